//! The layer with a hand-set leadership: no database needed. (Readiness and
//! backpressure: `readiness.rs`; a lease lost for real: `busy_inner.rs`,
//! `lost_in_flight.rs`.)

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::routing::{get, post};
use axum::{Extension, Router};
use chosen_core::Leadership;
use chosen_tower::{
    FollowerContext, LEADER_HEADER, LeaderHealth, LeaderOnlyHttpLayer, Redirect, Tenure, Tenures,
};
use http::{Method, Request, Response, StatusCode, Uri};
use tokio::sync::{Notify, mpsc};
use tower::{Layer, Service, ServiceExt, service_fn};

fn request(method: Method, path: &str) -> Request<Body> {
    Request::builder()
        .method(method)
        .uri(path)
        .body(Body::empty())
        .unwrap()
}

fn echo() -> impl Service<Request<Body>, Response = Response<Body>, Error = Infallible> + Clone {
    service_fn(|_req: Request<Body>| async {
        Ok::<_, Infallible>(Response::new(Body::from("inner")))
    })
}

async fn body_text(res: Response<Body>) -> String {
    let bytes = http_body_util::BodyExt::collect(res.into_body())
        .await
        .unwrap()
        .to_bytes();
    String::from_utf8(bytes.to_vec()).unwrap()
}

#[tokio::test]
async fn leader_passes_follower_answers_503_with_retry_after() {
    let (leadership, control) = Leadership::manual("admin", "node-1");
    let svc = LeaderOnlyHttpLayer::new(leadership).layer(echo());

    control.lead(7);
    let res = svc
        .clone()
        .oneshot(request(Method::GET, "/"))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(body_text(res).await, "inner");

    control.follow(None);
    let res = svc
        .clone()
        .oneshot(request(Method::GET, "/"))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(res.headers()["retry-after"], "1");
    assert!(res.headers().get(LEADER_HEADER).is_none());
    assert_eq!(body_text(res).await, "");

    control.follow(Some("node-2"));
    let res = svc.oneshot(request(Method::GET, "/")).await.unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(res.headers()[LEADER_HEADER], "node-2");
}

#[tokio::test]
async fn retry_after_rounds_up_to_whole_seconds() {
    let (leadership, _control) = Leadership::manual("admin", "node-1");
    let svc = LeaderOnlyHttpLayer::new(leadership)
        .retry_after(Duration::from_millis(2500))
        .layer(echo());
    let res = svc.oneshot(request(Method::GET, "/")).await.unwrap();
    assert_eq!(res.headers()["retry-after"], "3");
}

/// A layer that redirects followers to `http://<leader>.internal:8080`.
fn redirect_to_the_leader(
    leadership: Leadership,
) -> LeaderOnlyHttpLayer<Redirect<impl Fn(&str, &Uri) -> Option<Uri> + Clone + Send + Sync>> {
    LeaderOnlyHttpLayer::new(leadership).redirect(|leader, uri| {
        format!("http://{leader}.internal:8080{}", uri.path_and_query()?)
            .parse()
            .ok()
    })
}

/// The echo service behind [`redirect_to_the_leader`].
fn redirecting(
    leadership: Leadership,
) -> impl Service<Request<Body>, Response = Response<Body>, Error = Infallible> + Clone {
    redirect_to_the_leader(leadership).layer(echo())
}

#[tokio::test]
async fn redirect_to_the_leader_or_503_when_unknown() {
    let (leadership, control) = Leadership::manual("admin", "node-1");
    let svc = redirecting(leadership);
    control.follow(Some("node-3"));
    let res = svc
        .clone()
        .oneshot(request(Method::POST, "/admin/run?now=1"))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::TEMPORARY_REDIRECT);
    assert_eq!(
        res.headers()["location"],
        "http://node-3.internal:8080/admin/run?now=1"
    );
    assert_eq!(res.headers()[LEADER_HEADER], "node-3");

    control.follow(None);
    let res = svc
        .oneshot(request(Method::POST, "/admin/run"))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
}

