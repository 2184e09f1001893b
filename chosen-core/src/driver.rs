//! The manager's task: the only code that touches the connection, and none of the
//! rules. It feeds commands, notifications and statement results to the
//! [`LockTable`](crate::table::LockTable) and carries out what the table decides,
//! through the [`Session`]'s statements. A separate heartbeat task proves the session
//! alive, so no statement, command or notification flood can delay it.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use tokio::sync::mpsc::{UnboundedReceiver, WeakUnboundedSender};
use tokio::sync::oneshot;
use tokio::time::sleep_until;
use tracing::{debug, info, warn};

use crate::command::{ClusterReply, Command, Grant, HolderReply};
use crate::engine::{CloseNext, Engine, Overdue, Timing};
use crate::error::{Error, Result};
use crate::fault::{Fault, error_text};
use crate::generation::Generation;
use crate::info::{LockInfo, LockState};
use crate::key::LockKey;
use crate::session::{self, ConnEvent, Session};
use crate::shared::Shared;
use crate::status::{ConnectionState, SessionDownReason};
use crate::table::{Action, Entry, Refusal, RequestId, Rules};
use crate::token::FencingToken;

enum Exit {
    Lost(SessionDownReason),
    Shutdown,
}

pub(crate) struct Driver {
    shared: Arc<Shared>,
    rx: UnboundedReceiver<Command>,
    weak_tx: WeakUnboundedSender<Command>,
    engine: Engine,
    /// Reply channels of requests the table still has (waiting or in a statement).
    replies: HashMap<RequestId, oneshot::Sender<Result<Option<Grant>>>>,
    release_replies: Vec<oneshot::Sender<Result<()>>>,
    holder_queries: Vec<(LockKey, HolderReply)>,
    cluster_queries: Vec<ClusterReply>,
    shutdown_replies: Vec<oneshot::Sender<()>>,
    shutting_down: bool,
    /// Lost sessions kept open (the engine's rule 6), oldest first: each by a task of
    /// its own that closes it at its deadline, or at once when this is cancelled.
    retiring: std::collections::VecDeque<tokio_util::sync::CancellationToken>,
    generations: u64,
    current: Option<Arc<Generation>>,
    last_reason: SessionDownReason,
    /// The error of the last failed try statement, for the try requests it answers.
    last_error: Option<Arc<tokio_postgres::Error>>,
    /// Waiter counts last reported to the metrics sink, per key.
    reported_waiting: HashMap<LockKey, (Arc<str>, usize)>,
}

