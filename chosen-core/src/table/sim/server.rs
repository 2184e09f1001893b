//! The simulated server: its backends and their advisory locks (keys, stop fences,
//! interest keys), its announcements, its transaction ids and terms, as PostgreSQL
//! keeps them for chosen's statements. No network, no clock and no randomness of its
//! own: the caller says when each thing happens and which statement fails, and gets
//! back the answer, what the server sent to whom, and what broke a rule of the
//! protocol. The engine simulation drives it; a simulated fleet is to share it.

use std::collections::{BTreeMap, BTreeSet};

use super::{SEC, T, epoch_us};
use crate::engine::TryFailed;
use crate::key::{LockKey, SessionLock};
use crate::table::{Backend as Seen, FenceCheck, Plan, TryOutcome};
use crate::token::FencingToken;

/// What the first queries of a new session find.
#[derive(Clone, Debug)]
pub(super) struct Connected {
    pub(super) pid: i32,
    /// When the session is ready (proven).
    pub(super) ready: T,
    /// The term's age as the term query finds it (`None`: unknown).
    pub(super) term_age: Option<T>,
    pub(super) high: u16,
    pub(super) identity: String,
    pub(super) system: u32,
    pub(super) first_xid: u64,
    /// Opened before the DBA set a replaced cluster's epoch.
    pub(super) unepoched: bool,
}

/// One announcement to one listening backend (of node `n`, instance `inst`).
#[derive(Clone, Debug)]
pub(super) struct Notice {
    pub(super) n: usize,
    pub(super) inst: u32,
    pub(super) to: i32,
    pub(super) sender: i32,
    pub(super) sender_start: T,
    pub(super) sent_at: T,
    pub(super) keys: Vec<LockKey>,
    pub(super) hand: Vec<(LockKey, u64)>,
}

/// What a plan's statements did.
#[derive(Debug, Default)]
pub(super) struct Executed {
    /// The answer.
    pub(super) reply: Reply,
    /// Rules of the protocol the plan broke, in the order found.
    pub(super) violations: Vec<String>,
    /// Statement failures that happened, by kind.
    pub(super) faults: Vec<&'static str>,
    /// The plan ran a try statement.
    pub(super) tried: bool,
    /// The announcements its statements sent, in order, each to every listener.
    pub(super) notices: Vec<Vec<Notice>>,
}

#[derive(Clone, Debug, Default)]
pub(super) struct Reply {
    /// When the server ran the statements.
    pub(super) at: T,
    pub(super) token: Option<FencingToken>,
    pub(super) tried: Vec<(LockKey, TryOutcome)>,
    /// Keys whose interest bucket the try statement registered.
    pub(super) registered: Vec<LockKey>,
    /// Keys of `verify` won, with the start of the backend that has the pid now.
    pub(super) senders: Vec<(LockKey, Option<i64>)>,
    pub(super) fenced: Vec<(LockKey, bool)>,
    pub(super) checked: Vec<(LockKey, FenceCheck)>,
    /// The try statement failed with the session intact (cancelled, timed out,
    /// refused, the lock table full): no key of it was taken.
    pub(super) try_failed: Option<TryFailed>,
    /// The token statement found keys of the hand-off no longer held by the session
    /// (another client released them): the session ends, as a pooler's.
    pub(super) locks_gone: bool,
}

#[derive(Clone, Copy, Debug)]
pub(super) struct Backend {
    pub(super) n: usize,
    pub(super) inst: u32,
    pub(super) last: T,
    /// `backend_start`.
    pub(super) start: T,
    /// The high bits of its tokens, as its client read them at connect (the token
    /// epoch is a database setting: a session keeps the value it started with).
    pub(super) high: u16,
    /// Opened on a replaced cluster before the DBA set its token epoch.
    pub(super) unepoched: bool,
    /// How far the server's clock had stepped since its term began when this
    /// session read the term's age (`None`: the age was unknown).
    pub(super) age_step: Option<i64>,
    /// The cluster (system identifier) it is on.
    pub(super) system: u32,
}

#[derive(Clone, Copy, Debug)]
pub(super) struct FenceHold {
    pub(super) key: LockKey,
    pub(super) pid: i32,
    pub(super) from: T,
    pub(super) to: Option<T>,
}

