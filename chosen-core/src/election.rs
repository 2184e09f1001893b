//! Keep contending for a name in the background.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use crate::error::{Error, Result};
use crate::leadership::Leadership;
use crate::lease::Lease;
use crate::manager::{LockManager, LockRequest};

/// While following, how often the leader's node id is looked up (one query per
/// election; not batched across elections yet, see the README's Scaling section).
const LEADER_REFRESH: Duration = Duration::from_secs(2);

/// Contends for a name in the background for as long as it lives, and exposes the
/// outcome as a [`Leadership`]: for code that needs "am I the leader" without a
/// supervised child (the tower and apalis adapters, a health endpoint).
///
/// On lease loss it drops the lost lease at once (so the manager's next session holds
/// nothing of it, and the node that takes over does not wait), then contends again
/// after two poll intervals (a node that just lost its session is the suspect one, so
/// healthy nodes get a head start). Dropping the election,
/// [`shutdown`](Self::shutdown), or the manager's
/// [`shutdown`](crate::LockManager::shutdown) releases the lock.
///
/// The leadership never outlives the lease: if the election's task ends in any other
/// way (it panics, or is dropped with its runtime), the lease is dropped with it, which
/// ends its validity before the lock is released, and the leadership turns
/// [`Stopped`](crate::LeaderState::Stopped).
///
/// ```no_run
/// # async fn demo(manager: chosen_core::LockManager) -> chosen_core::Result<()> {
/// let election = chosen_core::Election::start(&manager, "scheduler")?;
/// let leadership = election.leadership();
/// loop {
///     let token = leadership.wait_leading().await;
///     println!("leading with token {token}");
///     leadership.wait_not_leading().await;
///     println!("not leading any more");
/// }
/// # }
/// ```
#[derive(Debug)]
pub struct Election {
    leadership: Leadership,
    stop: CancellationToken,
    /// The current term's step-down token (`None` between terms).
    step_down: Arc<Mutex<Option<CancellationToken>>>,
    /// The node the current term is handed over to when it steps down.
    hand_to: Arc<Mutex<Option<String>>>,
    task: tokio::sync::Mutex<Option<JoinHandle<()>>>,
}

impl Election {
    /// Starts contending for `lock` on `manager`. On a manager that has been shut down,
    /// the election stops at once ([`Stopped`](crate::LeaderState::Stopped)).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidName`] for an empty name, one with a NUL character, or a reserved one (beginning with `chosen.`, or named as a raw key's lease is: `key(a, b)`);
    /// [`Error::InvalidPollInterval`] for a request whose poll interval is outside
    /// 10 ms to 1 h.
    pub fn start(manager: &LockManager, lock: impl Into<LockRequest>) -> Result<Self> {
        Self::start_with(manager, lock, ElectionOptions::default())
    }

