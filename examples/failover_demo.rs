//! Three nodes run one singleton; the leader is made to fail in three ways and every
//! takeover is timed.
//!
//! ```text
//! cargo run --example failover_demo
//! ```
//!
//! With `DATABASE_URL` set it uses that database; otherwise it starts a throwaway
//! PostgreSQL cluster from the server binaries (and says how to install them if they
//! are missing). Each node connects through its own loopback proxy, so that one
//! node's network can be cut for the partition scenario.

use std::error::Error;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use chosen_core::{
    FencingToken, LockManager, ManagerOptions, PrometheusMetrics, Singleton, SingletonOptions,
};
use chosen_tests::{FaultProxy, PgCluster, ProxyMode, connect_admin};
use tokio::sync::mpsc;

const SINGLETON: &str = "nightly-report";

#[path = "common/mod.rs"]
mod common;

enum Event {
    Started {
        node: usize,
        token: FencingToken,
        at: Instant,
    },
    Stopped {
        node: usize,
        why: String,
        at: Instant,
    },
}

struct Node {
    manager: LockManager,
    singleton: Option<Singleton>,
    proxy: FaultProxy,
    http: SocketAddr,
}

#[tokio::main]
async fn main() -> ExitCode {
    // `RUST_LOG=chosen_core=debug cargo run --example failover_demo` shows the library's events.
    if std::env::var_os("RUST_LOG").is_some() {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .init();
    }
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("\nfailover_demo failed: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<(), Box<dyn Error>> {
    let started = Instant::now();
    let (url, _cluster) = match std::env::var("DATABASE_URL") {
        Ok(url) if !url.is_empty() => {
            println!("Using DATABASE_URL.");
            (url, None)
        }
        _ => {
            println!("No DATABASE_URL: starting a throwaway PostgreSQL cluster...");
            let cluster = PgCluster::start_local()?;
            println!(
                "PostgreSQL is up on 127.0.0.1:{} after {:.1} s.",
                cluster.port().unwrap_or_default(),
                started.elapsed().as_secs_f64()
            );
            (cluster.url(), Some(cluster))
        }
    };
    let pg_config: tokio_postgres_config::Config = url.parse()?;
    let upstream = upstream_addr(&pg_config)?;

    println!(
        "\nThree nodes (one lock connection each) run the singleton {SINGLETON:?}: exactly one of them runs its child."
    );
    let (tx, mut events) = mpsc::unbounded_channel();
    let registry = prometheus::Registry::new();
    let metrics = std::sync::Arc::new(PrometheusMetrics::register(&registry)?);
    let metrics_addr = common::serve_metrics(registry, ([127, 0, 0, 1], 0).into()).await?;
    let mut nodes = Vec::new();
    for n in 1..=3 {
        let proxy = FaultProxy::start(upstream).await?;
        let config = through(&pg_config, proxy.addr());
        let options = ManagerOptions::from_pg_config(config)
            .node_id(format!("node-{n}"))
            .metrics(metrics.clone());
        let manager = LockManager::connect(options).await?;
        let singleton = start_singleton(&manager, n, &tx)?;
        let http = serve_admin(singleton.leadership()).await?;
        nodes.push(Node {
            manager,
            singleton: Some(singleton),
            proxy,
            http,
        });
    }
    let admin = connect_admin(&url).await?;
    let mut leader = next_start(&mut events, None).await?.0;
    println!("   Each node also serves POST /admin behind LeaderOnlyHttpLayer:");
    show_admin(&nodes).await;
    let mut results = Vec::new();

    // 1. Graceful shutdown: stop the child, release, announce with NOTIFY.
    println!("\n1. node-{leader} shuts down gracefully (as on SIGTERM)...");
    let t = Instant::now();
    if let Some(s) = nodes[leader - 1].singleton.take() {
        s.shutdown().await;
    }
    let (next, took, _) = next_start(&mut events, Some(t)).await?;
    results.push(("graceful shutdown", took, None));
    println!("   node-{leader} has left; two nodes remain.");
    show_admin(&nodes).await;
    leader = next;
    settle().await;

    // 2. The server kills the leader's session.
    println!("\n2. the database terminates node-{leader}'s session (pg_terminate_backend)...");
    let t = Instant::now();
    admin
        .execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1",
            &[&format!("node-{leader}")],
        )
        .await?;
    let (next, took, _) = next_start(&mut events, Some(t)).await?;
    results.push(("session killed", took, None));
    show_admin(&nodes).await;
    leader = next;
    settle().await;

    // 3. The leader's network goes silent: it must stop on its own before the server
    //    lets anyone else in.
    println!(
        "\n3. node-{leader}'s network goes silent (a partition: packets dropped, sockets open)..."
    );
    let t = Instant::now();
    nodes[leader - 1].proxy.set(ProxyMode::BlackHole);
    let (next, took, stopped) = next_start(&mut events, Some(t)).await?;
    results.push(("network partition", took, stopped));
    show_admin(&nodes).await;
    nodes[leader - 1].proxy.set(ProxyMode::Pass);
    let _ = next;

    println!("\nSummary (time until another node's child was running):");
    for (what, took, stopped) in &results {
        print!("  {what:<20} {:>8}", ms(*took));
        if let Some(stopped) = stopped {
            print!(
                "   (old leader stopped its child after {}, {} before the takeover: no overlap)",
                ms(*stopped),
                ms(took.saturating_sub(*stopped))
            );
        }
        println!();
    }
    println!("\nFrom http://{metrics_addr}/metrics (the three nodes share one registry here):");
    if let Ok((_, body)) = common::http(metrics_addr, "GET", "/metrics").await {
        for line in body.lines().filter(|l| {
            l.starts_with("chosen_lock_held")
                || l.starts_with("chosen_lock_losses_total")
                || l.starts_with("chosen_singleton_running")
        }) {
            println!("  {line}");
        }
    }
    println!(
        "\nA partitioned leader cannot be told it lost: it stops by itself when its heartbeat is {} overdue, and the server releases its lock only after {} of silence.",
        secs(nodes[0].manager.options().get_lease_timeout()),
        secs(nodes[0].manager.options().get_server_release_after())
    );
    for node in &nodes {
        if let Some(s) = &node.singleton {
            s.shutdown().await;
        }
        node.manager.shutdown().await;
    }
    println!("Done in {:.1} s.", started.elapsed().as_secs_f64());
    Ok(())
}

