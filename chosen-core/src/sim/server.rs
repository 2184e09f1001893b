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
use crate::rows_step::{Answer, Steps, Tried, Win};
use crate::table::{Backend as Seen, FenceCheck, Plan, TryOutcome};
use crate::token::FencingToken;

/// What the first queries of a new session find.
#[derive(Clone, Debug)]
pub(crate) struct Connected {
    pub(crate) pid: i32,
    /// When the session is ready (proven).
    pub(crate) ready: T,
    /// The term's age as the term query finds it (`None`: unknown).
    pub(crate) term_age: Option<T>,
    pub(crate) high: u16,
    pub(crate) identity: String,
    pub(crate) system: u32,
    pub(crate) first_xid: u64,
    /// Opened before the DBA set a replaced cluster's epoch.
    pub(crate) unepoched: bool,
}

/// One announcement to one listening backend (of node `n`, instance `inst`).
#[derive(Clone, Debug)]
pub(crate) struct Notice {
    pub(crate) n: usize,
    pub(crate) inst: u32,
    pub(crate) to: i32,
    pub(crate) sender: i32,
    pub(crate) sender_start: T,
    pub(crate) sent_at: T,
    pub(crate) keys: Vec<LockKey>,
    pub(crate) hand: Vec<(LockKey, u64)>,
}

/// What a plan's statements did.
#[derive(Debug, Default)]
pub(crate) struct Executed {
    /// The answer.
    pub(crate) reply: Reply,
    /// Rules of the protocol the plan broke, in the order found.
    pub(crate) violations: Vec<String>,
    /// Statement failures that happened, by kind.
    pub(crate) faults: Vec<&'static str>,
    /// The plan ran a try statement.
    pub(crate) tried: bool,
    /// The announcements its statements sent, in order, each to every listener.
    pub(crate) notices: Vec<Vec<Notice>>,
}

