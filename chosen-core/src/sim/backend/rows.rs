//! The lease-row mode on the simulated server: a session is a holder id, its locks are
//! rows of the model's tables (see [`Server::execute_rows`](super::Server)), and its
//! batches go over connections of a pool, as `rows.rs` sends them.
//!
//! What the PostgreSQL mode does, this does too: a batch runs one at a time in the
//! session's order, on the session's connection (a new one once that one failed or was
//! terminated), within the lease timeout; any failure ends the session; a batch that
//! reaches a server other than the session's (restarted, promoted) fails; the rows stay
//! when the connection ends, and when the process dies; dropping the link deletes the
//! session's rows (best effort, unless the process is dead). Its faults are the
//! PostgreSQL mode's own: a batch rolled back, a batch committed whose answer is lost,
//! a batch given up by its client (the lease timeout, a black hole) that still reaches
//! the server and commits late, a terminated pooled connection, and the server's wall
//! clock stepping forward.
//!
//! A takeover of a row checks the timing invariant directly: the row's holder trusted
//! it (as its client's round trips allow: the send time of its last answered batch
//! plus the lease timeout) at least its stop budget before it was taken.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use super::{Conn, Inner, SimServer};
use crate::backend::{BoxFuture, ConnEvent, HeartbeatLink, HolderAnswer, Link};
use crate::engine::Done;
use crate::fault::Fault;
use crate::info::HolderInfo;
use crate::key::{LockKey, SessionLock};
use crate::rows_step::{self, Steps, lost};
use crate::sim::T;
use crate::status::SessionDownReason;
use crate::table::Plan;

/// The lease-row mode's part of the server's state.
#[derive(Debug, Default)]
pub(super) struct RowsState {
    /// Batches no longer fail by themselves (the faults are over).
    pub(super) calm: bool,
    /// A server that lets rows expire sooner than their sessions asked (a broken
    /// timing invariant, for the checks' own test).
    pub(super) max_ttl: Option<T>,
    /// The next holder id (apart from every backend pid).
    next_holder: i32,
    /// Each holder's node, and whether its link is still open.
    pub(super) holders: std::collections::BTreeMap<i32, (String, bool)>,
    /// How long each holder's client trusts its rows at most (the send time of its
    /// last answered batch plus its lease timeout), and its stop budget.
    trust: std::collections::BTreeMap<i32, (Instant, Duration)>,
}

impl Inner {
    /// A new holder id for a session of `node_id`.
    pub(super) fn new_holder(&mut self, node_id: &str) -> i32 {
        let rows = self.rows.get_or_insert_with(RowsState::default);
        rows.next_holder = rows.next_holder.max(1_000_000) + 1;
        let holder = rows.next_holder;
        rows.holders.insert(holder, (node_id.to_owned(), true));
        holder
    }

    /// Now and then a batch fails: rolled back (nothing of it happened), or committed
    /// with its answer lost (the connection broke after the commit).
    fn rows_failing(&mut self) -> &'static str {
        if self.rows.as_ref().is_none_or(|r| r.calm) {
            return "";
        }
        if !crate::table::next_random(&mut self.rng).is_multiple_of(100) {
            return "";
        }
        self.last_failure = Some(Instant::now());
        if crate::table::next_random(&mut self.rng).is_multiple_of(2) {
            "rolled_back"
        } else {
            "answer_lost"
        }
    }

    /// Rows taken over: each holder must have stopped trusting its row its stop budget
    /// before.
    fn check_takeovers(&mut self, taken: &[(LockKey, crate::sim::server::Row)]) {
        let now = Instant::now();
        for (key, row) in taken {
            let Some(rows) = &self.rows else {
                return;
            };
            // A promotion lost its last renewals: it may be taken that much sooner
            // (the new term's hold keeps the next grant back, which the fleet's acting
            // check sees).
            let lost = Duration::from_micros(row.lost);
            if let Some((until, budget)) = rows.trust.get(&row.holder)
                && now + lost < *until + *budget
            {
                self.violations.push(format!(
                    "the row of {key} held by {} is taken over at {:?}, {:?} after that holder's client stopped trusting it (at {:?}), within its stop budget of {budget:?}",
                    row.holder,
                    now.duration_since(self.base),
                    now.checked_duration_since(*until),
                    until.duration_since(self.base),
                ));
            }
        }
    }

    fn row_holder_info(&self, row: crate::sim::server::Row) -> HolderInfo {
        HolderInfo {
            node_id: self
                .rows
                .as_ref()
                .and_then(|r| r.holders.get(&row.holder))
                .map(|(n, _)| n.clone())
                .unwrap_or_default(),
            backend_pid: row.holder,
            client_addr: None,
            session_start: u64::try_from(row.start)
                .ok()
                .map(|us| std::time::SystemTime::UNIX_EPOCH + Duration::from_micros(us)),
        }
    }

    /// A new pooled connection for node `node_id`'s sessions, or `None` while the
    /// server is down.
    fn pool_connection(&mut self, node_id: &str) -> Option<i32> {
        let now = self.now();
        let n = self.node_index(node_id);
        let connected = self.model.connect(n, 0, now, 0)?;
        let (events, _) = mpsc::unbounded_channel();
        self.conns.insert(
            connected.pid,
            Conn {
                node_id: node_id.to_owned(),
                events,
                closed: Arc::new(AtomicBool::new(false)),
                ended: tokio_util::sync::CancellationToken::new(),
                server_ended: false,
                deaf: true,
                last_up: Instant::now(),
                last_down: Instant::now(),
            },
        );
        Some(connected.pid)
    }
}

