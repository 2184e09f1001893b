//! The database's clock as the ledger sees it: whether a tick is due is decided against
//! the database's `clock_timestamp()`, never against a node's wall clock.
//!
//! A reading is one round trip (`SELECT clock_timestamp()`), carried forward on this
//! node's monotonic clock for [`REFRESH`]: the database's clock at the middle of the
//! round trip, give or take half of it. No I/O here: the ledger takes readings, the
//! gate asks them whether a tick is due yet.

use std::sync::{Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::time::Instant;

/// How long a reading is carried forward before the next use reads the clock again.
pub(crate) const REFRESH: Duration = Duration::from_secs(30);

/// How often, at most, the warning that this node's clock is off is repeated.
const WARN_EVERY: Duration = Duration::from_secs(600);

/// One reading of the database's clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Reading {
    /// The database's clock at `at` (its best estimate), since the Unix epoch.
    db: Duration,
    /// When (on this node's monotonic clock) the answer arrived.
    at: Instant,
    /// How far `db` may be off either way: half the round trip.
    error: Duration,
}

impl Reading {
    /// The database said `db` somewhere between `sent` and `received`.
    pub(crate) fn new(db: SystemTime, sent: Instant, received: Instant) -> Self {
        let half = received.saturating_duration_since(sent) / 2;
        let db = db.duration_since(UNIX_EPOCH).unwrap_or_default();
        // At `received` the database's clock reads between `db` (it answered at the
        // last moment) and `db` + the round trip (at the first).
        Self {
            db: db + half,
            at: received,
            error: half,
        }
    }

    /// The database's clock at `now`, best estimate, since the Unix epoch.
    pub(crate) fn estimate(&self, now: Instant) -> Duration {
        self.db + now.saturating_duration_since(self.at)
    }

    /// The earliest the database's clock can have read at `then`, before or after the
    /// reading (carried back or forward on the monotonic clock).
    pub(crate) fn earliest_at(&self, then: Instant) -> Duration {
        let db = if then >= self.at {
            self.db + (then - self.at)
        } else {
            self.db.saturating_sub(self.at - then)
        };
        db.saturating_sub(self.error)
    }

    /// The earliest the database's clock can read at `now`.
    fn earliest(&self, now: Instant) -> Duration {
        self.estimate(now).saturating_sub(self.error)
    }

    /// How long until the tick scheduled at `tick` (Unix seconds) is due at `now`,
    /// `tolerance` early at most; `None` when it is due (the database's clock reads at
    /// least `tick - tolerance`, whatever the reading's error).
    pub(crate) fn early_by(
        &self,
        tick: u64,
        tolerance: Duration,
        now: Instant,
    ) -> Option<Duration> {
        let due = Duration::from_secs(tick).saturating_sub(tolerance);
        let wait = due.saturating_sub(self.earliest(now));
        (!wait.is_zero()).then_some(wait)
    }

    /// The database's clock at `now`, in whole Unix seconds (the latest second it has
    /// certainly reached).
    pub(crate) fn unix_secs(&self, now: Instant) -> u64 {
        self.earliest(now).as_secs()
    }

    fn is_fresh(&self, now: Instant) -> bool {
        now.saturating_duration_since(self.at) < REFRESH
    }
}

/// How far this node's wall clock is from the database's, when it is further than the
/// tolerance allows: what the warning says.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Offset {
    /// This node's clock minus the database's, in seconds: positive when it is ahead.
    pub(crate) seconds: f64,
}

/// The latest reading, shared by every clone of a ledger.
#[derive(Debug, Default)]
pub(crate) struct DbClock {
    state: Mutex<State>,
    /// Held while a reading is taken: ticks that find the reading stale together wait
    /// for one new reading rather than each taking its own.
    pub(crate) reading: tokio::sync::Mutex<()>,
}

#[derive(Debug, Default)]
struct State {
    reading: Option<Reading>,
    warned: Option<Instant>,
}

impl DbClock {
    /// The latest reading, if it is recent enough to carry forward to `now`.
    pub(crate) fn fresh(&self, now: Instant) -> Option<Reading> {
        let state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.reading.filter(|r| r.is_fresh(now))
    }

