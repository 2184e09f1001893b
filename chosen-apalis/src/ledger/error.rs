//! What can go wrong with the tick ledger.

/// An error from the tick ledger.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LedgerError {
    /// The fence refused this transaction or failed: chosen-core's error, e.g.
    /// [`chosen_core::Error::StaleToken`] when a newer leader has written (this node no
    /// longer leads: stop), or [`chosen_core::Error::FenceNotInstalled`] (run
    /// [`TickLedger::install`](crate::TickLedger::install)).
    #[error(transparent)]
    Fence(#[from] chosen_core::Error),
    /// The ledger table does not exist.
    #[error(
        "the tick ledger table {table:?} does not exist: run TickLedger::install at start-up, or its install_sql() in your migrations"
    )]
    NotInstalled {
        /// The table name.
        table: String,
        /// The server's error.
        #[source]
        source: tokio_postgres::Error,
    },
    /// A ledger statement failed (lost connection, missing privilege, ...).
    #[error("tick ledger: {action} failed")]
    Database {
        /// What was being done.
        action: &'static str,
        /// The server's or the connection's error.
        #[source]
        source: tokio_postgres::Error,
    },
    /// A ledger operation did not finish within the ledger's timeout
    /// ([`TickLedger::timeout`](crate::TickLedger::timeout)): the database is slow or
    /// unreachable, or a row lock is held by another session (a former leader frozen
    /// inside its transaction).
    #[error("tick ledger: {action} took longer than {after:?}")]
    Timeout {
        /// What was being done.
        action: &'static str,
        /// How long it was given.
        after: std::time::Duration,
    },
    /// The pool gave no connection.
    #[error("tick ledger: no connection from the pool")]
    Pool(#[source] deadpool_postgres::PoolError),
    /// A tick more than [`TickLedger::clock_tolerance`](crate::TickLedger::clock_tolerance)
    /// ahead of the database's clock: not due yet, so not claimed nor recorded. The
    /// gate holds early ticks until they are due, so this means the database's clock
    /// went back meanwhile, or a tick was claimed by hand too early.
    #[error(
        "tick ledger: the tick is {early:?} ahead of the database's clock, more than the tolerance ({tolerance:?}): not due yet"
    )]
    NotDue {
        /// The tick's scheduled time.
        tick: std::time::SystemTime,
        /// How far ahead of the database's clock it is.
        early: std::time::Duration,
        /// The ledger's clock tolerance.
        tolerance: std::time::Duration,
    },
    /// The server answered something a ledger statement cannot have answered (no row,
    /// a NULL): a bug in chosen, or something between it and the server.
    #[error("tick ledger: unexpected answer from the server: {0}")]
    Unexpected(&'static str),
    /// A ledger table name that is not `table` or `schema.table` in lowercase SQL
    /// identifiers.
    #[error("invalid tick ledger table name: {0}")]
    InvalidTableName(String),
}

impl LedgerError {
    /// `true` when this node must stop: a newer leader has written under the job's
    /// fence, so nothing this node does for the job may commit.
    #[must_use]
    pub fn is_stale(&self) -> bool {
        matches!(self, Self::Fence(chosen_core::Error::StaleToken { .. }))
    }
}

/// The error and its sources on one line, for logs and skip reasons.
pub(crate) fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}
