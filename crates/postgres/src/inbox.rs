//! The inbox: a handler wrapper that runs each message's handler once per
//! (consumer, message id), in the transaction that records it.

use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::time::Duration;

use redeliver_amqp::lapin::types::AMQPValue;
use redeliver_core::HandlerError;
use redeliver_worker::{Context, Handler};
use sqlx::{PgConnection, PgPool, Postgres, Transaction};
use tokio::sync::OnceCell;
use tokio_util::sync::CancellationToken;

use crate::error::Error;
use crate::outbox::{Outbox, OutboxMessage};
use crate::schema::Schema;

/// Counter: deliveries the inbox found already processed (acked without running the handler),
/// label `consumer`.
pub const INBOX_DUPLICATES_TOTAL: &str = "redeliver_inbox_duplicates_total";

/// The dead-letter reason of a delivery without a `message_id` (the default key).
pub const NO_MESSAGE_ID: &str = "no_message_id";
/// The dead-letter reason of a delivery without the key configured with
/// [`Inbox::key_from_header`] or [`Inbox::key_with`].
pub const NO_IDEMPOTENCY_KEY: &str = "no_idempotency_key";

/// A message handler that writes its effects through the inbox's transaction.
///
/// Implement it on a struct (it is the inbox's counterpart of the worker's
/// [`Handler`]) and pass it to [`Inbox::handler`]. `async fn` works in the impl. Everything
/// written through `tx` is committed together with the inbox row, so it happens exactly once
/// per (consumer, message id); return an error and all of it is rolled back.
///
/// ```no_run
/// use redeliver::postgres::{Inbox, OutboxMessage, TransactionalHandler, Tx};
/// use redeliver::{Context, HandlerError, Json, Worker};
/// use redeliver::postgres::sqlx;
///
/// #[derive(serde::Deserialize)]
/// struct Paid { order: i64 }
///
/// struct MarkPaid;
///
/// impl TransactionalHandler<Json<Paid>> for MarkPaid {
///     async fn handle(&self, m: Json<Paid>, _ctx: Context, tx: &mut Tx) -> Result<(), HandlerError> {
///         sqlx::query("UPDATE orders SET paid = true WHERE id = $1")
///             .bind(m.order)
///             .execute(&mut **tx)
///             .await
///             .map_err(HandlerError::transient)?;
///         tx.publish(OutboxMessage::new("emails", "receipt", m.order.to_string()))
///             .await
///             .map_err(HandlerError::transient)?;
///         Ok(())
///     }
/// }
///
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let inbox = Inbox::new(pool, "billing");
/// inbox.prepare().await?; // migrations, at start
/// Worker::builder("amqp://127.0.0.1:5672/%2f")
///     .queue("payments")
///     .handler(inbox.handler(MarkPaid))
///     .build()?
///     .run(redeliver::shutdown_on_signal()?)
///     .await?;
/// # Ok(()) }
/// ```
pub trait TransactionalHandler<M>: Send + Sync + 'static {
    /// Processes one message inside `tx`. `Ok` commits (then the worker acks); an error rolls
    /// back and is returned to the worker unchanged (retried or dead-lettered as its policy
    /// says).
    fn handle(
        &self,
        message: M,
        ctx: Context,
        tx: &mut Tx,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send;
}

/// The transaction of one delivery: the inbox row is already inserted in it.
///
/// Derefs to [`PgConnection`], so every sqlx query runs in it with `.execute(&mut **tx)` (from
/// a `&mut Tx`). [`publish`](Self::publish) stores an outbox message in it. The inbox commits
/// or rolls it back; the handler never does.
pub struct Tx {
    tx: Transaction<'static, Postgres>,
    outbox: Arc<Outbox>,
}

impl Tx {
    /// Stores `message` in the outbox of the inbox's schema, in this transaction: published by
    /// a [`Relay`](crate::Relay) once it commits, never if it rolls back.
    pub async fn publish(&mut self, message: OutboxMessage) -> Result<(), Error> {
        self.outbox.store(&mut self.tx, &message).await
    }
}

impl Deref for Tx {
    type Target = PgConnection;
    fn deref(&self) -> &PgConnection {
        &self.tx
    }
}

impl DerefMut for Tx {
    fn deref_mut(&mut self) -> &mut PgConnection {
        &mut self.tx
    }
}

impl fmt::Debug for Tx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tx").finish_non_exhaustive()
    }
}

