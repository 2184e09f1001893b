//! A rolling deploy with real `node` processes: three replicas run five singletons
//! (all led by the first); one at a time, a replica of the new version starts and an old one gets SIGTERM, as
//! a deployment controller does. Every singleton changes hands at most once per
//! replica replaced, the time from one child's stop to the next one's start stays well
//! under a second, and the checker finds no overlap and no token going backwards.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use chosen_tests::checker::{Timing, check};
use chosen_tests::{History, LoggedNode, PgCluster, signal, unique_name};

const REPLICAS: usize = 3;
const SINGLETONS: usize = 5;

fn spawn(url: &str, id: &str, names: &[String], history: &History) -> LoggedNode {
    let mut args = vec!["--node-id", id, "--poll-ms", "200", "--tick-ms", "50"];
    for n in names {
        args.extend(["--singleton", n.as_str()]);
    }
    LoggedNode::spawn(url, &args, history, 1).unwrap()
}

/// Waits up to `limit` for an event of `node` named `event`.
fn wait_event(history: &History, node: &str, event: &str, limit: Duration) {
    let t0 = Instant::now();
    while !history
        .lock()
        .unwrap()
        .iter()
        .any(|e| e.node == node && e.event == event)
    {
        assert!(t0.elapsed() < limit, "{node} never reported {event}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Per singleton, its children in start order: (node, started µs, stopped µs).
fn runs(history: &History) -> BTreeMap<String, Vec<(String, u64, Option<u64>)>> {
    let mut out: BTreeMap<String, Vec<(String, u64, Option<u64>)>> = BTreeMap::new();
    let mut events = history.lock().unwrap().clone();
    events.sort_by_key(|e| e.mono_us);
    for e in events {
        let Some(s) = &e.singleton else { continue };
        match e.event.as_str() {
            "child_started" => {
                out.entry(s.clone())
                    .or_default()
                    .push((e.node.clone(), e.mono_us, None));
            }
            "child_stopped" => {
                if let Some(run) = out
                    .get_mut(s)
                    .into_iter()
                    .flatten()
                    .rev()
                    .find(|(n, _, end)| *n == e.node && end.is_none())
                {
                    run.2 = Some(e.mono_us);
                }
            }
            _ => {}
        }
    }
    out
}

#[test]
fn a_rolling_deploy_of_node_processes_moves_each_singleton_at_most_once_per_replica() {
    let pg = PgCluster::start().unwrap();
    let url = pg.url();
    let prefix = unique_name("roll");
    let names: Vec<String> = (0..SINGLETONS).map(|i| format!("{prefix}-{i}")).collect();
    let history = History::default();
    // The first old replica leads everything (the worst case: each old replica that
    // goes may hand its singletons to another old one, to be moved again); the other
    // two wait in every queue.
    let mut old: Vec<(String, LoggedNode)> = Vec::new();
    for i in 0..REPLICAS {
        let id = format!("old-{i}");
        old.push((id.clone(), spawn(&url, &id, &names, &history)));
        if i == 0 {
            let t0 = Instant::now();
            while runs(&history).len() < SINGLETONS {
                assert!(
                    t0.elapsed() < Duration::from_secs(60),
                    "not every singleton ran"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        } else {
            wait_event(&history, &id, "connected", Duration::from_secs(30));
        }
    }
    std::thread::sleep(Duration::from_millis(500));
    let mut new = Vec::new();
    for i in 0..REPLICAS {
        let id = format!("new-{i}");
        new.push(spawn(&url, &id, &names, &history));
        // The new replica is up and waits in every queue; then an old one goes.
        wait_event(&history, &id, "connected", Duration::from_secs(30));
        std::thread::sleep(Duration::from_millis(500));
        let (old_id, mut node) = old.remove(0);
        signal(node.child.id(), "TERM").unwrap();
        let status = node.child.wait().unwrap();
        assert!(status.success(), "{old_id} exited with {status}");
    }
    std::thread::sleep(Duration::from_secs(1));

    let runs = runs(&history);
    for (name, list) in &runs {
        eprintln!(
            "ROLLING-DEPLOY {name}: {:?}",
            list.iter().map(|r| &r.0).collect::<Vec<_>>()
        );
    }
    let mut gaps = Vec::new();
    for (name, list) in &runs {
        let changes = list.windows(2).filter(|p| p[0].0 != p[1].0).count();
        assert!(
            changes <= REPLICAS,
            "{name} changed hands {changes} times for {REPLICAS} replicas: {list:?}"
        );
        for pair in list.windows(2) {
            let stopped = pair[0]
                .2
                .expect("an old child stopped before the next started");
            gaps.push(Duration::from_micros(pair[1].1.saturating_sub(stopped)));
        }
        assert!(
            list.last().unwrap().0.starts_with("new-"),
            "{name} ends on an old replica: {list:?}"
        );
    }
    gaps.sort();
    let pct = |p: usize| gaps[(gaps.len() * p / 100).min(gaps.len() - 1)];
    eprintln!(
        "ROLLING-DEPLOY {REPLICAS} node processes, {SINGLETONS} singletons: {} hand-overs, leaderless p50 {:?}, p99 {:?}, max {:?}",
        gaps.len(),
        pct(50),
        pct(99),
        gaps.last().unwrap()
    );
    assert!(!gaps.is_empty(), "nothing changed hands");
    assert!(
        *gaps.last().unwrap() < Duration::from_secs(1),
        "leaderless for {:?}",
        gaps.last().unwrap()
    );

    // Stop the new replicas too, and judge the whole history.
    for mut node in new {
        signal(node.child.id(), "TERM").unwrap();
        assert!(node.child.wait().unwrap().success());
    }
    let verdict = check(&history.lock().unwrap(), &[], Timing::default());
    assert!(verdict.safe(), "{verdict}");
}
