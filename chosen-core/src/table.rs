//! The lock rules, apart from their I/O.
//!
//! [`LockTable`] decides who holds and who waits for each key this process wants; the
//! manager's task (`task/`) carries its decisions out on the session and feeds the
//! results back. The table never awaits, never touches the connection and has no clock:
//! every input carries the `Instant` it happened at. That keeps the rules readable top to
//! bottom and lets the tests drive them through millions of steps with no database.
//!
//! # The rules
//!
//! * **One owner per key, FIFO waiters.** PostgreSQL advisory locks are re-entrant per
//!   session, so the server cannot arbitrate between requests of one process: the table
//!   does. A key has at most one local holder; other requests queue in arrival order.
//! * **Only the head waiter contends**, and every due key is tried in one statement
//!   ([`Plan::try_keys`]). Keys with one poll interval share one tick.
//! * **A local hand-off keeps the server lock** and gives the next waiter a fresh, larger
//!   fencing token ([`Plan::token_for`]), or none when it asked for none.
//! * **Tokens on demand.** A request that asks for its token eagerly gets it with its
//!   grant (assigned by the statement that won the key, after every lock of the batch).
//!   Any other gets none until its holder reads it ([`LockTable::read_token`]): then a
//!   token statement issues it, in a statement that proves this session still holds the
//!   key ([`Plan::token_read`]). Either way the token is assigned while this session
//!   holds the key at the server and the lease holds it here, so every later tenure's
//!   token (assigned after this one ended) is greater, and every earlier one's smaller.
//! * **Takeover grace.** A key that a try saw held by another session and then won
//!   *without* a verified release announcement may have a holder that does not know yet
//!   that its session ended (terminated or cut by the server). The grant waits
//!   `takeover_grace`, giving that holder time to learn of its loss. An announcement is
//!   verified when it was sent by the *session* the last failed try saw holding the key,
//!   not merely by its pid: the server stamps every notification with its sender's pid,
//!   which no role can forge, but a pid is reused once its backend is gone (the holder's
//!   backend dies, its work may still be stopping, and the OS gives the pid to a new
//!   backend, whose notifications would then be believed). A session is its pid and its
//!   start (`backend_start`): an announcement from the holder's pid only brings the try
//!   forward, and the win that follows skips the grace only if that try finds the same
//!   session (pid *and* start) still alive. Pids are unique among live backends, so the
//!   notification came from the session the last try saw. A start the payload carried
//!   could be replayed by any listener; a start the server reports cannot. Unknown starts
//!   (another role's session, without `pg_read_all_stats`) verify nothing. Anything else
//!   is a cue only.
//! * **Generations.** When the session ends every holder is lost at once, and nothing the
//!   table knew about the server survives, except the evidence that a key was contended:
//!   after a reconnect, a key is won with the grace, because what happened to it while
//!   this process was away is unknown.
//! * **Try requests** are answered at once when the key is busy locally or the session is
//!   down, and after the first statement that tried them otherwise.
//! * **Withdrawn requests** (their caller stopped waiting) leave the queue at once; a key
//!   nobody holds or wants is forgotten. Memory is bounded by live requests and keys held,
//!   and by the keys requested within the last few seconds (hand-over holds and the
//!   unchecked hand-overs a key trusted, each remembered for a while).

use std::collections::VecDeque;

use crate::maps::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use crate::key::{LockKey, SessionLock};
use crate::token::FencingToken;

/// Identifies one acquire request (and the lease it becomes).
pub(crate) type RequestId = u64;

/// How a request waits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Queue until acquired.
    Wait,
    /// One attempt: acquired, or answered "held elsewhere".
    Try,
}

/// An acquire request as the table sees it.
#[derive(Clone, Debug)]
pub(crate) struct Request {
    pub(crate) id: RequestId,
    pub(crate) key: LockKey,
    /// The name reported in `locks()` and metrics.
    pub(crate) name: Arc<str>,
    pub(crate) poll_interval: Duration,
    pub(crate) mode: Mode,
    /// When the request was made (wall clock, for `locks()`).
    pub(crate) since: SystemTime,
    /// When the request was made (monotonic, for the wait-time metric).
    pub(crate) enqueued: Instant,
    /// The grant carries its fencing token (taken by the statement that wins the key);
    /// otherwise the token is issued only when the holder reads it.
    pub(crate) eager_token: bool,
}

/// Why a request was answered without a lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// The key is held, here or elsewhere (a try request): `Ok(None)`.
    Busy,
    /// The per-manager cap on keys is reached.
    TooManyLocks { limit: usize },
    /// The session is down (a try request).
    NotConnected,
    /// The statement that tried the key failed (a try request); the task knows the error.
    Failed,
    /// The manager is shutting down.
    Closed,
}

/// What the table asks the task to do besides the statements of a [`Plan`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Action {
    /// Hand request `id` a lease on `key`.
    Grant {
        id: RequestId,
        key: LockKey,
        /// `None` for a request that did not ask for it eagerly.
        token: Option<FencingToken>,
        generation: u64,
        /// Wait time of the request, for metrics.
        waited: Duration,
        /// How the key came to be granted.
        via: Via,
    },
    /// Answer request `id` without a lease.
    Refuse { id: RequestId, why: Refusal },
    /// Answer the token read of the holder `id` (see [`LockTable::read_token`]): its
    /// token, or `None` when it could not be had (the statement failed, or the lease
    /// ended first).
    Token {
        id: RequestId,
        key: LockKey,
        token: Option<FencingToken>,
    },
    /// The holder of `key` released it (metrics, logs).
    Released { key: LockKey, name: Arc<str> },
    /// The holder of `key` lost it with its session (metrics, logs).
    Lost { key: LockKey, name: Arc<str> },
}

/// A protection that a test may switch off ([`LockTable::switch_off`],
/// [`Engine::switch_off`](crate::engine::Engine::switch_off)), to show that the
/// simulation fails without it: each one is load-bearing. Never off outside tests.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Protection {
    /// An unannounced takeover waits `takeover_grace` before its fence check.
    TakeoverGrace,
    /// A won key whose stop fence is held (in the try, or in a check) waits for it.
    StopFence,
    /// An announcement counts only from the backend the last try saw holding the key.
    AnnouncementCheck,
    /// ... and only from its *session*: the try that follows finds that backend, with
    /// the start the last try saw, still alive (a pid is reused once its backend died).
    SessionCheck,
    /// A grant that never reached its requester is unlocked without an announcement.
    QuietUnlock,
    /// A young server term holds grants (the engine's rule 3).
    TermHold,
    /// ... measured on this process's clock too, from the end of its last session of
    /// an earlier term (the server's wall clock may have stepped forward).
    TermOwnClock,
    /// A session past its validity deadline plans and grants nothing (rule 1).
    ValidityGate,
    /// A session whose tokens could go backwards is refused (rule 4).
    TokenFloor,
    /// A lost session stays open until the next one fences the work still stopping
    /// (rule 6).
    KeepLostOpen,
    /// A grant that comes of a statement in flight when the handle began a shutdown is
    /// not delivered (the engine's rule 8).
    HandleClosing,
    /// A heartbeat that finds a lock the session holds missing at the server ends the
    /// session (another client released it: a pooler, `DISCARD ALL`). Kept by the
    /// heartbeat's `Pulse`, switched there.
    #[cfg(test)]
    LockGuard,
    /// While a statement that may take locks is unanswered, a heartbeat's answer
    /// proves the session no later than that statement's send (another client may
    /// release what it took before the heartbeat runs, which the floor cannot show).
    /// Kept by the heartbeat's `Pulse`, switched there.
    #[cfg(test)]
    TakesInFlight,
    /// A win not yet granted is given back when the holder the try before saw announces
    /// it handed the key to another node (the try raced the hand-over). Where a
    /// hand-over goes is not a safety property, so the engine simulation does not see
    /// it: the table's tests and the fleet simulation's calm hand-overs do.
    HandOverYield,
    /// This node's own next request after it handed a key to another node holds off
    /// too (its slot forgotten meanwhile, or not). Seen as `HandOverYield` is.
    HandOverHold,
    /// A local hand-off to a lazy waiter grants it without a token: never with the
    /// token of the holder before it (two tenures would share one token, and the
    /// earlier's writes would pass the later's fence).
    FreshHandOffToken,
    /// A key whose holder no try has seen (a new request, or evidence lost) trusts one
    /// announced hand-over to another node, whoever sent it: it holds off, or gives
    /// back a win not yet granted (its first try raced the hand-over). Seen as
    /// `HandOverYield` is.
    HandOverUnseen,
}

/// How a grant came about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Via {
    /// In the answer to a try (a free key, an announced release, a held term over).
    Won,
    /// After the grace, on a clear stop-fence check.
    Checked,
    /// The old holder's stop fence outlived the longest fence wait.
    FenceExpired,
    /// A local hand-off, with a fresh token.
    HandOff,
}

