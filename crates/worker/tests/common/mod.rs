//! Shared helpers for the worker's broker tests: connection, unique names, publishing, DLQ
//! reading and the management API (for unacked counts and killing connections).
#![allow(dead_code)]

use std::collections::HashMap;
use std::time::{Duration, Instant};

use futures::future::join_all;
use redeliver_worker::lapin::options::{
    BasicAckOptions, BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions,
    QueueDeclareOptions,
};
use redeliver_worker::lapin::types::{AMQPValue, FieldTable};
use redeliver_worker::lapin::{BasicProperties, Connection, ConnectionProperties};
use redeliver_worker::{DelayConfig, QueueType, Topology};

pub fn amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

pub fn mgmt_url() -> String {
    std::env::var("RABBITMQ_MGMT_URL").unwrap_or_else(|_| "http://127.0.0.1:15672".into())
}

fn mgmt_auth() -> String {
    let user = std::env::var("RABBITMQ_MGMT_USER").unwrap_or_else(|_| "guest".into());
    let pass = std::env::var("RABBITMQ_MGMT_PASSWORD").unwrap_or_else(|_| "guest".into());
    format!("Basic {}", base64(format!("{user}:{pass}").as_bytes()))
}

fn base64(input: &[u8]) -> String {
    const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in input.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(T[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Connects or panics with instructions: a broker test never skips.
pub async fn connect() -> Connection {
    let url = amqp_url();
    match Connection::connect(&url, ConnectionProperties::default()).await {
        Ok(c) => c,
        Err(e) => panic!(
            "cannot connect to RabbitMQ at {url}: {e}\n\
             These tests need a real broker. Start one with `rabbitmq-server -detached` \
             (management plugin enabled: `rabbitmq-plugins enable rabbitmq_management`), \
             or set AMQP_URL."
        ),
    }
}

/// A unique prefix for every object of one test, and removal of all of them on drop (even when
/// the test panics), through the management API.
pub struct Names {
    pub prefix: String,
}

impl Names {
    pub fn new(test: &str) -> Self {
        let id = uuid::Uuid::new_v4().simple().to_string();
        Self {
            prefix: format!("rdw-{test}-{}-", &id[..8]),
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

fn mgmt_get(path: &str) -> Result<serde_json::Value, String> {
    let url = format!("{}{}", mgmt_url(), path);
    let mut resp = ureq::get(&url)
        .header("Authorization", &mgmt_auth())
        .call()
        .map_err(|e| {
            format!(
                "management API {url}: {e} (enable it with `rabbitmq-plugins enable rabbitmq_management`)"
            )
        })?;
    resp.body_mut()
        .read_json::<serde_json::Value>()
        .map_err(|e| e.to_string())
}

fn mgmt_delete(path: &str) -> Result<(), String> {
    let url = format!("{}{}", mgmt_url(), path);
    ureq::delete(&url)
        .header("Authorization", &mgmt_auth())
        .call()
        .map(|_| ())
        .map_err(|e| format!("DELETE {url}: {e}"))
}

fn pct(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Deletes every queue and exchange of the default vhost whose name starts with `prefix`.
pub fn cleanup_prefix(prefix: &str) {
    for kind in ["queues", "exchanges"] {
        let Ok(list) = mgmt_get(&format!("/api/{kind}/%2f?columns=name")) else {
            eprintln!("cleanup of {prefix}: management API unreachable");
            return;
        };
        for item in list.as_array().into_iter().flatten() {
            if let Some(name) = item["name"].as_str() {
                if name.starts_with(prefix) {
                    let _ = mgmt_delete(&format!("/api/{kind}/%2f/{}", pct(name)));
                }
            }
        }
    }
}

/// Queue counters from the management API (they lag the broker by its statistics interval).
#[derive(Debug, Clone, Copy, Default)]
pub struct QueueStats {
    pub messages: u64,
    pub ready: u64,
    pub unacked: u64,
}

pub fn queue_stats(name: &str) -> QueueStats {
    let v = mgmt_get(&format!("/api/queues/%2f/{}", pct(name))).unwrap_or_else(|e| panic!("{e}"));
    QueueStats {
        messages: v["messages"].as_u64().unwrap_or(0),
        ready: v["messages_ready"].as_u64().unwrap_or(0),
        unacked: v["messages_unacknowledged"].as_u64().unwrap_or(0),
    }
}

/// Sum of `messages` over queues whose name starts with `prefix`, and the per-queue unacked sum.
pub fn prefix_stats(prefix: &str) -> QueueStats {
    let list =
        mgmt_get("/api/queues/%2f?columns=name,messages,messages_ready,messages_unacknowledged")
            .unwrap_or_else(|e| panic!("{e}"));
    let mut s = QueueStats::default();
    for q in list.as_array().into_iter().flatten() {
        if q["name"].as_str().is_some_and(|n| n.starts_with(prefix)) {
            s.messages += q["messages"].as_u64().unwrap_or(0);
            s.ready += q["messages_ready"].as_u64().unwrap_or(0);
            s.unacked += q["messages_unacknowledged"].as_u64().unwrap_or(0);
        }
    }
    s
}

/// Management names of the connections with client property `connection_name == name`.
pub fn connections_named(name: &str) -> Vec<String> {
    let list = mgmt_get("/api/connections?columns=name,client_properties")
        .unwrap_or_else(|e| panic!("{e}"));
    list.as_array()
        .into_iter()
        .flatten()
        .filter(|c| c["client_properties"]["connection_name"].as_str() == Some(name))
        .filter_map(|c| c["name"].as_str().map(str::to_owned))
        .collect()
}

/// Unacked messages held by the channels of the connections named `name`.
pub fn connection_unacked(name: &str) -> u64 {
    let conns = connections_named(name);
    let list = mgmt_get("/api/channels?columns=connection_details,messages_unacknowledged")
        .unwrap_or_else(|e| panic!("{e}"));
    list.as_array()
        .into_iter()
        .flatten()
        .filter(|c| {
            c["connection_details"]["name"]
                .as_str()
                .is_some_and(|n| conns.iter().any(|x| x == n))
        })
        .map(|c| c["messages_unacknowledged"].as_u64().unwrap_or(0))
        .sum()
}

/// Force-closes (as the broker would) every connection named `name`; returns how many.
pub fn kill_connections(name: &str) -> usize {
    let conns = connections_named(name);
    for c in &conns {
        mgmt_delete(&format!("/api/connections/{}", pct(c))).unwrap_or_else(|e| panic!("{e}"));
    }
    conns.len()
}

/// Waits until the management API lists a connection named `name`.
pub fn wait_for_connection(name: &str, timeout: Duration) -> bool {
    let start = Instant::now();
    while start.elapsed() < timeout {
        if !connections_named(name).is_empty() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    false
}

/// Ready messages in `queue`, right now (passive declare, no statistics lag).
pub async fn ready_count(conn: &Connection, queue: &str) -> u32 {
    let ch = conn.create_channel().await.unwrap();
    let q = ch
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap_or_else(|e| panic!("passive declare of {queue}: {e}"));
    let _ = ch.close(200, "ok".into()).await;
    q.message_count()
}

/// Polls `f` until it returns true or `timeout` passes.
pub async fn eventually(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    loop {
        if f() {
            return true;
        }
        if start.elapsed() > timeout {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
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
        self.properties
            .message_id()
            .as_ref()
            .map(|s| s.to_string())
            .unwrap_or_default()
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
    let ch = conn.create_channel().await.unwrap();
    let mut out = Vec::new();
    while let Some(m) = ch
        .basic_get(queue.into(), BasicGetOptions::default())
        .await
        .unwrap_or_else(|e| panic!("basic.get from {queue}: {e}"))
    {
        m.delivery.ack(BasicAckOptions::default()).await.unwrap();
        out.push(Got {
            body: m.delivery.data,
            properties: m.delivery.properties,
        });
    }
    let _ = ch.close(200, "ok".into()).await;
    out
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
