//! Breaks found by the review of the `term` change (a grant delay after a new primary
//! term; durable, timeline-carrying tokens), against real servers, kept as regression
//! tests. (Its third finding, tokens going backwards when two standbys promoted one
//! after the other share a timeline number, is documented on `FencingToken`: no client
//! rule can tell the two timelines apart.)

use std::time::{Duration, Instant};

use chosen_core::{LockManager, ManagerOptions};
use chosen_tests::{PgCluster, unique_name};

fn options(url: &str, node: &str) -> ManagerOptions {
    chosen_tests::manager_options(url, node)
        .poll_interval(Duration::from_millis(100))
        .reconnect_backoff(Duration::from_millis(50), Duration::from_millis(500))
}

/// F1. A synchronous standby is configured but down (or slow). The token expression
/// set `synchronous_commit = on` and writes WAL, so the commit of every statement
/// that wins a lock waits for the standby. `statement_timeout` does not cover a
/// commit's sync-rep wait, so the statement never returns: no lock is ever granted,
/// and (one connection, heartbeat behind it) the session is lost. Before the change a
/// win wrote no WAL and never waited for standbys. The timeline already keeps tokens
/// monotonic across a failover, so `synchronous_commit = local` is enough.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_win_does_not_wait_for_a_synchronous_standby() {
    let pg = PgCluster::builder()
        .setting("synchronous_standby_names", "ghost")
        .start()
        .unwrap();
    let a = LockManager::connect(options(&pg.url(), "syncrep-a").term_grant_delay(Duration::ZERO))
        .await
        .unwrap();
    let t0 = Instant::now();
    let got = tokio::time::timeout(
        Duration::from_secs(10),
        a.acquire(unique_name("syncrep").as_str()),
    )
    .await;
    assert!(
        matches!(got, Ok(Ok(_))),
        "acquire did not complete within {:?} with a synchronous standby down: {got:?}",
        t0.elapsed()
    );
}

/// F2. `try_acquire` ("takes the lock if it is free right now") on a session whose
/// server term is young waits for the whole term hold (6 s by default) before it
/// answers, holding the key at the server meanwhile. It should answer at once
/// (`Ok(None)`, or a dedicated refusal) and not take the key at the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn try_acquire_answers_promptly_during_the_term_hold() {
    let pg = PgCluster::start_local().unwrap();
    // The cluster just started: its term is younger than the 6 s default delay.
    let a = LockManager::connect(options(&pg.url(), "try-a"))
        .await
        .unwrap();
    let t0 = Instant::now();
    let got = a.try_acquire(unique_name("try-hold").as_str()).await;
    let took = t0.elapsed();
    assert!(matches!(got, Ok(None)), "{got:?}");
    assert!(
        took < Duration::from_secs(1),
        "try_acquire took {took:?} (the term hold) instead of answering at once"
    );
}

/// F7. A role that may not run `pg_logical_emit_message` (a DBA revoked it from
/// PUBLIC) would fail every win with a bare permission error: the connect refuses it,
/// naming the grant to run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_that_may_not_emit_the_token_record_is_refused_at_connect() {
    use std::str::FromStr;

    let pg = PgCluster::start().unwrap();
    let admin = chosen_tests::connect_admin(&pg.url()).await.unwrap();
    let role = unique_name("chosen_no_emit").replace('-', "_");
    admin
        .batch_execute(&format!(
            "CREATE ROLE {role} LOGIN PASSWORD 'no-emit-secret'; \
             GRANT CONNECT ON DATABASE postgres TO {role}; \
             {}",
            emit_grant("REVOKE", "FROM")
        ))
        .await
        .unwrap();
    let mut config = tokio_postgres::Config::from_str(&pg.url()).unwrap();
    config.user(&role).password("no-emit-secret");
    let refused = LockManager::connect(ManagerOptions::from_pg_config(config).node_id("no-emit"))
        .await
        .expect_err("refused at connect");
    let text = refused.to_string();
    assert!(
        text.contains("pg_logical_emit_message") && text.contains("GRANT EXECUTE"),
        "{text}"
    );
    admin
        .batch_execute(&emit_grant("GRANT", "TO"))
        .await
        .unwrap();
}

/// `GRANT`/`REVOKE` of `pg_logical_emit_message` to or from PUBLIC, whatever the
/// server's version: 17 gave it a fourth argument (`flush`) and dropped the
/// three-argument form.
fn emit_grant(verb: &str, preposition: &str) -> String {
    format!(
        "DO $$ BEGIN EXECUTE format('{verb} EXECUTE ON FUNCTION %s {preposition} PUBLIC', \
         coalesce(to_regprocedure('pg_catalog.pg_logical_emit_message(boolean, text, text, boolean)'), \
                  to_regprocedure('pg_catalog.pg_logical_emit_message(boolean, text, text)'))); END $$"
    )
}
