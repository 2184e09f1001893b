//! The tick ledger against a real PostgreSQL: each misfire policy after a gap (what
//! runs, in which order, what is recorded as skipped and why), a new leader deciding
//! from the ledger alone, claim uniqueness between two gates, exactly one witness row
//! per tick with the claim in the job's transaction, and a stale leader refused.
//!
//! Leaderships are set by hand (`Leadership::manual`): these tests are about what the
//! ledger decides, which depends only on the tokens and the ticks, not on how the
//! leadership was won. Ticks are handed to the gate directly, so a "gap" is exact.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use apalis_core::error::BoxDynError;
use apalis_core::task::Task;
use chosen_apalis::{
    Claim, LeaderOnlyJobLayer, LedgeredCron, LedgeredCronLayer, Misfire, Outcome, Overlap,
    Schedule, SkipReason, Tick, TickContext, TickLedger,
};
use chosen_core::{Leadership, ManualLeadership, MetricsSink};
use chosen_tests::{PgCluster, connect_admin, unique_name};
use deadpool_postgres::Pool;
use tokio_postgres::Client;
use tower::{Layer, Service, ServiceExt};

/// A tick in the past (ticks are due by the database's clock: a future one would be
/// held until then), two days ago at a whole hour, the same for every test in this
/// process. Ticks up to a day after it are in the past too.
fn t0() -> u64 {
    static T0: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *T0.get_or_init(|| (unix_now() - 2 * 86_400) / 3600 * 3600)
}

struct Db {
    _pg: PgCluster,
    url: String,
    pool: Pool,
    admin: Client,
    ledger: TickLedger,
}

async fn db() -> Db {
    db_on(PgCluster::start().unwrap()).await
}

/// [`db`] on the cluster given (a local one, for a test that crashes the server).
async fn db_on(pg: PgCluster) -> Db {
    let config: tokio_postgres::Config = pg.url().parse().unwrap();
    let pool = Pool::builder(deadpool_postgres::Manager::new(
        config,
        tokio_postgres::NoTls,
    ))
    .max_size(4)
    .build()
    .unwrap();
    let ledger = TickLedger::new(pool.clone());
    ledger.install().await.unwrap();
    // Idempotent.
    ledger.install().await.unwrap();
    let admin = connect_admin(&pg.url()).await.unwrap();
    admin
        .batch_execute("CREATE TABLE IF NOT EXISTS witness (job text, tick bigint, token bigint)")
        .await
        .unwrap();
    Db {
        url: pg.url(),
        _pg: pg,
        pool,
        admin,
        ledger,
    }
}

/// The ticks the job ran, in order, and whether each was a missed one.
type Runs = Arc<Mutex<Vec<(u64, bool)>>>;

/// A job that notes its runs and, if `pool` is given, writes a witness row in the
/// ledger transaction.
#[derive(Clone)]
struct Job {
    runs: Runs,
    pool: Option<Pool>,
    /// How long the run of a tick takes, for the ticks listed (others: no time).
    delays: Delays,
    /// The task id of every run, in order.
    ids: Ids,
}

type Ids = Arc<Mutex<Vec<Option<String>>>>;

type Delays = Arc<Mutex<Vec<(u64, Duration)>>>;

impl Service<Task<Tick>> for Job {
    type Response = ();
    type Error = BoxDynError;
    type Future = std::pin::Pin<Box<dyn Future<Output = Result<(), BoxDynError>> + Send>>;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), BoxDynError>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, task: Task<Tick>) -> Self::Future {
        let (runs, pool) = (Arc::clone(&self.runs), self.pool.clone());
        self.ids
            .lock()
            .unwrap()
            .push(task.task_id().map(ToString::to_string));
        let delay = self
            .delays
            .lock()
            .unwrap()
            .iter()
            .find(|(t, _)| *t == task.args.get_timestamp())
            .map(|(_, d)| *d);
        Box::pin(async move {
            let ctx = task
                .ctx()
                .data()
                .get::<TickContext>()
                .cloned()
                .ok_or("no TickContext")?;
            assert_eq!(ctx.timestamp(), task.args.get_timestamp());
            runs.lock()
                .unwrap()
                .push((ctx.timestamp(), ctx.is_catch_up()));
            if let Some(pool) = pool {
                let mut client = pool.get().await?;
                let Some(tx) = ctx.begin(&mut client).await? else {
                    return Ok(());
                };
                if let Some(delay) = delay {
                    tokio::time::sleep(delay).await;
                }
                tx.execute(
                    "INSERT INTO witness (job, tick, token) VALUES ($1, $2, $3)",
                    &[
                        &ctx.job(),
                        &(ctx.timestamp() as i64),
                        &(ctx.fencing_token().get() as i64),
                    ],
                )
                .await?;
                tx.commit().await?;
            } else if let Some(delay) = delay {
                tokio::time::sleep(delay).await;
            }
            Ok(())
        })
    }
}

struct Node {
    svc: LedgeredCron<Job>,
    control: ManualLeadership,
    layer: LedgeredCronLayer,
    runs: Runs,
    delays: Delays,
    ids: Ids,
}

fn node(
    db: &Db,
    job: &str,
    id: &str,
    token: u64,
    misfire: Misfire,
    claim: Claim,
    witness: bool,
) -> Node {
    let every_second = "* * * * * *".parse::<Schedule>().unwrap();
    node_on(db, job, id, token, (misfire, claim, every_second), witness)
}

fn node_on(
    db: &Db,
    job: &str,
    id: &str,
    token: u64,
    (misfire, claim, schedule): (Misfire, Claim, Schedule),
    witness: bool,
) -> Node {
    node_with(db, job, id, token, witness, |layer| {
        layer.misfire(misfire).claim(claim).schedule(schedule)
    })
}

fn node_with(
    db: &Db,
    job: &str,
    id: &str,
    token: u64,
    witness: bool,
    configure: impl FnOnce(LedgeredCronLayer) -> LedgeredCronLayer,
) -> Node {
    let (leadership, control): (Leadership, _) = Leadership::manual(job, id);
    control.lead(token);
    let layer = configure(LeaderOnlyJobLayer::new(leadership).ledger(db.ledger.clone()));
    let runs = Runs::default();
    let delays = Delays::default();
    let ids = Ids::default();
    let svc = layer.layer(Job {
        runs: Arc::clone(&runs),
        pool: witness.then(|| db.pool.clone()),
        delays: Arc::clone(&delays),
        ids: Arc::clone(&ids),
    });
    Node {
        svc,
        control,
        layer,
        runs,
        delays,
        ids,
    }
}

async fn try_tick(node: &mut Node, at: u64) -> Result<Outcome<()>, BoxDynError> {
    node.svc.ready().await?.call(Task::new(Tick::new(at))).await
}

async fn tick(node: &mut Node, at: u64) -> Outcome<()> {
    try_tick(node, at).await.unwrap()
}

/// `(tick - T0, outcome, reason, token)` per ledger row of `job`, by tick.
async fn rows(admin: &Client, job: &str) -> Vec<(i64, String, Option<String>, i64)> {
    admin
        .query(
            "SELECT extract(epoch FROM tick)::bigint, outcome, reason, token FROM chosen_ticks WHERE job = $1 ORDER BY tick",
            &[&job],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get::<_, i64>(0) - t0() as i64, r.get(1), r.get(2), r.get(3)))
        .collect()
}

fn row(
    dt: i64,
    outcome: &str,
    reason: Option<&str>,
    token: i64,
) -> (i64, String, Option<String>, i64) {
    (dt, outcome.to_owned(), reason.map(str::to_owned), token)
}

#[tokio::test]
async fn skip_records_every_missed_tick_and_runs_none() {
    let db = db().await;
    let job = unique_name("ledger-skip");
    let mut a = node(
        &db,
        &job,
        "node-a",
        5,
        Misfire::Skip,
        Claim::BeforeRun,
        false,
    );
    assert!(tick(&mut a, t0()).await.ran());
    // Four ticks nobody handled, then T0+5.
    assert!(tick(&mut a, t0() + 5).await.ran());
    assert_eq!(
        *a.runs.lock().unwrap(),
        vec![(t0(), false), (t0() + 5, false)]
    );
    let missed = Some("missed: not run when due");
    assert_eq!(
        rows(&db.admin, &job).await,
        vec![
            row(0, "ran", None, 5),
            row(1, "skipped", missed, 5),
            row(2, "skipped", missed, 5),
            row(3, "skipped", missed, 5),
            row(4, "skipped", missed, 5),
            row(5, "ran", None, 5),
        ]
    );
    assert_eq!(a.layer.stats().skipped_missed(), 4);
    // The same tick again (a second scheduler, a retry): not run twice.
    assert!(matches!(
        tick(&mut a, t0() + 5).await,
        Outcome::Skipped(SkipReason::AlreadyRecorded { .. })
    ));
    assert_eq!(a.runs.lock().unwrap().len(), 2);
    a.control.follow(Some("node-b"));
    assert!(matches!(
        tick(&mut a, t0() + 6).await,
        Outcome::Skipped(SkipReason::NotLeader { .. })
    ));
}

#[tokio::test]
async fn run_once_runs_the_most_recent_missed_tick_then_the_due_one() {
    let db = db().await;
    let job = unique_name("ledger-once");
    let mut a = node(
        &db,
        &job,
        "node-a",
        5,
        Misfire::RunOnce,
        Claim::BeforeRun,
        false,
    );
    tick(&mut a, t0()).await;
    tick(&mut a, t0() + 5).await;
    assert_eq!(
        *a.runs.lock().unwrap(),
        vec![(t0(), false), (t0() + 4, true), (t0() + 5, false)]
    );
    let sup = Some("superseded by a later missed tick");
    assert_eq!(
        rows(&db.admin, &job).await,
        vec![
            row(0, "ran", None, 5),
            row(1, "skipped", sup, 5),
            row(2, "skipped", sup, 5),
            row(3, "skipped", sup, 5),
            row(4, "ran", None, 5),
            row(5, "ran", None, 5),
        ]
    );
}

// A gap, then a new leader on another node: it decides from the ledger alone (it ran
// nothing before), runs exactly the missed ticks within the window, oldest first,
// each once, and records the others with their reason.
#[tokio::test]
async fn catch_up_runs_the_missed_ticks_within_the_window_oldest_first() {
    let db = db().await;
    let job = unique_name("ledger-catchup");
    let policy = Misfire::CatchUp {
        max: 3,
        within: Duration::from_secs(4),
    };
    let mut a = node(
        &db,
        &job,
        "node-a",
        5,
        policy,
        Claim::InJobTransaction,
        true,
    );
    tick(&mut a, t0()).await;
    a.control.stop();
    let mut b = node(
        &db,
        &job,
        "node-b",
        7,
        policy,
        Claim::InJobTransaction,
        true,
    );
    assert!(tick(&mut b, t0() + 10).await.ran());
    // Within 4 s of T0+10: T0+6..T0+9; the most recent 3 run, oldest first.
    assert_eq!(
        *b.runs.lock().unwrap(),
        vec![
            (t0() + 7, true),
            (t0() + 8, true),
            (t0() + 9, true),
            (t0() + 10, false)
        ]
    );
    let (win, max) = (Some("beyond catch-up window"), Some("beyond catch-up max"));
    assert_eq!(
        rows(&db.admin, &job).await,
        vec![
            row(0, "ran", None, 5),
            row(1, "skipped", win, 7),
            row(2, "skipped", win, 7),
            row(3, "skipped", win, 7),
            row(4, "skipped", win, 7),
            row(5, "skipped", win, 7),
            row(6, "skipped", max, 7),
            row(7, "ran", None, 7),
            row(8, "ran", None, 7),
            row(9, "ran", None, 7),
            row(10, "ran", None, 7),
        ]
    );
    let witness: Vec<(i64, i64)> = db
        .admin
        .query(
            "SELECT tick, token FROM witness WHERE job = $1 ORDER BY tick",
            &[&job],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get::<_, i64>(0) - t0() as i64, r.get(1)))
        .collect();
    assert_eq!(witness, vec![(0, 5), (7, 7), (8, 7), (9, 7), (10, 7)]);
    // Each missed tick's task has an id of its own (review finding: they were built
    // from the tick at hand's task, id included).
    let ids = b.ids.lock().unwrap().clone();
    let caught_up: std::collections::BTreeSet<_> = ids[..3].iter().flatten().collect();
    assert_eq!(caught_up.len(), 3, "{ids:?}");
    assert_eq!(b.layer.stats().caught_up(), 3);
    assert_eq!(b.layer.stats().skipped_missed(), 6);
}

