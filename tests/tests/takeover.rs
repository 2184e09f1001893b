//! Taking a key over after its holder's session ended, against real servers: a node
//! that won the key but leaves before granting it unlocks it without announcing it free
//! (an announcement would let a third node skip the takeover grace and the stop fence
//! while the old holder's work is still stopping), and a node that lost its own lease
//! can try or take the key again while the lost lease is still held.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chosen_core::LockManager;
use chosen_tests::{PgCluster, connect_admin, fast_options, unique_name};

async fn manager(url: &str, node: &str) -> LockManager {
    LockManager::connect(fast_options(url, node))
        .await
        .expect("manager connects")
}

/// Terminates the lock session of `node` from the server side.
async fn terminate(admin: &tokio_postgres::Client, node: &str) {
    let killed: i64 = admin
        .query_one(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = $1",
            &[&node],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(killed, 1, "terminated {node}'s session");
}

/// Waits until the server shows `lock` held by `node` (as `holder` sees it).
async fn wait_for_holder(observer: &LockManager, lock: &str, node: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(Some(h)) = observer.holder(lock).await
            && h.node_id == node
        {
            return;
        }
        assert!(Instant::now() < deadline, "{node} never held {lock}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A node that won a key after an unannounced takeover holds it at the server while it
/// waits the grace and the old holder's stop fence, but has granted it to nobody. If it
/// shuts down meanwhile, it unlocks the key *and announces the release* from its
/// backend. A third node that saw the key held by that backend trusts the announcement
/// as proof that the previous holder's work stopped, wins the key at once and grants it
/// with neither grace nor fence check, while the old holder (whose session the server
/// ended) is still stopping its work under the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_abandoned_at_shutdown_does_not_announce_the_key_free() {
    let pg = PgCluster::start().unwrap();
    let admin = connect_admin(&pg.url()).await.unwrap();
    let lock = unique_name("abandoned-takeover");
    let a = manager(&pg.url(), "abandon-a").await;
    let lease = a.acquire(lock.as_str()).await.unwrap();
    // B takes the key over; a generous grace, as this machine runs many tests at once.
    let b = LockManager::connect(
        fast_options(&pg.url(), "abandon-b").takeover_grace(Duration::from_millis(500)),
    )
    .await
    .unwrap();
    // C polls slowly: after its first try only an announcement makes it try again
    // before A's work has stopped.
    let c = LockManager::connect(
        fast_options(&pg.url(), "abandon-c").poll_interval(Duration::from_secs(3)),
    )
    .await
    .unwrap();
    let b_waiting = tokio::spawn({
        let b = b.clone();
        let lock = lock.clone();
        async move { b.acquire(lock.as_str()).await.map(drop) }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;

    // A's work takes 1.8 s (within the 2 s stop budget) to stop after its loss.
    let stopped = Arc::new(Mutex::new(None::<Instant>));
    let child = tokio::spawn({
        let stopped = Arc::clone(&stopped);
        async move {
            lease.lost().await;
            tokio::time::sleep(Duration::from_millis(1_800)).await;
            *stopped.lock().unwrap() = Some(Instant::now());
            drop(lease);
        }
    });
    terminate(&admin, "abandon-a").await;
    // B wins the key at the server and waits (grace, then A's stop fence).
    wait_for_holder(&c, &lock, "abandon-b").await;
    // C sees B's backend holding the key.
    let c_waiting = tokio::spawn({
        let c = c.clone();
        let lock = lock.clone();
        async move { c.acquire(lock.as_str()).await.map(|l| (Instant::now(), l)) }
    });
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(
        stopped.lock().unwrap().is_none(),
        "the machine is too slow for this test"
    );
    // B leaves before granting the key to anyone.
    b.shutdown().await;
    assert!(b_waiting.await.unwrap().is_err(), "B's request was refused");

    child.await.unwrap();
    let (acquired, lease_c) = tokio::time::timeout(Duration::from_secs(15), c_waiting)
        .await
        .expect("C takes over")
        .unwrap()
        .unwrap();
    let stopped = stopped.lock().unwrap().expect("A's work stopped");
    assert!(
        acquired > stopped,
        "C held the lock {:?} before A's work stopped: B's release announcement of a key it never granted let C skip the grace and the stop fence",
        stopped - acquired
    );
    drop(lease_c);
    c.shutdown().await;
    a.shutdown().await;
}

/// A process does not try a key while a lease of it from an ended session is still out.
/// The idiom `lease = manager.acquire(name).await?` (reassigning the lost lease) drops
/// the old lease only once the new one is there: the request waits for a release that
/// waits for the request, forever. A `try_acquire` made while the old lease is out is
/// not answered at once either, as the docs promise, but only when the old lease is
/// dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reacquiring_while_the_lost_lease_is_still_held_does_not_hang() {
    let pg = PgCluster::start().unwrap();
    let admin = connect_admin(&pg.url()).await.unwrap();
    let lock = unique_name("reassign");
    let a = manager(&pg.url(), "reassign-a").await;
    let mut lease = a.acquire(lock.as_str()).await.unwrap();
    terminate(&admin, "reassign-a").await;
    lease.lost().await;
    // Nobody else wants the key: a try answers at once, one way or the other.
    let tried = tokio::time::timeout(Duration::from_secs(10), a.try_acquire(lock.as_str())).await;
    assert!(
        tried.is_ok(),
        "try_acquire was not answered within 10 s while the lost lease was still held"
    );
    drop(tried);
    // The reassigning idiom: the old lease is dropped by the assignment, after the new
    // one arrives.
    let again = tokio::time::timeout(Duration::from_secs(10), a.acquire(lock.as_str())).await;
    assert!(
        again.is_ok(),
        "acquire of a free key hung for 10 s: it waits for the lost lease, which waits for it"
    );
    lease = again.unwrap().unwrap();
    drop(lease);
    a.shutdown().await;
}
