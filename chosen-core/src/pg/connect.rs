//! Opening a session: connect, prove that the server is a writable primary that the
//! session is alone on, set the session up, prepare the statements, and read the term.

use std::sync::{Arc, Mutex};

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::mpsc;
use tokio_postgres::error::SqlState;
use tokio_postgres::{AsyncMessage, Client, NoTls};
use tracing::{debug, warn};

use super::sql::*;
use super::*;
use crate::backend::Opened;
use crate::engine::Term;
use crate::error::{Error, Result};
use crate::fault::error_text;
use crate::generation::Generation;
use crate::options::ManagerOptions;
use crate::status::SessionDownReason;
use crate::task::AbortOnDrop;
use crate::token::FencingToken;

/// Reads the server's current term (see [`TERM_SQL`]); with `emits`, checks that the
/// role may write the token's WAL record (the lease-row mode writes none).
pub(crate) async fn read_term(client: &Client, epoch: u16, emits: bool) -> Result<Term> {
    // With it, in the same round trip: may this role write the token's WAL record?
    let messages = client
        .simple_query(&format!("{TERM_SQL}; {EMIT_PRIVILEGE_SQL}"))
        .await
        .map_err(Error::database)?;
    let read_at = crate::clock::now();
    let mut rows = messages.iter().filter_map(|m| match m {
        tokio_postgres::SimpleQueryMessage::Row(row) => Some(row),
        _ => None,
    });
    let (Some(row), Some(privilege)) = (rows.next(), rows.next()) else {
        return Err(Error::Protocol {
            message: "the server answered the term query with no row".to_owned(),
        });
    };
    let timeline: i64 = column(row, 0).and_then(|t| t.parse().ok()).unwrap_or(0);
    // The larger of the option and the server's own setting: a DBA sets it on the new
    // cluster alone (`ALTER DATABASE ... SET chosen.token_epoch = N`) before it takes
    // connections, and every node picks it up as it reconnects.
    let server_epoch = match column(row, 3).map(str::trim).filter(|e| !e.is_empty()) {
        None => 0,
        Some(text) => match text.parse::<u16>() {
            Ok(e) if e < (1 << 15) - 1 => e,
            _ => {
                return Err(Error::Refused(SessionDownReason::ConnectFailed {
                    message: format!(
                        "the server's chosen.token_epoch setting {text:?} is not a whole number from 0 to 32766; fix it (ALTER DATABASE ... SET chosen.token_epoch = N)"
                    ),
                }));
            }
        },
    };
    let epoch = epoch.max(server_epoch);
    if timeline == 0 {
        return Err(Error::Refused(SessionDownReason::ConnectFailed {
            message: "the server answered no timeline".to_owned(),
        }));
    }
    // 15 bits: a token stored in a signed 64-bit column (PostgreSQL's bigint) must stay
    // positive.
    let Some(timeline) = u16::try_from(timeline + i64::from(epoch))
        .ok()
        .filter(|t| *t < 1 << 15)
    else {
        return Err(Error::Refused(SessionDownReason::ConnectFailed {
            message: format!(
                "the server is on timeline {timeline}, with token_epoch {epoch}: fencing tokens carry the timeline plus the epoch in 15 bits (so that they stay positive as a signed 64-bit number), so their sum must stay below 32768"
            ),
        }));
    };
    if emits && column(privilege, 0) != Some("t") {
        return Err(Error::Refused(SessionDownReason::ConnectFailed {
            message: "this role may not execute pg_logical_emit_message, which makes fencing tokens durable: GRANT EXECUTE ON FUNCTION pg_catalog.pg_logical_emit_message(boolean, text, text, boolean) TO the role on PostgreSQL 17 and newer, (boolean, text, text) before 17 (PostgreSQL grants it to PUBLIC by default)".to_owned(),
        }));
    }
    let age = column(row, 1)
        .and_then(|ms| ms.parse::<u64>().ok())
        .map(std::time::Duration::from_millis);
    let Some(next_xid) = column(row, 4).and_then(|x| x.parse::<u64>().ok()) else {
        return Err(Error::Refused(SessionDownReason::ConnectFailed {
            message: "the server answered no next transaction id".to_owned(),
        }));
    };
    Ok(Term {
        timeline,
        age,
        identity: column(row, 2).unwrap_or_default().to_owned(),
        first_token: FencingToken::from_parts(timeline, next_xid),
        system_id: column(row, 5).unwrap_or_default().to_owned(),
        read_at,
    })
}