/// A function computing a delivery's key ([`Inbox::key_with`]).
type KeyFn = Arc<dyn Fn(&Context) -> Option<String> + Send + Sync>;

/// Where the idempotency key of a delivery comes from.
#[derive(Clone)]
enum Key {
    MessageId,
    Header(String),
    With(KeyFn),
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Key::MessageId => f.write_str("MessageId"),
            Key::Header(h) => f.debug_tuple("Header").field(h).finish(),
            Key::With(_) => f.write_str("With(..)"),
        }
    }
}

/// How many rows a cleanup deleted ([`Inbox::cleanup_once`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Cleaned {
    /// Rows deleted.
    pub rows: u64,
    /// `DELETE` statements run.
    pub batches: u32,
}

/// Deduplication for one consumer: runs a handler at most once per message id, in a
/// transaction that records it.
///
/// Per delivery, [`handler`](Self::handler)'s wrapper:
/// 1. `BEGIN`; `INSERT INTO inbox (consumer, message_id) ... ON CONFLICT DO NOTHING`.
/// 2. No row inserted: the message was processed (committed) before. Roll back, record
///    `duplicate = true` on the delivery's span, count [`INBOX_DUPLICATES_TOTAL`], return `Ok`
///    (the worker acks) without calling the handler.
/// 3. Otherwise call the handler with the transaction ([`Tx`]). `Ok`: `COMMIT`, then `Ok` (a
///    failed commit is a transient error: retried, and found a duplicate if it did commit).
///    An error: `ROLLBACK`, and the error is returned unchanged.
///
/// Two deliveries of one message at once (two workers, a redelivery racing a retry) produce one
/// effect: the second `INSERT` waits for the first transaction (PostgreSQL's unique index), and
/// is a duplicate if it commits, or goes ahead if it rolls back. The waiting delivery holds a
/// connection of the pool meanwhile: size the pool for the worker's concurrency.
///
/// The key is the `message_id` property; a delivery without one is dead-lettered at once
/// ([`HandlerError::permanent_because`] with [`NO_MESSAGE_ID`]). For producers that cannot set
/// it, [`key_from_header`](Self::key_from_header) or [`key_with`](Self::key_with).
///
/// # Retention
///
/// Rows are kept for [`retention`](Self::retention) (default 7 days), then deleted by
/// [`spawn_cleanup`](Self::spawn_cleanup). A message seen again after that is processed again,
/// so the retention must exceed every way a message can come back: the longest total retry
/// delay of the worker's policy, the time a message may wait in the queue, and the window in
/// which messages are replayed from the dead-letter queue (a message replayed from the DLQ
/// after its row was deleted is processed a second time).
///
/// ```no_run
/// use std::time::Duration;
/// use redeliver::postgres::Inbox;
///
/// # async fn demo(pool: redeliver::postgres::sqlx::PgPool) -> Result<(), redeliver::postgres::Error> {
/// let token = redeliver::CancellationToken::new();
/// let inbox = Inbox::new(pool, "thumbnailer")
///     .key_from_header("x-idempotency-key")
///     .retention(Duration::from_secs(14 * 24 * 3600));
/// inbox.prepare().await?;
/// let cleanup = inbox.spawn_cleanup(token.clone());
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct Inbox {
    pool: PgPool,
    consumer: Arc<str>,
    schema: Schema,
    key: Key,
    retention: Duration,
    cleanup_batch: u32,
    cleanup_pause: Duration,
    cleanup_interval: Duration,
    ready: Arc<OnceCell<()>>,
}

impl Inbox {
    /// The inbox of `consumer` (any stable name: usually the queue's) in the default
    /// [`Schema`]. Several consumers share the table; each has its own keys.
    pub fn new(pool: PgPool, consumer: impl Into<String>) -> Self {
        Self {
            pool,
            consumer: consumer.into().into(),
            schema: Schema::default(),
            key: Key::MessageId,
            retention: Duration::from_secs(7 * 24 * 3600),
            cleanup_batch: 1000,
            cleanup_pause: Duration::from_millis(100),
            cleanup_interval: Duration::from_secs(600),
            ready: Arc::new(OnceCell::new()),
        }
    }

    /// Uses `schema`'s tables.
    ///
    /// Read it back with [`Self::configured_schema`].
    pub fn schema(mut self, schema: Schema) -> Self {
        self.schema = schema;
        self.ready = Arc::new(OnceCell::new());
        self
    }

