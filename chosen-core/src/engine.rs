//! The lock session's rules without I/O, in the quinn-proto style: the lock table plus
//! everything the task used to decide around it. Inputs carry their `Instant`; outputs
//! are plans of statements, actions (grants, answers, metrics) and the next wake-up.
//! The task ([`task`](crate::task)) carries them out against PostgreSQL, and the
//! simulation against a simulated server: both run this code.
//!
//! The rules kept here, beyond the table's own:
//!
//! 1. **The validity gate.** A session whose validity deadline has passed (the task was
//!    frozen or starved past it) plans nothing, and the answers to statements that
//!    come back after it are not applied: the session ends instead. The server may
//!    have ended it and given its keys away meanwhile.
//! 2. **One order of results.** A plan's answers are fed to the table in one order
//!    (unlocks, fences, fence checks, the hand-off token, interest, the tries), and a
//!    full server lock table counts as contention, not as a failure of the request.
//! 3. **The term hold.** A server whose term as primary (start, crash restart,
//!    promotion) began less than `term_grant_delay` ago grants nothing before that much
//!    time has passed since it began: a holder of the previous term that went silent
//!    may still trust its lease. The server tells the age with its wall clock; a
//!    process that saw its session of the previous term end also counts the delay from
//!    that end on its own monotonic clock, and the later of the two holds: when that end
//!    was the old term's end (a process connected when the server restarted or failed
//!    over), a forward step of the server's clock cannot shorten its hold; otherwise the
//!    server's measure stands, which tolerates a step of `safety_margin`.
//! 4. **The token floor.** A new session whose first token is not above every token
//!    answered to this manager (in a plan's answers, also answers that came too late to
//!    be applied), or that is another cluster whose tokens would not order after the
//!    old one's, is refused: tokens never go backwards. A token of a step whose session
//!    was lost before it answered never reached anyone (its locks ended with the
//!    session) and does not count.
//! 5. **Reconnect backoff.** Doubling from `reconnect_min` to `reconnect_max`, each wait
//!    drawn from its upper half, so a fleet does not reconnect in step.
//! 6. **A lost session is closed last.** A session this node gave up on (its validity
//!    deadline passed, a heartbeat failed) may still be alive at the server, holding
//!    its keys. Closing it frees them: a node that takes one over then checks the stop
//!    fence of the work still stopping here, which only the *next* session can hold. So
//!    the lost session stays open until every lease it had is fenced on the next one
//!    (or `max_fence_wait` has passed, when that work is over or aborted): the fence is
//!    in place before the key is free, however long the reconnect takes. The server's
//!    `idle_session_timeout` ends it anyway by `server_release_after`, which the timing
//!    invariant puts after `max_fence_wait`.
//! 7. **The shutdown sequence.** Every lease stops being trusted first; then the task
//!    waits, at most `stop_budget`, for the leases' owners to drop them (a singleton
//!    drops its lease once its child has stopped), unlocking and announcing each as it
//!    comes back; then it unlocks the rest, unannounced (their work may not have
//!    stopped). The session then stays connected until the takeover grace has passed
//!    since its last announcement: a waiter that heard one skips the grace only if its
//!    next try finds this session alive. A statement that fails ends the sequence (the
//!    locks end with the session). Shut down while disconnected, the lost sessions kept
//!    open (rule 6) close once the work under their leases has stopped, or at their
//!    deadline, at most `stop_budget` from the shutdown.
//! 8. **Nothing is granted once the handle closes.** A shutdown begun by the handle
//!    (every supervisor told to stop) while a statement was in flight may find a key won
//!    in its answers: that grant is answered `Closed`, and the key unlocked quietly
//!    (nothing ran under it).

use std::time::{Duration, Instant};

use crate::key::LockKey;
use crate::table::{
    Action, FenceCheck, LockTable, Plan, Protection, Rules, TryOutcome, jitter_below,
};
use crate::token::FencingToken;

/// At most this many lost sessions are kept open at once (rule 6): a node whose new
/// sessions keep failing must not pile up connections on a server that is struggling.
pub(crate) const MAX_KEPT_OPEN: usize = 2;

/// The options the engine's own rules need (the table's are [`Rules`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Timing {
    /// See [`ManagerOptions::term_grant_delay`](crate::ManagerOptions::term_grant_delay);
    /// zero turns the term hold off.
    pub(crate) term_grant_delay: Duration,
    pub(crate) reconnect_min: Duration,
    pub(crate) reconnect_max: Duration,
    /// How long a shutdown waits for the leases' owners to drop them (rule 7).
    pub(crate) stop_budget: Duration,
    /// How long past the stop budget a closing statement may take before the session
    /// is closed without its answer (the locks go with the session then).
    pub(crate) statement_slack: Duration,
    /// How long a closing session stays connected after announcing its releases
    /// (rule 7): the takeover grace a waiter that heard them skips.
    pub(crate) linger: Duration,
}

/// What the task does next while shutting down (rule 7): see
/// [`Engine::close_next`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CloseNext {
    /// Run a step; its statements may take until `deadline`, then the session is closed
    /// without their answers.
    Step { deadline: Instant },
    /// Wait for a command (an owner dropping its lease) until `until`.
    Wait { until: Instant },
    /// Stay connected, sending nothing, until `until`.
    Linger { until: Instant },
    /// Reset the session's settings; the statement may take until `deadline`.
    Reset { deadline: Instant },
    /// Done: close the connection (and the lost sessions kept open).
    Done,
}

