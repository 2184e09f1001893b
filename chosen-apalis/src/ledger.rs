//! The tick ledger: every (job, scheduled tick) recorded in PostgreSQL, claimed once.

mod clock;
mod context;
mod error;
mod gate;
mod identity;
mod overlap;
mod plan;

use std::fmt;
use std::sync::{Arc, PoisonError, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use chosen_core::fenced::FenceTable;
use chosen_core::{FencingToken, LockKey};
use deadpool_postgres::Pool;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::Type;

use clock::DbClock;
pub(crate) use clock::Reading;
pub use context::{LedgerTx, TickContext};
pub use error::LedgerError;
pub use gate::{LedgerFuture, LedgeredCron, LedgeredCronLayer};
use identity::job_key;
pub use overlap::Overlap;
pub use plan::Misfire;
pub(crate) use plan::Recorded;

pub(crate) use error::chain;

/// The ledger table used unless another is configured.
pub const DEFAULT_LEDGER_TABLE: &str = "chosen_ticks";

/// The SQL that creates the default ledger table (`"chosen_ticks"` in the schema first
/// on the `search_path`; the ledger then names it with that schema, see
/// [`TickLedger::table`]), for teams that run their own migrations; the fence table
/// ([`chosen_core::fenced::INSTALL_SQL`]) is needed too. Tables created by earlier
/// versions are brought up to date by [`LedgerTable::upgrade_sql`] (which
/// [`TickLedger::install`] runs).
pub const LEDGER_INSTALL_SQL: &str = "CREATE TABLE IF NOT EXISTS \"chosen_ticks\" (\n    job         text        NOT NULL,\n    tick        timestamptz NOT NULL,\n    token       bigint      NOT NULL CHECK (token >= 0),\n    outcome     text        NOT NULL CHECK (outcome IN ('running', 'ran', 'skipped', 'failed', 'cancelled')),\n    reason      text,\n    node        text        NOT NULL,\n    started_at  timestamptz NOT NULL,\n    finished_at timestamptz,\n    schedule    text,\n    PRIMARY KEY (job, tick)\n)";

/// Who claims a tick in the ledger, and so what "once" means for it.
///
/// | claim | the tick's row is committed | a tick runs | covers |
/// |---|---|---|---|
/// | [`BeforeRun`](Self::BeforeRun) (default) | by the gate, in a transaction of its own, *before* the job runs (outcome `running`, then `ran` / `failed`) | **at most once**: a crash after the claim loses the run, and the row stays `running` | the job's whole run, whatever it writes where |
/// | [`InJobTransaction`](Self::InJobTransaction) | by the job, in the transaction [`TickContext::begin`] opens, *with the job's writes* | **exactly once** for the writes made in that transaction: they commit together with the tick's row, once, or not at all (and then a later leader may run the tick again, per the misfire policy) | only the writes in that transaction |
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Claim {
    /// The gate claims the tick before the job runs: at most once.
    #[default]
    BeforeRun,
    /// The job claims the tick in its own transaction ([`TickContext::begin`]):
    /// exactly once for the writes in that transaction.
    InJobTransaction,
}

/// Where the ticks of ledgered cron jobs are recorded: a `deadpool_postgres::Pool` and
/// two tables, the ledger and chosen-core's fence table.
///
/// Each row is one (job, scheduled tick): the tick's identity is the time the cron
/// schedule gave it, not any node's clock, and the primary key makes a second row for
/// it impossible. Every row is inserted in a transaction that first calls
/// [`chosen_core::fenced::fence`] with the job's fence name
/// ([`LedgeredCronLayer::fence_name`]: the lock's name, for the lock's only job in the
/// default namespace) and the leader's fencing token, so a stale leader's insert cannot
/// commit after a newer leader's.
///
/// ```no_run
/// use chosen_apalis::TickLedger;
///
/// # async fn demo(pool: deadpool_postgres::Pool) -> Result<(), chosen_apalis::LedgerError> {
/// let ledger = TickLedger::new(pool);
/// ledger.install().await?; // once, at start-up: CREATE TABLE IF NOT EXISTS (both tables)
/// # Ok(())
/// # }
/// ```
///
/// The table, for teams that run their own migrations ([`LEDGER_INSTALL_SQL`], or
/// [`LedgerTable::install_sql`] for another name), next to
/// [`chosen_core::fenced::INSTALL_SQL`]:
///
/// ```sql
/// CREATE TABLE IF NOT EXISTS "chosen_ticks" (
///     job         text        NOT NULL,
///     tick        timestamptz NOT NULL,
///     token       bigint      NOT NULL CHECK (token >= 0),
///     outcome     text        NOT NULL CHECK (outcome IN ('running', 'ran', 'skipped', 'failed', 'cancelled')),
///     reason      text,
///     node        text        NOT NULL,
///     started_at  timestamptz NOT NULL,
///     finished_at timestamptz,
///     schedule    text,
///     PRIMARY KEY (job, tick)
/// )
/// ```
///
/// `job` is the job's key ([`LedgeredCronLayer::job_name`]: the lock's name, or
/// `lock/name`, in the default namespace); `token` the fencing token of the leader that wrote the row; `outcome`
/// `running` (claimed before the run, not finished: at most once, see [`Claim`]),
/// `ran`, `skipped` (with `reason`: why, see [`Misfire`]), `failed` (with the job's
/// error), `cancelled` (stopped: `max_runtime`, a newer tick, a lost lease);
/// `schedule` the cron expression the row was written under (a row under another one
/// tells the next leader that the schedule changed, so older ticks of the new schedule
/// were never due). Every row is inserted behind the lock's fence; a run's outcome is
/// then set, unfenced, by the node that claimed it. chosen never deletes rows: prune
/// old ones yourself (`DELETE … WHERE tick < now() - interval '90 days'`) if you need
/// to; ticks before the oldest row left are not looked at again. The role needs
/// `SELECT, INSERT, UPDATE` on both tables.
#[derive(Clone)]
pub struct TickLedger {
    pool: Pool,
    table: LedgerTable,
    fence: FenceTable,
    timeout: Duration,
    idle_in_transaction: Duration,
    clock_tolerance: Duration,
    /// The latest reading of the database's clock, shared by every clone.
    clock: Arc<DbClock>,
    /// The two tables with their schema, as the first statement that found both
    /// resolved them: every later statement names them so, whatever the connection's
    /// `search_path` (see [`TickLedger::resolve`]).
    resolved: Arc<RwLock<Option<(LedgerTable, FenceTable)>>>,
}

/// How much longer than the server the client waits for a ledger operation.
const CLIENT_MARGIN: Duration = Duration::from_millis(500);

/// How long a ledger operation may take unless [`TickLedger::timeout`] says otherwise.
pub const DEFAULT_LEDGER_TIMEOUT: Duration = Duration::from_secs(10);

/// How long the job's transaction may sit idle between two statements unless
/// [`TickLedger::idle_in_transaction`] says otherwise: below the time a silent leader's
/// lock session takes to end at the server (`server_release_after`, 7 s by default).
pub const DEFAULT_IDLE_IN_TRANSACTION: Duration = Duration::from_secs(5);

/// How far ahead of the database's clock a tick may run unless
/// [`TickLedger::clock_tolerance`] says otherwise.
pub const DEFAULT_CLOCK_TOLERANCE: Duration = Duration::from_secs(1);

/// The longest [`TickLedger::clock_tolerance`]; also the longest a tick delivered early
/// (this node's clock ahead of the database's) is held until it is due.
pub const MAX_EARLY_HOLD: Duration = Duration::from_secs(3600);

/// How long a record that must not wait behind a running job's transaction waits for
/// the job's fence row ([`TickLedger::record_now`]).
const QUICK_LOCK_WAIT: Duration = Duration::from_millis(250);

/// How long such a record may take in all ([`TickLedger::record_now`]).
const QUICK_RECORD: Duration = Duration::from_secs(2);

/// How long one try of [`TickLedger::install`] waits for a lock at most (the fleet's
/// ledger statements queue behind an `ALTER TABLE` that waits).
const INSTALL_LOCK_WAIT: Duration = Duration::from_secs(1);

impl fmt::Debug for TickLedger {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TickLedger")
            .field("table", &self.table.name())
            .field("fence", &self.fence.name())
            .field("timeout", &self.timeout)
            .field("idle_in_transaction", &self.idle_in_transaction)
            .field("clock_tolerance", &self.clock_tolerance)
            .finish_non_exhaustive()
    }
}

