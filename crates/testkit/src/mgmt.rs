//! A blocking client of the RabbitMQ management API (default vhost), for what AMQP cannot tell:
//! queue statistics, connections, the broker version, and deleting objects by name prefix.
//!
//! [`Client`] talks to one broker's API; the free functions use [`Client::from_env`], the test
//! broker's. From async code, call them through [`blocking`].

use std::time::{Duration, Instant};

pub use crate::api::{pct, Client};

/// The test broker's management API base URL: `RABBITMQ_MGMT_URL`, or `http://127.0.0.1:15672`.
/// The first call in a process makes sure it answers
/// ([`fixtures::management`](crate::fixtures::management)).
///
/// # Panics
///
/// When it does not and cannot be enabled here, saying what to run.
pub fn url() -> String {
    crate::fixtures::management_url().unwrap_or_else(|e| panic!("{e}"))
}

impl Client {
    /// The test broker's API: [`url`], credentials as in [`Client::new`].
    ///
    /// # Panics
    ///
    /// As [`url`] does.
    pub fn from_env() -> Self {
        Self::new(&url())
    }
}

/// [`Client::get_json`] on the test broker.
pub fn get_json(path: &str) -> Result<serde_json::Value, String> {
    Client::from_env().get_json(path)
}

/// [`Client::delete`] on the test broker.
pub fn delete(path: &str) -> Result<bool, String> {
    Client::from_env().delete(path)
}

/// The messages of `queue` as the management UI's "Get messages" shows them, left in place
/// (ack mode "Nack message requeue true"): up to `count`, payloads decoded when they are text.
pub fn get_messages(queue: &str, count: usize) -> Result<Vec<serde_json::Value>, String> {
    let answer = Client::from_env().post_json(
        &format!("/api/queues/%2f/{}/get", pct(queue)),
        &serde_json::json!({
            "count": count,
            "ackmode": "ack_requeue_true",
            "encoding": "auto",
            "truncate": 1_000_000,
        }),
    )?;
    answer
        .as_array()
        .cloned()
        .ok_or_else(|| format!("not a list of messages: {answer}"))
}

/// Runs blocking management calls off the async runtime's threads.
pub async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.expect("blocking task")
}

/// Deletes every queue and exchange of the test broker whose name starts with `prefix`; best
/// effort (it runs from drop guards), so failures are only printed.
pub fn delete_prefix(prefix: &str) {
    if let Err(e) = Client::from_env().delete_prefix(prefix) {
        eprintln!("cleanup of {prefix}: {e}");
    }
}

/// The queues and exchanges left with this prefix, as `"queues/NAME"` / `"exchanges/NAME"`.
///
/// # Panics
///
/// When the management API cannot be reached.
pub fn leftovers(prefix: &str) -> Vec<String> {
    let client = Client::from_env();
    let mut left = Vec::new();
    for kind in ["queues", "exchanges"] {
        let names = client
            .names_with_prefix(kind, prefix)
            .unwrap_or_else(|e| panic!("{e}"));
        left.extend(names.into_iter().map(|name| format!("{kind}/{name}")));
    }
    left
}

/// Queue counters from the management API (they lag the broker by its statistics interval).
#[derive(Debug, Clone, Copy, Default)]
pub struct QueueStats {
    /// Ready plus unacknowledged messages.
    pub messages: u64,
    /// Messages ready for delivery.
    pub ready: u64,
    /// Messages delivered and not yet acknowledged.
    pub unacked: u64,
}

impl QueueStats {
    fn of(v: &serde_json::Value) -> Self {
        Self {
            messages: v["messages"].as_u64().unwrap_or(0),
            ready: v["messages_ready"].as_u64().unwrap_or(0),
            unacked: v["messages_unacknowledged"].as_u64().unwrap_or(0),
        }
    }
}

/// The counters of queue `name`.
///
/// # Panics
///
/// When the management API cannot be reached or has no such queue.
pub fn queue_stats(name: &str) -> QueueStats {
    let v = get_json(&format!("/api/queues/%2f/{}", pct(name))).unwrap_or_else(|e| panic!("{e}"));
    QueueStats::of(&v)
}

/// The counters summed over every queue whose name starts with `prefix`.
///
/// # Panics
///
/// When the management API cannot be reached.
pub fn prefix_stats(prefix: &str) -> QueueStats {
    let list =
        get_json("/api/queues/%2f?columns=name,messages,messages_ready,messages_unacknowledged")
            .unwrap_or_else(|e| panic!("{e}"));
    let mut s = QueueStats::default();
    for q in list.as_array().into_iter().flatten() {
        if q["name"].as_str().is_some_and(|n| n.starts_with(prefix)) {
            let one = QueueStats::of(q);
            s.messages += one.messages;
            s.ready += one.ready;
            s.unacked += one.unacked;
        }
    }
    s
}

/// [`Client::connections_named`] on the test broker.
///
/// # Panics
///
/// When the management API cannot be reached.
pub fn connections_named(name: &str) -> Vec<String> {
    Client::from_env()
        .connections_named(name)
        .unwrap_or_else(|e| panic!("{e}"))
}

/// Unacked messages held by the channels of the connections named `name`.
///
/// # Panics
///
/// When the management API cannot be reached.
pub fn connection_unacked(name: &str) -> u64 {
    let conns = connections_named(name);
    let list = get_json("/api/channels?columns=connection_details,messages_unacknowledged")
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

/// Force-closes every connection of the test broker named `name` (client property); returns
/// how many.
///
/// # Panics
///
/// When the management API cannot be reached or refuses a close.
pub fn kill_connections(name: &str) -> usize {
    let client = Client::from_env();
    let conns = client
        .connections_named(name)
        .unwrap_or_else(|e| panic!("{e}"));
    for c in &conns {
        client.close_connection(c).unwrap_or_else(|e| panic!("{e}"));
    }
    conns.len()
}

/// Force-closes the listed connections of the test broker (their management names, as
/// [`connections_named`] gives them), as an operator or a broker-side failure would; returns
/// how many were closed. A connection already gone is not an error.
///
/// # Panics
///
/// When the management API cannot be reached or refuses a close.
pub fn close_connections(names: &[String]) -> usize {
    let client = Client::from_env();
    names
        .iter()
        .map(|n| client.close_connection(n).unwrap_or_else(|e| panic!("{e}")))
        .filter(|closed| *closed)
        .count()
}

/// Waits (polling every 200 ms) until the management API lists a connection named `name`;
/// returns whether it did within `timeout`.
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

/// Waits (up to 10 s) until the management API lists the connection named `name`: it shows a new
/// connection only at its next statistics emission.
pub async fn await_listed_connection(name: &str) {
    let n = name.to_owned();
    let listed = blocking(move || wait_for_connection(&n, Duration::from_secs(10))).await;
    assert!(listed, "management API never listed connection {name}");
}

/// Force-closes the one connection named `name` through the management API.
pub async fn force_close_connection(name: &str) {
    let n = name.to_owned();
    let killed = blocking(move || kill_connections(&n)).await;
    assert_eq!(killed, 1, "one connection named {name} to close");
}
