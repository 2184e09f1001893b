//! The misfire rules: which missed ticks a leader runs, and which it records as
//! skipped. No I/O: fed the ticks nobody recorded, returns what to do.

use std::time::Duration;

use chrono::{DateTime, Utc};

/// What a leader does with the ticks of a job that nobody ran: those scheduled after the
/// job's first recorded tick and before the tick at hand that have no row in the
/// ledger (a failover gap, a time when no node ran the worker, a run stopped and left
/// unrecorded). Decided from the ledger, not from any node's
/// memory, so a node that just became leader decides the same as one that led all along.
///
/// | policy | missed ticks run | missed ticks recorded as `skipped` |
/// |---|---|---|
/// | [`Skip`](Self::Skip) (default) | none | all, reason `missed: not run when due` |
/// | [`RunOnce`](Self::RunOnce) | the most recent | the others, reason `superseded by a later missed tick` |
/// | [`CatchUp`](Self::CatchUp) | every one scheduled at most `within` before the tick at hand, the most recent `max` of them, oldest first | older ones `beyond catch-up window`, the rest `beyond catch-up max` |
///
/// Each missed tick is run or recorded once: a missed tick that runs is claimed in the
/// ledger like any other tick, and skips are ledger rows too, so the next leader sees
/// them as decided. At most the 1,000 most recent scheduled ticks are looked at; a gap
/// reaching further back is cut there (its oldest tick looked at says so in its
/// reason, and a warning too). A `max` above 1,000 acts as 1,000.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Misfire {
    /// Run none of the missed ticks; record each as skipped.
    #[default]
    Skip,
    /// Run the most recent missed tick once, before the tick at hand; record the
    /// others as skipped.
    RunOnce,
    /// Run every missed tick scheduled at most `within` before the tick at hand,
    /// oldest first, each once, at most `max` of them (the most recent); record the
    /// others as skipped.
    CatchUp {
        /// At most this many missed ticks are run per gap.
        max: u32,
        /// Only ticks scheduled at most this long before the tick at hand are run
        /// (measured between scheduled times, not on a node's clock).
        within: Duration,
    },
}

/// How many missed ticks are looked at per gap, at most.
pub(crate) const MAX_MISSED: usize = 1000;

/// Why a missed tick was not run; stored in the ledger's `reason` column. Do not
/// change the texts: operators query them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MissReason {
    Missed,
    Superseded,
    BeyondWindow,
    BeyondMax,
}

impl MissReason {
    /// Added to the reason of the oldest missed tick looked at when the gap goes on
    /// below it.
    pub(crate) const OLDER_NOT_LOOKED_AT: &'static str =
        "older ticks were not looked at (a gap of more than 1000 ticks)";

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Missed => "missed: not run when due",
            Self::Superseded => "superseded by a later missed tick",
            Self::BeyondWindow => "beyond catch-up window",
            Self::BeyondMax => "beyond catch-up max",
        }
    }
}

/// What to do about one gap.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Plan {
    /// Missed ticks to run before the tick at hand, oldest first (Unix seconds).
    pub(crate) run: Vec<u64>,
    /// Missed ticks to record as skipped, newest first.
    pub(crate) skip: Vec<(u64, MissReason)>,
    /// More than [`MAX_MISSED`] ticks were missed: the older ones were not looked at.
    pub(crate) truncated: bool,
}

/// The plan for the tick scheduled at `current`, given the missed ticks newest first
/// (all before `current`, none recorded).
pub(crate) fn plan(policy: Misfire, current: u64, missed: impl IntoIterator<Item = u64>) -> Plan {
    let mut out = Plan::default();
    let mut missed = missed.into_iter();
    for (i, tick) in missed.by_ref().take(MAX_MISSED).enumerate() {
        let reason = match policy {
            Misfire::Skip => Some(MissReason::Missed),
            Misfire::RunOnce => (i > 0).then_some(MissReason::Superseded),
            Misfire::CatchUp { max, within } => {
                let age = Duration::from_secs(current.saturating_sub(tick));
                if age > within {
                    Some(MissReason::BeyondWindow)
                } else if out.run.len() < usize::try_from(max).unwrap_or(usize::MAX) {
                    None
                } else {
                    Some(MissReason::BeyondMax)
                }
            }
        };
        match reason {
            None => out.run.push(tick),
            Some(reason) => out.skip.push((tick, reason)),
        }
    }
    out.truncated = missed.next().is_some();
    out.run.reverse();
    out
}

