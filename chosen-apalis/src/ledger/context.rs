//! What a ledgered job gets: its tick, its token, and the ledger-guarded transaction.

use std::ops::Deref;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::SystemTime;

use chosen_core::FencingToken;
use tokio_postgres::types::Type;
use tokio_postgres::{Client, Transaction};

use super::{Claim, JobIds, LedgerError, TickLedger, at, token_value};

/// What became of a tick's claim in the job's own transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum Slot {
    /// No ledger transaction committed (yet).
    #[default]
    Open,
    /// [`TickContext::begin`] failed (the ledger, not the job: a lock wait past the
    /// timeout, a stale token, a lost connection), or the job's transaction found its
    /// session ended ([`LedgerTx::commit`] or [`LedgerTx::rollback`] did, or it was
    /// dropped uncommitted on a closed connection): the gate leaves the tick
    /// unrecorded, for the misfire policy of a later tick.
    Failed,
    /// A ledger transaction claimed the tick and committed.
    Committed,
    /// The tick was already recorded when the job tried to claim it.
    AlreadyRecorded,
}

/// Injected into every run of a ledgered cron job; take it as `Data<TickContext>`
/// (`apalis_core::task::data::Data`).
///
/// It names the tick being run (its *scheduled* time, the ledger's key; for a missed
/// tick run by [`Misfire::RunOnce`](crate::Misfire::RunOnce) or
/// [`Misfire::CatchUp`](crate::Misfire::CatchUp), that older time, also in the job's
/// `Tick`), the leader's fencing token, and opens the transaction that records the
/// tick ([`begin`](Self::begin)).
///
/// ```no_run
/// use apalis_core::{error::BoxDynError, task::data::Data};
/// use chosen_apalis::{Tick, TickContext};
///
/// async fn bill(_tick: Tick, ctx: Data<TickContext>, pool: Data<deadpool_postgres::Pool>) -> Result<(), BoxDynError> {
///     let mut client = pool.get().await?;
///     // Fenced, and (with Claim::InJobTransaction) the tick claimed: None if it is
///     // already recorded (another leader ran it): nothing to do.
///     let Some(tx) = ctx.begin(&mut client).await? else { return Ok(()) };
///     tx.execute("INSERT INTO invoices_sent (at) VALUES ($1)", &[&ctx.tick()]).await?;
///     tx.commit().await?; // the writes and the tick's row, together, once
///     Ok(())
/// }
/// ```
#[derive(Debug, Clone)]
pub struct TickContext {
    ids: JobIds,
    tick: u64,
    token: FencingToken,
    catch_up: bool,
    claim: Claim,
    ledger: TickLedger,
    slot: Arc<Mutex<Slot>>,
    /// How many transactions [`begin`](Self::begin) opened: only the latest one's end
    /// settles the slot from its drop.
    begun: Arc<std::sync::atomic::AtomicU64>,
}

impl TickContext {
    pub(crate) fn new(
        ids: JobIds,
        tick: u64,
        token: FencingToken,
        catch_up: bool,
        claim: Claim,
        ledger: TickLedger,
    ) -> Self {
        Self {
            ids,
            tick,
            token,
            catch_up,
            claim,
            ledger,
            slot: Arc::default(),
            begun: Arc::default(),
        }
    }

    /// The tick's scheduled time: its identity in the ledger.
    #[must_use]
    pub fn tick(&self) -> SystemTime {
        at(self.tick)
    }

    /// The tick's scheduled time in Unix seconds (what `Tick::get_timestamp` gives).
    #[must_use]
    pub fn timestamp(&self) -> u64 {
        self.tick
    }

    /// The job's key in the ledger (see
    /// [`LedgeredCronLayer::job_name`](crate::LedgeredCronLayer::job_name)).
    #[must_use]
    pub fn job(&self) -> &str {
        &self.ids.job
    }

    /// The name the job's ledger transaction is fenced under
    /// ([`LedgeredCronLayer::fence_name`](crate::LedgeredCronLayer::fence_name): the
    /// lock's name for an unnamed job in the default namespace; the tokens are the
    /// lock's). Fence the job's other writes under it too.
    #[must_use]
    pub fn fence_name(&self) -> &str {
        &self.ids.fence
    }

    /// This node's id.
    #[must_use]
    pub fn node_id(&self) -> &str {
        &self.ids.node
    }

