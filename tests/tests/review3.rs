//! Breaks found by a third review (fence checks inside the try statement), against real
//! servers, kept as regression tests.

use std::time::{Duration, Instant};

use chosen_core::{LockKey, LockManager, ManagerOptions};
use chosen_tests::{PgCluster, connect_admin, unique_name};

fn options(url: &str, node: &str) -> ManagerOptions {
    ManagerOptions::from_url(url)
        .expect("valid test URL")
        .node_id(node)
        .poll_interval(Duration::from_millis(50))
        .reconnect_backoff(Duration::from_millis(20), Duration::from_millis(200))
}

/// Finding 1. The fence probes (in the try statement and in the fence check) take the
/// stop fence *shared* for an instant. A stopping holder's exclusive fence try that
/// meets such a probe fails; it is retried 50 ms later, but the probe that made it fail
/// found the fence free and lets its node grant the key at once. Here a shared hold of
/// the fence stands for that probe, held across the old holder's reconnect: the old
/// holder never gets its fence, and the new holder is granted while the old lease
/// (whose work is still stopping) is out and was never dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fence_probe_does_not_keep_a_stopping_holder_from_fencing() {
    let pg = PgCluster::start().unwrap();
    let admin = connect_admin(&pg.url()).await.unwrap();
    let prober = connect_admin(&pg.url()).await.unwrap();
    let lock = unique_name("probe-collision");
    let a = LockManager::connect(options(&pg.url(), "probe-a"))
        .await
        .unwrap();
    let lease = a.acquire(lock.as_str()).await.unwrap();
    let b = LockManager::connect(
        options(&pg.url(), "probe-b").takeover_grace(Duration::from_millis(300)),
    )
    .await
    .unwrap();
    let b_waiting = tokio::spawn({
        let b = b.clone();
        let lock = lock.clone();
        async move { b.acquire(lock.as_str()).await }
    });
    // B has seen the key held.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let LockKey::Pair(ka, kb) = a.key_for(&lock) else {
        unreachable!("named locks are pairs")
    };
    let LockKey::Pair(fa, fb) = LockKey::derive("chosen.stop-fence", &format!("pair:{ka}:{kb}"))
    else {
        unreachable!("fences are pairs")
    };
    // A probe in flight at the moment the old holder fences (held a little longer here).
    prober
        .execute("SELECT pg_advisory_lock_shared($1, $2)", &[&fa, &fb])
        .await
        .unwrap();
    let killed: i64 = admin
        .query_one(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = 'probe-a'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(killed, 1);
    // A reconnects and tries its fence, which meets the probe, and retries every 50 ms.
    // The probe stands for the one B's own fence check takes after the grace, when it
    // meets A's retry: held here until past B's grace, then it ends, as probes do.
    tokio::time::sleep(Duration::from_millis(500)).await;
    prober
        .execute("SELECT pg_advisory_unlock_shared($1, $2)", &[&fa, &fb])
        .await
        .unwrap();
    // A's work is still stopping (its lease is kept): B must not be granted.
    let started = Instant::now();
    let granted = tokio::time::timeout(Duration::from_millis(1500), b_waiting).await;
    assert!(
        granted.is_err(),
        "B was granted the key {:?} after the probe while A's lease of it (work still stopping) was out",
        started.elapsed()
    );
    drop(lease);
}
