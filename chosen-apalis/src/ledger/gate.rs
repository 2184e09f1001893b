//! The ledgered cron gate: the leader gate, plus every tick claimed in the ledger and
//! missed ticks handled by the misfire policy.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use apalis_core::task::Task;
use apalis_core::task::task_id::TaskId;
use apalis_core::worker::context::WorkerContext;
use apalis_cron::Tick;
use chosen_core::{LeaderState, Leadership};
use tower_layer::Layer;
use tower_service::Service;
use tracing::{debug, error, info, warn};

use super::context::{Slot, TickContext};
use super::overlap::{Held, Overlap, Refused, SKIP_RUNNING, Turn};
use super::plan::{Look, MAX_MISSED, next_after};
use super::{Claim, JobIds, LedgerError, MAX_EARLY_HOLD, Misfire, TickLedger, at, chain, job_key};
use crate::guard::LeaderGuard;
use crate::layer::{GateStats, LeaderOnlyJobLayer};
use crate::policy::CronTicks;
use crate::service::{Outcome, SkipReason, observe};

impl<P> LeaderOnlyJobLayer<P> {
    /// Records every tick of this cron job in `ledger` and claims it there before it
    /// runs, so that each scheduled tick runs at most once (exactly once for the
    /// writes of [`Claim::InJobTransaction`]) whatever the nodes' clocks say; missed
    /// ticks are handled by a [`Misfire`] policy (default [`Misfire::Skip`]).
    ///
    /// The clock-skew rule of [`for_cron_ticks`](Self::for_cron_ticks) is not applied:
    /// the ledger's primary key, not a clock, keeps two leaders from running one tick,
    /// so no tick is skipped after a hand-over.
    ///
    /// ```no_run
    /// use std::str::FromStr;
    /// use std::time::Duration;
    /// use chosen_apalis::{LeaderOnlyJobLayer, Misfire, Schedule, TickLedger, cron_worker};
    ///
    /// # async fn job(_: chosen_apalis::Tick) -> Result<(), apalis_core::error::BoxDynError> { Ok(()) }
    /// # async fn demo(manager: chosen_core::LockManager, pool: deadpool_postgres::Pool) -> Result<(), apalis_core::error::BoxDynError> {
    /// let ledger = TickLedger::new(pool);
    /// ledger.install().await?;
    /// let gate = LeaderOnlyJobLayer::elect(&manager, "hourly-sync")?
    ///     .ledger(ledger)
    ///     .misfire(Misfire::CatchUp { max: 3, within: Duration::from_secs(3 * 3600) });
    /// cron_worker("hourly-sync", Schedule::from_str("0 0 * * * *")?, gate).build(job).run().await?;
    /// # Ok(())
    /// # }
    /// ```
    #[must_use]
    pub fn ledger(self, ledger: TickLedger) -> LedgeredCronLayer {
        LedgeredCronLayer {
            gate: self.for_cron_ticks(),
            ledger,
            misfire: Misfire::default(),
            claim: Claim::default(),
            schedule: None,
            overlap: Overlap::default(),
            max_runtime: None,
            job: None,
            turn: Arc::default(),
        }
    }
}

/// The gate of a cron job whose ticks are recorded in a [`TickLedger`]: from
/// [`LeaderOnlyJobLayer::ledger`]. Give it to [`cron_worker`](crate::cron_worker),
/// which also gives it the schedule (needed to know which ticks were missed).
///
/// What happens to a tick that reaches it, on each node:
///
/// 0. Due by the database's clock: a tick delivered more than
///    [`TickLedger::clock_tolerance`](crate::TickLedger::clock_tolerance) (1 s) before
///    the database's clock reaches it (this node's clock is ahead) is held until then,
///    at most an hour (further ahead: `Ok(Outcome::Skipped(NotDue))`, unrecorded).
/// 1. Not the leader (no valid lease at this moment): `Ok(Outcome::Skipped(NotLeader))`,
///    nothing else, as [`LeaderOnlyJobLayer`] (a follower reads the database's clock
///    for step 0, and answers this at once when it cannot).
/// 2. Runs of one job on one node never overlap: a tick due while the previous run
///    still runs follows the [`Overlap`] policy (default [`Overlap::Buffer`]: it waits,
///    one at most; further ones are left to the misfire policy of the next run). A run is stopped (its future dropped, the tick recorded
///    `cancelled`) past [`max_runtime`](Self::max_runtime), for a newer tick under
///    [`Overlap::CancelPrevious`], and when the lease it was let through under is lost
///    (with [`Claim::InJobTransaction`] that tick is then left unrecorded: its writes
///    rolled back, and the next leader's misfire policy decides about it).
/// 3. It looks for missed ticks: ticks of the schedule before this one that have no
///    row (nobody ran, skipped or cancelled them; holes below the newest row
///    included), after the job's first row, and after the first row written under
///    this schedule since rows were last written under another (ticks of a new
///    schedule before it was deployed were never due). The [`Misfire`] policy runs
///    some, oldest first, each claimed like any tick, and the others are recorded as
///    `skipped` with their reason, in one fenced transaction.
/// 4. It runs the tick: with [`Claim::BeforeRun`] the gate claims it first (fenced
///    `INSERT … ON CONFLICT DO NOTHING`), runs the job if the claim succeeded, and
///    records `ran` or `failed`; with [`Claim::InJobTransaction`] the job claims it
///    in [`TickContext::begin`].
/// 5. A tick already recorded is `Ok(Outcome::Skipped(AlreadyRecorded))`; a ledger
///    that cannot be reached (or a stale token, or a wait past
///    [`TickLedger::timeout`](crate::TickLedger::timeout)) is
///    `Ok(Outcome::Skipped(Ledger))`, and the tick does not run here (the misfire
///    policy of a later tick decides about it). A run that panics is caught, recorded
///    `failed` and answered `Ok(Outcome::Skipped(Panicked))`; a tick delivered again
///    (or older than the latest delivered) is answered `Ok(Outcome::Skipped(Overlap))`
///    and stops nothing.
///
/// Step 3 also runs when this node gains leadership, if the schedule's next tick is
/// more than 5 s after the database's clock (a daily job's missed run does not wait
/// a day, whenever the gain comes): at once for the ticks more than 5 s old, and 5 s
/// later for the last ones before the gain (this node's scheduler may still deliver
/// them, or may have delivered them before it led, answered "not the leader"); the
/// catch-up window ends at the database's clock at the gain instead of at a tick's
/// scheduled time. A tick due within 5 s decides about the gap itself. (A catch-up run built at the gain, before this
/// node's scheduler delivered any tick, carries no apalis worker data such as
/// `WorkerContext`; data added with `.data(..)` is added inside the gate and is there.)
///
/// Every run gets a [`LeaderGuard`] and a [`TickContext`] in its data. Skips are `Ok`,
/// `poll_ready` is ready at once (a held tick must not hold the job's readiness, such
/// as a concurrency permit: the run waits for it once the tick is due), and the layer
/// must be outermost, as for
/// [`LeaderOnlyJobLayer`].
#[derive(Debug, Clone)]
pub struct LedgeredCronLayer {
    gate: LeaderOnlyJobLayer<CronTicks>,
    ledger: TickLedger,
    misfire: Misfire,
    claim: Claim,
    schedule: Option<cron::Schedule>,
    overlap: Overlap,
    max_runtime: Option<Duration>,
    /// The job's name under its lock ([`job`](Self::job)).
    job: Option<Arc<str>>,
    /// One run of the job at a time on this node, across every service of this layer.
    turn: Arc<Turn>,
}