/// Where a shutdown is (rule 7).
#[derive(Clone, Copy, Debug)]
struct Shutdown {
    /// The end of the stop budget.
    budget_end: Instant,
    /// Statements end by then at the latest.
    statement_deadline: Instant,
    phase: ClosePhase,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ClosePhase {
    /// Waiting for the owners to drop their leases; `stepped`: a step ran since the
    /// last wait.
    Draining {
        stepped: bool,
    },
    /// Unlocking the rest (one step).
    Unlocking,
    Lingering,
    Resetting,
    /// Disconnected: waiting for the work under the lost sessions kept open.
    Retiring {
        until: Instant,
    },
    Over,
}

/// What a new session found out about the server's current term as primary.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Term {
    /// The server's timeline plus the token epoch: the high bits of every token of
    /// this session.
    pub(crate) timeline: u16,
    /// How long before `read_at` the term began; `None` when unknown.
    pub(crate) age: Option<Duration>,
    /// Tells terms apart when the age is unknown.
    pub(crate) identity: String,
    /// The smallest token this session can issue.
    pub(crate) first_token: FencingToken,
    /// The cluster's system identifier.
    pub(crate) system_id: String,
    /// When the answer arrived (so the age is at least this old then).
    pub(crate) read_at: Instant,
}

/// The answers to one [`Plan`]'s statements, the session being fine. A statement
/// whose failure ends the session is not here: the backend ends the session instead.
#[derive(Clone, Debug)]
pub(crate) struct Done {
    /// The hand-off token, `None` when it could not be had (the keys are released).
    pub(crate) token: Option<FencingToken>,
    /// The try statement's answers, or how it failed.
    pub(crate) tried: Result<Vec<(LockKey, TryOutcome)>, TryFailed>,
    /// Keys whose bucket's interest key the try statement took.
    pub(crate) registered: Vec<LockKey>,
    /// Keys won after the try statement's first try of them found them held.
    pub(crate) seen_held: Vec<LockKey>,
    /// Keys of [`Plan::verify`] won, with the start of the backend that has the
    /// announcer's pid now (see `LockTable::senders`).
    pub(crate) senders: Vec<(LockKey, Option<i64>)>,
    /// Stop fences taken (`true`) or not.
    pub(crate) fenced: Vec<(LockKey, bool)>,
    /// Stop-fence checks.
    pub(crate) checked: Vec<(LockKey, FenceCheck)>,
}

impl Default for Done {
    fn default() -> Self {
        Self {
            token: None,
            tried: Ok(Vec::new()),
            registered: Vec::new(),
            seen_held: Vec::new(),
            senders: Vec::new(),
            fenced: Vec::new(),
            checked: Vec::new(),
        }
    }
}

/// How a try statement failed, the session being fine (no key of it is held).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TryFailed {
    /// The server's lock table is full (SQLSTATE 53200): contention, not a failure.
    LockTableFull,
    /// Any other failure (cancelled, timed out, refused): the requests that asked
    /// once are answered with it, the waiting ones tried again.
    Failed,
}

/// The session can no longer be trusted: its validity deadline passed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Overdue;

/// Why a new session was refused before it was used.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Refused {
    /// Its tokens would start at `first`, not above `issued`.
    TokensBackwards { first: u64, issued: u64 },
    /// The same cluster, on high bits (`timeline`) below those of a term used before
    /// (`seen`).
    LowerTerm { timeline: u16, seen: u16 },
    /// Another cluster (`system_id`, was `was`) whose high bits (`timeline`) are not
    /// above those of the tokens issued before (`issued_high`).
    OtherCluster {
        system_id: String,
        was: String,
        timeline: u16,
        issued_high: u64,
    },
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::TokensBackwards { first, issued } => write!(
                f,
                "this server would issue fencing tokens from {first} on, not above {issued} that this manager already issued: tokens would go backwards (a cluster started again on timeline 1 by pg_upgrade, a logical cutover or a restore, or a collided timeline); set chosen.token_epoch on the new cluster (ALTER DATABASE ... SET chosen.token_epoch = N) above the old cluster's last timeline plus its epoch"
            ),
            Self::LowerTerm { timeline, seen } => write!(
                f,
                "the server's timeline plus token epoch, {timeline}, is below the {seen} of a term this manager used before: tokens could go backwards (chosen.token_epoch was lowered or removed, or two standbys were promoted onto one timeline); restore chosen.token_epoch (never lower it) or promote onto a new timeline"
            ),
            Self::OtherCluster {
                system_id,
                was,
                timeline,
                issued_high,
            } => write!(
                f,
                "the server is another cluster (system identifier {system_id}, was {was}) whose timeline plus token epoch, {timeline}, is not above the {issued_high} of the tokens issued or terms seen before: tokens would not order after the old cluster's; set chosen.token_epoch on the new cluster (ALTER DATABASE ... SET chosen.token_epoch = N) so that its timeline plus N is above {issued_high}"
            ),
        }
    }
}

/// The lock table and the session rules around it. See the module docs.
#[derive(Debug)]
pub(crate) struct Engine {
    table: LockTable,
    timing: Timing,
    /// A server term whose start the server could not tell, and when this process
    /// first saw it.
    term_first_seen: Option<(String, Instant)>,
    /// The term of the last session, and when this process saw that session end: a
    /// term that began since began after the previous one ended, which was no later
    /// than that (when the end was the term's).
    last_term: Option<String>,
    last_end: Option<Instant>,
    /// The term whose start this process saw, and the end of its hold by this
    /// process's clock.
    term_own_clock: Option<(String, Instant)>,
    /// The highest token a session of this manager was issued.
    issued: u64,
    /// The system identifier of the cluster the last session was on.
    last_system: Option<String>,
    /// The highest high bits (timeline plus epoch) of any session this process used.
    seen_high: u16,
    /// The next reconnect wait's upper bound.
    backoff: Duration,
    /// Lost sessions kept open (rule 6), oldest first: until when at most.
    retiring: std::collections::VecDeque<Instant>,
    max_fence_wait: Duration,
    /// The shutdown under way, if one is (rule 7).
    shutdown: Option<Shutdown>,
    /// When the last step that announced releases on this session was answered (rule 7's
    /// linger counts from there).
    last_announced: Option<Instant>,
    rng: u64,
}

