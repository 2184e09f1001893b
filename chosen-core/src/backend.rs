//! The seam between the manager's task and a database server: where sessions come from
//! ([`Backend`]) and what an open session does ([`Link`], [`HeartbeatLink`]). The task
//! knows only these; PostgreSQL ([`crate::pg`]) is the one backend that ships, and a
//! simulated server is to stand in for it in tests, running the real task above it.
//! (The answers still carry `tokio_postgres::Error`, which only tokio-postgres can
//! make: such a server answers a failed statement as a lost session or no answer, not
//! as a database error.)
//!
//! Every implementation keeps the same contract (the one the PostgreSQL code keeps):
//!
//! 1. [`Link::perform`] sends a whole plan on its first poll, ahead of anything sent
//!    later on the session (heartbeats included), and answers it in one round trip. An
//!    `Err` ends the session; a statement that failed with the session intact is in the
//!    [`Done`].
//! 2. [`HeartbeatLink::heartbeat`] answers in the order sent: the advisory locks the
//!    session holds when it runs, or why the session is lost.
//! 3. Notifications and the session's end arrive on [`Session::events`], filled by the
//!    session's own connection task: a notification stamped when that task read it, the
//!    end once, after every earlier message.
//! 4. Dropping the [`Link`] closes the session: the server ends it and frees its locks
//!    (unless the wire is cut).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::mpsc;

use crate::engine::{Done, Term};
use crate::error::Result;
use crate::fault::Fault;
use crate::generation::Generation;
use crate::info::HolderInfo;
use crate::key::{LockKey, SessionLock};
use crate::options::ManagerOptions;
use crate::status::SessionDownReason;
use crate::table::Plan;

/// A boxed future that may move between threads.
pub(crate) type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Who holds a key, as a look-up answers it: its holder if any, or why the look-up of
/// that key failed.
pub(crate) type HolderAnswer = Result<Option<HolderInfo>, Arc<tokio_postgres::Error>>;

/// Where sessions come from.
pub(crate) trait Backend: Send + Sync + fmt::Debug + 'static {
    /// Opens and proves session `generation`, within the options' connect timeout.
    fn connect<'a>(
        &'a self,
        options: &'a ManagerOptions,
        generation: u64,
    ) -> BoxFuture<'a, Result<Session>>;

    /// The seed of the manager's jitter (poll spreading, backoffs), or `None` for one
    /// drawn from the time and the process. A simulated server gives a fixed one, so
    /// that a run replays exactly (each manager mixes its node id in).
    fn seed(&self) -> Option<u64> {
        None
    }

    /// A session on the proven server was found sharing or swapping its backend (a
    /// pooler put in between): the next session proves the server again.
    fn forget_proven(&self) {}

    /// Its sessions hold rows, not a backend's advisory locks (the lease-row mode): a
    /// session found missing a lock is not a pooler's, and is retired as any lost
    /// session (what it still holds stays until the next session fences the work still
    /// stopping).
    fn holds_rows(&self) -> bool {
        false
    }
}

/// One open session's statements.
pub(crate) trait Link: Send + Sync + 'static {
    /// Carries out a plan (contract item 1); a failed try statement's error is
    /// answered beside the [`Done`].
    fn perform<'a>(
        &'a self,
        plan: &'a Plan,
    ) -> BoxFuture<'a, Result<(Done, Option<tokio_postgres::Error>), Fault>>;

    /// Who holds each of `keys`.
    fn holders<'a>(
        &'a self,
        keys: &'a [LockKey],
    ) -> BoxFuture<'a, Result<Vec<HolderAnswer>, Fault>>;

    /// Every advisory lock of the database, with its holder.
    fn cluster(&self) -> BoxFuture<'_, Result<Vec<(LockKey, HolderInfo)>, Fault>>;

    /// Leaves the session as it found it (a graceful shutdown's last statement).
    fn reset(&self) -> BoxFuture<'_, Result<(), Fault>>;

    /// What the heartbeat task needs of the session.
    fn heartbeat_link(&self) -> Box<dyn HeartbeatLink>;

    /// The connection is known to be closed.
    fn is_closed(&self) -> bool;
}

