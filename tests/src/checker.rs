//! The independent checker: reads the nodes' event histories and judges them against
//! the contract. Pure functions over events, so it is tested with made-up histories.
//!
//! A run of a child *acts* from `child_started` to its first `lease_lost` or
//! `child_stopped` (or the moment its process was killed), not merely at its ticks: an
//! overlap of any length between the acting spans of two processes is a violation,
//! except the documented window of a process frozen for longer than the server release
//! time (it may finish the step it checked before the freeze, fenced by a smaller
//! token, and must not tick again). Every injected fault is checked to have taken
//! effect, and every fault that took a holder's lease away to be followed by a
//! takeover.

use std::collections::{BTreeMap, HashMap};
use std::fmt::{self, Write as _};
use std::time::Duration;

mod placement;

pub use placement::{Placement, PlacementSpec};

/// One event line of a `node` process, with the process instance that emitted it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// `CLOCK_MONOTONIC` microseconds (the `mono_us` field): one clock for every process
    /// on the machine, never jumping backwards.
    pub mono_us: u64,
    /// The node id.
    pub node: String,
    /// Which process of that node (a restarted node is a new instance).
    pub instance: u32,
    /// The event name.
    pub event: String,
    /// The singleton, for child and leadership events.
    pub singleton: Option<String>,
    /// The fencing token, where given.
    pub token: Option<u64>,
    /// The reason, where given.
    pub reason: Option<String>,
    /// The shutdown phase, where given.
    pub phase: Option<String>,
    /// The session generation, where given (`connected`).
    pub generation: Option<u64>,
}

impl Event {
    /// Parses one JSON line of the `node` test process (flat object; strings, numbers, null).
    #[must_use]
    pub fn parse(line: &str, instance: u32) -> Option<Self> {
        let fields = parse_flat_json(line)?;
        let get = |k: &str| fields.get(k).and_then(|v| v.clone());
        Some(Self {
            mono_us: get("mono_us")?.parse().ok()?,
            node: get("node")?,
            instance,
            event: get("event")?,
            singleton: get("singleton"),
            token: get("token").and_then(|t| t.parse().ok()),
            reason: get("reason"),
            phase: get("phase"),
            generation: get("generation").and_then(|g| g.parse().ok()),
        })
    }
}

fn parse_flat_json(line: &str) -> Option<HashMap<String, Option<String>>> {
    let mut out = HashMap::new();
    let mut chars = line
        .trim()
        .strip_prefix('{')?
        .strip_suffix('}')?
        .chars()
        .peekable();
    let read_string = |chars: &mut std::iter::Peekable<std::str::Chars<'_>>| -> Option<String> {
        let mut s = String::new();
        loop {
            match chars.next()? {
                '"' => return Some(s),
                '\\' => match chars.next()? {
                    'n' => s.push('\n'),
                    'r' => s.push('\r'),
                    't' => s.push('\t'),
                    'u' => {
                        let hex: String = (0..4).filter_map(|_| chars.next()).collect();
                        s.push(char::from_u32(u32::from_str_radix(&hex, 16).ok()?)?);
                    }
                    c => s.push(c),
                },
                c => s.push(c),
            }
        }
    };
    loop {
        while chars.peek().is_some_and(|c| c.is_whitespace() || *c == ',') {
            chars.next();
        }
        match chars.next() {
            None => return Some(out),
            Some('"') => {}
            Some(_) => return None,
        }
        let key = read_string(&mut chars)?;
        if chars.next()? != ':' {
            return None;
        }
        let value = if chars.peek() == Some(&'"') {
            chars.next();
            Some(read_string(&mut chars)?)
        } else {
            let raw: String = std::iter::from_fn(|| chars.next_if(|c| *c != ',')).collect();
            let raw = raw.trim().to_owned();
            (raw != "null").then_some(raw)
        };
        out.insert(key, value);
    }
}

/// A fault the nemesis injected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FaultRecord {
    /// The fault kind (a short fixed name, see [`crate::nemesis::FAULT_KINDS`]).
    pub kind: &'static str,
    /// The node process it hit (node id and instance), or `None` for the server.
    pub target: Option<(String, u32)>,
    /// When it began (`CLOCK_MONOTONIC` µs): the signal sent, the proxy switched, the
    /// backend terminated, the server stop begun.
    pub at_us: u64,
    /// When it was healed (`CLOCK_MONOTONIC` µs): for a freeze the moment just before
    /// SIGCONT, else the moment the fault was undone or the server was back.
    pub healed_us: u64,
}

/// The timing the nodes ran with.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    /// `server_release_after`: a silence longer than it marks a freeze after which a
    /// process may find another holder.
    pub release: Duration,
    /// `lease_timeout`: a black hole longer than it (plus a second) must cost the
    /// holder its lease.
    pub lease_timeout: Duration,
}

impl Default for Timing {
    /// The library's defaults (7 s, 3 s).
    fn default() -> Self {
        Self {
            release: Duration::from_secs(7),
            lease_timeout: Duration::from_secs(3),
        }
    }
}

/// One run of a child: it acts from `start_us` to `end_us`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Run {
    node: String,
    instance: u32,
    token: u64,
    start_us: u64,
    /// First `lease_lost` or `child_stopped`, or the kill of its process; `u64::MAX`
    /// when it never ended.
    end_us: u64,
    /// Whether it ended with a `lease_lost` (not a graceful stop or hand-over).
    lost: bool,
    ticks: Vec<u64>,
    /// A freeze longer than the release time inside the run: the process was silent
    /// from `.0` to `.1`; it acted on old checks ("stale") from `.1` to `end_us`.
    freeze: Option<(u64, u64)>,
}

impl Run {
    fn same_process(&self, other: &Self) -> bool {
        self.node == other.node && self.instance == other.instance
    }

    fn same_lease(&self, other: &Self) -> bool {
        self.same_process(other) && self.token == other.token
    }

