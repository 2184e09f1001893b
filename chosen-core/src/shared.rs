//! State shared between the manager's task and every handle: the watchdog deadline
//! lives here so that lease checks are correct even when the task is starved.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::key::SessionLock;
use crate::options::ManagerOptions;
use crate::status::ConnectionState;

/// The advisory locks the session holds for certain (taken by statements already
/// answered, their release not yet sent), and an epoch that grows whenever one of them
/// is to be released, with the locks each of the last such lowerings removed: the
/// heartbeat's guard checks that every lock of the set it read before it was sent is
/// still on the session when it ran, but for those released since (see
/// `Pulse::answered`). It checks which locks, not how many: a count would let a key
/// taken after another client released the session's locks make up for one released.
///
/// Locks a statement still on its way takes are in no floor yet, and another client may
/// release them before a heartbeat runs, which then cannot tell they were there: while
/// such a statement is unanswered, a heartbeat's answer proves the session no later
/// than that statement's send (`taking_since`; the release came after it).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct ServerFloor {
    epoch: u64,
    /// Sorted, without repeats.
    held: Arc<[SessionLock]>,
    /// When the oldest statement that may take locks, not yet answered, was sent.
    taking_since: Option<Instant>,
    /// `(epoch, locks removed)` of the last lowerings, oldest first.
    lows: std::collections::VecDeque<(u64, Vec<SessionLock>)>,
}

/// What a heartbeat read of the [`ServerFloor`] before it was sent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct FloorRead {
    pub(crate) epoch: u64,
    /// The locks held for certain then.
    pub(crate) held: Arc<[SessionLock]>,
    /// A statement that may take locks was on its way since then.
    pub(crate) taking_since: Option<Instant>,
}

/// How many lowerings [`ServerFloor`] remembers: a heartbeat answered after more than
/// that many is not judged.
const KEPT_LOWERINGS: usize = 64;

impl ServerFloor {
    /// The session holds `held` for certain from now on; set *before* a statement that
    /// releases some of the locks held so far is sent.
    pub(crate) fn set(&mut self, mut held: Vec<SessionLock>) {
        held.sort_unstable();
        held.dedup();
        if *self.held == *held {
            return;
        }
        let removed: Vec<SessionLock> = self
            .held
            .iter()
            .filter(|l| held.binary_search(l).is_err())
            .copied()
            .collect();
        if !removed.is_empty() {
            self.epoch += 1;
            self.lows.push_back((self.epoch, removed));
            if self.lows.len() > KEPT_LOWERINGS {
                self.lows.pop_front();
            }
        }
        self.held = held.into();
    }

    /// A statement that may take locks is sent at `at` (`Some`, set before it is
    /// sent), or the last one's answer was applied to the floor (`None`).
    pub(crate) fn taking(&mut self, at: Option<Instant>) {
        self.taking_since = match at {
            Some(at) => Some(self.taking_since.map_or(at, |since| since.min(at))),
            None => None,
        };
    }

    /// What a heartbeat reads before it is sent.
    pub(crate) fn get(&self) -> FloorRead {
        FloorRead {
            epoch: self.epoch,
            held: Arc::clone(&self.held),
            taking_since: self.taking_since,
        }
    }

    /// The locks of `read` (read at `epoch`) that the server's lock table `on_server`
    /// (sorted) lacks, though none of them was released since: a statement that ran
    /// after the read found every lock of `read` on the session, but for those, unless
    /// another client released them. `None` when too many lowerings ago to tell.
    pub(crate) fn missing_since(
        &self,
        epoch: u64,
        read: &[SessionLock],
        on_server: &[SessionLock],
    ) -> Option<Vec<SessionLock>> {
        if epoch != self.epoch {
            let oldest_kept = self.lows.front().map_or(self.epoch + 1, |(e, _)| *e);
            if epoch + 1 < oldest_kept {
                return None;
            }
        }
        let released = |l: &SessionLock| {
            self.lows
                .iter()
                .filter(|(e, _)| *e > epoch)
                .any(|(_, removed)| removed.binary_search(l).is_ok())
        };
        Some(
            read.iter()
                .filter(|l| on_server.binary_search(l).is_err() && !released(l))
                .copied()
                .collect(),
        )
    }
}

#[cfg(test)]
mod floor_tests {
    use super::{FloorRead, ServerFloor, SessionLock};
    use crate::key::LockKey;

    fn lock(n: i32) -> SessionLock {
        SessionLock {
            key: LockKey::Pair(0, n),
            exclusive: true,
        }
    }

    fn locks(ns: impl IntoIterator<Item = i32>) -> Vec<SessionLock> {
        ns.into_iter().map(lock).collect()
    }

