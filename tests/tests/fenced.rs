//! Fenced writes against a real PostgreSQL: install (idempotent, concurrent), stale,
//! equal and greater tokens, a stale holder blocked on the row lock, a rolled-back
//! newer fence, isolation levels, real leases across a hand-over, bad input, and a
//! pooled (deadpool) client.

use std::sync::Arc;
use std::time::Duration;

use chosen_core::fenced::{self, FenceTable};
use chosen_core::{Error, FencingToken, LockManager, ManagerOptions};
use chosen_tests::{PgCluster, connect_admin, unique_name};
use tokio_postgres::error::SqlState;
use tokio_postgres::{Client, IsolationLevel};

fn token(value: u64) -> FencingToken {
    FencingToken::new(value)
}

/// A cluster with the default fence table installed, and a client.
async fn installed() -> (PgCluster, Client) {
    let pg = PgCluster::start().unwrap();
    let client = connect_admin(&pg.url()).await.unwrap();
    fenced::install(&client).await.unwrap();
    (pg, client)
}

/// The token recorded for `name` in the default table.
async fn recorded(client: &Client, name: &str) -> Option<i64> {
    client
        .query_opt("SELECT token FROM chosen_fence WHERE name = $1", &[&name])
        .await
        .unwrap()
        .map(|r| r.get(0))
}

/// Fences `name` with `value` in a transaction of its own and commits.
async fn fence_and_commit(client: &mut Client, name: &str, value: u64) -> chosen_core::Result<()> {
    let tx = client.transaction().await.unwrap();
    fenced::fence(&tx, name, token(value)).await?;
    tx.commit().await.unwrap();
    Ok(())
}

async fn backend_pid(client: &Client) -> i32 {
    client
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0)
}

