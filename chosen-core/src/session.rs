//! The one dedicated connection: connect, session settings, prepared statements, and
//! how errors on it are classified. Only the manager's task uses a [`Session`].

use std::sync::Arc;
use std::time::Instant;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_postgres::error::SqlState;
use tokio_postgres::{AsyncMessage, Client, NoTls, Statement};
use tracing::{debug, warn};

use crate::engine::{Done, Term, TryFailed};
use crate::error::{Error, Result};
use crate::fault::{Fault, classify, error_text};
use crate::generation::Generation;
use crate::info::HolderInfo;
use crate::key::LockKey;
use crate::options::ManagerOptions;
use crate::status::SessionDownReason;
use crate::table::{Backend, FenceCheck, Plan, TryOutcome};
use crate::token::FencingToken;

/// The channel graceful releases are announced on (payload: up to 200 key tags, see
/// `LockKey::tag`, joined by commas).
/// Seen by operators and other versions: do not change.
pub(crate) const RELEASE_CHANNEL: &str = "chosen_release";

/// The oldest server supported: `idle_session_timeout` appeared in PostgreSQL 14.
const MIN_SERVER_VERSION: i32 = 140_000;

// Statement texts. They show up in pg_stat_statements and pg_stat_activity, so keep
// them stable.

/// The custom setting that marks a backend as ours. A fresh backend has none; a
/// transaction pooler that shares backends between clients shows another one's.
pub(crate) const MARKER_SETTING: &str = "chosen.session";

const PROBE_SQL: &str = "SELECT current_setting('server_version_num')::int4, pg_backend_pid(), pg_is_in_recovery(), coalesce(current_setting('chosen.session', true), ''), (SELECT count(*) FROM pg_lock_status() l WHERE l.locktype = 'advisory' AND l.pid = pg_backend_pid()), (SELECT oid FROM pg_database WHERE datname = current_database())::int8, coalesce(host(inet_server_addr()) || ':' || inet_server_port(), ''), current_setting('transaction_read_only')";

/// Proves the session: the same backend, writable, still marked as ours, and how many
/// advisory locks it holds (fewer than the manager holds means something released them
/// behind its back: a transaction pooler sharing the backend, `DISCARD ALL`,
/// `pg_advisory_unlock_all()`).
///
/// Writable means not in recovery *and* not read-only: a switchover that fences the old
/// primary with `default_transaction_read_only = on` and a reload before promoting its
/// standby is seen by the next heartbeat (a reload reaches every session, and the
/// setting is read at the start of each statement's transaction).
const HEARTBEAT_SQL: &str = "
SELECT pg_backend_pid(), pg_is_in_recovery(),
       coalesce(current_setting('chosen.session', true), ''),
       (SELECT count(*) FROM pg_lock_status() l
        WHERE l.locktype = 'advisory' AND l.pid = pg_backend_pid() AND l.granted),
       current_setting('transaction_read_only') = 'on'";

/// Tries every due key in one statement, on our own marked backend only (behind a
/// transaction pooler the guard makes it return no rows instead), and only while the
/// session is writable (a primary fenced read-only takes no lock and writes no token
/// record; the empty answer is then told apart, see [`Session::guard_failed`]).
///
/// * The locks are taken in the materialized CTE `k`, all of them before any fencing
///   token is assigned: the uncorrelated `done` sub-select (evaluated once, on first
///   use) reads every row of `k` first. A token assigned before a later key of the batch
///   was locked could be smaller than the token of another node's tenure of that key in
///   between.
/// * A transaction id (the token) is assigned only when a lock was won: failed polls burn
///   no transaction ids. Keys won in one statement share one token.
/// * For a key won, its stop fence (`$7`, `$8`) is *probed*: taken exclusively and
///   released again in one expression (`fence_clear`). It fails when another backend
///   holds the fence in any mode: an earlier holder whose session the server ended is
///   still stopping its work. A stopping holder takes its fence with a bounded wait
///   ([`FENCE_SQL`]), so meeting a probe only delays its take by the probe's instant.
///   Probing costs about what a try costs; reading the lock table costs a scan of the
///   server's whole lock hash table (50-70 µs on a small server, more on a big one).
/// * A key not won whose flag in `$9` is set registers interest in releases: it takes
///   its bucket's interest key (`$10`, `$11`, see `LockKey::interest`) in shared mode
///   and is tried once more (a release between the two tries found no interest and
///   announced nothing; if the take fails, a releaser is probing the bucket right now,
///   after its unlock, so the key is tried once more too). The last column says how
///   it went: 0 not won, 1 won at the first try, 2 not won and registered, 3 won after
///   registering, 4 won at the last try without registering. Releases announce
///   themselves only to buckets someone registered in (see [`UNLOCK_SQL`]). A key won
///   after a failed first try (3, 4) was held a moment before: a takeover.
/// * The lock table (`pg_lock_status()`, the function behind `pg_locks`, readable by
///   every role) is read only when needed: for a key not won (the backend pid of its
///   holder: release announcements are trusted only from that backend's session), or a
///   fence probe that failed (the backend pid of the fence's holder, 0 when it let go
///   meanwhile). Once, into a map of other backends' advisory locks, after every try of
///   the statement (the lateral reference to `done` orders it).
/// * A session is its pid and its start: pids are reused. For a key not won, the sixth
///   column is the start of its holder's backend (`backend_start` from
///   `pg_stat_get_activity(pid)`, in microseconds since the Unix epoch); for a key won
///   whose `$12` is set (the pid of the holder the last failed try saw, which announced
///   its release since), the seventh is the start of the backend that has that pid now,
///   read after the key was won: the announcement is trusted only if it is the start
///   the last try saw (see `LockTable::senders`). Both are NULL when the server hides
///   them (another role's session, without `pg_read_all_stats`) or no backend has the
///   pid. The holder's pid is computed once per row, in `h` (`OFFSET 0` keeps it from
///   being inlined into two columns). `pg_stat_get_activity(NULL)` lists every backend,
///   hence the `CASE`s; given a pid, it returns that backend's row only, from one copy
///   of the backend status table per transaction, taken at its first call (after every
///   try here).
const TRY_KEYS_SQL: &str = "
WITH t AS MATERIALIZED (
    SELECT k.i, k.a, k.b, k.big, k.fa, k.fb, k.ap,
           CASE WHEN (CASE WHEN k.big IS NULL THEN pg_try_advisory_lock(k.a, k.b)
                           ELSE pg_try_advisory_lock(k.big) END) THEN 1
                WHEN NOT k.reg THEN 0
                WHEN pg_try_advisory_lock_shared(k.ia, k.ib) THEN
                    CASE WHEN (CASE WHEN k.big IS NULL THEN pg_try_advisory_lock(k.a, k.b)
                                    ELSE pg_try_advisory_lock(k.big) END) THEN 3 ELSE 2 END
                WHEN (CASE WHEN k.big IS NULL THEN pg_try_advisory_lock(k.a, k.b)
                           ELSE pg_try_advisory_lock(k.big) END) THEN 4
                ELSE 0 END AS r
    FROM unnest($1::int4[], $2::int4[], $3::int8[], $7::int4[], $8::int4[],
                $9::bool[], $10::int4[], $11::int4[], $12::int4[])
         WITH ORDINALITY AS k(a, b, big, fa, fb, reg, ia, ib, ap, i)
    WHERE pg_backend_pid() = $4 AND current_setting('chosen.session', true) = $5
      AND current_setting('transaction_read_only') = 'off'
),
k AS (SELECT t.*, t.r IN (1, 3, 4) AS won FROM t),
done AS (SELECT count(*) AS n FROM t),
f AS MATERIALIZED (
    SELECT k.*, CASE WHEN k.won AND (SELECT n FROM done) > 0 THEN
               CASE WHEN pg_try_advisory_lock(k.fa, k.fb) THEN pg_advisory_unlock(k.fa, k.fb)
                    ELSE false END
           END AS fence_clear
    FROM k
),
holders AS (
    SELECT x.m FROM done d, LATERAL (
        SELECT jsonb_object_agg(
                   l.classid::text || ':' || l.objid::text || ':' || l.objsubid::text
                   || CASE WHEN l.mode = 'ExclusiveLock' THEN ':x' ELSE ':s' END,
                   l.pid) AS m
        FROM pg_lock_status() l
        WHERE d.n >= 0 AND l.locktype = 'advisory' AND l.granted AND l.pid IS NOT NULL
          AND l.pid <> pg_backend_pid() AND l.database = $6::int8::oid
    ) x
)
SELECT f.i,
       CASE WHEN f.won AND set_config('synchronous_commit', 'local', true) = 'local' AND pg_logical_emit_message(true, 'chosen.token', '') IS NOT NULL THEN pg_current_xact_id()::text::int8 END,
       h.pid,
       CASE WHEN f.won AND NOT f.fence_clear THEN coalesce(
           ((SELECT m FROM holders) ->> ((f.fa::int8 & 4294967295)::text || ':' || (f.fb::int8 & 4294967295)::text || ':2:s'))::int4,
           ((SELECT m FROM holders) ->> ((f.fa::int8 & 4294967295)::text || ':' || (f.fb::int8 & 4294967295)::text || ':2:x'))::int4,
           0
       ) END,
       f.r,
       CASE WHEN h.pid IS NOT NULL THEN (
           SELECT (extract(epoch FROM a.backend_start) * 1000000)::int8
           FROM pg_stat_get_activity(h.pid) a) END,
       CASE WHEN f.won AND f.ap IS NOT NULL THEN (
           SELECT (extract(epoch FROM a.backend_start) * 1000000)::int8
           FROM pg_stat_get_activity(f.ap) a) END
FROM f, LATERAL (
    SELECT CASE WHEN NOT f.won THEN ((SELECT m FROM holders) ->> (
               CASE WHEN f.big IS NULL THEN (f.a::int8 & 4294967295)::text || ':' || (f.b::int8 & 4294967295)::text || ':2:x'
                    ELSE ((f.big >> 32) & 4294967295)::text || ':' || (f.big & 4294967295)::text || ':1:x' END
           ))::int4 END AS pid
    OFFSET 0
) h";

