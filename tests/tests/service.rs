//! Three `service` example processes (`examples/service.rs`) against one cluster:
//! exactly one answers the leader-only route, the cron job ticks once per second on
//! that node only, a SIGTERMed leader hands both over within seconds, and every process
//! exits 0 soon after SIGTERM.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use chosen_tests::{NodeProcess, PgCluster, monotonic_us, signal};

/// A number field of a JSON event line.
fn num(line: &str, key: &str) -> Option<u64> {
    let rest = &line[line.find(&format!("\"{key}\":"))? + key.len() + 3..];
    let end = rest
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(rest.len());
    rest[..end].parse().ok()
}

/// A string field of a JSON event line (no escapes in the values used here).
fn text<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let rest = &line[line.find(&format!("\"{key}\":\""))? + key.len() + 4..];
    Some(&rest[..rest.find('"')?])
}

/// A GET on loopback: the status (0 when the request failed) and body.
fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    chosen_tests::http_request(addr, "GET", path).map_or((0, String::new()), |r| (r.status, r.body))
}

struct Service {
    node: String,
    process: NodeProcess,
    addr: SocketAddr,
    lines: Vec<String>,
}

impl Service {
    fn start(url: &str, node: &str) -> Self {
        let process = NodeProcess::spawn_example(
            "service",
            url,
            &["--node-id", node, "--listen", "127.0.0.1:0"],
        )
        .unwrap();
        let line = process
            .wait("listening", Duration::from_secs(60))
            .unwrap_or_else(|| panic!("{node} never listened"));
        let addr = text(&line, "addr").unwrap().parse().unwrap();
        Self {
            node: node.to_owned(),
            process,
            addr,
            lines: Vec::new(),
        }
    }

    fn pump(&mut self) {
        self.lines.extend(self.process.drain());
    }

    /// `(scheduled second, mono_us)` of every tick so far.
    fn ticks(&self) -> Vec<(u64, u64)> {
        self.lines
            .iter()
            .filter(|l| text(l, "event") == Some("tick"))
            .map(|l| (num(l, "scheduled").unwrap(), num(l, "mono_us").unwrap()))
            .collect()
    }

    fn status(&self, path: &str) -> u16 {
        get(self.addr, path).0
    }

    /// Sends SIGTERM and waits (bounded) for the process to exit: its exit code and how
    /// long after its `shutdown` `done` line, and after the signal, it was gone (µs of
    /// the monotonic clock).
    fn terminate(&mut self, limit: Duration) -> (Option<i32>, u64, u64) {
        let sent = monotonic_us();
        signal(self.process.child.id(), "TERM").unwrap();
        let deadline = Instant::now() + limit;
        let (status, gone) = loop {
            if let Some(status) = self.process.child.try_wait().unwrap() {
                break (status, monotonic_us());
            }
            assert!(
                Instant::now() < deadline,
                "{} still runs {limit:?} after SIGTERM",
                self.node
            );
            std::thread::sleep(Duration::from_millis(1));
        };
        // The reader thread may still hold the last lines: read up to the end.
        let rest = self.process.rest(Duration::from_secs(5));
        self.lines.extend(rest);
        let done = self
            .lines
            .iter()
            .filter(|l| text(l, "phase") == Some("done"))
            .find_map(|l| num(l, "mono_us"))
            .unwrap_or_else(|| panic!("{}: no shutdown done line", self.node));
        (
            status.code(),
            gone.saturating_sub(done),
            gone.saturating_sub(sent),
        )
    }
}

