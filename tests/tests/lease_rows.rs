//! The lease-row mode against real servers, through PgBouncer in transaction mode
//! (where session advisory locks are refused): rows exclude, renew, hand over with
//! larger tokens, and are taken over only once they expired by the server's clock.

use std::time::{Duration, Instant};

use chosen_core::{
    Election, Error, Leadership, LockKey, LockManager, ManagerOptions, Observer, ObserverOptions,
};
use chosen_tests::{PgBouncer, PgCluster, connect_admin, in_ci, leader_of, unique_name};
use deadpool_postgres::Pool;

fn pool(url: &str, size: usize) -> Pool {
    let config: tokio_postgres::Config = url.parse().unwrap();
    Pool::builder(deadpool_postgres::Manager::new(
        config,
        tokio_postgres::NoTls,
    ))
    .max_size(size)
    .build()
    .unwrap()
}

/// Fast timings for tests, with room for a loaded machine: a heartbeat every 200 ms,
/// leases trusted 1 s past a renewal's send, rows living 2 s past it.
fn options(node: &str) -> ManagerOptions {
    ManagerOptions::pooled()
        .node_id(node)
        .heartbeat_interval(Duration::from_millis(200))
        .lease_timeout(Duration::from_millis(1000))
        .stop_budget(Duration::from_millis(500))
        .safety_margin(Duration::from_millis(200))
        .server_release_after(Duration::from_millis(2000))
        .poll_interval(Duration::from_millis(50))
        .term_grant_delay(Duration::ZERO)
        .reconnect_backoff(Duration::from_millis(20), Duration::from_millis(200))
}

/// Waits (at most 10 s) until `leadership` names `leader`.
async fn until_leader(leadership: &Leadership, leader: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while leadership.leader().as_deref() != Some(leader) {
        assert!(
            Instant::now() < deadline,
            "the observer shows {:?}, not {leader}",
            leadership.leader()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn bouncer(pg: &PgCluster, test: &str) -> Option<PgBouncer> {
    match PgBouncer::start(pg, "transaction", 2) {
        Ok(b) => Some(b),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && !in_ci() => {
            eprintln!("SKIPPED {test}: {e}");
            None
        }
        Err(e) => panic!("{e}"),
    }
}

/// Two managers on pools through a transaction pooler: one holds a name, the other
/// cannot take it while the holder renews it (for several lifetimes of a row), sees
/// who holds it, and takes it at its next poll once it is released, with a larger
/// token; an observer reading the rows follows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_rows_exclude_renew_and_hand_over_through_a_transaction_pooler() {
    let pg = PgCluster::start_local().unwrap();
    let Some(bouncer) = bouncer(
        &pg,
        "lease_rows_exclude_renew_and_hand_over_through_a_transaction_pooler",
    ) else {
        return;
    };
    let name = unique_name("rows");
    let a = LockManager::connect_pooled(pool(&bouncer.url(), 2), options("rows-a"))
        .await
        .unwrap();
    let b = LockManager::connect_pooled(pool(&bouncer.url(), 2), options("rows-b"))
        .await
        .unwrap();
    let lease = a.acquire(name.as_str()).await.unwrap();
    let first = lease.fencing_token().await.unwrap();
    // Past two lifetimes of a row: the heartbeat renews it.
    tokio::time::sleep(Duration::from_millis(4500)).await;
    assert!(lease.is_valid(), "the renewed lease is still valid");
    assert!(b.try_acquire(name.as_str()).await.unwrap().is_none());
    let holder = b.holder(name.as_str()).await.unwrap().expect("a holder");
    assert_eq!(holder.node_id, "rows-a");
    let observer = Observer::new(
        pool(&bouncer.url(), 1),
        ObserverOptions::default()
            .node_id("rows-observer")
            .poll_interval(Duration::from_millis(50))
            .lease_rows(true),
    )
    .unwrap();
    let seen = observer.watch(&name).unwrap();
    until_leader(&seen, "rows-a").await;

    let waiting = tokio::spawn({
        let b = b.clone();
        let name = name.clone();
        async move { b.acquire(name.as_str()).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let released = Instant::now();
    lease.release().await.unwrap();
    let taken = tokio::time::timeout(Duration::from_secs(5), waiting)
        .await
        .expect("the waiter takes the released name")
        .unwrap()
        .unwrap();
    let hand_over = released.elapsed();
    let second = taken.fencing_token().await.unwrap();
    assert!(second > first, "{second:?} after {first:?}");
    assert!(hand_over < Duration::from_secs(2), "{hand_over:?}");
    eprintln!(
        "LEASE ROWS hand-over through PgBouncer: {} ms",
        hand_over.as_millis()
    );
    drop(taken);
    a.shutdown().await;
    b.shutdown().await;
}

/// A holder that stops renewing (its manager's task gone, as in a crash) keeps its
/// row until the row expires by the server's clock: no other node takes it before,
/// and one takes it soon after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_that_is_not_renewed_is_taken_over_only_once_it_expired() {
    let pg = PgCluster::start_local().unwrap();
    let Some(bouncer) = bouncer(
        &pg,
        "a_row_that_is_not_renewed_is_taken_over_only_once_it_expired",
    ) else {
        return;
    };
    let name = unique_name("rows-expire");
    let b = LockManager::connect_pooled(pool(&bouncer.url(), 2), options("rows-b"))
        .await
        .unwrap();
    // A's manager lives on a runtime of its own, dropped whole to stop it dead: no
    // release, no renewal, no deletion of its rows.
    let url = bouncer.url();
    let held = name.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    let a_thread = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let a = LockManager::connect_pooled(pool(&url, 2), options("rows-a"))
                .await
                .unwrap();
            let lease = a.acquire(held.as_str()).await.unwrap();
            // A crash: neither the lease nor the manager gets to say goodbye.
            #[allow(clippy::mem_forget)]
            {
                std::mem::forget(lease);
                std::mem::forget(a);
            }
        });
        tx.send(Instant::now()).unwrap();
        // Dropping the runtime drops every task without running any further.
        drop(runtime);
    });
    let stopped = tokio::task::spawn_blocking(move || rx.recv().unwrap())
        .await
        .unwrap();
    a_thread.join().unwrap();
    let taken = tokio::time::timeout(Duration::from_secs(10), b.acquire(name.as_str()))
        .await
        .expect("B takes the expired row")
        .unwrap();
    let after = stopped.elapsed();
    // The row lives server_release_after (1.6 s) past its last renewal, which was at
    // most a heartbeat (100 ms) before A stopped.
    assert!(
        after >= Duration::from_millis(1400),
        "taken {after:?} after A stopped"
    );
    assert!(
        after < Duration::from_secs(4),
        "taken {after:?} after A stopped"
    );
    eprintln!(
        "LEASE ROWS takeover of an unrenewed row: {} ms",
        after.as_millis()
    );
    drop(taken);
    b.shutdown().await;
}

