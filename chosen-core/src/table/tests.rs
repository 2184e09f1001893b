//! The rules of [`LockTable`], one test each, then properties over random histories.
//! No database and no sleeps: time is an `Instant` the tests move by hand.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use proptest::prelude::*;

use super::*;

#[path = "sim.rs"]
mod sim;

const GRACE: Duration = Duration::from_millis(100);
const POLL: Duration = Duration::from_millis(300);
const MAX_FENCE: Duration = Duration::from_secs(6);

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn key(n: i32) -> LockKey {
    LockKey::Pair(7, n)
}

fn token(n: u64) -> FencingToken {
    FencingToken::new(n)
}

/// When the backend with `pid` started, in the tests (one session per pid unless a
/// test says otherwise).
fn start_of(pid: i32) -> i64 {
    1_700_000_000_000_000 + i64::from(pid)
}

/// The backend a try saw holding a key: `pid`, started at [`start_of`].
fn by(pid: i32) -> Option<Backend> {
    Some(Backend {
        pid,
        start: Some(start_of(pid)),
    })
}

/// A table with a connected session (generation 1) and a hand-moved clock.
struct Fixture {
    table: LockTable,
    now: Instant,
    next_id: RequestId,
}

impl Fixture {
    fn new() -> Self {
        Self::with_rules(Rules {
            node: 0,
            max_locks: 16,
            takeover_grace: GRACE,
            max_fence_wait: MAX_FENCE,
        })
    }

    fn with_rules(rules: Rules) -> Self {
        let now = Instant::now();
        let mut table = LockTable::new(rules, 42);
        table.session_started(1, now);
        Self {
            table,
            now,
            next_id: 1,
        }
    }

    fn request(&mut self, key: LockKey, mode: Mode, poll: Duration) -> RequestId {
        let id = self.next_id;
        self.next_id += 1;
        self.table.acquire(
            Request {
                id,
                key,
                name: Arc::from(format!("lock-{key}")),
                poll_interval: poll,
                mode,
                since: SystemTime::UNIX_EPOCH,
                enqueued: self.now,
                eager_token: true,
            },
            self.now,
        );
        id
    }

    fn wait(&mut self, key: LockKey) -> RequestId {
        self.request(key, Mode::Wait, POLL)
    }

    /// A waiting request that takes no token with its grant.
    fn wait_lazily(&mut self, key: LockKey) -> RequestId {
        let id = self.next_id;
        self.next_id += 1;
        self.table.acquire(
            Request {
                id,
                key,
                name: Arc::from(format!("lock-{key}")),
                poll_interval: POLL,
                mode: Mode::Wait,
                since: SystemTime::UNIX_EPOCH,
                enqueued: self.now,
                eager_token: false,
            },
            self.now,
        );
        id
    }

    /// Grants with their tokens as given (`None` for a lazy grant).
    fn granted_lazily(&mut self) -> Vec<(RequestId, Option<FencingToken>)> {
        self.actions()
            .into_iter()
            .filter_map(|a| match a {
                Action::Grant { id, token, .. } => Some((id, token)),
                _ => None,
            })
            .collect()
    }

    /// Token reads answered.
    fn read_answers(&mut self) -> Vec<(RequestId, Option<FencingToken>)> {
        self.actions()
            .into_iter()
            .filter_map(|a| match a {
                Action::Token { id, token, .. } => Some((id, token)),
                _ => None,
            })
            .collect()
    }

    fn try_(&mut self, key: LockKey) -> RequestId {
        self.request(key, Mode::Try, POLL)
    }

    fn advance(&mut self, by: Duration) {
        self.now += by;
    }

    fn plan(&mut self) -> Plan {
        self.table.plan(self.now)
    }

    fn actions(&mut self) -> Vec<Action> {
        std::iter::from_fn(|| self.table.poll_action()).collect()
    }

    /// Plans, expects exactly `keys` to be tried, and answers `outcome` for each (a key
    /// flagged to register interest and not won registers it, as the server would; an
    /// announcer to verify is found alive, started at [`start_of`] its pid).
    fn try_round(&mut self, keys: &[LockKey], outcome: TryOutcome) {
        self.try_round_finding(keys, outcome, |pid| Some(start_of(pid)));
    }

    /// [`Self::try_round`], the backend that has an announcer's pid now having started
    /// at `sender(pid)` (`None`: no such backend, or its start hidden).
    fn try_round_finding(
        &mut self,
        keys: &[LockKey],
        outcome: TryOutcome,
        sender: impl Fn(i32) -> Option<i64>,
    ) {
        let plan = self.plan();
        assert_eq!(plan.try_keys, keys, "tried keys");
        if matches!(outcome, TryOutcome::Held { .. }) {
            self.table.registered(&plan.register);
        }
        if matches!(outcome, TryOutcome::Won(_) | TryOutcome::WonFenced { .. }) {
            let found: Vec<_> = plan
                .verify
                .iter()
                .map(|(k, pid)| (*k, sender(*pid)))
                .collect();
            self.table.senders(&found);
        }
        let outcomes: Vec<_> = keys.iter().map(|k| (*k, outcome)).collect();
        self.table.tried(&outcomes, self.now);
    }

    /// The grace is over: plans, expects `keys` to be checked for stop fences, finds
    /// them clear.
    fn clear_fences(&mut self, keys: &[LockKey]) {
        let plan = self.plan();
        assert_eq!(plan.check, keys, "checked fences");
        let outcomes: Vec<_> = keys.iter().map(|k| (*k, FenceCheck::Clear)).collect();
        self.table.checked(&outcomes, self.now);
    }

    fn granted(&mut self) -> Vec<(RequestId, FencingToken)> {
        self.granted_lazily()
            .into_iter()
            .map(|(id, token)| (id, token.expect("eager requests get their token")))
            .collect()
    }
}

#[test]
fn a_free_lock_is_granted_on_the_first_try() {
    let mut f = Fixture::new();
    let id = f.wait(key(1));
    f.try_round(&[key(1)], TryOutcome::Won(Some(token(10))));
    assert_eq!(f.granted(), vec![(id, token(10))]);
    assert_eq!(f.table.held(), 1);
}

#[test]
fn waiters_are_served_in_order_and_a_hand_off_gets_a_larger_token() {
    let mut f = Fixture::new();
    let a = f.wait(key(1));
    let b = f.wait(key(1));
    let c = f.wait(key(1));
    f.try_round(&[key(1)], TryOutcome::Won(Some(token(10))));
    assert_eq!(f.granted(), vec![(a, token(10))]);
    f.table.release(key(1), a, f.now);
    let plan = f.plan();
    assert_eq!(plan.token_for, vec![key(1)], "a hand-off keeps the lock");
    assert!(plan.unlock.is_empty() && plan.try_keys.is_empty());
    f.table.tokens(&[key(1)], &[], Some(token(11)), f.now);
    assert_eq!(f.granted(), vec![(b, token(11))]);
    f.table.release(key(1), b, f.now);
    f.plan();
    // The token statement failed: the lock is released instead, and c tries again.
    f.table.tokens(&[key(1)], &[], None, f.now);
    assert!(f.granted().is_empty());
    let plan = f.plan();
    assert_eq!(plan.unlock, vec![key(1)]);
    f.table.unlocked(&plan.unlock, f.now);
    f.try_round(&[key(1)], TryOutcome::Won(Some(token(12))));
    assert_eq!(f.granted(), vec![(c, token(12))]);
}

#[test]
fn a_release_with_nobody_waiting_unlocks_and_forgets_the_key() {
    let mut f = Fixture::new();
    let a = f.wait(key(1));
    f.try_round(&[key(1)], TryOutcome::Won(Some(token(10))));
    f.actions();
    f.table.release(key(1), a, f.now);
    assert!(matches!(f.actions().as_slice(), [Action::Released { key: k, .. }] if *k == key(1)));
    let plan = f.plan();
    assert_eq!(plan.unlock, vec![key(1)]);
    f.table.unlocked(&plan.unlock, f.now);
    assert!(f.table.slots.is_empty());
    // Releasing twice, or a stranger's id, does nothing.
    f.table.release(key(1), a, f.now);
    f.table.release(key(1), 999, f.now);
    assert!(f.plan().is_empty());
}

#[test]
fn an_unannounced_takeover_waits_the_grace() {
    let mut f = Fixture::new();
    let a = f.wait(key(1));
    f.try_round(&[key(1)], TryOutcome::Held { by: by(4242) });
    f.advance(POLL * 2);
    f.try_round(&[key(1)], TryOutcome::Won(Some(token(10))));
    assert!(f.granted().is_empty(), "granted before the grace");
    // The interest key, no longer needed, is released at once; then the grace.
    assert_eq!(f.table.next_wakeup(f.now), Some(f.now));
    assert_eq!(f.plan().unregister, vec![key(1).interest_bucket()]);
    assert_eq!(f.table.next_wakeup(f.now), Some(f.now + GRACE));
    f.advance(GRACE - ms(1));
    assert!(f.plan().is_empty());
    assert!(f.granted().is_empty());
    f.advance(ms(1));
    f.clear_fences(&[key(1)]);
    assert_eq!(f.granted(), vec![(a, token(10))]);
}

#[test]
fn a_verified_announcement_skips_the_grace_and_polls_at_once() {
    let mut f = Fixture::new();
    let a = f.request(key(1), Mode::Wait, Duration::from_secs(3600));
    f.try_round(&[key(1)], TryOutcome::Held { by: by(4242) });
    f.advance(ms(5));
    assert!(f.plan().is_empty(), "next poll is an hour away");
    f.table.announced(key(1), 4242, f.now);
    f.try_round(&[key(1)], TryOutcome::Won(Some(token(10))));
    assert_eq!(f.granted(), vec![(a, token(10))]);
}

/// A waiter whose last try saw backend 4242 (started at `start_of(4242)`) holding key 1
/// hears 4242 announce its release, and wins at the next try, which finds the backend
/// with pid 4242 now started at `found`: is the grant immediate?
fn announced_win_when_the_sender_is(found: Option<i64>, holder_start: Option<i64>) -> bool {
    let mut f = Fixture::new();
    let a = f.request(key(1), Mode::Wait, Duration::from_secs(3600));
    f.try_round(
        &[key(1)],
        TryOutcome::Held {
            by: Some(Backend {
                pid: 4242,
                start: holder_start,
            }),
        },
    );
    f.advance(ms(5));
    f.table.announced(key(1), 4242, f.now);
    // Tried at once either way: from the holder's pid, it is at least a good cue.
    let plan = f.plan();
    assert_eq!(plan.try_keys, vec![key(1)], "not tried at once");
    let expected: Vec<(LockKey, i32)> = if holder_start.is_some() {
        vec![(key(1), 4242)]
    } else {
        Vec::new()
    };
    assert_eq!(plan.verify, expected, "announcer to verify");
    let found: Vec<_> = plan.verify.iter().map(|(k, _)| (*k, found)).collect();
    f.table.senders(&found);
    f.table
        .tried(&[(key(1), TryOutcome::Won(Some(token(10))))], f.now);
    let immediate = f.granted() == vec![(a, token(10))];
    if !immediate {
        assert!(f.granted().is_empty());
        f.advance(GRACE);
        let plan = f.plan();
        assert_eq!(plan.check, vec![key(1)], "the grace ends in a fence check");
        f.table.checked(&[(key(1), FenceCheck::Clear)], f.now);
        assert_eq!(f.granted(), vec![(a, token(10))]);
    }
    immediate
}

#[test]
fn an_announcement_is_verified_only_from_the_holders_session() {
    let start = start_of(4242);
    // The holder's session, still alive: verified, the grace is skipped.
    assert!(announced_win_when_the_sender_is(Some(start), Some(start)));
    // The pid now belongs to another session (the holder's backend died and the pid
    // was reused, the new backend announcing what it never held): not verified.
    assert!(!announced_win_when_the_sender_is(
        Some(start + 1),
        Some(start)
    ));
    assert!(!announced_win_when_the_sender_is(
        Some(start - 1),
        Some(start)
    ));
    // No backend has the pid any more (or its start is hidden): not verified.
    assert!(!announced_win_when_the_sender_is(None, Some(start)));
    // The holder's start was hidden (another role's session, without
    // pg_read_all_stats): nothing can be verified, whatever the try finds.
    assert!(!announced_win_when_the_sender_is(Some(start), None));
    assert!(!announced_win_when_the_sender_is(None, None));
}

#[test]
fn without_session_verification_a_reused_pid_is_believed() {
    // What `Protection::SessionCheck` prevents (the simulation's pid-reuse faults show it
    // in whole histories): pid-only verification skips the grace on any backend's word.
    let mut f = Fixture::new();
    f.table.switch_off(Protection::SessionCheck);
    let a = f.wait(key(1));
    f.try_round(&[key(1)], TryOutcome::Held { by: by(4242) });
    f.table.announced(key(1), 4242, f.now);
    f.try_round_finding(&[key(1)], TryOutcome::Won(Some(token(10))), |_| {
        panic!("nothing to verify")
    });
    assert_eq!(f.granted(), vec![(a, token(10))]);
}

