//! The manager's task: the only code that touches the connection.
//!
//! It keeps, per key, one local owner and a FIFO queue of waiters; tries every due key
//! in one statement; runs the heartbeat; and ends the generation (revoking every lease
//! at once) *before* it reconnects.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use tokio::sync::mpsc::{UnboundedReceiver, WeakUnboundedSender};
use tokio::sync::oneshot;
use tokio::time::sleep_until;
use tokio_postgres::error::SqlState;
use tracing::{debug, info, warn};

use crate::error::{Error, Result};
use crate::key::LockKey;
use crate::lease::{FencingToken, Lease};
use crate::manager::{HolderInfo, LockInfo, LockState};
use crate::session::{self, ConnEvent, Fault, Generation, Session, classify, error_text};
use crate::shared::Shared;
use crate::status::{ConnectionStatus, DisconnectReason};

pub(crate) enum Command {
    Acquire(Waiter),
    Release {
        key: LockKey,
        lease_id: u64,
        reply: Option<oneshot::Sender<Result<()>>>,
    },
    Locks(oneshot::Sender<Vec<LockInfo>>),
    Holder {
        key: LockKey,
        reply: oneshot::Sender<Result<Option<HolderInfo>>>,
    },
    Cluster(ClusterReply),
    Shutdown(oneshot::Sender<()>),
}

/// Where the rows of a cluster view go.
pub(crate) type ClusterReply = oneshot::Sender<Result<Vec<(LockKey, HolderInfo)>>>;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    Wait,
    Try,
}

pub(crate) struct Waiter {
    pub(crate) id: u64,
    pub(crate) key: LockKey,
    pub(crate) name: Arc<str>,
    pub(crate) poll_interval: Duration,
    pub(crate) mode: Mode,
    pub(crate) since: SystemTime,
    pub(crate) enqueued: Instant,
    pub(crate) reply: oneshot::Sender<Result<Option<Lease>>>,
}

struct Holder {
    id: u64,
    token: FencingToken,
    since: SystemTime,
    generation: u64,
}

/// One key. Invariant between steps: the session holds the key at the server iff
/// `holder` or `granting` is `Some`, or the key is in `Driver::unlocks`.
struct Slot {
    name: Arc<str>,
    holder: Option<Holder>,
    waiters: VecDeque<Waiter>,
    next_try: Instant,
    /// A release of this key was announced since it was last tried.
    announced: bool,
    /// A try of this key found it held by another session.
    contended: bool,
    /// Won at the server, granted locally once the takeover grace has passed.
    granting: Option<(FencingToken, Instant)>,
}

enum Exit {
    Lost(DisconnectReason),
    Shutdown,
}

pub(crate) struct Driver {
    shared: Arc<Shared>,
    rx: UnboundedReceiver<Command>,
    weak_tx: WeakUnboundedSender<Command>,
    slots: HashMap<LockKey, Slot>,
    releases: Vec<(LockKey, u64)>,
    holder_queries: Vec<(LockKey, oneshot::Sender<Result<Option<HolderInfo>>>)>,
    cluster_queries: Vec<ClusterReply>,
    release_replies: Vec<oneshot::Sender<Result<()>>>,
    unlocks: Vec<LockKey>,
    shutdown_replies: Vec<oneshot::Sender<()>>,
    shutting_down: bool,
    /// While closing gracefully, queries are bounded by this instead of the watchdog
    /// (the leases are already revoked, so the watchdog deadline has passed).
    closing_deadline: Option<Instant>,
    generations: u64,
    current: Option<Arc<Generation>>,
    last_reason: DisconnectReason,
    rng: u64,
    /// The next poll tick per poll interval: every waiting key with that interval is
    /// tried at the same instant, so one statement covers them all.
    ticks: HashMap<Duration, Instant>,
    /// Waiter counts last reported to the metrics sink, per key.
    reported_waiting: HashMap<LockKey, (Arc<str>, usize)>,
}

impl Drop for Driver {
    fn drop(&mut self) {
        // The task ended (shutdown, or the runtime dropped it): nothing it granted may
        // be trusted any more.
        self.shared.invalidate();
        if let Some(generation) = self.current.take() {
            generation.revoke(DisconnectReason::Shutdown);
        }
    }
}

impl Driver {
    pub(crate) fn new(
        shared: Arc<Shared>,
        rx: UnboundedReceiver<Command>,
        weak_tx: WeakUnboundedSender<Command>,
    ) -> Self {
        let seed = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
            ^ u64::from(std::process::id()).rotate_left(32)
            ^ (Arc::as_ptr(&shared) as u64);
        Self {
            shared,
            rx,
            weak_tx,
            slots: HashMap::new(),
            releases: Vec::new(),
            holder_queries: Vec::new(),
            cluster_queries: Vec::new(),
            release_replies: Vec::new(),
            unlocks: Vec::new(),
            shutdown_replies: Vec::new(),
            shutting_down: false,
            closing_deadline: None,
            generations: 1,
            current: None,
            last_reason: DisconnectReason::ConnectFailed {
                message: "not connected yet".to_owned(),
            },
            rng: seed | 1,
            ticks: HashMap::new(),
            reported_waiting: HashMap::new(),
        }
    }

