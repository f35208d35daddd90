//! A consumer of one queue over AMQP 1.0: one connection (read through the nesting guard), one
//! session, one receiving link with manual settlement, and the task that owns the link.
//!
//! fe2o3-amqp settles `modified` and `rejected` only through the [`Receiver`] itself, which
//! `recv` borrows mutably: so one task owns it, receives, and carries out the settlements the
//! deliveries' tasks send it ([`Settler`]). It also batches them: the accepts waiting when it
//! wakes go out as one `accept_all`, which fe2o3 coalesces into ranges (one disposition frame
//! for a run of deliveries), as the 0-9-1 worker batches its acks.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use fe2o3_amqp::connection::ConnectionHandle;
use fe2o3_amqp::link::delivery::DeliveryInfo;
use fe2o3_amqp::link::receiver::CreditMode;
use fe2o3_amqp::link::RecvError;
use fe2o3_amqp::sasl_profile::SaslProfile;
use fe2o3_amqp::session::SessionHandle;
use fe2o3_amqp::types::messaging::{Body, Modified, Source};
use fe2o3_amqp::types::primitives::{OrderedMap, Symbol, Value};
use fe2o3_amqp::{Connection, Receiver, Session};
use futures::FutureExt;
use lapin::message::Delivery;
use std::panic::AssertUnwindSafe;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tracing::{debug, warn};

use crate::guard::{Cuts, GuardedStream};
use crate::message::to_delivery;
use crate::tls::Tls;

/// Bound on opening the connection, session and link, and on closing them.
const OPEN_TIMEOUT: Duration = Duration::from_secs(30);

/// Bound on the last settlements and the detach when closing.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);

/// Where and as whom to connect.
#[derive(Clone)]
pub struct Endpoint {
    /// Host name or address.
    pub host: String,
    /// Port: the URL's (RabbitMQ serves AMQP 1.0 on its AMQP port, 5672, and with TLS on its
    /// AMQPS port, 5671).
    pub port: u16,
    /// SASL PLAIN user.
    pub username: String,
    /// SASL PLAIN password.
    pub password: String,
    /// The virtual host (`/` by default).
    pub vhost: String,
    /// The connection's container id, shown by RabbitMQ as its name.
    pub container_id: String,
    /// TLS (`amqps://`), or `None` for a plain connection. With
    /// [`TlsConfig::sasl_external`](redeliver_amqp::TlsConfig::sasl_external) the broker logs
    /// in by the client certificate, and `username` and `password` are not sent. Needs the
    /// `tls` feature ([`crate::tls::SUPPORTED`]).
    pub tls: Option<Tls>,
}

impl std::fmt::Debug for Endpoint {
    // By hand: never the password.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("username", &self.username)
            .field("vhost", &self.vhost)
            .field("container_id", &self.container_id)
            .field("tls", &self.tls)
            .finish_non_exhaustive()
    }
}

/// Why a consumer could not be opened, or ended.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// TCP connect or I/O.
    #[error("connecting to {endpoint}: {source}")]
    Io {
        /// `host:port`.
        endpoint: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The AMQP 1.0 connection, session or link was refused or failed.
    #[error("AMQP 1.0 {what}: {reason}")]
    Amqp {
        /// `connection`, `session` or `link`.
        what: &'static str,
        /// The broker's or the client's reason.
        reason: String,
    },
    /// Opening took longer than 30 s.
    #[error("opening the AMQP 1.0 {0} timed out")]
    Timeout(&'static str),
    /// The TLS settings cannot be used (a file unreadable or holding no usable PEM), or TLS
    /// was asked of a build without the `tls` feature.
    #[error("TLS: {0}")]
    Tls(String),
    /// The broker's certificate was refused (unknown CA, wrong host name, expired), the broker
    /// refused ours, or the port does not speak TLS.
    #[error("TLS handshake with {endpoint} failed: {reason}")]
    TlsHandshake {
        /// `host:port`.
        endpoint: String,
        /// rustls' reason, e.g. `invalid peer certificate: UnknownIssuer`, and what to check.
        reason: String,
    },
}

/// A received delivery, as the worker handles it.
// Not boxed: each one moves once, through a channel, and a box would cost an allocation per
// message on the hot path.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Incoming {
    /// A message, mapped to a lapin delivery ([`crate::message`]); its `delivery_tag` is what
    /// [`Settler`] takes.
    Message(Delivery),
    /// A message that could not be decoded (or was cut by the guard): settle it by `tag`.
    Undecodable {
        /// For [`Settler`].
        tag: u64,
        /// Why.
        error: String,
    },
}

