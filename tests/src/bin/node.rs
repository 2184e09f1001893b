//! One real node: a lock manager running one or more singletons, reporting every event
//! as a JSON line on stdout. The fault-injection suite runs several of these.
//!
//! ```text
//! DATABASE_URL=postgres://... cargo run --release -p chosen-tests --bin node -- \
//!     --node-id ID --singleton NAME [--singleton NAME ...] [--group NAME --members M] \
//!     [--group-flap-leaves N] [--ineligible] [--preferred] [--lease-rows] \
//!     [--heartbeat-ms N] [--lease-timeout-ms N] [--server-release-ms N] [--poll-ms N] [--tick-ms N]
//!     [--metrics ADDR]
//! ```
//!
//! The event format is documented in `examples/README.md`. SIGTERM or SIGINT hands
//! every singleton over gracefully, then exits 0. Bad flags or a bad URL print one line
//! on stderr and exit 2.

use std::fmt::Write as _;
use std::io::Write as _;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use std::future::Future;

use chosen_core::{
    ConnectionState, GroupOptions, LeaderContext, LeaderState, LockManager, ManagerOptions,
    PrometheusMetrics, Singleton, SingletonGroup, SingletonOptions,
};

// The examples' metrics endpoint, shared (this fixture was an example once).
#[path = "../../../examples/common/mod.rs"]
mod common;

struct Args {
    node_id: String,
    singletons: Vec<String>,
    /// A singleton group: its name and how many members (`NAME-0` ... `NAME-(M-1)`).
    group: Option<(String, usize)>,
    /// Leaves within a minute that freeze the group's moves (`GroupOptions::flapping`).
    group_flap_leaves: Option<usize>,
    /// Never leads (`ManagerOptions::eligible(false)`): follows only.
    ineligible: bool,
    /// Its singletons are preferred here (`SingletonOptions::preferred`).
    preferred: bool,
    heartbeat: Option<Duration>,
    lease_timeout: Option<Duration>,
    server_release: Option<Duration>,
    poll: Option<Duration>,
    tick: Duration,
    metrics: Option<std::net::SocketAddr>,
    /// Holds its locks as lease rows on a pool of `DATABASE_URL`
    /// (`LockManager::connect_pooled`).
    lease_rows: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        node_id: String::new(),
        singletons: Vec::new(),
        group: None,
        group_flap_leaves: None,
        ineligible: false,
        preferred: false,
        heartbeat: None,
        lease_timeout: None,
        server_release: None,
        poll: None,
        tick: Duration::from_millis(50),
        metrics: None,
        lease_rows: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        let ms = |v: String, flag: &str| -> Result<Duration, String> {
            v.parse::<u64>()
                .ok()
                .filter(|n| *n > 0)
                .map(Duration::from_millis)
                .ok_or_else(|| format!("{flag} takes a positive number of milliseconds, got {v:?}"))
        };
        match flag.as_str() {
            "--node-id" => args.node_id = value()?,
            "--ineligible" => args.ineligible = true,
            "--preferred" => args.preferred = true,
            "--lease-rows" => args.lease_rows = true,
            "--singleton" => args.singletons.push(value()?),
            "--group" => {
                let name = value()?;
                let members = args.group.as_ref().map_or(0, |g| g.1);
                args.group = Some((name, members));
            }
            "--group-flap-leaves" => {
                let v = value()?;
                args.group_flap_leaves =
                    Some(v.parse::<usize>().ok().filter(|n| *n > 0).ok_or_else(|| {
                        format!("--group-flap-leaves takes a positive number, got {v:?}")
                    })?);
            }
            "--members" => {
                let v = value()?;
                let m = v
                    .parse::<usize>()
                    .ok()
                    .filter(|m| (1..=10_000).contains(m))
                    .ok_or_else(|| {
                        format!("--members takes a number from 1 to 10000, got {v:?}")
                    })?;
                let name = args.group.take().map(|g| g.0).unwrap_or_default();
                args.group = Some((name, m));
            }
            "--heartbeat-ms" => args.heartbeat = Some(ms(value()?, &flag)?),
            "--lease-timeout-ms" => args.lease_timeout = Some(ms(value()?, &flag)?),
            "--server-release-ms" => args.server_release = Some(ms(value()?, &flag)?),
            "--poll-ms" => args.poll = Some(ms(value()?, &flag)?),
            "--tick-ms" => args.tick = ms(value()?, &flag)?,
            "--metrics" => {
                let v = value()?;
                args.metrics = Some(v.parse().map_err(|_| {
                    format!("--metrics takes an address such as 127.0.0.1:9090, got {v:?}")
                })?);
            }
            "-h" | "--help" => {
                return Err("usage: node --node-id ID --singleton NAME [--singleton NAME ...] [--group NAME --members M [--group-flap-leaves N]] [--heartbeat-ms N] [--lease-timeout-ms N] [--server-release-ms N] [--poll-ms N] [--tick-ms N] [--metrics ADDR] [--lease-rows] (DATABASE_URL must be set)".to_owned());
            }
            other => return Err(format!("unknown flag {other:?}; see --help")),
        }
    }
    if args.node_id.is_empty() {
        return Err("--node-id is required".to_owned());
    }
    if let Some((name, members)) = &args.group
        && (name.is_empty() || *members == 0)
    {
        return Err("a group needs both --group NAME and --members M".to_owned());
    }
    if args.singletons.is_empty() && args.group.is_none() {
        return Err(
            "at least one --singleton NAME (or a --group NAME --members M) is required".to_owned(),
        );
    }
    Ok(args)
}