#[test]
fn a_confirmed_sender_does_not_outlive_its_try() {
    // A sender found alive verifies the announcement of the try that found it only: a
    // try that does not win (the key was taken meanwhile) starts over.
    let mut f = Fixture::new();
    let a = f.wait(key(1));
    f.try_round(&[key(1)], TryOutcome::Held { by: by(100) });
    f.table.announced(key(1), 100, f.now);
    let plan = f.plan();
    assert_eq!(plan.verify, vec![(key(1), 100)]);
    // (The statement reports senders for keys won only; a stray report is ignored.)
    f.table.senders(&[(key(1), Some(start_of(100)))]);
    f.table
        .tried(&[(key(1), TryOutcome::Held { by: by(200) })], f.now);
    f.table.announced(key(1), 100, f.now);
    f.advance(POLL * 2);
    let plan = f.plan();
    assert!(
        plan.verify.is_empty(),
        "verifying an announcer the last try did not see"
    );
    f.table
        .tried(&[(key(1), TryOutcome::Won(Some(token(10))))], f.now);
    assert!(
        f.granted().is_empty(),
        "an old confirmation skipped the grace"
    );
    f.advance(GRACE);
    f.clear_fences(&[key(1)]);
    assert_eq!(f.granted(), vec![(a, token(10))]);
}

#[test]
fn an_announcement_from_another_backend_is_only_a_cue() {
    // Any role may NOTIFY on our channel, and a holder that took over since our last try
    // announces too: only the backend the last try saw is believed (the grace is
    // skipped); any other announcement brings the next try forward by a bounded amount,
    // at most one try per `UNVERIFIED_CUE` however many arrive, and skips nothing.
    let mut f = Fixture::new();
    let a = f.request(key(1), Mode::Wait, Duration::from_secs(3600));
    f.try_round(&[key(1)], TryOutcome::Held { by: by(4242) });
    f.advance(ms(5));
    for forged in [1, 4241, 4243, -4242] {
        f.table.announced(key(1), forged, f.now);
    }
    assert!(
        f.plan().is_empty(),
        "an unverified announcement made us poll at once"
    );
    // The cue is a shared tick, one jittered (±10 %) `UNVERIFIED_CUE` ahead.
    f.advance(UNVERIFIED_CUE * 8 / 10);
    for forged in 0..1000 {
        f.table.announced(key(1), forged, f.now);
    }
    assert!(f.plan().is_empty(), "a flood moved the cue forward");
    f.advance(UNVERIFIED_CUE * 3 / 10);
    f.try_round(&[key(1)], TryOutcome::Held { by: by(4243) });
    for forged in 0..1000 {
        f.table.announced(key(1), forged + 5000, f.now);
    }
    assert!(f.plan().is_empty(), "two tries within one cue interval");
    f.advance(UNVERIFIED_CUE * 11 / 10);
    f.try_round(&[key(1)], TryOutcome::Won(Some(token(10))));
    assert!(
        f.granted().is_empty(),
        "an unverified announcement skipped the grace"
    );
    f.advance(GRACE);
    f.clear_fences(&[key(1)]);
    assert_eq!(f.granted(), vec![(a, token(10))]);
}

#[test]
fn an_announcement_does_not_outlive_a_lost_race() {
    // Three nodes: B releases and announces; C wins the race; C's session is then ended
    // by the server. Our next win is unannounced again.
    let mut f = Fixture::new();
    let a = f.wait(key(1));
    f.try_round(&[key(1)], TryOutcome::Held { by: by(100) });
    f.table.announced(key(1), 100, f.now);
    f.try_round(&[key(1)], TryOutcome::Held { by: by(200) });
    f.advance(POLL * 2);
    f.try_round(&[key(1)], TryOutcome::Won(Some(token(10))));
    assert!(
        f.granted().is_empty(),
        "a stale announcement skipped the grace"
    );
    f.advance(GRACE);
    f.clear_fences(&[key(1)]);
    assert_eq!(f.granted(), vec![(a, token(10))]);
}

#[test]
fn a_win_on_a_new_primary_term_waits_until_the_hold_ends() {
    let mut f = Fixture::new();
    let hold = Duration::from_secs(6);
    f.table.session_ended(f.now);
    f.table.session_started(2, f.now);
    f.table.hold_grants_until(f.now + hold);
    let a = f.wait(key(1));
    let b = f.wait(key(2));
    // A try answers at once (see `a_try_during_a_new_terms_hold_answers_at_once`).
    let t = f.try_(key(3));
    assert_eq!(
        f.actions(),
        vec![Action::Refuse {
            id: t,
            why: Refusal::Busy
        }]
    );
    // Tried at once (the lock is taken at the server), but not granted.
    f.try_round(&[key(1), key(2)], TryOutcome::Won(Some(token(10))));
    assert!(f.granted().is_empty(), "granted during the term's hold");
    assert_eq!(f.table.next_wakeup(f.now), Some(f.now + hold));
    f.advance(hold - ms(1));
    assert!(f.plan().is_empty());
    f.advance(ms(1));
    // Then, as after the grace, the stop fences are checked before granting.
    f.clear_fences(&[key(1), key(2)]);
    assert_eq!(f.granted(), vec![(a, token(10)), (b, token(10))]);
}

#[test]
fn a_fenced_win_on_a_new_term_waits_for_the_hold_too() {
    let mut f = Fixture::new();
    // Shorter than the longest fence wait, which would grant without a check.
    let hold = Duration::from_secs(3);
    f.table.hold_grants_until(f.now + hold);
    let a = f.wait(key(1));
    f.try_round(
        &[key(1)],
        TryOutcome::WonFenced {
            token: Some(token(10)),
            by: Some(9),
        },
    );
    // The fence lets go at once, but the hold still applies, whatever is announced.
    f.table.announced(key(1), 9, f.now);
    assert!(f.plan().check.is_empty(), "checked during the hold");
    f.advance(hold);
    f.clear_fences(&[key(1)]);
    assert_eq!(f.granted(), vec![(a, token(10))]);
}

#[test]
fn the_hold_ends_with_its_session() {
    let mut f = Fixture::new();
    f.table.hold_grants_until(f.now + Duration::from_secs(6));
    f.table.session_ended(f.now);
    f.table.session_started(2, f.now);
    let a = f.wait(key(1));
    f.try_round(&[key(1)], TryOutcome::Won(Some(token(10))));
    assert_eq!(
        f.granted(),
        vec![(a, token(10))],
        "the next session sets its own hold"
    );
}

#[test]
fn after_a_reconnect_the_first_win_waits_the_grace() {
    let mut f = Fixture::new();
    let a = f.wait(key(1));
    f.try_round(&[key(1)], TryOutcome::Held { by: by(100) });
    f.table.session_ended(f.now);
    f.table.session_started(2, f.now);
    f.try_round(&[key(1)], TryOutcome::Won(Some(token(10))));
    assert!(f.granted().is_empty(), "won right after our own reconnect");
    f.advance(GRACE);
    f.clear_fences(&[key(1)]);
    assert_eq!(f.granted(), vec![(a, token(10))]);
}

#[test]
fn a_session_end_revokes_every_holder_and_answers_tries() {
    let mut f = Fixture::new();
    let held = f.wait(key(1));
    let _waiting = f.wait(key(1));
    f.try_round(&[key(1)], TryOutcome::Won(Some(token(10))));
    f.actions();
    let t = f.try_(key(2));
    let plan = f.plan();
    assert_eq!(plan.try_keys, vec![key(2)]);
    f.table.session_ended(f.now);
    let actions = f.actions();
    assert!(
        actions
            .iter()
            .any(|a| matches!(a, Action::Lost { key: k, .. } if *k == key(1)))
    );
    assert!(actions.contains(&Action::Refuse {
        id: t,
        why: Refusal::NotConnected
    }));
    assert_eq!(f.table.held(), 1, "the old lease is out until dropped");
    // The old lease comes back before the next session: nothing is unlocked or fenced.
    f.table.release(key(1), held, f.now);
    assert_eq!(f.table.held(), 0);
    f.table.session_started(2, f.now);
    let plan = f.plan();
    assert!(plan.unlock.is_empty());
    assert_eq!(plan.try_keys, vec![key(1)], "the waiter stays queued");
    // A try request while disconnected is answered at once.
    f.table
        .tried(&[(key(1), TryOutcome::Held { by: None })], f.now);
    f.table.session_ended(f.now);
    f.actions();
    let t2 = f.try_(key(3));
    assert_eq!(
        f.actions(),
        vec![Action::Refuse {
            id: t2,
            why: Refusal::NotConnected
        }]
    );
}

#[test]
fn a_try_is_busy_while_anyone_here_holds_or_waits() {
    let mut f = Fixture::new();
    let _a = f.wait(key(1));
    let t = f.try_(key(1));
    assert_eq!(
        f.actions(),
        vec![Action::Refuse {
            id: t,
            why: Refusal::Busy
        }]
    );
    f.try_round(&[key(1)], TryOutcome::Held { by: by(9) });
    let t = f.try_(key(2));
    f.try_round(&[key(2)], TryOutcome::Held { by: by(9) });
    assert!(f.actions().contains(&Action::Refuse {
        id: t,
        why: Refusal::Busy
    }));
}

#[test]
fn a_withdrawn_head_does_not_delay_the_next_request() {
    // An hourly waiter withdrawn: a later try of the same key runs in the next step.
    let mut f = Fixture::new();
    let hourly = f.request(key(1), Mode::Wait, Duration::from_secs(3600));
    f.try_round(&[key(1)], TryOutcome::Held { by: by(9) });
    f.advance(ms(10));
    f.table.withdraw(key(1), hourly, f.now);
    let t = f.try_(key(1));
    f.try_round(&[key(1)], TryOutcome::Won(Some(token(10))));
    // The key was forgotten with its last request: a first try that wins is granted
    // at once (a documented gap: nothing is known about who held it).
    assert_eq!(f.granted(), vec![(t, token(10))]);

    // A withdrawn head among waiters: the next one is tried at once.
    let mut f = Fixture::new();
    let hourly = f.request(key(1), Mode::Wait, Duration::from_secs(3600));
    let quick = f.request(key(1), Mode::Wait, ms(50));
    f.try_round(&[key(1)], TryOutcome::Held { by: by(9) });
    f.advance(ms(10));
    f.table.withdraw(key(1), hourly, f.now);
    f.try_round(&[key(1)], TryOutcome::Held { by: by(9) });
    f.advance(ms(60));
    f.try_round(&[key(1)], TryOutcome::Won(Some(token(10))));
    f.advance(GRACE);
    f.clear_fences(&[key(1)]);
    assert_eq!(f.granted(), vec![(quick, token(10))]);
}

#[test]
fn withdrawn_waiters_behind_a_local_holder_leave_at_once() {
    let mut f = Fixture::new();
    let _holder = f.wait(key(1));
    f.try_round(&[key(1)], TryOutcome::Won(Some(token(10))));
    for _ in 0..10_000 {
        let id = f.wait(key(1));
        f.table.withdraw(key(1), id, f.now);
    }
    assert_eq!(f.table.slots[&key(1)].waiters.len(), 0);
    assert_eq!(f.table.snapshot().len(), 1);
}

#[test]
fn a_grant_nobody_takes_any_more_is_unlocked() {
    let mut f = Fixture::new();
    let a = f.wait(key(1));
    f.try_round(&[key(1)], TryOutcome::Held { by: by(9) });
    f.advance(POLL * 2);
    f.try_round(&[key(1)], TryOutcome::Won(Some(token(10))));
    f.table.withdraw(key(1), a, f.now);
    f.advance(GRACE);
    f.clear_fences(&[key(1)]);
    assert!(f.granted().is_empty());
    let plan = f.plan();
    // Never granted here: unlocked without announcing (whoever held it before may
    // still be stopping, and an announcement would let waiters skip the grace).
    assert!(plan.unlock.is_empty());
    assert_eq!(plan.unlock_quiet, vec![key(1)]);
    f.table.unlocked(&plan.unlock_quiet, f.now);
    assert!(f.table.slots.is_empty());
}

#[test]
fn the_cap_counts_keys_not_requests() {
    let mut f = Fixture::with_rules(Rules {
        node: 0,
        max_locks: 2,
        takeover_grace: GRACE,
        max_fence_wait: MAX_FENCE,
    });
    f.wait(key(1));
    f.wait(key(1));
    f.wait(key(2));
    f.actions();
    let refused = f.wait(key(3));
    assert_eq!(
        f.actions(),
        vec![Action::Refuse {
            id: refused,
            why: Refusal::TooManyLocks { limit: 2 }
        }]
    );
}

