//! Carrying out a [`Plan`] in one pipelined round trip, and reading its answers into
//! a [`Done`].

use tokio_postgres::error::SqlState;
use tracing::warn;

use super::statements::pair_arrays;
use super::*;
use crate::engine::{Done, TryFailed};
use crate::error::Result;
use crate::fault::{Fault, error_text};
use crate::key::LockKey;
use crate::table::{FenceCheck, Plan};

impl PgLink {
    /// Runs a plan's statements, issued together: tokio-postgres pipelines them on the
    /// one connection, so a step costs one round trip. A failure that ends the session
    /// is an `Err`; a statement that failed with the session intact is in [`Done`],
    /// and a failed try statement's error is returned beside it (the requests that
    /// asked once are answered with it).
    pub(super) async fn perform_plan(
        &self,
        plan: &Plan,
    ) -> Result<(Done, Option<tokio_postgres::Error>), Fault> {
        let unlocking = async {
            if plan.unlock.is_empty() && plan.unlock_quiet.is_empty() {
                return Ok(());
            }
            // One statement: every key unlocked, only the first ones announced (each
            // for one node when handed over to it).
            let keys: Vec<LockKey> = plan
                .unlock
                .iter()
                .chain(&plan.unlock_quiet)
                .copied()
                .collect();
            let targets: crate::maps::HashMap<LockKey, u64> =
                plan.hand_to.iter().copied().collect();
            let tags = plan
                .unlock
                .iter()
                .map(|k| k.announcement(targets.get(k).copied()))
                .collect();
            self.unlock_announcing(&keys, tags).await
        };
        let unfencing = async {
            if plan.unfence.is_empty() {
                Ok(())
            } else {
                self.unfence(&plan.unfence).await
            }
        };
        let token = async {
            if plan.token_for.is_empty() && plan.token_read.is_empty() {
                return Ok(None);
            }
            let mut keys: Vec<LockKey> = plan
                .token_for
                .iter()
                .chain(&plan.token_read)
                .copied()
                .collect();
            keys.sort_unstable();
            keys.dedup();
            match self.fresh_token(&keys).await {
                Ok(t) => Ok(Some(t)),
                Err(Fault::Query(e)) => {
                    warn!(error = %error_text(&e), "could not issue a fencing token (a local hand-off is released instead; a holder's read fails and may be retried)");
                    Ok(None)
                }
                Err(lost) => Err(lost),
            }
        };
        let trying = async {
            if plan.try_keys.is_empty() {
                return Ok(((Ok(Vec::new()), None), Vec::new(), Vec::new(), Vec::new()));
            }
            match self
                .try_keys(&plan.try_keys, &plan.register, &plan.verify, &plan.lazy)
                .await
            {
                Ok(t) => Ok(((Ok(t.outcomes), None), t.registered, t.seen_held, t.senders)),
                Err(Fault::Query(error)) => {
                    let full = error.code() == Some(&SqlState::OUT_OF_MEMORY);
                    let keys = plan.try_keys.len();
                    if full {
                        warn!(keys, error = %error_text(&error), "the server's lock table is full (SQLSTATE 53200); locks not acquired, will retry. Raise max_locks_per_transaction or hold fewer locks");
                    } else {
                        warn!(keys, error = %error_text(&error), "acquire statement failed; will retry");
                    }
                    let (failed, error) = if full {
                        (TryFailed::LockTableFull, None)
                    } else {
                        (TryFailed::Failed, Some(error))
                    };
                    Ok(((Err(failed), error), Vec::new(), Vec::new(), Vec::new()))
                }
                Err(lost) => Err(lost),
            }
        };
        let fencing = async {
            if plan.fence.is_empty() {
                Ok(Vec::new())
            } else {
                self.fence(&plan.fence).await
            }
        };
        let checking = async {
            if plan.check.is_empty() {
                return Ok(Vec::new());
            }
            match self.check_fences(&plan.check).await {
                Err(Fault::Query(e)) => {
                    warn!(error = %error_text(&e), "could not check stop fences; will retry");
                    Ok(plan
                        .check
                        .iter()
                        .map(|k| (*k, FenceCheck::Failed))
                        .collect())
                }
                other => other,
            }
        };
        let unregistering = async {
            if plan.unregister.is_empty() {
                return Ok(());
            }
            let (ia, ib) = pair_arrays(plan.unregister.iter().map(|b| LockKey::interest_of(*b)));
            match self
                .unlock_shared_held(&ia, &ib, "interest keys", false)
                .await
            {
                // A leaked interest key costs other sessions a NOTIFY now and then.
                Err(Fault::Query(e)) => {
                    warn!(error = %error_text(&e), "could not release interest keys");
                    Ok(())
                }
                other => other,
            }
        };
        let ((unlocked, unfenced, token, unregistered), (tried, fenced, checked)) = tokio::join!(
            async { tokio::join!(unlocking, unfencing, token, unregistering) },
            async { tokio::join!(trying, fencing, checking) },
        );
        unlocked?;
        unfenced?;
        unregistered?;
        let ((tried, try_error), registered, seen_held, senders) = tried?;
        let done = Done {
            token: token?,
            tried,
            registered,
            seen_held,
            senders,
            fenced: fenced?,
            checked: checked?,
        };
        Ok((done, try_error))
    }
}
