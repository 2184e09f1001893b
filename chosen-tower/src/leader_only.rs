//! The leader-only HTTP middleware: [`LeaderOnlyHttpLayer`] wraps a service in
//! [`LeaderOnlyHttp`], whose [`ResponseFuture`] is a ready answer on a follower and, on
//! the leader, waits for the inner service's readiness, then runs its future.
//!
//! On the leader a request goes to the inner service with its [`Tenure`] in its
//! extensions; on a follower the layer's [`FollowerResponder`] answers it (by default
//! [`Reject`]: `503` with `Retry-After`; or [`Redirect`] to the leader, or your own),
//! and the response names the leader in [`LEADER_HEADER`] when known. Leadership is
//! read in `call` and again once the inner service is ready, never in `poll_ready`
//! (which is always ready), and the error type is the inner service's.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use chosen_core::{Election, Leadership, LockManager, LockRequest};
use http::header::HeaderValue;
use http::{HeaderMap, Method, Request, Response, Uri};
use pin_project_lite::pin_project;
use tower_layer::Layer;
use tower_service::Service;

use crate::responder::{FollowerContext, FollowerResponder, LEADER_HEADER, Redirect, Reject};
use crate::tenure::Tenure;

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
/// ([`Leadership::is_leader`]). `poll_ready` is always ready, so a follower never
/// stalls the caller, not even behind a busy inner service (a `ConcurrencyLimit` full
/// of requests admitted while this node led): on the leader, the response future
/// waits for the inner service's readiness (as `tower::util::Oneshot` does), so its
/// backpressure still holds, and checks leadership again once it is ready. This is why
/// the inner service must be `Clone`: each admitted request takes a clone of it to
/// wait on (`tower::buffer::Buffer` makes any service `Clone`; axum requires `Clone`
/// already). The error type stays the inner service's, so axum's `Infallible`
/// contract holds.
///
/// A request passed to the inner service carries its [`Tenure`] (the term's fencing
/// token, validity and loss) in its extensions. By default it runs to completion even
/// if the lease is lost meanwhile; with [`cancel_on_loss`](Self::cancel_on_loss) it is
/// dropped and answered `503` instead. The crate documentation, "A request in flight
/// when the lease is lost", states what each mode guarantees.
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

/// The name before the apalis gate got a layer of its own: both were `LeaderOnlyLayer`,
/// so a service using both crates could not import both.
#[deprecated(
    note = "renamed to `LeaderOnlyHttpLayer` (chosen-apalis' gate is `LeaderOnlyJobLayer`)"
)]
pub type LeaderOnlyLayer<R = Reject> = LeaderOnlyHttpLayer<R>;

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
    /// the client retries, on the new leader. A response the inner service completed
    /// while the term was valid is passed on. The default is to let a request in
    /// flight run to completion.
    ///
    /// What is done is not undone: writes the handler made before the loss stay made,
    /// and tasks it spawned go on. Fence such writes with the request's
    /// [`Tenure`]. The crate documentation, "A request in flight when the lease is
    /// lost", has the details.
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
/// A `Service` only for an inner service that is `Clone`: each request admitted on
/// the leader waits for the readiness of a clone of it, in the response future.
#[derive(Debug)]
pub struct LeaderOnlyHttp<S, R> {
    inner: S,
    leadership: Leadership,
    /// Shared with the response futures, which answer for a term that ended.
    responder: Arc<R>,
    cancel_on_loss: bool,
    /// The layer's own election, if it started one: kept alive while this service is.
    election: Option<Arc<Election>>,
}

// Not derived: the responder is shared, so it need not be `Clone` itself.
impl<S: Clone, R> Clone for LeaderOnlyHttp<S, R> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            leadership: self.leadership.clone(),
            responder: Arc::clone(&self.responder),
            cancel_on_loss: self.cancel_on_loss,
            election: self.election.clone(),
        }
    }
}

/// The name before the apalis gate got a service of its own: both were `LeaderOnly`.
#[deprecated(note = "renamed to `LeaderOnlyHttp` (chosen-apalis' gate service is `LeaderOnlyJob`)")]
pub type LeaderOnly<S, R> = LeaderOnlyHttp<S, R>;