/// Waits until backend `pid` waits for a lock (a row lock or a transaction's end).
async fn wait_until_blocked(admin: &Client, pid: i32) {
    for _ in 0..200 {
        let row = admin
            .query_one(
                "SELECT coalesce(wait_event_type, '') FROM pg_stat_activity WHERE pid = $1",
                &[&pid],
            )
            .await
            .unwrap();
        if row.get::<_, String>(0) == "Lock" {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("backend {pid} never waited for a lock");
}

fn is_stale(e: &Error, name: &str, ours: u64, theirs: u64) -> bool {
    matches!(e, Error::StaleToken { name: n, token: t, recorded: Some(r) }
        if n == name && t.get() == ours && r.get() == theirs)
}

/// Runs `table.install` (the default table for `None`) on every client at once.
async fn install_at_once(clients: &[Arc<Client>], table: Option<&FenceTable>) {
    let barrier = Arc::new(tokio::sync::Barrier::new(clients.len()));
    let mut set = tokio::task::JoinSet::new();
    for client in clients {
        let (client, barrier, table) = (Arc::clone(client), Arc::clone(&barrier), table.cloned());
        set.spawn(async move {
            barrier.wait().await;
            match table {
                Some(table) => table.install(&client).await,
                None => fenced::install(&client).await,
            }
        });
    }
    while let Some(result) = set.join_next().await {
        result.unwrap().unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn install_is_idempotent_and_safe_from_many_nodes_at_once() {
    let pg = PgCluster::start().unwrap();
    let admin = connect_admin(&pg.url()).await.unwrap();
    admin
        .batch_execute("CREATE SCHEMA IF NOT EXISTS fence_ops")
        .await
        .unwrap();
    let mut clients = Vec::new();
    for _ in 0..8 {
        clients.push(Arc::new(connect_admin(&pg.url()).await.unwrap()));
    }
    // Several rounds, each a fresh table created by eight connections at once (where a
    // bare CREATE TABLE IF NOT EXISTS can fail with a unique violation in pg_type).
    for round in 0..5 {
        let name = format!("fence_ops.race_{round}");
        let table = FenceTable::new(&name).unwrap();
        install_at_once(&clients, Some(&table)).await;
        // Once more: nothing to do, no error.
        table.install(&admin).await.unwrap();
        let exists: bool = admin
            .query_one("SELECT to_regclass($1) IS NOT NULL", &[&name])
            .await
            .unwrap()
            .get(0);
        assert!(exists, "round {round}: table created");
    }
    // The default table, concurrently and again.
    install_at_once(&clients, None).await;
    fenced::install(&admin).await.unwrap();
    // What teams that run migrations run: the same SQL, also idempotent.
    admin.batch_execute(fenced::INSTALL_SQL).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newer_token_s_commit_makes_an_older_fence_fail_and_its_transaction_abort() {
    let (_pg, mut client) = installed().await;
    let name = unique_name("fence-order");
    client
        .batch_execute("CREATE TABLE fence_work (id serial PRIMARY KEY, token bigint)")
        .await
        .unwrap();

    fence_and_commit(&mut client, &name, 5).await.unwrap();
    assert_eq!(recorded(&client, &name).await, Some(5));
    // Greater: recorded.
    fence_and_commit(&mut client, &name, 7).await.unwrap();
    assert_eq!(recorded(&client, &name).await, Some(7));
    // Equal: the same holder writing again, in a later transaction and twice in one.
    fence_and_commit(&mut client, &name, 7).await.unwrap();
    {
        let tx = client.transaction().await.unwrap();
        fenced::fence(&tx, &name, token(7)).await.unwrap();
        fenced::fence(&tx, &name, token(7)).await.unwrap();
        tx.commit().await.unwrap();
    }
    assert_eq!(recorded(&client, &name).await, Some(7));

    // Smaller: the typed error, naming both tokens.
    let tx = client.transaction().await.unwrap();
    tx.execute("INSERT INTO fence_work (token) VALUES (5)", &[])
        .await
        .unwrap();
    let err = fenced::fence(&tx, &name, token(5)).await.unwrap_err();
    assert!(is_stale(&err, &name, 5, 7), "{err:?}");
    let text = err.to_string();
    assert!(
        text.contains("fencing token 5") && text.contains("recorded 7") && text.contains("roll"),
        "{text}"
    );
    assert!(!err.is_transient());
    // The transaction is aborted on the server: nothing more runs, and a commit (which
    // tokio-postgres reports as Ok) rolls back.
    let next = tx.execute("SELECT 1", &[]).await.unwrap_err();
    assert_eq!(next.code(), Some(&SqlState::IN_FAILED_SQL_TRANSACTION));
    tx.commit().await.unwrap();
    let rows: i64 = client
        .query_one("SELECT count(*) FROM fence_work", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(rows, 0, "the stale transaction's write must not commit");
    assert_eq!(recorded(&client, &name).await, Some(7));

    // Names are independent fences.
    fence_and_commit(&mut client, &format!("{name}-other"), 1)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_holder_blocked_on_the_row_lock_fails_once_the_newer_commits() {
    let (pg, admin) = installed().await;
    // With and without a row for the name yet (a first write waits on the unique index).
    for existing in [true, false] {
        let name = unique_name("fence-block");
        let mut old = connect_admin(&pg.url()).await.unwrap();
        let mut new = connect_admin(&pg.url()).await.unwrap();
        if existing {
            fence_and_commit(&mut new, &name, 3).await.unwrap();
        }
        let old_pid = backend_pid(&old).await;
        let name2 = name.clone();
        // The stale holder's transaction starts first.
        let (started_tx, started_rx) = tokio::sync::oneshot::channel();
        let (go_tx, go_rx) = tokio::sync::oneshot::channel::<()>();
        let stale = tokio::spawn(async move {
            let tx = old.transaction().await.unwrap();
            tx.execute("SELECT 1", &[]).await.unwrap();
            started_tx.send(()).unwrap();
            go_rx.await.unwrap();
            let result = fenced::fence(&tx, &name2, token(5)).await;
            let committed = tx.commit().await;
            (result, committed)
        });
        started_rx.await.unwrap();
        let tx_new = new.transaction().await.unwrap();
        fenced::fence(&tx_new, &name, token(10)).await.unwrap();
        go_tx.send(()).unwrap();
        wait_until_blocked(&admin, old_pid).await;
        assert!(!stale.is_finished(), "the stale fence must wait");
        tx_new.commit().await.unwrap();
        let (result, _) = tokio::time::timeout(Duration::from_secs(10), stale)
            .await
            .expect("the stale fence ends once the newer commits")
            .unwrap();
        let err = result.unwrap_err();
        assert!(is_stale(&err, &name, 5, 10), "existing {existing}: {err:?}");
        assert_eq!(recorded(&admin, &name).await, Some(10));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolled_back_newer_fence_does_not_block_the_older() {
    let (pg, admin) = installed().await;
    for existing in [true, false] {
        let name = unique_name("fence-rollback");
        let mut old = connect_admin(&pg.url()).await.unwrap();
        let mut new = connect_admin(&pg.url()).await.unwrap();
        if existing {
            fence_and_commit(&mut old, &name, 3).await.unwrap();
        }
        let old_pid = backend_pid(&old).await;
        let tx_new = new.transaction().await.unwrap();
        fenced::fence(&tx_new, &name, token(10)).await.unwrap();
        let name2 = name.clone();
        let older = tokio::spawn(async move {
            let tx = old.transaction().await.unwrap();
            fenced::fence(&tx, &name2, token(5)).await?;
            tx.commit().await.unwrap();
            Ok::<(), Error>(())
        });
        wait_until_blocked(&admin, old_pid).await;
        tx_new.rollback().await.unwrap();
        tokio::time::timeout(Duration::from_secs(10), older)
            .await
            .expect("the older fence goes on once the newer rolled back")
            .unwrap()
            .unwrap();
        assert_eq!(
            recorded(&admin, &name).await,
            Some(5),
            "existing {existing}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_repeatable_read_a_concurrent_newer_commit_is_a_retryable_conflict() {
    let (pg, admin) = installed().await;
    for level in [IsolationLevel::RepeatableRead, IsolationLevel::Serializable] {
        let name = unique_name("fence-rr");
        let mut old = connect_admin(&pg.url()).await.unwrap();
        let mut new = connect_admin(&pg.url()).await.unwrap();
        fence_and_commit(&mut new, &name, 3).await.unwrap();
        let old_pid = backend_pid(&old).await;
        let name2 = name.clone();
        let (started_tx, started_rx) = tokio::sync::oneshot::channel();
        let (go_tx, go_rx) = tokio::sync::oneshot::channel::<()>();
        let stale = tokio::spawn(async move {
            let tx = old
                .build_transaction()
                .isolation_level(level)
                .start()
                .await
                .unwrap();
            // Takes the snapshot before the newer holder's fence commits.
            tx.execute("SELECT 1", &[]).await.unwrap();
            started_tx.send(()).unwrap();
            go_rx.await.unwrap();
            fenced::fence(&tx, &name2, token(5)).await
        });
        started_rx.await.unwrap();
        let tx_new = new.transaction().await.unwrap();
        fenced::fence(&tx_new, &name, token(10)).await.unwrap();
        go_tx.send(()).unwrap();
        wait_until_blocked(&admin, old_pid).await;
        tx_new.commit().await.unwrap();
        let err = tokio::time::timeout(Duration::from_secs(10), stale)
            .await
            .unwrap()
            .unwrap()
            .unwrap_err();
        assert!(
            matches!(&err, Error::FenceConflict { name: n, .. } if *n == name),
            "{level:?}: {err:?}"
        );
        assert!(err.is_transient());
        // The retry, with a snapshot that sees the newer token: stale.
        let mut retry = connect_admin(&pg.url()).await.unwrap();
        let tx = retry
            .build_transaction()
            .isolation_level(level)
            .start()
            .await
            .unwrap();
        let err = fenced::fence(&tx, &name, token(5)).await.unwrap_err();
        assert!(is_stale(&err, &name, 5, 10), "{level:?}: {err:?}");
        drop(tx);
        // And an equal or greater token passes at this level.
        let tx = retry
            .build_transaction()
            .isolation_level(level)
            .start()
            .await
            .unwrap();
        fenced::fence(&tx, &name, token(10)).await.unwrap();
        tx.commit().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_of_real_leases_across_a_hand_over_are_accepted_in_order() {
    let (pg, mut client) = installed().await;
    let options = |node: &str| {
        ManagerOptions::from_url(&pg.url())
            .unwrap()
            .node_id(node)
            .poll_interval(Duration::from_millis(50))
            // A fresh server grants nothing for term_grant_delay; not what is tested.
            .term_grant_delay(Duration::ZERO)
    };
    let a = LockManager::connect(options("fence-lease-a"))
        .await
        .unwrap();
    let b = LockManager::connect(options("fence-lease-b"))
        .await
        .unwrap();
    let name = unique_name("fence-lease");

    // A holds, fences twice (the same token again), and hands over gracefully.
    let lease_a = a.acquire(&name).await.unwrap();
    let token_a = lease_a.fencing_token().await.unwrap();
    for _ in 0..2 {
        let tx = client.transaction().await.unwrap();
        lease_a.fence(&tx).await.unwrap();
        tx.commit().await.unwrap();
    }
    lease_a.release().await.unwrap();
    let lease_b = b.acquire(&name).await.unwrap();
    let token_b = lease_b.fencing_token().await.unwrap();
    assert!(token_b > token_a, "{token_b} > {token_a}");
    let tx = client.transaction().await.unwrap();
    lease_b.fence(&tx).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(
        recorded(&client, &name).await,
        Some(i64::try_from(token_b.get()).unwrap())
    );

    // A, acquiring again, gets a newer token still; B's lease is then lost (its
    // session killed), and B may not fence with it at all.
    let admin = connect_admin(&pg.url()).await.unwrap();
    admin
        .execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = 'fence-lease-b'",
            &[],
        )
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(10), lease_b.lost())
        .await
        .expect("B learns it lost the lease");
    let lease_a2 = a.acquire(&name).await.unwrap();
    assert!(lease_a2.fencing_token().await.unwrap() > token_b);
    let tx = client.transaction().await.unwrap();
    lease_a2.fence(&tx).await.unwrap();
    tx.commit().await.unwrap();

    let tx = client.transaction().await.unwrap();
    let err = lease_b.fence(&tx).await.unwrap_err();
    assert!(matches!(err, Error::LeaseLost(_)), "{err:?}");
    // Nothing was sent: the transaction is still usable.
    tx.execute("SELECT 1", &[]).await.unwrap();
    // B's token through the plain function (a holder that does not know yet): stale.
    let err = fenced::fence(&tx, &name, token_b).await.unwrap_err();
    assert!(
        is_stale(
            &err,
            &name,
            token_b.get(),
            lease_a2.fencing_token().await.unwrap().get()
        ),
        "{err:?}"
    );
    drop(tx);
    drop(lease_a2);
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_clear_errors_and_no_statement() {
    let pg = PgCluster::start().unwrap();
    let mut client = connect_admin(&pg.url()).await.unwrap();

    // Table names.
    for bad in ["", "a.b.c", "Fence", "fence; DROP TABLE x", "x\"y", "ops."] {
        let err = FenceTable::new(bad).unwrap_err();
        assert!(
            matches!(err, Error::InvalidTableName(_)),
            "{bad:?}: {err:?}"
        );
        assert!(
            err.to_string().starts_with("invalid fence table name"),
            "{err}"
        );
    }
    // A schema that does not exist.
    let err = FenceTable::new("no_such_schema.fence")
        .unwrap()
        .install(&client)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Fence { .. }), "{err:?}");
    // Not installed: says how to install.
    let tx = client.transaction().await.unwrap();
    let err = fenced::fence(&tx, "x", token(1)).await.unwrap_err();
    assert!(matches!(err, Error::FenceNotInstalled { .. }), "{err:?}");
    assert!(err.to_string().contains("install"), "{err}");
    drop(tx);

    fenced::install(&client).await.unwrap();
    let tx = client.transaction().await.unwrap();
    // Fence names, and tokens past 2^63 - 1: refused before any statement, so the
    // transaction goes on.
    for bad in ["", "a\0b"] {
        let err = fenced::fence(&tx, bad, token(1)).await.unwrap_err();
        assert!(matches!(err, Error::InvalidName(_)), "{bad:?}: {err:?}");
    }
    for big in [1 << 63, u64::MAX] {
        let err = fenced::fence(&tx, "big", token(big)).await.unwrap_err();
        assert!(
            matches!(err, Error::TokenOutOfRange(t) if t.get() == big),
            "{err:?}"
        );
        assert!(
            err.to_string().contains("the largest a fence stores"),
            "{err}"
        );
    }
    fenced::fence(&tx, "big", fenced::MAX_TOKEN).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(recorded(&client, "big").await, Some(i64::MAX));
    // A name with quotes and odd characters is only data.
    let odd = "x'); DROP TABLE chosen_fence; --";
    fence_and_commit(&mut client, odd, 1).await.unwrap();
    assert_eq!(recorded(&client, odd).await, Some(1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pooled_client_in_another_table_fences_too() {
    let pg = PgCluster::start().unwrap();
    let admin = connect_admin(&pg.url()).await.unwrap();
    admin.batch_execute("CREATE SCHEMA ops").await.unwrap();
    let config: tokio_postgres::Config = pg.url().parse().unwrap();
    let pool = deadpool_postgres::Pool::builder(deadpool_postgres::Manager::new(
        config,
        tokio_postgres::NoTls,
    ))
    .max_size(2)
    .build()
    .unwrap();
    let table = FenceTable::new("ops.chosen_fence").unwrap();
    let mut client = pool.get().await.unwrap();
    table.install(&client).await.unwrap();
    let name = unique_name("fence-pool");
    let tx = client.transaction().await.unwrap();
    table.fence(&tx, &name, token(9)).await.unwrap();
    tx.commit().await.unwrap();
    let tx = client.transaction().await.unwrap();
    let err = table.fence(&tx, &name, token(8)).await.unwrap_err();
    assert!(is_stale(&err, &name, 8, 9), "{err:?}");
    drop(tx);
    let n: i64 = admin
        .query_one(
            "SELECT token FROM ops.chosen_fence WHERE name = $1",
            &[&name],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(n, 9);
    // The default table was never created.
    let exists: bool = admin
        .query_one("SELECT to_regclass('chosen_fence') IS NOT NULL", &[])
        .await
        .unwrap()
        .get(0);
    assert!(!exists);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_singleton_child_fences_with_its_context_until_it_must_stop() {
    let (pg, client) = installed().await;
    let manager = LockManager::connect(
        ManagerOptions::from_url(&pg.url())
            .unwrap()
            .node_id("fence-singleton")
            .term_grant_delay(Duration::ZERO),
    )
    .await
    .unwrap();
    let name = unique_name("fence-singleton");
    let (report, mut reports) = tokio::sync::mpsc::unbounded_channel();
    let url = pg.url();
    let singleton = chosen_core::Singleton::start(
        &manager,
        name.as_str(),
        chosen_core::SingletonOptions::default(),
        move |ctx| {
            let (url, report) = (url.clone(), report.clone());
            async move {
                let mut client = connect_admin(&url).await?;
                let tx = client.transaction().await?;
                let fenced = ctx.fence(&tx).await;
                tx.commit().await?;
                let _ = report.send((ctx.fencing_token(), fenced));
                ctx.cancelled().await;
                // Told to stop: a fence is refused without a statement.
                let tx = client.transaction().await?;
                let _ = report.send((ctx.fencing_token(), ctx.fence(&tx).await));
                Ok::<(), tokio_postgres::Error>(())
            }
        },
    )
    .unwrap();
    let (token, fenced) = tokio::time::timeout(Duration::from_secs(20), reports.recv())
        .await
        .unwrap()
        .unwrap();
    fenced.unwrap();
    assert_eq!(
        recorded(&client, &name).await,
        Some(i64::try_from(token.get()).unwrap())
    );
    singleton.shutdown().await;
    let (_, after) = reports.recv().await.unwrap();
    assert!(matches!(after, Err(Error::LeaseLost(_))), "{after:?}");
    manager.shutdown().await;
}
