//! A service that uses chosen-tower and chosen-apalis together: both gates import side
//! by side (their names differ: `LeaderOnlyHttpLayer`, `LeaderOnlyJobLayer`), gate on one
//! leadership, and agree on who runs what. No database: the leadership is set by hand.

use std::time::{SystemTime, UNIX_EPOCH};

use apalis_core::error::BoxDynError;
use apalis_core::task::Task;
use apalis_core::task::task_fn::task_fn;
use axum::Router;
use axum::body::Body;
use axum::routing::post;
use chosen_apalis::{LeaderOnlyJob, LeaderOnlyJobLayer, Outcome, Tick};
use chosen_core::Leadership;
use chosen_tower::{LeaderOnlyHttp, LeaderOnlyHttpLayer, Reject};
use http::{Request, StatusCode};
use tower::{Layer, ServiceExt};

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

async fn admin_status(app: &Router) -> StatusCode {
    let req = Request::post("/admin").body(Body::empty()).unwrap();
    app.clone().oneshot(req).await.unwrap().status()
}

async fn tick_ran(leadership: &Leadership) -> bool {
    let job = task_fn(|_tick: Tick| async { Ok::<_, BoxDynError>("ran") });
    // Named, to show both service types in one scope.
    let gate: LeaderOnlyJob<_, _> = LeaderOnlyJobLayer::new(leadership.clone()).layer(job);
    let out = gate
        .oneshot(Task::new(Tick::new(now_secs())))
        .await
        .expect("a gate answers Ok");
    matches!(out, Outcome::Ran("ran"))
}

#[tokio::test]
async fn both_gates_import_side_by_side_and_share_one_leadership() {
    let (leadership, control) = Leadership::manual("admin", "node-1");
    let http_gate = LeaderOnlyHttpLayer::new(leadership.clone());
    let _named: LeaderOnlyHttp<(), Reject> = http_gate.clone().layer(());
    let app = Router::new().route("/admin", post(|| async { "done" }).route_layer(http_gate));

    control.follow(Some("node-2"));
    assert_eq!(admin_status(&app).await, StatusCode::SERVICE_UNAVAILABLE);
    assert!(!tick_ran(&leadership).await);

    control.lead(7);
    assert_eq!(admin_status(&app).await, StatusCode::OK);
    assert!(tick_ran(&leadership).await);
}

/// The whole of both crates in one scope: names that clash would fail to compile as
/// soon as they are used.
mod globs {
    use chosen_apalis::*;
    use chosen_tower::*;

    #[test]
    fn both_layers_by_glob() {
        let (leadership, _control) = chosen_core::Leadership::manual("admin", "node-1");
        let http: LeaderOnlyHttpLayer = LeaderOnlyHttpLayer::new(leadership.clone());
        let jobs: LeaderOnlyJobLayer = LeaderOnlyJobLayer::new(leadership);
        assert_eq!(http.leadership().name(), jobs.leadership().name());
    }
}
