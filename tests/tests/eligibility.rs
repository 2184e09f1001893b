//! Who may lead: an ineligible node (`ManagerOptions::eligible(false)`), election
//! (`ElectionOptions::eligible(false)`) or singleton (`SingletonOptions::eligible`)
//! never leads, even when nobody else does; it follows whoever leads; and an
//! ineligible node's groups place every member on the eligible nodes.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use chosen_core::{
    Election, ElectionOptions, GroupOptions, LockManager, Singleton, SingletonGroup,
    SingletonOptions,
};
use chosen_tests::{PgCluster, prompt_options, unique_name};

/// Waits up to `limit` for `cond`.
async fn eventually(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let t0 = std::time::Instant::now();
    while t0.elapsed() < limit {
        if cond() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    cond()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ineligible_election_follows_and_never_leads() {
    let pg = PgCluster::start().unwrap();
    let url = pg.url();
    let name = unique_name("eligible");
    let a = LockManager::connect(prompt_options(&url, "el-a"))
        .await
        .unwrap();
    // Ineligible two ways: the whole node, and one election on an eligible node.
    let b = LockManager::connect(prompt_options(&url, "el-b").eligible(false))
        .await
        .unwrap();
    let c = LockManager::connect(prompt_options(&url, "el-c"))
        .await
        .unwrap();
    let ea = Election::start(&a, name.as_str()).unwrap();
    let eb = Election::start(&b, name.as_str()).unwrap();
    let ec = Election::start_with(
        &c,
        name.as_str(),
        ElectionOptions::default().eligible(false),
    )
    .unwrap();
    assert!(eventually(Duration::from_secs(10), || ea.leadership().is_leader()).await);
    // Both followers name the leader.
    for e in [&eb, &ec] {
        assert!(
            eventually(Duration::from_secs(5), || e
                .leadership()
                .leader()
                .as_deref()
                == Some("el-a"))
            .await,
            "{:?}",
            e.leadership().state()
        );
    }
    // The leader goes: nobody leads, and the ineligible ones do not take it, however
    // long they wait (an eligible follower would within about a poll).
    ea.shutdown().await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(!eb.leadership().is_leader());
    assert!(!ec.leadership().is_leader());
    // An eligible node comes: it leads, and they follow it.
    let d = LockManager::connect(prompt_options(&url, "el-d"))
        .await
        .unwrap();
    let ed = Election::start(&d, name.as_str()).unwrap();
    assert!(eventually(Duration::from_secs(10), || ed.leadership().is_leader()).await);
    assert!(
        eventually(Duration::from_secs(5), || eb
            .leadership()
            .leader()
            .as_deref()
            == Some("el-d"))
        .await
    );
    for m in [a, b, c, d] {
        m.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ineligible_singleton_never_starts_its_child() {
    let pg = PgCluster::start().unwrap();
    let name = unique_name("eligible-singleton");
    let manager = LockManager::connect(prompt_options(&pg.url(), "es-a"))
        .await
        .unwrap();
    let started = Arc::new(AtomicU32::new(0));
    let singleton = {
        let started = Arc::clone(&started);
        Singleton::start(
            &manager,
            name.as_str(),
            SingletonOptions::default().eligible(false),
            move |ctx| {
                started.fetch_add(1, Ordering::Relaxed);
                async move {
                    ctx.cancelled().await;
                    Ok::<(), std::io::Error>(())
                }
            },
        )
        .unwrap()
    };
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(started.load(Ordering::Relaxed), 0);
    assert!(!singleton.leadership().is_leader());
    manager.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ineligible_node_gets_no_group_member() {
    let pg = PgCluster::start().unwrap();
    let url = pg.url();
    let group = unique_name("eligible-group");
    let members: Vec<String> = (0..6).map(|i| format!("m{i}")).collect();
    let start = |manager: &LockManager| {
        SingletonGroup::start(
            manager,
            group.as_str(),
            members.clone(),
            GroupOptions::default().interval(Duration::from_millis(250)),
            |_member, ctx| async move {
                ctx.cancelled().await;
                Ok::<(), std::io::Error>(())
            },
        )
        .unwrap()
    };
    let a = LockManager::connect(prompt_options(&url, "eg-a"))
        .await
        .unwrap();
    let b = LockManager::connect(prompt_options(&url, "eg-b").eligible(false))
        .await
        .unwrap();
    let (ga, gb) = (start(&a), start(&b));
    assert!(
        eventually(Duration::from_secs(20), || ga.status().leading.len() == 6).await,
        "{:?}",
        ga.status()
    );
    // Stays so: the ineligible node neither joins nor takes a member.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(ga.status().leading.len(), 6);
    assert_eq!(ga.status().live_nodes, 1, "{:?}", ga.status());
    assert!(gb.status().leading.is_empty(), "{:?}", gb.status());
    assert_eq!(gb.status().target, None);
    // The eligible node leaves: the members are orphaned, not taken by the other.
    ga.shutdown().await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(gb.status().leading.is_empty(), "{:?}", gb.status());
    a.shutdown().await;
    b.shutdown().await;
}

// R3-4. `SingletonOptions::eligible(false)` passed to a group (`GroupOptions::singleton`)
// on an eligible manager: the node joins (holds a membership lock, so it is a live
// node with a target) but its member singletons never contend. The other node takes
// the members it is "placed" there only through the orphan safety net, is then above
// its target and hands one over again: a member's child is stopped and restarted
// every orphan_grace, for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ineligible_member_singletons_do_not_make_a_group_churn() {
    let pg = PgCluster::start().unwrap();
    let url = pg.url();
    let group = unique_name("eligible-group-singleton");
    let members: Vec<String> = (0..2).map(|i| format!("m{i}")).collect();
    let starts = Arc::new(AtomicU32::new(0));
    let start = |manager: &LockManager, singleton: SingletonOptions| {
        let starts = Arc::clone(&starts);
        SingletonGroup::start(
            manager,
            group.as_str(),
            members.clone(),
            GroupOptions::default()
                .interval(Duration::from_millis(250))
                .orphan_grace(Duration::from_secs(1))
                .singleton(singleton),
            move |_member, ctx| {
                starts.fetch_add(1, Ordering::Relaxed);
                async move {
                    ctx.cancelled().await;
                    Ok::<(), std::io::Error>(())
                }
            },
        )
        .unwrap()
    };
    let a = LockManager::connect(prompt_options(&url, "egs-a"))
        .await
        .unwrap();
    let b = LockManager::connect(prompt_options(&url, "egs-b"))
        .await
        .unwrap();
    let ga = start(&a, SingletonOptions::default());
    let gb = start(&b, SingletonOptions::default().eligible(false));
    tokio::time::sleep(Duration::from_secs(12)).await;
    let (sa, sb) = (ga.status(), gb.status());
    assert!(sb.leading.is_empty(), "{sb:?}");
    assert_eq!(
        (sa.handed_over, starts.load(Ordering::Relaxed)),
        (0, 2),
        "node a: {sa:?}; node b: {sb:?}"
    );
    a.shutdown().await;
    b.shutdown().await;
}

// An ineligible election registers no request with its manager (its acquire
// future is never polled), and step_down on it does nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ineligible_election_sends_no_request() {
    let pg = PgCluster::start().unwrap();
    let url = pg.url();
    let name = unique_name("eligible-probe");
    let b = LockManager::connect(prompt_options(&url, "ep-b").eligible(false))
        .await
        .unwrap();
    let c = LockManager::connect(prompt_options(&url, "ep-c"))
        .await
        .unwrap();
    let eb = Election::start(&b, name.as_str()).unwrap();
    let ec = Election::start_with(
        &c,
        name.as_str(),
        ElectionOptions::default().eligible(false),
    )
    .unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    eb.step_down();
    ec.step_down();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(b.locks().await.unwrap().is_empty());
    assert!(c.locks().await.unwrap().is_empty());
    assert!(!eb.leadership().is_leader() && !ec.leadership().is_leader());
    b.shutdown().await;
    c.shutdown().await;
}
