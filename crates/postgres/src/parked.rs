//! Parked outbox rows: messages the [`Relay`](crate::Relay) gave up on, kept for an operator
//! to read, replay (publish again) or purge, as `Q.dlq` is for a consumer.
//!
//! A row is parked when the relay's retry policy is exhausted (the broker refused every
//! attempt: returned, nacked, a missing exchange, no confirm in time), or at once when it can
//! never be published as it is (a name over 255 bytes, headers that are not a JSON object of
//! strings: a row written by something else than [`Outbox::store`](crate::Outbox::store)).
//! Nothing is ever deleted but by [`ParkedRows::purge`] or after its publish was confirmed.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sqlx::{PgPool, Postgres, QueryBuilder, Row};

use crate::error::Error;
use crate::outbox::{parse_headers, OutboxMessage};
use crate::schema::Schema;

/// Why a row was parked: the value of its `parked_reason` column.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ParkReason {
    /// Every attempt the relay's policy allows was refused by the broker.
    RetriesExhausted,
    /// The broker can never take the row as it is (too large, a name AMQP cannot carry).
    Permanent,
    /// The row cannot be read as a message (its headers are not a JSON object of strings,
    /// a column holds what the crate never writes).
    Unreadable,
}

impl ParkReason {
    /// Every reason.
    pub const ALL: [ParkReason; 3] = [
        ParkReason::RetriesExhausted,
        ParkReason::Permanent,
        ParkReason::Unreadable,
    ];

    /// `retries_exhausted`, `permanent` or `unreadable`: the stored value, the metrics label
    /// and what `redeliver outbox parked --reason` takes.
    pub fn as_str(self) -> &'static str {
        match self {
            ParkReason::RetriesExhausted => "retries_exhausted",
            ParkReason::Permanent => "permanent",
            ParkReason::Unreadable => "unreadable",
        }
    }

    /// The reason named `s`, if it is one.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|r| r.as_str() == s)
    }
}

impl std::fmt::Display for ParkReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One parked row.
#[derive(Clone, Debug, PartialEq)]
pub struct ParkedRow {
    /// The row's id in the outbox table.
    pub id: i64,
    /// The row's `message_id` column.
    pub message_id: String,
    /// Its exchange column.
    pub exchange: String,
    /// Its routing key column.
    pub routing_key: String,
    /// Its body.
    pub body: Vec<u8>,
    /// Its content type column.
    pub content_type: Option<String>,
    /// Its headers, or why they cannot be read (what makes an
    /// [`Unreadable`](ParkReason::Unreadable) row unreadable; `headers_json` shows them).
    pub headers: Result<BTreeMap<String, String>, String>,
    /// Its headers column as stored, JSON text.
    pub headers_json: Option<String>,
    /// Publishes the broker refused.
    pub attempts: u32,
    /// Why the last one failed, as the relay saw it.
    pub last_error: Option<String>,
    /// Why it was parked: a [`ParkReason`] name (kept as text: a row parked by a later version
    /// may name a reason this one does not know).
    pub reason: String,
    /// When the transaction that stored it committed (the row's `created_at`).
    pub created_at: SystemTime,
    /// When the relay parked it.
    pub parked_at: SystemTime,
}

impl ParkedRow {
    /// The message the row holds, as the relay would publish it; `Err` with why for an
    /// unreadable row.
    pub fn message(&self) -> Result<OutboxMessage, String> {
        Ok(OutboxMessage {
            exchange: self.exchange.clone(),
            routing_key: self.routing_key.clone(),
            body: self.body.clone(),
            content_type: self.content_type.clone(),
            headers: self.headers.clone()?,
            message_id: self.message_id.clone(),
        })
    }
}

/// Which parked rows a command acts on. Every criterion given must hold (AND); several ids or
/// several message ids are alternatives (OR) among themselves. The default selects every
/// parked row.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ParkedFilter {
    /// Only these row ids; empty: no restriction.
    pub ids: Vec<i64>,
    /// Only these message ids; empty: no restriction.
    pub message_ids: Vec<String>,
    /// Only rows parked for this reason (`retries_exhausted`, `permanent`, `unreadable`).
    pub reason: Option<String>,
    /// Only rows whose last error contains this (case-sensitive).
    pub error_contains: Option<String>,
    /// Only rows for this exchange (`""`: the default exchange).
    pub exchange: Option<String>,
    /// Only rows with this routing key.
    pub routing_key: Option<String>,
    /// Only rows parked at least this long ago.
    pub older_than: Option<Duration>,
}

