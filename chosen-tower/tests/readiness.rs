//! The gate's readiness, with a hand-set leadership: a follower is ready at once, the
//! leader passes the inner service's backpressure on to the layers outside the gate, and
//! readiness reserved while leading (a `ConcurrencyLimit` permit) is used by the
//! request it was reserved for or given back.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use axum::body::Body;
use chosen_core::Leadership;
use chosen_tower::{LEADER_HEADER, LeaderOnlyHttp, LeaderOnlyHttpLayer, Reject, Tenure};
use http::{Request, Response, StatusCode};
use tokio::sync::{Notify, mpsc};
use tokio::time::timeout;
use tower::{BoxError, Layer, Service, ServiceBuilder, ServiceExt, service_fn};

/// How long anything that should happen soon may take on a slow, busy machine.
const PATIENCE: Duration = Duration::from_secs(30);

fn req() -> Request<Body> {
    Request::new(Body::empty())
}

/// A waker that records that it was woken: proves that a pending service or future
/// asked to be woken, and was.
#[derive(Default)]
struct WakeFlag(Notify);

impl Wake for WakeFlag {
    fn wake(self: Arc<Self>) {
        self.0.notify_one();
    }
}

impl WakeFlag {
    fn waker(self: &Arc<Self>) -> Waker {
        Waker::from(Arc::clone(self))
    }

    async fn woken(&self, what: &str) {
        timeout(PATIENCE, self.0.notified())
            .await
            .unwrap_or_else(|_| panic!("never woken: {what}"));
    }
}

/// An inner service that is never ready, and counts how often its readiness was polled.
#[derive(Clone, Default)]
struct NeverReady(Arc<AtomicUsize>);

impl Service<Request<Body>> for NeverReady {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = std::future::Ready<Result<Response<Body>, Infallible>>;
    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.0.fetch_add(1, Ordering::SeqCst);
        Poll::Pending
    }
    fn call(&mut self, _req: Request<Body>) -> Self::Future {
        unreachable!("never ready, so never called")
    }
}

/// A handler that reports each request's tenure, then answers once `finish` is
/// notified; `dropped` counts its futures dropped (completed or cancelled).
#[derive(Clone, Default)]
struct Handler {
    finish: Arc<Notify>,
    dropped: Arc<AtomicUsize>,
}

impl Handler {
    fn service(
        &self,
    ) -> (
        impl Service<Request<Body>, Response = Response<Body>, Error = Infallible, Future: Send>
        + Clone
        + Send
        + Sync
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
        let this = self.clone();
        let svc = service_fn(move |req: Request<Body>| {
            let (tx, this) = (tx.clone(), this.clone());
            async move {
                let _count = CountDrop(this.dropped);
                let tenure = req.extensions().get::<Tenure>().cloned().unwrap();
                let token = tenure.fencing_token().get();
                tx.send(tenure).unwrap();
                this.finish.notified().await;
                Ok::<_, Infallible>(Response::new(Body::from(format!("token {token}"))))
            }
        });
        (svc, rx)
    }
}

async fn body_text(res: Response<Body>) -> String {
    let bytes = http_body_util::BodyExt::collect(res.into_body())
        .await
        .unwrap()
        .to_bytes();
    String::from_utf8(bytes.to_vec()).unwrap()
}

/// Polls `svc`'s readiness once, with `cx`.
fn poll_ready<S: Service<Request<Body>>>(svc: &mut S, cx: &mut Context<'_>) -> Poll<()> {
    svc.poll_ready(cx).map(|r| {
        assert!(r.is_ok(), "the service failed");
    })
}

#[tokio::test]
async fn a_follower_is_ready_at_once_and_never_polls_a_never_ready_inner_service() {
    let (leadership, control) = Leadership::manual("admin", "node-1");
    control.follow(Some("node-2"));
    let polls = NeverReady::default();
    let mut svc = LeaderOnlyHttpLayer::new(leadership).layer(polls.clone());
    let mut cx = Context::from_waker(Waker::noop());
    assert!(poll_ready(&mut svc, &mut cx).is_ready());
    let res = svc.call(req()).await.unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(res.headers()[LEADER_HEADER], "node-2");
    assert_eq!(
        polls.0.load(Ordering::SeqCst),
        0,
        "the inner service was polled"
    );
}

