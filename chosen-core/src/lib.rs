#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod driver;
mod error;
mod key;
mod lease;
mod manager;
mod options;
mod session;
mod shared;
mod status;

pub use error::{Error, Result};
pub use key::{DEFAULT_NAMESPACE, LockKey};
pub use lease::{FencingToken, Lease};
pub use manager::{HolderInfo, LockInfo, LockManager, LockRequest, LockState};
pub use options::ManagerOptions;
pub use status::{ConnectionStatus, DisconnectReason};