/// How often the loss watcher looks at a lease whose loss has no event of its own
/// (the client-side deadline passing while heartbeats are late).
const LOSS_POLL: Duration = Duration::from_millis(5);

/// One JSON object per line: `mono_us`, `ts_us`, `node`, `event`, then the given fields.
#[derive(Clone)]
struct Events {
    node: Arc<str>,
}

impl Events {
    fn emit(&self, event: &str, fields: &[(&str, Field)]) {
        self.emit_at(chosen_tests::monotonic_us(), event, fields);
    }

    /// Emits an event stamped `mono_us` (`CLOCK_MONOTONIC` µs, taken by the caller).
    fn emit_at(&self, mono_us: u64, event: &str, fields: &[(&str, Field)]) {
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_micros());
        let mut line = format!(
            "{{\"mono_us\":{mono_us},\"ts_us\":{ts},\"node\":{},\"event\":{}",
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
                Field::Null => line.push_str("null"),
            }
        }
        line.push('}');
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{line}");
        let _ = out.flush();
    }
}

/// The fields every child event carries.
#[derive(Clone)]
struct ChildFields {
    singleton: String,
    token: u64,
}

impl ChildFields {
    fn fields(&self) -> Vec<(&'static str, Field)> {
        vec![
            ("singleton", Field::Str(self.singleton.clone())),
            ("token", Field::Num(self.token)),
        ]
    }
}

/// Emits `lease_lost` once the child's lease is lost: at once when the lease is
/// revoked, within [`LOSS_POLL`] when its client-side deadline passes.
async fn watch_loss(
    ctx: LeaderContext,
    events: Events,
    fields: ChildFields,
    reported: Arc<AtomicBool>,
) {
    loop {
        if ctx.loss_reason().is_some() {
            report_loss(&ctx, &events, &fields, &reported);
            return;
        }
        if ctx.is_cancelled() {
            // Stopping for a shutdown: the lease may still be lost before the child
            // returns, so keep looking, at the poll rate.
            tokio::time::sleep(LOSS_POLL).await;
        } else {
            tokio::select! {
                () = ctx.cancelled() => {}
                () = tokio::time::sleep(LOSS_POLL) => {}
            }
        }
    }
}

/// Emits `lease_lost` once per run, when the lease is lost.
fn report_loss(ctx: &LeaderContext, events: &Events, fields: &ChildFields, reported: &AtomicBool) {
    if let Some(reason) = ctx.loss_reason()
        && !reported.swap(true, Ordering::SeqCst)
    {
        let mut f = fields.fields();
        f.push(("reason", Field::Str(reason.to_string())));
        events.emit("lease_lost", &f);
    }
}

/// Emits `child_stopped` when dropped: when the child returns, and also when its future
/// is dropped without returning (aborted by the singleton after the shutdown timeout).
/// A loss the watcher had no time to report (the child was stopped for it first) is
/// reported just before.
struct StoppedGuard {
    ctx: LeaderContext,
    events: Events,
    fields: ChildFields,
    watcher: tokio::task::JoinHandle<()>,
    reported: Arc<AtomicBool>,
}

impl Drop for StoppedGuard {
    fn drop(&mut self) {
        self.watcher.abort();
        report_loss(&self.ctx, &self.events, &self.fields, &self.reported);
        self.events.emit("child_stopped", &self.fields.fields());
    }
}

enum Field {
    Str(String),
    Num(u64),
    Null,
}

