//! The fault-injection runner: N `node` processes with M singletons each, every node
//! behind its own fault proxy, and a seeded nemesis that injects random faults for a
//! fixed time; then the [`checker`](crate::checker) judges the history.
//!
//! Knobs (environment): `CHOSEN_NEMESIS_SECS` (default 60), `CHOSEN_NEMESIS_SEED`
//! (default: from the clock; always printed), `CHOSEN_NEMESIS_NODES` (5),
//! `CHOSEN_NEMESIS_SINGLETONS` (10).

use std::io::{self, BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::checker::{Event, FaultRecord, Verdict, check};
use crate::{FaultProxy, PgCluster, ProxyMode, connect_admin, example_binary, signal};

/// How a run is set up.
#[derive(Debug, Clone)]
pub struct NemesisConfig {
    /// Node processes.
    pub nodes: usize,
    /// Singletons every node runs.
    pub singletons: usize,
    /// How long faults are injected.
    pub duration: Duration,
    /// The random seed (print it; a failing run replays with the same seed).
    pub seed: u64,
    /// The nodes' `server_release_after` (their default, 7 s).
    pub server_release: Duration,
}

impl NemesisConfig {
    /// From the `CHOSEN_NEMESIS_*` environment variables, with the defaults above.
    #[must_use]
    pub fn from_env() -> Self {
        let num = |k: &str, d: u64| {
            std::env::var(k)
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(d)
        };
        let clock_seed = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64);
        Self {
            nodes: num("CHOSEN_NEMESIS_NODES", 5) as usize,
            singletons: num("CHOSEN_NEMESIS_SINGLETONS", 10) as usize,
            duration: Duration::from_secs(num("CHOSEN_NEMESIS_SECS", 60)),
            seed: num("CHOSEN_NEMESIS_SEED", clock_seed),
            server_release: Duration::from_secs(7),
        }
    }
}

/// The faults, by the names reports use.
pub const FAULT_KINDS: [&str; 10] = [
    "sigkill",
    "sigstop_short",
    "sigstop_long",
    "blackhole",
    "cut",
    "terminate_backend",
    "restart_fast",
    "restart_immediate",
    "server_down",
    "sigterm",
];

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    fn millis(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(lo + self.below(hi - lo + 1))
    }
}

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

struct Node {
    id: String,
    proxy: FaultProxy,
    url: String,
    child: Option<Child>,
    instance: u32,
}

