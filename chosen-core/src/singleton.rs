//! Run a supervised child task on exactly one node.

use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use tokio::task::JoinHandle;
use tokio_util::sync::{CancellationToken, WaitForCancellationFuture};
use tracing::{error, info, warn};

use crate::election::{campaign, gained, rejoin_pause, wait_for_successor};
use crate::error::{Error, Result};
use crate::leadership::Leadership;
use crate::lease::{Lease, Validity};
use crate::manager::{LockManager, LockRequest};
use crate::status::SessionDownReason;
use crate::token::FencingToken;

mod context;
mod options;
mod status;
mod supervisor;
#[cfg(test)]
mod tests;

pub use context::LeaderContext;
pub use options::{ChildError, RestartPolicy, SingletonOptions};
pub use status::{ChildState, SingletonState, SingletonStatus};
use supervisor::{Outcome, Tenure, lead, panic_message};

/// A child task that runs on exactly one node of the fleet: the Rust form of Elixir's
/// `{Chosen, child: MyWorker, name: :my_singleton}`.
///
/// The singleton keeps an election going for its name; while this node holds the lock
/// it runs the child made by the factory, restarting it by its [`RestartPolicy`].
///
/// The stop contract:
///
/// 1. **Lease lost** (session ended, heartbeat overdue): the child's
///    [`LeaderContext::cancelled`] resolves at once, it gets the shutdown timeout to
///    return, then it is aborted (at its next `.await`; a child that never yields
///    cannot be aborted, so keep CPU-bound steps short). Then the node contends again,
///    after two poll intervals that give the other nodes a head start.
/// 2. **Shutdown** ([`shutdown`](Self::shutdown), the manager's
///    [`shutdown`](LockManager::shutdown), or dropping the `Singleton`): the same stop,
///    *then* the lock is released and announced, so a waiting node starts its child
///    within about a round trip.
/// 3. **Too many restarts** (more than the intensity allows): the child is not started
///    again, the lock is released so another node may do better, and this node sits out
///    a cooldown; reported in [`status`](Self::status) and as an `error` event.
/// 4. **The supervisor dies** (a [`MetricsSink`](crate::MetricsSink) or tracing layer
///    that panics, or its task dropped with its runtime): the lease stops being trusted
///    at once ([`Leadership::is_leader`] and [`LeaderContext::is_valid`] turn `false`
///    before the lock is released), the child is cancelled and aborted, the lock is
///    released only once the child has stopped, and the singleton turns
///    [`Stopped`](SingletonState::Stopped) for good ([`shutdown`](Self::shutdown) logs
///    the panic). A factory that panics is not this case: it counts as a failure of the
///    child and is restarted by the policy.
///
/// ```no_run
/// use chosen_core::{LockManager, Singleton, SingletonOptions};
///
/// # async fn demo(manager: LockManager) -> chosen_core::Result<()> {
/// let singleton = Singleton::start(&manager, "billing-sync", SingletonOptions::default(), |ctx| async move {
///     while !ctx.is_cancelled() {
///         // one guarded step, tagged with ctx.fencing_token()
///         tokio::select! {
///             () = ctx.cancelled() => break,
///             () = tokio::time::sleep(std::time::Duration::from_secs(5)) => {}
///         }
///     }
///     Ok::<(), std::io::Error>(())
/// })?;
/// // ... on SIGTERM:
/// singleton.shutdown().await;
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct Singleton {
    inner: Arc<SingletonInner>,
    stop: CancellationToken,
    task: tokio::sync::Mutex<Option<JoinHandle<()>>>,
}

#[derive(Debug)]
struct SingletonInner {
    leadership: Leadership,
    status: Mutex<SingletonStatus>,
    /// Cancelled to step down from the current tenure (a new one per tenure; `None`
    /// between tenures).
    tenure: Mutex<Option<CancellationToken>>,
    /// The node the current tenure is to be handed over to when it is stopped
    /// ([`Singleton::hand_over_to`]).
    hand_to: Mutex<Option<String>>,
    /// The child has finished for good on this node (it ended and is not to be
    /// restarted): it is not started again here, in this tenure or a later one.
    finished: std::sync::atomic::AtomicBool,
}

impl SingletonInner {
    fn update(&self, f: impl FnOnce(&mut SingletonStatus)) {
        // A status is plain data: after a panic elsewhere it is still worth updating
        // (the drop guard that marks a dead supervisor stopped relies on this).
        f(&mut self.status.lock().unwrap_or_else(PoisonError::into_inner));
    }

    /// The child ended and is not to be restarted ([`ChildState::Finished`]): this node
    /// keeps the lock so that it does not run again elsewhere while this node lives.
    pub(crate) fn child_finished(&self) -> bool {
        self.finished.load(std::sync::atomic::Ordering::Acquire)
    }

