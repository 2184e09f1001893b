//! Names and gauges the library must keep to itself (issue 12, session 4): a lock of
//! yours can never be one of the library's own (an election's preferred-node lock, a
//! group's slot or member lock, a stop fence or interest key), and a manager that ends
//! reports nothing as still waited for, connected or not.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chosen_core::{
    Election, ElectionOptions, Error, GroupOptions, LeaderContext, LockManager, ManagerOptions,
    SingletonGroup,
};
use chosen_tests::{PgCluster, prompt_options, unique_name};

fn reserved(result: Result<impl std::fmt::Debug, Error>) -> String {
    match result {
        Err(Error::InvalidName(message)) => {
            assert!(message.contains("reserved"), "{message}");
            message
        }
        other => panic!("expected InvalidName (reserved), got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_library_s_own_lock_names_are_refused_and_still_work_for_the_library() {
    let pg = PgCluster::start().unwrap();
    let m = LockManager::connect(prompt_options(&pg.url(), "names-a"))
        .await
        .unwrap();
    let other = LockManager::connect(prompt_options(&pg.url(), "names-b"))
        .await
        .unwrap();
    let name = unique_name("names-e");
    // `other` leads; then `m` contends as a preferred node, holding
    // `chosen.prefer/<name>` while it does (taken through the manager by name).
    let leader = Election::start(&other, name.as_str()).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !leader.leadership().is_leader() {
        assert!(Instant::now() < deadline, "the first election never led");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let election = Election::start_with(
        &m,
        name.as_str(),
        ElectionOptions::default().preferred(true),
    )
    .unwrap();
    let prefer = format!("chosen.prefer/{name}");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let held = m.cluster_locks(&[prefer.as_str()]).await.unwrap();
        if held
            .iter()
            .any(|l| l.name.as_deref() == Some(prefer.as_str()) && l.holder.node_id == "names-a")
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the presence lock was never taken"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // No other lock may take it by name: that would make a leader see a preferred node
    // that is not there, and hand over to it.
    let message = reserved(other.try_acquire(prefer.as_str()).await);
    assert!(message.contains(&prefer), "{message}");
    reserved(other.acquire(prefer.as_str()).await);
    reserved(other.acquire(format!("chosen.group/g/member/{name}")).await);
    reserved(Election::start(&other, "chosen.anything"));
    let child = |_: LeaderContext| async { Ok::<(), std::io::Error>(()) };
    reserved(chosen_core::Singleton::start(
        &other,
        "chosen.anything",
        chosen_core::SingletonOptions::default(),
        child,
    ));
    // Looking one up is fine.
    other.holder(prefer.as_str()).await.unwrap();
    // A prefix that is not the reserved one is a name like any other.
    let _jobs = other.try_acquire("chosen-jobs").await.unwrap().unwrap();
    let _plain = other.try_acquire("chosen").await.unwrap().unwrap();

    election.shutdown().await;
    leader.shutdown().await;
    other.shutdown().await;
    m.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_name_with_a_slash_is_refused() {
    // Group "a" member "b/member/c" and group "a/member/b" member "c" would share the
    // lock `chosen.group/a/member/b/member/c`.
    let pg = PgCluster::start().unwrap();
    let m = LockManager::connect(prompt_options(&pg.url(), "names-g"))
        .await
        .unwrap();
    let child = |_: String, _: LeaderContext| async { Ok::<(), std::io::Error>(()) };
    let Err(err) = SingletonGroup::start(&m, "a/member/b", ["c"], GroupOptions::default(), child)
    else {
        panic!("a group name with '/' must be refused");
    };
    match &err {
        Error::InvalidName(message) => assert!(message.contains("'/'"), "{message}"),
        other => panic!("expected InvalidName, got {other:?}"),
    }
    // Members may contain '/': the group's name comes first and has none.
    let group =
        SingletonGroup::start(&m, "a", ["b/member/c"], GroupOptions::default(), child).unwrap();
    group.shutdown().await;
    m.shutdown().await;
}

/// Review finding: the group's member locks (`chosen.group/<g>/member/<m>`) are the
/// library's own, and must not be refused as a user's reserved name would be (the first
/// version of the check left every group silently idle).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_member_still_runs() {
    let pg = PgCluster::start().unwrap();
    let m = LockManager::connect(prompt_options(&pg.url(), "names-run"))
        .await
        .unwrap();
    let ran = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let group = SingletonGroup::start(
        &m,
        unique_name("names-group"),
        ["only"],
        GroupOptions::default().interval(Duration::from_millis(100)),
        {
            let ran = Arc::clone(&ran);
            move |_member: String, ctx: LeaderContext| {
                let ran = Arc::clone(&ran);
                async move {
                    ran.store(true, std::sync::atomic::Ordering::SeqCst);
                    ctx.cancelled().await;
                    Ok::<(), std::io::Error>(())
                }
            }
        },
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !ran.load(std::sync::atomic::Ordering::SeqCst) {
        assert!(Instant::now() < deadline, "the group's member never ran");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    group.shutdown().await;
    m.shutdown().await;
}

#[test]
fn a_namespace_with_the_reserved_prefix_is_refused() {
    for namespace in ["chosen.stop-fence", "chosen.interest", "chosen.x"] {
        let err = ManagerOptions::from_url("postgres://u@localhost/db")
            .unwrap()
            .namespace(namespace)
            .validate()
            .expect_err(namespace);
        match &err {
            Error::InvalidConfig { setting, message } => {
                assert_eq!(*setting, "ManagerOptions::namespace", "{err}");
                assert!(message.contains("reserved"), "{err}");
            }
            other => panic!("expected InvalidConfig, got {other:?}"),
        }
    }
    for namespace in ["chosen", "chosen-billing", "billing"] {
        ManagerOptions::from_url("postgres://u@localhost/db")
            .unwrap()
            .namespace(namespace)
            .validate()
            .expect(namespace);
    }
}

/// The last number of waiters reported per lock.
#[derive(Debug, Default)]
struct Waiters(Mutex<HashMap<String, usize>>);

impl chosen_core::MetricsSink for Waiters {
    fn lock_waiting(&self, _node: &str, lock: &str, waiters: usize) {
        self.0.lock().unwrap().insert(lock.to_owned(), waiters);
    }
}

impl Waiters {
    fn of(&self, lock: &str) -> Option<usize> {
        self.0.lock().unwrap().get(lock).copied()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manager_ending_while_disconnected_reports_no_waiters_left() {
    let mut pg = PgCluster::start().unwrap();
    let holder = LockManager::connect(prompt_options(&pg.url(), "names-holder"))
        .await
        .unwrap();
    let lock = unique_name("names-w");
    let lease = holder.acquire(lock.as_str()).await.unwrap();
    let waiters = Arc::new(Waiters::default());
    let waiter =
        LockManager::connect(prompt_options(&pg.url(), "names-waiter").metrics(waiters.clone()))
            .await
            .unwrap();
    let waiting = tokio::spawn({
        let waiter = waiter.clone();
        let lock = lock.clone();
        async move { waiter.acquire(lock.as_str()).await.map(drop) }
    });
    let deadline = Instant::now() + Duration::from_secs(20);
    while waiters.of(&lock) != Some(1) {
        assert!(Instant::now() < deadline, "the wait was never reported");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The server goes away: the waiter's session is lost, its request keeps waiting.
    pg.stop("immediate").unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while waiter.connection_status().is_connected() {
        assert!(
            Instant::now() < deadline,
            "the waiter never saw its session end"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    waiter.shutdown().await;
    let answer = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("the waiting request is answered at shutdown")
        .unwrap();
    assert!(matches!(answer, Err(Error::Closed)), "{answer:?}");
    assert_eq!(
        waiters.of(&lock),
        Some(0),
        "a manager that ended still reports a waiter"
    );
    drop(lease);
    holder.shutdown().await;
}

/// Review findings: a raw key's lease, election or singleton is named `key(a, b)`
/// (`key(k)` for a one-integer key). A lock *named* that way was another advisory lock
/// under the same name: it wrote to the raw key's fence row (so the rightful holder
/// with the older token got `StaleToken` for as long as it held its lock), and its
/// election shared the key election's presence lock (its leader handed over to a node
/// that was not contending there). Such names are refused now, and a raw key's
/// presence lock is `chosen.prefer-key/<key>`, which no name can produce.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_like_a_raw_key_s_is_refused_and_key_elections_still_fail_back() {
    use chosen_core::LockKey;
    let pg = PgCluster::start().unwrap();
    let l = LockManager::connect(prompt_options(&pg.url(), "names-l"))
        .await
        .unwrap();
    let p = LockManager::connect(prompt_options(&pg.url(), "names-p"))
        .await
        .unwrap();
    let key = LockKey::derive("names-test", &unique_name("k"));
    let like_key = format!("key{key}");
    reserved(l.acquire(like_key.as_str()).await);
    reserved(l.try_acquire("key(7)").await);
    reserved(l.try_acquire("key(-1, 2)").await);
    reserved(Election::start(&l, like_key.as_str()));
    // Names that only look a little like one are names like any other.
    for name in [
        "key",
        "key()",
        "key(a)",
        "key(1, 2, 3)",
        "mykey(1)",
        "key(1)x",
    ] {
        let lease = l.try_acquire(name).await.unwrap();
        assert!(lease.is_some(), "{name}");
    }

    // The key election fails back to its preferred node through the new presence lock.
    let on_key = Election::start_with(
        &l,
        key,
        ElectionOptions::default().fail_back_after(Duration::from_secs(1)),
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !on_key.leadership().is_leader() {
        assert!(Instant::now() < deadline, "l never led");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let preferred =
        Election::start_with(&p, key, ElectionOptions::default().preferred(true)).unwrap();
    let presence = format!("chosen.prefer-key/{}", tag(key));
    let deadline = Instant::now() + Duration::from_secs(20);
    while !preferred.leadership().is_leader() {
        assert!(
            Instant::now() < deadline,
            "the key election never failed back to p"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The presence lock was taken under its new name (p let it go once it led).
    assert!(
        p.holder(presence.as_str()).await.unwrap().is_none(),
        "p still holds {presence} after it led"
    );
    preferred.shutdown().await;
    on_key.shutdown().await;
    p.shutdown().await;
    l.shutdown().await;
}

/// A key's tag, as the library derives stop fences and presence locks from it.
fn tag(key: chosen_core::LockKey) -> String {
    match key {
        chosen_core::LockKey::Pair(a, b) => format!("pair:{a}:{b}"),
        chosen_core::LockKey::Int(k) => format!("int:{k}"),
    }
}

/// Review finding (the fence half of the one above): a raw key's lease fences under
/// its name, `key(a, b)`; no lock named that way can share that fence row any more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_lease_does_not_share_its_fence_with_a_lock_named_like_it() {
    use chosen_core::{LockKey, fenced};
    let pg = PgCluster::start().unwrap();
    let mut client = chosen_tests::connect_admin(&pg.url()).await.unwrap();
    fenced::install(&client).await.unwrap();
    let m = LockManager::connect(prompt_options(&pg.url(), "names-f"))
        .await
        .unwrap();
    let key = LockKey::derive("names-test", &unique_name("k"));
    let on_key = m.acquire(key).await.unwrap();
    reserved(m.acquire(format!("key{key}")).await);
    let tx = client.transaction().await.unwrap();
    on_key.fence(&tx).await.unwrap();
    tx.commit().await.unwrap();
    drop(on_key);
    m.shutdown().await;
}
