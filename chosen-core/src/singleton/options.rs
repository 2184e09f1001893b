//! How a singleton supervises its child: [`SingletonOptions`], [`RestartPolicy`].

use super::*;

/// The error type a child may return.
pub type ChildError = Box<dyn std::error::Error + Send + Sync>;

/// When a child that ended is started again (while this node still leads).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum RestartPolicy {
    /// Whenever it ends (OTP `permanent`). The default: a background loop should run.
    #[default]
    Always,
    /// Only when it fails (returns `Err` or panics) (OTP `transient`).
    OnFailure,
    /// Never (OTP `temporary`).
    Never,
}

/// How a [`Singleton`] supervises its child.
///
/// When the child ends and is not to be restarted (policy [`RestartPolicy::Never`], or
/// [`RestartPolicy::OnFailure`] after a success), this node **keeps the lock** with no
/// child running, so that no other node starts the child again while this node's
/// session lives: a preferred node coming up is not handed it (no fail-back), nor is a
/// group's joining node ([`SingletonGroup`](crate::SingletonGroup) keeps such a member
/// where it finished), and this node does not start it again in a later tenure (after
/// a session loss), nor, if preferred, ask to be failed back to. An explicit
/// [`Singleton::step_down`] or [`Singleton::hand_over_to`] gives the lock away and
/// forgets that the child finished: whoever takes the lock next, this node too, starts
/// it again. The lock is a session's, not a record: once this node's session is lost
/// (the server ended it, a network cut), or it crashes or stops, the next node to take
/// the lock starts the child again. A run that must happen once
/// across the fleet, whatever fails, needs a durable record of it: the tick ledger of
/// chosen-apalis, or a table of your own written in a fenced transaction.
#[derive(Clone, Debug)]
pub struct SingletonOptions {
    pub(super) restart: RestartPolicy,
    pub(super) max_restarts: u32,
    pub(super) restart_period: Duration,
    pub(super) backoff_min: Duration,
    pub(super) backoff_max: Duration,
    pub(super) shutdown_timeout: Duration,
    pub(super) give_up_cooldown: Duration,
    pub(super) poll_interval: Option<Duration>,
    /// Who may run it and who is preferred: the same choices as an election's.
    pub(super) election: crate::ElectionOptions,
}

impl Default for SingletonOptions {
    fn default() -> Self {
        Self {
            restart: RestartPolicy::Always,
            max_restarts: 3,
            restart_period: Duration::from_secs(5),
            backoff_min: Duration::from_millis(100),
            backoff_max: Duration::from_secs(5),
            shutdown_timeout: Duration::from_secs(1),
            give_up_cooldown: Duration::from_secs(30),
            poll_interval: None,
            election: crate::ElectionOptions::default(),
        }
    }
}

impl SingletonOptions {
    /// Whether this node may run the singleton (default `true`). An ineligible one
    /// never contends for the lock and never starts the child: its leadership follows
    /// whoever runs it (for replicas without the privileges the child needs). A
    /// manager made ineligible
    /// ([`ManagerOptions::eligible`](crate::ManagerOptions::eligible)) makes every
    /// singleton on it so.
    #[must_use]
    pub fn eligible(mut self, eligible: bool) -> Self {
        self.election = self.election.eligible(eligible);
        self
    }

    /// Makes this node the preferred one to run the singleton (default `false`): after
    /// a failover elsewhere, the node running it hands it back (its child stops first)
    /// once this node has been up for that node's
    /// [`fail_back_after`](Self::fail_back_after); see
    /// [`ElectionOptions::preferred`](crate::ElectionOptions::preferred).
    #[must_use]
    pub fn preferred(mut self, preferred: bool) -> Self {
        self.election = self.election.preferred(preferred);
        self
    }

    /// How long a preferred node must have been seen without a break before this node,
    /// running the singleton, hands it over (default 10 s); see
    /// [`ElectionOptions::fail_back_after`](crate::ElectionOptions::fail_back_after).
    #[must_use]
    pub fn fail_back_after(mut self, after: Duration) -> Self {
        self.election = self.election.fail_back_after(after);
        self
    }

