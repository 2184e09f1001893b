//! The error type of chosen-core.

use std::time::Duration;

use crate::status::SessionDownReason;
use crate::token::FencingToken;

/// A `Result` whose error defaults to [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in chosen-core.
///
/// Contention is not an error: [`LockManager::try_acquire`](crate::LockManager::try_acquire)
/// answers `Ok(None)` when another session holds the lock.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The options are invalid.
    #[error("invalid chosen configuration ({setting}): {message}")]
    InvalidConfig {
        /// The setting at fault, as its builder method is named
        /// (`"ManagerOptions::lease_timeout"`, `"SingletonOptions::poll_interval"`), or,
        /// for a connection parameter of the URL or `tokio_postgres::Config`,
        /// `"connection settings: <parameter>"` (`host`, `user`, `sslmode`); for a rule
        /// between several settings, the one the message suggests changing first.
        setting: &'static str,
        /// What is wrong: the value, the bound or rule it breaks, and the fix.
        message: String,
    },

    /// The connection string could not be parsed.
    #[error("invalid PostgreSQL connection string: {message}")]
    InvalidUrl {
        /// What was wrong, with the password never included.
        message: String,
    },

    /// The server answered in a way chosen does not expect (a probe returned no row):
    /// something between chosen and PostgreSQL (a proxy or pooler) rewrote the
    /// conversation, or this is a bug in chosen; please report it with the message.
    #[error(
        "unexpected answer from the server: {message}; is a proxy or pooler rewriting queries? if not, report a bug"
    )]
    Protocol {
        /// What was unexpected.
        message: String,
    },

    /// The server could not be reached or refused the connection.
    #[error(
        "could not connect to PostgreSQL ({target}); check that the server runs and accepts TCP connections there"
    )]
    Connect {
        /// Hosts and ports that were tried (no credentials).
        target: String,
        /// The underlying error.
        #[source]
        source: tokio_postgres::Error,
    },

    /// The server rejected the credentials.
    #[error(
        "PostgreSQL rejected the login of user {user:?} ({target}); check the user name and password"
    )]
    Authentication {
        /// The user name that was tried.
        user: String,
        /// Hosts and ports that were tried.
        target: String,
        /// The underlying error.
        #[source]
        source: tokio_postgres::Error,
    },

    /// The server is not one chosen can safely hold locks on (standby, too old, pooler).
    #[error("refusing to hold locks on this server: {0}")]
    Refused(SessionDownReason),

    /// A query on the lock session failed (the session itself is still fine, e.g. the
    /// server's lock table is full). Requests made with
    /// [`acquire`](crate::LockManager::acquire) are retried instead.
    #[error("query on the lock session failed")]
    Database(#[source] std::sync::Arc<tokio_postgres::Error>),

    /// Connecting and proving the session took longer than the connect timeout.
    #[error(
        "connecting to PostgreSQL ({target}) did not finish within {after:?}; check that the host is reachable, or raise ManagerOptions::connect_timeout"
    )]
    ConnectTimeout {
        /// Hosts and ports that were tried.
        target: String,
        /// The time allowed.
        after: Duration,
    },

    /// The lock session is down right now; requests made with
    /// [`acquire`](crate::LockManager::acquire) wait for it instead.
    #[error("the lock session is not connected ({0}); try again once it reconnects")]
    NotConnected(SessionDownReason),

    /// The manager already tracks as many locks as
    /// [`ManagerOptions::max_locks`](crate::ManagerOptions::max_locks) allows. Release
    /// some, or raise the limit after checking the server's lock table capacity: every
    /// held lock takes an entry of a table shared by the whole server
    /// (`max_locks_per_transaction × (max_connections + max_prepared_transactions)`
    /// entries), and other sessions' queries fail once it is full.
    #[error(
        "this manager already holds or waits for {limit} locks (ManagerOptions::max_locks): release some or raise the limit"
    )]
    TooManyLocks {
        /// The configured limit.
        limit: usize,
    },

    /// A lock, group, member or fence name is not usable (empty, with a NUL character,
    /// a lock name beginning with the reserved `chosen.` or named as a raw key's lease
    /// is, `key(a, b)`; a group name with `/`); the message says which.
    #[error("invalid name: {0}")]
    InvalidName(String),

    /// The poll interval of a request is outside the accepted range.
    #[error("poll interval {0:?} is out of range: use between 10 ms and 1 hour")]
    InvalidPollInterval(Duration),

    /// The manager has shut down (or its task ended); create a new one.
    #[error("the lock manager has shut down")]
    Closed,

    /// A fenced write ([`fenced::fence`](crate::fenced::fence)) found a greater token
    /// already recorded for its fence name: a newer holder of the lock has written.
    /// The transaction has been aborted on the server and cannot commit; roll it back
    /// and stop the guarded work, this process no longer holds the lock.
    #[error(
        "fencing token {token} for {name:?} is stale (a newer holder recorded {}): roll back and stop the guarded work",
        recorded_text(.recorded.as_ref())
    )]
    StaleToken {
        /// The fence name.
        name: String,
        /// The token this transaction tried to record.
        token: FencingToken,
        /// The greater token already recorded (`None` only if it could not be read
        /// back, which the row lock held by the transaction rules out).
        recorded: Option<FencingToken>,
    },

    /// A fenced write conflicted with a concurrent transaction on the same fence name:
    /// a serialization failure (`40001`, under `REPEATABLE READ` or `SERIALIZABLE`) or a
    /// deadlock (`40P01`). The transaction is aborted; run it again from the start.
    #[error(
        "fenced write for {name:?} conflicted with a concurrent transaction (serialization failure or deadlock); roll back and run the whole transaction again"
    )]
    FenceConflict {
        /// The fence name.
        name: String,
        /// The underlying error.
        #[source]
        source: tokio_postgres::Error,
    },

    /// A fencing token too large to record: fences store tokens as `bigint`, so they
    /// must be below 2<sup>63</sup>. Every token chosen issues is, so this one was made
    /// by hand.
    #[error(
        "fencing token {0} is above 2^63 - 1, the largest a fence stores: pass a token chosen issued"
    )]
    TokenOutOfRange(FencingToken),

    /// The fence table name is not usable.
    #[error("invalid fence table name: {0}")]
    InvalidTableName(String),

    /// The fence table does not exist: create it with
    /// [`fenced::install`](crate::fenced::install) (or
    /// [`FenceTable::install`](crate::fenced::FenceTable::install)), or run its SQL
    /// ([`fenced::INSTALL_SQL`](crate::fenced::INSTALL_SQL),
    /// [`FenceTable::install_sql`](crate::fenced::FenceTable::install_sql)) in a migration.
    #[error(
        "the fence table {table} does not exist: run chosen_core::fenced::install, or its SQL in a migration"
    )]
    FenceNotInstalled {
        /// The table name.
        table: String,
        /// The underlying error.
        #[source]
        source: tokio_postgres::Error,
    },

    /// A statement of a fenced write, or of installing the fence table, failed.
    #[error("fenced write statement on table {table} failed")]
    Fence {
        /// The table name.
        table: String,
        /// The underlying error.
        #[source]
        source: tokio_postgres::Error,
    },

    /// A fenced write through a lease or leader context that is known to be lost
    /// already; no statement was sent. Roll back: another node may hold the lock.
    #[error("the lease is no longer valid ({0}): roll back, another node may hold the lock")]
    LeaseLost(SessionDownReason),

    /// The statement that issues a lease's fencing token failed while the lease is still
    /// held (the server logged why); nothing was issued. Call
    /// [`Lease::fencing_token`](crate::Lease::fencing_token) again.
    #[error(
        "the fencing token could not be issued (the statement failed; the lease is still held): try again"
    )]
    TokenNotIssued,

    /// A read through the application's connection pool (an `Observer`, feature
    /// `deadpool`) failed: the pool gave no connection (exhausted, or it cannot
    /// connect), no answer came within the read timeout, or the pool reaches a standby.
    #[error("the read through the connection pool failed: {message}")]
    Pool {
        /// What the pool reported.
        message: String,
    },
}

