//! The one dedicated connection to PostgreSQL: it performs and decides nothing. The
//! statement texts ([`sql`]), opening and proving a session ([`connect`](mod@connect)), the
//! statements ([`statements`]) and carrying out a plan ([`perform`]); how errors are
//! classified is [`fault`](crate::fault). Only the manager's task uses a [`Session`].

mod connect;
mod perform;
mod sql;
mod statements;

use std::sync::Arc;
use std::time::Instant;

use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_postgres::{Client, Statement};

use crate::engine::Term;
use crate::error::Result;
use crate::fault::{Fault, classify, error_text};
use crate::generation::Generation;
use crate::key::{LockKey, SessionLock};
use crate::status::SessionDownReason;

pub(crate) use connect::connect;
#[cfg(test)]
pub(crate) use connect::tcp_user_timeout;
#[cfg(test)]
pub(crate) use sql::{ANNOUNCEMENTS_PER_NOTIFY, UNLOCK_SQL_FOR_TESTS};
#[cfg(feature = "test-util")]
pub(crate) use sql::{TRY_ONE_SQL, UNLOCK_ONE_SQL};

/// What the connection task reports.
#[derive(Debug)]
pub(crate) enum ConnEvent {
    /// A release announcement: the sender's backend pid (stamped by the server), the
    /// payload (key tags joined by commas), and when it arrived (the task reads it
    /// between steps, possibly after a slow try answered: an announcement vouches only
    /// for a win answered within the grace of its arrival).
    Notification {
        sender: i32,
        payload: String,
        at: Instant,
    },
    Closed(String),
}

pub(crate) struct Statements {
    pub(crate) heartbeat: Statement,
    try_keys: Statement,
    try_one: Statement,
    unlock: Statement,
    unlock_one: Statement,
    check_fences: Statement,
    fence: Statement,
    unfence: Statement,
    unlock_shared: Statement,
    fences_held: Statement,
    cleanup: Statement,
    token: Statement,
    holders: Statement,
    cluster: Statement,
}

pub(crate) struct Session {
    /// Shared with the heartbeat task; tokio-postgres pipelines their queries.
    pub(crate) client: Arc<Client>,
    pub(crate) stmts: Statements,
    pub(crate) backend_pid: i32,
    /// The value of `chosen.session` on our backend.
    pub(crate) marker: String,
    /// `oid` of the current database.
    pub(crate) database_oid: i64,
    /// The server's address and port as it sees this connection (`inet_server_addr()`,
    /// `inet_server_port()`), empty over a Unix socket: which host of a multi-host URL
    /// the session is on.
    pub(crate) server: String,
    pub(crate) generation: Arc<Generation>,
    pub(crate) events: mpsc::UnboundedReceiver<ConnEvent>,
    /// When the setup query that proved the session was sent.
    pub(crate) proven_at: Instant,
    /// The server's current term as primary.
    pub(crate) term: Term,
    conn_task: JoinHandle<()>,
}

impl Drop for Session {
    fn drop(&mut self) {
        // Dropping the connection closes the socket; the server then ends the backend
        // and releases its locks.
        self.conn_task.abort();
    }
}

/// What the heartbeat task needs of the session.
pub(crate) struct HeartbeatSession {
    client: Arc<Client>,
    statement: Statement,
    backend_pid: i32,
    marker: String,
}

impl HeartbeatSession {
    /// Proves the session is still ours and writable; answers the advisory locks the
    /// server shows on it (those of a form this manager never takes left out).
    pub(crate) async fn heartbeat(&self) -> Result<Vec<SessionLock>, SessionDownReason> {
        let lost = |message: String| SessionDownReason::ConnectionLost { message };
        let row = match self.client.query_one(&self.statement, &[]).await {
            Ok(row) => row,
            Err(e) => {
                return Err(match classify(e) {
                    Fault::Lost(reason) => reason,
                    Fault::Query(e) => lost(format!("heartbeat failed: {}", error_text(&e))),
                });
            }
        };
        let parsed = (|| {
            Ok::<_, tokio_postgres::Error>((
                row.try_get::<_, Option<i32>>(0)?,
                row.try_get::<_, Option<bool>>(1)?,
                row.try_get::<_, Option<String>>(2)?,
                row.try_get::<_, Option<Vec<i64>>>(3)?,
                row.try_get::<_, Option<Vec<i32>>>(4)?,
                row.try_get::<_, Option<bool>>(5)?,
            ))
        })();
        let (Some(pid), Some(in_recovery), Some(marker), Some(keys), Some(kinds), Some(read_only)) =
            parsed.map_err(|e| lost(format!("heartbeat answered an odd row: {e}")))?
        else {
            return Err(lost("heartbeat answered NULL".to_owned()));
        };
        if keys.len() != kinds.len() {
            return Err(lost(format!(
                "heartbeat answered {} locks but {} modes",
                keys.len(),
                kinds.len()
            )));
        }
        let locks = keys
            .iter()
            .zip(&kinds)
            .filter_map(|(&k, &kind)| {
                let key = match kind >> 1 {
                    2 => LockKey::Pair((k >> 32) as i32, k as i32),
                    1 => LockKey::Int(k),
                    // Not a form this manager takes: it cannot be one of its locks.
                    _ => return None,
                };
                Some(SessionLock {
                    key,
                    exclusive: kind & 1 == 1,
                })
            })
            .collect();
        if pid == self.backend_pid && marker != self.marker {
            return Err(SessionDownReason::PoolerDetected {
                detail: "another client changed this session's marker: the backend is shared"
                    .to_owned(),
            });
        }
        if pid != self.backend_pid {
            return Err(SessionDownReason::BackendChanged {
                expected: self.backend_pid,
                found: pid,
            });
        }
        if in_recovery {
            return Err(SessionDownReason::ServerInRecovery);
        }
        if read_only {
            return Err(SessionDownReason::ServerReadOnly);
        }
        Ok(locks)
    }
}
