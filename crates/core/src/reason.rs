//! Why a message left its queue without success: the one reason type of the policy, the
//! worker's headers and metrics, and the command-line tool.

use std::fmt;

/// Why a message is dead-lettered, or why the worker gave a delivery back to its queue.
///
/// [`as_str`](Self::as_str) is the reason's stable name: the value of the
/// `x-redeliver-dead-letter-reason` header (or the `x-opt-` annotation of a native dead letter)
/// on the message in `Q.dlq`, the `reason` label of the worker's
/// `redeliver_messages_dead_lettered_total` and `redeliver_messages_requeued_total` metrics, and
/// what `redeliver dlq list` shows and `--reason` selects. Names never change once released:
/// they are stored in queues and dashboards.
///
/// A [`RetryPolicy`](crate::RetryPolicy) decides [`Permanent`](Self::Permanent),
/// [`RetriesExhausted`](Self::RetriesExhausted), [`BudgetExhausted`](Self::BudgetExhausted),
/// [`ForwardUnconfigured`](Self::ForwardUnconfigured) and [`Named`](Self::Named); the worker
/// adds the others when settling a delivery. The `*Unconfirmed` and
/// [`SettlePanicked`](Self::SettlePanicked) reasons ([`is_requeue`](Self::is_requeue)) label a
/// requeue, never a dead letter: past the worker's requeue limit the message is dead-lettered
/// with [`RequeueLimit`](Self::RequeueLimit).
///
/// Reading a dead letter back:
///
/// ```
/// use redeliver::DeadLetterReason;
///
/// assert_eq!(DeadLetterReason::parse("too_large"), Some(DeadLetterReason::TooLarge));
/// // A reason a handler named, or one from a later version: keep the text.
/// assert_eq!(DeadLetterReason::parse("no_message_id"), None);
/// ```
///
/// Non-exhaustive on purpose: a new way for the worker to give up is a new reason, and it must
/// not break the tools that match on reasons. Such tools need a catch-all arm anyway: a dead
/// letter may carry a [`Named`](Self::Named) reason or one written by a later version, which
/// [`parse`](Self::parse) does not know.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DeadLetterReason {
    /// `permanent`: the error is permanent (the handler or the classifier said so).
    Permanent,
    /// `retries_exhausted`: the message was already retried `retries` times, the policy's
    /// `max_retries`.
    RetriesExhausted {
        /// Retries done before this failure (not part of the name: [`parse`](Self::parse)
        /// gives 0).
        retries: u32,
    },
    /// `budget_exhausted`: the retry budget is empty and configured to dead-letter.
    BudgetExhausted,
    /// `forward_unconfigured`: the error is of the forward kind but the policy has no
    /// [`Forward`](crate::Forward) destination.
    ForwardUnconfigured,
    /// `undecodable`: the body (or its headers, cut on receipt) could not be decoded; a poison
    /// pill, dead-lettered at once without calling the handler.
    Undecodable,
    /// `too_large`: the retry or forwarded copy would exceed the broker's message size limit,
    /// now and on every later attempt.
    TooLarge,
    /// `requeue_limit`: the worker gave the message back to its queue `requeue_limit` times,
    /// each time because the broker did not confirm its replacement copy (one of the
    /// [`is_requeue`](Self::is_requeue) reasons); the dead letter's final error names the last.
    RequeueLimit,
    /// `retry_unconfirmed` (requeue): the broker did not confirm the retry copy.
    RetryUnconfirmed,
    /// `sanitize_unconfirmed` (requeue): the broker did not confirm the copy without the
    /// malformed `x-death` header.
    SanitizeUnconfirmed,
    /// `forward_unconfirmed` (requeue): the broker did not confirm the forwarded copy, or
    /// returned it (the destination is gone or does not route it).
    ForwardUnconfirmed,
    /// `dead_letter_unconfirmed` (requeue): the broker did not confirm the annotated dead
    /// letter (`DeadLetterMode::Annotate`).
    DeadLetterUnconfirmed,
    /// `settle_panicked` (requeue): settling the delivery panicked (a bug: please report it);
    /// the message goes back to its queue instead of staying unsettled.
    SettlePanicked,
    /// `early_unconfirmed` (requeue): a native retry came back before its time and the broker
    /// did not confirm the copy that waits out the rest.
    EarlyUnconfirmed,
    /// A permanent error whose reason the handler named
    /// ([`HandlerError::permanent_because`](crate::HandlerError::permanent_because)); the name
    /// is the handler's string.
    Named(&'static str),
}

