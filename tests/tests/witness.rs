//! The tick ledger's witness: three `cron_node` *processes* run an every-second apalis
//! cron job with the ledger (claim in the job's transaction), under SIGSTOP, SIGKILL,
//! a black-holed connection and SIGTERM, in that order, over and over (a freeze and a
//! black hole last 8 to 11 s, longer than the server's release time, so a new leader
//! takes over while the old one is cut off), each timed within 150 ms of a tick
//! boundary (a freeze just after one). Each node reaches the server through its own proxy; the server ends
//! sessions idle in a transaction for 3 s (`idle_in_transaction_session_timeout`, as
//! the README recommends). Each run works 400 ms before it opens its ledger
//! transaction, in a task of its own that the gate's cancellation on a lost lease does
//! not stop, so a freeze often lands there and the woken leader's write meets a newer
//! leader's fence (only the fence stops it). The job writes a witness row, numbered from a sequence, in its
//! ledger transaction. Once a tick at or after the last one is recorded (so the last
//! gap is decided), over every tick of the run:
//!
//! * `CatchUp`: every tick has exactly one ledger row, `ran`, and exactly one witness
//!   row with the same token: 0 duplicates, 0 missing, and at least one tick caught up
//!   (the first fault leaves a gap);
//! * `Skip`: 0 duplicates, every tick without a witness row has a `skipped` row
//!   (`missed: not run when due`), and at least one has;
//! * both: the witness rows' tokens never decrease in the order they were written (a woken leader's write
//!   after a newer leader's would: the fence must refuse it), and no tick's claim
//!   committed more than the tolerance (1 s) before the database's clock reached it,
//!   although node-3's wall clock is 20 s off (ahead under `CatchUp`, behind under
//!   `Skip`; libfaketime, `CHOSEN_WITNESS_CLOCK_OFFSET` to change it). How many runs
//!   the fence refused is printed (`rejected_by_fence`), and how many node-3 ran.
//!
//! `CHOSEN_WITNESS_TICKS` (default 40) sets the length; a run prints its seed, and
//! `CHOSEN_WITNESS_SEED` replays the fault schedule (the timing of the machine is not
//! replayed). The closing figure is at least 300 ticks:
//!
//! ```text
//! CHOSEN_WITNESS_TICKS=300 cargo test -p chosen-tests --test witness -- --nocapture
//! ```

use std::collections::BTreeMap;
use std::io::BufRead;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use chosen_tests::{
    FaultProxy, PgCluster, ProxyMode, connect_admin, shifted_clock_env, signal, test_binary,
    unique_name,
};
use tokio_postgres::Client;

const DEFAULT_TICKS: u64 = 40;

/// Quiet seconds at the end: every fault is over this long before the last tick.
const CALM: u64 = 5;

/// How long each run works before its ledger transaction: a SIGSTOP landing in it
/// (most of those timed within 150 ms after a boundary) freezes a leader that wakes up,
/// after a newer leader wrote, to a fence that refuses it.
const THINK_MS: u64 = 400;

/// The longest fault: a frozen or cut-off leader stays so for 8 to 11 s.
const LONGEST_FAULT: u64 = 11;

/// How far node-3's wall clock is off, in seconds, unless `CHOSEN_WITNESS_CLOCK_OFFSET`
/// says otherwise: ahead under CatchUp, behind under Skip.
const SHIFT: i64 = 20;

/// The faults, in turn: the first one (a freeze) leaves a gap, so every run has one.
const FAULTS: [&str; 4] = ["STOP", "KILL", "BLACKHOLE", "TERM"];

struct Node {
    id: String,
    child: Child,
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = signal(self.child.id(), "CONT");
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts a `cron_node` process; its event lines go to `lines`.
fn spawn(
    url: &str,
    (id, clock): (&str, &[(String, String)]),
    job: &str,
    misfire: &str,
    lines: &Arc<Mutex<Vec<String>>>,
) -> Node {
    let mut child = Command::new(test_binary("cron_node").unwrap())
        .args(["--node-id", id, "--job", job, "--misfire", misfire])
        .args(["--think-ms", &THINK_MS.to_string(), "--detached-writes"])
        .envs(clock.iter().map(|(k, v)| (k, v)))
        .env("DATABASE_URL", url)
        .env("RUST_LOG", "off")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().expect("BUG: stdout is piped");
    let lines = Arc::clone(lines);
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
        {
            lines.lock().unwrap().push(line);
        }
    });
    Node {
        id: id.to_owned(),
        child,
    }
}

