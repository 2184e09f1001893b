//! Fencing tokens issued on first use, against a real PostgreSQL: a lease whose token
//! nobody reads writes nothing; a token read late still orders after every earlier
//! tenure's and before every later one's; no token is issued to a session that lost
//! the lock.

use std::time::Duration;

use chosen_core::{Error, LockManager, LockRequest};
use chosen_tests::{PgCluster, connect_admin, unique_name};

async fn manager(url: &str, node: &str) -> LockManager {
    LockManager::connect(
        chosen_tests::manager_options(url, node).poll_interval(Duration::from_millis(50)),
    )
    .await
    .expect("manager connects")
}

/// The next transaction id the server would assign (taking one itself).
async fn next_xid(admin: &tokio_postgres::Client) -> i64 {
    admin
        .query_one("SELECT pg_current_xact_id()::text::int8", &[])
        .await
        .unwrap()
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_whose_token_is_never_read_takes_no_transaction_id() {
    let pg = PgCluster::start().unwrap();
    let a = manager(&pg.url(), "lazy-unread").await;
    let admin = connect_admin(&pg.url()).await.unwrap();
    let name = unique_name("lazy-unread");
    // The first grant waits out the young term's hold.
    a.acquire(&name).await.unwrap().release().await.unwrap();

    let before = next_xid(&admin).await;
    for _ in 0..10 {
        let lease = a.acquire(&name).await.unwrap();
        assert!(lease.known_fencing_token().is_none(), "not taken yet");
        lease.release().await.unwrap();
    }
    let after = next_xid(&admin).await;
    assert_eq!(after, before + 1, "only the admin's own ids were taken");

    // Asked for with the grant, each acquisition takes one.
    let before = next_xid(&admin).await;
    for _ in 0..10 {
        let lease = a
            .acquire(LockRequest::from(name.as_str()).eager_token())
            .await
            .unwrap();
        assert!(
            lease.known_fencing_token().is_some(),
            "taken with the grant"
        );
        lease.release().await.unwrap();
    }
    let after = next_xid(&admin).await;
    assert_eq!(after, before + 11, "one id per eager acquisition");
    a.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_read_late_orders_between_the_tenures_around_it() {
    let pg = PgCluster::start().unwrap();
    let a = manager(&pg.url(), "lazy-late-a").await;
    let b = manager(&pg.url(), "lazy-late-b").await;
    let admin = connect_admin(&pg.url()).await.unwrap();
    let name = unique_name("lazy-late");

    // A's tenure, its token read at once.
    let lease_a = a.acquire(&name).await.unwrap();
    let token_a = lease_a.fencing_token().await.unwrap();
    lease_a.release().await.unwrap();

    // B's tenure: other transactions run while it holds, then it reads its token late.
    let lease_b = b.acquire(&name).await.unwrap();
    let during = next_xid(&admin).await;
    for _ in 0..5 {
        next_xid(&admin).await;
    }
    let token_b = lease_b.fencing_token().await.unwrap();
    assert!(token_b > token_a, "{token_b} > {token_a}");
    assert!(
        token_b.xact_id() > u64::try_from(during).unwrap(),
        "issued when read ({token_b}), not when won"
    );
    assert_eq!(
        lease_b.fencing_token().await.unwrap(),
        token_b,
        "read once, then known"
    );
    lease_b.release().await.unwrap();

    // A later tenure, eager or lazy, orders after B's late token.
    let lease_a2 = a
        .acquire(LockRequest::from(name.as_str()).eager_token())
        .await
        .unwrap();
    assert!(lease_a2.known_fencing_token().unwrap() > token_b);
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_token_is_issued_to_a_session_that_lost_the_lock() {
    let pg = PgCluster::start().unwrap();
    let a = manager(&pg.url(), "lazy-lost-a").await;
    let b = manager(&pg.url(), "lazy-lost-b").await;
    let admin = connect_admin(&pg.url()).await.unwrap();
    let name = unique_name("lazy-lost");

    let lease_a = a.acquire(&name).await.unwrap();
    let waiting = tokio::spawn({
        let b = b.clone();
        let name = name.clone();
        async move { b.acquire(name).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    // The server ends A's session; B takes the lock over.
    admin
        .execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = 'lazy-lost-a'",
            &[],
        )
        .await
        .unwrap();
    let lease_b = tokio::time::timeout(Duration::from_secs(20), waiting)
        .await
        .expect("B takes the lock over")
        .unwrap()
        .unwrap();
    let token_b = lease_b.fencing_token().await.unwrap();
    // A reads its token only now: refused, never a token above B's.
    match lease_a.fencing_token().await {
        Err(Error::LeaseLost(_)) => {}
        other => panic!("a lost lease read {other:?} (B holds token {token_b})"),
    }
    assert!(lease_a.known_fencing_token().is_none());
    drop(lease_a);
    a.shutdown().await;
    b.shutdown().await;
}
