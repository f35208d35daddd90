//! Every end of a delivery, from the handler's call to the broker's answer, against a scripted
//! broker: the list in the crate docs ("Every end of a delivery") is this file's.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use lapin::message::Delivery;
use lapin::types::{AMQPValue, FieldArray, FieldTable, ShortString};
use lapin::BasicProperties;
use redeliver_amqp::headers::{self, ForwardInfo, RetryState};
use redeliver_amqp::DelayConfig;
use redeliver_core::{Classifier, Forward, HandlerError, Jitter, RetryPolicy, TimedOut};

use super::{start, Deliveries};
use crate::broker::CopyError;
use crate::fake::{nacked, Call, FakeBroker, FakeLink};
use crate::handler::{Json, Raw};
use crate::settings::DeadLetterMode;
use crate::settle::{Rules, REQUEUE_PAUSE};
use crate::shared::Shared;
use crate::{Context, Worker, WorkerBuilder};

const QUEUE: &str = "orders";

#[derive(serde::Deserialize)]
struct Order {
    #[allow(dead_code)]
    id: u32,
}

fn policy() -> RetryPolicy {
    RetryPolicy::exponential(Duration::from_millis(100))
        .jitter(Jitter::None)
        .max_retries(3)
}

fn builder() -> WorkerBuilder {
    Worker::builder("amqp://guest:guest@127.0.0.1:5672/%2f")
        .queue(QUEUE)
        .policy(policy())
}

fn rules(mode: DeadLetterMode) -> Rules {
    Rules {
        queue: QUEUE.into(),
        dlx: "orders.dlx".into(),
        dlq: "orders.dlq".into(),
        mode,
        requeue_limit: 2,
        connection_name: "test-worker".into(),
        max_delay: Duration::from_secs(3600),
        delay_levels: DelayConfig::default(),
        username: "guest".into(),
        retries: Default::default(),
        retry_mode: crate::settings::RetryMode::Levels,
        dead_letters_malformed_x_death: true,
    }
}

/// A worker built from `builder` and a session on a scripted broker: what a run would make.
struct Harness {
    worker: Arc<Shared>,
    session: Arc<Deliveries<FakeLink>>,
}

impl Harness {
    fn new(builder: WorkerBuilder, mode: DeadLetterMode, broker: FakeBroker) -> Self {
        let worker = builder.build().expect("valid test settings").shared();
        Self::on(worker, mode, broker)
    }

    /// A new session of `worker` (its requeue ledger and tokens kept) on `broker`.
    fn on(worker: Arc<Shared>, mode: DeadLetterMode, broker: FakeBroker) -> Self {
        let session = Arc::new(Deliveries::new(
            FakeLink(broker),
            rules(mode),
            crate::meters::Meters::new(QUEUE),
        ));
        Self { worker, session }
    }

    fn broker(&self) -> &FakeBroker {
        &self.session.link.0
    }

    /// Hands `delivery` to the worker and waits until it is settled (or left unsettled).
    async fn deliver(&self, delivery: Delivery) {
        let permit = self
            .worker
            .permits
            .try_take()
            .expect("a free concurrency permit");
        start(&self.worker, &self.session, delivery, permit);
        self.worker.tracker.close();
        self.worker.tracker.wait().await;
        self.worker.tracker.reopen();
    }
}

fn delivery(body: &[u8], headers: FieldTable) -> Delivery {
    let mut d = Delivery::mock(
        1,
        "shop".into(),
        "order.created".into(),
        false,
        body.to_vec(),
    );
    d.properties = BasicProperties::default()
        .with_message_id("m-1".into())
        .with_headers(headers);
    d
}

