//! The relay: publishes what the outbox holds once it is committed; a row the broker refuses
//! is tried again with backoff, then parked, never a wall in front of the rows behind it.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::join_all;
use redeliver_amqp::lapin::{Channel, Connection, ConnectionProperties};
use redeliver_amqp::url::BrokerUrl;
use redeliver_amqp::{DelayConfig, PublishError, Publisher, ServerInfo, TlsConfig};
use redeliver_core::{Backoff, DeadLetterReason, Decision, HandlerError, Jitter, RetryPolicy};
use sqlx::postgres::PgListener;
use sqlx::{PgPool, Row};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::error::Error;
use crate::outbox::{pending, read_message, OutboxMessage};
use crate::parked::ParkReason;
use crate::schema::Schema;

/// Gauge: rows the relay will publish (not parked; the retrying ones included), as it last
/// counted them (label `outbox`: `schema.table`).
pub const OUTBOX_PENDING: &str = "redeliver_outbox_pending";
/// Gauge: age in seconds of the oldest row the relay will publish (0 when there is none).
pub const OUTBOX_OLDEST_AGE_SECONDS: &str = "redeliver_outbox_oldest_age_seconds";
/// Gauge: rows parked, waiting for an operator (label `outbox`).
pub const OUTBOX_PARKED: &str = "redeliver_outbox_parked";
/// Gauge: seconds since the earliest parked row was parked (0 when none is).
pub const OUTBOX_PARKED_OLDEST_AGE_SECONDS: &str = "redeliver_outbox_parked_oldest_age_seconds";
/// Counter: rows published (confirmed by the broker) and deleted (label `outbox`).
pub const OUTBOX_PUBLISHED_TOTAL: &str = "redeliver_outbox_published_total";
/// Counter: publishes of a row the broker refused (labels `outbox`, `refusal`: `returned`,
/// `nacked`, `no_exchange`, `channel_closed`, `timeout`, `too_large`, `invalid`,
/// `unreadable`).
pub const OUTBOX_REFUSED_TOTAL: &str = "redeliver_outbox_refused_total";
/// Counter: rows parked (labels `outbox`, `reason`: a [`ParkReason`] name).
pub const OUTBOX_PARKED_TOTAL: &str = "redeliver_outbox_parked_total";

/// Upper bound on one connection attempt (TCP, TLS, AMQP handshake, the publisher's channels),
/// so a black-holed broker address cannot hang the reconnect loop.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);
/// How long opening the publisher's channels again on a live connection may take (they open in
/// milliseconds; a connection the broker is closing never answers).
const REOPEN_TIMEOUT: Duration = Duration::from_secs(5);
/// How long closing the broker connection may take (a broker going away may never answer).
const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long an exchange found by a passive declare is trusted to exist.
const EXCHANGE_CHECK_TTL: Duration = Duration::from_secs(10);
/// The longest `last_error` stored, in bytes.
const MAX_ERROR_BYTES: usize = 1024;

/// The relay's retry policy unless [`Relay::policy`] sets another: 1 s, 2 s, 4 s, … capped at
/// 5 minutes, full jitter, 12 retries; a row refused throughout is parked after about 12 minutes
/// on average (about 24 at most).
pub fn default_relay_policy() -> RetryPolicy {
    RetryPolicy::exponential(Duration::from_secs(1))
        .cap(Duration::from_secs(300))
        .max_retries(12)
}

/// Lifecycle of a [`Relay`], as its [`RelayStatus`] reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RelayState {
    /// Built, `run` not called yet.
    Starting,
    /// Preparing the schema, or the first connection to the broker.
    Connecting,
    /// Connected: publishing what the outbox holds. The only ready state.
    Relaying,
    /// The broker connection was lost; waiting out the backoff or reconnecting.
    Reconnecting,
    /// `run` returned.
    Stopped,
}

impl RelayState {
    /// Lower-case name, for logs and health responses.
    pub fn as_str(self) -> &'static str {
        match self {
            RelayState::Starting => "starting",
            RelayState::Connecting => "connecting",
            RelayState::Relaying => "relaying",
            RelayState::Reconnecting => "reconnecting",
            RelayState::Stopped => "stopped",
        }
    }
}

impl std::fmt::Display for RelayState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Cloneable, read-only view of a [`Relay`]'s state, for readiness probes and tests: get it
/// from [`Relay::status_handle`] before `run`.
#[derive(Clone, Debug)]
pub struct RelayStatus {
    rx: watch::Receiver<RelayState>,
    shared: Arc<Flags>,
}

#[derive(Debug, Default)]
struct Flags {
    /// The last round could not reach the database.
    database_down: AtomicBool,
    /// The broker blocks the relay's connection (a memory or disk alarm).
    blocked: AtomicBool,
}

impl RelayStatus {
    /// The state right now.
    pub fn state(&self) -> RelayState {
        *self.rx.borrow()
    }

    /// True while the relay is connected to the broker ([`RelayState::Relaying`]), its last
    /// round reached the database, and the broker does not block its connection: what a
    /// readiness probe should report.
    pub fn is_ready(&self) -> bool {
        self.state() == RelayState::Relaying
            && !self.shared.database_down.load(Ordering::Acquire)
            && !self.shared.blocked.load(Ordering::Acquire)
    }