#[test]
fn poll_ticks_are_shared_and_forgotten() {
    let mut f = Fixture::with_rules(Rules {
        node: 0,
        max_locks: 100,
        takeover_grace: GRACE,
        max_fence_wait: MAX_FENCE,
    });
    for n in 0..50 {
        f.wait(key(n));
    }
    let keys: Vec<_> = (0..50).map(key).collect();
    f.try_round(&keys, TryOutcome::Held { by: None });
    let next: BTreeSet<Instant> = f.table.slots.values().map(|s| s.next_try).collect();
    assert_eq!(next.len(), 1, "one interval, one tick");
    // Many intervals over time: the tick map stays bounded by those in use.
    let mut f = Fixture::new();
    for n in 0..1000u64 {
        let id = f.request(key(1), Mode::Wait, ms(10 + n));
        f.try_round(&[key(1)], TryOutcome::Held { by: None });
        f.table.withdraw(key(1), id, f.now);
        f.advance(ms(2000));
    }
    assert!(
        f.table.ticks.len() <= 1,
        "{} ticks kept",
        f.table.ticks.len()
    );
}

#[test]
fn jitter_stays_within_ten_percent() {
    let mut rng = 0x1234_5678_9abc_def1;
    for _ in 0..10_000 {
        let d = jitter(&mut rng, ms(300));
        assert!(d >= ms(270) && d < ms(330), "{d:?}");
    }
    assert!(jitter_below(&mut rng, Duration::MAX) < Duration::MAX);
}

#[test]
fn closing_refuses_waiters_and_unlocks_as_leases_come_back() {
    let mut f = Fixture::new();
    let a = f.wait(key(1));
    let b = f.wait(key(1));
    let c = f.wait(key(2));
    f.try_round(&[key(1), key(2)], TryOutcome::Won(Some(token(10))));
    f.actions();
    f.table.begin_close();
    assert_eq!(
        f.actions(),
        vec![Action::Refuse {
            id: b,
            why: Refusal::Closed
        }]
    );
    assert!(f.plan().is_empty(), "nothing unlocked while leases are out");
    f.table.release(key(1), a, f.now);
    let plan = f.plan();
    assert_eq!(plan.unlock, vec![key(1)], "no hand-off while closing");
    f.table.unlocked(&plan.unlock, f.now);
    let late = f.wait(key(3));
    assert!(f.actions().contains(&Action::Refuse {
        id: late,
        why: Refusal::Closed
    }));
    f.table.close_now();
    assert!(
        f.actions()
            .iter()
            .any(|a| matches!(a, Action::Lost { key: k, .. } if *k == key(2)))
    );
    // Its lease was still out at the deadline: released without an announcement.
    assert_eq!(f.plan().unlock_quiet, vec![key(2)]);
    let _ = c;
}

#[test]
fn a_lease_of_an_ended_session_is_fenced_until_its_owner_drops_it() {
    let mut f = Fixture::new();
    let old = f.wait(key(1));
    f.try_round(&[key(1)], TryOutcome::Won(Some(token(10))));
    f.actions();
    let local = f.wait(key(1));
    f.table.session_ended(f.now);
    f.actions();
    f.table.session_started(2, f.now);
    let plan = f.plan();
    assert_eq!(
        plan.fence,
        vec![key(1)],
        "the new session fences the old lease"
    );
    assert!(
        plan.try_keys.is_empty(),
        "a local waiter must not take the key while the old lease is out"
    );
    f.table.fenced(&[(key(1), true)], f.now);
    f.advance(Duration::from_secs(2));
    assert!(f.plan().is_empty(), "still out: nothing to do");
    f.table.release(key(1), old, f.now);
    let plan = f.plan();
    assert_eq!(plan.unfence, vec![key(1)], "released and announced");
    assert!(plan.try_keys.is_empty());
    f.table.unfenced(&plan.unfence, f.now);
    // Now the local waiter may try; it won unannounced, so it checks the fence too.
    f.try_round(&[key(1)], TryOutcome::Won(Some(token(20))));
    f.advance(GRACE);
    f.clear_fences(&[key(1)]);
    assert_eq!(f.granted(), vec![(local, token(20))]);
}

#[test]
fn a_takeover_waits_while_the_old_holder_is_stopping() {
    let mut f = Fixture::new();
    let a = f.wait(key(1));
    f.try_round(&[key(1)], TryOutcome::Held { by: by(100) });
    f.advance(POLL * 2);
    f.try_round(&[key(1)], TryOutcome::Won(Some(token(10))));
    f.advance(GRACE);
    let plan = f.plan();
    assert_eq!(plan.check, vec![key(1)]);
    f.table
        .checked(&[(key(1), FenceCheck::Held { by: Some(200) })], f.now);
    assert!(f.granted().is_empty(), "granted while the old holder stops");
    // A stranger's announcement changes nothing; the old holder's makes us look again.
    f.advance(ms(10));
    f.table.announced(key(1), 999, f.now);
    assert!(f.plan().is_empty());
    f.table.announced(key(1), 200, f.now);
    f.clear_fences(&[key(1)]);
    assert_eq!(f.granted(), vec![(a, token(10))]);
}

#[test]
fn a_fence_held_past_any_stop_budget_is_given_up_on() {
    let mut f = Fixture::new();
    let a = f.wait(key(1));
    f.try_round(&[key(1)], TryOutcome::Held { by: by(100) });
    f.advance(POLL * 2);
    f.try_round(&[key(1)], TryOutcome::Won(Some(token(10))));
    f.advance(GRACE);
    f.plan();
    f.table.checked(&[(key(1), FenceCheck::Failed)], f.now);
    let until = f.now + MAX_FENCE;
    while f.now < until {
        f.advance(ms(500));
        let plan = f.plan();
        if f.now < until {
            assert!(f.granted().is_empty());
        }
        let outcomes: Vec<_> = plan
            .check
            .iter()
            .map(|k| (*k, FenceCheck::Held { by: Some(200) }))
            .collect();
        f.table.checked(&outcomes, f.now);
    }
    f.plan();
    assert_eq!(f.granted(), vec![(a, token(10))]);
}

#[test]
fn a_first_try_that_finds_a_stop_fence_waits_for_it() {
    // A request that never saw the key held wins it, but the statement finds its stop
    // fence held: an earlier holder's work still stops.
    let mut f = Fixture::new();
    let a = f.wait(key(1));
    f.try_round(
        &[key(1)],
        TryOutcome::WonFenced {
            token: Some(token(10)),
            by: Some(300),
        },
    );
    assert!(f.granted().is_empty(), "granted past a stop fence");
    f.advance(POLL);
    let plan = f.plan();
    assert_eq!(plan.check, vec![key(1)]);
    f.table
        .checked(&[(key(1), FenceCheck::Held { by: Some(300) })], f.now);
    f.table.announced(key(1), 300, f.now);
    f.clear_fences(&[key(1)]);
    assert_eq!(f.granted(), vec![(a, token(10))]);
}

// ---- properties ---------------------------------------------------------------------

/// One input to the table, drawn at random.
#[derive(Clone, Debug)]
enum Op {
    Acquire {
        key: u8,
        try_: bool,
        poll: u8,
    },
    Withdraw {
        pick: u16,
    },
    Release {
        pick: u16,
    },
    /// Plan a step and answer it: per tried key, 0 = won, 1 = held, 2 = failed; per
    /// checked fence, 0 = clear, 1 = held, 2 = failed; fences taken or not.
    Step {
        outcomes: Vec<(u8, u8)>,
        token_ok: bool,
        checks: Vec<(u8, u8)>,
        fence_ok: bool,
    },
    Announce {
        key: u8,
        sender: u8,
    },
    SessionEnd,
    /// A new session, whose server's term began recently: nothing it wins is granted
    /// for `hold` ms (0: an old term).
    SessionStart {
        hold: u16,
    },
    Advance {
        ms: u16,
    },
    Close,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..3, any::<bool>(), 0u8..3).prop_map(|(key, try_, poll)| Op::Acquire { key, try_, poll }),
        2 => any::<u16>().prop_map(|pick| Op::Withdraw { pick }),
        3 => any::<u16>().prop_map(|pick| Op::Release { pick }),
        6 => (
            proptest::collection::vec((0u8..4, 0u8..2), 4),
            any::<bool>(),
            proptest::collection::vec((0u8..3, 0u8..2), 4),
            proptest::bool::weighted(0.8),
        )
            .prop_map(|(outcomes, token_ok, checks, fence_ok)| Op::Step {
                outcomes,
                token_ok,
                checks,
                fence_ok,
            }),
        2 => (0u8..4, 0u8..2).prop_map(|(key, sender)| Op::Announce { key, sender }),
        2 => Just(Op::SessionEnd),
        3 => prop_oneof![Just(0u16), 0u16..2000].prop_map(|hold| Op::SessionStart { hold }),
        4 => (0u16..400).prop_map(|ms| Op::Advance { ms }),
        1 => Just(Op::Close),
    ]
}

/// What the outside world knows, to check the table against.
#[derive(Default)]
struct Model {
    /// Keys this session holds at the server.
    server_held: BTreeSet<LockKey>,
    /// Live leases: id -> (key, generation).
    leases: BTreeMap<RequestId, (LockKey, u64)>,
    /// Requests not answered yet: id -> (key, mode).
    pending: BTreeMap<RequestId, (LockKey, Mode)>,
    /// Wait requests per key, in arrival order (withdrawn ones removed).
    queues: HashMap<LockKey, Vec<RequestId>>,
    answered: BTreeSet<RequestId>,
    last_token: HashMap<LockKey, FencingToken>,
    /// Per key: the backend a failed try saw, and whether it announced since.
    seen: HashMap<LockKey, (Option<i32>, bool)>,
    /// Per key: a win that must wait the grace (until when), and then a clear fence
    /// check (or the maximum fence wait since the first check that was not clear).
    graced: HashMap<LockKey, (Instant, bool, Option<Instant>)>,
    /// Leases of ended sessions not dropped yet: id -> (key, lost at).
    stopping: BTreeMap<RequestId, (LockKey, Instant)>,
    /// Keys granted here since they were won: only their release may be announced.
    worked: BTreeSet<LockKey>,
    /// Stop fences this session holds at the server (by their key).
    fences_held: BTreeSet<LockKey>,
    generation: Option<u64>,
    generations: u64,
    /// No grant before this (the current session's term hold).
    not_before: Option<Instant>,
    next_token: u64,
    next_id: RequestId,
    closing: bool,
}

