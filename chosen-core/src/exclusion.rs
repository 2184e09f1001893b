//! The exclusion self-test: before a new session's advisory locks are trusted, a key
//! taken on it must be refused to a second session.
//!
//! Some servers and proxies answer the advisory-lock functions without keeping the
//! lock to the session that took it: a transaction pooler (PgBouncer
//! `pool_mode=transaction`, Supavisor's transaction port, RDS Proxy without pinning)
//! hands the backend that holds it to its other clients; a PostgreSQL-compatible engine
//! may lack the functions, answer them with a stub, or grant one key twice. The
//! self-test asks the question chosen's safety rests on, on the server itself:
//!
//! 1. the new session takes a key of its own (one no other session uses) and listens
//!    on a channel of its own, and goes idle, as between any two of its statements;
//! 2. a second, short-lived connection to the same target (opened alongside the
//!    session's when no server is proven yet or the target names several hosts; else
//!    once the session's probe found a server other than the proven one) tries the key, reports its backend and server, and sends a
//!    notification on the session's channel;
//! 3. the notification must reach the session while it is idle (only a backend bound
//!    to the session's own connection sends it then: a transaction pooler holds it on
//!    an idle pooled backend, whatever its pool size, its scheduling or a balancer in
//!    front of several of them); then the session releases the key, and reports its
//!    backend.
//!
//! The key must have been granted to the session, refused to the second connection,
//! and still held by the session afterwards, on the same backend; the second
//! connection must have reached the same server with a backend of its own. [`judge`]
//! decides from what the three steps saw; each backend (PostgreSQL, the simulated
//! server) gathers it. A manager runs it once per server identity (the server's
//! address, database and start, and the client's address as the server sees it), and
//! again after a session found its backend shared or swapped, so that a reconnect to
//! the proven server stays as fast as the stop fences need.

use crate::key::LockKey;
use crate::status::SessionDownReason;

/// The key namespace of the self-test's keys (reserved, see
/// [`RESERVED_PREFIX`](crate::names::RESERVED_PREFIX)): no lock of a user is one of
/// them.
const PROBE_NAMESPACE: &str = "chosen.exclusion-probe";

/// The key (`pg_try_advisory_lock(key1, key2)`) session `marker`, unique to the
/// session, takes for the self-test.
pub(crate) fn probe_key(marker: &str) -> (i32, i32) {
    match LockKey::derive(PROBE_NAMESPACE, marker) {
        LockKey::Pair(key1, key2) => (key1, key2),
        // `derive` answers pairs only.
        LockKey::Int(key) => ((key >> 32) as i32, key as i32),
    }
}

/// What the self-test's three steps saw.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Seen {
    /// The session's backend when it took the key, and whether it was granted.
    pub(crate) ours: i32,
    pub(crate) took: bool,
    /// The second connection's backend, whether the key was granted to it, and
    /// whether it reached the session's server.
    pub(crate) other: i32,
    pub(crate) other_granted: bool,
    pub(crate) same_server: bool,
    /// The second connection's notification reached the idle session.
    pub(crate) notified: bool,
    /// The session's backend when it released the key, and whether it still held it.
    pub(crate) after: i32,
    pub(crate) released: bool,
}