/// Which services answer `/leader` with 200; the others must answer 503.
fn leaders(services: &[Service]) -> Vec<usize> {
    let mut leaders = Vec::new();
    for (i, s) in services.iter().enumerate() {
        match s.status("/leader") {
            200 => leaders.push(i),
            503 => {}
            other => panic!("{}: /leader answered {other}", s.node),
        }
    }
    leaders
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

#[test]
fn three_services_one_leader_one_tick_per_second_and_a_clean_hand_over() {
    let pg = PgCluster::start_local().unwrap();
    let mut services: Vec<Service> = (0..3)
        .map(|i| Service::start(&pg.url(), &format!("svc-{i}")))
        .collect();

    // The first leader is chosen once the new server's term grant delay passed (~6 s).
    let deadline = Instant::now() + Duration::from_secs(30);
    let leader = loop {
        if let [one] = leaders(&services)[..] {
            break one;
        }
        assert!(Instant::now() < deadline, "no single leader");
        std::thread::sleep(Duration::from_millis(100));
    };
    for s in &services {
        assert_eq!(s.status("/healthz"), 200, "{}", s.node);
        let (status, body) = get(s.addr, "/metrics");
        assert_eq!(status, 200, "{}", s.node);
        assert!(body.contains("chosen_lock_held"), "{}: {body}", s.node);
    }

    // About ten seconds under a stable leader: the same one answers 200, the others
    // 503, and it ticks once per second.
    let window_start = monotonic_us();
    for _ in 0..10 {
        assert_eq!(leaders(&services), vec![leader]);
        std::thread::sleep(Duration::from_secs(1));
    }
    let window_end = monotonic_us();
    for s in &mut services {
        s.pump();
    }
    for (i, s) in services.iter().enumerate() {
        if i != leader {
            assert!(s.ticks().is_empty(), "{} ticked as a follower", s.node);
        }
    }
    let in_window: Vec<u64> = services[leader]
        .ticks()
        .into_iter()
        .filter(|(_, at)| (window_start..window_end).contains(at))
        .map(|(scheduled, _)| scheduled)
        .collect();
    let secs = (window_end - window_start) / 1_000_000;
    assert!(
        in_window.len() as u64 + 2 >= secs && in_window.len() as u64 <= secs + 1,
        "{} ticks in {secs} s: {in_window:?}",
        in_window.len()
    );

    // SIGTERM the leader: it exits 0, and another node answers 200 within seconds.
    let old = services[leader].node.clone();
    let terminated_at = now_secs();
    let t0 = Instant::now();
    let (code, exit_delay, since_signal) = services[leader].terminate(Duration::from_secs(15));
    assert_eq!(code, Some(0), "{old} exit code");
    let mut delays = vec![(old.clone(), exit_delay, since_signal)];
    let stopped = services.remove(leader);
    let deadline = t0 + Duration::from_secs(5);
    let next = loop {
        if let [one] = leaders(&services)[..] {
            break one;
        }
        assert!(
            Instant::now() < deadline,
            "no new leader after {old} stopped"
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    let takeover = t0.elapsed();
    assert!(takeover < Duration::from_secs(5), "{takeover:?}");

    // Ticks go on, on the new leader only.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        for s in &mut services {
            s.pump();
        }
        let after = services[next]
            .ticks()
            .iter()
            .filter(|(scheduled, _)| *scheduled > terminated_at)
            .count();
        if after >= 3 {
            break;
        }
        assert!(Instant::now() < deadline, "the new leader does not tick");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(leaders(&services), vec![next]);
    let other = 1 - next;
    assert!(
        services[other].ticks().is_empty(),
        "{} ticked as a follower",
        services[other].node
    );
    // No scheduled second ran twice across the fleet, and the new leader's ticks come
    // after the old one's.
    let mut by_second: BTreeMap<u64, Vec<&str>> = BTreeMap::new();
    for s in services.iter().chain(std::iter::once(&stopped)) {
        for (scheduled, _) in s.ticks() {
            by_second.entry(scheduled).or_default().push(&s.node);
        }
    }
    let twice: Vec<_> = by_second.iter().filter(|(_, v)| v.len() > 1).collect();
    assert!(twice.is_empty(), "ticks ran twice: {twice:?}");
    let old_last = stopped.ticks().iter().map(|t| t.0).max().unwrap();
    let new_first = services[next].ticks().iter().map(|t| t.0).min().unwrap();
    assert!(old_last < new_first, "{old_last} >= {new_first}");

    // Every process exits 0 soon after SIGTERM, and soon after its shutdown ended.
    for s in &mut services {
        let (code, delay, since_signal) = s.terminate(Duration::from_secs(15));
        assert_eq!(code, Some(0), "{} exit code", s.node);
        delays.push((s.node.clone(), delay, since_signal));
    }
    eprintln!(
        "SERVICE takeover {} ms; exit after the shutdown done line (after SIGTERM): {}",
        takeover.as_millis(),
        delays
            .iter()
            .map(|(n, d, s)| {
                format!(
                    "{n} {:.1} ms ({:.1} ms)",
                    *d as f64 / 1000.0,
                    *s as f64 / 1000.0
                )
            })
            .collect::<Vec<_>>()
            .join(", ")
    );
    for (node, delay, _) in &delays {
        assert!(
            *delay < 3_000_000,
            "{node} took {delay} µs to exit after its shutdown ended"
        );
    }
}