impl DeadLetterReason {
    /// Every reason redeliver names itself, in declaration order: all but
    /// [`Named`](Self::Named), [`RetriesExhausted`](Self::RetriesExhausted) with `retries: 0`.
    pub const ALL: [DeadLetterReason; 13] = [
        DeadLetterReason::Permanent,
        DeadLetterReason::RetriesExhausted { retries: 0 },
        DeadLetterReason::BudgetExhausted,
        DeadLetterReason::ForwardUnconfigured,
        DeadLetterReason::Undecodable,
        DeadLetterReason::TooLarge,
        DeadLetterReason::RequeueLimit,
        DeadLetterReason::RetryUnconfirmed,
        DeadLetterReason::SanitizeUnconfirmed,
        DeadLetterReason::ForwardUnconfirmed,
        DeadLetterReason::DeadLetterUnconfirmed,
        DeadLetterReason::SettlePanicked,
        DeadLetterReason::EarlyUnconfirmed,
    ];

    /// The stable name (see each variant): the header value and the metrics label. A
    /// [`Named`](Self::Named) reason is the handler's string.
    pub fn as_str(&self) -> &'static str {
        match self {
            DeadLetterReason::Permanent => "permanent",
            DeadLetterReason::RetriesExhausted { .. } => "retries_exhausted",
            DeadLetterReason::BudgetExhausted => "budget_exhausted",
            DeadLetterReason::ForwardUnconfigured => "forward_unconfigured",
            DeadLetterReason::Undecodable => "undecodable",
            DeadLetterReason::TooLarge => "too_large",
            DeadLetterReason::RequeueLimit => "requeue_limit",
            DeadLetterReason::RetryUnconfirmed => "retry_unconfirmed",
            DeadLetterReason::SanitizeUnconfirmed => "sanitize_unconfirmed",
            DeadLetterReason::ForwardUnconfirmed => "forward_unconfirmed",
            DeadLetterReason::DeadLetterUnconfirmed => "dead_letter_unconfirmed",
            DeadLetterReason::SettlePanicked => "settle_panicked",
            DeadLetterReason::EarlyUnconfirmed => "early_unconfirmed",
            DeadLetterReason::Named(reason) => reason,
        }
    }

    /// The reason of [`ALL`](Self::ALL) named `name`, if it is one (`retries_exhausted` gives
    /// `retries: 0`). `None` for anything else, which is not an error when reading a dead
    /// letter: a handler's [`Named`](Self::Named) reason, a later version's reason or another
    /// publisher's text.
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|r| r.as_str() == name)
    }

    /// True for the reasons the worker gives a delivery back to its queue for (the `reason`
    /// label of `redeliver_messages_requeued_total`); they never name a dead letter.
    pub fn is_requeue(&self) -> bool {
        match self {
            DeadLetterReason::RetryUnconfirmed
            | DeadLetterReason::SanitizeUnconfirmed
            | DeadLetterReason::ForwardUnconfirmed
            | DeadLetterReason::DeadLetterUnconfirmed
            | DeadLetterReason::SettlePanicked
            | DeadLetterReason::EarlyUnconfirmed => true,
            DeadLetterReason::Permanent
            | DeadLetterReason::RetriesExhausted { .. }
            | DeadLetterReason::BudgetExhausted
            | DeadLetterReason::ForwardUnconfigured
            | DeadLetterReason::Undecodable
            | DeadLetterReason::TooLarge
            | DeadLetterReason::RequeueLimit
            | DeadLetterReason::Named(_) => false,
        }
    }
}

