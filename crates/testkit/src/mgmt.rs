//! A blocking client of the RabbitMQ management API (default vhost), for what AMQP cannot tell:
//! queue statistics, connections, the broker version, and deleting objects by name prefix.
//!
//! [`Client`] talks to one broker's API; the free functions use [`Client::from_env`], the test
//! broker's. From async code, call them through [`blocking`].

use std::time::{Duration, Instant};

use crate::START_BROKER;

/// The test broker's management API base URL: `RABBITMQ_MGMT_URL`, or `http://127.0.0.1:15672`.
/// The first call in a process makes sure it answers
/// ([`fixtures::management`](crate::fixtures::management)).
///
/// # Panics
///
/// When it does not and cannot be enabled here, saying what to run.
pub fn url() -> String {
    let url =
        std::env::var("RABBITMQ_MGMT_URL").unwrap_or_else(|_| "http://127.0.0.1:15672".into());
    let client = Client::new(&url);
    if let Err(e) = crate::fixtures::management(&client.base, &client.auth) {
        panic!("{e}");
    }
    url
}

/// The management API of one broker: its base URL and the `Authorization` header value.
#[derive(Clone)]
pub struct Client {
    base: String,
    auth: String,
}

/// Without the `Authorization` value: it is the password, base64-encoded.
impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("base", &self.base)
            .field("auth", &"***")
            .finish()
    }
}

impl Client {
    /// The API at `base`, e.g. `http://127.0.0.1:15672` or `http://user:pass@host:15672`.
    /// Credentials in the URL win; otherwise `RABBITMQ_MGMT_USER` / `RABBITMQ_MGMT_PASSWORD`
    /// (default `guest`/`guest`).
    pub fn new(base: &str) -> Self {
        let base = base.trim_end_matches('/');
        let (scheme, rest) = base.split_once("://").unwrap_or(("http", base));
        let (credentials, host) = match rest.rsplit_once('@') {
            Some((cred, host)) => (cred.to_owned(), host),
            None => {
                let user = std::env::var("RABBITMQ_MGMT_USER").unwrap_or_else(|_| "guest".into());
                let pass =
                    std::env::var("RABBITMQ_MGMT_PASSWORD").unwrap_or_else(|_| "guest".into());
                (format!("{user}:{pass}"), rest)
            }
        };
        Self {
            base: format!("{scheme}://{host}"),
            auth: format!("Basic {}", base64(credentials.as_bytes())),
        }
    }

    /// The test broker's API: [`url`], credentials as in [`Client::new`].
    ///
    /// # Panics
    ///
    /// As [`url`] does.
    pub fn from_env() -> Self {
        Self::new(&url())
    }

    /// The base URL, without credentials.
    pub fn base(&self) -> &str {
        &self.base
    }

    /// The `Authorization` header value it sends.
    pub fn authorization(&self) -> &str {
        &self.auth
    }

    /// `GET {base}{path}` as JSON; the error says how to get the API running.
    pub fn get_json(&self, path: &str) -> Result<serde_json::Value, String> {
        let url = format!("{}{path}", self.base);
        let mut resp = ureq::get(&url)
            .header("Authorization", &self.auth)
            .call()
            .map_err(|e| format!("management API {url}: {e}\n{START_BROKER}"))?;
        resp.body_mut()
            .read_json::<serde_json::Value>()
            .map_err(|e| format!("decoding {url}: {e}"))
    }

    /// `POST {base}{path}` with a JSON body; the JSON answer.
    pub fn post_json(
        &self,
        path: &str,
        body: &serde_json::Value,
    ) -> Result<serde_json::Value, String> {
        let url = format!("{}{path}", self.base);
        let mut resp = ureq::post(&url)
            .header("Authorization", &self.auth)
            .send_json(body)
            .map_err(|e| format!("POST {url}: {e}\n{START_BROKER}"))?;
        resp.body_mut()
            .read_json::<serde_json::Value>()
            .map_err(|e| format!("decoding {url}: {e}"))
    }

    /// `DELETE {base}{path}`: `Ok(false)` when there was nothing to delete (404).
    pub fn delete(&self, path: &str) -> Result<bool, String> {
        let url = format!("{}{path}", self.base);
        match ureq::delete(&url)
            .header("Authorization", &self.auth)
            .call()
        {
            Ok(_) => Ok(true),
            Err(ureq::Error::StatusCode(404)) => Ok(false),
            Err(e) => Err(format!("DELETE {url}: {e}")),
        }
    }

