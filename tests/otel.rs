//! OpenTelemetry (feature `otel`): one message published inside a span, failing twice and then
//! succeeding, gives one trace: the publish span and the three delivery spans (each a child of
//! the publish), all with its trace id. A dead letter published by the worker itself
//! (`DeadLetterMode::Annotate`) carries the same `traceparent` as the message it came from.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};
use redeliver::amqp::headers::TRACEPARENT;
use redeliver::{
    CancellationToken, Context, DelayConfig, HandlerError, Jitter, Publisher, QueueType, Raw,
    RetryPolicy, Topology, Worker,
};
use redeliver_testkit::{connect, poll_get, unique_prefix, Cleanup};
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;

/// The process-wide tracing pipeline of this test binary: tracing -> OpenTelemetry -> memory.
fn exporter() -> &'static (InMemorySpanExporter, SdkTracerProvider) {
    static PIPELINE: OnceLock<(InMemorySpanExporter, SdkTracerProvider)> = OnceLock::new();
    PIPELINE.get_or_init(|| {
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("redeliver-test"));
        tracing::subscriber::set_global_default(tracing_subscriber::registry().with(layer))
            .expect("no other global subscriber in this test binary");
        (exporter, provider)
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_trace_across_the_publish_and_every_attempt() {
    let (exporter, provider) = exporter();
    let prefix = unique_prefix("otel-", 10, "-");
    let _cleanup = Cleanup(prefix.clone());
    let conn = connect().await;
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

    let publisher = Publisher::new(&conn, delay.clone())
        .await
        .expect("publisher");
    let publish = tracing::info_span!("publish");
    let trace_id = publish.context().span().span_context().trace_id();
    let publish_span_id = publish.context().span().span_context().span_id();
    assert!(publish.context().span().span_context().is_valid());
    for body in [&b"flaky"[..], b"poison"] {
        publisher
            .publish_bytes("", &queue, body, Default::default())
            .instrument(publish.clone())
            .await
            .expect("publish");
    }
    drop(publish);

    let done = Arc::new(AtomicUsize::new(0));
    let token = CancellationToken::new();
    let seen = done.clone();
    let worker = Worker::builder(redeliver_testkit::amqp_url())
        .topology(topology.clone())
        .dead_letter_mode(redeliver::DeadLetterMode::Annotate)
        .policy(
            RetryPolicy::constant(Duration::from_millis(20))
                .jitter(Jitter::None)
                .max_retries(5),
        )
        .handler(move |m: Raw, ctx: Context| {
            let seen = seen.clone();
            async move {
                if &m[..] == b"poison" {
                    seen.fetch_add(1, Ordering::SeqCst);
                    return Err(HandlerError::permanent("poison"));
                }
                if ctx.attempt() < 2 {
                    return Err(HandlerError::transient("not yet"));
                }
                seen.fetch_add(1, Ordering::SeqCst);
                Ok(())
            }
        })
        .build()
        .expect("worker");
    let run = tokio::spawn(worker.run(token.clone()));
    let finished =
        redeliver_testkit::eventually(Duration::from_secs(20), || done.load(Ordering::SeqCst) == 2)
            .await;
    assert!(finished, "both messages handled");
    let ch = conn.create_channel().await.expect("channel");
    let dead = poll_get(&ch, &topology.dlq_name(), Duration::from_secs(10))
        .await
        .expect("the poison message in the DLQ");
    token.cancel();
    run.await.expect("join").expect("clean stop");

    // The dead letter keeps the trace of the message it came from.
    let dead_parent = dead
        .properties
        .headers()
        .as_ref()
        .and_then(|h| h.inner().get(TRACEPARENT).cloned())
        .expect("a traceparent on the dead letter");
    let dead_cx = redeliver::amqp::trace_context::extract(dead.properties.headers().as_ref());
    assert_eq!(
        dead_cx.span().span_context().trace_id(),
        trace_id,
        "{dead_parent:?}"
    );

    provider.force_flush().expect("flush");
    let spans = exporter.get_finished_spans().expect("spans");
    let deliveries: Vec<_> = spans
        .iter()
        .filter(|s| s.name == "delivery" && s.span_context.trace_id() == trace_id)
        .collect();
    // flaky: attempts 0, 1, 2; poison: one attempt.
    assert_eq!(deliveries.len(), 4, "{deliveries:#?}");
    for d in &deliveries {
        assert_eq!(d.parent_span_id, publish_span_id, "a child of the publish");
    }
    assert!(spans
        .iter()
        .any(|s| s.name == "publish" && s.span_context.trace_id() == trace_id));

    topology.delete(&conn).await.expect("delete topology");
    delay.delete(&conn).await.expect("delete delay levels");
}
