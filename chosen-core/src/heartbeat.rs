//! The heartbeat: its own task per session, so that nothing the manager's task does (a
//! slow statement, a flood of notifications, a burst of requests) can delay it.

use std::sync::Arc;
use std::time::Instant;

use tokio::time::sleep_until;
use tracing::debug;

use crate::session::{self, Generation};
use crate::shared::Shared;
use crate::status::DisconnectReason;

/// Proves the session alive every heartbeat interval, on its own task, so nothing the
/// manager's task does can delay it. Each success extends the leases' validity from
/// the moment its query was *sent*; a failure, or no success within the lease timeout,
/// revokes the generation at once.
pub(crate) async fn run(
    session: session::HeartbeatSession,
    shared: Arc<Shared>,
    generation: Arc<Generation>,
    proven_at: Instant,
) {
    let interval = shared.options.heartbeat_interval;
    let lease_timeout = shared.options.lease_timeout;
    let revoke = |reason: DisconnectReason| {
        shared.invalidate();
        generation.revoke(reason);
    };
    let overdue = || DisconnectReason::HeartbeatOverdue { lease_timeout };
    let mut next = proven_at.checked_add(interval).unwrap_or(proven_at);
    loop {
        let watchdog = tokio::time::Instant::from_std(shared.valid_until());
        tokio::select! {
            biased;
            () = generation.revoked.cancelled() => return,
            () = sleep_until(watchdog) => return revoke(overdue()),
            () = sleep_until(tokio::time::Instant::from_std(next)) => {}
        }
        let sent = Instant::now();
        let (epoch, floor) = shared.server_floor();
        let result = tokio::select! {
            biased;
            () = generation.revoked.cancelled() => return,
            () = sleep_until(watchdog) => Err(overdue()),
            result = session.heartbeat() => result,
        };
        // Fewer locks than the manager held all along (no release was sent meanwhile):
        // another client of a shared backend released them.
        let result = result.and_then(|locks| match usize::try_from(locks) {
            Ok(locks) if locks < floor && shared.server_floor().0 == epoch => {
                Err(DisconnectReason::PoolerDetected {
                    detail: format!(
                        "the server shows {locks} advisory locks on this session, fewer than the {floor} it holds: another client released them (a transaction pooler sharing the backend, DISCARD ALL, pg_advisory_unlock_all)"
                    ),
                })
            }
            _ => Ok(()),
        });
        match result {
            Ok(()) => {
                let now = Instant::now();
                if !shared.renew_validity(sent + lease_timeout, now) {
                    // The deadline passed while the reply was on its way: too late.
                    return revoke(overdue());
                }
                let rtt = now.saturating_duration_since(sent);
                if let Some(m) = shared.options.metrics.as_deref() {
                    m.heartbeat(&shared.options.node_id, rtt);
                }
                debug!(rtt_us = rtt.as_micros() as u64, "heartbeat");
            }
            Err(reason) => return revoke(reason),
        }
        next = sent.checked_add(interval).unwrap_or(sent);
    }
}
