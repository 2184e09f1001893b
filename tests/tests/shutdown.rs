//! `LockManager::shutdown` alone stops what was started from it, in order: every
//! singleton's child first, every election's contest, then the announced releases,
//! then the session. A lock is released only once its lease is dropped (a waiting node
//! cannot start while this node still works under the lease), or once the stop budget
//! ran out, then without an announcement. Real clusters.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chosen_core::{
    Election, Error, LeaderState, LockManager, Singleton, SingletonOptions, SingletonState,
};
use chosen_tests::{PgCluster, manager_options, unique_name};

/// One moment of a child's life: (node, what, when).
type Moment = (String, &'static str, Instant);

/// Instants of a child's life, per node: started, cancelled, and when its future was
/// dropped.
#[derive(Clone, Default)]
struct Lives(Arc<Mutex<Vec<Moment>>>);

struct Gone(Lives, String);

impl Drop for Gone {
    fn drop(&mut self) {
        self.0.record(&self.1, "gone");
    }
}

impl Lives {
    fn record(&self, node: &str, what: &'static str) {
        self.0
            .lock()
            .unwrap()
            .push((node.to_owned(), what, Instant::now()));
    }

    fn at(&self, node: &str, what: &str) -> Option<Instant> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .find(|(n, w, _)| n == node && *w == what)
            .map(|(_, _, t)| *t)
    }

    async fn wait(&self, node: &str, what: &str) -> Instant {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(t) = self.at(node, what) {
                return t;
            }
            assert!(Instant::now() < deadline, "{node}: never {what}");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// A singleton whose child takes 300 ms to stop once cancelled (well within its
    /// 1 s shutdown timeout), so a release that does not wait for it is caught.
    fn start(&self, manager: &LockManager, name: &str, opts: SingletonOptions) -> Singleton {
        let lives = self.clone();
        Singleton::start(manager, name, opts, move |ctx| {
            let lives = lives.clone();
            async move {
                let node = ctx.node_id().to_owned();
                lives.record(&node, "started");
                let _gone = Gone(lives.clone(), node.clone());
                ctx.cancelled().await;
                lives.record(&node, "cancelled");
                tokio::time::sleep(Duration::from_millis(300)).await;
                Ok::<(), std::io::Error>(())
            }
        })
        .unwrap()
    }
}

async fn until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !done() {
        assert!(Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manager_shutdown_alone_stops_children_then_releases_announced() {
    let pg = PgCluster::start().unwrap();
    let single = unique_name("down-single");
    let elect = unique_name("down-elect");
    let lives = Lives::default();
    let a = LockManager::connect(
        manager_options(&pg.url(), "down-a").poll_interval(Duration::from_millis(100)),
    )
    .await
    .unwrap();
    let a_singleton = lives.start(&a, &single, SingletonOptions::default());
    let a_election = Election::start(&a, elect.as_str()).unwrap();
    lives.wait("down-a", "started").await;
    let a_leads = a_election.leadership();
    until("A leads the election", || a_leads.is_leader()).await;

    // B polls every 30 s: a take-over within 2 s can only come from the announcement.
    let b = LockManager::connect(
        manager_options(&pg.url(), "down-b")
            .poll_interval(Duration::from_millis(100))
            .poll_interval(Duration::from_secs(30)),
    )
    .await
    .unwrap();
    let b_singleton = lives.start(&b, &single, SingletonOptions::default());
    let b_election = Election::start(&b, elect.as_str()).unwrap();
    let (bs, be) = (b_singleton.leadership(), b_election.leadership());
    // B has tried once and follows, knowing A leads: now it sleeps for 30 s.
    until("B follows A on both", || {
        bs.leader().as_deref() == Some("down-a") && be.leader().as_deref() == Some("down-a")
    })
    .await;

    let t0 = Instant::now();
    tokio::time::timeout(Duration::from_secs(10), a.shutdown())
        .await
        .expect("the shutdown ends within its bound");
    let a_done = Instant::now();

    // The child was told to stop, and its future was gone before B's child started.
    let cancelled = lives
        .at("down-a", "cancelled")
        .expect("A's child was cancelled");
    let gone = lives.at("down-a", "gone").expect("A's child stopped");
    assert!(cancelled >= t0 && gone >= cancelled + Duration::from_millis(290));
    assert!(
        gone <= a_done,
        "the shutdown returned before the child stopped"
    );
    let b_started = lives.wait("down-b", "started").await;
    assert!(
        b_started > gone,
        "B's child started {:?} before A's child stopped",
        gone - b_started
    );
    let took = b_started - t0;
    assert!(
        took < Duration::from_secs(2),
        "singleton taken over after {took:?}: a poll"
    );
    until("B leads the election", || be.is_leader()).await;
    let took = t0.elapsed();
    assert!(
        took < Duration::from_secs(2),
        "election taken over after {took:?}: a poll"
    );

    // What was started from A has stopped, and A refuses more.
    assert_eq!(a_singleton.status().state, SingletonState::Stopped);
    assert_eq!(a_leads.state(), LeaderState::Stopped);
    assert!(matches!(a.acquire("more").await, Err(Error::Closed)));
    assert!(matches!(a.try_acquire("more").await, Err(Error::Closed)));
    // Twice is fine, and so are the handles' own shutdowns afterwards.
    tokio::time::timeout(Duration::from_secs(5), async {
        a.shutdown().await;
        a_singleton.shutdown().await;
        a_election.shutdown().await;
        a_election.shutdown().await;
    })
    .await
    .expect("shutting down again is quick");

    // Started after the shutdown: they end at once, nothing runs.
    let late = lives.start(&a, &unique_name("late"), SingletonOptions::default());
    let late_election = Election::start(&a, "late-election").unwrap();
    let (ls, le) = (late.leadership(), late_election.leadership());
    until("late ones stop", || {
        ls.state() == LeaderState::Stopped && le.state() == LeaderState::Stopped
    })
    .await;
    tokio::time::timeout(Duration::from_secs(5), async {
        late.shutdown().await;
        late_election.shutdown().await;
    })
    .await
    .expect("late ones shut down at once");
    assert_eq!(late.status().state, SingletonState::Stopped);
    assert_eq!(
        lives
            .0
            .lock()
            .unwrap()
            .iter()
            .filter(|(n, w, _)| n == "down-a" && *w == "started")
            .count(),
        1,
        "a late singleton ran its child"
    );

    b.shutdown().await;
    assert_eq!(bs.state(), LeaderState::Stopped);
    assert_eq!(be.state(), LeaderState::Stopped);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_singleton_shut_down_first_then_the_manager() {
    let pg = PgCluster::start().unwrap();
    let lives = Lives::default();
    let a = LockManager::connect(
        manager_options(&pg.url(), "first-a").poll_interval(Duration::from_millis(100)),
    )
    .await
    .unwrap();
    let singleton = lives.start(&a, &unique_name("first"), SingletonOptions::default());
    let election = Election::start(&a, unique_name("first-e").as_str()).unwrap();
    lives.wait("first-a", "started").await;
    tokio::time::timeout(Duration::from_secs(10), async {
        singleton.shutdown().await;
        assert!(lives.at("first-a", "gone").is_some());
        election.shutdown().await;
        a.shutdown().await;
        a.shutdown().await;
        singleton.shutdown().await;
    })
    .await
    .expect("every shutdown ends");
    assert_eq!(singleton.status().state, SingletonState::Stopped);
    assert_eq!(election.leadership().state(), LeaderState::Stopped);
    assert!(matches!(a.acquire("more").await, Err(Error::Closed)));
}

/// Review F2: a `shutdown()` whose caller stopped waiting (a timeout) left the next
/// call nothing to wait on, so it returned while the child still ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_that_was_given_up_on_is_still_waited_for() {
    let pg = PgCluster::start().unwrap();
    let m = LockManager::connect(
        manager_options(&pg.url(), "given-up")
            .poll_interval(Duration::from_millis(100))
            .term_grant_delay(Duration::ZERO),
    )
    .await
    .unwrap();
    let done = Arc::new(Mutex::new(false));
    let s = {
        let done = Arc::clone(&done);
        Singleton::start(
            &m,
            unique_name("given-up").as_str(),
            SingletonOptions::default(),
            move |ctx| {
                let done = Arc::clone(&done);
                async move {
                    ctx.cancelled().await;
                    // Takes a while to stop (within the 1 s shutdown timeout).
                    tokio::time::sleep(Duration::from_millis(600)).await;
                    *done.lock().unwrap() = true;
                    Ok::<(), std::io::Error>(())
                }
            },
        )
        .unwrap()
    };
    let t0 = Instant::now();
    while !s.leadership().is_leader() {
        assert!(t0.elapsed() < Duration::from_secs(10));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        tokio::time::timeout(Duration::from_millis(50), s.shutdown())
            .await
            .is_err(),
        "the child takes 600 ms to stop"
    );
    s.shutdown().await;
    assert!(
        *done.lock().unwrap(),
        "shutdown returned while the child still ran"
    );
    m.shutdown().await;
}

/// A minimal executor: polls `fut` on this thread until it is ready (no tokio runtime).
fn block_on<F: std::future::Future>(fut: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl std::task::Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = std::task::Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = std::task::Context::from_waker(&waker);
    let mut fut = std::pin::pin!(fut);
    loop {
        if let std::task::Poll::Ready(out) = fut.as_mut().poll(&mut cx) {
            return out;
        }
        std::thread::park();
    }
}

// Review finding (shutdown F3): `shutdown` spawned on tokio, so polling it outside a
// tokio runtime (a plain executor on a thread of its own) panicked. It shuts down there
// too: the singleton's child stops and the lock is released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_polled_outside_the_runtime_works() {
    let pg = PgCluster::start().unwrap();
    let name = unique_name("shutdown-outside");
    let manager = LockManager::connect(
        manager_options(&pg.url(), "so-a").poll_interval(Duration::from_millis(100)),
    )
    .await
    .unwrap();
    let singleton = Singleton::start(
        &manager,
        name.as_str(),
        SingletonOptions::default(),
        |ctx| async move {
            ctx.cancelled().await;
            Ok::<(), std::io::Error>(())
        },
    )
    .unwrap();
    until("leading", || singleton.leadership().is_leader()).await;
    let m = manager.clone();
    let done = tokio::task::spawn_blocking(move || {
        std::thread::spawn(move || block_on(m.shutdown()))
            .join()
            .is_ok()
    });
    let finished = tokio::time::timeout(Duration::from_secs(20), done)
        .await
        .expect("the shutdown finished")
        .unwrap();
    assert!(finished, "the shutdown panicked outside the runtime");
    assert!(!singleton.leadership().is_leader());
    let other = LockManager::connect(
        manager_options(&pg.url(), "so-b").poll_interval(Duration::from_millis(100)),
    )
    .await
    .unwrap();
    assert!(other.holder(name.as_str()).await.unwrap().is_none());
    other.shutdown().await;
}

// Review finding F1: a request waiting when the shutdown begins is answered `Closed`
// at once, not granted while the singletons' children stop (step 1 of the shutdown).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_waiting_when_the_shutdown_begins_is_closed_not_granted() {
    let pg = PgCluster::start().unwrap();
    let single = unique_name("f1-single");
    let lock = unique_name("f1-lock");
    let lives = Lives::default();
    let other = LockManager::connect(
        manager_options(&pg.url(), "f1-other").poll_interval(Duration::from_millis(100)),
    )
    .await
    .unwrap();
    let held = other.acquire(lock.as_str()).await.unwrap();
    let m = LockManager::connect(
        manager_options(&pg.url(), "f1-m").poll_interval(Duration::from_millis(100)),
    )
    .await
    .unwrap();
    // A child that takes 300 ms to stop: step 1 of the shutdown lasts that long.
    let _singleton = lives.start(&m, &single, SingletonOptions::default());
    lives.wait("f1-m", "started").await;
    let waiter = {
        let m = m.clone();
        let lock = lock.clone();
        tokio::spawn(async move { m.acquire(lock.as_str()).await })
    };
    // The request waits behind the other manager's lease.
    until("the request waits", || !waiter.is_finished()).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiter.is_finished());

    let shutdown = {
        let m = m.clone();
        tokio::spawn(async move { m.shutdown().await })
    };
    lives.wait("f1-m", "cancelled").await;
    // The lock comes free while the child is still stopping.
    held.release().await.unwrap();
    let answer = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("the waiting request is answered")
        .unwrap();
    assert!(
        matches!(answer, Err(Error::Closed)),
        "a request waiting at shutdown must be answered Closed, got {answer:?}"
    );
    shutdown.await.unwrap();
    other.shutdown().await;
}

