//! Following who holds locks without a lock session: an [`Observer`] reads the holders
//! of every name it watches through the application's own connection pool, in one
//! statement per poll.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use tokio::sync::Notify;
use tracing::{debug, warn};

use crate::error::{Error, Result};
use crate::info::HolderInfo;
use crate::key::{DEFAULT_NAMESPACE, LockKey};
use crate::leadership::Leadership;
use crate::metrics::MetricsSink;
use crate::names::{RESERVED_PREFIX, validate_lock_name};
use crate::task::AbortOnDrop;

/// How an [`Observer`] reads: which namespace its names are in, how often it looks,
/// who it is, where its metrics go.
#[derive(Clone)]
pub struct ObserverOptions {
    namespace: String,
    node_id: String,
    poll_interval: Duration,
    read_timeout: Duration,
    lease_rows: bool,
    lease_schema: String,
    metrics: Option<Arc<dyn MetricsSink>>,
}

impl std::fmt::Debug for ObserverOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ObserverOptions")
            .field("namespace", &self.namespace)
            .field("node_id", &self.node_id)
            .field("poll_interval", &self.poll_interval)
            .field("read_timeout", &self.read_timeout)
            .field("lease_rows", &self.lease_rows)
            .field("lease_schema", &self.lease_schema)
            .field("metrics", &self.metrics.is_some())
            .finish()
    }
}

impl Default for ObserverOptions {
    fn default() -> Self {
        Self {
            namespace: DEFAULT_NAMESPACE.to_owned(),
            node_id: format!("{}-observer", crate::options::default_node_id()),
            poll_interval: Duration::from_secs(1),
            read_timeout: Duration::from_secs(5),
            lease_rows: false,
            lease_schema: "public".to_owned(),
            metrics: None,
        }
    }
}

impl ObserverOptions {
    /// The namespace the watched names' keys are derived in: the one the managers that
    /// hold them use (default [`DEFAULT_NAMESPACE`]).
    #[must_use]
    pub fn namespace(mut self, namespace: impl Into<String>) -> Self {
        self.namespace = namespace.into();
        self
    }

    /// The observer's own id, as its metrics label it (default
    /// `<hostname>-<pid>-observer`, apart from a manager's default in the same process).
    #[must_use]
    pub fn node_id(mut self, node_id: impl Into<String>) -> Self {
        self.node_id = node_id.into();
        self
    }

    /// How often the holders are read (default 1 s; 10 ms to an hour). A change of
    /// leader is seen within it.
    #[must_use]
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = interval;
        self
    }

    /// How long one read may take, the wait for a connection of the pool included
    /// (default 5 s; at least 10 ms): past it, the read failed, and the observer shows
    /// nobody leading until a read succeeds (a black-holed connection or an exhausted
    /// pool never leaves a stale leader showing).
    #[must_use]
    pub fn read_timeout(mut self, timeout: Duration) -> Self {
        self.read_timeout = timeout;
        self
    }

    /// Reads the holders of the lease-row mode (managers made with
    /// [`LockManager::connect_pooled`](crate::LockManager::connect_pooled)): their live
    /// rows of `chosen_lease`, instead of the server's advisory locks (default: off).
    #[must_use]
    pub fn lease_rows(mut self, lease_rows: bool) -> Self {
        self.lease_rows = lease_rows;
        self
    }

    /// The schema of the lease rows (default `public`; see
    /// [`ManagerOptions::lease_schema`](crate::ManagerOptions::lease_schema)).
    #[must_use]
    pub fn lease_schema(mut self, schema: impl Into<String>) -> Self {
        self.lease_schema = schema.into();
        self
    }

    /// Whether the lease rows are read (see [`lease_rows`](Self::lease_rows)).
    #[must_use]
    pub fn get_lease_rows(&self) -> bool {
        self.lease_rows
    }

    /// The namespace (see [`namespace`](Self::namespace)).
    #[must_use]
    pub fn get_namespace(&self) -> &str {
        &self.namespace
    }

    /// The observer's id (see [`node_id`](Self::node_id)).
    #[must_use]
    pub fn get_node_id(&self) -> &str {
        &self.node_id
    }

    /// The poll interval (see [`poll_interval`](Self::poll_interval)).
    #[must_use]
    pub fn get_poll_interval(&self) -> Duration {
        self.poll_interval
    }

    /// The read timeout (see [`read_timeout`](Self::read_timeout)).
    #[must_use]
    pub fn get_read_timeout(&self) -> Duration {
        self.read_timeout
    }

    /// Reports what the observer sees (the seconds without a leader and the changes of
    /// leader, per name) to `sink`, as a manager's followers do.
    #[must_use]
    pub fn metrics(mut self, sink: Arc<dyn MetricsSink>) -> Self {
        self.metrics = Some(sink);
        self
    }
}