    pub(crate) async fn run(mut self, first: Session) {
        let mut next = Some(first);
        loop {
            let session = match next.take() {
                Some(s) => s,
                None => match self.reconnect().await {
                    Some(s) => s,
                    None => break,
                },
            };
            match self.serve(session).await {
                Exit::Lost(_) => {}
                Exit::Shutdown => break,
            }
        }
        self.finish();
    }

    // ---- connected -------------------------------------------------------------

    async fn serve(&mut self, mut s: Session) -> Exit {
        let generation = Arc::clone(&s.generation);
        self.current = Some(Arc::clone(&generation));
        self.shared
            .extend_validity(s.proven_at + self.shared.options.lease_timeout);
        self.shared
            .status
            .send_replace(ConnectionStatus::Connected {
                generation: generation.id,
                backend_pid: s.backend_pid,
            });
        if let Some(m) = self.metrics() {
            m.connection_changed(self.node(), true, generation.id);
        }
        info!(
            node_id = %self.shared.options.node_id,
            generation = generation.id,
            backend_pid = s.backend_pid,
            "lock session connected"
        );
        let now = Instant::now();
        for slot in self.slots.values_mut() {
            slot.next_try = now;
        }
        let heartbeat_interval = self.shared.options.heartbeat_interval;
        let mut next_heartbeat = s.proven_at + heartbeat_interval;

        let exit = loop {
            // Take everything already queued first, so releases and requests batch.
            while let Ok(cmd) = self.rx.try_recv() {
                self.handle(cmd, true);
            }
            if self.shutting_down {
                break Exit::Shutdown;
            }
            if let Err(reason) = self.step(&mut s).await {
                break Exit::Lost(reason);
            }
            let watchdog = tokio::time::Instant::from_std(self.shared.valid_until());
            let next_poll = self.next_poll().map(tokio::time::Instant::from_std);
            tokio::select! {
                biased;
                event = s.events.recv() => match event {
                    Some(ConnEvent::Notification(tag)) => self.on_release_announced(&tag),
                    Some(ConnEvent::Closed(message)) => {
                        break Exit::Lost(DisconnectReason::ConnectionLost { message });
                    }
                    None => break Exit::Lost(DisconnectReason::ConnectionLost {
                        message: "the connection task ended".to_owned(),
                    }),
                },
                () = sleep_until(watchdog) => break Exit::Lost(self.overdue()),
                () = sleep_until(tokio::time::Instant::from_std(next_heartbeat)) => {
                    let sent = Instant::now();
                    if let Err(reason) = self.heartbeat(&s).await {
                        break Exit::Lost(reason);
                    }
                    self.shared.extend_validity(sent + self.shared.options.lease_timeout);
                    next_heartbeat = sent + heartbeat_interval;
                }
                cmd = self.rx.recv() => match cmd {
                    Some(cmd) => self.handle(cmd, true),
                    None => break Exit::Shutdown,
                },
                () = sleep_until(next_poll.unwrap_or(watchdog)), if next_poll.is_some() => {}
            }
        };
        match exit {
            Exit::Lost(reason) => {
                self.end_generation(&generation, reason.clone());
                drop(s);
                Exit::Lost(reason)
            }
            Exit::Shutdown => {
                self.graceful_close(s, &generation).await;
                Exit::Shutdown
            }
        }
    }

    fn overdue(&self) -> DisconnectReason {
        DisconnectReason::HeartbeatOverdue {
            lease_timeout: self.shared.options.lease_timeout,
        }
    }

    /// Runs a query, giving up at the watchdog deadline.
    async fn guarded<T>(
        &self,
        query: impl Future<Output = Result<T, tokio_postgres::Error>>,
    ) -> Result<T, Fault> {
        let deadline = tokio::time::Instant::from_std(
            self.closing_deadline
                .unwrap_or_else(|| self.shared.valid_until()),
        );
        tokio::select! {
            biased;
            result = query => result.map_err(classify),
            () = sleep_until(deadline) => Err(Fault::Lost(self.overdue())),
        }
    }

    async fn heartbeat(&self, s: &Session) -> Result<(), DisconnectReason> {
        let started = Instant::now();
        let row = match self
            .guarded(s.client.query_one(&s.stmts.heartbeat, &[]))
            .await
        {
            Ok(row) => row,
            Err(Fault::Lost(reason)) => return Err(reason),
            Err(Fault::Query(e)) => {
                return Err(DisconnectReason::ConnectionLost {
                    message: format!("heartbeat failed: {}", error_text(&e)),
                });
            }
        };
        let pid: i32 = row.get(0);
        let in_recovery: bool = row.get(1);
        let marker: String = row.get(2);
        if pid == s.backend_pid && marker != s.marker {
            return Err(DisconnectReason::PoolerDetected {
                detail: "another client changed this session's marker: the backend is shared"
                    .to_owned(),
            });
        }
        if pid != s.backend_pid {
            return Err(DisconnectReason::BackendChanged {
                expected: s.backend_pid,
                found: pid,
            });
        }
        if in_recovery {
            return Err(DisconnectReason::ServerInRecovery);
        }
        let rtt = started.elapsed();
        if let Some(m) = self.metrics() {
            m.heartbeat(self.node(), rtt);
        }
        debug!(rtt_us = rtt.as_micros() as u64, "heartbeat");
        Ok(())
    }

