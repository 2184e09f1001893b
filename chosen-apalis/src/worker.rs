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
pub fn cron_worker<P>(
    worker_name: &str,
    schedule: cron::Schedule,
    gate: LeaderOnlyJobLayer<P>,
) -> WorkerBuilder<
    Tick,
    CronScheduler<cron::Schedule>,
    Stack<LeaderOnlyJobLayer<CronTicks>, Identity>,
> {
    WorkerBuilder::new(worker_name)
        .backend(CronScheduler::new(schedule))
        .layer(gate.for_cron_ticks())
}
