//! Real faults against throwaway clusters: every test asserts that no two holders
//! overlap and that another node takes over within a bound. Each prints a `FAULT` line
//! with the measured times (run with `--nocapture` to see them).

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use chosen_core::{
    ConnectionState, Error, FencingToken, LockManager, MetricsSink, SessionDownReason,
};
use chosen_tests::{
    FaultProxy, PgCluster, ProxyMode, connect_admin, fault_options, signal, unique_name,
};

#[derive(Debug, Clone)]
struct Interval {
    node: String,
    token: FencingToken,
    start: Instant,
    end: Option<Instant>,
    reason: Option<SessionDownReason>,
}

/// Keeps acquiring `name` on `manager`, recording every holding interval.
#[derive(Clone, Default)]
struct History(Arc<Mutex<Vec<Interval>>>);

impl History {
    fn contend(&self, manager: LockManager, name: String) -> tokio::task::JoinHandle<()> {
        let history = self.clone();
        tokio::spawn(async move {
            loop {
                // The token with the grant: known at once, whatever happens next.
                let request = chosen_core::LockRequest::from(name.as_str()).eager_token();
                let lease = match manager.acquire(request).await {
                    Ok(lease) => lease,
                    Err(Error::Closed) => return,
                    Err(e) => panic!("acquire failed: {e}"),
                };
                let token = lease.known_fencing_token().expect("taken with the grant");
                let index = {
                    let mut h = history.0.lock().unwrap();
                    h.push(Interval {
                        node: manager.node_id().to_owned(),
                        token,
                        start: Instant::now(),
                        end: None,
                        reason: None,
                    });
                    h.len() - 1
                };
                let reason = lease.lost().await;
                let mut h = history.0.lock().unwrap();
                h[index].end = Some(Instant::now());
                h[index].reason = Some(reason);
            }
        })
    }

    fn snapshot(&self) -> Vec<Interval> {
        self.0.lock().unwrap().clone()
    }

