//! LockManager against a real PostgreSQL: contention, hand-over, FIFO, re-entrancy,
//! many locks on one backend, keys, fencing tokens (a batch's newer than every tenure
//! before it), cancellation, bad input.

use std::sync::Arc;
use std::time::{Duration, Instant};

use chosen_core::{
    ConnectionState, Error, LockKey, LockManager, LockRequest, LockState, ManagerOptions,
};
use chosen_tests::{FaultProxy, PgCluster, ProxyMode, connect_admin, eager_options, unique_name};

async fn manager(url: &str, node: &str) -> LockManager {
    LockManager::connect(eager_options(url, node))
        .await
        .expect("manager connects")
}

/// Advisory locks (pair keys) held by the session whose application_name is `node`.
async fn held_keys(admin: &tokio_postgres::Client, node: &str) -> Vec<(u32, u32)> {
    admin
        .query(
            "SELECT l.classid::int8, l.objid::int8 FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
             WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.granted AND a.application_name = $1",
            &[&node],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get::<_, i64>(0) as u32, r.get::<_, i64>(1) as u32))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_managers_contend_and_exactly_one_holds() {
    let pg = PgCluster::start().unwrap();
    let a = manager(&pg.url(), "contend-a").await;
    let b = manager(&pg.url(), "contend-b").await;
    let name = unique_name("contend");

    // Acquire, not try: on a server that just started, nothing is granted before its
    // term is `term_grant_delay` old (a try answers `None` meanwhile).
    let lease = tokio::time::timeout(Duration::from_secs(20), a.acquire(&name))
        .await
        .expect("free lock is taken")
        .unwrap();
    assert!(lease.is_valid());
    assert!(
        b.try_acquire(&name).await.unwrap().is_none(),
        "held elsewhere"
    );
    // A waiting acquire does not complete while A holds.
    let waiting = tokio::time::timeout(Duration::from_millis(500), b.acquire(&name)).await;
    assert!(waiting.is_err(), "B must not acquire while A holds");

    let admin = connect_admin(&pg.url()).await.unwrap();
    let expected = a.key_for(&name).pg_locks_columns();
    assert_eq!(
        held_keys(&admin, "contend-a").await,
        vec![(expected.0, expected.1)]
    );
    assert!(held_keys(&admin, "contend-b").await.is_empty());
    drop(lease);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_hands_over_to_a_waiting_manager() {
    let pg = PgCluster::start().unwrap();
    let a = manager(&pg.url(), "handover-a").await;
    // A long poll interval: the hand-over must come from NOTIFY, not from polling.
    let waiting = std::sync::Arc::new(Waiting::default());
    let b = LockManager::connect(
        eager_options(&pg.url(), "handover-b")
            .poll_interval(Duration::from_secs(30))
            .metrics(waiting.clone()),
    )
    .await
    .unwrap();
    let name = unique_name("handover");

    let lease_a = a.acquire(&name).await.unwrap();
    let token_a = lease_a.fencing_token().await.unwrap();
    let waiter = tokio::spawn({
        let b = b.clone();
        let name = name.clone();
        async move { b.acquire(name).await }
    });
    // Wait until B's first attempt has run and failed (B reports the lock as waited
    // for only after its poll statement returned): from then on B sleeps for 30 s.
    waiting.wait_for(&name).await;
    assert!(!waiter.is_finished());

    let released = Instant::now();
    lease_a.release().await.unwrap();
    let lease_b = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("B is woken by the release announcement, long before its poll")
        .unwrap()
        .unwrap();
    // NOTIFY takes milliseconds; B's next poll is 30 s away.
    let handoff = released.elapsed();
    assert!(handoff < Duration::from_secs(1), "{handoff:?}");
    assert!(
        lease_b.fencing_token().await.unwrap() > token_a,
        "tokens grow across holders"
    );
    assert!(a.try_acquire(&name).await.unwrap().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_waiters_are_served_in_fifo_order() {
    let pg = PgCluster::start().unwrap();
    let m = manager(&pg.url(), "fifo").await;
    let name = unique_name("fifo");

    let first = m.acquire(&name).await.unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let mut tasks = Vec::new();
    for i in 0..5 {
        let m = m.clone();
        let name = name.clone();
        let tx = tx.clone();
        tasks.push(tokio::spawn(async move {
            let lease = m.acquire(name).await.unwrap();
            tx.send((i, lease.fencing_token().await.unwrap())).unwrap();
            tokio::time::sleep(Duration::from_millis(20)).await;
            lease.release().await.unwrap();
        }));
        // Make the queue order certain.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let waiting: Vec<_> = m
        .locks()
        .await
        .unwrap()
        .into_iter()
        .filter(|l| l.name == name)
        .map(|l| l.state)
        .collect();
    assert_eq!(waiting.len(), 6, "{waiting:?}");
    assert_eq!(
        waiting
            .iter()
            .filter(|s| matches!(s, LockState::Held { .. }))
            .count(),
        1
    );

    let mut last_token = first.fencing_token().await.unwrap();
    drop(first);
    for expected in 0..5 {
        let (i, token) = tokio::time::timeout(Duration::from_secs(10), rx.recv())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(i, expected, "FIFO order");
        assert!(
            token > last_token,
            "every local hand-off gets a larger token"
        );
        last_token = token;
    }
    for t in tasks {
        t.await.unwrap();
    }
}

/// The generation of a connected manager.
fn generation(m: &LockManager) -> u64 {
    match m.connection_status() {
        chosen_core::ConnectionState::Connected { generation, .. } => generation,
        other => panic!("not connected: {other:?}"),
    }
}

/// A local hand-off keeps the session (the token statement finds the key still held,
/// whatever its form: a name's pair, negative halves, a 64-bit key of either sign or
/// above 32 bits) and gives the next waiter a greater token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_hand_off_keeps_the_session_for_every_key_form() {
    let pg = PgCluster::start().unwrap();
    let m = manager(&pg.url(), "hand-off-forms").await;
    let before = generation(&m);
    let name = unique_name("hand-off-forms");
    let keys = [
        m.key_for(&name),
        chosen_core::LockKey::Pair(-1, i32::MIN),
        chosen_core::LockKey::Int(-1),
        chosen_core::LockKey::Int(i64::MIN),
        chosen_core::LockKey::Int(0x1_ffff_fffe),
    ];
    for key in keys {
        let first = m.acquire(key).await.unwrap();
        let waiter = tokio::spawn({
            let m = m.clone();
            async move { m.acquire(key).await }
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        let token = first.fencing_token().await.unwrap();
        drop(first);
        let next = tokio::time::timeout(Duration::from_secs(10), waiter)
            .await
            .expect("the waiter is served")
            .unwrap()
            .unwrap();
        assert!(
            next.fencing_token().await.unwrap() > token,
            "{key:?}: a greater token"
        );
        assert_eq!(
            generation(&m),
            before,
            "{key:?}: the hand-off kept the session"
        );
        next.release().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_name_twice_in_one_process_never_both_hold() {
    let pg = PgCluster::start().unwrap();
    let m = manager(&pg.url(), "reentrant").await;
    let name = unique_name("reentrant");
    let lease = m.acquire(&name).await.unwrap();
    // PostgreSQL would grant the same key to the same session again; the manager must not.
    assert!(m.try_acquire(&name).await.unwrap().is_none());
    let second = tokio::time::timeout(Duration::from_millis(400), m.acquire(&name)).await;
    assert!(second.is_err(), "second request waits");
    // Raw key of the same lock: same answer.
    assert!(m.try_acquire(m.key_for(&name)).await.unwrap().is_none());

    let admin = connect_admin(&pg.url()).await.unwrap();
    lease.release().await.unwrap();
    // Released once and fully: the server no longer shows the lock.
    assert!(held_keys(&admin, "reentrant").await.is_empty());
    let again = m.try_acquire(&name).await.unwrap();
    assert!(again.is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_locks_share_one_backend() {
    let pg = PgCluster::start().unwrap();
    let node = unique_name("many");
    let node = &node[..node.len().min(60)];
    let m = manager(&pg.url(), node).await;
    let prefix = unique_name("many-lock");
    let started = Instant::now();
    let futures: Vec<_> = (0..1000)
        .map(|i| m.acquire(format!("{prefix}-{i}")))
        .collect();
    let mut leases = Vec::new();
    for f in futures {
        leases.push(f.await.unwrap());
    }
    let took = started.elapsed();

    let admin = connect_admin(&pg.url()).await.unwrap();
    let backends: i64 = admin
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1",
            &[&node],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(backends, 1, "one connection for all locks");
    assert_eq!(held_keys(&admin, node).await.len(), 1000);
    assert_eq!(m.locks().await.unwrap().len(), 1000);
    eprintln!("acquired 1000 locks in {took:?}");

    drop(leases);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !held_keys(&admin, node).await.is_empty() {
        assert!(Instant::now() < deadline, "dropped leases are released");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_follow_the_documented_derivation() {
    // `LockKey::derive` is pinned to golden vectors by chosen-core's unit tests; here
    // the SQL from the LockKey docs computes the same keys on a real server.
    let inputs = [
        ("chosen", "my-job"),
        ("chosen", ""),
        ("chosen", "nightly-report"),
        ("billing", "nightly-report"),
        ("chosen", "ünïcødé ✓"),
    ];
    let pg = PgCluster::start().unwrap();
    let admin = connect_admin(&pg.url()).await.unwrap();
    for (ns, name) in inputs {
        let row = admin
            .query_one(
                "SELECT ('x' || encode(substr(h, 1, 4), 'hex'))::bit(32)::int4, \
                        ('x' || encode(substr(h, 5, 4), 'hex'))::bit(32)::int4 \
                 FROM (SELECT sha256(convert_to($1, 'UTF8') || '\\x00'::bytea || convert_to($2, 'UTF8')) AS h) AS d",
                &[&ns, &name],
            )
            .await
            .unwrap();
        assert_eq!(
            LockKey::Pair(row.get::<_, i32>(0), row.get::<_, i32>(1)),
            LockKey::derive(ns, name),
            "{ns}/{name}"
        );
    }

    // And pg_locks shows a held named lock under exactly those columns.
    let m = LockManager::connect(eager_options(&pg.url(), "golden").namespace("billing"))
        .await
        .unwrap();
    let lease = m.acquire("nightly-report").await.unwrap();
    let row = admin
        .query_one(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2 \
             AND classid = ($1::int4)::oid AND objid = ($2::int4)::oid AND granted",
            &[&1_907_377_311i32, &1_129_609_294i32],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, i64>(0), 1);
    drop(lease);

    // Raw bigint keys live in the other key space.
    let raw = m
        .acquire(LockKey::Int(0x0000_0001_ffff_fffe))
        .await
        .unwrap();
    let row = admin
        .query_one(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1 \
             AND classid = 1::oid AND objid = 4294967294::oid AND granted",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, i64>(0), 1);
    raw.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_tokens_increase_across_holders() {
    let pg = PgCluster::start().unwrap();
    let managers = [
        manager(&pg.url(), "token-a").await,
        manager(&pg.url(), "token-b").await,
        manager(&pg.url(), "token-c").await,
    ];
    let name = unique_name("token");
    let mut last = None;
    for round in 0..12 {
        let lease = managers[round % 3].acquire(&name).await.unwrap();
        let token = lease.fencing_token().await.unwrap();
        if let Some(prev) = last {
            assert!(token > prev, "round {round}: {token} after {prev}");
        }
        last = Some(token);
        lease.release().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_acquire_leaves_nothing_held() {
    let pg = PgCluster::start().unwrap();
    let a = manager(&pg.url(), "cancel-a").await;
    let b = manager(&pg.url(), "cancel-b").await;
    let admin = connect_admin(&pg.url()).await.unwrap();
    let name = unique_name("cancel");

    // Cancelled while waiting: the request is withdrawn.
    let held = a.acquire(&name).await.unwrap();
    let attempt = tokio::time::timeout(Duration::from_millis(200), b.acquire(&name)).await;
    assert!(attempt.is_err());
    drop(held);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        held_keys(&admin, "cancel-b").await.is_empty(),
        "withdrawn request took the lock"
    );
    assert!(b.locks().await.unwrap().is_empty());

    // Cancelled at every point around the grant of a free lock: never left held.
    for i in 0..200u64 {
        let name = format!("{name}-{i}");
        let budget = Duration::from_micros(50 * (i % 40));
        let _ = tokio::time::timeout(budget, b.acquire(&name)).await;
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let left = held_keys(&admin, "cancel-b").await;
        if left.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "{} locks left held", left.len());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(b.locks().await.unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_releases_everything_and_fails_waiters() {
    let pg = PgCluster::start().unwrap();
    let a = manager(&pg.url(), "shutdown-a").await;
    // A long poll interval: B must be woken by the release announcement.
    let waiting = std::sync::Arc::new(Waiting::default());
    let b = LockManager::connect(
        eager_options(&pg.url(), "shutdown-b")
            .poll_interval(Duration::from_secs(30))
            .metrics(waiting.clone()),
    )
    .await
    .unwrap();
    let name = unique_name("shutdown");
    let lease = a.acquire(&name).await.unwrap();
    let waiter = tokio::spawn({
        let a = a.clone();
        let name = format!("{name}-other");
        let _blocker = b.acquire(&name).await.unwrap();
        async move {
            let r = a.acquire(name).await;
            drop(_blocker);
            r
        }
    });
    let b_waits = tokio::spawn({
        let b = b.clone();
        let name = name.clone();
        async move { b.acquire(name).await }
    });
    // B has tried once and now sleeps for its 30 s poll interval.
    waiting.wait_for(&name).await;
    assert!(!b_waits.is_finished());
    // The holder drops its lease as soon as it is told: the shutdown waits for that
    // (at most the stop budget) before it releases the lock.
    let holder = tokio::spawn(async move {
        let reason = lease.lost().await;
        assert!(!lease.is_valid());
        drop(lease);
        reason
    });
    let t0 = Instant::now();
    a.shutdown().await;
    assert_eq!(
        holder.await.unwrap(),
        chosen_core::SessionDownReason::Shutdown
    );
    assert!(matches!(waiter.await.unwrap(), Err(Error::Closed)));
    assert!(matches!(a.acquire("x").await, Err(Error::Closed)));
    assert!(matches!(
        a.connection_status(),
        ConnectionState::Disconnected { .. }
    ));
    // The shutdown announced its releases: B takes over long before its next poll.
    let taken = tokio::time::timeout(Duration::from_secs(10), b_waits).await;
    assert!(taken.expect("woken by NOTIFY").unwrap().is_ok());
    assert!(
        t0.elapsed() < Duration::from_secs(1),
        "B took over {:?} after the shutdown began: a poll, not the announcement",
        t0.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gives_clear_errors() {
    // Unparsable URL: at build time.
    let err = ManagerOptions::from_url("postgres://u:pw@host:99999999/db").unwrap_err();
    assert!(matches!(err, Error::InvalidUrl { .. }), "{err}");

    // Nothing listens: a prompt, clear error.
    let started = Instant::now();
    let err = LockManager::connect(eager_options(
        "postgres://postgres:pw@127.0.0.1:1/postgres",
        "nobody-home",
    ))
    .await
    .unwrap_err();
    assert!(matches!(err, Error::Connect { .. }), "{err}");
    assert!(err.to_string().contains("127.0.0.1:1"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(10));

    // A host that accepts the TCP connection and never answers (a black-holed proxy on
    // loopback): bounded by the connect timeout, not a hang, and said so.
    let silent = FaultProxy::start(([127, 0, 0, 1], 1).into()).await.unwrap();
    silent.set(ProxyMode::BlackHole);
    let started = Instant::now();
    let err = LockManager::connect(
        eager_options(
            &format!("postgres://postgres:pw@{}/postgres", silent.addr()),
            "unreachable",
        )
        .connect_timeout(Duration::from_secs(1)),
    )
    .await
    .unwrap_err();
    assert!(matches!(err, Error::ConnectTimeout { .. }), "{err}");
    assert!(
        started.elapsed() >= Duration::from_secs(1),
        "gave up before the connect timeout: {:?}",
        started.elapsed()
    );
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );

    // Invalid options are rejected before any connection is tried.
    let err = LockManager::connect(
        eager_options("postgres://postgres:pw@127.0.0.1:1/postgres", "bad")
            .server_release_after(Duration::from_secs(2)),
    )
    .await
    .unwrap_err();
    // The error names the setting to change, as a field and in its text.
    match &err {
        Error::InvalidConfig { setting, message } => {
            assert_eq!(*setting, "ManagerOptions::server_release_after", "{err}");
            assert!(message.contains("timing invariant"), "{err}");
        }
        other => panic!("expected InvalidConfig, got {other:?}"),
    }
    assert!(
        err.to_string()
            .contains("ManagerOptions::server_release_after"),
        "{err}"
    );

    let pg = PgCluster::start_local().unwrap();
    // Wrong password: an authentication error naming the user, not the password.
    let url = pg.url_with_password("not-the-password").unwrap();
    let err = LockManager::connect(eager_options(&url, "wrong-pw"))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Authentication { .. }), "{err}");
    let text = format!("{err} {err:?}");
    assert!(text.contains("postgres"), "{text}");
    assert!(!text.contains("not-the-password"), "{text}");

    // Bad requests on a working manager.
    let m = manager(&pg.url(), "bad-requests").await;
    assert!(matches!(m.acquire("").await, Err(Error::InvalidName(_))));
    // A NUL character is refused the same way, by every call that takes a name.
    match m.acquire("a\0b").await {
        Err(Error::InvalidName(message)) => assert!(message.contains("NUL"), "{message}"),
        other => panic!("expected InvalidName, got {other:?}"),
    }
    assert!(matches!(
        m.try_acquire("a\0b").await,
        Err(Error::InvalidName(_))
    ));
    assert!(matches!(m.holder("a\0b").await, Err(Error::InvalidName(_))));
    assert!(matches!(
        chosen_core::Election::start(&m, "a\0b"),
        Err(Error::InvalidName(_))
    ));
    assert!(matches!(
        m.acquire(LockRequest::from("x").poll_interval(Duration::ZERO))
            .await,
        Err(Error::InvalidPollInterval(_))
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_per_manager_cap_is_a_clear_error() {
    let pg = PgCluster::start().unwrap();
    let m = LockManager::connect(eager_options(&pg.url(), "capped").max_locks(3))
        .await
        .unwrap();
    let name = unique_name("cap");
    let mut leases = Vec::new();
    for i in 0..3 {
        leases.push(m.acquire(format!("{name}-{i}")).await.unwrap());
    }
    let err = m.acquire(format!("{name}-3")).await.unwrap_err();
    assert!(matches!(err, Error::TooManyLocks { limit: 3 }), "{err}");
    assert!(err.to_string().contains("ManagerOptions::max_locks"));
    leases.pop();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(m.acquire(format!("{name}-3")).await.is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settings_come_from_config_and_deadpool_and_the_password_stays_hidden() {
    let pg = PgCluster::start().unwrap();
    let pg_config: tokio_postgres::Config = pg.url().parse().unwrap();
    let opts = ManagerOptions::from_pg_config(pg_config).node_id("from-config");
    let text = format!("{opts:?}");
    assert!(!text.contains(chosen_tests::SUPERUSER_PASSWORD), "{text}");
    let m = LockManager::connect(opts).await.unwrap();
    assert!(m.connection_status().is_connected());
    let lease = m.acquire(unique_name("cfg")).await.unwrap();
    let text = format!("{lease:?} {m:?}");
    assert!(!text.contains(chosen_tests::SUPERUSER_PASSWORD), "{text}");

    let mut dp = deadpool_postgres::Config::new();
    dp.url = Some(pg.url());
    let opts = ManagerOptions::from_deadpool(&dp)
        .unwrap()
        .node_id("from-deadpool");
    let m2 = LockManager::connect(opts).await.unwrap();
    assert!(m2.try_acquire(lease.name()).await.unwrap().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_session_identifies_its_node() {
    let pg = PgCluster::start().unwrap();
    let m = manager(&pg.url(), "session-settings").await;
    let pid = match m.connection_status() {
        ConnectionState::Connected { backend_pid, .. } => backend_pid,
        other => panic!("{other:?}"),
    };
    let admin = connect_admin(&pg.url()).await.unwrap();
    let row = admin
        .query_one(
            "SELECT application_name FROM pg_stat_activity WHERE pid = $1",
            &[&pid],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0), "session-settings");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn followers_learn_who_holds_a_lock() {
    let pg = PgCluster::start().unwrap();
    let a = manager(&pg.url(), "holder-a").await;
    let b = manager(&pg.url(), "holder-b").await;
    let name = unique_name("holder");
    assert_eq!(b.holder(name.as_str()).await.unwrap(), None);
    let lease = a.acquire(name.as_str()).await.unwrap();
    let holder = b.holder(name.as_str()).await.unwrap().expect("held");
    assert_eq!(holder.node_id, "holder-a");
    if pg.is_local() {
        assert_eq!(holder.client_addr.as_deref(), Some("127.0.0.1"));
    }
    let pid = match a.connection_status() {
        ConnectionState::Connected { backend_pid, .. } => backend_pid,
        other => panic!("{other:?}"),
    };
    assert_eq!(holder.backend_pid, pid);
    // The holder can ask too; raw keys work.
    let raw = b.acquire(LockKey::Int(77)).await.unwrap();
    assert_eq!(
        a.holder(LockKey::Int(77)).await.unwrap().map(|h| h.node_id),
        Some("holder-b".to_owned())
    );
    drop((lease, raw));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn releasing_many_locks_wakes_a_waiter_on_all_of_them() {
    let pg = PgCluster::start().unwrap();
    let a = manager(&pg.url(), "bulk-a").await;
    let b = LockManager::connect(
        eager_options(&pg.url(), "bulk-b").poll_interval(Duration::from_secs(60)),
    )
    .await
    .unwrap();
    let prefix = unique_name("bulk");
    let names: Vec<String> = (0..500).map(|i| format!("{prefix}-{i}")).collect();
    let mut leases = Vec::new();
    for n in &names {
        leases.push(a.acquire(n.as_str()).await.unwrap());
    }
    let mut waiting = tokio::task::JoinSet::new();
    for n in names.clone() {
        let b = b.clone();
        waiting.spawn(async move { b.acquire(n).await });
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let t0 = Instant::now();
    drop(leases); // 500 releases, announced in chunks of 200 tags per notification
    let mut got = Vec::new();
    while let Some(r) = tokio::time::timeout(Duration::from_secs(20), waiting.join_next())
        .await
        .expect("woken by the announcements, not the 60 s poll")
    {
        got.push(r.unwrap().unwrap());
    }
    assert_eq!(got.len(), 500);
    assert!(t0.elapsed() < Duration::from_secs(20));
}

/// Records the locks a manager reported as waited for, which it does right after a
/// poll statement for them returned without the lock.
#[derive(Debug, Default)]
struct Waiting(std::sync::Mutex<Vec<String>>);

impl chosen_core::MetricsSink for Waiting {
    fn lock_waiting(&self, _node: &str, lock: &str, waiters: usize) {
        if waiters > 0 {
            self.0.lock().unwrap().push(lock.to_owned());
        }
    }
}

impl Waiting {
    /// Waits (bounded) until `lock` was reported as waited for.
    async fn wait_for(&self, lock: &str) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self.0.lock().unwrap().iter().any(|l| l == lock) {
            assert!(Instant::now() < deadline, "{lock} was never waited for");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_locks_cost_one_statement_per_tick_however_many() {
    // Counted by the server (pg_stat_statements), not by the library's own metrics.
    let pg = PgCluster::builder()
        .setting("shared_preload_libraries", "pg_stat_statements")
        .start()
        .unwrap();
    let admin = connect_admin(&pg.url()).await.unwrap();
    admin
        .batch_execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        .await
        .unwrap();
    let holder = manager(&pg.url(), "tick-holder").await;
    let waiting = std::sync::Arc::new(Waiting::default());
    let waiter = LockManager::connect(
        eager_options(&pg.url(), "tick-waiter")
            .poll_interval(Duration::from_millis(100))
            .metrics(waiting.clone()),
    )
    .await
    .unwrap();
    let prefix = unique_name("tick");
    let mut leases = Vec::new();
    for i in 0..300 {
        leases.push(holder.acquire(format!("{prefix}-{i}")).await.unwrap());
    }
    let mut waits = tokio::task::JoinSet::new();
    for i in 0..300 {
        let w = waiter.clone();
        let name = format!("{prefix}-{i}");
        waits.spawn(async move { w.acquire(name).await.map(drop) });
    }
    // Every request has been tried once and waits.
    for i in 0..300 {
        waiting.wait_for(&format!("{prefix}-{i}")).await;
    }
    // Only the waiter polls: the holder holds everything it wants.
    let try_statements = "SELECT coalesce(sum(calls), 0)::int8 FROM pg_stat_statements \
         WHERE query ILIKE '%pg_try_advisory_lock%' AND query NOT ILIKE '%pg_stat_statements%'";
    admin
        .batch_execute("SELECT pg_stat_statements_reset()")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let queries: i64 = admin.query_one(try_statements, &[]).await.unwrap().get(0);
    // About 20 ticks in 2 s at 100 ms; every tick tries all 300 keys in one statement
    // (300 statements a tick, or none, would be far outside).
    assert!((10..=40).contains(&queries), "{queries} statements in 2 s");
    waits.abort_all();
    drop(leases);
}

/// §2.6: keys won in one batched statement share one fencing token. It must be assigned
/// after every lock of the batch was taken, or a key locked late in the batch gets a
/// token smaller than another node's tenure of it in between.
///
/// A current-thread runtime makes every request arrive before the manager's task looks,
/// so they are tried in one statement; another session on its own thread takes and
/// releases the batch's last key in a tight loop meanwhile.
#[tokio::test(flavor = "current_thread")]
async fn a_batch_token_is_newer_than_every_tenure_before_it() {
    let pg = PgCluster::start().unwrap();
    const KEYS: i32 = 4000;
    let mut valid_rounds = 0;
    for round in 0..16 {
        let a = LockManager::connect(
            // No term hold: the cluster just started, and the tries must race now.
            eager_options(&pg.url(), &format!("batcher-{round}"))
                .max_locks(KEYS as usize + 10)
                .term_grant_delay(Duration::ZERO),
        )
        .await
        .unwrap();
        // Raw keys in one class: the statement tries them in key order, the last last.
        let class = 9000 + round;
        let last = chosen_core::LockKey::Pair(class, KEYS - 1);
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let started = Arc::new(std::sync::Barrier::new(2));
        let spinner = std::thread::spawn({
            let url = pg.url();
            let stop = Arc::clone(&stop);
            let started = Arc::clone(&started);
            move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                rt.block_on(async move {
                    let client = connect_admin(&url).await.unwrap();
                    started.wait();
                    let mut tokens = Vec::new();
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        let row = client
                            .query_one(
                                "SELECT CASE WHEN pg_try_advisory_lock($1::int4, $2::int4) THEN pg_current_xact_id()::text::int8 END",
                                &[&class, &(KEYS - 1)],
                            )
                            .await
                            .unwrap();
                        if let Some(t) = row.get::<_, Option<i64>>(0) {
                            client
                                .execute(
                                    "SELECT pg_advisory_unlock($1::int4, $2::int4)",
                                    &[&class, &(KEYS - 1)],
                                )
                                .await
                                .unwrap();
                            tokens.push(t as u64);
                        }
                    }
                    tokens
                })
            }
        });
        started.wait();
        let requests: Vec<_> = (0..KEYS)
            .map(|k| {
                let a = a.clone();
                tokio::spawn(async move {
                    a.try_acquire(
                        chosen_core::LockRequest::from(chosen_core::LockKey::Pair(class, k))
                            .eager_token(),
                    )
                    .await
                })
            })
            .collect();
        let mut leases = Vec::new();
        for r in requests {
            if let Some(lease) = r.await.unwrap().unwrap() {
                leases.push(lease);
            }
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let spun = spinner.join().unwrap();
        let first = leases
            .iter()
            .find(|l| l.key() == chosen_core::LockKey::Pair(class, 0))
            .and_then(chosen_core::Lease::known_fencing_token);
        let won_last = leases
            .iter()
            .find(|l| l.key() == last)
            .and_then(chosen_core::Lease::known_fencing_token);
        eprintln!(
            "round {round}: {} leases, first {first:?}, last {won_last:?}, {} tenures of the last key",
            leases.len(),
            spun.len()
        );
        if let (Some(first), Some(t)) = (first, won_last)
            && first == t
            && !spun.is_empty()
        {
            valid_rounds += 1;
            let newest = spun.iter().max().copied().unwrap();
            // The spinner's tokens are raw transaction ids; ours carry the timeline
            // above them (see `FencingToken`).
            assert!(
                t.xact_id() > newest,
                "round {round}: the batch token {t} is older than a tenure of the last key that ended before the batch took it ({newest})"
            );
        }
        drop(leases);
        a.shutdown().await;
        if valid_rounds >= 10 {
            break;
        }
    }
    assert!(valid_rounds >= 1, "no round raced the batch");
}