/// One lease-row session: what every batch of it needs.
pub(super) struct RowsSession {
    pub(super) server: Arc<SimServer>,
    pub(super) holder: i32,
    /// When the session began (microseconds since the Unix epoch).
    pub(super) start: i64,
    pub(super) node_id: String,
    /// The server identity the session began on: a batch that reaches another fails.
    pub(super) identity: String,
    pub(super) high: u16,
    /// `server_release_after`: how long a row lives past its renewal.
    pub(super) ttl: T,
    pub(super) timeout: Duration,
    pub(super) stop_budget: Duration,
    pub(super) dead: Arc<AtomicBool>,
    /// The session's pooled connection (`None`: take a new one).
    pub(super) conn: Mutex<Option<i32>>,
    /// Batches run one at a time, in the order sent.
    pub(super) turn: tokio::sync::Mutex<()>,
}

impl RowsSession {
    /// How long its rows live past a renewal, as the server keeps them.
    fn ttl(&self) -> T {
        let max = self.server.lock().rows.as_ref().and_then(|r| r.max_ttl);
        max.map_or(self.ttl, |m| m.min(self.ttl))
    }

    /// Runs `run` at the server as one batch (see the module's notes).
    async fn trip<R: Send + 'static>(
        self: &Arc<Self>,
        run: impl FnOnce(&mut Inner, T) -> R + Send + 'static,
    ) -> Result<R, Fault> {
        let deadline = Instant::now() + self.timeout;
        let Ok(_turn) = tokio::time::timeout_at(deadline, self.turn.lock()).await else {
            return Err(lost(
                "an earlier statement of the lease session is still running past the lease timeout (simulated)"
                    .to_owned(),
            ));
        };
        if self.dead.load(Ordering::Acquire) {
            std::future::pending::<()>().await;
        }
        let sent = Instant::now();
        let (pid, arrival, ended) = {
            let mut inner = self.server.lock();
            let mut slot = self
                .conn
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let pid = match slot.filter(|p| inner.conns.contains_key(p)) {
                Some(pid) => pid,
                None => match inner.pool_connection(&self.node_id) {
                    Some(pid) => pid,
                    None => {
                        return Err(lost(
                            "the pool gave no connection: the server is down (simulated)"
                                .to_owned(),
                        ));
                    }
                },
            };
            *slot = Some(pid);
            let arrival = inner.arrival_up(pid);
            let ended = inner
                .conns
                .get(&pid)
                .map(|c| c.ended.clone())
                .unwrap_or_default();
            (pid, arrival, ended)
        };
        let (tx, rx) = oneshot::channel::<Result<R, Fault>>();
        // The server's side goes on whatever the client does meanwhile: a batch given
        // up by its client still commits when it arrives.
        tokio::spawn({
            let (server, node_id, identity) = (
                Arc::clone(&self.server),
                self.node_id.clone(),
                self.identity.clone(),
            );
            async move {
                tokio::time::sleep_until(arrival).await;
                server.until_healed(&node_id).await;
                let (answer, back) = {
                    let mut inner = server.lock();
                    // Ended by the server before it arrived (terminated, a restart):
                    // rolled back; the client hears of the connection's end.
                    if !inner.model.up || inner.model.ended_by_server.contains_key(&pid) {
                        return;
                    }
                    let now = inner.now();
                    inner.model.touch(pid, now);
                    let failing = inner.rows_failing();
                    let answer = if failing == "rolled_back" {
                        Err(lost("a lease statement failed (simulated)".to_owned()))
                    } else if inner.model.identity() != identity {
                        Err(lost(
                            "the pool's connection reached another server than the session's (simulated)"
                                .to_owned(),
                        ))
                    } else {
                        let answer = run(&mut inner, now);
                        if failing == "answer_lost" {
                            Err(lost(
                                "the connection broke after the batch committed (simulated)"
                                    .to_owned(),
                            ))
                        } else {
                            Ok(answer)
                        }
                    };
                    let back = Instant::now() + inner.latency();
                    let back = match inner.conns.get_mut(&pid) {
                        Some(conn) => {
                            let at = back.max(conn.last_down + Duration::from_micros(1));
                            conn.last_down = at;
                            at
                        }
                        None => back,
                    };
                    (answer, back)
                };
                tokio::time::sleep_until(back).await;
                server.until_healed(&node_id).await;
                let _ = tx.send(answer);
            }
        });
        let answer = tokio::select! {
            biased;
            () = ended.cancelled() => Err(lost("server closed the connection unexpectedly (simulated)".to_owned())),
            answer = tokio::time::timeout_at(deadline, rx) => match answer {
                Ok(Ok(answer)) => answer,
                Ok(Err(_)) => Err(lost("server closed the connection unexpectedly (simulated)".to_owned())),
                Err(_) => Err(lost(format!("a lease statement got no answer within the lease timeout of {:?} (simulated)", self.timeout))),
            },
        };
        let mut inner = self.server.lock();
        match &answer {
            Ok(_) => {
                let until = sent + self.timeout;
                if let Some(rows) = &mut inner.rows {
                    let trust = rows
                        .trust
                        .entry(self.holder)
                        .or_insert((until, self.stop_budget));
                    trust.0 = trust.0.max(until);
                }
            }
            // The checkout closes the connection: the next batch takes another.
            Err(_) => {
                let mut slot = self
                    .conn
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                if *slot == Some(pid) {
                    *slot = None;
                }
                if let Some(conn) = inner.conns.remove(&pid) {
                    conn.ended.cancel();
                }
            }
        }
        answer
    }
}

