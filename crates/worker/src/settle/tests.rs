//! The settling rules, each against a scripted broker.

use std::sync::Mutex;
use std::time::Duration;

use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::BasicProperties;
use redeliver_amqp::headers::{self, RetryState};
use tokio_util::sync::CancellationToken;

use super::*;
use crate::fake::{nacked, returned, too_large, Call, FakeBroker};
use crate::meters::Meters;
use crate::outcome::{Outcome, Settled};
use crate::requeue::RequeueLedger;
use crate::settings::DeadLetterMode;

fn rules(mode: DeadLetterMode) -> Rules {
    Rules {
        queue: "orders".into(),
        dlx: "orders.dlx".into(),
        dlq: "orders.dlq".into(),
        mode,
        requeue_limit: 2,
        connection_name: "test-worker".into(),
        max_delay: Duration::from_secs(60),
        delay_levels: redeliver_amqp::DelayConfig::default(),
        username: "guest".into(),
        retries: Default::default(),
        retry_mode: crate::settings::RetryMode::Levels,
        dead_letters_malformed_x_death: true,
    }
}

/// One settling of a message `m-1` with the given rules.
struct Fixture {
    props: BasicProperties,
    state: RetryState,
    meters: Meters,
    requeues: Mutex<RequeueLedger>,
    hard_stop: CancellationToken,
    rules: Rules,
}

impl Fixture {
    fn new(mode: DeadLetterMode) -> Self {
        Self {
            props: BasicProperties::default()
                .with_message_id("m-1".into())
                .with_expiration("60000".into()),
            state: RetryState::default(),
            meters: Meters::new("orders"),
            requeues: Mutex::default(),
            hard_stop: CancellationToken::new(),
            rules: rules(mode),
        }
    }

    async fn run(&self, broker: &FakeBroker, outcome: Outcome) -> Settled {
        Settle {
            broker,
            rules: &self.rules,
            message: Message {
                properties: &self.props,
                body: b"body",
                exchange: "shop",
                routing_key: "order.created",
                message_id: "m-1",
                state: &self.state,
            },
            meters: &self.meters,
            requeues: &self.requeues,
            hard_stop: &self.hard_stop,
        }
        .run(outcome)
        .await
    }
}

fn retry(delay_ms: u64) -> Outcome {
    Outcome::Retry {
        delay: Duration::from_millis(delay_ms),
        attempt: 1,
        jittered: false,
        error: "timeout".into(),
    }
}

fn dead_letter() -> Outcome {
    Outcome::DeadLetter {
        reason: DeadLetterReason::Permanent,
        error: "bad input".into(),
    }
}

fn header<'a>(h: &'a FieldTable, name: &str) -> Option<&'a AMQPValue> {
    h.inner().get(&ShortString::from(name))
}

#[tokio::test]
async fn success_is_acked_as_a_success() {
    let f = Fixture::new(DeadLetterMode::Reject);
    let b = FakeBroker::new();
    assert_eq!(f.run(&b, Outcome::Ack).await, Settled::Acked);
    assert_eq!(b.calls(), [Call::Ack { success: true }]);
}

#[tokio::test]
async fn confirmed_retry_copy_then_ack() {
    let f = Fixture::new(DeadLetterMode::Reject);
    let b = FakeBroker::new();
    assert_eq!(f.run(&b, retry(250)).await, Settled::Retried);
    assert_eq!(
        b.calls(),
        [
            Call::PublishDelayed {
                queue: "orders".into(),
                delay: Duration::from_millis(250)
            },
            Call::Ack { success: false },
        ]
    );
    let h = b.published_headers();
    assert_eq!(
        header(&h, headers::ATTEMPT),
        Some(&AMQPValue::LongLongInt(1))
    );
    assert!(header(&h, headers::LAST_ERROR).is_some());
}

#[tokio::test]
async fn retry_delay_is_clamped_to_the_levels_maximum() {
    let f = Fixture::new(DeadLetterMode::Reject);
    let b = FakeBroker::new();
    f.run(&b, retry(3_600_000)).await;
    assert_eq!(
        b.calls()[0],
        Call::PublishDelayed {
            queue: "orders".into(),
            delay: Duration::from_secs(60)
        }
    );
}

