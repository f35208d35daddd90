//! The workers of the inbox fault tests: `reliability_worker` in inbox mode on an
//! [`EffectsSchema`], the deliveries it records, and the end every inbox scenario asserts.

use super::accounting::Accounting;
use super::scenario::Scenario;
use super::worker::WorkerCmd;
use crate::effects::EffectsSchema;

impl Scenario {
    /// This scenario's worker command in inbox mode on schema `schema`, recording deliveries
    /// ([`Self::deliveries`]).
    pub fn inbox_worker(&self, schema: &str) -> WorkerCmd {
        self.worker()
            .arg("inbox-schema", schema)
            .arg("deliveries", self.dir.join(DELIVERIES).display())
    }

    /// The deliveries that went through the inbox, from the workers' `--deliveries` file.
    pub fn deliveries(&self) -> Vec<Delivery> {
        std::fs::read_to_string(self.dir.join(DELIVERIES))
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

    /// Calls of the transactional handler for `id` (committed or not), from the calls file.
    pub fn handler_calls(&self, id: &str) -> usize {
        self.calls().iter().filter(|(i, _, _)| i == id).count()
    }
}

/// The deliveries file of an inbox scenario, in its directory.
const DELIVERIES: &str = "deliveries.txt";

/// One delivery that went through the inbox, from the worker's `--deliveries` file.
#[derive(Clone, Debug)]
pub struct Delivery {
    /// Its message id.
    pub id: String,
    /// Label of the worker process.
    pub label: String,
    /// When the worker took it (unix ms).
    pub start_ms: u128,
    /// When the worker was done with it (unix ms).
    pub end_ms: u128,
    /// `handled`, `duplicate` or `error`.
    pub outcome: String,
}

/// How an inbox scenario ended, once [`assert_inbox_end`] found it right.
pub struct End {
    /// The harness's accounting of every id.
    pub acc: Accounting,
    /// [`EffectsSchema::assert_exactly_once`]'s summary line.
    pub line: String,
    /// Deliveries the inbox found already processed (acked without the handler).
    pub duplicates: usize,
    /// Deliveries whose transaction failed (retried).
    pub errors: usize,
}

/// The end every inbox fault scenario asserts: each of `ids` settled, none in the DLQ, exactly
/// one effect row each. `what` names the scenario in the panics.
pub async fn assert_inbox_end(s: &Scenario, db: &EffectsSchema, ids: &[String], what: &str) -> End {
    let acc = s.account(ids).await;
    acc.assert_settled(what);
    assert_eq!(
        acc.dead_lettered,
        0,
        "{what}: messages dead-lettered: {:?}",
        acc.dlq_reasons()
    );
    let line = db.assert_exactly_once(what, ids).await;
    let ds = s.deliveries();
    let count = |outcome: &str| ds.iter().filter(|d| d.outcome == outcome).count();
    End {
        duplicates: count("duplicate"),
        errors: count("error"),
        acc,
        line,
    }
}