/// Bad input: options made for a pool cannot open a session of their own, and a pool
/// that cannot connect is a clear error, not a hang.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lease_row_mode_says_what_is_wrong() {
    let Err(error) = LockManager::connect(ManagerOptions::pooled()).await else {
        panic!("pooled options name no server");
    };
    assert!(error.to_string().contains("connect_pooled"), "{error}");
    let dead = pool("postgres://nobody@127.0.0.1:1/none", 1);
    let started = Instant::now();
    let Err(error) = LockManager::connect_pooled(
        dead,
        options("rows-dead").connect_timeout(Duration::from_secs(2)),
    )
    .await
    else {
        panic!("no server");
    };
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(
        matches!(error, Error::Pool { .. } | Error::ConnectTimeout { .. }),
        "{error:?}"
    );
    // A role that may not create the tables is told to run the migration.
    let pg = PgCluster::start_local().unwrap();
    let admin = connect_admin(&pg.url()).await.unwrap();
    admin
        .batch_execute(
            "CREATE ROLE rows_reader LOGIN PASSWORD 'rows-secret'; REVOKE CREATE ON SCHEMA public FROM PUBLIC; REVOKE CREATE ON SCHEMA public FROM rows_reader;",
        )
        .await
        .unwrap();
    let mut config: tokio_postgres::Config = pg.url().parse().unwrap();
    config.user("rows_reader").password("rows-secret");
    let limited = Pool::builder(deadpool_postgres::Manager::new(
        config,
        tokio_postgres::NoTls,
    ))
    .max_size(1)
    .build()
    .unwrap();
    let Err(error) = LockManager::connect_pooled(limited, options("rows-limited")).await else {
        panic!("no tables");
    };
    assert!(error.to_string().contains("lease_tables_sql"), "{error}");
    // A role that may read the tables but not write them is told at connect.
    admin
        .batch_execute(&chosen_core::lease_tables_sql("public"))
        .await
        .unwrap();
    admin
        .batch_execute(
            "GRANT SELECT ON chosen_lease, chosen_lease_fence, chosen_lease_counter TO rows_reader",
        )
        .await
        .unwrap();
    let mut config: tokio_postgres::Config = pg.url().parse().unwrap();
    config.user("rows_reader").password("rows-secret");
    let reader = Pool::builder(deadpool_postgres::Manager::new(
        config,
        tokio_postgres::NoTls,
    ))
    .max_size(1)
    .build()
    .unwrap();
    let Err(error) = LockManager::connect_pooled(reader, options("rows-reader")).await else {
        panic!("a role that may not write the tables");
    };
    assert!(
        error.to_string().contains("GRANT SELECT, INSERT"),
        "{error}"
    );
    // A lease table made by an earlier version (no `hand_to`): a role that does not own
    // it is told to run the migration again; the owner's connect adds the column.
    admin
        .batch_execute(
            "GRANT INSERT, UPDATE, DELETE ON chosen_lease, chosen_lease_fence TO rows_reader; \
             GRANT UPDATE ON chosen_lease_counter TO rows_reader; \
             ALTER TABLE chosen_lease DROP COLUMN hand_to",
        )
        .await
        .unwrap();
    let mut config: tokio_postgres::Config = pg.url().parse().unwrap();
    config.user("rows_reader").password("rows-secret");
    let writer = Pool::builder(deadpool_postgres::Manager::new(
        config,
        tokio_postgres::NoTls,
    ))
    .max_size(1)
    .build()
    .unwrap();
    let Err(error) = LockManager::connect_pooled(writer, options("rows-writer")).await else {
        panic!("a lease table without hand_to, which this role may not alter");
    };
    assert!(
        error.to_string().contains("hand_to") && error.to_string().contains("lease_tables_sql"),
        "{error}"
    );
    let owner = LockManager::connect_pooled(pool(&pg.url(), 1), options("rows-owner"))
        .await
        .expect("the owner's connect adds the column");
    assert!(
        owner
            .try_acquire(unique_name("rows-upgraded").as_str())
            .await
            .unwrap()
            .is_some()
    );
    owner.shutdown().await;
    // A schema that is not a plain identifier.
    let Err(error) = LockManager::connect_pooled(
        pool(&pg.url(), 1),
        options("rows-schema").lease_schema("x\"; DROP TABLE y; --"),
    )
    .await
    else {
        panic!("a bad schema");
    };
    assert!(matches!(error, Error::InvalidConfig { .. }), "{error:?}");
    // A standby.
    let standby = pg.start_standby().unwrap();
    let Err(error) =
        LockManager::connect_pooled(pool(&standby.url(), 1), options("rows-standby")).await
    else {
        panic!("a standby");
    };
    assert!(
        matches!(
            error,
            Error::Refused(chosen_core::SessionDownReason::ServerInRecovery)
        ),
        "{error:?}"
    );
}