    /// The fencing token of the lease this run was let through under.
    #[must_use]
    pub fn fencing_token(&self) -> FencingToken {
        self.token
    }

    /// `true` for a missed tick run late by the misfire policy, `false` for the tick
    /// that just fell due.
    #[must_use]
    pub fn is_catch_up(&self) -> bool {
        self.catch_up
    }

    /// Who claims the tick: see [`Claim`].
    #[must_use]
    pub fn claim(&self) -> Claim {
        self.claim
    }

    pub(crate) fn slot(&self) -> Slot {
        *self.slot.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn settle(&self, slot: Slot) {
        let mut s = self.slot.lock().unwrap_or_else(PoisonError::into_inner);
        // A committed claim stays committed, whatever a later attempt finds.
        if *s != Slot::Committed {
            *s = slot;
        }
    }

    /// Opens a transaction on `client` (any tokio-postgres client; a
    /// `deadpool_postgres::Client` dereferences to one: `ctx.begin(&mut client)`),
    /// fences it with the job's name and this run's token
    /// ([`chosen_core::fenced::fence`]), and with [`Claim::InJobTransaction`] claims
    /// the tick in the ledger, in that transaction.
    ///
    /// * `Ok(Some(tx))`: write in `tx`, then [`LedgerTx::commit`]. With
    ///   [`Claim::InJobTransaction`], the tick's row (outcome `ran`) commits with your
    ///   writes, or neither does.
    /// * `Ok(None)` (only with [`Claim::InJobTransaction`]): the tick is already
    ///   recorded (another leader ran or skipped it, or an earlier attempt of this run
    ///   committed): do nothing, return `Ok`.
    ///
    /// With [`Claim::BeforeRun`] the gate has claimed the tick already: this is a
    /// fenced transaction (a stale leader's writes cannot commit after a newer
    /// leader's), nothing more.
    ///
    /// # Errors
    ///
    /// * [`LedgerError::Fence`] with [`chosen_core::Error::StaleToken`] (see
    ///   [`LedgerError::is_stale`]): a newer leader has written; this node no longer
    ///   leads. The transaction is aborted on the server: return the error.
    /// * [`LedgerError::Timeout`]: the fence row stayed locked (a former leader frozen
    ///   inside its transaction) past the ledger's timeout. Only the fence's wait is
    ///   bounded so: the job's own statements keep the transaction's `lock_timeout`.
    /// * [`LedgerError::NotInstalled`], [`LedgerError::Database`].
    ///
    /// On any error the gate leaves the tick unrecorded, for the misfire policy of a
    /// later tick (it is not recorded `failed`).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future rolls the transaction back (if it was opened): nothing is
    /// claimed.
    pub async fn begin<'c>(
        &self,
        client: &'c mut Client,
    ) -> Result<Option<LedgerTx<'c>>, LedgerError> {
        let begun = self.begin_unsettled(client).await;
        match &begun {
            // Not the job's own failure: the gate leaves the tick unrecorded, for the
            // misfire policy of a later tick.
            Err(_) => self.settle(Slot::Failed),
            // Begun after all (a retry): what the job does now decides.
            Ok(Some(_)) if self.slot() == Slot::Failed => self.settle(Slot::Open),
            Ok(_) => {}
        }
        begun
    }

    async fn begin_unsettled<'c>(
        &self,
        client: &'c mut Client,
    ) -> Result<Option<LedgerTx<'c>>, LedgerError> {
        let tx = client
            .transaction()
            .await
            .map_err(self.ledger.db("beginning a transaction"))?;
        // A former leader frozen inside its transaction holds the fence row: wait for
        // it no longer than the ledger's timeout (the job's own statements keep the
        // transaction's lock_timeout).
        let tables = self
            .ledger
            .fence_bounded(&tx, &self.ids, self.token)
            .await?;
        let claimed = match self.claim {
            Claim::BeforeRun => false,
            Claim::InJobTransaction => {
                let claimed = self
                    .ledger
                    .claim_in(&tx, &tables, &self.ids, self.tick, self.token, "ran")
                    .await?
                    .inserted;
                if !claimed {
                    self.settle(Slot::AlreadyRecorded);
                    // Dropping `tx` rolls it back.
                    return Ok(None);
                }
                true
            }
        };
        let attempt = self.begun.fetch_add(1, std::sync::atomic::Ordering::AcqRel) + 1;
        Ok(Some(LedgerTx {
            tx: Some(tx),
            tables,
            attempt,
            ctx: self.clone(),
            claimed,
        }))
    }
}

