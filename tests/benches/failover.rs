//! The database's own failures, measured: takeover after a primary failover (a standby
//! promoted, the follower on a multi-host URL), with the old holder connected or
//! partitioned; and the highest steady round trip to the database a leader holds
//! without a leader change, at default and tightened settings.
//!
//! ```text
//! cargo bench -p chosen-tests --bench failover              # 3 rounds, ~8 minutes
//! cargo bench -p chosen-tests --bench failover -- --smoke   # 1 round, short holds
//! ```
//!
//! Prints Markdown for `BENCHMARKS.md`.

#![allow(missing_docs)] // a benchmark binary

use std::time::{Duration, Instant};

use chosen_core::{ConnectionState, LockManager, ManagerOptions};
use chosen_tests::{
    FaultProxy, PgCluster, ProxyMode, SUPERUSER_PASSWORD, connect_admin, fault_options,
};

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

fn ms(d: Duration) -> String {
    format!("{:.0}", d.as_secs_f64() * 1000.0)
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v.get(v.len() / 2).copied().unwrap_or_default()
}

struct Takeover {
    /// The standby's promotion finished -> the follower's lease granted.
    after_promotion: Duration,
    /// The primary was told to stop -> the follower's lease granted.
    after_stop: Duration,
    /// The primary was told to stop -> the old holder's lease revoked.
    old_revoked: Duration,
}