/// The single-key form of [`TRY_KEYS_SQL`], for the common uncontended case (no arrays
/// to build or unnest). Same semantics, same guard, same columns but the first; the
/// fence is probed once the key is won, the lock table is read only when the key was not
/// won or the probe failed, and the backend status only when the key was not won
/// (its holder's start) or it was won with `$12` set (the announcer's start now).
pub(crate) const TRY_ONE_SQL: &str = "
WITH t AS MATERIALIZED (
    SELECT CASE WHEN (CASE WHEN $3::int8 IS NULL THEN pg_try_advisory_lock($1::int4, $2::int4)
                           ELSE pg_try_advisory_lock($3::int8) END) THEN 1
                WHEN NOT $9::bool THEN 0
                WHEN pg_try_advisory_lock_shared($10::int4, $11::int4) THEN
                    CASE WHEN (CASE WHEN $3::int8 IS NULL THEN pg_try_advisory_lock($1::int4, $2::int4)
                                    ELSE pg_try_advisory_lock($3::int8) END) THEN 3 ELSE 2 END
                WHEN (CASE WHEN $3::int8 IS NULL THEN pg_try_advisory_lock($1::int4, $2::int4)
                           ELSE pg_try_advisory_lock($3::int8) END) THEN 4
                ELSE 0 END AS r
    WHERE pg_backend_pid() = $4 AND current_setting('chosen.session', true) = $5
      AND current_setting('transaction_read_only') = 'off'
),
k AS (SELECT t.r, t.r IN (1, 3, 4) AS won FROM t),
f AS MATERIALIZED (
    SELECT k.r, k.won, CASE WHEN k.won THEN
               CASE WHEN pg_try_advisory_lock($7::int4, $8::int4)
                    THEN pg_advisory_unlock($7::int4, $8::int4) ELSE false END
           END AS fence_clear
    FROM k
)
SELECT CASE WHEN f.won AND set_config('synchronous_commit', 'local', true) = 'local' AND pg_logical_emit_message(true, 'chosen.token', '') IS NOT NULL THEN pg_current_xact_id()::text::int8 END,
       h.pid,
       CASE WHEN f.won AND NOT f.fence_clear THEN coalesce((
           SELECT l.pid FROM pg_lock_status() l
           WHERE l.locktype = 'advisory' AND l.granted AND l.pid IS NOT NULL
             AND l.pid <> pg_backend_pid()
             AND l.database = $6::int8::oid
             AND l.classid::int8 = $7::int4::int8 & 4294967295
             AND l.objid::int8 = $8::int4::int8 & 4294967295
             AND l.objsubid = 2
           LIMIT 1), 0) END,
       f.r,
       CASE WHEN h.pid IS NOT NULL THEN (
           SELECT (extract(epoch FROM a.backend_start) * 1000000)::int8
           FROM pg_stat_get_activity(h.pid) a) END,
       CASE WHEN f.won AND $12::int4 IS NOT NULL THEN (
           SELECT (extract(epoch FROM a.backend_start) * 1000000)::int8
           FROM pg_stat_get_activity($12::int4) a) END
FROM f, LATERAL (
    SELECT CASE WHEN NOT f.won THEN (
               SELECT l.pid FROM pg_lock_status() l
               WHERE l.locktype = 'advisory' AND l.granted AND l.pid IS NOT NULL
                 AND l.pid <> pg_backend_pid() AND l.mode = 'ExclusiveLock'
                 AND l.database = $6::int8::oid
                 AND l.classid::int8 = CASE WHEN $3::int8 IS NULL THEN $1::int4::int8 & 4294967295
                                            ELSE ($3::int8 >> 32) & 4294967295 END
                 AND l.objid::int8 = CASE WHEN $3::int8 IS NULL THEN $2::int4::int8 & 4294967295
                                          ELSE $3::int8 & 4294967295 END
                 AND l.objsubid = CASE WHEN $3::int8 IS NULL THEN 2 ELSE 1 END
               LIMIT 1) END AS pid
    OFFSET 0
) h";

/// Is anyone stopping work under these keys? Each stop fence (always a two-int4 key) is
/// probed as in [`TRY_KEYS_SQL`]: taken exclusively and released at once, never held
/// (a held probe would make the stopping holder's own take wait). Only for a fence
/// found held is the lock table read, for its holder's backend pid (0 when it let go
/// meanwhile). On our own marked backend only.
const CHECK_FENCES_SQL: &str = "
WITH f AS MATERIALIZED (
    SELECT k.i, k.a, k.b,
           CASE WHEN pg_try_advisory_lock(k.a, k.b) THEN pg_advisory_unlock(k.a, k.b)
                ELSE false END AS clear
    FROM unnest($1::int4[], $2::int4[]) WITH ORDINALITY AS k(a, b, i)
    WHERE pg_backend_pid() = $3 AND current_setting('chosen.session', true) = $4
),
holders AS (
    SELECT jsonb_object_agg(l.classid::text || ':' || l.objid::text, l.pid) AS m
    FROM pg_lock_status() l
    WHERE l.locktype = 'advisory' AND l.granted AND l.pid IS NOT NULL
      AND l.pid <> pg_backend_pid()
      AND l.objsubid = 2 AND l.database = $5::int8::oid
)
SELECT f.i,
       CASE WHEN NOT f.clear THEN coalesce(
           ((SELECT m FROM holders) ->> ((f.a::int8 & 4294967295)::text || ':' || (f.b::int8 & 4294967295)::text))::int4,
           0) END
FROM f";

/// How long a stopping holder's fence take waits for a probe to let go (a probe holds
/// the fence for an instant: microseconds; under two hot probe loops on 2 cores, at
/// most 15 ms). The wait holds up the session's other statements, the heartbeat among
/// them, so it stays far below any heartbeat's slack. Past it, the statement fails;
/// the fences it took are kept and the others tried again soon.
const FENCE_LOCK_TIMEOUT: &str = "50ms";

/// Takes stop fences, in *shared* mode: first every one without waiting (`t`, read
/// whole by the sub-select before any row is returned), then, for a fence held
/// exclusively at that instant (a probe), waiting at most `$5` (`lock_timeout`, for
/// this statement only): a probe must not make the take fail, or the probe's node could
/// grant the key while this one's work still runs. Shared, so that no other shared
/// holder can make it fail. On our own marked backend only.
const FENCE_SQL: &str = "
WITH me AS MATERIALIZED (
    SELECT set_config('lock_timeout', $5, true)
    WHERE pg_backend_pid() = $3 AND current_setting('chosen.session', true) = $4
),
t AS MATERIALIZED (
    SELECT k.i, k.a, k.b, pg_try_advisory_lock_shared(k.a, k.b) AS got
    FROM unnest($1::int4[], $2::int4[]) WITH ORDINALITY AS k(a, b, i), me
)
SELECT t.i, CASE WHEN t.got THEN true
                 ELSE pg_advisory_lock_shared(t.a, t.b)::text IS NOT NULL END
FROM t
WHERE (SELECT count(*) FROM t) >= 0";

/// Which of the stop fences `$1`, `$2` this backend holds (shared): after a failed fence
/// statement, the fences it took before it failed are kept, never undone (undoing them
/// would open a gap in which a node checking the key finds it clear). Reads the lock
/// table directly (no relation lock). On our own marked backend only.
const FENCES_HELD_SQL: &str = "
SELECT k.i, EXISTS (
    SELECT 1 FROM pg_lock_status() l
    WHERE l.locktype = 'advisory' AND l.pid = pg_backend_pid() AND l.granted
      AND l.mode = 'ShareLock' AND l.database = $3::int8::oid
      AND l.classid::int8 = k.a::int8 & 4294967295
      AND l.objid::int8 = k.b::int8 & 4294967295
      AND l.objsubid = 2)
FROM unnest($1::int4[], $2::int4[]) WITH ORDINALITY AS k(a, b, i)
WHERE pg_backend_pid() = $4 AND current_setting('chosen.session', true) = $5";

/// Releases, without announcing, the two-int4 keys of `$1`, `$2` this backend holds in
/// shared mode, once each: the interest keys of a failed try statement, interest keys
/// no longer needed. Reads the lock table directly (no relation lock).
/// Returns one row when the guard passed.
const UNLOCK_SHARED_SQL: &str = "
WITH me AS (
    SELECT 1 WHERE pg_backend_pid() = $4 AND current_setting('chosen.session', true) = $5
),
undone AS (
    SELECT pg_advisory_unlock_shared(k.a, k.b)
    FROM unnest($1::int4[], $2::int4[]) AS k(a, b), me
    WHERE EXISTS (
        SELECT 1 FROM pg_lock_status() l
        WHERE l.locktype = 'advisory' AND l.pid = pg_backend_pid() AND l.granted
          AND l.mode = 'ShareLock' AND l.database = $3::int8::oid
          AND l.classid::int8 = k.a::int8 & 4294967295
          AND l.objid::int8 = k.b::int8 & 4294967295
          AND l.objsubid = 2)
)
SELECT (SELECT count(*) FROM undone) FROM me";

/// Releases stop fences (shared) and announces their keys, on our own marked backend.
const UNFENCE_SQL: &str = "
WITH me AS (
    SELECT 1 WHERE pg_backend_pid() = $4 AND current_setting('chosen.session', true) = $5
),
u AS MATERIALIZED (
    SELECT k.i, pg_advisory_unlock_shared(k.a, k.b) AS ok
    FROM unnest($1::int4[], $2::int4[]) WITH ORDINALITY AS k(a, b, i), me
),
n AS (
    SELECT pg_notify('chosen_release', string_agg(t.tag, ',' ORDER BY t.j))
    FROM unnest($3::text[]) WITH ORDINALITY AS t(tag, j), me
    WHERE current_setting('transaction_read_only') = 'off'
    GROUP BY (t.j - 1) / 200
)
SELECT u.i, u.ok, (SELECT count(*) FROM n) FROM u";

