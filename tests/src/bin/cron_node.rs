//! One real node running an every-second apalis cron job with the tick ledger, for the
//! witness test: the job writes a witness row `(job, tick, token, node)` in its ledger
//! transaction, and every run is reported as a JSON line on stdout.
//!
//! ```text
//! DATABASE_URL=postgres://... cargo run -p chosen-tests --bin cron_node -- \
//!     --node-id ID --job NAME [--misfire skip|catchup] [--think-ms N] [--detached-writes]
//! ```
//!
//! `--think-ms` makes each run wait that long before it opens its transaction (a node
//! frozen there wakes up to find a newer leader's fence). `--detached-writes` runs the
//! write in a task of its own, which the gate's cancellation (on a lost lease) does not
//! stop: a job that leaves work behind, which only the fence keeps from committing
//! after a newer leader's write.
//!
//! Events: `ready`; `ran` (`tick`, `token`, `catch_up`); `rejected` (`tick`, `token`:
//! the fence refused the run's transaction: a newer leader has written); `exit`.
//! SIGTERM or SIGINT stops the worker and releases the lock, then exits 0; bad flags
//! print one line on stderr and exit 2.

use std::process::ExitCode;
use std::str::FromStr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use apalis_core::error::BoxDynError;
use apalis_core::monitor::Monitor;
use apalis_core::task::data::Data;
use chosen_apalis::{
    Claim, LeaderOnlyJobLayer, Misfire, Schedule, Tick, TickContext, TickLedger, cron_worker,
};
use chosen_core::{LockManager, ManagerOptions};
use deadpool_postgres::Pool;

struct Args {
    node_id: String,
    job: String,
    misfire: Misfire,
    think: Duration,
    detached: bool,
}

fn parse_args() -> Result<Args, String> {
    let (mut node_id, mut job, mut misfire) = (String::new(), String::new(), Misfire::Skip);
    let mut think = Duration::ZERO;
    let mut detached = false;
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--node-id" => node_id = value()?,
            "--job" => job = value()?,
            "--misfire" => {
                misfire = match value()?.as_str() {
                    "skip" => Misfire::Skip,
                    "catchup" => Misfire::CatchUp {
                        max: 100,
                        within: Duration::from_secs(60),
                    },
                    other => return Err(format!("--misfire takes skip or catchup, got {other:?}")),
                }
            }
            "--detached-writes" => detached = true,
            "--think-ms" => {
                let v = value()?;
                think = Duration::from_millis(
                    v.parse()
                        .map_err(|_| format!("--think-ms takes milliseconds, got {v:?}"))?,
                );
            }
            other => {
                return Err(format!(
                    "unknown flag {other:?}; usage: cron_node --node-id ID --job NAME [--misfire skip|catchup] [--think-ms N] [--detached-writes] (DATABASE_URL must be set)"
                ));
            }
        }
    }
    if node_id.is_empty() || job.is_empty() {
        return Err("--node-id and --job are required".to_owned());
    }
    Ok(Args {
        node_id,
        job,
        misfire,
        think,
        detached,
    })
}

/// Prints one event line: `ts_us`, `node`, `event`, then the given numeric fields.
fn emit(node: &str, event: &str, fields: &[(&str, u64)]) {
    let ts = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros());
    let mut line = format!("{{\"ts_us\":{ts},\"node\":\"{node}\",\"event\":\"{event}\"");
    for (k, v) in fields {
        line.push_str(&format!(",\"{k}\":{v}"));
    }
    line.push('}');
    println!("{line}");
}

async fn witness(
    tick: Tick,
    ctx: Data<TickContext>,
    pool: Data<Pool>,
    style: Data<Style>,
) -> Result<(), BoxDynError> {
    let (ctx, pool, style) = ((*ctx).clone(), (*pool).clone(), *style);
    if style.detached {
        // Outlives the gate's cancellation: only the fence stops a stale write.
        tokio::spawn(write(tick, ctx, pool, style.think)).await?
    } else {
        write(tick, ctx, pool, style.think).await
    }
}

async fn write(
    tick: Tick,
    ctx: TickContext,
    pool: Pool,
    think: Duration,
) -> Result<(), BoxDynError> {
    // Work before the transaction: a node frozen here wakes up to a fence that a newer
    // leader may have moved.
    tokio::time::sleep(think).await;
    let mut client = pool.get().await?;
    let token = ctx.fencing_token().get();
    let tx = match ctx.begin(&mut client).await {
        Ok(Some(tx)) => tx,
        Ok(None) => return Ok(()),
        Err(e) => {
            if e.is_stale() {
                emit(
                    ctx.node_id(),
                    "rejected",
                    &[("tick", tick.get_timestamp()), ("token", token)],
                );
            }
            return Err(e.into());
        }
    };
    tx.execute(
        "INSERT INTO witness (job, tick, token, node, seq) VALUES ($1, $2, $3, $4, nextval('witness_seq'))",
        &[
            &ctx.job(),
            &i64::try_from(tick.get_timestamp())?,
            &i64::try_from(token)?,
            &ctx.node_id(),
        ],
    )
    .await?;
    tx.commit().await?;
    emit(
        ctx.node_id(),
        "ran",
        &[
            ("tick", tick.get_timestamp()),
            ("token", token),
            ("catch_up", u64::from(ctx.is_catch_up())),
        ],
    );
    Ok(())
}

/// How a run writes: after `think`, and in a task of its own if `detached`.
#[derive(Clone, Copy)]
struct Style {
    think: Duration,
    detached: bool,
}

async fn run(args: Args, url: &str) -> Result<(), BoxDynError> {
    let pool = Pool::builder(deadpool_postgres::Manager::new(
        tokio_postgres::Config::from_str(url)?,
        tokio_postgres::NoTls,
    ))
    .max_size(4)
    .build()?;
    let ledger = TickLedger::new(pool.clone());
    ledger.install().await?;
    pool.get()
        .await?
        .batch_execute(
            "CREATE SEQUENCE IF NOT EXISTS witness_seq;\nCREATE TABLE IF NOT EXISTS witness (job text, tick bigint, token bigint, node text, seq bigint)",
        )
        .await?;
    let manager =
        LockManager::connect(ManagerOptions::from_url(url)?.node_id(&args.node_id)).await?;
    let gate = LeaderOnlyJobLayer::elect(&manager, args.job.as_str())?
        .ledger(ledger)
        .claim(Claim::InJobTransaction)
        .misfire(args.misfire);
    let schedule = Schedule::from_str("* * * * * *")?;
    emit(&args.node_id, "ready", &[]);
    let job = args.job.clone();
    let style = Style {
        think: args.think,
        detached: args.detached,
    };
    Monitor::new()
        .register(move |_| {
            cron_worker(&job, schedule.clone(), gate.clone())
                .data(pool.clone())
                .data(style)
                .build(witness)
        })
        .run_with_signal(async {
            use tokio::signal::unix::{SignalKind, signal};
            let (mut term, mut int) = (
                signal(SignalKind::terminate())?,
                signal(SignalKind::interrupt())?,
            );
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
            Ok(())
        })
        .await?;
    manager.shutdown().await;
    emit(&args.node_id, "exit", &[]);
    Ok(())
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(args) => args,
        Err(e) => {
            eprintln!("cron_node: {e}");
            return ExitCode::from(2);
        }
    };
    let Ok(url) = std::env::var("DATABASE_URL") else {
        eprintln!("cron_node: set DATABASE_URL");
        return ExitCode::from(2);
    };
    match run(args, &url).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("cron_node: {e}");
            ExitCode::FAILURE
        }
    }
}