impl LedgeredCronLayer {
    /// Names the job, for several ledgered jobs gated by one leadership: its rows are
    /// then recorded under a key of its own (`lock/name`; see
    /// [`job_name`](Self::job_name)). Every node must give the job the same name (the
    /// worker's name plays no part: it may differ per node).
    #[must_use]
    pub fn job(mut self, name: &str) -> Self {
        self.job = Some(name.into());
        // A job of its own: its runs do not wait for, nor cancel, another job's.
        self.turn = Arc::default();
        self
    }

    /// The job's key in the ledger (its `job` column): who the job is, from the lock
    /// (its name and the namespace its key was derived in,
    /// [`Leadership::namespace`](chosen_core::Leadership::namespace)) and the job's
    /// name ([`job`](Self::job)), so that two jobs never share rows and one job always
    /// finds its own. In the default namespace (or for a raw key), with no `/` in the
    /// names: the lock's name, or `lock/name` for a named job, as earlier versions
    /// wrote. Otherwise `chosen.job:namespace/lock[/name]`, each part percent-encoded
    /// (`%`, `/`, `*` and NUL; `*` stands for a raw key's namespace), e.g.
    /// `chosen.job:tenant-a/billing`.
    ///
    /// Its ledger transactions are fenced under [`fence_name`](Self::fence_name).
    ///
    /// Upgrading: jobs whose key has the first form keep their rows. A job in another
    /// namespace, or with a `/` (or a NUL) in its lock's or its own name, was keyed
    /// `lock` or `lock/name` before (shared with other jobs: the defect this fixes)
    /// and starts under its new key with no rows: its first tick after the upgrade
    /// starts its history (nothing before it is missed or caught up). Stop such a job
    /// on every node for the upgrade, or a tick at a hand-over between a node of each
    /// version may run on both.
    #[must_use]
    pub fn job_name(&self) -> String {
        self.key().job
    }

    /// The name the job's ledger transactions are fenced under: the lock's name for an
    /// unnamed job keyed by it, `chosen.job/lock/name` for a named job keyed
    /// `lock/name`, else the job's key (see [`job_name`](Self::job_name)). Names
    /// beginning with `chosen.` are the library's: no lock of an application fences
    /// under them.
    ///
    /// One limit stays: chosen-core's fence rows are keyed by name alone
    /// ([`chosen_core::fenced`]), so an unnamed job in the default namespace shares its
    /// fence row (the lock's name) with any fenced write of an application that locks
    /// the same name in another namespace (`lease.fence(&tx)`, `fence(&tx, name, ..)`):
    /// the side with the older tenure is refused as stale. Give such applications
    /// distinct lock names, or distinct fence tables ([`TickLedger::fence_table`]).
    #[must_use]
    pub fn fence_name(&self) -> String {
        self.key().fence
    }

    fn key(&self) -> super::identity::JobKey {
        let leadership = self.gate.leadership();
        job_key(
            leadership.namespace(),
            leadership.name(),
            self.job.as_deref(),
        )
    }

    /// What to do with missed ticks (default [`Misfire::Skip`]).
    #[must_use]
    pub fn misfire(mut self, misfire: Misfire) -> Self {
        self.misfire = misfire;
        self
    }

    /// Who claims each tick (default [`Claim::BeforeRun`]: at most once; use
    /// [`Claim::InJobTransaction`] for exactly once of the job's transaction).
    #[must_use]
    pub fn claim(mut self, claim: Claim) -> Self {
        self.claim = claim;
        self
    }

    /// What a tick due while the previous run still runs on this node does (default
    /// [`Overlap::Buffer`]).
    #[must_use]
    pub fn overlap(mut self, overlap: Overlap) -> Self {
        self.overlap = overlap;
        self
    }

    /// Cancels a run (drops its future) that runs longer than `limit`, and records it
    /// `cancelled`, reason `ran longer than max_runtime (..)`. Default: no limit.
    #[must_use]
    pub fn max_runtime(mut self, limit: Duration) -> Self {
        self.max_runtime = Some(limit);
        self
    }

    /// The cron schedule, to know which ticks were missed; [`cron_worker`](crate::cron_worker)
    /// sets it. Without it no tick counts as missed.
    #[must_use]
    pub fn schedule(mut self, schedule: cron::Schedule) -> Self {
        self.schedule = Some(schedule);
        self
    }

    /// The leadership the gate reads.
    #[must_use]
    pub fn leadership(&self) -> &Leadership {
        self.gate.leadership()
    }

    /// What the gate did so far.
    #[must_use]
    pub fn stats(&self) -> Arc<GateStats> {
        self.gate.stats()
    }

    /// The ledger.
    #[must_use]
    pub fn tick_ledger(&self) -> &TickLedger {
        &self.ledger
    }
}

impl<S> Layer<S> for LedgeredCronLayer
where
    S: Service<Task<Tick>> + Clone + Send + 'static,
    S::Future: Send,
    S::Response: Send + 'static,
    S::Error: fmt::Display + Send + 'static,
{
    type Service = LedgeredCron<S>;

    fn layer(&self, inner: S) -> Self::Service {
        let leadership = self.gate.leadership.clone();
        // Fenced per job: the tokens are the lock's, and one job's long ledger
        // transaction does not hold up another's.
        let key = self.key();
        let ids = JobIds {
            fence: key.fence.into(),
            job: key.job.into(),
            node: leadership.node_id().into(),
            schedule: self.schedule.as_ref().map(|s| s.source().into()),
        };
        let shared = Arc::new(Shared {
            job: Arc::clone(&ids.job),
            node: Arc::clone(&ids.node),
            ids,
            leadership,
            stats: Arc::clone(&self.gate.stats),
            ledger: self.ledger.clone(),
            misfire: self.misfire,
            claim: self.claim,
            schedule: self.schedule.clone(),
            overlap: self.overlap,
            max_runtime: self.max_runtime,
            turn: Arc::clone(&self.turn),
            template: std::sync::Mutex::new(None),
            _election: self.gate._election.clone(),
            worker: std::sync::Mutex::new(None),
            low: AtomicU64::new(0),
            deciding: std::sync::atomic::AtomicBool::new(false),
            tenure_start: std::sync::Mutex::new(None),
            gained: std::sync::Mutex::new(None),
        });
        // Catch up on gaining leadership, not only at the next tick; needs a runtime
        // (apalis builds workers on one), and without one the next tick still does.
        let on_gain = match (&self.schedule, tokio::runtime::Handle::try_current()) {
            (Some(_), Ok(runtime)) => {
                let task = runtime.spawn(on_every_gain(Arc::clone(&shared), inner.clone()));
                Some(Arc::new(AbortOnDrop(task.abort_handle())))
            }
            _ => None,
        };
        LedgeredCron {
            inner,
            shared,
            _on_gain: on_gain,
        }
    }
}

/// The service [`LedgeredCronLayer`] applies.
#[derive(Debug, Clone)]
pub struct LedgeredCron<S> {
    inner: S,
    shared: Arc<Shared>,
    _on_gain: Option<Arc<AbortOnDrop>>,
}

