//! The errors of routing a delay and of declaring topology, shared by [`crate::DelayConfig`],
//! [`crate::Topology`] and the publisher.

use std::time::Duration;

use crate::delete::QueueMessages;
use crate::names::NameError;

/// Why a delay cannot be routed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DelayError {
    /// The delay exceeds what the levels can express and clamping is off.
    #[error("delay {requested:?} exceeds the maximum delay {max:?} of the delay infrastructure (raise the level count or granularity, or enable clamping)")]
    TooLong {
        /// The requested delay.
        requested: Duration,
        /// [`DelayConfig::max_delay`](crate::DelayConfig::max_delay).
        max: Duration,
    },
    /// The destination queue's name cannot be used as topic words.
    #[error(transparent)]
    InvalidName(#[from] NameError),
    /// Granularity or level count are out of range.
    #[error("invalid delay configuration: {0}")]
    InvalidConfig(DelayConfigError),
}

/// True when the broker answered 404 NOT_FOUND: the queue or exchange an operation named does
/// not exist (a passive declare's answer for "missing"). Anything else, a closed connection
/// included, is false, so it never passes for "missing".
///
/// ```no_run
/// # async fn demo(channel: lapin::Channel) -> Result<(), lapin::Error> {
/// use lapin::options::QueueDeclareOptions;
/// let passive = QueueDeclareOptions { passive: true, ..Default::default() };
/// match channel.queue_declare("orders".into(), passive, Default::default()).await {
///     Ok(q) => println!("{} ready", q.message_count()),
///     Err(e) if redeliver::amqp::is_not_found(&e) => println!("no queue 'orders'"),
///     Err(e) => return Err(e),
/// }
/// # Ok(())
/// # }
/// ```
pub fn is_not_found(e: &lapin::Error) -> bool {
    matches!(e.kind(), lapin::ErrorKind::ProtocolError(a) if a.get_id() == 404)
}

// By hand, not `#[from]`: that would also make the inner error the `source()`, and a chain
// printer would show its text twice.
impl From<DelayConfigError> for DelayError {
    fn from(e: DelayConfigError) -> Self {
        DelayError::InvalidConfig(e)
    }
}

/// What is wrong with a [`DelayConfig`](crate::DelayConfig).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DelayConfigError {
    /// RabbitMQ TTLs are whole milliseconds.
    #[error("granularity {granularity:?} must be a whole number of milliseconds, at least 1 ms")]
    Granularity {
        /// The configured granularity.
        granularity: Duration,
    },
    /// The level count is zero or above the maximum.
    #[error("level count {levels} must be between 1 and {max}")]
    Levels {
        /// The configured level count.
        levels: u8,
        /// The largest level count allowed.
        max: u8,
    },
    /// The top level's TTL exceeds the largest `x-message-ttl` RabbitMQ accepts.
    #[error("the top level's TTL of {ttl_ms} ms exceeds RabbitMQ's maximum of {max_ms} ms; use fewer levels or a finer granularity")]
    TopLevelTtl {
        /// `2^(L-1) * g` in milliseconds.
        ttl_ms: u128,
        /// RabbitMQ's maximum TTL in milliseconds.
        max_ms: u128,
    },
}

