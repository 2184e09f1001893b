//! Fenced writes: a stale holder's transaction cannot commit after a newer holder
//! wrote.
//!
//! A [`FencingToken`] only protects a write if that write checks it. For writes to the
//! PostgreSQL database the application already uses, [`fence`] is that check: called
//! inside the caller's own transaction (any connection, a pooled one included), it
//! records the token for a *fence name* in one small table and fails if a greater
//! token is already recorded there. Every write the transaction makes then commits
//! only if no newer holder of the lock has written under the same fence name before
//! it.
//!
//! ```no_run
//! use chosen_core::{LockManager, ManagerOptions, fenced};
//!
//! # async fn demo(mut client: tokio_postgres::Client) -> Result<(), Box<dyn std::error::Error>> {
//! let manager = LockManager::connect(ManagerOptions::from_url("postgres://app@db/app")?).await?;
//! // `client`: any tokio-postgres client, e.g. a `deadpool_postgres` pooled one.
//! fenced::install(&client).await?; // once, at start-up: CREATE TABLE IF NOT EXISTS
//!
//! let lease = manager.acquire("nightly-report").await?;
//! let tx = client.transaction().await?;
//! // First in the transaction: fails with Error::StaleToken if a newer holder
//! // of "nightly-report" has already written.
//! fenced::fence(&tx, "nightly-report", lease.fencing_token().await?).await?;
//! // Or, the same with the lease's name and token, refused at once if this node
//! // already knows the lease is lost: lease.fence(&tx).await?;
//! tx.execute("INSERT INTO reports (day, body) VALUES (current_date, $1)", &[&"..."])
//!     .await?;
//! tx.commit().await?;
//! # Ok(())
//! # }
//! ```
//!
//! # The guarantee
//!
//! For one fence name, transactions that called [`fence`] and **committed** did so in
//! non-decreasing token order: once a transaction fenced with token *T* has committed,
//! no transaction fenced with a token below *T* commits afterwards, whatever its
//! timing. So a holder that was frozen past the server's release time, woke up and
//! still believes it holds the lock cannot commit a fenced transaction once the new
//! holder has committed one.
//!
//! How: [`fence`] is one statement,
//!
//! ```sql
//! INSERT INTO "chosen_fence" AS f (name, token) VALUES ($1, $2)
//! ON CONFLICT (name) DO UPDATE SET token = EXCLUDED.token, updated_at = now()
//! WHERE f.token <= EXCLUDED.token
//! RETURNING f.token
//! ```
//!
//! It takes the row lock of the fence name's row (or, for a first write, the unique
//! index entry) and **holds it until the transaction ends**. A second fenced
//! transaction on the same name waits for that lock; when the first commits, the
//! second checks its token against the *committed* value (an `ON CONFLICT DO UPDATE`
//! checks the latest row version, not its snapshot's; under `REPEATABLE READ` and
//! `SERIALIZABLE` it refuses instead, see below), and when the first rolls back, the
//! second goes on as if it had never run.
//!
//! * **A greater token recorded** (a newer holder committed, or committed while this
//!   transaction waited): [`Error::StaleToken`], naming both tokens. Before returning
//!   it, [`fence`] *aborts the transaction on the server* (it runs a statement that
//!   raises), so nothing this transaction wrote can commit, even if the error were
//!   ignored: later statements fail with `25P02`, and `COMMIT` rolls back (note that
//!   tokio-postgres' `Transaction::commit` then still returns `Ok`: propagate the
//!   error instead). Stop the guarded work: this process no longer holds the lock.
//! * **An equal token** (the same holder writing again, in this or a later
//!   transaction): succeeds; the row is rewritten, so the row lock is taken as for a
//!   greater token. Concurrent transactions of the same holder on the same name
//!   therefore run one after the other, too.
//! * **A smaller token recorded, or none**: succeeds and records this token.
//! * **A token of 2<sup>63</sup> or more**: [`Error::TokenOutOfRange`], before any
//!   statement. Tokens are stored as `bigint`; every token chosen issues fits, since
//!   a token is `timeline << 48 | xid` and a server on timeline 32,768 or later is
//!   refused (see [`FencingToken`]), so bit 63 is always clear.
//!
//! What it does **not** do:
//!
//! * It protects only writes made **in the same transaction** (and that commit with
//!   it). A write on another connection, or committed before the fence, is not
//!   guarded. Fence inside a savepoint and roll back to it, and the writes after the
//!   savepoint lose their protection with it.
//! * It orders holders **per fence name**: two names are two independent fences. Use
//!   the lock's name (what [`Lease::fence`](crate::Lease::fence) does) unless one lock
//!   guards several independent resources.
//! * It does not make a fenced transaction of the *current* holder wait for anything
//!   but other fenced transactions on the same name.
//!
//! Call [`fence`] **first** in the transaction, before the writes it guards: a stale
//! transaction then fails before it does any work, and a newer holder's transaction
//! never waits on row locks of a stale one's writes (writing first, then fencing, is
//! still safe, but two such transactions can deadlock; PostgreSQL then aborts one of
//! them, see below).
//!
//! # Isolation levels
//!
//! * **`READ COMMITTED`** (PostgreSQL's default): a fenced transaction that waited for
//!   another one on the same name goes on after that one ends, against its committed
//!   token: [`Error::StaleToken`] if it was greater, success otherwise.
//! * **`REPEATABLE READ`, `SERIALIZABLE`**: when the other transaction committed a
//!   change to the row after this transaction's snapshot was taken, PostgreSQL refuses
//!   with a serialization failure (`40001`) instead; [`fence`] maps it (and a deadlock,
//!   `40P01`) to [`Error::FenceConflict`], for which
//!   [`is_transient`](Error::is_transient) is `true`: roll back and run the whole
//!   transaction again (a stale holder then gets [`Error::StaleToken`]).
//!
//! # Cost
//!
//! One extra statement per fenced transaction (one round trip: it is sent parsed,
//! bound and executed at once, with no separate prepare), writing one row: a
//! new row version of a small table (an update that changes no indexed column, so a
//! HOT update), its WAL record, and a dead tuple that page pruning and autovacuum
//! reclaim. It adds no commit of its own: it commits with the caller's transaction.
//! And it serialises: fenced transactions on one name run one at a time, each holding
//! the row lock from [`fence`] to its commit, so keep fenced transactions short.
//! Measured in `BENCHMARKS.md` ("Fenced writes"). The stale path costs two more
//! statements (reading the recorded token for the error, and the aborting
//! statement).
//!
//! # The table
//!
//! [`install`] creates it (idempotently, safe to run from several nodes at once).
//! Teams that run their own migrations run [`INSTALL_SQL`] (or
//! [`FenceTable::install_sql`] for another table name) instead:
//!
//! ```sql
//! CREATE TABLE IF NOT EXISTS "chosen_fence" (
//!     name       text        PRIMARY KEY,
//!     token      bigint      NOT NULL CHECK (token >= 0),
//!     updated_at timestamptz NOT NULL DEFAULT now()
//! )
//! ```
//!
//! Rows are keyed by the fence name alone, not by the manager's
//! [`namespace`](crate::ManagerOptions::namespace): two applications that share a
//! database in different namespaces and both lock `jobs` hold two different locks,
//! but fence under one row, and the one with the older token gets
//! [`StaleToken`](crate::Error::StaleToken) while the other writes. Give such
//! applications distinct lock names, or their own table ([`FenceTable`]).
//!
//! One row per fence name, never deleted by chosen. The role that fences needs
//! `SELECT, INSERT, UPDATE` on it. Another name or schema:
//! [`FenceTable::new`]`("ops.chosen_fence")`.