    /// [`start`](Self::start) with options: e.g. an election this node never wins
    /// ([`ElectionOptions::eligible`]), which follows whoever leads.
    ///
    /// ```no_run
    /// use chosen_core::{Election, ElectionOptions};
    ///
    /// # async fn demo(manager: chosen_core::LockManager) -> chosen_core::Result<()> {
    /// // A replica without the privileges the job needs: it only watches.
    /// let election = Election::start_with(&manager, "billing", ElectionOptions::default().eligible(false))?;
    /// println!("leader: {:?}", election.leadership().leader());
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::InvalidName`] for an empty name, one with a NUL character, or a reserved one (beginning with `chosen.`, or named as a raw key's lease is: `key(a, b)`);
    /// [`Error::InvalidPollInterval`] for a request whose poll interval is outside
    /// 10 ms to 1 h.
    // By value, as `Singleton::start` takes its options: more of them are to come.
    #[allow(clippy::needless_pass_by_value)]
    pub fn start_with(
        manager: &LockManager,
        lock: impl Into<LockRequest>,
        options: ElectionOptions,
    ) -> Result<Self> {
        let ElectionOptions {
            eligible,
            preferred,
            fail_back_after,
        } = options;
        // A leader hands its token to its code at once (a gate's requests, a child):
        // taken with the win, one durable write per tenure.
        let request: LockRequest = lock.into();
        let request = request.eager_token();
        let name = request.validated_name()?;
        let prefer = request.presence_lock();
        let leadership = Leadership::new(
            &name,
            request.namespace(&manager.options().namespace),
            manager.node_id(),
            manager.options().metrics.clone(),
        );
        // A child of the manager's: its shutdown stops this election too.
        let stop = manager.stop_token();
        let step_down: Arc<Mutex<Option<CancellationToken>>> = Arc::default();
        let hand_to: Arc<Mutex<Option<String>>> = Arc::default();
        let task = manager.spawn_supervisor({
            let manager = manager.clone();
            let leadership = leadership.clone();
            let stop = stop.clone();
            let step_down = Arc::clone(&step_down);
            let hand_to = Arc::clone(&hand_to);
            async move {
                let _stopped = MarkStopped(leadership.clone());
                let presence = preferred.then_some(prefer.as_str());
                while let Some(lease) =
                    campaign(&manager, &request, &leadership, &stop, eligible, presence.map(|p| (p, tokio::time::Instant::now()))).await
                {
                    // One token per term: a step-down asked for in another term (or twice)
                    // cannot end this one.
                    let term = CancellationToken::new();
                    hand_to.lock().unwrap_or_else(PoisonError::into_inner).take();
                    *step_down.lock().unwrap_or_else(PoisonError::into_inner) = Some(term.clone());
                    gained(&leadership, &lease);
                    let ended = tokio::select! {
                        biased;
                        () = stop.cancelled() => TermEnd::Stop,
                        reason = lease.lost() => TermEnd::Lost(reason),
                        () = stepped_down(&term, fail_back_unless_preferred(&manager, &prefer, fail_back_after, &hand_to, presence.is_some())) => TermEnd::SteppedDown,
                    };
                    step_down.lock().unwrap_or_else(PoisonError::into_inner).take();
                    leadership.set_following(None);
                    match ended {
                        TermEnd::Stop => {
                            // `hand_over_to` then `shutdown` (a rolling deploy): still
                            // handed over.
                            let to = hand_to.lock().unwrap_or_else(PoisonError::into_inner).take();
                            let _ = lease.release_to(to).await;
                            break;
                        }
                        TermEnd::Lost(reason) => {
                            // Lost for good, even if the deadline is extended later, and
                            // dropped now, before the pause: a lease kept meanwhile would
                            // keep the key's stop fence held on the manager's next session,
                            // and the node that takes over would wait for it.
                            lease.end();
                            drop(lease);
                            warn!(lock = %leadership.name(), %reason, "lost leadership");
                            if !rejoin_pause(&manager, &stop).await {
                                break;
                            }
                        }
                        TermEnd::SteppedDown => {
                            let to = hand_to.lock().unwrap_or_else(PoisonError::into_inner).take();
                            match &to {
                                Some(node) => info!(lock = %leadership.name(), to = %node, "handing over"),
                                None => info!(lock = %leadership.name(), "stepped down"),
                            }
                            let _ = lease.release_to(to).await;
                            if !wait_for_successor(&manager, &request, &stop).await {
                                break;
                            }
                        }
                    }
                }
            }
        });
        Ok(Self {
            leadership,
            stop,
            step_down,
            hand_to,
            task: tokio::sync::Mutex::new(Some(task)),
        })
    }

    /// Gives the leadership up, if this node holds it: the lock is released (and
    /// announced, so a node waiting for it takes it within about a round trip), and
    /// this node contends again only once another node holds it, or after two seconds
    /// when none took it. No effect while following. For a rolling deploy: step down,
    /// then stop.
    pub fn step_down(&self) {
        self.hand_over(None);
    }

    /// Gives the leadership to the node `node_id`, if this node holds it: as
    /// [`step_down`](Self::step_down), but the release is announced for that node, and
    /// every other waiting node holds off for a second, so that it takes over (within
    /// about a round trip, when it waits for the lock); if it does not, the lock goes
    /// to whichever node takes it first, as after a step-down. No effect while
    /// following, or when `node_id` is this node's.
    ///
    /// ```no_run
    /// # async fn demo(election: chosen_core::Election) {
    /// // A rolling deploy: hand the leadership to a replica that stays, then stop.
    /// election.hand_over_to("web-2");
    /// # }
    /// ```
    pub fn hand_over_to(&self, node_id: &str) {
        if node_id != self.leadership.node_id() {
            self.hand_over(Some(node_id.to_owned()));
        }
    }

    fn hand_over(&self, to: Option<String>) {
        let term = self
            .step_down
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(term) = term.as_ref() {
            *self.hand_to.lock().unwrap_or_else(PoisonError::into_inner) = to;
            term.cancel();
        }
    }