#[tokio::test]
async fn the_leaders_poll_ready_waits_for_the_inner_service_until_the_term_ends() {
    let (leadership, control) = Leadership::manual("admin", "node-1");
    control.lead(1);
    let polls = NeverReady::default();
    let mut svc = LeaderOnlyHttpLayer::new(leadership).layer(polls.clone());
    let flag = Arc::new(WakeFlag::default());
    let waker = flag.waker();
    let mut cx = Context::from_waker(&waker);
    assert!(poll_ready(&mut svc, &mut cx).is_pending());
    assert!(poll_ready(&mut svc, &mut cx).is_pending());
    assert_eq!(
        polls.0.load(Ordering::SeqCst),
        2,
        "the leader keeps to the inner's readiness"
    );

    // The term ends: the waiting caller is woken, and the gate is ready as a follower.
    control.follow(Some("node-2"));
    flag.woken("the term ended while poll_ready waited").await;
    assert!(poll_ready(&mut svc, &mut cx).is_ready());
    let res = svc.call(req()).await.unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(res.headers()[LEADER_HEADER], "node-2");
    assert_eq!(polls.0.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn the_leaders_poll_ready_turns_ready_when_the_lease_deadline_passes() {
    let (leadership, control) = Leadership::manual("admin", "node-1");
    let mut svc = LeaderOnlyHttpLayer::new(leadership).layer(NeverReady::default());
    let flag = Arc::new(WakeFlag::default());
    let waker = flag.waker();
    let mut cx = Context::from_waker(&waker);
    // Nothing but the clock ends the term (no state change, no `expire()`): the gate
    // must be woken by a timer. A lease so short that it ended before the first poll
    // tests nothing: then again with a longer one.
    let mut deadline = None;
    for lease in [300, 1_000, 5_000].map(Duration::from_millis) {
        let until = Instant::now() + lease;
        control.lead_until(1, until);
        if poll_ready(&mut svc, &mut cx).is_pending() {
            deadline = Some(until);
            break;
        }
    }
    let deadline = deadline.expect("every lease ended before poll_ready was polled");
    flag.woken("the lease deadline passed while poll_ready waited")
        .await;
    assert!(Instant::now() >= deadline, "woken before the deadline");
    assert!(poll_ready(&mut svc, &mut cx).is_ready());
    let res = svc.call(req()).await.unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(
        res.headers().get(LEADER_HEADER).is_none(),
        "must not name itself"
    );
}

#[tokio::test]
async fn load_shed_outside_the_gate_sheds_while_the_leaders_inner_service_is_busy() {
    let (leadership, control) = Leadership::manual("admin", "node-1");
    control.lead(1);
    let handler = Handler::default();
    let (inner, mut admitted) = handler.service();
    let svc = ServiceBuilder::new()
        .load_shed()
        .layer(LeaderOnlyHttpLayer::new(leadership))
        .concurrency_limit(1)
        .service(inner);
    let first = tokio::spawn(svc.clone().oneshot(req()));
    timeout(PATIENCE, admitted.recv())
        .await
        .expect("the first request never reached the handler");

    // The only slot is held: the leader's further requests are shed, not queued.
    for _ in 0..20 {
        let err = timeout(PATIENCE, svc.clone().oneshot(req()))
            .await
            .expect("a request queued behind the busy inner service")
            .expect_err("a request passed a full ConcurrencyLimit");
        assert!(err.is::<tower::load_shed::error::Overloaded>(), "{err}");
    }

    // A follower is never shed: it answers at once, without the inner service.
    control.follow(Some("node-2"));
    let res = timeout(PATIENCE, svc.clone().oneshot(req()))
        .await
        .expect("the follower waited")
        .expect("the follower's answer was shed");
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(res.headers()[LEADER_HEADER], "node-2");

    // The request in flight runs to completion (the default).
    handler.finish.notify_one();
    let res = timeout(PATIENCE, first).await.unwrap().unwrap().unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert!(
        admitted.try_recv().is_err(),
        "only the first request was admitted"
    );
}

#[tokio::test]
async fn a_buffer_outside_the_gate_answers_its_queue_as_a_follower_once_the_term_ends() {
    let (leadership, control) = Leadership::manual("admin", "node-1");
    control.lead(1);
    let handler = Handler::default();
    let (inner, mut admitted) = handler.service();
    let svc = ServiceBuilder::new()
        .buffer(8)
        .layer(LeaderOnlyHttpLayer::new(leadership))
        .concurrency_limit(1)
        .service(inner);
    let first = tokio::spawn(svc.clone().oneshot(req()));
    timeout(PATIENCE, admitted.recv())
        .await
        .expect("the first request never reached the handler");
    // Queued in the buffer, whose worker waits for the gate's readiness.
    let queued: Vec<_> = (0..3)
        .map(|_| tokio::spawn(svc.clone().oneshot(req())))
        .collect();

    control.follow(Some("node-2"));
    for request in queued {
        let res: Result<_, BoxError> = timeout(PATIENCE, request)
            .await
            .expect("a queued request still waits for the busy inner service")
            .unwrap();
        let res = res.unwrap();
        assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(res.headers()[LEADER_HEADER], "node-2");
    }
    assert!(
        admitted.try_recv().is_err(),
        "a queued request reached the handler"
    );
    handler.finish.notify_one();
    let res = timeout(PATIENCE, first).await.unwrap().unwrap().unwrap();
    assert_eq!(res.status(), StatusCode::OK);
}

/// The handler behind the layer, behind a `ConcurrencyLimit` of one.
fn limited(
    layer: LeaderOnlyHttpLayer,
    handler: &Handler,
) -> (
    impl Service<Request<Body>, Response = Response<Body>, Error = Infallible, Future: Send>
    + Clone
    + Send
    + 'static,
    mpsc::UnboundedReceiver<Tenure>,
) {
    let (inner, admitted) = handler.service();
    let svc = ServiceBuilder::new()
        .layer(layer)
        .concurrency_limit(1)
        .service(inner);
    (svc, admitted)
}

#[tokio::test]
async fn an_admitted_request_holds_its_permit_until_it_completes() {
    let (leadership, control) = Leadership::manual("admin", "node-1");
    control.lead(1);
    let handler = Handler::default();
    let (svc, mut admitted) = limited(LeaderOnlyHttpLayer::new(leadership), &handler);
    let first = tokio::spawn(svc.clone().oneshot(req()));
    timeout(PATIENCE, admitted.recv()).await.unwrap().unwrap();

    let mut second = svc.clone();
    let flag = Arc::new(WakeFlag::default());
    let waker = flag.waker();
    let mut cx = Context::from_waker(&waker);
    assert!(
        poll_ready(&mut second, &mut cx).is_pending(),
        "two permits of a ConcurrencyLimit(1)"
    );
    handler.finish.notify_one();
    let res = timeout(PATIENCE, first).await.unwrap().unwrap().unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    flag.woken("the permit came free").await;
    assert!(poll_ready(&mut second, &mut cx).is_ready());
    handler.finish.notify_one();
    let res = timeout(PATIENCE, second.call(req()))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
}

#[tokio::test]
async fn readiness_reserved_while_leading_is_given_back_when_the_term_ends_before_call() {
    let (leadership, control) = Leadership::manual("admin", "node-1");
    control.lead_until(1, Instant::now() + Duration::from_secs(3600));
    let handler = Handler::default();
    let (svc, mut admitted) = limited(LeaderOnlyHttpLayer::new(leadership), &handler);
    let mut cx = Context::from_waker(Waker::noop());

    // `reserved` takes the only permit; `other` waits for it.
    let mut reserved = svc.clone();
    assert!(poll_ready(&mut reserved, &mut cx).is_ready());
    let mut other = svc.clone();
    assert!(poll_ready(&mut other, &mut cx).is_pending());

    // The term ends between poll_ready and call: answered as a follower, and the
    // permit given back at once, while `reserved` lives on.
    control.expire();
    let res = reserved.call(req()).await.unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(admitted.try_recv().is_err(), "the inner service was called");

    control.lead_until(2, Instant::now() + Duration::from_secs(3600));
    assert!(
        poll_ready(&mut other, &mut cx).is_ready(),
        "the permit is still held by the service that did not use it"
    );
    handler.finish.notify_one();
    let res = timeout(PATIENCE, other.call(req())).await.unwrap().unwrap();
    assert_eq!(body_text(res).await, "token 2");
    assert_eq!(admitted.try_recv().unwrap().fencing_token().get(), 2);

    // And `reserved`, polled again, gets a permit of its own.
    assert!(poll_ready(&mut reserved, &mut cx).is_ready());
    handler.finish.notify_one();
    let res = timeout(PATIENCE, reserved.call(req()))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
}

#[tokio::test]
async fn a_wait_for_readiness_under_way_when_the_term_ends_is_given_back() {
    let (leadership, control) = Leadership::manual("admin", "node-1");
    control.lead(1);
    let handler = Handler::default();
    let (svc, mut admitted) = limited(LeaderOnlyHttpLayer::new(leadership), &handler);
    let first = tokio::spawn(svc.clone().oneshot(req()));
    timeout(PATIENCE, admitted.recv()).await.unwrap().unwrap();
    let mut cx = Context::from_waker(Waker::noop());

    // `queued` waits for the permit `first` holds: its `ConcurrencyLimit` queues an
    // acquire.
    let mut queued = svc.clone();
    assert!(poll_ready(&mut queued, &mut cx).is_pending());
    // The term ends: `queued` is ready at once, as a follower, and answers as one.
    control.follow(Some("node-2"));
    assert!(poll_ready(&mut queued, &mut cx).is_ready());
    let res = queued.call(req()).await.unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);

    // `first` completes: nothing is in flight any more.
    handler.finish.notify_one();
    let res = timeout(PATIENCE, first).await.unwrap().unwrap().unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    // Led again: the freed permit goes to the next request, not to the acquire the idle
    // `queued` had queued.
    control.lead(2);
    let mut next = svc.clone();
    assert!(
        poll_ready(&mut next, &mut cx).is_ready(),
        "the permit went to the acquire of a service that answered as a follower"
    );
    handler.finish.notify_one();
    let res = timeout(PATIENCE, next.call(req())).await.unwrap().unwrap();
    assert_eq!(body_text(res).await, "token 2");
}

#[tokio::test]
async fn a_node_that_became_leader_between_poll_ready_and_call_answers_as_a_follower() {
    let (leadership, control) = Leadership::manual("admin", "node-1");
    control.follow(Some("node-2"));
    let handler = Handler::default();
    let (svc, mut admitted) = limited(LeaderOnlyHttpLayer::new(leadership), &handler);
    let mut cx = Context::from_waker(Waker::noop());

    // Ready as a follower (no permit taken), called as the leader: the inner service
    // gave no readiness for it, so it is not passed on.
    let mut late = svc.clone();
    assert!(poll_ready(&mut late, &mut cx).is_ready());
    control.lead(1);
    let res = late.call(req()).await.unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(res.headers()["retry-after"], "1");
    assert!(
        res.headers().get(LEADER_HEADER).is_none(),
        "must not name itself"
    );
    assert!(admitted.try_recv().is_err(), "the inner service was called");

    // No permit was taken: another clone gets it at once; the next round of `late`
    // is admitted.
    let mut other = svc.clone();
    assert!(poll_ready(&mut other, &mut cx).is_ready());
    handler.finish.notify_one();
    let res = timeout(PATIENCE, other.call(req())).await.unwrap().unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert!(poll_ready(&mut late, &mut cx).is_ready());
    handler.finish.notify_one();
    let res = timeout(PATIENCE, late.call(req())).await.unwrap().unwrap();
    assert_eq!(res.status(), StatusCode::OK);
}

/// Collects what a `tracing` subscriber writes.
#[derive(Clone, Default)]
struct Captured(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn text(&self) -> String {
        String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
    }
}

#[tokio::test]
async fn a_call_without_poll_ready_on_the_leader_answers_as_a_follower_and_warns_once() {
    let (leadership, control) = Leadership::manual("admin", "node-1");
    control.lead(1);
    let handler = Handler::default();
    let (inner, mut admitted) = handler.service();
    let mut svc = LeaderOnlyHttpLayer::new(leadership).layer(inner);
    let mut clone = svc.clone();
    let mut cx = Context::from_waker(Waker::noop());
    let captured = Captured::default();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_writer({
            let captured = captured.clone();
            move || captured.clone()
        })
        .finish();
    let answers = tracing::subscriber::with_default(subscriber, || {
        // Called with no `poll_ready` before, twice, and on a clone: the caller's bug.
        let mut answers = vec![svc.call(req()), svc.call(req()), clone.call(req())];
        // Ready as a follower, called as the leader: a race, not a bug.
        control.follow(None);
        assert!(poll_ready(&mut svc, &mut cx).is_ready());
        control.lead(2);
        answers.push(svc.call(req()));
        answers
    });
    for answer in answers {
        let res = answer.await.unwrap();
        assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    }
    assert!(admitted.try_recv().is_err(), "the inner service was called");
    let logged = captured.text();
    assert_eq!(
        logged.matches("without a poll_ready").count(),
        1,
        "one warning for the service and its clones: {logged}"
    );
    assert!(
        logged.contains("WARN") && logged.contains("lock=admin"),
        "{logged}"
    );

    // Polled ready first, it is passed on.
    assert!(poll_ready(&mut svc, &mut cx).is_ready());
    handler.finish.notify_one();
    let res = timeout(PATIENCE, svc.call(req())).await.unwrap().unwrap();
    assert_eq!(body_text(res).await, "token 2");
}

#[tokio::test]
async fn readiness_reserved_in_one_term_serves_the_call_in_the_next() {
    let (leadership, control) = Leadership::manual("admin", "node-1");
    control.lead(1);
    let handler = Handler::default();
    let (mut svc, mut admitted) = limited(LeaderOnlyHttpLayer::new(leadership), &handler);
    let mut cx = Context::from_waker(Waker::noop());
    assert!(poll_ready(&mut svc, &mut cx).is_ready());
    // Lost and led again between poll_ready and call: the request is admitted in the
    // term of the call.
    control.follow(None);
    control.lead(2);
    handler.finish.notify_one();
    let res = timeout(PATIENCE, svc.call(req())).await.unwrap().unwrap();
    assert_eq!(body_text(res).await, "token 2");
    assert_eq!(admitted.try_recv().unwrap().fencing_token().get(), 2);
}

#[tokio::test]
async fn cancel_on_loss_gives_the_permit_of_the_dropped_request_back() {
    let (leadership, control) = Leadership::manual("admin", "node-1");
    control.lead_until(1, Instant::now() + Duration::from_secs(3600));
    let handler = Handler::default();
    let (svc, mut admitted) = limited(
        LeaderOnlyHttpLayer::new(leadership).cancel_on_loss(),
        &handler,
    );
    let first = tokio::spawn(svc.clone().oneshot(req()));
    timeout(PATIENCE, admitted.recv()).await.unwrap().unwrap();
    let mut other = svc.clone();
    let mut cx = Context::from_waker(Waker::noop());
    assert!(poll_ready(&mut other, &mut cx).is_pending());

    control.expire();
    let res = timeout(PATIENCE, first).await.unwrap().unwrap().unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(handler.dropped.load(Ordering::SeqCst), 1, "not dropped");
    // The dropped future's permit is free again.
    control.lead_until(2, Instant::now() + Duration::from_secs(3600));
    assert!(
        poll_ready(&mut other, &mut cx).is_ready(),
        "the cancelled request's permit is still held"
    );
    handler.finish.notify_one();
    let res = timeout(PATIENCE, other.call(req())).await.unwrap().unwrap();
    assert_eq!(body_text(res).await, "token 2");
}

#[test]
fn the_service_and_its_response_future_are_send_and_sync() {
    fn send_sync<T: Send + Sync>() {}
    // A `Sync` body (axum's `Body` is not `Sync`, so no future holding one is).
    type Inner = tower::limit::ConcurrencyLimit<chosen_tower::LeaderHealth>;
    send_sync::<LeaderOnlyHttp<Inner, Reject>>();
    send_sync::<<LeaderOnlyHttp<Inner, Reject> as Service<Request<String>>>::Future>();
}

/// A tower service that is not `Clone`.
struct NotClone;

impl Service<Request<Body>> for NotClone {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = std::future::Ready<Result<Response<Body>, Infallible>>;
    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }
    fn call(&mut self, _req: Request<Body>) -> Self::Future {
        std::future::ready(Ok(Response::new(Body::from("not clone"))))
    }
}

