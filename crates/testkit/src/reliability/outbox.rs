//! The end checks of the outbox fault tests: the relay done with an [`EffectsSchema`]'s
//! outbox, and every stored message id received, at most as often as at-least-once allows.

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use super::scenario::Scenario;
use crate::effects::EffectsSchema;

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
    db: &EffectsSchema,
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
