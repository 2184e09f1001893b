//! A deterministic simulation of several managers against a simulated server.
//!
//! Each node runs the real [`Engine`] (the lock table and the session rules: the
//! validity gate, the order results are fed in, the term hold, the token floor, the
//! reconnect backoff), and around it what the task does with no rules of its own:
//! one session (backend) that runs the engine's plans as pipelined statements, a
//! heartbeat that keeps the leases valid until the last successful heartbeat *sent* +
//! `lease_timeout` (pipelined like `heartbeat.rs`: one sent every interval whatever the
//! answers do, at most `ceil(lease / interval) + 1` on their way), reconnects with backoff, a graceful shutdown, and one "child" per
//! granted lease that acts until the node learns the lease is lost and then takes up to
//! `stop_budget` to stop before it drops the lease. The server models what our SQL
//! relies on: exclusive and shared advisory locks per backend, backend pids and starts
//! (a try reports its holder's, and the start of the backend that has an announcer's pid
//! now), one transaction-id counter (tokens assigned after every lock of a try
//! statement), NOTIFY stamped with the sender's pid, pid reuse (a forger gets a dead
//! backend's pid), `idle_session_timeout` (`server_release_after`),
//! termination, restart, promotion of a standby (the next timeline, transaction ids a
//! little behind, a term age unknown until the end-of-recovery checkpoint), a replaced
//! cluster (timeline 1, smaller transaction ids, another system identifier, the token
//! epoch set by the DBA before or after), steps of the server's wall clock (which the
//! term age is measured with), statements that fail with the session intact, a reply
//! lost after the commit, a session ended in the middle of a statement, slow replies
//! (up to the lease timeout), and per-connection FIFO delivery with latency (a
//! partition, both ways or one, holds messages until it heals, as TCP does).
//!
//! Time is virtual: a priority queue of events by virtual instant (a base
//! `Instant::now()` plus virtual durations, fed to the tables), ties broken by the
//! seeded RNG. One seed is one exact history. `CHOSEN_SIM_SEED=n` replays seed `n` and
//! prints its trace; `CHOSEN_SIM_SEEDS=n` runs `n` seeds (`CHOSEN_SIM_FIRST` the first).
//!
//! The checks follow `tests/src/checker.rs`: two processes' children must never *act*
//! (grant → the node learns of the loss) at once for one key, and never *run* (acting or
//! stopping) at once, except the known gaps, which are counted:
//! (a) a node frozen while the server ended its session (silence longer than
//!     `server_release_after`): only with a greater token for the later holder;
//! (b) a brand-new requester (its table slot never saw the key held) wins the key while
//!     the old holder's work is stopping and its new session holds no stop fence yet;
//! (c) the server ended the old holder's session, and the old holder had not taken its
//!     stop fence when the new holder checked it (the news, or its reconnect, took
//!     longer than `takeover_grace` after the new holder won); bounded: no heartbeat of
//!     an ended session succeeds, so that work stops acting by the end + `lease` and
//!     has stopped by the end + `lease` + `stop_budget` (plus any freeze meanwhile),
//!     which the checks assert;
//! (d) a grant on a believed release announcement overlapping a tenure that began after
//!     that release, within the grace of the announcement's arrival (its session ended
//!     at the server, within gap (c)'s bound);
//! (e) another client released the old holder's locks behind its session's back
//!     (`pg_advisory_unlock_all()` on a shared backend): the heartbeat's lock-count
//!     guard ends the session with its next beat, within gap (c)'s bound.
//!
//! The lease-row mode (`Config::rows`, the test
//! `simulation_holds_over_many_seeds_in_the_lease_row_mode`, same environment
//! variables) runs the same engines against the same server's model of the lease rows
//! (`Server::execute_rows`, `renew_rows`, `release_rows`), as `LockManager::connect_pooled`
//! and `sim/backend/rows.rs` do: a session is a holder id whose batches go over a
//! pooled connection (a new one once that one ended while idle); a plan is one
//! transaction (`Steps::of`), its answer interpreted by `rows_step::interpret` (an
//! `Err` ends the session); the heartbeat renews every live row of the holder, and a
//! row missing from its answer ends the session; a lost session is retired, never
//! dropped as a pooler's, and its link dropped deletes its rows (best effort). The
//! server ending a pooled connection (termination, idle timeout, a restart) frees
//! nothing: it fails what is in flight on it (the session ends); a batch that reaches a
//! server other than the session's (restarted, promoted) fails; a process that dies
//! leaves its rows to expire; a promotion loses the last renewals and takes
//! (`lose_recent_rows`). No announcements, no interest keys: the engines poll. Faults:
//! any batch rolled back, or committed with its answer lost; a batch given up by its
//! client (a partition, a lost session, a dead process) that commits late; a process
//! killed; the server's wall clock stepping forward by at most `safety_margin` (once per
//! row lifetime) or back. Not drawn there: announcements and pid reuse, another
//! client's unlocks, failures with the session intact (every failure ends a session), a
//! replaced cluster (its token epoch is a client option in that mode).
//! Checks: the same acting and running checks with none of the gaps (b) to (e) (they
//! come of advisory locks freed with their backend, or by another client); gap (a), the
//! freeze window, stays: a process frozen across its validity deadline, or while its
//! rows were taken over, runs its stopping work after the freeze, fenced only by the
//! later holder's greater token (its rows are not kept by the session kept open, as
//! advisory locks are). Besides: a row is taken over only once its holder's client
//! stopped trusting it (the send time of its last answered heartbeat plus the lease
//! timeout) plus the stop budget, less what a promotion lost of its renewals (the new
//! term's hold keeps those apart, which the grants' check asserts); tokens of a key strictly
//! increase across tenures, with no excuse of a session ended at the server.
//!
//! Findings counted apart: a grant on a session the server had already ended (the
//! answer was on its way), fenced by the later holder's greater token; a term hold
//! shortened by a forward step of the server's clock past the tolerance
//! (`safety_margin` plus the server's downtime) for a process that did not see the old
//! term end; tokens of a replaced cluster before the DBA set its epoch, on a process
//! that never knew the old cluster.

use std::cmp::Ordering;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use crate::engine::{CloseNext, Done, Engine, Term, Timing as EngineTiming};
use crate::heartbeat::{Beat, Pulse, Verdict};
use crate::key::LockKey;
use crate::key::SessionLock;
use crate::shared::ServerFloor;
use crate::table::{
    Action, FenceCheck, Mode, Plan, Protection, Refusal, Request, RequestId, Rules, TokenRead,
    TryOutcome, Via, verified,
};
use crate::token::FencingToken;

use crate::rows_step::{self, Answer, Steps};
use crate::sim::server::{Backend, Coming, Connected, Executed, Notice, Reply, Row, Server};

/// An announcement as the checks know it: its sender, the sender's start, when the
/// server sent it and when it arrived (a waiter's try may win on it without the grace
/// when answered within the grace of its arrival, which bounds gap (d)).
type Note = (i32, T, T, T);

/// Every kind of fault the random runs draw, as the summary counts them.
const FAULT_KINDS: &[&str] = &[
    "terminate",
    "partition",
    "partition_requests",
    "partition_replies",
    "freeze",
    "freeze_long",
    "restart",
    "promotion",
    "replaced_cluster",
    "clock_step",
    "shutdown",
    "shutdown_disconnected",
    "forged_notify",
    "pid_reuse",
    "slow_replies",
    "reply_lost_after_commit",
    "session_ends_in_statement",
    "give_up",
    "discard_all",
    "discard_and_take",
    "discard_after_win",
    "try_failed",
    "lock_table_full",
    "check_failed",
    "token_failed",
];

/// Every kind of fault the random runs draw in the lease-row mode (the advisory-lock
/// mode's own ones left out: announcements, pid reuse, another client's unlocks,
/// failures with the session intact, a replaced cluster).
const ROWS_FAULT_KINDS: &[&str] = &[
    "terminate",
    "partition",
    "partition_requests",
    "partition_replies",
    "freeze",
    "freeze_long",
    "restart",
    "promotion",
    "clock_step",
    "shutdown",
    "shutdown_disconnected",
    "slow_replies",
    "reply_lost_after_commit",
    "session_ends_in_statement",
    "give_up",
    "kill",
    "rolled_back",
    "answer_lost",
    "late_commit",
];

/// Holder ids of lease-row sessions start here (apart from every backend pid).
const FIRST_HOLDER: i32 = 5_000_000;

/// Once faults stop and their effects end, a key some live node waits for is held
/// again within this (a poll, the grace, a fence check, a reconnect backoff of up to
/// `reconnect_max`, a stop fence outliving its wait).
const LIVENESS: T = 15 * SEC;

/// How soon after a thaw a frozen node is taken to have seen what its clock says
/// (its deadlines passed during the freeze): the events that waited replay right after
/// it, one a microsecond.
const THAW_SLACK: T = MS;

/// Why a backend ended when its client closed the connection.
const CLIENT_CLOSED: &str = "client closed the connection";

/// Forged announcements come from these pids (no backend of the server has one).
const FORGED_PIDS: i32 = 900_000;

use crate::sim::{MS, Rng, SEC, T, epoch_us};

// ---- configuration ------------------------------------------------------------------

/// The manager options the nodes run with (the library's defaults).
#[derive(Clone, Copy, Debug)]
struct Timing {
    heartbeat: T,
    lease: T,
    stop_budget: T,
    margin: T,
    release: T,
    poll: T,
    grace: T,
    reconnect_min: T,
    reconnect_max: T,
    connect_timeout: T,
}

impl Default for Timing {
    fn default() -> Self {
        Self {
            heartbeat: SEC,
            lease: 3 * SEC,
            stop_budget: 2 * SEC,
            margin: SEC,
            release: 7 * SEC,
            poll: 300 * MS,
            grace: 100 * MS,
            reconnect_min: 100 * MS,
            reconnect_max: 5 * SEC,
            connect_timeout: 5 * SEC,
        }
    }
}

/// A fault a hand-written scenario injects at a given time.
#[derive(Clone, Debug)]
enum Scripted {
    /// The server terminates the backend of the node holding this key.
    TerminateHolder(usize),
    /// The server restarts and stays down this long.
    Restart { down: T },
    /// A foreign backend sends `count` release announcements of this key.
    ForgedFlood { key: usize, count: u32 },
    /// The holder of this key drops its lease now, handing the key over to the next
    /// node (review 2: `Lease::hand_over`).
    HandOverToNext(usize),
    /// The server's wall clock steps by this many microseconds.
    ClockStep(i64),
    /// The server goes down and another cluster comes up (pg_upgrade, a restore) on
    /// timeline 1 with smaller transaction ids; its token epoch set or not.
    Replace { down: T, epoch_set: bool },
    /// The DBA sets the replaced cluster's token epoch (and ends the sessions opened
    /// before).
    SetEpoch,
}

#[derive(Clone, Debug)]
struct Config {
    seed: u64,
    /// Key indexes of each node's singletons; empty: drawn (3–5 nodes, 1–2 each).
    singletons: Vec<Vec<usize>>,
    duration: T,
    random_faults: bool,
    script: Vec<(T, Scripted)>,
    /// A fixed stop time of children after a loss; `None`: drawn up to the budget.
    stop_time: Option<T>,
    /// Children sometimes give their lease up on their own.
    resign: bool,
    /// Half the requests take no token with the grant: their holders read it (issued
    /// by a token statement) before they start their work.
    lazy: bool,
    /// Rare reconnects slower than the takeover grace (gap (c)).
    slow_reconnects: bool,
    /// No fault is drawn from then on: once their effects end, every key some node
    /// waits for must be granted within [`LIVENESS`].
    quiet_after: Option<T>,
    trace: bool,
    /// Protections switched off in every node (see [`Protection`]).
    off: Vec<Protection>,
    /// The lease-row mode: sessions are holder ids, locks are rows (see the module's
    /// notes).
    rows: bool,
    /// A server that lets rows expire this soon after a renewal, whatever their
    /// sessions ask (a broken timing invariant, for the checks' own test).
    rows_ttl: Option<T>,
}

impl Config {
    fn random(seed: u64) -> Self {
        Self {
            seed,
            singletons: Vec::new(),
            duration: 60 * SEC,
            random_faults: true,
            script: Vec::new(),
            stop_time: None,
            resign: true,
            lazy: true,
            slow_reconnects: true,
            // Three seeds in ten settle for the last half of the run.
            quiet_after: (seed % 10 < 3).then_some(30 * SEC),
            trace: false,
            off: Vec::new(),
            rows: false,
            rows_ttl: None,
        }
    }

    /// A random run in the lease-row mode.
    fn rows(seed: u64) -> Self {
        Self {
            rows: true,
            ..Self::random(seed)
        }
    }

    fn scripted(seed: u64, singletons: Vec<Vec<usize>>, script: Vec<(T, Scripted)>) -> Self {
        Self {
            singletons,
            duration: 20 * SEC,
            random_faults: false,
            script,
            resign: false,
            lazy: false,
            slow_reconnects: false,
            ..Self::random(seed)
        }
    }
}

// ---- randomness -----------------------------------------------------------------------

// ---- messages and events --------------------------------------------------------------

/// The statements of one plan, as sent.
type Stmts = Plan;

/// Node → server, on the node's connection.
#[derive(Clone, Debug)]
enum Up {
    Connect {
        inst: u32,
        attempt: u64,
        handshake: T,
    },
    Batch {
        gn: u64,
        pid: i32,
        stmts: Box<Stmts>,
    },
    Heartbeat {
        gn: u64,
        pid: i32,
        beat: Beat,
    },
    Close {
        pid: i32,
    },
}

/// Server → node.
#[derive(Clone, Debug)]
enum Down {
    Connected {
        attempt: u64,
        pid: i32,
        proven_at: T,
        /// What the session's term query found (its `read_at` is the arrival): the
        /// age (`None`: unknown), the timeline plus epoch, the identity, the system.
        term_age: Option<T>,
        high: u16,
        identity: String,
        system: u32,
        first_xid: u64,
        /// For the checks: opened before the DBA set a replaced cluster's epoch.
        unepoched: bool,
    },
    Refused {
        attempt: u64,
    },
    Reply {
        gn: u64,
        reply: Reply,
    },
    HbOk {
        gn: u64,
        beat: Beat,
        /// The advisory locks the backend holds when the heartbeat runs.
        locks: Vec<SessionLock>,
    },
    Notify {
        to: i32,
        sender: i32,
        /// The sender's start: not in the message (the table never sees it), for the
        /// checks only.
        sender_start: T,
        /// When the server sent it (for the checks only).
        sent_at: T,
        keys: Vec<LockKey>,
        hand: Vec<(LockKey, u64)>,
    },
    Closed {
        pid: i32,
    },
    /// The lease-row mode: a batch's answer (interpreted by the node, as
    /// `rows_step::interpret` does for the real mode), with when the server ran it.
    RowsReply {
        gn: u64,
        at: T,
        steps: Box<Steps>,
        answer: Answer,
    },
    /// The lease-row mode: a batch (or a heartbeat) failed; any failure ends the
    /// session.
    Failed {
        gn: u64,
        why: &'static str,
    },
}

#[derive(Clone, Debug)]
enum Ev {
    // Node-side: deferred while the node is frozen.
    Wake {
        n: usize,
        inst: u32,
    },
    Deliver {
        n: usize,
        inst: u32,
        msg: Down,
    },
    HbTimer {
        n: usize,
        inst: u32,
        gn: u64,
    },
    Watchdog {
        n: usize,
        inst: u32,
        gn: u64,
    },
    ChildDrop {
        n: usize,
        inst: u32,
        s: usize,
        id: RequestId,
    },
    Resign {
        n: usize,
        inst: u32,
        s: usize,
        id: RequestId,
    },
    Reacquire {
        n: usize,
        inst: u32,
        s: usize,
    },
    /// The caller of a waiting request stops waiting (a timeout, a dropped future).
    GiveUp {
        n: usize,
        inst: u32,
        s: usize,
        id: RequestId,
    },
    Reconnect {
        n: usize,
        inst: u32,
    },
    /// A lost session kept open may have to be closed now.
    Retire {
        n: usize,
        inst: u32,
    },
    /// A plain lease's work stops, but its owner keeps the lease (never released).
    WorkStops {
        n: usize,
        inst: u32,
        s: usize,
        id: RequestId,
    },
    /// A shutdown's stage (1: the handle's wait for its supervisors, until the task
    /// reads the shutdown; 2: the engine's sequence), begun at `from`, must have ended
    /// `bound` later, unfrozen (the checks; not the node's).
    ShutdownBound {
        n: usize,
        inst: u32,
        from: T,
        stage: u8,
        bound: T,
    },
    ConnectTimeout {
        n: usize,
        inst: u32,
        attempt: u64,
    },
    // The rest of the world.
    Thaw {
        n: usize,
    },
    Heal {
        n: usize,
    },
    RestartNode {
        n: usize,
    },
    Arrive {
        n: usize,
        msg: Up,
    },
    IdleCheck {
        pid: i32,
    },
    /// A new backend, of no node, gets `pid` (of a backend that died) and sends the
    /// announcement `keys`, `hand`, then leaves at `leave`.
    PidReuse {
        pid: i32,
        keys: Vec<LockKey>,
        hand: Vec<(LockKey, u64)>,
        leave: T,
    },
    ForeignLeaves {
        pid: i32,
        start: T,
    },
    ServerUp,
    /// The DBA sets the token epoch of a replaced cluster.
    EpochSet,
    /// The server's clock steps; `young`: early in a term, where the term hold
    /// measures with it.
    ClockStep {
        young: bool,
    },
    FaultTick,
    Script(usize),
}

impl Ev {
    /// The node whose process runs this event, if any.
    fn node(&self) -> Option<usize> {
        match self {
            Ev::Wake { n, .. }
            | Ev::Deliver { n, .. }
            | Ev::HbTimer { n, .. }
            | Ev::Watchdog { n, .. }
            | Ev::ChildDrop { n, .. }
            | Ev::WorkStops { n, .. }
            | Ev::Resign { n, .. }
            | Ev::Reacquire { n, .. }
            | Ev::GiveUp { n, .. }
            | Ev::Reconnect { n, .. }
            | Ev::Retire { n, .. }
            | Ev::ConnectTimeout { n, .. } => Some(*n),
            _ => None,
        }
    }
}

#[derive(Debug)]
struct Queued {
    t: T,
    tie: u64,
    seq: u64,
    ev: Ev,
}

impl PartialEq for Queued {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Queued {}
impl PartialOrd for Queued {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Queued {
    fn cmp(&self, other: &Self) -> Ordering {
        // Reversed: the heap pops the earliest first.
        (other.t, other.tie, other.seq).cmp(&(self.t, self.tie, self.seq))
    }
}

// ---- the world ------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Conn {
    Down,
    Connecting { attempt: u64 },
    Up { gn: u64, pid: i32 },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Cut {
    None,
    Both,
    /// The node's messages to the server are held; the server's reach it.
    Up,
    /// The server's messages to the node are held; the node's reach it.
    Down,
}

/// What happens to a node's next statements at the server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BatchFault {
    /// The server runs and commits them, then the connection breaks before the reply.
    ReplyLost,
    /// The server ends the session while they run (a DBA's `transaction_timeout`, an
    /// out-of-memory kill of the backend).
    SessionEnds,
    /// Right after statements that win a key run, another client releases every
    /// advisory lock of the backend, and the connection turns slow (every message up to
    /// `extra` later, for `for_`): heartbeats sent before the win's answer arrives
    /// read a floor without the key.
    DiscardAfterWin { extra: T, for_: T },
}

#[derive(Clone, Copy, Debug)]
struct Closing {
    /// Until when the engine said to wait (for a command) or linger: the sequence goes
    /// on then, or at a command if it waits (`Wait`).
    until: T,
    /// The sequence may go on at a command (a lease dropped) before `until`.
    on_command: bool,
    /// The statements in flight end by then, or the shutdown gives up on them.
    statement_deadline: Option<T>,
    /// The task has read the shutdown: the engine's sequence runs. Until then the
    /// handle waits for its supervisors (their children stopping), and the task goes on
    /// as usual (steps, reconnects, notifications).
    begun: bool,
    /// The task has read the handle's `Closing` (between steps): nothing is granted.
    read: bool,
    /// The handle sends the shutdown once every child has stopped, or by then.
    supervisors_until: T,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SState {
    Idle,
    Waiting(RequestId),
    /// Granted without its token (a lazy request): it reads the token first and starts
    /// its work once the token is issued (a holder that fences what it does).
    Reading {
        id: RequestId,
        how: How,
        decided_at: T,
        /// When it was granted, and how its session's tenure of the key began.
        granted: T,
        origin: Origin,
    },
    Holding {
        id: RequestId,
        run: usize,
    },
    Stopping {
        id: RequestId,
        run: usize,
    },
    Gone,
}

#[derive(Debug)]
struct Single {
    key: LockKey,
    state: SState,
    /// When its current request was made.
    since: T,
    /// Run by a supervisor (a singleton, an election) that `LockManager::shutdown`
    /// stops first and waits for; otherwise a plain lease, whose owner hears of the
    /// shutdown only when the task stops trusting every lease.
    supervised: bool,
}

#[derive(Debug)]
struct Node {
    inst: u32,
    engine: Engine,
    conn: Conn,
    gens: u64,
    attempt: u64,
    valid_until: T,
    /// The heartbeat's rules for this generation (the real `Pulse`), and the lock
    /// floor its pooler guard compares with (the real `ServerFloor`, as `Shared` keeps
    /// it).
    pulse: Option<Pulse>,
    floor: ServerFloor,
    busy: Option<Stmts>,
    closing: Option<Closing>,
    /// The process ended (graceful shutdown); restarted later as a new instance.
    down: bool,
    singles: Vec<Single>,
    /// Index into `Sim::freezes` while frozen.
    frozen: Option<usize>,
    deferred: Vec<Ev>,
    /// A partition of its connection: both ways, or one (messages held until it heals,
    /// as TCP does).
    cut: Cut,
    held_up: Vec<Up>,
    /// Messages to the node held by a cut, with when they were sent (a reply to a
    /// connect is sent once its handshake is done, which may be after the cut heals).
    held_down: Vec<(u32, Down, T)>,
    last_up: T,
    last_down: T,
    wake_at: Option<T>,
    next_req: RequestId,
    /// Backends of lost sessions kept open (the engine's rule 6), oldest first.
    retiring: std::collections::VecDeque<i32>,
    /// Until then every message on its connection takes up to `slow_extra` longer.
    slow_until: T,
    slow_extra: T,
    /// What happens to the next statements it sends.
    batch_fault: Option<BatchFault>,
    /// When this instance's engine last saw a session end (0: never).
    end_seen: T,
    /// Requests whose caller stopped waiting: a grant for one never reaches it.
    abandoned: BTreeSet<RequestId>,
    /// Requests that asked for their token with the grant.
    eager: BTreeSet<RequestId>,
    /// The clusters (system identifiers) this instance had a session on.
    known_systems: BTreeSet<u32>,
    /// Their withdrawals, read after the statement in flight answers (the task reads
    /// commands between steps).
    withdrawals: Vec<(LockKey, RequestId)>,
    /// Releases sent that the task has not answered yet (it answers them after the next
    /// step, or when the session is lost): a supervisor ends once its release answered.
    releases_unanswered: u32,
    /// Notifications that arrived while a statement was in flight, with their arrival:
    /// the task reads them after the step (applied then, stamped with their arrival).
    notes: Vec<(Down, T)>,
    /// The term of its last session, and the end seen before its first session of it
    /// (what the engine counts its own-clock term hold from).
    last_identity: Option<String>,
    term_end_seen: T,
    /// The lease-row mode: heartbeats of the session sent and not answered yet (with
    /// the statement in flight, what a terminated pooled connection fails), and the
    /// high bits of the session's tokens.
    hb_out: u32,
    rows_high: u16,
}

/// A lease-row session as the server's side of the simulation knows it: a holder id
/// whose batches go over a pooled connection (a new one once that one ended).
#[derive(Clone, Debug)]
struct RowsSession {
    n: usize,
    inst: u32,
    /// The server identity it began on: a batch that reaches another server fails.
    identity: String,
    /// When it began (what its rows carry as `start`).
    start: i64,
    /// Its pooled connection (a backend of the server).
    conn: i32,
    /// The backend it opened on (its cluster, its token epoch).
    opened_on: Backend,
}

/// Which end of an old holder's session bounds an overlap (see `within_gap_c`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum End {
    /// The server ended it.
    Server,
    /// Another client released its locks (gap (e)).
    Discard,
}

/// How a tenure began, and the server time that decided it.
type Origin = (How, T);

/// How a grant came about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum How {
    /// In the answer to a try (free key, announced release, or a brand-new slot).
    Direct,
    /// After the grace, on a clear stop-fence check.
    Checked,
    /// A local hand-off with a fresh token.
    Handoff,
    /// The old holder's fence outlived the maximum fence wait.
    Expired,
}