use tokio_postgres::error::SqlState;
use tokio_postgres::types::Type;
use tokio_postgres::{Client, Transaction};

use crate::error::{Error, Result};
use crate::key::LockKey;
use crate::token::FencingToken;

/// The table name used unless another is configured.
pub const DEFAULT_TABLE: &str = "chosen_fence";

/// The greatest token a fence can record: tokens are stored as `bigint`.
pub const MAX_TOKEN: FencingToken = FencingToken::new(i64::MAX as u64);

/// The SQL that creates the default table (`"chosen_fence"` in the schema first on
/// the `search_path`), for teams that run their own migrations. What [`install`]
/// runs, under an advisory lock. Do not change: tables created by earlier versions
/// must keep working.
pub const INSTALL_SQL: &str = "CREATE TABLE IF NOT EXISTS \"chosen_fence\" (\n    name       text        PRIMARY KEY,\n    token      bigint      NOT NULL CHECK (token >= 0),\n    updated_at timestamptz NOT NULL DEFAULT now()\n)";

/// Raised on the server after a stale fence, so the transaction cannot commit.
const ABORT_SQL: &str = "DO $$BEGIN RAISE EXCEPTION 'chosen: stale fencing token: a newer holder has written under this fence name, so this transaction must not commit' USING HINT = 'roll back and stop: this process no longer holds the lock'; END$$";