fn order() -> Delivery {
    delivery(br#"{"id": 7}"#, FieldTable::default())
}

fn published_retry_state(b: &FakeBroker) -> RetryState {
    RetryState::read(Some(&b.published_headers()))
}

fn text(h: &FieldTable, name: &str) -> Option<String> {
    match h.inner().get(&ShortString::from(name)) {
        Some(AMQPValue::LongString(s)) => Some(String::from_utf8_lossy(s.as_bytes()).into()),
        _ => None,
    }
}

async fn ok(_: Raw, _: Context) -> Result<(), HandlerError> {
    Ok(())
}

#[tokio::test]
async fn success_acks() {
    let h = Harness::new(
        builder().handler(|_: Json<Order>, _| async { Ok(()) }),
        DeadLetterMode::Reject,
        FakeBroker::new(),
    );
    h.deliver(order()).await;
    assert_eq!(h.broker().calls(), [Call::Ack { success: true }]);
}

#[tokio::test]
async fn transient_error_publishes_a_retry_copy_then_acks() {
    let h = Harness::new(
        builder().handler(|_: Raw, _| async { Err(HandlerError::transient("503")) }),
        DeadLetterMode::Reject,
        FakeBroker::new(),
    );
    h.deliver(order()).await;
    assert_eq!(
        h.broker().calls(),
        [
            Call::PublishDelayed {
                queue: QUEUE.into(),
                delay: Duration::from_millis(100)
            },
            Call::Ack { success: false },
        ]
    );
    let state = published_retry_state(h.broker());
    assert_eq!(state.attempt, 1);
    assert_eq!(state.last_error.as_deref(), Some("503"));
    assert_eq!(state.original_exchange.as_deref(), Some("shop"));
}

#[tokio::test]
async fn retry_after_uses_the_handlers_delay() {
    let h = Harness::new(
        builder().handler(|_: Raw, _| async {
            Err(HandlerError::retry_after(
                Duration::from_secs(7),
                "rate limited",
            ))
        }),
        DeadLetterMode::Reject,
        FakeBroker::new(),
    );
    h.deliver(order()).await;
    assert_eq!(
        h.broker().calls()[0],
        Call::PublishDelayed {
            queue: QUEUE.into(),
            delay: Duration::from_secs(7)
        }
    );
}

/// Hops of a delay through the test rules' delay levels (10 ms ticks).
fn hops(delay: Duration) -> u32 {
    DelayConfig::default()
        .route(QUEUE, delay)
        .expect("a routable delay")
        .ticks
        .count_ones()
}

/// 37.23 s = 3723 ticks of 10 ms = 0b1110_1000_1011: 7 hops when exact.
const SEVEN_HOPS: Duration = Duration::from_millis(37_230);

/// The delay of each retry copy published so far.
fn published_delays(b: &FakeBroker) -> Vec<Duration> {
    b.calls()
        .into_iter()
        .filter_map(|c| match c {
            Call::PublishDelayed { delay, .. } => Some(delay),
            _ => None,
        })
        .collect()
}

#[tokio::test]
async fn a_jittered_retry_is_published_in_at_most_four_hops() {
    // Full jitter over 0-40 s: 12-bit tick counts, 6 bits set on average.
    let jittered = || {
        RetryPolicy::exponential(Duration::from_secs(40))
            .cap(Duration::from_secs(60))
            .jitter(Jitter::Full)
            .max_retries(3)
            .seed(38)
    };
    // Same seed: the draws the worker makes, one per delivery.
    let twin = jittered();
    let h = Harness::new(
        builder()
            .policy(jittered())
            .handler(|_: Raw, _| async { Err(HandlerError::transient("503")) }),
        DeadLetterMode::Reject,
        FakeBroker::new(),
    );
    let levels = DelayConfig::default();
    let mut rounded = 0;
    for _ in 0..100 {
        h.deliver(order()).await;
        let exact = twin.delay_for(0, None);
        let published = *published_delays(h.broker()).last().expect("a retry copy");
        assert_eq!(published, levels.round_jittered(exact), "drawn {exact:?}");
        assert!(
            hops(published) <= 4,
            "{published:?}: {} hops",
            hops(published)
        );
        // The copy records the rounded delay: the next decision's prev_delay.
        assert_eq!(published_retry_state(h.broker()).delay, Some(published));
        rounded += usize::from(hops(exact) > 4);
    }
    assert!(
        rounded > 30,
        "only {rounded} of 100 draws had more than 4 hops"
    );
}

#[tokio::test]
async fn retry_after_and_unjittered_delays_stay_exact() {
    let full = policy().jitter(Jitter::Full);
    let h = Harness::new(
        builder().policy(full).handler(|_: Raw, _| async {
            Err(HandlerError::retry_after(SEVEN_HOPS, "rate limited"))
        }),
        DeadLetterMode::Reject,
        FakeBroker::new(),
    );
    h.deliver(order()).await;
    assert_eq!(published_delays(h.broker()), [SEVEN_HOPS]);
    assert_eq!(hops(SEVEN_HOPS), 7);
    assert_eq!(published_retry_state(h.broker()).delay, Some(SEVEN_HOPS));

    let h = Harness::new(
        builder()
            .policy(RetryPolicy::constant(SEVEN_HOPS).jitter(Jitter::None))
            .handler(|_: Raw, _| async { Err(HandlerError::transient("503")) }),
        DeadLetterMode::Reject,
        FakeBroker::new(),
    );
    h.deliver(order()).await;
    assert_eq!(published_delays(h.broker()), [SEVEN_HOPS]);
}

#[tokio::test]
async fn permanent_error_is_rejected_to_the_dlx_in_reject_mode() {
    let h = Harness::new(
        builder().handler(|_: Raw, _| async { Err(HandlerError::permanent("bad order")) }),
        DeadLetterMode::Reject,
        FakeBroker::new(),
    );
    h.deliver(order()).await;
    assert_eq!(h.broker().calls(), [Call::Reject { requeue: false }]);
}

#[tokio::test]
async fn retries_exhausted_are_published_annotated_in_annotate_mode() {
    let h = Harness::new(
        builder().handler(|_: Raw, _| async { Err(HandlerError::transient("still down")) }),
        DeadLetterMode::Annotate,
        FakeBroker::new(),
    );
    let mut exhausted = FieldTable::default();
    exhausted.insert(headers::ATTEMPT.into(), AMQPValue::LongLongInt(3));
    h.deliver(delivery(b"{}", exhausted)).await;
    assert_eq!(
        h.broker().calls(),
        [
            Call::Publish {
                exchange: "orders.dlx".into(),
                routing_key: QUEUE.into()
            },
            Call::Ack { success: false },
        ]
    );
    let published = h.broker().published_headers();
    assert_eq!(
        text(&published, headers::DEAD_LETTER_REASON).as_deref(),
        Some("retries_exhausted")
    );
    assert_eq!(
        text(&published, headers::DEAD_LETTER_ERROR).as_deref(),
        Some("still down")
    );
}

#[tokio::test]
async fn a_body_that_does_not_decode_is_dead_lettered_without_calling_the_handler() {
    let calls = Arc::new(AtomicU32::new(0));
    let seen = Arc::clone(&calls);
    let h = Harness::new(
        builder().handler(move |_: Json<Order>, _| {
            seen.fetch_add(1, Ordering::SeqCst);
            async { Ok(()) }
        }),
        DeadLetterMode::Reject,
        FakeBroker::new(),
    );
    h.deliver(delivery(b"not json", FieldTable::default()))
        .await;
    assert_eq!(h.broker().calls(), [Call::Reject { requeue: false }]);
    assert_eq!(calls.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn headers_cut_on_receipt_are_dead_lettered_without_calling_the_handler() {
    let h = Harness::new(
        builder().handler(|_: Raw, _| async { panic!("the handler must not run") }),
        DeadLetterMode::Annotate,
        FakeBroker::new(),
    );
    let mut cut = FieldTable::default();
    cut.insert(
        redeliver_amqp::HEADERS_REMOVED.into(),
        AMQPValue::LongString("nested too deep".into()),
    );
    h.deliver(delivery(b"{}", cut)).await;
    let published = h.broker().published_headers();
    assert_eq!(
        text(&published, headers::DEAD_LETTER_REASON).as_deref(),
        Some("undecodable")
    );
}

#[tokio::test]
async fn a_handler_panic_is_a_transient_error_with_its_message() {
    let h = Harness::new(
        builder().handler(|_: Raw, _| async { panic!("index out of bounds") }),
        DeadLetterMode::Reject,
        FakeBroker::new(),
    );
    h.deliver(order()).await;
    assert!(matches!(h.broker().calls()[0], Call::PublishDelayed { .. }));
    let error = published_retry_state(h.broker()).last_error;
    assert!(
        error
            .as_deref()
            .is_some_and(|e| e.contains("panicked: index out of bounds")),
        "{error:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_handler_past_its_time_limit_is_retried() {
    let h = Harness::new(
        builder()
            .handler_timeout(Duration::from_secs(30))
            .handler(|_: Raw, _| async {
                tokio::time::sleep(Duration::from_secs(3600)).await;
                Ok(())
            }),
        DeadLetterMode::Reject,
        FakeBroker::new(),
    );
    h.deliver(order()).await;
    assert!(matches!(h.broker().calls()[0], Call::PublishDelayed { .. }));
    let error = published_retry_state(h.broker()).last_error;
    assert_eq!(error.as_deref(), Some("handler timed out after 30s"));
}

#[tokio::test(start_paused = true)]
async fn a_timeout_the_policy_forwards_goes_to_the_other_queue_then_acks() {
    let forwarding = policy()
        .classifier(Classifier::default().forward_on::<TimedOut>())
        .forward(Forward::to_queue("orders.heavy").after_attempts(2));
    let h = Harness::new(
        builder()
            .policy(forwarding)
            .handler_timeout(Duration::from_secs(30))
            .handler(|_: Raw, _| async {
                tokio::time::sleep(Duration::from_secs(3600)).await;
                Ok(())
            }),
        DeadLetterMode::Reject,
        FakeBroker::new(),
    );
    // The first timeout is retried here; the second (attempt 2) is forwarded.
    h.deliver(order()).await;
    assert!(matches!(h.broker().calls()[0], Call::PublishDelayed { .. }));
    let mut second = FieldTable::default();
    second.insert(headers::ATTEMPT.into(), AMQPValue::LongLongInt(1));
    second.insert("tenant".into(), AMQPValue::LongString("acme".into()));
    let h = Harness::on(h.worker, DeadLetterMode::Reject, FakeBroker::new());
    h.deliver(delivery(b"{}", second)).await;
    assert_eq!(
        h.broker().calls(),
        [
            Call::Publish {
                exchange: "".into(),
                routing_key: "orders.heavy".into()
            },
            Call::Ack { success: false },
        ]
    );
    let published = h.broker().published_headers();
    let info = ForwardInfo::read(Some(&published)).expect("forward headers");
    assert_eq!(info.from, QUEUE);
    assert_eq!(info.reason, "timeout");
    assert_eq!(info.attempts, Some(2));
    assert_eq!(info.by.as_deref(), Some("test-worker"));
    assert!(info.error.is_some_and(|e| e.contains("timed out")));
    assert_eq!(text(&published, "tenant").as_deref(), Some("acme"));
    // The destination starts the message's retries afresh.
    assert_eq!(RetryState::read(Some(&published)).attempt, 0);
}

#[tokio::test]
async fn a_forward_the_handler_asks_for_without_a_destination_is_dead_lettered() {
    let h = Harness::new(
        builder().handler(|_: Raw, _| async { Err(HandlerError::forward("needs a GPU")) }),
        DeadLetterMode::Annotate,
        FakeBroker::new(),
    );
    h.deliver(order()).await;
    let published = h.broker().published_headers();
    assert_eq!(
        text(&published, headers::DEAD_LETTER_REASON).as_deref(),
        Some("forward_unconfigured")
    );
}

#[tokio::test(start_paused = true)]
async fn the_hard_stop_leaves_a_running_handler_unsettled() {
    let h = Harness::new(
        builder().handler(|_: Raw, _| async {
            tokio::time::sleep(Duration::from_secs(3600)).await;
            Ok(())
        }),
        DeadLetterMode::Reject,
        FakeBroker::new(),
    );
    let stop = h.worker.hard_stop.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(1)).await;
        stop.cancel();
    });
    h.deliver(order()).await;
    assert!(h.broker().calls().is_empty(), "{:?}", h.broker().calls());
}

#[tokio::test(start_paused = true)]
async fn a_panic_while_settling_requeues_the_message() {
    let broker = FakeBroker::new();
    broker.panic_on_publish.store(true, Ordering::SeqCst);
    let h = Harness::new(
        builder().handler(|_: Raw, _| async { Err(HandlerError::transient("503")) }),
        DeadLetterMode::Reject,
        broker,
    );
    let started = tokio::time::Instant::now();
    h.deliver(order()).await;
    assert_eq!(
        h.broker().calls(),
        [
            Call::PublishDelayed {
                queue: QUEUE.into(),
                delay: Duration::from_millis(100)
            },
            Call::Reject { requeue: true },
        ]
    );
    assert!(started.elapsed() >= REQUEUE_PAUSE);
}

#[tokio::test(start_paused = true)]
async fn an_unconfirmed_retry_copy_requeues_the_original() {
    let h = Harness::new(
        builder().handler(|_: Raw, _| async { Err(HandlerError::transient("503")) }),
        DeadLetterMode::Reject,
        FakeBroker::answering([Err(nacked())]),
    );
    h.deliver(order()).await;
    assert_eq!(
        h.broker().calls().last(),
        Some(&Call::Reject { requeue: true })
    );
    assert_eq!(h.broker().calls().len(), 2, "never acked");
}

#[tokio::test(start_paused = true)]
async fn requeues_while_publishing_is_blocked_never_reach_the_limit() {
    let builder = builder().handler(|_: Raw, _| async { Err(HandlerError::transient("503")) });
    let worker = builder.build().expect("valid test settings").shared();
    for _ in 0..5 {
        let blocked =
            FakeBroker::answering_copy([Err(CopyError::Blocked(Duration::from_secs(30)))]);
        let h = Harness::on(Arc::clone(&worker), DeadLetterMode::Reject, blocked);
        h.deliver(order()).await;
        assert_eq!(
            h.broker().calls().last(),
            Some(&Call::Reject { requeue: true })
        );
    }
}

#[tokio::test(start_paused = true)]
async fn past_the_requeue_limit_the_message_is_dead_lettered() {
    let builder = builder().handler(|_: Raw, _| async { Err(HandlerError::transient("503")) });
    let worker = builder.build().expect("valid test settings").shared();
    let mut last = Vec::new();
    // The limit is 2: the third unconfirmed copy in a row ends in the DLQ.
    for _ in 0..3 {
        let nacking = FakeBroker::answering([Err(nacked())]);
        let h = Harness::on(Arc::clone(&worker), DeadLetterMode::Reject, nacking);
        h.deliver(order()).await;
        last = h.broker().calls();
    }
    assert_eq!(last.last(), Some(&Call::Reject { requeue: false }));
}

#[tokio::test]
async fn a_malformed_x_death_is_sanitized_before_the_handler_runs() {
    let h = Harness::new(
        builder().handler(|_: Raw, _| async { panic!("the handler must not run") }),
        DeadLetterMode::Reject,
        FakeBroker::new(),
    );
    let mut bad = FieldTable::default();
    bad.insert(
        headers::X_DEATH.into(),
        AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::LongLongInt(7)])),
    );
    h.deliver(delivery(b"{}", bad)).await;
    assert_eq!(
        h.broker().calls(),
        [
            Call::Publish {
                exchange: "".into(),
                routing_key: QUEUE.into()
            },
            Call::Ack { success: false },
        ]
    );
    assert!(h
        .broker()
        .published_headers()
        .contains_key(headers::SANITIZED));
}

