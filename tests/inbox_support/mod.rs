//! Shared by the inbox and outbox fault tests (`tests/inbox_*.rs`, `tests/outbox_*.rs`):
//! a PostgreSQL schema of their own holding the inbox, the outbox and the business table
//! `effects`, dropped at the end (also when the test fails), the exactly-once check, and the
//! outbox's per-message-id check ([`assert_published`]).

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code); helpers are `pub` for the test files that include this module.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    unreachable_pub
)]
#![allow(dead_code)] // each test binary uses some of these

use std::collections::{BTreeMap, HashSet};
use std::path::PathBuf;
use std::time::Duration;

use futures::StreamExt as _;
use redeliver::lapin::options::{BasicConsumeOptions, QueueDeclareOptions};
use redeliver::lapin::types::FieldTable;
use redeliver::lapin::Connection;
use redeliver::postgres::{Outbox, OutboxMessage, Schema};
use redeliver_testkit::reliability::{Accounting, Scenario, WorkerCmd};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;

pub use redeliver_testkit::postgres::{pool, START_POSTGRES};

/// A schema of its own (`rdfx_<hex>`) with the inbox and outbox tables and
/// `effects (message_id text, worker text, at timestamptz)`, **no unique constraint**: only
/// the inbox can keep a second row out. Dropped with everything in it when this is dropped.
pub struct EffectsDb {
    pub pool: PgPool,
    pub name: String,
    pub schema: Schema,
}

impl EffectsDb {
    pub async fn new() -> Self {
        let pool = pool(4).await;
        let name = format!("rdfx_{}", redeliver_testkit::unique_id(12));
        let schema = Schema::named(&name).expect("a valid schema name");
        // Dropped from here on, whatever fails next.
        let db = Self { pool, name, schema };
        db.schema
            .migrate(&db.pool)
            .await
            .unwrap_or_else(|e| panic!("migrate schema {}: {e}", db.name));
        sqlx::query(&format!(
            "CREATE TABLE \"{}\".effects (message_id text NOT NULL, worker text NOT NULL, \
             at timestamptz NOT NULL DEFAULT clock_timestamp())",
            db.name
        ))
        .execute(&db.pool)
        .await
        .unwrap_or_else(|e| panic!("create {}.effects: {e}", db.name));
        db
    }

    /// Rows of `effects` per message id.
    pub async fn effects(&self) -> BTreeMap<String, i64> {
        self.group_count("effects", "message_id").await
    }

    /// Rows of the inbox per message id.
    pub async fn inbox_rows(&self) -> BTreeMap<String, i64> {
        self.group_count("inbox", "message_id").await
    }

    /// Rows waiting in the outbox.
    pub async fn outbox_rows(&self) -> i64 {
        sqlx::query_scalar(&format!("SELECT count(*) FROM \"{}\".outbox", self.name))
            .fetch_one(&self.pool)
            .await
            .unwrap_or_else(|e| panic!("count {}.outbox: {e}", self.name))
    }

    /// Commits one outbox message per id of `ids` (default exchange, routing key `queue`, a
    /// body of `body_len` bytes, the id as its message id) through [`Outbox::store`], in
    /// transactions of up to 500 rows, in the order given (so the rows' ids follow it).
    pub async fn commit_outbox(&self, queue: &str, ids: &[String], body_len: usize) {
        let outbox = Outbox::new(self.schema.clone());
        let body = vec![b'x'; body_len];
        for chunk in ids.chunks(500) {
            let mut tx = self.pool.begin().await.expect("begin");
            for id in chunk {
                let m = OutboxMessage::new("", queue, body.clone()).with_message_id(id.as_str());
                outbox
                    .store(&mut tx, &m)
                    .await
                    .unwrap_or_else(|e| panic!("store {id} in {}.outbox: {e}", self.name));
            }
            tx.commit().await.expect("commit the outbox rows");
        }
    }

    /// Message ids of the rows left in the outbox (parked or not), in row id order: the order
    /// in which a relay takes them.
    pub async fn outbox_message_ids(&self) -> Vec<String> {
        sqlx::query_scalar(&format!(
            "SELECT message_id FROM \"{}\".outbox ORDER BY id",
            self.name
        ))
        .fetch_all(&self.pool)
        .await
        .unwrap_or_else(|e| panic!("read {}.outbox: {e}", self.name))
    }

