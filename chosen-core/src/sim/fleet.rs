//! A simulated fleet: several nodes, each a real [`LockManager`] with real
//! [`Singleton`]s, on one [`SimServer`], on tokio's paused clock, with faults drawn from
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
//!   or request since.
//!
//! Children of one name *running* at once (one stopping while the next starts) are
//! counted, not failed: a session the server ended may leave its holder's stop fence
//! untaken when the next holder looks (the engine simulation's gap (c)).
//!
//! Faults: a node's backends terminated, its traffic black-holed for up to 12 s (the
//! server ends a session idle for 7 s), a node shut down and started again, a
//! singleton stepped down or handed over, an election stepped down.
//!
//! `CHOSEN_FLEET_SEEDS` (default 200) and `CHOSEN_FLEET_FIRST` choose the seeds;
//! `CHOSEN_FLEET_SEED=n` runs seed `n` alone and prints what happened.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use super::backend::{SimBackend, SimServer};
use crate::singleton::{LeaderContext, RestartPolicy, Singleton, SingletonOptions};
use crate::{Election, Leadership, LockManager, ManagerOptions};

/// Singleton names every node runs.
const NAMES: [&str; 2] = ["s0", "s1"];
/// The election every node runs.
const ELECTION: &str = "e0";
/// Once the faults are over, the fleet has this long to settle; after it, no leader
/// changes and no child starts (nothing happens that would call for one).
const QUIET_AFTER: Duration = Duration::from_secs(10);
/// Fault steps of a run.
const STEPS: u32 = 30;
/// How long the fleet is left alone after the faults before liveness is checked.
const SETTLE: Duration = Duration::from_secs(30);
/// A shutdown returns within this (stop budget, lease timeout and slack: 2 + 3 + 5 s).
const SHUTDOWN_BOUND: Duration = Duration::from_secs(10);

struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        crate::table::next_random(&mut self.0) % n.max(1)
    }

    fn millis(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(lo + self.below(hi - lo + 1))
    }
}

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
    /// Each running node's view of the election.
    leaderships: BTreeMap<String, Leadership>,
    /// The election's leaders as last sampled, and how often they changed.
    leaders: Vec<String>,
    leader_changes: u64,
    /// From then on nothing may change (the faults are over and the fleet settled).
    quiet_from: Option<Instant>,
}

impl History {
    fn note(&mut self, line: impl std::fmt::Display) {
        let at = Instant::now();
        self.log.push(format!("{at:?} {line}"));
    }

    /// Another node's child of `name` whose lease is valid now.
    fn acting_elsewhere(&self, name: &str, node: &str) -> Option<(u64, String)> {
        self.running
            .get(name)?
            .iter()
            .find_map(|(id, n, ctx)| (n != node && ctx.is_valid()).then(|| (*id, n.clone())))
    }

    fn begin(&mut self, name: &'static str, node: &str, ctx: &LeaderContext) -> u64 {
        self.next_id += 1;
        let id = self.next_id;
        self.starts += 1;
        if let Some((other, on)) = self.acting_elsewhere(name, node) {
            self.violations.push(format!(
                "{name}: child {id} starts on {node} (token {}) while child {other} acts on {on}",
                ctx.fencing_token().get()
            ));
        } else if self
            .running
            .get(name)
            .is_some_and(|r| r.iter().any(|(_, n, _)| n != node))
        {
            self.running_overlaps += 1;
        }
        self.note(format!(
            "{name}: child {id} starts on {node}, token {}",
            ctx.fencing_token().get()
        ));
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
        if !ctx.is_valid() {
            return;
        }
        if let Some((other, on)) = self.acting_elsewhere(name, node) {
            self.violations.push(format!(
                "{name}: child {id} on {node} and child {other} on {on} act at once"
            ));
        }
    }

    fn end(&mut self, name: &'static str, id: u64) {
        if let Some(r) = self.running.get_mut(name) {
            r.retain(|(i, _, _)| *i != id);
        }
        self.note(format!("{name}: child {id} returned"));
    }

