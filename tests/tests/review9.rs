//! Breaks found by the review of the one-round-trip session set-up and the read-only
//! guard, against real servers, kept as regression tests.

use std::time::{Duration, Instant};

use chosen_core::{ConnectionState, LockManager, ManagerOptions, SessionDownReason};
use chosen_tests::{FaultProxy, PgCluster, ProxyMode, connect_admin, unique_name};

fn options(url: &str, node: &str) -> ManagerOptions {
    chosen_tests::manager_options(url, node)
        .poll_interval(Duration::from_millis(100))
        .reconnect_backoff(Duration::from_millis(50), Duration::from_millis(300))
        .term_grant_delay(Duration::ZERO)
}

/// F3 and F1. A logical cutover (or a dump and restore) from a cluster on timeline 1
/// to a new cluster on timeline 1: transaction ids restart, so tokens would go
/// backwards in their low bits. The manager refuses the new server until its next token
/// is above every token it issued, and the server's own `chosen.token_epoch` (set on
/// the new cluster only) lifts it there, without touching the nodes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cutover_to_a_cluster_with_smaller_ids_is_refused_until_its_epoch_is_raised() {
    let old = PgCluster::start_local().unwrap();
    let new = PgCluster::start_local().unwrap();
    let (old_port, new_port) = (old.port().unwrap(), new.port().unwrap());
    // The old cluster has handed out more transaction ids than the new one.
    let admin_old = connect_admin(&old.url()).await.unwrap();
    for _ in 0..300 {
        admin_old
            .batch_execute("SELECT pg_current_xact_id()")
            .await
            .unwrap();
    }
    let proxy = FaultProxy::start(([127, 0, 0, 1], old_port).into())
        .await
        .unwrap();
    let m = LockManager::connect(options(&proxy.url(&old.url(), old_port), "cutover"))
        .await
        .unwrap();
    let name = unique_name("cutover");
    let lease = m.acquire(name.as_str()).await.unwrap();
    let old_token = lease.fencing_token();
    lease.release().await.unwrap();

    // The cutover: the address now leads to the new cluster.
    proxy.set_upstream(([127, 0, 0, 1], new_port).into());
    proxy.set(ProxyMode::Cut);
    tokio::time::sleep(Duration::from_millis(100)).await;
    proxy.set(ProxyMode::Pass);
    let deadline = Instant::now() + Duration::from_secs(5);
    let refused = loop {
        if let ConnectionState::Disconnected {
            reason: SessionDownReason::ConnectFailed { message },
            ..
        } = m.connection_status()
            && message.contains("go backwards")
        {
            break message;
        }
        assert!(
            Instant::now() < deadline,
            "not refused: {:?}",
            m.connection_status()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(refused.contains("chosen.token_epoch"), "{refused}");
    let waiting = tokio::time::timeout(Duration::from_secs(2), m.acquire(name.as_str())).await;
    assert!(waiting.is_err(), "granted on a server with smaller tokens");

    // The DBA raises the epoch on the new cluster only; the manager picks it up.
    let admin_new = connect_admin(&new.url()).await.unwrap();
    admin_new
        .batch_execute("ALTER DATABASE postgres SET chosen.token_epoch = 1")
        .await
        .unwrap();
    let lease = tokio::time::timeout(Duration::from_secs(20), m.acquire(name.as_str()))
        .await
        .expect("granted once the new cluster's epoch is raised")
        .unwrap();
    let new_token = lease.fencing_token();
    assert!(new_token > old_token, "{new_token} <= {old_token}");
    assert_eq!(
        new_token.timeline(),
        2,
        "timeline 1 plus the server's epoch 1"
    );

    // A bad server setting is a clear refusal, not a panic or a silent 0.
    admin_new
        .batch_execute("ALTER DATABASE postgres SET chosen.token_epoch = 'many'")
        .await
        .unwrap();
    let err = LockManager::connect(options(&new.url(), "bad-epoch"))
        .await
        .expect_err("refused");
    assert!(err.to_string().contains("chosen.token_epoch"), "{err}");
}

/// F4. A release on a primary fenced read-only sent a `NOTIFY`, which commits (and
/// writes WAL) even in a read-only transaction: the fenced primary's WAL moved on
/// after a switchover checked it. Now nothing is announced there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_on_a_read_only_primary_writes_nothing() {
    let pg = PgCluster::start_local().unwrap();
    let admin = connect_admin(&pg.url()).await.unwrap();
    let slow = |node: &str| {
        options(&pg.url(), node)
            .heartbeat_interval(Duration::from_secs(5))
            .lease_timeout(Duration::from_secs(12))
            .server_release_after(Duration::from_secs(30))
    };
    let a = LockManager::connect(slow("ro-release-a")).await.unwrap();
    // B polls rarely: after its first try (which registers its interest) it waits
    // for the announcement, so its session stays up through the fence.
    let b = LockManager::connect(slow("ro-release-b").poll_interval(Duration::from_secs(30)))
        .await
        .unwrap();
    let name = unique_name("ro-release");
    let lease = a.acquire(name.as_str()).await.unwrap();
    // B waits, registered in the key's interest bucket: a release would announce.
    let _waiter = {
        let name = name.clone();
        tokio::spawn(async move { b.acquire(name.as_str()).await.map(|l| (b, l)) })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    for sql in [
        "ALTER SYSTEM SET default_transaction_read_only = on",
        "SELECT pg_reload_conf()",
    ] {
        admin.batch_execute(sql).await.unwrap();
    }
    // The reload reaches the other backends at their next statement.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let next_xid = |row: tokio_postgres::Row| row.get::<_, i64>(0);
    let before = next_xid(
        admin
            .query_one(
                "SELECT pg_snapshot_xmax(pg_current_snapshot())::text::int8",
                &[],
            )
            .await
            .unwrap(),
    );
    // Before A's next heartbeat (every 5 s) notices the fence.
    let _ = lease.release().await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let after = next_xid(
        admin
            .query_one(
                "SELECT pg_snapshot_xmax(pg_current_snapshot())::text::int8",
                &[],
            )
            .await
            .unwrap(),
    );
    for sql in [
        "ALTER SYSTEM RESET default_transaction_read_only",
        "SELECT pg_reload_conf()",
    ] {
        admin.batch_execute(sql).await.unwrap();
    }
    assert_eq!(
        before, after,
        "a transaction id was assigned (a commit written) on the read-only primary"
    );
}

/// Review 10, F1. The refusal of a cluster with smaller transaction ids lifted itself
/// once the new cluster's ids passed this process's last token, though other nodes may
/// have issued greater ones on the old cluster. Another cluster altogether (a new
/// system identifier: `pg_upgrade`, a restore into a new `initdb`, a logical copy) is
/// now accepted only when its timeline plus epoch is above the old tokens' high bits,
/// whatever its transaction ids.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_cluster_needs_higher_high_bits_whatever_its_ids() {
    let old = PgCluster::start_local().unwrap();
    let new = PgCluster::builder().own_initdb().start().unwrap();
    let (old_port, new_port) = (old.port().unwrap(), new.port().unwrap());
    let proxy = FaultProxy::start(([127, 0, 0, 1], old_port).into())
        .await
        .unwrap();
    let m = LockManager::connect(options(&proxy.url(&old.url(), old_port), "other-cluster"))
        .await
        .unwrap();
    let name = unique_name("other-cluster");
    let lease = m.acquire(name.as_str()).await.unwrap();
    let old_token = lease.fencing_token();
    lease.release().await.unwrap();
    // The new cluster has handed out far more ids than this process's last token.
    let admin_new = connect_admin(&new.url()).await.unwrap();
    for _ in 0..(old_token.xact_id() + 50) {
        admin_new
            .batch_execute("SELECT pg_current_xact_id()")
            .await
            .unwrap();
    }
    proxy.set_upstream(([127, 0, 0, 1], new_port).into());
    proxy.set(ProxyMode::Cut);
    tokio::time::sleep(Duration::from_millis(100)).await;
    proxy.set(ProxyMode::Pass);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if let ConnectionState::Disconnected {
            reason: SessionDownReason::ConnectFailed { message },
            ..
        } = m.connection_status()
            && message.contains("another cluster")
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not refused: {:?}",
            m.connection_status()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    admin_new
        .batch_execute("ALTER DATABASE postgres SET chosen.token_epoch = 1")
        .await
        .unwrap();
    let lease = tokio::time::timeout(Duration::from_secs(20), m.acquire(name.as_str()))
        .await
        .expect("granted once the new cluster's epoch is raised")
        .unwrap();
    assert!(lease.fencing_token() > old_token);
    assert_eq!(lease.fencing_token().timeline(), 2);
}
