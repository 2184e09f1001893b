//! Fencing tokens stay above every token issued before a move to another cluster,
//! against real servers: a token epoch (`ManagerOptions::token_epoch`, or the server's
//! own `chosen.token_epoch`) raises the tokens' high bits; a cluster whose transaction
//! ids restarted (a logical cutover, a dump and restore) is refused until its epoch
//! lifts its tokens above the old ones; and another cluster altogether (a new system
//! identifier) is accepted only with high bits above the old tokens', whatever its
//! transaction ids.

use std::time::{Duration, Instant};

use chosen_core::{ConnectionState, Error, LockManager, SessionDownReason};
use chosen_tests::{FaultProxy, PgCluster, ProxyMode, connect_admin, prompt_options, unique_name};

/// `pg_upgrade`, a logical cutover or a dump and restore start a cluster on timeline 1
/// again, so tokens would go backwards; the token epoch raises the high bits above the
/// old cluster's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_token_epoch_raises_the_high_bits() {
    let pg = PgCluster::start().unwrap();
    let plain = LockManager::connect(
        prompt_options(&pg.url(), "epoch-0")
            .reconnect_backoff(Duration::from_millis(50), Duration::from_millis(300)),
    )
    .await
    .unwrap();
    let name = unique_name("epoch");
    let lease = plain.acquire(name.as_str()).await.unwrap();
    let before = lease.fencing_token().await.unwrap();
    lease.release().await.unwrap();
    let raised = LockManager::connect(
        prompt_options(&pg.url(), "epoch-3")
            .reconnect_backoff(Duration::from_millis(50), Duration::from_millis(300))
            .token_epoch(3),
    )
    .await
    .unwrap();
    let after = raised
        .acquire(name.as_str())
        .await
        .unwrap()
        .fencing_token()
        .await
        .unwrap();
    assert_eq!(after.timeline(), before.timeline() + 3);
    assert!(after > before);

    let err = LockManager::connect(
        prompt_options(&pg.url(), "epoch-big")
            .reconnect_backoff(Duration::from_millis(50), Duration::from_millis(300))
            .token_epoch(40_000),
    )
    .await
    .expect_err("refused");
    assert!(matches!(err, Error::InvalidConfig { .. }), "{err:?}");
    assert!(err.to_string().contains("token_epoch"), "{err}");
    let err = LockManager::connect(
        prompt_options(&pg.url(), "epoch-edge")
            .reconnect_backoff(Duration::from_millis(50), Duration::from_millis(300))
            .token_epoch(32_767),
    )
    .await
    .expect_err("timeline + epoch too large");
    assert!(err.to_string().contains("token_epoch 32767"), "{err}");
}

/// A logical cutover (or a dump and restore) from a cluster on timeline 1 to a new
/// cluster on timeline 1: transaction ids restart, so tokens would go backwards in
/// their low bits. The manager refuses the new server until its next token is above
/// every token it issued, and the server's own `chosen.token_epoch` (set on the new
/// cluster only) lifts it there, without touching the nodes.
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
    let m = LockManager::connect(
        prompt_options(&proxy.url(&old.url(), old_port), "cutover")
            .reconnect_backoff(Duration::from_millis(50), Duration::from_millis(300)),
    )
    .await
    .unwrap();
    let name = unique_name("cutover");
    let lease = m.acquire(name.as_str()).await.unwrap();
    let old_token = lease.fencing_token().await.unwrap();
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
    let new_token = lease.fencing_token().await.unwrap();
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
    let err = LockManager::connect(
        prompt_options(&new.url(), "bad-epoch")
            .reconnect_backoff(Duration::from_millis(50), Duration::from_millis(300)),
    )
    .await
    .expect_err("refused");
    assert!(err.to_string().contains("chosen.token_epoch"), "{err}");
}

/// The refusal of a cluster with smaller transaction ids lifted itself once the new
/// cluster's ids passed this process's last token, though other nodes may have issued
/// greater ones on the old cluster. Another cluster altogether (a new system
/// identifier: `pg_upgrade`, a restore into a new `initdb`, a logical copy) is now
/// accepted only when its timeline plus epoch is above the old tokens' high bits,
/// whatever its transaction ids.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_cluster_needs_higher_high_bits_whatever_its_ids() {
    let old = PgCluster::start_local().unwrap();
    let new = PgCluster::builder().own_initdb().start().unwrap();
    let (old_port, new_port) = (old.port().unwrap(), new.port().unwrap());
    let proxy = FaultProxy::start(([127, 0, 0, 1], old_port).into())
        .await
        .unwrap();
    let m = LockManager::connect(
        prompt_options(&proxy.url(&old.url(), old_port), "other-cluster")
            .reconnect_backoff(Duration::from_millis(50), Duration::from_millis(300)),
    )
    .await
    .unwrap();
    let name = unique_name("other-cluster");
    let lease = m.acquire(name.as_str()).await.unwrap();
    let old_token = lease.fencing_token().await.unwrap();
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
    assert!(lease.fencing_token().await.unwrap() > old_token);
    assert_eq!(lease.fencing_token().await.unwrap().timeline(), 2);
}
