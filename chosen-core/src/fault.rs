//! What a failed statement on the lock session means: the session lost, or one
//! statement failed on a session that is fine.

use tokio_postgres::error::SqlState;

use crate::error::Error;
use crate::status::SessionDownReason;

/// A classified failure of a query on the session.
#[derive(Debug)]
pub(crate) enum Fault {
    /// The session can no longer be trusted: end the generation.
    Lost(SessionDownReason),
    /// The statement failed but the session is fine (e.g. lock table full).
    Query(tokio_postgres::Error),
}

pub(crate) fn classify(error: tokio_postgres::Error) -> Fault {
    let fatal = match error.code() {
        None => true,
        Some(code) if *code == SqlState::READ_ONLY_SQL_TRANSACTION => {
            return Fault::Lost(SessionDownReason::ServerInRecovery);
        }
        Some(code) => {
            let c = code.code();
            c.starts_with("08") // connection exception
                || c.starts_with("57P") // admin/crash shutdown, cannot connect now, idle session timeout
                || c == "25P03" // idle_in_transaction_session_timeout ended the session
                || c == "25P04" // transaction_timeout (PostgreSQL 17) ended the session
                || c.starts_with("XX") // internal error
        }
    };
    if fatal || error.is_closed() {
        Fault::Lost(SessionDownReason::ConnectionLost {
            message: error_text(&error),
        })
    } else {
        Fault::Query(error)
    }
}

/// The error with its database message, if any (tokio-postgres' Display of a
/// database error is only "db error").
pub(crate) fn error_text(error: &tokio_postgres::Error) -> String {
    match error.as_db_error() {
        Some(db) => format!("{} ({})", db.message(), db.code().code()),
        None => error.to_string(),
    }
}

impl Error {
    /// A failed statement on the lock session: a lost session is
    /// [`NotConnected`](Self::NotConnected) (or [`Refused`](Self::Refused) when the
    /// server turned read-only), anything else [`Database`](Self::Database).
    pub(crate) fn database(error: tokio_postgres::Error) -> Self {
        match classify(error) {
            Fault::Lost(
                reason @ (SessionDownReason::ServerInRecovery | SessionDownReason::ServerReadOnly),
            ) => Self::Refused(reason),
            Fault::Lost(reason) => Self::NotConnected(reason),
            Fault::Query(e) => Self::Database(std::sync::Arc::new(e)),
        }
    }
}