fn run(ops: &[Op]) -> Result<(), TestCaseError> {
    let start = Instant::now();
    let mut now = start;
    let mut table = LockTable::new(
        Rules {
            node: 0,
            max_locks: 3,
            takeover_grace: GRACE,
            max_fence_wait: MAX_FENCE,
        },
        7,
    );
    let mut m = Model {
        generation: Some(1),
        generations: 1,
        next_token: 100,
        next_id: 1,
        ..Model::default()
    };
    table.session_started(1, now);
    let polls = [ms(10), POLL, Duration::from_secs(3600)];
    for op in ops {
        match op {
            Op::Acquire { key: k, try_, poll } => {
                let id = m.next_id;
                m.next_id += 1;
                let mode = if *try_ { Mode::Try } else { Mode::Wait };
                let k = key(i32::from(*k));
                m.pending.insert(id, (k, mode));
                if mode == Mode::Wait {
                    m.queues.entry(k).or_default().push(id);
                }
                table.acquire(
                    Request {
                        id,
                        key: k,
                        name: Arc::from("p"),
                        poll_interval: polls[usize::from(*poll)],
                        mode,
                        since: SystemTime::UNIX_EPOCH,
                        enqueued: now,
                        eager_token: true,
                    },
                    now,
                );
            }
            Op::Withdraw { pick } => {
                if let Some((&id, &(k, _))) = m
                    .pending
                    .iter()
                    .nth(usize::from(*pick) % m.pending.len().max(1))
                {
                    m.pending.remove(&id);
                    m.answered.insert(id);
                    if let Some(q) = m.queues.get_mut(&k) {
                        q.retain(|x| *x != id);
                    }
                    table.withdraw(k, id, now);
                }
            }
            Op::Release { pick } => {
                // A live lease, or one of an ended session whose work just stopped.
                let out: Vec<(RequestId, LockKey)> = m
                    .leases
                    .iter()
                    .map(|(id, (k, _))| (*id, *k))
                    .chain(m.stopping.iter().map(|(id, (k, _))| (*id, *k)))
                    .collect();
                if let Some(&(id, k)) = out.get(usize::from(*pick) % out.len().max(1)) {
                    m.leases.remove(&id);
                    m.stopping.remove(&id);
                    table.release(k, id, now);
                }
            }
            Op::Step {
                outcomes,
                token_ok,
                checks,
                fence_ok,
            } => {
                let plan = table.plan(now);
                for k in &plan.fence {
                    prop_assert!(!m.fences_held.contains(k), "fences {k} twice");
                    prop_assert!(
                        m.stopping.values().any(|(s, _)| s == k),
                        "fences {k}, not stopping"
                    );
                }
                for k in &plan.unfence {
                    prop_assert!(m.fences_held.contains(k), "unfences {k}, not fenced");
                }
                for k in &plan.check {
                    prop_assert!(m.server_held.contains(k), "checks {k}, not won");
                }
                for k in &plan.unlock {
                    prop_assert!(m.server_held.contains(k), "unlocks {k}, not held");
                    prop_assert!(
                        m.worked.contains(k),
                        "announces the release of {k}, never granted since it was won"
                    );
                }
                for k in &plan.unlock_quiet {
                    prop_assert!(m.server_held.contains(k), "unlocks {k}, not held");
                }
                for k in &plan.token_for {
                    prop_assert!(m.server_held.contains(k), "hand-off of {k}, not held");
                }
                for k in &plan.try_keys {
                    prop_assert!(!m.server_held.contains(k), "tries {k}, already held");
                }
                if !plan.is_empty() {
                    prop_assert!(m.generation.is_some(), "statements while disconnected");
                }
                drain(&mut table, &mut m, now)?;
                for k in plan.unlock.iter().chain(&plan.unlock_quiet) {
                    m.server_held.remove(k);
                    m.worked.remove(k);
                }
                table.unlocked(&plan.unlock, now);
                table.unlocked(&plan.unlock_quiet, now);
                let t = token_ok.then(|| {
                    m.next_token += 1;
                    token(m.next_token)
                });
                table.tokens(&plan.token_for, &plan.token_read, t, now);
                if !plan.try_keys.is_empty() {
                    m.next_token += 1;
                }
                let batch_token = token(m.next_token);
                let results: Vec<(LockKey, TryOutcome)> = plan
                    .try_keys
                    .iter()
                    .zip(outcomes.iter().cycle())
                    .map(|(k, (o, pid))| {
                        let outcome = match o {
                            0 => TryOutcome::Won(Some(batch_token)),
                            1 => TryOutcome::Held {
                                by: by(i32::from(*pid)),
                            },
                            2 => TryOutcome::WonFenced {
                                token: Some(batch_token),
                                by: Some(i32::from(*pid)),
                            },
                            _ => TryOutcome::Failed,
                        };
                        (*k, outcome)
                    })
                    .collect();
                for (k, outcome) in &results {
                    match outcome {
                        TryOutcome::Won(_) => {
                            m.server_held.insert(*k);
                            let (_, announced) = m.seen.remove(k).unwrap_or((None, true));
                            if !announced {
                                m.graced.insert(*k, (now + GRACE, false, None));
                            }
                        }
                        TryOutcome::WonFenced { .. } => {
                            // Someone's work is still stopping: only a clear fence check
                            // (or the longest wait) may grant it, after the grace too
                            // when the takeover was unannounced.
                            m.server_held.insert(*k);
                            let (_, announced) = m.seen.remove(k).unwrap_or((None, true));
                            let at = if announced { now } else { now + GRACE };
                            m.graced.insert(*k, (at, false, Some(now)));
                        }
                        TryOutcome::Held { by } => {
                            m.seen.insert(*k, (by.map(|b| b.pid), false));
                        }
                        TryOutcome::Failed => {}
                    }
                }
                // The announcers are still alive (their sessions as the tries saw them).
                let senders: Vec<(LockKey, Option<i64>)> = plan
                    .verify
                    .iter()
                    .filter(|(k, _)| {
                        results.iter().any(|(r, o)| {
                            r == k && matches!(o, TryOutcome::Won(_) | TryOutcome::WonFenced { .. })
                        })
                    })
                    .map(|(k, pid)| (*k, Some(start_of(*pid))))
                    .collect();
                table.senders(&senders);
                table.tried(&results, now);
                let fenced: Vec<(LockKey, bool)> =
                    plan.fence.iter().map(|k| (*k, *fence_ok)).collect();
                if *fence_ok {
                    m.fences_held.extend(plan.fence.iter().copied());
                }
                table.fenced(&fenced, now);
                for k in &plan.unfence {
                    m.fences_held.remove(k);
                }
                table.unfenced(&plan.unfence, now);
                let checked: Vec<(LockKey, FenceCheck)> = plan
                    .check
                    .iter()
                    .zip(checks.iter().cycle())
                    .map(|(k, (o, pid))| {
                        let outcome = match o {
                            0 => FenceCheck::Clear,
                            1 => FenceCheck::Held {
                                by: Some(i32::from(*pid)),
                            },
                            _ => FenceCheck::Failed,
                        };
                        if let Some((_, cleared, fenced_since)) = m.graced.get_mut(k) {
                            if outcome == FenceCheck::Clear {
                                *cleared = true;
                            } else {
                                fenced_since.get_or_insert(now);
                            }
                        }
                        (*k, outcome)
                    })
                    .collect();
                table.checked(&checked, now);
            }
            Op::Announce { key: k, sender } => {
                let k = key(i32::from(*k));
                let sender = i32::from(*sender);
                if let Some((by, announced)) = m.seen.get_mut(&k)
                    && *by == Some(sender)
                    && !m.server_held.contains(&k)
                {
                    *announced = true;
                }
                table.announced(k, sender, now);
            }
            Op::SessionEnd => {
                if m.generation.take().is_some() {
                    table.session_ended(now);
                    m.server_held.clear();
                    m.worked.clear();
                    m.fences_held.clear();
                    m.graced.clear();
                    m.seen.clear();
                    for (k, q) in &m.queues {
                        if !q.is_empty() {
                            m.seen.insert(*k, (None, false));
                        }
                    }
                }
            }
            Op::SessionStart { hold } => {
                if m.generation.is_none() {
                    m.generations += 1;
                    m.generation = Some(m.generations);
                    table.session_started(m.generations, now);
                    if *hold > 0 {
                        m.not_before = Some(now + ms(u64::from(*hold)));
                        table.hold_grants_until(now + ms(u64::from(*hold)));
                    } else {
                        m.not_before = None;
                    }
                }
            }
            Op::Advance { ms: d } => now += ms(u64::from(*d)),
            Op::Close => {
                if !m.closing {
                    m.closing = true;
                    table.begin_close();
                }
            }
        }
        drain(&mut table, &mut m, now)?;
        // Past the longest stop, the table stops fencing for a lease still out.
        m.stopping.retain(|_, (_, lost)| now < *lost + MAX_FENCE);
        // The table forgets a key nobody holds or wants, and what it knew about it.
        let live: BTreeSet<LockKey> = m
            .pending
            .values()
            .map(|(k, _)| *k)
            .chain(m.leases.values().map(|(k, _)| *k))
            .chain(m.server_held.iter().copied())
            .chain(m.stopping.values().map(|(k, _)| *k))
            .collect();
        m.seen.retain(|k, _| live.contains(k));
        m.graced.retain(|k, _| m.server_held.contains(k));
        check(&table, &m)?;
    }
    Ok(())
}

/// Applies the table's actions to the model, checking each.
fn drain(table: &mut LockTable, m: &mut Model, now: Instant) -> Result<(), TestCaseError> {
    while let Some(action) = table.poll_action() {
        match action {
            Action::Grant {
                id,
                key: k,
                token: t,
                generation,
                ..
            } => {
                prop_assert!(!m.closing, "granted while closing");
                prop_assert!(
                    m.not_before.is_none_or(|at| now >= at),
                    "granted {} during the new term's hold",
                    k
                );
                prop_assert_eq!(
                    Some(generation),
                    m.generation,
                    "granted in an old generation"
                );
                prop_assert!(
                    m.server_held.contains(&k),
                    "granted {} not held at the server",
                    k
                );
                prop_assert!(
                    m.leases.values().all(|(other, _)| *other != k),
                    "two local holders of {}",
                    k
                );
                let Some(t) = t else {
                    return Err(TestCaseError::fail(format!(
                        "{k} granted to an eager request without its token"
                    )));
                };
                if let Some(prev) = m.last_token.get(&k) {
                    prop_assert!(t > *prev, "token went from {} to {} on {}", prev, t, k);
                }
                m.last_token.insert(k, t);
                prop_assert!(
                    !m.stopping.values().any(|(s, _)| *s == k),
                    "{} granted while a lease of an ended session still runs here",
                    k
                );
                if let Some((at, cleared, fenced_since)) = m.graced.remove(&k) {
                    prop_assert!(now >= at, "{} granted before the takeover grace ended", k);
                    prop_assert!(
                        cleared || fenced_since.is_some_and(|t| now >= t + MAX_FENCE),
                        "{} granted without a clear stop fence",
                        k
                    );
                }
                let (pk, mode) = m.pending.remove(&id).expect("granted an unknown request");
                prop_assert_eq!(pk, k);
                if mode == Mode::Wait {
                    let q = m.queues.get_mut(&k).expect("queue");
                    prop_assert_eq!(q.first().copied(), Some(id), "not FIFO on {}", k);
                    q.remove(0);
                }
                prop_assert!(m.answered.insert(id), "answered twice");
                m.leases.insert(id, (k, generation));
                m.worked.insert(k);
            }
            Action::Refuse { id, .. } => {
                let (k, _) = m.pending.remove(&id).expect("refused an unknown request");
                if let Some(q) = m.queues.get_mut(&k) {
                    q.retain(|x| *x != id);
                }
                prop_assert!(m.answered.insert(id), "answered twice");
            }
            Action::Token { id, .. } => {
                return Err(TestCaseError::fail(format!(
                    "a token read answered for {id}, which never read"
                )));
            }
            Action::Lost { key: k, .. } => {
                let lost: Vec<RequestId> = m
                    .leases
                    .iter()
                    .filter(|(_, (lk, _))| *lk == k)
                    .map(|(id, _)| *id)
                    .collect();
                for id in lost {
                    m.leases.remove(&id);
                    // Its owner has not dropped it yet.
                    m.stopping.insert(id, (k, now));
                }
            }
            Action::Released { .. } => {}
        }
    }
    Ok(())
}

fn check(table: &LockTable, m: &Model) -> Result<(), TestCaseError> {
    // Every unanswered request is still queued, in order, and nothing else is.
    let mut queued: HashMap<LockKey, Vec<RequestId>> = HashMap::new();
    let mut holders: HashMap<LockKey, usize> = HashMap::new();
    for (k, entry) in table.snapshot() {
        match entry {
            Entry::Waiting { id, .. } => queued.entry(k).or_default().push(id),
            Entry::Held { id, .. } => {
                *holders.entry(k).or_default() += 1;
                prop_assert!(
                    m.leases.contains_key(&id),
                    "table holds a lease the model lost"
                );
            }
        }
    }
    prop_assert!(holders.values().all(|n| *n <= 1), "two holders of one key");
    let mut expected: HashMap<LockKey, Vec<RequestId>> = HashMap::new();
    for (id, (k, _)) in &m.pending {
        expected.entry(*k).or_default().push(*id);
    }
    for ids in queued.values_mut() {
        ids.sort_unstable();
    }
    prop_assert_eq!(
        queued,
        expected,
        "queued requests differ from unanswered ones"
    );
    // No lease outlives its generation.
    for (k, generation) in m.leases.values() {
        prop_assert_eq!(
            Some(*generation),
            m.generation,
            "lease of {} outlived its session",
            k
        );
    }
    for k in &m.server_held {
        prop_assert!(table.slots.contains_key(k), "forgot {} while holding it", k);
    }
    // Memory is bounded by what is live.
    prop_assert!(table.slots.len() <= 4);
    // The poll intervals in use (at most 3 here) and the unverified-cue tick.
    prop_assert!(table.ticks.len() <= 4);
    for (k, slot) in &table.slots {
        prop_assert!(
            !slot.unused(),
            "{} kept with no holder, waiter or server state",
            k
        );
        prop_assert_eq!(
            slot.server != Server::Free,
            m.server_held.contains(k),
            "server state of {} differs",
            k
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("CHOSEN_TABLE_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(2_000),
        max_shrink_iters: 10_000,
        ..ProptestConfig::default()
    })]

    #[test]
    fn the_rules_hold_over_random_histories(ops in proptest::collection::vec(op(), 1..300)) {
        run(&ops)?;
    }
}

/// A replayed history: a lease lost with its session is still out when the next
/// session starts; a local waiter of the same key must not be granted meanwhile.
#[test]
fn history_old_lease_still_out_blocks_the_local_waiter() {
    let step = |o: u8, c: u8| Op::Step {
        outcomes: vec![(o, 0); 4],
        token_ok: true,
        checks: vec![(c, 0); 4],
        fence_ok: true,
    };
    let ops = vec![
        Op::Acquire {
            key: 0,
            try_: false,
            poll: 0,
        },
        Op::Acquire {
            key: 0,
            try_: false,
            poll: 0,
        },
        step(0, 0),
        Op::SessionEnd,
        Op::SessionStart { hold: 0 },
        step(0, 0),
        Op::Advance { ms: 200 },
        step(0, 0),
        step(0, 0),
    ];
    run(&ops).unwrap();
}