    #[test]
    fn a_lock_missing_from_the_server_is_found_unless_released_since_the_read() {
        let mut f = ServerFloor::default();
        f.set(locks([3, 1, 2]));
        let FloorRead {
            epoch, held: read, ..
        } = f.get();
        assert_eq!(&*read, &locks([1, 2, 3])[..], "sorted");
        assert_eq!(
            f.missing_since(epoch, &read, &locks([1, 2, 3])),
            Some(vec![])
        );
        // Another client released 2; a key taken since (9) does not make up for it.
        assert_eq!(
            f.missing_since(epoch, &read, &locks([1, 3, 9])),
            Some(locks([2]))
        );
        // The same lock held shared is not the lock held exclusively.
        let shared = SessionLock {
            key: LockKey::Pair(0, 2),
            exclusive: false,
        };
        let mut on_server = locks([1, 3]);
        on_server.push(shared);
        on_server.sort_unstable();
        assert_eq!(f.missing_since(epoch, &read, &on_server), Some(locks([2])));
        // Released (and taken again) since the read: not required any more.
        f.set(locks([1, 3]));
        f.set(locks([1, 2, 3, 4]));
        assert_eq!(f.missing_since(epoch, &read, &locks([1, 3])), Some(vec![]));
        assert_eq!(f.missing_since(epoch, &read, &locks([3])), Some(locks([1])));
    }

    #[test]
    fn lowerings_are_remembered_for_the_last_64() {
        let mut f = ServerFloor::default();
        f.set(locks(0..100));
        let FloorRead {
            epoch, held: read, ..
        } = f.get();
        for i in 0..64 {
            f.set(locks((0..100).filter(|n| *n != i)));
        }
        assert_eq!(
            f.missing_since(epoch, &read, &locks(64..100)),
            Some(vec![]),
            "all 64 remembered"
        );
        // One more: the oldest needed is forgotten, so nothing is claimed.
        f.set(locks((0..100).filter(|n| *n != 64)));
        assert_eq!(f.missing_since(epoch, &read, &[]), None);
        // A read after the forgotten ones is judged again.
        let FloorRead {
            epoch, held: read, ..
        } = f.get();
        f.set(locks(0..10));
        assert_eq!(
            f.missing_since(epoch, &read, &locks(0..5)),
            Some(locks(5..10))
        );
        // Setting the same set again is no lowering.
        let FloorRead {
            epoch, held: read, ..
        } = f.get();
        f.set(locks(0..10));
        assert_eq!(f.get().epoch, epoch);
        assert_eq!(f.missing_since(epoch, &read, &[]), Some(locks(0..10)));
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
    /// The advisory locks the session holds for certain, and an epoch that grows
    /// whenever one of them is to be released (before the statement that releases it is
    /// sent), for the heartbeat's check that nothing released them behind the
    /// manager's back.
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
            epoch: crate::clock::now(),
            valid_until: AtomicU64::new(0),
            next_id: AtomicU64::new(1),
            status: watch::Sender::new(status),
            server_floor: std::sync::Mutex::new(ServerFloor::default()),
            closing: CancellationToken::new(),
            tasks: TaskTracker::new(),
        }
    }

    /// Records the advisory locks the session holds for certain, and whether a
    /// statement that may take more is on its way (sent at `taking`, `Some` only just
    /// before it is sent: see [`ServerFloor::taking`]).
    pub(crate) fn set_server_floor(&self, floor: Vec<SessionLock>, taking: Option<Instant>) {
        let mut f = self
            .server_floor
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        f.set(floor);
        f.taking(taking);
    }

    /// The floor as a heartbeat reads it before it is sent: see [`Self::set_server_floor`].
    pub(crate) fn server_floor(&self) -> FloorRead {
        self.server_floor
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get()
    }

    /// Reads the floor and its recent lowerings (see [`ServerFloor::missing_since`]).
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
                let now = self.nanos(now.max(crate::clock::now()));
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
        // Compared as offsets from the epoch: a reading before the epoch (a clock
        // behind the one the epoch was read on) counts as the epoch, so an invalidated
        // validity (0) is never valid, whatever clock reads it.
        self.nanos(crate::clock::now()) < self.valid_until.load(Ordering::Acquire)
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

    /// Validity read on a clock behind the one its epoch was read on (a paused
    /// runtime's, with the shared state made outside it): an invalidated validity is
    /// still invalid, and a deadline is still compared with its own clock.
    #[test]
    fn an_invalidated_validity_is_invalid_on_a_clock_behind_its_epoch() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap();
        std::thread::sleep(Duration::from_millis(50));
        let shared = shared();
        shared.invalidate();
        assert!(!rt.block_on(async { shared.is_valid_now() }));
        assert!(!shared.is_valid_now());
        let virtual_now = rt.block_on(async { crate::clock::now() });
        shared.extend_validity(virtual_now + Duration::from_millis(10));
        assert!(
            !rt.block_on(async { shared.is_valid_now() }),
            "a deadline before the epoch is passed"
        );
        shared.extend_validity(virtual_now + s(1));
        assert!(
            rt.block_on(async { shared.is_valid_now() }),
            "valid until its deadline"
        );
        rt.block_on(async { tokio::time::sleep(s(1)).await });
        assert!(
            !rt.block_on(async { shared.is_valid_now() }),
            "and no longer"
        );
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
