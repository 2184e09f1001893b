//! What the handles ask of the manager's task, and what a granted lock is on its way
//! back: values with no rules.

use std::sync::Arc;

use tokio::sync::{mpsc, oneshot};

use crate::error::Result;
use crate::generation::Generation;
use crate::info::{HolderInfo, LockInfo};
use crate::key::LockKey;
use crate::shared::Shared;
use crate::table::{Request, RequestId};
use crate::token::FencingToken;

/// A request to the manager's task.
pub(crate) enum Command {
    Acquire {
        request: Request,
        reply: oneshot::Sender<Result<Option<Grant>>>,
    },
    /// The caller stopped waiting for request `id`.
    Withdraw {
        key: LockKey,
        id: RequestId,
    },
    Release {
        key: LockKey,
        lease_id: u64,
        /// Hand the lock over to this node (its id).
        to: Option<String>,
        reply: Option<oneshot::Sender<Result<()>>>,
    },
    /// The holder `id` of `key` reads its fencing token (`None`: it could not be had).
    Token {
        key: LockKey,
        id: RequestId,
        reply: oneshot::Sender<Option<FencingToken>>,
    },
    Locks(oneshot::Sender<Vec<LockInfo>>),
    Holder {
        key: LockKey,
        reply: oneshot::Sender<Result<Option<HolderInfo>>>,
    },
    Cluster(ClusterReply),
    /// A shutdown began: waiting requests are answered `Closed` and new ones refused at
    /// once, while the supervisors stop (leases stay until released).
    Closing,
    Shutdown(oneshot::Sender<()>),
}

/// Where the rows of a cluster view go.
pub(crate) type ClusterReply = oneshot::Sender<Result<Vec<(LockKey, HolderInfo)>>>;

pub(crate) type HolderReply = oneshot::Sender<Result<Option<HolderInfo>>>;

/// A lock the task granted, on its way to its requester, who wraps it in a
/// [`Lease`](crate::Lease). Dropping it releases the lock (through the task), so a grant
/// whose requester is gone never keeps the lock; [`disarm`](Self::disarm) makes the
/// drop a no-op when the task takes the lock back itself.
#[derive(Debug)]
pub(crate) struct Grant {
    pub(crate) id: RequestId,
    pub(crate) name: Arc<str>,
    pub(crate) key: LockKey,
    /// `None` for a request that did not ask for its token eagerly.
    pub(crate) token: Option<FencingToken>,
    pub(crate) generation: Arc<Generation>,
    pub(crate) shared: Arc<Shared>,
    /// `None` once released (or never armed), so `Drop` and a release don't both act.
    tx: Option<mpsc::UnboundedSender<Command>>,
}

impl Grant {
    /// A grant that releases through `tx` when dropped (`None`: releases nothing).
    pub(crate) fn new(
        id: RequestId,
        name: Arc<str>,
        key: LockKey,
        token: Option<FencingToken>,
        generation: Arc<Generation>,
        shared: Arc<Shared>,
        tx: Option<mpsc::UnboundedSender<Command>>,
    ) -> Self {
        Self {
            id,
            name,
            key,
            token,
            generation,
            shared,
            tx,
        }
    }

    /// Makes `Drop` a no-op: the grant never reached its owner, and the task takes the
    /// lock back itself.
    pub(crate) fn disarm(&mut self) {
        self.tx = None;
    }

    /// Asks the task for this lease's fencing token: `None` when it was released (or
    /// disarmed) already, or the task is gone.
    pub(crate) fn read_token(&self) -> Option<oneshot::Receiver<Option<FencingToken>>> {
        let tx = self.tx.as_ref()?;
        let (reply, rx) = oneshot::channel();
        tx.send(Command::Token {
            key: self.key,
            id: self.id,
            reply,
        })
        .ok()?;
        Some(rx)
    }

    /// Asks the task to release the lock (for `to`, a hand-over), once: `None` if it was
    /// released or disarmed already, `Some(false)` if the task is gone (and with it the
    /// session and the lock).
    pub(crate) fn release(
        &mut self,
        to: Option<String>,
        reply: Option<oneshot::Sender<Result<()>>>,
    ) -> Option<bool> {
        let tx = self.tx.take()?;
        Some(
            tx.send(Command::Release {
                key: self.key,
                lease_id: self.id,
                to,
                reply,
            })
            .is_ok(),
        )
    }
}

impl Drop for Grant {
    fn drop(&mut self) {
        // If the task is gone, so is the session and the lock with it.
        let _ = self.release(None, None);
    }
}