#[derive(Clone, Debug)]
struct Run {
    key: LockKey,
    n: usize,
    inst: u32,
    /// The backend of the session it was granted on.
    pid: i32,
    /// When its request was made.
    asked_at: T,
    /// Its session did not hold the key at the server when it was granted (the server
    /// had ended it, or another client had released its locks, and the answer that
    /// granted it was on its way).
    stale: bool,
    /// Granted on a replaced cluster before its token epoch was set, by a node that
    /// never saw the old one: its token need not order after earlier tenures' on
    /// other clusters (`system`).
    unepoched: bool,
    system: u32,
    token: FencingToken,
    how: How,
    grant_at: T,
    /// How the session's tenure of the key began (a hand-off keeps the server lock, so
    /// it inherits the grant that won it) and the server time that decided it (the try
    /// or the clear check).
    origin: (How, T),
    acting_end: Option<T>,
    drop_at: Option<T>,
    /// Granted after the node's validity deadline had passed (a node waking from a
    /// freeze): the lease is invalid from the start, its child never acts.
    born_invalid: bool,
    /// Granted at once on a release announcement the table believed (no grace): when
    /// the server sent it, and when it arrived.
    on_announcement: Option<(T, T, i32)>,
}

#[derive(Clone, Copy, Debug)]
struct Freeze {
    n: usize,
    inst: u32,
    from: T,
    to: T,
    /// The server ended the node's session while it was frozen.
    server_ended: bool,
    /// The server's wall clock when the freeze began, and the latest it read during the
    /// freeze (a backward step of it makes a row expired meanwhile look live again).
    wall_from: i64,
    wall_peak: i64,
}

/// What a run counted.
#[derive(Clone, Debug, Default)]
struct Stats {
    seeds: u64,
    events: u64,
    virtual_us: u64,
    grants: u64,
    takeovers: u64,
    grants_by_how: BTreeMap<&'static str, u64>,
    faults: BTreeMap<&'static str, u64>,
    idle_timeouts: u64,
    /// Sessions that started on a young term, so their grants were held.
    term_holds: u64,
    fence_waits: u64,
    statements: u64,
    /// Overlaps of running children in the known gaps.
    gap_a: u64,
    gap_b: u64,
    gap_c: u64,
    /// Gap (c) where the old holder's child was still acting (the news of the end of
    /// its session had not reached it: a slow network).
    gap_c_acting: u64,
    /// A grant on a release announcement whose sender's tenure began in gap (c) of a
    /// run still stopping.
    gap_c_chained: u64,
    gap_d: u64,
    /// Gap (e): another client released the old holder's locks behind its back; the
    /// lock guard ends its session with the next heartbeat (gap (c)'s bound).
    gap_e: u64,
    gap_e_acting: u64,
    /// Gap (a) by another path: the old holder froze while stopping, until the new
    /// holder's maximum fence wait ran out.
    gap_a_fence_wait: u64,
    /// Gap (b) where the old holder's child was still *acting* (it had not learned of
    /// its loss yet: a network latency).
    gap_b_acting: u64,
    /// A brand-new requester won while the old holder's stop fence was in place.
    b_past_fence: u64,
    /// Grants with a smaller token than the key's last grant, by a node whose validity
    /// deadline had passed (after a freeze).
    stale_grants: u64,
    /// Overlaps with a run granted on a session the server had already ended (the
    /// answer was on its way), fenced by the earlier run's greater token.
    stale_grant_overlaps: u64,
    /// Grants inside the term hold by a process that did not see the old term end,
    /// after the server's clock stepped forward past the tolerance.
    beyond_clock_tolerance: u64,
    /// Grants that never reached their caller (it had stopped waiting).
    undelivered: u64,
    /// Lazy holders' token reads answered with a token, and without one.
    tokens_read: u64,
    tokens_unread: u64,
    /// Sessions ended by the heartbeat's lock guard.
    pooler_detected: u64,
    /// Runs whose faults stopped early enough to check that wanted keys are granted,
    /// and the longest a wanted key stayed free in them after the faults' effects
    /// ended (a maximum, not a sum).
    settled_runs: u64,
    longest_wait_settled: T,
    /// Sessions refused by the token floor (a replaced cluster without its epoch).
    refused_sessions: u64,
    /// Grants whose token was not above the key's last, on a replaced cluster whose
    /// epoch the DBA had not set yet, by a node that never saw the old cluster.
    epoch_unset_grants: u64,
    /// Shutdowns: finished, and among them those whose session failed under them (a
    /// closing statement lost, or past its deadline and given up on).
    shutdowns: u64,
    shutdowns_failed: u64,
    closing_given_up: u64,
    /// The lease-row mode: expired rows taken over (of them, rows a promotion had
    /// shortened), batches committed after their client had given them up, and
    /// freezes across the expiry of a row of the process (gap (a)'s freeze window).
    row_takeovers: u64,
    shortened_takeovers: u64,
    late_commits: u64,
    thawed_past_deadline: u64,
    violations: u64,
}

impl Stats {
    fn add(&mut self, o: &Stats) {
        self.seeds += o.seeds;
        self.events += o.events;
        self.virtual_us += o.virtual_us;
        self.grants += o.grants;
        self.takeovers += o.takeovers;
        for (k, v) in &o.grants_by_how {
            *self.grants_by_how.entry(k).or_default() += v;
        }
        for (k, v) in &o.faults {
            *self.faults.entry(k).or_default() += v;
        }
        self.idle_timeouts += o.idle_timeouts;
        self.term_holds += o.term_holds;
        self.fence_waits += o.fence_waits;
        self.statements += o.statements;
        self.gap_a += o.gap_a;
        self.gap_b += o.gap_b;
        self.gap_c += o.gap_c;
        self.gap_c_acting += o.gap_c_acting;
        self.gap_c_chained += o.gap_c_chained;
        self.gap_d += o.gap_d;
        self.gap_e += o.gap_e;
        self.gap_e_acting += o.gap_e_acting;
        self.gap_a_fence_wait += o.gap_a_fence_wait;
        self.gap_b_acting += o.gap_b_acting;
        self.b_past_fence += o.b_past_fence;
        self.stale_grants += o.stale_grants;
        self.refused_sessions += o.refused_sessions;
        self.shutdowns += o.shutdowns;
        self.shutdowns_failed += o.shutdowns_failed;
        self.closing_given_up += o.closing_given_up;
        self.undelivered += o.undelivered;
        self.tokens_read += o.tokens_read;
        self.tokens_unread += o.tokens_unread;
        self.pooler_detected += o.pooler_detected;
        self.settled_runs += o.settled_runs;
        self.longest_wait_settled = self.longest_wait_settled.max(o.longest_wait_settled);
        self.beyond_clock_tolerance += o.beyond_clock_tolerance;
        self.stale_grant_overlaps += o.stale_grant_overlaps;
        self.epoch_unset_grants += o.epoch_unset_grants;
        self.row_takeovers += o.row_takeovers;
        self.shortened_takeovers += o.shortened_takeovers;
        self.late_commits += o.late_commits;
        self.thawed_past_deadline += o.thawed_past_deadline;
        self.violations += o.violations;
    }
}

#[derive(Debug)]
struct Outcome {
    stats: Stats,
    violations: Vec<String>,
    runs: Vec<Run>,
    trace: Vec<String>,
    /// Seeds of the finding "a brand-new requester ignores a stop fence" (not a failure
    /// of the known gaps, kept apart).
    past_fence: Vec<String>,
    stale_grants: Vec<String>,
    /// When the server ran a try statement, per node.
    tries: Vec<Vec<T>>,
}

struct Sim {
    cfg: Config,
    t: Timing,
    base: Instant,
    now: T,
    rng: Rng,
    queue: BinaryHeap<Queued>,
    seq: u64,
    keys: Vec<LockKey>,
    nodes: Vec<Node>,
    server: Server,
    runs: Vec<Run>,
    /// Tenures granted without a token whose holder dropped them before the token came
    /// (key, the session's pid, grant, and the server time its tenure began): tenures
    /// all the same, whose announced release vouches for itself only.
    unrun: Vec<(LockKey, i32, T, T)>,
    /// The server time of the last win or clear fence check of each node's key.
    decided: BTreeMap<(usize, LockKey), T>,
    freezes: Vec<Freeze>,
    pid_owners: BTreeMap<i32, (usize, u32)>,
    /// The start of the backend that last sent each node an announcement of a key, per
    /// sender pid (kept whatever the table made of it: an announcement that arrives
    /// during a try counts once the try answers): the checks compare it with the start
    /// of the holder the table believes released the key.
    announcers: BTreeMap<(usize, LockKey, i32), T>,
    last_token: BTreeMap<LockKey, FencingToken>,
    last_grantee: BTreeMap<LockKey, usize>,
    stats: Stats,
    violations: Vec<String>,
    past_fence: Vec<String>,
    stale_grants: Vec<String>,
    trace: Vec<String>,
    tries: Vec<Vec<T>>,
    /// Review 2: the target of the lease being dropped (a scripted hand-over).
    hand_over_next: Option<u64>,
    /// Keys of the reply being applied whose table believed a release announcement,
    /// and when the server sent it.
    announced_now: Vec<(usize, LockKey, (T, T, i32))>,
    /// When the server sent the announcement each node's table last came to believe.
    announced_sent: BTreeMap<(usize, LockKey), (T, T, i32)>,
    /// Announcements that arrived during a key's try.
    in_flight_notes: BTreeMap<(usize, LockKey), Vec<Note>>,
    resign_to: BTreeMap<(usize, RequestId), u64>,
    /// The cluster of each key's last grant.
    last_system: BTreeMap<LockKey, u32>,
    /// Node instances that knew a cluster since replaced.
    saw_old_cluster: BTreeSet<(usize, u32)>,
    /// When the effects of the faults drawn so far end at the latest (a partition
    /// heals, a freeze thaws, a server's term hold ends, a node restarts).
    disturbed_until: T,
    /// The last grant that never reached its caller, per node instance and key: when,
    /// and how its tenure began (a local hand-off that follows inherits it).
    undelivered_origin: BTreeMap<(usize, u32, LockKey), (T, Origin)>,
    /// The lease-row mode: every session (by holder id), the holder of each pooled
    /// connection, the next holder id, and until when each holder's client trusted its
    /// rows (its validity deadline: the send time of its last answered heartbeat plus
    /// the lease timeout).
    rows_sessions: BTreeMap<i32, RowsSession>,
    conn_holder: BTreeMap<i32, i32>,
    next_holder: i32,
    trust: BTreeMap<i32, T>,
    /// The next forward step of the server's clock comes no sooner (the rows' expiry
    /// absorbs one step of up to `safety_margin` per row lifetime).
    next_forward_step: T,
}

impl Sim {
    fn new(cfg: Config) -> Self {
        let mut rng = Rng::new(cfg.seed);
        let keys: Vec<LockKey> = (0..2).map(|i| LockKey::Pair(7, i)).collect();
        let fence_of = keys.iter().map(|k| (*k, k.stop_fence())).collect();
        let layout: Vec<Vec<usize>> = if cfg.singletons.is_empty() {
            let n = rng.range(3, 5) as usize;
            (0..n)
                .map(|_| {
                    let count = rng.range(1, 2);
                    (0..count).map(|_| rng.below(2) as usize).collect()
                })
                .collect()
        } else {
            cfg.singletons.clone()
        };
        let t = Timing::default();
        let nodes = layout
            .iter()
            .enumerate()
            .map(|(i, ks)| Node {
                inst: 0,
                engine: Engine::new(
                    Rules {
                        node: i as u64 + 1,
                        ..rules(&t)
                    },
                    engine_timing(&t),
                    rng.next(),
                ),
                conn: Conn::Down,
                gens: 0,
                attempt: 0,
                valid_until: 0,
                pulse: None,
                floor: ServerFloor::default(),
                busy: None,
                closing: None,
                down: false,
                singles: ks
                    .iter()
                    .enumerate()
                    .map(|(j, k)| Single {
                        key: keys[*k],
                        state: SState::Idle,
                        since: 0,
                        supervised: (i + j) % 3 != 2,
                    })
                    .collect(),
                frozen: None,
                deferred: Vec::new(),
                cut: Cut::None,
                held_up: Vec::new(),
                held_down: Vec::new(),
                last_up: 0,
                last_down: 0,
                wake_at: None,
                next_req: 1,
                retiring: std::collections::VecDeque::new(),
                slow_until: 0,
                slow_extra: 0,
                batch_fault: None,
                end_seen: 0,
                abandoned: BTreeSet::new(),
                eager: BTreeSet::new(),
                known_systems: BTreeSet::new(),
                withdrawals: Vec::new(),
                notes: Vec::new(),
                releases_unanswered: 0,
                last_identity: None,
                term_end_seen: 0,
                hb_out: 0,
                rows_high: 0,
            })
            .collect::<Vec<_>>();
        let mut nodes = nodes;
        for node in &mut nodes {
            for p in &cfg.off {
                node.engine.switch_off(*p);
            }
        }
        let tries = vec![Vec::new(); nodes.len()];
        Self {
            cfg,
            t,
            base: Instant::now(),
            now: 0,
            rng,
            queue: BinaryHeap::new(),
            seq: 0,
            keys,
            nodes,
            server: Server::new(fence_of),
            saw_old_cluster: BTreeSet::new(),
            last_system: BTreeMap::new(),
            undelivered_origin: BTreeMap::new(),
            disturbed_until: 0,
            runs: Vec::new(),
            unrun: Vec::new(),
            decided: BTreeMap::new(),
            freezes: Vec::new(),
            pid_owners: BTreeMap::new(),
            announcers: BTreeMap::new(),
            last_token: BTreeMap::new(),
            last_grantee: BTreeMap::new(),
            stats: Stats::default(),
            violations: Vec::new(),
            past_fence: Vec::new(),
            stale_grants: Vec::new(),
            trace: Vec::new(),
            tries,
            hand_over_next: None,
            announced_now: Vec::new(),
            announced_sent: BTreeMap::new(),
            in_flight_notes: BTreeMap::new(),
            resign_to: BTreeMap::new(),
            rows_sessions: BTreeMap::new(),
            conn_holder: BTreeMap::new(),
            next_holder: FIRST_HOLDER,
            trust: BTreeMap::new(),
            next_forward_step: 0,
        }
    }

    fn at(&self, t: T) -> Instant {
        self.base + Duration::from_micros(t)
    }

    fn t_of(&self, i: Instant) -> T {
        // Rounded up: a wake-up a fraction of a microsecond early would find nothing due.
        i.saturating_duration_since(self.base)
            .as_nanos()
            .div_ceil(1000) as T
    }

    fn log(&mut self, line: impl FnOnce() -> String) {
        if self.cfg.trace {
            let text = line();
            let now = self.now;
            self.trace
                .push(format!("{:>9.3} ms  {text}", now as f64 / 1000.0));
        }
    }

