//! The leader-only HTTP middleware: [`LeaderOnlyHttpLayer`] wraps a service in
//! [`LeaderOnlyHttp`], whose [`ResponseFuture`] is the inner service's future on the
//! leader and a ready answer on a follower.
//!
//! On the leader a request goes to the inner service with its [`Tenure`] in its
//! extensions; on a follower the layer's [`FollowerResponder`] answers it (by default
//! [`Reject`]: `503` with `Retry-After`; or [`Redirect`] to the leader, or your own),
//! and the response names the leader in [`LEADER_HEADER`] when known. `poll_ready` is
//! the inner service's readiness while this node leads and ready at once while it
//! follows; the decision is made in `call`, and the error type is the inner service's.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use chosen_core::{Election, FencingToken, Leadership, LockManager, LockRequest};
use http::header::HeaderValue;
use http::{HeaderMap, Method, Request, Response, Uri};
use pin_project_lite::pin_project;
use tower_layer::Layer;
use tower_service::Service;

use crate::responder::{FollowerContext, FollowerResponder, LEADER_HEADER, Redirect, Reject};
use crate::tenure::{Tenure, Tenures};

/// Gates HTTP requests on leadership: on the leader, requests reach the inner service;
/// on a follower, the layer answers itself (by default `503` + `Retry-After: 1`), with
/// a `x-chosen-leader` header naming the leader when known.
///
/// Build it from a [`Leadership`] you already have ([`new`](Self::new), e.g. the one of
/// an [`Election`] or a [`Singleton`](chosen_core::Singleton) that also serves other
/// code), or let it start its own election ([`elect`](Self::elect)). Its counterpart for
/// apalis jobs is `chosen_apalis::LeaderOnlyJobLayer`, built the same two ways.
///
/// The check happens in `call`, against the lease's deadline at that moment
/// ([`Leadership::is_leader`]). `poll_ready` never makes a follower wait: while this
/// node follows it is ready at once, even behind a busy inner service (a
/// `ConcurrencyLimit` full of requests admitted while this node led). While it leads,
/// `poll_ready` is the inner service's readiness, so its backpressure reaches the layers
/// outside the gate (`load_shed` sheds, `Buffer` holds its queue), and it turns ready as
/// soon as the term ends, the request then being answered as a follower answers. A
/// request is passed on only with readiness the inner service gave while this node
/// led: one arriving just after the node became leader (ready as a follower, called as
/// the leader) is answered as a follower (the client retries). So is one `call`ed
/// without a `poll_ready` that returned ready before it, although this node leads (a
/// caller that breaks the `Service` contract; earlier versions passed it on): the first
/// such call of a service and its clones logs a warning through `tracing`, and the
/// answer counts as a follower response in the metrics.
///
/// What the inner service was polled for while this node led and no `call` used (a
/// `ConcurrencyLimit` permit it reserved, or its acquire still queued for one) is given
/// back once the gate sees that this node no longer leads: at its next `poll_ready`
/// (ready at once, as a follower) or `call` (answered as a follower). A gate polled
/// again only once this node leads again, in a new term, keeps it for that term's
/// `call`; one neither polled nor called again keeps it until it is dropped, as any
/// service does. It is given back by replacing the inner service with a clone of
/// itself, which is why the inner service must be `Clone`, and its `Clone` must make a
/// service that holds no readiness: tower's `ConcurrencyLimit` and `Buffer` do (tower
/// 0.5.3: a clone starts with no permit and no acquire under way), but a service of
/// your own with a derived `Clone` over a field that records its readiness (a
/// `ready: bool` standing for a slot it took) copies that field, and what it reserved
/// is not given back. axum requires `Clone` already; for a tower service that is not,
/// `tower::buffer::Buffer` is `Clone`, but its error is `BoxError`: with axum, turn it
/// into a response with `axum::error_handling::HandleErrorLayer` outside the gate. The
/// error type stays the inner service's, so axum's `Infallible` contract holds.
///
/// A request passed to the inner service carries its [`Tenure`] (the term's fencing
/// token, validity and loss) in its extensions, and each gate's in [`Tenures`] when
/// gates on several locks are stacked. By default it runs to completion even
/// if the lease is lost meanwhile; with [`cancel_on_loss`](Self::cancel_on_loss) it is
/// dropped and answered as a follower answers instead. The crate documentation, "A
/// request in flight when the lease is lost", states what each mode guarantees.
///
/// # Runtime
///
/// Waiting for a term to end needs tokio's timer, since a lease's deadline passes
/// without any change of state: on the leader when the inner service is not ready at
/// once (`poll_ready` then waits for it and for the loss), and in cancel mode while the
/// inner future is pending. There the service and its future must be polled inside a
/// tokio runtime with its timer enabled (`#[tokio::main]`, `Builder::enable_all`, as
/// `axum::serve` runs); elsewhere (no runtime, another executor, a runtime built
/// without `enable_time`) they panic. A follower, and a leader whose inner service is
/// ready at once and (in cancel mode) whose future completes at its first poll, need
/// no runtime.
///
/// # With axum
///
/// Use `route_layer` so unknown paths keep answering `404`; gate a single method
/// router to keep `405` for wrong methods on the gated path:
///
/// ```
/// use axum::{Router, routing::{get, post}};
/// use chosen_core::Leadership;
/// use chosen_tower::LeaderOnlyHttpLayer;
///
/// fn app(leadership: Leadership) -> Router {
///     Router::new()
///         .route("/", get(|| async { "served by every replica" }))
///         // Only the leader runs this; wrong methods still get 405:
///         .route(
///             "/admin/reindex",
///             post(|| async { "reindexing" }).route_layer(LeaderOnlyHttpLayer::new(leadership.clone())),
///         )
///         // Or gate every route added so far (unknown paths stay 404, but a wrong
///         // method on a gated path answers 503 on followers):
///         .route("/admin/flush", post(|| async { "flushed" }))
///         .route_layer(LeaderOnlyHttpLayer::new(leadership))
/// }
/// # let (l, _c) = Leadership::manual("x", "n");
/// # let _ = app(l);
/// ```
///
/// `Router::layer` would also wrap the fallback, so unknown paths would answer `503`
/// on followers instead of `404`.
#[derive(Debug, Clone)]
pub struct LeaderOnlyHttpLayer<R = Reject> {
    leadership: Leadership,
    responder: R,
    cancel_on_loss: bool,
    /// An election [`elect`](Self::elect) started: it lives as long as any clone of
    /// the layer or any service built from it (axum drops the layer once the routes
    /// are built).
    election: Option<Arc<Election>>,
}

