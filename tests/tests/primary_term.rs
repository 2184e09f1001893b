//! A new primary term (a restart, a crash, a promotion) against real servers: no lock
//! is granted before a holder of the old term that went silent has fenced itself, and
//! fencing tokens never go backwards. Each prints a `TERM` line with the measured times
//! (run with `--nocapture` to see them). The term's machinery (the grant hold of a
//! young term, the token record every win writes) costs nothing else: a win waits for
//! no synchronous standby, a try during the hold answers at once, and a role that may
//! not write the token record is refused at connect.
//!
//! Not tested, as no client rule can tell the timelines apart: tokens going backwards
//! when two standbys promoted one after the other share a timeline number (documented
//! on `FencingToken`).

use std::time::{Duration, Instant};

use chosen_core::{FencingToken, LockManager, ManagerOptions};
use chosen_tests::{FaultProxy, PgCluster, ProxyMode, connect_admin, fault_options, unique_name};

/// Waits until the server's current term is older than the grant delay, so the first
/// grants of a test are not held back by the cluster's own start.
async fn settle(options: &ManagerOptions) {
    tokio::time::sleep(options.get_term_grant_delay()).await;
}

/// (b) The holder is partitioned (its sockets silent) and the server restarts: the
/// holder never hears of it and trusts its lease until its own deadline. The other node
/// reconnects at once and finds the lock free on the new server; it must not start
/// before the old holder fenced itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_holder_fences_itself_before_a_restarted_server_grants() {
    let mut pg = PgCluster::start_local().unwrap();
    let port = pg.port().unwrap();
    let proxy = FaultProxy::start(([127, 0, 0, 1], port).into())
        .await
        .unwrap();
    let name = unique_name("term-partition");
    let a_opts = fault_options(&proxy.url(&pg.url(), port), "term-a");
    let delay = a_opts.get_term_grant_delay();
    settle(&a_opts).await;
    let a = LockManager::connect(a_opts).await.unwrap();
    let b = LockManager::connect(fault_options(&pg.url(), "term-b"))
        .await
        .unwrap();
    let held = a.acquire(name.as_str()).await.unwrap();
    let old_token = held.fencing_token().await.unwrap();
    let a_lost = tokio::spawn(async move {
        held.lost().await;
        Instant::now()
    });
    let b_task = {
        let name = name.clone();
        tokio::spawn(async move {
            let lease = b.acquire(name.as_str()).await.unwrap();
            (
                Instant::now(),
                lease.fencing_token().await.unwrap(),
                b,
                lease,
            )
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;

    proxy.set(ProxyMode::BlackHole);
    let t0 = Instant::now();
    let mut restarting = tokio::task::spawn_blocking(move || {
        pg.restart("fast").unwrap();
        (pg, Instant::now())
    });
    let (b_at, new_token, _b, _lease) = tokio::time::timeout(Duration::from_secs(60), b_task)
        .await
        .expect("the other node takes over")
        .unwrap();
    let a_lost_at = tokio::time::timeout(Duration::from_secs(30), a_lost)
        .await
        .expect("the partitioned holder fences itself")
        .unwrap();
    let (_pg, up_at) = (&mut restarting).await.unwrap();
    eprintln!(
        "TERM partitioned holder + restart: server back after {:?}, old holder fenced after {:?}, new holder after {:?} ({:?} after the server was back; delay {delay:?})",
        up_at - t0,
        a_lost_at - t0,
        b_at - t0,
        b_at.saturating_duration_since(up_at)
    );
    assert!(
        b_at > a_lost_at,
        "overlap: the new holder started {:?} before the partitioned holder fenced itself",
        a_lost_at - b_at
    );
    assert!(
        b_at - up_at <= delay + Duration::from_secs(2),
        "takeover took {:?} after the server was back (delay {delay:?})",
        b_at - up_at
    );
    assert!(new_token > old_token, "{new_token} <= {old_token}");
    drop(a);
}

/// The cost: a plain restart with no silent holder hands over only after the delay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_restart_hands_over_after_the_delay() {
    let mut pg = PgCluster::start_local().unwrap();
    let name = unique_name("term-plain");
    let a_opts = fault_options(&pg.url(), "plain-a");
    let delay = a_opts.get_term_grant_delay();
    settle(&a_opts).await;
    let a = LockManager::connect(a_opts).await.unwrap();
    let b = LockManager::connect(fault_options(&pg.url(), "plain-b"))
        .await
        .unwrap();
    let held = a.acquire(name.as_str()).await.unwrap();
    let b_task = {
        let name = name.clone();
        tokio::spawn(async move {
            let lease = b.acquire(name.as_str()).await.unwrap();
            (Instant::now(), b, lease)
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let t0 = Instant::now();
    let (pg, up_at) = tokio::task::spawn_blocking(move || {
        pg.restart("fast").unwrap();
        (pg, Instant::now())
    })
    .await
    .unwrap();
    assert!(!held.is_valid(), "the holder heard of the restart");
    let (b_at, _b, _lease) = tokio::time::timeout(Duration::from_secs(60), b_task)
        .await
        .expect("the other node takes over")
        .unwrap();
    eprintln!(
        "TERM plain restart: server back after {:?}, first grant after {:?} ({:?} after the server was back; delay {delay:?})",
        up_at - t0,
        b_at - t0,
        b_at - up_at
    );
    assert!(b_at - up_at <= delay + Duration::from_secs(2));
    drop((pg, a));
}

/// (c) After an asynchronous failover the promoted standby hands out transaction ids
/// the old primary already handed out: the timeline in the token's high bits keeps
/// every token issued after the promotion above every token issued before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_never_go_backwards_across_a_promotion() {
    let mut primary = PgCluster::start_local().unwrap();
    let mut standby = primary.start_standby().unwrap();
    let name = unique_name("term-failover");
    // The standby falls behind (here: it is down) while the old primary hands out
    // tokens that it therefore never receives.
    standby.stop("fast").unwrap();
    let a = LockManager::connect(
        fault_options(&primary.url(), "failover-a").term_grant_delay(Duration::ZERO),
    )
    .await
    .unwrap();
    let mut before: Vec<FencingToken> = Vec::new();
    for _ in 0..20 {
        let lease = a.acquire(name.as_str()).await.unwrap();
        before.push(lease.fencing_token().await.unwrap());
        lease.release().await.unwrap();
    }
    let held = a.acquire(name.as_str()).await.unwrap();
    before.push(held.fencing_token().await.unwrap());
    primary.stop("immediate").unwrap();
    standby.start_again().unwrap();
    let admin = connect_admin(&standby.url()).await.unwrap();
    let promoted: bool = admin
        .query_one("SELECT pg_promote(true, 60)", &[])
        .await
        .unwrap()
        .get(0);
    assert!(promoted);

    let t0 = Instant::now();
    let b = LockManager::connect(fault_options(&standby.url(), "failover-b"))
        .await
        .unwrap();
    let mut after = Vec::new();
    for _ in 0..5 {
        let lease = b.acquire(name.as_str()).await.unwrap();
        if after.is_empty() {
            eprintln!(
                "TERM promotion: first grant {:?} after connecting to the promoted standby",
                t0.elapsed()
            );
        }
        after.push(lease.fencing_token().await.unwrap());
        lease.release().await.unwrap();
    }
    let newest_before = *before.iter().max().unwrap();
    let oldest_after = *after.iter().min().unwrap();
    eprintln!(
        "TERM promotion: tokens before {:?}..{newest_before} (timeline {}, xid {}), after {oldest_after}.. (timeline {}, xid {})",
        before.first(),
        newest_before.timeline(),
        newest_before.xact_id(),
        oldest_after.timeline(),
        oldest_after.xact_id(),
    );
    assert!(
        oldest_after > newest_before,
        "fencing token went backwards across a failover: {newest_before} before, {oldest_after} after"
    );
    assert!(oldest_after.timeline() > newest_before.timeline());
    drop(held);
}

/// (c) A crash with `synchronous_commit = off` (the harness's setting) loses commit
/// records still in the WAL buffers (the WAL writer flushes every 10 s here), and the
/// restarted server hands their transaction ids out again: the statements that issue
/// tokens commit synchronously whatever the server's setting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_never_go_backwards_across_a_crash() {
    let mut pg = PgCluster::builder()
        .setting("wal_writer_delay", "10s")
        .setting("autovacuum", "off")
        .start()
        .unwrap();
    let name = unique_name("term-crash");
    let a =
        LockManager::connect(fault_options(&pg.url(), "crash-a").term_grant_delay(Duration::ZERO))
            .await
            .unwrap();
    for _ in 0..5 {
        a.acquire(name.as_str())
            .await
            .unwrap()
            .release()
            .await
            .unwrap();
    }
    let held = a.acquire(name.as_str()).await.unwrap();
    let old = held.fencing_token().await.unwrap();
    pg.restart("immediate").unwrap();
    let b =
        LockManager::connect(fault_options(&pg.url(), "crash-b").term_grant_delay(Duration::ZERO))
            .await
            .unwrap();
    let lease = b.acquire(name.as_str()).await.unwrap();
    let new = lease.fencing_token().await.unwrap();
    eprintln!("TERM crash: token before {old}, after {new}");
    assert!(
        !held.is_valid(),
        "the old holder's session died with the server"
    );
    assert!(
        new > old,
        "fencing token went backwards across a server crash: the old holder had {old}, the next one got {new}"
    );
}

/// (a) The holder is partitioned (its sockets silent), the primary stops and its hot
/// standby is promoted. The other node, on a multi-host URL, finds the promoted server
/// by itself, where no lock is held at all; it must not start before the old holder
/// fenced itself, and it takes over within the grant delay (+ 2 s) of the promotion.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_holder_fences_itself_before_a_promoted_standby_grants() {
    let mut primary = PgCluster::start_local().unwrap();
    let standby = primary.start_standby().unwrap();
    let (primary_port, standby_port) = (primary.port().unwrap(), standby.port().unwrap());
    let proxy = FaultProxy::start(([127, 0, 0, 1], primary_port).into())
        .await
        .unwrap();
    let name = unique_name("term-promotion");
    let a_opts = fault_options(&proxy.url(&primary.url(), primary_port), "promote-a");
    let delay = a_opts.get_term_grant_delay();
    // Both hosts, the primary first; read-write targeting is the default for a
    // multi-host URL.
    let multi_host = format!(
        "host=127.0.0.1,127.0.0.1 port={primary_port},{standby_port} user=postgres password={} dbname=postgres",
        chosen_tests::SUPERUSER_PASSWORD
    );
    settle(&a_opts).await;
    let a = LockManager::connect(a_opts).await.unwrap();
    let b = LockManager::connect(fault_options(&multi_host, "promote-b"))
        .await
        .unwrap();
    assert_eq!(server_of(&b), format!("127.0.0.1:{primary_port}"));
    let held = a.acquire(name.as_str()).await.unwrap();
    let old_token = held.fencing_token().await.unwrap();
    let a_lost = tokio::spawn(async move {
        held.lost().await;
        Instant::now()
    });
    let b_task = {
        let name = name.clone();
        tokio::spawn(async move {
            let lease = b.acquire(name.as_str()).await.unwrap();
            (
                Instant::now(),
                lease.fencing_token().await.unwrap(),
                b,
                lease,
            )
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;

    // The partition, then the failover: the old primary stops serving before the
    // standby is promoted (what Patroni, RDS and Cloud SQL do).
    proxy.set(ProxyMode::BlackHole);
    let t0 = Instant::now();
    tokio::task::spawn_blocking(move || {
        primary.stop("fast").unwrap();
        primary
    })
    .await
    .unwrap();
    let admin = connect_admin(&standby.url()).await.unwrap();
    let promoted: bool = admin
        .query_one("SELECT pg_promote(true, 60)", &[])
        .await
        .unwrap()
        .get(0);
    assert!(promoted);
    let promoted_at = Instant::now();

    let (b_at, new_token, b, _lease) = tokio::time::timeout(Duration::from_secs(60), b_task)
        .await
        .expect("the other node takes over on the promoted standby")
        .unwrap();
    let a_lost_at = tokio::time::timeout(Duration::from_secs(30), a_lost)
        .await
        .expect("the partitioned holder fences itself")
        .unwrap();
    eprintln!(
        "TERM partitioned holder + promotion: promoted after {:?}, old holder fenced after {:?}, new holder after {:?} ({:?} after the promotion; delay {delay:?})",
        promoted_at - t0,
        a_lost_at - t0,
        b_at - t0,
        b_at.saturating_duration_since(promoted_at)
    );
    assert!(
        b_at > a_lost_at,
        "overlap: the new holder started {:?} before the partitioned holder fenced itself",
        a_lost_at - b_at
    );
    assert!(
        b_at - promoted_at <= delay + Duration::from_secs(2),
        "takeover took {:?} after the promotion (delay {delay:?})",
        b_at - promoted_at
    );
    assert!(new_token > old_token, "{new_token} <= {old_token}");
    assert!(new_token.timeline() > old_token.timeline());
    assert_eq!(
        server_of(&b),
        format!("127.0.0.1:{standby_port}"),
        "the session moved to the promoted standby"
    );
    drop(a);
}

fn server_of(m: &LockManager) -> String {
    match m.connection_status() {
        chosen_core::ConnectionState::Connected { server, .. } => server,
        other => panic!("not connected: {other:?}"),
    }
}

/// A synchronous standby is configured but down (or slow). The token expression set
/// `synchronous_commit = on` and writes WAL, so the commit of every statement that wins
/// a lock waits for the standby. `statement_timeout` does not cover a commit's sync-rep
/// wait, so the statement never returns: no lock is ever granted, and (one connection,
/// heartbeat behind it) the session is lost. Before the `term` change (durable,
/// timeline-carrying tokens) a win wrote no WAL and never waited for standbys. The
/// timeline already keeps tokens monotonic across a failover, so
/// `synchronous_commit = local` is enough.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_win_does_not_wait_for_a_synchronous_standby() {
    let pg = PgCluster::builder()
        .setting("synchronous_standby_names", "ghost")
        .start()
        .unwrap();
    let a = LockManager::connect(
        fault_options(&pg.url(), "syncrep-a").term_grant_delay(Duration::ZERO),
    )
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

/// `try_acquire` ("takes the lock if it is free right now") on a session whose server
/// term is young waits for the whole term hold (6 s by default) before it answers,
/// holding the key at the server meanwhile. It should answer at once (`Ok(None)`, or a
/// dedicated refusal) and not take the key at the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn try_acquire_answers_promptly_during_the_term_hold() {
    let pg = PgCluster::start_local().unwrap();
    // The cluster just started: its term is younger than the 6 s default delay.
    let a = LockManager::connect(fault_options(&pg.url(), "try-a"))
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

/// A role that may not run `pg_logical_emit_message` (a DBA revoked it from PUBLIC)
/// would fail every win with a bare permission error: the connect refuses it, naming
/// the grant to run.
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
