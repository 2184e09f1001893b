//! The heartbeat: its own task per session, so that nothing the manager's task does (a
//! slow statement, a flood of notifications, a burst of requests) can delay it.
//!
//! Heartbeats are pipelined: one is sent every `heartbeat_interval` whether or not the
//! earlier ones have answered (tokio-postgres pipelines queries on one `Client`; the
//! server answers them in order). So a slow database is not a dead one: leases stay
//! valid while the round trip stays below `lease_timeout - heartbeat_interval`, where
//! one heartbeat at a time lost them above `lease_timeout / 2`. (While a statement that
//! takes locks is on its way, an answer renews only from that statement's send; with
//! requests waiting, whose tries go out one poll interval after the last answer, that
//! brings the limit down to about half that. Known, to be made exact: see
//! `Pulse::answered`.)
//!
//! The rules ([`Pulse`]: when to send, how many may be on their way, what an answer
//! means) are apart from the task that carries them out ([`run`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::stream::{FuturesUnordered, StreamExt};
use tokio::time::sleep_until;
use tracing::{debug, warn};

use crate::backend::HeartbeatLink;
use crate::clock::far_future;
use crate::generation::Generation;
use crate::key::SessionLock;
use crate::shared::{FloorRead, ServerFloor, Shared};
use crate::status::SessionDownReason;

/// However the settings compare, never more heartbeats than this on their way at once
/// (it bounds memory; with any sane settings the bound from the lease timeout is lower).
const MAX_IN_FLIGHT: usize = 1024;

/// At most one warning about slow heartbeats per this long.
const SLOW_WARNING_EVERY: Duration = Duration::from_secs(30);

/// Proves the session alive every heartbeat interval, on its own task, so nothing the
/// manager's task does can delay it. Each success extends the leases' validity from
/// the moment *its own* query was sent; a failure, or no success within the lease
/// timeout, revokes the generation at once.
pub(crate) async fn run(
    session: Box<dyn HeartbeatLink>,
    shared: Arc<Shared>,
    generation: Arc<Generation>,
    proven_at: Instant,
) {
    let lease_timeout = shared.options.lease_timeout;
    let mut pulse = Pulse::new(proven_at, shared.options.heartbeat_interval, lease_timeout);
    let revoke = |reason: SessionDownReason| {
        // Already revoked (the driver ended this generation and may have started the
        // next one, whose validity this must not wipe): nothing to do.
        if generation.revoked.is_cancelled() {
            return;
        }
        shared.invalidate();
        generation.revoke(reason);
    };
    let overdue = || SessionDownReason::HeartbeatOverdue { lease_timeout };
    let session = &session;
    // Declared after `session`, which its futures borrow. Dropping it (the task ends or
    // is aborted) drops the queries' futures; their replies are then discarded.
    let mut in_flight = FuturesUnordered::new();
    loop {
        let watchdog = tokio::time::Instant::from_std(shared.valid_until());
        let next = pulse.next_send().map(tokio::time::Instant::from_std);
        tokio::select! {
            biased;
            () = generation.revoked.cancelled() => return,
            // No success within the lease timeout (even if replies are on their way).
            () = sleep_until(watchdog) => return revoke(overdue()),
            Some((beat, answer)) = in_flight.next(), if !in_flight.is_empty() => {
                let now = crate::clock::now();
                // Sorted before the floor's lock is taken (the task waits for it).
                let mut answer: Result<Vec<SessionLock>, SessionDownReason> = answer;
                if let Ok(locks) = answer.as_mut() {
                    locks.sort_unstable();
                }
                match shared.with_server_floor(|floors| pulse.answered(&beat, answer, floors, now)) {
                    Verdict::Renew { until, rtt, slow } => {
                        if !shared.renew_validity(until, now) {
                            // The deadline passed while the reply was on its way: too late.
                            return revoke(overdue());
                        }
                        if let Some(m) = shared.options.metrics.as_deref() {
                            m.heartbeat(&shared.options.node_id, rtt);
                        }
                        debug!(rtt_us = rtt.as_micros() as u64, in_flight = in_flight.len(), "heartbeat");
                        if let Some(slow) = slow {
                            warn!(
                                node_id = %shared.options.node_id,
                                rtt_ms = rtt.as_millis() as u64,
                                warn_above_ms = slow.warn_above.as_millis() as u64,
                                limit_ms = slow.limit.as_millis() as u64,
                                slow_since_last_warning = slow.since_last_warning,
                                "heartbeat round trip above half the lease timeout; leases are lost if round trips reach the limit (lease_timeout - heartbeat_interval)"
                            );
                        }
                    }
                    Verdict::Revoke(reason) => return revoke(session.explain(reason)),
                    Verdict::Unjudged { rtt } => {
                        warn!(node_id = %shared.options.node_id, rtt_ms = rtt.as_millis() as u64, "heartbeat answered after more lock releases than are remembered (the heartbeat task was starved): it renews nothing");
                    }
                }
            }
            () = sleep_until(next.unwrap_or_else(far_future)), if next.is_some() => {
                // Read before the query is sent (it goes out when `in_flight` first polls
                // it): validity counts from no later than the send, and the lock floor
                // holds for the server's state when the query runs (see `Pulse::answered`).
                let beat = pulse.send(crate::clock::now(), shared.server_floor());
                in_flight.push(async move { (beat, session.heartbeat().await) });
            }
        }
    }
}