#[derive(Debug)]
struct Shared {
    job: Arc<str>,
    node: Arc<str>,
    /// The job's, the fence's and this node's names, the schedule's text.
    ids: JobIds,
    leadership: Leadership,
    stats: Arc<GateStats>,
    ledger: TickLedger,
    misfire: Misfire,
    claim: Claim,
    schedule: Option<cron::Schedule>,
    overlap: Overlap,
    max_runtime: Option<Duration>,
    turn: Arc<Turn>,
    /// The latest task that reached the gate: what a catch-up run on gaining
    /// leadership is built from (so it carries the worker's data).
    template: std::sync::Mutex<Option<Task<Tick>>>,
    /// The election of the layer this came from, if it started one: kept alive while
    /// any service of it is.
    _election: Option<Arc<chosen_core::Election>>,
    /// The apalis worker of the latest task that carried one: whether it is stopping
    /// is what a run built by the gate (a catch-up on gaining leadership, which may
    /// carry none) looks at too.
    worker: std::sync::Mutex<Option<WorkerContext>>,
    /// Every scheduled tick before this one is known to be recorded in the ledger
    /// (0: nothing known yet): where the next look for missed ticks starts. Learnt
    /// from the ledger only, never from what this node meant to do. A look up to a tick
    /// below it (the clock stepped back, or a catch-up on gaining leadership whose
    /// `upto` was fixed before a later tick ran) starts again from 0 and may move it
    /// back: that only looks at more ticks.
    low: AtomicU64,
    /// A decision about the due ticks, at a tick delivered too early to be held, is
    /// under way.
    deciding: std::sync::atomic::AtomicBool,
    /// The tenure (its token) and when it began by the database's clock, once worked
    /// out ([`Shared::tenure_start`]).
    tenure_start: std::sync::Mutex<Option<(chosen_core::FencingToken, Duration)>>,
    /// The tenure (its token) and when it began on this node's monotonic clock, as
    /// noted by the task that catches up on gaining leadership (immune to a wall clock
    /// stepped between the gain and the tenure's first tick).
    gained: std::sync::Mutex<Option<(chosen_core::FencingToken, tokio::time::Instant)>>,
}

/// Clears a flag when dropped.
struct ClearOnDrop<'a>(&'a std::sync::atomic::AtomicBool);

impl Drop for ClearOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// On gaining leadership, missed ticks are decided at once only if the schedule's next
/// tick is further away than this; a tick this close to the gain may still reach the
/// gate from this node's scheduler, and the next tick decides about the gap anyway.
const GAIN_MARGIN: Duration = Duration::from_secs(5);

/// How long the catch-up on gaining leadership waits before it reads the database's
/// clock again, when it could not.
const GAIN_RETRY: Duration = Duration::from_secs(2);

/// Stops the task that catches up on gaining leadership when the last clone of the
/// service is dropped (the worker stopped).
#[derive(Debug)]
struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Runs [`Shared::catch_up_on_gain`] at the start of every tenure of this node.
async fn on_every_gain<S>(shared: Arc<Shared>, mut inner: S)
where
    S: Service<Task<Tick>> + Clone,
    S::Error: fmt::Display + 'static,
{
    loop {
        shared.leadership.wait_leading().await;
        let (tenure, state) = observe(&shared.leadership);
        let LeaderState::Leading { token, since } = state else {
            continue;
        };
        if tenure.ended() {
            // Changing as we look: look again once it settles.
            tokio::task::yield_now().await;
            continue;
        }
        // When the tenure began on the monotonic clock: `since` is on the wall clock,
        // read an instant ago. Noted only when that is clear: a lag of more than a
        // second (this task was late: a stalled runtime, the previous tenure's
        // catch-up still under way) or a wall clock that went back leaves the start to
        // be worked out from `since`, as when no schedule is known.
        let now = tokio::time::Instant::now();
        let noted = SystemTime::now()
            .duration_since(since)
            .ok()
            .filter(|lag| *lag <= Duration::from_secs(1))
            .and_then(|lag| now.checked_sub(lag))
            .map(|at| (token, at));
        *shared
            .gained
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = noted;
        let guard = LeaderGuard::new(token, shared.leadership.clone(), tenure);
        shared.catch_up_on_gain(&mut inner, &guard).await;
        guard.lost().await;
    }
}

/// The future of [`LedgeredCron`].
pub type LedgerFuture<R, E> = Pin<Box<dyn Future<Output = Result<Outcome<R>, E>> + Send>>;

impl<S> Service<Task<Tick>> for LedgeredCron<S>
where
    S: Service<Task<Tick>> + Clone + Send + 'static,
    S::Future: Send,
    S::Response: Send + 'static,
    S::Error: fmt::Display + Send + 'static,
{
    type Response = Outcome<S::Response>;
    type Error = S::Error;
    type Future = LedgerFuture<S::Response, S::Error>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), S::Error>> {
        // Ready at once, whatever the job: a tick may be held until it is due, and must
        // not hold the job's readiness (a concurrency permit) meanwhile; the run waits
        // for the job's readiness itself, once it is due and claimed. (And never gate
        // here: a Pending would stall the cron backend.)
        let _ = cx;
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, task: Task<Tick>) -> Self::Future {
        let shared = Arc::clone(&self.shared);
        if let Some(worker) = task.data().get::<WorkerContext>() {
            *shared
                .worker
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(worker.clone());
        }
        *shared
            .template
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(task.clone());
        // A clone of the job goes with the call; it is polled ready when the tick runs.
        let inner = self.inner.clone();
        Box::pin(async move { shared.admit(inner, task).await })
    }
}

impl Shared {
    /// `true` once the apalis worker is shutting down (see [`stopping`]).
    fn stopping(&self, base: &Task<Tick>) -> bool {
        stopping(base, &self.worker)
    }

    /// Counts a run whose claim succeeded (and a caught-up one).
    fn count_run(&self, catch_up: bool) {
        if catch_up {
            self.stats.caught_up.fetch_add(1, Ordering::Relaxed);
            self.report("caught_up");
        }
        self.stats.ran.fetch_add(1, Ordering::Relaxed);
        self.report("ran");
    }

    fn report(&self, outcome: &str) {
        if let Some(m) = self.leadership.metrics() {
            m.task_gated(&self.node, &self.job, outcome);
        }
    }

    fn not_leader<R>(&self) -> Outcome<R> {
        let leader = self.leadership.leader();
        self.stats
            .skipped_not_leader
            .fetch_add(1, Ordering::Relaxed);
        self.report("skipped_not_leader");
        debug!(lock = %self.job, leader = ?leader, "tick skipped: not the leader");
        Outcome::Skipped(SkipReason::NotLeader { leader })
    }

    fn ledger_failed<R>(&self, tick: u64, e: &LedgerError) -> Outcome<R> {
        self.stats
            .skipped_ledger_error
            .fetch_add(1, Ordering::Relaxed);
        self.report("skipped_ledger_error");
        let error = chain(e);
        if e.is_stale() {
            info!(lock = %self.job, tick, %error, "tick skipped: a newer leader has written to the ledger");
        } else {
            warn!(lock = %self.job, tick, %error, "tick skipped: the tick ledger failed");
        }
        Outcome::Skipped(SkipReason::Ledger {
            tick: at(tick),
            error,
        })
    }

    /// A tick stopped before its run started (the worker shutting down, a newer tick
    /// under `Overlap::CancelPrevious`): answered `Cancelled`, and counted and reported
    /// `cancelled` once, as every answer is counted once.
    fn not_started<R>(&self, tick: u64, reason: String) -> Outcome<R> {
        self.stats.cancelled.fetch_add(1, Ordering::Relaxed);
        self.report("cancelled");
        debug!(lock = %self.job, tick, reason = %reason, "tick cancelled before its run started");
        Outcome::Skipped(SkipReason::Cancelled {
            tick: at(tick),
            reason,
        })
    }

