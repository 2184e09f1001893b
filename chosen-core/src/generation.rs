//! A session generation: every (re)connect starts one, and every lease belongs to one;
//! revoking it ends all of them at once.

use std::sync::Arc;

use crate::status::SessionDownReason;

/// Shared by every lease of one generation: revoked all at once.
#[derive(Debug)]
pub(crate) struct Generation {
    pub(crate) id: u64,
    pub(crate) revoked: tokio_util::sync::CancellationToken,
    pub(crate) reason: std::sync::OnceLock<SessionDownReason>,
}

impl Generation {
    pub(crate) fn new(id: u64) -> Arc<Self> {
        Arc::new(Self {
            id,
            revoked: tokio_util::sync::CancellationToken::new(),
            reason: std::sync::OnceLock::new(),
        })
    }

    pub(crate) fn revoke(&self, reason: SessionDownReason) {
        let _ = self.reason.set(reason);
        self.revoked.cancel();
    }
}