impl Engine {
    pub(crate) fn new(rules: Rules, timing: Timing, seed: u64) -> Self {
        Self {
            table: LockTable::new(rules, seed),
            timing,
            term_first_seen: None,
            last_term: None,
            last_end: None,
            term_own_clock: None,
            issued: 0,
            last_system: None,
            seen_high: 0,
            backoff: timing.reconnect_min,
            retiring: std::collections::VecDeque::new(),
            max_fence_wait: rules.max_fence_wait,
            shutdown: None,
            last_announced: None,
            rng: seed.rotate_left(17) | 1,
        }
    }

    /// Switches a protection off (the engine's or the table's), to show that the
    /// simulation fails without it. The table keeps the switches for both.
    #[cfg(test)]
    pub(crate) fn switch_off(&mut self, protection: Protection) {
        self.table.switch_off(protection);
    }

    /// Is this protection switched off? Never outside tests.
    fn off(&self, protection: Protection) -> bool {
        self.table.off(protection)
    }

    /// The lock table, for what the handles ask (requests, releases, snapshots).
    pub(crate) fn table(&self) -> &LockTable {
        &self.table
    }

    /// The lock table, for what the handles ask (requests, releases, withdrawals).
    pub(crate) fn table_mut(&mut self) -> &mut LockTable {
        &mut self.table
    }

    /// The next thing the task must do, if any. `handle_closing`: the manager's handle
    /// began a shutdown, whose commands the task reads only between steps; a grant that
    /// comes of a statement in flight then is not delivered (rule 8).
    pub(crate) fn poll_action(&mut self, now: Instant, handle_closing: bool) -> Option<Action> {
        let action = self.table.poll_action()?;
        match action {
            Action::Grant { id, key, .. }
                if handle_closing && !self.off(Protection::HandleClosing) =>
            {
                // Nothing ran under it: the key is unlocked quietly.
                self.table.undelivered(key, id, now);
                Some(Action::Refuse {
                    id,
                    why: crate::table::Refusal::Closed,
                })
            }
            action => Some(action),
        }
    }

    // ---- the session's life ---------------------------------------------------------

    /// A new session was opened and proven, on a server in `term`: may it be used?
    /// Refused when its tokens could go backwards (rule 4).
    pub(crate) fn check_session(&self, term: &Term) -> Result<(), Refused> {
        if self.off(Protection::TokenFloor) {
            return Ok(());
        }
        if term.first_token.get() <= self.issued {
            return Err(Refused::TokensBackwards {
                first: term.first_token.get(),
                issued: self.issued,
            });
        }
        // Another cluster altogether (pg_upgrade, a restore, a logical copy: a new system
        // identifier): its transaction ids tell nothing about the old cluster's, and
        // other nodes may have issued tokens there above this one's, with the high bits
        // of any term this process saw there (a promotion raised them, whether or not
        // this process won anything since), so only higher high bits (timeline plus
        // epoch) order its tokens after the old cluster's.
        let old_high = (self.issued >> 48).max(u64::from(self.seen_high));
        // The same cluster with lower high bits than a term this process used: the
        // token epoch was lowered or removed, or two standbys were promoted onto one
        // timeline. Its tokens could come out below ones issued before.
        if self.last_system.as_deref() == Some(term.system_id.as_str())
            && term.timeline < self.seen_high
        {
            return Err(Refused::LowerTerm {
                timeline: term.timeline,
                seen: self.seen_high,
            });
        }
        if let Some(was) = &self.last_system
            && *was != term.system_id
            && u64::from(term.timeline) <= old_high
        {
            return Err(Refused::OtherCluster {
                system_id: term.system_id.clone(),
                was: was.clone(),
                timeline: term.timeline,
                issued_high: old_high,
            });
        }
        Ok(())
    }

    /// The session checked by [`check_session`](Self::check_session) is up as
    /// `generation`. Returns how long grants are held for the server's young term
    /// (rule 3), if they are.
    pub(crate) fn session_started(
        &mut self,
        generation: u64,
        term: &Term,
        now: Instant,
    ) -> Option<Duration> {
        self.backoff = self.timing.reconnect_min;
        self.last_system = Some(term.system_id.clone());
        self.seen_high = self.seen_high.max(term.timeline);
        self.table.session_started(generation, now);
        let delay = self.timing.term_grant_delay;
        if delay.is_zero() || self.off(Protection::TermHold) {
            return None;
        }
        let server_says = match term.age {
            Some(age) => term.read_at + delay.saturating_sub(age),
            None => {
                // Promoted, and the server cannot tell when yet: the term began before
                // this process first saw it.
                let first = match &self.term_first_seen {
                    Some((identity, at)) if *identity == term.identity => *at,
                    _ => term.read_at,
                };
                self.term_first_seen = Some((term.identity.clone(), first));
                first + delay
            }
        };
        // The server measures the age with its wall clock, which may have stepped
        // forward since the term began (NTP, a VM resumed), making the term look older.
        // A process whose last session was of another term, and which saw that session
        // end, measures on its own monotonic clock as well: the old term had ended by
        // then at the latest (when that end was the term's end), so the delay counts
        // from there too. The later of the two holds.
        // Kept for the term's later sessions (a reconnect within the hold).
        if let (Some(last), Some(end)) = (&self.last_term, self.last_end)
            && *last != term.identity
        {
            self.term_own_clock = Some((term.identity.clone(), end + delay));
        }
        self.last_term = Some(term.identity.clone());
        let seen_here = match &self.term_own_clock {
            Some((identity, at))
                if *identity == term.identity && !self.off(Protection::TermOwnClock) =>
            {
                Some(*at)
            }
            _ => None,
        };
        let not_before = seen_here.map_or(server_says, |own| own.max(server_says));
        (not_before > now).then(|| {
            self.table.hold_grants_until(not_before);
            not_before - now
        })
    }

    /// The session ended (lost, or closed at shutdown): every lease of it is lost.
    pub(crate) fn session_ended(&mut self, now: Instant) {
        self.last_end = Some(now);
        self.last_announced = None;
        self.table.session_ended(now);
    }