/// Unlocks one key and, if another session registered interest in its bucket
/// (`$7`, `$8`; see [`TRY_KEYS_SQL`]), announces it; on our own marked backend only.
/// The interest key is probed after the unlock, the way fences are (taken exclusively
/// and released at once): it fails while another session holds it shared. No waiter,
/// no `NOTIFY`: it costs a commit record, a signal to every listening backend and a
/// message to each of their clients. Nor on a read-only session: a `NOTIFY` commits
/// even there, and a primary fenced read-only must not write WAL (a switchover may have
/// checked its last position); no waiter can win on it anyway.
pub(crate) const UNLOCK_ONE_SQL: &str = "
WITH u AS MATERIALIZED (
    SELECT CASE WHEN $3::int8 IS NULL THEN pg_advisory_unlock($1::int4, $2::int4)
                ELSE pg_advisory_unlock($3::int8) END AS ok
    WHERE pg_backend_pid() = $5 AND current_setting('chosen.session', true) = $6
)
SELECT u.ok,
       CASE WHEN pg_try_advisory_lock($7::int4, $8::int4)
            THEN NOT pg_advisory_unlock($7::int4, $8::int4)
            WHEN current_setting('transaction_read_only') = 'on' THEN false
            ELSE pg_notify('chosen_release', $4)::text IS NOT NULL END
FROM u";

/// How many release announcements one `NOTIFY` carries at most (the number in
/// `UNLOCK_SQL`'s `GROUP BY`; a test checks they agree): an entry is at most 46 bytes
/// with a hand-over's target, and a payload must stay under 8,000 bytes, or the
/// statement fails and the session with it.
#[cfg(test)]
pub(crate) const ANNOUNCEMENTS_PER_NOTIFY: usize = 150;

#[cfg(test)]
pub(crate) const UNLOCK_SQL_FOR_TESTS: &str = UNLOCK_SQL;

/// Unlocks many keys and announces the first of them (`$4`: their tags; `$7`, `$8`:
/// their interest keys) whose bucket another session registered interest in (probed
/// once per bucket, after every unlock), on our own marked backend only: one
/// notification per 150 keys (entries joined by commas, at most 46 bytes each with a
/// hand-over's target, under the 8,000-byte payload limit),
/// delivered at commit, after the unlocks. The server stamps each notification
/// with this backend's pid, which is how waiters tell a real release from a forged one.
const UNLOCK_SQL: &str = "
WITH me AS (
    SELECT 1 WHERE pg_backend_pid() = $5 AND current_setting('chosen.session', true) = $6
),
u AS MATERIALIZED (
    SELECT k.i, CASE WHEN k.big IS NULL THEN pg_advisory_unlock(k.a, k.b)
                     ELSE pg_advisory_unlock(k.big) END AS ok
    FROM unnest($1::int4[], $2::int4[], $3::int8[]) WITH ORDINALITY AS k(a, b, big, i), me
),
t AS MATERIALIZED (
    SELECT t.tag, t.ia, t.ib, t.j
    FROM unnest($4::text[], $7::int4[], $8::int4[]) WITH ORDINALITY AS t(tag, ia, ib, j), me
    WHERE (SELECT count(*) FROM u) >= 0
),
p AS MATERIALIZED (
    SELECT d.ia, d.ib,
           CASE WHEN pg_try_advisory_lock(d.ia, d.ib) THEN NOT pg_advisory_unlock(d.ia, d.ib)
                ELSE true END AS interested
    FROM (SELECT DISTINCT t.ia, t.ib FROM t) d
),
n AS (
    SELECT pg_notify('chosen_release', string_agg(t.tag, ',' ORDER BY t.j))
    FROM t JOIN p ON p.ia = t.ia AND p.ib = t.ib
    WHERE p.interested AND current_setting('transaction_read_only') = 'off'
    GROUP BY (t.j - 1) / 150
)
SELECT u.i, u.ok, (SELECT count(*) FROM n) FROM u";

/// After a failed try statement some of its locks (or a fence probe's) may have been
/// taken (session locks survive the statement's error): unlock those the lock table
/// shows we hold exclusively, on our own marked backend only. It reads `pg_lock_status()` directly, not the `pg_locks`
/// view, and gets the database oid as a parameter, so it needs no relation lock: it
/// runs when the lock table is full. Returns one row when the guard passed.
const CLEANUP_SQL: &str = "
WITH me AS (
    SELECT 1 WHERE pg_backend_pid() = $5 AND current_setting('chosen.session', true) = $6
),
undone AS (
    SELECT CASE WHEN k.big IS NULL THEN pg_advisory_unlock(k.a, k.b)
                ELSE pg_advisory_unlock(k.big) END
    FROM unnest($1::int4[], $2::int4[], $3::int8[]) AS k(a, b, big), me
    WHERE EXISTS (
        SELECT 1 FROM pg_lock_status() l
        WHERE l.locktype = 'advisory' AND l.pid = pg_backend_pid() AND l.granted
          AND l.mode = 'ExclusiveLock' AND l.database = $4::int8::oid
          AND l.classid::int8 = CASE WHEN k.big IS NULL THEN k.a::int8 & 4294967295
                                     ELSE (k.big >> 32) & 4294967295 END
          AND l.objid::int8 = CASE WHEN k.big IS NULL THEN k.b::int8 & 4294967295
                                   ELSE k.big & 4294967295 END
          AND l.objsubid = CASE WHEN k.big IS NULL THEN 2 ELSE 1 END)
)
SELECT (SELECT count(*) FROM undone) FROM me";

/// Who holds each of several keys: the node id is the holder session's
/// `application_name`. Every column of `pg_stat_activity` may be NULL (other roles'
/// sessions hide most of them), and a lock may have no session row at all.
const HOLDERS_SQL: &str = "
SELECT k.i, a.application_name, l.pid, host(a.client_addr), a.backend_start
FROM unnest($1::int8[], $2::int8[], $3::int2[]) WITH ORDINALITY AS k(classid, objid, objsubid, i)
JOIN pg_locks l
  ON l.locktype = 'advisory' AND l.granted AND l.pid IS NOT NULL
 AND l.database = $4::int8::oid
 AND l.classid::int8 = k.classid AND l.objid::int8 = k.objid AND l.objsubid = k.objsubid
LEFT JOIN pg_stat_activity a ON a.pid = l.pid";

/// Every advisory lock held in this database, with its holder session.
const CLUSTER_SQL: &str = "
SELECT l.classid::int8, l.objid::int8, l.objsubid::int4,
       a.application_name, l.pid, host(a.client_addr), a.backend_start
FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.granted AND l.pid IS NOT NULL
  AND l.database = $1::int8::oid
ORDER BY a.application_name, l.classid, l.objid";

/// A new fencing token for local hand-offs (the session keeps the locks), on our own
/// marked backend only.
///
/// Every statement that issues a token makes its transaction durable before the token
/// is returned, whatever the server's `synchronous_commit`: a transaction that only
/// takes a transaction id writes no WAL of its own, and PostgreSQL commits such a
/// transaction asynchronously *even with* `synchronous_commit = on`; a crash before
/// the WAL writer's next round then loses its commit record and the restarted server
/// hands the same id out again (verified on PostgreSQL 15: with either measure alone
/// the id was handed out again after `pg_ctl stop -m immediate`). So the statement
/// writes a transactional logical decoding message (prefix `chosen.token`, empty, any
/// role may; logical decoding consumers see it) and sets `synchronous_commit = local`
/// for its own transaction: the commit is flushed to the local WAL before the answer is
/// sent. Local, not `on`: with synchronous standbys configured and one of them down, a
/// commit waiting for it would hang the win (no `statement_timeout` covers that wait)
/// and every statement queued behind it, the heartbeat among them; across a failover,
/// the timeline in the token's high bits orders the new term's tokens after the old
/// ones. Only when a lock was won: failed tries write nothing.
///
/// The token is issued only while the session still holds every key handed off
/// (`$3`-`$5`, in `pg_lock_status()`, read directly so that no relation lock is
/// needed; `$6` the database): another client may have released them behind its back
/// (`pg_advisory_unlock_all()` on a shared backend), another node may hold them now,
/// and a fresh token would then order this process's stale tenure *after* that node's.
/// The second column counts the keys found; fewer than asked ends the session, as
/// the heartbeat's lock-count guard would with its next beat. The nested `CASE` makes
/// the order certain: no WAL record and no transaction id unless every key is held.
/// (It reads the whole lock table, once per step that hands keys off locally.)
const TOKEN_SQL: &str = "
WITH held AS (
    SELECT count(*) AS n FROM unnest($3::int4[], $4::int4[], $5::int8[]) AS k(a, b, big)
    WHERE EXISTS (
        SELECT 1 FROM pg_lock_status() l
        WHERE l.locktype = 'advisory' AND l.pid = pg_backend_pid() AND l.granted
          AND l.mode = 'ExclusiveLock' AND l.database = $6::int8::oid
          AND l.classid::int8 = CASE WHEN k.big IS NULL THEN k.a::int8 & 4294967295
                                     ELSE (k.big >> 32) & 4294967295 END
          AND l.objid::int8 = CASE WHEN k.big IS NULL THEN k.b::int8 & 4294967295
                                   ELSE k.big & 4294967295 END
          AND l.objsubid = CASE WHEN k.big IS NULL THEN 2 ELSE 1 END)
)
SELECT CASE WHEN held.n = cardinality($5::int8[]) THEN
           CASE WHEN set_config('synchronous_commit', 'local', true) = 'local'
                 AND pg_logical_emit_message(true, 'chosen.token', '') IS NOT NULL
                THEN pg_current_xact_id()::text::int8 END
       END,
       held.n
FROM held
WHERE pg_backend_pid() = $1 AND current_setting('chosen.session', true) = $2
  AND current_setting('transaction_read_only') = 'off'";

