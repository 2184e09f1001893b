//! The independent checker: reads the nodes' event histories and judges them against
//! the contract. Pure functions over events, so it is tested with made-up histories.

use std::collections::{BTreeMap, HashMap};
use std::fmt::{self, Write as _};
use std::time::Duration;

/// One event line of a `node` process, with the process instance that emitted it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// Wall-clock microseconds since the Unix epoch (all nodes share one clock).
    pub ts_us: u64,
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
}

impl Event {
    /// Parses one JSON line of the `node` example (flat object; strings, numbers, null).
    #[must_use]
    pub fn parse(line: &str, instance: u32) -> Option<Self> {
        let fields = parse_flat_json(line)?;
        let get = |k: &str| fields.get(k).and_then(|v| v.clone());
        Some(Self {
            ts_us: get("ts_us")?.parse().ok()?,
            node: get("node")?,
            instance,
            event: get("event")?,
            singleton: get("singleton"),
            token: get("token").and_then(|t| t.parse().ok()),
            reason: get("reason"),
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
    /// The fault kind (a short fixed name).
    pub kind: &'static str,
    /// The node it hit, or `None` for the server.
    pub node: Option<String>,
    /// When it began (wall-clock µs).
    pub at_us: u64,
    /// When it was healed (wall-clock µs).
    pub healed_us: u64,
}

/// One run of a child: from `child_started` to its last `child_tick` (the span in which
/// the node *acted* as the holder), and to its end.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Run {
    node: String,
    instance: u32,
    token: u64,
    start_us: u64,
    last_act_us: u64,
    end_us: u64,
    /// Ticks that came after a silence longer than the server release time (the node
    /// was frozen): the documented window.
    stale_ticks: Vec<u64>,
}

/// Two nodes acting as the holder of one singleton at once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Overlap {
    /// The singleton.
    pub singleton: String,
    /// The two nodes.
    pub nodes: (String, String),
    /// How long they overlapped.
    pub duration: Duration,
    /// When it began (wall-clock µs).
    pub at_us: u64,
}

/// A tick of a node that woke up from a freeze longer than the server release time
/// while another node held the lock (the one unavoidable window).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StaleWindow {
    /// The singleton.
    pub singleton: String,
    /// The stale node.
    pub node: String,
    /// How long the stale node acted after waking.
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
    /// Runs whose token did not grow over the previous holder's: must be empty.
    pub token_regressions: Vec<String>,
    /// Events the contract forbids (e.g. a tick after the node reported its session
    /// lost): must be empty.
    pub forbidden: Vec<String>,
    /// The documented window, measured.
    pub stale_windows: Vec<StaleWindow>,
    /// Ticks stamped after their node reported its session lost, within the grace of a
    /// check-then-act delay (the tick was decided while the lease was valid; the
    /// process was descheduled before it stamped it): how many, and the latest.
    pub late_ticks: (usize, Duration),
    /// Per fault kind: takeover latencies (fault injected -> a child running on
    /// another node) for the singletons the fault took away.
    pub takeovers: BTreeMap<&'static str, Vec<Duration>>,
    /// Per fault kind: how many were injected.
    pub faults: BTreeMap<&'static str, usize>,
    /// Total time with no child running, summed over singletons, outside server-down
    /// windows.
    pub leaderless: Duration,
    /// Child runs seen, ticks seen, singletons.
    pub runs: usize,
    /// Ticks seen.
    pub ticks: usize,
    /// Singletons seen.
    pub singletons: usize,
}

impl Verdict {
    /// `true` when the history honours the contract.
    #[must_use]
    pub fn ok(&self) -> bool {
        self.overlaps.is_empty() && self.token_regressions.is_empty() && self.forbidden.is_empty()
    }
}

/// How long before a fault a run may have shown its last sign of life and still count
/// as the holder the fault hit (a killed process's last tick precedes the kill).
const KILL_SLACK_US: u64 = 500_000;

/// How late a tick may be stamped after its node reported the loss before it counts
/// as acting without checking (rather than the check-then-act delay of a descheduled
/// process).
const LATE_TICK_GRACE: Duration = Duration::from_secs(1);