    /// The session was lost: every lease of it is lost. It is kept open while rule 6
    /// says so, if it may be (`may_keep`: it may still hold its keys at the server) and
    /// fewer than [`MAX_KEPT_OPEN`] are: returns until when at most.
    /// [`close_retired`](Self::close_retired) tells when to close it sooner.
    pub(crate) fn session_lost(&mut self, now: Instant, may_keep: bool) -> Option<Instant> {
        self.last_end = Some(now);
        self.last_announced = None;
        self.table.session_ended(now);
        let keep =
            may_keep && self.retiring.len() < MAX_KEPT_OPEN && !self.off(Protection::KeepLostOpen);
        keep.then(|| {
            let until = now + self.max_fence_wait;
            self.retiring.push_back(until);
            until
        })
    }

    /// How many of the lost sessions kept open (oldest first) may be closed now: all of
    /// them once this session holds every stop fence, else those whose time is up.
    pub(crate) fn close_retired(&mut self, now: Instant) -> usize {
        let fenced = self.table.connected() && !self.table.fences_pending();
        let n = if fenced {
            self.retiring.len()
        } else {
            self.retiring
                .iter()
                .take_while(|until| **until <= now)
                .count()
        };
        self.retiring.drain(..n);
        n
    }

    /// When the last of the lost sessions kept open is to be closed at the latest.
    pub(crate) fn retired_until(&self) -> Option<Instant> {
        self.retiring.back().copied()
    }

    /// A connect attempt failed: how long to wait before the next (rule 5).
    pub(crate) fn connect_failed(&mut self) -> Duration {
        let delay = self.backoff;
        self.backoff = delay.saturating_mul(2).min(self.timing.reconnect_max);
        delay / 2 + jitter_below(&mut self.rng, delay / 2)
    }

    // ---- the shutdown (rule 7) --------------------------------------------------------

    /// A shutdown begins: every waiting request is refused `Closed`, and nothing is
    /// granted any more. [`close_next`](Self::close_next) says what to do then. The
    /// task has stopped trusting every lease before (the shared validity).
    pub(crate) fn begin_shutdown(&mut self, now: Instant) {
        if self.shutdown.is_some() {
            return;
        }
        let budget_end = now + self.timing.stop_budget;
        let phase = if self.table.connected() {
            ClosePhase::Draining { stepped: false }
        } else {
            // The lost sessions kept open hold keys under which work may still run:
            // closing them frees those keys.
            let until = self
                .retired_until()
                .map_or(now, |until| until.min(budget_end));
            ClosePhase::Retiring { until }
        };
        self.shutdown = Some(Shutdown {
            budget_end,
            statement_deadline: budget_end + self.timing.statement_slack,
            phase,
        });
        self.table.begin_close();
    }

    /// What to do next while shutting down (nothing but [`CloseNext::Done`] before
    /// [`begin_shutdown`](Self::begin_shutdown)). Call it again after each thing done;
    /// a command (a lease dropped) ends a [`CloseNext::Wait`] early.
    pub(crate) fn close_next(&mut self, now: Instant) -> CloseNext {
        let Some(mut sd) = self.shutdown else {
            return CloseNext::Done;
        };
        let next = loop {
            match sd.phase {
                ClosePhase::Draining { stepped } => {
                    if self.table.held() == 0 || now >= sd.budget_end {
                        let held = self.table.held();
                        if held > 0 {
                            tracing::warn!(
                                leases = held,
                                budget = ?self.timing.stop_budget,
                                "leases still held at shutdown after the stop budget; releasing them anyway"
                            );
                        }
                        self.table.close_now();
                        sd.phase = ClosePhase::Unlocking;
                        continue;
                    }
                    if stepped {
                        sd.phase = ClosePhase::Draining { stepped: false };
                        break CloseNext::Wait {
                            until: sd.budget_end,
                        };
                    }
                    sd.phase = ClosePhase::Draining { stepped: true };
                    break CloseNext::Step {
                        deadline: sd.statement_deadline,
                    };
                }
                ClosePhase::Unlocking => {
                    sd.phase = ClosePhase::Lingering;
                    break CloseNext::Step {
                        deadline: sd.statement_deadline,
                    };
                }
                ClosePhase::Lingering => {
                    sd.phase = ClosePhase::Resetting;
                    let until = self.last_announced.map(|at| at + self.timing.linger);
                    if let Some(until) = until.filter(|until| *until > now) {
                        break CloseNext::Linger { until };
                    }
                }
                ClosePhase::Resetting => {
                    sd.phase = ClosePhase::Over;
                    break CloseNext::Reset {
                        deadline: sd.statement_deadline,
                    };
                }
                ClosePhase::Retiring { until } => {
                    if self.table.held() == 0 || now >= until {
                        sd.phase = ClosePhase::Over;
                        continue;
                    }
                    break CloseNext::Wait { until };
                }
                ClosePhase::Over => {
                    self.table.close_now();
                    if self.table.connected() {
                        self.session_ended(now);
                    }
                    self.retiring.clear();
                    break CloseNext::Done;
                }
            }
        };
        self.shutdown = Some(sd);
        next
    }

    /// A statement of the shutdown failed: the session is gone, and its locks with it.
    /// Nothing more is sent; the next [`close_next`](Self::close_next) is
    /// [`CloseNext::Done`].
    pub(crate) fn close_failed(&mut self) {
        if let Some(sd) = &mut self.shutdown {
            sd.phase = ClosePhase::Over;
        }
    }

    // ---- steps ----------------------------------------------------------------------

    /// The statements of the next step (grants whose grace has passed are made first).
    /// `valid`: the session's validity deadline has not passed; `false` ends it (rule 1),
    /// except while it closes (`closing`), when validity was given up on purpose.
    pub(crate) fn plan(
        &mut self,
        now: Instant,
        valid: bool,
        closing: bool,
    ) -> Result<Plan, Overdue> {
        let valid = valid || self.off(Protection::ValidityGate);
        if !valid && !closing {
            return Err(Overdue);
        }
        Ok(self.table.plan(now))
    }

