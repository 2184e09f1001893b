//! A transaction pooler (pgbouncer, transaction mode) between a node and the server,
//! against real servers: either the node is refused at connect, or a lock it holds
//! through the pooler is not dropped behind its lease's back by another client of the
//! pool; and the node's session settings do not leak to the pool's other clients.
//! Skipped without pgbouncer outside CI.

use std::time::Duration;

use chosen_core::LockManager;
use chosen_tests::{PgBouncer, PgCluster, connect_admin, fault_options, unique_name};

/// A transaction pooler in front of `pg`, or `None` (test skipped) without pgbouncer.
fn bouncer(pg: &PgCluster, test: &str) -> Option<PgBouncer> {
    match PgBouncer::start(pg, "transaction", 1) {
        Ok(b) => Some(b),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            // In CI nothing skips: .ci/run installs pgbouncer.
            assert!(
                std::env::var("CI").is_err(),
                "{test} needs pgbouncer, which CI must install: {e}"
            );
            eprintln!("SKIPPED {test}: {e}");
            None
        }
        Err(e) => panic!("{e}"),
    }
}

/// The pooler check refuses only a *second* chosen client that lands on a backend
/// already marked. The first client behind a transaction pooler is accepted and holds
/// its locks on a backend the pooler also hands to every other client of the pool; any
/// of them can drop those locks (`pg_advisory_unlock_all()`, or `DISCARD ALL`, which
/// some drivers and poolers send on check-out) and chosen never notices: the heartbeat
/// checks the pid and the marker, not the locks. Another node then acquires while the
/// first lease stays valid, indefinitely.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_held_through_a_transaction_pooler_is_not_released_behind_its_back() {
    let pg = PgCluster::start_local().unwrap();
    let Some(bouncer) = bouncer(&pg, "pooled_lock") else {
        return;
    };
    let name = unique_name("pooled-lock");
    let pooled = match LockManager::connect(fault_options(&bouncer.url(), "pooled-a")).await {
        Ok(m) => m,
        // Refused up front: that is the fix.
        Err(_) => return,
    };
    let lease = pooled.acquire(name.as_str()).await.unwrap();

    // Another client of the same pool (an application that uses advisory locks itself).
    let app = connect_admin(&bouncer.url()).await.unwrap();
    app.batch_execute("SELECT pg_advisory_unlock_all()")
        .await
        .unwrap();

    let direct = LockManager::connect(fault_options(&pg.url(), "direct-b"))
        .await
        .unwrap();
    let other = direct.try_acquire(name.as_str()).await.unwrap();
    // Several heartbeats later.
    tokio::time::sleep(pooled.options().get_lease_timeout() * 2).await;
    assert!(
        !(lease.is_valid() && other.as_ref().is_some_and(chosen_core::Lease::is_valid)),
        "two holders at once: the pooled node's lease is valid (token {:?}) and the direct node holds token {:?}",
        lease.known_fencing_token(),
        other
            .as_ref()
            .and_then(chosen_core::Lease::known_fencing_token)
    );
}

/// Another client of the pool releases the node's locks and then takes an advisory
/// lock of its own on the same backend, in one statement: the backend holds as many
/// advisory locks as before, but not the node's. A guard that counted the session's
/// locks would see nothing wrong (and the node would keep its lease for ever while
/// another node holds the lock); the heartbeat checks which locks the session holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_released_behind_the_sessions_back_is_missed_even_when_another_takes_its_place() {
    let pg = PgCluster::start_local().unwrap();
    let Some(bouncer) = bouncer(&pg, "pooled_lock_replaced") else {
        return;
    };
    let name = unique_name("pooled-replaced");
    let pooled = match LockManager::connect(fault_options(&bouncer.url(), "pooled-c")).await {
        Ok(m) => m,
        // Refused up front: nothing can release its locks behind its back.
        Err(_) => return,
    };
    let lease = pooled.acquire(name.as_str()).await.unwrap();
    let app = connect_admin(&bouncer.url()).await.unwrap();
    app.batch_execute("SELECT pg_advisory_unlock_all(), pg_advisory_lock(424242)")
        .await
        .unwrap();
    let direct = LockManager::connect(fault_options(&pg.url(), "direct-d"))
        .await
        .unwrap();
    let other = direct.try_acquire(name.as_str()).await.unwrap();
    assert!(other.is_some(), "the lock was released: free to take");
    // The next heartbeat (well within this) ends the pooled node's lease.
    let deadline = tokio::time::Instant::now() + pooled.options().get_lease_timeout() * 3;
    while lease.is_valid() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        !lease.is_valid(),
        "two holders: the pooled node's lease is still valid (token {:?}) while the direct node holds token {:?}",
        lease.known_fencing_token(),
        other
            .as_ref()
            .and_then(chosen_core::Lease::known_fencing_token)
    );
}

/// The session settings (`statement_timeout`, `idle_session_timeout`,
/// `tcp_user_timeout`, `LISTEN`, the marker) are set before anything proves the backend
/// is ours alone, and stay on it. Behind a transaction pooler the backend serves every
/// client of the pool: after the chosen client has even shut down, an application's
/// statements through the pool are cancelled after `lease_timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_settings_do_not_leak_to_other_clients_of_a_pooler() {
    let pg = PgCluster::start_local().unwrap();
    let Some(bouncer) = bouncer(&pg, "settings_leak") else {
        return;
    };
    let app = connect_admin(&bouncer.url()).await.unwrap();
    let before: String = app
        .query_one("SHOW statement_timeout", &[])
        .await
        .unwrap()
        .get(0);
    if let Ok(m) = LockManager::connect(fault_options(&bouncer.url(), "pooled-settings")).await {
        m.shutdown().await;
    }
    let after: String = app
        .query_one("SHOW statement_timeout", &[])
        .await
        .unwrap()
        .get(0);
    let slow = app.batch_execute("SELECT pg_sleep(4)").await;
    assert!(
        before == after && slow.is_ok(),
        "another client of the pool now runs with statement_timeout {after} (was {before}); a 4 s query: {slow:?}"
    );
}
