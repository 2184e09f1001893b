//! Three real nodes serving HTTP on loopback; exactly one answers the leader-only route.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::post;
use chosen_core::{ConnectionState, Election, LockManager, ManagerOptions};
use chosen_tests::{PgCluster, connect_admin, unique_name};
use chosen_tower::{LeaderHealth, LeaderOnlyHttpLayer};
use tower::Layer;

/// A minimal HTTP/1.1 client: (status, x-chosen-leader).
async fn http(addr: SocketAddr, method: &str, path: &str) -> (u16, Option<String>) {
    let r = chosen_tests::http_request_async(addr, method, path)
        .await
        .unwrap();
    let leader = r.header("x-chosen-leader").map(str::to_owned);
    (r.status, leader)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_one_node_serves_the_leader_only_route() {
    let pg = PgCluster::start().unwrap();
    let name = unique_name("admin-routes");
    let mut nodes = Vec::new();
    for i in 0..3 {
        let node_id = format!("web-{i}");
        let manager = LockManager::connect(
            ManagerOptions::from_url(&pg.url())
                .unwrap()
                .node_id(&node_id)
                .poll_interval(Duration::from_millis(100)),
        )
        .await
        .unwrap();
        let election = Election::start(&manager, name.as_str()).unwrap();
        let leadership = election.leadership();
        let app = Router::new()
            .route(
                "/admin",
                post(|| async { "done" }).route_layer(LeaderOnlyHttpLayer::new(leadership.clone())),
            )
            .route_service("/leader", LeaderHealth::new(leadership));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        nodes.push((node_id, manager, election, addr));
    }

    // Wait until one leads and the followers know who (refreshed every 2 s).
    let deadline = Instant::now() + Duration::from_secs(15);
    let leader = loop {
        let mut oks = Vec::new();
        let mut named = 0;
        for (id, _, _, addr) in &nodes {
            let (status, leader) = http(*addr, "POST", "/admin").await;
            if status == 200 {
                oks.push(id.clone());
            } else {
                assert_eq!(status, 503);
                named += usize::from(leader.is_some());
            }
        }
        assert!(
            oks.len() <= 1,
            "two nodes served the leader-only route: {oks:?}"
        );
        if oks.len() == 1 && named == 2 {
            break oks[0].clone();
        }
        assert!(Instant::now() < deadline, "no stable leader: {oks:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    for (id, _, _, addr) in &nodes {
        let (status, named) = http(*addr, "GET", "/leader").await;
        assert_eq!(status, if *id == leader { 200 } else { 503 });
        assert_eq!(named.as_deref(), Some(leader.as_str()));
    }

    // Kill the leader's session: the 200 moves to another node, never two at once.
    let index = nodes.iter().position(|n| n.0 == leader).unwrap();
    let pid = match nodes[index].1.connection_status() {
        ConnectionState::Connected { backend_pid, .. } => backend_pid,
        other => panic!("{other:?}"),
    };
    let admin = connect_admin(&pg.url()).await.unwrap();
    admin
        .execute("SELECT pg_terminate_backend($1)", &[&pid])
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let mut oks = Vec::new();
        for (id, _, _, addr) in &nodes {
            if http(*addr, "POST", "/admin").await.0 == 200 {
                oks.push(id.clone());
            }
        }
        assert!(
            oks.len() <= 1,
            "two nodes served the leader-only route: {oks:?}"
        );
        if oks.len() == 1 && oks[0] != leader {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "leadership did not move: {oks:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `LeaderOnlyHttpLayer::elect`: the election the layer started lives on in the
/// services built from it after the layer is gone, and ends (releasing the lock) when
/// the router holding them is dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_elected_layer_leads_while_its_routes_live() {
    let pg = PgCluster::start().unwrap();
    let name = unique_name("elected-route");
    let options = |node: &str| {
        ManagerOptions::from_url(&pg.url())
            .unwrap()
            .node_id(node)
            .poll_interval(Duration::from_millis(100))
            .term_grant_delay(Duration::ZERO)
    };
    let manager = LockManager::connect(options("web-elected")).await.unwrap();
    // The layer is a temporary: only the service built from it remains. (A layer given
    // to a handler's `route_layer` would be kept by axum until the router is finalised.)
    let gated = LeaderOnlyHttpLayer::elect(&manager, name.as_str())
        .unwrap()
        .layer(post(|| async { "done" }));
    let app = Router::new().route_service("/admin", gated);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move { axum::serve(listener, app).await });

    let deadline = Instant::now() + Duration::from_secs(15);
    while http(addr, "POST", "/admin").await.0 != 200 {
        assert!(
            Instant::now() < deadline,
            "the elected layer never led: its election ended with the layer?"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let other = LockManager::connect(options("web-other")).await.unwrap();
    assert!(
        other.try_acquire(name.as_str()).await.unwrap().is_none(),
        "the route leads, so the lock is held"
    );

    // The router goes, and the election with it: the lock is released.
    server.abort();
    let _ = server.await;
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        if let Some(lease) = other.try_acquire(name.as_str()).await.unwrap() {
            lease.release().await.unwrap();
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the lock outlived the router that held its election"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