    /// Releases, hand-offs, then one statement for every due key.
    async fn step(&mut self, s: &mut Session) -> Result<(), DisconnectReason> {
        self.grant_ready(&s.generation);
        self.flush_releases(s).await?;
        self.poll_due(s).await?;
        self.flush_unlocks(s).await?;
        self.answer_releases();
        self.report_waiting();
        self.answer_holder_queries(s).await
    }

    fn metrics(&self) -> Option<&dyn crate::MetricsSink> {
        self.shared.options.metrics.as_deref()
    }

    fn node(&self) -> &str {
        &self.shared.options.node_id
    }

    /// Brings the sink's waiter gauges up to date (only when a sink is set).
    fn report_waiting(&mut self) {
        let Some(m) = self.shared.options.metrics.clone() else {
            return;
        };
        let node = &self.shared.options.node_id;
        let mut seen = HashMap::with_capacity(self.slots.len());
        for (key, slot) in &self.slots {
            let n = slot.waiters.iter().filter(|w| !w.reply.is_closed()).count();
            if self.reported_waiting.get(key).map(|(_, c)| *c) != Some(n) {
                m.lock_waiting(node, &slot.name, n);
            }
            seen.insert(*key, (Arc::clone(&slot.name), n));
        }
        for (key, (name, n)) in &self.reported_waiting {
            if *n > 0 && !seen.contains_key(key) {
                m.lock_waiting(node, name, 0);
            }
        }
        self.reported_waiting = seen;
    }

    async fn answer_holder_queries(&mut self, s: &Session) -> Result<(), DisconnectReason> {
        for (key, reply) in std::mem::take(&mut self.holder_queries) {
            if reply.is_closed() {
                continue;
            }
            let (classid, objid, objsubid) = key.pg_locks_columns();
            let params: [&(dyn tokio_postgres::types::ToSql + Sync); 4] = [
                &s.database_oid,
                &i64::from(classid),
                &i64::from(objid),
                &objsubid,
            ];
            let answer = match self
                .guarded(s.client.query_opt(&s.stmts.holder, &params))
                .await
            {
                Ok(row) => Ok(row.map(|row| HolderInfo {
                    node_id: row.get(0),
                    backend_pid: row.get(1),
                    client_addr: row.get(2),
                    session_start: row.get(3),
                })),
                Err(Fault::Lost(reason)) => {
                    let _ = reply.send(Err(Error::NotConnected(reason.clone())));
                    return Err(reason);
                }
                Err(Fault::Query(e)) => Err(Error::Database(Arc::new(e))),
            };
            let _ = reply.send(answer);
        }
        for reply in std::mem::take(&mut self.cluster_queries) {
            if reply.is_closed() {
                continue;
            }
            let answer = match self
                .guarded(s.client.query(&s.stmts.cluster, &[&s.database_oid]))
                .await
            {
                Ok(rows) => Ok(rows
                    .iter()
                    .filter_map(|row| {
                        let classid: i64 = row.get(0);
                        let objid: i64 = row.get(1);
                        let key = match row.get::<_, i32>(2) {
                            2 => LockKey::Pair(classid as u32 as i32, objid as u32 as i32),
                            1 => LockKey::Int((classid << 32) | objid),
                            _ => return None,
                        };
                        Some((
                            key,
                            HolderInfo {
                                node_id: row.get(3),
                                backend_pid: row.get(4),
                                client_addr: row.get(5),
                                session_start: row.get(6),
                            },
                        ))
                    })
                    .collect()),
                Err(Fault::Lost(reason)) => {
                    let _ = reply.send(Err(Error::NotConnected(reason.clone())));
                    return Err(reason);
                }
                Err(Fault::Query(e)) => Err(Error::Database(Arc::new(e))),
            };
            let _ = reply.send(answer);
        }
        Ok(())
    }