    /// Takes the key from header `name` instead of `message_id` (string or integer values); a
    /// delivery without it is dead-lettered ([`NO_IDEMPOTENCY_KEY`]).
    pub fn key_from_header(mut self, name: impl Into<String>) -> Self {
        self.key = Key::Header(name.into());
        self
    }

    /// Computes the key from the delivery (`None`: dead-lettered with
    /// [`NO_IDEMPOTENCY_KEY`]). The same message must give the same key on every delivery.
    pub fn key_with(
        mut self,
        f: impl Fn(&Context) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.key = Key::With(Arc::new(f));
        self
    }

    /// How long a processed key is remembered (default 7 days); see the type's docs.
    pub fn retention(mut self, d: Duration) -> Self {
        self.retention = d;
        self
    }

    /// Rows deleted per cleanup statement (at least 1; default 1000), and the pause between
    /// two statements (default 100 ms), so a cleanup never holds many locks for long.
    pub fn cleanup_batches(mut self, rows: u32, pause: Duration) -> Self {
        self.cleanup_batch = rows.max(1);
        self.cleanup_pause = pause;
        self
    }

    /// How often [`spawn_cleanup`](Self::spawn_cleanup)'s task runs (default 10 minutes).
    pub fn cleanup_interval(mut self, d: Duration) -> Self {
        self.cleanup_interval = d;
        self
    }

    /// The consumer's name.
    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    /// Its schema.
    pub fn configured_schema(&self) -> &Schema {
        &self.schema
    }

    /// Migrates (or verifies) the schema, once per inbox and its clones: call it at start to
    /// fail fast. Every handler also calls it before its first delivery (a failure is then a
    /// transient error).
    ///
    /// It also looks at the schema's outbox: rows stored over a minute ago and never tried
    /// mean no [`Relay`](crate::Relay) publishes this schema's outbox (a relay publishes only
    /// the outbox of the [`Schema`] it is given), which it logs as a warning.
    pub async fn prepare(&self) -> Result<(), Error> {
        self.ready
            .get_or_try_init(|| async {
                self.schema.prepare(&self.pool).await?;
                crate::outbox::warn_if_unrelayed(&self.pool, &self.schema).await;
                Ok::<(), Error>(())
            })
            .await?;
        Ok(())
    }

    /// Wraps `handler` into a worker [`Handler`], for
    /// [`WorkerBuilder::handler`](redeliver_worker::WorkerBuilder::handler).
    pub fn handler<M, H: TransactionalHandler<M>>(&self, handler: H) -> InboxHandler<H, M> {
        InboxHandler {
            core: self.core(),
            handler,
            _message: PhantomData,
        }
    }

    /// The closure form of [`handler`](Self::handler): `f` takes the message, the context and
    /// the [`Tx`] by value, and returns the `Tx` to commit (`Ok(tx)`) or an error, which rolls
    /// back (the transaction is dropped with the closure's future).
    ///
    /// A second method, where the worker's [`handler`](redeliver_worker::WorkerBuilder::handler)
    /// takes closures and values alike: a transactional handler borrows the transaction
    /// (`&mut Tx`), and stable Rust cannot yet say that the future of a closure borrowing its
    /// argument is `Send`, which the worker needs. Taking the `Tx` by value and giving it back
    /// sidesteps that.
    ///
    /// ```no_run
    /// use redeliver::postgres::{Inbox, Tx};
    /// use redeliver::{Context, HandlerError, Raw, Worker};
    /// use redeliver::postgres::sqlx;
    ///
    /// # async fn demo(pool: sqlx::PgPool) -> Result<(), redeliver::WorkerError> {
    /// let inbox = Inbox::new(pool, "recorder");
    /// let handler = inbox.handler_fn(|m: Raw, ctx: Context, mut tx: Tx| async move {
    ///     sqlx::query("INSERT INTO seen (id, body) VALUES ($1, $2)")
    ///         .bind(ctx.message_id())
    ///         .bind(&m.0)
    ///         .execute(&mut *tx)
    ///         .await
    ///         .map_err(HandlerError::transient)?;
    ///     Ok(tx)
    /// });
    /// Worker::builder("amqp://127.0.0.1:5672/%2f")
    ///     .queue("records")
    ///     .handler(handler)
    ///     .build()?
    ///     .run(redeliver::shutdown_on_signal()?)
    ///     .await
    /// # }
    /// ```
    pub fn handler_fn<M, F, Fut>(&self, f: F) -> InboxFnHandler<F, M>
    where
        F: Fn(M, Context, Tx) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Tx, HandlerError>> + Send,
    {
        InboxFnHandler {
            core: self.core(),
            f,
            _message: PhantomData,
        }
    }