    /// Parked rows of the outbox: (message id, reason, last error).
    pub async fn parked_rows(&self) -> Vec<(String, Option<String>, Option<String>)> {
        sqlx::query_as(&format!(
            "SELECT message_id, parked_reason, last_error FROM \"{}\".outbox \
             WHERE parked_at IS NOT NULL ORDER BY id",
            self.name
        ))
        .fetch_all(&self.pool)
        .await
        .unwrap_or_else(|e| panic!("read the parked rows of {}.outbox: {e}", self.name))
    }

    async fn group_count(&self, table: &str, column: &str) -> BTreeMap<String, i64> {
        let rows: Vec<(String, i64)> = sqlx::query_as(&format!(
            "SELECT {column}, count(*) FROM \"{}\".{table} GROUP BY {column}",
            self.name
        ))
        .fetch_all(&self.pool)
        .await
        .unwrap_or_else(|e| panic!("count {}.{table}: {e}", self.name));
        rows.into_iter().collect()
    }

    /// The business table's verdict: every id of `ids` has exactly one effect row, and no
    /// other id has any. Panics naming the ids missing or duplicated; returns a summary line.
    pub async fn assert_exactly_once(&self, what: &str, ids: &[String]) -> String {
        let effects = self.effects().await;
        let want: HashSet<&String> = ids.iter().collect();
        let missing: Vec<&String> = ids.iter().filter(|id| !effects.contains_key(*id)).collect();
        let twice: BTreeMap<&String, i64> = effects
            .iter()
            .filter(|(_, n)| **n > 1)
            .map(|(id, n)| (id, *n))
            .collect();
        let foreign: Vec<&String> = effects.keys().filter(|id| !want.contains(id)).collect();
        let rows: i64 = effects.values().sum();
        let line = format!(
            "{what}: {} ids, {rows} effect rows, {} ids with more than one, {} without any, {} \
             foreign",
            ids.len(),
            twice.len(),
            missing.len(),
            foreign.len()
        );
        assert!(
            twice.is_empty() && missing.is_empty() && foreign.is_empty(),
            "{line}; duplicated: {:?}; missing: {:?}; foreign: {:?}",
            twice.iter().take(20).collect::<Vec<_>>(),
            missing.iter().take(20).collect::<Vec<_>>(),
            foreign.iter().take(20).collect::<Vec<_>>(),
        );
        line
    }
}

impl Drop for EffectsDb {
    fn drop(&mut self) {
        redeliver_testkit::postgres::drop_schema(&self.name);
    }
}

/// `s`'s worker command in inbox mode on `db`'s schema, recording deliveries.
pub fn inbox_worker(s: &Scenario, db: &EffectsDb) -> WorkerCmd {
    s.worker()
        .arg("inbox-schema", &db.name)
        .arg("deliveries", deliveries_file(s).display())
}

pub fn deliveries_file(s: &Scenario) -> PathBuf {
    s.dir.join("deliveries.txt")
}

/// One delivery that went through the inbox, from the worker's `--deliveries` file.
#[derive(Clone, Debug)]
pub struct Delivery {
    pub id: String,
    pub label: String,
    pub start_ms: u128,
    pub end_ms: u128,
    /// `handled`, `duplicate` or `error`.
    pub outcome: String,
}

pub fn deliveries(s: &Scenario) -> Vec<Delivery> {
    std::fs::read_to_string(deliveries_file(s))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let mut it = l.split(' ');
            Some(Delivery {
                id: it.next()?.to_owned(),
                label: it.next()?.to_owned(),
                start_ms: it.next()?.parse().ok()?,
                end_ms: it.next()?.parse().ok()?,
                outcome: it.next()?.to_owned(),
            })
        })
        .collect()
}

