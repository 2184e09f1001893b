//! Terms that end on one thread while another polls: hand-set leases (no database),
//! expired over and over, for a bounded time.

use std::convert::Infallible;
use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use axum::body::Body;
use chosen_core::Leadership;
use chosen_tower::{LeaderOnlyHttpLayer, Tenure};
use http::{Request, Response};
use tower::{Layer, Service};

/// How long each test hammers, at most.
const HAMMER: Duration = Duration::from_secs(2);
/// How many terms each test ends, at most.
const TERMS: u64 = 200_000;

/// Runs `poller` on a thread of its own (inside a tokio runtime with its timer, as the
/// loss waits need) until told to stop, while this thread starts a term under a lease
/// and expires it, again and again. Returns what `poller` returned; fails if it
/// panicked.
fn hammer<T: Send + 'static>(
    poller: impl FnOnce(Leadership, &AtomicBool) -> T + Send + 'static,
) -> T {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let (leadership, control) = Leadership::manual("admin", "node-1");
    let stop = Arc::new(AtomicBool::new(false));
    let polling = {
        let (stop, handle) = (Arc::clone(&stop), rt.handle().clone());
        std::thread::spawn(move || {
            let _runtime = handle.enter();
            poller(leadership, &stop)
        })
    };
    let start = Instant::now();
    let mut token = 0;
    while start.elapsed() < HAMMER && token < TERMS && !polling.is_finished() {
        token += 1;
        control.lead_until(token, Instant::now() + Duration::from_secs(3600));
        for _ in 0..200 {
            std::hint::spin_loop();
        }
        control.expire();
        for _ in 0..200 {
            std::hint::spin_loop();
        }
    }
    stop.store(true, Ordering::Relaxed);
    match polling.join() {
        Ok(out) => out,
        Err(panic) => {
            let message = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied());
            panic!("the polling thread panicked after {token} terms: {message:?}");
        }
    }
}

#[test]
fn lost_resolves_only_once_is_valid_is_false_while_leases_expire_on_another_thread() {
    let resolved = hammer(|leadership, stop| {
        let mut cx = Context::from_waker(Waker::noop());
        let mut resolved = 0u64;
        while !stop.load(Ordering::Relaxed) {
            let Some(tenure) = Tenure::current(&leadership) else {
                continue;
            };
            let mut lost = pin!(tenure.lost());
            while !stop.load(Ordering::Relaxed) {
                if lost.as_mut().poll(&mut cx).is_ready() {
                    assert!(
                        !tenure.is_valid(),
                        "lost() resolved while the term is valid"
                    );
                    resolved += 1;
                    break;
                }
            }
        }
        resolved
    });
    assert!(resolved > 0, "no term was seen to end");
}

/// An inner service that is never ready.
#[derive(Clone)]
struct NeverReady;

impl Service<Request<Body>> for NeverReady {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = std::future::Ready<Result<Response<Body>, Infallible>>;
    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Pending
    }
    fn call(&mut self, _req: Request<Body>) -> Self::Future {
        unreachable!("never ready, so never called")
    }
}

#[test]
fn the_leaders_poll_ready_keeps_working_while_leases_expire_on_another_thread() {
    let (polls, ready) = hammer(|leadership, stop| {
        let mut svc = LeaderOnlyHttpLayer::new(leadership).layer(NeverReady);
        let mut cx = Context::from_waker(Waker::noop());
        let (mut polls, mut ready) = (0u64, 0u64);
        while !stop.load(Ordering::Relaxed) {
            // Ready only once the term is over: the inner service never is.
            if svc.poll_ready(&mut cx).is_ready() {
                ready += 1;
            }
            polls += 1;
        }
        (polls, ready)
    });
    assert!(polls > 0 && ready > 0, "{polls} polls, {ready} ready");
}
