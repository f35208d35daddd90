//! The accounting of a reliability scenario: where every published id ended, and the bounds
//! the fault tests assert on duplicates.

use std::collections::BTreeMap;

use super::report;
use crate::Got;

/// Where one published id ended, as [`IdAccount::ending`] reads its account.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Ending {
    /// Gone from every queue of the scenario, with a success its handler recorded before the
    /// ack: acked after success.
    Acked,
    /// In the DLQ (and nowhere else waiting).
    DeadLettered,
    /// Still in the work queue or a delay level.
    InFlight,
    /// In the delay infrastructure's unroutable (parking) queue.
    Parked,
    /// Found nowhere, and no handler recorded a success for it.
    Lost,
}

/// Everything known about one published id after the run.
#[derive(Clone, Debug, Default)]
pub struct IdAccount {
    /// Labels of the worker processes whose handler recorded a success for it, one per
    /// success (before each ack; a label twice is one process handling it twice).
    pub handled_by: Vec<String>,
    /// Its copies in the DLQ, with their headers (x-death, attempt, last error).
    pub dlq: Vec<Got>,
    /// Its copies still in the work queue or the delay levels.
    pub waiting: usize,
    /// Its copies in the unroutable (parking) queue.
    pub parked: usize,
}

impl IdAccount {
    /// Successes its handlers recorded.
    pub fn successes(&self) -> usize {
        self.handled_by.len()
    }

    /// Copies of it the broker still holds (DLQ, work queue, delay levels, parking queue).
    pub fn copies(&self) -> usize {
        self.dlq.len() + self.waiting + self.parked
    }

    /// Where it ended. A copy still waiting wins over the rest (it is not settled yet), then a
    /// parked one, then the DLQ; an id the broker no longer holds was acked, after a success
    /// if its handler recorded one, else it is lost.
    pub fn ending(&self) -> Ending {
        if self.waiting > 0 {
            Ending::InFlight
        } else if self.parked > 0 {
            Ending::Parked
        } else if !self.dlq.is_empty() {
            Ending::DeadLettered
        } else if self.successes() > 0 {
            Ending::Acked
        } else {
            Ending::Lost
        }
    }

    /// Times it was handled or settled beyond once: handler successes plus copies held by the
    /// broker, minus one. Acked twice (the broker redelivered it although its ack was written),
    /// handled again without a second ack, acked and dead-lettered, dead-lettered twice: each
    /// extra time counts one.
    pub fn extra(&self) -> usize {
        (self.successes() + self.copies()).saturating_sub(1)
    }
}

/// The drained queues and the workers' records one [`Accounting`] is computed from.
#[derive(Debug, Default)]
pub struct Observed {
    /// Success records, `(id, worker label)`, in the order they were written.
    pub records: Vec<(String, String)>,
    /// Success acks the workers counted after writing them.
    pub acked_successes: u64,
    /// What the DLQ held.
    pub dlq: Vec<Got>,
    /// What the work queue and the delay levels held.
    pub waiting: Vec<Got>,
    /// What the unroutable (parking) queue held.
    pub unroutable: Vec<Got>,
}