#[tokio::test]
async fn a_service_that_is_not_clone_serves_axum_behind_a_buffer_and_handle_error_layer() {
    use axum::error_handling::HandleErrorLayer;

    let (leadership, control) = Leadership::manual("admin", "node-1");
    let gated = ServiceBuilder::new()
        // `Buffer` fails with `BoxError`; axum needs `Infallible`.
        .layer(HandleErrorLayer::new(|e: BoxError| async move {
            (StatusCode::INTERNAL_SERVER_ERROR, e.to_string())
        }))
        .layer(LeaderOnlyHttpLayer::new(leadership))
        .buffer(8)
        .service(NotClone);
    let app = axum::Router::new().route_service("/hook", gated);
    control.lead(1);
    let res = app.clone().oneshot(req_to("/hook")).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(body_text(res).await, "not clone");
    control.follow(None);
    let res = app.oneshot(req_to("/hook")).await.unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
}

fn req_to(path: &str) -> Request<Body> {
    Request::builder().uri(path).body(Body::empty()).unwrap()
}

#[test]
fn a_follower_and_a_leader_that_need_not_wait_need_no_runtime() {
    // No tokio runtime here: only waiting for a term to end needs its timer.
    let (leadership, control) = Leadership::manual("admin", "node-1");
    let mut cx = Context::from_waker(Waker::noop());
    let ready = || {
        service_fn(|_req: Request<String>| async {
            Ok::<_, Infallible>(Response::new(String::new()))
        })
    };
    let layers = [
        LeaderOnlyHttpLayer::new(leadership.clone()),
        LeaderOnlyHttpLayer::new(leadership).cancel_on_loss(),
    ];
    for layer in layers {
        let mut svc = layer.layer(ready());
        for leading in [true, false] {
            if leading {
                control.lead_until(1, Instant::now() + Duration::from_secs(3600));
            } else {
                control.follow(Some("node-2"));
            }
            assert!(svc.poll_ready(&mut cx).is_ready());
            let mut fut = std::pin::pin!(svc.call(Request::new(String::new())));
            let res = match std::future::Future::poll(fut.as_mut(), &mut cx) {
                Poll::Ready(res) => res.unwrap(),
                Poll::Pending => panic!("the inner future is ready at its first poll"),
            };
            let expected = if leading {
                StatusCode::OK
            } else {
                StatusCode::SERVICE_UNAVAILABLE
            };
            assert_eq!(res.status(), expected);
        }
    }
}
