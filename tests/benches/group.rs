//! Singleton groups, measured: how a group of 200 members settles on 5 nodes, what it
//! costs the database per second once settled (counted by `pg_stat_statements`), how
//! many members move when a sixth node joins, and how fast a leaving node's members are
//! running elsewhere.
//!
//! ```text
//! cargo bench -p chosen-tests --bench group
//! ```
//!
//! Prints Markdown for `BENCHMARKS.md`.

#![allow(missing_docs)] // a benchmark binary

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chosen_core::{GroupOptions, LockManager, ManagerOptions, SingletonGroup};
use chosen_tests::PgCluster;

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// Which node runs each member's child right now.
type Running = Arc<Mutex<HashMap<String, String>>>;

const MEMBERS: usize = 200;
const NODES: usize = 5;

struct Node {
    id: String,
    manager: LockManager,
    group: SingletonGroup,
}

async fn node(url: &str, id: &str, members: &[String], running: &Running) -> Res<Node> {
    let manager = LockManager::connect(
        ManagerOptions::from_url(url)?
            .node_id(id)
            .term_grant_delay(Duration::ZERO),
    )
    .await?;
    let running = Arc::clone(running);
    let me = id.to_owned();
    let group = SingletonGroup::start(
        &manager,
        "bench-group",
        members.to_vec(),
        GroupOptions::default(),
        move |member, ctx| {
            let running = Arc::clone(&running);
            let me = me.clone();
            async move {
                running.lock().unwrap().insert(member.clone(), me);
                ctx.cancelled().await;
                running.lock().unwrap().remove(&member);
                Ok::<(), std::io::Error>(())
            }
        },
    )?;
    Ok(Node {
        id: id.to_owned(),
        manager,
        group,
    })
}

/// Children running per node, from the children themselves.
fn loads(nodes: &[Node], running: &Running) -> Vec<usize> {
    let running = running.lock().unwrap();
    nodes
        .iter()
        .map(|n| running.values().filter(|v| **v == n.id).count())
        .collect()
}

async fn settle(nodes: &[Node], running: &Running, max: usize) -> Duration {
    let t0 = Instant::now();
    while !(running.lock().unwrap().len() == MEMBERS
        && loads(nodes, running).iter().all(|l| *l <= max))
    {
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "no settle: {:?}",
            loads(nodes, running)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    t0.elapsed()
}

async fn calls(admin: &tokio_postgres::Client) -> Res<i64> {
    Ok(admin
        .query_one(
            "SELECT coalesce(sum(calls), 0)::int8 FROM pg_stat_statements WHERE query NOT LIKE '%pg_stat_statements%'",
            &[],
        )
        .await?
        .get(0))
}

#[tokio::main]
async fn main() -> Res<()> {
    let pg = PgCluster::builder()
        .setting("shared_preload_libraries", "pg_stat_statements")
        .start()?;
    let url = pg.url();
    let admin = chosen_tests::connect_admin(&url).await?;
    admin
        .batch_execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        .await?;
    let members: Vec<String> = (0..MEMBERS).map(|i| format!("bench-member-{i}")).collect();
    let running = Arc::new(Mutex::new(HashMap::new()));
    let mut nodes = Vec::new();
    for i in 0..NODES {
        nodes.push(node(&url, &format!("bench-{i}"), &members, &running).await?);
    }
    let settled = settle(&nodes, &running, MEMBERS.div_ceil(NODES)).await;
    let at_start = loads(&nodes, &running);
    // The steady cost: every statement of every node, over 10 s.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let c0 = calls(&admin).await?;
    let t0 = Instant::now();
    tokio::time::sleep(Duration::from_secs(10)).await;
    let per_second = (calls(&admin).await? - c0) as f64 / t0.elapsed().as_secs_f64();

    // A sixth node joins.
    let moved0: u64 = nodes.iter().map(|n| n.group.status().handed_over).sum();
    nodes.push(node(&url, "bench-5", &members, &running).await?);
    let join = settle(&nodes, &running, MEMBERS.div_ceil(NODES + 1)).await;
    let moves: u64 = nodes
        .iter()
        .map(|n| n.group.status().handed_over)
        .sum::<u64>()
        - moved0;
    let after_join = loads(&nodes, &running);

    // One leaves gracefully.
    let leaving = nodes.remove(0);
    let t_leave = Instant::now();
    leaving.group.shutdown().await;
    leaving.manager.shutdown().await;
    settle(&nodes, &running, MEMBERS.div_ceil(NODES)).await;
    let leave = t_leave.elapsed();
    let after_leave = loads(&nodes, &running);

    println!("## Singleton groups (`cargo bench -p chosen-tests --bench group`)\n");
    println!(
        "{MEMBERS} members, {NODES} nodes (one process, one manager each), group interval 1 s; statements counted by `pg_stat_statements`.\n"
    );
    println!("| measure | value |\n|---|---|");
    println!(
        "| settled (every member running, none above ceil(M/N)) | {} ms, loads {at_start:?} |",
        settled.as_millis()
    );
    println!(
        "| steady cost, all nodes | {per_second:.1} statements/s ({:.1} per node) |",
        per_second / NODES as f64
    );
    println!(
        "| a sixth node joins | settled in {} ms, {moves} members moved, loads {after_join:?} |",
        join.as_millis()
    );
    println!(
        "| a node leaves (graceful) | settled in {} ms, loads {after_leave:?} |",
        leave.as_millis()
    );
    for n in &nodes {
        n.group.shutdown().await;
        n.manager.shutdown().await;
    }
    Ok(())
}
