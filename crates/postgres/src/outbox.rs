//! The outbox: messages stored by a transaction and published by a [`Relay`](crate::Relay) after its commit.

use std::collections::BTreeMap;
use std::time::Duration;

use redeliver_amqp::lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use redeliver_amqp::lapin::BasicProperties;
use sqlx::{PgConnection, PgPool, Row};

use crate::error::Error;
use crate::schema::Schema;

/// A message to publish once the transaction that stores it commits.
///
/// `message_id` is a new UUID v4 unless set: it is stored with the row and sent on every
/// publish attempt of it, so a consumer behind an [`Inbox`](crate::Inbox) sees the relay's
/// duplicates (a publish repeated after a crash) as duplicates. Headers are strings only: they
/// are stored as a JSON object and sent as AMQP long strings.
///
/// ```
/// use redeliver::postgres::OutboxMessage;
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
    pub(crate) fn check(&self) -> Result<(), Error> {
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
    pub(crate) fn properties(&self) -> BasicProperties {
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
/// use redeliver::postgres::{Outbox, OutboxMessage};
/// use redeliver::postgres::sqlx;
///
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), redeliver::postgres::Error> {
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
    /// bytes) is refused here, [`Error::InvalidMessage`]. The table must exist: a producer
    /// that stores before anything prepared the schema gets [`Error::MissingTable`], which
    /// says to call [`Schema::prepare`] at start (in a transaction, PostgreSQL then aborts the
    /// whole transaction).
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
            .await
            .map_err(|e| missing_table(&self.schema, e))?;
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
    /// Rows the relay will publish: not yet published, not parked (the retrying ones included).
    pub count: u64,
    /// Age of the oldest of them; `None` when there is none.
    pub oldest_age: Option<Duration>,
    /// Of `count`, the rows the broker refused at least once, waiting for their next attempt.
    pub retrying: u64,
    /// Rows the relay gave up on, waiting for an operator ([`ParkedRows`](crate::ParkedRows)).
    pub parked: u64,
    /// How long ago the earliest parked row was parked; `None` when none is.
    pub oldest_parked_age: Option<Duration>,
}

/// Counts the rows waiting in the outbox of `schema` (to be published, retrying, parked) and
/// the age of the oldest.
///
/// A missing table (nothing migrated that schema yet) is [`Error::MissingTable`].
///
/// ```no_run
/// # async fn demo(pool: redeliver::postgres::sqlx::PgPool) -> Result<(), redeliver::postgres::Error> {
/// let p = redeliver::postgres::pending(&pool, &redeliver::postgres::Schema::default()).await?;
/// println!("{} waiting, oldest {:?}, {} parked", p.count, p.oldest_age, p.parked);
/// # Ok(()) }
/// ```
pub async fn pending(pool: &PgPool, schema: &Schema) -> Result<Pending, Error> {
    let row = sqlx::query(&format!(
        "SELECT count(*) FILTER (WHERE parked_at IS NULL),
                extract(epoch FROM now() - min(created_at) FILTER (WHERE parked_at IS NULL))::float8,
                count(*) FILTER (WHERE parked_at IS NULL AND attempts > 0),
                count(*) FILTER (WHERE parked_at IS NOT NULL),
                extract(epoch FROM now() - min(parked_at))::float8
           FROM {}",
        schema.outbox_sql()
    ))
    .fetch_one(pool)
    .await
    .map_err(|e| missing_table(schema, e))?;
    let count = |i: usize| -> Result<u64, Error> {
        Ok(u64::try_from(row.try_get::<i64, _>(i)?).unwrap_or(0))
    };
    let age = |i: usize| -> Result<Option<Duration>, Error> {
        let secs: Option<f64> = row.try_get(i)?;
        Ok(secs.map(|s| Duration::try_from_secs_f64(s.max(0.0)).unwrap_or(Duration::MAX)))
    };
    Ok(Pending {
        count: count(0)?,
        oldest_age: age(1)?,
        retrying: count(2)?,
        parked: count(3)?,
        oldest_parked_age: age(4)?,
    })
}

/// `e`, or [`Error::MissingTable`] when it says the outbox table (or its schema) is missing.
pub(crate) fn missing_table(schema: &Schema, e: sqlx::Error) -> Error {
    match &e {
        // undefined_table: the table, or its whole schema.
        sqlx::Error::Database(db) if db.code().as_deref() == Some("42P01") => Error::MissingTable {
            table: format!("{}.{}", schema.name(), schema.outbox_table()),
        },
        _ => Error::Database(e),
    }
}

/// The message of an outbox row (columns `id`, `message_id`, `exchange`, `routing_key`,
/// `body`, `content_type`, `headers` as text).
pub(crate) fn read_message(row: &sqlx::postgres::PgRow) -> Result<OutboxMessage, Error> {
    let id: i64 = row.try_get("id")?;
    let headers: Option<String> = row.try_get("headers")?;
    let headers = parse_headers(id, headers.as_deref())?;
    Ok(OutboxMessage {
        exchange: row.try_get("exchange")?,
        routing_key: row.try_get("routing_key")?,
        body: row.try_get("body")?,
        content_type: row.try_get("content_type")?,
        headers,
        message_id: row.try_get("message_id")?,
    })
}

/// The headers column of row `id`: a JSON object of strings, or none.
pub(crate) fn parse_headers(
    id: i64,
    json: Option<&str>,
) -> Result<BTreeMap<String, String>, Error> {
    match json {
        Some(json) => serde_json::from_str(json).map_err(|source| Error::Headers { id, source }),
        None => Ok(BTreeMap::new()),
    }
}

/// Rows older than this and never tried mean no relay publishes the outbox.
const UNRELAYED_AFTER: Duration = Duration::from_secs(60);

/// Warns when rows of `schema`'s outbox were stored over [`UNRELAYED_AFTER`] ago and never
/// tried: the relay runs on another schema, or not at all. A producer and its relay on two
/// schemas would otherwise store rows that are never published, silently.
pub(crate) async fn warn_if_unrelayed(pool: &PgPool, schema: &Schema) {
    let row = sqlx::query(&format!(
        "SELECT count(*), extract(epoch FROM now() - min(created_at))::float8
           FROM {}
          WHERE parked_at IS NULL AND attempts = 0
            AND created_at < now() - make_interval(secs => $1)",
        schema.outbox_sql()
    ))
    .bind(UNRELAYED_AFTER.as_secs_f64())
    .fetch_one(pool)
    .await;
    let (count, age) = match row {
        Ok(row) => (
            row.try_get::<i64, _>(0).unwrap_or(0),
            row.try_get::<Option<f64>, _>(1)
                .ok()
                .flatten()
                .unwrap_or(0.0),
        ),
        // Only a hint: a failure here must not stop a start that prepared its schema.
        Err(e) => {
            tracing::debug!(error = %e, "cannot look for unrelayed outbox rows");
            return;
        }
    };
    if count > 0 {
        tracing::warn!(
            outbox = %format!("{}.{}", schema.name(), schema.outbox_table()),
            rows = count,
            oldest_seconds = age.round(),
            "outbox rows have waited over a minute without a publish attempt: is a Relay running \
             with this Schema? (a Relay publishes only the outbox of the Schema it is given)"
        );
    }
}