#[tokio::test]
async fn a_jittered_retry_delay_is_clamped_then_rounded_and_recorded_rounded() {
    let f = Fixture::new(DeadLetterMode::Reject);
    let b = FakeBroker::new();
    let jittered = Outcome::Retry {
        delay: Duration::from_secs(3600),
        attempt: 1,
        jittered: true,
        error: "timeout".into(),
    };
    assert_eq!(f.run(&b, jittered).await, Settled::Retried);
    // 60 s = 6000 ticks = 0b1_0111_0111_0000 (7 hops) -> 0b1_0111_0000_0000 = 5888 ticks.
    let rounded = Duration::from_millis(58_880);
    assert_eq!(
        b.calls()[0],
        Call::PublishDelayed {
            queue: "orders".into(),
            delay: rounded
        }
    );
    let state = RetryState::read(Some(&b.published_headers()));
    assert_eq!(state.delay, Some(rounded));
}

#[tokio::test(start_paused = true)]
async fn nacked_or_returned_copy_requeues_the_original_after_a_pause() {
    for error in [nacked(), returned()] {
        let f = Fixture::new(DeadLetterMode::Reject);
        let b = FakeBroker::answering([Err(error)]);
        let started = tokio::time::Instant::now();
        assert_eq!(f.run(&b, retry(10)).await, Settled::Requeued);
        assert!(started.elapsed() >= REQUEUE_PAUSE);
        assert!(matches!(b.calls()[1], Call::Reject { requeue: true }));
        assert_eq!(b.calls().len(), 2, "never acked: {:?}", b.calls());
    }
}

#[tokio::test(start_paused = true)]
async fn requeues_are_bounded_then_the_message_is_dead_lettered() {
    let f = Fixture::new(DeadLetterMode::Annotate);
    for _ in 0..2 {
        let b = FakeBroker::answering([Err(nacked())]);
        assert_eq!(f.run(&b, retry(10)).await, Settled::Requeued);
    }
    // The third unconfirmed copy is past the limit of 2: rejected to the DLX, whatever the
    // mode, since publishing is what keeps failing.
    let b = FakeBroker::answering([Err(nacked())]);
    assert_eq!(f.run(&b, retry(10)).await, Settled::DeadLettered);
    assert_eq!(b.calls().last(), Some(&Call::Reject { requeue: false }));
    // The count starts over for the message.
    let b = FakeBroker::answering([Err(nacked())]);
    assert_eq!(f.run(&b, retry(10)).await, Settled::Requeued);
}

#[tokio::test(start_paused = true)]
async fn a_confirmed_copy_forgets_earlier_requeues() {
    let f = Fixture::new(DeadLetterMode::Reject);
    for _ in 0..2 {
        let b = FakeBroker::answering([Err(nacked())]);
        f.run(&b, retry(10)).await;
    }
    f.run(&FakeBroker::new(), retry(10)).await;
    let b = FakeBroker::answering([Err(nacked())]);
    assert_eq!(f.run(&b, retry(10)).await, Settled::Requeued);
}

#[tokio::test(start_paused = true)]
async fn requeues_while_the_broker_blocks_publishing_do_not_count() {
    let f = Fixture::new(DeadLetterMode::Reject);
    // Far more than the limit of 2: an alarm never sends a message to the DLQ.
    for _ in 0..6 {
        let b = FakeBroker::answering_copy([Err(CopyError::Blocked(Duration::from_secs(30)))]);
        assert_eq!(f.run(&b, retry(10)).await, Settled::Requeued);
        assert_eq!(b.calls().last(), Some(&Call::Reject { requeue: true }));
    }
    // A confirm timeout outside an alarm counts like a nack.
    for _ in 0..2 {
        let b = FakeBroker::answering_copy([Err(CopyError::Timeout(Duration::from_secs(30)))]);
        assert_eq!(f.run(&b, retry(10)).await, Settled::Requeued);
    }
    let b = FakeBroker::answering_copy([Err(CopyError::Timeout(Duration::from_secs(30)))]);
    assert_eq!(f.run(&b, retry(10)).await, Settled::DeadLettered);
}