#[derive(Debug)]
pub(super) struct Server {
    pub(super) up: bool,
    /// When the server's current term as primary began (it came up), `None` when long
    /// before the run (an hour).
    pub(super) started: Option<T>,
    pub(super) backends: BTreeMap<i32, Backend>,
    /// Exclusive advisory locks (the keys).
    pub(super) excl: BTreeMap<LockKey, i32>,
    /// Stop fences, as `FENCE_SQL` takes them: shared, by any number of backends; the
    /// probes (in the try and the check) are exclusive, and fail against any of them.
    pub(super) fences_shared: BTreeMap<LockKey, BTreeSet<i32>>,
    /// Interest buckets: the backends holding each bucket's interest key (shared).
    pub(super) interest: BTreeMap<u16, BTreeSet<i32>>,
    /// Advisory locks another client took on a node's backend (a pooler's other
    /// client), in a key space no node uses: how many, per backend.
    pub(super) foreign_locks: BTreeMap<i32, u8>,
    pub(super) next_pid: i32,
    pub(super) xid: u64,
    /// Backends of no node (a forger on a reused pid): their starts.
    pub(super) foreign: BTreeMap<i32, T>,
    /// The last announcement each backend sent (what a forger replays).
    pub(super) last_payload: BTreeMap<i32, Payload>,
    /// The timeline it writes (a promoted standby's is one higher; a replaced cluster
    /// starts at 1 again).
    pub(super) timeline: u16,
    /// Its `chosen.token_epoch` (a DBA sets it on a replaced cluster).
    pub(super) epoch: u16,
    /// Its system identifier (a replaced cluster has another).
    pub(super) system: u32,
    /// Its wall clock minus virtual time, in microseconds (a clock step changes it).
    pub(super) clock: i64,
    /// The wall-clock time it recorded for its term's start (what the term query's age
    /// is measured from, with the wall clock of the moment).
    pub(super) started_wall: Option<i64>,
    /// Until then the term's start is unknown (a promoted server whose end-of-recovery
    /// checkpoint is not done: the term query answers no age).
    pub(super) age_unknown_until: T,
    /// When the previous term stopped answering (a restart, a crash, a promotion):
    /// every holder of it trusted its lease at most `lease` longer, and then had
    /// `stop_budget` to stop.
    pub(super) ended: Option<T>,
    /// What the next `ServerUp` brings.
    pub(super) coming: Coming,
    /// Its clock offset when its term began.
    pub(super) clock_at_start: i64,
    /// The highest high bits any of its sessions had (what a DBA takes the token
    /// epoch of a replacement from).
    pub(super) high_water: u16,
    /// The DBA forgot to set the token epoch on a replaced cluster, and sets it (to
    /// `epoch_due`) later.
    pub(super) epoch_missing: bool,
    pub(super) epoch_due: u16,
    /// The stop fence of each key.
    pub(super) fence_of: BTreeMap<LockKey, LockKey>,
    /// Every stop fence held, by whom and when (for the checks).
    pub(super) fences: Vec<FenceHold>,
    /// Backends whose advisory locks another client released, and when.
    pub(super) discarded: Vec<(i32, T)>,
    /// Backends the server ended (not their clients), and when.
    pub(super) ended_by_server: BTreeMap<i32, T>,
}

impl Server {
    /// The high bits of its tokens: the timeline plus the token epoch.
    pub(super) fn high(&self) -> u16 {
        self.timeline + self.epoch
    }

    /// What tells its term from another when the age is unknown (the term query's
    /// `identity`: the timeline and the postmaster's start).
    pub(super) fn identity(&self) -> String {
        format!(
            "{}/{}/{}",
            self.system,
            self.timeline,
            self.started_wall.unwrap_or(0)
        )
    }