/// How an inbox scenario ended, once [`assert_end`] found it right.
pub struct End {
    /// The harness's accounting of every id.
    pub acc: Accounting,
    /// [`EffectsDb::assert_exactly_once`]'s summary line.
    pub line: String,
    /// Deliveries the inbox found already processed (acked without the handler).
    pub duplicates: usize,
    /// Deliveries whose transaction failed (retried).
    pub errors: usize,
}

/// The end every inbox fault scenario asserts: each of `ids` settled, none in the DLQ, exactly
/// one effect row each. `what` names the scenario in the panics.
pub async fn assert_end(s: &Scenario, db: &EffectsDb, ids: &[String], what: &str) -> End {
    let acc = s.account(ids).await;
    acc.assert_settled(what);
    assert_eq!(
        acc.dead_lettered,
        0,
        "{what}: messages dead-lettered: {:?}",
        acc.dlq_reasons()
    );
    let line = db.assert_exactly_once(what, ids).await;
    let ds = deliveries(s);
    let count = |outcome: &str| ds.iter().filter(|d| d.outcome == outcome).count();
    End {
        duplicates: count("duplicate"),
        errors: count("error"),
        acc,
        line,
    }
}

/// Calls of the transactional handler for `id` (committed or not), from the calls file.
pub fn handler_calls(s: &Scenario, id: &str) -> usize {
    s.calls().iter().filter(|(i, _, _)| i == id).count()
}