// Two gates that both believe they lead (equal tokens, so the fence lets both through)
// get the same tick at the same moment: the ledger's key lets one run.
#[tokio::test]
async fn two_gates_one_tick_one_run() {
    let db = db().await;
    for claim in [Claim::BeforeRun, Claim::InJobTransaction] {
        let job = unique_name("ledger-unique");
        let mut a = node(&db, &job, "node-a", 5, Misfire::Skip, claim, true);
        let mut b = node(&db, &job, "node-b", 5, Misfire::Skip, claim, true);
        for t in t0()..t0() + 5 {
            let (x, y) = tokio::join!(tick(&mut a, t), tick(&mut b, t));
            assert!(x.ran() != y.ran(), "{claim:?} {t}: {x:?} {y:?}");
        }
        let per_tick: Vec<i64> = db
            .admin
            .query(
                "SELECT count(*) FROM witness WHERE job = $1 GROUP BY tick ORDER BY tick",
                &[&job],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect();
        assert_eq!(per_tick, vec![1; 5], "{claim:?}: one witness row per tick");
        assert_eq!(rows(&db.admin, &job).await.len(), 5);
    }
}

// A leader whose lease passed to a newer one (greater token) and that still believes
// it leads: the newer leader has written, so the old one's claim and its job's
// transaction are refused, and nothing it writes commits.
#[tokio::test]
async fn a_stale_leader_cannot_claim_or_commit() {
    let db = db().await;
    for claim in [Claim::BeforeRun, Claim::InJobTransaction] {
        let job = unique_name("ledger-stale");
        let mut old = node(&db, &job, "node-a", 5, Misfire::Skip, claim, true);
        let mut new = node(&db, &job, "node-b", 7, Misfire::Skip, claim, true);
        assert!(tick(&mut old, t0()).await.ran());
        assert!(tick(&mut new, t0() + 1).await.ran());
        let out = try_tick(&mut old, t0() + 2).await;
        match claim {
            // The gate's claim is refused: the job does not run.
            Claim::BeforeRun => {
                let out = out.unwrap();
                assert!(
                    matches!(&out, Outcome::Skipped(SkipReason::Ledger { error, .. }) if error.contains("stale")),
                    "{out:?}"
                );
                assert_eq!(old.runs.lock().unwrap().len(), 1);
            }
            // The job runs, and its transaction is refused at `begin`: the job's error.
            Claim::InJobTransaction => {
                let err = out.expect_err("the stale transaction must fail");
                assert!(err.to_string().contains("stale"), "{err}");
                assert_eq!(old.runs.lock().unwrap().len(), 2);
            }
            _ => unreachable!(),
        }
        let witness: Vec<(i64, i64)> = db
            .admin
            .query(
                "SELECT tick, token FROM witness WHERE job = $1 ORDER BY tick",
                &[&job],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| (r.get::<_, i64>(0) - t0() as i64, r.get(1)))
            .collect();
        assert_eq!(witness, vec![(0, 5), (1, 7)], "{claim:?}");
        // No row of the stale leader after the newer one's.
        let rows = rows(&db.admin, &job).await;
        assert!(
            rows.iter().all(|r| r.0 < 1 || r.3 == 7),
            "{claim:?}: {rows:?}"
        );
    }
}

// An hourly job whose ticks fell in a gap: the new leader decides as soon as it leads,
// not at the next tick (half an hour away here; a day for a daily job).
#[tokio::test]
async fn a_new_leader_catches_up_at_once_when_the_next_tick_is_far() {
    let db = db().await;
    let job = unique_name("ledger-gain");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    // Minute `m` of every hour, with `m` half an hour from now: the next tick is ~30 min
    // away, the last one ~30 min ago.
    let m = (now / 60 + 30) % 60;
    let hourly = || format!("0 {m} * * * *").parse::<Schedule>().unwrap();
    let last = {
        let mut t = now - now % 60;
        while (t / 60) % 60 != m {
            t -= 60;
        }
        t
    };
    // Node A ran the tick three hours before the last one, then went away.
    let (t3, t2, t1, t0) = (last - 3 * 3600, last - 2 * 3600, last - 3600, last);
    db.admin
        .execute(
            "INSERT INTO chosen_ticks (job, tick, token, outcome, node, started_at) VALUES ($1, to_timestamp($2), 5, 'ran', 'node-a', now())",
            &[&job, &(t3 as f64)],
        )
        .await
        .unwrap();
    // Node B leads: its gate runs the most recent missed tick, with no tick arriving.
    let b = node_on(
        &db,
        &job,
        "node-b",
        7,
        (Misfire::RunOnce, Claim::BeforeRun, hourly()),
        false,
    );
    for _ in 0..100 {
        if !b.runs.lock().unwrap().is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(*b.runs.lock().unwrap(), vec![(t0, true)]);
    let sup = Some("superseded by a later missed tick".to_owned());
    let got: Vec<(u64, String, Option<String>)> = db
        .admin
        .query(
            "SELECT extract(epoch FROM tick)::bigint, outcome, reason FROM chosen_ticks WHERE job = $1 ORDER BY tick",
            &[&job],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get::<_, i64>(0) as u64, r.get(1), r.get(2)))
        .collect();
    assert_eq!(
        got,
        vec![
            (t3, "ran".to_owned(), None),
            (t2, "skipped".to_owned(), sup.clone()),
            (t1, "skipped".to_owned(), sup),
            (t0, "ran".to_owned(), None),
        ]
    );
    assert_eq!(b.layer.stats().caught_up(), 1);
}

// A node whose clock is behind delivers the ticks due just before it gained
// leadership after the gain, "on time" by its own clock; a node whose clock is right
// had them delivered while it followed. Both must decide them as missed ticks, or
// whether a failover leaves a gap would depend on which node wins.
#[tokio::test]
async fn a_tick_due_before_the_gain_is_missed_even_when_delivered_after_it() {
    let db = db().await;
    let job = unique_name("ledger-late-delivery");
    let before = unix_now();
    db.admin
        .execute(
            "INSERT INTO chosen_ticks (job, tick, token, outcome, node, started_at) VALUES ($1, to_timestamp($2), 5, 'ran', 'node-a', now())",
            &[&job, &((before - 10) as f64)],
        )
        .await
        .unwrap();
    // Gains now, at `gain` (between two whole seconds).
    let mut b = node(
        &db,
        &job,
        "node-b",
        7,
        Misfire::Skip,
        Claim::BeforeRun,
        false,
    );
    let gain = unix_now();
    // Due 3 s before the gain, delivered now (3 s late: on time for a scheduler 3 s
    // behind): a missed tick, not the tick at hand.
    let late = tick(&mut b, gain - 3).await;
    assert!(
        matches!(late, Outcome::Skipped(SkipReason::StaleTick { .. })),
        "{late:?}"
    );
    assert!(b.runs.lock().unwrap().is_empty());
    // Due within the clock tolerance (1 s) of the gain: run.
    assert!(tick(&mut b, gain).await.ran());
    assert_eq!(*b.runs.lock().unwrap(), vec![(gain, false)]);
    let missed = Some("missed: not run when due");
    let got = rows(&db.admin, &job).await;
    let base = (before - 10) as i64 - t0() as i64;
    let mut want = vec![row(base, "ran", None, 5)];
    for t in before - 9..gain {
        want.push(row(t as i64 - t0() as i64, "skipped", missed, 7));
    }
    want.push(row(gain as i64 - t0() as i64, "ran", None, 7));
    assert_eq!(got, want);
}

fn every_second() -> Schedule {
    "* * * * * *".parse().unwrap()
}

/// Waits until the job's run of `tick` has started.
async fn started(node: &Node, tick: u64) {
    for _ in 0..200 {
        if node.runs.lock().unwrap().iter().any(|(t, _)| *t == tick) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("the run of {tick} did not start");
}

/// Ticks `at` on a clone of the node's service, in a task of its own.
fn tick_in_background(node: &Node, at: u64) -> tokio::task::JoinHandle<Outcome<()>> {
    let mut svc = node.svc.clone();
    tokio::spawn(async move {
        svc.ready()
            .await
            .unwrap()
            .call(Task::new(Tick::new(at)))
            .await
            .unwrap()
    })
}

// A tick due while the previous run still runs on this node, under each overlap
// policy; and a run past max_runtime. Every tick ends with one row saying what
// happened to it.
#[tokio::test]
async fn overlap_policies_and_max_runtime_record_what_they_did() {
    let db = db().await;
    let slow = Duration::from_secs(3);
    let settle = Duration::from_millis(200);

    // Skip: the tick due during the run is recorded skipped.
    let job = unique_name("ledger-overlap-skip");
    let mut a = node_with(&db, &job, "node-a", 5, false, |l| {
        l.schedule(every_second()).overlap(Overlap::Skip)
    });
    a.delays.lock().unwrap().push((t0(), slow));
    let first = tick_in_background(&a, t0());
    started(&a, t0()).await;
    let out = tick(&mut a, t0() + 1).await;
    assert!(
        matches!(out, Outcome::Skipped(SkipReason::Overlap { .. })),
        "{out:?}"
    );
    assert!(first.await.unwrap().ran());
    let running = Some("previous run still running");
    assert_eq!(
        rows(&db.admin, &job).await,
        vec![row(0, "ran", None, 5), row(1, "skipped", running, 5)]
    );

    // Buffer: one tick waits and runs after; a second one is skipped.
    let job = unique_name("ledger-overlap-buffer");
    let mut a = node_with(&db, &job, "node-a", 5, false, |l| {
        l.schedule(every_second()).overlap(Overlap::Buffer)
    });
    a.delays.lock().unwrap().push((t0(), slow));
    let first = tick_in_background(&a, t0());
    started(&a, t0()).await;
    let second = tick_in_background(&a, t0() + 1);
    tokio::time::sleep(settle).await;
    let out = tick(&mut a, t0() + 2).await;
    assert!(
        matches!(out, Outcome::Skipped(SkipReason::Overlap { .. })),
        "{out:?}"
    );
    assert!(first.await.unwrap().ran());
    assert!(second.await.unwrap().ran());
    assert_eq!(
        *a.runs.lock().unwrap(),
        vec![(t0(), false), (t0() + 1, false)]
    );
    // The third was left to the misfire policy (Skip here): the next tick records it.
    assert_eq!(
        rows(&db.admin, &job).await,
        vec![row(0, "ran", None, 5), row(1, "ran", None, 5)]
    );
    assert!(tick(&mut a, t0() + 3).await.ran());
    assert_eq!(
        rows(&db.admin, &job).await,
        vec![
            row(0, "ran", None, 5),
            row(1, "ran", None, 5),
            row(2, "skipped", Some("missed: not run when due"), 5),
            row(3, "ran", None, 5)
        ]
    );

    // CancelPrevious, with the claim in the job's transaction: the slow run is
    // stopped, its write rolled back, and the tick recorded cancelled.
    let job = unique_name("ledger-overlap-cancel");
    let mut a = node_with(&db, &job, "node-a", 5, true, |l| {
        l.schedule(every_second())
            .overlap(Overlap::CancelPrevious)
            .claim(Claim::InJobTransaction)
    });
    a.delays
        .lock()
        .unwrap()
        .push((t0(), Duration::from_secs(60)));
    let first = tick_in_background(&a, t0());
    started(&a, t0()).await;
    assert!(tick(&mut a, t0() + 1).await.ran());
    let out = first.await.unwrap();
    assert!(
        matches!(out, Outcome::Skipped(SkipReason::Cancelled { .. })),
        "{out:?}"
    );
    assert_eq!(
        rows(&db.admin, &job).await,
        vec![
            row(0, "cancelled", Some("a newer tick is due"), 5),
            row(1, "ran", None, 5)
        ]
    );
    let witness: Vec<i64> = db
        .admin
        .query("SELECT tick FROM witness WHERE job = $1", &[&job])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get::<_, i64>(0) - t0() as i64)
        .collect();
    assert_eq!(witness, vec![1], "the cancelled run's write rolled back");

    // max_runtime: a run past it is stopped and recorded.
    let job = unique_name("ledger-max-runtime");
    let mut a = node_with(&db, &job, "node-a", 5, false, |l| {
        l.schedule(every_second())
            .max_runtime(Duration::from_millis(300))
    });
    a.delays
        .lock()
        .unwrap()
        .push((t0(), Duration::from_secs(60)));
    let out = tick(&mut a, t0()).await;
    assert!(
        matches!(out, Outcome::Skipped(SkipReason::Cancelled { .. })),
        "{out:?}"
    );
    assert_eq!(
        rows(&db.admin, &job).await,
        vec![row(
            0,
            "cancelled",
            Some("ran longer than max_runtime (300ms)"),
            5
        )]
    );
    assert_eq!(a.layer.stats().cancelled(), 1);
}

// A graceful stop while a tick waits behind a slow run (Overlap::Buffer), in a real
// apalis worker: the worker stops. (apalis' lifecycle service, inside the gate, is
// never ready again once its worker shuts down; a gate that kept waiting for it
// hung the stop: found by the witness run.)
#[tokio::test]
async fn a_graceful_stop_does_not_hang_behind_a_waiting_tick() {
    use apalis_core::monitor::Monitor;
    use chosen_apalis::cron_worker;

    async fn slow(_tick: Tick) -> Result<(), BoxDynError> {
        tokio::time::sleep(Duration::from_millis(2500)).await;
        Ok(())
    }

    let db = db().await;
    let job = unique_name("ledger-stop");
    let (leadership, control) = Leadership::manual(&job, "node-a");
    control.lead(5);
    let gate = LeaderOnlyJobLayer::new(leadership)
        .ledger(db.ledger.clone())
        .overlap(Overlap::Buffer);
    let stats = gate.stats();
    let stop = Arc::new(tokio::sync::Notify::new());
    let monitor = {
        let stop = Arc::clone(&stop);
        tokio::spawn(
            Monitor::new()
                .register(move |_| cron_worker("stop", every_second(), gate.clone()).build(slow))
                .run_with_signal(async move {
                    stop.notified().await;
                    Ok(())
                }),
        )
    };
    // A run is under way and the next tick waits for it.
    for _ in 0..100 {
        if stats.ran() >= 1 && stats.skipped_overlap() >= 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        stats.ran() >= 1 && stats.skipped_overlap() >= 1,
        "{stats:?}"
    );
    stop.notify_one();
    tokio::time::timeout(Duration::from_secs(15), monitor)
        .await
        .expect("the worker stops within 15 s")
        .unwrap()
        .unwrap();
}

// Review finding: two cron jobs gated by one leadership recorded their ticks under the
// leadership's name, so the second job's every tick was "already recorded" and never
// ran. Each job named with `job` has its own rows, `lock/name`.
#[tokio::test]
async fn two_jobs_of_one_leadership_each_run_every_tick() {
    let db = db().await;
    let lock = unique_name("ledger-shared-lock");
    let (leadership, control) = Leadership::manual(&lock, "node-a");
    control.lead(3);
    let every_second = "* * * * * *".parse::<Schedule>().unwrap();
    let mut jobs = Vec::new();
    for name in ["first", "second"] {
        let layer = LeaderOnlyJobLayer::new(leadership.clone())
            .ledger(db.ledger.clone())
            .schedule(every_second.clone())
            .job(name);
        let runs = Runs::default();
        let svc = layer.layer(Job {
            runs: Arc::clone(&runs),
            pool: None,
            delays: Delays::default(),
            ids: Ids::default(),
        });
        jobs.push((svc, runs, format!("{lock}/{name}")));
    }
    for t in t0()..t0() + 3 {
        for (svc, ..) in &mut jobs {
            let out = svc
                .ready()
                .await
                .unwrap()
                .call(Task::new(Tick::new(t)))
                .await;
            assert!(out.unwrap().ran(), "tick {t}");
        }
    }
    for (_, runs, job) in &jobs {
        assert_eq!(runs.lock().unwrap().len(), 3, "{job}");
        assert_eq!(rows(&db.admin, job).await.len(), 3, "{job}");
    }
    // The leadership's own name has no rows.
    assert!(rows(&db.admin, &lock).await.is_empty());
}

// Review finding: only ticks after the newest row counted as missed, so a hole below
// it (a run stopped and left unrecorded while a later tick was recorded, e.g. by an
// overlap policy; a claim that failed) was neither run nor recorded. Every hole after
// the job's first row is decided.
#[tokio::test]
async fn a_hole_below_the_newest_row_is_decided() {
    let db = db().await;
    for (misfire, outcome) in [
        (Misfire::Skip, "skipped"),
        (
            Misfire::CatchUp {
                max: 10,
                within: Duration::from_secs(60),
            },
            "ran",
        ),
    ] {
        let job = unique_name("ledger-hole");
        let mut a = node(
            &db,
            &job,
            "node-a",
            5,
            misfire,
            Claim::InJobTransaction,
            true,
        );
        assert!(tick(&mut a, t0()).await.ran());
        // T0+3 recorded (as an overlap skip would be), T0+1 and T0+2 not.
        db.admin
            .execute(
                "INSERT INTO chosen_ticks (job, tick, token, outcome, reason, node, started_at) VALUES ($1, to_timestamp($2), 5, 'skipped', 'previous run still running', 'node-a', now())",
                &[&job, &((t0() + 3) as f64)],
            )
            .await
            .unwrap();
        assert!(tick(&mut a, t0() + 4).await.ran());
        let got: Vec<(i64, String)> = rows(&db.admin, &job)
            .await
            .into_iter()
            .map(|(t, o, ..)| (t, o))
            .collect();
        assert_eq!(
            got,
            vec![
                (0, "ran".to_owned()),
                (1, outcome.to_owned()),
                (2, outcome.to_owned()),
                (3, "skipped".to_owned()),
                (4, "ran".to_owned()),
            ],
            "{misfire:?}"
        );
    }
}

// Review finding: the gate's ledger statements had no bound, so a leader frozen inside
// its transaction (holding the job's fence row) held up the next leader's claim for as
// long as its session lived, the turn with it, and every tick after. A claim now gives
// up after the ledger's timeout: the tick is skipped as a ledger failure and left
// unrecorded, and the next tick decides about it.
#[tokio::test]
async fn a_fence_row_held_by_a_frozen_session_bounds_the_wait() {
    let db = db().await;
    for claim in [Claim::BeforeRun, Claim::InJobTransaction] {
        let job = unique_name("ledger-held");
        // A short timeout for this node's ledger.
        let (leadership, control) = Leadership::manual(&job, "node-a");
        control.lead(5);
        let layer = LeaderOnlyJobLayer::new(leadership)
            .ledger(db.ledger.clone().timeout(Duration::from_secs(1)))
            .claim(claim)
            .schedule("* * * * * *".parse().unwrap());
        let (runs, delays, ids) = (Runs::default(), Delays::default(), Ids::default());
        let svc = layer.layer(Job {
            runs: Arc::clone(&runs),
            pool: Some(db.pool.clone()),
            delays: Arc::clone(&delays),
            ids: Arc::clone(&ids),
        });
        let mut a = Node {
            svc,
            control,
            layer,
            runs,
            delays,
            ids,
        };
        assert!(tick(&mut a, t0()).await.ran(), "{claim:?}");
        // Another session holds the fence row, inside a transaction it never ends.
        let (mut frozen, conn) = tokio_postgres::connect(&db.url, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(conn);
        let tx = frozen.transaction().await.unwrap();
        tx.execute(
            "SELECT 1 FROM chosen_fence WHERE name = $1 FOR UPDATE",
            &[&job],
        )
        .await
        .unwrap();
        let started = std::time::Instant::now();
        let out = tokio::time::timeout(Duration::from_secs(30), try_tick(&mut a, t0() + 1))
            .await
            .expect("a held fence row does not hang the gate");
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{claim:?}: {:?}",
            started.elapsed()
        );
        match claim {
            Claim::BeforeRun => assert!(
                matches!(out, Ok(Outcome::Skipped(SkipReason::Ledger { .. }))),
                "{claim:?}: {out:?}"
            ),
            // The job's own transaction gave up: the job failed, the tick is left
            // unrecorded.
            _ => assert!(out.is_err(), "{claim:?}: {out:?}"),
        }
        tx.rollback().await.unwrap();
        // The next tick decides about the one left over (Skip: recorded as missed).
        assert!(tick(&mut a, t0() + 2).await.ran(), "{claim:?}");
        let got: Vec<(i64, String)> = rows(&db.admin, &job)
            .await
            .into_iter()
            .map(|(t, o, ..)| (t, o))
            .collect();
        assert_eq!(
            got,
            vec![
                (0, "ran".to_owned()),
                (1, "skipped".to_owned()),
                (2, "ran".to_owned())
            ],
            "{claim:?}"
        );
    }
}

// Review finding: a gap longer than the ticks looked at (1000) left its older ticks
// without any record. The oldest tick looked at says so in its reason.
#[tokio::test]
async fn a_gap_longer_than_the_look_is_marked() {
    let db = db().await;
    let job = unique_name("ledger-long-gap");
    let mut a = node(
        &db,
        &job,
        "node-a",
        5,
        Misfire::Skip,
        Claim::BeforeRun,
        false,
    );
    assert!(tick(&mut a, t0()).await.ran());
    assert!(tick(&mut a, t0() + 1500).await.ran());
    let got = rows(&db.admin, &job).await;
    assert_eq!(got.len(), 1 + 1000 + 1);
    let oldest = &got[1];
    assert_eq!(oldest.0, 500);
    assert_eq!(
        oldest.2.as_deref(),
        Some(
            "missed: not run when due; older ticks were not looked at (a gap of more than 1000 ticks)"
        )
    );
    assert_eq!(got[2].2.as_deref(), Some("missed: not run when due"));
}

// ---------------------------------------------------------------------------------
// Attempts to break the ledger as of 64ac650: job keys, a stop during a catch-up,
// panics, the job's lock waits, long timeouts, failures, duplicates, schedule changes,
// counters.
// ---------------------------------------------------------------------------------

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// `(tick - T0)` of every tick with more than one witness row among `jobs`.
async fn ticks_run_twice(admin: &Client, jobs: &[String]) -> Vec<i64> {
    admin
        .query(
            "SELECT tick FROM witness WHERE job = ANY($1) GROUP BY tick HAVING count(*) > 1 ORDER BY tick",
            &[&jobs],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get::<_, i64>(0) - t0() as i64)
        .collect()
}

// R1. The job's key defaulted to the worker's name, and examples/apalis_cron.rs names
// its workers per node (`report-{i}`): each node had its own rows and its own fence,
// and a node that led again "caught up" every tick the other node ran. The key is the
// lock's name now, whatever the worker is called (`.job` names a job under its lock,
// the same on every node).
#[tokio::test]
async fn per_node_worker_names_do_not_run_a_tick_twice() {
    let db = db().await;
    let lock = unique_name("ledger-per-node");
    let policy = Misfire::CatchUp {
        max: 10,
        within: Duration::from_secs(60),
    };
    let mk = |id: &str, token: u64| {
        node_with(&db, &lock, id, token, true, move |l| {
            l.schedule(every_second())
                .misfire(policy)
                .claim(Claim::InJobTransaction)
        })
    };
    let mut b = mk("node-b", 5);
    assert!(tick(&mut b, t0()).await.ran());
    b.control.follow(Some("node-a"));
    let mut a = mk("node-a", 7);
    for t in t0() + 1..t0() + 5 {
        assert!(tick(&mut a, t).await.ran());
    }
    a.control.follow(Some("node-b"));
    b.control.lead(9);
    assert!(tick(&mut b, t0() + 5).await.ran());
    let jobs = vec![lock.clone()];
    let twice = ticks_run_twice(&db.admin, &jobs).await;
    assert!(
        twice.is_empty(),
        "ticks run twice: {twice:?}; node-b ran {:?}",
        b.runs.lock().unwrap()
    );
}

// R1b. Worker names are not unique across leaderships: two services, each with its
// own lock, both naming their cron worker "cleanup", now share rows and a fence.
#[tokio::test]
async fn jobs_of_one_name_under_two_leaderships_each_run() {
    let db = db().await;
    let name = unique_name("cleanup");
    let mut x = node_with(&db, &unique_name("svc-x"), "node-1", 9, false, |l| {
        l.schedule(every_second()).job(&name)
    });
    let mut y = node_with(&db, &unique_name("svc-y"), "node-1", 5, false, |l| {
        l.schedule(every_second()).job(&name)
    });
    assert!(tick(&mut x, t0()).await.ran());
    let out = tick(&mut y, t0()).await;
    assert!(out.ran(), "svc-y's tick t0(): {out:?}");
    let out = tick(&mut y, t0() + 1).await;
    assert!(out.ran(), "svc-y's tick t0()+1: {out:?}");
}

// R2. A catch-up on gaining leadership before this node's scheduler delivered any tick
// runs from a task with no WorkerContext. If the worker is asked to stop while such a
// catch-up holds the turn and a delivered tick waits for it, the next catch-up waits
// for apalis' lifecycle service to be ready (never, once stopping), the waiting tick
// waits for the turn, and the worker waits for the tick: the stop hangs.
#[tokio::test]
async fn a_graceful_stop_during_a_catch_up_on_gain_does_not_hang() {
    use apalis_core::monitor::Monitor;
    use chosen_apalis::cron_worker;

    async fn slow(_tick: Tick) -> Result<(), BoxDynError> {
        tokio::time::sleep(Duration::from_secs(12)).await;
        Ok(())
    }

    let db = db().await;
    let job = unique_name("ledger-gain-stop");
    let now = unix_now();
    // Two ticks 8 and 7 s ago (missed), the next 8 s away: the gate catches up at once.
    let mut secs = [(now - 8) % 60, (now - 7) % 60, (now + 8) % 60];
    secs.sort_unstable();
    let schedule: Schedule = format!("{},{},{} * * * * *", secs[0], secs[1], secs[2])
        .parse()
        .unwrap();
    // The job's first row, 30 s ago, under this schedule (a row with no schedule off
    // its ticks would be another schedule's: nothing before the next row is missed).
    db.admin
        .execute(
            "INSERT INTO chosen_ticks (job, tick, token, outcome, node, started_at, schedule) VALUES ($1, to_timestamp($2), 5, 'ran', 'node-a', now(), $3)",
            &[&job, &((now - 30) as f64), &schedule.source()],
        )
        .await
        .unwrap();
    let (leadership, control) = Leadership::manual(&job, "node-a");
    control.lead(5);
    let gate = LeaderOnlyJobLayer::new(leadership)
        .ledger(db.ledger.clone())
        .misfire(Misfire::CatchUp {
            max: 5,
            within: Duration::from_secs(60),
        });
    let stats = gate.stats();
    let stop = Arc::new(tokio::sync::Notify::new());
    let monitor = {
        let (stop, job) = (Arc::clone(&stop), job.clone());
        tokio::spawn(
            Monitor::new()
                .register(move |_| cron_worker(&job, schedule.clone(), gate.clone()).build(slow))
                .run_with_signal(async move {
                    stop.notified().await;
                    Ok(())
                }),
        )
    };
    for _ in 0..50 {
        if stats.caught_up() >= 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(stats.caught_up(), 1, "{stats:?}");
    // The tick due at now+8 has reached the gate and waits behind the catch-up.
    while unix_now() < now + 10 {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop.notify_one();
    tokio::time::timeout(Duration::from_secs(25), monitor)
        .await
        .expect("the worker stops within 25 s")
        .unwrap()
        .unwrap();
}

// R3. A run that panicked left its tick unrecorded (Claim::InJobTransaction): every
// later tick first "caught up" that tick again, panicked again, and never ran itself
// (until the tick aged out of the catch-up window). The gate catches the panic now,
// records the tick `failed` with the message, and goes on.
#[tokio::test]
async fn a_panicking_run_does_not_block_every_later_tick() {
    let db = db().await;
    let job = unique_name("ledger-panic");
    let calls = Arc::new(Mutex::new(Vec::new()));
    let job_fn = {
        let (calls, pool) = (Arc::clone(&calls), db.pool.clone());
        tower::service_fn(move |task: Task<Tick>| {
            let (calls, pool) = (Arc::clone(&calls), pool.clone());
            async move {
                let t = task.args.get_timestamp();
                calls.lock().unwrap().push(t - t0());
                assert_ne!(t, t0() + 1, "the job panics on t0()+1");
                let ctx = task.ctx().data().get::<TickContext>().cloned().unwrap();
                let mut client = pool.get().await?;
                if let Some(tx) = ctx.begin(&mut client).await? {
                    tx.commit().await?;
                }
                Ok::<(), BoxDynError>(())
            }
        })
    };
    let (leadership, control) = Leadership::manual(&job, "node-a");
    control.lead(5);
    let svc = LeaderOnlyJobLayer::new(leadership)
        .ledger(db.ledger.clone())
        .claim(Claim::InJobTransaction)
        .misfire(Misfire::CatchUp {
            max: 10,
            within: Duration::from_secs(60),
        })
        .schedule(every_second())
        .layer(job_fn);
    let run = |t: u64| {
        let mut svc = svc.clone();
        tokio::spawn(async move { svc.ready().await?.call(Task::new(Tick::new(t))).await })
    };
    assert!(run(t0()).await.unwrap().unwrap().ran());
    let out = run(t0() + 1).await.unwrap().unwrap();
    assert!(
        matches!(&out, Outcome::Skipped(SkipReason::Panicked { message, .. }) if message.contains("the job panics on t0()+1")),
        "{out:?}"
    );
    let out = run(t0() + 2).await;
    assert!(
        matches!(&out, Ok(Ok(o)) if o.ran()),
        "the tick at hand: {out:?}; calls {:?}",
        calls.lock().unwrap()
    );
    assert_eq!(*calls.lock().unwrap(), vec![0, 1, 2]);
    let got = rows(&db.admin, &job).await;
    assert_eq!(got[1].1, "failed", "{got:?}");
    assert!(
        got[1].2.as_deref().is_some_and(
            |r| r.starts_with("the run panicked: ") && r.contains("the job panics on t0()+1")
        ),
        "{got:?}"
    );
}

// R4. `TickContext::begin` sets `lock_timeout` for the whole of the job's transaction,
// so the job's own statements may no longer wait for a lock longer than the ledger's
// timeout: a job that waits 3 s for its own table fails, and is recorded `failed`
// (never run again).
#[tokio::test]
async fn the_job_s_own_statements_keep_their_lock_waits() {
    let db = db().await;
    let job = unique_name("ledger-job-lock");
    db.admin
        .batch_execute("CREATE TABLE IF NOT EXISTS busy (id int)")
        .await
        .unwrap();
    let job_fn = {
        let pool = db.pool.clone();
        tower::service_fn(move |task: Task<Tick>| {
            let pool = pool.clone();
            async move {
                let ctx = task.ctx().data().get::<TickContext>().cloned().unwrap();
                let mut client = pool.get().await?;
                let Some(tx) = ctx.begin(&mut client).await? else {
                    return Ok(());
                };
                tx.batch_execute("LOCK TABLE busy IN EXCLUSIVE MODE")
                    .await?;
                tx.commit().await?;
                Ok::<(), BoxDynError>(())
            }
        })
    };
    let (leadership, control) = Leadership::manual(&job, "node-a");
    control.lead(5);
    let mut svc = LeaderOnlyJobLayer::new(leadership)
        .ledger(db.ledger.clone().timeout(Duration::from_secs(1)))
        .claim(Claim::InJobTransaction)
        .schedule(every_second())
        .layer(job_fn);
    // Another session (a nightly batch, say) holds the job's table for 3 s.
    let (other, conn) = tokio_postgres::connect(&db.url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    other
        .batch_execute("BEGIN; LOCK TABLE busy IN EXCLUSIVE MODE")
        .await
        .unwrap();
    let release = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(3)).await;
        other.batch_execute("COMMIT").await.unwrap();
    });
    let out = svc
        .ready()
        .await
        .unwrap()
        .call(Task::new(Tick::new(t0())))
        .await;
    release.await.unwrap();
    assert!(
        matches!(&out, Ok(o) if o.ran()),
        "{out:?}; rows {:?}",
        rows(&db.admin, &job).await
    );
    assert_eq!(rows(&db.admin, &job).await, vec![row(0, "ran", None, 5)]);
}

// R5. A long timeout: past 2^31 ms the server refuses the SET LOCAL (every ledger
// operation fails, every tick is skipped); Duration::MAX ("no limit") overflows
// `timeout + CLIENT_MARGIN` and panics inside the gate.
#[tokio::test]
async fn a_long_ledger_timeout_is_usable() {
    let db = db().await;
    for timeout in [Duration::MAX, Duration::from_secs(30 * 86_400)] {
        let job = unique_name("ledger-long-timeout");
        let (leadership, control) = Leadership::manual(&job, "node-a");
        control.lead(5);
        let mut svc = LeaderOnlyJobLayer::new(leadership)
            .ledger(db.ledger.clone().timeout(timeout))
            .schedule(every_second())
            .layer(Job {
                runs: Runs::default(),
                pool: None,
                delays: Delays::default(),
                ids: Ids::default(),
            });
        let out = tokio::spawn(async move {
            svc.ready()
                .await
                .unwrap()
                .call(Task::new(Tick::new(t0())))
                .await
                .unwrap()
        })
        .await;
        assert!(matches!(&out, Ok(o) if o.ran()), "{timeout:?}: {out:?}");
    }
}

// R6. A job error with a NUL character cannot be stored in `reason`: the `failed` row
// is never written, the tick stays a hole, and CatchUp runs the failed tick again at
// every later tick ("failed: not run again" does not hold).
#[tokio::test]
async fn a_failure_with_a_nul_in_its_message_is_recorded_once() {
    let db = db().await;
    let job = unique_name("ledger-nul");
    let calls = Arc::new(Mutex::new(Vec::new()));
    let job_fn = {
        let calls = Arc::clone(&calls);
        tower::service_fn(move |task: Task<Tick>| {
            let calls = Arc::clone(&calls);
            async move {
                let t = task.args.get_timestamp();
                calls.lock().unwrap().push(t - t0());
                if t == t0() + 1 {
                    return Err::<(), BoxDynError>("bad input: \0 in a field".into());
                }
                Ok(())
            }
        })
    };
    let (leadership, control) = Leadership::manual(&job, "node-a");
    control.lead(5);
    let mut svc = LeaderOnlyJobLayer::new(leadership)
        .ledger(db.ledger.clone())
        .claim(Claim::InJobTransaction)
        .misfire(Misfire::CatchUp {
            max: 10,
            within: Duration::from_secs(60),
        })
        .schedule(every_second())
        .layer(job_fn);
    for t in t0()..t0() + 4 {
        let _ = svc
            .ready()
            .await
            .unwrap()
            .call(Task::new(Tick::new(t)))
            .await;
    }
    assert_eq!(*calls.lock().unwrap(), vec![0, 1, 2, 3], "t0()+1 runs once");
    let outcomes: Vec<(i64, String)> = rows(&db.admin, &job)
        .await
        .into_iter()
        .map(|(t, o, ..)| (t, o))
        .collect();
    assert!(outcomes.contains(&(1, "failed".to_owned())), "{outcomes:?}");
}

// R7. Overlap::CancelPrevious cancels the running tick when the *same* tick is
// delivered again (a second scheduler on the node, a retry), records it `cancelled`,
// "a newer tick is due", and the duplicate then finds it recorded: the tick never runs.
#[tokio::test]
async fn a_duplicate_delivery_does_not_cancel_the_tick_it_duplicates() {
    let db = db().await;
    let job = unique_name("ledger-dup-cancel");
    let mut a = node_with(&db, &job, "node-a", 5, true, |l| {
        l.schedule(every_second())
            .overlap(Overlap::CancelPrevious)
            .claim(Claim::InJobTransaction)
            .misfire(Misfire::CatchUp {
                max: 10,
                within: Duration::from_secs(60),
            })
    });
    a.delays
        .lock()
        .unwrap()
        .push((t0(), Duration::from_secs(2)));
    let first = tick_in_background(&a, t0());
    started(&a, t0()).await;
    let second = tick(&mut a, t0()).await;
    let first = first.await.unwrap();
    let witness: Vec<i64> = db
        .admin
        .query("SELECT tick FROM witness WHERE job = $1", &[&job])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get::<_, i64>(0) - t0() as i64)
        .collect();
    assert_eq!(
        witness,
        vec![0],
        "first {first:?}, second {second:?}, rows {:?}",
        rows(&db.admin, &job).await
    );
}

