//! The leader-only HTTP middleware: [`LeaderOnlyHttpLayer`] wraps a service in
//! [`LeaderOnlyHttp`], whose [`ResponseFuture`] is the inner service's future on the
//! leader and a ready answer elsewhere.
//!
//! On the leader a request goes to the inner service unchanged; on a follower the
//! layer's [`FollowerResponder`] answers it (by default [`Reject`]: `503` with
//! `Retry-After`; or [`Redirect`] to the leader, or your own), and the response names
//! the leader in [`LEADER_HEADER`] when known. Leadership is read in `call`, never in
//! `poll_ready`, and the error type is the inner service's.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use chosen_core::{Election, Leadership, LockManager, LockRequest};
use http::header::HeaderValue;
use http::{Request, Response, Uri};
use pin_project_lite::pin_project;
use tower_layer::Layer;
use tower_service::Service;

use crate::responder::{FollowerContext, FollowerResponder, LEADER_HEADER, Redirect, Reject};

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
/// ([`Leadership::is_leader`]); `poll_ready` only forwards, so a follower never stalls
/// the caller. The error type stays the inner service's, so axum's `Infallible`
/// contract holds.
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
            election: self.election,
        }
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
        LeaderOnlyHttp::new(inner, self.leadership.clone(), self.responder.clone())
            .keeping(self.election.clone())
    }
}

/// The middleware [`LeaderOnlyHttpLayer`](crate::LeaderOnlyHttpLayer) applies: passes
/// HTTP requests to `inner` on the leader, answers them with `responder` elsewhere.
#[derive(Debug, Clone)]
pub struct LeaderOnlyHttp<S, R> {
    inner: S,
    leadership: Leadership,
    responder: R,
    /// The layer's own election, if it started one: kept alive while this service is.
    election: Option<Arc<Election>>,
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
            responder,
            election: None,
        }
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
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    R: FollowerResponder<ResBody>,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, ResBody>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // Never gate here: a follower must answer, not stall its caller.
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        // Checked now, against the lease deadline, not a cached flag.
        if self.leadership.is_leader() {
            return ResponseFuture::inner(self.inner.call(req));
        }
        if let Some(m) = self.leadership.metrics() {
            m.follower_response(self.leadership.node_id(), self.leadership.name());
        }
        // Never this node itself while it follows (its own former session may still
        // hold the lock): a redirect there would come straight back.
        let leader = self
            .leadership
            .leader()
            .filter(|leader| leader != self.leadership.node_id());
        let ctx = FollowerContext {
            leader: leader.as_deref(),
            method: req.method(),
            uri: req.uri(),
            headers: req.headers(),
        };
        let mut res = self.responder.respond(&ctx);
        if let Some(value) = leader.and_then(|l| HeaderValue::try_from(l).ok()) {
            res.headers_mut().entry(LEADER_HEADER).or_insert(value);
        }
        ResponseFuture::ready(res)
    }
}

pin_project! {
    /// The future of [`LeaderOnlyHttp`](crate::LeaderOnlyHttp): the inner service's, or a
    /// follower's ready answer.
    #[derive(Debug)]
    pub struct ResponseFuture<F, B> {
        #[pin]
        kind: Kind<F, B>,
    }
}

pin_project! {
    #[project = KindProj]
    #[derive(Debug)]
    enum Kind<F, B> {
        Inner { #[pin] future: F },
        Ready { response: Option<Response<B>> },
    }
}

impl<F, B> ResponseFuture<F, B> {
    pub(crate) fn inner(future: F) -> Self {
        Self {
            kind: Kind::Inner { future },
        }
    }

    pub(crate) fn ready(response: Response<B>) -> Self {
        Self {
            kind: Kind::Ready {
                response: Some(response),
            },
        }
    }
}

impl<F, B, E> Future for ResponseFuture<F, B>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<B>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            KindProj::Inner { future } => future.poll(cx),
            KindProj::Ready { response } => Poll::Ready(Ok(response
                .take()
                .expect("BUG: ResponseFuture polled after completion"))),
        }
    }
}
