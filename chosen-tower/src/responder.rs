//! What a follower answers.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::header::{HeaderValue, LOCATION, RETRY_AFTER};
use http::{HeaderMap, Method, Response, StatusCode, Uri};

/// The header that names the leader's node id on every follower answer, when known.
pub const LEADER_HEADER: &str = "x-chosen-leader";

/// What a follower knows when it answers instead of the inner service.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct FollowerContext<'a> {
    /// The leader's node id, when known.
    pub leader: Option<&'a str>,
    /// The request method.
    pub method: &'a Method,
    /// The request URI.
    pub uri: &'a Uri,
    /// The request headers.
    pub headers: &'a HeaderMap,
}

/// Builds the response a follower gives instead of calling the inner service.
///
/// Implemented by [`Reject`] (the default), [`Redirect`], and any
/// `Fn(&FollowerContext<'_>) -> Response<B> + Clone`.
pub trait FollowerResponder<B> {
    /// The answer. A `x-chosen-leader` header is added when the leader is known and the
    /// response does not set one.
    fn respond(&self, ctx: &FollowerContext<'_>) -> Response<B>;
}

impl<B, F> FollowerResponder<B> for F
where
    F: Fn(&FollowerContext<'_>) -> Response<B>,
{
    fn respond(&self, ctx: &FollowerContext<'_>) -> Response<B> {
        self(ctx)
    }
}

/// `503 Service Unavailable` with `Retry-After` and an empty body: the default.
#[derive(Debug, Clone, Copy)]
pub struct Reject {
    retry_after_secs: u64,
}

impl Reject {
    /// `Retry-After` is `retry_after` rounded up to whole seconds (at least 1).
    #[must_use]
    pub fn new(retry_after: Duration) -> Self {
        let secs = retry_after.as_secs() + u64::from(retry_after.subsec_nanos() > 0);
        Self {
            retry_after_secs: secs.max(1),
        }
    }
}

impl Default for Reject {
    fn default() -> Self {
        Self::new(Duration::from_secs(1))
    }
}

impl<B: Default> FollowerResponder<B> for Reject {
    fn respond(&self, _ctx: &FollowerContext<'_>) -> Response<B> {
        let mut res = Response::new(B::default());
        *res.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
        res.headers_mut()
            .insert(RETRY_AFTER, HeaderValue::from(self.retry_after_secs));
        res
    }
}

/// `307 Temporary Redirect` to the leader, at the URL a resolver builds from the
/// leader's node id and the request URI; `503` (as [`Reject`]) when no leader is known
/// or the resolver returns `None`. 307 keeps the method and body, so a `POST` is
/// re-sent to the leader.
#[derive(Clone)]
pub struct Redirect<F> {
    resolver: F,
    fallback: Reject,
}

impl<F> fmt::Debug for Redirect<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Redirect")
            .field("fallback", &self.fallback)
            .finish_non_exhaustive()
    }
}

impl<F> Redirect<F>
where
    F: Fn(&str, &Uri) -> Option<Uri>,
{
    /// A redirect built by `resolver(leader_node_id, request_uri)`.
    pub fn new(resolver: F) -> Self {
        Self {
            resolver,
            fallback: Reject::default(),
        }
    }
}

impl<B: Default, F> FollowerResponder<B> for Redirect<F>
where
    F: Fn(&str, &Uri) -> Option<Uri>,
{
    fn respond(&self, ctx: &FollowerContext<'_>) -> Response<B> {
        let location = ctx
            .leader
            .and_then(|leader| (self.resolver)(leader, ctx.uri))
            .and_then(|uri| HeaderValue::try_from(uri.to_string()).ok());
        match location {
            Some(location) => {
                let mut res = Response::new(B::default());
                *res.status_mut() = StatusCode::TEMPORARY_REDIRECT;
                res.headers_mut().insert(LOCATION, location);
                res
            }
            None => self.fallback.respond(ctx),
        }
    }
}

/// A shared responder: type-erases any [`FollowerResponder`] (handy to pick one at run
/// time).
pub struct BoxResponder<B>(Arc<dyn FollowerResponder<B> + Send + Sync>);

impl<B> Clone for BoxResponder<B> {
    fn clone(&self) -> Self {
        Self(Arc::clone(&self.0))
    }
}

impl<B> fmt::Debug for BoxResponder<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("BoxResponder")
    }
}

impl<B> BoxResponder<B> {
    /// Boxes a responder.
    pub fn new(responder: impl FollowerResponder<B> + Send + Sync + 'static) -> Self {
        Self(Arc::new(responder))
    }
}

impl<B> FollowerResponder<B> for BoxResponder<B> {
    fn respond(&self, ctx: &FollowerContext<'_>) -> Response<B> {
        self.0.respond(ctx)
    }
}
