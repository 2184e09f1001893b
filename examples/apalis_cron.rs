//! Three nodes in one process run the same every-second apalis cron job, with the tick
//! ledger and `Misfire::CatchUp`: each tick runs once, on the leader, and its write
//! commits together with the tick's ledger row. Halfway through, the leader's database
//! session is killed; the next leader runs the ticks that fell in the gap, oldest
//! first, each once.
//!
//! ```text
//! cargo run --example apalis_cron
//! ```

use std::error::Error;
use std::str::FromStr;
use std::time::Duration;

use apalis_core::error::BoxDynError;
use apalis_core::monitor::Monitor;
use apalis_core::task::data::Data;
use chosen_apalis::{
    Claim, LeaderOnlyJobLayer, Misfire, Schedule, Tick, TickContext, TickLedger, cron_worker,
};
use chosen_core::{ConnectionState, LockManager, ManagerOptions};
use deadpool_postgres::Pool;

/// The job: one row per tick in `reports`, written in the ledger transaction, so the
/// row and the tick's ledger row commit together, once.
async fn report(tick: Tick, ctx: Data<TickContext>, pool: Data<Pool>) -> Result<(), BoxDynError> {
    let mut client = pool.get().await?;
    // Fenced with this leader's token, and the tick claimed: `None` if it is already
    // recorded (another leader ran it): nothing to do.
    let Some(tx) = ctx.begin(&mut client).await? else {
        return Ok(());
    };
    tx.execute(
        "INSERT INTO reports (tick, token) VALUES ($1, $2)",
        &[
            &i64::try_from(tick.get_timestamp())?,
            &i64::try_from(ctx.fencing_token().get())?,
        ],
    )
    .await?;
    tx.commit().await?;
    println!(
        "   tick {} ran on {}{}",
        clock(tick.get_timestamp()),
        ctx.node_id(),
        if ctx.is_catch_up() {
            " (missed during the failover: caught up)"
        } else {
            ""
        }
    );
    Ok(())
}

fn clock(ts: u64) -> String {
    format!("{:02}:{:02}:{:02}", ts / 3600 % 24, ts / 60 % 60, ts % 60)
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
    let pool = Pool::builder(deadpool_postgres::Manager::new(
        url.parse::<tokio_postgres::Config>()?,
        tokio_postgres::NoTls,
    ))
    .max_size(8)
    .build()?;
    let ledger = TickLedger::new(pool.clone());
    ledger.install().await?; // CREATE TABLE IF NOT EXISTS chosen_ticks, chosen_fence
    pool.get()
        .await?
        .batch_execute("CREATE TABLE IF NOT EXISTS reports (tick bigint, token bigint)")
        .await?;

    let schedule = Schedule::from_str("* * * * * *")?; // every second
    let stop = std::sync::Arc::new(tokio::sync::Notify::new());
    let mut nodes = Vec::new();
    println!(
        "Three nodes run the cron job \"* * * * * *\" with the tick ledger and CatchUp; every replica's scheduler fires every tick."
    );
    for i in 1..=3 {
        let manager =
            LockManager::connect(ManagerOptions::from_url(&url)?.node_id(format!("node-{i}")))
                .await?;
        // Today's gate, plus the ledger and a misfire policy.
        let gate = LeaderOnlyJobLayer::elect(&manager, "every-second-report")?
            .ledger(ledger.clone())
            .claim(Claim::InJobTransaction)
            .misfire(Misfire::CatchUp {
                max: 30,
                within: Duration::from_secs(60),
            });
        let stats = gate.stats();
        let leadership = gate.leadership().clone();
        let (schedule, pool, stop) = (schedule.clone(), pool.clone(), stop.clone());
        let monitor = tokio::spawn(async move {
            Monitor::new()
                .register(move |_| {
                    cron_worker(&format!("report-{i}"), schedule.clone(), gate.clone())
                        .data(pool.clone())
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

    tokio::time::sleep(Duration::from_secs(8)).await;
    if let Some((manager, ..)) = nodes.iter().find(|n| n.1.is_leader())
        && let ConnectionState::Connected { backend_pid, .. } = manager.connection_status()
    {
        println!("   -- killing {}'s database session --", manager.node_id());
        let admin = chosen_tests::connect_admin(&url).await?;
        admin
            .execute("SELECT pg_terminate_backend($1)", &[&backend_pid])
            .await?;
    }
    tokio::time::sleep(Duration::from_secs(8)).await;
    stop.notify_waiters();
    for (manager, _, _, monitor) in &mut nodes {
        let _ = tokio::time::timeout(Duration::from_secs(5), monitor).await;
        manager.shutdown().await;
    }

    let client = pool.get().await?;
    let row = client
        .query_one(
            "SELECT min(tick)::bigint, max(tick)::bigint, count(*), count(DISTINCT tick) FROM reports",
            &[],
        )
        .await?;
    let (first, last, rows, distinct): (Option<i64>, Option<i64>, i64, i64) =
        (row.get(0), row.get(1), row.get(2), row.get(3));
    let (Some(first), Some(last)) = (first, last) else {
        return Err("no tick ran".into());
    };
    let skipped: i64 = client
        .query_one(
            "SELECT count(*) FROM chosen_ticks WHERE job = 'every-second-report' AND outcome = 'skipped'",
            &[],
        )
        .await?
        .get(0);
    let caught_up: u64 = nodes.iter().map(|n| n.2.caught_up()).sum();
    println!(
        "\nTicks {}..{}: {} scheduled, {distinct} ran ({caught_up} of them caught up after the failover), {} ran twice, {} missing, {skipped} recorded as skipped.",
        clock(u64::try_from(first)?),
        clock(u64::try_from(last)?),
        last - first + 1,
        rows - distinct,
        last - first + 1 - distinct,
    );
    Ok(())
}