    /// Whether this node may run the singleton: see [`eligible`](Self::eligible).
    #[must_use]
    pub fn is_eligible(&self) -> bool {
        self.election.eligible
    }

    /// The restart policy (default [`RestartPolicy::Always`]).
    #[must_use]
    pub fn restart(mut self, policy: RestartPolicy) -> Self {
        self.restart = policy;
        self
    }

    /// Restart intensity, as in OTP: more than `max_restarts` restarts within `period`
    /// (default 3 in 5 s) makes this node give up: it releases the lock so another
    /// node may do better, waits [`give_up_cooldown`](Self::give_up_cooldown), then
    /// contends again. So does a child that fails more than `max_restarts` times in a
    /// row, each time within `period` (and within a minute) of its start, however long
    /// the backoff between (a child that cannot start: a backoff longer than the period
    /// would never reach the intensity, and the node would sit on the lock running
    /// nothing). A preferred node whose child gave up does not ask to be failed back to
    /// (it does not hold the presence lock) for ten [`give_up_cooldown`](Self::give_up_cooldown)s
    /// (or ten `period`s, if longer), doubling with each further give-up (at most an
    /// hour), until it has led for longer than `period` again: the other nodes keep the
    /// singleton meanwhile.
    #[must_use]
    pub fn intensity(mut self, max_restarts: u32, period: Duration) -> Self {
        self.max_restarts = max_restarts;
        self.restart_period = period;
        self
    }

    /// Delay before a restart: doubles from `min` to `max` (default 100 ms to 5 s), back
    /// to `min` once a child ran longer than the intensity period.
    #[must_use]
    pub fn backoff(mut self, min: Duration, max: Duration) -> Self {
        self.backoff_min = min;
        self.backoff_max = max;
        self
    }

    /// How long a cancelled child may take to stop before it is aborted (default 1 s).
    /// Must fit in the manager's [`stop_budget`](crate::ManagerOptions::stop_budget),
    /// so that a child losing its lease has stopped before another node can start.
    #[must_use]
    pub fn shutdown_timeout(mut self, timeout: Duration) -> Self {
        self.shutdown_timeout = timeout;
        self
    }

    /// How long to stay out of the contest after giving up (default 30 s).
    #[must_use]
    pub fn give_up_cooldown(mut self, cooldown: Duration) -> Self {
        self.give_up_cooldown = cooldown;
        self
    }

    /// The poll interval while following (default: the manager's).
    #[must_use]
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = Some(interval);
        self
    }

    pub(crate) fn validate(&self, manager: &LockManager) -> Result<()> {
        self.validate_against(manager.options().get_stop_budget())
    }

    pub(super) fn validate_against(&self, budget: Duration) -> Result<()> {
        if let Some(interval) = self.poll_interval
            && !crate::names::POLL_INTERVAL_RANGE.contains(&interval)
        {
            return Err(Error::config(
                "SingletonOptions::poll_interval",
                format!("poll interval {interval:?} is out of range: use between 10 ms and 1 hour"),
            ));
        }
        if self.shutdown_timeout > budget {
            return Err(Error::config(
                "SingletonOptions::shutdown_timeout",
                format!(
                    "singleton shutdown_timeout {:?} exceeds the manager's stop_budget {budget:?}: a child losing its lease could still run when another node starts; lower shutdown_timeout or raise stop_budget (and server_release_after)",
                    self.shutdown_timeout
                ),
            ));
        }
        if self.restart_period.is_zero() {
            return Err(Error::config(
                "SingletonOptions::intensity",
                "singleton restart period must be greater than zero",
            ));
        }
        if self.backoff_min.is_zero() || self.backoff_min > self.backoff_max {
            return Err(Error::config(
                "SingletonOptions::backoff",
                format!(
                    "singleton backoff {:?}..{:?} must satisfy 0 < min <= max",
                    self.backoff_min, self.backoff_max
                ),
            ));
        }
        Ok(())
    }
}
