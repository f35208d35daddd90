//! What the broker says about itself, and the semantics that differ between RabbitMQ versions.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use futures::{AsyncReadExt, AsyncWriteExt};
use lapin::protocol::AMQPClass;
use lapin::tcp::{AMQPUriTcpExt, OwnedTLSConfig};
use lapin::types::AMQPValue;
use lapin::uri::AMQPUri;

/// How long a probe may take, connect included, unless the URL sets `connection_timeout`.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(10);

/// Largest `connection.start` frame accepted (RabbitMQ's is under 1 KiB).
const MAX_START_FRAME: usize = 64 * 1024;

/// A RabbitMQ version, `major.minor.patch` (a missing part reads as 0, a suffix such as
/// `-beta.1` is ignored).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BrokerVersion {
    /// Major version (3, 4, ...).
    pub major: u32,
    /// Minor version.
    pub minor: u32,
    /// Patch version.
    pub patch: u32,
}

impl BrokerVersion {
    /// `major.minor.patch`.
    pub const fn new(major: u32, minor: u32, patch: u32) -> Self {
        Self {
            major,
            minor,
            patch,
        }
    }

    /// Parses `"4.3.6"`, `"3.10"`, `"4.1.0-rc.1"`; `None` when it does not start with a number.
    pub fn parse(s: &str) -> Option<Self> {
        let core = s.trim().split(['-', '+', ' ']).next()?;
        let mut parts = core.split('.');
        let major = parts.next()?.parse().ok()?;
        let minor = parts.next().map_or(Some(0), |p| p.parse().ok())?;
        let patch = parts.next().map_or(Some(0), |p| p.parse().ok())?;
        Some(Self::new(major, minor, patch))
    }

    /// Whether a quorum queue counts a `basic.nack`/`basic.reject` with `requeue = true` as a
    /// delivery attempt toward `x-delivery-limit`. Measured: yes on 3.10.8 and 4.0.5, no on
    /// 4.3.6 (only a return by a closed channel or connection counts there). So from 4.3 a
    /// consumer's own requeues are unbounded unless the consumer bounds them.
    pub fn requeue_counts_toward_delivery_limit(&self) -> bool {
        *self < Self::new(4, 3, 0)
    }

    /// Whether a quorum queue holds a message given back with the AMQP 1.0 outcome `modified`
    /// until its `x-opt-delivery-time` (native retry). Measured: yes on 4.3.6; on 4.0.5 the
    /// message comes back at once.
    pub fn holds_native_retries(&self) -> bool {
        *self >= Self::new(4, 3, 0)
    }

    /// The delivery limit a quorum queue has when declared without `x-delivery-limit`: none
    /// before 4.0, 20 from 4.0 (a message returned more often is dropped, or dead-lettered when
    /// the queue has a dead-letter exchange).
    pub fn default_delivery_limit(&self) -> Option<u32> {
        if self.major >= 4 {
            Some(20)
        } else {
            None
        }
    }

    /// The broker's default `max_message_size` (largest body it accepts): 128 MiB before 4.0,
    /// 16 MiB from 4.0. A broker can be configured otherwise.
    pub fn default_max_message_size(&self) -> usize {
        if self.major >= 4 {
            16 * 1024 * 1024
        } else {
            128 * 1024 * 1024
        }
    }

    /// Whether dead-lettering a message whose `x-death` header a client forged (an array
    /// holding a non-table, or a non-integer `count`) is known to crash the broker's
    /// dead-lettering: RabbitMQ 3.x (measured on 3.10.8). From 4.0 the broker keeps its
    /// dead-letter history in message annotations and ignores a client's `x-death`.
    pub fn dead_lettering_trusts_client_x_death(&self) -> bool {
        self.major < 4
    }
}

impl fmt::Display for BrokerVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

impl FromStr for BrokerVersion {
    type Err = ProbeError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
            .ok_or_else(|| ProbeError::Protocol(StartFrameError::Version { text: s.to_owned() }))
    }
}

