//! The leadership term a request was admitted in.

use std::fmt;
use std::future::{Future, poll_fn};
use std::pin::pin;
use std::task::Poll;

use chosen_core::{FencingToken, LeaderState, Leadership};

/// The leadership term a request was admitted in: its fencing token, whether this node
/// may still trust it ([`is_valid`](Self::is_valid)), and a future that resolves once it
/// may not ([`lost`](Self::lost)).
///
/// [`LeaderOnlyHttp`](crate::LeaderOnlyHttp) puts one into the extensions of every
/// request it passes to the inner service (axum: the `Extension<Tenure>` extractor).
/// Behind gates on several locks, that is the tenure of the gate nearest to the
/// handler; [`Tenures`], in the extensions too, holds each gate's.
/// A tenure belongs to one term: once the lease of that term is lost, released, or past
/// its deadline, it stays invalid, even if this node leads again later under a new
/// token.
///
/// Leading does not make a write safe by itself: a request admitted just before the
/// lease was lost may still run while another node already leads (see the crate
/// documentation, "A request in flight when the lease is lost"). Fence the writes with
/// the token, so that the database refuses the stale leader's transaction once the new
/// leader has committed one. Fencing orders the commits, it does not make them one: the
/// client's retry, on the new leader, writes again, and a stale transaction that
/// committed first stays committed. So give the write an idempotency key too (here the
/// sender's delivery id, the same on every retry), and check [`is_valid`](Self::is_valid)
/// first, as [`Lease::fence`](chosen_core::Lease::fence) does, so that a node that
/// already knows its term is over writes nothing:
///
/// ```no_run
/// use std::sync::Arc;
///
/// use axum::extract::{Extension, State};
/// use axum::http::{HeaderMap, StatusCode};
/// use chosen_core::fenced;
/// use chosen_tower::Tenure;
/// use tokio::sync::Mutex;
///
/// // Behind the layer: `post(webhook).route_layer(LeaderOnlyHttpLayer::new(leadership))`.
/// async fn webhook(
///     Extension(tenure): Extension<Tenure>,
///     State(db): State<Arc<Mutex<tokio_postgres::Client>>>,
///     headers: HeaderMap,
///     body: String,
/// ) -> StatusCode {
///     // The sender's id for this delivery, the same on each of its retries.
///     let Some(id) = headers.get("x-delivery-id").and_then(|v| v.to_str().ok()) else {
///         return StatusCode::BAD_REQUEST;
///     };
///     match deliver(&tenure, &mut *db.lock().await, id, &body).await {
///         Ok(()) => StatusCode::OK,
///         // The term is over, a newer leader has written, or the database failed:
///         // let the client retry.
///         Err(_) => StatusCode::SERVICE_UNAVAILABLE,
///     }
/// }
///
/// async fn deliver(
///     tenure: &Tenure,
///     client: &mut tokio_postgres::Client,
///     id: &str,
///     body: &str,
/// ) -> Result<(), Box<dyn std::error::Error>> {
///     // A node that knows its term is over writes nothing (the token check alone
///     // would let it write until the new leader has).
///     if !tenure.is_valid() {
///         return Err("the term is over".into());
///     }
///     let tx = client.transaction().await?;
///     // First in the transaction: `Error::StaleToken` (and the transaction aborted)
///     // once a newer leader of the lock has fenced, so that a stale leader cannot
///     // commit after the new one.
///     fenced::fence(&tx, tenure.name(), tenure.fencing_token()).await?;
///     // Whoever commits second (the retry after a stale leader's commit, or a
///     // duplicate delivery) inserts nothing.
///     tx.execute(
///         "INSERT INTO deliveries (id, body) VALUES ($1, $2) ON CONFLICT (id) DO NOTHING",
///         &[&id, &body],
///     )
///     .await?;
///     tx.commit().await?;
///     Ok(())
/// }
/// # let _ = webhook;
/// ```
///
/// For side effects the database cannot fence (a call to another service), check
/// [`is_valid`](Self::is_valid) right before each, or race the work against
/// [`lost`](Self::lost).
#[derive(Clone)]
pub struct Tenure {
    leadership: Leadership,
    token: FencingToken,
}