fn start_singleton(
    manager: &LockManager,
    node: usize,
    tx: &mpsc::UnboundedSender<Event>,
) -> chosen_core::Result<Singleton> {
    let tx = tx.clone();
    Singleton::start(
        manager,
        SINGLETON,
        SingletonOptions::default(),
        move |ctx| {
            let tx = tx.clone();
            async move {
                let _ = tx.send(Event::Started {
                    node,
                    token: ctx.fencing_token(),
                    at: Instant::now(),
                });
                // The child's work would go here, checking ctx.is_valid() before each step.
                ctx.cancelled().await;
                let why = ctx
                    .loss_reason()
                    .map_or_else(|| "shutdown".to_owned(), |r| r.to_string());
                let _ = tx.send(Event::Stopped {
                    node,
                    why,
                    at: Instant::now(),
                });
                Ok::<(), std::io::Error>(())
            }
        },
    )
}

/// Prints events until a child starts; returns the node, the time since `since`, and
/// when (since `since`) a child stopped before it.
async fn next_start(
    events: &mut mpsc::UnboundedReceiver<Event>,
    since: Option<Instant>,
) -> Result<(usize, Duration, Option<Duration>), Box<dyn Error>> {
    let t0 = since.unwrap_or_else(Instant::now);
    let mut stopped = None;
    loop {
        let event = tokio::time::timeout(Duration::from_secs(30), events.recv())
            .await
            .map_err(|_| "no node started the child within 30 s")?
            .ok_or("all nodes stopped")?;
        match event {
            Event::Started { node, token, at } => {
                let took = at.duration_since(t0);
                if since.is_some() {
                    println!(
                        "   {:>8}  node-{node} runs the child (fencing token {token})",
                        ms(took)
                    );
                } else {
                    println!("   node-{node} runs the child (fencing token {token})");
                }
                return Ok((node, took, stopped));
            }
            Event::Stopped { node, why, at } => {
                let took = at.duration_since(t0);
                println!("   {:>8}  node-{node} stopped its child: {why}", ms(took));
                stopped = Some(took);
            }
        }
    }
}

/// Serves `POST /admin` (leader only) on a loopback port.
async fn serve_admin(leadership: chosen_core::Leadership) -> Result<SocketAddr, Box<dyn Error>> {
    let app = axum::Router::new().route(
        "/admin",
        axum::routing::post(|| async { "done\n" })
            .route_layer(chosen_tower::LeaderOnlyHttpLayer::new(leadership)),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(addr)
}

/// Asks every node's `POST /admin` and prints the status codes.
async fn show_admin(nodes: &[Node]) {
    let mut line = String::from("   POST /admin:");
    for (i, node) in nodes.iter().enumerate() {
        let status = http_status(node.http).await.unwrap_or_else(|e| e);
        line.push_str(&format!("  node-{} -> {status}", i + 1));
    }
    println!("{line}");
}

async fn http_status(addr: SocketAddr) -> Result<String, String> {
    let (status, _) = common::http(addr, "POST", "/admin")
        .await
        .map_err(|e| e.to_string())?;
    Ok(match status {
        200 => "200 (leader)".to_owned(),
        other => other.to_string(),
    })
}

/// Lets every node that is not leading get back in line.
async fn settle() {
    tokio::time::sleep(Duration::from_millis(1500)).await;
}

fn upstream_addr(config: &tokio_postgres_config::Config) -> Result<SocketAddr, Box<dyn Error>> {
    use tokio_postgres_config::Host;
    let host = match config.get_hosts().first() {
        Some(Host::Tcp(h)) => h.clone(),
        _ => return Err("the failover demo needs a TCP host in DATABASE_URL".into()),
    };
    let port = config.get_ports().first().copied().unwrap_or(5432);
    std::net::ToSocketAddrs::to_socket_addrs(&(host.as_str(), port))?
        .next()
        .ok_or_else(|| format!("cannot resolve {host}").into())
}

/// The same credentials and database, reached only through `proxy` (note that
/// `Config::host` adds a host rather than replacing it, hence a fresh config).
fn through(
    config: &tokio_postgres_config::Config,
    proxy: SocketAddr,
) -> tokio_postgres_config::Config {
    let mut c = tokio_postgres_config::Config::new();
    c.host(proxy.ip().to_string()).port(proxy.port());
    if let Some(user) = config.get_user() {
        c.user(user);
    }
    if let Some(password) = config.get_password() {
        c.password(password);
    }
    if let Some(db) = config.get_dbname() {
        c.dbname(db);
    }
    c
}

fn ms(d: Duration) -> String {
    if d >= Duration::from_secs(1) {
        format!("{:.2} s", d.as_secs_f64())
    } else {
        format!("{:.1} ms", d.as_secs_f64() * 1000.0)
    }
}

fn secs(d: Duration) -> String {
    format!("{} s", d.as_secs_f64())
}

mod tokio_postgres_config {
    pub(crate) use chosen_tests::PgConfig as Config;
    pub(crate) use chosen_tests::PgHost as Host;
}