/// xorshift64*: a seeded fault schedule.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) % n
    }
}

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// Sleeps until `offset_ms` (-150..=150) from the next second boundary.
async fn near_next_boundary(offset_ms: i64) {
    let now = now_us();
    let boundary = (now / 1_000_000 + 2) * 1_000_000;
    let target = boundary.saturating_add_signed(offset_ms * 1000);
    tokio::time::sleep(Duration::from_micros(target.saturating_sub(now))).await;
}

/// The node holding the job's lock now: the one session holding an advisory lock
/// exclusively (followers hold only shared ones: interest keys, stop fences), else the
/// node that ran the latest tick. (A node whose clock is behind runs its ticks late, so
/// the latest tick's runner is not always the leader.)
async fn current_leader(admin: &Client, job: &str) -> Option<String> {
    let holders = admin
        .query(
            "SELECT DISTINCT a.application_name FROM pg_locks l \
             JOIN pg_stat_activity a ON a.pid = l.pid \
             WHERE l.locktype = 'advisory' AND l.mode = 'ExclusiveLock' AND l.granted \
             AND a.application_name LIKE 'node-%'",
            &[],
        )
        .await
        .ok()
        .unwrap_or_default();
    match holders.as_slice() {
        [one] => Some(one.get(0)),
        _ => latest_runner(admin, job).await,
    }
}

async fn latest_runner(admin: &Client, job: &str) -> Option<String> {
    admin
        .query_opt(
            "SELECT node FROM chosen_ticks WHERE job = $1 AND outcome = 'ran' ORDER BY tick DESC LIMIT 1",
            &[&job],
        )
        .await
        .ok()
        .flatten()
        .map(|r| r.get(0))
}

#[derive(Debug, Default)]
struct Figures {
    ticks: u64,
    ran: u64,
    skipped: u64,
    caught_up: u64,
    duplicates: u64,
    missing: u64,
    stale_witness_rows: u64,
    rejected_by_fence: u64,
    /// Ticks run (their claim committed) more than the tolerance (1 s) before the
    /// database's clock reached them.
    early_runs: u64,
    /// Ticks run by the node whose clock is off.
    runs_by_the_shifted_node: u64,
    faults: BTreeMap<&'static str, u64>,
}

