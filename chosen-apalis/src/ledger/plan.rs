//! The misfire rules: which ticks were missed, which of them a leader runs, and which
//! it records as skipped. No I/O: fed what the ledger holds around the gap, returns
//! what to do.

use std::collections::BTreeSet;
use std::time::Duration;

use chrono::{DateTime, Utc};

/// What a leader does with the ticks of a job that nobody ran: those scheduled before
/// the tick at hand that have no row in the ledger (a failover gap, a time when no node
/// ran the worker, a run stopped and left unrecorded), after the job's first recorded
/// tick and after the first row written under the current schedule since the schedule
/// changed (ticks of a new schedule before its first row were never due under any
/// deployed schedule). Decided from the ledger, not from any node's memory, so a node
/// that just became leader decides the same as one that led all along.
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

/// What the ledger holds for a job around the ticks looked at (`[from, upto)`, `from`
/// being the oldest tick looked at): one statement's answer.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Recorded {
    /// The job's first tick ever recorded.
    pub(crate) first: Option<u64>,
    /// The ticks looked at that have a row, whatever its outcome.
    pub(crate) ticks: BTreeSet<u64>,
    /// The schedules (their text) other than the current one that rows in
    /// `[from, upto)` were written under, each with its newest such row.
    pub(crate) rescheduled: Vec<(String, u64)>,
    /// The newest row in `[from, upto)` with no schedule (written before the ledger
    /// recorded schedules, or by a gate given none) at a tick that is not one looked at.
    pub(crate) unscheduled: Option<u64>,
    /// The newest row before `from`, and the schedule it was written under (`None`:
    /// written before the ledger recorded schedules, or by a gate given none).
    pub(crate) below: Option<(u64, Option<String>)>,
}

/// The missed ticks among `candidates` (the schedule's ticks looked at, newest first,
/// all of the schedule's ticks from the oldest of them to the tick at hand): those with
/// no row, after the job's first row, and after the first row written under the
/// current schedule since it last changed.
///
/// A schedule change is a row written under another schedule (`same` says whether a
/// schedule's text is the current schedule, spelled the same or otherwise), or a row
/// with no schedule at a tick the current schedule does not have (`on_schedule`; rows
/// with no schedule at its ticks count as its own). Ticks of the current schedule
/// before its first row after the change were never due under any deployed schedule
/// (when it was deployed is not recorded; its first row is the earliest the ledger can
/// tell), so none is missed until that row exists.
pub(crate) fn missed(
    candidates: &[u64],
    found: &Recorded,
    same: impl Fn(&str) -> bool,
    on_schedule: impl Fn(u64) -> bool,
) -> Vec<u64> {
    let Some(first) = found.first else {
        return Vec::new(); // nothing recorded yet: the job starts with the tick at hand
    };
    let below = found
        .below
        .as_ref()
        .filter(|(tick, text)| match text {
            Some(text) => !same(text),
            None => !on_schedule(*tick),
        })
        .map(|(tick, _)| *tick);
    // The newest row written under another schedule, in the look or just below it.
    let changed = found
        .rescheduled
        .iter()
        .filter(|(text, _)| !same(text))
        .map(|(_, newest)| *newest)
        .chain(found.unscheduled)
        .chain(below)
        .max();
    let floor = match changed {
        None => first,
        // The current schedule's first row since: looked at, as every row after the
        // change is at one of its ticks (or none yet: nothing missed).
        Some(change) => match found.ticks.range(change + 1..).next() {
            Some(&since) => since,
            None => return Vec::new(),
        },
    };
    candidates
        .iter()
        .copied()
        .filter(|t| *t > floor && !found.ticks.contains(t))
        .collect()
}

/// The ticks a look for missed ticks covers: the schedule's ticks in `[low, upto)`,
/// the [`MAX_MISSED`] most recent of them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Look {
    /// Newest first.
    pub(crate) candidates: Vec<u64>,
    /// The schedule has older ticks in `[low, upto)` than those looked at.
    pub(crate) more: bool,
    /// The tick at hand (or, on gaining leadership, the next one): every candidate is
    /// before it.
    pub(crate) upto: u64,
    schedule: cron::Schedule,
}