    #[expect(
        clippy::needless_pass_by_value,
        reason = "every caller builds the text with format!"
    )]
    fn violation(&mut self, text: String) {
        self.log(|| format!("VIOLATION {text}"));
        self.violations
            .push(format!("at {:.3} ms: {text}", self.now as f64 / 1000.0));
    }

    fn push(&mut self, t: T, ev: Ev) {
        self.seq += 1;
        let tie = self.rng.next();
        self.queue.push(Queued {
            t: t.max(self.now),
            tie,
            seq: self.seq,
            ev,
        });
    }

    /// A message's way on node `n`'s connection: slower while its replies are slow.
    fn latency_of(&mut self, n: usize) -> T {
        let base = self.latency();
        let node = &self.nodes[n];
        if self.now < node.slow_until {
            let extra = node.slow_extra;
            base + self.rng.range(extra / 2, extra)
        } else {
            base
        }
    }

    fn latency(&mut self) -> T {
        if self.rng.chance(4) {
            self.rng.range(5 * MS, 40 * MS)
        } else {
            self.rng.range(100, 1_500)
        }
    }

    fn stop_time(&mut self) -> T {
        if let Some(t) = self.cfg.stop_time {
            return t;
        }
        let budget = self.t.stop_budget;
        if self.rng.chance(30) {
            self.rng.range(budget * 8 / 10, budget)
        } else {
            self.rng.range(0, budget)
        }
    }

    fn fault(&mut self, kind: &'static str) {
        *self.stats.faults.entry(kind).or_default() += 1;
    }

    // ---- the loop ---------------------------------------------------------------------

    fn run(mut self) -> Outcome {
        for n in 0..self.nodes.len() {
            let t = self.rng.range(0, 50 * MS);
            self.push(t, Ev::Reconnect { n, inst: 0 });
            for s in 0..self.nodes[n].singles.len() {
                let t = self.rng.range(0, 200 * MS);
                self.push(t, Ev::Reacquire { n, inst: 0, s });
            }
        }
        if self.cfg.random_faults {
            let t = self.rng.range(2 * SEC, 5 * SEC);
            self.push(t, Ev::FaultTick);
        }
        for i in 0..self.cfg.script.len() {
            let t = self.cfg.script[i].0;
            self.push(t, Ev::Script(i));
        }
        let mut same_instant = 0u32;
        while let Some(q) = self.queue.pop() {
            if q.t > self.cfg.duration {
                break;
            }
            same_instant = if q.t == self.now { same_instant + 1 } else { 0 };
            if same_instant > 100_000 {
                self.violation(format!(
                    "livelock: 100,000 events at one instant, the last {:?}",
                    q.ev
                ));
                break;
            }
            self.now = q.t;
            self.stats.events += 1;
            if let Some(n) = q.ev.node()
                && self.nodes[n].frozen.is_some()
            {
                self.nodes[n].deferred.push(q.ev);
                continue;
            }
            self.handle(q.ev);
        }
        self.now = self.cfg.duration;
        self.judge();
        self.check_liveness();
        self.check_reads_answered();
        self.stats.seeds = 1;
        self.stats.virtual_us = self.cfg.duration;
        self.stats.violations = self.violations.len() as u64;
        Outcome {
            stats: self.stats,
            violations: self.violations,
            runs: self.runs,
            trace: self.trace,
            past_fence: self.past_fence,
            stale_grants: self.stale_grants,
            tries: self.tries,
        }
    }

    /// Every token read is answered: a holder still waiting for its token long after
    /// its grant, on a node neither frozen nor down, is a hang of `Lease::fencing_token`.
    fn check_reads_answered(&mut self) {
        let mut hung = Vec::new();
        for (n, node) in self.nodes.iter().enumerate() {
            if node.down || node.frozen.is_some() {
                continue;
            }
            for single in &node.singles {
                if let SState::Reading { id, granted, .. } = single.state
                    && granted + 20 * SEC < self.now
                {
                    hung.push(format!(
                        "n{n} request {id} waits for its token of {} since {:.3} ms",
                        single.key,
                        granted as f64 / 1000.0
                    ));
                }
            }
        }
        for h in hung {
            self.violation(h);
        }
    }

    fn current(&self, n: usize, inst: u32) -> bool {
        self.nodes[n].inst == inst && !self.nodes[n].down
    }

    fn handle(&mut self, ev: Ev) {
        match ev {
            Ev::Wake { n, inst } => {
                if self.current(n, inst) {
                    if self.nodes[n].wake_at.is_some_and(|w| w <= self.now) {
                        self.nodes[n].wake_at = None;
                    }
                    self.node_loop(n);
                }
            }
            Ev::Deliver { n, inst, msg } => {
                if self.current(n, inst) {
                    self.deliver(n, msg);
                }
            }
            Ev::HbTimer { n, inst, gn } => {
                // The shutdown revoked the generation: its heartbeat task has ended.
                if !self.current(n, inst) || self.nodes[n].closing.is_some_and(|c| c.begun) {
                    return;
                }
                let Conn::Up { gn: g, pid } = self.nodes[n].conn else {
                    return;
                };
                if g != gn {
                    return;
                }
                if self.now >= self.nodes[n].valid_until {
                    return self.lose_session(n, "heartbeat overdue");
                }
                let now = self.at(self.now);
                let node = &mut self.nodes[n];
                let Some(pulse) = node.pulse.as_mut() else {
                    return;
                };
                // `None`: the most allowed are on their way; due again when one answers.
                let Some(due) = pulse.next_send() else {
                    return;
                };
                if due > now {
                    let at = self.t_of(due);
                    return self.push(at, Ev::HbTimer { n, inst, gn });
                }
                let beat = pulse.send(now, node.floor.get());
                let next = pulse.next_send();
                node.hb_out += 1;
                self.send_up(n, Up::Heartbeat { gn, pid, beat });
                if let Some(next) = next {
                    let at = self.t_of(next);
                    self.push(at, Ev::HbTimer { n, inst, gn });
                }
            }
            Ev::Watchdog { n, inst, gn } => {
                if self.current(n, inst)
                    && !self.nodes[n].closing.is_some_and(|c| c.begun)
                    && matches!(self.nodes[n].conn, Conn::Up { gn: g, .. } if g == gn)
                    && self.now >= self.nodes[n].valid_until
                {
                    self.lose_session(n, "validity deadline passed");
                }
            }
            Ev::ChildDrop { n, inst, s, id } => {
                if self.current(n, inst) {
                    self.child_drop(n, s, id);
                }
            }
            Ev::WorkStops { n, inst, s, id } => {
                if self.current(n, inst)
                    && let SState::Stopping { id: h, run } = self.nodes[n].singles[s].state
                    && h == id
                {
                    let r = &mut self.runs[run];
                    r.drop_at = Some(self.now);
                    r.acting_end.get_or_insert(self.now);
                    self.log(|| format!("n{n} work of run {run} stopped; its lease is kept"));
                    self.nodes[n].singles[s].state = SState::Gone;
                }
            }
            Ev::Resign { n, inst, s, id } => {
                if self.current(n, inst)
                    && let SState::Holding { id: h, run } = self.nodes[n].singles[s].state
                    && h == id
                {
                    self.nodes[n].singles[s].state = SState::Stopping { id, run };
                    let t = self.now + self.rng.range(0, 200 * MS);
                    self.push(t, Ev::ChildDrop { n, inst, s, id });
                    self.log(|| format!("n{n} child of run {run} resigns"));
                    // Half the resignations hand the key over (to another node, or to
                    // one that does not exist).
                    if self.rng.chance(50) {
                        let m = self.rng.below(self.nodes.len() as u64 + 1);
                        self.resign_to.insert((n, id), m + 1);
                    }
                }
            }
            Ev::Reacquire { n, inst, s } => {
                if self.current(n, inst) {
                    self.reacquire(n, s);
                }
            }
            Ev::GiveUp { n, inst, s, id } => {
                if self.current(n, inst) && self.nodes[n].singles[s].state == SState::Waiting(id) {
                    self.give_up(n, s, id);
                }
            }
            Ev::Reconnect { n, inst } => {
                if self.current(n, inst)
                    && self.nodes[n].conn == Conn::Down
                    && !self.nodes[n].closing.is_some_and(|c| c.begun)
                {
                    let node = &mut self.nodes[n];
                    node.attempt += 1;
                    node.gens += 1;
                    let attempt = node.attempt;
                    node.conn = Conn::Connecting { attempt };
                    let handshake = if self.cfg.slow_reconnects && self.rng.chance(4) {
                        self.rng.range(60 * MS, 400 * MS)
                    } else {
                        self.rng.range(MS, 25 * MS)
                    };
                    self.send_up(
                        n,
                        Up::Connect {
                            inst,
                            attempt,
                            handshake,
                        },
                    );
                    let t = self.now + self.t.connect_timeout;
                    self.push(t, Ev::ConnectTimeout { n, inst, attempt });
                }
            }
            Ev::ShutdownBound {
                n,
                inst,
                from,
                stage,
                bound,
            } => {
                let node = &self.nodes[n];
                let open = match node.closing {
                    Some(c) => stage == 2 || !c.begun,
                    None => false,
                };
                if node.inst == inst && !node.down && open {
                    // Frozen meanwhile, it had that much less time.
                    let frozen: T = self
                        .freezes
                        .iter()
                        .filter(|f| f.n == n && f.inst == inst && f.to > from)
                        .map(|f| f.to.min(self.now) - f.from.max(from))
                        .sum();
                    if node.frozen.is_some() || self.now < from + bound + frozen {
                        let t = self.now + frozen.max(SEC);
                        self.push(
                            t,
                            Ev::ShutdownBound {
                                n,
                                inst,
                                from,
                                stage,
                                bound,
                            },
                        );
                    } else {
                        self.violation(format!(
                            "n{n}'s shutdown still in stage {stage} {} ms after the stage began",
                            (self.now - from) / MS
                        ));
                    }
                }
            }
            Ev::Retire { n, inst } => {
                if self.current(n, inst) {
                    self.close_retired(n);
                }
            }
            Ev::ConnectTimeout { n, inst, attempt } => {
                if self.current(n, inst) {
                    self.connect_failed(n, attempt);
                }
            }
            Ev::Thaw { n } => {
                self.disturbed_until = self.disturbed_until.max(self.now);
                let idx = self.nodes[n]
                    .frozen
                    .take()
                    .expect("BUG: thaw of a running node");
                self.log(|| format!("n{n} thaws (freeze {idx})"));
                // The lease-row mode: a row of the process's sessions (a lease, or the
                // stop fence that keeps its stopping work apart) expired during the
                // freeze, or expires before the process can stop its work (rows are not
                // kept by a session kept open, as advisory locks are): what it still
                // runs after the freeze is the freeze window, fenced by the token, as a
                // session the server ended during a freeze. (A row taken over during
                // the freeze marks it too, see `check_takeovers`.)
                if self.cfg.rows {
                    let inst = self.nodes[n].inst;
                    // By the server's clock as it read then: a row that expired before
                    // a backward step of it during the freeze expired all the same.
                    let from = self.freezes[idx].wall_from;
                    let until = self
                        .server
                        .wall(self.now + self.t.stop_budget)
                        .max(self.freezes[idx].wall_peak);
                    let mine = |h: i32| {
                        self.rows_sessions
                            .get(&h)
                            .is_some_and(|s| s.n == n && s.inst == inst)
                    };
                    let expiring = self
                        .server
                        .rows
                        .values()
                        .map(|r| (r.holder, r.expires))
                        .chain(self.server.fence_rows.iter().map(|((_, h), e)| (*h, *e)))
                        .any(|(h, e)| from < e && e <= until && mine(h));
                    if expiring {
                        self.stats.thawed_past_deadline += 1;
                        self.freezes[idx].server_ended = true;
                    }
                }
                let deferred = std::mem::take(&mut self.nodes[n].deferred);
                for (i, ev) in deferred.into_iter().enumerate() {
                    self.push(self.now + i as T, ev);
                }
            }
            Ev::Heal { n } => {
                self.disturbed_until = self.disturbed_until.max(self.now);
                self.nodes[n].cut = Cut::None;
                self.log(|| format!("n{n} partition heals"));
                for msg in std::mem::take(&mut self.nodes[n].held_up) {
                    self.send_up(n, msg);
                }
                for (inst, msg, at) in std::mem::take(&mut self.nodes[n].held_down) {
                    self.send_down(n, inst, msg, at.max(self.now));
                }
            }
            Ev::RestartNode { n } => {
                self.disturbed_until = self.disturbed_until.max(self.now);
                self.restart_node(n);
            }
            Ev::Arrive { n, msg } => self.arrive(n, msg),
            Ev::IdleCheck { pid } => {
                if let Some(b) = self.server.backends.get(&pid)
                    && b.last + self.t.release <= self.now
                {
                    self.stats.idle_timeouts += 1;
                    self.terminate(pid, true, "idle_session_timeout");
                }
            }
            Ev::PidReuse {
                pid,
                keys,
                hand,
                leave,
            } => {
                if self.server.backends.contains_key(&pid)
                    || self.server.foreign.contains_key(&pid)
                    || !self.server.up
                {
                    return;
                }
                self.fault("pid_reuse");
                let start = self.now;
                self.log(|| {
                    format!("PID REUSE: a foreign backend gets pid {pid}, announces {keys:?}")
                });
                self.server.foreign.insert(pid, start);
                self.notify_for(pid, &keys, &hand);
                self.push(leave.max(self.now), Ev::ForeignLeaves { pid, start });
            }
            Ev::ForeignLeaves { pid, start } => {
                if self.server.foreign.get(&pid) == Some(&start) {
                    self.server.foreign.remove(&pid);
                }
            }
            Ev::ServerUp => self.server_up(),
            Ev::ClockStep { young } => self.clock_step(young),
            Ev::EpochSet => {
                self.disturbed_until = self.disturbed_until.max(self.now);
                let server = &mut self.server;
                if server.epoch_missing {
                    // The documented procedure: set it, then end the sessions opened
                    // before (each reads it once, when it connects).
                    server.epoch_missing = false;
                    server.epoch = server.epoch_due;
                    self.log(|| "the DBA sets the replaced cluster's token epoch".to_owned());
                    let pids: Vec<i32> = self.server.backends.keys().copied().collect();
                    for pid in pids {
                        self.terminate(pid, true, "pg_terminate_backend after the epoch");
                    }
                }
            }
            Ev::FaultTick if self.cfg.quiet_after.is_some_and(|q| self.now >= q) => {}
            Ev::FaultTick => {
                self.random_fault();
                let t = self.now + self.rng.range(SEC, 6 * SEC);
                self.push(t, Ev::FaultTick);
            }
            Ev::Script(i) => {
                let what = self.cfg.script[i].1.clone();
                match what {
                    Scripted::TerminateHolder(k) => {
                        let key = self.keys[k];
                        if let Some(pid) = self.holder_pid(key) {
                            self.fault("terminate");
                            self.terminate(pid, true, "pg_terminate_backend");
                        }
                    }
                    Scripted::Restart { down } => self.restart_server(down),
                    Scripted::ClockStep(step) => self.step_clock(step),
                    Scripted::Replace { down, epoch_set } => {
                        let xid = self.server.xid / 2;
                        self.server_down(down, Coming::Replaced { xid, epoch_set });
                    }
                    Scripted::SetEpoch => self.handle(Ev::EpochSet),
                    Scripted::ForgedFlood { key, count } => {
                        let key = self.keys[key];
                        self.forged(key, count);
                    }
                    Scripted::HandOverToNext(k) => {
                        let key = self.keys[k];
                        let holder = (0..self.nodes.len()).find_map(|n| {
                            self.nodes[n]
                                .singles
                                .iter()
                                .enumerate()
                                .find_map(|(s, single)| match single.state {
                                    SState::Holding { id, run } if single.key == key => {
                                        Some((n, s, id, run))
                                    }
                                    _ => None,
                                })
                        });
                        if let Some((n, s, id, run)) = holder {
                            let to = ((n + 1) % self.nodes.len()) as u64 + 1;
                            self.log(|| format!("n{n} hands {key} over to n{}", to - 1));
                            // The child stops at once, then the lease is handed over.
                            self.nodes[n].singles[s].state = SState::Stopping { id, run };
                            self.hand_over_next = Some(to);
                            self.child_drop(n, s, id);
                            self.hand_over_next = None;
                        }
                    }
                }
            }
        }
    }

    // ---- the node: the driver's loop ------------------------------------------------

    fn schedule_wake(&mut self, n: usize, at: T) {
        let at = at.max(self.now);
        if let Some(w) = self.nodes[n].wake_at
            && w >= self.now
            && w <= at
        {
            return;
        }
        self.nodes[n].wake_at = Some(at);
        let inst = self.nodes[n].inst;
        self.push(at, Ev::Wake { n, inst });
    }

    fn poke(&mut self, n: usize) {
        self.schedule_wake(n, self.now);
    }

    /// Closes the lost sessions the engine lets close (rule 6).
    fn close_retired(&mut self, n: usize) {
        let now = self.at(self.now);
        for _ in 0..self.nodes[n].engine.close_retired(now) {
            if let Some(pid) = self.nodes[n].retiring.pop_front() {
                self.log(|| format!("n{n} closes its lost session's backend {pid}"));
                self.send_up(n, Up::Close { pid });
            }
        }
    }

    fn node_loop(&mut self, n: usize) {
        self.close_retired(n);
        let node = &self.nodes[n];
        if node.down {
            return;
        }
        if !self.handle_shutdown(n) {
            return;
        }
        let node = &self.nodes[n];
        if node.busy.is_some() || !matches!(node.conn, Conn::Up { .. }) {
            return;
        }
        // The engine's validity gate: a session whose deadline passed grants nothing.
        let now = self.at(self.now);
        let valid = self.now < self.nodes[n].valid_until;
        let Ok(plan) = self.nodes[n].engine.plan(now, valid, false) else {
            return self.lose_session(n, "validity deadline passed (seen by the step)");
        };
        self.carry_out(n, self.now);
        if plan.is_empty() {
            self.nodes[n].releases_unanswered = 0;
            if let Some(w) = self.nodes[n].engine.next_wakeup(now) {
                let w = self.t_of(w);
                self.schedule_wake(n, w);
            }
            return;
        }
        self.send_plan(n, plan);
    }

    fn send_plan(&mut self, n: usize, plan: Plan) {
        let Conn::Up { gn, pid } = self.nodes[n].conn else {
            self.violation(format!("n{n} planned statements while disconnected"));
            return;
        };
        let stmts = plan;
        // Lowered before the statements that release locks are sent, and marked while
        // they may take locks (as the task does).
        let floor = self.nodes[n].engine.server_floor();
        let taking = stmts.takes_locks().then(|| self.at(self.now));
        self.nodes[n].floor.set(floor);
        self.nodes[n].floor.taking(taking);
        self.log(|| format!("n{n} sends {stmts:?}"));
        self.nodes[n].busy = Some(stmts.clone());
        self.stats.statements += 1;
        self.send_up(
            n,
            Up::Batch {
                gn,
                pid,
                stmts: Box::new(stmts),
            },
        );
    }

    /// A notification applied, as the task applies one it read: with its arrival.
    fn read_note(&mut self, n: usize, note: Down, arrived: T) {
        let Down::Notify {
            to,
            sender,
            sender_start,
            sent_at,
            keys,
            hand,
        } = note
        else {
            return;
        };
        if self.nodes[n].conn
            == (Conn::Up {
                gn: self.nodes[n].gens,
                pid: to,
            })
            && !self.nodes[n].closing.is_some_and(|c| c.begun)
        {
            let now = self.at(arrived);
            for k in &keys {
                let to = hand.iter().find(|(h, _)| h == k).map(|(_, t)| *t);
                let trusted = |sim: &Self| {
                    sim.nodes[n]
                        .engine
                        .table()
                        .slots
                        .get(k)
                        .map(|slot| (slot.evidence.announced, slot.hold_until.is_some()))
                };
                let before = trusted(self);
                let unseen = |sim: &Self| {
                    sim.nodes[n]
                        .engine
                        .table()
                        .slots
                        .get(k)
                        .is_some_and(|slot| slot.trusted_unseen.is_some())
                };
                let unseen_before = unseen(self);
                let in_flight = self.nodes[n]
                    .engine
                    .table()
                    .slots
                    .get(k)
                    .is_some_and(|slot| slot.server == crate::table::Server::Trying);
                self.nodes[n]
                    .engine
                    .table_mut()
                    .announced_for(*k, sender, to, now);
                // What the checks know of the announcement the table comes to
                // believe: who sent it and when. One that arrives during the
                // key's try is applied after its answer (see `on_reply`).
                let believed = |t: Option<(bool, bool)>| t.is_some_and(|(a, _)| a);
                if in_flight {
                    self.in_flight_notes.entry((n, *k)).or_default().push((
                        sender,
                        sender_start,
                        sent_at,
                        arrived,
                    ));
                } else if believed(trusted(self)) && !believed(before) {
                    self.announcers.insert((n, *k, sender), sender_start);
                    self.announced_sent
                        .insert((n, *k), (sent_at, arrived, sender));
                }
                // No backend of the server sent it: it must not be believed (a
                // skipped grace), and holds this node off (or takes back a win not
                // granted) only as the one hand-over a slot that saw no holder trusts.
                let after = trusted(self);
                let spent = !unseen_before && unseen(self);
                if sender >= FORGED_PIDS
                    && (after.map(|t| t.0) != before.map(|t| t.0)
                        || (after.map(|t| t.1) != before.map(|t| t.1) && !spent))
                {
                    self.violation(format!(
                                "n{n} trusted a forged announcement of {k} from {sender}: {before:?} -> {after:?}"
                            ));
                }
            }
            self.carry_out(n, self.now);
            self.poke(n);
        }
    }

    fn deliver(&mut self, n: usize, msg: Down) {
        match msg {
            Down::Connected {
                attempt,
                pid,
                proven_at,
                term_age,
                high,
                identity,
                system,
                first_xid,
                unepoched,
            } => {
                if self.nodes[n].conn != (Conn::Connecting { attempt }) {
                    // A late answer to an attempt given up on: drop that connection.
                    self.send_up(n, Up::Close { pid });
                    return;
                }
                let now = self.at(self.now);
                if self.nodes[n].last_identity.as_ref() != Some(&identity) {
                    self.nodes[n].term_end_seen = self.nodes[n].end_seen;
                }
                self.nodes[n].last_identity = Some(identity.clone());
                let term = Term {
                    timeline: high,
                    age: term_age.map(Duration::from_micros),
                    identity,
                    first_token: FencingToken::from_parts(high, first_xid),
                    system_id: system.to_string(),
                    read_at: now,
                };
                if let Err(refused) = self.nodes[n].engine.check_session(&term) {
                    // Expected only on a replaced cluster whose token epoch the DBA has
                    // not set yet, by a node that issued tokens on the old one.
                    if unepoched && self.nodes[n].engine.knows_a_cluster() {
                        self.stats.refused_sessions += 1;
                        self.log(|| format!("n{n} refuses its new session: {refused}"));
                    } else {
                        self.violation(format!("n{n} refused its new session: {refused}"));
                    }
                    self.send_up(n, Up::Close { pid });
                    return self.connect_failed(n, attempt);
                }
                let node = &mut self.nodes[n];
                node.known_systems.insert(system);
                let gn = node.gens;
                node.conn = Conn::Up { gn, pid };
                node.valid_until = proven_at + self.t.lease;
                node.hb_out = 0;
                node.rows_high = high;
                if self.cfg.rows {
                    self.trust.insert(pid, proven_at + self.t.lease);
                }
                node.pulse = Some(Pulse::new(
                    self.base + Duration::from_micros(proven_at),
                    Duration::from_micros(self.t.heartbeat),
                    Duration::from_micros(self.t.lease),
                ));
                if self.cfg.off.contains(&Protection::LockGuard)
                    && let Some(pulse) = node.pulse.as_mut()
                {
                    pulse.switch_off_lock_guard();
                }
                if self.cfg.off.contains(&Protection::TakesInFlight)
                    && let Some(pulse) = node.pulse.as_mut()
                {
                    pulse.switch_off_takes_in_flight();
                }
                // A new session holds nothing yet.
                node.floor.set(Vec::new());
                node.floor.taking(None);
                let valid_until = node.valid_until;
                let inst = node.inst;
                if let Some(held) = self.nodes[n].engine.session_started(gn, &term, now) {
                    self.stats.term_holds += 1;
                    self.log(|| {
                        format!(
                            "n{n} holds grants for {} ms: a young term",
                            held.as_millis()
                        )
                    });
                }
                self.log(|| {
                    format!(
                        "n{n} connected: generation {gn}, pid {pid}, proven at {:.3} ms",
                        proven_at as f64 / 1000.0
                    )
                });
                self.push(proven_at + self.t.heartbeat, Ev::HbTimer { n, inst, gn });
                self.push(valid_until, Ev::Watchdog { n, inst, gn });
                self.poke(n);
            }
            Down::Refused { attempt } => self.connect_failed(n, attempt),
            Down::Reply { gn, reply } => self.on_reply(n, gn, &reply, Vec::new()),
            Down::RowsReply {
                gn,
                at,
                steps,
                answer,
            } => {
                if !matches!(self.nodes[n].conn, Conn::Up { gn: g, .. } if g == gn) {
                    return;
                }
                // The real mode's rules of interpretation: any `Err` ends the session.
                match rows_step::interpret(&steps, &answer, self.nodes[n].rows_high) {
                    Ok(done) => {
                        let reply = Reply {
                            at,
                            token: done.token,
                            tried: done.tried.clone().unwrap_or_default(),
                            registered: Vec::new(),
                            senders: Vec::new(),
                            fenced: done.fenced.clone(),
                            checked: done.checked.clone(),
                            try_failed: None,
                            locks_gone: false,
                        };
                        self.on_reply(n, gn, &reply, done.seen_held);
                    }
                    Err(fault) => self.lose_session(n, &format!("{fault:?}")),
                }
            }
            Down::Failed { gn, why } => {
                if matches!(self.nodes[n].conn, Conn::Up { gn: g, .. } if g == gn) {
                    self.lose_session(n, why);
                }
            }
            Down::HbOk { gn, beat, locks } => {
                let Conn::Up { gn: g, .. } = self.nodes[n].conn else {
                    return;
                };
                if g == gn {
                    self.nodes[n].hb_out = self.nodes[n].hb_out.saturating_sub(1);
                }
                if self.nodes[n].closing.is_some_and(|c| c.begun) {
                    return;
                }
                if g != gn {
                    return;
                }
                let now = self.at(self.now);
                let node = &mut self.nodes[n];
                let Some(pulse) = node.pulse.as_mut() else {
                    return;
                };
                let was_full = pulse.next_send().is_none();
                let shown = locks.len();
                let verdict = pulse.answered(&beat, Ok(locks), &node.floor, now);
                let floor = node.floor.get();
                self.log(|| format!("n{n} heartbeat {beat:?} answered: {shown} locks, floor now {floor:?}: {verdict:?}"));
                match verdict {
                    Verdict::Renew { until, .. } => {
                        let until = self.t_of(until);
                        let node = &mut self.nodes[n];
                        if node.valid_until > self.now {
                            node.valid_until = node.valid_until.max(until);
                            let (inst, valid) = (node.inst, node.valid_until);
                            if self.cfg.rows
                                && let Conn::Up { pid, .. } = self.nodes[n].conn
                            {
                                self.trust.insert(pid, valid);
                            }
                            self.push(valid, Ev::Watchdog { n, inst, gn });
                            // The next heartbeat waited for this answer: due now.
                            if was_full {
                                self.push(self.now, Ev::HbTimer { n, inst, gn });
                            }
                        } else {
                            self.lose_session(n, "heartbeat answered too late");
                        }
                    }
                    // Renews nothing: the next one is sent on the grid anyway.
                    Verdict::Unjudged { .. } => {
                        if was_full {
                            let inst = self.nodes[n].inst;
                            self.push(self.now, Ev::HbTimer { n, inst, gn });
                        }
                    }
                    // A row missing, in the lease-row mode: retired as any lost session
                    // (what the session still holds stays until the next one fences the
                    // work still stopping), never a pooler's.
                    Verdict::Revoke(reason) => {
                        self.stats.pooler_detected += 1;
                        let rows = self.cfg.rows;
                        self.lose_session_keeping(n, &format!("{reason:?}"), rows);
                    }
                }
            }
            note @ Down::Notify { .. } => {
                // The task reads notifications between steps: one that arrives during a
                // statement waits for its answer (applied then, with its arrival). Now
                // and then one is applied at once, as a task reading them concurrently
                // would: the table's rules must not depend on the order.
                if self.nodes[n].busy.is_some() && !self.rng.chance(25) {
                    self.nodes[n].notes.push((note, self.now));
                } else {
                    self.read_note(n, note, self.now);
                }
            }
            // The lease-row mode: a pooled connection of the session ended. It fails
            // what is in flight on it (the session ends); idle, it is replaced by the
            // next batch.
            Down::Closed { pid } if self.cfg.rows => {
                let holder = self.conn_holder.get(&pid).copied();
                let node = &self.nodes[n];
                let in_flight = node.busy.is_some() || node.hb_out > 0;
                if matches!(node.conn, Conn::Up { pid: h, .. } if Some(h) == holder) && in_flight {
                    self.lose_session(n, "server closed the pooled connection unexpectedly");
                }
            }
            Down::Closed { pid } => {
                if matches!(self.nodes[n].conn, Conn::Up { pid: p, .. } if p == pid) {
                    self.lose_session(n, "connection closed by the server");
                }
            }
        }
    }

    /// A plan's answer; `seen_held`: won keys the answer says someone held before
    /// (the lease-row mode's takeover of an expired row).
    fn on_reply(&mut self, n: usize, gn: u64, reply: &Reply, seen_held: Vec<LockKey>) {
        if !matches!(self.nodes[n].conn, Conn::Up { gn: g, .. } if g == gn) {
            return;
        }
        let Some(stmts) = self.nodes[n].busy.take() else {
            return;
        };
        // The step is done: the releases read before it are answered.
        self.nodes[n].releases_unanswered = 0;
        self.log(|| {
            format!(
                "n{n} answered: tried {:?} checked {:?} fenced {:?} token {:?}",
                reply.tried, reply.checked, reply.fenced, reply.token
            )
        });
        if reply.locks_gone {
            self.stats.pooler_detected += 1;
            return self.lose_session_keeping(n, "the hand-off's keys are no longer held", false);
        }
        self.stats.fence_waits += reply
            .checked
            .iter()
            .filter(|(_, c)| matches!(c, FenceCheck::Held { .. }))
            .count() as u64;
        // The sessions the try found alive (applied again, to the same effect, with the
        // rest of the answer): the checks below judge with them.
        self.nodes[n].engine.table_mut().senders(&reply.senders);
        // What the table knew before the answer: a won key it had seen held, with no
        // verified announcement since, must wait the grace (the table's own rule).
        let check_sessions = !self.nodes[n].engine.table().off(Protection::SessionCheck);
        let unannounced: Vec<LockKey> = reply
            .tried
            .iter()
            .filter(|(k, _)| {
                self.nodes[n].engine.table().slots.get(k).is_some_and(|s| {
                    s.evidence.contended
                        && !verified(
                            &s.evidence,
                            check_sessions,
                            self.at(self.now),
                            Duration::from_micros(self.t.grace),
                        )
                })
            })
            .map(|(k, _)| *k)
            .collect();
        // And the truth: a release believed, but announced by another session than the
        // holder the last try saw (a reused pid), must not skip the grace either.
        let forged: Vec<LockKey> = reply
            .tried
            .iter()
            .filter(|(k, o)| {
                !matches!(o, TryOutcome::Held { .. } | TryOutcome::Failed)
                    && self.nodes[n].engine.table().slots.get(k).is_some_and(|s| {
                        s.evidence.contended
                            && verified(
                                &s.evidence,
                                check_sessions,
                                self.at(self.now),
                                Duration::from_micros(self.t.grace),
                            )
                            && s.evidence.holder.and_then(|h| h.start)
                                != s.evidence.holder.and_then(|h| {
                                    self.announcers.get(&(n, *k, h.pid)).map(|t| epoch_us(*t))
                                })
                    })
            })
            .map(|(k, _)| *k)
            .collect();
        self.announced_now = reply
            .tried
            .iter()
            .filter(|(k, _)| {
                self.nodes[n]
                    .engine
                    .table()
                    .slots
                    .get(k)
                    .is_some_and(|s| s.evidence.contended && s.evidence.announced)
            })
            .map(|(k, _)| {
                (
                    n,
                    *k,
                    self.announced_sent
                        .get(&(n, *k))
                        .copied()
                        .unwrap_or((0, 0, 0)),
                )
            })
            .collect();
        let done = Done {
            token: reply.token,
            tried: match reply.try_failed {
                Some(failed) => Err(failed),
                None => Ok(reply.tried.clone()),
            },
            registered: reply.registered.clone(),
            seen_held,
            senders: reply.senders.clone(),
            fenced: reply.fenced.clone(),
            checked: reply.checked.clone(),
        };
        let now = self.at(self.now);
        let valid = self.now < self.nodes[n].valid_until;
        let closing = self.nodes[n].closing.is_some_and(|c| c.begun);
        // The engine's validity gate: results that arrive after the deadline (a freeze
        // during the statement) end the session instead of granting.
        if self.nodes[n]
            .engine
            .done(&stmts, &done, valid, closing, now)
            .is_err()
        {
            return self.lose_session(n, "validity deadline passed (seen with a reply)");
        }
        let floor = self.nodes[n].engine.server_floor();
        self.nodes[n].floor.set(floor);
        self.nodes[n].floor.taking(None);
        // Announcements that arrived during the tries were applied after the answers:
        // the one the table now believes (from the holder its try saw) is recorded.
        for (k, _) in &reply.tried {
            let Some(notes) = self.in_flight_notes.remove(&(n, *k)) else {
                continue;
            };
            let holder = self.nodes[n]
                .engine
                .table()
                .slots
                .get(k)
                .filter(|s| s.evidence.announced)
                .and_then(|s| s.evidence.holder)
                .map(|h| h.pid);
            if let Some((sender, start, sent_at, arrived)) = notes
                .into_iter()
                .rev()
                .find(|(p, _, _, _)| Some(*p) == holder)
            {
                self.announcers.insert((n, *k, sender), start);
                self.announced_sent
                    .insert((n, *k), (sent_at, arrived, sender));
            }
        }
        // When the server decided each win and each clear fence check: a grant that
        // waits for a token statement first (an eager request won by a lazy try) was
        // decided then, not by that statement.
        for (k, outcome) in &reply.tried {
            if matches!(outcome, TryOutcome::Won(_) | TryOutcome::WonFenced { .. }) {
                self.decided.insert((n, *k), reply.at);
            }
        }
        // (Every check: with the stop fence switched off, a held one grants too.)
        for (k, _) in &reply.checked {
            self.decided.insert((n, *k), reply.at);
        }
        let granted_before = self.runs.len();
        self.carry_out(n, reply.at);
        self.announced_now.clear();
        // The notifications read after the step, in their order.
        for (note, arrived) in std::mem::take(&mut self.nodes[n].notes) {
            self.read_note(n, note, arrived);
        }
        if !self.nodes[n].withdrawals.is_empty() {
            self.apply_withdrawals(n);
        }
        // A caller that gives up at the worst moment: its request won at the server
        // and waits out the grace, or its fence.
        if self.cfg.random_faults {
            for (k, outcome) in &reply.tried {
                if !matches!(outcome, TryOutcome::Won(_) | TryOutcome::WonFenced { .. }) {
                    continue;
                }
                let waiting = self.nodes[n].singles.iter().position(|single| {
                    single.key == *k && matches!(single.state, SState::Waiting(_))
                });
                if let Some(s) = waiting
                    && let SState::Waiting(id) = self.nodes[n].singles[s].state
                    && self.rng.chance(30)
                {
                    let inst = self.nodes[n].inst;
                    let t = self.now + self.rng.range(0, self.t.grace + 40 * MS);
                    self.push(t, Ev::GiveUp { n, inst, s, id });
                }
            }
        }
        for k in unannounced {
            if self.runs[granted_before..]
                .iter()
                .any(|r| r.n == n && r.key == k && r.how == How::Direct)
            {
                self.violation(format!(
                    "n{n} granted {k} on an unannounced takeover without the grace"
                ));
            }
        }
        for k in forged {
            if self.runs[granted_before..]
                .iter()
                .any(|r| r.n == n && r.key == k)
            {
                self.violation(format!(
                    "n{n} granted {k} without the grace, believing an announcement from \
                     another session on its holder's pid (pid reuse)"
                ));
            }
        }
        self.poke(n);
    }

    /// Carries out the table's actions (in a fixed order: the table's own order comes
    /// from hash maps, and the history must not depend on it).
    /// `reply_at`: when the server ran the statements whose answers were just fed in
    /// (the instant that decided a grant that came of them).
    fn carry_out(&mut self, n: usize, reply_at: T) {
        let mut actions = Vec::new();
        // The handle's shutdown began (its supervisors told to stop): the engine's
        // rule 8 holds back the grants of a statement that was in flight.
        let (now, handle_closing) = (self.at(self.now), self.nodes[n].closing.is_some());
        while let Some(a) = self.nodes[n].engine.poll_action(now, handle_closing) {
            actions.push(a);
        }
        actions.sort_by_key(|a| match a {
            Action::Grant { id, key, .. } => (0, *key, *id),
            Action::Refuse { id, .. } => (1, LockKey::Int(0), *id),
            Action::Released { key, .. } => (2, *key, 0),
            Action::Lost { key, .. } => (3, *key, 0),
            Action::Token { id, key, .. } => (4, *key, *id),
        });
        for a in actions {
            match a {
                Action::Grant {
                    id,
                    key,
                    token,
                    generation,
                    via,
                    ..
                } => {
                    let decided = self.decided.get(&(n, key)).copied().unwrap_or(reply_at);
                    let (how, decided_at) = match via {
                        Via::Won => (How::Direct, decided),
                        Via::Checked => (How::Checked, decided),
                        Via::HandOff => (How::Handoff, reply_at),
                        Via::FenceExpired => (How::Expired, self.now),
                    };
                    self.on_grant(n, id, key, token, generation, how, decided_at);
                }
                Action::Refuse { id, why } => {
                    if self.nodes[n].abandoned.remove(&id) {
                        continue;
                    }
                    let Some(s) = self.nodes[n]
                        .singles
                        .iter()
                        .position(|s| s.state == SState::Waiting(id))
                    else {
                        self.violation(format!("n{n} refused unknown request {id}"));
                        continue;
                    };
                    let node = &mut self.nodes[n];
                    if why == Refusal::Closed || node.closing.is_some() {
                        node.singles[s].state = SState::Gone;
                    } else {
                        node.singles[s].state = SState::Idle;
                        let inst = node.inst;
                        let t = self.now + self.rng.range(0, SEC);
                        self.push(t, Ev::Reacquire { n, inst, s });
                    }
                }
                Action::Token { id, key, token } => self.on_token(n, id, key, token),
                Action::Released { .. } | Action::Lost { .. } => {}
            }
        }
    }

    /// A lazy holder's token read answered: it starts its work with the token, or,
    /// without one (its lease ended, or the statement failed), drops its lease and asks
    /// again later.
    fn on_token(&mut self, n: usize, id: RequestId, key: LockKey, token: Option<FencingToken>) {
        let Some(s) = self.nodes[n]
            .singles
            .iter()
            .position(|single| matches!(single.state, SState::Reading { id: r, .. } if r == id))
        else {
            // Dropped meanwhile: its release answered the read without a token.
            if let Some(token) = token {
                self.violation(format!(
                    "n{n} answered a token read of {key} with {token} to request {id}, which no longer reads"
                ));
            }
            return;
        };
        let SState::Reading {
            how, decided_at, ..
        } = self.nodes[n].singles[s].state
        else {
            return;
        };
        match token {
            Some(token) => {
                self.log(|| format!("n{n} read token {token} of {key} (request {id})"));
                self.stats.tokens_read += 1;
                self.check_token(n, key, token, false);
                self.start_run(n, s, id, key, token, how, decided_at);
            }
            None => {
                self.log(|| format!("n{n} got no token for {key} (request {id}); drops it"));
                self.stats.tokens_unread += 1;
                self.drop_unread(n, s, id);
            }
        }
    }

    /// A single whose lease is gone asks again within a second, or is gone for good
    /// while its node closes.
    fn asks_again_later(&mut self, n: usize, s: usize) {
        let node = &mut self.nodes[n];
        if node.closing.is_some() {
            node.singles[s].state = SState::Gone;
        } else {
            node.singles[s].state = SState::Idle;
            let inst = node.inst;
            let t = self.now + self.rng.range(0, SEC);
            self.push(t, Ev::Reacquire { n, inst, s });
        }
    }

    /// A lazy holder drops its lease before it started any work.
    fn drop_unread(&mut self, n: usize, s: usize, id: RequestId) {
        let key = self.nodes[n].singles[s].key;
        if let SState::Reading {
            granted, origin, ..
        } = self.nodes[n].singles[s].state
            && let Conn::Up { pid, .. } = self.nodes[n].conn
        {
            // A tenure all the same (its release is announced): see `unrun`.
            self.unrun.push((key, pid, granted, origin.1));
        }
        let now = self.at(self.now);
        self.nodes[n].engine.table_mut().release(key, id, now);
        self.asks_again_later(n, s);
        self.poke(n);
    }

    #[expect(clippy::too_many_arguments, reason = "one grant's fields")]
    fn on_grant(
        &mut self,
        n: usize,
        id: RequestId,
        key: LockKey,
        token: Option<FencingToken>,
        generation: u64,
        how: How,
        decided_at: T,
    ) {
        match self.nodes[n].conn {
            Conn::Up { gn, pid } => {
                if gn != generation {
                    self.violation(format!(
                        "n{n} granted {key} in generation {generation}, session is {gn}"
                    ));
                }
                // (Another client may have released it behind the session's back: the
                // lock guard finds out with the next heartbeat. In the lease-row mode, a
                // promotion may have lost the row: the session's next batch fails.)
                let held = self.holds_at_server(n, key);
                if !held && self.session_live(n) && !self.server.was_discarded(pid) {
                    self.violation(format!(
                        "n{n} granted {key}, which its live backend {pid} does not hold"
                    ));
                }
            }
            other => self.violation(format!("n{n} granted {key} while {other:?}")),
        }
        if self.nodes[n].closing.is_some() {
            self.violation(format!("n{n} granted {key} while closing"));
        }
        if self.nodes[n].singles.iter().any(|s| {
            s.key == key
                && matches!(
                    s.state,
                    SState::Holding { .. } | SState::Stopping { .. } | SState::Reading { .. }
                )
        }) {
            self.violation(format!(
                "n{n} granted {key} while a lease of its own on it is still out"
            ));
        }
        let born_invalid = self.now >= self.nodes[n].valid_until;
        if born_invalid {
            // The engine's validity gate: nothing is granted on a session whose
            // deadline passed (the server may have ended it and given the key away).
            self.violation(format!(
                "n{n} granted {key} on a session past its validity deadline"
            ));
        }
        // The term hold: a holder of the previous term that went silent trusted its
        // lease at most `lease` after its last heartbeat, which the old term answered
        // before it ended, and then had `stop_budget` to stop: nothing is granted
        // before that. (The hold itself lasts `term_grant_delay` from the new term's
        // start, a `safety_margin` more, which absorbs a forward step of the server's
        // clock.) A grant on a session of the old term, answered before it ended and
        // arriving after, is a stale grant: the client learns with the next message.
        let live_at_server = self.session_live(n);
        if let Some(ended) = self.server.ended
            && live_at_server
            && self.now < ended + self.t.lease + self.t.stop_budget
        {
            // The server's clock stepped forward past the tolerance (`safety_margin`
            // plus the time the server was down), and this process did not see the
            // old term end (it started since, or lost its session before): only the
            // server's clock could tell it, and it was wrong. The documented limit.
            // The step that counts is the one inside this session's own reading of
            // the age (a step after it cannot shorten its hold); a term of unknown
            // age is counted from first sight, which no step touches.
            let started = self.server.started.unwrap_or(ended);
            let step = self
                .session_backend(n)
                .and_then(|b| b.age_step)
                .unwrap_or(0);
            let beyond = step > (self.t.margin + (started - ended)) as i64;
            if beyond && self.nodes[n].term_end_seen < ended {
                self.stats.beyond_clock_tolerance += 1;
                self.log(|| {
                    format!(
                        "FINDING n{n} granted {key} early: the server's clock stepped forward past the tolerance"
                    )
                });
            } else {
                self.violation(format!(
                    "n{n} granted {key} {} ms after the server's previous term ended, before a holder of it had stopped",
                    (self.now - ended) / MS
                ));
            }
        }
        if let Some(token) = token {
            self.check_token(n, key, token, born_invalid);
        }
        let eager = self.nodes[n].eager.remove(&id);
        if eager && token.is_none() {
            self.violation(format!(
                "n{n} granted {key} to request {id}, which asked for its token, without one"
            ));
        }
        if self.nodes[n].abandoned.remove(&id) {
            // The grant never reaches its caller: nothing runs under it, and the key
            // goes back as the driver gives it (`LockTable::undelivered`).
            self.stats.undelivered += 1;
            self.log(|| format!("n{n} grant {id} of {key} was never delivered"));
            let inst = self.nodes[n].inst;
            let origin = self.tenure_origin(n, key, how, decided_at);
            self.undelivered_origin
                .insert((n, inst, key), (self.now, origin));
            let now = self.at(self.now);
            self.nodes[n].engine.table_mut().undelivered(key, id, now);
            self.poke(n);
            return;
        }
        let Some(s) = self.nodes[n]
            .singles
            .iter()
            .position(|s| s.state == SState::Waiting(id))
        else {
            self.violation(format!("n{n} granted unknown request {id}"));
            return;
        };
        let Some(token) = token else {
            // A lazy request: its holder reads the token before it starts its work. Its
            // session's tenure began as a grant since the last run's (a hand-off from
            // it inherits that).
            let origin = self.tenure_origin(n, key, how, decided_at);
            let inst = self.nodes[n].inst;
            self.undelivered_origin
                .insert((n, inst, key), (self.now, origin));
            self.nodes[n].singles[s].state = SState::Reading {
                id,
                how,
                decided_at,
                granted: self.now,
                origin,
            };
            self.log(|| format!("n{n} GRANT {key} without a token (request {id}); reads it"));
            match self.nodes[n].engine.table_mut().read_token(key, id) {
                TokenRead::Pending => self.poke(n),
                TokenRead::Known(token) => {
                    self.violation(format!(
                        "n{n} granted {key} without its token, which it knows ({token})"
                    ));
                }
                TokenRead::NotHeld => {
                    self.violation(format!(
                        "n{n} granted {key} to request {id}, which does not hold it"
                    ));
                }
            }
            return;
        };
        self.start_run(n, s, id, key, token, how, decided_at);
    }

    /// A holder starts its work with its token (given with the grant, or read since).
    #[expect(clippy::too_many_arguments, reason = "one grant's fields")]
    fn start_run(
        &mut self,
        n: usize,
        s: usize,
        id: RequestId,
        key: LockKey,
        token: FencingToken,
        how: How,
        decided_at: T,
    ) {
        // A lease past its deadline before its work could start: it never acts.
        let born_invalid = self.now >= self.nodes[n].valid_until;
        let run = self.runs.len();
        let inst = self.nodes[n].inst;
        let origin = self.tenure_origin(n, key, how, decided_at);
        let pid = match self.nodes[n].conn {
            Conn::Up { pid, .. } => pid,
            _ => 0,
        };
        let unepoched = self.unepoched(n);
        let system = self.session_system(n);
        let stale = !self.holds_at_server(n, key);
        let asked_at = self.nodes[n].singles[s].since;
        self.runs.push(Run {
            key,
            n,
            inst,
            pid,
            asked_at,
            stale,
            unepoched,
            system,
            token,
            how,
            grant_at: self.now,
            origin,
            acting_end: born_invalid.then_some(self.now),
            drop_at: None,
            born_invalid,
            on_announcement: self
                .announced_now
                .iter()
                .find(|(m, k, _)| how == How::Direct && *m == n && *k == key)
                .map(|(_, _, note)| *note),
        });
        self.nodes[n].singles[s].state = SState::Holding { id, run };
        self.stats.grants += 1;
        let name = match how {
            How::Direct => "direct",
            How::Checked => "checked",
            How::Handoff => "handoff",
            How::Expired => "expired",
        };
        *self.stats.grants_by_how.entry(name).or_default() += 1;
        if self.last_grantee.insert(key, n).is_some_and(|p| p != n) {
            self.stats.takeovers += 1;
        }
        self.log(|| format!("n{n} GRANT {key} token {token} ({name}) run {run}"));
        if self.cfg.resign && self.rng.chance(35) {
            let t = self.now + self.rng.range(300 * MS, 8 * SEC);
            self.push(t, Ev::Resign { n, inst, s, id });
        }
    }

    /// How the session's tenure of `key` began, for a grant made `how`: a hand-off keeps
    /// the server lock, so it inherits the tenure of the last grant of this session's
    /// lock (the last run's, or a grant since that never reached its caller or was
    /// granted without its token).
    fn tenure_origin(&self, n: usize, key: LockKey, how: How, decided_at: T) -> Origin {
        if how != How::Handoff {
            return (how, decided_at);
        }
        let inst = self.nodes[n].inst;
        let run = self
            .runs
            .iter()
            .rev()
            .find(|r| r.n == n && r.inst == inst && r.key == key)
            .map(|r| (r.grant_at, r.origin));
        let lost = self.undelivered_origin.get(&(n, inst, key)).copied();
        match (run, lost) {
            (Some((at, o)), Some((lost_at, lost_o))) => {
                if lost_at >= at {
                    lost_o
                } else {
                    o
                }
            }
            (Some((_, o)), None) | (None, Some((_, o))) => o,
            (None, None) => (how, decided_at),
        }
    }

    /// A token handed to a holder (with its grant, or read later) must be above every
    /// token of the key's earlier tenures: findings kept apart where the client cannot
    /// know yet (see the cases).
    fn check_token(&mut self, n: usize, key: LockKey, token: FencingToken, born_invalid: bool) {
        if let Some(prev) = self.last_token.get(&key).copied()
            && token <= prev
        {
            let text = format!("n{n} granted {key} with token {token} after token {prev}");
            // The answer that won the key came back after the server had ended the
            // session (a termination racing the reply): the client cannot know yet,
            // and learns it with the next message. Physics, as gap (a): the later
            // holder's greater token fences this one's writes. Kept apart as a finding.
            // Or another client released the session's locks behind its back: the
            // lock guard ends it with the next heartbeat.
            // Not in the lease-row mode: a later tenure's row was taken after this
            // session's expired, past its validity deadline, and its tokens are drawn
            // after; no answer of a session with a smaller token is trusted then.
            let ended_at_server = !self.cfg.rows
                && matches!(self.nodes[n].conn, Conn::Up { .. })
                && !self.holds_at_server(n, key);
            // A replaced cluster whose token epoch the DBA has not set yet, and a node
            // that never saw the old one (it started since): it cannot know. The
            // documented operator duty; counted apart.
            // (Or it knew clusters, but not the one of the key's last token: its floor
            // says nothing of that one's tokens.)
            let prev_system = self.last_system.get(&key).copied();
            let on_unepoched = self.session_backend(n).is_some_and(|b| b.unepoched);
            let cannot_know = on_unepoched
                && prev_system != Some(self.session_system(n))
                && prev_system.is_some_and(|sys| !self.nodes[n].known_systems.contains(&sys));
            if born_invalid || ended_at_server {
                self.stats.stale_grants += 1;
                self.log(|| format!("FINDING {text}, on a session the server had ended"));
                self.stale_grants.push(text);
            } else if cannot_know {
                self.stats.epoch_unset_grants += 1;
                self.log(|| format!("FINDING {text}, on a replaced cluster without its epoch"));
            } else {
                self.violation(text);
            }
        }
        self.last_token.insert(key, token);
        let system = self.session_system(n);
        self.last_system.insert(key, system);
    }

    fn child_drop(&mut self, n: usize, s: usize, id: RequestId) {
        let SState::Stopping { id: h, run } = self.nodes[n].singles[s].state else {
            return;
        };
        if h != id {
            return;
        }
        let r = &mut self.runs[run];
        r.drop_at = Some(self.now);
        r.acting_end.get_or_insert(self.now);
        let key = self.nodes[n].singles[s].key;
        self.log(|| format!("n{n} child of run {run} dropped its lease on {key}"));
        let now = self.at(self.now);
        let to = self
            .hand_over_next
            .or_else(|| self.resign_to.remove(&(n, id)));
        self.nodes[n]
            .engine
            .table_mut()
            .release_to(key, id, to, now);
        // Answered after the next step (at once while disconnected).
        if matches!(self.nodes[n].conn, Conn::Up { .. }) {
            self.nodes[n].releases_unanswered += 1;
        }
        // The lease is gone before the task's answers are read.
        self.asks_again_later(n, s);
        self.carry_out(n, self.now);
        self.closing_command(n);
        self.poke(n);
    }

    fn reacquire(&mut self, n: usize, s: usize) {
        let node = &mut self.nodes[n];
        if node.singles[s].state != SState::Idle || node.closing.is_some() {
            return;
        }
        let id = node.next_req;
        node.next_req += 1;
        let key = node.singles[s].key;
        node.singles[s].state = SState::Waiting(id);
        node.singles[s].since = self.now;
        let now = self.base + Duration::from_micros(self.now);
        let eager_token = !(self.cfg.lazy && self.rng.chance(50));
        let node = &mut self.nodes[n];
        if eager_token {
            node.eager.insert(id);
        }
        node.engine.table_mut().acquire(
            Request {
                id,
                key,
                name: Arc::from("sim"),
                poll_interval: Duration::from_micros(self.t.poll),
                mode: Mode::Wait,
                since: SystemTime::UNIX_EPOCH,
                enqueued: now,
                eager_token,
            },
            now,
        );
        self.carry_out(n, self.now);
        self.poke(n);
    }

    /// The caller of a waiting request stops waiting: the request is withdrawn, and a
    /// grant already on its way never reaches it. It asks again later.
    fn give_up(&mut self, n: usize, s: usize, id: RequestId) {
        self.fault("give_up");
        let key = self.nodes[n].singles[s].key;
        self.log(|| format!("n{n} stops waiting for {key} (request {id})"));
        let node = &mut self.nodes[n];
        node.withdrawals.push((key, id));
        node.abandoned.insert(id);
        node.singles[s].state = SState::Idle;
        let inst = node.inst;
        let t = self.now + self.rng.range(100 * MS, 2 * SEC);
        self.push(t, Ev::Reacquire { n, inst, s });
        if self.nodes[n].busy.is_none() {
            self.apply_withdrawals(n);
        }
    }

    /// The withdrawals the task reads between steps.
    fn apply_withdrawals(&mut self, n: usize) {
        let now = self.at(self.now);
        for (key, id) in std::mem::take(&mut self.nodes[n].withdrawals) {
            self.nodes[n].engine.table_mut().withdraw(key, id, now);
        }
        self.carry_out(n, self.now);
        self.poke(n);
    }

    /// The generation ends (every lease of it revoked at once); the first reconnect
    /// attempt follows at once.
    fn lose_session(&mut self, n: usize, why: &str) {
        self.lose_session_keeping(n, why, true);
    }

    /// [`lose_session`](Self::lose_session); `may_keep`: the lost session may be kept
    /// open (rule 6; not a pooler's).
    fn lose_session_keeping(&mut self, n: usize, why: &str, may_keep: bool) {
        let Conn::Up { pid, gn } = self.nodes[n].conn else {
            return;
        };
        if self.nodes[n].closing.is_some_and(|c| c.begun) {
            // A closing statement failed: the locks end with the session.
            self.stats.shutdowns_failed += 1;
            self.nodes[n].busy = None;
            self.nodes[n].engine.close_failed();
            return self.poke(n);
        }
        self.log(|| format!("n{n} LOSES generation {gn} (pid {pid}): {why}"));
        // Tries in flight never answer now, and nobody reads what came meanwhile; the
        // releases are answered (nothing is held any more).
        self.in_flight_notes.retain(|(m, _), _| *m != n);
        self.nodes[n].notes.clear();
        self.nodes[n].releases_unanswered = 0;
        // Kept open until the next session fences what is still stopping (rule 6).
        let node = &mut self.nodes[n];
        node.retiring.push_back(pid);
        node.conn = Conn::Down;
        node.busy = None;
        node.valid_until = 0;
        node.hb_out = 0;
        // The task reads the withdrawals that came in meanwhile.
        let now_i = self.at(self.now);
        for (key, id) in std::mem::take(&mut self.nodes[n].withdrawals) {
            self.nodes[n].engine.table_mut().withdraw(key, id, now_i);
        }
        let at = self.at(self.now);
        self.nodes[n].end_seen = self.now;
        match self.nodes[n].engine.session_lost(at, may_keep) {
            // Its own deadline (not the oldest kept one's).
            Some(until) => {
                let (until, inst) = (self.t_of(until), self.nodes[n].inst);
                self.push(until, Ev::Retire { n, inst });
            }
            None => {
                if let Some(pid) = self.nodes[n].retiring.pop_back() {
                    self.send_up(n, Up::Close { pid });
                }
            }
        }
        self.carry_out(n, self.now);
        for s in 0..self.nodes[n].singles.len() {
            match self.nodes[n].singles[s].state {
                SState::Holding { id, run } => {
                    self.runs[run].acting_end.get_or_insert(self.now);
                    self.nodes[n].singles[s].state = SState::Stopping { id, run };
                    // A child whose lease was invalid from the start never started.
                    let stop = if self.runs[run].born_invalid {
                        0
                    } else {
                        self.stop_time()
                    };
                    let t = self.now + stop;
                    let inst = self.nodes[n].inst;
                    self.push(t, Ev::ChildDrop { n, inst, s, id });
                }
                SState::Stopping { run, .. } => {
                    self.runs[run].acting_end.get_or_insert(self.now);
                }
                _ => {}
            }
        }
        let inst = self.nodes[n].inst;
        self.push(self.now, Ev::Reconnect { n, inst });
        if self.nodes[n].closing.is_some() {
            // The handle's shutdown may be read while reconnecting.
            self.poke(n);
        }
    }

    fn connect_failed(&mut self, n: usize, attempt: u64) {
        let node = &mut self.nodes[n];
        if node.conn != (Conn::Connecting { attempt }) {
            return;
        }
        node.conn = Conn::Down;
        let inst = node.inst;
        let wait = node.engine.connect_failed().as_micros() as T;
        self.push(self.now + wait, Ev::Reconnect { n, inst });
    }

    // ---- the node: graceful shutdown ---------------------------------------------------

    fn begin_shutdown(&mut self, n: usize) {
        self.log(|| format!("n{n} begins a graceful shutdown"));
        let inst = self.nodes[n].inst;
        // `LockManager::shutdown`: the supervisors are told to stop, and the task is
        // sent `Closing`; the shutdown itself once they stopped, or after the stop
        // budget and the lease timeout.
        let supervisors_until = self.now + self.t.stop_budget + self.t.lease;
        self.nodes[n].closing = Some(Closing {
            until: self.now,
            on_command: false,
            statement_deadline: None,
            begun: false,
            read: false,
            supervisors_until,
        });
        self.push(supervisors_until, Ev::Wake { n, inst });
        // The task reads the shutdown by then: the supervisors' wait, then the step in
        // flight (it answers, or the session is lost, within the lease timeout).
        let (from, stage) = (self.now, 1);
        let bound = self.t.stop_budget + 2 * self.t.lease + 100 * MS;
        self.push(
            from + bound,
            Ev::ShutdownBound {
                n,
                inst,
                from,
                stage,
                bound,
            },
        );
        // The supervisors are told to stop; a plain lease goes on until the task stops
        // trusting every lease (`stop_unsupervised`).
        for s in 0..self.nodes[n].singles.len() {
            let supervised = self.nodes[n].singles[s].supervised;
            match self.nodes[n].singles[s].state {
                SState::Holding { id, run } if supervised => {
                    self.runs[run].acting_end = Some(self.now);
                    self.nodes[n].singles[s].state = SState::Stopping { id, run };
                    let t = self.now + self.stop_time();
                    self.push(t, Ev::ChildDrop { n, inst, s, id });
                }
                SState::Stopping { run, .. } if supervised => {
                    self.runs[run].acting_end.get_or_insert(self.now);
                }
                // Nothing started under it yet: dropped now.
                SState::Reading { id, .. } if supervised => self.drop_unread(n, s, id),
                SState::Idle => self.nodes[n].singles[s].state = SState::Gone,
                _ => {}
            }
        }
        // The task reads the commands between steps (`handle_shutdown`).
        self.carry_out(n, self.now);
        self.poke(n);
    }

    /// The task between two steps, while the handle shuts down: reads `Closing`, and
    /// the shutdown once the supervisors have stopped; then runs the engine's sequence.
    /// Returns whether the ordinary loop goes on.
    fn handle_shutdown(&mut self, n: usize) -> bool {
        let Some(c) = self.nodes[n].closing else {
            return true;
        };
        if c.begun {
            self.closing_step(n);
            return false;
        }
        if self.nodes[n].busy.is_some() {
            return false;
        }
        if !c.read {
            self.nodes[n].engine.table_mut().begin_close();
            self.carry_out(n, self.now);
            if let Some(c) = &mut self.nodes[n].closing {
                c.read = true;
            }
        }
        // A supervisor ends once its child stopped and its release was answered.
        let stopped = self.nodes[n].releases_unanswered == 0
            && self.nodes[n].singles.iter().all(|single| {
                !single.supervised
                    || !matches!(
                        single.state,
                        SState::Holding { .. } | SState::Stopping { .. } | SState::Reading { .. }
                    )
            });
        if !stopped && self.now < c.supervisors_until {
            return true;
        }
        self.log(|| format!("n{n} reads the shutdown"));
        if matches!(self.nodes[n].conn, Conn::Connecting { .. }) {
            // The connect in flight is dropped (its late answer closes its backend).
            self.nodes[n].conn = Conn::Down;
        }
        let now = self.at(self.now);
        self.nodes[n].engine.begin_shutdown(now);
        self.carry_out(n, self.now);
        self.set_closing(n, self.now, false, None);
        self.stop_unsupervised(n);
        // The engine's sequence: its stop budget, a closing statement's slack (the lease
        // timeout) past it, and the linger (the grace).
        let (inst, from, stage) = (self.nodes[n].inst, self.now, 2);
        let bound = self.t.stop_budget + self.t.lease + self.t.grace + 100 * MS;
        self.push(
            from + bound,
            Ev::ShutdownBound {
                n,
                inst,
                from,
                stage,
                bound,
            },
        );
        self.closing_step(n);
        false
    }

    /// The task stops trusting every lease (`close()`): a plain lease's owner stops its
    /// work and drops it, sometimes only after the stop budget.
    fn stop_unsupervised(&mut self, n: usize) {
        let inst = self.nodes[n].inst;
        for s in 0..self.nodes[n].singles.len() {
            if self.nodes[n].singles[s].supervised {
                continue;
            }
            match self.nodes[n].singles[s].state {
                SState::Holding { id, run } => {
                    self.runs[run].acting_end = Some(self.now);
                    self.nodes[n].singles[s].state = SState::Stopping { id, run };
                    let t = self.now + self.stop_time();
                    // Its work stops within the stop budget (the owner's part of the
                    // contract); now and then the owner keeps the lease object past it
                    // (the engine then unlocks it unannounced).
                    if self.rng.chance(15) {
                        self.push(t, Ev::WorkStops { n, inst, s, id });
                    } else {
                        self.push(t, Ev::ChildDrop { n, inst, s, id });
                    }
                }
                SState::Stopping { run, .. } => {
                    self.runs[run].acting_end.get_or_insert(self.now);
                }
                SState::Reading { id, .. } => self.drop_unread(n, s, id),
                SState::Idle => self.nodes[n].singles[s].state = SState::Gone,
                _ => {}
            }
        }
    }

    /// The next plan while closing: validity was given up on purpose, so no gate.
    fn closing_plan(&mut self, n: usize, now: Instant) -> Plan {
        self.nodes[n]
            .engine
            .plan(now, false, true)
            .expect("BUG: a closing session has no validity gate")
    }

    /// Carries out the engine's shutdown sequence (its rule 7) as the task does, until
    /// it waits for something.
    fn closing_step(&mut self, n: usize) {
        let Some(c) = self.nodes[n].closing else {
            return;
        };
        if self.nodes[n].busy.is_some() {
            // A closing statement past its deadline: the shutdown gives up on it.
            if c.statement_deadline.is_some_and(|d| self.now >= d) {
                self.log(|| format!("n{n} gives up on its closing statement"));
                self.stats.closing_given_up += 1;
                self.stats.shutdowns_failed += 1;
                self.nodes[n].busy = None;
                self.nodes[n].engine.close_failed();
            } else {
                return;
            }
        }
        if self.now < c.until {
            return;
        }
        loop {
            let now = self.at(self.now);
            let next = self.nodes[n].engine.close_next(now);
            self.carry_out(n, self.now);
            let up = matches!(self.nodes[n].conn, Conn::Up { .. });
            match next {
                CloseNext::Done => return self.finish_shutdown(n),
                CloseNext::Step { deadline } if up => {
                    let plan = self.closing_plan(n, now);
                    self.carry_out(n, self.now);
                    if plan.is_empty() {
                        continue;
                    }
                    let deadline = self.t_of(deadline);
                    self.set_closing(n, self.now, false, Some(deadline));
                    let inst = self.nodes[n].inst;
                    self.push(deadline, Ev::Wake { n, inst });
                    return self.send_plan(n, plan);
                }
                // `RESET ALL; UNLISTEN *`: nothing the simulation models.
                CloseNext::Reset { .. } if up => {}
                CloseNext::Step { .. } | CloseNext::Reset { .. } => {
                    self.nodes[n].engine.close_failed();
                }
                CloseNext::Wait { until } => {
                    let until = self.t_of(until);
                    self.set_closing(n, until, true, None);
                    return self.schedule_wake(n, until);
                }
                CloseNext::Linger { until } => {
                    let until = self.t_of(until);
                    self.log(|| format!("n{n} lingers after announcing its releases"));
                    self.set_closing(n, until, false, None);
                    return self.schedule_wake(n, until);
                }
            }
        }
    }

    fn set_closing(&mut self, n: usize, until: T, on_command: bool, deadline: Option<T>) {
        if let Some(c) = &mut self.nodes[n].closing {
            *c = Closing {
                until,
                on_command,
                statement_deadline: deadline,
                begun: true,
                ..*c
            };
        }
    }

    /// A command reached a closing node: a `Wait` of its shutdown ends.
    fn closing_command(&mut self, n: usize) {
        if let Some(c) = &mut self.nodes[n].closing
            && c.on_command
        {
            c.until = self.now;
            c.on_command = false;
        }
    }

    fn finish_shutdown(&mut self, n: usize) {
        if let Conn::Up { pid, .. } = self.nodes[n].conn {
            self.send_up(n, Up::Close { pid });
        }
        // The process exits: every connection of it closes.
        for pid in std::mem::take(&mut self.nodes[n].retiring) {
            self.send_up(n, Up::Close { pid });
        }
        self.log(|| format!("n{n} shut down"));
        self.stats.shutdowns += 1;
        self.nodes[n].end_seen = self.now;
        self.carry_out(n, self.now);
        let node = &mut self.nodes[n];
        node.conn = Conn::Down;
        node.busy = None;
        node.closing = None;
        node.down = true;
        for s in 0..node.singles.len() {
            if let SState::Holding { run, .. } | SState::Stopping { run, .. } =
                node.singles[s].state
            {
                // The process exits: its children end with it.
                let r = &mut self.runs[run];
                r.acting_end.get_or_insert(self.now);
                r.drop_at.get_or_insert(self.now);
            }
            node.singles[s].state = SState::Gone;
        }
        let t = self.now + self.rng.range(SEC, 5 * SEC);
        self.push(t, Ev::RestartNode { n });
    }

    fn restart_node(&mut self, n: usize) {
        let seed = self.rng.next();
        let rules = Rules {
            node: n as u64 + 1,
            ..rules(&self.t)
        };
        let timing = engine_timing(&self.t);
        let node = &mut self.nodes[n];
        node.inst += 1;
        node.engine = Engine::new(rules, timing, seed);
        for p in &self.cfg.off {
            node.engine.switch_off(*p);
        }
        node.conn = Conn::Down;
        node.gens = 0;
        node.attempt = 0;
        node.valid_until = 0;
        node.busy = None;
        node.closing = None;
        node.down = false;
        node.wake_at = None;
        node.end_seen = 0;
        node.abandoned.clear();
        node.known_systems.clear();
        node.withdrawals.clear();
        node.notes.clear();
        node.releases_unanswered = 0;
        node.last_identity = None;
        node.term_end_seen = 0;
        for s in &mut node.singles {
            s.state = SState::Idle;
        }
        let inst = node.inst;
        let count = node.singles.len();
        self.log(|| format!("n{n} restarts as instance {inst}"));
        self.push(self.now, Ev::Reconnect { n, inst });
        for s in 0..count {
            let t = self.now + self.rng.range(0, 100 * MS);
            self.push(t, Ev::Reacquire { n, inst, s });
        }
    }

    // ---- the network ----------------------------------------------------------------------

    fn send_up(&mut self, n: usize, msg: Up) {
        if matches!(self.nodes[n].cut, Cut::Both | Cut::Up) {
            self.nodes[n].held_up.push(msg);
            return;
        }
        // Strictly after the previous message on the connection: same-instant events are
        // ordered at random, and TCP delivers in order.
        let arrival = (self.now + self.latency_of(n)).max(self.nodes[n].last_up + 1);
        self.nodes[n].last_up = arrival;
        self.push(arrival, Ev::Arrive { n, msg });
    }

    fn send_down(&mut self, n: usize, inst: u32, msg: Down, at: T) {
        if matches!(self.nodes[n].cut, Cut::Both | Cut::Down) {
            self.nodes[n].held_down.push((inst, msg, at));
            return;
        }
        let arrival = (at + self.latency_of(n)).max(self.nodes[n].last_down + 1);
        self.nodes[n].last_down = arrival;
        self.push(arrival, Ev::Deliver { n, inst, msg });
    }

    // ---- the server -------------------------------------------------------------------

    fn touch(&mut self, pid: i32) {
        if self.server.touch(pid, self.now) {
            self.push(self.now + self.t.release, Ev::IdleCheck { pid });
        }
    }

    fn arrive(&mut self, n: usize, msg: Up) {
        if self.cfg.rows {
            return self.arrive_rows(n, msg);
        }
        match msg {
            Up::Connect {
                inst,
                attempt,
                handshake,
            } => {
                if let Some(c) = self.accept(n, inst, attempt, handshake) {
                    let pid = c.pid;
                    self.send_connected(n, inst, attempt, pid, c);
                }
            }
            Up::Batch { gn, pid, stmts } => {
                let Some(b) = self.server.backends.get(&pid).copied() else {
                    self.send_down(n, self.nodes[n].inst, Down::Closed { pid }, self.now);
                    return;
                };
                self.touch(pid);
                let fault = self.nodes[n].batch_fault.take();
                if let Some(armed @ BatchFault::DiscardAfterWin { .. }) = fault {
                    // Armed until statements win a key.
                    self.nodes[n].batch_fault = Some(armed);
                }
                match fault {
                    Some(BatchFault::SessionEnds) => {
                        return self.terminate(pid, true, "transaction_timeout");
                    }
                    Some(BatchFault::ReplyLost) => {
                        self.execute(n, pid, &stmts);
                        return self.terminate(pid, true, "connection broke after the commit");
                    }
                    Some(BatchFault::DiscardAfterWin { .. }) | None => {}
                }
                let reply = self.execute(n, pid, &stmts);
                if let Some(BatchFault::DiscardAfterWin { extra, for_ }) = self.nodes[n].batch_fault
                    && reply.tried.iter().any(|(_, o)| {
                        matches!(o, TryOutcome::Won(_) | TryOutcome::WonFenced { .. })
                    })
                {
                    self.nodes[n].batch_fault = None;
                    self.fault("discard_after_win");
                    self.log(|| format!("FAULT n{n} won a key; another client releases every advisory lock of backend {pid}; its connection is slow for {} ms", for_ / MS));
                    self.server.release_locks_of(pid, self.now);
                    self.server.discarded.push((pid, self.now));
                    self.disturbed_until = self.disturbed_until.max(self.now + for_);
                    let node = &mut self.nodes[n];
                    node.slow_until = self.now + for_;
                    node.slow_extra = extra;
                }
                self.send_down(n, b.inst, Down::Reply { gn, reply }, self.now);
            }
            Up::Heartbeat { gn, pid, beat } => match self.server.backends.get(&pid).copied() {
                Some(b) => {
                    self.touch(pid);
                    let locks = self.server.locks_of(pid);
                    self.send_down(n, b.inst, Down::HbOk { gn, beat, locks }, self.now);
                }
                None => self.send_down(n, self.nodes[n].inst, Down::Closed { pid }, self.now),
            },
            Up::Close { pid } => self.terminate(pid, false, CLIENT_CLOSED),
        }
    }

    /// The server takes node `n`'s connect: the new backend (its idle timer started),
    /// or `None` when it is down (the node hears it refused).
    fn accept(&mut self, n: usize, inst: u32, attempt: u64, handshake: T) -> Option<Connected> {
        let Some(c) = self.server.connect(n, inst, self.now, handshake) else {
            self.send_down(n, inst, Down::Refused { attempt }, self.now);
            return None;
        };
        self.pid_owners.insert(c.pid, (n, inst));
        self.push(c.ready + self.t.release, Ev::IdleCheck { pid: c.pid });
        Some(c)
    }

    /// Tells node `n` its session `pid` (a backend, or a lease-row holder) is open, with
    /// what the connect's queries found.
    fn send_connected(&mut self, n: usize, inst: u32, attempt: u64, pid: i32, c: Connected) {
        self.send_down(
            n,
            inst,
            Down::Connected {
                attempt,
                pid,
                proven_at: c.ready,
                term_age: c.term_age,
                high: c.high,
                identity: c.identity,
                system: c.system,
                first_xid: c.first_xid,
                unepoched: c.unepoched,
            },
            c.ready,
        );
    }

    /// A node's message at the server in the lease-row mode: the connect opens a
    /// session (a holder id) on a pooled connection; a batch or a heartbeat runs as
    /// one transaction on the session's connection (a new one of the pool once that
    /// one ended), and fails (ending the session) when the server is down or is
    /// another than the session began on; the close (the link dropped) deletes the
    /// session's rows, best effort.
    fn arrive_rows(&mut self, n: usize, msg: Up) {
        match msg {
            Up::Connect {
                inst,
                attempt,
                handshake,
            } => {
                let Some(c) = self.accept(n, inst, attempt, handshake) else {
                    return;
                };
                let holder = self.next_holder;
                self.next_holder += 1;
                self.pid_owners.insert(holder, (n, inst));
                self.conn_holder.insert(c.pid, holder);
                let opened_on = self.server.backends[&c.pid];
                self.rows_sessions.insert(
                    holder,
                    RowsSession {
                        n,
                        inst,
                        identity: c.identity.clone(),
                        start: epoch_us(c.ready),
                        conn: c.pid,
                        opened_on,
                    },
                );
                self.send_connected(n, inst, attempt, holder, c);
            }
            Up::Batch {
                gn,
                pid: holder,
                stmts,
            } => {
                let Some(inst) = self.rows_sessions.get(&holder).map(|s| s.inst) else {
                    return;
                };
                let conn = match self.rows_conn(holder) {
                    Ok(conn) => conn,
                    Err(why) => {
                        return self.send_down(n, inst, Down::Failed { gn, why }, self.now);
                    }
                };
                let fault = self.nodes[n].batch_fault.take();
                match fault {
                    Some(BatchFault::SessionEnds) => {
                        return self.terminate(conn, true, "transaction_timeout");
                    }
                    Some(BatchFault::ReplyLost) => {
                        self.execute_rows(n, holder, gn, &stmts);
                        return self.terminate(conn, true, "connection broke after the commit");
                    }
                    Some(BatchFault::DiscardAfterWin { .. }) | None => {}
                }
                let failing = self.rows_failing();
                if failing == "rolled_back" {
                    self.fault(failing);
                    let why = "a lease statement failed (simulated)";
                    return self.send_down(n, inst, Down::Failed { gn, why }, self.now);
                }
                let (steps, answer) = self.execute_rows(n, holder, gn, &stmts);
                if failing == "answer_lost" {
                    self.fault(failing);
                    let why = "the connection broke after the batch committed (simulated)";
                    return self.send_down(n, inst, Down::Failed { gn, why }, self.now);
                }
                let at = self.now;
                self.send_down(
                    n,
                    inst,
                    Down::RowsReply {
                        gn,
                        at,
                        steps: Box::new(steps),
                        answer,
                    },
                    self.now,
                );
            }
            Up::Heartbeat {
                gn,
                pid: holder,
                beat,
            } => {
                let Some(inst) = self.rows_sessions.get(&holder).map(|s| s.inst) else {
                    return;
                };
                if let Err(why) = self.rows_conn(holder) {
                    return self.send_down(n, inst, Down::Failed { gn, why }, self.now);
                }
                let failing = self.rows_failing();
                if failing == "rolled_back" {
                    self.fault(failing);
                    let why = "a lease heartbeat failed (simulated)";
                    return self.send_down(n, inst, Down::Failed { gn, why }, self.now);
                }
                let locks = self.server.renew_rows(holder, self.now, self.rows_ttl());
                if failing == "answer_lost" {
                    self.fault(failing);
                    let why = "the connection broke after the heartbeat committed (simulated)";
                    return self.send_down(n, inst, Down::Failed { gn, why }, self.now);
                }
                self.send_down(n, inst, Down::HbOk { gn, beat, locks }, self.now);
            }
            // The link dropped (a lost session retired, a shutdown): its rows deleted,
            // best effort (they expire otherwise).
            Up::Close { pid: holder } => {
                if self.rows_conn(holder).is_ok() {
                    self.log(|| format!("n{n} deletes the rows of session {holder}"));
                    self.server.release_rows(holder);
                }
            }
        }
    }

    /// The pooled connection a batch of session `holder` runs on now, or why it fails:
    /// the server is down, or is another than the session began on (restarted,
    /// promoted: the batch's guard fails).
    fn rows_conn(&mut self, holder: i32) -> Result<i32, &'static str> {
        let Some(session) = self.rows_sessions.get(&holder).cloned() else {
            return Err("no such lease session");
        };
        if !self.server.up {
            return Err("the pool gave no connection: the server is down (simulated)");
        }
        let conn = if self.server.backends.contains_key(&session.conn) {
            session.conn
        } else {
            // The session's connection ended while idle: the pool gives another.
            let Some(c) = self.server.connect(session.n, session.inst, self.now, 0) else {
                return Err("the pool gave no connection (simulated)");
            };
            self.pid_owners.insert(c.pid, (session.n, session.inst));
            self.conn_holder.insert(c.pid, holder);
            if let Some(s) = self.rows_sessions.get_mut(&holder) {
                s.conn = c.pid;
            }
            c.pid
        };
        self.touch(conn);
        if self.server.identity() != session.identity {
            return Err(
                "the pool's connection reached another server than the session's (simulated)",
            );
        }
        Ok(conn)
    }

    /// How long a row lives past its renewal (`server_release_after`, or less on a
    /// server that breaks the timing invariant).
    fn rows_ttl(&self) -> T {
        self.cfg
            .rows_ttl
            .map_or(self.t.release, |ttl| ttl.min(self.t.release))
    }

    /// Now and then a lease-row batch fails, ending its session: rolled back, or
    /// committed with its answer lost (not once the faults stop).
    fn rows_failing(&mut self) -> &'static str {
        let faults_on = self.cfg.random_faults && self.cfg.quiet_after.is_none_or(|q| self.now < q);
        if !faults_on || !self.rng.chance(1) {
            return "";
        }
        if self.rng.chance(50) {
            "rolled_back"
        } else {
            "answer_lost"
        }
    }

    /// One plan of session `holder` as one transaction on the rows (the real mode's
    /// steps, `Steps::of`), with its takeovers checked.
    fn execute_rows(&mut self, n: usize, holder: i32, gn: u64, stmts: &Stmts) -> (Steps, Answer) {
        let steps = Steps::of(stmts);
        let start = self.rows_sessions.get(&holder).map_or(0, |s| s.start);
        let mut taken = Vec::new();
        let ttl = self.rows_ttl();
        let answer = self.server.execute_rows(
            (holder, start, n as u64 + 1),
            &steps,
            self.now,
            ttl,
            &mut taken,
        );
        self.check_takeovers(&taken);
        if !steps.tries.is_empty() {
            self.tries[n].push(self.now);
        }
        // Its client gave it up (the lease timeout, a lost session, a dead process)
        // and it still commits: what it took stays until it expires, or its
        // session's rows are deleted.
        let current = self.nodes[n].inst == self.rows_sessions.get(&holder).map_or(0, |s| s.inst)
            && !self.nodes[n].down
            && matches!(self.nodes[n].conn, Conn::Up { gn: g, pid } if g == gn && pid == holder);
        if !current {
            self.fault("late_commit");
            self.stats.late_commits += 1;
            self.log(|| format!("n{n}'s given-up batch of session {holder} commits late"));
        }
        (steps, answer)
    }

    /// Rows taken over (expired, or deleted and taken again): each holder's client
    /// must have stopped trusting its row (its last answered heartbeat's send time plus
    /// the lease timeout) at least its stop budget before, unless a promotion lost the
    /// row's last renewals (the new term's hold keeps that tenure apart from the next:
    /// the grants' check in `on_grant`).
    fn check_takeovers(&mut self, taken: &[(LockKey, Row)]) {
        for (key, row) in taken {
            // Kept for a hand-over's target: held by no session.
            if row.holder == 0 {
                continue;
            }
            self.stats.row_takeovers += 1;
            // Its holder's process is frozen: what it still runs after the freeze is
            // the freeze window (gap (a)).
            if let Some(s) = self.rows_sessions.get(&row.holder) {
                let node = &self.nodes[s.n];
                if let Some(idx) = node.frozen
                    && node.inst == s.inst
                    && matches!(node.conn, Conn::Up { pid, .. } if pid == row.holder)
                {
                    self.freezes[idx].server_ended = true;
                }
            }
            // Less what a promotion lost of its renewals (the new term's hold keeps
            // the next grant back then).
            if row.shortened {
                self.stats.shortened_takeovers += 1;
            }
            if let Some(until) = self.trust.get(&row.holder).copied()
                && self.now + row.lost < until + self.t.stop_budget
            {
                self.violation(format!(
                    "the row of {key} held by session {} is taken over {} ms after that holder's client stopped trusting it (at {:.3} ms), within its stop budget",
                    row.holder,
                    (self.now as i64 - until as i64) / 1000,
                    until as f64 / 1000.0
                ));
            }
        }
    }

    /// The node's process dies (`kill -9`, out of memory): its children end with it,
    /// its connections close, and its lease rows stay until they expire (nobody deletes
    /// them). A new instance starts a while later.
    fn kill_node(&mut self, n: usize) {
        self.fault("kill");
        self.log(|| format!("FAULT n{n}'s process dies"));
        let inst = self.nodes[n].inst;
        let conns: Vec<i32> = self
            .server
            .backends
            .iter()
            .filter(|(_, b)| b.n == n && b.inst == inst)
            .map(|(pid, _)| *pid)
            .collect();
        for pid in conns {
            self.terminate(pid, false, CLIENT_CLOSED);
        }
        self.disturbed_until = self.disturbed_until.max(self.now + self.t.release + SEC);
        let now = self.now;
        let node = &mut self.nodes[n];
        node.end_seen = now;
        node.conn = Conn::Down;
        node.busy = None;
        node.closing = None;
        node.down = true;
        node.hb_out = 0;
        node.retiring.clear();
        for s in 0..node.singles.len() {
            if let SState::Holding { run, .. } | SState::Stopping { run, .. } =
                node.singles[s].state
            {
                let r = &mut self.runs[run];
                r.acting_end.get_or_insert(now);
                r.drop_at.get_or_insert(now);
            }
            node.singles[s].state = SState::Gone;
        }
        let t = self.now + self.rng.range(SEC, 5 * SEC);
        self.push(t, Ev::RestartNode { n });
    }

    /// NOTIFY at commit: every listening backend, stamped with the sender's pid.
    fn notify(&mut self, sender: i32, keys: &[LockKey]) {
        self.notify_for(sender, keys, &[]);
    }

    fn notify_for(&mut self, sender: i32, keys: &[LockKey], hand: &[(LockKey, u64)]) {
        let notices = self.server.announce(sender, keys, hand, self.now);
        self.send_notices(notices);
    }

    fn send_notices(&mut self, notices: Vec<Notice>) {
        for notice in notices {
            let Notice {
                n,
                inst,
                to,
                sender,
                sender_start,
                sent_at,
                keys,
                hand,
            } = notice;
            self.send_down(
                n,
                inst,
                Down::Notify {
                    to,
                    sender,
                    sender_start,
                    sent_at,
                    keys,
                    hand,
                },
                sent_at,
            );
        }
    }

    /// The statements of one plan, in the order the driver pipelines them.
    fn execute(&mut self, n: usize, pid: i32, stmts: &Stmts) -> Reply {
        // A statement fails now and then with the session intact, in each way the
        // server fails one: the engine decides what each failure means.
        let failing = if self.cfg.random_faults && self.rng.chance(1) {
            match self.rng.below(4) {
                0 => "try_failed",
                1 => "lock_table_full",
                2 => "check_failed",
                _ => "token_failed",
            }
        } else {
            ""
        };
        let Executed {
            reply,
            violations,
            faults,
            tried,
            notices,
        } = self.server.execute(n, pid, stmts, self.now, failing);
        for kind in faults {
            self.fault(kind);
        }
        for text in violations {
            self.violation(text);
        }
        if tried {
            self.tries[n].push(self.now);
        }
        for notices in notices {
            self.send_notices(notices);
        }
        reply
    }
    /// The backend of the holder of a key dies (terminated), and its pid goes at once
    /// to a foreign backend, which announces what the dead one held (its earlier
    /// payload, when it sent one, plus those keys) and then stays a while or leaves.
    fn pid_reuse(&mut self) {
        let Some((n, pid)) = self.pick_node(true) else {
            return;
        };
        let mut keys: Vec<LockKey> = self
            .server
            .excl
            .iter()
            .filter(|(k, p)| **p == pid && self.keys.contains(k))
            .map(|(k, _)| *k)
            .collect();
        let (earlier, hand) = self
            .server
            .last_payload
            .get(&pid)
            .cloned()
            .unwrap_or_default();
        for k in earlier {
            if !keys.contains(&k) {
                keys.push(k);
            }
        }
        if keys.is_empty() {
            return;
        }
        self.fault("terminate");
        self.log(|| format!("FAULT terminate n{n}, then its pid {pid} is reused"));
        self.terminate(pid, true, "pg_terminate_backend");
        let at = self.now + self.rng.range(0, 20 * MS);
        let leave = if self.rng.chance(50) {
            at
        } else {
            at + self.rng.range(MS, 2 * SEC)
        };
        self.push(
            at,
            Ev::PidReuse {
                pid,
                keys,
                hand,
                leave,
            },
        );
    }

    fn terminate(&mut self, pid: i32, tell: bool, why: &'static str) {
        let Some(b) = self.server.end_backend(pid, self.now, why != CLIENT_CLOSED) else {
            return;
        };
        let node = &self.nodes[b.n];
        if let Some(idx) = node.frozen
            && node.inst == b.inst
            && matches!(node.conn, Conn::Up { pid: p, .. } if p == pid)
        {
            self.freezes[idx].server_ended = true;
        }
        self.log(|| format!("server ends backend {pid} of n{}: {why}", b.n));
        if tell {
            self.send_down(b.n, b.inst, Down::Closed { pid }, self.now);
        }
    }

    /// Another client on the node's backend releases its advisory locks behind its back
    /// (`DISCARD ALL` or `pg_advisory_unlock_all()` by a pooler's next client, or a DBA's
    /// script), the session itself staying up.
    fn discard_all(&mut self) {
        let Some((n, pid)) = self.pick_node(true) else {
            return;
        };
        // Half the time that client then takes advisory locks of its own on the
        // backend, as many as it released or so: a guard that counted the session's
        // locks would not see the release.
        let take = if self.rng.below(2) == 0 {
            let held = self.server.locks_of(pid).len() as u64;
            Some(
                self.rng
                    .range(held.saturating_sub(1).max(1), held + 2)
                    .min(250) as u8,
            )
        } else {
            None
        };
        self.fault(if take.is_some() {
            "discard_and_take"
        } else {
            "discard_all"
        });
        self.log(|| {
            format!("FAULT another client releases every advisory lock of n{n}'s backend {pid}, then takes {} of its own", take.unwrap_or(0))
        });
        self.server.release_locks_of(pid, self.now);
        if let Some(take) = take {
            self.server.foreign_locks.insert(pid, take);
        }
        self.server.discarded.push((pid, self.now));
    }

    fn holder_pid(&self, key: LockKey) -> Option<i32> {
        self.nodes.iter().find_map(|node| match node.conn {
            Conn::Up { pid, .. }
                if node.singles.iter().any(|s| {
                    s.key == key
                        && matches!(s.state, SState::Holding { .. } | SState::Reading { .. })
                }) =>
            {
                Some(pid)
            }
            _ => None,
        })
    }

    fn restart_server(&mut self, down: T) {
        self.server_down(down, Coming::Restart);
    }

    /// The server stops answering: every backend ends (its clients hear of it), and
    /// after `down` the server comes back as `coming` says.
    fn server_down(&mut self, down: T, coming: Coming) {
        let kind = match coming {
            Coming::Restart => "restart",
            Coming::Promotion { .. } => "promotion",
            Coming::Replaced { .. } => "replaced_cluster",
        };
        self.fault(kind);
        self.log(|| format!("SERVER DOWN ({coming:?}) for {} ms", down / MS));
        self.server.up = false;
        self.server.ended = Some(self.now);
        self.server.coming = coming;
        if let Coming::Replaced { .. } = coming {
            // Which node instances knew the old cluster: they refuse a new one whose
            // tokens would not order after the old one's.
            for n in 0..self.nodes.len() {
                if self.nodes[n].engine.knows_a_cluster() {
                    let inst = self.nodes[n].inst;
                    self.saw_old_cluster.insert((n, inst));
                }
            }
        }
        let pids: Vec<i32> = self.server.backends.keys().copied().collect();
        for pid in pids {
            self.terminate(pid, true, "server down");
        }
        self.push(self.now + down, Ev::ServerUp);
    }

    fn server_up(&mut self) {
        let now = self.now;
        // Its term hold (and a promotion's unknown age) is part of the disturbance.
        self.disturbed_until = self.disturbed_until.max(now + 8 * SEC);
        let server = &mut self.server;
        server.up = true;
        server.started = Some(now);
        server.started_wall = Some(now as i64 + server.clock);
        server.age_unknown_until = 0;
        server.clock_at_start = server.clock;
        match std::mem::replace(&mut server.coming, Coming::Restart) {
            Coming::Restart => {}
            Coming::Promotion { lag } => {
                server.timeline += 1;
                server.xid = server.xid.saturating_sub(lag);
                // The lease-row mode: the standby had not replayed the last `lag` of
                // history, some 160 ms of rows each, up to 8 s (lost renewals, lost
                // takes: longer than a row's slack, so that only the new term's hold
                // keeps tenures apart).
                if self.cfg.rows {
                    let down_at = server.ended.unwrap_or(now);
                    server.lose_recent_rows(down_at, (lag * 160 * MS).min(8 * SEC));
                }
                // The end-of-recovery checkpoint takes a while: until it is done, the
                // term query cannot tell when the term began.
                let unknown = self.rng.range(0, 8 * SEC);
                self.server.age_unknown_until = now + unknown;
            }
            Coming::Replaced { xid, epoch_set } => {
                // The documented N: the high bits of the newest token issued before,
                // on whichever cluster.
                let due = server.high_water;
                server.timeline = 1;
                server.system += 1;
                server.xid = xid;
                server.epoch_due = due;
                if epoch_set {
                    server.epoch = due;
                    server.epoch_missing = false;
                } else {
                    server.epoch = 0;
                    server.epoch_missing = true;
                    if self.cfg.random_faults {
                        let later = self.rng.range(2 * SEC, 20 * SEC);
                        self.push(now + later, Ev::EpochSet);
                    }
                }
            }
        }
        // A clock step early in the term, where the term hold measures with it.
        if self.cfg.random_faults && self.rng.chance(50) {
            let at = now + self.rng.range(0, 4 * SEC);
            self.push(at, Ev::ClockStep { young: true });
        }
        let s = &self.server;
        let line = format!(
            "server up: timeline {}, epoch {}, system {}, next xid {}",
            s.timeline,
            s.epoch,
            s.system,
            s.xid + 1
        );
        self.log(|| line);
    }

    fn forged(&mut self, key: LockKey, count: u32) {
        self.fault("forged_notify");
        self.log(|| format!("FORGED NOTIFY x{count} for {key}"));
        for _ in 0..count {
            let sender = FORGED_PIDS + self.rng.below(1000) as i32;
            // Half of them hand the key over (to a node, or to none that exists).
            if self.rng.chance(50) {
                let to = self.rng.below(self.nodes.len() as u64 + 1) + 1;
                self.notify_for(sender, &[key], &[(key, to)]);
            } else {
                self.notify(sender, &[key]);
            }
        }
    }

    // ---- faults ---------------------------------------------------------------------------

    /// A node a fault may hit: connected, live at the server, and not already in a
    /// fault (double faults that hide a termination from its holder, which only the
    /// fencing token covers, are not generated).
    /// (In the lease-row mode: the session's pooled connection, what a termination
    /// ends.)
    fn eligible(&self, n: usize) -> Option<i32> {
        let node = &self.nodes[n];
        if self.cfg.rows {
            let Conn::Up { pid: holder, .. } = node.conn else {
                return None;
            };
            let conn = self.rows_sessions.get(&holder)?.conn;
            let fit = !node.down
                && node.frozen.is_none()
                && node.cut == Cut::None
                && self.server.backends.contains_key(&conn);
            return fit.then_some(conn);
        }
        match node.conn {
            // A closing node too: faults go on while it shuts down.
            Conn::Up { pid, .. }
                if !node.down
                    && node.frozen.is_none()
                    && node.cut == Cut::None
                    && self.server.backends.contains_key(&pid) =>
            {
                Some(pid)
            }
            _ => None,
        }
    }

    fn pick_node(&mut self, prefer_holders: bool) -> Option<(usize, i32)> {
        let all: Vec<(usize, i32)> = (0..self.nodes.len())
            .filter_map(|n| self.eligible(n).map(|p| (n, p)))
            .collect();
        let holders: Vec<(usize, i32)> = all
            .iter()
            .copied()
            .filter(|(n, _)| {
                self.nodes[*n]
                    .singles
                    .iter()
                    .any(|s| matches!(s.state, SState::Holding { .. } | SState::Reading { .. }))
            })
            .collect();
        let from = if prefer_holders && !holders.is_empty() && self.rng.chance(75) {
            holders
        } else {
            all
        };
        if from.is_empty() {
            return None;
        }
        let i = self.rng.below(from.len() as u64) as usize;
        Some(from[i])
    }

    fn random_fault(&mut self) {
        let roll = self.rng.below(100);
        // The lease-row mode has no announcements, no advisory locks another client
        // could release, no backend whose pid matters: those rolls kill a process, or
        // terminate a pooled connection.
        let roll = match roll {
            75..81 | 90..92 if self.cfg.rows => {
                if let Some((n, _)) = self.pick_node(true) {
                    self.kill_node(n);
                }
                return;
            }
            84..90 if self.cfg.rows => 0,
            roll => roll,
        };
        match roll {
            0..26 => {
                if let Some((n, pid)) = self.pick_node(true) {
                    self.fault("terminate");
                    self.log(|| format!("FAULT terminate n{n}"));
                    self.terminate(pid, true, "pg_terminate_backend");
                }
            }
            26..42 => {
                if let Some((n, _)) = self.pick_node(true) {
                    let d = self.rng.range(300 * MS, 15 * SEC);
                    // Mostly both ways; else one way only (a half-broken route, a
                    // firewall dropping one direction).
                    let (cut, kind) = match self.rng.below(8) {
                        0 | 1 => (Cut::Up, "partition_requests"),
                        2 | 3 => (Cut::Down, "partition_replies"),
                        _ => (Cut::Both, "partition"),
                    };
                    self.fault(kind);
                    self.log(|| format!("FAULT {kind} n{n} for {} ms", d / MS));
                    self.nodes[n].cut = cut;
                    self.push(self.now + d, Ev::Heal { n });
                }
            }
            42..57 => {
                if let Some((n, _)) = self.pick_node(true) {
                    let d = if self.rng.chance(40) {
                        self.rng.range(6 * SEC, 12 * SEC)
                    } else {
                        self.rng.range(100 * MS, 5 * SEC)
                    };
                    self.fault(if d > self.t.release {
                        "freeze_long"
                    } else {
                        "freeze"
                    });
                    self.log(|| format!("FAULT freeze n{n} for {} ms", d / MS));
                    self.freezes.push(Freeze {
                        n,
                        inst: self.nodes[n].inst,
                        from: self.now,
                        to: self.now + d,
                        server_ended: false,
                        wall_from: self.server.wall(self.now),
                        wall_peak: self.server.wall(self.now),
                    });
                    self.nodes[n].frozen = Some(self.freezes.len() - 1);
                    self.push(self.now + d, Ev::Thaw { n });
                }
            }
            57..64 => {
                let calm = self.server.up
                    && self
                        .nodes
                        .iter()
                        .all(|node| node.frozen.is_none() && node.cut == Cut::None);
                if calm {
                    match self.rng.below(100) {
                        0..70 => {
                            let down = self.rng.range(200 * MS, 4 * SEC);
                            self.restart_server(down);
                        }
                        70..92 => {
                            // A failover: the standby is found dead-primary and promoted.
                            let down = self.rng.range(SEC, 10 * SEC);
                            let lag = self.rng.range(0, 40);
                            self.server_down(down, Coming::Promotion { lag });
                        }
                        // (Not in the lease-row mode: see the module's notes.)
                        _ if self.cfg.rows => {
                            let down = self.rng.range(SEC, 10 * SEC);
                            let lag = self.rng.range(0, 40);
                            self.server_down(down, Coming::Promotion { lag });
                        }
                        _ => {
                            let down = self.rng.range(SEC, 10 * SEC);
                            let xid = self.rng.range(500, self.server.xid.max(501));
                            let epoch_set = self.rng.chance(70);
                            self.server_down(down, Coming::Replaced { xid, epoch_set });
                        }
                    }
                }
            }
            64..67 => self.clock_step(false),
            67..75 => {
                let disconnected: Vec<usize> = (0..self.nodes.len())
                    .filter(|n| {
                        let node = &self.nodes[*n];
                        !node.down
                            && node.closing.is_none()
                            && node.frozen.is_none()
                            && !matches!(node.conn, Conn::Up { .. })
                    })
                    .collect();
                if !disconnected.is_empty() && self.rng.chance(25) {
                    let n = disconnected[self.rng.below(disconnected.len() as u64) as usize];
                    self.fault("shutdown_disconnected");
                    self.begin_shutdown(n);
                } else if let Some((n, _)) = self.pick_node(true)
                    && self.nodes[n].closing.is_none()
                {
                    self.fault("shutdown");
                    self.begin_shutdown(n);
                }
            }
            81..84 => {
                let waiting: Vec<(usize, usize, RequestId)> =
                    (0..self.nodes.len())
                        .filter(|n| !self.nodes[*n].down)
                        .flat_map(|n| {
                            self.nodes[n].singles.iter().enumerate().filter_map(
                                move |(s, single)| match single.state {
                                    SState::Waiting(id) => Some((n, s, id)),
                                    _ => None,
                                },
                            )
                        })
                        .collect();
                if !waiting.is_empty() {
                    let (n, s, id) = waiting[self.rng.below(waiting.len() as u64) as usize];
                    self.give_up(n, s, id);
                }
            }
            75..81 => {
                let key = self.keys[self.rng.below(self.keys.len() as u64) as usize];
                let count = self.rng.range(1, 50) as u32;
                self.forged(key, count);
            }
            84..90 => self.pid_reuse(),
            90..92 => self.discard_all(),
            92..96 => {
                if let Some((n, _)) = self.pick_node(true) {
                    // Replies (and requests) slow for a while, each by up to the lease
                    // timeout: the heartbeat's answers come too late, statements answer
                    // past the validity deadline.
                    let extra = self.rng.range(100 * MS, self.t.lease);
                    let d = self.rng.range(500 * MS, 8 * SEC);
                    self.fault("slow_replies");
                    self.log(|| {
                        format!(
                            "FAULT slow replies n{n}: up to {} ms more for {} ms",
                            extra / MS,
                            d / MS
                        )
                    });
                    self.disturbed_until = self.disturbed_until.max(self.now + d);
                    let node = &mut self.nodes[n];
                    node.slow_until = self.now + d;
                    node.slow_extra = extra;
                }
            }
            _ => {
                if let Some((n, _)) = self.pick_node(true) {
                    let fault = match self.rng.below(if self.cfg.rows { 2 } else { 4 }) {
                        0 => BatchFault::ReplyLost,
                        1 => BatchFault::SessionEnds,
                        _ => BatchFault::DiscardAfterWin {
                            extra: self.rng.range(100 * MS, self.t.lease),
                            for_: self.rng.range(500 * MS, 6 * SEC),
                        },
                    };
                    match fault {
                        BatchFault::ReplyLost => self.fault("reply_lost_after_commit"),
                        BatchFault::SessionEnds => self.fault("session_ends_in_statement"),
                        // Counted when it strikes.
                        BatchFault::DiscardAfterWin { .. } => {}
                    }
                    self.log(|| format!("FAULT {fault:?} n{n}, at its next statements"));
                    self.nodes[n].batch_fault = Some(fault);
                }
            }
        }
    }

    /// The server's wall clock steps (NTP, a VM resumed): back by up to 10 s, or forward
    /// by up to `safety_margin`, which the term hold absorbs (the failover contract
    /// states it as the tolerance), or now and then by up to three times that (half
    /// the steps early in a term).
    fn clock_step(&mut self, young: bool) {
        if self.cfg.rows {
            return self.rows_clock_step();
        }
        let step = if young && self.rng.chance(50) {
            self.rng.range(self.t.margin, 3 * self.t.margin) as i64
        } else if self.rng.chance(50) {
            -(self.rng.range(MS, 10 * SEC) as i64)
        } else if self.rng.chance(70) {
            self.rng.range(MS, self.t.margin) as i64
        } else {
            self.rng.range(self.t.margin, 3 * self.t.margin) as i64
        };
        self.step_clock(step);
    }

    /// The lease-row mode's clock steps: the rows expire by the server's wall clock,
    /// which the timing invariant allows to step forward by up to `safety_margin` (once
    /// per row lifetime: two such steps within one would add up); back by up to 10 s
    /// (rows then live that much longer: the liveness check waits for them).
    fn rows_clock_step(&mut self) {
        let step = if self.now >= self.next_forward_step && self.rng.chance(50) {
            self.next_forward_step = self.now + self.t.release + SEC;
            self.rng.range(MS, self.t.margin) as i64
        } else {
            let back = self.rng.range(MS, 10 * SEC);
            self.disturbed_until = self.disturbed_until.max(self.now + self.t.release + back);
            -(back as i64)
        };
        // The bound the contract states (a simulation's own check).
        if step > self.t.margin as i64 {
            self.violation(format!(
                "the server's clock steps forward {} ms, past the safety margin",
                step / 1000
            ));
        }
        self.step_clock(step);
    }

    fn step_clock(&mut self, step: i64) {
        self.fault("clock_step");
        self.log(|| format!("FAULT the server's clock steps {} ms", step / 1000));
        let wall = self.server.wall(self.now);
        for node in &self.nodes {
            if let Some(idx) = node.frozen {
                let freeze = &mut self.freezes[idx];
                freeze.wall_peak = freeze.wall_peak.max(wall);
            }
        }
        self.server.clock += step;
    }

    // ---- the checks -----------------------------------------------------------------------

    /// Acting or running segments of a run: `(from, to, stale)`, the part after a freeze
    /// during which the server ended the session being stale (for running segments,
    /// also after a freeze before whose end another client released its locks).
    fn segments(&self, r: &Run, acting: bool) -> Vec<(T, T, bool)> {
        let end = if acting { r.acting_end } else { r.drop_at }.unwrap_or(self.now);
        if acting {
            // As the nemesis checker: a run acts through short freezes; after a freeze in
            // which the server ended the session, the rest of the run is stale.
            let freeze = self.freezes.iter().find(|f| {
                f.n == r.n
                    && f.inst == r.inst
                    && f.server_ended
                    && f.from >= r.grant_at
                    && f.from < end
            });
            return match freeze {
                None => vec![(r.grant_at, end, false)],
                Some(f) if end >= f.to => vec![(r.grant_at, f.from, false), (f.to, end, true)],
                Some(f) => vec![(r.grant_at, f.from, false)],
            };
        }
        // Running: a frozen process runs nothing, so every freeze is cut out. After a
        // freeze in which, or before which, the run lost its lock (the server ended its
        // session during the freeze; another client released its session's locks, gap
        // (e), which is as good as an end for its holder, and whose bound `judge_pair`
        // then checks), the rest of the run is stale.
        let mut out = Vec::new();
        let (mut from, mut stale) = (r.grant_at, false);
        for f in self
            .freezes
            .iter()
            .filter(|f| f.n == r.n && f.inst == r.inst && f.to > r.grant_at && f.from < end)
        {
            out.push((from, f.from.max(from), stale));
            from = f.to;
            stale |= f.server_ended
                || self
                    .server
                    .discarded
                    .iter()
                    .any(|(pid, at)| *pid == r.pid && *at >= r.grant_at && *at < f.to);
        }
        if from <= end {
            out.push((from, end, stale));
        }
        out
    }

    /// Another client released the locks of `r`'s session while the run was out.
    fn discarded_in(&self, r: &Run) -> bool {
        let end = r.drop_at.unwrap_or(self.now);
        self.server
            .discarded
            .iter()
            .any(|(pid, at)| *pid == r.pid && *at >= r.grant_at && *at < end)
    }

    /// The process of `r` was frozen at some time in `[from, to)` while its run was out.
    fn frozen_while_out(&self, r: &Run, before: T) -> bool {
        let end = r.drop_at.unwrap_or(self.now);
        self.freezes.iter().any(|f| {
            f.n == r.n && f.inst == r.inst && f.from < before.min(end) && f.to > r.grant_at
        })
    }

    fn fence_held(&self, n: usize, inst: u32, key: LockKey, at: T) -> bool {
        self.server.fences.iter().any(|h| {
            h.key == key
                && self
                    .pid_owner(h.pid)
                    .is_some_and(|(hn, hi)| hn == n && hi == inst)
                // Taken at the very instant of the decision, it ran after the
                // statement that decided (the server runs one at a time).
                && h.from < at
                && h.to.is_none_or(|to| at < to)
        })
    }

    /// The cluster of node `n`'s session's backend (0: none).
    fn session_system(&self, n: usize) -> u32 {
        self.session_backend(n).map_or(0, |b| b.system)
    }

    /// The backend of node `n`'s session while the server has it (in the lease-row
    /// mode, the one the session opened on, kept by the session whatever became of
    /// it).
    fn session_backend(&self, n: usize) -> Option<Backend> {
        let Conn::Up { pid, .. } = self.nodes[n].conn else {
            return None;
        };
        if self.cfg.rows {
            return self.rows_sessions.get(&pid).map(|s| s.opened_on);
        }
        self.server.backends.get(&pid).copied()
    }

    /// Does node `n`'s session hold `key` at the server now: its advisory lock, or in
    /// the lease-row mode its live row?
    fn holds_at_server(&self, n: usize, key: LockKey) -> bool {
        match self.nodes[n].conn {
            Conn::Up { pid, .. } if self.cfg.rows => self
                .server
                .live_row(key, self.now)
                .is_some_and(|r| r.holder == pid),
            Conn::Up { pid, .. } => self.server.excl.get(&key) == Some(&pid),
            _ => false,
        }
    }

    /// Is node `n`'s session live at the server: its backend, or in the lease-row mode
    /// the server it began on (up, not restarted nor promoted)?
    fn session_live(&self, n: usize) -> bool {
        match self.nodes[n].conn {
            Conn::Up { pid, .. } if self.cfg.rows => {
                self.server.up
                    && self
                        .rows_sessions
                        .get(&pid)
                        .is_some_and(|s| s.identity == self.server.identity())
            }
            Conn::Up { pid, .. } => self.server.backends.contains_key(&pid),
            _ => false,
        }
    }

    /// Is node `n` on a session of a replaced cluster opened before the DBA set its
    /// token epoch, without having seen the old cluster? Its tokens may come out below
    /// the old cluster's, and it cannot know (the documented operator duty).
    fn unepoched(&self, n: usize) -> bool {
        let session = self.session_backend(n).is_some_and(|b| b.unepoched);
        session && !self.saw_old_cluster.contains(&(n, self.nodes[n].inst))
    }

    /// Is the run's overlap with a tenure decided at `decided_at` inside gap (c)? The
    /// server ended the session that held the key (or a later one of its process that
    /// held the fence) before then, and the run stayed within the bound: no heartbeat of
    /// an ended session succeeds, so its work stopped acting by that end + `lease` and
    /// had stopped by the end + `lease` + `stop_budget`.
    /// Says which end it was (another client releasing its locks is gap (e)).
    fn within_gap_c(&self, x: &Run, decided_at: T) -> Result<End, String> {
        // The lease-row mode has no such gap: nothing the server ends (a pooled
        // connection, an idle one) frees a row, and nobody else deletes one.
        if self.cfg.rows {
            return Err(
                "outside the lease-row mode's gaps (only the freeze window, gap (a))".to_owned(),
            );
        }
        // A backend whose locks another client released is as good as ended for
        // its holder: the lock guard ends the session with its next heartbeat.
        let ended = self
            .server
            .ended_by_server
            .iter()
            .map(|(pid, at)| (pid, at, false))
            .chain(
                self.server
                    .discarded
                    .iter()
                    .map(|(pid, at)| (pid, at, true)),
            )
            .filter(|(pid, at, _)| {
                if **at > decided_at {
                    return false;
                }
                // Its own session (which may have ended before the grant's answer
                // arrived, a slow network: granted stale, it acts until it hears), or
                // a later session of its process that held this key's stop fence.
                **pid == x.pid
                    || (self.pid_owner(**pid) == Some((x.n, x.inst))
                        && **at >= x.grant_at
                        && self
                            .server
                            .fences
                            .iter()
                            .any(|h| h.pid == **pid && h.key == x.key && h.from <= **at))
            })
            .map(|(_, at, discard)| (*at, discard))
            .max();
        let Some((ended, by_discard)) = ended else {
            return Err("the old holder's session was not ended by the server".to_owned());
        };
        let acting_end = x.acting_end.unwrap_or(self.now);
        let drop_at = x.drop_at.unwrap_or(self.now);
        // The monotonic deadline does not move with a freeze, but a process frozen
        // across it notices only when it thaws; and its stopping work does not run
        // while it is frozen (the freeze window, fenced by the token).
        let mine = || {
            self.freezes
                .iter()
                .filter(|f| f.n == x.n && f.inst == x.inst)
        };
        let mut acting_bound = ended + self.t.lease;
        for f in mine() {
            if f.from <= acting_bound && acting_bound < f.to {
                // What waited during the freeze runs right after it, one event a
                // microsecond here: the loss is seen within a moment of the thaw.
                acting_bound = f.to + THAW_SLACK;
            }
        }
        let frozen_stopping: T = mine()
            .map(|f| f.to.min(drop_at).saturating_sub(f.from.max(acting_bound)))
            .sum();
        let drop_bound = acting_bound + self.t.stop_budget + frozen_stopping;
        if acting_end > acting_bound || drop_at > drop_bound {
            return Err(format!(
                "past the bound of gap (c): acting until {:.3} ms (bound {:.3}), stopped {:.3} ms (bound {:.3}), its session ended at the server at {:.3} ms",
                acting_end as f64 / 1000.0,
                acting_bound as f64 / 1000.0,
                drop_at as f64 / 1000.0,
                drop_bound as f64 / 1000.0,
                ended as f64 / 1000.0
            ));
        }
        Ok(if by_discard {
            End::Discard
        } else {
            End::Server
        })
    }

    fn pid_owner(&self, pid: i32) -> Option<(usize, u32)> {
        self.pid_owners.get(&pid).copied()
    }

    fn judge(&mut self) {
        let mut by_key: BTreeMap<LockKey, Vec<usize>> = BTreeMap::new();
        for (i, r) in self.runs.iter().enumerate() {
            by_key.entry(r.key).or_default().push(i);
        }
        let mut found: Vec<String> = Vec::new();
        for list in by_key.values() {
            for (i, &xi) in list.iter().enumerate() {
                for &yi in &list[i + 1..] {
                    let (x, y) = (self.runs[xi].clone(), self.runs[yi].clone());
                    if let Err(v) = self.judge_pair(xi, &x, yi, &y) {
                        found.push(v);
                    }
                }
            }
        }
        for v in found {
            self.violation(v);
        }
    }

    /// Once faults stop and their effects end, a key some live node waits for is held
    /// again within [`LIVENESS`].
    fn check_liveness(&mut self) {
        let Some(quiet) = self.cfg.quiet_after else {
            return;
        };
        let settled = quiet.max(self.disturbed_until);
        if self.now < settled + LIVENESS {
            return;
        }
        self.stats.settled_runs += 1;
        // How long each grant after that waited once its key was free and asked for.
        for r in &self.runs {
            if r.grant_at <= settled || r.how == How::Handoff {
                continue;
            }
            let last_drop = self
                .runs
                .iter()
                .filter(|p| p.key == r.key && p.grant_at < r.grant_at)
                .filter_map(|p| p.drop_at)
                .filter(|d| *d <= r.grant_at)
                .max()
                .unwrap_or(0);
            let wait = r.grant_at - settled.max(last_drop).max(r.asked_at);
            self.stats.longest_wait_settled = self.stats.longest_wait_settled.max(wait);
        }
        for k in self.keys.clone() {
            let held = self
                .runs
                .iter()
                .any(|r| r.key == k && r.drop_at.is_none() && !r.born_invalid);
            if held {
                continue;
            }
            let waiting_since = self
                .nodes
                .iter()
                .filter(|node| !node.down && node.closing.is_none())
                .flat_map(|node| node.singles.iter())
                .filter(|single| single.key == k && matches!(single.state, SState::Waiting(_)))
                .map(|single| single.since)
                .min();
            let Some(since) = waiting_since else {
                continue;
            };
            let last_drop = self
                .runs
                .iter()
                .filter(|r| r.key == k)
                .filter_map(|r| r.drop_at)
                .max()
                .unwrap_or(0);
            let free_since = settled.max(last_drop).max(since);
            let free_for = self.now - free_since;
            self.stats.longest_wait_settled = self.stats.longest_wait_settled.max(free_for);
            if free_for > LIVENESS {
                self.violation(format!(
                    "{k} is free and waited for {} ms after the faults' effects ended at {:.3} ms",
                    free_for / MS,
                    settled as f64 / 1000.0
                ));
            }
        }
    }

    /// Judges two runs of one key, `x` granted no later than `y`.
    fn judge_pair(&mut self, xi: usize, x: &Run, yi: usize, y: &Run) -> Result<(), String> {
        let label = |i: usize, r: &Run| {
            format!(
                "run {i} (n{}#{} token {} {:?} granted {:.3} ms)",
                r.n,
                r.inst,
                r.token,
                r.how,
                r.grant_at as f64 / 1000.0
            )
        };
        let overlap = |a: (T, T, bool), b: (T, T, bool)| {
            let (lo, hi) = (a.0.max(b.0), a.1.min(b.1));
            if a.2 || b.2 { lo <= hi } else { lo < hi }
        };
        if x.born_invalid || y.born_invalid {
            // Never acted; counted as a finding when its token regressed.
            return Ok(());
        }
        if x.n == y.n && x.inst == y.inst {
            if x.drop_at.unwrap_or(self.now) > y.grant_at {
                return Err(format!(
                    "{} and {} of one process ran at once",
                    label(xi, x),
                    label(yi, y)
                ));
            }
            return Ok(());
        }
        // The freeze window first, on running segments (acting ones are inside them).
        let (xs, ys) = (self.segments(x, false), self.segments(y, false));
        let mut stale_ok = false;
        let mut fresh_overlap = false;
        let mut x_stale = false;
        for a in &xs {
            for b in &ys {
                if !overlap(*a, *b) {
                    continue;
                }
                x_stale |= a.2;
                match (a.2, b.2) {
                    (false, false) => fresh_overlap = true,
                    (true, false) | (false, true) => {
                        let (stale, holder) = if a.2 { (x, y) } else { (y, x) };
                        let excused = holder.unepoched && holder.system != stale.system;
                        if holder.token <= stale.token && !excused {
                            return Err(format!(
                                "stale {} is not fenced by {}",
                                label(if a.2 { xi } else { yi }, stale),
                                label(if a.2 { yi } else { xi }, holder)
                            ));
                        }
                        stale_ok = true;
                    }
                    // Gap (a) twice: both holders were frozen while the server ended
                    // their sessions; the later holder's greater token fences the
                    // earlier one, as for one stale run.
                    (true, true) if y.token > x.token || (y.unepoched && y.system != x.system) => {
                        stale_ok = true;
                    }
                    (true, true) => {
                        return Err(format!(
                            "two stale runs at once, not ordered by tokens: {} and {}",
                            label(xi, x),
                            label(yi, y)
                        ));
                    }
                }
            }
        }
        if stale_ok {
            self.stats.gap_a += 1;
        }
        // Stale after its locks were released behind its back: its session lived on, so
        // only the lock guard stopped it, and gap (e)'s bound must hold as well, which
        // the fresh overlaps below may not reach.
        if x_stale && self.discarded_in(x) {
            self.within_gap_c(x, y.origin.1)
                .map_err(|why| format!("{}: {why}", label(xi, x)))?;
        }
        if !fresh_overlap {
            return Ok(());
        }
        // Acting at once, outside the freeze window?
        let (xa, ya) = (self.segments(x, true), self.segments(y, true));
        let acting = xa
            .iter()
            .any(|a| !a.2 && ya.iter().any(|b| !b.2 && overlap(*a, *b)));
        // The later grant's answer arrived after the server had ended its session (a
        // slow network): granted stale, it acts until the news arrives, which is gap
        // (c)'s bound, and the earlier run, which won the key after that end, has the
        // greater token.
        // (A stale grant whose token is the greater won the key after the earlier run's
        // tenure ended at the server, and lost it behind its back only later: the
        // overlap is then judged as any other, by how that win came about.)
        if y.stale && x.token > y.token {
            self.within_gap_c(y, y.grant_at)
                .map_err(|why| format!("{}: {why}", label(yi, y)))?;
            self.stats.stale_grant_overlaps += 1;
            return Ok(());
        }
        // The earlier run was the stale one (its session no longer held the key when
        // it was granted): the later holder, which won the key at the server, has the
        // greater token, and the stale run stays within gap (c)'s bound.
        if x.stale {
            if y.token <= x.token {
                return Err(format!(
                    "{} was granted on a session the server had ended, and does not fence {}",
                    label(xi, x),
                    label(yi, y)
                ));
            }
            self.within_gap_c(x, y.grant_at)
                .map_err(|why| format!("{}: {why}", label(xi, x)))?;
            self.stats.stale_grant_overlaps += 1;
            return Ok(());
        }
        // A hand-off keeps the server lock: judged by how the tenure began.
        let (how, decided_at) = y.origin;
        let fenced = self.fence_held(x.n, x.inst, x.key, decided_at);
        match (how, acting) {
            // Granted at once on an announced release, while another node's work ran:
            // the announcement vouched for what it could not know.
            // Granted at once on an announced release, while another node's work ran:
            // the announcement vouched for its sender's tenure only. Gap (d): a tenure
            // that began after that release and ended (its session ended at the server)
            // before this node's winning try, within this node's reaction time to the
            // announcement. Anything else is a violation.
            (How::Direct, _) if y.on_announcement.is_some() => {
                let (sent, arrived, sender) = y.on_announcement.unwrap_or((0, 0, 0));
                // The announcer's own tenure of the key (granted on the sender's
                // session), which began in gap (c) of this run (the server had ended
                // this one's session, the news or its fence was slow): its release
                // vouched for its own tenure only.
                // (Or a tenure granted without a token, whose holder dropped it
                // before its work started.)
                let chained = self.runs.iter().any(|z| {
                    z.key == y.key
                        && z.pid == sender
                        && z.grant_at >= x.grant_at
                        && z.grant_at <= sent
                        && self.within_gap_c(x, z.origin.1).is_ok()
                }) || self.unrun.iter().any(|&(key, pid, at, decided)| {
                    key == y.key
                        && pid == sender
                        && at >= x.grant_at
                        && at <= sent
                        && self.within_gap_c(x, decided).is_ok()
                });
                // In both, the overlapped run's session was ended by the server (else
                // its lock would have kept the key) and it stays within gap (c)'s bound,
                // and it held no stop fence when this one won.
                let bounded = !fenced && self.within_gap_c(x, decided_at).is_ok();
                if x.grant_at >= sent && decided_at <= arrived + self.t.grace && bounded {
                    self.stats.gap_d += 1;
                    Ok(())
                } else if x.grant_at < sent && chained && bounded {
                    self.stats.gap_c_chained += 1;
                    Ok(())
                } else {
                    Err(format!(
                        "{} was granted on a release announcement sent at {:.3} ms while {} ran",
                        label(yi, y),
                        sent as f64 / 1000.0,
                        label(xi, x)
                    ))
                }
            }
            // Gap (b): a brand-new requester (nothing told it the key was held) won
            // while the old holder's work ran; its session was ended by the server, so
            // gap (c)'s bound holds for it too.
            (How::Direct, true) => {
                let discard = self.within_gap_c(x, decided_at).map_err(|why| {
                    format!(
                        "{} and {} overlap (both acting): {why}",
                        label(xi, x),
                        label(yi, y)
                    )
                })?;
                match discard {
                    End::Server => self.stats.gap_b_acting += 1,
                    End::Discard => self.stats.gap_e_acting += 1,
                }
                Ok(())
            }
            (How::Direct, false) if fenced => {
                self.stats.b_past_fence += 1;
                self.past_fence.push(format!(
                    "{} won past the stop fence of {}",
                    label(yi, y),
                    label(xi, x)
                ));
                Ok(())
            }
            (How::Direct, false) => {
                let discard = self.within_gap_c(x, decided_at).map_err(|why| {
                    format!(
                        "{} and {} overlap (running): {why}",
                        label(xi, x),
                        label(yi, y)
                    )
                })?;
                match discard {
                    End::Server => self.stats.gap_b += 1,
                    End::Discard => self.stats.gap_e += 1,
                }
                Ok(())
            }
            // Gap (c): the server ended the old holder's session, and the news or the
            // old holder's reconnect and fence took longer than the new holder's grace
            // (a slow network, an overloaded server, a reconnect backoff). Bounded (see
            // `within_gap_c`).
            (How::Checked, _) if !fenced => {
                let discard = self.within_gap_c(x, decided_at).map_err(|why| {
                    format!(
                        "{} and {} overlap ({}): {why}",
                        label(xi, x),
                        label(yi, y),
                        if acting { "both acting" } else { "running" }
                    )
                })?;
                match (discard, acting) {
                    (End::Discard, true) => self.stats.gap_e_acting += 1,
                    (End::Discard, false) => self.stats.gap_e += 1,
                    (End::Server, true) => self.stats.gap_c_acting += 1,
                    (End::Server, false) => self.stats.gap_c += 1,
                }
                Ok(())
            }
            // The old holder was frozen while its work was stopping, past the new
            // holder's maximum fence wait: the freeze window again, fenced by the token.
            (How::Expired, false) if self.frozen_while_out(x, y.grant_at) => {
                if y.token <= x.token && !(y.unepoched && y.system != x.system) {
                    return Err(format!("{} not fenced by {}", label(xi, x), label(yi, y)));
                }
                self.stats.gap_a_fence_wait += 1;
                Ok(())
            }
            _ => Err(format!(
                "{} and {} overlap ({}), outside the known gaps",
                label(xi, x),
                label(yi, y),
                if acting { "both acting" } else { "running" }
            )),
        }
    }
}

