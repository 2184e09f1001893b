//! Starting an election, whichever way: `Election::start`, `Singleton::start`,
//! `SingletonGroup::start` and the apalis and tower gates' `elect` each refuse a poll
//! interval out of range at once and leave nothing behind (no task that retries for
//! ever and never leads), and an apalis gate's election, plain or ledgered, lives as
//! long as the service it gates, not the layer that built it (as chosen-tower's does).

use std::time::{Duration, Instant};

use chosen_apalis::LeaderOnlyJobLayer;
use chosen_core::{
    Election, Error, GroupOptions, LeaderContext, LockManager, LockRequest, Singleton,
    SingletonGroup, SingletonOptions,
};
use chosen_tests::{PgCluster, prompt_options, unique_name};
use tower::Layer;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poll_interval_out_of_range_is_refused_by_every_start() {
    let pg = PgCluster::start().unwrap();
    let m = LockManager::connect(prompt_options(&pg.url(), "start-poll"))
        .await
        .unwrap();
    for bad in [Duration::ZERO, Duration::from_secs(7200)] {
        let err = Election::start(&m, LockRequest::from("start-e").poll_interval(bad))
            .expect_err("an election with a bad poll interval");
        assert!(matches!(err, Error::InvalidPollInterval(_)), "{err}");
        let child = |_: LeaderContext| async { Ok::<(), std::io::Error>(()) };
        let err = Singleton::start(
            &m,
            "start-s",
            SingletonOptions::default().poll_interval(bad),
            child,
        )
        .expect_err("a singleton with a bad poll interval");
        match &err {
            Error::InvalidConfig { setting, .. } => {
                assert_eq!(*setting, "SingletonOptions::poll_interval", "{err}");
            }
            other => panic!("expected InvalidConfig, got {other:?}"),
        }
        let member = |_: String, _: LeaderContext| async { Ok::<(), std::io::Error>(()) };
        let err = SingletonGroup::start(
            &m,
            "start-g",
            ["a"],
            GroupOptions::default().singleton(SingletonOptions::default().poll_interval(bad)),
            member,
        )
        .expect_err("a group with a bad poll interval");
        assert!(matches!(err, Error::InvalidConfig { .. }), "{err}");
        let err = LeaderOnlyJobLayer::elect(&m, LockRequest::from("start-j").poll_interval(bad))
            .expect_err("an apalis gate with a bad poll interval");
        assert!(matches!(err, Error::InvalidPollInterval(_)), "{err}");
        let err = chosen_tower::LeaderOnlyHttpLayer::elect(
            &m,
            LockRequest::from("start-h").poll_interval(bad),
        )
        .expect_err("a tower layer with a bad poll interval");
        assert!(matches!(err, Error::InvalidPollInterval(_)), "{err}");
    }
    // Nothing was left behind.
    assert!(m.locks().await.unwrap().is_empty());
    m.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_apalis_gate_keeps_its_layers_election_alive() {
    let pg = PgCluster::start().unwrap();
    let m = LockManager::connect(prompt_options(&pg.url(), "start-gate"))
        .await
        .unwrap();
    let name = unique_name("start-gate");
    // The layer is a temporary: only the service is kept.
    let service = LeaderOnlyJobLayer::elect(&m, name.as_str())
        .unwrap()
        .layer(tower::service_fn(|_: ()| async {
            Ok::<(), std::io::Error>(())
        }));
    let t0 = Instant::now();
    while !service.leadership().is_leader() {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the gate's election stopped with its layer: {:?}",
            service.leadership().state()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop(service);

    // The same for a ledgered cron gate: its election's lock stays held with only the
    // service kept.
    let name = unique_name("start-ledgered");
    let config: tokio_postgres::Config = pg.url().parse().unwrap();
    let pool = deadpool_postgres::Pool::builder(deadpool_postgres::Manager::new(
        config,
        tokio_postgres::NoTls,
    ))
    .build()
    .unwrap();
    let service = LeaderOnlyJobLayer::elect(&m, name.as_str())
        .unwrap()
        .ledger(chosen_apalis::TickLedger::new(pool))
        .layer(tower::service_fn(
            |_: apalis_core::task::Task<chosen_apalis::Tick>| async {
                Ok::<(), std::io::Error>(())
            },
        ));
    let held = |locks: Vec<chosen_core::LockInfo>| {
        locks
            .iter()
            .any(|l| l.name == name && matches!(l.state, chosen_core::LockState::Held { .. }))
    };
    let t0 = Instant::now();
    while !held(m.locks().await.unwrap()) {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the ledgered gate's election never held its lock"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        held(m.locks().await.unwrap()),
        "the ledgered gate's election stopped with its layer"
    );
    drop(service);
    m.shutdown().await;
}