impl TickLedger {
    /// A ledger in the default tables ([`DEFAULT_LEDGER_TABLE`],
    /// [`chosen_core::fenced::DEFAULT_TABLE`]), reached through `pool`. The gate takes
    /// a connection from it per tick and gives it back before the job runs, so the job
    /// may use the same pool.
    #[must_use]
    pub fn new(pool: Pool) -> Self {
        Self {
            pool,
            table: LedgerTable::default(),
            fence: FenceTable::default(),
            timeout: DEFAULT_LEDGER_TIMEOUT,
            idle_in_transaction: DEFAULT_IDLE_IN_TRANSACTION,
            clock_tolerance: DEFAULT_CLOCK_TOLERANCE,
            clock: Arc::default(),
            resolved: Arc::default(),
        }
    }

    /// How far ahead of the database's clock a tick may run; default
    /// [`DEFAULT_CLOCK_TOLERANCE`] (1 s), at most [`MAX_EARLY_HOLD`].
    ///
    /// Whether a tick is due is decided by the database's clock
    /// (`clock_timestamp()`), never by a node's: apalis-cron delivers each tick when
    /// *this node's* clock reaches it, and a node whose clock runs ahead (an NTP step,
    /// a VM resumed with a stale offset, a container with a wrong clock) would run it
    /// early, and record the ticks before it as missed. So:
    ///
    /// 1. a tick delivered more than the tolerance before the database's clock reaches
    ///    it is held by the gate until then (on a follower too, so that it is there
    ///    if this node leads by then), for up to [`MAX_EARLY_HOLD`] beyond the
    ///    tolerance; one further ahead is not run here (`Outcome::Skipped(NotDue)`)
    ///    and left unrecorded, and a leader decides then about the ticks the database's
    ///    clock has reached, by the misfire policy (so a leader an hour or more ahead
    ///    still decides about every tick, late);
    /// 2. on gaining leadership, missed ticks are those before the database's clock;
    /// 3. the statements that claim or record a tick refuse one that is more than the
    ///    tolerance ahead of the database's clock ([`LedgerError::NotDue`]), so no path
    ///    records a future tick;
    /// 4. a node whose clock is off by more than the tolerance says so in a warning
    ///    with the offset (`offset_seconds`, positive when it is ahead), at most every
    ///    ten minutes.
    ///
    /// A node whose clock runs *behind* the database's gets each tick due while it leads
    /// late, by its offset (its scheduler fires late); the warning says so too. A tick
    /// due before it gained leadership (by the database's clock, beyond the tolerance)
    /// is a missed tick, decided by the misfire policy, even when its scheduler
    /// delivers it later (that delivery is answered
    /// `Outcome::Skipped(SkipReason::StaleTick)`), as on a node whose clock is right.
    ///
    /// A reading of the database's clock (one `SELECT clock_timestamp()` on the pool,
    /// one at a time) is carried forward on this node's monotonic clock for 30 s; a
    /// reading that fails is tried again by the next tick.
    #[must_use]
    pub fn clock_tolerance(mut self, tolerance: Duration) -> Self {
        self.clock_tolerance = tolerance.min(MAX_EARLY_HOLD);
        self
    }

    /// How far ahead of the database's clock a tick may run
    /// ([`clock_tolerance`](Self::clock_tolerance)).
    #[must_use]
    pub fn tolerance(&self) -> Duration {
        self.clock_tolerance
    }

    /// The database's clock: the latest reading if it is recent, else a new one (one
    /// round trip, bounded by the ledger's timeout). Warns when this node's wall clock
    /// is off by more than the tolerance.
    pub(crate) async fn clock(&self) -> Result<Reading, LedgerError> {
        if let Some(reading) = self.clock.fresh(tokio::time::Instant::now()) {
            return Ok(reading);
        }
        self.bounded("reading the database's clock", async {
            // One reading at a time; whoever waited for it uses it.
            let _one = self.clock.reading.lock().await;
            if let Some(reading) = self.clock.fresh(tokio::time::Instant::now()) {
                return Ok(reading);
            }
            let client = self.client().await?;
            let sent = tokio::time::Instant::now();
            // One round trip (no prepare), so that the reading's error is half of it.
            let row = client
                .query_typed("SELECT clock_timestamp()", &[])
                .await
                .map_err(self.db("reading the database's clock"))?;
            let received = tokio::time::Instant::now();
            let db: SystemTime = row
                .first()
                .and_then(|r| r.try_get::<_, Option<SystemTime>>(0).ok().flatten())
                .ok_or(LedgerError::Unexpected("clock_timestamp() gave no time"))?;
            let reading = Reading::new(db, sent, received);
            if let Some(offset) = self
                .clock
                .keep(reading, SystemTime::now(), self.clock_tolerance)
            {
                tracing::warn!(
                    offset_seconds = offset.seconds,
                    tolerance = ?self.clock_tolerance,
                    "this node's clock is off from the database's by more than the tick ledger's tolerance: ticks are run when the database's clock reaches them (held when this node's clock is ahead, late when it is behind); fix the node's clock (NTP)"
                );
            }
            Ok(reading)
        })
        .await
    }

    /// The tolerance as the statements take it (seconds).
    fn tolerance_secs(&self) -> f64 {
        self.clock_tolerance.as_secs_f64()
    }

    /// How long the job's own transaction ([`TickContext::begin`]) may sit idle between
    /// two statements before the server ends it (`SET LOCAL
    /// idle_in_transaction_session_timeout`); default [`DEFAULT_IDLE_IN_TRANSACTION`]
    /// (5 s); the gate's own transactions are bounded by it too. A leader frozen or cut
    /// off inside that transaction holds the job's fence row: the server ends its
    /// session this long after its last statement, and nothing of the transaction
    /// commits. Keep it below the time a new leader can take over after a leader goes
    /// silent, `server_release_after` less one `heartbeat_interval` (7 s − 1 s with
    /// chosen-core's defaults), so the new leader never waits for a stalled
    /// transaction; raise it (and `server_release_after`) for a job that works longer
    /// than this between two statements of its transaction. A new leader can still
    /// find the old transaction open when the old leader's lock session ended while
    /// its job's connection lived on (the server terminated that one session; or the
    /// lock manager's server failed over while the ledger is on another server: on one
    /// server, a failover ends the job's transaction too), or when the old
    /// transaction's backend is stuck sending to a dead client (it counts as active,
    /// not idle). Its tick then waits at most the ledger's [`timeout`](Self::timeout)
    /// and gives up, unrun and unrecorded (`Outcome::Skipped(Ledger)` with
    /// [`Claim::BeforeRun`]; [`TickContext::begin`] fails with [`LedgerError::Timeout`]
    /// with [`Claim::InJobTransaction`]): the misfire policy of a later tick decides
    /// about it. Taken as at least 100 ms and at most [`MAX_LEDGER_TIMEOUT`].
    #[must_use]
    pub fn idle_in_transaction(mut self, idle: Duration) -> Self {
        self.idle_in_transaction = idle.clamp(Duration::from_millis(100), MAX_LEDGER_TIMEOUT);
        self
    }