async fn witness_run(misfire: &str) -> Figures {
    let ticks: u64 = std::env::var("CHOSEN_WITNESS_TICKS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_TICKS);
    let seed: u64 = std::env::var("CHOSEN_WITNESS_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        // Two runs started at once get different schedules.
        .unwrap_or_else(|| (now_us() ^ if misfire == "skip" { 0x5bd1_e995 } else { 0 }) | 1);
    println!("witness {misfire}: seed {seed}, {ticks} ticks");
    let mut rng = Rng(seed);
    let pg = PgCluster::builder()
        .setting("idle_in_transaction_session_timeout", "3s")
        .start()
        .unwrap();
    let url = pg.url();
    let port = pg.port().expect("a local cluster has a port");
    let admin = connect_admin(&url).await.unwrap();
    let job = unique_name("witness");
    // Made here, not by three nodes at once.
    admin
        .batch_execute(
            "CREATE SEQUENCE IF NOT EXISTS witness_seq;\nCREATE TABLE IF NOT EXISTS witness (job text, tick bigint, token bigint, node text, seq bigint)",
        )
        .await
        .unwrap();
    let lines = Arc::new(Mutex::new(Vec::new()));
    // One proxy per node id, kept across restarts.
    let mut proxies = BTreeMap::new();
    for i in 1..=3 {
        let proxy = FaultProxy::start(([127, 0, 0, 1], port).into())
            .await
            .unwrap();
        proxies.insert(format!("node-{i}"), proxy);
    }
    let url_of = |id: &str| proxies[id].url(&url, port);
    // node-3's wall clock is off (its scheduler delivers every tick that early or
    // late): ahead under CatchUp, behind under Skip.
    let offset: i64 = std::env::var("CHOSEN_WITNESS_CLOCK_OFFSET")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if misfire == "skip" { -SHIFT } else { SHIFT });
    println!("witness {misfire}: node-3's clock is {offset:+} s off");
    let shifted = shifted_clock_env(offset).unwrap();
    let clock_of = |id: &str| {
        if id == "node-3" {
            &shifted[..]
        } else {
            &[][..]
        }
    };
    let mut nodes: Vec<Node> = (1..=3)
        .map(|i| {
            let id = format!("node-{i}");
            spawn(&url_of(&id), (&id, clock_of(&id)), &job, misfire, &lines)
        })
        .collect();

    // The first run (the first lock is granted some seconds after the server started).
    let mut start = None;
    for _ in 0..600 {
        if let Ok(Some(row)) = admin
            .query_opt(
                "SELECT extract(epoch FROM min(tick))::bigint FROM chosen_ticks WHERE job = $1 HAVING count(*) > 0",
                &[&job],
            )
            .await
        {
            start = Some(row.get::<_, i64>(0) as u64);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let start = start.expect("no tick ran within a minute");
    // `ticks` ticks from now (exclusive), so that the faults have their time: the first
    // row is written up to 20 s after its tick when node-3, whose clock is behind,
    // leads from the start.
    let end = start.max(now_us() / 1_000_000) + ticks;
    let mut figures = Figures {
        ticks: end - start,
        ..Figures::default()
    };

    // Faults, each over CALM seconds before the end.
    let mut turn = 0;
    while now_us() / 1_000_000 + 7 + LONGEST_FAULT + CALM < end {
        tokio::time::sleep(Duration::from_millis(2000 + rng.below(3000))).await;
        let leader = current_leader(&admin, &job).await;
        let Some(i) = nodes.iter().position(|n| Some(&n.id) == leader.as_ref()) else {
            continue;
        };
        let fault = FAULTS[turn % FAULTS.len()];
        turn += 1;
        // A freeze lands just after a boundary, inside the run's work before its
        // transaction; the other faults anywhere within 150 ms of one.
        let offset = if fault == "STOP" {
            10 + rng.below(141) as i64
        } else {
            rng.below(301) as i64 - 150
        };
        near_next_boundary(offset).await;
        let pid = nodes[i].child.id();
        *figures.faults.entry(fault).or_default() += 1;
        println!(
            "   {fault} {} at {offset:+} ms from a tick boundary (tick {:+})",
            nodes[i].id,
            (now_us() / 1_000_000) as i64 - start as i64
        );
        match fault {
            "BLACKHOLE" => {
                let proxy = &proxies[&nodes[i].id];
                proxy.set(ProxyMode::BlackHole);
                tokio::time::sleep(Duration::from_millis(8000 + rng.below(3000))).await;
                proxy.set(ProxyMode::Pass);
            }
            "STOP" => {
                signal(pid, "STOP").unwrap();
                // Past the server's release time (7 s by default): a new leader takes over
                // while this one is frozen.
                tokio::time::sleep(Duration::from_millis(8000 + rng.below(3000))).await;
                signal(pid, "CONT").unwrap();
            }
            _ => {
                signal(pid, fault).unwrap();
                let id = nodes[i].id.clone();
                let mut node = nodes.remove(i);
                // A graceful stop waits for the run in progress: give it 10 s.
                for _ in 0..100 {
                    if node.child.try_wait().ok().flatten().is_some() {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                if node.child.try_wait().ok().flatten().is_none() {
                    println!("   {id} did not exit within 10 s of SIGTERM: killed");
                }
                drop(node);
                tokio::time::sleep(Duration::from_millis(500 + rng.below(1000))).await;
                nodes.push(spawn(
                    &url_of(&id),
                    (&id, clock_of(&id)),
                    &job,
                    misfire,
                    &lines,
                ));
            }
        }
    }
    // The last gap is decided once a tick at or after the end is recorded (a new
    // leader may come up to the server's release time after the last fault).
    let mut decided = false;
    for _ in 0..600 {
        if let Ok(Some(_)) = admin
            .query_opt(
                "SELECT 1 FROM chosen_ticks WHERE job = $1 AND tick >= to_timestamp($2) LIMIT 1",
                &[&job, &(end as f64)],
            )
            .await
        {
            decided = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        decided,
        "no tick at or after the end was recorded within a minute of it"
    );
    for node in &nodes {
        let _ = signal(node.child.id(), "TERM");
    }
    drop(nodes);

    // The ledger and the witness rows of the run's ticks.
    let ledger: BTreeMap<i64, (String, Option<String>, i64)> = admin
        .query(
            "SELECT extract(epoch FROM tick)::bigint, outcome, reason, token FROM chosen_ticks WHERE job = $1 ORDER BY tick",
            &[&job],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), (r.get(1), r.get(2), r.get(3))))
        .collect();
    let (early, shifted_runs): (i64, i64) = {
        let row = admin
            .query_one(
                "SELECT count(*) FILTER (WHERE started_at < tick - interval '1 second'), count(*) FILTER (WHERE node = 'node-3') FROM chosen_ticks WHERE job = $1 AND outcome = 'ran'",
                &[&job],
            )
            .await
            .unwrap();
        (row.get(0), row.get(1))
    };
    figures.early_runs = early as u64;
    figures.runs_by_the_shifted_node = shifted_runs as u64;
    // The run's ticks as the ledger has them: who decided each, how, and how late.
    for r in admin
        .query(
            "SELECT extract(epoch FROM tick)::bigint, outcome, coalesce(reason, ''), node, token, \
             (extract(epoch FROM started_at - tick) * 1000)::bigint FROM chosen_ticks \
             WHERE job = $1 ORDER BY tick",
            &[&job],
        )
        .await
        .unwrap()
    {
        let (tick, late): (i64, i64) = (r.get(0), r.get(5));
        let (outcome, reason, node, token): (String, String, String, i64) =
            (r.get(1), r.get(2), r.get(3), r.get(4));
        println!(
            "   tick {:+}: {outcome} {reason:?} by {node} (token {token}) at {late:+} ms",
            tick - start as i64
        );
    }
    let mut witness: BTreeMap<i64, Vec<i64>> = BTreeMap::new();
    // In the order the rows were written (each took the fence row first, so this is
    // the order their transactions committed in): tokens never go back.
    let mut max_witness_token = 0;
    for r in admin
        .query(
            "SELECT tick, token FROM witness WHERE job = $1 ORDER BY seq",
            &[&job],
        )
        .await
        .unwrap()
    {
        let (tick, token): (i64, i64) = (r.get(0), r.get(1));
        if token < max_witness_token {
            figures.stale_witness_rows += 1;
        }
        max_witness_token = max_witness_token.max(token);
        witness.entry(tick).or_default().push(token);
    }
    let lines = lines.lock().unwrap().clone();
    figures.caught_up = lines
        .iter()
        .filter(|l| l.contains("\"event\":\"ran\"") && l.contains("\"catch_up\":1"))
        .count() as u64;
    figures.rejected_by_fence = lines
        .iter()
        .filter(|l| l.contains("\"event\":\"rejected\""))
        .count() as u64;

    for tick in start as i64..end as i64 {
        let rows = witness.get(&tick).map_or(&[][..], Vec::as_slice);
        if rows.len() > 1 {
            figures.duplicates += 1;
        }
        match ledger.get(&tick) {
            None => figures.missing += 1,
            Some((outcome, reason, token)) => {
                // (Tokens may go down in tick order: a newer leader fills an older hole.)
                match (outcome.as_str(), rows) {
                    ("ran", [w]) if w == token => figures.ran += 1,
                    ("skipped", []) if reason.as_deref() == Some("missed: not run when due") => {
                        figures.skipped += 1;
                    }
                    other => panic!(
                        "tick {tick}: ledger {outcome} {reason:?} {token}, witness {other:?}"
                    ),
                }
            }
        }
    }
    drop(pg);
    println!("witness {misfire}: {figures:?}");
    // A long run freezes a leader inside its run several times: the fence must have
    // refused at least one woken leader's write (a short run may draw none in time).
    if figures.ticks >= 300 {
        assert!(
            figures.rejected_by_fence >= 1,
            "no write met the fence: {figures:?}"
        );
    }
    figures
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn catch_up_runs_every_tick_exactly_once_under_faults() {
    let f = witness_run("catchup").await;
    assert_eq!(
        (
            f.duplicates,
            f.missing,
            f.skipped,
            f.stale_witness_rows,
            f.early_runs
        ),
        (0, 0, 0, 0, 0),
        "{f:?}"
    );
    assert_eq!(f.ran, f.ticks, "{f:?}");
    // The first fault (a freeze past the server's release time) leaves a gap.
    assert!(f.caught_up >= 1, "no gap was drawn: {f:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn skip_records_every_tick_it_does_not_run_under_faults() {
    let f = witness_run("skip").await;
    assert_eq!(
        (f.duplicates, f.missing, f.stale_witness_rows, f.early_runs),
        (0, 0, 0, 0),
        "{f:?}"
    );
    assert_eq!(f.ran + f.skipped, f.ticks, "{f:?}");
    assert!(f.skipped >= 1, "no gap was drawn: {f:?}");
}