    /// The answers to `plan`'s statements (rule 2). Tokens count for the floor even
    /// when the answers come too late to be applied (rule 1).
    pub(crate) fn done(
        &mut self,
        plan: &Plan,
        done: &Done,
        valid: bool,
        closing: bool,
        now: Instant,
    ) -> Result<(), Overdue> {
        let tokens = done
            .token
            .into_iter()
            .chain(
                done.tried
                    .iter()
                    .flatten()
                    .filter_map(|(_, outcome)| match outcome {
                        TryOutcome::Won(token) | TryOutcome::WonFenced { token, .. } => *token,
                        TryOutcome::Held { .. } | TryOutcome::Failed => None,
                    }),
            );
        for token in tokens {
            self.issued = self.issued.max(token.get());
        }
        let valid = valid || self.off(Protection::ValidityGate);
        if !valid && !closing {
            return Err(Overdue);
        }
        // The announcements went out at the commit, just before this answer.
        if !plan.unlock.is_empty() || !plan.unfence.is_empty() {
            self.last_announced = Some(now);
        }
        let table = &mut self.table;
        table.unlocked(&plan.unlock, now);
        table.unlocked(&plan.unlock_quiet, now);
        table.unfenced(&plan.unfence, now);
        table.fenced(&done.fenced, now);
        table.checked(&done.checked, now);
        table.tokens(&plan.token_for, &plan.token_read, done.token, now);
        table.registered(&done.registered);
        table.seen_held(&done.seen_held);
        table.senders(&done.senders);
        match &done.tried {
            Ok(outcomes) => table.tried(outcomes, now),
            Err(failed) => {
                let outcome = match failed {
                    TryFailed::LockTableFull => TryOutcome::Held { by: None },
                    TryFailed::Failed => TryOutcome::Failed,
                };
                let outcomes: Vec<(LockKey, TryOutcome)> =
                    plan.try_keys.iter().map(|k| (*k, outcome)).collect();
                table.tried(&outcomes, now);
            }
        }
        Ok(())
    }

    /// The next instant something is due, if any.
    pub(crate) fn next_wakeup(&self, now: Instant) -> Option<Instant> {
        self.table.next_wakeup(now)
    }

    /// The locks the session holds for certain, for the heartbeat's pooler guard.
    pub(crate) fn server_floor(&self) -> Vec<crate::key::SessionLock> {
        self.table.server_floor()
    }

    /// Has a session of this manager been up (so it knows a cluster)?
    #[cfg(test)]
    pub(crate) fn knows_a_cluster(&self) -> bool {
        self.last_system.is_some()
    }