    async fn flush_releases(&mut self, s: &Session) -> Result<(), DisconnectReason> {
        let mut handoffs = Vec::new();
        for (key, lease_id) in std::mem::take(&mut self.releases) {
            let Some(slot) = self.slots.get_mut(&key) else {
                continue;
            };
            if slot.holder.as_ref().map(|h| h.id) != Some(lease_id) {
                continue; // revoked with an old generation, or already released
            }
            slot.holder = None;
            if let Some(m) = self.shared.options.metrics.as_deref() {
                m.lock_released(&self.shared.options.node_id, &slot.name);
            }
            debug!(lock = %slot.name, key = %key, "released");
            slot.waiters.retain(|w| !w.reply.is_closed());
            if slot.waiters.is_empty() {
                self.unlocks.push(key);
            } else {
                handoffs.push(key);
            }
        }
        if handoffs.is_empty() {
            return Ok(());
        }
        // Hand the lock to the next local waiter without releasing it at the server,
        // under a new, larger fencing token.
        match self.guarded(s.client.query_one(&s.stmts.token, &[])).await {
            Ok(row) => {
                let token = FencingToken::new(row.get::<_, i64>(0) as u64);
                for key in handoffs {
                    self.grant(&s.generation, key, token);
                }
                Ok(())
            }
            Err(Fault::Lost(reason)) => Err(reason),
            Err(Fault::Query(e)) => {
                warn!(error = %error_text(&e), "could not get a fencing token for a local hand-off; releasing instead");
                self.unlocks.extend(handoffs);
                Ok(())
            }
        }
    }

    async fn poll_due(&mut self, s: &Session) -> Result<(), DisconnectReason> {
        let now = Instant::now();
        // Only the due keys are looked at closely: withdrawn requests are dropped and
        // keys nobody wants any more are forgotten (a full prune per step would make
        // every step O(locks)).
        let mut due = Vec::new();
        let mut unwanted = Vec::new();
        for (key, slot) in &mut self.slots {
            if slot.holder.is_none()
                && slot.granting.is_none()
                && !slot.waiters.is_empty()
                && slot.next_try <= now
            {
                slot.waiters.retain(|w| !w.reply.is_closed());
                if slot.waiters.is_empty() {
                    unwanted.push(*key);
                } else {
                    due.push(*key);
                }
            }
        }
        for key in unwanted {
            self.forget_if_unused(key);
        }
        if due.is_empty() {
            return Ok(());
        }
        let (a, b, big) = key_arrays(&due);
        if let Some(m) = self.metrics() {
            m.poll_query(self.node(), due.len());
        }
        let query = async {
            if let [key] = due.as_slice() {
                let (a, b, big) = key_params(*key);
                let rows = s
                    .client
                    .query(
                        &s.stmts.acquire_one,
                        &[&a, &b, &big, &s.backend_pid, &s.marker],
                    )
                    .await?;
                // Same shape as the batched form: (ordinal, token).
                Ok(rows
                    .iter()
                    .map(|r| (1i64, r.get::<_, Option<i64>>(0)))
                    .collect::<Vec<_>>())
            } else {
                let rows = s
                    .client
                    .query(&s.stmts.acquire, &[&a, &b, &big, &s.backend_pid, &s.marker])
                    .await?;
                Ok(rows
                    .iter()
                    .map(|r| (r.get::<_, i64>(0), r.get::<_, Option<i64>>(1)))
                    .collect())
            }
        };
        match self.guarded(query).await {
            Ok(rows) if rows.is_empty() => Err(DisconnectReason::PoolerDetected {
                detail: "an acquire statement ran on another backend than the session's own"
                    .to_owned(),
            }),
            Ok(rows) => {
                let mut won = vec![None; due.len()];
                for (i, token) in rows {
                    if let Some(slot) = usize::try_from(i - 1).ok().and_then(|i| won.get_mut(i)) {
                        *slot = token;
                    }
                }
                for (key, token) in due.into_iter().zip(won) {
                    match token {
                        Some(t) => self.won(&s.generation, key, FencingToken::new(t as u64)),
                        None => self.not_acquired(key, None),
                    }
                }
                Ok(())
            }
            Err(Fault::Lost(reason)) => Err(reason),
            Err(Fault::Query(e)) => {
                let full = e.code() == Some(&SqlState::OUT_OF_MEMORY);
                if full {
                    warn!(keys = due.len(), error = %error_text(&e), "the server's lock table is full (SQLSTATE 53200); locks not acquired, will retry. Raise max_locks_per_transaction or hold fewer locks");
                } else {
                    warn!(keys = due.len(), error = %error_text(&e), "acquire statement failed; will retry");
                }
                // Session locks taken before the error survive it: undo them.
                match self
                    .guarded(
                        s.client
                            .query(&s.stmts.cleanup, &[&a, &b, &big, &s.database_oid]),
                    )
                    .await
                {
                    Ok(_) => {}
                    Err(Fault::Lost(reason)) => return Err(reason),
                    Err(Fault::Query(e2)) => {
                        return Err(DisconnectReason::ConnectionLost {
                            message: format!(
                                "could not undo a failed acquire ({}); dropping the session to release everything",
                                error_text(&e2)
                            ),
                        });
                    }
                }
                let error = (!full).then(|| Arc::new(e));
                for key in due {
                    self.not_acquired(key, error.as_ref());
                }
                Ok(())
            }
        }
    }

