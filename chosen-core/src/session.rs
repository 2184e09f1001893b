//! The one dedicated connection: connect, session settings, prepared statements, and
//! how errors on it are classified. Only the manager's task uses a [`Session`].

use std::sync::Arc;
use std::time::Instant;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_postgres::error::SqlState;
use tokio_postgres::{AsyncMessage, Client, NoTls, Statement};
use tracing::debug;

use crate::error::{Error, Result};
use crate::options::ManagerOptions;
use crate::status::DisconnectReason;

/// The channel graceful releases are announced on (payload: up to 200 key tags, see
/// `LockKey::tag`, joined by commas).
/// Seen by operators and other versions: do not change.
pub(crate) const RELEASE_CHANNEL: &str = "chosen_release";

/// The oldest server supported: `idle_session_timeout` appeared in PostgreSQL 14.
const MIN_SERVER_VERSION: i32 = 140_000;

// Statement texts. They show up in pg_stat_statements and pg_stat_activity, so keep
// them stable.

/// The custom setting that marks a backend as ours. A fresh backend has none; a
/// transaction pooler that shares backends between clients shows another one's.
pub(crate) const MARKER_SETTING: &str = "chosen.session";

const PROBE_SQL: &str = "SELECT current_setting('server_version_num')::int4, pg_backend_pid(), pg_is_in_recovery(), coalesce(current_setting('chosen.session', true), ''), (SELECT count(*) FROM pg_lock_status() l WHERE l.locktype = 'advisory' AND l.pid = pg_backend_pid()), (SELECT oid FROM pg_database WHERE datname = current_database())::int8";

const HEARTBEAT_SQL: &str = "SELECT pg_backend_pid(), pg_is_in_recovery(), coalesce(current_setting('chosen.session', true), '')";

/// One statement for every due key. A transaction id (the fencing token) is assigned
/// only when a lock was won: the CASE evaluates `pg_current_xact_id()` only then, so
/// failed polls burn no transaction ids. Locks are only tried on our own marked
/// backend: behind a transaction pooler the statement returns no rows instead.
const ACQUIRE_SQL: &str = "SELECT k.i, CASE WHEN CASE WHEN k.big IS NULL THEN pg_try_advisory_lock(k.a, k.b) ELSE pg_try_advisory_lock(k.big) END THEN pg_current_xact_id()::text::int8 END FROM unnest($1::int4[], $2::int4[], $3::int8[]) WITH ORDINALITY AS k(a, b, big, i) WHERE pg_backend_pid() = $4 AND current_setting('chosen.session', true) = $5";

/// The single-key forms of the two statements above, for the common uncontended case
/// (no arrays to build or unnest). Same semantics, same guards.
const ACQUIRE_ONE_SQL: &str = "SELECT CASE WHEN CASE WHEN $3::int8 IS NULL THEN pg_try_advisory_lock($1::int4, $2::int4) ELSE pg_try_advisory_lock($3::int8) END THEN pg_current_xact_id()::text::int8 END WHERE pg_backend_pid() = $4 AND current_setting('chosen.session', true) = $5";

const RELEASE_ONE_SQL: &str = "SELECT CASE WHEN $3::int8 IS NULL THEN pg_advisory_unlock($1::int4, $2::int4) ELSE pg_advisory_unlock($3::int8) END, pg_notify('chosen_release', $4)::text";

/// Unlocks and announces: one notification per 200 keys (tags joined by commas, well
/// under the 8,000-byte payload limit), delivered at commit, after the unlocks. The
/// uncorrelated sub-select runs the notifications once per statement.
const RELEASE_SQL: &str = "WITH n AS (SELECT pg_notify('chosen_release', string_agg(t.tag, ',' ORDER BY t.j)) FROM unnest($4::text[]) WITH ORDINALITY AS t(tag, j) GROUP BY (t.j - 1) / 200) SELECT k.i, CASE WHEN k.big IS NULL THEN pg_advisory_unlock(k.a, k.b) ELSE pg_advisory_unlock(k.big) END, (SELECT count(*) FROM n) FROM unnest($1::int4[], $2::int4[], $3::int8[]) WITH ORDINALITY AS k(a, b, big, i)";

