//! A leader health endpoint for load balancers.

use std::convert::Infallible;
use std::future::{Ready, ready};
use std::task::{Context, Poll};

use chosen_core::Leadership;
use http::header::{CONTENT_TYPE, HeaderValue};
use http::{Request, Response, StatusCode};
use tower_service::Service;

use crate::responder::LEADER_HEADER;

/// Answers `200 leader` on the leader and `503 follower` elsewhere, with a
/// `x-chosen-leader` header naming the leader when known: for load balancer target
/// groups that should send traffic only to the leader, or a Kubernetes readiness probe.
///
/// ```
/// use axum::Router;
/// use chosen_tower::LeaderHealth;
/// # let (leadership, _c) = chosen_core::Leadership::manual("x", "n");
/// let app: Router = Router::new().route_service("/leader", LeaderHealth::new(leadership));
/// ```
#[derive(Debug, Clone)]
pub struct LeaderHealth {
    leadership: Leadership,
}

impl LeaderHealth {
    /// A health service for `leadership`.
    #[must_use]
    pub fn new(leadership: Leadership) -> Self {
        Self { leadership }
    }
}

impl<B> Service<Request<B>> for LeaderHealth {
    type Response = Response<String>;
    type Error = Infallible;
    type Future = Ready<Result<Response<String>, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _req: Request<B>) -> Self::Future {
        let leading = self.leadership.is_leader();
        let leader = self.leadership.leader();
        let body = match (leading, &leader) {
            (true, _) => "leader\n".to_owned(),
            (false, Some(l)) => format!("follower; leader is {l}\n"),
            (false, None) => "follower; no known leader\n".to_owned(),
        };
        let mut res = Response::new(body);
        *res.status_mut() = if leading {
            StatusCode::OK
        } else {
            StatusCode::SERVICE_UNAVAILABLE
        };
        res.headers_mut().insert(
            CONTENT_TYPE,
            HeaderValue::from_static("text/plain; charset=utf-8"),
        );
        if let Some(value) = leader.and_then(|l| HeaderValue::try_from(l).ok()) {
            res.headers_mut().insert(LEADER_HEADER, value);
        }
        ready(Ok(res))
    }
}
