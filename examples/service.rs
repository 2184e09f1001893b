//! One service process with every piece together, as a replica of a real service would
//! run them: one `LockManager`; one `Election` whose leadership gates both an axum
//! route (`chosen_tower::LeaderOnlyHttpLayer`) and an every-second apalis cron job
//! (`chosen_apalis::LeaderOnlyJobLayer`); a `Singleton` running a background loop;
//! Prometheus metrics; structured logs; and a graceful shutdown in the right order.
//!
//! ```text
//! DATABASE_URL=postgres://... cargo run --example service -- [--node-id ID] [--listen 127.0.0.1:0]
//! curl -i localhost:PORT/leader    # 200 on the leader, 503 (Retry-After) elsewhere
//! curl -s localhost:PORT/metrics   # chosen_* series, on every replica
//! curl -s localhost:PORT/healthz   # 200 while the process runs
//! ```
//!
//! Run three with the same `DATABASE_URL`: exactly one answers `/leader` with 200 and
//! runs the cron ticks; SIGTERM it and another takes over within about a round trip.
//! Without `DATABASE_URL` it starts a throwaway cluster (so it is the only node).
//!
//! Stdout carries one JSON object per line (`mono_us`, `ts_us`, `node`, `event`, then
//! fields; see `examples/README.md`); logs go to stderr (`RUST_LOG`, default `info`).
//! SIGTERM or SIGINT: stop accepting HTTP, stop the apalis worker, then
//! `manager.shutdown()` (the singleton's child stops, then every lock is released and
//! announced), then exit 0. Bad flags print one line on stderr and exit 2.

use std::fmt::Write as _;
use std::io::{IsTerminal as _, Write as _};
use std::net::SocketAddr;
use std::process::ExitCode;
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use apalis_core::error::BoxDynError;
use apalis_core::monitor::Monitor;
use apalis_core::task::data::Data;
use axum::Router;
use axum::routing::get;
use chosen_apalis::{LeaderGuard, LeaderOnlyJobLayer, Schedule, Tick, cron_worker};
use chosen_core::{
    Election, LockManager, ManagerOptions, PrometheusMetrics, Singleton, SingletonOptions,
};
use chosen_tower::LeaderOnlyHttpLayer;
use tokio::sync::watch;
use tracing::{info, warn};

/// The lock the HTTP route and the cron job share (one election, two gates).
const LEADER_LOCK: &str = "service-leader";
/// The singleton's lock.
const HOUSEKEEPING: &str = "service-housekeeping";
/// How long each shutdown step may take before the next one starts anyway. Idle
/// keep-alive connections close at once, but a client that sent half a request holds
/// axum's graceful shutdown until this bound (measured).
const STEP_BOUND: Duration = Duration::from_secs(5);

struct Args {
    node_id: String,
    listen: SocketAddr,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        node_id: format!("service-{}", std::process::id()),
        listen: SocketAddr::from(([127, 0, 0, 1], 0)),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--node-id" => {
                args.node_id = value()?;
                if args.node_id.is_empty() {
                    return Err("--node-id must not be empty".to_owned());
                }
            }
            "--listen" => {
                let v = value()?;
                args.listen = v.parse().map_err(|_| {
                    format!("--listen takes an address such as 127.0.0.1:8080, got {v:?}")
                })?;
            }
            "-h" | "--help" => {
                return Err("usage: service [--node-id ID] [--listen ADDR] (DATABASE_URL: the database; unset: a throwaway cluster)".to_owned());
            }
            other => return Err(format!("unknown flag {other:?}; see --help")),
        }
    }
    Ok(args)
}

/// One JSON object per line on stdout: `mono_us`, `ts_us`, `node`, `event`, then fields.
#[derive(Clone)]
struct Events {
    node: Arc<str>,
}

impl Events {
    fn emit(&self, event: &str, fields: &[(&str, Field)]) {
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_micros());
        let mut line = format!(
            "{{\"mono_us\":{},\"ts_us\":{ts},\"node\":{},\"event\":{}",
            chosen_tests::monotonic_us(),
            json_str(&self.node),
            json_str(event)
        );
        for (key, value) in fields {
            let _ = write!(line, ",{}:", json_str(key));
            match value {
                Field::Str(s) => line.push_str(&json_str(s)),
                Field::Num(n) => {
                    let _ = write!(line, "{n}");
                }
            }
        }
        line.push('}');
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{line}");
        let _ = out.flush();
    }
}

