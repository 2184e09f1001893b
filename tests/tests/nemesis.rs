//! Many nodes, random faults, an independent checker. The default profile runs about
//! a minute; `CHOSEN_NEMESIS_SECS=600` (and `CHOSEN_NEMESIS_SEED=...` to replay) runs
//! longer, see the README.

use chosen_tests::nemesis::{NemesisConfig, run};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nemesis_never_finds_two_holders() {
    let config = NemesisConfig::from_env();
    eprintln!(
        "nemesis: seed {} ({} nodes, {} singletons, {:?}); replay with CHOSEN_NEMESIS_SEED={}",
        config.seed, config.nodes, config.singletons, config.duration, config.seed
    );
    let (verdict, faults) = run(&config).await.expect("the nemesis runs");
    eprintln!(
        "nemesis: {} faults injected (seed {})\n{verdict}",
        faults.len(),
        config.seed
    );
    assert!(
        verdict.ok(),
        "the contract was broken (seed {}):\n{verdict}",
        config.seed
    );
    assert!(
        verdict.runs > config.singletons,
        "too few child runs to judge: {verdict}"
    );
}
