//! A request in flight when the leader's lease is lost for real (its session is
//! terminated by the server): it learns of the loss through its `Tenure`, and with
//! `cancel_on_loss` it is dropped and answered `503`.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use axum::body::Body;
use chosen_core::{ConnectionState, Election, Leadership, LockManager, ManagerOptions};
use chosen_tests::{PgCluster, connect_admin, manager_options, unique_name};
use chosen_tower::{LeaderOnlyHttpLayer, Tenure};
use http::{Method, Request, Response, StatusCode};
use tokio::sync::{Notify, mpsc};
use tokio::time::timeout;
use tower::{Layer, ServiceExt, service_fn};

/// How long anything that should happen soon may take on a slow, busy machine.
const PATIENCE: Duration = Duration::from_secs(30);

fn post() -> Request<Body> {
    Request::builder()
        .method(Method::POST)
        .uri("/hook")
        .body(Body::empty())
        .unwrap()
}

/// Two nodes of one lock: web-1 leads, web-2 waits. web-1 polls slowly, so that after
/// losing its lease it contends again only seconds later (two poll intervals), well
/// after web-2 (polling every 50 ms) took over.
struct Pair {
    _pg: PgCluster,
    url: String,
    one: LockManager,
    two: LockManager,
    leader: Election,
    successor: Election,
}

impl Pair {
    async fn start(prefix: &str) -> Self {
        let pg = PgCluster::start().unwrap();
        let url = pg.url();
        let name = unique_name(prefix);
        // A fresh cluster: no holder can be silent across its start, so no grant delay.
        let options = |node: &str, poll: u64| -> ManagerOptions {
            manager_options(&url, node)
                .poll_interval(Duration::from_millis(poll))
                .term_grant_delay(Duration::ZERO)
        };
        let one = LockManager::connect(options("web-1", 3000)).await.unwrap();
        let leader = Election::start(&one, name.as_str()).unwrap();
        timeout(PATIENCE, leader.leadership().wait_leading())
            .await
            .expect("web-1 never led");
        let two = LockManager::connect(options("web-2", 50)).await.unwrap();
        let successor = Election::start(&two, name.as_str()).unwrap();
        Self {
            _pg: pg,
            url,
            one,
            two,
            leader,
            successor,
        }
    }

    fn leadership(&self) -> Leadership {
        self.leader.leadership()
    }

    /// web-1's lease is lost: the server terminates its lock session.
    async fn terminate_the_leaders_session(&self) {
        let pid = match self.one.connection_status() {
            ConnectionState::Connected { backend_pid, .. } => backend_pid,
            other => panic!("web-1 is not connected: {other:?}"),
        };
        let admin = connect_admin(&self.url).await.unwrap();
        admin
            .execute("SELECT pg_terminate_backend($1)", &[&pid])
            .await
            .unwrap();
    }

    async fn shutdown(self) {
        self.successor.shutdown().await;
        self.leader.shutdown().await;
        self.two.shutdown().await;
        self.one.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_in_flight_learns_from_its_tenure_that_the_lease_was_lost() {
    let pair = Pair::start("tenure-lost").await;
    let leadership = pair.leadership();
    let (tenures, mut admitted) = mpsc::unbounded_channel::<Tenure>();
    let handler = service_fn(move |req: Request<Body>| {
        let tenures = tenures.clone();
        async move {
            let tenure = req
                .extensions()
                .get::<Tenure>()
                .cloned()
                .expect("no tenure in the request's extensions");
            tenures.send(tenure.clone()).unwrap();
            let lost = timeout(PATIENCE, tenure.lost()).await.is_ok();
            let body = format!("lost: {lost}, valid: {}", tenure.is_valid());
            Ok::<_, Infallible>(Response::new(Body::from(body)))
        }
    });
    let svc = LeaderOnlyHttpLayer::new(leadership.clone()).layer(handler);

    let request = tokio::spawn(svc.oneshot(post()));
    let tenure = timeout(PATIENCE, admitted.recv())
        .await
        .expect("the request never reached the handler")
        .unwrap();
    assert!(tenure.is_valid());
    assert_eq!(Some(tenure.fencing_token()), leadership.fencing_token());
    assert_eq!(tenure.name(), leadership.name());

    pair.terminate_the_leaders_session().await;
    let successor = timeout(PATIENCE, pair.successor.leadership().wait_leading())
        .await
        .expect("web-2 never led");
    assert!(
        successor > tenure.fencing_token(),
        "the new term's token is greater"
    );

    // By default the request runs to completion: its handler learnt of the loss.
    let res = timeout(PATIENCE, request)
        .await
        .expect("the request never finished")
        .unwrap()
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let body = http_body_util::BodyExt::collect(res.into_body())
        .await
        .unwrap()
        .to_bytes();
    assert_eq!(&body[..], b"lost: true, valid: false");
    assert!(!tenure.is_valid(), "a lost tenure stays lost");
    pair.shutdown().await;
}

/// Sets its flag when dropped: the handler's future was dropped.
struct DropFlag(Arc<AtomicBool>);

impl Drop for DropFlag {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_on_loss_drops_the_request_in_flight_and_answers_503() {
    let pair = Pair::start("cancel-on-loss").await;
    let leadership = pair.leadership();
    let started = Arc::new(Notify::new());
    let finish = Arc::new(Notify::new());
    let dropped = Arc::new(AtomicBool::new(false));
    let completed = Arc::new(AtomicUsize::new(0));
    let handler = {
        let (started, finish) = (Arc::clone(&started), Arc::clone(&finish));
        let (dropped, completed) = (Arc::clone(&dropped), Arc::clone(&completed));
        service_fn(move |_req: Request<Body>| {
            let (started, finish) = (Arc::clone(&started), Arc::clone(&finish));
            let (dropped, completed) = (Arc::clone(&dropped), Arc::clone(&completed));
            async move {
                let _flag = DropFlag(dropped);
                started.notify_one();
                // The webhook's slow work, in flight when the lease is lost.
                finish.notified().await;
                completed.fetch_add(1, Ordering::SeqCst);
                Ok::<_, Infallible>(Response::new(Body::from("handled")))
            }
        })
    };
    let svc = LeaderOnlyHttpLayer::new(leadership.clone())
        .cancel_on_loss()
        .layer(handler.clone());

    let request = tokio::spawn(svc.oneshot(post()));
    timeout(PATIENCE, started.notified())
        .await
        .expect("the request never reached the handler");
    assert!(!request.is_finished());

    pair.terminate_the_leaders_session().await;
    // Answered without the handler finishing: nothing tells the handler to finish.
    let res = timeout(PATIENCE, request)
        .await
        .expect("the request in flight was not cancelled when the lease was lost")
        .unwrap()
        .unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(res.headers()["retry-after"], "1");
    assert!(!leadership.is_leader());
    assert!(
        dropped.load(Ordering::SeqCst),
        "the handler's future was dropped"
    );

    // The client's retry goes to the new leader, which handles it: the only handler
    // that ever completed.
    timeout(PATIENCE, pair.successor.leadership().wait_leading())
        .await
        .expect("web-2 never led");
    let retry = LeaderOnlyHttpLayer::new(pair.successor.leadership())
        .cancel_on_loss()
        .layer(handler);
    finish.notify_one();
    let res = timeout(PATIENCE, retry.oneshot(post()))
        .await
        .expect("the retry on the new leader never finished")
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(completed.load(Ordering::SeqCst), 1);
    pair.shutdown().await;
}
