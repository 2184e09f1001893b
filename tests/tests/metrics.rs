//! Scrape `/metrics` of real node processes over HTTP during a takeover.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use chosen_core::{LockManager, ManagerOptions};
use chosen_tests::{NodeProcess, PgCluster, connect_admin, unique_name};

struct Node {
    id: String,
    _process: NodeProcess,
    metrics: SocketAddr,
}

fn spawn(url: &str, id: &str, singleton: &str) -> Node {
    let process = NodeProcess::spawn(
        url,
        &[
            "--node-id",
            id,
            "--singleton",
            singleton,
            "--poll-ms",
            "100",
            "--metrics",
            "127.0.0.1:0",
        ],
    )
    .unwrap();
    let line = process
        .wait("metrics", Duration::from_secs(20))
        .expect("the node reports its metrics address");
    let addr = line
        .split("\"addr\":\"")
        .nth(1)
        .unwrap()
        .split('"')
        .next()
        .unwrap();
    Node {
        id: id.to_owned(),
        metrics: addr.parse().unwrap(),
        _process: process,
    }
}

/// `metric{labels}` -> value, from the Prometheus text format.
async fn scrape(addr: SocketAddr) -> HashMap<String, f64> {
    let r = chosen_tests::http_request_async(addr, "GET", "/metrics")
        .await
        .unwrap();
    r.body
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            Some((series.to_owned(), value.parse().ok()?))
        })
        .collect()
}

/// A series that may not exist yet (a follower's gauges before its first report).
fn get(m: &HashMap<String, f64>, series: &str) -> Option<f64> {
    m.get(series).copied()
}

/// A series that must exist: a missing one is a failure, not a 0.
fn value(m: &HashMap<String, f64>, series: &str) -> f64 {
    get(m, series).unwrap_or_else(|| {
        let mut names: Vec<&String> = m.keys().collect();
        names.sort();
        panic!("no series {series} in the scrape: {names:#?}")
    })
}

async fn holders(nodes: &[Node], lock: &str) -> Vec<String> {
    let mut out = Vec::new();
    for n in nodes {
        let m = scrape(n.metrics).await;
        if get(
            &m,
            &format!("chosen_lock_held{{lock=\"{lock}\",node=\"{}\"}}", n.id),
        ) == Some(1.0)
        {
            out.push(n.id.clone());
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scraped_metrics_follow_a_takeover() {
    let pg = PgCluster::start().unwrap();
    let lock = unique_name("metrics");
    let nodes: Vec<Node> = (0..3)
        .map(|i| spawn(&pg.url(), &format!("m-node-{i}"), &lock))
        .collect();

    let deadline = Instant::now() + Duration::from_secs(20);
    let leader = loop {
        let h = holders(&nodes, &lock).await;
        assert!(h.len() <= 1, "two nodes report held=1: {h:?}");
        if let [one] = h.as_slice() {
            break one.clone();
        }
        assert!(Instant::now() < deadline, "no node reports held=1");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let m = scrape(nodes.iter().find(|n| n.id == leader).unwrap().metrics).await;
    assert_eq!(
        value(&m, &format!("chosen_connection_up{{node=\"{leader}\"}}")),
        1.0
    );
    assert_eq!(
        value(
            &m,
            &format!("chosen_singleton_running{{node=\"{leader}\",singleton=\"{lock}\"}}")
        ),
        1.0
    );
    for n in nodes.iter().filter(|n| n.id != leader) {
        // Followers report one waiting request and their polls (once they are up).
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let m = scrape(n.metrics).await;
            let waiters = get(
                &m,
                &format!("chosen_lock_waiters{{lock=\"{lock}\",node=\"{}\"}}", n.id),
            );
            let polls = get(
                &m,
                &format!("chosen_poll_queries_total{{node=\"{}\"}}", n.id),
            );
            if waiters == Some(1.0) && polls.is_some_and(|p| p >= 1.0) {
                // A follower that never led exports its series at 0, not nothing.
                for series in [
                    format!("chosen_lock_held{{lock=\"{lock}\",node=\"{}\"}}", n.id),
                    format!(
                        "chosen_singleton_running{{node=\"{}\",singleton=\"{lock}\"}}",
                        n.id
                    ),
                ] {
                    assert_eq!(value(&m, &series), 0.0, "{series}");
                }
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{}: waiters {waiters:?}, polls {polls:?}",
                n.id
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    // Kill the leader's session: held flips to another node, the loss is counted.
    let admin = connect_admin(&pg.url()).await.unwrap();
    admin
        .execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1",
            &[&leader],
        )
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let h = holders(&nodes, &lock).await;
        assert!(h.len() <= 1, "two nodes report held=1: {h:?}");
        if let [one] = h.as_slice()
            && *one != leader
        {
            break;
        }
        assert!(Instant::now() < deadline, "held=1 did not move: {h:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let old = scrape(nodes.iter().find(|n| n.id == leader).unwrap().metrics).await;
    assert_eq!(
        value(
            &old,
            &format!(
                "chosen_lock_losses_total{{lock=\"{lock}\",node=\"{leader}\",reason=\"connection_lost\"}}"
            )
        ),
        1.0
    );
    assert_eq!(
        value(
            &old,
            &format!("chosen_lock_held{{lock=\"{lock}\",node=\"{leader}\"}}")
        ),
        0.0
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while get(
        &scrape(nodes.iter().find(|n| n.id == leader).unwrap().metrics).await,
        &format!("chosen_session_generation{{node=\"{leader}\"}}"),
    )
    .is_none_or(|g| g < 2.0)
    {
        assert!(
            Instant::now() < deadline,
            "the old leader did not reconnect"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// "Nobody leads" is `max(chosen_lock_held) == 0`, no `absent()`: a node that has never
/// held the lock exports its lock and singleton series at 0 from the first request on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_never_led_exports_its_series_at_zero() {
    let pg = PgCluster::start().unwrap();
    let lock = unique_name("never-led");
    // Held by the test for the whole test: the node can only wait.
    let holder = LockManager::connect(
        ManagerOptions::from_url(&pg.url())
            .unwrap()
            .node_id("m-holder")
            .term_grant_delay(Duration::ZERO),
    )
    .await
    .unwrap();
    let _lease = holder.acquire(lock.as_str()).await.unwrap();
    let node = spawn(&pg.url(), "m-waiter", &lock);

    let held = format!("chosen_lock_held{{lock=\"{lock}\",node=\"m-waiter\"}}");
    let waiters = format!("chosen_lock_waiters{{lock=\"{lock}\",node=\"m-waiter\"}}");
    let deadline = Instant::now() + Duration::from_secs(20);
    let m = loop {
        let m = scrape(node.metrics).await;
        // Waiting shows the request reached the manager; the rest must exist by then.
        if get(&m, &waiters) == Some(1.0) {
            break m;
        }
        assert!(
            Instant::now() < deadline,
            "the node never reported its waiting request: {:?}",
            get(&m, &waiters)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(value(&m, &held), 0.0);
    assert_eq!(
        value(
            &m,
            &format!("chosen_lock_acquisitions_total{{lock=\"{lock}\",node=\"m-waiter\"}}")
        ),
        0.0
    );
    assert_eq!(
        value(
            &m,
            &format!("chosen_singleton_running{{node=\"m-waiter\",singleton=\"{lock}\"}}")
        ),
        0.0
    );
    assert_eq!(
        value(
            &m,
            &format!("chosen_singleton_restarts_total{{node=\"m-waiter\",singleton=\"{lock}\"}}")
        ),
        0.0
    );
}
