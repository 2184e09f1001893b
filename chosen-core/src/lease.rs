//! A held lock.

use std::fmt;
use std::sync::Arc;
use std::time::SystemTime;

use tokio::sync::{mpsc, oneshot};

use crate::driver::Command;
use crate::error::{Error, Result};
use crate::key::LockKey;
use crate::session::Generation;
use crate::shared::Shared;
use crate::status::DisconnectReason;

/// A number that grows with every acquisition of a lock.
///
/// Each acquisition gets a token strictly greater than the token of every earlier
/// holder of the same lock, on any node. It is a PostgreSQL transaction id
/// (`pg_current_xact_id()`), assigned only when a lock is actually won. Pass it to
/// systems your guarded work writes to, and have them reject writes carrying a token
/// lower than one they have already seen: that stops a holder which was frozen past
/// the server's release time and wakes up believing it still holds the lock.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct FencingToken(u64);

impl FencingToken {
    /// Wraps a raw token value (for tests and for comparing stored tokens).
    #[must_use]
    pub const fn new(value: u64) -> Self {
        Self(value)
    }

    /// The token as a number.
    #[must_use]
    pub const fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// A held lock. Dropping it releases the lock.
///
/// * [`release`](Self::release) releases now and waits for the server to confirm.
/// * `Drop` asks the manager's task to release; the server-side unlock follows within
///   a round trip (it is deferred only while the session is reconnecting, in which case
///   the lock is already gone with the old session).
/// * If other requests of this process wait for the same lock, the lock passes to the
///   oldest of them (FIFO) without being released at the server, with a new fencing
///   token.
///
/// A lease belongs to one session *generation*. When that session ends or can no
/// longer prove it is alive within the lease timeout, every lease of it is revoked at
/// once: [`is_valid`](Self::is_valid) turns `false` and [`lost`](Self::lost)
/// resolves. A lease never survives into a new session; acquire again.
#[must_use = "dropping a Lease releases the lock at once"]
pub struct Lease {
    pub(crate) id: u64,
    pub(crate) name: Arc<str>,
    pub(crate) key: LockKey,
    pub(crate) token: FencingToken,
    pub(crate) acquired_at: SystemTime,
    pub(crate) generation: Arc<Generation>,
    pub(crate) shared: Arc<Shared>,
    /// `None` once released (or never armed), so `Drop` and `release` don't both act.
    pub(crate) tx: Option<mpsc::UnboundedSender<Command>>,
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("name", &self.name)
            .field("key", &self.key)
            .field("token", &self.token)
            .field("generation", &self.generation.id)
            .field("valid", &self.is_valid())
            .finish()
    }
}

impl Lease {
    /// The lock's name (for raw keys, `key(...)`).
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The advisory-lock key.
    #[must_use]
    pub fn key(&self) -> LockKey {
        self.key
    }

    /// The fencing token of this acquisition.
    #[must_use]
    pub fn fencing_token(&self) -> FencingToken {
        self.token
    }

    /// The session generation the lease belongs to.
    #[must_use]
    pub fn generation(&self) -> u64 {
        self.generation.id
    }

    /// When the lease was granted (wall clock).
    #[must_use]
    pub fn acquired_at(&self) -> SystemTime {
        self.acquired_at
    }

    /// `true` while the lease may be trusted: its session has not ended and its last
    /// heartbeat is younger than the lease timeout. Reads a clock and two atomics; call
    /// it right before doing guarded work.
    #[must_use]
    pub fn is_valid(&self) -> bool {
        self.validity().is_valid()
    }

    /// Why the lease is no longer valid, or `None` while it is.
    #[must_use]
    pub fn loss_reason(&self) -> Option<DisconnectReason> {
        self.validity().loss_reason()
    }

    /// Resolves when the lease is lost, with the reason. It follows the client-side
    /// deadline itself, so it resolves on time even if the manager's task is starved.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only observes.
    pub async fn lost(&self) -> DisconnectReason {
        self.validity().lost().await
    }

    pub(crate) fn validity(&self) -> Validity {
        Validity {
            generation: Arc::clone(&self.generation),
            shared: Arc::clone(&self.shared),
        }
    }

    /// Releases the lock and waits until the server confirmed it (or the lock passed
    /// to a waiting request of this process).
    ///
    /// # Errors
    ///
    /// [`Error::Closed`] if the manager's task has ended (the session, and with it
    /// the lock, is gone then). A lease that was already lost releases trivially.
    ///
    /// # Cancel safety
    ///
    /// The release is requested before the first await: dropping the future does not
    /// keep the lock held, it only stops waiting for the confirmation.
    pub async fn release(mut self) -> Result<()> {
        let Some(tx) = self.tx.take() else {
            return Ok(());
        };
        let (reply, rx) = oneshot::channel();
        tx.send(Command::Release {
            key: self.key,
            lease_id: self.id,
            reply: Some(reply),
        })
        .map_err(|_| Error::Closed)?;
        rx.await.map_err(|_| Error::Closed)?
    }

    /// Makes `Drop` a no-op (used when the lease never reached its owner).
    pub(crate) fn disarm(&mut self) {
        self.tx = None;
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(tx) = self.tx.take() {
            // If the task is gone, so is the session and the lock with it.
            let _ = tx.send(Command::Release {
                key: self.key,
                lease_id: self.id,
                reply: None,
            });
        }
    }
}

/// The validity check of a lease, detached from the lease (for leadership handles and
/// leader contexts, which must not own the lock).
#[derive(Clone, Debug)]
pub(crate) struct Validity {
    generation: Arc<Generation>,
    shared: Arc<Shared>,
}

impl Validity {
    pub(crate) fn is_valid(&self) -> bool {
        !self.generation.revoked.is_cancelled() && self.shared.is_valid_now()
    }

    pub(crate) fn loss_reason(&self) -> Option<DisconnectReason> {
        if let Some(reason) = self.generation.reason.get() {
            return Some(reason.clone());
        }
        if self.generation.revoked.is_cancelled() {
            return Some(DisconnectReason::Shutdown);
        }
        (!self.shared.is_valid_now()).then(|| DisconnectReason::HeartbeatOverdue {
            lease_timeout: self.shared.options.lease_timeout,
        })
    }

    pub(crate) async fn lost(&self) -> DisconnectReason {
        loop {
            if let Some(reason) = self.loss_reason() {
                return reason;
            }
            let deadline = tokio::time::Instant::from_std(self.shared.valid_until());
            tokio::select! {
                () = self.generation.revoked.cancelled() => {}
                () = tokio::time::sleep_until(deadline) => {}
            }
        }
    }

    /// A validity that holds until revoked by hand (tests of code above the manager).
    #[cfg(test)]
    pub(crate) fn for_tests() -> (Self, Arc<Generation>) {
        let options = crate::ManagerOptions::from_url("postgres://test@localhost/test")
            .expect("BUG: static URL parses");
        let shared = Arc::new(Shared::new(
            options,
            crate::ConnectionStatus::Connecting { attempt: 1 },
        ));
        shared
            .extend_validity(std::time::Instant::now() + std::time::Duration::from_secs(1_000_000));
        let generation = Generation::new(1);
        (
            Self {
                generation: Arc::clone(&generation),
                shared,
            },
            generation,
        )
    }
}
