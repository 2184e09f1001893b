//! The state of a manager's lock session.

use std::fmt;
use std::time::{Duration, SystemTime};

/// The state of a [`LockManager`](crate::LockManager)'s database session, as
/// [`connection_status`](crate::LockManager::connection_status) reports it (a *state*
/// enum, as [`SingletonState`](crate::SingletonState), where `*Status` types are
/// snapshots such as [`SingletonStatus`](crate::SingletonStatus)).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConnectionState {
    /// A connection attempt is under way.
    Connecting {
        /// 1 for the first attempt after a loss, counting up.
        attempt: u32,
    },
    /// The session is up and its last heartbeat succeeded in time.
    Connected {
        /// The session generation; every reconnect starts a new one.
        generation: u64,
        /// The server process id serving the session (`pg_backend_pid()`).
        backend_pid: i32,
        /// The server's address and port as it sees this connection
        /// (`inet_server_addr()`:`inet_server_port()`, e.g. `10.0.0.7:5432`; empty over
        /// a Unix socket): which host of a multi-host URL the session is on, e.g. the
        /// promoted standby after a failover.
        server: String,
    },
    /// The session is down; every lease was revoked. A new attempt follows unless
    /// the manager shut down.
    Disconnected {
        /// Why.
        reason: SessionDownReason,
        /// Since when (wall clock).
        since: SystemTime,
    },
}

impl ConnectionState {
    /// `true` when the session is up.
    #[must_use]
    pub fn is_connected(&self) -> bool {
        matches!(self, Self::Connected { .. })
    }
}

/// Why the lock session is down: it ended (lost, overdue, shut down) or was refused
/// (a standby, a read-only or too old server, a pooler, a failed connect). Every
/// variant revokes all leases of the session at once.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum SessionDownReason {
    /// The connection closed or failed (server shutdown, `pg_terminate_backend`,
    /// `idle_session_timeout`, network error).
    ConnectionLost {
        /// What was observed.
        message: String,
    },
    /// No heartbeat succeeded within the lease timeout: the session may be partitioned
    /// or the server stalled, so this client stopped trusting its locks.
    HeartbeatOverdue {
        /// The lease timeout that passed.
        lease_timeout: Duration,
    },
    /// The server is a hot standby (`pg_is_in_recovery()`): a standby grants advisory
    /// locks locally, unseen by the primary.
    ServerInRecovery,
    /// The session is read-only (`transaction_read_only` is on: the server, database
    /// or role sets `default_transaction_read_only`, e.g. an old primary fenced that
    /// way during a switchover): chosen holds locks on a writable primary only, as
    /// read-write targeting of a multi-host URL requires. Connect to the primary; if
    /// the role or database sets it, remove that (`ALTER ROLE ... RESET
    /// default_transaction_read_only`).
    ServerReadOnly,
    /// The backend process changed under the session: a transaction-mode pooler sits in
    /// between, through which session locks are unsafe.
    BackendChanged {
        /// The pid the session started with.
        expected: i32,
        /// The pid that answered.
        found: i32,
    },
    /// Something between client and server shares or swaps backends (a
    /// transaction-mode pooler): session locks would be shared with other clients.
    PoolerDetected {
        /// What was observed.
        detail: String,
    },
    /// The server's advisory locks do not keep a key to the session that took it: a
    /// key held by this session was granted to another one too, or a free key was
    /// refused, or lost a moment after it was taken (a stub, an engine without real
    /// session advisory locks, a proxy that answers for the server). Found by the
    /// self-test every new server gets; see "Where chosen runs" in the README.
    AdvisoryLocksUnsafe {
        /// What the self-test saw.
        detail: String,
    },
    /// The server is older than the minimum supported version.
    ServerTooOld {
        /// `server_version_num` of the server.
        version: i32,
    },
    /// The connection attempt failed.
    ConnectFailed {
        /// What the attempt reported.
        message: String,
    },
    /// The manager was shut down.
    Shutdown,
}

impl SessionDownReason {
    /// A short, fixed label for metrics: `connection_lost`, `heartbeat_overdue`,
    /// `server_in_recovery`, `server_read_only`, `backend_changed`, `pooler_detected`,
    /// `server_too_old`, `connect_failed`, `shutdown`.
    #[must_use]
    pub fn label(&self) -> &'static str {
        match self {
            Self::ConnectionLost { .. } => "connection_lost",
            Self::HeartbeatOverdue { .. } => "heartbeat_overdue",
            Self::ServerInRecovery => "server_in_recovery",
            Self::ServerReadOnly => "server_read_only",
            Self::BackendChanged { .. } => "backend_changed",
            Self::PoolerDetected { .. } => "pooler_detected",
            Self::AdvisoryLocksUnsafe { .. } => "advisory_locks_unsafe",
            Self::ServerTooOld { .. } => "server_too_old",
            Self::ConnectFailed { .. } => "connect_failed",
            Self::Shutdown => "shutdown",
        }
    }
}

impl fmt::Display for SessionDownReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::ConnectionLost { message } => write!(f, "connection lost: {message}"),
            Self::HeartbeatOverdue { lease_timeout } => write!(
                f,
                "no heartbeat succeeded within the lease timeout of {lease_timeout:?}"
            ),
            Self::ServerInRecovery => f.write_str(
                "the server is in recovery (a hot standby); connect to the primary, e.g. with target_session_attrs=read-write",
            ),
            Self::ServerReadOnly => f.write_str(
                "the session is read-only (default_transaction_read_only): connect to a writable primary, or reset the setting",
            ),
            Self::BackendChanged { expected, found } => write!(
                f,
                "the backend pid changed from {expected} to {found}: a transaction pooler is in between; connect directly or in session mode",
            ),
            Self::PoolerDetected { detail } => write!(
                f,
                "a transaction pooler seems to be in between ({detail}); connect directly or in session mode",
            ),
            Self::AdvisoryLocksUnsafe { detail } => write!(
                f,
                "the server's advisory locks do not exclude ({detail}); use PostgreSQL directly or through a session-mode pooler",
            ),
            Self::ServerTooOld { version } => write!(
                f,
                "server_version_num {version} is older than 140000; PostgreSQL 14 or newer is required (for idle_session_timeout)",
            ),
            Self::ConnectFailed { message } => write!(f, "connection attempt failed: {message}"),
            Self::Shutdown => f.write_str("the lock manager shut down"),
        }
    }
}
