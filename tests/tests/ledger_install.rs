//! Installing and upgrading the tick ledger during a rolling deploy: an older node's
//! open job transaction holds the ledger table, and the upgrade's `ALTER TABLE` must
//! neither queue every ledger statement of the fleet behind it nor wait for ever.

use std::time::{Duration, Instant};

use chosen_apalis::{LedgerError, TickLedger};
use chosen_tests::{PgCluster, connect_admin};
use deadpool_postgres::Pool;

fn pool(url: &str) -> Pool {
    let config: tokio_postgres::Config = url.parse().unwrap();
    Pool::builder(deadpool_postgres::Manager::new(
        config,
        tokio_postgres::NoTls,
    ))
    .max_size(2)
    .build()
    .unwrap()
}

/// A server with a ledger table as an earlier version created it (no `schedule`
/// column), and an open transaction that read it (an older node's running job).
async fn old_table_in_use(pg: &PgCluster) -> tokio_postgres::Client {
    let ledger = TickLedger::new(pool(&pg.url()));
    ledger.install().await.unwrap();
    let admin = connect_admin(&pg.url()).await.unwrap();
    admin
        .batch_execute("ALTER TABLE chosen_ticks DROP COLUMN schedule")
        .await
        .unwrap();
    let old_node = connect_admin(&pg.url()).await.unwrap();
    old_node
        .batch_execute("BEGIN; SELECT count(*) FROM chosen_ticks")
        .await
        .unwrap();
    old_node
}

async fn has_schedule(url: &str) -> bool {
    let admin = connect_admin(url).await.unwrap();
    admin
        .query_one(
            "SELECT count(*) FROM pg_attribute WHERE attrelid = 'chosen_ticks'::regclass AND attname = 'schedule' AND NOT attisdropped",
            &[],
        )
        .await
        .unwrap()
        .get::<_, i64>(0)
        == 1
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_behind_an_open_transaction_does_not_hold_up_other_nodes_and_completes_after_it()
{
    let pg = PgCluster::start().unwrap();
    let old_node = old_table_in_use(&pg).await;
    let ledger = TickLedger::new(pool(&pg.url()));
    let install = tokio::spawn(async move { ledger.install().await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Another node's ledger statements go on while the upgrade waits (each of the
    // upgrade's tries holds them up a moment at most).
    let other_node = connect_admin(&pg.url()).await.unwrap();
    for _ in 0..5 {
        let t = Instant::now();
        tokio::time::timeout(
            Duration::from_secs(10),
            other_node.query_one("SELECT count(*) FROM chosen_ticks", &[]),
        )
        .await
        .expect("a ledger read queued behind the upgrade's ALTER TABLE")
        .unwrap();
        assert!(
            t.elapsed() < Duration::from_secs(3),
            "a ledger read waited {:?} behind the upgrade",
            t.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        !install.is_finished(),
        "the upgrade did not wait for the lock"
    );
    // The old node's job ends: the upgrade goes through.
    old_node.batch_execute("COMMIT").await.unwrap();
    tokio::time::timeout(Duration::from_secs(15), install)
        .await
        .expect("the upgrade did not complete after the transaction ended")
        .unwrap()
        .unwrap();
    assert!(has_schedule(&pg.url()).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_that_never_gets_the_lock_fails_with_a_timeout_and_leaves_the_connection_usable()
{
    let pg = PgCluster::start().unwrap();
    let _old_node = old_table_in_use(&pg).await;
    let pool = pool(&pg.url());
    let ledger = TickLedger::new(pool.clone()).timeout(Duration::from_millis(500));
    let t = Instant::now();
    let result = tokio::time::timeout(Duration::from_secs(30), ledger.install())
        .await
        .expect("install waited for ever");
    assert!(
        matches!(result, Err(LedgerError::Timeout { .. })),
        "{result:?}"
    );
    let message = result.unwrap_err().to_string();
    assert!(message.contains("install"), "{message}");
    // It retried for its patience (six ledger timeouts: 3 s; it gives up when the
    // next try could not end within it), no more.
    assert!(t.elapsed() >= Duration::from_secs(2), "{:?}", t.elapsed());
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    // The pooled connection is not left in a failed transaction.
    let client = pool.get().await.unwrap();
    client.query_one("SELECT 1", &[]).await.unwrap();
    assert!(!has_schedule(&pg.url()).await);
}