    /// A lock was won at the server. If it was free on the first try, or its release
    /// was announced (a graceful hand-over), it is granted now. If it was held by
    /// another session and then came free without an announcement, that holder may
    /// have lost it without knowing yet (its session ended on the server's side:
    /// terminated, cut), so the grant waits the takeover grace, giving that holder time
    /// to learn of its loss first.
    fn won(&mut self, generation: &Arc<Generation>, key: LockKey, token: FencingToken) {
        let grace = self.shared.options.takeover_grace;
        // Only a lock seen held by another session can have a holder that does not
        // know yet; a free lock on the first try is granted at once.
        let unannounced_takeover = self.slots.get_mut(&key).is_some_and(|slot| {
            let announced = std::mem::take(&mut slot.announced);
            std::mem::take(&mut slot.contended) && !announced
        });
        if !unannounced_takeover || grace.is_zero() {
            self.grant(generation, key, token);
        } else if let Some(slot) = self.slots.get_mut(&key) {
            slot.granting = Some((token, Instant::now() + grace));
        } else {
            self.unlocks.push(key);
        }
    }

    /// Grants the locks whose takeover grace has passed.
    fn grant_ready(&mut self, generation: &Arc<Generation>) {
        let now = Instant::now();
        let ready: Vec<(LockKey, FencingToken)> = self
            .slots
            .iter_mut()
            .filter_map(|(key, slot)| match slot.granting {
                Some((token, at)) if at <= now => {
                    slot.granting = None;
                    Some((*key, token))
                }
                _ => None,
            })
            .collect();
        for (key, token) in ready {
            self.grant(generation, key, token);
        }
    }

    /// Gives a lock the session now holds to the oldest live waiter, or queues its
    /// unlock when nobody takes it.
    fn grant(&mut self, generation: &Arc<Generation>, key: LockKey, token: FencingToken) {
        let Some(slot) = self.slots.get_mut(&key) else {
            self.unlocks.push(key);
            return;
        };
        while let Some(waiter) = slot.waiters.pop_front() {
            if waiter.reply.is_closed() {
                continue;
            }
            let Some(tx) = self.weak_tx.upgrade() else {
                break;
            };
            let lease = Lease {
                id: waiter.id,
                name: Arc::clone(&waiter.name),
                key,
                token,
                acquired_at: SystemTime::now(),
                generation: Arc::clone(generation),
                shared: Arc::clone(&self.shared),
                tx: Some(tx),
                ended: tokio_util::sync::CancellationToken::new(),
            };
            match waiter.reply.send(Ok(Some(lease))) {
                Ok(()) => {
                    if let Some(m) = self.shared.options.metrics.as_deref() {
                        m.lock_acquired(
                            &self.shared.options.node_id,
                            &waiter.name,
                            waiter.enqueued.elapsed(),
                        );
                    }
                    debug!(lock = %waiter.name, key = %key, token = token.get(), "acquired");
                    slot.holder = Some(Holder {
                        id: waiter.id,
                        token,
                        since: SystemTime::now(),
                        generation: generation.id,
                    });
                    return;
                }
                Err(returned) => {
                    // The request was withdrawn at this very moment.
                    if let Ok(Some(mut lease)) = returned {
                        lease.disarm();
                    }
                }
            }
        }
        self.unlocks.push(key);
    }

    /// The key is held elsewhere (or the attempt failed): answer tries, reschedule waits.
    fn not_acquired(&mut self, key: LockKey, error: Option<&Arc<tokio_postgres::Error>>) {
        let Some(slot) = self.slots.get_mut(&key) else {
            return;
        };
        while slot.waiters.front().is_some_and(|w| w.mode == Mode::Try) {
            let waiter = slot.waiters.pop_front().expect("BUG: front checked");
            let answer = match &error {
                Some(e) => Err(Error::Database(Arc::clone(e))),
                None => Ok(None),
            };
            let _ = waiter.reply.send(answer);
        }
        if error.is_none() {
            slot.contended = true;
        }
        if let Some(front) = slot.waiters.front() {
            let interval = front.poll_interval;
            slot.next_try = next_tick(&mut self.ticks, &mut self.rng, interval);
        }
        self.forget_if_unused(key);
    }