impl LeaderOnlyHttpLayer {
    /// Gates on an existing leadership (from an [`Election`] or a
    /// [`Singleton`](chosen_core::Singleton)). Followers answer `503 Service
    /// Unavailable` with `Retry-After: 1`.
    #[must_use]
    pub fn new(leadership: Leadership) -> Self {
        Self {
            leadership,
            responder: Reject::default(),
            cancel_on_loss: false,
            election: None,
        }
    }

    /// Starts an election for `lock` on `manager` and gates on it; the election lives
    /// as long as any clone of the layer or any service built from it, and releases the
    /// lock when the last is dropped.
    ///
    /// ```no_run
    /// use axum::{Router, routing::post};
    /// use chosen_tower::LeaderOnlyHttpLayer;
    ///
    /// # async fn demo(manager: chosen_core::LockManager) -> chosen_core::Result<()> {
    /// let app: Router = Router::new().route(
    ///     "/admin/reindex",
    ///     post(|| async { "reindexing" })
    ///         .route_layer(LeaderOnlyHttpLayer::elect(&manager, "admin")?),
    /// );
    /// # let _ = app;
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// [`chosen_core::Error::InvalidName`] for an empty name, one with a NUL character, or
    /// a reserved one (beginning with `chosen.`, or named as a raw key's lease is: `key(a, b)`).
    pub fn elect(manager: &LockManager, lock: impl Into<LockRequest>) -> chosen_core::Result<Self> {
        let election = Election::start(manager, lock)?;
        let mut layer = Self::new(election.leadership());
        layer.election = Some(Arc::new(election));
        Ok(layer)
    }

