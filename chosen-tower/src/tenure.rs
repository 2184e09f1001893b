//! The leadership term a request was admitted in.

use std::fmt;
use std::future::{Future, poll_fn};
use std::pin::pin;
use std::task::Poll;

use chosen_core::{FencingToken, LeaderState, Leadership};

/// The leadership term a request was admitted in: over once the lease of that term is
/// lost, released, or past its deadline, even if this node leads again later under a
/// new token.
#[derive(Clone)]
pub(crate) struct Tenure {
    leadership: Leadership,
    token: FencingToken,
}

impl fmt::Debug for Tenure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tenure")
            .field("name", &self.leadership.name())
            .field("token", &self.token)
            .field("valid", &self.is_valid())
            .finish()
    }
}

impl Tenure {
    /// The term `leadership` leads in right now; `None` while it does not lead (or its
    /// lease is past its deadline).
    pub(crate) fn current(leadership: &Leadership) -> Option<Self> {
        match leadership.state() {
            LeaderState::Leading { token, .. } => Some(Self {
                leadership: leadership.clone(),
                token,
            }),
            _ => None,
        }
    }

    pub(crate) fn leadership(&self) -> &Leadership {
        &self.leadership
    }

    /// `true` while this node still leads in this term with a lease that may be trusted
    /// right now (checked against the lease's deadline at the call, as
    /// [`Leadership::is_leader`] is). Once `false`, never `true` again.
    pub(crate) fn is_valid(&self) -> bool {
        matches!(self.leadership.state(), LeaderState::Leading { token, .. } if token == self.token)
    }

    /// Resolves once the term is over: the lease was lost, released, or passed its
    /// deadline (the moment [`is_valid`](Self::is_valid) turns `false`, even before the
    /// election task notices); at once if it already is. Needs a tokio runtime with
    /// its timer, as [`Leadership::wait_not_leading`] does.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    pub(crate) async fn lost(&self) {
        loop {
            // Subscribe to the leadership's changes before checking the term: a change
            // between the check and the wait is then seen by the wait. (A watch only
            // keeps the newest state: a loss followed by a new term must not be
            // mistaken for this term going on.)
            let mut changed = pin!(self.leadership.changed());
            let first = poll_fn(|cx| Poll::Ready(changed.as_mut().poll(cx).is_ready())).await;
            if !self.is_valid() {
                return;
            }
            if !first {
                // The deadline passing changes no state: `wait_not_leading` sees it.
                let mut not_leading = pin!(self.leadership.wait_not_leading());
                let over = poll_fn(|cx| {
                    if not_leading.as_mut().poll(cx).is_ready() {
                        return Poll::Ready(true);
                    }
                    changed.as_mut().poll(cx).map(|_| false)
                })
                .await;
                if over {
                    return;
                }
            }
            // The state changed: check the term again. (`changed` is never ready at its
            // first poll while we hold the leadership, whose sender it watches.)
        }
    }
}
