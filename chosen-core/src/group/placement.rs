//! Where the members of a [`SingletonGroup`](crate::SingletonGroup) should run: a pure
//! function of one snapshot of the database (who holds which member, which nodes are
//! live), so that every node computes the same plan from the same snapshot and acts on
//! its own part of it, with no messages between nodes.
//!
//! The rules:
//!
//! * Every live node's target is `M / N` or `M / N + 1` members (`M` members, `N` live
//!   nodes); the `M % N` larger targets go to the nodes with the smallest backend pids.
//!   A stable rule on purpose: ranked by what nodes hold, targets would flip while
//!   hand-overs are under way, and members would move twice.
//! * A node above its target releases the surplus, its highest-numbered members first;
//!   a member held by no live node (an orphan) or released that way goes to the node
//!   below its target that ranks it highest (rendezvous hashing, so the choice holds
//!   still as other members land), until each reaches its target.
//!   After a node joins, only the new node's target moves (at most `ceil(M / N)`); after
//!   a node leaves, its members spread over the nodes that are below their new targets.
//! * While the membership flaps, nothing held moves (`frozen`): orphans are still placed.
//! * Members held by a session that is not a live node (one that is leaving: it gives up
//!   its membership first) are in transit: placed like orphans, after them, so that the
//!   nodes that will take them already wait when they are released (and announced).

use std::collections::BTreeMap;

/// A node: the backend pid of its lock session (visible to every role in `pg_locks`).
pub(crate) type Node = i32;

/// What one node should do, from [`plan`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Plan {
    /// Members this node holds and should hand over (stop the child, release).
    pub(crate) release: Vec<usize>,
    /// Members this node should contend for (free now, or about to be released).
    pub(crate) contend: Vec<usize>,
    /// This node's target number of members (`None` when it is not a live node).
    pub(crate) target: Option<usize>,
}

/// The plan for `me`, given who holds each member (`holders[i]`: the pid holding member
/// `i`, if any) and the live nodes.
pub(crate) fn plan(me: Node, live: &[Node], holders: &[Option<Node>], frozen: bool) -> Plan {
    let mut nodes: Vec<Node> = live.to_vec();
    nodes.sort_unstable();
    nodes.dedup();
    if nodes.is_empty() {
        return Plan::default();
    }
    let members = holders.len();
    // What each live node holds, in member order.
    let mut held: BTreeMap<Node, Vec<usize>> = nodes.iter().map(|n| (*n, Vec::new())).collect();
    let mut orphans = Vec::new();
    let mut in_transit = Vec::new();
    for (i, holder) in holders.iter().enumerate() {
        match holder {
            Some(h) => match held.get_mut(h) {
                Some(list) => list.push(i),
                // Held by a session that is not a live node: in transit.
                None => in_transit.push(i),
            },
            None => orphans.push(i),
        }
    }
    // Targets: the larger ones to the smallest pids (a stable rule).
    let base = members / nodes.len();
    let extra = members % nodes.len();
    let target: BTreeMap<Node, usize> = nodes
        .iter()
        .enumerate()
        .map(|(rank, n)| (*n, base + usize::from(rank < extra)))
        .collect();

    #[cfg(test)]
    if crate::sim::is_off(crate::sim::Guard::GroupKeepsPlaced) {
        // Each member to a node by its number modulo the live nodes, wherever it is held.
        let top = |m: usize| Some(nodes[m % nodes.len()]);
        return Plan {
            release: (0..members)
                .filter(|m| holders[*m] == Some(me) && top(*m) != Some(me))
                .collect(),
            contend: (0..members)
                .filter(|m| holders[*m] != Some(me) && top(*m) == Some(me))
                .collect(),
            target: target.get(&me).copied(),
        };
    }
    // The pool to place: orphans first (lowest member first), then members in transit,
    // then each surplus.
    let mut pool = orphans;
    pool.extend(in_transit);
    let mut release_of: BTreeMap<Node, Vec<usize>> = BTreeMap::new();
    #[cfg(test)]
    let frozen = frozen || crate::sim::is_off(crate::sim::Guard::GroupReleasesSurplus);
    if !frozen {
        for n in &nodes {
            let list = &held[n];
            let surplus = list.len().saturating_sub(target[n]);
            if surplus > 0 {
                let moved: Vec<usize> = list.iter().rev().take(surplus).copied().collect();
                pool.extend(moved.iter().copied());
                release_of.insert(*n, moved);
            }
        }
    }
    // Deficits, and each member of the pool to the node below its target that ranks
    // it highest (rendezvous hashing): stable as other members land, so that a node
    // waiting for a member keeps waiting for it.
    let mut need: BTreeMap<Node, usize> = nodes
        .iter()
        .filter_map(|n| {
            let have = held[n].len();
            (have < target[n]).then(|| (*n, target[n] - have))
        })
        .collect();
    let mut contend_of: BTreeMap<Node, Vec<usize>> = BTreeMap::new();
    for m in pool {
        let Some(n) = need
            .iter()
            .filter(|(_, k)| **k > 0)
            .max_by_key(|(n, _)| rank(m, **n))
            .map(|(n, _)| *n)
        else {
            break;
        };
        contend_of.entry(n).or_default().push(m);
        if let Some(k) = need.get_mut(&n) {
            *k -= 1;
        }
    }
    Plan {
        release: release_of.remove(&me).unwrap_or_default(),
        contend: contend_of.remove(&me).unwrap_or_default(),
        target: target.get(&me).copied(),
    }
}

