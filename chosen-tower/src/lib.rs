#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod health;
mod leader_only;
mod responder;
mod tenure;

pub use health::LeaderHealth;
#[allow(deprecated)] // the old names, kept so that existing code still compiles
pub use leader_only::{
    LeaderOnly, LeaderOnlyHttp, LeaderOnlyHttpLayer, LeaderOnlyLayer, ResponseFuture,
};
pub use responder::{
    BoxResponder, FollowerContext, FollowerResponder, LEADER_HEADER, Redirect, Reject,
};
pub use tenure::{Tenure, Tenures};