/// The heartbeat's rules, apart from its I/O: when the next heartbeat is due, how many
/// may be on their way, and what an answer means.
#[derive(Debug)]
pub(crate) struct Pulse {
    interval: Duration,
    lease_timeout: Duration,
    /// `ceil(lease_timeout / interval) + 1`: more could not help. A heartbeat still
    /// unanswered `lease_timeout` after it was sent means validity has lapsed (answers
    /// come back in order, so every success was sent before it).
    max_in_flight: usize,
    in_flight: usize,
    /// When the next heartbeat is due (on a fixed grid, whatever the answers do).
    next: Instant,
    /// Round trips above half the lease timeout: when the last warning was given, and
    /// how many slow ones came since.
    last_warning: Option<Instant>,
    slow_since_warning: u64,
    /// The lock guard switched off (`Protection::LockGuard`), in tests only.
    #[cfg(test)]
    guard_off: bool,
    /// Statements in flight ignored (`Protection::TakesInFlight`), in tests only.
    #[cfg(test)]
    takes_off: bool,
}

/// One heartbeat on its way: when it was sent, and the lock floor (see
/// [`Shared::set_server_floor`]) read just before.
#[derive(Clone, Debug)]
pub(crate) struct Beat {
    sent: Instant,
    floor: FloorRead,
}

/// What an answer means.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Extend validity to `until` (unless it already lapsed: then the answer is too late).
    Renew {
        until: Instant,
        rtt: Duration,
        /// Set when a slow round trip should be reported now (rate-limited).
        slow: Option<SlowWarning>,
    },
    /// End the session.
    Revoke(SessionDownReason),
    /// Renew nothing: answered after more lowerings of the floor than are remembered,
    /// so what it shows cannot be judged.
    Unjudged { rtt: Duration },
}

/// A warning about slow heartbeats is due.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct SlowWarning {
    /// Half the lease timeout.
    warn_above: Duration,
    /// The round trip at which leases are lost: `lease_timeout - heartbeat_interval`.
    limit: Duration,
    /// Slow round trips since the last warning, this one included.
    since_last_warning: u64,
}

impl Pulse {
    /// The first heartbeat is due one interval after the session was proven.
    pub(crate) fn new(proven_at: Instant, interval: Duration, lease_timeout: Duration) -> Self {
        let max_in_flight = lease_timeout
            .as_nanos()
            .div_ceil(interval.as_nanos().max(1))
            .saturating_add(1);
        Self {
            interval,
            lease_timeout,
            max_in_flight: usize::try_from(max_in_flight)
                .unwrap_or(usize::MAX)
                .min(MAX_IN_FLIGHT),
            in_flight: 0,
            next: proven_at.checked_add(interval).unwrap_or(proven_at),
            last_warning: None,
            slow_since_warning: 0,
            #[cfg(test)]
            guard_off: false,
            #[cfg(test)]
            takes_off: false,
        }
    }