/// A lease-row session's link.
pub(super) struct SimRowsLink {
    pub(super) session: Arc<RowsSession>,
    /// Kept so that the events channel stays open: a pool has no session to end.
    pub(super) _events: mpsc::UnboundedSender<ConnEvent>,
}

impl Drop for SimRowsLink {
    fn drop(&mut self) {
        let session = Arc::clone(&self.session);
        {
            let mut inner = session.server.lock();
            if let Some((_, open)) = inner
                .rows
                .as_mut()
                .and_then(|r| r.holders.get_mut(&session.holder))
            {
                *open = false;
            }
        }
        // A dead process deletes nothing: its rows expire.
        if session.dead.load(Ordering::Acquire) {
            return;
        }
        tokio::spawn(async move {
            let holder = session.holder;
            let _ = session
                .trip(move |inner, _| inner.model.release_rows(holder))
                .await;
        });
    }
}

impl Link for SimRowsLink {
    fn perform<'a>(
        &'a self,
        plan: &'a Plan,
    ) -> BoxFuture<'a, Result<(Done, Option<tokio_postgres::Error>), Fault>> {
        Box::pin(async move {
            let steps = Steps::of(plan);
            let session = &self.session;
            let (holder, start) = (session.holder, session.start);
            let ttl = session.ttl();
            let node_hash = crate::key::node_hash(&session.node_id);
            let answer = session
                .trip({
                    let steps = steps.clone();
                    move |inner, now| {
                        let mut taken = Vec::new();
                        let answer = inner.model.execute_rows(
                            (holder, start, node_hash),
                            &steps,
                            now,
                            ttl,
                            &mut taken,
                        );
                        inner.check_takeovers(&taken);
                        answer
                    }
                })
                .await?;
            Ok((rows_step::interpret(&steps, &answer, session.high)?, None))
        })
    }

    fn holders<'a>(
        &'a self,
        keys: &'a [LockKey],
    ) -> BoxFuture<'a, Result<Vec<HolderAnswer>, Fault>> {
        let keys = keys.to_vec();
        Box::pin(self.session.trip(move |inner, now| {
            keys.iter()
                .map(|k| {
                    Ok(inner
                        .model
                        .live_row(*k, now)
                        .map(|r| inner.row_holder_info(r)))
                })
                .collect()
        }))
    }

    fn cluster(&self) -> BoxFuture<'_, Result<Vec<(LockKey, HolderInfo)>, Fault>> {
        Box::pin(self.session.trip(move |inner, now| {
            let live: Vec<(LockKey, crate::sim::server::Row)> = inner
                .model
                .rows
                .keys()
                .filter_map(|k| inner.model.live_row(*k, now).map(|r| (*k, r)))
                .collect();
            live.into_iter()
                .map(|(k, r)| (k, inner.row_holder_info(r)))
                .collect()
        }))
    }

    fn reset(&self) -> BoxFuture<'_, Result<(), Fault>> {
        let holder = self.session.holder;
        Box::pin(
            self.session
                .trip(move |inner, _| inner.model.release_rows(holder)),
        )
    }

    fn heartbeat_link(&self) -> Box<dyn HeartbeatLink> {
        Box::new(SimRowsHeartbeat {
            session: Arc::clone(&self.session),
        })
    }

    fn is_closed(&self) -> bool {
        false
    }
}

struct SimRowsHeartbeat {
    session: Arc<RowsSession>,
}

impl HeartbeatLink for SimRowsHeartbeat {
    fn explain(&self, reason: SessionDownReason) -> SessionDownReason {
        rows_step::explain(reason)
    }

    fn heartbeat(&self) -> BoxFuture<'_, Result<Vec<SessionLock>, SessionDownReason>> {
        Box::pin(async move {
            let (holder, ttl) = (self.session.holder, self.session.ttl());
            match self
                .session
                .trip(move |inner, now| inner.model.renew_rows(holder, now, ttl))
                .await
            {
                Ok(locks) => Ok(locks),
                Err(Fault::Lost(reason)) => Err(reason),
                Err(Fault::Query(_)) => Err(SessionDownReason::ConnectionLost {
                    message: "heartbeat failed (simulated)".to_owned(),
                }),
            }
        })
    }
}
