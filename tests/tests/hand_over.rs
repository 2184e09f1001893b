//! Hand-over to a named node: `Election::hand_over_to` and `Singleton::hand_over_to`
//! give the lock to that node while the other waiting nodes hold off; a target that is
//! not there falls back to the normal queue, and one no node can have (an empty node
//! id) is a plain release; and a rolling deploy of K replicas (each replaced in turn:
//! start the new one, hand over if leading, stop the old one) causes at most K
//! hand-overs with short leaderless times. Prints `HAND-OVER` lines with the timings
//! (run with `--nocapture`). The managers poll at the default interval (300 ms): a node
//! that did not hold off would take the lock within 300 ms of a release.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chosen_core::{Election, LockManager, Singleton, SingletonOptions};
use chosen_tests::{PgCluster, leader_of, unheld_options, unique_name};

fn pct(sorted: &[Duration], p: usize) -> Duration {
    sorted[(sorted.len() * p / 100).min(sorted.len() - 1)]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_election_is_handed_to_the_named_node() {
    let pg = PgCluster::start().unwrap();
    let url = pg.url();
    let name = unique_name("hand-over");
    let mut elections = Vec::new();
    let mut managers = Vec::new();
    for node in ["ho-a", "ho-b", "ho-c"] {
        let m = LockManager::connect(unheld_options(&url, node))
            .await
            .unwrap();
        elections.push((node, Election::start(&m, name.as_str()).unwrap()));
        managers.push(m);
        // The first one leads before the others start.
        leader_of(&elections, Duration::from_secs(10)).await;
    }
    // Everyone waits, registered for the announcement.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut took = Vec::new();
    let targets = ["ho-c", "ho-b", "ho-a"];
    for round in 0..12 {
        let (leader, _) = leader_of(&elections, Duration::from_secs(5)).await;
        let target = targets
            .iter()
            .cycle()
            .skip(round)
            .find(|t| **t != leader)
            .unwrap();
        let e = &elections.iter().find(|(n, _)| *n == leader).unwrap().1;
        let t0 = Instant::now();
        e.hand_over_to(target);
        // The next leader seen is the target, but for a rare race: another node's poll
        // reaching the server between the release and the target's try (the hold is
        // decided on each node, not at the server).
        let t1 = Instant::now();
        let next = loop {
            let (now_leading, _) = leader_of(&elections, Duration::from_secs(5)).await;
            if now_leading != leader {
                break now_leading;
            }
            assert!(t1.elapsed() < Duration::from_secs(5));
            tokio::time::sleep(Duration::from_millis(1)).await;
        };
        if next == *target {
            took.push(t0.elapsed());
        } else {
            eprintln!("HAND-OVER round {round}: {next} won the race against {target}");
        }
        // It stays (well past the others' hold, so that their next try sees the new
        // holder and the next hand-over's announcement is verified, even under load).
        tokio::time::sleep(Duration::from_millis(2000)).await;
        assert_eq!(leader_of(&elections, Duration::from_secs(5)).await.0, next);
    }
    assert!(
        took.len() >= 10,
        "only {} of 12 went to the named node",
        took.len()
    );
    took.sort();
    let (p50, p99) = (pct(&took, 50), pct(&took, 99));
    eprintln!(
        "HAND-OVER election, {} of 12 hand-overs to the named node: p50 {p50:?}, p99 {p99:?}",
        took.len()
    );
    assert!(p99 < Duration::from_secs(1), "p99 {p99:?}");

    // A target that is not there: after the hold, the others take it.
    let (leader, _) = leader_of(&elections, Duration::from_secs(5)).await;
    let e = &elections.iter().find(|(n, _)| *n == leader).unwrap().1;
    let t0 = Instant::now();
    e.hand_over_to("ho-nobody");
    loop {
        let (now_leading, _) = leader_of(&elections, Duration::from_secs(10)).await;
        if now_leading != leader {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "nobody took it");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // (The others held off about a second, then waited the grace: printed, not
    // asserted. The hold is decided on each node and is best effort: under load, a node
    // whose last try predates the current holder cannot verify the announcement and
    // does not hold off. The table's tests pin the rule itself.)
    let fallback = t0.elapsed();
    eprintln!("HAND-OVER to a node that is not there: another took it after {fallback:?}");
    for m in managers {
        m.shutdown().await;
    }
}

/// A hand-over to a node id no node can have (here empty) is a plain announced
/// release: the waiting node takes over at once, instead of holding off for a second
/// for a node that cannot come.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hand_over_to_an_impossible_node_id_is_a_plain_release() {
    let pg = PgCluster::start().unwrap();
    let name = unique_name("ho-void");
    let a = LockManager::connect(unheld_options(&pg.url(), "hv-a"))
        .await
        .unwrap();
    let ea = Election::start(&a, name.as_str()).unwrap();
    let t0 = Instant::now();
    while !ea.leadership().is_leader() {
        assert!(t0.elapsed() < Duration::from_secs(10));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // B polls every 30 s: only the announcement can make it take over soon.
    let b = LockManager::connect(
        unheld_options(&pg.url(), "hv-b").poll_interval(Duration::from_secs(30)),
    )
    .await
    .unwrap();
    let eb = Election::start(&b, name.as_str()).unwrap();
    let t0 = Instant::now();
    while eb.leadership().leader().as_deref() != Some("hv-a") {
        assert!(t0.elapsed() < Duration::from_secs(10));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let t0 = Instant::now();
    ea.hand_over_to("");
    while !eb.leadership().is_leader() {
        assert!(t0.elapsed() < Duration::from_secs(10), "B never led");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let took = t0.elapsed();
    eprintln!("HAND-OVER to \"\" (a plain release): the waiting node led after {took:?}");
    // The hold would be a second; a plain release goes in milliseconds (generous
    // under load, still below the hold).
    assert!(took < Duration::from_millis(800), "held off for {took:?}");
    drop((ea, eb));
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_singleton_is_handed_over_and_its_child_stops_first() {
    let pg = PgCluster::start().unwrap();
    let url = pg.url();
    let name = unique_name("hand-over-singleton");
    // (node, started, stopped)
    type Runs = Arc<Mutex<Vec<(&'static str, Instant, Option<Instant>)>>>;
    let runs: Runs = Arc::default();
    let start = |m: &LockManager, node: &'static str| {
        let runs = Arc::clone(&runs);
        Singleton::start(m, name.as_str(), SingletonOptions::default(), move |ctx| {
            let runs = Arc::clone(&runs);
            async move {
                let i = {
                    let mut r = runs.lock().unwrap();
                    r.push((node, Instant::now(), None));
                    r.len() - 1
                };
                ctx.cancelled().await;
                tokio::time::sleep(Duration::from_millis(100)).await;
                runs.lock().unwrap()[i].2 = Some(Instant::now());
                Ok::<(), std::io::Error>(())
            }
        })
        .unwrap()
    };
    let a = LockManager::connect(unheld_options(&url, "hs-a"))
        .await
        .unwrap();
    let sa = start(&a, "hs-a");
    let t0 = Instant::now();
    while runs.lock().unwrap().is_empty() {
        assert!(t0.elapsed() < Duration::from_secs(10));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let b = LockManager::connect(unheld_options(&url, "hs-b"))
        .await
        .unwrap();
    let c = LockManager::connect(unheld_options(&url, "hs-c"))
        .await
        .unwrap();
    let (_sb, _sc) = (start(&b, "hs-b"), start(&c, "hs-c"));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let t0 = Instant::now();
    sa.hand_over_to("hs-c");
    while runs.lock().unwrap().len() < 2 {
        assert!(t0.elapsed() < Duration::from_secs(5), "not handed over");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let took = t0.elapsed();
    let r = runs.lock().unwrap().clone();
    assert_eq!(r[1].0, "hs-c", "{r:?}");
    let stopped = r[0].2.expect("the old child stopped");
    assert!(
        stopped <= r[1].1,
        "the new child started before the old one stopped"
    );
    eprintln!(
        "HAND-OVER singleton: the named node's child started {took:?} after hand_over_to (the old child took 100 ms to stop)"
    );
    for m in [a, b, c] {
        m.shutdown().await;
    }
}

// A rolling deploy of K = 3 replicas: each old replica is replaced in turn (start the
// new one, hand over if it leads, stop it). At most K hand-overs, and every leaderless
// time short.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_deploy_hands_over_at_most_once_per_replica() {
    let pg = PgCluster::start().unwrap();
    let url = pg.url();
    let name = unique_name("rolling");
    type Node = (String, LockManager, Election);
    let start = |id: String| {
        let url = url.clone();
        let name = name.clone();
        async move {
            let m = LockManager::connect(unheld_options(&url, &id))
                .await
                .unwrap();
            let e = Election::start(&m, name.as_str()).unwrap();
            (id, m, e)
        }
    };
    let mut nodes: Vec<Node> = Vec::new();
    for i in 0..3 {
        nodes.push(start(format!("old-{i}")).await);
    }
    // A sampler: who leads, every millisecond, until told to stop.
    let leaderships: Arc<Mutex<Vec<(String, chosen_core::Leadership)>>> = Arc::new(Mutex::new(
        nodes
            .iter()
            .map(|(id, _, e)| (id.clone(), e.leadership()))
            .collect(),
    ));
    let t_start = Instant::now();
    while !nodes.iter().any(|(_, _, e)| e.leadership().is_leader()) {
        assert!(t_start.elapsed() < Duration::from_secs(10));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = {
        let (leaderships, done) = (Arc::clone(&leaderships), Arc::clone(&done));
        tokio::spawn(async move {
            // (changes of leader, leaderless stretches)
            let mut last: Option<String> = None;
            let mut changes = 0;
            let mut gaps = Vec::new();
            let mut gap_since: Option<Instant> = None;
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                let leading: Vec<String> = leaderships
                    .lock()
                    .unwrap()
                    .iter()
                    .filter(|(_, l)| l.is_leader())
                    .map(|(id, _)| id.clone())
                    .collect();
                assert!(leading.len() <= 1, "two leaders: {leading:?}");
                match leading.first() {
                    Some(id) => {
                        if let Some(since) = gap_since.take() {
                            gaps.push(since.elapsed());
                        }
                        if last.as_ref() != Some(id) {
                            if last.is_some() {
                                changes += 1;
                            }
                            last = Some(id.clone());
                        }
                    }
                    None => {
                        gap_since.get_or_insert_with(Instant::now);
                    }
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            (changes, gaps)
        })
    };
    for i in 0..3 {
        let new = start(format!("new-{i}")).await;
        leaderships
            .lock()
            .unwrap()
            .push((new.0.clone(), new.2.leadership()));
        nodes.push(new);
        // The new replica is up and waiting.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let pos = nodes
            .iter()
            .position(|(id, ..)| *id == format!("old-{i}"))
            .unwrap();
        let (_, m, e) = nodes.remove(pos);
        if e.leadership().is_leader() {
            // Hand it to a replica of the new version: it is not stopped later.
            let target = nodes
                .iter()
                .rev()
                .find(|(id, ..)| id.starts_with("new-"))
                .map(|(id, ..)| id.clone())
                .unwrap();
            e.hand_over_to(&target);
            let t0 = Instant::now();
            while e.leadership().is_leader() {
                assert!(t0.elapsed() < Duration::from_secs(5));
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
        m.shutdown().await;
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let (changes, mut gaps) = sampler.await.unwrap();
    gaps.sort();
    let worst = gaps.last().copied().unwrap_or_default();
    eprintln!(
        "HAND-OVER rolling deploy of 3 replicas: {changes} leader changes, {} leaderless stretches, longest {worst:?}",
        gaps.len()
    );
    assert!(changes <= 3, "{changes} hand-overs for 3 replicas");
    assert!(worst < Duration::from_secs(1), "leaderless for {worst:?}");
    for (_, m, _) in nodes {
        m.shutdown().await;
    }
}

/// Records leader changes among `leaderships` every millisecond until `done`, and
/// once more after it is seen set, so that a change the caller waited for before
/// setting it is always recorded (a sampler that stopped at once raced it, seen in CI).
fn watch_leaders(
    leaderships: Arc<Mutex<Vec<(String, chosen_core::Leadership)>>>,
    done: Arc<std::sync::atomic::AtomicBool>,
) -> tokio::task::JoinHandle<Vec<String>> {
    tokio::spawn(async move {
        let mut seen: Vec<String> = Vec::new();
        loop {
            let last_round = done.load(std::sync::atomic::Ordering::SeqCst);
            let leading: Vec<String> = leaderships
                .lock()
                .unwrap()
                .iter()
                .filter(|(_, l)| l.is_leader())
                .map(|(id, _)| id.clone())
                .collect();
            assert!(leading.len() <= 1, "two leaders: {leading:?}");
            if let Some(id) = leading.first()
                && seen.last() != Some(id)
            {
                seen.push(id.clone());
            }
            if last_round {
                break;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        seen
    })
}

// Fail-back: a preferred node that comes (back) takes the leadership from the node
// that led meanwhile, once it has been there for the leader's `fail_back_after`, with
// one hand-over each time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_preferred_node_takes_the_lead_back_once_it_is_stable() {
    use chosen_core::ElectionOptions;

    let pg = PgCluster::start().unwrap();
    let url = pg.url();
    let name = unique_name("fail-back");
    let plain = ElectionOptions::default().fail_back_after(Duration::from_secs(2));
    let preferred = ElectionOptions::default().preferred(true);
    let a = LockManager::connect(unheld_options(&url, "fb-a"))
        .await
        .unwrap();
    let ea = Election::start_with(&a, name.as_str(), plain.clone()).unwrap();
    let t0 = Instant::now();
    while !ea.leadership().is_leader() {
        assert!(t0.elapsed() < Duration::from_secs(10));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let leaderships = Arc::new(Mutex::new(vec![("fb-a".to_owned(), ea.leadership())]));
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = watch_leaders(Arc::clone(&leaderships), Arc::clone(&done));
    for round in 0..2 {
        // The preferred node comes up: after about two seconds it leads.
        let p = LockManager::connect(unheld_options(&url, "fb-p"))
            .await
            .unwrap();
        let ep = Election::start_with(&p, name.as_str(), preferred.clone()).unwrap();
        leaderships
            .lock()
            .unwrap()
            .push(("fb-p".to_owned(), ep.leadership()));
        let t0 = Instant::now();
        while !ep.leadership().is_leader() {
            assert!(
                t0.elapsed() < Duration::from_secs(15),
                "round {round}: no fail-back"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let took = t0.elapsed();
        eprintln!(
            "HAND-OVER fail-back round {round}: the preferred node led {took:?} after it started"
        );
        assert!(
            took >= Duration::from_secs(2),
            "before the window: {took:?}"
        );
        // It keeps it.
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert!(ep.leadership().is_leader());
        // It goes away: the other node leads again.
        p.shutdown().await;
        leaderships.lock().unwrap().retain(|(id, _)| id != "fb-p");
        let t0 = Instant::now();
        while !ea.leadership().is_leader() {
            assert!(t0.elapsed() < Duration::from_secs(10));
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    let seen = watcher.await.unwrap();
    assert_eq!(
        seen,
        ["fb-a", "fb-p", "fb-a", "fb-p", "fb-a"],
        "one hand-over each way"
    );
    a.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_preferred_node_whose_session_is_lost_while_it_waits_is_still_failed_back_to() {
    // The preferred node waits (holding its presence lock) behind a leader that does
    // not prefer it... yet: its session is terminated before the fail-back window has
    // passed. On its next session it must ask again, or the leader keeps the lead.
    use chosen_core::{ConnectionState, ElectionOptions};

    let pg = PgCluster::start_local().unwrap();
    let url = pg.url();
    let admin = chosen_tests::connect_admin(&url).await.unwrap();
    let name = unique_name("fail-back-lost");
    let a = LockManager::connect(unheld_options(&url, "fl-a"))
        .await
        .unwrap();
    let ea = Election::start_with(
        &a,
        name.as_str(),
        ElectionOptions::default().fail_back_after(Duration::from_secs(3)),
    )
    .unwrap();
    let t0 = Instant::now();
    while !ea.leadership().is_leader() {
        assert!(t0.elapsed() < Duration::from_secs(10));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let p = LockManager::connect(unheld_options(&url, "fl-p"))
        .await
        .unwrap();
    let ep = Election::start_with(
        &p,
        name.as_str(),
        ElectionOptions::default().preferred(true),
    )
    .unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let ConnectionState::Connected { backend_pid, .. } = p.connection_status() else {
        panic!("not connected");
    };
    admin
        .execute("SELECT pg_terminate_backend($1)", &[&backend_pid])
        .await
        .unwrap();
    let t0 = Instant::now();
    while !ep.leadership().is_leader() {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the preferred node was not failed back to after its session was lost"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(!ea.leadership().is_leader());
    p.shutdown().await;
    a.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_preferred_singleton_node_gets_the_child_back() {
    let pg = PgCluster::start().unwrap();
    let url = pg.url();
    let name = unique_name("fail-back-singleton");
    type Runs = Arc<Mutex<Vec<(&'static str, Instant, Option<Instant>)>>>;
    let runs: Runs = Arc::default();
    let start = |m: &LockManager, node: &'static str, options: SingletonOptions| {
        let runs = Arc::clone(&runs);
        Singleton::start(m, name.as_str(), options, move |ctx| {
            let runs = Arc::clone(&runs);
            async move {
                let i = {
                    let mut r = runs.lock().unwrap();
                    r.push((node, Instant::now(), None));
                    r.len() - 1
                };
                ctx.cancelled().await;
                tokio::time::sleep(Duration::from_millis(100)).await;
                runs.lock().unwrap()[i].2 = Some(Instant::now());
                Ok::<(), std::io::Error>(())
            }
        })
        .unwrap()
    };
    let a = LockManager::connect(unheld_options(&url, "fs-a"))
        .await
        .unwrap();
    let _sa = start(
        &a,
        "fs-a",
        SingletonOptions::default().fail_back_after(Duration::from_secs(1)),
    );
    let t0 = Instant::now();
    while runs.lock().unwrap().is_empty() {
        assert!(t0.elapsed() < Duration::from_secs(10));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let p = LockManager::connect(unheld_options(&url, "fs-p"))
        .await
        .unwrap();
    let _sp = start(&p, "fs-p", SingletonOptions::default().preferred(true));
    let t0 = Instant::now();
    while runs.lock().unwrap().len() < 2 {
        assert!(t0.elapsed() < Duration::from_secs(15), "no fail-back");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let r = runs.lock().unwrap().clone();
    assert_eq!(r.len(), 2, "it stays with the preferred node: {r:?}");
    assert_eq!(r[1].0, "fs-p");
    assert!(r[0].2.expect("the old child stopped") <= r[1].1, "{r:?}");
    for m in [a, p] {
        m.shutdown().await;
    }
}

// ---- hand-overs at shutdown and in bulk ----------------------------------------------

/// A connection that LISTENs on the release channel; payloads arrive on the receiver.
async fn listener(
    url: &str,
) -> (
    tokio_postgres::Client,
    tokio::sync::mpsc::UnboundedReceiver<String>,
) {
    let (client, mut connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Some(Ok(message)) = std::future::poll_fn(|cx| connection.poll_message(cx)).await {
            if let tokio_postgres::AsyncMessage::Notification(n) = message
                && tx.send(n.payload().to_owned()).is_err()
            {
                break;
            }
        }
    });
    client.batch_execute("LISTEN chosen_release").await.unwrap();
    (client, rx)
}

// The documented rolling deploy ("hand the leadership to a replica that stays, then
// stop"): `hand_over_to` then `shutdown` at once. The release must still name the
// target; a plain release lets any waiting node take it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hand_over_then_shutdown_still_hands_over() {
    let pg = PgCluster::start().unwrap();
    let url = pg.url();
    let (_listen, mut rx) = listener(&url).await;
    // Election.
    let name = unique_name("ho-then-stop");
    let a = LockManager::connect(unheld_options(&url, "hx-a"))
        .await
        .unwrap();
    let ea = Election::start(&a, name.as_str()).unwrap();
    let t0 = Instant::now();
    while !ea.leadership().is_leader() {
        assert!(t0.elapsed() < Duration::from_secs(10));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let b = LockManager::connect(unheld_options(&url, "hx-b"))
        .await
        .unwrap();
    let _eb = Election::start(&b, name.as_str()).unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    ea.hand_over_to("hx-b");
    ea.shutdown().await;
    let payload = tokio::time::timeout(Duration::from_secs(5), rx.recv())
        .await
        .expect("an announcement")
        .unwrap();
    // Singleton whose child takes 100 ms to stop.
    let sname = unique_name("ho-then-stop-singleton");
    let start = |m: &LockManager| {
        Singleton::start(
            m,
            sname.as_str(),
            SingletonOptions::default(),
            |ctx| async move {
                ctx.cancelled().await;
                tokio::time::sleep(Duration::from_millis(100)).await;
                Ok::<(), std::io::Error>(())
            },
        )
        .unwrap()
    };
    let c = LockManager::connect(unheld_options(&url, "hx-c"))
        .await
        .unwrap();
    let sc = start(&c);
    let t0 = Instant::now();
    while !sc.leadership().is_leader() {
        assert!(t0.elapsed() < Duration::from_secs(10));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let _sb = start(&b);
    tokio::time::sleep(Duration::from_millis(300)).await;
    sc.hand_over_to("hx-b");
    sc.shutdown().await;
    let spayload = tokio::time::timeout(Duration::from_secs(5), rx.recv())
        .await
        .expect("an announcement")
        .unwrap();
    eprintln!("HAND-OVER election announced {payload:?}, singleton announced {spayload:?}");
    assert!(
        payload.contains('>'),
        "election: hand_over_to + shutdown released plainly: {payload:?}"
    );
    assert!(
        spayload.contains('>'),
        "singleton: hand_over_to + shutdown released plainly: {spayload:?}"
    );
    for m in [a, b, c] {
        m.shutdown().await;
    }
}

// A node hands many locks over at once (a rolling deploy of a node running many
// singletons): their announcements share NOTIFY payloads of up to 200 entries, and
// each entry is now ~45 bytes: a payload of 8,000 bytes fails the unlock statement,
// which ends the session and revokes every other lease of the process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_hand_overs_at_once_keep_the_session() {
    const N: usize = 400;
    let pg = PgCluster::start().unwrap();
    let url = pg.url();
    let a = LockManager::connect(unheld_options(&url, "hm-a"))
        .await
        .unwrap();
    let b = LockManager::connect(unheld_options(&url, "hm-b"))
        .await
        .unwrap();
    let names: Vec<String> = (0..N).map(|i| unique_name(&format!("many-{i}"))).collect();
    let mut leases = Vec::new();
    for n in &names {
        leases.push(a.acquire(n.as_str()).await.unwrap());
    }
    // A lease nobody waits for, and that is not handed over.
    let bystander = a.acquire(unique_name("bystander").as_str()).await.unwrap();
    // B waits for every one (its tries register interest in their buckets).
    let mut waiting = tokio::task::JoinSet::new();
    for n in &names {
        let (b, n) = (b.clone(), n.clone());
        waiting.spawn(async move { b.acquire(n.as_str()).await.map(|l| (n, l)) });
    }
    tokio::time::sleep(Duration::from_millis(1000)).await;
    // Every release sent before the first await: they merge into one plan.
    let mut releases: Vec<_> = leases
        .into_iter()
        .map(|l| Box::pin(async move { l.hand_over("hm-b").await }))
        .collect();
    std::future::poll_fn(|cx| {
        for r in &mut releases {
            let _ = r.as_mut().poll(cx);
        }
        std::task::Poll::Ready(())
    })
    .await;
    drop(releases);
    let lost = tokio::time::timeout(Duration::from_secs(3), bystander.lost()).await;
    assert!(
        lost.is_err(),
        "handing {N} locks over at once lost the session: {:?}",
        lost.ok()
    );
    let mut got = Vec::new();
    while let Some(r) = waiting.join_next().await {
        got.push(r.unwrap().unwrap());
    }
    assert_eq!(got.len(), N);
    drop(got);
    for m in [a, b] {
        m.shutdown().await;
    }
}

// ---- fail-back -----------------------------------------------------------------------

/// R3-1: a preferred node that stops its election (its manager stays up) keeps the
/// presence lock `chosen.prefer/<lock>` (spawned with the manager's stop token, not the
/// election's): the leader then hands over, again and again, to a node that no longer
/// contends, with a leaderless gap each time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_preferred_election_is_not_failed_back_to() {
    use chosen_core::ElectionOptions;

    let pg = PgCluster::start().unwrap();
    let url = pg.url();
    let name = unique_name("r3-leak");
    let a = LockManager::connect(unheld_options(&url, "r3-a"))
        .await
        .unwrap();
    let ea = Election::start_with(
        &a,
        name.as_str(),
        ElectionOptions::default().fail_back_after(Duration::from_secs(1)),
    )
    .unwrap();
    let t0 = Instant::now();
    while !ea.leadership().is_leader() {
        assert!(t0.elapsed() < Duration::from_secs(10));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let p = LockManager::connect(unheld_options(&url, "r3-p"))
        .await
        .unwrap();
    let ep = Election::start_with(
        &p,
        name.as_str(),
        ElectionOptions::default().preferred(true),
    )
    .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    ep.shutdown().await; // p stops contending; its manager keeps running
    tokio::time::sleep(Duration::from_millis(300)).await;
    let prefer = format!("chosen.prefer/{name}");
    let held = p
        .cluster_locks(&[prefer.as_str()])
        .await
        .unwrap()
        .into_iter()
        .filter(|l| l.holder.node_id == "r3-p" && l.name.as_deref() == Some(prefer.as_str()))
        .count();
    eprintln!("R3-1: locks r3-p still holds after its election stopped: {held}");
    let t0 = Instant::now();
    let mut gaps = 0;
    let mut was = true;
    while t0.elapsed() < Duration::from_secs(20) {
        let now = ea.leadership().is_leader();
        if was && !now {
            gaps += 1;
        }
        was = now;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    for m in [a, p] {
        m.shutdown().await;
    }
    assert_eq!(
        gaps, 0,
        "the leader stepped down {gaps} times for a preferred node that had stopped"
    );
}

// ---- fail-back between preferred nodes, and of a finished child -------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_preferred_nodes_do_not_hand_the_leadership_back_and_forth() {
    // P1 leads; P2, preferred too, comes up and waits (holding the presence lock). A
    // preferred leader keeps the leadership: no hand-over at all, with no fault.
    use chosen_core::ElectionOptions;

    let pg = PgCluster::start().unwrap();
    let url = pg.url();
    let name = unique_name("two-preferred");
    let preferred = ElectionOptions::default()
        .preferred(true)
        .fail_back_after(Duration::from_secs(1));
    let p1 = LockManager::connect(unheld_options(&url, "tp-1"))
        .await
        .unwrap();
    let e1 = Election::start_with(&p1, name.as_str(), preferred.clone()).unwrap();
    let t0 = Instant::now();
    while !e1.leadership().is_leader() {
        assert!(t0.elapsed() < Duration::from_secs(10));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let p2 = LockManager::connect(unheld_options(&url, "tp-2"))
        .await
        .unwrap();
    let e2 = Election::start_with(&p2, name.as_str(), preferred).unwrap();
    let leaderships = Arc::new(Mutex::new(vec![
        ("tp-1".to_owned(), e1.leadership()),
        ("tp-2".to_owned(), e2.leadership()),
    ]));
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = watch_leaders(Arc::clone(&leaderships), Arc::clone(&done));
    // Four fail-back windows and their 2 s look-ups.
    tokio::time::sleep(Duration::from_secs(10)).await;
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    assert_eq!(
        watcher.await.unwrap(),
        ["tp-1"],
        "leader changes with no fault"
    );
    for m in [p1, p2] {
        m.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finished_one_shot_child_is_not_run_again_by_a_fail_back() {
    // A `Never` child that returned keeps its lock on its node, so that no other node
    // runs it again while that node lives: a preferred node coming up is not handed it.
    use chosen_core::RestartPolicy;

    let pg = PgCluster::start().unwrap();
    let url = pg.url();
    let name = unique_name("one-shot");
    let runs: Arc<Mutex<Vec<&'static str>>> = Arc::default();
    let start = |m: &LockManager, node: &'static str, options: SingletonOptions| {
        let runs = Arc::clone(&runs);
        Singleton::start(
            m,
            name.as_str(),
            options.restart(RestartPolicy::Never),
            move |_ctx| {
                let runs = Arc::clone(&runs);
                async move {
                    runs.lock().unwrap().push(node);
                    Ok::<(), std::io::Error>(())
                }
            },
        )
        .unwrap()
    };
    let a = LockManager::connect(unheld_options(&url, "os-a"))
        .await
        .unwrap();
    let sa = start(
        &a,
        "os-a",
        SingletonOptions::default().fail_back_after(Duration::from_secs(1)),
    );
    let t0 = Instant::now();
    while sa.status().child != chosen_core::ChildState::Finished {
        assert!(t0.elapsed() < Duration::from_secs(10));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let p = LockManager::connect(unheld_options(&url, "os-p"))
        .await
        .unwrap();
    let _sp = start(&p, "os-p", SingletonOptions::default().preferred(true));
    // Several fail-back windows and look-ups.
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(
        *runs.lock().unwrap(),
        ["os-a"],
        "the finished child ran again"
    );
    assert!(sa.leadership().is_leader(), "the lock left its node");
    for m in [a, p] {
        m.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_preferred_node_whose_child_gave_up_is_not_failed_back_to_again_and_again() {
    // The preferred node's child cannot start there: it gives up and cools down, the
    // other node runs the child fine. The preferred node, back from its cooldown, must
    // not be handed the lock again (stopping the healthy child) to give up once more,
    // for ever.
    use std::sync::atomic::{AtomicU64, Ordering};

    let pg = PgCluster::start().unwrap();
    let url = pg.url();
    let name = unique_name("preferred-gave-up");
    let n_starts = Arc::new(AtomicU64::new(0));
    let n = LockManager::connect(unheld_options(&url, "pg-n"))
        .await
        .unwrap();
    let sn = {
        let n_starts = Arc::clone(&n_starts);
        Singleton::start(
            &n,
            name.as_str(),
            SingletonOptions::default().fail_back_after(Duration::from_secs(1)),
            move |ctx| {
                n_starts.fetch_add(1, Ordering::SeqCst);
                async move {
                    ctx.cancelled().await;
                    Ok::<(), std::io::Error>(())
                }
            },
        )
        .unwrap()
    };
    let t0 = Instant::now();
    while !sn.leadership().is_leader() {
        assert!(t0.elapsed() < Duration::from_secs(10));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let p = LockManager::connect(unheld_options(&url, "pg-p"))
        .await
        .unwrap();
    let sp = Singleton::start(
        &p,
        name.as_str(),
        SingletonOptions::default()
            .preferred(true)
            .backoff(Duration::from_millis(50), Duration::from_millis(200))
            .give_up_cooldown(Duration::from_secs(2)),
        |_ctx| async { Err::<(), std::io::Error>(std::io::Error::other("cannot start here")) },
    )
    .unwrap();
    // The first fail-back (about 1 s after the preferred node comes, plus a look-up),
    // its give-up, and several cooldowns and fail-back windows after it.
    tokio::time::sleep(Duration::from_secs(20)).await;
    let (starts, give_ups) = (n_starts.load(Ordering::SeqCst), sp.status().give_ups);
    for m in [n, p] {
        m.shutdown().await;
    }
    assert!(give_ups <= 1, "the preferred node gave up {give_ups} times");
    assert!(
        starts <= 2,
        "the healthy node's child was started {starts} times: handed back and forth"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finished_one_shot_child_is_not_run_again_on_its_node_after_a_session_loss() {
    // The node's session is lost after its `Never` child finished; alone, it takes the
    // lock again, and must not start the child again.
    use chosen_core::{ConnectionState, RestartPolicy};

    let pg = PgCluster::start_local().unwrap();
    let url = pg.url();
    let admin = chosen_tests::connect_admin(&url).await.unwrap();
    let name = unique_name("one-shot-lost");
    let runs = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let a = LockManager::connect(unheld_options(&url, "ol-a"))
        .await
        .unwrap();
    let sa = {
        let runs = Arc::clone(&runs);
        Singleton::start(
            &a,
            name.as_str(),
            SingletonOptions::default().restart(RestartPolicy::Never),
            move |_ctx| {
                runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                async { Ok::<(), std::io::Error>(()) }
            },
        )
        .unwrap()
    };
    let t0 = Instant::now();
    while sa.status().child != chosen_core::ChildState::Finished {
        assert!(t0.elapsed() < Duration::from_secs(10));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let ConnectionState::Connected { backend_pid, .. } = a.connection_status() else {
        panic!("not connected");
    };
    admin
        .execute("SELECT pg_terminate_backend($1)", &[&backend_pid])
        .await
        .unwrap();
    // It leads again (after its rejoin pause), with the child finished.
    let t0 = Instant::now();
    while !(sa.leadership().is_leader() && t0.elapsed() > Duration::from_secs(1)) {
        assert!(t0.elapsed() < Duration::from_secs(15), "it never led again");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert_eq!(sa.status().child, chosen_core::ChildState::Finished);
    a.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_preferred_node_whose_child_finished_does_not_take_a_running_child_from_another_node() {
    // P (preferred) ran its one-shot child; its session is lost and N, taking the lock,
    // runs the child again (the lock is a session's: documented). P, back, must not
    // ask to be failed back to: it would take the lock from N's running child and run
    // nothing itself.
    use chosen_core::{ConnectionState, RestartPolicy};
    let pg = PgCluster::start_local().unwrap();
    let url = pg.url();
    let admin = chosen_tests::connect_admin(&url).await.unwrap();
    let name = unique_name("finished-preferred");
    let log: Arc<Mutex<Vec<String>>> = Arc::default();
    let start = |m: &LockManager, node: &'static str, options: SingletonOptions| {
        let log = Arc::clone(&log);
        Singleton::start(m, name.as_str(), options.restart(RestartPolicy::Never), move |ctx| {
            let log = Arc::clone(&log);
            async move {
                log.lock().unwrap().push(format!("{node} start"));
                if node == "r6-p" {
                    // the preferred node's run is quick
                    return Ok::<(), std::io::Error>(());
                }
                // a long one-shot job elsewhere
                tokio::select! {
                    () = ctx.cancelled() => log.lock().unwrap().push(format!("{node} cancelled")),
                    () = tokio::time::sleep(Duration::from_secs(60)) => log.lock().unwrap().push(format!("{node} done")),
                }
                Ok(())
            }
        })
        .unwrap()
    };
    let p = LockManager::connect(unheld_options(&url, "r6-p"))
        .await
        .unwrap();
    let sp = start(&p, "r6-p", SingletonOptions::default().preferred(true));
    let t0 = Instant::now();
    while sp.status().child != chosen_core::ChildState::Finished {
        assert!(t0.elapsed() < Duration::from_secs(10));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let n = LockManager::connect(unheld_options(&url, "r6-n"))
        .await
        .unwrap();
    let sn = start(
        &n,
        "r6-n",
        SingletonOptions::default().fail_back_after(Duration::from_secs(1)),
    );
    let _ = &sn;
    tokio::time::sleep(Duration::from_millis(500)).await;
    // P's session is lost: N takes the lock and runs the child again (documented).
    let ConnectionState::Connected { backend_pid, .. } = p.connection_status() else {
        panic!()
    };
    admin
        .execute("SELECT pg_terminate_backend($1)", &[&backend_pid])
        .await
        .unwrap();
    let t0 = Instant::now();
    while !log.lock().unwrap().iter().any(|l| l == "r6-n start") {
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "N never ran: {:?}",
            log.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // P comes back, holds the presence lock although it will never start the child.
    tokio::time::sleep(Duration::from_secs(8)).await;
    let l = log.lock().unwrap().clone();
    for m in [n, p] {
        m.shutdown().await;
    }
    assert!(
        !l.iter().any(|x| x == "r6-n cancelled"),
        "N's running one-shot was cut off by a fail-back to a node that runs nothing: {l:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_down_of_a_finished_child_starts_it_again_on_the_next_holder() {
    // An explicit step-down gives the lock away and forgets that the child finished:
    // whoever takes the lock next starts it again, this node too.
    use chosen_core::RestartPolicy;
    let pg = PgCluster::start().unwrap();
    let url = pg.url();
    let name = unique_name("step-down-finished");
    let runs = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let a = LockManager::connect(unheld_options(&url, "r6-a"))
        .await
        .unwrap();
    let sa = {
        let runs = Arc::clone(&runs);
        Singleton::start(
            &a,
            name.as_str(),
            SingletonOptions::default().restart(RestartPolicy::Never),
            move |_ctx| {
                runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                async { Ok::<(), std::io::Error>(()) }
            },
        )
        .unwrap()
    };
    let t0 = Instant::now();
    while sa.status().child != chosen_core::ChildState::Finished {
        assert!(t0.elapsed() < Duration::from_secs(10));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    sa.step_down();
    tokio::time::sleep(Duration::from_secs(5)).await;
    let r = runs.load(std::sync::atomic::Ordering::SeqCst);
    a.shutdown().await;
    assert_eq!(
        r, 2,
        "the next node to take the lock (this one) did not start the child again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_preferred_node_gets_the_singleton_back_after_a_transient_give_up() {
    // The preferred node's child fails at first (its dependency is down for 6 s) and
    // gives up; it does not ask for fail-back for ten cooldowns (20 s: longer than ten
    // intensity periods), then does, and, healthy by then, gets the singleton back.
    let pg = PgCluster::start().unwrap();
    let url = pg.url();
    let name = unique_name("transient-give-up");
    let n = LockManager::connect(unheld_options(&url, "r6-tn"))
        .await
        .unwrap();
    let sn = Singleton::start(
        &n,
        name.as_str(),
        SingletonOptions::default().fail_back_after(Duration::from_secs(1)),
        |ctx| async move {
            ctx.cancelled().await;
            Ok::<(), std::io::Error>(())
        },
    )
    .unwrap();
    let t0 = Instant::now();
    while !sn.leadership().is_leader() {
        assert!(t0.elapsed() < Duration::from_secs(10));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let p = LockManager::connect(unheld_options(&url, "r6-tp"))
        .await
        .unwrap();
    let born = Instant::now();
    let sp = Singleton::start(
        &p,
        name.as_str(),
        SingletonOptions::default()
            .preferred(true)
            .intensity(3, Duration::from_secs(1))
            .backoff(Duration::from_millis(50), Duration::from_millis(200))
            .give_up_cooldown(Duration::from_secs(2)),
        move |ctx| async move {
            // a transient failure: its dependency is down for the first 6 s
            if born.elapsed() < Duration::from_secs(6) {
                return Err(std::io::Error::other("dependency down"));
            }
            ctx.cancelled().await;
            Ok(())
        },
    )
    .unwrap();
    tokio::time::sleep(Duration::from_secs(40)).await;
    let (pl, gu) = (sp.leadership().is_leader(), sp.status().give_ups);
    assert!(gu >= 1, "the transient failure never gave up");
    for m in [n, p] {
        m.shutdown().await;
    }
    assert!(
        pl,
        "the preferred node, healthy for 34 s, never got the singleton back"
    );
}
