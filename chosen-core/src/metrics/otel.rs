use std::collections::HashSet;
use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::Duration;

use opentelemetry::KeyValue;
use opentelemetry::metrics::{Counter, Gauge, Histogram, Meter};

use super::MetricsSink;

/// OpenTelemetry instruments for chosen, from the global meter provider (this crate
/// depends on the API only and never sets a provider).
///
/// The instruments are created on first use, so set your provider
/// (`opentelemetry::global::set_meter_provider`) before the first lock is taken; a
/// meter taken before that would stay a no-op. Names mirror
/// [`PrometheusMetrics`](crate::PrometheusMetrics) with dots: `chosen.lock.held`,
/// `chosen.lock.acquisitions`, `chosen.lock.losses`, `chosen.lock.wait` (s),
/// `chosen.lock.waiters`, `chosen.connection.up`, `chosen.session.generation`,
/// `chosen.reconnects`, `chosen.heartbeat.rtt` (s), `chosen.poll.queries`,
/// `chosen.poll.keys`, `chosen.singleton.running`, `chosen.singleton.restarts`,
/// `chosen.apalis.tasks`, `chosen.tower.follower_responses`, `chosen.leaderless` (s,
/// a counter), `chosen.leader.changes`, `chosen.fencing_token` (a `u64` gauge: exact
/// here, rounded only by a backend that keeps floats, see
/// [`PrometheusMetrics`](crate::PrometheusMetrics)); attributes as its labels.
#[derive(Debug, Default)]
pub struct OtelMetrics {
    instruments: OnceLock<Instruments>,
    /// The (node, singleton) pairs whose series were set to rest: an instrument cannot
    /// be read back, and a second singleton of the same name must not reset the
    /// first's `running` to 0. Bounded by the singletons a process starts.
    singletons_known: Mutex<HashSet<(String, String)>>,
}

#[derive(Debug)]
struct Instruments {
    lock_held: Gauge<u64>,
    lock_waiters: Gauge<u64>,
    acquisitions: Counter<u64>,
    losses: Counter<u64>,
    wait: Histogram<f64>,
    connection_up: Gauge<u64>,
    generation: Gauge<u64>,
    reconnects: Counter<u64>,
    heartbeat_rtt: Histogram<f64>,
    poll_queries: Counter<u64>,
    poll_keys: Counter<u64>,
    singleton_running: Gauge<u64>,
    singleton_restarts: Counter<u64>,
    apalis_tasks: Counter<u64>,
    follower_responses: Counter<u64>,
    leaderless: Counter<f64>,
    leader_changes: Counter<u64>,
    fencing_token: Gauge<u64>,
}

impl Instruments {
    fn new(meter: &Meter) -> Self {
        Self {
            lock_held: meter
                .u64_gauge("chosen.lock.held")
                .with_description("1 while this node holds the lock")
                .build(),
            lock_waiters: meter
                .u64_gauge("chosen.lock.waiters")
                .with_description("Requests of this node waiting for the lock")
                .build(),
            acquisitions: meter
                .u64_counter("chosen.lock.acquisitions")
                .with_description("Times this node acquired the lock")
                .build(),
            losses: meter
                .u64_counter("chosen.lock.losses")
                .with_description("Times this node lost the lock with its session")
                .build(),
            wait: meter
                .f64_histogram("chosen.lock.wait")
                .with_unit("s")
                .with_description("Time from request to acquisition")
                .build(),
            connection_up: meter
                .u64_gauge("chosen.connection.up")
                .with_description("1 while the lock session is up")
                .build(),
            generation: meter
                .u64_gauge("chosen.session.generation")
                .with_description("Current session generation")
                .build(),
            reconnects: meter
                .u64_counter("chosen.reconnects")
                .with_description("Reconnect attempts of the lock session")
                .build(),
            heartbeat_rtt: meter
                .f64_histogram("chosen.heartbeat.rtt")
                .with_unit("s")
                .with_description("Round trip of the session heartbeat")
                .build(),
            poll_queries: meter
                .u64_counter("chosen.poll.queries")
                .with_description("Batched acquire statements sent")
                .build(),
            poll_keys: meter
                .u64_counter("chosen.poll.keys")
                .with_description("Keys tried by batched acquire statements")
                .build(),
            singleton_running: meter
                .u64_gauge("chosen.singleton.running")
                .with_description("1 while the singleton's child runs here")
                .build(),
            singleton_restarts: meter
                .u64_counter("chosen.singleton.restarts")
                .with_description("Restarts of the singleton's child")
                .build(),
            apalis_tasks: meter
                .u64_counter("chosen.apalis.tasks")
                .with_description("apalis tasks that reached the leader gate")
                .build(),
            follower_responses: meter
                .u64_counter("chosen.tower.follower_responses")
                .with_description("Requests answered by the leader-only layer")
                .build(),
            leaderless: meter
                .f64_counter("chosen.leaderless")
                .with_unit("s")
                .with_description("Time this node saw nobody lead the lock (a lower bound)")
                .build(),
            leader_changes: meter
                .u64_counter("chosen.leader.changes")
                .with_description("Changes of the lock's leader this node saw")
                .build(),
            fencing_token: meter
                .u64_gauge("chosen.fencing_token")
                .with_description(
                    "Fencing token of the lock this node holds (0: none or not known)",
                )
                .build(),
        }
    }
}

