//! The lock manager handle.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use std::future::Future;

use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::backend::Backend;
use crate::command::Command;
use crate::error::{Error, Result};
use crate::info::{ClusterLock, HolderInfo, LockInfo};
use crate::key::LockKey;
use crate::lease::Lease;
use crate::options::ManagerOptions;
use crate::pg;
use crate::shared::Shared;
use crate::status::ConnectionState;
use crate::table::{Mode, Request};
use crate::task::Driver;

/// One PostgreSQL session holding any number of advisory locks for this process.
///
/// The Rust form of Elixir's `Chosen.LockManager`:
///
/// | Elixir `chosen` | chosen-core |
/// |---|---|
/// | `start_link(connect_opts: ..)` / `repo:` | [`LockManager::connect`] with [`ManagerOptions::from_url`], [`from_pg_config`](ManagerOptions::from_pg_config) or `from_deadpool` |
/// | `request_lock(name, polling_interval)` | [`acquire`](Self::acquire) (with [`LockRequest::poll_interval`]) |
/// | (none) | [`try_acquire`](Self::try_acquire) |
/// | `release_lock(name)` | [`Lease::release`] or dropping the [`Lease`] |
/// | `list_locks()` | [`locks`](Self::locks) |
/// | `connection_status()` | [`connection_status`](Self::connection_status) |
///
/// What happens in the database:
///
/// * One dedicated connection (never from a pool), driven by the manager's own task:
///   1,000 held locks are one row in `pg_stat_activity`. Several managers (e.g. one
///   per database) work side by side.
/// * Session-level advisory locks (`pg_try_advisory_lock`), which PostgreSQL
///   grants re-entrantly to one session; the manager therefore decides locally
///   between requests of this process: one owner per lock, a FIFO queue of waiters.
/// * Only the oldest waiter of each lock contends at the server, and all due locks are
///   tried in **one statement per poll tick**. A graceful release is announced with
///   `NOTIFY`, so waiting managers on other nodes retry at once.
/// * Every acquisition carries a [`FencingToken`](crate::FencingToken).
///
/// The handle is cheap to clone. The task (and the session) ends when
/// [`shutdown`](Self::shutdown) is called (which first stops every singleton and election
/// started from the manager) or when every handle and every lease is dropped.
///
/// ```no_run
/// use chosen_core::{LockManager, ManagerOptions};
///
/// # async fn demo() -> chosen_core::Result<()> {
/// let manager = LockManager::connect(ManagerOptions::from_url("postgres://app@db/app")?).await?;
/// let lease = manager.acquire("nightly-report").await?;
/// println!("running with fencing token {}", lease.fencing_token().await?);
/// tokio::select! {
///     reason = lease.lost() => eprintln!("lost the lock: {reason}"),
///     () = tokio::time::sleep(std::time::Duration::from_secs(10)) => {}
/// }
/// lease.release().await?;
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct LockManager {
    shared: Arc<Shared>,
    tx: mpsc::UnboundedSender<Command>,
}

/// What to lock, and how to wait for it.
///
/// Built from a name (`&str`, `String`) or a raw [`LockKey`]:
///
/// ```
/// use std::time::Duration;
/// use chosen_core::{LockKey, LockRequest};
///
/// let by_name = LockRequest::from("billing-sync").poll_interval(Duration::from_secs(1));
/// let raw = LockRequest::from(LockKey::Int(42));
/// # let _ = (by_name, raw);
/// ```
#[derive(Clone, Debug)]
pub struct LockRequest {
    target: Target,
    poll_interval: Option<Duration>,
    /// One of the library's own locks, whose name may begin with
    /// [`RESERVED_PREFIX`](crate::names::RESERVED_PREFIX).
    internal: bool,
    /// The grant carries the fencing token.
    eager_token: bool,
}

#[derive(Clone, Debug)]
enum Target {
    Name(String),
    Key(LockKey),
}

