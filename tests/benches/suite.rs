//! The benchmark suite: chosen against the physical floor and its peers.
//!
//! ```text
//! cargo bench -p chosen-tests --bench suite            # full profile (a few minutes)
//! cargo bench -p chosen-tests --bench suite -- --smoke # tiny profile
//! cargo bench -p chosen-tests --bench suite -- --fenced # scenario 9 (fenced writes) alone
//! cargo bench -p chosen-tests --bench suite -- --throughput # scenario 10 (64 tasks) alone
//! cargo bench -p chosen-tests --bench suite -- --throughput --durable # with fsync on
//! ```
//!
//! Prints Markdown; `BENCHMARKS.md` holds the table of a full run.

#![allow(missing_docs)] // a benchmark binary

#[path = "suite_impl.rs"]
mod suite_impl;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let smoke = std::env::args().any(|a| a == "--smoke");
    let profile = if smoke {
        suite_impl::Profile::smoke()
    } else {
        suite_impl::Profile::full()
    };
    let report = if std::env::args().any(|a| a == "--fenced") {
        suite_impl::run_fenced(&profile).await?
    } else if std::env::args().any(|a| a == "--throughput") {
        suite_impl::run_throughput(&profile, std::env::args().any(|a| a == "--durable")).await?
    } else {
        suite_impl::run(&profile, env!("CARGO_BIN_EXE_chosen-holder")).await?
    };
    println!("{report}");
    Ok(())
}