/// The server's `tcp_user_timeout`: how long the server keeps a connection whose sent
/// data stays unacknowledged. Linux counts it from the first send of the oldest
/// unacknowledged byte, not from the last query: with heartbeats pipelined, replies
/// stuck behind a lost byte can renew validity up to a lease timeout after that clock
/// started, so it must be at least `server_release_after + lease_timeout` (a
/// one-way loss then keeps the session, and its locks, that much longer; an idle
/// silent session is still ended by `idle_session_timeout` at `server_release_after`).
pub(crate) fn tcp_user_timeout(options: &ManagerOptions) -> std::time::Duration {
    options.server_release_after + options.lease_timeout
}

/// The settings that make the server end a silent session in bounded time, and keep a
/// DBA's defaults from breaking the contract.
pub(super) fn setup_sql(options: &ManagerOptions) -> String {
    let release_ms = options.server_release_after.as_millis();
    let user_timeout_ms = tcp_user_timeout(options).as_millis();
    // Keepalives and tcp_user_timeout are a second line for a real partition; they must
    // never release *earlier* than server_release_after, so they start at that point.
    let keepalive_idle_s = options.server_release_after.as_secs().max(1);
    let statement_ms = options.lease_timeout.as_millis();
    // Our statements are few and always the same: plan them once (a custom plan per
    // execution of the try statement cost more than the statement itself).
    format!(
        "SET statement_timeout = {statement_ms}; \
         {TRANSACTION_TIMEOUT_OFF_SESSION} \
         SET plan_cache_mode = force_generic_plan; \
         SET lock_timeout = 0; \
         SET idle_in_transaction_session_timeout = 0; \
         SET idle_session_timeout = {release_ms}; \
         SET tcp_keepalives_idle = {keepalive_idle_s}; \
         SET tcp_keepalives_interval = 1; \
         SET tcp_keepalives_count = 3; \
         SET tcp_user_timeout = {user_timeout_ms}; \
         SET client_connection_check_interval = 1000; \
         LISTEN {RELEASE_CHANNEL};"
    )
}

/// PostgreSQL 17's `transaction_timeout` ends the *session* (FATAL 25P04) when a
/// transaction, or outside one a statement, runs longer: a DBA's short default for the
/// role or database would end the lock session whenever a statement of ours ran long.
/// Turned off as the other DBA timeouts are, only where the setting exists (`SET` of an
/// unknown setting is an error on older servers), right after `statement_timeout` and
/// in constant time (the timer runs from the start of the message, so a short one may
/// already be close). The `CASE` orders the evaluation, so `set_config` runs only where
/// the setting exists; no row is returned (the probe reads the first row of its message
/// as its own). Setting it inside a transaction stops that transaction's timer too. If
/// it fires before (25P04), the session is lost and `connect` tries once more.
pub(super) const TRANSACTION_TIMEOUT_OFF_LOCAL: &str = "SELECT 1 WHERE CASE WHEN current_setting('transaction_timeout', true) IS NULL THEN false ELSE set_config('transaction_timeout', '0', true) IS NULL END;";

/// [`TRANSACTION_TIMEOUT_OFF_LOCAL`] for the whole session.
pub(super) const TRANSACTION_TIMEOUT_OFF_SESSION: &str = "SELECT 1 WHERE CASE WHEN current_setting('transaction_timeout', true) IS NULL THEN false ELSE set_config('transaction_timeout', '0', false) IS NULL END;";