fn json_str(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(args) => args,
        Err(e) => {
            eprintln!("node: {e}");
            return ExitCode::from(2);
        }
    };
    let Ok(url) = std::env::var("DATABASE_URL") else {
        eprintln!("node: DATABASE_URL is not set");
        return ExitCode::from(2);
    };
    match run(args, &url).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("node: {e}");
            ExitCode::from(2)
        }
    }
}

/// A pool of `url` for the lease-row mode: four connections, as an application's.
fn pool(url: &str) -> Result<deadpool_postgres::Pool, Box<dyn std::error::Error>> {
    let config: tokio_postgres::Config = url.parse()?;
    Ok(
        deadpool_postgres::Pool::builder(deadpool_postgres::Manager::new(
            config,
            tokio_postgres::NoTls,
        ))
        .max_size(4)
        .build()?,
    )
}

fn options(args: &Args, url: &str) -> chosen_core::Result<ManagerOptions> {
    let base = if args.lease_rows {
        ManagerOptions::pooled()
    } else {
        ManagerOptions::from_url(url)?
    };
    let mut o = base.node_id(&args.node_id).eligible(!args.ineligible);
    if let Some(h) = args.heartbeat {
        o = o.heartbeat_interval(h);
    }
    if let Some(l) = args.lease_timeout {
        o = o.lease_timeout(l);
        if args.server_release.is_none() {
            // Keep the invariant: lease + stop budget + margin + 1 s of slack.
            let release = (l + o.get_stop_budget() + Duration::from_secs(2))
                .max(o.get_server_release_after());
            o = o.server_release_after(release);
        }
    }
    if let Some(s) = args.server_release {
        o = o.server_release_after(s);
    }
    if let Some(p) = args.poll {
        o = o.poll_interval(p);
    }
    o.validate()?;
    Ok(o)
}

async fn run(args: Args, url: &str) -> Result<(), Box<dyn std::error::Error>> {
    let events = Events {
        node: args.node_id.as_str().into(),
    };
    let mut options = options(&args, url)?;
    if let Some(addr) = args.metrics {
        let registry = prometheus::Registry::new();
        options = options.metrics(Arc::new(PrometheusMetrics::register(&registry)?));
        let bound = common::serve_metrics(registry, addr).await?;
        events.emit("metrics", &[("addr", Field::Str(bound.to_string()))]);
    }
    // A node started while the database is down or restarting waits for it, as a
    // service under a supervisor would, instead of exiting: the manager reconnects by
    // itself once it is up, but its first connection is the caller's to retry.
    let manager = {
        let mut delay = Duration::from_millis(100);
        let give_up = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            let connected = if args.lease_rows {
                LockManager::connect_pooled(pool(url)?, options.clone()).await
            } else {
                LockManager::connect(options.clone()).await
            };
            match connected {
                Ok(manager) => break manager,
                Err(e) if e.is_transient() && std::time::Instant::now() < give_up => {
                    events.emit("connect_retry", &[("error", Field::Str(e.to_string()))]);
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_secs(2));
                }
                Err(e) => return Err(e.into()),
            }
        }
    };
    spawn_status_events(&manager, events.clone());

    let child = child_factory(events.clone(), args.tick);
    let mut singletons = Vec::new();
    for name in &args.singletons {
        let singleton = Singleton::start(
            &manager,
            name.as_str(),
            SingletonOptions::default().preferred(args.preferred),
            child.clone(),
        )?;
        spawn_leadership_events(&singleton, events.clone());
        singletons.push(singleton);
    }
    let group = match &args.group {
        Some((name, members)) => {
            let child = child.clone();
            let group = SingletonGroup::start(
                &manager,
                name.as_str(),
                (0..*members).map(|i| format!("{name}-{i}")),
                match args.group_flap_leaves {
                    Some(n) => GroupOptions::default().flapping(n, Duration::from_secs(60)),
                    None => GroupOptions::default(),
                },
                move |_member, ctx| child(ctx),
            )?;
            Some(Arc::new(group))
        }
        None => None,
    };
    if let Some(group) = &group {
        spawn_placement_events(Arc::clone(group), events.clone());
    }

    wait_for_signal().await;
    events.emit("shutdown", &[("phase", Field::Str("begin".to_owned()))]);
    if let Some(group) = &group {
        group.shutdown().await;
    }
    for singleton in &singletons {
        singleton.shutdown().await;
    }
    manager.shutdown().await;
    events.emit("shutdown", &[("phase", Field::Str("done".to_owned()))]);
    Ok(())
}

