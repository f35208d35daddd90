//! The publishing connection is lost and the node it reconnects to accepts TCP but never answers
//! (a hung broker, a half-dead load balancer): the retries that need it are requeued within the
//! confirm timeout, per the settling rules, until the requeue limit dead-letters them; the
//! successful deliveries go on meanwhile. Nothing waits for the silent node for ever.
//!
//! The worker reaches the broker through a TCP relay in the test, which is switched to
//! "accept and never answer" before the publishing connection is closed through the management
//! API.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;
#[path = "common/fixture.rs"]
mod fixture;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use fixture::fixture;
#[path = "common/consuming.rs"]
mod consuming;

use redeliver_amqp::QueueType;
use redeliver_core::{HandlerError, Jitter, RetryPolicy};
use redeliver_testkit::mgmt::{await_listed_connection, force_close_connection};
use redeliver_testkit::{eventually, ready_count, wait_count};
use redeliver_worker::{Context, Raw, Worker};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

const OK: usize = 20;

/// `host:port` of an `amqp://user:pass@host:port/vhost` URL.
fn authority(url: &str) -> &str {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let rest = rest.rsplit_once('@').map_or(rest, |(_, r)| r);
    rest.split('/').next().unwrap_or(rest)
}

/// Relays every connection to `broker` until `silent` is set; from then on accepts connections
/// and never answers. Returns the address to connect to.
async fn relay(broker: String, silent: Arc<AtomicBool>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("listen");
    let address = listener.local_addr().expect("address").to_string();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((mut client, _)) = listener.accept().await {
            if silent.load(Ordering::SeqCst) {
                held.push(client);
                continue;
            }
            let broker = broker.clone();
            tokio::spawn(async move {
                if let Ok(mut upstream) = TcpStream::connect(&broker).await {
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
                }
            });
        }
    });
    address
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_node_on_reconnect_delays_retries_by_the_confirm_timeout_only() {
    init_tracing();
    let (_names, conn, topo, queue) =
        fixture("reopen", QueueType::Classic, 2, QueueType::Classic).await;
    let broker_url = redeliver_testkit::amqp_url();
    let silent = Arc::new(AtomicBool::new(false));
    let address = relay(authority(&broker_url).to_owned(), Arc::clone(&silent)).await;
    let url = broker_url.replacen(authority(&broker_url), &address, 1);
    let name = format!("reopen-{queue}");
    let ok = Arc::new(AtomicUsize::new(0));
    let ok2 = Arc::clone(&ok);
    let token = CancellationToken::new();
    let builder = Worker::builder(url)
        .topology(topo.clone())
        .connection_name(name.clone())
        .confirm_timeout(Duration::from_secs(1))
        .requeue_limit(1)
        .policy(
            RetryPolicy::constant(Duration::from_millis(100))
                .jitter(Jitter::None)
                .max_retries(5),
        )
        .handler(move |m: Raw, _ctx: Context| {
            let ok = Arc::clone(&ok2);
            async move {
                if &m[..] == b"retry" {
                    return Err(HandlerError::transient("always"));
                }
                ok.fetch_add(1, Ordering::SeqCst);
                Ok(())
            }
        });
    let (_status, run) = consuming::run_consuming(builder, &token).await;
    let publishing = format!("{name} (publishing)");
    await_listed_connection(&publishing).await;
    // The next connection attempts meet a node that never answers; the open ones still work.
    silent.store(true, Ordering::SeqCst);
    force_close_connection(&publishing).await;

    let started = Instant::now();
    publish_all(
        &conn,
        &queue,
        std::iter::once((b"retry".to_vec(), props("retry")))
            .chain((0..OK).map(|i| (format!("m{i}").into_bytes(), props(&format!("m{i}")))))
            .collect(),
    )
    .await;
    // Twice a failed retry (each bounded by the 1 s confirm timeout, then a 1 s pause before
    // the requeue), then the requeue limit dead-letters it on the consumer channel.
    wait_count(&conn, &topo.dlq_name(), 1, Duration::from_secs(20)).await;
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(15),
        "dead-lettered only after {took:?}"
    );
    assert!(
        eventually(Duration::from_secs(10), || ok.load(Ordering::SeqCst) == OK).await,
        "the successful deliveries went on"
    );
    assert_eq!(ready_count(&conn, &queue).await, 0);
    token.cancel();
    tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .expect("the worker stops")
        .expect("join")
        .expect("clean stop");
}
