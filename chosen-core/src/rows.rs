//! The lease-row mode: locks are rows of a table (`chosen_lease`), taken, renewed and
//! released with ordinary statements on any connection of the application's pool, so
//! that it works through transaction poolers and needs no connection of its own.
//!
//! A *session* here is a holder id (random, with the time it began) instead of a
//! backend: its locks are the rows carrying it. The server releases them when they
//! expire by its clock, `server_release_after` after the last renewal's transaction
//! began; the client trusts them until the renewal's send time plus `lease_timeout`,
//! which [`ManagerOptions::validate`] keeps below it with room for the work to stop
//! (`lease_timeout + stop_budget + safety_margin < server_release_after`), the same
//! invariant as the advisory-lock mode's. So a node that cannot renew stops before any
//! other can take its rows over, as long as the two clocks run at about the same rate
//! and the server's wall clock does not step forward by more than the safety margin.
//!
//! Every plan is one transaction, sent as one simple query (see [`sql::Batch`]):
//! nothing prepared has to survive between two transactions of a pooler, and the
//! statements of a plan commit together or not at all. The batches of one session run
//! one at a time, in the order sent (a fair lock), which is the order the engine
//! expects answers in; any error ends the session (its rows are deleted when the link
//! is dropped, or expire), since after an error nobody knows what committed.
//!
//! Tokens come from a one-row counter (`chosen_lease_counter`), drawn after every row
//! of the batch was taken, as `greatest(counter + 1, the snapshot's next transaction
//! id)` (above every token the advisory-lock mode issued on the server), with the
//! server's timeline in the high bits as in the other mode: the counter's row lock
//! orders the draws, and a later tenure of a key draws after the earlier one's rows
//! were committed, so its token is larger.

mod sql;

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use deadpool_postgres::{Object, Pool};
use tokio::sync::mpsc;
use tokio_postgres::{SimpleQueryMessage, SimpleQueryRow};
use tracing::{debug, warn};

use crate::backend::{
    Backend, BoxFuture, ConnEvent, HeartbeatLink, HolderAnswer, Link, Opened, Session,
};
use crate::engine::Done;
use crate::error::{Error, Result};
use crate::fault::{Fault, classify, error_text};
use crate::generation::Generation;
use crate::info::HolderInfo;
use crate::key::{LockKey, SessionLock};
use crate::options::ManagerOptions;
use crate::status::SessionDownReason;
use crate::table::Plan;
use crate::token::FencingToken;

use crate::rows_step::{self, Answer, Steps, Tried, Win, lost};
use sql::{Batch, Me, Names};
pub(crate) use sql::{IN_TRANSACTION, observer_sql, tables_sql};

/// Locks as rows, on connections of `pool`.
#[derive(Debug)]
pub(crate) struct RowsBackend {
    pool: Pool,
}

impl RowsBackend {
    pub(crate) fn new(pool: Pool) -> Self {
        Self { pool }
    }
}

impl Backend for RowsBackend {
    fn connect<'a>(
        &'a self,
        options: &'a ManagerOptions,
        generation: u64,
    ) -> BoxFuture<'a, Result<Session>> {
        Box::pin(open(self.pool.clone(), options, generation))
    }

    fn holds_rows(&self) -> bool {
        true
    }
}

/// What every statement of a session needs.
struct Inner {
    pool: Pool,
    names: Names,
    me: Me,
    node_id: String,
    /// The server's identity (see [`sql::SERVER_SQL`]) the session began on.
    server: String,
    /// `server_release_after`, in milliseconds: how long a row lives past its renewal.
    ttl_ms: u128,
    /// `lease_timeout`: how long one batch may take, the wait for a connection included.
    timeout: Duration,
    /// How long a release keeps a row handed over for its target (see
    /// [`Steps::hand`]): the hand-over's hold, or twice the poll interval, whichever is
    /// longer, so that a target polling at the fleet's interval tries within it.
    hold_ms: u128,
    timeline: u16,
    /// The session's connection of the pool, kept between batches (so that an
    /// application holding every other connection cannot starve the renewals;
    /// through a transaction pooler it holds no server connection between them).
    /// Batches run one at a time, in the order sent (tokio's mutex is fair); a batch
    /// takes the connection out while it runs, and one abandoned mid-statement closes
    /// it (see [`Checkout`]).
    conn: tokio::sync::Mutex<Option<Object>>,
}

