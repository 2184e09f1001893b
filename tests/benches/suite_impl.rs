//! The benchmark scenarios (shared by `benches/suite.rs` and the CI smoke test).

// The smoke test uses only the small profile.
#![allow(dead_code)]

use std::io;
use std::sync::Arc;
use std::time::{Duration, Instant};

use chosen_core::LockManager;
use chosen_tests::{FaultProxy, PgCluster, ProxyMode, connect_admin, signal, try_manager_options};

/// Sizes of one run.
#[derive(Debug, Clone)]
pub(crate) struct Profile {
    pub(crate) latency_rounds: usize,
    pub(crate) latency_runs: usize,
    pub(crate) many: usize,
    pub(crate) many_large: Option<usize>,
    pub(crate) waiting_names: usize,
    pub(crate) waiting_window: Duration,
    pub(crate) handover_rounds: usize,
    pub(crate) crash_rounds: usize,
    pub(crate) partition_rounds: usize,
    pub(crate) fenced_rounds: usize,
    /// Scenario 10: how long each client runs, and how many runs.
    pub(crate) throughput_window: Duration,
    pub(crate) throughput_runs: usize,
}

impl Profile {
    pub(crate) fn full() -> Self {
        Self {
            latency_rounds: 2000,
            latency_runs: 3,
            many: 5000,
            many_large: Some(100_000),
            waiting_names: 5000,
            waiting_window: Duration::from_secs(10),
            handover_rounds: 200,
            crash_rounds: 20,
            partition_rounds: 3,
            fenced_rounds: 2000,
            throughput_window: Duration::from_secs(10),
            throughput_runs: 3,
        }
    }

    pub(crate) fn smoke() -> Self {
        Self {
            latency_rounds: 50,
            latency_runs: 1,
            many: 200,
            many_large: None,
            waiting_names: 100,
            waiting_window: Duration::from_secs(2),
            handover_rounds: 5,
            crash_rounds: 2,
            partition_rounds: 1,
            fenced_rounds: 50,
            throughput_window: Duration::from_millis(500),
            throughput_runs: 1,
        }
    }
}

fn pct(sorted: &[Duration], p: usize) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[(sorted.len() * p / 100).min(sorted.len() - 1)]
}

fn us(d: Duration) -> String {
    format!("{:.0} µs", d.as_secs_f64() * 1e6)
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1e3)
}

/// Resident set size of this process, in KiB.
fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

/// Calls of statements that try advisory locks, as the server counted them.
async fn tries(admin: &tokio_postgres::Client) -> i64 {
    admin
        .query_one(
            "SELECT coalesce(sum(calls), 0)::int8 FROM pg_stat_statements WHERE query LIKE '%pg_try_advisory_lock%' AND query NOT LIKE '%pg_stat_statements%'",
            &[],
        )
        .await
        .map_or(0, |r| r.get(0))
}