    /// The version the broker reports (`/api/overview`).
    pub fn version(&self) -> Result<String, String> {
        let v = self.get_json("/api/overview")?;
        v["rabbitmq_version"]
            .as_str()
            .map(str::to_owned)
            .ok_or_else(|| format!("no rabbitmq_version in /api/overview: {v}"))
    }

    /// Names of the `kind` (`"queues"`, `"exchanges"`) objects starting with `prefix`.
    pub fn names_with_prefix(&self, kind: &str, prefix: &str) -> Result<Vec<String>, String> {
        let list = self.get_json(&format!("/api/{kind}/%2f?columns=name"))?;
        Ok(list
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|item| item["name"].as_str())
            .filter(|name| name.starts_with(prefix))
            .map(str::to_owned)
            .collect())
    }

    /// Deletes every queue and exchange whose name starts with `prefix`; returns their names.
    /// A failed delete of one object does not stop the others.
    pub fn delete_prefix(&self, prefix: &str) -> Result<Vec<String>, String> {
        let mut deleted = Vec::new();
        for kind in ["queues", "exchanges"] {
            for name in self.names_with_prefix(kind, prefix)? {
                if let Ok(true) = self.delete(&format!("/api/{kind}/%2f/{}", pct(&name))) {
                    deleted.push(name);
                }
            }
        }
        Ok(deleted)
    }

    /// Management names of the connections whose client property `connection_name` is `name`.
    pub fn connections_named(&self, name: &str) -> Result<Vec<String>, String> {
        let list = self.get_json("/api/connections?columns=name,client_properties")?;
        Ok(list
            .as_array()
            .into_iter()
            .flatten()
            .filter(|c| c["client_properties"]["connection_name"].as_str() == Some(name))
            .filter_map(|c| c["name"].as_str().map(str::to_owned))
            .collect())
    }

    /// Force-closes the connection whose management name is `mgmt_name` (as the broker would);
    /// `Ok(false)` when it was already gone.
    pub fn close_connection(&self, mgmt_name: &str) -> Result<bool, String> {
        let url = format!("{}/api/connections/{}", self.base, pct(mgmt_name));
        match ureq::delete(&url)
            .header("Authorization", &self.auth)
            .header("X-Reason", "closed by a redeliver test")
            .call()
        {
            Ok(_) => Ok(true),
            Err(ureq::Error::StatusCode(404)) => Ok(false),
            Err(e) => Err(format!("DELETE {url}: {e}")),
        }
    }
}

fn base64(input: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(input)
}

/// Percent-encodes one path segment (a queue, exchange or connection name): everything but
/// RFC 3986's unreserved characters.
pub fn pct(s: &str) -> String {
    use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
    const SEGMENT: &AsciiSet = &NON_ALPHANUMERIC
        .remove(b'-')
        .remove(b'.')
        .remove(b'_')
        .remove(b'~');
    utf8_percent_encode(s, SEGMENT).to_string()
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_come_from_the_url_when_it_has_them() {
        let c = Client::new("http://admin:s3cret@127.0.0.1:15672/");
        assert_eq!(c.base(), "http://127.0.0.1:15672");
        assert_eq!(c.auth, format!("Basic {}", base64(b"admin:s3cret")));
        assert_eq!(base64(b"guest:guest"), "Z3Vlc3Q6Z3Vlc3Q=");
        assert_eq!(base64(b"ab"), "YWI=");
        assert_eq!(pct("rd-1.q_~ x/y%"), "rd-1.q_~%20x%2Fy%25");
        assert_eq!(pct("a.b c/d"), "a.b%20c%2Fd");
    }

    #[test]
    fn debug_hides_the_credentials() {
        let c = Client::new("http://admin:s3cret@127.0.0.1:15672/");
        let shown = format!("{c:?}");
        assert!(shown.contains("127.0.0.1:15672"), "{shown}");
        assert!(!shown.contains("s3cret"), "{shown}");
        assert!(!shown.contains(&base64(b"admin:s3cret")), "{shown}");
    }
}
