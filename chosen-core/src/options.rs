//! Manager configuration and the timing invariant.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use tokio_postgres::config::{Host, TargetSessionAttrs};

use crate::error::{Error, Result};
use crate::key::DEFAULT_NAMESPACE;

/// PostgreSQL truncates `application_name` to 63 bytes; the node id is stored there.
const MAX_NODE_ID_LEN: usize = 63;

/// Whether `id` may be a node id: 1 to 63 bytes of printable ASCII (it is stored as
/// the session's `application_name`).
pub(crate) fn is_valid_node_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= MAX_NODE_ID_LEN
        && id.bytes().all(|b| b.is_ascii_graphic() || b == b' ')
}

/// The largest `server_release_after`, and so of every term of the timing invariant.
/// Checking each term against it first keeps every sum and product in validation (and
/// in the manager, which adds them to `Instant`s) far from overflowing.
const MAX_TIMING: Duration = Duration::from_secs(24 * 3600);
const MAX_TIMING_TEXT: &str = "24h";

/// The largest poll interval, connect timeout and reconnect backoff.
const MAX_WAIT: Duration = Duration::from_secs(3600);
const MAX_WAIT_TEXT: &str = "1h";

/// How a [`LockManager`](crate::LockManager) connects and times its session.
///
/// Build it from a URL ([`from_url`](Self::from_url)), a
/// [`tokio_postgres::Config`] ([`from_pg_config`](Self::from_pg_config)) or, with the
/// `deadpool` feature, a `deadpool_postgres::Config`; then adjust with the by-value
/// setters. Whatever the source, the lock connection is a dedicated one, never taken
/// from a pool: pooled sessions rotate, and session locks would leak.
///
/// # The timing invariant
///
/// A lease is trusted on the client only while the last successful heartbeat was
/// *sent* less than `lease_timeout` ago; the server ends a silent session (and so
/// releases its locks) no sooner than `server_release_after` after its last query.
/// Between the two, a holder that lost its session must have stopped its work:
///
/// ```text
/// lease_timeout + stop_budget + safety_margin < server_release_after
/// ```
///
/// [`validate`](Self::validate) (called by [`LockManager::connect`](crate::LockManager::connect))
/// rejects options that break it, naming the numbers. Every setting reads back through a
/// getter named `get_<setting>`, as in `tokio_postgres::Config` (the plain name is the
/// builder method). The defaults (1 s heartbeat,
/// 3 s lease timeout, 2 s stop budget, 1 s margin, 7 s server release) give a
/// partition or freeze failover of about 7–8 s with no overlap.
///
/// ```
/// use std::time::Duration;
/// use chosen_core::ManagerOptions;
///
/// let options = ManagerOptions::from_url("postgres://app:secret@db.internal/app")?
///     .node_id("worker-1")
///     .heartbeat_interval(Duration::from_millis(500))
///     .lease_timeout(Duration::from_secs(2));
/// options.validate()?;
/// assert!(!format!("{options:?}").contains("secret"));
/// # Ok::<(), chosen_core::Error>(())
/// ```
#[derive(Clone)]
pub struct ManagerOptions {
    pub(crate) pg: tokio_postgres::Config,
    pub(crate) node_id: String,
    pub(crate) namespace: String,
    pub(crate) heartbeat_interval: Duration,
    pub(crate) lease_timeout: Duration,
    pub(crate) stop_budget: Duration,
    pub(crate) safety_margin: Duration,
    pub(crate) server_release_after: Duration,
    pub(crate) poll_interval: Duration,
    pub(crate) connect_timeout: Duration,
    pub(crate) reconnect_min: Duration,
    pub(crate) reconnect_max: Duration,
    pub(crate) max_locks: usize,
    pub(crate) takeover_grace: Duration,
    /// `None`: the default, `lease_timeout + stop_budget + safety_margin`.
    pub(crate) term_grant_delay: Option<Duration>,
    pub(crate) token_epoch: u16,
    pub(crate) eligible: bool,
    /// The exclusion self-test runs on each new server (off only in tests).
    pub(crate) exclusion_self_test: bool,
    /// Made for the lease-row mode ([`ManagerOptions::pooled`]): no connection
    /// settings of its own.
    pub(crate) pooled: bool,
    /// The schema of the lease-row tables.
    pub(crate) lease_schema: String,
    #[cfg(feature = "rustls")]
    pub(crate) tls: Option<std::sync::Arc<rustls::ClientConfig>>,
    pub(crate) metrics: Option<std::sync::Arc<dyn crate::MetricsSink>>,
}

impl fmt::Debug for ManagerOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // `tokio_postgres::Config`'s own Debug redacts the password.
        f.debug_struct("ManagerOptions")
            .field("pg", &self.pg)
            .field("node_id", &self.node_id)
            .field("namespace", &self.namespace)
            .field("heartbeat_interval", &self.heartbeat_interval)
            .field("lease_timeout", &self.lease_timeout)
            .field("stop_budget", &self.stop_budget)
            .field("safety_margin", &self.safety_margin)
            .field("server_release_after", &self.server_release_after)
            .field("poll_interval", &self.poll_interval)
            .field("connect_timeout", &self.connect_timeout)
            .field("reconnect_min", &self.reconnect_min)
            .field("reconnect_max", &self.reconnect_max)
            .field("max_locks", &self.max_locks)
            .field("takeover_grace", &self.takeover_grace)
            .field("term_grant_delay", &self.get_term_grant_delay())
            .field("token_epoch", &self.token_epoch)
            .field("eligible", &self.eligible)
            .field("exclusion_self_test", &self.exclusion_self_test)
            .field("pooled", &self.pooled)
            .field("lease_schema", &self.lease_schema)
            .field("tls", &self.uses_tls())
            .field("metrics", &self.metrics.is_some())
            .finish()
    }
}