    fn report_running(&self, running: bool) {
        if let Some(m) = self.leadership.metrics() {
            m.singleton_running(self.leadership.node_id(), self.leadership.name(), running);
        }
    }
}

/// How long a preferred node whose child gave up does not ask to be failed back to:
/// ten cooldowns (or ten intensity periods, if longer) after its first give-up,
/// doubling with each further one (at most an hour), reset once it has led longer than
/// the intensity period again.
#[derive(Debug, Default)]
struct Suspension {
    until: Option<tokio::time::Instant>,
    length: Option<Duration>,
}

impl Suspension {
    /// When this node may ask to be failed back to again.
    fn over_at(&self) -> tokio::time::Instant {
        self.until.unwrap_or_else(tokio::time::Instant::now)
    }

    fn next_length(&self) -> Duration {
        const MAX: Duration = Duration::from_secs(3600);
        self.length.map_or(MAX, |l| l.saturating_mul(2).min(MAX))
    }

    /// Begins (or lengthens) the suspension after a give-up, from ten times `base` (the
    /// cooldown, or the intensity period if longer); answers its length.
    fn begin(&mut self, now: tokio::time::Instant, base: Duration) -> Duration {
        let length = match self.length {
            None => base.saturating_mul(10).min(Duration::from_secs(3600)),
            Some(_) => self.next_length(),
        };
        self.length = Some(length);
        self.until = Some(now + length);
        length
    }
}

/// Marks the singleton stopped when its task ends, however it ends (returns, panics,
/// or is dropped with its runtime), so that no handle keeps reporting leadership.
struct MarkStopped<'a>(&'a SingletonInner);

impl Drop for MarkStopped<'_> {
    fn drop(&mut self) {
        // No user code here (no metrics sink, no tracing): this may run while a panic
        // from either unwinds, and a second panic would abort the process.
        self.0.leadership.set_stopped();
        self.0.update(|s| {
            s.state = SingletonState::Stopped;
            s.child = ChildState::NotRunning;
        });
    }
}

/// `now + after` on the wall clock, saturating instead of panicking for absurd
/// durations.
fn wall_clock_after(after: Duration) -> SystemTime {
    let now = SystemTime::now();
    now.checked_add(after)
        .unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 24 * 3600))
}