/// What to do about the ticks looked at.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Decision {
    /// Missed ticks to run, oldest first.
    pub(crate) run: Vec<u64>,
    /// Missed ticks to record as skipped, newest first, each with its reason.
    pub(crate) skip: Vec<(u64, String)>,
    /// Where the next look starts: every tick of the schedule before it is recorded,
    /// or decided now.
    pub(crate) low: u64,
    /// The gap goes on below the ticks looked at (its oldest tick looked at is missed,
    /// and the schedule has older ones).
    pub(crate) truncated: bool,
}

impl Look {
    /// The ticks of `schedule` to look at before `upto`, from `low` on (0: from the
    /// start).
    pub(crate) fn new(schedule: &cron::Schedule, low: u64, upto: u64) -> Self {
        let mut candidates: Vec<u64> = missed_ticks(schedule, low.saturating_sub(1), upto)
            .take(MAX_MISSED + 1)
            .collect();
        let more = candidates.len() > MAX_MISSED;
        candidates.truncate(MAX_MISSED);
        Self {
            candidates,
            more,
            upto,
            schedule: schedule.clone(),
        }
    }

    /// The oldest tick looked at (`upto` when there is none).
    pub(crate) fn from(&self) -> u64 {
        self.candidates.last().copied().unwrap_or(self.upto)
    }

    /// Whether `text` (a schedule rows were recorded under) is this schedule, spelled
    /// the same or otherwise (`*/1` and `*`): the same fields once parsed, so the same
    /// ticks at all times.
    fn same(&self, text: &str) -> bool {
        text == self.schedule.source()
            || text
                .parse::<cron::Schedule>()
                .is_ok_and(|other| other.timeunitspec_eq(&self.schedule))
    }

    /// Whether the schedule has a tick at `tick`.
    fn on_schedule(&self, tick: u64) -> bool {
        i64::try_from(tick)
            .ok()
            .and_then(|t| DateTime::<Utc>::from_timestamp(t, 0))
            .is_some_and(|t| self.schedule.includes(t))
    }

