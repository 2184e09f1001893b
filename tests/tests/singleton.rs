//! Singletons against real clusters: one child across the fleet, takeovers, restarts,
//! cancellation, many singletons on one backend, and real node processes.

use std::future::Future;
use std::process::Command;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chosen_core::{
    LeaderState, LockManager, RestartPolicy, Singleton, SingletonOptions, SingletonState,
};
use chosen_tests::{
    NodeProcess, PgCluster, connect_admin, manager_options, signal, test_binary, unique_name,
};

/// Records every child's life, across every singleton given to it: when it started and
/// when its future was dropped (returned *or* aborted), from a drop guard.
#[derive(Clone, Default)]
struct Census {
    running: Arc<AtomicI64>,
    max: Arc<AtomicI64>,
    starts: Arc<Mutex<Vec<(String, Instant)>>>,
    /// (node, started, ended) of every child that ended.
    lives: Arc<Mutex<Vec<(String, Instant, Instant)>>>,
    cancelled: Arc<AtomicU64>,
}

/// Ends a child's life in the census when the child future goes away, however.
struct Life {
    census: Census,
    node: String,
    started: Instant,
}

impl Drop for Life {
    fn drop(&mut self) {
        self.census.running.fetch_sub(1, Ordering::SeqCst);
        self.census
            .lives
            .lock()
            .unwrap()
            .push((self.node.clone(), self.started, Instant::now()));
    }
}

impl Census {
    fn start(&self, manager: &LockManager, name: &str, opts: SingletonOptions) -> Singleton {
        let census = self.clone();
        Singleton::start(manager, name, opts, move |ctx| {
            let census = census.clone();
            async move {
                let started = Instant::now();
                let now = census.running.fetch_add(1, Ordering::SeqCst) + 1;
                census.max.fetch_max(now, Ordering::SeqCst);
                let _life = Life {
                    census: census.clone(),
                    node: ctx.node_id().to_owned(),
                    started,
                };
                census
                    .starts
                    .lock()
                    .unwrap()
                    .push((ctx.node_id().to_owned(), started));
                ctx.cancelled().await;
                census.cancelled.fetch_add(1, Ordering::SeqCst);
                Ok::<(), std::io::Error>(())
            }
        })
        .unwrap()
    }