    /// Switches the lock guard off, to show that the simulation fails without it.
    #[cfg(test)]
    pub(crate) fn switch_off_lock_guard(&mut self) {
        self.guard_off = true;
    }

    /// Makes answers renew from their own send even while a statement that may take
    /// locks is unanswered, to show that the simulation fails then.
    #[cfg(test)]
    pub(crate) fn switch_off_takes_in_flight(&mut self) {
        self.takes_off = true;
    }

    /// Are statements in flight ignored? Never outside tests.
    fn takes_off(&self) -> bool {
        #[cfg(test)]
        return self.takes_off;
        #[cfg(not(test))]
        false
    }

    /// Is the lock guard switched off? Never outside tests.
    fn guard_off(&self) -> bool {
        #[cfg(test)]
        return self.guard_off;
        #[cfg(not(test))]
        false
    }

    /// When the next heartbeat is due; `None` while the most allowed are on their way
    /// (then it is due as soon as one answers).
    pub(crate) fn next_send(&self) -> Option<Instant> {
        (self.in_flight < self.max_in_flight).then_some(self.next)
    }

    /// A heartbeat is sent at `now` (read before the floor: a statement sent after this
    /// read and queued before the heartbeat took its locks after `now`), after reading
    /// the lock floor.
    pub(crate) fn send(&mut self, now: Instant, floor: FloorRead) -> Beat {
        self.in_flight += 1;
        // On the grid; but after a stall (a freeze, a full pipeline) start again from
        // now rather than sending the missed ones in a burst.
        self.next = self
            .next
            .checked_add(self.interval)
            .filter(|next| *next > now)
            .or_else(|| now.checked_add(self.interval))
            .unwrap_or(now);
        Beat { sent: now, floor }
    }

    /// The answer to `beat` arrived at `now` (the session's advisory locks as the
    /// server's lock table showed them when it ran); `floors` is the lock floor as the
    /// task keeps it now.
    ///
    /// Every lock of the floor this heartbeat read was taken by a statement already
    /// answered, so before this query ran (the server runs one session's statements in
    /// order), and a lock leaves the floor before the statement that releases it is
    /// sent; so when the query ran, the session held every lock of that floor but
    /// those released since (`floors` remembers which). One missing means another client
    /// released it. The check is by lock, not by count: a key the session took after
    /// such a release (a try, an interest key) cannot make up for the one released.
    ///
    /// Locks taken by a statement still unanswered when the floor was read are in no
    /// floor, and another client may have released them before this query ran: then the
    /// answer proves the session no later than that statement's send (the release came
    /// after the take), and validity is renewed from there. A heartbeat answered after
    /// more lowerings than are remembered cannot be judged, and renews nothing.
    pub(crate) fn answered(
        &mut self,
        beat: &Beat,
        answer: Result<Vec<SessionLock>, SessionDownReason>,
        floors: &ServerFloor,
        now: Instant,
    ) -> Verdict {
        self.in_flight = self.in_flight.saturating_sub(1);
        let mut on_server = match answer {
            Ok(locks) => locks,
            Err(reason) => return Verdict::Revoke(reason),
        };
        on_server.sort_unstable();
        let rtt = now.saturating_duration_since(beat.sent);
        let Some(missing) = floors.missing_since(beat.floor.epoch, &beat.floor.held, &on_server)
        else {
            return Verdict::Unjudged { rtt };
        };
        if let Some(first) = missing.first()
            && !self.guard_off()
        {
            return Verdict::Revoke(SessionDownReason::PoolerDetected {
                detail: format!(
                    "the server no longer shows {} of the advisory locks this session holds (key {} among them): another client released them (a transaction pooler sharing the backend, DISCARD ALL, pg_advisory_unlock_all)",
                    missing.len(),
                    first.key
                ),
            });
        }
        let from = beat
            .floor
            .taking_since
            .filter(|_| !self.takes_off())
            .map_or(beat.sent, |since| since.min(beat.sent));
        Verdict::Renew {
            until: from.checked_add(self.lease_timeout).unwrap_or(from),
            rtt,
            slow: self.slow(rtt, now),
        }
    }

