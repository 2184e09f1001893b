//! A watch handle on "is this node the leader of a name".

use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use tokio::sync::watch;

use crate::lease::{Lease, Validity};
use crate::metrics::MetricsSink;
use crate::token::FencingToken;

/// Who leads a name, as this node sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum LeaderState {
    /// This node holds a valid lease for the name.
    Leading {
        /// The fencing token of the lease.
        token: FencingToken,
        /// When leadership was gained (wall clock).
        since: SystemTime,
    },
    /// Another node leads, or nobody does, or this node's lease was just lost.
    Following {
        /// The leader's node id, when known (refreshed every couple of seconds).
        leader: Option<String>,
    },
    /// The election was stopped on this node.
    Stopped,
}

#[derive(Clone, Debug)]
struct Snapshot {
    state: LeaderState,
    validity: Option<Validity>,
}

/// A cheap, cloneable handle on this node's leadership of one name, in the manner of
/// `CancellationToken`: a synchronous [`is_leader`](Self::is_leader) plus awaitable
/// transitions ([`changed`](Self::changed), [`wait_leading`](Self::wait_leading)).
///
/// [`is_leader`](Self::is_leader) is not a stale flag: it checks the lease deadline
/// at the moment of the call, so it turns `false` as soon as the lease can no longer be
/// trusted, even before the election task has noticed.
///
/// Get one from an [`Election`](crate::Election) or a [`Singleton`](crate::Singleton),
/// or (feature `deadpool`) a follower-only one from an `Observer`, which reads who
/// leads through the application's pool.
#[derive(Clone)]
pub struct Leadership {
    inner: Arc<Inner>,
}

struct Inner {
    name: String,
    /// The namespace the name's key was derived in; `None` for a raw key.
    namespace: Option<String>,
    node_id: String,
    tx: watch::Sender<Snapshot>,
    metrics: Option<Arc<dyn MetricsSink>>,
    /// What this node saw of the leader so far, for the leadership metrics.
    observed: Mutex<Observed>,
}

/// What a node saw of a lock's leader: its observations are the leader look-ups of a
/// follower, the wins and the ends of its own terms. Turns them into the leaderless
/// time and the changes of hands that [`MetricsSink::leaderless`] and
/// [`MetricsSink::leader_changed`] describe.
#[derive(Debug, Default)]
struct Observed {
    /// The last observation: when, and whether it saw nobody lead.
    last: Option<(tokio::time::Instant, bool)>,
    /// The last leader seen.
    leader: Option<String>,
    /// Nobody was seen leading since `leader` was.
    gap: bool,
}

/// What one observation adds to the metrics.
#[derive(Debug, PartialEq, Eq)]
struct Seen {
    /// Leaderless time to add (zero at the first observation).
    leaderless: Option<Duration>,
    /// The leadership changed hands.
    changed: bool,
}

impl Observed {
    /// Notes an observation made `now`: `leader` leads (`None`: nobody does);
    /// `free_before`: the lock was free just before (this node just won it).
    fn see(&mut self, now: tokio::time::Instant, leader: Option<&str>, free_before: bool) -> Seen {
        let leaderless = match self.last {
            None => Some(Duration::ZERO),
            // Both ends of the interval saw nobody: leaderless throughout, as far as
            // this node can tell. An interval with a leader at one end counts nothing.
            Some((at, true)) if leader.is_none() || free_before => {
                Some(now.saturating_duration_since(at))
            }
            Some(_) => None,
        };
        self.last = Some((now, leader.is_none()));
        let changed = match leader {
            Some(leader) => {
                let changed = self
                    .leader
                    .as_deref()
                    .is_some_and(|old| old != leader || self.gap);
                if self.leader.as_deref() != Some(leader) {
                    self.leader = Some(leader.to_owned());
                }
                self.gap = false;
                changed
            }
            None => {
                self.gap = true;
                false
            }
        };
        Seen {
            leaderless,
            changed,
        }
    }

