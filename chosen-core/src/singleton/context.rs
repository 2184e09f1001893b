//! What a child gets: [`LeaderContext`].

use super::*;

/// What a child gets: why it runs, and how it is told to stop.
#[derive(Clone)]
pub struct LeaderContext {
    pub(super) name: Arc<str>,
    pub(super) node_id: Arc<str>,
    pub(super) token: FencingToken,
    pub(super) restarts: u64,
    pub(super) cancel: CancellationToken,
    pub(super) validity: Validity,
}

impl fmt::Debug for LeaderContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaderContext")
            .field("name", &self.name)
            .field("node_id", &self.node_id)
            .field("token", &self.token)
            .field("restarts", &self.restarts)
            .field("cancelled", &self.cancel.is_cancelled())
            .finish()
    }
}

impl LeaderContext {
    /// The singleton's name.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// This node's id.
    #[must_use]
    pub fn node_id(&self) -> &str {
        &self.node_id
    }

    /// The fencing token of the lease the child runs under; pass it to downstream
    /// systems so they can reject a stale holder.
    #[must_use]
    pub fn fencing_token(&self) -> FencingToken {
        self.token
    }

    /// How many times the child was restarted under this lease.
    #[must_use]
    pub fn restarts(&self) -> u64 {
        self.restarts
    }

    /// Resolves when the child must stop (lease lost or shutdown). After it, the child
    /// has the singleton's shutdown timeout to return before it is aborted.
    pub fn cancelled(&self) -> WaitForCancellationFuture<'_> {
        self.cancel.cancelled()
    }

    /// `true` once the child must stop.
    #[must_use]
    pub fn is_cancelled(&self) -> bool {
        self.cancel.is_cancelled()
    }

    /// The cancellation token (to hand to sub-tasks).
    #[must_use]
    pub fn cancellation_token(&self) -> CancellationToken {
        self.cancel.clone()
    }

    /// `true` while the lease may be trusted *and* the child was not told to stop:
    /// check it right before each guarded step.
    #[must_use]
    pub fn is_valid(&self) -> bool {
        !self.cancel.is_cancelled() && self.validity.is_valid()
    }

    /// A fenced write under the child's lease: records
    /// [`fencing_token`](Self::fencing_token) for the singleton's name inside `tx`, in
    /// the default fence table, as [`Lease::fence`] does; refused at once, sending
    /// nothing, once the child must stop ([`is_valid`](Self::is_valid) is `false`).
    /// See [`fenced`](crate::fenced) for the guarantee.
    ///
    /// # Errors
    ///
    /// [`Error::LeaseLost`](crate::Error::LeaseLost) once the child must stop; otherwise
    /// as [`fenced::fence`](crate::fenced::fence).
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
        if !self.is_valid() {
            let reason = self
                .validity
                .loss_reason()
                .unwrap_or(SessionDownReason::Shutdown);
            return Err(Error::LeaseLost(reason));
        }
        table.fence(tx, &self.name, self.token).await
    }

    /// Why the lease was lost, once it was (`None` for a shutdown that kept it valid).
    #[must_use]
    pub fn loss_reason(&self) -> Option<SessionDownReason> {
        self.validity.loss_reason()
    }
}