    /// The leadership handle (cheap to clone).
    #[must_use]
    pub fn leadership(&self) -> Leadership {
        self.leadership.clone()
    }

    /// Stops contending, then releases the lock if held, announced so a waiting node
    /// takes over at once. Idempotent; waits until done.
    /// [`LockManager::shutdown`] does the same for every election started from the
    /// manager.
    ///
    /// ```no_run
    /// # async fn demo(manager: chosen_core::LockManager) -> chosen_core::Result<()> {
    /// let election = chosen_core::Election::start(&manager, "scheduler")?;
    /// // ... on SIGTERM:
    /// election.shutdown().await;
    /// election.shutdown().await; // nothing more to do
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Cancel safety
    ///
    /// The stop is requested before the first await; dropping the future only stops
    /// waiting for it.
    pub async fn shutdown(&self) {
        if crate::manager::stop_supervisor(&self.stop, &self.task)
            .await
            .is_some()
        {
            error!(lock = %self.leadership.name(), "the election's task had panicked; the lock was released");
        }
    }
}

impl Drop for Election {
    fn drop(&mut self) {
        // The task releases the lock in the background.
        self.stop.cancel();
    }
}

/// Options of an [`Election`] (see [`Election::start_with`]).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ElectionOptions {
    pub(crate) eligible: bool,
    pub(crate) preferred: bool,
    pub(crate) fail_back_after: Duration,
}

/// How long a preferred node must have been there before the leader hands over to it,
/// unless set otherwise.
pub const DEFAULT_FAIL_BACK_AFTER: Duration = Duration::from_secs(10);

impl Default for ElectionOptions {
    fn default() -> Self {
        Self {
            eligible: true,
            preferred: false,
            fail_back_after: DEFAULT_FAIL_BACK_AFTER,
        }
    }
}

impl ElectionOptions {
    /// Whether this node may win this election (default `true`). An ineligible one
    /// never contends: its leadership follows whoever leads. A manager made
    /// ineligible ([`ManagerOptions::eligible`](crate::ManagerOptions::eligible)) makes
    /// every election on it so.
    #[must_use]
    pub fn eligible(mut self, eligible: bool) -> Self {
        self.eligible = eligible;
        self
    }

    /// Makes this node the preferred leader (default `false`): while it contends for
    /// the lock it holds a presence lock (`chosen.prefer/<lock>`, or
    /// `chosen.prefer-key/<key>` for a raw [`LockKey`](crate::LockKey)), and a leader that is
    /// not it hands the leadership over to it ([`Election::hand_over_to`]) once it has
    /// been there for the leader's [`fail_back_after`](Self::fail_back_after): after a
    /// failover to another node, the leadership comes back once the preferred node is
    /// up and stable, with one hand-over. With several preferred nodes, the first to
    /// hold the presence lock is the one, and a preferred node that leads keeps the
    /// leadership (it never hands over to another preferred node: two of them would
    /// hand it back and forth). Ignored on an ineligible node. A preferred leader that
    /// steps down gets the leadership back the same way: to move it away for good, stop
    /// its election.
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use chosen_core::{Election, ElectionOptions};
    ///
    /// # async fn demo(manager: chosen_core::LockManager) -> chosen_core::Result<()> {
    /// // The replica next to the database leads whenever it is up.
    /// let election = Election::start_with(
    ///     &manager,
    ///     "scheduler",
    ///     ElectionOptions::default().preferred(true).fail_back_after(Duration::from_secs(30)),
    /// )?;
    /// # Ok(())
    /// # }
    /// ```
    #[must_use]
    pub fn preferred(mut self, preferred: bool) -> Self {
        self.preferred = preferred;
        self
    }

    /// How long a preferred node must have been seen without a break before this
    /// node, leading, hands over to it (default [`DEFAULT_FAIL_BACK_AFTER`], 10 s): a
    /// node that comes and goes is not handed the leadership each time. The leader
    /// looks every 2 s, in one look-up shared by every election of the manager.
    #[must_use]
    pub fn fail_back_after(mut self, after: Duration) -> Self {
        self.fail_back_after = after;
        self
    }
}

/// How a term of an election ended.
enum TermEnd {
    /// The election stops.
    Stop,
    /// The lease was lost.
    Lost(crate::status::SessionDownReason),
    /// A step-down, a hand-over or a fail-back.
    SteppedDown,
}