/// Opens and proves a new session; `proven` is the identity of the server the
/// exclusion self-test last passed on (see [`crate::exclusion`]).
pub(crate) async fn connect(
    options: &ManagerOptions,
    generation: u64,
    proven: &Mutex<Option<String>>,
) -> Result<Session> {
    let timeout = options.connect_timeout * (options.pg.get_hosts().len().max(1) as u32 + 1);
    let attempt = async {
        // A DBA's statement_timeout (e.g. a role default of a millisecond) applies to
        // every statement of a new session until our own `SET statement_timeout` has
        // run (the server starts the timer anew for each statement of a message), and
        // a short idle_session_timeout to the pause between our first two round trips:
        // under load, even a `BEGIN` can overrun the one, a descheduled client the
        // other. Another connection very likely gets through; nothing of a failed one
        // is kept (it holds no lock, and its socket is closed). At most three, within
        // the connect timeout.
        let mut tries = 1;
        loop {
            match connect_inner(options, generation, proven).await {
                Err(e) if tries < 3 && cut_short_by_dba_settings(&e) => {
                    warn!(error = %e, "the new lock session was cut short, likely by a very short statement_timeout or idle_session_timeout set for the role or database; connecting again (consider ALTER ROLE ... RESET for this role)");
                    tries += 1;
                    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                }
                other => break other,
            }
        }
    };
    match tokio::time::timeout(timeout, attempt).await {
        Ok(result) => result,
        Err(_) => Err(Error::ConnectTimeout {
            target: options.target_description(),
            after: timeout,
        }),
    }
}

/// A new session's statement cancelled (57014), or the session lost while it was
/// being proven (e.g. ended by `idle_session_timeout`, 57P05, whose notice may arrive
/// as a plain close, or by `transaction_timeout`, 25P04): worth another connection at
/// once. A server that refuses
/// connections is not this (`Error::Connect`).
pub(super) fn cut_short_by_dba_settings(error: &Error) -> bool {
    match error {
        Error::Database(e) => e.code() == Some(&SqlState::QUERY_CANCELED),
        Error::NotConnected(SessionDownReason::ConnectionLost { .. }) => true,
        _ => false,
    }
}

/// A failed connection attempt as the error a caller sees.
fn connect_error(options: &ManagerOptions, source: tokio_postgres::Error) -> Error {
    let auth = matches!(
        source.code(),
        Some(c) if *c == SqlState::INVALID_PASSWORD
            || *c == SqlState::INVALID_AUTHORIZATION_SPECIFICATION
    );
    if auth {
        Error::Authentication {
            user: options.pg.get_user().unwrap_or_default().to_owned(),
            target: options.target_description(),
            source,
        }
    } else {
        Error::Connect {
            target: options.target_description(),
            source,
        }
    }
}

pub(super) async fn connect_inner(
    options: &ManagerOptions,
    generation: u64,
    proven: &Mutex<Option<String>>,
) -> Result<Session> {
    let config = options.session_config();
    // The exclusion self-test's second connection: opened alongside the session's when
    // no server is proven yet, or the target names several hosts (so that the session is
    // not left idle while it connects, and a multi-host URL is not walked twice in a
    // row: a dead host first would cost each walk a whole connect timeout); to one host,
    // on a reconnect, only once the probe found another server than the proven one, so
    // that the reconnect the stop fences need fast races for no second connection slot.
    let cached = proven
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    let targets = options
        .pg
        .get_hosts()
        .len()
        .max(options.pg.get_hostaddrs().len());
    let upfront = cached.is_none() || targets > 1;
    let second = (options.exclusion_self_test && upfront).then(|| open_second(options));
    #[cfg(feature = "rustls")]
    if let Some(tls) = &options.tls {
        let tls = tokio_postgres_rustls::MakeRustlsConnect::new(rustls::ClientConfig::clone(tls));
        let (client, connection) = config
            .connect(tls)
            .await
            .map_err(|e| connect_error(options, e))?;
        return prove(
            options,
            generation,
            (proven, cached),
            second,
            client,
            connection,
        )
        .await;
    }
    let (client, connection) = config
        .connect(NoTls)
        .await
        .map_err(|e| connect_error(options, e))?;
    prove(
        options,
        generation,
        (proven, cached),
        second,
        client,
        connection,
    )
    .await
}

/// The self-test's second connection, opening on its own task.
fn open_second(options: &ManagerOptions) -> AbortOnDrop<Result<(Client, AbortOnDrop)>> {
    let options = options.clone();
    AbortOnDrop::with_output(tokio::spawn(
        async move { second_connection(&options).await },
    ))
}

