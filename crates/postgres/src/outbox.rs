//! The outbox: messages stored by a transaction and published by a [`Relay`] after its commit.

use std::collections::BTreeMap;
use std::time::Duration;

use futures::future::join_all;
use redeliver_amqp::lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use redeliver_amqp::lapin::BasicProperties;
use redeliver_amqp::{PublishError, Publisher};
use sqlx::postgres::PgListener;
use sqlx::{PgConnection, PgPool, Row};
use tokio_util::sync::CancellationToken;

use crate::error::Error;
use crate::schema::Schema;

/// Gauge: rows waiting in the outbox, as the relay last counted them (label `outbox`:
/// `schema.table`).
pub const OUTBOX_PENDING: &str = "redeliver_outbox_pending";
/// Gauge: age in seconds of the oldest row waiting in the outbox (0 when it is empty).
pub const OUTBOX_OLDEST_AGE_SECONDS: &str = "redeliver_outbox_oldest_age_seconds";

/// A message to publish once the transaction that stores it commits.
///
/// `message_id` is a new UUID v4 unless set: it is stored with the row and sent on every
/// publish attempt of it, so a consumer behind an [`Inbox`](crate::Inbox) sees the relay's
/// duplicates (a publish repeated after a crash) as duplicates. Headers are strings only: they
/// are stored as a JSON object and sent as AMQP long strings.
///
/// ```
/// use redeliver_postgres::OutboxMessage;
///
/// let m = OutboxMessage::json("orders", "order.paid", &serde_json::json!({"order": 7}))?
///     .with_header("tenant", "acme");
/// assert_eq!(m.content_type.as_deref(), Some("application/json"));
/// assert_eq!(m.message_id.len(), 36);
/// # Ok::<(), serde_json::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutboxMessage {
    /// Exchange to publish to (`""`: the default exchange, the routing key naming a queue).
    pub exchange: String,
    /// Routing key.
    pub routing_key: String,
    /// The body, sent as is.
    pub body: Vec<u8>,
    /// The `content_type` property; the publisher sends `application/octet-stream` when none.
    pub content_type: Option<String>,
    /// User headers, sent as AMQP long strings.
    pub headers: BTreeMap<String, String>,
    /// The `message_id` property, the same on every publish attempt.
    pub message_id: String,
}

impl OutboxMessage {
    /// A message with `body`, no content type, no headers and a new message id.
    pub fn new(
        exchange: impl Into<String>,
        routing_key: impl Into<String>,
        body: impl Into<Vec<u8>>,
    ) -> Self {
        Self {
            exchange: exchange.into(),
            routing_key: routing_key.into(),
            body: body.into(),
            content_type: None,
            headers: BTreeMap::new(),
            message_id: uuid::Uuid::new_v4().to_string(),
        }
    }

    /// `value` as JSON, content type `application/json`.
    pub fn json<T: serde::Serialize + ?Sized>(
        exchange: impl Into<String>,
        routing_key: impl Into<String>,
        value: &T,
    ) -> Result<Self, serde_json::Error> {
        Ok(Self::new(exchange, routing_key, serde_json::to_vec(value)?)
            .with_content_type("application/json"))
    }

    /// Sets the content type.
    pub fn with_content_type(mut self, content_type: impl Into<String>) -> Self {
        self.content_type = Some(content_type.into());
        self
    }

    /// Adds (or replaces) a header.
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.insert(name.into(), value.into());
        self
    }

    /// Replaces the generated message id, for a producer with an id of its own.
    pub fn with_message_id(mut self, id: impl Into<String>) -> Self {
        self.message_id = id.into();
        self
    }

    /// Checks what AMQP carries as short strings (at most 255 bytes): exchange, routing key,
    /// message id, content type, header names.
    fn check(&self) -> Result<(), Error> {
        const MAX: usize = 255;
        let fields = [
            ("exchange", self.exchange.as_str()),
            ("routing key", self.routing_key.as_str()),
            ("message id", self.message_id.as_str()),
            (
                "content type",
                self.content_type.as_deref().unwrap_or_default(),
            ),
        ];
        let headers = self.headers.keys().map(|k| ("header name", k.as_str()));
        match fields
            .into_iter()
            .chain(headers)
            .find(|(_, v)| v.len() > MAX)
        {
            Some((what, v)) => Err(Error::InvalidMessage(format!(
                "the {what} has {} bytes, AMQP allows at most {MAX}",
                v.len()
            ))),
            None => Ok(()),
        }
    }

    /// The AMQP properties of every publish of this message: message id, content type (when
    /// set), headers, persistent delivery mode.
    fn properties(&self) -> BasicProperties {
        let mut props = BasicProperties::default()
            .with_message_id(ShortString::from(self.message_id.as_str()))
            .with_delivery_mode(2);
        if let Some(ct) = &self.content_type {
            props = props.with_content_type(ShortString::from(ct.as_str()));
        }
        if !self.headers.is_empty() {
            let mut table = FieldTable::default();
            for (k, v) in &self.headers {
                table.insert(
                    ShortString::from(k.as_str()),
                    AMQPValue::LongString(LongString::from(v.as_str())),
                );
            }
            props = props.with_headers(table);
        }
        props
    }
}

