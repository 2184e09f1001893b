//! The benchmark suite's tiny profile, so CI keeps it working.

#[path = "../benches/suite_impl.rs"]
mod suite_impl;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn benchmark_suite_runs() {
    let report = suite_impl::run(
        &suite_impl::Profile::smoke(),
        env!("CARGO_BIN_EXE_chosen-holder"),
    )
    .await
    .unwrap();
    assert!(
        ["### 1.", "### 4.", "### 5.", "### 6.", "### 9.", "| 0 |"]
            .iter()
            .all(|section| report.contains(section)),
        "{report}"
    );
}