    async fn flush_unlocks(&mut self, s: &Session) -> Result<(), DisconnectReason> {
        if self.unlocks.is_empty() {
            return Ok(());
        }
        let keys = std::mem::take(&mut self.unlocks);
        let query = async {
            if let [key] = keys.as_slice() {
                let (a, b, big) = key_params(*key);
                let row = s
                    .client
                    .query_one(&s.stmts.release_one, &[&a, &b, &big, &key.tag()])
                    .await?;
                Ok(vec![row.get::<_, bool>(0)])
            } else {
                let (a, b, big) = key_arrays(&keys);
                let tags: Vec<String> = keys.iter().map(|k| k.tag()).collect();
                let rows = s
                    .client
                    .query(&s.stmts.release, &[&a, &b, &big, &tags])
                    .await?;
                Ok(rows.iter().map(|r| r.get::<_, bool>(1)).collect::<Vec<_>>())
            }
        };
        match self.guarded(query).await {
            Ok(released) => {
                // We only unlock keys the session holds, once each: a `false` means the
                // statement ran on a backend that is not ours.
                if released.len() != keys.len() || released.iter().any(|ok| !ok) {
                    return Err(DisconnectReason::PoolerDetected {
                        detail: "the server says this session did not hold a lock it held"
                            .to_owned(),
                    });
                }
            }
            Err(Fault::Lost(reason)) => return Err(reason),
            Err(Fault::Query(e)) => {
                return Err(DisconnectReason::ConnectionLost {
                    message: format!(
                        "could not release locks ({}); dropping the session to release them",
                        error_text(&e)
                    ),
                });
            }
        }
        let now = Instant::now();
        for key in keys {
            if let Some(slot) = self.slots.get_mut(&key) {
                slot.next_try = now;
            }
            self.forget_if_unused(key);
        }
        Ok(())
    }

    fn answer_releases(&mut self) {
        for reply in self.release_replies.drain(..) {
            let _ = reply.send(Ok(()));
        }
    }

    fn on_release_announced(&mut self, payload: &str) {
        let now = Instant::now();
        for tag in payload.split(',') {
            if let Some(key) = LockKey::from_tag(tag)
                && let Some(slot) = self.slots.get_mut(&key)
                && slot.holder.is_none()
            {
                slot.next_try = now;
                slot.announced = true;
            }
        }
    }

    /// Forgets `key` if it neither holds nor has a live waiter (and is not being
    /// unlocked).
    fn forget_if_unused(&mut self, key: LockKey) {
        let unused = self.slots.get_mut(&key).is_some_and(|slot| {
            slot.waiters.retain(|w| !w.reply.is_closed());
            slot.holder.is_none() && slot.granting.is_none() && slot.waiters.is_empty()
        });
        if unused && !self.unlocks.contains(&key) {
            self.slots.remove(&key);
        }
    }

    /// Drops withdrawn requests and slots that neither hold nor wait (all keys: used
    /// when a generation ends).
    fn prune(&mut self) {
        let unlocks = &self.unlocks;
        self.slots.retain(|key, slot| {
            slot.waiters.retain(|w| !w.reply.is_closed());
            slot.holder.is_some()
                || slot.granting.is_some()
                || !slot.waiters.is_empty()
                || unlocks.contains(key)
        });
    }

    /// The next instant the loop has work: a due poll or a grace that ends.
    fn next_poll(&self) -> Option<Instant> {
        self.slots
            .values()
            .filter_map(|slot| match slot.granting {
                Some((_, at)) => Some(at),
                None if slot.holder.is_none() && !slot.waiters.is_empty() => Some(slot.next_try),
                None => None,
            })
            .min()
    }

    // ---- commands ----------------------------------------------------------------

    fn handle(&mut self, cmd: Command, connected: bool) {
        match cmd {
            Command::Acquire(waiter) => self.on_acquire(waiter, connected),
            Command::Release {
                key,
                lease_id,
                reply,
            } => {
                self.releases.push((key, lease_id));
                if let Some(reply) = reply {
                    self.release_replies.push(reply);
                }
                if !connected {
                    // Nothing is held while disconnected.
                    self.releases.clear();
                    self.answer_releases();
                }
            }
            Command::Locks(reply) => {
                let _ = reply.send(self.snapshot());
            }
            Command::Cluster(reply) => {
                if connected {
                    self.cluster_queries.push(reply);
                } else {
                    let _ = reply.send(Err(Error::NotConnected(self.last_reason.clone())));
                }
            }
            Command::Holder { key, reply } => {
                if connected {
                    self.holder_queries.push((key, reply));
                } else {
                    let _ = reply.send(Err(Error::NotConnected(self.last_reason.clone())));
                }
            }
            Command::Shutdown(reply) => {
                self.shutdown_replies.push(reply);
                self.shutting_down = true;
            }
        }
    }

    fn on_acquire(&mut self, waiter: Waiter, connected: bool) {
        let max = self.shared.options.max_locks;
        if !self.slots.contains_key(&waiter.key) && self.slots.len() >= max {
            let _ = waiter.reply.send(Err(Error::TooManyLocks { limit: max }));
            return;
        }
        if waiter.mode == Mode::Try {
            let busy = self.slots.get(&waiter.key).is_some_and(|slot| {
                slot.holder.is_some() || slot.waiters.iter().any(|w| !w.reply.is_closed())
            });
            if busy {
                let _ = waiter.reply.send(Ok(None));
                return;
            }
            if !connected {
                let _ = waiter
                    .reply
                    .send(Err(Error::NotConnected(self.last_reason.clone())));
                return;
            }
        }
        let now = Instant::now();
        let slot = self.slots.entry(waiter.key).or_insert_with(|| Slot {
            name: Arc::clone(&waiter.name),
            holder: None,
            waiters: VecDeque::new(),
            next_try: now,
            announced: false,
            contended: false,
            granting: None,
        });
        if slot.holder.is_none() && slot.granting.is_none() && slot.waiters.is_empty() {
            slot.next_try = now;
        }
        slot.waiters.push_back(waiter);
    }

