//! A held lock.

use std::fmt;
use std::sync::Arc;
use std::time::SystemTime;

#[cfg(test)]
use tokio::sync::mpsc;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use crate::command::Grant;
use crate::error::{Error, Result};
use crate::generation::Generation;
use crate::key::LockKey;
use crate::shared::Shared;
use crate::status::SessionDownReason;
use crate::token::FencingToken;

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
///
/// Everything that watches this lease from elsewhere (a [`Leadership`](crate::Leadership),
/// a [`LeaderContext`](crate::LeaderContext)) stops trusting it the moment the lease
/// ends on this node, for whatever reason (released, dropped, or dropped with a task
/// that panicked or was aborted): that happens *before* the manager is asked to
/// release the lock, so no other node can have it while this node still believes it
/// leads.
#[must_use = "dropping a Lease releases the lock at once"]
pub struct Lease {
    /// What the task granted; dropping it asks the task to release.
    grant: Grant,
    acquired_at: SystemTime,
    /// Cancelled when the lease ends on this node (dropped, released, or ended by its
    /// owner), always *before* the release is sent: every [`Validity`] of this lease
    /// checks it. A new, uncancelled token for each lease.
    ended: CancellationToken,
    /// The fencing token, once known: with the grant (an eager request), or read.
    token: std::sync::OnceLock<FencingToken>,
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("name", &self.grant.name)
            .field("key", &self.grant.key)
            .field("token", &self.token.get())
            .field("generation", &self.grant.generation.id)
            .field("valid", &self.is_valid())
            .finish()
    }
}

impl Lease {
    /// The lease of a grant that reached its requester: granted now (wall clock).
    pub(crate) fn new(grant: Grant) -> Self {
        let token = std::sync::OnceLock::new();
        if let Some(t) = grant.token {
            let _ = token.set(t);
        }
        Self {
            grant,
            acquired_at: SystemTime::now(),
            ended: CancellationToken::new(),
            token,
        }
    }

    /// The lock's name (for raw keys, `key(...)`).
    #[must_use]
    pub fn name(&self) -> &str {
        &self.grant.name
    }

    /// The advisory-lock key.
    #[must_use]
    pub fn key(&self) -> LockKey {
        self.grant.key
    }

    /// The fencing token of this acquisition: greater than every token of the lock's
    /// earlier holders, on any node, and smaller than every later holder's.
    ///
    /// Issued on first use (unless the request asked for it with the grant, see
    /// [`LockRequest::eager_token`](crate::LockRequest::eager_token)): one statement,
    /// run only while this session still holds the lock, writes and flushes it; later
    /// calls answer at once. A lease whose token is never read costs no write.
    ///
    /// # Errors
    ///
    /// [`Error::LeaseLost`] when the lease is lost or released before the token was
    /// issued (no token is ever issued to a session that no longer holds the lock);
    /// [`Error::TokenNotIssued`] when the statement failed while the lease is still
    /// held (retry); [`Error::Closed`] when the manager has shut down.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a token issued for a call that was dropped is kept for the next.
    pub async fn fencing_token(&self) -> Result<FencingToken> {
        if let Some(token) = self.token.get() {
            return Ok(*token);
        }
        if let Some(reason) = self.loss_reason() {
            return Err(Error::LeaseLost(reason));
        }
        let Some(rx) = self.grant.read_token() else {
            return Err(Error::Closed);
        };
        match rx.await {
            // Issued while held; but a lease that ended meanwhile (a shutdown began)
            // is not handed a token.
            Ok(Some(_)) if self.loss_reason().is_some() => Err(Error::LeaseLost(
                self.loss_reason().unwrap_or(SessionDownReason::Shutdown),
            )),
            Ok(Some(token)) => Ok(*self.token.get_or_init(|| token)),
            Ok(None) => match self.loss_reason() {
                Some(reason) => Err(Error::LeaseLost(reason)),
                None => Err(Error::TokenNotIssued),
            },
            Err(_) => Err(Error::Closed),
        }
    }

    /// The fencing token if it is known already (taken with the grant, or read before),
    /// without asking the database.
    #[must_use]
    pub fn known_fencing_token(&self) -> Option<FencingToken> {
        self.token.get().copied()
    }

    /// The token of a lease whose request asked for it eagerly: the table grants such a
    /// request only with its token. (Token 0, which every fence refuses as stale, should
    /// that ever break.)
    pub(crate) fn eager_token(&self) -> FencingToken {
        debug_assert!(
            self.token.get().is_some(),
            "BUG: an eager request granted without its token"
        );
        self.token.get().copied().unwrap_or(FencingToken::new(0))
    }