enum Field {
    Str(String),
    Num(u64),
}

fn json_str(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// The cron job: one `tick` line per scheduled second, on the leader only (the gate
/// skips it elsewhere). `scheduled` is the tick's own time (Unix seconds), the same on
/// every replica, so a tick that ran twice across the fleet shows.
async fn tick(
    tick: Tick,
    guard: Data<LeaderGuard>,
    events: Data<Events>,
) -> Result<(), BoxDynError> {
    events.emit(
        "tick",
        &[
            ("scheduled", Field::Num(tick.get_timestamp())),
            ("token", Field::Num(guard.fencing_token().get())),
        ],
    );
    Ok(())
}

/// `SIGTERM` or `SIGINT`, installed before anything else so that an early signal is
/// handled too (a default-handled SIGTERM would kill the process with no shutdown).
fn signals() -> std::io::Result<impl std::future::Future<Output = &'static str>> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        }
    })
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        // Stdout is for the JSON event lines.
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let args = match parse_args() {
        Ok(args) => args,
        Err(e) => {
            eprintln!("service: {e}");
            return ExitCode::from(2);
        }
    };
    let signal = match signals() {
        Ok(signal) => signal,
        Err(e) => {
            eprintln!("service: cannot handle signals: {e}");
            return ExitCode::from(2);
        }
    };
    // Process exit, measured (issue 16, item 6): with `DATABASE_URL` set, three of these
    // processes were gone 1-6 ms after their `shutdown` `done` line (5-17 ms after
    // SIGTERM; tests/tests/service.rs prints it), and 25-60 ms without it (the throwaway
    // cluster is stopped and removed after `done`). Nothing waits in the runtime's
    // blocking pool. What does make a process slow to exit is its stderr: logs are
    // written synchronously, so when whoever runs the process does not read a piped
    // stderr, the pipe fills (64 KiB) and every thread that logs blocks, SIGTERM handling
    // included, until it is read (measured here: ticks stopped, exit 0.1 s after the pipe
    // was drained). With `tracing_appender::non_blocking` instead, the logging thread
    // blocks, and dropping its `WorkerGuard` at the end of `main` waits up to 1 s
    // (measured: 1.0 s after `done`, every time): that is the 1.2-1.7 s reported. Let
    // stderr go to a terminal, a file or journald, or drain the pipe.
    let (url, _cluster) = match std::env::var("DATABASE_URL") {
        Ok(url) if !url.is_empty() => (url, None),
        _ => match chosen_tests::PgCluster::start_local() {
            Ok(cluster) => (cluster.url(), Some(cluster)),
            Err(e) => {
                eprintln!("service: no DATABASE_URL, and no throwaway cluster: {e}");
                return ExitCode::from(2);
            }
        },
    };
    match run(args, &url, signal).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("service: {e}");
            ExitCode::from(2)
        }
    }
}

