//! The response future.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::Response;
use pin_project_lite::pin_project;

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
