//! The one dedicated connection to PostgreSQL: it performs and decides nothing. The
//! statement texts ([`sql`]), opening and proving a session ([`connect`](mod@connect)), the
//! statements ([`statements`]) and carrying out a plan ([`perform`]); how errors are
//! classified is [`fault`](crate::fault). A session on PostgreSQL is a [`Session`] whose
//! link is a [`PgLink`]; only the manager's task uses one.

mod connect;
mod perform;
mod sql;
mod statements;

use std::sync::Arc;
use tokio::task::JoinHandle;
use tokio_postgres::{Client, Statement};

use crate::backend::{Backend, BoxFuture, HeartbeatLink, Link};
pub(crate) use crate::backend::{ConnEvent, HolderAnswer, Session};
use crate::engine::{Done, Term};
use crate::error::Result;
use crate::fault::{Fault, classify, error_text};
use crate::info::HolderInfo;
use crate::key::{LockKey, SessionLock};
use crate::options::ManagerOptions;
use crate::status::SessionDownReason;
use crate::table::Plan;

pub(crate) use connect::connect;
#[cfg(feature = "deadpool")]
pub(crate) use connect::read_term;
#[cfg(test)]
pub(crate) use connect::tcp_user_timeout;
#[cfg(test)]
pub(crate) use sql::{ANNOUNCEMENTS_PER_NOTIFY, UNLOCK_SQL_FOR_TESTS};
#[cfg(feature = "test-util")]
pub(crate) use sql::{TRY_ONE_SQL, UNLOCK_ONE_SQL};

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

/// A session on PostgreSQL: one dedicated connection, its prepared statements, and the
/// task that polls the connection.
pub(crate) struct PgLink {
    /// Shared with the heartbeat task; tokio-postgres pipelines their queries.
    pub(crate) client: Arc<Client>,
    pub(crate) stmts: Statements,
    pub(crate) backend_pid: i32,
    /// The value of `chosen.session` on our backend.
    pub(crate) marker: String,
    /// `oid` of the current database.
    pub(crate) database_oid: i64,
    /// The server's current term as primary.
    pub(crate) term: Term,
    conn_task: JoinHandle<()>,
}

impl Drop for PgLink {
    fn drop(&mut self) {
        // Dropping the connection closes the socket; the server then ends the backend
        // and releases its locks.
        self.conn_task.abort();
    }
}

impl Link for PgLink {
    fn perform<'a>(
        &'a self,
        plan: &'a Plan,
    ) -> BoxFuture<'a, Result<(Done, Option<tokio_postgres::Error>), Fault>> {
        Box::pin(self.perform_plan(plan))
    }

    fn holders<'a>(
        &'a self,
        keys: &'a [LockKey],
    ) -> BoxFuture<'a, Result<Vec<HolderAnswer>, Fault>> {
        Box::pin(self.look_up_holders(keys))
    }

    fn cluster(&self) -> BoxFuture<'_, Result<Vec<(LockKey, HolderInfo)>, Fault>> {
        Box::pin(self.look_up_cluster())
    }

    fn reset(&self) -> BoxFuture<'_, Result<(), Fault>> {
        Box::pin(self.reset_session())
    }

    fn heartbeat_link(&self) -> Box<dyn HeartbeatLink> {
        Box::new(HeartbeatSession {
            client: Arc::clone(&self.client),
            statement: self.stmts.heartbeat.clone(),
            backend_pid: self.backend_pid,
            marker: self.marker.clone(),
        })
    }

    fn is_closed(&self) -> bool {
        self.client.is_closed()
    }
}

/// PostgreSQL, the backend that ships: [`connect()`].
#[derive(Debug, Default)]
pub(crate) struct PgBackend {
    /// The identity of the server the exclusion self-test last passed on.
    proven: std::sync::Mutex<Option<String>>,
}

impl Backend for PgBackend {
    fn connect<'a>(
        &'a self,
        options: &'a ManagerOptions,
        generation: u64,
    ) -> BoxFuture<'a, Result<Session>> {
        Box::pin(connect(options, generation, &self.proven))
    }

    fn forget_proven(&self) {
        *self
            .proven
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = None;
    }
}

/// What the heartbeat task needs of the session.
struct HeartbeatSession {
    client: Arc<Client>,
    statement: Statement,
    backend_pid: i32,
    marker: String,
}

impl HeartbeatLink for HeartbeatSession {
    fn heartbeat(&self) -> BoxFuture<'_, Result<Vec<SessionLock>, SessionDownReason>> {
        Box::pin(self.prove())
    }
}

impl HeartbeatSession {
    /// Proves the session is still ours and writable; answers the advisory locks the
    /// server shows on it (those of a form this manager never takes left out).
    async fn prove(&self) -> Result<Vec<SessionLock>, SessionDownReason> {
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