/// After a failed acquire statement some of its locks may have been taken (session
/// locks survive the statement's error): unlock those the lock table shows we hold.
/// It reads `pg_lock_status()` directly, not the `pg_locks` view, and gets the
/// database oid as a parameter, so it needs no relation lock: it runs when the lock
/// table is full.
const CLEANUP_SQL: &str = "SELECT CASE WHEN k.big IS NULL THEN pg_advisory_unlock(k.a, k.b) ELSE pg_advisory_unlock(k.big) END FROM unnest($1::int4[], $2::int4[], $3::int8[]) AS k(a, b, big) WHERE EXISTS (SELECT 1 FROM pg_lock_status() l WHERE l.locktype = 'advisory' AND l.pid = pg_backend_pid() AND l.granted AND l.database = $4::int8::oid AND CASE WHEN k.big IS NULL THEN l.objsubid = 2 AND l.classid = k.a::oid AND l.objid = k.b::oid ELSE l.objsubid = 1 AND l.classid = (k.big >> 32)::oid AND l.objid = (k.big & 4294967295)::oid END)";

/// Who holds a key: the node id is the holder session's `application_name`.
const HOLDER_SQL: &str = "SELECT a.application_name, a.pid, host(a.client_addr), a.backend_start FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid WHERE l.locktype = 'advisory' AND l.granted AND l.database = $1::int8::oid AND l.classid::int8 = $2 AND l.objid::int8 = $3 AND l.objsubid = $4::int2";

/// Every advisory lock held in this database, with its holder session.
const CLUSTER_SQL: &str = "SELECT l.classid::int8, l.objid::int8, l.objsubid::int4, a.application_name, a.pid, host(a.client_addr), a.backend_start FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid WHERE l.locktype = 'advisory' AND l.granted AND l.database = $1::int8::oid ORDER BY a.application_name, l.classid, l.objid";

/// A new fencing token for a local handoff (the session keeps the lock).
const TOKEN_SQL: &str = "SELECT pg_current_xact_id()::text::int8";

/// What the connection task reports.
#[derive(Debug)]
pub(crate) enum ConnEvent {
    Notification(String),
    Closed(String),
}

/// Shared by every lease of one generation: revoked all at once.
#[derive(Debug)]
pub(crate) struct Generation {
    pub(crate) id: u64,
    pub(crate) revoked: tokio_util::sync::CancellationToken,
    pub(crate) reason: std::sync::OnceLock<DisconnectReason>,
}

impl Generation {
    pub(crate) fn new(id: u64) -> Arc<Self> {
        Arc::new(Self {
            id,
            revoked: tokio_util::sync::CancellationToken::new(),
            reason: std::sync::OnceLock::new(),
        })
    }

    pub(crate) fn revoke(&self, reason: DisconnectReason) {
        let _ = self.reason.set(reason);
        self.revoked.cancel();
    }
}

pub(crate) struct Statements {
    pub(crate) heartbeat: Statement,
    pub(crate) acquire: Statement,
    pub(crate) release: Statement,
    pub(crate) cleanup: Statement,
    pub(crate) token: Statement,
    pub(crate) holder: Statement,
    pub(crate) cluster: Statement,
    pub(crate) acquire_one: Statement,
    pub(crate) release_one: Statement,
}

pub(crate) struct Session {
    pub(crate) client: Client,
    pub(crate) stmts: Statements,
    pub(crate) backend_pid: i32,
    /// The value of `chosen.session` on our backend.
    pub(crate) marker: String,
    /// `oid` of the current database.
    pub(crate) database_oid: i64,
    pub(crate) generation: Arc<Generation>,
    pub(crate) events: mpsc::UnboundedReceiver<ConnEvent>,
    /// When the setup query that proved the session was sent.
    pub(crate) proven_at: Instant,
    conn_task: JoinHandle<()>,
}

impl Drop for Session {
    fn drop(&mut self) {
        // Dropping the connection closes the socket; the server then ends the backend
        // and releases its locks.
        self.conn_task.abort();
    }
}

/// A classified failure of a query on the session.
#[derive(Debug)]
pub(crate) enum Fault {
    /// The session can no longer be trusted: end the generation.
    Lost(DisconnectReason),
    /// The statement failed but the session is fine (e.g. lock table full).
    Query(tokio_postgres::Error),
}