/// A second connection to the session's target, for the exclusion self-test: its
/// client, and its connection's task (aborted, closing it, when dropped).
async fn second_connection(options: &ManagerOptions) -> Result<(Client, AbortOnDrop)> {
    let config = options.session_config();
    #[cfg(feature = "rustls")]
    if let Some(tls) = &options.tls {
        let tls = tokio_postgres_rustls::MakeRustlsConnect::new(rustls::ClientConfig::clone(tls));
        let (client, connection) = config
            .connect(tls)
            .await
            .map_err(|e| connect_error(options, e))?;
        let task = tokio::spawn(async move {
            let _ = connection.await;
        });
        return Ok((client, AbortOnDrop::new(task)));
    }
    let (client, connection) = config
        .connect(NoTls)
        .await
        .map_err(|e| connect_error(options, e))?;
    let task = tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok((client, AbortOnDrop::new(task)))
}

/// The rows of a simple-query answer.
fn rows(messages: &[tokio_postgres::SimpleQueryMessage]) -> Vec<&tokio_postgres::SimpleQueryRow> {
    messages
        .iter()
        .filter_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(row) => Some(row),
            _ => None,
        })
        .collect()
}

/// Column `i` of `row`, `None` when it is NULL or missing (never a panic on a short row).
fn column(row: &tokio_postgres::SimpleQueryRow, i: usize) -> Option<&str> {
    row.try_get(i).ok().flatten()
}

/// A statement of the self-test in a transaction of its own, with the DBA's timeouts
/// overridden for it alone (as the probe's): nothing of it stays on the backend.
fn local_transaction(options: &ManagerOptions, statement: &str) -> String {
    format!(
        "BEGIN; SET LOCAL statement_timeout = {}; {TRANSACTION_TIMEOUT_OFF_LOCAL} SET LOCAL lock_timeout = 0; SET LOCAL idle_in_transaction_session_timeout = 0; {statement}; COMMIT;",
        options.lease_timeout.as_millis()
    )
}

/// An advisory-lock function the server does not have (an engine that lacks them, a
/// proxy that refuses them): its locks cannot be trusted.
fn without_advisory_locks(error: &tokio_postgres::Error) -> Option<Error> {
    let code = error.code()?;
    let about_advisory_locks = error
        .as_db_error()
        .is_some_and(|e| e.message().contains("advisory"));
    ((*code == SqlState::UNDEFINED_FUNCTION || *code == SqlState::FEATURE_NOT_SUPPORTED)
        && about_advisory_locks)
        .then(|| {
            Error::Refused(SessionDownReason::AdvisoryLocksUnsafe {
                detail: format!(
                    "the server has no session advisory locks: {}",
                    error_text(error)
                ),
            })
        })
}

/// The self-test's channel: unique to the session (its key), a plain identifier.
fn probe_channel((k1, k2): (i32, i32)) -> String {
    format!("chosen_probe_{:08x}{:08x}", k1 as u32, k2 as u32)
}

/// How long the self-test waits for its notification to reach the idle session: a
/// round trip, generously (an honest server sends it as the second connection commits).
fn notification_wait(options: &ManagerOptions) -> std::time::Duration {
    options.lease_timeout.min(options.connect_timeout)
}

/// The second connection's failure, said as what the self-test needs.
fn second_connection_failed(error: &Error) -> Error {
    let message = if matches!(error, Error::ConnectTimeout { .. }) {
        format!(
            "the exclusion self-test's second connection did not connect in time ({error}); the connect is tried again"
        )
    } else {
        format!(
            "the exclusion self-test needs one more connection for a moment and got none ({error}); allow one more connection per node connecting (role CONNECTION LIMIT, max_connections, a pooler's pool size)"
        )
    };
    Error::NotConnected(SessionDownReason::ConnectFailed { message })
}

