//! Forwarding: a failure that should go on to another queue rather than be retried here.
//!
//! Celery users send a task that hits its time limit on to a more powerful queue; NServiceBus
//! and Spring AMQP call the general form a dead-letter "recoverer" with a destination of its
//! own. Here a policy holds at most one [`Forward`] destination, and a failure is forwarded when
//! it is *of the forward kind* ([`ErrorKind::Forward`](crate::ErrorKind::Forward)): the handler
//! said so ([`HandlerError::forward`](crate::HandlerError::forward)), or the policy's
//! [`Classifier`](crate::Classifier) named its error class
//! ([`forward_on`](crate::Classifier::forward_on), [`TimedOut`] for handler timeouts).

use std::fmt;
use std::time::Duration;

/// Where a policy forwards failures of the forward kind, and from which attempt on.
///
/// ```
/// use std::time::Duration;
/// use redeliver::{Classifier, Decision, Forward, HandlerError, RetryPolicy, TimedOut};
///
/// // Timeouts of `images` are retried once here, then go on to `images.heavy`.
/// let policy = RetryPolicy::exponential(Duration::from_millis(100))
///     .classifier(Classifier::default().forward_on::<TimedOut>())
///     .forward(Forward::to_queue("images.heavy").after_attempts(2));
///
/// let timeout = || HandlerError::unclassified(TimedOut::after(Duration::from_secs(30)));
/// assert!(matches!(policy.decide(0, None, &timeout()), Decision::Retry { .. }));
/// match policy.decide(1, None, &timeout()) {
///     Decision::Forward(to) => assert_eq!(to.routing_key(), "images.heavy"),
///     other => panic!("unexpected {other:?}"),
/// }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Forward {
    exchange: String,
    routing_key: String,
    after_attempts: u32,
}

impl Forward {
    /// Forward to the queue `queue` (through the default exchange, which routes by queue name).
    pub fn to_queue(queue: impl Into<String>) -> Self {
        Self::to_exchange("", queue)
    }

    /// Forward to `exchange` with `routing_key`. The message must be routable: an unroutable
    /// forward is refused by the broker and the original stays in its queue.
    pub fn to_exchange(exchange: impl Into<String>, routing_key: impl Into<String>) -> Self {
        Self {
            exchange: exchange.into(),
            routing_key: routing_key.into(),
            after_attempts: 1,
        }
    }

    /// Forward only at the `n`-th attempt that fails with a forward-kind error, counting every
    /// attempt of the message (its first delivery is attempt 1); earlier ones are retried here
    /// like a transient error. Default 1: forward at the first such failure. `0` counts as 1.
    ///
    /// The message's retries still count: with `max_retries` below `n - 1` it is dead-lettered
    /// (retries exhausted) before it would be forwarded.
    ///
    /// Read it back with [`Self::configured_after_attempts`].
    pub fn after_attempts(mut self, n: u32) -> Self {
        self.after_attempts = n.max(1);
        self
    }

    /// The destination exchange (`""`: the default exchange, routing by queue name).
    pub fn exchange(&self) -> &str {
        &self.exchange
    }

    /// The destination routing key (the queue's name with [`to_queue`](Self::to_queue)).
    pub fn routing_key(&self) -> &str {
        &self.routing_key
    }

    /// The attempt from which failures are forwarded.
    pub fn configured_after_attempts(&self) -> u32 {
        self.after_attempts
    }

    /// The queue name when the destination is a queue through the default exchange.
    pub fn queue(&self) -> Option<&str> {
        self.exchange
            .is_empty()
            .then_some(self.routing_key.as_str())
    }

    /// Whether the failure of the attempt after `retries_so_far` retries is forwarded.
    pub(crate) fn due(&self, retries_so_far: u32) -> bool {
        retries_so_far.saturating_add(1) >= self.after_attempts
    }
}

impl fmt::Display for Forward {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.queue() {
            Some(q) => write!(f, "queue '{q}'"),
            None => write!(
                f,
                "exchange '{}' (routing key '{}')",
                self.exchange, self.routing_key
            ),
        }
    }
}

/// The error of a handler that did not finish within its time limit. The worker reports a
/// timeout as an unclassified [`HandlerError`](crate::HandlerError) holding a `TimedOut`: it
/// is transient unless a [`Classifier`](crate::Classifier) rule names it, such as
/// [`forward_on::<TimedOut>()`](crate::Classifier::forward_on).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TimedOut {
    limit: Duration,
}

impl TimedOut {
    /// A handler stopped after `limit`.
    pub fn after(limit: Duration) -> Self {
        Self { limit }
    }

    /// The time limit the handler ran into.
    pub fn limit(&self) -> Duration {
        self.limit
    }
}

impl fmt::Display for TimedOut {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "handler timed out after {:?}", self.limit)
    }
}

impl std::error::Error for TimedOut {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn due_counts_attempts_from_one() {
        let f = Forward::to_queue("heavy");
        assert!(f.due(0));
        let f = f.after_attempts(3);
        assert!(!f.due(0));
        assert!(!f.due(1));
        assert!(f.due(2));
        assert!(f.due(u32::MAX));
        assert_eq!(
            Forward::to_queue("q")
                .after_attempts(0)
                .configured_after_attempts(),
            1
        );
    }

    #[test]
    fn destination_reads_back() {
        let q = Forward::to_queue("images.heavy");
        assert_eq!((q.exchange(), q.routing_key()), ("", "images.heavy"));
        assert_eq!(q.queue(), Some("images.heavy"));
        assert_eq!(q.to_string(), "queue 'images.heavy'");
        let x = Forward::to_exchange("heavy", "images");
        assert_eq!(x.queue(), None);
        assert_eq!(x.to_string(), "exchange 'heavy' (routing key 'images')");
        assert_eq!(
            TimedOut::after(Duration::from_millis(1500)).to_string(),
            "handler timed out after 1.5s"
        );
    }
}