impl LockRequest {
    /// How often this request retries while another session holds the lock
    /// (10 ms to 1 hour; default: the manager's poll interval).
    #[must_use]
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = Some(interval);
        self
    }

    /// Take the fencing token with the lock, in the statement that wins it, so that
    /// [`Lease::fencing_token`] answers at once.
    ///
    /// By default a lease has no token until its holder first asks for one: then one
    /// statement issues it (proving that this session still holds the lock), and a lease
    /// whose token nobody reads writes nothing to the database. A token is durable
    /// (a small WAL record flushed before it is answered), which with `fsync` on costs
    /// a disk flush: take it eagerly when the holder always needs it right away;
    /// elections, singletons and the adapters' gates do. Either way the ordering
    /// guarantee is the same (see [`FencingToken`](crate::FencingToken)).
    #[must_use]
    pub fn eager_token(mut self) -> Self {
        self.eager_token = true;
        self
    }
}

impl LockRequest {
    /// One of the library's own locks (an election's preferred-node lock): its name may
    /// begin with the reserved prefix.
    pub(crate) fn internal(name: String) -> Self {
        Self {
            target: Target::Name(name),
            poll_interval: None,
            internal: true,
            eager_token: false,
        }
    }

    /// The lock a preferred node holds while it contends for this one, in an election
    /// or a singleton (see [`ElectionOptions::preferred`](crate::ElectionOptions::preferred));
    /// the leader looks for its holder: `chosen.prefer/<name>`, or for a raw key
    /// `chosen.prefer-key/<its tag>`, which no name can produce.
    pub(crate) fn presence_lock(&self) -> String {
        match &self.target {
            Target::Name(name) => format!("chosen.prefer/{name}"),
            Target::Key(key) => format!("chosen.prefer-key/{}", key.tag()),
        }
    }

    /// Checks the request as [`LockManager::acquire`] would (the name, and its own poll
    /// interval if it has one), so that a supervisor started on it fails at once rather
    /// than retry for ever; returns the name reported for it: the lock name, or
    /// `key(...)` for raw keys.
    pub(crate) fn validated_name(&self) -> Result<String> {
        if let Some(interval) = self.poll_interval
            && !crate::names::POLL_INTERVAL_RANGE.contains(&interval)
        {
            return Err(Error::InvalidPollInterval(interval));
        }
        Ok(self.resolve("", false)?.0)
    }

    /// The name reported for this request and its key in `namespace`, the name checked
    /// as [`LockManager::acquire`] checks it, or, for a `lookup`, only as a look-up
    /// does (reserved names allowed). A raw key is reported as `key(...)`.
    pub(crate) fn resolve(&self, namespace: &str, lookup: bool) -> Result<(String, LockKey)> {
        match &self.target {
            Target::Name(name) => {
                if lookup {
                    crate::names::validate_name("the lock name", name)?;
                } else {
                    crate::names::validate_lock_name(name, self.internal)?;
                }
                Ok((name.clone(), LockKey::derive(namespace, name)))
            }
            Target::Key(key) => Ok((format!("key{key}"), *key)),
        }
    }

    /// The namespace this request's key is derived in, given the manager's: `None` for
    /// a raw key.
    pub(crate) fn namespace<'a>(&self, manager: &'a str) -> Option<&'a str> {
        match self.target {
            Target::Name(_) => Some(manager),
            Target::Key(_) => None,
        }
    }
}

impl From<&str> for LockRequest {
    fn from(name: &str) -> Self {
        Self {
            target: Target::Name(name.to_owned()),
            poll_interval: None,
            internal: false,
            eager_token: false,
        }
    }
}

impl From<String> for LockRequest {
    fn from(name: String) -> Self {
        Self {
            target: Target::Name(name),
            poll_interval: None,
            internal: false,
            eager_token: false,
        }
    }
}

impl From<&String> for LockRequest {
    fn from(name: &String) -> Self {
        Self::from(name.as_str())
    }
}

impl From<LockKey> for LockRequest {
    fn from(key: LockKey) -> Self {
        Self {
            target: Target::Key(key),
            poll_interval: None,
            internal: false,
            eager_token: false,
        }
    }
}

