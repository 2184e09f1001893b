//! A process that takes one lock and reports, for fault tests that freeze or kill it.
//!
//! `chosen-holder URL LOCK NODE_ID` prints, one per line (times in Unix microseconds):
//!
//! * `acquired TOKEN TIME` once it holds the lock;
//! * `tick TIME` every 10 ms while `Lease::is_valid()` says the lease may be trusted;
//! * `lost TIME REASON` when it no longer may; then it exits.

use std::io::Write;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use chosen_core::{LockManager, ManagerOptions};

fn now_us() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros())
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let (Some(url), Some(lock), Some(node)) = (args.next(), args.next(), args.next()) else {
        return Err("usage: chosen-holder URL LOCK NODE_ID".into());
    };
    let manager = LockManager::connect(ManagerOptions::from_url(&url)?.node_id(node)).await?;
    let lease = manager.acquire(lock.as_str()).await?;
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "acquired {} {}",
        lease.fencing_token().await.unwrap(),
        now_us()
    )?;
    out.flush()?;
    let mut ticks = tokio::time::interval(Duration::from_millis(10));
    loop {
        ticks.tick().await;
        // The check a guarded piece of work makes before each step.
        if lease.is_valid() {
            writeln!(out, "tick {}", now_us())?;
        } else {
            let reason = lease
                .loss_reason()
                .map(|r| r.to_string())
                .unwrap_or_default();
            writeln!(out, "lost {} {reason}", now_us())?;
            out.flush()?;
            return Ok(());
        }
        out.flush()?;
    }
}
