//! chosen-core's modules form layers: no module uses, directly or through others, a
//! module that uses it. Value types live in leaf files (`token`, `names`, `info`,
//! `generation`, `command`, `fault`), so the handles, the task and the session import
//! one way. Reads the crate's own sources; test code (the test-only `sim` module too)
//! and comments do not count.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Every top-level module of `src` and the top-level modules its non-test code names
/// as `crate::<module>`.
fn edges(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut files = Vec::new();
    let mut dirs = vec![src.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("the crate's src is readable") {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                files.push(path);
            }
        }
    }
    let is_module = |name: &str| src.join(format!("{name}.rs")).exists() || src.join(name).is_dir();
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in files {
        let rel = file.strip_prefix(src).expect("below src");
        let parts: Vec<String> = rel
            .with_extension("")
            .iter()
            .map(|p| p.to_string_lossy().into_owned())
            .collect();
        let top = parts[0].clone();
        let leaf = parts.last().expect("a file name").as_str();
        // `sim` is a test-only module (`#[cfg(test)] mod sim;`): test code.
        if top == "lib" || top == "sim" || (parts.len() > 1 && matches!(leaf, "tests" | "sim")) {
            continue;
        }
        let text = std::fs::read_to_string(&file).expect("a readable source file");
        let code = match text.find("#[cfg(test)]\nmod ") {
            Some(at) => &text[..at],
            None => &text[..],
        };
        let deps = out.entry(top.clone()).or_default();
        for line in code.lines().filter(|l| !l.trim_start().starts_with("//")) {
            for (at, _) in line.match_indices("crate::") {
                let name: String = line[at + "crate::".len()..]
                    .chars()
                    .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                    .collect();
                // (The test-only `sim` switches some rules read under `#[cfg(test)]`.)
                if !name.is_empty() && name != top && name != "sim" && is_module(&name) {
                    deps.insert(name);
                }
            }
        }
    }
    out
}

/// A cycle through `from`, as the path of modules, if there is one.
fn cycle_through(edges: &BTreeMap<String, BTreeSet<String>>, from: &str) -> Option<Vec<String>> {
    let mut stack = vec![(from.to_owned(), vec![from.to_owned()])];
    let mut seen = BTreeSet::new();
    while let Some((at, path)) = stack.pop() {
        for next in edges.get(&at).into_iter().flatten() {
            if next == from {
                let mut cycle = path.clone();
                cycle.push(next.clone());
                return Some(cycle);
            }
            if seen.insert(next.clone()) {
                let mut longer = path.clone();
                longer.push(next.clone());
                stack.push((next.clone(), longer));
            }
        }
    }
    None
}

#[test]
fn chosen_core_has_no_import_cycle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let edges = edges(&src);
    assert!(edges.len() > 10, "found too few modules: {edges:?}");
    let cycles: Vec<String> = edges
        .keys()
        .filter_map(|m| cycle_through(&edges, m))
        .map(|c| c.join(" -> "))
        .collect();
    assert!(cycles.is_empty(), "import cycles:\n{}", cycles.join("\n"));
}

#[test]
fn the_value_leaves_depend_on_no_behaviour() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let edges = edges(&src);
    let values: BTreeSet<&str> = [
        "key",
        "token",
        "status",
        "error",
        "names",
        "info",
        "generation",
    ]
    .into_iter()
    .collect();
    for leaf in &values {
        let deps = edges.get(*leaf).cloned().unwrap_or_default();
        let outside: Vec<&String> = deps
            .iter()
            .filter(|d| !values.contains(d.as_str()))
            .collect();
        assert!(
            outside.is_empty(),
            "the value module {leaf} uses {outside:?}, which are not values"
        );
    }
}