/// One failover: holder A on the primary (through a proxy, black-holed first when
/// `partitioned`), follower B on a multi-host URL; the primary stops, the standby is
/// promoted.
async fn failover(partitioned: bool) -> Res<Takeover> {
    let mut primary = PgCluster::start_local()?;
    let standby = primary.start_standby()?;
    let (primary_port, standby_port) = (
        primary.port().ok_or("local cluster")?,
        standby.port().ok_or("local cluster")?,
    );
    let proxy = FaultProxy::start(([127, 0, 0, 1], primary_port).into()).await?;
    let a_opts = fault_options(&proxy.url(&primary.url(), primary_port), "bench-a");
    tokio::time::sleep(a_opts.get_term_grant_delay()).await;
    let multi_host = format!(
        "host=127.0.0.1,127.0.0.1 port={primary_port},{standby_port} user=postgres password={SUPERUSER_PASSWORD} dbname=postgres"
    );
    let a = LockManager::connect(a_opts).await?;
    let b = LockManager::connect(fault_options(&multi_host, "bench-b")).await?;
    let held = a.acquire("failover").await?;
    let a_lost = tokio::spawn(async move {
        held.lost().await;
        Instant::now()
    });
    let b_task = tokio::spawn(async move {
        let lease = b.acquire("failover").await;
        (Instant::now(), b, lease)
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    if partitioned {
        proxy.set(ProxyMode::BlackHole);
    }
    let t0 = Instant::now();
    let primary =
        tokio::task::spawn_blocking(move || primary.stop("fast").map(|()| primary)).await??;
    let admin = connect_admin(&standby.url()).await?;
    let promoted: bool = admin
        .query_one("SELECT pg_promote(true, 60)", &[])
        .await?
        .get(0);
    if !promoted {
        return Err("pg_promote did not finish".into());
    }
    let promoted_at = Instant::now();
    let (b_at, b, lease) = tokio::time::timeout(Duration::from_secs(60), b_task).await??;
    drop(lease?);
    let a_lost_at = tokio::time::timeout(Duration::from_secs(30), a_lost).await??;
    if b_at <= a_lost_at {
        return Err(format!(
            "overlap: the new holder started {:?} before the old one was revoked",
            a_lost_at - b_at
        )
        .into());
    }
    match b.connection_status() {
        ConnectionState::Connected { server, .. }
            if server == format!("127.0.0.1:{standby_port}") => {}
        other => {
            return Err(format!("the follower is not on the promoted server: {other:?}").into());
        }
    }
    drop((a, b, primary));
    Ok(Takeover {
        after_promotion: b_at.saturating_duration_since(promoted_at),
        after_stop: b_at - t0,
        old_revoked: a_lost_at - t0,
    })
}

/// The largest of `ladder` (round trips) that the leader held for `hold` without a
/// leader change, and the first that moved the lease (if any).
async fn latency_ladder(
    heartbeat: Duration,
    lease_timeout: Duration,
    ladder: &[Duration],
    hold: Duration,
) -> Res<(Option<Duration>, Option<Duration>)> {
    let pg = PgCluster::start_local()?;
    let port = pg.port().ok_or("local cluster")?;
    let proxy = FaultProxy::start(([127, 0, 0, 1], port).into()).await?;
    let tune = |o: ManagerOptions| o.heartbeat_interval(heartbeat).lease_timeout(lease_timeout);
    let a = LockManager::connect(tune(fault_options(&proxy.url(&pg.url(), port), "slow"))).await?;
    let b = LockManager::connect(tune(fault_options(&pg.url(), "fast"))).await?;
    let lease = a.acquire("latency").await?;
    let b_task = tokio::spawn(async move { b.acquire("latency").await.map(|l| (b, l)) });
    let mut held = None;
    for &rtt in ladder {
        proxy.set(ProxyMode::Latency(rtt));
        let step = Instant::now();
        while step.elapsed() < hold && lease.is_valid() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        if !lease.is_valid() {
            proxy.set(ProxyMode::Pass);
            // The lease moved: the other node takes over (cleanly: it waits for the
            // lock, which the revoked session gives up when its connection ends).
            let _ = tokio::time::timeout(Duration::from_secs(60), b_task).await;
            return Ok((held, Some(rtt)));
        }
        held = Some(rtt);
    }
    proxy.set(ProxyMode::Pass);
    b_task.abort();
    Ok((held, None))
}

#[tokio::main]
async fn main() -> Res<()> {
    let smoke = std::env::args().any(|a| a == "--smoke");
    let rounds = if smoke { 1 } else { 3 };
    let hold = Duration::from_secs(if smoke { 3 } else { 15 });
    println!("## Database failover (`cargo bench -p chosen-tests --bench failover`)\n");
    println!(
        "Primary stopped (`pg_ctl stop -m fast`), hot standby promoted (`pg_promote`); the follower is on a multi-host URL (read-write targeting) and finds the promoted server by itself. Defaults: lease timeout 3 s, term grant delay 6 s; {rounds} rounds each, median.\n"
    );
    println!(
        "| old holder | old lease revoked (ms after stop) | new holder (ms after stop) | new holder (ms after promotion) |"
    );
    println!("|---|---|---|---|");
    for partitioned in [false, true] {
        let mut runs = Vec::new();
        for _ in 0..rounds {
            runs.push(failover(partitioned).await?);
        }
        println!(
            "| {} | {} | {} | {} |",
            if partitioned {
                "partitioned (silent)"
            } else {
                "connected"
            },
            ms(median(runs.iter().map(|r| r.old_revoked).collect())),
            ms(median(runs.iter().map(|r| r.after_stop).collect())),
            ms(median(runs.iter().map(|r| r.after_promotion).collect())),
        );
    }
    println!("\n## Latency (highest steady round trip held without a leader change)\n");
    println!(
        "Every chunk to and from the leader's server delayed (a loopback proxy, order kept), each step held {hold:?}; a second node waits for the lock.\n"
    );
    println!("| settings | bound (lease - heartbeat) | held | first step that moved the lease |");
    println!("|---|---|---|---|");
    for (label, heartbeat, lease) in [
        (
            "defaults (heartbeat 1 s, lease 3 s)",
            Duration::from_secs(1),
            Duration::from_secs(3),
        ),
        (
            "tightened (heartbeat 250 ms, lease 1 s)",
            Duration::from_millis(250),
            Duration::from_secs(1),
        ),
    ] {
        let bound = lease - heartbeat;
        let ladder: Vec<Duration> = [50u32, 75, 90, 95, 105, 120]
            .iter()
            .map(|pct| bound * *pct / 100)
            .collect();
        let (held, moved) = latency_ladder(heartbeat, lease, &ladder, hold).await?;
        println!(
            "| {label} | {} ms | {} | {} |",
            ms(bound),
            held.map_or("none".to_owned(), |d| format!("{} ms", ms(d))),
            moved.map_or("none".to_owned(), |d| format!("{} ms", ms(d))),
        );
    }
    Ok(())
}
