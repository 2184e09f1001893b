//! Terms that end on one thread while another polls: hand-set leases (no database),
//! expired over and over, for a bounded time.

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Waker};
use std::time::{Duration, Instant};

use chosen_core::Leadership;
use chosen_tower::Tenure;

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
