//! A watch handle on "is this node the leader of a name".

use std::fmt;
use std::sync::Arc;
use std::time::SystemTime;

use tokio::sync::watch;

use crate::lease::{FencingToken, Lease, Validity};
use crate::metrics::MetricsSink;

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
/// Get one from an [`Election`](crate::Election) or a [`Singleton`](crate::Singleton).
#[derive(Clone)]
pub struct Leadership {
    inner: Arc<Inner>,
}

struct Inner {
    name: String,
    node_id: String,
    tx: watch::Sender<Snapshot>,
    metrics: Option<Arc<dyn MetricsSink>>,
}

impl fmt::Debug for Leadership {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Leadership")
            .field("name", &self.inner.name)
            .field("node_id", &self.inner.node_id)
            .field("state", &self.state())
            .finish()
    }
}

impl Leadership {
    pub(crate) fn new(name: &str, node_id: &str, metrics: Option<Arc<dyn MetricsSink>>) -> Self {
        let (tx, _) = watch::channel(Snapshot {
            state: LeaderState::Following { leader: None },
            validity: None,
        });
        Self {
            inner: Arc::new(Inner {
                name: name.to_owned(),
                node_id: node_id.to_owned(),
                tx,
                metrics,
            }),
        }
    }

    /// A leadership that a test sets by hand (no database), with its controller.
    #[cfg(any(test, feature = "test-util"))]
    #[must_use]
    pub fn manual(name: &str, node_id: &str) -> (Self, ManualLeadership) {
        let leadership = Self::new(name, node_id, None);
        (leadership.clone(), ManualLeadership { leadership })
    }

    pub(crate) fn set_leading(&self, lease: &Lease) {
        self.inner.tx.send_replace(Snapshot {
            state: LeaderState::Leading {
                token: lease.fencing_token(),
                since: lease.acquired_at(),
            },
            validity: Some(lease.validity()),
        });
    }

    pub(crate) fn set_following(&self, leader: Option<String>) {
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
        self.inner.tx.send_replace(Snapshot {
            state: LeaderState::Stopped,
            validity: None,
        });
    }

    /// The lock name.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.inner.name
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
#[cfg(any(test, feature = "test-util"))]
#[derive(Debug, Clone)]
pub struct ManualLeadership {
    leadership: Leadership,
}

#[cfg(any(test, feature = "test-util"))]
impl ManualLeadership {
    /// Leading with `token`.
    pub fn lead(&self, token: u64) {
        self.leadership.inner.tx.send_replace(Snapshot {
            state: LeaderState::Leading {
                token: FencingToken::new(token),
                since: SystemTime::now(),
            },
            validity: None,
        });
    }

    /// Following `leader`.
    pub fn follow(&self, leader: Option<&str>) {
        self.leadership.set_following(leader.map(str::to_owned));
    }

    /// Stopped.
    pub fn stop(&self) {
        self.leadership.set_stopped();
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn leadership_ends_when_its_lease_is_dropped() {
        let leadership = Leadership::new("test", "node", None);
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
}
