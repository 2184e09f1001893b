//! A [`Backend`] on the simulated [`Server`]: the real manager task, heartbeat and
//! everything above them run against it, on tokio's clock (paused in tests, so a run is
//! virtual time and replays from its seed).
//!
//! It keeps the seam's contract as the PostgreSQL backend does: a plan is sent on its
//! first poll and arrives after everything sent before it on the session (each
//! direction of a session is one ordered stream, as a TCP connection is), it runs at
//! one instant at the server, and its answer comes back after one latency;
//! notifications and the session's end arrive on the session's events, in order. A
//! statement of a session the server ended fails as a lost connection; dropping the
//! link closes the session at once.

mod rows;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use tokio::sync::mpsc;
use tokio::time::Instant;

use super::server::{Executed, Notice, Reply, Server};
use super::{MS, SEC, T, epoch_us};
use crate::backend::{
    Backend, BoxFuture, ConnEvent, HeartbeatLink, HolderAnswer, Link, Opened, Session,
};
use crate::engine::{Done, Term};
use crate::error::{Error, Result};
use crate::exclusion::{Seen, judge};
use crate::fault::Fault;
use crate::generation::Generation;
use crate::info::HolderInfo;
use crate::key::{LockKey, SessionLock};
use crate::options::ManagerOptions;
use crate::status::SessionDownReason;
use crate::table::Plan;
use crate::token::FencingToken;

/// How a simulated server, or a proxy in front of it, fails to keep an advisory lock
/// to the one session that took it (what the exclusion self-test must catch).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum Lie {
    /// It keeps them as PostgreSQL does.
    #[default]
    Not,
    /// A transaction pooler with one backend: every connection is served by it.
    SharesBackends,
    /// A transaction pooler with many backends: each statement runs on the one free
    /// at the time, rarely the same twice.
    SwapsBackends,
    /// Transaction poolers, one backend each, behind a balancer: the second connection
    /// lands in another pool, the session's statements stay on its backend, but what
    /// the server sends that backend while the session is idle never reaches it.
    BalancedPoolers,
    /// A balancer over several servers: the second connection reaches another one.
    BalancedServers,
    /// A stub that grants every key to everyone.
    GrantsEverything,
    /// A stub that refuses every key.
    RefusesEverything,
    /// The lock is gone right after it was taken (taken for the transaction only).
    ForgetsLocks,
}

/// A simulated server shared by the nodes of one run.
#[derive(Debug)]
pub(crate) struct SimServer {
    inner: Mutex<Inner>,
    /// Woken when a node's traffic is healed.
    healed: tokio::sync::Notify,
}

#[derive(Debug)]
struct Inner {
    model: Server,
    /// Virtual time zero.
    base: Instant,
    rng: u64,
    /// One-way latency, drawn in `[min, max]` microseconds.
    latency: (T, T),
    /// The live sessions' client ends.
    conns: BTreeMap<i32, Conn>,
    /// Node ids, by the index the model knows each node by.
    nodes: Vec<String>,
    /// What broke a rule of the protocol at the server, in order.
    violations: Vec<String>,
    /// Backends terminated (`pg_terminate_backend`, not a silent session given up):
    /// their node, when, and when their client heard of it.
    terminated: BTreeMap<i32, (String, Instant, Option<Instant>)>,
    /// The server itself (for tasks that wait for a heal).
    me: std::sync::Weak<SimServer>,
    /// Nodes whose traffic is black-holed: what they send and what is sent to them
    /// arrives once healed (TCP retransmits), unless the session ended meanwhile.
    cut: std::collections::BTreeSet<String>,
    /// When a statement last failed with its session intact.
    last_failure: Option<Instant>,
    /// How it keeps advisory locks.
    lie: Lie,
    /// Its sessions hold lease rows, not advisory locks (the lease-row mode).
    rows: Option<rows::RowsState>,
}

#[derive(Debug)]
struct Conn {
    node_id: String,
    events: mpsc::UnboundedSender<ConnEvent>,
    closed: Arc<AtomicBool>,
    /// Cancelled when the client learns the session ended: every request in flight on
    /// it fails then, as tokio-postgres fails them when the connection closes.
    ended: tokio_util::sync::CancellationToken,
    /// The server ended the backend; its client has not heard yet (the news is on its
    /// way, or held by a black hole).
    server_ended: bool,
    /// `UNLISTEN *` ran (a reset at shutdown): no more notifications.
    deaf: bool,
    /// When the last message towards the server and towards the client arrives:
    /// each direction is one ordered stream.
    last_up: Instant,
    last_down: Instant,
}

