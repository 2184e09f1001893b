//! The supervisor of one term of leadership: the child started, restarted by its
//! policy, and stopped before the lock is released ([`Tenure`]).

use super::*;

/// A child that fails within this long of its start (or within the intensity period,
/// if that is shorter) failed on start: more than `max_restarts` such failures in a
/// row give up.
const FAILS_ON_START: Duration = Duration::from_secs(60);

pub(super) enum Outcome {
    Lost(SessionDownReason),
    Stop,
    GiveUp,
    /// A preferred node is back: hand over to it (the child stopped, or not running).
    FailBack,
}

/// What ended a wait on the running child.
enum Event {
    Lost(SessionDownReason),
    Stop,
    FailBack,
    Ended(Result<Result<(), ChildError>, tokio::task::JoinError>),
}

/// A child running under the lease, and the token that tells it to stop.
pub(super) struct RunningChild {
    handle: JoinHandle<Result<(), ChildError>>,
    cancel: CancellationToken,
}

/// One term of leadership: the lease and the child running under it.
///
/// The orderly paths stop the child and then release (or drop) the lease. If the
/// tenure is dropped instead, because the supervisor panicked (a panicking
/// [`MetricsSink`](crate::MetricsSink), say) or its task was aborted (its runtime shut
/// down), `Drop` still keeps the promise, in this order:
///
/// 1. the lease's validity ends, so every [`Leadership`] and [`LeaderContext`] of it
///    stops reporting leadership at once;
/// 2. the child is told to stop and aborted;
/// 3. the lock is released only once the child has stopped (from a small task that
///    waits for it), so no other node starts a child while this one still runs.
pub(super) struct Tenure {
    /// `None` once released.
    pub(super) lease: Option<Lease>,
    /// `Some` while a child task exists.
    pub(super) child: Option<RunningChild>,
}

impl Tenure {
    pub(super) fn new(lease: Lease) -> Self {
        Self {
            lease: Some(lease),
            child: None,
        }
    }

    /// Releases the lock now; the child must have stopped.
    pub(super) async fn release(self) {
        self.release_to(None).await;
    }

    /// Releases the lock, for the node `to` when given (see [`Lease::hand_over`]).
    pub(super) async fn release_to(mut self, to: Option<String>) {
        debug_assert!(self.child.is_none(), "released with a child running");
        if let Some(lease) = self.lease.take() {
            let _ = lease.release_to(to).await;
        }
    }
}

impl Drop for Tenure {
    fn drop(&mut self) {
        let lease = self.lease.take();
        if let Some(lease) = &lease {
            lease.end();
        }
        let Some(child) = self.child.take() else {
            return; // nothing runs: dropping `lease` releases the lock
        };
        child.cancel.cancel();
        if child.handle.is_finished() {
            return;
        }
        child.handle.abort();
        // Keep the lock until the aborted child has really stopped. Without a runtime
        // (it is gone), the child went with it.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let _ = child.handle.await;
                drop(lease);
            });
        }
    }
}

/// One term of leadership: reports it, supervises the child under the tenure's lease
/// until the lease is lost, a stop is asked for or the child gives up, and reports the
/// end. The caller releases or drops the tenure.
pub(super) async fn lead<F, Fut>(
    options: &SingletonOptions,
    inner: &SingletonInner,
    stop: &CancellationToken,
    tenure: &mut Tenure,
    node_id: &Arc<str>,
    factory: &Arc<F>,
    fail_back: &tokio::sync::Notify,
) -> Outcome
where
    F: Fn(LeaderContext) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), ChildError>> + Send + 'static,
{
    let Tenure { lease, child } = tenure;
    let lease = lease
        .as_ref()
        .expect("BUG: a tenure holds its lease until released");
    gained(&inner.leadership, lease);
    inner.update(|s| {
        s.state = SingletonState::Leading {
            since: lease.acquired_at(),
            token: lease.eager_token(),
        };
    });
    let name: Arc<str> = inner.leadership.name().into();
    let validity = lease.validity();
    let make = |restarts, cancel| LeaderContext {
        name: Arc::clone(&name),
        node_id: Arc::clone(node_id),
        token: lease.eager_token(),
        restarts,
        cancel,
        validity: validity.clone(),
    };
    // Lost from the first instant, for good: a heartbeat that extends the watchdog
    // deadline while the child is still stopping must not revive the lease.
    let lost = async {
        let reason = validity.lost().await;
        lease.end();
        reason
    };
    let outcome = supervise(options, inner, stop, lost, make, child, factory, fail_back).await;
    inner.leadership.set_following(None);
    inner.update(|s| {
        s.state = SingletonState::Following { leader: None };
        s.child = ChildState::NotRunning;
    });
    outcome
}

