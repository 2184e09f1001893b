//! The placement judgement for a singleton group, over the whole history (not only at
//! the end): how many members each node ran at every moment, against the bound for the
//! nodes that were live, and how many members moved between nodes that stayed up.
//!
//! *Live* is what the nemesis did, not what the library believed: a node is live while
//! one of its processes runs and no fault aimed at it (or at the server) is in effect; a
//! slow database (`latency`) does not count. The library learns of a join only after a
//! while (a node back from a freeze or a cut reconnects and takes a membership lock, a
//! promoted server grants nothing for its term hold, hand-overs take a round each), and
//! of a leave at once (a dead session's locks are free), so the bound counts the
//! *steady* nodes: those live throughout the last `settle`. After a node leaves, the
//! bound loosens at once; after one joins, it tightens `settle` later.
//!
//! * **Load over time.** At every moment (judged at each member's start, and at each
//!   moment a bound tightens), no node runs more than `ceil(M / N) + 1` of the `M`
//!   members, `N` the steady nodes; nothing is judged while that is 0 (a server outage,
//!   or the fleet starting). Moments with the whole fleet steady and with part of it out
//!   are counted apart; either fails the judgement. (Counting nodes as soon as
//!   they came back, a 300 s run found a node at 7 of 20 where 4 live nodes allow 6:
//!   one node was back from a freeze the others had not seen yet, another had just
//!   been killed, so the fleet rightly placed over 3.)
//! * **Moves per membership change.** A *move* is a member whose next run is on another
//!   node after its run ended gracefully on a node that stayed up (a hand-over to
//!   rebalance; runs ended by a lost lease, a kill or the node's own shutdown are forced,
//!   counted apart). Each join (a node becoming live) allows `ceil(M / N)` moves, `N` the
//!   live nodes just after it; the total must stay within the sum. A fleet that moves
//!   members back and forth breaks it.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::time::Duration;

use super::{FaultRecord, Run, is_server_fault};

/// The group to judge.
#[derive(Debug, Clone)]
pub struct PlacementSpec {
    /// The lock-name prefix of the members' singletons (`chosen.group/NAME/member/`).
    pub prefix: String,
    /// How many members the group has.
    pub members: usize,
    /// The fleet's node ids.
    pub nodes: Vec<String>,
    /// How long after the live membership changed placement may still be settling.
    pub settle: Duration,
    /// Judge up to this moment (`CLOCK_MONOTONIC` µs): the final shutdown's start.
    pub until_us: u64,
}

/// What the placement judgement found.
#[derive(Debug, Clone, Default)]
pub struct Placement {
    /// Moments when the whole fleet had been live for `settle` and a node ran more
    /// members than the bound: must be empty (the first few, with how many there were
    /// in `over_count`).
    pub over_bound: Vec<String>,
    /// How many moments were over the bound with the whole fleet live.
    pub over_count: usize,
    /// Moments over the bound while part of the fleet was out (or had been, within
    /// `settle`): must be empty too (the first few), listed apart.
    pub over_partial: Vec<String>,
    /// How many such moments.
    pub over_partial_count: usize,
    /// Moments judged (with at least one steady node: live throughout the last
    /// `settle`).
    pub judged: usize,
    /// Per steady-node count `N`: the most members one node ran at a judged moment.
    pub peak_by_live: BTreeMap<usize, usize>,
    /// The most members one node ran at any moment (judged or not).
    pub peak: usize,
    /// Nodes becoming live (the first start included).
    pub joins: usize,
    /// Members handed over between nodes that stayed up.
    pub moves: usize,
    /// The moves the joins allow (`ceil(M / N)` each).
    pub move_bound: usize,
    /// Members that changed node after a lost lease, a kill or a shutdown.
    pub forced_moves: usize,
    /// The group's size.
    pub members: usize,
}

