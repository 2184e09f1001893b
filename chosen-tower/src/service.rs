//! The service.

use std::sync::Arc;
use std::task::{Context, Poll};

use chosen_core::{Election, Leadership};
use http::header::HeaderValue;
use http::{Request, Response};
use tower_service::Service;

use crate::future::ResponseFuture;
use crate::responder::{FollowerContext, FollowerResponder, LEADER_HEADER};

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
        let leader = self.leadership.leader();
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