#[tokio::test]
async fn a_closed_channel_settles_nothing() {
    let broker = FakeBroker::new();
    *broker.open.lock().expect("not poisoned") = false;
    let h = Harness::new(builder().handler(ok), DeadLetterMode::Reject, broker);
    h.deliver(order()).await;
    assert!(h.broker().calls().is_empty());
}

/// The same rules over a broker whose queue holds retries (native mode): a retry is a
/// `modified` with the delivery time and the new retry state, no copy; a dead letter carries
/// the reason, whatever the dead-letter mode.
#[tokio::test]
async fn natively_a_retry_is_held_by_the_queue_with_its_state() {
    let h = Harness::new(
        builder().handler(|_: Raw, _| async { Err(HandlerError::transient("503")) }),
        DeadLetterMode::Reject,
        FakeBroker::native(),
    );
    let before = crate::settle::now_ms();
    h.deliver(order()).await;
    let calls = h.broker().calls();
    let [Call::Hold { until_ms, state }] = &calls[..] else {
        panic!("one hold, no copy, no ack: {calls:?}");
    };
    assert!(*until_ms >= before + 100 && *until_ms <= crate::settle::now_ms() + 100);
    assert_eq!(state.attempt, 1);
    assert_eq!(state.last_error.as_deref(), Some("503"));
    assert_eq!(state.not_before_ms, Some(*until_ms));
    assert_eq!(state.original_exchange.as_deref(), Some("shop"));
}