/// The name, but `retries_exhausted after N retries` for
/// [`RetriesExhausted`](DeadLetterReason::RetriesExhausted).
impl fmt::Display for DeadLetterReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeadLetterReason::RetriesExhausted { retries } => {
                write!(f, "retries_exhausted after {retries} retries")
            }
            other => f.write_str(other.as_str()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::DeadLetterReason as R;

    /// Where each variant sits in [`R::ALL`]. Exhaustive, without a catch-all: a new variant
    /// does not compile until it gets a position here, and the test below fails until it is
    /// in `ALL` at that position.
    fn position(r: R) -> Option<usize> {
        Some(match r {
            R::Permanent => 0,
            R::RetriesExhausted { .. } => 1,
            R::BudgetExhausted => 2,
            R::ForwardUnconfigured => 3,
            R::Undecodable => 4,
            R::TooLarge => 5,
            R::RequeueLimit => 6,
            R::RetryUnconfirmed => 7,
            R::SanitizeUnconfirmed => 8,
            R::ForwardUnconfirmed => 9,
            R::DeadLetterUnconfirmed => 10,
            R::SettlePanicked => 11,
            R::EarlyUnconfirmed => 12,
            R::Named(_) => return None,
        })
    }

    #[test]
    fn every_reason_is_listed_once_in_order() {
        for (i, r) in R::ALL.into_iter().enumerate() {
            assert_eq!(position(r), Some(i), "{r:?}");
        }
        assert_eq!(position(R::Named("x")), None);
    }

    /// The names are on the wire and in dashboards: this list changes only by growing.
    #[test]
    fn names_are_stable() {
        let names: Vec<&str> = R::ALL.iter().map(R::as_str).collect();
        assert_eq!(
            names,
            [
                "permanent",
                "retries_exhausted",
                "budget_exhausted",
                "forward_unconfigured",
                "undecodable",
                "too_large",
                "requeue_limit",
                "retry_unconfirmed",
                "sanitize_unconfirmed",
                "forward_unconfirmed",
                "dead_letter_unconfirmed",
                "settle_panicked",
                "early_unconfirmed",
            ]
        );
    }

    #[test]
    fn every_reason_round_trips_through_its_name() {
        for r in R::ALL {
            assert_eq!(R::parse(r.as_str()), Some(r), "{r:?}");
        }
        // The count is not part of the name.
        let exhausted = R::RetriesExhausted { retries: 5 };
        assert_eq!(
            R::parse(exhausted.as_str()),
            Some(R::RetriesExhausted { retries: 0 })
        );
    }

    #[test]
    fn unknown_and_named_reasons_do_not_parse() {
        for name in ["", "Permanent", "no_message_id", "rejected", " permanent"] {
            assert_eq!(R::parse(name), None, "{name:?}");
        }
        assert_eq!(R::Named("no_message_id").as_str(), "no_message_id");
        // A handler may reuse a known name; it then reads back as that reason.
        assert_eq!(R::parse(R::Named("too_large").as_str()), Some(R::TooLarge));
    }

    #[test]
    fn requeue_reasons_are_the_unconfirmed_ones_and_the_panic() {
        let requeue: Vec<&str> = R::ALL
            .iter()
            .filter(|r| r.is_requeue())
            .map(R::as_str)
            .collect();
        assert_eq!(
            requeue,
            [
                "retry_unconfirmed",
                "sanitize_unconfirmed",
                "forward_unconfirmed",
                "dead_letter_unconfirmed",
                "settle_panicked",
                "early_unconfirmed",
            ]
        );
        assert!(!R::Named("x").is_requeue());
    }

    #[test]
    fn display_adds_the_retry_count() {
        assert_eq!(
            R::RetriesExhausted { retries: 3 }.to_string(),
            "retries_exhausted after 3 retries"
        );
        assert_eq!(R::TooLarge.to_string(), "too_large");
        assert_eq!(R::Named("no_message_id").to_string(), "no_message_id");
    }
}
