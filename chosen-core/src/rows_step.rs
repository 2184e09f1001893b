//! The lease-row mode's steps without their SQL: what a plan asks of the rows, in the
//! order one batch runs it ([`Steps`]), what the batch answered ([`Answer`]), and what
//! that means for the engine ([`interpret`]). The PostgreSQL backend (`rows`) builds
//! its batch from the steps and parses the server's rows into an answer; the simulated
//! server answers the same steps from its model of the tables, so the simulations run
//! the same rules of interpretation the real mode does.

use crate::engine::Done;
use crate::fault::Fault;
use crate::key::LockKey;
use crate::status::SessionDownReason;
use crate::table::{Backend as Holder, FenceCheck, Plan, TryOutcome};
use crate::token::FencingToken;

/// What one plan asks of the lease rows, in the order the batch runs it: the try first
/// (the one statement that waits for rows others hold), then the releases and the
/// token draw (which skip a row another statement holds), then the tokens of the keys
/// won, the stop fences taken and the fences checked.
#[derive(Clone, Debug, Default)]
pub(crate) struct Steps {
    pub(crate) tries: Vec<LockKey>,
    /// Announced or not, a release deletes the row (a pool has no one to announce to),
    /// except for a key handed over to one node: its row is kept for that node for
    /// [`HAND_OVER_HOLD`](crate::table::HAND_OVER_HOLD), what the announcement's hold
    /// does in the advisory-lock mode.
    pub(crate) unlock: Vec<LockKey>,
    /// The keys of `unlock` handed over, and the node (hash) each is kept for.
    pub(crate) hand: Vec<(LockKey, u64)>,
    pub(crate) unfence: Vec<LockKey>,
    /// One fresh token for all of them, sorted and without duplicates.
    pub(crate) token: Vec<LockKey>,
    pub(crate) fence: Vec<LockKey>,
    pub(crate) check: Vec<LockKey>,
}

impl Steps {
    /// The steps of `plan` (its announcements, interest keys and sender checks have no
    /// rows: a lease-row session polls).
    pub(crate) fn of(plan: &Plan) -> Self {
        let mut token: Vec<LockKey> = plan
            .token_for
            .iter()
            .chain(&plan.token_read)
            .copied()
            .collect();
        token.sort_unstable();
        token.dedup();
        Self {
            tries: plan.try_keys.clone(),
            unlock: plan
                .unlock
                .iter()
                .chain(&plan.unlock_quiet)
                .copied()
                .collect(),
            hand: plan
                .hand_to
                .iter()
                .filter(|(k, _)| plan.unlock.contains(k))
                .copied()
                .collect(),
            unfence: plan.unfence.clone(),
            token,
            fence: plan.fence.clone(),
            check: plan.check.clone(),
        }
    }
}

/// One key of the try, as the batch answered it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Tried {
    /// Its position in [`Steps::tries`].
    pub(crate) at: usize,
    pub(crate) won: bool,
    /// A row was there before (an expired one, when won: a takeover).
    pub(crate) existed: bool,
    /// For a key not won, the live holder the statement saw: its id and start.
    pub(crate) holder: Option<i32>,
    pub(crate) start: Option<i64>,
}

/// One key won, with its token (drawn after every key of the batch was taken) and the
/// holder of a live stop fence of it, if another session holds one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Win {
    pub(crate) key: LockKey,
    pub(crate) token: Option<i64>,
    pub(crate) fenced_by: Option<i32>,
}

/// What a batch answered, statement by statement.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Answer {
    /// Rows of the session the release deleted.
    pub(crate) unlocked: usize,
    /// Stop fences of the session deleted.
    pub(crate) unfenced: usize,
    /// The token drawn for each key of [`Steps::token`] the session still held live.
    pub(crate) tokens: Vec<i64>,
    pub(crate) tried: Vec<Tried>,
    pub(crate) wins: Vec<Win>,
    /// The fence keys (packed, see `fence_column`) taken or renewed.
    pub(crate) fenced: Vec<LockKey>,
    /// Per checked key (its position in [`Steps::check`]), the holder of another live
    /// fence of it.
    pub(crate) checked: Vec<(usize, Option<i32>)>,
}

/// A lease-row session ends with this (its rows expire, or are deleted when the link
/// is dropped).
pub(crate) fn lost(message: String) -> Fault {
    Fault::Lost(SessionDownReason::ConnectionLost { message })
}