    fn already_recorded<R>(&self, tick: u64) -> Outcome<R> {
        self.stats
            .skipped_already_recorded
            .fetch_add(1, Ordering::Relaxed);
        self.report("skipped_already_recorded");
        debug!(lock = %self.job, tick, "tick skipped: already recorded in the ledger");
        Outcome::Skipped(SkipReason::AlreadyRecorded { tick: at(tick) })
    }

    /// A tick that reached the gate: held until the database's clock reaches it, then
    /// run if this node leads.
    async fn admit<S>(
        &self,
        mut inner: S,
        task: Task<Tick>,
    ) -> Result<Outcome<S::Response>, S::Error>
    where
        S: Service<Task<Tick>> + Clone,
        S::Error: fmt::Display + 'static,
    {
        let tick = task.args.get_timestamp();
        let too_early = match self.until_due(&task, tick).await {
            Hold::Due => None,
            Hold::NotRun(outcome) => return Ok(outcome),
            Hold::TooEarly { outcome, now } => Some((outcome, now)),
        };
        let (tenure, state) = observe(&self.leadership);
        let (token, since) = match state {
            LeaderState::Leading { token, since } if !tenure.ended() => (token, since),
            _ => return Ok(too_early.map_or_else(|| self.not_leader(), |(o, _)| o)),
        };
        let guard = LeaderGuard::new(token, self.leadership.clone(), tenure);
        if let Some((outcome, now)) = too_early {
            // Every tick this leader's scheduler delivers is this early: decide about the
            // ticks the database's clock has reached at each of them, or none would ever
            // reach the misfire policy while it leads. One such decision at a time: the
            // ticks that come meanwhile leave it to the one under way.
            let deciding = self.deciding.swap(true, Ordering::AcqRel);
            let _done = (!deciding).then(|| ClearOnDrop(&self.deciding));
            if let (false, Some(schedule)) = (deciding, &self.schedule) {
                let upto = next_after(schedule, now.saturating_sub(GAIN_MARGIN.as_secs()));
                if let Some(upto) = upto {
                    self.fill_upto(&mut inner, &guard, upto, now).await;
                }
            }
            return Ok(outcome);
        }
        self.run(inner, task, guard, since).await
    }

    /// When (since the Unix epoch, on the database's clock) the tenure of `token`
    /// began. From the gain's instant on this node's monotonic clock when the task
    /// watching for gains noted it; otherwise from its start on this node's wall
    /// clock (`since`), moved by how far that clock is from the database's. Worked out
    /// once per tenure, at its first tick delivered on time by this node's clock (for
    /// a sparse schedule, maybe long after the gain), so that a clock stepped later in
    /// the tenure does not move it. The earliest the database's clock can have read
    /// then (less the reading's error): a late start would take a tick due just after
    /// the gain for a missed one.
    async fn tenure_start(
        &self,
        token: chosen_core::FencingToken,
        since: SystemTime,
    ) -> Option<Duration> {
        if let Some((t, start)) = *self
            .tenure_start
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            && t == token
        {
            return Some(start);
        }
        let gained = *self
            .gained
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let reading = self.ledger.clock().await.ok()?;
        let start = match gained {
            Some((t, at)) if t == token => reading.earliest_at(at),
            _ => {
                let db = reading.earliest_at(tokio::time::Instant::now());
                let wall = SystemTime::now().duration_since(UNIX_EPOCH).ok()?;
                let since = since.duration_since(UNIX_EPOCH).ok()?;
                (since + db).checked_sub(wall)?
            }
        };
        *self
            .tenure_start
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some((token, start));
        Some(start)
    }

    /// Waits until the database's clock reaches `tick` (less the ledger's tolerance):
    /// a tick is due by the database's clock, not by this node's, which delivered it.
    /// On a follower too, so that an early tick is still there if this node leads once
    /// it is due. Not run here when the clock cannot be read (a follower: not the
    /// leader; a leader: the ledger failed), when the worker stops meanwhile, or when
    /// the tick is more than [`MAX_EARLY_HOLD`] (beyond the tolerance) early.
    async fn until_due<R>(&self, task: &Task<Tick>, tick: u64) -> Hold<R> {
        let tolerance = self.ledger.tolerance();
        let shutting_down = || Hold::NotRun(self.not_started(tick, Stop::ShuttingDown.reason()));
        let mut held = false;
        // Each wait covers the whole distance, so a second round finds the tick due
        // unless a new reading moved the clock back; the claim statement decides then.
        for _ in 0..3 {
            let Some(read) = self
                .unless_stopping(task, SHUTDOWN_POLL, self.ledger.clock())
                .await
            else {
                return shutting_down();
            };
            let reading = match read {
                Ok(reading) => reading,
                Err(e) if self.leadership.is_leader() => {
                    return Hold::NotRun(self.ledger_failed(tick, &e));
                }
                Err(_) => return Hold::NotRun(self.not_leader()),
            };
            let now = tokio::time::Instant::now();
            let Some(early) = reading.early_by(tick, tolerance, now) else {
                break;
            };
            if early > MAX_EARLY_HOLD {
                self.stats.skipped_not_due.fetch_add(1, Ordering::Relaxed);
                self.report("skipped_not_due");
                warn!(lock = %self.job, tick, early = ?early, "tick not run: delivered more than an hour before the database's clock reaches it (this node's clock is ahead); the misfire policy decides about the ticks that are due");
                return Hold::TooEarly {
                    outcome: Outcome::Skipped(SkipReason::NotDue {
                        tick: at(tick),
                        early,
                    }),
                    now: reading.unix_secs(now),
                };
            }
            if !held {
                held = true;
                self.stats.held_early.fetch_add(1, Ordering::Relaxed);
                debug!(lock = %self.job, tick, early = ?early, "tick held until the database's clock reaches it");
            }
            if self
                .unless_stopping(task, HOLD_POLL, tokio::time::sleep(early))
                .await
                .is_none()
            {
                // Not claimed, not run: the next run, here or on the next leader, decides.
                return shutting_down();
            }
        }
        Hold::Due
    }

    /// Runs `work` to its end, or gives up (`None`) once the apalis worker is shutting
    /// down, looked at every `every`.
    async fn unless_stopping<T>(
        &self,
        task: &Task<Tick>,
        every: Duration,
        work: impl Future<Output = T>,
    ) -> Option<T> {
        let mut work = std::pin::pin!(work);
        loop {
            if self.stopping(task) {
                return None;
            }
            tokio::select! {
                done = &mut work => return Some(done),
                () = tokio::time::sleep(every) => {}
            }
        }
    }

