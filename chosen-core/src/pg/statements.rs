//! The session's statements, one method each: they run what they are given and report
//! what the server answered, deciding nothing.

use std::sync::Arc;

use tracing::warn;

use super::sql::*;
use super::*;
use crate::error::Result;
use crate::fault::{Fault, classify, error_text};
use crate::info::HolderInfo;
use crate::key::LockKey;
use crate::status::SessionDownReason;
use crate::table::{Backend, FenceCheck, TryOutcome};
use crate::token::FencingToken;

/// A statement parameter.
type Param<'a> = &'a (dyn tokio_postgres::types::ToSql + Sync);

impl PgLink {
    /// Tries every key in one statement; the keys of `register` that are not won
    /// register interest in their bucket (see [`TRY_KEYS_SQL`]). Answers the outcome
    /// per key and the keys whose bucket's interest key was taken. On a statement error
    /// (e.g. the server's lock table is full), the locks it took are undone first and
    /// the error is returned as [`Fault::Query`].
    pub(crate) async fn try_keys(
        &self,
        keys: &[LockKey],
        register: &[LockKey],
        verify: &[(LockKey, i32)],
        lazy: &[LockKey],
    ) -> Result<Tried, Fault> {
        type Row = (
            i64,
            Option<i64>,
            Option<i32>,
            Option<i32>,
            Option<i32>,
            Option<i64>,
            Option<i64>,
        );
        let (fa, fb) = fence_arrays(keys);
        let reg: Vec<bool> = keys.iter().map(|k| register.contains(k)).collect();
        let (ia, ib) = interest_arrays(keys);
        // The announcer's pid per key, for the start of its backend once won.
        let ap: Vec<Option<i32>> = keys
            .iter()
            .map(|k| verify.iter().find(|(v, _)| v == k).map(|(_, pid)| *pid))
            .collect();
        // Take the token with the win (the plan's `lazy` keys take none).
        let tok: Vec<bool> = keys
            .iter()
            .map(|k| lazy.binary_search(k).is_err())
            .collect();
        // One key: the single-key statement, the same parameters as scalars (its rows
        // carry no index column); more: the batched one, with arrays.
        let single = keys.len() == 1;
        let one;
        let many;
        let mut params: Vec<Param<'_>> = Vec::with_capacity(13);
        if single {
            one = key_params(keys[0]);
            params.extend::<[Param<'_>; 3]>([&one.0, &one.1, &one.2]);
        } else {
            many = key_arrays(keys);
            params.extend::<[Param<'_>; 3]>([&many.0, &many.1, &many.2]);
        }
        params.extend::<[Param<'_>; 3]>([&self.backend_pid, &self.marker, &self.database_oid]);
        if single {
            params.extend::<[Param<'_>; 7]>([
                &fa[0], &fb[0], &reg[0], &ia[0], &ib[0], &ap[0], &tok[0],
            ]);
        } else {
            params.extend::<[Param<'_>; 7]>([&fa, &fb, &reg, &ia, &ib, &ap, &tok]);
        }
        let statement = if single {
            &self.stmts.try_one
        } else {
            &self.stmts.try_keys
        };
        let at = usize::from(!single);
        let result = self
            .client
            .query(statement, &params)
            .await
            .and_then(|rows| {
                rows.iter()
                    .map(|r| {
                        Ok((
                            if single { 1 } else { r.try_get(0)? },
                            r.try_get(at)?,
                            r.try_get(at + 1)?,
                            r.try_get(at + 2)?,
                            r.try_get(at + 3)?,
                            r.try_get(at + 4)?,
                            r.try_get(at + 5)?,
                        ))
                    })
                    .collect::<Result<Vec<Row>, _>>()
            });
        let rows = match result.map_err(classify) {
            Ok(rows) => rows,
            Err(Fault::Lost(reason)) => return Err(Fault::Lost(reason)),
            Err(Fault::Query(e)) => {
                // Session locks taken before the error survive it: undo them, and any
                // fence probe the error caught between its take and its release.
                let mut taken = keys.to_vec();
                taken.extend(keys.iter().map(|k| k.stop_fence()));
                self.cleanup(&taken).await?;
                // And the interest keys it may have taken (none of them was held).
                if !register.is_empty() {
                    let (ia, ib) = interest_arrays(register);
                    self.unlock_shared_held(&ia, &ib, "interest keys", true)
                        .await?;
                }
                return Err(Fault::Query(e));
            }
        };
        if rows.is_empty() {
            return Err(self
                .guard_failed("a try statement ran on another backend than the session's own")
                .await);
        }
        let mut out: Vec<(LockKey, TryOutcome)> = keys
            .iter()
            .map(|k| (*k, TryOutcome::Held { by: None }))
            .collect();
        let mut registered = Vec::new();
        let mut seen_held = Vec::new();
        let mut senders = Vec::new();
        for (i, token, holder, fence_holder, how, holder_start, sender_start) in rows {
            let Some(at) = usize::try_from(i.saturating_sub(1))
                .ok()
                .filter(|at| *at < out.len())
            else {
                continue;
            };
            let entry = &mut out[at];
            if matches!(how, Some(2 | 3)) {
                registered.push(entry.0);
            }
            if matches!(how, Some(3 | 4)) {
                seen_held.push(entry.0);
            }
            let won = matches!(how, Some(1 | 3 | 4));
            if won && ap[at].is_some() {
                senders.push((entry.0, sender_start));
            }
            let token = token.map(|t| self.issue(t));
            entry.1 = match (won, fence_holder) {
                (true, Some(by)) => TryOutcome::WonFenced {
                    token,
                    // 0: the fence was let go between the probe and the read.
                    by: (by != 0).then_some(by),
                },
                (true, None) => TryOutcome::Won(token),
                (false, _) => TryOutcome::Held {
                    by: holder.map(|pid| Backend {
                        pid,
                        start: holder_start,
                    }),
                },
            };
        }
        Ok(Tried {
            outcomes: out,
            registered,
            seen_held,
            senders,
        })
    }

    /// Unlocks what a failed try statement may have locked.
    pub(super) async fn cleanup(&self, keys: &[LockKey]) -> Result<(), Fault> {
        let (a, b, big) = key_arrays(keys);
        let rows = self
            .client
            .query(
                &self.stmts.cleanup,
                &[
                    &a,
                    &b,
                    &big,
                    &self.database_oid,
                    &self.backend_pid,
                    &self.marker,
                ],
            )
            .await;
        match rows.map_err(classify) {
            Ok(rows) if rows.is_empty() => Err(pooler(
                "the clean-up after a failed try ran on another backend than the session's own",
            )),
            Ok(_) => Ok(()),
            Err(Fault::Lost(reason)) => Err(Fault::Lost(reason)),
            Err(Fault::Query(e)) => Err(Fault::Lost(SessionDownReason::ConnectionLost {
                message: format!(
                    "could not undo a failed acquire ({}); dropping the session to release everything",
                    error_text(&e)
                ),
            })),
        }
    }

    /// Releases the stop fences of `keys` and announces the keys: the work this process
    /// ran under them, in an ended session, has stopped.
    pub(crate) async fn unfence(&self, keys: &[LockKey]) -> Result<(), Fault> {
        let (fa, fb) = fence_arrays(keys);
        let tags: Vec<String> = keys.iter().map(|k| k.tag()).collect();
        let rows = self
            .client
            .query(
                &self.stmts.unfence,
                &[&fa, &fb, &tags, &self.backend_pid, &self.marker],
            )
            .await
            .and_then(|rows| {
                rows.iter()
                    .map(|r| r.try_get::<_, Option<bool>>(1))
                    .collect::<Result<Vec<_>, _>>()
            });
        released(rows, keys.len(), "stop fences")
    }

    /// Unlocks `keys` and announces `tags`, in one statement.
    pub(super) async fn unlock_announcing(
        &self,
        keys: &[LockKey],
        tags: Vec<String>,
    ) -> Result<(), Fault> {
        // The single-key form always announces: only for one key with its tag.
        let result = if let ([key], [tag]) = (keys, tags.as_slice()) {
            let (a, b, big) = key_params(*key);
            let LockKey::Pair(ia, ib) = key.interest() else {
                unreachable!("BUG: interest keys are two-int4 keys")
            };
            self.client
                .query(
                    &self.stmts.unlock_one,
                    &[&a, &b, &big, tag, &self.backend_pid, &self.marker, &ia, &ib],
                )
                .await
                .and_then(|rows| {
                    rows.iter()
                        .map(|r| r.try_get::<_, Option<bool>>(0))
                        .collect::<Result<Vec<_>, _>>()
                })
        } else {
            let (a, b, big) = key_arrays(keys);
            let (ia, ib) = interest_arrays(&keys[..tags.len().min(keys.len())]);
            self.client
                .query(
                    &self.stmts.unlock,
                    &[
                        &a,
                        &b,
                        &big,
                        &tags,
                        &self.backend_pid,
                        &self.marker,
                        &ia,
                        &ib,
                    ],
                )
                .await
                .and_then(|rows| {
                    rows.iter()
                        .map(|r| r.try_get::<_, Option<bool>>(1))
                        .collect::<Result<Vec<_>, _>>()
                })
        };
        released(result, keys.len(), "locks")
    }

    /// Takes the stop fences of `keys` (shared); `true` per fence now held. When the
    /// statement fails (a take waited too long, the lock table is full), the fences it
    /// took are kept, read back from the lock table: `false` only for the others, which
    /// are tried again soon.
    pub(crate) async fn fence(&self, keys: &[LockKey]) -> Result<Vec<(LockKey, bool)>, Fault> {
        let (fa, fb) = fence_arrays(keys);
        let rows = self
            .client
            .query(
                &self.stmts.fence,
                &[
                    &fa,
                    &fb,
                    &self.backend_pid,
                    &self.marker,
                    &FENCE_LOCK_TIMEOUT,
                ],
            )
            .await
            .and_then(|rows| {
                rows.iter()
                    .map(|r| Ok((r.try_get::<_, i64>(0)?, r.try_get::<_, Option<bool>>(1)?)))
                    .collect::<Result<Vec<_>, _>>()
            });
        let rows = match rows.map_err(classify) {
            Ok(rows) => rows,
            Err(Fault::Query(e)) => {
                warn!(
                    error = %error_text(&e),
                    "could not take every stop fence; keeping those taken, trying the others again"
                );
                self.client
                    .query(
                        &self.stmts.fences_held,
                        &[
                            &fa,
                            &fb,
                            &self.database_oid,
                            &self.backend_pid,
                            &self.marker,
                        ],
                    )
                    .await
                    .and_then(|rows| {
                        rows.iter()
                            .map(|r| {
                                Ok((r.try_get::<_, i64>(0)?, r.try_get::<_, Option<bool>>(1)?))
                            })
                            .collect::<Result<Vec<_>, _>>()
                    })
                    .map_err(|e| match classify(e) {
                        Fault::Lost(reason) => Fault::Lost(reason),
                        // Nothing is known: end the session rather than leak a fence.
                        Fault::Query(e) => Fault::Lost(SessionDownReason::ConnectionLost {
                            message: format!(
                                "could not tell which stop fences a failed statement took ({}); dropping the session to release everything",
                                error_text(&e)
                            ),
                        }),
                    })?
            }
            Err(lost) => return Err(lost),
        };
        if rows.is_empty() && !keys.is_empty() {
            return Err(pooler(
                "a fence statement ran on another backend than the session's own",
            ));
        }
        let mut out: Vec<(LockKey, bool)> = keys.iter().map(|k| (*k, false)).collect();
        for (i, taken) in rows {
            if let Some(entry) = usize::try_from(i.saturating_sub(1))
                .ok()
                .and_then(|i| out.get_mut(i))
            {
                entry.1 = taken == Some(true);
            }
        }
        Ok(out)
    }

    /// Releases, without announcing, the shared two-int4 keys (`a`, `b`) this backend
    /// holds, once each: the interest keys a failed try statement took, interest keys no
    /// longer needed (`what` names them in errors). A statement error ends the session
    /// when `fatal` (nothing is known), else it is returned as [`Fault::Query`].
    pub(super) async fn unlock_shared_held(
        &self,
        fa: &[i32],
        fb: &[i32],
        what: &str,
        fatal: bool,
    ) -> Result<(), Fault> {
        let rows = self
            .client
            .query(
                &self.stmts.unlock_shared,
                &[
                    &fa,
                    &fb,
                    &self.database_oid,
                    &self.backend_pid,
                    &self.marker,
                ],
            )
            .await;
        match rows.map_err(classify) {
            Ok(rows) if rows.is_empty() => Err(pooler(&format!(
                "the release of {what} ran on another backend than the session's own"
            ))),
            Ok(_) => Ok(()),
            Err(Fault::Lost(reason)) => Err(Fault::Lost(reason)),
            Err(Fault::Query(e)) if !fatal => Err(Fault::Query(e)),
            // Nothing is known: end the session rather than leak what it took.
            Err(Fault::Query(e)) => Err(Fault::Lost(SessionDownReason::ConnectionLost {
                message: format!(
                    "could not release {what} ({}); dropping the session to release everything",
                    error_text(&e)
                ),
            })),
        }
    }

    /// Checks the stop fences of `keys`.
    pub(crate) async fn check_fences(
        &self,
        keys: &[LockKey],
    ) -> Result<Vec<(LockKey, FenceCheck)>, Fault> {
        let (a, b) = fence_arrays(keys);
        let rows = self
            .client
            .query(
                &self.stmts.check_fences,
                &[&a, &b, &self.backend_pid, &self.marker, &self.database_oid],
            )
            .await
            .map_err(classify)?;
        if rows.is_empty() && !keys.is_empty() {
            return Err(pooler(
                "a fence check ran on another backend than the session's own",
            ));
        }
        let mut out: Vec<(LockKey, FenceCheck)> =
            keys.iter().map(|k| (*k, FenceCheck::Failed)).collect();
        for row in &rows {
            let parsed = (|| {
                Ok::<_, tokio_postgres::Error>((
                    row.try_get::<_, i64>(0)?,
                    row.try_get::<_, Option<i32>>(1)?,
                ))
            })();
            let Ok((i, holder)) = parsed else {
                continue;
            };
            let Some(entry) = usize::try_from(i.saturating_sub(1))
                .ok()
                .and_then(|i| out.get_mut(i))
            else {
                continue;
            };
            entry.1 = match holder {
                None => FenceCheck::Clear,
                Some(0) => FenceCheck::Held { by: None },
                Some(by) => FenceCheck::Held { by: Some(by) },
            };
        }
        Ok(out)
    }

    /// Leaves the backend as a new one would be (best effort, at shutdown): behind a
    /// pooler that shares it, our settings would otherwise apply to other clients.
    pub(super) async fn reset_session(&self) -> Result<(), Fault> {
        self.client
            .batch_execute("RESET ALL; UNLISTEN *;")
            .await
            .map_err(classify)
    }

    /// The token of transaction id `xid` on this session (the engine keeps the floor
    /// of the tokens issued).
    pub(super) fn issue(&self, xid: i64) -> FencingToken {
        FencingToken::from_parts(self.term.timeline, xid as u64)
    }

    /// Why a guarded statement answered nothing: the session turned read-only (a
    /// primary fenced with `default_transaction_read_only` and a reload), or the
    /// statement ran on another backend (a pooler), as `detail` says.
    pub(super) async fn guard_failed(&self, detail: &str) -> Fault {
        match self
            .client
            .query_one(
                "SELECT current_setting('transaction_read_only') = 'on' AND pg_backend_pid() = $1",
                &[&self.backend_pid],
            )
            .await
        {
            Ok(row) if row.try_get::<_, bool>(0).unwrap_or(false) => {
                Fault::Lost(SessionDownReason::ServerReadOnly)
            }
            Ok(_) => pooler(detail),
            // The session already failed its guard: whatever the diagnosis ran into,
            // it is not trusted any more.
            Err(e) => match classify(e) {
                Fault::Lost(reason) => Fault::Lost(reason),
                Fault::Query(e) => Fault::Lost(SessionDownReason::ConnectionLost {
                    message: format!(
                        "{detail}, or the session is read-only; asking which failed: {}",
                        error_text(&e)
                    ),
                }),
            },
        }
    }

    /// A fresh fencing token (for local hand-offs).
    pub(crate) async fn fresh_token(&self, keys: &[LockKey]) -> Result<FencingToken, Fault> {
        let (a, b, big) = key_arrays(keys);
        let row = self
            .client
            .query_opt(
                &self.stmts.token,
                &[
                    &self.backend_pid,
                    &self.marker,
                    &a,
                    &b,
                    &big,
                    &self.database_oid,
                ],
            )
            .await
            .map_err(classify)?;
        let Some(row) = row else {
            return Err(self
                .guard_failed("a token statement ran on another backend than the session's own")
                .await);
        };
        let held = match row.try_get::<_, i64>(1) {
            Ok(held) => held,
            Err(e) => return Err(Fault::Query(e)),
        };
        if usize::try_from(held).ok() != Some(keys.len()) {
            return Err(Fault::Lost(SessionDownReason::PoolerDetected {
                detail: format!(
                    "the session holds {held} of the {} locks it hands off: another client released them (a transaction pooler sharing the backend, DISCARD ALL, pg_advisory_unlock_all)",
                    keys.len()
                ),
            }));
        }
        match row.try_get::<_, Option<i64>>(0) {
            Ok(Some(t)) => Ok(self.issue(t)),
            Ok(None) => Err(Fault::Lost(SessionDownReason::ConnectionLost {
                message: "the server answered a NULL transaction id".to_owned(),
            })),
            Err(e) => Err(Fault::Query(e)),
        }
    }

    /// Who holds each key, in one statement. A row the server answers oddly is an error
    /// for that key only.
    pub(super) async fn look_up_holders(
        &self,
        keys: &[LockKey],
    ) -> Result<Vec<HolderAnswer>, Fault> {
        let mut classids = Vec::with_capacity(keys.len());
        let mut objids = Vec::with_capacity(keys.len());
        let mut subids = Vec::with_capacity(keys.len());
        for key in keys {
            let (c, o, s) = key.pg_locks_columns();
            classids.push(i64::from(c));
            objids.push(i64::from(o));
            subids.push(s);
        }
        let rows = self
            .client
            .query(
                &self.stmts.holders,
                &[&classids, &objids, &subids, &self.database_oid],
            )
            .await
            .map_err(classify)?;
        let mut out: Vec<HolderAnswer> = keys.iter().map(|_| Ok(None)).collect();
        for row in &rows {
            let Some(i) = row
                .try_get::<_, i64>(0)
                .ok()
                .and_then(|i| usize::try_from(i.saturating_sub(1)).ok())
            else {
                continue;
            };
            let Some(entry) = out.get_mut(i) else {
                continue;
            };
            if matches!(entry, Ok(Some(_))) {
                continue; // a shared lock has several holders: the first one answers
            }
            *entry = holder_info(row, 1).map(Some).map_err(Arc::new);
        }
        Ok(out)
    }

    /// Every advisory lock held in this database, with its holder.
    pub(super) async fn look_up_cluster(&self) -> Result<Vec<(LockKey, HolderInfo)>, Fault> {
        let rows = self
            .client
            .query(&self.stmts.cluster, &[&self.database_oid])
            .await
            .map_err(classify)?;
        let mut out = Vec::with_capacity(rows.len());
        for row in &rows {
            let classid: i64 = row.try_get(0).map_err(Fault::Query)?;
            let objid: i64 = row.try_get(1).map_err(Fault::Query)?;
            let key = match row.try_get::<_, i32>(2).map_err(Fault::Query)? {
                2 => LockKey::Pair(classid as u32 as i32, objid as u32 as i32),
                1 => LockKey::Int((classid << 32) | objid),
                _ => continue,
            };
            out.push((key, holder_info(row, 3).map_err(Fault::Query)?));
        }
        Ok(out)
    }
}

/// Reads `application_name, pid, host(client_addr), backend_start` from `row` starting at
/// column `at`; every column may be NULL.
pub(super) fn holder_info(
    row: &tokio_postgres::Row,
    at: usize,
) -> Result<HolderInfo, tokio_postgres::Error> {
    Ok(HolderInfo {
        node_id: row.try_get::<_, Option<String>>(at)?.unwrap_or_default(),
        backend_pid: row.try_get::<_, Option<i32>>(at + 1)?.unwrap_or(0),
        client_addr: row.try_get(at + 2)?,
        session_start: row.try_get(at + 3)?,
    })
}

pub(super) fn pooler(detail: &str) -> Fault {
    Fault::Lost(SessionDownReason::PoolerDetected {
        detail: detail.to_owned(),
    })
}

/// The scalar parameters of the single-key statements.
pub(super) fn key_params(key: LockKey) -> (Option<i32>, Option<i32>, Option<i64>) {
    match key {
        LockKey::Pair(a, b) => (Some(a), Some(b), None),
        LockKey::Int(k) => (None, None, Some(k)),
    }
}

/// The stop fences of `keys`, as the two arrays of their two-int4 keys.
pub(super) fn fence_arrays(keys: &[LockKey]) -> (Vec<i32>, Vec<i32>) {
    pair_arrays(keys.iter().map(|k| k.stop_fence()))
}

/// The interest keys of `keys`' buckets, as the two arrays of their two-int4 keys.
pub(super) fn interest_arrays(keys: &[LockKey]) -> (Vec<i32>, Vec<i32>) {
    pair_arrays(keys.iter().map(|k| k.interest()))
}

/// Derived keys (stop fences, interest keys: always two-int4 keys) as two arrays.
pub(super) fn pair_arrays(keys: impl Iterator<Item = LockKey>) -> (Vec<i32>, Vec<i32>) {
    keys.map(|k| match k {
        LockKey::Pair(a, b) => (a, b),
        LockKey::Int(_) => unreachable!("BUG: derived keys are two-int4 keys"),
    })
    .unzip()
}

/// The three parallel arrays the batched statements `unnest`.
pub(super) type KeyArrays = (Vec<Option<i32>>, Vec<Option<i32>>, Vec<Option<i64>>);

pub(super) fn key_arrays(keys: &[LockKey]) -> KeyArrays {
    let mut a = Vec::with_capacity(keys.len());
    let mut b = Vec::with_capacity(keys.len());
    let mut big = Vec::with_capacity(keys.len());
    for key in keys {
        match *key {
            LockKey::Pair(x, y) => {
                a.push(Some(x));
                b.push(Some(y));
                big.push(None);
            }
            LockKey::Int(k) => {
                a.push(None);
                b.push(None);
                big.push(Some(k));
            }
        }
    }
    (a, b, big)
}

/// What a try statement answered.
pub(crate) struct Tried {
    pub(crate) outcomes: Vec<(LockKey, TryOutcome)>,
    /// Keys whose bucket's interest key the statement took.
    pub(crate) registered: Vec<LockKey>,
    /// Keys won after the statement's first try of them found them held.
    pub(crate) seen_held: Vec<LockKey>,
    /// Keys of [`Plan::verify`](crate::table::Plan::verify) won, with the start of the announcer pid's backend now.
    pub(crate) senders: Vec<(LockKey, Option<i64>)>,
}

/// Judges an unlocking statement: we only unlock what the session holds, once each, so
/// anything but one `true` per key means the statement ran on a backend that is not
/// ours; any failure ends the session, which releases everything.
pub(super) fn released(
    result: Result<Vec<Option<bool>>, tokio_postgres::Error>,
    expected: usize,
    what: &str,
) -> Result<(), Fault> {
    match result.map_err(classify) {
        Ok(done) if done.len() == expected && done.iter().all(|ok| *ok == Some(true)) => Ok(()),
        Ok(_) => Err(pooler(&format!(
            "the server says this session did not hold {what} it held"
        ))),
        Err(Fault::Lost(reason)) => Err(Fault::Lost(reason)),
        Err(Fault::Query(e)) => Err(Fault::Lost(SessionDownReason::ConnectionLost {
            message: format!(
                "could not release {what} ({}); dropping the session to release them",
                error_text(&e)
            ),
        })),
    }
}
