//! The cron entry point.

use apalis_core::layers::{Identity, Stack};
use apalis_core::worker::builder::WorkerBuilder;
use apalis_cron::{CronScheduler, Tick};

use crate::layer::LeaderOnlyJobLayer;
use crate::policy::CronTicks;

/// A cron worker builder whose ticks run only on the leader: the gate is already its
/// first (outermost) layer, so any layer added after it (retries included) sits inside.
/// Finish it with `.build(job)` and run it (or register it with a `Monitor`).
///
/// ```no_run
/// use std::str::FromStr;
/// use apalis_core::{error::BoxDynError, task::data::Data};
/// use chosen_apalis::{LeaderGuard, LeaderOnlyJobLayer, Schedule, Tick, cron_worker};
///
/// async fn every_minute(tick: Tick, guard: Data<LeaderGuard>) -> Result<(), BoxDynError> {
///     println!("tick {} on {}, token {}", tick.get_timestamp(), guard.node_id(), guard.fencing_token());
///     Ok(())
/// }
///
/// # async fn demo(manager: chosen_core::LockManager) -> Result<(), BoxDynError> {
/// let gate = LeaderOnlyJobLayer::elect(&manager, "reports-cron")?;
/// let schedule = Schedule::from_str("0 * * * * *")?; // seconds field first
/// let worker = cron_worker("reports", schedule, gate).build(every_minute);
/// worker.run().await?;
/// # Ok(())
/// # }
/// ```
pub fn cron_worker<G: CronGate>(
    worker_name: &str,
    schedule: cron::Schedule,
    gate: G,
) -> WorkerBuilder<Tick, CronScheduler<cron::Schedule>, Stack<G::Layer, Identity>> {
    let layer = gate.into_cron_layer(&schedule);
    WorkerBuilder::new(worker_name)
        .backend(CronScheduler::new(schedule))
        .layer(layer)
}

/// A gate [`cron_worker`] accepts: [`LeaderOnlyJobLayer`] (which it turns into a cron
/// gate with [`for_cron_ticks`](LeaderOnlyJobLayer::for_cron_ticks)), or, with the
/// `ledger` feature, `LedgeredCronLayer` (which it gives the schedule).
pub trait CronGate {
    /// The layer the worker gets, outermost.
    type Layer;

    /// The layer for a cron worker on `schedule`.
    fn into_cron_layer(self, schedule: &cron::Schedule) -> Self::Layer;
}

impl<P> CronGate for LeaderOnlyJobLayer<P> {
    type Layer = LeaderOnlyJobLayer<CronTicks>;

    fn into_cron_layer(self, _schedule: &cron::Schedule) -> Self::Layer {
        self.for_cron_ticks()
    }
}

#[cfg(feature = "ledger")]
impl CronGate for crate::ledger::LedgeredCronLayer {
    type Layer = Self;

    fn into_cron_layer(self, schedule: &cron::Schedule) -> Self {
        self.schedule(schedule.clone())
    }
}