    async fn wait_starts(&self, n: usize) -> (String, Instant) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(last) = self.starts.lock().unwrap().get(n - 1) {
                return last.clone();
            }
            assert!(Instant::now() < deadline, "no start #{n}");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// Asserts from the recorded lives that no child started before the previous one's
    /// future was gone (a child still running counts as running forever).
    fn assert_one_at_a_time(&self) {
        let starts = self.starts.lock().unwrap().clone();
        let lives = self.lives.lock().unwrap().clone();
        for (i, (node, started)) in starts.iter().enumerate() {
            for (other, other_started) in &starts[i + 1..] {
                let ended = lives
                    .iter()
                    .find(|(n, s, _)| n == node && s == started)
                    .map(|(_, _, e)| *e);
                assert!(
                    ended.is_some_and(|e| e <= *other_started),
                    "the child on {other} started while the one on {node} ran (ended {:?} after its start)",
                    ended.map(|e| e - *started)
                );
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_child_across_three_managers_and_takeovers() {
    let pg = PgCluster::start().unwrap();
    let name = unique_name("singleton");
    let census = Census::default();
    let mut managers = Vec::new();
    let mut singletons = Vec::new();
    for i in 0..3 {
        let m = LockManager::connect(
            manager_options(&pg.url(), &format!("single-{i}"))
                .poll_interval(Duration::from_millis(100)),
        )
        .await
        .unwrap();
        singletons.push(census.start(&m, &name, SingletonOptions::default()));
        managers.push(m);
    }
    let (first, _) = census.wait_starts(1).await;
    // Followers learn who leads from their holder look-up (refreshed every 2 s): wait
    // for that, bounded, rather than sleeping.
    let deadline = Instant::now() + Duration::from_secs(10);
    while singletons
        .iter()
        .filter(|s| s.leadership().leader().as_deref() == Some(first.as_str()))
        .count()
        < 3
    {
        assert!(
            Instant::now() < deadline,
            "the followers never learnt the leader"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(census.running.load(Ordering::SeqCst), 1);
    let leader = singletons
        .iter()
        .position(|s| s.leadership().is_leader())
        .expect("one leads");
    assert_eq!(managers[leader].node_id(), first);
    for (i, s) in singletons.iter().enumerate() {
        let status = s.status();
        if i == leader {
            assert!(
                matches!(status.state, SingletonState::Leading { .. }),
                "{status:?}"
            );
        } else {
            // Followers know who leads (refreshed every 2 s).
            assert_eq!(
                status.state,
                SingletonState::Following {
                    leader: Some(first.clone())
                },
                "{status:?}"
            );
        }
    }

    // Graceful: the leader shuts down; a follower starts the child about a round trip later.
    let t0 = Instant::now();
    singletons[leader].shutdown().await;
    let (second, started) = census.wait_starts(2).await;
    assert_ne!(second, first);
    let graceful = started - t0;
    assert!(graceful < Duration::from_secs(1), "{graceful:?}");

    // Killed session: the new leader's child is cancelled, another node takes over.
    let second_index = managers.iter().position(|m| m.node_id() == second).unwrap();
    let pid = match managers[second_index].connection_status() {
        chosen_core::ConnectionState::Connected { backend_pid, .. } => backend_pid,
        other => panic!("{other:?}"),
    };
    let admin = connect_admin(&pg.url()).await.unwrap();
    let t1 = Instant::now();
    admin
        .execute("SELECT pg_terminate_backend($1)", &[&pid])
        .await
        .unwrap();
    let (_third, started) = census.wait_starts(3).await;
    let killed = started - t1;
    // A killed session's lock is free within milliseconds; the waiters poll every
    // 100 ms: 2 s is twenty polls.
    assert!(killed < Duration::from_secs(2), "{killed:?}");
    assert!(
        census.cancelled.load(Ordering::SeqCst) >= 2,
        "children were told to stop"
    );
    census.assert_one_at_a_time();
    assert_eq!(
        census.max.load(Ordering::SeqCst),
        1,
        "never two children at once"
    );
    eprintln!(
        "TAKEOVER singleton: graceful shutdown {} ms, killed session {} ms",
        graceful.as_millis(),
        killed.as_millis()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_hand_over_is_announced_not_polled() {
    let pg = PgCluster::start().unwrap();
    let name = unique_name("announced");
    let census = Census::default();
    // Followers poll every 30 s: a take-over under a second can only come from the
    // release announcement (NOTIFY).
    let slow = || SingletonOptions::default().poll_interval(Duration::from_secs(30));
    let a = LockManager::connect(
        manager_options(&pg.url(), "announced-a").poll_interval(Duration::from_millis(100)),
    )
    .await
    .unwrap();
    let leader = census.start(&a, &name, slow());
    census.wait_starts(1).await;
    let b = LockManager::connect(
        manager_options(&pg.url(), "announced-b").poll_interval(Duration::from_millis(100)),
    )
    .await
    .unwrap();
    let follower = census.start(&b, &name, slow());
    // B has tried once and lost (it follows, knowing A leads): now it sleeps for 30 s.
    let deadline = Instant::now() + Duration::from_secs(10);
    while follower.leadership().leader().as_deref() != Some("announced-a") {
        assert!(Instant::now() < deadline, "{:?}", follower.status());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let t0 = Instant::now();
    leader.shutdown().await;
    let (node, started) = census.wait_starts(2).await;
    assert_eq!(node, "announced-b");
    let took = started - t0;
    assert!(took < Duration::from_secs(1), "{took:?}");
    census.assert_one_at_a_time();
    follower.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_singletons_with_one_name_in_one_process_never_both_run() {
    let pg = PgCluster::start().unwrap();
    let m = LockManager::connect(
        manager_options(&pg.url(), "same-name").poll_interval(Duration::from_millis(100)),
    )
    .await
    .unwrap();
    let name = unique_name("same");
    let census = Census::default();
    let a = census.start(&m, &name, SingletonOptions::default());
    let b = census.start(&m, &name, SingletonOptions::default());
    census.wait_starts(1).await;
    // Wait until the other one has tried and follows (bounded), not a fixed sleep.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !matches!(a.leadership().state(), LeaderState::Following { .. })
        && !matches!(b.leadership().state(), LeaderState::Following { .. })
    {
        assert!(Instant::now() < deadline, "neither follows");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(census.running.load(Ordering::SeqCst), 1);
    let (leader, follower) = if a.leadership().is_leader() {
        (a, b)
    } else {
        (b, a)
    };
    assert!(!follower.leadership().is_leader());
    leader.shutdown().await;
    census.wait_starts(2).await;
    assert!(follower.leadership().is_leader());
    census.assert_one_at_a_time();
    assert_eq!(census.max.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_singletons_share_one_backend() {
    let pg = PgCluster::start().unwrap();
    let node = unique_name("many-singletons");
    let node = node[..node.len().min(60)].to_owned();
    let m = LockManager::connect(
        manager_options(&pg.url(), &node).poll_interval(Duration::from_millis(100)),
    )
    .await
    .unwrap();
    let census = Census::default();
    let prefix = unique_name("s");
    let singletons: Vec<_> = (0..200)
        .map(|i| census.start(&m, &format!("{prefix}-{i}"), SingletonOptions::default()))
        .collect();
    census.wait_starts(200).await;
    assert_eq!(census.running.load(Ordering::SeqCst), 200);
    let admin = connect_admin(&pg.url()).await.unwrap();
    let backends: i64 = admin
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1",
            &[&node],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(backends, 1);
    for s in &singletons {
        s.shutdown().await;
    }
    assert_eq!(census.running.load(Ordering::SeqCst), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_child_that_ignores_cancellation_is_aborted_and_failures_restart() {
    let pg = PgCluster::start().unwrap();
    let m = LockManager::connect(
        manager_options(&pg.url(), "stubborn").poll_interval(Duration::from_millis(100)),
    )
    .await
    .unwrap();
    let finished = Arc::new(AtomicU64::new(0));
    let runs = Arc::new(AtomicU64::new(0));
    // When the stubborn child's future was dropped (aborted), from a drop guard.
    let dropped: Arc<Mutex<Option<Instant>>> = Arc::default();
    struct Dropped(Arc<Mutex<Option<Instant>>>);
    impl Drop for Dropped {
        fn drop(&mut self) {
            *self.0.lock().unwrap() = Some(Instant::now());
        }
    }
    let singleton = Singleton::start(
        &m,
        unique_name("stubborn"),
        SingletonOptions::default()
            .shutdown_timeout(Duration::from_millis(300))
            .restart(RestartPolicy::OnFailure)
            .backoff(Duration::from_millis(10), Duration::from_millis(50)),
        {
            let finished = Arc::clone(&finished);
            let runs = Arc::clone(&runs);
            let dropped = Arc::clone(&dropped);
            move |_ctx| {
                let finished = Arc::clone(&finished);
                let dropped = Arc::clone(&dropped);
                let n = runs.fetch_add(1, Ordering::SeqCst);
                async move {
                    if n < 2 {
                        return Err(std::io::Error::other(format!("failure {n}")));
                    }
                    let _guard = Dropped(dropped);
                    // Ignores cancellation entirely.
                    tokio::time::sleep(Duration::from_secs(3600)).await;
                    finished.fetch_add(1, Ordering::SeqCst);
                    Ok(())
                }
            }
        },
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while runs.load(Ordering::SeqCst) < 3 {
        assert!(Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let status = singleton.status();
    assert_eq!(status.restarts, 2);
    assert_eq!(status.last_failure.as_deref(), Some("failure 1"));
    let t0 = Instant::now();
    // Bounded: a child that is never aborted would keep shutdown() waiting an hour.
    tokio::time::timeout(Duration::from_secs(10), singleton.shutdown())
        .await
        .expect("shutdown() returned: the stubborn child was aborted");
    let took = t0.elapsed();
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_secs(3),
        "{took:?}"
    );
    let dropped_at = dropped
        .lock()
        .unwrap()
        .expect("the child's future was dropped (aborted) by the time shutdown() returned");
    assert!(
        dropped_at - t0 >= Duration::from_millis(300),
        "aborted before the shutdown timeout: {:?}",
        dropped_at - t0
    );
    assert_eq!(finished.load(Ordering::SeqCst), 0, "aborted, not finished");
    assert_eq!(singleton.status().state, SingletonState::Stopped);
    assert_eq!(singleton.leadership().state(), LeaderState::Stopped);
    // The lock was released.
    assert!(
        m.try_acquire(singleton.status().name.as_str())
            .await
            .unwrap()
            .is_some()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_timeout_beyond_the_stop_budget_is_rejected() {
    let pg = PgCluster::start().unwrap();
    let m = LockManager::connect(
        manager_options(&pg.url(), "budget").poll_interval(Duration::from_millis(100)),
    )
    .await
    .unwrap();
    let err = Singleton::start(
        &m,
        "x",
        SingletonOptions::default().shutdown_timeout(Duration::from_secs(10)),
        |_ctx| async { Ok::<(), std::io::Error>(()) },
    )
    .unwrap_err();
    assert!(err.to_string().contains("stop_budget"), "{err}");
    let err = Singleton::start(&m, "", SingletonOptions::default(), |_ctx| async {
        Ok::<(), std::io::Error>(())
    })
    .unwrap_err();
    assert!(matches!(err, chosen_core::Error::InvalidName(_)), "{err}");
}

fn spawn_node(url: &str, id: &str, singleton: &str, poll: Duration) -> NodeProcess {
    NodeProcess::spawn(
        url,
        &[
            "--node-id",
            id,
            "--singleton",
            singleton,
            "--poll-ms",
            &poll.as_millis().to_string(),
        ],
    )
    .unwrap()
}

/// Waits until `node` reports `leader` as the leader. A node's election asks for the
/// lock before it looks the leader up, and its manager answers the look-up only after
/// the statement that tried the lock: so `node` has also tried and seen `leader` hold
/// it, and waits as a node that knows the lock is contended and whose release
/// announcement to trust. (A `following` event with no leader comes before any try.)
fn wait_following(node: &NodeProcess, leader: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    let needle = format!("\"leader\":\"{leader}\"");
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = node
            .wait("following", left)
            .unwrap_or_else(|| panic!("no \"following\" event naming {leader}"));
        if line.contains(&needle) {
            return;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_processes_take_over_after_sigkill_and_sigterm() {
    let pg = PgCluster::start().unwrap();
    let name = unique_name("proc");
    let url = pg.url();
    let fast = Duration::from_millis(100);
    let a = spawn_node(&url, "proc-a", &name, fast);
    a.wait("child_started", Duration::from_secs(20))
        .expect("A runs the child");
    // A killed process announces nothing: only a poll finds its lock free, so B polls
    // often.
    let b = spawn_node(&url, "proc-b", &name, fast);
    wait_following(&b, "proc-a");

    // SIGKILL the leader: B's child starts within a poll or so.
    let mut a = a;
    let t0 = Instant::now();
    a.child.kill().unwrap();
    let _ = a.child.wait();
    let b = tokio::task::spawn_blocking(move || {
        b.wait("child_started", Duration::from_secs(20))
            .expect("B takes over");
        b
    })
    .await
    .unwrap();
    let sigkill = t0.elapsed();

    // C polls every 30 s: after its first try, which sees B hold the lock, only B's
    // release announcement can wake it within the next 27 s (30 s less the 10 % jitter).
    let slow = Duration::from_secs(30);
    let c_spawned = Instant::now();
    let c = spawn_node(&url, "proc-c", &name, slow);
    wait_following(&c, "proc-b");

    // SIGTERM the leader: graceful hand-over, exit 0.
    let t1 = Instant::now();
    signal(b.child.id(), "TERM").unwrap();
    let c = tokio::task::spawn_blocking(move || {
        c.wait("child_started", Duration::from_secs(20))
            .expect("the last node takes over");
        c
    })
    .await
    .unwrap();
    let sigterm = t1.elapsed();
    let taken_after_spawn = c_spawned.elapsed();
    let mut b = b;
    let status = b.child.wait().unwrap();
    assert!(status.success(), "{status}");
    let done = b
        .wait("shutdown", Duration::from_secs(5))
        .expect("a shutdown event");
    assert!(done.contains("\"phase\":\"begin\""), "{done}");
    assert!(
        b.wait("shutdown", Duration::from_secs(5)).is_some(),
        "a second shutdown event (done)"
    );
    drop(c);
    // B polls every 100 ms and a killed process's lock is free within milliseconds:
    // 2 s is twenty polls.
    assert!(sigkill < Duration::from_secs(2), "{sigkill:?}");
    // A SIGTERM is announced: milliseconds; 1 s allows for process noise and is far
    // below C's next poll, which cannot have come yet.
    assert!(
        taken_after_spawn < slow - slow / 10,
        "C took over {taken_after_spawn:?} after it started: maybe by a poll"
    );
    assert!(sigterm < Duration::from_secs(1), "{sigterm:?}");
    eprintln!(
        "TAKEOVER node process: SIGKILL {} ms, SIGTERM {} ms",
        sigkill.as_millis(),
        sigterm.as_millis()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_rejects_bad_flags_with_one_line() {
    let bin = test_binary("node").unwrap();
    for (args, url) in [
        (vec!["--node-id", "x"], Some("postgres://u@127.0.0.1:1/db")),
        (
            vec!["--singleton", "s"],
            Some("postgres://u@127.0.0.1:1/db"),
        ),
        (
            vec!["--node-id", "x", "--singleton", "s", "--tick-ms", "abc"],
            Some("postgres://u@127.0.0.1:1/db"),
        ),
        (
            vec!["--node-id", "x", "--singleton", "s", "--bogus"],
            Some("postgres://u@127.0.0.1:1/db"),
        ),
        (
            vec!["--node-id", "x", "--singleton", "s"],
            Some("postgres://u@host:notaport/db"),
        ),
        (vec!["--node-id", "x", "--singleton", "s"], None),
    ] {
        let mut cmd = Command::new(&bin);
        cmd.args(&args).env_remove("DATABASE_URL");
        if let Some(url) = url {
            cmd.env("DATABASE_URL", url);
        }
        let out = cmd.output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(stderr.trim().lines().count(), 1, "{args:?}: {stderr}");
        assert!(stderr.starts_with("node: "), "{stderr}");
    }
}

// ---- leadership never outlives its lease -------------------------------------------
//
// Whatever ends a lease on this node (its supervisor or election task dying, the task
// dropped with its runtime), this node's `Leadership` must stop reporting leadership
// before another node can take over, and its child must be stopped before the lock is
// released.

/// A metrics sink that panics when a singleton's child is reported running.
#[derive(Debug)]
struct PanicsOnRunning;

impl chosen_core::MetricsSink for PanicsOnRunning {
    fn singleton_running(&self, _node: &str, _singleton: &str, running: bool) {
        assert!(!running, "metrics sink fails on purpose");
    }
}

/// Counts one node's children: started, running now (decremented even when aborted).
#[derive(Clone, Default)]
struct Children {
    started: Arc<AtomicU64>,
    running: Arc<AtomicI64>,
}

struct Running(Arc<AtomicI64>);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Children {
    /// A child that runs until cancelled, counted even when it is aborted instead.
    fn child(
        &self,
    ) -> impl Fn(
        chosen_core::LeaderContext,
    ) -> std::pin::Pin<Box<dyn Future<Output = Result<(), std::io::Error>> + Send>>
    + Send
    + Sync
    + 'static {
        let me = self.clone();
        move |ctx| {
            let me = me.clone();
            Box::pin(async move {
                me.started.fetch_add(1, Ordering::SeqCst);
                me.running.fetch_add(1, Ordering::SeqCst);
                let _running = Running(Arc::clone(&me.running));
                ctx.cancelled().await;
                Ok(())
            })
        }
    }
}

async fn eventually(what: &str, limit: Duration, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !check() {
        assert!(Instant::now() < deadline, "not within {limit:?}: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_metrics_sink_ends_leadership_before_another_node_leads() {
    let pg = PgCluster::start().unwrap();
    let name = unique_name("sink-panics");
    let a = LockManager::connect(
        manager_options(&pg.url(), "sink-a")
            .poll_interval(Duration::from_millis(100))
            .metrics(Arc::new(PanicsOnRunning)),
    )
    .await
    .unwrap();
    let b = LockManager::connect(
        manager_options(&pg.url(), "sink-b").poll_interval(Duration::from_millis(100)),
    )
    .await
    .unwrap();
    let (children_a, children_b) = (Children::default(), Children::default());
    let single_a =
        Singleton::start(&a, &name, SingletonOptions::default(), children_a.child()).unwrap();
    let leadership_a = single_a.leadership();
    // A wins (nobody else contends yet), then its supervisor panics in the sink.
    eventually("a wins", Duration::from_secs(10), || {
        !matches!(
            leadership_a.state(),
            LeaderState::Following { leader: None }
        ) || children_a.started.load(Ordering::SeqCst) > 0
    })
    .await;
    let single_b =
        Singleton::start(&b, &name, SingletonOptions::default(), children_b.child()).unwrap();
    let leadership_b = single_b.leadership();
    // Watch both sides until B leads, then a while longer.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut b_led_at = None;
    loop {
        let (la, lb) = (leadership_a.is_leader(), leadership_b.is_leader());
        let (ra, rb) = (
            children_a.running.load(Ordering::SeqCst),
            children_b.running.load(Ordering::SeqCst),
        );
        assert!(!(la && lb), "both nodes report leadership");
        assert!(ra + rb <= 1, "children running at once: a={ra} b={rb}");
        if lb && b_led_at.is_none() {
            b_led_at = Some(Instant::now());
        }
        if b_led_at.is_some_and(|t| t.elapsed() > Duration::from_secs(1)) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "b never led; a leads: {la}, a: {:?}",
            single_a.status()
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert!(!leadership_a.is_leader());
    assert_eq!(children_a.running.load(Ordering::SeqCst), 0);
    assert_eq!(
        single_a.status().state,
        SingletonState::Stopped,
        "{:?}",
        single_a.status()
    );
    assert_eq!(leadership_a.state(), LeaderState::Stopped);
    single_b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_factory_that_panics_is_a_child_failure_not_a_lost_supervisor() {
    let pg = PgCluster::start().unwrap();
    let name = unique_name("factory-panics");
    let a = LockManager::connect(
        manager_options(&pg.url(), "factory-a").poll_interval(Duration::from_millis(100)),
    )
    .await
    .unwrap();
    let b = LockManager::connect(
        manager_options(&pg.url(), "factory-b").poll_interval(Duration::from_millis(100)),
    )
    .await
    .unwrap();
    let calls = Arc::new(AtomicU64::new(0));
    let children_a = Children::default();
    let single_a = Singleton::start(&a, &name, SingletonOptions::default(), {
        let calls = Arc::clone(&calls);
        let child = children_a.child();
        move |ctx| {
            // The first call panics before it returns a future.
            assert!(
                calls.fetch_add(1, Ordering::SeqCst) > 0,
                "factory fails on purpose"
            );
            child(ctx)
        }
    })
    .unwrap();
    let leadership_a = single_a.leadership();
    eventually("a's factory called", Duration::from_secs(10), || {
        calls.load(Ordering::SeqCst) > 0
    })
    .await;
    let children_b = Children::default();
    let single_b =
        Singleton::start(&b, &name, SingletonOptions::default(), children_b.child()).unwrap();
    let leadership_b = single_b.leadership();
    let until = Instant::now() + Duration::from_secs(3);
    while Instant::now() < until {
        assert!(
            !(leadership_a.is_leader() && leadership_b.is_leader()),
            "both nodes report leadership"
        );
        let (ra, rb) = (
            children_a.running.load(Ordering::SeqCst),
            children_b.running.load(Ordering::SeqCst),
        );
        assert!(ra + rb <= 1, "children running at once: a={ra} b={rb}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    // The panic counted as a child failure: A restarted the child and still leads.
    let status = single_a.status();
    assert!(leadership_a.is_leader(), "{status:?}");
    assert_eq!(status.restarts, 1, "{status:?}");
    assert!(
        status
            .last_failure
            .as_deref()
            .is_some_and(|f| f.contains("factory fails on purpose")),
        "{status:?}"
    );
    assert_eq!(children_a.running.load(Ordering::SeqCst), 1);
    assert_eq!(children_b.started.load(Ordering::SeqCst), 0);
    single_a.shutdown().await;
    single_b.shutdown().await;
}

/// Elections and singletons whose tasks die with their runtime (here: a second runtime
/// shut down under them, while the manager lives on in the test's runtime).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_dropped_with_its_runtime_ends_leadership() {
    let pg = PgCluster::start().unwrap();
    for kind in ["election", "singleton"] {
        let name = unique_name(kind);
        let a = LockManager::connect(
            manager_options(&pg.url(), "rt-a").poll_interval(Duration::from_millis(100)),
        )
        .await
        .unwrap();
        let b = LockManager::connect(
            manager_options(&pg.url(), "rt-b").poll_interval(Duration::from_millis(100)),
        )
        .await
        .unwrap();
        let doomed = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let children_a = Children::default();
        let (leadership_a, keep) = {
            let _in_doomed = doomed.enter();
            if kind == "election" {
                let e = chosen_core::Election::start(&a, name.as_str()).unwrap();
                (e.leadership(), Box::new(e) as Box<dyn std::any::Any + Send>)
            } else {
                let s =
                    Singleton::start(&a, &name, SingletonOptions::default(), children_a.child())
                        .unwrap();
                (s.leadership(), Box::new(s) as Box<dyn std::any::Any + Send>)
            }
        };
        tokio::time::timeout(Duration::from_secs(10), leadership_a.wait_leading())
            .await
            .expect("a leads");
        if kind == "singleton" {
            eventually("a's child runs", Duration::from_secs(10), || {
                children_a.running.load(Ordering::SeqCst) == 1
            })
            .await;
        }
        let election_b = chosen_core::Election::start(&b, name.as_str()).unwrap();
        let leadership_b = election_b.leadership();
        doomed.shutdown_background();
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut b_led_at = None;
        loop {
            let (la, lb) = (leadership_a.is_leader(), leadership_b.is_leader());
            assert!(!(la && lb), "{kind}: both nodes report leadership");
            if lb && b_led_at.is_none() {
                b_led_at = Some(Instant::now());
                assert_eq!(children_a.running.load(Ordering::SeqCst), 0, "{kind}");
            }
            if b_led_at.is_some_and(|t| t.elapsed() > Duration::from_millis(500)) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{kind}: b never led; a leads: {la}"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        assert!(!leadership_a.is_leader(), "{kind}");
        assert_eq!(leadership_a.state(), LeaderState::Stopped, "{kind}");
        election_b.shutdown().await;
        drop(keep);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_whose_child_cannot_start_gives_the_lock_to_another_node() {
    // Node A's child fails as soon as it starts (its configuration is wrong, say); its
    // backoff spreads the restarts wider than the intensity counts. A must still give
    // the lock up after max_restarts + 1 failures in a row, so that node B, whose child
    // starts, runs it; A cools down before it contends again.
    let pg = PgCluster::start().unwrap();
    let url = pg.url();
    let name = unique_name("cannot-start");
    let started_on_b = Arc::new(AtomicU64::new(0));
    let a = LockManager::connect(
        manager_options(&url, "cs-a").poll_interval(Duration::from_millis(100)),
    )
    .await
    .unwrap();
    let sa = Singleton::start(
        &a,
        name.as_str(),
        SingletonOptions::default()
            .intensity(3, Duration::from_millis(500))
            .backoff(Duration::from_secs(1), Duration::from_secs(30))
            .give_up_cooldown(Duration::from_secs(60)),
        |_ctx| async { Err::<(), std::io::Error>(std::io::Error::other("no such table")) },
    )
    .unwrap();
    let t0 = Instant::now();
    while !sa.leadership().is_leader() {
        assert!(t0.elapsed() < Duration::from_secs(10));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let b = LockManager::connect(
        manager_options(&url, "cs-b").poll_interval(Duration::from_millis(100)),
    )
    .await
    .unwrap();
    let _sb = Singleton::start(&b, name.as_str(), SingletonOptions::default(), {
        let started_on_b = Arc::clone(&started_on_b);
        move |ctx| {
            started_on_b.fetch_add(1, Ordering::SeqCst);
            async move {
                ctx.cancelled().await;
                Ok::<(), std::io::Error>(())
            }
        }
    })
    .unwrap();
    // Restarts after 1, 2 and 4 s: the 4th failure, about 7 s in, gives up.
    let t0 = Instant::now();
    while started_on_b.load(Ordering::SeqCst) == 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "node A sat on the lock with a child that cannot start: {:?}",
            sa.status()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let status = sa.status();
    assert_eq!(status.give_ups, 1, "{status:?}");
    assert!(
        matches!(status.state, SingletonState::CoolingDown { .. }),
        "{status:?}"
    );
    for m in [a, b] {
        m.shutdown().await;
    }
}
