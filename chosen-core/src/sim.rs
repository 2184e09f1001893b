//! Simulated servers for chosen-core's own tests: a model of PostgreSQL's side of
//! chosen's statements ([`server`]), which the engine simulation (`table/sim.rs`)
//! drives event by event, and a [`Backend`](crate::backend::Backend) on it
//! ([`backend`]) that runs the real manager task on tokio's paused clock.

pub(crate) mod backend;
mod fleet;
pub(crate) mod server;

/// Virtual microseconds since the start of a run.
pub(crate) type T = u64;
pub(crate) const MS: T = 1_000;
pub(crate) const SEC: T = 1_000_000;

/// `backend_start` as the SQL reports it (microseconds since the Unix epoch).
pub(crate) fn epoch_us(start: T) -> i64 {
    1_700_000_000_000_000 + start as i64
}