    /// How long one ledger operation of the gate (getting a connection, reading the
    /// ledger, a claim or a record with its transaction) may take, waits for row locks
    /// included; default [`DEFAULT_LEDGER_TIMEOUT`] (10 s). Past it the operation
    /// fails, the tick is skipped as `Outcome::Skipped(Ledger)` and left unrecorded, and
    /// the misfire policy of a later tick decides about it. The server enforces it too
    /// (`SET LOCAL lock_timeout, statement_timeout,
    /// idle_in_transaction_session_timeout` in the gate's transactions), so a leader
    /// frozen inside one of them holds its row locks no longer than this. In the job's
    /// own transaction ([`TickContext::begin`]) the fence's wait is bounded so (a job
    /// that waits behind a frozen former leader's fence fails after this long instead of
    /// waiting as long as that session lives), and its idle time by
    /// [`idle_in_transaction`](Self::idle_in_transaction). Taken as at least 1 ms and at most
    /// [`MAX_LEDGER_TIMEOUT`] (24 days: the server's settings take no more), so
    /// `Duration::MAX` means "as long as the server allows".
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout.clamp(Duration::from_millis(1), MAX_LEDGER_TIMEOUT);
        self
    }

    /// Another ledger table.
    ///
    /// Tables named without a schema (the default ones) are found through the
    /// connection's `search_path`: the ledger resolves both once, to what the first
    /// statement that found them saw, and names them with their schema from then on.
    /// When tables of those names exist in more than one schema it warns, naming them:
    /// a node whose `search_path` differs would use others, and run ticks again. Name
    /// the schema (`LedgerTable::new("ops.chosen_ticks")`) to rule that out.
    #[must_use]
    pub fn table(mut self, table: LedgerTable) -> Self {
        self.table = table;
        self.resolved = Arc::default();
        self
    }

    /// Another fence table (the one your own fenced writes use, if any).
    #[must_use]
    pub fn fence_table(mut self, fence: FenceTable) -> Self {
        self.fence = fence;
        self.resolved = Arc::default();
        self
    }

    /// The ledger table.
    #[must_use]
    pub fn ledger_table(&self) -> &LedgerTable {
        &self.table
    }

    /// The pool the ledger uses.
    #[must_use]
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// Creates the fence table and the ledger table if they do not exist, and brings a
    /// ledger table of an earlier version up to date ([`LedgerTable::upgrade_sql`]), in
    /// one transaction under an advisory lock, so that several nodes may install at
    /// once. Idempotent; needs the `CREATE` privilege on the schema(s).
    ///
    /// An upgrade needs the ledger table to itself for a moment, and during a rolling
    /// deploy an older node's running job may hold it in an open transaction. So each
    /// try waits at most a second (or the ledger's [`timeout`](Self::timeout), if
    /// shorter) for that lock, the fleet's ledger statements queuing behind it no
    /// longer than that, and tries again with a backoff (one warning says so) until the
    /// lock is free, for at most six ledger timeouts (a minute by default).
    ///
    /// # Errors
    ///
    /// [`LedgerError::Timeout`] when the lock stayed taken that long (retry later, or
    /// find the transaction that holds it: `pg_blocking_pids`), [`LedgerError::Pool`]
    /// or [`LedgerError::Database`].
    ///
    /// # Cancel safety
    ///
    /// Each try is one implicit transaction: it commits whole or not at all. Dropping
    /// the future does not stop a try already sent, so a dropped `install` may still
    /// have committed (or not). It is idempotent (`CREATE TABLE IF NOT EXISTS`, and an
    /// upgrade that changes nothing once done), so running it again is safe.
    pub async fn install(&self) -> Result<(), LedgerError> {
        let patience = self.timeout.saturating_mul(6);
        let timed_out = || LedgerError::Timeout {
            action: "install (the ledger table stayed locked by another transaction)",
            after: patience,
        };
        // The client's own bound too: a pool that gives no connection, or a connection
        // that went silent, must not hold the start-up for ever.
        tokio::time::timeout(
            patience.saturating_add(CLIENT_MARGIN),
            self.install_tries(patience),
        )
        .await
        .unwrap_or_else(|_| Err(timed_out()))
    }

    async fn install_tries(&self, patience: Duration) -> Result<(), LedgerError> {
        let client = self.pool.get().await.map_err(LedgerError::Pool)?;
        let LockKey::Pair(k1, k2) = LockKey::derive("chosen.apalis", "install") else {
            unreachable!("BUG: derived keys are pairs")
        };
        let tables = self.tables();
        let wait = self.timeout.min(INSTALL_LOCK_WAIT);
        // One simple query, so one implicit transaction that commits on the server with
        // no round trip after the `ALTER TABLE` took its lock (a client frozen there
        // would hold it, and every ledger statement of the fleet behind it). The
        // `SET LOCAL` holds for the rest of it.
        let sql = format!(
            "SET LOCAL lock_timeout = {ms};\nSELECT pg_advisory_xact_lock({k1}, {k2});\n{};\n{};\n{}",
            tables.fence.install_sql(),
            tables.ledger.install_sql(),
            tables.ledger.upgrade_sql(),
            ms = wait.as_millis().max(1),
        );
        let started = std::time::Instant::now();
        let mut backoff = Duration::from_millis(50);
        let (mut duplicates, mut waits) = (0, 0);
        loop {
            let source = match client.batch_execute(&sql).await {
                Ok(()) => {
                    // Named with their schemas from now on (and warned about if nodes
                    // whose search_path differs would find others).
                    self.resolve(&**client).await;
                    return Ok(());
                }
                Err(e) => e,
            };
            // Created at the same moment by someone not taking the lock (a migration
            // tool): it exists now.
            if duplicates < 3 && is_duplicate(&source) {
                duplicates += 1;
                continue;
            }
            if source.code() != Some(&SqlState::LOCK_NOT_AVAILABLE) {
                return Err(LedgerError::Database {
                    action: "install",
                    source,
                });
            }
            if started.elapsed() + backoff + wait >= patience {
                return Err(LedgerError::Timeout {
                    action: "install (the ledger table stayed locked by another transaction)",
                    after: patience,
                });
            }
            if waits == 0 {
                tracing::warn!(
                    table = self.table.name(),
                    "the tick ledger's upgrade waits for a lock another transaction holds (an older node's running job?); retrying"
                );
            }
            waits += 1;
            tokio::time::sleep(backoff).await;
            backoff = backoff.saturating_mul(2).min(Duration::from_secs(2));
        }
    }

    async fn client(&self) -> Result<deadpool_postgres::Client, LedgerError> {
        let client = self.pool.get().await.map_err(LedgerError::Pool)?;
        self.resolve(&**client).await;
        Ok(client)
    }

    /// The two tables as a transaction names them: with their schema once resolved.
    /// Read once per transaction, so that a resolution changing meanwhile cannot split
    /// one transaction over two schemas.
    pub(crate) fn tables(&self) -> Tables {
        let resolved = self.resolved.read().unwrap_or_else(PoisonError::into_inner);
        let (ledger, fence) = resolved
            .as_ref()
            .map_or((&self.table, &self.fence), |(t, f)| (t, f));
        Tables {
            ledger: ledger.clone(),
            fence: fence.clone(),
        }
    }

    /// Forgets the resolution (a table was found missing): resolved again next time.
    fn unresolve(&self) {
        *self
            .resolved
            .write()
            .unwrap_or_else(PoisonError::into_inner) = None;
    }

    /// Resolves the two tables to the ones `search_path` finds on `client`, once (both
    /// must exist), so that every later statement of this ledger, on any connection,
    /// names the same two (until a statement finds one missing: they are resolved
    /// again). Warns when an unqualified name has tables in more than one schema: a
    /// node whose `search_path` differs would use others, and a new leader that does
    /// not see the old leader's rows runs their ticks again. A failure leaves the names
    /// as given (the statements then say what is wrong).
    pub(crate) async fn resolve(&self, client: &impl tokio_postgres::GenericClient) {
        if self
            .resolved
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some()
        {
            return;
        }
        let (ledger, fence) = (self.table.name(), self.fence.name());
        let last = |name: &'static str, column: &'static str| {
            format!(
                "(SELECT {column} FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = to_regclass({name}))"
            )
        };
        let all = |name: &'static str| {
            format!(
                "ARRAY(SELECT format('%s.%s', n.nspname, c.relname) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.relname = {name} AND c.relkind IN ('r', 'p') ORDER BY 1)"
            )
        };
        let sql = format!(
            "SELECT {}, {}, {}, {}, {}, {}",
            last("$1", "n.nspname::text"),
            last("$1", "c.relname::text"),
            last("$2", "n.nspname::text"),
            last("$2", "c.relname::text"),
            all("$3"),
            all("$4")
        );
        let quote = |name: &str| {
            name.split('.')
                .map(|p| format!("\"{p}\""))
                .collect::<Vec<_>>()
                .join(".")
        };
        let relname = |name: &str| name.rsplit('.').next().unwrap_or(name).to_owned();
        let rows = match client
            .query_typed(
                &sql,
                &[
                    (&quote(ledger), Type::TEXT),
                    (&quote(fence), Type::TEXT),
                    (&relname(ledger), Type::NAME),
                    (&relname(fence), Type::NAME),
                ],
            )
            .await
        {
            Ok(rows) => rows,
            Err(e) => {
                tracing::debug!(error = %e, "could not resolve the tick ledger's tables; using their names as given");
                return;
            }
        };
        let Some(row) = rows.first() else { return };
        let text = |i| row.try_get::<_, Option<String>>(i).ok().flatten();
        let list = |i| {
            row.try_get::<_, Option<Vec<Option<String>>>>(i)
                .ok()
                .flatten()
                .unwrap_or_default()
                .into_iter()
                .flatten()
                .collect::<Vec<_>>()
        };
        let (Some(ledger_schema), Some(ledger_name), Some(fence_schema), Some(fence_name)) =
            (text(0), text(1), text(2), text(3))
        else {
            return; // not installed (yet): looked for again next time
        };
        // Quoted as written: a schema with capitals, spaces or quotes is one too.
        let (Ok(ledger_table), Ok(fence_table)) = (
            LedgerTable::in_schema(&ledger_schema, &ledger_name),
            FenceTable::in_schema(&fence_schema, &fence_name),
        ) else {
            return;
        };
        for (given, found, all) in [
            (ledger, ledger_table.name(), list(4)),
            (fence, fence_table.name(), list(5)),
        ] {
            if !given.contains('.') && all.len() > 1 {
                tracing::warn!(
                    table = given,
                    using = %found,
                    found = ?all,
                    "tables of this name exist in several schemas: this node uses the first on its search_path, and a node whose search_path differs would use another, and run ticks again; name the schema (LedgerTable::new(\"schema.table\"), FenceTable::new(\"schema.table\"))"
                );
            }
        }
        // The first resolution wins: two at once, on connections whose search_path
        // differs, must not each set theirs.
        self.resolved
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .get_or_insert((ledger_table, fence_table));
    }

    fn db(&self, action: &'static str) -> impl FnOnce(tokio_postgres::Error) -> LedgerError + '_ {
        move |source| {
            if source.code().is_some_and(is_timeout) {
                LedgerError::Timeout {
                    action,
                    after: self.timeout,
                }
            } else if source.code() == Some(&SqlState::UNDEFINED_TABLE) {
                // Dropped or moved since it was resolved: resolved again next time.
                self.unresolve();
                LedgerError::NotInstalled {
                    table: self.table.name().to_owned(),
                    source,
                }
            } else {
                LedgerError::Database { action, source }
            }
        }
    }

    /// Runs `op` within the ledger's timeout. The client waits a little longer than
    /// the server (whose own bounds end a waiting statement first), so that a pooled
    /// connection is seldom given back with a statement still running on it.
    pub(crate) async fn bounded<T>(
        &self,
        action: &'static str,
        op: impl Future<Output = Result<T, LedgerError>>,
    ) -> Result<T, LedgerError> {
        let limit = self.timeout.saturating_add(CLIENT_MARGIN);
        match tokio::time::timeout(limit, op).await {
            Ok(result) => result,
            Err(_) => Err(LedgerError::Timeout {
                action,
                after: self.timeout,
            }),
        }
    }

    /// The ledger's timeout in milliseconds, as the server's settings take it.
    fn timeout_ms(&self) -> u128 {
        self.timeout.as_millis().max(1)
    }

    /// A transaction of the gate's own, bounded by the ledger's timeout on the server
    /// (`lock_timeout`, `statement_timeout`, `idle_in_transaction_session_timeout`), so
    /// that the server ends a wait even when the client is frozen or gone.
    async fn bounded_transaction<'c>(
        &self,
        client: &'c mut deadpool_postgres::Client,
    ) -> Result<deadpool_postgres::Transaction<'c>, LedgerError> {
        let tx = client
            .transaction()
            .await
            .map_err(self.db("beginning a transaction"))?;
        let ms = self.timeout_ms();
        // Idle no longer than the job's own transaction may be: a leader frozen inside
        // one of these holds the job's fence row no longer either.
        let idle = self
            .idle_in_transaction
            .min(self.timeout)
            .as_millis()
            .max(1);
        tx.batch_execute(&format!(
            "SET LOCAL lock_timeout = {ms};\nSET LOCAL statement_timeout = {ms};\nSET LOCAL idle_in_transaction_session_timeout = {idle}"
        ))
        .await
        .map_err(self.db("bounding the transaction"))?;
        Ok(tx)
    }

    /// Fences `tx` for `ids`, waiting for the fence row at most the ledger's timeout,
    /// whatever the transaction's own `lock_timeout` (which is left as it was), and
    /// bounds the transaction's idle time ([`TickLedger::idle_in_transaction`]).
    pub(crate) async fn fence_bounded(
        &self,
        tx: &tokio_postgres::Transaction<'_>,
        ids: &JobIds,
        token: FencingToken,
    ) -> Result<Tables, LedgerError> {
        let previous: String = tx
            .query_one(
                "WITH p AS MATERIALIZED (SELECT current_setting('lock_timeout') AS v)\nSELECT p.v FROM p WHERE set_config('lock_timeout', $1, true) IS NOT NULL AND set_config('idle_in_transaction_session_timeout', $2, true) IS NOT NULL",
                &[
                    &self.timeout_ms().to_string(),
                    &self.idle_in_transaction.as_millis().max(1).to_string(),
                ],
            )
            .await
            .map_err(self.db("bounding the fence's lock wait"))?
            .try_get(0)
            .map_err(self.db("bounding the fence's lock wait"))?;
        self.resolve(tx).await;
        let tables = self.tables();
        tables
            .fence
            .fence(tx, &ids.fence, token)
            .await
            .map_err(|e| self.fence_error(e, "fencing"))?;
        tx.execute("SELECT set_config('lock_timeout', $1, true)", &[&previous])
            .await
            .map_err(self.db("restoring lock_timeout"))?;
        Ok(tables)
    }

    /// A fence error as a ledger error: a lock wait the server ended is a timeout.
    pub(crate) fn fence_error(&self, e: chosen_core::Error, action: &'static str) -> LedgerError {
        if matches!(e, chosen_core::Error::FenceNotInstalled { .. }) {
            // Dropped or moved since it was resolved: resolved again next time.
            self.unresolve();
        }
        let timed_out = std::error::Error::source(&e)
            .and_then(|s| s.downcast_ref::<tokio_postgres::Error>())
            .and_then(tokio_postgres::Error::code)
            .is_some_and(is_timeout);
        if timed_out {
            LedgerError::Timeout {
                action,
                after: self.timeout,
            }
        } else {
            LedgerError::Fence(e)
        }
    }

    /// What the ledger holds for the job of `ids` around the ticks looked at
    /// (`candidates`, newest first, all in `[from, upto)` with `from` the oldest): its
    /// first tick ever recorded; which candidates have a row, whatever its outcome; the
    /// other schedule texts rows in `[from, upto)` were recorded under, with the newest
    /// row of each; and the newest row before `from` with its schedule (the schedule may
    /// have changed: see [`plan::missed`]). One statement, in a bounded transaction.
    pub(crate) async fn recorded(
        &self,
        ids: &JobIds,
        candidates: &[u64],
        upto: u64,
    ) -> Result<Recorded, LedgerError> {
        let Some(&from) = candidates.last() else {
            return Ok(Recorded::default());
        };
        let looked_at: Vec<SystemTime> = candidates.iter().map(|t| at(*t)).collect();
        self.bounded("reading the recorded ticks", async {
            let mut client = self.client().await?;
            let tx = self.bounded_transaction(&mut client).await?;
            let rows = tx
                .query_typed(
                    &format!(
                        "WITH w AS MATERIALIZED (SELECT tick, schedule FROM {t} WHERE job = $1 AND tick >= $2 AND tick < $3),\n     o AS MATERIALIZED (SELECT schedule, max(tick) AS newest FROM w WHERE schedule <> $4 GROUP BY schedule),\n     u AS MATERIALIZED (SELECT max(tick) AS newest FROM w WHERE schedule IS NULL AND tick <> ALL ($5::timestamptz[])),\n     b AS MATERIALIZED (SELECT tick, schedule FROM {t} WHERE job = $1 AND tick < $2 ORDER BY tick DESC LIMIT 1)\nSELECT (SELECT min(tick) FROM {t} WHERE job = $1),\n       ARRAY(SELECT tick FROM w WHERE tick = ANY ($5::timestamptz[])),\n       ARRAY(SELECT schedule FROM o ORDER BY schedule),\n       ARRAY(SELECT newest FROM o ORDER BY schedule),\n       (SELECT tick FROM b),\n       (SELECT schedule FROM b),\n       (SELECT newest FROM u)",
                        t = self.tables().ledger.quoted
                    ),
                    &[
                        (&&*ids.job, Type::TEXT),
                        (&at(from), Type::TIMESTAMPTZ),
                        (&at(upto), Type::TIMESTAMPTZ),
                        (&ids.schedule.as_deref(), Type::TEXT),
                        (&looked_at, Type::TIMESTAMPTZ_ARRAY),
                    ],
                )
                .await
                .map_err(self.db("reading the recorded ticks"))?;
            tx.commit()
                .await
                .map_err(self.db("reading the recorded ticks"))?;
            let Some(row) = rows.first() else {
                return Ok(Recorded::default());
            };
            let read = || self.db("reading the recorded ticks");
            let first = row
                .try_get::<_, Option<SystemTime>>(0)
                .map_err(read())?
                .map(secs);
            let ticks = row
                .try_get::<_, Option<Vec<Option<SystemTime>>>>(1)
                .map_err(read())?
                .unwrap_or_default()
                .into_iter()
                .flatten()
                .map(secs)
                .collect();
            let texts = row
                .try_get::<_, Option<Vec<Option<String>>>>(2)
                .map_err(read())?
                .unwrap_or_default();
            let newest = row
                .try_get::<_, Option<Vec<Option<SystemTime>>>>(3)
                .map_err(read())?
                .unwrap_or_default();
            let rescheduled = texts
                .into_iter()
                .zip(newest)
                .filter_map(|(text, newest)| Some((text?, secs(newest?))))
                .collect();
            let below = row
                .try_get::<_, Option<SystemTime>>(4)
                .map_err(read())?
                .map(|tick| {
                    let text = row.try_get::<_, Option<String>>(5).ok().flatten();
                    (secs(tick), text)
                });
            let unscheduled = row
                .try_get::<_, Option<SystemTime>>(6)
                .map_err(read())?
                .map(secs);
            Ok(Recorded {
                first,
                ticks,
                rescheduled,
                unscheduled,
                below,
            })
        })
        .await
    }

    /// [`record`](Self::record), waiting for the job's fence row a moment only
    /// ([`QUICK_LOCK_WAIT`]), and for all of it [`QUICK_RECORD`] at most:
    /// `LedgerError::Timeout` when a transaction of the job holds the row (or the pool
    /// or the server is slow).
    pub(crate) async fn record_now(
        &self,
        ids: &JobIds,
        token: FencingToken,
        outcome: &str,
        ticks: &[(u64, &str)],
    ) -> Result<usize, LedgerError> {
        // The whole of it bounded so too: the answer of the tick it records waits.
        tokio::time::timeout(
            QUICK_RECORD,
            self.record_waiting(ids, token, outcome, ticks, QUICK_LOCK_WAIT),
        )
        .await
        .unwrap_or(Err(LedgerError::Timeout {
            action: "recording ticks",
            after: QUICK_RECORD,
        }))
    }

    /// Records finished ticks (`outcome` with a reason each) in one fenced
    /// transaction; ticks already recorded keep their row. Answers how many of them
    /// were not recorded because the database's clock has not reached them (less the
    /// tolerance): none unless that clock went back.
    pub(crate) async fn record(
        &self,
        ids: &JobIds,
        token: FencingToken,
        outcome: &str,
        ticks: &[(u64, &str)],
    ) -> Result<usize, LedgerError> {
        self.record_waiting(ids, token, outcome, ticks, self.timeout)
            .await
    }

    async fn record_waiting(
        &self,
        ids: &JobIds,
        token: FencingToken,
        outcome: &str,
        ticks: &[(u64, &str)],
        lock_wait: Duration,
    ) -> Result<usize, LedgerError> {
        self.bounded("recording ticks", async {
            let mut client = self.client().await?;
            let tx = self.bounded_transaction(&mut client).await?;
            if lock_wait < self.timeout {
                tx.batch_execute(&format!(
                    "SET LOCAL lock_timeout = {}",
                    lock_wait.as_millis().max(1)
                ))
                .await
                .map_err(self.db("bounding the fence's lock wait"))?;
            }
            let tables = self.tables();
            tables
                .fence
                .fence(&tx, &ids.fence, token)
                .await
                .map_err(|e| self.fence_error(e, "fencing"))?;
            let when: Vec<SystemTime> = ticks.iter().map(|(t, _)| at(*t)).collect();
            let why: Vec<String> = ticks.iter().map(|(_, r)| storable(r)).collect();
            // Only ticks the database's clock has reached (less the tolerance): no path
            // records a future tick, whatever this node's clock says.
            let rows = tx
                .query_typed(
                    &format!(
                        "WITH d AS MATERIALIZED (SELECT clock_timestamp() + $8::float8 * interval '1 second' AS due),\n     u AS MATERIALIZED (SELECT * FROM unnest($2::timestamptz[], $6::text[]) AS u(tick, reason)),\n     i AS (INSERT INTO {} (job, tick, token, outcome, reason, node, started_at, finished_at, schedule)\n           SELECT $1, u.tick, $3, $4, u.reason, $5, clock_timestamp(), clock_timestamp(), $7 FROM u, d WHERE u.tick <= d.due\n           ON CONFLICT (job, tick) DO NOTHING)\nSELECT count(*) FROM u, d WHERE u.tick > d.due",
                        tables.ledger.quoted
                    ),
                    &[
                        (&&*ids.job, Type::TEXT),
                        (&when, Type::TIMESTAMPTZ_ARRAY),
                        (&token_value(token)?, Type::INT8),
                        (&outcome, Type::TEXT),
                        (&&*ids.node, Type::TEXT),
                        (&why, Type::TEXT_ARRAY),
                        (&ids.schedule.as_deref(), Type::TEXT),
                        (&self.tolerance_secs(), Type::FLOAT8),
                    ],
                )
                .await
                .map_err(self.db("recording ticks"))?;
            let not_due = rows
                .first()
                .and_then(|r| r.try_get::<_, Option<i64>>(0).ok().flatten())
                .unwrap_or(0);
            if not_due > 0 {
                tracing::warn!(
                    job = %ids.job,
                    not_due,
                    "ticks ahead of the database's clock were not recorded: they are not due yet"
                );
            }
            tx.commit().await.map_err(self.db("committing"))?;
            Ok(usize::try_from(not_due).unwrap_or(0))
        })
        .await
    }

    /// Claims `tick` with outcome `running`, in a fenced transaction of its own: the
    /// tables it was claimed in, or `None` if it is already recorded.
    ///
    /// When the COMMIT of a claim that inserted its row goes unanswered (the connection
    /// lost while the server commits, the client-side bound firing), the row is read
    /// back until the ledger's timeout ([`claim_committed`](Self::claim_committed)):
    /// the claim's own row means it committed. A claim that cannot be told so is
    /// reported: if it committed, its row stays `running` and the tick does not run.
    pub(crate) async fn claim_before_run(
        &self,
        ids: &JobIds,
        tick: u64,
        token: FencingToken,
    ) -> Result<Option<Tables>, LedgerError> {
        // The claim's transaction id and tables, once its COMMIT is on its way; and
        // whether the COMMIT's failure came with the server's answer that it did not
        // commit (an error, not the session's end).
        let committing: std::sync::Mutex<Option<(String, Tables)>> = std::sync::Mutex::default();
        let answered = std::sync::atomic::AtomicBool::new(false);
        let claimed = self
            .bounded("claiming the tick", async {
                let mut client = self.client().await?;
                let tx = self.bounded_transaction(&mut client).await?;
                let tables = self.tables();
                tables
                    .fence
                    .fence(&tx, &ids.fence, token)
                    .await
                    .map_err(|e| self.fence_error(e, "fencing"))?;
                let claim = self
                    .claim_in(&tx, &tables, ids, tick, token, "running")
                    .await?;
                let Some(xact) = claim.xact.filter(|_| claim.inserted) else {
                    return Ok(None);
                };
                *committing.lock().unwrap_or_else(PoisonError::into_inner) =
                    Some((xact, tables.clone()));
                match tx.commit().await {
                    Ok(()) => Ok(Some(tables)),
                    Err(e) => {
                        answered.store(
                            e.as_db_error().is_some() && !context::session_ended(&e),
                            std::sync::atomic::Ordering::Relaxed,
                        );
                        Err(self.db("committing the claim")(e))
                    }
                }
            })
            .await;
        let committing = committing
            .into_inner()
            .unwrap_or_else(PoisonError::into_inner);
        match (claimed, committing) {
            (Err(lost), Some((xact, tables)))
                if !answered.load(std::sync::atomic::Ordering::Relaxed) =>
            {
                let ours = self
                    .claim_committed(ids, (tick, token), &xact, &tables, lost)
                    .await?;
                Ok(ours.then_some(tables))
            }
            (claimed, _) => claimed,
        }
    }

    /// Whether the claim of `tick` by the transaction `xact`, whose COMMIT went
    /// unanswered (`lost`), committed: `Ok(true)` when the row is there, written by that
    /// transaction (its `xmin`) with this node and token; `Ok(false)` when another's row
    /// is there (ours did not commit); `Err(lost)` when it did not commit. The row
    /// decides, not the transaction id alone: after a crash, or on a promoted standby,
    /// an id whose commit was never flushed is handed out again, and its status then
    /// says "committed" for another transaction. While the row is not there the id's
    /// status tells whether to wait (still in progress) or stop. Looked at until the
    /// ledger's timeout.
    async fn claim_committed(
        &self,
        ids: &JobIds,
        (tick, token): (u64, FencingToken),
        xact: &str,
        tables: &Tables,
        lost: LedgerError,
    ) -> Result<bool, LedgerError> {
        let xmin = xact.parse::<u64>().ok().map(|x| x & 0xffff_ffff);
        let token = token_value(token)?;
        let deadline = tokio::time::Instant::now() + self.timeout;
        let mut backoff = Duration::from_millis(50);
        let mut saw_committed = false;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let looked = tokio::time::timeout(left, async {
                let client = self.client().await?;
                let row = client
                    .query_typed(
                        &format!(
                            "SELECT xmin::text, token, node FROM {} WHERE job = $1 AND tick = $2",
                            tables.ledger.quoted
                        ),
                        &[(&&*ids.job, Type::TEXT), (&at(tick), Type::TIMESTAMPTZ)],
                    )
                    .await
                    .map_err(self.db("reading the claim back"))?;
                if let Some(row) = row.first() {
                    let ours = row
                        .try_get::<_, Option<String>>(0)
                        .ok()
                        .flatten()
                        .and_then(|x| x.parse::<u64>().ok())
                        == xmin
                        && row.try_get::<_, Option<i64>>(1).ok().flatten() == Some(token)
                        && row
                            .try_get::<_, Option<String>>(2)
                            .ok()
                            .flatten()
                            .as_deref()
                            == Some(&*ids.node);
                    return Ok(Looked::Row(ours));
                }
                match client
                    .query_typed(
                        "SELECT pg_xact_status($1::text::xid8)",
                        &[(&xact, Type::TEXT)],
                    )
                    .await
                {
                    Ok(rows) => {
                        Ok(Looked::Status(rows.first().and_then(|r| {
                            r.try_get::<_, Option<String>>(0).ok().flatten()
                        })))
                    }
                    // "In the future": the id was never flushed (a crash since).
                    Err(e) if e.code() == Some(&SqlState::INVALID_PARAMETER_VALUE) => {
                        Ok(Looked::Status(None))
                    }
                    Err(e) => Err(self.db("looking up the claim's transaction")(e)),
                }
            })
            .await;
            match looked {
                Ok(Ok(Looked::Row(ours))) => {
                    tracing::info!(job = %ids.job, tick, ours, error = %chain(&lost), "the claim's commit went unanswered; its row was read back");
                    return Ok(ours);
                }
                Ok(Ok(Looked::Status(Some(status)))) if status == "in progress" => {}
                // Committed, yet no row a moment ago: read it again once, then the id
                // is another transaction's.
                Ok(Ok(Looked::Status(Some(status)))) if status == "committed" && !saw_committed => {
                    saw_committed = true;
                    continue;
                }
                Ok(Ok(Looked::Status(_))) => return Err(lost),
                Ok(Err(_)) | Err(_) => {}
            }
            if tokio::time::Instant::now() + backoff >= deadline {
                tracing::warn!(job = %ids.job, tick, error = %chain(&lost), "could not tell whether the claim committed: if it did, its row stays 'running' and the tick does not run");
                return Err(lost);
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(1));
        }
    }

    /// Inserts the claim row in `tx`, in `tables.ledger`: not inserted if the tick is
    /// already recorded.
    pub(crate) async fn claim_in(
        &self,
        tx: &tokio_postgres::Transaction<'_>,
        tables: &Tables,
        ids: &JobIds,
        tick: u64,
        token: FencingToken,
        outcome: &str,
    ) -> Result<Inserted, LedgerError> {
        // The tick is claimed only once the database's clock has reached it (less the
        // tolerance): `due` is false, and nothing inserted, for a future tick.
        let rows = tx
            .query_typed(
                &format!(
                    "WITH d AS MATERIALIZED (SELECT $2::timestamptz - clock_timestamp() AS ahead, $7::float8 * interval '1 second' AS tolerance),\n     i AS (INSERT INTO {} (job, tick, token, outcome, node, started_at, schedule)\n           SELECT $1, $2, $3, $4, $5, clock_timestamp(), $6 FROM d WHERE d.ahead <= d.tolerance\n           ON CONFLICT (job, tick) DO NOTHING\n           RETURNING 1)\nSELECT d.ahead <= d.tolerance, extract(epoch FROM d.ahead)::float8, EXISTS (SELECT 1 FROM i),\n       CASE WHEN EXISTS (SELECT 1 FROM i) THEN pg_current_xact_id()::text END\nFROM d",
                    tables.ledger.quoted
                ),
                &[
                    (&&*ids.job, Type::TEXT),
                    (&at(tick), Type::TIMESTAMPTZ),
                    (&token_value(token)?, Type::INT8),
                    (&outcome, Type::TEXT),
                    (&&*ids.node, Type::TEXT),
                    (&ids.schedule.as_deref(), Type::TEXT),
                    (&self.tolerance_secs(), Type::FLOAT8),
                ],
            )
            .await
            .map_err(self.db("claiming the tick"))?;
        let row = rows
            .first()
            .ok_or(LedgerError::Unexpected("the claim statement gave no row"))?;
        let answer = |i| {
            row.try_get::<_, Option<bool>>(i)
                .ok()
                .flatten()
                .ok_or(LedgerError::Unexpected("the claim statement gave NULL"))
        };
        let (due, inserted) = (answer(0)?, answer(2)?);
        if !due {
            let ahead = row
                .try_get::<_, Option<f64>>(1)
                .ok()
                .flatten()
                .unwrap_or(0.0);
            return Err(LedgerError::NotDue {
                tick: at(tick),
                early: Duration::try_from_secs_f64(ahead).unwrap_or_default(),
                tolerance: self.clock_tolerance,
            });
        }
        Ok(Inserted {
            inserted,
            xact: row.try_get::<_, Option<String>>(3).ok().flatten(),
        })
    }

    /// The statement that sets the outcome of a tick this leader claimed: `$1` job,
    /// `$2` tick, `$3` token, `$4` outcome (NULL: keep), `$5` reason (NULL: keep).
    pub(crate) fn finish_sql(tables: &Tables) -> String {
        format!(
            "UPDATE {} SET outcome = coalesce($4, outcome), reason = coalesce($5, reason), finished_at = clock_timestamp()\nWHERE job = $1 AND tick = $2 AND token = $3",
            tables.ledger.quoted
        )
    }

    /// Sets the outcome of a tick this leader claimed before the run: `false` if no
    /// such row (not our claim).
    pub(crate) async fn finish(
        &self,
        tables: &Tables,
        job: &str,
        tick: u64,
        token: FencingToken,
        outcome: &str,
        reason: Option<&str>,
    ) -> Result<bool, LedgerError> {
        let reason = reason.map(storable);
        self.bounded(
            "recording the outcome",
            self.finish_unbounded(tables, job, tick, token, outcome, reason.as_deref()),
        )
        .await
    }

    async fn finish_unbounded(
        &self,
        tables: &Tables,
        job: &str,
        tick: u64,
        token: FencingToken,
        outcome: &str,
        reason: Option<&str>,
    ) -> Result<bool, LedgerError> {
        let mut client = self.client().await?;
        let tx = self.bounded_transaction(&mut client).await?;
        let n = tx
            .execute_typed(
                &Self::finish_sql(tables),
                &[
                    (&job, Type::TEXT),
                    (&at(tick), Type::TIMESTAMPTZ),
                    (&token_value(token)?, Type::INT8),
                    (&Some(outcome), Type::TEXT),
                    (&reason, Type::TEXT),
                ],
            )
            .await
            .map_err(self.db("recording the outcome"))?;
        tx.commit()
            .await
            .map_err(self.db("committing the outcome"))?;
        Ok(n == 1)
    }
}

