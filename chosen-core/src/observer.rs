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
    metrics: Option<Arc<dyn MetricsSink>>,
}

impl std::fmt::Debug for ObserverOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ObserverOptions")
            .field("namespace", &self.namespace)
            .field("node_id", &self.node_id)
            .field("poll_interval", &self.poll_interval)
            .field("metrics", &self.metrics.is_some())
            .finish()
    }
}

impl Default for ObserverOptions {
    fn default() -> Self {
        Self {
            namespace: DEFAULT_NAMESPACE.to_owned(),
            node_id: crate::options::default_node_id(),
            poll_interval: Duration::from_secs(1),
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

    /// The observer's own id, as its metrics label it (default `<hostname>-<pid>`).
    #[must_use]
    pub fn node_id(mut self, node_id: impl Into<String>) -> Self {
        self.node_id = node_id.into();
        self
    }

    /// How often the holders are read (default 1 s; at least 10 ms). A change of
    /// leader is seen within it.
    #[must_use]
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = interval;
        self
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
    /// [`Error::InvalidConfig`] when the options are out of range (a namespace that is
    /// empty or reserved, a poll interval below 10 ms) or this is called outside a
    /// tokio runtime.
    pub fn new(pool: deadpool_postgres::Pool, options: ObserverOptions) -> Result<Self> {
        if options.namespace.is_empty()
            || options.namespace.contains('\0')
            || options.namespace.starts_with(RESERVED_PREFIX)
        {
            return Err(Error::config(
                "ObserverOptions::namespace",
                format!(
                    "namespace {:?} is empty, contains a NUL character or begins with {RESERVED_PREFIX:?} (reserved); use the namespace of the managers that hold the locks",
                    options.namespace
                ),
            ));
        }
        if options.poll_interval < Duration::from_millis(10) {
            return Err(Error::config(
                "ObserverOptions::poll_interval",
                format!(
                    "poll_interval {:?} is below 10ms; poll less often",
                    options.poll_interval
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

    /// Who leads `name`, kept up to date from now on (every poll interval) for as long
    /// as the observer lives. Watching a name twice gives the same handle.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidName`] for an empty name, or one reserved for the library's own
    /// locks.
    pub fn watch(&self, name: &str) -> Result<Leadership> {
        validate_lock_name(name, false)?;
        let key = LockKey::derive(&self.shared.options.namespace, name);
        let leadership = self
            .shared
            .watched()
            .entry(key)
            .or_insert_with(|| {
                Leadership::new(
                    name,
                    Some(&self.shared.options.namespace),
                    &self.shared.options.node_id,
                    self.shared.options.metrics.clone(),
                )
            })
            .clone();
        self.shared.wake.notify_one();
        Ok(leadership)
    }

    /// Who holds each of `names` now, in one statement on a connection of the pool
    /// (`None`: nobody).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidName`] for a bad name; [`Error::Pool`] when the pool gives no
    /// connection; [`Error::Database`] when the statement fails;
    /// [`Error::Refused`] when the pool's server is a standby.
    pub async fn holders(&self, names: &[&str]) -> Result<Vec<Option<HolderInfo>>> {
        let mut keys = Vec::with_capacity(names.len());
        for name in names {
            validate_lock_name(name, false)?;
            keys.push(LockKey::derive(&self.shared.options.namespace, name));
        }
        read_holders(&self.shared.pool, &keys).await
    }
}

/// The observer's polling: every interval (at once after a new watch), one statement
/// for every name watched; aborted when the last clone of the observer is dropped.
async fn poll(s: Arc<Shared>) {
    let mut failing = false;
    loop {
        let watched: Vec<(LockKey, Leadership)> =
            s.watched().iter().map(|(k, l)| (*k, l.clone())).collect();
        if !watched.is_empty() {
            let keys: Vec<LockKey> = watched.iter().map(|(k, _)| *k).collect();
            match read_holders(&s.pool, &keys).await {
                Ok(holders) => {
                    if failing {
                        debug!("the observer reads the holders again");
                        failing = false;
                    }
                    for ((_, leadership), holder) in watched.iter().zip(holders) {
                        leadership.set_following(holder.map(|h| h.node_id));
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
        tokio::select! {
            () = tokio::time::sleep(s.options.poll_interval) => {}
            () = s.wake.notified() => {}
        }
    }
}

/// Who holds each of `keys` exclusively, in one statement on a connection of `pool`.
async fn read_holders(
    pool: &deadpool_postgres::Pool,
    keys: &[LockKey],
) -> Result<Vec<Option<HolderInfo>>> {
    let client = pool.get().await.map_err(|e| Error::Pool {
        message: e.to_string(),
    })?;
    // A simple query with the keys inlined (numbers only): no prepared statement, which
    // a transaction pooler may not carry between its backends.
    let messages = client
        .simple_query(&holders_sql(keys))
        .await
        .map_err(Error::database)?;
    parse_holders(&messages, keys.len())
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
        "SELECT 0::int8, pg_is_in_recovery()::text, NULL::int4, NULL::text, NULL::float8 \
         UNION ALL \
         SELECT k.i, a.application_name, l.pid, host(a.client_addr), extract(epoch FROM a.backend_start)::float8 \
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
        let Some(i) = row.get(0).and_then(|i| i.parse::<usize>().ok()) else {
            continue;
        };
        if i == 0 {
            standby = Some(row.get(1) == Some("true"));
            continue;
        }
        let Some(entry) = out.get_mut(i - 1) else {
            continue;
        };
        if entry.is_none() {
            *entry = Some(HolderInfo {
                node_id: row.get(1).unwrap_or_default().to_owned(),
                backend_pid: row.get(2).and_then(|p| p.parse().ok()).unwrap_or(0),
                client_addr: row.get(3).map(str::to_owned),
                session_start: row
                    .get(4)
                    .and_then(|s| s.parse::<f64>().ok())
                    .filter(|s| s.is_finite() && *s >= 0.0)
                    .map(|s| SystemTime::UNIX_EPOCH + Duration::from_secs_f64(s)),
            });
        }
    }
    match standby {
        Some(false) => Ok(out),
        Some(true) => Err(Error::Refused(
            crate::status::SessionDownReason::ServerInRecovery,
        )),
        None => Err(Error::Protocol {
            message: "the server answered the holders query with no header row".to_owned(),
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
