//! What a gated job gets to know about its leadership.

use chosen_core::{FencingToken, Leadership};

/// Injected into every task the gate lets through; take it in a job as
/// `Data<LeaderGuard>` (`apalis_core::task::data::Data`).
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
}

impl LeaderGuard {
    pub(crate) fn new(token: FencingToken, leadership: Leadership) -> Self {
        Self { token, leadership }
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

    /// `true` while this node still leads under the same lease: check before each step.
    #[must_use]
    pub fn is_valid(&self) -> bool {
        self.leadership.fencing_token() == Some(self.token)
    }

    /// Resolves when this node stops leading (lease lost or election stopped): race the
    /// job's work against it to stop at once.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    pub async fn lost(&self) {
        while self.is_valid() {
            self.leadership.wait_not_leading().await;
        }
    }
}