// R8. Changing a job's schedule (hourly -> every 15 min) makes every new-schedule tick
// since the job's first row a "hole": the next tick runs catch-ups of ticks that were
// never scheduled (before this commit only ticks after the newest row counted).
#[tokio::test]
async fn a_schedule_change_after_a_quiet_spell_does_not_replay_history() {
    // An hourly job last ran two days ago; it comes back as a per-minute job. No
    // per-minute tick before its first row was ever due under a deployed schedule: none
    // is missed, none caught up, on gaining leadership or at the first tick.
    let db = db().await;
    let job = unique_name("ledger-reschedule");
    // Seconds 10 to 50 of a minute: the minute's tick is at least 10 s old and the next
    // at least 10 s away (a minute tick in between would rightly be caught up).
    let mut now = db_now(&db.admin).await;
    while !(10..50).contains(&(now % 60)) {
        tokio::time::sleep(Duration::from_millis(500)).await;
        now = db_now(&db.admin).await;
    }
    let hour = now / 3600 * 3600 - 2 * 86_400;
    for t in [hour - 3600, hour] {
        db.admin
            .execute(
                "INSERT INTO chosen_ticks (job, tick, token, outcome, node, started_at, schedule) VALUES ($1, to_timestamp($2), 5, 'ran', 'node-a', now(), '0 0 * * * *')",
                &[&job, &(t as f64)],
            )
            .await
            .unwrap();
    }
    let policy = Misfire::CatchUp {
        max: 1000,
        within: Duration::from_secs(6 * 3600),
    };
    let minutely: Schedule = "0 * * * * *".parse().unwrap();
    let mut b = node_on(
        &db,
        &job,
        "node-b",
        7,
        (policy, Claim::BeforeRun, minutely),
        false,
    );
    let minute = now / 60 * 60;
    assert!(tick(&mut b, minute).await.ran());
    // The catch-up on gaining leadership has decided by now (it waits 5 s at most).
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(
        *b.runs.lock().unwrap(),
        vec![(minute, false)],
        "ticks of the new schedule before the change were never due"
    );
    let recorded: i64 = db
        .admin
        .query_one("SELECT count(*) FROM chosen_ticks WHERE job = $1", &[&job])
        .await
        .unwrap()
        .get(0);
    assert_eq!(recorded, 3, "nothing recorded as missed");
}

