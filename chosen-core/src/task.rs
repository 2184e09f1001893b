//! The manager's task: the only code that touches the connection, and none of the
//! rules. It feeds commands, notifications and statement results to the
//! [`Engine`], and carries out what the engine decides through the [`Session`]'s
//! statements: the plans of each step, the shutdown sequence, the lost sessions kept
//! open, the reconnect waits. A separate heartbeat task proves the session alive, so
//! no statement, command or notification flood can delay it.
//!
//! This file is the loop; [`answers`] carries out the engine's actions and the
//! handles' commands, [`lifecycle`] ends and opens sessions.

mod answers;
mod lifecycle;

use crate::maps::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use tokio::sync::mpsc::{UnboundedReceiver, WeakUnboundedSender};
use tokio::sync::oneshot;
use tokio::time::sleep_until;
use tracing::{debug, info};

use crate::backend::{Backend, ConnEvent, Session};
use crate::clock::far_future;
use crate::command::{ClusterReply, Command, Grant, HolderReply};
use crate::engine::{CloseNext, Engine, Overdue};
use crate::error::Result;
use crate::fault::{Fault, error_text};
use crate::generation::Generation;
use crate::key::LockKey;
use crate::shared::Shared;
use crate::status::{ConnectionState, SessionDownReason};
use crate::table::RequestId;

enum Exit {
    Lost(SessionDownReason),
    Shutdown,
}