/// How much node `n` wants member `m` (a fixed pseudo-random ranking).
fn rank(m: usize, n: Node) -> u64 {
    // splitmix64 of the pair.
    let mut x = (m as u64) ^ (u64::from(n.unsigned_abs()) << 32) ^ 0x9e37_79b9_7f4a_7c15;
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Runs every live node's plan on one shared state until nothing changes: releases
    /// free members, then each contended free member goes to the first contender (in
    /// node order, as the server would grant one of them). Returns the final holders
    /// and how many members changed holder.
    fn settle(
        live: &[Node],
        mut holders: Vec<Option<Node>>,
        frozen: bool,
    ) -> (Vec<Option<Node>>, usize) {
        let start = holders.clone();
        for _ in 0..100 {
            let plans: Vec<(Node, Plan)> = live
                .iter()
                .map(|n| (*n, plan(*n, live, &holders, frozen)))
                .collect();
            let mut next = holders.clone();
            for (_, p) in &plans {
                for m in &p.release {
                    next[*m] = None;
                }
            }
            let mut changed = next != holders;
            for (n, p) in &plans {
                for m in &p.contend {
                    if next[*m].is_none() {
                        next[*m] = Some(*n);
                        changed = true;
                    }
                }
            }
            holders = next;
            if !changed {
                break;
            }
        }
        let moves = start
            .iter()
            .zip(&holders)
            .filter(|(a, b)| a.is_some() && a != b)
            .count();
        (holders, moves)
    }

    fn loads(live: &[Node], holders: &[Option<Node>]) -> Vec<usize> {
        live.iter()
            .map(|n| holders.iter().filter(|h| **h == Some(*n)).count())
            .collect()
    }

    #[test]
    fn thirty_members_on_three_nodes_spread_ten_each() {
        let live = [11, 22, 33];
        let (holders, _) = settle(&live, vec![None; 30], false);
        assert!(holders.iter().all(Option::is_some));
        assert_eq!(loads(&live, &holders), vec![10, 10, 10]);
    }

    #[test]
    fn all_on_one_node_rebalances_with_the_fewest_moves() {
        // The situation of the issue: three nodes started together, one took all 30.
        let live = [11, 22, 33];
        let (holders, moves) = settle(&live, vec![Some(11); 30], false);
        assert_eq!(loads(&live, &holders), vec![10, 10, 10]);
        assert_eq!(moves, 20);
    }

    #[test]
    fn a_fourth_node_takes_at_most_a_quarter() {
        let live = [11, 22, 33];
        let (holders, _) = settle(&live, vec![None; 30], false);
        let live4 = [11, 22, 33, 44];
        let (after, moves) = settle(&live4, holders, false);
        let l = loads(&live4, &after);
        assert!(l.iter().all(|n| (7..=8).contains(n)), "{l:?}");
        assert!(moves <= 8, "{moves} moves");
    }

    #[test]
    fn a_node_that_leaves_spreads_over_the_others() {
        let live = [11, 22, 33, 44];
        let (holders, _) = settle(&live, vec![None; 30], false);
        // 44 crashes: its members are orphans.
        let orphaned: Vec<Option<Node>> = holders
            .iter()
            .map(|h| if *h == Some(44) { None } else { *h })
            .collect();
        let live3 = [11, 22, 33];
        let before = loads(&live3, &orphaned);
        let (after, moves) = settle(&live3, orphaned, false);
        let l = loads(&live3, &after);
        assert_eq!(l, vec![10, 10, 10], "from {before:?}");
        assert_eq!(moves, 0, "nothing held moved: only orphans were placed");
        // Spread: every survivor took some.
        assert!(
            l.iter().zip(&before).all(|(a, b)| a > b),
            "{before:?} -> {l:?}"
        );
    }

    #[test]
    fn frozen_places_orphans_but_moves_nothing_held() {
        let live = [11, 22, 33];
        let mut holders = vec![Some(11); 20];
        holders.extend(vec![None; 10]);
        let (after, moves) = settle(&live, holders, true);
        assert_eq!(moves, 0);
        assert!(after.iter().all(Option::is_some));
        assert_eq!(loads(&live, &after)[0], 20);
    }

    #[test]
    fn members_in_transit_are_awaited_by_one_node() {
        // Member 0 is held by pid 99, not a live node (it is leaving): one node waits
        // for it, so that the release's announcement finds it.
        let live = [11, 22];
        let mut holders = vec![None; 4];
        holders[0] = Some(99);
        let waiting: usize = live
            .iter()
            .filter(|n| plan(**n, &live, &holders, false).contend.contains(&0))
            .count();
        assert_eq!(waiting, 1);
    }

    #[test]
    fn targets_do_not_flip_while_hand_overs_are_under_way() {
        // Five nodes with 8 each, a sixth joins; as releases complete one by one, no
        // node's target changes and no node's release set grows.
        let live: Vec<Node> = (1..=6).collect();
        let mut holders: Vec<Option<Node>> = (0..40).map(|i| Some(i / 8 + 1)).collect();
        let first: Vec<Plan> = live
            .iter()
            .map(|n| plan(*n, &live, &holders, false))
            .collect();
        for step in 0..40 {
            let plans: Vec<Plan> = live
                .iter()
                .map(|n| plan(*n, &live, &holders, false))
                .collect();
            for (p, f) in plans.iter().zip(&first) {
                assert_eq!(p.target, f.target, "step {step}");
                assert!(
                    p.release.iter().all(|m| f.release.contains(m)),
                    "step {step}"
                );
            }
            // One release completes (and its member is taken by its planned node).
            let Some((n, m)) = plans
                .iter()
                .zip(&live)
                .find_map(|(p, n)| p.release.first().map(|m| (*n, *m)))
            else {
                break;
            };
            let _ = n;
            holders[m] = None;
            let taker = live
                .iter()
                .find(|t| plan(**t, &live, &holders, false).contend.contains(&m))
                .copied();
            holders[m] = taker;
        }
    }

    #[test]
    fn a_waiting_node_keeps_waiting_for_the_same_members() {
        // Node 99 leaves with members 8..12; A (0..4) and C (4..8) wait for them.
        let live = [1, 3];
        let mut holders: Vec<Option<Node>> = (0..4).map(|_| Some(1)).collect();
        holders.extend((4..8).map(|_| Some(3)));
        holders.extend((8..12).map(|_| Some(99)));
        let first: Vec<Vec<usize>> = live
            .iter()
            .map(|n| plan(*n, &live, &holders, false).contend)
            .collect();
        // One lands where it was awaited; the others stay awaited by the same node.
        let (n, m) = if first[0].is_empty() {
            (3, first[1][0])
        } else {
            (1, first[0][0])
        };
        holders[m] = Some(n);
        for (i, node) in live.iter().enumerate() {
            let now = plan(*node, &live, &holders, false).contend;
            for x in &now {
                assert!(
                    first[i].contains(x),
                    "{node} now waits for {x}, not in {:?}",
                    first[i]
                );
            }
        }
    }

    #[test]
    fn a_node_that_is_not_live_does_nothing() {
        let p = plan(55, &[11, 22], &[None, Some(55)], false);
        assert!(p.release.is_empty() && p.contend.is_empty() && p.target.is_none());
        assert_eq!(plan(11, &[], &[None], false), Plan::default());
    }

    proptest! {
        /// From any placement, after settling: every member is held, no node holds more
        /// than ceil(M/N), and no member moved that did not have to (moves never exceed
        /// what the surplus over the targets forces).
        #[test]
        fn settles_balanced(
            n in 1usize..8,
            m in 0usize..80,
            seed in proptest::collection::vec(0usize..10, 0..80),
        ) {
            let live: Vec<Node> = (1..=n as i32).map(|i| i * 7).collect();
            let holders: Vec<Option<Node>> = (0..m)
                .map(|i| seed.get(i).and_then(|s| (*s < n).then(|| live[*s])))
                .collect();
            let (after, _) = settle(&live, holders, false);
            prop_assert!(after.iter().all(Option::is_some));
            let max = m.div_ceil(n);
            for l in loads(&live, &after) {
                prop_assert!(l <= max && l + 1 >= m / n, "load {l}, M {m}, N {n}");
            }
        }

        /// A join from a balanced placement moves at most ceil(M / (N + 1)) members.
        #[test]
        fn a_join_moves_few(n in 1usize..8, m in 0usize..80) {
            let live: Vec<Node> = (1..=n as i32).map(|i| i * 7).collect();
            let (balanced, _) = settle(&live, vec![None; m], false);
            let mut joined = live.clone();
            joined.push(1000);
            let (after, moves) = settle(&joined, balanced, false);
            prop_assert!(moves <= m.div_ceil(n + 1), "{moves} moves, M {m}, N {n}");
            for l in loads(&joined, &after) {
                prop_assert!(l <= m.div_ceil(n + 1));
            }
        }
    }
}