/// Runs the nemesis and returns the checker's verdict with the faults injected.
///
/// # Errors
///
/// When the cluster, a proxy or a node process cannot be started.
pub async fn run(config: &NemesisConfig) -> io::Result<(Verdict, Vec<FaultRecord>)> {
    let cluster = Arc::new(Mutex::new(PgCluster::start_local()?));
    let (direct_url, port) = {
        let c = cluster.lock().expect("cluster lock");
        (c.url(), c.port().expect("local cluster"))
    };
    let binary = example_binary("node")?;
    let events: Arc<Mutex<Vec<Event>>> = Arc::default();
    let singletons: Vec<String> = (0..config.singletons).map(|i| format!("s{i}")).collect();
    let mut nodes = Vec::new();
    for i in 0..config.nodes {
        let proxy = FaultProxy::start(([127, 0, 0, 1], port).into()).await?;
        let url = proxy.url(&direct_url, port);
        let mut node = Node {
            id: format!("n{i}"),
            proxy,
            url,
            child: None,
            instance: 0,
        };
        spawn(&binary, &mut node, &singletons, &events)?;
        nodes.push(node);
    }
    tokio::time::sleep(Duration::from_secs(3)).await;

    let mut rng = Rng(config.seed | 1);
    let mut faults = Vec::new();
    let started = std::time::Instant::now();
    while started.elapsed() < config.duration {
        // A node that died on its own is restarted (and shows in the history).
        for node in &mut nodes {
            if node
                .child
                .as_mut()
                .is_some_and(|c| matches!(c.try_wait(), Ok(Some(_))))
            {
                spawn(&binary, node, &singletons, &events)?;
            }
        }
        let kind = FAULT_KINDS[rng.below(FAULT_KINDS.len() as u64) as usize];
        // Mostly aim at nodes that hold something, so faults cause takeovers.
        let holders = holders(&events.lock().expect("events lock"));
        let candidates: Vec<usize> = (0..nodes.len())
            .filter(|i| holders.contains(&nodes[*i].id))
            .collect();
        let target = if !candidates.is_empty() && rng.below(10) < 8 {
            candidates[rng.below(candidates.len() as u64) as usize]
        } else {
            rng.below(nodes.len() as u64) as usize
        };
        let at_us = now_us();
        let mut node_id = Some(nodes[target].id.clone());
        match kind {
            "sigkill" => {
                kill(&mut nodes[target]);
                tokio::time::sleep(rng.millis(500, 2000)).await;
                spawn(&binary, &mut nodes[target], &singletons, &events)?;
            }
            "sigstop_short" | "sigstop_long" => {
                let pause = if kind == "sigstop_short" {
                    rng.millis(500, 2500)
                } else {
                    config.server_release + rng.millis(1000, 4000)
                };
                if let Some(pid) = nodes[target].child.as_ref().map(Child::id) {
                    let _ = signal(pid, "STOP");
                    tokio::time::sleep(pause).await;
                    let _ = signal(pid, "CONT");
                }
            }
            "blackhole" => {
                nodes[target].proxy.set(ProxyMode::BlackHole);
                tokio::time::sleep(rng.millis(2000, 10_000)).await;
                nodes[target].proxy.set(ProxyMode::Pass);
            }
            "cut" => {
                nodes[target].proxy.set(ProxyMode::Cut);
                tokio::time::sleep(rng.millis(100, 1000)).await;
                nodes[target].proxy.set(ProxyMode::Pass);
            }
            "terminate_backend" => {
                if let Ok(admin) = connect_admin(&direct_url).await {
                    let _ = admin
                        .execute(
                            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1",
                            &[&nodes[target].id],
                        )
                        .await;
                }
            }
            "restart_fast" | "restart_immediate" | "server_down" => {
                node_id = None;
                let cluster = Arc::clone(&cluster);
                let down = rng.millis(2000, 5000);
                tokio::task::spawn_blocking(move || -> io::Result<()> {
                    let mut c = cluster.lock().expect("cluster lock");
                    match kind {
                        "restart_fast" => c.restart("fast"),
                        "restart_immediate" => c.restart("immediate"),
                        _ => {
                            c.stop("fast")?;
                            std::thread::sleep(down);
                            c.start_again()
                        }
                    }
                })
                .await
                .map_err(io::Error::other)??;
            }
            "sigterm" => {
                if let Some(child) = nodes[target].child.as_mut() {
                    let _ = signal(child.id(), "TERM");
                    for _ in 0..100 {
                        if matches!(child.try_wait(), Ok(Some(_))) {
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
                kill(&mut nodes[target]);
                tokio::time::sleep(rng.millis(200, 1000)).await;
                spawn(&binary, &mut nodes[target], &singletons, &events)?;
            }
            other => unreachable!("unknown fault {other}"),
        }
        faults.push(FaultRecord {
            kind,
            node: node_id,
            at_us,
            healed_us: now_us(),
        });
        tokio::time::sleep(rng.millis(1500, 3500)).await;
    }

    // Heal, let the fleet settle, then stop every node gracefully.
    for node in &nodes {
        node.proxy.set(ProxyMode::Pass);
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    for node in &mut nodes {
        if let Some(child) = node.child.as_mut() {
            let _ = signal(child.id(), "TERM");
        }
    }
    for node in &mut nodes {
        if let Some(child) = node.child.as_mut() {
            for _ in 0..100 {
                if matches!(child.try_wait(), Ok(Some(_))) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        kill(node);
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let events = events.lock().expect("events lock").clone();
    Ok((check(&events, &faults, config.server_release), faults))
}

/// Nodes whose latest process instance runs at least one child right now.
fn holders(events: &[Event]) -> std::collections::HashSet<String> {
    let mut latest: std::collections::HashMap<&str, u32> = std::collections::HashMap::new();
    for e in events {
        let i = latest.entry(&e.node).or_insert(e.instance);
        *i = (*i).max(e.instance);
    }
    let mut running: std::collections::HashMap<(&str, &str), bool> =
        std::collections::HashMap::new();
    for e in events {
        if latest.get(e.node.as_str()) != Some(&e.instance) {
            continue;
        }
        if let Some(s) = &e.singleton {
            match e.event.as_str() {
                "child_started" => {
                    running.insert((&e.node, s), true);
                }
                "child_stopped" | "lease_lost" => {
                    running.insert((&e.node, s), false);
                }
                _ => {}
            }
        }
    }
    running
        .into_iter()
        .filter(|(_, on)| *on)
        .map(|((n, _), _)| n.to_owned())
        .collect()
}

fn spawn(
    binary: &PathBuf,
    node: &mut Node,
    singletons: &[String],
    events: &Arc<Mutex<Vec<Event>>>,
) -> io::Result<()> {
    kill(node);
    node.instance += 1;
    let mut cmd = Command::new(binary);
    cmd.args(["--node-id", &node.id, "--poll-ms", "200", "--tick-ms", "50"]);
    for s in singletons {
        cmd.args(["--singleton", s]);
    }
    let mut child = cmd
        .env("DATABASE_URL", &node.url)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?;
    let stdout = child.stdout.take().expect("piped stdout");
    let (events, instance) = (Arc::clone(events), node.instance);
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(e) = Event::parse(&line, instance) {
                events.lock().expect("events lock").push(e);
            }
        }
    });
    node.child = Some(child);
    Ok(())
}

fn kill(node: &mut Node) {
    if let Some(mut child) = node.child.take() {
        let _ = signal(child.id(), "CONT");
        let _ = child.kill();
        let _ = child.wait();
    }
}
