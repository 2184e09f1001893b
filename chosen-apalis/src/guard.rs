//! What a gated job gets to know about its leadership.

use std::fmt;
use std::future::Future;
use std::pin::{Pin, pin};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

use chosen_core::{FencingToken, LeaderState, Leadership};

/// Injected into every task the gate lets through; take it in a job as
/// `Data<LeaderGuard>` (`apalis_core::task::data::Data`).
///
/// A guard belongs to one *tenure*: the leadership the gate saw when it let the task
/// through. Once that tenure ends (lease lost or expired, election stopped) the guard
/// stays invalid, even if this node leads again by the time the job looks, and even
/// with an equal fencing token.
///
/// ```no_run
/// use apalis_core::{error::BoxDynError, task::data::Data};
/// use apalis_cron::Tick;
/// use chosen_apalis::LeaderGuard;
///
/// async fn nightly(tick: Tick, guard: Data<LeaderGuard>) -> Result<(), BoxDynError> {
///     for batch in 0..10 {
///         if !guard.is_valid() {
///             return Ok(()); // leadership lost mid-run: stop; the new leader takes over
///         }
///         // write batch, tagged with guard.fencing_token(), so a stale leader is rejected
///         # let _ = (batch, &tick);
///     }
///     Ok(())
/// }
/// ```
#[derive(Debug, Clone)]
pub struct LeaderGuard {
    token: FencingToken,
    leadership: Leadership,
    tenure: Arc<Tenure>,
}

impl LeaderGuard {
    pub(crate) fn new(token: FencingToken, leadership: Leadership, tenure: Tenure) -> Self {
        Self {
            token,
            leadership,
            tenure: Arc::new(tenure),
        }
    }

    /// The fencing token of the lease the task was let through under.
    #[must_use]
    pub fn fencing_token(&self) -> FencingToken {
        self.token
    }

    /// This node's id.
    #[must_use]
    pub fn node_id(&self) -> &str {
        self.leadership.node_id()
    }

    /// `true` while this node still leads in the tenure the task was let through
    /// under, with a lease that may be trusted right now: check before each step.
    #[must_use]
    pub fn is_valid(&self) -> bool {
        !self.tenure.ended() && self.leadership.fencing_token() == Some(self.token)
    }

    /// Resolves when the guard's tenure ends (lease lost or expired, or election
    /// stopped), even if this node leads again meanwhile: race the job's work against
    /// it to stop at once.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    pub async fn lost(&self) {
        // Subscribe to changes before checking, so that a change between the check and
        // the wait is not missed.
        let mut changed = pin!(self.leadership.changed());
        if std::future::poll_fn(|cx| Poll::Ready(changed.as_mut().poll(cx).is_ready())).await {
            return;
        }
        if !self.is_valid() {
            return;
        }
        // Leading in our tenure after we subscribed: the leadership changes only on a
        // transition, so any change from here on ends our tenure, whatever it is
        // (a regain included). The deadline passing is no change: the other arm.
        tokio::select! {
            _ = changed => {}
            () = self.leadership.wait_not_leading() => {}
        }
    }
}

/// Whether the leadership changed since the gate looked at it: a subscription taken
/// *before* the gate read the state, polled only to ask "did anything change?".
///
/// The leadership changes only on a transition (gained, lost, stopped; a new leader
/// name while following), so any change after the gate saw this node leading ends the
/// tenure it let the task through under.
pub(crate) struct Tenure {
    ended: AtomicBool,
    changed: Mutex<Pin<Box<dyn Future<Output = LeaderState> + Send>>>,
}

impl fmt::Debug for Tenure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tenure")
            .field("ended", &self.ended())
            .finish_non_exhaustive()
    }
}

impl Tenure {
    /// Subscribes to `leadership` now: read the state only after this.
    pub(crate) fn watch(leadership: &Leadership) -> Self {
        let leadership = leadership.clone();
        // Unconstrained: a future out of tokio's coop budget would answer `Pending`
        // to a poll even after a change, and a change must never be missed.
        let changed = tokio::task::unconstrained(async move { leadership.changed().await });
        let tenure = Self {
            ended: AtomicBool::new(false),
            changed: Mutex::new(Box::pin(changed)),
        };
        // The first poll subscribes (the current value counts as seen).
        let _ = tenure.ended();
        tenure
    }

    /// `true` once the leadership changed after [`watch`](Self::watch).
    pub(crate) fn ended(&self) -> bool {
        if self.ended.load(Ordering::Acquire) {
            return true;
        }
        // A poisoned lock only means a panic elsewhere while polling; the future is
        // still usable.
        let mut changed = self
            .changed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // Checked again under the lock: a finished future must not be polled again.
        if self.ended.load(Ordering::Acquire) {
            return true;
        }
        let ended = changed
            .as_mut()
            .poll(&mut Context::from_waker(Waker::noop()))
            .is_ready();
        if ended {
            self.ended.store(true, Ordering::Release);
        }
        ended
    }
}