/// A connection of the pool in use: given back to where it came from when its answer
/// arrived ([`Checkout::done`]); closed, not given back, when dropped before (a
/// statement may still run on it: its next user would wait behind it).
struct Checkout(Option<Object>);

impl Checkout {
    fn client(&self) -> &Object {
        self.0
            .as_ref()
            .expect("BUG: a checkout is used only before done")
    }

    fn done(mut self) -> Object {
        self.0.take().expect("BUG: a checkout is done once")
    }
}

impl Drop for Checkout {
    fn drop(&mut self) {
        if let Some(object) = self.0.take() {
            drop(Object::take(object));
        }
    }
}

/// A lease-row session.
struct RowsLink {
    inner: Arc<Inner>,
    /// Kept so that the events channel stays open: a pool has no session to end.
    _events: mpsc::UnboundedSender<ConnEvent>,
}

impl Drop for RowsLink {
    fn drop(&mut self) {
        // The server does not end anything here: delete the session's rows, so that
        // the next holder need not wait for them to expire (best effort; they expire
        // anyway). The manager drops a session only once nothing of it is trusted any
        // more and its stopping work is fenced by the next session (a lost lease-row
        // session is always retired, see `Backend::holds_rows`).
        let inner = Arc::clone(&self.inner);
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let mut batch = inner.batch();
                batch.release_all(inner.me);
                if let Err(e) = inner.run(&batch.sql).await {
                    debug!(error = ?e, holder = inner.me.holder, "could not delete the rows of an ended lease session; they expire");
                }
            });
        }
    }
}