/// The statements one step needs. Every key in it has been moved to an in-flight state:
/// the task must report each list's outcome back before it asks for the next plan.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Plan {
    /// Unlock these keys at the server and announce their release: work under them
    /// ran here and has stopped.
    pub(crate) unlock: Vec<LockKey>,
    /// Keys of `unlock` handed over to one node: their announcements name its hash.
    pub(crate) hand_to: Vec<(LockKey, u64)>,
    /// Unlock these keys without announcing: won, but never granted here (announcing
    /// would tell waiters that any earlier holder's work has stopped, which this process
    /// does not know).
    pub(crate) unlock_quiet: Vec<LockKey>,
    /// Local hand-offs, and wins granted to a request that wants its token eagerly but
    /// whose try took none: one fresh fencing token for all of them (and for
    /// `token_read`), in one statement that proves the session holds every key.
    pub(crate) token_for: Vec<LockKey>,
    /// Held keys whose holder reads its token: issued by the same statement as
    /// `token_for`'s.
    pub(crate) token_read: Vec<LockKey>,
    /// Keys of `try_keys` whose head waiter did not ask for its token: a win of one
    /// takes none (no transaction id and no durable write for it; the statement takes
    /// one only when a key that wants it is won).
    pub(crate) lazy: Vec<LockKey>,
    /// Try these keys, in one statement.
    pub(crate) try_keys: Vec<LockKey>,
    /// Take the stop fences of these keys: leases of an ended session still out.
    pub(crate) fence: Vec<LockKey>,
    /// Release the stop fences of these keys and announce the keys' release.
    pub(crate) unfence: Vec<LockKey>,
    /// Won after an unannounced takeover: is the old holder still stopping?
    pub(crate) check: Vec<LockKey>,
    /// Keys of `try_keys` whose last failed try's holder (this pid) announced its release
    /// since: when such a key is won, the try reports the start of the backend that has
    /// the pid now (see [`LockTable::senders`]).
    pub(crate) verify: Vec<(LockKey, i32)>,
    /// Keys of `try_keys` that, when not won, take their bucket's interest key (shared)
    /// and are tried once more in the same statement (at most one per bucket).
    pub(crate) register: Vec<LockKey>,
    /// Interest buckets no key waits in any more: release their interest keys.
    pub(crate) unregister: Vec<u16>,
}

impl Plan {
    pub(crate) fn is_empty(&self) -> bool {
        self.unlock.is_empty()
            && self.unlock_quiet.is_empty()
            && self.token_for.is_empty()
            && self.token_read.is_empty()
            && self.try_keys.is_empty()
            && self.fence.is_empty()
            && self.unfence.is_empty()
            && self.check.is_empty()
            && self.register.is_empty()
            && self.unregister.is_empty()
    }

    /// Can these statements take advisory locks that stay on the session (keys, stop
    /// fences, interest keys)? The fence checks take and release theirs in one
    /// expression.
    pub(crate) fn takes_locks(&self) -> bool {
        !self.try_keys.is_empty() || !self.fence.is_empty()
    }
}

/// What a check of a key's stop fence found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FenceCheck {
    /// Nobody is stopping work under the key.
    Clear,
    /// A node is still stopping its work (its backend pid, when the server told).
    Held { by: Option<i32> },
    /// The statement failed.
    Failed,
}

/// A backend session as a statement saw it: its pid and, when the server showed it,
/// its start (`backend_start`, in microseconds since the Unix epoch; NULL for another
/// role's session without `pg_read_all_stats`). Pids are reused; (pid, start) is not.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Backend {
    pub(crate) pid: i32,
    pub(crate) start: Option<i64>,
}

/// What one try of one key found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TryOutcome {
    /// The session took the lock; the token was assigned after every lock of the batch
    /// (`None`: the key was tried without one, see [`Plan::lazy`]).
    Won(Option<FencingToken>),
    /// The session took the lock, but its stop fence is held (by that backend pid, when
    /// the server told): an earlier holder's work is still stopping.
    WonFenced {
        token: Option<FencingToken>,
        by: Option<i32>,
    },
    /// Another session holds it (its backend, when the server told).
    Held { by: Option<Backend> },
    /// The statement failed; nothing is known about the key.
    Failed,
}

/// How many times in a row a key that failed without its bucket's interest registered
/// is tried again soon (see [`Plan::register`]); then it waits for its poll.
const MAX_QUICK_REGISTERS: u8 = 5;

/// How soon a release announcement from a backend the last try did not see holding the
/// key brings the next try forward (see [`LockTable::announced`]): it helps a waiter
/// with a long poll interval whose last try saw a holder that was replaced since; and a
/// flood of forged announcements costs each waiting node at most one more statement
/// per second (none at poll intervals below it).
pub(crate) const UNVERIFIED_CUE: Duration = Duration::from_secs(1);

/// How many announcements of one key arriving during its try are kept for it (the
/// latest of each sender, the oldest senders dropped first): enough for the real one
/// among a few forged ones; a flood keeps the latest.
const MAX_IN_FLIGHT_ANNOUNCEMENTS: usize = 4;

/// How long the other nodes hold off after a release handed over to one node, so that
/// it takes the lock: it tries at once on the announcement, within a round trip; past
/// this, every node contends as usual (the named node was gone, or not waiting).
pub(crate) const HAND_OVER_HOLD: Duration = Duration::from_secs(1);

/// How long a key whose slot was forgotten remembers that it trusted an unchecked
/// hand-over (see `Slot::trusted_unseen`): a request that comes and goes cannot be held
/// off by forged ones more than once in this long.
pub(crate) const UNSEEN_MEMORY: Duration = Duration::from_secs(10);

/// The table's configuration.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Rules {
    /// This node's [`node_hash`](crate::key::node_hash).
    pub(crate) node: u64,
    pub(crate) max_locks: usize,
    pub(crate) takeover_grace: Duration,
    /// How long a won key waits at most for an old holder's stop fence (its stop budget
    /// and then some): past it, that holder's work was aborted or it is broken.
    pub(crate) max_fence_wait: Duration,
}

/// The server-side state of a key, as far as this session is concerned. The session
/// holds the key at the server iff this is not `Free`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Server {
    /// Not held by this session.
    Free,
    /// In the current plan's try statement.
    Trying,
    /// Won; granted locally once the takeover grace ends at `at`. `from`: the backend
    /// the try before saw holding the key, if any (a hand-over it announces to another
    /// node meanwhile gives the key back: this try raced it).
    Granting {
        token: Option<FencingToken>,
        at: Instant,
        from: Option<i32>,
    },
    /// Won; its stop fence is being checked (in the current plan).
    Checking {
        token: Option<FencingToken>,
        until: Option<Instant>,
    },
    /// Won, but the old holder is still stopping its work: checked again at `next` or on
    /// its announcement; granted anyway at `until`.
    Fenced {
        token: Option<FencingToken>,
        next: Instant,
        until: Instant,
        by: Option<i32>,
        /// Not checked before this (the end of the takeover grace, when it applies).
        not_before: Instant,
    },
    /// Held; a local hand-off (or a win whose next holder wants its token eagerly but
    /// whose try took none) waits for a fresh token (`asked`: in the current plan).
    /// `announce`: a holder here released it (its work stopped), so if the hand-off
    /// fails the key is unlocked announced; not after a grant that never reached its
    /// request (nothing ran here, and whoever held it before may still be stopping), nor
    /// after a win. `via`: how the key came to be granted.
    NeedsToken {
        asked: bool,
        announce: bool,
        via: Via,
    },
    /// Held, and owned by `Slot::holder`.
    Held,
    /// Held by nobody here; to be unlocked (`sent`: in the current plan), announced
    /// only when work under it ran here and stopped.
    Unlocking { sent: bool, announce: bool },
}

#[derive(Clone, Debug)]
struct Holder {
    id: RequestId,
    name: Arc<str>,
    /// `None` until issued (a request that did not ask for it eagerly).
    token: Option<FencingToken>,
    generation: u64,
    since: SystemTime,
    /// Its token read: to be asked in the next plan, or asked in the current one.
    reading: Reading,
}

/// A holder's token read (see [`LockTable::read_token`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Reading {
    No,
    /// To be asked in the next plan.
    Wanted,
    /// In the current plan's token statement.
    Asked,
}

/// What a holder's token read found at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TokenRead {
    /// Known already: no statement.
    Known(FencingToken),
    /// A token statement will issue it: answered by an [`Action::Token`].
    Pending,
    /// `id` does not hold the key (any more).
    NotHeld,
}

/// What this process knows about who else held a key.
#[derive(Clone, Copy, Debug, Default)]
struct Evidence {
    /// A try found the key held by another session (or the session was lost since, and
    /// nothing is known): the next win is an unannounced takeover unless `announced`.
    contended: bool,
    /// The backend the last failed try saw holding the key.
    holder: Option<Backend>,
    /// A backend with that pid announced its release since the last try: the key is tried
    /// at once, and the win skips the grace only if that try finds the holder's session
    /// still alive (`confirmed`; see the module docs).
    announced: bool,
    /// The try that follows `announced` found the holder's session, with its start,
    /// still alive: the announcement came from it.
    confirmed: bool,
    /// When the announcement arrived. It vouches for its sender's tenure only: a
    /// session that took the key after that release and lost it before this node's try
    /// is not seen. So it is trusted only for a win answered within `takeover_grace` of
    /// its arrival (about a round trip, normally): a try made late (a frozen or starved
    /// process, a slow link) keeps the grace, and the fence check.
    announced_at: Option<Instant>,
}

