//! Three nodes compete for one lock; the holder is made to fail in different ways and
//! every takeover is timed.
//!
//! ```text
//! cargo run --example quickstart
//! ```
//!
//! With `DATABASE_URL` set it uses that database; otherwise it starts a throwaway
//! PostgreSQL cluster from the server binaries (and says how to install them if they
//! are missing).

use std::error::Error;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use chosen_core::{FencingToken, LockManager, ManagerOptions};
use chosen_tests::{PgCluster, connect_admin};
use tokio::sync::{Notify, mpsc};

const LOCK: &str = "quickstart-singleton";

#[derive(Debug)]
enum Event {
    Leading { node: usize, token: FencingToken },
    Lost { node: usize, reason: String },
}

#[tokio::main]
async fn main() -> ExitCode {
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("quickstart failed: {e}");
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
                "  PostgreSQL is up on 127.0.0.1:{} ({:.1} s).",
                cluster.port().unwrap_or_default(),
                started.elapsed().as_secs_f64()
            );
            (cluster.url(), Some(cluster))
        }
    };

    println!("\nThree nodes, one connection each, all asking for the lock {LOCK:?}.");
    let (tx, mut events) = mpsc::unbounded_channel();
    let mut managers = Vec::new();
    let mut step_down = Vec::new();
    for node in 1..=3 {
        let options = ManagerOptions::from_url(&url)?.node_id(format!("quickstart-node-{node}"));
        let manager = LockManager::connect(options).await?;
        let notify = Arc::new(Notify::new());
        tokio::spawn(node_loop(
            node,
            manager.clone(),
            Arc::clone(&notify),
            tx.clone(),
        ));
        managers.push(manager);
        step_down.push(notify);
    }
    let admin = connect_admin(&url).await?;

    let mut leader = wait_leader(&mut events, None).await?.0;
    println!("  node-{leader} leads.\n");

    // 1. Graceful hand-off: the leader releases; the release is announced with NOTIFY.
    println!("1. node-{leader} steps down gracefully (release + NOTIFY)...");
    let t = Instant::now();
    step_down[leader - 1].notify_one();
    let (next, took) = wait_leader(&mut events, Some(t)).await?;
    println!("   node-{next} took over after {}.\n", ms(took));
    leader = next;
    settle().await;

    // 2. The leader's database session is killed by the server.
    println!("2. the server terminates node-{leader}'s session (pg_terminate_backend)...");
    let t = Instant::now();
    admin
        .execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1",
            &[&format!("quickstart-node-{leader}")],
        )
        .await?;
    let (next, took) = wait_leader(&mut events, Some(t)).await?;
    println!(
        "   node-{leader} revoked its lease at once; node-{next} took over after {} (waiters poll every 300 ms).\n",
        ms(took)
    );
    leader = next;
    settle().await;

    // 3. The leader's process shuts down (as on SIGTERM).
    println!("3. node-{leader} shuts down (manager.shutdown(): revoke, release, announce)...");
    let t = Instant::now();
    managers[leader - 1].shutdown().await;
    let (next, took) = wait_leader(&mut events, Some(t)).await?;
    println!("   node-{next} took over after {}.\n", ms(took));

    for m in &managers {
        m.shutdown().await;
    }
    println!(
        "Done in {:.1} s. At no point did two nodes hold the lock: each takeover happened only after the previous holder released it or lost its session.",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

async fn node_loop(
    node: usize,
    manager: LockManager,
    step_down: Arc<Notify>,
    tx: mpsc::UnboundedSender<Event>,
) {
    loop {
        let lease = match manager.acquire(LOCK).await {
            Ok(lease) => lease,
            Err(chosen_core::Error::Closed) => return,
            Err(e) => {
                eprintln!("   node-{node}: {e}");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        let _ = tx.send(Event::Leading {
            node,
            token: lease.fencing_token(),
        });
        tokio::select! {
            reason = lease.lost() => {
                let _ = tx.send(Event::Lost { node, reason: reason.to_string() });
                // Give the others a chance before contending again.
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            () = step_down.notified() => {
                let _ = lease.release().await;
                // Let another node win this round.
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
        }
    }
}

async fn wait_leader(
    events: &mut mpsc::UnboundedReceiver<Event>,
    since: Option<Instant>,
) -> Result<(usize, Duration), Box<dyn Error>> {
    let deadline = Duration::from_secs(30);
    loop {
        match tokio::time::timeout(deadline, events.recv()).await {
            Ok(Some(Event::Leading { node, token })) => {
                println!("   [event] node-{node} acquired the lock, fencing token {token}");
                return Ok((node, since.map(|t| t.elapsed()).unwrap_or_default()));
            }
            Ok(Some(Event::Lost { node, reason })) => {
                println!("   [event] node-{node} lost the lock: {reason}");
            }
            Ok(None) => return Err("all nodes stopped".into()),
            Err(_) => return Err("no node acquired the lock within 30 s".into()),
        }
    }
}

/// Lets every node that is not leading get back in line.
async fn settle() {
    tokio::time::sleep(Duration::from_millis(2500)).await;
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}
