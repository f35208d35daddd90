//! Bounds the worker's own requeues.
//!
//! The worker gives a message back to its queue (`basic.reject(requeue = true)`) only when it
//! could not make a safe copy: a retry copy or a repaired copy the broker did not confirm. Before
//! RabbitMQ 4.3 the quorum queue counted each such requeue toward `x-delivery-limit`, so a copy
//! that can never be confirmed ended in the DLQ by itself; from 4.3 it does not (only a return by
//! a closed channel counts), and a classic queue never counted at all. So the worker counts: it
//! remembers how often it requeued each message and, past the limit, dead-letters it instead.
//!
//! A message is recognised by a hash of its `message_id`, routing key and body, in a ledger of
//! bounded size (the oldest entries go first), kept for the worker's life across reconnects.

use std::collections::hash_map::DefaultHasher;
use std::collections::{HashMap, VecDeque};
use std::hash::{Hash, Hasher};
use std::sync::{Mutex, MutexGuard, PoisonError};

/// Messages the ledger remembers at most; far more than ever wait for a requeue at once.
const CAPACITY: usize = 10_000;

/// Identity of a delivered message across its redeliveries.
pub(crate) fn identity(message_id: &str, routing_key: &str, body: &[u8]) -> u64 {
    let mut h = DefaultHasher::new();
    message_id.hash(&mut h);
    routing_key.hash(&mut h);
    body.hash(&mut h);
    h.finish()
}

/// Locks a ledger. A poisoned lock still holds good counts; losing them would unbound the
/// requeues.
pub(crate) fn lock(ledger: &Mutex<RequeueLedger>) -> MutexGuard<'_, RequeueLedger> {
    ledger.lock().unwrap_or_else(PoisonError::into_inner)
}

/// How often each message was requeued by this worker.
#[derive(Debug, Default)]
pub(crate) struct RequeueLedger {
    counts: HashMap<u64, u32>,
    order: VecDeque<u64>,
}

impl RequeueLedger {
    /// Counts one more requeue of `key` and returns the count, this one included.
    pub(crate) fn record(&mut self, key: u64) -> u32 {
        if let Some(n) = self.counts.get_mut(&key) {
            *n += 1;
            return *n;
        }
        if self.order.len() >= CAPACITY {
            if let Some(oldest) = self.order.pop_front() {
                self.counts.remove(&oldest);
            }
        }
        self.order.push_back(key);
        self.counts.insert(key, 1);
        1
    }

    /// Requeues of `key` so far.
    pub(crate) fn count(&self, key: u64) -> u32 {
        self.counts.get(&key).copied().unwrap_or(0)
    }

    /// Forgets `key` (the message left the queue for good).
    pub(crate) fn forget(&mut self, key: u64) {
        if self.counts.remove(&key).is_some() {
            self.order.retain(|k| *k != key);
        }
    }

    /// Nothing remembered: a confirmed copy need not hash its body to forget it.
    pub(crate) fn is_empty(&self) -> bool {
        self.counts.is_empty()
    }

    /// Messages remembered.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.counts.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_per_message_and_stays_bounded() {
        let mut l = RequeueLedger::default();
        assert_eq!(l.record(1), 1);
        assert_eq!(l.record(1), 2);
        assert_eq!(l.record(2), 1);
        assert_eq!(l.record(1), 3);
        l.forget(1);
        assert_eq!(l.record(1), 1);
        for k in 10..(10 + CAPACITY as u64 * 2) {
            l.record(k);
        }
        assert_eq!(l.len(), CAPACITY);
        // The oldest went first: 1 and 2 are forgotten, the newest are kept.
        assert_eq!(l.record(2), 1);
        assert_eq!(l.record(9 + CAPACITY as u64 * 2), 2);
    }
}
