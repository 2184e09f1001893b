use std::time::Duration;

use prometheus::{
    CounterVec, Gauge, GaugeVec, HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts,
    Registry,
};

use super::MetricsSink;

/// Prometheus collectors for chosen, registered into a registry you own (never the
/// default one).
///
/// ```
/// use std::sync::Arc;
/// use chosen_core::{ManagerOptions, PrometheusMetrics};
///
/// let registry = prometheus::Registry::new();
/// let metrics = Arc::new(PrometheusMetrics::register(&registry)?);
/// let options = ManagerOptions::from_url("postgres://app@db/app")?.metrics(metrics);
/// // Registering twice into one registry is an error, not a panic:
/// assert!(PrometheusMetrics::register(&registry).is_err());
/// # let _ = options;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// | metric | type | labels |
/// |---|---|---|
/// | `chosen_lock_held` | gauge, 0/1 | `node`, `lock` |
/// | `chosen_lock_waiters` | gauge | `node`, `lock` |
/// | `chosen_lock_acquisitions_total` | counter | `node`, `lock` |
/// | `chosen_lock_losses_total` | counter | `node`, `lock`, `reason` |
/// | `chosen_lock_wait_seconds` | histogram | `node`, `lock` |
/// | `chosen_connection_up` | gauge, 0/1 | `node` |
/// | `chosen_session_generation` | gauge | `node` |
/// | `chosen_reconnects_total` | counter | `node`, `result` (`ok`, `failed`) |
/// | `chosen_heartbeat_rtt_seconds` | histogram | `node` |
/// | `chosen_poll_queries_total` | counter | `node` |
/// | `chosen_poll_keys_total` | counter | `node` |
/// | `chosen_singleton_running` | gauge, 0/1 | `node`, `singleton` |
/// | `chosen_singleton_restarts_total` | counter | `node`, `singleton` |
/// | `chosen_apalis_tasks_total` | counter | `node`, `lock`, `outcome` |
/// | `chosen_tower_follower_responses_total` | counter | `node`, `lock` |
/// | `chosen_leaderless_seconds_total` | counter (s) | `node`, `lock` |
/// | `chosen_leader_changes_total` | counter | `node`, `lock` |
/// | `chosen_fencing_token` | gauge | `node`, `lock` |
///
/// `chosen_leaderless_seconds_total` and `chosen_leader_changes_total` are what this
/// node's [`Election`](crate::Election) or [`Singleton`](crate::Singleton) for the lock
/// saw ([`MetricsSink::leaderless`], [`MetricsSink::leader_changed`]): every node that
/// looks counts, so aggregate with `max by (lock)`. Leaderless time is a lower bound (a
/// hand-over of milliseconds adds nothing; a stretch of `n` seconds adds at least
/// `n - 4`).
///
/// `chosen_fencing_token` is the token of the lock this node holds (0 when it holds
/// none, or does not know the token yet: a plain lease's token is issued on first
/// use). Prometheus keeps samples as 64-bit floats: the value is exact below 2<sup>53</sup>,
/// that is on timelines below 32 (the token is `timeline << 48 | xid`); above, it is
/// rounded to an even number or a multiple of a higher power of two (off by at most 1
/// on timelines below 64), never reordered, so "the token grew" still holds. The exact
/// value is in the `gained leadership` log line, and in
/// [`Leadership::fencing_token`](crate::Leadership::fencing_token). Not set for locks
/// past the label cap (`_other`: a token of one of many locks means nothing).
///
/// The series of a lock appear, at 0, as soon as a request for it reaches the manager
/// (an `acquire`, or the first campaign of an `Election` or `Singleton`), and those of a
/// singleton when it starts: a follower that never led exports `chosen_lock_held 0` and
/// `chosen_singleton_running 0`, so "nobody leads" is `max by (lock) (chosen_lock_held)
/// == 0`, with no `absent()`.
///
/// Labels stay bounded: `lock` and `singleton` take at most
/// [`DEFAULT_MAX_LOCK_LABELS`](Self::DEFAULT_MAX_LOCK_LABELS) distinct names per sink
/// (change it with [`with_max_lock_labels`](Self::with_max_lock_labels)); the names
/// seen after that report as `_other`, so a process that derives lock names from data
/// (one per tenant, per job id) cannot grow the registry without bound. Series are
/// never removed, so counters keep their meaning across releases.
#[derive(Debug, Clone)]
pub struct PrometheusMetrics {
    /// The `lock`/`singleton` label values admitted so far, and how many may be.
    names: std::sync::Arc<std::sync::Mutex<std::collections::HashSet<String>>>,
    max_names: usize,
    lock_held: IntGaugeVec,
    lock_waiters: IntGaugeVec,
    acquisitions: IntCounterVec,
    losses: IntCounterVec,
    wait_seconds: HistogramVec,
    connection_up: IntGaugeVec,
    generation: GaugeVec,
    reconnects: IntCounterVec,
    heartbeat_rtt: HistogramVec,
    poll_queries: IntCounterVec,
    poll_keys: IntCounterVec,
    singleton_running: IntGaugeVec,
    singleton_restarts: IntCounterVec,
    apalis_tasks: IntCounterVec,
    follower_responses: IntCounterVec,
    leaderless: CounterVec,
    leader_changes: IntCounterVec,
    fencing_token: GaugeVec,
}

