//! What every broker test of the worker uses: unique names and their topologies, publishing,
//! tracing. The helpers only some tests use are files of their own in this directory, which
//! those tests declare (`#[path = "common/fixture.rs"] mod fixture;`). Connection, reading
//! queues, the management API and polling come from `redeliver-testkit`.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code); helpers are `pub` for the test files that include this module.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    unreachable_pub
)]

use futures::future::join_all;
use redeliver_amqp::lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use redeliver_amqp::lapin::{BasicProperties, Connection};
use redeliver_amqp::{DelayConfig, QueueType, Topology};
use redeliver_testkit::mgmt::delete_prefix;

/// A unique prefix for every object of one test, and removal of all of them on drop (even when
/// the test panics), through the management API.
pub struct Names {
    pub prefix: String,
}

impl Names {
    pub fn new(test: &str) -> Self {
        Self {
            prefix: redeliver_testkit::unique_prefix(&format!("rdw-{test}-"), 8, "-"),
        }
    }

    /// Delay configuration with the test's prefix; few classic levels unless told otherwise,
    /// because creating 24 quorum queues per test is slow and the levels are the amqp crate's
    /// subject, not this one's.
    pub fn delay(&self, levels: u8, queue_type: QueueType) -> DelayConfig {
        DelayConfig::new()
            .prefix(self.prefix.clone())
            .levels(levels)
            .queue_type(queue_type)
    }

    pub fn topology(&self, queue: &str, queue_type: QueueType, delay: DelayConfig) -> Topology {
        Topology::new(queue)
            .prefix(self.prefix.clone())
            .queue_type(queue_type)
            .delay(delay)
    }
}

impl Drop for Names {
    fn drop(&mut self) {
        delete_prefix(&self.prefix);
    }
}

pub fn props(message_id: &str) -> BasicProperties {
    BasicProperties::default()
        .with_message_id(message_id.into())
        .with_content_type("application/json".into())
        .with_delivery_mode(2)
}

/// Publishes `(body, properties)` to `queue` through the default exchange, with confirms,
/// many in flight at once.
pub async fn publish_all(
    conn: &Connection,
    queue: &str,
    messages: Vec<(Vec<u8>, BasicProperties)>,
) {
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    for chunk in messages.chunks(500) {
        let mut confirms = Vec::with_capacity(chunk.len());
        for (body, p) in chunk {
            let c = ch
                .basic_publish(
                    "".into(),
                    queue.into(),
                    BasicPublishOptions {
                        mandatory: true,
                        ..Default::default()
                    },
                    body,
                    p.clone(),
                )
                .await
                .unwrap();
            confirms.push(c);
        }
        for c in join_all(confirms).await {
            let c = c.unwrap();
            assert!(c.is_ack(), "publish not acked");
            assert!(
                c.take_message().is_none(),
                "publish returned: no queue {queue}?"
            );
        }
    }
    let _ = ch.close(200, "ok".into()).await;
}

pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_test_writer()
        .try_init();
}