/// Records `token` for fence name `name` inside transaction `tx`, in the default table
/// ([`DEFAULT_TABLE`]); fails if a greater token is already recorded. See the
/// [module docs](self) for the exact guarantee.
///
/// `tx` is any tokio-postgres transaction; a `deadpool_postgres::Transaction`
/// dereferences to one, so `fence(&tx, ..)` works with a pooled client too.
///
/// # Errors
///
/// * [`Error::StaleToken`]: a greater token is recorded for `name`; the transaction
///   has been aborted on the server and cannot commit.
/// * [`Error::FenceConflict`] (transient): under `REPEATABLE READ` or `SERIALIZABLE`,
///   a concurrent fenced transaction on `name` committed first, or a deadlock; retry
///   the whole transaction.
/// * [`Error::TokenOutOfRange`]: `token` is 2<sup>63</sup> or more.
/// * [`Error::InvalidName`]: `name` is empty or contains a NUL character.
/// * [`Error::FenceNotInstalled`]: the table does not exist (run [`install`]).
/// * [`Error::Fence`]: any other database error.
///
/// # Cancel safety
///
/// Not cancel safe: dropping the future may leave the statement executed or not, and
/// the row lock taken or not. Roll the transaction back (dropping a tokio-postgres
/// transaction does) and start again.
pub async fn fence(tx: &Transaction<'_>, name: &str, token: FencingToken) -> Result<()> {
    FenceTable::default().fence(tx, name, token).await
}

/// Creates the default table ([`DEFAULT_TABLE`]) if it does not exist: [`INSTALL_SQL`],
/// under a transaction-level advisory lock so that nodes installing at once do not
/// collide. Idempotent; needs the `CREATE` privilege on the schema.
///
/// Pass a client outside any transaction (a `deadpool_postgres::Client` dereferences
/// to one, so `install(&client)` works with a pooled client too).
///
/// # Errors
///
/// [`Error::Fence`] when the statement fails (no privilege, no such schema, lost
/// connection).
///
/// # Cancel safety
///
/// Cancel safe: the statements run as one implicit transaction, so a dropped future
/// either created the table or left nothing behind.
pub async fn install(client: &Client) -> Result<()> {
    FenceTable::default().install(client).await
}

/// A fence table: its (validated) name and the SQL that uses it.
///
/// ```
/// use chosen_core::fenced::FenceTable;
///
/// let table = FenceTable::new("ops.chosen_fence")?;
/// assert_eq!(table.name(), "ops.chosen_fence");
/// assert!(table.install_sql().starts_with("CREATE TABLE IF NOT EXISTS \"ops\".\"chosen_fence\""));
/// assert!(FenceTable::new("ops.Chosen Fence").is_err());
/// # Ok::<(), chosen_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FenceTable {
    /// As given, e.g. `ops.chosen_fence`.
    name: String,
    /// Quoted, e.g. `"ops"."chosen_fence"`.
    quoted: String,
}

