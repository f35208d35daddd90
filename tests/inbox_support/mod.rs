//! Shared by the inbox and outbox fault tests (`tests/inbox_*.rs`, `tests/outbox_faults.rs`):
//! a PostgreSQL schema of their own holding the inbox, the outbox and the business table
//! `effects`, dropped at the end (also when the test fails), and the exactly-once check.
#![allow(dead_code)] // each test binary uses some of these

use std::collections::{BTreeMap, HashSet};
use std::path::PathBuf;

use redeliver::postgres::Schema;
use redeliver_testkit::reliability::{Accounting, Scenario, WorkerCmd};
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