// Review finding (round 11): a request whose try is already on its way to the server
// when the shutdown begins is answered `Closed` too, not granted once the try wins.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_whose_try_is_in_flight_when_the_shutdown_begins_is_closed_not_granted() {
    use chosen_core::{LockRequest, LockState};
    use chosen_tests::{FaultProxy, ProxyMode};

    let pg = PgCluster::start_local().unwrap();
    let port = pg.port().unwrap();
    let proxy = FaultProxy::start(([127, 0, 0, 1], port).into())
        .await
        .unwrap();
    let lock = unique_name("f1-inflight");
    let other = LockManager::connect(
        manager_options(&pg.url(), "f1b-other").poll_interval(Duration::from_millis(100)),
    )
    .await
    .unwrap();
    let held = other.acquire(lock.as_str()).await.unwrap();
    let m = LockManager::connect(
        manager_options(&proxy.url(&pg.url(), port), "f1b-m")
            .poll_interval(Duration::from_millis(100))
            .term_grant_delay(Duration::ZERO),
    )
    .await
    .unwrap();
    // It polls every 30 s: only the release's announcement makes it try again.
    let waiter = {
        let m = m.clone();
        let lock = lock.clone();
        tokio::spawn(async move {
            m.acquire(LockRequest::from(lock.as_str()).poll_interval(Duration::from_secs(30)))
                .await
        })
    };
    until("the request waits", || !waiter.is_finished()).await;
    let t0 = Instant::now();
    while !m
        .locks()
        .await
        .unwrap()
        .iter()
        .any(|l| l.name == lock && matches!(l.state, LockState::Waiting { .. }))
    {
        assert!(t0.elapsed() < Duration::from_secs(10));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Its first try has been answered; from now on every round trip takes 600 ms.
    tokio::time::sleep(Duration::from_millis(500)).await;
    proxy.set(ProxyMode::Latency(Duration::from_millis(600)));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // The announced release makes it try again: the try is on the wire when the
    // shutdown begins.
    held.release().await.unwrap();
    tokio::time::sleep(Duration::from_millis(600)).await;
    let shutdown = {
        let m = m.clone();
        tokio::spawn(async move { m.shutdown().await })
    };
    let answer = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("the waiting request is answered")
        .unwrap();
    let granted = format!("{answer:?}");
    drop(answer);
    tokio::time::timeout(Duration::from_secs(30), shutdown)
        .await
        .expect("the shutdown ends")
        .unwrap();
    assert!(
        granted.starts_with("Err(Closed"),
        "a request answered after the shutdown began must be Closed, got {granted}"
    );
    other.shutdown().await;
}

