//! Where the cost of an uncontended acquire + release goes: the statements chosen sends,
//! taken apart, on one raw tokio-postgres connection, against the bare pair and against
//! chosen itself. Every round runs every variant once, in a rotated order.
//!
//! Three more rows tell the statements from the manager's task: chosen's *exact*
//! single-key statements on the raw connection (with and without the durable token),
//! and the bare pair sent through a relay task (one task hop each way per statement,
//! as a request through the manager's task has).
//!
//! ```text
//! cargo bench -p chosen-tests --bench itemize               # fsync and synchronous_commit off
//! cargo bench -p chosen-tests --bench itemize -- --durable  # both on
//! ```

#![allow(missing_docs)] // a benchmark binary

use std::time::{Duration, Instant};

use chosen_core::{LockManager, ManagerOptions};
use chosen_tests::{PgCluster, connect_admin};

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

struct Variant {
    name: &'static str,
    lock: &'static str,
    unlock: &'static str,
}

fn main() -> Res<()> {
    // `--current-thread`: every task on one thread, so a hop between tasks costs no
    // wake-up of another thread.
    let mut builder = if std::env::args().any(|a| a == "--current-thread") {
        tokio::runtime::Builder::new_current_thread()
    } else {
        tokio::runtime::Builder::new_multi_thread()
    };
    builder.enable_all().build()?.block_on(run())
}

