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

use crate::guard::LeaderGuard;
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
    /// A cron tick scheduled before this node gained leadership: it was the previous
    /// leader's.
    StaleTick {
        /// When the tick was scheduled.
        scheduled: SystemTime,
        /// When this node gained leadership.
        leading_since: SystemTime,
    },
}

/// The service [`LeaderOnlyLayer`](crate::LeaderOnlyLayer) applies.
#[derive(Debug, Clone)]
pub struct LeaderOnly<S, P> {
    pub(crate) inner: S,
    pub(crate) leadership: Leadership,
    pub(crate) policy: P,
    pub(crate) skew_tolerance: Duration,
    pub(crate) stats: Arc<GateStats>,
}

impl<S, P> LeaderOnly<S, P> {
    fn report(&self, outcome: &str) {
        if let Some(m) = self.leadership.metrics() {
            m.task_gated(self.leadership.node_id(), self.leadership.name(), outcome);
        }
    }
}

impl<S, P, Args> Service<Task<Args>> for LeaderOnly<S, P>
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
        let (token, since) = match self.leadership.state() {
            LeaderState::Leading { token, since } => (token, since),
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
            && scheduled + self.skew_tolerance < since
        {
            self.stats
                .skipped_stale_tick
                .fetch_add(1, Ordering::Relaxed);
            self.report("skipped_stale_tick");
            info!(lock = %name, ?scheduled, ?since, "tick skipped: scheduled before this node gained leadership");
            return GateFuture::skipped(SkipReason::StaleTick {
                scheduled,
                leading_since: since,
            });
        }
        self.stats.ran.fetch_add(1, Ordering::Relaxed);
        self.report("ran");
        task.inject_data(LeaderGuard::new(token, self.leadership.clone()));
        GateFuture {
            kind: Kind::Inner {
                future: self.inner.call(task),
            },
        }
    }
}

pin_project! {
    /// The future of [`LeaderOnly`].
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