/// Steps 2 and 3 of the exclusion self-test (see [`crate::exclusion`]), once the
/// session (backend `ours`, on server `identity`) took `key` (or was refused it:
/// `took`) and listens on its channel; the verdict, after both connections released
/// what they were granted.
#[allow(clippy::too_many_arguments)]
async fn test_exclusion(
    options: &ManagerOptions,
    client: &Client,
    events: &mut mpsc::UnboundedReceiver<ConnEvent>,
    second: AbortOnDrop<Result<(Client, AbortOnDrop)>>,
    ours: i32,
    identity: &str,
    took: bool,
    key: (i32, i32),
) -> Result<()> {
    let outcome = exclusion_steps(options, client, events, second, ours, identity, took, key).await;
    if outcome.is_err() {
        // Refused or failed after step 1: behind a pooler the backend outlives the
        // connection, so what the session took there is given back (best effort).
        clean_up_probe(options, client, key).await;
    }
    outcome
}

/// Gives back the self-test's key and channel on the session, a few tries, each
/// bounded: nothing of a refused session stays on a pooled backend.
async fn clean_up_probe(options: &ManagerOptions, client: &Client, key: (i32, i32)) {
    let (k1, k2) = key;
    // `ROLLBACK` first: a statement that failed may have left a transaction open
    // (outside one it is only a warning).
    let statement = format!(
        "ROLLBACK; {}",
        local_transaction(
            options,
            &format!(
                "SELECT pg_advisory_unlock({k1}, {k2}); UNLISTEN {}",
                probe_channel(key)
            ),
        )
    );
    // Until the key is given back: behind a pooler a statement may land on a backend
    // that does not hold it (a key never taken is tried three times, harmlessly).
    for _ in 0..3 {
        match tokio::time::timeout(notification_wait(options), client.simple_query(&statement))
            .await
        {
            Ok(Ok(messages))
                if rows(&messages)
                    .first()
                    .is_some_and(|row| column(row, 0) == Some("t")) =>
            {
                break;
            }
            Ok(Ok(_)) => {}
            // The session is gone (a direct server frees everything then) or stalled.
            _ => break,
        }
    }
}