/// A fenced transaction that (with [`Claim::InJobTransaction`]) has claimed its tick:
/// from [`TickContext::begin`]. Use it as a `tokio_postgres::Transaction` (it
/// dereferences to one), then [`commit`](Self::commit). Dropping it rolls back: the
/// tick stays unclaimed.
///
/// While it is open it holds the job's fence row, and a newer leader's tick waits for
/// that row. The server ends the transaction once it has sat idle
/// [`TickLedger::idle_in_transaction`] between two statements (nothing of it commits:
/// [`commit`](Self::commit), or the job's next statement in it, then fails on the
/// closed connection, and with [`Claim::InJobTransaction`] the tick is left to the
/// misfire policy, whatever the job returns). A newer leader's tick that finds it still open waits for
/// the row at most [`TickLedger::timeout`] and then gives up, unrun and unrecorded:
/// [`TickContext::begin`] fails with [`LedgerError::Timeout`] (with
/// [`Claim::BeforeRun`], the gate answers `Outcome::Skipped(Ledger)`), and the misfire
/// policy of a later tick decides about it.
pub struct LedgerTx<'c> {
    /// `None` only once [`commit`](Self::commit) or [`rollback`](Self::rollback) took it.
    tx: Option<Transaction<'c>>,
    /// The tables it fenced and claimed in (its end is recorded there too).
    tables: super::Tables,
    /// Which of the context's transactions this is (1 for the first).
    attempt: u64,
    ctx: TickContext,
    claimed: bool,
}

impl Drop for LedgerTx<'_> {
    /// Dropped uncommitted on a closed connection (the server ended the session while
    /// the job's own statement waited or ran): nothing of it committed, and it is not
    /// the job's failure, whatever the job returns: the tick is left to the misfire
    /// policy, as when [`commit`](Self::commit) finds the connection closed.
    fn drop(&mut self) {
        if let Some(tx) = &self.tx
            && tx.client().is_closed()
        {
            self.session_ended();
        }
    }
}

impl std::fmt::Debug for LedgerTx<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LedgerTx")
            .field("job", &self.ctx.ids.job)
            .field("tick", &self.ctx.tick)
            .field("token", &self.ctx.token)
            .field("claimed", &self.claimed)
            .finish_non_exhaustive()
    }
}

impl<'c> Deref for LedgerTx<'c> {
    type Target = Transaction<'c>;

    fn deref(&self) -> &Self::Target {
        self.tx.as_ref().expect(
            "BUG: a LedgerTx's transaction is taken only by commit and rollback, which consume it",
        )
    }
}