impl Evidence {
    /// What is known when the key may have been held meanwhile by a session no try saw
    /// (this session ended, a hand-over to another node, a take seen held first): it
    /// was contended, by nobody known.
    fn unknown() -> Self {
        Self {
            contended: true,
            ..Self::default()
        }
    }
}

/// A lease of an ended session that its owner has not dropped yet: its work may still
/// be running. While it is out, this process keeps the key's *stop fence* (a companion
/// key) on its new session, so that a node that takes the key over waits for the work
/// to stop; and it does not try the key itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Stopping {
    id: RequestId,
    fence: Fence,
    /// When the lease was lost: past `max_fence_wait` from then, its work was aborted or
    /// will never stop, and the fence is given up (others give up waiting then too).
    since: Instant,
    /// When to try again to take an absent fence.
    retry_at: Instant,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fence {
    /// Not held: to be taken on the next session.
    Absent,
    /// Being taken (in the current plan); `released`: the lease came back meanwhile.
    Taking { released: bool },
    /// Held by this session.
    Held,
    /// The lease came back: to be released and announced (`sent`: in the current plan).
    Releasing { sent: bool },
}

#[derive(Debug)]
struct Slot {
    name: Arc<str>,
    server: Server,
    holder: Option<Holder>,
    waiters: VecDeque<Request>,
    next_try: Instant,
    evidence: Evidence,
    stopping: Option<Stopping>,
    /// The key's interest bucket (see [`LockKey::interest`]).
    bucket: u16,
    /// Tries in a row that failed without the bucket's interest held (another key of
    /// the bucket was flagged, or the take met a releaser's probe): the first few are
    /// followed by another try at once, which registers.
    unregistered: u8,
    /// Not tried before this: the key was handed over to another node, which has until
    /// then to take it (see [`HAND_OVER_HOLD`]).
    hold_until: Option<Instant>,
    /// The node (hash) the key's next announced unlock hands it over to.
    hand_to: Option<u64>,
    /// Announcements (sender pid, hand-over target) that arrived while this key's try
    /// was in flight: what they are worth is known only once the try answers who held
    /// the key, so they are applied right after its answer, in the order they came (see
    /// [`LockTable::tried`]). At most [`MAX_IN_FLIGHT_ANNOUNCEMENTS`].
    announced_in_flight: Vec<(i32, Option<u64>, Instant)>,
    /// When an announced hand-over to another node from a sender no try saw holding the
    /// key was trusted: at most one until a try sees a holder or the session ends
    /// (remembered by the key for [`UNSEEN_MEMORY`] from then when the slot is
    /// forgotten), so that a forged announcement costs a request one hold (and a
    /// contended win after it: the takeover grace and the fence check) that often at
    /// most.
    trusted_unseen: Option<Instant>,
    /// The token of the holder that released the key for a local hand-off (used only
    /// with [`Protection::FreshHandOffToken`] switched off, to show it is needed).
    inherited: Option<FencingToken>,
}

impl Slot {
    /// The earliest this node may try the key from `now`: at once, unless it holds off
    /// for a hand-over to another node (every path that asks for a try honours it: a
    /// new or withdrawn waiter, a new session, an unlock, a fence let go).
    fn earliest_try(&self, now: Instant) -> Instant {
        self.hold_until.filter(|h| *h > now).unwrap_or(now)
    }

    fn new(key: LockKey, name: Arc<str>, now: Instant) -> Self {
        Self {
            bucket: key.interest_bucket(),
            unregistered: 0,
            name,
            server: Server::Free,
            holder: None,
            waiters: VecDeque::new(),
            next_try: now,
            evidence: Evidence::default(),
            stopping: None,
            hold_until: None,
            hand_to: None,
            announced_in_flight: Vec::new(),
            trusted_unseen: None,
            inherited: None,
        }
    }

    /// Due for a try at `now` (its poll is due, and no hand-over to another node holds
    /// it back).
    fn due(&self, now: Instant) -> bool {
        self.next_try <= now && self.hold_until.is_none_or(|h| h <= now)
    }

    /// Waits for another session's release: its bucket's interest is wanted.
    fn wants_interest(&self) -> bool {
        matches!(self.server, Server::Free | Server::Trying)
            && self.holder.is_none()
            && self.stopping.is_none()
            && !self.waiters.is_empty()
    }

    fn busy(&self) -> bool {
        self.holder.is_some() || !self.waiters.is_empty()
    }

    fn unused(&self) -> bool {
        self.server == Server::Free
            && self.holder.is_none()
            && self.waiters.is_empty()
            && self.stopping.is_none()
    }
}

/// One entry of [`LockTable::snapshot`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Entry {
    Held {
        id: RequestId,
        name: Arc<str>,
        token: Option<FencingToken>,
        generation: u64,
        since: SystemTime,
    },
    Waiting {
        id: RequestId,
        name: Arc<str>,
        position: usize,
        since: SystemTime,
    },
}

/// The lock rules of one manager. See the module docs.
#[derive(Debug)]
pub(crate) struct LockTable {
    rules: Rules,
    /// The connected session's generation, `None` while disconnected.
    generation: Option<u64>,
    /// Set once a graceful shutdown began: no new requests.
    closing: bool,
    slots: HashMap<LockKey, Slot>,
    /// Interest buckets whose key this session holds (shared): some key of the bucket
    /// waits for another session's release. See [`LockKey::interest`].
    interest: HashSet<u16>,
    /// The next shared poll tick per poll interval.
    ticks: HashMap<Duration, Instant>,
    rng: u64,
    actions: VecDeque<Action>,
    /// Nothing won on this session is granted before this instant: see
    /// [`Self::hold_grants_until`].
    grants_not_before: Option<Instant>,
    /// An unverified hand-over naming this node brings no try forward before this (one
    /// for the whole table, so that a flood over many keys costs one statement).
    quick_cue: Option<Instant>,
    /// Holds for a hand-over to another node of keys whose slot was forgotten (nobody
    /// here waited any more, or the session ended): a request that comes within the
    /// hold honours it. Pruned of holds that are over at every request, so it is bounded
    /// by the keys handed over in the last [`HAND_OVER_HOLD`] (and the slots forgotten
    /// since the last request).
    holds: HashMap<LockKey, Instant>,
    /// Keys whose forgotten slot trusted an unchecked hand-over, and when (see
    /// `Slot::trusted_unseen`). Pruned of what is older than [`UNSEEN_MEMORY`] at every
    /// request that reaches the queue, and emptied when the session ends.
    unseen_trusted: HashMap<LockKey, Instant>,
    /// Protections switched off (tests only).
    #[cfg(test)]
    switched_off: Vec<Protection>,
}

impl LockTable {
    pub(crate) fn new(rules: Rules, seed: u64) -> Self {
        Self {
            rules,
            generation: None,
            closing: false,
            slots: HashMap::default(),
            interest: HashSet::default(),
            ticks: HashMap::default(),
            rng: seed | 1,
            actions: VecDeque::new(),
            grants_not_before: None,
            quick_cue: None,
            holds: HashMap::default(),
            unseen_trusted: HashMap::default(),
            #[cfg(test)]
            switched_off: Vec::new(),
        }
    }

    /// Switches a protection off, to show that the simulation fails without it.
    #[cfg(test)]
    pub(crate) fn switch_off(&mut self, protection: Protection) {
        self.switched_off.push(protection);
    }

    /// Is this protection switched off? Never outside tests.
    #[cfg(test)]
    pub(crate) fn off(&self, protection: Protection) -> bool {
        self.switched_off.contains(&protection)
            || crate::sim::is_off(crate::sim::Guard::Engine(protection))
    }

    #[cfg(not(test))]
    #[expect(clippy::unused_self, reason = "the test build reads the switches")]
    pub(crate) fn off(&self, _protection: Protection) -> bool {
        false
    }

    /// The next thing the task must do, if any.
    pub(crate) fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    // ---- the session ----------------------------------------------------------------

    /// A new session (generation) is up and proven.
    pub(crate) fn session_started(&mut self, generation: u64, now: Instant) {
        self.generation = Some(generation);
        for slot in self.slots.values_mut() {
            slot.next_try = slot.earliest_try(now);
        }
    }

    /// The session that just started grants nothing it wins before `at`: its server's
    /// term as primary began recently, and a holder of the previous term that went
    /// silent may trust its lease until then. A key won earlier waits, held, until `at`
    /// (and then its stop fence is checked, as after the takeover grace).
    pub(crate) fn hold_grants_until(&mut self, at: Instant) {
        self.grants_not_before = Some(at);
    }

