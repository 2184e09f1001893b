//! Measures the latency of an uncontended acquire + release against the floor (the same
//! two statements on a raw tokio-postgres connection), and of a hand-over between two
//! managers (holder releases -> waiter's lease granted, woken by NOTIFY).
//!
//! ```text
//! cargo run --release --example latency [-- ROUNDS]
//! ```

use std::error::Error;
use std::time::{Duration, Instant};

use chosen_core::{LockManager, ManagerOptions};
use chosen_tests::{PgCluster, connect_admin};

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    let rounds: usize = std::env::args()
        .nth(1)
        .map(|a| a.parse())
        .transpose()?
        .unwrap_or(2000);
    let cluster = PgCluster::start()?;
    let url = cluster.url();

    // The floor (lock + unlock as two round trips on a raw connection) and chosen,
    // interleaved round by round so both see the same machine noise.
    let raw = connect_admin(&url).await?;
    let lock = raw.prepare("SELECT pg_try_advisory_lock(1, 2)").await?;
    let unlock = raw.prepare("SELECT pg_advisory_unlock(1, 2)").await?;
    let a = LockManager::connect(ManagerOptions::from_url(&url)?.node_id("latency-a")).await?;
    let mut floor = Vec::with_capacity(rounds);
    let mut ours = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let t = Instant::now();
        raw.query_one(&lock, &[]).await?;
        raw.query_one(&unlock, &[]).await?;
        floor.push(t.elapsed());

        let t = Instant::now();
        let lease = a.acquire("latency").await?;
        lease.release().await?;
        ours.push(t.elapsed());
    }

    // Hand-over: B waits with a long poll interval; A releases; time until B holds.
    let b = LockManager::connect(
        ManagerOptions::from_url(&url)?
            .node_id("latency-b")
            .poll_interval(Duration::from_secs(60)),
    )
    .await?;
    let handovers = (rounds / 10).max(20);
    let mut handover = Vec::with_capacity(handovers);
    for _ in 0..handovers {
        let lease = a.acquire("handover").await?;
        let waiter = tokio::spawn({
            let b = b.clone();
            async move {
                let lease = b.acquire("handover").await;
                (Instant::now(), lease)
            }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        let t = Instant::now();
        lease.release().await?;
        let (got, lease_b) = waiter.await?;
        handover.push(got - t);
        lease_b?.release().await?;
    }

    println!("rounds: {rounds} (hand-overs: {handovers})");
    report("floor: raw lock + unlock (2 round trips)", &mut floor);
    report("chosen: acquire + release, uncontended", &mut ours);
    report("chosen: hand-over between managers", &mut handover);
    let ratio = percentile(&ours, 50).as_secs_f64() / percentile(&floor, 50).as_secs_f64();
    println!("ratio p50 chosen / floor: {ratio:.2}");
    a.shutdown().await;
    b.shutdown().await;
    Ok(())
}

fn percentile(sorted: &[Duration], p: usize) -> Duration {
    sorted[(sorted.len() * p / 100).min(sorted.len() - 1)]
}

fn report(label: &str, samples: &mut [Duration]) {
    samples.sort();
    println!(
        "{label:<45} p50 {:>8.1} us   p99 {:>8.1} us",
        percentile(samples, 50).as_secs_f64() * 1e6,
        percentile(samples, 99).as_secs_f64() * 1e6
    );
}