/// Opens a session: checks that the pool reaches a writable primary and that the
/// tables are there and writable (creating them when missing and allowed), reads the
/// term, and draws a holder id. The connection it used becomes the session's.
async fn open(pool: Pool, options: &ManagerOptions, generation: u64) -> Result<Session> {
    let deadline = tokio::time::Instant::now() + options.connect_timeout;
    let timed_out = || Error::ConnectTimeout {
        target: "the application's pool".to_owned(),
        after: options.connect_timeout,
    };
    let client = Checkout(Some(
        tokio::time::timeout_at(deadline, pool.get())
            .await
            .map_err(|_| timed_out())?
            .map_err(|e| Error::Pool {
                message: format!("no connection from the pool: {}", pool_error_text(&e)),
            })?,
    ));
    let names = Names::new(&options.lease_schema);
    let work = async {
        let role = client
            .client()
            .simple_query(sql::ROLE_SQL)
            .await
            .map_err(Error::database)?;
        let row = rows(&role).next().ok_or_else(|| Error::Protocol {
            message: "the server answered the lease session's probe with no row".to_owned(),
        })?;
        if column(row, 2) != Some("t") {
            // Closed (the checkout is not done), which rolls the application's
            // transaction back: it gave the connection back to the pool inside it.
            return Err(Error::Pool {
                message: "a connection of the pool was inside an open transaction (its last user gave it back without COMMIT or ROLLBACK); it was closed, and the connect is tried again".to_owned(),
            });
        }
        if column(row, 0) != Some("f") {
            return Err(Error::Refused(SessionDownReason::ServerInRecovery));
        }
        if column(row, 1) != Some("off") {
            return Err(Error::Refused(SessionDownReason::ServerReadOnly));
        }
        ensure_tables(client.client(), &options.lease_schema, &names).await?;
        let proven_at = crate::clock::now();
        let term = crate::pg::read_term(client.client(), options.token_epoch, false).await?;
        let answer = client
            .client()
            .simple_query(&sql::open_sql(&names))
            .await
            .map_err(Error::database)?;
        if let Err(e) = client.client().batch_execute(&sql::sweep_sql(&names)).await {
            debug!(error = %error_text(&e), "could not sweep long-expired lease rows");
        }
        Ok::<_, Error>((proven_at, term, answer))
    };
    let (proven_at, mut term, answer) = tokio::time::timeout_at(deadline, work)
        .await
        .map_err(|_| timed_out())??;
    let row = rows(&answer).next().ok_or_else(|| Error::Protocol {
        message: "the server answered the lease session's probe with no row".to_owned(),
    })?;
    let server = column(row, 0).unwrap_or_default().to_owned();
    let address = column(row, 1).unwrap_or_default().to_owned();
    let first = column(row, 2)
        .and_then(|t| t.parse::<u64>().ok())
        .ok_or_else(|| Error::Protocol {
            message: "the server answered no token counter".to_owned(),
        })?;
    if first >= 1 << 48 {
        return Err(Error::Refused(SessionDownReason::ConnectFailed {
            message: format!(
                "the lease token counter ({}.chosen_lease_counter) is at {first}, past the 48 bits a token carries: set it back to 0 on a new timeline or token epoch (ManagerOptions::token_epoch)",
                options.lease_schema
            ),
        }));
    }
    // The first token this session can draw (the term's own counts transaction ids;
    // this mode's counter is at least as high).
    term.first_token = FencingToken::from_parts(term.timeline, first);
    let me = Me {
        holder: random_holder(&options.node_id, generation),
        start: micros_since_epoch(SystemTime::now()),
    };
    let (events, receiver) = mpsc::unbounded_channel();
    let inner = Arc::new(Inner {
        pool,
        names,
        me,
        node_id: options.node_id.clone(),
        server,
        ttl_ms: options.server_release_after.as_millis(),
        timeout: options.lease_timeout,
        hold_ms: options
            .poll_interval
            .saturating_mul(2)
            .max(crate::table::HAND_OVER_HOLD)
            .as_millis(),
        timeline: term.timeline,
        conn: tokio::sync::Mutex::new(Some(client.done())),
    });
    debug!(holder = me.holder, "lease session opened");
    Ok(Session::new(
        Box::new(RowsLink {
            inner,
            _events: events,
        }),
        Opened {
            backend_pid: me.holder,
            server: address,
            generation: Generation::new(generation),
            events: receiver,
            proven_at,
            term,
        },
    ))
}

/// Creates the tables when they are missing (racing nodes may both try: the second
/// one's `IF NOT EXISTS` or a unique violation in the catalog tells), and checks that
/// this role may read and write them.
async fn ensure_tables(client: &tokio_postgres::Client, schema: &str, names: &Names) -> Result<()> {
    let usable = |answer: &[SimpleQueryMessage]| {
        let row = rows(answer).next();
        (
            row.and_then(|r| column(r, 0)) == Some("t"),
            row.and_then(|r| column(r, 1)) == Some("t"),
            row.and_then(|r| column(r, 2)) == Some("t"),
        )
    };
    let check = sql::tables_usable_sql(names);
    let answer = client.simple_query(&check).await.map_err(Error::database)?;
    let (mut exist, mut writable, mut current) = usable(&answer);
    if !exist {
        let created = client.batch_execute(&sql::tables_sql(schema)).await;
        let again = client.simple_query(&check).await.map_err(Error::database)?;
        (exist, writable, current) = usable(&again);
        if !exist {
            let why = created
                .err()
                .map_or_else(String::new, |e| format!(" ({})", error_text(&e)));
            return Err(Error::Refused(SessionDownReason::ConnectFailed {
                message: format!(
                    "the lease tables ({schema}.chosen_lease, chosen_lease_fence, chosen_lease_counter) are missing and could not be created{why}: run chosen_core::lease_tables_sql({schema:?}) as a migration, or grant this role CREATE on the schema"
                ),
            }));
        }
    }
    if !current {
        // Made by an earlier version: add what this one needs (every statement of it
        // names `hand_to`).
        let upgraded = client.batch_execute(&sql::add_columns_sql(names)).await;
        let again = client.simple_query(&check).await.map_err(Error::database)?;
        (_, writable, current) = usable(&again);
        if !current {
            let why = upgraded
                .err()
                .map_or_else(String::new, |e| format!(" ({})", error_text(&e)));
            return Err(Error::Refused(SessionDownReason::ConnectFailed {
                message: format!(
                    "the lease table {schema}.chosen_lease was made by an earlier version and lacks its hand_to column, which could not be added{why}: run chosen_core::lease_tables_sql({schema:?}) again as a migration (it adds it), as the table's owner"
                ),
            }));
        }
    }
    if !writable {
        return Err(Error::Refused(SessionDownReason::ConnectFailed {
            message: format!(
                "this role may not write the lease tables: GRANT SELECT, INSERT, UPDATE, DELETE ON {schema}.chosen_lease, {schema}.chosen_lease_fence TO it, and SELECT, UPDATE ON {schema}.chosen_lease_counter"
            ),
        }));
    }
    Ok(())
}

