//! Shared helpers of the PostgreSQL tests: the database, a unique schema per test (dropped at
//! the end, also when the test fails), a counting metrics recorder, contexts for direct calls.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code); helpers are `pub` for the test files that include this module.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    unreachable_pub
)]
#![allow(dead_code)] // each test binary uses some of these

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use redeliver_postgres::{Outbox, OutboxMessage, Schema};
use redeliver_worker::lapin::message::Delivery;
use redeliver_worker::lapin::types::{AMQPValue, FieldTable, LongString};
use redeliver_worker::lapin::BasicProperties;
use redeliver_worker::Context;
use sqlx::PgPool;

use redeliver_testkit::postgres::pool;

/// A schema of its own (`rdpg_<hex>`), dropped with everything in it when this is dropped.
pub struct TestDb {
    pub pool: PgPool,
    pub name: String,
    pub schema: Schema,
}

impl TestDb {
    pub async fn new() -> Self {
        Self::with_pool_size(10).await
    }

    pub async fn with_pool_size(max: u32) -> Self {
        let pool = pool(max).await;
        let name = format!("rdpg_{}", redeliver_testkit::unique_id(12));
        let schema = Schema::named(&name).expect("valid schema name");
        Self { pool, name, schema }
    }

    /// Migrates the schema and creates `effects (key text, note text)`, no unique constraint,
    /// so a duplicate effect shows as a second row.
    pub async fn with_effects() -> Self {
        let db = Self::new().await;
        db.schema.migrate(&db.pool).await.expect("migrate");
        sqlx::query(&format!(
            "CREATE TABLE {}.effects (key text NOT NULL, note text)",
            db.name
        ))
        .execute(&db.pool)
        .await
        .expect("create effects");
        db
    }

    /// Stores `messages` in the outbox in one transaction, and commits it.
    pub async fn store_committed(&self, messages: &[OutboxMessage]) {
        let outbox = Outbox::new(self.schema.clone());
        let mut tx = self.pool.begin().await.expect("begin");
        for m in messages {
            outbox.store(&mut tx, m).await.expect("store");
        }
        tx.commit().await.expect("commit");
    }

    pub async fn count(&self, table: &str) -> i64 {
        sqlx::query_scalar(&format!("SELECT count(*) FROM {}.{table}", self.name))
            .fetch_one(&self.pool)
            .await
            .unwrap_or_else(|e| panic!("count {table}: {e}"))
    }

    pub fn effects(&self) -> String {
        format!("{}.effects", self.name)
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        redeliver_testkit::postgres::drop_schema(&self.name);
    }
}

/// A context for a direct call of a handler, as the worker would give it.
pub fn context(message_id: Option<&str>, headers: &[(&str, &str)]) -> Context {
    let mut props = BasicProperties::default();
    if let Some(id) = message_id {
        props = props.with_message_id(id.into());
    }
    if !headers.is_empty() {
        let mut table = FieldTable::default();
        for (k, v) in headers {
            table.insert((*k).into(), AMQPValue::LongString(LongString::from(*v)));
        }
        props = props.with_headers(table);
    }
    let mut delivery = Delivery::mock(1, "".into(), "q".into(), false, b"body".to_vec());
    delivery.properties = props;
    Context::detached("q", delivery)
}

/// Counters and gauges recorded by the process-wide test recorder, by name and labels (a
/// gauge's cell holds the bits of its `f64`).
#[derive(Default)]
pub struct Counters(Mutex<HashMap<String, Arc<AtomicU64>>>);

struct Gauge(Arc<AtomicU64>);

impl Gauge {
    fn update(&self, f: impl Fn(f64) -> f64) {
        let _ = self
            .0
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                Some(f(f64::from_bits(bits)).to_bits())
            });
    }
}

impl metrics::GaugeFn for Gauge {
    fn increment(&self, value: f64) {
        self.update(|v| v + value);
    }
    fn decrement(&self, value: f64) {
        self.update(|v| v - value);
    }
    fn set(&self, value: f64) {
        self.0.store(value.to_bits(), Ordering::Relaxed);
    }
}

struct Counter(Arc<AtomicU64>);

impl metrics::CounterFn for Counter {
    fn increment(&self, value: u64) {
        self.0.fetch_add(value, Ordering::Relaxed);
    }
    fn absolute(&self, value: u64) {
        self.0.store(value, Ordering::Relaxed);
    }
}

struct Recorder(&'static Counters);

fn key_name(key: &metrics::Key) -> String {
    let mut s = key.name().to_owned();
    for l in key.labels() {
        s.push_str(&format!(",{}={}", l.key(), l.value()));
    }
    s
}

impl metrics::Recorder for Recorder {
    fn describe_counter(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_gauge(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_histogram(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn register_counter(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        let cell = Arc::clone(
            self.0
                 .0
                .lock()
                .expect("lock")
                .entry(key_name(key))
                .or_default(),
        );
        metrics::Counter::from_arc(Arc::new(Counter(cell)))
    }
    fn register_gauge(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        let cell = Arc::clone(
            self.0
                 .0
                .lock()
                .expect("lock")
                .entry(format!("gauge:{}", key_name(key)))
                .or_default(),
        );
        metrics::Gauge::from_arc(Arc::new(Gauge(cell)))
    }
    fn register_histogram(
        &self,
        _: &metrics::Key,
        _: &metrics::Metadata<'_>,
    ) -> metrics::Histogram {
        metrics::Histogram::noop()
    }
}

/// The process-wide counting recorder (installed on first use).
pub fn counters() -> &'static Counters {
    static COUNTERS: OnceLock<&'static Counters> = OnceLock::new();
    COUNTERS.get_or_init(|| {
        let c: &'static Counters = Box::leak(Box::default());
        metrics::set_global_recorder(Recorder(c)).expect("one recorder per test binary");
        c
    })
}

impl Counters {
    /// Counter `name` with labels `labels` ("k=v,k=v"), 0 when never incremented.
    pub fn get(&self, name: &str, labels: &str) -> u64 {
        let key = format!("{name},{labels}");
        self.0
            .lock()
            .expect("lock")
            .get(&key)
            .map_or(0, |c| c.load(Ordering::Relaxed))
    }

    /// Gauge `name` with labels `labels` ("k=v,k=v"), `None` when never registered.
    pub fn gauge(&self, name: &str, labels: &str) -> Option<f64> {
        let key = format!("gauge:{name},{labels}");
        self.0
            .lock()
            .expect("lock")
            .get(&key)
            .map(|c| f64::from_bits(c.load(Ordering::Relaxed)))
    }
}