#[tokio::test]
async fn a_follower_never_redirects_to_itself() {
    // Told (by whatever source) that this very node leads while it follows, the layer
    // answers as when the leader is unknown, not with a redirect back to itself.
    let (leadership, control) = Leadership::manual("admin", "node-1");
    let svc = redirecting(leadership);
    control.follow(Some("node-1"));
    let res = svc
        .oneshot(request(Method::POST, "/admin/run"))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(res.headers().get(LEADER_HEADER).is_none());
}

#[tokio::test]
async fn custom_answers() {
    let (leadership, control) = Leadership::manual("admin", "node-1");
    let svc = LeaderOnlyHttpLayer::new(leadership)
        .respond_with(|ctx: &FollowerContext<'_>| {
            let mut res = Response::new(Body::from(format!(
                "ask {} for {}",
                ctx.leader.unwrap_or("nobody"),
                ctx.uri.path()
            )));
            *res.status_mut() = StatusCode::MISDIRECTED_REQUEST;
            res
        })
        .layer(echo());
    control.follow(Some("node-9"));
    let res = svc.oneshot(request(Method::GET, "/x")).await.unwrap();
    assert_eq!(res.status(), StatusCode::MISDIRECTED_REQUEST);
    assert_eq!(res.headers()[LEADER_HEADER], "node-9");
    assert_eq!(body_text(res).await, "ask node-9 for /x");
}