impl SimServer {
    /// A server up since long before the run, with one-way latencies of 0.2–2 ms
    /// drawn from `seed`.
    pub(crate) fn new(seed: u64) -> Arc<Self> {
        Arc::new_cyclic(|me| Self {
            inner: Mutex::new(Inner {
                me: me.clone(),
                model: Server::new(BTreeMap::new()),
                base: Instant::now(),
                rng: seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1,
                latency: (200, 2 * MS),
                conns: BTreeMap::new(),
                nodes: Vec::new(),
                violations: Vec::new(),
                cut: std::collections::BTreeSet::new(),
                last_failure: None,
                terminated: BTreeMap::new(),
                lie: Lie::Not,
                rows: None,
            }),
            healed: tokio::sync::Notify::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding it is a test failure already; the state stays readable.
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// From now on, sessions hold lease rows (the lease-row mode): set before any
    /// node connects.
    pub(crate) fn lease_rows(&self) {
        self.lock().rows = Some(rows::RowsState::default());
    }

    /// The backend holding `key` exclusively (in the lease-row mode, the session whose
    /// live row it is), if any.
    pub(crate) fn holder_of(&self, key: LockKey) -> Option<i32> {
        let inner = self.lock();
        if inner.rows.is_some() {
            let now = inner.now();
            return inner.model.live_row(key, now).map(|r| r.holder);
        }
        inner.model.excl.get(&key).copied()
    }

    /// Whether session `id` (a backend, or a lease-row holder) still holds `key` at the
    /// server, whether or not its client knows.
    pub(crate) fn holds(&self, id: i32, key: LockKey) -> bool {
        self.holder_of(key) == Some(id)
    }

    /// Whether session `id` still lives at the server holding what it held: a backend
    /// not ended (its locks go with it), or a lease-row holder whose row of `key` is
    /// live.
    pub(crate) fn session_lives(&self, id: i32, key: LockKey) -> bool {
        if self.lock().rows.is_some() {
            self.holds(id, key)
        } else {
            self.is_alive(id)
        }
    }

    /// The sessions of node `node_id` whose client has not closed them: its backends,
    /// or in the lease-row mode its holder ids.
    pub(crate) fn sessions_of(&self, node_id: &str) -> Vec<i32> {
        {
            let inner = self.lock();
            if let Some(rows) = &inner.rows {
                return rows
                    .holders
                    .iter()
                    .filter(|(_, (n, open))| n == node_id && *open)
                    .map(|(h, _)| *h)
                    .collect();
            }
        }
        self.backends_of(node_id)
    }

    /// Rows expire `after` their last renewal at most, whatever their sessions ask (a
    /// server that breaks the timing invariant).
    pub(crate) fn rows_expire_after(&self, after: Duration) {
        if let Some(rows) = &mut self.lock().rows {
            rows.max_ttl = Some(T::try_from(after.as_micros()).unwrap_or(T::MAX));
        }
    }

    /// Lease-row batches stop failing by themselves (each failure ends a session: in a
    /// fleet that must stay quiet, they would look like flapping).
    pub(crate) fn calm(&self) {
        if let Some(rows) = &mut self.lock().rows {
            rows.calm = true;
        }
    }

    /// The server's wall clock steps forward by `by` (the lease-row mode's expiries
    /// are by it).
    pub(crate) fn step_clock(&self, by: Duration) {
        let by = i64::try_from(by.as_micros()).unwrap_or(i64::MAX);
        self.lock().model.clock += by;
    }

    /// When a statement last failed with its session intact (a fault no node chose).
    pub(crate) fn last_failure(&self) -> Option<Instant> {
        self.lock().last_failure
    }

    /// Whether the server still has backend `pid` (it has not ended it, whether or not
    /// its client heard).
    pub(crate) fn is_alive(&self, pid: i32) -> bool {
        self.lock().model.backends.contains_key(&pid)
    }

    /// From now on, the server keeps advisory locks as `lie` says.
    pub(crate) fn lie(&self, lie: Lie) {
        self.lock().lie = lie;
    }

    /// What the exclusion self-test's three steps see from session `pid` (see
    /// [`crate::exclusion`]), run at one instant: the key is the session's own, so
    /// nothing else is held under it, and both connections release what they took.
    fn test_exclusion(&self, pid: i32) -> Seen {
        let mut inner = self.lock();
        let lie = inner.lie;
        let mut fresh = || {
            inner.model.next_pid += 1;
            inner.model.next_pid
        };
        let other = if lie == Lie::SharesBackends {
            pid
        } else {
            fresh()
        };
        let after = if lie == Lie::SwapsBackends {
            fresh()
        } else {
            pid
        };
        let took = lie != Lie::RefusesEverything;
        let pooled = matches!(
            lie,
            Lie::SharesBackends | Lie::SwapsBackends | Lie::BalancedPoolers
        );
        Seen {
            ours: pid,
            took,
            same_server: lie != Lie::BalancedServers,
            notified: !pooled && lie != Lie::BalancedServers,
            other,
            // Re-entrantly on the same backend.
            other_granted: (other == pid && took) || lie == Lie::GrantsEverything,
            after,
            released: took && after == pid && lie != Lie::ForgetsLocks,
        }
    }

    /// The live backends of node `node_id`.
    pub(crate) fn backends_of(&self, node_id: &str) -> Vec<i32> {
        let inner = self.lock();
        inner
            .conns
            .iter()
            .filter(|(_, c)| c.node_id == node_id)
            .map(|(pid, _)| *pid)
            .collect()
    }

    /// `pg_terminate_backend(pid)`: the server ends the session and frees its locks;
    /// its client hears of it after one latency (once healed, if cut off), after every
    /// earlier message, and every request in flight on it fails then.
    pub(crate) fn terminate(self: &Arc<Self>, pid: i32) {
        self.end_session(pid, false);
    }

    /// The server ends backend `pid`: terminated, or (`idle`) given up as silent or
    /// ended with the whole server (neither is a known gap of the checks).
    fn end_session(self: &Arc<Self>, pid: i32, idle: bool) {
        let mut inner = self.lock();
        let now = inner.now();
        if inner.model.end_backend(pid, now, true).is_none() {
            return;
        }
        // A pooled connection of the lease-row mode: what is in flight on it fails, the
        // next batch takes another connection; no lock is freed, nothing to hear.
        if inner.rows.is_some() {
            if let Some(conn) = inner.conns.remove(&pid) {
                conn.ended.cancel();
            }
            return;
        }
        let latency = inner.latency();
        let Some(conn) = inner.conns.get_mut(&pid) else {
            return;
        };
        conn.server_ended = true;
        if !idle {
            let node_id = conn.node_id.clone();
            inner
                .terminated
                .insert(pid, (node_id, Instant::now(), None));
        }
        let Some(conn) = inner.conns.get_mut(&pid) else {
            return;
        };
        let at = (Instant::now() + latency).max(conn.last_down + Duration::from_micros(1));
        conn.last_down = at;
        let node_id = conn.node_id.clone();
        drop(inner);
        let server = Arc::clone(self);
        tokio::spawn(async move {
            tokio::time::sleep_until(at).await;
            server.until_healed(&node_id).await;
            let conn = {
                let mut inner = server.lock();
                if let Some(t) = inner.terminated.get_mut(&pid) {
                    t.2.get_or_insert_with(Instant::now);
                }
                inner.conns.remove(&pid)
            };
            if let Some(conn) = conn {
                conn.closed.store(true, Ordering::Release);
                let _ = conn.events.send(ConnEvent::Closed(
                    "terminating connection due to administrator command".into(),
                ));
                conn.ended.cancel();
            }
        });
    }

    /// The server goes down for `down` (every backend ends; its client hears of it as
    /// of a termination) and comes back: restarted, or (`promotion`) a standby
    /// promoted, on the next timeline, with transaction ids up to `lag` behind. Until
    /// it is back, connecting fails. Its new term's age is unknown for a while after a
    /// promotion (the end-of-recovery checkpoint), up to 8 s.
    pub(crate) fn restart(self: &Arc<Self>, down: Duration, promotion: Option<u64>) {
        let pids: Vec<i32> = {
            let mut inner = self.lock();
            let now = inner.now();
            // Down already: once at a time (its own coming back is due).
            if !inner.model.up {
                return;
            }
            inner.model.up = false;
            inner.model.ended = Some(now);
            inner.model.backends.keys().copied().collect()
        };
        // Not the known gap of a termination: the new term's hold keeps every node
        // from being granted before each old holder's lease ran out.
        for pid in pids {
            self.end_session(pid, true);
        }
        let server = Arc::downgrade(self);
        tokio::spawn(async move {
            tokio::time::sleep(down).await;
            let Some(server) = server.upgrade() else {
                return;
            };
            let mut inner = server.lock();
            let now = inner.now();
            let unknown = crate::table::next_random(&mut inner.rng) % (8 * SEC);
            let model = &mut inner.model;
            model.up = true;
            model.started = Some(now);
            model.started_wall = Some(now as i64 + model.clock);
            model.age_unknown_until = 0;
            model.clock_at_start = model.clock;
            if let Some(lag) = promotion {
                model.timeline += 1;
                model.xid = model.xid.saturating_sub(lag);
                model.age_unknown_until = now + unknown;
                // The standby had not replayed the last `lag` of history: some 160 ms
                // of rows each, up to 8 s (lost renewals, lost takes: longer than a
                // row's slack, so that only the new term's hold keeps tenures apart).
                let down_at = model.ended.unwrap_or(now);
                model.lose_recent_rows(down_at, (lag * 160 * MS).min(8 * SEC));
            }
        });
    }

    /// Returns once node `node_id`'s traffic flows.
    async fn until_healed(&self, node_id: &str) {
        loop {
            let healed = self.healed.notified();
            tokio::pin!(healed);
            healed.as_mut().enable();
            if !self.lock().cut.contains(node_id) {
                return;
            }
            healed.await;
        }
    }

    /// A session of node `node_id` was terminated (not given up as silent) within
    /// `within`, and its client has not heard of it, or heard of it within `heard`.
    pub(crate) fn terminated_unheard(
        &self,
        node_id: &str,
        within: Duration,
        heard: Duration,
    ) -> bool {
        let now = Instant::now();
        self.lock().terminated.values().any(|(node, at, heard_at)| {
            node == node_id
                && now.duration_since(*at) <= within
                && heard_at.is_none_or(|h| now.duration_since(h) <= heard)
        })
    }

    /// Node `node_id`'s traffic is black-holed now.
    pub(crate) fn is_cut(&self, node_id: &str) -> bool {
        self.lock().cut.contains(node_id)
    }

    /// Black-holes node `node_id`'s traffic (`true`) or heals it. What is sent either
    /// way meanwhile arrives once healed, as TCP retransmits it.
    pub(crate) fn cut(&self, node_id: &str, cut: bool) {
        let mut inner = self.lock();
        if cut {
            inner.cut.insert(node_id.to_owned());
        } else {
            inner.cut.remove(node_id);
            drop(inner);
            self.healed.notify_waiters();
        }
    }

    /// Ends every backend no statement has reached for `after`, checked every
    /// `every`, as the server's idle and keepalive timeouts do (what frees the locks of
    /// a process cut off from the server).
    pub(crate) fn reap_idle(self: &Arc<Self>, after: Duration, every: Duration) {
        let server = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                let Some(server) = server.upgrade() else {
                    return;
                };
                let idle: Vec<i32> = {
                    let inner = server.lock();
                    let now = inner.now();
                    let after = T::try_from(after.as_micros()).unwrap_or(T::MAX);
                    inner
                        .model
                        .backends
                        .iter()
                        .filter(|(_, b)| now.saturating_sub(b.last) >= after)
                        .map(|(pid, _)| *pid)
                        .collect()
                };
                for pid in idle {
                    server.end_session(pid, true);
                }
            }
        });
    }