async fn run() -> Res<()> {
    let durable = std::env::args().any(|a| a == "--durable");
    let rounds: usize = std::env::var("CHOSEN_ITEMIZE_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000);
    let mut builder =
        PgCluster::builder().setting("shared_preload_libraries", "pg_stat_statements");
    if durable {
        builder = builder
            .setting("fsync", "on")
            .setting("synchronous_commit", "on");
    }
    let cluster = builder.start()?;
    let url = cluster.url();
    let raw = std::sync::Arc::new(connect_admin(&url).await?);
    raw.batch_execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        .await?;
    raw.batch_execute("SET chosen.session = 'itemize'").await?;
    let pid: i32 = raw.query_one("SELECT pg_backend_pid()", &[]).await?.get(0);
    let marker = "itemize".to_owned();
    // Another session listens, as a waiting node would.
    let listener = connect_admin(&url).await?;
    listener.batch_execute("LISTEN chosen_release").await?;

    let variants = [
        Variant {
            name: "bare pair",
            lock: "SELECT pg_try_advisory_lock(1, 2) WHERE $1::int4 IS NOT NULL AND $2::text IS NOT NULL",
            unlock: "SELECT pg_advisory_unlock(1, 2) WHERE $1::int4 IS NOT NULL AND $2::text IS NOT NULL",
        },
        Variant {
            name: "+ pooler guard",
            lock: "SELECT pg_try_advisory_lock(1, 2) WHERE pg_backend_pid() = $1 AND current_setting('chosen.session', true) = $2",
            unlock: "SELECT pg_advisory_unlock(1, 2) WHERE pg_backend_pid() = $1 AND current_setting('chosen.session', true) = $2",
        },
        Variant {
            name: "+ guard + token (xid)",
            lock: "WITH k AS MATERIALIZED (SELECT pg_try_advisory_lock(1, 2) AS won WHERE pg_backend_pid() = $1 AND current_setting('chosen.session', true) = $2) SELECT CASE WHEN k.won THEN pg_current_xact_id()::text::int8 END FROM k",
            unlock: "SELECT pg_advisory_unlock(1, 2) WHERE pg_backend_pid() = $1 AND current_setting('chosen.session', true) = $2",
        },
        Variant {
            name: "+ guard + durable token (xid, local sync commit, WAL message)",
            lock: "WITH k AS MATERIALIZED (SELECT pg_try_advisory_lock(1, 2) AS won WHERE pg_backend_pid() = $1 AND current_setting('chosen.session', true) = $2) SELECT CASE WHEN k.won AND set_config('synchronous_commit', 'local', true) = 'local' AND pg_logical_emit_message(true, 'chosen.token', '') IS NOT NULL THEN pg_current_xact_id()::text::int8 END FROM k",
            unlock: "SELECT pg_advisory_unlock(1, 2) WHERE pg_backend_pid() = $1 AND current_setting('chosen.session', true) = $2",
        },
        Variant {
            name: "+ guard + NOTIFY",
            lock: "SELECT pg_try_advisory_lock(1, 2) WHERE pg_backend_pid() = $1 AND current_setting('chosen.session', true) = $2",
            unlock: "SELECT pg_advisory_unlock(1, 2), pg_notify('chosen_release', 'x')::text WHERE pg_backend_pid() = $1 AND current_setting('chosen.session', true) = $2",
        },
        Variant {
            name: "+ guard + fence read (pg_lock_status)",
            lock: "WITH k AS MATERIALIZED (SELECT pg_try_advisory_lock(1, 2) AS won WHERE pg_backend_pid() = $1 AND current_setting('chosen.session', true) = $2) SELECT CASE WHEN k.won THEN (SELECT l.pid FROM pg_lock_status() l WHERE l.locktype = 'advisory' AND l.granted AND l.pid IS NOT NULL AND l.pid <> pg_backend_pid() AND l.classid::int8 = 7 AND l.objid::int8 = 9 AND l.objsubid = 2 LIMIT 1) END FROM k",
            unlock: "SELECT pg_advisory_unlock(1, 2) WHERE pg_backend_pid() = $1 AND current_setting('chosen.session', true) = $2",
        },
        Variant {
            name: "+ guard + fence probe (try, unlock)",
            lock: "WITH k AS MATERIALIZED (SELECT pg_try_advisory_lock(1, 2) AS won WHERE pg_backend_pid() = $1 AND current_setting('chosen.session', true) = $2) SELECT CASE WHEN k.won THEN CASE WHEN pg_try_advisory_lock(7, 9) THEN pg_advisory_unlock(7, 9) ELSE false END END FROM k",
            unlock: "SELECT pg_advisory_unlock(1, 2) WHERE pg_backend_pid() = $1 AND current_setting('chosen.session', true) = $2",
        },
        Variant {
            name: "+ guard + interest probe on release (no NOTIFY)",
            lock: "SELECT pg_try_advisory_lock(1, 2) WHERE pg_backend_pid() = $1 AND current_setting('chosen.session', true) = $2",
            unlock: "WITH u AS MATERIALIZED (SELECT pg_advisory_unlock(1, 2) AS ok WHERE pg_backend_pid() = $1 AND current_setting('chosen.session', true) = $2) SELECT u.ok, CASE WHEN pg_try_advisory_lock(7, 11) THEN pg_advisory_unlock(7, 11) ELSE pg_notify('chosen_release', 'x') IS NULL END FROM u",
        },
        Variant {
            name: "0.2 statements (guard, durable token, fence probe, interest probe: no NOTIFY)",
            lock: "WITH k AS MATERIALIZED (SELECT pg_try_advisory_lock(1, 2) AS won WHERE pg_backend_pid() = $1 AND current_setting('chosen.session', true) = $2), f AS MATERIALIZED (SELECT k.won, CASE WHEN k.won THEN CASE WHEN pg_try_advisory_lock(7, 9) THEN pg_advisory_unlock(7, 9) ELSE false END END AS clear FROM k) SELECT CASE WHEN f.won AND set_config('synchronous_commit', 'local', true) = 'local' AND pg_logical_emit_message(true, 'chosen.token', '') IS NOT NULL THEN pg_current_xact_id()::text::int8 END, f.clear FROM f",
            unlock: "WITH u AS MATERIALIZED (SELECT pg_advisory_unlock(1, 2) AS ok WHERE pg_backend_pid() = $1 AND current_setting('chosen.session', true) = $2) SELECT u.ok, CASE WHEN pg_try_advisory_lock(7, 11) THEN pg_advisory_unlock(7, 11) ELSE pg_notify('chosen_release', 'x') IS NULL END FROM u",
        },
        Variant {
            name: "earlier 0.2 statements (guard, xid, fence probe, NOTIFY)",
            lock: "WITH k AS MATERIALIZED (SELECT pg_try_advisory_lock(1, 2) AS won WHERE pg_backend_pid() = $1 AND current_setting('chosen.session', true) = $2), f AS MATERIALIZED (SELECT k.won, CASE WHEN k.won THEN CASE WHEN pg_try_advisory_lock(7, 9) THEN pg_advisory_unlock(7, 9) ELSE false END END AS clear FROM k) SELECT CASE WHEN f.won THEN pg_current_xact_id()::text::int8 END, f.clear FROM f",
            unlock: "SELECT pg_advisory_unlock(1, 2), pg_notify('chosen_release', 'x')::text WHERE pg_backend_pid() = $1 AND current_setting('chosen.session', true) = $2",
        },
        Variant {
            name: "before: guard, xid, fence read, NOTIFY",
            lock: "WITH k AS MATERIALIZED (SELECT pg_try_advisory_lock(1, 2) AS won WHERE pg_backend_pid() = $1 AND current_setting('chosen.session', true) = $2) SELECT CASE WHEN k.won THEN pg_current_xact_id()::text::int8 END, CASE WHEN k.won THEN (SELECT l.pid FROM pg_lock_status() l WHERE l.locktype = 'advisory' AND l.granted AND l.pid IS NOT NULL AND l.pid <> pg_backend_pid() AND l.classid::int8 = 7 AND l.objid::int8 = 9 AND l.objsubid = 2 LIMIT 1) END FROM k",
            unlock: "SELECT pg_advisory_unlock(1, 2), pg_notify('chosen_release', 'x')::text WHERE pg_backend_pid() = $1 AND current_setting('chosen.session', true) = $2",
        },
    ];
    // chosen's own statements, with the plan cache mode chosen's session sets (the
    // bare pair's plan is the same either way).
    raw.batch_execute("SET plan_cache_mode = force_generic_plan")
        .await?;
    let database_oid: i64 = raw
        .query_one(
            "SELECT oid::int8 FROM pg_database WHERE datname = current_database()",
            &[],
        )
        .await?
        .get(0);
    // One statement; its last parameter says whether a win takes the durable token
    // (a request that asked for it with the grant) or not (the default: issued when
    // read).
    let exact_try = raw.prepare(chosen_core::bench_sql::TRY_ONE).await?;
    let exact_unlock = raw.prepare(chosen_core::bench_sql::UNLOCK_ONE).await?;
    // A relay task that runs the bare pair for the caller, one request at a time.
    let (relay, mut relay_rx) = tokio::sync::mpsc::unbounded_channel::<(
        tokio_postgres::Statement,
        tokio::sync::oneshot::Sender<Result<(), tokio_postgres::Error>>,
    )>();
    {
        let raw = std::sync::Arc::clone(&raw);
        let (pid, marker) = (pid, marker.clone());
        tokio::spawn(async move {
            while let Some((statement, reply)) = relay_rx.recv().await {
                let params: [&(dyn tokio_postgres::types::ToSql + Sync); 2] = [&pid, &marker];
                let _ = reply.send(raw.query(&statement, &params).await.map(drop));
            }
        });
    }
    let mut prepared = Vec::new();
    for v in &variants {
        prepared.push((raw.prepare(v.lock).await?, raw.prepare(v.unlock).await?));
    }
    // No grant delay for the cluster's own fresh start: it would only stretch the warm-up.
    let manager = LockManager::connect(
        ManagerOptions::from_url(&url)?
            .node_id("itemize")
            .term_grant_delay(Duration::ZERO),
    )
    .await?;
    // After the variants: chosen, its exact statements (with, without the token), the
    // relayed bare pair.
    let extra = [
        "chosen (acquire + release; the token not read)",
        "chosen's exact statements on the raw connection, the token taken",
        "chosen's exact statements, no token (as when it is not read)",
        "bare pair through a relay task",
        "chosen, the token taken with the grant (`eager_token`)",
    ];
    let n = variants.len() + extra.len();
    let mut times: Vec<Vec<Duration>> = vec![Vec::new(); n];
    let warm_up = (rounds / 10).max(5);
    // A fresh random order every round (a fixed generator: runs are comparable), so no
    // variant always follows another and pays for its after-effects.
    // `CHOSEN_ITEMIZE_ONLY=i` runs row i of the table alone (counting from 0), to see it
    // without the others' after-effects; `CHOSEN_ITEMIZE_ONLY=i,j,k` runs those rows,
    // interleaved as the full run does.
    let only: Vec<usize> = std::env::var("CHOSEN_ITEMIZE_ONLY")
        .ok()
        .map(|v| {
            v.split(',')
                .filter_map(|i| i.trim().parse().ok())
                .map(|i: usize| i.min(n - 1))
                .collect()
        })
        .unwrap_or_default();
    let mut order: Vec<usize> = match only.as_slice() {
        [] => (0..n).collect(),
        [one] => vec![*one; n],
        some => some.to_vec(),
    };
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut cpu_from = Duration::ZERO;
    for round in 0..warm_up + rounds {
        if round == warm_up {
            cpu_from = chosen_tests::process_cpu_time();
        }
        for i in (1..order.len()).rev() {
            seed = seed
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            order.swap(i, (seed >> 33) as usize % (i + 1));
        }
        for &which in &order {
            let t = Instant::now();
            if which == variants.len() {
                let lease = manager.acquire("itemize").await?;
                lease.release().await?;
            } else if which == variants.len() + 4 {
                let lease = manager
                    .acquire(chosen_core::LockRequest::from("itemize").eager_token())
                    .await?;
                lease.release().await?;
            } else if (variants.len() + 1..variants.len() + 3).contains(&which) {
                let (a, b, big): (i32, i32, Option<i64>) = (1, 3, None);
                let (fence, interest) = ((7i32, 9i32), (7i32, 11i32));
                // No announcer to verify (the key is free).
                let announcer: Option<i32> = None;
                let tag = "itemize".to_owned();
                let take_token = which == variants.len() + 1;
                raw.query(
                    &exact_try,
                    &[
                        &a,
                        &b,
                        &big,
                        &pid,
                        &marker,
                        &database_oid,
                        &fence.0,
                        &fence.1,
                        &true,
                        &interest.0,
                        &interest.1,
                        &announcer,
                        &take_token,
                    ],
                )
                .await?;
                raw.query(
                    &exact_unlock,
                    &[&a, &b, &big, &tag, &pid, &marker, &interest.0, &interest.1],
                )
                .await?;
            } else if which == variants.len() + 3 {
                for statement in [&prepared[0].0, &prepared[0].1] {
                    let (reply, answer) = tokio::sync::oneshot::channel();
                    relay.send((statement.clone(), reply))?;
                    answer.await??;
                }
            } else {
                let (lock, unlock) = &prepared[which];
                raw.query(lock, &[&pid, &marker]).await?;
                raw.query(unlock, &[&pid, &marker]).await?;
            }
            if round >= warm_up {
                times[which].push(t.elapsed());
            }
        }
    }
    // This process's CPU (every thread) per timed round: with one row alone
    // (`CHOSEN_ITEMIZE_ONLY=i`), what that row costs the client.
    let cpu_per_round = (chosen_tests::process_cpu_time().saturating_sub(cpu_from)).as_secs_f64()
        * 1e6
        / rounds as f64;
    manager.shutdown().await;
    // What chosen sent, per acquire + release.
    let rows = raw
        .query(
            "SELECT calls, mean_exec_time, left(regexp_replace(query, '\\s+', ' ', 'g'), 90) FROM pg_stat_statements WHERE query NOT LIKE '%pg_stat_statements%' AND query NOT LIKE '%pg_try_advisory_lock(1, 2)%' AND query NOT LIKE '%pg_advisory_unlock(1, 2)%' ORDER BY calls DESC LIMIT 30",
            &[],
        )
        .await?;
    for r in rows {
        let calls: i64 = r.get(0);
        let mean: f64 = r.get(1);
        let q: String = r.get(2);
        println!(
            "{:>6.2} per pair, {:>6.1} µs server time: {q}",
            calls as f64 / (warm_up + rounds) as f64,
            mean * 1000.0
        );
    }
    let p50 = |v: &mut Vec<Duration>| {
        v.sort();
        v[v.len() / 2]
    };
    let floor = if times[0].is_empty() {
        Duration::from_micros(1)
    } else {
        p50(&mut times[0].clone())
    };
    println!(
        "{} rounds, fsync and synchronous_commit {}; client CPU {cpu_per_round:.0} µs per round (all rows of a round)\n",
        rounds,
        if durable { "on" } else { "off" }
    );
    println!("| variant (acquire + release) | p50 | × bare pair |\n|---|---|---|");
    for (i, t) in times.iter_mut().enumerate().filter(|(_, t)| !t.is_empty()) {
        let name = variants
            .get(i)
            .map_or_else(|| extra[i - variants.len()], |v| v.name);
        let m = p50(t);
        println!(
            "| {name} | {} µs | {:.2} |",
            m.as_micros(),
            m.as_secs_f64() / floor.as_secs_f64()
        );
    }
    Ok(())
}
