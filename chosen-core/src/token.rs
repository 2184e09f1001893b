//! The fencing token: a value, no behaviour.

use std::fmt;

/// A number that grows with every acquisition of a lock.
///
/// Each acquisition gets a token strictly greater than the token of every earlier
/// holder of the same lock, on any node, also across a server crash and a failover.
/// Pass it to systems your guarded work writes to, and have them reject writes carrying
/// a token lower than one they have already seen: that stops a holder which was frozen
/// past the server's release time and wakes up believing it still holds the lock.
///
/// # Layout
///
/// ```text
///  63          48 47                                            0
/// +--------------+-----------------------------------------------+
/// |   timeline   |     transaction id (low 48 bits of xid8)      |
/// +--------------+-----------------------------------------------+
/// ```
///
/// * The low 48 bits are the PostgreSQL transaction id (`pg_current_xact_id()`, the
///   64-bit `xid8` with its epoch) of the statement that issued the token while the
///   session held the lock (the statement that won it, for a request that asked for
///   the token with the grant; otherwise the one that answered the holder's first
///   [`Lease::fencing_token`](crate::Lease::fencing_token), which issues it only if
///   the session still holds the lock), assigned only then and committed durably (a small WAL record and
///   `synchronous_commit = local` for that statement, whatever the server's setting),
///   so a crash cannot hand the same id out again. 2<sup>48</sup> transactions are 89 years at 100,000 per
///   second; past that the low bits would wrap and tokens go backwards (PostgreSQL's
///   own epoch runs out at 2<sup>64</sup>).
/// * The high 16 bits are the server's timeline (`pg_walfile_name(pg_current_wal_lsn())`),
///   which a promotion raises: after an asynchronous failover the promoted standby may
///   hand out transaction ids the old primary already handed out without replicating
///   them, and the timeline keeps its tokens above every token of the old primary. A
///   server on timeline 32,768 or later is refused, so that bit 63 stays clear and a
///   token stored in a signed 64-bit column (`bigint`) stays positive.
///   This needs timelines that do not collide: two standbys promoted one after the
///   other without a shared WAL archive (the second never saw the first's timeline)
///   both take the same timeline number, and the second's ids start from the old
///   primary's, below the first's; so does a base backup restored without
///   `recovery.signal`. Then tokens go backwards (downstream systems refuse the new,
///   legitimate holder: a stall, not two writers). Keep a shared WAL archive, or let
///   the failover tool rebuild standbys after a promotion.
/// * Some operations start a cluster on timeline 1 again: `pg_upgrade` (transaction
///   ids carry over, the timeline does not), a logical-replication or blue/green
///   cutover and a dump and restore (transaction ids restart as well). Tokens would go
///   backwards after them: set `chosen.token_epoch` on the new cluster before it takes
///   connections (the crate documentation, "Moving to another cluster", has the
///   procedure; [`ManagerOptions::token_epoch`](crate::ManagerOptions::token_epoch) is
///   the client-side form): the high bits are the timeline plus the epoch. A running
///   manager refuses a server whose tokens would not order after the ones it issued.
///
/// Tokens of the same lock compare as plain numbers (`u64`).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct FencingToken(u64);

impl FencingToken {
    /// Wraps a raw token value (for tests and for comparing stored tokens).
    #[must_use]
    pub const fn new(value: u64) -> Self {
        Self(value)
    }

    /// The token of transaction id `xid` (its low 48 bits) on `timeline`.
    #[must_use]
    pub const fn from_parts(timeline: u16, xid: u64) -> Self {
        Self(((timeline as u64) << 48) | (xid & Self::XID_MASK))
    }

    const XID_MASK: u64 = (1 << 48) - 1;

    /// The token as a number.
    #[must_use]
    pub const fn get(self) -> u64 {
        self.0
    }

    /// The server timeline the token was issued on, plus the
    /// [token epoch](crate::ManagerOptions::token_epoch) (its high 16 bits).
    #[must_use]
    pub const fn timeline(self) -> u16 {
        (self.0 >> 48) as u16
    }

    /// The low 48 bits of the transaction id that issued the token.
    #[must_use]
    pub const fn xact_id(self) -> u64 {
        self.0 & Self::XID_MASK
    }
}

impl fmt::Display for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}