/// Who leads each watched name, read through the application's connection pool: for
/// a replica that only needs to know who leads (a tower layer that redirects to the
/// leader, a dashboard, a replica that may never lead) and should not hold a lock
/// session of its own.
///
/// One statement per poll reads the holders of every name watched, on any connection
/// of the pool, through a transaction pooler too (PgBouncer `pool_mode=transaction`): it
/// only reads the server's lock table. The pool must reach the primary the managers hold
/// their locks on (a standby's lock table does not show them: the observer refuses
/// one, and reports nobody leading while the pool answers from one).
///
/// Each [`watch`](Self::watch) gives a [`Leadership`] that is always
/// [`Following`](crate::LeaderState::Following): its
/// [`leader`](Leadership::leader) is the node id of the session holding the name (the
/// manager's `node_id`), `None` when nobody holds it or the holders could not be read.
/// Like a follower's view, it is a snapshot: by the time it is read, the leader may
/// have changed. Never use it to decide that *this* process may act: only a lease does.
///
/// Dropping every clone of the observer stops its polling.
///
/// ```no_run
/// # async fn run(pool: deadpool_postgres::Pool) -> chosen_core::Result<()> {
/// use chosen_core::{Observer, ObserverOptions};
///
/// let observer = Observer::new(pool, ObserverOptions::default())?;
/// let reports = observer.watch("nightly-report")?;
/// println!("the leader is {:?}", reports.leader());
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Observer {
    shared: Arc<Shared>,
    _task: Arc<AbortOnDrop>,
}

impl std::fmt::Debug for Observer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Observer")
            .field("options", &self.shared.options)
            .field("watched", &self.shared.watched().len())
            .finish_non_exhaustive()
    }
}

struct Shared {
    pool: deadpool_postgres::Pool,
    options: ObserverOptions,
    /// Every name watched, by key.
    watched: Mutex<BTreeMap<LockKey, Leadership>>,
    /// Woken by a new watch: its first reading is not a poll away.
    wake: Notify,
}