impl ManagerOptions {
    /// Options from a connection string: a URL (`postgres://user:pw@host:port/db?...`) or
    /// libpq key/value form (`host=... user=...`), as
    /// [`tokio_postgres::Config`] parses them.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidUrl`] when the string does not parse; the message never contains
    /// the password.
    pub fn from_url(url: &str) -> Result<Self> {
        let pg = tokio_postgres::Config::from_str(url).map_err(|e| Error::InvalidUrl {
            // tokio-postgres' parse errors name the offending key, never its value.
            message: e.to_string(),
        })?;
        Ok(Self::from_pg_config(pg))
    }

    /// Options from a [`tokio_postgres::Config`].
    #[must_use]
    pub fn from_pg_config(pg: tokio_postgres::Config) -> Self {
        Self {
            pg,
            node_id: default_node_id(),
            namespace: DEFAULT_NAMESPACE.to_owned(),
            heartbeat_interval: Duration::from_secs(1),
            lease_timeout: Duration::from_secs(3),
            stop_budget: Duration::from_secs(2),
            safety_margin: Duration::from_secs(1),
            server_release_after: Duration::from_secs(7),
            poll_interval: Duration::from_millis(300),
            connect_timeout: Duration::from_secs(5),
            reconnect_min: Duration::from_millis(100),
            reconnect_max: Duration::from_secs(5),
            max_locks: 4096,
            takeover_grace: Duration::from_millis(100),
            term_grant_delay: None,
            token_epoch: 0,
            eligible: true,
            exclusion_self_test: true,
            pooled: false,
            lease_schema: "public".to_owned(),
            #[cfg(feature = "rustls")]
            tls: None,
            metrics: None,
        }
    }