/// Review2 finding 2: a try request for a key whose lease of an ended session is still
/// out is neither tried nor answered; it waits for that lease to come back (forever,
/// when its caller is the one holding it).
#[test]
fn a_try_while_a_lost_lease_is_out_is_answered_at_once() {
    let mut f = Fixture::new();
    let _old = f.wait(key(1));
    f.try_round(&[key(1)], TryOutcome::Won(Some(token(10))));
    f.actions();
    f.table.session_ended(f.now);
    f.actions();
    f.table.session_started(2, f.now);
    let plan = f.plan();
    f.table.fenced(&[(key(1), true)], f.now);
    assert_eq!(plan.fence, vec![key(1)]);
    let t = f.try_(key(1));
    for _ in 0..10 {
        f.advance(POLL);
        let plan = f.plan();
        assert!(
            plan.try_keys.is_empty(),
            "not tried while the old lease is out"
        );
    }
    assert!(
        f.actions()
            .iter()
            .any(|a| matches!(a, Action::Refuse { id, .. } if *id == t)),
        "the try request is still unanswered after {:?}",
        POLL * 10
    );
}

/// Review2 finding 4: a graceful shutdown that begins before the new session's first
/// step never takes the stop fence of a lease lost with the old session, yet the task
/// waits (up to the stop budget) for that lease, whose work still runs: a node taking
/// the key over finds the fence clear.
#[test]
fn a_shutdown_right_after_a_reconnect_still_fences_the_lost_lease() {
    let mut f = Fixture::new();
    let _old = f.wait(key(1));
    f.try_round(&[key(1)], TryOutcome::Won(Some(token(10))));
    f.actions();
    f.table.session_ended(f.now);
    f.actions();
    f.table.session_started(2, f.now);
    f.table.begin_close();
    assert_eq!(f.table.held(), 1, "the shutdown waits for the lost lease");
    let plan = f.plan();
    assert_eq!(
        plan.fence,
        vec![key(1)],
        "the work under the lost lease runs unfenced while the shutdown waits for it"
    );
}

/// Two keys of one interest bucket, `key(n)` for the smallest such n > `after`.
fn same_bucket(first: LockKey, after: i32) -> LockKey {
    (after + 1..)
        .map(key)
        .find(|k| k.interest_bucket() == first.interest_bucket())
        .expect("a key of the same bucket")
}

#[test]
fn a_key_not_won_without_its_buckets_interest_is_tried_again_at_once() {
    // Review 5, finding 1: only the first key of a bucket registers in a statement; when
    // that one is won, the other waits without interest and its release would be silent.
    let mut f = Fixture::new();
    let x = key(1);
    let y = same_bucket(x, 1);
    let (a, b) = (
        f.request(x, Mode::Wait, Duration::from_secs(30)),
        f.request(y, Mode::Wait, Duration::from_secs(30)),
    );
    let plan = f.plan();
    assert_eq!(plan.try_keys, vec![x, y]);
    assert_eq!(plan.register, vec![x], "one registration per bucket");
    f.table.tried(
        &[
            (x, TryOutcome::Won(Some(token(5)))),
            (y, TryOutcome::Held { by: by(9) }),
        ],
        f.now,
    );
    assert_eq!(f.granted(), vec![(a, token(5))]);
    let plan = f.plan();
    assert_eq!(plan.try_keys, vec![y], "tried again at once, not in 30 s");
    assert_eq!(plan.register, vec![y]);
    f.table.registered(&[y]);
    f.table.tried(&[(y, TryOutcome::Held { by: by(9) })], f.now);
    assert!(f.plan().is_empty(), "registered: it waits for its poll");
    // A registration that keeps failing (a releaser's probe every time) gives up after
    // a few quick tries.
    let mut g = Fixture::new();
    g.request(y, Mode::Wait, Duration::from_secs(30));
    let start = g.now;
    for _ in 0..=MAX_QUICK_REGISTERS {
        while g.table.next_wakeup(g.now).is_some_and(|at| at > g.now) {
            g.advance(ms(10));
        }
        let plan = g.plan();
        assert_eq!(plan.try_keys, vec![y]);
        g.table.tried(&[(y, TryOutcome::Held { by: by(9) })], g.now);
    }
    assert!(g.now - start >= ms(1500), "backs off: {:?}", g.now - start);
    assert!(
        g.table.next_wakeup(g.now) > Some(g.now + Duration::from_secs(20)),
        "then waits for its poll"
    );
    let _ = b;
}

#[test]
fn unverified_cues_for_many_keys_share_one_statement() {
    // Review 5, finding 3: cues for different keys at different instants.
    let mut f = Fixture::new();
    let keys: Vec<LockKey> = (1..=12).map(key).collect();
    for k in &keys {
        f.request(*k, Mode::Wait, Duration::from_secs(3600));
    }
    f.try_round(&keys, TryOutcome::Held { by: by(9) });
    for k in &keys {
        f.advance(ms(30));
        f.table.announced(*k, 12345, f.now);
    }
    let mut statements = 0;
    let end = f.now + Duration::from_secs(3);
    while f.now < end {
        let plan = f.plan();
        if !plan.try_keys.is_empty() {
            statements += 1;
            let outcomes: Vec<_> = plan
                .try_keys
                .iter()
                .map(|k| (*k, TryOutcome::Held { by: by(9) }))
                .collect();
            f.table.tried(&outcomes, f.now);
        }
        f.advance(ms(10));
    }
    assert!(
        statements <= 2,
        "{statements} try statements for one cue each"
    );
}

#[test]
fn a_key_won_after_being_seen_held_in_the_same_statement_waits_out_the_grace() {
    // Review 5, finding 4: the holder's session ended between the statement's tries.
    let mut f = Fixture::new();
    let a = f.wait(key(1));
    let plan = f.plan();
    assert_eq!(plan.try_keys, vec![key(1)]);
    f.table.seen_held(&[key(1)]);
    f.table
        .tried(&[(key(1), TryOutcome::Won(Some(token(3))))], f.now);
    assert!(f.granted().is_empty(), "granted without the grace");
    f.advance(GRACE);
    f.clear_fences(&[key(1)]);
    assert_eq!(f.granted(), vec![(a, token(3))]);
}

#[test]
fn held_interest_keys_count_in_the_server_floor() {
    let mut f = Fixture::new();
    f.wait(key(1));
    f.try_round(&[key(1)], TryOutcome::Held { by: by(9) });
    assert_eq!(
        f.table.server_floor(),
        vec![SessionLock {
            key: key(1).interest(),
            exclusive: false
        }],
        "the interest key"
    );
    f.table.withdraw(key(1), 1, f.now);
    let plan = f.plan();
    assert_eq!(plan.unregister, vec![key(1).interest_bucket()]);
    assert_eq!(
        f.table.server_floor(),
        vec![],
        "lowered before the release is sent"
    );
}

#[test]
fn a_try_during_a_new_terms_hold_answers_at_once() {
    // Review 6, finding 2: nothing can be granted before the hold ends; a try must not
    // wait it out (nor take the key at the server meanwhile).
    let mut f = Fixture::new();
    f.table.hold_grants_until(f.now + Duration::from_secs(6));
    let t = f.try_(key(1));
    assert_eq!(
        f.actions(),
        vec![Action::Refuse {
            id: t,
            why: Refusal::Busy
        }]
    );
    assert!(f.plan().is_empty(), "tried at the server");
    // A waiting request is tried (and held at the server) and granted after the hold.
    let w = f.wait(key(1));
    f.try_round(&[key(1)], TryOutcome::Won(Some(token(4))));
    assert!(f.granted().is_empty());
    f.advance(Duration::from_secs(6));
    f.clear_fences(&[key(1)]);
    assert_eq!(f.granted(), vec![(w, token(4))]);
}

#[test]
fn a_hand_over_names_its_node_and_skips_the_local_waiters() {
    // This node (hash 0) holds the key and a local request waits for it: handed over to
    // node 7, the key is unlocked and announced for node 7, not handed off locally, and
    // the local waiter holds off for HAND_OVER_HOLD.
    let mut f = Fixture::new();
    let a = f.wait(key(1));
    let b = f.wait(key(1));
    f.try_round(&[key(1)], TryOutcome::Won(Some(token(10))));
    assert_eq!(f.granted(), vec![(a, token(10))]);
    f.table.release_to(key(1), a, Some(7), f.now);
    let plan = f.plan();
    assert!(plan.token_for.is_empty(), "handed off locally");
    assert_eq!(plan.unlock, vec![key(1)]);
    assert_eq!(plan.hand_to, vec![(key(1), 7)]);
    f.table.unlocked(&plan.unlock, f.now);
    assert!(
        f.plan().try_keys.is_empty(),
        "the local waiter tried at once"
    );
    assert_eq!(f.table.next_wakeup(f.now), Some(f.now + HAND_OVER_HOLD));
    f.advance(HAND_OVER_HOLD);
    f.try_round(&[key(1)], TryOutcome::Won(Some(token(12))));
    // Node 7 may have held it meanwhile and lost it silently: the grace, the fence.
    assert!(f.granted().is_empty());
    f.advance(GRACE);
    f.clear_fences(&[key(1)]);
    assert_eq!(f.granted(), vec![(b, token(12))]);
    // A later plain release is announced for nobody.
    f.table.release(key(1), b, f.now);
    let plan = f.plan();
    assert_eq!(plan.unlock, vec![key(1)]);
    assert!(plan.hand_to.is_empty());
}

#[test]
fn a_hand_over_to_this_node_is_a_plain_release() {
    let mut f = Fixture::new();
    let a = f.wait(key(1));
    let b = f.wait(key(1));
    f.try_round(&[key(1)], TryOutcome::Won(Some(token(10))));
    f.actions();
    f.table.release_to(key(1), a, Some(0), f.now);
    assert_eq!(
        f.plan().token_for,
        vec![key(1)],
        "a local hand-off, as usual"
    );
    f.table.tokens(&[key(1)], &[], Some(token(11)), f.now);
    assert_eq!(f.granted(), vec![(b, token(11))]);
}

#[test]
fn a_verified_hand_over_to_another_node_holds_this_one_off() {
    let mut f = Fixture::new();
    let a = f.request(key(1), Mode::Wait, Duration::from_secs(3600));
    f.try_round(&[key(1)], TryOutcome::Held { by: by(4242) });
    f.advance(ms(5));
    // Handed to node 9 (not us): we hold off, even when forged cues arrive meanwhile.
    f.table.announced_for(key(1), 4242, Some(9), f.now);
    for forged in 0..100 {
        f.table.announced_for(key(1), forged, None, f.now);
    }
    f.advance(HAND_OVER_HOLD - ms(1));
    assert!(f.plan().try_keys.is_empty(), "tried within the hold");
    // Node 9 did not take it (or took it and lost it silently): we do, after the
    // grace and the fence check.
    f.advance(ms(1));
    f.try_round(&[key(1)], TryOutcome::Won(Some(token(10))));
    assert!(f.granted().is_empty());
    f.advance(GRACE);
    f.clear_fences(&[key(1)]);
    assert_eq!(f.granted(), vec![(a, token(10))]);
}

#[test]
fn a_try_that_wins_a_key_just_handed_to_another_node_gives_it_back() {
    // Our poll try reaches the server just after the holder (backend 4242) released the
    // key for node 9, before its announcement reaches us: the try wins, unannounced,
    // and waits the grace. The announcement comes meanwhile: nothing was granted here,
    // so the key is given back (quietly: nothing ran under it here) and this node holds
    // off, so that node 9 takes it.
    let mut f = Fixture::new();
    let a = f.request(key(1), Mode::Wait, POLL);
    f.try_round(&[key(1)], TryOutcome::Held { by: by(4242) });
    f.advance(2 * POLL);
    f.try_round(&[key(1)], TryOutcome::Won(Some(token(10))));
    assert!(f.granted().is_empty(), "granted without the grace");
    f.advance(ms(5));
    f.table.announced_for(key(1), 4242, Some(9), f.now);
    let plan = f.plan();
    assert_eq!(plan.unlock_quiet, vec![key(1)], "{plan:?}");
    assert!(plan.check.is_empty(), "{plan:?}");
    f.table.unlocked(&[key(1)], f.now);
    assert!(f.granted().is_empty());
    f.advance(HAND_OVER_HOLD - ms(1));
    assert!(f.plan().try_keys.is_empty(), "tried within the hold");
    // Node 9 did not take it: this node does, after the hold, the grace and the check.
    f.advance(ms(1));
    f.try_round(&[key(1)], TryOutcome::Won(Some(token(11))));
    assert!(f.granted().is_empty());
    f.advance(GRACE);
    f.clear_fences(&[key(1)]);
    assert_eq!(f.granted(), vec![(a, token(11))]);
}

