//! The fault-injection runner: N `node` processes with M singletons each, every node
//! behind its own fault proxy, and a seeded nemesis that injects random faults for a
//! fixed time; then the [`checker`](crate::checker) judges the history.
//!
//! Knobs (environment): `CHOSEN_NEMESIS_SECS` (default 60), `CHOSEN_NEMESIS_SEED`
//! (default: from the clock; always printed), `CHOSEN_NEMESIS_NODES` (5),
//! `CHOSEN_NEMESIS_SINGLETONS` (10), `CHOSEN_NEMESIS_GROUP_MEMBERS` (20: a singleton
//! group every node runs, whose placement is judged over the whole run, see
//! [`Placement`](crate::checker::Placement), and once more at the end),
//! `CHOSEN_NEMESIS_HISTORY` (a file to write the history to, for reading after a
//! surprising run).
//!
//! The nodes' server is a throwaway local cluster, with a streaming standby for the
//! failover. With `DATABASE_URL` set, it is that server instead (your own): the faults
//! that need a local cluster (restarts, a stopped server, a failover) are left out of
//! the deck, and so is `terminate_backend` when the role may not end the nodes'
//! sessions; the run says which on stderr as it starts (see [`Deck`]). The nodes reach
//! it through loopback proxies (cuts, black holes, latency), so it must be a TCP
//! server they reach without TLS.
//!
//! A run cannot pass by doing nothing: faults are drawn from a shuffled deck, so every
//! kind of the deck is injected at least once (the run goes on past its duration until
//! the first deck is dealt); every signal, termination and restart must succeed; and the
//! [`Report`] lists what went wrong outside the contract: a node that exited on its
//! own, a panic on a node's stderr, an output line that is not an event.

use std::collections::{HashMap, HashSet};
use std::io::{self, BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::checker::{Event, FaultRecord, PlacementSpec, Timing, Verdict, check_with};
use crate::{FaultProxy, PgCluster, ProxyMode, connect_admin, monotonic_us, signal, test_binary};

/// How a run is set up.
#[derive(Debug, Clone)]
pub struct NemesisConfig {
    /// Node processes.
    pub nodes: usize,
    /// Singletons every node runs.
    pub singletons: usize,
    /// Members of the singleton group every node runs (`nem-0` ..), 0 for none.
    pub group_members: usize,
    /// How long faults are injected.
    pub duration: Duration,
    /// The random seed (print it; a failing run replays with the same seed).
    pub seed: u64,
    /// The nodes' `server_release_after` and `lease_timeout` (their defaults).
    pub timing: Timing,
    /// The nodes hold lease rows (`node --lease-rows`) on pools through a PgBouncer in
    /// transaction mode in front of the local cluster, each node's pool behind its own
    /// proxy (see [`Deck::lease_rows`]).
    pub lease_rows: bool,
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
            group_members: num("CHOSEN_NEMESIS_GROUP_MEMBERS", 20) as usize,
            duration: Duration::from_secs(num("CHOSEN_NEMESIS_SECS", 60)),
            seed: num("CHOSEN_NEMESIS_SEED", clock_seed),
            timing: Timing::default(),
            lease_rows: num("CHOSEN_NEMESIS_LEASE_ROWS", 0) != 0,
        }
    }
}

/// The faults, by the names reports use.
///
/// A run deals them all against a local cluster; against `DATABASE_URL`, those of
/// [`LOCAL_ONLY_KINDS`] (and `terminate_backend` when the role may not) are left out
/// (see [`Deck`]).
pub const FAULT_KINDS: [&str; 12] = [
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
    "latency",
    "failover",
];

/// The faults that need a local cluster: they restart or stop the server, or promote
/// its standby.
pub const LOCAL_ONLY_KINDS: [&str; 4] = [
    "restart_fast",
    "restart_immediate",
    "server_down",
    "failover",
];

/// The fault kinds a run deals, and those it leaves out with the reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Deck {
    /// The kinds dealt, in [`FAULT_KINDS`] order; each is injected at least once.
    pub kinds: Vec<&'static str>,
    /// The kinds left out, each with why.
    pub left_out: Vec<(&'static str, String)>,
}

impl Deck {
    /// Every kind: a local cluster.
    #[must_use]
    pub fn full() -> Self {
        Self {
            kinds: FAULT_KINDS.to_vec(),
            left_out: Vec::new(),
        }
    }

    /// The kinds for an external server (`DATABASE_URL`): all but [`LOCAL_ONLY_KINDS`],
    /// and but `terminate_backend` unless `may_terminate` is `Ok` (its error says why).
    #[must_use]
    pub fn external(may_terminate: &Result<(), String>) -> Self {
        let mut deck = Self::full();
        deck.kinds.retain(|k| !LOCAL_ONLY_KINDS.contains(k));
        for kind in LOCAL_ONLY_KINDS {
            deck.left_out.push((
                kind,
                "they need a local cluster: they restart, stop or fail over the server".to_owned(),
            ));
        }
        if let Err(why) = may_terminate {
            deck.kinds.retain(|k| *k != "terminate_backend");
            deck.left_out.push(("terminate_backend", why.clone()));
        }
        deck
    }