/// Where every published id ended up: per id ([`Self::ids`]), and the totals the reports and
/// RELIABILITY.md's tables use.
#[derive(Debug)]
pub struct Accounting {
    /// The scenario's name.
    pub scenario: String,
    /// The broker it ran on (`RabbitMQ 4.0.5`).
    pub broker: String,
    /// Every published id's account.
    pub ids: BTreeMap<String, IdAccount>,
    /// Ids published.
    pub published: usize,
    /// Ids acked after a success: gone from every queue, with a success recorded by the handler.
    pub succeeded: usize,
    /// Successes settled by the ack frames the workers wrote (counted after each frame was
    /// written to the socket, from the worker's `redeliver_messages_succeeded_total`).
    pub acked_successes: u64,
    /// Ids gone from the broker beyond the success acks counted: a SIGKILL between writing an
    /// ack and counting it (must be 0 without kills; more would be an ack without a success).
    pub acks_unseen: usize,
    /// Success lines the handlers recorded for published ids (before the ack).
    pub handler_successes: usize,
    /// Handler successes beyond one per id: the handler ran again for a message already
    /// handled (a fault between its success and the broker receiving the ack). The ids are in
    /// [`Self::duplicates`].
    pub rehandled: usize,
    /// Distinct published ids found in the DLQ.
    pub dead_lettered: usize,
    /// Messages of published ids found in the DLQ (more than `dead_lettered` when one id was
    /// dead-lettered twice).
    pub dlq_messages: usize,
    /// Ids found in the DLQ more than once, with their number of copies.
    pub dlq_repeated: Vec<(String, usize)>,
    /// Messages still in the work queue or the delay levels.
    pub remaining: usize,
    /// Ids with a copy still in the work queue or the delay levels.
    pub in_flight: Vec<String>,
    /// Messages found in the unroutable (parking) queue.
    pub unroutable: usize,
    /// Published ids found nowhere, or gone from the broker without a handler success.
    pub lost: Vec<String>,
    /// Every id handled or settled more than once, with how many times beyond once
    /// ([`IdAccount::extra`]).
    pub duplicates: BTreeMap<String, usize>,
    /// Settlements beyond one per id, counted as the broker sees them: success acks written
    /// plus copies still in the broker (DLQ, work queue, delay levels, parking queue), minus the
    /// ids they settle. A message acked twice, acked and dead-lettered, or dead-lettered twice
    /// counts one; a handler that ran again without a second ack does not (that is
    /// [`Self::rehandled`]). Each of them is one of the ids named in [`Self::duplicates`].
    pub settled_twice: usize,
    /// Messages found (or successes recorded) that this scenario did not publish.
    pub foreign: usize,
    /// What the DLQ held.
    pub dlq: Vec<Got>,
    /// What the unroutable queue held.
    pub unroutable_messages: Vec<Got>,
}

/// At most this many ids are printed in one message; the count says how many there were.
const NAMED: usize = 20;

/// `{id: n, ...}` of at most [`NAMED`] entries, and `... (k in all)` past that.
fn named_counts(m: &BTreeMap<String, usize>) -> String {
    let mut out: Vec<String> = m
        .iter()
        .take(NAMED)
        .map(|(id, n)| format!("{id}: {n}"))
        .collect();
    if m.len() > NAMED {
        out.push(format!("... ({} ids in all)", m.len()));
    }
    format!("{{{}}}", out.join(", "))
}

/// `[id, ...]` of at most [`NAMED`] ids, and `... (k in all)` past that.
fn named(ids: &[String]) -> String {
    let mut out: Vec<&str> = ids.iter().take(NAMED).map(String::as_str).collect();
    let all = format!("... ({} ids in all)", ids.len());
    if ids.len() > NAMED {
        out.push(&all);
    }
    format!("[{}]", out.join(", "))
}

