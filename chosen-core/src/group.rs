//! Many singletons spread over the live nodes of a fleet.

mod placement;

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use crate::maps::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::error::{Error, Result};
use crate::key::LockKey;
use crate::lease::Lease;
use crate::manager::{LockManager, LockRequest};
use crate::singleton::{ChildError, LeaderContext, Singleton, SingletonOptions};
use crate::status::ConnectionState;

/// How a [`SingletonGroup`] places and moves its members.
#[derive(Clone, Debug)]
pub struct GroupOptions {
    singleton: SingletonOptions,
    interval: Duration,
    orphan_grace: Duration,
    flap_window: Duration,
    flap_changes: usize,
    max_nodes: u16,
}

impl Default for GroupOptions {
    fn default() -> Self {
        Self {
            singleton: SingletonOptions::default(),
            interval: Duration::from_secs(1),
            orphan_grace: Duration::from_secs(5),
            flap_window: Duration::from_secs(60),
            flap_changes: 2,
            max_nodes: 64,
        }
    }
}

impl GroupOptions {
    /// How each member's child is supervised (see [`SingletonOptions`]).
    #[must_use]
    pub fn singleton(mut self, options: SingletonOptions) -> Self {
        self.singleton = options;
        self
    }

    /// How often a node reads the placement and acts on it (default 1 s): one query of
    /// the lock table per node per interval, however many members.
    #[must_use]
    pub fn interval(mut self, interval: Duration) -> Self {
        self.interval = interval;
        self
    }

    /// How long a member may stay unheld, seen by a node that joined, before every
    /// node contends for it, whatever the placement says (default 5 s): the safety net
    /// for nodes that disagree. (During a new server term's hold no node can join, so
    /// none counts.)
    #[must_use]
    pub fn orphan_grace(mut self, grace: Duration) -> Self {
        self.orphan_grace = grace;
        self
    }

    /// Membership flapping: when one node (by node id) left `leaves` times within
    /// `window`, or that many nodes left within `window` of joining (default twice in
    /// 60 s: nodes joined and left repeatedly, e.g. a crash loop, whose default node
    /// ids differ each time), held members stop moving until no node did for
    /// `window`; members nobody holds are still placed. A scale-out or a rolling
    /// deploy of long-running nodes does not count.
    #[must_use]
    pub fn flapping(mut self, leaves: usize, window: Duration) -> Self {
        self.flap_changes = leaves;
        self.flap_window = window;
        self
    }

    /// The most nodes a group counts (default 64; each live node holds one of this many
    /// membership locks).
    #[must_use]
    pub fn max_nodes(mut self, max: u16) -> Self {
        self.max_nodes = max;
        self
    }

    fn validate(&self) -> Result<()> {
        if self.interval < Duration::from_millis(10) || self.interval > Duration::from_secs(3600) {
            return Err(Error::config(
                "GroupOptions::interval",
                format!(
                    "group interval {:?} is out of range: use between 10 ms and 1 h",
                    self.interval
                ),
            ));
        }
        if self.max_nodes == 0 || self.max_nodes > 4096 {
            return Err(Error::config(
                "GroupOptions::max_nodes",
                format!(
                    "group max_nodes {} is out of range: use between 1 and 4096",
                    self.max_nodes
                ),
            ));
        }
        if self.flap_changes == 0 {
            return Err(Error::config(
                "GroupOptions::flapping",
                "group flapping threshold must be at least one change",
            ));
        }
        Ok(())
    }
}

/// A snapshot of a group on this node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct GroupStatus {
    /// Live nodes of the group, as last seen (including this one once it joined).
    pub live_nodes: usize,
    /// Members whose singleton leads on this node.
    pub leading: Vec<String>,
    /// This node's target number of members (`None` before it joined).
    pub target: Option<usize>,
    /// Whether moves are frozen because the membership flaps.
    pub frozen: bool,
    /// Members this node handed over to rebalance, since it started.
    pub handed_over: u64,
}

