//! chosen-apalis: coming next.
//!
//! Run apalis 1.0 jobs, cron jobs above all, only on the node that holds a lock, so
//! that each tick runs once across the fleet. It builds on \`chosen_core::LockManager\`.
//!
//! This crate is a placeholder until that work lands.

#[doc(no_inline)]
pub use chosen_core;