/// The heartbeat's statement on a session (contract item 2).
pub(crate) trait HeartbeatLink: Send + Sync + 'static {
    /// Proves the session is still this one and writable; answers the advisory locks
    /// it holds (those of a form the manager never takes left out).
    fn heartbeat(&self) -> BoxFuture<'_, Result<Vec<SessionLock>, SessionDownReason>>;

    /// Why the session is lost, in this backend's words: the heartbeat's verdicts
    /// speak of a backend's advisory locks (a lock missing is another client's doing).
    fn explain(&self, reason: SessionDownReason) -> SessionDownReason {
        reason
    }
}

/// An open, proven session: its statements, and what the task needs to know of it.
/// Only the manager's task uses one.
pub(crate) struct Session {
    link: Box<dyn Link>,
    pub(crate) backend_pid: i32,
    /// The server's address and port as it sees this connection (`inet_server_addr()`,
    /// `inet_server_port()`), empty over a Unix socket: which host of a multi-host URL
    /// the session is on.
    pub(crate) server: String,
    pub(crate) generation: Arc<Generation>,
    /// Notifications and the session's end (contract item 3).
    pub(crate) events: mpsc::UnboundedReceiver<ConnEvent>,
    /// When the setup query that proved the session was sent.
    pub(crate) proven_at: Instant,
    /// The server's current term as primary.
    pub(crate) term: Term,
}

/// What a session's connection task reports.
#[derive(Debug)]
pub(crate) enum ConnEvent {
    /// A release announcement: the sender's backend pid (stamped by the server), the
    /// payload (key tags joined by commas), and when it arrived (the task reads it
    /// between steps, possibly after a slow try answered: an announcement vouches only
    /// for a win answered within the grace of its arrival).
    Notification {
        sender: i32,
        payload: String,
        at: Instant,
    },
    Closed(String),
}

/// What a new [`Session`] is made of, besides its link.
pub(crate) struct Opened {
    pub(crate) backend_pid: i32,
    pub(crate) server: String,
    pub(crate) generation: Arc<Generation>,
    pub(crate) events: mpsc::UnboundedReceiver<ConnEvent>,
    pub(crate) proven_at: Instant,
    pub(crate) term: Term,
}

impl Session {
    pub(crate) fn new(link: Box<dyn Link>, opened: Opened) -> Self {
        let Opened {
            backend_pid,
            server,
            generation,
            events,
            proven_at,
            term,
        } = opened;
        Self {
            link,
            backend_pid,
            server,
            generation,
            events,
            proven_at,
            term,
        }
    }

    /// See [`Link::perform`].
    pub(crate) async fn perform(
        &self,
        plan: &Plan,
    ) -> Result<(Done, Option<tokio_postgres::Error>), Fault> {
        self.link.perform(plan).await
    }

    /// See [`Link::holders`].
    pub(crate) async fn holders(&self, keys: &[LockKey]) -> Result<Vec<HolderAnswer>, Fault> {
        self.link.holders(keys).await
    }

    /// See [`Link::cluster`].
    pub(crate) async fn cluster(&self) -> Result<Vec<(LockKey, HolderInfo)>, Fault> {
        self.link.cluster().await
    }

    /// See [`Link::reset`].
    pub(crate) async fn reset(&self) -> Result<(), Fault> {
        self.link.reset().await
    }

    /// A handle for the heartbeat task.
    pub(crate) fn heartbeat_handle(&self) -> Box<dyn HeartbeatLink> {
        self.link.heartbeat_link()
    }

    /// The connection is known to be closed.
    pub(crate) fn is_closed(&self) -> bool {
        self.link.is_closed()
    }
}