impl LockManager {
    /// Validates `options`, opens the lock session and starts the manager's task.
    ///
    /// # Errors
    ///
    /// * [`Error::InvalidConfig`]: the options break a rule (its `setting` names which).
    /// * [`Error::Connect`], [`Error::ConnectTimeout`], [`Error::Authentication`]: the
    ///   first connection failed. Later losses are retried in the background instead.
    /// * [`Error::Refused`]: the server is a standby or read-only, or older than PostgreSQL 14.
    /// * [`Error::Protocol`]: the server answered a probe in a way chosen does not
    ///   expect (something between rewrites the conversation).
    pub async fn connect(options: ManagerOptions) -> Result<Self> {
        if options.pooled {
            return Err(Error::config(
                "ManagerOptions::pooled",
                "these options name no server (they were made for the lease-row mode): pass them to LockManager::connect_pooled with a pool, or make them with ManagerOptions::from_url".to_owned(),
            ));
        }
        Self::connect_with(options, Arc::new(pg::PgBackend::default())).await
    }

    /// Validates `options` and starts a manager in the *lease-row mode*: its locks are
    /// rows of a table (`chosen_lease`), taken, renewed and released with ordinary
    /// statements on connections of `pool`, so that it runs where session advisory
    /// locks cannot: through a transaction pooler (PgBouncer `pool_mode=transaction`,
    /// Supavisor, RDS Proxy) and without a connection of its own. The API and the
    /// guarantees are the same; what differs:
    ///
    /// * a crashed holder's locks are free `server_release_after` after its last
    ///   renewal (the rows expire by the database's clock), not when the server sees
    ///   its connection end;
    /// * a graceful release is not announced: waiters find it at their next poll;
    /// * the database's wall clock decides expiry, so a step forward of it by more
    ///   than [`safety_margin`](ManagerOptions::safety_margin) can end a lease early;
    /// * every node of a namespace must use the same mode and schema;
    /// * [`HolderInfo::backend_pid`](crate::HolderInfo::backend_pid) and the status's
    ///   backend pid carry the session's holder id (random), not a server process.
    ///
    /// The tables live in [`ManagerOptions::lease_schema`] (`public` by default) and
    /// are created when missing, if the pool's role may (else run
    /// [`lease_tables_sql`](crate::lease_tables_sql) as a migration). The pool must
    /// reach the primary. The session keeps one connection of the pool between its
    /// statements (through a transaction pooler that holds no server connection), so
    /// that an application using every other one cannot starve the renewals; it takes
    /// a new one when that one breaks. Any connection settings in `options` are not
    /// used. A key an advisory-lock session holds is not taken as a row, but an
    /// advisory-lock manager does not see rows: switch a fleet's mode with every node
    /// of the old mode stopped.
    ///
    /// ```no_run
    /// # async fn run(pool: deadpool_postgres::Pool) -> chosen_core::Result<()> {
    /// use chosen_core::{LockManager, ManagerOptions};
    ///
    /// let manager = LockManager::connect_pooled(pool, ManagerOptions::pooled()).await?;
    /// let lease = manager.acquire("nightly-report").await?;
    /// assert!(lease.is_valid());
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`]; [`Error::Pool`] when the pool gives no connection;
    /// [`Error::ConnectTimeout`]; [`Error::Refused`] for a standby, a read-only
    /// server, or tables that are missing and may not be created.
    #[cfg(feature = "deadpool")]
    #[cfg_attr(docsrs, doc(cfg(feature = "deadpool")))]
    pub async fn connect_pooled(
        pool: deadpool_postgres::Pool,
        mut options: ManagerOptions,
    ) -> Result<Self> {
        options.pooled = true;
        Self::connect_with(options, Arc::new(crate::rows::RowsBackend::new(pool))).await
    }

    /// [`connect`](Self::connect) to the sessions of `backend` (PostgreSQL's, or a
    /// simulated server's in tests).
    pub(crate) async fn connect_with(
        options: ManagerOptions,
        backend: Arc<dyn Backend>,
    ) -> Result<Self> {
        options.validate()?;
        let first = backend.connect(&options, 1).await?;
        let status = ConnectionState::Connected {
            generation: 1,
            backend_pid: first.backend_pid,
            server: first.server.clone(),
        };
        let shared = Arc::new(Shared::new(options, status));
        shared.extend_validity(first.proven_at + shared.options.lease_timeout);
        let (tx, rx) = mpsc::unbounded_channel();
        let driver = Driver::new(Arc::clone(&shared), rx, tx.downgrade(), backend);
        // Every line the manager's tasks log carries its node id (several managers may
        // share a process: tests, a sharded fleet).
        let span = tracing::info_span!("chosen", node_id = %shared.options.node_id);
        tokio::spawn(tracing::Instrument::instrument(driver.run(first), span));
        Ok(Self { shared, tx })
    }

    /// Waits until the lock is held and returns its [`Lease`].
    ///
    /// Requests of this process for the same lock are served in FIFO order. While
    /// another session holds it, the request is retried every poll interval (and at
    /// once when that session announces a release). Database errors and reconnects
    /// do not drop the request: it stays queued.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidName`], [`Error::InvalidPollInterval`],
    /// [`Error::TooManyLocks`], or [`Error::Closed`] when the manager shuts down.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping the future withdraws the request, and a lease granted at
    /// that very moment is released, so no lock stays held.
    pub async fn acquire(&self, request: impl Into<LockRequest>) -> Result<Lease> {
        match self.request(request.into(), Mode::Wait).await? {
            Some(lease) => Ok(lease),
            None => Err(Error::Closed),
        }
    }

    /// Takes the lock if it is free right now: `Ok(None)` when another session, or
    /// another request of this process, holds or waits for it, and while nothing may be
    /// granted yet because the server's term as primary began less than
    /// [`term_grant_delay`](crate::ManagerOptions::term_grant_delay) ago.
    ///
    /// # Errors
    ///
    /// As [`acquire`](Self::acquire), plus [`Error::NotConnected`] while the session
    /// is down and [`Error::Database`] when the attempt failed on the server.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe, as [`acquire`](Self::acquire).
    pub async fn try_acquire(&self, request: impl Into<LockRequest>) -> Result<Option<Lease>> {
        self.request(request.into(), Mode::Try).await
    }

    async fn request(&self, request: LockRequest, mode: Mode) -> Result<Option<Lease>> {
        if self.shared.closing.is_cancelled() {
            return Err(Error::Closed);
        }
        let (name, key) = request.resolve(&self.shared.options.namespace, false)?;
        let poll_interval = request
            .poll_interval
            .unwrap_or(self.shared.options.poll_interval);
        if !crate::names::POLL_INTERVAL_RANGE.contains(&poll_interval) {
            return Err(Error::InvalidPollInterval(poll_interval));
        }
        let (reply, rx) = oneshot::channel();
        let id = self.shared.next_id();
        let request = Request {
            id,
            key,
            name: name.into(),
            poll_interval,
            mode,
            since: SystemTime::now(),
            enqueued: crate::clock::now(),
            eager_token: request.eager_token,
        };
        self.tx
            .send(Command::Acquire { request, reply })
            .map_err(|_| Error::Closed)?;
        // If this future is dropped before the answer, the request leaves the queue at
        // once (a lease sent meanwhile is dropped with the channel, which releases it).
        let mut withdraw = WithdrawOnDrop {
            tx: &self.tx,
            key,
            id,
            armed: true,
        };
        let answer = rx.await;
        withdraw.armed = false;
        Ok(answer.map_err(|_| Error::Closed)??.map(Lease::new))
    }

    /// Every lock this manager holds or waits for.
    ///
    /// # Errors
    ///
    /// [`Error::Closed`] when the manager has shut down.
    pub async fn locks(&self) -> Result<Vec<LockInfo>> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Command::Locks(reply))
            .map_err(|_| Error::Closed)?;
        rx.await.map_err(|_| Error::Closed)
    }

    /// Who holds a lock right now, on any node, from `pg_locks` ⨝ `pg_stat_activity`
    /// on this manager's own session (no second connection): `Ok(None)` when nobody
    /// does. Costs one query (about 0.4 ms with few locks in the cluster). A name is
    /// looked up by its derived key, reserved names included (`holder("key(1, 2)")`
    /// looks up the name, not the raw key `(1, 2)`: pass the `LockKey` for that).
    ///
    /// # Errors
    ///
    /// [`Error::NotConnected`] while the session is down, [`Error::Database`],
    /// [`Error::InvalidName`], [`Error::Closed`].
    pub async fn holder(&self, lock: impl Into<LockRequest>) -> Result<Option<HolderInfo>> {
        let (_, key) = lock.into().resolve(&self.shared.options.namespace, true)?;
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Command::Holder { key, reply })
            .map_err(|_| Error::Closed)?;
        rx.await.map_err(|_| Error::Closed)?
    }

    /// Every advisory lock held in this database right now, by any session, with its
    /// holder (node id = `application_name`, backend pid, client address, session
    /// start): the cluster view, from `pg_locks` ⨝ `pg_stat_activity` on this manager's
    /// own session, no schema. Names are filled in where known: the locks of this
    /// manager, and `names` (derived in this manager's namespace). Keys are one-way
    /// hashes, so other locks show their key only. PostgreSQL does not record when a
    /// lock was granted; `session_start` is when the holder's session began.
    ///
    /// # Errors
    ///
    /// [`Error::NotConnected`], [`Error::Database`], [`Error::Closed`].
    pub async fn cluster_locks(&self, names: &[&str]) -> Result<Vec<ClusterLock>> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Command::Cluster(reply))
            .map_err(|_| Error::Closed)?;
        let rows = rx.await.map_err(|_| Error::Closed)??;
        let mut known: crate::maps::HashMap<LockKey, String> = self
            .locks()
            .await?
            .into_iter()
            .map(|l| (l.key, l.name))
            .collect();
        for name in names {
            known.insert(self.key_for(name), (*name).to_owned());
        }
        Ok(rows
            .into_iter()
            .map(|(key, holder)| ClusterLock {
                name: known.get(&key).cloned(),
                key,
                holder,
            })
            .collect())
    }

    /// The state of the lock session right now.
    #[must_use]
    pub fn connection_status(&self) -> ConnectionState {
        self.shared.status.borrow().clone()
    }

    /// A receiver that sees every change of [`connection_status`](Self::connection_status).
    #[must_use]
    pub fn watch_connection_status(&self) -> watch::Receiver<ConnectionState> {
        self.shared.status.subscribe()
    }

    /// The key lock `name` maps to in this manager's namespace.
    #[must_use]
    pub fn key_for(&self, name: &str) -> LockKey {
        LockKey::derive(&self.shared.options.namespace, name)
    }

    /// See `Shared::next_shared_tick`.
    pub(crate) fn next_shared_tick(&self, period: Duration) -> std::time::Instant {
        self.shared.next_shared_tick(period, crate::clock::now())
    }

    /// This manager's node id (its session's `application_name`).
    #[must_use]
    pub fn node_id(&self) -> &str {
        &self.shared.options.node_id
    }

    /// The options the manager was built with.
    #[must_use]
    pub fn options(&self) -> &ManagerOptions {
        &self.shared.options
    }

    /// Shuts down everything started from this manager, in order, and waits until done:
    ///
    /// 1. every [`Singleton`](crate::Singleton) stops its child (cancel, its shutdown
    ///    timeout, abort) and every [`Election`](crate::Election) stops contending, as
    ///    their own `shutdown` does: each releases its lock and announces it, so a
    ///    waiting node takes over within about a round trip, and only after the child
    ///    stopped. This waits at most `stop_budget + lease_timeout` (a `warn` event
    ///    names how many were still stopping; the next step still keeps the order);
    /// 2. every other lock is released at the server (announced) and every lease
    ///    revoked;
    /// 3. the session closes.
    ///
    /// Requests still waiting when it begins fail with [`Error::Closed`] at once (none
    /// is granted while the singletons stop). One call is enough on SIGTERM; calling
    /// the singletons' and elections' own `shutdown` first is fine too. Idempotent.
    /// Afterwards, requests fail with [`Error::Closed`], and a singleton or election
    /// started on this manager stops at once.
    ///
    /// ```no_run
    /// use chosen_core::{Election, LockManager, ManagerOptions, Singleton, SingletonOptions};
    ///
    /// # async fn demo() -> chosen_core::Result<()> {
    /// let manager = LockManager::connect(ManagerOptions::from_url("postgres://app@db/app")?).await?;
    /// let _election = Election::start(&manager, "web-leader")?;
    /// let _singleton = Singleton::start(&manager, "billing-sync", SingletonOptions::default(), |ctx| async move {
    ///     ctx.cancelled().await;
    ///     Ok::<(), std::io::Error>(())
    /// })?;
    /// // ... on SIGTERM: the child stops, then both locks are released and announced.
    /// manager.shutdown().await;
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Cancel safety
    ///
    /// The shutdown is started before the first await and goes on in its own task;
    /// dropping the future only stops waiting for it to finish. (Polled outside a tokio
    /// runtime, e.g. by `futures::executor::block_on` on a thread of its own, it works
    /// too, in the caller's future, without the bound on the supervisors' stop.)
    pub async fn shutdown(&self) {
        // Refuse new requests and tell every supervisor to stop, synchronously. From
        // here on no grant is delivered (the engine's rule 8, whatever statement was in
        // flight), and waiting requests are
        // answered `Closed` as soon as the driver reads this, not when the supervisors
        // have stopped.
        self.shared.closing.cancel();
        self.shared.tasks.close();
        let _ = self.tx.send(Command::Closing);
        let (reply, rx) = oneshot::channel();
        let shared = Arc::clone(&self.shared);
        let tx = self.tx.clone();
        match tokio::runtime::Handle::try_current() {
            // In a task of its own, so that dropping this future (or calling `shutdown`
            // from a singleton's child, which the singleton then aborts) does not stop it
            // half-way.
            Ok(runtime) => drop(runtime.spawn(async move {
                let options = &shared.options;
                let bound = options.stop_budget.saturating_add(options.lease_timeout);
                if tokio::time::timeout(bound, shared.tasks.wait())
                    .await
                    .is_err()
                {
                    warn!(
                        node_id = %options.node_id,
                        still_stopping = shared.tasks.len(),
                        bound = ?bound,
                        "singletons or elections still stopping at shutdown; closing the session anyway"
                    );
                }
                let _ = tx.send(Command::Shutdown(reply));
            })),
            // Polled outside a tokio runtime (a plain executor, on a thread of its own):
            // no timer and no task here, so wait for the supervisors, which stop on the
            // runtime the manager runs on, without a bound.
            Err(_) => {
                shared.tasks.wait().await;
                let _ = tx.send(Command::Shutdown(reply));
            }
        }
        let _ = rx.await;
    }

    /// A stop token for a supervisor started from this manager: cancelled by
    /// [`shutdown`](Self::shutdown) (already, if it began).
    pub(crate) fn stop_token(&self) -> CancellationToken {
        self.shared.closing.child_token()
    }

    /// Spawns a supervisor task that [`shutdown`](Self::shutdown) waits for.
    pub(crate) fn spawn_supervisor<F>(&self, task: F) -> JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        let span = tracing::info_span!("chosen", node_id = %self.shared.options.node_id);
        self.shared
            .tasks
            .spawn(tracing::Instrument::instrument(task, span))
    }
}

/// Asks a supervisor to stop and waits until its task is done: the `shutdown` of an
/// `Election`, a `Singleton` and a `SingletonGroup`. The handle stays in place until
/// the task is done, so a caller that stops waiting (its future dropped) leaves it for
/// the next call to wait on. Returns the task's panic, if it panicked (once).
pub(crate) async fn stop_supervisor(
    stop: &CancellationToken,
    task: &tokio::sync::Mutex<Option<JoinHandle<()>>>,
) -> Option<Box<dyn std::any::Any + Send>> {
    stop.cancel();
    let mut task = task.lock().await;
    let result = task.as_mut()?.await;
    *task = None;
    match result {
        Err(e) if e.is_panic() => Some(e.into_panic()),
        _ => None,
    }
}

/// Withdraws a request whose caller stopped waiting.
struct WithdrawOnDrop<'a> {
    tx: &'a mpsc::UnboundedSender<Command>,
    key: LockKey,
    id: u64,
    armed: bool,
}

impl Drop for WithdrawOnDrop<'_> {
    fn drop(&mut self) {
        if self.armed {
            let _ = self.tx.send(Command::Withdraw {
                key: self.key,
                id: self.id,
            });
        }
    }
}