/// The server's current term as primary: which timeline it writes, and how long ago
/// the term began (its start, crash restart or promotion), computed with the server's
/// own clock, so the client's clock never matters. Run once per session, after the
/// probe found the server writable; every function in it may be run by any role.
///
/// * `timeline`: the first 8 hex digits of the current WAL file name.
/// * The age is measured from the latest of: the postmaster's start (a plain restart;
///   the old server's backends were all gone by then); the reset of the shared
///   statistics (PostgreSQL 15 discards them when it reinitializes after a crash,
///   which `pg_postmaster_start_time()` does not show; a DBA's reset only makes the
///   age shorter); the latest checkpoint, plus a second for its time's truncation to
///   seconds, when it was written on the current timeline and is the end of a recovery
///   (`redo_lsn = checkpoint_lsn`: shutdown-type), or the timeline is above 1 (the
///   server or an ancestor was promoted: every checkpoint on its timeline is later than
///   the promotion; `prev_timeline_id` does not tell, measured: it equals the timeline
///   right after a promotion) and the WAL writer's start is not visible; and the WAL
///   writer's start, which only roles allowed to read other sessions' statistics
///   (`pg_read_all_stats`) see: it starts when recovery ends, so it marks a promotion
///   or a crash restart to the millisecond.
/// * `NULL` age: the current timeline is newer than the latest checkpoint's, so the
///   server was promoted and its (spread) end-of-recovery checkpoint is not done yet:
///   the term's start is unknown, and the client takes its first sight of the term.
/// * `identity`: what tells one term from another in that case.
/// * The server's token epoch (`chosen.token_epoch`, e.g. set with `ALTER DATABASE`;
///   NULL or empty when unset).
/// * The next transaction id (`pg_snapshot_xmax`, which assigns none): every token this
///   session can issue is at least the token of that id.
/// * The cluster's system identifier: a physical standby keeps it; `pg_upgrade`, a
///   restore into a new `initdb` and a logical copy get a new one.
const TERM_SQL: &str = "
SELECT w.tl,
       CASE WHEN w.tl = c.timeline_id OR ww.started IS NOT NULL THEN
           greatest(0, extract(epoch FROM clock_timestamp() - greatest(
               pg_postmaster_start_time(),
               (SELECT stats_reset FROM pg_stat_bgwriter),
               CASE WHEN w.tl = c.timeline_id
                     AND (c.redo_lsn = c.checkpoint_lsn OR (w.tl > 1 AND ww.started IS NULL))
                    THEN c.checkpoint_time + interval '1 second' END,
               ww.started)) * 1000)::int8
       END,
       w.tl::text || '/' || pg_postmaster_start_time()::text || '/'
           || coalesce((SELECT stats_reset FROM pg_stat_bgwriter)::text, ''),
       current_setting('chosen.token_epoch', true),
       pg_snapshot_xmax(pg_current_snapshot())::text::int8,
       (SELECT system_identifier FROM pg_control_system())::text
FROM pg_control_checkpoint() c,
     (SELECT ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::int8 AS tl) w,
     (SELECT max(a.backend_start) AS started FROM pg_stat_activity a
      WHERE a.backend_type = 'walwriter') ww";

/// Every token-issuing statement writes a logical decoding message (see [`TOKEN_SQL`]):
/// a role without the right would fail every win with a bare permission error, so the
/// connect checks it.
/// The function's signature depends on the version: PostgreSQL 17 added a fourth
/// argument with a default (`flush`) and dropped the three-argument form, so the name
/// is resolved with `to_regprocedure` (NULL for a missing one: refused as well).
const EMIT_PRIVILEGE_SQL: &str = "SELECT has_function_privilege(coalesce(to_regprocedure('pg_catalog.pg_logical_emit_message(boolean, text, text, boolean)'), to_regprocedure('pg_catalog.pg_logical_emit_message(boolean, text, text)')), 'EXECUTE')";

/// Reads the server's current term (see [`TERM_SQL`]).
async fn read_term(client: &Client, epoch: u16) -> Result<Term> {
    // With it, in the same round trip: may this role write the token's WAL record?
    let messages = client
        .simple_query(&format!("{TERM_SQL}; {EMIT_PRIVILEGE_SQL}"))
        .await
        .map_err(Error::database)?;
    let read_at = Instant::now();
    let mut rows = messages.iter().filter_map(|m| match m {
        tokio_postgres::SimpleQueryMessage::Row(row) => Some(row),
        _ => None,
    });
    let (Some(row), Some(privilege)) = (rows.next(), rows.next()) else {
        return Err(Error::Protocol {
            message: "the server answered the term query with no row".to_owned(),
        });
    };
    let timeline: i64 = row.get(0).and_then(|t| t.parse().ok()).unwrap_or(0);
    // The larger of the option and the server's own setting: a DBA sets it on the new
    // cluster alone (`ALTER DATABASE ... SET chosen.token_epoch = N`) before it takes
    // connections, and every node picks it up as it reconnects.
    let server_epoch = match row.get(3).map(str::trim).filter(|e| !e.is_empty()) {
        None => 0,
        Some(text) => match text.parse::<u16>() {
            Ok(e) if e < (1 << 15) - 1 => e,
            _ => {
                return Err(Error::Refused(SessionDownReason::ConnectFailed {
                    message: format!(
                        "the server's chosen.token_epoch setting {text:?} is not a whole number from 0 to 32766; fix it (ALTER DATABASE ... SET chosen.token_epoch = N)"
                    ),
                }));
            }
        },
    };
    let epoch = epoch.max(server_epoch);
    if timeline == 0 {
        return Err(Error::Refused(SessionDownReason::ConnectFailed {
            message: "the server answered no timeline".to_owned(),
        }));
    }
    // 15 bits: a token stored in a signed 64-bit column (PostgreSQL's bigint) must stay
    // positive.
    let Some(timeline) = u16::try_from(timeline + i64::from(epoch))
        .ok()
        .filter(|t| *t < 1 << 15)
    else {
        return Err(Error::Refused(SessionDownReason::ConnectFailed {
            message: format!(
                "the server is on timeline {timeline}, with token_epoch {epoch}: fencing tokens carry the timeline plus the epoch in 15 bits (so that they stay positive as a signed 64-bit number), so their sum must stay below 32768"
            ),
        }));
    };
    if privilege.get(0) != Some("t") {
        return Err(Error::Refused(SessionDownReason::ConnectFailed {
            message: "this role may not execute pg_logical_emit_message, which makes fencing tokens durable: GRANT EXECUTE ON FUNCTION pg_catalog.pg_logical_emit_message(boolean, text, text, boolean) TO the role on PostgreSQL 17 and newer, (boolean, text, text) before 17 (PostgreSQL grants it to PUBLIC by default)".to_owned(),
        }));
    }
    let age = row
        .get(1)
        .and_then(|ms| ms.parse::<u64>().ok())
        .map(std::time::Duration::from_millis);
    let Some(next_xid) = row.get(4).and_then(|x| x.parse::<u64>().ok()) else {
        return Err(Error::Refused(SessionDownReason::ConnectFailed {
            message: "the server answered no next transaction id".to_owned(),
        }));
    };
    Ok(Term {
        timeline,
        age,
        identity: row.get(2).unwrap_or_default().to_owned(),
        first_token: FencingToken::from_parts(timeline, next_xid),
        system_id: row.get(5).unwrap_or_default().to_owned(),
        read_at,
    })
}

/// What the connection task reports.
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

pub(crate) struct Statements {
    pub(crate) heartbeat: Statement,
    try_keys: Statement,
    try_one: Statement,
    unlock: Statement,
    unlock_one: Statement,
    check_fences: Statement,
    fence: Statement,
    unfence: Statement,
    unlock_shared: Statement,
    fences_held: Statement,
    cleanup: Statement,
    token: Statement,
    holders: Statement,
    cluster: Statement,
}

pub(crate) struct Session {
    /// Shared with the heartbeat task; tokio-postgres pipelines their queries.
    pub(crate) client: Arc<Client>,
    pub(crate) stmts: Statements,
    pub(crate) backend_pid: i32,
    /// The value of `chosen.session` on our backend.
    pub(crate) marker: String,
    /// `oid` of the current database.
    pub(crate) database_oid: i64,
    /// The server's address and port as it sees this connection (`inet_server_addr()`,
    /// `inet_server_port()`), empty over a Unix socket: which host of a multi-host URL
    /// the session is on.
    pub(crate) server: String,
    pub(crate) generation: Arc<Generation>,
    pub(crate) events: mpsc::UnboundedReceiver<ConnEvent>,
    /// When the setup query that proved the session was sent.
    pub(crate) proven_at: Instant,
    /// The server's current term as primary.
    pub(crate) term: Term,
    conn_task: JoinHandle<()>,
}

impl Drop for Session {
    fn drop(&mut self) {
        // Dropping the connection closes the socket; the server then ends the backend
        // and releases its locks.
        self.conn_task.abort();
    }
}

/// What the heartbeat task needs of the session.
pub(crate) struct HeartbeatSession {
    client: Arc<Client>,
    statement: Statement,
    backend_pid: i32,
    marker: String,
}

impl HeartbeatSession {
    /// Proves the session is still ours and writable; answers how many advisory locks
    /// the server shows on it.
    pub(crate) async fn heartbeat(&self) -> Result<i64, SessionDownReason> {
        let lost = |message: String| SessionDownReason::ConnectionLost { message };
        let row = match self.client.query_one(&self.statement, &[]).await {
            Ok(row) => row,
            Err(e) => {
                return Err(match classify(e) {
                    Fault::Lost(reason) => reason,
                    Fault::Query(e) => lost(format!("heartbeat failed: {}", error_text(&e))),
                });
            }
        };
        let parsed = (|| {
            Ok::<_, tokio_postgres::Error>((
                row.try_get::<_, Option<i32>>(0)?,
                row.try_get::<_, Option<bool>>(1)?,
                row.try_get::<_, Option<String>>(2)?,
                row.try_get::<_, Option<i64>>(3)?,
                row.try_get::<_, Option<bool>>(4)?,
            ))
        })();
        let (Some(pid), Some(in_recovery), Some(marker), Some(locks), Some(read_only)) =
            parsed.map_err(|e| lost(format!("heartbeat answered an odd row: {e}")))?
        else {
            return Err(lost("heartbeat answered NULL".to_owned()));
        };
        if pid == self.backend_pid && marker != self.marker {
            return Err(SessionDownReason::PoolerDetected {
                detail: "another client changed this session's marker: the backend is shared"
                    .to_owned(),
            });
        }
        if pid != self.backend_pid {
            return Err(SessionDownReason::BackendChanged {
                expected: self.backend_pid,
                found: pid,
            });
        }
        if in_recovery {
            return Err(SessionDownReason::ServerInRecovery);
        }
        if read_only {
            return Err(SessionDownReason::ServerReadOnly);
        }
        Ok(locks)
    }
}

impl Session {
    /// A handle for the heartbeat task.
    pub(crate) fn heartbeat_handle(&self) -> HeartbeatSession {
        HeartbeatSession {
            client: Arc::clone(&self.client),
            statement: self.stmts.heartbeat.clone(),
            backend_pid: self.backend_pid,
            marker: self.marker.clone(),
        }
    }