/// Runs and restarts the child while the lease holds. Independent of the database,
/// so it is tested with paused time.
///
/// The running child lives in `slot`, owned by the caller's [`Tenure`], so that a
/// supervisor that dies (panics, is aborted) still leaves it to be stopped before the
/// lock is released.
#[expect(
    clippy::too_many_arguments,
    reason = "each is a separate input of the policy, and its tests pass each on its own"
)]
pub(super) async fn supervise<F, Fut, L>(
    options: &SingletonOptions,
    inner: &SingletonInner,
    stop: &CancellationToken,
    lost: L,
    make_context: impl Fn(u64, CancellationToken) -> LeaderContext,
    slot: &mut Option<RunningChild>,
    factory: &Arc<F>,
    fail_back: &tokio::sync::Notify,
) -> Outcome
where
    F: Fn(LeaderContext) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), ChildError>> + Send + 'static,
    L: Future<Output = SessionDownReason>,
{
    tokio::pin!(lost);
    // Finished for good on this node in an earlier tenure: not started again here.
    if inner.child_finished() {
        inner.update(|s| s.child = ChildState::Finished);
        return keep_finished(stop, &mut lost, fail_back).await;
    }
    // tokio's clock, so the policy is testable with paused time.
    let mut recent: VecDeque<tokio::time::Instant> = VecDeque::new();
    let mut backoff = options.backoff_min;
    let mut restarts = 0u64;
    // Failures in a row of a child that ran less than the intensity period: a child
    // that cannot start. Counted apart from the intensity, which a backoff longer than
    // the period would never reach: the node would sit on the lock running nothing.
    let mut failed_young = 0u32;
    loop {
        let cancel = CancellationToken::new();
        let ctx = make_context(restarts, cancel.clone());
        let make = Arc::clone(factory);
        // The factory runs inside the child's task: one that panics is a child failure,
        // restarted by the policy, not the end of the supervisor.
        *slot = Some(RunningChild {
            handle: tokio::spawn(async move { make(ctx).await }),
            cancel,
        });
        let started = tokio::time::Instant::now();
        inner.update(|s| {
            s.child = ChildState::Running {
                since: SystemTime::now(),
            };
        });
        inner.report_running(true);
        let child = &mut slot
            .as_mut()
            .expect("BUG: the child was just spawned")
            .handle;
        let event = tokio::select! {
            biased;
            reason = &mut lost => Event::Lost(reason),
            () = stop.cancelled() => Event::Stop,
            () = fail_back.notified() => Event::FailBack,
            ended = &mut *child => Event::Ended(ended),
        };
        // A fail-back that came as the child ended: its end decides first (finished for
        // good, this node keeps the lock); to be restarted, it is handed over instead.
        let mut fail_back_came = false;
        let ended = match event {
            Event::Ended(ended) => ended,
            Event::FailBack if child.is_finished() => {
                fail_back_came = true;
                (&mut *child).await
            }
            Event::Lost(reason) => {
                stop_child(options, inner, slot).await;
                inner.report_running(false);
                return Outcome::Lost(reason);
            }
            Event::Stop => {
                stop_child(options, inner, slot).await;
                inner.report_running(false);
                return Outcome::Stop;
            }
            Event::FailBack => {
                stop_child(options, inner, slot).await;
                inner.report_running(false);
                return Outcome::FailBack;
            }
        };
        *slot = None;
        inner.report_running(false);
        let failure = match ended {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(e.to_string()),
            Err(e) if e.is_panic() => Some(panic_message(e.into_panic())),
            Err(e) => Some(e.to_string()),
        };
        let name = inner.leadership.name();
        match &failure {
            Some(f) => warn!(singleton = %name, failure = %f, "child failed"),
            None => info!(singleton = %name, "child returned"),
        }
        if failure.is_some() {
            inner.update(|s| s.last_failure.clone_from(&failure));
        }
        let restart = match options.restart {
            RestartPolicy::Always => true,
            RestartPolicy::OnFailure => failure.is_some(),
            RestartPolicy::Never => false,
        };
        if !restart {
            // Keep the lock so no other node runs the child again while this session
            // lives; and never start it here again. Not if a step-down or hand-over was
            // asked for meanwhile (it forgets the finish): decided under the tenure's
            // lock, which `Singleton::hand_over` holds while it asks.
            {
                let _asking = inner.tenure.lock().unwrap_or_else(PoisonError::into_inner);
                if !stop.is_cancelled() {
                    inner
                        .finished
                        .store(true, std::sync::atomic::Ordering::Release);
                }
            }
            inner.update(|s| s.child = ChildState::Finished);
            return keep_finished(stop, &mut lost, fail_back).await;
        }
        if fail_back_came {
            return Outcome::FailBack;
        }
        let now = tokio::time::Instant::now();
        // Failed on start: within the intensity period of its start, and within a
        // minute (a child that ran for most of a long period did start).
        let young = now.duration_since(started) <= options.restart_period.min(FAILS_ON_START);
        failed_young = if failure.is_some() && young {
            failed_young.saturating_add(1)
        } else {
            0
        };
        // (A test may switch giving up off, to show the fleet simulation sees a node
        // that sits on the lock running nothing.)
        #[cfg(test)]
        let gives_up = !crate::sim::is_off(crate::sim::Guard::ChildGivesUp);
        #[cfg(not(test))]
        let gives_up = true;
        if gives_up && failed_young > options.max_restarts {
            return Outcome::GiveUp;
        }
        if now.duration_since(started) > options.restart_period {
            backoff = options.backoff_min;
        }
        recent.push_back(now);
        while recent
            .front()
            .is_some_and(|t| now.duration_since(*t) > options.restart_period)
        {
            recent.pop_front();
        }
        if gives_up && recent.len() > options.max_restarts as usize {
            return Outcome::GiveUp;
        }
        inner.update(|s| {
            s.child = ChildState::Restarting {
                at: wall_clock_after(backoff),
            };
        });
        tokio::select! {
            biased;
            reason = &mut lost => return Outcome::Lost(reason),
            () = stop.cancelled() => return Outcome::Stop,
            () = fail_back.notified() => return Outcome::FailBack,
            () = tokio::time::sleep(backoff) => {}
        }
        backoff = backoff.saturating_mul(2).min(options.backoff_max);
        restarts += 1;
        inner.update(|s| s.restarts += 1);
        if let Some(m) = inner.leadership.metrics() {
            m.singleton_restart(inner.leadership.node_id(), inner.leadership.name());
        }
    }
}