    /// A client connects (node `n`, instance `inst`) at `now`, its session ready after
    /// `handshake`: the new backend and what its first queries find, or `None` while
    /// the server is down.
    pub(super) fn connect(
        &mut self,
        n: usize,
        inst: u32,
        now: T,
        handshake: T,
    ) -> Option<Connected> {
        if !self.up {
            return None;
        }
        let pid = self.next_pid;
        self.next_pid += 1;
        self.high_water = self.high_water.max(self.high());
        let ready = now + handshake;
        self.backends.insert(
            pid,
            Backend {
                n,
                inst,
                last: ready,
                start: now,
                high: self.high(),
                unepoched: self.epoch_missing,
                age_step: (ready >= self.age_unknown_until)
                    .then_some(self.clock - self.clock_at_start),
                system: self.system,
            },
        );
        // Measured with the server's wall clock, as the term query does.
        let term_age = match self.started_wall {
            None => Some(ready + 3_600 * SEC),
            Some(_) if ready < self.age_unknown_until => None,
            Some(wall) => Some((ready as i64 + self.clock - wall).max(0) as T),
        };
        Some(Connected {
            pid,
            ready,
            term_age,
            high: self.high(),
            identity: self.identity(),
            system: self.system,
            first_xid: self.xid + 1,
            unepoched: self.epoch_missing,
        })
    }

    /// A statement of backend `pid` ran at `now`: the server's idle timer of the
    /// backend starts again. `false`: no such backend.
    pub(super) fn touch(&mut self, pid: i32, now: T) -> bool {
        match self.backends.get_mut(&pid) {
            Some(b) => {
                b.last = now;
                true
            }
            None => false,
        }
    }

    /// The server ends backend `pid` at `now` (`by_server`: not at its client's
    /// request), releasing its locks: the backend it was, if it was live.
    pub(super) fn end_backend(&mut self, pid: i32, now: T, by_server: bool) -> Option<Backend> {
        let b = self.backends.remove(&pid)?;
        if by_server {
            self.ended_by_server.insert(pid, now);
        }
        self.release_locks_of(pid, now);
        Some(b)
    }

    /// NOTIFY at commit by backend `sender` (a sender of no backend here is a foreign
    /// one, started at `now` as far as the checks care): one notice per listening
    /// backend, stamped with the sender's pid.
    pub(super) fn announce(
        &mut self,
        sender: i32,
        keys: &[LockKey],
        hand: &[(LockKey, u64)],
        now: T,
    ) -> Vec<Notice> {
        let sender_start = self.start_of(sender).unwrap_or(now);
        if self.backends.contains_key(&sender) {
            self.last_payload
                .insert(sender, (keys.to_vec(), hand.to_vec()));
        }
        self.backends
            .iter()
            .map(|(to, b)| Notice {
                n: b.n,
                inst: b.inst,
                to: *to,
                sender,
                sender_start,
                sent_at: now,
                keys: keys.to_vec(),
                hand: hand.to_vec(),
            })
            .collect()
    }