/// §2.2 (b): a graceful shutdown releases a lock only once its lease is dropped (a
/// singleton drops it once its child has stopped), so a waiting node cannot start while
/// this node still works under the lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_releases_only_after_the_lease_is_dropped() {
    let pg = PgCluster::start().unwrap();
    let lock = unique_name("graceful-order");
    let a = LockManager::connect(chosen_tests::eager_options(&pg.url(), "stopping-holder"))
        .await
        .expect("manager connects");
    let lease = a.acquire(lock.as_str()).await.unwrap();
    // The waiter polls every 30 s: only the release announcement can wake it.
    let b = LockManager::connect(
        chosen_tests::eager_options(&pg.url(), "patient-waiter")
            .poll_interval(Duration::from_secs(30)),
    )
    .await
    .unwrap();
    let waiting = tokio::spawn({
        let b = b.clone();
        let lock = lock.clone();
        async move {
            let lease = b.acquire(lock.as_str()).await.unwrap();
            (Instant::now(), lease)
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;

    // The holder's "child" notices the loss and takes 500 ms to stop.
    let stopped = Arc::new(Mutex::new(None::<Instant>));
    let child = tokio::spawn({
        let stopped = Arc::clone(&stopped);
        async move {
            lease.lost().await;
            tokio::time::sleep(Duration::from_millis(500)).await;
            *stopped.lock().unwrap() = Some(Instant::now());
            drop(lease);
        }
    });
    a.shutdown().await;
    child.await.unwrap();
    let (acquired, lease_b) = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("the waiter is woken by the announcement, not its 30 s poll")
        .unwrap();
    let stopped = stopped.lock().unwrap().expect("the child stopped");
    assert!(
        acquired > stopped,
        "the waiter held the lock {:?} before the old holder's work stopped",
        stopped - acquired
    );
    assert!(
        acquired - stopped < Duration::from_secs(2),
        "hand-over took {:?} after the stop",
        acquired - stopped
    );
    drop(lease_b);
    b.shutdown().await;
}

/// §2.2 (b), the other half: a lease its owner never drops does not keep the lock past
/// the stop budget; the shutdown then releases it anyway, without an announcement (its
/// work may still run), so a waiter finds it free by polling and waits the grace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_kept_through_shutdown_is_released_after_the_stop_budget() {
    let pg = PgCluster::start().unwrap();
    let lock = unique_name("kept-lease");
    let budget = Duration::from_millis(800);
    let a = LockManager::connect(
        chosen_tests::eager_options(&pg.url(), "keeping-holder").stop_budget(budget),
    )
    .await
    .unwrap();
    let lease = a.acquire(lock.as_str()).await.unwrap();
    let b = LockManager::connect(
        chosen_tests::eager_options(&pg.url(), "budget-waiter")
            .poll_interval(Duration::from_millis(200)),
    )
    .await
    .unwrap();
    let waiting = tokio::spawn({
        let b = b.clone();
        let lock = lock.clone();
        async move { b.acquire(lock.as_str()).await.map(|l| (Instant::now(), l)) }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let t0 = Instant::now();
    a.shutdown().await;
    assert!(!lease.is_valid(), "revoked first");
    let (acquired, lease_b) = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("the waiter takes over")
        .unwrap()
        .unwrap();
    let after = acquired - t0;
    assert!(
        after >= budget,
        "released {after:?} after the shutdown began, before the budget"
    );
    assert!(
        after < budget + Duration::from_secs(2),
        "released {after:?} after the shutdown began"
    );
    drop(lease);
    drop(lease_b);
    b.shutdown().await;
}
