//! The inbox on a real PostgreSQL: one effect per message id, rollbacks, keys, retention, and a
//! real worker on RabbitMQ.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "common/context.rs"]
mod context;
#[path = "common/effects.rs"]
mod effects;
#[path = "common/test_db.rs"]
mod test_db;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use context::context;
use redeliver_core::{ErrorKind, HandlerError};
use redeliver_postgres::{
    Inbox, OutboxMessage, TransactionalHandler, Tx, INBOX_DUPLICATES_TOTAL, NO_IDEMPOTENCY_KEY,
    NO_MESSAGE_ID,
};
use redeliver_testkit::recorder::recorder;
use redeliver_worker::{Context, Handler, Raw};
use test_db::TestDb;

/// Writes one `effects` row per call (keyed by the message id or the idempotency header), and
/// optionally an outbox message; sleeps on its first call, fails on demand.
#[derive(Clone)]
struct Effect {
    table: String,
    calls: Arc<AtomicUsize>,
    first_call_sleeps: Option<Duration>,
    fail: bool,
    publish: bool,
}

impl Effect {
    fn new(db: &TestDb) -> Self {
        Self {
            table: db.effects(),
            calls: Arc::default(),
            first_call_sleeps: None,
            fail: false,
            publish: false,
        }
    }

    fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }
}

impl TransactionalHandler<Raw> for Effect {
    async fn handle(&self, m: Raw, ctx: Context, tx: &mut Tx) -> Result<(), HandlerError> {
        let call = self.calls.fetch_add(1, Ordering::SeqCst);
        let key = ctx
            .message_id()
            .map(str::to_owned)
            .unwrap_or_else(|| format!("{:?}", ctx.header("x-idempotency-key")));
        sqlx::query(&format!(
            "INSERT INTO {} (key, note) VALUES ($1, $2)",
            self.table
        ))
        .bind(&key)
        .bind(String::from_utf8_lossy(&m))
        .execute(&mut **tx)
        .await
        .map_err(HandlerError::transient)?;
        if self.publish {
            tx.publish(OutboxMessage::new("", "nowhere", key))
                .await
                .map_err(HandlerError::transient)?;
        }
        if call == 0 {
            if let Some(d) = self.first_call_sleeps {
                tokio::time::sleep(d).await;
            }
        }
        if self.fail {
            return Err(HandlerError::transient("boom"));
        }
        Ok(())
    }
}

fn consumer() -> String {
    format!("c-{}", redeliver_testkit::unique_id(8))
}

