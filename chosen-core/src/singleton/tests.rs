//! The supervisor, tested without a database (paused time, hand-made leases).

use std::sync::atomic::{AtomicU64, Ordering};

use super::supervisor::*;
use super::*;

struct Fixture {
    inner: SingletonInner,
    stop: CancellationToken,
    validity: Validity,
    generation: Arc<crate::generation::Generation>,
}

fn fixture() -> Fixture {
    fixture_with(None)
}

fn fixture_with(metrics: Option<Arc<dyn crate::MetricsSink>>) -> Fixture {
    let (validity, generation) = Validity::for_tests();
    Fixture {
        inner: SingletonInner {
            leadership: Leadership::new("test", Some("chosen"), "node", metrics),
            status: Mutex::new(SingletonStatus {
                name: "test".to_owned(),
                state: SingletonState::Following { leader: None },
                child: ChildState::NotRunning,
                restarts: 0,
                give_ups: 0,
                last_failure: None,
            }),
            tenure: Mutex::new(None),
            hand_to: Mutex::new(None),
            finished: std::sync::atomic::AtomicBool::new(false),
        },
        stop: CancellationToken::new(),
        validity,
        generation,
    }
}

impl Fixture {
    fn context(&self) -> impl Fn(u64, CancellationToken) -> LeaderContext + '_ {
        move |restarts, cancel| LeaderContext {
            name: "test".into(),
            node_id: "node".into(),
            token: FencingToken::new(1),
            restarts,
            cancel,
            validity: self.validity.clone(),
        }
    }

    fn status(&self) -> SingletonStatus {
        self.inner.status.lock().unwrap().clone()
    }
}

#[tokio::test(start_paused = true)]
async fn restarts_back_off_and_give_up_past_the_intensity() {
    let f = fixture();
    let options = SingletonOptions::default()
        .intensity(3, Duration::from_secs(10))
        .backoff(Duration::from_millis(100), Duration::from_secs(5));
    let starts = Arc::new(Mutex::new(Vec::new()));
    let factory = {
        let starts = Arc::clone(&starts);
        move |_ctx: LeaderContext| {
            starts.lock().unwrap().push(tokio::time::Instant::now());
            async { Err::<(), ChildError>("boom".into()) }
        }
    };
    let t0 = tokio::time::Instant::now();
    let outcome = supervise(
        &options,
        &f.inner,
        &f.stop,
        std::future::pending(),
        f.context(),
        &mut None,
        &Arc::new(factory),
        &tokio::sync::Notify::new(),
    )
    .await;
    assert!(matches!(outcome, Outcome::GiveUp));
    let gaps: Vec<u128> = starts
        .lock()
        .unwrap()
        .iter()
        .map(|t| (*t - t0).as_millis())
        .collect();
    // Started, then restarted after 100, 200, 400 ms; the 4th failure within 10 s gives up.
    assert_eq!(gaps, vec![0, 100, 300, 700]);
    let status = f.status();
    assert_eq!(status.restarts, 3);
    assert_eq!(status.last_failure.as_deref(), Some("boom"));
}

#[tokio::test(start_paused = true)]
async fn a_child_that_cannot_start_gives_up_however_long_the_backoff() {
    // Each failure comes right after the start, but the backoff (2 s, then 4 s, ...)
    // spreads the restarts wider than the intensity (3 in 3 s) ever counts: the node
    // must still give the lock up, after the 4th failure in a row.
    let f = fixture();
    let options = SingletonOptions::default()
        .intensity(3, Duration::from_secs(3))
        .backoff(Duration::from_secs(2), Duration::from_secs(60));
    let starts = Arc::new(AtomicU64::new(0));
    let factory = {
        let starts = Arc::clone(&starts);
        move |_ctx: LeaderContext| {
            starts.fetch_add(1, Ordering::SeqCst);
            async { Err::<(), ChildError>("cannot connect".into()) }
        }
    };
    let t0 = tokio::time::Instant::now();
    let outcome = tokio::time::timeout(
        Duration::from_secs(3600),
        supervise(
            &options,
            &f.inner,
            &f.stop,
            std::future::pending(),
            f.context(),
            &mut None,
            &Arc::new(factory),
            &tokio::sync::Notify::new(),
        ),
    )
    .await
    .expect("it held the lock running nothing for an hour");
    assert!(matches!(outcome, Outcome::GiveUp));
    assert_eq!(starts.load(Ordering::SeqCst), 4);
    // Started, restarted after 2, 4 and 8 s.
    assert_eq!(t0.elapsed(), Duration::from_secs(14));
}