impl Default for FenceTable {
    /// The table [`DEFAULT_TABLE`], in the schema first on the `search_path`.
    fn default() -> Self {
        Self {
            name: DEFAULT_TABLE.to_owned(),
            quoted: format!("\"{DEFAULT_TABLE}\""),
        }
    }
}

impl FenceTable {
    /// A fence table named `name`: `table` (in the schema first on the connection's
    /// `search_path`) or `schema.table`.
    ///
    /// Each part must be a lowercase SQL identifier: an ASCII letter or `_`, then
    /// letters, digits or `_`, at most 63 bytes (PostgreSQL would silently cut a
    /// longer one). The parts are always quoted in SQL, so reserved words work.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidTableName`], saying what is wrong.
    pub fn new(name: &str) -> Result<Self> {
        let parts: Vec<&str> = name.split('.').collect();
        if parts.len() > 2 {
            return Err(Error::InvalidTableName(format!(
                "{name:?} has {} dot-separated parts; use \"table\" or \"schema.table\"",
                parts.len()
            )));
        }
        for part in &parts {
            check_identifier(name, part)?;
        }
        let quoted = parts
            .iter()
            .map(|p| format!("\"{p}\""))
            .collect::<Vec<_>>()
            .join(".");
        Ok(Self {
            name: name.to_owned(),
            quoted,
        })
    }

    /// A fence table `table` in the schema `schema`, each any identifier PostgreSQL
    /// takes (capitals, spaces, quotes and all: they are quoted as written, with `"`
    /// doubled), not only the lowercase ones [`new`](Self::new) accepts: for a table
    /// found in the catalog (`pg_namespace.nspname`, `pg_class.relname`).
    ///
    /// ```
    /// use chosen_core::fenced::FenceTable;
    ///
    /// let table = FenceTable::in_schema("Ops Data", "chosen_fence")?;
    /// assert!(table.install_sql().starts_with("CREATE TABLE IF NOT EXISTS \"Ops Data\".\"chosen_fence\""));
    /// assert!(FenceTable::in_schema("", "chosen_fence").is_err());
    /// # Ok::<(), chosen_core::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::InvalidTableName`] for an empty part, one longer than 63 bytes, or
    /// one with a NUL character.
    pub fn in_schema(schema: &str, table: &str) -> Result<Self> {
        let name = format!("{schema}.{table}");
        for part in [schema, table] {
            let bad = |why: &str| Err(Error::InvalidTableName(format!("{name:?}: {why}")));
            if part.is_empty() {
                return bad("an empty part");
            }
            if part.len() > 63 {
                return bad(&format!(
                    "{part:?} is {} bytes long; PostgreSQL identifiers are at most 63",
                    part.len()
                ));
            }
            if part.contains('\0') {
                return bad(&format!("{part:?} contains a NUL character"));
            }
        }
        Ok(Self {
            quoted: format!("{}.{}", quote_identifier(schema), quote_identifier(table)),
            name,
        })
    }

    /// The table name as given (unquoted).
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The table as SQL names it: each part double-quoted.
    #[must_use]
    pub fn quoted(&self) -> &str {
        &self.quoted
    }

    /// The SQL that creates this table if it does not exist (what
    /// [`install`](Self::install) runs), for teams that run their own migrations.
    #[must_use]
    pub fn install_sql(&self) -> String {
        // Do not change the shape: tables created by earlier versions must keep working.
        format!(
            "CREATE TABLE IF NOT EXISTS {} (\n    name       text        PRIMARY KEY,\n    token      bigint      NOT NULL CHECK (token >= 0),\n    updated_at timestamptz NOT NULL DEFAULT now()\n)",
            self.quoted
        )
    }

