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
use crate::lease::{FencingToken, Lease, Validity};
use crate::manager::{LockManager, LockRequest};
use crate::status::SessionDownReason;

/// The error type a child may return.
pub type ChildError = Box<dyn std::error::Error + Send + Sync>;

/// When a child that ended is started again (while this node still leads).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum RestartPolicy {
    /// Whenever it ends (OTP `permanent`). The default: a background loop should run.
    #[default]
    Always,
    /// Only when it fails (returns `Err` or panics) (OTP `transient`).
    OnFailure,
    /// Never (OTP `temporary`).
    Never,
}

/// How a [`Singleton`] supervises its child.
///
/// When the child ends and is not to be restarted (policy [`RestartPolicy::Never`], or
/// [`RestartPolicy::OnFailure`] after a success), this node **keeps the lock** with no
/// child running, so that no other node starts the child again while this node lives.
#[derive(Clone, Debug)]
pub struct SingletonOptions {
    restart: RestartPolicy,
    max_restarts: u32,
    restart_period: Duration,
    backoff_min: Duration,
    backoff_max: Duration,
    shutdown_timeout: Duration,
    give_up_cooldown: Duration,
    poll_interval: Option<Duration>,
    eligible: bool,
    preferred: bool,
    fail_back_after: Duration,
}

impl Default for SingletonOptions {
    fn default() -> Self {
        Self {
            restart: RestartPolicy::Always,
            max_restarts: 3,
            restart_period: Duration::from_secs(5),
            backoff_min: Duration::from_millis(100),
            backoff_max: Duration::from_secs(5),
            shutdown_timeout: Duration::from_secs(1),
            give_up_cooldown: Duration::from_secs(30),
            poll_interval: None,
            eligible: true,
            preferred: false,
            fail_back_after: crate::election::DEFAULT_FAIL_BACK_AFTER,
        }
    }
}

impl SingletonOptions {
    /// Whether this node may run the singleton (default `true`). An ineligible one
    /// never contends for the lock and never starts the child: its leadership follows
    /// whoever runs it (for replicas without the privileges the child needs). A
    /// manager made ineligible
    /// ([`ManagerOptions::eligible`](crate::ManagerOptions::eligible)) makes every
    /// singleton on it so.
    #[must_use]
    pub fn eligible(mut self, eligible: bool) -> Self {
        self.eligible = eligible;
        self
    }

    /// Makes this node the preferred one to run the singleton (default `false`): after
    /// a failover elsewhere, the node running it hands it back (its child stops first)
    /// once this node has been up for that node's
    /// [`fail_back_after`](Self::fail_back_after); see
    /// [`ElectionOptions::preferred`](crate::ElectionOptions::preferred).
    #[must_use]
    pub fn preferred(mut self, preferred: bool) -> Self {
        self.preferred = preferred;
        self
    }

    /// How long a preferred node must have been seen without a break before this node,
    /// running the singleton, hands it over (default 10 s); see
    /// [`ElectionOptions::fail_back_after`](crate::ElectionOptions::fail_back_after).
    #[must_use]
    pub fn fail_back_after(mut self, after: Duration) -> Self {
        self.fail_back_after = after;
        self
    }

    /// Whether this node may run the singleton: see [`eligible`](Self::eligible).
    #[must_use]
    pub fn is_eligible(&self) -> bool {
        self.eligible
    }

    /// The restart policy (default [`RestartPolicy::Always`]).
    #[must_use]
    pub fn restart(mut self, policy: RestartPolicy) -> Self {
        self.restart = policy;
        self
    }

    /// Restart intensity, as in OTP: more than `max_restarts` restarts within `period`
    /// (default 3 in 5 s) makes this node give up: it releases the lock so another
    /// node may do better, waits [`give_up_cooldown`](Self::give_up_cooldown), then
    /// contends again.
    #[must_use]
    pub fn intensity(mut self, max_restarts: u32, period: Duration) -> Self {
        self.max_restarts = max_restarts;
        self.restart_period = period;
        self
    }

