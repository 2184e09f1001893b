//! A simulated fleet: several nodes, each a real [`LockManager`] with real
//! [`Singleton`]s, an [`Election`] and a [`SingletonGroup`], on one [`SimServer`], on tokio's paused clock, with faults drawn from
//! a seed. A checker watches the children and fails the seed on:
//!
//! * two children of one name *acting* at once (each child's lease is read at every
//!   child's start and at each of its ticks, on the one clock every node shares here);
//! * a node's shutdown returning while one of its children still runs, or not
//!   returning within its bound (a hang);
//! * a name with no acting child, or an election without exactly one leader, once the
//!   faults are over and the fleet settled;
//! * two leaders of an election at once (sampled every 10 ms);
//! * flapping: a leader change or a child start after the fleet settled, with no fault
//!   or request since;
//! * a finished one-shot (`Never`) child started again while the session that finished
//!   it lives, or ever on its node until a step-down, hand-over or restart there;
//! * a preferred node up and not holding its name once settled;
//! * a group member without exactly one acting child, or a node running more than
//!   `ceil(M / N)` of its `M` members with `N` nodes up, once settled and after a node
//!   leaves and joins again in a calm fleet; a member moved by that leave (join) that
//!   was not on the node that left (does not go to the node that joined), or more than
//!   `ceil(M / N)` moved by the join;
//! * a hand-over in a calm fleet (once settled, each name handed over twice) that has
//!   not reached its target within 1.5 s, or one asked during the faults, of a name
//!   its target waited for in a fleet calm for 5 s, that another node took first.
//!
//! Two acting at once is a known gap, counted and not failed, when the earlier one's own
//! session was terminated (`pg_terminate_backend`) within its lease timeout, its client
//! has not heard yet (or heard within the last sample), and the later one has the
//! greater token: the server frees a terminated session's locks at
//! once, and its client hears of it only a latency later (longer if the news meets a
//! black hole); a node granted meanwhile is fenced by its greater token (the engine
//! simulation's gaps (b) and (c)). A silent session the server gives up on is no
//! excuse: the timing invariant keeps its holder from acting by then. Children of one name *running* at once (one
//! stopping while the next starts) are counted, not failed (gap (c)).
//!
//! Faults: a node's backends terminated (not drawn while it is cut off: a termination
//! its holder cannot hear is a double fault only the fencing token covers; one drawn
//! just before a cut is excused the same way), its traffic
//! black-holed for up to 12 s (the server ends a session idle for 7 s), a node shut
//! down and started again, a node's process killed (its connections close, its
//! children are gone, nothing is released or announced) and started again, a singleton or the election stepped down or handed over by
//! the node that leads it; several at once (a black hole heals in the background); now
//! and then a statement that fails with its session intact, and the server restarted
//! or failed over to a standby (a new timeline). Tokens of one name never go
//! back, nor repeat on another node. The fleet's shape is drawn too: 3 or 4 nodes, `s1`
//! preferred on `n0` and a one-shot child in half the runs, in half the runs a node on
//! which `s0`'s child fails as it starts (it must give up and leave `s0` to another),
//! and none, one or two preferred nodes for the election.
//!
//! `CHOSEN_FLEET_SEEDS` (default 100) and `CHOSEN_FLEET_FIRST` choose the seeds;
//! `CHOSEN_FLEET_SEED=n` runs seed `n` alone and prints what happened.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use super::Rng;
use super::backend::{SimBackend, SimServer};
use crate::singleton::{LeaderContext, RestartPolicy, Singleton, SingletonOptions};
use crate::{Election, GroupOptions, Leadership, LockManager, ManagerOptions, SingletonGroup};

/// Singleton names every node runs.
const NAMES: [&str; 2] = ["s0", "s1"];
/// The election every node runs.
const ELECTION: &str = "e0";
/// The singleton group every node runs, and its members.
const GROUP: &str = "g";
const MEMBERS: [&str; 7] = ["m0", "m1", "m2", "m3", "m4", "m5", "m6"];
/// The group's flapping window: nodes that leave twice within it freeze the placement
/// until none did for that long (shorter than the default 60 s, so that the placement
/// thaws well before the fleet must be quiet).
const GROUP_FLAP_WINDOW: Duration = Duration::from_secs(8);
/// How long a group has to place its members after a node leaves or joins in a calm
/// fleet: the others see it within an interval (1 s), a joining node's view is acted
/// on when seen twice, a member moved stops its child (up to its 1 s shutdown timeout)
/// and is taken within a round trip.
const GROUP_SETTLE: Duration = Duration::from_secs(10);
/// Once the faults are over, the fleet has this long to settle; after it, no leader
/// changes and no child starts (nothing happens that would call for one). A fail-back
/// to a preferred node healed last takes up to ~10 s: its session found ended and a
/// new one, seen for `FAIL_BACK_AFTER` (3 s), on the next 2 s look, then the child's
/// stop (up to its 1 s shutdown timeout).
const QUIET_AFTER: Duration = Duration::from_secs(15);
/// The managers' lease timeout (the default).
const LEASE_TIMEOUT: Duration = Duration::from_secs(3);
/// Fault steps of a run.
const STEPS: u32 = 30;
/// How long the fleet is left alone after the faults before liveness is checked.
const SETTLE: Duration = Duration::from_secs(30);
/// A shutdown returns within this (stop budget, lease timeout and slack: 2 + 3 + 5 s).
const SHUTDOWN_BOUND: Duration = Duration::from_secs(10);