#[derive(Clone, Debug, Default)]
pub(crate) struct Reply {
    /// When the server ran the statements.
    pub(crate) at: T,
    pub(crate) token: Option<FencingToken>,
    pub(crate) tried: Vec<(LockKey, TryOutcome)>,
    /// Keys whose interest bucket the try statement registered.
    pub(crate) registered: Vec<LockKey>,
    /// Keys of `verify` won, with the start of the backend that has the pid now.
    pub(crate) senders: Vec<(LockKey, Option<i64>)>,
    pub(crate) fenced: Vec<(LockKey, bool)>,
    pub(crate) checked: Vec<(LockKey, FenceCheck)>,
    /// The try statement failed with the session intact (cancelled, timed out,
    /// refused, the lock table full): no key of it was taken.
    pub(crate) try_failed: Option<TryFailed>,
    /// The token statement found keys of the hand-off no longer held by the session
    /// (another client released them): the session ends, as a pooler's.
    pub(crate) locks_gone: bool,
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct Backend {
    pub(crate) n: usize,
    pub(crate) inst: u32,
    pub(crate) last: T,
    /// `backend_start`.
    pub(crate) start: T,
    /// The high bits of its tokens, as its client read them at connect (the token
    /// epoch is a database setting: a session keeps the value it started with).
    pub(crate) high: u16,
    /// Opened on a replaced cluster before the DBA set its token epoch.
    pub(crate) unepoched: bool,
    /// How far the server's clock had stepped since its term began when this
    /// session read the term's age (`None`: the age was unknown).
    pub(crate) age_step: Option<i64>,
    /// The cluster (system identifier) it is on.
    pub(crate) system: u32,
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct FenceHold {
    pub(crate) key: LockKey,
    pub(crate) pid: i32,
    pub(crate) from: T,
    pub(crate) to: Option<T>,
}

#[derive(Debug)]
pub(crate) struct Server {
    pub(crate) up: bool,
    /// When the server's current term as primary began (it came up), `None` when long
    /// before the run (an hour).
    pub(crate) started: Option<T>,
    pub(crate) backends: BTreeMap<i32, Backend>,
    /// Exclusive advisory locks (the keys).
    pub(crate) excl: BTreeMap<LockKey, i32>,
    /// Stop fences, as `FENCE_SQL` takes them: shared, by any number of backends; the
    /// probes (in the try and the check) are exclusive, and fail against any of them.
    pub(crate) fences_shared: BTreeMap<LockKey, BTreeSet<i32>>,
    /// Interest buckets: the backends holding each bucket's interest key (shared).
    pub(crate) interest: BTreeMap<u16, BTreeSet<i32>>,
    /// Advisory locks another client took on a node's backend (a pooler's other
    /// client), in a key space no node uses: how many, per backend.
    pub(crate) foreign_locks: BTreeMap<i32, u8>,
    pub(crate) next_pid: i32,
    pub(crate) xid: u64,
    /// Backends of no node (a forger on a reused pid): their starts.
    pub(crate) foreign: BTreeMap<i32, T>,
    /// The last announcement each backend sent (what a forger replays).
    pub(crate) last_payload: BTreeMap<i32, Payload>,
    /// The timeline it writes (a promoted standby's is one higher; a replaced cluster
    /// starts at 1 again).
    pub(crate) timeline: u16,
    /// Its `chosen.token_epoch` (a DBA sets it on a replaced cluster).
    pub(crate) epoch: u16,
    /// Its system identifier (a replaced cluster has another).
    pub(crate) system: u32,
    /// Its wall clock minus virtual time, in microseconds (a clock step changes it).
    pub(crate) clock: i64,
    /// The wall-clock time it recorded for its term's start (what the term query's age
    /// is measured from, with the wall clock of the moment).
    pub(crate) started_wall: Option<i64>,
    /// Until then the term's start is unknown (a promoted server whose end-of-recovery
    /// checkpoint is not done: the term query answers no age).
    pub(crate) age_unknown_until: T,
    /// When the previous term stopped answering (a restart, a crash, a promotion):
    /// every holder of it trusted its lease at most `lease` longer, and then had
    /// `stop_budget` to stop.
    pub(crate) ended: Option<T>,
    /// What the next `ServerUp` brings.
    pub(crate) coming: Coming,
    /// Its clock offset when its term began.
    pub(crate) clock_at_start: i64,
    /// The highest high bits any of its sessions had (what a DBA takes the token
    /// epoch of a replacement from).
    pub(crate) high_water: u16,
    /// The DBA forgot to set the token epoch on a replaced cluster, and sets it (to
    /// `epoch_due`) later.
    pub(crate) epoch_missing: bool,
    pub(crate) epoch_due: u16,
    /// The stop fence of each key.
    pub(crate) fence_of: BTreeMap<LockKey, LockKey>,
    /// Every stop fence held, by whom and when (for the checks).
    pub(crate) fences: Vec<FenceHold>,
    /// Backends whose advisory locks another client released, and when.
    pub(crate) discarded: Vec<(i32, T)>,
    /// Backends the server ended (not their clients), and when.
    pub(crate) ended_by_server: BTreeMap<i32, T>,
    /// The lease-row mode's tables: the lease of each key, and the stop fences (by
    /// fence key and holder), with their expiry by the server's wall clock.
    pub(crate) rows: BTreeMap<LockKey, Row>,
    pub(crate) fence_rows: BTreeMap<(LockKey, i32), i64>,
}

/// A row of `chosen_lease`: its holder (a session id, not a backend), when that session
/// began, and when the row expires by the server's wall clock (microseconds, as
/// [`Server::wall`] counts them).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Row {
    pub(crate) holder: i32,
    pub(crate) start: i64,
    pub(crate) expires: i64,
    /// When it was taken (virtual time).
    pub(crate) taken: T,
    /// Kept by a release for a hand-over's target (by node hash): held by no session
    /// (holder 0), only that node may take it before it expires.
    pub(crate) hand_to: Option<u64>,
    /// A promotion lost some of its renewals: it expires earlier than its holder's
    /// client may think, by `lost` at most (microseconds).
    pub(crate) shortened: bool,
    pub(crate) lost: T,
}

impl Server {
    /// A server up since long before the run (an hour), on timeline 1 of cluster 1;
    /// the stop fence of each key as `fence_of` says, or its own otherwise.
    pub(crate) fn new(fence_of: BTreeMap<LockKey, LockKey>) -> Self {
        Self {
            up: true,
            started: None,
            backends: BTreeMap::new(),
            excl: BTreeMap::new(),
            foreign_locks: BTreeMap::new(),
            fences_shared: BTreeMap::new(),
            interest: BTreeMap::new(),
            next_pid: 1000,
            xid: 700,
            foreign: BTreeMap::new(),
            last_payload: BTreeMap::new(),
            timeline: 1,
            epoch: 0,
            system: 1,
            clock: 0,
            started_wall: None,
            age_unknown_until: 0,
            ended: None,
            coming: Coming::Restart,
            clock_at_start: 0,
            high_water: 1,
            epoch_missing: false,
            epoch_due: 0,
            fence_of,
            fences: Vec::new(),
            discarded: Vec::new(),
            ended_by_server: BTreeMap::new(),
            rows: BTreeMap::new(),
            fence_rows: BTreeMap::new(),
        }
    }

    /// The high bits of its tokens: the timeline plus the token epoch.
    pub(crate) fn high(&self) -> u16 {
        self.timeline + self.epoch
    }