    /// Waits at most `timeout` until the state satisfies `pred` (checked on the current value
    /// first); `None` on timeout or if the relay was dropped.
    pub async fn wait_for_timeout(
        &mut self,
        timeout: Duration,
        pred: impl FnMut(&RelayState) -> bool,
    ) -> Option<RelayState> {
        tokio::time::timeout(timeout, self.rx.wait_for(pred))
            .await
            .ok()?
            .ok()
            .map(|s| *s)
    }
}

/// Publishes what transactions stored in the outbox, after their commit, and deletes it; a row
/// the broker refuses is tried again with backoff and, after the [policy](Self::policy)'s last
/// retry, parked for an operator ([`ParkedRows`](crate::ParkedRows), `redeliver outbox
/// parked`). The relay connects to the broker itself and reconnects when the connection drops,
/// like a [`Worker`](redeliver_worker::Worker).
///
/// Each round: `BEGIN`; take up to [`batch_size`](Self::batch_size) rows that are due (not
/// parked, their next attempt not in the future) in id order with `FOR UPDATE SKIP LOCKED` (so
/// several relays share the work, never a row); publish each through a confirmed, mandatory
/// publish with the row's message id; delete the rows the broker confirmed, record an attempt on
/// those it refused, park those out of retries; `COMMIT`. So a message is published at least
/// once: twice when the relay dies between the broker's confirm and the commit. Within a round
/// the publishes are concurrent, so the broker may receive them out of id order, and a retried
/// row goes out after newer ones.
///
/// What the broker refuses, and what becomes of it:
///
/// | refusal | the row |
/// |---|---|
/// | returned (no queue bound), nacked, no confirm within [`confirm_timeout`](Self::confirm_timeout), the exchange does not exist, the broker closed the channel on it | tried again after the policy's backoff; parked (`retries_exhausted`) after its last retry |
/// | body over the broker's `max_message_size`, a name over 255 bytes | parked at once (`permanent`) |
/// | headers that are not a JSON object of strings | parked at once (`unreadable`) |
///
/// One row never stops the others: the exchanges of a round are checked with passive declares
/// (on a channel of their own, which a 404 closes) before anything is published to them, and a
/// channel the broker closes during a round anyway (an exchange deleted meanwhile, a publish
/// it forbids) costs no row an attempt: the rows of that round are published one at a time the
/// next time they are due, which finds the one the broker refuses. A lost connection, a broker
/// that blocks publishers (memory or disk alarm) and an unreachable database cost no row an
/// attempt either: the relay waits, reconnects with [`reconnect_backoff`](Self::reconnect_backoff)
/// over its URLs, and goes on.
///
/// The relay `LISTEN`s on the schema's [channel](Schema::notify_channel), so it runs a round as
/// soon as a transaction that stored a message commits, and polls every
/// [`poll_interval`](Self::poll_interval) as well (missed notifications, rows due again). It
/// sets the gauges [`OUTBOX_PENDING`], [`OUTBOX_OLDEST_AGE_SECONDS`], [`OUTBOX_PARKED`] and
/// [`OUTBOX_PARKED_OLDEST_AGE_SECONDS`] after each round, and counts
/// [`OUTBOX_PUBLISHED_TOTAL`], [`OUTBOX_REFUSED_TOTAL`] and [`OUTBOX_PARKED_TOTAL`].
///
/// ```no_run
/// use std::time::Duration;
/// use redeliver::postgres::{Relay, Schema};
/// use redeliver::RetryPolicy;
///
/// # async fn demo(pool: redeliver::postgres::sqlx::PgPool) -> Result<(), redeliver::postgres::Error> {
/// let token = redeliver::CancellationToken::new();
/// Relay::new(pool, "amqp://guest:guest@127.0.0.1:5672/%2f")
///     .schema(Schema::default())
///     .policy(RetryPolicy::exponential(Duration::from_secs(1)).max_retries(10))
///     .run(token)
///     .await?;
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct Relay {
    pool: PgPool,
    schema: Schema,
    urls: Vec<String>,
    tls: TlsConfig,
    connection_name: String,
    policy: RetryPolicy,
    batch_size: u32,
    poll_interval: Duration,
    confirm_timeout: Duration,
    reconnect_backoff: Backoff,
    reconnect_jitter: Jitter,
    max_message_size: Option<usize>,
    state: watch::Sender<RelayState>,
    flags: Arc<Flags>,
}

/// What became of one row in a round.
#[derive(Debug)]
enum Fate {
    /// Confirmed by the broker: deleted.
    Published,
    /// Refused: an attempt is recorded (or the row parked).
    Refused(Refusal),
    /// The publishing channel or the connection went away during the publish: whose doing
    /// that was is for the round to tell (lapin's error).
    Lost(String),
    /// Not the row's doing (connection lost, broker blocked, channel closed by another row):
    /// left as it was.
    Untouched,
}