#[tokio::test]
async fn natively_a_dead_letter_carries_its_reason_in_either_mode() {
    for mode in [DeadLetterMode::Reject, DeadLetterMode::Annotate] {
        let h = Harness::new(
            builder().handler(|_: Raw, _| async { Err(HandlerError::permanent("bad order")) }),
            mode,
            FakeBroker::native(),
        );
        h.deliver(order()).await;
        let calls = h.broker().calls();
        let [Call::DeadLetter { info }] = &calls[..] else {
            panic!("one native dead letter, no copy: {calls:?}");
        };
        assert_eq!(info.reason, "permanent");
        assert_eq!(info.error.as_deref(), Some("bad order"));
        assert_eq!(info.attempts, Some(1));
        assert_eq!(info.by.as_deref(), Some("test-worker"));
    }
}

/// A retry that arrives before its earliest time (the broker ignored the delivery time) never
/// reaches the handler: the rest of its time goes to the delay levels, and later retries too.
#[tokio::test]
async fn an_early_retry_waits_in_the_levels_and_later_retries_follow() {
    let h = Harness::new(
        builder().handler(|_: Raw, _| async { panic!("the handler ran early") }),
        DeadLetterMode::Reject,
        FakeBroker::native(),
    );
    let mut early = FieldTable::default();
    early.insert(headers::ATTEMPT.into(), AMQPValue::LongLongInt(1));
    early.insert(
        headers::NOT_BEFORE.into(),
        AMQPValue::LongLongInt((crate::settle::now_ms() + 30_000) as i64),
    );
    h.deliver(delivery(b"{}", early)).await;
    let calls = h.broker().calls();
    let [Call::PublishDelayed { queue, delay }, Call::Ack { success: false }] = &calls[..] else {
        panic!("the rest in the levels, then the original settled: {calls:?}");
    };
    assert_eq!(queue, QUEUE);
    assert!(*delay > Duration::from_secs(29) && *delay <= Duration::from_secs(30));
    let copy = published_retry_state(h.broker());
    assert_eq!(copy.attempt, 1, "the retry state is unchanged");
    assert!(h.session.rules.retries.ignored());
    // A fresh failure (the handler's panic is a transient error) now goes to the levels.
    h.deliver(order()).await;
    let calls = h.broker().calls();
    assert!(
        matches!(
            calls[2..],
            [Call::PublishDelayed { .. }, Call::Ack { success: false }]
        ),
        "{calls:?}"
    );
}
