//! Scrape `/metrics` of real node processes over HTTP during a takeover, and the
//! registries of managers in this process through a change of leader.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use chosen_core::{Election, LockManager, ManagerOptions, PrometheusMetrics};
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

/// `metric{labels}` -> value, from the Prometheus text encoding of `registry`.
fn scrape_registry(registry: &prometheus::Registry) -> HashMap<String, f64> {
    let text = prometheus::TextEncoder::new()
        .encode_to_string(&registry.gather())
        .unwrap();
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            Some((series.to_owned(), value.parse().ok()?))
        })
        .collect()
}

async fn manager_with_registry(url: &str, id: &str) -> (LockManager, prometheus::Registry) {
    let registry = prometheus::Registry::new();
    let metrics = Arc::new(PrometheusMetrics::register(&registry).unwrap());
    let manager = LockManager::connect(
        ManagerOptions::from_url(url)
            .unwrap()
            .node_id(id)
            .poll_interval(Duration::from_millis(100))
            .term_grant_delay(Duration::ZERO)
            .metrics(metrics),
    )
    .await
    .unwrap();
    (manager, registry)
}

/// The leadership series in a real scrape: a change of leader between two managers
/// counts on the one that saw it, the fencing token gauge follows the holder, and a
/// stretch with nobody leading (the leader's session killed, nobody else there) adds
/// leaderless seconds, where the hand-over before it added none to speak of.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scraped_leadership_series_follow_a_change_of_leader() {
    let pg = PgCluster::start().unwrap();
    let lock = unique_name("metrics-leader");
    let series = |family: &str, node: &str| format!("{family}{{lock=\"{lock}\",node=\"{node}\"}}");
    let within = Duration::from_secs(10);

    let (a, registry_a) = manager_with_registry(&pg.url(), "m-lead-a").await;
    let election_a = Election::start(&a, lock.as_str()).unwrap();
    let token_a = tokio::time::timeout(within, election_a.leadership().wait_leading())
        .await
        .expect("a leads");
    let (b, registry_b) = manager_with_registry(&pg.url(), "m-lead-b").await;
    let election_b = Election::start(&b, lock.as_str()).unwrap();
    // B's look-ups (every 2 s) name A.
    let deadline = Instant::now() + within;
    while election_b.leadership().leader().as_deref() != Some("m-lead-a") {
        assert!(Instant::now() < deadline, "b never saw a lead");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let m = scrape_registry(&registry_a);
    assert_eq!(
        value(&m, &series("chosen_fencing_token", "m-lead-a")),
        token_a.get() as f64
    );
    assert!(token_a.get() > 0);
    assert_eq!(
        value(&m, &series("chosen_leader_changes_total", "m-lead-a")),
        0.0
    );
    let m = scrape_registry(&registry_b);
    // At rest on the follower: no token, no change seen, no leaderless time.
    assert_eq!(value(&m, &series("chosen_fencing_token", "m-lead-b")), 0.0);
    assert_eq!(
        value(&m, &series("chosen_leader_changes_total", "m-lead-b")),
        0.0
    );
    assert_eq!(
        value(&m, &series("chosen_leaderless_seconds_total", "m-lead-b")),
        0.0
    );

    // A change of leader: A stops, B takes over within milliseconds.
    election_a.shutdown().await;
    let token_b = tokio::time::timeout(within, election_b.leadership().wait_leading())
        .await
        .expect("b takes over");
    assert!(token_b > token_a);
    let m = scrape_registry(&registry_a);
    assert_eq!(value(&m, &series("chosen_fencing_token", "m-lead-a")), 0.0);
    assert_eq!(value(&m, &series("chosen_lock_held", "m-lead-a")), 0.0);
    let m = scrape_registry(&registry_b);
    assert_eq!(
        value(&m, &series("chosen_fencing_token", "m-lead-b")),
        token_b.get() as f64
    );
    assert_eq!(
        value(&m, &series("chosen_leader_changes_total", "m-lead-b")),
        1.0
    );
    let handed_over = value(&m, &series("chosen_leaderless_seconds_total", "m-lead-b"));
    assert!(
        handed_over < 1.0,
        "a hand-over counted {handed_over} s leaderless"
    );

    // B's session killed, nobody else contends: leaderless until B's next session
    // wins the lock again, a new term (a change) with a newer token.
    let admin = connect_admin(&pg.url()).await.unwrap();
    admin
        .execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = 'm-lead-b'",
            &[],
        )
        .await
        .unwrap();
    tokio::time::timeout(within, election_b.leadership().wait_not_leading())
        .await
        .expect("b loses its lease with its session");
    let token_b2 = tokio::time::timeout(within, election_b.leadership().wait_leading())
        .await
        .expect("b leads again");
    assert!(token_b2 > token_b);
    let m = scrape_registry(&registry_b);
    assert_eq!(
        value(&m, &series("chosen_fencing_token", "m-lead-b")),
        token_b2.get() as f64
    );
    assert_eq!(
        value(&m, &series("chosen_leader_changes_total", "m-lead-b")),
        2.0
    );
    let leaderless = value(&m, &series("chosen_leaderless_seconds_total", "m-lead-b"));
    // At least the pause before contending again (two poll intervals).
    assert!(
        (0.15..10.0).contains(&(leaderless - handed_over)),
        "leaderless {leaderless} s, {handed_over} s of it before the kill"
    );
    election_b.shutdown().await;
    b.shutdown().await;
    a.shutdown().await;
}