/// A holder id: random, positive (the hash of a fresh random state, the node and the
/// generation).
fn random_holder(node_id: &str, generation: u64) -> i32 {
    use std::hash::{BuildHasher, Hash, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    node_id.hash(&mut hasher);
    generation.hash(&mut hasher);
    std::process::id().hash(&mut hasher);
    let id = (hasher.finish() & 0x7fff_ffff) as i32;
    id.max(1)
}

/// A pool's error with the database's own message (tokio-postgres' Display of a
/// database error is only "db error").
pub(crate) fn pool_error_text(error: &deadpool_postgres::PoolError) -> String {
    match error {
        deadpool_postgres::PoolError::Backend(e) => error_text(e),
        other => other.to_string(),
    }
}

fn micros_since_epoch(at: SystemTime) -> i64 {
    at.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

fn rows(answer: &[SimpleQueryMessage]) -> impl Iterator<Item = &SimpleQueryRow> {
    answer.iter().filter_map(|m| match m {
        SimpleQueryMessage::Row(row) => Some(row),
        _ => None,
    })
}

fn column(row: &SimpleQueryRow, i: usize) -> Option<&str> {
    row.try_get(i).ok().flatten()
}

fn number<T: std::str::FromStr>(row: &SimpleQueryRow, i: usize) -> Option<T> {
    column(row, i).and_then(|t| t.parse().ok())
}

/// Rows of `answer` tagged `tag` (the first column).
fn tagged<'a>(
    answer: &'a [SimpleQueryMessage],
    tag: &'a str,
) -> impl Iterator<Item = &'a SimpleQueryRow> + 'a {
    rows(answer).filter(move |r| column(r, 0) == Some(tag))
}

/// A 1-based index column as a position in a list of `len`.
fn index(row: &SimpleQueryRow, i: usize, len: usize) -> Option<usize> {
    number::<i64>(row, i)
        .and_then(|i| usize::try_from(i.checked_sub(1)?).ok())
        .filter(|i| *i < len)
}

impl Inner {
    /// Runs one batch on the session's connection (a new one of the pool when it has
    /// none), after the batches sent before it, within the lease timeout (the wait for
    /// the connection included). Any failure ends the session: what committed is not
    /// known.
    async fn run(&self, batch: &str) -> Result<Vec<SimpleQueryMessage>, Fault> {
        let deadline = tokio::time::Instant::now() + self.timeout;
        let mut slot = tokio::time::timeout_at(deadline, self.conn.lock())
            .await
            .map_err(|_| lost("an earlier statement of the lease session is still running past the lease timeout".to_owned()))?;
        let object = match slot.take().filter(|c| !c.is_closed()) {
            Some(object) => object,
            None => tokio::time::timeout_at(deadline, self.pool.get())
                .await
                .map_err(|_| {
                    lost(format!(
                        "the pool gave no connection within the lease timeout of {:?}",
                        self.timeout
                    ))
                })?
                .map_err(|e| {
                    lost(format!(
                        "the pool gave no connection: {}",
                        pool_error_text(&e)
                    ))
                })?,
        };
        let client = Checkout(Some(object));
        match tokio::time::timeout_at(deadline, client.client().simple_query(batch)).await {
            Ok(Ok(answer)) => {
                *slot = Some(client.done());
                Ok(answer)
            }
            // Closed by the checkout: after a failed batch, the connection's state
            // (an aborted transaction, a setting) is not known.
            Ok(Err(e)) => Err(self.failed(e)),
            // Closed by the checkout, not given back with a statement in flight.
            Err(_) => Err(lost(format!(
                "a lease statement got no answer within the lease timeout of {:?}",
                self.timeout
            ))),
        }
    }

    fn failed(&self, e: tokio_postgres::Error) -> Fault {
        if error_text(&e).contains(sql::IN_TRANSACTION) {
            return lost(
                "the session's connection was inside a transaction it did not begin (an application's, left open on a pooled connection): closed; a new session takes another"
                    .to_owned(),
            );
        }
        if error_text(&e).contains(sql::SERVER_CHANGED) {
            return lost(
                "the pool's connection reached another server than the session's (a restart, a failover, another database): a new session reads its term"
                    .to_owned(),
            );
        }
        match classify(e) {
            Fault::Lost(reason) => Fault::Lost(reason),
            Fault::Query(e) => lost(format!("a lease statement failed: {}", error_text(&e))),
        }
    }

    fn batch(&self) -> Batch {
        Batch::new(&self.names, &self.server, self.timeout.as_millis())
    }
}

impl Link for RowsLink {
    fn perform<'a>(
        &'a self,
        plan: &'a Plan,
    ) -> BoxFuture<'a, Result<(Done, Option<tokio_postgres::Error>), Fault>> {
        Box::pin(async move { Ok((self.inner.perform(plan).await?, None)) })
    }

    fn holders<'a>(
        &'a self,
        keys: &'a [LockKey],
    ) -> BoxFuture<'a, Result<Vec<HolderAnswer>, Fault>> {
        Box::pin(async move {
            let answer = self
                .inner
                .read(&sql::holders_sql(&self.inner.names, keys))
                .await?;
            let mut out: Vec<HolderAnswer> = keys.iter().map(|_| Ok(None)).collect();
            for row in tagged(&answer, "h") {
                if let Some(at) = index(row, 1, keys.len()) {
                    out[at] = Ok(Some(holder_info(row, 2)));
                }
            }
            Ok(out)
        })
    }

    fn cluster(&self) -> BoxFuture<'_, Result<Vec<(LockKey, HolderInfo)>, Fault>> {
        Box::pin(async move {
            let answer = self
                .inner
                .read(&sql::cluster_sql(&self.inner.names))
                .await?;
            Ok(tagged(&answer, "h")
                .filter_map(|row| {
                    let key = sql::key_of(number(row, 1)?, number(row, 2)?)?;
                    Some((key, holder_info(row, 3)))
                })
                .collect())
        })
    }

    fn reset(&self) -> BoxFuture<'_, Result<(), Fault>> {
        Box::pin(async move {
            let mut batch = self.inner.batch();
            batch.release_all(self.inner.me);
            self.inner.run(&batch.sql).await.map(|_| ())
        })
    }

    fn heartbeat_link(&self) -> Box<dyn HeartbeatLink> {
        Box::new(RowsHeartbeat {
            inner: Arc::clone(&self.inner),
        })
    }

    fn is_closed(&self) -> bool {
        false
    }
}

