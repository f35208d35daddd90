//! A memory alarm on the broker blocks every connection that publishes. The worker publishes
//! its retry copies on a connection of its own, so while the alarm lasts successful deliveries
//! keep being acked, retries wait (bounded by the confirm timeout, their originals given back
//! to the queue meanwhile, never dead-lettered for it), readiness and the blocked flag say so;
//! once the alarm clears, the retries go through and every message is accounted for.
//!
//! An alarm stops every publisher of the node, so this runs against a dedicated node
//! (`rdalarm-1@localhost`, AMQP port 5695) started with `scripts/cluster.sh` and removed
//! afterwards.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::BasicProperties;
use redeliver_amqp::{DelayConfig, QueueType, Topology};
use redeliver_core::{HandlerError, Jitter, RetryPolicy};
use redeliver_testkit::nodes::Nodes;
use redeliver_testkit::reliability::report;
use redeliver_testkit::{connect_guarded, queue_depth, unique_prefix, wait_until};
use redeliver_worker::{Context, Raw, Worker};
use tokio_util::sync::CancellationToken;

const OK: usize = 200;
const RETRY: usize = 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_memory_alarm_blocks_retries_but_never_the_acks() {
    let nodes = Nodes::start("rdalarm", 1, 5695, false).await;
    let url = nodes.amqp_url(1);
    let conn = connect_guarded(&url).await;
    let prefix = unique_prefix("alarm-", 8, "-");
    let delay = DelayConfig::new()
        .prefix(format!("{prefix}delay."))
        .levels(4)
        .queue_type(QueueType::Classic);
    let topology = Topology::new("q")
        .prefix(prefix.clone())
        .classic()
        .delay(delay.clone());
    topology.declare(&conn).await.expect("declare");
    let queue = topology.queue_name();

    let ch = conn.create_channel().await.expect("channel");
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirms");
    for id in (0..OK)
        .map(|i| format!("ok-{i}"))
        .chain((0..RETRY).map(|i| format!("retry-{i}")))
    {
        ch.basic_publish(
            "".into(),
            queue.as_str().into(),
            BasicPublishOptions::default(),
            id.as_bytes(),
            BasicProperties::default()
                .with_message_id(id.as_str().into())
                .with_delivery_mode(2),
        )
        .await
        .expect("publish")
        .await
        .expect("confirm");
    }

    // The alarm: no publisher of the node may publish until it clears.
    nodes
        .rabbitmqctl(1, &["set_vm_memory_high_watermark", "0"])
        .await;
    let alarm_at = Instant::now();

    let done: Arc<Mutex<HashMap<String, u32>>> = Arc::default();
    let worker = |done: Arc<Mutex<HashMap<String, u32>>>| {
        Worker::builder(url.clone())
            .topology(topology.clone())
            .connection_name(format!("{prefix}worker"))
            .confirm_timeout(Duration::from_secs(2))
            .requeue_limit(2)
            .policy(
                RetryPolicy::constant(Duration::from_millis(100))
                    .jitter(Jitter::None)
                    .max_retries(5),
            )
            .handler(move |m: Raw, ctx: Context| {
                let done = Arc::clone(&done);
                async move {
                    let id = String::from_utf8_lossy(&m).into_owned();
                    if id.starts_with("retry-") && ctx.attempt() == 0 {
                        return Err(HandlerError::transient("fails once"));
                    }
                    *done.lock().unwrap().entry(id).or_default() += 1;
                    Ok(())
                }
            })
    };
    let finished = |prefix: &str, n: usize| {
        let d = done.lock().unwrap();
        d.keys().filter(|k| k.starts_with(prefix)).count() == n
    };

    // While blocked: every successful delivery is handled and acked, no retry gets through,
    // and the worker says it is blocked.
    let first = worker(Arc::clone(&done)).build().expect("build");
    let status = first.status_handle();
    let token = CancellationToken::new();
    let run = tokio::spawn(first.run(token.clone()));
    wait_until(
        Duration::from_secs(60),
        "the successful deliveries while blocked",
        || finished("ok-", OK),
    )
    .await;
    wait_until(
        Duration::from_secs(30),
        "the worker reports it is blocked",
        || status.is_blocked(),
    )
    .await;
    assert!(!status.is_ready(), "blocked is not ready");
    // Several confirm timeouts: nothing goes to the DLQ because of the alarm.
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert!(
        !finished("retry-", 1),
        "a retry got through a blocked connection"
    );
    // Stopped while still blocked: what was not acked goes back to the queue. Only the
    // retries' originals may be there; had the acks travelled on a blocked connection, the
    // successful deliveries would be back too.
    token.cancel();
    run.await.expect("join").expect("clean stop");
    let ready = queue_depth(&conn, &queue).await.expect("queue").ready;
    assert_eq!(ready as usize, RETRY, "ready after a stop while blocked");
    let dlq = queue_depth(&conn, &topology.dlq_name()).await.expect("dlq");
    assert_eq!(dlq.ready, 0, "dead-lettered because of the alarm");
    report(format!(
        "blocked for {:?}: {OK} acked, {RETRY} retries waiting",
        alarm_at.elapsed()
    ));

    // The alarm clears: the retries go through.
    nodes
        .rabbitmqctl(1, &["set_vm_memory_high_watermark", "0.4"])
        .await;
    let second = worker(Arc::clone(&done)).build().expect("build");
    let status = second.status_handle();
    let token = CancellationToken::new();
    let run = tokio::spawn(second.run(token.clone()));
    wait_until(
        Duration::from_secs(60),
        "the retries after the alarm",
        || finished("retry-", RETRY),
    )
    .await;
    wait_until(Duration::from_secs(10), "unblocked and ready", || {
        !status.is_blocked() && status.is_ready()
    })
    .await;
    token.cancel();
    run.await.expect("join").expect("clean stop");

    let counts = done.lock().unwrap().clone();
    assert_eq!(counts.len(), OK + RETRY, "every message handled");
    let duplicates: u32 = counts.values().map(|n| n - 1).sum();
    report(format!("after the alarm: 0 lost, {duplicates} duplicates"));
    // Only copies already written to the socket when the block began can arrive twice: at most
    // one per retry.
    assert!(duplicates as usize <= RETRY, "{duplicates} duplicates");
    for q in [queue.clone(), topology.dlq_name(), delay.unroutable_name()] {
        let d = queue_depth(&conn, &q).await.expect("queue");
        assert_eq!(d.ready, 0, "{q} not empty");
    }
    topology.delete(&conn).await.expect("delete topology");
    delay.delete(&conn).await.expect("delete delay levels");
}