    /// Delay before a restart: doubles from `min` to `max` (default 100 ms to 5 s), back
    /// to `min` once a child ran longer than the intensity period.
    #[must_use]
    pub fn backoff(mut self, min: Duration, max: Duration) -> Self {
        self.backoff_min = min;
        self.backoff_max = max;
        self
    }

    /// How long a cancelled child may take to stop before it is aborted (default 1 s).
    /// Must fit in the manager's [`stop_budget`](crate::ManagerOptions::stop_budget),
    /// so that a child losing its lease has stopped before another node can start.
    #[must_use]
    pub fn shutdown_timeout(mut self, timeout: Duration) -> Self {
        self.shutdown_timeout = timeout;
        self
    }

    /// How long to stay out of the contest after giving up (default 30 s).
    #[must_use]
    pub fn give_up_cooldown(mut self, cooldown: Duration) -> Self {
        self.give_up_cooldown = cooldown;
        self
    }

    /// The poll interval while following (default: the manager's).
    #[must_use]
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = Some(interval);
        self
    }

    pub(crate) fn validate(&self, manager: &LockManager) -> Result<()> {
        self.validate_against(manager.options().get_stop_budget())
    }

    fn validate_against(&self, budget: Duration) -> Result<()> {
        if self.shutdown_timeout > budget {
            return Err(Error::config(
                "SingletonOptions::shutdown_timeout",
                format!(
                    "singleton shutdown_timeout {:?} exceeds the manager's stop_budget {budget:?}: a child losing its lease could still run when another node starts; lower shutdown_timeout or raise stop_budget (and server_release_after)",
                    self.shutdown_timeout
                ),
            ));
        }
        if self.restart_period.is_zero() {
            return Err(Error::config(
                "SingletonOptions::intensity",
                "singleton restart period must be greater than zero",
            ));
        }
        if self.backoff_min.is_zero() || self.backoff_min > self.backoff_max {
            return Err(Error::config(
                "SingletonOptions::backoff",
                format!(
                    "singleton backoff {:?}..{:?} must satisfy 0 < min <= max",
                    self.backoff_min, self.backoff_max
                ),
            ));
        }
        Ok(())
    }
}

/// What a child gets: why it runs, and how it is told to stop.
#[derive(Clone)]
pub struct LeaderContext {
    name: Arc<str>,
    node_id: Arc<str>,
    token: FencingToken,
    restarts: u64,
    cancel: CancellationToken,
    validity: Validity,
}

impl fmt::Debug for LeaderContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaderContext")
            .field("name", &self.name)
            .field("node_id", &self.node_id)
            .field("token", &self.token)
            .field("restarts", &self.restarts)
            .field("cancelled", &self.cancel.is_cancelled())
            .finish()
    }
}

impl LeaderContext {
    /// The singleton's name.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// This node's id.
    #[must_use]
    pub fn node_id(&self) -> &str {
        &self.node_id
    }

    /// The fencing token of the lease the child runs under; pass it to downstream
    /// systems so they can reject a stale holder.
    #[must_use]
    pub fn fencing_token(&self) -> FencingToken {
        self.token
    }

    /// How many times the child was restarted under this lease.
    #[must_use]
    pub fn restarts(&self) -> u64 {
        self.restarts
    }

