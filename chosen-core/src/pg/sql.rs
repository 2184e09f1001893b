//! The statement texts, each with its design notes: what it locks, in which order, and
//! why. Seen by operators (`pg_stat_statements`) and reviewed as SQL; change them with
//! care.

/// The channel graceful releases are announced on (payload: up to 200 key tags, see
/// `LockKey::tag`, joined by commas).
/// Seen by operators and other versions: do not change.
pub(crate) const RELEASE_CHANNEL: &str = "chosen_release";

/// The oldest server supported: `idle_session_timeout` appeared in PostgreSQL 14.
pub(super) const MIN_SERVER_VERSION: i32 = 140_000;

// Statement texts. They show up in pg_stat_statements and pg_stat_activity, so keep
// them stable.

/// The custom setting that marks a backend as ours. A fresh backend has none; a
/// transaction pooler that shares backends between clients shows another one's.
pub(crate) const MARKER_SETTING: &str = "chosen.session";

pub(super) const PROBE_SQL: &str = "SELECT current_setting('server_version_num')::int4, pg_backend_pid(), pg_is_in_recovery(), coalesce(current_setting('chosen.session', true), ''), (SELECT count(*) FROM pg_lock_status() l WHERE l.locktype = 'advisory' AND l.pid = pg_backend_pid()), (SELECT oid FROM pg_database WHERE datname = current_database())::int8, coalesce(host(inet_server_addr()) || ':' || inet_server_port(), ''), current_setting('transaction_read_only')";

/// What tells one server (and the database on it) from another, for the exclusion
/// self-test, whose two connections must agree on it: its address as it sees the
/// connection, the database, and when the server started. A hex digest, so that it can
/// be inlined in SQL.
pub(super) const SERVER_IDENTITY_SQL: &str = "encode(sha256(convert_to(coalesce(host(inet_server_addr()) || ':' || inet_server_port(), '') || '/' || current_database() || '/' || pg_postmaster_start_time()::text, 'UTF8')), 'hex')";

/// What the self-test is remembered by: the server's identity and the client's address
/// as the server sees it (a pooler put in between connects from its own). A hex digest.
pub(super) const PROVEN_IDENTITY_SQL: &str = "encode(sha256(convert_to(coalesce(host(inet_server_addr()) || ':' || inet_server_port(), '') || '/' || current_database() || '/' || pg_postmaster_start_time()::text || '/' || coalesce(host(inet_client_addr()), ''), 'UTF8')), 'hex')";

/// Proves the session: the same backend, writable, still marked as ours, and which
/// advisory locks it holds (one the manager holds missing means something released it
/// behind its back: a transaction pooler sharing the backend, `DISCARD ALL`,
/// `pg_advisory_unlock_all()`).
///
/// Writable means not in recovery *and* not read-only: a switchover that fences the old
/// primary with `default_transaction_read_only = on` and a reload before promoting its
/// standby is seen by the next heartbeat (a reload reaches every session, and the
/// setting is read at the start of each statement's transaction).
///
/// The locks come as two arrays in the same order: `classid << 32 | objid`, and
/// `objsubid * 2 + 1` when held exclusively (`objsubid * 2` when shared). Both are
/// aggregated over the same rows of one scan of the lock table, so they line up.
pub(super) const HEARTBEAT_SQL: &str = "
SELECT pg_backend_pid(), pg_is_in_recovery(),
       coalesce(current_setting('chosen.session', true), ''),
       h.keys, h.kinds,
       current_setting('transaction_read_only') = 'on'
FROM (SELECT coalesce(array_agg((l.classid::int8 << 32) | l.objid::int8), '{}') AS keys,
             coalesce(array_agg(l.objsubid::int4 * 2 + (l.mode = 'ExclusiveLock')::int4), '{}') AS kinds
      FROM pg_lock_status() l
      WHERE l.locktype = 'advisory' AND l.pid = pg_backend_pid() AND l.granted) h";