#[test]
fn a_win_is_not_given_back_for_a_hand_over_from_a_backend_the_try_did_not_see() {
    // The same race, but the hand-over comes from backend 5151, which the last try did
    // not see holding the key (forged, or a holder since): the win stands.
    let mut f = Fixture::new();
    let a = f.request(key(1), Mode::Wait, POLL);
    f.try_round(&[key(1)], TryOutcome::Held { by: by(4242) });
    f.advance(2 * POLL);
    f.try_round(&[key(1)], TryOutcome::Won(Some(token(10))));
    f.advance(ms(5));
    f.table.announced_for(key(1), 5151, Some(9), f.now);
    f.advance(GRACE);
    f.clear_fences(&[key(1)]);
    assert_eq!(f.granted(), vec![(a, token(10))]);
}

#[test]
fn a_win_by_a_try_that_saw_no_holder_is_given_back_once_for_a_hand_over_to_another_node() {
    // The session was lost while waiting: who holds the key is unknown. The first try
    // on the new session reaches the server just after the holder released the key for
    // node 9: it wins, unannounced, and waits the grace. The hand-over's announcement
    // cannot be checked against a holder this session saw, but giving back a win not
    // yet granted is safe whoever sent it: it is trusted, once.
    let mut f = Fixture::new();
    let a = f.request(key(1), Mode::Wait, POLL);
    f.try_round(&[key(1)], TryOutcome::Held { by: by(4242) });
    f.table.session_ended(f.now);
    f.table.session_started(2, f.now);
    f.try_round(&[key(1)], TryOutcome::Won(Some(token(10))));
    assert!(f.granted().is_empty(), "granted without the grace");
    f.advance(ms(5));
    f.table.announced_for(key(1), 4343, Some(9), f.now);
    let plan = f.plan();
    assert_eq!(plan.unlock_quiet, vec![key(1)], "{plan:?}");
    f.table.unlocked(&[key(1)], f.now);
    f.advance(HAND_OVER_HOLD - ms(1));
    assert!(f.plan().try_keys.is_empty(), "tried within the hold");
    // Node 9 did not take it: this node wins again, and another such announcement (a
    // forged one, say) no longer takes the key from it.
    f.advance(ms(1));
    f.try_round(&[key(1)], TryOutcome::Won(Some(token(11))));
    f.advance(ms(5));
    f.table.announced_for(key(1), 4444, Some(9), f.now);
    assert!(f.plan().unlock_quiet.is_empty());
    f.advance(GRACE);
    f.clear_fences(&[key(1)]);
    assert_eq!(f.granted(), vec![(a, token(11))]);
}

#[test]
fn a_new_request_held_off_by_an_unchecked_hand_over_keeps_the_grace_after_it() {
    // A new request, and before its first try a hand-over to node 9 from a backend no
    // try saw: trusted once, this node holds off. Node 9 may take the key within the
    // hold and lose it silently, so the win after the hold is a contended one: the
    // grace and the fence check, as after every other hold.
    let mut f = Fixture::new();
    let a = f.wait(key(1));
    f.table.announced_for(key(1), 4343, Some(9), f.now);
    assert!(f.plan().try_keys.is_empty(), "not held off for node 9");
    f.advance(HAND_OVER_HOLD);
    f.try_round(&[key(1)], TryOutcome::Won(Some(token(10))));
    assert!(f.granted().is_empty(), "granted without the grace");
    f.advance(GRACE);
    f.clear_fences(&[key(1)]);
    assert_eq!(f.granted(), vec![(a, token(10))]);
}

#[test]
fn a_hold_after_an_announced_release_keeps_the_grace_after_it() {
    // The holder this node saw (backend 4242) announced a release, then, before this
    // node's try, took the key again and handed it to node 9: this node holds off.
    // What the first announcement proved is over: node 9 may take the key within the
    // hold and lose it silently, so the win after the hold waits the grace (here
    // longer than the hold) and the fence check.
    let grace = Duration::from_secs(5);
    let mut f = Fixture::with_rules(Rules {
        node: 0,
        max_locks: 16,
        takeover_grace: grace,
        max_fence_wait: MAX_FENCE,
    });
    let a = f.wait(key(1));
    f.try_round(&[key(1)], TryOutcome::Held { by: by(4242) });
    f.advance(ms(5));
    f.table.announced(key(1), 4242, f.now);
    f.table.announced_for(key(1), 4242, Some(9), f.now);
    assert!(f.plan().try_keys.is_empty(), "not held off for node 9");
    f.advance(HAND_OVER_HOLD);
    f.try_round(&[key(1)], TryOutcome::Won(Some(token(10))));
    assert!(
        f.granted().is_empty(),
        "granted without the grace after a hold"
    );
    f.advance(grace);
    f.clear_fences(&[key(1)]);
    assert_eq!(f.granted(), vec![(a, token(10))]);
}

#[test]
fn forged_hand_overs_hold_a_request_that_comes_and_goes_off_once_in_a_while() {
    // A waiter that withdraws (a timed-out acquire) and comes back gets a new slot: the
    // key remembers that it trusted an unchecked hand-over, so forged ones do not hold
    // it off each time it comes back.
    let mut f = Fixture::new();
    let mut holds = 0;
    for _ in 0..5 {
        let a = f.wait(key(1));
        f.table.announced_for(key(1), 900_123, Some(9), f.now);
        if f.table
            .slots
            .get(&key(1))
            .is_some_and(|s| s.hold_until.is_some())
        {
            holds += 1;
        }
        // A try, if one goes out, finds the key held by nobody it is told of.
        if f.plan().try_keys == [key(1)] {
            f.table
                .tried(&[(key(1), TryOutcome::Held { by: None })], f.now);
        }
        f.advance(ms(900));
        f.table.withdraw(key(1), a, f.now);
        f.advance(HAND_OVER_HOLD);
    }
    assert_eq!(
        holds, 1,
        "held off {holds} times by forged hand-overs, no holder seen"
    );
}

#[test]
fn a_waiter_that_saw_no_holder_holds_off_once_for_a_hand_over_to_another_node() {
    // The same, announced before this session's first try: it holds off once for
    // node 9; a second such announcement is only a cue.
    let mut f = Fixture::new();
    let a = f.request(key(1), Mode::Wait, Duration::from_secs(3600));
    f.try_round(&[key(1)], TryOutcome::Held { by: by(4242) });
    f.table.session_ended(f.now);
    f.table.session_started(2, f.now);
    f.table.announced_for(key(1), 4343, Some(9), f.now);
    f.advance(HAND_OVER_HOLD - ms(1));
    assert!(f.plan().try_keys.is_empty(), "tried within the hold");
    f.advance(ms(1));
    f.try_round(&[key(1)], TryOutcome::Won(Some(token(10))));
    f.table.announced_for(key(1), 4444, Some(9), f.now);
    assert!(f.plan().unlock_quiet.is_empty());
    f.advance(GRACE);
    f.clear_fences(&[key(1)]);
    assert_eq!(f.granted(), vec![(a, token(10))]);
}

#[test]
fn a_node_that_handed_a_key_to_another_does_not_take_it_back_at_once() {
    // This node holds the key and hands it to node 9; its next request (a singleton
    // contending again, a new lease) holds off like every other node's, so that node 9
    // takes it, whether it comes before the unlock is answered or after.
    for before_unlock in [true, false] {
        let mut f = Fixture::new();
        let a = f.request(key(1), Mode::Wait, POLL);
        f.try_round(&[key(1)], TryOutcome::Won(Some(token(10))));
        assert_eq!(f.granted(), vec![(a, token(10))]);
        f.table.release_to(key(1), a, Some(9), f.now);
        let plan = f.plan();
        assert_eq!(plan.hand_to, vec![(key(1), 9)], "{plan:?}");
        if before_unlock {
            f.request(key(1), Mode::Wait, POLL);
        }
        f.table.unlocked(&[key(1)], f.now);
        if !before_unlock {
            f.request(key(1), Mode::Wait, POLL);
        }
        f.advance(HAND_OVER_HOLD - ms(1));
        assert!(
            f.plan().try_keys.is_empty(),
            "tried within the hold ({before_unlock})"
        );
        f.advance(ms(1));
        assert_eq!(f.plan().try_keys, vec![key(1)]);
    }
}

#[test]
fn a_verified_hand_over_to_this_node_tries_at_once() {
    let mut f = Fixture::new();
    let a = f.request(key(1), Mode::Wait, Duration::from_secs(3600));
    f.try_round(&[key(1)], TryOutcome::Held { by: by(4242) });
    f.advance(ms(5));
    f.table.announced_for(key(1), 4242, Some(0), f.now);
    f.try_round(&[key(1)], TryOutcome::Won(Some(token(10))));
    assert_eq!(f.granted(), vec![(a, token(10))]);
}

#[test]
fn a_hand_over_announced_while_the_named_node_s_try_is_in_flight_is_kept() {
    // The holder (backend 4242) hands the key to this node (hash 0) while this node's
    // try is on its way and finds 4242 still holding it: the announcement counts once
    // the try answers, and this node tries at once (not a poll interval later, when the
    // hold for it would have ended and anyone could take the key).
    let mut f = Fixture::new();
    let a = f.request(key(1), Mode::Wait, Duration::from_secs(3600));
    let plan = f.plan();
    assert_eq!(plan.try_keys, vec![key(1)]);
    f.table.announced_for(key(1), 4242, Some(0), f.now);
    f.table.registered(&plan.register);
    f.table
        .tried(&[(key(1), TryOutcome::Held { by: by(4242) })], f.now);
    f.advance(ms(1));
    f.try_round(&[key(1)], TryOutcome::Won(Some(token(10))));
    // Announced by the holder the try saw: no grace.
    assert_eq!(f.granted(), vec![(a, token(10))]);
}

#[test]
fn an_announcement_in_flight_from_a_backend_the_try_did_not_see_is_only_a_cue() {
    // While the try is in flight, backend 5151 announces a hand-over to this node, but
    // the try finds 4242 holding the key: 5151's word is only a cue (a try soon, as for
    // any unverified hand-over naming this node), and the win keeps the grace.
    let mut f = Fixture::new();
    let a = f.request(key(1), Mode::Wait, Duration::from_secs(3600));
    let plan = f.plan();
    f.table.announced_for(key(1), 5151, Some(0), f.now);
    f.table.registered(&plan.register);
    f.table
        .tried(&[(key(1), TryOutcome::Held { by: by(4242) })], f.now);
    f.try_round(&[key(1)], TryOutcome::Won(Some(token(10))));
    assert!(f.granted().is_empty(), "granted without the grace");
    f.advance(GRACE);
    f.clear_fences(&[key(1)]);
    assert_eq!(f.granted(), vec![(a, token(10))]);
}

#[test]
fn a_hand_over_to_another_node_announced_during_the_try_holds_this_one_off() {
    // The sibling rule: handed to node 9 while our try is in flight, and the try saw
    // the sender holding: we hold off for node 9 as if the announcement came after.
    let mut f = Fixture::new();
    let _a = f.request(key(1), Mode::Wait, Duration::from_millis(100));
    let plan = f.plan();
    f.table.announced_for(key(1), 4242, Some(9), f.now);
    f.table.registered(&plan.register);
    f.table
        .tried(&[(key(1), TryOutcome::Held { by: by(4242) })], f.now);
    f.advance(HAND_OVER_HOLD - ms(1));
    assert!(f.plan().try_keys.is_empty(), "tried within the hold");
    f.advance(ms(1));
    assert_eq!(f.plan().try_keys, vec![key(1)]);
}

#[test]
fn an_announcement_during_the_try_counts_as_if_it_came_after_the_answer() {
    // Whatever the answer, an announcement that arrived while the try was in flight
    // has the effect it would have had right after the answer (the order in which the
    // task feeds them), here with the old holder's fence found held by the sender.
    let after_the_answer = |during: bool| {
        let mut f = Fixture::new();
        let _a = f.request(key(1), Mode::Wait, Duration::from_millis(400));
        assert_eq!(f.plan().try_keys, vec![key(1)]);
        if during {
            f.table.announced_for(key(1), 4242, None, f.now);
        }
        f.table.tried(
            &[(
                key(1),
                TryOutcome::WonFenced {
                    token: Some(token(10)),
                    by: Some(4242),
                },
            )],
            f.now,
        );
        if !during {
            f.table.announced_for(key(1), 4242, None, f.now);
        }
        f.table.next_wakeup(f.now).map(|w| w - f.now)
    };
    assert_eq!(after_the_answer(true), after_the_answer(false));
}