/// A row taken by a round.
#[derive(Debug)]
struct Taken {
    id: i64,
    /// Refusals recorded so far.
    attempts: i32,
    message_id: String,
    fate: Fate,
}

#[derive(Debug)]
struct Refusal {
    /// The [`OUTBOX_REFUSED_TOTAL`] label.
    kind: &'static str,
    /// Retrying cannot help: parked at once.
    permanent: bool,
    error: String,
}

impl Refusal {
    fn transient(kind: &'static str, error: String) -> Fate {
        Fate::Refused(Refusal {
            kind,
            permanent: false,
            error,
        })
    }

    fn permanent(kind: &'static str, error: String) -> Fate {
        Fate::Refused(Refusal {
            kind,
            permanent: true,
            error,
        })
    }
}

/// What a round did.
#[derive(Debug, Default)]
struct Round {
    /// Rows taken.
    taken: usize,
    /// Rows published, deferred or parked: rows that left the due set.
    settled: usize,
    /// The connection to the broker is gone: reconnect.
    lost: Option<String>,
}

/// The relay's connection to the broker.
struct Link {
    conn: Connection,
    publisher: Publisher,
    /// Where passive declares of exchanges run: a 404 closes it, never the publisher's.
    probe: Option<Channel>,
    /// Exchanges found to exist, and when.
    exchanges: HashMap<String, Instant>,
    max_message_size: Option<usize>,
}

impl Link {
    fn connected(&self) -> bool {
        self.conn.status().connected()
    }

    /// A new publisher on the same connection, within `timeout`. Bounded: a connection the
    /// broker is closing (`stop_app`: its channels die a moment before the connection does)
    /// can still say it is connected, and a channel opened on it then waits forever for its
    /// `channel.open-ok`, with the round's transaction open.
    async fn reopen_publisher(&mut self, timeout: Duration) -> Result<(), String> {
        match tokio::time::timeout(timeout, open_publisher(&self.conn, self.max_message_size)).await
        {
            Ok(Ok(publisher)) => {
                self.publisher = publisher;
                Ok(())
            }
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!("no answer within {timeout:?}")),
        }
    }

    /// Whether `exchange` exists (a passive declare, trusted for [`EXCHANGE_CHECK_TTL`]);
    /// `None` when that cannot be told (the probe failed otherwise than with a 404).
    async fn exchange_exists(&mut self, exchange: &str, timeout: Duration) -> Option<bool> {
        if exchange.is_empty() {
            return Some(true); // the default exchange
        }
        if self
            .exchanges
            .get(exchange)
            .is_some_and(|at| at.elapsed() < EXCHANGE_CHECK_TTL)
        {
            return Some(true);
        }
        let channel = match &self.probe {
            Some(c) if c.status().connected() => c.clone(),
            _ => {
                let c = tokio::time::timeout(timeout, self.conn.create_channel())
                    .await
                    .ok()?
                    .ok()?;
                self.probe = Some(c.clone());
                c
            }
        };
        let found = tokio::time::timeout(
            timeout,
            redeliver_amqp::passive_exchange(&channel, exchange),
        )
        .await;
        match found {
            Ok(Ok(true)) => {
                self.exchanges.insert(exchange.to_owned(), Instant::now());
                Some(true)
            }
            // The 404 closed the probe channel: the next check opens another.
            Ok(Ok(false)) => {
                self.probe = None;
                Some(false)
            }
            _ => {
                self.probe = None;
                None
            }
        }
    }

    /// Closes the connection; bounded, as a broker that is going away may never answer.
    async fn close(self) {
        let _ =
            tokio::time::timeout(CLOSE_TIMEOUT, self.conn.close(200, "relay stopped".into())).await;
    }
}

async fn open_publisher(
    conn: &Connection,
    max_message_size: Option<usize>,
) -> Result<Publisher, PublishError> {
    // The delay configuration is the publisher's for delayed publishes, which the relay makes
    // none of.
    let publisher = Publisher::new(conn, DelayConfig::default()).await?;
    Ok(match max_message_size {
        Some(limit) => publisher.with_max_message_size(limit),
        None => publisher,
    })
}

impl Relay {
    /// A relay of the default [`Schema`]'s outbox, publishing to the broker at `amqp_url`;
    /// 100 rows a round, polling every second, the [`default_relay_policy`].
    pub fn new(pool: PgPool, amqp_url: impl Into<String>) -> Self {
        let (state, _) = watch::channel(RelayState::Starting);
        Self {
            pool,
            schema: Schema::default(),
            urls: vec![amqp_url.into()],
            tls: TlsConfig::new(),
            connection_name: "redeliver-outbox-relay".into(),
            policy: default_relay_policy(),
            batch_size: 100,
            poll_interval: Duration::from_secs(1),
            confirm_timeout: Duration::from_secs(30),
            reconnect_backoff: Backoff::Exponential {
                base: Duration::from_millis(100),
                factor: 2.0,
                cap: Duration::from_secs(30),
            },
            reconnect_jitter: Jitter::Full,
            max_message_size: None,
            state,
            flags: Arc::default(),
        }
    }

