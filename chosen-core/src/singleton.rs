//! Run a supervised child task on exactly one node.

use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use tokio::task::JoinHandle;
use tokio_util::sync::{CancellationToken, WaitForCancellationFuture};
use tracing::{error, info, warn};

use crate::election::{campaign, gained, rejoin_pause};
use crate::error::{Error, Result};
use crate::leadership::Leadership;
use crate::lease::{FencingToken, Validity};
use crate::manager::{LockManager, LockRequest};
use crate::status::DisconnectReason;

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
        }
    }
}

impl SingletonOptions {
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

    fn validate(&self, manager: &LockManager) -> Result<()> {
        self.validate_against(manager.options().get_stop_budget())
    }

    fn validate_against(&self, budget: Duration) -> Result<()> {
        if self.shutdown_timeout > budget {
            return Err(Error::InvalidConfig(format!(
                "singleton shutdown_timeout {:?} exceeds the manager's stop_budget {budget:?}: a child losing its lease could still run when another node starts; lower shutdown_timeout or raise stop_budget (and server_release_after)",
                self.shutdown_timeout
            )));
        }
        if self.restart_period.is_zero() {
            return Err(Error::InvalidConfig(
                "singleton restart period must be greater than zero".to_owned(),
            ));
        }
        if self.backoff_min.is_zero() || self.backoff_min > self.backoff_max {
            return Err(Error::InvalidConfig(format!(
                "singleton backoff {:?}..{:?} must satisfy 0 < min <= max",
                self.backoff_min, self.backoff_max
            )));
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

    /// Why the lease was lost, once it was (`None` for a shutdown that kept it valid).
    #[must_use]
    pub fn loss_reason(&self) -> Option<DisconnectReason> {
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
/// 2. **Shutdown** ([`shutdown`](Self::shutdown), or dropping the `Singleton`): the same
///    stop, *then* the lock is released and announced, so a waiting node starts its
///    child within about a round trip.
/// 3. **Too many restarts** (more than the intensity allows): the child is not started
///    again, the lock is released so another node may do better, and this node sits out
///    a cooldown; reported in [`status`](Self::status) and as an `error` event.
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
}

impl SingletonInner {
    fn update(&self, f: impl FnOnce(&mut SingletonStatus)) {
        f(&mut self.status.lock().expect("BUG: status lock poisoned"));
    }

    fn report_running(&self, running: bool) {
        if let Some(m) = self.leadership.metrics() {
            m.singleton_running(self.leadership.node_id(), self.leadership.name(), running);
        }
    }
}

enum Outcome {
    Lost(DisconnectReason),
    Stop,
    GiveUp,
}

impl Singleton {
    /// Starts the singleton `name` on `manager`, with children made by `factory`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidName`] for an empty name, [`Error::InvalidConfig`] when the
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
        });
        let stop = CancellationToken::new();
        let factory = move |ctx| {
            let fut = factory(ctx);
            async move { fut.await.map_err(Into::into) }
        };
        let task = tokio::spawn(run(
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
            .expect("BUG: status lock poisoned")
            .clone();
        if let SingletonState::Following { leader } = &mut status.state
            && let Some(known) = self.inner.leadership.leader()
        {
            *leader = Some(known);
        }
        status
    }

    /// Stops the child (cancel, wait the shutdown timeout, abort), then releases the
    /// lock so a waiting node takes over at once. Idempotent; waits until done.
    ///
    /// # Cancel safety
    ///
    /// The stop is requested before the first await; dropping the future only stops
    /// waiting for it.
    pub async fn shutdown(&self) {
        self.stop.cancel();
        if let Some(task) = self.task.lock().await.take() {
            let _ = task.await;
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
    let leadership = inner.leadership.clone();
    let node_id: Arc<str> = manager.node_id().into();
    let name: Arc<str> = leadership.name().into();
    while let Some(lease) = campaign(&manager, &request, &leadership, &stop).await {
        gained(&leadership, &lease);
        inner.update(|s| {
            s.state = SingletonState::Leading {
                since: lease.acquired_at(),
                token: lease.fencing_token(),
            };
        });
        let validity = lease.validity();
        let make = |restarts, cancel| LeaderContext {
            name: Arc::clone(&name),
            node_id: Arc::clone(&node_id),
            token: lease.fencing_token(),
            restarts,
            cancel,
            validity: validity.clone(),
        };
        let outcome = supervise(&options, &inner, &stop, validity.lost(), make, &factory).await;
        leadership.set_following(None);
        inner.update(|s| {
            s.state = SingletonState::Following { leader: None };
            s.child = ChildState::NotRunning;
        });
        match outcome {
            Outcome::Lost(reason) => {
                warn!(singleton = %name, %reason, "lost leadership; child stopped");
                if !rejoin_pause(&manager, &stop).await {
                    break;
                }
            }
            Outcome::Stop => {
                let _ = lease.release().await;
                break;
            }
            Outcome::GiveUp => {
                let _ = lease.release().await;
                let until = SystemTime::now() + options.give_up_cooldown;
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
    leadership.set_stopped();
    inner.update(|s| {
        s.state = SingletonState::Stopped;
        s.child = ChildState::NotRunning;
    });
    info!(singleton = %name, "singleton stopped");
}

/// Runs and restarts the child while the lease holds. Independent of the database,
/// so it is tested with paused time.
async fn supervise<F, Fut, L>(
    options: &SingletonOptions,
    inner: &SingletonInner,
    stop: &CancellationToken,
    lost: L,
    make_context: impl Fn(u64, CancellationToken) -> LeaderContext,
    factory: &F,
) -> Outcome
where
    F: Fn(LeaderContext) -> Fut,
    Fut: Future<Output = Result<(), ChildError>> + Send + 'static,
    L: Future<Output = DisconnectReason>,
{
    tokio::pin!(lost);
    // tokio's clock, so the policy is testable with paused time.
    let mut recent: VecDeque<tokio::time::Instant> = VecDeque::new();
    let mut backoff = options.backoff_min;
    let mut restarts = 0u64;
    loop {
        let cancel = CancellationToken::new();
        let mut child = tokio::spawn(factory(make_context(restarts, cancel.clone())));
        let started = tokio::time::Instant::now();
        inner.update(|s| {
            s.child = ChildState::Running {
                since: SystemTime::now(),
            };
        });
        inner.report_running(true);
        let ended = tokio::select! {
            biased;
            reason = &mut lost => {
                stop_child(options, inner, &cancel, &mut child).await;
                inner.report_running(false);
                return Outcome::Lost(reason);
            }
            () = stop.cancelled() => {
                stop_child(options, inner, &cancel, &mut child).await;
                inner.report_running(false);
                return Outcome::Stop;
            }
            ended = &mut child => ended,
        };
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
                at: SystemTime::now() + backoff,
            };
        });
        tokio::select! {
            biased;
            reason = &mut lost => return Outcome::Lost(reason),
            () = stop.cancelled() => return Outcome::Stop,
            () = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(options.backoff_max);
        restarts += 1;
        inner.update(|s| s.restarts += 1);
        if let Some(m) = inner.leadership.metrics() {
            m.singleton_restart(inner.leadership.node_id(), inner.leadership.name());
        }
    }
}

async fn stop_child(
    options: &SingletonOptions,
    inner: &SingletonInner,
    cancel: &CancellationToken,
    child: &mut JoinHandle<Result<(), ChildError>>,
) {
    inner.update(|s| s.child = ChildState::Stopping);
    cancel.cancel();
    if tokio::time::timeout(options.shutdown_timeout, &mut *child)
        .await
        .is_err()
    {
        warn!(
            singleton = %inner.leadership.name(),
            timeout = ?options.shutdown_timeout,
            "child ignored cancellation; aborting it"
        );
        child.abort();
        let _ = child.await;
    }
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
        let (validity, generation) = Validity::for_tests();
        Fixture {
            inner: SingletonInner {
                leadership: Leadership::new("test", "node", None),
                status: Mutex::new(SingletonStatus {
                    name: "test".to_owned(),
                    state: SingletonState::Following { leader: None },
                    child: ChildState::NotRunning,
                    restarts: 0,
                    give_ups: 0,
                    last_failure: None,
                }),
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
            &factory,
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
            &factory,
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
            &factory,
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
                generation.revoke(DisconnectReason::ConnectionLost {
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
                &factory,
            )
            .await;
            let took = t0.elapsed();
            assert!(matches!(outcome, Outcome::Lost(_)));
            assert_eq!(saw_cancel.load(Ordering::SeqCst), 1, "ignores={ignores}");
            let expected = if ignores { 3 } else { 2 };
            assert_eq!(took.as_secs(), expected, "ignores={ignores}: {took:?}");
        }
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