/// Nodes whose connections search other schemas first (a role's own schema with tables
/// of the same names, an application's `search_path`) still share the one schema the
/// options name: the name stays exclusive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_node_uses_the_named_schema_whatever_its_search_path() {
    let pg = PgCluster::start_local().unwrap();
    let admin = connect_admin(&pg.url()).await.unwrap();
    admin
        .batch_execute(&format!(
            "CREATE SCHEMA decoy; {}",
            chosen_core::lease_tables_sql("decoy")
        ))
        .await
        .unwrap();
    let mut config: tokio_postgres::Config = pg.url().parse().unwrap();
    config.options("-c search_path=decoy,public");
    let decoyed = Pool::builder(deadpool_postgres::Manager::new(
        config,
        tokio_postgres::NoTls,
    ))
    .max_size(2)
    .build()
    .unwrap();
    let name = unique_name("rows-schema");
    let a = LockManager::connect_pooled(decoyed, options("rows-a"))
        .await
        .unwrap();
    let b = LockManager::connect_pooled(pool(&pg.url(), 2), options("rows-b"))
        .await
        .unwrap();
    let held = a.acquire(name.as_str()).await.unwrap();
    assert!(b.try_acquire(name.as_str()).await.unwrap().is_none());
    let rows: i64 = admin
        .query_one("SELECT count(*) FROM decoy.chosen_lease", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(rows, 0, "nothing was written to the decoy schema");
    drop(held);
    a.shutdown().await;
    b.shutdown().await;
}

/// A fleet that moves from advisory locks to lease rows on the same server: a key an
/// advisory-lock session holds is not taken as a row, and the first row token is above
/// every token the advisory-lock mode issued there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_rows_respect_advisory_holders_and_their_tokens() {
    let pg = PgCluster::start_local().unwrap();
    let name = unique_name("rows-modes");
    let advisory = LockManager::connect(chosen_tests::unheld_options(&pg.url(), "advisory"))
        .await
        .unwrap();
    // Burn transaction ids, so that advisory tokens are far above a fresh counter.
    let admin = connect_admin(&pg.url()).await.unwrap();
    for _ in 0..50 {
        admin
            .batch_execute("SELECT pg_current_xact_id()")
            .await
            .unwrap();
    }
    let lease = advisory.acquire(name.as_str()).await.unwrap();
    let advisory_token = lease.fencing_token().await.unwrap();
    let rows = LockManager::connect_pooled(pool(&pg.url(), 2), options("rows"))
        .await
        .unwrap();
    assert!(
        rows.try_acquire(name.as_str()).await.unwrap().is_none(),
        "a key held as an advisory lock is not taken as a row"
    );
    drop(lease);
    advisory.shutdown().await;
    let taken = tokio::time::timeout(Duration::from_secs(5), rows.acquire(name.as_str()))
        .await
        .expect("taken once the advisory holder is gone")
        .unwrap();
    let row_token = taken.fencing_token().await.unwrap();
    assert!(
        row_token > advisory_token,
        "{row_token:?} after {advisory_token:?}"
    );
    drop(taken);
    rows.shutdown().await;
}

