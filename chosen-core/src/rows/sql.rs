//! The lease-row statements, with their design notes. Every value is inlined (numbers,
//! and text as hex), so that each batch is one simple-protocol query: no prepared
//! statement has to survive between two transactions of a transaction pooler.

use std::fmt::Write as _;

use crate::key::LockKey;

/// The tables of the lease-row mode in `schema` (see
/// [`lease_tables_sql`](crate::lease_tables_sql)): the leases, the stop fences, and the
/// one-row counter tokens are drawn from. Each object is created (and the counter's row
/// written) only when missing, checked first: a `CREATE ... IF NOT EXISTS` on a table
/// that exists still takes a lock on it, which would queue behind a renewal's open
/// transaction and hold every later statement of the fleet behind it, so running the
/// migration again on tables that are up to date waits for nothing.
pub(crate) fn tables_sql(schema: &str) -> String {
    let names = Names::new(schema);
    let upgrade = add_columns_sql(&names);
    let Names {
        lease,
        fence,
        counter,
    } = names;
    let index = |name: &str| format!("\"{schema}\".{name}");
    let (lease_index, fence_index) = (
        index("chosen_lease_holder"),
        index("chosen_lease_fence_holder"),
    );
    format!(
        "
DO $chosen$ BEGIN
IF to_regclass('{lease}') IS NULL THEN
CREATE TABLE IF NOT EXISTS {lease} (
    form int2 NOT NULL,
    key int8 NOT NULL,
    holder int4 NOT NULL,
    holder_start int8 NOT NULL,
    node_id text NOT NULL,
    token int8 NOT NULL,
    taken_at timestamptz NOT NULL,
    expires_at timestamptz NOT NULL,
    hand_to int8,
    PRIMARY KEY (form, key)
);
END IF;
IF to_regclass('{lease_index}') IS NULL THEN
CREATE INDEX IF NOT EXISTS chosen_lease_holder ON {lease} (holder, holder_start);
END IF;
IF to_regclass('{fence}') IS NULL THEN
CREATE TABLE IF NOT EXISTS {fence} (
    key int8 NOT NULL,
    holder int4 NOT NULL,
    holder_start int8 NOT NULL,
    node_id text NOT NULL,
    expires_at timestamptz NOT NULL,
    PRIMARY KEY (key, holder, holder_start)
);
END IF;
IF to_regclass('{fence_index}') IS NULL THEN
CREATE INDEX IF NOT EXISTS chosen_lease_fence_holder ON {fence} (holder, holder_start);
END IF;
IF to_regclass('{counter}') IS NULL THEN
CREATE TABLE IF NOT EXISTS {counter} (
    one bool PRIMARY KEY DEFAULT true CHECK (one),
    v int8 NOT NULL
);
END IF;
IF NOT EXISTS (SELECT 1 FROM {counter}) THEN
INSERT INTO {counter} (one, v) VALUES (true, 0) ON CONFLICT DO NOTHING;
END IF;
END $chosen$;
{upgrade};
"
    )
}

/// The schema-qualified names of the lease-row tables, quoted.
#[derive(Clone, Debug)]
pub(crate) struct Names {
    pub(crate) lease: String,
    pub(crate) fence: String,
    pub(crate) counter: String,
}

impl Names {
    /// The names in `schema`, which [`ManagerOptions::validate`](crate::ManagerOptions::validate)
    /// has checked to be a plain identifier (no quote in it).
    pub(crate) fn new(schema: &str) -> Self {
        Self {
            lease: format!("\"{schema}\".chosen_lease"),
            fence: format!("\"{schema}\".chosen_lease_fence"),
            counter: format!("\"{schema}\".chosen_lease_counter"),
        }
    }
}

