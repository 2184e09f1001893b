//! Where chosen reports what it does, for metrics.
//!
//! Every layer reports to one [`MetricsSink`] given to the manager with
//! [`ManagerOptions::metrics`](crate::ManagerOptions::metrics): the manager's task
//! (locks, session, heartbeats, polls), singletons, and the tower and apalis adapters
//! (through [`Leadership::metrics`](crate::Leadership::metrics)). Two sinks ship behind
//! features:
//!
//! | feature | sink | names |
//! |---|---|---|
//! | `prometheus` | [`PrometheusMetrics`]: collectors in a `prometheus::Registry` you pass | `chosen_*`, e.g. `chosen_lock_held` |
//! | `opentelemetry` | [`OtelMetrics`]: instruments of the global meter provider | `chosen.*`, e.g. `chosen.lock.held` |
//!
//! Use one or the other for one registry: exported through `opentelemetry-prometheus`,
//! the OpenTelemetry names would turn into the same `chosen_*` families with other
//! labels.
//!
//! Labels are bounded: `node` (one per manager), `lock` / `singleton` (the names your
//! code uses; keep them a fixed set, not per-request values), `reason` and `outcome`
//! (fixed sets, listed on each method).

use std::fmt;
use std::time::Duration;

#[cfg(feature = "opentelemetry")]
mod otel;
#[cfg(feature = "prometheus")]
mod prometheus;

#[cfg(feature = "opentelemetry")]
#[cfg_attr(docsrs, doc(cfg(feature = "opentelemetry")))]
pub use otel::OtelMetrics;
#[cfg(feature = "prometheus")]
#[cfg_attr(docsrs, doc(cfg(feature = "prometheus")))]
pub use prometheus::PrometheusMetrics;

/// Receives chosen's events. Every method has an empty default, so a sink implements
/// only what it needs. Calls are made inline on hot paths: keep them cheap.
pub trait MetricsSink: Send + Sync + fmt::Debug {
    /// `node` got `lock` after waiting `waited` (zero for a lock that was free).
    fn lock_acquired(&self, node: &str, lock: &str, waited: Duration) {
        let _ = (node, lock, waited);
    }

    /// `node` released `lock` (or handed it to another local request).
    fn lock_released(&self, node: &str, lock: &str) {
        let _ = (node, lock);
    }

    /// `node` lost `lock` with its session. `reason`: `connection_lost`,
    /// `heartbeat_overdue`, `server_in_recovery`, `server_read_only`, `backend_changed`, `pooler_detected`,
    /// `shutdown`.
    fn lock_lost(&self, node: &str, lock: &str, reason: &str) {
        let _ = (node, lock, reason);
    }

    /// `node` now knows `lock`, and neither holds it nor has a request queued for it: a
    /// sink shows the lock's series at rest (`held` 0, no waiters, no acquisitions
    /// yet), so that a follower exports `held = 0` before it ever leads and "nobody
    /// leads" needs no `absent()`.
    ///
    /// Called when a request for `lock` (an acquire, an election's or a singleton's)
    /// reaches a manager that has no state for it: the first time, and again after the
    /// manager forgot the lock (nobody held or wanted it). Never while this manager
    /// holds the lock, so a sink may set its gauges to 0.
    fn lock_known(&self, node: &str, lock: &str) {
        let _ = (node, lock);
    }

    /// `waiters` requests of `node` now wait for `lock`.
    fn lock_waiting(&self, node: &str, lock: &str, waiters: usize) {
        let _ = (node, lock, waiters);
    }

    /// The session of `node` went up (`generation` is the new one) or down.
    fn connection_changed(&self, node: &str, up: bool, generation: u64) {
        let _ = (node, up, generation);
    }

    /// A reconnect attempt of `node` ended (`ok` or failed).
    fn reconnect_attempt(&self, node: &str, ok: bool) {
        let _ = (node, ok);
    }

    /// A heartbeat of `node` succeeded after `rtt`.
    fn heartbeat(&self, node: &str, rtt: Duration) {
        let _ = (node, rtt);
    }

    /// `node` ran one batched acquire statement for `keys` keys.
    fn poll_query(&self, node: &str, keys: usize) {
        let _ = (node, keys);
    }

    /// The child of `singleton` on `node` started or stopped.
    fn singleton_running(&self, node: &str, singleton: &str, running: bool) {
        let _ = (node, singleton, running);
    }

    /// A [`Singleton`](crate::Singleton) for `singleton` started on `node`; its child
    /// does not run yet. A sink shows the singleton's series at rest (`running` 0, no
    /// restarts), unless they exist already: another singleton of the same name on this
    /// node may run its child right now.
    fn singleton_known(&self, node: &str, singleton: &str) {
        let _ = (node, singleton);
    }

    /// The child of `singleton` on `node` was restarted.
    fn singleton_restart(&self, node: &str, singleton: &str) {
        let _ = (node, singleton);
    }

