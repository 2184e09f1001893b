//! Three nodes in one process run the same every-second apalis cron job; each tick runs
//! once, on the leader. Halfway through, the leader's database session is killed and
//! another node carries on.
//!
//! ```text
//! cargo run --example apalis_cron
//! ```

use std::collections::BTreeMap;
use std::error::Error;
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use apalis_core::error::BoxDynError;
use apalis_core::monitor::Monitor;
use apalis_core::task::data::Data;
use chosen_apalis::{LeaderGuard, LeaderOnlyJobLayer, Schedule, Tick, cron_worker};
use chosen_core::{ConnectionStatus, LockManager, ManagerOptions};

/// Which node ran which tick.
type Ledger = Arc<Mutex<BTreeMap<u64, Vec<String>>>>;

async fn report(
    tick: Tick,
    guard: Data<LeaderGuard>,
    ledger: Data<Ledger>,
) -> Result<(), BoxDynError> {
    let ts = tick.get_timestamp();
    println!(
        "   tick {} ran on {} (fencing token {})",
        clock(ts),
        guard.node_id(),
        guard.fencing_token()
    );
    ledger
        .lock()
        .map_err(|_| "ledger poisoned")?
        .entry(ts)
        .or_default()
        .push(guard.node_id().to_owned());
    Ok(())
}

fn clock(ts: u64) -> String {
    format!("{:02}:{:02}:{:02}", ts / 3600 % 24, ts / 60 % 60, ts % 60)
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    let (url, _cluster) = match std::env::var("DATABASE_URL") {
        Ok(url) if !url.is_empty() => (url, None),
        _ => {
            println!("No DATABASE_URL: starting a throwaway PostgreSQL cluster...");
            let cluster = chosen_tests::PgCluster::start_local()?;
            (cluster.url(), Some(cluster))
        }
    };
    let schedule = Schedule::from_str("* * * * * *")?; // every second
    let ledger: Ledger = Arc::default();
    let stop = Arc::new(tokio::sync::Notify::new());
    let mut nodes = Vec::new();
    println!(
        "Three nodes run the cron job \"* * * * * *\"; every replica's scheduler fires every tick."
    );
    for i in 1..=3 {
        let manager =
            LockManager::connect(ManagerOptions::from_url(&url)?.node_id(format!("node-{i}")))
                .await?;
        let gate = LeaderOnlyJobLayer::elect(&manager, "every-second-report")?;
        let stats = gate.stats();
        let leadership = gate.leadership().clone();
        let (schedule, ledger, stop) = (schedule.clone(), Arc::clone(&ledger), Arc::clone(&stop));
        let monitor = tokio::spawn(async move {
            Monitor::new()
                .register(move |_| {
                    cron_worker(&format!("report-{i}"), schedule.clone(), gate.clone())
                        .data(Arc::clone(&ledger))
                        .build(report)
                })
                .run_with_signal(async move {
                    stop.notified().await;
                    Ok(())
                })
                .await
        });
        nodes.push((manager, leadership, stats, monitor));
    }

    tokio::time::sleep(Duration::from_secs(5)).await;
    if let Some((manager, ..)) = nodes.iter().find(|n| n.1.is_leader())
        && let ConnectionStatus::Connected { backend_pid, .. } = manager.connection_status()
    {
        println!("   -- killing {}'s database session --", manager.node_id());
        let admin = chosen_tests::connect_admin(&url).await?;
        admin
            .execute("SELECT pg_terminate_backend($1)", &[&backend_pid])
            .await?;
    }
    tokio::time::sleep(Duration::from_secs(5)).await;
    let end = now_secs();
    stop.notify_waiters();
    for (manager, _, _, monitor) in nodes.iter_mut() {
        let _ = tokio::time::timeout(Duration::from_secs(5), monitor).await;
        manager.shutdown().await;
    }

    let ledger = ledger.lock().map_err(|_| "ledger poisoned")?;
    let (Some(first), Some(last)) = (ledger.keys().next(), ledger.keys().last()) else {
        return Err("no tick ran".into());
    };
    let scheduled = last - first + 1;
    let executed: usize = ledger.values().map(Vec::len).sum();
    let duplicates = ledger.values().filter(|v| v.len() > 1).count();
    let skipped: u64 = nodes
        .iter()
        .map(|n| n.2.skipped_not_leader() + n.2.skipped_stale_tick())
        .sum();
    println!(
        "\nTicks {}..{}: {scheduled} scheduled, {executed} executed, {} missed in the failover, {duplicates} ran twice; the gates skipped {skipped} (the followers' copies). Stopped at {}.",
        clock(*first),
        clock(*last),
        scheduled.saturating_sub(executed as u64),
        clock(end)
    );
    Ok(())
}