impl Placement {
    /// `true` when no node was above the bound (whole fleet or not) and the moves
    /// stayed within theirs.
    #[must_use]
    pub fn ok(&self) -> bool {
        self.over_count == 0 && self.over_partial_count == 0 && self.moves <= self.move_bound
    }
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "placement of {} members: {} moments judged, {} over the bound with the whole fleet live, {} with part of it out; most members on one node",
            self.members, self.judged, self.over_count, self.over_partial_count
        )?;
        for (n, peak) in &self.peak_by_live {
            write!(
                f,
                ", {peak} with {n} live (bound {})",
                self.members.div_ceil(*n) + 1
            )?;
        }
        write!(
            f,
            " ({} at any moment); {} joins, {} hand-overs (bound {}), {} forced moves",
            self.peak, self.joins, self.moves, self.move_bound, self.forced_moves
        )?;
        for o in &self.over_bound {
            write!(f, "\nOVER THE PLACEMENT BOUND {o}")?;
        }
        for o in &self.over_partial {
            write!(
                f,
                "\nover the bound with part of the fleet out (reported) {o}"
            )?;
        }
        Ok(())
    }
}

/// How many moments over the bound are described (all are counted).
const DESCRIBED: usize = 20;

/// Judges the placement of `spec`'s group. `runs` are every singleton's runs, each
/// list sorted by start; `killed_at` and `shutdown_at` are when each process was
/// killed or began its graceful shutdown.
pub(super) fn judge(
    spec: &PlacementSpec,
    runs: &BTreeMap<String, Vec<Run>>,
    faults: &[FaultRecord],
    process_spans: &HashMap<(String, u32), (u64, u64)>,
    killed_at: &HashMap<(String, u32), u64>,
    shutdown_at: &HashMap<(String, u32), u64>,
) -> Placement {
    let mut p = Placement {
        members: spec.members,
        ..Placement::default()
    };
    let settle_us = spec.settle.as_micros() as u64;
    let members: Vec<&Run> = runs
        .iter()
        .filter(|(name, _)| name.starts_with(&spec.prefix))
        .flat_map(|(_, list)| list.iter())
        .collect();

    // Live intervals per node: a process runs, less the faults in effect.
    let mut down: HashMap<&str, Vec<(u64, u64)>> = HashMap::new();
    for f in faults.iter().filter(|f| f.kind != "latency") {
        let span = (f.at_us, f.healed_us.max(f.at_us));
        match (&f.target, is_server_fault(f.kind)) {
            (Some((node, _)), false) => down.entry(node.as_str()).or_default().push(span),
            _ => {
                for n in &spec.nodes {
                    down.entry(n.as_str()).or_default().push(span);
                }
            }
        }
    }
    let live_at = |node: &str, t: u64| {
        process_spans
            .iter()
            .any(|((n, _), (from, to))| n == node && *from <= t && t <= *to)
            && down
                .get(node)
                .is_none_or(|spans| spans.iter().all(|(a, b)| t < *a || t > *b))
    };
    // The live count changes only at these moments.
    let mut edges: BTreeSet<u64> = BTreeSet::new();
    for ((n, _), (from, to)) in process_spans {
        if spec.nodes.contains(n) {
            edges.insert(*from);
            edges.insert(to.saturating_add(1));
        }
    }
    for spans in down.values() {
        for (a, b) in spans {
            edges.insert(*a);
            edges.insert(b.saturating_add(1));
        }
    }
    // Each node's liveness from each edge on (`transitions`), and the joins.
    let mut steps: Vec<u64> = Vec::new();
    let mut transitions: HashMap<&str, Vec<(u64, bool)>> = HashMap::new();
    let mut was_live: HashMap<&str, bool> = HashMap::new();
    for &t in &edges {
        let mut count = 0;
        let mut joined = 0;
        let mut changed = false;
        for n in &spec.nodes {
            let live = live_at(n, t);
            count += usize::from(live);
            let before = was_live.get(n.as_str()).copied().unwrap_or(false);
            if live && !before {
                joined += 1;
            }
            if live != before {
                changed = true;
                transitions.entry(n.as_str()).or_default().push((t, live));
            }
            was_live.insert(n.as_str(), live);
        }
        if joined > 0 && count > 0 && t <= spec.until_us {
            p.joins += joined;
            p.move_bound += joined * spec.members.div_ceil(count);
        }
        if changed {
            steps.push(t);
        }
    }
    // The nodes live throughout [t - settle, t]: a node that left counts no more at
    // once; one that joined (or came back) counts once it has been live for `settle`,
    // the time the others take to see it and hand it members.
    let steady = |t: u64| {
        let from = t.saturating_sub(settle_us);
        spec.nodes
            .iter()
            .filter(|n| {
                let Some(list) = transitions.get(n.as_str()) else {
                    return false;
                };
                let live_at_from = list
                    .iter()
                    .take_while(|(at, _)| *at <= from)
                    .last()
                    .is_some_and(|(_, live)| *live);
                live_at_from
                    && !list
                        .iter()
                        .any(|(at, live)| *at > from && *at <= t && !*live)
            })
            .count()
    };

    // The moments to judge: every member's start, and every moment a bound tightens.
    let mut moments: BTreeSet<u64> = members.iter().map(|r| r.start_us).collect();
    moments.extend(steps.iter().map(|at| at.saturating_add(settle_us)));
    for &t in moments.range(..=spec.until_us) {
        let mut load: BTreeMap<&str, usize> = BTreeMap::new();
        for r in members.iter().filter(|r| r.start_us <= t && t < r.end_us) {
            *load.entry(r.node.as_str()).or_default() += 1;
        }
        let (worst_node, worst) = load
            .iter()
            .max_by_key(|(_, k)| **k)
            .map_or(("", 0), |(n, k)| (*n, *k));
        p.peak = p.peak.max(worst);
        let n = steady(t);
        if n == 0 {
            continue;
        }
        p.judged += 1;
        let peak = p.peak_by_live.entry(n).or_default();
        *peak = (*peak).max(worst);
        let bound = spec.members.div_ceil(n) + 1;
        if worst > bound {
            let (count, list) = if n == spec.nodes.len() {
                (&mut p.over_count, &mut p.over_bound)
            } else {
                (&mut p.over_partial_count, &mut p.over_partial)
            };
            *count += 1;
            if list.len() < DESCRIBED {
                list.push(format!(
                    "at {t}: {worst_node} ran {worst} of {} members; {n} nodes had been live for {:?}, bound {bound}; loads {load:?}",
                    spec.members, spec.settle
                ));
            }
        }
    }

    // Moves: consecutive runs of one member on different nodes.
    for (_, list) in runs.iter().filter(|(n, _)| n.starts_with(&spec.prefix)) {
        for pair in list.windows(2) {
            let (a, b) = (&pair[0], &pair[1]);
            if a.node == b.node || a.start_us > spec.until_us {
                continue;
            }
            let process = (a.node.clone(), a.instance);
            let forced = a.lost
                || killed_at.get(&process).is_some_and(|at| *at <= a.end_us)
                || shutdown_at.get(&process).is_some_and(|at| *at <= a.end_us);
            if forced {
                p.forced_moves += 1;
            } else {
                p.moves += 1;
            }
        }
    }
    p
}