impl fmt::Debug for Tenure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tenure")
            .field("name", &self.leadership.name())
            .field("token", &self.token)
            .field("valid", &self.is_valid())
            .finish()
    }
}

impl Tenure {
    /// The term `leadership` leads in right now; `None` while it does not lead (or its
    /// lease is past its deadline).
    #[must_use]
    pub fn current(leadership: &Leadership) -> Option<Self> {
        match leadership.state() {
            LeaderState::Leading { token, .. } => Some(Self {
                leadership: leadership.clone(),
                token,
            }),
            _ => None,
        }
    }

    /// The fencing token of the term: greater than every earlier leader's token of this
    /// lock.
    #[must_use]
    pub fn fencing_token(&self) -> FencingToken {
        self.token
    }

    /// The lock name.
    #[must_use]
    pub fn name(&self) -> &str {
        self.leadership.name()
    }

    pub(crate) fn leadership(&self) -> &Leadership {
        &self.leadership
    }

    /// `true` while this node still leads in this term with a lease that may be trusted
    /// right now (checked against the lease's deadline at the call, as
    /// [`Leadership::is_leader`] is). Once `false`, never `true` again.
    #[must_use]
    pub fn is_valid(&self) -> bool {
        matches!(self.leadership.state(), LeaderState::Leading { token, .. } if token == self.token)
    }

    /// Resolves once the term is over: the lease was lost, released, or passed its
    /// deadline (the moment [`is_valid`](Self::is_valid) turns `false`, even before the
    /// election task notices); at once if it already is. When it resolves,
    /// [`is_valid`](Self::is_valid) is `false`. Needs a tokio runtime with its timer, as
    /// [`Leadership::wait_not_leading`] does.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    pub async fn lost(&self) {
        loop {
            // Subscribe to the leadership's changes before checking the term: a change
            // between the check and the wait is then seen by the wait. (A watch only
            // keeps the newest state: a loss followed by a new term must not be
            // mistaken for this term going on.)
            let mut changed = pin!(self.leadership.changed());
            let first = poll_fn(|cx| Poll::Ready(changed.as_mut().poll(cx).is_ready())).await;
            if !self.is_valid() {
                return;
            }
            if !first {
                // The deadline passing changes no state: `wait_not_leading` sees it.
                let mut not_leading = pin!(self.leadership.wait_not_leading());
                let over = poll_fn(|cx| {
                    if not_leading.as_mut().poll(cx).is_ready() {
                        return Poll::Ready(true);
                    }
                    changed.as_mut().poll(cx).map(|_| false)
                })
                .await;
                if over {
                    if !self.is_valid() {
                        return;
                    }
                    // The wait saw a loss `is_valid` does not. Never with real leases:
                    // every revoke makes the shared validity invalid first, and a new
                    // lease brings a new token. Only a `ManualLeadership` can: its
                    // `expire` sets the loss reason an instant before it revokes,
                    // without invalidating (another thread may be in between), and
                    // its `lead_until` may replace a lease under the same token. A
                    // fallback: let the other thread go on, and look again.
                    yield_once().await;
                }
            }
            // The state changed: check the term again. (`changed` is never ready at its
            // first poll while we hold the leadership, whose sender it watches.)
        }
    }
}

/// Pending once (waking its task at once), then ready: gives the executor's other tasks
/// and threads a turn.
async fn yield_once() {
    let mut yielded = false;
    poll_fn(|cx| {
        if yielded {
            return Poll::Ready(());
        }
        yielded = true;
        cx.waker().wake_by_ref();
        Poll::Pending
    })
    .await;
}