impl Singleton {
    /// Starts the singleton `name` on `manager`, with children made by `factory`. On a
    /// manager that has been shut down, the singleton stops at once
    /// ([`Stopped`](SingletonState::Stopped)) without running its child.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidName`] for an empty name, one with a NUL character, or a reserved one (beginning with `chosen.`, or named as a raw key's lease is: `key(a, b)`), [`Error::InvalidConfig`] when the
    /// options are inconsistent (e.g. a shutdown timeout above the manager's stop
    /// budget).
    pub fn start<F, Fut, E>(
        manager: &LockManager,
        name: impl Into<String>,
        options: SingletonOptions,
        factory: F,
    ) -> Result<Self>
    where
        F: Fn(LeaderContext) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), E>> + Send + 'static,
        E: Into<ChildError>,
    {
        Self::start_request(manager, LockRequest::from(name.into()), options, factory)
    }

    /// [`start`](Self::start) on a request built by the caller: a group starts its
    /// members on its own (`internal`) lock names this way.
    pub(crate) fn start_request<F, Fut, E>(
        manager: &LockManager,
        mut request: LockRequest,
        options: SingletonOptions,
        factory: F,
    ) -> Result<Self>
    where
        F: Fn(LeaderContext) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), E>> + Send + 'static,
        E: Into<ChildError>,
    {
        options.validate(manager)?;
        // The child gets its token at start: taken with the win.
        request = request.eager_token();
        if let Some(interval) = options.poll_interval {
            request = request.poll_interval(interval);
        }
        let name = request.validated_name()?;
        let leadership = Leadership::new(
            &name,
            request.namespace(&manager.options().namespace),
            manager.node_id(),
            manager.options().metrics.clone(),
        );
        if let Some(m) = leadership.metrics() {
            // Before the supervisor exists: its child cannot run yet.
            m.singleton_known(manager.node_id(), &name);
        }
        let inner = Arc::new(SingletonInner {
            leadership,
            status: Mutex::new(SingletonStatus {
                name,
                state: SingletonState::Following { leader: None },
                child: ChildState::NotRunning,
                restarts: 0,
                give_ups: 0,
                last_failure: None,
            }),
            tenure: Mutex::new(None),
            hand_to: Mutex::new(None),
            finished: std::sync::atomic::AtomicBool::new(false),
        });
        // A child of the manager's: its shutdown stops this singleton too.
        let stop = manager.stop_token();
        let factory = move |ctx| {
            let fut = factory(ctx);
            async move { fut.await.map_err(Into::into) }
        };
        let task = manager.spawn_supervisor(run(
            manager.clone(),
            request,
            options,
            Arc::clone(&inner),
            stop.clone(),
            factory,
        ));
        Ok(Self {
            inner,
            stop,
            task: tokio::sync::Mutex::new(Some(task)),
        })
    }

    /// The leadership handle for this singleton's name.
    #[must_use]
    pub fn leadership(&self) -> Leadership {
        self.inner.leadership.clone()
    }

    /// A snapshot of the supervision state.
    #[must_use]
    pub fn status(&self) -> SingletonStatus {
        let mut status = self
            .inner
            .status
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        if let SingletonState::Following { leader } = &mut status.state
            && let Some(known) = self.inner.leadership.leader()
        {
            *leader = Some(known);
        }
        status
    }

    /// Gives the leadership up, if this node holds it: the child is stopped (cancel,
    /// the shutdown timeout, abort), the lock released and announced, so a node waiting
    /// for it takes over within about a round trip; this node contends again only once
    /// another node holds it, or after two seconds when none took it. No effect while
    /// following.
    pub fn step_down(&self) {
        self.hand_over(None);
    }

    /// Gives the leadership to the node `node_id`, if this node holds it: as
    /// [`step_down`](Self::step_down), but the release is announced for that node, and
    /// every other waiting node holds off for a second, so that it takes over (within
    /// about a round trip, when it waits for the lock); if it does not, the lock goes
    /// to whichever node takes it first, as after a step-down. No effect while
    /// following, or when `node_id` is this node's.
    ///
    /// ```no_run
    /// # async fn demo(singleton: chosen_core::Singleton) {
    /// // Before stopping this replica, give the work to the one that stays.
    /// singleton.hand_over_to("web-2");
    /// # }
    /// ```
    pub fn hand_over_to(&self, node_id: &str) {
        if node_id != self.inner.leadership.node_id() {
            self.hand_over(Some(node_id.to_owned()));
        }
    }

    fn hand_over(&self, to: Option<String>) {
        let tenure = self
            .inner
            .tenure
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(tenure) = tenure.as_ref() {
            *self
                .inner
                .hand_to
                .lock()
                .unwrap_or_else(PoisonError::into_inner) = to;
            // Asked to give the lock away: a finished child is started again by whoever
            // takes it next, this node too.
            self.inner
                .finished
                .store(false, std::sync::atomic::Ordering::Release);
            tenure.cancel();
        }
    }

    /// Stops the child (cancel, wait the shutdown timeout, abort), then releases the
    /// lock, announced so a waiting node takes over at once. Idempotent; waits until
    /// done. [`LockManager::shutdown`] does the same for every singleton started from
    /// the manager.
    ///
    /// ```no_run
    /// use chosen_core::{LockManager, Singleton, SingletonOptions};
    ///
    /// # async fn demo(manager: LockManager) -> chosen_core::Result<()> {
    /// let singleton = Singleton::start(&manager, "billing-sync", SingletonOptions::default(), |ctx| async move {
    ///     ctx.cancelled().await;
    ///     Ok::<(), std::io::Error>(())
    /// })?;
    /// // ... on SIGTERM:
    /// singleton.shutdown().await;
    /// singleton.shutdown().await; // nothing more to do
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Cancel safety
    ///
    /// The stop is requested before the first await; dropping the future only stops
    /// waiting for it.
    pub async fn shutdown(&self) {
        if let Some(panic) = crate::manager::stop_supervisor(&self.stop, &self.task).await {
            error!(
                singleton = %self.inner.leadership.name(),
                panic = %panic_message(panic),
                "the singleton's supervisor had panicked; its child was stopped and the lock released"
            );
        }
    }
}

impl Drop for Singleton {
    fn drop(&mut self) {
        // The task stops the child and releases the lock in the background.
        self.stop.cancel();
    }
}