/// The session keeps a connection of the pool for itself: an application that holds
/// every other connection does not starve its renewals.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_application_holding_the_rest_of_the_pool_does_not_end_the_lease() {
    let pg = PgCluster::start_local().unwrap();
    let shared = pool(&pg.url(), 2);
    let manager = LockManager::connect_pooled(shared.clone(), options("rows-starved"))
        .await
        .unwrap();
    let lease = manager
        .acquire(unique_name("rows-starved").as_str())
        .await
        .unwrap();
    let taken = shared.get().await.unwrap();
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert!(
        lease.is_valid(),
        "renewed while the application holds the rest"
    );
    drop(taken);
    drop(lease);
    manager.shutdown().await;
}

/// A row deleted behind the session's back (an operator "unsticking" a lock) ends the
/// session, said as a lease row gone, not as a pooler's doing; the node holds the name
/// again once its next session takes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_deleted_behind_the_sessions_back_ends_the_session() {
    let pg = PgCluster::start_local().unwrap();
    let admin = connect_admin(&pg.url()).await.unwrap();
    let manager = LockManager::connect_pooled(pool(&pg.url(), 2), options("rows-deleted"))
        .await
        .unwrap();
    let name = unique_name("rows-deleted");
    let lease = manager.acquire(name.as_str()).await.unwrap();
    let chosen_core::LockKey::Pair(a, b) = manager.key_for(&name) else {
        panic!("names derive pair keys");
    };
    let packed = (i64::from(a) << 32) | i64::from(b as u32);
    let deleted = admin
        .execute(
            "DELETE FROM chosen_lease WHERE form = 2 AND key = $1",
            &[&packed],
        )
        .await
        .unwrap();
    assert_eq!(deleted, 1);
    let reason = tokio::time::timeout(Duration::from_secs(5), lease.lost())
        .await
        .expect("the session ends");
    assert!(!lease.is_valid());
    assert!(reason.to_string().contains("lease row"), "{reason}");
    drop(lease);
    let again = tokio::time::timeout(Duration::from_secs(10), manager.acquire(name.as_str()))
        .await
        .expect("held again")
        .unwrap();
    drop(again);
    manager.shutdown().await;
}

/// A connection the application gave back to the pool inside an open transaction is
/// not adopted (nothing of the session would ever commit): the connect says so and the
/// next one takes another connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_left_in_a_transaction_is_not_adopted() {
    let pg = PgCluster::start_local().unwrap();
    let shared = pool(&pg.url(), 1);
    {
        let leaked = shared.get().await.unwrap();
        leaked.batch_execute("BEGIN; SELECT 1").await.unwrap();
    }
    let Err(error) = LockManager::connect_pooled(shared.clone(), options("rows-leaked")).await
    else {
        panic!("a connection inside a transaction is refused");
    };
    assert!(error.to_string().contains("open transaction"), "{error}");
    assert!(error.is_transient(), "{error:?}");
    let manager = LockManager::connect_pooled(shared, options("rows-leaked"))
        .await
        .unwrap();
    let lease = manager
        .acquire(unique_name("rows-leaked").as_str())
        .await
        .unwrap();
    let admin = connect_admin(&pg.url()).await.unwrap();
    let visible: i64 = admin
        .query_one("SELECT count(*) FROM chosen_lease", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(visible, 1, "the row is committed");
    drop(lease);
    manager.shutdown().await;
}

/// Managers whose connections default to a stricter isolation level win and draw
/// tokens at the same moments without losing their sessions to serialization failures.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strict_default_isolation_does_not_end_sessions() {
    let pg = PgCluster::start_local().unwrap();
    let strict = || {
        let mut config: tokio_postgres::Config = pg.url().parse().unwrap();
        config.options("-c default_transaction_isolation=serializable");
        Pool::builder(deadpool_postgres::Manager::new(
            config,
            tokio_postgres::NoTls,
        ))
        .max_size(2)
        .build()
        .unwrap()
    };
    let a = LockManager::connect_pooled(strict(), options("rows-strict-a"))
        .await
        .unwrap();
    let b = LockManager::connect_pooled(strict(), options("rows-strict-b"))
        .await
        .unwrap();
    let run = |m: LockManager, prefix: &'static str| async move {
        for i in 0..30 {
            let lease = m.acquire(format!("{prefix}-{i}").as_str()).await.unwrap();
            lease.fencing_token().await.unwrap();
            lease.release().await.unwrap();
        }
        m
    };
    let (a, b) = tokio::join!(run(a, "strict-a"), run(b, "strict-b"));
    for m in [&a, &b] {
        assert!(
            matches!(
                m.connection_status(),
                chosen_core::ConnectionState::Connected { generation: 1, .. }
            ),
            "{:?}",
            m.connection_status()
        );
    }
    a.shutdown().await;
    b.shutdown().await;
}

