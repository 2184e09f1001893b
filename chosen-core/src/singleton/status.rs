//! Where a singleton stands: [`SingletonState`], [`ChildState`], [`SingletonStatus`].

use super::*;

/// Where a singleton stands on this node.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum SingletonState {
    /// Contending; `leader` is the holder's node id when known.
    Following {
        /// The leader's node id, when known.
        leader: Option<String>,
    },
    /// This node holds the lock and supervises the child.
    Leading {
        /// Since when (wall clock).
        since: SystemTime,
        /// The lease's fencing token.
        token: FencingToken,
    },
    /// Gave up after too many restarts; contends again at `until`.
    CoolingDown {
        /// When it contends again (wall clock).
        until: SystemTime,
    },
    /// Shut down.
    Stopped,
}

/// The child's state, as `which_children` reported it in Elixir.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ChildState {
    /// Not running (not leading).
    NotRunning,
    /// Running since (wall clock).
    Running {
        /// Since when.
        since: SystemTime,
    },
    /// Ended; restarts at (wall clock).
    Restarting {
        /// When it restarts.
        at: SystemTime,
    },
    /// Ended and not restarted (policy); the lock is kept.
    Finished,
    /// Told to stop; waiting for it.
    Stopping,
}

/// A snapshot of a singleton's supervision (Elixir's `which_children` and
/// `count_children` in one).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct SingletonStatus {
    /// The singleton's name.
    pub name: String,
    /// Leadership on this node.
    pub state: SingletonState,
    /// The child.
    pub child: ChildState,
    /// Restarts on this node since the singleton started.
    pub restarts: u64,
    /// Times this node gave up after exceeding the restart intensity.
    pub give_ups: u64,
    /// The last failure of the child (error text or panic message).
    pub last_failure: Option<String>,
}