impl Shared {
    fn watched(&self) -> std::sync::MutexGuard<'_, BTreeMap<LockKey, Leadership>> {
        self.watched.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Observer {
    /// An observer reading through `pool`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] when the options are out of range (a reserved
    /// namespace, a poll interval outside 10 ms to an hour, a read timeout below
    /// 10 ms) or this is called outside a tokio runtime.
    pub fn new(pool: deadpool_postgres::Pool, options: ObserverOptions) -> Result<Self> {
        if options.namespace.contains('\0') || options.namespace.starts_with(RESERVED_PREFIX) {
            return Err(Error::config(
                "ObserverOptions::namespace",
                format!(
                    "namespace {:?} contains a NUL character or begins with {RESERVED_PREFIX:?} (reserved); use the namespace of the managers that hold the locks",
                    options.namespace
                ),
            ));
        }
        let range = Duration::from_millis(10)..=Duration::from_secs(3600);
        if !range.contains(&options.poll_interval) {
            return Err(Error::config(
                "ObserverOptions::poll_interval",
                format!(
                    "poll_interval {:?} is outside 10ms..=1h; pick one in that range",
                    options.poll_interval
                ),
            ));
        }
        if options.read_timeout < Duration::from_millis(10) {
            return Err(Error::config(
                "ObserverOptions::read_timeout",
                format!(
                    "read_timeout {:?} is below 10ms; allow a read more time",
                    options.read_timeout
                ),
            ));
        }
        if !crate::options::is_plain_identifier(&options.lease_schema) {
            return Err(Error::config(
                "ObserverOptions::lease_schema",
                format!(
                    "lease_schema {:?} is not a plain identifier: use a letter or _, then letters, digits or _, at most 63 bytes",
                    options.lease_schema
                ),
            ));
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return Err(Error::config(
                "Observer::new",
                "called outside a tokio runtime; call it from within one",
            ));
        };
        let shared = Arc::new(Shared {
            pool,
            options,
            watched: Mutex::new(BTreeMap::new()),
            wake: Notify::new(),
        });
        let task = runtime.spawn(poll(Arc::clone(&shared)));
        Ok(Self {
            shared,
            _task: Arc::new(AbortOnDrop::new(task)),
        })
    }

    /// Who leads `name`, kept up to date from now on (every poll interval) while the
    /// observer lives and a clone of the handle is kept; when the last clone of the
    /// observer is dropped, the handle turns [`Stopped`](crate::LeaderState::Stopped).
    /// Watching a name twice gives the same handle, at no cost.
    ///
    /// The handle only ever *follows*: its [`is_leader`](Leadership::is_leader) is
    /// always `false`, its [`fencing_token`](Leadership::fencing_token) `None`, and its
    /// [`wait_leading`](Leadership::wait_leading) never ends. Use it to find the
    /// leader, never to decide that this process may act: only a lease does.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidName`] for an empty name, or one reserved for the library's own
    /// locks.
    pub fn watch(&self, name: &str) -> Result<Leadership> {
        validate_lock_name(name, false)?;
        let key = LockKey::derive(&self.shared.options.namespace, name);
        let mut watched = self.shared.watched();
        if let Some(leadership) = watched.get(&key) {
            return Ok(leadership.clone());
        }
        let leadership = Leadership::new(
            name,
            Some(&self.shared.options.namespace),
            &self.shared.options.node_id,
            self.shared.options.metrics.clone(),
        );
        watched.insert(key, leadership.clone());
        drop(watched);
        // Its first reading is not a poll away.
        self.shared.wake.notify_one();
        Ok(leadership)
    }

    /// Who holds each of `names` now, in one statement on a connection of the pool
    /// (`None`: nobody).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidName`] for a bad name; [`Error::Pool`] when the pool gives no
    /// connection, the read takes longer than the read timeout, or the pool's server is
    /// a standby; [`Error::Database`] when the statement fails.
    pub async fn holders(&self, names: &[&str]) -> Result<Vec<Option<HolderInfo>>> {
        if names.is_empty() {
            return Ok(Vec::new());
        }
        let mut keys = Vec::with_capacity(names.len());
        for name in names {
            validate_lock_name(name, false)?;
            keys.push(LockKey::derive(&self.shared.options.namespace, name));
        }
        read_holders(&self.shared.pool, &self.shared.options, &keys).await
    }
}

impl Drop for Shared {
    /// The polling has ended (the last clone of the observer is gone): the handles it
    /// kept up to date say so.
    fn drop(&mut self) {
        for leadership in self.watched().values() {
            leadership.set_stopped();
        }
    }
}

/// The observer's polling: every interval (at once after a new watch), one statement
/// for every name watched; aborted when the last clone of the observer is dropped.
async fn poll(s: Arc<Shared>) {
    let mut failing = false;
    loop {
        let watched: Vec<(LockKey, Leadership)> = {
            let mut watched = s.watched();
            // A name nobody keeps a handle of any more is read no more.
            watched.retain(|_, l| l.handles() > 1);
            watched.iter().map(|(k, l)| (*k, l.clone())).collect()
        };
        if !watched.is_empty() {
            let keys: Vec<LockKey> = watched.iter().map(|(k, _)| *k).collect();
            match read_holders(&s.pool, &s.options, &keys).await {
                Ok(holders) => {
                    if failing {
                        debug!("the observer reads the holders again");
                        failing = false;
                    }
                    for ((_, leadership), holder) in watched.iter().zip(holders) {
                        match holder {
                            None => leadership.set_following(None),
                            // Held by a session whose name the server did not show
                            // (it just ended, or another role's): no leader to name.
                            Some(h) if h.node_id.is_empty() => leadership.set_unknown(),
                            Some(h) => leadership.set_following(Some(h.node_id)),
                        }
                    }
                }
                Err(e) => {
                    if !failing {
                        warn!(error = %e, "the observer could not read the holders; it reports nobody leading until it can");
                        failing = true;
                    }
                    for (_, leadership) in &watched {
                        leadership.set_unknown();
                    }
                }
            }
        }
        drop(watched);
        tokio::select! {
            () = tokio::time::sleep(s.options.poll_interval) => {}
            () = s.wake.notified() => {}
        }
    }
}

/// Who holds each of `keys` exclusively, in one statement on a connection of `pool`,
/// within `timeout` (the wait for the connection included).
async fn read_holders(
    pool: &deadpool_postgres::Pool,
    options: &ObserverOptions,
    keys: &[LockKey],
) -> Result<Vec<Option<HolderInfo>>> {
    let timeout = options.read_timeout;
    let statement = if options.lease_rows {
        crate::rows::observer_sql(&options.lease_schema, keys)
    } else {
        holders_sql(keys)
    };
    let no_connection = |message: String| Error::Pool {
        message: format!("no connection: {message}"),
    };
    // One deadline for the wait for a connection and the statement together.
    let deadline = tokio::time::Instant::now() + timeout;
    let client = tokio::time::timeout_at(deadline, pool.get())
        .await
        .map_err(|_| no_connection(format!("none within the read timeout of {timeout:?}")))?
        .map_err(|e| no_connection(crate::rows::pool_error_text(&e)))?;
    // A simple query with the keys inlined (numbers only): no prepared statement, which
    // a transaction pooler may not carry between its backends.
    match tokio::time::timeout_at(deadline, client.simple_query(&statement)).await {
        Ok(Ok(answer)) => parse_holders(&answer, keys.len()),
        Ok(Err(e)) => {
            // Not given back when it was inside a transaction (an application's, left
            // open: the lease-row read refuses it), which the failure may have left
            // aborted; a plain failure (missing tables, a privilege) leaves it clean.
            let text = crate::fault::error_text(&e);
            let in_transaction = text.contains(crate::rows::IN_TRANSACTION)
                || e.code().is_some_and(|c| c.code().starts_with("25"));
            if in_transaction || e.is_closed() {
                drop(deadpool_postgres::Object::take(client));
            }
            if text.contains(crate::rows::IN_TRANSACTION) {
                return Err(Error::Pool {
                    message: "a connection of the pool was inside an open transaction (its last user gave it back without COMMIT or ROLLBACK); it was closed".to_owned(),
                });
            }
            Err(Error::database(e))
        }
        Err(_) => {
            // Not given back to the application's pool with a statement in flight
            // (a black-holed connection would stall its next user): closed.
            drop(deadpool_postgres::Object::take(client));
            Err(Error::Pool {
                message: format!("no answer within the read timeout of {timeout:?}"),
            })
        }
    }
}

/// The statement [`read_holders`] runs: a first row (`i = 0`) saying whether the
/// server is a standby, then a row per key held (`i` from 1, in the order of `keys`).
fn holders_sql(keys: &[LockKey]) -> String {
    let mut classids = Vec::with_capacity(keys.len());
    let mut objids = Vec::with_capacity(keys.len());
    let mut subids = Vec::with_capacity(keys.len());
    for key in keys {
        let (c, o, s) = key.pg_locks_columns();
        classids.push(c.to_string());
        objids.push(o.to_string());
        subids.push(s.to_string());
    }
    format!(
        "SELECT 0::int8, pg_is_in_recovery()::text, NULL::int4, NULL::text, NULL::int8 \
         UNION ALL \
         SELECT k.i, a.application_name, l.pid, host(a.client_addr), (extract(epoch FROM a.backend_start) * 1000000)::int8 \
         FROM unnest('{{{}}}'::int8[], '{{{}}}'::int8[], '{{{}}}'::int2[]) WITH ORDINALITY AS k(classid, objid, objsubid, i) \
         JOIN pg_locks l \
           ON l.locktype = 'advisory' AND l.granted AND l.mode = 'ExclusiveLock' AND l.pid IS NOT NULL \
          AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
          AND l.classid::int8 = k.classid AND l.objid::int8 = k.objid AND l.objsubid = k.objsubid \
         LEFT JOIN pg_stat_activity a ON a.pid = l.pid",
        classids.join(","),
        objids.join(","),
        subids.join(","),
    )
}

fn parse_holders(
    messages: &[tokio_postgres::SimpleQueryMessage],
    count: usize,
) -> Result<Vec<Option<HolderInfo>>> {
    let mut out: Vec<Option<HolderInfo>> = vec![None; count];
    let mut standby = None;
    for message in messages {
        let tokio_postgres::SimpleQueryMessage::Row(row) = message else {
            continue;
        };
        let Some(i) = row
            .try_get(0)
            .ok()
            .flatten()
            .and_then(|i| i.parse::<usize>().ok())
        else {
            continue;
        };
        if i == 0 {
            standby = Some(row.try_get(1).ok().flatten() == Some("true"));
            continue;
        }
        let Some(entry) = out.get_mut(i - 1) else {
            continue;
        };
        if entry.is_none() {
            *entry = Some(HolderInfo {
                node_id: row.try_get(1).ok().flatten().unwrap_or_default().to_owned(),
                backend_pid: row
                    .try_get(2)
                    .ok()
                    .flatten()
                    .and_then(|p| p.parse().ok())
                    .unwrap_or(0),
                client_addr: row.try_get(3).ok().flatten().map(str::to_owned),
                session_start: row
                    .try_get(4)
                    .ok()
                    .flatten()
                    .and_then(|s| s.parse::<u64>().ok())
                    .map(|us| SystemTime::UNIX_EPOCH + Duration::from_micros(us)),
            });
        }
    }
    match standby {
        Some(false) => Ok(out),
        Some(true) => Err(Error::Pool {
            message: "its server is a standby, whose lock table does not show the primary's locks; point the pool at the primary".to_owned(),
        }),
        None => Err(Error::Protocol {
            message: "the server answered the holders query with no header row; is a proxy rewriting queries?".to_owned(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_holders_statement_inlines_only_numbers() {
        let sql = holders_sql(&[LockKey::Pair(-1, 2), LockKey::Int(-5)]);
        assert!(
            sql.contains(
                "'{4294967295,4294967295}'::int8[], '{2,4294967291}'::int8[], '{2,1}'::int2[]"
            ),
            "{sql}"
        );
    }
}
