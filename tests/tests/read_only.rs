//! A read-only server is no place to hold or win a lock, against real servers: a
//! session that is read-only (`default_transaction_read_only`) is refused at connect,
//! and on a primary fenced read-only (as a switchover may do before it promotes the
//! standby) the next heartbeat revokes every lease, no waiter wins, and a release
//! writes nothing.

use std::time::{Duration, Instant};

use chosen_core::{Error, LockManager, ManagerOptions, SessionDownReason};
use chosen_tests::{PgCluster, connect_admin, fault_options, unique_name};

/// A role whose sessions are read-only (`default_transaction_read_only = on`) connected
/// on a single-host URL, while a multi-host URL (read-write targeting) refused the same
/// server: one rule now, refused at connect with a clear reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_session_is_refused_at_connect() {
    use std::str::FromStr;

    let pg = PgCluster::start().unwrap();
    let admin = connect_admin(&pg.url()).await.unwrap();
    let role = unique_name("chosen_read_only").replace('-', "_");
    admin
        .batch_execute(&format!(
            "CREATE ROLE {role} LOGIN PASSWORD 'read-only-secret'; \
             ALTER ROLE {role} SET default_transaction_read_only = on;"
        ))
        .await
        .unwrap();
    let mut config = tokio_postgres::Config::from_str(&pg.url()).unwrap();
    config.user(&role).password("read-only-secret");
    let refused = LockManager::connect(ManagerOptions::from_pg_config(config).node_id("ro"))
        .await
        .expect_err("refused at connect");
    assert!(
        matches!(refused, Error::Refused(SessionDownReason::ServerReadOnly)),
        "{refused:?}"
    );
    assert!(refused.is_transient(), "a fenced primary may open again");
    let text = refused.to_string();
    assert!(text.contains("default_transaction_read_only"), "{text}");
}

/// A switchover that fences the old primary by making it read-only
/// (`ALTER SYSTEM SET default_transaction_read_only = on` and a reload) before promoting
/// its standby: holders on the old primary kept their leases (advisory locks work in
/// read-only transactions) while the new primary granted the same keys after its hold.
/// The next heartbeat now revokes them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_made_read_only_revokes_its_leases() {
    let pg = PgCluster::start_local().unwrap();
    let admin = connect_admin(&pg.url()).await.unwrap();
    let a =
        LockManager::connect(fault_options(&pg.url(), "fenced-a").term_grant_delay(Duration::ZERO))
            .await
            .unwrap();
    let lease = a.acquire(unique_name("read-only").as_str()).await.unwrap();
    let t0 = Instant::now();
    for sql in [
        "ALTER SYSTEM SET default_transaction_read_only = on",
        "SELECT pg_reload_conf()",
    ] {
        admin.batch_execute(sql).await.unwrap();
    }
    let reason = tokio::time::timeout(Duration::from_secs(5), lease.lost())
        .await
        .expect("the lease is revoked within a heartbeat or two");
    assert_eq!(
        reason,
        SessionDownReason::ServerReadOnly,
        "after {:?}",
        t0.elapsed()
    );
    // Opened again: the manager reconnects by itself and grants again.
    for sql in [
        "ALTER SYSTEM RESET default_transaction_read_only",
        "SELECT pg_reload_conf()",
    ] {
        admin.batch_execute(sql).await.unwrap();
    }
    let again = tokio::time::timeout(
        Duration::from_secs(20),
        a.acquire(unique_name("read-only-again").as_str()),
    )
    .await
    .expect("granted again once the server is writable")
    .unwrap();
    assert!(again.is_valid());
}

/// The lock attempts checked the backend and the marker, not whether the session is
/// writable: after a primary was fenced read-only, a waiter's next poll (before its
/// next heartbeat) won the key the revoked holder's session gave up, and wrote a token
/// record on the fenced primary. Now no try wins there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_wins_nothing_on_a_primary_made_read_only() {
    let pg = PgCluster::start_local().unwrap();
    let admin = connect_admin(&pg.url()).await.unwrap();
    let name = unique_name("read-only-waiter");
    let a = LockManager::connect(
        fault_options(&pg.url(), "fenced-holder").term_grant_delay(Duration::ZERO),
    )
    .await
    .unwrap();
    // The waiter's heartbeat is rare: its polls (every 100 ms), not its heartbeat,
    // are what meet the fence first.
    let b = LockManager::connect(
        fault_options(&pg.url(), "fenced-waiter")
            .term_grant_delay(Duration::ZERO)
            .heartbeat_interval(Duration::from_secs(5))
            .lease_timeout(Duration::from_secs(12))
            .server_release_after(Duration::from_secs(30)),
    )
    .await
    .unwrap();
    let lease = a.acquire(name.as_str()).await.unwrap();
    let waiter = {
        let name = name.clone();
        tokio::spawn(async move {
            let lease = b.acquire(name.as_str()).await;
            (Instant::now(), b, lease)
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    for sql in [
        "ALTER SYSTEM SET default_transaction_read_only = on",
        "SELECT pg_reload_conf()",
    ] {
        admin.batch_execute(sql).await.unwrap();
    }
    let fenced_at = Instant::now();
    tokio::time::timeout(Duration::from_secs(5), lease.lost())
        .await
        .expect("the holder is revoked");
    // Read-only for 3 s: the waiter must not be granted meanwhile.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        !waiter.is_finished(),
        "the waiter was granted on a read-only primary"
    );
    for sql in [
        "ALTER SYSTEM RESET default_transaction_read_only",
        "SELECT pg_reload_conf()",
    ] {
        admin.batch_execute(sql).await.unwrap();
    }
    let (granted_at, _b, got) = tokio::time::timeout(Duration::from_secs(20), waiter)
        .await
        .expect("granted once writable again")
        .unwrap();
    assert!(got.is_ok(), "{got:?}");
    assert!(granted_at - fenced_at >= Duration::from_secs(3));
}

/// A release on a primary fenced read-only sent a `NOTIFY`, which commits (and writes
/// WAL) even in a read-only transaction: the fenced primary's WAL moved on after a
/// switchover checked it. Now nothing is announced there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_on_a_read_only_primary_writes_nothing() {
    let pg = PgCluster::start_local().unwrap();
    let admin = connect_admin(&pg.url()).await.unwrap();
    let slow = |node: &str| {
        fault_options(&pg.url(), node)
            .term_grant_delay(Duration::ZERO)
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
