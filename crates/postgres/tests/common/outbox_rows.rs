//! Rows put in the outbox of a [`TestDb`] as a service's transaction would.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code); helpers are `pub` for the test files that include this module.
#![allow(clippy::expect_used, unreachable_pub)]

use redeliver_postgres::{Outbox, OutboxMessage};

use crate::test_db::TestDb;

impl TestDb {
    /// Stores `messages` in the outbox in one transaction, and commits it.
    pub async fn store_committed(&self, messages: &[OutboxMessage]) {
        let outbox = Outbox::new(self.schema.clone());
        let mut tx = self.pool.begin().await.expect("begin");
        for m in messages {
            outbox.store(&mut tx, m).await.expect("store");
        }
        tx.commit().await.expect("commit");
    }
}