/// Whether the server kept the key to the session alone: `Ok`, or why its advisory
/// locks cannot be trusted.
pub(crate) fn judge(seen: &Seen) -> Result<(), SessionDownReason> {
    let pooler = |detail: String| Err(SessionDownReason::PoolerDetected { detail });
    let unsafe_locks = |detail: String| Err(SessionDownReason::AdvisoryLocksUnsafe { detail });
    if seen.ours <= 0 || seen.other <= 0 || seen.after <= 0 {
        return unsafe_locks(format!(
            "the server answered no backend pid (got {}, {} and {})",
            seen.ours, seen.other, seen.after
        ));
    }
    if !seen.same_server {
        return unsafe_locks(
            "a second connection to the same target reached another server".to_owned(),
        );
    }
    if seen.other == seen.ours || seen.other == seen.after {
        return pooler(format!(
            "a second connection got this session's backend (pid {})",
            seen.other
        ));
    }
    if seen.after != seen.ours {
        return pooler(format!(
            "this session's backend changed from pid {} to {}",
            seen.ours, seen.after
        ));
    }
    if !seen.notified {
        return pooler(format!(
            "a notification to this session's backend (pid {}) did not reach it while idle",
            seen.ours
        ));
    }
    if !seen.took {
        return unsafe_locks(format!("a free key was refused to pid {}", seen.ours));
    }
    if seen.other_granted {
        return unsafe_locks(format!(
            "a key held by pid {} was also granted to pid {}",
            seen.ours, seen.other
        ));
    }
    if !seen.released {
        return unsafe_locks(format!(
            "a key taken by pid {} was gone a moment later",
            seen.ours
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const HONEST: Seen = Seen {
        ours: 10,
        took: true,
        other: 11,
        other_granted: false,
        same_server: true,
        notified: true,
        after: 10,
        released: true,
    };

    #[test]
    fn a_server_that_keeps_the_key_to_its_session_passes() {
        assert_eq!(judge(&HONEST), Ok(()));
    }

    #[test]
    fn every_way_of_not_excluding_is_refused() {
        let pooler = |r: Result<(), SessionDownReason>| {
            matches!(r, Err(SessionDownReason::PoolerDetected { .. }))
        };
        let unsafe_locks = |r: Result<(), SessionDownReason>| {
            matches!(r, Err(SessionDownReason::AdvisoryLocksUnsafe { .. }))
        };
        // A transaction pooler with one backend: the second client is served by it,
        // and re-entrantly granted the key.
        assert!(pooler(judge(&Seen {
            other: 10,
            other_granted: true,
            ..HONEST
        })));
        // The second client lands on the backend our next statement runs on.
        assert!(pooler(judge(&Seen {
            other: 12,
            after: 12,
            released: false,
            ..HONEST
        })));
        // Our statements move between backends.
        assert!(pooler(judge(&Seen {
            after: 12,
            released: false,
            ..HONEST
        })));
        // Transaction poolers behind a balancer: the second connection lands in
        // another pool, the session's statements stay on one backend, but nothing
        // reaches the session while it is idle.
        assert!(pooler(judge(&Seen {
            notified: false,
            ..HONEST
        })));
        // A stub that answers no pid.
        assert!(unsafe_locks(judge(&Seen {
            ours: 0,
            after: 0,
            ..HONEST
        })));
        // A balancer over several servers.
        assert!(unsafe_locks(judge(&Seen {
            same_server: false,
            ..HONEST
        })));
        // A stub that refuses the session and grants the second connection: named
        // for the refusal.
        assert_eq!(
            judge(&Seen {
                took: false,
                other_granted: true,
                released: false,
                ..HONEST
            }),
            Err(SessionDownReason::AdvisoryLocksUnsafe {
                detail: "a free key was refused to pid 10".to_owned()
            })
        );
        // A stub that grants everything, or an engine that grants one key twice.
        assert!(unsafe_locks(judge(&Seen {
            other_granted: true,
            ..HONEST
        })));
        // A stub that refuses everything.
        assert!(unsafe_locks(judge(&Seen {
            took: false,
            ..HONEST
        })));
        // A lock lost as soon as it was taken (a transaction-scoped one answered as a
        // session's).
        assert!(unsafe_locks(judge(&Seen {
            released: false,
            ..HONEST
        })));
    }

    #[test]
    fn the_probe_key_is_unique_to_the_session_and_no_lock_of_a_user() {
        assert_ne!(probe_key("a.1.1.ff"), probe_key("a.1.1.fe"));
        let (key1, key2) = probe_key("a.1.1.ff");
        assert_ne!(
            LockKey::Pair(key1, key2),
            LockKey::derive(crate::key::DEFAULT_NAMESPACE, "a.1.1.ff")
        );
    }
}