    /// Followers answer `503` with this `Retry-After` (whole seconds, rounded up).
    #[must_use]
    pub fn retry_after(mut self, retry_after: Duration) -> Self {
        self.responder = Reject::new(retry_after);
        self
    }

    /// Followers answer `307` to the URL `resolver(leader_node_id, request_uri)`
    /// builds, or `503` when no leader is known or the resolver gives `None`.
    ///
    /// ```
    /// use chosen_tower::LeaderOnlyHttpLayer;
    /// # let (leadership, _c) = chosen_core::Leadership::manual("x", "n");
    /// let layer = LeaderOnlyHttpLayer::new(leadership).redirect(|leader, uri| {
    ///     // Node ids are host names in this fleet.
    ///     format!("http://{leader}:8080{}", uri.path_and_query()?.as_str()).parse().ok()
    /// });
    /// # let _ = layer;
    /// ```
    #[must_use]
    pub fn redirect<F>(self, resolver: F) -> LeaderOnlyHttpLayer<Redirect<F>>
    where
        F: Fn(&str, &Uri) -> Option<Uri>,
    {
        LeaderOnlyHttpLayer {
            leadership: self.leadership,
            responder: Redirect::new(resolver),
            cancel_on_loss: self.cancel_on_loss,
            election: self.election,
        }
    }
}

impl<R> LeaderOnlyHttpLayer<R> {
    /// Followers answer whatever `responder` builds (any
    /// [`FollowerResponder`](crate::FollowerResponder), e.g. a closure
    /// `|ctx: &FollowerContext<'_>| -> Response<B>`).
    #[must_use]
    pub fn respond_with<R2>(self, responder: R2) -> LeaderOnlyHttpLayer<R2> {
        LeaderOnlyHttpLayer {
            leadership: self.leadership,
            responder,
            cancel_on_loss: self.cancel_on_loss,
            election: self.election,
        }
    }

    /// Cancels a request in flight when this node's lease is lost: from the moment
    /// its [`Tenure`] ends (the lease's deadline passed, or its loss was seen), the
    /// inner service's future is dropped without being polled again, and the request
    /// is answered as a follower answers (by default `503` + `Retry-After`), so that
    /// the client retries, on the new leader. A response returned by a poll of the inner
    /// future that began and ended within the term (valid at its start and at its end)
    /// is passed on; one returned by a poll during which the term ended is dropped (so
    /// is an error), and the request is answered as a follower answers too, although
    /// what the handler did in that poll is done. A
    /// request whose term ended is answered so even if this node leads again by then,
    /// in a new term: the client's retry is admitted in that term. The default is to
    /// let a request in flight run to completion.
    ///
    /// What is done is not undone: writes the handler made before the loss stay made,
    /// and tasks it spawned go on. Fence such writes with the request's
    /// [`Tenure`]. The crate documentation, "A request in flight when the lease is
    /// lost", has the details. Waiting for the loss needs a tokio runtime with its
    /// timer (the layer's "Runtime" section).
    ///
    /// ```
    /// use chosen_tower::LeaderOnlyHttpLayer;
    /// # let (leadership, _c) = chosen_core::Leadership::manual("x", "n");
    /// let layer = LeaderOnlyHttpLayer::new(leadership).cancel_on_loss();
    /// # let _ = layer;
    /// ```
    #[must_use]
    pub fn cancel_on_loss(mut self) -> Self {
        self.cancel_on_loss = true;
        self
    }

    /// The leadership the layer reads.
    #[must_use]
    pub fn leadership(&self) -> &Leadership {
        &self.leadership
    }
}

