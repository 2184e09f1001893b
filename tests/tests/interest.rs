//! Release announcements go out only when someone waits: a waiter registers interest
//! in the key's bucket (a shared lock on an interest key), and a release announces
//! itself (`NOTIFY`) only when another session holds that bucket's interest key.

use std::time::{Duration, Instant};

use chosen_core::{LockManager, ManagerOptions};
use chosen_tests::{PgCluster, connect_admin, unique_name};
use tokio::sync::mpsc;
use tokio_postgres::{AsyncMessage, NoTls};

fn options(url: &str, node: &str) -> ManagerOptions {
    chosen_tests::manager_options(url, node).poll_interval(Duration::from_millis(50))
}

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
    let a = LockManager::connect(options(&pg.url(), "quiet-a"))
        .await
        .unwrap();
    // Another manager waits for a different lock: its interest must not make every
    // release announce (unless the two share a bucket: pick one that does not).
    let b = LockManager::connect(options(&pg.url(), "quiet-b"))
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

/// The bucket of a lock name, as the library computes it (mirrored here from the
/// documented derivation: `LockKey::derive("chosen.interest-bucket", tag)`, first key
/// modulo 256).
fn bucket_of(manager: &LockManager, name: &str) -> u32 {
    let tag = match manager.key_for(name) {
        chosen_core::LockKey::Pair(a, b) => format!("pair:{a}:{b}"),
        chosen_core::LockKey::Int(k) => format!("int:{k}"),
    };
    match chosen_core::LockKey::derive("chosen.interest-bucket", &tag) {
        chosen_core::LockKey::Pair(a, _) => a as u32 % 256,
        chosen_core::LockKey::Int(_) => unreachable!("derived keys are pairs"),
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
    let a = LockManager::connect(options(&pg.url(), "interest-a"))
        .await
        .unwrap();
    let b = LockManager::connect(
        options(&pg.url(), "interest-b").poll_interval(Duration::from_secs(30)),
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
    let a = LockManager::connect(options(&pg.url(), "cue-a"))
        .await
        .unwrap();
    let lease_a = a.acquire(name.as_str()).await.unwrap();
    let c =
        LockManager::connect(options(&pg.url(), "cue-c").poll_interval(Duration::from_secs(30)))
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
    let b = LockManager::connect(options(&pg.url(), "cue-b"))
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