    /// Tries every key in one statement; the keys of `register` that are not won
    /// register interest in their bucket (see [`TRY_KEYS_SQL`]). Answers the outcome
    /// per key and the keys whose bucket's interest key was taken. On a statement error
    /// (e.g. the server's lock table is full), the locks it took are undone first and
    /// the error is returned as [`Fault::Query`].
    pub(crate) async fn try_keys(
        &self,
        keys: &[LockKey],
        register: &[LockKey],
        verify: &[(LockKey, i32)],
    ) -> Result<Tried, Fault> {
        type Row = (
            i64,
            Option<i64>,
            Option<i32>,
            Option<i32>,
            Option<i32>,
            Option<i64>,
            Option<i64>,
        );
        let (fa, fb) = fence_arrays(keys);
        let reg: Vec<bool> = keys.iter().map(|k| register.contains(k)).collect();
        let (ia, ib) = interest_arrays(keys);
        // The announcer's pid per key, for the start of its backend once won.
        let ap: Vec<Option<i32>> = keys
            .iter()
            .map(|k| verify.iter().find(|(v, _)| v == k).map(|(_, pid)| *pid))
            .collect();
        let result = if let ([key], [fa], [fb], [reg], [ia], [ib], [ap]) = (
            keys,
            fa.as_slice(),
            fb.as_slice(),
            reg.as_slice(),
            ia.as_slice(),
            ib.as_slice(),
            ap.as_slice(),
        ) {
            let (a, b, big) = key_params(*key);
            self.client
                .query(
                    &self.stmts.try_one,
                    &[
                        &a,
                        &b,
                        &big,
                        &self.backend_pid,
                        &self.marker,
                        &self.database_oid,
                        fa,
                        fb,
                        reg,
                        ia,
                        ib,
                        ap,
                    ],
                )
                .await
                .and_then(|rows| {
                    rows.iter()
                        .map(|r| {
                            Ok((
                                1i64,
                                r.try_get(0)?,
                                r.try_get(1)?,
                                r.try_get(2)?,
                                r.try_get(3)?,
                                r.try_get(4)?,
                                r.try_get(5)?,
                            ))
                        })
                        .collect::<Result<Vec<Row>, _>>()
                })
        } else {
            let (a, b, big) = key_arrays(keys);
            self.client
                .query(
                    &self.stmts.try_keys,
                    &[
                        &a,
                        &b,
                        &big,
                        &self.backend_pid,
                        &self.marker,
                        &self.database_oid,
                        &fa,
                        &fb,
                        &reg,
                        &ia,
                        &ib,
                        &ap,
                    ],
                )
                .await
                .and_then(|rows| {
                    rows.iter()
                        .map(|r| {
                            Ok((
                                r.try_get(0)?,
                                r.try_get(1)?,
                                r.try_get(2)?,
                                r.try_get(3)?,
                                r.try_get(4)?,
                                r.try_get(5)?,
                                r.try_get(6)?,
                            ))
                        })
                        .collect::<Result<Vec<Row>, _>>()
                })
        };
        let rows = match result.map_err(classify) {
            Ok(rows) => rows,
            Err(Fault::Lost(reason)) => return Err(Fault::Lost(reason)),
            Err(Fault::Query(e)) => {
                // Session locks taken before the error survive it: undo them, and any
                // fence probe the error caught between its take and its release.
                let mut taken = keys.to_vec();
                taken.extend(keys.iter().map(|k| k.stop_fence()));
                self.cleanup(&taken).await?;
                // And the interest keys it may have taken (none of them was held).
                if !register.is_empty() {
                    let (ia, ib) = interest_arrays(register);
                    self.unlock_shared_held(&ia, &ib, "interest keys", true)
                        .await?;
                }
                return Err(Fault::Query(e));
            }
        };
        if rows.is_empty() {
            return Err(self
                .guard_failed("a try statement ran on another backend than the session's own")
                .await);
        }
        let mut out: Vec<(LockKey, TryOutcome)> = keys
            .iter()
            .map(|k| (*k, TryOutcome::Held { by: None }))
            .collect();
        let mut registered = Vec::new();
        let mut seen_held = Vec::new();
        let mut senders = Vec::new();
        for (i, token, holder, fence_holder, how, holder_start, sender_start) in rows {
            let Some(at) = usize::try_from(i.saturating_sub(1))
                .ok()
                .filter(|at| *at < out.len())
            else {
                continue;
            };
            let entry = &mut out[at];
            if matches!(how, Some(2 | 3)) {
                registered.push(entry.0);
            }
            if matches!(how, Some(3 | 4)) {
                seen_held.push(entry.0);
            }
            if token.is_some() && ap[at].is_some() {
                senders.push((entry.0, sender_start));
            }
            entry.1 = match (token, fence_holder) {
                (Some(t), Some(by)) => TryOutcome::WonFenced {
                    token: self.issue(t),
                    // 0: the fence was let go between the probe and the read.
                    by: (by != 0).then_some(by),
                },
                (Some(t), _) => TryOutcome::Won(self.issue(t)),
                (None, _) => TryOutcome::Held {
                    by: holder.map(|pid| Backend {
                        pid,
                        start: holder_start,
                    }),
                },
            };
        }
        Ok(Tried {
            outcomes: out,
            registered,
            seen_held,
            senders,
        })
    }

    /// Unlocks what a failed try statement may have locked.
    async fn cleanup(&self, keys: &[LockKey]) -> Result<(), Fault> {
        let (a, b, big) = key_arrays(keys);
        let rows = self
            .client
            .query(
                &self.stmts.cleanup,
                &[
                    &a,
                    &b,
                    &big,
                    &self.database_oid,
                    &self.backend_pid,
                    &self.marker,
                ],
            )
            .await;
        match rows.map_err(classify) {
            Ok(rows) if rows.is_empty() => Err(pooler(
                "the clean-up after a failed try ran on another backend than the session's own",
            )),
            Ok(_) => Ok(()),
            Err(Fault::Lost(reason)) => Err(Fault::Lost(reason)),
            Err(Fault::Query(e)) => Err(Fault::Lost(SessionDownReason::ConnectionLost {
                message: format!(
                    "could not undo a failed acquire ({}); dropping the session to release everything",
                    error_text(&e)
                ),
            })),
        }
    }

    /// Releases the stop fences of `keys` and announces the keys: the work this process
    /// ran under them, in an ended session, has stopped.
    pub(crate) async fn unfence(&self, keys: &[LockKey]) -> Result<(), Fault> {
        let (fa, fb) = fence_arrays(keys);
        let tags: Vec<String> = keys.iter().map(|k| k.tag()).collect();
        let rows = self
            .client
            .query(
                &self.stmts.unfence,
                &[&fa, &fb, &tags, &self.backend_pid, &self.marker],
            )
            .await
            .and_then(|rows| {
                rows.iter()
                    .map(|r| r.try_get::<_, Option<bool>>(1))
                    .collect::<Result<Vec<_>, _>>()
            });
        released(rows, keys.len(), "stop fences")
    }

    /// Unlocks `keys` and announces `tags`, in one statement.
    async fn unlock_announcing(&self, keys: &[LockKey], tags: Vec<String>) -> Result<(), Fault> {
        // The single-key form always announces: only for one key with its tag.
        let result = if let ([key], [tag]) = (keys, tags.as_slice()) {
            let (a, b, big) = key_params(*key);
            let LockKey::Pair(ia, ib) = key.interest() else {
                unreachable!("BUG: interest keys are two-int4 keys")
            };
            self.client
                .query(
                    &self.stmts.unlock_one,
                    &[&a, &b, &big, tag, &self.backend_pid, &self.marker, &ia, &ib],
                )
                .await
                .and_then(|rows| {
                    rows.iter()
                        .map(|r| r.try_get::<_, Option<bool>>(0))
                        .collect::<Result<Vec<_>, _>>()
                })
        } else {
            let (a, b, big) = key_arrays(keys);
            let (ia, ib) = interest_arrays(&keys[..tags.len().min(keys.len())]);
            self.client
                .query(
                    &self.stmts.unlock,
                    &[
                        &a,
                        &b,
                        &big,
                        &tags,
                        &self.backend_pid,
                        &self.marker,
                        &ia,
                        &ib,
                    ],
                )
                .await
                .and_then(|rows| {
                    rows.iter()
                        .map(|r| r.try_get::<_, Option<bool>>(1))
                        .collect::<Result<Vec<_>, _>>()
                })
        };
        released(result, keys.len(), "locks")
    }

    /// Takes the stop fences of `keys` (shared); `true` per fence now held. When the
    /// statement fails (a take waited too long, the lock table is full), the fences it
    /// took are kept, read back from the lock table: `false` only for the others, which
    /// are tried again soon.
    pub(crate) async fn fence(&self, keys: &[LockKey]) -> Result<Vec<(LockKey, bool)>, Fault> {
        let (fa, fb) = fence_arrays(keys);
        let rows = self
            .client
            .query(
                &self.stmts.fence,
                &[
                    &fa,
                    &fb,
                    &self.backend_pid,
                    &self.marker,
                    &FENCE_LOCK_TIMEOUT,
                ],
            )
            .await
            .and_then(|rows| {
                rows.iter()
                    .map(|r| Ok((r.try_get::<_, i64>(0)?, r.try_get::<_, Option<bool>>(1)?)))
                    .collect::<Result<Vec<_>, _>>()
            });
        let rows = match rows.map_err(classify) {
            Ok(rows) => rows,
            Err(Fault::Query(e)) => {
                warn!(
                    error = %error_text(&e),
                    "could not take every stop fence; keeping those taken, trying the others again"
                );
                self.client
                    .query(
                        &self.stmts.fences_held,
                        &[
                            &fa,
                            &fb,
                            &self.database_oid,
                            &self.backend_pid,
                            &self.marker,
                        ],
                    )
                    .await
                    .and_then(|rows| {
                        rows.iter()
                            .map(|r| {
                                Ok((r.try_get::<_, i64>(0)?, r.try_get::<_, Option<bool>>(1)?))
                            })
                            .collect::<Result<Vec<_>, _>>()
                    })
                    .map_err(|e| match classify(e) {
                        Fault::Lost(reason) => Fault::Lost(reason),
                        // Nothing is known: end the session rather than leak a fence.
                        Fault::Query(e) => Fault::Lost(SessionDownReason::ConnectionLost {
                            message: format!(
                                "could not tell which stop fences a failed statement took ({}); dropping the session to release everything",
                                error_text(&e)
                            ),
                        }),
                    })?
            }
            Err(lost) => return Err(lost),
        };
        if rows.is_empty() && !keys.is_empty() {
            return Err(pooler(
                "a fence statement ran on another backend than the session's own",
            ));
        }
        let mut out: Vec<(LockKey, bool)> = keys.iter().map(|k| (*k, false)).collect();
        for (i, taken) in rows {
            if let Some(entry) = usize::try_from(i.saturating_sub(1))
                .ok()
                .and_then(|i| out.get_mut(i))
            {
                entry.1 = taken == Some(true);
            }
        }
        Ok(out)
    }

