//! Release announcements go out only when someone waits: a waiter registers interest
//! in the key's bucket (a shared lock on an interest key), and a release announces
//! itself (`NOTIFY`) only when another session holds that bucket's interest key. No
//! waiter is left out: a key that shares its bucket with a key won in the same try
//! statement, and a waiter whose interest take met another release's probe, register
//! on their next try, and are announced to. An announcement from a backend the waiter
//! never saw holding the key is only a cue to try soon, and a forged flood of them
//! costs at most one more try statement per second. A flood of forged announcements
//! revokes nothing and grants nothing held, and the holder a waiter saw is looked up
//! right for every key shape.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use chosen_core::{ConnectionState, LockKey, LockManager, MetricsSink};
use chosen_tests::{PgCluster, connect_admin, eager_options, unique_name};
use tokio::sync::mpsc;
use tokio_postgres::{AsyncMessage, NoTls};

/// A connection that LISTENs on the release channel; payloads arrive on the receiver.
async fn listener(url: &str) -> (tokio_postgres::Client, mpsc::UnboundedReceiver<String>) {
    let (client, mut connection) = tokio_postgres::connect(url, NoTls).await.unwrap();
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Some(Ok(message)) = std::future::poll_fn(|cx| connection.poll_message(cx)).await {
            if let AsyncMessage::Notification(n) = message
                && tx.send(n.payload().to_owned()).is_err()
            {
                break;
            }
        }
    });
    client.batch_execute("LISTEN chosen_release").await.unwrap();
    (client, rx)
}