    /// The session ended: every lock it held is gone, every holder has lost its lease.
    pub(crate) fn session_ended(&mut self, now: Instant) {
        self.generation = None;
        self.interest.clear();
        self.grants_not_before = None;
        self.unseen_trusted.clear();
        for (key, slot) in &mut self.slots {
            // A fence held by the old session is gone with it; a lease still out is
            // fenced again on the next one.
            slot.stopping = match slot.stopping {
                Some(Stopping {
                    fence: Fence::Releasing { .. } | Fence::Taking { released: true },
                    ..
                })
                | None => None,
                Some(Stopping { id, since, .. }) => Some(Stopping {
                    id,
                    fence: Fence::Absent,
                    since,
                    retry_at: now,
                }),
            };
            if let Some(h) = slot.holder.take() {
                slot.stopping = Some(Stopping {
                    id: h.id,
                    fence: Fence::Absent,
                    since: now,
                    retry_at: now,
                });
                unanswered_read(&mut self.actions, *key, &h);
                self.actions.push_back(Action::Lost {
                    key: *key,
                    name: h.name,
                });
            }
            slot.server = Server::Free;
            slot.announced_in_flight.clear();
            // Whatever happens to the key while we are away is unknown (and the next
            // session may trust one hand-over it cannot check).
            slot.evidence = Evidence::unknown();
            slot.trusted_unseen = None;
            let actions = &mut self.actions;
            slot.waiters.retain(|w| {
                let keep = w.mode == Mode::Wait;
                if !keep {
                    actions.push_back(Action::Refuse {
                        id: w.id,
                        why: Refusal::NotConnected,
                    });
                }
                keep
            });
        }
        self.forget_unused();
    }

    /// A session is up.
    pub(crate) fn connected(&self) -> bool {
        self.generation.is_some()
    }

    /// Some lease of an ended session is out whose stop fence this session does not
    /// hold yet (absent, or being taken).
    pub(crate) fn fences_pending(&self) -> bool {
        self.slots.values().any(|slot| {
            matches!(
                slot.stopping,
                Some(Stopping {
                    fence: Fence::Absent | Fence::Taking { released: false },
                    ..
                })
            )
        })
    }

    /// A graceful shutdown begins: waiting requests are answered `Closed`; holders keep
    /// their leases until they release them (see [`Self::close_now`]).
    pub(crate) fn begin_close(&mut self) {
        self.closing = true;
        for slot in self.slots.values_mut() {
            for w in slot.waiters.drain(..) {
                self.actions.push_back(Action::Refuse {
                    id: w.id,
                    why: Refusal::Closed,
                });
            }
            match slot.server {
                // A holder here released it (its work stopped), or a grant never
                // reached its request (nothing ran here): announced only then.
                Server::NeedsToken { announce, .. } => {
                    slot.server = Server::Unlocking {
                        sent: false,
                        announce,
                    };
                }
                // Won but never granted: whoever held it before may still be stopping.
                Server::Granting { .. } | Server::Checking { .. } | Server::Fenced { .. } => {
                    slot.server = Server::Unlocking {
                        sent: false,
                        announce: false,
                    };
                }
                _ => {}
            }
        }
        self.forget_unused();
    }

    /// The shutdown deadline passed: every lease still out is dropped from the table and
    /// every key this session holds is to be unlocked.
    pub(crate) fn close_now(&mut self) {
        self.begin_close();
        for (key, slot) in &mut self.slots {
            if let Some(h) = slot.holder.take() {
                unanswered_read(&mut self.actions, *key, &h);
                self.actions.push_back(Action::Lost {
                    key: *key,
                    name: h.name,
                });
            }
            if slot.server != Server::Free {
                // Leases still out past the stop budget: their work may not have
                // stopped, so the release is not announced.
                let announce = matches!(slot.server, Server::Unlocking { announce: true, .. });
                slot.server = Server::Unlocking {
                    sent: false,
                    announce,
                };
            }
            slot.stopping = match slot.stopping {
                Some(
                    st @ Stopping {
                        fence: Fence::Held | Fence::Releasing { sent: false },
                        ..
                    },
                ) => Some(Stopping {
                    fence: Fence::Releasing { sent: false },
                    ..st
                }),
                Some(
                    s @ Stopping {
                        fence: Fence::Releasing { sent: true },
                        ..
                    },
                ) => Some(s),
                _ => None,
            };
        }
        self.forget_unused();
    }

    /// Leases still out: held, or of an ended session and not dropped yet.
    pub(crate) fn held(&self) -> usize {
        self.slots
            .values()
            .filter(|s| {
                s.holder.is_some()
                    || s.stopping.is_some_and(|st| {
                        !matches!(
                            st.fence,
                            Fence::Releasing { .. } | Fence::Taking { released: true }
                        )
                    })
            })
            .count()
    }

    // ---- requests -------------------------------------------------------------------

    /// A new acquire request.
    pub(crate) fn acquire(&mut self, request: Request, now: Instant) {
        if self.closing {
            self.actions.push_back(Action::Refuse {
                id: request.id,
                why: Refusal::Closed,
            });
            return;
        }
        let known = self.slots.get(&request.key);
        if known.is_none() && self.slots.len() >= self.rules.max_locks {
            self.actions.push_back(Action::Refuse {
                id: request.id,
                why: Refusal::TooManyLocks {
                    limit: self.rules.max_locks,
                },
            });
            return;
        }
        if request.mode == Mode::Try {
            let held = self.holds.get(&request.key).is_some_and(|h| *h > now);
            let why = if held
                || known.is_some_and(|s| {
                    s.busy() || s.stopping.is_some() || s.hold_until.is_some_and(|h| h > now)
                }) {
                // (Held off for a hand-over to another node: that node's to take.)
                Some(Refusal::Busy)
            } else if self.generation.is_none() {
                Some(Refusal::NotConnected)
            } else if self.grants_not_before.is_some_and(|at| at > now) {
                // Nothing can be granted before the hold of a new primary term ends: a
                // try answers now rather than wait it out.
                Some(Refusal::Busy)
            } else {
                None
            };
            if let Some(why) = why {
                self.actions.push_back(Action::Refuse {
                    id: request.id,
                    why,
                });
                return;
            }
        }
        if !self.holds.is_empty() {
            self.holds.retain(|_, hold| *hold > now);
        }
        if !self.unseen_trusted.is_empty() {
            self.unseen_trusted
                .retain(|_, at| now.saturating_duration_since(*at) < UNSEEN_MEMORY);
        }
        let honour = !self.off(Protection::HandOverHold);
        let held = self.holds.remove(&request.key).filter(|_| honour);
        let unseen_trusted = self.unseen_trusted.remove(&request.key);
        let slot = self.slots.entry(request.key).or_insert_with(|| {
            let mut slot = Slot::new(request.key, Arc::clone(&request.name), now);
            slot.trusted_unseen = unseen_trusted;
            slot
        });
        if held.is_some() {
            // Handed to another node within the hold: it may take the key and lose it
            // silently, so a win after the hold is a contended one (the grace and the
            // fence check), as for a waiter that stayed.
            slot.hold_until = held;
            slot.evidence = Evidence::unknown();
        }
        if !slot.busy() {
            // A head waiter is tried at once, whatever was planned for an earlier one.
            slot.next_try = slot.earliest_try(now);
        }
        slot.waiters.push_back(request);
    }

    /// The caller of request `id` stopped waiting for it.
    pub(crate) fn withdraw(&mut self, key: LockKey, id: RequestId, now: Instant) {
        let Some(slot) = self.slots.get_mut(&key) else {
            return;
        };
        let Some(position) = slot.waiters.iter().position(|w| w.id == id) else {
            return;
        };
        slot.waiters.remove(position);
        if position == 0 && slot.holder.is_none() {
            // The new head may poll on another interval: try it at once.
            slot.next_try = slot.earliest_try(now);
        }
        self.forget_if_unused(key);
    }

    /// The holder of lease `id` released it (a grant never delivered goes to
    /// [`undelivered`](Self::undelivered) instead). A
    /// lease of an ended generation, or one already released, is ignored.
    #[cfg(test)]
    pub(crate) fn release(&mut self, key: LockKey, id: RequestId, now: Instant) {
        self.release_to(key, id, None, now);
    }

    /// [`release`](Self::release), handing the key over to one node (by its
    /// [`node_hash`](crate::key::node_hash)) when `to` names another: the key is
    /// unlocked and announced for that node even when this process has waiters for it
    /// (they, like every other node's, hold off [`HAND_OVER_HOLD`]).
    pub(crate) fn release_to(
        &mut self,
        key: LockKey,
        id: RequestId,
        to: Option<u64>,
        now: Instant,
    ) {
        let to = to.filter(|node| *node != self.rules.node);
        let Some(slot) = self.slots.get_mut(&key) else {
            return;
        };
        if let Some(stopping) = slot.stopping
            && stopping.id == id
        {
            // A lease of an ended session came back: its work has stopped.
            slot.stopping = match stopping.fence {
                Fence::Absent => None,
                Fence::Taking { .. } => Some(Stopping {
                    fence: Fence::Taking { released: true },
                    ..stopping
                }),
                Fence::Held => Some(Stopping {
                    fence: Fence::Releasing { sent: false },
                    ..stopping
                }),
                Fence::Releasing { .. } => Some(stopping),
            };
            if slot.stopping.is_none() {
                slot.next_try = slot.earliest_try(now);
            }
            self.forget_if_unused(key);
            return;
        }
        if slot.holder.as_ref().map(|h| h.id) != Some(id) {
            return;
        }
        let holder = slot.holder.take().expect("BUG: holder checked");
        unanswered_read(&mut self.actions, key, &holder);
        let inherited = holder.token;
        self.actions.push_back(Action::Released {
            key,
            name: holder.name,
        });
        slot.hand_to = to;
        if to.is_some() {
            // Not handed to a local waiter: unlocked and announced for that node, and
            // the local waiters hold off like the other nodes'. If they win after the
            // hold, that node may have held it meanwhile and lost it silently: a
            // contended win, with the grace and the fence check.
            slot.hold_until = Some(now + HAND_OVER_HOLD);
            slot.next_try = slot.next_try.max(now + HAND_OVER_HOLD);
            slot.evidence = Evidence::unknown();
        }
        if slot.waiters.is_empty() || to.is_some() {
            slot.server = Server::Unlocking {
                sent: false,
                announce: true,
            };
        } else {
            slot.server = Server::NeedsToken {
                asked: false,
                announce: true,
                via: Via::HandOff,
            };
            slot.inherited = inherited;
        }
    }