    /// The session generation the lease belongs to.
    #[must_use]
    pub fn generation(&self) -> u64 {
        self.grant.generation.id
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

    /// Why the lease is no longer valid, or `None` while it is. A lease that ended on
    /// this node (released or dropped) while its session was fine reports
    /// [`SessionDownReason::Shutdown`].
    #[must_use]
    pub fn loss_reason(&self) -> Option<SessionDownReason> {
        self.validity().loss_reason()
    }

    /// Resolves when the lease is lost, with the reason. It follows the client-side
    /// deadline itself, so it resolves on time even if the manager's task is starved.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only observes.
    pub async fn lost(&self) -> SessionDownReason {
        self.validity().lost().await
    }

    pub(crate) fn validity(&self) -> Validity {
        Validity {
            generation: Arc::clone(&self.grant.generation),
            shared: Arc::clone(&self.grant.shared),
            ended: self.ended.clone(),
        }
    }

    /// Ends the lease's validity on this node without releasing the lock yet: for an
    /// owner that must keep the lock until work started under it has stopped.
    pub(crate) fn end(&self) {
        self.ended.cancel();
    }

    /// A fenced write under this lease: records its fencing token for its name (the lock
    /// name) inside `tx`, in the default fence table, as
    /// [`fenced::fence`](crate::fenced::fence)`(tx, lease.name(), lease.fencing_token().await?)`;
    /// fails if a newer holder has already recorded a greater token. Call it first in
    /// the transaction that makes the guarded writes; see [`fenced`](crate::fenced) for
    /// the guarantee.
    ///
    /// It also refuses at once, sending nothing, when this node already knows the
    /// lease is lost ([`is_valid`](Self::is_valid) is `false`): the token check alone
    /// would let a lost lease write until the next holder has written.
    ///
    /// ```no_run
    /// # async fn demo(manager: chosen_core::LockManager, mut client: tokio_postgres::Client) -> Result<(), Box<dyn std::error::Error>> {
    /// let lease = manager.acquire("ledger").await?;
    /// let tx = client.transaction().await?;
    /// lease.fence(&tx).await?;
    /// tx.execute("UPDATE accounts SET balance = balance - 10 WHERE id = 1", &[]).await?;
    /// tx.commit().await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::LeaseLost`] for a lease known to be lost; otherwise as
    /// [`fenced::fence`](crate::fenced::fence) ([`Error::StaleToken`] above all).
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: roll the transaction back if the future is dropped.
    pub async fn fence(&self, tx: &tokio_postgres::Transaction<'_>) -> Result<()> {
        self.fence_in(tx, &crate::fenced::FenceTable::default())
            .await
    }

    /// [`fence`](Self::fence) in another fence table.
    ///
    /// # Errors
    ///
    /// As [`fence`](Self::fence).
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: roll the transaction back if the future is dropped.
    pub async fn fence_in(
        &self,
        tx: &tokio_postgres::Transaction<'_>,
        table: &crate::fenced::FenceTable,
    ) -> Result<()> {
        if let Some(reason) = self.loss_reason() {
            return Err(Error::LeaseLost(reason));
        }
        let token = self.fencing_token().await?;
        table.fence(tx, &self.grant.name, token).await
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
    pub async fn release(self) -> Result<()> {
        self.release_to(None).await
    }

    /// Releases the lock for the node `node_id`: the release is announced naming it,
    /// so that it takes the lock (within about a round trip, if it waits for it) while
    /// every other waiting node, this process's included, holds off for a second;
    /// then anyone may take it, as after [`release`](Self::release). A node that does
    /// not know this (an older version) or did not hear the announcement contends as
    /// usual. Waits as [`release`](Self::release) does.
    ///
    /// A `node_id` no node can have (empty, longer than 63 bytes, or not printable
    /// ASCII: see [`ManagerOptions::node_id`](crate::ManagerOptions::node_id)) is
    /// logged as a warning and the lock released as by [`release`](Self::release), so
    /// that nobody holds off for a node that cannot come.
    ///
    /// # Errors
    ///
    /// As [`release`](Self::release).
    ///
    /// # Cancel safety
    ///
    /// As [`release`](Self::release).
    pub async fn hand_over(self, node_id: &str) -> Result<()> {
        self.release_to(Some(node_id.to_owned())).await
    }

    pub(crate) async fn release_to(mut self, to: Option<String>) -> Result<()> {
        let to = to.filter(|node| {
            let valid = crate::options::is_valid_node_id(node);
            if !valid {
                tracing::warn!(
                    lock = %self.grant.name,
                    to = ?node,
                    "hand-over to a node id no node can have (empty, over 63 bytes or not printable ASCII); releasing to anyone instead"
                );
            }
            valid
        });
        // Stop trusting the lease before anyone else can get the lock.
        self.ended.cancel();
        let (reply, rx) = oneshot::channel();
        match self.grant.release(to, Some(reply)) {
            None => return Ok(()),
            Some(false) => return Err(Error::Closed),
            Some(true) => {}
        }
        rx.await.map_err(|_| Error::Closed)?
    }

    /// The state the lease's validity reads (for tests of code above the manager).
    #[cfg(test)]
    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.grant.shared
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        // Stop trusting the lease before anyone else can get the lock: a `Leadership`
        // or `LeaderContext` kept by others turns invalid here, whoever drops the lease
        // and however (a task that panicked or was aborted included). The grant, dropped
        // after this, sends the release.
        self.ended.cancel();
    }
}

/// The validity check of a lease, detached from the lease (for leadership handles and
/// leader contexts, which must not own the lock). It ends when the lease's session
/// generation is revoked, when the watchdog deadline passes, or when the lease itself
/// ends on this node (released or dropped), whichever comes first.
#[derive(Clone, Debug)]
pub(crate) struct Validity {
    generation: Arc<Generation>,
    shared: Arc<Shared>,
    /// The lease's own end ([`Lease::ended`]).
    ended: CancellationToken,
}

impl Validity {
    pub(crate) fn is_valid(&self) -> bool {
        !self.ended.is_cancelled()
            && !self.generation.revoked.is_cancelled()
            && self.shared.is_valid_now()
    }

