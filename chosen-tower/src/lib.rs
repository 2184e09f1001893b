//! chosen-tower: coming next.
//!
//! A tower \`Layer\` that serves leader-only routes (admin actions, webhooks that must be
//! handled once) only on the node that holds a lock, answering \`503\` + \`Retry-After\`
//! or a redirect to the leader elsewhere. It builds on \`chosen_core::LockManager\`.
//!
//! This crate is a placeholder until that work lands.

#[doc(no_inline)]
pub use chosen_core;