impl PrometheusMetrics {
    /// How many distinct lock and singleton names get their own label value.
    pub const DEFAULT_MAX_LOCK_LABELS: usize = 1_000;

    /// At most `max` distinct `lock`/`singleton` label values; later names report as
    /// `_other`.
    #[must_use]
    pub fn with_max_lock_labels(mut self, max: usize) -> Self {
        self.max_names = max;
        self
    }

    /// The label value for `name`: itself while the cap allows, else `_other`.
    fn label<'a>(&self, name: &'a str) -> &'a str {
        let mut names = self
            .names
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if names.contains(name) {
            return name;
        }
        if names.len() < self.max_names {
            names.insert(name.to_owned());
            return name;
        }
        "_other"
    }

    /// Creates the collectors and registers them into `registry`.
    ///
    /// # Errors
    ///
    /// `prometheus::Error::AlreadyReg` when they are registered there already.
    pub fn register(registry: &Registry) -> prometheus::Result<Self> {
        let gauge = |name: &str, help: &str, labels: &[&str]| {
            IntGaugeVec::new(Opts::new(name, help), labels)
        };
        let counter = |name: &str, help: &str, labels: &[&str]| {
            IntCounterVec::new(Opts::new(name, help), labels)
        };
        let m = Self {
            names: std::sync::Arc::default(),
            max_names: Self::DEFAULT_MAX_LOCK_LABELS,
            lock_held: gauge(
                "chosen_lock_held",
                "1 while this node holds the lock",
                &["node", "lock"],
            )?,
            lock_waiters: gauge(
                "chosen_lock_waiters",
                "Requests of this node waiting for the lock",
                &["node", "lock"],
            )?,
            acquisitions: counter(
                "chosen_lock_acquisitions_total",
                "Times this node acquired the lock",
                &["node", "lock"],
            )?,
            losses: counter(
                "chosen_lock_losses_total",
                "Times this node lost the lock with its session, by reason",
                &["node", "lock", "reason"],
            )?,
            wait_seconds: HistogramVec::new(
                HistogramOpts::new(
                    "chosen_lock_wait_seconds",
                    "Time from request to acquisition",
                )
                .buckets(vec![
                    0.001, 0.01, 0.1, 0.5, 1.0, 5.0, 30.0, 120.0, 600.0, 3600.0,
                ]),
                &["node", "lock"],
            )?,
            connection_up: gauge(
                "chosen_connection_up",
                "1 while the lock session is up",
                &["node"],
            )?,
            generation: GaugeVec::new(
                Opts::new(
                    "chosen_session_generation",
                    "Current session generation (grows with every reconnect)",
                ),
                &["node"],
            )?,
            reconnects: counter(
                "chosen_reconnects_total",
                "Reconnect attempts of the lock session, by result",
                &["node", "result"],
            )?,
            heartbeat_rtt: HistogramVec::new(
                HistogramOpts::new(
                    "chosen_heartbeat_rtt_seconds",
                    "Round trip of the session heartbeat",
                )
                .buckets(vec![
                    0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 3.0,
                ]),
                &["node"],
            )?,
            poll_queries: counter(
                "chosen_poll_queries_total",
                "Batched acquire statements sent",
                &["node"],
            )?,
            poll_keys: counter(
                "chosen_poll_keys_total",
                "Keys tried by batched acquire statements",
                &["node"],
            )?,
            singleton_running: gauge(
                "chosen_singleton_running",
                "1 while the singleton's child runs on this node",
                &["node", "singleton"],
            )?,
            singleton_restarts: counter(
                "chosen_singleton_restarts_total",
                "Restarts of the singleton's child on this node",
                &["node", "singleton"],
            )?,
            apalis_tasks: counter(
                "chosen_apalis_tasks_total",
                "apalis tasks that reached the leader gate, by outcome",
                &["node", "lock", "outcome"],
            )?,
            follower_responses: counter(
                "chosen_tower_follower_responses_total",
                "Requests answered by the leader-only layer because this node does not lead",
                &["node", "lock"],
            )?,
            leaderless: CounterVec::new(
                Opts::new(
                    "chosen_leaderless_seconds_total",
                    "Seconds this node saw nobody lead the lock (a lower bound)",
                ),
                &["node", "lock"],
            )?,
            leader_changes: counter(
                "chosen_leader_changes_total",
                "Changes of the lock's leader this node saw",
                &["node", "lock"],
            )?,
            fencing_token: GaugeVec::new(
                Opts::new(
                    "chosen_fencing_token",
                    "Fencing token of the lock this node holds (0: none or not known); exact below 2^53",
                ),
                &["node", "lock"],
            )?,
        };
        registry.register(Box::new(m.lock_held.clone()))?;
        registry.register(Box::new(m.lock_waiters.clone()))?;
        registry.register(Box::new(m.acquisitions.clone()))?;
        registry.register(Box::new(m.losses.clone()))?;
        registry.register(Box::new(m.wait_seconds.clone()))?;
        registry.register(Box::new(m.connection_up.clone()))?;
        registry.register(Box::new(m.generation.clone()))?;
        registry.register(Box::new(m.reconnects.clone()))?;
        registry.register(Box::new(m.heartbeat_rtt.clone()))?;
        registry.register(Box::new(m.poll_queries.clone()))?;
        registry.register(Box::new(m.poll_keys.clone()))?;
        registry.register(Box::new(m.singleton_running.clone()))?;
        registry.register(Box::new(m.singleton_restarts.clone()))?;
        registry.register(Box::new(m.apalis_tasks.clone()))?;
        registry.register(Box::new(m.follower_responses.clone()))?;
        registry.register(Box::new(m.leaderless.clone()))?;
        registry.register(Box::new(m.leader_changes.clone()))?;
        registry.register(Box::new(m.fencing_token.clone()))?;
        Ok(m)
    }
}