impl LedgerTx<'_> {
    /// The server ended this transaction's session: nothing of it committed, and the
    /// tick is not the job's failure (if the tick was claimed here and this is the
    /// latest transaction the job began for it).
    fn session_ended(&self) {
        if self.claimed && self.ctx.begun.load(std::sync::atomic::Ordering::Acquire) == self.attempt
        {
            self.ctx.settle(Slot::Failed);
        }
    }

    /// Records the run's end time on the tick's row and commits: the writes made in
    /// this transaction and the tick's row (outcome `ran`) commit together.
    ///
    /// # Errors
    ///
    /// [`LedgerError::Database`] when a statement or the commit fails (a transaction
    /// the fence aborted fails here too): then nothing committed, unless the commit
    /// itself was lost on the way back (the next leader then finds the row).
    ///
    /// When the statement that records the end of the run or the commit finds the
    /// session ended (the transaction sat idle past
    /// [`TickLedger::idle_in_transaction`], its backend was terminated, the connection
    /// failed), the error says so, and with [`Claim::InJobTransaction`] the tick is not
    /// the job's failure: the gate leaves it unrecorded, for the misfire policy of a
    /// later tick, which reads what the ledger holds (the row, if the commit's answer
    /// was lost with the connection), whatever the job returns then. Any other failure
    /// of that statement is the job's: a job that returns it is recorded `failed`.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: the commit may or may not have happened.
    pub async fn commit(mut self) -> Result<(), LedgerError> {
        let Some(tx) = self.tx.take() else {
            unreachable!(
                "BUG: a LedgerTx's transaction is taken only by commit and rollback, which consume it"
            )
        };
        let ledger = &self.ctx.ledger;
        if self.claimed {
            // The row was inserted by this transaction, so it is there to update.
            let finished = tx
                .execute_typed(
                    &TickLedger::finish_sql(&self.tables),
                    &[
                        (&&*self.ctx.ids.job, Type::TEXT),
                        (&at(self.ctx.tick), Type::TIMESTAMPTZ),
                        (&token_value(self.ctx.token)?, Type::INT8),
                        (&None::<&str>, Type::TEXT),
                        (&None::<&str>, Type::TEXT),
                    ],
                )
                .await;
            match finished {
                Ok(_) => {}
                // The COMMIT was never sent: nothing of the transaction committed.
                Err(source) if session_ended(&source) => {
                    return Err(connection_closed(
                        &self,
                        "recording the end of the run (its connection is closed: the server ended the session, e.g. idle in the transaction past TickLedger::idle_in_transaction)",
                        source,
                    ));
                }
                Err(source) => return Err(ledger.db("recording the end of the run")(source)),
            }
        }
        if let Err(source) = tx.commit().await {
            // Nothing of it committed, or the commit's answer was lost with the
            // connection.
            if session_ended(&source) {
                return Err(connection_closed(
                    &self,
                    "committing the ledger transaction (its connection is closed: the server ended the session, e.g. idle in the transaction past TickLedger::idle_in_transaction)",
                    source,
                ));
            }
            return Err(LedgerError::Database {
                action: "committing the ledger transaction",
                source,
            });
        }
        if self.claimed {
            self.ctx.settle(Slot::Committed);
        }
        Ok(())
    }

    /// Rolls back: nothing written in it commits, and the tick stays unclaimed. What the
    /// job returns then decides (with [`Claim::InJobTransaction`]: `Err` is recorded
    /// `failed`, `Ok` is recorded `ran`), unless the session had ended (the connection
    /// is closed, or the rollback fails with the server's `FATAL` error): then the tick
    /// is left to the misfire policy of a later tick.
    ///
    /// # Errors
    ///
    /// [`LedgerError::Database`] when the rollback fails (the server rolls back anyway
    /// when the connection ends).
    pub async fn rollback(mut self) -> Result<(), LedgerError> {
        let Some(tx) = self.tx.take() else {
            unreachable!(
                "BUG: a LedgerTx's transaction is taken only by commit and rollback, which consume it"
            )
        };
        let closed = tx.client().is_closed();
        let rolled_back = tx.rollback().await;
        if closed || rolled_back.as_ref().err().is_some_and(session_ended) {
            self.session_ended();
        }
        let ledger = self.ctx.ledger.clone();
        rolled_back.map_err(ledger.db("rolling back"))
    }
}

/// A statement of [`LedgerTx::commit`] found its connection closed: the server ended
/// the session (it sat idle past `TickLedger::idle_in_transaction`, or was
/// terminated). Not the job's failure: the tick is left to the misfire policy, which
/// reads what the ledger holds. The same for the statement that records the end of the
/// run as for the COMMIT.
fn connection_closed(
    tx: &LedgerTx<'_>,
    action: &'static str,
    source: tokio_postgres::Error,
) -> LedgerError {
    tx.session_ended();
    LedgerError::Database { action, source }
}

/// Did `e` come of the session's end rather than of the statement: the connection is
/// closed, or the server's last words before it closed it (a `FATAL` or `PANIC` error:
/// the transaction sat idle past `idle_in_transaction_session_timeout`, ran past
/// `transaction_timeout`, an administrator or a shutdown terminated the backend),
/// which tokio-postgres reports as the statement's error when they arrive with it.
/// (The same codes at `ERROR` severity come from another server, through
/// `postgres_fdw` or `dblink`, on a session that lives on.)
pub(crate) fn session_ended(e: &tokio_postgres::Error) -> bool {
    use tokio_postgres::error::Severity;
    e.is_closed()
        || e.as_db_error().is_some_and(|db| {
            matches!(
                db.parsed_severity(),
                Some(Severity::Fatal | Severity::Panic)
            )
        })
}