/// Stores [`OutboxMessage`]s in the outbox table of a [`Schema`], inside the caller's
/// transaction.
///
/// Any producer with a sqlx transaction can store: a web request handler as well as an
/// [`Inbox`](crate::Inbox) handler (which has [`Tx::publish`](crate::Tx::publish)). The
/// message is published only if and after the transaction commits: a rolled-back transaction
/// stores nothing and wakes no relay. Storing on a connection outside a transaction commits
/// the row at once.
///
/// ```no_run
/// use redeliver_postgres::{Outbox, OutboxMessage};
///
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), redeliver_postgres::Error> {
/// let outbox = Outbox::default();
/// let mut tx = pool.begin().await?;
/// sqlx::query("UPDATE orders SET paid = true WHERE id = $1")
///     .bind(7_i64)
///     .execute(&mut *tx)
///     .await?;
/// outbox
///     .store(&mut tx, &OutboxMessage::new("orders", "order.paid", b"7".to_vec()))
///     .await?;
/// tx.commit().await?; // the relay publishes it now, never before
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct Outbox {
    schema: Schema,
    insert: String,
    notify: String,
}

impl Outbox {
    /// The outbox of `schema`.
    pub fn new(schema: Schema) -> Self {
        let insert = format!(
            "INSERT INTO {} (message_id, exchange, routing_key, body, content_type, headers)
             VALUES ($1, $2, $3, $4, $5, $6::jsonb)",
            schema.outbox_sql()
        );
        Self {
            notify: "SELECT pg_notify($1, '')".into(),
            insert,
            schema,
        }
    }

    /// Its schema.
    pub fn schema(&self) -> &Schema {
        &self.schema
    }

    /// Inserts `message` and notifies the relay's channel, both on `conn` (a transaction
    /// derefs to one: pass `&mut tx` or `&mut *tx`). PostgreSQL delivers the notification only
    /// when the transaction commits. A message AMQP cannot carry (a name or property over 255
    /// bytes) is refused here, [`Error::InvalidMessage`].
    pub async fn store(
        &self,
        conn: &mut PgConnection,
        message: &OutboxMessage,
    ) -> Result<(), Error> {
        message.check()?;
        let headers = if message.headers.is_empty() {
            None
        } else {
            serde_json::to_string(&message.headers).ok()
        };
        sqlx::query(&self.insert)
            .bind(&message.message_id)
            .bind(&message.exchange)
            .bind(&message.routing_key)
            .bind(&message.body)
            .bind(&message.content_type)
            .bind(headers)
            .execute(&mut *conn)
            .await?;
        sqlx::query(&self.notify)
            .bind(self.schema.notify_channel())
            .execute(&mut *conn)
            .await?;
        Ok(())
    }
}

impl Default for Outbox {
    /// The outbox of the default [`Schema`].
    fn default() -> Self {
        Self::new(Schema::default())
    }
}

/// What waits in an outbox ([`pending`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Pending {
    /// Rows not yet published.
    pub count: u64,
    /// Age of the oldest of them; `None` when there is none.
    pub oldest_age: Option<Duration>,
}

