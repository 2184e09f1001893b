//! What the task answers: the engine's actions carried out (leases delivered, requests
//! answered, metrics), the handles' commands fed to the engine, and the look-ups.

use crate::maps::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::debug;

use super::Driver;
use crate::backend::Session;
use crate::command::{Command, Grant};
use crate::error::{Error, Result};
use crate::fault::Fault;
use crate::info::{LockInfo, LockState};
use crate::key::LockKey;
use crate::status::SessionDownReason;
use crate::table::{Action, Entry, Refusal, RequestId, TokenRead};
use crate::token::FencingToken;

impl Driver {
    /// Carries out the table's actions: leases granted, requests answered, metrics.
    pub(super) fn carry_out(&mut self) {
        let closing = self.shared.closing.is_cancelled();
        while let Some(action) = self.engine.poll_action(crate::clock::now(), closing) {
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
                Action::Token { id, key, token } => {
                    for reply in self.token_replies.remove(&id).unwrap_or_default() {
                        let _ = reply.send(token);
                    }
                    // Answered only to the holder that asked, still holding.
                    if let Some(token) = token
                        && self.metrics().is_some()
                        && let Some(name) = self.engine.table_mut().name_of(key).cloned()
                        && let Some(m) = self.metrics()
                    {
                        m.fencing_token(self.node(), &name, Some(token.get()));
                    }
                }
                Action::Released { key, name } => {
                    debug!(lock = %name, key = %key, "released");
                    if let Some(m) = self.metrics() {
                        m.lock_released(self.node(), &name);
                        m.fencing_token(self.node(), &name, None);
                    }
                }
                Action::Lost { key, name } => {
                    debug!(lock = %name, key = %key, "lost with the session");
                    if let Some(m) = self.metrics() {
                        m.lock_lost(self.node(), &name, self.last_reason.label());
                        m.fencing_token(self.node(), &name, None);
                    }
                }
            }
        }
    }

    /// Sends a lease to its requester; if the request was withdrawn at this very moment,
    /// the table takes the lock back.
    pub(super) fn deliver(
        &mut self,
        id: RequestId,
        key: LockKey,
        token: Option<FencingToken>,
        generation_id: u64,
        waited: Duration,
    ) {
        let (Some(reply), Some(generation), Some(tx)) = (
            self.replies.remove(&id),
            self.current.clone(),
            self.weak_tx.upgrade(),
        ) else {
            self.engine
                .table_mut()
                .undelivered(key, id, crate::clock::now());
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
                    if let Some(token) = token {
                        m.fencing_token(self.node(), &name, Some(token.get()));
                    }
                }
                debug!(lock = %name, key = %key, token = token.map(FencingToken::get), "acquired");
            }
            Err(returned) => {
                if let Ok(Some(mut grant)) = returned {
                    grant.disarm();
                }
                self.engine
                    .table_mut()
                    .undelivered(key, id, crate::clock::now());
            }
        }
    }

    pub(super) fn metrics(&self) -> Option<&dyn crate::MetricsSink> {
        self.shared.options.metrics.as_deref()
    }

    pub(super) fn node(&self) -> &str {
        &self.shared.options.node_id
    }

    /// Brings the sink's waiter gauges up to date (only when a sink is set).
    pub(super) fn report_waiting(&mut self) {
        let Some(m) = self.shared.options.metrics.clone() else {
            return;
        };
        let node = &self.shared.options.node_id;
        let mut seen = HashMap::default();
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
    pub(super) async fn answer_queries(
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

    pub(super) fn answer_releases(&mut self) {
        for reply in self.release_replies.drain(..) {
            let _ = reply.send(Ok(()));
        }
    }

    // ---- commands ----------------------------------------------------------------

    pub(super) fn handle(&mut self, cmd: Command) {
        let now = crate::clock::now();
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
            Command::Token { key, id, reply } => {
                match self.engine.table_mut().read_token(key, id) {
                    TokenRead::Known(token) => {
                        let _ = reply.send(Some(token));
                    }
                    TokenRead::NotHeld => {
                        let _ = reply.send(None);
                    }
                    // Answered by the table's `Action::Token`, with every read of the
                    // lease that came meanwhile (the dropped ones' too).
                    TokenRead::Pending => {
                        let replies = self.token_replies.entry(id).or_default();
                        replies.retain(|r| !r.is_closed());
                        replies.push(reply);
                    }
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

    pub(super) fn snapshot(&self) -> Vec<LockInfo> {
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
}