/// Why a heartbeat found a lock missing, in the lease-row mode's words.
pub(crate) fn explain(reason: SessionDownReason) -> SessionDownReason {
    match reason {
        SessionDownReason::PoolerDetected { .. } => SessionDownReason::ConnectionLost {
            message: "a lease row of this session is gone: deleted behind its back, or expired early (the server's clock stepped forward)".to_owned(),
        },
        other => other,
    }
}

/// The token of counter value `value` on `timeline`, which must fit the 48 bits a
/// token carries.
pub(crate) fn issue(timeline: u16, value: i64) -> Result<FencingToken, Fault> {
    match u64::try_from(value) {
        Ok(v) if v < 1 << 48 => Ok(FencingToken::from_parts(timeline, v)),
        _ => Err(lost(format!(
            "the lease token counter drew {value}, outside the 48 bits a token carries: set it back on a new timeline or token epoch (ManagerOptions::token_epoch)"
        ))),
    }
}

/// What a batch's answer means: the session's [`Done`], or why the session is lost
/// (a release or a token draw that found a row of the session gone, a try answered
/// incompletely).
pub(crate) fn interpret(steps: &Steps, answer: &Answer, timeline: u16) -> Result<Done, Fault> {
    // Releases: every key must have been the session's.
    if answer.unlocked != steps.unlock.len() {
        return Err(lost(format!(
            "the server says this session held {} of the {} leases it released: a row expired and was taken, or was deleted behind its back",
            answer.unlocked,
            steps.unlock.len()
        )));
    }
    if answer.unfenced != steps.unfence.len() {
        return Err(lost(format!(
            "the server says this session held {} of the {} stop fences it released",
            answer.unfenced,
            steps.unfence.len()
        )));
    }
    let token = if steps.token.is_empty() {
        None
    } else {
        if answer.tokens.len() != steps.token.len() {
            return Err(lost(format!(
                "the session holds {} of the {} leases it draws a token for: a row expired or was deleted behind its back",
                answer.tokens.len(),
                steps.token.len()
            )));
        }
        answer
            .tokens
            .first()
            .map(|t| issue(timeline, *t))
            .transpose()?
    };
    let tried = if steps.tries.is_empty() {
        Vec::new()
    } else {
        tried(steps, answer, timeline)?
    };
    let seen_held = answer
        .tried
        .iter()
        .filter(|t| t.won && t.existed)
        .filter_map(|t| steps.tries.get(t.at).copied())
        .collect();
    let fenced = steps
        .fence
        .iter()
        .map(|k| (*k, answer.fenced.contains(&k.stop_fence())))
        .collect();
    let mut checked: Vec<(LockKey, FenceCheck)> = steps
        .check
        .iter()
        .map(|k| (*k, FenceCheck::Failed))
        .collect();
    for (at, by) in &answer.checked {
        if let Some(entry) = checked.get_mut(*at) {
            entry.1 = match by {
                None => FenceCheck::Clear,
                Some(by) => FenceCheck::Held { by: Some(*by) },
            };
        }
    }
    Ok(Done {
        token,
        tried: Ok(tried),
        registered: Vec::new(),
        seen_held,
        senders: Vec::new(),
        fenced,
        checked,
    })
}

/// The try's outcomes: every key answered, and a token for every key won.
fn tried(
    steps: &Steps,
    answer: &Answer,
    timeline: u16,
) -> Result<Vec<(LockKey, TryOutcome)>, Fault> {
    let keys = &steps.tries;
    let mut out: Vec<(LockKey, TryOutcome)> =
        keys.iter().map(|k| (*k, TryOutcome::Failed)).collect();
    let mut won = 0;
    for t in &answer.tried {
        let Some(entry) = out.get_mut(t.at) else {
            continue;
        };
        entry.1 = if t.won {
            won += 1;
            TryOutcome::Won(None)
        } else {
            TryOutcome::Held {
                by: t.holder.map(|pid| Holder {
                    pid,
                    start: t.start,
                }),
            }
        };
    }
    let mut tokens = 0;
    for w in &answer.wins {
        let Some(entry) = out.iter_mut().find(|(o, _)| *o == w.key) else {
            continue;
        };
        let Some(token) = w.token.map(|t| issue(timeline, t)).transpose()? else {
            continue;
        };
        tokens += 1;
        entry.1 = match w.fenced_by {
            Some(by) => TryOutcome::WonFenced {
                token: Some(token),
                by: Some(by),
            },
            None => TryOutcome::Won(Some(token)),
        };
    }
    if out.iter().any(|(_, o)| matches!(o, TryOutcome::Failed)) || tokens != won {
        return Err(lost(format!(
            "the try statement answered {won} keys won and {tokens} tokens for {} keys",
            keys.len()
        )));
    }
    Ok(out)
}