    /// The statements of one plan, in the order the driver pipelines them, run by
    /// backend `pid` of node `n` at `now`; `failing` names the statement that fails
    /// with the session intact (`""`: none).
    pub(super) fn execute(
        &mut self,
        n: usize,
        pid: i32,
        stmts: &Plan,
        now: T,
        failing: &'static str,
    ) -> Executed {
        let mut out = Executed::default();
        let high = self.backends.get(&pid).map_or(1, |b| b.high);
        let mut reply = Reply {
            at: now,
            token: None,
            tried: Vec::new(),
            registered: Vec::new(),
            senders: Vec::new(),
            fenced: Vec::new(),
            checked: Vec::new(),
            try_failed: None,
            locks_gone: false,
        };
        // Interest keys no longer needed (released without a word).
        for b in &stmts.unregister {
            if let Some(pids) = self.interest.get_mut(b) {
                pids.remove(&pid);
            }
        }
        // UNLOCK_SQL: unlock all, announce the first list.
        for k in stmts.unlock.iter().chain(&stmts.unlock_quiet) {
            if self.excl.get(k) == Some(&pid) {
                self.excl.remove(k);
            } else if !self.was_discarded(pid) {
                out.violations.push(format!(
                    "n{n} unlocks {k}, which backend {pid} does not hold"
                ));
            }
        }
        // Announced only where another backend registered interest.
        let interested: Vec<LockKey> = stmts
            .unlock
            .iter()
            .copied()
            .filter(|k| {
                self.interest
                    .get(&k.interest_bucket())
                    .is_some_and(|pids| pids.iter().any(|p| *p != pid))
            })
            .collect();
        if !interested.is_empty() {
            let hand = stmts.hand_to.clone();
            out.notices
                .push(self.announce(pid, &interested, &hand, now));
        }
        // TOKEN_SQL (a failed one: the keys are released instead).
        if !stmts.token_for.is_empty() && failing == "token_failed" {
            out.faults.push("token_failed");
        } else if !stmts.token_for.is_empty() {
            // TOKEN_SQL issues one only while the session still holds every key.
            let all_held = stmts
                .token_for
                .iter()
                .all(|k| self.excl.get(k) == Some(&pid));
            if all_held {
                self.xid += 1;
                reply.token = Some(FencingToken::from_parts(high, self.xid));
            } else {
                reply.locks_gone = true;
            }
        }
        // TRY_KEYS_SQL: every lock first, then one token for the keys won. A failed one
        // takes nothing here (the cleanup statement unlocks what a failed one took).
        if !stmts.try_keys.is_empty() && matches!(failing, "try_failed" | "lock_table_full") {
            out.faults.push(failing);
            reply.try_failed = Some(if failing == "try_failed" {
                TryFailed::Failed
            } else {
                TryFailed::LockTableFull
            });
        } else if !stmts.try_keys.is_empty() {
            out.tried = true;
            let mut won = Vec::new();
            for k in &stmts.try_keys {
                match self.excl.get(k) {
                    Some(&holder) => {
                        if holder == pid {
                            out.violations
                                .push(format!("n{n} tries {k}, which it holds"));
                        }
                        // Not won: register interest (the second try fails too: the
                        // statement runs at one instant here).
                        if stmts.register.contains(k) {
                            let pids = self.interest.entry(k.interest_bucket()).or_default();
                            if !pids.insert(pid) {
                                out.violations
                                    .push(format!("n{n} registers interest in a bucket it holds"));
                            }
                            reply.registered.push(*k);
                        }
                        let start = self.start_of(holder).map(epoch_us);
                        reply.tried.push((
                            *k,
                            TryOutcome::Held {
                                by: Some(Seen { pid: holder, start }),
                            },
                        ));
                    }
                    None => {
                        self.excl.insert(*k, pid);
                        won.push(*k);
                    }
                }
            }
            if !won.is_empty() {
                self.xid += 1;
                let token = FencingToken::from_parts(high, self.xid);
                for k in won {
                    // The statement also probes the won key's stop fence (exclusively:
                    // it fails against any other holder of the shared fence).
                    let fence = self.fence_key(k);
                    let outcome = match self.fence_holder(fence, pid) {
                        Some(holder) => TryOutcome::WonFenced {
                            token,
                            by: Some(holder),
                        },
                        None => TryOutcome::Won(token),
                    };
                    reply.tried.push((k, outcome));
                    // The start of the backend that has the announcer's pid, now.
                    if let Some((_, ap)) = stmts.verify.iter().find(|(v, _)| *v == k) {
                        reply.senders.push((k, self.start_of(*ap).map(epoch_us)));
                    }
                }
            }
        }
        // Stop fences: taken with the try statement (a won fence burns an id).
        let mut burned = false;
        for k in &stmts.fence {
            let f = self.fence_key(*k);
            // `FENCE_SQL`: shared, so several stopping holders can each hold it.
            let taken = self.fences_shared.entry(f).or_default().insert(pid);
            if taken {
                self.fences.push(FenceHold {
                    key: *k,
                    pid,
                    from: now,
                    to: None,
                });
                burned = true;
            }
            reply.fenced.push((*k, taken));
        }
        if burned {
            self.xid += 1;
        }
        // Unfence: unlock the fences, announce the keys.
        for k in &stmts.unfence {
            let f = self.fence_key(*k);
            if self
                .fences_shared
                .get_mut(&f)
                .is_some_and(|pids| pids.remove(&pid))
            {
                for h in &mut self.fences {
                    if h.pid == pid && h.key == *k && h.to.is_none() {
                        h.to = Some(now);
                    }
                }
            } else if !self.was_discarded(pid) {
                out.violations.push(format!(
                    "n{n} unfences {k}, whose fence {pid} does not hold"
                ));
            }
        }
        if !stmts.unfence.is_empty() {
            out.notices
                .push(self.announce(pid, &stmts.unfence, &[], now));
        }
        // CHECK_FENCES_SQL: a shared try and unlock; the exclusive holder when taken.
        if !stmts.check.is_empty() && failing == "check_failed" {
            out.faults.push("check_failed");
        }
        for k in &stmts.check {
            let f = self.fence_key(*k);
            let outcome = match self.fence_holder(f, pid) {
                _ if failing == "check_failed" => FenceCheck::Failed,
                Some(holder) => FenceCheck::Held { by: Some(holder) },
                None => FenceCheck::Clear,
            };
            reply.checked.push((*k, outcome));
        }
        out.reply = reply;
        out
    }