impl Accounting {
    /// Accounts for `ids` from what was observed: pure bookkeeping, so it is tested alone.
    pub fn compute(scenario: &str, broker: &str, ids: &[String], seen: Observed) -> Accounting {
        let mut accounts: BTreeMap<String, IdAccount> = ids
            .iter()
            .map(|id| (id.clone(), IdAccount::default()))
            .collect();
        let mut foreign = 0;
        for (id, label) in seen.records {
            match accounts.get_mut(&id) {
                Some(a) => a.handled_by.push(label),
                None => foreign += 1,
            }
        }
        for g in &seen.dlq {
            match accounts.get_mut(g.message_id()) {
                Some(a) => a.dlq.push(g.clone()),
                None => foreign += 1,
            }
        }
        for g in &seen.waiting {
            match accounts.get_mut(g.message_id()) {
                Some(a) => a.waiting += 1,
                None => foreign += 1,
            }
        }
        for g in &seen.unroutable {
            match accounts.get_mut(g.message_id()) {
                Some(a) => a.parked += 1,
                None => foreign += 1,
            }
        }
        let with = |e: Ending| -> Vec<String> {
            accounts
                .iter()
                .filter(|(_, a)| a.ending() == e)
                .map(|(id, _)| id.clone())
                .collect()
        };
        let lost = with(Ending::Lost);
        let succeeded = with(Ending::Acked).len();
        let in_flight = with(Ending::InFlight);
        let duplicates: BTreeMap<String, usize> = accounts
            .iter()
            .filter(|(_, a)| a.extra() > 0)
            .map(|(id, a)| (id.clone(), a.extra()))
            .collect();
        let handler_successes: usize = accounts.values().map(IdAccount::successes).sum();
        let handled_ids = accounts.values().filter(|a| a.successes() > 0).count();
        let in_broker: Vec<&IdAccount> = accounts.values().filter(|a| a.copies() > 0).collect();
        let broker_copies: usize = in_broker.iter().map(|a| a.copies()).sum();
        // One settlement per id is expected: a success ack, or its one copy in the broker.
        let settlements = seen.acked_successes as usize + broker_copies;
        let settled_ids = succeeded + in_broker.len();
        let dlq_repeated: Vec<(String, usize)> = accounts
            .iter()
            .filter(|(_, a)| a.dlq.len() > 1)
            .map(|(id, a)| (id.clone(), a.dlq.len()))
            .collect();
        Accounting {
            scenario: scenario.to_owned(),
            broker: broker.to_owned(),
            published: ids.len(),
            succeeded,
            acked_successes: seen.acked_successes,
            acks_unseen: succeeded.saturating_sub(seen.acked_successes as usize),
            handler_successes,
            rehandled: handler_successes - handled_ids,
            dead_lettered: accounts.values().filter(|a| !a.dlq.is_empty()).count(),
            dlq_messages: accounts.values().map(|a| a.dlq.len()).sum(),
            dlq_repeated,
            remaining: accounts.values().map(|a| a.waiting).sum(),
            in_flight,
            unroutable: seen.unroutable.len(),
            lost,
            duplicates,
            settled_twice: settlements.saturating_sub(settled_ids),
            foreign,
            dlq: seen.dlq,
            unroutable_messages: seen.unroutable,
            ids: accounts,
        }
    }

    /// Handled or settled beyond once, all ids together (the sum of [`Self::duplicates`]).
    pub fn duplicate_total(&self) -> usize {
        self.duplicates.values().sum()
    }

    /// Each duplicated id with what happened to it: its successes and the processes that
    /// recorded them, its copies in the DLQ (with their x-death reasons) and elsewhere.
    pub fn describe_duplicates(&self) -> String {
        let mut out: Vec<String> = self
            .duplicates
            .keys()
            .take(NAMED)
            .filter_map(|id| {
                let a = self.ids.get(id)?;
                let reasons: Vec<String> = a
                    .dlq
                    .iter()
                    .map(|g| g.death_reason().unwrap_or_else(|| "none".into()))
                    .collect();
                Some(format!(
                    "{id}: handled by {:?}, DLQ copies {reasons:?}, waiting {}, parked {}",
                    a.handled_by, a.waiting, a.parked
                ))
            })
            .collect();
        if self.duplicates.len() > NAMED {
            out.push(format!("... ({} ids in all)", self.duplicates.len()));
        }
        out.join("; ")
    }

    /// One line with every count.
    pub fn summary(&self) -> String {
        format!(
            "N={} succeeded={} (success acks {}, unseen {}; handler successes {}, re-handled {}) \
             dead-lettered={} (DLQ messages {}, ids twice or more {}) remaining={} unroutable={} \
             lost={} duplicates={} (settled twice {}) foreign={}; duplicated ids {}",
            self.published,
            self.succeeded,
            self.acked_successes,
            self.acks_unseen,
            self.handler_successes,
            self.rehandled,
            self.dead_lettered,
            self.dlq_messages,
            self.dlq_repeated.len(),
            self.remaining,
            self.unroutable,
            self.lost.len(),
            self.duplicate_total(),
            self.settled_twice,
            self.foreign,
            named_counts(&self.duplicates)
        )
    }