/// What the children did, as the checker saw it.
#[derive(Default)]
struct History {
    next_id: u64,
    /// Children started and not yet returned: name → (id, node, context).
    running: BTreeMap<&'static str, Vec<(u64, String, LeaderContext)>>,
    violations: Vec<String>,
    starts: u64,
    /// Child starts while another node's child of the name was still running (not
    /// acting).
    running_overlaps: u64,
    log: Vec<String>,
    /// The server, to tell the known gap from a violation.
    server: Option<Arc<SimServer>>,
    /// Acting overlaps in the known gap, by name and the pair of children (or nodes).
    known_gap: std::collections::BTreeSet<(String, String, String)>,
    /// The last child's token and node, per name: a later tenure's token is greater.
    last_token: BTreeMap<&'static str, (u64, String)>,
    /// Each running node's view of the election.
    leaderships: BTreeMap<String, Leadership>,
    /// The election's leaders as last sampled, and how often they changed.
    leaders: Vec<String>,
    leader_changes: u64,
    /// From then on nothing may change (the faults are over and the fleet settled).
    quiet_from: Option<Instant>,
    /// The lock key of each singleton name.
    keys: BTreeMap<&'static str, crate::LockKey>,
    /// One-shot children that finished by themselves, per name and node: the backend
    /// that held the lock then, and when the child started. Until a step-down,
    /// hand-over or shutdown is asked of that node (it forgets the finish), no other
    /// node starts a child of the name while that backend lives, and that node does
    /// not start one again at all.
    finished: BTreeMap<&'static str, BTreeMap<String, (Option<i32>, Instant)>>,
    /// Step-downs, hand-overs and shutdowns asked: name, node, when.
    requests: Vec<(&'static str, String, Instant)>,
    /// Each running node's view of each singleton.
    singleton_leaderships: BTreeMap<(&'static str, String), Leadership>,
    /// Who leads each name (singletons and the election), as last sampled.
    holders: BTreeMap<&'static str, Vec<String>>,
    /// When the fleet was last disturbed: a fault, a heal, a request, a restart.
    disturbed_at: Option<Instant>,
    /// Hand-overs asked in a calm fleet, to a node that waits for the name: from, to,
    /// when. The name's next leader must be that node, unless something happens first.
    hand_overs: BTreeMap<&'static str, (String, String, Instant)>,
    /// Children that died with their node's process (their tasks linger, inert).
    dead: std::collections::BTreeSet<u64>,
    /// When the run began (log lines are stamped from it).
    t0: Option<Instant>,
    /// Children started while another node's child of the name still ran (stopping):
    /// the one still running → when the next started.
    overlapped: BTreeMap<u64, Instant>,
}

/// How long a child may still run (stopping) once another node's child of its name
/// started: its shutdown timeout (1 s), and slack for the news of its loss.
const RUNNING_OVERLAP_BOUND: Duration = Duration::from_millis(1_250);

/// A hand-over is checked only in a fleet left alone this long before it (no node in
/// a rejoin pause, a reconnect or a cooldown).
const CALM_BEFORE_HAND_OVER: Duration = Duration::from_secs(5);

impl History {
    fn note(&mut self, line: impl std::fmt::Display) {
        // As an offset from the run's start, so that a replay's log compares equal.
        let at = Instant::now().duration_since(*self.t0.get_or_insert_with(Instant::now));
        self.log.push(format!("{at:?} {line}"));
    }

    /// Something happened that may change who leads what.
    fn disturb(&mut self) {
        // (Kept if later: a server restart disturbs until its new term's hold is over.)
        self.disturbed_at = self.disturbed_at.max(Some(Instant::now()));
    }

    /// The last disturbance: one of [`disturb`](Self::disturb), or a statement that
    /// failed at the server.
    fn last_disturbance(&self) -> Option<Instant> {
        let failed = self.server.as_ref().and_then(|s| s.last_failure());
        self.disturbed_at.max(failed)
    }

    /// Notes a hand-over of `name` from `from` to `to`, checked if the fleet was calm
    /// and `to` waits for it.
    fn hand_over_asked(&mut self, name: &'static str, from: &str, to: &str, waits: bool) {
        // Who leads what as the request is made (the sampler looks every 10 ms): a
        // leader seen for the first time after the request did not take it back.
        self.sample_leaders();
        self.sample_singletons();
        let now = Instant::now();
        let calm = self
            .last_disturbance()
            .is_none_or(|at| now.duration_since(at) >= CALM_BEFORE_HAND_OVER);
        if calm && waits {
            self.hand_overs
                .insert(name, (from.to_owned(), to.to_owned(), now));
        } else {
            self.hand_overs.remove(name);
        }
    }

    /// `node` leads `name` now (it did not when last sampled).
    fn gained(&mut self, name: &'static str, node: &str) {
        let Some((from, to, at)) = self.hand_overs.remove(name) else {
            return;
        };
        let undisturbed = self.last_disturbance().is_none_or(|d| d <= at);
        if node != to && undisturbed {
            self.violations.push(format!(
                "{name}: handed over from {from} to {to}, which waited for it, but {node} \
                 took it (nothing else happened meanwhile)"
            ));
        }
    }

    /// Samples who leads each singleton, for the hand-over check.
    fn sample_singletons(&mut self) {
        for name in NAMES {
            let leading: Vec<String> = self
                .singleton_leaderships
                .iter()
                .filter(|((n, _), l)| *n == name && l.is_leader())
                .map(|((_, node), _)| node.clone())
                .collect();
            let before = self.holders.get(name).cloned().unwrap_or_default();
            for node in &leading {
                if !before.contains(node) {
                    self.gained(name, node);
                }
            }
            self.holders.insert(name, leading);
        }
    }

    /// Another node's child of `name` whose lease is valid now: its id, node, token.
    fn acting_elsewhere(&self, name: &str, node: &str) -> Option<(u64, String, u64)> {
        self.running.get(name)?.iter().find_map(|(id, n, ctx)| {
            (n != node && ctx.is_valid()).then(|| (*id, n.clone(), ctx.fencing_token().get()))
        })
    }

    /// Two act at once for `name`: `a` and `b` (node, token, what). A known gap when the
    /// session of the one with the smaller token was terminated within the lease
    /// timeout; a violation otherwise (a silent session the server gave up on must
    /// not overlap: that is the timing invariant).
    fn overlap(&mut self, name: &str, a: (&str, u64, String), b: (&str, u64, String)) {
        let (older, newer) = if a.1 <= b.1 { (a, b) } else { (b, a) };
        // Its own session terminated within the lease timeout, and the news not yet
        // heard (or heard just now: samples are 10 ms apart).
        let in_gap = newer.1 > older.1
            && self.server.as_ref().is_some_and(|s| {
                s.terminated_unheard(older.0, LEASE_TIMEOUT, Duration::from_millis(10))
            });
        if in_gap {
            self.known_gap.insert((name.to_owned(), older.2, newer.2));
        } else {
            self.violations.push(format!(
                "{name}: {} on {} (token {}) and {} on {} (token {}) act at once",
                older.2, older.0, older.1, newer.2, newer.0, newer.1
            ));
        }
    }

    fn begin(&mut self, name: &'static str, node: &str, ctx: &LeaderContext) -> u64 {
        self.next_id += 1;
        let id = self.next_id;
        self.starts += 1;
        for (on, (pid, _)) in self.finished_standing(name) {
            let lives = pid.is_some_and(|pid| {
                let key = self.keys.get(name).copied();
                self.server
                    .as_ref()
                    .is_some_and(|s| key.is_some_and(|k| s.session_lives(pid, k)))
            });
            if on == node {
                self.violations.push(format!(
                    "{name}: child {id} starts again on {node}, where the one-shot child \
                     finished"
                ));
            } else if lives {
                self.violations.push(format!(
                    "{name}: child {id} starts on {node} while the session of {on}, where \
                     the one-shot child finished, lives (backend {pid:?})"
                ));
            }
        }
        if let Some((other, on, token)) = self.acting_elsewhere(name, node) {
            self.overlap(
                name,
                (&on, token, format!("child {other}")),
                (
                    node,
                    ctx.fencing_token().get(),
                    format!("child {id} (starting)"),
                ),
            );
        } else {
            let stopping: Vec<u64> = self
                .running
                .get(name)
                .into_iter()
                .flatten()
                .filter(|(_, n, _)| n != node)
                .map(|(id, _, _)| *id)
                .collect();
            if !stopping.is_empty() {
                self.running_overlaps += 1;
            }
            for other in stopping {
                self.overlapped.entry(other).or_insert_with(Instant::now);
            }
        }
        self.note(format!(
            "{name}: child {id} starts on {node}, token {}",
            ctx.fencing_token().get()
        ));
        let token = ctx.fencing_token().get();
        if let Some((last, on)) = self.last_token.get(name)
            && (token < *last || (token == *last && on != node))
        {
            self.violations.push(format!(
                "{name}: child {id} on {node} has token {token}, after token {last} on {on}"
            ));
        }
        self.last_token.insert(name, (token, node.to_owned()));
        if self.quiet_from.is_some_and(|q| Instant::now() >= q) {
            self.violations.push(format!(
                "{name}: child {id} starts on {node} with no fault or request since the \
                 fleet settled (flapping)"
            ));
        }
        self.running
            .entry(name)
            .or_default()
            .push((id, node.to_owned(), ctx.clone()));
        id
    }

    fn tick(&mut self, name: &'static str, node: &str, id: u64, ctx: &LeaderContext) {
        if !ctx.is_valid() || self.dead.contains(&id) {
            return;
        }
        if let Some((other, on, token)) = self.acting_elsewhere(name, node) {
            self.overlap(
                name,
                (&on, token, format!("child {other}")),
                (node, ctx.fencing_token().get(), format!("child {id}")),
            );
        }
    }

    /// A one-shot child returned by itself (not cancelled): the node keeps the lock.
    fn finish(&mut self, name: &'static str, node: &str, id: u64, began: Instant) {
        // A child of a dead process finishes nothing (the node id is the next one's).
        if self.dead.contains(&id) {
            return;
        }
        // The backend of this node that holds the lock (none if the server gave it to
        // another node meanwhile: then no session of this node keeps the finish).
        let pid = self.keys.get(name).and_then(|k| {
            let server = self.server.as_ref()?;
            server
                .holder_of(*k)
                .filter(|pid| server.sessions_of(node).contains(pid))
        });
        self.note(format!(
            "{name}: one-shot child {id} finished on {node} (lock held by backend {pid:?})"
        ));
        self.finished
            .entry(name)
            .or_default()
            .insert(node.to_owned(), (pid, began));
    }

    /// The finishes of `name` no request has made the node forget since.
    fn finished_standing(&self, name: &str) -> Vec<(String, (Option<i32>, Instant))> {
        self.finished
            .get(name)
            .into_iter()
            .flatten()
            .filter(|(on, (_, began))| {
                !self
                    .requests
                    .iter()
                    .any(|(n, at, when)| *n == name && at == *on && when >= began)
            })
            .map(|(on, v)| (on.clone(), *v))
            .collect()
    }

    /// Whether a finished one-shot child of `name` is still kept by its node (on the
    /// session that held its lock then, or a later one: a node does not start it again
    /// in a later tenure): then no child of the name runs, rightly.
    fn kept_finished(&self, name: &str) -> Option<String> {
        let server = self.server.as_ref()?;
        let holder = server.holder_of(*self.keys.get(name)?)?;
        self.finished_standing(name)
            .into_iter()
            .map(|(on, _)| on)
            .find(|on| server.sessions_of(on).contains(&holder))
    }

    fn end(&mut self, name: &'static str, id: u64) {
        if let Some(r) = self.running.get_mut(name) {
            r.retain(|(i, _, _)| *i != id);
        }
        // A child still stopping when the next started ends within its shutdown
        // timeout of it: the next one started only once this one's lease had run out,
        // by when its node had cancelled it (gap (c) is bounded).
        if let Some(since) = self.overlapped.remove(&id)
            && !self.dead.contains(&id)
        {
            let ran_on = Instant::now().duration_since(since);
            if ran_on > RUNNING_OVERLAP_BOUND {
                self.violations.push(format!(
                    "{name}: child {id} ran on for {ran_on:?} after another node's child \
                     started (bound {RUNNING_OVERLAP_BOUND:?})"
                ));
            }
        }
        self.note(format!("{name}: child {id} returned"));
    }

    /// Samples the election: at most one leader, and none new once quiet.
    fn sample_leaders(&mut self) {
        let leading: Vec<(String, u64)> = self
            .leaderships
            .iter()
            .filter_map(|(n, l)| match l.state() {
                crate::LeaderState::Leading { token, .. } => Some((n.clone(), token.get())),
                _ => None,
            })
            .collect();
        for (i, a) in leading.iter().enumerate() {
            for b in &leading[i + 1..] {
                self.overlap(
                    ELECTION,
                    (&a.0, a.1, format!("leader {}", a.0)),
                    (&b.0, b.1, format!("leader {}", b.0)),
                );
            }
        }
        // A new leader's token is greater than every earlier leader's.
        let new: Vec<String> = leading
            .iter()
            .filter(|(n, _)| !self.leaders.contains(n))
            .map(|(n, _)| n.clone())
            .collect();
        for n in &new {
            self.gained(ELECTION, n);
        }
        for (n, token) in &leading {
            if !self.leaders.contains(n) {
                if let Some((last, on)) = self.last_token.get(ELECTION)
                    && (*token < *last || (*token == *last && on != n))
                {
                    self.violations.push(format!(
                        "{ELECTION}: {n} leads with token {token}, after token {last} on {on}"
                    ));
                }
                self.last_token.insert(ELECTION, (*token, n.clone()));
            }
        }
        let leaders: Vec<String> = leading.into_iter().map(|(n, _)| n).collect();
        if leaders != self.leaders {
            self.note(format!("{ELECTION}: leaders {leaders:?}"));
            if !leaders.is_empty() {
                self.leader_changes += 1;
                if self.quiet_from.is_some_and(|q| Instant::now() >= q) {
                    self.violations.push(format!(
                        "{ELECTION}: leader changed to {leaders:?} with no fault or request \
                         since the fleet settled (flapping)"
                    ));
                }
            }
            self.leaders = leaders;
        }
    }

    /// Where each member of the group has an acting child, and whether every member
    /// has exactly one and no node more than `ceil(M / N)` of them with `nodes` live
    /// nodes (the group's promise once placed). Returns the member → node placement.
    fn check_balance(&mut self, when: &str, up: &[String]) -> BTreeMap<&'static str, String> {
        let nodes = up.len();
        let mut placed = BTreeMap::new();
        let mut load: BTreeMap<String, usize> = BTreeMap::new();
        for member in MEMBERS {
            let acting: Vec<String> = self.running.get(member).map_or(Vec::new(), |r| {
                r.iter()
                    .filter(|(_, _, ctx)| ctx.is_valid())
                    .map(|(_, n, _)| n.clone())
                    .collect()
            });
            if let [on] = acting.as_slice() {
                *load.entry(on.clone()).or_default() += 1;
                placed.insert(member, on.clone());
            } else {
                self.violations.push(format!(
                    "{GROUP}/{member}: acting children on {acting:?} {when} (want one)"
                ));
            }
        }
        let most = MEMBERS.len().div_ceil(nodes.max(1));
        let least = MEMBERS.len() / nodes.max(1);
        for node in up {
            let members = load.get(node).copied().unwrap_or(0);
            if members < least {
                self.violations.push(format!(
                    "{GROUP}: {node} runs {members} members {when}, below floor({} / {nodes}) \
                     = {least} (unbalanced)",
                    MEMBERS.len()
                ));
            }
        }
        for (node, members) in load {
            if members > most {
                self.violations.push(format!(
                    "{GROUP}: {node} runs {members} members {when}, above ceil({} / {nodes}) = \
                     {most} (unbalanced)",
                    MEMBERS.len()
                ));
            }
        }
        placed
    }

    /// The members that moved between two placements when `node` left or joined the
    /// group: only its own members when it left; only to it, and at most
    /// `ceil(M / N)` of them, when it joined.
    fn check_moves(
        &mut self,
        node: &str,
        joined: bool,
        nodes: usize,
        before: &BTreeMap<&'static str, String>,
        after: &BTreeMap<&'static str, String>,
    ) {
        let change = if joined { "joined" } else { "left" };
        let mut moves = 0;
        for (member, from) in before {
            let Some(to) = after.get(member) else {
                continue;
            };
            if to == from {
                continue;
            }
            moves += 1;
            let allowed = if joined { to == node } else { from == node };
            if !allowed {
                self.violations.push(format!(
                    "{GROUP}/{member}: moved from {from} to {to} when {node} {change} (only \
                     members of the node that left, or to the node that joined, move)"
                ));
            }
        }
        let most = MEMBERS.len().div_ceil(nodes.max(1));
        if joined && moves > most {
            self.violations.push(format!(
                "{GROUP}: {moves} members moved when {node} joined, above ceil({} / {nodes}) = \
                 {most}",
                MEMBERS.len()
            ));
        }
        self.note(format!(
            "{GROUP}: {moves} members moved when {node} {change}"
        ));
    }

    /// `node`'s process died: its children are gone with it, and it leads nothing.
    fn died(&mut self, node: &str) {
        let gone = self.running_on(node);
        for r in self.running.values_mut() {
            r.retain(|(id, _, _)| !gone.contains(id));
        }
        self.dead.extend(gone.iter().copied());
        // A process that starts again does not know what the dead one finished.
        for name in NAMES {
            self.requests.push((name, node.to_owned(), Instant::now()));
        }
        self.leaderships.remove(node);
        self.singleton_leaderships.retain(|(_, n), _| n != node);
        self.disturb();
        self.note(format!("{node} died with children {gone:?}"));
    }

    fn running_on(&self, node: &str) -> Vec<u64> {
        self.running
            .values()
            .flatten()
            .filter(|(_, n, _)| n == node)
            .map(|(id, _, _)| *id)
            .collect()
    }
}

/// Records a child's end when dropped.
struct Ended {
    history: Arc<Mutex<History>>,
    name: &'static str,
    id: u64,
}

impl Drop for Ended {
    fn drop(&mut self) {
        if let Ok(mut h) = self.history.lock() {
            h.end(self.name, self.id);
        }
    }
}

/// What a run's fleet is made of, drawn from its seed.
#[derive(Clone, Copy, Debug)]
struct Shape {
    /// `s1`'s children finish by themselves ([`RestartPolicy::Never`]).
    one_shot: bool,
    /// The node (index) on which `s0`'s child fails as it starts, every time (a
    /// missing permission, say): it must give up and leave `s0` to another node.
    broken: Option<usize>,
    /// How many nodes prefer the election (`n0`, then `n1`): two preferred nodes must
    /// not hand the lead back and forth.
    e0_preferred: usize,
}

impl Shape {
    /// Whether node `node` cannot run name `what` (an index of [`NAMES`]): it gives it
    /// up, and waits for it only after a cooldown.
    fn cannot_run(self, what: usize, node: &str) -> bool {
        what == 0 && self.broken.is_some_and(|b| node == format!("n{b}"))
    }
}

/// The node preferred for `s1`, which fails back to it.
const S1_PREFERRED: &str = "n0";
/// How long a preferred node is seen before the leader fails back to it.
const FAIL_BACK_AFTER: Duration = Duration::from_secs(3);

struct Node {
    id: String,
    manager: Option<LockManager>,
    singletons: Vec<Singleton>,
    election: Option<Election>,
    group: Option<SingletonGroup>,
    /// Its sessions (to kill its process).
    backend: Option<Arc<SimBackend>>,
}

impl Node {
    /// Whether this node leads name `what` (an index of [`NAMES`], or past them: the
    /// election).
    fn leads(&self, what: usize) -> bool {
        if what < NAMES.len() {
            self.singletons
                .get(what)
                .is_some_and(|s| s.leadership().is_leader())
        } else {
            self.election
                .as_ref()
                .is_some_and(|e| e.leadership().is_leader())
        }
    }