/// Are the tables there, and may this role read and write them? One row: the tables
/// exist (`t`/`f`), whether every privilege needed is granted (`t`/`f`; NULL when a
/// table is missing), and whether the lease table has the columns of this version
/// (`hand_to`, added after the first).
pub(super) fn tables_usable_sql(names: &Names) -> String {
    let Names {
        lease,
        fence,
        counter,
    } = names;
    // `has_table_privilege` with a list is true when *any* of them is held: one call
    // per privilege.
    let may = |table: &str, privileges: &[&str]| {
        privileges
            .iter()
            .map(|p| format!("has_table_privilege(to_regclass('{table}'), '{p}')"))
            .collect::<Vec<_>>()
            .join(" AND ")
    };
    let write = ["SELECT", "INSERT", "UPDATE", "DELETE"];
    format!(
        "SELECT to_regclass('{lease}') IS NOT NULL AND to_regclass('{fence}') IS NOT NULL AND to_regclass('{counter}') IS NOT NULL, \
         CASE WHEN to_regclass('{lease}') IS NOT NULL AND to_regclass('{fence}') IS NOT NULL AND to_regclass('{counter}') IS NOT NULL THEN \
             {} AND {} AND {} END, \
         EXISTS (SELECT 1 FROM pg_catalog.pg_attribute WHERE attrelid = to_regclass('{lease}') AND attname = 'hand_to' AND NOT attisdropped)",
        may(lease, &write),
        may(fence, &write),
        may(counter, &["SELECT", "UPDATE"]),
    )
}

/// Adds the columns later versions added to a lease table made before them (in the
/// migration, and at an owner's connect): only when
/// one is missing (`ALTER TABLE` locks the table against every statement even when it
/// has nothing to do, so running the migration again costs nothing then). A waiting
/// `ALTER TABLE` would hold every later statement of the fleet behind it in the lock's
/// queue, renewals included: it waits at most 100 ms at a time, 20 times, a moment
/// apart, and then fails with a message saying to run it again. The caller's
/// `lock_timeout` is put back after (a migration tool may run this inside a longer
/// transaction of its own).
pub(super) fn add_columns_sql(names: &Names) -> String {
    let lease = &names.lease;
    format!(
        "DO $chosen$ DECLARE before text := pg_catalog.current_setting('lock_timeout'); BEGIN \
           IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_attribute WHERE attrelid = '{lease}'::regclass AND attname = 'hand_to' AND NOT attisdropped) THEN \
             PERFORM pg_catalog.set_config('lock_timeout', '100ms', true); \
             FOR attempt IN 1..20 LOOP \
               BEGIN \
                 ALTER TABLE {lease} ADD COLUMN IF NOT EXISTS hand_to int8; \
                 PERFORM pg_catalog.set_config('lock_timeout', before, true); \
                 RETURN; \
               EXCEPTION WHEN lock_not_available THEN \
                 PERFORM pg_catalog.pg_sleep(0.1); \
               END; \
             END LOOP; \
             PERFORM pg_catalog.set_config('lock_timeout', before, true); \
             RAISE EXCEPTION 'chosen: could not add the hand_to column to {lease}: its lock was never free for 100 ms (a long transaction on the table?); run lease_tables_sql again'; \
           END IF; \
         END $chosen$"
    )
}

/// Deletes rows that expired more than an hour ago (a crashed holder's, a name used
/// once), a thousand of each table at most, skipping rows another statement has locked
/// (a try taking one over: no deadlock with it): run as a session opens, so that the
/// tables do not grow with names nobody takes again.
pub(super) fn sweep_sql(names: &Names) -> String {
    let Names { lease, fence, .. } = names;
    format!(
        "DELETE FROM {lease} WHERE ctid = ANY (ARRAY(SELECT ctid FROM {lease} WHERE expires_at < now() - interval '1 hour' LIMIT 1000 FOR UPDATE SKIP LOCKED)) AND expires_at < now() - interval '1 hour'; \
         DELETE FROM {fence} WHERE ctid = ANY (ARRAY(SELECT ctid FROM {fence} WHERE expires_at < now() - interval '1 hour' LIMIT 1000 FOR UPDATE SKIP LOCKED)) AND expires_at < now() - interval '1 hour'"
    )
}