/// The ledger and fence tables one transaction uses ([`TickLedger::tables`]).
#[derive(Debug, Clone)]
pub(crate) struct Tables {
    pub(crate) ledger: LedgerTable,
    pub(crate) fence: FenceTable,
}

/// What a look at an unanswered claim found.
enum Looked {
    /// The tick's row, and whether it is the claim's.
    Row(bool),
    /// No row; the claim's transaction's status (`None`: unknown to the server).
    Status(Option<String>),
}

/// What a claim's insert did.
#[derive(Debug)]
pub(crate) struct Inserted {
    /// The row was inserted (else the tick is already recorded).
    pub(crate) inserted: bool,
    /// The claiming transaction's id (`pg_current_xact_id()`), when inserted.
    pub(crate) xact: Option<String>,
}

/// Who writes a job's rows: the job's name in the ledger, the fence name (the lock's:
/// fencing tokens are the lock's), this node, and the schedule's source text.
#[derive(Debug, Clone)]
pub(crate) struct JobIds {
    pub(crate) job: Arc<str>,
    pub(crate) fence: Arc<str>,
    pub(crate) node: Arc<str>,
    pub(crate) schedule: Option<Arc<str>>,
}

/// The longest ledger timeout: the server's settings take at most `i32::MAX` ms.
pub const MAX_LEDGER_TIMEOUT: Duration = Duration::from_secs(24 * 24 * 3600);