    /// The kinds for nodes holding lease rows through a transaction pooler: the
    /// process faults, black holes, and the server behind the pooler restarted,
    /// stopped for a while, or failed over to its standby (the server's address, which
    /// the pooler connects to, moved to the promoted one). Left out: cuts (a pool opens
    /// a new connection and the session goes on: no loss to check), `terminate_backend`
    /// (no session of its own to end) and latency (the pooler's queue adds its own).
    #[must_use]
    pub fn lease_rows() -> Self {
        let kinds = [
            "sigkill",
            "sigstop_short",
            "sigstop_long",
            "blackhole",
            "restart_fast",
            "restart_immediate",
            "server_down",
            "sigterm",
            "failover",
        ];
        let mut deck = Self::full();
        deck.kinds.retain(|k| kinds.contains(k));
        let why = [
            (
                "cut",
                "a pool opens a new connection and the session goes on",
            ),
            (
                "terminate_backend",
                "a lease session has no backend of its own",
            ),
            ("latency", "not yet judged through the pooler's queue"),
        ];
        for (kind, reason) in why {
            deck.left_out.push((kind, reason.to_owned()));
        }
        deck
    }

    /// Whether `kind` is dealt.
    #[must_use]
    pub fn deals(&self, kind: &str) -> bool {
        self.kinds.contains(&kind)
    }
}