    /// Waits until some interval satisfies `pred`.
    async fn wait_for(&self, what: &str, limit: Duration, pred: impl Fn(&[Interval]) -> bool) {
        let deadline = Instant::now() + limit;
        loop {
            if pred(&self.snapshot()) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}: {:#?}",
                self.snapshot()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    fn current_holders(&self) -> Vec<String> {
        self.snapshot()
            .into_iter()
            .filter(|i| i.end.is_none())
            .map(|i| i.node)
            .collect()
    }

    /// No two intervals overlap, and tokens grow from holder to holder.
    fn assert_no_overlap(&self) {
        let mut h = self.snapshot();
        h.sort_by_key(|i| i.start);
        for pair in h.windows(2) {
            let end = pair[0].end.unwrap_or_else(|| {
                panic!(
                    "{} still held when {} acquired: {h:#?}",
                    pair[0].node, pair[1].node
                )
            });
            assert!(
                end <= pair[1].start,
                "overlap: {} held until {:?} after {} acquired: {h:#?}",
                pair[0].node,
                end - pair[1].start,
                pair[1].node
            );
            assert!(pair[1].token > pair[0].token, "token regression: {h:#?}");
        }
    }
}

fn ms(d: Duration) -> u128 {
    d.as_millis()
}

/// Counts a manager's try statements (each poll of its waiting keys is one).
#[derive(Debug, Default)]
struct PollCounter(AtomicU64);

impl MetricsSink for PollCounter {
    fn poll_query(&self, _node: &str, _keys: usize) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

impl PollCounter {
    /// Waits until `manager` has started `n` try statements.
    async fn wait_for(&self, n: u64, limit: Duration) {
        let deadline = Instant::now() + limit;
        while self.0.load(Ordering::SeqCst) < n {
            assert!(
                Instant::now() < deadline,
                "timed out waiting for try statement {n} ({} so far)",
                self.0.load(Ordering::SeqCst)
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
}

/// A, then B, contend; the fault is applied to whoever holds first. Returns once B has
/// tried the lock and seen A hold it, so that B takes over as a waiter that knows the
/// lock was contended (and grants with the takeover grace), whatever the fault.
async fn two_contenders(
    url_a: &str,
    url_b: &str,
    name: &str,
) -> (LockManager, LockManager, History) {
    let a = LockManager::connect(fault_options(url_a, "node-a"))
        .await
        .unwrap();
    let polls = Arc::new(PollCounter::default());
    let b = LockManager::connect(fault_options(url_b, "node-b").metrics(polls.clone()))
        .await
        .unwrap();
    let history = History::default();
    history.contend(a.clone(), name.to_owned());
    history
        .wait_for("A to hold", Duration::from_secs(10), |h| h.len() == 1)
        .await;
    history.contend(b.clone(), name.to_owned());
    // B's manager runs one statement at a time and plans the next try only after the
    // last one answered: its second try means the first came back without the lock.
    polls.wait_for(2, Duration::from_secs(10)).await;
    assert_eq!(history.current_holders(), vec!["node-a".to_owned()]);
    (a, b, history)
}

fn report(fault: &str, t0: Instant, history: &History) {
    let h = history.snapshot();
    let revoked = h[0].end.map(|e| ms(e - t0));
    let next = h.get(1).map(|i| ms(i.start - t0));
    let gap = match (h[0].end, h.get(1)) {
        (Some(end), Some(next)) => Some(ms(next.start - end)),
        _ => None,
    };
    eprintln!(
        "FAULT {fault}: old holder revoked after {revoked:?} ms, new holder after {next:?} ms, gap {gap:?} ms (no overlap), reason {:?}",
        h[0].reason
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminated_backend_revokes_at_once_and_another_takes_over() {
    let pg = PgCluster::start_local().unwrap();
    let name = unique_name("terminate");
    let (a, _b, history) = two_contenders(&pg.url(), &pg.url(), &name).await;
    let pid = match a.connection_status() {
        ConnectionState::Connected { backend_pid, .. } => backend_pid,
        other => panic!("{other:?}"),
    };
    let admin = connect_admin(&pg.url()).await.unwrap();
    let t0 = Instant::now();
    admin
        .execute("SELECT pg_terminate_backend($1)", &[&pid])
        .await
        .unwrap();
    history
        .wait_for("a second holder", Duration::from_secs(10), |h| h.len() >= 2)
        .await;
    history.assert_no_overlap();
    let h = history.snapshot();
    assert!(
        matches!(h[0].reason, Some(SessionDownReason::ConnectionLost { .. })),
        "{h:#?}"
    );
    assert!(
        h[0].end.unwrap() - t0 < Duration::from_secs(2),
        "revoked at once"
    );
    report("pg_terminate_backend", t0, &history);
    // A reconnects in a new generation.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !matches!(a.connection_status(), ConnectionState::Connected { generation, .. } if generation >= 2)
    {
        assert!(Instant::now() < deadline, "{:?}", a.connection_status());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn black_holed_holder_fences_itself_before_the_server_releases() {
    let pg = PgCluster::start_local().unwrap();
    let port = pg.port().unwrap();
    let proxy = FaultProxy::start(([127, 0, 0, 1], port).into())
        .await
        .unwrap();
    let name = unique_name("blackhole");
    let (a, _b, history) = two_contenders(&proxy.url(&pg.url(), port), &pg.url(), &name).await;
    let t0 = Instant::now();
    proxy.set(ProxyMode::BlackHole);
    history
        .wait_for("a second holder", Duration::from_secs(30), |h| h.len() >= 2)
        .await;
    history.assert_no_overlap();
    let h = history.snapshot();
    assert!(
        matches!(
            h[0].reason,
            Some(SessionDownReason::HeartbeatOverdue { .. })
        ),
        "{h:#?}"
    );
    let opts = a.options();
    let revoked = h[0].end.unwrap() - t0;
    let taken = h[1].start - t0;
    assert!(
        revoked <= opts.get_lease_timeout() + Duration::from_secs(1),
        "{revoked:?}"
    );
    // The server released only after the client had fenced itself and its stop budget
    // had passed.
    assert!(
        taken >= revoked + opts.get_stop_budget(),
        "server released at {taken:?}, client revoked at {revoked:?}"
    );
    assert!(taken < Duration::from_secs(20), "{taken:?}");
    report("black-hole (proxy)", t0, &history);
    proxy.set(ProxyMode::Pass);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cut_connection_revokes_at_once() {
    let pg = PgCluster::start_local().unwrap();
    let port = pg.port().unwrap();
    let proxy = FaultProxy::start(([127, 0, 0, 1], port).into())
        .await
        .unwrap();
    let name = unique_name("cut");
    let (_a, _b, history) = two_contenders(&proxy.url(&pg.url(), port), &pg.url(), &name).await;
    let t0 = Instant::now();
    proxy.set(ProxyMode::Cut);
    history
        .wait_for("a second holder", Duration::from_secs(20), |h| h.len() >= 2)
        .await;
    history.assert_no_overlap();
    let h = history.snapshot();
    // A closed socket is seen at once: the lease is revoked as a lost connection, well
    // before any heartbeat deadline (the lease timeout is 3 s).
    assert!(
        matches!(h[0].reason, Some(SessionDownReason::ConnectionLost { .. })),
        "{h:#?}"
    );
    let revoked = h[0].end.unwrap() - t0;
    assert!(
        revoked < Duration::from_secs(2),
        "revoked after {revoked:?}"
    );
    report("cut (proxy closes both sides)", t0, &history);
    proxy.set(ProxyMode::Pass);
}

/// Spawns the holder binary and returns it with a reader of its lines.
fn spawn_holder(
    url: &str,
    name: &str,
    node: &str,
) -> (std::process::Child, std::sync::mpsc::Receiver<String>) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_chosen-holder"))
        .args([url, name, node])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    (child, rx)
}

fn unix_us(t: SystemTime) -> u128 {
    t.duration_since(UNIX_EPOCH).unwrap().as_micros()
}

fn wait_line(rx: &std::sync::mpsc::Receiver<String>, prefix: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = rx
            .recv_timeout(left)
            .unwrap_or_else(|_| panic!("no {prefix:?} line"));
        if line.starts_with(prefix) {
            return line;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frozen_holder_loses_to_the_server_and_wakes_up_fenced() {
    let pg = PgCluster::start_local().unwrap();
    let name = unique_name("frozen");
    let (mut holder, lines) = spawn_holder(&pg.url(), &name, "frozen-holder");
    let acquired = wait_line(&lines, "acquired");
    let holder_token: u64 = acquired.split(' ').nth(1).unwrap().parse().unwrap();

    let b = LockManager::connect(fault_options(&pg.url(), "node-b"))
        .await
        .unwrap();
    let t0 = Instant::now();
    let frozen_at = SystemTime::now();
    signal(holder.id(), "STOP").unwrap();
    let lease = tokio::time::timeout(Duration::from_secs(30), b.acquire(name.as_str()))
        .await
        .expect("the server releases a frozen holder's lock")
        .unwrap();
    let taken = t0.elapsed();
    let taken_at = unix_us(SystemTime::now());
    assert!(lease.fencing_token().await.unwrap().get() > holder_token);

    // Let it sleep a little longer, then wake it: its first check must say "lost".
    tokio::time::sleep(Duration::from_secs(1)).await;
    signal(holder.id(), "CONT").unwrap();
    let mut last_tick = 0u128;
    let lost = loop {
        let line = lines
            .recv_timeout(Duration::from_secs(20))
            .expect("holder reports");
        if let Some(t) = line.strip_prefix("tick ") {
            last_tick = t.parse().unwrap();
            continue;
        }
        if line.starts_with("lost") {
            break line;
        }
    };
    assert!(
        last_tick < unix_us(frozen_at) + 100_000 && last_tick < taken_at,
        "the woken holder acted as a holder after it was frozen (tick at {last_tick}, frozen at {}, taken over at {taken_at})",
        unix_us(frozen_at)
    );
    let lost_at: u128 = lost.split(' ').nth(1).unwrap().parse().unwrap();
    assert!(lost.contains("heartbeat"), "{lost}");
    let _ = holder.wait();
    eprintln!(
        "FAULT SIGSTOP holder: new holder after {} ms (server idle_session_timeout), woken holder reported lost {} ms after the takeover with no work in between; tokens {holder_token} -> {}",
        ms(taken),
        (lost_at.saturating_sub(taken_at)) / 1000,
        lease.fencing_token().await.unwrap()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_holder_process_is_replaced_within_a_poll() {
    let pg = PgCluster::start_local().unwrap();
    let name = unique_name("killed");
    let (mut holder, lines) = spawn_holder(&pg.url(), &name, "killed-holder");
    wait_line(&lines, "acquired");
    let polls = Arc::new(PollCounter::default());
    let b = LockManager::connect(fault_options(&pg.url(), "node-b").metrics(polls.clone()))
        .await
        .unwrap();
    let waiting = tokio::spawn({
        let b = b.clone();
        let name = name.clone();
        async move { b.acquire(name.as_str()).await }
    });
    // B waits, having seen the holder hold the lock (see `two_contenders`).
    polls.wait_for(2, Duration::from_secs(10)).await;
    assert!(!waiting.is_finished());
    let t0 = Instant::now();
    holder.kill().unwrap();
    let _ = holder.wait();
    let lease = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    eprintln!(
        "FAULT SIGKILL holder: new holder after {} ms",
        ms(t0.elapsed())
    );
    drop(lease);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_lock_table_means_not_acquired_not_a_crash() {
    let pg = PgCluster::builder()
        .setting("max_locks_per_transaction", "10")
        .setting("max_connections", "20")
        .start()
        .unwrap();
    let m = LockManager::connect(fault_options(&pg.url(), "table-full"))
        .await
        .unwrap();
    let name = unique_name("table");
    let held = m.acquire(format!("{name}-held")).await.unwrap();

    // Another session fills the whole lock table.
    let filler = connect_admin(&pg.url()).await.unwrap();
    let err = filler
        .batch_execute("SELECT pg_try_advisory_lock(7, g) FROM generate_series(1, 100000) g")
        .await
        .unwrap_err();
    assert_eq!(
        err.code(),
        Some(&tokio_postgres::error::SqlState::OUT_OF_MEMORY)
    );

    // Not acquired (and no locks leaked by the failed statement), session intact.
    assert!(m.try_acquire(format!("{name}-1")).await.unwrap().is_none());
    let batch: Vec<_> = (0..20)
        .map(|i| m.try_acquire(format!("{name}-b{i}")))
        .collect();
    for f in batch {
        assert!(f.await.unwrap().is_none());
    }
    let waiting = tokio::spawn({
        let m = m.clone();
        let name = name.clone();
        async move { m.acquire(format!("{name}-2")).await }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!waiting.is_finished());
    assert!(held.is_valid());
    assert!(m.connection_status().is_connected());

    // Space again: the queued request goes through.
    filler
        .batch_execute("SELECT pg_advisory_unlock_all()")
        .await
        .unwrap();
    let lease = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(lease.is_valid());
    let admin = connect_admin(&pg.url()).await.unwrap();
    let ours: i64 = admin
        .query_one(
            "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) WHERE l.locktype = 'advisory' AND a.application_name = 'table-full'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(ours, 2, "exactly the two held locks, nothing leaked");
}

async fn restart_scenario(mode: &'static str) {
    let mut pg = PgCluster::start_local().unwrap();
    let name = unique_name(&format!("restart-{mode}"));
    let (a, b, history) = two_contenders(&pg.url(), &pg.url(), &name).await;
    let t0 = Instant::now();
    let pg = tokio::task::spawn_blocking(move || {
        pg.restart(mode).unwrap();
        pg
    })
    .await
    .unwrap();
    history
        .wait_for("a holder after the restart", Duration::from_secs(30), |h| {
            h.len() >= 2 && h.iter().filter(|i| i.end.is_none()).count() == 1
        })
        .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    history.assert_no_overlap();
    assert_eq!(history.current_holders().len(), 1);
    report(&format!("server restart -m {mode}"), t0, &history);
    a.shutdown().await;
    b.shutdown().await;
    drop(pg);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_restart_fast_revokes_then_exactly_one_holds() {
    restart_scenario("fast").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_restart_immediate_revokes_then_exactly_one_holds() {
    restart_scenario("immediate").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_down_for_a_while_revokes_everything_then_one_holds_again() {
    let mut pg = PgCluster::start_local().unwrap();
    let name = unique_name("down");
    let (a, b, history) = two_contenders(&pg.url(), &pg.url(), &name).await;
    let t0 = Instant::now();
    pg = tokio::task::spawn_blocking(move || {
        pg.stop("fast").unwrap();
        pg
    })
    .await
    .unwrap();
    history
        .wait_for("the holder to be revoked", Duration::from_secs(10), |h| {
            h.iter().all(|i| i.end.is_some())
        })
        .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(history.current_holders().is_empty());
    assert!(!a.connection_status().is_connected());
    assert!(!b.connection_status().is_connected());
    assert!(matches!(
        a.try_acquire("anything").await,
        Err(Error::NotConnected(_))
    ));
    pg = tokio::task::spawn_blocking(move || {
        pg.start_again().unwrap();
        pg
    })
    .await
    .unwrap();
    history
        .wait_for("a holder after the start", Duration::from_secs(30), |h| {
            h.len() >= 2 && h.iter().filter(|i| i.end.is_none()).count() == 1
        })
        .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    history.assert_no_overlap();
    assert_eq!(history.current_holders().len(), 1);
    report("server stopped ~3 s", t0, &history);
    drop(pg);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hot_standby_is_refused_and_multi_host_urls_pick_the_primary() {
    let pg = PgCluster::start_local().unwrap();
    let standby = pg.start_standby().unwrap();
    let admin = connect_admin(&standby.url()).await.unwrap();
    let in_recovery: bool = admin
        .query_one("SELECT pg_is_in_recovery()", &[])
        .await
        .unwrap()
        .get(0);
    assert!(in_recovery);

    let err = LockManager::connect(fault_options(&standby.url(), "on-standby"))
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::Refused(SessionDownReason::ServerInRecovery)),
        "{err}"
    );
    assert!(err.to_string().contains("standby"), "{err}");

    // Standby first in a multi-host URL: read-write targeting skips to the primary.
    let url = format!(
        "host=127.0.0.1,127.0.0.1 port={},{} user=postgres password={} dbname=postgres",
        standby.port().unwrap(),
        pg.port().unwrap(),
        chosen_tests::SUPERUSER_PASSWORD
    );
    let m = LockManager::connect(fault_options(&url, "multi-host"))
        .await
        .unwrap();
    // The status says which host it is on: the primary's port.
    match m.connection_status() {
        ConnectionState::Connected { server, .. } => assert_eq!(
            server,
            format!("127.0.0.1:{}", pg.port().unwrap()),
            "the session is on the primary"
        ),
        other => panic!("not connected: {other:?}"),
    }
    // (Acquire, not try: the cluster just started, and no lock is granted before its
    // term is `term_grant_delay` old.)
    let lease = tokio::time::timeout(Duration::from_secs(20), m.acquire(unique_name("multi")))
        .await
        .expect("granted once the new term's hold ends")
        .unwrap();
    assert!(lease.is_valid());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dba_defaults_do_not_break_a_holder() {
    let pg = PgCluster::start_local().unwrap();
    let admin = connect_admin(&pg.url()).await.unwrap();
    // Settings that would kill or break our session if we did not override them;
    // `transaction_timeout` (PostgreSQL 17 on) ends the session itself.
    admin
        .batch_execute(
            "ALTER ROLE postgres SET idle_session_timeout = '300ms'; \
             ALTER ROLE postgres SET statement_timeout = '1ms'; \
             ALTER ROLE postgres SET idle_in_transaction_session_timeout = '1ms'",
        )
        .await
        .unwrap();
    let version: i32 = admin
        .query_one("SELECT current_setting('server_version_num')::int4", &[])
        .await
        .unwrap()
        .get(0);
    if version >= 170_000 {
        admin
            .batch_execute("ALTER ROLE postgres SET transaction_timeout = '1ms'")
            .await
            .unwrap();
    }
    let m = LockManager::connect(fault_options(&pg.url(), "dba-defaults"))
        .await
        .unwrap();
    let name = unique_name("dba");
    let lease = m.acquire(name.as_str()).await.unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(lease.is_valid(), "{:?}", lease.loss_reason());
    assert!(matches!(
        m.connection_status(),
        ConnectionState::Connected { generation: 1, .. }
    ));
    let many: Vec<_> = (0..200).map(|i| m.acquire(format!("{name}-{i}"))).collect();
    let mut held = Vec::new();
    for f in many {
        held.push(f.await.unwrap());
    }
    assert!(lease.is_valid());
    assert!(held.iter().all(chosen_core::Lease::is_valid));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_with_verification() {
    let pg = PgCluster::builder().tls().start().unwrap();
    let cert = pg.tls_certificate().unwrap();
    let url = format!("{}?sslmode=require", pg.url());

    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    use rustls::pki_types::{CertificateDer, pem::PemObject};
    for c in CertificateDer::pem_slice_iter(&cert) {
        roots.add(c.unwrap()).unwrap();
    }
    let trusted = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let m = LockManager::connect(fault_options(&url, "tls-node").rustls(trusted))
        .await
        .unwrap();
    let pid = match m.connection_status() {
        ConnectionState::Connected { backend_pid, .. } => backend_pid,
        other => panic!("{other:?}"),
    };
    let lease = m.acquire(unique_name("tls")).await.unwrap();
    let admin = connect_admin(&pg.url()).await.unwrap();
    let ssl: bool = admin
        .query_one("SELECT ssl FROM pg_stat_ssl WHERE pid = $1", &[&pid])
        .await
        .unwrap()
        .get(0);
    assert!(ssl, "the lock session is encrypted");
    drop(lease);

    // A server whose certificate is not trusted is refused (verify-full semantics).
    let untrusted = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_no_client_auth();
    let err = LockManager::connect(fault_options(&url, "tls-untrusted").rustls(untrusted))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Connect { .. }), "{err}");

    // sslmode=require without TLS settings: a configuration error, before connecting.
    let err = LockManager::connect(fault_options(&url, "tls-missing"))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::InvalidConfig { .. }), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminated_holder_knows_before_anyone_else_holds() {
    // The server releases a terminated session's locks at once; the holder learns a
    // moment later. A waiter polling every 10 ms would often win inside that moment
    // without the takeover grace.
    let pg = PgCluster::start_local().unwrap();
    let admin = connect_admin(&pg.url()).await.unwrap();
    let b = LockManager::connect(
        fault_options(&pg.url(), "race-b").poll_interval(Duration::from_millis(10)),
    )
    .await
    .unwrap();
    let mut closest = Duration::MAX;
    for round in 0..20 {
        let node = format!("race-a-{round}");
        let a = LockManager::connect(fault_options(&pg.url(), &node))
            .await
            .unwrap();
        let name = unique_name("race");
        let lease = a.acquire(name.as_str()).await.unwrap();
        let waiter = tokio::spawn({
            let b = b.clone();
            let name = name.clone();
            async move {
                let lease = b.acquire(name.as_str()).await.unwrap();
                (Instant::now(), lease)
            }
        });
        tokio::time::sleep(Duration::from_millis(30)).await;
        let watch = tokio::spawn(async move {
            lease.lost().await;
            Instant::now()
        });
        admin
            .execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1",
                &[&node],
            )
            .await
            .unwrap();
        let revoked = watch.await.unwrap();
        let (granted, lease_b) = tokio::time::timeout(Duration::from_secs(10), waiter)
            .await
            .unwrap()
            .unwrap();
        assert!(
            revoked <= granted,
            "round {round}: the old holder learned {:?} after the new one held",
            revoked - granted
        );
        closest = closest.min(granted - revoked);
        drop(lease_b);
        a.shutdown().await;
    }
    eprintln!("FAULT terminate race: 20 rounds, the closest margin was {closest:?}");
}
