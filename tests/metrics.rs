//! `/metrics` scraped after a run shows exactly what happened: k good messages, m that always
//! fail (retried then dead-lettered), q permanent failures and p malformed bodies.
//!
//! One test in this file on purpose: the Prometheus recorder is process-wide, and every
//! integration test file is a process of its own. The assertions are also queue-label specific.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use redeliver::lapin::BasicProperties;
use redeliver::worker::health::{self, Health};
use redeliver::worker::metrics_names as m;
use redeliver::{
    CancellationToken, Context, DeadLetterReason, DelayConfig, HandlerError, Json, Publisher,
    QueueType, RetryPolicy, Topology, Worker,
};
use redeliver_testkit::http::{get as http_get, parse_prometheus, sample};
use redeliver_testkit::mgmt::{blocking as mgmt, leftovers};
use redeliver_testkit::{amqp_url, connect, ready_count, unique_prefix, Cleanup};

#[derive(serde::Deserialize)]
struct Msg {
    kind: String,
}

const GOOD: u32 = 6;
const FAILING: u32 = 3;
const PERMANENT: u32 = 2;
const POISON: u32 = 2;
const RETRIES: u32 = 2;

#[tokio::test]
async fn metrics_endpoint_counts_what_happened() {
    let prefix = unique_prefix("rdt-metrics-", 8, ".");
    let _cleanup = Cleanup(prefix.clone());
    let conn = connect().await;
    let delay = DelayConfig::new()
        .prefix(prefix.clone())
        .levels(4)
        .queue_type(QueueType::Classic);
    let topology = Topology::new("metered")
        .prefix(prefix.clone())
        .delay(delay.clone());
    let queue = topology.queue_name();

    let handle = health::install_prometheus().expect("install the Prometheus recorder");
    // Idempotent: a second call hands back the same recorder.
    health::install_prometheus().expect("second install");

    let calls = Arc::new(AtomicU32::new(0));
    let counted = calls.clone();
    let builder = Worker::builder(amqp_url())
        .topology(topology.clone())
        .policy(RetryPolicy::constant(Duration::from_millis(20)).max_retries(RETRIES))
        .concurrency(8)
        .handler(move |msg: Json<Msg>, _c: Context| {
            let counted = counted.clone();
            async move {
                counted.fetch_add(1, Ordering::SeqCst);
                match msg.kind.as_str() {
                    "good" => Ok(()),
                    "permanent" => Err(HandlerError::permanent("invalid image")),
                    _ => Err(HandlerError::transient("image server unreachable")),
                }
            }
        });
    let worker = builder.build().expect("build");
    let mut status = worker.status_handle();
    let token = CancellationToken::new();
    let server = Health::new()
        .worker(worker.status_handle())
        .metrics(handle)
        .bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = server.local_addr();
    let http = server.spawn(token.clone());
    let worker_token = CancellationToken::new();
    let worker = tokio::spawn(worker.run(worker_token.clone()));
    status
        .wait_for_timeout(Duration::from_secs(30), |s| {
            *s == redeliver::WorkerState::Consuming
        })
        .await
        .expect("the worker consumes");

    let publisher = Publisher::new(&conn, delay.clone())
        .await
        .expect("publisher");
    let mut bodies: Vec<Vec<u8>> = Vec::new();
    bodies.extend((0..GOOD).map(|_| br#"{"kind":"good"}"#.to_vec()));
    bodies.extend((0..FAILING).map(|_| br#"{"kind":"flaky"}"#.to_vec()));
    bodies.extend((0..PERMANENT).map(|_| br#"{"kind":"permanent"}"#.to_vec()));
    bodies.extend((0..POISON).map(|_| b"{not json".to_vec()));
    for body in &bodies {
        publisher
            .publish_bytes("", &queue, body, BasicProperties::default())
            .await
            .expect("publish");
    }

    let q = queue.as_str();
    let received = GOOD + FAILING * (1 + RETRIES) + PERMANENT + POISON;
    let handler_calls = GOOD + FAILING * (1 + RETRIES) + PERMANENT;
    let dead = FAILING + PERMANENT + POISON;

    // Wait until everything has ended (DLQ and success counter), then check every number.
    let start = Instant::now();
    loop {
        let text = http_get(addr, "/metrics").await.1;
        let s = parse_prometheus(&text);
        let ok = sample(&s, m::MESSAGES_SUCCEEDED, &[("queue", q)]) == Some(f64::from(GOOD));
        let in_dlq = ready_count(&conn, &topology.dlq_name()).await;
        if ok && in_dlq == dead {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "not finished after 30 s: {in_dlq} in the DLQ, metrics:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Settled, not just counted: give late increments a moment to show if there were any.
    tokio::time::sleep(Duration::from_millis(300)).await;

    let (code, text) = http_get(addr, "/metrics").await;
    assert_eq!(code, 200);
    let s = parse_prometheus(&text);
    let get = |name: &str, labels: &[(&str, &str)]| sample(&s, name, labels).unwrap_or(0.0);
    let n = f64::from;

    assert_eq!(
        get(m::MESSAGES_RECEIVED, &[("queue", q)]),
        n(received),
        "{text}"
    );
    assert_eq!(
        get(m::MESSAGES_SUCCEEDED, &[("queue", q)]),
        n(GOOD),
        "{text}"
    );
    for attempt in 1..=RETRIES {
        let a = attempt.to_string();
        assert_eq!(
            get(m::MESSAGES_RETRIED, &[("queue", q), ("attempt", &a)]),
            n(FAILING),
            "retries with attempt {a}: {text}"
        );
    }
    let a = (RETRIES + 1).to_string();
    assert_eq!(
        sample(&s, m::MESSAGES_RETRIED, &[("queue", q), ("attempt", &a)]),
        None,
        "no retry beyond max_retries: {text}"
    );
    for (reason, count) in [
        (DeadLetterReason::RetriesExhausted { retries: 0 }, FAILING),
        (DeadLetterReason::Permanent, PERMANENT),
        (DeadLetterReason::Undecodable, POISON),
    ] {
        let reason = reason.as_str();
        assert_eq!(
            get(
                m::MESSAGES_DEAD_LETTERED,
                &[("queue", q), ("reason", reason)]
            ),
            n(count),
            "dead-lettered ({reason}): {text}"
        );
    }
    assert_eq!(get(m::SETTLE_FAILURES, &[("queue", q)]), 0.0, "{text}");
    // Decoding is excluded from the histogram: undecodable bodies never reach the handler.
    let hist = format!("{}_count", m::HANDLER_DURATION);
    assert_eq!(get(&hist, &[("queue", q)]), n(handler_calls), "{text}");
    assert_eq!(calls.load(Ordering::SeqCst), handler_calls);
    let inf = format!("{}_bucket", m::HANDLER_DURATION);
    assert_eq!(
        get(&inf, &[("queue", q), ("le", "+Inf")]),
        n(handler_calls),
        "{text}"
    );
    assert!(
        text.contains(&format!("# TYPE {} histogram", m::HANDLER_DURATION)),
        "{text}"
    );
    assert!(
        text.contains(&format!("# HELP {}", m::MESSAGES_RECEIVED)),
        "{text}"
    );
    assert_eq!(get(m::HANDLERS_IN_FLIGHT, &[("queue", q)]), 0.0, "{text}");
    assert_eq!(
        get(m::CONNECTION_STATE, &[("queue", q), ("state", "consuming")]),
        1.0,
        "consuming: {text}"
    );
    assert_eq!(
        get(
            m::CONNECTION_STATE,
            &[("queue", q), ("state", "reconnecting")]
        ),
        0.0,
        "{text}"
    );

    // After a clean stop the connection gauge says disconnected.
    worker_token.cancel();
    worker.await.expect("join").expect("clean stop");
    let s = parse_prometheus(&http_get(addr, "/metrics").await.1);
    assert_eq!(
        sample(
            &s,
            m::CONNECTION_STATE,
            &[("queue", q), ("state", "stopped")]
        ),
        Some(1.0)
    );
    assert_eq!(
        sample(
            &s,
            m::CONNECTION_STATE,
            &[("queue", q), ("state", "consuming")]
        ),
        Some(0.0)
    );
    token.cancel();
    http.await.expect("join").expect("health server");

    topology.delete(&conn).await.expect("delete topology");
    delay.delete(&conn).await.expect("delete delay levels");
    let _ = conn.close(200, "done".into()).await;
    let p = prefix.clone();
    let left = mgmt(move || leftovers(&p)).await;
    assert!(left.is_empty(), "objects left behind: {left:?}");
}
