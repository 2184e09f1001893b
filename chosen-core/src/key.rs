//! Lock names and the PostgreSQL advisory-lock keys they map to.

use std::fmt;

use sha2::{Digest, Sha256};

/// The namespace used when none is configured.
///
/// Part of the key derivation: changing it changes every key. Do not change.
pub const DEFAULT_NAMESPACE: &str = "chosen";

/// The PostgreSQL advisory-lock key a lock is taken under.
///
/// PostgreSQL has two key spaces for advisory locks that never conflict with each
/// other: one `bigint` key, and a pair of `integer` keys. Named locks live in the
/// pair space ([`LockKey::Pair`]), away from the `bigint` keys most applications use;
/// both forms are accepted as raw keys for interoperability with other programs.
///
/// # Derivation of named keys
///
/// A name maps to a key as follows, and this never changes across versions
/// (golden vectors in the test suite freeze it):
///
/// 1. `digest = SHA-256(namespace || 0x00 || name)`, strings as UTF-8 bytes;
/// 2. `key1` = the first 4 bytes of `digest` as a big-endian signed 32-bit integer,
///    `key2` = the next 4 bytes, likewise;
/// 3. the lock is `pg_try_advisory_lock(key1, key2)`.
///
/// The same computation in SQL, to find a lock by name:
///
/// ```sql
/// SELECT ('x' || encode(substr(h, 1, 4), 'hex'))::bit(32)::int4 AS key1,
///        ('x' || encode(substr(h, 5, 4), 'hex'))::bit(32)::int4 AS key2
/// FROM (SELECT sha256(convert_to('chosen', 'UTF8') || '\x00'::bytea
///                     || convert_to('my-job', 'UTF8')) AS h) AS d;
/// ```
///
/// and in [`pg_locks`](https://www.postgresql.org/docs/current/view-pg-locks.html)
/// such a lock is the row with `locktype = 'advisory'`, `objsubid = 2`,
/// `classid = key1::oid` and `objid = key2::oid` (the `oid` columns show the keys as
/// unsigned numbers).
///
/// ```
/// use chosen_core::LockKey;
///
/// let key = LockKey::derive("chosen", "my-job");
/// assert_eq!(key, LockKey::derive("chosen", "my-job"));
/// assert_ne!(key, LockKey::derive("other-app", "my-job"));
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub enum LockKey {
    /// `pg_advisory_lock(integer, integer)`: the space named locks use.
    Pair(i32, i32),
    /// `pg_advisory_lock(bigint)`: for interoperability with programs that use it.
    Int(i64),
}

/// One advisory lock of a session as the server's lock table shows it: the key and
/// whether it is held exclusively (leases) or shared (stop fences, interest keys).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct SessionLock {
    pub(crate) key: LockKey,
    pub(crate) exclusive: bool,
}

/// How many interest buckets there are (see [`LockKey::interest`]). Do not change.
const INTEREST_BUCKETS: u32 = 256;

impl LockKey {
    /// Derives the key of lock `name` in `namespace` (see the type docs).
    #[must_use]
    pub fn derive(namespace: &str, name: &str) -> Self {
        // Do not change: the derivation is part of the on-database contract.
        let mut hasher = Sha256::new();
        hasher.update(namespace.as_bytes());
        hasher.update([0u8]);
        hasher.update(name.as_bytes());
        let digest = hasher.finalize();
        let key1 = i32::from_be_bytes([digest[0], digest[1], digest[2], digest[3]]);
        let key2 = i32::from_be_bytes([digest[4], digest[5], digest[6], digest[7]]);
        Self::Pair(key1, key2)
    }

    /// The `(classid, objid, objsubid)` columns of this lock's row in `pg_locks`.
    #[must_use]
    pub fn pg_locks_columns(self) -> (u32, u32, i16) {
        match self {
            // `as` reinterprets the bits, which is what the int4 -> oid cast does.
            Self::Pair(a, b) => (a as u32, b as u32, 2),
            Self::Int(k) => ((k >> 32) as u32, k as u32, 1),
        }
    }

    /// The *stop fence* of this key: a companion key that a node whose session ended
    /// while its work under this key was still running holds (on its new session) until
    /// that work has stopped. A node that takes this key over waits while it is held.
    /// Do not change: nodes of different versions must agree on it.
    pub(crate) fn stop_fence(self) -> Self {
        Self::derive("chosen.stop-fence", &self.tag())
    }

    /// The *interest* key of this key's bucket: a session that waits for a key another
    /// session holds holds its bucket's interest key in shared mode, and a release
    /// announces itself (`NOTIFY`) only when its bucket's interest key is held by
    /// another session. 256 buckets, so a session waiting for many keys holds at most
    /// 256 of them. Do not change: nodes of different versions must agree on it.
    pub(crate) fn interest(self) -> Self {
        Self::interest_of(self.interest_bucket())
    }

    /// The bucket of [`Self::interest`].
    pub(crate) fn interest_bucket(self) -> u16 {
        match Self::derive("chosen.interest-bucket", &self.tag()) {
            Self::Pair(a, _) => (a as u32 % INTEREST_BUCKETS) as u16,
            Self::Int(_) => unreachable!("BUG: derived keys are pairs"),
        }
    }