/// A reason as `text` can store it: no NUL, at most 2,000 characters.
fn storable(reason: &str) -> String {
    const MAX: usize = 2000;
    let mut text: String = reason.replace('\0', "\u{fffd}");
    if text.chars().count() > MAX {
        text = text.chars().take(MAX - 1).collect();
        text.push('…');
    }
    text
}

/// `true` for the server's lock or statement timeout.
fn is_timeout(code: &SqlState) -> bool {
    *code == SqlState::LOCK_NOT_AVAILABLE
        || *code == SqlState::QUERY_CANCELED
        || *code == SqlState::IDLE_IN_TRANSACTION_SESSION_TIMEOUT
}

pub(crate) fn token_value(token: FencingToken) -> Result<i64, LedgerError> {
    i64::try_from(token.get())
        .map_err(|_| LedgerError::Fence(chosen_core::Error::TokenOutOfRange(token)))
}

/// A tick (Unix seconds) as the server's `timestamptz`.
pub(crate) fn at(tick: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(tick)
}

/// A `timestamptz` back to Unix seconds (ticks are whole seconds).
fn secs(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

fn is_duplicate(e: &tokio_postgres::Error) -> bool {
    e.code().is_some_and(|c| {
        *c == SqlState::UNIQUE_VIOLATION
            || *c == SqlState::DUPLICATE_TABLE
            || *c == SqlState::DUPLICATE_OBJECT
            || *c == SqlState::DUPLICATE_COLUMN
    })
}

/// A ledger table: its (validated) name and the SQL that creates it.
///
/// ```
/// use chosen_apalis::LedgerTable;
///
/// let table = LedgerTable::new("ops.chosen_ticks")?;
/// assert_eq!(table.name(), "ops.chosen_ticks");
/// assert!(table.install_sql().starts_with("CREATE TABLE IF NOT EXISTS \"ops\".\"chosen_ticks\""));
/// assert!(LedgerTable::new("ops.Chosen Ticks").is_err());
/// # Ok::<(), chosen_apalis::LedgerError>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LedgerTable {
    name: String,
    quoted: String,
}