/// The ticks of `schedule` strictly between `last` and `current`, newest first (Unix
/// seconds, UTC: what apalis-cron's `Tick` carries).
pub(crate) fn missed_ticks(
    schedule: &cron::Schedule,
    last: u64,
    current: u64,
) -> impl Iterator<Item = u64> + '_ {
    let start = i64::try_from(current)
        .ok()
        .and_then(|s| DateTime::<Utc>::from_timestamp(s, 0));
    start
        .into_iter()
        .flat_map(move |start| schedule.after_owned(start).rev())
        .map(|t| u64::try_from(t.timestamp()).unwrap_or(0))
        .take_while(move |&t| t > last)
}

/// The first tick of `schedule` strictly after `t` (Unix seconds, UTC).
pub(crate) fn next_after(schedule: &cron::Schedule, t: u64) -> Option<u64> {
    let start = DateTime::<Utc>::from_timestamp(i64::try_from(t).ok()?, 0)?;
    let next = schedule.after(&start).next()?;
    u64::try_from(next.timestamp()).ok()
}

#[cfg(test)]
mod tests {
    use std::str::FromStr;

    use super::*;

    const NOW: u64 = 1_800_000_000;

    fn gap(n: u64) -> Vec<u64> {
        // Newest first: NOW-1, NOW-2, ..., NOW-n.
        (1..=n).map(|i| NOW - i).collect()
    }

    #[test]
    fn skip_records_every_missed_tick() {
        let p = plan(Misfire::Skip, NOW, gap(3));
        assert!(p.run.is_empty());
        assert_eq!(
            p.skip,
            vec![
                (NOW - 1, MissReason::Missed),
                (NOW - 2, MissReason::Missed),
                (NOW - 3, MissReason::Missed)
            ]
        );
        assert!(!p.truncated);
    }

    #[test]
    fn run_once_runs_the_most_recent_missed_tick() {
        let p = plan(Misfire::RunOnce, NOW, gap(3));
        assert_eq!(p.run, vec![NOW - 1]);
        assert_eq!(
            p.skip,
            vec![
                (NOW - 2, MissReason::Superseded),
                (NOW - 3, MissReason::Superseded)
            ]
        );
    }

    #[test]
    fn catch_up_runs_the_window_oldest_first_within_max() {
        let policy = Misfire::CatchUp {
            max: 3,
            within: Duration::from_secs(5),
        };
        let p = plan(policy, NOW, gap(8));
        // Within 5 s: NOW-1..NOW-5; the most recent 3 run, oldest first.
        assert_eq!(p.run, vec![NOW - 3, NOW - 2, NOW - 1]);
        assert_eq!(
            p.skip,
            vec![
                (NOW - 4, MissReason::BeyondMax),
                (NOW - 5, MissReason::BeyondMax),
                (NOW - 6, MissReason::BeyondWindow),
                (NOW - 7, MissReason::BeyondWindow),
                (NOW - 8, MissReason::BeyondWindow)
            ]
        );
    }

    #[test]
    fn no_gap_no_plan() {
        for policy in [
            Misfire::Skip,
            Misfire::RunOnce,
            Misfire::CatchUp {
                max: 10,
                within: Duration::from_secs(60),
            },
        ] {
            assert_eq!(plan(policy, NOW, gap(0)), Plan::default());
        }
    }

    #[test]
    fn a_huge_gap_is_cut_not_walked() {
        let p = plan(Misfire::Skip, NOW, (1..).map(|i| NOW - i));
        assert_eq!(p.skip.len(), MAX_MISSED);
        assert!(p.truncated);
        let p = plan(
            Misfire::CatchUp {
                max: u32::MAX,
                within: Duration::MAX,
            },
            NOW,
            gap(MAX_MISSED as u64),
        );
        assert_eq!(p.run.len(), MAX_MISSED);
        assert!(!p.truncated);
    }

    #[test]
    fn missed_ticks_are_the_schedule_strictly_between() {
        let every_10s = cron::Schedule::from_str("*/10 * * * * *").unwrap();
        let current = 1_800_000_060; // a multiple of 60
        let got: Vec<u64> = missed_ticks(&every_10s, current - 40, current).collect();
        assert_eq!(got, vec![current - 10, current - 20, current - 30]);
        // Nothing between two consecutive ticks.
        assert_eq!(missed_ticks(&every_10s, current - 10, current).count(), 0);
        // A last tick at or after the current one: nothing missed.
        assert_eq!(missed_ticks(&every_10s, current, current).count(), 0);
        assert_eq!(missed_ticks(&every_10s, current + 10, current).count(), 0);
        assert_eq!(next_after(&every_10s, current), Some(current + 10));
        assert_eq!(next_after(&every_10s, current - 1), Some(current));
    }
}