    /// What broke a rule of the protocol at the server so far.
    pub(crate) fn violations(&self) -> Vec<String> {
        self.lock().violations.clone()
    }
}

impl Inner {
    fn now(&self) -> T {
        T::try_from(Instant::now().duration_since(self.base).as_micros()).unwrap_or(T::MAX)
    }

    fn latency(&mut self) -> Duration {
        let (lo, hi) = self.latency;
        let r = crate::table::next_random(&mut self.rng);
        Duration::from_micros(lo + r % (hi - lo + 1))
    }

    /// When a message sent now towards the server on `pid`'s session arrives.
    fn arrival_up(&mut self, pid: i32) -> Instant {
        let at = Instant::now() + self.latency();
        match self.conns.get_mut(&pid) {
            Some(conn) => {
                let at = at.max(conn.last_up + Duration::from_micros(1));
                conn.last_up = at;
                at
            }
            None => at,
        }
    }

    /// Now and then a statement fails with the session intact, in each way the server
    /// fails one (as the engine simulation draws them).
    fn failing(&mut self) -> &'static str {
        if !crate::table::next_random(&mut self.rng).is_multiple_of(100) {
            return "";
        }
        self.last_failure = Some(Instant::now());
        match crate::table::next_random(&mut self.rng) % 4 {
            0 => "try_failed",
            1 => "lock_table_full",
            2 => "check_failed",
            _ => "token_failed",
        }
    }

    fn node_index(&mut self, node_id: &str) -> usize {
        match self.nodes.iter().position(|n| n == node_id) {
            Some(i) => i,
            None => {
                self.nodes.push(node_id.to_owned());
                self.nodes.len() - 1
            }
        }
    }

    fn holder_info(&self, pid: i32) -> HolderInfo {
        let start = self.model.start_of(pid).map_or(0, epoch_us);
        HolderInfo {
            node_id: self
                .conns
                .get(&pid)
                .map(|c| c.node_id.clone())
                .unwrap_or_default(),
            backend_pid: pid,
            client_addr: None,
            session_start: Some(
                SystemTime::UNIX_EPOCH + Duration::from_micros(u64::try_from(start).unwrap_or(0)),
            ),
        }
    }

    /// Sends each listener its announcement, after a latency, in its stream's order.
    fn send_notices(&mut self, notices: Vec<Notice>) {
        for notice in notices {
            let Some(conn) = self.conns.get(&notice.to) else {
                continue;
            };
            if conn.deaf || conn.server_ended {
                continue;
            }
            let events = conn.events.clone();
            let node_id = conn.node_id.clone();
            let last_down = conn.last_down;
            let at = (Instant::now() + self.latency()).max(last_down + Duration::from_micros(1));
            if let Some(c) = self.conns.get_mut(&notice.to) {
                c.last_down = at;
            }
            let targets: BTreeMap<LockKey, u64> = notice.hand.iter().copied().collect();
            let payload = notice
                .keys
                .iter()
                .map(|k| k.announcement(targets.get(k).copied()))
                .collect::<Vec<_>>()
                .join(",");
            let sender = notice.sender;
            let server = self.me.clone();
            // Stamped when the client's connection task reads it.
            tokio::spawn(async move {
                tokio::time::sleep_until(at).await;
                if let Some(server) = server.upgrade() {
                    server.until_healed(&node_id).await;
                }
                let _ = events.send(ConnEvent::Notification {
                    sender,
                    payload,
                    at: crate::clock::now(),
                });
            });
        }
    }
}

