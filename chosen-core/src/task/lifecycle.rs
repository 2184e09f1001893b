//! How sessions end and begin: a lost one revoked and kept open while the engine says
//! so (its rule 6), the manager's end, and the reconnect loop with the engine's
//! backoff and token floor.

use std::time::{Instant, SystemTime};

use tokio::time::sleep_until;
use tracing::{debug, warn};

use super::{Driver, error_chain};
use crate::backend::Session;
use crate::clock::far_future;
use crate::error::Error;
use crate::generation::Generation;
use crate::status::{ConnectionState, SessionDownReason};

impl Driver {
    /// Revokes every lease of the generation at once, before anything else happens.
    /// Returns until when the lost session is to be kept open, if it is (`may_keep`).
    pub(super) fn end_generation(
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
        let kept = self.engine.session_lost(crate::clock::now(), may_keep);
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
    pub(super) fn retire(&mut self, mut s: Session, until: Instant) {
        // Nobody reads its notifications any more.
        s.events.close();
        let close = tokio_util::sync::CancellationToken::new();
        let closed = close.clone();
        tokio::spawn(async move {
            tokio::select! {
                biased;
                () = sleep_until(tokio::time::Instant::from_std(until)) => {}
                () = closed.cancelled() => {}
            }
            debug!(backend_pid = s.backend_pid, "closing the lost lock session");
            drop(s);
        });
        self.retiring.push_back(close);
    }

    /// Closes the lost sessions that the engine says may close (rule 6); those past
    /// their deadline closed themselves already.
    pub(super) fn close_retired(&mut self) {
        for _ in 0..self.engine.close_retired(crate::clock::now()) {
            if let Some(close) = self.retiring.pop_front() {
                close.cancel();
            }
        }
    }

    /// Opens the next session, retrying with the engine's backoff; `None` when the
    /// manager shuts down meanwhile.
    pub(super) async fn reconnect(&mut self) -> Option<Session> {
        let options = self.shared.options.clone();
        let mut attempt = 0u32;
        loop {
            // The shutdown may have been read already: by the last session's loop
            // before it found the session lost, or between two attempts.
            if self.shutting_down {
                return None;
            }
            attempt = attempt.saturating_add(1);
            self.generations += 1;
            self.shared
                .status
                .send_replace(ConnectionState::Connecting { attempt });
            let backend = std::sync::Arc::clone(&self.backend);
            let connect = backend.connect(&options, self.generations);
            tokio::pin!(connect);
            let result = loop {
                tokio::select! {
                    biased;
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
                    biased;
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

    pub(super) fn finish(&mut self) {
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
