//! What the manager reports about locks: values, no behaviour.

use std::time::SystemTime;

use crate::key::LockKey;
use crate::token::FencingToken;

/// One lock this manager holds or waits for, as [`LockManager::locks`](crate::LockManager::locks) reports it.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct LockInfo {
    /// The lock's name (for raw keys, `key(...)`).
    pub name: String,
    /// The advisory-lock key.
    pub key: LockKey,
    /// Held or waiting.
    pub state: LockState,
    /// The identity of the lease or request inside this manager.
    pub request_id: u64,
    /// The node id of this manager.
    pub node_id: String,
    /// When the lease was granted, or when the request started waiting.
    pub since: SystemTime,
}

/// The session holding a lock, as the database reports it
/// ([`LockManager::holder`](crate::LockManager::holder)).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct HolderInfo {
    /// The holder's `application_name`: for chosen managers, their node id
    /// (PostgreSQL keeps at most 63 bytes of it).
    pub node_id: String,
    /// The holder's backend process id.
    pub backend_pid: i32,
    /// The holder's client address (`None` for Unix-socket connections).
    pub client_addr: Option<String>,
    /// When the holder's session started (PostgreSQL does not record when a lock was
    /// granted).
    pub session_start: Option<SystemTime>,
}

/// One advisory lock held in the database, as [`LockManager::cluster_locks`](crate::LockManager::cluster_locks) reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ClusterLock {
    /// The lock's name, when known to the caller.
    pub name: Option<String>,
    /// The key.
    pub key: LockKey,
    /// The session holding it.
    pub holder: HolderInfo,
}

/// Whether a [`LockInfo`] entry holds or waits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum LockState {
    /// Held by a lease of this manager.
    Held {
        /// The lease's fencing token, `None` until issued (see
        /// [`Lease::fencing_token`](crate::Lease::fencing_token)).
        token: Option<FencingToken>,
        /// The session generation it belongs to.
        generation: u64,
    },
    /// Waiting; `position` 0 is next in line within this process.
    Waiting {
        /// Place in this process's FIFO queue for the lock.
        position: usize,
    },
}