/// Sends a sentinel notification and returns every payload that arrived before it
/// (notifications are delivered in commit order).
async fn drain_until_sentinel(
    admin: &tokio_postgres::Client,
    rx: &mut mpsc::UnboundedReceiver<String>,
) -> Vec<String> {
    let sentinel = unique_name("sentinel");
    admin
        .execute("SELECT pg_notify('chosen_release', $1)", &[&sentinel])
        .await
        .unwrap();
    let mut before = Vec::new();
    loop {
        let payload = tokio::time::timeout(Duration::from_secs(10), rx.recv())
            .await
            .expect("the sentinel arrives")
            .expect("listener alive");
        if payload == sentinel {
            return before;
        }
        before.push(payload);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_nobody_waits_for_announces_nothing() {
    let pg = PgCluster::start().unwrap();
    let admin = connect_admin(&pg.url()).await.unwrap();
    let (_listen, mut rx) = listener(&pg.url()).await;
    let a = LockManager::connect(eager_options(&pg.url(), "quiet-a"))
        .await
        .unwrap();
    // Another manager waits for a different lock: its interest must not make every
    // release announce (unless the two share a bucket: pick one that does not).
    let b = LockManager::connect(eager_options(&pg.url(), "quiet-b"))
        .await
        .unwrap();
    let other = unique_name("quiet-other");
    let held_elsewhere = a.acquire(other.as_str()).await.unwrap();
    let waiting = tokio::spawn({
        let b = b.clone();
        let other = other.clone();
        async move { b.acquire(other.as_str()).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiting.is_finished());
    let mut names = Vec::new();
    for i in 0.. {
        let name = unique_name(&format!("quiet-{i}"));
        if bucket_of(&a, &name) != bucket_of(&a, &other) {
            names.push(name);
        }
        if names.len() == 20 {
            break;
        }
    }
    for name in &names {
        let lease = a.acquire(name.as_str()).await.unwrap();
        lease.release().await.unwrap();
    }
    let announced = drain_until_sentinel(&admin, &mut rx).await;
    assert!(
        announced.is_empty(),
        "uncontended releases announced themselves: {announced:?}"
    );
    // The contended one is announced.
    held_elsewhere.release().await.unwrap();
    let lease_b = tokio::time::timeout(Duration::from_secs(5), waiting)
        .await
        .expect("B takes over")
        .unwrap()
        .unwrap();
    let announced = drain_until_sentinel(&admin, &mut rx).await;
    assert_eq!(
        announced.len(),
        1,
        "one announcement for the contended release: {announced:?}"
    );
    drop(lease_b);
}

/// The tag of a key in the library's derivations (`pair:<a>:<b>`, `int:<k>`), as in
/// its release announcements.
fn tag(key: LockKey) -> String {
    match key {
        LockKey::Pair(a, b) => format!("pair:{a}:{b}"),
        LockKey::Int(k) => format!("int:{k}"),
    }
}

/// The interest bucket of a key, as the library computes it (mirrored here from the
/// documented derivation of `LockKey::interest_bucket`:
/// `LockKey::derive("chosen.interest-bucket", tag)`, first key modulo 256).
fn bucket(key: LockKey) -> u32 {
    match LockKey::derive("chosen.interest-bucket", &tag(key)) {
        LockKey::Pair(a, _) => a as u32 % 256,
        LockKey::Int(_) => unreachable!("derived keys are pairs"),
    }
}

/// The bucket of a lock name.
fn bucket_of(manager: &LockManager, name: &str) -> u32 {
    bucket(manager.key_for(name))
}

/// The interest key of a bucket (mirrors `LockKey::interest_of`).
fn interest_key(bucket: u32) -> (i32, i32) {
    match LockKey::derive("chosen.interest", &bucket.to_string()) {
        LockKey::Pair(a, b) => (a, b),
        LockKey::Int(_) => unreachable!("derived keys are pairs"),
    }
}

/// Shared advisory locks (interest keys, stop fences) held by the session of `node`.
async fn shared_locks(admin: &tokio_postgres::Client, node: &str) -> i64 {
    admin
        .query_one(
            "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
             WHERE l.locktype = 'advisory' AND l.mode = 'ShareLock' AND l.granted
               AND a.application_name = $1",
            &[&node],
        )
        .await
        .unwrap()
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_holds_interest_only_while_it_waits() {
    let pg = PgCluster::start().unwrap();
    let admin = connect_admin(&pg.url()).await.unwrap();
    let a = LockManager::connect(eager_options(&pg.url(), "interest-a"))
        .await
        .unwrap();
    let b = LockManager::connect(
        eager_options(&pg.url(), "interest-b").poll_interval(Duration::from_secs(30)),
    )
    .await
    .unwrap();
    let name = unique_name("interest");
    let lease_a = a.acquire(name.as_str()).await.unwrap();
    assert_eq!(shared_locks(&admin, "interest-b").await, 0);
    let waiting = tokio::spawn({
        let b = b.clone();
        let name = name.clone();
        async move { b.acquire(name.as_str()).await }
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while shared_locks(&admin, "interest-b").await != 1 {
        assert!(Instant::now() < deadline, "B never registered its interest");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The release is announced (B polls every 30 s) and B lets its interest go.
    let released = Instant::now();
    lease_a.release().await.unwrap();
    let lease_b = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("B takes over")
        .unwrap()
        .unwrap();
    assert!(
        released.elapsed() < Duration::from_secs(1),
        "the hand-over took {:?}: not announced?",
        released.elapsed()
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while shared_locks(&admin, "interest-b").await != 0 {
        assert!(
            Instant::now() < deadline,
            "B kept its interest key after it won"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop(lease_b);
}

/// C waits with a 30 s poll and its last try saw A; A's session is then ended by the
/// server and B takes over. B's release comes from a backend C never saw holding the
/// key: not believed, but a cue to try within a second, so C does not wait for its poll.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_by_a_holder_the_waiter_never_saw_is_a_cue() {
    let pg = PgCluster::start().unwrap();
    let admin = connect_admin(&pg.url()).await.unwrap();
    let name = unique_name("cue");
    let a = LockManager::connect(eager_options(&pg.url(), "cue-a"))
        .await
        .unwrap();
    let lease_a = a.acquire(name.as_str()).await.unwrap();
    let c = LockManager::connect(
        eager_options(&pg.url(), "cue-c").poll_interval(Duration::from_secs(30)),
    )
    .await
    .unwrap();
    let c_waiting = tokio::spawn({
        let c = c.clone();
        let name = name.clone();
        async move { c.acquire(name.as_str()).await }
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while shared_locks(&admin, "cue-c").await != 1 {
        assert!(Instant::now() < deadline, "C never tried");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let b = LockManager::connect(eager_options(&pg.url(), "cue-b"))
        .await
        .unwrap();
    let b_waiting = tokio::spawn({
        let b = b.clone();
        let name = name.clone();
        async move { b.acquire(name.as_str()).await }
    });
    while shared_locks(&admin, "cue-b").await != 1 {
        assert!(Instant::now() < deadline, "B never tried");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let killed: i64 = admin
        .query_one(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = 'cue-a'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(killed, 1);
    // A learns of its loss and stops at once: its fence goes, B is granted.
    tokio::time::timeout(Duration::from_secs(10), lease_a.lost())
        .await
        .expect("A learns it lost the lock");
    drop(lease_a);
    let lease_b = tokio::time::timeout(Duration::from_secs(10), b_waiting)
        .await
        .expect("B takes over")
        .unwrap()
        .unwrap();
    // C may have been cued by A's fence release already; either way it sees B now or
    // within a second of B's release.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let released = Instant::now();
    lease_b.release().await.unwrap();
    let lease_c = tokio::time::timeout(Duration::from_secs(10), c_waiting)
        .await
        .expect("C takes over long before its 30 s poll")
        .unwrap()
        .unwrap();
    assert!(
        released.elapsed() < Duration::from_secs(3),
        "C took over {:?} after the release (poll: 30 s)",
        released.elapsed()
    );
    drop(lease_c);
}

/// A lost wake-up (deterministic): `Plan::register` flags only the *first* key of a
/// bucket per try statement; the others are sent with `reg = false`. When that first
/// key is won on its first try (`r = 1`), no interest key is taken, and a second key of
/// the same bucket that fails (`NOT k.reg THEN 0`) waits with no interest registered.
/// Its holder's release then probes the bucket, finds nobody, and announces nothing:
/// the waiter sits out its whole poll interval (30 s here) although the key is free.
/// README: "a node whose try of a key fails registers interest in the key's bucket";
/// "waiters elsewhere take over in about one round trip".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_key_of_a_bucket_whose_first_key_was_won_is_still_announced() {
    let pg = PgCluster::start().unwrap();
    let admin = connect_admin(&pg.url()).await.unwrap();
    let a = LockManager::connect(eager_options(&pg.url(), "lw-a"))
        .await
        .unwrap();
    let b = LockManager::connect(
        eager_options(&pg.url(), "lw-b")
            .poll_interval(Duration::from_secs(30))
            .reconnect_backoff(Duration::from_millis(1000), Duration::from_millis(1000)),
    )
    .await
    .unwrap();
    // Y: held by A. X: same bucket as Y, before Y in key order (so X is the key of the
    // bucket that the plan flags), also held by A at first.
    let y = unique_name("lw-y");
    let ky = a.key_for(&y);
    let x = (0..)
        .map(|i| unique_name(&format!("lw-x{i}")))
        .find(|x| {
            let kx = a.key_for(x);
            bucket(kx) == bucket(ky) && kx < ky
        })
        .unwrap();
    let lease_x = a.acquire(x.as_str()).await.unwrap();
    let lease_y = a.acquire(y.as_str()).await.unwrap();
    let (bx, by) = (b.clone(), b.clone());
    let (x2, y2) = (x.clone(), y.clone());
    let wait_x = tokio::spawn(async move { bx.acquire(x2.as_str()).await });
    let wait_y = tokio::spawn(async move { by.acquire(y2.as_str()).await });
    let deadline = Instant::now() + Duration::from_secs(10);
    while shared_locks(&admin, "lw-b").await != 1 {
        assert!(Instant::now() < deadline, "B never registered");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // B's session ends; while it reconnects (1 s backoff), A lets X go. On the new
    // session every waiting key is tried at once: X and Y in one statement.
    let killed: i64 = admin
        .query_one(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = 'lw-b'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(killed, 1);
    lease_x.release().await.unwrap();
    let lease_bx = tokio::time::timeout(Duration::from_secs(10), wait_x)
        .await
        .expect("B gets X")
        .unwrap()
        .unwrap();
    assert!(!wait_y.is_finished());
    // Y, not won and not registered in that statement, is tried again at once and
    // registers (on 92dd237 it never did, and the release below was silent).
    let deadline = Instant::now() + Duration::from_secs(5);
    while shared_locks(&admin, "lw-b").await != 1 {
        assert!(Instant::now() < deadline, "Y never registered its interest");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let released = Instant::now();
    lease_y.release().await.unwrap();
    let got = tokio::time::timeout(Duration::from_secs(3), wait_y).await;
    assert!(
        got.is_ok(),
        "B waits for Y (poll 30 s) although A released it {:?} ago: Y's try failed but registered no interest (X, first of the bucket, was won), so the release announced nothing",
        released.elapsed()
    );
    drop(lease_bx);
}

/// A lost wake-up (timing): the flagged key's interest take fails while another session
/// holds the bucket's interest key exclusively, which is what a release of *another*
/// key of the same bucket does for the instant of its probe. The statement then tries
/// the key once more and, when it is still held, answers `r = 0`: nothing is
/// registered, and the holder's later release finds nobody in the bucket. The code
/// comment assumes the prober is releasing *this* key ("a releaser is probing the
/// bucket right now, after its unlock"); with 256 buckets it may be any key. Here an
/// outsider holds the interest key for the instant of B's first try (the race window
/// made wide).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_whose_interest_take_failed_is_still_announced() {
    let pg = PgCluster::start().unwrap();
    let admin = connect_admin(&pg.url()).await.unwrap();
    let prober = connect_admin(&pg.url()).await.unwrap();
    let a = LockManager::connect(eager_options(&pg.url(), "ft-a"))
        .await
        .unwrap();
    let b = LockManager::connect(
        eager_options(&pg.url(), "ft-b").poll_interval(Duration::from_secs(30)),
    )
    .await
    .unwrap();
    let y = unique_name("ft-y");
    let (ia, ib) = interest_key(bucket(a.key_for(&y)));
    let lease_y = a.acquire(y.as_str()).await.unwrap();
    // Another release of this bucket is probing (exclusive try) at this instant.
    prober
        .execute("SELECT pg_advisory_lock($1, $2)", &[&ia, &ib])
        .await
        .unwrap();
    let wait_y = tokio::spawn({
        let b = b.clone();
        let y = y.clone();
        async move { b.acquire(y.as_str()).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    prober
        .execute("SELECT pg_advisory_unlock($1, $2)", &[&ia, &ib])
        .await
        .unwrap();
    // B tries again soon after (backing off: 0, 100, 200, 400, 800 ms) and registers.
    let deadline = Instant::now() + Duration::from_secs(5);
    while shared_locks(&admin, "ft-b").await != 1 {
        assert!(Instant::now() < deadline, "B never registered its interest");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let released = Instant::now();
    lease_y.release().await.unwrap();
    let got = tokio::time::timeout(Duration::from_secs(3), wait_y).await;
    assert!(
        got.is_ok(),
        "B waits for Y (poll 30 s) although A released it {:?} ago: its interest take failed and it never registered",
        released.elapsed()
    );
}

#[derive(Debug, Default)]
struct Polls(AtomicUsize);

impl MetricsSink for Polls {
    fn poll_query(&self, _node: &str, _keys: usize) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
}

/// Cue amplification: an unverified announcement sets the key's
/// `next_try = min(next_try, now + 1 s)`, per key. A forger that announces each of N
/// waited-for keys at a different instant gives each key its own cue instant, so the
/// node runs one try statement per key per second (each one that does not win reads
/// `pg_lock_status()`), not "at most one more try per second" (README item 10,
/// `UNVERIFIED_CUE`). Before 92dd237 forged announcements cost nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_flood_costs_at_most_one_more_statement_per_second() {
    const N: usize = 40;
    let pg = PgCluster::start().unwrap();
    let forger = connect_admin(&pg.url()).await.unwrap();
    let a = LockManager::connect(eager_options(&pg.url(), "fl-a"))
        .await
        .unwrap();
    let polls = Arc::new(Polls::default());
    let b = LockManager::connect(
        eager_options(&pg.url(), "fl-b")
            .poll_interval(Duration::from_secs(30))
            .metrics(polls.clone()),
    )
    .await
    .unwrap();
    let names: Vec<String> = (0..N).map(|i| unique_name(&format!("fl-{i}"))).collect();
    let mut leases = Vec::new();
    for n in &names {
        leases.push(a.acquire(n.as_str()).await.unwrap());
    }
    let mut waits = Vec::new();
    for n in &names {
        let b = b.clone();
        let n = n.clone();
        waits.push(tokio::spawn(async move { b.acquire(n.as_str()).await }));
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let tags: Vec<String> = names.iter().map(|n| tag(a.key_for(n))).collect();
    let before = polls.0.load(Ordering::Relaxed);
    let start = Instant::now();
    let window = Duration::from_secs(3);
    'flood: loop {
        for t in &tags {
            if start.elapsed() >= window {
                break 'flood;
            }
            forger
                .execute("SELECT pg_notify('chosen_release', $1)", &[t])
                .await
                .unwrap();
            tokio::time::sleep(Duration::from_millis(1000 / N as u64)).await;
        }
    }
    let statements = polls.0.load(Ordering::Relaxed) - before;
    assert!(
        statements <= 3 + 2,
        "a forged flood made B run {statements} try statements in {window:?} (documented: at most one more per second)"
    );
    drop(leases);
    for w in waits {
        w.abort();
    }
}

/// §2.4: any role may `NOTIFY chosen_release`. A flood of them naming keys a manager
/// waits for must not starve its heartbeat (revoking every lease it holds), nor hand it
/// a lock another session holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_notification_flood_revokes_nothing() {
    let pg = PgCluster::start().unwrap();
    let lock = unique_name("flooded");
    // The victim holds one lock and waits for twenty others.
    let victim = LockManager::connect(chosen_tests::eager_options(&pg.url(), "flooded-victim"))
        .await
        .expect("manager connects");
    let lease = victim.acquire(lock.as_str()).await.unwrap();
    let other = LockManager::connect(chosen_tests::eager_options(&pg.url(), "key-holder"))
        .await
        .expect("manager connects");
    let mut held = Vec::new();
    let mut waits = Vec::new();
    for i in 0..20 {
        let name = format!("{lock}-{i}");
        held.push(other.acquire(name.as_str()).await.unwrap());
        let m = victim.clone();
        waits.push(tokio::spawn(async move { m.acquire(name.as_str()).await }));
    }
    let tags: Vec<String> = held
        .iter()
        .map(|l| match l.key() {
            chosen_core::LockKey::Pair(a, b) => format!("pair:{a}:{b}"),
            chosen_core::LockKey::Int(k) => format!("int:{k}"),
        })
        .collect();
    let flood_until = Instant::now() + Duration::from_secs(6);
    let flooder = tokio::spawn({
        let url = pg.url();
        async move {
            let client = connect_admin(&url).await.unwrap();
            let mut sent = 0u64;
            while Instant::now() < flood_until {
                // Distinct payloads: the server folds identical ones within a transaction.
                client
                    .execute(
                        "SELECT pg_notify('chosen_release', $1 || ',' || g::text) FROM generate_series(1, 1000) g",
                        &[&tags.join(",")],
                    )
                    .await
                    .unwrap();
                sent += 1_000;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            sent
        }
    });
    let mut checks = 0;
    while Instant::now() < flood_until {
        assert!(
            lease.is_valid(),
            "the victim's lease was revoked during the flood: {:?}",
            lease.loss_reason()
        );
        assert!(
            waits.iter().all(|w| !w.is_finished()),
            "a forged announcement handed over a held lock"
        );
        checks += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let sent = flooder.await.unwrap();
    assert!(sent >= 50_000, "only {sent} notifications sent");
    assert!(checks > 50);
    assert!(lease.is_valid(), "{:?}", lease.loss_reason());
    assert!(matches!(
        victim.connection_status(),
        ConnectionState::Connected { generation: 1, .. }
    ));
    for w in waits {
        w.abort();
    }
    drop(held);
    drop(lease);
    victim.shutdown().await;
    other.shutdown().await;
}

/// Release announcements are believed only from the backend a failed try saw holding the
/// key: that look-up must be right for every key shape (negative halves, big keys), in
/// the single-key and the batched statement, or hand-overs fall back to polling.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn announcements_are_verified_for_every_key_shape() {
    use chosen_core::LockKey;
    let pg = PgCluster::start().unwrap();
    let shapes = [
        vec![LockKey::Int(-5)],
        vec![LockKey::Pair(-1, -2)],
        vec![
            LockKey::Int(i64::MIN + 7),
            LockKey::Int(0x7fff_ffff_0000_0001),
            LockKey::Pair(i32::MIN, 3),
            LockKey::Pair(12, -12),
        ],
    ];
    for keys in shapes {
        let a = LockManager::connect(chosen_tests::eager_options(&pg.url(), "shape-holder"))
            .await
            .expect("manager connects");
        let b = LockManager::connect(
            chosen_tests::eager_options(&pg.url(), "shape-waiter")
                .poll_interval(Duration::from_secs(30)),
        )
        .await
        .unwrap();
        let mut held = Vec::new();
        for k in &keys {
            held.push(a.acquire(*k).await.unwrap());
        }
        let waits: Vec<_> = keys
            .iter()
            .map(|k| {
                let b = b.clone();
                let k = *k;
                tokio::spawn(async move { b.acquire(k).await })
            })
            .collect();
        // Let B's first (failed) try see the holders.
        let deadline = Instant::now() + Duration::from_secs(10);
        while b.locks().await.unwrap().len() < keys.len() {
            assert!(Instant::now() < deadline);
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        let t0 = Instant::now();
        drop(held);
        for w in waits {
            let lease = tokio::time::timeout(Duration::from_secs(5), w)
                .await
                .expect("woken by the verified announcement, not the 30 s poll")
                .unwrap()
                .unwrap();
            drop(lease);
        }
        assert!(
            t0.elapsed() < Duration::from_secs(2),
            "{keys:?}: hand-over took {:?}",
            t0.elapsed()
        );
        a.shutdown().await;
        b.shutdown().await;
    }
}