    /// Keeps `reading`, taken when this node's wall clock read `wall`, and says how far
    /// off that clock is when it is further than `tolerance` (beyond the reading's own
    /// error) and no warning was given in the last [`WARN_EVERY`].
    pub(crate) fn keep(
        &self,
        reading: Reading,
        wall: SystemTime,
        tolerance: Duration,
    ) -> Option<Offset> {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.reading = Some(reading);
        let wall = wall.duration_since(UNIX_EPOCH).unwrap_or_default();
        let db = reading.estimate(reading.at);
        let (ahead, apart) = if wall >= db {
            (true, wall - db)
        } else {
            (false, db - wall)
        };
        if apart <= tolerance + reading.error {
            return None;
        }
        if state
            .warned
            .is_some_and(|w| reading.at.saturating_duration_since(w) < WARN_EVERY)
        {
            return None;
        }
        state.warned = Some(reading.at);
        let seconds = apart.as_secs_f64();
        Some(Offset {
            seconds: if ahead { seconds } else { -seconds },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at_unix(secs: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(secs)
    }

    #[test]
    fn a_reading_is_the_middle_of_its_round_trip_carried_forward() {
        let sent = Instant::now();
        let received = sent + Duration::from_millis(200);
        let r = Reading::new(at_unix(1_000), sent, received);
        assert_eq!(r.estimate(received), Duration::from_millis(1_000_100));
        assert_eq!(
            r.estimate(received + Duration::from_secs(5)),
            Duration::from_millis(1_005_100)
        );
        // Whole seconds certainly reached: the earliest reading, 1000.0 s at receipt.
        assert_eq!(r.unix_secs(received), 1_000);
        assert_eq!(r.unix_secs(received + Duration::from_millis(999)), 1_000);
        assert_eq!(r.unix_secs(received + Duration::from_secs(1)), 1_001);
    }

    #[test]
    fn a_tick_is_due_once_the_earliest_database_time_reaches_it_less_the_tolerance() {
        let sent = Instant::now();
        let received = sent + Duration::from_millis(100);
        // The database read 1000 s during the round trip: it reads 1000.0..=1000.1 now.
        let r = Reading::new(at_unix(1_000), sent, received);
        let tol = Duration::from_secs(1);
        assert_eq!(r.early_by(1_000, tol, received), None);
        assert_eq!(r.early_by(1_001, tol, received), None);
        assert_eq!(
            r.early_by(1_002, tol, received),
            Some(Duration::from_secs(1))
        );
        assert_eq!(
            r.early_by(1_600, Duration::ZERO, received),
            Some(Duration::from_secs(600))
        );
        // Carried forward: due once the monotonic clock has moved on as far.
        assert_eq!(
            r.early_by(1_600, Duration::ZERO, received + Duration::from_secs(600)),
            None
        );
        // A tick far in the past is due, and nothing overflows.
        assert_eq!(r.early_by(0, Duration::MAX, received), None);
    }

    #[test]
    fn readings_older_than_the_refresh_are_not_carried_forward() {
        let clock = DbClock::default();
        let t = Instant::now();
        assert_eq!(clock.fresh(t), None);
        let r = Reading::new(at_unix(1_000), t, t);
        assert_eq!(clock.keep(r, at_unix(1_000), Duration::from_secs(1)), None);
        assert_eq!(clock.fresh(t + REFRESH - Duration::from_millis(1)), Some(r));
        assert_eq!(clock.fresh(t + REFRESH), None);
    }

    #[test]
    fn a_clock_off_by_more_than_the_tolerance_is_reported_with_its_sign_then_rate_limited() {
        let clock = DbClock::default();
        let tol = Duration::from_secs(1);
        let t = Instant::now();
        let r = Reading::new(at_unix(1_000), t, t);
        // Within the tolerance: nothing to say.
        assert_eq!(clock.keep(r, at_unix(1_001), tol), None);
        // Ten minutes ahead.
        let off = clock.keep(r, at_unix(1_600), tol).expect("reported");
        assert!((off.seconds - 600.0).abs() < 1e-9, "{off:?}");
        // Not again within WARN_EVERY, even behind.
        let later = Reading::new(
            at_unix(1_100),
            t + Duration::from_secs(100),
            t + Duration::from_secs(100),
        );
        assert_eq!(clock.keep(later, at_unix(1_000), tol), None);
        let much_later = t + WARN_EVERY;
        let r = Reading::new(at_unix(2_000), much_later, much_later);
        let off = clock.keep(r, at_unix(1_990), tol).expect("reported again");
        assert!((off.seconds + 10.0).abs() < 1e-9, "{off:?}");
        // The reading's own error widens the tolerance.
        let clock = DbClock::default();
        let r = Reading::new(at_unix(1_000), t, t + Duration::from_secs(4));
        assert_eq!(clock.keep(r, at_unix(1_004), tol), None);
    }
}