/// What tells the server a session began on from any other (another server, the same
/// one restarted, promoted or moved to another timeline, another database): every
/// batch checks it first, so that a pool whose connections moved to another server (a
/// failover behind a DNS name, a restart) ends the session instead of issuing tokens
/// of the old term's timeline there. A hex digest, so that it can be inlined.
/// (Numbers only: a connection's `TimeZone` or `DateStyle` must not change it.)
pub(super) const SERVER_SQL: &str = "encode(sha256(convert_to(current_database() || '/' || extract(epoch FROM pg_postmaster_start_time())::text || '/' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8) || '/' || (SELECT system_identifier FROM pg_control_system())::text, 'UTF8')), 'hex')";

/// What the connect reads besides the term: the server identity, where the pool
/// connects (for the status), and the least token the session can draw.
pub(super) fn open_sql(names: &Names) -> String {
    let counter = &names.counter;
    format!(
        "SELECT {SERVER_SQL}, coalesce(host(inet_server_addr()) || ':' || inet_server_port(), ''), (SELECT greatest(c.v + 1, {XMAX_SQL}) FROM {counter} c)::text"
    )
}

/// Above every transaction id assigned before the statement's snapshot: the tokens of
/// the advisory-lock mode issued before on this server are below it.
const XMAX_SQL: &str = "pg_snapshot_xmax(pg_current_snapshot())::text::int8";

/// Is the server a writable primary, and is the connection outside any transaction?
/// Asked first: the term query fails on a standby.
pub(super) const ROLE_SQL: &str = "SELECT pg_is_in_recovery(), current_setting('transaction_read_only'), transaction_timestamp() = statement_timestamp() AND pg_current_xact_id_if_assigned() IS NULL";

/// The marker the guard's failure carries (see [`Batch::new`]).
pub(super) const SERVER_CHANGED: &str = "chosen-lease-server-changed";

/// The marker of a batch that did not begin its own transaction.
pub(crate) const IN_TRANSACTION: &str = "chosen-lease-in-transaction";

/// True in the first statement of a transaction that has written nothing: a batch (or
/// the connect's probe) on a connection an application left inside its own open
/// transaction is refused.
pub(super) const FRESH_SQL: &str =
    "transaction_timestamp() = statement_timestamp() AND pg_current_xact_id_if_assigned() IS NULL";

/// The identity of one session: the holder id and when it began (microseconds since
/// the Unix epoch); ids are random, the pair is unique.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Me {
    pub(super) holder: i32,
    pub(super) start: i64,
}

impl Me {
    fn matches(self, table: &str) -> String {
        format!(
            "{table}.holder = {} AND {table}.holder_start = {}",
            self.holder, self.start
        )
    }
}

/// A key's `(form, key)` columns: a pair of int4 packs into one int8 (form 2), an int8
/// key is itself (form 1), as in `pg_locks`' `objsubid`.
pub(super) fn columns(key: LockKey) -> (i16, i64) {
    match key {
        LockKey::Pair(a, b) => (2, (i64::from(a) << 32) | i64::from(b as u32)),
        LockKey::Int(k) => (1, k),
    }
}

/// The key of a row's columns (`None` for a form chosen never writes).
pub(super) fn key_of(form: i16, key: i64) -> Option<LockKey> {
    match form {
        2 => Some(LockKey::Pair((key >> 32) as i32, key as i32)),
        1 => Some(LockKey::Int(key)),
        _ => None,
    }
}

/// `ARRAY[...]::<ty>[]` of `values`.
fn array<T: std::fmt::Display>(values: impl IntoIterator<Item = T>, ty: &str) -> String {
    let mut out = String::from("ARRAY[");
    for (i, v) in values.into_iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        let _ = write!(out, "{v}");
    }
    let _ = write!(out, "]::{ty}[]");
    out
}

/// `unnest(forms, keys) WITH ORDINALITY AS k(form, key, i)` of `keys`.
fn keys_table(keys: &[LockKey]) -> String {
    let cols: Vec<(i16, i64)> = keys.iter().map(|k| columns(*k)).collect();
    format!(
        "unnest({}, {}) WITH ORDINALITY AS k(form, key, i)",
        array(cols.iter().map(|c| c.0), "int2"),
        array(cols.iter().map(|c| c.1), "int8"),
    )
}

