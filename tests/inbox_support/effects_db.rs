//! The database of the inbox and outbox fault tests: an [`EffectsSchema`] with the inbox and
//! outbox tables migrated into it by the crate under test.

use redeliver::postgres::Schema;
use redeliver_testkit::effects::EffectsSchema;

/// A fresh [`EffectsSchema`]: the inbox and outbox tables, then `effects`.
pub(crate) async fn effects_db() -> EffectsSchema {
    // Dropped from here on, whatever fails next.
    let db = EffectsSchema::new().await;
    schema(&db)
        .migrate(&db.pool)
        .await
        .unwrap_or_else(|e| panic!("migrate schema {}: {e}", db.name));
    db.create_effects().await;
    db
}

/// `db`'s schema, as the inbox, the outbox and the relay take it.
pub(crate) fn schema(db: &EffectsSchema) -> Schema {
    Schema::named(&db.name).expect("a valid schema name")
}
