//! Support code shared by the integration tests of the redeliver workspace, and by the bench
//! (management API, queue counts).
//!
//! Every broker test connects to a real RabbitMQ (never skipping when it is down: [`connect`]
//! fails the test with instructions). What the tests need of the machine (the broker started,
//! its management API enabled, a TLS node with test certificates) the first test that needs it
//! brings up ([`fixtures`]), so `cargo test` needs nothing run before it. Each test names its objects with a [`unique_prefix`], removes them
//! through the management API ([`mgmt`], [`Cleanup`]) and waits for the broker with the polling
//! helpers here, which all take an explicit timeout. The example programs under test come
//! from [`examples`] and run under [`process`]; [`http`] reads health and metrics endpoints,
//! [`recorder`] the metrics recorded in the test's own process; [`raw_publish`] writes
//! hostile messages on the wire by hand; [`reliability`] is the conservation harness of the
//! reliability suite, [`nodes`] the extra broker nodes of its disruptive tests.

// Lints: `[workspace.lints]` in Cargo.toml, but test support code panics, as the tests do: a
// failed expectation is a failed test. Its types are internal and need no `Debug`.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    missing_debug_implementations
)]

use std::collections::HashMap;
use std::time::{Duration, Instant};

use lapin::message::{BasicGetMessage, Delivery};
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicGetOptions, BasicQosOptions, BasicRejectOptions,
    ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};

mod api;
pub mod effects;
pub mod examples;
pub mod fixtures;
pub mod http;
pub mod logs;
pub mod mgmt;
pub mod nodes;
pub mod postgres;
pub mod process;
pub mod raw_publish;
pub mod recorder;
pub mod reliability;

/// The broker the tests use when `AMQP_URL` is not set.
pub const DEFAULT_AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

pub use fixtures::START_BROKER;

/// The test broker's URL: `AMQP_URL`, or [`DEFAULT_AMQP_URL`]. The first call in a process
/// makes sure that broker answers ([`fixtures::broker`]).
///
/// # Panics
///
/// When it does not and cannot be started here, saying what to run ([`START_BROKER`]).
pub fn amqp_url() -> String {
    let url = std::env::var("AMQP_URL").unwrap_or_else(|_| DEFAULT_AMQP_URL.to_owned());
    if let Err(e) = fixtures::broker(&url) {
        panic!("{e}");
    }
    url
}

/// Connects to the test broker at [`amqp_url`].
///
/// # Panics
///
/// When the broker cannot be reached, with instructions ([`START_BROKER`]): a broker test fails,
/// it never skips.
pub async fn connect() -> Connection {
    connect_to(&amqp_url()).await
}

/// Connects to the broker at `url` (another node than the test broker: a TLS node, a node of
/// [`nodes`]).
///
/// # Panics
///
/// When the broker cannot be reached, with instructions ([`START_BROKER`]).
pub async fn connect_to(url: &str) -> Connection {
    match Connection::connect(url, ConnectionProperties::default()).await {
        Ok(c) => c,
        Err(e) => panic!(
            "cannot connect to RabbitMQ at {}: {e}\n{START_BROKER}",
            redact(url)
        ),
    }
}

/// Connects to the broker at `url` as redeliver itself does ([`redeliver_amqp::connect`]: every
/// frame read through the header-depth guard), without TLS: for a test that needs what that
/// connection does and lapin's alone does not (`connection.blocked` on a dedicated node).
///
/// # Panics
///
/// When the broker cannot be reached.
pub async fn connect_guarded(url: &str) -> Connection {
    redeliver_amqp::connect(
        url,
        ConnectionProperties::default(),
        &redeliver_amqp::TlsConfig::new(),
    )
    .await
    .unwrap_or_else(|e| panic!("cannot connect to RabbitMQ at {}: {e}", redact(url)))
}