pub(crate) fn classify(error: tokio_postgres::Error) -> Fault {
    let fatal = match error.code() {
        None => true,
        Some(code) if *code == SqlState::READ_ONLY_SQL_TRANSACTION => {
            return Fault::Lost(DisconnectReason::ServerInRecovery);
        }
        Some(code) => {
            let c = code.code();
            c.starts_with("08") // connection exception
                || c.starts_with("57P") // admin/crash shutdown, cannot connect now, idle session timeout
                || c.starts_with("XX") // internal error
        }
    };
    if fatal || error.is_closed() {
        Fault::Lost(DisconnectReason::ConnectionLost {
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

/// The settings that make the server end a silent session in bounded time, and keep a
/// DBA's defaults from breaking the contract.
fn setup_sql(options: &ManagerOptions) -> String {
    let release_ms = options.server_release_after.as_millis();
    // Keepalives and tcp_user_timeout are a second line for a real partition; they must
    // never release *earlier* than server_release_after, so they start at that point.
    let keepalive_idle_s = options.server_release_after.as_secs().max(1);
    format!(
        "SET idle_session_timeout = {release_ms}; \
         SET tcp_keepalives_idle = {keepalive_idle_s}; \
         SET tcp_keepalives_interval = 1; \
         SET tcp_keepalives_count = 3; \
         SET tcp_user_timeout = {release_ms}; \
         SET client_connection_check_interval = 1000; \
         LISTEN {RELEASE_CHANNEL};"
    )
}

/// Opens and proves a new session.
pub(crate) async fn connect(options: &ManagerOptions, generation: u64) -> Result<Session> {
    let timeout = options.connect_timeout * (options.pg.get_hosts().len().max(1) as u32 + 1);
    match tokio::time::timeout(timeout, connect_inner(options, generation)).await {
        Ok(result) => result,
        Err(_) => Err(Error::ConnectTimeout {
            target: options.target_description(),
            after: timeout,
        }),
    }
}

async fn connect_inner(options: &ManagerOptions, generation: u64) -> Result<Session> {
    let config = options.session_config();
    let connect_error = |source: tokio_postgres::Error| {
        let auth = matches!(
            source.code(),
            Some(c) if *c == SqlState::INVALID_PASSWORD
                || *c == SqlState::INVALID_AUTHORIZATION_SPECIFICATION
        );
        if auth {
            Error::Authentication {
                user: options.pg.get_user().unwrap_or_default().to_owned(),
                target: options.target_description(),
                source,
            }
        } else {
            Error::Connect {
                target: options.target_description(),
                source,
            }
        }
    };
    #[cfg(feature = "rustls")]
    if let Some(tls) = &options.tls {
        let tls = tokio_postgres_rustls::MakeRustlsConnect::new(rustls::ClientConfig::clone(tls));
        let (client, connection) = config.connect(tls).await.map_err(connect_error)?;
        return prove(options, generation, client, connection).await;
    }
    let (client, connection) = config.connect(NoTls).await.map_err(connect_error)?;
    prove(options, generation, client, connection).await
}

/// Drives the connection on its own task and proves the session is one we may hold
/// locks on.
async fn prove<S, T>(
    options: &ManagerOptions,
    generation: u64,
    client: Client,
    mut connection: tokio_postgres::Connection<S, T>,
) -> Result<Session>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (events_tx, events) = mpsc::unbounded_channel();
    let conn_task = tokio::spawn(async move {
        let end = loop {
            match std::future::poll_fn(|cx| connection.poll_message(cx)).await {
                Some(Ok(AsyncMessage::Notification(n))) => {
                    let _ = events_tx.send(ConnEvent::Notification(n.payload().to_owned()));
                }
                Some(Ok(AsyncMessage::Notice(notice))) => {
                    debug!(message = notice.message(), "notice on the lock session");
                }
                Some(Ok(_)) => {}
                Some(Err(e)) => break error_text(&e),
                None => break "the server closed the connection".to_owned(),
            }
        };
        let _ = events_tx.send(ConnEvent::Closed(end));
    });
    // From here on, dropping `guard` (on any error) closes the connection.
    let guard = AbortOnDrop(Some(conn_task));
    let proven_at = Instant::now();
    // A DBA's statement_timeout could cancel even the probe: override it in the same
    // round trip, first (these settings exist on every server version).
    let messages = client
        .simple_query(&format!(
            "SET statement_timeout = {}; SET lock_timeout = 0; SET idle_in_transaction_session_timeout = 0; {PROBE_SQL}",
            options.lease_timeout.as_millis()
        ))
        .await
        .map_err(Error::database)?;
    let row = messages
        .iter()
        .find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(row) => Some(row),
            _ => None,
        })
        .ok_or_else(|| Error::InvalidUrl {
            message: "the server answered the session probe with no row".to_owned(),
        })?;
    let field = |i: usize| row.get(i).unwrap_or_default();
    let version: i32 = field(0).parse().unwrap_or(0);
    let backend_pid: i32 = field(1).parse().unwrap_or(0);
    let in_recovery = field(2) == "t";
    let found_marker = field(3).to_owned();
    let advisory_locks: i64 = field(4).parse().unwrap_or(0);
    let database_oid: i64 = field(5).parse().unwrap_or(0);
    if version < MIN_SERVER_VERSION {
        return Err(Error::Refused(DisconnectReason::ServerTooOld { version }));
    }
    if in_recovery {
        return Err(Error::Refused(DisconnectReason::ServerInRecovery));
    }
    if !found_marker.is_empty() || advisory_locks > 0 {
        return Err(Error::Refused(DisconnectReason::PoolerDetected {
            detail: format!(
                "the new session's backend (pid {backend_pid}) already carries another session's state ({} advisory locks{})",
                advisory_locks,
                if found_marker.is_empty() {
                    ""
                } else {
                    ", another chosen marker"
                }
            ),
        }));
    }
    let marker = new_marker(options, generation);
    client
        .batch_execute(&format!(
            "{} SELECT set_config('{MARKER_SETTING}', '{marker}', false);",
            setup_sql(options)
        ))
        .await
        .map_err(Error::database)?;
    let stmts = Statements::prepare(&client)
        .await
        .map_err(Error::database)?;
    Ok(Session {
        client,
        stmts,
        backend_pid,
        marker,
        database_oid,
        generation: Generation::new(generation),
        events,
        proven_at,
        conn_task: guard.disarm(),
    })
}

struct AbortOnDrop(Option<JoinHandle<()>>);

impl AbortOnDrop {
    fn disarm(mut self) -> JoinHandle<()> {
        self.0.take().expect("BUG: disarmed twice")
    }
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if let Some(task) = &self.0 {
            task.abort();
        }
    }
}