/// The engine's own options, as the library's defaults derive them.
fn engine_timing(t: &Timing) -> EngineTiming {
    EngineTiming {
        // `ManagerOptions::term_grant_delay`'s default: lease + stop budget + margin.
        term_grant_delay: Duration::from_micros(t.lease + t.stop_budget + t.margin),
        reconnect_min: Duration::from_micros(t.reconnect_min),
        reconnect_max: Duration::from_micros(t.reconnect_max),
        stop_budget: Duration::from_micros(t.stop_budget),
        statement_slack: Duration::from_micros(t.lease),
        linger: Duration::from_micros(t.grace),
    }
}

fn rules(t: &Timing) -> Rules {
    Rules {
        node: 0,
        max_locks: 16,
        takeover_grace: Duration::from_micros(t.grace),
        max_fence_wait: Duration::from_micros(t.lease + t.stop_budget + t.margin),
    }
}

// ---- running seeds ----------------------------------------------------------------------

/// Reports (summaries, findings, a failing seed's trace) go through tracing, to the
/// test's output (`--nocapture` shows it for a passing run).
fn report_through_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_test_writer()
        .without_time()
        .with_target(false)
        .try_init();
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok())
}

fn summary(s: &Stats) -> String {
    let mut out = String::new();
    let _ = write!(
        out,
        "{} seeds, {:.0} virtual s, {} events, {} statements; {} grants {:?}, {} takeovers, \
         {} fence waits, {} idle timeouts, {} sessions on a young term; faults {:?}; overlaps in gaps: (a) {} (+{} past a fence wait), (b) {} \
         (+{} still acting), (c) {} (+{} still acting, +{} chained), (d) {}, (e) {} (+{} still acting); brand-new requester past a stop fence: {}; stale grants (session ended at the server): {} (overlaps with one: {}); \
         grants never delivered: {}; lazy holders' token reads answered: {} (without a token: {}); sessions ended by the lock guard: {}; settled runs: {}, the longest a wanted key stayed free after the faults' effects ended: {} ms; grants in a term hold shortened by a clock step past the tolerance: {}; sessions refused by the token floor: {}; grants on a replaced cluster before its epoch was set, by a node that never saw the old one: {}; \
         shutdowns: {} ({} with a failed statement, {} given up on past its deadline); \
         lease rows taken over: {} ({} shortened by a promotion); batches committed after their client gave up: {}; freezes across a row's expiry: {}; \
         violations: {}",
        s.seeds,
        s.virtual_us as f64 / 1e6,
        s.events,
        s.statements,
        s.grants,
        s.grants_by_how,
        s.takeovers,
        s.fence_waits,
        s.idle_timeouts,
        s.term_holds,
        s.faults,
        s.gap_a,
        s.gap_a_fence_wait,
        s.gap_b,
        s.gap_b_acting,
        s.gap_c,
        s.gap_c_acting,
        s.gap_c_chained,
        s.gap_d,
        s.gap_e,
        s.gap_e_acting,
        s.b_past_fence,
        s.stale_grants,
        s.stale_grant_overlaps,
        s.undelivered,
        s.tokens_read,
        s.tokens_unread,
        s.pooler_detected,
        s.settled_runs,
        s.longest_wait_settled / MS,
        s.beyond_clock_tolerance,
        s.refused_sessions,
        s.epoch_unset_grants,
        s.shutdowns,
        s.shutdowns_failed,
        s.closing_given_up,
        s.row_takeovers,
        s.shortened_takeovers,
        s.late_commits,
        s.thawed_past_deadline,
        s.violations,
    );
    out
}

