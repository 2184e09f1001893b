//! Many nodes, random faults, an independent checker. The default profile runs about
//! a minute; `CHOSEN_NEMESIS_SECS=600` (and `CHOSEN_NEMESIS_SEED=...` to replay) runs
//! longer, see the README.
//!
//! Against your own server (a TCP server the nodes reach without TLS, a role that may
//! take advisory locks and, for `terminate_backend`, end its own sessions):
//!
//! ```text
//! DATABASE_URL=postgres://user:pw@host:5432/db CHOSEN_NEMESIS_SECS=300 \
//!     cargo test --release -p chosen-tests --test nemesis -- --nocapture
//! ```
//!
//! The faults that need a local cluster (restarts, a stopped server, a failover to a
//! standby) are then left out, as the first line on stderr says; the rest (signals,
//! cuts, black holes, latency through loopback proxies) run as against a local one.

use std::time::Duration;

use chosen_tests::nemesis::{NemesisConfig, run};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nemesis_never_finds_two_holders() {
    judge(&NemesisConfig::from_env()).await;
}

/// The lease-row mode through a transaction pooler (PgBouncer): nodes killed, frozen
/// past the rows' lifetime, black-holed and stopped gracefully, and the server behind
/// the pooler restarted (cleanly and as after a crash), stopped for a while, or failed
/// over to its standby; the checker's verdict and the takeover times, per fault kind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_row_nemesis_never_finds_two_holders() {
    let mut config = NemesisConfig::from_env();
    if std::env::var_os("DATABASE_URL").is_some() {
        eprintln!(
            "SKIPPED lease_row_nemesis_never_finds_two_holders: it starts its own pooler in front of a local cluster"
        );
        return;
    }
    config.lease_rows = true;
    config.nodes = 3;
    config.singletons = 4;
    config.group_members = 0;
    config.duration = config.duration.min(Duration::from_secs(30));
    judge(&config).await;
}

async fn judge(config: &NemesisConfig) {
    let config = config.clone();
    eprintln!(
        "nemesis: seed {} ({} nodes, {} singletons, {:?}); replay with CHOSEN_NEMESIS_SEED={}",
        config.seed, config.nodes, config.singletons, config.duration, config.seed
    );
    let report = run(&config).await.expect("the nemesis runs");
    let mode = if config.lease_rows {
        "lease rows"
    } else {
        "advisory locks"
    };
    for (kind, times) in &report.verdict.takeovers {
        let mut ms: Vec<u128> = times.iter().map(Duration::as_millis).collect();
        ms.sort_unstable();
        eprintln!(
            "nemesis ({mode}): {kind}: {} takeovers, median {} ms, max {} ms",
            ms.len(),
            ms.get(ms.len() / 2).copied().unwrap_or(0),
            ms.last().copied().unwrap_or(0)
        );
    }
    let verdict = &report.verdict;
    eprintln!(
        "nemesis: {} faults injected (seed {})\n{verdict}",
        report.faults.len(),
        config.seed
    );
    assert!(
        verdict.safe(),
        "the contract was broken (seed {}):\n{verdict}",
        config.seed
    );
    assert!(
        report.problems.is_empty(),
        "the nodes misbehaved (seed {}):\n{}",
        config.seed,
        report.problems.join("\n")
    );
    assert!(
        verdict.ok(),
        "a fault did not take effect or was not followed by a takeover (seed {}):\n{verdict}",
        config.seed
    );
    if config.group_members > 0 {
        let placement = verdict
            .placement
            .as_ref()
            .expect("the nemesis names its group");
        assert!(
            placement.ok(),
            "the group's placement broke its bounds (seed {}): {placement}",
            config.seed
        );
        assert!(
            placement.judged > 0,
            "no moment of the run was judged for placement (seed {}): {placement}",
            config.seed
        );
    }
    for kind in &report.deck.kinds {
        assert!(
            verdict.faults.contains_key(kind),
            "{kind} was never injected: {verdict}"
        );
    }
    // Every fault kind that takes a lease away was seen to: a run where faults missed
    // every holder would prove nothing.
    for kind in [
        "sigkill",
        "sigstop_long",
        "cut",
        "terminate_backend",
        "sigterm",
        "failover",
    ]
    .into_iter()
    .filter(|kind| report.deck.deals(kind))
    {
        assert!(
            verdict.takeovers.contains_key(kind),
            "no takeover after any {kind} (seed {}): {verdict}",
            config.seed
        );
    }
    // Generous: the server release time, a lease timeout and 10 s of polls, backoff
    // and a busy machine.
    let bound = config.timing.release + config.timing.lease_timeout + Duration::from_secs(10);
    assert!(
        verdict.longest_leaderless < bound,
        "a singleton went without a holder for {:?} (bound {bound:?}, seed {}): {verdict}",
        verdict.longest_leaderless,
        config.seed
    );
    assert!(
        verdict.runs > config.singletons,
        "too few child runs to judge: {verdict}"
    );
}