/// [`fail_back`], unless this node is itself a preferred one (`preferred`: it holds
/// the presence lock while it waits): a preferred leader keeps the leadership, or two
/// preferred nodes would hand it back and forth for ever (each waits, so holds the
/// presence lock, while the other leads). Never ends then.
pub(crate) async fn fail_back_unless_preferred(
    manager: &LockManager,
    lock: &str,
    after: Duration,
    hand_to: &Mutex<Option<String>>,
    preferred: bool,
) {
    #[cfg(test)]
    let preferred = preferred && !crate::sim::is_off(crate::sim::Guard::PreferredLeaderKeeps);
    if preferred {
        std::future::pending::<()>().await;
    }
    fail_back(manager, lock, after, hand_to).await;
}

/// Ends when `term` is cancelled (a step-down or a hand-over) or `fail_back` ends (it
/// set the node to hand over to).
pub(crate) async fn stepped_down(term: &CancellationToken, fail_back: impl Future<Output = ()>) {
    tokio::select! {
        biased;
        () = term.cancelled() => {}
        () = fail_back => {}
    }
}

/// While this node leads: once a preferred node other than this one has held the
/// preferred lock `lock` for `after` without a break (looked at every
/// [`LEADER_REFRESH`] on the manager's shared grid), names it in `hand_to` and ends.
pub(crate) async fn fail_back(
    manager: &LockManager,
    lock: &str,
    after: Duration,
    hand_to: &Mutex<Option<String>>,
) {
    let me = manager.node_id();
    let mut seen: Option<(String, tokio::time::Instant)> = None;
    let mut refresh = tokio::time::interval_at(
        tokio::time::Instant::from_std(manager.next_shared_tick(LEADER_REFRESH)),
        LEADER_REFRESH,
    );
    refresh.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        refresh.tick().await;
        let holder = match manager.holder(lock).await {
            Ok(Some(h)) if h.node_id != me && !h.node_id.is_empty() => h.node_id,
            _ => {
                seen = None;
                continue;
            }
        };
        match &seen {
            Some((node, since)) if *node == holder => {
                if since.elapsed() >= after {
                    info!(lock = %lock, to = %holder, "the preferred node is back: failing back");
                    *hand_to.lock().unwrap_or_else(PoisonError::into_inner) = Some(holder);
                    return;
                }
            }
            _ => seen = Some((holder, tokio::time::Instant::now())),
        }
    }
}

/// Marks the leadership stopped when the election's task ends, however it ends
/// (returns, panics, or is dropped with its runtime). The lease, dropped with the task,
/// has already ended its validity by then; this also tells watchers
/// ([`Leadership::changed`]) and makes the state say `Stopped`.
struct MarkStopped(Leadership);

impl Drop for MarkStopped {
    fn drop(&mut self) {
        self.0.set_stopped();
    }
}

/// The longest a node that stepped down waits for another to take the lock before it
/// contends again. Waiting nodes hear of the release at once (they registered for its
/// announcement on their first try), so this is only for when nobody waits.
/// Two seconds: above a waiter's retry after an announcement it could not verify (a
/// second, jittered) plus the takeover grace, so that such a waiter gets it first.
pub(crate) const STEP_DOWN_WAIT: Duration = Duration::from_secs(2);

/// After stepping down: wait until another session holds the lock (or
/// [`STEP_DOWN_WAIT`] passes). `false` if stopped meanwhile.
pub(crate) async fn wait_for_successor(
    manager: &LockManager,
    request: &LockRequest,
    stop: &CancellationToken,
) -> bool {
    let deadline = tokio::time::Instant::now() + STEP_DOWN_WAIT;
    loop {
        let me = match manager.connection_status() {
            crate::status::ConnectionState::Connected { backend_pid, .. } => Some(backend_pid),
            _ => None,
        };
        if let Ok(Some(holder)) = manager.holder(request.clone()).await
            && Some(holder.backend_pid) != me
        {
            return true;
        }
        tokio::select! {
            biased;
            () = stop.cancelled() => return false,
            () = tokio::time::sleep_until(deadline) => return true,
            () = tokio::time::sleep(Duration::from_millis(25)) => {}
        }
    }
}