    /// Notes that the leader could not be read: what follows is not measured from the
    /// last observation (nothing is known of the time between).
    #[cfg(feature = "deadpool")]
    fn see_unknown(&mut self) -> Seen {
        self.last = None;
        Seen {
            leaderless: None,
            changed: false,
        }
    }

    /// Notes an observation made `now` of the lock held by this node's own id (a former
    /// session of this node): held, so no leaderless time, but no leader either (the
    /// leader's succession is judged by the next observation of another holder or of
    /// nobody, not by a session of this node that is already over).
    fn see_held_here(&mut self, now: tokio::time::Instant) -> Seen {
        let leaderless = self.last.is_none().then_some(Duration::ZERO);
        self.last = Some((now, false));
        Seen {
            leaderless,
            changed: false,
        }
    }
}

impl fmt::Debug for Leadership {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Leadership")
            .field("name", &self.inner.name)
            .field("namespace", &self.inner.namespace)
            .field("node_id", &self.inner.node_id)
            .field("state", &self.state())
            .finish()
    }
}

impl Leadership {
    pub(crate) fn new(
        name: &str,
        namespace: Option<&str>,
        node_id: &str,
        metrics: Option<Arc<dyn MetricsSink>>,
    ) -> Self {
        let (tx, _) = watch::channel(Snapshot {
            state: LeaderState::Following { leader: None },
            validity: None,
        });
        Self {
            inner: Arc::new(Inner {
                name: name.to_owned(),
                namespace: namespace.map(str::to_owned),
                node_id: node_id.to_owned(),
                tx,
                metrics,
                observed: Mutex::default(),
            }),
        }
    }

    /// A leadership that a test sets by hand (no database), with its controller; its
    /// name is taken as derived in the default namespace
    /// ([`DEFAULT_NAMESPACE`](crate::DEFAULT_NAMESPACE)).
    #[cfg(any(test, feature = "test-util"))]
    #[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
    #[must_use]
    pub fn manual(name: &str, node_id: &str) -> (Self, ManualLeadership) {
        Self::manual_in(Some(crate::key::DEFAULT_NAMESPACE), name, node_id)
    }

    /// [`manual`](Self::manual), with a metrics sink that code reading the leadership
    /// reports to through [`metrics`](Self::metrics), as it would to a manager's.
    #[cfg(any(test, feature = "test-util"))]
    #[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
    #[must_use]
    pub fn manual_with_metrics(
        name: &str,
        node_id: &str,
        metrics: Arc<dyn MetricsSink>,
    ) -> (Self, ManualLeadership) {
        let leadership = Self::new(
            name,
            Some(crate::key::DEFAULT_NAMESPACE),
            node_id,
            Some(metrics),
        );
        let control = ManualLeadership {
            leadership: leadership.clone(),
            lease: Arc::default(),
        };
        (leadership, control)
    }

    /// [`manual`](Self::manual), for a name derived in `namespace` (`None`: a raw key's
    /// leadership, named `key(..)`).
    #[cfg(any(test, feature = "test-util"))]
    #[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
    #[must_use]
    pub fn manual_in(
        namespace: Option<&str>,
        name: &str,
        node_id: &str,
    ) -> (Self, ManualLeadership) {
        let leadership = Self::new(name, namespace, node_id, None);
        let control = ManualLeadership {
            leadership: leadership.clone(),
            lease: Arc::default(),
        };
        (leadership, control)
    }

    pub(crate) fn set_leading(&self, lease: &Lease) {
        // Before publishing: code woken by the change sees the metrics that go with it
        // (sinks are called inline and must be cheap, see `MetricsSink`).
        self.observe(Some(&self.inner.node_id), true);
        self.inner.tx.send_replace(Snapshot {
            state: LeaderState::Leading {
                token: lease.eager_token(),
                since: lease.acquired_at(),
            },
            validity: Some(lease.validity()),
        });
    }