#[cfg(test)]
mod tests {
    use super::super::{Event, FaultRecord, Timing, check_with};
    use super::*;

    const PREFIX: &str = "chosen.group/g/member/";

    fn event(ms: u64, node: &str, event: &str, member: Option<usize>, token: u64) -> Event {
        Event {
            mono_us: ms * 1000,
            node: node.to_owned(),
            instance: 0,
            event: event.to_owned(),
            singleton: member.map(|m| format!("{PREFIX}{m}")),
            token: member.map(|_| token),
            reason: None,
            phase: None,
            generation: None,
        }
    }

    /// A node process alive from `from` to `to` (ms).
    fn alive(node: &str, from: u64, to: u64) -> Vec<Event> {
        vec![
            event(from, node, "connected", None, 0),
            event(to, node, "disconnected", None, 0),
        ]
    }

    /// Member `m` running on `node` from `from` to `to` (ms), ended gracefully.
    fn member(node: &str, m: usize, from: u64, to: u64, token: u64) -> Vec<Event> {
        vec![
            event(from, node, "child_started", Some(m), token),
            event(to, node, "child_stopped", Some(m), token),
        ]
    }

    fn spec(members: usize, nodes: &[&str], until_ms: u64) -> PlacementSpec {
        PlacementSpec {
            prefix: PREFIX.to_owned(),
            members,
            nodes: nodes.iter().map(|n| (*n).to_owned()).collect(),
            settle: Duration::from_secs(10),
            until_us: until_ms * 1000,
        }
    }