    fn label(&self) -> String {
        format!("{}#{} (token {})", self.node, self.instance, self.token)
    }
}

/// Two processes acting as the holder of one singleton at once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Overlap {
    /// The singleton.
    pub singleton: String,
    /// The two runs (`node#instance (token t)`).
    pub runs: (String, String),
    /// How long they overlapped.
    pub duration: Duration,
    /// When it began (`CLOCK_MONOTONIC` µs).
    pub at_us: u64,
}

/// A process that woke up from a freeze longer than the server release time while
/// another process held the lock, and acted on a check made before the freeze until it
/// reported the loss (the one documented window).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StaleWindow {
    /// The singleton.
    pub singleton: String,
    /// The stale process.
    pub node: String,
    /// How long the stale process acted after waking.
    pub duration: Duration,
    /// Its fencing token.
    pub stale_token: u64,
    /// The token of the holder at that time (strictly greater, or the check failed).
    pub holder_token: u64,
}

/// What the checker found.
#[derive(Debug, Clone, Default)]
pub struct Verdict {
    /// Overlaps outside the documented window: must be empty.
    pub overlaps: Vec<Overlap>,
    /// Runs whose token did not grow over the previous holder's, and stale windows not
    /// fenced by a greater token: must be empty.
    pub token_regressions: Vec<String>,
    /// Events the contract forbids (a tick after the run's end or outside a run, a
    /// child started twice, a run that never ended): must be empty.
    pub forbidden: Vec<String>,
    /// Faults whose effect the history does not show (a frozen process that spoke, a
    /// cut without a disconnect, ...): must be empty, or the run proved nothing.
    pub ineffective: Vec<String>,
    /// Faults that took a holder's lease away with no takeover after: must be empty.
    pub missing_takeovers: Vec<String>,
    /// The documented window, measured.
    pub stale_windows: Vec<StaleWindow>,
    /// Ticks stamped after their process reported its session lost, within the grace
    /// of a status report that trails the revocation: how many, and the latest.
    pub late_ticks: (usize, Duration),
    /// Per fault kind: takeover latencies (fault injected -> a new lease's child
    /// running) for the singletons the fault took away.
    pub takeovers: BTreeMap<&'static str, Vec<Duration>>,
    /// Per fault kind: how many were injected.
    pub faults: BTreeMap<&'static str, usize>,
    /// Total time with no child running, summed over singletons, outside server
    /// outages.
    pub leaderless: Duration,
    /// The longest time one singleton had no child running, outside server outages.
    pub longest_leaderless: Duration,
    /// Child runs seen.
    pub runs: usize,
    /// Ticks seen.
    pub ticks: usize,
    /// Singletons seen.
    pub singletons: usize,
    /// The placement judgement, when a group was named ([`check_with`]).
    pub placement: Option<Placement>,
}

impl Verdict {
    /// `true` when the history honours the contract *and* shows every fault's effect
    /// and every takeover.
    #[must_use]
    pub fn ok(&self) -> bool {
        self.safe() && self.ineffective.is_empty() && self.missing_takeovers.is_empty()
    }

    /// `true` when the history honours the safety contract (no overlap, no token
    /// regression, no forbidden event).
    #[must_use]
    pub fn safe(&self) -> bool {
        self.overlaps.is_empty() && self.token_regressions.is_empty() && self.forbidden.is_empty()
    }
}

/// How long after a SIGKILL or SIGSTOP was sent its process may still stamp events (the
/// signal reaches a thread running on another core within microseconds).
const SIGNAL_SLACK_US: u64 = 50_000;

/// How late a tick may be stamped after its process reported its session lost before
/// it counts as forbidden (the status report and the revocation are separate steps).
const LATE_TICK_GRACE: Duration = Duration::from_secs(1);

/// How long after a slow database is fast again a holder must still hold what it held.
const LATENCY_AFTERMATH_US: u64 = 3_000_000;

/// How long after a fault was healed its effect (a disconnect, a lost lease) may show.
const EFFECT_BOUND_US: u64 = 10_000_000;

/// Faults that hit one node process; the others hit the server.
fn is_server_fault(kind: &str) -> bool {
    matches!(
        kind,
        "restart_fast" | "restart_immediate" | "server_down" | "failover"
    )
}

/// Judges a history. `timing` is what the nodes ran with.
#[must_use]
pub fn check(events: &[Event], faults: &[FaultRecord], timing: Timing) -> Verdict {
    check_with(events, faults, timing, None)
}