#[tokio::test(start_paused = true)]
async fn a_child_that_ran_a_while_before_failing_is_restarted_as_before() {
    // Failures after a run longer than the period are not a child that cannot start:
    // the intensity alone decides, and here it never gives up.
    let f = fixture();
    let options = SingletonOptions::default()
        .intensity(1, Duration::from_secs(3))
        .backoff(Duration::from_secs(2), Duration::from_secs(60));
    let starts = Arc::new(AtomicU64::new(0));
    let factory = {
        let starts = Arc::clone(&starts);
        move |_ctx: LeaderContext| {
            starts.fetch_add(1, Ordering::SeqCst);
            async {
                tokio::time::sleep(Duration::from_secs(4)).await;
                Err::<(), ChildError>("lost the connection".into())
            }
        }
    };
    let stop = f.stop.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(120)).await;
        stop.cancel();
    });
    let outcome = supervise(
        &options,
        &f.inner,
        &f.stop,
        std::future::pending(),
        f.context(),
        &mut None,
        &Arc::new(factory),
        &tokio::sync::Notify::new(),
    )
    .await;
    assert!(matches!(outcome, Outcome::Stop));
    assert!(starts.load(Ordering::SeqCst) >= 10);
}

#[tokio::test(start_paused = true)]
async fn a_one_shot_child_that_ends_as_a_fail_back_comes_keeps_the_lock() {
    // The child returns (for good: `Never`) and, in the same wake-up, a preferred node
    // is back: the supervisor sees the end first, keeps the lock (the preferred node
    // would run the child again), and no hand-over follows.
    let f = fixture();
    let options = SingletonOptions::default().restart(RestartPolicy::Never);
    let fail_back = Arc::new(tokio::sync::Notify::new());
    let stop = f.stop.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(5)).await;
        stop.cancel();
    });
    // The fail-back is asked for by the child itself, as it returns: both wake the
    // supervisor at once.
    let factory = {
        let fail_back = Arc::clone(&fail_back);
        move |_ctx: LeaderContext| {
            let fail_back = Arc::clone(&fail_back);
            async move {
                fail_back.notify_one();
                Ok::<(), ChildError>(())
            }
        }
    };
    let outcome = supervise(
        &options,
        &f.inner,
        &f.stop,
        std::future::pending(),
        f.context(),
        &mut None,
        &Arc::new(factory),
        &fail_back,
    )
    .await;
    assert!(
        matches!(outcome, Outcome::Stop),
        "handed over a finished child"
    );
    assert!(f.inner.child_finished());
    assert_eq!(f.status().child, ChildState::Finished);
}

#[tokio::test(start_paused = true)]
async fn a_healthy_run_resets_the_backoff_and_spreads_restarts() {
    let f = fixture();
    let options = SingletonOptions::default()
        .intensity(1, Duration::from_secs(5))
        .backoff(Duration::from_millis(100), Duration::from_secs(5));
    let runs = Arc::new(AtomicU64::new(0));
    let factory = {
        let runs = Arc::clone(&runs);
        move |_ctx: LeaderContext| {
            let n = runs.fetch_add(1, Ordering::SeqCst);
            async move {
                // Each run lasts longer than the period: never too many restarts.
                tokio::time::sleep(Duration::from_secs(6)).await;
                if n == 4 {
                    std::future::pending::<()>().await;
                }
                Ok::<(), ChildError>(())
            }
        }
    };
    let stop = f.stop.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(60)).await;
        stop.cancel();
    });
    let outcome = supervise(
        &options,
        &f.inner,
        &f.stop,
        std::future::pending(),
        f.context(),
        &mut None,
        &Arc::new(factory),
        &tokio::sync::Notify::new(),
    )
    .await;
    let what = match outcome {
        Outcome::Stop => "stop".to_owned(),
        Outcome::GiveUp => "give up".to_owned(),
        Outcome::FailBack => "fail back".to_owned(),
        Outcome::Lost(r) => r.to_string(),
    };
    assert_eq!(what, "stop", "after {} runs", runs.load(Ordering::SeqCst));
    assert_eq!(runs.load(Ordering::SeqCst), 5);
}