    /// The outbox's [`Schema`] (default: [`Schema::default`]); the one its producers store in.
    pub fn schema(mut self, schema: Schema) -> Self {
        self.schema = schema;
        self
    }

    /// URLs tried in order after the first when it cannot be reached, as the worker's
    /// [`failover_urls`](redeliver_worker::WorkerBuilder::failover_urls).
    pub fn failover_urls<I>(mut self, urls: I) -> Self
    where
        I: IntoIterator,
        I::Item: Into<String>,
    {
        self.urls.truncate(1);
        self.urls.extend(urls.into_iter().map(Into::into));
        self
    }

    /// TLS for `amqps://` URLs (CA bundle, client certificate), as the worker's.
    pub fn tls(mut self, tls: TlsConfig) -> Self {
        self.tls = tls;
        self
    }

    /// The connection's name in the management UI (default `redeliver-outbox-relay`).
    pub fn connection_name(mut self, name: impl Into<String>) -> Self {
        self.connection_name = name.into();
        self
    }

    /// When a row the broker refused is tried again, and after how many retries it is parked
    /// (default [`default_relay_policy`]). The policy's backoff, jitter, cap and `max_retries`
    /// are used; refusals are transient errors to it, except those that can never succeed
    /// (parked at once).
    pub fn policy(mut self, policy: RetryPolicy) -> Self {
        self.policy = policy;
        self
    }

    /// Rows taken per round (at least 1; default 100).
    pub fn batch_size(mut self, n: u32) -> Self {
        self.batch_size = n.max(1);
        self
    }

    /// How often the relay looks at the table without a notification (default 1 s): the
    /// latest a row whose next attempt has come is published.
    pub fn poll_interval(mut self, d: Duration) -> Self {
        self.poll_interval = d.max(Duration::from_millis(1));
        self
    }

    /// How long a publish may wait for the broker's confirm before it counts as refused
    /// (default 30 s; not while the broker blocks the connection, which costs no attempt).
    pub fn confirm_timeout(mut self, d: Duration) -> Self {
        self.confirm_timeout = d.max(Duration::from_millis(1));
        self
    }

    /// Pacing of reconnect attempts (default 100 ms doubling to 30 s, full jitter), as the
    /// worker's.
    pub fn reconnect_backoff(mut self, backoff: Backoff, jitter: Jitter) -> Self {
        self.reconnect_backoff = backoff;
        self.reconnect_jitter = jitter;
        self
    }

    /// The largest body the broker takes (default: the broker version's default
    /// `max_message_size`, read when connecting): a larger row is parked without being sent,
    /// which would close the publishing channel.
    pub fn max_message_size(mut self, bytes: usize) -> Self {
        self.max_message_size = Some(bytes);
        self
    }

    /// A handle on the relay's state, for readiness probes.
    pub fn status_handle(&self) -> RelayStatus {
        RelayStatus {
            rx: self.state.subscribe(),
            shared: self.flags.clone(),
        }
    }

    fn outbox_label(&self) -> String {
        format!("{}.{}", self.schema.name(), self.schema.outbox_table())
    }

    /// Prepares the schema ([`Schema::prepare`]), connects, and relays until `token` is
    /// cancelled, reconnecting whenever the broker connection drops and waiting out an
    /// unreachable database. The `LISTEN` holds one connection of the pool for as long as the
    /// relay runs, and a round another: give the pool at least two.
    ///
    /// Returns `Ok(())` once cancelled, and an error only for what waiting cannot fix: a URL
    /// that is not one or TLS files that cannot be read ([`Error::Broker`]), tables that do
    /// not match ([`Error::MissingTable`], [`Error::MissingColumn`], a failed migration), a
    /// closed pool.
    pub async fn run(self, token: CancellationToken) -> Result<(), Error> {
        let result = self.run_inner(&token).await;
        self.state.send_replace(RelayState::Stopped);
        result
    }