/// PostgreSQL's cluster, for the restart test: `pg_ctlcluster` on the one version installed.
pub fn pg_ctlcluster(action: &str) -> Result<String, String> {
    let versions: Vec<String> = std::fs::read_dir("/etc/postgresql")
        .map_err(|e| format!("/etc/postgresql: {e}; {START_POSTGRES}"))?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    let [version] = versions.as_slice() else {
        return Err(format!(
            "expected one PostgreSQL version in /etc/postgresql, found {versions:?}"
        ));
    };
    let out = std::process::Command::new("pg_ctlcluster")
        .args(["--skip-systemctl-redirect", version, "main", action])
        .output()
        .map_err(|e| format!("run pg_ctlcluster: {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "pg_ctlcluster {version} main {action}: {}\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// A pool of at most `max` connections on the test database whose sessions carry
/// `application_name = app` (so a test can find and terminate the backends of one relay in
/// `pg_stat_activity`), acquiring for at most `acquire_timeout`. Call after [`pool`] (or
/// [`EffectsDb::new`]), which makes sure PostgreSQL answers.
pub async fn pool_named(app: &str, max: u32, acquire_timeout: Duration) -> PgPool {
    let url = redeliver_testkit::postgres::database_url();
    let options: PgConnectOptions = url
        .parse::<PgConnectOptions>()
        .unwrap_or_else(|e| panic!("DATABASE_URL is not a PostgreSQL URL: {e}"))
        .application_name(app);
    PgPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(acquire_timeout)
        .connect_with(options)
        .await
        .unwrap_or_else(|e| panic!("cannot connect to PostgreSQL: {e}\n{START_POSTGRES}"))
}

/// What arrived in the destination queue, counted per message id ([`assert_published`]).
#[derive(Debug)]
pub struct Copies {
    /// Copies received per message id.
    pub per_id: BTreeMap<String, usize>,
    /// Messages received in all.
    pub messages: usize,
    /// The ids received more than once, with their number of copies.
    pub duplicated: BTreeMap<String, usize>,
    /// A one-line summary.
    pub line: String,
}

/// The outbox's end check, per message id: every id of `stored` (each committed once) was
/// received (in `received`, the message ids drained from the destination queue) at least once
/// and at most `max_copies` times, no other id was, and only ids for which `may_repeat` holds
/// were received more than once. Panics naming the ids missing, foreign or wrongly duplicated.
pub fn assert_published(
    what: &str,
    stored: &[String],
    received: &[String],
    may_repeat: impl Fn(&str) -> bool,
    max_copies: usize,
) -> Copies {
    let mut per_id: BTreeMap<String, usize> = BTreeMap::new();
    for id in received {
        *per_id.entry(id.clone()).or_default() += 1;
    }
    let want: HashSet<&str> = stored.iter().map(String::as_str).collect();
    assert_eq!(
        want.len(),
        stored.len(),
        "{what}: the stored ids are not unique"
    );
    let missing: Vec<&String> = stored
        .iter()
        .filter(|id| !per_id.contains_key(*id))
        .collect();
    let foreign: Vec<&String> = per_id
        .keys()
        .filter(|id| !want.contains(id.as_str()))
        .collect();
    let duplicated: BTreeMap<String, usize> = per_id
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(id, n)| (id.clone(), *n))
        .collect();
    let unexpected: Vec<(&String, &usize)> = duplicated
        .iter()
        .filter(|(id, n)| **n > max_copies || !may_repeat(id))
        .collect();
    let line = format!(
        "{what}: {} rows committed, {} messages received, {} ids received, {} of them more than \
         once ({} extra copies), {} missing, {} foreign",
        stored.len(),
        received.len(),
        per_id.len(),
        duplicated.len(),
        duplicated.values().map(|n| n - 1).sum::<usize>(),
        missing.len(),
        foreign.len()
    );
    assert!(
        missing.is_empty() && foreign.is_empty() && unexpected.is_empty(),
        "{line}; missing: {:?}; foreign: {:?}; duplicated where at-least-once does not allow \
         it (or more than {max_copies} copies): {:?}",
        missing.iter().take(20).collect::<Vec<_>>(),
        foreign.iter().take(20).collect::<Vec<_>>(),
        unexpected.iter().take(20).collect::<Vec<_>>(),
    );
    Copies {
        messages: received.len(),
        per_id,
        duplicated,
        line,
    }
}

/// Waits until the outbox of `db` holds no row (published and deleted; a parked row fails at
/// once, with its reason) and `queue` at least `total` messages; panics after `timeout` saying
/// what is left. Returns how long it took.
pub async fn wait_relayed(
    db: &EffectsDb,
    s: &Scenario,
    queue: &str,
    total: usize,
    timeout: Duration,
) -> Duration {
    let start = std::time::Instant::now();
    loop {
        let left = db.outbox_rows().await;
        let parked = db.parked_rows().await;
        assert!(
            parked.is_empty(),
            "{} rows parked in {}.outbox (the first: {:?})",
            parked.len(),
            db.name,
            parked.first()
        );
        let (depth, _) = s.queue_state(queue).await;
        if left == 0 && depth as usize >= total {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < timeout,
            "after {timeout:?}: {left} rows still in {}.outbox, {depth} of {total} messages in \
             {queue}",
            db.name
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Message ids of every message in `queue`, removed (call once nothing publishes to it): a
/// consumer without acks, many times faster than one basic.get a message for thousands.
/// Panics when a message it was told of does not come within 10 s, or the queue is not empty
/// afterwards.
pub async fn drain_message_ids(conn: &Connection, queue: &str) -> Vec<String> {
    let passive = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    let ch = conn.create_channel().await.expect("a channel");
    let n = ch
        .queue_declare(queue.into(), passive, FieldTable::default())
        .await
        .unwrap_or_else(|e| panic!("passive declare of {queue}: {e}"))
        .message_count() as usize;
    let mut consumer = ch
        .basic_consume(
            queue.into(),
            "outbox-test-drain".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap_or_else(|e| panic!("basic.consume on {queue}: {e}"));
    let mut ids = Vec::with_capacity(n);
    while ids.len() < n {
        let d = tokio::time::timeout(Duration::from_secs(10), consumer.next())
            .await
            .unwrap_or_else(|_| panic!("{} of {n} messages drained from {queue}", ids.len()))
            .expect("the drain consumer ended")
            .expect("a delivery");
        ids.push(redeliver_testkit::message_id(&d.properties));
    }
    let _ = ch.close(200, "drained".into()).await;
    let ch = conn.create_channel().await.expect("a channel");
    let left = ch
        .queue_declare(queue.into(), passive, FieldTable::default())
        .await
        .unwrap_or_else(|e| panic!("passive declare of {queue}: {e}"))
        .message_count();
    let _ = ch.close(200, "checked".into()).await;
    assert_eq!(left, 0, "{queue} still holds messages after the drain");
    ids
}