    fn judge_history(h: &[Event], faults: &[FaultRecord], spec: &PlacementSpec) -> Placement {
        check_with(h, faults, Timing::default(), Some(spec))
            .placement
            .expect("a group was named")
    }

    #[test]
    fn a_spread_group_passes() {
        let mut h = [alive("a", 0, 100_000), alive("b", 0, 100_000)].concat();
        for m in 0..4 {
            h.extend(member(
                if m % 2 == 0 { "a" } else { "b" },
                m,
                1_000,
                99_000,
                1,
            ));
        }
        let p = judge_history(&h, &[], &spec(4, &["a", "b"], 90_000));
        assert!(p.ok(), "{p}");
        assert!(p.judged > 0, "{p}");
        assert_eq!((p.peak, p.moves, p.joins), (2, 0, 2), "{p}");
    }

    #[test]
    fn every_member_on_one_of_three_live_nodes_is_caught() {
        let mut h = [
            alive("a", 0, 100_000),
            alive("b", 0, 100_000),
            alive("c", 0, 100_000),
        ]
        .concat();
        for m in 0..6 {
            h.extend(member("a", m, 1_000, 99_000, 1));
        }
        // Started together: judged only once the fleet has been whole for the settle
        // time, and still found.
        let p = judge_history(&h, &[], &spec(6, &["a", "b", "c"], 90_000));
        assert!(!p.ok(), "{p}");
        assert!(p.over_bound[0].contains("a ran 6 of 6"), "{p}");
    }

    #[test]
    fn survivors_of_a_kill_may_carry_its_members_until_it_is_back_and_settled() {
        // Three nodes, six members; c is killed at 30 s and back at 35 s. a and b take
        // its members (three each: the bound for two live nodes is 4). Back, c takes
        // two members back by 40 s: within the settle time (10 s), so not judged as late.
        let mut h = [
            alive("a", 0, 100_000),
            alive("b", 0, 100_000),
            alive("c", 0, 30_000),
        ]
        .concat();
        let mut c1 = alive("c", 35_000, 100_000);
        for e in &mut c1 {
            e.instance = 1;
        }
        h.extend(c1);
        h.extend(member("a", 0, 1_000, 99_000, 1));
        h.extend(member("a", 1, 1_000, 99_000, 1));
        h.extend(member("b", 2, 1_000, 99_000, 1));
        h.extend(member("b", 3, 1_000, 99_000, 1));
        h.extend(member("c", 4, 1_000, 30_000, 1));
        h.extend(member("c", 5, 1_000, 30_000, 1));
        h.extend(member("a", 4, 31_000, 40_000, 2));
        h.extend(member("b", 5, 31_000, 40_000, 2));
        let mut back = [
            member("c", 4, 40_100, 99_000, 3),
            member("c", 5, 40_100, 99_000, 3),
        ]
        .concat();
        for e in &mut back {
            e.instance = 1;
        }
        h.extend(back);
        let kill = FaultRecord {
            kind: "sigkill",
            target: Some(("c".to_owned(), 0)),
            at_us: 30_000_000,
            healed_us: 30_010_000,
        };
        let p = judge_history(&h, &[kill], &spec(6, &["a", "b", "c"], 90_000));
        assert!(p.ok(), "{p}");
        assert_eq!((p.moves, p.forced_moves), (2, 2), "{p}");
        // Joins: a, b, c at the start and c again: 2 + 2 + 2 + 2 moves allowed.
        assert_eq!((p.joins, p.move_bound), (4, 8), "{p}");
    }

    #[test]
    fn a_node_left_over_the_bound_after_a_join_settles_is_caught() {
        // c joins at 20 s, but a keeps all six members: over the bound once c has been
        // live for the settle time (no new start needed to find it).
        let mut h = [
            alive("a", 0, 100_000),
            alive("b", 0, 100_000),
            alive("c", 20_000, 100_000),
        ]
        .concat();
        for m in 0..4 {
            h.extend(member("a", m, 1_000, 99_000, 1));
        }
        for m in 4..6 {
            h.extend(member("b", m, 1_000, 99_000, 1));
        }
        let p = judge_history(&h, &[], &spec(6, &["a", "b", "c"], 90_000));
        // With two nodes, 4 is within ceil(6 / 2) + 1; with three, above 3.
        assert!(!p.ok(), "{p}");
        assert!(p.over_bound[0].starts_with("at 30000000"), "{p}");
    }