/// Many singletons (the *members*) spread over the live nodes of a fleet: each member
/// runs on exactly one node, as a [`Singleton`] does, and no node runs more than
/// `ceil(M / N)` of `M` members with `N` live nodes once the placement settled.
///
/// Every node starts the group with the same name and members. Membership is learned
/// from the database alone: each node holds one of the group's membership locks, and
/// once per [`interval`](GroupOptions::interval) every node reads the lock table (one
/// query, however many members) and computes, from that one snapshot, the same plan as
/// every other node: each node's target (`M / N` or one more), which held members move
/// (an over-loaded node's surplus, handed over gracefully: the child stops, then the
/// lock is released and announced), and which node takes each member nobody holds. A
/// node acts on its own part only.
///
/// * A node joining takes at most `ceil(M / N)` members from the others; a node
///   leaving (crash or shutdown) has its members spread over the nodes below their new
///   targets.
/// * While the membership flaps, held members do not move (see
///   [`GroupOptions::flapping`]).
/// * A member whose child has finished for good (`RestartPolicy::Never`, or
///   `OnFailure` after a success) stays on the node where it finished, whatever the
///   plan: moved, it would run again on the other node. Such members count in their
///   node's load, so the balance may be off by them. (The lock is its session's: if
///   that node's session is lost, the member goes to another node and runs again.)
/// * A member nobody holds for [`orphan_grace`](GroupOptions::orphan_grace) is
///   contended for by every node: placement is a preference; the locks keep it one
///   child per member in every case.
///
/// ```no_run
/// # async fn demo(manager: chosen_core::LockManager) -> chosen_core::Result<()> {
/// use chosen_core::{GroupOptions, SingletonGroup};
///
/// let partitions: Vec<String> = (0..30).map(|i| format!("orders-partition-{i}")).collect();
/// let group = SingletonGroup::start(&manager, "orders", partitions, GroupOptions::default(),
///     |member, ctx| async move {
///         // Consume one partition until told to stop.
///         ctx.cancelled().await;
///         let _ = member;
///         Ok::<(), std::io::Error>(())
///     })?;
/// // ...
/// group.shutdown().await;
/// # Ok(()) }
/// ```
pub struct SingletonGroup {
    status: Arc<Mutex<GroupStatus>>,
    stop: CancellationToken,
    task: tokio::sync::Mutex<Option<JoinHandle<()>>>,
}

impl fmt::Debug for SingletonGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SingletonGroup")
            .field("status", &self.status())
            .finish_non_exhaustive()
    }
}

type Factory = dyn Fn(
        String,
        LeaderContext,
    ) -> std::pin::Pin<Box<dyn Future<Output = std::result::Result<(), ChildError>> + Send>>
    + Send
    + Sync;

impl SingletonGroup {
    /// Starts the group `name` with `members` on `manager`; `factory` makes the child
    /// of a member (its name and its [`LeaderContext`]) on the node that leads it.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidName`] for an empty group or member name (or one with a NUL character), a group name with `/`, or a member named
    /// twice; [`Error::InvalidConfig`] for inconsistent options.
    pub fn start<F, Fut, E>(
        manager: &LockManager,
        name: impl Into<String>,
        members: impl IntoIterator<Item = impl Into<String>>,
        options: GroupOptions,
        factory: F,
    ) -> Result<Self>
    where
        F: Fn(String, LeaderContext) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = std::result::Result<(), E>> + Send + 'static,
        E: Into<ChildError>,
    {
        let name = name.into();
        crate::names::validate_name("the group name", &name)?;
        if name.contains('/') {
            // The group's locks are `chosen.group/<group>/node-slot/<i>` and
            // `chosen.group/<group>/member/<member>`: with a `/` in group names, group
            // "a" member "b/member/c" and group "a/member/b" member "c" would share one.
            return Err(Error::InvalidName(format!(
                "the group name {name:?} contains '/', which separates the parts of the group's lock names; use another character (e.g. '-' or ':')"
            )));
        }
        options.validate()?;
        let members: Vec<String> = members.into_iter().map(Into::into).collect();
        let mut seen = BTreeSet::new();
        for m in &members {
            crate::names::validate_name(&format!("the name of a member of group {name:?}"), m)?;
            if !seen.insert(m.as_str()) {
                return Err(Error::InvalidName(format!(
                    "group {name:?} names member {m:?} twice"
                )));
            }
        }
        // Checked once here, so that starting a member later cannot fail on them.
        options.singleton.validate(manager)?;
        let factory: Arc<Factory> = Arc::new(move |member, ctx| {
            let fut = factory(member, ctx);
            Box::pin(async move { fut.await.map_err(Into::into) })
        });
        let status = Arc::new(Mutex::new(GroupStatus::default()));
        // A child of the manager's: its shutdown stops this group too (and waits for it).
        let stop = manager.stop_token();
        let task = manager.spawn_supervisor(
            Runner {
                manager: manager.clone(),
                slot_keys: (0..options.max_nodes)
                    .map(|i| manager.key_for(&slot_name(&name, i)))
                    .collect(),
                member_keys: members
                    .iter()
                    .map(|m| manager.key_for(&member_lock(&name, m)))
                    .collect(),
                name,
                members,
                options,
                factory,
                status: Arc::clone(&status),
                stop: stop.clone(),
                slot: None,
                running: HashMap::default(),
                stopping: Vec::new(),
                orphan_since: HashMap::default(),
                me: None,
                first_seen: HashMap::default(),
                last_live: BTreeMap::new(),
                leaves: VecDeque::new(),
            }
            .run(),
        );
        Ok(Self {
            status,
            stop,
            task: tokio::sync::Mutex::new(Some(task)),
        })
    }

