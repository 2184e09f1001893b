//! The tables' SQL that the READMEs and the API docs print, for teams that run their own
//! migrations, is exactly the SQL the libraries install: a copy that lacks a column
//! (a table created from it would make every tick `Skipped(Ledger)`) fails here.

use std::path::Path;

/// Every `CREATE TABLE IF NOT EXISTS "<table>"` block in `file` (doc-comment prefixes
/// removed), up to its closing `)` line.
fn blocks(file: &str, table: &str) -> Vec<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(file);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let head = format!("CREATE TABLE IF NOT EXISTS \"{table}\" (");
    let mut out = Vec::new();
    let mut lines = text.lines().map(|l| {
        let t = l.trim_start();
        t.strip_prefix("//! ")
            .or_else(|| t.strip_prefix("/// "))
            .or_else(|| t.strip_prefix("//!"))
            .or_else(|| t.strip_prefix("///"))
            .unwrap_or(l)
            .to_owned()
    });
    while let Some(line) = lines.next() {
        if line != head {
            continue;
        }
        let mut block = vec![line];
        for next in lines.by_ref() {
            let end = next == ")";
            block.push(next);
            if end {
                break;
            }
        }
        out.push(block.join("\n"));
    }
    out
}

fn assert_copies(table: &str, sql: &str, files: &[&str]) {
    for file in files {
        let found = blocks(file, table);
        assert!(
            !found.is_empty(),
            "{file} no longer prints the {table} table"
        );
        for block in found {
            assert_eq!(
                block, sql,
                "{file} prints a {table} table other than the one the library installs"
            );
        }
    }
}

#[test]
fn the_printed_ledger_table_is_the_one_installed() {
    assert_copies(
        "chosen_ticks",
        chosen_apalis::LEDGER_INSTALL_SQL,
        &["chosen-apalis/README.md", "chosen-apalis/src/ledger.rs"],
    );
}

#[test]
fn the_printed_fence_table_is_the_one_installed() {
    assert_copies(
        "chosen_fence",
        chosen_core::fenced::INSTALL_SQL,
        &["chosen-core/src/fenced.rs"],
    );
}
