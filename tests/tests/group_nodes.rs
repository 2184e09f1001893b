//! Singleton groups across real `node` processes, judged from their event lines: three
//! nodes started together with 30 members hold 9-11 each; a fourth joins and each holds
//! 7-9, with at most 8 members handed over; one is SIGKILLed and its members spread
//! over the other three; the checker finds no member with two children at once and no
//! token going backwards.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use chosen_tests::checker::{Event, Timing, check};
use chosen_tests::{History, LoggedNode, PgCluster, signal, unique_name};

const MEMBERS: usize = 30;

struct Proc {
    id: String,
    child: LoggedNode,
}

fn spawn(url: &str, id: &str, group: &str, history: &History) -> Proc {
    let members = MEMBERS.to_string();
    let args = ["--node-id", id, "--group", group, "--members", &members];
    let args = [&args[..], &["--poll-ms", "200", "--tick-ms", "50"]].concat();
    Proc {
        id: id.to_owned(),
        child: LoggedNode::spawn(url, &args, history, 1).unwrap(),
    }
}

/// Members whose child runs on each node right now (from `child_started` /
/// `child_stopped` / `lease_lost`), and how many were stopped on each node so far.
fn placement(history: &History) -> (HashMap<String, usize>, HashMap<String, usize>) {
    let mut running: HashMap<(String, String), bool> = HashMap::new();
    let mut stopped: HashMap<String, usize> = HashMap::new();
    for e in history.lock().unwrap().iter() {
        let Some(member) = &e.singleton else { continue };
        match e.event.as_str() {
            "child_started" => {
                running.insert((e.node.clone(), member.clone()), true);
            }
            "child_stopped" => {
                running.insert((e.node.clone(), member.clone()), false);
                *stopped.entry(e.node.clone()).or_default() += 1;
            }
            "lease_lost" => {
                running.insert((e.node.clone(), member.clone()), false);
            }
            _ => {}
        }
    }
    let mut loads: HashMap<String, usize> = HashMap::new();
    for ((node, _), on) in running {
        if on {
            *loads.entry(node).or_default() += 1;
        }
    }
    (loads, stopped)
}

fn loads_of(history: &History, nodes: &[&str]) -> Vec<usize> {
    let (loads, _) = placement(history);
    nodes
        .iter()
        .map(|n| loads.get(*n).copied().unwrap_or(0))
        .collect()
}

fn wait_for(
    what: &str,
    limit: Duration,
    history: &History,
    nodes: &[&str],
    ok: impl Fn(&[usize]) -> bool,
) -> Duration {
    let t0 = Instant::now();
    loop {
        let l = loads_of(history, nodes);
        if l.iter().sum::<usize>() == MEMBERS && ok(&l) {
            return t0.elapsed();
        }
        assert!(t0.elapsed() < limit, "timed out waiting for {what}: {l:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_group_spreads_over_node_processes_and_heals() {
    let pg = PgCluster::start().unwrap();
    // A fresh cluster holds grants for its term's first seconds; the nodes just wait.
    let url = pg.url();
    let group = unique_name("nodes");
    let history = History::default();
    let a = spawn(&url, "gn-a", &group, &history);
    let b = spawn(&url, "gn-b", &group, &history);
    let c = spawn(&url, "gn-c", &group, &history);
    let took = wait_for(
        "3 nodes at 9-11",
        Duration::from_secs(60),
        &history,
        &["gn-a", "gn-b", "gn-c"],
        |l| l.iter().all(|n| (9..=11).contains(n)),
    );
    eprintln!(
        "GROUP-NODES 3 started together: {:?} after {took:?}",
        loads_of(&history, &["gn-a", "gn-b", "gn-c"])
    );

    let (_, stopped_before) = placement(&history);
    let d = spawn(&url, "gn-d", &group, &history);
    let took = wait_for(
        "4 nodes at 7-9",
        Duration::from_secs(60),
        &history,
        &["gn-a", "gn-b", "gn-c", "gn-d"],
        |l| l.iter().all(|n| (7..=9).contains(n)),
    );
    let (_, stopped_after) = placement(&history);
    let moves: usize = ["gn-a", "gn-b", "gn-c"]
        .iter()
        .map(|n| stopped_after.get(*n).unwrap_or(&0) - stopped_before.get(*n).unwrap_or(&0))
        .sum();
    eprintln!(
        "GROUP-NODES a 4th joined: {:?} after {took:?}, {moves} members handed over",
        loads_of(&history, &["gn-a", "gn-b", "gn-c", "gn-d"])
    );
    assert!(moves <= 8, "{moves} moves for one join");

    // SIGKILL one: its members spread over the other three.
    let before = loads_of(&history, &["gn-a", "gn-b", "gn-c"]);
    let killed_at = Instant::now();
    signal(d.child.child.id(), "KILL").unwrap();
    drop(d);
    // Its children stopped at the kill (a killed process reports nothing).
    {
        let mut h = history.lock().unwrap();
        let now = chosen_tests::monotonic_us();
        let running: Vec<String> = {
            let mut on: HashMap<String, bool> = HashMap::new();
            for e in h.iter().filter(|e| e.node == "gn-d") {
                if let Some(m) = &e.singleton {
                    match e.event.as_str() {
                        "child_started" => {
                            on.insert(m.clone(), true);
                        }
                        "child_stopped" | "lease_lost" => {
                            on.insert(m.clone(), false);
                        }
                        _ => {}
                    }
                }
            }
            on.into_iter().filter(|(_, v)| *v).map(|(m, _)| m).collect()
        };
        for m in running {
            h.push(Event {
                mono_us: now,
                node: "gn-d".to_owned(),
                instance: 1,
                event: "child_stopped".to_owned(),
                singleton: Some(m),
                token: None,
                reason: None,
                phase: None,
                generation: None,
            });
        }
    }
    let took = wait_for(
        "3 nodes at 10 each",
        Duration::from_secs(60),
        &history,
        &["gn-a", "gn-b", "gn-c"],
        |l| l.iter().all(|n| *n == 10),
    );
    let after = loads_of(&history, &["gn-a", "gn-b", "gn-c"]);
    eprintln!(
        "GROUP-NODES the 4th SIGKILLed: {before:?} -> {after:?} after {took:?} ({:?} after the kill)",
        killed_at.elapsed()
    );
    assert!(
        after.iter().zip(&before).filter(|(x, y)| x > y).count() >= 2,
        "its members went to one node: {before:?} -> {after:?}"
    );

    for p in [&a, &b, &c] {
        signal(p.child.child.id(), "TERM").unwrap();
    }
    for mut p in [a, b, c] {
        let status = p.child.child.wait().unwrap();
        assert!(status.success(), "{} exited with {status}", p.id);
    }
    std::thread::sleep(Duration::from_millis(200));
    let events = history.lock().unwrap().clone();
    let verdict = check(&events, &[], Timing::default());
    eprintln!("GROUP-NODES checker: {verdict}");
    assert!(verdict.safe(), "{verdict}");
}