    /// An apalis task reached the gate for `lock`. Reported once per answer of the
    /// gate, and once per missed tick its misfire policy decided about. `outcome`:
    /// `ran`, `skipped_not_leader`, `skipped_stale_tick`; with chosen-apalis' tick
    /// ledger also `caught_up` (a missed tick run late; its run counts as `ran` too),
    /// `skipped_missed` (once per missed tick recorded as skipped),
    /// `skipped_already_recorded`, `skipped_ledger_error`, `skipped_overlap`,
    /// `skipped_not_due` (delivered over an hour before the database's clock reaches
    /// it), `cancelled` (a run stopped before it ended, also counted `ran` once
    /// claimed; or a tick stopped before its run started: the worker shutting down, a
    /// newer tick).
    ///
    /// Ticks skipped or missed, by reason, are one query:
    /// `sum by (lock, outcome) (increase(chosen_apalis_tasks_total{outcome=~"skipped_.*|cancelled", outcome!~"skipped_not_leader|skipped_already_recorded"}[1h]))`.
    /// The two left out are the normal answers of a follower (to every tick) and to a
    /// tick delivered twice. A tick answered `skipped_stale_tick`, `skipped_not_due`,
    /// `skipped_ledger_error`, `skipped_overlap` under `Overlap::Buffer`, or
    /// `cancelled` before its run started (left unrecorded), is also decided about as a
    /// missed tick (`skipped_missed` or `caught_up`), then or by a later leader, so the
    /// sum counts such a tick twice; a shutdown during a catch-up reports `cancelled`
    /// for each missed tick it did not reach.
    fn task_gated(&self, node: &str, lock: &str, outcome: &str) {
        let _ = (node, lock, outcome);
    }

    /// `node` saw nobody lead `lock` for `seen` more: the time between two observations
    /// of its [`Election`](crate::Election) or [`Singleton`](crate::Singleton) for the
    /// lock that both found no valid holder anywhere in the fleet (a follower's leader
    /// look-up, every 2 s, that found no holder; the end of this node's own term; the
    /// lock won by this node, free just before). A sink adds it up
    /// (`chosen_leaderless_seconds_total`).
    ///
    /// What it leaves out: the time between an observation that saw a leader and one
    /// that saw none (the leader may have left just before the second), so a hand-over
    /// of a few milliseconds adds nothing and a follower that just started counts
    /// nothing before its first look-up; and whatever happens while look-ups fail (the
    /// database unreachable: the gap is counted at the next observation if both ends
    /// saw nobody, so alert on `chosen_connection_up` for outages). What it may add:
    /// a node that wins the lock again counts the time since the end of its own last
    /// term, which can include another node's short term within the pause before it
    /// contends again (about two poll intervals). With a follower looking every 2 s, a
    /// stretch of `n` seconds adds about `n` less up to two look-up intervals (4 s) on
    /// each node that keeps looking. A look-up that finds this node's own id holding
    /// the lock (a former session of it) counts as held. A counter rather than a
    /// histogram of stretches: it grows *during* a stretch (at each look-up), where a
    /// stretch's histogram sample would only come once a leader is back, too late for
    /// the alert that matters.
    ///
    /// Called with [`Duration::ZERO`] at this node's first observation of the lock, so
    /// that a sink shows the lock's leadership series (this and
    /// [`leader_changed`](Self::leader_changed)) at rest before they first move.
    fn leaderless(&self, node: &str, lock: &str, seen: Duration) {
        let _ = (node, lock, seen);
    }

    /// `node` saw the leadership of `lock` change hands: a leader observed (itself or
    /// another node, by its [`Election`](crate::Election) or
    /// [`Singleton`](crate::Singleton) for the lock) other than the last one it
    /// observed, or the same one again after it observed nobody leading (a new term).
    /// A follower sees a change between two other nodes when its look-ups (every 2 s)
    /// catch both leaders; a change and its reversal within one look-up interval go
    /// unseen. The first leader a node observes is no change. Every node that
    /// observes counts the change: take `max by (lock)` across nodes, not `sum`.
    fn leader_changed(&self, node: &str, lock: &str) {
        let _ = (node, lock);
    }

    /// The fencing token of `lock` on `node`: `Some` when this node holds the lock and
    /// knows the token (granted with it, as every [`Election`](crate::Election)'s and
    /// [`Singleton`](crate::Singleton)'s lease is, or issued at a
    /// [`Lease::fencing_token`](crate::Lease::fencing_token) call); `None` right after
    /// it released or lost the lock. Tokens grow with every acquisition, on any node.
    fn fencing_token(&self, node: &str, lock: &str, token: Option<u64>) {
        let _ = (node, lock, token);
    }

    /// The tower layer answered a request itself because `node` does not lead `lock`.
    fn follower_response(&self, node: &str, lock: &str) {
        let _ = (node, lock);
    }
}