    /// Following `leader` (`None`: nobody leads, as this node just found at the end of
    /// its own term). Every call is an observation for the metrics, a repeated one too.
    pub(crate) fn set_following(&self, leader: Option<String>) {
        self.observe(leader.as_deref(), false);
        self.follow(leader);
    }

    /// Following after a look-up found `holder` holding the lock (`None`: nobody).
    /// A holder with this node's own id is not published as the leader (it is a former
    /// session of this node, still open, or another leadership of the same lock in this
    /// process, or a replica misconfigured with the same id), but the lock is held: the
    /// metrics see it held, not leaderless.
    pub(crate) fn set_following_holder(&self, holder: Option<String>) {
        if holder.as_deref() == Some(self.inner.node_id.as_str()) {
            self.report(|o, now| o.see_held_here(now));
            self.follow(None);
        } else {
            self.observe(holder.as_deref(), false);
            self.follow(holder);
        }
    }

    /// Following, with the leader unknown (a look-up failed): no observation for the
    /// metrics.
    /// The time until the next observation is not counted as leaderless.
    #[cfg(feature = "deadpool")]
    pub(crate) fn set_unknown(&self) {
        self.report(|o, _| o.see_unknown());
        self.follow(None);
    }

    /// How many handles of this leadership exist (the observer keeps one).
    #[cfg(feature = "deadpool")]
    pub(crate) fn handles(&self) -> usize {
        Arc::strong_count(&self.inner)
    }

    fn follow(&self, leader: Option<String>) {
        self.inner.tx.send_if_modified(|snap| {
            let next = LeaderState::Following { leader };
            if snap.state == next {
                return false;
            }
            *snap = Snapshot {
                state: next,
                validity: None,
            };
            true
        });
    }

    pub(crate) fn set_stopped(&self) {
        *self
            .inner
            .observed
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Observed::default();
        self.inner.tx.send_replace(Snapshot {
            state: LeaderState::Stopped,
            validity: None,
        });
    }

    /// Reports an observation of the leader to the metrics sink, if there is one.
    fn observe(&self, leader: Option<&str>, free_before: bool) {
        self.report(|o, now| o.see(now, leader, free_before));
    }

    /// Notes an observation with `see` and reports what it adds to the sink, if any.
    fn report(&self, see: impl FnOnce(&mut Observed, tokio::time::Instant) -> Seen) {
        let Some(m) = self.inner.metrics.as_deref() else {
            return;
        };
        let seen = see(
            &mut self
                .inner
                .observed
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
            tokio::time::Instant::now(),
        );
        let (node, lock) = (self.inner.node_id.as_str(), self.inner.name.as_str());
        if let Some(leaderless) = seen.leaderless {
            m.leaderless(node, lock, leaderless);
        }
        if seen.changed {
            m.leader_changed(node, lock);
        }
    }

    /// The lock name.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The namespace the lock's key was derived in from its name
    /// ([`ManagerOptions::namespace`](crate::ManagerOptions::namespace)): two
    /// leaderships of one name in two namespaces are two locks. `None` for a raw key's
    /// leadership ([`LockKey`](crate::LockKey), named `key(..)`), the same lock in every
    /// namespace.
    #[must_use]
    pub fn namespace(&self) -> Option<&str> {
        self.inner.namespace.as_deref()
    }

    /// This node's id.
    #[must_use]
    pub fn node_id(&self) -> &str {
        &self.inner.node_id
    }

    /// The metrics sink of the manager this leadership comes from, if one was set
    /// ([`ManagerOptions::metrics`](crate::ManagerOptions::metrics)); adapters report
    /// through it.
    #[must_use]
    pub fn metrics(&self) -> Option<&dyn MetricsSink> {
        self.inner.metrics.as_deref()
    }