/// The sessions of one node on a [`SimServer`].
#[derive(Debug)]
pub(crate) struct SimBackend {
    server: Arc<SimServer>,
    seed: u64,
    /// The node's process died: it connects no more.
    dead: Arc<AtomicBool>,
    /// The identity of the server the exclusion self-test last passed on.
    proven: Mutex<Option<String>>,
}

impl SimBackend {
    pub(crate) fn new(server: Arc<SimServer>, seed: u64) -> Self {
        Self {
            server,
            seed,
            dead: Arc::new(AtomicBool::new(false)),
            proven: Mutex::new(None),
        }
    }

    /// The node's process dies (`kill -9`): its kernel closes its connections, so the
    /// server ends each of its backends (at once, or once healed if the node is cut
    /// off), freeing their locks with nothing announced; its tasks (still in this
    /// runtime) never reach the server again, as a dead process sends nothing.
    pub(crate) fn die(&self, node_id: &str) {
        self.dead.store(true, Ordering::Release);
        if let Some(rows) = &mut self.server.lock().rows {
            for (node, open) in rows.holders.values_mut() {
                if node == node_id {
                    *open = false;
                }
            }
        }
        for pid in self.server.backends_of(node_id) {
            self.server.close(pid);
        }
    }

    /// A dead process does nothing: what it would have sent is never sent.
    async fn unless_dead(&self) {
        if self.dead.load(Ordering::Acquire) {
            std::future::pending::<()>().await;
        }
    }
}

