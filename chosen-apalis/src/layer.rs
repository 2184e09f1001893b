//! The gate layer.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use chosen_core::{Election, Leadership, LockManager, LockRequest};
use tower_layer::Layer;

use crate::policy::{AnyTask, CronTicks};
use crate::service::LeaderOnlyJob;

/// Counts of what a gate did (shared by every clone of a layer).
#[derive(Debug, Default)]
pub struct GateStats {
    pub(crate) ran: AtomicU64,
    pub(crate) skipped_not_leader: AtomicU64,
    pub(crate) skipped_stale_tick: AtomicU64,
    pub(crate) caught_up: AtomicU64,
    pub(crate) skipped_missed: AtomicU64,
    pub(crate) skipped_already_recorded: AtomicU64,
    pub(crate) skipped_ledger_error: AtomicU64,
    pub(crate) skipped_overlap: AtomicU64,
    pub(crate) cancelled: AtomicU64,
    pub(crate) held_early: AtomicU64,
    pub(crate) skipped_not_due: AtomicU64,
}

impl GateStats {
    /// Tasks let through to the job.
    #[must_use]
    pub fn ran(&self) -> u64 {
        self.ran.load(Ordering::Relaxed)
    }

    /// Tasks skipped because this node did not lead.
    #[must_use]
    pub fn skipped_not_leader(&self) -> u64 {
        self.skipped_not_leader.load(Ordering::Relaxed)
    }

    /// Cron ticks skipped because they were scheduled before this node gained
    /// leadership plus the skew tolerance (they may have been the previous leader's).
    #[must_use]
    pub fn skipped_stale_tick(&self) -> u64 {
        self.skipped_stale_tick.load(Ordering::Relaxed)
    }

    /// Missed ticks the misfire policy ran late (tick ledger only; also counted in
    /// [`ran`](Self::ran) when their claim succeeded).
    #[must_use]
    pub fn caught_up(&self) -> u64 {
        self.caught_up.load(Ordering::Relaxed)
    }

    /// Missed ticks the misfire policy recorded as skipped (tick ledger only).
    #[must_use]
    pub fn skipped_missed(&self) -> u64 {
        self.skipped_missed.load(Ordering::Relaxed)
    }

    /// Ticks not run because the ledger already had them (tick ledger only).
    #[must_use]
    pub fn skipped_already_recorded(&self) -> u64 {
        self.skipped_already_recorded.load(Ordering::Relaxed)
    }

    /// Ticks not run because the ledger failed or refused this node's token (tick
    /// ledger only).
    #[must_use]
    pub fn skipped_ledger_error(&self) -> u64 {
        self.skipped_ledger_error.load(Ordering::Relaxed)
    }

    /// Ticks not run because the previous run still ran (overlap policy; tick ledger
    /// only).
    #[must_use]
    pub fn skipped_overlap(&self) -> u64 {
        self.skipped_overlap.load(Ordering::Relaxed)
    }

    /// Runs stopped before they ended: `max_runtime`, `Overlap::CancelPrevious`, or
    /// leadership lost; and ticks stopped before their run started: the worker shutting
    /// down, or a newer tick under `Overlap::CancelPrevious` (tick ledger only).
    #[must_use]
    pub fn cancelled(&self) -> u64 {
        self.cancelled.load(Ordering::Relaxed)
    }

    /// Ticks delivered before the database's clock reached them (this node's clock
    /// ahead of the database's by more than the tolerance), held until it did (tick
    /// ledger only; counted whatever became of them then).
    #[must_use]
    pub fn held_early(&self) -> u64 {
        self.held_early.load(Ordering::Relaxed)
    }

    /// Ticks not run because they were delivered more than an hour before the
    /// database's clock reached them (tick ledger only).
    #[must_use]
    pub fn skipped_not_due(&self) -> u64 {
        self.skipped_not_due.load(Ordering::Relaxed)
    }
}