/// After losing a lease: wait two poll intervals before contending again, so that the
/// other nodes (whose sessions did not just fail) get the lock first. `false` if
/// stopped meanwhile.
pub(crate) async fn rejoin_pause(manager: &LockManager, stop: &CancellationToken) -> bool {
    let pause = manager.options().get_poll_interval() * 2;
    tokio::select! {
        biased;
        () = stop.cancelled() => false,
        () = tokio::time::sleep(pause) => true,
    }
}

pub(crate) fn gained(leadership: &Leadership, lease: &Lease) {
    leadership.set_leading(lease);
    info!(
        lock = %leadership.name(),
        node_id = %leadership.node_id(),
        token = lease.eager_token().get(),
        "gained leadership"
    );
}

/// Waits for the lock while keeping the leadership's view of the leader fresh.
/// `None` when stopped or the manager closed.
pub(crate) async fn campaign(
    manager: &LockManager,
    request: &LockRequest,
    leadership: &Leadership,
    stop: &CancellationToken,
    eligible: bool,
    preferred: Option<(&str, tokio::time::Instant)>,
) -> Option<Lease> {
    // An ineligible node only follows: its acquire is never polled (so never sent).
    let eligible = eligible && manager.options().is_eligible();
    let acquire = manager.acquire(request.clone());
    tokio::pin!(acquire);
    // A preferred node holds its presence lock while it contends, and only then: a
    // leader hands over only to a node that waits for the lock (not one stopped, in a
    // cooldown, or pausing after a loss). Dropped (released) when the campaign ends.
    // From the instant given (a preferred node whose child gave up lately asks again
    // only once its suspension is over).
    let mut want_presence = eligible && preferred.is_some();
    let (presence_lock, presence_from) = preferred.map_or_else(
        || (String::new(), tokio::time::Instant::now()),
        |(lock, from)| (lock.to_owned(), from),
    );
    // Taken again when the session it was held on is lost while the campaign goes on
    // (the acquire carries over to the next session; so must the presence, or the
    // leader would not fail back to this node until it next led).
    let take_presence = |from: tokio::time::Instant| {
        let lock = presence_lock.clone();
        async move {
            tokio::time::sleep_until(from).await;
            manager.acquire(LockRequest::internal(lock)).await
        }
    };
    let presence = take_presence(presence_from);
    tokio::pin!(presence);
    let mut present: Option<Lease> = None;
    // On the manager's shared grid: the look-ups of every election following on this
    // manager arrive together and share one statement.
    let mut refresh = tokio::time::interval_at(
        tokio::time::Instant::from_std(manager.next_shared_tick(LEADER_REFRESH)),
        LEADER_REFRESH,
    );
    refresh.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        #[cfg(test)]
        let watch = !crate::sim::is_off(crate::sim::Guard::PresenceRetaken);
        #[cfg(not(test))]
        let watch = true;
        let presence_lost = async {
            match &present {
                Some(lease) if watch => lease.lost().await,
                _ => std::future::pending().await,
            }
        };
        tokio::select! {
            biased;
            () = stop.cancelled() => return None,
            result = &mut acquire, if eligible => match result {
                Ok(lease) => return Some(lease),
                Err(Error::Closed) => return None,
                Err(e) => {
                    warn!(lock = %leadership.name(), error = %e, "acquire failed; retrying");
                    tokio::select! {
                        biased;
                        () = stop.cancelled() => return None,
                        () = tokio::time::sleep(Duration::from_secs(1)) => {}
                    }
                    acquire.set(manager.acquire(request.clone()));
                }
            },
            result = &mut presence, if want_presence => {
                want_presence = false;
                match result {
                    Ok(lease) => present = Some(lease),
                    Err(e) => debug!(lock = %presence_lock, error = %e, "could not take the preferred lock: no fail-back to this node in this campaign"),
                }
            }
            reason = presence_lost => {
                debug!(lock = %presence_lock, reason = %reason, "the preferred lock was lost with the session: taking it again");
                present = None;
                want_presence = true;
                presence.set(take_presence(presence_from.max(tokio::time::Instant::now())));
            }
            _ = refresh.tick() => {
                if let Ok(holder) = manager.holder(request.clone()).await {
                    // Never this node itself while it follows: the holder is then a
                    // former session of its own (lost, and kept open until the next one
                    // fences the work still stopping, or not yet noticed as gone by the
                    // server), so the leader is not known; the lock is held all the same.
                    leadership.set_following_holder(holder.map(|h| h.node_id));
                }
            }
        }
    }
}