/// Judges a history as [`check`] does and, when `group` is given, that group's
/// placement over time (see [`Placement`]).
#[must_use]
pub fn check_with(
    events: &[Event],
    faults: &[FaultRecord],
    timing: Timing,
    group: Option<&PlacementSpec>,
) -> Verdict {
    let mut v = Verdict::default();
    let mut events: Vec<&Event> = events.iter().collect();
    events.sort_by_key(|e| e.mono_us);
    let release_us = timing.release.as_micros() as u64;

    // When each killed process ended (its runs end there at the latest).
    let mut killed_at: HashMap<(String, u32), u64> = HashMap::new();
    for f in faults {
        if let (Some((node, instance)), "sigkill") = (&f.target, f.kind) {
            killed_at.insert((node.clone(), *instance), f.at_us);
        }
    }

    // Per process: event times (to find freezes), and since when its session is lost.
    let mut times: HashMap<(String, u32), Vec<u64>> = HashMap::new();
    let mut session_down: HashMap<(String, u32), Option<u64>> = HashMap::new();
    let mut open: HashMap<(String, u32, String), Run> = HashMap::new();
    let mut runs: BTreeMap<String, Vec<Run>> = BTreeMap::new();

    for e in &events {
        let proc_key = (e.node.clone(), e.instance);
        times.entry(proc_key.clone()).or_default().push(e.mono_us);
        match e.event.as_str() {
            "disconnected" => {
                session_down
                    .entry(proc_key.clone())
                    .or_insert(None)
                    .get_or_insert(e.mono_us);
            }
            "connected" => {
                session_down.insert(proc_key.clone(), None);
            }
            _ => {}
        }
        let Some(s) = &e.singleton else { continue };
        let key = (e.node.clone(), e.instance, s.clone());
        let token = e.token.unwrap_or(0);
        match e.event.as_str() {
            "child_started" => {
                if let Some(prev) = open.remove(&key) {
                    v.forbidden.push(format!(
                        "{}#{} started {s} at {} while its run with token {} had not stopped",
                        e.node, e.instance, e.mono_us, prev.token
                    ));
                    runs.entry(s.clone()).or_default().push(prev);
                }
                open.insert(
                    key,
                    Run {
                        node: e.node.clone(),
                        instance: e.instance,
                        token,
                        start_us: e.mono_us,
                        end_us: u64::MAX,
                        lost: false,
                        ticks: Vec::new(),
                        freeze: None,
                    },
                );
            }
            "child_tick" => {
                v.ticks += 1;
                if let Some(Some(down_at)) = session_down.get(&proc_key).copied() {
                    let late = Duration::from_micros(e.mono_us.saturating_sub(down_at));
                    if late > LATE_TICK_GRACE {
                        v.forbidden.push(format!(
                            "{}#{} ticked {s} at {}, {late:?} after reporting its session lost",
                            e.node, e.instance, e.mono_us
                        ));
                    } else {
                        v.late_ticks.0 += 1;
                        v.late_ticks.1 = v.late_ticks.1.max(late);
                    }
                }
                match open.get_mut(&key) {
                    Some(run) if run.end_us != u64::MAX => v.forbidden.push(format!(
                        "{}#{} ticked {s} at {}, after its run ended at {} (lease lost)",
                        e.node, e.instance, e.mono_us, run.end_us
                    )),
                    Some(run) if run.token != token => v.forbidden.push(format!(
                        "{}#{} ticked {s} with token {token} in a run with token {}",
                        e.node, e.instance, run.token
                    )),
                    Some(run) => run.ticks.push(e.mono_us),
                    None => v.forbidden.push(format!(
                        "{}#{} ticked {s} at {} outside a run",
                        e.node, e.instance, e.mono_us
                    )),
                }
            }
            "lease_lost" | "child_stopped" => {
                if let Some(run) = open.get_mut(&key) {
                    run.end_us = run.end_us.min(e.mono_us);
                    run.lost |= e.event == "lease_lost";
                    if e.event == "child_stopped" {
                        let run = open.remove(&key).expect("BUG: checked");
                        runs.entry(s.clone()).or_default().push(run);
                    }
                }
            }
            _ => {}
        }
    }
    for ((node, instance, s), mut run) in open {
        if let Some(at) = killed_at.get(&(node.clone(), instance)) {
            run.end_us = run.end_us.min(*at);
        } else if run.end_us == u64::MAX {
            v.forbidden.push(format!(
                "{node}#{instance} never reported the end of its {s} run (token {}), and was not killed",
                run.token
            ));
        }
        runs.entry(s).or_default().push(run);
    }

    // Freezes: a silence of a process longer than the release time inside a run makes
    // the rest of that run stale.
    for list in runs.values_mut() {
        for run in list.iter_mut() {
            let Some(ts) = times.get(&(run.node.clone(), run.instance)) else {
                continue;
            };
            let end = run.end_us.min(ts.last().copied().unwrap_or(run.end_us));
            run.freeze = ts
                .windows(2)
                .find(|p| p[0] >= run.start_us && p[1] <= end && p[1] - p[0] > release_us)
                .map(|p| (p[0], p[1]));
        }
    }

    // When each process began a graceful shutdown: runs it ends then were not taken by
    // an earlier fault.
    let mut shutdown_at: HashMap<(String, u32), u64> = HashMap::new();
    for e in &events {
        if e.event == "shutdown" && e.phase.as_deref() == Some("begin") {
            shutdown_at
                .entry((e.node.clone(), e.instance))
                .or_insert(e.mono_us);
        }
    }
    let outages: Vec<(u64, u64)> = faults
        .iter()
        .filter(|f| is_server_fault(f.kind))
        .map(|f| (f.at_us, f.healed_us))
        .collect();
    for f in faults {
        *v.faults.entry(f.kind).or_default() += 1;
    }
    v.singletons = runs.len();
    for (singleton, list) in &mut runs {
        list.sort_by_key(|r| r.start_us);
        v.runs += list.len();
        check_overlaps(singleton, list, &mut v);
        // Tokens grow from holder to holder.
        for pair in list.windows(2) {
            let (a, b) = (&pair[0], &pair[1]);
            if !a.same_lease(b) && b.token <= a.token {
                v.token_regressions.push(format!(
                    "{singleton}: {} started after {}",
                    b.label(),
                    a.label()
                ));
            }
        }
        // Leaderless time, less server outages.
        let mut covered_until = list.first().map_or(0, |r| r.end_us);
        for r in list.iter().skip(1) {
            if r.start_us > covered_until {
                let (lo, hi) = (covered_until, r.start_us);
                let in_outage: u64 = outages
                    .iter()
                    .map(|(a, b)| hi.min(*b).saturating_sub(lo.max(*a)))
                    .sum();
                let gap = Duration::from_micros((hi - lo).saturating_sub(in_outage));
                v.leaderless += gap;
                v.longest_leaderless = v.longest_leaderless.max(gap);
            }
            covered_until = covered_until.max(r.end_us);
        }
        check_takeovers(singleton, list, faults, &shutdown_at, release_us, &mut v);
    }
    check_fault_effects(&events, faults, &runs, timing, &mut v);
    if let Some(spec) = group {
        // Each process runs from its first event to its last (or its kill).
        let spans: HashMap<(String, u32), (u64, u64)> = times
            .iter()
            .map(|(process, ts)| {
                let from = ts.first().copied().unwrap_or(0);
                let to = ts.last().copied().unwrap_or(from);
                let to = killed_at.get(process).map_or(to, |k| to.min(*k));
                (process.clone(), (from, to))
            })
            .collect();
        v.placement = Some(placement::judge(
            spec,
            &runs,
            faults,
            &spans,
            &killed_at,
            &shutdown_at,
        ));
    }
    v
}