    /// Hands name `what` over to node `to`, or steps down (`None`).
    fn give_away(&self, what: usize, to: Option<&str>) {
        if what < NAMES.len() {
            match (self.singletons.get(what), to) {
                (Some(s), Some(to)) => s.hand_over_to(to),
                (Some(s), None) => s.step_down(),
                (None, _) => {}
            }
        } else {
            match (&self.election, to) {
                (Some(e), Some(to)) => e.hand_over_to(to),
                (Some(e), None) => e.step_down(),
                (None, _) => {}
            }
        }
    }
}

fn options(node: &str) -> ManagerOptions {
    ManagerOptions::from_url("postgres://sim@localhost/sim")
        .expect("BUG: static URL parses")
        .node_id(node)
}

/// A child of the fleet: it reports its start, its ticks (at each of which the checker
/// reads every running child's lease) and its end to the [`History`].
struct Child {
    history: Arc<Mutex<History>>,
    name: &'static str,
    node: String,
    /// Its work ends by itself (after 0.5 to 4 s), as a [`RestartPolicy::Never`]
    /// child's does.
    one_shot: bool,
    /// It fails as it starts.
    fails: bool,
    seed: u64,
    /// How long it takes to stop once cancelled (beyond the 1 s shutdown timeout, it is
    /// aborted).
    stop_for: Duration,
}

impl Child {
    async fn run(self, ctx: LeaderContext) -> Result<(), std::io::Error> {
        let Self {
            history,
            name,
            node,
            one_shot,
            fails,
            seed,
            stop_for,
        } = self;
        let began = Instant::now();
        let id = history.lock().unwrap().begin(name, &node, &ctx);
        // Ended when it returns, or when the singleton aborts it.
        let _ended = Ended {
            history: Arc::clone(&history),
            name,
            id,
        };
        if fails {
            return Err(std::io::Error::other("cannot start (simulated)"));
        }
        // A one-shot child's work takes 0.5 to 4 s.
        let work = Duration::from_millis(500 + (seed ^ id).wrapping_mul(0x9e37) % 3_500);
        let done = tokio::time::sleep(if one_shot {
            work
        } else {
            Duration::from_secs(365 * 86_400)
        });
        tokio::pin!(done);
        loop {
            tokio::select! {
                biased;
                () = ctx.cancelled() => break,
                () = &mut done => {
                    history.lock().unwrap().finish(name, &node, id, began);
                    return Ok(());
                }
                () = tokio::time::sleep(Duration::from_millis(10)) => {
                    history.lock().unwrap().tick(name, &node, id, &ctx);
                }
            }
        }
        // Stopping takes a while.
        tokio::time::sleep(stop_for).await;
        Ok(())
    }
}

async fn start_node(
    server: &Arc<SimServer>,
    history: &Arc<Mutex<History>>,
    node: &mut Node,
    (seed, shape): (u64, Shape),
) {
    // A node cut off, or while the server is down, cannot connect: it tries again, as
    // a restarting process would (a bounded number of times: a black hole always
    // heals, and the server comes back, within a few attempts).
    let mut attempts = 0;
    let manager = loop {
        attempts += 1;
        if attempts > 20 {
            history
                .lock()
                .unwrap()
                .violations
                .push(format!("{} could not connect in 20 attempts", node.id));
            return;
        }
        let backend = Arc::new(SimBackend::new(Arc::clone(server), seed));
        match LockManager::connect_with(options(&node.id), Arc::clone(&backend) as _).await {
            Ok(manager) => {
                node.backend = Some(backend);
                break manager;
            }
            Err(e) => {
                history
                    .lock()
                    .unwrap()
                    .note(format!("{} could not connect: {e}", node.id));
                // (The server may be down for a few seconds.)
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    };
    // Some children stop within their shutdown timeout (1 s), some are aborted.
    let stop_for = Duration::from_millis(seed % 1_500);
    {
        let mut h = history.lock().unwrap();
        for name in NAMES {
            h.keys.insert(name, manager.key_for(name));
        }
    }
    let index: usize = node.id[1..].parse().expect("BUG: nodes are named n<i>");
    node.singletons = NAMES
        .iter()
        .map(|name| {
            let history = Arc::clone(history);
            let node_id = node.id.clone();
            let name: &'static str = name;
            let one_shot = shape.one_shot && name == "s1";
            let fails = name == "s0" && shape.broken == Some(index);
            let options = SingletonOptions::default()
                .restart(if one_shot {
                    RestartPolicy::Never
                } else {
                    RestartPolicy::Always
                })
                .shutdown_timeout(Duration::from_secs(1))
                .preferred(name == "s1" && node.id == S1_PREFERRED)
                .fail_back_after(FAIL_BACK_AFTER);
            Singleton::start(&manager, name, options, move |ctx: LeaderContext| {
                let child = Child {
                    history: Arc::clone(&history),
                    name,
                    node: node_id.clone(),
                    one_shot,
                    fails,
                    seed,
                    stop_for,
                };
                child.run(ctx)
            })
            .expect("valid singleton")
        })
        .collect();
    {
        let mut h = history.lock().unwrap();
        for (name, s) in NAMES.iter().zip(&node.singletons) {
            h.singleton_leaderships
                .insert((name, node.id.clone()), s.leadership());
        }
    }
    let election = Election::start_with(
        &manager,
        ELECTION,
        crate::ElectionOptions::default()
            .preferred(index < shape.e0_preferred)
            .fail_back_after(FAIL_BACK_AFTER),
    )
    .expect("valid election");
    history
        .lock()
        .unwrap()
        .leaderships
        .insert(node.id.clone(), election.leadership());
    node.election = Some(election);
    let group = SingletonGroup::start(
        &manager,
        GROUP,
        MEMBERS,
        GroupOptions::default()
            .singleton(SingletonOptions::default().shutdown_timeout(Duration::from_secs(1)))
            .max_nodes(8)
            .flapping(2, GROUP_FLAP_WINDOW),
        {
            let (history, node) = (Arc::clone(history), node.id.clone());
            move |member: String, ctx: LeaderContext| {
                let name = MEMBERS
                    .into_iter()
                    .find(|m| *m == member)
                    .expect("BUG: the group has only these members");
                let child = Child {
                    history: Arc::clone(&history),
                    name,
                    node: node.clone(),
                    one_shot: false,
                    fails: false,
                    seed,
                    stop_for,
                };
                child.run(ctx)
            }
        },
    )
    .expect("valid group");
    node.group = Some(group);
    node.manager = Some(manager);
}

/// Shuts a node down and checks the bound and that none of its children runs on.
async fn stop_node(history: &Arc<Mutex<History>>, node: &mut Node) {
    let Some(manager) = node.manager.take() else {
        return;
    };
    let singletons = std::mem::take(&mut node.singletons);
    let election = node.election.take();
    let group = node.group.take();
    node.backend = None;
    history.lock().unwrap().disturb();
    let ended = tokio::time::timeout(SHUTDOWN_BOUND, async {
        if let Some(g) = &group {
            g.shutdown().await;
        }
        for (name, s) in NAMES.into_iter().zip(&singletons) {
            // A singleton shut down gives its lock away: the next node starts the
            // child, even one that finished here. Noted as it is asked, not when the
            // node's shutdown began: until then, a child may start here and finish.
            history
                .lock()
                .unwrap()
                .requests
                .push((name, node.id.clone(), Instant::now()));
            s.shutdown().await;
        }
        if let Some(e) = &election {
            e.shutdown().await;
        }
        manager.shutdown().await;
    })
    .await;
    let mut h = history.lock().unwrap();
    h.leaderships.remove(&node.id);
    h.singleton_leaderships.retain(|(_, n), _| *n != node.id);
    if ended.is_err() {
        h.violations.push(format!(
            "{}: shutdown not done within {SHUTDOWN_BOUND:?}",
            node.id
        ));
    }
    let still = h.running_on(&node.id);
    if !still.is_empty() {
        h.violations.push(format!(
            "{}: shutdown returned while children {still:?} run",
            node.id
        ));
    }
    h.note(format!("{} shut down", node.id));
}

/// Black-holes node `node`'s traffic for `cut_for`, healed in the background (other
/// faults go on meanwhile).
fn black_hole(
    server: &Arc<SimServer>,
    history: &Arc<Mutex<History>>,
    node: &str,
    cut_for: Duration,
) {
    {
        let mut h = history.lock().unwrap();
        h.note(format!(
            "FAULT black-hole {node} for {} ms",
            cut_for.as_millis()
        ));
        h.disturb();
    }
    server.cut(node, true);
    tokio::spawn({
        let (server, history, node) = (Arc::clone(server), Arc::clone(history), node.to_owned());
        async move {
            tokio::time::sleep(cut_for).await;
            server.cut(&node, false);
            let mut h = history.lock().unwrap();
            h.disturb();
            h.note(format!("{node} healed"));
        }
    });
}

/// Kills a node's process: its sessions close, its children are gone, and its tasks
/// linger in `graveyard`, never to reach the server again.
fn kill_node(history: &Arc<Mutex<History>>, node: &mut Node, graveyard: &mut Vec<Node>) {
    let Some(backend) = node.backend.take() else {
        return;
    };
    backend.die(&node.id);
    history.lock().unwrap().died(&node.id);
    graveyard.push(Node {
        id: node.id.clone(),
        manager: node.manager.take(),
        singletons: std::mem::take(&mut node.singletons),
        election: node.election.take(),
        group: node.group.take(),
        backend: Some(backend),
    });
}

/// How long a hand-over in a calm fleet takes at most: the holder's child stops (up to
/// its 1 s shutdown timeout), then the target takes the key within about a round trip.
const HAND_OVER_BOUND: Duration = Duration::from_millis(1_500);

/// Once the fleet settled: each name is handed over twice, from its holder to another
/// node, in a fleet with nothing else going on; each time the target must hold it
/// within [`HAND_OVER_BOUND`] (no other node may take it meanwhile, nor the holder
/// take it back).
async fn calm_hand_overs(
    history: &Arc<Mutex<History>>,
    nodes: &[Node],
    rng: &mut Rng,
    shape: Shape,
) {
    for _ in 0..2 {
        for what in 0..=NAMES.len() {
            let name = NAMES.get(what).copied().unwrap_or(ELECTION);
            let leads = |node: &Node| node.leads(what);
            let Some(from) = nodes.iter().position(leads) else {
                continue;
            };
            let others: Vec<usize> = (0..nodes.len())
                .filter(|i| {
                    *i != from
                        && nodes[*i].manager.is_some()
                        && !shape.cannot_run(what, &nodes[*i].id)
                })
                .collect();
            if others.is_empty() {
                continue;
            }
            let to = others[rng.below(others.len() as u64) as usize];
            let (from_id, to_id) = (nodes[from].id.clone(), nodes[to].id.clone());
            {
                let mut h = history.lock().unwrap();
                h.requests.push((name, from_id.clone(), Instant::now()));
                h.disturb();
                h.note(format!("calm: hand over {name} from {from_id} to {to_id}"));
            }
            let asked = Instant::now();
            nodes[from].give_away(what, Some(&to_id));
            tokio::time::sleep(HAND_OVER_BOUND).await;
            let holders: Vec<String> = nodes
                .iter()
                .filter(|n| leads(n))
                .map(|n| n.id.clone())
                .collect();
            // A statement that failed meanwhile (the server's own fault, drawn now and
            // then) is no calm fleet: a failed try waits for the next poll.
            let failed = history
                .lock()
                .unwrap()
                .server
                .as_ref()
                .and_then(|s| s.last_failure())
                .is_some_and(|at| at >= asked);
            if holders != [to_id.clone()] && !failed {
                history.lock().unwrap().violations.push(format!(
                    "{name}: handed over from {from_id} to {to_id} in a calm fleet, but \
                     held by {holders:?} {HAND_OVER_BOUND:?} later"
                ));
            }
            // Calm again (a fail-back to a preferred node may follow: let it).
            tokio::time::sleep(Duration::from_secs(8)).await;
        }
    }
    // Then each name is stepped down once: another node leads it within the bound.
    for what in 0..=NAMES.len() {
        let name = NAMES.get(what).copied().unwrap_or(ELECTION);
        let leads = |node: &Node| node.leads(what);
        let Some(from) = nodes.iter().position(leads) else {
            continue;
        };
        let can_take = nodes
            .iter()
            .enumerate()
            .any(|(i, n)| i != from && n.manager.is_some() && !shape.cannot_run(what, &n.id));
        // (A node that cannot run it may take it first, give up, and the key go back
        // to the node that stepped down: right, but not what this checks.)
        let broken_waits = nodes
            .iter()
            .any(|n| n.manager.is_some() && shape.cannot_run(what, &n.id));
        if !can_take || broken_waits {
            continue;
        }
        let from_id = nodes[from].id.clone();
        {
            let mut h = history.lock().unwrap();
            h.requests.push((name, from_id.clone(), Instant::now()));
            h.disturb();
            h.note(format!("calm: step down {name} on {from_id}"));
        }
        let asked = Instant::now();
        nodes[from].give_away(what, None);
        tokio::time::sleep(STEP_DOWN_BOUND).await;
        let holders: Vec<String> = nodes
            .iter()
            .filter(|n| leads(n))
            .map(|n| n.id.clone())
            .collect();
        {
            let mut h = history.lock().unwrap();
            let failed = h
                .server
                .as_ref()
                .and_then(|s| s.last_failure())
                .is_some_and(|at| at >= asked);
            if (holders.len() != 1 || holders.contains(&from_id)) && !failed {
                h.violations.push(format!(
                    "{name}: stepped down on {from_id} in a calm fleet, but held by \
                     {holders:?} {STEP_DOWN_BOUND:?} later (want another node)"
                ));
            }
        }
        tokio::time::sleep(Duration::from_secs(8)).await;
    }
}

/// How long a step-down in a calm fleet takes at most: the child stops (up to its 1 s
/// shutdown timeout), the release is announced, and a waiting node takes the key
/// (with no hand-over named, after the takeover grace's worth of checks at most).
const STEP_DOWN_BOUND: Duration = Duration::from_millis(2_500);

/// Once the fleet settled and is calm: a node leaves (shuts down), then joins again.
/// Once the group placed its members after each change, every member runs on one
/// node, none runs more than `ceil(M / N)`, and only what must move moved (see
/// [`History::check_moves`]).
async fn calm_membership_changes(
    server: &Arc<SimServer>,
    history: &Arc<Mutex<History>>,
    nodes: &mut [Node],
    rng: &mut Rng,
    (seed, shape): (u64, Shape),
) {
    let up: Vec<String> = nodes
        .iter()
        .filter(|n| n.manager.is_some())
        .map(|n| n.id.clone())
        .collect();
    if up.len() < 2 {
        return;
    }
    let id = up[rng.below(up.len() as u64) as usize].clone();
    let x = nodes
        .iter()
        .position(|n| n.id == id)
        .expect("BUG: an up node");
    let rest: Vec<String> = up.iter().filter(|n| **n != id).cloned().collect();
    let before = {
        let mut h = history.lock().unwrap();
        h.note(format!("calm: {id} leaves"));
        h.check_balance(&format!("before {id} leaves"), &up)
    };
    stop_node(history, &mut nodes[x]).await;
    tokio::time::sleep(GROUP_SETTLE).await;
    let left = {
        let mut h = history.lock().unwrap();
        let left = h.check_balance(&format!("{GROUP_SETTLE:?} after {id} left"), &rest);
        h.check_moves(&id, false, up.len() - 1, &before, &left);
        h.note(format!("calm: {id} joins"));
        left
    };
    start_node(server, history, &mut nodes[x], (seed ^ 0xca1d, shape)).await;
    history.lock().unwrap().disturb();
    tokio::time::sleep(GROUP_SETTLE).await;
    let mut h = history.lock().unwrap();
    let joined = h.check_balance(&format!("{GROUP_SETTLE:?} after {id} joined"), &up);
    h.check_moves(&id, true, up.len(), &left, &joined);
}

struct Outcome {
    violations: Vec<String>,
    known_gap: u64,
    starts: u64,
    running_overlaps: u64,
    log: Vec<String>,
}

/// The server ends a session idle this long (`server_release_after`, 7 s by default):
/// longer than the lease timeout (3 s) plus the stop budget, the timing invariant that
/// keeps a cut-off holder from acting once another node is granted.
const RELEASE_AFTER: Duration = Duration::from_secs(7);

/// Which way the nodes hold their locks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// Session advisory locks on a dedicated connection each.
    Advisory,
    /// Lease rows through a pool (`LockManager::connect_pooled`).
    Rows,
}

/// The server's wall clock steps forward by at most this (the managers' safety margin,
/// the default), at most once in a row's lifetime: the lease-row mode's expiries are
/// by it.
const CLOCK_STEP_MAX: Duration = Duration::from_secs(1);

async fn run(seed: u64, release_after: Duration, mode: Mode) -> Outcome {
    let mut rng = Rng::new(seed);
    let server = SimServer::new(seed);
    if mode == Mode::Rows {
        server.lease_rows();
        if release_after < RELEASE_AFTER {
            server.rows_expire_after(release_after);
        }
    }
    // The server's clock steps no sooner than a row's lifetime after its last step.
    let mut next_clock_step = Instant::now();
    // As chosen sets its session up: the server ends a silent session after
    // `server_release_after` (7 s by default).
    server.reap_idle(release_after, Duration::from_millis(250));
    let history = Arc::new(Mutex::new(History {
        server: Some(Arc::clone(&server)),
        ..History::default()
    }));
    let count = 3 + rng.below(2) as usize;
    let shape = Shape {
        one_shot: rng.below(2) == 0,
        broken: (rng.below(2) == 0).then(|| rng.below(count as u64) as usize),
        e0_preferred: rng.below(3) as usize,
    };
    history
        .lock()
        .unwrap()
        .note(format!("{count} nodes, {shape:?}, {mode:?}"));
    let mut nodes: Vec<Node> = (0..count)
        .map(|i| Node {
            id: format!("n{i}"),
            manager: None,
            singletons: Vec::new(),
            election: None,
            group: None,
            backend: None,
        })
        .collect();
    for (i, node) in nodes.iter_mut().enumerate() {
        start_node(&server, &history, node, (seed ^ (i as u64 + 1), shape)).await;
    }
    let sampler = tokio::spawn({
        let history = Arc::clone(&history);
        async move {
            loop {
                tokio::time::sleep(Duration::from_millis(10)).await;
                let mut h = history.lock().unwrap();
                h.sample_leaders();
                h.sample_singletons();
            }
        }
    });
    let mut faults_until = Instant::now();
    // Nodes whose process was killed: their tasks, inert.
    let mut graveyard = Vec::new();
    // The server is down until then (it goes down once at a time).
    let mut server_back = Instant::now();
    for step in 0..STEPS {
        tokio::time::sleep(rng.millis(0, 2_000)).await;
        if mode == Mode::Rows && rng.below(8) == 0 && Instant::now() >= next_clock_step {
            let by = rng.millis(1, CLOCK_STEP_MAX.as_millis() as u64);
            let mut h = history.lock().unwrap();
            h.note(format!(
                "FAULT the server's clock steps {} ms forward",
                by.as_millis()
            ));
            h.disturb();
            drop(h);
            server.step_clock(by);
            next_clock_step = Instant::now() + release_after + Duration::from_secs(1);
        }
        if rng.below(STEPS.into()) == 0 && Instant::now() >= server_back {
            // Now and then the server restarts, or fails over to a standby.
            let down = rng.millis(200, 4_000);
            let promotion = (rng.below(2) == 0).then(|| rng.below(50));
            let mut h = history.lock().unwrap();
            h.note(format!(
                "FAULT server {} for {} ms",
                if promotion.is_some() {
                    "fails over"
                } else {
                    "restarts"
                },
                down.as_millis()
            ));
            // Disturbed until its new term's hold is over (up to 8 s after it is back,
            // a promotion's age unknown meanwhile).
            let settled = Instant::now() + down + Duration::from_secs(16);
            h.disturbed_at = Some(settled);
            drop(h);
            faults_until = faults_until.max(settled);
            server_back = Instant::now() + down;
            // Half the time a node is cut off from it as it goes down (a failover and
            // a partition together): that node hears of nothing until healed.
            if rng.below(2) == 0 {
                let n = rng.below(count as u64) as usize;
                if !server.is_cut(&nodes[n].id) {
                    black_hole(&server, &history, &nodes[n].id, rng.millis(1_000, 6_000));
                }
            }
            server.restart(down, promotion);
            continue;
        }
        let n = rng.below(count as u64) as usize;
        let node = &mut nodes[n];
        match rng.below(10) {
            // Not while the node is cut off: a termination its holder cannot hear is a
            // double fault only the fencing token covers (as in the engine simulation,
            // which does not draw it either).
            0..=4 if !server.is_cut(&node.id) => {
                for pid in server.backends_of(&node.id) {
                    let mut h = history.lock().unwrap();
                    h.disturb();
                    h.note(format!("FAULT terminate backend {pid} of {}", node.id));
                    drop(h);
                    server.terminate(pid);
                }
            }
            5 | 6 => {
                let crash = rng.below(2) == 0;
                history.lock().unwrap().note(format!(
                    "FAULT {} {}",
                    if crash { "kill" } else { "restart" },
                    node.id
                ));
                if crash {
                    kill_node(&history, node, &mut graveyard);
                } else {
                    stop_node(&history, node).await;
                }
                tokio::time::sleep(rng.millis(0, 3_000)).await;
                let node_seed = seed ^ (u64::from(step) << 8) ^ n as u64;
                start_node(&server, &history, node, (node_seed, shape)).await;
                history.lock().unwrap().disturb();
            }
            7 | 8 => {
                // Asked of the node that leads (if one does), as an operator would.
                let what = rng.below(NAMES.len() as u64 + 1) as usize;
                let leads = |node: &Node| node.leads(what);
                let n = nodes.iter().position(leads).unwrap_or(n);
                let to = format!(
                    "n{}",
                    (n + 1 + rng.below(count as u64 - 1) as usize) % count
                );
                let hand_over = rng.below(2) == 0;
                let node = &nodes[n];
                let name = NAMES.get(what).copied().unwrap_or(ELECTION);
                // Does the target wait for it (it runs, is not cut off, does not lead it)?
                let waits = nodes.iter().find(|m| m.id == to).is_some_and(|m| {
                    m.manager.is_some()
                        && !server.is_cut(&m.id)
                        && !leads(m)
                        && !shape.cannot_run(what, &m.id)
                });
                let mut h = history.lock().unwrap();
                // Only a node that holds it gives it away (and forgets a finish):
                // asked of another, it does nothing.
                if leads(node) {
                    h.requests.push((name, node.id.clone(), Instant::now()));
                    if hand_over {
                        h.hand_over_asked(name, &node.id, &to, waits);
                    }
                }
                // A disturbance for any later hand-over (not for this one: it is at the
                // same instant, and the clock stands still between).
                h.disturb();
                h.note(if hand_over {
                    format!("hand over {name} from {} to {to}", node.id)
                } else {
                    format!("step down {name} on {}", node.id)
                });
                drop(h);
                node.give_away(what, hand_over.then_some(to.as_str()));
            }
            _ => {
                let cut_for = rng.millis(500, 12_000);
                black_hole(&server, &history, &node.id, cut_for);
                faults_until = faults_until.max(Instant::now() + cut_for);
            }
        }
    }
    tokio::time::sleep_until(faults_until.max(Instant::now())).await;
    server.calm();
    tokio::time::sleep(QUIET_AFTER).await;
    history.lock().unwrap().quiet_from = Some(Instant::now());
    tokio::time::sleep(SETTLE - QUIET_AFTER).await;
    {
        let mut h = history.lock().unwrap();
        h.quiet_from = None;
        if h.leaders.len() != 1 {
            let leaders = h.leaders.clone();
            h.violations.push(format!(
                "{ELECTION}: leaders {leaders:?} once settled (want one)"
            ));
        }
        for name in NAMES {
            let acting: Vec<String> = h.running.get(name).map_or(Vec::new(), |r| {
                r.iter()
                    .filter(|(_, _, ctx)| ctx.is_valid())
                    .map(|(_, n, _)| n.clone())
                    .collect()
            });
            // A one-shot child that finished is kept, running nothing, by its node.
            let kept = h.kept_finished(name);
            match (acting.as_slice(), &kept) {
                ([_], None) | ([], Some(_)) => {}
                _ => h.violations.push(format!(
                    "{name}: acting children on {acting:?} once settled, finished one kept \
                     by {kept:?} (want one of the two)"
                )),
            }
            // The preferred node, up since the faults ended, runs it (unless a finished
            // one is kept elsewhere).
            if name == "s1" && kept.is_none() && acting.iter().any(|n| n != S1_PREFERRED) {
                h.violations.push(format!(
                    "{name}: runs on {acting:?} once settled, not on the preferred {S1_PREFERRED}"
                ));
            }
        }
        let up: Vec<String> = nodes
            .iter()
            .filter(|n| n.manager.is_some())
            .map(|n| n.id.clone())
            .collect();
        h.check_balance("once settled", &up);
        let preferred: Vec<String> = (0..shape.e0_preferred).map(|i| format!("n{i}")).collect();
        if !preferred.is_empty() && h.leaders.iter().any(|l| !preferred.contains(l)) {
            let leaders = h.leaders.clone();
            h.violations.push(format!(
                "{ELECTION}: led by {leaders:?} once settled, not by a preferred node of {preferred:?}"
            ));
        }
    }
    calm_hand_overs(&history, &nodes, &mut rng, shape).await;
    calm_membership_changes(&server, &history, &mut nodes, &mut rng, (seed, shape)).await;
    for node in &mut nodes {
        stop_node(&history, node).await;
    }
    sampler.abort();
    let mut violations = server.violations();
    let mut h = history.lock().unwrap();
    violations.append(&mut h.violations);
    Outcome {
        violations,
        known_gap: h.known_gap.len() as u64,
        starts: h.starts,
        running_overlaps: h.running_overlaps,
        log: std::mem::take(&mut h.log),
    }
}

/// Log lines stamped with tokio's (paused) clock.
struct VirtualTime;

impl tracing_subscriber::fmt::time::FormatTime for VirtualTime {
    fn format_time(&self, w: &mut tracing_subscriber::fmt::format::Writer<'_>) -> std::fmt::Result {
        write!(w, "{:?}", Instant::now())
    }
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok()?.parse().ok()
}

fn run_seed(seed: u64, release_after: Duration, mode: Mode) -> Outcome {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("a runtime")
        .block_on(run(seed, release_after, mode))
}

/// The acting check sees two children act at once when the server ends a silent
/// session before its holder's lease has expired (2 s against a 3 s lease timeout):
/// the check can fail, and fails where the timing invariant is broken.
#[test]
fn the_fleet_check_fails_when_the_server_releases_a_session_before_its_lease_expires() {
    let failing: Vec<u64> = (0..20)
        .filter(|seed| {
            run_seed(*seed, Duration::from_secs(2), Mode::Advisory)
                .violations
                .iter()
                .any(|v| v.contains("act"))
        })
        .collect();
    assert!(
        failing.len() >= 5,
        "two children acting at once in only {failing:?} of 20 seeds"
    );
}

/// The same in the lease-row mode: rows that expire 2 s after their renewal, while
/// their holders trust them for 3 s, are taken over while the holder still acts.
#[test]
fn the_lease_row_fleet_check_fails_when_rows_expire_before_their_holder_stops() {
    let failing = (0..40)
        .map(|seed| run_seed(seed, Duration::from_secs(2), Mode::Rows))
        .find(|out| !out.violations.is_empty())
        .map(|out| out.violations);
    let violations = failing.expect("no seed of 40 found a row taken too early");
    assert!(
        violations
            .iter()
            .any(|v| v.contains("taken over") || v.contains("at once")),
        "{violations:?}"
    );
}

/// The first of the first 40 seeds whose run, with `guard` switched off, reports a
/// violation that contains `what`.
/// Reports through `tracing` to the test's output (`--nocapture` shows it), once per
/// test process.
fn log_to_tests(filter: &str) {
    let _ = tracing_subscriber::fmt()
        .with_test_writer()
        .with_timer(VirtualTime)
        .with_target(false)
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .try_init();
}

fn first_failing_without(guard: super::Guard, what: &str) -> Option<u64> {
    first_failing_without_in(guard, what, Mode::Advisory)
}

/// As [`first_failing_without`], with every node in `mode`.
fn first_failing_without_in(guard: super::Guard, what: &str, mode: Mode) -> Option<u64> {
    log_to_tests("chosen_core::sim::fleet=info");
    let _off = super::switch_off(&[guard]);
    let found = (0..40).find_map(|seed| {
        run_seed(seed, RELEASE_AFTER, mode)
            .violations
            .into_iter()
            .find(|v| v.contains(what))
            .map(|v| (seed, v))
    });
    tracing::info!("with {guard:?} off, the first failing seed and its violation: {found:?}");
    found.map(|(seed, _)| seed)
}

/// Each rule of the supervision layer (and of the lock table, for what only a fleet
/// shows) that the fleet checks is load-bearing: with it switched off, the check it
/// serves fails on one of the first 40 seeds.
#[test]
fn the_fleet_check_fails_when_a_finished_one_shot_child_is_failed_back() {
    let seed = first_failing_without(super::Guard::FinishedKeepsLock, "one-shot");
    assert!(seed.is_some(), "no seed of 40 ran a finished child twice");
}

#[test]
fn the_fleet_check_fails_when_preferred_leaders_fail_back_to_each_other() {
    let seed = first_failing_without(super::Guard::PreferredLeaderKeeps, "flapping");
    assert!(seed.is_some(), "no seed of 40 flapped");
}

#[test]
fn the_fleet_check_fails_when_a_preferred_node_does_not_retake_its_presence() {
    let seed = first_failing_without(super::Guard::PresenceRetaken, "preferred");
    assert!(seed.is_some(), "no seed of 40 left the preferred node out");
}

#[test]
fn the_fleet_check_fails_when_a_try_that_raced_a_hand_over_keeps_the_key() {
    let guard = super::Guard::Engine(crate::table::Protection::HandOverYield);
    let seed = first_failing_without(guard, "handed over");
    assert!(seed.is_some(), "no seed of 40 lost a hand-over");
}

#[test]
fn the_fleet_check_fails_when_a_node_takes_back_what_it_just_handed_over() {
    let guard = super::Guard::Engine(crate::table::Protection::HandOverHold);
    let seed = first_failing_without(guard, "handed over");
    assert!(seed.is_some(), "no seed of 40 lost a hand-over");
}

#[test]
fn the_fleet_check_fails_when_a_child_that_cannot_start_does_not_give_up() {
    let seed = first_failing_without(super::Guard::ChildGivesUp, "s0: ");
    assert!(
        seed.is_some(),
        "no seed of 40 left s0 on a node that cannot run it"
    );
}

#[test]
fn the_fleet_check_fails_when_a_new_server_term_does_not_hold_grants() {
    let guard = super::Guard::Engine(crate::table::Protection::TermHold);
    let seed = first_failing_without(guard, "at once");
    assert!(seed.is_some(), "no seed of 40 had two act at once");
}

#[test]
fn the_lease_row_fleet_check_fails_when_a_new_server_term_does_not_hold_grants() {
    let guard = super::Guard::Engine(crate::table::Protection::TermHold);
    let seed = first_failing_without_in(guard, "at once", Mode::Rows);
    assert!(seed.is_some(), "no seed of 40 had two act at once");
}

#[test]
fn the_fleet_check_fails_when_a_group_node_keeps_its_surplus() {
    let seed = first_failing_without(super::Guard::GroupReleasesSurplus, "unbalanced");
    assert!(seed.is_some(), "no seed of 40 left a group unbalanced");
}

#[test]
fn the_fleet_check_fails_when_group_members_move_between_nodes_that_stayed() {
    let seed = first_failing_without(super::Guard::GroupKeepsPlaced, "moved from");
    assert!(seed.is_some(), "no seed of 40 moved a member it need not");
}

/// A seed's run is a function of the seed: run twice, its log is the same.
#[test]
fn a_fleet_run_replays_exactly() {
    for (seed, mode) in [(3, Mode::Advisory), (11, Mode::Advisory), (5, Mode::Rows)] {
        let a = run_seed(seed, RELEASE_AFTER, mode);
        let b = run_seed(seed, RELEASE_AFTER, mode);
        assert!(
            a.log.len() > 50,
            "seed {seed}: a short run ({} lines)",
            a.log.len()
        );
        if let Some(i) = (0..a.log.len().max(b.log.len())).find(|i| a.log.get(*i) != b.log.get(*i))
        {
            panic!(
                "seed {seed} ran differently the second time, from line {i}: {:?} / {:?}",
                a.log.get(i),
                b.log.get(i)
            );
        }
        assert_eq!(a.violations, b.violations);
    }
}

#[test]
fn the_fleet_holds_over_many_seeds() {
    fleet_holds(Mode::Advisory);
}

/// The same fleet, every node holding its locks as lease rows through a pool: rows
/// outlive connections, expire by the server's (stepping) clock, are taken over only
/// once their holder stopped, and batches fail before and after they commit, or commit
/// after their client gave them up.
#[test]
fn the_fleet_holds_in_the_lease_row_mode() {
    fleet_holds(Mode::Rows);
}

/// Runs the seeds `CHOSEN_FLEET_FIRST..+CHOSEN_FLEET_SEEDS` (or `CHOSEN_FLEET_SEED`
/// alone) in `mode`, and fails with every failing seed.
fn fleet_holds(mode: Mode) {
    let replay = env_u64("CHOSEN_FLEET_SEED");
    // Reports go through tracing, to the test's output. A replay shows the managers'
    // own logs too, with the virtual time of each line.
    // `CHOSEN_FLEET_LOG` (e.g. `chosen_core=trace`) overrides it.
    let filter = std::env::var("CHOSEN_FLEET_LOG").unwrap_or_else(|_| {
        if replay.is_some() {
            "chosen_core=debug"
        } else {
            "chosen_core::sim=info"
        }
        .to_owned()
    });
    log_to_tests(&filter);
    let (first, count) = match replay {
        Some(seed) => (seed, 1),
        None => (
            env_u64("CHOSEN_FLEET_FIRST").unwrap_or(0),
            env_u64("CHOSEN_FLEET_SEEDS").unwrap_or(100),
        ),
    };
    let started = std::time::Instant::now();
    let mut failures = Vec::new();
    let (mut starts, mut overlaps, mut gap) = (0, 0, 0);
    for seed in first..first + count {
        let out = run_seed(seed, RELEASE_AFTER, mode);
        if replay.is_some() {
            for line in &out.log {
                tracing::info!("{line}");
            }
        }
        starts += out.starts;
        overlaps += out.running_overlaps;
        gap += out.known_gap;
        if !out.violations.is_empty() {
            failures.push((seed, out.violations));
        }
    }
    tracing::info!(
        "fleet ({mode:?}): seeds {first}..{}, {:.1} s: {starts} child starts, {overlaps} starts while \
         another node's child was still stopping, {gap} acting at once in the known gap \
         (the earlier one's session terminated; greater token), {} failing seeds",
        first + count,
        started.elapsed().as_secs_f64(),
        failures.len()
    );
    for (seed, violations) in failures.iter().take(20) {
        tracing::info!("seed {seed}: {}", violations[0]);
    }
    if let Some((seed, violations)) = failures.first() {
        let seeds: Vec<u64> = failures.iter().map(|(s, _)| *s).collect();
        panic!(
            "the fleet simulation failed with seeds {seeds:?}; first, seed {seed} (replay with \
             CHOSEN_FLEET_SEED={seed}):\n{}",
            violations.join("\n")
        );
    }
}