    /// Grant `id` never reached its request (the caller stopped waiting, or a shutdown
    /// began while its statement was in flight): nobody ran anything under it, so the
    /// key goes to the next local waiter, or is unlocked *quietly*, as a win refused
    /// before it was granted is. An announcement would let other nodes skip the
    /// takeover grace, although whoever held the key before this win may still be
    /// stopping. No [`Action::Released`] either: the lease was never delivered, so no
    /// acquisition was reported that a release would end.
    pub(crate) fn undelivered(&mut self, key: LockKey, id: RequestId, _now: Instant) {
        let Some(slot) = self.slots.get_mut(&key) else {
            return;
        };
        if slot.holder.as_ref().map(|h| h.id) != Some(id) {
            return;
        }
        let inherited = slot.holder.take().and_then(|h| {
            unanswered_read(&mut self.actions, key, &h);
            h.token
        });
        slot.hand_to = None;
        let announce = self.off(Protection::QuietUnlock);
        let slot = self
            .slots
            .get_mut(&key)
            .expect("BUG: the slot was just seen");
        if slot.waiters.is_empty() {
            slot.server = Server::Unlocking {
                sent: false,
                announce,
            };
        } else {
            slot.server = Server::NeedsToken {
                asked: false,
                announce,
                via: Via::HandOff,
            };
            slot.inherited = inherited;
        }
    }

    /// Holder `id` of `key` reads its fencing token: known already, or to be issued by
    /// the next plan's token statement (answered by [`Action::Token`]), or refused when
    /// `id` does not hold the key.
    pub(crate) fn read_token(&mut self, key: LockKey, id: RequestId) -> TokenRead {
        let Some(holder) = self
            .slots
            .get_mut(&key)
            .and_then(|slot| slot.holder.as_mut())
            .filter(|h| h.id == id)
        else {
            return TokenRead::NotHeld;
        };
        if let Some(token) = holder.token {
            return TokenRead::Known(token);
        }
        if holder.reading == Reading::No {
            holder.reading = Reading::Wanted;
        }
        TokenRead::Pending
    }

    /// Another session announced that it released `key`; `sender` is the backend pid
    /// the server stamped on the notification.
    #[cfg(test)]
    pub(crate) fn announced(&mut self, key: LockKey, sender: i32, now: Instant) {
        self.announced_for(key, sender, None, now);
    }

    /// [`announced`](Self::announced), for a release that hands the key over to the
    /// node `to` (by hash), when given: another node's waiters hold off
    /// [`HAND_OVER_HOLD`] so that it takes it, if the announcement is verified (from the
    /// backend the last try saw holding the key); the named node tries at once.
    pub(crate) fn announced_for(
        &mut self,
        key: LockKey,
        sender: i32,
        to: Option<u64>,
        now: Instant,
    ) {
        let me = self.rules.node;
        let trust_any = self.off(Protection::AnnouncementCheck);
        let yield_won = !self.off(Protection::HandOverYield);
        let unseen_ok = !self.off(Protection::HandOverUnseen);
        let Some(slot) = self.slots.get_mut(&key) else {
            return;
        };
        let for_another = to.is_some_and(|node| node != me);
        // A hand-over to another node, announced by a sender this slot cannot check (no
        // try saw who held the key): trusted once (per key, until a try sees a holder,
        // the session ends, or `UNSEEN_MEMORY` passes). Holding off or giving back a win
        // not yet granted is safe whoever sent it; what a forged one costs is one hold.
        let trust_unseen = for_another && unseen_ok && slot.trusted_unseen.is_none();
        // Won, not yet granted (the grace, or the term hold), by a try that came just
        // after the holder the try before saw released the key for another node, and
        // before its announcement: nothing ran under it here, so it is given back
        // (quietly) and this node holds off as if the announcement had come first, so
        // that the named node takes it.
        if let Server::Granting { from, .. } = slot.server
            && (from == Some(sender) || (from.is_none() && trust_unseen))
            && yield_won
            && for_another
        {
            if from.is_none() {
                slot.trusted_unseen = Some(now);
            }
            slot.server = Server::Unlocking {
                sent: false,
                announce: false,
            };
            // Whoever takes it next (the named node) may lose it silently: a win after
            // the hold keeps the grace and the fence check.
            slot.evidence = Evidence::unknown();
            slot.hold_until = Some(now + HAND_OVER_HOLD);
            slot.next_try = now + HAND_OVER_HOLD;
            return;
        }
        if let Server::Fenced {
            by,
            next,
            not_before,
            ..
        } = &mut slot.server
        {
            // The old holder's new session announces that its work stopped: look again
            // (not before the grace ends, though: another holder may not know yet). The
            // pid alone suffices: this only brings the fence check forward, and the
            // check, not the announcement, decides (a reused pid costs one check).
            if *by == Some(sender) {
                *next = now.max(*not_before);
            }
            return;
        }
        if slot.server == Server::Trying && !slot.waiters.is_empty() {
            // The try in flight may answer that the sender held the key: the
            // announcement is verified against that answer, not the one before, but
            // it keeps its arrival: it vouches only for a win answered within the
            // grace of that (a slow try does not make it fresh again; the sender may
            // have taken the key again before the try ran).
            slot.announced_in_flight
                .retain(|(pid, _, _)| *pid != sender);
            if slot.announced_in_flight.len() == MAX_IN_FLIGHT_ANNOUNCEMENTS {
                slot.announced_in_flight.remove(0);
            }
            slot.announced_in_flight.push((sender, to, now));
            return;
        }
        if slot.server != Server::Free || slot.waiters.is_empty() {
            return;
        }
        let holding_off = slot.hold_until.is_some_and(|h| h > now);
        // The pid alone: whether the session that sent it is the one the last try saw is
        // known only at the next try (see `Plan::verify`). A hold for another node on a
        // reused pid delays this node's tries by `HAND_OVER_HOLD`, once per try, and
        // skips nothing.
        let unseen = slot.evidence.holder.is_none() && trust_unseen;
        if slot.evidence.holder.map(|h| h.pid) == Some(sender) || trust_any || unseen {
            match to {
                // Handed to another node: give it the time to take it, then try. Not an
                // announced release for this node: the named node may take the key and
                // lose it silently within the hold, so a win after it keeps the grace
                // and the fence check (contended, whatever was known before). One hold
                // per try: announcements repeated during a hold do not push it further
                // (nor spend the one unseen hand-over trusted).
                Some(node) if node != me => {
                    if slot.hold_until.is_none() {
                        if unseen {
                            slot.trusted_unseen = Some(now);
                        }
                        // Whatever an earlier announcement proved is over: the key may
                        // be taken and lost within the hold.
                        slot.evidence = Evidence {
                            contended: true,
                            holder: slot.evidence.holder,
                            ..Evidence::default()
                        };
                        slot.hold_until = Some(now + HAND_OVER_HOLD);
                        slot.next_try = now + HAND_OVER_HOLD;
                    }
                }
                _ => {
                    slot.evidence.announced = true;
                    slot.evidence.confirmed = false;
                    slot.evidence.announced_at = Some(now);
                    slot.hold_until = None;
                    slot.next_try = now;
                }
            }
        } else if to == Some(me) && !holding_off && self.quick_cue.is_none_or(|at| now >= at) {
            // Handed to this node by a holder the last try did not see (it took over
            // while this node held off for an earlier hand-over), or forged: try at once,
            // but as an unannounced takeover (the grace is not skipped), at most once per
            // `UNVERIFIED_CUE` for the whole table however many arrive, and never
            // against a verified hold for another node.
            self.quick_cue = Some(now + UNVERIFIED_CUE);
            slot.next_try = now;
        } else {
            // From a holder the last try did not see (it took over since), or forged:
            // only a cue to try again within `UNVERIFIED_CUE`, without skipping the
            // grace, however many arrive.
            // On a shared tick, so that cues for many keys share one statement.
            let cue = next_tick(&mut self.ticks, &mut self.rng, UNVERIFIED_CUE, now);
            slot.next_try = slot.next_try.min(cue);
        }
    }

    // ---- steps ----------------------------------------------------------------------