impl Default for LedgerTable {
    /// [`DEFAULT_LEDGER_TABLE`], in the schema first on the `search_path`.
    fn default() -> Self {
        Self {
            name: DEFAULT_LEDGER_TABLE.to_owned(),
            quoted: format!("\"{DEFAULT_LEDGER_TABLE}\""),
        }
    }
}

impl LedgerTable {
    /// A ledger table named `table` or `schema.table`; each part a lowercase SQL
    /// identifier (an ASCII letter or `_`, then letters, digits or `_`, at most 63
    /// bytes). Always quoted in SQL, so reserved words work.
    ///
    /// # Errors
    ///
    /// [`LedgerError::InvalidTableName`], saying what is wrong.
    pub fn new(name: &str) -> Result<Self, LedgerError> {
        // The same rules as the fence table's: reuse them, and say "ledger" in the error.
        FenceTable::new(name).map_err(|e| match e {
            chosen_core::Error::InvalidTableName(why) => LedgerError::InvalidTableName(why),
            other => LedgerError::InvalidTableName(other.to_string()),
        })?;
        let quoted = name
            .split('.')
            .map(|p| format!("\"{p}\""))
            .collect::<Vec<_>>()
            .join(".");
        Ok(Self {
            name: name.to_owned(),
            quoted,
        })
    }