impl ParkedFilter {
    /// True when no criterion is given: every parked row is selected.
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }

    /// Appends ` AND …` for each criterion.
    fn push_where(&self, q: &mut QueryBuilder<'_, Postgres>) {
        if !self.ids.is_empty() {
            q.push(" AND id = ANY(")
                .push_bind(self.ids.clone())
                .push(")");
        }
        if !self.message_ids.is_empty() {
            q.push(" AND message_id = ANY(")
                .push_bind(self.message_ids.clone())
                .push(")");
        }
        if let Some(r) = &self.reason {
            q.push(" AND parked_reason = ").push_bind(r.clone());
        }
        if let Some(e) = &self.error_contains {
            // strpos, not LIKE: the operator's text is matched as it is, `%` and `_` included.
            q.push(" AND strpos(coalesce(last_error, ''), ")
                .push_bind(e.clone())
                .push(") > 0");
        }
        if let Some(x) = &self.exchange {
            q.push(" AND exchange = ").push_bind(x.clone());
        }
        if let Some(k) = &self.routing_key {
            q.push(" AND routing_key = ").push_bind(k.clone());
        }
        if let Some(d) = self.older_than {
            q.push(" AND parked_at <= now() - make_interval(secs => ")
                .push_bind(d.as_secs_f64())
                .push(")");
        }
    }
}

/// Counts of parked rows ([`ParkedRows::stats`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ParkedStats {
    /// Parked rows selected.
    pub count: u64,
    /// How many for each reason, most frequent first.
    pub by_reason: Vec<(String, u64)>,
    /// How many for each (exchange, routing key), most frequent first.
    pub by_route: Vec<((String, String), u64)>,
    /// How long ago the earliest of them was parked.
    pub oldest_age: Option<Duration>,
}

/// The parked rows of one outbox: read, replay, purge.
///
/// ```no_run
/// use redeliver::postgres::{ParkedFilter, ParkedRows, Schema};
///
/// # async fn demo(pool: redeliver::postgres::sqlx::PgPool) -> Result<(), redeliver::postgres::Error> {
/// let parked = ParkedRows::new(pool, Schema::default());
/// for row in parked.list(&ParkedFilter::default(), 20).await? {
///     println!("{} {} {:?}", row.id, row.reason, row.last_error);
/// }
/// // The binding was missing and is there now: publish them again.
/// let filter = ParkedFilter { routing_key: Some("order.paid".into()), ..Default::default() };
/// let replayed = parked.replay(&filter).await?;
/// println!("{replayed} rows back in the outbox");
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct ParkedRows {
    pool: PgPool,
    schema: Schema,
}

impl ParkedRows {
    /// The parked rows of `schema`'s outbox.
    pub fn new(pool: PgPool, schema: Schema) -> Self {
        Self { pool, schema }
    }

    /// Up to `limit` parked rows matching `filter`, oldest id first, bodies included.
    pub async fn list(&self, filter: &ParkedFilter, limit: u32) -> Result<Vec<ParkedRow>, Error> {
        let mut q = QueryBuilder::new(
            "SELECT id, message_id, exchange, routing_key, body, content_type, headers::text,
                    attempts, last_error, coalesce(parked_reason, 'unknown') AS parked_reason,
                    extract(epoch FROM created_at)::float8 AS created,
                    extract(epoch FROM parked_at)::float8 AS parked
               FROM ",
        );
        q.push(self.schema.outbox_sql())
            .push(" WHERE parked_at IS NOT NULL");
        filter.push_where(&mut q);
        q.push(" ORDER BY id LIMIT ").push_bind(i64::from(limit));
        let rows = q
            .build()
            .fetch_all(&self.pool)
            .await
            .map_err(|e| self.missing_table(e))?;
        rows.iter().map(parked_row).collect()
    }