    /// Resolves when the child must stop (lease lost or shutdown). After it, the child
    /// has the singleton's shutdown timeout to return before it is aborted.
    pub fn cancelled(&self) -> WaitForCancellationFuture<'_> {
        self.cancel.cancelled()
    }

    /// `true` once the child must stop.
    #[must_use]
    pub fn is_cancelled(&self) -> bool {
        self.cancel.is_cancelled()
    }

    /// The cancellation token (to hand to sub-tasks).
    #[must_use]
    pub fn cancellation_token(&self) -> CancellationToken {
        self.cancel.clone()
    }

    /// `true` while the lease may be trusted *and* the child was not told to stop:
    /// check it right before each guarded step.
    #[must_use]
    pub fn is_valid(&self) -> bool {
        !self.cancel.is_cancelled() && self.validity.is_valid()
    }

    /// A fenced write under the child's lease: records
    /// [`fencing_token`](Self::fencing_token) for the singleton's name inside `tx`, in
    /// the default fence table, as [`Lease::fence`] does; refused at once, sending
    /// nothing, once the child must stop ([`is_valid`](Self::is_valid) is `false`).
    /// See [`fenced`](crate::fenced) for the guarantee.
    ///
    /// # Errors
    ///
    /// [`Error::LeaseLost`](crate::Error::LeaseLost) once the child must stop; otherwise
    /// as [`fenced::fence`](crate::fenced::fence).
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: roll the transaction back if the future is dropped.
    pub async fn fence(&self, tx: &tokio_postgres::Transaction<'_>) -> Result<()> {
        self.fence_in(tx, &crate::fenced::FenceTable::default())
            .await
    }

    /// [`fence`](Self::fence) in another fence table.
    ///
    /// # Errors
    ///
    /// As [`fence`](Self::fence).
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: roll the transaction back if the future is dropped.
    pub async fn fence_in(
        &self,
        tx: &tokio_postgres::Transaction<'_>,
        table: &crate::fenced::FenceTable,
    ) -> Result<()> {
        if !self.is_valid() {
            let reason = self
                .validity
                .loss_reason()
                .unwrap_or(SessionDownReason::Shutdown);
            return Err(Error::LeaseLost(reason));
        }
        table.fence(tx, &self.name, self.token).await
    }

    /// Why the lease was lost, once it was (`None` for a shutdown that kept it valid).
    #[must_use]
    pub fn loss_reason(&self) -> Option<SessionDownReason> {
        self.validity.loss_reason()
    }
}

/// Where a singleton stands on this node.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum SingletonState {
    /// Contending; `leader` is the holder's node id when known.
    Following {
        /// The leader's node id, when known.
        leader: Option<String>,
    },
    /// This node holds the lock and supervises the child.
    Leading {
        /// Since when (wall clock).
        since: SystemTime,
        /// The lease's fencing token.
        token: FencingToken,
    },
    /// Gave up after too many restarts; contends again at `until`.
    CoolingDown {
        /// When it contends again (wall clock).
        until: SystemTime,
    },
    /// Shut down.
    Stopped,
}

/// The child's state, as `which_children` reported it in Elixir.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ChildState {
    /// Not running (not leading).
    NotRunning,
    /// Running since (wall clock).
    Running {
        /// Since when.
        since: SystemTime,
    },
    /// Ended; restarts at (wall clock).
    Restarting {
        /// When it restarts.
        at: SystemTime,
    },
    /// Ended and not restarted (policy); the lock is kept.
    Finished,
    /// Told to stop; waiting for it.
    Stopping,
}

/// A snapshot of a singleton's supervision (Elixir's `which_children` and
/// `count_children` in one).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct SingletonStatus {
    /// The singleton's name.
    pub name: String,
    /// Leadership on this node.
    pub state: SingletonState,
    /// The child.
    pub child: ChildState,
    /// Restarts on this node since the singleton started.
    pub restarts: u64,
    /// Times this node gave up after exceeding the restart intensity.
    pub give_ups: u64,
    /// The last failure of the child (error text or panic message).
    pub last_failure: Option<String>,
}

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
}

impl SingletonInner {
    fn update(&self, f: impl FnOnce(&mut SingletonStatus)) {
        // A status is plain data: after a panic elsewhere it is still worth updating
        // (the drop guard that marks a dead supervisor stopped relies on this).
        f(&mut self.status.lock().unwrap_or_else(PoisonError::into_inner));
    }

    fn report_running(&self, running: bool) {
        if let Some(m) = self.leadership.metrics() {
            m.singleton_running(self.leadership.node_id(), self.leadership.name(), running);
        }
    }
}

