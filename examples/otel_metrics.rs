//! Exporting chosen's OpenTelemetry instruments, here through the
//! `opentelemetry-prometheus` exporter (OTLP works the same way: install any meter
//! provider before the first lock is taken).
//!
//! ```text
//! cargo run --example otel_metrics
//! ```

use std::error::Error;
use std::sync::Arc;

use chosen_core::{LockManager, ManagerOptions, OtelMetrics};
use opentelemetry_sdk::metrics::SdkMeterProvider;

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    // 1. The application installs its meter provider (chosen never does).
    let registry = prometheus::Registry::new();
    let exporter = opentelemetry_prometheus::exporter()
        .with_registry(registry.clone())
        .build()?;
    let provider = SdkMeterProvider::builder().with_reader(exporter).build();
    opentelemetry::global::set_meter_provider(provider.clone());

    // 2. chosen reports through the global meter, created on first use.
    let (url, _cluster) = match std::env::var("DATABASE_URL") {
        Ok(url) if !url.is_empty() => (url, None),
        _ => {
            let cluster = chosen_tests::PgCluster::start_local()?;
            (cluster.url(), Some(cluster))
        }
    };
    let options = ManagerOptions::from_url(&url)?
        .node_id("otel-demo")
        .metrics(Arc::new(OtelMetrics::new()));
    let manager = LockManager::connect(options).await?;
    let lease = manager.acquire("otel-demo-lock").await?;
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await; // a heartbeat or so
    lease.release().await?;
    manager.shutdown().await;

    // 3. Whatever the exporter exports; here, the Prometheus text format.
    let mut text = Vec::new();
    prometheus::Encoder::encode(
        &prometheus::TextEncoder::new(),
        &registry.gather(),
        &mut text,
    )?;
    for line in String::from_utf8(text)?.lines() {
        if line.starts_with("chosen_") && !line.contains("_bucket") {
            println!("{line}");
        }
    }
    provider.shutdown()?;
    Ok(())
}