    fn snapshot(&self) -> Vec<LockInfo> {
        let node_id = &self.shared.options.node_id;
        let mut out = Vec::new();
        for (key, slot) in &self.slots {
            if let Some(h) = &slot.holder {
                out.push(LockInfo {
                    name: slot.name.to_string(),
                    key: *key,
                    state: LockState::Held {
                        token: h.token,
                        generation: h.generation,
                    },
                    request_id: h.id,
                    node_id: node_id.clone(),
                    since: h.since,
                });
            }
            for (position, w) in slot
                .waiters
                .iter()
                .filter(|w| !w.reply.is_closed())
                .enumerate()
            {
                out.push(LockInfo {
                    name: w.name.to_string(),
                    key: *key,
                    state: LockState::Waiting { position },
                    request_id: w.id,
                    node_id: node_id.clone(),
                    since: w.since,
                });
            }
        }
        out.sort_by(|a, b| a.name.cmp(&b.name).then(a.request_id.cmp(&b.request_id)));
        out
    }

    // ---- ending and reconnecting ---------------------------------------------------

    /// Revokes every lease of the generation at once, before anything else happens.
    fn end_generation(&mut self, generation: &Generation, reason: DisconnectReason) {
        self.shared.invalidate();
        generation.revoke(reason.clone());
        self.current = None;
        let held = self.slots.values().filter(|s| s.holder.is_some()).count();
        warn!(
            node_id = %self.shared.options.node_id,
            generation = generation.id,
            revoked_leases = held,
            %reason,
            "lock session lost; every lease revoked"
        );
        let now = Instant::now();
        let metrics = self.shared.options.metrics.clone();
        for slot in self.slots.values_mut() {
            if slot.holder.take().is_some()
                && let Some(m) = &metrics
            {
                m.lock_lost(&self.shared.options.node_id, &slot.name, reason.label());
            }
            slot.granting = None;
            slot.announced = false;
            slot.contended = false;
            slot.next_try = now;
        }
        if let Some(m) = &metrics {
            m.connection_changed(&self.shared.options.node_id, false, generation.id);
        }
        // The session is gone, and every lock with it.
        self.releases.clear();
        for (_, reply) in self.holder_queries.drain(..) {
            let _ = reply.send(Err(Error::NotConnected(reason.clone())));
        }
        for reply in self.cluster_queries.drain(..) {
            let _ = reply.send(Err(Error::NotConnected(reason.clone())));
        }
        self.unlocks.clear();
        self.answer_releases();
        self.prune();
        self.last_reason = reason.clone();
        self.shared
            .status
            .send_replace(ConnectionStatus::Disconnected {
                reason,
                since: SystemTime::now(),
            });
    }

    async fn graceful_close(&mut self, s: Session, generation: &Generation) {
        // Stop trusting the leases first, then release at the server and announce it,
        // so that no moment has two holders.
        self.shared.invalidate();
        generation.revoke(DisconnectReason::Shutdown);
        self.current = None;
        self.unlocks.extend(
            self.slots
                .iter()
                .filter(|(_, slot)| slot.holder.is_some() || slot.granting.is_some())
                .map(|(key, _)| *key),
        );
        for slot in self.slots.values_mut() {
            slot.granting = None;
        }
        let metrics = self.shared.options.metrics.clone();
        for slot in self.slots.values_mut() {
            if slot.holder.take().is_some()
                && let Some(m) = &metrics
            {
                m.lock_lost(&self.shared.options.node_id, &slot.name, "shutdown");
            }
        }
        if let Some(m) = &metrics {
            m.connection_changed(&self.shared.options.node_id, false, generation.id);
        }
        self.releases.clear();
        self.closing_deadline = Some(Instant::now() + self.shared.options.lease_timeout);
        if let Err(reason) = self.flush_unlocks(&s).await {
            debug!(%reason, "releasing at shutdown failed; closing the session releases the locks");
        }
        drop(s);
        info!(node_id = %self.shared.options.node_id, "lock manager shut down");
    }