/// Tries every due key in one statement, on our own marked backend only (behind a
/// transaction pooler the guard makes it return no rows instead), and only while the
/// session is writable (a primary fenced read-only takes no lock and writes no token
/// record; the empty answer is then told apart, see [`PgLink::guard_failed`](super::PgLink::guard_failed)).
///
/// * The locks are taken in the materialized CTE `k`, all of them before any fencing
///   token is assigned: the uncorrelated `done` sub-select (evaluated once, on first
///   use) reads every row of `k` first. A token assigned before a later key of the batch
///   was locked could be smaller than the token of another node's tenure of that key in
///   between.
/// * A transaction id (the token) is assigned only when a lock was won, and only for a
///   key whose flag in `$13` is set (its request wants the token with the grant; any
///   other's is issued when its holder reads it, see [`TOKEN_SQL`]): failed polls and
///   lazy wins burn no transaction ids and write nothing. Keys won in one statement
///   share one token. Whether a key was won is told by the fifth column, not the token.
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
pub(super) const TRY_KEYS_SQL: &str = "
WITH t AS MATERIALIZED (
    SELECT k.i, k.a, k.b, k.big, k.fa, k.fb, k.ap, k.tok,
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
                $9::bool[], $10::int4[], $11::int4[], $12::int4[], $13::bool[])
         WITH ORDINALITY AS k(a, b, big, fa, fb, reg, ia, ib, ap, tok, i)
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
       CASE WHEN f.won AND f.tok AND set_config('synchronous_commit', 'local', true) = 'local' AND pg_logical_emit_message(true, 'chosen.token', '') IS NOT NULL THEN pg_current_xact_id()::text::int8 END,
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
SELECT CASE WHEN f.won AND $13::bool AND set_config('synchronous_commit', 'local', true) = 'local' AND pg_logical_emit_message(true, 'chosen.token', '') IS NOT NULL THEN pg_current_xact_id()::text::int8 END,
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
pub(super) const CHECK_FENCES_SQL: &str = "
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
pub(super) const FENCE_LOCK_TIMEOUT: &str = "50ms";

/// Takes stop fences, in *shared* mode: first every one without waiting (`t`, read
/// whole by the sub-select before any row is returned), then, for a fence held
/// exclusively at that instant (a probe), waiting at most `$5` (`lock_timeout`, for
/// this statement only): a probe must not make the take fail, or the probe's node could
/// grant the key while this one's work still runs. Shared, so that no other shared
/// holder can make it fail. On our own marked backend only.
pub(super) const FENCE_SQL: &str = "
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
pub(super) const FENCES_HELD_SQL: &str = "
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
pub(super) const UNLOCK_SHARED_SQL: &str = "
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
pub(super) const UNFENCE_SQL: &str = "
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
pub(super) const UNLOCK_SQL: &str = "
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
pub(super) const CLEANUP_SQL: &str = "
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
pub(super) const HOLDERS_SQL: &str = "
SELECT k.i, a.application_name, l.pid, host(a.client_addr), a.backend_start
FROM unnest($1::int8[], $2::int8[], $3::int2[]) WITH ORDINALITY AS k(classid, objid, objsubid, i)
JOIN pg_locks l
  ON l.locktype = 'advisory' AND l.granted AND l.pid IS NOT NULL
 AND l.database = $4::int8::oid
 AND l.classid::int8 = k.classid AND l.objid::int8 = k.objid AND l.objsubid = k.objsubid
LEFT JOIN pg_stat_activity a ON a.pid = l.pid";

/// Every advisory lock held in this database, with its holder session.
pub(super) const CLUSTER_SQL: &str = "
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
/// the heartbeat's lock guard would with its next beat. The nested `CASE` makes
/// the order certain: no WAL record and no transaction id unless every key is held.
/// (It reads the whole lock table, once per step that hands keys off locally.)
pub(super) const TOKEN_SQL: &str = "
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
pub(super) const TERM_SQL: &str = "
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
pub(super) const EMIT_PRIVILEGE_SQL: &str = "SELECT has_function_privilege(coalesce(to_regprocedure('pg_catalog.pg_logical_emit_message(boolean, text, text, boolean)'), to_regprocedure('pg_catalog.pg_logical_emit_message(boolean, text, text)')), 'EXECUTE')";