    /// Grants whose grace has passed, then the statements of the next step.
    pub(crate) fn plan(&mut self, now: Instant) -> Plan {
        let mut plan = Plan::default();
        let Some(generation) = self.generation else {
            return plan;
        };
        let mut grants: Vec<(LockKey, Option<FencingToken>, Via)> = Vec::new();
        let pass_inherited = self.off(Protection::FreshHandOffToken);
        let check_sessions = !self.off(Protection::SessionCheck);
        for (key, slot) in &mut self.slots {
            if let Some(st) = slot.stopping {
                let given_up = now >= st.since + self.rules.max_fence_wait;
                slot.stopping = match st.fence {
                    // Past the longest any stop may take: stop fencing (the other nodes
                    // stop waiting at the same bound), and let this process use the key.
                    Fence::Absent if given_up => None,
                    Fence::Held if given_up => Some(Stopping {
                        fence: Fence::Releasing { sent: false },
                        ..st
                    }),
                    // Also while closing: the lease's work may still be stopping.
                    Fence::Absent if now >= st.retry_at => {
                        plan.fence.push(*key);
                        Some(Stopping {
                            fence: Fence::Taking { released: false },
                            ..st
                        })
                    }
                    _ => Some(st),
                };
                if let Some(
                    st @ Stopping {
                        fence: Fence::Releasing { sent: false },
                        ..
                    },
                ) = slot.stopping
                {
                    plan.unfence.push(*key);
                    slot.stopping = Some(Stopping {
                        fence: Fence::Releasing { sent: true },
                        ..st
                    });
                }
                if slot.stopping.is_none() {
                    slot.next_try = slot.earliest_try(now);
                }
            }
            match slot.server {
                // The grace is over: before granting, is the old holder still stopping?
                Server::Granting { token, at, .. } if at <= now => {
                    slot.server = Server::Checking { token, until: None };
                    plan.check.push(*key);
                }
                Server::Fenced { token, until, .. } if until <= now => {
                    grants.push((*key, token, Via::FenceExpired));
                }
                Server::Fenced {
                    token, next, until, ..
                } if next <= now => {
                    slot.server = Server::Checking {
                        token,
                        until: Some(until),
                    };
                    plan.check.push(*key);
                }
                Server::Held => {
                    if let Some(h) = slot.holder.as_mut()
                        && h.reading == Reading::Wanted
                    {
                        h.reading = Reading::Asked;
                        plan.token_read.push(*key);
                    }
                }
                Server::Granting { .. }
                | Server::Fenced { .. }
                | Server::Checking { .. }
                | Server::Trying
                | Server::NeedsToken { asked: true, .. }
                | Server::Unlocking { sent: true, .. } => {}
                // A local hand-off to a waiter that did not ask for its token eagerly
                // needs no statement: granted now, without a token (its holder reads
                // one when it needs it, issued then, after every token of the key's
                // earlier holders). Here, not on the release: a plan is made only on a
                // valid session.
                Server::NeedsToken {
                    asked: false,
                    via: Via::HandOff,
                    ..
                } if slot.waiters.front().is_some_and(|w| !w.eager_token) => {
                    let inherited = slot.inherited.take();
                    let passed = if pass_inherited { inherited } else { None };
                    grants.push((*key, passed, Via::HandOff));
                }
                Server::NeedsToken {
                    asked: false,
                    announce,
                    via,
                } => {
                    slot.server = Server::NeedsToken {
                        asked: true,
                        announce,
                        via,
                    };
                    slot.inherited = None;
                    plan.token_for.push(*key);
                }
                Server::Unlocking {
                    sent: false,
                    announce,
                } => {
                    slot.server = Server::Unlocking {
                        sent: true,
                        announce,
                    };
                    if announce {
                        plan.unlock.push(*key);
                        if let Some(node) = slot.hand_to.take() {
                            plan.hand_to.push((*key, node));
                        }
                    } else {
                        plan.unlock_quiet.push(*key);
                    }
                }
                Server::Free => {
                    // Not while a lease of ours from an ended session is still out.
                    if slot.holder.is_none()
                        && slot.stopping.is_none()
                        && !slot.waiters.is_empty()
                        && slot.due(now)
                    {
                        slot.server = Server::Trying;
                        plan.try_keys.push(*key);
                        if slot.waiters.front().is_some_and(|w| !w.eager_token) {
                            plan.lazy.push(*key);
                        }
                        if let Some(Backend {
                            pid,
                            start: Some(_),
                        }) = slot.evidence.holder
                            && slot.evidence.announced
                            && check_sessions
                        {
                            plan.verify.push((*key, pid));
                        }
                    }
                }
            }
        }
        for (key, token, via) in grants {
            // `FenceExpired`: the old holder's fence outlived any stop budget: it is
            // broken or gone.
            self.grant(key, token, generation, now, via);
        }
        // Interest: a key that waits for another session's release registers its bucket
        // (once per bucket per statement); a bucket no waiting key needs is released.
        plan.try_keys.sort_unstable();
        let mut flagged: HashSet<u16> = HashSet::default();
        for key in &plan.try_keys {
            let bucket = self.slots[key].bucket;
            if !self.interest.contains(&bucket) && flagged.insert(bucket) {
                plan.register.push(*key);
            }
        }
        let unwanted = self.unwanted_interest();
        for bucket in unwanted {
            self.interest.remove(&bucket);
            plan.unregister.push(bucket);
        }
        // Deterministic order: tests replay exactly, and statements lock in key order.
        plan.unlock.sort_unstable();
        plan.unlock_quiet.sort_unstable();
        plan.token_for.sort_unstable();
        plan.token_read.sort_unstable();
        plan.lazy.sort_unstable();
        plan.try_keys.sort_unstable();
        plan.fence.sort_unstable();
        plan.unfence.sort_unstable();
        plan.check.sort_unstable();
        plan.verify.sort_unstable();
        plan.register.sort_unstable();
        plan.unregister.sort_unstable();
        plan
    }

    /// Interest buckets held that no waiting key needs any more.
    fn unwanted_interest(&self) -> Vec<u16> {
        if self.interest.is_empty() {
            return Vec::new();
        }
        let wanted: HashSet<u16> = self
            .slots
            .values()
            .filter(|slot| slot.wants_interest())
            .map(|slot| slot.bucket)
            .collect();
        self.interest
            .iter()
            .filter(|b| !wanted.contains(b))
            .copied()
            .collect()
    }

    /// The try statement of the last plan took the interest keys of these keys'
    /// buckets (see [`Plan::register`]).
    pub(crate) fn registered(&mut self, keys: &[LockKey]) {
        if self.generation.is_none() {
            return;
        }
        for key in keys {
            let bucket = match self.slots.get_mut(key) {
                Some(slot) => {
                    slot.unregistered = 0;
                    slot.bucket
                }
                None => key.interest_bucket(),
            };
            self.interest.insert(bucket);
        }
    }

    /// The try statement of the last plan won these keys of [`Plan::verify`] and found
    /// the backend with the announcer's pid started at this instant (`None`: no such
    /// backend, or its start hidden). The announcement is verified if that is the start
    /// the last failed try saw: the holder's session is still alive, so it sent it.
    pub(crate) fn senders(&mut self, found: &[(LockKey, Option<i64>)]) {
        for &(key, start) in found {
            if let Some(slot) = self.slots.get_mut(&key)
                && slot.server == Server::Trying
                && slot.evidence.announced
                && start.is_some()
                && slot.evidence.holder.and_then(|h| h.start) == start
            {
                slot.evidence.confirmed = true;
            }
        }
    }

    /// The try statement of the last plan found these keys held at its first try and
    /// won them at a later one: the holder's session ended in between, so the win is a
    /// takeover (the grace applies), whatever the table knew before.
    pub(crate) fn seen_held(&mut self, keys: &[LockKey]) {
        for key in keys {
            if let Some(slot) = self.slots.get_mut(key)
                && slot.server == Server::Trying
            {
                slot.evidence = Evidence::unknown();
            }
        }
    }

    /// The fence statement of the last plan answered: `true` per key whose fence this
    /// session now holds.
    pub(crate) fn fenced(&mut self, outcomes: &[(LockKey, bool)], now: Instant) {
        for &(key, taken) in outcomes {
            let Some(slot) = self.slots.get_mut(&key) else {
                continue;
            };
            let Some(
                st @ Stopping {
                    fence: Fence::Taking { released },
                    ..
                },
            ) = slot.stopping
            else {
                continue;
            };
            let fence = match (taken, released) {
                (true, false) => Fence::Held,
                (true, true) => Fence::Releasing { sent: false },
                // Someone held it (a node checking it, for an instant): try again soon.
                (false, false) => {
                    slot.stopping = Some(Stopping {
                        fence: Fence::Absent,
                        retry_at: now + Duration::from_millis(50),
                        ..st
                    });
                    continue;
                }
                (false, true) => {
                    slot.stopping = None;
                    slot.next_try = slot.earliest_try(now);
                    self.forget_if_unused(key);
                    continue;
                }
            };
            slot.stopping = Some(Stopping { fence, ..st });
        }
    }

    /// The unfence statement of the last plan succeeded.
    pub(crate) fn unfenced(&mut self, keys: &[LockKey], now: Instant) {
        for &key in keys {
            let Some(slot) = self.slots.get_mut(&key) else {
                continue;
            };
            if let Some(Stopping {
                fence: Fence::Releasing { sent: true },
                ..
            }) = slot.stopping
            {
                slot.stopping = None;
                slot.next_try = slot.earliest_try(now);
            }
            self.forget_if_unused(key);
        }
    }