    /// What tells its term from another when the age is unknown (the term query's
    /// `identity`: the timeline and the postmaster's start).
    pub(crate) fn identity(&self) -> String {
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
    pub(crate) fn connect(
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
    pub(crate) fn touch(&mut self, pid: i32, now: T) -> bool {
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
    pub(crate) fn end_backend(&mut self, pid: i32, now: T, by_server: bool) -> Option<Backend> {
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
    pub(crate) fn announce(
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
    pub(crate) fn execute(
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
        // TOKEN_SQL, for the hand-offs and the holders' reads (a failed one: the
        // hand-offs are released instead, the reads fail).
        let token_keys: Vec<LockKey> = stmts
            .token_for
            .iter()
            .chain(&stmts.token_read)
            .copied()
            .collect();
        if !token_keys.is_empty() && failing == "token_failed" {
            out.faults.push("token_failed");
        } else if !token_keys.is_empty() {
            // TOKEN_SQL issues one only while the session still holds every key.
            let all_held = token_keys.iter().all(|k| self.excl.get(k) == Some(&pid));
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
                // One id for the keys won that take their token with the win (none
                // when every key won is lazy: no id, no write).
                let token = won.iter().any(|k| !stmts.lazy.contains(k)).then(|| {
                    self.xid += 1;
                    FencingToken::from_parts(high, self.xid)
                });
                for k in won {
                    let token = if stmts.lazy.contains(&k) { None } else { token };
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
    pub(crate) fn fence_holder(&self, f: LockKey, me: i32) -> Option<i32> {
        self.fences_shared
            .get(&f)?
            .iter()
            .copied()
            .find(|p| *p != me)
    }

    pub(crate) fn fence_key(&self, k: LockKey) -> LockKey {
        self.fence_of
            .get(&k)
            .copied()
            .unwrap_or_else(|| k.stop_fence())
    }

    /// The start of the live backend with `pid`, if any.
    pub(crate) fn start_of(&self, pid: i32) -> Option<T> {
        self.backends
            .get(&pid)
            .map(|b| b.start)
            .or_else(|| self.foreign.get(&pid).copied())
    }

    /// Every advisory lock of a backend is released (its keys, its stop fences, its
    /// interest keys): the backend ended, or another client released them.
    pub(crate) fn release_locks_of(&mut self, pid: i32, now: T) {
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
    pub(crate) fn locks_of(&self, pid: i32) -> Vec<SessionLock> {
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
    pub(crate) fn was_discarded(&self, pid: i32) -> bool {
        self.discarded.iter().any(|(p, _)| *p == pid)
    }
}

/// The lease-row mode: the statements of `rows::sql` on the model of its tables.
impl Server {
    /// The server's wall clock at virtual time `now` (what `now()` answers).
    pub(crate) fn wall(&self, now: T) -> i64 {
        now as i64 + self.clock
    }

    /// The live row of `key` at `now` that a session holds (not one kept for a
    /// hand-over's target), if any.
    pub(crate) fn live_row(&self, key: LockKey, now: T) -> Option<Row> {
        let wall = self.wall(now);
        self.rows
            .get(&key)
            .copied()
            .filter(|r| r.expires > wall && !(r.holder == 0 && r.hand_to.is_some()))
    }

    /// A token from the counter: above every one drawn before, and above every
    /// transaction id (`greatest(v + 1, xmax)`; one number space here).
    fn draw(&mut self) -> u64 {
        self.xid += 1;
        self.xid
    }

    /// One batch of session `holder` (which began at `start`) at `now`, its rows living
    /// `ttl` past it: the statements in the batch's order, all at one instant (the
    /// model has no row locks, so no statement skips a row another one holds). The
    /// rows taken over, with their holders, are in `taken_over`.
    pub(crate) fn execute_rows(
        &mut self,
        (holder, start, node_hash): (i32, i64, u64),
        steps: &Steps,
        now: T,
        ttl: T,
        taken_over: &mut Vec<(LockKey, Row)>,
    ) -> Answer {
        let wall = self.wall(now);
        let expires = wall + ttl as i64;
        let mut answer = Answer::default();
        // The try, in key order: a key with no live row is taken (an expired one
        // overwritten), with token 0 until the tokens of the wins are drawn.
        let mut order: Vec<(usize, LockKey)> = steps.tries.iter().copied().enumerate().collect();
        order.sort_by_key(|(_, k)| *k);
        let mut won = Vec::new();
        for (at, key) in order {
            let before = self.rows.get(&key).copied();
            // Kept for this node: a row held by no session (holder 0) naming it.
            let kept_for_me = |r: &Row| r.holder == 0 && r.hand_to == Some(node_hash);
            match before.filter(|r| r.expires > wall && !kept_for_me(r)) {
                Some(live) => answer.tried.push(Tried {
                    at,
                    won: false,
                    existed: true,
                    holder: Some(live.holder),
                    start: Some(live.start),
                }),
                None => {
                    if let Some(old) = before {
                        taken_over.push((key, old));
                    }
                    self.rows.insert(
                        key,
                        Row {
                            holder,
                            start,
                            expires,
                            taken: now,
                            hand_to: None,
                            shortened: false,
                            lost: 0,
                        },
                    );
                    won.push(key);
                    answer.tried.push(Tried {
                        at,
                        won: true,
                        existed: before.is_some(),
                        holder: None,
                        start: None,
                    });
                }
            }
        }
        answer.tried.sort_by_key(|t| t.at);
        // The releases: the session's rows of the keys, live or not; a key handed over
        // is kept for its target for the hand-over's hold.
        for key in &steps.unlock {
            if self.rows.get(key).is_some_and(|r| r.holder == holder) {
                match steps.hand.iter().find(|(k, _)| k == key) {
                    Some((_, to)) => {
                        let hold = crate::table::HAND_OVER_HOLD.as_micros() as i64;
                        self.rows.insert(
                            *key,
                            Row {
                                holder: 0,
                                start: 0,
                                expires: wall + hold,
                                taken: now,
                                hand_to: Some(*to),
                                shortened: false,
                                lost: 0,
                            },
                        );
                    }
                    None => {
                        self.rows.remove(key);
                    }
                }
                answer.unlocked += 1;
            }
        }
        for key in &steps.unfence {
            if self
                .fence_rows
                .remove(&(key.stop_fence(), holder))
                .is_some()
            {
                answer.unfenced += 1;
            }
        }
        // One token for the keys the session still holds live.
        let held = steps
            .token
            .iter()
            .filter(|k| self.live_row(**k, now).is_some_and(|r| r.holder == holder))
            .count();
        if held > 0 {
            let token = self.draw();
            answer.tokens = vec![token as i64; held];
        }
        // One token for the keys won, drawn after all of them were taken, and who else
        // holds a live fence of each.
        if !won.is_empty() {
            let token = self.draw() as i64;
            for key in won {
                let fenced_by = self.other_fence(key, holder, wall);
                answer.wins.push(Win {
                    key,
                    token: Some(token),
                    fenced_by,
                });
            }
        }
        for key in &steps.fence {
            self.fence_rows.insert((key.stop_fence(), holder), expires);
            answer.fenced.push(key.stop_fence());
        }
        for (at, key) in steps.check.iter().enumerate() {
            answer
                .checked
                .push((at, self.other_fence(*key, holder, wall)));
        }
        answer
    }

    /// Another session's live stop fence of `key`, if any.
    fn other_fence(&self, key: LockKey, holder: i32, wall: i64) -> Option<i32> {
        let fence = key.stop_fence();
        self.fence_rows
            .range((fence, i32::MIN)..=(fence, i32::MAX))
            .find(|((_, h), expires)| *h != holder && **expires > wall)
            .map(|((_, h), _)| *h)
    }

    /// The heartbeat: every live row of `holder`, leases and fences, renewed to `ttl`
    /// past `now`; the answer lacks a row that expired (someone may be taking it).
    pub(crate) fn renew_rows(&mut self, holder: i32, now: T, ttl: T) -> Vec<SessionLock> {
        let wall = self.wall(now);
        let expires = wall + ttl as i64;
        let mut locks = Vec::new();
        for (key, row) in &mut self.rows {
            if row.holder == holder && row.expires > wall {
                row.expires = expires;
                locks.push(SessionLock {
                    key: *key,
                    exclusive: true,
                });
            }
        }
        for ((fence, h), until) in &mut self.fence_rows {
            if *h == holder && *until > wall {
                *until = expires;
                locks.push(SessionLock {
                    key: *fence,
                    exclusive: false,
                });
            }
        }
        locks
    }

    /// Deletes every row of `holder`.
    pub(crate) fn release_rows(&mut self, holder: i32) {
        self.rows.retain(|_, r| r.holder != holder);
        self.fence_rows.retain(|(_, h), _| *h != holder);
    }

    /// A standby promoted with the last `lost` of the old primary's history not
    /// replayed: rows taken since are gone (what was there before is not known: none),
    /// and every other row's last renewals are lost, its expiry that much earlier.
    pub(crate) fn lose_recent_rows(&mut self, now: T, lost: T) {
        let since = now.saturating_sub(lost);
        self.rows.retain(|_, r| r.taken < since);
        for row in self.rows.values_mut() {
            row.expires -= lost as i64;
            row.shortened |= lost > 0;
            row.lost += lost;
        }
        for until in self.fence_rows.values_mut() {
            *until -= lost as i64;
        }
    }
}

/// How the server comes back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Coming {
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
pub(crate) type Payload = (Vec<LockKey>, Vec<(LockKey, u64)>);
