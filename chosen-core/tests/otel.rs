//! The OpenTelemetry sink reaches a provider installed after the sink was made, and
//! shows known locks and singletons at rest.

use std::collections::BTreeSet;
use std::time::Duration;

use chosen_core::{MetricsSink, OtelMetrics};
use opentelemetry_sdk::metrics::data::{AggregatedMetrics, MetricData, ResourceMetrics};
use opentelemetry_sdk::metrics::{InMemoryMetricExporter, SdkMeterProvider};

/// The last value of the u64 gauge `name` with attribute `key` = `value`.
fn gauge(metrics: &[ResourceMetrics], name: &str, key: &str, value: &str) -> Option<u64> {
    metrics
        .iter()
        .flat_map(|rm| rm.scope_metrics().flat_map(|sm| sm.metrics()))
        .filter(|m| m.name() == name)
        .filter_map(|m| match m.data() {
            AggregatedMetrics::U64(MetricData::Gauge(g)) => g
                .data_points()
                .find(|p| {
                    p.attributes()
                        .any(|kv| kv.key.as_str() == key && kv.value.as_str() == value)
                })
                .map(|p| p.value()),
            _ => None,
        })
        .last()
}

#[test]
fn instruments_use_the_provider_installed_later() {
    // Made before the application installs its provider: nothing is bound yet.
    let sink = OtelMetrics::new();

    let exporter = InMemoryMetricExporter::default();
    let provider = SdkMeterProvider::builder()
        .with_periodic_exporter(exporter.clone())
        .build();
    opentelemetry::global::set_meter_provider(provider.clone());

    sink.lock_acquired("n1", "report", Duration::from_millis(3));
    sink.lock_released("n1", "report");
    sink.lock_lost("n1", "report", "heartbeat_overdue");
    sink.lock_waiting("n1", "report", 2);
    sink.connection_changed("n1", true, 4);
    sink.reconnect_attempt("n1", false);
    sink.heartbeat("n1", Duration::from_micros(400));
    sink.poll_query("n1", 12);
    sink.singleton_running("n1", "report", true);
    sink.singleton_restart("n1", "report");
    sink.task_gated("n1", "cron", "ran");
    sink.follower_response("n1", "admin");
    sink.leaderless("n1", "report", Duration::ZERO);
    sink.leaderless("n1", "report", Duration::from_secs(3));
    sink.leader_changed("n1", "report");
    sink.fencing_token("n1", "report", Some((40 << 48) | 7));
    sink.fencing_token("n1", "idle", None);
    // At rest until they lead; a running singleton stays running when another of its
    // name starts.
    sink.lock_known("n1", "idle");
    sink.singleton_known("n1", "idle");
    sink.singleton_known("n1", "report");
    provider.force_flush().unwrap();

    let finished = exporter.get_finished_metrics().unwrap();
    assert_eq!(
        gauge(&finished, "chosen.lock.held", "lock", "idle"),
        Some(0)
    );
    assert_eq!(
        gauge(&finished, "chosen.lock.waiters", "lock", "idle"),
        Some(0)
    );
    assert_eq!(
        gauge(&finished, "chosen.singleton.running", "singleton", "idle"),
        Some(0)
    );
    assert_eq!(
        gauge(&finished, "chosen.singleton.running", "singleton", "report"),
        Some(1)
    );
    // A token above 2^53 (timeline 40) stays exact in a u64 gauge.
    assert_eq!(
        gauge(&finished, "chosen.fencing_token", "lock", "report"),
        Some((40 << 48) | 7)
    );
    assert_eq!(
        gauge(&finished, "chosen.fencing_token", "lock", "idle"),
        Some(0)
    );
    let names: BTreeSet<String> = finished
        .iter()
        .flat_map(|rm| {
            rm.scope_metrics()
                .flat_map(|sm| sm.metrics().map(|m| m.name().to_owned()))
                .collect::<Vec<_>>()
        })
        .collect();
    for expected in [
        "chosen.lock.held",
        "chosen.lock.waiters",
        "chosen.lock.acquisitions",
        "chosen.lock.losses",
        "chosen.lock.wait",
        "chosen.connection.up",
        "chosen.session.generation",
        "chosen.reconnects",
        "chosen.heartbeat.rtt",
        "chosen.poll.queries",
        "chosen.poll.keys",
        "chosen.singleton.running",
        "chosen.singleton.restarts",
        "chosen.apalis.tasks",
        "chosen.tower.follower_responses",
        "chosen.leaderless",
        "chosen.leader.changes",
        "chosen.fencing_token",
    ] {
        assert!(
            names.contains(expected),
            "{expected} missing from {names:?}"
        );
    }
    provider.shutdown().unwrap();
}