impl OtelMetrics {
    /// A sink whose instruments are created, from the global meter provider, on first
    /// use.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Records that the series of `singleton` on `node` exist; `true` the first time.
    fn note_singleton(&self, node: &str, singleton: &str) -> bool {
        let mut known = self
            .singletons_known
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        known.insert((node.to_owned(), singleton.to_owned()))
    }

    fn get(&self) -> &Instruments {
        self.instruments
            .get_or_init(|| Instruments::new(&opentelemetry::global::meter("chosen")))
    }
}

fn kv(key: &'static str, value: &str) -> KeyValue {
    KeyValue::new(key, value.to_owned())
}

impl MetricsSink for OtelMetrics {
    fn lock_acquired(&self, node: &str, lock: &str, waited: Duration) {
        let i = self.get();
        let attrs = [kv("node", node), kv("lock", lock)];
        i.lock_held.record(1, &attrs);
        i.acquisitions.add(1, &attrs);
        i.wait.record(waited.as_secs_f64(), &attrs);
    }

    fn lock_released(&self, node: &str, lock: &str) {
        self.get()
            .lock_held
            .record(0, &[kv("node", node), kv("lock", lock)]);
    }

    fn lock_lost(&self, node: &str, lock: &str, reason: &str) {
        let i = self.get();
        i.lock_held.record(0, &[kv("node", node), kv("lock", lock)]);
        i.losses.add(
            1,
            &[kv("node", node), kv("lock", lock), kv("reason", reason)],
        );
    }

    fn lock_known(&self, node: &str, lock: &str) {
        // The manager calls this only for a lock it neither holds nor queues requests
        // for, so 0 is the truth for both gauges.
        let i = self.get();
        let attrs = [kv("node", node), kv("lock", lock)];
        i.lock_held.record(0, &attrs);
        i.lock_waiters.record(0, &attrs);
        i.acquisitions.add(0, &attrs);
        i.fencing_token.record(0, &attrs);
    }

    fn lock_waiting(&self, node: &str, lock: &str, waiters: usize) {
        self.get()
            .lock_waiters
            .record(waiters as u64, &[kv("node", node), kv("lock", lock)]);
    }

    fn connection_changed(&self, node: &str, up: bool, generation: u64) {
        let i = self.get();
        i.connection_up.record(u64::from(up), &[kv("node", node)]);
        if up {
            i.generation.record(generation, &[kv("node", node)]);
        }
    }

    fn reconnect_attempt(&self, node: &str, ok: bool) {
        let result = if ok { "ok" } else { "failed" };
        self.get()
            .reconnects
            .add(1, &[kv("node", node), kv("result", result)]);
    }

    fn heartbeat(&self, node: &str, rtt: Duration) {
        self.get()
            .heartbeat_rtt
            .record(rtt.as_secs_f64(), &[kv("node", node)]);
    }

    fn poll_query(&self, node: &str, keys: usize) {
        let i = self.get();
        i.poll_queries.add(1, &[kv("node", node)]);
        i.poll_keys.add(keys as u64, &[kv("node", node)]);
    }

    fn singleton_running(&self, node: &str, singleton: &str, running: bool) {
        self.note_singleton(node, singleton);
        self.get().singleton_running.record(
            u64::from(running),
            &[kv("node", node), kv("singleton", singleton)],
        );
    }

    fn singleton_known(&self, node: &str, singleton: &str) {
        if self.note_singleton(node, singleton) {
            let i = self.get();
            let attrs = [kv("node", node), kv("singleton", singleton)];
            i.singleton_running.record(0, &attrs);
            i.singleton_restarts.add(0, &attrs);
        }
    }

    fn singleton_restart(&self, node: &str, singleton: &str) {
        self.get()
            .singleton_restarts
            .add(1, &[kv("node", node), kv("singleton", singleton)]);
    }

    fn task_gated(&self, node: &str, lock: &str, outcome: &str) {
        self.get().apalis_tasks.add(
            1,
            &[kv("node", node), kv("lock", lock), kv("outcome", outcome)],
        );
    }

    fn follower_response(&self, node: &str, lock: &str) {
        self.get()
            .follower_responses
            .add(1, &[kv("node", node), kv("lock", lock)]);
    }

    fn leaderless(&self, node: &str, lock: &str, seen: Duration) {
        let i = self.get();
        let attrs = [kv("node", node), kv("lock", lock)];
        // Zero at the first observation: both series start at rest.
        i.leaderless.add(seen.as_secs_f64(), &attrs);
        if seen.is_zero() {
            i.leader_changes.add(0, &attrs);
        }
    }

    fn leader_changed(&self, node: &str, lock: &str) {
        self.get()
            .leader_changes
            .add(1, &[kv("node", node), kv("lock", lock)]);
    }

    fn fencing_token(&self, node: &str, lock: &str, token: Option<u64>) {
        self.get()
            .fencing_token
            .record(token.unwrap_or(0), &[kv("node", node), kv("lock", lock)]);
    }
}