/// A stop fence's packed key (fences are always two-int4 keys).
pub(super) fn fence_column(key: LockKey) -> i64 {
    columns(key.stop_fence()).1
}

/// Text inlined as hex, so that nothing in it can end the literal.
pub(super) fn text_literal(text: &str) -> String {
    let mut hex = String::with_capacity(text.len() * 2);
    for b in text.as_bytes() {
        let _ = write!(hex, "{b:02x}");
    }
    format!("convert_from(decode('{hex}', 'hex'), 'UTF8')")
}

/// One transaction of statements, sent as one simple query (PostgreSQL runs a
/// multi-statement query as one implicit transaction: all of it commits, or none).
/// Every statement's rows begin with a one-letter tag, which is how the answers are
/// told apart.
pub(super) struct Batch {
    pub(super) sql: String,
    names: Names,
}

impl Batch {
    /// A batch that first proves it runs on the session's server, writable, in a
    /// transaction of its own at `READ COMMITTED` (a connection left inside an
    /// application's open transaction would never commit it, and a stricter level would
    /// fail concurrent token draws), with the session's timeouts: `statement_timeout` per statement, no wait for a row lock
    /// longer than that either, and a commit that waits for the local WAL flush (a
    /// token the server forgets in a crash could be issued again).
    /// The `search_path` is pinned for the batch (the application may set its own on a
    /// pooled connection): the tables are named with their schema, and functions
    /// resolve in `pg_catalog`.
    pub(super) fn new(names: &Names, server: &str, statement_ms: u128) -> Self {
        Self {
            sql: format!(
                "SET TRANSACTION ISOLATION LEVEL READ COMMITTED; \
                 SELECT 'g', CASE WHEN {SERVER_SQL} = '{server}' THEN 1 ELSE ('{SERVER_CHANGED}:' || {SERVER_SQL})::int4 END, \
                 CASE WHEN {FRESH_SQL} THEN 1 ELSE ('{IN_TRANSACTION}:' || statement_timestamp()::text)::int4 END, \
                 set_config('search_path', 'pg_catalog', true), set_config('statement_timeout', '{statement_ms}', true), set_config('lock_timeout', '{statement_ms}', true), set_config('synchronous_commit', 'local', true), \
                 CASE WHEN current_setting('transaction_timeout', true) IS NULL THEN '' ELSE set_config('transaction_timeout', '0', true) END;"
            ),
            names: names.clone(),
        }
    }

    fn push(&mut self, statement: &str) {
        self.sql.push('\n');
        self.sql.push_str(statement);
        self.sql.push(';');
    }

    /// Deletes the session's rows of `keys`, except those handed over to one node
    /// (`hand`: the key and the node's hash), which are kept for that node for `hold_ms`
    /// (held by no session: holder 0); answers `u` with each key released.
    /// `wait`: wait for a row another statement has locked instead of skipping it (see
    /// [`Batch::retry`]).
    pub(super) fn unlock(
        &mut self,
        me: Me,
        keys: &[LockKey],
        hand: &[(LockKey, u64)],
        hold_ms: u128,
        wait: bool,
    ) {
        let skip = if wait { "" } else { " SKIP LOCKED" };
        let lease = &self.names.lease;
        let cols: Vec<(i16, i64)> = keys.iter().map(|k| columns(*k)).collect();
        let hands: Vec<String> = keys
            .iter()
            .map(|k| {
                hand.iter()
                    .find(|(h, _)| h == k)
                    .map_or_else(|| "NULL".to_owned(), |(_, to)| (*to as i64).to_string())
            })
            .collect();
        let hands = format!("ARRAY[{}]::int8[]", hands.join(","));
        // Locked in key order, skipping (not waiting for) a row another statement has
        // locked: a try taking it over (it expired), or, rarely, a try that found it
        // live only as it conflicted (at a renewal racing the expiry, or a fresh take
        // racing another node's). What was skipped is released again by `retry`, which
        // waits; only a row still not the session's then ends the session.
        self.push(&format!(
            "WITH m AS (SELECT l.form, l.key, k.i, k.hand FROM {lease} l JOIN unnest({}, {}, {}) WITH ORDINALITY AS k(form, key, hand, i) ON l.form = k.form AND l.key = k.key WHERE {} ORDER BY l.form, l.key FOR UPDATE OF l{skip}), \
             d AS (DELETE FROM {lease} l USING m WHERE l.form = m.form AND l.key = m.key AND m.hand IS NULL RETURNING m.i), \
             h AS (UPDATE {lease} l SET holder = 0, holder_start = 0, node_id = '', hand_to = m.hand, expires_at = clock_timestamp() + interval '{hold_ms} milliseconds' FROM m WHERE l.form = m.form AND l.key = m.key AND m.hand IS NOT NULL RETURNING m.i) \
             SELECT 'u', i FROM d UNION ALL SELECT 'u', i FROM h",
            array(cols.iter().map(|c| c.0), "int2"),
            array(cols.iter().map(|c| c.1), "int8"),
            hands,
            me.matches("l")
        ));
    }