fn gauge_of(g: &Gauge, value: f64) {
    g.set(value);
}

impl MetricsSink for PrometheusMetrics {
    fn lock_acquired(&self, node: &str, lock: &str, waited: Duration) {
        self.lock_held
            .with_label_values(&[node, self.label(lock)])
            .set(1);
        self.acquisitions
            .with_label_values(&[node, self.label(lock)])
            .inc();
        self.wait_seconds
            .with_label_values(&[node, self.label(lock)])
            .observe(waited.as_secs_f64());
    }

    fn lock_released(&self, node: &str, lock: &str) {
        self.lock_held
            .with_label_values(&[node, self.label(lock)])
            .set(0);
    }

    fn lock_lost(&self, node: &str, lock: &str, reason: &str) {
        self.lock_held
            .with_label_values(&[node, self.label(lock)])
            .set(0);
        self.losses
            .with_label_values(&[node, self.label(lock), reason])
            .inc();
    }

    fn lock_known(&self, node: &str, lock: &str) {
        // Created at 0 when absent, left alone when present: under the label cap, many
        // locks share `_other`, and one of them may be held.
        let labels = [node, self.label(lock)];
        let _ = self.lock_held.with_label_values(&labels);
        let _ = self.lock_waiters.with_label_values(&labels);
        let _ = self.acquisitions.with_label_values(&labels);
        if labels[1] != "_other" {
            let _ = self.fencing_token.with_label_values(&labels);
        }
    }

    fn lock_waiting(&self, node: &str, lock: &str, waiters: usize) {
        self.lock_waiters
            .with_label_values(&[node, self.label(lock)])
            .set(i64::try_from(waiters).unwrap_or(i64::MAX));
    }

    fn connection_changed(&self, node: &str, up: bool, generation: u64) {
        self.connection_up
            .with_label_values(&[node])
            .set(i64::from(up));
        if up {
            gauge_of(
                &self.generation.with_label_values(&[node]),
                generation as f64,
            );
        }
    }

