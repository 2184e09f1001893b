//! Which tasks carry a scheduled time the gate should check.

use std::time::{Duration, SystemTime};

use apalis_cron::Tick;

/// Tells the gate when a task was scheduled, if it knows.
///
/// With a time, the gate also skips a task scheduled before this node gained
/// leadership plus a clock-skew tolerance: that tick may have belonged to the previous
/// leader, which may have run it already.
pub trait TaskSchedule<Args> {
    /// When the task was scheduled, if known.
    fn scheduled_at(&self, args: &Args) -> Option<SystemTime>;
}

/// Any task: no scheduled time is checked (queues, storages).
#[derive(Debug, Clone, Copy, Default)]
pub struct AnyTask;

impl<Args> TaskSchedule<Args> for AnyTask {
    fn scheduled_at(&self, _args: &Args) -> Option<SystemTime> {
        None
    }
}

/// Cron ticks: the tick's timestamp is its scheduled time.
#[derive(Debug, Clone, Copy, Default)]
pub struct CronTicks;

impl<Tz> TaskSchedule<Tick<Tz>> for CronTicks {
    fn scheduled_at(&self, tick: &Tick<Tz>) -> Option<SystemTime> {
        Some(SystemTime::UNIX_EPOCH + Duration::from_secs(tick.get_timestamp()))
    }
}