impl Error {
    /// An [`Error::InvalidConfig`] for `setting`.
    pub(crate) fn config(setting: &'static str, message: impl Into<String>) -> Self {
        Self::InvalidConfig {
            setting,
            message: message.into(),
        }
    }
}

fn recorded_text(recorded: Option<&FencingToken>) -> String {
    recorded.map_or_else(|| "a greater token".to_owned(), ToString::to_string)
}

impl Error {
    /// `true` when the same call may succeed later without any change on your side: the
    /// server could not be reached, did not answer in time, or the session is between
    /// connections (e.g. the database is restarting or failing over), or a fenced
    /// write conflicted with a concurrent transaction ([`Error::FenceConflict`]: run the
    /// transaction again). `false` for bad configuration or input, refused logins or
    /// servers, limits, a shut-down manager, and a stale fencing token.
    ///
    /// ```
    /// # async fn demo(options: chosen_core::ManagerOptions) -> chosen_core::Result<()> {
    /// use chosen_core::LockManager;
    /// let manager = loop {
    ///     match LockManager::connect(options.clone()).await {
    ///         Ok(manager) => break manager,
    ///         Err(e) if e.is_transient() => tokio::time::sleep(std::time::Duration::from_secs(1)).await,
    ///         Err(e) => return Err(e),
    ///     }
    /// };
    /// # drop(manager); Ok(()) }
    /// ```
    #[must_use]
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Connect { .. }
            | Self::ConnectTimeout { .. }
            | Self::NotConnected(_)
            | Self::FenceConflict { .. }
            | Self::TokenNotIssued
            | Self::Pool { .. } => true,
            Self::Database(e) => e.is_closed(),
            Self::Fence { source, .. } => source.is_closed(),
            // A standby may be promoted in a moment, a fenced primary opened again.
            Self::Refused(reason) => matches!(
                reason,
                SessionDownReason::ServerInRecovery | SessionDownReason::ServerReadOnly
            ),
            Self::InvalidConfig { .. }
            | Self::InvalidUrl { .. }
            | Self::Protocol { .. }
            | Self::Authentication { .. }
            | Self::TooManyLocks { .. }
            | Self::InvalidName(_)
            | Self::InvalidPollInterval(_)
            | Self::Closed
            | Self::StaleToken { .. }
            | Self::TokenOutOfRange(_)
            | Self::InvalidTableName(_)
            | Self::FenceNotInstalled { .. }
            | Self::LeaseLost(_) => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every message is one line that says what was wrong and what to do; the longer
    /// explanation lives in the variant's docs.
    #[test]
    fn every_error_reads_in_one_line() {
        let reasons = [
            SessionDownReason::ConnectionLost {
                message: "connection reset by peer".into(),
            },
            SessionDownReason::HeartbeatOverdue {
                lease_timeout: Duration::from_secs(5),
            },
            SessionDownReason::ServerInRecovery,
            SessionDownReason::ServerReadOnly,
            SessionDownReason::BackendChanged {
                expected: 4242,
                found: 4343,
            },
            SessionDownReason::PoolerDetected {
                detail: "the session carried another client's settings".into(),
            },
            SessionDownReason::AdvisoryLocksUnsafe {
                detail: "a key held by pid 10 was also granted to pid 11".into(),
            },
            SessionDownReason::ServerTooOld { version: 130_010 },
            SessionDownReason::ConnectFailed {
                message: "connection refused".into(),
            },
            SessionDownReason::Shutdown,
        ];
        let token = FencingToken::new(281_474_976_711_381);
        let mut errors = vec![
            Error::config(
                "ManagerOptions::lease_timeout",
                "lease_timeout 0ns must be more than zero",
            ),
            Error::InvalidUrl {
                message: "invalid port".into(),
            },
            Error::Protocol {
                message: "no row".into(),
            },
            Error::TooManyLocks { limit: 4096 },
            Error::InvalidName("lock name \"\" is empty".into()),
            Error::InvalidPollInterval(Duration::from_millis(1)),
            Error::Closed,
            Error::StaleToken {
                name: "billing-run".into(),
                token,
                recorded: Some(FencingToken::new(281_474_976_711_999)),
            },
            Error::TokenOutOfRange(FencingToken::new(u64::MAX)),
            Error::InvalidTableName("\"a.b.c\": too many dots".into()),
            Error::TokenNotIssued,
            Error::Pool {
                message:
                    "no connection: timed out waiting for one; check the pool's size and the server"
                        .into(),
            },
        ];
        for reason in reasons {
            errors.push(Error::Refused(reason.clone()));
            errors.push(Error::NotConnected(reason.clone()));
            errors.push(Error::LeaseLost(reason));
        }
        for error in errors {
            let text = error.to_string();
            assert!(!text.contains('\n'), "one line: {text}");
            assert!(
                text.len() <= 240,
                "{} chars, at most 240: {text}",
                text.len()
            );
        }
    }
}