    /// Counts a round trip above half the lease timeout; a warning is due for the first
    /// one and then at most once per [`SLOW_WARNING_EVERY`].
    fn slow(&mut self, rtt: Duration, now: Instant) -> Option<SlowWarning> {
        let warn_above = self.lease_timeout / 2;
        if rtt <= warn_above {
            return None;
        }
        self.slow_since_warning += 1;
        if self
            .last_warning
            .is_some_and(|at| now.saturating_duration_since(at) < SLOW_WARNING_EVERY)
        {
            return None;
        }
        self.last_warning = Some(now);
        Some(SlowWarning {
            warn_above,
            limit: self.lease_timeout.saturating_sub(self.interval),
            since_last_warning: std::mem::take(&mut self.slow_since_warning),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shared::Shared;

    const INTERVAL: Duration = Duration::from_secs(1);
    const LEASE: Duration = Duration::from_secs(3);

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// A floor with no lock, at epoch 0.
    fn nothing() -> FloorRead {
        ServerFloor::default().get()
    }

    fn lock(n: i32, exclusive: bool) -> SessionLock {
        SessionLock {
            key: crate::LockKey::Pair(7, n),
            exclusive,
        }
    }

    fn renewed(verdict: Verdict) -> (Instant, Duration, Option<SlowWarning>) {
        match verdict {
            Verdict::Renew { until, rtt, slow } => (until, rtt, slow),
            other => panic!("expected a renewal, got {other:?}"),
        }
    }

    #[test]
    fn sends_on_a_fixed_grid_whether_or_not_answers_come() {
        let t0 = Instant::now();
        let mut pulse = Pulse::new(t0, INTERVAL, LEASE);
        assert_eq!(pulse.next_send(), Some(t0 + INTERVAL));
        // Fired a little late: the next one stays on the grid.
        pulse.send(t0 + ms(1_003), nothing());
        assert_eq!(pulse.next_send(), Some(t0 + ms(2_000)));
        pulse.send(t0 + ms(2_000), nothing());
        assert_eq!(pulse.next_send(), Some(t0 + ms(3_000)));
    }

    #[test]
    fn never_more_in_flight_than_the_lease_timeout_can_use() {
        let t0 = Instant::now();
        let mut pulse = Pulse::new(t0, INTERVAL, LEASE);
        // ceil(3 s / 1 s) + 1 = 4.
        let beats: Vec<Beat> = (1..=4)
            .map(|i| pulse.send(t0 + INTERVAL * i, nothing()))
            .collect();
        assert_eq!(pulse.next_send(), None, "at the bound");
        pulse.answered(
            &beats[0],
            Ok(vec![]),
            &ServerFloor::default(),
            t0 + ms(5_500),
        );
        // Due at once (its slot passed while the pipeline was full), and the grid goes
        // on from there.
        assert_eq!(pulse.next_send(), Some(t0 + ms(5_000)));
        pulse.send(t0 + ms(5_500), nothing());
        assert_eq!(pulse.next_send(), None, "full again");
        pulse.answered(
            &beats[1],
            Ok(vec![]),
            &ServerFloor::default(),
            t0 + ms(5_600),
        );
        assert_eq!(pulse.next_send(), Some(t0 + ms(6_000)));
        // A lease timeout that is not a multiple of the interval rounds up.
        assert_eq!(Pulse::new(t0, ms(400), ms(1_000)).max_in_flight, 4);
        // Absurd ratios stay bounded.
        assert_eq!(
            Pulse::new(t0, ms(10), Duration::from_secs(24 * 3600)).max_in_flight,
            MAX_IN_FLIGHT
        );
    }

    #[test]
    fn no_burst_after_a_stall() {
        let t0 = Instant::now();
        let mut pulse = Pulse::new(t0, INTERVAL, LEASE);
        // The task ran again only 10 s late (a freeze): one heartbeat, not ten.
        pulse.send(t0 + ms(11_000), nothing());
        assert_eq!(pulse.next_send(), Some(t0 + ms(12_000)));
    }

    #[test]
    fn each_answer_renews_from_its_own_send() {
        let t0 = Instant::now();
        let mut pulse = Pulse::new(t0, INTERVAL, LEASE);
        let first = pulse.send(t0 + ms(1_000), nothing());
        let second = pulse.send(t0 + ms(2_000), nothing());
        let (until, rtt, slow) =
            renewed(pulse.answered(&first, Ok(vec![]), &ServerFloor::default(), t0 + ms(2_900)));
        assert_eq!(until, t0 + ms(4_000));
        assert_eq!(rtt, ms(1_900));
        assert!(slow.is_some(), "1.9 s is above half the lease timeout");
        let (until, _, _) =
            renewed(pulse.answered(&second, Ok(vec![]), &ServerFloor::default(), t0 + ms(3_900)));
        assert_eq!(until, t0 + ms(5_000));
    }

    #[test]
    fn an_error_revokes() {
        let t0 = Instant::now();
        let mut pulse = Pulse::new(t0, INTERVAL, LEASE);
        let beat = pulse.send(t0 + INTERVAL, nothing());
        let reason = SessionDownReason::ServerInRecovery;
        assert_eq!(
            pulse.answered(
                &beat,
                Err(reason.clone()),
                &ServerFloor::default(),
                t0 + ms(1_001)
            ),
            Verdict::Revoke(reason)
        );
        assert_eq!(pulse.in_flight, 0);
    }

    #[test]
    fn a_lock_of_the_floor_missing_at_the_server_is_a_pooler() {
        let t0 = Instant::now();
        let mut pulse = Pulse::new(t0, INTERVAL, LEASE);
        let pooler =
            |v: &Verdict| matches!(v, Verdict::Revoke(SessionDownReason::PoolerDetected { .. }));
        let mut floors = ServerFloor::default();
        floors.set(vec![lock(1, true), lock(2, false)]);
        // Sent while the session held both; nothing released since.
        let beat = pulse.send(t0 + INTERVAL, floors.get());
        assert!(pooler(&pulse.answered(
            &beat,
            Ok(vec![lock(1, true)]),
            &floors,
            t0 + ms(1_010)
        )));
        // All of them, and more (a lock won meanwhile), is fine.
        let beat = pulse.send(t0 + 2 * INTERVAL, floors.get());
        renewed(pulse.answered(
            &beat,
            Ok(vec![lock(3, true), lock(2, false), lock(1, true)]),
            &floors,
            t0 + ms(2_010),
        ));
        // One released behind the session's back, one taken since (an interest key, a
        // try): as many locks as before, but not the same ones.
        let beat = pulse.send(t0 + 3 * INTERVAL, floors.get());
        let verdict = pulse.answered(
            &beat,
            Ok(vec![lock(2, false), lock(9, false)]),
            &floors,
            t0 + ms(3_010),
        );
        assert!(pooler(&verdict), "{verdict:?}");
        // The key held shared is not the key held exclusively.
        let beat = pulse.send(t0 + 4 * INTERVAL, floors.get());
        assert!(pooler(&pulse.answered(
            &beat,
            Ok(vec![lock(1, false), lock(2, false)]),
            &floors,
            t0 + ms(4_010)
        )));
        // A release was sent after this heartbeat read the floor (the floor lowered
        // first): the server may already show it gone.
        let beat = pulse.send(t0 + 5 * INTERVAL, floors.get());
        floors.set(vec![lock(2, false)]);
        renewed(pulse.answered(&beat, Ok(vec![lock(2, false)]), &floors, t0 + ms(5_010)));
        // ... also when taken again since; but the others must still be there.
        floors.set(vec![lock(1, true), lock(2, false)]);
        let beat = pulse.send(t0 + 6 * INTERVAL, floors.get());
        floors.set(vec![lock(2, false)]);
        floors.set(vec![lock(1, true), lock(2, false)]);
        renewed(pulse.answered(&beat, Ok(vec![lock(2, false)]), &floors, t0 + ms(6_010)));
        let beat = pulse.send(t0 + 7 * INTERVAL, floors.get());
        floors.set(vec![lock(2, false)]);
        floors.set(vec![lock(1, true), lock(2, false)]);
        assert!(pooler(&pulse.answered(
            &beat,
            Ok(vec![lock(1, true)]),
            &floors,
            t0 + ms(7_010)
        )));
        // Pipelined: an earlier heartbeat read a larger floor than a later one; each is
        // judged against what was released since its own read.
        let early = pulse.send(t0 + 8 * INTERVAL, floors.get());
        floors.set(vec![lock(2, false)]);
        let late = pulse.send(t0 + 9 * INTERVAL, floors.get());
        renewed(pulse.answered(&late, Ok(vec![lock(2, false)]), &floors, t0 + ms(9_500)));
        renewed(pulse.answered(&early, Ok(vec![lock(2, false)]), &floors, t0 + ms(9_500)));
        // Answered after more lowerings than are remembered: not judged, and renews
        // nothing.
        let beat = pulse.send(t0 + 10 * INTERVAL, floors.get());
        for _ in 0..100 {
            floors.set(vec![lock(1, true), lock(2, false)]);
            floors.set(vec![lock(2, false)]);
        }
        assert_eq!(
            pulse.answered(&beat, Ok(vec![]), &floors, t0 + ms(10_010)),
            Verdict::Unjudged { rtt: ms(10) }
        );
    }

    #[test]
    fn while_a_statement_that_takes_locks_is_unanswered_an_answer_renews_from_its_send() {
        let t0 = Instant::now();
        let mut pulse = Pulse::new(t0, INTERVAL, LEASE);
        let mut floors = ServerFloor::default();
        floors.set(vec![lock(1, true)]);
        // A try is sent at 900 ms; it may win lock 2, which another client may release
        // before the heartbeat runs: the heartbeat cannot tell, so it proves the
        // session only as of the try's send.
        floors.taking(Some(t0 + ms(900)));
        let beat = pulse.send(t0 + INTERVAL, floors.get());
        // The try's answer is applied (lock 2 won) before the heartbeat's arrives.
        floors.set(vec![lock(1, true), lock(2, true)]);
        floors.taking(None);
        let (until, rtt, _) =
            renewed(pulse.answered(&beat, Ok(vec![lock(1, true)]), &floors, t0 + ms(1_100)));
        assert_eq!(until, t0 + ms(900) + LEASE);
        assert_eq!(rtt, ms(100), "the round trip is the heartbeat's own");
        // The next heartbeat reads lock 2 in the floor: its absence ends the session.
        let beat = pulse.send(t0 + 2 * INTERVAL, floors.get());
        assert!(matches!(
            pulse.answered(&beat, Ok(vec![lock(1, true)]), &floors, t0 + ms(2_010)),
            Verdict::Revoke(SessionDownReason::PoolerDetected { .. })
        ));
        // With nothing on its way, from the heartbeat's own send.
        let beat = pulse.send(t0 + 3 * INTERVAL, floors.get());
        let (until, _, _) = renewed(pulse.answered(
            &beat,
            Ok(vec![lock(2, true), lock(1, true)]),
            &floors,
            t0 + ms(3_010),
        ));
        assert_eq!(until, t0 + 3 * INTERVAL + LEASE);
        // Several statements: the oldest unanswered send counts.
        floors.taking(Some(t0 + ms(3_500)));
        floors.taking(Some(t0 + ms(3_700)));
        assert_eq!(floors.get().taking_since, Some(t0 + ms(3_500)));
    }

    #[test]
    fn slow_round_trips_warn_at_most_every_thirty_seconds() {
        let t0 = Instant::now();
        let mut pulse = Pulse::new(t0, INTERVAL, LEASE);
        let mut warnings = Vec::new();
        for i in 1..=70u32 {
            let sent = t0 + INTERVAL * i;
            let beat = pulse.send(sent, nothing());
            // Fast ones never warn; slow ones (above 1.5 s) warn at most every 30 s.
            let rtt = if i % 2 == 0 { ms(1_600) } else { ms(200) };
            let (_, _, slow) =
                renewed(pulse.answered(&beat, Ok(vec![]), &ServerFloor::default(), sent + rtt));
            if let Some(slow) = slow {
                assert_eq!(slow.warn_above, ms(1_500));
                assert_eq!(slow.limit, ms(2_000));
                warnings.push((i, slow.since_last_warning));
            }
        }
        assert_eq!(warnings, vec![(2, 1), (32, 15), (62, 15)]);
        // Exactly half is not above half.
        let beat = pulse.send(t0 + ms(100_000), nothing());
        let (_, _, slow) =
            renewed(pulse.answered(&beat, Ok(vec![]), &ServerFloor::default(), t0 + ms(101_500)));
        assert!(slow.is_none());
    }

    /// The heartbeat rules and the validity they renew, in virtual time, with every
    /// answer `rtt` after its send (in order, as the server answers a pipeline).
    /// Returns when validity lapsed, if it did within `beats` heartbeats.
    fn lapses_at(rtt: Duration, beats: u32) -> Option<Duration> {
        let options = crate::ManagerOptions::from_url("postgres://test@localhost/test")
            .expect("BUG: static URL parses");
        let shared = Shared::new(options, crate::ConnectionState::Connecting { attempt: 1 });
        let t0 = Instant::now();
        shared.extend_validity(t0 + LEASE);
        let mut pulse = Pulse::new(t0, INTERVAL, LEASE);
        let mut answers: std::collections::VecDeque<(Instant, Beat)> = Default::default();
        let mut sent = 0;
        while sent < beats || !answers.is_empty() {
            // The next event: an answer, or a send that is due.
            let answer_at = answers.front().map(|(at, _)| *at);
            let send_at = pulse.next_send().filter(|_| sent < beats);
            let now = match (answer_at, send_at) {
                (Some(a), Some(s)) => a.min(s),
                (Some(a), None) => a,
                (None, Some(s)) => s,
                (None, None) => unreachable!(),
            };
            // The watchdog.
            if now >= shared.valid_until() {
                return Some(shared.valid_until() - t0);
            }
            if answer_at == Some(now) {
                let (_, beat) = answers.pop_front().expect("BUG: an answer is due");
                let Verdict::Renew { until, .. } =
                    pulse.answered(&beat, Ok(vec![]), &ServerFloor::default(), now)
                else {
                    panic!("no pooler here");
                };
                if !shared.renew_validity(until, now) {
                    return Some(now - t0);
                }
            } else {
                let beat = pulse.send(now, nothing());
                answers.push_back((now + rtt, beat));
                sent += 1;
            }
        }
        None
    }

    #[test]
    fn round_trips_below_lease_timeout_minus_interval_keep_the_lease() {
        for rtt in [ms(1), ms(500), ms(1_500), ms(1_900), ms(1_999)] {
            assert_eq!(lapses_at(rtt, 60), None, "rtt {rtt:?}");
        }
    }

    #[test]
    fn round_trips_at_or_above_lease_timeout_minus_interval_lose_it() {
        for rtt in [ms(2_000), ms(2_500), ms(4_000)] {
            let lapsed = lapses_at(rtt, 60).unwrap_or_else(|| panic!("rtt {rtt:?} kept it"));
            // Never later than a lease timeout after the last answered send.
            assert!(lapsed <= Duration::from_secs(6), "rtt {rtt:?}: {lapsed:?}");
        }
    }

    // The server's `tcp_user_timeout` (was `server_release_after` in session.rs
    // setup_sql; now `pg::tcp_user_timeout`) counts from the ORIGINAL send time of the oldest server byte still
    // unacknowledged (Linux: retransmits_timed_out() measures from tp->retrans_stamp),
    // not from when the last heartbeat ran. With pipelining the client keeps sending
    // heartbeats that reach the server while server->client bytes are being
    // retransmitted; those heartbeats' segments carry no newer ACK. When the
    // retransmission finally gets through, the replies renew validity to the *latest*
    // heartbeat's send + lease_timeout, which can be up to ~(lease_timeout - interval)
    // after the moment the server's tcp_user_timeout clock started. If the link then
    // fails completely (the client's ACK is lost), the server drops the session (and
    // its locks) at T0 + server_release_after, while the client trusts its lease far
    // beyond that. One heartbeat at a time (main) could not do this: heartbeat k+1 is
    // sent only after reply k was read, so its segment ACKs everything before it.
    //
    // Timeline (ms), options valid per `validate()`: heartbeat 1 s, lease 10 s,
    // stop_budget 2 s, margin 0.1 s, server_release_after 12.2 s
    // (10 + 2 + 0.1 = 12.1 < 12.2).
    //   1000  hb@1000 runs, reply delivered at once (validity -> 11000)
    //   1002  server sends a NOTIFY / poll reply: LOST (server->client blackholed);
    //         T0 = 1002 is now the oldest unacked byte; RTO retransmits at
    //         T0+200, +600, +1400, +3000, +6200 (exponential backoff)
    //   2000..7000  hb@2000..hb@7000 reach the server (client->server fine), run, and
    //         their replies queue behind the unacked byte
    //   7202  server->client heals just in time for the retransmission at T0+6200:
    //         the client reads every reply; hb@7000's renews validity to 17000
    //   7203  the link fails both ways; the client's ACK never arrives
    //   13202 server: tcp_user_timeout (12.2 s since T0) -> backend ends, locks free;
    //         another node is granted at the next poll (~13.5 s)
    //   17000 client: watchdog fires; the child may run until 19000 (stop budget)
    //   => ~5.5 s of two holders. The contract needs
    //      valid_until + stop_budget + margin <= server release.
    #[test]
    fn the_lease_ends_before_a_tcp_user_timeout_counted_from_the_oldest_unacked_byte() {
        let interval = ms(1_000);
        let lease = ms(10_000);
        let stop_budget = ms(2_000);
        let margin = ms(100);
        let release = ms(12_200);
        // The invariant the options check.
        assert!(lease + stop_budget + margin < release);
        let options = crate::ManagerOptions::from_url("postgres://test@localhost/test")
            .expect("BUG: static URL parses")
            .heartbeat_interval(interval)
            .lease_timeout(lease)
            .stop_budget(stop_budget)
            .safety_margin(margin)
            .server_release_after(release);
        options
            .validate()
            .expect("the options keep the timing invariant");
        let shared = Shared::new(options, crate::ConnectionState::Connecting { attempt: 1 });
        let t0 = Instant::now();
        shared.extend_validity(t0 + lease);
        let mut pulse = Pulse::new(t0, interval, lease);

        // hb@1000: answered at once.
        let beat = pulse.send(t0 + ms(1_000), nothing());
        let (until, _, _) =
            renewed(pulse.answered(&beat, Ok(vec![]), &ServerFloor::default(), t0 + ms(1_001)));
        assert!(shared.renew_validity(until, t0 + ms(1_001)));
        // T0: the server's first byte that will stay unacknowledged.
        let oldest_unacked = t0 + ms(1_002);
        // hb@2000..hb@7000 are sent (pipelined, nothing answered in between: the
        // pipeline holds ceil(10/1)+1 = 11) and run at the server at once.
        let mut queued = Vec::new();
        for s in 2..=7u64 {
            let at = t0 + ms(1_000 * s);
            assert_eq!(
                pulse.next_send(),
                Some(at),
                "on the grid, pipeline not full"
            );
            queued.push(pulse.send(at, nothing()));
        }
        // The retransmission at T0 + 6200 delivers them all; then the link fails.
        let delivered = oldest_unacked + ms(6_200);
        for beat in queued {
            let (until, _, _) =
                renewed(pulse.answered(&beat, Ok(vec![]), &ServerFloor::default(), delivered));
            assert!(shared.renew_validity(until, delivered), "not lapsed yet");
        }
        let server_releases = oldest_unacked + crate::pg::tcp_user_timeout(&shared.options);
        let client_child_may_run_until = shared.valid_until() + stop_budget;
        assert!(
            client_child_may_run_until + margin <= server_releases,
            "lease trusted until {:?} (+ stop budget {:?} + margin {:?}) but the server's \
             tcp_user_timeout ends the session at {:?}: overlap {:?}",
            shared.valid_until() - t0,
            stop_budget,
            margin,
            server_releases - t0,
            (client_child_may_run_until + margin) - server_releases,
        );
    }
}
