#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod guard;
mod layer;
#[cfg(feature = "ledger")]
mod ledger;
mod policy;
mod service;
mod worker;

pub use guard::LeaderGuard;
pub use layer::{GateStats, LeaderOnlyJobLayer};
#[cfg(feature = "ledger")]
#[cfg_attr(docsrs, doc(cfg(feature = "ledger")))]
pub use ledger::{
    Claim, DEFAULT_CLOCK_TOLERANCE, DEFAULT_IDLE_IN_TRANSACTION, DEFAULT_LEDGER_TABLE,
    DEFAULT_LEDGER_TIMEOUT, LEDGER_INSTALL_SQL, LedgerError, LedgerFuture, LedgerTable, LedgerTx,
    LedgeredCron, LedgeredCronLayer, MAX_EARLY_HOLD, MAX_LEDGER_TIMEOUT, Misfire, Overlap,
    TickContext, TickLedger,
};
pub use policy::{AnyTask, CronTicks, TaskSchedule};
pub use service::{GateFuture, LeaderOnlyJob, Outcome, SkipReason};
pub use worker::{CronGate, cron_worker};

// What a cron job's code names, at the versions this crate is built with: no need to add
// `cron` (at the exact version apalis-cron uses) or `apalis-cron` by hand.
pub use apalis_cron::Tick;
pub use cron::Schedule;