    fn core(&self) -> Core {
        Core {
            insert: format!(
                "INSERT INTO {} (consumer, message_id) VALUES ($1, $2) ON CONFLICT DO NOTHING",
                self.schema.inbox_sql()
            ),
            outbox: Arc::new(Outbox::new(self.schema.clone())),
            inbox: self.clone(),
        }
    }

    /// The key of `ctx`'s delivery, or the error that dead-letters it.
    fn key(&self, ctx: &Context) -> Result<String, HandlerError> {
        match &self.key {
            Key::MessageId => ctx.message_id().map(str::to_owned).ok_or_else(|| {
                HandlerError::permanent_because(
                    NO_MESSAGE_ID,
                    "the message has no message_id: the inbox cannot deduplicate it",
                )
            }),
            Key::Header(name) => header_key(ctx.header(name)).ok_or_else(|| {
                HandlerError::permanent_because(
                    NO_IDEMPOTENCY_KEY,
                    format!("the message has no usable header '{name}': the inbox cannot deduplicate it"),
                )
            }),
            Key::With(f) => f(ctx).ok_or_else(|| {
                HandlerError::permanent_because(
                    NO_IDEMPOTENCY_KEY,
                    "the inbox's key function gave no key: the inbox cannot deduplicate it",
                )
            }),
        }
    }

    /// Deletes this consumer's rows older than the retention,
    /// [`cleanup_batches`](Self::cleanup_batches) rows per statement with a pause between statements, until none
    /// is left.
    pub async fn cleanup_once(&self) -> Result<Cleaned, Error> {
        let table = self.schema.inbox_sql();
        let sql = format!(
            "DELETE FROM {table} WHERE (consumer, message_id) IN (
                 SELECT consumer, message_id FROM {table}
                 WHERE consumer = $1 AND processed_at < now() - make_interval(secs => $2)
                 LIMIT $3)"
        );
        let mut cleaned = Cleaned::default();
        loop {
            let delete = sqlx::query(&sql)
                .bind(&*self.consumer)
                .bind(self.retention.as_secs_f64())
                .bind(i64::from(self.cleanup_batch))
                .execute(&self.pool);
            let rows = delete.await?.rows_affected();
            cleaned.rows += rows;
            cleaned.batches += 1;
            if rows < u64::from(self.cleanup_batch) {
                return Ok(cleaned);
            }
            tokio::time::sleep(self.cleanup_pause).await;
        }
    }

    /// Spawns a task that runs [`cleanup_once`](Self::cleanup_once) now and then every
    /// [`cleanup_interval`](Self::cleanup_interval), until `token` is cancelled. Errors are
    /// logged, and tried again at the next interval. Run one per consumer (several are safe).
    pub fn spawn_cleanup(&self, token: CancellationToken) -> tokio::task::JoinHandle<()> {
        let inbox = self.clone();
        tokio::spawn(async move {
            loop {
                let round = async {
                    inbox.prepare().await?;
                    inbox.cleanup_once().await
                };
                tokio::select! {
                    () = token.cancelled() => return,
                    result = round => match result {
                        Ok(c) if c.rows > 0 => tracing::info!(consumer = %inbox.consumer, rows = c.rows, batches = c.batches, "inbox cleanup"),
                        Ok(_) => {}
                        Err(e) => tracing::warn!(consumer = %inbox.consumer, error = %e, "inbox cleanup failed"),
                    },
                }
                tokio::select! {
                    () = token.cancelled() => return,
                    () = tokio::time::sleep(inbox.cleanup_interval) => {}
                }
            }
        })
    }
}

/// A header's value as a key: strings and integers.
fn header_key(value: Option<&AMQPValue>) -> Option<String> {
    let key = match value? {
        AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        AMQPValue::ShortString(s) => s.as_str().to_owned(),
        AMQPValue::ShortShortInt(i) => i.to_string(),
        AMQPValue::ShortShortUInt(i) => i.to_string(),
        AMQPValue::ShortInt(i) => i.to_string(),
        AMQPValue::ShortUInt(i) => i.to_string(),
        AMQPValue::LongInt(i) => i.to_string(),
        AMQPValue::LongUInt(i) => i.to_string(),
        AMQPValue::LongLongInt(i) => i.to_string(),
        _ => return None,
    };
    (!key.is_empty()).then_some(key)
}