async fn run(
    args: Args,
    url: &str,
    signal: impl std::future::Future<Output = &'static str>,
) -> Result<(), Box<dyn std::error::Error>> {
    let events = Events {
        node: args.node_id.as_str().into(),
    };
    let registry = prometheus::Registry::new();
    let options = ManagerOptions::from_url(url)?
        .node_id(&args.node_id)
        .metrics(Arc::new(PrometheusMetrics::register(&registry)?));
    let manager = LockManager::connect(options).await?;

    // One election, two gates: the route and the cron job follow the same leader.
    let election = Election::start(&manager, LEADER_LOCK)?;
    let leadership = election.leadership();

    // A background loop on exactly one node (not necessarily the election's leader).
    let singleton_events = events.clone();
    let _housekeeping = Singleton::start(
        &manager,
        HOUSEKEEPING,
        SingletonOptions::default(),
        move |ctx| {
            let events = singleton_events.clone();
            async move {
                let token = ("token", Field::Num(ctx.fencing_token().get()));
                events.emit("housekeeping_started", &[token]);
                info!(token = ctx.fencing_token().get(), "housekeeping started");
                let mut every = tokio::time::interval(Duration::from_secs(5));
                loop {
                    tokio::select! {
                        () = ctx.cancelled() => break,
                        _ = every.tick() => {
                            if ctx.is_valid() {
                                // One guarded step, tagged with ctx.fencing_token().
                            }
                        }
                    }
                }
                events.emit(
                    "housekeeping_stopped",
                    &[("token", Field::Num(ctx.fencing_token().get()))],
                );
                Ok::<(), std::io::Error>(())
            }
        },
    )?;

    // HTTP: `/leader` is leader-only (the layer answers 503 with Retry-After
    // elsewhere); `/metrics` and `/healthz` are served by every replica.
    let node_id = args.node_id.clone();
    let app = Router::new()
        .route(
            "/leader",
            get(move || {
                let node_id = node_id.clone();
                async move { format!("{{\"leader\":{}}}\n", json_str(&node_id)) }
            })
            .route_layer(LeaderOnlyHttpLayer::new(leadership.clone())),
        )
        .route(
            "/metrics",
            get(move || {
                let registry = registry.clone();
                async move {
                    let mut body = Vec::new();
                    let encoder = prometheus::TextEncoder::new();
                    let _ = prometheus::Encoder::encode(&encoder, &registry.gather(), &mut body);
                    (
                        [(axum::http::header::CONTENT_TYPE, prometheus::TEXT_FORMAT)],
                        body,
                    )
                }
            }),
        )
        .route("/healthz", get(|| async { "ok\n" }));
    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    let addr = listener.local_addr()?;
    let (stop_tx, stop_rx) = watch::channel(false);
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|stop| *stop).await;
    };
    let mut http = tokio::spawn(
        axum::serve(listener, app)
            .with_graceful_shutdown(stopped(stop_rx.clone()))
            .into_future(),
    );
    info!(%addr, "listening");
    events.emit("listening", &[("addr", Field::Str(addr.to_string()))]);

    // The cron job: every replica's scheduler fires every second; the gate lets the
    // leader's tick through only.
    let schedule = Schedule::from_str("* * * * * *")?;
    let gate = LeaderOnlyJobLayer::new(leadership);
    let worker_name = format!("tick-{}", args.node_id);
    let job_events = events.clone();
    let worker_stop = stopped(stop_rx);
    let mut worker = tokio::spawn(async move {
        Monitor::new()
            .register(move |_| {
                cron_worker(&worker_name, schedule.clone(), gate.clone())
                    .data(job_events.clone())
                    .build(tick)
            })
            .run_with_signal(async move {
                worker_stop.await;
                Ok(())
            })
            .await
    });

    let got = tokio::select! {
        got = signal => got,
        // Either stopping on its own is a failure of this replica: shut down the rest.
        ended = &mut http => { warn!(?ended, "the HTTP server ended"); "http-ended" }
        ended = &mut worker => { warn!(?ended, "the apalis monitor ended"); "worker-ended" }
    };
    info!(signal = got, "shutting down");
    events.emit("shutdown", &[("phase", Field::Str("begin".to_owned()))]);
    let _ = stop_tx.send(true);
    // 1. Stop accepting HTTP: the listener closes; requests in flight finish, idle
    //    keep-alive connections are closed.
    if !http.is_finished() && tokio::time::timeout(STEP_BOUND, &mut http).await.is_err() {
        warn!(bound = ?STEP_BOUND, "HTTP connections still open; dropping them");
        http.abort();
    }
    events.emit(
        "shutdown",
        &[("phase", Field::Str("http_stopped".to_owned()))],
    );
    // 2. Stop the apalis worker: no tick starts after this.
    if !worker.is_finished() && tokio::time::timeout(STEP_BOUND, &mut worker).await.is_err() {
        warn!(bound = ?STEP_BOUND, "the apalis monitor is still stopping; dropping it");
        worker.abort();
    }
    events.emit(
        "shutdown",
        &[("phase", Field::Str("worker_stopped".to_owned()))],
    );
    // 3. One call for the rest: the singleton's child stops, then the singleton's and the
    //    election's locks are released and announced, then the session closes.
    manager.shutdown().await;
    info!("shutdown done");
    events.emit("shutdown", &[("phase", Field::Str("done".to_owned()))]);
    Ok(())
}
