//! The gate service and its outcome.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use apalis_core::task::Task;
use chosen_core::{LeaderState, Leadership};
use pin_project_lite::pin_project;
use tower_service::Service;
use tracing::{debug, info};

use crate::guard::{LeaderGuard, Tenure};
use crate::layer::GateStats;
use crate::policy::TaskSchedule;

/// What happened to a task that reached the gate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome<R> {
    /// This node led: the job ran and answered `R`.
    Ran(R),
    /// The job was not run on this node.
    Skipped(SkipReason),
}

impl<R> Outcome<R> {
    /// `true` if the job ran here.
    #[must_use]
    pub fn ran(&self) -> bool {
        matches!(self, Self::Ran(_))
    }
}

/// Why a task was skipped.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum SkipReason {
    /// Another node leads (named when known), or nobody does right now.
    NotLeader {
        /// The leader's node id, when known.
        leader: Option<String>,
    },
    /// A cron tick scheduled before this node gained leadership, or less than the
    /// clock-skew tolerance after: it may have been the previous leader's. With the
    /// tick ledger: a tick this node's scheduler delivered on time by its own clock but
    /// which fell due (by the database's clock, beyond the ledger's clock tolerance)
    /// before this node led (its clock is behind): a missed tick, which the misfire
    /// policy decided about as this answer was given (it may have run it, late:
    /// counted in `GateStats::caught_up`).
    /// `leading_since` is on this node's clock.
    StaleTick {
        /// When the tick was scheduled.
        scheduled: SystemTime,
        /// When this node gained leadership.
        leading_since: SystemTime,
    },
    /// The tick is already recorded in the tick ledger: another leader (or an earlier
    /// attempt here) ran or skipped it.
    AlreadyRecorded {
        /// The tick's scheduled time.
        tick: SystemTime,
    },
    /// The tick ledger could not be read or written (database unreachable, table not
    /// installed, or a newer leader's token recorded): the tick did not run here; the
    /// next leader's misfire policy decides about it.
    Ledger {
        /// The tick's scheduled time.
        tick: SystemTime,
        /// What failed, with its causes.
        error: String,
    },
    /// The previous run of the job was still running on this node, and the overlap
    /// policy did not run this tick now (`Overlap::Skip`: recorded `skipped`;
    /// `Overlap::Buffer` with a tick already waiting: left to the misfire policy).
    Overlap {
        /// The tick's scheduled time.
        tick: SystemTime,
        /// The reason recorded.
        reason: String,
    },
    /// The run was stopped before it ended (its future dropped): `max_runtime`, a
    /// newer tick under `Overlap::CancelPrevious`, or leadership lost.
    Cancelled {
        /// The tick's scheduled time.
        tick: SystemTime,
        /// Why.
        reason: String,
    },
    /// The tick was delivered more than an hour (`MAX_EARLY_HOLD`) beyond the clock
    /// tolerance before the database's clock reaches it (tick ledger): this node's
    /// clock is ahead of the database's. It is not run here and left unrecorded; the
    /// misfire policy decides about it once it is due (a leader decides about the ticks
    /// that are due at each such tick). Ticks less early are held until they are due.
    NotDue {
        /// The tick's scheduled time.
        tick: SystemTime,
        /// How long it would have had to be held (how far ahead of the database's
        /// clock it was delivered, less the tolerance).
        early: Duration,
    },
    /// The run panicked (tick ledger): the panic was caught, the tick recorded `failed`
    /// with the message, and the worker goes on (a leader whose worker died would hold
    /// the job's lock and run nothing).
    Panicked {
        /// The tick's scheduled time.
        tick: SystemTime,
        /// The panic's message.
        message: String,
    },
}

/// The service [`LeaderOnlyJobLayer`](crate::LeaderOnlyJobLayer) applies: runs the job
/// `inner` on the leader, answers [`Outcome::Skipped`] elsewhere.
#[derive(Debug, Clone)]
pub struct LeaderOnlyJob<S, P> {
    inner: S,
    leadership: Leadership,
    policy: P,
    skew_tolerance: Duration,
    stats: Arc<GateStats>,
    /// The election of the layer that built this service, if it started one
    /// ([`LeaderOnlyJobLayer::elect`](crate::LeaderOnlyJobLayer::elect)): kept alive
    /// while this service is, as chosen-tower's service does.
    _election: Option<Arc<chosen_core::Election>>,
}

