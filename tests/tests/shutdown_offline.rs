//! A shutdown while the database is unreachable (a black hole, refused connections,
//! a step hanging) ends within its bound: it never waits for the database to come
//! back, only for the leases still out, at most the stop budget. Real clusters behind a
//! fault proxy.

use std::time::{Duration, Instant};

use chosen_core::{ConnectionState, LockManager};
use chosen_tests::{FaultProxy, ProxyMode, manager_options};
use chosen_tests::{PgCluster, unique_name};

/// Lost (black hole), reconnecting (new connections hang for the connect timeout), a
/// lease of the lost session still out: the shutdown waits for it only, then ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_while_reconnecting_waits_only_for_the_lost_sessions_lease() {
    let pg = PgCluster::start_local().unwrap();
    let port = pg.port().unwrap();
    let proxy = FaultProxy::start(([127, 0, 0, 1], port).into())
        .await
        .unwrap();
    let m = LockManager::connect(manager_options(&proxy.url(&pg.url(), port), "offline-a"))
        .await
        .unwrap();
    let lease = m.acquire(unique_name("offline")).await.unwrap();
    proxy.set(ProxyMode::BlackHole);
    tokio::time::timeout(Duration::from_secs(10), lease.lost())
        .await
        .expect("lost");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let t = Instant::now();
    let sd = tokio::spawn({
        let m = m.clone();
        async move { m.shutdown().await }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    drop(lease);
    tokio::time::timeout(Duration::from_secs(20), sd)
        .await
        .expect("shutdown ends")
        .unwrap();

    assert!(
        t.elapsed() < Duration::from_millis(1500),
        "{:?}",
        t.elapsed()
    );
    assert!(matches!(
        m.connection_status(),
        ConnectionState::Disconnected { .. }
    ));
}

/// The same, the lease never dropped: the shutdown gives up on it after the stop budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_while_disconnected_gives_up_on_a_kept_lease_after_the_stop_budget() {
    let pg = PgCluster::start_local().unwrap();
    let port = pg.port().unwrap();
    let proxy = FaultProxy::start(([127, 0, 0, 1], port).into())
        .await
        .unwrap();
    let m = LockManager::connect(manager_options(&proxy.url(&pg.url(), port), "offline-b"))
        .await
        .unwrap();
    let lease = m.acquire(unique_name("offline")).await.unwrap();
    proxy.set(ProxyMode::BlackHole);
    tokio::time::timeout(Duration::from_secs(10), lease.lost())
        .await
        .expect("lost");
    let t = Instant::now();
    tokio::time::timeout(Duration::from_secs(20), m.shutdown())
        .await
        .expect("shutdown ends");

    // stop_budget 2 s (the kept session's deadline is later).
    assert!(
        t.elapsed() < Duration::from_millis(2600),
        "{:?}",
        t.elapsed()
    );
    drop(lease);
}

/// A black hole while connected, the lease dropped and the shutdown asked at once: the
/// release's step hangs until the heartbeat gives the session up (lease timeout), then
/// the shutdown is read instead of reconnecting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_while_a_step_hangs_ends_within_its_bound() {
    let pg = PgCluster::start_local().unwrap();
    let port = pg.port().unwrap();
    let proxy = FaultProxy::start(([127, 0, 0, 1], port).into())
        .await
        .unwrap();
    let m = LockManager::connect(manager_options(&proxy.url(&pg.url(), port), "offline-c"))
        .await
        .unwrap();
    let lease = m.acquire(unique_name("offline")).await.unwrap();
    proxy.set(ProxyMode::BlackHole);
    let t = Instant::now();
    drop(lease);
    tokio::time::timeout(Duration::from_secs(30), m.shutdown())
        .await
        .expect("shutdown ends");

    // The shutdown may be read before the step: its closing statements then run into
    // their deadline, stop_budget + lease_timeout (5 s), the heartbeat being stopped.
    assert!(
        t.elapsed() < Duration::from_millis(6000),
        "{:?}",
        t.elapsed()
    );
}

/// Connections cut (refused at once, so reconnects fail fast and back off) at the very
/// moment the shutdown is asked: whichever the loop reads first, no reconnect loop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_racing_a_cut_connection_does_not_wait_for_the_database() {
    let pg = PgCluster::start_local().unwrap();
    let port = pg.port().unwrap();
    for i in 0..20 {
        let proxy = FaultProxy::start(([127, 0, 0, 1], port).into())
            .await
            .unwrap();
        let m = LockManager::connect(manager_options(&proxy.url(&pg.url(), port), "offline-d"))
            .await
            .unwrap();
        let _ = m.try_acquire(unique_name("offline")).await;
        tokio::time::sleep(Duration::from_millis(7 * (i % 10))).await;
        let t = Instant::now();
        proxy.set(ProxyMode::Cut);
        tokio::time::timeout(Duration::from_secs(30), m.shutdown())
            .await
            .expect("shutdown ends (not waiting for the database to come back)");

        assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    }
}