/// The child finished for good: this node keeps the lock, running nothing, until the
/// session is lost or the tenure stopped (a step-down, a hand-over, a shutdown). A
/// fail-back asked meanwhile is ignored: the preferred node would run the child again.
async fn keep_finished<L>(
    stop: &CancellationToken,
    lost: &mut std::pin::Pin<&mut L>,
    fail_back: &tokio::sync::Notify,
) -> Outcome
where
    L: Future<Output = SessionDownReason>,
{
    #[cfg(test)]
    if crate::sim::is_off(crate::sim::Guard::FinishedKeepsLock) {
        return tokio::select! {
            biased;
            reason = lost => Outcome::Lost(reason),
            () = stop.cancelled() => Outcome::Stop,
            () = fail_back.notified() => Outcome::FailBack,
        };
    }
    let _ = fail_back;
    tokio::select! {
        biased;
        reason = lost => Outcome::Lost(reason),
        () = stop.cancelled() => Outcome::Stop,
    }
}

/// Cancels the child, waits the shutdown timeout, then aborts it and waits until it
/// has stopped. The child stays in `slot` until then, so that if this future is
/// dropped half-way the [`Tenure`] still stops it before releasing.
pub(super) async fn stop_child(
    options: &SingletonOptions,
    inner: &SingletonInner,
    slot: &mut Option<RunningChild>,
) {
    let Some(child) = slot.as_mut() else {
        return;
    };
    inner.update(|s| s.child = ChildState::Stopping);
    child.cancel.cancel();
    if tokio::time::timeout(options.shutdown_timeout, &mut child.handle)
        .await
        .is_err()
    {
        warn!(
            singleton = %inner.leadership.name(),
            timeout = ?options.shutdown_timeout,
            "child ignored cancellation; aborting it"
        );
        child.handle.abort();
        let _ = (&mut child.handle).await;
    }
    *slot = None;
}

pub(super) fn panic_message(payload: Box<dyn std::any::Any + Send>) -> String {
    match payload.downcast::<String>() {
        Ok(s) => format!("panicked: {s}"),
        Err(payload) => match payload.downcast::<&'static str>() {
            Ok(s) => format!("panicked: {s}"),
            Err(_) => "panicked".to_owned(),
        },
    }
}
