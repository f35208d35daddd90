//! The outbox fault tests' rows: committed through the crate under test's [`Outbox`].

use redeliver::postgres::{Outbox, OutboxMessage};
use redeliver_testkit::effects::EffectsSchema;

use crate::effects_db::schema;

/// Commits to `db`'s outbox one message per id of `ids` (default exchange, routing key `queue`, a
/// body of `body_len` bytes, the id as its message id) through [`Outbox::store`], in
/// transactions of up to 500 rows, in the order given (so the rows' ids follow it).
pub(crate) async fn commit_outbox(
    db: &EffectsSchema,
    queue: &str,
    ids: &[String],
    body_len: usize,
) {
    let outbox = Outbox::new(schema(db));
    let body = vec![b'x'; body_len];
    for chunk in ids.chunks(500) {
        let mut tx = db.pool.begin().await.expect("begin");
        for id in chunk {
            let m = OutboxMessage::new("", queue, body.clone()).with_message_id(id.as_str());
            outbox
                .store(&mut tx, &m)
                .await
                .unwrap_or_else(|e| panic!("store {id} in {}.outbox: {e}", db.name));
        }
        tx.commit().await.expect("commit the outbox rows");
    }
}