    /// Releases, without announcing, the shared two-int4 keys (`a`, `b`) this backend
    /// holds, once each: the interest keys a failed try statement took, interest keys no
    /// longer needed (`what` names them in errors). A statement error ends the session
    /// when `fatal` (nothing is known), else it is returned as [`Fault::Query`].
    async fn unlock_shared_held(
        &self,
        fa: &[i32],
        fb: &[i32],
        what: &str,
        fatal: bool,
    ) -> Result<(), Fault> {
        let rows = self
            .client
            .query(
                &self.stmts.unlock_shared,
                &[
                    &fa,
                    &fb,
                    &self.database_oid,
                    &self.backend_pid,
                    &self.marker,
                ],
            )
            .await;
        match rows.map_err(classify) {
            Ok(rows) if rows.is_empty() => Err(pooler(&format!(
                "the release of {what} ran on another backend than the session's own"
            ))),
            Ok(_) => Ok(()),
            Err(Fault::Lost(reason)) => Err(Fault::Lost(reason)),
            Err(Fault::Query(e)) if !fatal => Err(Fault::Query(e)),
            // Nothing is known: end the session rather than leak what it took.
            Err(Fault::Query(e)) => Err(Fault::Lost(SessionDownReason::ConnectionLost {
                message: format!(
                    "could not release {what} ({}); dropping the session to release everything",
                    error_text(&e)
                ),
            })),
        }
    }

    /// Checks the stop fences of `keys`.
    pub(crate) async fn check_fences(
        &self,
        keys: &[LockKey],
    ) -> Result<Vec<(LockKey, FenceCheck)>, Fault> {
        let (a, b) = fence_arrays(keys);
        let rows = self
            .client
            .query(
                &self.stmts.check_fences,
                &[&a, &b, &self.backend_pid, &self.marker, &self.database_oid],
            )
            .await
            .map_err(classify)?;
        if rows.is_empty() && !keys.is_empty() {
            return Err(pooler(
                "a fence check ran on another backend than the session's own",
            ));
        }
        let mut out: Vec<(LockKey, FenceCheck)> =
            keys.iter().map(|k| (*k, FenceCheck::Failed)).collect();
        for row in &rows {
            let parsed = (|| {
                Ok::<_, tokio_postgres::Error>((
                    row.try_get::<_, i64>(0)?,
                    row.try_get::<_, Option<i32>>(1)?,
                ))
            })();
            let Ok((i, holder)) = parsed else {
                continue;
            };
            let Some(entry) = usize::try_from(i.saturating_sub(1))
                .ok()
                .and_then(|i| out.get_mut(i))
            else {
                continue;
            };
            entry.1 = match holder {
                None => FenceCheck::Clear,
                Some(0) => FenceCheck::Held { by: None },
                Some(by) => FenceCheck::Held { by: Some(by) },
            };
        }
        Ok(out)
    }

    /// Leaves the backend as a new one would be (best effort, at shutdown): behind a
    /// pooler that shares it, our settings would otherwise apply to other clients.
    pub(crate) async fn reset(&self) -> Result<(), Fault> {
        self.client
            .batch_execute("RESET ALL; UNLISTEN *;")
            .await
            .map_err(classify)
    }

    /// The token of transaction id `xid` on this session (the engine keeps the floor
    /// of the tokens issued).
    fn issue(&self, xid: i64) -> FencingToken {
        FencingToken::from_parts(self.term.timeline, xid as u64)
    }

    /// Why a guarded statement answered nothing: the session turned read-only (a
    /// primary fenced with `default_transaction_read_only` and a reload), or the
    /// statement ran on another backend (a pooler), as `detail` says.
    async fn guard_failed(&self, detail: &str) -> Fault {
        match self
            .client
            .query_one(
                "SELECT current_setting('transaction_read_only') = 'on' AND pg_backend_pid() = $1",
                &[&self.backend_pid],
            )
            .await
        {
            Ok(row) if row.try_get::<_, bool>(0).unwrap_or(false) => {
                Fault::Lost(SessionDownReason::ServerReadOnly)
            }
            Ok(_) => pooler(detail),
            // The session already failed its guard: whatever the diagnosis ran into,
            // it is not trusted any more.
            Err(e) => match classify(e) {
                Fault::Lost(reason) => Fault::Lost(reason),
                Fault::Query(e) => Fault::Lost(SessionDownReason::ConnectionLost {
                    message: format!(
                        "{detail}, or the session is read-only; asking which failed: {}",
                        error_text(&e)
                    ),
                }),
            },
        }
    }

    /// A fresh fencing token (for local hand-offs).
    pub(crate) async fn fresh_token(&self, keys: &[LockKey]) -> Result<FencingToken, Fault> {
        let (a, b, big) = key_arrays(keys);
        let row = self
            .client
            .query_opt(
                &self.stmts.token,
                &[
                    &self.backend_pid,
                    &self.marker,
                    &a,
                    &b,
                    &big,
                    &self.database_oid,
                ],
            )
            .await
            .map_err(classify)?;
        let Some(row) = row else {
            return Err(self
                .guard_failed("a token statement ran on another backend than the session's own")
                .await);
        };
        let held = match row.try_get::<_, i64>(1) {
            Ok(held) => held,
            Err(e) => return Err(Fault::Query(e)),
        };
        if usize::try_from(held).ok() != Some(keys.len()) {
            return Err(Fault::Lost(SessionDownReason::PoolerDetected {
                detail: format!(
                    "the session holds {held} of the {} locks it hands off: another client released them (a transaction pooler sharing the backend, DISCARD ALL, pg_advisory_unlock_all)",
                    keys.len()
                ),
            }));
        }
        match row.try_get::<_, Option<i64>>(0) {
            Ok(Some(t)) => Ok(self.issue(t)),
            Ok(None) => Err(Fault::Lost(SessionDownReason::ConnectionLost {
                message: "the server answered a NULL transaction id".to_owned(),
            })),
            Err(e) => Err(Fault::Query(e)),
        }
    }

    /// Who holds each key, in one statement. A row the server answers oddly is an error
    /// for that key only.
    pub(crate) async fn holders(&self, keys: &[LockKey]) -> Result<Vec<HolderAnswer>, Fault> {
        let mut classids = Vec::with_capacity(keys.len());
        let mut objids = Vec::with_capacity(keys.len());
        let mut subids = Vec::with_capacity(keys.len());
        for key in keys {
            let (c, o, s) = key.pg_locks_columns();
            classids.push(i64::from(c));
            objids.push(i64::from(o));
            subids.push(s);
        }
        let rows = self
            .client
            .query(
                &self.stmts.holders,
                &[&classids, &objids, &subids, &self.database_oid],
            )
            .await
            .map_err(classify)?;
        let mut out: Vec<HolderAnswer> = keys.iter().map(|_| Ok(None)).collect();
        for row in &rows {
            let Some(i) = row
                .try_get::<_, i64>(0)
                .ok()
                .and_then(|i| usize::try_from(i.saturating_sub(1)).ok())
            else {
                continue;
            };
            let Some(entry) = out.get_mut(i) else {
                continue;
            };
            if matches!(entry, Ok(Some(_))) {
                continue; // a shared lock has several holders: the first one answers
            }
            *entry = holder_info(row, 1).map(Some).map_err(Arc::new);
        }
        Ok(out)
    }

    /// Every advisory lock held in this database, with its holder.
    pub(crate) async fn cluster(&self) -> Result<Vec<(LockKey, HolderInfo)>, Fault> {
        let rows = self
            .client
            .query(&self.stmts.cluster, &[&self.database_oid])
            .await
            .map_err(classify)?;
        let mut out = Vec::with_capacity(rows.len());
        for row in &rows {
            let classid: i64 = row.try_get(0).map_err(Fault::Query)?;
            let objid: i64 = row.try_get(1).map_err(Fault::Query)?;
            let key = match row.try_get::<_, i32>(2).map_err(Fault::Query)? {
                2 => LockKey::Pair(classid as u32 as i32, objid as u32 as i32),
                1 => LockKey::Int((classid << 32) | objid),
                _ => continue,
            };
            out.push((key, holder_info(row, 3).map_err(Fault::Query)?));
        }
        Ok(out)
    }
}

/// What a try statement answered.
pub(crate) struct Tried {
    pub(crate) outcomes: Vec<(LockKey, TryOutcome)>,
    /// Keys whose bucket's interest key the statement took.
    pub(crate) registered: Vec<LockKey>,
    /// Keys won after the statement's first try of them found them held.
    pub(crate) seen_held: Vec<LockKey>,
    /// Keys of [`Plan::verify`] won, with the start of the announcer pid's backend now.
    pub(crate) senders: Vec<(LockKey, Option<i64>)>,
}