/// The self-test's steps 2 and 3 (see [`test_exclusion`]).
#[allow(clippy::too_many_arguments)]
async fn exclusion_steps(
    options: &ManagerOptions,
    client: &Client,
    events: &mut mpsc::UnboundedReceiver<ConnEvent>,
    second: AbortOnDrop<Result<(Client, AbortOnDrop)>>,
    ours: i32,
    identity: &str,
    took: bool,
    key: (i32, i32),
) -> Result<()> {
    let (k1, k2) = key;
    let channel = probe_channel(key);
    let payload = format!("{k1}.{k2}");
    let database =
        |e: tokio_postgres::Error| without_advisory_locks(&e).unwrap_or_else(|| Error::database(e));
    // Step 2: the session is idle now, as between any two of its statements (a
    // transaction pooler has given its backend back to the pool).
    let (other, granted, same_server) = {
        let wait = options.connect_timeout;
        let (second, _task) = match tokio::time::timeout(wait, second.join()).await {
            Ok(Ok(Ok(opened))) => opened,
            Ok(Ok(Err(e))) => return Err(second_connection_failed(&e)),
            Ok(Err(panicked)) => {
                return Err(Error::Protocol {
                    message: format!("the self-test's second connection failed: {panicked}"),
                });
            }
            Err(_) => {
                return Err(second_connection_failed(&Error::ConnectTimeout {
                    target: options.target_description(),
                    after: wait,
                }));
            }
        };
        let answer = tokio::time::timeout(
            wait,
            second.simple_query(&local_transaction(
                options,
                &format!(
                    "SELECT pg_backend_pid(), pg_try_advisory_xact_lock({k1}, {k2}), {SERVER_IDENTITY_SQL}; NOTIFY {channel}, '{payload}'"
                ),
            )),
        )
        .await
        .map_err(|_| {
            second_connection_failed(&Error::ConnectTimeout {
                target: options.target_description(),
                after: wait,
            })
        })?
        .map_err(|e| {
            // Cut short (a DBA's idle_session_timeout, transaction_timeout or
            // statement_timeout on the second connection): `connect` tries again.
            let cut = e.is_closed()
                || e.code()
                    .is_some_and(|c| matches!(c.code(), "57P05" | "25P04" | "57014"));
            if cut {
                Error::NotConnected(SessionDownReason::ConnectionLost {
                    message: error_text(&e),
                })
            } else {
                database(e)
            }
        })?;
        let Some((other, granted, other_server)) = rows(&answer).first().map(|row| {
            (
                column(row, 0)
                    .and_then(|p| p.parse::<i32>().ok())
                    .unwrap_or(0),
                column(row, 1) == Some("t"),
                column(row, 2).unwrap_or_default().to_owned(),
            )
        }) else {
            return Err(Error::Protocol {
                message: "the server answered the exclusion self-test with no row".to_owned(),
            });
        };
        // (A transaction-level try: whatever it was granted ends with its commit.)
        (
            other,
            granted,
            !identity.is_empty() && other_server == identity,
        )
    };
    // The notification must reach the session while it is idle: only a backend bound
    // to the session's own connection delivers it then.
    let notified = {
        let deadline = tokio::time::Instant::now() + notification_wait(options);
        loop {
            match tokio::time::timeout_at(deadline, events.recv()).await {
                Ok(Some(ConnEvent::Notification {
                    payload: p, sender, ..
                })) if p == payload && sender == other => {
                    break true;
                }
                Ok(Some(ConnEvent::Notification { .. })) => {}
                Ok(Some(ConnEvent::Closed(message))) => {
                    return Err(Error::NotConnected(SessionDownReason::ConnectionLost {
                        message,
                    }));
                }
                Ok(None) => {
                    return Err(Error::NotConnected(SessionDownReason::ConnectionLost {
                        message: "the connection closed during the exclusion self-test".to_owned(),
                    }));
                }
                Err(_) => break false,
            }
        }
    };
    // Step 3, until the key is released (behind a pooler the statement may land on
    // another backend than the one holding it: a few tries leave nothing behind).
    let mut first = None;
    for _ in 0..4 {
        let messages = client
            .simple_query(&local_transaction(
                options,
                &format!(
                    "SELECT pg_backend_pid(), pg_advisory_unlock({k1}, {k2}); UNLISTEN {channel}"
                ),
            ))
            .await
            .map_err(database)?;
        let Some((after, released)) = rows(&messages).first().map(|row| {
            (
                column(row, 0)
                    .and_then(|p| p.parse::<i32>().ok())
                    .unwrap_or(0),
                column(row, 1) == Some("t"),
            )
        }) else {
            return Err(Error::Protocol {
                message: "the server answered the exclusion self-test with no row".to_owned(),
            });
        };
        first.get_or_insert((after, released));
        if released || !took {
            break;
        }
    }
    let (after, released) = first.unwrap_or((0, false));
    crate::exclusion::judge(&crate::exclusion::Seen {
        ours,
        took,
        other,
        other_granted: granted,
        same_server,
        notified,
        after,
        released,
    })
    .map_err(Error::Refused)
}