    /// The state right now. A `Leading` state whose lease deadline has passed is
    /// reported as `Following { leader: None }`.
    #[must_use]
    pub fn state(&self) -> LeaderState {
        let snap = self.inner.tx.borrow();
        match (&snap.state, &snap.validity) {
            (LeaderState::Leading { .. }, Some(v)) if !v.is_valid() => {
                LeaderState::Following { leader: None }
            }
            (state, _) => state.clone(),
        }
    }

    /// `true` while this node leads with a lease that may be trusted right now.
    /// Cheap (a read lock, a clock read and two atomics; no allocation): call it per
    /// request or before each guarded step.
    #[must_use]
    pub fn is_leader(&self) -> bool {
        let snap = self.inner.tx.borrow();
        matches!(snap.state, LeaderState::Leading { .. })
            && snap.validity.as_ref().is_none_or(Validity::is_valid)
    }

    /// The fencing token while leading.
    #[must_use]
    pub fn fencing_token(&self) -> Option<FencingToken> {
        match self.state() {
            LeaderState::Leading { token, .. } => Some(token),
            _ => None,
        }
    }

    /// The leader's node id: this node's while leading, the holder's (when known)
    /// while following.
    #[must_use]
    pub fn leader(&self) -> Option<String> {
        match self.state() {
            LeaderState::Leading { .. } => Some(self.inner.node_id.clone()),
            LeaderState::Following { leader } => leader,
            LeaderState::Stopped => None,
        }
    }

    /// Waits for the next change of state and returns the new state.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    pub async fn changed(&self) -> LeaderState {
        let mut rx = self.inner.tx.subscribe();
        let _ = rx.changed().await;
        self.state()
    }

    /// Waits until this node leads and returns the fencing token (at once if it
    /// already does). Never resolves after the election stopped.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    pub async fn wait_leading(&self) -> FencingToken {
        let mut rx = self.inner.tx.subscribe();
        loop {
            if let Some(token) = self.fencing_token() {
                return token;
            }
            if rx.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }

    /// Waits until this node does not lead (at once if it does not): the moment its
    /// lease can no longer be trusted, even before the election task notices.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    pub async fn wait_not_leading(&self) {
        let mut rx = self.inner.tx.subscribe();
        loop {
            let validity = {
                let snap = rx.borrow_and_update();
                match (&snap.state, &snap.validity) {
                    (LeaderState::Leading { .. }, Some(v)) if v.is_valid() => Some(v.clone()),
                    (LeaderState::Leading { .. }, None) => None,
                    _ => return,
                }
            };
            match validity {
                Some(v) => {
                    tokio::select! {
                        biased;
                        _ = v.lost() => return,
                        r = rx.changed() => if r.is_err() { return },
                    }
                }
                None => {
                    if rx.changed().await.is_err() {
                        return;
                    }
                }
            }
        }
    }
}

/// Sets a [`Leadership`] by hand, for tests of code that reads one (feature
/// `test-util`).
///
/// [`lead`](Self::lead) leads with no deadline; [`lead_until`](Self::lead_until) leads
/// with a lease checked exactly as real leases are, so a test can reach "the state
/// says `Leading` but the lease deadline has passed", the window before the election
/// task notices a lost lease.
#[cfg(any(test, feature = "test-util"))]
#[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
#[derive(Debug, Clone)]
pub struct ManualLeadership {
    leadership: Leadership,
    /// The lease of the last [`lead_until`](Self::lead_until), for
    /// [`expire`](Self::expire).
    lease: Arc<std::sync::Mutex<Option<ManualLease>>>,
}

/// The parts of a hand-made lease that decide its validity.
#[cfg(any(test, feature = "test-util"))]
#[derive(Debug)]
struct ManualLease {
    generation: Arc<crate::generation::Generation>,
    lease_timeout: std::time::Duration,
    /// Kept alive: a dropped lease ends its validity.
    _lease: Lease,
}

#[cfg(any(test, feature = "test-util"))]
impl ManualLeadership {
    /// Leading with `token`, with no deadline: leading until told otherwise.
    pub fn lead(&self, token: u64) {
        self.forget_lease();
        self.leadership.inner.tx.send_replace(Snapshot {
            state: LeaderState::Leading {
                token: FencingToken::new(token),
                since: SystemTime::now(),
            },
            validity: None,
        });
    }