    /// How many parked rows match `filter`, by reason and by route, and the oldest's age.
    pub async fn stats(&self, filter: &ParkedFilter) -> Result<ParkedStats, Error> {
        let mut q = QueryBuilder::new(
            "SELECT coalesce(parked_reason, 'unknown'), exchange, routing_key, count(*),
                    extract(epoch FROM now() - min(parked_at))::float8
               FROM ",
        );
        q.push(self.schema.outbox_sql())
            .push(" WHERE parked_at IS NOT NULL");
        filter.push_where(&mut q);
        q.push(" GROUP BY 1, 2, 3");
        let rows = q
            .build()
            .fetch_all(&self.pool)
            .await
            .map_err(|e| self.missing_table(e))?;
        let mut stats = ParkedStats::default();
        let mut reasons = std::collections::BTreeMap::<String, u64>::new();
        let mut routes = std::collections::BTreeMap::<(String, String), u64>::new();
        for row in &rows {
            let n = u64::try_from(row.try_get::<i64, _>(3)?).unwrap_or(0);
            let age: Option<f64> = row.try_get(4)?;
            stats.count += n;
            *reasons.entry(row.try_get(0)?).or_default() += n;
            *routes
                .entry((row.try_get(1)?, row.try_get(2)?))
                .or_default() += n;
            let age = age.map(|s| Duration::from_secs_f64(s.max(0.0)));
            stats.oldest_age = stats.oldest_age.max(age);
        }
        stats.by_reason = most_first(reasons);
        stats.by_route = most_first(routes);
        Ok(stats)
    }

    /// Puts the parked rows matching `filter` back in the outbox as new (no attempts, due
    /// now) and wakes the relays; returns how many. Their message ids are kept, so a consumer
    /// behind an [`Inbox`](crate::Inbox) still recognises one it has already handled.
    pub async fn replay(&self, filter: &ParkedFilter) -> Result<u64, Error> {
        let mut tx = self.pool.begin().await?;
        let mut q = QueryBuilder::new("UPDATE ");
        q.push(self.schema.outbox_sql()).push(
            " SET parked_at = NULL, parked_reason = NULL, attempts = 0, next_attempt_at = NULL
              WHERE parked_at IS NOT NULL",
        );
        filter.push_where(&mut q);
        let n = q
            .build()
            .execute(&mut *tx)
            .await
            .map_err(|e| self.missing_table(e))?
            .rows_affected();
        if n > 0 {
            sqlx::query("SELECT pg_notify($1, '')")
                .bind(self.schema.notify_channel())
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(n)
    }

    /// Deletes the parked rows matching `filter`; returns how many. Their messages are gone
    /// for good.
    pub async fn purge(&self, filter: &ParkedFilter) -> Result<u64, Error> {
        let mut q = QueryBuilder::new("DELETE FROM ");
        q.push(self.schema.outbox_sql())
            .push(" WHERE parked_at IS NOT NULL");
        filter.push_where(&mut q);
        Ok(q.build()
            .execute(&self.pool)
            .await
            .map_err(|e| self.missing_table(e))?
            .rows_affected())
    }

    fn missing_table(&self, e: sqlx::Error) -> Error {
        crate::outbox::missing_table(&self.schema, e)
    }
}

fn most_first<K: Ord>(counts: std::collections::BTreeMap<K, u64>) -> Vec<(K, u64)> {
    let mut v: Vec<(K, u64)> = counts.into_iter().collect();
    v.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    v
}

fn parked_row(row: &sqlx::postgres::PgRow) -> Result<ParkedRow, Error> {
    let id: i64 = row.try_get("id")?;
    let attempts: i32 = row.try_get("attempts")?;
    let created: f64 = row.try_get("created")?;
    let parked: f64 = row.try_get("parked")?;
    let headers_json: Option<String> = row.try_get("headers")?;
    Ok(ParkedRow {
        id,
        message_id: row.try_get("message_id")?,
        exchange: row.try_get("exchange")?,
        routing_key: row.try_get("routing_key")?,
        body: row.try_get("body")?,
        content_type: row.try_get("content_type")?,
        headers: parse_headers(id, headers_json.as_deref()).map_err(|e| e.to_string()),
        headers_json,
        attempts: u32::try_from(attempts).unwrap_or(0),
        last_error: row.try_get("last_error")?,
        reason: row.try_get("parked_reason")?,
        created_at: epoch(created),
        parked_at: epoch(parked),
    })
}

/// Seconds since the epoch as a time; out-of-range values (a hand-edited row) are clamped
/// instead of overflowing.
fn epoch(secs: f64) -> SystemTime {
    if secs.is_finite() && secs > 0.0 {
        Duration::try_from_secs_f64(secs)
            .ok()
            .and_then(|d| UNIX_EPOCH.checked_add(d))
            .unwrap_or(UNIX_EPOCH)
    } else {
        UNIX_EPOCH
    }
}