#[tokio::test(start_paused = true)]
async fn on_failure_keeps_the_lock_after_success_and_counts_panics() {
    let f = fixture();
    let options = SingletonOptions::default().restart(RestartPolicy::OnFailure);
    let runs = Arc::new(AtomicU64::new(0));
    let factory = {
        let runs = Arc::clone(&runs);
        move |_ctx: LeaderContext| {
            let n = runs.fetch_add(1, Ordering::SeqCst);
            async move {
                assert!(n != 0, "first run panics");
                Ok::<(), ChildError>(())
            }
        }
    };
    let stop = f.stop.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(3)).await;
        stop.cancel();
    });
    let outcome = supervise(
        &options,
        &f.inner,
        &f.stop,
        std::future::pending(),
        f.context(),
        &mut None,
        &Arc::new(factory),
        &tokio::sync::Notify::new(),
    )
    .await;
    assert!(matches!(outcome, Outcome::Stop));
    assert_eq!(
        runs.load(Ordering::SeqCst),
        2,
        "restarted after the panic only"
    );
    let status = f.status();
    assert_eq!(status.child, ChildState::Finished);
    assert!(
        status
            .last_failure
            .unwrap()
            .contains("panicked: first run panics")
    );
}

#[tokio::test(start_paused = true)]
async fn lease_loss_cancels_the_child_and_aborts_one_that_ignores_it() {
    for ignores in [false, true] {
        let f = fixture();
        let options = SingletonOptions::default().shutdown_timeout(Duration::from_secs(1));
        let saw_cancel = Arc::new(AtomicU64::new(0));
        let factory = {
            let saw_cancel = Arc::clone(&saw_cancel);
            move |ctx: LeaderContext| {
                let saw_cancel = Arc::clone(&saw_cancel);
                async move {
                    ctx.cancelled().await;
                    assert!(!ctx.is_valid());
                    saw_cancel.fetch_add(1, Ordering::SeqCst);
                    if ignores {
                        tokio::time::sleep(Duration::from_secs(3600)).await;
                        saw_cancel.fetch_add(100, Ordering::SeqCst);
                    }
                    Ok::<(), ChildError>(())
                }
            }
        };
        let generation = Arc::clone(&f.generation);
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(2)).await;
            generation.revoke(SessionDownReason::ConnectionLost {
                message: "test".to_owned(),
            });
        });
        let t0 = tokio::time::Instant::now();
        let outcome = supervise(
            &options,
            &f.inner,
            &f.stop,
            f.validity.lost(),
            f.context(),
            &mut None,
            &Arc::new(factory),
            &tokio::sync::Notify::new(),
        )
        .await;
        let took = t0.elapsed();
        assert!(matches!(outcome, Outcome::Lost(_)));
        assert_eq!(saw_cancel.load(Ordering::SeqCst), 1, "ignores={ignores}");
        let expected = if ignores { 3 } else { 2 };
        assert_eq!(took.as_secs(), expected, "ignores={ignores}: {took:?}");
    }
}

// ---- leadership never outlives the lease -----------------------------------

/// Fails in `singleton_running(.., true)`, or in `singleton_restart`.
#[derive(Debug)]
struct PanickingSink {
    on_running: bool,
}