    /// Leading with `token`, under a lease trusted strictly before `deadline`, checked
    /// the way real leases are. Past the deadline the state stored stays `Leading` (as
    /// when the election task has not noticed yet), while
    /// [`Leadership::is_leader`] is `false`, [`Leadership::state`] reports
    /// `Following { leader: None }` and [`Leadership::wait_not_leading`] resolves.
    ///
    /// `deadline` is on the clock tokio's timers use, as real leases' are: take it as
    /// `tokio::time::Instant::now().into_std() + d` (the same as
    /// `std::time::Instant::now() + d` unless tokio's time is paused, when it is the
    /// paused clock, and the lease is checked against that clock inside that runtime).
    /// A deadline already passed gives a lease that is expired from the start.
    pub fn lead_until(&self, token: u64, deadline: std::time::Instant) {
        let options = crate::ManagerOptions::from_url("postgres://manual@localhost/manual")
            .expect("BUG: static URL parses");
        let lease_timeout = options.lease_timeout;
        let shared = Arc::new(crate::shared::Shared::new(
            options,
            crate::ConnectionState::Connecting { attempt: 1 },
        ));
        shared.extend_validity(deadline);
        let generation = crate::generation::Generation::new(0);
        let name = self.leadership.name();
        // Unarmed: dropping it releases nothing.
        let lease = Lease::new(crate::command::Grant::new(
            0,
            Arc::from(name),
            crate::LockKey::derive("manual", name),
            Some(FencingToken::new(token)),
            Arc::clone(&generation),
            shared,
            None,
        ));
        self.leadership.set_leading(&lease);
        *self.lease_slot() = Some(ManualLease {
            generation,
            lease_timeout,
            _lease: lease,
        });
    }

    /// The deadline of the lease given by the last [`lead_until`](Self::lead_until)
    /// passes now: as [`lead_until`](Self::lead_until) describes past its deadline, and
    /// waiters wake at once. The state stored keeps saying `Leading`.
    ///
    /// # Panics
    ///
    /// If the leadership is not leading under a lease from
    /// [`lead_until`](Self::lead_until) (a test bug).
    pub fn expire(&self) {
        let slot = self.lease_slot();
        let lease = slot
            .as_ref()
            .expect("expire() needs a lease from lead_until(); lead() has no deadline");
        // The reason a real lease reports once its deadline passed unnoticed.
        lease
            .generation
            .revoke(crate::SessionDownReason::HeartbeatOverdue {
                lease_timeout: lease.lease_timeout,
            });
    }

    /// Following `leader`.
    pub fn follow(&self, leader: Option<&str>) {
        self.forget_lease();
        self.leadership.set_following(leader.map(str::to_owned));
    }

    /// Stopped.
    pub fn stop(&self) {
        self.forget_lease();
        self.leadership.set_stopped();
    }

    fn lease_slot(&self) -> std::sync::MutexGuard<'_, Option<ManualLease>> {
        self.lease
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn forget_lease(&self) {
        *self.lease_slot() = None;
    }
}

#[cfg(test)]
mod manual_tests {
    use std::time::{Duration, Instant};

    use super::{LeaderState, Leadership};

    #[test]
    fn a_passed_deadline_turns_leading_into_not_leading() {
        let (leadership, control) = Leadership::manual("job", "node-1");
        control.lead_until(5, Instant::now() + Duration::from_secs(3600));
        assert!(leadership.is_leader());
        assert_eq!(leadership.fencing_token().map(|t| t.get()), Some(5));
        control.expire();
        assert!(!leadership.is_leader());
        assert_eq!(leadership.state(), LeaderState::Following { leader: None });
        assert_eq!(leadership.fencing_token(), None);
        assert_eq!(leadership.leader(), None, "must not name itself");

        control.lead_until(6, Instant::now());
        assert!(!leadership.is_leader(), "a deadline already passed");
        control.lead(7);
        assert!(leadership.is_leader());
    }