    /// The statement [`fence`](Self::fence) runs: parameters `$1` the fence name
    /// (`text`) and `$2` the token (`bigint`); one row when the token was recorded,
    /// none when a greater one is recorded. For clients other than tokio-postgres,
    /// which must then abort the transaction themselves when it returns no row.
    #[must_use]
    pub fn fence_sql(&self) -> String {
        format!(
            "INSERT INTO {} AS f (name, token) VALUES ($1, $2)\nON CONFLICT (name) DO UPDATE SET token = EXCLUDED.token, updated_at = now()\nWHERE f.token <= EXCLUDED.token\nRETURNING f.token",
            self.quoted
        )
    }

    fn read_sql(&self) -> String {
        format!("SELECT token FROM {} WHERE name = $1", self.quoted)
    }

    /// Creates this table if it does not exist ([`install_sql`](Self::install_sql)),
    /// under a transaction-level advisory lock so that nodes installing at once do not
    /// collide (concurrent `CREATE TABLE IF NOT EXISTS` can otherwise fail with a
    /// unique violation in `pg_type`). Idempotent; needs the `CREATE` privilege on the
    /// schema, which must exist.
    ///
    /// # Errors
    ///
    /// [`Error::Fence`] when the statement fails.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: the statements run as one implicit transaction.
    pub async fn install(&self, client: &Client) -> Result<()> {
        // One multi-statement simple query runs as one implicit transaction, so the
        // transaction-level lock is held until the table is committed. One key for
        // every table: installs are rare and brief.
        let LockKey::Pair(k1, k2) = LockKey::derive("chosen.fenced", "install") else {
            unreachable!("BUG: derived keys are pairs")
        };
        let sql = format!(
            "SELECT pg_advisory_xact_lock({k1}, {k2});\n{}",
            self.install_sql()
        );
        let mut tries = 0;
        loop {
            tries += 1;
            match client.batch_execute(&sql).await {
                Ok(()) => return Ok(()),
                // Someone created the same table at the same time without the lock
                // (e.g. a migration tool): it exists now, so once more skips it.
                Err(e) if tries < 3 && is_duplicate(&e) => {}
                Err(source) => {
                    return Err(Error::Fence {
                        table: self.name.clone(),
                        source,
                    });
                }
            }
        }
    }

    /// Records `token` for fence name `name` inside transaction `tx`, in this table; see
    /// [`fence`](fn@fence) (which uses the default table) for errors and cancel safety,
    /// and the [module docs](self) for the guarantee.
    ///
    /// # Errors
    ///
    /// As [`fence`](fn@fence).
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe; roll the transaction back.
    pub async fn fence(&self, tx: &Transaction<'_>, name: &str, token: FencingToken) -> Result<()> {
        check_fence_name(name)?;
        let value = i64::try_from(token.get()).map_err(|_| Error::TokenOutOfRange(token))?;
        // Typed: parse, bind and execute in one round trip (no separate prepare).
        let recorded = tx
            .query_typed(
                &self.fence_sql(),
                &[(&name, Type::TEXT), (&value, Type::INT8)],
            )
            .await
            .map_err(|e| self.query_error(name, e))?;
        if !recorded.is_empty() {
            return Ok(());
        }
        // A greater token is recorded, and this transaction holds its row lock: read it
        // (a new snapshot under READ COMMITTED sees the committed value that refused
        // us), for the error.
        let recorded = tx
            .query_opt(&self.read_sql(), &[&name])
            .await
            .map_err(|e| self.query_error(name, e))?
            .and_then(|row| row.try_get::<_, i64>(0).ok())
            .and_then(|v| u64::try_from(v).ok())
            .map(FencingToken::new);
        // Make the transaction unable to commit, whatever the caller does with the
        // error. The statement fails by design.
        let _ = tx.batch_execute(ABORT_SQL).await;
        Err(Error::StaleToken {
            name: name.to_owned(),
            token,
            recorded,
        })
    }