/// Judges a history. `release` is the server-side release time the nodes ran with
/// (a silence longer than it before a tick marks that tick as stale).
#[must_use]
pub fn check(events: &[Event], faults: &[FaultRecord], release: Duration) -> Verdict {
    let mut v = Verdict::default();
    let mut events: Vec<&Event> = events.iter().collect();
    events.sort_by_key(|e| e.ts_us);

    // Per process instance: its last event time (to spot silences) and whether its
    // session was reported lost since the current run started.
    let mut last_seen: HashMap<(String, u32), u64> = HashMap::new();
    let mut session_down: HashMap<(String, u32), Option<u64>> = HashMap::new();
    let mut open: HashMap<(String, u32, String), Run> = HashMap::new();
    let mut runs: BTreeMap<String, Vec<Run>> = BTreeMap::new();
    let release_us = release.as_micros() as u64;

    for e in &events {
        let proc_key = (e.node.clone(), e.instance);
        let silent_for = last_seen
            .get(&proc_key)
            .map_or(0, |t| e.ts_us.saturating_sub(*t));
        last_seen.insert(proc_key.clone(), e.ts_us);
        match e.event.as_str() {
            "disconnected" => {
                session_down
                    .entry(proc_key.clone())
                    .or_insert(None)
                    .get_or_insert(e.ts_us);
            }
            "connected" => {
                session_down.insert(proc_key.clone(), None);
            }
            _ => {}
        }
        let Some(s) = &e.singleton else { continue };
        let key = (e.node.clone(), e.instance, s.clone());
        match e.event.as_str() {
            "child_started" => {
                if let Some(prev) = open.remove(&key) {
                    runs.entry(s.clone()).or_default().push(prev);
                }
                open.insert(
                    key,
                    Run {
                        node: e.node.clone(),
                        instance: e.instance,
                        token: e.token.unwrap_or(0),
                        start_us: e.ts_us,
                        last_act_us: e.ts_us,
                        end_us: e.ts_us,
                        stale_ticks: Vec::new(),
                    },
                );
            }
            "child_tick" => {
                v.ticks += 1;
                if let Some(Some(down_at)) = session_down.get(&proc_key).copied() {
                    let late = Duration::from_micros(e.ts_us.saturating_sub(down_at));
                    if late > LATE_TICK_GRACE {
                        v.forbidden.push(format!(
                            "{} ticked {s} at {}, {late:?} after reporting its session lost",
                            e.node, e.ts_us
                        ));
                    } else {
                        v.late_ticks.0 += 1;
                        v.late_ticks.1 = v.late_ticks.1.max(late);
                    }
                }
                if let Some(run) = open.get_mut(&key) {
                    if silent_for > release_us {
                        run.stale_ticks.push(e.ts_us);
                    } else {
                        run.last_act_us = e.ts_us;
                    }
                    run.end_us = e.ts_us;
                } else {
                    v.forbidden.push(format!(
                        "{} ticked {s} at {} outside a run",
                        e.node, e.ts_us
                    ));
                }
            }
            "lease_lost" | "child_stopped" => {
                if let Some(run) = open.get_mut(&key) {
                    run.end_us = e.ts_us;
                    if e.event == "child_stopped" {
                        let run = open.remove(&key).expect("BUG: checked");
                        runs.entry(s.clone()).or_default().push(run);
                    }
                }
            }
            _ => {}
        }
    }
    for ((_, _, s), run) in open {
        runs.entry(s).or_default().push(run);
    }

    let down_windows: Vec<(u64, u64)> = faults
        .iter()
        .filter(|f| f.node.is_none())
        .map(|f| (f.at_us, f.healed_us))
        .collect();
    for f in faults {
        *v.faults.entry(f.kind).or_default() += 1;
    }
    v.singletons = runs.len();
    for (singleton, list) in &mut runs {
        list.sort_by_key(|r| r.start_us);
        v.runs += list.len();
        // Overlaps between acting spans of different nodes.
        for (i, a) in list.iter().enumerate() {
            for b in &list[i + 1..] {
                if a.node == b.node && a.instance == b.instance {
                    continue;
                }
                let lo = a.start_us.max(b.start_us);
                let hi = a.last_act_us.min(b.last_act_us);
                if lo < hi {
                    v.overlaps.push(Overlap {
                        singleton: singleton.clone(),
                        nodes: (a.node.clone(), b.node.clone()),
                        duration: Duration::from_micros(hi - lo),
                        at_us: lo,
                    });
                }
            }
        }
        // Stale ticks: the documented window, with the tokens that fence it.
        for run in list.iter() {
            if let (Some(first), Some(last)) = (run.stale_ticks.first(), run.stale_ticks.last()) {
                let holder = list
                    .iter()
                    .filter(|r| r.node != run.node && r.start_us <= *first)
                    .max_by_key(|r| r.start_us);
                let holder_token = holder.map_or(0, |h| h.token);
                if holder.is_some() && holder_token <= run.token {
                    v.token_regressions.push(format!(
                        "{singleton}: stale {} (token {}) is not fenced by holder token {holder_token}",
                        run.node, run.token
                    ));
                }
                v.stale_windows.push(StaleWindow {
                    singleton: singleton.clone(),
                    node: run.node.clone(),
                    duration: Duration::from_micros(last - first),
                    stale_token: run.token,
                    holder_token,
                });
            }
        }
        // Tokens grow from holder to holder.
        for pair in list.windows(2) {
            let (a, b) = (&pair[0], &pair[1]);
            let same_lease = a.node == b.node && a.instance == b.instance && a.token == b.token;
            if !same_lease && b.token <= a.token {
                v.token_regressions.push(format!(
                    "{singleton}: {} got token {} after {} had {}",
                    b.node, b.token, a.node, a.token
                ));
            }
        }
        // Leaderless time, outside server-down windows.
        let mut covered_until = list.first().map_or(0, |r| r.end_us);
        for r in list.iter().skip(1) {
            if r.start_us > covered_until {
                let gap = (covered_until, r.start_us);
                let in_down = down_windows
                    .iter()
                    .any(|(a, b)| gap.0 < *b + release_us && gap.1 > *a);
                if !in_down {
                    v.leaderless += Duration::from_micros(gap.1 - gap.0);
                }
            }
            covered_until = covered_until.max(r.end_us);
        }
        // Takeover latency after each fault that took this singleton's holder away.
        let mut by_time: Vec<&FaultRecord> = faults.iter().collect();
        by_time.sort_by_key(|f| f.at_us);
        for (i, f) in by_time.iter().enumerate() {
            let next_fault = by_time.get(i + 1).map_or(u64::MAX, |n| n.at_us);
            // A killed process emits nothing at its end: its run "ends" at its last
            // tick, up to a tick interval before the kill.
            let holder = list
                .iter()
                .find(|r| r.start_us <= f.at_us && r.end_us + KILL_SLACK_US >= f.at_us);
            let hit = match (&f.node, holder) {
                (None, _) => true,
                (Some(n), Some(h)) => *n == h.node,
                (Some(_), None) => false,
            };
            // Only faults that ended the holder's run count (a freeze shorter than the
            // lease timeout, say, takes nothing away).
            // ... and it must have ended before the next fault, which would otherwise be
            // charged to this one.
            let took_it = holder
                .is_none_or(|h| h.end_us <= (f.healed_us + release_us + 2_000_000).min(next_fault));
            if !hit || !took_it {
                continue;
            }
            if let Some(next) = list.iter().find(|r| {
                r.start_us > f.at_us
                    && holder.is_none_or(|h| {
                        r.node != h.node || r.instance != h.instance || r.token != h.token
                    })
            }) {
                v.takeovers
                    .entry(f.kind)
                    .or_default()
                    .push(Duration::from_micros(next.start_us - f.at_us));
            }
        }
    }
    v
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
            "\nsingletons {}, child runs {}, ticks {}; overlaps {} (outside the documented window), token regressions {}, forbidden events {}; stale-window events {}",
            self.singletons,
            self.runs,
            self.ticks,
            self.overlaps.len(),
            self.token_regressions.len(),
            self.forbidden.len(),
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
            "; leaderless time outside server outages {} ms; ticks stamped just after a reported loss {} (latest {} ms after)",
            ms(self.leaderless),
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
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(ts_ms: u64, node: &str, event: &str, token: u64) -> Event {
        Event {
            ts_us: ts_ms * 1000,
            node: node.to_owned(),
            instance: 0,
            event: event.to_owned(),
            singleton: Some("s".to_owned()),
            token: Some(token),
            reason: None,
        }
    }

    fn run(node: &str, from: u64, to: u64, token: u64) -> Vec<Event> {
        let mut out = vec![ev(from, node, "child_started", token)];
        let mut t = from + 50;
        while t < to {
            out.push(ev(t, node, "child_tick", token));
            t += 50;
        }
        out.push(ev(to, node, "child_stopped", token));
        out
    }

    #[test]
    fn parses_node_lines() {
        let e = Event::parse(
            r#"{"ts_us":17,"node":"n-1","event":"lease_lost","singleton":"a \"b\"","token":9,"reason":"x\ny"}"#,
            3,
        )
        .unwrap();
        assert_eq!(e.ts_us, 17);
        assert_eq!(e.singleton.as_deref(), Some("a \"b\""));
        assert_eq!(e.token, Some(9));
        assert_eq!(e.reason.as_deref(), Some("x\ny"));
        let e = Event::parse(
            r#"{"ts_us":1,"node":"n","event":"following","leader":null}"#,
            0,
        )
        .unwrap();
        assert_eq!(e.event, "following");
        assert!(Event::parse("not json", 0).is_none());
    }

    #[test]
    fn a_clean_handover_passes() {
        let mut h = run("a", 0, 1000, 5);
        h.extend(run("b", 1100, 2000, 6));
        let v = check(&h, &[], Duration::from_secs(7));
        assert!(v.ok(), "{v}");
        assert_eq!(v.runs, 2);
    }

    #[test]
    fn overlapping_ticks_are_caught() {
        let mut h = run("a", 0, 1000, 5);
        h.extend(run("b", 800, 2000, 6));
        let v = check(&h, &[], Duration::from_secs(7));
        assert!(!v.ok());
        assert_eq!(v.overlaps.len(), 1, "{v}");
    }

    #[test]
    fn token_regressions_are_caught() {
        let mut h = run("a", 0, 1000, 6);
        h.extend(run("b", 1100, 2000, 5));
        let v = check(&h, &[], Duration::from_secs(7));
        assert_eq!(v.token_regressions.len(), 1, "{v}");
    }

    #[test]
    fn a_tick_long_after_a_reported_loss_is_forbidden() {
        let mut h = vec![ev(0, "a", "child_started", 1)];
        h.push(Event {
            singleton: None,
            ..ev(10, "a", "disconnected", 0)
        });
        h.push(ev(20, "a", "child_tick", 1));
        let v = check(&h, &[], Duration::from_secs(7));
        assert!(v.forbidden.is_empty(), "{v}");
        assert_eq!(v.late_ticks, (1, Duration::from_millis(10)));
        h.push(ev(2000, "a", "child_tick", 1));
        let v = check(&h, &[], Duration::from_secs(7));
        assert_eq!(v.forbidden.len(), 1, "{v}");
    }

    #[test]
    fn a_frozen_node_waking_up_is_the_documented_window_not_an_overlap() {
        // a acts until 1000, is frozen for 10 s, wakes and ticks once at 11_000 while b
        // (token 6) holds; its token 5 is lower.
        let mut h = vec![
            ev(0, "a", "child_started", 5),
            ev(500, "a", "child_tick", 5),
        ];
        h.push(ev(1000, "a", "child_tick", 5));
        h.extend(run("b", 8000, 20_000, 6));
        h.push(ev(11_000, "a", "child_tick", 5));
        h.push(ev(11_010, "a", "child_stopped", 5));
        let v = check(&h, &[], Duration::from_secs(7));
        assert!(v.ok(), "{v}");
        assert_eq!(v.stale_windows.len(), 1);
        assert_eq!(v.stale_windows[0].holder_token, 6);
    }

    #[test]
    fn a_fault_that_took_nothing_away_measures_no_takeover() {
        // a keeps running well past the fault (a short freeze); b takes over much later.
        let mut h = run("a", 0, 20_000, 5);
        h.extend(run("b", 20_100, 21_000, 6));
        let faults = [FaultRecord {
            kind: "sigstop_short",
            node: Some("a".to_owned()),
            at_us: 1_000_000,
            healed_us: 2_000_000,
        }];
        let v = check(&h, &faults, Duration::from_secs(7));
        assert!(!v.takeovers.contains_key("sigstop_short"), "{v}");
    }

    #[test]
    fn a_killed_holder_counts_for_its_fault_and_later_faults_are_not_charged() {
        // a's process is killed at 1.02 s (its last tick was at 0.95 s); b takes over
        // at 1.3 s. A second fault at 5 s hits b, whose run ends at 5.1 s; c follows.
        let mut h = vec![ev(0, "a", "child_started", 5)];
        let mut t = 50;
        while t < 1000 {
            h.push(ev(t, "a", "child_tick", 5));
            t += 50;
        }
        h.extend(run("b", 1300, 5100, 6));
        h.extend(run("c", 5300, 6000, 7));
        let faults = [
            FaultRecord {
                kind: "sigkill",
                node: Some("a".to_owned()),
                at_us: 1_020_000,
                healed_us: 1_020_000,
            },
            FaultRecord {
                kind: "sigstop_short",
                node: Some("b".to_owned()),
                at_us: 2_000_000,
                healed_us: 3_000_000,
            },
            FaultRecord {
                kind: "cut",
                node: Some("b".to_owned()),
                at_us: 5_000_000,
                healed_us: 5_100_000,
            },
        ];
        let v = check(&h, &faults, Duration::from_secs(7));
        assert_eq!(
            v.takeovers["sigkill"],
            vec![Duration::from_millis(280)],
            "{v}"
        );
        assert!(!v.takeovers.contains_key("sigstop_short"), "{v}");
        assert_eq!(v.takeovers["cut"], vec![Duration::from_millis(300)], "{v}");
    }

    #[test]
    fn takeover_latency_is_measured_per_fault() {
        let mut h = run("a", 0, 1000, 5);
        h.extend(run("b", 1300, 2000, 6));
        let faults = [FaultRecord {
            kind: "sigkill",
            node: Some("a".to_owned()),
            at_us: 900_000,
            healed_us: 900_000,
        }];
        let v = check(&h, &faults, Duration::from_secs(7));
        assert_eq!(v.takeovers["sigkill"], vec![Duration::from_millis(400)]);
    }
}