impl Backend for SimBackend {
    fn connect<'a>(
        &'a self,
        options: &'a ManagerOptions,
        generation: u64,
    ) -> BoxFuture<'a, Result<Session>> {
        Box::pin(async move {
            self.unless_dead().await;
            let sent = crate::clock::now();
            let up = {
                let mut inner = self.server.lock();
                (!inner.cut.contains(&options.node_id)).then(|| inner.latency())
            };
            let Some(up) = up else {
                // Black-holed: the connect attempt times out.
                tokio::time::sleep(options.connect_timeout).await;
                return Err(Error::NotConnected(SessionDownReason::ConnectFailed {
                    message: "timeout expired (simulated)".into(),
                }));
            };
            tokio::time::sleep(up).await;
            self.unless_dead().await;
            let opened = {
                let mut inner = self.server.lock();
                let now = inner.now();
                let n = inner.node_index(&options.node_id);
                let inst = u32::try_from(generation).unwrap_or(u32::MAX);
                let connected = inner.model.connect(n, inst, now, 0);
                let down = inner.latency();
                connected
                    .map(|connected| {
                        let (tx, rx) = mpsc::unbounded_channel();
                        let closed = Arc::new(AtomicBool::new(false));
                        inner.conns.insert(
                            connected.pid,
                            Conn {
                                node_id: options.node_id.clone(),
                                events: tx,
                                closed: Arc::clone(&closed),
                                ended: tokio_util::sync::CancellationToken::new(),
                                server_ended: false,
                                deaf: false,
                                last_up: Instant::now(),
                                last_down: Instant::now() + down,
                            },
                        );
                        (connected, rx, closed, down)
                    })
                    .ok_or(down)
            };
            let (connected, events, closed, down) = match opened {
                Ok(opened) => opened,
                Err(down) => {
                    tokio::time::sleep(down).await;
                    return Err(Error::NotConnected(SessionDownReason::ConnectFailed {
                        message: "the database system is shutting down (simulated)".into(),
                    }));
                }
            };
            tokio::time::sleep(down).await;
            let term = Term {
                timeline: connected.high,
                age: connected.term_age.map(Duration::from_micros),
                identity: connected.identity.clone(),
                first_token: FencingToken::from_parts(connected.high, connected.first_xid),
                system_id: connected.system.to_string(),
                read_at: crate::clock::now(),
            };
            // The lease-row mode: no self-test (no advisory lock is trusted), a holder
            // id for the session, the connection its first pooled one.
            let holder = {
                let mut inner = self.server.lock();
                inner
                    .rows
                    .is_some()
                    .then(|| inner.new_holder(&options.node_id))
            };
            if let Some(holder) = holder {
                let (events_tx, events_rx) = mpsc::unbounded_channel();
                let session = Arc::new(rows::RowsSession {
                    server: Arc::clone(&self.server),
                    holder,
                    start: epoch_us(connected.ready),
                    node_id: options.node_id.clone(),
                    identity: connected.identity.clone(),
                    high: connected.high,
                    ttl: T::try_from(options.server_release_after.as_micros()).unwrap_or(T::MAX),
                    timeout: options.lease_timeout,
                    stop_budget: options.stop_budget,
                    dead: Arc::clone(&self.dead),
                    conn: Mutex::new(Some(connected.pid)),
                    turn: tokio::sync::Mutex::new(()),
                });
                drop(events);
                return Ok(Session::new(
                    Box::new(rows::SimRowsLink {
                        session,
                        _events: events_tx,
                    }),
                    Opened {
                        backend_pid: holder,
                        server: "simulated".into(),
                        generation: Generation::new(generation),
                        events: events_rx,
                        proven_at: sent,
                        term,
                    },
                ));
            }
            // The exclusion self-test, once per server identity (as the PostgreSQL
            // backend runs it), in no time of its own.
            let mut proven = self
                .proven
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if options.exclusion_self_test && proven.as_deref() != Some(connected.identity.as_str())
            {
                if let Err(reason) = judge(&self.server.test_exclusion(connected.pid)) {
                    *proven = None;
                    drop(proven);
                    self.server.close(connected.pid);
                    return Err(Error::Refused(reason));
                }
                *proven = Some(connected.identity.clone());
            }
            drop(proven);
            let link = SimLink {
                server: Arc::clone(&self.server),
                pid: connected.pid,
                closed,
            };
            Ok(Session::new(
                Box::new(link),
                Opened {
                    backend_pid: connected.pid,
                    server: "simulated".into(),
                    generation: Generation::new(generation),
                    events,
                    proven_at: sent,
                    term,
                },
            ))
        })
    }

    fn seed(&self) -> Option<u64> {
        Some(self.seed)
    }

    fn holds_rows(&self) -> bool {
        self.server.lock().rows.is_some()
    }

    fn forget_proven(&self) {
        *self
            .proven
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = None;
    }
}

