#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod future;
mod health;
mod layer;
mod responder;
mod service;

pub use future::ResponseFuture;
pub use health::LeaderHealth;
pub use layer::LeaderOnlyLayer;
pub use responder::{
    BoxResponder, FollowerContext, FollowerResponder, LEADER_HEADER, Redirect, Reject,
};
pub use service::LeaderOnly;
