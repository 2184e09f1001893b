#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod health;
mod leader_only;
mod responder;
mod tenure;

pub use health::LeaderHealth;
pub use leader_only::{LeaderOnlyHttp, LeaderOnlyHttpLayer, ResponseFuture};
pub use responder::{
    BoxResponder, FollowerContext, FollowerResponder, LEADER_HEADER, Redirect, Reject,
};
pub use tenure::{Tenure, Tenures};