/// What a broker announced in `connection.start`.
///
/// lapin 4 reads `connection.start` and drops its server properties, so [`ServerInfo::probe`]
/// opens a short connection of its own: it sends the protocol header, reads `connection.start`
/// and closes the socket before authenticating (no credentials are sent). The broker logs that
/// as a client that closed its connection early.
///
/// ```
/// use redeliver::amqp::BrokerVersion;
///
/// let v = BrokerVersion::parse("4.3.6").unwrap();
/// assert!(!v.requeue_counts_toward_delivery_limit());
/// assert_eq!(v.default_delivery_limit(), Some(20));
/// assert_eq!(BrokerVersion::parse("3.10.8").unwrap().default_delivery_limit(), None);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerInfo {
    product: String,
    version_text: String,
    version: Option<BrokerVersion>,
    cluster_name: Option<String>,
}

/// Why [`ServerInfo::probe`] failed. The message never contains the URL's password.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProbeError {
    /// The URL does not parse. The parser's own message is left out: it can quote the URL,
    /// password included.
    #[error("not an AMQP URL: expected amqp://user:password@host:port/vhost")]
    Url,
    /// Connecting (TCP or TLS) or reading failed.
    #[error("cannot reach the broker at {endpoint}: {source}")]
    Io {
        /// `host:port`.
        endpoint: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// No `connection.start` within the time allowed.
    #[error("the broker at {endpoint} sent no connection.start within {timeout:?}")]
    Timeout {
        /// `host:port`.
        endpoint: String,
        /// The time allowed.
        timeout: Duration,
    },
    /// The peer answered with something other than AMQP 0-9-1's `connection.start`.
    #[error("not an AMQP 0-9-1 broker: {0}")]
    Protocol(StartFrameError),
}

/// How the peer's first frame differs from AMQP 0-9-1's `connection.start`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartFrameError {
    /// The peer answered with a protocol header: it does not speak AMQP 0-9-1.
    #[error("the broker refused protocol AMQP 0-9-1")]
    Refused,
    /// The first frame is larger than any `connection.start`.
    #[error("first frame of {size} bytes")]
    TooLarge {
        /// Its announced size in bytes.
        size: usize,
    },
    /// The frame does not parse.
    #[error("unreadable first frame: {reason}")]
    Unreadable {
        /// The frame parser's message.
        reason: String,
    },
    /// The announced version is not `major.minor.patch`.
    #[error("not a version: {text:?}")]
    Version {
        /// The version text.
        text: String,
    },
    /// A frame other than `connection.start`.
    #[error("expected connection.start, got {frame}")]
    Unexpected {
        /// The frame received, as `Debug` shows it.
        frame: String,
    },
}

impl ServerInfo {
    /// A `ServerInfo` for a broker announcing `product` and `version` (for tests and for
    /// callers that learnt the version elsewhere, e.g. from the management API).
    pub fn new(product: impl Into<String>, version: impl Into<String>) -> Self {
        let version_text = version.into();
        Self {
            product: product.into(),
            version: BrokerVersion::parse(&version_text),
            version_text,
            cluster_name: None,
        }
    }

    /// Reads the server properties of the broker at `url` (`amqp://` or, in a build with TLS,
    /// `amqps://`), without authenticating. Takes at most the URL's `connection_timeout` or
    /// [`PROBE_TIMEOUT`].
    pub async fn probe(url: &str) -> Result<Self, ProbeError> {
        // The parser's message can quote the URL, password included: not passed on.
        let uri: AMQPUri = url.parse().map_err(|_: String| ProbeError::Url)?;
        Self::probe_uri(&uri, OwnedTLSConfig::default()).await
    }