    /// Samples the election: at most one leader, and none new once quiet.
    fn sample_leaders(&mut self) {
        let leaders: Vec<String> = self
            .leaderships
            .iter()
            .filter(|(_, l)| l.is_leader())
            .map(|(n, _)| n.clone())
            .collect();
        if leaders.len() > 1 {
            self.violations
                .push(format!("{ELECTION}: {leaders:?} lead at once"));
        }
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

struct Node {
    id: String,
    manager: Option<LockManager>,
    singletons: Vec<Singleton>,
    election: Option<Election>,
}

fn options(node: &str) -> ManagerOptions {
    ManagerOptions::from_url("postgres://sim@localhost/sim")
        .expect("BUG: static URL parses")
        .node_id(node)
}

async fn start_node(
    server: &Arc<SimServer>,
    history: &Arc<Mutex<History>>,
    node: &mut Node,
    seed: u64,
) {
    let manager = LockManager::connect_with(
        options(&node.id),
        Arc::new(SimBackend::new(Arc::clone(server), seed)),
    )
    .await
    .expect("the simulated server is up");
    let stop_for = Duration::from_millis(seed % 400);
    node.singletons = NAMES
        .iter()
        .map(|name| {
            let history = Arc::clone(history);
            let node_id = node.id.clone();
            let name: &'static str = name;
            Singleton::start(
                &manager,
                name,
                SingletonOptions::default()
                    .restart(RestartPolicy::Always)
                    .shutdown_timeout(Duration::from_secs(1)),
                move |ctx: LeaderContext| {
                    let history = Arc::clone(&history);
                    let node_id = node_id.clone();
                    async move {
                        let id = history.lock().unwrap().begin(name, &node_id, &ctx);
                        // Ended when it returns, or when the singleton aborts it.
                        let _ended = Ended {
                            history: Arc::clone(&history),
                            name,
                            id,
                        };
                        loop {
                            tokio::select! {
                                biased;
                                () = ctx.cancelled() => break,
                                () = tokio::time::sleep(Duration::from_millis(10)) => {
                                    history.lock().unwrap().tick(name, &node_id, id, &ctx);
                                }
                            }
                        }
                        // Stopping takes a while.
                        tokio::time::sleep(stop_for).await;
                        Ok::<(), std::io::Error>(())
                    }
                },
            )
            .expect("valid singleton")
        })
        .collect();
    let election = Election::start(&manager, ELECTION).expect("valid election");
    history
        .lock()
        .unwrap()
        .leaderships
        .insert(node.id.clone(), election.leadership());
    node.election = Some(election);
    node.manager = Some(manager);
}

/// Shuts a node down and checks the bound and that none of its children runs on.
async fn stop_node(history: &Arc<Mutex<History>>, node: &mut Node) {
    let Some(manager) = node.manager.take() else {
        return;
    };
    let singletons = std::mem::take(&mut node.singletons);
    let election = node.election.take();
    let ended = tokio::time::timeout(SHUTDOWN_BOUND, async {
        for s in &singletons {
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

struct Outcome {
    violations: Vec<String>,
    starts: u64,
    running_overlaps: u64,
    log: Vec<String>,
}

/// The server ends a session idle this long (`server_release_after`, 7 s by default):
/// longer than the lease timeout (3 s) plus the stop budget, the timing invariant that
/// keeps a cut-off holder from acting once another node is granted.
const RELEASE_AFTER: Duration = Duration::from_secs(7);

async fn run(seed: u64, release_after: Duration) -> Outcome {
    let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    let server = SimServer::new(seed);
    // As chosen sets its session up: the server ends a silent session after
    // `server_release_after` (7 s by default).
    server.reap_idle(release_after, Duration::from_millis(250));
    let history = Arc::new(Mutex::new(History::default()));
    let count = 3 + rng.below(2) as usize;
    let mut nodes: Vec<Node> = (0..count)
        .map(|i| Node {
            id: format!("n{i}"),
            manager: None,
            singletons: Vec::new(),
            election: None,
        })
        .collect();
    for (i, node) in nodes.iter_mut().enumerate() {
        start_node(&server, &history, node, seed ^ (i as u64 + 1)).await;
    }
    let sampler = tokio::spawn({
        let history = Arc::clone(&history);
        async move {
            loop {
                tokio::time::sleep(Duration::from_millis(10)).await;
                history.lock().unwrap().sample_leaders();
            }
        }
    });
    for step in 0..STEPS {
        tokio::time::sleep(rng.millis(0, 2_000)).await;
        let n = rng.below(count as u64) as usize;
        let node = &mut nodes[n];
        match rng.below(10) {
            0..=4 => {
                for pid in server.backends_of(&node.id) {
                    history
                        .lock()
                        .unwrap()
                        .note(format!("FAULT terminate backend {pid} of {}", node.id));
                    server.terminate(pid);
                }
            }
            5 | 6 => {
                history
                    .lock()
                    .unwrap()
                    .note(format!("FAULT restart {}", node.id));
                stop_node(&history, node).await;
                tokio::time::sleep(rng.millis(0, 3_000)).await;
                let node_seed = seed ^ (u64::from(step) << 8) ^ n as u64;
                start_node(&server, &history, node, node_seed).await;
            }
            7 if rng.below(3) == 0 => {
                if let Some(e) = &node.election {
                    history
                        .lock()
                        .unwrap()
                        .note(format!("step down {ELECTION} on {}", node.id));
                    e.step_down();
                }
            }
            7 => {
                if let Some(s) = node.singletons.get(rng.below(NAMES.len() as u64) as usize) {
                    history.lock().unwrap().note(format!(
                        "step down {} on {}",
                        s.leadership().name(),
                        node.id
                    ));
                    s.step_down();
                }
            }
            8 => {
                let to = format!("n{}", rng.below(count as u64));
                if let Some(s) = node.singletons.get(rng.below(NAMES.len() as u64) as usize) {
                    history.lock().unwrap().note(format!(
                        "hand over {} from {} to {to}",
                        s.leadership().name(),
                        node.id
                    ));
                    s.hand_over_to(&to);
                }
            }
            _ => {
                let cut_for = rng.millis(500, 12_000);
                history.lock().unwrap().note(format!(
                    "FAULT black-hole {} for {} ms",
                    node.id,
                    cut_for.as_millis()
                ));
                server.cut(&node.id, true);
                tokio::time::sleep(cut_for).await;
                server.cut(&node.id, false);
                history.lock().unwrap().note(format!("{} healed", node.id));
            }
        }
    }
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
            let acting = h
                .running
                .get(name)
                .map_or(0, |r| r.iter().filter(|(_, _, ctx)| ctx.is_valid()).count());
            if acting != 1 {
                h.violations.push(format!(
                    "{name}: {acting} acting children once settled (want 1)"
                ));
            }
        }
    }
    for node in &mut nodes {
        stop_node(&history, node).await;
    }
    sampler.abort();
    let mut violations = server.violations();
    let mut h = history.lock().unwrap();
    violations.append(&mut h.violations);
    Outcome {
        violations,
        starts: h.starts,
        running_overlaps: h.running_overlaps,
        log: std::mem::take(&mut h.log),
    }
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok()?.parse().ok()
}

fn run_seed(seed: u64, release_after: Duration) -> Outcome {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("a runtime")
        .block_on(run(seed, release_after))
}

/// The acting check sees two children act at once when the server ends a silent
/// session before its holder's lease has expired (2 s against a 3 s lease timeout):
/// the check can fail, and fails where the timing invariant is broken.
#[test]
fn the_fleet_check_fails_when_the_server_releases_a_session_before_its_lease_expires() {
    let failing: Vec<u64> = (0..20)
        .filter(|seed| {
            run_seed(*seed, Duration::from_secs(2))
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

#[test]
fn the_fleet_holds_over_many_seeds() {
    let replay = env_u64("CHOSEN_FLEET_SEED");
    let (first, count) = match replay {
        Some(seed) => (seed, 1),
        None => (
            env_u64("CHOSEN_FLEET_FIRST").unwrap_or(0),
            env_u64("CHOSEN_FLEET_SEEDS").unwrap_or(200),
        ),
    };
    let started = std::time::Instant::now();
    let mut failures = Vec::new();
    let (mut starts, mut overlaps) = (0, 0);
    for seed in first..first + count {
        let out = run_seed(seed, RELEASE_AFTER);
        if replay.is_some() {
            for line in &out.log {
                eprintln!("{line}");
            }
        }
        starts += out.starts;
        overlaps += out.running_overlaps;
        if !out.violations.is_empty() {
            failures.push((seed, out.violations));
        }
    }
    eprintln!(
        "fleet: seeds {first}..{}, {:.1} s: {starts} child starts, {overlaps} starts while \
         another node's child was still stopping, {} failing seeds",
        first + count,
        started.elapsed().as_secs_f64(),
        failures.len()
    );
    if let Some((seed, violations)) = failures.first() {
        let seeds: Vec<u64> = failures.iter().map(|(s, _)| *s).collect();
        panic!(
            "the fleet simulation failed with seeds {seeds:?}; first, seed {seed} (replay with \
             CHOSEN_FLEET_SEED={seed}):\n{}",
            violations.join("\n")
        );
    }
}