impl crate::MetricsSink for PanickingSink {
    fn singleton_running(&self, _: &str, _: &str, running: bool) {
        assert!(!(running && self.on_running), "sink fails on purpose");
    }
    fn singleton_restart(&self, _: &str, _: &str) {
        assert!(self.on_running, "sink fails on purpose");
    }
}

/// What a child saw: started, still running (decremented even when aborted), and
/// whether its context was still valid when it stopped.
#[derive(Clone, Default)]
struct Probe {
    started: Arc<AtomicU64>,
    running: Arc<AtomicU64>,
}

struct Stops(Arc<AtomicU64>);

impl Drop for Stops {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Probe {
    /// A child that runs until cancelled, or, with `fail`, fails at once.
    fn factory(
        &self,
        fail: bool,
    ) -> impl Fn(
        LeaderContext,
    ) -> std::pin::Pin<Box<dyn Future<Output = Result<(), ChildError>> + Send>>
    + Send
    + Sync
    + 'static {
        let probe = self.clone();
        move |_ctx| {
            let probe = probe.clone();
            Box::pin(async move {
                probe.started.fetch_add(1, Ordering::SeqCst);
                probe.running.fetch_add(1, Ordering::SeqCst);
                let _stops = Stops(Arc::clone(&probe.running));
                if fail {
                    return Err("child fails".into());
                }
                // Ignores cancellation: only an abort stops it.
                std::future::pending::<()>().await;
                Ok(())
            })
        }
    }
}

/// Holds `lease` and supervises the child under it, as `run` does between
/// `campaign` and the release; spawned, so a test can kill it.
fn hold<F, Fut>(
    f: Arc<Fixture>,
    lease: crate::Lease,
    options: SingletonOptions,
    factory: F,
) -> JoinHandle<()>
where
    F: Fn(LeaderContext) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), ChildError>> + Send + 'static,
{
    tokio::spawn(async move {
        let _stopped = MarkStopped(&f.inner);
        let mut tenure = Tenure::new(lease);
        let factory = Arc::new(factory);
        let _ = lead(
            &options,
            &f.inner,
            &f.stop,
            &mut tenure,
            &"node".into(),
            &factory,
            &tokio::sync::Notify::new(),
        )
        .await;
        drop(tenure);
    })
}

/// Waits for the release the lease sends to its manager, and checks what was true
/// at that moment: the leadership had ended and the child had stopped.
async fn release_seen(
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<crate::command::Command>,
    f: &Fixture,
    probe: &Probe,
) {
    let cmd = tokio::time::timeout(Duration::from_secs(60), rx.recv())
        .await
        .expect("the lease is released");
    assert!(matches!(cmd, Some(crate::command::Command::Release { .. })));
    assert!(
        !f.inner.leadership.is_leader(),
        "still leader at the release"
    );
    assert_eq!(
        probe.running.load(Ordering::SeqCst),
        0,
        "child runs at the release"
    );
}

#[tokio::test(start_paused = true)]
async fn a_sink_panicking_in_the_supervisor_stops_child_and_leadership() {
    let f = Arc::new(fixture_with(Some(Arc::new(PanickingSink {
        on_running: true,
    }))));
    let (lease, mut rx, _generation) = crate::Lease::for_tests();
    let probe = Probe::default();
    let task = hold(
        Arc::clone(&f),
        lease,
        SingletonOptions::default(),
        probe.factory(false),
    );
    assert!(task.await.unwrap_err().is_panic());
    assert_eq!(f.inner.leadership.state(), crate::LeaderState::Stopped);
    assert_eq!(f.status().state, SingletonState::Stopped);
    release_seen(&mut rx, &f, &probe).await;
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(probe.running.load(Ordering::SeqCst), 0);
    assert!(!f.inner.leadership.is_leader());
}