    /// [`Self::probe`] for a parsed URL, with the TLS settings of the real connection (CA,
    /// client certificate).
    pub async fn probe_uri(uri: &AMQPUri, tls: OwnedTLSConfig) -> Result<Self, ProbeError> {
        let endpoint = format!("{}:{}", uri.authority.host, uri.authority.port);
        let timeout = uri
            .query
            .connection_timeout
            .map_or(PROBE_TIMEOUT, Duration::from_millis);
        let io = |source| ProbeError::Io {
            endpoint: endpoint.clone(),
            source,
        };
        let read = async {
            let runtime = lapin::runtime::default_runtime()
                .map_err(|e| io(std::io::Error::other(e.to_string())))?;
            let mut stream = uri
                .connect_with_config_async(tls.as_ref(), &runtime)
                .await
                .map_err(io)?;
            stream
                .write_all(b"AMQP\x00\x00\x09\x01")
                .await
                .map_err(io)?;
            stream.flush().await.map_err(io)?;
            let mut header = [0u8; 7];
            stream.read_exact(&mut header).await.map_err(io)?;
            if &header[..4] == b"AMQP" {
                return Err(ProbeError::Protocol(StartFrameError::Refused));
            }
            let size = u32::from_be_bytes([header[3], header[4], header[5], header[6]]) as usize;
            if size > MAX_START_FRAME {
                return Err(ProbeError::Protocol(StartFrameError::TooLarge { size }));
            }
            let mut frame = header.to_vec();
            frame.resize(7 + size + 1, 0);
            stream.read_exact(&mut frame[7..]).await.map_err(io)?;
            let _ = stream.close().await;
            Ok(frame)
        };
        let frame = match tokio::time::timeout(timeout, read).await {
            Ok(frame) => frame?,
            Err(_) => return Err(ProbeError::Timeout { endpoint, timeout }),
        };
        Self::from_start_frame(&frame)
    }

    /// Parses a raw `connection.start` frame.
    fn from_start_frame(frame: &[u8]) -> Result<Self, ProbeError> {
        use lapin::protocol::connection::AMQPMethod;
        let parsed = amq_protocol::frame::parse_frame(frame).map_err(|e| {
            ProbeError::Protocol(StartFrameError::Unreadable {
                reason: e.to_string(),
            })
        })?;
        let start = match parsed.1 {
            amq_protocol::frame::AMQPFrame::Method(
                0,
                AMQPClass::Connection(AMQPMethod::Start(s)),
            ) => s,
            other => {
                return Err(ProbeError::Protocol(StartFrameError::Unexpected {
                    frame: format!("{other:?}"),
                }))
            }
        };
        let props = start.server_properties.inner();
        let text = |key: &str| match props.get(key) {
            Some(AMQPValue::LongString(s)) => {
                Some(String::from_utf8_lossy(s.as_bytes()).into_owned())
            }
            Some(AMQPValue::ShortString(s)) => Some(s.as_str().to_owned()),
            _ => None,
        };
        let version_text = text("version").unwrap_or_default();
        Ok(Self {
            product: text("product").unwrap_or_default(),
            version: BrokerVersion::parse(&version_text),
            version_text,
            cluster_name: text("cluster_name"),
        })
    }

    /// `"RabbitMQ"` for RabbitMQ.
    pub fn product(&self) -> &str {
        &self.product
    }

    /// The version as announced, e.g. `"4.3.6"`.
    pub fn version_text(&self) -> &str {
        &self.version_text
    }

    /// The parsed version; `None` when the broker announced none that parses.
    pub fn version(&self) -> Option<BrokerVersion> {
        self.version
    }

    /// The cluster's name, when announced.
    pub fn cluster_name(&self) -> Option<&str> {
        self.cluster_name.as_deref()
    }

    /// Whether this is RabbitMQ at `major.minor` or later.
    pub fn is_rabbitmq_at_least(&self, major: u32, minor: u32) -> bool {
        self.product == "RabbitMQ"
            && self
                .version
                .is_some_and(|v| v >= BrokerVersion::new(major, minor, 0))
    }
}