/// A holder as a row shows it, from column `at` on: node id, holder id, start.
fn holder_info(row: &SimpleQueryRow, at: usize) -> HolderInfo {
    HolderInfo {
        node_id: column(row, at).unwrap_or_default().to_owned(),
        backend_pid: number(row, at + 1).unwrap_or(0),
        client_addr: None,
        session_start: number::<u64>(row, at + 2)
            .map(|us| SystemTime::UNIX_EPOCH + Duration::from_micros(us)),
    }
}

impl Inner {
    /// A read: any connection of the pool, no turn to wait for, within the lease
    /// timeout.
    async fn read(&self, statement: &str) -> Result<Vec<SimpleQueryMessage>, Fault> {
        let deadline = tokio::time::Instant::now() + self.timeout;
        let object = tokio::time::timeout_at(deadline, self.pool.get())
            .await
            .map_err(|_| Fault::Query(timeout_error()))?
            .map_err(|e| match e {
                deadpool_postgres::PoolError::Backend(e) => Fault::Query(e),
                _ => Fault::Query(timeout_error()),
            })?;
        let client = Checkout(Some(object));
        let statement = format!("{} {statement}", sql::read_head());
        match tokio::time::timeout_at(deadline, client.client().simple_query(&statement)).await {
            Ok(Ok(answer)) => {
                drop(client.done());
                Ok(answer)
            }
            Ok(Err(e)) => Err(Fault::Query(e)),
            Err(_) => Err(Fault::Query(timeout_error())),
        }
    }