pub(crate) struct Driver {
    shared: Arc<Shared>,
    /// Where sessions come from.
    backend: Arc<dyn Backend>,
    rx: UnboundedReceiver<Command>,
    weak_tx: WeakUnboundedSender<Command>,
    engine: Engine,
    /// Reply channels of requests the table still has (waiting or in a statement).
    replies: HashMap<RequestId, oneshot::Sender<Result<Option<Grant>>>>,
    /// Token reads waiting for the table's answer, by lease.
    token_replies: HashMap<RequestId, Vec<oneshot::Sender<Option<crate::token::FencingToken>>>>,
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
        backend: Arc<dyn Backend>,
    ) -> Self {
        // A backend's seed is one for every node it serves: each node's own id is mixed
        // in, so that their jitter differs as it does between processes.
        let node_seed = shared
            .options
            .node_id
            .bytes()
            .fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
                (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
            });
        let seed = backend.seed().map(|s| s ^ node_seed).unwrap_or_else(|| {
            SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64)
                ^ u64::from(std::process::id()).rotate_left(32)
                ^ (Arc::as_ptr(&shared) as u64)
        });
        Self {
            engine: Engine::new(
                shared.options.table_rules(),
                shared.options.engine_timing(),
                seed,
            ),
            shared,
            rx,
            weak_tx,
            backend,
            replies: HashMap::default(),
            token_replies: HashMap::default(),
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
            reported_waiting: HashMap::default(),
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
        if let Some(grants_in) =
            self.engine
                .session_started(generation.id, &s.term, crate::clock::now())
        {
            let began = s.term.age.map_or_else(
                || "at an unknown time (a promotion)".to_owned(),
                |age| format!("{:.1} s ago", age.as_secs_f64()),
            );
            info!(
                node_id = %self.shared.options.node_id,
                timeline = s.term.timeline,
                term_age = ?s.term.age,
                ?grants_in,
                "no lock is granted for {:.1} s: the server started or was promoted {began}, and a holder from before that may still trust its lease until then (ManagerOptions::term_grant_delay)",
                grants_in.as_secs_f64()
            );
        }
        self.shared.set_server_floor(Vec::new(), None);
        let heartbeat = tokio::spawn(tracing::Instrument::in_current_span(crate::heartbeat::run(
            s.heartbeat_handle(),
            Arc::clone(&self.shared),
            Arc::clone(&generation),
            s.proven_at,
        )));
        let _heartbeat = AbortOnDrop::new(heartbeat);

        let exit = loop {
            // Everything already queued first, merged: requests, releases and
            // announcements of one iteration cost one step.
            while let Ok(cmd) = self.rx.try_recv() {
                self.handle(cmd);
            }
            if let Some(exit) = self.drain_events(&mut s) {
                break exit;
            }
            // A session already known lost (or past its validity deadline, the
            // heartbeat's watchdog not having run yet) is lost, even with a shutdown
            // asked: the shutdown then waits for what is still stopping, at most the stop
            // budget, instead of stepping on a dead session until its statement deadline.
            if generation.revoked.is_cancelled() {
                break Exit::Lost(revoke_reason(&generation));
            }
            if !self.shared.is_valid_now() {
                break Exit::Lost(SessionDownReason::HeartbeatOverdue {
                    lease_timeout: self.shared.options.lease_timeout,
                });
            }
            if self.shutting_down {
                break Exit::Shutdown;
            }
            if let Err(reason) = self.step(&s, None).await {
                break Exit::Lost(reason);
            }
            self.close_retired();
            let wakeup = self
                .engine
                .next_wakeup(crate::clock::now())
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
                let pooled = !self.backend.holds_rows()
                    && matches!(
                        reason,
                        SessionDownReason::PoolerDetected { .. }
                            | SessionDownReason::BackendChanged { .. }
                    );
                if pooled {
                    self.backend.forget_proven();
                }
                let may_keep = !s.is_closed() && !pooled;
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
            .plan(crate::clock::now(), self.shared.is_valid_now(), closing)
            .map_err(overdue)?;
        // Lowered before the statements that release locks are sent; and until their
        // answer is applied, heartbeats prove the session no later than their send
        // (what they take is in no floor yet).
        self.shared.set_server_floor(
            self.engine.server_floor(),
            plan.takes_locks().then(crate::clock::now),
        );
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
                    crate::clock::now(),
                )
                .map_err(overdue)?;
            self.shared
                .set_server_floor(self.engine.server_floor(), None);
            self.carry_out();
        }
        self.answer_releases();
        self.report_waiting();
        self.answer_queries(s, deadline).await
    }

    /// The shutdown, as the engine sequences it (its rule 7): on the session `s`, or
    /// while disconnected (`None`).
    async fn close(&mut self, mut s: Option<&mut Session>) {
        self.shared.invalidate();
        if let Some(generation) = &self.current {
            generation.revoke(SessionDownReason::Shutdown);
        }
        self.last_reason = SessionDownReason::Shutdown;
        self.engine.begin_shutdown(crate::clock::now());
        self.carry_out();
        loop {
            let next = self.engine.close_next(crate::clock::now());
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
                    let until = tokio::time::Instant::from_std(until);
                    tokio::select! {
                        biased;
                        // The deadline first; commands that came meanwhile are handled
                        // just below.
                        () = sleep_until(until) => {}
                        cmd = self.rx.recv() => match cmd {
                            Some(cmd) => self.handle(cmd),
                            // No handle left (nor a lease, whose grant holds one).
                            None => sleep_until(until).await,
                        },
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

/// Aborts its task when dropped, unless [`disarm`](Self::disarm)ed first.
pub(crate) struct AbortOnDrop<T = ()>(Option<tokio::task::JoinHandle<T>>);

impl AbortOnDrop {
    pub(crate) fn new(task: tokio::task::JoinHandle<()>) -> Self {
        Self(Some(task))
    }
}

impl<T> AbortOnDrop<T> {
    /// A task whose output is awaited with [`join`](Self::join).
    pub(crate) fn with_output(task: tokio::task::JoinHandle<T>) -> Self {
        Self(Some(task))
    }

    /// The task, no longer aborted on drop.
    pub(crate) fn disarm(mut self) -> tokio::task::JoinHandle<T> {
        self.0.take().expect("BUG: disarmed twice")
    }

    /// The task's output (aborted if this future is dropped first).
    pub(crate) async fn join(mut self) -> Result<T, tokio::task::JoinError> {
        // `disarm` consumes `self`: a handle is always here.
        match self.0.as_mut() {
            Some(task) => task.await,
            None => std::future::pending().await,
        }
    }
}

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        if let Some(task) = &self.0 {
            task.abort();
        }
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