    /// A ledger table `table` in the schema `schema`, each any identifier PostgreSQL
    /// takes (capitals, spaces, quotes and all: quoted as written), not only the
    /// lowercase ones [`new`](Self::new) accepts.
    ///
    /// ```
    /// use chosen_apalis::LedgerTable;
    ///
    /// let table = LedgerTable::in_schema("Ops", "chosen_ticks")?;
    /// assert!(table.install_sql().starts_with("CREATE TABLE IF NOT EXISTS \"Ops\".\"chosen_ticks\""));
    /// # Ok::<(), chosen_apalis::LedgerError>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`LedgerError::InvalidTableName`] for an empty part, one longer than 63 bytes,
    /// or one with a NUL character.
    pub fn in_schema(schema: &str, table: &str) -> Result<Self, LedgerError> {
        // The same rules as the fence table's, and the same quoting.
        let fence = FenceTable::in_schema(schema, table).map_err(|e| match e {
            chosen_core::Error::InvalidTableName(why) => LedgerError::InvalidTableName(why),
            other => LedgerError::InvalidTableName(other.to_string()),
        })?;
        Ok(Self {
            name: fence.name().to_owned(),
            quoted: fence.quoted().to_owned(),
        })
    }

    /// The table name as given (unquoted).
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The SQL that brings a table created by an earlier version of this crate up to
    /// date (idempotent; [`TickLedger::install`] runs it too): a table from before the
    /// `schedule` column gets it. Its `ALTER TABLE` needs the table to itself for a
    /// moment, and every statement on the table queues behind it while it waits: run it
    /// with a short `lock_timeout` (`SET LOCAL lock_timeout = '1s'`) and retry, as
    /// `install` does.
    #[must_use]
    pub fn upgrade_sql(&self) -> String {
        // Only when the column is missing: `ALTER TABLE` locks the table exclusively
        // even when there is nothing to add, and would wait behind (and then hold up)
        // every job's ledger transaction on every node.
        let literal = self.quoted.replace('\'', "''");
        format!(
            "DO $chosen$ BEGIN\n  IF NOT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = '{literal}'::regclass AND attname = 'schedule' AND NOT attisdropped) THEN\n    ALTER TABLE {} ADD COLUMN IF NOT EXISTS schedule text;\n  END IF;\nEND $chosen$",
            self.quoted
        )
    }

