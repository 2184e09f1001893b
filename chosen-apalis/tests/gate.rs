//! The gate around a real apalis task function, with a hand-set leadership.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use apalis_core::error::BoxDynError;
use apalis_core::task::Task;
use apalis_core::task::data::Data;
use apalis_core::task::task_fn::task_fn;
use apalis_cron::Tick;
use chosen_apalis::{LeaderGuard, LeaderOnlyJobLayer, Outcome, SkipReason};
use chosen_core::Leadership;
use tower::{Layer, ServiceExt};

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

#[tokio::test]
async fn followers_skip_with_ok_and_never_call_the_job() {
    let (leadership, control) = Leadership::manual("cron", "node-1");
    control.follow(Some("node-2"));
    let calls = Arc::new(AtomicU64::new(0));
    let job = {
        let calls = Arc::clone(&calls);
        task_fn(move |_tick: Tick| {
            let calls = Arc::clone(&calls);
            async move {
                calls.fetch_add(1, Ordering::SeqCst);
                Err::<(), BoxDynError>("would loop under retry if it ran".into())
            }
        })
    };
    let gate = LeaderOnlyJobLayer::new(leadership);
    let stats = gate.stats();
    let svc = gate.for_cron_ticks().layer(job);
    let out = svc
        .oneshot(Task::new(Tick::new(now_secs())))
        .await
        .expect("a skip is Ok, never Err");
    assert_eq!(
        out,
        Outcome::Skipped(SkipReason::NotLeader {
            leader: Some("node-2".to_owned())
        })
    );
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    assert_eq!(stats.skipped_not_leader(), 1);
}

#[tokio::test]
async fn the_leader_runs_the_job_with_a_guard() {
    let (leadership, control) = Leadership::manual("cron", "node-1");
    control.lead(42);
    let job = task_fn(|tick: Tick, guard: Data<LeaderGuard>| async move {
        assert!(guard.is_valid());
        Ok::<_, BoxDynError>((
            tick.get_timestamp(),
            guard.fencing_token().get(),
            guard.node_id().to_owned(),
        ))
    });
    let gate = LeaderOnlyJobLayer::new(leadership.clone()).for_cron_ticks();
    let stats = gate.stats();
    // Past the default 1 s skew tolerance after gaining leadership, with a margin.
    let ts = now_secs() + 5;
    let out = gate
        .layer(job)
        .oneshot(Task::new(Tick::new(ts)))
        .await
        .unwrap();
    assert_eq!(out, Outcome::Ran((ts, 42, "node-1".to_owned())));
    assert_eq!(stats.ran(), 1);
}

#[tokio::test]
async fn a_tick_from_before_leadership_is_skipped() {
    let (leadership, control) = Leadership::manual("cron", "node-1");
    control.lead(7);
    let job = task_fn(|_tick: Tick| async { Ok::<(), BoxDynError>(()) });
    let gate = LeaderOnlyJobLayer::new(leadership)
        .for_cron_ticks()
        .skew_tolerance(Duration::from_secs(1));
    // Scheduled 5 s before this node gained leadership: the previous leader's tick.
    let out = gate
        .clone()
        .layer(job)
        .oneshot(Task::new(Tick::new(now_secs() - 5)))
        .await
        .unwrap();
    assert!(
        matches!(out, Outcome::Skipped(SkipReason::StaleTick { .. })),
        "{out:?}"
    );
    // Any task (not cron): no schedule check.
    let out = LeaderOnlyJobLayer::new(gate.leadership().clone())
        .layer(job)
        .oneshot(Task::new(Tick::new(now_secs() - 5)))
        .await
        .unwrap();
    assert!(out.ran());
}

#[tokio::test]
async fn the_guard_sees_leadership_loss_during_a_job() {
    let (leadership, control) = Leadership::manual("cron", "node-1");
    control.lead(1);
    let job = task_fn(|_tick: Tick, guard: Data<LeaderGuard>| async move {
        guard.lost().await;
        Ok::<_, BoxDynError>(guard.is_valid())
    });
    let run = tokio::spawn(
        LeaderOnlyJobLayer::new(leadership)
            .layer(job)
            .oneshot(Task::new(Tick::new(now_secs()))),
    );
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!run.is_finished());
    control.follow(None);
    let out = tokio::time::timeout(Duration::from_secs(5), run)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(out, Outcome::Ran(false));
}

/// Lets one tick through on the leader and hands back the guard the job got.
async fn guard_of_a_run(leadership: &Leadership) -> LeaderGuard {
    let job = task_fn(|_tick: Tick, guard: Data<LeaderGuard>| async move {
        Ok::<_, BoxDynError>(LeaderGuard::clone(&guard))
    });
    match LeaderOnlyJobLayer::new(leadership.clone())
        .layer(job)
        .oneshot(Task::new(Tick::new(now_secs())))
        .await
        .unwrap()
    {
        Outcome::Ran(guard) => guard,
        other => panic!("the leader must run the job, got {other:?}"),
    }
}