/// What declaring, verifying or deleting topology can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TopologyError {
    /// An object exists with other arguments than requested (406 PRECONDITION_FAILED).
    #[error("{object} exists with different arguments{}: the broker said \"{broker_message}\"; requested {requested}", argument.as_ref().map(|a| format!(" (argument '{a}' differs)")).unwrap_or_default())]
    Mismatch {
        /// The object, e.g. `queue 'orders'`.
        object: String,
        /// The differing argument, when the broker's message names it.
        argument: Option<String>,
        /// The arguments we asked for.
        requested: String,
        /// The broker's reply text.
        broker_message: String,
    },
    /// The delay infrastructure of this prefix exists with other settings (level count,
    /// granularity or level queue type) than requested: another deployment on the same prefix
    /// uses other ones, or the configuration changed. Declaring on would bind the level
    /// exchanges twice and duplicate or misroute delayed messages, so nothing was changed. Use
    /// the same settings as the existing infrastructure, or another prefix; to change them,
    /// stop every deployment on the prefix, let the level queues drain, delete the delay
    /// infrastructure and declare again. Not transient: retrying cannot help.
    #[error("the delay infrastructure of prefix '{prefix}' exists with other settings: existing {existing}, requested {requested}; every deployment on one prefix must use the same levels, granularity and level queue type (or another prefix)")]
    DelaySettingsMismatch {
        /// The delay prefix.
        prefix: String,
        /// What exists, as recorded (`levels=24 granularity=10ms queue-type=quorum`) or, for
        /// delay levels declared by an earlier version, as found.
        existing: String,
        /// What was requested ([`DelayConfig::settings`](crate::DelayConfig::settings)).
        requested: String,
    },
    /// An object does not exist (404 NOT_FOUND), e.g. on verify or when binding to a user
    /// exchange that was never declared.
    #[error("{object} does not exist")]
    Missing {
        /// The object, e.g. `queue 'orders'`.
        object: String,
    },
    /// The user lacks the permission (403 ACCESS_REFUSED); with a read/write-only user, use
    /// `verify` instead of `declare`.
    #[error("access refused on {object}: {broker_message}")]
    AccessRefused {
        /// The object, e.g. `queue 'orders'`.
        object: String,
        /// The broker's reply text.
        broker_message: String,
    },
    /// [`DelayConfig::delete_checked`](crate::DelayConfig::delete_checked) with
    /// [`HeldMessages::Refuse`](crate::HeldMessages::Refuse) found delay queues holding
    /// messages (other services' pending retries, whose originals are already acknowledged, or
    /// parked messages). Nothing was deleted, unless messages reached the parking queue while
    /// deleting: then only `already_deleted` was. Wait until the queues are empty, or discard
    /// their messages with [`HeldMessages::Discard`](crate::HeldMessages::Discard).
    #[error(
        "refusing to delete the delay infrastructure of prefix '{prefix}': {} hold messages; {}",
        list_counts(non_empty),
        describe_deleted(already_deleted)
    )]
    DelayNotEmpty {
        /// The delay prefix.
        prefix: String,
        /// The delay queues that hold messages, none of them deleted.
        non_empty: Vec<QueueMessages>,
        /// Empty delay queues deleted before a queue that had meanwhile received messages was
        /// found (only when messages arrived while deleting); nothing else was deleted.
        already_deleted: Vec<String>,
    },
    /// While deleting the delay infrastructure, messages reached a level queue after its
    /// binding was removed; nothing was deleted, but binding `queue` to its exchange again
    /// failed, so retries routed to that level go to the parking queue instead. Declare the
    /// delay infrastructure again.
    #[error("messages arrived in the delay queues while deleting, so nothing was deleted, but binding '{queue}' to its exchange again failed: declare the delay infrastructure again")]
    DelayRestore {
        /// The level queue left without its binding.
        queue: String,
        /// Why binding it failed.
        #[source]
        source: Box<TopologyError>,
    },
    /// A queue or exchange name is unusable.
    #[error(transparent)]
    InvalidName(#[from] NameError),
    /// The delay configuration is invalid.
    #[error(transparent)]
    Delay(#[from] DelayError),
    /// Any other AMQP error (connection lost, ...).
    #[error("AMQP error: {0}")]
    Amqp(#[from] lapin::Error),
}

/// `'q' (2 message(s)), ...`
fn list_counts(v: &[QueueMessages]) -> String {
    v.iter()
        .map(|c| format!("'{}' ({} message(s))", c.queue, c.messages))
        .collect::<Vec<_>>()
        .join(", ")
}

fn describe_deleted(v: &[String]) -> String {
    if v.is_empty() {
        return "nothing was deleted".to_owned();
    }
    format!(
        "messages arrived while deleting: only the empty queues {} were deleted, nothing else",
        v.iter()
            .map(|q| format!("'{q}'"))
            .collect::<Vec<_>>()
            .join(", ")
    )
}