/// Gates apalis jobs on leadership: runs a task only while this node holds a valid lease
/// for a name; otherwise answers `Ok(Outcome::Skipped(..))` without calling the job.
///
/// Build it from a [`Leadership`] you already have ([`new`](Self::new)), or let it
/// start its own election ([`elect`](Self::elect)). Its counterpart for HTTP routes is
/// `chosen_tower::LeaderOnlyHttpLayer`, built the same two ways.
///
/// * **Outermost.** Add it *first* to the `WorkerBuilder` (the first layer added is the
///   outermost), before `.retry(..)` and every other layer: [`cron_worker`](crate::cron_worker)
///   does this for you.
/// * **Never `Err`.** A skip is `Ok`: a gate answering `Err` without calling the inner
///   service spins in a hot loop under apalis' retry layer (measured: 5 million calls
///   in 3.9 s).
/// * **Never in `poll_ready`.** `poll_ready` only forwards; a `Pending` there would stop
///   the cron backend from being polled (and its ticks would fall out of range).
/// * **Checked at execution time**, against the lease deadline at that moment.
///
/// Every task let through gets a [`LeaderGuard`](crate::LeaderGuard) (fencing token,
/// loss signal) in its data.
#[derive(Debug, Clone)]
pub struct LeaderOnlyJobLayer<P = AnyTask> {
    pub(crate) leadership: Leadership,
    pub(crate) policy: P,
    pub(crate) skew_tolerance: Duration,
    pub(crate) stats: Arc<GateStats>,
    /// Keeps an election this layer started alive as long as any clone of the layer.
    pub(crate) _election: Option<Arc<Election>>,
}

impl LeaderOnlyJobLayer {
    /// Gates on an existing leadership (from an [`Election`] or a
    /// [`Singleton`](chosen_core::Singleton)).
    #[must_use]
    pub fn new(leadership: Leadership) -> Self {
        Self {
            leadership,
            policy: AnyTask,
            skew_tolerance: Duration::from_secs(1),
            stats: Arc::default(),
            _election: None,
        }
    }

    /// Starts an election for `lock` on `manager` and gates on it; the election lives as
    /// long as any clone of the layer (so an apalis `Monitor` factory may capture it).
    ///
    /// ```no_run
    /// use chosen_apalis::LeaderOnlyJobLayer;
    ///
    /// # fn demo(manager: chosen_core::LockManager) -> chosen_core::Result<()> {
    /// let gate = LeaderOnlyJobLayer::elect(&manager, "nightly-report")?;
    /// // `cron_worker("nightly-report", schedule, gate)`, or `WorkerBuilder::layer(gate)`
    /// // as the first layer.
    /// # let _ = gate;
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// [`chosen_core::Error::InvalidName`] for an empty name, one with a NUL character, or
    /// a reserved one (beginning with `chosen.`, or named as a raw key's lease is: `key(a, b)`).
    pub fn elect(manager: &LockManager, lock: impl Into<LockRequest>) -> chosen_core::Result<Self> {
        let election = Election::start(manager, lock)?;
        let mut layer = Self::new(election.leadership());
        layer._election = Some(Arc::new(election));
        Ok(layer)
    }
}

impl<P> LeaderOnlyJobLayer<P> {
    /// Also skip cron ticks scheduled before this node gained leadership *plus*
    /// `skew_tolerance` (default 1 s): the previous leader ran ticks up to the moment it
    /// stopped leading by its own clock, which may run ahead of ours. This is what makes
    /// "at most once per tick" hold across a hand-over between two nodes whose clocks
    /// differ by less than the tolerance.
    ///
    /// The cost: the ticks falling within the tolerance after this node gained
    /// leadership are skipped, by every node, even after a graceful hand-over.
    #[must_use]
    pub fn for_cron_ticks(self) -> LeaderOnlyJobLayer<CronTicks> {
        LeaderOnlyJobLayer {
            leadership: self.leadership,
            policy: CronTicks,
            skew_tolerance: self.skew_tolerance,
            stats: self.stats,
            _election: self._election,
        }
    }

    /// The clock-skew tolerance for [`for_cron_ticks`](LeaderOnlyJobLayer::for_cron_ticks):
    /// a bound on how far the nodes' wall clocks may differ. Larger is safer against
    /// skew and skips more ticks after each change of leader.
    #[must_use]
    pub fn skew_tolerance(mut self, tolerance: Duration) -> Self {
        self.skew_tolerance = tolerance;
        self
    }

    /// The leadership the gate reads.
    #[must_use]
    pub fn leadership(&self) -> &Leadership {
        &self.leadership
    }

    /// What the gate did so far.
    #[must_use]
    pub fn stats(&self) -> Arc<GateStats> {
        Arc::clone(&self.stats)
    }
}

impl<S, P: Clone> Layer<S> for LeaderOnlyJobLayer<P> {
    type Service = LeaderOnlyJob<S, P>;

    fn layer(&self, inner: S) -> Self::Service {
        LeaderOnlyJob::from_parts(
            inner,
            self.leadership.clone(),
            self.policy.clone(),
            self.skew_tolerance,
            Arc::clone(&self.stats),
            self._election.clone(),
        )
    }
}