    /// The interest key of `bucket`.
    pub(crate) fn interest_of(bucket: u16) -> Self {
        static KEYS: std::sync::OnceLock<Vec<LockKey>> = std::sync::OnceLock::new();
        KEYS.get_or_init(|| {
            (0..INTEREST_BUCKETS)
                .map(|b| Self::derive("chosen.interest", &b.to_string()))
                .collect()
        })[usize::from(bucket) % INTEREST_BUCKETS as usize]
    }

    /// An entry of a release announcement's payload: the key's tag, followed by
    /// `>` and the target node's hash (16 hex digits) for a hand-over to one node.
    pub(crate) fn announcement(self, to: Option<u64>) -> String {
        match to {
            Some(node) => format!("{}>{node:016x}", self.tag()),
            None => self.tag(),
        }
    }

    /// Parses an entry of a release announcement's payload (see
    /// [`announcement`](Self::announcement)); `None` for anything else.
    pub(crate) fn from_announcement(entry: &str) -> Option<(Self, Option<u64>)> {
        match entry.split_once('>') {
            None => Some((Self::from_tag(entry)?, None)),
            Some((tag, node)) if node.len() == 16 => Some((
                Self::from_tag(tag)?,
                Some(u64::from_str_radix(node, 16).ok()?),
            )),
            Some(_) => None,
        }
    }

    /// The text used in `NOTIFY` payloads and logs: `pair:<key1>:<key2>` or `int:<key>`.
    pub(crate) fn tag(self) -> String {
        match self {
            Self::Pair(a, b) => format!("pair:{a}:{b}"),
            Self::Int(k) => format!("int:{k}"),
        }
    }

    pub(crate) fn from_tag(tag: &str) -> Option<Self> {
        let mut parts = tag.split(':');
        let key = match (parts.next()?, parts.next()?, parts.next()) {
            ("pair", a, Some(b)) => Self::Pair(a.parse().ok()?, b.parse().ok()?),
            ("int", k, None) => Self::Int(k.parse().ok()?),
            _ => return None,
        };
        parts.next().is_none().then_some(key)
    }
}

impl fmt::Display for LockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Pair(a, b) => write!(f, "({a}, {b})"),
            Self::Int(k) => write!(f, "({k})"),
        }
    }
}

/// A node id's hash, as hand-over announcements name their target: FNV-1a, the same on
/// every node and every version.
pub(crate) fn node_hash(node_id: &str) -> u64 {
    node_id.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Golden vectors of [`LockKey::derive`], computed independently (Python `hashlib`):
/// `(namespace, name, key1, key2)`. They freeze the derivation: never change them.
#[cfg(test)]
const GOLDEN_KEYS: [(&str, &str, i32, i32); 5] = [
    ("chosen", "my-job", -790_094_319, -645_757_411),
    ("chosen", "", 1_564_407_143, -1_276_471_026),
    ("chosen", "nightly-report", -786_972_525, 1_718_261_010),
    ("billing", "nightly-report", 1_907_377_311, 1_129_609_294),
    ("chosen", "ünïcødé ✓", -305_617_263, 1_629_876_428),
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_follow_the_golden_vectors() {
        for (ns, name, a, b) in GOLDEN_KEYS {
            assert_eq!(
                LockKey::derive(ns, name),
                LockKey::Pair(a, b),
                "{ns}/{name}"
            );
        }
    }

    #[test]
    fn tags_round_trip() {
        for key in [
            LockKey::Pair(i32::MIN, i32::MAX),
            LockKey::Pair(-1, 0),
            LockKey::Int(i64::MIN),
            LockKey::Int(42),
        ] {
            assert_eq!(LockKey::from_tag(&key.tag()), Some(key));
        }
        for bad in ["", "pair:1", "pair:1:2:3", "int:x", "int:1:2", "other:1:2"] {
            assert_eq!(LockKey::from_tag(bad), None, "{bad}");
        }
    }

    #[test]
    fn pg_locks_columns_match_postgres_encoding() {
        assert_eq!(LockKey::Pair(-1, 5).pg_locks_columns(), (u32::MAX, 5, 2));
        assert_eq!(
            LockKey::Int(0x0000_0001_ffff_fffe).pg_locks_columns(),
            (1, 0xffff_fffe, 1)
        );
    }

    #[test]
    fn announcements_round_trip_and_name_their_target() {
        let key = LockKey::Pair(-3, 7);
        assert_eq!(
            LockKey::from_announcement(&key.announcement(None)),
            Some((key, None))
        );
        let to = node_hash("node-b");
        assert_eq!(
            LockKey::from_announcement(&key.announcement(Some(to))),
            Some((key, Some(to)))
        );
        for bad in [
            "pair:1:2>",
            "pair:1:2>12",
            "pair:1:2>zzzzzzzzzzzzzzzz",
            ">0000000000000001",
        ] {
            assert_eq!(LockKey::from_announcement(bad), None, "{bad}");
        }
        // Stable across versions: a fleet mid-upgrade agrees on who is named.
        assert_eq!(node_hash(""), 0xcbf2_9ce4_8422_2325);
        assert_ne!(node_hash("node-a"), node_hash("node-b"));
    }
}