    /// Deletes the session's stop fences of `keys`; answers `v` with each one deleted.
    pub(super) fn unfence(&mut self, me: Me, keys: &[LockKey]) {
        let fence = &self.names.fence;
        self.push(&format!(
            "DELETE FROM {fence} f USING unnest({}) WITH ORDINALITY AS k(key, i) WHERE f.key = k.key AND {} RETURNING 'v', k.i",
            array(keys.iter().map(|k| fence_column(*k)), "int8"),
            me.matches("f")
        ));
    }

    /// A fresh token, from the counter, for keys the session holds (their rows locked
    /// in key order first, so that they cannot be taken meanwhile): answers `t` with
    /// each key and the token.
    /// `wait`: wait for a row another statement has locked instead of skipping it (see
    /// [`Batch::retry`]).
    pub(super) fn token(&mut self, me: Me, keys: &[LockKey], wait: bool) {
        let Names { lease, counter, .. } = &self.names;
        let skip = if wait { "" } else { " SKIP LOCKED" };
        // A row is live by the clock: the transaction's start (`now()`) is stale after
        // a wait (the try's, or the retry's).
        let now = "clock_timestamp()";
        // Its rows (skipping one another statement holds, as the unlock does, for
        // `retry` to wait for), then the counter. In a step, only the try waits for rows held by
        // others, before anything else of the step locks one; after it, nothing waits
        // but for the counter, whose holder waits for nothing (see `Inner::perform`):
        // no two steps deadlock.
        let draw = format!(
            "WITH m AS (SELECT l.form, l.key, k.i FROM {lease} l JOIN {} ON l.form = k.form AND l.key = k.key WHERE {} AND l.expires_at > {now} ORDER BY l.form, l.key FOR UPDATE OF l{skip}), \
             t AS (UPDATE {counter} c SET v = greatest(c.v + 1, {XMAX_SQL}) WHERE (SELECT count(*) FROM m) > 0 RETURNING c.v) \
             UPDATE {lease} l SET token = t.v FROM m, t WHERE l.form = m.form AND l.key = m.key RETURNING 't', m.i, t.v",
            keys_table(keys),
            me.matches("l")
        );
        self.push(&draw);
    }

    /// The second chance of a step whose release or token draw skipped a row of the
    /// session that another statement had locked (a try that found it live only as it
    /// conflicted, or one taking it over as it expired): in a transaction of its own,
    /// which first locks every one of those rows in key order (holding no other row
    /// while it waits), those statements wait for that statement's transaction (within
    /// `lock_timeout`) and then see the row as it committed: still the session's (a try
    /// that failed), or another's (the session lost it).
    pub(super) fn retry(
        &mut self,
        me: Me,
        (unlock, hand, hold_ms): (&[LockKey], &[(LockKey, u64)], u128),
        token: &[LockKey],
    ) {
        // Every row of both first, in key order, in one statement: a release that held
        // its rows while the token draw waited for another step's try, which waited
        // for those rows, would deadlock.
        let mut all: Vec<LockKey> = unlock.iter().chain(token).copied().collect();
        all.sort_unstable();
        all.dedup();
        let lease = &self.names.lease;
        self.push(&format!(
            "SELECT count(*) FROM (SELECT 1 FROM {lease} l JOIN {} ON l.form = k.form AND l.key = k.key WHERE {} ORDER BY l.form, l.key FOR UPDATE OF l) AS locked",
            keys_table(&all),
            me.matches("l")
        ));
        if !unlock.is_empty() {
            self.unlock(me, unlock, hand, hold_ms, true);
        }
        if !token.is_empty() {
            self.token(me, token, true);
        }
    }