fn print_trace(seed: u64, trace: &[String], all: bool) {
    let from = if all {
        0
    } else {
        trace.len().saturating_sub(300)
    };
    tracing::info!(
        "---- trace of seed {seed} ({} lines, from {from}) ----",
        trace.len()
    );
    for line in &trace[from..] {
        tracing::info!("{line}");
    }
}

/// A digest of a trace (std's hasher with its fixed keys: the same in every run of one
/// build). `Instant`s printed whole are left out: they count from the real moment the
/// run began (the virtual time at the start of each line is kept).
fn digest_of(trace: &[String]) -> u64 {
    use std::hash::{DefaultHasher, Hash, Hasher};
    let mut h = DefaultHasher::new();
    for line in trace {
        let mut rest = line.as_str();
        while let Some(at) = rest.find("Instant {") {
            rest[..at].hash(&mut h);
            rest = rest[at..].find('}').map_or("", |end| &rest[at + end + 1..]);
        }
        rest.hash(&mut h);
    }
    h.finish()
}

#[test]
fn simulation_holds_over_many_seeds() {
    run_seeds(false);
}

/// The same in the lease-row mode (see the module's notes): the same checks, none of
/// the advisory-lock mode's gaps (c) to (e), and the rows' own (a takeover after its
/// holder stopped, tokens that only go up).
#[test]
fn simulation_holds_over_many_seeds_in_the_lease_row_mode() {
    run_seeds(true);
}

