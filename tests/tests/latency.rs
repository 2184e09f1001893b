//! A slow database is not a dead one (issue 13, flap resistance): with default
//! settings (heartbeat every 1 s, lease timeout 3 s) a leader whose round trips to the
//! database grow keeps its lease while they stay below `lease_timeout -
//! heartbeat_interval` (2 s), because heartbeats are pipelined; above that it hands
//! over once, cleanly (its lease is revoked before the other node is granted), and
//! rejoins as a follower when the latency is gone.
//!
//! The latency is real: a proxy on loopback delays every chunk both ways. Prints a
//! `LATENCY` line per step (run with `--nocapture` to see them).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chosen_core::{ConnectionState, Error, LockManager, LockState, SessionDownReason};
use chosen_tests::{FaultProxy, PgCluster, ProxyMode, manager_options, unique_name};

#[derive(Debug, Clone)]
struct Interval {
    node: String,
    start: Instant,
    end: Option<Instant>,
    reason: Option<SessionDownReason>,
}

/// Every holding interval of one lock, across nodes.
#[derive(Clone, Default)]
struct History(Arc<Mutex<Vec<Interval>>>);

impl History {
    /// Keeps acquiring `name` on `manager` (waiting, across reconnects), recording each
    /// holding interval from grant until `lost()` resolves.
    fn contend(&self, manager: LockManager, name: String) -> tokio::task::JoinHandle<()> {
        let history = self.clone();
        tokio::spawn(async move {
            loop {
                let lease = match manager.acquire(name.as_str()).await {
                    Ok(lease) => lease,
                    Err(Error::Closed) => return,
                    Err(e) => {
                        eprintln!("{}: acquire failed ({e}); again", manager.node_id());
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                let index = {
                    let mut h = history.0.lock().unwrap();
                    h.push(Interval {
                        node: manager.node_id().to_owned(),
                        start: Instant::now(),
                        end: None,
                        reason: None,
                    });
                    h.len() - 1
                };
                let reason = lease.lost().await;
                let mut h = history.0.lock().unwrap();
                h[index].end = Some(Instant::now());
                h[index].reason = Some(reason);
            }
        })
    }

    fn snapshot(&self) -> Vec<Interval> {
        self.0.lock().unwrap().clone()
    }

    async fn wait_for(&self, what: &str, limit: Duration, pred: impl Fn(&[Interval]) -> bool) {
        let deadline = Instant::now() + limit;
        loop {
            if pred(&self.snapshot()) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}: {:#?}",
                self.snapshot()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

fn generation(manager: &LockManager) -> Option<u64> {
    match manager.connection_status() {
        ConnectionState::Connected { generation, .. } => Some(generation),
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_leader_keeps_its_lease_below_the_bound_and_hands_over_cleanly_above() {
    let pg = PgCluster::start_local().unwrap();
    let port = pg.port().unwrap();
    let upstream = ([127, 0, 0, 1], port).into();
    let proxy_a = FaultProxy::start(upstream).await.unwrap();
    let proxy_b = FaultProxy::start(upstream).await.unwrap();
    let name = unique_name("latency");
    let a = LockManager::connect(manager_options(&proxy_a.url(&pg.url(), port), "node-a"))
        .await
        .unwrap();
    let b = LockManager::connect(manager_options(&proxy_b.url(&pg.url(), port), "node-b"))
        .await
        .unwrap();
    let history = History::default();
    history.contend(a.clone(), name.clone());
    history
        .wait_for("A to lead", Duration::from_secs(10), |h| h.len() == 1)
        .await;
    history.contend(b.clone(), name.clone());
    // B is waiting (polling) behind A.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !b.locks().await.unwrap().iter().any(|l| l.name == name) {
        assert!(Instant::now() < deadline, "B never queued");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(generation(&a), Some(1));

    // Below the bound: no leader change, A's session and lease stay up throughout.
    for rtt_ms in [500, 1_500, 1_900] {
        proxy_a.set(ProxyMode::Latency(Duration::from_millis(rtt_ms)));
        let step = Instant::now();
        while step.elapsed() < Duration::from_secs(15) {
            let h = history.snapshot();
            assert!(
                h.len() == 1 && h[0].node == "node-a" && h[0].end.is_none(),
                "leader changed with an added round trip of {rtt_ms} ms: {h:#?}"
            );
            assert_eq!(
                generation(&a),
                Some(1),
                "A's session ended with an added round trip of {rtt_ms} ms"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        eprintln!("LATENCY +{rtt_ms} ms round trip for 15 s: node-a kept the lease");
    }

    // Above the bound: one clean hand-over.
    let t0 = Instant::now();
    proxy_a.set(ProxyMode::Latency(Duration::from_secs(4)));
    history
        .wait_for("B to take over", Duration::from_secs(30), |h| h.len() >= 2)
        .await;
    let h = history.snapshot();
    assert_eq!(h.len(), 2, "{h:#?}");
    assert_eq!(
        (h[0].node.as_str(), h[1].node.as_str()),
        ("node-a", "node-b")
    );
    let revoked = h[0].end.expect("A's lease ended before B was granted");
    assert!(revoked <= h[1].start, "overlap: {h:#?}");
    assert!(
        matches!(
            h[0].reason,
            Some(SessionDownReason::HeartbeatOverdue { .. })
        ),
        "{h:#?}"
    );
    eprintln!(
        "LATENCY +4 s round trip: node-a revoked after {} ms, node-b granted after {} ms",
        (revoked - t0).as_millis(),
        (h[1].start - t0).as_millis()
    );

    // The latency goes away: A reconnects, and waits behind B.
    tokio::time::sleep(Duration::from_secs(2)).await;
    proxy_a.set(ProxyMode::Pass);
    let deadline = Instant::now() + Duration::from_secs(40);
    while generation(&a).is_none_or(|g| g < 2) {
        assert!(
            Instant::now() < deadline,
            "A did not reconnect: {:?}",
            a.connection_status()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let rejoined = Instant::now();
    while rejoined.elapsed() < Duration::from_secs(5) {
        let h = history.snapshot();
        assert!(
            h.len() == 2 && h[1].end.is_none(),
            "A took the lock back, or B lost it: {h:#?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let waiting = a.locks().await.unwrap();
    assert!(
        waiting
            .iter()
            .any(|l| l.name == name && matches!(l.state, LockState::Waiting { .. })),
        "A is not waiting as a follower: {waiting:?}"
    );
    eprintln!(
        "LATENCY back to normal: node-a reconnected {} ms after, and follows",
        (rejoined - t0).as_millis()
    );
    a.shutdown().await;
    b.shutdown().await;
}

/// A slow database is not a dead one while connecting either: a session set up over a
/// 1 s round trip (its settings, term and statements in one round trip, proven from
/// when they were sent) holds a lock and keeps its first session. Before, the connect
/// took four round trips after the proof and the new session was overdue at birth
/// above about a quarter of the lease timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_is_set_up_and_kept_over_a_slow_database() {
    let pg = PgCluster::start_local().unwrap();
    let port = pg.port().unwrap();
    let proxy = FaultProxy::start(([127, 0, 0, 1], port).into())
        .await
        .unwrap();
    proxy.set(ProxyMode::Latency(Duration::from_secs(1)));
    let t0 = Instant::now();
    let a = LockManager::connect(
        manager_options(&proxy.url(&pg.url(), port), "slow-connect")
            .term_grant_delay(Duration::ZERO),
    )
    .await
    .unwrap();
    eprintln!(
        "LATENCY connect over a 1 s round trip took {:?}",
        t0.elapsed()
    );
    let lease = a
        .acquire(unique_name("slow-connect").as_str())
        .await
        .unwrap();
    let held = Instant::now();
    while held.elapsed() < Duration::from_secs(10) {
        assert!(lease.is_valid(), "lost after {:?}", held.elapsed());
        assert_eq!(generation(&a), Some(1), "the first session ended");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    a.shutdown().await;
}
