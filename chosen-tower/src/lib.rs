#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod future;
mod health;
mod layer;
mod responder;
mod service;

pub use future::ResponseFuture;
pub use health::LeaderHealth;
#[allow(deprecated)] // the old name, kept so that existing code still compiles
pub use layer::{LeaderOnlyHttpLayer, LeaderOnlyLayer};
pub use responder::{
    BoxResponder, FollowerContext, FollowerResponder, LEADER_HEADER, Redirect, Reject,
};
#[allow(deprecated)] // the old name, kept so that existing code still compiles
pub use service::{LeaderOnly, LeaderOnlyHttp};