/// Counts the rows waiting in the outbox of `schema` and the age of the oldest.
///
/// A missing table (nothing migrated that schema yet) is [`Error::MissingTable`].
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), redeliver_postgres::Error> {
/// let p = redeliver_postgres::pending(&pool, &redeliver_postgres::Schema::default()).await?;
/// println!("{} waiting, oldest {:?}", p.count, p.oldest_age);
/// # Ok(()) }
/// ```
pub async fn pending(pool: &PgPool, schema: &Schema) -> Result<Pending, Error> {
    let row = sqlx::query(&format!(
        "SELECT count(*), extract(epoch FROM now() - min(created_at))::float8 FROM {}",
        schema.outbox_sql()
    ))
    .fetch_one(pool)
    .await
    .map_err(|e| match &e {
        // undefined_table: the table, or its whole schema.
        sqlx::Error::Database(db) if db.code().as_deref() == Some("42P01") => Error::MissingTable {
            table: format!("{}.{}", schema.name(), schema.outbox_table()),
        },
        _ => Error::Database(e),
    })?;
    let count: i64 = row.try_get(0)?;
    let age: Option<f64> = row.try_get(1)?;
    Ok(Pending {
        count: u64::try_from(count).unwrap_or(0),
        oldest_age: age.map(|s| Duration::from_secs_f64(s.max(0.0))),
    })
}

/// Publishes what transactions stored in the outbox, after their commit, and deletes it.
///
/// Each round: `BEGIN`; take up to [`batch_size`](Self::batch_size) rows in id order with
/// `FOR UPDATE SKIP LOCKED` (so several relays share the work, never a row); publish each
/// through the confirmed [`Publisher`] (mandatory: a nacked or unroutable publish is an error)
/// with the row's message id; delete the rows the broker confirmed; `COMMIT`. A publish that
/// fails leaves its row for a later round (logged), so a message is published at least once:
/// twice when the relay dies between the broker's confirm and the commit. Within a round the
/// publishes are concurrent, so the broker may receive them out of id order.
///
/// The relay `LISTEN`s on the schema's [channel](Schema::notify_channel), so it runs a round as
/// soon as a transaction that stored a message commits, and polls every
/// [`poll_interval`](Self::poll_interval) as well (missed notifications, rows left after a
/// crash). It sets [`OUTBOX_PENDING`] and [`OUTBOX_OLDEST_AGE_SECONDS`] after each round.
///
/// ```no_run
/// use redeliver_postgres::{Relay, Schema};
///
/// # async fn demo(pool: sqlx::PgPool, publisher: redeliver_amqp::Publisher) -> Result<(), redeliver_postgres::Error> {
/// let token = tokio_util::sync::CancellationToken::new();
/// Relay::new(pool, Schema::default(), publisher).run(token).await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Relay {
    pool: PgPool,
    schema: Schema,
    publisher: Publisher,
    batch_size: u32,
    poll_interval: Duration,
}

/// A row taken by a round.
struct Taken {
    id: i64,
    message: OutboxMessage,
}

impl Relay {
    /// A relay of `schema`'s outbox publishing through `publisher`; 100 rows a round, polling
    /// every second.
    pub fn new(pool: PgPool, schema: Schema, publisher: Publisher) -> Self {
        Self {
            pool,
            schema,
            publisher,
            batch_size: 100,
            poll_interval: Duration::from_secs(1),
        }
    }

    /// Rows taken per round (at least 1; default 100).
    pub fn batch_size(mut self, n: u32) -> Self {
        self.batch_size = n.max(1);
        self
    }

    /// How often the relay looks at the table without a notification (default 1 s).
    pub fn poll_interval(mut self, d: Duration) -> Self {
        self.poll_interval = d;
        self
    }