    /// The suite's invariant: nothing lost. Prints the summary either way.
    pub fn assert_nothing_lost(&self, what: &str) {
        report(format!("{what}: {}", self.summary()));
        assert!(
            self.lost.is_empty(),
            "{what}: {} message(s) lost: {}",
            self.lost.len(),
            named(&self.lost)
        );
        assert_eq!(
            self.foreign, 0,
            "{what}: messages of another scenario found"
        );
    }

    /// Nothing lost, nothing left in the work queue or delay levels, nothing parked.
    pub fn assert_settled(&self, what: &str) {
        self.assert_settled_parked(what, 0);
    }

    /// [`Self::assert_settled`] where exactly `parked` messages must be in the parking queue.
    pub fn assert_settled_parked(&self, what: &str, parked: usize) {
        self.assert_nothing_lost(what);
        assert!(
            self.in_flight.is_empty(),
            "{what}: {} message(s) still waiting in the work queue or the delay levels: {}",
            self.remaining,
            named(&self.in_flight)
        );
        assert_eq!(
            self.unroutable,
            parked,
            "{what}: messages in the parking queue (delay infrastructure's unroutable queue): \
             {:?}",
            self.unroutable_messages
                .iter()
                .map(Got::message_id)
                .take(NAMED)
                .collect::<Vec<_>>()
        );
    }

    /// Bounds what at-least-once allows a fault to cost: the ids handled or settled more than
    /// once, `bound` times at most in all, each named in the message; the settlements and the
    /// handler runs beyond one per id at most `bound` each; and, without a process killed
    /// (`killed` false), every id gone from the broker matched by a success ack the workers
    /// counted. Prints the measured counts as one `RESULT` line (RELIABILITY.md's tables are
    /// filled from them), with the duplicated ids.
    pub fn assert_duplicates_at_most(&self, what: &str, bound: usize, killed: bool) {
        report(format!(
            "RESULT fault=\"{what}\" broker=\"{}\" N={} lost={} duplicates={} re-handled={} \
             dlq-ids={} dlq-messages={} acks-unseen={} bound={bound} duplicated-ids={}",
            self.broker,
            self.published,
            self.lost.len(),
            self.settled_twice,
            self.rehandled,
            self.dead_lettered,
            self.dlq_messages,
            self.acks_unseen,
            named_counts(&self.duplicates)
        ));
        assert!(
            self.duplicate_total() <= bound,
            "{what}: ids handled or settled more than once, {} times beyond once in all, more \
             than the bound {bound}: {}",
            self.duplicate_total(),
            self.describe_duplicates()
        );
        assert!(
            self.settled_twice <= bound,
            "{what}: {} settlements beyond one per id, more than the bound {bound}; duplicated \
             ids: {}",
            self.settled_twice,
            self.describe_duplicates()
        );
        assert!(
            self.rehandled <= bound,
            "{what}: {} messages handled again, more than the bound {bound}; duplicated ids: {}",
            self.rehandled,
            self.describe_duplicates()
        );
        if killed {
            assert!(
                self.acks_unseen <= bound,
                "{what}: {} ids left the broker without a counted success ack",
                self.acks_unseen
            );
        } else {
            assert_eq!(
                self.acks_unseen, 0,
                "{what}: ids left the broker without a success ack (acks counted {}, ids \
                 acked {})",
                self.acked_successes, self.succeeded
            );
        }
    }

    /// Ids found in the DLQ more than once must be none: every dead letter is one message.
    pub fn assert_dead_lettered_once(&self, what: &str) {
        let repeated: BTreeMap<String, usize> = self.dlq_repeated.iter().cloned().collect();
        assert!(
            repeated.is_empty(),
            "{what}: ids dead-lettered more than once: {}",
            named_counts(&repeated)
        );
    }

