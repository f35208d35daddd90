//! The hostile-input suite on both transports: AMQP 0-9-1 with the delay levels on every broker,
//! AMQP 1.0 with native retries where the broker holds them (RabbitMQ 4.3+, quorum queues).
//! The queue type a retry mode needs is in `common/mode_queue.rs`.

// Test code: helpers are `pub` for the test files that include this module.
#![allow(clippy::panic, unreachable_pub)]

use redeliver_worker::RetryMode;

/// Whether this broker holds native retries. If not (before 4.3), asserts that version's
/// behaviour instead of the `test`: a worker asked for native retries refuses to start, saying
/// why, before it declares anything.
pub async fn native_or_skip(test: &str) -> bool {
    let version = redeliver_testkit::broker_version().await;
    let holds = version.holds_native_retries();
    if !holds {
        let queue = redeliver_testkit::unique_prefix("rdw-refused-", 8, "");
        let run = redeliver_worker::Worker::builder(redeliver_testkit::amqp_url())
            .queue(queue)
            .retry_mode(RetryMode::Native)
            .handler(
                |_: redeliver_worker::Raw, _: redeliver_worker::Context| async {
                    Ok::<(), redeliver_core::HandlerError>(())
                },
            )
            .build()
            .expect("build")
            .run(tokio_util::sync::CancellationToken::new());
        let result = tokio::time::timeout(std::time::Duration::from_secs(30), run).await;
        assert!(
            matches!(result, Ok(Err(redeliver_worker::WorkerError::RetryMode(_)))),
            "{test}: RabbitMQ {version} holds no native retries, and a native worker must refuse to start: {result:?}"
        );
    }
    holds
}
