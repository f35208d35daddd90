//! Helpers shared by the broker tests; the broker-facing ones come from `redeliver-testkit`.
#![allow(dead_code)]

use futures::FutureExt;
use redeliver_amqp::lapin::options::BasicConsumeOptions;
use redeliver_amqp::lapin::types::FieldTable;
use redeliver_amqp::lapin::{Channel, Consumer};
use std::future::Future;
use std::panic::AssertUnwindSafe;

/// `get(ch, queue, timeout)`: polls `queue` with basic.get until a message arrives or the timeout.
#[allow(unused_imports)] // each test file uses a different subset
pub use redeliver_testkit::{connect, poll_get as get};

/// A unique prefix for every object a test declares, such as "t3f9a0c1b2d4e.".
pub fn prefix() -> String {
    redeliver_testkit::unique_prefix("t", 12, ".")
}

/// Runs `body`, then `cleanup` whether or not `body` panicked, then re-raises the panic.
pub async fn with_cleanup<B, C>(body: B, cleanup: C)
where
    B: Future<Output = ()>,
    C: Future<Output = ()>,
{
    let outcome = AssertUnwindSafe(body).catch_unwind().await;
    cleanup.await;
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

pub async fn consume(ch: &Channel, queue: &str) -> Consumer {
    ch.basic_consume(
        queue.into(),
        "".into(),
        BasicConsumeOptions::default(),
        FieldTable::default(),
    )
    .await
    .expect("basic_consume")
}