    async fn reconnect(&mut self) -> Option<Session> {
        let options = self.shared.options.clone();
        let mut delay = options.reconnect_min;
        let mut attempt = 0u32;
        loop {
            attempt += 1;
            self.generations += 1;
            self.shared
                .status
                .send_replace(ConnectionStatus::Connecting { attempt });
            let connect = session::connect(&options, self.generations);
            tokio::pin!(connect);
            let result = loop {
                tokio::select! {
                    result = &mut connect => break result,
                    cmd = self.rx.recv() => match cmd {
                        Some(cmd) => self.handle(cmd, false),
                        None => return None,
                    },
                }
                if self.shutting_down {
                    return None;
                }
            };
            if let Some(m) = self.shared.options.metrics.as_deref() {
                m.reconnect_attempt(&self.shared.options.node_id, result.is_ok());
            }
            let error = match result {
                Ok(session) => return Some(session),
                Err(e) => e,
            };
            let reason = match &error {
                Error::Refused(reason) | Error::NotConnected(reason) => reason.clone(),
                other => DisconnectReason::ConnectFailed {
                    message: error_chain(other),
                },
            };
            warn!(attempt, error = %error_chain(&error), "lock session reconnect failed");
            self.last_reason = reason.clone();
            self.shared
                .status
                .send_replace(ConnectionStatus::Disconnected {
                    reason,
                    since: SystemTime::now(),
                });
            let wait = delay / 2 + jitter_below(&mut self.rng, delay / 2);
            delay = (delay * 2).min(options.reconnect_max);
            let until = tokio::time::Instant::now() + wait;
            loop {
                tokio::select! {
                    () = sleep_until(until) => break,
                    cmd = self.rx.recv() => match cmd {
                        Some(cmd) => self.handle(cmd, false),
                        None => return None,
                    },
                }
                if self.shutting_down {
                    return None;
                }
            }
        }
    }

    fn finish(&mut self) {
        self.shared.invalidate();
        if let Some(generation) = self.current.take() {
            generation.revoke(DisconnectReason::Shutdown);
        }
        // Dropping the waiters' reply senders answers them with `Error::Closed`.
        self.slots.clear();
        self.answer_releases();
        self.shared
            .status
            .send_replace(ConnectionStatus::Disconnected {
                reason: DisconnectReason::Shutdown,
                since: SystemTime::now(),
            });
        self.rx.close();
        for reply in self.shutdown_replies.drain(..) {
            let _ = reply.send(());
        }
    }
}

/// The scalar parameters of the single-key statements.
fn key_params(key: LockKey) -> (Option<i32>, Option<i32>, Option<i64>) {
    match key {
        LockKey::Pair(a, b) => (Some(a), Some(b), None),
        LockKey::Int(k) => (None, None, Some(k)),
    }
}

/// The three parallel arrays the batched statements `unnest`.
type KeyArrays = (Vec<Option<i32>>, Vec<Option<i32>>, Vec<Option<i64>>);

fn key_arrays(keys: &[LockKey]) -> KeyArrays {
    let mut a = Vec::with_capacity(keys.len());
    let mut b = Vec::with_capacity(keys.len());
    let mut big = Vec::with_capacity(keys.len());
    for key in keys {
        match *key {
            LockKey::Pair(x, y) => {
                a.push(Some(x));
                b.push(Some(y));
                big.push(None);
            }
            LockKey::Int(k) => {
                a.push(None);
                b.push(None);
                big.push(Some(k));
            }
        }
    }
    (a, b, big)
}

/// The next shared tick for `interval`: the one already planned if it lies ahead
/// (within one jittered interval), else a new one, one jittered interval from now.
fn next_tick(ticks: &mut HashMap<Duration, Instant>, rng: &mut u64, interval: Duration) -> Instant {
    let now = Instant::now();
    match ticks.get(&interval) {
        Some(at) if *at > now && *at <= now + interval + interval / 10 => *at,
        _ => {
            let at = now + jitter(rng, interval);
            ticks.insert(interval, at);
            at
        }
    }
}

fn next_random(state: &mut u64) -> u64 {
    // xorshift64*: enough to spread polls and backoffs, no dependency.
    let mut x = *state;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *state = x;
    x.wrapping_mul(0x2545_F491_4F6C_DD1D)
}

fn jitter_below(state: &mut u64, max: Duration) -> Duration {
    let nanos = max.as_nanos() as u64;
    if nanos == 0 {
        return Duration::ZERO;
    }
    Duration::from_nanos(next_random(state) % nanos)
}

/// `interval` ± 10 %.
fn jitter(state: &mut u64, interval: Duration) -> Duration {
    interval - interval / 10 + jitter_below(state, interval / 5)
}

/// An error with its sources, for logs.
pub(crate) fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_with_one_interval_share_ticks() {
        let mut ticks = HashMap::new();
        let mut rng = 7;
        let interval = Duration::from_millis(300);
        let first = next_tick(&mut ticks, &mut rng, interval);
        for _ in 0..1000 {
            assert_eq!(next_tick(&mut ticks, &mut rng, interval), first);
        }
        let other = next_tick(&mut ticks, &mut rng, Duration::from_secs(2));
        assert!(other > first);
    }

    #[test]
    fn jitter_stays_within_ten_percent() {
        let mut rng = 0x1234_5678_9abc_def1;
        for _ in 0..10_000 {
            let d = jitter(&mut rng, Duration::from_millis(300));
            assert!(
                d >= Duration::from_millis(270) && d < Duration::from_millis(330),
                "{d:?}"
            );
        }
    }
}