    fn query_error(&self, name: &str, source: tokio_postgres::Error) -> Error {
        match source.code() {
            Some(code)
                if *code == SqlState::T_R_SERIALIZATION_FAILURE
                    || *code == SqlState::T_R_DEADLOCK_DETECTED =>
            {
                Error::FenceConflict {
                    name: name.to_owned(),
                    source,
                }
            }
            Some(code) if *code == SqlState::UNDEFINED_TABLE => Error::FenceNotInstalled {
                table: self.name.clone(),
                source,
            },
            _ => Error::Fence {
                table: self.name.clone(),
                source,
            },
        }
    }
}

fn is_duplicate(e: &tokio_postgres::Error) -> bool {
    e.code().is_some_and(|c| {
        *c == SqlState::UNIQUE_VIOLATION
            || *c == SqlState::DUPLICATE_TABLE
            || *c == SqlState::DUPLICATE_OBJECT
    })
}

/// `part` as a quoted SQL identifier (`"` doubled).
fn quote_identifier(part: &str) -> String {
    format!("\"{}\"", part.replace('"', "\"\""))
}

fn check_identifier(name: &str, part: &str) -> Result<()> {
    let bad = |why: &str| Err(Error::InvalidTableName(format!("{name:?}: {why}")));
    let Some(first) = part.chars().next() else {
        return bad("an empty part; use \"table\" or \"schema.table\"");
    };
    if part.len() > 63 {
        return bad(&format!(
            "{part:?} is {} bytes long; PostgreSQL identifiers are at most 63",
            part.len()
        ));
    }
    if !(first.is_ascii_lowercase() || first == '_') {
        return bad(&format!(
            "{part:?} must start with a lowercase ASCII letter or '_'"
        ));
    }
    if let Some(c) = part
        .chars()
        .find(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_'))
    {
        return bad(&format!(
            "{part:?} contains {c:?}; use lowercase ASCII letters, digits and '_' (PostgreSQL folds unquoted names to lowercase)"
        ));
    }
    Ok(())
}

pub(crate) fn check_fence_name(name: &str) -> Result<()> {
    crate::names::validate_name("the fence name", name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_table_s_sql_is_the_published_constant() {
        assert_eq!(FenceTable::default().install_sql(), INSTALL_SQL);
        assert_eq!(
            FenceTable::new(DEFAULT_TABLE).unwrap(),
            FenceTable::default()
        );
    }

    #[test]
    fn table_names_are_validated_and_quoted() {
        let t = FenceTable::new("ops.fence_2").unwrap();
        assert_eq!(t.quoted, "\"ops\".\"fence_2\"");
        assert!(
            t.fence_sql()
                .starts_with("INSERT INTO \"ops\".\"fence_2\" AS f")
        );
        // Reserved words are fine: always quoted.
        assert_eq!(FenceTable::new("user").unwrap().quoted, "\"user\"");
        assert!(FenceTable::new(&"a".repeat(63)).is_ok());
        for bad in [
            "",
            ".",
            "a.",
            ".a",
            "a.b.c",
            "Fence",
            "1fence",
            "fen ce",
            "fence\"; DROP TABLE x; --",
            "fe\0nce",
            "schéma.fence",
            &"a".repeat(64),
        ] {
            let err = FenceTable::new(bad).expect_err(bad);
            assert!(
                matches!(err, Error::InvalidTableName(_)),
                "{bad:?}: {err:?}"
            );
            assert!(
                err.to_string().starts_with("invalid fence table name"),
                "{err}"
            );
        }
    }

    #[test]
    fn fence_names_must_be_storable() {
        assert!(check_fence_name("job").is_ok());
        assert!(matches!(check_fence_name(""), Err(Error::InvalidName(_))));
        assert!(matches!(
            check_fence_name("a\0b"),
            Err(Error::InvalidName(_))
        ));
    }

    #[test]
    fn the_largest_token_fits_a_bigint() {
        assert_eq!(i64::try_from(MAX_TOKEN.get()), Ok(i64::MAX));
        // The largest token a served timeline can produce is below it.
        assert!(FencingToken::from_parts(32_767, u64::MAX) <= MAX_TOKEN);
        assert!(FencingToken::from_parts(32_768, 0) > MAX_TOKEN);
    }
}