    /// Reports what the manager, its singletons and elections, and the tower and apalis
    /// adapters do to `sink`: any [`MetricsSink`](crate::MetricsSink), such as the two
    /// that ship behind features:
    ///
    // Linked only when built: a link to an item of a disabled feature would not resolve.
    #[cfg_attr(
        feature = "prometheus",
        doc = "* [`PrometheusMetrics`](crate::PrometheusMetrics) (feature `prometheus`),"
    )]
    #[cfg_attr(
        not(feature = "prometheus"),
        doc = "* `PrometheusMetrics` (feature `prometheus`),"
    )]
    #[cfg_attr(
        feature = "opentelemetry",
        doc = "* [`OtelMetrics`](crate::OtelMetrics) (feature `opentelemetry`)."
    )]
    #[cfg_attr(
        not(feature = "opentelemetry"),
        doc = "* `OtelMetrics` (feature `opentelemetry`)."
    )]
    #[must_use]
    pub fn metrics(mut self, sink: std::sync::Arc<dyn crate::MetricsSink>) -> Self {
        self.metrics = Some(sink);
        self
    }

    /// Connects with TLS through rustls, using `config` (its root certificates decide
    /// which servers are trusted). rustls always verifies the certificate chain and the
    /// host name, so any `sslmode` that uses TLS behaves like libpq's `verify-full`;
    /// `sslmode=disable` in the connection settings still turns TLS off, and
    /// `sslmode=require` makes TLS mandatory.
    ///
    /// ```no_run
    /// # fn demo(ca_pem: &[u8]) -> Result<(), Box<dyn std::error::Error>> {
    /// use std::sync::Arc;
    /// use rustls::pki_types::{CertificateDer, pem::PemObject};
    ///
    /// let mut roots = rustls::RootCertStore::empty();
    /// for cert in CertificateDer::pem_slice_iter(ca_pem) {
    ///     roots.add(cert?)?;
    /// }
    /// let tls = rustls::ClientConfig::builder_with_provider(Arc::new(
    ///     rustls::crypto::ring::default_provider(),
    /// ))
    /// .with_safe_default_protocol_versions()?
    /// .with_root_certificates(roots)
    /// .with_no_client_auth();
    /// let options = chosen_core::ManagerOptions::from_url("postgres://app@db.internal/app?sslmode=require")?
    ///     .rustls(tls);
    /// # let _ = options; Ok(())
    /// # }
    /// ```
    #[cfg(feature = "rustls")]
    #[cfg_attr(docsrs, doc(cfg(feature = "rustls")))]
    #[must_use]
    pub fn rustls(mut self, config: rustls::ClientConfig) -> Self {
        self.tls = Some(std::sync::Arc::new(config));
        self
    }

    fn uses_tls(&self) -> bool {
        #[cfg(feature = "rustls")]
        {
            self.tls.is_some()
        }
        #[cfg(not(feature = "rustls"))]
        {
            false
        }
    }

    /// Options for the lease-row mode ([`LockManager::connect_pooled`]): no connection
    /// settings, since every statement runs on a connection of the application's pool.
    /// Adjust the timings as for any manager.
    ///
    /// ```
    /// use chosen_core::ManagerOptions;
    ///
    /// let options = ManagerOptions::pooled().node_id("worker-1");
    /// options.validate()?;
    /// # Ok::<(), chosen_core::Error>(())
    /// ```
    ///
    /// [`LockManager::connect_pooled`]: crate::LockManager::connect_pooled
    #[cfg(feature = "deadpool")]
    #[cfg_attr(docsrs, doc(cfg(feature = "deadpool")))]
    #[must_use]
    pub fn pooled() -> Self {
        let mut options = Self::from_pg_config(tokio_postgres::Config::new());
        options.pooled = true;
        options
    }

    /// The schema the lease-row mode keeps its tables in (default `public`): every
    /// node of a fleet must name the same one, whatever its role's own schemas or
    /// `search_path` (a plain identifier: a letter or `_`, then letters, digits or `_`,
    /// at most 63 bytes).
    #[must_use]
    pub fn lease_schema(mut self, schema: impl Into<String>) -> Self {
        self.lease_schema = schema.into();
        self
    }

    /// The schema of the lease-row tables (see [`lease_schema`](Self::lease_schema)).
    #[must_use]
    pub fn get_lease_schema(&self) -> &str {
        &self.lease_schema
    }

    /// Options from a `deadpool_postgres::Config` (the settings only: the lock
    /// connection is dedicated, never taken from the pool).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidUrl`] when deadpool cannot turn its settings into a
    /// `tokio_postgres::Config`.
    #[cfg(feature = "deadpool")]
    #[cfg_attr(docsrs, doc(cfg(feature = "deadpool")))]
    pub fn from_deadpool(config: &deadpool_postgres::Config) -> Result<Self> {
        let pg = config.get_pg_config().map_err(|e| Error::InvalidUrl {
            message: e.to_string(),
        })?;
        Ok(Self::from_pg_config(pg))
    }

    /// This process's identity among the nodes, stored as the session's
    /// `application_name` so other nodes can tell who holds a lock. Default:
    /// `<hostname>-<pid>`. At most 63 bytes of printable ASCII.
    #[must_use]
    pub fn node_id(mut self, node_id: impl Into<String>) -> Self {
        self.node_id = node_id.into();
        self
    }

    /// Whether this node may lead (default `true`). An ineligible node's elections,
    /// singletons and group members never contend for their locks: they follow
    /// whoever leads (their leadership names the leader), and its groups do not count
    /// it as a live node. For replicas that must not run the work, e.g. without the
    /// privileges the job needs, or in another region. The manager itself still
    /// connects, and [`LockManager::acquire`](crate::LockManager::acquire) and
    /// [`try_acquire`](crate::LockManager::try_acquire) still work: eligibility is
    /// about what leads, not about the locks a program takes itself.
    ///
    /// ```
    /// let options = chosen_core::ManagerOptions::from_url("postgres://app@db/app")?
    ///     .eligible(false);
    /// assert!(!options.is_eligible());
    /// # Ok::<(), chosen_core::Error>(())
    /// ```
    #[must_use]
    pub fn eligible(mut self, eligible: bool) -> Self {
        self.eligible = eligible;
        self
    }

    /// Skips the self-test that proves, on each new server, that an advisory lock taken
    /// by the session is refused to another session (what makes a transaction pooler or
    /// a stub refused at connect). For tests only: they use it to put a node where the
    /// self-test would refuse it and check what the heartbeat sees there.
    #[cfg(feature = "test-util")]
    #[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
    #[must_use]
    pub fn without_exclusion_self_test(mut self) -> Self {
        self.exclusion_self_test = false;
        self
    }

    /// Whether this node may lead: see [`eligible`](Self::eligible).
    #[must_use]
    pub fn is_eligible(&self) -> bool {
        self.eligible
    }

    /// The namespace lock names are derived in (default `"chosen"`); see
    /// [`LockKey`](crate::LockKey). Applications sharing a database use different
    /// namespaces to keep equal names apart (their locks; not their fence rows, which
    /// are keyed by name alone: see [`fenced`](crate::fenced)). A namespace beginning
    /// with `chosen.` is refused: the library derives its own keys in such namespaces.
    #[must_use]
    pub fn namespace(mut self, namespace: impl Into<String>) -> Self {
        self.namespace = namespace.into();
        self
    }

    /// How often the session proves it is alive, the same backend, and on a primary.
    /// Default 1 s; at least 10 ms, at most half the lease timeout.
    ///
    /// Heartbeats are pipelined: one is sent every interval whether or not the earlier
    /// ones have answered, so leases survive database round trips below
    /// `lease_timeout - heartbeat_interval` (2 s with the defaults); a round trip above
    /// half the lease timeout is logged as a warning (at most every 30 s). While
    /// requests wait (their tries are then on their way most of the time on a slow
    /// database, and a heartbeat answer renews only from a try's send), the limit is
    /// about half that.
    #[must_use]
    pub fn heartbeat_interval(mut self, interval: Duration) -> Self {
        self.heartbeat_interval = interval;
        self
    }

    /// How long after the last successful heartbeat was sent the client still trusts
    /// its leases. Default 3 s; at least twice the heartbeat interval, at most 24 h.
    #[must_use]
    pub fn lease_timeout(mut self, timeout: Duration) -> Self {
        self.lease_timeout = timeout;
        self
    }

    /// How long work guarded by a lease may take to stop once the lease is lost (a
    /// singleton's shutdown timeout must fit in it). Default 2 s; at most 24 h.
    #[must_use]
    pub fn stop_budget(mut self, budget: Duration) -> Self {
        self.stop_budget = budget;
        self
    }

    /// Slack for clock granularity and scheduling delays in the timing invariant.
    /// Default 1 s; at least 100 ms, at most 24 h.
    #[must_use]
    pub fn safety_margin(mut self, margin: Duration) -> Self {
        self.safety_margin = margin;
        self
    }

    /// After how long the server ends a silent session, releasing its locks so another
    /// node can take over. Set on the session as `idle_session_timeout` (and as
    /// the TCP keepalive floor; `tcp_user_timeout` is this plus `lease_timeout`).
    /// Default 7 s; at most 24 h.
    #[must_use]
    pub fn server_release_after(mut self, after: Duration) -> Self {
        self.server_release_after = after;
        self
    }

    /// How often a waiting request retries (default 300 ms, jittered by ±10 %; between
    /// 10 ms and 1 h);
    /// a request may set its own with [`LockRequest::poll_interval`](crate::LockRequest::poll_interval).
    #[must_use]
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = interval;
        self
    }

    /// Timeout of one connection attempt, used when the connection settings have none.
    /// Default 5 s; at most 1 h.
    #[must_use]
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Bounds of the jittered exponential backoff between reconnect attempts.
    /// Default 100 ms to 5 s; `0 < min <= max <= 1 h`.
    #[must_use]
    pub fn reconnect_backoff(mut self, min: Duration, max: Duration) -> Self {
        self.reconnect_min = min;
        self.reconnect_max = max;
        self
    }

    /// The most locks (held or waited for) this manager tracks at once. Default 4096.
    ///
    /// Advisory locks occupy the server's shared lock table, sized
    /// `max_locks_per_transaction × (max_connections + max_prepared_transactions)`;
    /// with default server settings it fills at about 12,800 locks for the whole
    /// cluster, after which other sessions' queries and new connections fail. Raise
    /// this only together with `max_locks_per_transaction`.
    #[must_use]
    pub fn max_locks(mut self, max: usize) -> Self {
        self.max_locks = max;
        self
    }

    /// How long a lock that was held by another session, and then came free without a
    /// release announcement, waits before it is granted (default 100 ms; zero turns it
    /// off; at most the lease timeout).
    ///
    /// When the server ends a holder's session on its own side
    /// (`pg_terminate_backend`, a proxy closing the server connection), it releases the
    /// lock at once, while the holder learns of it only when the termination reaches
    /// it, usually within a millisecond. A lock released gracefully is announced and
    /// granted at once, a lock free on the first try too; any other takeover waits
    /// this grace so that a reachable old holder has stopped first. Crash failover is
    /// slower by this much. An announcement counts only when the waiter's next try
    /// finds the releasing session (its pid *and* `backend_start`) still connected, and
    /// its role's sessions visible (the same role, or `pg_read_all_stats`): pids are
    /// reused, and a session that left cannot be told from a new one on its pid (a
    /// shutting-down node's session usually outlives its last announcement by a
    /// round trip, its reset).
    #[must_use]
    pub fn takeover_grace(mut self, grace: Duration) -> Self {
        self.takeover_grace = grace;
        self
    }

    /// How long after the server's current term as primary began (its start, a crash
    /// restart, or its promotion from standby) no lock is granted on it. Default: the
    /// longest a holder that lost the previous term *silently* (partitioned, frozen, its
    /// sockets silent) may still trust its lease and stop its work, `lease_timeout +
    /// stop_budget + safety_margin` (6 s with the defaults); at least that, at most
    /// 24 h. Zero turns the delay off, which is **unsafe** unless nothing can hold a lock
    /// silently across a restart or failover (a single process, say).
    ///
    /// A restart or a failover ends every session at once, and a new primary holds no
    /// advisory locks at all: a holder that did not hear of it keeps working until its
    /// own deadline. The term's start is read from the server, its age computed with
    /// the server's clock (so the client's clock does not matter); see the crate
    /// documentation ("A new primary term") for how, and what a DBA can do to make it
    /// exact. The cost: after a restart or failover, the first grant comes this long
    /// after the server came back, even when no holder was silent.
    ///
    /// A server started for the first time waits too (every `docker compose up`, every
    /// throwaway test server): nothing it shows proves that no earlier term existed. Its
    /// first start after `initdb` looks the same whether or not it replaces a server at
    /// the same address whose holders still trust their leases (a fresh volume after
    /// `docker compose down`, a cluster rebuilt by a script). The manager logs the wait
    /// once at `info`, with its length and this option's name. In tests that start one
    /// server per test and no process outlives it, zero is safe.
    #[must_use]
    pub fn term_grant_delay(mut self, delay: Duration) -> Self {
        self.term_grant_delay = Some(delay);
        self
    }

    /// Added to the server's timeline in the high bits of every fencing token (see
    /// [`FencingToken`](crate::FencingToken)); 0 by default, at most 32766 (and at
    /// most 32767 together with the timeline). The server's own `chosen.token_epoch`
    /// setting counts too: a session uses the larger of the two.
    ///
    /// Tokens order by the server's timeline first, which every promotion raises.
    /// `pg_upgrade`, a logical or blue/green cutover and a dump and restore start a
    /// cluster on timeline 1 again; the crate documentation ("Moving to another
    /// cluster") has the procedure that keeps tokens in order, which sets
    /// `chosen.token_epoch` on the new cluster. This option is the client-side form:
    /// raise it only after the old cluster stopped taking connections, or the old
    /// cluster's tokens rise with it.
    ///
    /// ```
    /// # use chosen_core::ManagerOptions;
    /// let options = ManagerOptions::from_url("postgres://app@db/app")?.token_epoch(3);
    /// # Ok::<(), chosen_core::Error>(())
    /// ```
    #[must_use]
    pub fn token_epoch(mut self, epoch: u16) -> Self {
        self.token_epoch = epoch;
        self
    }

    /// The term grant delay (see [`term_grant_delay`](Self::term_grant_delay)).
    #[must_use]
    pub fn get_term_grant_delay(&self) -> Duration {
        self.term_grant_delay.unwrap_or_else(|| self.max_stop())
    }

    /// The longest a holder that lost its session may still act or stop:
    /// `lease_timeout + stop_budget + safety_margin` (saturating; validated far below
    /// overflow).
    pub(crate) fn max_stop(&self) -> Duration {
        self.lease_timeout
            .saturating_add(self.stop_budget)
            .saturating_add(self.safety_margin)
    }

    /// The lock table's rules, from these options.
    pub(crate) fn table_rules(&self) -> crate::table::Rules {
        crate::table::Rules {
            node: crate::key::node_hash(&self.node_id),
            max_locks: self.max_locks,
            takeover_grace: self.takeover_grace,
            max_fence_wait: self.max_stop(),
        }
    }

    /// The engine's own timing, from these options.
    pub(crate) fn engine_timing(&self) -> crate::engine::Timing {
        crate::engine::Timing {
            term_grant_delay: self.get_term_grant_delay(),
            reconnect_min: self.reconnect_min,
            reconnect_max: self.reconnect_max,
            stop_budget: self.stop_budget,
            statement_slack: self.lease_timeout,
            linger: self.takeover_grace,
        }
    }

    /// The node id (see [`node_id`](Self::node_id)).
    #[must_use]
    pub fn get_node_id(&self) -> &str {
        &self.node_id
    }

    /// The namespace (see [`namespace`](Self::namespace)).
    #[must_use]
    pub fn get_namespace(&self) -> &str {
        &self.namespace
    }

    /// The connection settings.
    #[must_use]
    pub fn get_pg_config(&self) -> &tokio_postgres::Config {
        &self.pg
    }

    /// The lease timeout (see [`lease_timeout`](Self::lease_timeout)).
    #[must_use]
    pub fn get_lease_timeout(&self) -> Duration {
        self.lease_timeout
    }

    /// The stop budget (see [`stop_budget`](Self::stop_budget)).
    #[must_use]
    pub fn get_stop_budget(&self) -> Duration {
        self.stop_budget
    }

    /// The server release time (see [`server_release_after`](Self::server_release_after)).
    #[must_use]
    pub fn get_server_release_after(&self) -> Duration {
        self.server_release_after
    }

    /// The default poll interval (see [`poll_interval`](Self::poll_interval)).
    #[must_use]
    pub fn get_poll_interval(&self) -> Duration {
        self.poll_interval
    }

    /// Whether this node may lead (see [`eligible`](Self::eligible)).
    #[must_use]
    pub fn get_eligible(&self) -> bool {
        self.eligible
    }

    /// The heartbeat interval (see [`heartbeat_interval`](Self::heartbeat_interval)).
    #[must_use]
    pub fn get_heartbeat_interval(&self) -> Duration {
        self.heartbeat_interval
    }

    /// The safety margin (see [`safety_margin`](Self::safety_margin)).
    #[must_use]
    pub fn get_safety_margin(&self) -> Duration {
        self.safety_margin
    }

    /// The connect timeout (see [`connect_timeout`](Self::connect_timeout)).
    #[must_use]
    pub fn get_connect_timeout(&self) -> Duration {
        self.connect_timeout
    }

    /// The most locks this manager tracks (see [`max_locks`](Self::max_locks)).
    #[must_use]
    pub fn get_max_locks(&self) -> usize {
        self.max_locks
    }

    /// The takeover grace (see [`takeover_grace`](Self::takeover_grace)).
    #[must_use]
    pub fn get_takeover_grace(&self) -> Duration {
        self.takeover_grace
    }

    /// The client-side token epoch (see [`token_epoch`](Self::token_epoch)).
    #[must_use]
    pub fn get_token_epoch(&self) -> u16 {
        self.token_epoch
    }

    /// The reconnect backoff, `(min, max)` (see [`reconnect_backoff`](Self::reconnect_backoff)).
    #[must_use]
    pub fn get_reconnect_backoff(&self) -> (Duration, Duration) {
        (self.reconnect_min, self.reconnect_max)
    }

    /// Checks every setting and the timing invariant.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] naming the setting, the numbers and the fix, or the
    /// bound an absurd value exceeds (never a panic, whatever the values).
    pub fn validate(&self) -> Result<()> {
        let bad = |setting: &'static str, msg: String| Err(Error::config(setting, msg));
        if !is_valid_node_id(&self.node_id) {
            return bad(
                "ManagerOptions::node_id",
                format!(
                    "node_id {:?} must be 1 to {MAX_NODE_ID_LEN} bytes of printable ASCII (it is stored as the session's application_name)",
                    self.node_id
                ),
            );
        }
        if self.namespace.contains('\0') {
            return bad(
                "ManagerOptions::namespace",
                "namespace must not contain a NUL character".to_owned(),
            );
        }
        if self.namespace.starts_with(crate::names::RESERVED_PREFIX) {
            return bad(
                "ManagerOptions::namespace",
                format!(
                    "namespace {:?} begins with {:?}, which is reserved for the library's own keys (stop fences, interest keys); choose a namespace without that prefix",
                    self.namespace,
                    crate::names::RESERVED_PREFIX
                ),
            );
        }
        if !is_plain_identifier(&self.lease_schema) {
            return bad(
                "ManagerOptions::lease_schema",
                format!(
                    "lease_schema {:?} is not a plain identifier: use a letter or _, then letters, digits or _, at most 63 bytes",
                    self.lease_schema
                ),
            );
        }
        if !self.pooled && self.pg.get_hosts().is_empty() {
            return bad(
                "connection settings: host",
                "the connection settings name no host; add host=... or a host to the URL"
                    .to_owned(),
            );
        }
        if !self.pooled && self.pg.get_user().is_none() {
            return bad(
                "connection settings: user",
                "the connection settings name no user; add user=... or a user to the URL"
                    .to_owned(),
            );
        }
        // Upper bounds first, so that no sum or product below can overflow.
        for (setting, name, value) in [
            (
                "ManagerOptions::heartbeat_interval",
                "heartbeat_interval",
                self.heartbeat_interval,
            ),
            (
                "ManagerOptions::lease_timeout",
                "lease_timeout",
                self.lease_timeout,
            ),
            (
                "ManagerOptions::stop_budget",
                "stop_budget",
                self.stop_budget,
            ),
            (
                "ManagerOptions::safety_margin",
                "safety_margin",
                self.safety_margin,
            ),
            (
                "ManagerOptions::server_release_after",
                "server_release_after",
                self.server_release_after,
            ),
            (
                "ManagerOptions::takeover_grace",
                "takeover_grace",
                self.takeover_grace,
            ),
        ] {
            if value > MAX_TIMING {
                return bad(
                    setting,
                    format!(
                        "{name} {value:?} is above the maximum of {MAX_TIMING_TEXT} ({MAX_TIMING:?})"
                    ),
                );
            }
        }
        if self.heartbeat_interval < Duration::from_millis(10) {
            return bad(
                "ManagerOptions::heartbeat_interval",
                format!(
                    "heartbeat_interval {:?} is below the minimum of 10 ms",
                    self.heartbeat_interval
                ),
            );
        }
        if self
            .heartbeat_interval
            .checked_mul(2)
            .is_none_or(|twice| self.lease_timeout < twice)
        {
            return bad(
                "ManagerOptions::lease_timeout",
                format!(
                    "lease_timeout {:?} must be at least twice heartbeat_interval {:?}, so that one slow heartbeat does not revoke every lease",
                    self.lease_timeout, self.heartbeat_interval
                ),
            );
        }
        if self.safety_margin < Duration::from_millis(100) {
            return bad(
                "ManagerOptions::safety_margin",
                format!(
                    "safety_margin {:?} is below the minimum of 100 ms",
                    self.safety_margin
                ),
            );
        }
        let needed = self
            .lease_timeout
            .checked_add(self.stop_budget)
            .and_then(|d| d.checked_add(self.safety_margin));
        if needed.is_none_or(|needed| needed >= self.server_release_after) {
            let needed = needed.map_or_else(
                || "more than Duration::MAX".to_owned(),
                |d| format!("{d:?}"),
            );
            return bad(
                "ManagerOptions::server_release_after",
                format!(
                    "timing invariant: lease_timeout {:?} + stop_budget {:?} + safety_margin {:?} = {needed} must be below server_release_after {:?}: raise it (at most {MAX_TIMING_TEXT}) or lower the others",
                    self.lease_timeout,
                    self.stop_budget,
                    self.safety_margin,
                    self.server_release_after,
                ),
            );
        }
        if !crate::names::POLL_INTERVAL_RANGE.contains(&self.poll_interval) {
            return bad(
                "ManagerOptions::poll_interval",
                format!(
                    "poll_interval {:?} is out of range: use between 10 ms and {MAX_WAIT_TEXT}",
                    self.poll_interval
                ),
            );
        }
        if self.connect_timeout.is_zero() || self.connect_timeout > MAX_WAIT {
            return bad(
                "ManagerOptions::connect_timeout",
                format!(
                    "connect_timeout {:?} is out of range: use more than zero and at most {MAX_WAIT_TEXT}",
                    self.connect_timeout
                ),
            );
        }
        if self.reconnect_min.is_zero()
            || self.reconnect_min > self.reconnect_max
            || self.reconnect_max > MAX_WAIT
        {
            return bad(
                "ManagerOptions::reconnect_backoff",
                format!(
                    "reconnect backoff {:?}..{:?} must satisfy 0 < min <= max <= {MAX_WAIT_TEXT}",
                    self.reconnect_min, self.reconnect_max
                ),
            );
        }
        if self.takeover_grace > self.lease_timeout {
            return bad(
                "ManagerOptions::takeover_grace",
                format!(
                    "takeover_grace {:?} must not exceed lease_timeout {:?}",
                    self.takeover_grace, self.lease_timeout
                ),
            );
        }
        if let Some(delay) = self.term_grant_delay
            && !delay.is_zero()
            && (delay < self.max_stop() || delay > MAX_TIMING)
        {
            return bad(
                "ManagerOptions::term_grant_delay",
                format!(
                    "term_grant_delay {delay:?} must be zero (unsafe: no delay) or between lease_timeout + stop_budget + safety_margin = {:?} and {MAX_TIMING_TEXT}",
                    self.max_stop()
                ),
            );
        }
        if self.token_epoch >= (1 << 15) - 1 {
            return bad(
                "ManagerOptions::token_epoch",
                format!(
                    "token_epoch {} is above the maximum of 32766 (a token carries the timeline, at least 1, plus the epoch in 15 bits)",
                    self.token_epoch
                ),
            );
        }
        if self.max_locks == 0 {
            return bad(
                "ManagerOptions::max_locks",
                "max_locks must be at least 1".to_owned(),
            );
        }
        if self.pg.get_ssl_mode() == tokio_postgres::config::SslMode::Require && !self.uses_tls() {
            return bad(
                "connection settings: sslmode",
                if cfg!(feature = "rustls") {
                    "sslmode=require needs TLS settings: pass a rustls::ClientConfig with ManagerOptions::rustls".to_owned()
                } else {
                    "sslmode=require needs TLS: enable the `rustls` feature of chosen-core and pass a rustls::ClientConfig with ManagerOptions::rustls".to_owned()
                },
            );
        }
        Ok(())
    }

    /// The connection settings as the lock session uses them: our node id as
    /// `application_name`, a connect timeout, and read-write targeting when several
    /// hosts are listed.
    pub(crate) fn session_config(&self) -> tokio_postgres::Config {
        let mut pg = self.pg.clone();
        pg.application_name(&self.node_id);
        if pg.get_connect_timeout().is_none() {
            pg.connect_timeout(self.connect_timeout);
        }
        if pg.get_hosts().len() > 1 && pg.get_target_session_attrs() == TargetSessionAttrs::Any {
            pg.target_session_attrs(TargetSessionAttrs::ReadWrite);
        }
        pg
    }

    /// `host:port, ...` for error messages; never credentials.
    pub(crate) fn target_description(&self) -> String {
        let ports = self.pg.get_ports();
        let mut out = Vec::new();
        for (i, host) in self.pg.get_hosts().iter().enumerate() {
            let port = ports
                .get(i)
                .or_else(|| ports.first())
                .copied()
                .unwrap_or(5432);
            match host {
                Host::Tcp(h) => out.push(format!("{h}:{port}")),
                #[cfg(unix)]
                Host::Unix(p) => out.push(format!("{}:{port}", p.display())),
            }
        }
        out.join(", ")
    }
}

