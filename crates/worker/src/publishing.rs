//! The publishing connection: retry copies, repaired copies and annotated dead letters go out
//! on a connection of their own, never on the one deliveries and acks use.
//!
//! During a memory or disk alarm RabbitMQ blocks every connection that publishes
//! (`connection.blocked`): a consumer publishing on its own connection then stops receiving and
//! acking too. With a separate connection, successful deliveries keep being acked while a
//! retry waits, bounded, for the alarm to clear. One publishing connection per broker URL is
//! shared by the workers of a `run_all` (RabbitMQ's advice: few connections, separate for
//! publishing and consuming).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use futures::StreamExt;
use lapin::{Connection, ConnectionProperties, Event};
use redeliver_amqp::url::BrokerUrl;
use redeliver_amqp::{ConnectError, TlsConfig};
use tokio::sync::watch;
use tracing::{debug, info, warn};

/// Longest a (re)connect of the publishing connection may take (TCP, TLS and the AMQP
/// handshake), and opening the publisher's channels on it. Without it a node that accepts TCP
/// and never answers holds the connection's lock, and so every copy of every worker sharing it,
/// for ever. A delivery waits for a reconnect no longer than its confirm timeout (it is then
/// requeued by the settling rules); this bounds the attempt itself, at session start too.
pub(crate) const REOPEN_TIMEOUT: Duration = Duration::from_secs(30);

/// A publishing connection shared by the workers of this process that use the same broker URL;
/// (re)connected on demand.
pub(crate) struct Publishing {
    url: BrokerUrl,
    tls: TlsConfig,
    name: String,
    connection: tokio::sync::Mutex<Option<Arc<Connection>>>,
    /// True while the broker blocks the connection (a resource alarm).
    blocked: watch::Sender<bool>,
    /// Bound of one connect attempt ([`REOPEN_TIMEOUT`]; shorter in the unit tests).
    connect_timeout: Duration,
}

/// The publishing connections of the workers that share them (one [`Worker::run`]
/// (crate::Worker::run), or all the workers of a [`run_all`](crate::run_all)), by URL
/// (credentials included) and TLS. Never shared further: a lapin connection lives on the tokio
/// runtime that opened it.
#[derive(Clone, Default)]
pub(crate) struct Pool(Arc<Mutex<HashMap<String, Weak<Publishing>>>>);

impl Pool {
    /// The publishing connection for `url`; `name` (shown in the management UI) is taken from
    /// the first worker asking.
    pub(crate) fn get(&self, url: &BrokerUrl, tls: &TlsConfig, name: &str) -> Arc<Publishing> {
        // Only ever compared in memory: the key holds the password.
        let key = format!("{:?}|{tls:?}", url.uri());
        let mut map = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        map.retain(|_, w| w.strong_count() > 0);
        if let Some(existing) = map.get(&key).and_then(Weak::upgrade) {
            return existing;
        }
        let fresh = Arc::new(Publishing {
            url: url.clone(),
            tls: tls.clone(),
            name: format!("{name} (publishing)"),
            connection: tokio::sync::Mutex::new(None),
            blocked: watch::Sender::new(false),
            connect_timeout: REOPEN_TIMEOUT,
        });
        map.insert(key, Arc::downgrade(&fresh));
        fresh
    }
}

