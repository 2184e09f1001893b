//! Poolers between a node and the server, against real servers (PgBouncer): a
//! transaction pooler is refused at connect by the exclusion self-test, and leaves
//! nothing of the node on its backends; a session pooler is not; and where a pooler
//! shares the backend anyway (the self-test turned off, as a server that changes after
//! it passed), the heartbeat sees the locks released behind the session's back.
//! Skipped without pgbouncer outside CI.

use std::time::Duration;

use chosen_core::{Error, LockManager, SessionDownReason};
use chosen_tests::{PgBouncer, PgCluster, connect_admin, fault_options, unique_name};

/// A pooler in `mode` with `size` backends in front of `pg`, or `None` (test skipped)
/// without pgbouncer.
fn bouncer_in(pg: &PgCluster, mode: &str, size: u32, test: &str) -> Option<PgBouncer> {
    match PgBouncer::start(pg, mode, size) {
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

/// A transaction pooler with one backend in front of `pg`.
fn bouncer(pg: &PgCluster, test: &str) -> Option<PgBouncer> {
    bouncer_in(pg, "transaction", 1, test)
}

/// The advisory locks held on the server, by anyone.
async fn advisory_locks(pg: &PgCluster) -> i64 {
    let admin = connect_admin(&pg.url()).await.unwrap();
    admin
        .query_one(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

/// The first client of a transaction pooler, with one backend or several, is refused
/// at connect: a key its session took was granted to a second connection, served by
/// the same backend, or its own statements moved to another backend. Nothing of it
/// stays on the pool's backends: no advisory lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_pooler_is_refused_at_connect() {
    let pg = PgCluster::start_local().unwrap();
    for size in [1, 4] {
        let Some(bouncer) = bouncer_in(&pg, "transaction", size, "transaction_pooler") else {
            return;
        };
        let err = LockManager::connect(fault_options(&bouncer.url(), "pooled"))
            .await
            .expect_err("a transaction pooler is refused");
        assert!(
            matches!(
                err,
                Error::Refused(SessionDownReason::PoolerDetected { .. })
            ),
            "{size} backends: {err}"
        );
        assert!(err.to_string().contains("pooler"), "{err}");
        eprintln!("{size} backends: {err}");
        assert_eq!(advisory_locks(&pg).await, 0, "{size} backends: {err}");
    }
}

/// A round-robin TCP balancer on loopback in front of `upstreams`: each accepted
/// connection goes to the next one. Stops when dropped.
struct Balancer {
    port: u16,
    task: tokio::task::JoinHandle<()>,
}

impl Balancer {
    async fn start(upstreams: Vec<u16>) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let task = tokio::spawn(async move {
            for next in (0..upstreams.len()).cycle() {
                let Ok((mut client, _)) = listener.accept().await else {
                    return;
                };
                let upstream = upstreams[next];
                tokio::spawn(async move {
                    if let Ok(mut server) =
                        tokio::net::TcpStream::connect(("127.0.0.1", upstream)).await
                    {
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    }
                });
            }
        });
        Self { port, task }
    }
}

impl Drop for Balancer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Two transaction poolers (one backend each) behind a round-robin balancer: the
/// self-test's second connection lands in the other pool, and the session's statements
/// stay on its own backend, so backends alone would not tell; but a notification to
/// the session's backend cannot reach it while it is idle, and it is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transaction_poolers_behind_a_balancer_are_refused_at_connect() {
    let pg = PgCluster::start_local().unwrap();
    let (Some(one), Some(two)) = (
        bouncer_in(&pg, "transaction", 1, "balanced_poolers"),
        bouncer_in(&pg, "transaction", 1, "balanced_poolers"),
    ) else {
        return;
    };
    let port = |url: String| -> u16 {
        let config: tokio_postgres::Config = url.parse().unwrap();
        config.get_ports()[0]
    };
    let balancer = Balancer::start(vec![port(one.url()), port(two.url())]).await;
    let url = one.url().replace(
        &format!(":{}/", port(one.url())),
        &format!(":{}/", balancer.port),
    );
    assert_ne!(url, one.url());
    for _ in 0..3 {
        let err = LockManager::connect(fault_options(&url, "balanced"))
            .await
            .expect_err("poolers behind a balancer are refused");
        assert!(
            matches!(
                err,
                Error::Refused(SessionDownReason::PoolerDetected { .. })
            ),
            "{err}"
        );
        eprintln!("balanced: {err}");
    }
    assert_eq!(advisory_locks(&pg).await, 0);
}

/// A session pooler gives each client a backend of its own for as long as it is
/// connected: the self-test passes, and the node holds locks through it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_pooler_is_accepted() {
    let pg = PgCluster::start_local().unwrap();
    let Some(bouncer) = bouncer_in(&pg, "session", 4, "session_pooler") else {
        return;
    };
    let m = LockManager::connect(fault_options(&bouncer.url(), "session-pooled"))
        .await
        .expect("a session pooler is accepted");
    let lease = m
        .acquire(unique_name("session-pooled").as_str())
        .await
        .unwrap();
    assert!(lease.is_valid());
    lease.release().await.unwrap();
    m.shutdown().await;
}

/// Behind a transaction pooler (the self-test off, as for a server that changed after
/// it passed), the node holds its locks on a backend the pooler also hands to every
/// other client of the pool; any of them can drop those locks
/// (`pg_advisory_unlock_all()`, or `DISCARD ALL`, which some drivers and poolers send
/// on check-out). The heartbeat checks which locks the session holds, so the lease
/// ends before another node can hold the lock with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_held_through_a_transaction_pooler_is_not_released_behind_its_back() {
    let pg = PgCluster::start_local().unwrap();
    let Some(bouncer) = bouncer(&pg, "pooled_lock") else {
        return;
    };
    let name = unique_name("pooled-lock");
    let pooled = LockManager::connect(
        fault_options(&bouncer.url(), "pooled-a").without_exclusion_self_test(),
    )
    .await
    .unwrap();
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
    let pooled = LockManager::connect(
        fault_options(&bouncer.url(), "pooled-c").without_exclusion_self_test(),
    )
    .await
    .unwrap();
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