/// What both handler wrappers share: the inbox and its statements.
struct Core {
    inbox: Inbox,
    insert: String,
    outbox: Arc<Outbox>,
}

/// A [`TransactionalHandler`] behind an [`Inbox`]: a worker [`Handler`]. Made by
/// [`Inbox::handler`].
pub struct InboxHandler<H, M> {
    core: Core,
    handler: H,
    _message: PhantomData<fn() -> M>,
}

impl<H, M> fmt::Debug for InboxHandler<H, M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InboxHandler")
            .field("inbox", &self.core.inbox)
            .finish_non_exhaustive()
    }
}

/// A closure behind an [`Inbox`], taking the [`Tx`] by value: a worker [`Handler`]. Made by
/// [`Inbox::handler_fn`].
pub struct InboxFnHandler<F, M> {
    core: Core,
    f: F,
    _message: PhantomData<fn() -> M>,
}

impl<F, M> fmt::Debug for InboxFnHandler<F, M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InboxFnHandler")
            .field("inbox", &self.core.inbox)
            .finish_non_exhaustive()
    }
}

impl Core {
    /// Steps 1 and 2: the delivery's transaction with its inbox row inserted, or `None` for a
    /// duplicate (already rolled back, recorded and counted).
    async fn begin(&self, ctx: &Context) -> Result<Option<Tx>, HandlerError> {
        let key = self.inbox.key(ctx)?;
        if let Err(e) = self.inbox.prepare().await {
            tracing::error!(error = %e, "the inbox's tables are not ready");
            return Err(HandlerError::transient(e));
        }
        let mut tx = self
            .inbox
            .pool
            .begin()
            .await
            .map_err(|e| HandlerError::transient(Error::Database(e)))?;
        let inserted = sqlx::query(&self.insert)
            .bind(&*self.inbox.consumer)
            .bind(&key)
            .execute(&mut *tx)
            .await
            .map_err(|e| HandlerError::transient(Error::Database(e)))?
            .rows_affected();
        if inserted == 0 {
            if let Err(e) = tx.rollback().await {
                tracing::debug!(error = %e, "rollback of a duplicate's transaction failed");
            }
            tracing::Span::current().record("duplicate", true);
            metrics::counter!(INBOX_DUPLICATES_TOTAL, "consumer" => self.inbox.consumer.to_string())
                .increment(1);
            tracing::info!(consumer = %self.inbox.consumer, message_id = %ctx.message_id().unwrap_or(""), key = %key, "duplicate dropped: already processed");
            return Ok(None);
        }
        Ok(Some(Tx {
            tx,
            outbox: Arc::clone(&self.outbox),
        }))
    }
}

/// Step 3 after the handler: commit on `Ok`, roll back on an error and return it unchanged.
async fn finish(tx: Tx, result: Result<(), HandlerError>) -> Result<(), HandlerError> {
    match result {
        Ok(()) => tx
            .tx
            .commit()
            .await
            .map_err(|e| HandlerError::transient(Error::Database(e))),
        Err(error) => {
            if let Err(e) = tx.tx.rollback().await {
                tracing::warn!(error = %e, "rollback after a handler error failed (the connection is dropped, which rolls back)");
            }
            Err(error)
        }
    }
}

impl<H, M> Handler<M> for InboxHandler<H, M>
where
    H: TransactionalHandler<M>,
    M: Send + 'static,
{
    async fn handle(&self, message: M, ctx: Context) -> Result<(), HandlerError> {
        let Some(mut tx) = self.core.begin(&ctx).await? else {
            return Ok(());
        };
        let result = self.handler.handle(message, ctx, &mut tx).await;
        finish(tx, result).await
    }
}

impl<F, Fut, M> Handler<M> for InboxFnHandler<F, M>
where
    F: Fn(M, Context, Tx) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Tx, HandlerError>> + Send,
    M: Send + 'static,
{
    async fn handle(&self, message: M, ctx: Context) -> Result<(), HandlerError> {
        let Some(tx) = self.core.begin(&ctx).await? else {
            return Ok(());
        };
        match (self.f)(message, ctx, tx).await {
            Ok(tx) => finish(tx, Ok(())).await,
            // The closure dropped the transaction: sqlx rolls it back.
            Err(error) => Err(error),
        }
    }
}