    fn reconnect_attempt(&self, node: &str, ok: bool) {
        let result = if ok { "ok" } else { "failed" };
        self.reconnects.with_label_values(&[node, result]).inc();
    }

    fn heartbeat(&self, node: &str, rtt: Duration) {
        self.heartbeat_rtt
            .with_label_values(&[node])
            .observe(rtt.as_secs_f64());
    }

    fn poll_query(&self, node: &str, keys: usize) {
        self.poll_queries.with_label_values(&[node]).inc();
        self.poll_keys
            .with_label_values(&[node])
            .inc_by(keys as u64);
    }

    fn singleton_running(&self, node: &str, singleton: &str, running: bool) {
        self.singleton_running
            .with_label_values(&[node, self.label(singleton)])
            .set(i64::from(running));
    }

    fn singleton_known(&self, node: &str, singleton: &str) {
        // Created at 0 when absent, left alone when present (see `lock_known`).
        let labels = [node, self.label(singleton)];
        let _ = self.singleton_running.with_label_values(&labels);
        let _ = self.singleton_restarts.with_label_values(&labels);
    }

    fn singleton_restart(&self, node: &str, singleton: &str) {
        self.singleton_restarts
            .with_label_values(&[node, self.label(singleton)])
            .inc();
    }

    fn task_gated(&self, node: &str, lock: &str, outcome: &str) {
        self.apalis_tasks
            .with_label_values(&[node, self.label(lock), outcome])
            .inc();
    }

    fn follower_response(&self, node: &str, lock: &str) {
        self.follower_responses
            .with_label_values(&[node, self.label(lock)])
            .inc();
    }

    fn leaderless(&self, node: &str, lock: &str, seen: Duration) {
        let labels = [node, self.label(lock)];
        // Zero at the first observation: both series start at rest.
        let _ = self.leader_changes.with_label_values(&labels);
        self.leaderless
            .with_label_values(&labels)
            .inc_by(seen.as_secs_f64());
    }

    fn leader_changed(&self, node: &str, lock: &str) {
        self.leader_changes
            .with_label_values(&[node, self.label(lock)])
            .inc();
    }