#[tokio::test(start_paused = true)]
async fn a_sink_panicking_between_restarts_stops_leadership() {
    let f = Arc::new(fixture_with(Some(Arc::new(PanickingSink {
        on_running: false,
    }))));
    let (lease, mut rx, _generation) = crate::Lease::for_tests();
    let probe = Probe::default();
    let task = hold(
        Arc::clone(&f),
        lease,
        SingletonOptions::default(),
        probe.factory(true),
    );
    assert!(task.await.unwrap_err().is_panic());
    release_seen(&mut rx, &f, &probe).await;
    assert_eq!(probe.started.load(Ordering::SeqCst), 1);
}

#[tokio::test(start_paused = true)]
async fn an_aborted_supervisor_stops_child_and_leadership() {
    let f = Arc::new(fixture());
    let (lease, mut rx, _generation) = crate::Lease::for_tests();
    let probe = Probe::default();
    let task = hold(
        Arc::clone(&f),
        lease,
        SingletonOptions::default(),
        probe.factory(false),
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(f.inner.leadership.is_leader());
    assert_eq!(probe.running.load(Ordering::SeqCst), 1);
    task.abort();
    assert!(task.await.unwrap_err().is_cancelled());
    assert_eq!(f.inner.leadership.state(), crate::LeaderState::Stopped);
    assert_eq!(f.status().state, SingletonState::Stopped);
    release_seen(&mut rx, &f, &probe).await;
}

#[tokio::test(start_paused = true)]
async fn a_factory_panic_is_a_child_failure() {
    let f = Arc::new(fixture());
    let (lease, _rx, _generation) = crate::Lease::for_tests();
    let calls = Arc::new(AtomicU64::new(0));
    let probe = Probe::default();
    let factory = {
        let calls = Arc::clone(&calls);
        let child = probe.factory(false);
        move |ctx| {
            assert!(calls.fetch_add(1, Ordering::SeqCst) > 0, "factory fails");
            child(ctx)
        }
    };
    let task = hold(Arc::clone(&f), lease, SingletonOptions::default(), factory);
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(
        !task.is_finished(),
        "the supervisor survives a factory panic"
    );
    assert!(f.inner.leadership.is_leader());
    assert_eq!(probe.running.load(Ordering::SeqCst), 1);
    let status = f.status();
    assert_eq!(status.restarts, 1);
    assert!(status.last_failure.unwrap().contains("factory fails"));
    task.abort();
}

/// The watchdog deadline passed (a late heartbeat), then a heartbeat extended it
/// again while the child was still being stopped: the lease must stay lost.
/// On a paused clock: the deadline and the watchdog read the same clock.
#[tokio::test(start_paused = true)]
async fn a_lease_once_lost_stays_lost_while_the_child_stops() {
    let f = Arc::new(fixture());
    let (lease, _rx, _generation) = crate::Lease::for_tests();
    let shared = Arc::clone(lease.shared());
    shared.invalidate();
    shared.extend_validity(crate::clock::now() + Duration::from_millis(300));
    let probe = Probe::default();
    let options = SingletonOptions::default().shutdown_timeout(Duration::from_secs(2));
    let task = hold(Arc::clone(&f), lease, options, probe.factory(false));
    f.inner.leadership.wait_leading().await;
    tokio::time::timeout(
        Duration::from_secs(10),
        f.inner.leadership.wait_not_leading(),
    )
    .await
    .expect("the deadline passes");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(f.status().child, ChildState::Stopping);
    // A heartbeat that lands now must not revive the lost lease.
    shared.extend_validity(crate::clock::now() + Duration::from_secs(3600));
    assert!(!f.inner.leadership.is_leader());
    task.abort();
}

#[test]
fn shutdown_timeout_must_fit_the_stop_budget() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    // Validation needs only the options; no connection.
    let options = crate::ManagerOptions::from_url("postgres://u@localhost/db").unwrap();
    let budget = options.get_stop_budget();
    rt.block_on(async {
        let err = SingletonOptions::default()
            .shutdown_timeout(budget + Duration::from_secs(1))
            .validate_against(budget)
            .unwrap_err();
        assert!(err.to_string().contains("stop_budget"), "{err}");
    });
}

