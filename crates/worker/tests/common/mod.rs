//! Shared helpers for the worker's broker tests: unique names and their topologies, publishing
//! and DLQ reading. Connection, management API and polling come from `redeliver-testkit`.
#![allow(dead_code)]

use std::collections::HashMap;
use std::time::Instant;

use futures::future::join_all;
use redeliver_worker::lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use redeliver_worker::lapin::types::AMQPValue;
use redeliver_worker::lapin::{BasicProperties, Connection};
use redeliver_worker::{DelayConfig, QueueType, Topology};

#[allow(unused_imports)] // each test file uses a different subset
pub use redeliver_testkit::mgmt::{
    connection_unacked, connections_named, delete_prefix as cleanup_prefix, kill_connections,
    prefix_stats, queue_stats, url as mgmt_url, wait_for_connection, QueueStats,
};
#[allow(unused_imports)] // each test file uses a different subset
pub use redeliver_testkit::{amqp_url, connect, eventually, ready_count};

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
        cleanup_prefix(&self.prefix);
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

/// A message read from a queue with basic.get.
#[derive(Debug)]
pub struct Got {
    pub body: Vec<u8>,
    pub properties: BasicProperties,
}

impl Got {
    pub fn message_id(&self) -> String {
        redeliver_testkit::message_id(&self.properties)
    }

    pub fn header(&self, name: &str) -> Option<&AMQPValue> {
        self.properties.headers().as_ref()?.inner().get(name)
    }

    pub fn header_str(&self, name: &str) -> Option<String> {
        match self.header(name)? {
            AMQPValue::LongString(s) => Some(s.to_string()),
            AMQPValue::ShortString(s) => Some(s.to_string()),
            _ => None,
        }
    }

    pub fn header_int(&self, name: &str) -> Option<i64> {
        match self.header(name)? {
            AMQPValue::LongLongInt(v) => Some(*v),
            AMQPValue::LongInt(v) => Some(i64::from(*v)),
            AMQPValue::ShortInt(v) => Some(i64::from(*v)),
            AMQPValue::LongUInt(v) => Some(i64::from(*v)),
            _ => None,
        }
    }
}

/// Takes (and acks) every message currently in `queue`.
pub async fn drain_queue(conn: &Connection, queue: &str) -> Vec<Got> {
    redeliver_testkit::drain(conn, queue)
        .await
        .into_iter()
        .map(|m| Got {
            body: m.delivery.data,
            properties: m.delivery.properties,
        })
        .collect()
}

/// Shared per-message call log for handlers: message id -> (attempt seen, instant).
pub type Calls = std::sync::Arc<std::sync::Mutex<HashMap<String, Vec<(u32, Instant)>>>>;

pub fn record(calls: &Calls, id: &str, attempt: u32) -> usize {
    let mut map = calls.lock().unwrap();
    let v = map.entry(id.to_owned()).or_default();
    v.push((attempt, Instant::now()));
    v.len()
}

pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_test_writer()
        .try_init();
}

/// Waits (up to 10 s) until the management API lists the connection named `name`: it shows a new
/// connection only at its next statistics emission.
pub async fn await_listed_connection(name: &str) {
    let n = name.to_owned();
    let listed = tokio::task::spawn_blocking(move || {
        wait_for_connection(&n, std::time::Duration::from_secs(10))
    })
    .await
    .expect("management API task");
    assert!(listed, "management API never listed connection {name}");
}

/// Force-closes the one connection named `name` through the management API.
pub async fn force_close_connection(name: &str) {
    let n = name.to_owned();
    let killed = tokio::task::spawn_blocking(move || kill_connections(&n))
        .await
        .expect("management API task");
    assert_eq!(killed, 1, "one connection named {name} to close");
}

/// The objects most tests start from: unique names (their objects are deleted when they drop, so
/// keep the binding), a connection, and queue `q`'s topology with its own delay levels, and its
/// full name.
pub async fn fixture(
    test: &str,
    queue_type: QueueType,
    levels: u8,
    level_type: QueueType,
) -> (Names, Connection, Topology, String) {
    let names = Names::new(test);
    let conn = redeliver_testkit::connect().await;
    let topo = names.topology("q", queue_type, names.delay(levels, level_type));
    let queue = topo.queue_name();
    (names, conn, topo, queue)
}

/// Runs the worker `builder` makes until `token` is cancelled, once it consumes: its status
/// handle and its task. Panics when it does not consume within 20 s.
pub async fn run_consuming(
    builder: redeliver_worker::WorkerBuilder,
    token: &redeliver_worker::CancellationToken,
) -> (
    redeliver_worker::WorkerStatus,
    tokio::task::JoinHandle<Result<(), redeliver_worker::WorkerError>>,
) {
    let mut status = builder.status_handle();
    let run = tokio::spawn(builder.run(token.clone()));
    status
        .wait_for_timeout(std::time::Duration::from_secs(20), |s| {
            *s == redeliver_worker::WorkerState::Consuming
        })
        .await
        .expect("the worker never started consuming");
    (status, run)
}