/// Drives the connection on its own task and proves the session is one we may hold
/// locks on.
pub(super) async fn prove<S, T>(
    options: &ManagerOptions,
    generation: u64,
    (proven, cached): (&Mutex<Option<String>>, Option<String>),
    second: Option<AbortOnDrop<Result<(Client, AbortOnDrop)>>>,
    client: Client,
    mut connection: tokio_postgres::Connection<S, T>,
) -> Result<Session>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (events_tx, mut events) = mpsc::unbounded_channel();
    let conn_task = tokio::spawn(async move {
        let end = loop {
            match std::future::poll_fn(|cx| connection.poll_message(cx)).await {
                Some(Ok(AsyncMessage::Notification(n))) => {
                    let _ = events_tx.send(ConnEvent::Notification {
                        sender: n.process_id(),
                        payload: n.payload().to_owned(),
                        at: crate::clock::now(),
                    });
                }
                Some(Ok(AsyncMessage::Notice(notice))) => {
                    debug!(message = notice.message(), "notice on the lock session");
                }
                Some(Ok(_)) => {}
                Some(Err(e)) => break error_text(&e),
                None => break "the server closed the connection".to_owned(),
            }
        };
        let _ = events_tx.send(ConnEvent::Closed(end));
    });
    // From here on, dropping `guard` (on any error) closes the connection.
    let guard = AbortOnDrop::new(conn_task);
    // A DBA's statement_timeout could cancel even the probe: override it in the same
    // round trip, as early as a `SET LOCAL` can be (it still covers the `BEGIN` and the
    // `SET` itself; `connect` tries once more if one of them is cancelled; these
    // settings exist on every server version). Only for this
    // transaction: a backend that turns out not to be ours alone (a pooler's) keeps
    // nothing of ours. With it, step 1 of the exclusion self-test: on a backend that
    // passes the probe's checks (so that a refused one keeps no key of ours), the
    // session takes a key of its own, and listens on a channel of its own.
    let marker = new_marker(options, generation);
    let probe_key = crate::exclusion::probe_key(&marker);
    let testing = options.exclusion_self_test;
    // Inlined only as the digest it must be.
    let cached = cached
        .filter(|c| c.len() == 64 && c.bytes().all(|b| b.is_ascii_hexdigit()))
        .unwrap_or_default();
    let step_one = if testing {
        format!(
            "SELECT CASE WHEN current_setting('server_version_num')::int4 >= {MIN_SERVER_VERSION} \
                  AND NOT pg_is_in_recovery() AND current_setting('transaction_read_only') = 'off' \
                  AND coalesce(current_setting('{MARKER_SETTING}', true), '') = '' \
                  AND NOT EXISTS (SELECT 1 FROM pg_lock_status() l WHERE l.locktype = 'advisory' AND l.pid = pg_backend_pid()) \
                  AND {PROVEN_IDENTITY_SQL} <> '{cached}' \
             THEN pg_try_advisory_lock({}, {}) END, {SERVER_IDENTITY_SQL}, {PROVEN_IDENTITY_SQL}; LISTEN {}",
            probe_key.0,
            probe_key.1,
            probe_channel(probe_key)
        )
    } else {
        "SELECT NULL::bool, NULL::text, NULL::text".to_owned()
    };
    let answer = client
        .simple_query(&local_transaction(
            options,
            &format!("{PROBE_SQL}; {step_one}"),
        ))
        .await;
    let messages = match answer {
        Ok(messages) => messages,
        Err(e) => {
            // A session-level key taken in a transaction that then failed stays held.
            if testing && !e.is_closed() {
                clean_up_probe(options, &client, probe_key).await;
            }
            return Err(without_advisory_locks(&e).unwrap_or_else(|| Error::database(e)));
        }
    };
    let rows = rows(&messages);
    let (Some(row), Some(exclusion)) = (rows.first(), rows.get(1)) else {
        if testing {
            clean_up_probe(options, &client, probe_key).await;
        }
        return Err(Error::Protocol {
            message: "the server answered the session probe with no row".to_owned(),
        });
    };
    let field = |i: usize| column(row, i).unwrap_or_default();
    let version: i32 = field(0).parse().unwrap_or(0);
    let backend_pid: i32 = field(1).parse().unwrap_or(0);
    let in_recovery = field(2) == "t";
    let found_marker = field(3).to_owned();
    let advisory_locks: i64 = field(4).parse().unwrap_or(0);
    let database_oid: i64 = field(5).parse().unwrap_or(0);
    // The server's address as it sees this connection (empty over a Unix socket).
    let server = field(6).to_owned();
    let read_only = field(7) == "on";
    let refused = if version < MIN_SERVER_VERSION {
        Some(SessionDownReason::ServerTooOld { version })
    } else if in_recovery {
        Some(SessionDownReason::ServerInRecovery)
    } else if read_only {
        Some(SessionDownReason::ServerReadOnly)
    } else if !found_marker.is_empty() || advisory_locks > 0 {
        Some(SessionDownReason::PoolerDetected {
            detail: format!(
                "the new session's backend (pid {backend_pid}) already carries another session's state ({} advisory locks{})",
                advisory_locks,
                if found_marker.is_empty() {
                    ""
                } else {
                    ", another chosen marker"
                }
            ),
        })
    } else {
        None
    };
    if let Some(reason) = refused {
        // Refused: whatever was proven of this server is not trusted any more.
        *proven
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = None;
        if testing {
            // The key was not taken there, but the channel may be listened to.
            clean_up_probe(options, &client, probe_key).await;
        }
        return Err(Error::Refused(reason));
    }
    // Steps 2 and 3, on a server other than the one last proven.
    let identity = column(exclusion, 1).unwrap_or_default().to_owned();
    let remembered = column(exclusion, 2).unwrap_or_default().to_owned();
    if testing && (cached.is_empty() || remembered != cached) {
        let second = second.unwrap_or_else(|| open_second(options));
        let tested = test_exclusion(
            options,
            &client,
            &mut events,
            second,
            backend_pid,
            &identity,
            column(exclusion, 0) == Some("t"),
            probe_key,
        )
        .await;
        *proven
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) =
            tested.is_ok().then_some(remembered);
        tested?;
    }
    // (The self-test's channel, listened to by the probe, is not kept.)
    let unlisten = if testing {
        format!(" UNLISTEN {};", probe_channel(probe_key))
    } else {
        String::new()
    };
    let setup = format!(
        "{}{unlisten} SELECT set_config('{MARKER_SETTING}', '{marker}', false);",
        setup_sql(options)
    );
    // The settings, the term and the prepared statements in one round trip: a slow
    // database is not a dead one while connecting either. They are pipelined in this
    // order (each request is sent on its first poll, a biased `try_join!` polls in
    // order, and the server answers in order), so the term is read after the settings (a DBA's
    // statement_timeout must not cancel it). The session is proven from the moment they
    // were sent: the server answered them later, so its idle clock started later, the
    // same rule as a heartbeat's.
    let proven_at = crate::clock::now();
    let ((), term, stmts) = tokio::try_join!(
        biased;
        async { client.batch_execute(&setup).await.map_err(Error::database) },
        read_term(&client, options.token_epoch, true),
        async { Statements::prepare(&client).await.map_err(Error::database) },
    )?;
    let link = PgLink {
        client: Arc::new(client),
        stmts,
        backend_pid,
        marker,
        database_oid,
        term: term.clone(),
        conn_task: guard.disarm(),
    };
    Ok(Session::new(
        Box::new(link),
        Opened {
            backend_pid,
            server,
            generation: Generation::new(generation),
            events,
            proven_at,
            term,
        },
    ))
}

