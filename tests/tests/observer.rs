//! An observer follows who leads through the application's own pool, against real
//! servers: through a transaction pooler (PgBouncer), with no lock session of its own,
//! one statement per poll for every name it watches.

use std::time::Duration;

use chosen_core::{
    Election, Error, LeaderState, Leadership, LockManager, Observer, ObserverOptions,
};
use chosen_tests::{PgBouncer, PgCluster, connect_admin, fault_options, in_ci, unique_name};
use deadpool_postgres::Pool;

fn pool(url: &str) -> Pool {
    let config: tokio_postgres::Config = url.parse().unwrap();
    Pool::builder(deadpool_postgres::Manager::new(
        config,
        tokio_postgres::NoTls,
    ))
    .max_size(2)
    .build()
    .unwrap()
}

/// Waits (at most 10 s) until `leadership` names `leader`.
async fn until_leader(leadership: &Leadership, leader: Option<&str>) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while leadership.leader().as_deref() != leader {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the observer shows {:?}, not {leader:?}",
            leadership.leader()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Through PgBouncer in transaction mode (where no lock session is possible), an
/// observer shows each election's leader as the elected node's id, follows a change of
/// leader, shows nobody for a name nobody holds, and never shows itself leading.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_observer_follows_the_leaders_through_a_transaction_pooler() {
    let pg = PgCluster::start_local().unwrap();
    let bouncer = match PgBouncer::start(&pg, "transaction", 2) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && !in_ci() => {
            eprintln!("SKIPPED an_observer_follows_the_leaders_through_a_transaction_pooler: {e}");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    let (first, second, idle) = (
        unique_name("observed-1"),
        unique_name("observed-2"),
        unique_name("observed-none"),
    );
    let a = LockManager::connect(fault_options(&pg.url(), "observed-a"))
        .await
        .unwrap();
    let b = LockManager::connect(fault_options(&pg.url(), "observed-b"))
        .await
        .unwrap();
    let on_a = Election::start(&a, first.as_str()).unwrap();
    on_a.leadership().wait_leading().await;
    let on_b = Election::start(&b, second.as_str()).unwrap();
    on_b.leadership().wait_leading().await;

    let observer = Observer::new(
        pool(&bouncer.url()),
        ObserverOptions::default()
            .node_id("observer")
            .poll_interval(Duration::from_millis(50)),
    )
    .unwrap();
    let (l1, l2, l3) = (
        observer.watch(&first).unwrap(),
        observer.watch(&second).unwrap(),
        observer.watch(&idle).unwrap(),
    );
    until_leader(&l1, Some("observed-a")).await;
    until_leader(&l2, Some("observed-b")).await;
    assert_eq!(l3.leader(), None);
    for l in [&l1, &l2, &l3] {
        assert!(!l.is_leader());
        assert!(matches!(l.state(), LeaderState::Following { .. }));
    }
    let holders = observer
        .holders(&[first.as_str(), idle.as_str()])
        .await
        .unwrap();
    assert_eq!(
        holders[0].as_ref().map(|h| h.node_id.as_str()),
        Some("observed-a")
    );
    assert!(holders[1].is_none());

    // The first election moves to b: a's manager shuts down.
    let also_on_b = Election::start(&b, first.as_str()).unwrap();
    a.shutdown().await;
    also_on_b.leadership().wait_leading().await;
    until_leader(&l1, Some("observed-b")).await;

    // The observer holds no lock session: nothing of it is in the lock table.
    let admin = connect_admin(&pg.url()).await.unwrap();
    let own: i64 = admin
        .query_one(
            "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
             WHERE l.locktype = 'advisory' AND a.application_name = 'observer'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(own, 0);
    assert!(observer.holders(&[]).await.unwrap().is_empty());

    // Dropping the observer stops its handles: they say so, rather than keep showing a
    // leader nobody checks any more.
    drop(observer);
    tokio::time::timeout(Duration::from_secs(5), async {
        while l1.state() != LeaderState::Stopped {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the handles of a dropped observer are stopped");
    drop((on_a, on_b, also_on_b));
    b.shutdown().await;
}

/// The observer cannot read any more (the server is gone): within the read timeout
/// and a poll it shows nobody leading, never the last leader it saw.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_observer_that_cannot_read_stops_showing_the_last_leader() {
    let mut pg = PgCluster::start_local().unwrap();
    let name = unique_name("observed-gone");
    let a = LockManager::connect(fault_options(&pg.url(), "gone-a"))
        .await
        .unwrap();
    let election = Election::start(&a, name.as_str()).unwrap();
    election.leadership().wait_leading().await;
    let observer = Observer::new(
        pool(&pg.url()),
        ObserverOptions::default()
            .poll_interval(Duration::from_millis(50))
            .read_timeout(Duration::from_millis(500)),
    )
    .unwrap();
    let l = observer.watch(&name).unwrap();
    until_leader(&l, Some("gone-a")).await;
    pg.stop("immediate").unwrap();
    until_leader(&l, None).await;
    drop(election);
    a.shutdown().await;
}

/// A pool that cannot connect: the observer shows nobody leading (it cannot tell),
/// and a direct look-up fails with a pool error that says what to check.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_observer_whose_pool_cannot_connect_shows_nobody_leading() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let observer = Observer::new(
        pool(&format!(
            "postgres://nobody@127.0.0.1:{port}/none?connect_timeout=1"
        )),
        ObserverOptions::default().poll_interval(Duration::from_millis(50)),
    )
    .unwrap();
    let l = observer.watch("anything").unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(l.leader(), None);
    let err = observer.holders(&["anything"]).await.unwrap_err();
    assert!(matches!(err, Error::Pool { .. }), "{err}");
    assert!(err.to_string().contains("pool"), "{err}");
}

/// Bad input is an error that says what to fix, never a panic.
#[tokio::test]
async fn an_observer_refuses_bad_options_and_names() {
    let p = pool("postgres://nobody@127.0.0.1:1/none");
    let err = Observer::new(
        p.clone(),
        ObserverOptions::default().poll_interval(Duration::from_millis(1)),
    )
    .unwrap_err();
    assert!(err.to_string().contains("poll_interval"), "{err}");
    let err =
        Observer::new(p.clone(), ObserverOptions::default().namespace("chosen.x")).unwrap_err();
    assert!(err.to_string().contains("namespace"), "{err}");
    let observer = Observer::new(p, ObserverOptions::default()).unwrap();
    assert!(matches!(
        observer.watch("").unwrap_err(),
        Error::InvalidName(_)
    ));
    assert!(matches!(
        observer.watch("chosen.prefer/x").unwrap_err(),
        Error::InvalidName(_)
    ));
}