#[tokio::test(start_paused = true)]
async fn a_fail_back_that_comes_as_a_restarting_child_ends_still_hands_over() {
    // Always: the child returns Ok (to be restarted) in the same wake-up as the
    // fail-back watch's one and only notify. The watch never notifies again (it then
    // pends for good), so the tenure must still end in FailBack.
    let f = fixture();
    let options = SingletonOptions::default().restart(RestartPolicy::Always);
    let fail_back = Arc::new(tokio::sync::Notify::new());
    let stop = f.stop.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(600)).await;
        stop.cancel();
    });
    let runs = Arc::new(AtomicU64::new(0));
    let factory = {
        let fail_back = Arc::clone(&fail_back);
        let runs = Arc::clone(&runs);
        move |ctx: LeaderContext| {
            let fail_back = Arc::clone(&fail_back);
            let n = runs.fetch_add(1, Ordering::SeqCst);
            async move {
                if n == 0 {
                    fail_back.notify_one(); // the watch fires once
                    return Ok::<(), ChildError>(());
                }
                ctx.cancelled().await;
                Ok(())
            }
        }
    };
    let outcome = supervise(
        &options,
        &f.inner,
        &f.stop,
        std::future::pending(),
        f.context(),
        &mut None,
        &Arc::new(factory),
        &fail_back,
    )
    .await;
    let what = match outcome {
        Outcome::Stop => "stop",
        Outcome::GiveUp => "give up",
        Outcome::FailBack => "fail back",
        Outcome::Lost(_) => "lost",
    };
    assert_eq!(what, "fail back", "runs: {}", runs.load(Ordering::SeqCst));
}

#[derive(Debug)]
struct HandOverInWindow {
    armed: std::sync::atomic::AtomicBool,
    to_test: std::sync::mpsc::SyncSender<()>,
    from_test: Mutex<std::sync::mpsc::Receiver<()>>,
}

impl crate::MetricsSink for HandOverInWindow {
    fn singleton_running(&self, _: &str, _: &str, running: bool) {
        // The child has ended (Never): the supervisor is between the end and storing
        // `finished`. Let another thread call step_down now.
        if !running && self.armed.swap(false, Ordering::SeqCst) {
            self.to_test.send(()).unwrap();
            self.from_test.lock().unwrap().recv().unwrap();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_down_racing_a_one_shot_child_s_end_forgets_that_it_finished() {
    let (to_test, rx) = std::sync::mpsc::sync_channel(1);
    let (tx, from_test) = std::sync::mpsc::sync_channel(1);
    let sink = Arc::new(HandOverInWindow {
        armed: true.into(),
        to_test,
        from_test: Mutex::new(from_test),
    });
    let f = Arc::new(fixture_with(Some(sink)));
    let options = SingletonOptions::default().restart(RestartPolicy::Never);
    // The other thread: what `Singleton::hand_over(None)` does with a tenure, under
    // the tenure's lock.
    let g = Arc::clone(&f);
    let other = std::thread::spawn(move || {
        rx.recv().unwrap();
        {
            let _tenure = g.inner.tenure.lock().unwrap();
            *g.inner.hand_to.lock().unwrap() = None;
            g.inner
                .finished
                .store(false, std::sync::atomic::Ordering::Release);
            g.stop.cancel();
        }
        tx.send(()).unwrap();
    });
    let factory = |_ctx: LeaderContext| async { Ok::<(), ChildError>(()) };
    let outcome = supervise(
        &options,
        &f.inner,
        &f.stop,
        std::future::pending(),
        f.context(),
        &mut None,
        &Arc::new(factory),
        &tokio::sync::Notify::new(),
    )
    .await;
    other.join().unwrap();
    assert!(matches!(outcome, Outcome::Stop));
    assert!(
        !f.inner.child_finished(),
        "stepped down explicitly, yet the node still believes its child finished: it will never run it again and, if preferred, never ask for fail-back"
    );
}