/// Overlaps of acting spans between different processes. An overlap with the stale
/// part of a run (after a freeze) is the documented window when the stale run ticked
/// no more and the other holder's token is greater; anything else is a violation.
fn check_overlaps(singleton: &str, list: &[Run], v: &mut Verdict) {
    // (from, to, stale) segments in which a run acts.
    let segments = |r: &Run| -> Vec<(u64, u64, bool)> {
        match r.freeze {
            None => vec![(r.start_us, r.end_us, false)],
            Some((silent, woke)) => vec![(r.start_us, silent, false), (woke, r.end_us, true)],
        }
    };
    for (i, a) in list.iter().enumerate() {
        for b in &list[i + 1..] {
            if a.same_process(b) {
                continue;
            }
            for (a_lo, a_hi, a_stale) in segments(a) {
                for (b_lo, b_hi, b_stale) in segments(b) {
                    let (lo, hi) = (a_lo.max(b_lo), a_hi.min(b_hi));
                    // A stale segment may be a single instant (the process reported
                    // the loss as the first thing after waking): it still counts.
                    if lo > hi || (lo == hi && !a_stale && !b_stale) {
                        continue;
                    }
                    let stale = match (a_stale, b_stale) {
                        (true, false) => Some((a, b)),
                        (false, true) => Some((b, a)),
                        _ => None,
                    };
                    if let Some((s, holder)) = stale {
                        let woke = s.freeze.expect("BUG: stale without a freeze").1;
                        if s.ticks.iter().any(|t| *t >= woke) {
                            v.forbidden.push(format!(
                                "{singleton}: {} ticked after waking from a freeze while {} held it",
                                s.label(),
                                holder.label()
                            ));
                        } else if holder.token <= s.token {
                            v.token_regressions.push(format!(
                                "{singleton}: stale {} is not fenced by holder {}",
                                s.label(),
                                holder.label()
                            ));
                        } else {
                            v.stale_windows.push(StaleWindow {
                                singleton: singleton.to_owned(),
                                node: s.node.clone(),
                                duration: Duration::from_micros(hi - lo),
                                stale_token: s.token,
                                holder_token: holder.token,
                            });
                        }
                        continue;
                    }
                    v.overlaps.push(Overlap {
                        singleton: singleton.to_owned(),
                        runs: (a.label(), b.label()),
                        duration: Duration::from_micros(hi - lo),
                        at_us: lo,
                    });
                }
            }
        }
    }
}

/// For each fault that ended a holder's run (before the next fault, and within the
/// release time after it was healed), a run under a new lease must start after it.
fn check_takeovers(
    singleton: &str,
    list: &[Run],
    faults: &[FaultRecord],
    shutdown_at: &HashMap<(String, u32), u64>,
    release_us: u64,
    v: &mut Verdict,
) {
    let mut by_time: Vec<&FaultRecord> = faults.iter().collect();
    by_time.sort_by_key(|f| f.at_us);
    for (i, f) in by_time.iter().enumerate() {
        let next_fault = by_time.get(i + 1).map_or(u64::MAX, |n| n.at_us);
        let limit = (f.healed_us + release_us + 2_000_000).min(next_fault);
        for holder in list.iter().filter(|r| {
            r.start_us <= f.at_us
                && r.end_us >= f.at_us
                && r.end_us <= limit
                && f.target
                    .as_ref()
                    .is_none_or(|(n, inst)| *n == r.node && *inst == r.instance)
                // A run ended by its process's own graceful shutdown was taken by that
                // shutdown (the `sigterm` fault, or the end of the run), not by this.
                && (f.kind == "sigterm"
                    || shutdown_at
                        .get(&(r.node.clone(), r.instance))
                        .is_none_or(|at| r.end_us < *at))
        }) {
            match list
                .iter()
                .find(|r| r.start_us > f.at_us && !r.same_lease(holder))
            {
                Some(next) => v
                    .takeovers
                    .entry(f.kind)
                    .or_default()
                    .push(Duration::from_micros(next.start_us - f.at_us)),
                None => v.missing_takeovers.push(format!(
                    "{singleton}: {} at {} ended {} but no other lease took over",
                    f.kind,
                    f.at_us,
                    holder.label()
                )),
            }
        }
    }
}

