//! A busy inner service behind the layer, with a real lease: a follower answers at
//! once, while the leader still waits for the inner service's readiness.

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Wake, Waker};
use std::time::Duration;

use axum::body::Body;
use chosen_core::{Election, LockManager};
use chosen_tests::{PgCluster, manager_options, unique_name};
use chosen_tower::LeaderOnlyHttpLayer;
use http::{Method, Request, Response, StatusCode};
use tokio::sync::Notify;
use tokio::time::timeout;
use tower::{Service, ServiceBuilder, ServiceExt, service_fn};

/// How long anything that should happen soon may take on a slow, busy machine.
const PATIENCE: Duration = Duration::from_secs(30);

/// A waker that records that it was woken.
#[derive(Default)]
struct WakeFlag(Notify);

impl Wake for WakeFlag {
    fn wake(self: Arc<Self>) {
        self.0.notify_one();
    }
}

fn post() -> Request<Body> {
    Request::builder()
        .method(Method::POST)
        .uri("/hook")
        .body(Body::empty())
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_answers_at_once_while_the_inner_service_is_busy() {
    let pg = PgCluster::start().unwrap();
    let name = unique_name("busy-inner");
    // A fresh cluster: no holder can be silent across its start, so no grant delay.
    let options = |node: &str| {
        manager_options(&pg.url(), node)
            .poll_interval(Duration::from_millis(100))
            .term_grant_delay(Duration::ZERO)
    };
    let one = LockManager::connect(options("web-1")).await.unwrap();
    let election = Election::start(&one, name.as_str()).unwrap();
    let leadership = election.leadership();
    timeout(PATIENCE, leadership.wait_leading())
        .await
        .expect("web-1 never led");
    let two = LockManager::connect(options("web-2")).await.unwrap();
    let successor = Election::start(&two, name.as_str()).unwrap();

    // The inner service takes one request at a time; the handler keeps it until told.
    let started = Arc::new(Notify::new());
    let finish = Arc::new(Notify::new());
    let handler = {
        let (started, finish) = (Arc::clone(&started), Arc::clone(&finish));
        service_fn(move |_req: Request<Body>| {
            let (started, finish) = (Arc::clone(&started), Arc::clone(&finish));
            async move {
                started.notify_one();
                finish.notified().await;
                Ok::<_, Infallible>(Response::new(Body::from("done")))
            }
        })
    };
    let svc = ServiceBuilder::new()
        .layer(LeaderOnlyHttpLayer::new(leadership.clone()))
        .concurrency_limit(1)
        .service(handler);

    let first = tokio::spawn(svc.clone().oneshot(post()));
    timeout(PATIENCE, started.notified())
        .await
        .expect("the first request never reached the handler");

    // The leader keeps to the inner service's backpressure: the second request waits
    // for the gate's readiness, registered to be woken.
    let mut second = svc.clone();
    let flag = Arc::new(WakeFlag::default());
    let waker = Waker::from(Arc::clone(&flag));
    let mut cx = Context::from_waker(&waker);
    assert!(
        second.poll_ready(&mut cx).is_pending(),
        "the leader's gate was ready while its inner service is busy"
    );

    // The leadership moves to web-2, while the first request still holds the inner
    // service.
    election.hand_over_to("web-2");
    timeout(PATIENCE, successor.leadership().wait_leading())
        .await
        .expect("web-2 never led");
    assert!(!leadership.is_leader());

    // Now a follower: it answers at once, without waiting for the inner service.
    let res = timeout(Duration::from_secs(10), svc.clone().oneshot(post()))
        .await
        .expect("the follower waited for the busy inner service")
        .unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(res.headers()["retry-after"], "1");
    // The request that waited for the inner service's readiness on the leader is woken,
    // ready, and answered as a follower answers, too, now that the term ended.
    timeout(PATIENCE, flag.0.notified())
        .await
        .expect("the request waiting for the leader's readiness was never woken");
    assert!(
        second.poll_ready(&mut cx).is_ready(),
        "a request whose term ended still waits for the inner service"
    );
    let res = second.call(post()).await.unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);

    // The request in flight runs to completion (the default).
    finish.notify_one();
    let res = timeout(PATIENCE, first)
        .await
        .expect("the first request never finished")
        .unwrap()
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);

    successor.shutdown().await;
    election.shutdown().await;
    two.shutdown().await;
    one.shutdown().await;
}