impl<S, R: Clone> Layer<S> for LeaderOnlyHttpLayer<R> {
    type Service = LeaderOnlyHttp<S, R>;

    fn layer(&self, inner: S) -> Self::Service {
        let mut service =
            LeaderOnlyHttp::new(inner, self.leadership.clone(), self.responder.clone())
                .keeping(self.election.clone());
        service.cancel_on_loss = self.cancel_on_loss;
        service
    }
}

/// The middleware [`LeaderOnlyHttpLayer`](crate::LeaderOnlyHttpLayer) applies: passes
/// HTTP requests to `inner` on the leader, answers them with `responder` elsewhere.
///
/// `poll_ready` is ready at once while this node follows; while it leads, it is the
/// inner service's readiness, and turns ready as soon as the term ends. A `Service` only
/// for an inner service that is `Clone`: what the inner service was polled for while
/// this node led and no `call` used (a reserved permit, or an acquire still queued) is
/// given back, by replacing the inner service with a clone of itself, at the first
/// `poll_ready` or `call` that sees this node follow; so the inner service's clone must
/// hold no readiness, as [`LeaderOnlyHttpLayer`](crate::LeaderOnlyHttpLayer) describes.
#[derive(Debug)]
pub struct LeaderOnlyHttp<S, R> {
    inner: S,
    leadership: Leadership,
    /// Shared with the response futures, which answer for a term that ended.
    responder: Arc<R>,
    cancel_on_loss: bool,
    /// The layer's own election, if it started one: kept alive while this service is.
    election: Option<Arc<Election>>,
    /// What `inner` may hold since it was last called: readiness the next `call` uses,
    /// or gives back.
    readiness: Readiness,
    /// While `poll_ready` waits for the inner service on the leader: wakes the caller
    /// when that term ends.
    waiter: Option<LossWaiter>,
    /// Set once a `call` without readiness reached this service (or a clone of it)
    /// while this node led, and was logged: later ones are not.
    unready_call_logged: Arc<AtomicBool>,
}

// Not derived: the responder is shared, so it need not be `Clone` itself; and a clone's
// inner service is a clone, which holds no readiness.
impl<S: Clone, R> Clone for LeaderOnlyHttp<S, R> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            leadership: self.leadership.clone(),
            responder: Arc::clone(&self.responder),
            cancel_on_loss: self.cancel_on_loss,
            election: self.election.clone(),
            readiness: Readiness::Unpolled,
            waiter: None,
            unready_call_logged: Arc::clone(&self.unready_call_logged),
        }
    }
}

impl<S, R> LeaderOnlyHttp<S, R> {
    /// Wraps `inner`.
    pub fn new(inner: S, leadership: Leadership, responder: R) -> Self {
        Self {
            inner,
            leadership,
            responder: Arc::new(responder),
            cancel_on_loss: false,
            election: None,
            readiness: Readiness::Unpolled,
            waiter: None,
            unready_call_logged: Arc::new(AtomicBool::new(false)),
        }
    }

    /// Cancels a request in flight when the lease is lost, as
    /// [`LeaderOnlyHttpLayer::cancel_on_loss`](crate::LeaderOnlyHttpLayer::cancel_on_loss)
    /// describes.
    #[must_use]
    pub fn cancel_on_loss(mut self) -> Self {
        self.cancel_on_loss = true;
        self
    }

