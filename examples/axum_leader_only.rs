//! A real axum server with public routes, a leader-only route and a leader health
//! endpoint. Run several (with the same `DATABASE_URL`) and only one answers the admin
//! route.
//!
//! ```text
//! DATABASE_URL=postgres://... cargo run --example axum_leader_only -- --node-id web-1 --port 8081
//! curl -i -X POST localhost:8081/admin/run-report   # 200 on the leader, 503 elsewhere
//! curl -i localhost:8081/leader                      # 200 on the leader, 503 elsewhere
//! ```
//!
//! Without `DATABASE_URL` it starts a throwaway cluster (so it is the only node).
//! Ctrl-C hands leadership over gracefully.

use std::error::Error;
use std::net::SocketAddr;

use axum::Router;
use axum::routing::{get, post};
use chosen_core::{Election, LockManager, ManagerOptions};
use chosen_tower::{LeaderHealth, LeaderOnlyHttpLayer};

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    let mut node_id = format!("web-{}", std::process::id());
    let mut port = 0u16;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        match flag.as_str() {
            "--node-id" => node_id = args.next().ok_or("--node-id needs a value")?,
            "--port" => port = args.next().ok_or("--port needs a value")?.parse()?,
            other => return Err(format!("unknown flag {other:?}").into()),
        }
    }
    let (url, _cluster) = match std::env::var("DATABASE_URL") {
        Ok(url) if !url.is_empty() => (url, None),
        _ => {
            let cluster = chosen_tests::PgCluster::start_local()?;
            (cluster.url(), Some(cluster))
        }
    };
    let manager = LockManager::connect(ManagerOptions::from_url(&url)?.node_id(&node_id)).await?;
    let election = Election::start(&manager, "admin-routes")?;
    let leadership = election.leadership();

    let app = Router::new()
        .route("/", get(|| async { "served by every replica\n" }))
        .route(
            "/admin/run-report",
            post(|| async { "report started on the leader\n" })
                .route_layer(LeaderOnlyHttpLayer::new(leadership.clone())),
        )
        .route_service("/leader", LeaderHealth::new(leadership));

    let listener = tokio::net::TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], port))).await?;
    println!("{node_id} listening on http://{}", listener.local_addr()?);
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    election.shutdown().await;
    manager.shutdown().await;
    Ok(())
}