/// Runs the seeds the environment says (see the module's notes), in the advisory-lock
/// mode or the lease-row mode, and fails with the first seed's violations.
fn run_seeds(rows: bool) {
    let base = if rows { Config::rows } else { Config::random };
    // Reports (the summary, findings, a failing seed's trace) go through tracing, to the
    // test's output (`--nocapture` shows it for a passing run).
    report_through_tracing();
    let replay = env_u64("CHOSEN_SIM_SEED");
    // `CHOSEN_SIM_DIGEST=1`: trace every seed and print one digest of all the traces,
    // in seed order. Equal digests before and after a change to the simulation or the
    // table mean that it changed no history (a refactor's proof).
    let digest = env_u64("CHOSEN_SIM_DIGEST").is_some_and(|d| d != 0);
    let (first, count) = match replay {
        Some(seed) => (seed, 1),
        None => (
            env_u64("CHOSEN_SIM_FIRST").unwrap_or(0),
            env_u64("CHOSEN_SIM_SEEDS").unwrap_or(10_000),
        ),
    };
    let started = std::time::Instant::now();
    let mut total = Stats::default();
    let mut failures: Vec<(u64, Vec<String>)> = Vec::new();
    let mut past_fence: Vec<(u64, String)> = Vec::new();
    let mut stale: Vec<(u64, String)> = Vec::new();
    // Seeds are independent: spread over the cores (each seed is still one exact,
    // replayable history), in seed order in the report.
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get().min(8));
    let next = std::sync::atomic::AtomicU64::new(first);
    let results: Vec<(u64, Outcome)> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(|| {
                    let mut mine = Vec::new();
                    loop {
                        let seed = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        if seed >= first + count {
                            break mine;
                        }
                        let mut out = Sim::new(Config {
                            trace: replay.is_some() || digest,
                            ..base(seed)
                        })
                        .run();
                        // Only what the report needs is kept across seeds.
                        out.runs = Vec::new();
                        out.tries = Vec::new();
                        if digest && replay.is_none() {
                            out.trace = vec![format!("{:016x}", digest_of(&out.trace))];
                        }
                        mine.push((seed, out));
                    }
                })
            })
            .collect();
        let mut all: Vec<(u64, Outcome)> = workers
            .into_iter()
            .flat_map(|w| w.join().expect("BUG: a simulation thread panicked"))
            .collect();
        all.sort_by_key(|(seed, _)| *seed);
        all
    });
    let mut all_traces = 0u64;
    for (seed, out) in results {
        if replay.is_some() {
            print_trace(seed, &out.trace, true);
        }
        if digest {
            all_traces = all_traces.rotate_left(5) ^ digest_of(&out.trace);
        }
        total.add(&out.stats);
        if let Some(f) = out.stale_grants.first() {
            stale.push((seed, f.clone()));
        }
        if let Some(f) = out.past_fence.first() {
            past_fence.push((seed, f.clone()));
        }
        if !out.violations.is_empty() {
            failures.push((seed, out.violations));
        }
    }
    // Every kind of fault is drawn in every ten thousand seeds (the rarest, a failed
    // token statement, about twice in a thousand).
    if replay.is_none() && count >= 10_000 {
        let kinds = if rows { ROWS_FAULT_KINDS } else { FAULT_KINDS };
        let missing: Vec<&str> = kinds
            .iter()
            .copied()
            .filter(|k| !total.faults.contains_key(k))
            .collect();
        assert!(
            missing.is_empty(),
            "fault kinds never drawn in {count} seeds: {missing:?}"
        );
    }
    let secs = started.elapsed().as_secs_f64();
    tracing::info!(
        "simulation{}: seeds {first}..{}, {:.1} seeds/s: {}",
        if rows { " (lease rows)" } else { "" },
        first + count,
        count as f64 / secs,
        summary(&total)
    );
    if digest {
        tracing::info!("simulation: digest of the traces {all_traces:016x}");
    }
    for (seed, text) in past_fence.iter().take(5) {
        tracing::warn!("finding, seed {seed}: {text}");
    }
    for (seed, text) in stale.iter().take(5) {
        tracing::warn!("finding, seed {seed}: {text}, after its validity deadline");
    }
    for (seed, violations) in failures.iter().take(20) {
        tracing::warn!("violation, seed {seed}: {}", violations[0]);
    }
    if let Some((seed, violations)) = failures.first() {
        if replay.is_none() {
            let out = Sim::new(Config {
                trace: true,
                ..base(*seed)
            })
            .run();
            print_trace(*seed, &out.trace, false);
        }
        let seeds: Vec<u64> = failures.iter().map(|(s, _)| *s).collect();
        panic!(
            "the simulation found violations with seeds {seeds:?}; first, seed {seed} \
             (replay with CHOSEN_SIM_SEED={seed}):\n{}",
            violations.join("\n")
        );
    }
}