/// A value of a message annotation given with `modified`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Annotation {
    /// An AMQP long (times in Unix milliseconds, counts).
    Long(i64),
    /// An AMQP string.
    Text(String),
}

/// The `modified` outcome: what the queue does with the message next.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Modify {
    /// Counts as a failed delivery (`x-delivery-count` + 1).
    pub delivery_failed: bool,
    /// Dead-letter it (through the queue's DLX) instead of delivering it again.
    pub undeliverable_here: bool,
    /// Message annotations to add: keys must start `x-opt-` (RabbitMQ refuses others).
    pub annotations: Vec<(String, Annotation)>,
}

enum Command {
    Accept(u64),
    Release(u64),
    Modify(u64, Modify, oneshot::Sender<bool>),
    /// Carry out everything sent before, detach the link, then answer.
    Close(oneshot::Sender<()>),
}

/// Settles deliveries of one consumer from any task. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Settler {
    tx: mpsc::UnboundedSender<Command>,
    open: Arc<AtomicBool>,
}

impl std::fmt::Debug for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Command::Accept(t) => write!(f, "Accept({t})"),
            Command::Release(t) => write!(f, "Release({t})"),
            Command::Modify(t, m, _) => write!(f, "Modify({t}, {m:?})"),
            Command::Close(_) => f.write_str("Close"),
        }
    }
}

impl Settler {
    /// The link is still attached: a settlement can reach the broker.
    pub fn is_open(&self) -> bool {
        self.open.load(Ordering::Acquire) && !self.tx.is_closed()
    }

    /// `accepted` (batched with the other accepts waiting); false when the link is gone.
    pub fn accept(&self, tag: u64) -> bool {
        self.is_open() && self.tx.send(Command::Accept(tag)).is_ok()
    }

    /// `released`: back to the queue, not counted as a failed delivery.
    pub fn release(&self, tag: u64) -> bool {
        self.is_open() && self.tx.send(Command::Release(tag)).is_ok()
    }

    /// `modified`; true once the disposition is handed to the connection.
    pub async fn modify(&self, tag: u64, modify: Modify) -> bool {
        if !self.is_open() {
            return false;
        }
        let (done, answer) = oneshot::channel();
        if self.tx.send(Command::Modify(tag, modify, done)).is_err() {
            return false;
        }
        answer.await.unwrap_or(false)
    }
}

/// A consuming link and its connection.
#[derive(Debug)]
pub struct Consumer {
    link: Link,
    connection: ConnectionHandle<()>,
}

/// What [`Consumer::attach`] opens on a connection: the session, the task owning the receiving
/// link, and the handles to it.
#[derive(Debug)]
struct Link {
    deliveries: mpsc::Receiver<Incoming>,
    settler: Settler,
    task: JoinHandle<()>,
    session: SessionHandle<()>,
    /// Why the link task ended, once it did.
    end: Arc<std::sync::Mutex<Option<String>>>,
    /// Set by the link task when the broker ended the session with an internal error.
    broker_failed: Arc<AtomicBool>,
}

