//! What a fleet costs the database, measured: connections and statements per second
//! for 10, 100 and 1,000 contenders (a `LockManager` each, all in one election: one
//! leads, the rest wait) and for as many observers (an `Observer` each, on a shared
//! pool of 4 connections, each watching the election), in one process against one
//! throwaway server. Statements are counted by `pg_stat_statements` over 10 s once
//! settled; connections are the server's client backends.
//!
//! ```text
//! cargo bench -p chosen-tests --bench scale
//! CHOSEN_SCALE_SIZES=10,100 cargo bench -p chosen-tests --bench scale
//! ```
//!
//! Prints Markdown for `BENCHMARKS.md`.

#![allow(missing_docs)] // a benchmark binary

use std::time::{Duration, Instant};

use chosen_core::{Election, LockManager, ManagerOptions, Observer, ObserverOptions};
use chosen_tests::PgCluster;
use deadpool_postgres::Pool;

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const ELECTION: &str = "scale-election";
/// How long the steady cost is counted.
const WINDOW: Duration = Duration::from_secs(10);

async fn calls(admin: &tokio_postgres::Client) -> Res<i64> {
    Ok(admin
        .query_one(
            "SELECT coalesce(sum(calls), 0)::int8 FROM pg_stat_statements WHERE query NOT LIKE '%pg_stat_statements%' AND query NOT LIKE '%client backend%'",
            &[],
        )
        .await?
        .get(0))
}

/// Client backends of the server, the admin connection left out.
async fn connections(admin: &tokio_postgres::Client) -> Res<i64> {
    Ok(admin
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()",
            &[],
        )
        .await?
        .get(0))
}

/// Statements per second over [`WINDOW`], and the connections at its end.
async fn steady(admin: &tokio_postgres::Client) -> Res<(f64, i64)> {
    tokio::time::sleep(Duration::from_secs(2)).await;
    let c0 = calls(admin).await?;
    let t0 = Instant::now();
    tokio::time::sleep(WINDOW).await;
    let per_second = (calls(admin).await? - c0) as f64 / t0.elapsed().as_secs_f64();
    Ok((per_second, connections(admin).await?))
}