// A watch keeps only the latest value: a loss and a regain between two polls of
// `lost()` merge into "still leading". The guard belongs to the old tenure, so it must
// still see the loss.
#[tokio::test(start_paused = true)]
async fn the_guard_sees_a_loss_merged_with_a_regain() {
    let (leadership, control) = Leadership::manual("cron", "node-1");
    control.lead(1);
    let guard = guard_of_a_run(&leadership).await;
    let lost = tokio::spawn({
        let guard = guard.clone();
        async move { guard.lost().await }
    });
    // Let `lost()` start waiting.
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!lost.is_finished(), "the tenure has not ended yet");
    // Lost and regained (with a new token) without `lost()` being polled in between.
    control.follow(None);
    control.lead(2);
    tokio::time::timeout(Duration::from_secs(60), lost)
        .await
        .expect("lost() must resolve: the guard's tenure ended")
        .unwrap();
    assert!(!guard.is_valid());
    assert!(
        leadership.is_leader(),
        "the node leads again, in a new tenure"
    );
}

// Tokens are unique per acquisition on one server, but after an asynchronous failover
// a promoted standby may hand out a transaction id again: the tenure, not the token
// value, is what the guard must follow.
#[tokio::test(start_paused = true)]
async fn the_guard_sees_a_new_tenure_with_an_equal_token() {
    let (leadership, control) = Leadership::manual("cron", "node-1");
    control.lead(7);
    let guard = guard_of_a_run(&leadership).await;
    control.follow(None);
    control.lead(7);
    assert!(!guard.is_valid(), "a new tenure, even with an equal token");
    tokio::time::timeout(Duration::from_secs(60), guard.lost())
        .await
        .expect("lost() must resolve at once for an ended tenure");
}

// The window before the election task notices a lost lease: the state stored still
// says Leading, but the lease deadline has passed. The gate must skip with `Ok` (an
// `Err` would loop hot under retries) without calling the job.
#[tokio::test]
async fn an_expired_lease_skips_without_calling_the_job() {
    let (leadership, control) = Leadership::manual("cron", "node-1");
    let calls = Arc::new(AtomicU64::new(0));
    let job = {
        let calls = Arc::clone(&calls);
        task_fn(move |_tick: Tick| {
            let calls = Arc::clone(&calls);
            async move {
                calls.fetch_add(1, Ordering::SeqCst);
                Ok::<(), BoxDynError>(())
            }
        })
    };
    let gate = LeaderOnlyJobLayer::new(leadership);
    let stats = gate.stats();
    let svc = gate.layer(job);

    control.lead_until(4, Instant::now() + Duration::from_secs(3600));
    let out = svc
        .clone()
        .oneshot(Task::new(Tick::new(now_secs())))
        .await
        .unwrap();
    assert!(out.ran(), "{out:?}");

    control.expire();
    let out = svc
        .clone()
        .oneshot(Task::new(Tick::new(now_secs())))
        .await
        .expect("a skip is Ok, never Err");
    assert_eq!(
        out,
        Outcome::Skipped(SkipReason::NotLeader { leader: None })
    );

    // Expired from the start (a deadline already passed when leadership was set).
    control.lead_until(5, Instant::now());
    let out = svc
        .oneshot(Task::new(Tick::new(now_secs())))
        .await
        .expect("a skip is Ok, never Err");
    assert_eq!(
        out,
        Outcome::Skipped(SkipReason::NotLeader { leader: None })
    );
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "the job ran only while valid"
    );
    assert_eq!((stats.ran(), stats.skipped_not_leader()), (1, 2));
}

#[tokio::test]
async fn the_guard_turns_invalid_when_the_lease_deadline_passes() {
    let (leadership, control) = Leadership::manual("cron", "node-1");
    control.lead_until(8, Instant::now() + Duration::from_secs(3600));
    let guard = guard_of_a_run(&leadership).await;
    assert!(guard.is_valid());
    let lost = tokio::spawn({
        let guard = guard.clone();
        async move { guard.lost().await }
    });
    tokio::task::yield_now().await;
    control.expire();
    assert!(!guard.is_valid(), "the lease deadline passed");
    tokio::time::timeout(Duration::from_secs(30), lost)
        .await
        .expect("lost() must resolve when the lease deadline passes")
        .unwrap();

    // A near deadline passes by itself, with nobody telling the leadership.
    control.lead_until(9, Instant::now() + Duration::from_secs(3));
    let guard = guard_of_a_run(&leadership).await;
    tokio::time::timeout(Duration::from_secs(30), guard.lost())
        .await
        .expect("lost() must resolve at the lease deadline");
    assert!(!guard.is_valid());
}