impl Consumer {
    /// Connects to `endpoint` and consumes `queue` with `credit` unsettled deliveries at most
    /// (the prefetch).
    pub async fn open(endpoint: &Endpoint, queue: &str, credit: u32) -> Result<Self, Error> {
        // The TLS settings are read, or refused, before connecting: a build without TLS never
        // sends in plain text what was meant for TLS.
        #[cfg(feature = "tls")]
        let tls = match &endpoint.tls {
            Some(tls) => Some((crate::tls::Connector::new(tls)?, tls)),
            None => None,
        };
        #[cfg(not(feature = "tls"))]
        let tls: Option<(std::convert::Infallible, &Tls)> = match &endpoint.tls {
            Some(_) => return Err(no_tls()),
            None => None,
        };
        let address = format!("{}:{}", endpoint.host, endpoint.port);
        let tcp = tokio::net::TcpStream::connect(&address)
            .await
            .map_err(|source| Error::Io {
                endpoint: address.clone(),
                source,
            })?;
        let _ = tcp.set_nodelay(true);
        let cuts = Cuts::default();
        let mut connection = match tls {
            None => connect(GuardedStream::new(tcp, cuts.clone()), endpoint, false)
                .await
                .map_err(|e| e.into_error(None, &address))?,
            #[cfg(feature = "tls")]
            Some((connector, tls)) => {
                let stream = tokio::time::timeout(OPEN_TIMEOUT, connector.handshake(tcp, &address))
                    .await
                    .map_err(|_| Error::Timeout("TLS handshake"))??;
                // The guard on the plaintext side: it reads AMQP frames, not TLS records.
                let stream = GuardedStream::new(stream, cuts.clone());
                connect(stream, endpoint, tls.config.configured_sasl_external())
                    .await
                    .map_err(|e| e.into_error(Some(tls), &address))?
            }
            #[cfg(not(feature = "tls"))]
            Some((never, _)) => match never {},
        };
        match Self::attach(&mut connection, queue, credit, cuts).await {
            Ok(link) => Ok(Self { link, connection }),
            Err(e) => {
                let _ = tokio::time::timeout(OPEN_TIMEOUT, connection.close()).await;
                Err(e)
            }
        }
    }

    async fn attach(
        connection: &mut ConnectionHandle<()>,
        queue: &str,
        credit: u32,
        cuts: Cuts,
    ) -> Result<Link, Error> {
        let mut session = tokio::time::timeout(OPEN_TIMEOUT, Session::begin(connection))
            .await
            .map_err(|_| Error::Timeout("session"))?
            .map_err(|e| Error::Amqp {
                what: "session",
                reason: e.to_string(),
            })?;
        let source = Source::builder().address(queue_address(queue)).build();
        let attach = Receiver::builder()
            .name(format!("redeliver-{queue}"))
            .source(source)
            .auto_accept(false)
            // Granted by the link task as deliveries are settled: fe2o3's automatic credit
            // (0.18.4) tops up a whole window every half window of dispositions, so more than
            // the prefetch could be unsettled, and it counts a transfer against the credit
            // only when `recv` takes it, so a flow from the broker meanwhile makes it see more
            // transfers than it granted and fail the link.
            .credit_mode(CreditMode::Manual)
            .attach(&mut session);
        let receiver = match tokio::time::timeout(OPEN_TIMEOUT, attach).await {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => {
                let _ = session.end().await;
                return Err(Error::Amqp {
                    what: "link",
                    reason: e.to_string(),
                });
            }
            Err(_) => return Err(Error::Timeout("link")),
        };
        let (out, deliveries) = mpsc::channel(credit.max(1) as usize);
        let (tx, commands) = mpsc::unbounded_channel();
        let open = Arc::new(AtomicBool::new(true));
        let end = Arc::new(std::sync::Mutex::new(None));
        let broker_failed = Arc::new(AtomicBool::new(false));
        let task = tokio::spawn(
            LinkTask {
                receiver,
                credit: credit.max(1),
                available: 0,
                broker_failed: Arc::clone(&broker_failed),
                unsettled: HashMap::new(),
                cuts,
                open: Arc::clone(&open),
                end: Arc::clone(&end),
            }
            .run(out, commands),
        );
        Ok(Link {
            deliveries,
            settler: Settler { tx, open },
            task,
            session,
            end,
            broker_failed,
        })
    }

    /// The next delivery; `None` once the link, session or connection ended ([`Self::ended`]
    /// says why).
    pub async fn next(&mut self) -> Option<Incoming> {
        self.link.deliveries.recv().await
    }

    /// Why the link ended, once [`next`](Self::next) returned `None`.
    pub fn ended(&self) -> String {
        self.link
            .end
            .lock()
            .ok()
            .and_then(|e| e.clone())
            .unwrap_or_else(|| "the AMQP 1.0 link ended".to_owned())
    }

    /// Whether the link ended on a crash of the broker's session (`amqp:internal-error`,
    /// "Session error"): RabbitMQ 4.3 ends the connection so when it cannot convert a message
    /// for AMQP 1.0 (a `decimal` header, for one), and does so again at every delivery of that
    /// message. A connection closed by an operator is not one.
    pub fn broker_failed(&self) -> bool {
        self.link.broker_failed.load(Ordering::Acquire)
    }