    /// Carries out a plan in one transaction.
    async fn perform(&self, plan: &Plan) -> Result<Done, Fault> {
        let me = self.me;
        let steps = Steps::of(plan);
        let mut batch = self.batch();
        // The order of the statements: the try first, the one statement that waits for
        // rows others hold; then the releases and the token statement, which skip a
        // row another statement holds (a try taking it over, or rarely one that found
        // it live only as it conflicted: a false loss) instead of waiting; then
        // the counter, whose holder waits for no row after it (the fence statements
        // touch only the session's own fences). So a step waits only in its try, for a
        // step that is past its own try, or for the counter's holder, which waits for
        // nothing: no two steps deadlock.
        if !steps.tries.is_empty() {
            batch.try_keys(
                me,
                (&self.node_id, crate::key::node_hash(&self.node_id)),
                self.ttl_ms,
                &steps.tries,
            );
        }
        let hold_ms = self.hold_ms;
        if !steps.unlock.is_empty() {
            batch.unlock(me, &steps.unlock, &steps.hand, hold_ms, false);
        }
        if !steps.unfence.is_empty() {
            batch.unfence(me, &steps.unfence);
        }
        if !steps.token.is_empty() {
            batch.token(me, &steps.token, false);
        }
        if !steps.tries.is_empty() {
            let fences: Vec<(LockKey, i64)> = steps
                .tries
                .iter()
                .map(|k| (*k, sql::fence_column(*k)))
                .collect();
            batch.tokens_for_wins(me, &fences);
        }
        if !steps.fence.is_empty() {
            batch.fence(me, &self.node_id, self.ttl_ms, &steps.fence);
        }
        if !steps.check.is_empty() {
            batch.check(me, &steps.check);
        }
        let answer = self.run(&batch.sql).await?;
        let mut parsed = parse(&answer, &steps);
        // A release or token draw that skipped a row of the session another statement
        // had locked is tried again, waiting for it, in a transaction of its own: only
        // a row that is really gone then ends the session.
        let released: Vec<usize> = tagged(&answer, "u")
            .filter_map(|r| index(r, 1, steps.unlock.len()))
            .collect();
        let unlock: Vec<LockKey> = (0..steps.unlock.len())
            .filter(|i| !released.contains(i))
            .map(|i| steps.unlock[i])
            .collect();
        let token: &[LockKey] = if parsed.tokens.len() < steps.token.len() {
            &steps.token
        } else {
            &[]
        };
        if !unlock.is_empty() || !token.is_empty() {
            debug!(
                holder = me.holder,
                releases = unlock.len(),
                tokens = token.len(),
                "a lease step skipped rows another statement had locked: trying them again"
            );
            let hand: Vec<(LockKey, u64)> = steps
                .hand
                .iter()
                .filter(|(k, _)| unlock.contains(k))
                .copied()
                .collect();
            let mut again = self.batch();
            again.retry(me, (&unlock, &hand, hold_ms), token);
            let answer = self.run(&again.sql).await?;
            parsed.unlocked += tagged(&answer, "u").count();
            if !token.is_empty() {
                parsed.tokens = tagged(&answer, "t").filter_map(|r| number(r, 2)).collect();
            }
        }
        rows_step::interpret(&steps, &parsed, self.timeline)
    }
}