    /// Tries `keys`: a key with no row, whose row expired by the server's clock, or
    /// whose row a release kept for this node (`node_hash`, a hand-over), is taken
    /// (inserted, or its row overwritten), in key order; a key whose row is live (or
    /// kept for another node) is not. Rows that look live are not even locked (nor
    /// their keys' advisory locks tried): a failed try writes nothing.
    /// The new rows carry token 0 until [`Batch::tokens_for_wins`], which runs after
    /// every row of the batch is taken. Answers `k` per key: its index, whether it was
    /// won, whether a row was there before (an expired one: a takeover), and for a key
    /// not won the live holder the statement saw (id, start).
    pub(super) fn try_keys(
        &mut self,
        me: Me,
        (node, node_hash): (&str, u64),
        ttl_ms: u128,
        keys: &[LockKey],
    ) {
        let mine = node_hash as i64;
        let lease = &self.names.lease;
        self.push(&format!(
            "WITH k AS (SELECT * FROM {}), \
             won AS (INSERT INTO {lease} AS l (form, key, holder, holder_start, node_id, token, taken_at, expires_at) \
                 SELECT k.form, k.key, {}, {}, {}, 0, now(), now() + interval '{ttl_ms} milliseconds' FROM k \
                 WHERE CASE WHEN EXISTS (SELECT 1 FROM {lease} c WHERE c.form = k.form AND c.key = k.key AND c.expires_at > now() AND (c.hand_to IS DISTINCT FROM {mine} OR c.holder <> 0)) THEN false \
                            WHEN k.form = 2 THEN pg_try_advisory_xact_lock((k.key >> 32)::int4, ((k.key << 32) >> 32)::int4) \
                            ELSE pg_try_advisory_xact_lock(k.key) END \
                 ORDER BY k.form, k.key \
                 ON CONFLICT (form, key) DO UPDATE SET holder = excluded.holder, holder_start = excluded.holder_start, node_id = excluded.node_id, token = 0, taken_at = excluded.taken_at, expires_at = excluded.expires_at, hand_to = NULL \
                 WHERE l.expires_at <= now() OR (l.hand_to = {mine} AND l.holder = 0) \
                 RETURNING l.form, l.key) \
             SELECT 'k', k.i, w.key IS NOT NULL, c.key IS NOT NULL, \
                    CASE WHEN w.key IS NULL AND c.expires_at > now() THEN c.holder END, \
                    CASE WHEN w.key IS NULL AND c.expires_at > now() THEN c.holder_start END \
             FROM k LEFT JOIN won w ON w.form = k.form AND w.key = k.key \
                    LEFT JOIN {lease} c ON c.form = k.form AND c.key = k.key",
            keys_table(keys),
            me.holder,
            me.start,
            text_literal(node),
        ));
    }