    #[test]
    fn over_the_bound_with_part_of_the_fleet_out_is_caught_and_told_apart() {
        // c is gone from 30 s; a then runs five of six members (two live: bound 4).
        let mut h = [
            alive("a", 0, 100_000),
            alive("b", 0, 100_000),
            alive("c", 0, 30_000),
        ]
        .concat();
        for m in 0..5 {
            h.extend(member("a", m, 31_000, 99_000, 1));
        }
        h.extend(member("b", 5, 31_000, 99_000, 1));
        let p = judge_history(&h, &[], &spec(6, &["a", "b", "c"], 90_000));
        assert!(!p.ok(), "{p}");
        assert_eq!(p.over_count, 0, "{p}");
        assert!(p.over_partial_count > 0, "{p}");
        assert!(p.over_partial[0].contains("a ran 5 of 6"), "{p}");
    }

    #[test]
    fn a_node_back_from_a_freeze_counts_only_once_it_has_settled() {
        // d is frozen from 10 s to 20 s; c is killed at 21 s. At 21.5 s a runs five of
        // eight members: d is back but not yet seen by the others (it counts after the
        // settle time), c is gone: two steady nodes, bound ceil(8 / 2) + 1 = 5.
        let mut h = [
            alive("a", 0, 100_000),
            alive("b", 0, 100_000),
            alive("c", 0, 21_000),
            alive("d", 0, 100_000),
        ]
        .concat();
        for m in 0..2 {
            h.extend(member("a", m, 1_000, 99_000, 1));
        }
        for m in 2..5 {
            h.extend(member("a", m, 21_500, 99_000, 2));
        }
        for m in 5..8 {
            h.extend(member("b", m, 1_000, 99_000, 1));
        }
        let faults = [
            FaultRecord {
                kind: "sigstop_long",
                target: Some(("d".to_owned(), 0)),
                at_us: 10_000_000,
                healed_us: 20_000_000,
            },
            FaultRecord {
                kind: "sigkill",
                target: Some(("c".to_owned(), 0)),
                at_us: 21_000_000,
                healed_us: 21_010_000,
            },
        ];
        let p = judge_history(&h, &faults, &spec(8, &["a", "b", "c", "d"], 25_000));
        assert!(p.ok(), "{p}");
        assert_eq!(p.over_partial_count, 0, "{p}");
        assert_eq!(p.peak_by_live.get(&2), Some(&5), "{p}");
    }

    #[test]
    fn members_moving_back_and_forth_are_caught() {
        let mut h = [alive("a", 0, 100_000), alive("b", 0, 100_000)].concat();
        h.extend(member("b", 1, 1_000, 99_000, 1));
        let mut t = 1_000;
        for i in 0..20 {
            h.extend(member(
                if i % 2 == 0 { "a" } else { "b" },
                0,
                t,
                t + 1_000,
                i + 1,
            ));
            t += 2_000;
        }
        let p = judge_history(&h, &[], &spec(2, &["a", "b"], 90_000));
        assert!(p.over_bound.is_empty(), "{p}");
        assert_eq!(p.moves, 19, "{p}");
        assert!(!p.ok(), "{p}");
    }

    #[test]
    fn members_taken_after_a_lost_lease_are_forced_moves() {
        let mut h = [alive("a", 0, 100_000), alive("b", 0, 100_000)].concat();
        h.push(event(1_000, "a", "child_started", Some(0), 1));
        h.push(event(5_000, "a", "lease_lost", Some(0), 1));
        h.push(event(5_100, "a", "child_stopped", Some(0), 1));
        h.extend(member("b", 0, 6_000, 99_000, 2));
        let p = judge_history(&h, &[], &spec(1, &["a", "b"], 90_000));
        assert_eq!((p.moves, p.forced_moves), (0, 1), "{p}");
        assert!(p.ok(), "{p}");
    }
}