    #[tokio::test]
    async fn waiters_wake_when_the_deadline_passes() {
        let (leadership, control) = Leadership::manual("job", "node-1");
        control.lead_until(1, Instant::now() + Duration::from_secs(3600));
        let waiter = tokio::spawn({
            let leadership = leadership.clone();
            async move { leadership.wait_not_leading().await }
        });
        tokio::task::yield_now().await;
        control.expire();
        tokio::time::timeout(Duration::from_secs(30), waiter)
            .await
            .expect("wait_not_leading must resolve at expire()")
            .unwrap();

        // A near deadline passes by itself.
        control.lead_until(2, Instant::now() + Duration::from_millis(50));
        tokio::time::timeout(Duration::from_secs(30), leadership.wait_not_leading())
            .await
            .expect("wait_not_leading must resolve at the deadline");
        assert!(!leadership.is_leader());
    }

    #[test]
    #[should_panic(expected = "lead_until")]
    fn expire_without_a_deadline_is_a_test_bug() {
        let (_leadership, control) = Leadership::manual("job", "node-1");
        control.lead(1);
        control.expire();
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn leadership_ends_when_its_lease_is_dropped() {
        let leadership = Leadership::new("test", Some("chosen"), "node", None);
        let (lease, _rx, _generation) = Lease::for_tests();
        leadership.set_leading(&lease);
        let kept = leadership.clone();
        assert!(kept.is_leader());
        let waiter = tokio::spawn({
            let kept = kept.clone();
            async move { kept.wait_not_leading().await }
        });
        // Whatever drops the lease (a task that panicked or was aborted) and nothing
        // else: no one calls set_following or set_stopped.
        drop(lease);
        assert!(!kept.is_leader());
        assert_eq!(kept.state(), LeaderState::Following { leader: None });
        assert_eq!(kept.fencing_token(), None);
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("wait_not_leading resolves when the lease ends")
            .unwrap();
    }

    fn at(secs: u64) -> tokio::time::Instant {
        // Any fixed origin: only differences matter.
        static ORIGIN: std::sync::OnceLock<tokio::time::Instant> = std::sync::OnceLock::new();
        *ORIGIN.get_or_init(tokio::time::Instant::now) + Duration::from_secs(secs)
    }

    fn seen(leaderless: Option<u64>, changed: bool) -> Seen {
        Seen {
            leaderless: leaderless.map(Duration::from_secs),
            changed,
        }
    }

    #[test]
    fn a_follower_counts_nothing_before_its_first_look_up() {
        let mut o = Observed::default();
        // Started long before: the first look-up only puts the series at rest.
        assert_eq!(o.see(at(100), None, false), seen(Some(0), false));
        assert_eq!(o.see(at(102), None, false), seen(Some(2), false));
        // The first leader it ever sees is no change.
        assert_eq!(o.see(at(104), Some("a"), false), seen(None, false));
        assert_eq!(o.see(at(106), Some("a"), false), seen(None, false));
    }

    #[test]
    fn a_hand_over_between_look_ups_counts_a_change_and_no_leaderless_time() {
        let mut o = Observed::default();
        o.see(at(0), Some("a"), false);
        // A look-up that fell into the hand-over's milliseconds saw nobody: the
        // interval before it had a leader at one end, the one after it too.
        assert_eq!(o.see(at(2), None, false), seen(None, false));
        assert_eq!(o.see(at(4), Some("b"), false), seen(None, true));
        // Straight from one leader to another: a change.
        assert_eq!(o.see(at(6), Some("c"), false), seen(None, true));
    }

    #[test]
    fn a_long_stretch_counts_between_observations_that_saw_nobody() {
        let mut o = Observed::default();
        o.see(at(0), Some("me"), true);
        // This node's term ends; nobody takes over for 10 s, then this node wins
        // again (the lock free just before): leaderless from the end to the win, and
        // a new term of the same leader is a change.
        assert_eq!(o.see(at(10), None, false), seen(None, false));
        assert_eq!(o.see(at(12), None, false), seen(Some(2), false));
        assert_eq!(o.see(at(20), Some("me"), true), seen(Some(8), true));
        // The same leader seen again, no gap: nothing.
        assert_eq!(o.see(at(22), Some("me"), false), seen(None, false));
    }

    #[derive(Debug, Default)]
    struct Recorder(std::sync::Mutex<Vec<String>>);

    impl MetricsSink for Recorder {
        fn leaderless(&self, node: &str, lock: &str, seen: Duration) {
            self.0
                .lock()
                .unwrap()
                .push(format!("leaderless {node} {lock} {}", seen.as_secs()));
        }

        fn leader_changed(&self, node: &str, lock: &str) {
            self.0
                .lock()
                .unwrap()
                .push(format!("changed {node} {lock}"));
        }
    }

    #[tokio::test(start_paused = true)]
    async fn leadership_reports_what_it_observes_to_the_sink() {
        let sink = Arc::new(Recorder::default());
        let leadership = Leadership::new("job", Some("chosen"), "me", Some(sink.clone()));
        leadership.set_following(Some("a".to_owned()));
        tokio::time::advance(Duration::from_secs(2)).await;
        leadership.set_following(None);
        tokio::time::advance(Duration::from_secs(2)).await;
        leadership.set_following(None);
        tokio::time::advance(Duration::from_secs(3)).await;
        let (lease, _rx, _generation) = Lease::for_tests();
        leadership.set_leading(&lease);
        // Stopped and started again: no observation carries over.
        leadership.set_stopped();
        tokio::time::advance(Duration::from_secs(60)).await;
        leadership.set_following(None);
        assert_eq!(
            *sink.0.lock().unwrap(),
            [
                "leaderless me job 0",
                "leaderless me job 2",
                "leaderless me job 3",
                "changed me job",
                "leaderless me job 0",
            ]
        );
    }

    /// A look-up that finds this node's own id holding the lock (a former session of
    /// this node, another leadership of the lock in this process) publishes no leader,
    /// but counts no leaderless time either: the lock is held.
    #[tokio::test(start_paused = true)]
    async fn a_holder_with_this_nodes_id_is_not_leaderless_time() {
        let sink = Arc::new(Recorder::default());
        let leadership = Leadership::new("job", Some("chosen"), "me", Some(sink.clone()));
        leadership.set_following_holder(Some("me".to_owned()));
        assert_eq!(leadership.leader(), None);
        for _ in 0..3 {
            tokio::time::advance(Duration::from_secs(2)).await;
            leadership.set_following_holder(Some("me".to_owned()));
        }
        assert_eq!(leadership.leader(), None);
        assert_eq!(*sink.0.lock().unwrap(), ["leaderless me job 0"]);
    }

    /// A node that led, lost its session and finds its former session still holding
    /// the lock, then another node taking it: one change of hands, not two.
    #[tokio::test(start_paused = true)]
    async fn a_former_session_of_this_node_is_not_a_new_term() {
        let sink = Arc::new(Recorder::default());
        let leadership = Leadership::new("job", Some("chosen"), "me", Some(sink.clone()));
        let (lease, _rx, _generation) = Lease::for_tests();
        leadership.set_leading(&lease);
        leadership.set_following(None);
        tokio::time::advance(Duration::from_secs(2)).await;
        leadership.set_following_holder(Some("me".to_owned()));
        tokio::time::advance(Duration::from_secs(2)).await;
        leadership.set_following_holder(Some("b".to_owned()));
        assert_eq!(leadership.leader().as_deref(), Some("b"));
        assert_eq!(
            *sink.0.lock().unwrap(),
            ["leaderless me job 0", "changed me job"]
        );
    }
}