    /// One token for every key the try just won (the rows it wrote with token 0), drawn
    /// from the one-row counter (its row lock orders the draws of the whole fleet, and
    /// a draw is above every transaction id assigned before it: above the tokens of the
    /// advisory-lock mode on this server),
    /// drawn after all of them were taken: a token drawn before a later key of the
    /// batch was taken could be below the token of a tenure of that key in between.
    /// And for a key won, who holds its stop fence (an earlier holder still stopping).
    /// Answers `w` per key won: its columns, the token, and the fence's holder.
    pub(super) fn tokens_for_wins(&mut self, me: Me, fences: &[(LockKey, i64)]) {
        let (keys, fence_keys): (Vec<(i16, i64)>, Vec<i64>) =
            fences.iter().map(|(k, f)| (columns(*k), *f)).unzip();
        let Names {
            lease,
            fence,
            counter,
        } = &self.names;
        self.push(&format!(
            "WITH t AS (UPDATE {counter} c SET v = greatest(c.v + 1, {XMAX_SQL}) WHERE EXISTS (SELECT 1 FROM {lease} l WHERE {} AND l.token = 0) RETURNING c.v), \
             f AS (SELECT * FROM unnest({}, {}, {}) AS f(form, key, fence)), \
             u AS (UPDATE {lease} l SET token = t.v FROM t WHERE {} AND l.token = 0 RETURNING l.form, l.key, l.token) \
             SELECT 'w', u.form, u.key, u.token, \
                    (SELECT fe.holder FROM {fence} fe WHERE fe.key = f.fence AND fe.expires_at > now() AND NOT ({}) LIMIT 1) \
             FROM u LEFT JOIN f ON f.form = u.form AND f.key = u.key",
            me.matches("l"),
            array(keys.iter().map(|c| c.0), "int2"),
            array(keys.iter().map(|c| c.1), "int8"),
            array(fence_keys.iter(), "int8"),
            me.matches("l"),
            me.matches("fe"),
        ));
    }

    /// Takes (or renews) the session's stop fences of `keys`; answers `f` per fence.
    pub(super) fn fence(&mut self, me: Me, node: &str, ttl_ms: u128, keys: &[LockKey]) {
        let fence = &self.names.fence;
        self.push(&format!(
            "INSERT INTO {fence} AS f (key, holder, holder_start, node_id, expires_at) \
             SELECT k.key, {}, {}, {}, now() + interval '{ttl_ms} milliseconds' FROM unnest({}) AS k(key) ORDER BY k.key \
             ON CONFLICT (key, holder, holder_start) DO UPDATE SET expires_at = excluded.expires_at \
             RETURNING 'f', f.key",
            me.holder,
            me.start,
            text_literal(node),
            array(keys.iter().map(|k| fence_column(*k)), "int8"),
        ));
    }

    /// Who else holds a live stop fence of each of `keys`; answers `c` per key.
    pub(super) fn check(&mut self, me: Me, keys: &[LockKey]) {
        let fence = &self.names.fence;
        self.push(&format!(
            "SELECT 'c', k.i, (SELECT fe.holder FROM {fence} fe WHERE fe.key = k.key AND fe.expires_at > now() AND NOT ({}) LIMIT 1) \
             FROM unnest({}) WITH ORDINALITY AS k(key, i)",
            me.matches("fe"),
            array(keys.iter().map(|k| fence_column(*k)), "int8"),
        ));
    }

    /// Renews every live row of the session, leases and fences, to the server's clock
    /// now plus the TTL; the rows are locked in key order first, waiting for a step
    /// that holds one (its try locked it: a takeover, or a failed try, which keeps the
    /// row locked until its step ends; such a step waits for nothing but the counter,
    /// whose holder waits for no row: no cycle), and a row already expired is not
    /// renewed (someone may be taking it): the answer then lacks it. Answers
    /// `l` per lease and `s` per fence renewed.
    pub(super) fn renew(&mut self, me: Me, ttl_ms: u128) {
        let Names { lease, fence, .. } = &self.names;
        self.push(&format!(
            "WITH m AS (SELECT l.form, l.key FROM {lease} l WHERE {} AND l.expires_at > now() ORDER BY l.form, l.key FOR UPDATE), \
             r AS (UPDATE {lease} l SET expires_at = now() + interval '{ttl_ms} milliseconds' FROM m WHERE l.form = m.form AND l.key = m.key RETURNING l.form, l.key), \
             s AS (UPDATE {fence} f SET expires_at = now() + interval '{ttl_ms} milliseconds' WHERE {} AND f.expires_at > now() RETURNING f.key) \
             SELECT 'l', r.form, r.key FROM r UNION ALL SELECT 's', 2, s.key FROM s",
            me.matches("l"),
            me.matches("f"),
        ));
    }