    async fn run_inner(&self, token: &CancellationToken) -> Result<(), Error> {
        let urls = self
            .urls
            .iter()
            .map(|u| BrokerUrl::parse(u).map_err(|e| Error::Broker(e.into())))
            .collect::<Result<Vec<_>, _>>()?;
        self.state.send_replace(RelayState::Connecting);
        tracing::debug!("the outbox relay prepares its schema");
        if !self.prepare(token).await? {
            return Ok(());
        }
        let channel = self.schema.notify_channel();
        let mut listener = None;
        let mut delays = self.reconnect_backoff.delays(self.reconnect_jitter);
        let mut url_index = 0usize;
        let mut tried = 0usize;
        let mut ever_connected = false;
        // Rows of a round in which the broker closed the publishing channel: published one at
        // a time the next time they are due, to find the one it refuses.
        let mut suspects = HashSet::new();
        loop {
            let url = &urls[url_index];
            let link = tokio::select! {
                () = token.cancelled() => return Ok(()),
                r = tokio::time::timeout(CONNECT_TIMEOUT, self.connect(url)) => r,
            };
            let link = match link {
                Ok(Ok(link)) => link,
                Ok(Err(e)) if !e.is_fatal() => {
                    tracing::warn!(broker = %url.redacted(), error = %e, "the outbox relay cannot connect");
                    url_index = (url_index + 1) % urls.len();
                    tried += 1;
                    if tried < urls.len() {
                        continue;
                    }
                    tried = 0;
                    if !self.pause(token, delays.next_delay()).await {
                        return Ok(());
                    }
                    continue;
                }
                Ok(Err(e)) => return Err(e),
                Err(_elapsed) => {
                    tracing::warn!(broker = %url.redacted(), timeout = ?CONNECT_TIMEOUT, "the outbox relay's connect attempt timed out");
                    url_index = (url_index + 1) % urls.len();
                    tried += 1;
                    if tried >= urls.len() {
                        tried = 0;
                        if !self.pause(token, delays.next_delay()).await {
                            return Ok(());
                        }
                    }
                    continue;
                }
            };
            tried = 0;
            delays.reset();
            if ever_connected {
                tracing::info!(broker = %url.redacted(), outbox = %self.outbox_label(), "the outbox relay reconnected");
            } else {
                tracing::info!(broker = %url.redacted(), outbox = %self.outbox_label(), "relaying the outbox");
            }
            ever_connected = true;
            self.state.send_replace(RelayState::Relaying);
            let end = self
                .relay_connected(link, token, &channel, &mut listener, &mut suspects)
                .await;
            match end {
                Ok(None) => return Ok(()),
                Ok(Some(reason)) => {
                    tracing::warn!(broker = %url.redacted(), reason = %reason, "the outbox relay lost its broker connection; reconnecting");
                    self.state.send_replace(RelayState::Reconnecting);
                    self.flags.blocked.store(false, Ordering::Release);
                    url_index = (url_index + 1) % urls.len();
                    if !self.pause(token, delays.next_delay()).await {
                        return Ok(());
                    }
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Prepares the schema, waiting out an unreachable database; `false` when cancelled.
    async fn prepare(&self, token: &CancellationToken) -> Result<bool, Error> {
        let mut delays = self.reconnect_backoff.delays(self.reconnect_jitter);
        loop {
            let Some(prepared) = unless_cancelled(token, self.schema.prepare(&self.pool)).await
            else {
                return Ok(false);
            };
            match prepared {
                Ok(()) => return Ok(true),
                // A connection lost mid-migration rolls the migration back: trying again is
                // safe, as for any other statement.
                Err(Error::Database(e) | Error::Migration { source: e, .. })
                    if transient_db(&e) =>
                {
                    self.flags.database_down.store(true, Ordering::Release);
                    tracing::warn!(error = %e, "the outbox relay cannot reach the database; trying again");
                }
                Err(e) => return Err(e),
            }
            if !self.pause(token, delays.next_delay()).await {
                return Ok(false);
            }
        }
    }

    /// Sleeps `d`; `false` when cancelled first.
    async fn pause(&self, token: &CancellationToken, d: Duration) -> bool {
        tokio::select! {
            () = token.cancelled() => false,
            () = tokio::time::sleep(d) => true,
        }
    }

    async fn connect(&self, url: &BrokerUrl) -> Result<Link, Error> {
        let props = ConnectionProperties::default()
            .with_connection_name(self.connection_name.clone().into());
        let max_message_size = match self.max_message_size {
            Some(limit) => Some(limit),
            None => {
                let tls = if url.is_tls() {
                    self.tls.load().map_err(Error::Broker)?
                } else {
                    Default::default()
                };
                ServerInfo::probe_uri(url.uri(), tls)
                    .await
                    .ok()
                    .and_then(|info| info.version())
                    .map(|v| v.default_max_message_size())
            }
        };
        tracing::debug!(broker = %url.redacted(), ?max_message_size, "the outbox relay connects");
        let conn = redeliver_amqp::connect_url(url, props, &self.tls)
            .await
            .map_err(Error::Broker)?;
        tracing::debug!(broker = %url.redacted(), "the outbox relay connected");
        match open_publisher(&conn, max_message_size).await {
            Ok(publisher) => Ok(Link {
                conn,
                publisher,
                probe: None,
                exchanges: HashMap::new(),
                max_message_size,
            }),
            Err(e) => {
                let _ = conn.close(200, "publisher failed".into()).await;
                Err(Error::Publisher(e))
            }
        }
    }

    /// Relays on one connection: `Ok(None)` once cancelled, `Ok(Some(reason))` when the
    /// connection was lost.
    async fn relay_connected(
        &self,
        mut link: Link,
        token: &CancellationToken,
        channel: &str,
        listener: &mut Option<PgListener>,
        suspects: &mut HashSet<i64>,
    ) -> Result<Option<String>, Error> {
        loop {
            if self.pool.is_closed() {
                link.close().await;
                return Err(Error::Database(sqlx::Error::PoolClosed));
            }
            if listener.is_none() {
                let Some(listening) = unless_cancelled(token, self.listen(channel)).await else {
                    link.close().await;
                    return Ok(None);
                };
                *listener = match listening {
                    Ok(l) => Some(l),
                    Err(e) => {
                        tracing::warn!(error = %e, channel = %channel, "cannot LISTEN; the outbox relay polls only until it can");
                        None
                    }
                };
            }
            // Drain: a full round that settled rows suggests more are due.
            loop {
                if token.is_cancelled() {
                    link.close().await;
                    return Ok(None);
                }
                self.flags
                    .blocked
                    .store(link.conn.status().blocked(), Ordering::Release);
                match self.round(&mut link, suspects, token).await {
                    // Cancelled during the round (perhaps before it could reach the database).
                    Ok(_) if token.is_cancelled() => {
                        link.close().await;
                        return Ok(None);
                    }
                    Ok(round) => {
                        self.flags.database_down.store(false, Ordering::Release);
                        if let Some(reason) = round.lost {
                            link.close().await;
                            return Ok(Some(reason));
                        }
                        if round.taken < self.batch_size as usize || round.settled == 0 {
                            break;
                        }
                    }
                    Err(e) => {
                        if let Error::Database(db) = &e {
                            if transient_db(db) {
                                self.flags.database_down.store(true, Ordering::Release);
                            }
                        }
                        tracing::warn!(error = %e, "outbox relay round failed; trying again at the next poll");
                        break;
                    }
                }
            }
            unless_cancelled(token, self.update_gauges()).await;
            let wait = async {
                match listener.as_mut() {
                    Some(l) => match l.recv().await {
                        // One round serves every commit notified so far.
                        Ok(_) => while l.next_buffered().is_some() {},
                        Err(e) => {
                            // sqlx reconnects on the next recv; poll meanwhile. The LISTEN
                            // connection is the first to notice a database gone: not ready
                            // until a round reaches it again (a round would wait out the pool's
                            // acquire timeout before it could tell).
                            if matches!(e, sqlx::Error::Io(_)) || transient_db(&e) {
                                self.flags.database_down.store(true, Ordering::Release);
                            }
                            tracing::warn!(error = %e, "outbox notification listener failed");
                            tokio::time::sleep(self.poll_interval).await;
                        }
                    },
                    None => std::future::pending().await,
                }
            };
            let conn_status = link.conn.status().clone();
            let lost = async {
                // lapin has no close notification to wait on: look now and then, so a relay
                // with nothing to publish still notices (and reports) a lost connection.
                while conn_status.connected() {
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
            };
            tokio::select! {
                () = token.cancelled() => {
                    link.close().await;
                    return Ok(None);
                }
                () = wait => {}
                () = lost => {
                    return Ok(Some("the connection closed".into()));
                }
                () = tokio::time::sleep(self.poll_interval) => {}
            }
        }
    }

    async fn listen(&self, channel: &str) -> Result<PgListener, sqlx::Error> {
        let mut listener = PgListener::connect_with(&self.pool).await?;
        listener.listen(channel).await?;
        Ok(listener)
    }

    async fn update_gauges(&self) {
        match pending(&self.pool, &self.schema).await {
            Ok(p) => {
                let label = self.outbox_label();
                let secs = |d: Option<Duration>| d.map_or(0.0, |d| d.as_secs_f64());
                metrics::gauge!(OUTBOX_PENDING, "outbox" => label.clone()).set(p.count as f64);
                metrics::gauge!(OUTBOX_OLDEST_AGE_SECONDS, "outbox" => label.clone())
                    .set(secs(p.oldest_age));
                metrics::gauge!(OUTBOX_PARKED, "outbox" => label.clone()).set(p.parked as f64);
                metrics::gauge!(OUTBOX_PARKED_OLDEST_AGE_SECONDS, "outbox" => label)
                    .set(secs(p.oldest_parked_age));
            }
            Err(e) => tracing::warn!(error = %e, "cannot count the outbox"),
        }
    }

    /// One round; see the type's docs.
    /// Cancelled while it waits for a database connection, it takes nothing (an empty round).
    async fn round(
        &self,
        link: &mut Link,
        suspects: &mut HashSet<i64>,
        token: &CancellationToken,
    ) -> Result<Round, Error> {
        let Some(tx) = unless_cancelled(token, self.pool.begin()).await else {
            return Ok(Round::default());
        };
        let mut tx = tx?;
        let rows = sqlx::query(&format!(
            "SELECT id, message_id, exchange, routing_key, body, content_type, headers::text,
                    attempts
               FROM {}
              WHERE parked_at IS NULL AND (next_attempt_at IS NULL OR next_attempt_at <= now())
              ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED",
            self.schema.outbox_sql()
        ))
        .bind(i64::from(self.batch_size))
        .fetch_all(&mut *tx)
        .await?;
        let mut round = Round {
            taken: rows.len(),
            ..Round::default()
        };
        if rows.is_empty() {
            tx.rollback().await?;
            return Ok(round);
        }

        // Read and check each row; what can never be published is settled here.
        let mut taken: Vec<Taken> = Vec::with_capacity(rows.len());
        let mut ready: Vec<(usize, OutboxMessage)> = Vec::with_capacity(rows.len());
        for row in &rows {
            let fate = match read_message(row) {
                Err(e) => Refusal::permanent("unreadable", e.to_string()),
                Ok(m) => match m.check() {
                    Err(e) => Refusal::permanent("invalid", e.to_string()),
                    Ok(()) => {
                        ready.push((taken.len(), m));
                        Fate::Untouched
                    }
                },
            };
            taken.push(Taken {
                id: row.try_get("id")?,
                attempts: row.try_get("attempts")?,
                message_id: row.try_get("message_id").unwrap_or_default(),
                fate,
            });
        }

        // Exchanges that do not exist: a publish to one would close the publishing channel.
        let mut missing = HashSet::new();
        let exchanges: HashSet<&str> = ready.iter().map(|(_, m)| m.exchange.as_str()).collect();
        for exchange in exchanges {
            if link.exchange_exists(exchange, self.confirm_timeout).await == Some(false) {
                missing.insert(exchange.to_owned());
            }
        }
        let mut concurrent = Vec::with_capacity(ready.len());
        let mut one_by_one = Vec::new();
        for (i, m) in ready {
            if missing.contains(&m.exchange) {
                taken[i].fate = Refusal::transient(
                    "no_exchange",
                    format!("exchange '{}' does not exist (404 NOT_FOUND)", m.exchange),
                );
            } else if suspects.contains(&taken[i].id) {
                one_by_one.push((i, m));
            } else {
                concurrent.push((i, m));
            }
        }

        // Suspects first, one at a time: the one whose publish closes the channel is refused.
        for (i, m) in one_by_one {
            if !link.connected() {
                break;
            }
            let fate = match self.publish_one(link, &m).await {
                Fate::Lost(why) if link.connected() => {
                    if let Err(e) = link.reopen_publisher(REOPEN_TIMEOUT).await {
                        round.lost = Some(format!("cannot reopen the publisher: {e}"));
                    }
                    Refusal::transient(
                        "channel_closed",
                        format!("the broker closed the publishing channel on this row: {why}"),
                    )
                }
                Fate::Lost(_) => Fate::Untouched,
                other => other,
            };
            if !matches!(fate, Fate::Untouched) {
                suspects.remove(&taken[i].id);
            }
            taken[i].fate = fate;
            if round.lost.is_some() {
                break;
            }
        }

        if round.lost.is_none() && link.connected() && !concurrent.is_empty() {
            let results = join_all(concurrent.iter().map(|(_, m)| self.publish_one(link, m))).await;
            let mut channel_closed = false;
            for ((i, _), fate) in concurrent.iter().zip(results) {
                let row = &mut taken[*i];
                row.fate = match fate {
                    // Which row of the round the broker refused is not known: none pays for it.
                    Fate::Lost(_) => {
                        channel_closed = true;
                        suspects.insert(row.id);
                        Fate::Untouched
                    }
                    Fate::Untouched => Fate::Untouched,
                    other => {
                        suspects.remove(&row.id);
                        other
                    }
                };
            }
            if channel_closed && link.connected() {
                tracing::warn!(
                    suspects = suspects.len(),
                    "the broker closed the outbox relay's publishing channel; the rows of that round go out one at a time when next due"
                );
                if let Err(e) = link.reopen_publisher(REOPEN_TIMEOUT).await {
                    round.lost = Some(format!("cannot reopen the publisher: {e}"));
                }
            }
        }
        if round.lost.is_none() && !link.connected() {
            round.lost = Some("the connection closed".into());
        }
        self.record(tx, &taken, &mut round).await?;
        Ok(round)
    }

    /// Deletes the published rows, records the refused ones, commits, and reports.
    async fn record(
        &self,
        mut tx: sqlx::Transaction<'_, sqlx::Postgres>,
        taken: &[Taken],
        round: &mut Round,
    ) -> Result<(), Error> {
        let table = self.schema.outbox_sql();
        let mut published = Vec::new();
        let (mut ids, mut errors, mut delays, mut reasons) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut log = Vec::new();
        for row in taken {
            let r = match &row.fate {
                Fate::Published => {
                    published.push(row.id);
                    continue;
                }
                // A row whose publish died with its connection: not the row's doing.
                Fate::Untouched | Fate::Lost(_) => continue,
                Fate::Refused(r) => r,
            };
            let retries = u32::try_from(row.attempts).unwrap_or(0);
            let err = if r.permanent {
                HandlerError::permanent(r.error.clone())
            } else {
                HandlerError::transient(r.error.clone())
            };
            let (delay, reason) = match self.policy.decide(retries, None, &err) {
                Decision::Retry { delay, .. } => (Some(delay), None),
                Decision::DeadLetter(DeadLetterReason::Permanent)
                | Decision::DeadLetter(DeadLetterReason::Named(_)) => (
                    None,
                    Some(if r.kind == "unreadable" {
                        ParkReason::Unreadable
                    } else {
                        ParkReason::Permanent
                    }),
                ),
                // Exhausted retries, or an empty retry budget: parked all the same. A refusal
                // is never of the forward kind, but a policy given to the relay may forward
                // everything: nowhere to forward a row to, it is parked too.
                Decision::DeadLetter(_) | Decision::Forward(_) => {
                    (None, Some(ParkReason::RetriesExhausted))
                }
            };
            ids.push(row.id);
            errors.push(truncate(&r.error, MAX_ERROR_BYTES));
            delays.push(delay.map(|d| d.as_secs_f64()));
            reasons.push(reason.map(ParkReason::as_str));
            log.push((row, r, retries.saturating_add(1), delay, reason));
        }
        if !published.is_empty() {
            sqlx::query(&format!("DELETE FROM {table} WHERE id = ANY($1)"))
                .bind(&published)
                .execute(&mut *tx)
                .await?;
        }
        if !ids.is_empty() {
            sqlx::query(&format!(
                "UPDATE {table} AS t
                    SET attempts = t.attempts + 1,
                        last_error = u.error,
                        next_attempt_at = CASE WHEN u.delay IS NULL THEN NULL
                                               ELSE now() + make_interval(secs => u.delay) END,
                        parked_at = CASE WHEN u.reason IS NULL THEN NULL ELSE now() END,
                        parked_reason = u.reason
                   FROM unnest($1::bigint[], $2::text[], $3::float8[], $4::text[])
                        AS u(id, error, delay, reason)
                  WHERE t.id = u.id"
            ))
            .bind(&ids)
            .bind(&errors)
            .bind(&delays)
            .bind(&reasons)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;

        round.settled = published.len() + ids.len();
        let label = self.outbox_label();
        if !published.is_empty() {
            metrics::counter!(OUTBOX_PUBLISHED_TOTAL, "outbox" => label.clone())
                .increment(published.len() as u64);
        }
        for (row, r, attempt, delay, reason) in log {
            metrics::counter!(OUTBOX_REFUSED_TOTAL, "outbox" => label.clone(), "refusal" => r.kind)
                .increment(1);
            match reason {
                Some(reason) => {
                    metrics::counter!(OUTBOX_PARKED_TOTAL, "outbox" => label.clone(), "reason" => reason.as_str())
                        .increment(1);
                    tracing::error!(
                        id = row.id,
                        message_id = %row.message_id,
                        attempt,
                        reason = %reason,
                        error = %r.error,
                        "outbox row parked: `redeliver outbox parked list` shows it, `replay` publishes it again"
                    );
                }
                None => tracing::warn!(
                    id = row.id,
                    message_id = %row.message_id,
                    attempt,
                    retry_in = ?delay.unwrap_or_default(),
                    error = %r.error,
                    "the broker refused an outbox row; it is tried again later"
                ),
            }
        }
        Ok(())
    }

    /// Publishes one row and waits for the broker's confirm.
    async fn publish_one(&self, link: &Link, m: &OutboxMessage) -> Fate {
        let publish =
            link.publisher
                .publish_bytes(&m.exchange, &m.routing_key, &m.body, m.properties());
        match tokio::time::timeout(self.confirm_timeout, publish).await {
            Ok(Ok(())) => Fate::Published,
            Ok(Err(e)) => match e {
                PublishError::Returned { .. } => Refusal::transient("returned", e.to_string()),
                PublishError::Nacked { .. } => Refusal::transient("nacked", e.to_string()),
                PublishError::TooLarge { .. } => Refusal::permanent("too_large", e.to_string()),
                PublishError::InvalidName(_) => Refusal::permanent("invalid", e.to_string()),
                // The channel or the connection is gone: the round tells whose doing it was.
                PublishError::Amqp(e) => Fate::Lost(e.to_string()),
                other => Refusal::transient("refused", other.to_string()),
            },
            // While the broker blocks the connection nothing is confirmed: not the row's doing.
            Err(_) if link.conn.status().blocked() => Fate::Untouched,
            Err(_) => Refusal::transient(
                "timeout",
                format!(
                    "the broker did not confirm the publish within {:?} (it may still have taken it)",
                    self.confirm_timeout
                ),
            ),
        }
    }
}

/// `fut`'s output, or `None` when `token` is cancelled first. For the relay's waits on the
/// database: while it is unreachable, each lasts the pool's acquire timeout (sqlx's default:
/// 30 s), longer than a shutdown may take. Never around a round's publishes, which a
/// cancellation lets finish (cut short, they would be published again).
async fn unless_cancelled<F: std::future::Future>(
    token: &CancellationToken,
    fut: F,
) -> Option<F::Output> {
    tokio::select! {
        () = token.cancelled() => None,
        out = fut => Some(out),
    }
}

/// Errors of an unreachable database (as opposed to one that refuses the statement).
fn transient_db(e: &sqlx::Error) -> bool {
    matches!(
        e,
        sqlx::Error::Io(_)
            | sqlx::Error::PoolTimedOut
            | sqlx::Error::Tls(_)
            | sqlx::Error::Protocol(_)
            | sqlx::Error::WorkerCrashed
    ) || matches!(e, sqlx::Error::Database(db) if db.code().as_deref().is_some_and(|c| c.starts_with("57P") || c.starts_with("08")))
}

/// `s` cut to at most `max` bytes, on a character boundary.
fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}
