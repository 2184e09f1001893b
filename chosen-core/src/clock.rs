//! The one clock the manager's rules read.
//!
//! Every instant the manager, its heartbeat, its leases and its supervisors compare
//! (validity deadlines, poll and grace timers, the engine's `now`) comes from here, so
//! that they all agree with the timers they sleep on. In production this is the
//! monotonic clock (`std::time::Instant::now()`); under tokio's `test-util` with a
//! paused clock (`#[tokio::test(start_paused = true)]`) it is tokio's virtual clock, so
//! a test (or a simulated fleet) can advance time for the rules and the timers at once.
//! Outside a runtime it falls back to the monotonic clock, as tokio does.

use std::time::Instant;

/// A deadline that never comes (a year away), for a timer with nothing to wait for.
pub(crate) fn far_future() -> tokio::time::Instant {
    tokio::time::Instant::now() + std::time::Duration::from_secs(86_400 * 365)
}

/// Now, on the clock tokio's timers use.
pub(crate) fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}