    /// Deletes every row of the session.
    pub(super) fn release_all(&mut self, me: Me) {
        let Names { lease, fence, .. } = &self.names;
        let (l, f) = (me.matches("l"), me.matches("f"));
        // Best effort: a row a try is taking over is skipped, not waited for.
        let leases = format!(
            "WITH m AS (SELECT l.form, l.key FROM {lease} l WHERE {l} ORDER BY l.form, l.key FOR UPDATE SKIP LOCKED) \
             DELETE FROM {lease} l USING m WHERE l.form = m.form AND l.key = m.key"
        );
        let fences = format!("DELETE FROM {fence} f WHERE {f}");
        self.push(&leases);
        self.push(&fences);
    }
}

/// The head of a read: a transaction of its own at `READ COMMITTED` (a connection left
/// inside an application's transaction would answer from its old snapshot, and is
/// closed instead). Its one row is the text `r`: no read's answer takes it for one of
/// its own (they are tagged, or numbered).
pub(crate) fn read_head() -> String {
    format!(
        "SET TRANSACTION ISOLATION LEVEL READ COMMITTED; SELECT CASE WHEN {FRESH_SQL} THEN 'r' ELSE ('{IN_TRANSACTION}:' || statement_timestamp()::text)::int4::text END;"
    )
}

/// A row a release kept for a hand-over's target: held by no session (holder 0). Only
/// both together say so (a row some other writer took over may still carry `hand_to`).
const KEPT: &str = "(l.holder = 0 AND l.hand_to IS NOT NULL)";

/// Who holds each of `keys` (live rows only, not those kept for a hand-over's target);
/// answers `h` per key held.
pub(super) fn holders_sql(names: &Names, keys: &[LockKey]) -> String {
    let lease = &names.lease;
    format!(
        "SELECT 'h', k.i, l.node_id, l.holder, l.holder_start FROM {} JOIN {lease} l ON l.form = k.form AND l.key = k.key WHERE l.expires_at > now() AND NOT {KEPT}",
        keys_table(keys)
    )
}

/// An observer's read (see `observer::holders_sql`, whose columns it answers), after
/// [`read_head`]: the server's role first, then each key's live row.
pub(crate) fn observer_sql(schema: &str, keys: &[LockKey]) -> String {
    let lease = Names::new(schema).lease;
    format!(
        "{} SELECT 0::int8, pg_is_in_recovery()::text, NULL::int4, NULL::text, NULL::int8 \
         UNION ALL \
         SELECT k.i, l.node_id, l.holder, NULL::text, l.holder_start FROM {} JOIN {lease} l ON l.form = k.form AND l.key = k.key WHERE l.expires_at > now() AND NOT {KEPT}",
        read_head(),
        keys_table(keys)
    )
}

/// Every live lease row.
pub(super) fn cluster_sql(names: &Names) -> String {
    let lease = &names.lease;
    format!(
        "SELECT 'h', l.form, l.key, l.node_id, l.holder, l.holder_start FROM {lease} l WHERE l.expires_at > now() AND NOT {KEPT} ORDER BY l.form, l.key"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_key_form_round_trips_through_its_columns() {
        for key in [
            LockKey::Pair(0, 0),
            LockKey::Pair(-1, -1),
            LockKey::Pair(i32::MIN, i32::MAX),
            LockKey::Pair(i32::MAX, i32::MIN),
            LockKey::Int(0),
            LockKey::Int(i64::MIN),
            LockKey::Int(i64::MAX),
        ] {
            let (form, k) = columns(key);
            assert_eq!(key_of(form, k), Some(key));
        }
        assert_eq!(key_of(3, 1), None);
    }

    #[test]
    fn text_is_inlined_as_hex_only() {
        let lit = text_literal("a'; DROP TABLE x; --");
        assert!(!lit[..lit.len() - 1].contains(';'));
        assert_eq!(lit.matches('\'').count(), 6);
    }
}
