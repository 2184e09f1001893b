//! State shared between the manager's task and every handle: the watchdog deadline
//! lives here so that lease checks are correct even when the task is starved.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::options::ManagerOptions;
use crate::status::ConnectionState;

/// How many advisory locks the session holds at least, and an epoch that grows
/// whenever that number falls, with the floors set by the last lowerings: the
/// heartbeat's pooler guard judges a lock count against the lowest floor in effect
/// since it read the floor (see `Pulse::answered`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct ServerFloor {
    epoch: u64,
    floor: usize,
    /// `(epoch, floor)` of the last lowerings, oldest first.
    lows: std::collections::VecDeque<(u64, usize)>,
}

/// How many lowerings [`ServerFloor`] remembers: a heartbeat answered after more than
/// that many is not judged.
const KEPT_LOWERINGS: usize = 64;

impl ServerFloor {
    /// The session holds at least `floor` locks from now on; set *before* the statement
    /// that lowers it is sent.
    pub(crate) fn set(&mut self, floor: usize) {
        if floor < self.floor {
            self.epoch += 1;
            self.lows.push_back((self.epoch, floor));
            if self.lows.len() > KEPT_LOWERINGS {
                self.lows.pop_front();
            }
        }
        self.floor = floor;
    }

    /// `(epoch, floor)`.
    pub(crate) fn get(&self) -> (u64, usize) {
        (self.epoch, self.floor)
    }

    /// The lowest floor in effect at any time since `(epoch, floor)` was read: a
    /// statement that ran in between found at least that many locks on the session,
    /// unless another client released them. `None` when too many lowerings ago to tell.
    pub(crate) fn lowest_since(&self, epoch: u64, floor: usize) -> Option<usize> {
        if epoch == self.epoch {
            return Some(floor);
        }
        let oldest_kept = self.lows.front().map_or(self.epoch + 1, |(e, _)| *e);
        if epoch + 1 < oldest_kept {
            return None;
        }
        Some(
            self.lows
                .iter()
                .filter(|(e, _)| *e > epoch)
                .map(|(_, f)| *f)
                .fold(floor, usize::min),
        )
    }
}

#[cfg(test)]
mod floor_tests {
    use super::ServerFloor;

    #[test]
    fn the_lowest_floor_since_a_read_is_known_for_the_last_64_lowerings() {
        let mut f = ServerFloor::default();
        f.set(10);
        let (epoch, floor) = f.get();
        assert_eq!(f.lowest_since(epoch, floor), Some(10), "nothing since");
        // A rise, then a lowering below the read, then a rise again.
        f.set(12);
        f.set(4);
        f.set(9);
        assert_eq!(f.lowest_since(epoch, floor), Some(4));
        // 64 lowerings since the read: all remembered.
        let mut f = ServerFloor::default();
        f.set(100);
        let (epoch, floor) = f.get();
        for i in 0..64 {
            f.set(90 - i);
            f.set(100);
        }
        assert_eq!(f.lowest_since(epoch, floor), Some(27));
        // One more: the oldest needed is forgotten, so nothing is claimed.
        f.set(50);
        assert_eq!(f.lowest_since(epoch, floor), None);
        // A read after the forgotten ones is judged again.
        let (epoch, floor) = f.get();
        f.set(40);
        assert_eq!(f.lowest_since(epoch, floor), Some(40));
    }
}

#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) options: ManagerOptions,
    epoch: Instant,
    /// Leases are trusted strictly before this instant (nanoseconds since `epoch`).
    valid_until: AtomicU64,
    next_id: AtomicU64,
    pub(crate) status: watch::Sender<ConnectionState>,
    /// How many advisory locks the session holds at least, and an epoch that grows
    /// whenever that number falls (before the statement that lowers it is sent), for the
    /// heartbeat's check that nothing released them behind the manager's back.
    server_floor: std::sync::Mutex<ServerFloor>,
    /// Cancelled when [`LockManager::shutdown`](crate::LockManager::shutdown) begins;
    /// every singleton's and election's stop token is a child of it.
    pub(crate) closing: CancellationToken,
    /// The supervisor tasks of the singletons and elections started from this manager,
    /// which the shutdown waits for before it closes the session.
    pub(crate) tasks: TaskTracker,
}