/// One session on a [`SimServer`].
struct SimLink {
    server: Arc<SimServer>,
    pid: i32,
    closed: Arc<AtomicBool>,
}

impl Drop for SimLink {
    fn drop(&mut self) {
        self.closed.store(true, Ordering::Release);
        self.server.close(self.pid);
    }
}

impl SimServer {
    /// The client closes backend `pid`'s connection: the server ends the backend once
    /// the close reaches it (at once, unless the node is cut off: then when healed, or
    /// when the server gives the silent session up). What the client had in flight on
    /// it fails.
    fn close(&self, pid: i32) {
        let mut inner = self.lock();
        let Some(conn) = inner.conns.remove(&pid) else {
            return;
        };
        conn.closed.store(true, Ordering::Release);
        conn.ended.cancel();
        if let Some(t) = inner.terminated.get_mut(&pid) {
            t.2.get_or_insert_with(Instant::now);
        }
        if inner.cut.contains(&conn.node_id) {
            let server = inner.me.clone();
            let node_id = conn.node_id;
            drop(inner);
            tokio::spawn(async move {
                let Some(server) = server.upgrade() else {
                    return;
                };
                server.until_healed(&node_id).await;
                let mut inner = server.lock();
                let now = inner.now();
                inner.model.end_backend(pid, now, false);
            });
        } else {
            let now = inner.now();
            inner.model.end_backend(pid, now, false);
        }
    }
}

fn lost() -> Fault {
    Fault::Lost(SessionDownReason::ConnectionLost {
        message: "server closed the connection unexpectedly (simulated)".into(),
    })
}

/// One round trip on `pid`'s session: `run` at the server when the message arrives,
/// its answer after one latency (each way held while the node is cut off); `None`
/// when the session is gone by then, or its client learns it ended meanwhile.
async fn round_trip<R>(
    server: &SimServer,
    pid: i32,
    run: impl FnOnce(&mut Inner, T) -> R,
) -> Option<R> {
    let (ended, node_id) = {
        let inner = server.lock();
        let conn = inner.conns.get(&pid)?;
        (conn.ended.clone(), conn.node_id.clone())
    };
    let trip = async {
        // Its place in the session's stream is taken when it is sent.
        let arrival = server.lock().arrival_up(pid);
        tokio::time::sleep_until(arrival).await;
        // Cut off while on its way: it arrives once healed.
        server.until_healed(&node_id).await;
        let outcome = {
            let mut inner = server.lock();
            match inner.conns.get(&pid) {
                None => return None,
                // The backend is gone: the client learns it with the session's end
                // (the `ended` branch below), not before.
                Some(c) if c.server_ended => None,
                Some(_) => {
                    let now = inner.now();
                    inner.model.touch(pid, now);
                    let answer = run(&mut inner, now);
                    let at = Instant::now() + inner.latency();
                    let back = match inner.conns.get_mut(&pid) {
                        Some(conn) => {
                            let at = at.max(conn.last_down + Duration::from_micros(1));
                            conn.last_down = at;
                            at
                        }
                        None => at,
                    };
                    Some((answer, back))
                }
            }
        };
        let Some((answer, back)) = outcome else {
            return std::future::pending().await;
        };
        tokio::time::sleep_until(back).await;
        server.until_healed(&node_id).await;
        Some(answer)
    };
    tokio::select! {
        biased;
        () = ended.cancelled() => None,
        answer = trip => answer,
    }
}

impl SimLink {
    async fn round_trip<R>(
        &self,
        run: impl FnOnce(&mut Inner, T) -> R,
    ) -> std::result::Result<R, Fault> {
        round_trip(&self.server, self.pid, run)
            .await
            .ok_or_else(lost)
    }
}

