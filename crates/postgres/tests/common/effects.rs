//! The business table of the inbox tests: `effects`, in the [`TestDb`]'s schema.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code); helpers are `pub` for the test files that include this module.
#![allow(clippy::expect_used, unreachable_pub)]

use crate::test_db::TestDb;

impl TestDb {
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

    /// The qualified name of the `effects` table.
    pub fn effects(&self) -> String {
        format!("{}.effects", self.name)
    }
}