#[test]
fn an_announcement_older_than_a_failed_try_vouches_for_nothing() {
    // The holder the last try saw announced its release, but the next try failed: in
    // the time that passed, another session may have held the key and lost it
    // silently. The win after that keeps the grace and the fence check.
    let mut f = Fixture::new();
    let a = f.request(key(1), Mode::Wait, Duration::from_millis(100));
    f.try_round(&[key(1)], TryOutcome::Held { by: by(100) });
    f.table.announced(key(1), 100, f.now);
    f.try_round(&[key(1)], TryOutcome::Failed);
    f.advance(ms(500));
    f.try_round(&[key(1)], TryOutcome::Won(Some(token(10))));
    assert!(
        f.granted().is_empty(),
        "an announcement older than a failed try skipped the grace"
    );
    f.advance(GRACE);
    f.clear_fences(&[key(1)]);
    assert_eq!(f.granted(), vec![(a, token(10))]);
}

#[test]
fn an_announcement_counts_only_for_a_win_soon_after_it() {
    // Verified, but the try that follows is answered later than the grace after it (a
    // frozen or starved process): another session may have taken the key and lost it
    // meanwhile, so the win keeps the grace and the fence check.
    let mut f = Fixture::new();
    let a = f.request(key(1), Mode::Wait, Duration::from_millis(100));
    f.try_round(&[key(1)], TryOutcome::Held { by: by(100) });
    f.table.announced(key(1), 100, f.now);
    let plan = f.plan();
    assert_eq!(plan.try_keys, vec![key(1)], "tried at once");
    f.advance(GRACE + ms(1));
    f.table.senders(&[(key(1), by(100).and_then(|b| b.start))]);
    f.table
        .tried(&[(key(1), TryOutcome::Won(Some(token(10))))], f.now);
    assert!(f.granted().is_empty(), "a late win skipped the grace");
    f.advance(GRACE);
    f.clear_fences(&[key(1)]);
    assert_eq!(f.granted(), vec![(a, token(10))]);
}

#[test]
fn an_unverified_hand_over_holds_nobody_off() {
    // A forged hand-over (not from the backend our last try saw) must not keep us out:
    // it is only a cue, like any unverified announcement.
    let mut f = Fixture::new();
    let a = f.request(key(1), Mode::Wait, Duration::from_secs(3600));
    f.try_round(&[key(1)], TryOutcome::Held { by: by(4242) });
    for forged in 0..100 {
        f.table.announced_for(key(1), forged, Some(9), f.now);
    }
    f.advance(UNVERIFIED_CUE * 11 / 10);
    f.try_round(&[key(1)], TryOutcome::Won(Some(token(10))));
    f.advance(GRACE);
    f.clear_fences(&[key(1)]);
    assert_eq!(f.granted(), vec![(a, token(10))]);
}

#[test]
fn an_unverified_hand_over_to_this_node_tries_once_at_once_and_keeps_the_grace() {
    // This node held off for an earlier hand-over and did not see the new holder: a
    // hand-over naming it is tried at once (not verified: the grace applies), and a
    // flood of such announcements brings at most one try per UNVERIFIED_CUE.
    let mut f = Fixture::new();
    let a = f.request(key(1), Mode::Wait, Duration::from_secs(3600));
    f.try_round(&[key(1)], TryOutcome::Held { by: by(4242) });
    f.advance(ms(5));
    f.table.announced_for(key(1), 5151, Some(0), f.now);
    f.try_round(&[key(1)], TryOutcome::Held { by: by(6000) });
    for forged in 0..100 {
        f.table.announced_for(key(1), 7000 + forged, Some(0), f.now);
    }
    assert!(
        f.plan().try_keys.is_empty(),
        "a flood brought tries forward"
    );
    f.advance(UNVERIFIED_CUE);
    f.table.announced_for(key(1), 8000, Some(0), f.now);
    f.try_round(&[key(1)], TryOutcome::Won(Some(token(10))));
    assert!(f.granted().is_empty(), "the grace was skipped");
    f.advance(GRACE);
    f.clear_fences(&[key(1)]);
    assert_eq!(f.granted(), vec![(a, token(10))]);
}

// ---- hand-over ----------------------------------------------------------------------

#[test]
fn a_hand_over_hold_does_not_vouch_for_the_targets_release() {
    // This node (C, hash 0) waits; its last try saw A (backend 4242) holding. A hands
    // the key over to node 9 (verified): C holds off. Within the hold node 9 takes the
    // key and loses its session (terminated, or its client dropped it on a late
    // heartbeat: its child is still acting or stopping, and its new session has no stop
    // fence yet). C's first try after the hold wins: nothing C saw vouches for node 9's
    // release, so the takeover grace (and the fence check after it) must apply.
    let mut f = Fixture::new();
    let c = f.wait(key(1));
    f.try_round(&[key(1)], TryOutcome::Held { by: by(4242) });
    f.advance(ms(5));
    f.table.announced_for(key(1), 4242, Some(9), f.now);
    // ... node 9 wins the key at the server, and is cut off, within the hold ...
    f.advance(HAND_OVER_HOLD);
    f.try_round(&[key(1)], TryOutcome::Won(Some(token(20))));
    assert!(
        f.granted().is_empty(),
        "granted at once after the hold: the grace was skipped for node 9's unseen release"
    );
    f.advance(GRACE);
    f.clear_fences(&[key(1)]);
    assert_eq!(f.granted(), vec![(c, token(20))]);
}

#[test]
fn the_local_waiter_after_a_hand_over_hold_waits_the_grace() {
    // Same on the releasing node: a local request waits; the holder hands the key over
    // to node 9, which takes it within the hold and loses it unannounced. The local
    // waiter's win after the hold is a takeover from node 9, not a local hand-off.
    let mut f = Fixture::new();
    let a = f.wait(key(1));
    let b = f.wait(key(1));
    f.try_round(&[key(1)], TryOutcome::Won(Some(token(10))));
    assert_eq!(f.granted(), vec![(a, token(10))]);
    f.table.release_to(key(1), a, Some(9), f.now);
    let plan = f.plan();
    assert_eq!(plan.hand_to, vec![(key(1), 9)]);
    f.table.unlocked(&plan.unlock, f.now);
    // ... node 9 wins the key at the server, and is cut off, within the hold ...
    f.advance(HAND_OVER_HOLD);
    f.try_round(&[key(1)], TryOutcome::Won(Some(token(12))));
    assert!(
        f.granted().is_empty(),
        "the local waiter was granted at once after the hold: the grace was skipped"
    );
    f.advance(GRACE);
    f.clear_fences(&[key(1)]);
    assert_eq!(f.granted(), vec![(b, token(12))]);
}

#[test]
fn a_batch_of_hand_overs_fits_the_notify_payload_limit() {
    // A rolling deploy hands every singleton of a node to "web-2" at once: the releases
    // share one plan, and `UNLOCK_SQL` joins up to 200 announcements per NOTIFY. A
    // payload of 8,000 bytes or more fails the statement, which ends the session (every
    // other lease of the process is lost, the hand-overs become unannounced takeovers).
    let mut f = Fixture::with_rules(Rules {
        node: crate::key::node_hash("web-1"),
        max_locks: 4096,
        takeover_grace: GRACE,
        max_fence_wait: MAX_FENCE,
    });
    let mut keys: Vec<LockKey> = (0..200)
        .map(|i| LockKey::derive("chosen", &format!("job-{i}")))
        .collect();
    keys.sort_unstable();
    let ids: Vec<RequestId> = keys.iter().map(|k| f.wait(*k)).collect();
    f.try_round(&keys, TryOutcome::Won(Some(token(1))));
    assert_eq!(f.granted().len(), 200);
    let to = crate::key::node_hash("web-2");
    for (k, id) in keys.iter().zip(&ids) {
        f.table.release_to(*k, *id, Some(to), f.now);
    }
    let plan = f.plan();
    assert_eq!(plan.unlock.len(), 200);
    // As `Session::perform` builds the tags and `UNLOCK_SQL` groups them.
    let tags: Vec<String> = plan
        .unlock
        .iter()
        .map(|k| {
            let to = plan.hand_to.iter().find(|(h, _)| h == k).map(|(_, n)| *n);
            k.announcement(to)
        })
        .collect();
    let per_notify = crate::pg::ANNOUNCEMENTS_PER_NOTIFY;
    for chunk in tags.chunks(per_notify) {
        let payload = chunk.join(",");
        assert!(
            payload.len() < 8000,
            "a NOTIFY payload of {} bytes: pg_notify fails with 'payload string too long'",
            payload.len()
        );
    }
}

#[test]
fn announcements_from_the_backend_last_seen_cannot_hold_a_waiter_off_forever() {
    // Each verified hand-over to another node pushes the next try a full hold away, and
    // since no try happens during a hold, the backend last seen holding the key stays
    // "verified" for good: one that keeps announcing hand-overs (a reused backend pid,
    // or a misbehaving peer) holds the waiter off indefinitely.
    let mut f = Fixture::new();
    let _c = f.wait(key(1));
    f.try_round(&[key(1)], TryOutcome::Held { by: by(4242) });
    f.advance(ms(5));
    for _ in 0..60 {
        f.table.announced_for(key(1), 4242, Some(9), f.now);
        f.advance(ms(900));
        if !f.plan().try_keys.is_empty() {
            return;
        }
    }
    panic!("not tried for 54 s: repeated hand-over announcements starved the waiter");
}

#[test]
fn a_forged_hand_over_to_this_node_does_not_override_a_verified_hold() {
    // A hands the key over to node 9 (verified here). Anyone may then NOTIFY the same
    // key "for" this node: the hold is dropped and this node tries at once, racing the
    // named node (it wins with no grace, as after A's announced release). A forger picks
    // who gets the lock (node ids are visible in pg_stat_activity.application_name).
    let mut f = Fixture::new();
    let _c = f.wait(key(1));
    f.try_round(&[key(1)], TryOutcome::Held { by: by(4242) });
    f.advance(ms(5));
    f.table.announced_for(key(1), 4242, Some(9), f.now);
    f.table.announced_for(key(1), 31337, Some(0), f.now);
    assert!(
        f.plan().try_keys.is_empty(),
        "a forged hand-over to this node overrode a verified hold for node 9"
    );
}

#[test]
fn a_try_during_the_releasers_hold_is_answered_at_once() {
    // A try request made on the releasing node while its hand-over's unlock is on its
    // way: it is neither refused (Busy) nor tried; it waits out the whole hold.
    let mut f = Fixture::new();
    let a = f.wait(key(1));
    f.try_round(&[key(1)], TryOutcome::Won(Some(token(10))));
    assert_eq!(f.granted(), vec![(a, token(10))]);
    f.table.release_to(key(1), a, Some(9), f.now);
    let plan = f.plan();
    let t = f.try_(key(1));
    f.table.unlocked(&plan.unlock, f.now);
    f.advance(ms(1));
    let tried = f.plan().try_keys;
    let answered = f
        .actions()
        .iter()
        .any(|a| matches!(a, Action::Refuse { id, .. } if *id == t));
    assert!(
        answered || tried == vec![key(1)],
        "a try request waits up to HAND_OVER_HOLD (next wake-up {:?} from now)",
        f.table.next_wakeup(f.now).map(|w| w - f.now)
    );
}

#[test]
fn forged_hand_overs_to_this_node_for_many_keys_share_one_statement() {
    // The plain unverified cue is on a shared tick so that a spaced-out forged flood over
    // many keys costs one statement per UNVERIFIED_CUE (the test above). The new branch
    // for an unverified hand-over naming this node tries each key at once: a forger that
    // names this node (its id is its application_name) key after key, 30 ms apart, gets
    // one try statement per key.
    let mut f = Fixture::new();
    let keys: Vec<LockKey> = (1..=12).map(key).collect();
    for k in &keys {
        f.request(*k, Mode::Wait, Duration::from_secs(3600));
    }
    f.try_round(&keys, TryOutcome::Held { by: by(9) });
    let mut statements = 0;
    let end = f.now + Duration::from_secs(3);
    let mut next = 0;
    while f.now < end {
        if next < keys.len() {
            f.table.announced_for(keys[next], 12345, Some(0), f.now);
            next += 1;
        }
        let plan = f.plan();
        if !plan.try_keys.is_empty() {
            statements += 1;
            let outcomes: Vec<_> = plan
                .try_keys
                .iter()
                .map(|k| (*k, TryOutcome::Held { by: by(9) }))
                .collect();
            f.table.tried(&outcomes, f.now);
        }
        f.advance(ms(30));
    }
    assert!(
        statements <= 3,
        "{statements} try statements for {} forged hand-overs in {} ms",
        keys.len(),
        keys.len() * 30
    );
}