/// What the test broker at [`amqp_url`] announces in `connection.start` (product, version):
/// tests that depend on broker semantics assert the behaviour of this version.
///
/// # Panics
///
/// When the broker cannot be reached, with instructions ([`START_BROKER`]), or announces no
/// version.
pub async fn broker() -> redeliver_amqp::ServerInfo {
    let url = amqp_url();
    match redeliver_amqp::ServerInfo::probe(&url).await {
        Ok(info) if info.version().is_some() => info,
        Ok(info) => panic!(
            "the broker at {} announced no version: {info:?}",
            redact(&url)
        ),
        Err(e) => panic!("cannot reach RabbitMQ: {e}\n{START_BROKER}"),
    }
}

/// The test broker's version ([`broker`]).
pub async fn broker_version() -> redeliver_amqp::BrokerVersion {
    let info = broker().await;
    info.version()
        .unwrap_or_else(|| panic!("no version: {info:?}"))
}

/// The URL without its password, for failure messages: the amqp crate's redaction, which
/// also masks passwords holding `@`, `;` or `://`, URLs without `//` and lists. No test helper
/// prints a broker URL otherwise.
pub fn redact(url: &str) -> String {
    redeliver_amqp::url::redact(url)
}

/// The amqps URL of the TLS tests ([`fixtures::tls`]: a node the tests start themselves, or
/// `AMQPS_URL`). The server certificate names `localhost` only.
///
/// # Panics
///
/// When the TLS node cannot be had, saying why.
pub fn amqps_url() -> String {
    tls_broker().url
}

/// A file of the test TLS material ([`fixtures::Tls::dir`]: `ca.pem`, `client.pem`,
/// `client.key`, `other-ca.pem`, `other-client.pem`, `other-client.key`).
///
/// # Panics
///
/// When the TLS fixture cannot be had, or the file does not exist.
pub fn tls_file(name: &str) -> std::path::PathBuf {
    let path = tls_broker().dir.join(name);
    assert!(path.is_file(), "{} is missing", path.display());
    path
}

/// The broker of the TLS tests ([`fixtures::tls`]): amqps and plain URLs, management API,
/// certificates.
///
/// # Panics
///
/// When it cannot be had, saying why.
pub fn tls_broker() -> fixtures::Tls {
    fixtures::tls().unwrap_or_else(|e| panic!("{e}"))
}

/// `hex_len` random hex digits (at most 32), different on every call.
pub fn unique_id(hex_len: usize) -> String {
    let id = uuid::Uuid::new_v4().simple().to_string();
    id[..hex_len.min(id.len())].to_owned()
}

/// A fresh name prefix `{head}{unique_id(hex_len)}{tail}`, e.g. `unique_prefix("t", 12, ".")`
/// gives `"t3f9a0c1b2d4e."`.
pub fn unique_prefix(head: &str, hex_len: usize, tail: &str) -> String {
    format!("{head}{}{tail}", unique_id(hex_len))
}

/// Deletes (through [`mgmt::delete_prefix`]) every queue and exchange whose name starts with the
/// prefix when dropped, so it also runs while a failing test unwinds.
#[derive(Debug)]
pub struct Cleanup(pub String);

impl Drop for Cleanup {
    fn drop(&mut self) {
        mgmt::delete_prefix(&self.0);
    }
}

/// [`Cleanup`] on the TLS tests' broker ([`tls_broker`]), which need not be the one
/// `RABBITMQ_MGMT_URL` names.
#[derive(Debug)]
pub struct TlsCleanup(pub String);

impl Drop for TlsCleanup {
    fn drop(&mut self) {
        if let Err(e) = mgmt::Client::new(&tls_broker().mgmt_url).delete_prefix(&self.0) {
            eprintln!("cleanup of {}: {e}", self.0);
        }
    }
}

/// What a passive declare tells about a queue: no statistics lag, unlike the management API.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueDepth {
    /// Messages ready for delivery.
    pub ready: u32,
    /// Consumers subscribed.
    pub consumers: u32,
}