impl Statements {
    pub(super) async fn prepare(client: &Client) -> Result<Self, tokio_postgres::Error> {
        // Prepared concurrently: tokio-postgres pipelines them in one round trip.
        let (
            (heartbeat, try_keys, try_one, unlock, unlock_one),
            (
                check_fences,
                cleanup,
                token,
                holders,
                cluster,
                fence,
                unfence,
                unlock_shared,
                fences_held,
            ),
        ) = tokio::try_join!(
            async {
                tokio::try_join!(
                    client.prepare(HEARTBEAT_SQL),
                    client.prepare(TRY_KEYS_SQL),
                    client.prepare(TRY_ONE_SQL),
                    client.prepare(UNLOCK_SQL),
                    client.prepare(UNLOCK_ONE_SQL),
                )
            },
            async {
                tokio::try_join!(
                    client.prepare(CHECK_FENCES_SQL),
                    client.prepare(CLEANUP_SQL),
                    client.prepare(TOKEN_SQL),
                    client.prepare(HOLDERS_SQL),
                    client.prepare(CLUSTER_SQL),
                    client.prepare(FENCE_SQL),
                    client.prepare(UNFENCE_SQL),
                    client.prepare(UNLOCK_SHARED_SQL),
                    client.prepare(FENCES_HELD_SQL),
                )
            },
        )?;
        Ok(Self {
            heartbeat,
            try_keys,
            try_one,
            unlock,
            unlock_one,
            check_fences,
            fence,
            unfence,
            unlock_shared,
            fences_held,
            cleanup,
            token,
            holders,
            cluster,
        })
    }
}

/// A value unique to this session: the node, the process, the generation and the time.
/// Only `[A-Za-z0-9._-]`, so it can be inlined in SQL.
pub(super) fn new_marker(options: &ManagerOptions, generation: u64) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let node: String = options
        .node_id
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .take(32)
        .collect();
    format!("{node}.{}.{generation}.{nanos:x}", std::process::id())
}