/// The lease-row checks can fail: on a server whose rows expire sooner than their
/// holders' clients trust them plus their stop budget (3.5 s instead of 7 s, below the
/// lease timeout plus the stop budget), some of the first seeds take a row over while
/// its holder may still run (the takeover check), and run two holders' children at
/// once (the judge's check, which knows nothing of the rows' timing).
#[test]
fn rows_that_expire_before_their_holders_stop_are_caught() {
    report_through_tracing();
    let found: Vec<(u64, Vec<String>)> = (0..40)
        .map(|seed| {
            let out = Sim::new(Config {
                rows_ttl: Some(3_500 * MS),
                ..Config::rows(seed)
            })
            .run();
            (seed, out.violations)
        })
        .filter(|(_, v)| !v.is_empty())
        .collect();
    let takeovers = found
        .iter()
        .filter(|(_, v)| v.iter().any(|v| v.contains("is taken over")))
        .count();
    let overlaps: Vec<&(u64, Vec<String>)> = found
        .iter()
        .filter(|(_, v)| v.iter().any(|v| !v.contains("is taken over")))
        .collect();
    tracing::info!(
        "rows expiring 3.5 s after their renewal: {} of 40 seeds fail, {takeovers} with an early takeover, {} with children overlapping; the first: {:?}",
        found.len(),
        overlaps.len(),
        overlaps.first()
    );
    assert!(
        takeovers > 0,
        "no takeover within the stop budget in 40 seeds"
    );
    assert!(
        !overlaps.is_empty(),
        "no overlap of two holders' children in 40 seeds"
    );
}