// R10. Counters: with the claim in the job's transaction, a tick another gate already
// recorded is counted both `ran` and `skipped_already_recorded`.
#[tokio::test]
async fn a_tick_is_counted_once() {
    let db = db().await;
    let job = unique_name("ledger-count");
    let mut a = node(
        &db,
        &job,
        "node-a",
        5,
        Misfire::Skip,
        Claim::InJobTransaction,
        true,
    );
    let mut b = node(
        &db,
        &job,
        "node-b",
        5,
        Misfire::Skip,
        Claim::InJobTransaction,
        true,
    );
    assert!(tick(&mut a, t0()).await.ran());
    assert!(!tick(&mut b, t0()).await.ran());
    let s = b.layer.stats();
    assert_eq!((s.ran(), s.skipped_already_recorded()), (0, 1), "{s:?}");
}

// ---------------------------------------------------------------------------------
// Attempts to break the ledger as of 4470b6f: jobs sharing a layer or a fence, retried
// begins, schedule spellings, old tables, clock steps, installs, fence names.
// ---------------------------------------------------------------------------------

fn quiet_job(runs: &Runs) -> Job {
    Job {
        runs: Arc::clone(runs),
        pool: None,
        delays: Delays::default(),
        ids: Ids::default(),
    }
}

// N1. Two jobs named with `.job` on clones of one ledgered layer share its `Turn`, so
// the monotonic `latest` of one job refuses the other job's tick of the same second
// ("the same tick, or a later one, already reached the gate"): it is neither run nor
// recorded, and its fill_gap never runs either.
#[tokio::test]
async fn jobs_named_on_clones_of_one_layer_each_run_every_tick() {
    let db = db().await;
    let lock = unique_name("ledger-cloned-jobs");
    let (leadership, control) = Leadership::manual(&lock, "node-a");
    control.lead(3);
    let base = LeaderOnlyJobLayer::new(leadership)
        .ledger(db.ledger.clone())
        .schedule(every_second());
    let mut jobs = Vec::new();
    for name in ["first", "second"] {
        let runs = Runs::default();
        let svc = base.clone().job(name).layer(quiet_job(&runs));
        jobs.push((svc, runs, format!("{lock}/{name}")));
    }
    for t in t0()..t0() + 3 {
        for (svc, _, job) in &mut jobs {
            let out = svc
                .ready()
                .await
                .unwrap()
                .call(Task::new(Tick::new(t)))
                .await
                .unwrap();
            assert!(out.ran(), "{job}, tick {t}: {out:?}");
        }
    }
}

