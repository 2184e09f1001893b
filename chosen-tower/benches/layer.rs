//! Per-request overhead of `LeaderOnlyHttp` against the bare service (`cargo bench -p chosen-tower`).

#![allow(missing_docs)] // criterion's macros generate undocumented items

use std::convert::Infallible;
use std::future::Future;
use std::hint::black_box;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

use chosen_core::Leadership;
use chosen_tower::LeaderOnlyHttpLayer;
use criterion::{Criterion, criterion_group, criterion_main};
use http::{Request, Response};
use tower::{Layer, Service, service_fn};

/// Calls the service once and polls its future, which the bench services make ready at
/// its first poll.
fn call<S>(svc: &mut S, req: Request<()>) -> Response<()>
where
    S: Service<Request<()>, Response = Response<()>, Error = Infallible>,
{
    let mut cx = Context::from_waker(Waker::noop());
    assert!(svc.poll_ready(&mut cx).is_ready());
    let mut fut = pin!(svc.call(req));
    match fut.as_mut().poll(&mut cx) {
        Poll::Ready(Ok(res)) => res,
        _ => unreachable!("the bench service is always ready"),
    }
}

fn bench(c: &mut Criterion) {
    let bare = || {
        service_fn(|_req: Request<()>| std::future::ready(Ok::<_, Infallible>(Response::new(()))))
    };
    let (leadership, control) = Leadership::manual("bench", "node-1");
    let mut group = c.benchmark_group("leader_only");

    let mut svc = bare();
    group.bench_function("bare service", |b| {
        b.iter(|| black_box(call(&mut svc, Request::new(()))));
    });

    control.lead(1);
    let mut svc = LeaderOnlyHttpLayer::new(leadership.clone()).layer(bare());
    group.bench_function("layer, leader (passes through)", |b| {
        b.iter(|| black_box(call(&mut svc, Request::new(()))));
    });

    let mut svc = LeaderOnlyHttpLayer::new(leadership.clone())
        .cancel_on_loss()
        .layer(bare());
    group.bench_function("layer, leader, cancel_on_loss (passes through)", |b| {
        b.iter(|| black_box(call(&mut svc, Request::new(()))));
    });

    control.follow(Some("node-2"));
    let mut svc = LeaderOnlyHttpLayer::new(leadership).layer(bare());
    group.bench_function("layer, follower (answers 503)", |b| {
        b.iter(|| black_box(call(&mut svc, Request::new(()))));
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