    fn fencing_token(&self, node: &str, lock: &str, token: Option<u64>) {
        let lock = self.label(lock);
        if lock == "_other" {
            return;
        }
        // Exact below 2^53 (timelines below 32); rounded, in order, above.
        let value = token.map_or(0.0, |t| t as f64);
        gauge_of(&self.fencing_token.with_label_values(&[node, lock]), value);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The value of the series of `family` with exactly `labels`, if it exists.
    fn series(registry: &Registry, family: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let families = registry.gather();
        let family = families.iter().find(|f| f.name() == family)?;
        let gauge = family.get_field_type() == prometheus::proto::MetricType::GAUGE;
        family.get_metric().iter().find_map(|metric| {
            let mut have: Vec<(&str, &str)> = metric
                .get_label()
                .iter()
                .map(|l| (l.name(), l.value()))
                .collect();
            have.sort_unstable();
            let mut want = labels.to_vec();
            want.sort_unstable();
            (have == want).then(|| {
                if gauge {
                    metric.get_gauge().get_value()
                } else {
                    metric.get_counter().get_value()
                }
            })
        })
    }

    #[test]
    fn known_locks_and_singletons_show_at_rest_before_they_lead() {
        let registry = Registry::new();
        let m = PrometheusMetrics::register(&registry).unwrap();
        let lock = [("node", "n"), ("lock", "report")];
        assert_eq!(series(&registry, "chosen_lock_held", &lock), None);
        m.lock_known("n", "report");
        assert_eq!(series(&registry, "chosen_lock_held", &lock), Some(0.0));
        assert_eq!(series(&registry, "chosen_lock_waiters", &lock), Some(0.0));
        assert_eq!(
            series(&registry, "chosen_lock_acquisitions_total", &lock),
            Some(0.0)
        );
        let singleton = [("node", "n"), ("singleton", "report")];
        m.singleton_known("n", "report");
        assert_eq!(
            series(&registry, "chosen_singleton_running", &singleton),
            Some(0.0)
        );
        assert_eq!(
            series(&registry, "chosen_singleton_restarts_total", &singleton),
            Some(0.0)
        );

        // Known again while held or running here: the values stay.
        m.lock_acquired("n", "report", Duration::ZERO);
        m.singleton_running("n", "report", true);
        m.lock_known("n", "report");
        m.singleton_known("n", "report");
        assert_eq!(series(&registry, "chosen_lock_held", &lock), Some(1.0));
        assert_eq!(
            series(&registry, "chosen_singleton_running", &singleton),
            Some(1.0)
        );
    }

    #[test]
    fn leadership_series_count_leaderless_time_changes_and_the_token_held() {
        let registry = Registry::new();
        let m = PrometheusMetrics::register(&registry).unwrap();
        let lock = [("node", "n"), ("lock", "report")];
        m.lock_known("n", "report");
        assert_eq!(series(&registry, "chosen_fencing_token", &lock), Some(0.0));
        // The first observation puts both leadership series at rest.
        m.leaderless("n", "report", Duration::ZERO);
        assert_eq!(
            series(&registry, "chosen_leaderless_seconds_total", &lock),
            Some(0.0)
        );
        assert_eq!(
            series(&registry, "chosen_leader_changes_total", &lock),
            Some(0.0)
        );
        m.leaderless("n", "report", Duration::from_millis(2_500));
        m.leaderless("n", "report", Duration::from_secs(2));
        m.leader_changed("n", "report");
        assert_eq!(
            series(&registry, "chosen_leaderless_seconds_total", &lock),
            Some(4.5)
        );
        assert_eq!(
            series(&registry, "chosen_leader_changes_total", &lock),
            Some(1.0)
        );

        // A token on timeline 3; back to 0 once released.
        let token = (3_u64 << 48) | 1_234;
        m.lock_acquired("n", "report", Duration::ZERO);
        m.fencing_token("n", "report", Some(token));
        assert_eq!(
            series(&registry, "chosen_fencing_token", &lock),
            Some(token as f64)
        );
        m.lock_released("n", "report");
        m.fencing_token("n", "report", None);
        assert_eq!(series(&registry, "chosen_fencing_token", &lock), Some(0.0));
    }

    #[test]
    fn no_fencing_token_is_exported_for_locks_past_the_label_cap() {
        let registry = Registry::new();
        let m = PrometheusMetrics::register(&registry)
            .unwrap()
            .with_max_lock_labels(1);
        m.fencing_token("n", "a", Some(5));
        m.lock_known("n", "b");
        m.fencing_token("n", "b", Some(6));
        let other = [("node", "n"), ("lock", "_other")];
        assert_eq!(series(&registry, "chosen_fencing_token", &other), None);
        assert_eq!(
            series(
                &registry,
                "chosen_fencing_token",
                &[("node", "n"), ("lock", "a")]
            ),
            Some(5.0)
        );
    }

    #[test]
    fn a_known_lock_past_the_label_cap_leaves_other_alone() {
        let registry = Registry::new();
        let m = PrometheusMetrics::register(&registry)
            .unwrap()
            .with_max_lock_labels(1);
        m.lock_acquired("n", "a", Duration::ZERO);
        m.lock_acquired("n", "b", Duration::ZERO);
        let other = [("node", "n"), ("lock", "_other")];
        assert_eq!(series(&registry, "chosen_lock_held", &other), Some(1.0));
        m.lock_known("n", "c");
        assert_eq!(series(&registry, "chosen_lock_held", &other), Some(1.0));
    }

    #[test]
    fn lock_labels_are_capped_and_counters_kept() {
        let registry = Registry::new();
        let m = PrometheusMetrics::register(&registry)
            .unwrap()
            .with_max_lock_labels(2);
        for name in ["a", "b", "c", "d", "a"] {
            m.lock_acquired("n", name, Duration::from_millis(1));
            m.lock_released("n", name);
        }
        let families = registry.gather();
        let acquisitions = families
            .iter()
            .find(|f| f.name() == "chosen_lock_acquisitions_total")
            .unwrap();
        let mut seen: Vec<(String, f64)> = acquisitions
            .get_metric()
            .iter()
            .map(|metric| {
                let lock = metric
                    .get_label()
                    .iter()
                    .find(|l| l.name() == "lock")
                    .unwrap()
                    .value()
                    .to_owned();
                (lock, metric.get_counter().get_value())
            })
            .collect();
        seen.sort_by(|x, y| x.0.cmp(&y.0));
        assert_eq!(
            seen,
            vec![
                ("_other".to_owned(), 2.0),
                ("a".to_owned(), 2.0),
                ("b".to_owned(), 1.0)
            ]
        );
    }
}