    /// What this node runs and sees of the group right now.
    #[must_use]
    pub fn status(&self) -> GroupStatus {
        self.status
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Leaves the group: gives up its membership first (so the others plan without
    /// this node), then stops every member's child and releases its lock, announced,
    /// so the other nodes take over at once. Idempotent; waits until done.
    pub async fn shutdown(&self) {
        let _ = crate::manager::stop_supervisor(&self.stop, &self.task).await;
    }
}

impl Drop for SingletonGroup {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// The flap count of nodes that left soon after they joined, whatever their ids.
const SHORT_LIVED: &str = "\0short-lived";

fn slot_name(group: &str, i: u16) -> String {
    format!("chosen.group/{group}/node-slot/{i}")
}

/// The lock of a member: scoped to its group, so that another group's member or a
/// plain singleton of the same name is another lock.
fn member_lock(group: &str, member: &str) -> String {
    format!("chosen.group/{group}/member/{member}")
}

struct Runner {
    manager: LockManager,
    name: String,
    members: Vec<String>,
    member_keys: Vec<LockKey>,
    slot_keys: Vec<LockKey>,
    options: GroupOptions,
    factory: Arc<Factory>,
    status: Arc<Mutex<GroupStatus>>,
    stop: CancellationToken,
    /// The membership lock this node holds.
    slot: Option<Lease>,
    /// Members with a singleton on this node (leading or waiting), by index.
    running: HashMap<usize, Singleton>,
    /// Singletons being shut down (handed over, or no longer wanted), by member.
    stopping: Vec<(usize, JoinHandle<()>)>,
    /// Since when each member was seen unheld.
    orphan_since: HashMap<usize, Instant>,
    /// This node's session (backend pid) at the last step.
    me: Option<i32>,
    /// When each live pid was first seen (to tell a short-lived node).
    first_seen: HashMap<i32, Instant>,
    /// The live nodes (pid, node id) of the last snapshot.
    last_live: BTreeMap<i32, String>,
    /// When a node (by node id) left, within the flap window.
    leaves: VecDeque<(Instant, String)>,
}

impl Runner {
    async fn run(mut self) {
        let mut tick = tokio::time::interval(self.options.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                biased;
                () = self.stop.cancelled() => break,
                _ = tick.tick() => {}
            }
            if let Err(e) = self.step().await {
                debug!(group = %self.name, error = %e, "group step skipped");
            }
        }
        // Leave: the membership first, so the others plan without this node, then
        // every member (children stop, locks are released and announced).
        if let Some(slot) = self.slot.take() {
            let _ = slot.release().await;
        }
        let running: Vec<Singleton> = self.running.drain().map(|(_, s)| s).collect();
        futures_util::future::join_all(running.iter().map(Singleton::shutdown)).await;
        for (_, t) in self.stopping.drain(..) {
            let _ = t.await;
        }
        self.set_status(|s| {
            s.leading.clear();
            s.target = None;
        });
    }

    async fn step(&mut self) -> Result<()> {
        self.stopping.retain(|(_, t)| !t.is_finished());
        let me = match self.manager.connection_status() {
            ConnectionState::Connected { backend_pid, .. } => backend_pid,
            _ => return Ok(()),
        };
        if self.me != Some(me) {
            // A new session: what was seen unheld before it does not count.
            self.me = Some(me);
            self.orphan_since.clear();
        }
        // One snapshot of the group's keys (the membership locks and the members'),
        // asked together so that the manager batches them into one statement.
        let asks = self
            .slot_keys
            .iter()
            .chain(&self.member_keys)
            .map(|k| self.manager.holder(*k));
        let answers = futures_util::future::join_all(asks).await;
        let mut holders_all = Vec::with_capacity(answers.len());
        for a in answers {
            holders_all.push(a?);
        }
        let (slots, members) = holders_all.split_at(self.slot_keys.len());
        let now = crate::clock::now();
        // An ineligible node never joins: the others place every member. (Members
        // that may not lead here, by the group's singleton options, make it so too:
        // a member placed here would stay unheld, be taken over, and come back.)
        if !self.manager.options().is_eligible() || !self.options.singleton.is_eligible() {
            let live_nodes = slots.iter().flatten().count();
            self.set_status(|s| s.live_nodes = live_nodes);
            return Ok(());
        }
        // Join: hold a membership lock (the first one the snapshot shows free).
        if self.slot.as_ref().is_none_or(|l| !l.is_valid()) {
            self.slot = None;
            match slots.iter().position(Option::is_none) {
                Some(free) => {
                    self.slot = self.manager.try_acquire(self.slot_keys[free]).await?;
                }
                None => {
                    warn!(group = %self.name, max_nodes = self.options.max_nodes, "every membership lock of the group is held: this node does not join (raise GroupOptions::max_nodes)");
                }
            }
            // Acts from the next snapshot on, which shows it.
            return Ok(());
        }
        let live: BTreeMap<i32, String> = slots
            .iter()
            .flatten()
            .map(|h| (h.backend_pid, h.node_id.clone()))
            .collect();
        if !live.contains_key(&me) {
            return Ok(());
        }
        // Membership flapping: a node (by node id) that left twice within the window.
        let live_ids: BTreeSet<&String> = live.values().collect();
        for gone in self.last_live.values().filter(|id| !live_ids.contains(id)) {
            self.leaves.push_back((now, gone.clone()));
        }
        // A node that was live for less than the window and left counts too, whatever
        // its id (a crash-looping process gets a new default id each time).
        for pid in live.keys() {
            self.first_seen.entry(*pid).or_insert(now);
        }
        let window = self.options.flap_window;
        let short_lived: Vec<i32> = self
            .last_live
            .keys()
            .filter(|pid| !live.contains_key(pid))
            .filter(|pid| {
                self.first_seen
                    .get(pid)
                    .is_some_and(|t| now.duration_since(*t) < window)
            })
            .copied()
            .collect();
        for _ in short_lived {
            self.leaves.push_back((now, SHORT_LIVED.to_owned()));
        }
        self.first_seen.retain(|pid, _| live.contains_key(pid));
        while self
            .leaves
            .front()
            .is_some_and(|(t, _)| now.duration_since(*t) > self.options.flap_window)
        {
            self.leaves.pop_front();
        }
        let mut per_node: HashMap<&str, usize> = HashMap::default();
        for (_, id) in &self.leaves {
            *per_node.entry(id.as_str()).or_default() += 1;
        }
        let frozen = per_node.values().any(|n| *n >= self.options.flap_changes);
        // Act only on a view seen twice in a row when nodes joined: nodes that start
        // together would otherwise each see itself alone and take everything. A view
        // where nodes only left is acted on at once, so that their members do not wait.
        let stable = live.keys().all(|pid| self.last_live.contains_key(pid));
        if !stable {
            info!(group = %self.name, live_nodes = live.len(), "group membership changed");
        }
        self.last_live = live.clone();
        // Who holds each member: a member this node leads counts as ours even before
        // the lock table shows it.
        let holders: Vec<Option<i32>> = members
            .iter()
            .enumerate()
            .map(|(i, h)| {
                if self
                    .running
                    .get(&i)
                    .is_some_and(|s| s.leadership().is_leader())
                {
                    Some(me)
                } else {
                    h.as_ref().map(|h| h.backend_pid)
                }
            })
            .collect();
        for (i, h) in holders.iter().enumerate() {
            match h {
                Some(_) => {
                    self.orphan_since.remove(&i);
                }
                None => {
                    self.orphan_since.entry(i).or_insert(now);
                }
            }
        }
        let live_pids: Vec<i32> = live.keys().copied().collect();
        let plan = placement::plan(me, &live_pids, &holders, frozen);
        let mut wanted: BTreeSet<usize> = BTreeSet::new();
        // Members this node holds stay wanted unless the plan hands them over; a member
        // whose child has finished for good stays whatever the plan (handed over, it
        // would run again on the other node while this one lives).
        for (i, h) in holders.iter().enumerate() {
            let finished = self
                .running
                .get(&i)
                .is_some_and(|s| s.status().child == crate::ChildState::Finished);
            if *h == Some(me) && (!stable || !plan.release.contains(&i) || finished) {
                wanted.insert(i);
            }
        }
        if stable {
            wanted.extend(plan.contend.iter().copied());
            // The safety net: long-unheld members are everyone's.
            for (i, since) in &self.orphan_since {
                if now.duration_since(*since) >= self.options.orphan_grace {
                    wanted.insert(*i);
                }
            }
        } else {
            // Keep waiting where this node already waits.
            wanted.extend(self.running.keys().copied());
        }
        // Hand over and drop what is not wanted (a waiting singleton stops at once).
        let unwanted: Vec<usize> = self
            .running
            .keys()
            .copied()
            .filter(|i| !wanted.contains(i))
            .collect();
        let mut handed = 0;
        for i in unwanted {
            if let Some(s) = self.running.remove(&i) {
                if s.leadership().is_leader() {
                    handed += 1;
                    info!(group = %self.name, member = %self.members[i], "handing the member over to rebalance");
                }
                self.stopping
                    .push((i, tokio::spawn(async move { s.shutdown().await })));
            }
        }
        for i in wanted {
            // Not while its previous singleton on this node still stops: the new one
            // would be handed the lock locally, and the node that should take it over
            // would never see it released.
            if self.running.contains_key(&i) || self.stopping.iter().any(|(m, _)| *m == i) {
                continue;
            }
            let factory = Arc::clone(&self.factory);
            let member = self.members[i].clone();
            let started = Singleton::start_request(
                &self.manager,
                LockRequest::internal(member_lock(&self.name, &member)),
                self.options.singleton.clone(),
                move |ctx| factory(member.clone(), ctx),
            );
            match started {
                Ok(s) => {
                    self.running.insert(i, s);
                }
                Err(e) => {
                    warn!(group = %self.name, member = %self.members[i], error = %e, "could not start the member's singleton");
                }
            }
        }
        let leading: Vec<String> = {
            let mut v: Vec<(usize, String)> = self
                .running
                .iter()
                .filter(|(_, s)| s.leadership().is_leader())
                .map(|(i, _)| (*i, self.members[*i].clone()))
                .collect();
            v.sort();
            v.into_iter().map(|(_, m)| m).collect()
        };
        let live_nodes = live.len();
        self.set_status(|s| {
            s.live_nodes = live_nodes;
            s.leading = leading;
            s.target = plan.target;
            s.frozen = frozen;
            s.handed_over += handed;
        });
        Ok(())
    }

    fn set_status(&self, f: impl FnOnce(&mut GroupStatus)) {
        f(&mut self.status.lock().unwrap_or_else(PoisonError::into_inner));
    }
}