    /// Runs the tick at hand (`task`), under the tenure that began at `since` (this
    /// node's wall clock), after deciding about the ticks missed before it.
    async fn run<S>(
        &self,
        mut inner: S,
        task: Task<Tick>,
        guard: LeaderGuard,
        since: SystemTime,
    ) -> Result<Outcome<S::Response>, S::Error>
    where
        S: Service<Task<Tick>> + Clone,
        S::Error: fmt::Display + 'static,
    {
        let current = task.args.get_timestamp();
        let mut held = match self.turn.take(self.overlap, current).await {
            Ok(held) => held,
            Err(refused) => return Ok(self.overlap_skipped(&guard, current, refused).await),
        };
        if !guard.is_valid() {
            return Ok(self.not_leader());
        }
        // A tick this node's scheduler delivers on time by this node's clock, but which
        // the database's clock says fell due before this tenure began (by more than the
        // clock tolerance: this node's clock is behind, or its scheduler slow): it fell
        // due while nobody here led, so it is a missed tick, which the misfire policy
        // decides about (as on gaining leadership, where every tick before the
        // database's clock is a missed one), not the tick at hand. So what a tick's
        // policy decides does not depend on how far the new leader's clock is off.
        let on_time_here = SystemTime::now()
            .duration_since(at(current))
            .is_ok_and(|late| late <= GAIN_MARGIN);
        if on_time_here
            && let Some(start) = self.tenure_start(guard.fencing_token(), since).await
            && Duration::from_secs(current) + self.ledger.tolerance() < start
        {
            let decided = self
                .fill_gap(&mut inner, &mut held, &task, &guard, current + 1, current)
                .await;
            return Ok(match decided {
                Err(outcome) => outcome,
                Ok(()) => {
                    self.stats
                        .skipped_stale_tick
                        .fetch_add(1, Ordering::Relaxed);
                    self.report("skipped_stale_tick");
                    Outcome::Skipped(SkipReason::StaleTick {
                        scheduled: at(current),
                        leading_since: since,
                    })
                }
            });
        }
        if let Err(skipped) = self
            .fill_gap(&mut inner, &mut held, &task, &guard, current, current)
            .await
        {
            if let Outcome::Skipped(SkipReason::Cancelled { reason, .. }) = &skipped {
                // A newer tick stopped the catch-up: the tick at hand is cancelled too,
                // before it started.
                let (token, reason) = (guard.fencing_token(), reason.as_str());
                if let Err(e) = self
                    .ledger
                    .record(&self.ids, token, "cancelled", &[(current, reason)])
                    .await
                {
                    warn!(lock = %self.job, tick = current, error = %chain(&e), "could not record a cancelled tick");
                }
                return Ok(self.not_started(current, reason.to_owned()));
            }
            return Ok(skipped);
        }
        if !guard.is_valid() {
            return Ok(self.not_leader());
        }
        self.run_one(&mut inner, &mut held, &task, &guard, current, false)
            .await
    }

    /// Decides about the ticks missed before `upto` by the misfire policy, `reference`
    /// being the time the catch-up window ends at: records the skips, runs the others
    /// oldest first. `Err` with the outcome to answer when the tick at hand must not
    /// run (ledger failed, leadership lost, a newer tick took over).
    ///
    /// A missed tick is any scheduled tick before `upto`, after the job's first
    /// recorded one, without a row: holes below the newest row count too (a run
    /// stopped and left unrecorded while a later tick was recorded, a claim that
    /// failed, a tick an overlap policy left to the misfire policy). The look starts
    /// where the last one found no hole ([`Shared::low`]), and covers at most the
    /// [`MAX_MISSED`] most recent scheduled ticks.
    async fn fill_gap<S>(
        &self,
        inner: &mut S,
        held: &mut Held<'_>,
        base: &Task<Tick>,
        guard: &LeaderGuard,
        upto: u64,
        reference: u64,
    ) -> Result<(), Outcome<S::Response>>
    where
        S: Service<Task<Tick>> + Clone,
        S::Error: fmt::Display + 'static,
    {
        let Some(schedule) = &self.schedule else {
            return Ok(());
        };
        // Ticks an overlap skipped are not missed: recorded first, if kept.
        self.record_kept_skips(held).await;
        // A tick at hand below the watermark: the clock went back (after a step
        // forward made a future tick look at the gap before it): look again from the
        // start, or a tick left over down here would never be decided.
        let low = match self.low.load(Ordering::Acquire) {
            low if low > upto => 0,
            low => low,
        };
        let look = Look::new(schedule, low, upto);
        if look.candidates.is_empty() {
            return Ok(());
        }
        let found = match self
            .ledger
            .recorded(&self.ids, &look.candidates, upto)
            .await
        {
            Ok(found) => found,
            Err(e) => return Err(self.ledger_failed(upto, &e)),
        };
        let plan = look.decide(self.misfire, &found, reference);
        self.low.store(plan.low, Ordering::Release);
        if plan.truncated {
            warn!(lock = %self.job, upto, oldest_looked_at = look.from(), "more ticks were missed than are looked at ({MAX_MISSED}): the older ones are neither run nor recorded one by one");
        }
        if !plan.skip.is_empty() {
            let rows: Vec<(u64, &str)> = plan.skip.iter().map(|(t, r)| (*t, r.as_str())).collect();
            let token = guard.fencing_token();
            let recorded = match self.ledger.record(&self.ids, token, "skipped", &rows).await {
                Ok(not_due) => rows.len().saturating_sub(not_due),
                Err(e) => return Err(self.ledger_failed(upto, &e)),
            };
            self.stats
                .skipped_missed
                .fetch_add(recorded as u64, Ordering::Relaxed);
            for _ in 0..recorded {
                self.report("skipped_missed");
            }
            info!(lock = %self.job, upto, skipped = recorded, newest = rows[0].0, reason = rows[0].1, "missed ticks recorded as skipped");
        } else if plan.truncated {
            warn!(lock = %self.job, upto, "the oldest missed tick looked at runs: the older ones are not recorded");
        }
        for tick in plan.run {
            if !guard.is_valid() {
                return Err(self.not_leader());
            }
            match self.run_one(inner, held, base, guard, tick, true).await {
                // A newer tick took over: it decides about the rest of the gap.
                Ok(Outcome::Skipped(SkipReason::Cancelled { reason, tick: at_ }))
                    if reason == Stop::NewerTick.reason() =>
                {
                    return Err(Outcome::Skipped(SkipReason::Cancelled {
                        tick: at_,
                        reason,
                    }));
                }
                Ok(_) => {}
                Err(e) => warn!(lock = %self.job, tick, error = %e, "a missed tick's run failed"),
            }
        }
        Ok(())
    }

    /// On gaining leadership: if the schedule's next tick is more than [`GAIN_MARGIN`]
    /// after the database's clock, decides about the missed ticks now rather than at
    /// that tick (a daily job's missed run would otherwise wait a day). A tick due
    /// within the margin decides about the gap itself.
    ///
    /// Ticks more than the margin old cannot reach the gate from this node's scheduler
    /// any more (its clock is within the margin of the database's; a node further off
    /// is warned about): decided at once. The ticks of the last margin before the gain
    /// may still come (this node's clock a little behind), or may have come already,
    /// before this node led, and been answered "not the leader": they are decided once
    /// the margin has passed; each delivered meanwhile is decided as a missed tick too
    /// (answered `StaleTick`), unless it fell due within the clock tolerance of the
    /// gain.
    async fn catch_up_on_gain<S>(&self, inner: &mut S, guard: &LeaderGuard)
    where
        S: Service<Task<Tick>> + Clone,
        S::Error: fmt::Display + 'static,
    {
        let Some(schedule) = &self.schedule else {
            return;
        };
        // Read again while the clock cannot be read (the database unreachable), for as
        // long as this tenure lasts: a daily tick must not wait a day for a blip.
        let reading = loop {
            match self.ledger.clock().await {
                Ok(reading) => break reading,
                Err(e) => {
                    debug!(lock = %self.job, error = %chain(&e), "the database's clock could not be read on gaining leadership; trying again");
                    tokio::select! {
                        () = tokio::time::sleep(GAIN_RETRY) => {}
                        () = guard.lost() => return,
                    }
                }
            }
        };
        let now = reading.unix_secs(tokio::time::Instant::now());
        let margin = GAIN_MARGIN.as_secs();
        let Some(next) = next_after(schedule, now) else {
            return;
        };
        if next <= now + margin {
            return; // that tick comes soon, and decides about the gap itself
        }
        let older = next_after(schedule, now.saturating_sub(margin)).unwrap_or(next);
        if older < next {
            // Ticks in (now - margin, now]: first those older than the margin.
            self.fill_upto(inner, guard, older, now).await;
            tokio::select! {
                () = tokio::time::sleep(GAIN_MARGIN) => {}
                () = guard.lost() => return,
            }
        }
        self.fill_upto(inner, guard, next, now).await;
    }