async fn backends(admin: &tokio_postgres::Client, like: &str) -> i64 {
    admin
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE $1",
            &[&like],
        )
        .await
        .map_or(0, |r| r.get(0))
}

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// Runs every scenario and returns the results as Markdown.
pub(crate) async fn run(profile: &Profile, holder_bin: &str) -> Res<String> {
    let mut out = String::new();
    // pg_stat_statements counts the statements that reach the server (scenario 3).
    let cluster = PgCluster::builder()
        .setting("shared_preload_libraries", "pg_stat_statements")
        .start()?;
    let url = cluster.url();
    let admin = connect_admin(&url).await?;
    admin
        .batch_execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        .await?;

    // 1. Uncontended acquire + release against the floor and sqlx, interleaved. The
    // order of the three is drawn afresh every round and warm-up rounds are discarded, so no
    // client always runs first (or right after another's release) and none pays for a
    // cold cache; every client times the same work: take the lock, release it.
    out.push_str("### 1. Uncontended acquire + release (interleaved, a random order per round, warm-up discarded)\n\n");
    out.push_str("| run | floor p50 | floor p99 | chosen p50 | chosen p99 | sqlx p50 | sqlx p99 | chosen / floor (p50) | chosen / sqlx (p50) | sqlx / floor (p50) |\n|---|---|---|---|---|---|---|---|---|---|\n");
    let raw = connect_admin(&url).await?;
    let lock = raw.prepare("SELECT pg_try_advisory_lock(1, 2)").await?;
    let unlock = raw.prepare("SELECT pg_advisory_unlock(1, 2)").await?;
    let manager =
        LockManager::connect(try_manager_options(&url, "bench-latency")?.max_locks(1_000_000))
            .await?;
    let mut sqlx_conn = Some(<sqlx::PgConnection as sqlx::Connection>::connect(&url).await?);
    let sqlx_lock = sqlx::postgres::PgAdvisoryLock::new("bench-sqlx");
    let warm_up = (profile.latency_rounds / 10).max(5);
    let mut ratios = Vec::new();
    let mut ratios_sqlx = Vec::new();
    for run in 1..=profile.latency_runs {
        let mut times: [Vec<Duration>; 3] = [Vec::new(), Vec::new(), Vec::new()];
        // A fresh random order every round (a fixed generator), so that no client
        // always runs right after another and pays for its after-effects (a release's
        // NOTIFY, delivered to every listening session).
        let mut order = [0usize, 1, 2];
        let mut seed: u64 = 0x9e37_79b9_7f4a_7c15 ^ run as u64;
        for round in 0..warm_up + profile.latency_rounds {
            for i in (1..3).rev() {
                seed = seed
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                order.swap(i, (seed >> 33) as usize % (i + 1));
            }
            for &client in &order {
                let t = Instant::now();
                match client {
                    0 => {
                        raw.query_one(&lock, &[]).await?;
                        raw.query_one(&unlock, &[]).await?;
                    }
                    1 => {
                        let lease = manager.acquire("bench-latency").await?;
                        lease.release().await?;
                    }
                    _ => {
                        let guard = sqlx_lock.acquire(sqlx_conn.take().expect("conn")).await?;
                        sqlx_conn = Some(guard.release_now().await?);
                    }
                }
                if round >= warm_up {
                    times[client].push(t.elapsed());
                }
            }
        }
        let [mut floor, mut ours, mut peer] = times;
        floor.sort();
        ours.sort();
        peer.sort();
        let r = pct(&ours, 50).as_secs_f64() / pct(&floor, 50).as_secs_f64();
        let rp = pct(&ours, 50).as_secs_f64() / pct(&peer, 50).as_secs_f64();
        let rs = pct(&peer, 50).as_secs_f64() / pct(&floor, 50).as_secs_f64();
        ratios.push(r);
        ratios_sqlx.push(rp);
        out.push_str(&format!(
            "| {run} | {} | {} | {} | {} | {} | {} | {r:.2} | {rp:.2} | {rs:.2} |\n",
            us(pct(&floor, 50)),
            us(pct(&floor, 99)),
            us(pct(&ours, 50)),
            us(pct(&ours, 99)),
            us(pct(&peer, 50)),
            us(pct(&peer, 99)),
        ));
    }
    ratios.sort_by(f64::total_cmp);
    ratios_sqlx.sort_by(f64::total_cmp);
    out.push_str(&format!(
        "\nMedian over {} runs: chosen / tokio-postgres pair **{:.2}** (target ≤ 1.1), chosen / sqlx **{:.2}**. The floor is the bare `pg_try_advisory_lock` + `pg_advisory_unlock` pair on one tokio-postgres connection; sqlx drives its socket inline, tokio-postgres hops to a connection task.\n\n",
        ratios.len(),
        ratios[ratios.len() / 2],
        ratios_sqlx[ratios_sqlx.len() / 2]
    ));
    manager.shutdown().await;

    // 2. Many locks on one manager, against one connection per lock (sqlx).
    out.push_str("### 2. Many locks\n\n| what | locks | acquire all | release all | client RSS growth | backends |\n|---|---|---|---|---|---|\n");
    out.push_str(&many_locks(&url, &admin, profile.many, "default settings").await?);
    let max_conn: i64 = admin
        .query_one("SELECT current_setting('max_connections')::int8", &[])
        .await?
        .get(0);
    let per_conn = usize::try_from(max_conn - 20)
        .unwrap_or(10)
        .min(profile.many);
    out.push_str(&sqlx_many(&url, &admin, per_conn).await?);
    if let Some(large) = profile.many_large {
        let big = PgCluster::builder()
            .setting("max_locks_per_transaction", "1024")
            .start()?;
        let big_admin = connect_admin(&big.url()).await?;
        out.push_str(
            &many_locks(
                &big.url(),
                &big_admin,
                large,
                "max_locks_per_transaction=1024",
            )
            .await?,
        );
    }
    out.push('\n');

    // 3. Waiting cost.
    out.push_str(&waiting_cost(&url, &admin, profile).await?);

    // 4. Graceful hand-over.
    let a =
        LockManager::connect(try_manager_options(&url, "bench-handover-a")?.max_locks(1_000_000))
            .await?;
    let b = LockManager::connect(
        try_manager_options(&url, "bench-handover-b")?
            .max_locks(1_000_000)
            .poll_interval(Duration::from_secs(60)),
    )
    .await?;
    let mut handovers = Vec::new();
    for _ in 0..profile.handover_rounds {
        let lease = a.acquire("bench-handover").await?;
        let waiter = tokio::spawn({
            let b = b.clone();
            async move {
                let lease = b.acquire("bench-handover").await;
                (Instant::now(), lease)
            }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        let t = Instant::now();
        lease.release().await?;
        let (got, lease_b) = waiter.await?;
        handovers.push(got - t);
        lease_b?.release().await?;
    }
    handovers.sort();
    out.push_str(&format!(
        "### 4. Graceful hand-over (release -> waiter's lease granted; waiter poll interval 60 s, so this is NOTIFY)\n\n{} rounds: p50 **{}**, p99 {}, max {}.\n\n",
        handovers.len(),
        ms(pct(&handovers, 50)),
        ms(pct(&handovers, 99)),
        ms(handovers.last().copied().unwrap_or_default())
    ));
    a.shutdown().await;
    b.shutdown().await;

    // 5. Crash failover: holder process SIGKILLed.
    let waiter =
        LockManager::connect(try_manager_options(&url, "bench-crash-waiter")?.max_locks(1_000_000))
            .await?;
    let poll = waiter.options().get_poll_interval();
    let mut crashes = Vec::new();
    for round in 0..profile.crash_rounds {
        let name = format!("bench-crash-{round}");
        let mut holder = std::process::Command::new(holder_bin)
            .args([url.as_str(), name.as_str(), "bench-crash-holder"])
            .stdout(std::process::Stdio::piped())
            .spawn()?;
        let mut lines =
            io::BufRead::lines(io::BufReader::new(holder.stdout.take().expect("piped")));
        loop {
            match lines.next() {
                Some(Ok(l)) if l.starts_with("acquired") => break,
                Some(_) => {}
                None => return Err("holder exited".into()),
            }
        }
        let w = tokio::spawn({
            let waiter = waiter.clone();
            let name = name.clone();
            async move {
                let lease = waiter.acquire(name.as_str()).await;
                (Instant::now(), lease)
            }
        });
        tokio::time::sleep(Duration::from_millis(50 + (round as u64 * 37) % 300)).await;
        let t = Instant::now();
        signal(holder.id(), "KILL")?;
        let _ = holder.wait();
        let (got, lease) = w.await?;
        crashes.push(got - t);
        drop(lease?);
    }
    crashes.sort();
    out.push_str(&format!(
        "### 5. Crash failover (holder process SIGKILLed -> waiter holds)\n\n{} rounds: p50 **{}**, p99 {}, max {} (poll interval {}: a crash is seen by the next poll).\n\n",
        crashes.len(),
        ms(pct(&crashes, 50)),
        ms(pct(&crashes, 99)),
        ms(crashes.last().copied().unwrap_or_default()),
        ms(poll)
    ));
    waiter.shutdown().await;

    // 6. Partition failover.
    if profile.partition_rounds > 0 {
        let port = cluster.port().expect("local");
        let mut rows = String::new();
        let (mut fences, mut takeovers) = (Vec::new(), Vec::new());
        for round in 0..profile.partition_rounds {
            let proxy = FaultProxy::start(([127, 0, 0, 1], port).into()).await?;
            let holder = LockManager::connect(
                try_manager_options(&proxy.url(&url, port), "bench-part-holder")?
                    .max_locks(1_000_000),
            )
            .await?;
            let waiter = LockManager::connect(
                try_manager_options(&url, "bench-part-waiter")?.max_locks(1_000_000),
            )
            .await?;
            let name = format!("bench-partition-{round}");
            let lease = holder.acquire(name.as_str()).await?;
            let w = tokio::spawn({
                let waiter = waiter.clone();
                let name = name.clone();
                async move { (waiter.acquire(name.as_str()).await, Instant::now()) }
            });
            tokio::time::sleep(Duration::from_millis(300)).await;
            let t = Instant::now();
            proxy.set(ProxyMode::BlackHole);
            lease.lost().await;
            let fenced = t.elapsed();
            let (l, got) = w.await?;
            let took = got - t;
            fences.push(fenced);
            takeovers.push(took);
            rows.push_str(&format!(
                "| {round} | {} | {} | {} |\n",
                ms(fenced),
                ms(took),
                ms(took - fenced)
            ));
            drop(l?);
            proxy.set(ProxyMode::Pass);
            waiter.shutdown().await;
            drop(holder);
        }
        out.push_str(&format!(
            "### 6. Partition failover (holder's connection black-holed)\n\nBound: the holder fences itself within `lease_timeout` (3 s) of its last good heartbeat; the server releases after `server_release_after` (7 s) of silence.\n\n| round | holder fenced itself | waiter holds | gap (no holder) |\n|---|---|---|---|\n{rows}\n"
        ));
    }

    // 7 is the criterion benchmark of chosen-tower; 8: loss signal.
    out.push_str(&loss_signal(&url, &admin).await?);

    // 9. Fenced writes.
    out.push_str(&fenced_writes(&url, &admin, profile.fenced_rounds).await?);

    // 10. Throughput of many tasks on one manager.
    out.push_str(&throughput(&url, profile).await?);
    Ok(out)
}

/// Scenario 10 alone, on a cluster of its own (`--throughput`), with `fsync` and
/// `synchronous_commit` on when `durable` (`--durable`).
pub(crate) async fn run_throughput(profile: &Profile, durable: bool) -> Res<String> {
    let mut builder = PgCluster::builder();
    if durable {
        builder = builder
            .setting("fsync", "on")
            .setting("synchronous_commit", "on");
    }
    let cluster = builder.start()?;
    let out = throughput(&cluster.url(), profile).await?;
    Ok(format!(
        "{out}(`fsync` and `synchronous_commit` {})\n",
        if durable { "on" } else { "off" }
    ))
}

/// Tasks that each take and release a lock of their own, in a loop (scenario 10).
const THROUGHPUT_TASKS: usize = 64;
/// Connections of the peers' pools in scenario 10.
const THROUGHPUT_POOL: usize = 16;

/// One client of scenario 10: what each task does per operation.
#[derive(Clone)]
enum Contender {
    /// One manager (one connection) for every task.
    Chosen(LockManager),
    /// sqlx's `PgAdvisoryLock` on a connection taken from a pool, per operation.
    Sqlx(sqlx::PgPool),
    /// The bare pair on tokio-postgres connections shared round-robin (a client
    /// pipelines the statements of several tasks).
    Bare(
        Arc<
            Vec<(
                tokio_postgres::Client,
                tokio_postgres::Statement,
                tokio_postgres::Statement,
            )>,
        >,
    ),
}

impl Contender {
    fn label(&self) -> &'static str {
        match self {
            Self::Chosen(_) => "chosen, one manager (1 connection)",
            Self::Sqlx(_) => "sqlx `PgAdvisoryLock`, a pool of 16 connections",
            Self::Bare(_) => "bare tokio-postgres pair, 16 connections",
        }
    }

    /// Acquire + release of task `task`'s own lock.
    async fn once(&self, task: usize, name: &str) -> Res<()> {
        match self {
            Self::Chosen(manager) => {
                let lease = manager.acquire(name).await?;
                lease.release().await?;
            }
            Self::Sqlx(pool) => {
                let conn = pool.acquire().await?;
                let lock = sqlx::postgres::PgAdvisoryLock::new(name);
                let guard = lock.acquire(conn).await?;
                drop(guard.release_now().await?);
            }
            Self::Bare(clients) => {
                let (client, lock, unlock) = &clients[task % clients.len()];
                let key = i64::try_from(task)?;
                let won: bool = client.query_one(lock, &[&key]).await?.get(0);
                if !won {
                    return Err(format!("bare pair: key {key} was busy").into());
                }
                client.query_one(unlock, &[&key]).await?;
            }
        }
        Ok(())
    }

    /// Runs the tasks for a warm-up and then `window`; the latencies of the operations
    /// that started in the window.
    async fn run(&self, window: Duration) -> Res<Vec<Duration>> {
        let warm_up = window / 5;
        let start = Instant::now();
        let (from, until) = (start + warm_up, start + warm_up + window);
        let mut tasks = Vec::new();
        for task in 0..THROUGHPUT_TASKS {
            let this = self.clone();
            tasks.push(tokio::spawn(async move {
                let name = format!("bench-throughput-{task}");
                let mut times = Vec::new();
                loop {
                    let t = Instant::now();
                    if t >= until {
                        break;
                    }
                    this.once(task, &name).await?;
                    if t >= from {
                        times.push(t.elapsed());
                    }
                }
                Ok::<_, Box<dyn std::error::Error + Send + Sync>>(times)
            }));
        }
        let mut all = Vec::new();
        for task in tasks {
            all.extend(task.await??);
        }
        all.sort();
        Ok(all)
    }
}

/// 64 tasks, each acquiring and releasing a lock of its own in a loop: chosen on one
/// connection against sqlx on a pool of 16 and the bare pair on 16 connections. The
/// three run one after the other (they would share the two cores otherwise), in a
/// rotated order per run.
async fn throughput(url: &str, profile: &Profile) -> Res<String> {
    let manager =
        LockManager::connect(try_manager_options(url, "bench-throughput")?.max_locks(1_000_000))
            .await?;
    // A freshly started server grants nothing for `term_grant_delay`: wait it out
    // untimed.
    manager
        .acquire("bench-throughput-first")
        .await?
        .release()
        .await?;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(u32::try_from(THROUGHPUT_POOL)?)
        .min_connections(u32::try_from(THROUGHPUT_POOL)?)
        .connect(url)
        .await?;
    let mut clients = Vec::new();
    for _ in 0..THROUGHPUT_POOL {
        let client = connect_admin(url).await?;
        let lock = client
            .prepare("SELECT pg_try_advisory_lock($1::int8)")
            .await?;
        let unlock = client
            .prepare("SELECT pg_advisory_unlock($1::int8)")
            .await?;
        clients.push((client, lock, unlock));
    }
    let contenders = [
        Contender::Chosen(manager.clone()),
        Contender::Sqlx(pool.clone()),
        Contender::Bare(Arc::new(clients)),
    ];
    let window = profile.throughput_window;
    let mut rows = String::new();
    let mut ratios = Vec::new();
    for run in 0..profile.throughput_runs {
        let mut ops = [0.0_f64; 3];
        for i in 0..contenders.len() {
            let which = (run + i) % contenders.len();
            let contender = &contenders[which];
            let times = contender.run(window).await?;
            let per_sec = times.len() as f64 / window.as_secs_f64();
            ops[which] = per_sec;
            rows.push_str(&format!(
                "| {} | {} | {per_sec:.0} | {} | {} |\n",
                run + 1,
                contender.label(),
                us(pct(&times, 50)),
                us(pct(&times, 99)),
            ));
        }
        ratios.push(ops[0] / ops[1]);
    }
    ratios.sort_by(f64::total_cmp);
    manager.shutdown().await;
    pool.close().await;
    Ok(format!(
        "### 10. Throughput: {THROUGHPUT_TASKS} tasks, each taking and releasing a lock of its own in a loop ({} s per client and run, after {} s of warm-up)\n\n| run | client | operations/s | p50 | p99 |\n|---|---|---|---|---|\n{rows}\nchosen on one connection / sqlx on {THROUGHPUT_POOL} (operations/s, median of {}): **{:.2}** (target ≥ 1).\n\n",
        window.as_secs_f64(),
        (window / 5).as_secs_f64(),
        ratios.len(),
        ratios[ratios.len() / 2],
    ))
}

/// Scenario 9 alone, on a cluster of its own (`--fenced`).
pub(crate) async fn run_fenced(profile: &Profile) -> Res<String> {
    let cluster = PgCluster::builder()
        .setting("shared_preload_libraries", "pg_stat_statements")
        .start()?;
    let url = cluster.url();
    let admin = connect_admin(&url).await?;
    admin
        .batch_execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        .await?;
    fenced_writes(&url, &admin, profile.fenced_rounds).await
}

/// What a fence adds to a transaction: the same small transaction (one `UPDATE` of one
/// row, committed) with and without `fenced::fence` first, interleaved in a random
/// order per round on one connection, warm-up discarded.
async fn fenced_writes(url: &str, admin: &tokio_postgres::Client, rounds: usize) -> Res<String> {
    use chosen_core::{FencingToken, fenced};
    use tokio_postgres::types::Type;

    let mut client = connect_admin(url).await?;
    fenced::install(&client).await?;
    client
        .batch_execute(
            "CREATE TABLE IF NOT EXISTS bench_fenced_work (id int PRIMARY KEY, n bigint NOT NULL);
             INSERT INTO bench_fenced_work VALUES (1, 0) ON CONFLICT DO NOTHING",
        )
        .await?;
    let update = client
        .prepare("UPDATE bench_fenced_work SET n = n + 1 WHERE id = 1")
        .await?;
    let token = FencingToken::new(1);
    let warm_up = (rounds / 10).max(5);
    // 0: plain; 1: a trivial statement first (the round trip alone); 2: the fence first.
    let mut times: [Vec<Duration>; 3] = [Vec::new(), Vec::new(), Vec::new()];
    let mut order = [0usize, 1, 2];
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    admin
        .execute("SELECT pg_stat_statements_reset()", &[])
        .await?;
    for round in 0..warm_up + rounds {
        for i in (1..3).rev() {
            seed = seed
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            order.swap(i, (seed >> 33) as usize % (i + 1));
        }
        for &which in &order {
            let t = Instant::now();
            let tx = client.transaction().await?;
            match which {
                1 => {
                    tx.query_typed("SELECT $1::text", &[(&"bench-fenced", Type::TEXT)])
                        .await?;
                }
                2 => fenced::fence(&tx, "bench-fenced", token).await?,
                _ => {}
            }
            tx.execute(&update, &[]).await?;
            tx.commit().await?;
            if round >= warm_up {
                times[which].push(t.elapsed());
            }
        }
    }
    let server_us: f64 = admin
        .query_one(
            "SELECT coalesce(avg(mean_exec_time), 0) * 1000 FROM pg_stat_statements WHERE query LIKE 'INSERT INTO \"chosen_fence\"%'",
            &[],
        )
        .await
        .map_or(0.0, |r| r.get(0));
    let [mut plain, mut trivial, mut fenced_times] = times;
    plain.sort();
    trivial.sort();
    fenced_times.sort();
    let p50 = pct(&fenced_times, 50).saturating_sub(pct(&plain, 50));
    Ok(format!(
        "### 9. Fenced writes (one small transaction with and without `fenced::fence` first; interleaved, random order per round, warm-up discarded)\n\n| transaction | p50 | p99 |\n|---|---|---|\n| `BEGIN`, one-row `UPDATE`, `COMMIT` | {} | {} |\n| the same with a trivial statement first (`SELECT $1::text`: the round trip alone) | {} | {} |\n| the same with `fenced::fence` first | {} | {} |\n\n{} rounds: the fence adds **{}** per transaction at p50 ({:.2}×); its statement took {server_us:.0} µs of server time on average (`pg_stat_statements`). It commits with the transaction: no commit of its own.\n\n",
        us(pct(&plain, 50)),
        us(pct(&plain, 99)),
        us(pct(&trivial, 50)),
        us(pct(&trivial, 99)),
        us(pct(&fenced_times, 50)),
        us(pct(&fenced_times, 99)),
        plain.len(),
        us(p50),
        pct(&fenced_times, 50).as_secs_f64() / pct(&plain, 50).as_secs_f64().max(1e-9),
    ))
}

async fn many_locks(
    url: &str,
    admin: &tokio_postgres::Client,
    n: usize,
    label: &str,
) -> Res<String> {
    let node = format!("bench-many-{n}");
    let m = LockManager::connect(try_manager_options(url, &node)?.max_locks(1_000_000)).await?;
    // Untimed: on a server that just started, nothing is granted before its term is
    // `term_grant_delay` old; time the acquisitions, not that wait.
    m.acquire("bench-many-warm-up").await?.release().await?;
    let rss0 = rss_kib();
    let t = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    for i in 0..n {
        let m = m.clone();
        set.spawn(async move { m.acquire(format!("bench-many-{i}")).await });
    }
    let mut leases = Vec::with_capacity(n);
    while let Some(r) = set.join_next().await {
        leases.push(r??);
    }
    let acquired = t.elapsed();
    let rss = rss_kib().saturating_sub(rss0);
    let used = backends(admin, &node).await;
    let t = Instant::now();
    drop(leases);
    loop {
        let held: i64 = admin
            .query_one(
                "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) WHERE l.locktype = 'advisory' AND a.application_name = $1",
                &[&node],
            )
            .await?
            .get(0);
        if held == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let released = t.elapsed();
    m.shutdown().await;
    Ok(format!(
        "| chosen, one manager ({label}) | {n} | {} | {} | {} KiB ({:.0} B per lock) | **{used}** |\n",
        ms(acquired),
        ms(released),
        rss,
        rss as f64 * 1024.0 / n as f64
    ))
}

async fn sqlx_many(url: &str, admin: &tokio_postgres::Client, n: usize) -> Res<String> {
    let before = backends(admin, "%").await;
    let rss0 = rss_kib();
    // The logins are not timed: chosen's one login is not either.
    let mut conns = Vec::with_capacity(n);
    for _ in 0..n {
        conns.push(<sqlx::PgConnection as sqlx::Connection>::connect(url).await?);
    }
    let t = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    for (i, conn) in conns.into_iter().enumerate() {
        // The guard borrows its lock; spawned tasks need it 'static (a few hundred
        // leaked locks in a benchmark process).
        let lock: &'static sqlx::postgres::PgAdvisoryLock = Box::leak(Box::new(
            sqlx::postgres::PgAdvisoryLock::new(format!("bench-sqlx-many-{i}")),
        ));
        set.spawn(async move { lock.acquire(conn).await });
    }
    let mut guards = Vec::with_capacity(n);
    while let Some(r) = set.join_next().await {
        guards.push(r??);
    }
    let acquired = t.elapsed();
    let rss = rss_kib().saturating_sub(rss0);
    let used = backends(admin, "%").await - before;
    let t = Instant::now();
    for g in guards {
        let _ = g.release_now().await?;
    }
    let released = t.elapsed();
    Ok(format!(
        "| sqlx `PgAdvisoryLock` (one connection per lock; the server's max_connections binds) | {n} | {} | {} | {} KiB | **{used}** |\n",
        ms(acquired),
        ms(released),
        rss
    ))
}