/// The tenures of every gate that admitted a request, outermost first, for a route
/// behind gates on several locks: each [`LeaderOnlyHttp`](crate::LeaderOnlyHttp) adds its
/// own to the request's extensions (axum: the `Extension<Tenures>` extractor), next to
/// the [`Tenure`] of the gate nearest to the handler.
///
/// ```
/// use axum::Extension;
/// use chosen_tower::Tenures;
///
/// // Behind `LeaderOnlyHttpLayer`s on the locks "billing" and "ledger".
/// async fn close_month(Extension(tenures): Extension<Tenures>) -> String {
///     let billing = tenures.get("billing").expect("behind the billing gate");
///     let ledger = tenures.get("ledger").expect("behind the ledger gate");
///     format!("{:?} {:?}", billing.fencing_token(), ledger.fencing_token())
/// }
/// # let _ = close_month;
/// ```
#[derive(Clone, Debug)]
pub struct Tenures {
    /// The outermost gate's; a request in the extensions of which there is a `Tenures`
    /// was admitted by at least one gate.
    first: Tenure,
    /// The other gates', outermost first (empty behind a single gate: no allocation).
    rest: Vec<Tenure>,
}

impl Tenures {
    /// The tenure of the gate on the lock `name` (the one nearest to the handler, if
    /// several gates are on that lock); `None` if no gate on it admitted the request.
    #[must_use]
    pub fn get(&self, name: &str) -> Option<&Tenure> {
        self.iter().rev().find(|tenure| tenure.name() == name)
    }

    /// Each gate's tenure, outermost first.
    #[must_use]
    pub fn iter(&self) -> impl DoubleEndedIterator<Item = &Tenure> {
        std::iter::once(&self.first).chain(&self.rest)
    }