impl Link for SimLink {
    fn perform<'a>(
        &'a self,
        plan: &'a Plan,
    ) -> BoxFuture<'a, std::result::Result<(Done, Option<tokio_postgres::Error>), Fault>> {
        Box::pin(async move {
            let pid = self.pid;
            let reply = self
                .round_trip(|inner, now| {
                    let n = inner.model.backends.get(&pid).map_or(0, |b| b.n);
                    let Executed {
                        reply,
                        violations,
                        notices,
                        ..
                    } = {
                        let failing = inner.failing();
                        inner.model.execute(n, pid, plan, now, failing)
                    };
                    inner.violations.extend(violations);
                    for each in notices {
                        inner.send_notices(each);
                    }
                    reply
                })
                .await?;
            let Reply {
                token,
                tried,
                registered,
                senders,
                fenced,
                checked,
                try_failed,
                locks_gone,
                ..
            } = reply;
            if locks_gone {
                return Err(Fault::Lost(SessionDownReason::PoolerDetected {
                    detail: "the keys of a hand-off are no longer held by this session".into(),
                }));
            }
            Ok((
                Done {
                    token,
                    tried: try_failed.map_or(Ok(tried), Err),
                    registered,
                    seen_held: Vec::new(),
                    senders,
                    fenced,
                    checked,
                },
                None,
            ))
        })
    }

    fn holders<'a>(
        &'a self,
        keys: &'a [LockKey],
    ) -> BoxFuture<'a, std::result::Result<Vec<HolderAnswer>, Fault>> {
        Box::pin(self.round_trip(move |inner, _| {
            keys.iter()
                .map(|k| Ok(inner.model.excl.get(k).map(|pid| inner.holder_info(*pid))))
                .collect()
        }))
    }

    fn cluster(&self) -> BoxFuture<'_, std::result::Result<Vec<(LockKey, HolderInfo)>, Fault>> {
        Box::pin(self.round_trip(|inner, _| {
            inner
                .model
                .excl
                .iter()
                .map(|(k, pid)| (*k, inner.holder_info(*pid)))
                .collect()
        }))
    }

    fn reset(&self) -> BoxFuture<'_, std::result::Result<(), Fault>> {
        let pid = self.pid;
        // `RESET ALL; UNLISTEN *`.
        Box::pin(self.round_trip(move |inner, _| {
            if let Some(conn) = inner.conns.get_mut(&pid) {
                conn.deaf = true;
            }
        }))
    }

    fn heartbeat_link(&self) -> Box<dyn HeartbeatLink> {
        Box::new(SimHeartbeat {
            link: SimLinkRef {
                server: Arc::clone(&self.server),
                pid: self.pid,
            },
        })
    }

    fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }
}

/// The heartbeat's handle on a session: no ownership of it (dropping it closes
/// nothing).
struct SimLinkRef {
    server: Arc<SimServer>,
    pid: i32,
}

struct SimHeartbeat {
    link: SimLinkRef,
}

