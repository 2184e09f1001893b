//! The layer.

use std::time::Duration;

use chosen_core::Leadership;
use http::Uri;
use tower_layer::Layer;

use crate::responder::{Redirect, Reject};
use crate::service::LeaderOnly;

/// Gates a service on leadership: on the leader, requests reach the inner service; on
/// a follower, the layer answers itself (by default `503` + `Retry-After: 1`), with a
/// `x-chosen-leader` header naming the leader when known.
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
/// use chosen_tower::LeaderOnlyLayer;
///
/// fn app(leadership: Leadership) -> Router {
///     Router::new()
///         .route("/", get(|| async { "served by every replica" }))
///         // Only the leader runs this; wrong methods still get 405:
///         .route(
///             "/admin/reindex",
///             post(|| async { "reindexing" }).route_layer(LeaderOnlyLayer::new(leadership.clone())),
///         )
///         // Or gate every route added so far (unknown paths stay 404, but a wrong
///         // method on a gated path answers 503 on followers):
///         .route("/admin/flush", post(|| async { "flushed" }))
///         .route_layer(LeaderOnlyLayer::new(leadership))
/// }
/// # let (l, _c) = Leadership::manual("x", "n");
/// # let _ = app(l);
/// ```
///
/// `Router::layer` would also wrap the fallback, so unknown paths would answer `503`
/// on followers instead of `404`.
#[derive(Debug, Clone)]
pub struct LeaderOnlyLayer<R = Reject> {
    leadership: Leadership,
    responder: R,
}

impl LeaderOnlyLayer {
    /// Followers answer `503 Service Unavailable` with `Retry-After: 1`.
    #[must_use]
    pub fn new(leadership: Leadership) -> Self {
        Self {
            leadership,
            responder: Reject::default(),
        }
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
    /// use chosen_tower::LeaderOnlyLayer;
    /// # let (leadership, _c) = chosen_core::Leadership::manual("x", "n");
    /// let layer = LeaderOnlyLayer::new(leadership).redirect(|leader, uri| {
    ///     // Node ids are host names in this fleet.
    ///     format!("http://{leader}:8080{}", uri.path_and_query()?.as_str()).parse().ok()
    /// });
    /// # let _ = layer;
    /// ```
    #[must_use]
    pub fn redirect<F>(self, resolver: F) -> LeaderOnlyLayer<Redirect<F>>
    where
        F: Fn(&str, &Uri) -> Option<Uri>,
    {
        LeaderOnlyLayer {
            leadership: self.leadership,
            responder: Redirect::new(resolver),
        }
    }
}

impl<R> LeaderOnlyLayer<R> {
    /// Followers answer whatever `responder` builds (any
    /// [`FollowerResponder`](crate::FollowerResponder), e.g. a closure
    /// `|ctx: &FollowerContext<'_>| -> Response<B>`).
    #[must_use]
    pub fn respond_with<R2>(self, responder: R2) -> LeaderOnlyLayer<R2> {
        LeaderOnlyLayer {
            leadership: self.leadership,
            responder,
        }
    }

    /// The leadership the layer reads.
    #[must_use]
    pub fn leadership(&self) -> &Leadership {
        &self.leadership
    }
}

impl<S, R: Clone> Layer<S> for LeaderOnlyLayer<R> {
    type Service = LeaderOnly<S, R>;

    fn layer(&self, inner: S) -> Self::Service {
        LeaderOnly::new(inner, self.leadership.clone(), self.responder.clone())
    }
}