    /// Adds `tenure`, the term a gate admitted a request in, to the request's
    /// extensions: as its [`Tenure`] (replacing an outer gate's) and to its [`Tenures`].
    pub(crate) fn admit(extensions: &mut http::Extensions, tenure: Tenure) {
        match extensions.get_mut::<Self>() {
            Some(tenures) => tenures.rest.push(tenure.clone()),
            None => {
                extensions.insert(Self {
                    first: tenure.clone(),
                    rest: Vec::new(),
                });
            }
        }
        extensions.insert(tenure);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::task::{Context, Waker};
    use std::time::{Duration, Instant};

    use super::*;

    #[tokio::test]
    async fn a_tenure_ends_with_its_term_even_when_a_new_term_follows() {
        let (leadership, control) = Leadership::manual("hook", "node-1");
        assert!(Tenure::current(&leadership).is_none());
        control.lead(1);
        let tenure = Tenure::current(&leadership).expect("leading");
        assert_eq!(tenure.fencing_token().get(), 1);
        assert!(tenure.is_valid());

        // Lost and led again before anyone looked: the old term is still over.
        control.follow(None);
        control.lead(2);
        assert!(!tenure.is_valid());
        tokio::time::timeout(Duration::from_secs(30), tenure.lost())
            .await
            .expect("lost() resolves for a term that is over");
        assert!(Tenure::current(&leadership).is_some_and(|t| t.is_valid()));
    }

    /// A waker that records that it was woken.
    #[derive(Default)]
    struct WakeFlag(tokio::sync::Notify);

    impl std::task::Wake for WakeFlag {
        fn wake(self: Arc<Self>) {
            self.0.notify_one();
        }
    }

    impl WakeFlag {
        async fn woken(&self, what: &str) {
            tokio::time::timeout(Duration::from_secs(30), self.0.notified())
                .await
                .unwrap_or_else(|_| panic!("the waiter was not woken: {what}"));
        }
    }

    #[tokio::test]
    async fn lost_wakes_its_waiter_when_the_term_ends_later() {
        let (leadership, control) = Leadership::manual("hook", "node-1");
        let flag = Arc::new(WakeFlag::default());
        let waker = Waker::from(Arc::clone(&flag));
        let mut cx = Context::from_waker(&waker);

        control.lead_until(3, Instant::now() + Duration::from_secs(3600));
        let tenure = Tenure::current(&leadership).expect("leading");
        let mut lost = pin!(tenure.lost());
        // Polled, and so registered to be woken, while the term goes on.
        assert!(lost.as_mut().poll(&mut cx).is_pending(), "the term goes on");
        // The deadline passes, unnoticed by the election: no state change.
        control.expire();
        flag.woken("the lease expired").await;
        assert!(lost.as_mut().poll(&mut cx).is_ready());
        assert!(!tenure.is_valid());

        // A new term replaces this one while the waiter waits: lost, and led again
        // before the waiter looked.
        control.lead(4);
        let tenure = Tenure::current(&leadership).expect("leading");
        let mut lost = pin!(tenure.lost());
        assert!(lost.as_mut().poll(&mut cx).is_pending(), "the term goes on");
        control.follow(None);
        control.lead(5);
        flag.woken("a new term replaced this one").await;
        assert!(lost.as_mut().poll(&mut cx).is_ready());
        assert!(format!("{tenure:?}").contains("valid: false"));
    }

    #[tokio::test]
    async fn lost_wakes_its_waiter_when_the_lease_deadline_passes() {
        let (leadership, control) = Leadership::manual("hook", "node-1");
        let flag = Arc::new(WakeFlag::default());
        let waker = Waker::from(Arc::clone(&flag));
        let mut cx = Context::from_waker(&waker);
        // Nothing but the clock ends the term: a timer must wake the waiter. A lease
        // that ended before the first poll tests nothing: then a longer one.
        for lease in [300, 1_000, 5_000].map(Duration::from_millis) {
            let deadline = Instant::now() + lease;
            control.lead_until(6, deadline);
            let tenure = Tenure::current(&leadership).expect("leading");
            let mut lost = pin!(tenure.lost());
            if lost.as_mut().poll(&mut cx).is_ready() {
                continue;
            }
            flag.woken("the lease deadline passed").await;
            assert!(Instant::now() >= deadline, "woken before the deadline");
            assert!(lost.as_mut().poll(&mut cx).is_ready());
            return;
        }
        panic!("every lease ended before lost() was polled");
    }

    /// A waker that counts its wakes.
    #[derive(Default)]
    struct WakeCount(std::sync::atomic::AtomicUsize);

    impl std::task::Wake for WakeCount {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }

    impl WakeCount {
        fn take(&self) -> usize {
            self.0.swap(0, std::sync::atomic::Ordering::SeqCst)
        }
    }

    #[tokio::test]
    async fn lost_does_not_resolve_while_the_term_is_still_valid() {
        let (leadership, control) = Leadership::manual("hook", "node-1");
        let count = Arc::new(WakeCount::default());
        let waker = Waker::from(Arc::clone(&count));
        let mut cx = Context::from_waker(&waker);

        control.lead_until(8, Instant::now() + Duration::from_secs(3600));
        let tenure = Tenure::current(&leadership).expect("leading");
        let mut lost = pin!(tenure.lost());
        assert!(lost.as_mut().poll(&mut cx).is_pending(), "the term goes on");
        // A new lease under the same token: the term goes on (`is_valid` compares the
        // token), while the old lease, dropped, has ended. `wait_not_leading`, waiting
        // on the old lease, then returns while `is_valid` is still `true`: the moment
        // `lost` must not take for the loss. (It returns only if its `select!` picks
        // the old lease's end before the state change: it picks at random, so again
        // until it did. `lost` then yields, waking its task during the poll.)
        for _ in 0..1_000 {
            control.lead_until(8, Instant::now() + Duration::from_secs(3600));
            count.take();
            assert!(
                lost.as_mut().poll(&mut cx).is_pending(),
                "resolved while valid"
            );
            assert!(tenure.is_valid());
            if count.take() == 0 {
                continue; // the state change was seen first: nothing tested
            }
            assert!(
                lost.as_mut().poll(&mut cx).is_pending(),
                "resolved while valid"
            );
            assert!(tenure.is_valid());
            assert_eq!(count.take(), 0, "waits for the new lease only");

            control.expire();
            assert!(lost.as_mut().poll(&mut cx).is_ready(), "the lease expired");
            assert!(!tenure.is_valid());
            return;
        }
        panic!("wait_not_leading never returned for the old lease first");
    }
}