impl Drop for Driver {
    fn drop(&mut self) {
        // The task ended (shutdown, or the runtime dropped it): nothing it granted may
        // be trusted any more.
        self.shared.invalidate();
        if let Some(generation) = self.current.take() {
            generation.revoke(SessionDownReason::Shutdown);
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
        let rules = Rules {
            node: crate::key::node_hash(&shared.options.node_id),
            max_locks: shared.options.max_locks,
            takeover_grace: shared.options.takeover_grace,
            max_fence_wait: shared
                .options
                .lease_timeout
                .saturating_add(shared.options.stop_budget)
                .saturating_add(shared.options.safety_margin),
        };
        let timing = Timing {
            term_grant_delay: shared.options.get_term_grant_delay(),
            reconnect_min: shared.options.reconnect_min,
            reconnect_max: shared.options.reconnect_max,
            stop_budget: shared.options.stop_budget,
            statement_slack: shared.options.lease_timeout,
            linger: shared.options.takeover_grace,
        };
        Self {
            engine: Engine::new(rules, timing, seed),
            shared,
            rx,
            weak_tx,
            replies: HashMap::new(),
            release_replies: Vec::new(),
            holder_queries: Vec::new(),
            cluster_queries: Vec::new(),
            shutdown_replies: Vec::new(),
            shutting_down: false,
            retiring: std::collections::VecDeque::new(),
            generations: 1,
            current: None,
            last_reason: SessionDownReason::ConnectFailed {
                message: "not connected yet".to_owned(),
            },
            last_error: None,
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
                    None => {
                        self.close(None).await;
                        break;
                    }
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
        self.shared.status.send_replace(ConnectionState::Connected {
            generation: generation.id,
            backend_pid: s.backend_pid,
            server: s.server.clone(),
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
        if let Some(grants_in) = self
            .engine
            .session_started(generation.id, &s.term, Instant::now())
        {
            info!(
                node_id = %self.shared.options.node_id,
                timeline = s.term.timeline,
                term_age = ?s.term.age,
                ?grants_in,
                "the server's term as primary began recently; no lock is granted before the term grant delay passed"
            );
        }
        self.shared.set_server_floor(0);
        let heartbeat = tokio::spawn(crate::heartbeat::run(
            s.heartbeat_handle(),
            Arc::clone(&self.shared),
            Arc::clone(&generation),
            s.proven_at,
        ));
        let _heartbeat = AbortOnDrop(heartbeat);

        let exit = loop {
            // Everything already queued first, merged: requests, releases and
            // announcements of one iteration cost one step.
            while let Ok(cmd) = self.rx.try_recv() {
                self.handle(cmd);
            }
            if let Some(exit) = self.drain_events(&mut s) {
                break exit;
            }
            if self.shutting_down {
                break Exit::Shutdown;
            }
            if generation.revoked.is_cancelled() {
                break Exit::Lost(revoke_reason(&generation));
            }
            if let Err(reason) = self.step(&s, None).await {
                break Exit::Lost(reason);
            }
            self.close_retired();
            let wakeup = self
                .engine
                .next_wakeup(Instant::now())
                .map(tokio::time::Instant::from_std);
            tokio::select! {
                biased;
                () = generation.revoked.cancelled() => break Exit::Lost(revoke_reason(&generation)),
                cmd = self.rx.recv() => match cmd {
                    Some(cmd) => self.handle(cmd),
                    None => break Exit::Shutdown,
                },
                event = s.events.recv() => match event {
                    Some(event) => if let Some(exit) = self.on_event(event) {
                        break exit;
                    },
                    None => break Exit::Lost(SessionDownReason::ConnectionLost {
                        message: "the connection task ended".to_owned(),
                    }),
                },
                () = sleep_until(wakeup.unwrap_or_else(far_future)), if wakeup.is_some() => {}
            }
        };
        match exit {
            Exit::Lost(reason) => {
                // Kept open until the next session fences what is still stopping (the
                // engine's rule 6), unless its connection is closed already, or it is a
                // pooler's (nothing of it is ours).
                let may_keep = !s.client.is_closed()
                    && !matches!(reason, SessionDownReason::PoolerDetected { .. });
                match self.end_generation(&generation, reason.clone(), may_keep) {
                    Some(until) => self.retire(s, until),
                    None => drop(s),
                }
                Exit::Lost(reason)
            }
            Exit::Shutdown => {
                self.close(Some(&mut s)).await;
                drop(s);
                Exit::Shutdown
            }
        }
    }

    /// Takes the notifications already received, in one go (at most 10,000, so that a
    /// flood of them cannot hold up the step).
    fn drain_events(&mut self, s: &mut Session) -> Option<Exit> {
        for _ in 0..10_000 {
            let Ok(event) = s.events.try_recv() else {
                break;
            };
            if let Some(exit) = self.on_event(event) {
                return Some(exit);
            }
        }
        None
    }

    fn on_event(&mut self, event: ConnEvent) -> Option<Exit> {
        match event {
            ConnEvent::Notification {
                sender,
                payload,
                at,
            } => {
                // Applied with its arrival: read after a slow try, it must not look fresh.
                for (key, to) in payload.split(',').filter_map(LockKey::from_announcement) {
                    self.engine.table_mut().announced_for(key, sender, to, at);
                }
                None
            }
            ConnEvent::Closed(message) => {
                Some(Exit::Lost(SessionDownReason::ConnectionLost { message }))
            }
        }
    }

    /// Runs a statement until it answers, the generation is revoked, or `deadline`.
    async fn guarded<T>(
        &self,
        generation: &Generation,
        deadline: Option<Instant>,
        query: impl Future<Output = Result<T, Fault>>,
    ) -> Result<T, Fault> {
        let deadline = deadline.map(tokio::time::Instant::from_std);
        tokio::select! {
            biased;
            () = generation.revoked.cancelled(), if deadline.is_none() => {
                Err(Fault::Lost(revoke_reason(generation)))
            }
            result = query => result,
            () = sleep_until(deadline.unwrap_or_else(far_future)), if deadline.is_some() => {
                Err(Fault::Lost(SessionDownReason::Shutdown))
            }
        }
    }

    /// One step: what the table planned, in one pipelined round trip; then holder
    /// look-ups, batched. `deadline` bounds the statements while closing.
    async fn step(
        &mut self,
        s: &Session,
        deadline: Option<Instant>,
    ) -> Result<(), SessionDownReason> {
        let generation = Arc::clone(&s.generation);
        // After a freeze the task may run before the heartbeat task's watchdog: a session
        // whose deadline passed grants nothing (the engine's validity gate).
        let closing = deadline.is_some();
        let lease_timeout = self.shared.options.lease_timeout;
        let overdue = |Overdue| SessionDownReason::HeartbeatOverdue { lease_timeout };
        let plan = self
            .engine
            .plan(Instant::now(), self.shared.is_valid_now(), closing)
            .map_err(overdue)?;
        // Lowered before the statements that release locks are sent.
        self.shared.set_server_floor(self.engine.server_floor());
        self.carry_out();
        if !plan.is_empty() {
            if let (Some(m), false) = (self.metrics(), plan.try_keys.is_empty()) {
                m.poll_query(self.node(), plan.try_keys.len());
            }
            let (done, try_error) = self
                .guarded(&generation, deadline, s.perform(&plan))
                .await
                .map_err(fault_reason)?;
            self.last_error = try_error.map(Arc::new);
            // A freeze during the statement: its results would grant on a session whose
            // deadline passed (the server may have ended it and given the keys away).
            self.engine
                .done(
                    &plan,
                    &done,
                    self.shared.is_valid_now(),
                    closing,
                    Instant::now(),
                )
                .map_err(overdue)?;
            self.shared.set_server_floor(self.engine.server_floor());
            self.carry_out();
        }
        self.answer_releases();
        self.report_waiting();
        self.answer_queries(s, deadline).await
    }

    /// Carries out the table's actions: leases granted, requests answered, metrics.
    fn carry_out(&mut self) {
        let closing = self.shared.closing.is_cancelled();
        while let Some(action) = self.engine.poll_action(Instant::now(), closing) {
            match action {
                Action::Grant {
                    id,
                    key,
                    token,
                    generation,
                    waited,
                    ..
                } => self.deliver(id, key, token, generation, waited),
                Action::Refuse { id, why } => {
                    let Some(reply) = self.replies.remove(&id) else {
                        continue;
                    };
                    let answer = match why {
                        Refusal::Busy => Ok(None),
                        Refusal::TooManyLocks { limit } => Err(Error::TooManyLocks { limit }),
                        Refusal::NotConnected => Err(Error::NotConnected(self.last_reason.clone())),
                        Refusal::Failed => match &self.last_error {
                            Some(e) => Err(Error::Database(Arc::clone(e))),
                            None => Ok(None),
                        },
                        Refusal::Closed => Err(Error::Closed),
                    };
                    let _ = reply.send(answer);
                }
                Action::Released { key, name } => {
                    debug!(lock = %name, key = %key, "released");
                    if let Some(m) = self.metrics() {
                        m.lock_released(self.node(), &name);
                    }
                }
                Action::Lost { key, name } => {
                    debug!(lock = %name, key = %key, "lost with the session");
                    if let Some(m) = self.metrics() {
                        m.lock_lost(self.node(), &name, self.last_reason.label());
                    }
                }
            }
        }
    }

    /// Sends a lease to its requester; if the request was withdrawn at this very moment,
    /// the table takes the lock back.
    fn deliver(
        &mut self,
        id: RequestId,
        key: LockKey,
        token: FencingToken,
        generation_id: u64,
        waited: Duration,
    ) {
        let (Some(reply), Some(generation), Some(tx)) = (
            self.replies.remove(&id),
            self.current.clone(),
            self.weak_tx.upgrade(),
        ) else {
            self.engine.table_mut().undelivered(key, id, Instant::now());
            return;
        };
        debug_assert_eq!(generation.id, generation_id);
        let name = self
            .engine
            .table_mut()
            .name_of(key)
            .cloned()
            .unwrap_or_else(|| Arc::from(format!("key{key}")));
        let grant = Grant::new(
            id,
            Arc::clone(&name),
            key,
            token,
            generation,
            Arc::clone(&self.shared),
            Some(tx),
        );
        match reply.send(Ok(Some(grant))) {
            Ok(()) => {
                if let Some(m) = self.metrics() {
                    m.lock_acquired(self.node(), &name, waited);
                }
                debug!(lock = %name, key = %key, token = token.get(), "acquired");
            }
            Err(returned) => {
                if let Ok(Some(mut grant)) = returned {
                    grant.disarm();
                }
                self.engine.table_mut().undelivered(key, id, Instant::now());
            }
        }
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
        let mut seen = HashMap::new();
        for (key, name, n) in self.engine.table_mut().waiting() {
            if self.reported_waiting.get(&key).map(|(_, c)| *c) != Some(n) {
                m.lock_waiting(node, name, n);
            }
            seen.insert(key, (Arc::clone(name), n));
        }
        for (key, (name, n)) in &self.reported_waiting {
            if *n > 0 && !seen.contains_key(key) {
                m.lock_waiting(node, name, 0);
            }
        }
        self.reported_waiting = seen;
    }

    /// Holder look-ups (one statement for all keys asked since the last step) and
    /// cluster views.
    async fn answer_queries(
        &mut self,
        s: &Session,
        deadline: Option<Instant>,
    ) -> Result<(), SessionDownReason> {
        self.holder_queries.retain(|(_, reply)| !reply.is_closed());
        self.cluster_queries.retain(|reply| !reply.is_closed());
        if !self.holder_queries.is_empty() {
            let queries = std::mem::take(&mut self.holder_queries);
            let mut keys: Vec<LockKey> = queries.iter().map(|(k, _)| *k).collect();
            keys.sort_unstable();
            keys.dedup();
            match self
                .guarded(&s.generation, deadline, s.holders(&keys))
                .await
            {
                Ok(answers) => {
                    for (key, reply) in queries {
                        let answer = keys
                            .binary_search(&key)
                            .ok()
                            .and_then(|i| answers.get(i))
                            .cloned()
                            .unwrap_or(Ok(None));
                        let _ = reply.send(answer.map_err(Error::Database));
                    }
                }
                Err(Fault::Lost(reason)) => {
                    for (_, reply) in queries {
                        let _ = reply.send(Err(Error::NotConnected(reason.clone())));
                    }
                    return Err(reason);
                }
                Err(Fault::Query(e)) => {
                    let e = Arc::new(e);
                    for (_, reply) in queries {
                        let _ = reply.send(Err(Error::Database(Arc::clone(&e))));
                    }
                }
            }
        }
        for reply in std::mem::take(&mut self.cluster_queries) {
            match self.guarded(&s.generation, deadline, s.cluster()).await {
                Ok(rows) => {
                    let _ = reply.send(Ok(rows));
                }
                Err(Fault::Lost(reason)) => {
                    let _ = reply.send(Err(Error::NotConnected(reason.clone())));
                    return Err(reason);
                }
                Err(Fault::Query(e)) => {
                    let _ = reply.send(Err(Error::Database(Arc::new(e))));
                }
            }
        }
        Ok(())
    }

    fn answer_releases(&mut self) {
        for reply in self.release_replies.drain(..) {
            let _ = reply.send(Ok(()));
        }
    }

    // ---- commands ----------------------------------------------------------------

    fn handle(&mut self, cmd: Command) {
        let now = Instant::now();
        match cmd {
            Command::Acquire { request, reply } => {
                let key = request.key;
                let name = Arc::clone(&request.name);
                let unknown = self.engine.table_mut().name_of(key).is_none();
                self.replies.insert(request.id, reply);
                self.engine.table_mut().acquire(request, now);
                if unknown
                    && self.engine.table_mut().name_of(key).is_some()
                    && let Some(m) = self.metrics()
                {
                    // A lock new to the table is neither held nor waited for here: its
                    // series start at rest, so followers export them before leading.
                    m.lock_known(self.node(), &name);
                }
                self.carry_out();
            }
            Command::Withdraw { key, id } => {
                self.replies.remove(&id);
                self.engine.table_mut().withdraw(key, id, now);
            }
            Command::Release {
                key,
                lease_id,
                to,
                reply,
            } => {
                self.engine.table_mut().release_to(
                    key,
                    lease_id,
                    to.map(|n| crate::key::node_hash(&n)),
                    now,
                );
                self.carry_out();
                if let Some(reply) = reply {
                    self.release_replies.push(reply);
                }
                if self.current.is_none() {
                    // Nothing is held while disconnected.
                    self.answer_releases();
                }
            }
            Command::Locks(reply) => {
                let _ = reply.send(self.snapshot());
            }
            Command::Cluster(reply) => {
                if self.current.is_some() {
                    self.cluster_queries.push(reply);
                } else {
                    let _ = reply.send(Err(Error::NotConnected(self.last_reason.clone())));
                }
            }
            Command::Holder { key, reply } => {
                if self.current.is_some() {
                    self.holder_queries.push((key, reply));
                } else {
                    let _ = reply.send(Err(Error::NotConnected(self.last_reason.clone())));
                }
            }
            Command::Closing => {
                self.engine.table_mut().begin_close();
                self.carry_out();
            }
            Command::Shutdown(reply) => {
                self.shutdown_replies.push(reply);
                self.shutting_down = true;
            }
        }
    }

    fn snapshot(&self) -> Vec<LockInfo> {
        let node_id = &self.shared.options.node_id;
        let mut out: Vec<LockInfo> = self
            .engine
            .table()
            .snapshot()
            .into_iter()
            .map(|(key, entry)| match entry {
                Entry::Held {
                    id,
                    name,
                    token,
                    generation,
                    since,
                } => LockInfo {
                    name: name.to_string(),
                    key,
                    state: LockState::Held { token, generation },
                    request_id: id,
                    node_id: node_id.clone(),
                    since,
                },
                Entry::Waiting {
                    id,
                    name,
                    position,
                    since,
                } => LockInfo {
                    name: name.to_string(),
                    key,
                    state: LockState::Waiting { position },
                    request_id: id,
                    node_id: node_id.clone(),
                    since,
                },
            })
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name).then(a.request_id.cmp(&b.request_id)));
        out
    }

    // ---- ending and reconnecting ---------------------------------------------------

    /// Revokes every lease of the generation at once, before anything else happens.
    /// Returns until when the lost session is to be kept open, if it is (`may_keep`).
    fn end_generation(
        &mut self,
        generation: &Generation,
        reason: SessionDownReason,
        may_keep: bool,
    ) -> Option<Instant> {
        self.shared.invalidate();
        generation.revoke(reason.clone());
        self.current = None;
        self.last_reason = reason.clone();
        warn!(
            node_id = %self.shared.options.node_id,
            generation = generation.id,
            revoked_leases = self.engine.table_mut().held(),
            %reason,
            "lock session lost; every lease revoked"
        );
        let kept = self.engine.session_lost(Instant::now(), may_keep);
        self.carry_out();
        if let Some(m) = self.metrics() {
            m.connection_changed(self.node(), false, generation.id);
        }
        // The session is gone, and every lock with it.
        for (_, reply) in self.holder_queries.drain(..) {
            let _ = reply.send(Err(Error::NotConnected(reason.clone())));
        }
        for reply in self.cluster_queries.drain(..) {
            let _ = reply.send(Err(Error::NotConnected(reason.clone())));
        }
        self.answer_releases();
        self.shared
            .status
            .send_replace(ConnectionState::Disconnected {
                reason,
                since: SystemTime::now(),
            });
        kept
    }

    /// Keeps a lost session open until `until` at most, on a task of its own (so that
    /// the deadline holds whatever this task is doing), or until
    /// [`close_retired`](Self::close_retired) closes it.
    fn retire(&mut self, mut s: Session, until: Instant) {
        // Nobody reads its notifications any more.
        s.events.close();
        let close = tokio_util::sync::CancellationToken::new();
        let closed = close.clone();
        tokio::spawn(async move {
            tokio::select! {
                () = sleep_until(tokio::time::Instant::from_std(until)) => {}
                () = closed.cancelled() => {}
            }
            debug!(backend_pid = s.backend_pid, "closing the lost lock session");
            drop(s);
        });
        self.retiring.push_back(close);
    }

    /// The shutdown, as the engine sequences it (its rule 7): on the session `s`, or
    /// while disconnected (`None`).
    async fn close(&mut self, mut s: Option<&mut Session>) {
        self.shared.invalidate();
        if let Some(generation) = &self.current {
            generation.revoke(SessionDownReason::Shutdown);
        }
        self.last_reason = SessionDownReason::Shutdown;
        self.engine.begin_shutdown(Instant::now());
        self.carry_out();
        loop {
            let next = self.engine.close_next(Instant::now());
            match (next, s.as_deref_mut()) {
                (CloseNext::Done, _) => break,
                (CloseNext::Step { deadline }, Some(s)) => {
                    if let Err(reason) = self.step(s, Some(deadline)).await {
                        debug!(%reason, "releasing at shutdown failed; closing the session releases the locks");
                        self.engine.close_failed();
                    }
                }
                (CloseNext::Reset { deadline }, Some(s)) => {
                    let generation = Arc::clone(&s.generation);
                    if let Err(e) = self.guarded(&generation, Some(deadline), s.reset()).await {
                        debug!(error = ?e, "resetting the session at shutdown failed");
                    }
                }
                (CloseNext::Step { .. } | CloseNext::Reset { .. }, None) => {
                    self.engine.close_failed();
                }
                (CloseNext::Wait { until }, _) => {
                    tokio::select! {
                        cmd = self.rx.recv() => if let Some(cmd) = cmd {
                            self.handle(cmd);
                        },
                        () = sleep_until(tokio::time::Instant::from_std(until)) => {}
                    }
                    while let Ok(cmd) = self.rx.try_recv() {
                        self.handle(cmd);
                    }
                }
                (CloseNext::Linger { until }, _) => {
                    sleep_until(tokio::time::Instant::from_std(until)).await;
                }
            }
            self.carry_out();
        }
        self.answer_releases();
        if let Some(generation) = self.current.take() {
            if let Some(m) = self.metrics() {
                m.connection_changed(self.node(), false, generation.id);
            }
            info!(node_id = %self.shared.options.node_id, "lock manager shut down");
        }
    }

    /// Closes the lost sessions that the engine says may close (rule 6); those past
    /// their deadline closed themselves already.
    fn close_retired(&mut self) {
        for _ in 0..self.engine.close_retired(Instant::now()) {
            if let Some(close) = self.retiring.pop_front() {
                close.cancel();
            }
        }
    }

    async fn reconnect(&mut self) -> Option<Session> {
        let options = self.shared.options.clone();
        let mut attempt = 0u32;
        loop {
            attempt = attempt.saturating_add(1);
            self.generations += 1;
            self.shared
                .status
                .send_replace(ConnectionState::Connecting { attempt });
            let connect = session::connect(&options, self.generations);
            tokio::pin!(connect);
            let result = loop {
                tokio::select! {
                    result = &mut connect => break result,
                    cmd = self.rx.recv() => match cmd {
                        Some(cmd) => self.handle(cmd),
                        None => return None,
                    },
                }
                if self.shutting_down {
                    return None;
                }
            };
            // A server whose tokens would not order after those this manager was
            // issued is refused until its epoch is raised (the engine's token floor).
            let result =
                result.and_then(|session| match self.engine.check_session(&session.term) {
                    Ok(()) => Ok(session),
                    Err(refused) => Err(Error::Refused(SessionDownReason::ConnectFailed {
                        message: refused.to_string(),
                    })),
                });
            if let Some(m) = self.metrics() {
                m.reconnect_attempt(self.node(), result.is_ok());
            }
            let error = match result {
                Ok(session) => return Some(session),
                Err(e) => e,
            };
            let reason = match &error {
                Error::Refused(reason) | Error::NotConnected(reason) => reason.clone(),
                other => SessionDownReason::ConnectFailed {
                    message: error_chain(other),
                },
            };
            warn!(attempt, error = %error_chain(&error), "lock session reconnect failed");
            self.last_reason = reason.clone();
            self.shared
                .status
                .send_replace(ConnectionState::Disconnected {
                    reason,
                    since: SystemTime::now(),
                });
            let wait = self.engine.connect_failed();
            let until = tokio::time::Instant::now()
                .checked_add(wait)
                .unwrap_or_else(far_future);
            loop {
                tokio::select! {
                    () = sleep_until(until) => break,
                    cmd = self.rx.recv() => match cmd {
                        Some(cmd) => self.handle(cmd),
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
        for close in self.retiring.drain(..) {
            close.cancel();
        }
        self.shared.invalidate();
        if let Some(generation) = self.current.take() {
            generation.revoke(SessionDownReason::Shutdown);
        }
        self.engine.table_mut().begin_close();
        self.carry_out();
        // Waiters reported while connected are gone now, also when the manager ends
        // between sessions (no step reports it then).
        self.report_waiting();
        // Dropping the remaining reply senders answers them with `Error::Closed`.
        self.replies.clear();
        self.answer_releases();
        self.shared
            .status
            .send_replace(ConnectionState::Disconnected {
                reason: SessionDownReason::Shutdown,
                since: SystemTime::now(),
            });
        self.rx.close();
        for reply in self.shutdown_replies.drain(..) {
            let _ = reply.send(());
        }
    }
}

/// What a failed statement means for the session: a query error the step could not
/// absorb ends it too.
fn fault_reason(fault: Fault) -> SessionDownReason {
    match fault {
        Fault::Lost(reason) => reason,
        Fault::Query(e) => SessionDownReason::ConnectionLost {
            message: format!("statement failed: {}", error_text(&e)),
        },
    }
}

fn revoke_reason(generation: &Generation) -> SessionDownReason {
    generation
        .reason
        .get()
        .cloned()
        .unwrap_or(SessionDownReason::Shutdown)
}

fn far_future() -> tokio::time::Instant {
    tokio::time::Instant::now() + Duration::from_secs(86_400 * 365)
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
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