    /// Decides about the ticks missed before `upto` outside the run of a tick (on
    /// gaining leadership, or at a tick delivered too early to be held), the catch-up
    /// window ending at the database's clock (`now`).
    async fn fill_upto<S>(&self, inner: &mut S, guard: &LeaderGuard, upto: u64, now: u64)
    where
        S: Service<Task<Tick>> + Clone,
        S::Error: fmt::Display + 'static,
    {
        let mut held = self.turn.wait(upto.saturating_sub(1)).await;
        if !guard.is_valid() {
            return;
        }
        let base = self
            .template
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
            .unwrap_or_else(|| Task::new(Tick::new(now)));
        let _ = self
            .fill_gap(inner, &mut held, &base, guard, upto, now)
            .await;
    }

    /// Runs one tick (the one due, or a missed one) and records it.
    async fn run_one<S>(
        &self,
        inner: &mut S,
        held: &mut Held<'_>,
        base: &Task<Tick>,
        guard: &LeaderGuard,
        tick: u64,
        catch_up: bool,
    ) -> Result<Outcome<S::Response>, S::Error>
    where
        S: Service<Task<Tick>> + Clone,
        S::Error: fmt::Display + 'static,
    {
        let token = guard.fencing_token();
        let ctx = TickContext::new(
            self.ids.clone(),
            tick,
            token,
            catch_up,
            self.claim,
            self.ledger.clone(),
        );
        if self.stopping(base) {
            // Not claimed, not run: the next run, here or on the next leader, decides.
            return Ok(self.not_started(tick, Stop::ShuttingDown.reason()));
        }
        let mut task = base.clone();
        task.args = Tick::new(tick);
        if catch_up {
            // Its own id, as the scheduler would have given it (not the id of the tick
            // whose task it was built from).
            task = task
                .into_builder()
                .task_id(TaskId::Ulid(ulid::Ulid::from_datetime(at(tick))))
                .build();
        }
        task.inject_data(guard.clone());
        task.inject_data(ctx.clone());
        // The job's readiness first (a paused worker, a concurrency limit inside the
        // gate): nothing is claimed for a tick the job cannot take yet, and a stop while
        // it waits leaves the tick unrecorded, for the misfire policy. On a clone of its
        // own, dropped (and its readiness, a permit, with it) if the job is not called.
        let mut job = inner.clone();
        if let Some(outcome) = self.until_ready(&mut job, base, held, guard, tick).await? {
            return Ok(outcome);
        }
        // The tables a claim before the run was made in: its end is recorded there.
        let mut claimed_in = None;
        if self.claim == Claim::BeforeRun {
            match self.ledger.claim_before_run(&self.ids, tick, token).await {
                Ok(Some(tables)) => claimed_in = Some(tables),
                Ok(None) => return Ok(self.already_recorded(tick)),
                Err(e) => return Ok(self.ledger_failed(tick, &e)),
            }
            // The claim may have taken long (an unanswered commit looked up): the lease
            // must still hold before the job starts, or a newer leader may run a later
            // tick meanwhile. Claimed, the tick is decided: recorded `cancelled`.
            if !guard.is_valid() {
                return Ok(self
                    .cancelled(&ctx, claimed_in.as_ref(), Stop::LeadershipLost)
                    .await);
            }
        }
        // Counted once claimed: here for a claim before the run; after it for a claim
        // in the job's transaction (not if that found the tick already recorded).
        if catch_up {
            info!(lock = %self.job, tick, "running a missed tick");
        }
        if self.claim == Claim::BeforeRun {
            self.count_run(catch_up);
        }
        let stopped = self.run_until_stopped(&mut job, task, held, guard).await;
        if self.claim == Claim::InJobTransaction && ctx.slot() != Slot::AlreadyRecorded {
            self.count_run(catch_up);
        }
        let result = match stopped {
            Ok(result) => result,
            Err(stop) => return Ok(self.cancelled(&ctx, claimed_in.as_ref(), stop).await),
        };
        let failure = result.as_ref().err().map(describe);
        match self.claim {
            Claim::BeforeRun => {
                let outcome = if failure.is_some() { "failed" } else { "ran" };
                let tables = claimed_in
                    .as_ref()
                    .expect("BUG: a tick claimed before the run has its claim's tables");
                if let Err(e) = self
                    .ledger
                    .finish(tables, &self.job, tick, token, outcome, failure.as_deref())
                    .await
                {
                    warn!(lock = %self.job, tick, error = %chain(&e), "could not record the outcome of a run: its row stays 'running'");
                }
            }
            Claim::InJobTransaction => match (ctx.slot(), &failure) {
                (Slot::Committed, _) => {}
                // The ledger failed, not the job: nothing of the run committed. Left
                // unrecorded, the tick is a missed tick for the next one to decide about.
                (Slot::Failed, _) => {
                    warn!(lock = %self.job, tick, "the run's ledger transaction failed: the tick is left to the misfire policy");
                }
                (Slot::AlreadyRecorded, None) => return Ok(self.already_recorded(tick)),
                (_, failure) => {
                    // Failed, or succeeded without committing a ledger transaction: record
                    // it, so that no later leader runs it again.
                    let (outcome, reason) = match failure {
                        Some(f) => ("failed", f.as_str()),
                        None => (
                            "ran",
                            "recorded after the run: the job committed no ledger transaction",
                        ),
                    };
                    // (Already recorded: the insert does nothing.)
                    if let Err(e) = self
                        .ledger
                        .record(&self.ids, token, outcome, &[(tick, reason)])
                        .await
                    {
                        warn!(lock = %self.job, tick, error = %chain(&e), "could not record the outcome of a run");
                    }
                }
            },
        }
        result.map(Outcome::Ran)
    }
}

/// Why a run was stopped before it ended.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Stop {
    /// The job panicked (the message).
    Panicked(String),
    /// A newer tick is due, under [`Overlap::CancelPrevious`].
    NewerTick,
    /// The run exceeded `max_runtime`.
    MaxRuntime(Duration),
    /// The lease the run was let through under was lost.
    LeadershipLost,
    /// The apalis worker is shutting down (the job was not called).
    ShuttingDown,
}

impl Stop {
    fn reason(&self) -> String {
        match self {
            Self::Panicked(message) => format!("the run panicked: {message}"),
            Self::NewerTick => "a newer tick is due".to_owned(),
            Self::MaxRuntime(limit) => format!("ran longer than max_runtime ({:?})", *limit),
            Self::LeadershipLost => "leadership lost".to_owned(),
            Self::ShuttingDown => "the worker is shutting down".to_owned(),
        }
    }
}