impl Publishing {
    /// The connection, opened (again) if there is none or it died.
    pub(crate) async fn connection(&self) -> Result<Arc<Connection>, ConnectError> {
        let mut current = self.connection.lock().await;
        if let Some(c) = current.as_ref().filter(|c| c.status().connected()) {
            return Ok(Arc::clone(c));
        }
        let props = ConnectionProperties::default().with_connection_name(self.name.clone().into());
        let attempt = redeliver_amqp::connect_url(&self.url, props, &self.tls);
        let connection = match tokio::time::timeout(self.connect_timeout, attempt).await {
            Ok(connection) => Arc::new(connection?),
            Err(_) => {
                let timed_out = std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!(
                        "no AMQP handshake within {:?} (the node accepts connections but does not answer)",
                        self.connect_timeout
                    ),
                );
                return Err(ConnectError::Amqp {
                    redacted: self.url.redacted().to_owned(),
                    source: timed_out.into(),
                });
            }
        };
        debug!(broker = %self.url, name = %self.name, "publishing connection open");
        // A new connection is not blocked until the broker says so.
        self.blocked.send_replace(false);
        tokio::spawn(watch_blocked(
            connection.events_listener().boxed(),
            self.blocked.clone(),
            self.url.redacted().to_owned(),
        ));
        *current = Some(Arc::clone(&connection));
        Ok(connection)
    }

    /// Whether the broker blocks the connection, and its changes.
    pub(crate) fn blocked(&self) -> watch::Receiver<bool> {
        self.blocked.subscribe()
    }
}

impl Drop for Publishing {
    fn drop(&mut self) {
        // The last worker using it is gone: close it rather than leave it to the broker's
        // heartbeat timeout.
        if let Some(c) = self.connection.get_mut().take() {
            if c.status().connected() {
                if let Ok(handle) = tokio::runtime::Handle::try_current() {
                    handle.spawn(async move {
                        let _ = c.close(200, "worker stopped".into()).await;
                    });
                }
            }
        }
    }
}

/// Follows `connection.blocked` / `unblocked` until the connection's events end.
async fn watch_blocked(
    mut events: futures::stream::BoxStream<'static, Event>,
    blocked: watch::Sender<bool>,
    broker: String,
) {
    while let Some(event) = events.next().await {
        match event {
            Event::ConnectionBlocked(reason) => {
                warn!(broker = %broker, reason = %reason, "the broker blocks the publishing connection (resource alarm): retries wait, successful deliveries are still acked");
                blocked.send_replace(true);
            }
            Event::ConnectionUnblocked => {
                info!(broker = %broker, "the broker unblocked the publishing connection");
                blocked.send_replace(false);
            }
            _ => {}
        }
    }
    // A dead connection blocks nothing; its successor reports afresh.
    blocked.send_replace(false);
}

/// Why the publisher could not be (re)opened.
#[derive(Debug, thiserror::Error)]
pub(crate) enum OpenError {
    #[error("publishing connection: {0}")]
    Connect(#[from] redeliver_amqp::ConnectError),
    #[error(transparent)]
    Publish(#[from] redeliver_amqp::PublishError),
}

impl From<OpenError> for crate::error::WorkerError {
    fn from(e: OpenError) -> Self {
        match e {
            OpenError::Connect(e) => crate::error::WorkerError::Connect(e),
            OpenError::Publish(e) => crate::error::WorkerError::Publisher(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A node that accepts TCP and never answers: the connect gives up after its timeout,
    /// and releases the lock for the next attempt.
    #[tokio::test]
    async fn a_connect_to_a_silent_node_times_out() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("listen");
        let port = listener.local_addr().expect("address").port();
        // Accepts, keeps the sockets open, sends nothing.
        let silent = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((socket, _)) = listener.accept().await {
                held.push(socket);
            }
        });
        let url =
            BrokerUrl::parse(&format!("amqp://guest:guest@127.0.0.1:{port}/%2f")).expect("url");
        let publishing = Publishing {
            url,
            tls: TlsConfig::new(),
            name: "silent".into(),
            connection: tokio::sync::Mutex::new(None),
            blocked: watch::Sender::new(false),
            connect_timeout: Duration::from_millis(500),
        };
        for _ in 0..2 {
            let started = std::time::Instant::now();
            let outcome = tokio::time::timeout(Duration::from_secs(10), publishing.connection())
                .await
                .expect("the connect attempt is bounded");
            let Err(error) = outcome else {
                panic!("a connection to a silent node");
            };
            assert!(error.to_string().contains("no AMQP handshake"), "{error}");
            assert!(!error.to_string().contains("guest:guest"), "{error}");
            assert!(started.elapsed() < Duration::from_secs(5));
        }
        silent.abort();
    }
}