#[tokio::test]
async fn too_large_copy_dead_letters_at_once() {
    let f = Fixture::new(DeadLetterMode::Reject);
    let b = FakeBroker::answering([Err(too_large())]);
    assert_eq!(f.run(&b, retry(10)).await, Settled::DeadLettered);
    assert_eq!(b.calls()[1], Call::Reject { requeue: false });
}

#[tokio::test]
async fn channel_gone_before_settling_sends_nothing() {
    for outcome in [Outcome::Ack, retry(10), dead_letter()] {
        for mode in [DeadLetterMode::Reject, DeadLetterMode::Annotate] {
            let f = Fixture::new(mode);
            let b = FakeBroker::new();
            *b.open.lock().unwrap() = false;
            assert_eq!(f.run(&b, outcome.clone()).await, Settled::Failed);
            // A reject on a closed channel is attempted and reports it; nothing else is.
            assert!(
                b.calls().iter().all(|c| matches!(c, Call::Reject { .. })),
                "{:?}",
                b.calls()
            );
        }
    }
}

#[tokio::test]
async fn channel_gone_mid_settle_is_a_failure_not_a_success() {
    let f = Fixture::new(DeadLetterMode::Reject);
    let b = FakeBroker {
        close_after_publish: true,
        ..FakeBroker::new()
    };
    // The copy is confirmed but the original can no longer be acked: the broker redelivers
    // it, so the outcome is a failed settle (a duplicate to come), never "retried".
    assert_eq!(f.run(&b, retry(10)).await, Settled::Failed);
    assert_eq!(b.calls().len(), 1);
}

/// A reject that did not go out (an error, or a channel found closed) is reported as a
/// failed settle and must keep its tag from every later multiple ack: the channel is given
/// back, the tag never released. One that went out releases its tag and keeps the channel.
#[tokio::test]
async fn a_failed_reject_is_reported_and_abandons_the_channel_instead_of_releasing_its_tag() {
    let f = Fixture::new(DeadLetterMode::Reject);
    let failing = FakeBroker {
        reject_result: || {
            Err(lapin::Error::from(lapin::ErrorKind::InvalidChannelState(
                lapin::ChannelState::Closed,
                "reject",
            )))
        },
        ..FakeBroker::new()
    };
    let refused = FakeBroker {
        reject_result: || Ok(false),
        ..FakeBroker::new()
    };
    for b in [&failing, &refused] {
        assert_eq!(f.run(b, dead_letter()).await, Settled::Failed);
        assert_eq!(b.calls(), [Call::Reject { requeue: false }]);
        assert_eq!(*b.released.lock().unwrap(), 0, "the tag stays unsettled");
        assert_eq!(*b.abandoned.lock().unwrap(), ["reject failed"]);
    }
    let ok = FakeBroker::new();
    assert_eq!(f.run(&ok, dead_letter()).await, Settled::DeadLettered);
    assert_eq!(*ok.released.lock().unwrap(), 1);
    assert!(ok.abandoned.lock().unwrap().is_empty());
}

#[tokio::test]
async fn reject_mode_rejects_without_requeue() {
    let f = Fixture::new(DeadLetterMode::Reject);
    let b = FakeBroker::new();
    assert_eq!(f.run(&b, dead_letter()).await, Settled::DeadLettered);
    assert_eq!(b.calls(), [Call::Reject { requeue: false }]);
}

#[tokio::test]
async fn annotate_mode_publishes_to_the_dlx_then_acks() {
    let f = Fixture::new(DeadLetterMode::Annotate);
    let b = FakeBroker::new();
    assert_eq!(f.run(&b, dead_letter()).await, Settled::DeadLettered);
    assert_eq!(
        b.calls(),
        [
            Call::Publish {
                exchange: "orders.dlx".into(),
                routing_key: "orders".into()
            },
            Call::Ack { success: false },
        ]
    );
    let h = b.published_headers();
    assert_eq!(
        header(&h, headers::DEAD_LETTER_REASON),
        Some(&AMQPValue::LongString(
            DeadLetterReason::Permanent.as_str().into()
        ))
    );
    assert_eq!(
        header(&h, headers::DEAD_LETTERED_BY),
        Some(&AMQPValue::LongString("test-worker".into()))
    );
    // The original TTL is kept aside, not applied: a dead letter must not expire.
    assert!(header(&h, headers::ORIGINAL_EXPIRATION).is_some());
    assert_eq!(b.props.lock().unwrap()[0].expiration(), &None);
}