/// Checks from the history that every fault took effect.
fn check_fault_effects(
    events: &[&Event],
    faults: &[FaultRecord],
    runs: &BTreeMap<String, Vec<Run>>,
    timing: Timing,
    v: &mut Verdict,
) {
    fn of<'a>(
        events: &'a [&'a Event],
        node: &'a str,
        instance: u32,
    ) -> impl Iterator<Item = &'a &'a Event> + 'a {
        events
            .iter()
            .filter(move |e| e.node == node && e.instance == instance)
    }
    let seen = |node: &str, instance: u32, event: &str, from: u64, to: u64| {
        of(events, node, instance).any(|e| e.event == event && e.mono_us >= from && e.mono_us <= to)
    };
    // The session ended between `from` and `to`: a `disconnected`, or a `connected` of
    // a newer generation (the node reports connection states as it sees them, and a
    // reconnect fast enough can hide the disconnected state from it).
    let session_ended = |node: &str, instance: u32, from: u64, to: u64| {
        let before = of(events, node, instance)
            .filter(|e| e.event == "connected" && e.mono_us < from)
            .filter_map(|e| e.generation)
            .max()
            .unwrap_or(0);
        seen(node, instance, "disconnected", from, to)
            || of(events, node, instance).any(|e| {
                e.event == "connected"
                    && e.mono_us >= from
                    && e.mono_us <= to
                    && e.generation.is_some_and(|g| g > before)
            })
    };
    for f in faults {
        let what = format!("{} at {}", f.kind, f.at_us);
        let bound = f.healed_us + EFFECT_BOUND_US;
        let Some((node, instance)) = &f.target else {
            // The server went away: every process alive then must see its session end.
            let mut alive: BTreeMap<&str, u32> = BTreeMap::new();
            for e in events.iter().filter(|e| e.mono_us < f.at_us) {
                let i = alive.entry(&e.node).or_insert(e.instance);
                *i = (*i).max(e.instance);
            }
            for (node, instance) in alive {
                let killed = faults.iter().any(|k| {
                    k.target.as_ref() == Some(&(node.to_owned(), instance))
                        && matches!(k.kind, "sigkill" | "sigterm")
                        && k.at_us < f.at_us
                });
                if !killed && !session_ended(node, instance, f.at_us, bound) {
                    v.ineffective.push(format!(
                        "{what}: {node}#{instance} never reported a disconnect"
                    ));
                }
            }
            continue;
        };
        let (node, instance) = (node.as_str(), *instance);
        let holding: Vec<&Run> = runs
            .values()
            .flatten()
            .filter(|r| {
                r.node == node
                    && r.instance == instance
                    && r.start_us <= f.at_us
                    && r.end_us > f.at_us
            })
            .collect();
        match f.kind {
            "sigkill" | "sigterm" => {
                if f.kind == "sigkill" {
                    if let Some(e) =
                        of(events, node, instance).find(|e| e.mono_us > f.at_us + SIGNAL_SLACK_US)
                    {
                        v.ineffective.push(format!(
                            "{what}: {node}#{instance} still spoke at {} ({})",
                            e.mono_us, e.event
                        ));
                    }
                } else if !of(events, node, instance).any(|e| {
                    e.event == "shutdown"
                        && e.phase.as_deref() == Some("done")
                        && e.mono_us >= f.at_us
                }) {
                    v.ineffective.push(format!(
                        "{what}: {node}#{instance} never finished its shutdown"
                    ));
                }
                if !seen(node, instance + 1, "connected", f.at_us, u64::MAX) {
                    v.ineffective.push(format!(
                        "{what}: no new instance of {node} connected after it"
                    ));
                }
            }
            "sigstop_short" | "sigstop_long" => {
                if let Some(e) = of(events, node, instance)
                    .find(|e| e.mono_us > f.at_us + SIGNAL_SLACK_US && e.mono_us < f.healed_us)
                {
                    v.ineffective.push(format!(
                        "{what}: {node}#{instance} spoke while stopped, at {} ({})",
                        e.mono_us, e.event
                    ));
                }
                // Frozen past the server's idle timeout: the session is gone on waking.
                if f.kind == "sigstop_long" && !session_ended(node, instance, f.healed_us, bound) {
                    v.ineffective.push(format!(
                        "{what}: {node}#{instance} never reported its session lost after waking"
                    ));
                }
            }
            "cut" | "terminate_backend" if !session_ended(node, instance, f.at_us, bound) => {
                v.ineffective.push(format!(
                    "{what}: {node}#{instance} never reported a disconnect"
                ));
            }
            "latency" => {
                // A steady slow database below the heartbeat's bound is not a dead
                // one: the holder keeps its session and every lease through it.
                if session_ended(node, instance, f.at_us, f.healed_us) {
                    v.ineffective.push(format!(
                        "{what}: {node}#{instance} lost its session under a slow database"
                    ));
                }
                // Nor just after it: the answers delayed under it still arrive in time.
                // (Until the next fault, which may take them away.)
                let next = faults
                    .iter()
                    .map(|n| n.at_us)
                    .filter(|at| *at > f.at_us)
                    .min()
                    .unwrap_or(u64::MAX);
                let aftermath = (f.healed_us + LATENCY_AFTERMATH_US).min(next);
                // (A graceful stop, a group's hand-over, is not a loss.)
                for r in holding.iter().filter(|r| r.lost && r.end_us < aftermath) {
                    v.ineffective.push(format!(
                        "{what}: {} lost its lease under a slow database or just after it",
                        r.label()
                    ));
                }
            }
            "blackhole" => {
                let long = f.healed_us - f.at_us
                    >= (timing.lease_timeout + Duration::from_secs(1)).as_micros() as u64;
                // The holder stops acting (lease_lost, or its child stopped) while
                // the black hole lasts.
                for r in holding.iter().filter(|r| long && r.end_us > f.healed_us) {
                    v.ineffective.push(format!(
                        "{what}: {} kept its lease through a {} ms black hole",
                        r.label(),
                        (f.healed_us - f.at_us) / 1000
                    ));
                }
            }
            _ => {}
        }
    }
}