impl Session {
    /// Runs a plan's statements, issued together: tokio-postgres pipelines them on the
    /// one connection, so a step costs one round trip. A failure that ends the session
    /// is an `Err`; a statement that failed with the session intact is in [`Done`],
    /// and a failed try statement's error is returned beside it (the requests that
    /// asked once are answered with it).
    pub(crate) async fn perform(
        &self,
        plan: &Plan,
    ) -> Result<(Done, Option<tokio_postgres::Error>), Fault> {
        let unlocking = async {
            if plan.unlock.is_empty() && plan.unlock_quiet.is_empty() {
                return Ok(());
            }
            // One statement: every key unlocked, only the first ones announced (each
            // for one node when handed over to it).
            let keys: Vec<LockKey> = plan
                .unlock
                .iter()
                .chain(&plan.unlock_quiet)
                .copied()
                .collect();
            let targets: std::collections::HashMap<LockKey, u64> =
                plan.hand_to.iter().copied().collect();
            let tags = plan
                .unlock
                .iter()
                .map(|k| k.announcement(targets.get(k).copied()))
                .collect();
            self.unlock_announcing(&keys, tags).await
        };
        let unfencing = async {
            if plan.unfence.is_empty() {
                Ok(())
            } else {
                self.unfence(&plan.unfence).await
            }
        };
        let token = async {
            if plan.token_for.is_empty() {
                return Ok(None);
            }
            match self.fresh_token(&plan.token_for).await {
                Ok(t) => Ok(Some(t)),
                Err(Fault::Query(e)) => {
                    warn!(error = %error_text(&e), "could not get a fencing token for a local hand-off; releasing instead");
                    Ok(None)
                }
                Err(lost) => Err(lost),
            }
        };
        let trying = async {
            if plan.try_keys.is_empty() {
                return Ok(((Ok(Vec::new()), None), Vec::new(), Vec::new(), Vec::new()));
            }
            match self
                .try_keys(&plan.try_keys, &plan.register, &plan.verify)
                .await
            {
                Ok(t) => Ok(((Ok(t.outcomes), None), t.registered, t.seen_held, t.senders)),
                Err(Fault::Query(error)) => {
                    let full = error.code() == Some(&SqlState::OUT_OF_MEMORY);
                    let keys = plan.try_keys.len();
                    if full {
                        warn!(keys, error = %error_text(&error), "the server's lock table is full (SQLSTATE 53200); locks not acquired, will retry. Raise max_locks_per_transaction or hold fewer locks");
                    } else {
                        warn!(keys, error = %error_text(&error), "acquire statement failed; will retry");
                    }
                    let (failed, error) = if full {
                        (TryFailed::LockTableFull, None)
                    } else {
                        (TryFailed::Failed, Some(error))
                    };
                    Ok(((Err(failed), error), Vec::new(), Vec::new(), Vec::new()))
                }
                Err(lost) => Err(lost),
            }
        };
        let fencing = async {
            if plan.fence.is_empty() {
                Ok(Vec::new())
            } else {
                self.fence(&plan.fence).await
            }
        };
        let checking = async {
            if plan.check.is_empty() {
                return Ok(Vec::new());
            }
            match self.check_fences(&plan.check).await {
                Err(Fault::Query(e)) => {
                    warn!(error = %error_text(&e), "could not check stop fences; will retry");
                    Ok(plan
                        .check
                        .iter()
                        .map(|k| (*k, FenceCheck::Failed))
                        .collect())
                }
                other => other,
            }
        };
        let unregistering = async {
            if plan.unregister.is_empty() {
                return Ok(());
            }
            let (ia, ib) = pair_arrays(plan.unregister.iter().map(|b| LockKey::interest_of(*b)));
            match self
                .unlock_shared_held(&ia, &ib, "interest keys", false)
                .await
            {
                // A leaked interest key costs other sessions a NOTIFY now and then.
                Err(Fault::Query(e)) => {
                    warn!(error = %error_text(&e), "could not release interest keys");
                    Ok(())
                }
                other => other,
            }
        };
        let ((unlocked, unfenced, token, unregistered), (tried, fenced, checked)) = tokio::join!(
            async { tokio::join!(unlocking, unfencing, token, unregistering) },
            async { tokio::join!(trying, fencing, checking) },
        );
        unlocked?;
        unfenced?;
        unregistered?;
        let ((tried, try_error), registered, seen_held, senders) = tried?;
        let done = Done {
            token: token?,
            tried,
            registered,
            seen_held,
            senders,
            fenced: fenced?,
            checked: checked?,
        };
        Ok((done, try_error))
    }
}

/// Judges an unlocking statement: we only unlock what the session holds, once each, so
/// anything but one `true` per key means the statement ran on a backend that is not
/// ours; any failure ends the session, which releases everything.
fn released(
    result: Result<Vec<Option<bool>>, tokio_postgres::Error>,
    expected: usize,
    what: &str,
) -> Result<(), Fault> {
    match result.map_err(classify) {
        Ok(done) if done.len() == expected && done.iter().all(|ok| *ok == Some(true)) => Ok(()),
        Ok(_) => Err(pooler(&format!(
            "the server says this session did not hold {what} it held"
        ))),
        Err(Fault::Lost(reason)) => Err(Fault::Lost(reason)),
        Err(Fault::Query(e)) => Err(Fault::Lost(SessionDownReason::ConnectionLost {
            message: format!(
                "could not release {what} ({}); dropping the session to release them",
                error_text(&e)
            ),
        })),
    }
}

/// One key's answer from [`Session::holders`].
pub(crate) type HolderAnswer = Result<Option<HolderInfo>, Arc<tokio_postgres::Error>>;

/// Reads `application_name, pid, host(client_addr), backend_start` from `row` starting at
/// column `at`; every column may be NULL.
fn holder_info(row: &tokio_postgres::Row, at: usize) -> Result<HolderInfo, tokio_postgres::Error> {
    Ok(HolderInfo {
        node_id: row.try_get::<_, Option<String>>(at)?.unwrap_or_default(),
        backend_pid: row.try_get::<_, Option<i32>>(at + 1)?.unwrap_or(0),
        client_addr: row.try_get(at + 2)?,
        session_start: row.try_get(at + 3)?,
    })
}

fn pooler(detail: &str) -> Fault {
    Fault::Lost(SessionDownReason::PoolerDetected {
        detail: detail.to_owned(),
    })
}

/// The scalar parameters of the single-key statements.
fn key_params(key: LockKey) -> (Option<i32>, Option<i32>, Option<i64>) {
    match key {
        LockKey::Pair(a, b) => (Some(a), Some(b), None),
        LockKey::Int(k) => (None, None, Some(k)),
    }
}

/// The stop fences of `keys`, as the two arrays of their two-int4 keys.
fn fence_arrays(keys: &[LockKey]) -> (Vec<i32>, Vec<i32>) {
    pair_arrays(keys.iter().map(|k| k.stop_fence()))
}

/// The interest keys of `keys`' buckets, as the two arrays of their two-int4 keys.
fn interest_arrays(keys: &[LockKey]) -> (Vec<i32>, Vec<i32>) {
    pair_arrays(keys.iter().map(|k| k.interest()))
}

/// Derived keys (stop fences, interest keys: always two-int4 keys) as two arrays.
fn pair_arrays(keys: impl Iterator<Item = LockKey>) -> (Vec<i32>, Vec<i32>) {
    keys.map(|k| match k {
        LockKey::Pair(a, b) => (a, b),
        LockKey::Int(_) => unreachable!("BUG: derived keys are two-int4 keys"),
    })
    .unzip()
}

/// The three parallel arrays the batched statements `unnest`.
type KeyArrays = (Vec<Option<i32>>, Vec<Option<i32>>, Vec<Option<i64>>);

fn key_arrays(keys: &[LockKey]) -> KeyArrays {
    let mut a = Vec::with_capacity(keys.len());
    let mut b = Vec::with_capacity(keys.len());
    let mut big = Vec::with_capacity(keys.len());
    for key in keys {
        match *key {
            LockKey::Pair(x, y) => {
                a.push(Some(x));
                b.push(Some(y));
                big.push(None);
            }
            LockKey::Int(k) => {
                a.push(None);
                b.push(None);
                big.push(Some(k));
            }
        }
    }
    (a, b, big)
}

/// The server's `tcp_user_timeout`: how long the server keeps a connection whose sent
/// data stays unacknowledged. Linux counts it from the first send of the oldest
/// unacknowledged byte, not from the last query: with heartbeats pipelined, replies
/// stuck behind a lost byte can renew validity up to a lease timeout after that clock
/// started, so it must be at least `server_release_after + lease_timeout` (a
/// one-way loss then keeps the session, and its locks, that much longer; an idle
/// silent session is still ended by `idle_session_timeout` at `server_release_after`).
pub(crate) fn tcp_user_timeout(options: &ManagerOptions) -> std::time::Duration {
    options.server_release_after + options.lease_timeout
}

/// The settings that make the server end a silent session in bounded time, and keep a
/// DBA's defaults from breaking the contract.
fn setup_sql(options: &ManagerOptions) -> String {
    let release_ms = options.server_release_after.as_millis();
    let user_timeout_ms = tcp_user_timeout(options).as_millis();
    // Keepalives and tcp_user_timeout are a second line for a real partition; they must
    // never release *earlier* than server_release_after, so they start at that point.
    let keepalive_idle_s = options.server_release_after.as_secs().max(1);
    let statement_ms = options.lease_timeout.as_millis();
    // Our statements are few and always the same: plan them once (a custom plan per
    // execution of the try statement cost more than the statement itself).
    format!(
        "SET statement_timeout = {statement_ms}; \
         {TRANSACTION_TIMEOUT_OFF_SESSION} \
         SET plan_cache_mode = force_generic_plan; \
         SET lock_timeout = 0; \
         SET idle_in_transaction_session_timeout = 0; \
         SET idle_session_timeout = {release_ms}; \
         SET tcp_keepalives_idle = {keepalive_idle_s}; \
         SET tcp_keepalives_interval = 1; \
         SET tcp_keepalives_count = 3; \
         SET tcp_user_timeout = {user_timeout_ms}; \
         SET client_connection_check_interval = 1000; \
         LISTEN {RELEASE_CHANNEL};"
    )
}

/// PostgreSQL 17's `transaction_timeout` ends the *session* (FATAL 25P04) when a
/// transaction, or outside one a statement, runs longer: a DBA's short default for the
/// role or database would end the lock session whenever a statement of ours ran long.
/// Turned off as the other DBA timeouts are, only where the setting exists (`SET` of an
/// unknown setting is an error on older servers), right after `statement_timeout` and
/// in constant time (the timer runs from the start of the message, so a short one may
/// already be close). The `CASE` orders the evaluation, so `set_config` runs only where
/// the setting exists; no row is returned (the probe reads the first row of its message
/// as its own). Setting it inside a transaction stops that transaction's timer too. If
/// it fires before (25P04), the session is lost and `connect` tries once more.
const TRANSACTION_TIMEOUT_OFF_LOCAL: &str = "SELECT 1 WHERE CASE WHEN current_setting('transaction_timeout', true) IS NULL THEN false ELSE set_config('transaction_timeout', '0', true) IS NULL END;";

