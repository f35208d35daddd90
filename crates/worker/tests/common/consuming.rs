//! Running a worker in the background of a test.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code); helpers are `pub` for the test files that include this module.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    unreachable_pub
)]

/// Runs the worker `builder` makes until `token` is cancelled, once it consumes: its status
/// handle and its task. Panics when it does not consume within 20 s.
pub async fn run_consuming(
    builder: redeliver_worker::WorkerBuilder,
    token: &tokio_util::sync::CancellationToken,
) -> (
    redeliver_worker::WorkerStatus,
    tokio::task::JoinHandle<Result<(), redeliver_worker::WorkerError>>,
) {
    let worker = builder.build().expect("build");
    let mut status = worker.status_handle();
    let run = tokio::spawn(worker.run(token.clone()));
    status
        .wait_for_timeout(std::time::Duration::from_secs(20), |s| {
            *s == redeliver_worker::WorkerState::Consuming
        })
        .await
        .expect("the worker never started consuming");
    (status, run)
}