    /// Keeps `election` alive as long as this service.
    pub(crate) fn keeping(mut self, election: Option<Arc<Election>>) -> Self {
        self.election = election;
        self
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// The inner service, unwrapped.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

/// What the inner service may hold since it was last called (or cloned).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Readiness {
    /// Not polled: it holds nothing.
    Unpolled,
    /// Not polled: `poll_ready` was ready at once, as a follower.
    Follower,
    /// Polled while this node led, and not ready (or failed): it may have a wait for
    /// readiness under way (a queued `ConcurrencyLimit` acquire, a `Buffer` slot).
    Polled,
    /// Ready while this node led: it holds readiness (a `ConcurrencyLimit` permit) for
    /// the next `call`.
    Reserved,
}

impl<S: Clone, R> LeaderOnlyHttp<S, R> {
    /// Gives back what the inner service was polled for while this node led, now that
    /// no request of this node's term will use it: a reserved `ConcurrencyLimit` permit,
    /// or a queued acquire that would take the next permit freed, for a service that
    /// answers as a follower. A clone holds none, and the old inner service is dropped.
    fn give_back_readiness(&mut self) {
        match std::mem::replace(&mut self.readiness, Readiness::Unpolled) {
            Readiness::Polled | Readiness::Reserved => self.inner = self.inner.clone(),
            Readiness::Unpolled | Readiness::Follower => {}
        }
    }
}

impl<S, R> LeaderOnlyHttp<S, R> {
    /// Logs, the first time only for this service and its clones, that a request
    /// reached `call` while this node leads without a `poll_ready` that returned ready
    /// before it (a caller that breaks the `Service` contract), and was answered as a
    /// follower.
    fn log_unready_call(&self) {
        if !self.unready_call_logged.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                lock = %self.leadership.name(),
                node = %self.leadership.node_id(),
                "LeaderOnlyHttp::call without a poll_ready that returned ready before it, \
                 while this node leads: the request is answered as a follower; poll the \
                 service ready before each call (tower's ServiceExt::ready or oneshot). \
                 Logged once per service"
            );
        }
    }
}

impl<S, R, ReqBody, ResBody> Service<Request<ReqBody>> for LeaderOnlyHttp<S, R>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
    R: FollowerResponder<ResBody>,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, ResBody, R>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        loop {
            if !self.leadership.is_leader() {
                // A follower answers without the inner service: it never waits for it.
                self.waiter = None;
                self.give_back_readiness();
                self.readiness = Readiness::Follower;
                return Poll::Ready(Ok(()));
            }
            // The leader keeps to the inner service's backpressure, so that layers
            // outside the gate (`load_shed`, `Buffer`) see it.
            let polled = self.inner.poll_ready(cx);
            self.readiness = Readiness::Polled;
            match polled {
                Poll::Ready(Ok(())) => {
                    self.waiter = None;
                    self.readiness = Readiness::Reserved;
                    return Poll::Ready(Ok(()));
                }
                Poll::Ready(Err(e)) => {
                    self.waiter = None;
                    return Poll::Ready(Err(e));
                }
                Poll::Pending => {}
            }
            // Woken when the term ends, too: the request is then answered as a follower
            // answers, without waiting for the inner service any longer.
            let Some(tenure) = Tenure::current(&self.leadership) else {
                continue;
            };
            let waiter = match &mut self.waiter {
                Some(w) if w.token == tenure.fencing_token() => w,
                slot => slot.insert(LossWaiter::new(tenure)),
            };
            if waiter.poll(cx).is_pending() {
                return Poll::Pending;
            }
            // The term ended: read the leadership again, with a new waiter if this node
            // still (or again) leads.
            self.waiter = None;
        }
    }

    fn call(&mut self, mut req: Request<ReqBody>) -> Self::Future {
        // Checked now, against the lease deadline, not a cached flag. A request is
        // admitted only with the readiness the inner service gave while this node led:
        // one that became leader between `poll_ready` and `call` answers as a follower,
        // and so does one called without readiness (logged: the caller's bug).
        match Tenure::current(&self.leadership) {
            Some(tenure) if self.readiness == Readiness::Reserved => {
                self.readiness = Readiness::Unpolled;
                let gate = self.cancel_on_loss.then(|| Gate {
                    head: RequestHead {
                        method: req.method().clone(),
                        uri: req.uri().clone(),
                        headers: req.headers().clone(),
                    },
                    tenure: tenure.clone(),
                    responder: Arc::clone(&self.responder),
                    waiter: None,
                });
                Tenures::admit(req.extensions_mut(), tenure);
                ResponseFuture::called(self.inner.call(req), gate)
            }
            tenure => {
                if tenure.is_some()
                    && matches!(self.readiness, Readiness::Unpolled | Readiness::Polled)
                {
                    self.log_unready_call();
                }
                self.give_back_readiness();
                ResponseFuture::answered(follower_answer(
                    &self.leadership,
                    &*self.responder,
                    req.method(),
                    req.uri(),
                    req.headers(),
                ))
            }
        }
    }
}