impl fmt::Display for ServerInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let product = if self.product.is_empty() {
            "unknown broker"
        } else {
            &self.product
        };
        write!(f, "{product} {}", self.version_text)?;
        if let Some(c) = &self.cluster_name {
            write!(f, " (cluster {c})")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use amq_protocol::frame::{gen_frame, AMQPFrame};
    use lapin::protocol::connection::{AMQPMethod, Start};
    use lapin::types::FieldTable;

    #[test]
    fn versions_parse_and_order() {
        assert_eq!(
            BrokerVersion::parse("4.3.6"),
            Some(BrokerVersion::new(4, 3, 6))
        );
        assert_eq!(
            BrokerVersion::parse("3.10"),
            Some(BrokerVersion::new(3, 10, 0))
        );
        assert_eq!(
            BrokerVersion::parse("4.1.0-rc.1"),
            Some(BrokerVersion::new(4, 1, 0))
        );
        assert_eq!(BrokerVersion::parse("x"), None);
        assert_eq!(BrokerVersion::parse(""), None);
        assert!(BrokerVersion::new(3, 10, 8) < BrokerVersion::new(4, 0, 5));
        assert!(BrokerVersion::new(4, 0, 5) < BrokerVersion::new(4, 3, 6));
        assert_eq!(BrokerVersion::new(4, 0, 5).to_string(), "4.0.5");
    }

    #[test]
    fn semantics_by_version() {
        let v3 = BrokerVersion::new(3, 10, 8);
        let v40 = BrokerVersion::new(4, 0, 5);
        let v43 = BrokerVersion::new(4, 3, 6);
        assert!(v3.requeue_counts_toward_delivery_limit());
        assert!(v40.requeue_counts_toward_delivery_limit());
        assert!(!v43.requeue_counts_toward_delivery_limit());
        assert_eq!(v3.default_delivery_limit(), None);
        assert_eq!(v40.default_delivery_limit(), Some(20));
        assert_eq!(v3.default_max_message_size(), 128 << 20);
        assert_eq!(v43.default_max_message_size(), 16 << 20);
        assert!(v3.dead_lettering_trusts_client_x_death());
        assert!(!v40.dead_lettering_trusts_client_x_death());
    }

    #[test]
    fn reads_a_connection_start_frame() {
        let mut props = FieldTable::default();
        props.insert("product".into(), AMQPValue::LongString("RabbitMQ".into()));
        props.insert("version".into(), AMQPValue::LongString("4.3.6".into()));
        props.insert(
            "cluster_name".into(),
            AMQPValue::LongString("rabbit4@localhost".into()),
        );
        props.insert(
            "capabilities".into(),
            AMQPValue::FieldTable(FieldTable::default()),
        );
        let start = Start {
            version_major: 0,
            version_minor: 9,
            server_properties: props,
            mechanisms: "PLAIN AMQPLAIN".into(),
            locales: "en_US".into(),
        };
        let frame = AMQPFrame::Method(0, AMQPClass::Connection(AMQPMethod::Start(start)));
        let mut buf = Vec::new();
        let ctx = gen_frame(&frame)(amq_protocol::frame::WriteContext::from(Vec::new()))
            .expect("serializes");
        buf.extend_from_slice(&ctx.write);
        let info = ServerInfo::from_start_frame(&buf).expect("parses");
        assert_eq!(info.product(), "RabbitMQ");
        assert_eq!(info.version(), Some(BrokerVersion::new(4, 3, 6)));
        assert_eq!(
            info.to_string(),
            "RabbitMQ 4.3.6 (cluster rabbit4@localhost)"
        );
        assert!(info.is_rabbitmq_at_least(4, 3));
        assert!(!info.is_rabbitmq_at_least(4, 4));
        assert!(ServerInfo::from_start_frame(b"\x08\x00\x00\x00\x00\x00\x00\xce").is_err());
    }
}