impl Shared {
    /// Waits until the job is ready for a tick, before anything is claimed for it.
    /// `Some` with the answer, the tick left unrecorded, when the wait is cut short: the
    /// worker stops, the lease is lost, or a newer tick takes over under
    /// [`Overlap::CancelPrevious`]. The job's readiness error is the answer too.
    async fn until_ready<S>(
        &self,
        inner: &mut S,
        base: &Task<Tick>,
        held: &mut Held<'_>,
        guard: &LeaderGuard,
        tick: u64,
    ) -> Result<Option<Outcome<S::Response>>, S::Error>
    where
        S: Service<Task<Tick>> + Clone,
    {
        loop {
            if self.stopping(base) {
                return Ok(Some(self.not_started(tick, Stop::ShuttingDown.reason())));
            }
            tokio::select! {
                ready = std::future::poll_fn(|cx| inner.poll_ready(cx)) => return ready.map(|()| None),
                () = guard.lost() => return Ok(Some(self.not_leader())),
                () = held.cancelled(), if self.overlap == Overlap::CancelPrevious => {
                    return Ok(Some(self.not_started(tick, Stop::NewerTick.reason())));
                }
                () = tokio::time::sleep(SHUTDOWN_POLL) => {}
            }
        }
    }

    /// Runs the job until it ends, or is stopped: a newer tick under
    /// [`Overlap::CancelPrevious`], `max_runtime`, or the loss of the lease it was let
    /// through under (so that no other node's run of the job can start while this one
    /// still runs here, except in a process frozen past its lease, whose writes the
    /// fence refuses). Stopping drops the job's future.
    async fn run_until_stopped<S>(
        &self,
        inner: &mut S,
        task: Task<Tick>,
        held: &mut Held<'_>,
        guard: &LeaderGuard,
    ) -> Result<Result<S::Response, S::Error>, Stop>
    where
        S: Service<Task<Tick>> + Clone,
    {
        let limit = async {
            match self.max_runtime {
                Some(limit) => tokio::time::sleep(limit).await,
                None => std::future::pending().await,
            }
        };
        let run = CatchUnwind(Box::pin(call(inner, task, &self.worker)));
        // The lease first: a run whose lease has ended is not polled (started) once.
        tokio::select! {
            biased;
            () = guard.lost() => Err(Stop::LeadershipLost),
            () = held.cancelled(), if self.overlap == Overlap::CancelPrevious => Err(Stop::NewerTick),
            () = limit => Err(Stop::MaxRuntime(self.max_runtime.unwrap_or_default())),
            result = run => match result {
                Ok(result) => result.ok_or(Stop::ShuttingDown),
                Err(message) => Err(Stop::Panicked(message)),
            },
        }
    }

    /// Records a stopped run (`claimed_in`: the tables a claim before the run was made
    /// in) and answers its outcome.
    async fn cancelled<R>(
        &self,
        ctx: &TickContext,
        claimed_in: Option<&super::Tables>,
        stop: Stop,
    ) -> Outcome<R> {
        let (tick, token) = (ctx.timestamp(), ctx.fencing_token());
        let reason = stop.reason();
        let panicked = matches!(stop, Stop::Panicked(_));
        // A panic is a failure: recorded `failed`, so that no leader runs it again.
        let outcome = if panicked { "failed" } else { "cancelled" };
        if panicked {
            error!(lock = %self.job, tick, reason = %reason, "run panicked");
        } else {
            self.stats.cancelled.fetch_add(1, Ordering::Relaxed);
            self.report("cancelled");
            warn!(lock = %self.job, tick, reason = %reason, "run cancelled");
        }
        let recorded = match (self.claim, ctx.slot(), &stop) {
            (Claim::BeforeRun, ..) => match claimed_in {
                Some(tables) => self
                    .ledger
                    .finish(tables, &self.job, tick, token, outcome, Some(&reason))
                    .await
                    .map(drop),
                None => Ok(()),
            },
            // Its writes committed before the stop: it ran.
            (Claim::InJobTransaction, Slot::Committed, _) => Ok(()),
            // Its writes rolled back with the dropped transaction (or it never started);
            // left unrecorded, the tick is a missed tick for the next leader, which may
            // run it (exactly once).
            (Claim::InJobTransaction, _, Stop::LeadershipLost | Stop::ShuttingDown) => Ok(()),
            (Claim::InJobTransaction, ..) => self
                .ledger
                .record(&self.ids, token, outcome, &[(tick, &reason)])
                .await
                .map(drop),
        };
        if let Err(e) = recorded {
            warn!(lock = %self.job, tick, error = %chain(&e), "could not record a stopped run");
        }
        match stop {
            Stop::Panicked(message) => Outcome::Skipped(SkipReason::Panicked {
                tick: at(tick),
                message,
            }),
            _ => Outcome::Skipped(SkipReason::Cancelled {
                tick: at(tick),
                reason,
            }),
        }
    }

    /// Records (or leaves to the misfire policy) a tick an overlap policy did not run,
    /// and answers its outcome, within a couple of seconds at most. A skip is recorded
    /// now if the job's fence row is free within a moment; else (the running run's
    /// transaction holds it) once that run has ended: by a task of its own, or by the
    /// next holder of the turn that looks for missed ticks, whichever comes first.
    async fn overlap_skipped<R>(
        &self,
        guard: &LeaderGuard,
        tick: u64,
        refused: Refused,
    ) -> Outcome<R> {
        let reason = match refused {
            Refused::Record(reason) => {
                let token = guard.fencing_token();
                let rows = [(tick, reason)];
                match self
                    .ledger
                    .record_now(&self.ids, token, "skipped", &rows)
                    .await
                {
                    Ok(_) => {}
                    Err(LedgerError::Timeout { .. }) => {
                        if self.turn.defer_skip(tick, token.get()) {
                            self.record_skips_after_the_run();
                        }
                    }
                    Err(e) => return self.ledger_failed(tick, &e),
                }
                reason
            }
            Refused::Defer(reason) => reason,
        };
        self.stats.skipped_overlap.fetch_add(1, Ordering::Relaxed);
        self.report("skipped_overlap");
        info!(lock = %self.job, tick, reason, "tick not run now: the previous run is still running");
        Outcome::Skipped(SkipReason::Overlap {
            tick: at(tick),
            reason: reason.to_owned(),
        })
    }

    /// Starts the task that records the kept skips once the turn is free (the runs they
    /// overlapped have ended, and with them the transactions that held the job's fence
    /// row).
    fn record_skips_after_the_run(&self) {
        let (turn, ledger, ids, job) = (
            Arc::clone(&self.turn),
            self.ledger.clone(),
            self.ids.clone(),
            Arc::clone(&self.job),
        );
        tokio::spawn(async move {
            let held = turn.free().await;
            let skips = turn.take_skips(&held, true);
            record_skips(&ledger, &ids, &job, &skips).await;
        });
    }

    /// Records the kept skips now (this holder of the turn is about to look for missed
    /// ticks: they are not missed).
    async fn record_kept_skips(&self, held: &Held<'_>) {
        let skips = self.turn.take_skips(held, false);
        record_skips(&self.ledger, &self.ids, &self.job, &skips).await;
    }
}