enum Outcome {
    Lost(SessionDownReason),
    Stop,
    GiveUp,
}

/// A child running under the lease, and the token that tells it to stop.
struct RunningChild {
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
struct Tenure {
    /// `None` once released.
    lease: Option<Lease>,
    /// `Some` while a child task exists.
    child: Option<RunningChild>,
}

impl Tenure {
    fn new(lease: Lease) -> Self {
        Self {
            lease: Some(lease),
            child: None,
        }
    }

    /// Releases the lock now; the child must have stopped.
    async fn release(self) {
        self.release_to(None).await;
    }

    /// Releases the lock, for the node `to` when given (see [`Lease::hand_over`]).
    async fn release_to(mut self, to: Option<String>) {
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
    /// [`Error::InvalidName`] for an empty name or one with a NUL character, [`Error::InvalidConfig`] when the
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
        let name = name.into();
        options.validate(manager)?;
        let mut request = LockRequest::from(name.as_str());
        if let Some(interval) = options.poll_interval {
            request = request.poll_interval(interval);
        }
        let name = request.display_name(manager)?;
        let leadership =
            Leadership::new(&name, manager.node_id(), manager.options().metrics.clone());
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
        self.stop.cancel();
        // The handle stays in place until the task is done: a caller that stops
        // waiting (its future dropped) leaves it for the next call to wait on.
        let mut task = self.task.lock().await;
        let Some(handle) = task.as_mut() else {
            return;
        };
        let result = handle.await;
        *task = None;
        if let Err(e) = result
            && e.is_panic()
        {
            error!(
                singleton = %self.inner.leadership.name(),
                panic = %panic_message(e.into_panic()),
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
    let presence = crate::election::preferred_lock(&name);
    let presence = options.preferred.then_some(presence.as_str());
    while let Some(lease) = campaign(
        &manager,
        &request,
        &leadership,
        &stop,
        options.eligible,
        presence,
    )
    .await
    {
        let mut tenure = Tenure::new(lease);
        // Stops this tenure: a shutdown (a child of `stop`) or a step-down.
        let tenure_stop = stop.child_token();
        inner
            .hand_to
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        *inner.tenure.lock().unwrap_or_else(PoisonError::into_inner) = Some(tenure_stop.clone());
        // A preferred node back for long enough: hand over to it (the tenure stops as
        // for a hand-over asked for).
        let prefer = crate::election::preferred_lock(&name);
        let fail_back = async {
            crate::election::fail_back(&manager, &prefer, options.fail_back_after, &inner.hand_to)
                .await;
            tenure_stop.cancel();
            std::future::pending::<()>().await;
        };
        let outcome = tokio::select! {
            outcome = lead(
                &options,
                &inner,
                &tenure_stop,
                &mut tenure,
                &node_id,
                &factory,
            ) => outcome,
            () = fail_back => unreachable!("BUG: the fail-back watch never ends"),
        };
        inner
            .tenure
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
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
                    () = stop.cancelled() => break,
                    () = tokio::time::sleep(options.give_up_cooldown) => {}
                }
                inner.update(|s| s.state = SingletonState::Following { leader: None });
            }
        }
    }
    info!(singleton = %name, "singleton stopped");
}

/// One term of leadership: reports it, supervises the child under the tenure's lease
/// until the lease is lost, a stop is asked for or the child gives up, and reports the
/// end. The caller releases or drops the tenure.
async fn lead<F, Fut>(
    options: &SingletonOptions,
    inner: &SingletonInner,
    stop: &CancellationToken,
    tenure: &mut Tenure,
    node_id: &Arc<str>,
    factory: &Arc<F>,
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
            token: lease.fencing_token(),
        };
    });
    let name: Arc<str> = inner.leadership.name().into();
    let validity = lease.validity();
    let make = |restarts, cancel| LeaderContext {
        name: Arc::clone(&name),
        node_id: Arc::clone(node_id),
        token: lease.fencing_token(),
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
    let outcome = supervise(options, inner, stop, lost, make, child, factory).await;
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
async fn supervise<F, Fut, L>(
    options: &SingletonOptions,
    inner: &SingletonInner,
    stop: &CancellationToken,
    lost: L,
    make_context: impl Fn(u64, CancellationToken) -> LeaderContext,
    slot: &mut Option<RunningChild>,
    factory: &Arc<F>,
) -> Outcome
where
    F: Fn(LeaderContext) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), ChildError>> + Send + 'static,
    L: Future<Output = SessionDownReason>,
{
    tokio::pin!(lost);
    // tokio's clock, so the policy is testable with paused time.
    let mut recent: VecDeque<tokio::time::Instant> = VecDeque::new();
    let mut backoff = options.backoff_min;
    let mut restarts = 0u64;
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
        let ended = tokio::select! {
            biased;
            reason = &mut lost => {
                stop_child(options, inner, slot).await;
                inner.report_running(false);
                return Outcome::Lost(reason);
            }
            () = stop.cancelled() => {
                stop_child(options, inner, slot).await;
                inner.report_running(false);
                return Outcome::Stop;
            }
            ended = child => ended,
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
            // Keep the lock so no other node runs the child again while we live.
            inner.update(|s| s.child = ChildState::Finished);
            tokio::select! {
                reason = &mut lost => return Outcome::Lost(reason),
                () = stop.cancelled() => return Outcome::Stop,
            }
        }
        let now = tokio::time::Instant::now();
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
        if recent.len() > options.max_restarts as usize {
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

/// Cancels the child, waits the shutdown timeout, then aborts it and waits until it
/// has stopped. The child stays in `slot` until then, so that if this future is
/// dropped half-way the [`Tenure`] still stops it before releasing.
async fn stop_child(
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

fn panic_message(payload: Box<dyn std::any::Any + Send>) -> String {
    match payload.downcast::<String>() {
        Ok(s) => format!("panicked: {s}"),
        Err(payload) => match payload.downcast::<&'static str>() {
            Ok(s) => format!("panicked: {s}"),
            Err(_) => "panicked".to_owned(),
        },
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};

    use super::*;

    struct Fixture {
        inner: SingletonInner,
        stop: CancellationToken,
        validity: Validity,
        generation: Arc<crate::session::Generation>,
    }

    fn fixture() -> Fixture {
        fixture_with(None)
    }

    fn fixture_with(metrics: Option<Arc<dyn crate::MetricsSink>>) -> Fixture {
        let (validity, generation) = Validity::for_tests();
        Fixture {
            inner: SingletonInner {
                leadership: Leadership::new("test", "node", metrics),
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
        )
        .await;
        let what = match outcome {
            Outcome::Stop => "stop".to_owned(),
            Outcome::GiveUp => "give up".to_owned(),
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
        )
            -> std::pin::Pin<Box<dyn Future<Output = Result<(), ChildError>> + Send>>
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
            )
            .await;
            drop(tenure);
        })
    }

    /// Waits for the release the lease sends to its manager, and checks what was true
    /// at that moment: the leadership had ended and the child had stopped.
    async fn release_seen(
        rx: &mut tokio::sync::mpsc::UnboundedReceiver<crate::driver::Command>,
        f: &Fixture,
        probe: &Probe,
    ) {
        let cmd = tokio::time::timeout(Duration::from_secs(60), rx.recv())
            .await
            .expect("the lease is released");
        assert!(matches!(cmd, Some(crate::driver::Command::Release { .. })));
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
    /// Real time, because the deadline is on the std clock.
    #[tokio::test]
    async fn a_lease_once_lost_stays_lost_while_the_child_stops() {
        let f = Arc::new(fixture());
        let (lease, _rx, _generation) = crate::Lease::for_tests();
        let shared = Arc::clone(&lease.shared);
        shared.invalidate();
        shared.extend_validity(std::time::Instant::now() + Duration::from_millis(300));
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
        shared.extend_validity(std::time::Instant::now() + Duration::from_secs(3600));
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
}