impl<S> LeaderOnlyJob<S, crate::AnyTask> {
    /// Gates `inner` on `leadership`, as
    /// [`LeaderOnlyJobLayer::new`](crate::LeaderOnlyJobLayer::new)`(leadership).layer(inner)`
    /// does: every task runs on the leader only, with no stale-tick rule and stats of
    /// its own. Use the layer to share stats or gate cron ticks.
    ///
    /// A [`Leadership`] does not keep its election going: keep the
    /// [`Election`](chosen_core::Election) (or `Singleton`) it came from alive as long
    /// as this service, or use
    /// [`LeaderOnlyJobLayer::elect`](crate::LeaderOnlyJobLayer::elect), whose services
    /// keep its election alive.
    pub fn new(inner: S, leadership: Leadership) -> Self {
        tower_layer::Layer::layer(&crate::LeaderOnlyJobLayer::new(leadership), inner)
    }
}

impl<S, P> LeaderOnlyJob<S, P> {
    pub(crate) fn from_parts(
        inner: S,
        leadership: Leadership,
        policy: P,
        skew_tolerance: Duration,
        stats: Arc<GateStats>,
        election: Option<Arc<chosen_core::Election>>,
    ) -> Self {
        Self {
            inner,
            leadership,
            policy,
            skew_tolerance,
            stats,
            _election: election,
        }
    }

    /// The gated service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The gated service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// The gated service, ungated.
    pub fn into_inner(self) -> S {
        self.inner
    }

    /// The leadership the gate checks.
    pub fn leadership(&self) -> &Leadership {
        &self.leadership
    }

    /// What the gate did so far (shared with the layer that built it).
    pub fn stats(&self) -> Arc<GateStats> {
        Arc::clone(&self.stats)
    }

    fn report(&self, outcome: &str) {
        if let Some(m) = self.leadership.metrics() {
            m.task_gated(self.leadership.node_id(), self.leadership.name(), outcome);
        }
    }
}

impl<S, P, Args> Service<Task<Args>> for LeaderOnlyJob<S, P>
where
    S: Service<Task<Args>>,
    P: TaskSchedule<Args>,
{
    type Response = Outcome<S::Response>;
    type Error = S::Error;
    type Future = GateFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // Never gate here: a Pending would stall the backend (cron ticks included).
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut task: Task<Args>) -> Self::Future {
        let name = self.leadership.name();
        let (tenure, state) = observe(&self.leadership);
        let (token, since) = match state {
            LeaderState::Leading { token, since } if !tenure.ended() => (token, since),
            _ => {
                let leader = self.leadership.leader();
                self.stats
                    .skipped_not_leader
                    .fetch_add(1, Ordering::Relaxed);
                self.report("skipped_not_leader");
                debug!(lock = %name, leader = ?leader, "task skipped: not the leader");
                return GateFuture::skipped(SkipReason::NotLeader { leader });
            }
        };
        if let Some(scheduled) = self.policy.scheduled_at(&task.args)
            && is_stale(scheduled, since, self.skew_tolerance)
        {
            self.stats
                .skipped_stale_tick
                .fetch_add(1, Ordering::Relaxed);
            self.report("skipped_stale_tick");
            info!(lock = %name, ?scheduled, ?since, "tick skipped: scheduled before this node gained leadership plus the skew tolerance");
            return GateFuture::skipped(SkipReason::StaleTick {
                scheduled,
                leading_since: since,
            });
        }
        self.stats.ran.fetch_add(1, Ordering::Relaxed);
        self.report("ran");
        task.inject_data(LeaderGuard::new(token, self.leadership.clone(), tenure));
        GateFuture {
            kind: Kind::Inner {
                future: self.inner.call(task),
            },
        }
    }
}

/// The state, with a subscription taken before it was read, so the guard sees any
/// change after it. If the leadership changed in between (the state read may then
/// be a new tenure, which the subscription would take for ended), look again; if
/// it keeps changing, the caller sees an ended tenure and skips the task.
pub(crate) fn observe(leadership: &Leadership) -> (Tenure, LeaderState) {
    let mut attempts = 0;
    loop {
        let tenure = Tenure::watch(leadership);
        let state = leadership.state();
        attempts += 1;
        if !tenure.ended() || attempts == 3 {
            return (tenure, state);
        }
    }
}