    /// The fence checks of the last plan answered.
    pub(crate) fn checked(&mut self, outcomes: &[(LockKey, FenceCheck)], now: Instant) {
        let Some(generation) = self.generation else {
            return;
        };
        let no_fence = self.off(Protection::StopFence);
        for &(key, outcome) in outcomes {
            let Some(slot) = self.slots.get_mut(&key) else {
                continue;
            };
            let Server::Checking { token, until } = slot.server else {
                continue;
            };
            let outcome = match outcome {
                FenceCheck::Held { .. } if no_fence => FenceCheck::Clear,
                other => other,
            };
            let by = match outcome {
                FenceCheck::Clear => {
                    self.grant(key, token, generation, now, Via::Checked);
                    continue;
                }
                FenceCheck::Held { by } => by,
                FenceCheck::Failed => None,
            };
            let interval = slot
                .waiters
                .front()
                .map_or(Duration::from_millis(100), |w| {
                    w.poll_interval.min(Duration::from_millis(500))
                });
            slot.server = Server::Fenced {
                token,
                next: now + interval,
                until: until.unwrap_or(now + self.rules.max_fence_wait),
                by,
                not_before: now,
            };
        }
    }

    /// The unlock statement of the last plan succeeded.
    pub(crate) fn unlocked(&mut self, keys: &[LockKey], now: Instant) {
        for &key in keys {
            let Some(slot) = self.slots.get_mut(&key) else {
                continue;
            };
            if matches!(slot.server, Server::Unlocking { sent: true, .. }) {
                slot.server = Server::Free;
                // A request that arrived meanwhile is tried at once (after a hold for
                // another node, when a win was given back to it).
                slot.next_try = slot.earliest_try(now);
            }
            self.forget_if_unused(key);
        }
    }

    /// The token statement of the last plan answered: `Some(token)` for every hand-off
    /// (`handed`, [`Plan::token_for`]) and every holder's read (`read`,
    /// [`Plan::token_read`]), or `None` when it failed (the hand-offs are unlocked
    /// instead, the reads answered without a token).
    pub(crate) fn tokens(
        &mut self,
        handed: &[LockKey],
        read: &[LockKey],
        token: Option<FencingToken>,
        now: Instant,
    ) {
        let Some(generation) = self.generation else {
            return;
        };
        for &key in handed {
            let Some(slot) = self.slots.get_mut(&key) else {
                continue;
            };
            let Server::NeedsToken {
                asked: true,
                announce,
                via,
            } = slot.server
            else {
                continue;
            };
            match token {
                // Nobody waits any more (the waiter withdrew meanwhile): unlocked, and
                // announced only if a holder here released it.
                Some(_) if slot.waiters.is_empty() => {
                    slot.server = Server::Unlocking {
                        sent: false,
                        announce,
                    };
                }
                Some(token) => self.grant(key, Some(token), generation, now, via),
                // Announced only if a holder here released it (its work stopped); not
                // after a grant that never reached its request.
                None => {
                    slot.server = Server::Unlocking {
                        sent: false,
                        announce,
                    };
                }
            }
        }
        for &key in read {
            // Only the holder that asked, still holding (a lease that ended meanwhile
            // was answered then; a later holder's token is issued after this one).
            let Some(holder) = self
                .slots
                .get_mut(&key)
                .and_then(|slot| slot.holder.as_mut())
                .filter(|h| h.reading == Reading::Asked)
            else {
                continue;
            };
            holder.reading = Reading::No;
            if holder.token.is_none() {
                holder.token = token;
            }
            self.actions.push_back(Action::Token {
                id: holder.id,
                key,
                token: holder.token,
            });
        }
    }

    /// The try statement of the last plan answered, one outcome per key of
    /// [`Plan::try_keys`] (a key missing from `outcomes` counts as failed).
    pub(crate) fn tried(&mut self, outcomes: &[(LockKey, TryOutcome)], now: Instant) {
        let Some(generation) = self.generation else {
            return;
        };
        let (no_grace, no_fence) = (
            self.off(Protection::TakeoverGrace),
            self.off(Protection::StopFence),
        );
        let check_sessions = !self.off(Protection::SessionCheck);
        for &(key, outcome) in outcomes {
            let outcome = match outcome {
                TryOutcome::WonFenced { token, .. } if no_fence => TryOutcome::Won(token),
                other => other,
            };
            let Some(slot) = self.slots.get_mut(&key) else {
                continue;
            };
            if slot.server != Server::Trying {
                continue;
            }
            // A try ends a hold: what it found is what the next announcement is
            // verified against.
            slot.hold_until = None;
            let in_flight = std::mem::take(&mut slot.announced_in_flight);
            match outcome {
                TryOutcome::Won(token) => {
                    slot.unregistered = 0;
                    let evidence = std::mem::take(&mut slot.evidence);
                    let unannounced = evidence.contended
                        && !verified(&evidence, check_sessions, now, self.rules.takeover_grace);
                    let held_until = self.grants_not_before.filter(|at| *at > now);
                    let from = evidence.holder.map(|h| h.pid);
                    if unannounced && !self.rules.takeover_grace.is_zero() && !no_grace {
                        slot.server = Server::Granting {
                            token,
                            at: (now + self.rules.takeover_grace).max(held_until.unwrap_or(now)),
                            from,
                        };
                    } else if let Some(at) = held_until {
                        slot.server = Server::Granting { token, at, from };
                    } else {
                        self.grant(key, token, generation, now, Via::Won);
                    }
                }
                TryOutcome::WonFenced { token, by } => {
                    // Whatever we knew, someone's work under the key is still stopping:
                    // wait for its fence (and at least the grace, when unannounced).
                    let evidence = std::mem::take(&mut slot.evidence);
                    let unannounced = evidence.contended
                        && !verified(&evidence, check_sessions, now, self.rules.takeover_grace);
                    let interval = slot
                        .waiters
                        .front()
                        .map_or(Duration::from_millis(100), |w| {
                            w.poll_interval.min(Duration::from_millis(500))
                        });
                    let wait = if unannounced && !no_grace {
                        interval.max(self.rules.takeover_grace)
                    } else {
                        interval
                    };
                    let held_until = self.grants_not_before.unwrap_or(now).max(now);
                    slot.server = Server::Fenced {
                        token,
                        next: (now + wait).max(held_until),
                        until: (now + self.rules.max_fence_wait).max(held_until),
                        by,
                        not_before: if unannounced && !no_grace {
                            now + self.rules.takeover_grace
                        } else {
                            now
                        }
                        .max(held_until),
                    };
                }
                TryOutcome::Held { by } => {
                    slot.server = Server::Free;
                    // A holder seen: from now on its announcements are checked; if it
                    // is lost again, one unseen hand-over may be trusted again (a win
                    // does not renew it, so forged ones cannot starve this node).
                    if by.is_some() {
                        slot.trusted_unseen = None;
                    }
                    slot.evidence = Evidence {
                        contended: true,
                        holder: by,
                        ..Evidence::default()
                    };
                    self.not_acquired(key, Refusal::Busy, now);
                    // Waiting without interest registered, a release would not be
                    // announced to us: try again at once (a few times), registering.
                    if let Some(slot) = self.slots.get_mut(&key)
                        && !slot.waiters.is_empty()
                        && !self.interest.contains(&slot.bucket)
                        && slot.unregistered < MAX_QUICK_REGISTERS
                    {
                        // At once the first time (the bucket was flagged for another key
                        // of it), then backing off: 100, 200, 400, 800 ms (a releaser's
                        // probe holds the interest key for an instant; anything that
                        // holds it longer is not a release).
                        let backoff = match slot.unregistered {
                            0 => Duration::ZERO,
                            n => Duration::from_millis(50) * (1 << n),
                        };
                        slot.unregistered += 1;
                        slot.next_try = slot.next_try.min(now + backoff);
                    }
                }
                TryOutcome::Failed => {
                    slot.server = Server::Free;
                    // Nothing was seen, and time passed: whoever the last try saw may
                    // have released it and another session held it since, unseen. An
                    // announcement from before vouches for nothing after it.
                    slot.evidence = Evidence::unknown();
                    self.not_acquired(key, Refusal::Failed, now);
                }
            }
            // Announcements that came while the try was on its way, as if they came now,
            // after its answer: what the answer says is what they are verified against.
            for (sender, to, arrived) in in_flight {
                self.announced_for(key, sender, to, arrived);
            }
        }
        // Keys the statement did not answer for (it cannot happen with our statements,
        // but a server must not be able to wedge a key in `Trying`).
        let stuck: Vec<LockKey> = self
            .slots
            .iter()
            .filter(|(_, s)| s.server == Server::Trying)
            .map(|(k, _)| *k)
            .collect();
        for key in stuck {
            if let Some(slot) = self.slots.get_mut(&key) {
                slot.server = Server::Free;
                slot.announced_in_flight.clear();
            }
            self.not_acquired(key, Refusal::Failed, now);
        }
    }

