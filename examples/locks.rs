//! The cluster view: every advisory lock held in the database, with its holder.
//!
//! ```text
//! DATABASE_URL=postgres://... cargo run --example locks -- [--name NAME ...] [--namespace NS]
//! ```
//!
//! Lock keys are one-way hashes of the names, so pass the names you want resolved.
//! Without `DATABASE_URL` it starts a throwaway cluster and two demo nodes holding a
//! few locks, so there is something to see.

use std::error::Error;
use std::time::SystemTime;

use chosen_core::{LockManager, ManagerOptions};

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    let mut names = Vec::new();
    let mut namespace = None;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        match flag.as_str() {
            "--name" => names.push(args.next().ok_or("--name needs a value")?),
            "--namespace" => namespace = Some(args.next().ok_or("--namespace needs a value")?),
            other => {
                return Err(
                    format!("unknown flag {other:?}; use --name NAME, --namespace NS").into(),
                );
            }
        }
    }
    let (url, _cluster, _demo) = match std::env::var("DATABASE_URL") {
        Ok(url) if !url.is_empty() => (url, None, Vec::new()),
        _ => {
            println!("No DATABASE_URL: a throwaway cluster with two demo nodes.\n");
            let cluster = chosen_tests::PgCluster::start_local()?;
            let url = cluster.url();
            let mut demo = Vec::new();
            for (node, locks) in [
                ("web-1", vec!["nightly-report", "billing-sync"]),
                ("worker-7", vec!["search-reindex"]),
            ] {
                let m = LockManager::connect(ManagerOptions::from_url(&url)?.node_id(node)).await?;
                for lock in locks {
                    names.push(lock.to_owned());
                    demo.push(m.acquire(lock).await?);
                }
                if node == "web-1" {
                    // A raw bigint key, as another program might take it.
                    demo.push(m.acquire(chosen_core::LockKey::Int(42)).await?);
                }
            }
            (url, Some(cluster), demo)
        }
    };
    let mut options =
        ManagerOptions::from_url(&url)?.node_id(format!("locks-cli-{}", std::process::id()));
    if let Some(ns) = namespace {
        options = options.namespace(ns);
    }
    let manager = LockManager::connect(options).await?;
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    let locks = manager.cluster_locks(&names).await?;
    println!(
        "{:<18} {:<26} {:<12} {:>7} {:<15} {:>12}",
        "lock", "key", "node", "pid", "client", "session age"
    );
    for lock in &locks {
        // Hidden (NULL) for sessions of other roles unless this role has pg_read_all_stats.
        let age = lock
            .holder
            .session_start
            .and_then(|start| SystemTime::now().duration_since(start).ok())
            .map_or_else(|| "?".to_owned(), |d| format!("{:.1} s", d.as_secs_f64()));
        println!(
            "{:<18} {:<26} {:<12} {:>7} {:<15} {:>12}",
            lock.name.as_deref().unwrap_or("?"),
            lock.key.to_string(),
            lock.holder.node_id,
            lock.holder.backend_pid,
            lock.holder.client_addr.as_deref().unwrap_or("local"),
            age
        );
    }
    println!("\n{} lock(s) held.", locks.len());
    manager.shutdown().await;
    Ok(())
}