async fn waiting_cost(url: &str, admin: &tokio_postgres::Client, profile: &Profile) -> Res<String> {
    let n = profile.waiting_names;
    let window = profile.waiting_window;
    let holder =
        LockManager::connect(try_manager_options(url, "bench-wait-holder")?.max_locks(1_000_000))
            .await?;
    let mut leases = Vec::with_capacity(n);
    for chunk in (0..n).collect::<Vec<_>>().chunks(1000) {
        let mut set = tokio::task::JoinSet::new();
        for i in chunk {
            let h = holder.clone();
            let i = *i;
            set.spawn(async move { h.acquire(format!("bench-wait-{i}")).await });
        }
        while let Some(r) = set.join_next().await {
            leases.push(r??);
        }
    }
    // Baseline CPU: the holder's heartbeats only.
    let c0 = chosen_tests::process_cpu_time();
    tokio::time::sleep(window).await;
    let base_cpu = chosen_tests::process_cpu_time() - c0;

    // chosen: one manager waits for all N names.
    let waiter =
        LockManager::connect(try_manager_options(url, "bench-wait-waiter")?.max_locks(1_000_000))
            .await?;
    let poll = waiter.options().get_poll_interval();
    let mut waits = tokio::task::JoinSet::new();
    for i in 0..n {
        let w = waiter.clone();
        waits.spawn(async move { w.acquire(format!("bench-wait-{i}")).await.map(drop) });
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let x0 = tries(admin).await;
    let c0 = chosen_tests::process_cpu_time();
    tokio::time::sleep(window).await;
    let chosen_q = (tries(admin).await - x0) as f64 / window.as_secs_f64();
    let chosen_cpu = (chosen_tests::process_cpu_time() - c0).saturating_sub(base_cpu);
    waits.abort_all();
    waiter.shutdown().await;

    // Naive: one poll loop per name, `pg_try_advisory_lock` every poll interval, on one
    // shared connection (pipelined).
    let naive = Arc::new(connect_admin(url).await?);
    let stmt = naive
        .prepare("SELECT pg_try_advisory_lock($1::int4, $2::int4)")
        .await?;
    let stop = Arc::new(tokio::sync::Notify::new());
    let mut loops = tokio::task::JoinSet::new();
    for i in 0..n {
        let (c, stmt, stop) = (Arc::clone(&naive), stmt.clone(), Arc::clone(&stop));
        loops.spawn(async move {
            let key = chosen_core::LockKey::derive("chosen", &format!("bench-wait-{i}"));
            let chosen_core::LockKey::Pair(a, b) = key else {
                return;
            };
            loop {
                let _ = c.query_one(&stmt, &[&a, &b]).await;
                tokio::select! {
                    () = stop.notified() => return,
                    () = tokio::time::sleep(poll) => {}
                }
            }
        });
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let x0 = tries(admin).await;
    let c0 = chosen_tests::process_cpu_time();
    tokio::time::sleep(window).await;
    let naive_q = (tries(admin).await - x0) as f64 / window.as_secs_f64();
    let naive_cpu = (chosen_tests::process_cpu_time() - c0).saturating_sub(base_cpu);
    loops.abort_all();
    drop(leases);
    holder.shutdown().await;
    let cpu_pct = |d: Duration| 100.0 * d.as_secs_f64() / window.as_secs_f64();
    Ok(format!(
        "### 3. Waiting cost ({n} names held by one manager, waited for by another; poll interval {})\n\n| waiter | lock-trying statements/s reaching the server | client CPU (% of one core) |\n|---|---|---|\n| chosen (one batched statement per tick) | **{chosen_q:.1}** (ticks/s: {:.1}) | {:.1} % |\n| naive poll loop per name (one statement per name per tick; one pipelined connection, saturated) | {naive_q:.0} (would be {:.0} if it kept up) | {:.1} % |\n\nStatements counted by `pg_stat_statements` (calls of statements containing `pg_try_advisory_lock`); heartbeats (1/s per manager) come on top. CPU is this process's, less a baseline with nothing waiting.\n\n",
        ms(poll),
        1.0 / poll.as_secs_f64(),
        cpu_pct(chosen_cpu),
        n as f64 / poll.as_secs_f64(),
        cpu_pct(naive_cpu)
    ))
}

async fn loss_signal(url: &str, admin: &tokio_postgres::Client) -> Res<String> {
    // chosen: the holder's session is terminated; how soon does the holder know?
    let m =
        LockManager::connect(try_manager_options(url, "bench-loss")?.max_locks(1_000_000)).await?;
    let lease = m.acquire("bench-loss").await?;
    let t = Instant::now();
    admin
        .execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = 'bench-loss'",
            &[],
        )
        .await?;
    lease.lost().await;
    let chosen = t.elapsed();
    m.shutdown().await;
    // sqlx: `PgAdvisoryLockGuard` offers no validity check or loss future (its API is
    // `release_now` and `leak`), so there is nothing to time.
    Ok(format!(
        "### 8. Does the holder learn it lost the lock?\n\n| library | holder's session terminated by the server |\n|---|---|\n| chosen | `Lease::lost()` resolved after **{}**; `is_valid()` false from then on |\n| sqlx `PgAdvisoryLockGuard` | no signal: the guard has no validity check or loss future; the holder finds out only when its next query on that connection fails |\n| naive poll loop | no signal, as sqlx |\n\n",
        ms(chosen)
    ))
}