#[test]
fn the_unlock_statement_groups_announcements_as_the_payload_limit_allows() {
    let per = crate::pg::ANNOUNCEMENTS_PER_NOTIFY;
    assert!(
        crate::pg::UNLOCK_SQL_FOR_TESTS.contains(&format!("GROUP BY (t.j - 1) / {per}")),
        "UNLOCK_SQL groups by another number than ANNOUNCEMENTS_PER_NOTIFY"
    );
    // The longest entry: a pair of the most negative keys, handed over.
    let longest = LockKey::Pair(i32::MIN, i32::MIN).announcement(Some(u64::MAX));
    assert!((longest.len() + 1) * per < 8000, "{}", longest.len());
}

// A grant refused because the shutdown began while its try was in flight (or whose
// caller left) is unlocked quietly, as a win refused before it was granted is: an
// announcement would let another node skip the takeover grace although whoever held
// the key before may still be stopping. The same in either order.
#[test]
fn a_won_key_refused_at_shutdown_is_unlocked_quietly_in_either_order() {
    // (a) The shutdown is read first, then the try's result.
    let mut f = Fixture::new();
    f.wait(key(1));
    let plan = f.plan();
    assert_eq!(plan.try_keys, vec![key(1)]);
    f.table.begin_close();
    f.table
        .tried(&[(key(1), TryOutcome::Won(Some(token(10))))], f.now);
    assert!(f.granted().is_empty());
    let plan = f.plan();
    assert_eq!((plan.unlock, plan.unlock_quiet), (vec![], vec![key(1)]));

    // (b) The try's result is read first (a grant), then the driver refuses it.
    let mut f = Fixture::new();
    let w = f.wait(key(1));
    f.try_round(&[key(1)], TryOutcome::Won(Some(token(10))));
    assert_eq!(f.granted(), vec![(w, token(10))]);
    f.table.undelivered(key(1), w, f.now);
    let plan = f.plan();
    assert_eq!(
        (plan.unlock.clone(), plan.unlock_quiet.clone()),
        (vec![], vec![key(1)])
    );
    f.table.unlocked(&plan.unlock_quiet, f.now);
    assert_eq!(f.table.held(), 0);
    // Nothing was delivered, so nothing is reported released (a metrics sink counting
    // acquisitions and releases stays balanced).
    let released: Vec<Action> = f
        .actions()
        .into_iter()
        .filter(|a| matches!(a, Action::Released { .. }))
        .collect();
    assert!(released.is_empty(), "{released:?}");
}

#[test]
fn a_grant_that_never_reached_its_request_stays_quiet_through_a_failed_hand_off_and_a_shutdown() {
    // Two local waiters; the first one's grant never reaches it (the caller gave up).
    // The key goes to the second by a local hand-off, whose token statement fails:
    // nothing ran here, and whoever held the key before may still be stopping, so the
    // key is unlocked without an announcement (a waiter elsewhere would skip its grace
    // on it).
    let mut f = Fixture::new();
    let w = f.wait(key(1));
    let _second = f.wait(key(1));
    f.try_round(&[key(1)], TryOutcome::Won(Some(token(10))));
    assert_eq!(f.granted(), vec![(w, token(10))]);
    f.table.undelivered(key(1), w, f.now);
    let plan = f.plan();
    assert_eq!(plan.token_for, vec![key(1)]);
    f.table
        .tokens(&plan.token_for, &plan.token_read, None, f.now);
    let plan = f.plan();
    assert_eq!(
        (plan.unlock.clone(), plan.unlock_quiet.clone()),
        (vec![], vec![key(1)]),
        "a failed hand-off after an undelivered grant announced its release"
    );

    // The same hand-off cut short by a shutdown: quiet too.
    let mut f = Fixture::new();
    let w = f.wait(key(1));
    let _second = f.wait(key(1));
    f.try_round(&[key(1)], TryOutcome::Won(Some(token(10))));
    assert_eq!(f.granted(), vec![(w, token(10))]);
    f.table.undelivered(key(1), w, f.now);
    f.table.begin_close();
    let plan = f.plan();
    assert_eq!(
        (plan.unlock.clone(), plan.unlock_quiet.clone()),
        (vec![], vec![key(1)]),
        "a shutdown after an undelivered grant announced its release"
    );

    // The second waiter withdraws before the hand-off's token arrives: quiet too.
    let mut f = Fixture::new();
    let w = f.wait(key(1));
    let second = f.wait(key(1));
    f.try_round(&[key(1)], TryOutcome::Won(Some(token(10))));
    assert_eq!(f.granted(), vec![(w, token(10))]);
    f.table.undelivered(key(1), w, f.now);
    let plan = f.plan();
    assert_eq!(plan.token_for, vec![key(1)]);
    f.table.withdraw(key(1), second, f.now);
    f.table
        .tokens(&plan.token_for, &plan.token_read, Some(token(11)), f.now);
    let plan = f.plan();
    assert_eq!(
        (plan.unlock.clone(), plan.unlock_quiet.clone()),
        (vec![], vec![key(1)]),
        "a hand-off nobody waited for any more announced its release"
    );

    // A holder that released it: its work stopped, so a failed hand-off announces.
    let mut f = Fixture::new();
    let w = f.wait(key(1));
    let _second = f.wait(key(1));
    f.try_round(&[key(1)], TryOutcome::Won(Some(token(10))));
    assert_eq!(f.granted(), vec![(w, token(10))]);
    f.table.release_to(key(1), w, None, f.now);
    let plan = f.plan();
    assert_eq!(plan.token_for, vec![key(1)]);
    f.table
        .tokens(&plan.token_for, &plan.token_read, None, f.now);
    let plan = f.plan();
    assert_eq!(plan.unlock, vec![key(1)]);
}

#[test]
fn an_announcement_that_arrives_during_a_slow_try_keeps_its_arrival() {
    // 4242 announces during our try; the try answers later than the grace after that
    // (4242 took the key again before it ran, and is seen holding): the announcement
    // is verified against that answer but is old, so the next win keeps the grace.
    let mut f = Fixture::new();
    let a = f.request(key(1), Mode::Wait, Duration::from_secs(3600));
    let plan = f.plan();
    assert_eq!(plan.try_keys, vec![key(1)]);
    f.table.announced_for(key(1), 4242, Some(0), f.now);
    f.advance(GRACE + ms(1));
    f.table.registered(&plan.register);
    f.table
        .tried(&[(key(1), TryOutcome::Held { by: by(4242) })], f.now);
    f.try_round(&[key(1)], TryOutcome::Won(Some(token(10))));
    assert!(
        f.granted().is_empty(),
        "a stale in-flight announcement skipped the grace"
    );
    f.advance(GRACE);
    f.clear_fences(&[key(1)]);
    assert_eq!(f.granted(), vec![(a, token(10))]);
}

#[test]
fn an_announcement_read_after_a_slow_try_answered_keeps_its_arrival() {
    // As the task does: a notification that arrived during the try is read after the
    // answer, with its arrival; too old by the next win, so the grace is kept.
    let mut f = Fixture::new();
    let a = f.request(key(1), Mode::Wait, Duration::from_secs(3600));
    let plan = f.plan();
    assert_eq!(plan.try_keys, vec![key(1)]);
    let arrived = f.now;
    f.advance(GRACE + ms(1));
    f.table.registered(&plan.register);
    f.table
        .tried(&[(key(1), TryOutcome::Held { by: by(4242) })], f.now);
    f.table.announced_for(key(1), 4242, Some(0), arrived);
    f.try_round(&[key(1)], TryOutcome::Won(Some(token(10))));
    assert!(
        f.granted().is_empty(),
        "a stale announcement skipped the grace"
    );
    f.advance(GRACE);
    f.clear_fences(&[key(1)]);
    assert_eq!(f.granted(), vec![(a, token(10))]);
}

#[test]
fn a_lazy_request_is_won_without_a_token_and_reads_one_while_it_holds() {
    let mut f = Fixture::new();
    let id = f.wait_lazily(key(1));
    let plan = f.plan();
    assert_eq!(plan.try_keys, vec![key(1)]);
    assert_eq!(plan.lazy, vec![key(1)], "its try takes no token");
    f.table.tried(&[(key(1), TryOutcome::Won(None))], f.now);
    assert_eq!(f.granted_lazily(), vec![(id, None)]);
    assert_eq!(f.table.read_token(key(1), id), TokenRead::Pending);
    let plan = f.plan();
    assert_eq!(
        plan.token_read,
        vec![key(1)],
        "one token statement issues it"
    );
    assert!(plan.token_for.is_empty() && plan.try_keys.is_empty());
    // A second read while the first is in flight waits for the same answer.
    assert_eq!(f.table.read_token(key(1), id), TokenRead::Pending);
    assert!(f.plan().is_empty());
    f.table
        .tokens(&[], &plan.token_read, Some(token(20)), f.now);
    assert_eq!(f.read_answers(), vec![(id, Some(token(20)))]);
    assert_eq!(f.table.read_token(key(1), id), TokenRead::Known(token(20)));
    assert!(f.plan().is_empty(), "known: no statement");
    assert_eq!(f.table.read_token(key(1), id + 1), TokenRead::NotHeld);
}

#[test]
fn a_token_read_fails_when_the_statement_fails_and_may_be_read_again() {
    let mut f = Fixture::new();
    let id = f.wait_lazily(key(1));
    f.try_round(&[key(1)], TryOutcome::Won(None));
    assert_eq!(f.granted_lazily(), vec![(id, None)]);
    assert_eq!(f.table.read_token(key(1), id), TokenRead::Pending);
    let plan = f.plan();
    f.table.tokens(&[], &plan.token_read, None, f.now);
    assert_eq!(f.read_answers(), vec![(id, None)]);
    assert_eq!(f.table.held(), 1, "the lease is still held");
    assert_eq!(f.table.read_token(key(1), id), TokenRead::Pending);
    let plan = f.plan();
    f.table
        .tokens(&[], &plan.token_read, Some(token(21)), f.now);
    assert_eq!(f.read_answers(), vec![(id, Some(token(21)))]);
}

#[test]
fn a_token_read_pending_when_the_lease_ends_is_answered_without_a_token() {
    // Released while the read is in flight: answered at once, and the late token is
    // handed to nobody.
    let mut f = Fixture::new();
    let id = f.wait_lazily(key(1));
    f.try_round(&[key(1)], TryOutcome::Won(None));
    f.granted_lazily();
    f.table.read_token(key(1), id);
    let plan = f.plan();
    f.table.release(key(1), id, f.now);
    assert_eq!(f.read_answers(), vec![(id, None)]);
    f.table
        .tokens(&[], &plan.token_read, Some(token(30)), f.now);
    assert!(f.read_answers().is_empty(), "the late token goes to nobody");
    // Lost with the session while asked but not sent.
    let mut f = Fixture::new();
    let id = f.wait_lazily(key(1));
    f.try_round(&[key(1)], TryOutcome::Won(None));
    f.granted_lazily();
    f.table.read_token(key(1), id);
    f.table.session_ended(f.now);
    assert_eq!(f.read_answers(), vec![(id, None)]);
}

#[test]
fn an_eager_request_won_by_a_lazy_try_gets_a_token_before_its_grant() {
    let mut f = Fixture::new();
    let lazy = f.wait_lazily(key(1));
    let eager = f.wait(key(1));
    let plan = f.plan();
    assert_eq!(plan.lazy, vec![key(1)], "the head waiter decides");
    // The lazy head gives up while the try is in flight.
    f.table.withdraw(key(1), lazy, f.now);
    f.table.tried(&[(key(1), TryOutcome::Won(None))], f.now);
    assert!(
        f.granted_lazily().is_empty(),
        "not granted without its token"
    );
    let plan = f.plan();
    assert_eq!(plan.token_for, vec![key(1)]);
    f.table.tokens(&plan.token_for, &[], Some(token(40)), f.now);
    assert_eq!(f.granted_lazily(), vec![(eager, Some(token(40)))]);
}

#[test]
fn a_local_hand_off_to_a_lazy_waiter_needs_no_statement_and_no_earlier_token() {
    let mut f = Fixture::new();
    let a = f.wait(key(1));
    let b = f.wait_lazily(key(1));
    f.try_round(&[key(1)], TryOutcome::Won(Some(token(50))));
    assert_eq!(f.granted_lazily(), vec![(a, Some(token(50)))]);
    f.table.release(key(1), a, f.now);
    assert!(f.plan().is_empty(), "no statement");
    assert_eq!(
        f.granted_lazily(),
        vec![(b, None)],
        "granted by the next plan, never with the earlier holder's token"
    );
    assert_eq!(f.table.read_token(key(1), b), TokenRead::Pending);
    let plan = f.plan();
    assert_eq!(plan.token_read, vec![key(1)]);
    f.table
        .tokens(&[], &plan.token_read, Some(token(51)), f.now);
    assert_eq!(f.read_answers(), vec![(b, Some(token(51)))]);
}