/// A holder whose session's locks another client released (gap (e)), slowed so that it
/// did not hear before a long freeze, is judged stale after the freeze, as a holder
/// frozen across its session's end is: the next holder, frozen too and ended by the
/// server meanwhile, is fenced by its greater token, not taken for a stale run beside a
/// live one (seed 480,096,271 of a long run, where the checker did).
#[test]
fn a_holder_frozen_after_its_locks_were_released_behind_its_back_is_stale() {
    let out = Sim::new(Config::random(480_096_271)).run();
    assert!(out.violations.is_empty(), "{:?}", out.violations);
    assert!(out.stats.grants > 0);
}

/// The same seed gives the same history.
#[test]
fn a_seed_replays_exactly() {
    let a = Sim::new(Config::random(4242)).run();
    let b = Sim::new(Config::random(4242)).run();
    assert_eq!(a.stats.events, b.stats.events);
    let grants = |o: &Outcome| -> Vec<(usize, T, u64)> {
        o.runs
            .iter()
            .map(|r| (r.n, r.grant_at, r.token.get()))
            .collect()
    };
    assert_eq!(grants(&a), grants(&b));
    assert!(a.stats.grants > 0);
}

/// A holder whose backend the server terminates stops its child slowly (just under the
/// stop budget): the waiting node wins the key at the server after the grace, finds the
/// old holder's stop fence, and starts only after the old child dropped its lease.
#[test]
fn a_terminated_holder_that_stops_slowly_is_waited_for() {
    let mut cfg = Config::scripted(
        11,
        vec![vec![0], vec![0], vec![0]],
        vec![(5 * SEC, Scripted::TerminateHolder(0))],
    );
    cfg.stop_time = Some(1_900 * MS);
    let out = Sim::new(cfg).run();
    assert!(out.violations.is_empty(), "{:?}", out.violations);
    let old = out
        .runs
        .iter()
        .find(|r| r.grant_at < 5 * SEC && r.drop_at.is_some())
        .expect("a holder before the fault");
    let dropped = old.drop_at.expect("checked");
    assert!(
        dropped >= 5 * SEC + 1_900 * MS,
        "the old child stops slowly"
    );
    let new = out
        .runs
        .iter()
        .find(|r| r.grant_at > 5 * SEC)
        .expect("a takeover after the termination");
    assert_ne!(new.n, old.n, "another node took over");
    assert!(new.token > old.token);
    assert!(
        new.grant_at >= dropped,
        "started at {} while the old child ran until {dropped}",
        new.grant_at
    );
    assert!(
        new.grant_at < dropped + SEC,
        "took over {} µs after the old child stopped",
        new.grant_at - dropped
    );
    assert!(out.stats.fence_waits > 0, "the new holder found the fence");
    assert_eq!(
        (out.stats.gap_a, out.stats.gap_b, out.stats.gap_c),
        (0, 0, 0)
    );
}

/// A flood of forged release announcements (a foreign backend pid) while one node holds
/// the key: no waiter polls more often or skips the grace, and no one else is granted.
#[test]
fn a_forged_notify_flood_changes_nothing() {
    let script: Vec<(T, Scripted)> = (0..20)
        .map(|i| {
            (
                3 * SEC + i * 100 * MS,
                Scripted::ForgedFlood { key: 0, count: 200 },
            )
        })
        .chain(std::iter::once((8 * SEC, Scripted::TerminateHolder(0))))
        .collect();
    let flood = Sim::new(Config::scripted(5, vec![vec![0], vec![0], vec![0]], script)).run();
    assert!(flood.violations.is_empty(), "{:?}", flood.violations);
    let before: Vec<&Run> = flood.runs.iter().filter(|r| r.grant_at < 8 * SEC).collect();
    assert_eq!(before.len(), 1, "one holder until the termination");
    // The waiters polled no more often than their poll interval (-10 %) allows, and
    // forged hand-overs naming one brought at most one more try per
    // `UNVERIFIED_CUE` (1 s) for its whole table.
    for (n, tries) in flood.tries.iter().enumerate() {
        let during = tries
            .iter()
            .filter(|t| (3 * SEC..5 * SEC).contains(*t))
            .count();
        assert!(
            during <= 9 + 2,
            "n{n} ran {during} try statements in 2 s of flood"
        );
    }
    let takeover = flood
        .runs
        .iter()
        .find(|r| r.grant_at > 8 * SEC)
        .expect("a takeover after the termination");
    assert_eq!(takeover.how, How::Checked, "the grace was not skipped");
}

/// A server restart ends every session: every child stops acting at once, each key gets
/// one new holder after the server is back, with a greater token, and no child of the
/// new holders runs while an old one is still stopping.
#[test]
fn a_server_restart_hands_every_key_over_without_overlap() {
    let mut cfg = Config::scripted(
        23,
        vec![vec![0], vec![1], vec![0, 1], vec![0]],
        vec![(5 * SEC, Scripted::Restart { down: 2 * SEC })],
    );
    cfg.stop_time = Some(1_500 * MS);
    let out = Sim::new(cfg).run();
    assert!(out.violations.is_empty(), "{:?}", out.violations);
    assert_eq!(
        (out.stats.gap_a, out.stats.gap_b, out.stats.gap_c),
        (0, 0, 0)
    );
    for key in [LockKey::Pair(7, 0), LockKey::Pair(7, 1)] {
        let old: Vec<&Run> = out
            .runs
            .iter()
            .filter(|r| r.key == key && r.grant_at < 5 * SEC)
            .collect();
        let new: Vec<&Run> = out
            .runs
            .iter()
            .filter(|r| r.key == key && r.grant_at >= 5 * SEC)
            .collect();
        let last_old = old.last().expect("a holder before the restart");
        assert!(
            last_old.acting_end.expect("lost") < 5 * SEC + 50 * MS,
            "the old child stopped acting when the session ended"
        );
        let first_new = new.first().expect("a holder after the restart");
        assert!(
            first_new.grant_at >= 7 * SEC,
            "granted while the server was down"
        );
        assert!(first_new.token > last_old.token);
        assert!(first_new.grant_at >= last_old.drop_at.expect("dropped"));
    }
}

/// The server restarts and its clock then steps forward by three times the safety
/// margin, so the new term looks three seconds older than it is. Every node saw its
/// session of the old term end, and counts the term hold from there on its own clock:
/// nothing is granted before a holder of the old term could have stopped. Without that
/// (`Protection::TermOwnClock` off), the nodes trust the server's age and grant early.
#[test]
fn a_forward_clock_step_cannot_shorten_the_term_hold_of_nodes_that_saw_the_old_term_end() {
    let script = vec![
        (5 * SEC, Scripted::Restart { down: 500 * MS }),
        (5_600 * MS, Scripted::ClockStep(3 * SEC as i64)),
    ];
    let cfg = Config::scripted(31, vec![vec![0], vec![1], vec![0, 1]], script.clone());
    let out = Sim::new(cfg).run();
    assert!(out.violations.is_empty(), "{:?}", out.violations);
    assert_eq!(out.stats.beyond_clock_tolerance, 0);
    let first_new = out
        .runs
        .iter()
        .filter(|r| r.grant_at >= 5 * SEC)
        .map(|r| r.grant_at)
        .min()
        .expect("grants after the restart");
    // The delay (6 s) counted from the end each node saw (right after 5 s).
    assert!(first_new >= 11 * SEC, "granted at {first_new} µs");
    let mut cfg = Config::scripted(31, vec![vec![0], vec![1], vec![0, 1]], script);
    cfg.off = vec![Protection::TermOwnClock];
    let out = Sim::new(cfg).run();
    assert!(
        out.violations
            .iter()
            .any(|v| v.contains("before a holder of it had stopped")),
        "without the own clock, the stepped clock should shorten the hold: {:?}",
        out.violations
    );
}

/// The server is replaced by another cluster (pg_upgrade, a restore) on timeline 1
/// with smaller transaction ids, and the DBA forgot the token epoch: every node that
/// issued tokens refuses it (its tokens would go backwards) until the DBA sets the
/// epoch and ends the sessions opened before; then the nodes come back, and every token
/// is above the old cluster's. Without the floor (`Protection::TokenFloor` off), the
/// nodes take the new cluster at once and tokens go backwards.
#[test]
fn a_replaced_cluster_is_refused_until_its_token_epoch_is_set() {
    let script = vec![
        (
            5 * SEC,
            Scripted::Replace {
                down: SEC,
                epoch_set: false,
            },
        ),
        (15 * SEC, Scripted::SetEpoch),
    ];
    let cfg = Config::scripted(37, vec![vec![0], vec![1], vec![0, 1]], script.clone());
    let out = Sim::new(cfg).run();
    assert!(out.violations.is_empty(), "{:?}", out.violations);
    assert!(out.stats.refused_sessions > 0);
    let before = out
        .runs
        .iter()
        .filter(|r| r.grant_at < 5 * SEC)
        .map(|r| r.token)
        .max()
        .expect("grants before the replacement");
    let after: Vec<&Run> = out.runs.iter().filter(|r| r.grant_at >= 5 * SEC).collect();
    assert!(!after.is_empty(), "no grant after the epoch was set");
    for r in after {
        assert!(r.grant_at >= 15 * SEC, "granted before the epoch was set");
        assert!(r.token > before, "token {} after {before}", r.token);
    }
    let mut cfg = Config::scripted(37, vec![vec![0], vec![1], vec![0, 1]], script);
    cfg.off = vec![Protection::TokenFloor];
    let out = Sim::new(cfg).run();
    assert!(
        out.violations.iter().any(|v| v.contains("with token")),
        "without the floor, tokens should go backwards: {:?}",
        out.violations
    );
}

/// Seed 168: n3 wins (7, 0) with token 707 and waits on n0's stop fence (`Fenced`);
/// n3 is frozen for 9.5 s; the server ends n3's session (idle timeout) during the
/// freeze, and n2 takes the key over with token 713. When n3 wakes, its driver's
/// overdue wake-up runs before the heartbeat watchdog: `plan` finds the fence wait past
/// `max_fence_wait` (measured on a clock that includes the freeze) and grants 707, a
/// smaller token than the holder's, on a session the server already ended. The lease is
/// invalid from birth (its deadline passed), so its child never acts, but a `Grant` with
/// a regressed token is handed out before the loss is noticed.
#[test]
fn a_node_woken_from_a_freeze_makes_no_stale_grant() {
    let out = Sim::new(Config {
        trace: true,
        ..Config::random(168)
    })
    .run();
    assert!(out.violations.is_empty(), "{:?}", out.violations);
    assert!(
        out.stale_grants.is_empty(),
        "{:?}\n{}",
        out.stale_grants,
        out.trace
            .iter()
            .filter(|l| l.contains("(7, 0)") || l.contains("n3"))
            .take(80)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// Seed 2: n1's child (run 5, token 707) is stopping after its session ended, and n1's
/// new session holds the key's stop fence; n0's singleton re-acquires the key with a
/// new request on a slot the table had forgotten, wins it on the first try (no
/// contention seen, so no grace and no fence check) and starts while n1's child still
/// runs. Gap (b) is documented only for the old holder's reconnect time; the fence in
/// place does not stop a brand-new requester.
#[test]
fn a_brand_new_requester_waits_for_a_stop_fence() {
    let out = Sim::new(Config::random(2)).run();
    assert!(out.violations.is_empty(), "{:?}", out.violations);
    assert!(out.past_fence.is_empty(), "{:?}", out.past_fence);
}

/// n0 holds the key (n1, n2 wait); it hands the key over to the next node. That node
/// takes it at once and, just before the hold ends, the server terminates its backend:
/// its child stops slowly (1.5 s), its new session takes the stop fence after a
/// reconnect. The third node, held off by the hand-over, wins the key when the hold
/// ends: nothing it saw vouches for the target's release, so it must wait the grace and
/// then find the fence (`How::Checked`), not start at once next to the stopping child.
#[test]
fn a_target_lost_within_the_hand_over_hold_is_waited_for() {
    let mut failures = Vec::new();
    let mut cases = 0;
    for seed in 0..10 {
        for off in (980..=1004).step_by(2) {
            let end = 5 * SEC + off * MS;
            let mut cfg = Config::scripted(
                seed,
                vec![vec![0], vec![0], vec![0]],
                vec![
                    (5 * SEC, Scripted::HandOverToNext(0)),
                    (end, Scripted::TerminateHolder(0)),
                ],
            );
            cfg.stop_time = Some(1_500 * MS);
            let out = Sim::new(cfg).run();
            assert!(out.violations.is_empty(), "{:?}", out.violations);
            let Some(before) = out.runs.iter().rfind(|r| r.grant_at < end) else {
                continue;
            };
            let Some(after) = out.runs.iter().find(|r| r.grant_at > end) else {
                continue;
            };
            cases += 1;
            if after.grant_at < before.drop_at.unwrap_or(T::MAX) {
                failures.push(format!(
                    "seed {seed}, target terminated at +{off} ms: n{} granted {:?} token {} at {:.3} ms while n{}'s child (token {}) ran until {:?} ms (counted as gap b {} / b-acting {} / c {})",
                    after.n,
                    after.how,
                    after.token,
                    after.grant_at as f64 / 1000.0,
                    before.n,
                    before.token,
                    before.drop_at.map(|d| d as f64 / 1000.0),
                    out.stats.gap_b,
                    out.stats.gap_b_acting,
                    out.stats.gap_c,
                ));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {cases} runs overlapped:\n{}",
        failures.len(),
        failures
            .iter()
            .take(6)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// The first seed below `budget` whose run finds a violation with `off` switched off in
/// every node, searched on every core.
fn first_failing_seed(off: &[Protection], budget: u64) -> Option<u64> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get().min(8));
    let next = std::sync::atomic::AtomicU64::new(0);
    let found = std::sync::atomic::AtomicU64::new(u64::MAX);
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| {
                loop {
                    let seed = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if seed >= budget || seed > found.load(std::sync::atomic::Ordering::Relaxed) {
                        break;
                    }
                    let out = Sim::new(Config {
                        off: off.to_vec(),
                        ..Config::random(seed)
                    })
                    .run();
                    if !out.violations.is_empty() {
                        found.fetch_min(seed, std::sync::atomic::Ordering::Relaxed);
                    }
                }
            });
        }
    });
    let seed = found.into_inner();
    (seed != u64::MAX).then_some(seed)
}

/// Every protection is load-bearing: with it switched off, the simulation finds a
/// violation within the suite's seed budget. Those it cannot see yet are listed, with
/// what the simulation lacks to see them, so that the list only shrinks.
#[test]
fn every_protection_is_load_bearing() {
    report_through_tracing();
    let budget = env_u64("CHOSEN_SIM_PROOF_SEEDS").unwrap_or(20_000);
    // None left: kept for a protection added before the simulation can see it.
    let blind: &[(Protection, &str)] = &[];
    let mut seen = Vec::new();
    let mut unseen = Vec::new();
    for p in [
        Protection::TakeoverGrace,
        Protection::StopFence,
        Protection::AnnouncementCheck,
        Protection::SessionCheck,
        Protection::QuietUnlock,
        Protection::TermHold,
        Protection::TermOwnClock,
        Protection::ValidityGate,
        Protection::TokenFloor,
        Protection::KeepLostOpen,
        Protection::HandleClosing,
        Protection::LockGuard,
        Protection::TakesInFlight,
        Protection::FreshHandOffToken,
    ] {
        match first_failing_seed(&[p], budget) {
            Some(seed) => seen.push((p, seed)),
            None => unseen.push(p),
        }
    }
    tracing::info!(
        "protections switched off, first failing seed of {budget}: {seen:?}; not seen: {unseen:?}"
    );
    for (p, _) in &seen {
        assert!(
            blind.iter().all(|(b, _)| b != p),
            "the simulation now sees {p:?} switched off: take it off the blind list"
        );
    }
    for p in &unseen {
        let why = blind.iter().find(|(b, _)| b == p).map(|(_, why)| *why);
        assert!(
            why.is_some(),
            "with {p:?} switched off, {budget} seeds found no violation: the simulation cannot see what it protects"
        );
    }
}

/// Pid reuse: a holder's backend dies and a foreign backend that gets its pid announces
/// the keys it held. Verified by pid alone (`Protection::SessionCheck` off), waiters skip
/// the grace on its word, and the checks see it; verified by session, never.
#[test]
fn a_reused_pid_is_believed_only_without_session_verification() {
    report_through_tracing();
    let seeds = env_u64("CHOSEN_SIM_PID_REUSE_SEEDS").unwrap_or(100);
    let run = |check_sessions: bool| -> (Stats, Vec<(u64, String)>) {
        let mut total = Stats::default();
        let mut found = Vec::new();
        for seed in 0..seeds {
            let out = Sim::new(Config {
                off: if check_sessions {
                    Vec::new()
                } else {
                    vec![Protection::SessionCheck]
                },
                ..Config::random(seed)
            })
            .run();
            total.add(&out.stats);
            if !out.violations.is_empty() {
                found.push((seed, out.violations.join("; ")));
            }
        }
        (total, found)
    };
    let (off, wrong) = run(false);
    assert!(
        off.faults.get("pid_reuse").copied().unwrap_or(0) > 0,
        "no pid reuse in {seeds} seeds"
    );
    assert!(
        wrong.iter().any(|(_, v)| v.contains("pid reuse")),
        "pid-only verification was never fooled in {seeds} seeds: {wrong:?}"
    );
    let (on, right) = run(true);
    // (The histories part where a verdict differs, so the counts differ too.)
    assert!(on.faults.get("pid_reuse").copied().unwrap_or(0) > 0);
    assert!(right.is_empty(), "with session verification: {right:?}");
    tracing::info!(
        "pid reuse over {seeds} seeds: verified by pid only, {} faults, {} seeds wrong \
         ({} with children overlapping; first: {:?}); by session, {} faults, none wrong",
        off.faults["pid_reuse"],
        wrong.len(),
        wrong.iter().filter(|(_, v)| v.contains("overlap")).count(),
        wrong.first(),
        on.faults["pid_reuse"],
    );
    tracing::info!("by pid only: {}", summary(&off));
    tracing::info!("by session: {}", summary(&on));
}