    /// Prepares the schema ([`Schema::prepare`]), then relays until `token` is cancelled.
    /// The `LISTEN` holds one connection of the pool for as long as the relay runs.
    ///
    /// Returns an error when the schema cannot be prepared, when the pool was closed, or when
    /// the publisher became unusable ([`Error::Publisher`]); database errors in a round are
    /// logged and the round is tried again at the next poll.
    pub async fn run(self, token: CancellationToken) -> Result<(), Error> {
        self.schema.prepare(&self.pool).await?;
        let channel = self.schema.notify_channel();
        let mut listener = match self.listen(&channel).await {
            Ok(l) => Some(l),
            Err(e) => {
                tracing::warn!(error = %e, channel = %channel, "cannot LISTEN; the relay polls only");
                None
            }
        };
        loop {
            if self.pool.is_closed() {
                return Err(Error::Database(sqlx::Error::PoolClosed));
            }
            // Drain: a full round suggests more rows wait.
            loop {
                match self.relay_once().await {
                    Ok(n) if n == self.batch_size as usize => {
                        if token.is_cancelled() {
                            return Ok(());
                        }
                    }
                    Ok(_) => break,
                    Err(Error::Publisher(e)) => return Err(Error::Publisher(e)),
                    Err(e) => {
                        tracing::warn!(error = %e, "outbox relay round failed; trying again at the next poll");
                        break;
                    }
                }
            }
            self.update_gauges().await;
            let wait = async {
                match listener.as_mut() {
                    Some(l) => match l.recv().await {
                        // One round serves every commit notified so far.
                        Ok(_) => while l.next_buffered().is_some() {},
                        Err(e) => {
                            // sqlx reconnects on the next recv; poll meanwhile.
                            tracing::warn!(error = %e, "outbox notification listener failed");
                            tokio::time::sleep(self.poll_interval).await;
                        }
                    },
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = token.cancelled() => return Ok(()),
                () = wait => {}
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
                let label = format!("{}.{}", self.schema.name(), self.schema.outbox_table());
                metrics::gauge!(OUTBOX_PENDING, "outbox" => label.clone()).set(p.count as f64);
                metrics::gauge!(OUTBOX_OLDEST_AGE_SECONDS, "outbox" => label)
                    .set(p.oldest_age.map_or(0.0, |d| d.as_secs_f64()));
            }
            Err(e) => tracing::warn!(error = %e, "cannot count the outbox"),
        }
    }

    /// One round: publishes up to [`batch_size`](Self::batch_size) rows not locked by another
    /// relay, deletes those the broker confirmed, and returns how many rows it took (published
    /// or not). Does not prepare the schema.
    pub async fn relay_once(&self) -> Result<usize, Error> {
        let mut tx = self.pool.begin().await?;
        let rows = sqlx::query(&format!(
            "SELECT id, message_id, exchange, routing_key, body, content_type, headers::text
             FROM {} ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED",
            self.schema.outbox_sql()
        ))
        .bind(i64::from(self.batch_size))
        .fetch_all(&mut *tx)
        .await?;
        let taken = rows.len();
        if taken == 0 {
            tx.rollback().await?;
            return Ok(0);
        }
        let mut ready = Vec::with_capacity(taken);
        for row in &rows {
            match read_row(row) {
                Ok(r) => ready.push(r),
                Err(e) => tracing::error!(error = %e, "outbox row left unpublished"),
            }
        }
        let results = join_all(ready.iter().map(|r| {
            self.publisher.publish_bytes(
                &r.message.exchange,
                &r.message.routing_key,
                &r.message.body,
                r.message.properties(),
            )
        }))
        .await;
        let mut published = Vec::with_capacity(taken);
        let mut dead = None;
        for (r, result) in ready.iter().zip(results) {
            match result {
                Ok(()) => published.push(r.id),
                Err(e) => {
                    tracing::warn!(
                        id = r.id,
                        message_id = %r.message.message_id,
                        exchange = %r.message.exchange,
                        routing_key = %r.message.routing_key,
                        error = %e,
                        "outbox message not confirmed; it stays for the next round"
                    );
                    if matches!(e, PublishError::Amqp(_))
                        && !self.publisher.channel().status().connected()
                    {
                        dead = Some(e);
                    }
                }
            }
        }
        if !published.is_empty() {
            sqlx::query(&format!(
                "DELETE FROM {} WHERE id = ANY($1)",
                self.schema.outbox_sql()
            ))
            .bind(&published)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        match dead {
            Some(e) => Err(Error::Publisher(e)),
            None => Ok(taken),
        }
    }
}

fn read_row(row: &sqlx::postgres::PgRow) -> Result<Taken, Error> {
    let id: i64 = row.try_get("id")?;
    let headers: Option<String> = row.try_get("headers")?;
    let headers = match headers {
        Some(json) => {
            serde_json::from_str(&json).map_err(|source| Error::Headers { id, source })?
        }
        None => BTreeMap::new(),
    };
    Ok(Taken {
        id,
        message: OutboxMessage {
            exchange: row.try_get("exchange")?,
            routing_key: row.try_get("routing_key")?,
            body: row.try_get("body")?,
            content_type: row.try_get("content_type")?,
            headers,
            message_id: row.try_get("message_id")?,
        },
    })
}