    /// The settler of this consumer's deliveries.
    pub fn settler(&self) -> Settler {
        self.link.settler.clone()
    }

    /// Stops receiving: deliveries not yet taken go back to the queue when the link closes.
    pub fn stop_receiving(&mut self) {
        self.link.deliveries.close();
    }

    /// Closes link, session and connection, within 30 s; unsettled deliveries go back to the
    /// queue.
    pub async fn close(mut self) {
        // Settlements sent before this call go out first, and the detach after them on the same
        // link: the session's end could otherwise overtake a last accept, and the broker would
        // deliver that message again.
        let (done, detached) = oneshot::channel();
        if self.link.settler.tx.send(Command::Close(done)).is_ok() {
            let _ = tokio::time::timeout(CLOSE_TIMEOUT, detached).await;
        }
        self.link.settler.open.store(false, Ordering::Release);
        self.link.task.abort();
        let _ = tokio::time::timeout(OPEN_TIMEOUT, self.link.session.end()).await;
        if let Ok(Err(e)) = tokio::time::timeout(OPEN_TIMEOUT, self.connection.close()).await {
            debug!(error = %e, "closing the AMQP 1.0 connection");
        }
    }
}

/// Opens the AMQP 1.0 connection on `stream` (plain, or the plaintext side of TLS): SASL PLAIN
/// through fe2o3, or SASL EXTERNAL first when `external` (only with TLS).
#[cfg_attr(not(feature = "tls"), allow(unused_mut))]
async fn connect<S>(
    mut stream: GuardedStream<S>,
    endpoint: &Endpoint,
    external: bool,
) -> Result<ConnectionHandle<()>, OpenFailure>
where
    S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let hostname = format!("vhost:{}", endpoint.vhost);
    let open = async {
        let builder = Connection::builder()
            .container_id(endpoint.container_id.clone())
            .hostname(hostname.as_str());
        let builder = if external {
            #[cfg(feature = "tls")]
            crate::tls::sasl_external(&mut stream, &hostname)
                .await
                .map_err(|e| match e {
                    crate::tls::SaslFailure::Io(e) => OpenFailure::Io(e),
                    crate::tls::SaslFailure::Refused(reason) => OpenFailure::Ours(Error::Amqp {
                        what: "connection",
                        reason,
                    }),
                })?;
            // Done: fe2o3 starts at the AMQP header.
            builder
        } else {
            builder.sasl_profile(SaslProfile::Plain {
                username: endpoint.username.clone(),
                password: endpoint.password.clone(),
            })
        };
        builder
            .open_with_stream(stream)
            .await
            .map_err(OpenFailure::Fe2o3)
    };
    tokio::time::timeout(OPEN_TIMEOUT, open)
        .await
        .map_err(|_| OpenFailure::Ours(Error::Timeout("connection")))?
}

/// Why [`connect`] failed: fe2o3's error or an I/O error of SASL EXTERNAL (either of which TLS
/// may explain), or ours.
enum OpenFailure {
    Fe2o3(fe2o3_amqp::connection::OpenError),
    #[cfg_attr(not(feature = "tls"), allow(dead_code))]
    Io(std::io::Error),
    Ours(Error),
}

impl OpenFailure {
    fn into_error(self, tls: Option<&Tls>, address: &str) -> Error {
        match self {
            OpenFailure::Ours(e) => e,
            OpenFailure::Fe2o3(e) => explain(&e, tls, address).unwrap_or(Error::Amqp {
                what: "connection",
                reason: e.to_string(),
            }),
            OpenFailure::Io(e) => explain(&e, tls, address).unwrap_or(Error::Amqp {
                what: "connection",
                reason: format!("SASL EXTERNAL: {e}"),
            }),
        }
    }
}