impl Shared {
    pub(crate) fn new(options: ManagerOptions, status: ConnectionState) -> Self {
        Self {
            options,
            epoch: Instant::now(),
            valid_until: AtomicU64::new(0),
            next_id: AtomicU64::new(1),
            status: watch::Sender::new(status),
            server_floor: std::sync::Mutex::new(ServerFloor::default()),
            closing: CancellationToken::new(),
            tasks: TaskTracker::new(),
        }
    }

    /// Records how many advisory locks the session holds at least.
    pub(crate) fn set_server_floor(&self, floor: usize) {
        self.server_floor
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .set(floor);
    }

    /// `(epoch, floor)`: see [`Self::set_server_floor`].
    pub(crate) fn server_floor(&self) -> (u64, usize) {
        self.server_floor
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get()
    }

    /// Reads the floor and its recent lowerings (see [`ServerFloor::lowest_since`]).
    pub(crate) fn with_server_floor<R>(&self, f: impl FnOnce(&ServerFloor) -> R) -> R {
        f(&self
            .server_floor
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner))
    }

    /// The next instant after `now` on a grid of `period` shared by everything of this
    /// manager: periodic work aligned on it (the elections' leader look-ups) reaches the
    /// manager's task together and shares one statement.
    pub(crate) fn next_shared_tick(&self, period: Duration, now: Instant) -> Instant {
        let period_ns = period.as_nanos().max(1);
        let since = now.saturating_duration_since(self.epoch).as_nanos();
        let ticks = since / period_ns + 1;
        let offset = u64::try_from(ticks.saturating_mul(period_ns)).unwrap_or(u64::MAX);
        self.epoch + Duration::from_nanos(offset)
    }

    pub(crate) fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    fn nanos(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.epoch).as_nanos()).unwrap_or(u64::MAX)
    }

    /// Leases may be trusted until `deadline` (never moves backwards while a session is up).
    pub(crate) fn extend_validity(&self, deadline: Instant) {
        self.valid_until
            .fetch_max(self.nanos(deadline), Ordering::AcqRel);
    }

    /// Renews validity after a heartbeat: moves the deadline to `deadline` unless it has
    /// already passed at `now` (an expired session stays expired, so `is_valid()` never
    /// turns true again after `lost()` resolved). Returns whether it renewed.
    pub(crate) fn renew_validity(&self, deadline: Instant, now: Instant) -> bool {
        let deadline = self.nanos(deadline);
        self.valid_until
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |current| {
                // The clock is read here, not only by the caller: a thread paused between
                // its reading and this update must not revive validity that lapsed (and
                // was reported lost) meanwhile.
                let now = self.nanos(now.max(Instant::now()));
                (current > now).then_some(current.max(deadline))
            })
            .is_ok()
    }

    /// Distrust every lease now (before they are told they are revoked).
    pub(crate) fn invalidate(&self) {
        self.valid_until.store(0, Ordering::Release);
    }

    pub(crate) fn valid_until(&self) -> Instant {
        self.epoch + Duration::from_nanos(self.valid_until.load(Ordering::Acquire))
    }

    pub(crate) fn is_valid_now(&self) -> bool {
        Instant::now() < self.valid_until()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shared() -> Shared {
        let options = ManagerOptions::from_url("postgres://test@localhost/test")
            .expect("BUG: static URL parses");
        Shared::new(options, ConnectionState::Connecting { attempt: 1 })
    }

    fn s(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    #[test]
    fn a_late_answer_of_an_earlier_heartbeat_never_shortens_validity() {
        let shared = shared();
        let t0 = Instant::now();
        shared.extend_validity(t0 + s(3));
        // The later heartbeat's answer is handled first...
        assert!(shared.renew_validity(t0 + s(5), t0 + s(2)));
        // ...then the earlier one's: still renewed (the session is alive), not shortened.
        assert!(shared.renew_validity(t0 + s(4), t0 + s(2)));
        assert_eq!(shared.valid_until(), t0 + s(5));
    }

    #[test]
    fn an_answer_after_validity_lapsed_does_not_revive_it() {
        let shared = shared();
        let t0 = Instant::now();
        shared.extend_validity(t0 + s(3));
        // Exactly at the deadline is already too late.
        assert!(!shared.renew_validity(t0 + s(6), t0 + s(3)));
        assert!(!shared.renew_validity(t0 + s(6), t0 + s(4)));
        assert_eq!(shared.valid_until(), t0 + s(3));
        // Nor after the session was invalidated.
        shared.extend_validity(t0 + s(10));
        shared.invalidate();
        assert!(!shared.renew_validity(t0 + s(12), t0 + s(4)));
        assert!(!shared.is_valid_now());
    }
}
