//! The database of the inbox and outbox fault tests: a PostgreSQL schema of their own
//! ([`EffectsSchema`]) holding the inbox and the outbox (migrated by the test, with the crate
//! under test) and the business table `effects`, dropped at the end (also when the test fails),
//! with the counts read from it and the exactly-once check.

use std::collections::{BTreeMap, HashSet};

use sqlx::PgPool;

use crate::postgres::{drop_schema, pool};

/// A schema of its own (`rdfx_<hex>`) for the inbox and outbox tables and
/// `effects (message_id text, worker text, at timestamptz)`, **no unique constraint**: only
/// the inbox can keep a second row out. Dropped with everything in it when this is dropped.
#[derive(Debug)]
pub struct EffectsSchema {
    /// A pool of 4 connections on the test database.
    pub pool: PgPool,
    /// The schema's name.
    pub name: String,
}

impl EffectsSchema {
    /// A fresh schema name on a new pool; nothing is created yet. The test migrates the inbox
    /// and outbox tables into it, then calls [`Self::create_effects`].
    pub async fn new() -> Self {
        let pool = pool(4).await;
        let name = format!("rdfx_{}", crate::unique_id(12));
        Self { pool, name }
    }

    /// Creates the business table `effects` in the schema (which must exist: migrate first).
    pub async fn create_effects(&self) {
        sqlx::query(&format!(
            "CREATE TABLE \"{}\".effects (message_id text NOT NULL, worker text NOT NULL, \
             at timestamptz NOT NULL DEFAULT clock_timestamp())",
            self.name
        ))
        .execute(&self.pool)
        .await
        .unwrap_or_else(|e| panic!("create {}.effects: {e}", self.name));
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

impl Drop for EffectsSchema {
    fn drop(&mut self) {
        drop_schema(&self.name);
    }
}