impl<S, R> LeaderOnlyHttp<S, R> {
    /// Wraps `inner`.
    pub fn new(inner: S, leadership: Leadership, responder: R) -> Self {
        Self {
            inner,
            leadership,
            responder: Arc::new(responder),
            cancel_on_loss: false,
            election: None,
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

impl<S, R, ReqBody, ResBody> Service<Request<ReqBody>> for LeaderOnlyHttp<S, R>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
    R: FollowerResponder<ResBody>,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = ResponseFuture<S, R, ReqBody>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // Always ready: a follower answers without the inner service, so it must not
        // wait for the inner's readiness; the leader's request waits for it in the
        // response future instead (as `tower::util::Oneshot` does).
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        // Checked now, against the lease deadline, not a cached flag.
        match Tenure::current(&self.leadership) {
            Some(tenure) => {
                // tower's `mem::replace` idiom: the service itself goes with the
                // request (which makes it ready in the response future), a clone stays
                // for the next call.
                let clone = self.inner.clone();
                let inner = std::mem::replace(&mut self.inner, clone);
                ResponseFuture::admitted(
                    inner,
                    req,
                    Gate {
                        tenure,
                        responder: Arc::clone(&self.responder),
                        cancel_on_loss: self.cancel_on_loss,
                        head: None,
                        lost: None,
                    },
                )
            }
            None => ResponseFuture::answered(follower_answer(
                &self.leadership,
                &*self.responder,
                req.method(),
                req.uri(),
                req.headers(),
            )),
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

/// The parts of a request a follower answer is built from, kept in cancel mode once
/// the request itself went to the inner service.
struct RequestHead {
    method: Method,
    uri: Uri,
    headers: HeaderMap,
}

/// A request the leader admitted: its term, and what answers it if the term ends first.
struct Gate<R> {
    tenure: Tenure,
    responder: Arc<R>,
    cancel_on_loss: bool,
    /// Kept in cancel mode, once the request went to the inner service.
    head: Option<RequestHead>,
    /// [`Tenure::lost`], made only once a wait is needed: a request the inner service
    /// takes and answers at once costs no allocation for it.
    lost: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
}

impl<R> Gate<R> {
    /// `true` once the term is over; registers `cx` to be woken when it ends.
    fn poll_over(&mut self, cx: &mut Context<'_>) -> bool {
        if !self.tenure.is_valid() {
            return true;
        }
        let lost = self.lost.get_or_insert_with(|| {
            let tenure = self.tenure.clone();
            Box::pin(async move { tenure.lost().await })
        });
        lost.as_mut().poll(cx).is_ready()
    }

    fn answer<B>(&self, method: &Method, uri: &Uri, headers: &HeaderMap) -> Response<B>
    where
        R: FollowerResponder<B>,
    {
        follower_answer(
            self.tenure.leadership(),
            &*self.responder,
            method,
            uri,
            headers,
        )
    }
}

pin_project! {
    /// The future of [`LeaderOnlyHttp`](crate::LeaderOnlyHttp): a follower's ready
    /// answer, or, on the leader, the inner service's readiness, then its future.
    pub struct ResponseFuture<S: Service<Request<ReqBody>>, R, ReqBody> {
        #[pin]
        state: State<S, ReqBody>,
        // `None` for a follower's answer, and once the inner service was called outside
        // cancel mode.
        gate: Option<Gate<R>>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S: Service<Request<ReqBody>>, ReqBody> {
        Answered { response: Option<S::Response> },
        Admitted { inner: S, req: Option<Request<ReqBody>> },
        Called { #[pin] future: S::Future },
        Done,
    }
}

impl<S, R, ReqBody> fmt::Debug for ResponseFuture<S, R, ReqBody>
where
    S: Service<Request<ReqBody>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &self.state {
            State::Answered { .. } => "answered by the layer",
            State::Admitted { .. } => "waiting for the inner service to be ready",
            State::Called { .. } => "in the inner service",
            State::Done => "done",
        };
        f.debug_struct("ResponseFuture")
            .field("state", &state)
            .field("tenure", &self.gate.as_ref().map(|g| &g.tenure))
            .finish()
    }
}

impl<S, R, ReqBody> ResponseFuture<S, R, ReqBody>
where
    S: Service<Request<ReqBody>>,
{
    fn answered(response: S::Response) -> Self {
        Self {
            state: State::Answered {
                response: Some(response),
            },
            gate: None,
        }
    }

    fn admitted(inner: S, req: Request<ReqBody>, gate: Gate<R>) -> Self {
        Self {
            state: State::Admitted {
                inner,
                req: Some(req),
            },
            gate: Some(gate),
        }
    }
}

impl<S, R, ReqBody, ResBody> Future for ResponseFuture<S, R, ReqBody>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    R: FollowerResponder<ResBody>,
{
    type Output = Result<Response<ResBody>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Answered { response } => {
                    let response = response
                        .take()
                        .expect("BUG: ResponseFuture polled after completion");
                    this.state.set(State::Done);
                    return Poll::Ready(Ok(response));
                }
                StateProj::Admitted { inner, req } => {
                    let gate = this.gate.as_mut().expect("BUG: admitted without a gate");
                    match inner.poll_ready(cx) {
                        Poll::Ready(Ok(())) => {}
                        Poll::Ready(Err(e)) => {
                            this.state.set(State::Done);
                            return Poll::Ready(Err(e));
                        }
                        Poll::Pending => {
                            // A request whose term ends while it waits for the inner
                            // service is answered as a follower would, at once.
                            if gate.poll_over(cx) {
                                let req = req.take().expect("BUG: admitted twice");
                                let res = gate.answer(req.method(), req.uri(), req.headers());
                                this.state.set(State::Done);
                                return Poll::Ready(Ok(res));
                            }
                            return Poll::Pending;
                        }
                    }
                    // Checked again now that the inner service is ready: the term may
                    // have ended while the request waited.
                    if !gate.tenure.is_valid() {
                        let req = req.take().expect("BUG: admitted twice");
                        let res = gate.answer(req.method(), req.uri(), req.headers());
                        this.state.set(State::Done);
                        return Poll::Ready(Ok(res));
                    }
                    let mut req = req.take().expect("BUG: admitted twice");
                    if gate.cancel_on_loss {
                        gate.head = Some(RequestHead {
                            method: req.method().clone(),
                            uri: req.uri().clone(),
                            headers: req.headers().clone(),
                        });
                    }
                    req.extensions_mut().insert(gate.tenure.clone());
                    let future = inner.call(req);
                    if !gate.cancel_on_loss {
                        *this.gate = None;
                    }
                    this.state.set(State::Called { future });
                }
                StateProj::Called { future } => {
                    // In cancel mode the inner future is polled only while the term is
                    // valid: once it is over, the handler makes no further step.
                    if this.gate.as_ref().is_some_and(|g| !g.tenure.is_valid()) {
                        return Poll::Ready(Ok(cancel(this.state, this.gate)));
                    }
                    if let Poll::Ready(output) = future.poll(cx) {
                        this.state.set(State::Done);
                        *this.gate = None;
                        return Poll::Ready(output);
                    }
                    if this.gate.as_mut().is_some_and(|g| g.poll_over(cx)) {
                        return Poll::Ready(Ok(cancel(this.state, this.gate)));
                    }
                    return Poll::Pending;
                }
                StateProj::Done => panic!("BUG: ResponseFuture polled after completion"),
            }
        }
    }
}

/// Drops the inner future of a request whose term ended (cancel mode) and answers it
/// as a follower would.
fn cancel<S, R, ReqBody, ResBody>(
    mut state: Pin<&mut State<S, ReqBody>>,
    gate: &mut Option<Gate<R>>,
) -> Response<ResBody>
where
    S: Service<Request<ReqBody>>,
    R: FollowerResponder<ResBody>,
{
    state.set(State::Done);
    let gate = gate.take().expect("BUG: cancel without a gate");
    let head = gate.head.as_ref().expect("BUG: cancel mode keeps the head");
    gate.answer(&head.method, &head.uri, &head.headers)
}