/// A handler that reports each request's tenure, then waits for `finish` (with a flag
/// set when its future is dropped).
fn waiting_handler(
    finish: Arc<Notify>,
    dropped: Arc<AtomicUsize>,
) -> (
    impl Service<Request<Body>, Response = Response<Body>, Error = Infallible, Future: Send>
    + Clone
    + Send
    + 'static,
    mpsc::UnboundedReceiver<Tenure>,
) {
    struct CountDrop(Arc<AtomicUsize>);
    impl Drop for CountDrop {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
    let (tx, rx) = mpsc::unbounded_channel();
    let svc = service_fn(move |req: Request<Body>| {
        let (tx, finish, dropped) = (tx.clone(), Arc::clone(&finish), Arc::clone(&dropped));
        async move {
            let _count = CountDrop(dropped);
            tx.send(req.extensions().get::<Tenure>().cloned().unwrap())
                .unwrap();
            finish.notified().await;
            Ok::<_, Infallible>(Response::new(Body::from("inner")))
        }
    });
    (svc, rx)
}

/// The tenure the waiting handler was called with next: fails, rather than hangs, if
/// the layer does not call it.
async fn admitted(tenures: &mut mpsc::UnboundedReceiver<Tenure>) -> Tenure {
    tokio::time::timeout(Duration::from_secs(30), tenures.recv())
        .await
        .expect("the handler was not called")
        .unwrap()
}

#[tokio::test]
async fn a_request_in_flight_runs_on_after_the_lease_expires_by_default() {
    let (leadership, control) = Leadership::manual("admin", "node-1");
    control.lead_until(11, Instant::now() + Duration::from_secs(3600));
    let finish = Arc::new(Notify::new());
    let dropped = Arc::new(AtomicUsize::new(0));
    let (handler, mut tenures) = waiting_handler(Arc::clone(&finish), Arc::clone(&dropped));
    let svc = LeaderOnlyHttpLayer::new(leadership).layer(handler);
    let pending = tokio::spawn(svc.oneshot(request(Method::POST, "/hook")));
    let tenure = admitted(&mut tenures).await;
    assert_eq!(tenure.fencing_token().get(), 11);
    assert!(tenure.is_valid());
    control.expire();
    assert!(!tenure.is_valid());
    tokio::time::timeout(Duration::from_secs(30), tenure.lost())
        .await
        .expect("lost() resolves once the lease expired");
    finish.notify_one();
    let res = pending.await.unwrap().unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(body_text(res).await, "inner");
}

#[tokio::test]
async fn cancel_on_loss_answers_as_a_follower_when_the_lease_expires() {
    let (leadership, control) = Leadership::manual("admin", "node-1");
    control.lead_until(12, Instant::now() + Duration::from_secs(3600));
    let finish = Arc::new(Notify::new());
    let dropped = Arc::new(AtomicUsize::new(0));
    let (handler, mut tenures) = waiting_handler(Arc::clone(&finish), Arc::clone(&dropped));
    let svc = LeaderOnlyHttpLayer::new(leadership)
        .cancel_on_loss()
        .layer(handler);
    let pending = tokio::spawn(svc.clone().oneshot(request(Method::POST, "/hook")));
    let tenure = admitted(&mut tenures).await;
    assert_eq!(dropped.load(Ordering::SeqCst), 0);
    control.expire();
    let res = tokio::time::timeout(Duration::from_secs(30), pending)
        .await
        .expect("the request in flight was not cancelled")
        .unwrap()
        .unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(res.headers()["retry-after"], "1");
    assert!(
        res.headers().get(LEADER_HEADER).is_none(),
        "must not name itself"
    );
    assert_eq!(
        dropped.load(Ordering::SeqCst),
        1,
        "the handler's future was dropped"
    );
    assert!(!tenure.is_valid());

    // A request that completes within its term is passed on in cancel mode too.
    control.lead_until(13, Instant::now() + Duration::from_secs(3600));
    let pending = tokio::spawn(svc.oneshot(request(Method::POST, "/hook")));
    let tenure = admitted(&mut tenures).await;
    assert_eq!(tenure.fencing_token().get(), 13);
    finish.notify_one();
    let res = pending.await.unwrap().unwrap();
    assert_eq!(res.status(), StatusCode::OK);
}

#[tokio::test]
async fn cancel_on_loss_answers_as_a_follower_when_the_lease_deadline_passes() {
    let (leadership, control) = Leadership::manual("admin", "node-1");
    let finish = Arc::new(Notify::new());
    let dropped = Arc::new(AtomicUsize::new(0));
    let (handler, mut tenures) = waiting_handler(Arc::clone(&finish), Arc::clone(&dropped));
    let svc = LeaderOnlyHttpLayer::new(leadership)
        .cancel_on_loss()
        .layer(handler);
    // Nothing but the clock ends the term (no state change, no `expire()`): a timer
    // must wake the request in flight. A lease that ended before the request was
    // admitted tests nothing: then again with a longer one.
    for (token, lease) in [(31, 300), (32, 1_000), (33, 5_000)] {
        let deadline = Instant::now() + Duration::from_millis(lease);
        control.lead_until(token, deadline);
        let res = tokio::time::timeout(
            Duration::from_secs(30),
            svc.clone().oneshot(request(Method::POST, "/hook")),
        )
        .await
        .expect("the request in flight was not cancelled when the deadline passed")
        .unwrap();
        assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(
            res.headers().get(LEADER_HEADER).is_none(),
            "must not name itself"
        );
        let Ok(tenure) = tenures.try_recv() else {
            continue; // answered at `call`: the lease had already ended
        };
        assert_eq!(tenure.fencing_token().get(), token);
        assert!(Instant::now() >= deadline, "cancelled before the deadline");
        assert_eq!(
            dropped.load(Ordering::SeqCst),
            1,
            "the handler's future was dropped"
        );
        return;
    }
    panic!("every lease ended before the request was admitted");
}

#[tokio::test]
async fn cancel_on_loss_answers_as_a_follower_even_when_the_node_already_leads_again() {
    let (leadership, control) = Leadership::manual("admin", "node-1");
    control.lead(16);
    let finish = Arc::new(Notify::new());
    let dropped = Arc::new(AtomicUsize::new(0));
    let (handler, mut tenures) = waiting_handler(Arc::clone(&finish), Arc::clone(&dropped));
    let svc = LeaderOnlyHttpLayer::new(leadership.clone())
        .cancel_on_loss()
        .layer(handler);
    let pending = tokio::spawn(svc.clone().oneshot(request(Method::POST, "/hook")));
    assert_eq!(admitted(&mut tenures).await.fencing_token().get(), 16);

    // Lost and led again, in a new term, while the request was in flight: its term is
    // over, so it is answered as a follower, without naming this node.
    control.follow(None);
    control.lead(17);
    let res = tokio::time::timeout(Duration::from_secs(30), pending)
        .await
        .expect("the request in flight was not cancelled")
        .unwrap()
        .unwrap();
    assert!(leadership.is_leader());
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(res.headers()["retry-after"], "1");
    assert!(
        res.headers().get(LEADER_HEADER).is_none(),
        "must not name itself"
    );
    assert_eq!(dropped.load(Ordering::SeqCst), 1);

    // The client's retry is admitted in the new term.
    let pending = tokio::spawn(svc.oneshot(request(Method::POST, "/hook")));
    assert_eq!(admitted(&mut tenures).await.fencing_token().get(), 17);
    finish.notify_one();
    let res = pending.await.unwrap().unwrap();
    assert_eq!(res.status(), StatusCode::OK);
}

#[tokio::test]
async fn cancel_on_loss_redirects_a_request_in_flight_to_the_new_leader() {
    let (leadership, control) = Leadership::manual("admin", "node-1");
    let finish = Arc::new(Notify::new());
    let dropped = Arc::new(AtomicUsize::new(0));
    let (handler, mut tenures) = waiting_handler(Arc::clone(&finish), Arc::clone(&dropped));
    let svc = redirect_to_the_leader(leadership)
        .cancel_on_loss()
        .layer(handler);

    control.lead(18);
    let pending = tokio::spawn(
        svc.clone()
            .oneshot(request(Method::POST, "/admin/run?now=1")),
    );
    assert_eq!(admitted(&mut tenures).await.fencing_token().get(), 18);
    // node-3 takes over while the request is in the handler: the redirect is built from
    // the method, URI and headers the gate kept.
    control.follow(Some("node-3"));
    let res = tokio::time::timeout(Duration::from_secs(30), pending)
        .await
        .expect("the request in flight was not cancelled")
        .unwrap()
        .unwrap();
    assert_eq!(res.status(), StatusCode::TEMPORARY_REDIRECT);
    assert_eq!(
        res.headers()["location"],
        "http://node-3.internal:8080/admin/run?now=1"
    );
    assert_eq!(res.headers()[LEADER_HEADER], "node-3");
    assert_eq!(body_text(res).await, "");
    assert_eq!(
        dropped.load(Ordering::SeqCst),
        1,
        "the handler's future was dropped"
    );

    // Lost with no leader known yet: the redirect's fallback, `503`.
    control.lead(19);
    let pending = tokio::spawn(svc.oneshot(request(Method::POST, "/admin/run")));
    assert_eq!(admitted(&mut tenures).await.fencing_token().get(), 19);
    control.follow(None);
    let res = tokio::time::timeout(Duration::from_secs(30), pending)
        .await
        .expect("the request in flight was not cancelled")
        .unwrap()
        .unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(res.headers()["retry-after"], "1");
    assert!(res.headers().get(LEADER_HEADER).is_none());
    assert_eq!(dropped.load(Ordering::SeqCst), 2);
}

/// A handler that loses the lease in its last step (the poll that completes it) and
/// answers `200`.
fn loses_the_lease_in_its_last_step(
    control: chosen_core::ManualLeadership,
    handled: Arc<AtomicUsize>,
) -> impl Service<Request<Body>, Response = Response<Body>, Error = Infallible> + Clone {
    service_fn(move |req: Request<Body>| {
        let (control, handled) = (control.clone(), Arc::clone(&handled));
        async move {
            let tenure = req.extensions().get::<Tenure>().cloned().unwrap();
            tokio::task::yield_now().await;
            control.expire();
            assert!(!tenure.is_valid());
            handled.fetch_add(1, Ordering::SeqCst);
            Ok::<_, Infallible>(Response::new(Body::from("written after the loss")))
        }
    })
}

#[tokio::test]
async fn cancel_on_loss_answers_as_a_follower_when_the_term_ends_in_the_handlers_last_poll() {
    let (leadership, control) = Leadership::manual("admin", "node-1");
    let handled = Arc::new(AtomicUsize::new(0));
    let inner = loses_the_lease_in_its_last_step(control.clone(), Arc::clone(&handled));

    // Cancel mode: the response was not completed while the tenure was valid.
    control.lead_until(14, Instant::now() + Duration::from_secs(3600));
    let svc = LeaderOnlyHttpLayer::new(leadership.clone())
        .cancel_on_loss()
        .layer(inner.clone());
    let res = tokio::time::timeout(
        Duration::from_secs(30),
        svc.oneshot(request(Method::POST, "/hook")),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(
        res.headers().get(LEADER_HEADER).is_none(),
        "must not name itself"
    );
    assert_eq!(
        handled.load(Ordering::SeqCst),
        1,
        "the handler's last step ran"
    );

    // By default the handler's answer is passed on, whenever it completed.
    control.lead_until(15, Instant::now() + Duration::from_secs(3600));
    let svc = LeaderOnlyHttpLayer::new(leadership).layer(inner);
    let res = tokio::time::timeout(
        Duration::from_secs(30),
        svc.oneshot(request(Method::POST, "/hook")),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(body_text(res).await, "written after the loss");
    assert_eq!(handled.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn behind_gates_on_two_locks_the_handler_gets_each_gates_tenure() {
    let (billing, billing_control) = Leadership::manual("billing", "node-1");
    let (ledger, ledger_control) = Leadership::manual("ledger", "node-1");
    billing_control.lead(21);
    ledger_control.lead(34);
    let handler = |Extension(tenure): Extension<Tenure>, Extension(tenures): Extension<Tenures>| async move {
        let each: Vec<_> = tenures
            .iter()
            .map(|t| format!("{}={}", t.name(), t.fencing_token().get()))
            .collect();
        let billing = tenures.get("billing").map(|t| t.fencing_token().get());
        let ledger = tenures.get("ledger").map(|t| t.fencing_token().get());
        format!(
            "nearest {}; each {}; billing {billing:?}; ledger {ledger:?}",
            tenure.name(),
            each.join(",")
        )
    };
    let app = Router::new()
        .route(
            "/close",
            post(handler).route_layer(LeaderOnlyHttpLayer::new(ledger.clone())),
        )
        .route_layer(LeaderOnlyHttpLayer::new(billing))
        .route(
            "/ledger",
            post(handler).route_layer(LeaderOnlyHttpLayer::new(ledger)),
        );
    let res = app
        .clone()
        .oneshot(request(Method::POST, "/close"))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(
        body_text(res).await,
        "nearest ledger; each billing=21,ledger=34; billing Some(21); ledger Some(34)"
    );
    // Behind one gate: `Tenures` holds just its tenure.
    let res = app.oneshot(request(Method::POST, "/ledger")).await.unwrap();
    assert_eq!(
        body_text(res).await,
        "nearest ledger; each ledger=34; billing None; ledger Some(34)"
    );
}

#[tokio::test]
async fn axum_route_layer_versus_layer() {
    let (leadership, control) = Leadership::manual("admin", "node-1");
    control.follow(Some("node-2"));
    let gated = || LeaderOnlyHttpLayer::new(leadership.clone());

    // Router::route_layer: 404 kept; wrong method on the gated path -> 503.
    let app = Router::new()
        .route("/admin", post(|| async { "ok" }))
        .route_layer(gated());
    let status =
        |app: Router, m, p| async move { app.oneshot(request(m, p)).await.unwrap().status() };
    assert_eq!(
        status(app.clone(), Method::GET, "/nope").await,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        status(app.clone(), Method::POST, "/admin").await,
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert_eq!(
        status(app, Method::GET, "/admin").await,
        StatusCode::SERVICE_UNAVAILABLE
    );

    // A method router's route_layer: 405 kept.
    let app = Router::new().route("/admin", post(|| async { "ok" }).route_layer(gated()));
    assert_eq!(
        status(app.clone(), Method::GET, "/admin").await,
        StatusCode::METHOD_NOT_ALLOWED
    );
    assert_eq!(
        status(app, Method::POST, "/admin").await,
        StatusCode::SERVICE_UNAVAILABLE
    );

    // Router::layer also wraps the fallback: unknown paths answer 503 on followers.
    let app = Router::new()
        .route("/admin", post(|| async { "ok" }))
        .layer(gated());
    assert_eq!(
        status(app, Method::GET, "/nope").await,
        StatusCode::SERVICE_UNAVAILABLE
    );

    // On the leader everything reaches the handlers.
    control.lead(1);
    let app = Router::new()
        .route("/admin", post(|| async { "ok" }))
        .route("/public", get(|| async { "hi" }))
        .route_layer(gated());
    assert_eq!(
        status(app.clone(), Method::POST, "/admin").await,
        StatusCode::OK
    );
    assert_eq!(status(app, Method::GET, "/public").await, StatusCode::OK);
}

#[tokio::test]
async fn health_endpoint() {
    let (leadership, control) = Leadership::manual("admin", "node-1");
    let app = Router::new().route_service("/leader", LeaderHealth::new(leadership));
    control.lead(3);
    let res = app
        .clone()
        .oneshot(request(Method::GET, "/leader"))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(res.headers()[LEADER_HEADER], "node-1");
    assert_eq!(body_text(res).await, "leader\n");
    control.follow(Some("node-4"));
    let res = app.oneshot(request(Method::GET, "/leader")).await.unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(body_text(res).await, "follower; leader is node-4\n");
}

// The window before the election task notices a lost lease: the state stored still
// says Leading, but the lease deadline has passed. The node must answer as a follower
// that knows no leader: never serve, never name (or redirect to) itself.
#[tokio::test]
async fn an_expired_lease_answers_as_a_follower() {
    let (leadership, control) = Leadership::manual("admin", "node-1");
    let calls = Arc::new(AtomicUsize::new(0));
    let inner = {
        let calls = Arc::clone(&calls);
        service_fn(move |_req: Request<Body>| {
            calls.fetch_add(1, Ordering::SeqCst);
            async { Ok::<_, Infallible>(Response::new(Body::from("inner"))) }
        })
    };
    let svc = LeaderOnlyHttpLayer::new(leadership.clone()).layer(inner);
    let redirecting = LeaderOnlyHttpLayer::new(leadership)
        .redirect(|leader, uri| {
            format!("http://{leader}.internal{}", uri.path_and_query()?)
                .parse()
                .ok()
        })
        .layer(echo());

    control.lead_until(9, Instant::now() + Duration::from_secs(3600));
    let res = svc
        .clone()
        .oneshot(request(Method::POST, "/admin"))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(calls.load(Ordering::SeqCst), 1);

    control.expire();
    let res = svc
        .clone()
        .oneshot(request(Method::POST, "/admin"))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(res.headers()["retry-after"], "1");
    assert!(
        res.headers().get(LEADER_HEADER).is_none(),
        "no leader is known; must not name itself: {:?}",
        res.headers().get(LEADER_HEADER)
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1, "inner service not called");
    let res = redirecting
        .clone()
        .oneshot(request(Method::POST, "/admin"))
        .await
        .unwrap();
    assert_eq!(
        res.status(),
        StatusCode::SERVICE_UNAVAILABLE,
        "no redirect to itself"
    );
    assert!(res.headers().get("location").is_none());

    // Expired from the start (a deadline already passed when leadership was set).
    control.lead_until(10, Instant::now());
    let res = svc.oneshot(request(Method::POST, "/admin")).await.unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(res.headers().get(LEADER_HEADER).is_none());
    assert_eq!(calls.load(Ordering::SeqCst), 1, "inner service not called");
}

#[tokio::test]
async fn health_endpoint_with_an_expired_lease() {
    let (leadership, control) = Leadership::manual("admin", "node-1");
    let app = Router::new().route_service("/leader", LeaderHealth::new(leadership));
    control.lead_until(3, Instant::now() + Duration::from_secs(3600));
    let res = app
        .clone()
        .oneshot(request(Method::GET, "/leader"))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    control.expire();
    let res = app.oneshot(request(Method::GET, "/leader")).await.unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(res.headers().get(LEADER_HEADER).is_none());
    assert_eq!(body_text(res).await, "follower; no known leader\n");
}