/// What a follower answers for a request with this method, URI and headers.
fn follower_answer<R, B>(
    leadership: &Leadership,
    responder: &R,
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
) -> Response<B>
where
    R: FollowerResponder<B> + ?Sized,
{
    if let Some(m) = leadership.metrics() {
        m.follower_response(leadership.node_id(), leadership.name());
    }
    // Never this node itself while it follows (its own former session may still
    // hold the lock): a redirect there would come straight back.
    let leader = leadership
        .leader()
        .filter(|leader| leader != leadership.node_id());
    let ctx = FollowerContext {
        leader: leader.as_deref(),
        method,
        uri,
        headers,
    };
    let mut res = responder.respond(&ctx);
    if let Some(value) = leader.and_then(|l| HeaderValue::try_from(l).ok()) {
        res.headers_mut().entry(LEADER_HEADER).or_insert(value);
    }
    res
}

/// Resolves when one term ends: [`Tenure::lost`], made only once a wait is needed (a
/// request the inner service takes and answers at once costs no allocation for it).
/// Fused: once ready, it stays ready without polling `lost` again.
struct LossWaiter {
    token: FencingToken,
    /// `None` once resolved. Behind a `Mutex` only so that its holders stay `Sync` (axum
    /// needs its services `Sync`): it is reached through `&mut` (`Mutex::get_mut`),
    /// never locked.
    lost: Mutex<Option<Pin<Box<dyn Future<Output = ()> + Send>>>>,
}

impl fmt::Debug for LossWaiter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LossWaiter")
            .field("token", &self.token)
            .finish_non_exhaustive()
    }
}

impl LossWaiter {
    fn new(tenure: Tenure) -> Self {
        Self {
            token: tenure.fencing_token(),
            lost: Mutex::new(Some(Box::pin(async move { tenure.lost().await }))),
        }
    }

    /// Ready once the term is over (and from then on); registers `cx` to be woken when
    /// it ends.
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let slot = self.lost.get_mut().unwrap_or_else(PoisonError::into_inner);
        let Some(lost) = slot.as_mut() else {
            return Poll::Ready(());
        };
        let poll = lost.as_mut().poll(cx);
        if poll.is_ready() {
            *slot = None;
        }
        poll
    }
}

/// The parts of a request a follower answer is built from, kept in cancel mode once
/// the request itself went to the inner service.
struct RequestHead {
    method: Method,
    uri: Uri,
    headers: HeaderMap,
}

/// A request admitted in cancel mode: its term, and what answers it if the term ends
/// first.
struct Gate<R> {
    tenure: Tenure,
    responder: Arc<R>,
    head: RequestHead,
    waiter: Option<LossWaiter>,
}

impl<R> Gate<R> {
    /// `true` once the term is over; registers `cx` to be woken when it ends.
    fn poll_over(&mut self, cx: &mut Context<'_>) -> bool {
        if !self.tenure.is_valid() {
            return true;
        }
        let tenure = &self.tenure;
        self.waiter
            .get_or_insert_with(|| LossWaiter::new(tenure.clone()))
            .poll(cx)
            .is_ready()
    }

    /// The follower answer for a request whose term ended in flight.
    fn answer<B>(self) -> Response<B>
    where
        R: FollowerResponder<B>,
    {
        follower_answer(
            self.tenure.leadership(),
            &*self.responder,
            &self.head.method,
            &self.head.uri,
            &self.head.headers,
        )
    }
}