#[tokio::test(start_paused = true)]
async fn annotate_unconfirmed_requeues_and_too_large_falls_back_to_reject() {
    let f = Fixture::new(DeadLetterMode::Annotate);
    let b = FakeBroker::answering([Err(returned())]);
    assert_eq!(f.run(&b, dead_letter()).await, Settled::Requeued);
    assert_eq!(b.calls()[1], Call::Reject { requeue: true });

    let b = FakeBroker::answering([Err(too_large())]);
    assert_eq!(f.run(&b, dead_letter()).await, Settled::DeadLettered);
    assert_eq!(b.calls()[1], Call::Reject { requeue: false });
}

#[tokio::test]
async fn sanitize_republishes_to_the_queue_then_acks() {
    let f = Fixture::new(DeadLetterMode::Reject);
    let b = FakeBroker::new();
    let mut repaired = FieldTable::default();
    repaired.insert("tenant".into(), AMQPValue::LongString("acme".into()));
    assert_eq!(
        f.run(&b, Outcome::Sanitize(repaired.clone())).await,
        Settled::Sanitized
    );
    assert_eq!(
        b.calls(),
        [
            Call::Publish {
                exchange: "".into(),
                routing_key: "orders".into()
            },
            Call::Ack { success: false },
        ]
    );
    assert_eq!(b.published_headers(), repaired);
}

#[tokio::test(start_paused = true)]
async fn unconfirmed_sanitized_copy_is_never_dead_lettered_where_that_crashes_the_broker() {
    let mut f = Fixture::new(DeadLetterMode::Reject);
    f.rules.dead_letters_malformed_x_death = false;
    for _ in 0..5 {
        let b = FakeBroker::answering([Err(nacked())]);
        assert_eq!(
            f.run(&b, Outcome::Sanitize(FieldTable::default())).await,
            Settled::Requeued
        );
    }
}

#[tokio::test]
async fn abandoned_is_left_to_the_broker() {
    let f = Fixture::new(DeadLetterMode::Reject);
    let b = FakeBroker::new();
    assert_eq!(f.run(&b, Outcome::Abandon).await, Settled::Abandoned);
    assert!(b.calls().is_empty());
}

fn forward() -> Outcome {
    Outcome::Forward {
        to: redeliver_core::Forward::to_queue("orders.heavy"),
        reason: "timeout",
        attempts: 2,
        error: "handler timed out after 30s".into(),
    }
}

#[tokio::test]
async fn forward_publishes_to_the_destination_then_acks() {
    let f = Fixture::new(DeadLetterMode::Reject);
    let b = FakeBroker::new();
    assert_eq!(f.run(&b, forward()).await, Settled::Forwarded);
    assert_eq!(
        b.calls(),
        [
            Call::Publish {
                exchange: "".into(),
                routing_key: "orders.heavy".into()
            },
            Call::Ack { success: false },
        ]
    );
    let h = b.published_headers();
    assert_eq!(
        header(&h, headers::FORWARDED_FROM),
        Some(&AMQPValue::LongString("orders".into()))
    );
}

#[tokio::test(start_paused = true)]
async fn an_unroutable_forward_requeues_and_a_too_large_one_dead_letters() {
    let f = Fixture::new(DeadLetterMode::Reject);
    let b = FakeBroker::answering([Err(returned())]);
    assert_eq!(f.run(&b, forward()).await, Settled::Requeued);
    assert_eq!(b.calls()[1], Call::Reject { requeue: true });

    let b = FakeBroker::answering([Err(too_large())]);
    assert_eq!(f.run(&b, forward()).await, Settled::DeadLettered);
    assert_eq!(b.calls()[1], Call::Reject { requeue: false });
}