/// An observer of lease rows does not read through a connection the application left
/// inside a transaction (its snapshot would show an old holder): the read fails, that
/// connection is closed, and the next read shows the holder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_observer_does_not_read_lease_rows_inside_a_leaked_transaction() {
    let pg = PgCluster::start_local().unwrap();
    let manager = LockManager::connect_pooled(pool(&pg.url(), 2), options("rows-watched"))
        .await
        .unwrap();
    let name = unique_name("rows-watched");
    let lease = manager.acquire(name.as_str()).await.unwrap();
    let shared = pool(&pg.url(), 1);
    {
        let leaked = shared.get().await.unwrap();
        leaked.batch_execute("BEGIN; SELECT 1").await.unwrap();
    }
    let observer = Observer::new(
        shared,
        ObserverOptions::default()
            .node_id("rows-watcher")
            .lease_rows(true),
    )
    .unwrap();
    let Err(error) = observer.holders(&[name.as_str()]).await else {
        panic!("a read inside a leaked transaction is refused");
    };
    assert!(error.to_string().contains("open transaction"), "{error}");
    let holders = observer.holders(&[name.as_str()]).await.unwrap();
    assert_eq!(
        holders[0].as_ref().map(|h| h.node_id.as_str()),
        Some("rows-watched")
    );
    drop(lease);
    manager.shutdown().await;
}