// N2. The fence is keyed by the lock, so every ledgered job of one leadership shares
// one fence row: a job whose ledger transaction stays open longer than the ledger's
// timeout makes every other job of the lock fail its claim meanwhile (here a
// BeforeRun job: Skipped(Ledger), its tick not run).
#[tokio::test]
async fn a_long_ledger_transaction_of_one_job_does_not_stop_another_job() {
    let db = db().await;
    let lock = unique_name("ledger-shared-fence");
    let (leadership, control) = Leadership::manual(&lock, "node-a");
    control.lead(3);
    // The slow job works 5 s inside its transaction: it raises the idle bound.
    let ledger = db
        .ledger
        .clone()
        .timeout(Duration::from_secs(1))
        .idle_in_transaction(Duration::from_secs(30));
    let (slow_runs, slow_delays) = (Runs::default(), Delays::default());
    slow_delays
        .lock()
        .unwrap()
        .push((t0(), Duration::from_secs(3)));
    let slow = LeaderOnlyJobLayer::new(leadership.clone())
        .ledger(ledger.clone())
        .schedule(every_second())
        .claim(Claim::InJobTransaction)
        .job("slow")
        .layer(Job {
            runs: Arc::clone(&slow_runs),
            pool: Some(db.pool.clone()),
            delays: slow_delays,
            ids: Ids::default(),
        });
    let quick_runs = Runs::default();
    let mut quick = LeaderOnlyJobLayer::new(leadership)
        .ledger(ledger)
        .schedule(every_second())
        .job("quick")
        .layer(quiet_job(&quick_runs));
    let first = {
        let mut slow = slow.clone();
        tokio::spawn(async move {
            slow.ready()
                .await
                .unwrap()
                .call(Task::new(Tick::new(t0())))
                .await
        })
    };
    // The slow job is inside its ledger transaction (fenced, then sleeping 3 s).
    for _ in 0..100 {
        if !slow_runs.lock().unwrap().is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let out = quick
        .ready()
        .await
        .unwrap()
        .call(Task::new(Tick::new(t0())))
        .await
        .unwrap();
    assert!(first.await.unwrap().unwrap().ran());
    assert!(out.ran(), "the quick job's tick: {out:?}");
}

// N3. `Slot::Failed` is sticky: a job whose first `begin` fails (a dead cached
// connection; or an apalis retry layer inside the gate re-running the job after a
// transient ledger timeout) and whose retried `begin` succeeds, and which then fails
// for a reason of its own, is left unrecorded as if the ledger had failed: CatchUp
// runs the failed tick again at the next tick (and Skip would record it "missed: not
// run when due", though it ran).
#[tokio::test]
async fn a_job_failure_after_a_retried_begin_is_recorded_failed() {
    let db = db().await;
    let job = unique_name("ledger-sticky-failed");
    let calls = Arc::new(Mutex::new(Vec::new()));
    let job_fn = {
        let (calls, pool, url) = (Arc::clone(&calls), db.pool.clone(), db.url.clone());
        tower::service_fn(move |task: Task<Tick>| {
            let (calls, pool, url) = (Arc::clone(&calls), pool.clone(), url.clone());
            async move {
                let t = task.args.get_timestamp();
                calls.lock().unwrap().push(t - t0());
                let ctx = task.ctx().data().get::<TickContext>().cloned().unwrap();
                if t == t0() + 1 {
                    // A cached connection that has died: begin fails; reconnect.
                    let (mut dead, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
                        .await
                        .unwrap();
                    drop(conn);
                    assert!(ctx.begin(&mut dead).await.is_err());
                }
                let mut client = pool.get().await?;
                let Some(tx) = ctx.begin(&mut client).await? else {
                    return Ok(());
                };
                if t == t0() + 1 {
                    drop(tx);
                    return Err::<(), BoxDynError>("invoice 42 is invalid".into());
                }
                tx.commit().await?;
                Ok(())
            }
        })
    };
    let (leadership, control) = Leadership::manual(&job, "node-a");
    control.lead(5);
    let mut svc = LeaderOnlyJobLayer::new(leadership)
        .ledger(db.ledger.clone())
        .claim(Claim::InJobTransaction)
        .misfire(Misfire::CatchUp {
            max: 10,
            within: Duration::from_secs(60),
        })
        .schedule(every_second())
        .layer(job_fn);
    for t in t0()..t0() + 3 {
        let _ = svc
            .ready()
            .await
            .unwrap()
            .call(Task::new(Tick::new(t)))
            .await;
    }
    let recorded = rows(&db.admin, &job).await;
    assert_eq!(
        *calls.lock().unwrap(),
        vec![0, 1, 2],
        "a failed tick is not run again; rows {recorded:?}"
    );
}

// N4. The schedule column compares source texts: a node whose cron expression is
// spelled differently (same ticks) takes every row of the other spelling as "the
// schedule changed", and a hole below such a row is never decided (no row, ever).
#[tokio::test]
async fn a_differently_spelled_schedule_does_not_hide_a_hole() {
    let db = db().await;
    let job = unique_name("ledger-spelling");
    for (dt, outcome) in [(0, "ran"), (2, "ran")] {
        db.admin
            .execute(
                "INSERT INTO chosen_ticks (job, tick, token, outcome, node, started_at, schedule) VALUES ($1, to_timestamp($2), 5, $3, 'node-a', now(), '*/1 * * * * *')",
                &[&job, &((t0() + dt) as f64), &outcome],
            )
            .await
            .unwrap();
    }
    // Node B: the same schedule, spelled "* * * * * *"; T0+1 is a hole.
    let mut b = node(
        &db,
        &job,
        "node-b",
        7,
        Misfire::Skip,
        Claim::BeforeRun,
        false,
    );
    assert!(tick(&mut b, t0() + 3).await.ran());
    assert!(tick(&mut b, t0() + 4).await.ran());
    let got: Vec<(i64, String)> = rows(&db.admin, &job)
        .await
        .into_iter()
        .map(|(t, o, ..)| (t, o))
        .collect();
    assert!(
        got.iter().any(|(t, _)| *t == 1),
        "t0()+1 neither ran nor has a row: {got:?}"
    );
}

// N5. LEDGER_INSTALL_SQL gained a `schedule` column, but it says "Do not change:
// tables created by earlier versions must keep working": a table created by the
// previous version (64ac650) is left as it is by `install`, and every insert then
// fails (column "schedule" does not exist): no tick ever runs.
#[tokio::test]
async fn a_table_created_by_the_previous_version_keeps_working() {
    let db = db().await;
    db.admin
        .batch_execute(
            "CREATE TABLE old_ticks (\n    job         text        NOT NULL,\n    tick        timestamptz NOT NULL,\n    token       bigint      NOT NULL CHECK (token >= 0),\n    outcome     text        NOT NULL CHECK (outcome IN ('running', 'ran', 'skipped', 'failed', 'cancelled')),\n    reason      text,\n    node        text        NOT NULL,\n    started_at  timestamptz NOT NULL,\n    finished_at timestamptz,\n    PRIMARY KEY (job, tick)\n)",
        )
        .await
        .unwrap();
    let ledger = TickLedger::new(db.pool.clone())
        .table(chosen_apalis::LedgerTable::new("old_ticks").unwrap());
    ledger.install().await.unwrap();
    let job = unique_name("ledger-old-table");
    let (leadership, control) = Leadership::manual(&job, "node-a");
    control.lead(5);
    let runs = Runs::default();
    let mut svc = LeaderOnlyJobLayer::new(leadership)
        .ledger(ledger)
        .schedule(every_second())
        .layer(quiet_job(&runs));
    let out = svc
        .ready()
        .await
        .unwrap()
        .call(Task::new(Tick::new(t0())))
        .await
        .unwrap();
    assert!(out.ran(), "{out:?}");
}

// N6. A wall-clock step forward (NTP) then back: the scheduler delivers one tick from
// the future, and the monotonic `latest` then refuses every real tick until the clock
// passes it again; the refused ticks are not recorded and, being below the watermark
// `low` set by the future tick's look, are never decided (before 4470b6f they ran).
#[tokio::test]
async fn a_clock_step_forward_and_back_does_not_stop_the_job() {
    let db = db().await;
    let job = unique_name("ledger-clock-step");
    let mut a = node(
        &db,
        &job,
        "node-a",
        5,
        Misfire::Skip,
        Claim::BeforeRun,
        false,
    );
    assert!(tick(&mut a, t0()).await.ran());
    // The clock stepped 2 h forward for a moment: one tick from the future.
    assert!(tick(&mut a, t0() + 7200).await.ran());
    // Back to the right time: the next real ticks.
    let mut outs = Vec::new();
    for t in t0() + 1000..t0() + 1003 {
        outs.push(tick(&mut a, t).await);
    }
    let got: Vec<i64> = rows(&db.admin, &job)
        .await
        .into_iter()
        .map(|(t, ..)| t)
        .filter(|t| (1000..1003).contains(t))
        .collect();
    assert!(
        outs.iter().all(Outcome::ran) || got.len() == 3,
        "real ticks after the step neither ran nor were recorded: {outs:?}, rows {got:?}"
    );
}

// The ledger's bound on its own statements (`fence_bounded`) leaves a session-level
// lock_timeout in force for the job's statements.
#[tokio::test]
async fn the_job_s_statements_keep_a_session_lock_timeout() {
    let db = db().await;
    let job = unique_name("ledger-probe-lt");
    let seen = Arc::new(Mutex::new(None::<String>));
    let job_fn = {
        let (seen, pool) = (Arc::clone(&seen), db.pool.clone());
        tower::service_fn(move |task: Task<Tick>| {
            let (seen, pool) = (Arc::clone(&seen), pool.clone());
            async move {
                let ctx = task.ctx().data().get::<TickContext>().cloned().unwrap();
                let mut client = pool.get().await?;
                client.batch_execute("SET lock_timeout = '7s'").await?;
                let Some(tx) = ctx.begin(&mut client).await? else {
                    return Ok(());
                };
                let v: String = tx.query_one("SHOW lock_timeout", &[]).await?.get(0);
                *seen.lock().unwrap() = Some(v);
                tx.commit().await?;
                client.batch_execute("RESET lock_timeout").await?;
                Ok::<(), BoxDynError>(())
            }
        })
    };
    let (leadership, control) = Leadership::manual(&job, "node-a");
    control.lead(5);
    let mut svc = LeaderOnlyJobLayer::new(leadership)
        .ledger(db.ledger.clone().timeout(Duration::from_secs(1)))
        .claim(Claim::InJobTransaction)
        .schedule(every_second())
        .layer(job_fn);
    let out = svc
        .ready()
        .await
        .unwrap()
        .call(Task::new(Tick::new(t0())))
        .await;
    assert!(matches!(&out, Ok(o) if o.ran()), "{out:?}");
    assert_eq!(seen.lock().unwrap().as_deref(), Some("7s"));
    let plan: Vec<String> = db
        .admin
        .query(
            "EXPLAIN (VERBOSE, COSTS OFF) WITH p AS MATERIALIZED (SELECT current_setting('lock_timeout') AS v)\nSELECT p.v FROM p WHERE set_config('lock_timeout', '1000', true) IS NOT NULL",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    eprintln!("{}", plan.join("\n"));
}

// R3-1. `install()` now runs `ALTER TABLE … ADD COLUMN IF NOT EXISTS schedule`, which
// takes an ACCESS EXCLUSIVE lock on the ledger table even when the column exists. A
// node starting up (install at start-up, as documented) while a job is inside its
// InJobTransaction ledger transaction queues that lock behind the job's, and every
// other ledger statement of every node queues behind it: the leader's other jobs fail
// with Skipped(Ledger) until the long transaction ends, and install() itself waits
// that long (it has no timeout).
#[tokio::test]
async fn install_on_a_starting_node_does_not_stall_the_ledger() {
    let db = db().await;
    let lock = unique_name("ledger-install-stall");
    let (leadership, control) = Leadership::manual(&lock, "node-a");
    control.lead(3);
    // The slow job works 5 s inside its transaction: it raises the idle bound.
    let ledger = db
        .ledger
        .clone()
        .timeout(Duration::from_secs(1))
        .idle_in_transaction(Duration::from_secs(30));
    let (slow_runs, slow_delays) = (Runs::default(), Delays::default());
    slow_delays
        .lock()
        .unwrap()
        .push((t0(), Duration::from_secs(5)));
    let slow = LeaderOnlyJobLayer::new(leadership.clone())
        .ledger(ledger.clone())
        .schedule(every_second())
        .claim(Claim::InJobTransaction)
        .job("slow")
        .layer(Job {
            runs: Arc::clone(&slow_runs),
            pool: Some(db.pool.clone()),
            delays: slow_delays,
            ids: Ids::default(),
        });
    let quick_runs = Runs::default();
    let mut quick = LeaderOnlyJobLayer::new(leadership)
        .ledger(ledger)
        .schedule(every_second())
        .job("quick")
        .layer(quiet_job(&quick_runs));
    let first = {
        let mut slow = slow.clone();
        tokio::spawn(async move {
            slow.ready()
                .await
                .unwrap()
                .call(Task::new(Tick::new(t0())))
                .await
        })
    };
    // The slow job is inside its ledger transaction (its claim row inserted).
    for _ in 0..100 {
        if !slow_runs.lock().unwrap().is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Another node starts: install(), on its own pool.
    let other = {
        let config: tokio_postgres::Config = db.url.parse().unwrap();
        Pool::builder(deadpool_postgres::Manager::new(
            config,
            tokio_postgres::NoTls,
        ))
        .max_size(1)
        .build()
        .unwrap()
    };
    let started = std::time::Instant::now();
    let installing = tokio::spawn(async move { TickLedger::new(other).install().await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let out = quick
        .ready()
        .await
        .unwrap()
        .call(Task::new(Tick::new(t0())))
        .await
        .unwrap();
    installing.await.unwrap().unwrap();
    let install_took = started.elapsed();
    assert!(first.await.unwrap().unwrap().ran());
    assert!(
        out.ran(),
        "the quick job's tick while another node installs: {out:?} (install took {install_took:?})"
    );
    assert!(
        install_took < Duration::from_secs(2),
        "install waited {install_took:?} for a job's ledger transaction"
    );
}

// R3-2. The catch-up on gaining leadership holds the turn without an in-flight entry
// (`Turn::wait`), so under Overlap::CancelPrevious a duplicate delivery of the very
// tick it is catching up (or of any older tick) is taken for a newer tick and cancels
// it: the missed tick, which RunOnce was to run once, ends `cancelled` ("a newer tick
// is due") and the duplicate then finds the row. The README: a duplicate "is not run
// and stops nothing".
#[tokio::test]
async fn a_duplicate_does_not_cancel_a_catch_up_on_gain() {
    let db = db().await;
    let job = unique_name("ledger-gain-dup");
    let now = unix_now();
    // Minute `m` of every hour, half an hour from now: the next tick is ~30 min away.
    let m = (now / 60 + 30) % 60;
    let hourly: Schedule = format!("0 {m} * * * *").parse().unwrap();
    let last = {
        let mut t = now - now % 60;
        while (t / 60) % 60 != m {
            t -= 60;
        }
        t
    };
    // The job's first row, three hours before the last tick.
    db.admin
        .execute(
            "INSERT INTO chosen_ticks (job, tick, token, outcome, node, started_at) VALUES ($1, to_timestamp($2), 5, 'ran', 'node-a', now())",
            &[&job, &((last - 3 * 3600) as f64)],
        )
        .await
        .unwrap();
    // Node B: not leading yet, so the catch-up's run of `last` is slow from the start.
    let (leadership, control) = Leadership::manual(&job, "node-b");
    let layer = LeaderOnlyJobLayer::new(leadership)
        .ledger(db.ledger.clone())
        .misfire(Misfire::RunOnce)
        .overlap(Overlap::CancelPrevious)
        .schedule(hourly);
    let runs = Runs::default();
    let delays = Delays::default();
    delays.lock().unwrap().push((last, Duration::from_secs(3)));
    let mut svc = layer.layer(Job {
        runs: Arc::clone(&runs),
        pool: None,
        delays,
        ids: Ids::default(),
    });
    control.lead(7);
    for _ in 0..200 {
        if runs.lock().unwrap().contains(&(last, true)) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(runs.lock().unwrap().contains(&(last, true)), "no catch-up");
    // The same tick delivered again (a late scheduler, a retry).
    let dup = svc
        .ready()
        .await
        .unwrap()
        .call(Task::new(Tick::new(last)))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(4)).await;
    let got: Vec<(u64, String, Option<String>)> = db
        .admin
        .query(
            "SELECT extract(epoch FROM tick)::bigint, outcome, reason FROM chosen_ticks WHERE job = $1 AND tick = to_timestamp($2)",
            &[&job, &(last as f64)],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get::<_, i64>(0) as u64, r.get(1), r.get(2)))
        .collect();
    assert_eq!(
        got,
        vec![(last, "ran".to_owned(), None)],
        "the duplicate was answered {dup:?}"
    );
}

// R3-3. `low` is raised to the tick at hand after each look, whatever that tick is: one
// tick from a wall clock stepped forward (the N6 premise) puts it hours ahead, and
// every tick the gate leaves "to the misfire policy of the next run" until the real
// clock gets there is below it and never looked at again by this node (here a tick the
// Buffer policy deferred). Also, the future tick's look recorded ~1000 ticks that were
// not yet due as `skipped` (Misfire::Skip): they will not run when they fall due.
#[tokio::test]
async fn a_deferred_tick_after_a_clock_step_is_decided() {
    let db = db().await;
    let job = unique_name("ledger-clock-low");
    let mut a = node_with(&db, &job, "node-a", 5, false, |l| {
        l.schedule(every_second()).overlap(Overlap::Buffer)
    });
    assert!(tick(&mut a, t0()).await.ran());
    assert!(tick(&mut a, t0() + 7200).await.ran());
    // Back to the right time. T0+1000 runs 2 s, T0+1001 waits, T0+1002 is deferred.
    a.delays
        .lock()
        .unwrap()
        .push((t0() + 1000, Duration::from_secs(2)));
    let running = tick_in_background(&a, t0() + 1000);
    started(&a, t0() + 1000).await;
    let waiting = tick_in_background(&a, t0() + 1001);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let deferred = tick(&mut a, t0() + 1002).await;
    assert!(
        matches!(deferred, Outcome::Skipped(SkipReason::Overlap { .. })),
        "{deferred:?}"
    );
    running.await.unwrap();
    waiting.await.unwrap();
    for t in t0() + 1003..t0() + 1006 {
        assert!(tick(&mut a, t).await.ran());
    }
    let got: Vec<i64> = rows(&db.admin, &job)
        .await
        .into_iter()
        .map(|(t, ..)| t)
        .filter(|t| (1000..1006).contains(t))
        .collect();
    assert!(
        got.contains(&1002),
        "the deferred tick t0()+1002 has no row after later ticks ran: {got:?}"
    );
}

// R3-5. The fence name of a named job is `lock/name`, which is also the fence name a
// lock *called* `lock/name` uses (`Lease::fence`, or that lock's own unnamed ledgered
// job). Tokens are comparable across locks, so a write under the other lock with a
// greater token makes every ledger write of this job stale while its leader is valid.
#[tokio::test]
async fn a_named_job_s_fence_is_not_another_lock_s() {
    let db = db().await;
    let lock = unique_name("ledger-fence-names");
    // Another lock, named "<lock>/nightly", fenced a write with its (greater) token.
    {
        let mut client = db.pool.get().await.unwrap();
        let tx = client.transaction().await.unwrap();
        chosen_core::fenced::fence(
            &tx,
            &format!("{lock}/nightly"),
            chosen_core::FencingToken::new(100),
        )
        .await
        .unwrap();
        tx.commit().await.unwrap();
    }
    let (leadership, control) = Leadership::manual(&lock, "node-a");
    control.lead(3);
    let runs = Runs::default();
    let mut svc = LeaderOnlyJobLayer::new(leadership)
        .ledger(db.ledger.clone())
        .schedule(every_second())
        .job("nightly")
        .layer(quiet_job(&runs));
    let out = svc
        .ready()
        .await
        .unwrap()
        .call(Task::new(Tick::new(t0())))
        .await
        .unwrap();
    assert!(out.ran(), "{out:?}");
}

/// `(tick - T0, token)` per witness row of `job`.
async fn witness_rows(admin: &Client, job: &str) -> Vec<(i64, i64)> {
    admin
        .query(
            "SELECT tick - $2, token FROM witness WHERE job = $1 ORDER BY tick",
            &[&job, &(t0() as i64)],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_stalled_inside_its_job_transaction_does_not_hold_up_the_next_leader() {
    // The old leader fenced and claimed its tick in the job's transaction, then stalled
    // there (frozen, or its connection black-holed: to the server, idle in a
    // transaction). The server ends that transaction by the default bound, below the
    // time the next leader needs to take over, so the next leader's tick runs at once
    // instead of waiting for the stall to end (or failing after the ledger's timeout).
    let db = db().await;
    let job = unique_name("ledger-stalled");
    let mut old = node(
        &db,
        &job,
        "old",
        5,
        Misfire::CatchUp {
            max: 10,
            within: Duration::from_secs(3600),
        },
        Claim::InJobTransaction,
        true,
    );
    // Past the idle bound (5 s by default), and past the ledger's timeout (10 s),
    // after which the new leader would give up on its tick.
    old.delays
        .lock()
        .unwrap()
        .push((t0(), Duration::from_secs(15)));
    let stalled = tokio::spawn(async move { try_tick(&mut old, t0()).await.map(|o| o.ran()) });
    // Its claim is in: the fence row is locked by its transaction.
    let stalled_at = std::time::Instant::now();
    while db
        .admin
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE state = 'idle in transaction' AND query LIKE '%chosen_ticks%' AND query LIKE '%INSERT INTO%'",
            &[],
        )
        .await
        .unwrap()
        .get::<_, i64>(0)
        == 0
    {
        assert!(stalled_at.elapsed() < Duration::from_secs(10), "the old leader never began");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A newer leader: its tick fences the same row.
    let mut new = node(
        &db,
        &job,
        "new",
        6,
        Misfire::CatchUp {
            max: 10,
            within: Duration::from_secs(3600),
        },
        Claim::InJobTransaction,
        true,
    );
    let started = std::time::Instant::now();
    let out = tokio::time::timeout(Duration::from_secs(30), try_tick(&mut new, t0() + 1))
        .await
        .expect("the new leader's tick hung");
    assert!(
        matches!(out, Ok(ref o) if o.ran()),
        "the new leader's tick did not run: {out:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(7),
        "the new leader waited {:?} for the stalled transaction",
        started.elapsed()
    );
    // The stalled run's transaction was ended by the server: nothing of it committed.
    let stalled = tokio::time::timeout(Duration::from_secs(40), stalled)
        .await
        .expect("the stalled run never ended")
        .unwrap();
    assert!(!matches!(stalled, Ok(true)), "{stalled:?}");
    assert_eq!(witness_rows(&db.admin, &job).await, vec![(1, 6)]);
}

// A job that made its writes in the ledger transaction, then sat idle there past
// `TickLedger::idle_in_transaction` while this node still leads (it worked too long
// between two statements, or only its connection was cut): the server ended the
// session, and the first statement `commit` sends (the one that records the end of the
// run) fails on the closed connection. Nothing committed, so the tick is left to the
// misfire policy, as when COMMIT itself finds the connection closed: `CatchUp` runs it
// at the next tick. (Before, that statement's failure left the tick recorded `failed`,
// and no leader ran it again.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_on_a_connection_the_server_closed_leaves_the_tick_to_the_misfire_policy() {
    stalled_inside_the_job_transaction(Stalled::BeforeCommit).await;
}

// The same when the job's own next statement finds the session ended: the job returns
// that error without committing, and the tick is not recorded `failed` for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_statement_on_a_connection_the_server_closed_leaves_the_tick_to_the_misfire_policy() {
    stalled_inside_the_job_transaction(Stalled::BeforeItsNextWrite).await;
}

// ... and when the job rolls the dead transaction back itself and answers `Ok`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollback_on_a_connection_the_server_closed_leaves_the_tick_to_the_misfire_policy() {
    stalled_inside_the_job_transaction(Stalled::RolledBack).await;
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Stalled {
    BeforeCommit,
    BeforeItsNextWrite,
    RolledBack,
}

async fn stalled_inside_the_job_transaction(how: Stalled) {
    let db = db().await;
    let job = unique_name("ledger-idle-commit");
    let idle = Duration::from_millis(500);
    let calls: Arc<Mutex<Vec<(i64, bool)>>> = Arc::default();
    let commit_errors: Arc<Mutex<Vec<String>>> = Arc::default();
    let job_fn = {
        let (calls, commit_errors, pool) = (
            Arc::clone(&calls),
            Arc::clone(&commit_errors),
            db.pool.clone(),
        );
        tower::service_fn(move |task: Task<Tick>| {
            let (calls, commit_errors, pool) =
                (Arc::clone(&calls), Arc::clone(&commit_errors), pool.clone());
            async move {
                let t = task.args.get_timestamp();
                let ctx = task.ctx().data().get::<TickContext>().cloned().unwrap();
                calls
                    .lock()
                    .unwrap()
                    .push((t as i64 - t0() as i64, ctx.is_catch_up()));
                let mut client = pool.get().await?;
                let Some(tx) = ctx.begin(&mut client).await? else {
                    return Ok::<(), BoxDynError>(());
                };
                tx.execute(
                    "INSERT INTO witness (job, tick, token) VALUES ($1, $2, $3)",
                    &[&ctx.job(), &(t as i64), &(ctx.fencing_token().get() as i64)],
                )
                .await?;
                if t == t0() + 1 && !ctx.is_catch_up() {
                    // Its writes are made; it stalls past the idle bound.
                    tokio::time::sleep(idle * 4).await;
                    if how == Stalled::RolledBack {
                        // Fails on the closed connection; the job rolls back and says
                        // nothing.
                        let failed = tx.execute("SELECT 1", &[]).await.is_err();
                        let _ = tx.rollback().await;
                        assert!(failed, "the session had ended");
                        return Ok(());
                    }
                    if how == Stalled::BeforeItsNextWrite {
                        // Fails on the closed connection; the job returns the error.
                        tx.execute("SELECT 1", &[]).await?;
                        return Ok(());
                    }
                    if let Err(e) = tx.commit().await {
                        let mut text = e.to_string();
                        let mut source = std::error::Error::source(&e);
                        while let Some(s) = source {
                            text = format!("{text}: {s}");
                            source = s.source();
                        }
                        commit_errors.lock().unwrap().push(text);
                        return Err(e.into());
                    }
                    return Ok(());
                }
                tx.commit().await?;
                Ok(())
            }
        })
    };
    let (leadership, control) = Leadership::manual(&job, "node-a");
    control.lead(5);
    let mut svc = LeaderOnlyJobLayer::new(leadership)
        .ledger(db.ledger.clone().idle_in_transaction(idle))
        .claim(Claim::InJobTransaction)
        .misfire(Misfire::CatchUp {
            max: 10,
            within: Duration::from_secs(3600),
        })
        .schedule(every_second())
        .layer(job_fn);
    let first = svc
        .ready()
        .await
        .unwrap()
        .call(Task::new(Tick::new(t0())))
        .await;
    assert!(matches!(first, Ok(ref o) if o.ran()), "{first:?}");
    // The stalled run: its commit fails, the job returns that error.
    let stalled = svc
        .ready()
        .await
        .unwrap()
        .call(Task::new(Tick::new(t0() + 1)))
        .await;
    assert_eq!(stalled.is_err(), how != Stalled::RolledBack, "{stalled:?}");
    // Nothing of it committed, and the tick is not recorded: it is a missed tick.
    assert_eq!(witness_rows(&db.admin, &job).await, vec![(0, 5)]);
    assert_eq!(
        rows(&db.admin, &job).await,
        vec![row(0, "ran", None, 5)],
        "the stalled tick must be left unrecorded, to the misfire policy"
    );
    // The commit said why.
    let errors = commit_errors.lock().unwrap().clone();
    if how == Stalled::BeforeCommit {
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(errors[0].contains("connection is closed"), "{errors:?}");
    } else {
        assert!(errors.is_empty(), "{errors:?}");
    }
    // The next tick's misfire policy runs it (CatchUp: late, once), then its own.
    let next = svc
        .ready()
        .await
        .unwrap()
        .call(Task::new(Tick::new(t0() + 2)))
        .await;
    assert!(matches!(next, Ok(ref o) if o.ran()), "{next:?}");
    assert_eq!(
        *calls.lock().unwrap(),
        vec![(0, false), (1, false), (1, true), (2, false)]
    );
    assert_eq!(
        witness_rows(&db.admin, &job).await,
        vec![(0, 5), (1, 5), (2, 5)]
    );
    let outcomes: Vec<(i64, String)> = rows(&db.admin, &job)
        .await
        .into_iter()
        .map(|(t, o, ..)| (t, o))
        .collect();
    assert_eq!(
        outcomes,
        vec![
            (0, "ran".to_owned()),
            (1, "ran".to_owned()),
            (2, "ran".to_owned())
        ]
    );
}

// ---------------------------------------------------------------------------------
// The database's clock decides when a tick is due.
// ---------------------------------------------------------------------------------

/// The database's clock, in whole Unix seconds.
async fn db_now(admin: &Client) -> u64 {
    admin
        .query_one(
            "SELECT floor(extract(epoch FROM clock_timestamp()))::bigint",
            &[],
        )
        .await
        .unwrap()
        .get::<_, i64>(0) as u64
}

/// The ticks recorded for `job` after `after` (Unix seconds).
async fn rows_after(admin: &Client, job: &str, after: u64) -> Vec<i64> {
    admin
        .query(
            "SELECT extract(epoch FROM tick)::bigint FROM chosen_ticks WHERE job = $1 AND tick > to_timestamp($2) ORDER BY tick",
            &[&job, &(after as f64)],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

#[tokio::test]
async fn a_leader_ten_minutes_ahead_runs_no_tick_early_and_records_no_future_tick() {
    // The leader's scheduler delivers the tick due in ten minutes now: it is held, not
    // run, and nothing is recorded for the ticks before it; a leader with the right
    // clock then runs the next tick due as any tick.
    let db = db().await;
    let job = unique_name("ledger-ahead");
    let mut a = node(
        &db,
        &job,
        "node-a",
        5,
        Misfire::Skip,
        Claim::BeforeRun,
        false,
    );
    let now = db_now(&db.admin).await;
    assert!(tick(&mut a, now - 5).await.ran());
    let early = tick_in_background(&a, now + 600);
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!early.is_finished(), "a tick ten minutes early ran at once");
    assert_eq!(a.runs.lock().unwrap().len(), 1);
    assert_eq!(
        rows_after(&db.admin, &job, now - 5).await,
        Vec::<i64>::new(),
        "ticks recorded ahead of the database's clock"
    );
    assert_eq!(a.layer.stats().held_early(), 1);
    early.abort();
    a.control.follow(Some("node-b"));
    let mut b = node(
        &db,
        &job,
        "node-b",
        7,
        Misfire::Skip,
        Claim::BeforeRun,
        false,
    );
    let due = db_now(&db.admin).await + 1;
    let out = tick(&mut b, due).await;
    assert!(out.ran(), "the tick due next: {out:?}");
    // The ticks in between were missed (nobody ran them), none after the tick at hand.
    let after = rows_after(&db.admin, &job, now - 5).await;
    assert_eq!(after.last().copied(), Some(due as i64), "{after:?}");
    assert_eq!(after.len() as u64, due - (now - 5), "{after:?}");
}

#[tokio::test]
async fn an_early_tick_waits_for_the_database_clock_then_runs() {
    let db = db().await;
    let job = unique_name("ledger-early");
    let mut a = node(
        &db,
        &job,
        "node-a",
        5,
        Misfire::Skip,
        Claim::BeforeRun,
        false,
    );
    let due = db_now(&db.admin).await + 4;
    let out = tick(&mut a, due).await;
    assert!(out.ran(), "{out:?}");
    // Claimed no earlier than the tolerance (1 s) before it was due.
    let early_by: f64 = db
        .admin
        .query_one(
            "SELECT extract(epoch FROM tick - started_at)::float8 FROM chosen_ticks WHERE job = $1",
            &[&job],
        )
        .await
        .unwrap()
        .get(0);
    assert!(early_by <= 1.0, "claimed {early_by} s before it was due");
    assert_eq!(a.layer.stats().held_early(), 1);
}

#[tokio::test]
async fn an_early_tick_held_on_a_follower_runs_if_it_leads_by_then() {
    // A follower whose clock is ahead gets a tick before it is due, and leads by the
    // time it is: the tick runs there (answered "not the leader" at once, it would be
    // lost to that node, and missed).
    let db = db().await;
    let job = unique_name("ledger-early-follower");
    let mut b = node(
        &db,
        &job,
        "node-b",
        7,
        Misfire::Skip,
        Claim::BeforeRun,
        false,
    );
    b.control.follow(Some("node-a"));
    let due = db_now(&db.admin).await + 3;
    let held = tick_in_background(&b, due);
    tokio::time::sleep(Duration::from_millis(500)).await;
    b.control.lead(9);
    let out = held.await.unwrap();
    assert!(out.ran(), "{out:?}");
    // Nothing to do with this node's own later ticks: it still runs them.
    assert!(tick(&mut b, due + 1).await.ran());
}

#[tokio::test]
async fn a_tick_more_than_an_hour_ahead_is_not_run_nor_recorded() {
    let db = db().await;
    let job = unique_name("ledger-far-ahead");
    let mut a = node(
        &db,
        &job,
        "node-a",
        5,
        Misfire::Skip,
        Claim::BeforeRun,
        false,
    );
    // (Due after the gain: one due before it, delivered after it, is a missed tick.)
    let now = db_now(&db.admin).await;
    assert!(tick(&mut a, now).await.ran());
    let out = tokio::time::timeout(Duration::from_secs(10), tick(&mut a, now + 7200))
        .await
        .expect("a tick two hours ahead was held");
    assert!(
        matches!(out, Outcome::Skipped(SkipReason::NotDue { early, .. }) if early > Duration::from_secs(7000)),
        "{out:?}"
    );
    assert_eq!(rows_after(&db.admin, &job, now).await, Vec::<i64>::new());
    assert_eq!(a.layer.stats().skipped_not_due(), 1);
}

#[tokio::test]
async fn a_daily_tick_missed_just_before_a_gain_runs_at_once() {
    // The daily tick fell due 2 s before this node gained leadership, while it
    // followed: its scheduler delivered it then (answered "not the leader") and will
    // not again. The previous leader was gone. It must run now, not in a day.
    let db = db().await;
    let job = unique_name("ledger-daily-gain");
    let day = db_now(&db.admin).await - 2;
    let text = {
        let s = day % 86_400;
        format!("{} {} {} * * *", s % 60, s / 60 % 60, s / 3600)
    };
    let daily: Schedule = text.parse().unwrap();
    db.admin
        .execute(
            "INSERT INTO chosen_ticks (job, tick, token, outcome, node, started_at, schedule) VALUES ($1, to_timestamp($2), 5, 'ran', 'node-a', now(), $3)",
            &[&job, &((day - 86_400) as f64), &text],
        )
        .await
        .unwrap();
    let (leadership, control) = Leadership::manual(&job, "node-b");
    control.follow(Some("node-a"));
    let layer = LeaderOnlyJobLayer::new(leadership)
        .ledger(db.ledger.clone())
        .misfire(Misfire::RunOnce)
        .schedule(daily);
    let runs = Runs::default();
    let mut svc = layer.layer(quiet_job(&runs));
    let out = svc
        .ready()
        .await
        .unwrap()
        .call(Task::new(Tick::new(day)))
        .await
        .unwrap();
    assert!(
        matches!(out, Outcome::Skipped(SkipReason::NotLeader { .. })),
        "{out:?}"
    );
    control.lead(7);
    for _ in 0..150 {
        if !runs.lock().unwrap().is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        *runs.lock().unwrap(),
        vec![(day, true)],
        "the missed daily tick"
    );
}

// ---------------------------------------------------------------------------------
// One job is one job: no two jobs share rows or a fence, and no job is two.
// ---------------------------------------------------------------------------------

/// A ledgered every-second job under `leadership`, leading with `token`.
fn job_under(
    db: &Db,
    leadership: Leadership,
    control: &ManualLeadership,
    token: u64,
    job: Option<&str>,
) -> (LedgeredCron<Job>, Runs) {
    control.lead(token);
    let mut layer = LeaderOnlyJobLayer::new(leadership)
        .ledger(db.ledger.clone())
        .schedule(every_second());
    if let Some(job) = job {
        layer = layer.job(job);
    }
    let runs = Runs::default();
    let svc = layer.layer(quiet_job(&runs));
    (svc, runs)
}

async fn call_at(svc: &mut LedgeredCron<Job>, at: u64) -> Outcome<()> {
    svc.ready()
        .await
        .unwrap()
        .call(Task::new(Tick::new(at)))
        .await
        .unwrap()
}

#[tokio::test]
async fn one_lock_name_in_two_namespaces_is_two_jobs() {
    // Two applications share a database, each in its own namespace, both locking
    // `billing`: two locks, two rightful leaders (the second with a smaller token).
    // Each runs every tick of its own job; neither's fence stops the other.
    let db = db().await;
    let lock = unique_name("billing");
    let (a, ca) = Leadership::manual_in(Some("app-a"), &lock, "node-1");
    let (b, cb) = Leadership::manual_in(Some("app-b"), &lock, "node-2");
    let (mut a, _ra) = job_under(&db, a, &ca, 9, None);
    let (mut b, _rb) = job_under(&db, b, &cb, 5, None);
    for t in t0()..t0() + 3 {
        let out = call_at(&mut a, t).await;
        assert!(out.ran(), "app-a's tick {t}: {out:?}");
        let out = call_at(&mut b, t).await;
        assert!(out.ran(), "app-b's tick {t}: {out:?}");
    }
}

#[tokio::test]
async fn jobs_whose_names_joined_look_alike_are_two_jobs() {
    // The unnamed job of lock `x/y` and job `y` of lock `x`; job `c` of lock `a/b` and
    // job `b/c` of lock `a`: each pair used to be one ledger job, each tick going to
    // whichever claimed it first.
    let db = db().await;
    let x = unique_name("x");
    /// A lock and the job's name under it, if any.
    type Job<'a> = (String, Option<&'a str>);
    let pairs: [(Job<'_>, Job<'_>); 2] = [
        ((format!("{x}/y"), None), (x.clone(), Some("y"))),
        ((format!("{x}/b"), Some("c")), (x.clone(), Some("b/c"))),
    ];
    for ((lock1, job1), (lock2, job2)) in pairs {
        let (l1, c1) = Leadership::manual(&lock1, "node-1");
        let (l2, c2) = Leadership::manual(&lock2, "node-1");
        let (mut one, _) = job_under(&db, l1, &c1, 5, job1);
        let (mut two, _) = job_under(&db, l2, &c2, 5, job2);
        let out = call_at(&mut one, t0()).await;
        assert!(out.ran(), "{lock1} {job1:?}: {out:?}");
        let out = call_at(&mut two, t0()).await;
        assert!(out.ran(), "{lock2} {job2:?}: {out:?}");
    }
}

/// A pool of one connection to `db` (so that a session setting made on it is the one
/// the ledger's next statement runs under).
fn one_connection_pool(db: &Db) -> Pool {
    let config: tokio_postgres::Config = db.url.parse().unwrap();
    Pool::builder(deadpool_postgres::Manager::new(
        config,
        tokio_postgres::NoTls,
    ))
    .max_size(1)
    .build()
    .unwrap()
}

/// Tables named as the ledger's default ones in a schema of their own, which a
/// connection whose `search_path` begins with it finds first.
async fn shadow_tables(db: &Db) -> String {
    let schema = unique_name("shadow").replace('-', "_");
    db.admin
        .batch_execute(&format!(
            "CREATE SCHEMA {schema};\nCREATE TABLE {schema}.chosen_ticks (LIKE public.chosen_ticks INCLUDING ALL);\nCREATE TABLE {schema}.chosen_fence (LIKE public.chosen_fence INCLUDING ALL)"
        ))
        .await
        .unwrap();
    schema
}

#[tokio::test]
async fn the_ledger_keeps_the_tables_it_resolved_whatever_a_connections_search_path() {
    // A pooled connection whose session `search_path` changes (the application set it)
    // finds other tables of the same names first; the ledger keeps writing to the
    // tables it resolved, so no tick's row lands where the next leader does not look.
    let db = db().await;
    let schema = shadow_tables(&db).await;
    let pool = one_connection_pool(&db);
    let ledger = TickLedger::new(pool.clone());
    let job = unique_name("ledger-search-path");
    let (leadership, control) = Leadership::manual(&job, "node-1");
    control.lead(5);
    let runs = Runs::default();
    let mut svc = LeaderOnlyJobLayer::new(leadership)
        .ledger(ledger)
        .schedule(every_second())
        .layer(quiet_job(&runs));
    assert!(call_at(&mut svc, t0()).await.ran());
    pool.get()
        .await
        .unwrap()
        .batch_execute(&format!("SET search_path = {schema}, public"))
        .await
        .unwrap();
    assert!(call_at(&mut svc, t0() + 1).await.ran());
    let count = |table: String| {
        let admin = &db.admin;
        let job = job.clone();
        async move {
            admin
                .query_one(
                    &format!("SELECT count(*) FROM {table} WHERE job = $1"),
                    &[&job],
                )
                .await
                .unwrap()
                .get::<_, i64>(0)
        }
    };
    assert_eq!(count("public.chosen_ticks".to_owned()).await, 2);
    assert_eq!(count(format!("{schema}.chosen_ticks")).await, 0);
}

#[tokio::test]
async fn a_leader_hours_ahead_still_decides_the_ticks_that_are_due() {
    // Every tick this leader's scheduler delivers is two hours early, too early to hold:
    // each is answered NotDue, and at each the misfire policy decides about the ticks
    // the database's clock has reached, so none is left undecided for its tenure.
    let db = db().await;
    let job = unique_name("ledger-hours-ahead");
    let mut a = node(
        &db,
        &job,
        "node-a",
        5,
        Misfire::RunOnce,
        Claim::BeforeRun,
        false,
    );
    let now = db_now(&db.admin).await;
    assert!(tick(&mut a, now - 30).await.ran());
    let out = tick(&mut a, now + 7200).await;
    assert!(
        matches!(out, Outcome::Skipped(SkipReason::NotDue { .. })),
        "{out:?}"
    );
    // RunOnce: the newest tick at least 5 s old ran, late; the older ones skipped.
    let runs = a.runs.lock().unwrap().clone();
    assert_eq!(runs.len(), 2, "{runs:?}");
    assert!(runs[1].1 && runs[1].0 >= now - 5, "{runs:?}");
    let decided = rows_after(&db.admin, &job, now - 30).await;
    assert_eq!(decided.last().copied(), Some(runs[1].0 as i64));
    assert_eq!(decided.len() as u64, runs[1].0 - (now - 30), "{decided:?}");
}

#[tokio::test]
async fn a_held_tick_does_not_hold_the_jobs_readiness() {
    // The job allows one run at a time (a concurrency limit inside the gate). A tick
    // held until it is due must not take that permit while it waits: the gate stays
    // ready, and a due tick delivered meanwhile runs.
    let db = db().await;
    let job = unique_name("ledger-held-permit");
    let (leadership, control) = Leadership::manual(&job, "node-a");
    control.lead(5);
    let runs = Runs::default();
    let mut svc = LeaderOnlyJobLayer::new(leadership)
        .ledger(db.ledger.clone())
        .schedule(every_second())
        .layer(tower::limit::ConcurrencyLimit::new(quiet_job(&runs), 1));
    let now = db_now(&db.admin).await;
    let held = {
        let fut = svc
            .ready()
            .await
            .unwrap()
            .call(Task::new(Tick::new(now + 4)));
        tokio::spawn(fut)
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!held.is_finished());
    let ready = tokio::time::timeout(Duration::from_millis(500), svc.ready()).await;
    assert!(ready.is_ok(), "the gate waited for the held tick's permit");
    let out = ready
        .unwrap()
        .unwrap()
        .call(Task::new(Tick::new(now)))
        .await
        .unwrap();
    assert!(out.ran(), "{out:?}");
    assert!(held.await.unwrap().unwrap().ran());
}

#[tokio::test]
async fn an_overlap_skip_is_recorded_while_the_running_job_holds_its_fence_row() {
    // The run works inside its ledger transaction (holding the job's fence row) longer
    // than the ledger's timeout. A tick due meanwhile is skipped by the overlap policy:
    // it must be recorded skipped (once the run ends), not left unrecorded for CatchUp
    // to run later.
    let db = db().await;
    let job = unique_name("ledger-overlap-fenced");
    let ledger = db.ledger.clone().timeout(Duration::from_secs(1));
    let (leadership, control) = Leadership::manual(&job, "node-a");
    control.lead(5);
    let layer = LeaderOnlyJobLayer::new(leadership)
        .ledger(ledger)
        .schedule(every_second())
        .claim(Claim::InJobTransaction)
        .overlap(Overlap::Skip)
        .misfire(Misfire::CatchUp {
            max: 10,
            within: Duration::from_secs(3600),
        });
    let runs = Runs::default();
    let delays = Delays::default();
    let mut a = Node {
        svc: layer.clone().layer(Job {
            runs: Arc::clone(&runs),
            pool: Some(db.pool.clone()),
            delays: Arc::clone(&delays),
            ids: Ids::default(),
        }),
        control,
        layer,
        runs,
        delays,
        ids: Ids::default(),
    };
    a.delays
        .lock()
        .unwrap()
        .push((t0(), Duration::from_secs(3)));
    let first = tick_in_background(&a, t0());
    started(&a, t0()).await;
    let out = tokio::time::timeout(Duration::from_secs(1), tick(&mut a, t0() + 1))
        .await
        .expect("the overlap skip waited for the running job");
    assert!(
        matches!(out, Outcome::Skipped(SkipReason::Overlap { .. })),
        "{out:?}"
    );
    assert!(first.await.unwrap().ran());
    assert!(tick(&mut a, t0() + 2).await.ran());
    assert_eq!(
        *a.runs.lock().unwrap(),
        vec![(t0(), false), (t0() + 2, false)],
        "the skipped tick ran"
    );
    assert_eq!(
        rows(&db.admin, &job).await,
        vec![
            row(0, "ran", None, 5),
            row(1, "skipped", Some("previous run still running"), 5),
            row(2, "ran", None, 5)
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_whose_commit_answer_is_lost_is_read_back_and_run() {
    // The claim's COMMIT reaches the server, which commits, but its answer is lost (the
    // connection cut while the server commits). The gate cannot tell from the error:
    // it reads the row back, finds its own claim, and runs the tick. (Before: the tick
    // was skipped, and its row stayed `running`, never run nor decided.)
    use chosen_tests::{FaultProxy, ProxyMode};

    let db = db().await;
    let job = unique_name("ledger-lost-commit");
    // The commit of this job's claim takes 1.5 s on the server (a deferred trigger).
    db.admin
        .batch_execute(&format!(
            "CREATE OR REPLACE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN PERFORM pg_sleep(1.5); RETURN NULL; END $$;\nCREATE CONSTRAINT TRIGGER \"slow_{job}\" AFTER INSERT ON chosen_ticks DEFERRABLE INITIALLY DEFERRED FOR EACH ROW WHEN (NEW.job = '{job}') EXECUTE FUNCTION slow_commit()"
        ))
        .await
        .unwrap();
    let port = db._pg.port().unwrap();
    let proxy = FaultProxy::start(([127, 0, 0, 1], port).into())
        .await
        .unwrap();
    let config: tokio_postgres::Config = proxy.url(&db.url, port).parse().unwrap();
    let pool = Pool::builder(deadpool_postgres::Manager::new(
        config,
        tokio_postgres::NoTls,
    ))
    .max_size(2)
    .build()
    .unwrap();
    let (leadership, control) = Leadership::manual(&job, "node-a");
    control.lead(5);
    let runs = Runs::default();
    let mut svc = LeaderOnlyJobLayer::new(leadership)
        .ledger(TickLedger::new(pool))
        .schedule(every_second())
        .layer(quiet_job(&runs));
    let run = tokio::spawn(async move { call_at(&mut svc, t0()).await });
    // The server is committing: cut the connection, then let new ones through.
    let mut committing = false;
    for _ in 0..100 {
        committing = db
            .admin
            .query_one(
                "SELECT count(*) > 0 FROM pg_stat_activity WHERE wait_event = 'PgSleep' AND query = 'COMMIT'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        if committing {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(committing, "the claim never committed");
    proxy.set(ProxyMode::Cut);
    tokio::time::sleep(Duration::from_millis(300)).await;
    proxy.set(ProxyMode::Pass);
    let out = tokio::time::timeout(Duration::from_secs(20), run)
        .await
        .expect("the tick hung")
        .unwrap();
    assert!(out.ran(), "{out:?}");
    assert_eq!(*runs.lock().unwrap(), vec![(t0(), false)]);
    assert_eq!(rows(&db.admin, &job).await, vec![row(0, "ran", None, 5)]);
}

#[tokio::test]
async fn a_tick_waiting_for_the_jobs_readiness_is_not_claimed() {
    // The job is not ready (its only permit is taken: a paused apalis worker, a limiter
    // inside the gate). The gate stays ready and the tick waits, unclaimed: a hand-over
    // meanwhile leaves it unrecorded, and the next leader's misfire policy runs it.
    let db = db().await;
    let job = unique_name("ledger-not-ready");
    db.admin
        .execute(
            "INSERT INTO chosen_ticks (job, tick, token, outcome, node, started_at, schedule) VALUES ($1, to_timestamp($2), 4, 'ran', 'node-0', now(), '* * * * * *')",
            &[&job, &((t0() - 1) as f64)],
        )
        .await
        .unwrap();
    let (leadership, control) = Leadership::manual(&job, "node-a");
    control.lead(5);
    let runs = Runs::default();
    let limited = tower::limit::ConcurrencyLimit::new(quiet_job(&runs), 1);
    let mut holder = limited.clone();
    holder.ready().await.unwrap();
    let catch_up = Misfire::CatchUp {
        max: 10,
        within: Duration::from_secs(3 * 86_400),
    };
    let mut svc = LeaderOnlyJobLayer::new(leadership)
        .ledger(db.ledger.clone())
        .schedule(every_second())
        .misfire(catch_up)
        .layer(limited);
    let fut = tokio::time::timeout(Duration::from_millis(200), svc.ready())
        .await
        .expect("the gate waited for the job's readiness")
        .unwrap()
        .call(Task::new(Tick::new(t0())));
    let waiting = tokio::spawn(fut);
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(
        rows(&db.admin, &job).await,
        vec![row(-1, "ran", None, 4)],
        "claimed before the job was ready"
    );
    control.follow(Some("node-b"));
    let out = waiting.await.unwrap().unwrap();
    assert!(
        matches!(out, Outcome::Skipped(SkipReason::NotLeader { .. })),
        "{out:?}"
    );
    let mut b = node(&db, &job, "node-b", 6, catch_up, Claim::BeforeRun, false);
    assert!(tick(&mut b, t0() + 2).await.ran());
    assert_eq!(
        *b.runs.lock().unwrap(),
        vec![(t0(), true), (t0() + 1, true), (t0() + 2, false)]
    );
    drop(holder);
}

#[tokio::test]
async fn tables_in_a_schema_of_any_name_are_kept_once_resolved() {
    // The tables a node's connections find first are in a schema whose name has a
    // capital. Once resolved they are kept, whatever a later search_path: a second
    // node that finds the same ones sees the first node's rows.
    let db = db().await;
    db.admin
        .batch_execute(
            "CREATE SCHEMA \"Ops\";\nCREATE TABLE \"Ops\".chosen_ticks (LIKE public.chosen_ticks INCLUDING ALL);\nCREATE TABLE \"Ops\".chosen_fence (LIKE public.chosen_fence INCLUDING ALL)",
        )
        .await
        .unwrap();
    let on_ops = |pool: Pool| async move {
        pool.get()
            .await
            .unwrap()
            .batch_execute("SET search_path = \"Ops\", public")
            .await
            .unwrap();
        pool
    };
    let pool = on_ops(one_connection_pool(&db)).await;
    let job = unique_name("ledger-capital-schema");
    let (leadership, control) = Leadership::manual(&job, "node-1");
    control.lead(5);
    let runs = Runs::default();
    let mut svc = LeaderOnlyJobLayer::new(leadership)
        .ledger(TickLedger::new(pool.clone()))
        .schedule(every_second())
        .layer(quiet_job(&runs));
    assert!(call_at(&mut svc, t0()).await.ran());
    pool.get()
        .await
        .unwrap()
        .batch_execute("SET search_path = public")
        .await
        .unwrap();
    assert!(call_at(&mut svc, t0() + 1).await.ran());
    let pool2 = on_ops(one_connection_pool(&db)).await;
    let (l2, c2) = Leadership::manual(&job, "node-2");
    c2.lead(6);
    let mut svc2 = LeaderOnlyJobLayer::new(l2)
        .ledger(TickLedger::new(pool2))
        .schedule(every_second())
        .layer(quiet_job(&Runs::default()));
    let out = call_at(&mut svc2, t0() + 1).await;
    assert!(
        matches!(out, Outcome::Skipped(SkipReason::AlreadyRecorded { .. })),
        "ran on both nodes: {out:?}"
    );
    let in_ops: i64 = db
        .admin
        .query_one(
            "SELECT count(*) FROM \"Ops\".chosen_ticks WHERE job = $1",
            &[&job],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(in_ops, 2);
}

#[tokio::test]
async fn a_catch_up_that_cannot_claim_gives_the_jobs_readiness_back() {
    // The job allows one run at a time. The catch-up on gaining leadership takes the
    // job's readiness (its permit) before it claims; when the claim fails (the fence
    // row locked past the ledger's timeout), the permit must not stay with it, or every
    // later tick waits for it for the rest of the tenure.
    let db = db().await;
    let job = unique_name("ledger-permit-back");
    let now = db_now(&db.admin).await;
    let day = now - 60;
    let text = {
        let s = day % 86_400;
        format!("{} {} {} * * *", s % 60, s / 60 % 60, s / 3600)
    };
    let daily: Schedule = text.parse().unwrap();
    db.admin
        .execute(
            "INSERT INTO chosen_ticks (job, tick, token, outcome, node, started_at, schedule) VALUES ($1, to_timestamp($2), 5, 'ran', 'node-a', now(), $3)",
            &[&job, &((day - 86_400) as f64), &text],
        )
        .await
        .unwrap();
    db.admin
        .execute(
            "INSERT INTO chosen_fence (name, token) VALUES ($1, 5)",
            &[&job],
        )
        .await
        .unwrap();
    let (mut locker, conn) = tokio_postgres::connect(&db.url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let tx = locker.transaction().await.unwrap();
    tx.execute(
        "SELECT 1 FROM chosen_fence WHERE name = $1 FOR UPDATE",
        &[&job],
    )
    .await
    .unwrap();
    let (leadership, control) = Leadership::manual(&job, "node-b");
    control.follow(Some("node-a"));
    let layer = LeaderOnlyJobLayer::new(leadership)
        .ledger(db.ledger.clone().timeout(Duration::from_secs(1)))
        .misfire(Misfire::RunOnce)
        .schedule(daily);
    let stats = layer.stats();
    let runs = Runs::default();
    let mut svc = layer.layer(tower::limit::ConcurrencyLimit::new(quiet_job(&runs), 1));
    control.lead(7);
    for _ in 0..100 {
        if stats.skipped_ledger_error() > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        stats.skipped_ledger_error(),
        1,
        "the catch-up's claim failed"
    );
    tx.rollback().await.unwrap();
    // The database is fine again; the leader is the same. A due tick must run.
    let out = tokio::time::timeout(Duration::from_secs(10), async {
        svc.ready()
            .await
            .unwrap()
            .call(Task::new(Tick::new(now - 1)))
            .await
            .unwrap()
    })
    .await;
    assert!(
        out.is_ok(),
        "the tick waited 10 s for the permit the failed catch-up kept; runs {:?}",
        runs.lock().unwrap()
    );
}

#[tokio::test]
async fn a_tick_skipped_during_a_catch_up_on_gain_is_not_run_by_the_next_leader() {
    // A tick Overlap::Skip refuses while the catch-up on gaining leadership runs is
    // recorded skipped whoever holds the turn next, so a hand-over before this node
    // runs another tick does not leave it to the next leader's CatchUp.
    let db = db().await;
    let job = unique_name("ledger-skip-on-gain");
    // Wait for seconds 10..20 of a minute.
    let mut now = db_now(&db.admin).await;
    while !(10..20).contains(&(now % 60)) {
        tokio::time::sleep(Duration::from_millis(500)).await;
        now = db_now(&db.admin).await;
    }
    let base = now - now % 60;
    let (s1, s2, s3) = (base + 2, base + 30, base + 50);
    let text = format!("2,30,50 {} * * * *", base / 60 % 60);
    let schedule: Schedule = text.parse().unwrap();
    for t in [s1, s2, s3] {
        db.admin
            .execute(
                "INSERT INTO chosen_ticks (job, tick, token, outcome, node, started_at, schedule) VALUES ($1, to_timestamp($2), 4, 'ran', 'node-0', now(), $3)",
                &[&job, &((t - 3600) as f64), &text],
            )
            .await
            .unwrap();
    }
    let catch_up = Misfire::CatchUp {
        max: 10,
        within: Duration::from_secs(600),
    };
    let s = schedule.clone();
    let mut a = node_with(&db, &job, "node-a", 5, false, move |l| {
        l.schedule(s).misfire(catch_up).overlap(Overlap::Skip)
    });
    // The catch-up run of s1 lasts past s2.
    a.delays.lock().unwrap().push((s1, Duration::from_secs(25)));
    started(&a, s1).await;
    let out = tick(&mut a, s2).await; // held until s2 is due, then refused at once
    assert!(
        matches!(&out, Outcome::Skipped(SkipReason::Overlap { reason, .. }) if reason == "previous run still running"),
        "{out:?}"
    );
    // The catch-up run ends (s1 recorded ran); s2 stays unrecorded.
    for _ in 0..400 {
        if rows(&db.admin, &job)
            .await
            .iter()
            .any(|r| r.0 == (s1 - t0()) as i64 && r.1 == "ran")
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let recorded = rows_after(&db.admin, &job, s1).await;
    assert!(
        recorded.contains(&(s2 as i64)),
        "s2 unrecorded: {recorded:?}"
    );
    // Hand-over.
    a.control.follow(Some("node-b"));
    let s = schedule.clone();
    let mut b = node_with(&db, &job, "node-b", 8, false, move |l| {
        l.schedule(s).misfire(catch_up).overlap(Overlap::Skip)
    });
    let out = tick(&mut b, s3).await;
    assert!(out.ran(), "{out:?}");
    assert!(
        !b.runs.lock().unwrap().iter().any(|(t, _)| *t == s2),
        "the tick node-a answered Skipped(Overlap) was run by node-b's CatchUp"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_claim_never_takes_another_gates_claim_for_its_own() {
    // Two gates of one job on one node under one lease. The first one's COMMIT fails
    // (a deferred trigger raises: the server's answer, so it did not commit); the other
    // gate, which waited on the fence row, claims the tick and runs it. The first must
    // not take that row for its own claim and run the tick again.
    let db = db().await;
    let job = unique_name("ledger-not-ours");
    db.admin
        .batch_execute(&format!(
            "CREATE SEQUENCE fail_once;\nCREATE OR REPLACE FUNCTION fail_commit_once() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN IF nextval('fail_once') = 1 THEN PERFORM pg_sleep(1); RAISE EXCEPTION 'commit failed'; END IF; RETURN NULL; END $$;\nCREATE CONSTRAINT TRIGGER \"fail_{job}\" AFTER INSERT ON chosen_ticks DEFERRABLE INITIALLY DEFERRED FOR EACH ROW WHEN (NEW.job = '{job}') EXECUTE FUNCTION fail_commit_once()"
        ))
        .await
        .unwrap();
    // Two gates of one job on one node, under one lease (token 5).
    let (l1, c1) = Leadership::manual(&job, "node-a");
    let (l2, c2) = Leadership::manual(&job, "node-a");
    c1.lead(5);
    c2.lead(5);
    let (r1, r2) = (Runs::default(), Runs::default());
    let mut g1 = LeaderOnlyJobLayer::new(l1)
        .ledger(db.ledger.clone())
        .schedule(every_second())
        .layer(quiet_job(&r1));
    let slow = quiet_job(&r2);
    slow.delays
        .lock()
        .unwrap()
        .push((t0(), Duration::from_secs(2)));
    let mut g2 = LeaderOnlyJobLayer::new(l2)
        .ledger(db.ledger.clone())
        .schedule(every_second())
        .layer(slow);
    let first = tokio::spawn(async move { call_at(&mut g1, t0()).await });
    tokio::time::sleep(Duration::from_millis(300)).await; // g1's COMMIT is under way
    let second = tokio::spawn(async move { call_at(&mut g2, t0()).await });
    let (_first, _second) = (first.await.unwrap(), second.await.unwrap());
    let n = r1.lock().unwrap().len() + r2.lock().unwrap().len();
    assert_eq!(n, 1, "tick ran {n} times");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_lost_in_a_server_crash_is_not_taken_for_committed() {
    // The server crashes while the claim commits (its backend killed: the whole server
    // restarts and recovers). The claim never committed, and its transaction id, never
    // flushed, is handed out again after recovery, to transactions that do commit. The
    // gate must not take the id's "committed" for its claim's: it finds no row of its
    // own, and leaves the tick unrun, to the misfire policy. (A server of its own: it
    // crashes.)
    let db = db_on(PgCluster::start_local().unwrap()).await;
    let job = unique_name("ledger-crash-commit");
    db.admin
        .batch_execute(&format!(
            "CREATE OR REPLACE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN PERFORM pg_sleep(1.5); RETURN NULL; END $$;\nCREATE CONSTRAINT TRIGGER \"slow_{job}\" AFTER INSERT ON chosen_ticks DEFERRABLE INITIALLY DEFERRED FOR EACH ROW WHEN (NEW.job = '{job}') EXECUTE FUNCTION slow_commit()"
        ))
        .await
        .unwrap();
    let (leadership, control) = Leadership::manual(&job, "node-a");
    control.lead(5);
    let runs = Runs::default();
    let mut svc = LeaderOnlyJobLayer::new(leadership)
        .ledger(TickLedger::new(one_connection_pool(&db)))
        .schedule(every_second())
        .layer(quiet_job(&runs));
    let run = tokio::spawn(async move { call_at(&mut svc, t0()).await });
    let mut pid = None;
    for _ in 0..100 {
        pid = db
            .admin
            .query_opt(
                "SELECT pid FROM pg_stat_activity WHERE wait_event = 'PgSleep' AND query = 'COMMIT'",
                &[],
            )
            .await
            .unwrap()
            .map(|r| r.get::<_, i32>(0));
        if pid.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let pid = pid.expect("the claim never committed");
    chosen_tests::signal(pid as u32, "KILL").unwrap();
    // After recovery, other transactions take the ids the lost one had.
    let mut burnt = 0;
    for _ in 0..200 {
        if let Ok(admin) = connect_admin(&db.url).await {
            for _ in 0..20 {
                if admin
                    .batch_execute("BEGIN; SELECT pg_current_xact_id(); COMMIT")
                    .await
                    .is_ok()
                {
                    burnt += 1;
                }
            }
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(burnt > 0, "the server did not come back");
    let out = tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .expect("the tick hung")
        .unwrap();
    assert!(!out.ran(), "the tick ran on a claim that was lost: {out:?}");
    assert!(runs.lock().unwrap().is_empty());
    let admin = connect_admin(&db.url).await.unwrap();
    let rows = admin
        .query("SELECT outcome FROM chosen_ticks WHERE job = $1", &[&job])
        .await
        .unwrap();
    assert!(rows.is_empty(), "a row for a claim that was lost");
}

/// The outcomes a gate reported to the metrics sink, in order.
#[derive(Debug, Default)]
struct Outcomes(Mutex<Vec<String>>);

impl MetricsSink for Outcomes {
    fn task_gated(&self, _node: &str, _lock: &str, outcome: &str) {
        self.0.lock().unwrap().push(outcome.to_owned());
    }
}

// Every answer of the gate is reported to the metrics once, with its reason. A tick
// whose catch-up a newer tick cancelled (Overlap::CancelPrevious) is recorded
// `cancelled` before its run started, and was answered `Cancelled` without a report:
// "ticks skipped or missed, by reason" missed it.
#[tokio::test]
async fn a_tick_cancelled_before_its_run_started_is_reported() {
    let db = db().await;
    let job = unique_name("ledger-report-cancel");
    let outcomes = Arc::new(Outcomes::default());
    let (leadership, control) = Leadership::manual_with_metrics(&job, "node-a", outcomes.clone());
    control.lead(5);
    let layer = LeaderOnlyJobLayer::new(leadership)
        .ledger(db.ledger.clone())
        .schedule(every_second())
        .misfire(Misfire::RunOnce)
        .overlap(Overlap::CancelPrevious);
    let (runs, delays) = (Runs::default(), Delays::default());
    let mut a = Node {
        svc: layer.layer(Job {
            runs: Arc::clone(&runs),
            pool: None,
            delays: Arc::clone(&delays),
            ids: Ids::default(),
        }),
        control,
        layer,
        runs,
        delays,
        ids: Ids::default(),
    };
    assert!(tick(&mut a, t0()).await.ran());
    // t0+1..t0+4 missed when t0+5 comes: RunOnce runs t0+4 (slowly) first.
    a.delays
        .lock()
        .unwrap()
        .push((t0() + 4, Duration::from_secs(60)));
    let fifth = tick_in_background(&a, t0() + 5);
    started(&a, t0() + 4).await;
    // A newer tick: it cancels the catch-up, and with it the tick at hand.
    assert!(tick(&mut a, t0() + 6).await.ran());
    let out = fifth.await.unwrap();
    assert!(
        matches!(&out, Outcome::Skipped(SkipReason::Cancelled { reason, .. }) if reason == "a newer tick is due"),
        "{out:?}"
    );
    let mut got = outcomes.0.lock().unwrap().clone();
    got.sort_unstable();
    assert_eq!(
        got,
        [
            // The catch-up of t0+4 (stopped), and t0+5 (stopped before it started).
            "cancelled",
            "cancelled",
            "caught_up",
            // t0, the catch-up of t0+4, t0+6.
            "ran",
            "ran",
            "ran",
            // t0+1..t0+3, superseded by t0+4.
            "skipped_missed",
            "skipped_missed",
            "skipped_missed",
        ]
    );
    assert_eq!(a.layer.stats().cancelled(), 2);
    assert_eq!(
        rows(&db.admin, &job).await[4..],
        [
            row(4, "cancelled", Some("a newer tick is due"), 5),
            row(5, "cancelled", Some("a newer tick is due"), 5),
            row(6, "ran", None, 5),
        ]
    );
}
