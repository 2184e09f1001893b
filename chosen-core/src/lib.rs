#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod backend;
mod clock;
mod command;
mod election;
mod engine;
mod error;
mod exclusion;
mod fault;
mod group;
// Public as a module: its docs (the guarantee, the SQL) are the reference for fenced
// writes, and its free functions read best qualified (`fenced::fence`).
pub mod fenced;
mod generation;
mod heartbeat;
mod info;
mod key;
mod leadership;
mod lease;
mod manager;
mod maps;
mod metrics;
mod names;
#[cfg(feature = "deadpool")]
mod observer;
mod options;
mod pg;
#[cfg(feature = "deadpool")]
mod rows;
#[cfg(any(test, feature = "deadpool"))]
mod rows_step;
mod shared;
#[cfg(test)]
mod sim;
mod singleton;
mod status;
mod table;
mod task;
mod token;

pub use election::{DEFAULT_FAIL_BACK_AFTER, Election, ElectionOptions};
pub use error::{Error, Result};
pub use group::{GroupOptions, GroupStatus, SingletonGroup};
pub use info::{ClusterLock, HolderInfo, LockInfo, LockState};
pub use key::{DEFAULT_NAMESPACE, LockKey};
#[cfg(any(test, feature = "test-util"))]
#[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
pub use leadership::ManualLeadership;
pub use leadership::{LeaderState, Leadership};
pub use lease::Lease;
pub use manager::{LockManager, LockRequest};
pub use metrics::MetricsSink;
#[cfg(feature = "opentelemetry")]
#[cfg_attr(docsrs, doc(cfg(feature = "opentelemetry")))]
pub use metrics::OtelMetrics;
#[cfg(feature = "prometheus")]
#[cfg_attr(docsrs, doc(cfg(feature = "prometheus")))]
pub use metrics::PrometheusMetrics;
#[cfg(feature = "deadpool")]
#[cfg_attr(docsrs, doc(cfg(feature = "deadpool")))]
pub use observer::{Observer, ObserverOptions};
pub use options::ManagerOptions;
/// The tables of the lease-row mode ([`LockManager::connect_pooled`]) in `schema`
/// (`public` unless [`ManagerOptions::lease_schema`] says otherwise), for a migration:
/// a manager creates them when they are missing and its role may, and otherwise says to
/// run this. Running it again is cheap and safe while a fleet runs: it creates only what
/// is missing (columns a later version added included), checked first, so it waits for
/// no statement of the fleet on tables that are up to date. Where it adds a column, run
/// it in a transaction of its own: the table's lock is held until that transaction
/// commits. `schema` must be a plain identifier (letters, digits, `_`).
///
/// ```
/// let sql = chosen_core::lease_tables_sql("public");
/// assert!(sql.contains("CREATE TABLE IF NOT EXISTS \"public\".chosen_lease ("));
/// ```
#[cfg(feature = "deadpool")]
#[cfg_attr(docsrs, doc(cfg(feature = "deadpool")))]
#[must_use]
pub fn lease_tables_sql(schema: &str) -> String {
    rows::tables_sql(schema)
}
pub use singleton::{
    ChildError, ChildState, LeaderContext, RestartPolicy, Singleton, SingletonOptions,
    SingletonState, SingletonStatus,
};
pub use status::{ConnectionState, SessionDownReason};
pub use token::FencingToken;

/// The exact single-key statements of an uncontended acquire and release, for the
/// itemizing benchmark (which runs them on a raw connection to tell their cost from
/// the cost of the manager's task). Not a stable API.
#[cfg(feature = "test-util")]
#[doc(hidden)]
pub mod bench_sql {
    /// The single-key try (parameters as in the session's `try_keys`; the last, `$13`,
    /// takes the durable token with a win).
    pub const TRY_ONE: &str = crate::pg::TRY_ONE_SQL;
    /// The single-key unlock (parameters as in the session's `unlock_announcing`).
    pub const UNLOCK_ONE: &str = crate::pg::UNLOCK_ONE_SQL;
}