pin_project! {
    /// The future of [`LeaderOnlyHttp`](crate::LeaderOnlyHttp): the inner service's
    /// (in cancel mode, dropped once the request's term ends), or a follower's ready
    /// answer. `R`, the responder, builds the answer for a request cancelled in flight.
    pub struct ResponseFuture<F, B, R = Reject> {
        #[pin]
        kind: Kind<F, B>,
        // Cancel mode only.
        gate: Option<Gate<R>>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<F, B> {
        Inner { #[pin] future: F },
        Answered { response: Option<Response<B>> },
        Done,
    }
}

impl<F, B, R> fmt::Debug for ResponseFuture<F, B, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match &self.kind {
            Kind::Inner { .. } => "in the inner service",
            Kind::Answered { .. } => "answered by the layer",
            Kind::Done => "done",
        };
        f.debug_struct("ResponseFuture")
            .field("kind", &kind)
            .field("tenure", &self.gate.as_ref().map(|g| &g.tenure))
            .finish()
    }
}

impl<F, B, R> ResponseFuture<F, B, R> {
    fn called(future: F, gate: Option<Gate<R>>) -> Self {
        Self {
            kind: Kind::Inner { future },
            gate,
        }
    }

    fn answered(response: Response<B>) -> Self {
        Self {
            kind: Kind::Answered {
                response: Some(response),
            },
            gate: None,
        }
    }
}

impl<F, B, E, R> Future for ResponseFuture<F, B, R>
where
    F: Future<Output = Result<Response<B>, E>>,
    R: FollowerResponder<B>,
{
    type Output = Result<Response<B>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        match this.kind.as_mut().project() {
            KindProj::Inner { future } => {
                let Some(gate) = this.gate.as_mut() else {
                    return future.poll(cx);
                };
                // Cancel mode: the inner future is polled only while the term is valid,
                // so that the handler makes no further step once it is over.
                if gate.tenure.is_valid() {
                    match future.poll(cx) {
                        Poll::Ready(output) => {
                            // Passed on only if the term held through the poll that
                            // completed it (a term, once over, stays over).
                            if gate.tenure.is_valid() {
                                this.kind.set(Kind::Done);
                                *this.gate = None;
                                return Poll::Ready(output);
                            }
                        }
                        Poll::Pending => {
                            if !gate.poll_over(cx) {
                                return Poll::Pending;
                            }
                        }
                    }
                }
                this.kind.set(Kind::Done);
                let gate = this.gate.take().expect("BUG: cancel mode without a gate");
                Poll::Ready(Ok(gate.answer()))
            }
            KindProj::Answered { response } => {
                let response = response
                    .take()
                    .expect("BUG: ResponseFuture polled after completion");
                this.kind.set(Kind::Done);
                Poll::Ready(Ok(response))
            }
            KindProj::Done => panic!("BUG: ResponseFuture polled after completion"),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::task::Waker;
    use std::time::Instant;

    use super::*;

    #[tokio::test]
    async fn a_loss_waiter_stays_ready_when_polled_again_after_its_term_ended() {
        let (leadership, control) = Leadership::manual("hook", "node-1");
        let mut cx = Context::from_waker(Waker::noop());
        control.lead_until(7, Instant::now() + Duration::from_secs(3600));
        let tenure = Tenure::current(&leadership).expect("leading");
        let mut waiter = LossWaiter::new(tenure.clone());
        assert!(waiter.poll(&mut cx).is_pending(), "the term goes on");
        control.expire();
        assert!(waiter.poll(&mut cx).is_ready(), "the lease expired");
        // The future behind it has completed: polling it again would panic ("`async fn`
        // resumed after completion"). The waiter stays ready without it.
        assert!(waiter.poll(&mut cx).is_ready());
        assert!(waiter.poll(&mut cx).is_ready());

        // A waiter made once the term is over is ready at its first poll, and after.
        let mut waiter = LossWaiter::new(tenure);
        assert!(waiter.poll(&mut cx).is_ready());
        assert!(waiter.poll(&mut cx).is_ready());
    }
}