    /// A backend other than `me` holding stop fence `f` (what an exclusive probe of
    /// it fails against), if any.
    pub(super) fn fence_holder(&self, f: LockKey, me: i32) -> Option<i32> {
        self.fences_shared
            .get(&f)?
            .iter()
            .copied()
            .find(|p| *p != me)
    }

    pub(super) fn fence_key(&self, k: LockKey) -> LockKey {
        self.fence_of
            .get(&k)
            .copied()
            .unwrap_or_else(|| k.stop_fence())
    }

    /// The start of the live backend with `pid`, if any.
    pub(super) fn start_of(&self, pid: i32) -> Option<T> {
        self.backends
            .get(&pid)
            .map(|b| b.start)
            .or_else(|| self.foreign.get(&pid).copied())
    }

    /// Every advisory lock of a backend is released (its keys, its stop fences, its
    /// interest keys): the backend ended, or another client released them.
    pub(super) fn release_locks_of(&mut self, pid: i32, now: T) {
        self.excl.retain(|_, p| *p != pid);
        self.foreign_locks.remove(&pid);
        for pids in self
            .interest
            .values_mut()
            .chain(self.fences_shared.values_mut())
        {
            pids.remove(&pid);
        }
        for h in &mut self.fences {
            if h.pid == pid && h.to.is_none() {
                h.to = Some(now);
            }
        }
    }

    /// The advisory locks a backend holds (what the heartbeat reads): its keys, its
    /// stop fences, its interest keys.
    pub(super) fn locks_of(&self, pid: i32) -> Vec<SessionLock> {
        let keys = self
            .excl
            .iter()
            .filter(|(_, p)| **p == pid)
            .map(|(key, _)| SessionLock {
                key: *key,
                exclusive: true,
            });
        let fences = self
            .fences_shared
            .iter()
            .filter(|(_, pids)| pids.contains(&pid))
            .map(|(key, _)| SessionLock {
                key: *key,
                exclusive: false,
            });
        let interest = self
            .interest
            .iter()
            .filter(|(_, pids)| pids.contains(&pid))
            .map(|(bucket, _)| SessionLock {
                key: LockKey::interest_of(*bucket),
                exclusive: false,
            });
        let foreign =
            (0..self.foreign_locks.get(&pid).copied().unwrap_or(0)).map(|i| SessionLock {
                key: LockKey::Int(-1 - i64::from(i)),
                exclusive: true,
            });
        keys.chain(fences).chain(interest).chain(foreign).collect()
    }

    /// Did another client ever release this backend's locks?
    pub(super) fn was_discarded(&self, pid: i32) -> bool {
        self.discarded.iter().any(|(p, _)| *p == pid)
    }
}

/// How the server comes back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Coming {
    /// The same cluster, restarted (a stop and start, or a crash restart).
    Restart,
    /// A standby promoted: the next timeline; it had replayed up to `lag` transactions
    /// fewer than the old primary had committed.
    Promotion { lag: u64 },
    /// Another cluster (pg_upgrade, a restore into a new `initdb`, a logical cutover):
    /// timeline 1, another system identifier, transaction ids from `xid`; the DBA set
    /// the token epoch before it took connections, or forgot and sets it later.
    Replaced { xid: u64, epoch_set: bool },
}

/// An announcement: its keys, and the targets of those handed over.
pub(super) type Payload = (Vec<LockKey>, Vec<(LockKey, u64)>);