/// `true` if a tick scheduled at `scheduled` may have been the previous leader's, for
/// a node that gained leadership at `since` (by its own clock).
///
/// The previous leader ran ticks up to the moment it stopped leading, by *its* clock,
/// which may run up to `tolerance` ahead of ours: so a tick is ours only if it was
/// scheduled at least `tolerance` after we gained leadership. The tolerance shrinks
/// the window of ticks we run; it never widens it. A `since + tolerance` beyond what
/// `SystemTime` can represent skips every tick.
fn is_stale(scheduled: SystemTime, since: SystemTime, tolerance: Duration) -> bool {
    since
        .checked_add(tolerance)
        .is_none_or(|ours_from| scheduled < ours_from)
}

pin_project! {
    /// The future of [`LeaderOnlyJob`].
    #[derive(Debug)]
    pub struct GateFuture<F> {
        #[pin]
        kind: Kind<F>,
    }
}

pin_project! {
    #[project = KindProj]
    #[derive(Debug)]
    enum Kind<F> {
        Inner { #[pin] future: F },
        Skipped { reason: Option<SkipReason> },
    }
}

impl<F> GateFuture<F> {
    fn skipped(reason: SkipReason) -> Self {
        Self {
            kind: Kind::Skipped {
                reason: Some(reason),
            },
        }
    }
}

impl<F, R, E> Future for GateFuture<F>
where
    F: Future<Output = Result<R, E>>,
{
    type Output = Result<Outcome<R>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            KindProj::Inner { future } => future.poll(cx).map(|r| r.map(Outcome::Ran)),
            KindProj::Skipped { reason } => Poll::Ready(Ok(Outcome::Skipped(
                reason
                    .take()
                    .expect("BUG: GateFuture polled after completion"),
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, SystemTime, UNIX_EPOCH};

    use apalis_core::task::Task;
    use apalis_cron::Tick;
    use chosen_core::{LeaderState, Leadership};
    use tower_layer::Layer;
    use tower_service::Service;

    use super::{Outcome, SkipReason, is_stale};
    use crate::LeaderOnlyJobLayer;

    fn secs(t: SystemTime) -> u64 {
        t.duration_since(UNIX_EPOCH).unwrap().as_secs()
    }

    /// Runs one tick scheduled at `scheduled` (whole seconds since the epoch) through a
    /// cron gate with a 10 s tolerance; the job answers the tick's timestamp.
    async fn gate_tick(leadership: &Leadership, scheduled: u64) -> Outcome<u64> {
        let job = tower::service_fn(|task: Task<Tick>| async move {
            Ok::<_, std::convert::Infallible>(task.args.get_timestamp())
        });
        let mut svc = LeaderOnlyJobLayer::new(leadership.clone())
            .for_cron_ticks()
            .skew_tolerance(Duration::from_secs(10))
            .layer(job);
        svc.call(Task::new(Tick::new(scheduled))).await.unwrap()
    }

    // The tolerance absorbs clock skew between the old and the new leader: a tick the
    // old leader may have run (scheduled before, or up to the tolerance after, this
    // node gained leadership by its own clock) must not run again here.
    // No timers: `since` is read back from the leadership, so the test does not race
    // the wall clock.
    #[tokio::test]
    async fn ticks_up_to_the_tolerance_after_leadership_are_skipped() {
        let (leadership, control) = Leadership::manual("cron", "node-1");
        control.lead(3);
        let LeaderState::Leading { since, .. } = leadership.state() else {
            panic!("manual leadership leads");
        };
        let since_s = secs(since);
        for scheduled in [since_s - 5, since_s + 5] {
            let out = gate_tick(&leadership, scheduled).await;
            assert!(
                matches!(out, Outcome::Skipped(SkipReason::StaleTick { .. })),
                "tick at leading_since {:+} s must be skipped with a 10 s tolerance, got {out:?}",
                i128::from(scheduled) - i128::from(since_s)
            );
        }
        // Well past the tolerance: runs.
        let out = gate_tick(&leadership, since_s + 20).await;
        assert_eq!(out, Outcome::Ran(since_s + 20));
    }

    #[test]
    fn a_tick_is_ours_from_leadership_plus_the_tolerance_on() {
        let since = UNIX_EPOCH + Duration::from_secs(1_000_000);
        let tol = Duration::from_secs(1);
        let ms = Duration::from_millis;
        assert!(is_stale(since - ms(1), since, tol));
        assert!(is_stale(since, since, tol));
        assert!(is_stale(since + ms(999), since, tol));
        assert!(!is_stale(since + tol, since, tol));
        assert!(!is_stale(since + ms(1001), since, Duration::ZERO));
        assert!(is_stale(since - ms(1), since, Duration::ZERO));
        // An absurd tolerance skips every tick instead of panicking.
        assert!(is_stale(since + tol, since, Duration::MAX));
    }
}