/// Declares a durable classic queue `queue` on a throwaway channel (the default exchange routes
/// to it by name).
///
/// # Panics
///
/// When the broker refuses: a test cannot go on without its queue.
pub async fn declare_queue(conn: &Connection, queue: &str) {
    let ch = conn.create_channel().await.expect("a channel");
    ch.queue_declare(
        queue.into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap_or_else(|e| panic!("declaring queue {queue}: {e}"));
    let _ = ch.close(200, "declared".into()).await;
}

/// The [`QueueDepth`] of `queue` right now, through a passive declare on a throwaway channel
/// (a missing queue closes that channel, not the caller's).
pub async fn queue_depth(conn: &Connection, queue: &str) -> Result<QueueDepth, lapin::Error> {
    let ch = conn.create_channel().await?;
    let q = ch
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    let _ = ch.close(200, "ok".into()).await;
    Ok(QueueDepth {
        ready: q.message_count(),
        consumers: q.consumer_count(),
    })
}

/// Whether `queue` exists right now ([`queue_depth`]): `false` only for the broker's 404.
///
/// # Panics
///
/// On any other failure (no channel, a closed connection), which must not pass for "missing".
pub async fn queue_exists(conn: &Connection, queue: &str) -> bool {
    match queue_depth(conn, queue).await {
        Ok(_) => true,
        Err(e) if redeliver_amqp::is_not_found(&e) => false,
        Err(e) => panic!("passive declare of {queue}: {e}"),
    }
}

/// Declares `exchange`, a fanout exchange bound to `queue`: it routes a message whatever its
/// routing key (bytes that are not UTF-8, `#`), which the default exchange cannot. Auto-delete:
/// it goes with its binding when the queue is deleted.
///
/// # Panics
///
/// When the broker refuses the declare or the binding.
pub async fn fanout_to(conn: &Connection, exchange: &str, queue: &str) {
    let ch = conn.create_channel().await.expect("channel");
    ch.exchange_declare(
        exchange.into(),
        ExchangeKind::Fanout,
        ExchangeDeclareOptions {
            auto_delete: true,
            ..ExchangeDeclareOptions::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap_or_else(|e| panic!("declare the fanout exchange {exchange}: {e}"));
    ch.queue_bind(
        queue.into(),
        exchange.into(),
        "".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap_or_else(|e| panic!("bind {queue} to {exchange}: {e}"));
    let _ = ch.close(200, "ok".into()).await;
}

/// Ready messages in `queue` right now ([`queue_depth`]).
///
/// # Panics
///
/// When the queue does not exist or the broker fails.
pub async fn ready_count(conn: &Connection, queue: &str) -> u32 {
    queue_depth(conn, queue)
        .await
        .unwrap_or_else(|e| panic!("passive declare of {queue}: {e}"))
        .ready
}

/// Waits (polling every 50 ms) until `queue` holds exactly `n` ready messages.
///
/// # Panics
///
/// When it does not within `within`, naming the last count seen.
pub async fn wait_count(conn: &Connection, queue: &str, n: u32, within: Duration) {
    let start = Instant::now();
    loop {
        let c = ready_count(conn, queue).await;
        if c == n {
            return;
        }
        assert!(
            start.elapsed() < within,
            "{queue} holds {c} messages, expected {n} within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Polls `f` (every 20 ms) until it returns true, or `timeout` passes; returns whether it did.
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

/// Waits (polling every 20 ms, as [`eventually`]) until `pred` holds.
///
/// # Panics
///
/// When it does not within `within`, saying `what` was awaited.
pub async fn wait_until(within: Duration, what: &str, pred: impl FnMut() -> bool) {
    assert!(eventually(within, pred).await, "{what} (after {within:?})");
}

/// Polls `queue` with basic.get (manual ack, every 20 ms) until a message arrives, or `timeout`
/// passes.
pub async fn poll_get(ch: &Channel, queue: &str, timeout: Duration) -> Option<Delivery> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(m) = ch
            .basic_get(queue.into(), BasicGetOptions { no_ack: false })
            .await
            .expect("basic_get")
        {
            return Some(m.delivery);
        }
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Takes (basic.get + ack) every message currently in `queue`, in queue order.
pub async fn drain(conn: &Connection, queue: &str) -> Vec<BasicGetMessage> {
    let ch = conn.create_channel().await.expect("channel");
    let mut out = Vec::new();
    while let Some(m) = ch
        .basic_get(queue.into(), BasicGetOptions { no_ack: false })
        .await
        .unwrap_or_else(|e| panic!("basic.get from {queue}: {e}"))
    {
        m.delivery
            .acker
            .ack(BasicAckOptions::default())
            .await
            .expect("ack");
        out.push(m);
    }
    let _ = ch.close(200, "ok".into()).await;
    out
}

/// The message id of `props`, or `""` when it has none.
pub fn message_id(props: &BasicProperties) -> String {
    props
        .message_id()
        .as_ref()
        .map(|m| m.to_string())
        .unwrap_or_default()
}

/// Message ids of every message in `queue`, removed (call once nothing publishes to it): a
/// consumer without acks, many times faster than one basic.get a message for thousands.
/// Panics when a message it was told of does not come within 10 s, or the queue is not empty
/// afterwards.
pub async fn drain_message_ids(conn: &Connection, queue: &str) -> Vec<String> {
    use futures::StreamExt as _;
    let passive = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    let ch = conn.create_channel().await.expect("a channel");
    let n = ch
        .queue_declare(queue.into(), passive, FieldTable::default())
        .await
        .unwrap_or_else(|e| panic!("passive declare of {queue}: {e}"))
        .message_count() as usize;
    let mut consumer = ch
        .basic_consume(
            queue.into(),
            "outbox-test-drain".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap_or_else(|e| panic!("basic.consume on {queue}: {e}"));
    let mut ids = Vec::with_capacity(n);
    while ids.len() < n {
        let d = tokio::time::timeout(Duration::from_secs(10), consumer.next())
            .await
            .unwrap_or_else(|_| panic!("{} of {n} messages drained from {queue}", ids.len()))
            .expect("the drain consumer ended")
            .expect("a delivery");
        ids.push(message_id(&d.properties));
    }
    let _ = ch.close(200, "drained".into()).await;
    let ch = conn.create_channel().await.expect("a channel");
    let left = ch
        .queue_declare(queue.into(), passive, FieldTable::default())
        .await
        .unwrap_or_else(|e| panic!("passive declare of {queue}: {e}"))
        .message_count();
    let _ = ch.close(200, "checked".into()).await;
    assert_eq!(left, 0, "{queue} still holds messages after the drain");
    ids
}

/// Runs `body`, then `cleanup` whether or not `body` panicked, then re-raises the panic: for
/// cleanup that needs the async runtime (a drop guard cannot await).
pub async fn with_cleanup<B, C>(body: B, cleanup: C)
where
    B: std::future::Future<Output = ()>,
    C: std::future::Future<Output = ()>,
{
    use futures::FutureExt as _;
    let outcome = std::panic::AssertUnwindSafe(body).catch_unwind().await;
    cleanup.await;
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

/// A message read from a queue with basic.get: body and properties.
#[derive(Clone, Debug)]
pub struct Got {
    /// The body.
    pub body: Vec<u8>,
    /// The properties, headers included.
    pub properties: BasicProperties,
}

impl Got {
    /// Its message id, or `""` when it has none.
    pub fn message_id(&self) -> &str {
        self.properties
            .message_id()
            .as_ref()
            .map_or("", |m| m.as_str())
    }

    /// Its headers, if it has any.
    pub fn headers(&self) -> Option<&FieldTable> {
        self.properties.headers().as_ref()
    }

    /// Header `name`, if present.
    pub fn header(&self, name: &str) -> Option<&AMQPValue> {
        self.headers()?.inner().get(name)
    }

    /// Header `name` as text, when it is a string.
    pub fn header_str(&self, name: &str) -> Option<String> {
        value_str(self.header(name)?)
    }

    /// Header `name` as an integer, when it is one.
    pub fn header_int(&self, name: &str) -> Option<i64> {
        value_int(self.header(name)?)
    }

    /// `reason` of the newest x-death entry.
    pub fn death_reason(&self) -> Option<String> {
        redeliver_amqp::headers::x_death(self.headers())
            .first()
            .map(|d| d.reason.clone())
    }
}

/// A header value as text, when it is a string.
fn value_str(value: &AMQPValue) -> Option<String> {
    match value {
        AMQPValue::LongString(v) => Some(String::from_utf8_lossy(v.as_bytes()).into_owned()),
        AMQPValue::ShortString(v) => Some(v.as_str().to_owned()),
        _ => None,
    }
}

/// A header value as an integer, when it is one of the integer types headers arrive as.
fn value_int(value: &AMQPValue) -> Option<i64> {
    match value {
        AMQPValue::LongLongInt(v) => Some(*v),
        AMQPValue::LongInt(v) => Some(i64::from(*v)),
        AMQPValue::ShortInt(v) => Some(i64::from(*v)),
        AMQPValue::LongUInt(v) => Some(i64::from(*v)),
        _ => None,
    }
}

/// Takes (and acks) every message currently in `queue`, as [`Got`]s ([`drain`]).
pub async fn drain_queue(conn: &Connection, queue: &str) -> Vec<Got> {
    drain(conn, queue)
        .await
        .into_iter()
        .map(|m| Got {
            body: m.delivery.data,
            properties: m.delivery.properties,
        })
        .collect()
}

/// A handler's call log shared with the test: message id -> (attempt seen, instant), per call.
pub type Calls = std::sync::Arc<std::sync::Mutex<HashMap<String, Vec<(u32, Instant)>>>>;

/// Records a call of `id` at `attempt` in `calls`; returns how many calls `id` has had.
pub fn record(calls: &Calls, id: &str, attempt: u32) -> usize {
    let mut map = calls.lock().unwrap_or_else(|p| p.into_inner());
    let v = map.entry(id.to_owned()).or_default();
    v.push((attempt, Instant::now()));
    v.len()
}

/// When `id` was handled, in the order [`record`]ed: empty if never.
pub fn times_of(calls: &Calls, id: &str) -> Vec<Instant> {
    let map = calls.lock().unwrap_or_else(|p| p.into_inner());
    map.get(id)
        .map(|v| v.iter().map(|(_, t)| *t).collect())
        .unwrap_or_default()
}

/// Consumes `n` messages of `queue` and rejects each (requeue = false) in delivery order, so
/// the broker dead-letters them in that same order.
///
/// # Panics
///
/// When fewer than `n` arrive (10 s for each) or the broker fails.
pub async fn reject_all(conn: &Connection, queue: &str, n: usize) {
    use futures::StreamExt as _;
    let ch = conn.create_channel().await.expect("channel");
    ch.basic_qos(1, BasicQosOptions { global: false })
        .await
        .expect("basic.qos");
    let mut consumer = ch
        .basic_consume(
            queue.into(),
            "test-rejecter".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap_or_else(|e| panic!("basic.consume on {queue}: {e}"));
    for _ in 0..n {
        let d = tokio::time::timeout(Duration::from_secs(10), consumer.next())
            .await
            .unwrap_or_else(|_| panic!("no delivery from {queue} to reject"))
            .expect("consumer ended")
            .expect("delivery");
        d.acker
            .reject(BasicRejectOptions { requeue: false })
            .await
            .expect("reject");
    }
    ch.close(200, "ok".into()).await.expect("close the channel");
}

/// The `message_id` fields of a JSON array of messages (as `redeliver dlq list --json` prints
/// them), in order; `""` for one without.
///
/// # Panics
///
/// When `json` is not an array.
pub fn message_ids(json: &serde_json::Value) -> Vec<String> {
    json.as_array()
        .expect("a JSON array")
        .iter()
        .map(|m| m["message_id"].as_str().unwrap_or_default().to_owned())
        .collect()
}
