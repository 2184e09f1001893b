#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

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