    pub(crate) fn loss_reason(&self) -> Option<SessionDownReason> {
        if let Some(reason) = self.generation.reason.get() {
            return Some(reason.clone());
        }
        if self.generation.revoked.is_cancelled() || self.ended.is_cancelled() {
            return Some(SessionDownReason::Shutdown);
        }
        (!self.shared.is_valid_now()).then(|| SessionDownReason::HeartbeatOverdue {
            lease_timeout: self.shared.options.lease_timeout,
        })
    }

    pub(crate) async fn lost(&self) -> SessionDownReason {
        loop {
            if let Some(reason) = self.loss_reason() {
                return reason;
            }
            let deadline = tokio::time::Instant::from_std(self.shared.valid_until());
            tokio::select! {
                biased;
                () = self.ended.cancelled() => {}
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
            crate::ConnectionState::Connecting { attempt: 1 },
        ));
        shared.extend_validity(crate::clock::now() + std::time::Duration::from_secs(1_000_000));
        let generation = Generation::new(1);
        (
            Self {
                generation: Arc::clone(&generation),
                shared,
                ended: CancellationToken::new(),
            },
            generation,
        )
    }
}

#[cfg(test)]
impl Lease {
    /// A lease of a fake manager: the receiver sees the commands the lease sends.
    pub(crate) fn for_tests() -> (
        Self,
        mpsc::UnboundedReceiver<crate::command::Command>,
        Arc<Generation>,
    ) {
        let (validity, generation) = Validity::for_tests();
        let (tx, rx) = mpsc::unbounded_channel();
        let grant = Grant::new(
            1,
            "test".into(),
            LockKey::derive("chosen", "test"),
            Some(FencingToken::new(7)),
            Arc::clone(&generation),
            Arc::clone(&validity.shared),
            Some(tx),
        );
        (Self::new(grant), rx, generation)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::command::Command;

    fn is_release(cmd: Option<&Command>) -> bool {
        matches!(cmd, Some(Command::Release { lease_id: 1, .. }))
    }

    #[tokio::test]
    async fn dropping_a_lease_ends_its_validity_before_the_release_is_sent() {
        let (lease, mut rx, _generation) = Lease::for_tests();
        let validity = lease.validity();
        assert!(validity.is_valid());
        drop(lease);
        // The manager's task sees the release only once the validity has ended.
        assert!(!validity.is_valid());
        assert!(validity.loss_reason().is_some());
        assert!(is_release(rx.recv().await.as_ref()));
        tokio::time::timeout(std::time::Duration::from_secs(5), validity.lost())
            .await
            .expect("lost() resolves once the lease is gone");
    }

    #[tokio::test]
    async fn releasing_a_lease_ends_its_validity_before_the_release_is_sent() {
        let (lease, mut rx, _generation) = Lease::for_tests();
        let validity = lease.validity();
        let release = tokio::spawn(lease.release());
        let Some(Command::Release { reply, .. }) = rx.recv().await else {
            panic!("expected a release");
        };
        assert!(!validity.is_valid());
        let _ = reply.expect("release waits for a reply").send(Ok(()));
        release.await.unwrap().unwrap();
    }

    /// The validity deadline and the timer that wakes `lost()` read one clock, so a
    /// paused clock (a test, a simulated fleet) moves both: the lease turns invalid
    /// exactly when its deadline passes, and not a moment before.
    #[tokio::test(start_paused = true)]
    async fn a_lease_deadline_passes_with_a_paused_clock() {
        use std::time::Duration;
        let (lease, _rx, _generation) = Lease::for_tests();
        let shared = Arc::clone(lease.shared());
        shared.invalidate();
        let start = tokio::time::Instant::now();
        shared.extend_validity(crate::clock::now() + Duration::from_secs(5));
        assert!(lease.is_valid());
        tokio::time::sleep(Duration::from_millis(4_900)).await;
        assert!(lease.is_valid(), "valid until its deadline");
        let reason = tokio::time::timeout(Duration::from_secs(60), lease.lost())
            .await
            .expect("lost() resolves once the deadline passes");
        assert!(
            matches!(reason, SessionDownReason::HeartbeatOverdue { .. }),
            "{reason:?}"
        );
        assert!(!lease.is_valid());
        assert!(start.elapsed() >= Duration::from_secs(5));
        assert!(
            start.elapsed() < Duration::from_secs(6),
            "{:?}",
            start.elapsed()
        );
    }
}