    /// What the `policy` does about the missed ticks among those looked at, given
    /// what the ledger holds (`found`), the catch-up window ending at `reference`.
    pub(crate) fn decide(&self, policy: Misfire, found: &Recorded, reference: u64) -> Decision {
        let holes = missed(
            &self.candidates,
            found,
            |text| self.same(text),
            |tick| self.on_schedule(tick),
        );
        let plan = plan(policy, reference, holes.iter().copied());
        let truncated = self.more && holes.last() == Some(&self.from());
        let skip = plan
            .skip
            .iter()
            .map(|&(t, r)| {
                let reason = if truncated && t == self.from() {
                    format!("{}; {}", r.as_str(), MissReason::OLDER_NOT_LOOKED_AT)
                } else {
                    r.as_str().to_owned()
                };
                (t, reason)
            })
            .collect();
        Decision {
            run: plan.run,
            skip,
            // Everything below the oldest hole is recorded; the holes are looked at
            // again next time (filled by then, unless recording them fails).
            low: holes.last().copied().unwrap_or(self.upto),
            truncated,
        }
    }
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
    fn a_schedule_is_read_in_utc_so_no_tick_is_skipped_or_repeated_at_a_daylight_saving_change() {
        // 02:30 every day, across 2026-03-29 and 2026-10-25 (the spring and autumn
        // changes in most of Europe, at 01:00 UTC): one tick a day, 86,400 s apart.
        let daily = cron::Schedule::from_str("0 30 2 * * *").unwrap();
        for day in [1_774_828_800_u64, 1_792_972_800] {
            // Midnight UTC of the day after the change.
            let ticks: Vec<u64> =
                missed_ticks(&daily, day - 3 * 86_400, day + 2 * 86_400).collect();
            assert_eq!(ticks.len(), 5, "{ticks:?}");
            assert!(ticks.windows(2).all(|w| w[0] - w[1] == 86_400), "{ticks:?}");
            assert!(ticks.iter().all(|t| t % 86_400 == 9_000), "{ticks:?}");
        }
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

/// Cases found by review, each against the rule in `missed`'s docs.
#[cfg(test)]
mod cases {
    use std::collections::BTreeMap;

    use super::*;

    const T: u64 = 1_800_000_060; // a multiple of 60
    const CUR: &str = "0/7 * * * * *"; // seconds 0, 7, 14, ..., 56
    const OLD: &str = "1/5 * * * * *"; // seconds 1, 6, ..., 51, 56

    /// What `TickLedger::recorded` answers for `look`, from rows (tick: schedule).
    fn answer(look: &Look, rows: &BTreeMap<u64, Option<&str>>) -> Recorded {
        let (from, upto) = (look.from(), look.upto);
        let mut rescheduled: BTreeMap<String, u64> = BTreeMap::new();
        let mut unscheduled = None;
        for (t, s) in rows.range(from..upto) {
            match s {
                Some(s) if *s != CUR => {
                    let e = rescheduled.entry((*s).to_owned()).or_default();
                    *e = (*e).max(*t);
                }
                None if !look.candidates.contains(t) => unscheduled = Some(*t),
                _ => {}
            }
        }
        Recorded {
            first: rows.keys().next().copied(),
            ticks: look
                .candidates
                .iter()
                .copied()
                .filter(|t| rows.contains_key(t))
                .collect(),
            rescheduled: rescheduled.into_iter().collect(),
            unscheduled,
            below: rows
                .range(..from)
                .next_back()
                .map(|(t, s)| (*t, s.map(str::to_owned))),
        }
    }

    #[test]
    fn a_row_without_a_schedule_off_the_current_ticks_is_a_change_of_schedule() {
        // CUR at T+7, OLD at T+11, a row with no schedule at T+12 (not a CUR tick), CUR
        // again at T+28: the current schedule's first row since the change is T+28, so
        // T+14 and T+21 were not missed.
        let cur: cron::Schedule = CUR.parse().unwrap();
        let rows: BTreeMap<u64, Option<&str>> = [
            (T + 7, Some(CUR)),
            (T + 11, Some(OLD)),
            (T + 12, None),
            (T + 28, Some(CUR)),
        ]
        .into();
        let look = Look::new(&cur, 0, T + 35);
        let d = look.decide(Misfire::Skip, &answer(&look, &rows), T + 35);
        assert_eq!(
            d,
            Decision {
                low: T + 35,
                ..Decision::default()
            }
        );
        // On a CUR tick, such a row is the current schedule's: T+14 and T+21 after it.
        let rows: BTreeMap<u64, Option<&str>> = [
            (T + 7, Some(CUR)),
            (T + 11, Some(OLD)),
            (T + 14, None),
            (T + 28, Some(CUR)),
        ]
        .into();
        let d = look.decide(Misfire::Skip, &answer(&look, &rows), T + 35);
        assert_eq!(
            d.skip,
            vec![(T + 21, MissReason::Missed.as_str().to_owned())]
        );
    }

    #[test]
    fn a_schedule_is_another_even_where_a_short_look_sees_the_same_ticks() {
        // A later look of one tick, T+56, which OLD has too. The newest row below is
        // OLD's (T+51), with no CUR row since: nothing is missed.
        let cur: cron::Schedule = CUR.parse().unwrap();
        let rows: BTreeMap<u64, Option<&str>> = [
            (T + 42, Some(CUR)),
            (T + 49, Some(CUR)),
            (T + 51, Some(OLD)),
        ]
        .into();
        let look = Look::new(&cur, T + 56, T + 60);
        let d = look.decide(Misfire::RunOnce, &answer(&look, &rows), T + 60);
        assert_eq!(d.run, Vec::<u64>::new());
        // The same schedule spelled otherwise is no change.
        let rows: BTreeMap<u64, Option<&str>> = [
            (T + 42, Some(CUR)),
            (T + 49, Some("0,7,14,21,28,35,42,49,56 * * * * *")),
        ]
        .into();
        let d = look.decide(Misfire::RunOnce, &answer(&look, &rows), T + 60);
        assert_eq!(d.run, vec![T + 56]);
    }
}

/// The decision against an oracle that states each rule over the whole history (no
/// window, no statement): which ticks were missed, and what each policy does with them.
#[cfg(test)]
mod oracle {
    use std::collections::BTreeMap;

    use proptest::prelude::*;

    use super::*;

    /// A multiple of 60: every schedule below has a tick at its minute's offset.
    const BASE: u64 = 1_800_000_000;

    /// `offset/step * * * * *`: every `step` seconds from second `offset` of each
    /// minute.
    #[derive(Debug, Clone, Copy)]
    struct Sched {
        offset: u64,
        step: u64,
    }

    impl Sched {
        fn text(self) -> String {
            format!("{}/{} * * * * *", self.offset, self.step)
        }
        fn has(self, t: u64) -> bool {
            let s = t % 60;
            s >= self.offset && (s - self.offset).is_multiple_of(self.step)
        }
        /// The same ticks (another spelling of one schedule).
        fn same(self, other: Sched) -> bool {
            (0..60).all(|s| self.has(s) == other.has(s))
        }
        /// The latest tick at or before `t` (ticks exist in every minute).
        fn at_or_before(self, t: u64) -> u64 {
            (0..=t).rev().find(|&u| self.has(u)).expect("a tick")
        }
    }

    fn sched() -> impl Strategy<Value = Sched> {
        (
            0u64..6,
            prop_oneof![Just(1u64), Just(2), Just(3), Just(5), Just(7), Just(30)],
        )
            .prop_map(|(offset, step)| Sched { offset, step })
    }

    fn policy() -> impl Strategy<Value = Misfire> {
        prop_oneof![
            Just(Misfire::Skip),
            Just(Misfire::RunOnce),
            (0u32..20, 0u64..400).prop_map(|(max, within)| Misfire::CatchUp {
                max,
                within: Duration::from_secs(within)
            }),
        ]
    }

    /// Who wrote a row: `None` before the ledger recorded schedules, else which of the
    /// schedules (0 is the current one).
    type Rows = BTreeMap<u64, Option<usize>>;

    /// What the ledger statement answers for `look`, from the rows.
    fn answer(look: &Look, rows: &Rows, scheds: &[Sched]) -> Recorded {
        let (from, upto) = (look.from(), look.upto);
        let text = |l: &Option<usize>| l.map(|i| scheds[i].text());
        let mut rescheduled: BTreeMap<String, u64> = BTreeMap::new();
        let mut unscheduled = None;
        for (t, l) in rows.range(from..upto) {
            match text(l) {
                Some(x) if x != scheds[0].text() => {
                    let e = rescheduled.entry(x).or_default();
                    *e = (*e).max(*t);
                }
                Some(_) => {}
                None if !look.candidates.contains(t) => unscheduled = Some(*t),
                None => {}
            }
        }
        Recorded {
            first: rows.keys().next().copied(),
            ticks: look
                .candidates
                .iter()
                .copied()
                .filter(|t| rows.contains_key(t))
                .collect(),
            rescheduled: rescheduled.into_iter().collect(),
            unscheduled,
            below: rows.range(..from).next_back().map(|(t, l)| (*t, text(l))),
        }
    }

    /// The rules, over the whole history: a tick of the current schedule in
    /// `[low, upto)` is missed when it has no row, is among the 1000 most recent, and
    /// comes after the first row written since the schedule last changed (a row under
    /// another schedule, or with none at a tick the current one does not have); then
    /// the policy.
    fn oracle(
        rows: &Rows,
        scheds: &[Sched],
        (low, upto): (u64, u64),
        policy: Misfire,
        reference: u64,
    ) -> (Vec<u64>, Vec<(u64, String)>, bool) {
        let cur = scheds[0];
        let own = |t: u64, l: &Option<usize>| match l {
            Some(i) => scheds[*i].same(cur),
            None => cur.has(t),
        };
        let change = rows
            .range(..upto)
            .rev()
            .find(|(t, l)| !own(**t, l))
            .map(|(t, _)| *t);
        let floor = match change {
            None => rows.keys().next().copied(),
            Some(n) => rows.range(n + 1..).next().map(|(t, _)| *t),
        };
        let ticks: Vec<u64> = (low.max(1)..upto)
            .rev()
            .filter(|t| cur.has(*t))
            .take(1001)
            .collect();
        let window = &ticks[..ticks.len().min(1000)];
        let missed: Vec<u64> = match floor {
            None => Vec::new(),
            Some(floor) => window
                .iter()
                .copied()
                .filter(|t| *t > floor && !rows.contains_key(t))
                .collect(),
        };
        let truncated = ticks.len() > 1000 && missed.last() == window.last();
        let mut run = Vec::new();
        let mut skip = Vec::new();
        for (i, &t) in missed.iter().enumerate() {
            let reason = match policy {
                Misfire::Skip => Some("missed: not run when due"),
                Misfire::RunOnce => (i > 0).then_some("superseded by a later missed tick"),
                Misfire::CatchUp { max, within } => {
                    if Duration::from_secs(reference - t) > within {
                        Some("beyond catch-up window")
                    } else if run.len() < max as usize {
                        None
                    } else {
                        Some("beyond catch-up max")
                    }
                }
            };
            match reason {
                None => run.push(t),
                Some(r) if truncated && Some(&t) == window.last() => {
                    skip.push((t, format!("{r}; {}", MissReason::OLDER_NOT_LOOKED_AT)));
                }
                Some(r) => skip.push((t, r.to_owned())),
            }
        }
        run.reverse();
        (run, skip, truncated)
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: std::env::var("CHOSEN_LEDGER_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(1000),
            ..ProptestConfig::default()
        })]

        /// Whatever the history (rows of earlier schedules, spelled otherwise or not,
        /// rows with no schedule on or off the current one's ticks, holes, rows after
        /// the tick at hand) and wherever the look starts (a later look starts at the
        /// oldest hole of the one before), the decision is the policy applied to exactly
        /// the ticks the rules call missed.
        #[test]
        fn each_policy_decides_exactly_the_ticks_missed_since_the_schedule_last_changed(
            scheds in proptest::collection::vec(sched(), 1..4),
            raw in proptest::collection::vec(
                (0u64..2_400, proptest::option::weighted(0.8, 0usize..4), any::<bool>()),
                0..40,
            ),
            upto in 0u64..2_400,
            policy in policy(),
            late in 0u64..100,
            start in 0u64..=100,
        ) {
            let cur = scheds[0];
            let upto = cur.at_or_before(BASE + 60 + upto);
            let mut rows = Rows::new();
            for (t, l, snap) in raw {
                let l = l.map(|i| i % scheds.len());
                // A row sits on a tick of the schedule it was written under; one with
                // no schedule, anywhere.
                let t = BASE + 60 + t;
                let t = match l {
                    Some(i) => scheds[i].at_or_before(t),
                    None if snap => cur.at_or_before(t),
                    None => t,
                };
                rows.entry(t).or_insert(l);
            }
            let schedule: cron::Schedule = cur.text().parse().unwrap();
            // The first look starts at 0; a later one anywhere up to the oldest tick
            // the first found missed (everything below it is recorded or decided).
            let (first_run, first_skip, _) = oracle(&rows, &scheds, (0, upto), policy, upto + late);
            let oldest = first_run.iter().chain(first_skip.iter().map(|(t, _)| t)).copied().min().unwrap_or(upto);
            let low = if start == 0 { 0 } else { oldest - (oldest - BASE) * (100 - start) / 100 };
            let look = Look::new(&schedule, low, upto);
            let found = answer(&look, &rows, &scheds);
            let decision = look.decide(policy, &found, upto + late);
            let (run, skip, truncated) = oracle(&rows, &scheds, (low, upto), policy, upto + late);
            prop_assert_eq!(&decision.run, &run);
            prop_assert_eq!(&decision.skip, &skip);
            prop_assert_eq!(decision.truncated, truncated);
        }
    }
}
