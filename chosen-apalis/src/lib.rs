#![doc = include_str!("../README.md")]

mod guard;
mod layer;
mod policy;
mod service;
mod worker;

pub use guard::LeaderGuard;
pub use layer::{GateStats, LeaderOnlyLayer};
pub use policy::{AnyTask, CronTicks, TaskSchedule};
pub use service::{GateFuture, LeaderOnly, Outcome, SkipReason};
pub use worker::cron_worker;