/// The child every singleton and group member runs: it reports `child_started`, a
/// `child_tick` every `tick` while its lease may be trusted, `lease_lost` the moment
/// the lease is lost, and `child_stopped` when it ends or is aborted.
fn child_factory(
    events: Events,
    tick: Duration,
) -> impl Fn(LeaderContext) -> std::pin::Pin<Box<dyn Future<Output = Result<(), std::io::Error>> + Send>>
+ Clone
+ Send
+ Sync
+ 'static {
    move |ctx: LeaderContext| {
        let events = events.clone();
        Box::pin(async move {
            let token = ctx.fencing_token().get();
            let fields = ChildFields {
                singleton: ctx.name().to_owned(),
                token,
            };
            events.emit("child_started", &fields.fields());
            // Reports the moment the lease is lost, from its own task, so the report
            // does not wait for the child to notice.
            let reported = Arc::new(AtomicBool::new(false));
            let watcher = tokio::spawn(watch_loss(
                ctx.clone(),
                events.clone(),
                fields.clone(),
                Arc::clone(&reported),
            ));
            // `child_stopped` when this future returns *or is dropped* (aborted).
            let _stopped = StoppedGuard {
                ctx: ctx.clone(),
                events: events.clone(),
                fields: fields.clone(),
                watcher,
                reported,
            };
            let mut ticks = tokio::time::interval(tick);
            loop {
                tokio::select! {
                    () = ctx.cancelled() => break,
                    _ = ticks.tick() => {
                        // The guarded step: only while the lease may be trusted. The
                        // stamp is taken *before* the check, so a tick can never be
                        // stamped after the loss it missed.
                        let at = chosen_tests::monotonic_us();
                        if ctx.is_valid() {
                            events.emit_at(at, "child_tick", &fields.fields());
                        }
                    }
                }
            }
            Ok(())
        })
    }
}

/// Emits a `placement` event whenever this node's view of its group changes: how many
/// members it leads, its target, the live nodes, whether moves are frozen, and how
/// many members it handed over so far.
fn spawn_placement_events(group: Arc<SingletonGroup>, events: Events) {
    tokio::spawn(async move {
        let mut last = None;
        loop {
            let s = group.status();
            let now = (
                s.leading.len(),
                s.target,
                s.live_nodes,
                s.frozen,
                s.handed_over,
            );
            if last != Some(now) {
                events.emit(
                    "placement",
                    &[
                        ("leading", Field::Num(s.leading.len() as u64)),
                        (
                            "target",
                            s.target.map_or(Field::Null, |t| Field::Num(t as u64)),
                        ),
                        ("live_nodes", Field::Num(s.live_nodes as u64)),
                        ("frozen", Field::Str(s.frozen.to_string())),
                        ("handed_over", Field::Num(s.handed_over)),
                    ],
                );
                last = Some(now);
            }
            if Arc::strong_count(&group) == 1 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
}

fn spawn_status_events(manager: &LockManager, events: Events) {
    let mut status = manager.watch_connection_status();
    tokio::spawn(async move {
        loop {
            let current = status.borrow_and_update().clone();
            match current {
                ConnectionState::Connected {
                    generation,
                    backend_pid,
                    server,
                    ..
                } => events.emit(
                    "connected",
                    &[
                        ("generation", Field::Num(generation)),
                        (
                            "backend_pid",
                            Field::Num(u64::from(backend_pid.unsigned_abs())),
                        ),
                        ("server", Field::Str(server)),
                    ],
                ),
                ConnectionState::Disconnected { reason, .. } => {
                    events.emit(
                        "disconnected",
                        &[("reason", Field::Str(reason.to_string()))],
                    );
                }
                _ => {}
            }
            if status.changed().await.is_err() {
                return;
            }
        }
    });
}

fn spawn_leadership_events(singleton: &Singleton, events: Events) {
    let leadership = singleton.leadership();
    tokio::spawn(async move {
        let mut last = None;
        loop {
            let state = leadership.state();
            if last.as_ref() != Some(&state) {
                let name = ("singleton", Field::Str(leadership.name().to_owned()));
                match &state {
                    LeaderState::Leading { token, .. } => {
                        events.emit("leading", &[name, ("token", Field::Num(token.get()))]);
                    }
                    LeaderState::Following { leader } => events.emit(
                        "following",
                        &[
                            name,
                            ("leader", leader.clone().map_or(Field::Null, Field::Str)),
                        ],
                    ),
                    LeaderState::Stopped => return,
                    _ => {}
                }
                last = Some(state);
            }
            leadership.changed().await;
        }
    });
}

async fn wait_for_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        std::future::pending::<()>().await;
        return;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}
