//! A session the client gave up on (its heartbeat went unanswered) may still be alive at
//! the server, holding its keys. It stays open until the next session holds the stop
//! fences of the work still stopping, so that no other node can take a key before the
//! fence that makes it wait is in place.

use std::time::{Duration, Instant};

use chosen_core::{ConnectionState, LockKey, LockManager};
use chosen_tests::{PgCluster, connect_admin, signal, unique_name};

/// Whether this process has an established TCP connection from local port `port`
/// (read from `/proc/net/tcp` and `/proc/net/tcp6`: state `01` is ESTABLISHED).
fn established_from(port: u16) -> bool {
    ["/proc/net/tcp", "/proc/net/tcp6"].iter().any(|table| {
        std::fs::read_to_string(table)
            .unwrap_or_default()
            .lines()
            .skip(1)
            .any(|line| {
                let fields: Vec<&str> = line.split_whitespace().collect();
                let local_port = fields
                    .get(1)
                    .and_then(|a| a.rsplit(':').next())
                    .and_then(|p| u16::from_str_radix(p, 16).ok());
                local_port == Some(port) && fields.get(3) == Some(&"01")
            })
    })
}

/// The stop fence of `key` (as chosen-core derives it), as the two int4 halves.
fn stop_fence(key: LockKey) -> (i32, i32) {
    let tag = match key {
        LockKey::Pair(a, b) => format!("pair:{a}:{b}"),
        LockKey::Int(k) => format!("int:{k}"),
    };
    match LockKey::derive("chosen.stop-fence", &tag) {
        LockKey::Pair(a, b) => (a, b),
        LockKey::Int(_) => unreachable!("derived keys are pairs"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_session_stays_open_until_the_next_session_fences_the_stopping_work() {
    let pg = PgCluster::start_local().unwrap();
    let admin = connect_admin(&pg.url()).await.unwrap();
    let manager = LockManager::connect(chosen_tests::manager_options(&pg.url(), "retiring"))
        .await
        .unwrap();
    let ConnectionState::Connected { backend_pid, .. } = manager.connection_status() else {
        panic!("not connected");
    };
    let lease = manager.acquire(unique_name("retire")).await.unwrap();
    let port: i32 = admin
        .query_one(
            "SELECT client_port FROM pg_stat_activity WHERE pid = $1",
            &[&backend_pid],
        )
        .await
        .unwrap()
        .get(0);
    let port = u16::try_from(port).expect("the harness connects over TCP");
    assert!(established_from(port), "the lock session's socket is found");
    // Something else holds the stop fence exclusively for now: the next session cannot
    // take it (its shared take times out and is retried).
    let (fa, fb) = stop_fence(lease.key());
    admin
        .execute("SELECT pg_advisory_lock($1, $2)", &[&fa, &fb])
        .await
        .unwrap();

    // The backend freezes: heartbeats go unanswered, the client gives the session up
    // while the server still has it (and the key).
    signal(backend_pid as u32, "STOP").unwrap();
    let lost = tokio::time::timeout(Duration::from_secs(15), lease.lost()).await;
    let outcome = async {
        lost.map_err(|_| "the lease was not lost".to_owned())?;
        // The next session connects, but cannot fence: the old one stays open.
        let until = Instant::now() + Duration::from_secs(1);
        while Instant::now() < until {
            if !established_from(port) {
                return Err(
                    "the lost session was closed before the next session held the stop fence"
                        .to_owned(),
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Once the fence can be had, the next session takes it, and then (long before
        // the lost session's deadline, `max_fence_wait` after the loss) the lost session
        // is closed, the fence held.
        admin
            .execute("SELECT pg_advisory_unlock($1, $2)", &[&fa, &fb])
            .await
            .map_err(|e| e.to_string())?;
        let unlocked = Instant::now();
        while established_from(port) {
            if unlocked.elapsed() > Duration::from_secs(2) {
                return Err(
                    "the lost session was not closed once the fence could be held".to_owned(),
                );
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let fenced: i64 = admin
            .query_one(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted \
                 AND mode = 'ShareLock' AND classid::int8 = ($1::int4::int8 & 4294967295) \
                 AND objid::int8 = ($2::int4::int8 & 4294967295) AND objsubid = 2 AND pid <> $3",
                &[&fa, &fb, &backend_pid],
            )
            .await
            .map_err(|e| e.to_string())?
            .get(0);
        if fenced == 0 {
            return Err("closed, but the next session holds no stop fence".to_owned());
        }
        Ok(())
    }
    .await;
    // Whatever happened, let the backend go on (it then sees its client gone).
    signal(backend_pid as u32, "CONT").unwrap();
    drop(lease);
    outcome.unwrap();
}

/// While this node's own lost session still holds the lock (kept open, as above), its
/// election follows and must not name this node as the leader: a redirect to the
/// leader would send clients back to this node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_never_names_itself_while_its_lost_session_holds_the_lock() {
    let pg = PgCluster::start_local().unwrap();
    let admin = connect_admin(&pg.url()).await.unwrap();
    let node = "self-naming";
    let manager = LockManager::connect(chosen_tests::manager_options(&pg.url(), node))
        .await
        .unwrap();
    let ConnectionState::Connected { backend_pid, .. } = manager.connection_status() else {
        panic!("not connected");
    };
    let name = unique_name("self");
    let election = chosen_core::Election::start(&manager, name.as_str()).unwrap();
    let leadership = election.leadership();
    tokio::time::timeout(Duration::from_secs(10), leadership.wait_leading())
        .await
        .expect("leading");
    // The next session cannot fence, so the lost one stays open, holding the lock.
    let (fa, fb) = stop_fence(LockKey::derive(chosen_core::DEFAULT_NAMESPACE, &name));
    admin
        .execute("SELECT pg_advisory_lock($1, $2)", &[&fa, &fb])
        .await
        .unwrap();
    signal(backend_pid as u32, "STOP").unwrap();
    let outcome = async {
        tokio::time::timeout(Duration::from_secs(15), leadership.wait_not_leading())
            .await
            .map_err(|_| "leadership was not lost".to_owned())?;
        // Past a refresh of the leader's name (every two seconds).
        let until = Instant::now() + Duration::from_secs(3);
        while Instant::now() < until {
            if leadership.leader().as_deref() == Some(node) {
                return Err(format!(
                    "the follower names itself: {:?}",
                    leadership.state()
                ));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    }
    .await;
    signal(backend_pid as u32, "CONT").unwrap();
    let _ = admin
        .execute("SELECT pg_advisory_unlock($1, $2)", &[&fa, &fb])
        .await;
    election.shutdown().await;
    outcome.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_election_that_loses_its_session_lets_the_next_leader_in_without_its_pause() {
    // The leader's session is terminated at the server. Its election pauses before it
    // contends again (two poll intervals), but it must drop the lost lease first: kept
    // through the pause, the lease keeps its key's stop fence held on the manager's
    // next session, and the node that takes the lock waits for that pause.
    use chosen_core::Election;

    let pg = PgCluster::start_local().unwrap();
    let admin = connect_admin(&pg.url()).await.unwrap();
    let options = |node: &str| {
        chosen_tests::manager_options(&pg.url(), node)
            .poll_interval(Duration::from_secs(2))
            .term_grant_delay(Duration::ZERO)
    };
    let name = unique_name("rejoin");
    let a = LockManager::connect(options("rj-a")).await.unwrap();
    let ea = Election::start(&a, name.as_str()).unwrap();
    let t0 = Instant::now();
    while !ea.leadership().is_leader() {
        assert!(t0.elapsed() < Duration::from_secs(10));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let b = LockManager::connect(options("rj-b")).await.unwrap();
    let eb = Election::start(&b, name.as_str()).unwrap();
    // b waits, registered for the lock's announcements.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let ConnectionState::Connected { backend_pid, .. } = a.connection_status() else {
        panic!("not connected");
    };
    admin
        .execute("SELECT pg_terminate_backend($1)", &[&backend_pid])
        .await
        .unwrap();
    let t0 = Instant::now();
    while !eb.leadership().is_leader() {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "nobody took over in 10 s"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let took = t0.elapsed();
    eprintln!("the next leader took over {took:?} after the termination");
    // The rejoin pause is 4 s; b polls every 2 s.
    assert!(
        took < Duration::from_millis(3500),
        "the next leader waited {took:?}, about the old leader's rejoin pause"
    );
    for m in [a, b] {
        m.shutdown().await;
    }
}