    /// The highest token issued to this manager so far.
    #[cfg(test)]
    pub(crate) fn issued(&self) -> u64 {
        self.issued
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn engine() -> Engine {
        Engine::new(
            Rules {
                node: 0,
                max_locks: 100,
                takeover_grace: Duration::from_millis(100),
                max_fence_wait: Duration::from_secs(6),
            },
            Timing {
                term_grant_delay: Duration::from_secs(6),
                reconnect_min: Duration::from_millis(100),
                reconnect_max: Duration::from_secs(5),
                stop_budget: Duration::from_secs(5),
                statement_slack: Duration::from_secs(10),
                linger: Duration::from_millis(200),
            },
            7,
        )
    }

    fn term(system: &str, timeline: u16, xid: u64, age: Option<Duration>, at: Instant) -> Term {
        Term {
            timeline,
            age,
            identity: format!("{timeline}/{system}"),
            first_token: FencingToken::from_parts(timeline, xid),
            system_id: system.to_owned(),
            read_at: at,
        }
    }

    #[test]
    fn a_session_whose_tokens_would_go_backwards_is_refused() {
        let mut e = engine();
        let now = Instant::now();
        let old = term("a", 1, 1_000, Some(Duration::from_secs(60)), now);
        e.check_session(&old).unwrap();
        e.session_started(1, &old, now);
        let plan = e.plan(now, true, false).unwrap();
        let done = Done {
            tried: Ok(Vec::new()),
            token: Some(FencingToken::from_parts(1, 5_000)),
            ..Done::default()
        };
        e.done(&plan, &done, true, false, now).unwrap();
        e.session_ended(now);
        // The same cluster, restored to before token 5,000.
        let restored = term("a", 1, 4_000, Some(Duration::from_secs(60)), now);
        assert!(matches!(
            e.check_session(&restored),
            Err(Refused::TokensBackwards { .. })
        ));
        // Another cluster whose timeline is not above the tokens' high bits.
        let other = term("b", 1, 9_000, Some(Duration::from_secs(60)), now);
        assert!(matches!(
            e.check_session(&other),
            Err(Refused::OtherCluster { .. })
        ));
        // Another cluster on a higher timeline (plus epoch): fine.
        let raised = term("b", 2, 10, Some(Duration::from_secs(60)), now);
        e.check_session(&raised).unwrap();
    }

    #[test]
    fn a_cluster_is_refused_below_the_high_bits_of_a_term_this_process_used() {
        let mut e = engine();
        let now = Instant::now();
        // Promoted to timeline 3 (tokens would carry 3) without this process winning.
        let promoted = term("a", 3, 1_000, Some(Duration::from_secs(60)), now);
        e.check_session(&promoted).unwrap();
        e.session_started(1, &promoted, now);
        e.session_ended(now);
        // The same cluster with the epoch lowered, or a collided timeline: refused.
        let lowered = term("a", 2, 2_000, Some(Duration::from_secs(60)), now);
        assert!(matches!(
            e.check_session(&lowered),
            Err(Refused::LowerTerm {
                timeline: 2,
                seen: 3
            })
        ));
        // Another cluster whose high bits are not above the 3 this process saw, although
        // it never won a token there: refused; above it: fine.
        let moved = term("b", 3, 10, Some(Duration::from_secs(60)), now);
        assert!(matches!(
            e.check_session(&moved),
            Err(Refused::OtherCluster { issued_high: 3, .. })
        ));
        e.check_session(&term("b", 4, 10, Some(Duration::from_secs(60)), now))
            .unwrap();
    }

    /// A session up on a server of an old term, holding key 1 for request 1.
    fn holding(now: Instant) -> Engine {
        let mut e = engine();
        let t = term("a", 1, 1_000, Some(Duration::from_secs(60)), now);
        e.session_started(1, &t, now);
        e.table_mut().acquire(
            crate::table::Request {
                id: 1,
                key: LockKey::Int(1),
                name: std::sync::Arc::from("one"),
                poll_interval: Duration::from_secs(1),
                mode: crate::table::Mode::Try,
                since: std::time::SystemTime::UNIX_EPOCH,
                enqueued: now,
                eager_token: true,
            },
            now,
        );
        let plan = e.plan(now, true, false).unwrap();
        assert_eq!(plan.try_keys, vec![LockKey::Int(1)]);
        let done = Done {
            tried: Ok(vec![(
                LockKey::Int(1),
                TryOutcome::Won(Some(FencingToken::from_parts(1, 2_000))),
            )]),
            ..Done::default()
        };
        e.done(&plan, &done, true, false, now).unwrap();
        assert!(
            std::iter::from_fn(|| e.poll_action(now, false))
                .any(|a| matches!(a, Action::Grant { .. }))
        );
        assert_eq!(e.table().held(), 1);
        e
    }

    #[test]
    fn a_grant_answered_once_the_handle_closes_is_refused_and_unlocked_quietly() {
        let now = Instant::now();
        let mut e = engine();
        let t = term("a", 1, 1_000, Some(Duration::from_secs(60)), now);
        e.session_started(1, &t, now);
        e.table_mut().acquire(
            crate::table::Request {
                id: 1,
                key: LockKey::Int(1),
                name: std::sync::Arc::from("one"),
                poll_interval: Duration::from_secs(1),
                mode: crate::table::Mode::Try,
                since: std::time::SystemTime::UNIX_EPOCH,
                enqueued: now,
                eager_token: true,
            },
            now,
        );
        let plan = e.plan(now, true, false).unwrap();
        let done = Done {
            tried: Ok(vec![(
                LockKey::Int(1),
                TryOutcome::Won(Some(FencingToken::from_parts(1, 2_000))),
            )]),
            ..Done::default()
        };
        e.done(&plan, &done, true, false, now).unwrap();
        // The handle began a shutdown while the try was in flight.
        let actions: Vec<Action> = std::iter::from_fn(|| e.poll_action(now, true)).collect();
        assert!(
            matches!(
                actions.as_slice(),
                [Action::Refuse {
                    id: 1,
                    why: crate::table::Refusal::Closed
                }]
            ),
            "{actions:?}"
        );
        assert_eq!(e.table().held(), 0);
        let plan = e.plan(now, true, false).unwrap();
        assert_eq!(plan.unlock_quiet, vec![LockKey::Int(1)], "{plan:?}");
        assert!(plan.unlock.is_empty(), "announced: {plan:?}");
    }

    /// Carries out one closing step: plans it and answers every statement as done.
    fn closing_step(e: &mut Engine, now: Instant) -> Plan {
        let plan = e.plan(now, false, true).unwrap();
        e.done(&plan, &Done::default(), false, true, now).unwrap();
        plan
    }

    #[test]
    fn a_shutdown_waits_for_the_lease_then_unlocks_announces_and_lingers() {
        let start = Instant::now();
        let mut e = holding(start);
        e.begin_shutdown(start);
        let deadline = start + Duration::from_secs(15);
        // Nothing to send while the lease is out: a step, then a wait for its owner.
        assert_eq!(e.close_next(start), CloseNext::Step { deadline });
        assert!(closing_step(&mut e, start).is_empty());
        let budget_end = start + Duration::from_secs(5);
        assert_eq!(e.close_next(start), CloseNext::Wait { until: budget_end });
        // The owner drops it: the final step unlocks it, announced.
        let t = start + Duration::from_secs(1);
        e.table_mut().release_to(LockKey::Int(1), 1, None, t);
        assert_eq!(e.close_next(t), CloseNext::Step { deadline });
        let plan = closing_step(&mut e, t);
        assert_eq!(plan.unlock.len(), 1, "{plan:?}");
        assert_eq!(e.table().held(), 0);
        // Then the linger for the grace, the reset, and done.
        assert_eq!(
            e.close_next(t),
            CloseNext::Linger {
                until: t + Duration::from_millis(200)
            }
        );
        let t = t + Duration::from_millis(200);
        assert_eq!(e.close_next(t), CloseNext::Reset { deadline });
        assert_eq!(e.close_next(t), CloseNext::Done);
        assert!(!e.table().connected());
        assert_eq!(e.close_next(t), CloseNext::Done);
    }

    #[test]
    fn a_shutdown_past_its_budget_unlocks_without_announcing_or_lingering() {
        let start = Instant::now();
        let mut e = holding(start);
        e.begin_shutdown(start);
        let deadline = start + Duration::from_secs(15);
        assert_eq!(e.close_next(start), CloseNext::Step { deadline });
        closing_step(&mut e, start);
        let late = start + Duration::from_secs(5);
        assert_eq!(e.close_next(late), CloseNext::Step { deadline });
        let plan = closing_step(&mut e, late);
        assert!(
            plan.unlock.is_empty() && plan.unlock_quiet.len() == 1,
            "{plan:?}"
        );
        // Nothing was announced (its work may still run): no waiter skips the grace on
        // this session's word, so it need not stay.
        assert!(matches!(e.close_next(late), CloseNext::Reset { .. }));
        assert_eq!(e.close_next(late), CloseNext::Done);
    }

    #[test]
    fn a_shutdown_lingers_a_grace_after_its_last_announcement_only() {
        // Released and announced before the shutdown began (a supervisor stopped its
        // child first): the session stays only what is left of the grace since.
        let start = Instant::now();
        let mut e = holding(start);
        e.table_mut().release_to(LockKey::Int(1), 1, None, start);
        let plan = e.plan(start, true, false).unwrap();
        assert_eq!(plan.unlock.len(), 1, "{plan:?}");
        e.done(&plan, &Done::default(), true, false, start).unwrap();
        let t = start + Duration::from_millis(150);
        e.begin_shutdown(t);
        assert!(matches!(e.close_next(t), CloseNext::Step { .. }));
        closing_step(&mut e, t);
        assert_eq!(
            e.close_next(t),
            CloseNext::Linger {
                until: start + Duration::from_millis(200)
            }
        );
        assert!(matches!(e.close_next(t), CloseNext::Reset { .. }));
        // Announced longer ago than the grace: no linger at all.
        let mut e = holding(start);
        e.table_mut().release_to(LockKey::Int(1), 1, None, start);
        let plan = e.plan(start, true, false).unwrap();
        e.done(&plan, &Done::default(), true, false, start).unwrap();
        let t = start + Duration::from_secs(1);
        e.begin_shutdown(t);
        assert!(matches!(e.close_next(t), CloseNext::Step { .. }));
        closing_step(&mut e, t);
        assert!(matches!(e.close_next(t), CloseNext::Reset { .. }));
    }

    #[test]
    fn a_failed_final_unlock_ends_the_shutdown_without_lingering_or_resetting() {
        let start = Instant::now();
        let mut e = holding(start);
        e.table_mut().release_to(LockKey::Int(1), 1, None, start);
        e.begin_shutdown(start);
        // The final step (it would announce the release) fails.
        assert!(matches!(e.close_next(start), CloseNext::Step { .. }));
        e.close_failed();
        assert_eq!(e.close_next(start), CloseNext::Done);
    }

    #[test]
    fn a_wait_ended_by_another_command_steps_again_and_waits_again() {
        let start = Instant::now();
        let mut e = holding(start);
        e.begin_shutdown(start);
        let budget_end = start + Duration::from_secs(5);
        assert!(matches!(e.close_next(start), CloseNext::Step { .. }));
        closing_step(&mut e, start);
        assert_eq!(e.close_next(start), CloseNext::Wait { until: budget_end });
        // A command that released nothing (a snapshot asked for): one more step, then
        // the same wait.
        let t = start + Duration::from_secs(1);
        assert!(matches!(e.close_next(t), CloseNext::Step { .. }));
        closing_step(&mut e, t);
        assert_eq!(e.close_next(t), CloseNext::Wait { until: budget_end });
    }

    #[test]
    fn a_failed_closing_statement_ends_the_shutdown_at_once() {
        let start = Instant::now();
        let mut e = holding(start);
        e.begin_shutdown(start);
        assert!(matches!(e.close_next(start), CloseNext::Step { .. }));
        e.close_failed();
        assert_eq!(e.close_next(start), CloseNext::Done);
        assert!(!e.table().connected());
        assert_eq!(e.table().held(), 0);
    }

    #[test]
    fn a_shutdown_with_nothing_held_sends_one_step_and_does_not_linger() {
        let start = Instant::now();
        let mut e = engine();
        let t = term("a", 1, 1_000, Some(Duration::from_secs(60)), start);
        e.session_started(1, &t, start);
        e.begin_shutdown(start);
        assert!(matches!(e.close_next(start), CloseNext::Step { .. }));
        closing_step(&mut e, start);
        assert!(matches!(e.close_next(start), CloseNext::Reset { .. }));
        assert_eq!(e.close_next(start), CloseNext::Done);
    }

    #[test]
    fn a_shutdown_while_disconnected_waits_for_the_work_under_the_kept_sessions() {
        let start = Instant::now();
        let mut e = holding(start);
        // Lost and kept open until the fence wait (6 s) at most.
        assert_eq!(
            e.session_lost(start, true),
            Some(start + Duration::from_secs(6))
        );
        assert_eq!(e.table().held(), 1, "the work under the lease is stopping");
        let t = start + Duration::from_secs(2);
        e.begin_shutdown(t);
        // At most the stop budget from the shutdown, and no later than the kept
        // session's deadline.
        let until = start + Duration::from_secs(6);
        assert_eq!(e.close_next(t), CloseNext::Wait { until });
        // The work stops: done.
        e.table_mut().release_to(LockKey::Int(1), 1, None, t);
        assert_eq!(e.close_next(t), CloseNext::Done);
        // The stop budget ends before the kept session's deadline: the wait ends with
        // it, and the work still stopping is given up on.
        let mut e = holding(start);
        e.session_lost(start, true);
        let t = start + Duration::from_millis(500);
        e.begin_shutdown(t);
        let until = t + Duration::from_secs(5);
        assert_eq!(e.close_next(t), CloseNext::Wait { until });
        assert_eq!(e.close_next(until), CloseNext::Done);
        // Never connected again, nothing kept: done at once.
        let mut idle = engine();
        idle.begin_shutdown(t);
        assert_eq!(idle.close_next(t), CloseNext::Done);
    }

    #[test]
    fn tokens_answered_too_late_still_raise_the_floor() {
        let mut e = engine();
        let now = Instant::now();
        let t = term("a", 1, 1_000, Some(Duration::from_secs(60)), now);
        e.session_started(1, &t, now);
        let plan = e.plan(now, true, false).unwrap();
        let done = Done {
            tried: Ok(vec![(
                LockKey::Int(1),
                TryOutcome::Won(Some(FencingToken::from_parts(1, 2_000))),
            )]),
            ..Done::default()
        };
        assert_eq!(e.done(&plan, &done, false, false, now), Err(Overdue));
        assert_eq!(e.issued(), FencingToken::from_parts(1, 2_000).get());
    }

    #[test]
    fn an_overdue_session_plans_nothing_unless_it_is_closing() {
        let mut e = engine();
        let now = Instant::now();
        assert_eq!(e.plan(now, false, false).err(), Some(Overdue));
        assert!(e.plan(now, false, true).is_ok());
    }

    #[test]
    fn a_young_term_holds_grants_until_its_delay_has_passed() {
        let mut e = engine();
        let now = Instant::now();
        let young = term("a", 1, 10, Some(Duration::from_secs(2)), now);
        assert_eq!(
            e.session_started(1, &young, now),
            Some(Duration::from_secs(4))
        );
        e.session_ended(now);
        let old = term("a", 1, 10, Some(Duration::from_secs(60)), now);
        assert_eq!(e.session_started(2, &old, now), None);
        // A term of unknown age counts from when this process first saw it.
        e.session_ended(now);
        let unknown = term("a", 2, 10, None, now);
        assert_eq!(
            e.session_started(3, &unknown, now),
            Some(Duration::from_secs(6))
        );
        e.session_ended(now);
        let later = now + Duration::from_secs(5);
        let again = Term {
            read_at: later,
            ..unknown
        };
        assert_eq!(
            e.session_started(4, &again, later),
            Some(Duration::from_secs(1))
        );
    }

    #[test]
    fn a_forward_step_of_the_servers_clock_cannot_shorten_the_hold_of_a_process_that_saw_the_old_term_end()
     {
        let mut e = engine();
        let start = Instant::now();
        let old = term("a", 1, 10, Some(Duration::from_secs(3_600)), start);
        assert_eq!(e.session_started(1, &old, start), None);
        // The server restarts: this process sees its session end.
        let ended = start + Duration::from_secs(10);
        e.session_lost(ended, false);
        // The new term says it is an hour old (its clock stepped forward after the
        // postmaster started): this process counts from the end it saw.
        let back = ended + Duration::from_secs(1);
        let stepped = Term {
            identity: "1/a/restarted".to_owned(),
            ..term("a", 1, 20, Some(Duration::from_secs(3_600)), back)
        };
        assert_eq!(
            e.session_started(2, &stepped, back),
            Some(Duration::from_secs(5))
        );
        // A reconnect within the same term keeps that hold.
        e.session_lost(back + Duration::from_secs(2), false);
        let again = back + Duration::from_secs(3);
        let same = Term {
            read_at: again,
            ..stepped.clone()
        };
        assert_eq!(
            e.session_started(3, &same, again),
            Some(Duration::from_secs(2))
        );
        // A process that never saw the old term has only the server's word.
        let mut fresh = engine();
        assert_eq!(fresh.session_started(1, &stepped, back), None);
    }

    #[test]
    fn a_refusal_says_what_to_set() {
        let backwards = Refused::TokensBackwards {
            first: 10,
            issued: 20,
        }
        .to_string();
        assert!(backwards.contains("from 10") && backwards.contains("above 20"));
        assert!(backwards.contains("chosen.token_epoch"), "{backwards}");
        let other = Refused::OtherCluster {
            system_id: "b".to_owned(),
            was: "a".to_owned(),
            timeline: 1,
            issued_high: 3,
        }
        .to_string();
        assert!(other.contains("identifier b, was a") && other.contains("above 3"));
        let lower = Refused::LowerTerm {
            timeline: 2,
            seen: 3,
        }
        .to_string();
        assert!(lower.contains("2") && lower.contains("3") && lower.contains("never lower"));
    }

    #[test]
    fn a_session_that_ends_ends_the_tables_generation_and_counts_for_the_next_terms_hold() {
        let mut e = engine();
        let now = Instant::now();
        let old = term("a", 1, 10, Some(Duration::from_secs(3_600)), now);
        e.session_started(1, &old, now);
        assert!(e.table().connected());
        let end = now + Duration::from_secs(1);
        e.session_ended(end);
        assert!(!e.table().connected());
        // The next term's hold counts from that end, on this process's clock.
        let new = Term {
            identity: "1/a/again".to_owned(),
            ..term("a", 1, 20, Some(Duration::from_secs(3_600)), end)
        };
        assert_eq!(
            e.session_started(2, &new, end),
            Some(Duration::from_secs(6))
        );
    }

    #[test]
    fn at_most_two_lost_sessions_are_kept_open_each_until_its_fence_deadline() {
        let mut e = engine();
        let now = Instant::now();
        let t = term("a", 1, 10, Some(Duration::from_secs(3_600)), now);
        let wait = Duration::from_secs(6);
        e.session_started(1, &t, now);
        assert_eq!(e.session_lost(now, true), Some(now + wait));
        assert_eq!(e.retired_until(), Some(now + wait));
        // Not one that may not be kept (its connection is closed, a pooler's).
        let later = now + Duration::from_secs(1);
        e.session_started(2, &t, later);
        assert_eq!(e.session_lost(later, false), None);
        e.session_started(3, &t, later);
        assert_eq!(e.session_lost(later, true), Some(later + wait));
        assert_eq!(e.retired_until(), Some(later + wait));
        // A third is not kept while two are.
        e.session_started(4, &t, later);
        assert_eq!(e.session_lost(later, true), None);
        // Disconnected, none is closed before its deadline, then the oldest.
        assert_eq!(e.close_retired(later), 0);
        assert_eq!(e.close_retired(now + wait), 1);
        assert_eq!(e.retired_until(), Some(later + wait));
        // Connected with no stop fence pending: every kept one may close at once.
        e.session_started(5, &t, later);
        assert_eq!(e.close_retired(later), 1);
        assert_eq!(e.retired_until(), None);
    }

    #[test]
    fn reconnect_waits_double_within_their_bounds_and_reset_on_success() {
        let mut e = engine();
        let mut bounds = Vec::new();
        for _ in 0..8 {
            let wait = e.connect_failed();
            bounds.push(wait);
        }
        assert!(bounds[0] >= Duration::from_millis(50) && bounds[0] <= Duration::from_millis(100));
        assert!(bounds[7] >= Duration::from_millis(2_500) && bounds[7] <= Duration::from_secs(5));
        let now = Instant::now();
        e.session_started(1, &term("a", 1, 10, None, now), now);
        let wait = e.connect_failed();
        assert!(wait <= Duration::from_millis(100), "{wait:?}");
    }
}