/// [`TRANSACTION_TIMEOUT_OFF_LOCAL`] for the whole session.
const TRANSACTION_TIMEOUT_OFF_SESSION: &str = "SELECT 1 WHERE CASE WHEN current_setting('transaction_timeout', true) IS NULL THEN false ELSE set_config('transaction_timeout', '0', false) IS NULL END;";

/// Opens and proves a new session.
pub(crate) async fn connect(options: &ManagerOptions, generation: u64) -> Result<Session> {
    let timeout = options.connect_timeout * (options.pg.get_hosts().len().max(1) as u32 + 1);
    let attempt = async {
        // A DBA's statement_timeout (e.g. a role default of a millisecond) applies to
        // every statement of a new session until our own `SET statement_timeout` has
        // run (the server starts the timer anew for each statement of a message), and
        // a short idle_session_timeout to the pause between our first two round trips:
        // under load, even a `BEGIN` can overrun the one, a descheduled client the
        // other. Another connection very likely gets through; nothing of a failed one
        // is kept (it holds no lock, and its socket is closed). At most three, within
        // the connect timeout.
        let mut tries = 1;
        loop {
            match connect_inner(options, generation).await {
                Err(e) if tries < 3 && cut_short_by_dba_settings(&e) => {
                    warn!(error = %e, "the new lock session was cut short, likely by a very short statement_timeout or idle_session_timeout set for the role or database; connecting again (consider ALTER ROLE ... RESET for this role)");
                    tries += 1;
                    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                }
                other => break other,
            }
        }
    };
    match tokio::time::timeout(timeout, attempt).await {
        Ok(result) => result,
        Err(_) => Err(Error::ConnectTimeout {
            target: options.target_description(),
            after: timeout,
        }),
    }
}

/// A new session's statement cancelled (57014), or the session lost while it was
/// being proven (e.g. ended by `idle_session_timeout`, 57P05, whose notice may arrive
/// as a plain close, or by `transaction_timeout`, 25P04): worth another connection at
/// once. A server that refuses
/// connections is not this (`Error::Connect`).
fn cut_short_by_dba_settings(error: &Error) -> bool {
    match error {
        Error::Database(e) => e.code() == Some(&SqlState::QUERY_CANCELED),
        Error::NotConnected(SessionDownReason::ConnectionLost { .. }) => true,
        _ => false,
    }
}

async fn connect_inner(options: &ManagerOptions, generation: u64) -> Result<Session> {
    let config = options.session_config();
    let connect_error = |source: tokio_postgres::Error| {
        let auth = matches!(
            source.code(),
            Some(c) if *c == SqlState::INVALID_PASSWORD
                || *c == SqlState::INVALID_AUTHORIZATION_SPECIFICATION
        );
        if auth {
            Error::Authentication {
                user: options.pg.get_user().unwrap_or_default().to_owned(),
                target: options.target_description(),
                source,
            }
        } else {
            Error::Connect {
                target: options.target_description(),
                source,
            }
        }
    };
    #[cfg(feature = "rustls")]
    if let Some(tls) = &options.tls {
        let tls = tokio_postgres_rustls::MakeRustlsConnect::new(rustls::ClientConfig::clone(tls));
        let (client, connection) = config.connect(tls).await.map_err(connect_error)?;
        return prove(options, generation, client, connection).await;
    }
    let (client, connection) = config.connect(NoTls).await.map_err(connect_error)?;
    prove(options, generation, client, connection).await
}

/// Drives the connection on its own task and proves the session is one we may hold
/// locks on.
async fn prove<S, T>(
    options: &ManagerOptions,
    generation: u64,
    client: Client,
    mut connection: tokio_postgres::Connection<S, T>,
) -> Result<Session>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (events_tx, events) = mpsc::unbounded_channel();
    let conn_task = tokio::spawn(async move {
        let end = loop {
            match std::future::poll_fn(|cx| connection.poll_message(cx)).await {
                Some(Ok(AsyncMessage::Notification(n))) => {
                    let _ = events_tx.send(ConnEvent::Notification {
                        sender: n.process_id(),
                        payload: n.payload().to_owned(),
                        at: Instant::now(),
                    });
                }
                Some(Ok(AsyncMessage::Notice(notice))) => {
                    debug!(message = notice.message(), "notice on the lock session");
                }
                Some(Ok(_)) => {}
                Some(Err(e)) => break error_text(&e),
                None => break "the server closed the connection".to_owned(),
            }
        };
        let _ = events_tx.send(ConnEvent::Closed(end));
    });
    // From here on, dropping `guard` (on any error) closes the connection.
    let guard = AbortOnDrop(Some(conn_task));
    // A DBA's statement_timeout could cancel even the probe: override it in the same
    // round trip, as early as a `SET LOCAL` can be (it still covers the `BEGIN` and the
    // `SET` itself; `connect` tries once more if one of them is cancelled; these
    // settings exist on every server version). Only for this
    // transaction: a backend that turns out not to be ours alone (a pooler's) keeps
    // nothing of ours.
    let messages = client
        .simple_query(&format!(
            "BEGIN; SET LOCAL statement_timeout = {}; {TRANSACTION_TIMEOUT_OFF_LOCAL} SET LOCAL lock_timeout = 0; SET LOCAL idle_in_transaction_session_timeout = 0; {PROBE_SQL}; COMMIT;",
            options.lease_timeout.as_millis()
        ))
        .await
        .map_err(Error::database)?;
    let row = messages
        .iter()
        .find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(row) => Some(row),
            _ => None,
        })
        .ok_or_else(|| Error::Protocol {
            message: "the server answered the session probe with no row".to_owned(),
        })?;
    let field = |i: usize| row.get(i).unwrap_or_default();
    let version: i32 = field(0).parse().unwrap_or(0);
    let backend_pid: i32 = field(1).parse().unwrap_or(0);
    let in_recovery = field(2) == "t";
    let found_marker = field(3).to_owned();
    let advisory_locks: i64 = field(4).parse().unwrap_or(0);
    let database_oid: i64 = field(5).parse().unwrap_or(0);
    // The server's address as it sees this connection (empty over a Unix socket).
    let server = field(6).to_owned();
    let read_only = field(7) == "on";
    if version < MIN_SERVER_VERSION {
        return Err(Error::Refused(SessionDownReason::ServerTooOld { version }));
    }
    if in_recovery {
        return Err(Error::Refused(SessionDownReason::ServerInRecovery));
    }
    if read_only {
        return Err(Error::Refused(SessionDownReason::ServerReadOnly));
    }
    if !found_marker.is_empty() || advisory_locks > 0 {
        return Err(Error::Refused(SessionDownReason::PoolerDetected {
            detail: format!(
                "the new session's backend (pid {backend_pid}) already carries another session's state ({} advisory locks{})",
                advisory_locks,
                if found_marker.is_empty() {
                    ""
                } else {
                    ", another chosen marker"
                }
            ),
        }));
    }
    let marker = new_marker(options, generation);
    let setup = format!(
        "{} SELECT set_config('{MARKER_SETTING}', '{marker}', false);",
        setup_sql(options)
    );
    // The settings, the term and the prepared statements in one round trip: a slow
    // database is not a dead one while connecting either. They are pipelined in this
    // order (each request is sent on its first poll, a biased `try_join!` polls in
    // order, and the server answers in order), so the term is read after the settings (a DBA's
    // statement_timeout must not cancel it). The session is proven from the moment they
    // were sent: the server answered them later, so its idle clock started later, the
    // same rule as a heartbeat's.
    let proven_at = Instant::now();
    let ((), term, stmts) = tokio::try_join!(
        biased;
        async { client.batch_execute(&setup).await.map_err(Error::database) },
        read_term(&client, options.token_epoch),
        async { Statements::prepare(&client).await.map_err(Error::database) },
    )?;
    Ok(Session {
        client: Arc::new(client),
        stmts,
        backend_pid,
        marker,
        database_oid,
        server,
        generation: Generation::new(generation),
        events,
        proven_at,
        term,
        conn_task: guard.disarm(),
    })
}

struct AbortOnDrop(Option<JoinHandle<()>>);

impl AbortOnDrop {
    fn disarm(mut self) -> JoinHandle<()> {
        self.0.take().expect("BUG: disarmed twice")
    }
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if let Some(task) = &self.0 {
            task.abort();
        }
    }
}

impl Statements {
    async fn prepare(client: &Client) -> Result<Self, tokio_postgres::Error> {
        // Prepared concurrently: tokio-postgres pipelines them in one round trip.
        let (
            (heartbeat, try_keys, try_one, unlock, unlock_one),
            (
                check_fences,
                cleanup,
                token,
                holders,
                cluster,
                fence,
                unfence,
                unlock_shared,
                fences_held,
            ),
        ) = tokio::try_join!(
            async {
                tokio::try_join!(
                    client.prepare(HEARTBEAT_SQL),
                    client.prepare(TRY_KEYS_SQL),
                    client.prepare(TRY_ONE_SQL),
                    client.prepare(UNLOCK_SQL),
                    client.prepare(UNLOCK_ONE_SQL),
                )
            },
            async {
                tokio::try_join!(
                    client.prepare(CHECK_FENCES_SQL),
                    client.prepare(CLEANUP_SQL),
                    client.prepare(TOKEN_SQL),
                    client.prepare(HOLDERS_SQL),
                    client.prepare(CLUSTER_SQL),
                    client.prepare(FENCE_SQL),
                    client.prepare(UNFENCE_SQL),
                    client.prepare(UNLOCK_SHARED_SQL),
                    client.prepare(FENCES_HELD_SQL),
                )
            },
        )?;
        Ok(Self {
            heartbeat,
            try_keys,
            try_one,
            unlock,
            unlock_one,
            check_fences,
            fence,
            unfence,
            unlock_shared,
            fences_held,
            cleanup,
            token,
            holders,
            cluster,
        })
    }
}

/// A value unique to this session: the node, the process, the generation and the time.
/// Only `[A-Za-z0-9._-]`, so it can be inlined in SQL.
fn new_marker(options: &ManagerOptions, generation: u64) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let node: String = options
        .node_id
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .take(32)
        .collect();
    format!("{node}.{}.{generation}.{nanos:x}", std::process::id())
}