    /// DLQ entries per x-death reason.
    pub fn dlq_reasons(&self) -> BTreeMap<String, usize> {
        let mut m = BTreeMap::new();
        for g in &self.dlq {
            *m.entry(g.death_reason().unwrap_or_else(|| "none".into()))
                .or_default() += 1;
        }
        m
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn got(id: &str) -> Got {
        Got {
            body: Vec::new(),
            properties: lapin::BasicProperties::default().with_message_id(id.into()),
        }
    }

    fn record(id: &str, label: &str) -> (String, String) {
        (id.to_owned(), label.to_owned())
    }

    fn panic_message(f: impl FnOnce()) -> String {
        let err =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).expect_err("should panic");
        err.downcast_ref::<String>()
            .cloned()
            .or_else(|| err.downcast_ref::<&str>().map(|s| (*s).to_owned()))
            .unwrap_or_default()
    }

    #[test]
    fn every_id_has_an_ending_and_duplicates_are_named() {
        let ids: Vec<String> = [
            "ok",
            "twice",
            "dlq2",
            "ok-and-dlq",
            "gone",
            "waiting",
            "parked",
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        let seen = Observed {
            records: vec![
                record("ok", "a-1"),
                record("twice", "a-1"),
                record("twice", "a-2"),
                record("ok-and-dlq", "b-1"),
                record("someone-else", "b-1"),
            ],
            // ok, twice (acked twice: the first ack was written, then lost), ok-and-dlq.
            acked_successes: 4,
            dlq: vec![got("dlq2"), got("dlq2"), got("ok-and-dlq")],
            waiting: vec![got("waiting")],
            unroutable: vec![got("parked")],
        };
        let acc = Accounting::compute("t", "RabbitMQ 0", &ids, seen);
        let ending = |id: &str| acc.ids[id].ending();
        assert_eq!(ending("ok"), Ending::Acked);
        assert_eq!(ending("twice"), Ending::Acked);
        assert_eq!(ending("dlq2"), Ending::DeadLettered);
        assert_eq!(ending("ok-and-dlq"), Ending::DeadLettered);
        assert_eq!(ending("gone"), Ending::Lost);
        assert_eq!(ending("waiting"), Ending::InFlight);
        assert_eq!(ending("parked"), Ending::Parked);
        assert_eq!(acc.ids["twice"].handled_by, ["a-1", "a-2"]);
        assert_eq!(acc.lost, ["gone"]);
        assert_eq!(acc.in_flight, ["waiting"]);
        assert_eq!(acc.succeeded, 2);
        assert_eq!(acc.foreign, 1);
        let dup: Vec<(&str, usize)> = acc
            .duplicates
            .iter()
            .map(|(id, n)| (id.as_str(), *n))
            .collect();
        assert_eq!(dup, [("dlq2", 1), ("ok-and-dlq", 1), ("twice", 1)]);
        assert_eq!(acc.rehandled, 1);
        // Acked twice, dead-lettered twice, acked and dead-lettered: one each.
        assert_eq!(acc.settled_twice, 3);
        assert_eq!(acc.dlq_repeated, [("dlq2".to_owned(), 2)]);

        // Each failure names the ids, not only how many.
        let msg = panic_message(|| acc.assert_nothing_lost("t"));
        assert!(msg.contains("[gone]"), "{msg}");
        let msg = panic_message(|| acc.assert_duplicates_at_most("t", 2, true));
        for id in ["twice", "dlq2", "ok-and-dlq", "a-2"] {
            assert!(msg.contains(id), "{id} not named in: {msg}");
        }
        let msg = panic_message(|| acc.assert_dead_lettered_once("t"));
        assert!(msg.contains("dlq2: 2"), "{msg}");
    }

    #[test]
    fn a_clean_run_has_no_duplicates() {
        let ids = vec!["a".to_owned(), "b".to_owned()];
        let seen = Observed {
            records: vec![record("a", "w")],
            acked_successes: 1,
            dlq: vec![got("b")],
            ..Observed::default()
        };
        let acc = Accounting::compute("t", "RabbitMQ 0", &ids, seen);
        acc.assert_settled("t");
        acc.assert_duplicates_at_most("t", 0, false);
        acc.assert_dead_lettered_once("t");
        assert!(acc.duplicates.is_empty());
    }
}