async fn run<F, Fut>(
    manager: LockManager,
    request: LockRequest,
    options: SingletonOptions,
    inner: Arc<SingletonInner>,
    stop: CancellationToken,
    factory: F,
) where
    F: Fn(LeaderContext) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), ChildError>> + Send + 'static,
{
    let _stopped = MarkStopped(&inner);
    let factory = Arc::new(factory);
    let leadership = inner.leadership.clone();
    let node_id: Arc<str> = manager.node_id().into();
    let name: Arc<str> = leadership.name().into();
    let presence_lock = request.presence_lock();
    // Whether this node asks to be failed back to (holds the presence lock while it
    // waits): a preferred node, unless its child has finished for good here (it would
    // take the lock from a node running the child, and run nothing), or gave up here
    // lately (it would be handed the lock again and again, to give up each time).
    let mut suspension = Suspension::default();
    loop {
        let asks_fail_back = options.election.preferred && !inner.child_finished();
        let presence = asks_fail_back.then(|| (presence_lock.as_str(), suspension.over_at()));
        let Some(lease) = campaign(
            &manager,
            &request,
            &leadership,
            &stop,
            options.election.eligible,
            presence,
        )
        .await
        else {
            break;
        };
        let mut tenure = Tenure::new(lease);
        let began = tokio::time::Instant::now();
        // Stops this tenure: a shutdown (a child of `stop`) or a step-down.
        let tenure_stop = stop.child_token();
        inner
            .hand_to
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        *inner.tenure.lock().unwrap_or_else(PoisonError::into_inner) = Some(tenure_stop.clone());
        // A preferred node back for long enough: the supervisor is asked to hand over
        // to it, and decides, as it alone knows whether the child has finished for good
        // (then the lock stays: the preferred node would run the child again). Not by a
        // preferred node: another preferred one would hand it back.
        let fail_to: Mutex<Option<String>> = Mutex::new(None);
        let fail_back_asked = tokio::sync::Notify::new();
        let fail_back = async {
            crate::election::fail_back_unless_preferred(
                &manager,
                &presence_lock,
                options.election.fail_back_after,
                &fail_to,
                options.election.preferred,
            )
            .await;
            fail_back_asked.notify_one();
            std::future::pending::<()>().await;
        };
        let outcome = tokio::select! {
            biased;
            outcome = lead(
                &options,
                &inner,
                &tenure_stop,
                &mut tenure,
                &node_id,
                &factory,
                &fail_back_asked,
            ) => outcome,
            () = fail_back => unreachable!("BUG: the fail-back watch never ends"),
        };
        inner
            .tenure
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if matches!(outcome, Outcome::GiveUp) {
            let length = suspension.begin(
                tokio::time::Instant::now(),
                options.give_up_cooldown.max(options.restart_period),
            );
            if options.election.preferred {
                warn!(singleton = %name, suspended_for = ?length, "the child gave up on this preferred node: it does not ask to be failed back to for a while");
            }
        } else if began.elapsed() > options.restart_period {
            suspension = Suspension::default();
        }
        let outcome = match outcome {
            Outcome::FailBack => {
                // A hand-over asked for while the child stopped stands.
                let asked = inner
                    .hand_to
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .take();
                let to = asked.or_else(|| {
                    fail_to
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .take()
                });
                if let Some(to) = to {
                    info!(singleton = %name, to = %to, "the preferred node is back: handing over");
                    tenure.release_to(Some(to)).await;
                } else {
                    tenure.release().await;
                }
                if !wait_for_successor(&manager, &request, &stop).await {
                    break;
                }
                continue;
            }
            outcome => outcome,
        };
        match outcome {
            Outcome::Stop if !stop.is_cancelled() => {
                // Stepped down: the child stopped; release (announced, for one node
                // when handed over), then let another node take it before contending
                // again.
                let to = inner
                    .hand_to
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .take();
                match &to {
                    Some(node) => info!(singleton = %name, to = %node, "handing over"),
                    None => info!(singleton = %name, "stepped down"),
                }
                tenure.release_to(to).await;
                if !wait_for_successor(&manager, &request, &stop).await {
                    break;
                }
            }
            Outcome::Lost(reason) => {
                drop(tenure);
                warn!(singleton = %name, %reason, "lost leadership; child stopped");
                if !rejoin_pause(&manager, &stop).await {
                    break;
                }
            }
            Outcome::Stop => {
                // `hand_over_to` then `shutdown` (a rolling deploy): still handed over.
                let to = inner
                    .hand_to
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .take();
                tenure.release_to(to).await;
                break;
            }
            Outcome::FailBack => unreachable!("BUG: handled above"),
            Outcome::GiveUp => {
                tenure.release().await;
                let until = wall_clock_after(options.give_up_cooldown);
                error!(
                    singleton = %name,
                    max_restarts = options.max_restarts,
                    period = ?options.restart_period,
                    cooldown = ?options.give_up_cooldown,
                    "child restarted too often; released the lock so another node may take over"
                );
                inner.update(|s| {
                    s.give_ups += 1;
                    s.state = SingletonState::CoolingDown { until };
                });
                tokio::select! {
                    biased;
                    () = stop.cancelled() => break,
                    () = tokio::time::sleep(options.give_up_cooldown) => {}
                }
                inner.update(|s| s.state = SingletonState::Following { leader: None });
            }
        }
    }
    info!(singleton = %name, "singleton stopped");
}