fn percentile(sorted: &[Duration], p: usize) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[(sorted.len() * p / 100).min(sorted.len() - 1)]
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ms = |d: Duration| format!("{:.0}", d.as_secs_f64() * 1000.0);
        writeln!(
            f,
            "| fault | injected | takeovers | p50 ms | p99 ms | max ms |"
        )?;
        writeln!(f, "|---|---|---|---|---|---|")?;
        for (kind, count) in &self.faults {
            let mut t = self.takeovers.get(kind).cloned().unwrap_or_default();
            t.sort();
            writeln!(
                f,
                "| {kind} | {count} | {} | {} | {} | {} |",
                t.len(),
                ms(percentile(&t, 50)),
                ms(percentile(&t, 99)),
                ms(t.last().copied().unwrap_or_default())
            )?;
        }
        let mut s = String::new();
        let _ = write!(
            s,
            "\nsingletons {}, child runs {}, ticks {}; overlaps {} (outside the documented window), token regressions {}, forbidden events {}, ineffective faults {}, missing takeovers {}; stale-window events {}",
            self.singletons,
            self.runs,
            self.ticks,
            self.overlaps.len(),
            self.token_regressions.len(),
            self.forbidden.len(),
            self.ineffective.len(),
            self.missing_takeovers.len(),
            self.stale_windows.len()
        );
        if let Some(max) = self.stale_windows.iter().map(|w| w.duration).max() {
            let _ = write!(
                s,
                " (longest {} ms, every one fenced by a larger token)",
                ms(max)
            );
        }
        let _ = write!(
            s,
            "; leaderless time outside server outages {} ms (longest {} ms); ticks stamped just after a reported loss {} (latest {} ms after)",
            ms(self.leaderless),
            ms(self.longest_leaderless),
            self.late_ticks.0,
            ms(self.late_ticks.1)
        );
        writeln!(f, "{s}")?;
        for o in &self.overlaps {
            writeln!(f, "OVERLAP {o:?}")?;
        }
        for t in &self.token_regressions {
            writeln!(f, "TOKEN REGRESSION {t}")?;
        }
        for e in &self.forbidden {
            writeln!(f, "FORBIDDEN {e}")?;
        }
        for e in &self.ineffective {
            writeln!(f, "INEFFECTIVE FAULT {e}")?;
        }
        for e in &self.missing_takeovers {
            writeln!(f, "MISSING TAKEOVER {e}")?;
        }
        if let Some(p) = &self.placement {
            writeln!(f, "{p}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn evi(ts_ms: u64, node: &str, instance: u32, event: &str, token: u64) -> Event {
        Event {
            mono_us: ts_ms * 1000,
            node: node.to_owned(),
            instance,
            event: event.to_owned(),
            singleton: Some("s".to_owned()),
            token: Some(token),
            reason: None,
            phase: None,
            generation: None,
        }
    }

    fn ev(ts_ms: u64, node: &str, event: &str, token: u64) -> Event {
        evi(ts_ms, node, 0, event, token)
    }

    fn node_ev(ts_ms: u64, node: &str, instance: u32, event: &str) -> Event {
        Event {
            singleton: None,
            token: None,
            ..evi(ts_ms, node, instance, event, 0)
        }
    }

    fn run_i(node: &str, instance: u32, from: u64, to: u64, token: u64) -> Vec<Event> {
        let mut out = vec![evi(from, node, instance, "child_started", token)];
        let mut t = from + 50;
        while t < to {
            out.push(evi(t, node, instance, "child_tick", token));
            t += 50;
        }
        out.push(evi(to, node, instance, "child_stopped", token));
        out
    }

    fn run(node: &str, from: u64, to: u64, token: u64) -> Vec<Event> {
        run_i(node, 0, from, to, token)
    }

    fn fault(kind: &'static str, node: Option<&str>, at_ms: u64, healed_ms: u64) -> FaultRecord {
        FaultRecord {
            kind,
            target: node.map(|n| (n.to_owned(), 0)),
            at_us: at_ms * 1000,
            healed_us: healed_ms * 1000,
        }
    }

    fn judge(h: &[Event], faults: &[FaultRecord]) -> Verdict {
        check(h, faults, Timing::default())
    }

    #[test]
    fn parses_node_lines() {
        let e = Event::parse(
            r#"{"mono_us":17,"ts_us":99,"node":"n-1","event":"lease_lost","singleton":"a \"b\"","token":9,"reason":"x\ny"}"#,
            3,
        )
        .unwrap();
        assert_eq!(e.mono_us, 17);
        assert_eq!(e.singleton.as_deref(), Some("a \"b\""));
        assert_eq!(e.token, Some(9));
        assert_eq!(e.reason.as_deref(), Some("x\ny"));
        let e = Event::parse(
            r#"{"mono_us":1,"ts_us":1,"node":"n","event":"shutdown","phase":"done"}"#,
            0,
        )
        .unwrap();
        assert_eq!(e.phase.as_deref(), Some("done"));
        assert!(Event::parse("not json", 0).is_none());
        // Without the monotonic stamp a line is not an event: the checker cannot
        // order it.
        assert!(Event::parse(r#"{"ts_us":1,"node":"n","event":"connected"}"#, 0).is_none());
    }

    #[test]
    fn a_clean_handover_passes() {
        let mut h = run("a", 0, 1000, 5);
        h.extend(run("b", 1100, 2000, 6));
        let v = judge(&h, &[]);
        assert!(v.ok(), "{v}");
        assert_eq!(v.runs, 2);
    }

    #[test]
    fn overlapping_ticks_are_caught() {
        let mut h = run("a", 0, 1000, 5);
        h.extend(run("b", 800, 2000, 6));
        let v = judge(&h, &[]);
        assert!(!v.safe());
        assert_eq!(v.overlaps.len(), 1, "{v}");
    }

    #[test]
    fn an_overlap_shorter_than_one_tick_is_caught() {
        // a's last tick is at 950; it loses its lease at 1010. b starts at 1000, so
        // both acted for 10 ms, between two of a's ticks.
        let mut h = vec![ev(0, "a", "child_started", 5)];
        for t in (50..1000).step_by(50) {
            h.push(ev(t, "a", "child_tick", 5));
        }
        h.push(ev(1010, "a", "lease_lost", 5));
        h.push(ev(1020, "a", "child_stopped", 5));
        h.extend(run("b", 1000, 2000, 6));
        let v = judge(&h, &[]);
        assert_eq!(v.overlaps.len(), 1, "{v}");
        assert_eq!(v.overlaps[0].duration, Duration::from_millis(10));
        // b starting just after a's lease_lost (but before its child_stopped) is fine.
        let mut h = h[..h.len() - (run("b", 1000, 2000, 6).len())].to_vec();
        h.extend(run("b", 1011, 2000, 6));
        let v = judge(&h, &[]);
        assert!(v.ok(), "{v}");
    }

    #[test]
    fn two_instances_of_one_node_overlapping_are_caught() {
        let mut h = run_i("a", 1, 0, 1000, 5);
        h.extend(run_i("a", 2, 900, 2000, 6));
        let v = judge(&h, &[]);
        assert_eq!(v.overlaps.len(), 1, "{v}");
    }

    #[test]
    fn token_regressions_are_caught() {
        let mut h = run("a", 0, 1000, 6);
        h.extend(run("b", 1100, 2000, 5));
        let v = judge(&h, &[]);
        assert_eq!(v.token_regressions.len(), 1, "{v}");
    }

    #[test]
    fn a_tick_after_lease_lost_is_forbidden() {
        let h = vec![
            ev(0, "a", "child_started", 5),
            ev(50, "a", "child_tick", 5),
            ev(60, "a", "lease_lost", 5),
            ev(100, "a", "child_tick", 5),
            ev(120, "a", "child_stopped", 5),
        ];
        let v = judge(&h, &[]);
        assert_eq!(v.forbidden.len(), 1, "{v}");
    }

    #[test]
    fn a_run_that_never_ends_is_forbidden_unless_killed() {
        let h = vec![ev(0, "a", "child_started", 5), ev(50, "a", "child_tick", 5)];
        let v = judge(&h, &[]);
        assert_eq!(v.forbidden.len(), 1, "{v}");
        let mut h = h;
        h.push(node_ev(500, "a", 1, "connected"));
        h.extend(run_i("a", 1, 600, 700, 6));
        let v = judge(&h, &[fault("sigkill", Some("a"), 60, 60)]);
        assert!(v.ok(), "{v}");
    }

    #[test]
    fn a_tick_long_after_a_reported_loss_is_forbidden() {
        let mut h = vec![ev(0, "a", "child_started", 1)];
        h.push(node_ev(10, "a", 0, "disconnected"));
        h.push(ev(20, "a", "child_tick", 1));
        h.push(ev(30, "a", "child_stopped", 1));
        let v = judge(&h, &[]);
        assert!(v.forbidden.is_empty(), "{v}");
        assert_eq!(v.late_ticks, (1, Duration::from_millis(10)));
        h.pop();
        h.push(ev(2000, "a", "child_tick", 1));
        h.push(ev(2010, "a", "child_stopped", 1));
        let v = judge(&h, &[]);
        assert_eq!(v.forbidden.len(), 1, "{v}");
    }

    /// a acts until 1000, is frozen for 10 s, and on waking at 11_000 reports the loss
    /// while b (token `b_token`) holds since 8000.
    fn frozen_a(b_token: u64, ticks_after_waking: &[u64]) -> Vec<Event> {
        let mut h = vec![
            ev(0, "a", "child_started", 5),
            ev(500, "a", "child_tick", 5),
            ev(1000, "a", "child_tick", 5),
        ];
        h.extend(run("b", 8000, 20_000, b_token));
        for t in ticks_after_waking {
            h.push(ev(*t, "a", "child_tick", 5));
        }
        h.push(ev(11_060, "a", "lease_lost", 5));
        h.push(ev(11_070, "a", "child_stopped", 5));
        h
    }

    #[test]
    fn a_frozen_node_waking_up_is_the_documented_window_not_an_overlap() {
        let v = judge(&frozen_a(6, &[]), &[]);
        assert!(v.ok(), "{v}");
        assert_eq!(v.stale_windows.len(), 1, "{v}");
        assert_eq!(v.stale_windows[0].holder_token, 6);
    }

    #[test]
    fn ticks_after_a_freeze_are_caught() {
        let v = judge(&frozen_a(6, &[11_000, 11_050]), &[]);
        assert!(!v.safe(), "{v}");
        assert!(v.stale_windows.is_empty(), "{v}");
    }

    #[test]
    fn a_stale_window_without_a_greater_token_is_caught() {
        let v = judge(&frozen_a(4, &[]), &[]);
        assert!(!v.safe(), "{v}");
        assert!(!v.token_regressions.is_empty(), "{v}");
    }

    #[test]
    fn a_fault_that_took_nothing_away_measures_no_takeover() {
        // a keeps running well past the fault (a short freeze); b takes over much later.
        let mut h = run("a", 0, 20_000, 5);
        h.extend(run("b", 20_100, 21_000, 6));
        let faults = [fault("sigstop_short", Some("a"), 1000, 2000)];
        let v = judge(&h, &faults);
        assert!(!v.takeovers.contains_key("sigstop_short"), "{v}");
        // ... and that freeze did not happen: a ticked through it.
        assert_eq!(v.ineffective.len(), 1, "{v}");
    }

    #[test]
    fn a_killed_holder_counts_for_its_fault_and_later_faults_are_not_charged() {
        // a's process is killed at 1.02 s; b takes over at 1.3 s. A short freeze of b
        // at 2 s takes nothing; a cut at 5 s ends b's run at 5.1 s; c follows.
        let mut h = vec![ev(0, "a", "child_started", 5)];
        for t in (50..1000).step_by(50) {
            h.push(ev(t, "a", "child_tick", 5));
        }
        h.push(node_ev(1200, "a", 1, "connected"));
        let mut b = run("b", 1300, 5100, 6);
        b.retain(|e| !(2000..3000).contains(&(e.mono_us / 1000)));
        h.extend(b);
        h.push(node_ev(5050, "b", 0, "disconnected"));
        h.extend(run("c", 5300, 6000, 7));
        let faults = [
            fault("sigkill", Some("a"), 1020, 1020),
            fault("sigstop_short", Some("b"), 2000, 3000),
            fault("cut", Some("b"), 5000, 5100),
        ];
        let v = judge(&h, &faults);
        assert!(v.ok(), "{v}");
        assert_eq!(
            v.takeovers["sigkill"],
            vec![Duration::from_millis(280)],
            "{v}"
        );
        assert!(!v.takeovers.contains_key("sigstop_short"), "{v}");
        assert_eq!(v.takeovers["cut"], vec![Duration::from_millis(300)], "{v}");
    }

    #[test]
    fn a_kill_that_left_the_process_running_is_ineffective() {
        let mut h = run("a", 0, 3000, 5);
        h.push(node_ev(3100, "a", 1, "connected"));
        h.extend(run("b", 3200, 4000, 6));
        let v = judge(&h, &[fault("sigkill", Some("a"), 1000, 1000)]);
        assert!(!v.ineffective.is_empty(), "{v}");
    }

    #[test]
    fn a_cut_without_a_disconnect_is_ineffective() {
        let h = run("a", 0, 3000, 5);
        let v = judge(&h, &[fault("cut", Some("a"), 1000, 1100)]);
        assert!(!v.ineffective.is_empty(), "{v}");
    }

    #[test]
    fn a_reconnect_to_a_new_generation_shows_a_cut() {
        let mut h = run("a", 0, 3000, 5);
        h.push(Event {
            generation: Some(1),
            ..node_ev(0, "a", 0, "connected")
        });
        h.push(Event {
            generation: Some(1),
            ..node_ev(1050, "a", 0, "connected")
        });
        let faults = [fault("cut", Some("a"), 1000, 1100)];
        assert!(!judge(&h, &faults).ineffective.is_empty());
        h.push(Event {
            generation: Some(2),
            ..node_ev(1060, "a", 0, "connected")
        });
        assert!(judge(&h, &faults).ineffective.is_empty());
    }

    #[test]
    fn a_run_ended_by_the_final_shutdown_is_not_charged_to_a_fault() {
        let mut h = run("a", 0, 5000, 5);
        h.push(Event {
            phase: Some("begin".to_owned()),
            ..node_ev(4990, "a", 0, "shutdown")
        });
        let v = judge(&h, &[fault("sigstop_short", Some("a"), 1000, 2000)]);
        assert!(v.missing_takeovers.is_empty(), "{v}");
    }

    #[test]
    fn a_long_black_hole_that_kept_the_lease_is_ineffective() {
        let mut h = run("a", 0, 12_000, 5);
        h.extend(run("b", 12_100, 13_000, 6));
        let v = judge(&h, &[fault("blackhole", Some("a"), 1000, 6000)]);
        assert!(!v.ineffective.is_empty(), "{v}");
    }

    #[test]
    fn a_lease_lost_under_a_slow_database_is_caught() {
        // A run of `a` that ends with a lost lease at `to`.
        let lost = |to: u64| {
            let mut h = run("a", 0, to, 5);
            h.insert(h.len() - 1, ev(to, "a", "lease_lost", 5));
            h
        };
        let mut h = lost(3000);
        h.extend(run("b", 3100, 9000, 6));
        let v = judge(&h, &[fault("latency", Some("a"), 1000, 6000)]);
        assert!(!v.ineffective.is_empty(), "{v}");
        let h = run("a", 0, 9500, 5);
        let v = judge(&h, &[fault("latency", Some("a"), 1000, 6000)]);
        assert!(v.ineffective.is_empty(), "{v}");
        // Lost just after the latency was healed: caught as well.
        let mut h = lost(7000);
        h.extend(run("b", 7100, 9500, 6));
        let v = judge(&h, &[fault("latency", Some("a"), 1000, 6000)]);
        assert!(!v.ineffective.is_empty(), "{v}");
        // A graceful stop meanwhile (a group handing a member over) is no loss.
        let mut h = run("a", 0, 3000, 5);
        h.extend(run("b", 3100, 9000, 6));
        let v = judge(&h, &[fault("latency", Some("a"), 1000, 6000)]);
        assert!(v.ineffective.is_empty(), "{v}");
    }

    #[test]
    fn a_lost_holder_without_a_takeover_is_caught() {
        let mut h = vec![ev(0, "a", "child_started", 5)];
        h.push(node_ev(1050, "a", 0, "disconnected"));
        h.push(ev(1050, "a", "lease_lost", 5));
        h.push(ev(1060, "a", "child_stopped", 5));
        let v = judge(&h, &[fault("terminate_backend", Some("a"), 1000, 1000)]);
        assert_eq!(v.missing_takeovers.len(), 1, "{v}");
        h.extend(run("a", 1500, 2000, 6));
        let v = judge(&h, &[fault("terminate_backend", Some("a"), 1000, 1000)]);
        assert!(v.ok(), "{v}");
        assert_eq!(
            v.takeovers["terminate_backend"],
            vec![Duration::from_millis(500)]
        );
    }

    #[test]
    fn takeover_latency_is_measured_per_fault() {
        let mut h = run("a", 0, 1000, 5);
        h.push(node_ev(1100, "a", 1, "connected"));
        h.extend(run("b", 1300, 2000, 6));
        let v = judge(&h, &[fault("sigkill", Some("a"), 900, 900)]);
        // a stamped its child_stopped at 1000, after the kill at 900: not killed.
        assert!(!v.ineffective.is_empty(), "{v}");
        let mut h = run("a", 0, 1000, 5);
        h.pop();
        h.push(node_ev(1100, "a", 1, "connected"));
        h.extend(run("b", 1300, 2000, 6));
        let v = judge(&h, &[fault("sigkill", Some("a"), 990, 990)]);
        assert!(v.ok(), "{v}");
        assert_eq!(v.takeovers["sigkill"], vec![Duration::from_millis(310)]);
    }
}