impl std::fmt::Display for Deck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "faults {}", self.kinds.join(", "))?;
        // Kinds left out for one reason are named together.
        let mut groups: Vec<(Vec<&str>, &str)> = Vec::new();
        for (kind, why) in &self.left_out {
            match groups.last_mut() {
                Some((kinds, last)) if *last == why.as_str() => kinds.push(kind),
                _ => groups.push((vec![kind], why)),
            }
        }
        for (i, (kinds, why)) in groups.iter().enumerate() {
            let lead = if i == 0 { "; left out: " } else { "; " };
            write!(f, "{lead}{} ({why})", kinds.join(", "))?;
        }
        Ok(())
    }
}

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

    /// Every fault kind of `kinds` once, in a random order.
    fn deck(&mut self, kinds: &[&'static str]) -> Vec<&'static str> {
        let mut deck = kinds.to_vec();
        for i in (1..deck.len()).rev() {
            deck.swap(i, self.below(i as u64 + 1) as usize);
        }
        deck
    }
}

/// What a run produced.
#[derive(Debug)]
pub struct Report {
    /// The fault kinds the run dealt (all of them against a local cluster).
    pub deck: Deck,
    /// The checker's verdict on the history.
    pub verdict: Verdict,
    /// The faults injected.
    pub faults: Vec<FaultRecord>,
    /// Everything that went wrong outside the history: unexpected exits, panics and
    /// other stderr lines, unparsable output. Must be empty.
    pub problems: Vec<String>,
}

type Shared<T> = Arc<Mutex<T>>;

struct Node {
    id: String,
    proxy: FaultProxy,
    url: String,
    child: Option<Child>,
    instance: u32,
}

/// What every node runs: singletons by name, and a group of members.
struct Spec {
    names: Vec<String>,
    group_members: usize,
    lease_rows: bool,
}

/// The name of the group every node runs (its members are `nem-0` ..).
const GROUP: &str = "nem";

/// How long a node gets to shut down gracefully (its stop budget is a few seconds).
const SHUTDOWN_LIMIT: Duration = Duration::from_secs(15);

/// Runs the nemesis and returns the checker's verdict with the faults injected.
///
/// # Errors
///
/// When the cluster, a proxy or a node process cannot be started, or a fault cannot be
/// injected (a signal, a backend termination or a restart failed); with `DATABASE_URL`,
/// when it is not a TCP server.
pub async fn run(config: &NemesisConfig) -> io::Result<Report> {
    // `DATABASE_URL` when set, else a local cluster.
    let cluster = Arc::new(Mutex::new(PgCluster::start()?));
    let (mut direct_url, port) = {
        let c = cluster.lock().expect("cluster lock");
        (c.url(), c.port())
    };
    // Where the proxies forward to, and the deck: everything against a local cluster.
    // Lease rows: through a transaction pooler in front of the local cluster, which
    // the proxies forward to (its URL's port is the one they replace). The pooler
    // reaches the server through a proxy of its own, the server's address, which a
    // failover moves to the promoted standby (as a virtual IP or a DNS name would).
    let mut server_front = None;
    let bouncer = match (config.lease_rows, port) {
        (true, Some(server_port)) => {
            let address = FaultProxy::start(([127, 0, 0, 1], server_port).into()).await?;
            let c = cluster.lock().expect("cluster lock");
            let bouncer = crate::PgBouncer::start_to(&c, address.addr().port(), "transaction", 8)?;
            server_front = Some(address);
            Some(bouncer)
        }
        (true, None) => {
            return Err(io::Error::other(
                "the lease-row nemesis needs a local cluster (it starts a PgBouncer in front of it); unset DATABASE_URL",
            ));
        }
        (false, _) => None,
    };
    let port = match &bouncer {
        Some(b) => {
            direct_url = b.url();
            Some(b.port())
        }
        None => port,
    };
    let (upstream, deck) = match port {
        Some(port) if bouncer.is_some() => {
            (SocketAddr::from(([127, 0, 0, 1], port)), Deck::lease_rows())
        }
        Some(port) => (SocketAddr::from(([127, 0, 0, 1], port)), Deck::full()),
        None => {
            let upstream = server_address(&direct_url).await?;
            let deck = Deck::external(&may_terminate(&direct_url).await);
            eprintln!("nemesis: against DATABASE_URL ({upstream}): {deck}");
            (upstream, deck)
        }
    };
    // A streaming standby, promoted by the `failover` fault (and a new one made of the
    // new primary after each).
    let mut standby = if deck.deals("failover") {
        Some(cluster.lock().expect("cluster lock").start_standby()?)
    } else {
        None
    };
    // The standby streams through a proxy of its own, which the failover black-holes
    // for a while before the primary dies, so that the promoted server lacks the last
    // commits (as an asynchronous standby can: lease rows' renewals and takeovers,
    // advisory locks' token draws) and the new term's hold is what keeps holders
    // apart.
    let replication = match &standby {
        Some(s) => {
            let primary = cluster.lock().expect("cluster lock").port();
            let front =
                FaultProxy::start(([127, 0, 0, 1], primary.expect("a local cluster")).into())
                    .await?;
            stream_through(s, &front).await?;
            Some(front)
        }
        _ => None,
    };
    let binary = test_binary("node")?;
    let events: Shared<Vec<Event>> = Arc::default();
    let problems: Shared<Vec<String>> = Arc::default();
    let singletons = Spec {
        names: (0..config.singletons).map(|i| format!("s{i}")).collect(),
        group_members: config.group_members,
        lease_rows: config.lease_rows,
    };
    // Every name that must be held: the singletons and the group's members.
    let all_held = config.singletons + config.group_members;
    let mut nodes = Vec::new();
    for i in 0..config.nodes {
        let proxy = FaultProxy::start(upstream).await?;
        let (url, id) = match port {
            Some(port) => (proxy.url(&direct_url, port), format!("n{i}")),
            // Another server's sessions may be called `n0`: `terminate_backend` ends
            // the sessions named after its target.
            None => (
                proxied_url(&direct_url, proxy.addr())?,
                format!("n{i}-{}", std::process::id()),
            ),
        };
        let mut node = Node {
            id,
            proxy,
            url,
            child: None,
            instance: 0,
        };
        spawn(&binary, &mut node, &singletons, &events, &problems)?;
        nodes.push(node);
    }
    wait_all_held(&events, all_held, Duration::from_secs(30)).await;

    let mut rng = Rng(config.seed | 1);
    let mut faults = Vec::new();
    let mut dealt_now = Vec::new();
    let mut dealt = 0;
    let started = std::time::Instant::now();
    while started.elapsed() < config.duration || dealt < deck.kinds.len() {
        for node in &mut nodes {
            if let Some(status) = node
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                problems.lock().expect("problems lock").push(format!(
                    "{}#{} exited on its own ({status})",
                    node.id, node.instance
                ));
                node.child = None;
                spawn(&binary, node, &singletons, &events, &problems)?;
            }
        }
        if dealt_now.is_empty() {
            dealt_now = rng.deck(&deck.kinds);
        }
        let kind = dealt_now.pop().expect("BUG: dealt from a full deck");
        dealt += 1;
        // Aim at nodes that hold something, so that every fault takes a lease away.
        // Right after a fault the fleet may hold nothing yet (a lease row is taken over
        // only once it expired, ~7 s at the defaults): wait, bounded, for a holder to
        // aim at; none by then is a problem of its own.
        let running_now: Vec<(String, u32)> =
            nodes.iter().map(|n| (n.id.clone(), n.instance)).collect();
        let limit = config.timing.release + Duration::from_secs(10);
        let candidates = wait_for_holders(&events, &running_now, limit).await;
        let target = if candidates.is_empty() {
            problems.lock().expect("problems lock").push(format!(
                "no node held anything for {limit:?} before a {kind} fault"
            ));
            rng.below(nodes.len() as u64) as usize
        } else {
            candidates[rng.below(candidates.len() as u64) as usize]
        };
        let mut promoted_to = None;
        let node = &mut nodes[target];
        let pid = node
            .child
            .as_ref()
            .map(Child::id)
            .expect("BUG: every node runs");
        let mut record = FaultRecord {
            kind,
            target: Some((node.id.clone(), node.instance)),
            at_us: monotonic_us(),
            healed_us: 0,
        };
        match kind {
            "sigkill" => {
                record.at_us = monotonic_us();
                signal(pid, "KILL")?;
                reap(node, Duration::from_secs(5))?;
                record.healed_us = monotonic_us();
                tokio::time::sleep(rng.millis(500, 2000)).await;
                spawn(&binary, node, &singletons, &events, &problems)?;
            }
            "sigstop_short" | "sigstop_long" => {
                let pause = if kind == "sigstop_short" {
                    rng.millis(500, 2500)
                } else {
                    config.timing.release + rng.millis(1000, 4000)
                };
                record.at_us = monotonic_us();
                signal(pid, "STOP")?;
                tokio::time::sleep(pause).await;
                record.healed_us = monotonic_us();
                signal(pid, "CONT")?;
            }
            "blackhole" => {
                node.proxy.set(ProxyMode::BlackHole);
                tokio::time::sleep(rng.millis(2000, 10_000)).await;
                node.proxy.set(ProxyMode::Pass);
                record.healed_us = monotonic_us();
            }
            "cut" => {
                node.proxy.set(ProxyMode::Cut);
                tokio::time::sleep(rng.millis(100, 1000)).await;
                node.proxy.set(ProxyMode::Pass);
                record.healed_us = monotonic_us();
            }
            "terminate_backend" => {
                let admin = connect_admin(&direct_url).await.map_err(io::Error::other)?;
                record.at_us = monotonic_us();
                let rows = admin
                    .query(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1",
                        &[&node.id],
                    )
                    .await
                    .map_err(io::Error::other)?;
                let terminated = rows.iter().filter(|r| r.get::<_, bool>(0)).count();
                if terminated == 0 {
                    return Err(io::Error::other(format!(
                        "terminate_backend: no session of {} to terminate",
                        node.id
                    )));
                }
                record.healed_us = monotonic_us();
            }
            "restart_fast" | "restart_immediate" | "server_down" => {
                record.target = None;
                let cluster = Arc::clone(&cluster);
                let down = rng.millis(2000, 5000);
                record.at_us = monotonic_us();
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
                record.healed_us = monotonic_us();
                // A new primary term grants nothing for `term_grant_delay` (6 s at the
                // nodes' defaults): let the fleet lead again before the next fault, so
                // that it too takes a lease away (after the nodes reported the loss).
                tokio::time::sleep(Duration::from_millis(1500)).await;
                wait_all_held(&events, all_held, Duration::from_secs(30)).await;
            }
            "latency" => {
                // A slow database, steadily below the bound the heartbeat tolerates
                // (lease timeout - heartbeat interval, 2 s at the nodes' defaults) and
                // below the warning (half the lease timeout): the holder keeps leading.
                // At most a third of the lease timeout (1 s at the defaults): half the
                // bound, leaving a loaded machine room.
                let most = (config.timing.lease_timeout.as_millis() as u64 / 3).max(201);
                let rtt = rng.millis(200, most);
                record.at_us = monotonic_us();
                node.proxy.set(ProxyMode::Latency(rtt));
                tokio::time::sleep(rng.millis(3000, 8000)).await;
                node.proxy.set(ProxyMode::Pass);
                record.healed_us = monotonic_us();
            }
            "failover" => {
                // The primary stops serving and its standby is promoted; then every
                // node's address leads to the promoted server (as a DNS name or a
                // virtual IP would, below). No node is told: each finds its session
                // gone and reconnects, and grants on the new server wait out its
                // term's hold.
                record.target = None;
                let old = Arc::clone(&cluster);
                let promoted = standby
                    .take()
                    .expect("BUG: a standby is made after every failover");
                // The targeted holder is cut off first (its sockets silent): it never
                // hears of the failover and trusts its leases until its own deadline,
                // which the promoted server's term hold must outlast.
                // The standby first falls behind: what the primary
                // commits from now on is lost, and the primary then dies at once.
                let lost = match &replication {
                    Some(front) => {
                        front.set(ProxyMode::BlackHole);
                        // Long enough (at the defaults: rows live 7 s, a lease is
                        // trusted 3 s) that a row the promoted server has can expire
                        // before its cut-off holder stops trusting it: only the new
                        // term's hold keeps the next grant back.
                        tokio::time::sleep(rng.millis(6000, 9000)).await;
                        true
                    }
                    None => false,
                };
                // Where the primary's WAL ends, to check that the standby lacks some.
                let primary_lsn: Option<String> = if lost {
                    let admin = connect_admin(&direct_primary_url(&cluster))
                        .await
                        .map_err(io::Error::other)?;
                    Some(
                        admin
                            .query_one("SELECT pg_current_wal_lsn()::text", &[])
                            .await
                            .map_err(io::Error::other)?
                            .get(0),
                    )
                } else {
                    None
                };
                node.proxy.set(ProxyMode::BlackHole);
                record.at_us = monotonic_us();
                let mode = if lost { "immediate" } else { "fast" };
                tokio::task::spawn_blocking(move || old.lock().expect("cluster lock").stop(mode))
                    .await
                    .map_err(io::Error::other)??;
                let admin = connect_admin(&promoted.url())
                    .await
                    .map_err(io::Error::other)?;
                if let Some(primary_lsn) = primary_lsn {
                    let behind: f64 = admin
                        .query_one(
                            "SELECT pg_wal_lsn_diff($1::text::pg_lsn, pg_last_wal_receive_lsn())::float8",
                            &[&primary_lsn],
                        )
                        .await
                        .map_err(io::Error::other)?
                        .get(0);
                    if behind <= 0.0 {
                        problems.lock().expect("problems lock").push(
                            "failover: the standby had received all of the primary's WAL (nothing was lost)"
                                .to_owned(),
                        );
                    }
                }
                let done: bool = admin
                    .query_one("SELECT pg_promote(true, 60)", &[])
                    .await
                    .map_err(io::Error::other)?
                    .get(0);
                if !done {
                    return Err(io::Error::other("failover: pg_promote did not finish"));
                }
                promoted_to = Some(promoted);
            }
            "sigterm" => {
                record.at_us = monotonic_us();
                signal(pid, "TERM")?;
                let status = reap(node, SHUTDOWN_LIMIT)?;
                if !status.success() {
                    problems.lock().expect("problems lock").push(format!(
                        "{}#{} did not shut down cleanly on SIGTERM ({status})",
                        record.target.as_ref().expect("BUG: node fault").0,
                        node.instance
                    ));
                }
                record.healed_us = monotonic_us();
                tokio::time::sleep(rng.millis(200, 1000)).await;
                spawn(&binary, node, &singletons, &events, &problems)?;
            }
            other => unreachable!("unknown fault {other}"),
        }
        if let Some(promoted) = promoted_to {
            let new_port = promoted.port().expect("local cluster");
            // The server's address moves: behind a pooler, the pooler's; else each
            // node's.
            if let Some(address) = &server_front {
                address.set_upstream(([127, 0, 0, 1], new_port).into());
            }
            for (i, n) in nodes.iter().enumerate() {
                if server_front.is_none() {
                    n.proxy.set_upstream(([127, 0, 0, 1], new_port).into());
                }
                // The targeted holder stays cut off past its lease's
                // deadline, acting on what it last renewed while the others reach
                // the promoted server, whose rows lack the last seconds.
                if i != target || replication.is_none() {
                    n.proxy.set(ProxyMode::Pass);
                }
            }
            if replication.is_some() {
                let until = record.at_us
                    + (config.timing.lease_timeout + Duration::from_secs(1)).as_micros() as u64;
                let now = monotonic_us();
                if until > now {
                    tokio::time::sleep(Duration::from_micros(until - now)).await;
                }
                nodes[target].proxy.set(ProxyMode::Pass);
            }
            record.healed_us = monotonic_us();
            direct_url = promoted.url();
            let old = std::mem::replace(&mut *cluster.lock().expect("cluster lock"), promoted);
            tokio::task::spawn_blocking(move || drop(old))
                .await
                .map_err(io::Error::other)?;
            tokio::time::sleep(Duration::from_millis(1500)).await;
            wait_all_held(&events, all_held, Duration::from_secs(30)).await;
            let primary = Arc::clone(&cluster);
            let next = tokio::task::spawn_blocking(move || {
                primary.lock().expect("cluster lock").start_standby()
            })
            .await
            .map_err(io::Error::other)??;
            if let Some(front) = &replication {
                front.set_upstream(([127, 0, 0, 1], new_port).into());
                front.set(ProxyMode::Pass);
                stream_through(&next, front).await?;
            }
            standby = Some(next);
        }
        faults.push(record);
        tokio::time::sleep(rng.millis(1000, 2500)).await;
    }

    // Heal, wait for every singleton to be held again (the last fault's takeover), then
    // stop every node gracefully: each must exit 0.
    for node in &nodes {
        node.proxy.set(ProxyMode::Pass);
    }
    let settle = config.timing.release + Duration::from_secs(10);
    if !wait_all_held(&events, all_held, settle).await {
        problems.lock().expect("problems lock").push(format!(
            "not every singleton was held again within {settle:?} after the last fault"
        ));
    }
    // Placement: once the fleet is whole and quiet, the group's members are spread,
    // no node above ceil(M / N) + 1.
    if config.group_members > 0 {
        let bound = config.group_members.div_ceil(config.nodes) + 1;
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            let loads = group_loads(&events.lock().expect("events lock"));
            let worst = loads.values().copied().max().unwrap_or(0);
            if worst <= bound {
                break;
            }
            if std::time::Instant::now() > deadline {
                problems.lock().expect("problems lock").push(format!(
                    "placement: a node runs {worst} of the group's {} members with {} nodes (bound {bound}): {loads:?}",
                    config.group_members, config.nodes
                ));
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    // The placement is judged over time against the nodes live over the last `settle`
    // (the server's release of a silent session, a lease, and 10 s for a promoted
    // server's term hold of 6 s, rounds, hand-overs and a busy machine): the fleet
    // stays whole that long after the last fault, so that at least the settled end is
    // judged.
    let settle = config.timing.release + config.timing.lease_timeout + Duration::from_secs(10);
    if config.group_members > 0 {
        let healed = faults.iter().map(|f| f.healed_us).max().unwrap_or(0);
        let judged_from = healed + settle.as_micros() as u64 + 500_000;
        let now = monotonic_us();
        if judged_from > now {
            tokio::time::sleep(Duration::from_micros(judged_from - now)).await;
        }
    }
    let final_stop_us = monotonic_us();
    for node in &mut nodes {
        if let Some(child) = node.child.as_ref() {
            signal(child.id(), "TERM")?;
        }
    }
    for node in &mut nodes {
        let status = reap(node, SHUTDOWN_LIMIT)?;
        if !status.success() {
            problems.lock().expect("problems lock").push(format!(
                "{}#{} did not shut down cleanly at the end ({status})",
                node.id, node.instance
            ));
        }
    }
    // The reader threads end at EOF, which follows the exit.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let events = events.lock().expect("events lock").clone();
    let problems = problems.lock().expect("problems lock").clone();
    if let Ok(path) = std::env::var("CHOSEN_NEMESIS_HISTORY") {
        write_history(&path, &events, &faults)?;
    }
    let group = (config.group_members > 0).then(|| PlacementSpec {
        prefix: format!("chosen.group/{GROUP}/member/"),
        members: config.group_members,
        nodes: nodes.iter().map(|n| n.id.clone()).collect(),
        settle,
        until_us: final_stop_us,
    });
    Ok(Report {
        deck,
        verdict: check_with(&events, &faults, config.timing, group.as_ref()),
        faults,
        problems,
    })
}

/// The address of `url`'s server (its first host, resolved), for the proxies to
/// forward to.
async fn server_address(url: &str) -> io::Result<SocketAddr> {
    let config: tokio_postgres::Config = url
        .parse()
        .map_err(|e| io::Error::other(format!("DATABASE_URL does not parse: {e}")))?;
    let port = config.get_ports().first().copied().unwrap_or(5432);
    let host = match config.get_hostaddrs().first() {
        Some(addr) => addr.to_string(),
        None => match config.get_hosts().first() {
            Some(tokio_postgres::config::Host::Tcp(host)) => host.clone(),
            _ => {
                return Err(io::Error::other(
                    "the nemesis reaches DATABASE_URL through TCP proxies: it needs a TCP host, not a Unix socket",
                ));
            }
        },
    };
    tokio::net::lookup_host((host.as_str(), port))
        .await?
        .next()
        .ok_or_else(|| io::Error::other(format!("{host}:{port} resolves to no address")))
}

/// `url` with its server replaced by the proxy at `proxy` (a URL, or `key=value`
/// settings).
fn proxied_url(url: &str, proxy: SocketAddr) -> io::Result<String> {
    let (ip, port) = (proxy.ip(), proxy.port());
    if let Some((scheme, rest)) = url.split_once("://") {
        let end = rest.find(['/', '?']).unwrap_or(rest.len());
        let (authority, tail) = rest.split_at(end);
        let user = authority.rfind('@').map_or("", |at| &authority[..=at]);
        if authority[user.len()..].contains(',') {
            return Err(io::Error::other(
                "the nemesis needs DATABASE_URL to name one server, not several",
            ));
        }
        // Host settings in the query string would bypass the proxy.
        let query: Vec<&str> = tail.split_once('?').map_or(Vec::new(), |(_, q)| {
            q.split('&')
                .filter(|kv| {
                    !["host=", "hostaddr=", "port="]
                        .iter()
                        .any(|k| kv.starts_with(k))
                })
                .collect()
        });
        let path = tail.split_once('?').map_or(tail, |(p, _)| p);
        let query = if query.is_empty() {
            String::new()
        } else {
            format!("?{}", query.join("&"))
        };
        Ok(format!("{scheme}://{user}{ip}:{port}{path}{query}"))
    } else {
        let mut settings: Vec<&str> = url
            .split_whitespace()
            .filter(|kv| {
                !["host=", "hostaddr=", "port="]
                    .iter()
                    .any(|k| kv.starts_with(k))
            })
            .collect();
        let server = format!("host={ip} port={port}");
        settings.push(&server);
        Ok(settings.join(" "))
    }
}

/// Whether the role of `url` may end the nodes' sessions (which use the same role): a
/// probe session is opened and ended with `pg_terminate_backend`, as the fault does.
/// The error says why not.
async fn may_terminate(url: &str) -> Result<(), String> {
    // The server's own words (`tokio_postgres::Error` alone says "db error").
    let why_not = |e: &tokio_postgres::Error| {
        let e = e
            .as_db_error()
            .map_or_else(|| e.to_string(), |db| db.message().to_owned());
        format!("the role may not end the nodes' sessions: {e}")
    };
    let name = format!("chosen-nemesis-probe-{}", std::process::id());
    let mut config: tokio_postgres::Config = url.parse().map_err(|e| why_not(&e))?;
    config.application_name(&name);
    let (_probe, connection) = config
        .connect(tokio_postgres::NoTls)
        .await
        .map_err(|e| why_not(&e))?;
    let probe = tokio::spawn(connection);
    let admin = connect_admin(url).await.map_err(|e| why_not(&e))?;
    let ended = admin
        .query(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1",
            &[&name],
        )
        .await
        .map_err(|e| why_not(&e))?
        .iter()
        .any(|r| r.get::<_, bool>(0));
    probe.abort();
    if ended {
        Ok(())
    } else {
        Err("the role may not end the nodes' sessions (pg_terminate_backend ended none)".to_owned())
    }
}

/// Writes the history (events and faults, in time order, one per line) for a person to
/// read: `CHOSEN_NEMESIS_HISTORY=path`.
fn write_history(path: &str, events: &[Event], faults: &[FaultRecord]) -> io::Result<()> {
    let mut lines: Vec<(u64, String)> = events
        .iter()
        .map(|e| (e.mono_us, format!("{e:?}")))
        .chain(faults.iter().flat_map(|f| {
            [
                (f.at_us, format!("FAULT {} on {:?}", f.kind, f.target)),
                (f.healed_us, format!("HEALED {} on {:?}", f.kind, f.target)),
            ]
        }))
        .collect();
    lines.sort_by_key(|(t, _)| *t);
    let text: String = lines
        .into_iter()
        .map(|(t, l)| format!("{t} {l}\n"))
        .collect();
    std::fs::write(path, text)
}

/// The URL of the local primary itself (not of a pooler in front of it).
fn direct_primary_url(cluster: &Mutex<PgCluster>) -> String {
    cluster.lock().expect("cluster lock").url()
}

/// Points `standby`'s replication at `front` (a proxy to its primary) and waits, at
/// most 30 s, until it streams through it.
async fn stream_through(standby: &PgCluster, front: &FaultProxy) -> io::Result<()> {
    let admin = connect_admin(&standby.url())
        .await
        .map_err(io::Error::other)?;
    let conninfo: String = admin
        .query_one("SELECT current_setting('primary_conninfo')", &[])
        .await
        .map_err(io::Error::other)?
        .get(0);
    // A later keyword wins in a connection string: the proxy's port is appended.
    let port = front.addr().port();
    let rerouted = format!("{conninfo} port={port}").replace('\'', "''");
    // Two statements: `ALTER SYSTEM` runs outside any transaction block.
    for statement in [
        format!("ALTER SYSTEM SET primary_conninfo = '{rerouted}'"),
        "SELECT pg_reload_conf()".to_owned(),
    ] {
        admin
            .batch_execute(&statement)
            .await
            .map_err(io::Error::other)?;
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let streaming: bool = admin
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM pg_stat_wal_receiver WHERE status = 'streaming' AND sender_port = $1)",
                &[&i32::from(port)],
            )
            .await
            .map_err(io::Error::other)?
            .get(0);
        if streaming {
            return Ok(());
        }
        if std::time::Instant::now() > deadline {
            return Err(io::Error::other(format!(
                "the standby does not stream through its proxy (port {port}) within 30 s"
            )));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The indexes of the nodes, each given by its id and the instance that runs now,
/// whose process runs at least one child right now, once one does or `limit` passed
/// (then none). Judged by that instance's own events: a killed instance that held
/// something does not count for its successor.
async fn wait_for_holders(
    events: &Shared<Vec<Event>>,
    nodes: &[(String, u32)],
    limit: Duration,
) -> Vec<usize> {
    let deadline = std::time::Instant::now() + limit;
    loop {
        let holding: Vec<usize> = {
            let events = events.lock().expect("events lock");
            (0..nodes.len())
                .filter(|i| {
                    let (id, instance) = &nodes[*i];
                    let mut on: HashMap<&str, bool> = HashMap::new();
                    for e in events
                        .iter()
                        .filter(|e| e.node == *id && e.instance == *instance)
                    {
                        if let Some(s) = &e.singleton {
                            match e.event.as_str() {
                                "child_started" => {
                                    on.insert(s, true);
                                }
                                "child_stopped" | "lease_lost" => {
                                    on.insert(s, false);
                                }
                                _ => {}
                            }
                        }
                    }
                    on.values().any(|v| *v)
                })
                .collect()
        };
        if !holding.is_empty() || std::time::Instant::now() >= deadline {
            return holding;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until every singleton has a running child (bounded); `false` on timeout.
async fn wait_all_held(events: &Shared<Vec<Event>>, singletons: usize, limit: Duration) -> bool {
    let deadline = std::time::Instant::now() + limit;
    while std::time::Instant::now() < deadline {
        if held(&events.lock().expect("events lock")) >= singletons {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

/// Per (node, latest instance, singleton): whether a child runs right now.
fn running(events: &[Event]) -> HashMap<(&str, &str), bool> {
    let mut latest: HashMap<&str, u32> = HashMap::new();
    for e in events {
        let i = latest.entry(&e.node).or_insert(e.instance);
        *i = (*i).max(e.instance);
    }
    let mut running = HashMap::new();
    for e in events {
        if latest.get(e.node.as_str()) != Some(&e.instance) {
            continue;
        }
        if let Some(s) = &e.singleton {
            match e.event.as_str() {
                "child_started" => {
                    running.insert((e.node.as_str(), s.as_str()), true);
                }
                "child_stopped" | "lease_lost" => {
                    running.insert((e.node.as_str(), s.as_str()), false);
                }
                _ => {}
            }
        }
    }
    running
}

/// Members of the group running per node (latest instances), right now.
fn group_loads(events: &[Event]) -> HashMap<String, usize> {
    let prefix = format!("chosen.group/{GROUP}/member/");
    let mut loads = HashMap::new();
    for ((node, singleton), on) in running(events) {
        if on && singleton.starts_with(&prefix) {
            *loads.entry(node.to_owned()).or_default() += 1;
        }
    }
    loads
}

/// How many singletons have a running child right now.
fn held(events: &[Event]) -> usize {
    running(events)
        .into_iter()
        .filter(|(_, on)| *on)
        .map(|((_, s), _)| s)
        .collect::<HashSet<_>>()
        .len()
}

fn spawn(
    binary: &PathBuf,
    node: &mut Node,
    singletons: &Spec,
    events: &Shared<Vec<Event>>,
    problems: &Shared<Vec<String>>,
) -> io::Result<()> {
    if node.child.is_some() {
        return Err(io::Error::other(format!(
            "BUG: {}#{} is still running",
            node.id, node.instance
        )));
    }
    node.instance += 1;
    let mut cmd = Command::new(binary);
    cmd.args(["--node-id", &node.id, "--poll-ms", "200", "--tick-ms", "50"]);
    for s in &singletons.names {
        cmd.args(["--singleton", s]);
    }
    if singletons.lease_rows {
        cmd.arg("--lease-rows");
    }
    if singletons.group_members > 0 {
        // Faults make nodes leave all the time: freezing moves for that would make the
        // final placement depend on the last minute's faults (freezing has tests of its
        // own).
        cmd.args([
            "--group",
            GROUP,
            "--members",
            &singletons.group_members.to_string(),
            "--group-flap-leaves",
            "1000000",
        ]);
    }
    let mut child = cmd
        .env("DATABASE_URL", &node.url)
        .env("RUST_BACKTRACE", "0")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let stdout = child.stdout.take().expect("piped stdout");
    let stderr = child.stderr.take().expect("piped stderr");
    let label = format!("{}#{}", node.id, node.instance);
    let (events, instance) = (Arc::clone(events), node.instance);
    let problems_out = Arc::clone(problems);
    let label_out = label.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let line = match line {
                Ok(line) => line,
                Err(e) => {
                    problems_out
                        .lock()
                        .expect("problems lock")
                        .push(format!("{label_out}: stdout unreadable: {e}"));
                    break;
                }
            };
            match Event::parse(&line, instance) {
                Some(e) => events.lock().expect("events lock").push(e),
                None => problems_out
                    .lock()
                    .expect("problems lock")
                    .push(format!("{label_out}: not an event: {line:?}")),
            }
        }
    });
    // The node logs nothing on stderr unless something is wrong (a panic, a fatal
    // error): every line is a problem.
    let problems = Arc::clone(problems);
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            problems
                .lock()
                .expect("problems lock")
                .push(format!("{label} stderr: {line}"));
        }
    });
    node.child = Some(child);
    Ok(())
}

/// Waits (bounded) for the node's process to exit; kills it when the limit passes, and
/// reports that as an error status.
fn reap(node: &mut Node, limit: Duration) -> io::Result<std::process::ExitStatus> {
    let Some(mut child) = node.child.take() else {
        return Err(io::Error::other(format!("{} runs no process", node.id)));
    };
    let deadline = std::time::Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(status);
        }
        if std::time::Instant::now() > deadline {
            let _ = signal(child.id(), "CONT");
            child.kill()?;
            child.wait()?;
            return Err(io::Error::other(format!(
                "{}#{} did not exit within {limit:?}",
                node.id, node.instance
            )));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = signal(child.id(), "CONT");
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_proxied_url_names_the_proxy_and_keeps_the_rest() {
        let proxy = SocketAddr::from(([127, 0, 0, 1], 4242));
        assert_eq!(
            proxied_url("postgres://u:p@db.example:5433/app?sslmode=disable", proxy).unwrap(),
            "postgres://u:p@127.0.0.1:4242/app?sslmode=disable"
        );
        assert_eq!(
            proxied_url(
                "postgresql://db.example?host=other&application_name=x",
                proxy
            )
            .unwrap(),
            "postgresql://127.0.0.1:4242?application_name=x"
        );
        assert_eq!(
            proxied_url("host=db.example port=5433 user=u dbname=app", proxy).unwrap(),
            "user=u dbname=app host=127.0.0.1 port=4242"
        );
        assert!(proxied_url("postgres://u@a:1,b:2/app", proxy).is_err());
    }

    #[test]
    fn an_external_deck_leaves_out_the_local_faults_and_says_why() {
        let deck = Deck::external(&Ok(()));
        assert!(deck.deals("terminate_backend") && deck.deals("sigkill"));
        assert!(LOCAL_ONLY_KINDS.iter().all(|k| !deck.deals(k)));
        let deck = Deck::external(&Err("permission denied".to_owned()));
        assert!(!deck.deals("terminate_backend"));
        assert_eq!(
            deck.kinds.len(),
            FAULT_KINDS.len() - LOCAL_ONLY_KINDS.len() - 1
        );
        assert!(
            deck.to_string()
                .contains("terminate_backend (permission denied)")
        );
        assert_eq!(Deck::full().kinds, FAULT_KINDS.to_vec());
    }

    #[test]
    fn the_lease_row_deck_deals_the_server_faults_and_says_why_it_leaves_out_the_rest() {
        let deck = Deck::lease_rows();
        for kind in LOCAL_ONLY_KINDS {
            assert!(deck.deals(kind), "{kind} is dealt behind the pooler");
        }
        for kind in FAULT_KINDS {
            let left_out = deck.left_out.iter().any(|(k, _)| *k == kind);
            assert!(
                deck.deals(kind) != left_out,
                "{kind} is either dealt or left out with a reason: {deck}"
            );
        }
        for kind in ["cut", "terminate_backend", "latency"] {
            assert!(!deck.deals(kind), "{kind}: {deck}");
        }
    }
}