    /// The next instant something is due: now, when statements are waiting to be
    /// planned; else a grace that ends or a poll tick.
    pub(crate) fn next_wakeup(&self, now: Instant) -> Option<Instant> {
        self.generation?;
        if !self.unwanted_interest().is_empty() {
            return Some(now);
        }
        self.slots
            .values()
            .filter_map(|slot| {
                // A stop in progress first (no `if let` guard: newer than our rust-version).
                if let Some(st) = slot.stopping {
                    match st.fence {
                        Fence::Releasing { sent: false } => return Some(now),
                        Fence::Absent | Fence::Held => {
                            let give_up = st.since + self.rules.max_fence_wait;
                            return Some(if st.fence == Fence::Absent {
                                st.retry_at.min(give_up)
                            } else {
                                give_up
                            });
                        }
                        _ => {}
                    }
                }
                match slot.server {
                    Server::NeedsToken { asked: false, .. }
                    | Server::Unlocking { sent: false, .. } => Some(now),
                    Server::Held
                        if slot
                            .holder
                            .as_ref()
                            .is_some_and(|h| h.reading == Reading::Wanted) =>
                    {
                        Some(now)
                    }
                    Server::Granting { at, .. } => Some(at),
                    Server::Fenced { next, until, .. } => Some(next.min(until)),
                    Server::Free
                        if slot.holder.is_none()
                            && slot.stopping.is_none()
                            && !slot.waiters.is_empty() =>
                    {
                        Some(slot.next_try.max(slot.hold_until.unwrap_or(slot.next_try)))
                    }
                    _ => None,
                }
            })
            .min()
    }

    /// The advisory locks this session holds at the server for certain: keys and stop
    /// fences held, interest keys taken, not counting those in a statement that may
    /// release them or take them.
    pub(crate) fn server_floor(&self) -> Vec<SessionLock> {
        let mut held = Vec::with_capacity(self.slots.len() + self.interest.len());
        for (key, s) in &self.slots {
            if !matches!(
                s.server,
                Server::Free | Server::Trying | Server::Unlocking { sent: true, .. }
            ) {
                held.push(SessionLock {
                    key: *key,
                    exclusive: true,
                });
            }
            if matches!(
                s.stopping,
                Some(Stopping {
                    fence: Fence::Held | Fence::Releasing { sent: false },
                    ..
                })
            ) {
                held.push(SessionLock {
                    key: key.stop_fence(),
                    exclusive: false,
                });
            }
        }
        // Interest keys whose take was answered and whose release is not yet sent.
        held.extend(self.interest.iter().map(|b| SessionLock {
            key: LockKey::interest_of(*b),
            exclusive: false,
        }));
        held
    }

    // ---- views ----------------------------------------------------------------------

    /// Every held lease and waiting request, per key.
    pub(crate) fn snapshot(&self) -> Vec<(LockKey, Entry)> {
        let mut out = Vec::new();
        for (key, slot) in &self.slots {
            if let Some(h) = &slot.holder {
                out.push((
                    *key,
                    Entry::Held {
                        id: h.id,
                        name: Arc::clone(&h.name),
                        token: h.token,
                        generation: h.generation,
                        since: h.since,
                    },
                ));
            }
            for (position, w) in slot.waiters.iter().enumerate() {
                out.push((
                    *key,
                    Entry::Waiting {
                        id: w.id,
                        name: Arc::clone(&w.name),
                        position,
                        since: w.since,
                    },
                ));
            }
        }
        out
    }

    /// Waiting requests per key (for the waiter gauge), with the key's name.
    pub(crate) fn waiting(&self) -> impl Iterator<Item = (LockKey, &Arc<str>, usize)> + '_ {
        self.slots
            .iter()
            .map(|(key, slot)| (*key, &slot.name, slot.waiters.len()))
    }

    /// The name a key is known by here, if any.
    pub(crate) fn name_of(&self, key: LockKey) -> Option<&Arc<str>> {
        self.slots.get(&key).map(|s| &s.name)
    }

    // ---- internals ------------------------------------------------------------------

    /// Gives a lock the session holds to the oldest waiter, or unlocks it when nobody
    /// waits any more.
    /// When nobody takes it, its release is announced only after a hand-off (a holder
    /// here released it, so work under it has stopped); [`tokens`](Self::tokens) keeps a
    /// hand-off after a grant that never reached its request quiet before it gets here.
    fn grant(
        &mut self,
        key: LockKey,
        token: Option<FencingToken>,
        generation: u64,
        now: Instant,
        via: Via,
    ) {
        let announce = via == Via::HandOff;
        debug_assert!(
            self.grants_not_before.is_none_or(|at| now >= at),
            "BUG: a grant before the term's grant delay ended"
        );
        let slot = self
            .slots
            .get_mut(&key)
            .expect("BUG: granting an unknown key");
        if token.is_none() && slot.waiters.front().is_some_and(|w| w.eager_token) {
            // Its try took no token (another request headed the queue then): one fresh
            // token first, issued while the key is held.
            slot.server = Server::NeedsToken {
                asked: false,
                announce: false,
                via,
            };
            return;
        }
        match slot.waiters.pop_front() {
            Some(w) => {
                slot.server = Server::Held;
                slot.holder = Some(Holder {
                    id: w.id,
                    name: Arc::clone(&w.name),
                    token,
                    generation,
                    since: SystemTime::now(),
                    reading: Reading::No,
                });
                self.actions.push_back(Action::Grant {
                    id: w.id,
                    key,
                    token,
                    generation,
                    waited: now.saturating_duration_since(w.enqueued),
                    via,
                });
            }
            None => {
                slot.server = Server::Unlocking {
                    sent: false,
                    announce,
                };
            }
        }
    }

    /// The key was not won: answer try requests at the head, reschedule the rest.
    fn not_acquired(&mut self, key: LockKey, why: Refusal, now: Instant) {
        let Some(slot) = self.slots.get_mut(&key) else {
            return;
        };
        while slot.waiters.front().is_some_and(|w| w.mode == Mode::Try) {
            let w = slot.waiters.pop_front().expect("BUG: front checked");
            self.actions.push_back(Action::Refuse { id: w.id, why });
        }
        if let Some(front) = slot.waiters.front() {
            let interval = front.poll_interval;
            slot.next_try = next_tick(&mut self.ticks, &mut self.rng, interval, now);
        }
        self.forget_if_unused(key);
    }

    /// [`forget_if_unused`](Self::forget_if_unused) for every key.
    fn forget_unused(&mut self) {
        let (holds, unseen) = (&mut self.holds, &mut self.unseen_trusted);
        self.slots.retain(|key, slot| {
            let unused = slot.unused();
            if unused {
                if let Some(hold) = slot.hold_until {
                    holds.insert(*key, hold);
                }
                if let Some(at) = slot.trusted_unseen {
                    unseen.insert(*key, at);
                }
            }
            !unused
        });
    }

    fn forget_if_unused(&mut self, key: LockKey) {
        if self.slots.get(&key).is_some_and(Slot::unused)
            && let Some(slot) = self.slots.remove(&key)
        {
            if let Some(hold) = slot.hold_until {
                self.holds.insert(key, hold);
            }
            if let Some(at) = slot.trusted_unseen {
                self.unseen_trusted.insert(key, at);
            }
        }
    }
}

/// Does `evidence` prove that the last holder seen released the key (so that a win
/// skips the takeover grace)? `check_sessions`: unless [`Protection::SessionCheck`] is
/// switched off (tests only).
/// Whether a win answered at `now` may skip the grace on `evidence`'s announcement: it
/// came from the holder's session (`confirmed`, when sessions are checked), at most
/// `within` (the takeover grace) before.
fn verified(evidence: &Evidence, check_sessions: bool, now: Instant, within: Duration) -> bool {
    evidence.announced
        && (evidence.confirmed || !check_sessions)
        && evidence
            .announced_at
            .is_some_and(|at| now.saturating_duration_since(at) <= within)
}

/// The next shared tick for `interval`: the one already planned if it lies ahead
/// (within one jittered interval), else a new one, one jittered interval from now.
/// Ticks that passed are forgotten, so the map is bounded by the intervals in use.
fn next_tick(
    ticks: &mut HashMap<Duration, Instant>,
    rng: &mut u64,
    interval: Duration,
    now: Instant,
) -> Instant {
    if let Some(at) = ticks.get(&interval)
        && *at > now
        && *at <= now + interval + interval / 10
    {
        return *at;
    }
    ticks.retain(|_, at| *at > now);
    let at = now + jitter(rng, interval);
    ticks.insert(interval, at);
    at
}

/// A holder that leaves while its token read is pending is answered without one.
fn unanswered_read(actions: &mut VecDeque<Action>, key: LockKey, holder: &Holder) {
    if holder.reading != Reading::No {
        actions.push_back(Action::Token {
            id: holder.id,
            key,
            token: None,
        });
    }
}

pub(crate) fn next_random(state: &mut u64) -> u64 {
    // xorshift64*: enough to spread polls and backoffs, no dependency.
    let mut x = *state;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *state = x;
    x.wrapping_mul(0x2545_F491_4F6C_DD1D)
}

pub(crate) fn jitter_below(state: &mut u64, max: Duration) -> Duration {
    let nanos = u64::try_from(max.as_nanos()).unwrap_or(u64::MAX);
    if nanos == 0 {
        return Duration::ZERO;
    }
    Duration::from_nanos(next_random(state) % nanos)
}

/// `interval` ± 10 %.
fn jitter(state: &mut u64, interval: Duration) -> Duration {
    interval - interval / 10 + jitter_below(state, interval / 5)
}

#[cfg(test)]
mod tests;
