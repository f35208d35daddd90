//! The database of a PostgreSQL test: a schema of its own on the test database, dropped at the
//! end of the test, also when it fails.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code); helpers are `pub` for the test files that include this module.
#![allow(clippy::expect_used, clippy::panic, unreachable_pub)]

use redeliver_postgres::Schema;
use sqlx::PgPool;

/// A schema of its own (`rdpg_<hex>`), dropped with everything in it when this is dropped.
/// Nothing is created in it yet: the test migrates it. The `effects` table is in
/// `common/effects.rs`, storing in the outbox in `common/outbox_rows.rs`.
pub struct TestDb {
    pub pool: PgPool,
    pub name: String,
    pub schema: Schema,
}

impl TestDb {
    /// A fresh schema name on a pool of 10 connections.
    pub async fn new() -> Self {
        let pool = redeliver_testkit::postgres::pool(10).await;
        let name = format!("rdpg_{}", redeliver_testkit::unique_id(12));
        let schema = Schema::named(&name).expect("valid schema name");
        Self { pool, name, schema }
    }

    /// Rows in `table` of the schema.
    pub async fn count(&self, table: &str) -> i64 {
        sqlx::query_scalar(&format!("SELECT count(*) FROM {}.{table}", self.name))
            .fetch_one(&self.pool)
            .await
            .unwrap_or_else(|e| panic!("count {table}: {e}"))
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        redeliver_testkit::postgres::drop_schema(&self.name);
    }
}
