//! Helpers shared by the root integration tests that need a broker: connection (failing with
//! instructions, never skipping), unique names and their cleanup, the management API, a small
//! HTTP client for the health endpoints and a Prometheus text parser.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use redeliver::lapin::options::QueueDeclareOptions;
use redeliver::lapin::types::FieldTable;
use redeliver::lapin::{Connection, ConnectionProperties};

pub fn amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

pub fn mgmt_url() -> String {
    std::env::var("RABBITMQ_MGMT_URL").unwrap_or_else(|_| "http://127.0.0.1:15672".into())
}

pub const START_BROKER: &str = "These tests need a real RabbitMQ broker with the management plugin: \
     start one with `rabbitmq-server -detached` (then `rabbitmq-plugins enable rabbitmq_management`) \
     or `docker compose -f compose/docker-compose.yml up rabbitmq`, or set AMQP_URL / RABBITMQ_MGMT_URL.";

/// Connects or panics with instructions: a broker test never skips.
pub async fn connect() -> Connection {
    let url = amqp_url();
    match Connection::connect(&url, ConnectionProperties::default()).await {
        Ok(c) => c,
        Err(e) => panic!("cannot connect to RabbitMQ at {url}: {e}\n{START_BROKER}"),
    }
}

/// A unique prefix for every object of one test (delay levels included).
pub fn prefix(test: &str) -> String {
    let id = uuid::Uuid::new_v4().simple().to_string();
    format!("rdt-{test}-{}.", &id[..8])
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

fn mgmt_auth() -> String {
    let user = std::env::var("RABBITMQ_MGMT_USER").unwrap_or_else(|_| "guest".into());
    let pass = std::env::var("RABBITMQ_MGMT_PASSWORD").unwrap_or_else(|_| "guest".into());
    format!("Basic {}", base64(format!("{user}:{pass}").as_bytes()))
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

/// Blocking management API GET (call from `spawn_blocking` or [`mgmt`]).
fn mgmt_get(path: &str) -> Result<serde_json::Value, String> {
    let url = format!("{}{}", mgmt_url(), path);
    let mut resp = ureq::get(&url)
        .header("Authorization", &mgmt_auth())
        .call()
        .map_err(|e| format!("management API {url}: {e}\n{START_BROKER}"))?;
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

/// Runs blocking management calls off the runtime's threads.
pub async fn mgmt<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.expect("blocking task")
}

/// Management names of the connections whose client property `connection_name` is `name`.
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

/// Force-closes (as an operator or the broker would) every connection named `name`.
pub fn kill_connections(name: &str) -> usize {
    let conns = connections_named(name);
    for c in &conns {
        mgmt_delete(&format!("/api/connections/{}", pct(c))).unwrap_or_else(|e| panic!("{e}"));
    }
    conns.len()
}

/// Deletes every queue and exchange of the default vhost whose name starts with `prefix`.
pub fn cleanup_prefix(prefix: &str) {
    for kind in ["queues", "exchanges"] {
        let list = match mgmt_get(&format!("/api/{kind}/%2f?columns=name")) {
            Ok(l) => l,
            Err(e) => {
                eprintln!("cleanup of {prefix}: {e}");
                return;
            }
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

/// Names of the queues and exchanges left with this prefix.
pub fn leftovers(prefix: &str) -> Vec<String> {
    let mut left = Vec::new();
    for kind in ["queues", "exchanges"] {
        let list =
            mgmt_get(&format!("/api/{kind}/%2f?columns=name")).unwrap_or_else(|e| panic!("{e}"));
        for item in list.as_array().into_iter().flatten() {
            if let Some(name) = item["name"].as_str() {
                if name.starts_with(prefix) {
                    left.push(format!("{kind}/{name}"));
                }
            }
        }
    }
    left
}

/// Deletes the prefix's objects when dropped, even when the test panics.
pub struct Cleanup(pub String);

impl Drop for Cleanup {
    fn drop(&mut self) {
        cleanup_prefix(&self.0);
    }
}

/// Ready messages in `queue` right now (passive declare, no statistics lag).
pub async fn ready_count(conn: &Connection, queue: &str) -> u32 {
    let ch = conn.create_channel().await.expect("channel");
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

/// `GET http://{addr}{path}`: (status, body). 503 is an answer here, not an error.
pub async fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    let url = format!("http://{addr}{path}");
    mgmt(move || {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(5)))
            .build()
            .into();
        let mut resp = agent
            .get(&url)
            .call()
            .unwrap_or_else(|e| panic!("GET {url}: {e}"));
        let status = resp.status().as_u16();
        let body = resp.body_mut().read_to_string().expect("body");
        (status, body)
    })
    .await
}

/// Polls `GET path` until it answers `status`; returns the body, or panics with the last answer.
pub async fn wait_for_status(
    addr: SocketAddr,
    path: &str,
    status: u16,
    timeout: Duration,
) -> String {
    let start = Instant::now();
    loop {
        let (code, body) = http_get(addr, path).await;
        if code == status {
            return body;
        }
        if start.elapsed() > timeout {
            panic!("{path} still answers {code} after {timeout:?} (want {status}): {body}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// One sample of the Prometheus text format.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

/// Parses the sample lines of a Prometheus text exposition (no escaped quotes in label values:
/// ours are queue names and small words).
pub fn parse_prometheus(text: &str) -> Vec<Sample> {
    let mut out = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (head, value) = match line.rsplit_once(' ') {
            Some(x) => x,
            None => panic!("bad sample line: {line}"),
        };
        let value: f64 = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            v => v.parse().unwrap_or_else(|_| panic!("bad value in: {line}")),
        };
        let (name, labels) = match head.split_once('{') {
            None => (head.to_owned(), BTreeMap::new()),
            Some((name, rest)) => {
                let inner = rest
                    .strip_suffix('}')
                    .unwrap_or_else(|| panic!("bad labels: {line}"));
                let mut labels = BTreeMap::new();
                for pair in inner.split("\",").filter(|p| !p.is_empty()) {
                    let (k, v) = pair
                        .split_once("=\"")
                        .unwrap_or_else(|| panic!("bad label in: {line}"));
                    labels.insert(k.to_owned(), v.trim_end_matches('"').to_owned());
                }
                (name.to_owned(), labels)
            }
        };
        out.push(Sample {
            name,
            labels,
            value,
        });
    }
    out
}

/// The value of the sample `name` whose labels are exactly `labels`.
pub fn sample(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let want: BTreeMap<String, String> = labels
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    samples
        .iter()
        .find(|s| s.name == name && s.labels == want)
        .map(|s| s.value)
}