/// `hand_over_to` in the lease-row mode: the release keeps the row for the named node
/// (no announcement reaches a pool, so the others' hold is at the server), which takes
/// it at its next poll while every other node polls too; a row kept for a node that is
/// not there is taken by another once the hold is over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_rows_hand_over_to_the_named_node_through_a_transaction_pooler() {
    let pg = PgCluster::start_local().unwrap();
    let Some(bouncer) = bouncer(
        &pg,
        "lease_rows_hand_over_to_the_named_node_through_a_transaction_pooler",
    ) else {
        return;
    };
    let name = unique_name("rows-hand");
    let nodes = ["rows-ha", "rows-hb", "rows-hc"];
    let mut elections = Vec::new();
    let mut managers = Vec::new();
    for node in nodes {
        let m = LockManager::connect_pooled(pool(&bouncer.url(), 2), options(node))
            .await
            .unwrap();
        elections.push((node, Election::start(&m, name.as_str()).unwrap()));
        managers.push(m);
    }
    let leader = async |limit: Duration| leader_of(&elections, limit).await.0;
    let mut took = Vec::new();
    for round in 0..6 {
        let from = leader(Duration::from_secs(10)).await;
        let to = nodes
            .iter()
            .cycle()
            .skip(round + 1)
            .find(|n| **n != from)
            .unwrap();
        let t0 = Instant::now();
        elections
            .iter()
            .find(|(n, _)| *n == from)
            .unwrap()
            .1
            .hand_over_to(to);
        let next = loop {
            let now = leader(Duration::from_secs(5)).await;
            if now != from {
                break now;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        };
        assert_eq!(
            next, *to,
            "round {round}: handed from {from} to {to}, {next} took it"
        );
        took.push(t0.elapsed());
        // Settled before the next round.
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    took.sort();
    eprintln!("LEASE ROWS hand-over to a named node: {took:?}");
    assert!(took[took.len() - 1] < Duration::from_secs(2), "{took:?}");
    // Kept for a node that is not there: another takes it once the hold is over.
    let from = leader(Duration::from_secs(5)).await;
    let t0 = Instant::now();
    elections
        .iter()
        .find(|(n, _)| *n == from)
        .unwrap()
        .1
        .hand_over_to("rows-nobody");
    loop {
        let now = leader(Duration::from_secs(10)).await;
        if now != from {
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let after = t0.elapsed();
    assert!(
        after >= Duration::from_millis(900),
        "taken {after:?} after a hand-over to nobody: before the hold ended"
    );
    for (_, e) in &elections {
        e.shutdown().await;
    }
    for m in managers {
        m.shutdown().await;
    }
}

/// A release, and a token draw, that meet the session's row locked by another statement
/// (here an open transaction holding it `FOR UPDATE`, as another node's try holds a row
/// it found live only as it conflicted) wait for that transaction and go on, instead of
/// taking the row for gone and ending the session: the manager's other leases stay
/// valid.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_or_token_draw_waits_for_a_statement_holding_its_row() {
    let pg = PgCluster::start_local().unwrap();
    let Some(bouncer) = bouncer(
        &pg,
        "a_release_or_token_draw_waits_for_a_statement_holding_its_row",
    ) else {
        return;
    };
    let (name, other) = (unique_name("rows-locked"), unique_name("rows-kept"));
    let a = LockManager::connect_pooled(pool(&bouncer.url(), 2), options("rows-locked-a"))
        .await
        .unwrap();
    let lease = a.acquire(name.as_str()).await.unwrap();
    let kept = a.acquire(other.as_str()).await.unwrap();
    let LockKey::Pair(x, y) = lease.key() else {
        panic!("a named lock has a two-int4 key");
    };
    let packed = (i64::from(x) << 32) | i64::from(y as u32);
    let mut admin = connect_admin(&pg.url()).await.unwrap();
    let tx = admin.transaction().await.unwrap();
    let locked = tx
        .query(
            "SELECT 1 FROM public.chosen_lease WHERE form = 2 AND key = $1 FOR UPDATE",
            &[&packed],
        )
        .await
        .unwrap();
    assert_eq!(locked.len(), 1, "the lease's row");
    let releasing = tokio::spawn(async move { lease.release().await });
    // Shorter than the lease timeout (1 s), which bounds every wait for a row.
    tokio::time::sleep(Duration::from_millis(300)).await;
    tx.commit().await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), releasing)
        .await
        .expect("the release ends")
        .unwrap()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(kept.is_valid(), "the session went on");
    assert!(
        a.try_acquire(name.as_str()).await.unwrap().is_some(),
        "the released name is free"
    );
    // The same for a token draw: a hand-off to a waiter of the same manager keeps the
    // row and grants it without a token; the first read of it draws one. (A lease held
    // throughout tells whether the session went on: a name is had again on a new
    // session too.)
    let witness = a
        .acquire(unique_name("rows-witness").as_str())
        .await
        .unwrap();
    let before = kept.fencing_token().await.unwrap();
    let waiter = tokio::spawn({
        let (a, other) = (a.clone(), other.clone());
        async move { a.acquire(other.as_str()).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    kept.release().await.unwrap();
    let kept = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("the local waiter gets the name")
        .unwrap()
        .unwrap();
    let LockKey::Pair(x, y) = kept.key() else {
        panic!("a named lock has a two-int4 key");
    };
    let packed = (i64::from(x) << 32) | i64::from(y as u32);
    let tx = admin.transaction().await.unwrap();
    tx.query(
        "SELECT 1 FROM public.chosen_lease WHERE form = 2 AND key = $1 FOR UPDATE",
        &[&packed],
    )
    .await
    .unwrap();
    let reading = tokio::spawn(async move {
        let token = kept.fencing_token().await;
        (kept, token)
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    tx.commit().await.unwrap();
    let (kept, token) = tokio::time::timeout(Duration::from_secs(5), reading)
        .await
        .expect("the token read ends")
        .unwrap();
    assert!(token.unwrap() > before);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(kept.is_valid(), "the session went on after the token draw");
    assert!(
        witness.is_valid(),
        "the session went on after the token draw"
    );
    drop(witness);
    drop(kept);
    a.shutdown().await;
}

/// A row some other writer took over while it still named a hand-over's target (a node
/// of an earlier version, whose try does not clear `hand_to`) is that writer's: the
/// target does not take it, and reads show its holder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_taken_over_that_still_names_a_target_is_not_the_targets() {
    let pg = PgCluster::start_local().unwrap();
    let admin = connect_admin(&pg.url()).await.unwrap();
    let name = unique_name("rows-mixed");
    let a = LockManager::connect_pooled(pool(&pg.url(), 2), options("rows-mixed-a"))
        .await
        .unwrap();
    let t = LockManager::connect_pooled(pool(&pg.url(), 2), options("rows-mixed-t"))
        .await
        .unwrap();
    let lease = a.acquire(name.as_str()).await.unwrap();
    let LockKey::Pair(x, y) = lease.key() else {
        panic!("a named lock has a two-int4 key");
    };
    let key = (i64::from(x) << 32) | i64::from(y as u32);
    // Handed to a node that does not ask for it within the hold: kept for it.
    lease.hand_over("rows-mixed-t").await.unwrap();
    // An earlier version's try, as node rows-old (holder 4242): it overwrites the row
    // once the hold is over, leaving `hand_to`, live for a minute.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let taken = admin
        .execute(
            "INSERT INTO public.chosen_lease AS l (form, key, holder, holder_start, node_id, token, taken_at, expires_at) \
             VALUES (2, $1, 4242, 1, 'rows-old', 0, now(), now() + interval '60 seconds') \
             ON CONFLICT (form, key) DO UPDATE SET holder = excluded.holder, holder_start = excluded.holder_start, node_id = excluded.node_id, token = 0, taken_at = excluded.taken_at, expires_at = excluded.expires_at \
             WHERE l.expires_at <= now()",
            &[&key],
        )
        .await
        .unwrap();
    assert_eq!(taken, 1, "the other writer took the row");
    assert!(
        t.try_acquire(name.as_str()).await.unwrap().is_none(),
        "a row another writer holds live is not the named node's"
    );
    let holder = t
        .holder(name.as_str())
        .await
        .unwrap()
        .expect("its holder is shown");
    assert_eq!(holder.node_id, "rows-old");
    a.shutdown().await;
    t.shutdown().await;
}

/// Running the migration again on tables that are up to date waits for no statement
/// of the fleet: with a writer's transaction open on the lease table (a renewal, a
/// try), `lease_tables_sql` returns at once instead of queueing a table lock that
/// every later renewal would wait behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn running_the_migration_again_waits_for_no_statement_of_the_fleet() {
    let pg = PgCluster::start_local().unwrap();
    let admin = connect_admin(&pg.url()).await.unwrap();
    let migration = chosen_core::lease_tables_sql("public");
    admin.batch_execute(&migration).await.unwrap();
    let mut writer = connect_admin(&pg.url()).await.unwrap();
    let tx = writer.transaction().await.unwrap();
    tx.batch_execute(
        "INSERT INTO public.chosen_lease (form, key, holder, holder_start, node_id, token, taken_at, expires_at) \
         VALUES (1, 42, 7, 7, 'writer', 0, now(), now() + interval '1 minute')",
    )
    .await
    .unwrap();
    let started = Instant::now();
    admin
        .batch_execute(&format!("SET statement_timeout = '2s'; {migration}"))
        .await
        .expect("the migration waits for no lock the writer holds");
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    tx.rollback().await.unwrap();
    // On a table made before `hand_to`, the column is added without queueing the fleet
    // behind the table's lock for long: a read meanwhile waits 100 ms at most per try,
    // and once the writer is done, the column is there.
    admin
        .batch_execute("ALTER TABLE public.chosen_lease DROP COLUMN hand_to")
        .await
        .unwrap();
    let tx = writer.transaction().await.unwrap();
    tx.batch_execute(
        "INSERT INTO public.chosen_lease (form, key, holder, holder_start, node_id, token, taken_at, expires_at) \
         VALUES (1, 43, 7, 7, 'writer', 0, now(), now() + interval '1 minute')",
    )
    .await
    .unwrap();
    let migrating = tokio::spawn({
        let url = pg.url();
        let migration = migration.clone();
        async move {
            let client = connect_admin(&url).await.unwrap();
            client.batch_execute(&migration).await
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let reader = connect_admin(&pg.url()).await.unwrap();
    let mut slowest = Duration::ZERO;
    for _ in 0..5 {
        let read = Instant::now();
        tokio::time::timeout(
            Duration::from_secs(2),
            reader.simple_query("SELECT count(*) FROM public.chosen_lease"),
        )
        .await
        .expect("a read queued behind the migration's table lock")
        .unwrap();
        slowest = slowest.max(read.elapsed());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        slowest < Duration::from_millis(600),
        "a read waited {slowest:?}"
    );
    tx.rollback().await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), migrating)
        .await
        .expect("the migration ends")
        .unwrap()
        .expect("the column is added once the writer is done");
    let has = admin
        .query(
            "SELECT 1 FROM pg_attribute WHERE attrelid = 'public.chosen_lease'::regclass AND attname = 'hand_to' AND NOT attisdropped",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(has.len(), 1, "hand_to is there");
    // Inside a migration tool's own transaction, its lock timeout is its own again after.
    admin
        .batch_execute("ALTER TABLE public.chosen_lease DROP COLUMN hand_to")
        .await
        .unwrap();
    let answer = admin
        .simple_query(&format!(
            "BEGIN; SET LOCAL lock_timeout = '5s'; {migration}; SHOW lock_timeout; COMMIT"
        ))
        .await
        .unwrap();
    let shown: Vec<&str> = answer
        .iter()
        .filter_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0),
            _ => None,
        })
        .collect();
    assert_eq!(
        shown,
        ["5s"],
        "the caller's lock_timeout after the migration"
    );
}

/// The server behind the pooler restarted, cleanly and then as after a crash, while a
/// node holds a name: the holder's session ends (its pool now reaches a server with
/// another start time), the name is held again soon after, every tenure's token is
/// larger than the one before, and at no sampled instant do two nodes hold a valid
/// lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_rows_keep_one_holder_across_server_restarts_behind_a_transaction_pooler() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};

    let pg = PgCluster::start_local().unwrap();
    let Some(bouncer) = bouncer(
        &pg,
        "lease_rows_keep_one_holder_across_server_restarts_behind_a_transaction_pooler",
    ) else {
        return;
    };
    let pg = Arc::new(Mutex::new(pg));
    let name = unique_name("rows-restart");
    let stop = Arc::new(AtomicBool::new(false));
    // Each contender's lease while it holds one, and every tenure: (node, token, when).
    let held: Arc<Mutex<[Option<Arc<chosen_core::Lease>>; 2]>> = Arc::default();
    let tenures: Arc<Mutex<Vec<(usize, chosen_core::FencingToken, Instant)>>> = Arc::default();
    // Set when two nodes held a valid lease at once: checked as soon as a contender
    // sees its grant (before it awaits anything) and by a sampler every 5 ms.
    let both = Arc::new(AtomicBool::new(false));
    let mut managers = Vec::new();
    let mut contenders = Vec::new();
    for i in 0..2 {
        let manager = LockManager::connect_pooled(
            pool(&bouncer.url(), 2),
            options(&format!("rows-restart-{i}")),
        )
        .await
        .unwrap();
        managers.push(manager.clone());
        let (name, stop, held, tenures, both) = (
            name.clone(),
            Arc::clone(&stop),
            Arc::clone(&held),
            Arc::clone(&tenures),
            Arc::clone(&both),
        );
        contenders.push(tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                let Ok(lease) = manager.acquire(name.as_str()).await else {
                    break;
                };
                let lease = Arc::new(lease);
                {
                    let mut held = held.lock().unwrap();
                    if held.iter().flatten().any(|l| l.is_valid()) && lease.is_valid() {
                        both.store(true, Ordering::SeqCst);
                    }
                    held[i] = Some(Arc::clone(&lease));
                }
                // The token is read while the lease is valid; a session that ended
                // at once gives none, and the tenure is not counted.
                if let Ok(token) = lease.fencing_token().await {
                    tenures.lock().unwrap().push((i, token, Instant::now()));
                }
                tokio::select! {
                    _ = lease.lost() => {}
                    () = async {
                        while !stop.load(Ordering::SeqCst) {
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                    } => {}
                }
                held.lock().unwrap()[i] = None;
            }
        }));
    }
    // Never two valid leases at one instant.
    let sampler = tokio::spawn({
        let (stop, held, both) = (Arc::clone(&stop), Arc::clone(&held), Arc::clone(&both));
        async move {
            while !stop.load(Ordering::SeqCst) {
                let valid = held
                    .lock()
                    .unwrap()
                    .iter()
                    .flatten()
                    .filter(|l| l.is_valid())
                    .count();
                if valid > 1 {
                    both.store(true, Ordering::SeqCst);
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    });
    let wait_tenure_after = |since: Instant| {
        let tenures = Arc::clone(&tenures);
        async move {
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                if tenures.lock().unwrap().iter().any(|t| t.2 > since) {
                    return Instant::now() - since;
                }
                assert!(
                    Instant::now() < deadline,
                    "no node held the name within 30 s of {since:?}: {:?}",
                    tenures.lock().unwrap()
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    let began = Instant::now() - Duration::from_secs(1);
    wait_tenure_after(began).await;
    for mode in ["fast", "immediate"] {
        let at = Instant::now();
        let server = Arc::clone(&pg);
        tokio::task::spawn_blocking(move || server.lock().unwrap().restart(mode))
            .await
            .unwrap()
            .unwrap();
        let again = wait_tenure_after(at).await;
        eprintln!(
            "LEASE ROWS held again {} ms after a {mode} restart began",
            again.as_millis()
        );
        // About 2 s here (the restart, then the old session's rows expire): generous
        // for a loaded machine.
        assert!(
            again < Duration::from_secs(15),
            "held again only {again:?} after a {mode} restart"
        );
        // Let the new tenure run a while before the next restart.
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    stop.store(true, Ordering::SeqCst);
    sampler.await.unwrap();
    // A contender waiting in `acquire` returns when its manager shuts down.
    for m in managers {
        tokio::time::timeout(Duration::from_secs(10), m.shutdown())
            .await
            .expect("a manager shuts down");
    }
    for c in contenders {
        tokio::time::timeout(Duration::from_secs(10), c)
            .await
            .expect("a contender stops")
            .unwrap();
    }
    assert!(
        !both.load(Ordering::SeqCst),
        "two nodes held a valid lease at once"
    );
    let tenures = tenures.lock().unwrap().clone();
    for pair in tenures.windows(2) {
        assert!(pair[1].1 > pair[0].1, "a token went backwards: {tenures:?}");
    }
}