    /// The SQL that creates this table if it does not exist, for teams that run their
    /// own migrations.
    #[must_use]
    pub fn install_sql(&self) -> String {
        // Do not change the shape: tables created by earlier versions must keep working.
        LEDGER_INSTALL_SQL.replacen("\"chosen_ticks\"", &self.quoted, 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_table_s_sql_is_the_published_constant() {
        assert_eq!(LedgerTable::default().install_sql(), LEDGER_INSTALL_SQL);
        assert_eq!(
            LedgerTable::new(DEFAULT_LEDGER_TABLE).unwrap(),
            LedgerTable::default()
        );
    }

    #[test]
    fn table_names_are_validated_and_quoted() {
        let t = LedgerTable::new("ops.ticks_2").unwrap();
        assert_eq!(t.quoted, "\"ops\".\"ticks_2\"");
        assert!(
            t.install_sql()
                .starts_with("CREATE TABLE IF NOT EXISTS \"ops\".\"ticks_2\" (")
        );
        for bad in ["", "a.b.c", "Ticks", "ti cks", "t\"; DROP TABLE x; --"] {
            let err = LedgerTable::new(bad).expect_err(bad);
            assert!(
                err.to_string()
                    .starts_with("invalid tick ledger table name"),
                "{err}"
            );
        }
    }
}