/// `n` managers, each in the election; the statements and connections once one leads.
async fn contenders(url: &str, admin: &tokio_postgres::Client, n: usize) -> Res<(f64, i64)> {
    let before = connections(admin).await?;
    let mut managers = Vec::with_capacity(n);
    let mut elections = Vec::with_capacity(n);
    // Connected in batches: each new manager proves the server with a second
    // connection for a moment, which must fit under max_connections too.
    for batch in (0..n).collect::<Vec<_>>().chunks(20) {
        let connecting: Vec<_> = batch
            .iter()
            .map(|i| {
                // A thousand backends starting on two cores: a connect may take a while.
                let options = ManagerOptions::from_url(url).map(|o| {
                    o.node_id(format!("scale-{i}"))
                        .term_grant_delay(Duration::ZERO)
                        .connect_timeout(Duration::from_secs(30))
                });
                tokio::spawn(async move {
                    let options = options?;
                    // A loaded machine may time a connect out: tried again, a few times.
                    let mut tries = 0;
                    loop {
                        match LockManager::connect(options.clone()).await {
                            Err(e) if tries < 5 && e.is_transient() => tries += 1,
                            other => break other,
                        }
                    }
                })
            })
            .collect();
        for m in connecting {
            let m = m.await??;
            elections.push(Election::start(&m, ELECTION)?);
            managers.push(m);
        }
    }
    let t0 = Instant::now();
    while !elections.iter().any(|e| e.leadership().is_leader()) {
        assert!(t0.elapsed() < Duration::from_secs(60), "nobody leads");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (rate, after) = steady(admin).await?;
    drop(elections);
    for m in managers {
        m.shutdown().await;
    }
    settle(admin, before).await?;
    Ok((rate, after - before))
}

/// `n` managers in the lease-row mode, each on a pool of its own (one connection)
/// through a PgBouncer in transaction mode with 10 server connections, each in the
/// election; the statements and the server's connections once one leads.
async fn lease_contenders(
    pg: &PgCluster,
    admin: &tokio_postgres::Client,
    n: usize,
) -> Res<(f64, i64)> {
    let before = connections(admin).await?;
    let bouncer = chosen_tests::PgBouncer::start(pg, "transaction", 10)?;
    let config: tokio_postgres::Config = bouncer.url().parse()?;
    let mut managers = Vec::with_capacity(n);
    let mut elections = Vec::with_capacity(n);
    for batch in (0..n).collect::<Vec<_>>().chunks(20) {
        let connecting: Vec<_> = batch
            .iter()
            .map(|i| {
                let pool = Pool::builder(deadpool_postgres::Manager::new(
                    config.clone(),
                    tokio_postgres::NoTls,
                ))
                .max_size(1)
                .build();
                let options = ManagerOptions::pooled()
                    .node_id(format!("scale-rows-{i}"))
                    .term_grant_delay(Duration::ZERO);
                tokio::spawn(async move {
                    let pool = pool?;
                    let mut tries = 0;
                    loop {
                        match LockManager::connect_pooled(pool.clone(), options.clone()).await {
                            Err(e) if tries < 3 && e.is_transient() => tries += 1,
                            other => {
                                break other
                                    .map_err(Box::<dyn std::error::Error + Send + Sync>::from);
                            }
                        }
                    }
                })
            })
            .collect();
        for m in connecting {
            let m = m.await??;
            elections.push(Election::start(&m, ELECTION)?);
            managers.push(m);
        }
    }
    let t0 = Instant::now();
    while !elections.iter().any(|e| e.leadership().is_leader()) {
        assert!(t0.elapsed() < Duration::from_secs(60), "nobody leads");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (rate, after) = steady(admin).await?;
    drop(elections);
    for m in managers {
        m.shutdown().await;
    }
    // The pooler's server connections end with it.
    drop(bouncer);
    settle(admin, before).await?;
    Ok((rate, after - before))
}

/// Waits (at most 5 s) until the server is back to `connections` client backends.
async fn settle(admin: &tokio_postgres::Client, count: i64) -> Res<()> {
    let t0 = Instant::now();
    while connections(admin).await? > count && t0.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

/// `n` observers on one shared pool of 4, each watching the election (held by one
/// manager); the statements and connections of the observers alone.
async fn observers(url: &str, admin: &tokio_postgres::Client, n: usize) -> Res<(f64, i64)> {
    let holder = LockManager::connect(
        ManagerOptions::from_url(url)?
            .node_id("scale-holder")
            .term_grant_delay(Duration::ZERO),
    )
    .await?;
    let election = Election::start(&holder, ELECTION)?;
    election.leadership().wait_leading().await;
    let (holder_rate, holder_connections) = steady(admin).await?;
    let config: tokio_postgres::Config = url.parse()?;
    let pool = Pool::builder(deadpool_postgres::Manager::new(
        config,
        tokio_postgres::NoTls,
    ))
    .max_size(4)
    .build()?;
    let mut all = Vec::with_capacity(n);
    let mut watching = Vec::with_capacity(n);
    for i in 0..n {
        let o = Observer::new(
            pool.clone(),
            ObserverOptions::default().node_id(format!("observer-{i}")),
        )?;
        watching.push(o.watch(ELECTION)?);
        all.push(o);
    }
    let t0 = Instant::now();
    while !watching
        .iter()
        .all(|l| l.leader().as_deref() == Some("scale-holder"))
    {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the observers do not see the leader"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (rate, connections) = steady(admin).await?;
    drop((all, watching, election));
    holder.shutdown().await;
    Ok((rate - holder_rate, connections - holder_connections))
}

#[tokio::main]
async fn main() -> Res<()> {
    let sizes: Vec<usize> = std::env::var("CHOSEN_SCALE_SIZES")
        .unwrap_or_else(|_| "10,100,1000".to_owned())
        .split(',')
        .map(|s| s.trim().parse())
        .collect::<Result<_, _>>()?;
    let largest = sizes.iter().copied().max().unwrap_or(0);
    let pg = PgCluster::builder()
        .setting("shared_preload_libraries", "pg_stat_statements")
        .setting("max_connections", (largest + 100).to_string())
        .start()?;
    let url = pg.url();
    let admin = chosen_tests::connect_admin(&url).await?;
    admin
        .batch_execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        .await?;
    println!("## Scale (`cargo bench -p chosen-tests --bench scale`)\n");
    println!(
        "One process, one throwaway server; statements counted by `pg_stat_statements` over {} s once settled, connections are the server's client backends. Defaults: heartbeat 1 s, poll 300 ms, observer poll 1 s.\n",
        WINDOW.as_secs()
    );
    println!("| fleet | connections | statements/s | per member |\n|---|---|---|---|");
    for &n in &sizes {
        let (rate, conns) = lease_contenders(&pg, &admin, n).await?;
        println!(
            "| {n} contenders in the lease-row mode (a `LockManager::connect_pooled` each, through PgBouncer in transaction mode, 10 server connections) | {conns} | {rate:.0} | {:.2} |",
            rate / n as f64
        );
        let (rate, conns) = contenders(&url, &admin, n).await?;
        println!(
            "| {n} contenders (a `LockManager` each, one election) | {conns} | {rate:.0} | {:.2} |",
            rate / n as f64
        );
        let (rate, conns) = observers(&url, &admin, n).await?;
        println!(
            "| {n} observers (an `Observer` each, on a shared pool of 4) | {conns} | {rate:.0} | {:.2} |",
            rate / n as f64
        );
    }
    Ok(())
}
