//! One `LockManager`, a `Singleton` whose child runs on exactly one process of the
//! fleet, and an `Election` that tells every process who leads. Run it in two terminals
//! with one `DATABASE_URL` and stop the leader with Ctrl-C. Without `DATABASE_URL` it
//! starts a throwaway PostgreSQL server first (`examples/common`, not chosen's API).

use chosen_core::{Election, LockManager, ManagerOptions, Singleton, SingletonOptions};

#[path = "common/mod.rs"]
mod common;

// One thread: no other task runs between reading the leader and waiting for a change.
#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // chosen reports through `tracing`; its info lines say why a first grant waits.
    tracing_subscriber::fmt().with_env_filter("info").init();
    let (url, _server) = common::database_url()?;

    let manager = LockManager::connect(ManagerOptions::from_url(&url)?).await?;
    println!("connected as node {}", manager.node_id());

    // Runs on one process at a time; restarted if it fails, moved if this one dies.
    let options = SingletonOptions::default();
    let report = Singleton::start(&manager, "nightly-report", options, |ctx| async move {
        println!(
            "running nightly-report here, fencing token {}",
            ctx.fencing_token()
        );
        ctx.cancelled().await; // the lease is lost or we shut down: stop now
        println!("nightly-report stopped here");
        Ok::<(), std::io::Error>(())
    })?;

    // An election only tells who leads: gate routes or jobs with `is_leader()`.
    let election = Election::start(&manager, "admin")?;
    let leadership = election.leadership();
    let mut shown = None;
    loop {
        let leader = leadership.leader(); // this node's id while it leads
        if leader != shown {
            let who = match &leader {
                Some(node) if leadership.is_leader() => format!("this node ({node})"),
                Some(node) => node.clone(),
                None => "nobody".to_owned(),
            };
            println!("{who} leads admin");
            shown = leader;
        }
        tokio::select! {
            _ = leadership.changed() => {}
            _ = tokio::signal::ctrl_c() => break,
        }
    }

    // Stops the child, then releases the locks, announced: the next node takes over at once.
    manager.shutdown().await;
    drop(report);
    Ok(())
}