impl Statements {
    async fn prepare(client: &Client) -> Result<Self, tokio_postgres::Error> {
        // Prepared concurrently: tokio-postgres pipelines them in one round trip.
        let (
            heartbeat,
            acquire,
            release,
            cleanup,
            token,
            holder,
            cluster,
            acquire_one,
            release_one,
        ) = tokio::try_join!(
            client.prepare(HEARTBEAT_SQL),
            client.prepare(ACQUIRE_SQL),
            client.prepare(RELEASE_SQL),
            client.prepare(CLEANUP_SQL),
            client.prepare(TOKEN_SQL),
            client.prepare(HOLDER_SQL),
            client.prepare(CLUSTER_SQL),
            client.prepare(ACQUIRE_ONE_SQL),
            client.prepare(RELEASE_ONE_SQL),
        )?;
        Ok(Self {
            heartbeat,
            acquire,
            release,
            cleanup,
            token,
            holder,
            cluster,
            acquire_one,
            release_one,
        })
    }
}

/// A value unique to this session: the node, the process, the generation and the time.
/// Only `[A-Za-z0-9._-]`, so it can be inlined in SQL.
fn new_marker(options: &ManagerOptions, generation: u64) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let node: String = options
        .node_id
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .take(32)
        .collect();
    format!("{node}.{}.{generation}.{nanos:x}", std::process::id())
}

impl Error {
    pub(crate) fn database(error: tokio_postgres::Error) -> Self {
        match classify(error) {
            Fault::Lost(reason @ DisconnectReason::ServerInRecovery) => Self::Refused(reason),
            Fault::Lost(reason) => Self::NotConnected(reason),
            Fault::Query(e) => Self::Database(Arc::new(e)),
        }
    }
}