/// A failure after the TLS handshake that TLS explains (a refused client certificate).
#[cfg_attr(not(feature = "tls"), allow(unused_variables))]
fn explain(
    cause: &(dyn std::error::Error + 'static),
    tls: Option<&Tls>,
    address: &str,
) -> Option<Error> {
    #[cfg(feature = "tls")]
    return tls.and_then(|tls| crate::tls::after_handshake(cause, tls, address));
    #[cfg(not(feature = "tls"))]
    None
}

#[cfg(not(feature = "tls"))]
fn no_tls() -> Error {
    Error::Tls("this build has no TLS support (redeliver-amqp1's `tls` feature)".to_owned())
}

/// RabbitMQ 4's address of a queue: `/queues/` and the name, percent-encoded as a path segment.
pub fn queue_address(queue: &str) -> String {
    let mut out = String::from("/queues/");
    for b in queue.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

struct LinkTask {
    receiver: Receiver,
    /// Deliveries unsettled at most (the prefetch).
    credit: u32,
    /// Credit granted and not yet used, as far as we know (transfers in flight use it too).
    available: u32,
    broker_failed: Arc<AtomicBool>,
    unsettled: HashMap<u64, DeliveryInfo>,
    cuts: Cuts,
    open: Arc<AtomicBool>,
    end: Arc<std::sync::Mutex<Option<String>>>,
}

impl LinkTask {
    async fn run(
        mut self,
        out: mpsc::Sender<Incoming>,
        mut commands: mpsc::UnboundedReceiver<Command>,
    ) {
        // Received, not yet taken by the worker. Never more than the credit: what the broker
        // may send is bounded by what we grant (`top_up`).
        let mut pending: std::collections::VecDeque<Incoming> = std::collections::VecDeque::new();
        if let Err(e) = self.receiver.set_credit(self.credit).await {
            warn!(error = %e, "granting the AMQP 1.0 link its credit");
        }
        self.available = self.credit;
        let why = loop {
            // Never waits on the worker: settlements (which the worker's handlers await, holding
            // its permits) keep flowing while it takes no delivery.
            tokio::select! {
                biased;
                cmd = commands.recv() => match cmd {
                    Some(cmd) => {
                        if let Some(done) = self.settle(cmd, &mut commands).await {
                            self.open.store(false, Ordering::Release);
                            // What is still unsettled was never handled (received after the
                            // worker stopped taking deliveries, or abandoned at the end of the
                            // grace period): `released`, which RabbitMQ does not count as a
                            // failed delivery, where a detach with them unsettled would.
                            let rest: Vec<DeliveryInfo> =
                                self.unsettled.drain().map(|(_, info)| info).collect();
                            if !rest.is_empty() {
                                if let Err(e) = self.receiver.release_all(rest).await {
                                    debug!(error = %e, "releasing the unhandled deliveries");
                                }
                            }
                            if let Err(e) = self.receiver.close().await {
                                debug!(error = %e, "detaching the AMQP 1.0 link");
                            }
                            let _ = done.send(());
                            return;
                        }
                        self.top_up().await;
                    }
                    None => break "the consumer was dropped".to_owned(),
                },
                permit = out.reserve(), if !pending.is_empty() => match (permit, pending.pop_front()) {
                    (Ok(permit), Some(incoming)) => permit.send(incoming),
                    // Stopped: what is unsettled goes back when the link closes.
                    _ => pending.clear(),
                },
                received = AssertUnwindSafe(self.receiver.recv::<Body<Value>>()).catch_unwind(), if !out.is_closed() => {
                    self.available = self.available.saturating_sub(1);
                    // serde_amqp 0.18's unchecked arithmetic on malformed input panics in a
                    // build with overflow checks: the link ends (its deliveries go back to the
                    // queue, whose delivery limit ends a message that keeps doing it), never
                    // the process.
                    let Ok(received) = received else {
                        break "the AMQP 1.0 decoder panicked on a malformed delivery".to_owned();
                    };
                    let incoming = match received {
                        Ok(delivery) => {
                            let id = *delivery.delivery_id();
                            let tag = u64::from(id);
                            self.unsettled.insert(tag, DeliveryInfo::from(&delivery));
                            // A delivery the guard cut is not what was sent, even when what is
                            // left of it decodes (a cut right after a whole section).
                            if let Some(error) = self.cuts.take(id) {
                                Incoming::Undecodable { tag, error }
                            } else {
                                match to_delivery(tag, delivery.into_message()) {
                                    Ok(d) => Incoming::Message(d),
                                    Err(error) => Incoming::Undecodable { tag, error },
                                }
                            }
                        }
                        Err(RecvError::MessageDecode(e)) => {
                            let tag = u64::from(e.info.delivery_id());
                            let error = self
                                .cuts
                                .take(e.info.delivery_id())
                                .unwrap_or_else(|| format!("the AMQP 1.0 message does not decode: {}", e.source));
                            self.unsettled.insert(tag, e.info);
                            Incoming::Undecodable { tag, error }
                        }
                        Err(e) => {
                            // The broker's session crashed (RabbitMQ failing to convert a
                            // message for AMQP 1.0, say): what the caller may want to avoid.
                            // RabbitMQ says `internal-error` for a connection an operator
                            // closed too ("Connection forced"); only a session's crash says
                            // "Session error".
                            let debug = format!("{e:?}");
                            if debug.contains("AmqpError(InternalError)")
                                && debug.contains("Session error")
                            {
                                self.broker_failed.store(true, Ordering::Release);
                            }
                            break format!("AMQP 1.0 link: {e}");
                        }
                    };
                    pending.push_back(incoming);
                }
            }
        };
        self.open.store(false, Ordering::Release);
        if let Ok(mut end) = self.end.lock() {
            *end = Some(why);
        }
    }

    /// Grants credit again once half of it is used and settled: at most `credit` deliveries are
    /// ever unsettled or on their way. The count sent with it is fe2o3's, which lags the
    /// broker's by the transfers still waiting to be received, so the grant is never more than
    /// meant (the guard keeps the broker's flows from overwriting that count:
    /// docs/upstream/fe2o3-amqp-receiver-credit.md).
    async fn top_up(&mut self) {
        if self.unsettled.len() as u32 + self.available > self.credit / 2 {
            return;
        }
        let grant = self.credit.saturating_sub(self.unsettled.len() as u32);
        match self.receiver.set_credit(grant).await {
            Ok(()) => self.available = grant,
            Err(e) => warn!(error = %e, "granting the AMQP 1.0 link more credit"),
        }
    }

    /// Carries out `first` and every command already waiting, the accepts as one batch; a
    /// close ends the batch and is returned, once what came before it is carried out.
    async fn settle(
        &mut self,
        first: Command,
        commands: &mut mpsc::UnboundedReceiver<Command>,
    ) -> Option<oneshot::Sender<()>> {
        let mut accepts = Vec::new();
        let mut next = Some(first);
        let mut close = None;
        while let Some(cmd) = next {
            match cmd {
                Command::Close(done) => {
                    close = Some(done);
                    break;
                }
                Command::Accept(tag) => {
                    if let Some(info) = self.unsettled.remove(&tag) {
                        accepts.push(info);
                    }
                }
                Command::Release(tag) => {
                    if let Some(info) = self.unsettled.remove(&tag) {
                        if let Err(e) = self.receiver.release(info).await {
                            warn!(error = %e, "AMQP 1.0 release failed; the broker gives the message back when the link closes");
                        }
                    }
                }
                Command::Modify(tag, modify, done) => {
                    let ok = match self.unsettled.remove(&tag) {
                        Some(info) => match self.receiver.modify(info, outcome(modify)).await {
                            Ok(()) => true,
                            Err(e) => {
                                warn!(error = %e, "AMQP 1.0 modified failed; the broker gives the message back when the link closes");
                                false
                            }
                        },
                        None => false,
                    };
                    let _ = done.send(ok);
                }
            }
            next = commands.try_recv().ok();
        }
        if !accepts.is_empty() {
            if let Err(e) = self.receiver.accept_all(accepts).await {
                warn!(error = %e, "AMQP 1.0 accept failed; the broker gives the messages back when the link closes");
            }
        }
        close
    }
}

fn outcome(modify: Modify) -> Modified {
    let annotations = (!modify.annotations.is_empty()).then(|| {
        let mut fields = OrderedMap::new();
        for (k, v) in modify.annotations {
            // Symbols: a string key makes RabbitMQ end the session (DESIGN.md).
            let v = match v {
                Annotation::Long(n) => Value::Long(n),
                Annotation::Text(s) => Value::String(s),
            };
            fields.insert(Symbol::from(k), v);
        }
        fields
    });
    Modified {
        delivery_failed: Some(modify.delivery_failed),
        undeliverable_here: Some(modify.undeliverable_here),
        message_annotations: annotations,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queue_addresses_are_percent_encoded() {
        assert_eq!(queue_address("orders"), "/queues/orders");
        assert_eq!(queue_address("a b/ç"), "/queues/a%20b%2F%C3%A7");
    }
}