impl HeartbeatLink for SimHeartbeat {
    fn heartbeat(&self) -> BoxFuture<'_, std::result::Result<Vec<SessionLock>, SessionDownReason>> {
        Box::pin(async move {
            let SimLinkRef { server, pid } = &self.link;
            let pid = *pid;
            round_trip(server, pid, move |inner, _| inner.model.locks_of(pid))
                .await
                .ok_or_else(|| SessionDownReason::ConnectionLost {
                    message: "server closed the connection unexpectedly (simulated)".into(),
                })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::LockManager;

    async fn manager(server: &Arc<SimServer>, node: &str, seed: u64) -> LockManager {
        let options = ManagerOptions::from_url("postgres://sim@localhost/sim")
            .expect("BUG: static URL parses")
            .node_id(node);
        LockManager::connect_with(options, Arc::new(SimBackend::new(Arc::clone(server), seed)))
            .await
            .expect("the simulated server is up")
    }

    /// A takeover after the holder's backend is terminated: when the holder learned it
    /// lost the lease, when the waiting node got the lock (both from the termination),
    /// and their tokens. `stop`: the holder stops its work once it learns of the loss.
    async fn takeover(seed: u64, stop: bool) -> (Duration, Duration, FencingToken, FencingToken) {
        let server = SimServer::new(seed);
        let a = manager(&server, "a", seed + 1).await;
        let b = manager(&server, "b", seed + 2).await;
        let lease_a = a.acquire("job").await.unwrap();
        let token_a = lease_a
            .fencing_token()
            .await
            .expect("the holder reads its token");
        let waiting = tokio::spawn({
            let b = b.clone();
            async move { b.acquire("job").await }
        });
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(!waiting.is_finished(), "the lock is held");
        let pid = server.holder_of(lease_a.key()).expect("a holds the key");
        assert_eq!(server.backends_of("a"), vec![pid]);
        server.terminate(pid);
        let start = Instant::now();
        tokio::time::timeout(Duration::from_secs(10), lease_a.lost())
            .await
            .expect("the holder learns it lost the lease");
        let lost_after = start.elapsed();
        let kept = if stop {
            // Its work stops: the stop fence its next session took is released.
            drop(lease_a);
            None
        } else {
            Some(lease_a)
        };
        let lease_b = tokio::time::timeout(Duration::from_secs(30), waiting)
            .await
            .expect("the waiting node gets the lock")
            .unwrap()
            .unwrap();
        let granted_after = start.elapsed();
        assert!(server.violations().is_empty(), "{:?}", server.violations());
        let token_b = lease_b
            .fencing_token()
            .await
            .expect("the new holder reads its token");
        drop((kept, lease_b));
        a.shutdown().await;
        b.shutdown().await;
        (lost_after, granted_after, token_a, token_b)
    }

    /// The real manager task on the simulated server: a waiting node gets the lock only
    /// once the holder's backend was terminated and the holder has lost its lease and
    /// stopped, with a greater token, within a poll and the takeover grace.
    #[tokio::test(start_paused = true)]
    async fn a_waiting_node_gets_the_lock_after_the_holders_backend_is_terminated() {
        let (lost, granted, token_a, token_b) = takeover(7, true).await;
        assert!(token_b > token_a);
        assert!(
            granted >= lost,
            "granted {granted:?} before the holder knew it lost at {lost:?}"
        );
        assert!(
            granted < Duration::from_secs(1),
            "a poll and a grace: {granted:?}"
        );
    }

    /// A holder whose work does not stop keeps the key fenced: the waiting node gets it
    /// only once the holder's stop budget has run out.
    #[tokio::test(start_paused = true)]
    async fn a_holder_that_does_not_stop_keeps_the_lock_fenced_for_its_stop_budget() {
        let (lost, granted, token_a, token_b) = takeover(7, false).await;
        assert!(token_b > token_a);
        assert!(
            granted >= lost + Duration::from_secs(2),
            "granted {granted:?}, the holder lost at {lost:?}, its stop budget is 2 s"
        );
    }

    /// The exclusion self-test against servers (or proxies) that only pretend to keep
    /// an advisory lock to one session: each is refused at connect, with the reason
    /// that names what it does, and leaves no backend behind; an honest one is not.
    #[tokio::test(start_paused = true)]
    async fn a_server_that_does_not_keep_a_lock_to_one_session_is_refused_at_connect() {
        let cases = [
            (Lie::SharesBackends, "pooler_detected"),
            (Lie::SwapsBackends, "pooler_detected"),
            (Lie::BalancedPoolers, "pooler_detected"),
            (Lie::BalancedServers, "advisory_locks_unsafe"),
            (Lie::GrantsEverything, "advisory_locks_unsafe"),
            (Lie::RefusesEverything, "advisory_locks_unsafe"),
            (Lie::ForgetsLocks, "advisory_locks_unsafe"),
        ];
        for (lie, label) in cases {
            let server = SimServer::new(5);
            server.lie(lie);
            let options = ManagerOptions::from_url("postgres://sim@localhost/sim")
                .expect("BUG: static URL parses")
                .node_id("liar");
            let refused = LockManager::connect_with(
                options,
                Arc::new(SimBackend::new(Arc::clone(&server), 1)),
            )
            .await
            .err();
            match &refused {
                Some(Error::Refused(reason)) if reason.label() == label => {}
                other => panic!("{lie:?}: refused as {label} expected, got {other:?}"),
            }
            assert!(server.backends_of("liar").is_empty(), "{lie:?}");
        }
        let server = SimServer::new(5);
        let honest = manager(&server, "honest", 1).await;
        honest
            .acquire("job")
            .await
            .unwrap()
            .release()
            .await
            .unwrap();
        honest.shutdown().await;
    }

    /// The self-test runs once per server identity: a reconnect to the proven server
    /// runs none (it stays as fast as the stop fences need), a new term of the server is
    /// tested again.
    #[tokio::test(start_paused = true)]
    async fn the_exclusion_self_test_runs_once_per_server() {
        let server = SimServer::new(9);
        let backend = SimBackend::new(Arc::clone(&server), 1);
        let options = ManagerOptions::from_url("postgres://sim@localhost/sim")
            .expect("BUG: static URL parses")
            .node_id("n");
        let first = backend.connect(&options, 1).await.expect("honest");
        server.lie(Lie::BalancedPoolers);
        let again = backend.connect(&options, 2).await.expect("already proven");
        drop((first, again));
        server.restart(Duration::from_millis(500), None);
        tokio::time::sleep(Duration::from_secs(1)).await;
        match backend.connect(&options, 3).await.err() {
            Some(Error::Refused(SessionDownReason::PoolerDetected { .. })) => {}
            other => panic!("a new term is tested again: {other:?}"),
        }
    }

    /// One seed, one history: the same run twice takes the same virtual times and
    /// issues the same tokens.
    #[tokio::test(start_paused = true)]
    async fn a_simulated_run_replays_exactly() {
        let first = takeover(42, true).await;
        let second = takeover(42, true).await;
        assert_eq!(first, second);
    }

    /// A graceful release is announced: the waiting node takes the lock at once.
    #[tokio::test(start_paused = true)]
    async fn a_released_lock_is_announced_and_taken_at_once() {
        let server = SimServer::new(11);
        let a = manager(&server, "a", 1).await;
        let b = manager(&server, "b", 2).await;
        let lease_a = a.acquire("job").await.unwrap();
        let waiting = tokio::spawn({
            let b = b.clone();
            async move { b.acquire("job").await }
        });
        tokio::time::sleep(Duration::from_secs(3)).await;
        let start = Instant::now();
        lease_a.release().await.unwrap();
        let lease_b = tokio::time::timeout(Duration::from_secs(30), waiting)
            .await
            .expect("the waiting node gets the lock")
            .unwrap()
            .unwrap();
        assert!(
            start.elapsed() < Duration::from_millis(50),
            "announced, not polled: {:?}",
            start.elapsed()
        );
        assert!(lease_b.is_valid());
        assert!(server.violations().is_empty(), "{:?}", server.violations());
        a.shutdown().await;
        b.shutdown().await;
    }
}