/// A schema name chosen inlines in SQL: ASCII letters, digits and `_`, not starting
/// with a digit, 1 to 63 bytes.
pub(crate) fn is_plain_identifier(name: &str) -> bool {
    let bytes = name.as_bytes();
    (1..=63).contains(&bytes.len())
        && !bytes[0].is_ascii_digit()
        && bytes
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || *b == b'_')
}

pub(crate) fn default_node_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "node".to_owned());
    let host: String = host
        .chars()
        .filter(|c| c.is_ascii_graphic())
        .take(40)
        .collect();
    format!("{host}-{}", std::process::id())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts() -> ManagerOptions {
        ManagerOptions::from_url("postgres://u:hunter2@localhost:5433/db").unwrap()
    }

    #[test]
    fn defaults_are_valid() {
        opts().validate().unwrap();
        assert!(default_node_id().len() <= MAX_NODE_ID_LEN);
    }

    #[test]
    fn the_term_grant_delay_defaults_to_the_longest_stop() {
        assert_eq!(opts().get_term_grant_delay(), Duration::from_secs(6));
        let o = opts()
            .lease_timeout(Duration::from_secs(4))
            .server_release_after(Duration::from_secs(9));
        assert_eq!(o.get_term_grant_delay(), Duration::from_secs(7));
        opts().term_grant_delay(Duration::ZERO).validate().unwrap();
        opts()
            .term_grant_delay(Duration::from_secs(60))
            .validate()
            .unwrap();
    }

    #[test]
    fn debug_hides_password() {
        let text = format!("{:?}", opts());
        assert!(!text.contains("hunter2"), "{text}");
        let text = format!("{:?}", opts().session_config());
        assert!(!text.contains("hunter2"), "{text}");
    }

    #[test]
    fn invariant_violation_names_numbers() {
        let err = opts()
            .server_release_after(Duration::from_secs(5))
            .validate()
            .unwrap_err()
            .to_string();
        assert!(err.contains("timing invariant"), "{err}");
        assert!(err.contains("6s") && err.contains("5s"), "{err}");
    }

    #[test]
    fn bad_settings_are_rejected() {
        for o in [
            opts().node_id(""),
            opts().node_id("x".repeat(64)),
            opts().node_id("tab\there"),
            opts().namespace("a\0b"),
            opts().lease_timeout(Duration::from_millis(1500)),
            opts().poll_interval(Duration::from_millis(1)),
            opts().max_locks(0),
            opts().reconnect_backoff(Duration::from_secs(2), Duration::from_secs(1)),
            opts().term_grant_delay(Duration::from_secs(1)),
        ] {
            assert!(
                matches!(o.validate(), Err(Error::InvalidConfig { .. })),
                "{o:?}"
            );
        }
    }

    #[test]
    fn bad_url_is_a_clear_error_without_secrets() {
        let err = ManagerOptions::from_url("postgres://u:hunter2@host:notaport/db")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("invalid PostgreSQL connection string"),
            "{err}"
        );
        assert!(!err.contains("hunter2"), "{err}");
    }

    /// `validate` on `o` returns an error (it must not panic) whose message names
    /// `setting` and contains `bound`.
    fn rejected(o: &ManagerOptions, setting: &str, bound: &str) {
        let err = match o.validate() {
            Err(Error::InvalidConfig {
                setting: field,
                message,
            }) => {
                assert!(
                    field.starts_with("ManagerOptions::")
                        || field.starts_with("connection settings: "),
                    "{setting}: the setting field names a builder method or a connection parameter: {field}"
                );
                message
            }
            other => panic!("{setting}: expected InvalidConfig, got {other:?} for {o:?}"),
        };
        assert!(
            err.contains(setting) && err.contains(bound),
            "{setting}: the error must name the setting and the bound {bound:?}: {err}"
        );
        let shown = o
            .validate()
            .map_or_else(|e| e.to_string(), |()| String::new());
        assert!(
            !shown.contains('\n'),
            "{setting}: errors read in one line: {shown}"
        );
    }

    #[test]
    fn absurd_durations_are_errors_not_panics() {
        let huge = Duration::MAX / 2 + Duration::from_secs(1);
        for value in [Duration::MAX, huge, Duration::from_secs(u64::MAX / 3)] {
            rejected(
                &opts().heartbeat_interval(value),
                "heartbeat_interval",
                "24h",
            );
            rejected(&opts().lease_timeout(value), "lease_timeout", "24h");
            rejected(&opts().stop_budget(value), "stop_budget", "24h");
            rejected(&opts().safety_margin(value), "safety_margin", "24h");
            rejected(
                &opts().server_release_after(value),
                "server_release_after",
                "24h",
            );
            rejected(&opts().takeover_grace(value), "takeover_grace", "24h");
            rejected(&opts().term_grant_delay(value), "term_grant_delay", "24h");
            rejected(&opts().poll_interval(value), "poll_interval", "1h");
            rejected(&opts().connect_timeout(value), "connect_timeout", "1h");
            rejected(
                &opts().reconnect_backoff(Duration::from_millis(100), value),
                "reconnect backoff",
                "1h",
            );
            rejected(
                &opts().reconnect_backoff(value, value),
                "reconnect backoff",
                "1h",
            );
        }
        // Several large settings whose sum overflows a Duration.
        rejected(
            &opts()
                .lease_timeout(huge)
                .stop_budget(huge)
                .safety_margin(huge)
                .server_release_after(Duration::MAX),
            "lease_timeout",
            "24h",
        );
        // Large but each within bounds: the invariant still names the numbers.
        rejected(
            &opts()
                .heartbeat_interval(Duration::from_secs(10 * 3600))
                .lease_timeout(Duration::from_secs(20 * 3600))
                .stop_budget(Duration::from_secs(20 * 3600))
                .safety_margin(Duration::from_secs(20 * 3600))
                .server_release_after(Duration::from_secs(24 * 3600)),
            "timing invariant",
            "86400s",
        );
    }

    #[test]
    fn the_largest_accepted_settings_are_valid() {
        opts()
            .heartbeat_interval(Duration::from_secs(3600))
            .lease_timeout(Duration::from_secs(8 * 3600))
            .stop_budget(Duration::from_secs(8 * 3600))
            .safety_margin(Duration::from_secs(3600))
            .server_release_after(Duration::from_secs(24 * 3600))
            .takeover_grace(Duration::from_secs(3600))
            .poll_interval(Duration::from_secs(3600))
            .connect_timeout(Duration::from_secs(3600))
            .reconnect_backoff(Duration::from_secs(3600), Duration::from_secs(3600))
            .validate()
            .unwrap();
    }
}