/// Records ticks an overlap skipped, each under the token it was refused under (one
/// statement per token, in practice one). A failure leaves them to the misfire policy.
async fn record_skips(ledger: &TickLedger, ids: &JobIds, job: &str, skips: &[(u64, u64)]) {
    let mut tokens: Vec<u64> = skips.iter().map(|(_, t)| *t).collect();
    tokens.sort_unstable();
    tokens.dedup();
    for token in tokens {
        let rows: Vec<(u64, &str)> = skips
            .iter()
            .filter(|(_, t)| *t == token)
            .map(|(tick, _)| (*tick, SKIP_RUNNING))
            .collect();
        if let Err(e) = ledger
            .record(ids, chosen_core::FencingToken::new(token), "skipped", &rows)
            .await
        {
            warn!(lock = %job, ticks = ?rows.iter().map(|(t, _)| t).collect::<Vec<_>>(), error = %chain(&e), "could not record ticks an overlap skipped: they are left to the misfire policy");
        }
    }
}

/// How often a wait for the job's readiness (or for the database's clock) looks
/// whether the worker is stopping.
const SHUTDOWN_POLL: Duration = Duration::from_millis(100);

/// How often a tick held until it is due looks whether the worker is stopping (there
/// may be thousands of them, on a node far ahead).
const HOLD_POLL: Duration = Duration::from_secs(1);

/// What became of a tick's wait for the database's clock.
enum Hold<R> {
    /// It is due: run it if this node leads.
    Due,
    /// It does not run here: the answer.
    NotRun(Outcome<R>),
    /// It was delivered too early to be held (the answer); the database's clock reads
    /// `now` (Unix seconds).
    TooEarly { outcome: Outcome<R>, now: u64 },
}

/// Waits for `inner` to be ready, then calls it; `None` (without calling it) once the
/// apalis worker is shutting down (the task's, or the latest one the gate saw). apalis'
/// lifecycle service, inside the gate, is never ready again once its worker shuts
/// down, and the worker waits for every call in flight: waiting on regardless would
/// hang the shutdown.
async fn call<S: Service<Task<Tick>>>(
    inner: &mut S,
    task: Task<Tick>,
    latest: &std::sync::Mutex<Option<WorkerContext>>,
) -> Option<Result<S::Response, S::Error>> {
    loop {
        if stopping(&task, latest) {
            return None;
        }
        tokio::select! {
            ready = std::future::poll_fn(|cx| inner.poll_ready(cx)) => match ready {
                Ok(()) => break,
                Err(e) => return Some(Err(e)),
            },
            () = tokio::time::sleep(SHUTDOWN_POLL) => {}
        }
    }
    Some(inner.call(task).await)
}

/// `true` once the apalis worker that delivered `task`, or the latest one the gate
/// saw, is shutting down.
fn stopping(task: &Task<Tick>, latest: &std::sync::Mutex<Option<WorkerContext>>) -> bool {
    task.data()
        .get::<WorkerContext>()
        .is_some_and(WorkerContext::is_shutting_down)
        || latest
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_ref()
            .is_some_and(WorkerContext::is_shutting_down)
}

/// Polls a future, answering a panic in it as `Err` with the panic's message.
struct CatchUnwind<F>(Pin<Box<F>>);

impl<F: Future> Future for CatchUnwind<F> {
    type Output = Result<F::Output, String>;

    fn poll(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        let future = self.0.as_mut();
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| future.poll(cx))) {
            Ok(std::task::Poll::Ready(output)) => std::task::Poll::Ready(Ok(output)),
            Ok(std::task::Poll::Pending) => std::task::Poll::Pending,
            Err(payload) => std::task::Poll::Ready(Err(panic_message(payload.as_ref()))),
        }
    }
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(not a string)".to_owned())
}

/// A job's error as text for the ledger: its sources too when it is a boxed error
/// (apalis' `BoxDynError`, e.g. a database error whose own text is only "db error").
fn describe<E: fmt::Display + 'static>(e: &E) -> String {
    let any: &dyn std::any::Any = e;
    match any.downcast_ref::<apalis_core::error::BoxDynError>() {
        Some(boxed) => chain(boxed.as_ref()),
        None => e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};

    use apalis_core::task::Task;
    use apalis_cron::Tick;
    use chosen_core::Leadership;
    use tower_layer::Layer;
    use tower_service::Service;

    use crate::{LeaderOnlyJobLayer, Misfire, Outcome, SkipReason, TickLedger};

    /// A pool to a port nobody listens on: every `get` fails at once.
    fn dead_pool() -> deadpool_postgres::Pool {
        let mut config = tokio_postgres::Config::new();
        config
            .host("127.0.0.1")
            .port(1)
            .user("nobody")
            .dbname("none");
        deadpool_postgres::Pool::builder(deadpool_postgres::Manager::new(
            config,
            tokio_postgres::NoTls,
        ))
        .build()
        .expect("a pool without a runtime-dependent timeout builds")
    }

    // No database: a follower that cannot read the database's clock answers "not the
    // leader", and a leader whose ledger is unreachable skips the tick as `Ok` (never
    // `Err`: a hot loop under a retry layer) without calling the job. Paused time.
    #[tokio::test(start_paused = true)]
    async fn followers_skip_and_an_unreachable_ledger_skips_as_ok() {
        let (leadership, control) = Leadership::manual("ledger-unit", "node-1");
        let calls = Arc::new(AtomicU32::new(0));
        let job = {
            let calls = Arc::clone(&calls);
            tower::service_fn(move |_: Task<Tick>| {
                calls.fetch_add(1, Ordering::Relaxed);
                async { Ok::<_, std::convert::Infallible>(()) }
            })
        };
        let layer = LeaderOnlyJobLayer::new(leadership)
            .ledger(TickLedger::new(dead_pool()))
            .misfire(Misfire::RunOnce);
        let mut svc = layer.layer(job);

        control.follow(Some("node-2"));
        let out = svc.call(Task::new(Tick::new(1_900_000_000))).await.unwrap();
        assert_eq!(
            out,
            Outcome::Skipped(SkipReason::NotLeader {
                leader: Some("node-2".to_owned())
            })
        );

        control.lead(3);
        let out = svc.call(Task::new(Tick::new(1_900_000_001))).await.unwrap();
        assert!(
            matches!(&out, Outcome::Skipped(SkipReason::Ledger { error, .. }) if error.contains("no connection from the pool")),
            "{out:?}"
        );
        assert_eq!(calls.load(Ordering::Relaxed), 0);
        let stats = layer.stats();
        assert_eq!(
            (stats.skipped_not_leader(), stats.skipped_ledger_error()),
            (1, 1)
        );
    }

    // Rows are keyed by the lock's name, or `lock/name` for a job named on the layer;
    // never by the worker's name, which may differ per node (review finding).
    #[test]
    fn the_job_is_named_after_the_lock() {
        use crate::CronGate;

        let (leadership, _control) = Leadership::manual("shared-lock", "node-1");
        let every_minute: cron::Schedule = "0 * * * * *".parse().unwrap();
        let layer = LeaderOnlyJobLayer::new(leadership).ledger(TickLedger::new(dead_pool()));
        assert_eq!(layer.job_name(), "shared-lock");
        let named = layer.clone().job("nightly").into_cron_layer(&every_minute);
        assert_eq!(named.job_name(), "shared-lock/nightly");
        assert_eq!(
            layer.into_cron_layer(&every_minute).job_name(),
            "shared-lock"
        );
    }
}