// One thread: the subscriber set for this test sees everything the inbox logs while it runs.
#[tokio::test(flavor = "current_thread")]
async fn a_dropped_duplicate_is_logged_once_at_info_with_its_message_id() {
    let (captured, _guard) = redeliver_testkit::logs::capture(tracing::Level::INFO);
    let db = TestDb::with_effects().await;
    let c = consumer();
    let h = Inbox::new(db.pool.clone(), &c)
        .schema(db.schema.clone())
        .handler(Effect::new(&db));
    for _ in 0..2 {
        h.handle(Raw(b"x".to_vec()), context(Some("m-dup-1"), &[]))
            .await
            .expect("handled");
    }
    let log = captured.text();
    let lines: Vec<&str> = log.lines().filter(|l| l.contains("duplicate")).collect();
    assert_eq!(lines.len(), 1, "one line for the one duplicate:\n{log}");
    let line = lines[0];
    assert!(line.contains(" INFO "), "{line}");
    assert!(line.contains("message_id=m-dup-1"), "{line}");
    assert!(line.contains(&format!("consumer={c}")), "{line}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_message_twice_runs_the_handler_once() {
    let recorded = recorder(); // installed before anything is counted
    let db = TestDb::with_effects().await;
    let c = consumer();
    let effect = Effect::new(&db);
    let h = Inbox::new(db.pool.clone(), &c)
        .schema(db.schema.clone())
        .handler(effect.clone());
    for _ in 0..2 {
        h.handle(Raw(b"x".to_vec()), context(Some("m-1"), &[]))
            .await
            .expect("handled");
    }
    assert_eq!(effect.calls(), 1, "the handler ran for the duplicate");
    assert_eq!(db.count("effects").await, 1);
    assert_eq!(db.count("inbox").await, 1);
    assert_eq!(
        recorded.counter(INBOX_DUPLICATES_TOTAL, &format!("consumer={c}")),
        1
    );
    // Another consumer has keys of its own.
    let other = Inbox::new(db.pool.clone(), consumer())
        .schema(db.schema.clone())
        .handler(effect.clone());
    other
        .handle(Raw(b"x".to_vec()), context(Some("m-1"), &[]))
        .await
        .unwrap();
    assert_eq!(effect.calls(), 2);
    assert_eq!(db.count("effects").await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_concurrent_deliveries_produce_one_effect() {
    let db = TestDb::with_effects().await;
    let mut effect = Effect::new(&db);
    // The first call holds its transaction (and its uncommitted inbox row) for a while.
    effect.first_call_sleeps = Some(Duration::from_millis(800));
    let h = Arc::new(
        Inbox::new(db.pool.clone(), consumer())
            .schema(db.schema.clone())
            .handler(effect.clone()),
    );
    let first = tokio::spawn({
        let h = Arc::clone(&h);
        async move {
            h.handle(Raw(b"1".to_vec()), context(Some("same"), &[]))
                .await
        }
    });
    // The second starts while the first sleeps inside its transaction.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        effect.calls(),
        1,
        "the first delivery should be in its handler"
    );
    let started = Instant::now();
    let second = tokio::spawn({
        let h = Arc::clone(&h);
        async move {
            h.handle(Raw(b"2".to_vec()), context(Some("same"), &[]))
                .await
        }
    });
    second.await.unwrap().expect("the second delivery is acked");
    let waited = started.elapsed();
    first.await.unwrap().expect("the first delivery succeeds");
    assert!(
        waited >= Duration::from_millis(400),
        "the second INSERT did not wait for the first transaction ({waited:?})"
    );
    assert_eq!(effect.calls(), 1);
    assert_eq!(db.count("effects").await, 1);
    let note: String = sqlx::query_scalar(&format!("SELECT note FROM {}", db.effects()))
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(note, "1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_error_rolls_everything_back_and_is_returned() {
    let db = TestDb::with_effects().await;
    let c = consumer();
    let mut effect = Effect::new(&db);
    effect.fail = true;
    effect.publish = true;
    let inbox = Inbox::new(db.pool.clone(), &c).schema(db.schema.clone());
    let e = inbox
        .handler(effect.clone())
        .handle(Raw(b"x".to_vec()), context(Some("m-err"), &[]))
        .await
        .expect_err("the handler's error");
    assert_eq!(e.kind(), ErrorKind::Transient);
    assert_eq!(e.message(), "boom");
    assert_eq!(
        db.count("effects").await,
        0,
        "the effect was not rolled back"
    );
    assert_eq!(
        db.count("inbox").await,
        0,
        "the inbox row was not rolled back"
    );
    assert_eq!(
        db.count("outbox").await,
        0,
        "the outbox row was not rolled back"
    );
    // The retry then runs the handler, and commits.
    effect.fail = false;
    inbox
        .handler(effect.clone())
        .handle(Raw(b"x".to_vec()), context(Some("m-err"), &[]))
        .await
        .expect("the retry");
    assert_eq!(effect.calls(), 2);
    assert_eq!(db.count("effects").await, 1);
    assert_eq!(db.count("inbox").await, 1);
    assert_eq!(db.count("outbox").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_closure_form_commits_the_returned_tx_and_rolls_back_on_error() {
    let db = TestDb::with_effects().await;
    let table = db.effects();
    let calls = Arc::new(AtomicUsize::new(0));
    let h = Inbox::new(db.pool.clone(), consumer())
        .schema(db.schema.clone())
        .handler_fn({
            let calls = Arc::clone(&calls);
            move |m: Raw, ctx: Context, mut tx: Tx| {
                let (table, calls) = (table.clone(), Arc::clone(&calls));
                async move {
                    calls.fetch_add(1, Ordering::SeqCst);
                    sqlx::query(&format!("INSERT INTO {table} (key) VALUES ($1)"))
                        .bind(ctx.message_id())
                        .execute(&mut *tx)
                        .await
                        .map_err(HandlerError::transient)?;
                    if &*m == b"fail" {
                        return Err(HandlerError::permanent("refused"));
                    }
                    Ok(tx)
                }
            }
        });
    let e = h
        .handle(Raw(b"fail".to_vec()), context(Some("f-1"), &[]))
        .await
        .expect_err("the closure's error");
    assert_eq!(e.kind(), ErrorKind::Permanent);
    assert_eq!(e.message(), "refused");
    assert_eq!(db.count("effects").await, 0);
    assert_eq!(db.count("inbox").await, 0);
    for _ in 0..2 {
        h.handle(Raw(b"ok".to_vec()), context(Some("f-2"), &[]))
            .await
            .expect("handled");
    }
    assert_eq!(
        calls.load(Ordering::SeqCst),
        2,
        "one failed call, one for f-2"
    );
    assert_eq!(db.count("effects").await, 1);
    assert_eq!(db.count("inbox").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_without_id_is_dead_lettered() {
    let db = TestDb::with_effects().await;
    let effect = Effect::new(&db);
    let e = Inbox::new(db.pool.clone(), consumer())
        .schema(db.schema.clone())
        .handler(effect.clone())
        .handle(Raw(b"x".to_vec()), context(None, &[]))
        .await
        .expect_err("no message id");
    assert_eq!(e.kind(), ErrorKind::Permanent);
    assert_eq!(e.dead_letter_reason(), Some(NO_MESSAGE_ID));
    assert_eq!(effect.calls(), 0);
    assert_eq!(db.count("inbox").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_key_may_come_from_a_header_or_a_function() {
    let db = TestDb::with_effects().await;
    let effect = Effect::new(&db);
    let h = Inbox::new(db.pool.clone(), consumer())
        .schema(db.schema.clone())
        .key_from_header("x-idempotency-key")
        .handler(effect.clone());
    for _ in 0..2 {
        h.handle(
            Raw(b"x".to_vec()),
            context(None, &[("x-idempotency-key", "k-1")]),
        )
        .await
        .expect("keyed by the header");
    }
    assert_eq!(effect.calls(), 1);
    let stored: String = sqlx::query_scalar(&format!("SELECT message_id FROM {}.inbox", db.name))
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(stored, "k-1");
    // A message id does not replace a missing header.
    let e = h
        .handle(Raw(b"x".to_vec()), context(Some("m-1"), &[]))
        .await
        .expect_err("no header");
    assert_eq!(e.dead_letter_reason(), Some(NO_IDEMPOTENCY_KEY));

    let h = Inbox::new(db.pool.clone(), consumer())
        .schema(db.schema.clone())
        .key_with(|ctx| ctx.correlation_id().map(str::to_owned))
        .handler(effect.clone());
    let e = h
        .handle(Raw(b"x".to_vec()), context(Some("m-1"), &[]))
        .await
        .expect_err("no correlation id");
    assert_eq!(e.dead_letter_reason(), Some(NO_IDEMPOTENCY_KEY));
    assert_eq!(effect.calls(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cleanup_deletes_old_rows_in_batches_and_keeps_new_ones() {
    let db = TestDb::with_effects().await;
    let c = consumer();
    let insert = |consumer: String, n: i32, age: &'static str| {
        let (pool, table) = (db.pool.clone(), format!("{}.inbox", db.name));
        async move {
            sqlx::query(&format!(
                "INSERT INTO {table} (consumer, message_id, processed_at)
                 SELECT $1, $3 || i, now() - $2::interval FROM generate_series(1, $4) i"
            ))
            .bind(consumer)
            .bind(age)
            .bind(age)
            .bind(n)
            .execute(&pool)
            .await
            .unwrap();
        }
    };
    insert(c.clone(), 25, "8 days").await;
    insert(c.clone(), 5, "6 days").await;
    insert("someone-else".into(), 3, "30 days").await;
    let inbox = Inbox::new(db.pool.clone(), &c)
        .schema(db.schema.clone())
        .cleanup_batches(10, Duration::from_millis(10));
    let cleaned = inbox.cleanup_once().await.expect("cleanup");
    assert_eq!(cleaned.rows, 25);
    assert_eq!(cleaned.batches, 3, "10 + 10 + 5 rows");
    assert_eq!(
        db.count("inbox").await,
        8,
        "new rows and other consumers' rows stay"
    );

    // The background task, with a short retention.
    insert(c.clone(), 4, "2 hours").await;
    let token = tokio_util::sync::CancellationToken::new();
    let task = Inbox::new(db.pool.clone(), &c)
        .schema(db.schema.clone())
        .retention(Duration::from_secs(3600))
        .spawn_cleanup(token.clone());
    let deadline = Instant::now() + Duration::from_secs(10);
    while db.count("inbox").await != 3 {
        assert!(Instant::now() < deadline, "the cleanup task did not run");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    token.cancel();
    tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .expect("the task stops when cancelled")
        .unwrap();
}

mod worker {
    use super::*;
    use redeliver_amqp::lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
    use redeliver_amqp::lapin::BasicProperties;
    use redeliver_amqp::{DelayConfig, QueueType, Topology};
    use redeliver_worker::Worker;
    use tokio_util::sync::CancellationToken;

    /// A real worker, each of N messages published twice: exactly N effects.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_worker_with_an_inbox_applies_each_message_once() {
        const N: usize = 30;
        let recorded = recorder();
        let db = TestDb::with_effects().await;
        let prefix = redeliver_testkit::unique_prefix("rdpg-", 8, "-");
        let _cleanup = redeliver_testkit::Cleanup(prefix.clone());
        let topology = Topology::new("q")
            .prefix(prefix.clone())
            .queue_type(QueueType::Classic)
            .delay(
                DelayConfig::new()
                    .prefix(prefix.clone())
                    .levels(2)
                    .queue_type(QueueType::Classic),
            );
        let queue = topology.queue_name();
        let c = consumer();
        let effect = Effect::new(&db);
        let inbox = Inbox::new(db.pool.clone(), &c).schema(db.schema.clone());
        inbox.prepare().await.expect("prepare");
        let token = CancellationToken::new();
        let run = tokio::spawn(
            Worker::builder(redeliver_testkit::amqp_url())
                .topology(topology)
                .concurrency(8)
                .handler(inbox.handler(effect.clone()))
                .build()
                .expect("build")
                .run(token.clone()),
        );
        let conn = redeliver_testkit::connect().await;
        let deadline = Instant::now() + Duration::from_secs(30);
        while !redeliver_testkit::queue_exists(&conn, &queue).await {
            assert!(
                Instant::now() < deadline,
                "the worker did not declare {queue}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let ch = conn.create_channel().await.unwrap();
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        for round in 0..2 {
            for i in 0..N {
                ch.basic_publish(
                    "".into(),
                    queue.as_str().into(),
                    BasicPublishOptions::default(),
                    format!("{round}").as_bytes(),
                    BasicProperties::default().with_message_id(format!("m-{i}").into()),
                )
                .await
                .unwrap()
                .await
                .unwrap();
            }
        }
        let labels = format!("consumer={c}");
        while recorded.counter(INBOX_DUPLICATES_TOTAL, &labels) < N as u64
            || db.count("inbox").await < N as i64
        {
            assert!(
                Instant::now() < deadline + Duration::from_secs(30),
                "{} effects, {} duplicates so far",
                db.count("effects").await,
                recorded.counter(INBOX_DUPLICATES_TOTAL, &labels)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        token.cancel();
        run.await.unwrap().expect("worker");
        assert_eq!(db.count("effects").await, N as i64);
        let distinct: i64 =
            sqlx::query_scalar(&format!("SELECT count(DISTINCT key) FROM {}", db.effects()))
                .fetch_one(&db.pool)
                .await
                .unwrap();
        assert_eq!(distinct, N as i64);
        assert_eq!(effect.calls(), N);
        assert_eq!(recorded.counter(INBOX_DUPLICATES_TOTAL, &labels), N as u64);
        assert_eq!(redeliver_testkit::ready_count(&conn, &queue).await, 0);
    }
}