/// A batch's rows as its statements' answers (see the tags of [`Batch`]'s statements).
fn parse(answer: &[SimpleQueryMessage], steps: &Steps) -> Answer {
    let tries = steps.tries.len();
    Answer {
        unlocked: tagged(answer, "u").count(),
        unfenced: tagged(answer, "v").count(),
        tokens: tagged(answer, "t").filter_map(|r| number(r, 2)).collect(),
        tried: tagged(answer, "k")
            .filter_map(|r| {
                Some(Tried {
                    at: index(r, 1, tries)?,
                    won: column(r, 2) == Some("t"),
                    existed: column(r, 3) == Some("t"),
                    holder: number(r, 4),
                    start: number(r, 5),
                })
            })
            .collect(),
        wins: tagged(answer, "w")
            .filter_map(|r| {
                Some(Win {
                    key: sql::key_of(number(r, 1)?, number(r, 2)?)?,
                    token: number(r, 3),
                    fenced_by: number(r, 4),
                })
            })
            .collect(),
        fenced: tagged(answer, "f")
            .filter_map(|r| sql::key_of(2, number(r, 1)?))
            .collect(),
        checked: tagged(answer, "c")
            .filter_map(|r| Some((index(r, 1, steps.check.len())?, number(r, 2))))
            .collect(),
    }
}

/// A read that got no connection or no answer in time, as a query error (the caller
/// answers it per key).
fn timeout_error() -> tokio_postgres::Error {
    // tokio-postgres makes its errors itself only; its timeout error is the one it
    // lends to pools for a connection or a statement that did not come in time.
    tokio_postgres::Error::__private_api_timeout()
}

/// The heartbeat of a lease session: renews every row.
struct RowsHeartbeat {
    inner: Arc<Inner>,
}

impl HeartbeatLink for RowsHeartbeat {
    fn explain(&self, reason: SessionDownReason) -> SessionDownReason {
        rows_step::explain(reason)
    }

    fn heartbeat(&self) -> BoxFuture<'_, Result<Vec<SessionLock>, SessionDownReason>> {
        Box::pin(async move {
            let mut batch = self.inner.batch();
            batch.renew(self.inner.me, self.inner.ttl_ms);
            let answer = match self.inner.run(&batch.sql).await {
                Ok(answer) => answer,
                Err(Fault::Lost(reason)) => return Err(reason),
                Err(Fault::Query(e)) => {
                    return Err(SessionDownReason::ConnectionLost {
                        message: format!("heartbeat failed: {}", error_text(&e)),
                    });
                }
            };
            let mut locks = Vec::new();
            for row in rows(&answer) {
                let exclusive = match column(row, 0) {
                    Some("l") => true,
                    Some("s") => false,
                    _ => continue,
                };
                let (Some(form), Some(k)) = (number::<i16>(row, 1), number::<i64>(row, 2)) else {
                    warn!("a lease heartbeat answered an odd row");
                    continue;
                };
                if let Some(key) = sql::key_of(form, k) {
                    locks.push(SessionLock { key, exclusive });
                }
            }
            Ok(locks)
        })
    }
}
