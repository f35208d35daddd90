//! `/readyz` and `/livez` against a real worker: 503 before the consumer is up, while the broker
//! cannot be reached, while the connection is down (force-closed through the management API) and
//! while draining; 200 when consuming. `/livez` stays 200 throughout: it never depends on the
//! broker.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::SocketAddr;
use std::time::Duration;

use redeliver::worker::health::Health;
use redeliver::{
    Backoff, CancellationToken, Context, DelayConfig, HandlerError, Jitter, Publisher, QueueType,
    Raw, RetryPolicy, Topology, Worker, WorkerStatus,
};
use redeliver_testkit::http::{get as http_get, wait_for_status};
use redeliver_testkit::mgmt::{blocking as mgmt, kill_connections, leftovers};
use redeliver_testkit::{amqp_url, connect, ready_count, unique_prefix, Cleanup};
use tokio::sync::{mpsc, Notify};

async fn start_health(status: WorkerStatus) -> (SocketAddr, CancellationToken) {
    let token = CancellationToken::new();
    let server = Health::new()
        .worker(status)
        .bind("127.0.0.1:0")
        .await
        .expect("bind the health server");
    let addr = server.local_addr();
    server.spawn(token.clone());
    (addr, token)
}

/// A port nothing listens on: bound, then released.
fn closed_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

#[tokio::test]
async fn readyz_is_503_while_the_broker_cannot_be_reached() {
    let url = format!("amqp://guest:guest@127.0.0.1:{}/%2f", closed_port());
    let builder = Worker::builder(url)
        .queue("unreachable")
        .reconnect_backoff(Backoff::Constant(Duration::from_millis(200)), Jitter::None)
        .handler(|_m: Raw, _c: Context| async move { Ok::<(), HandlerError>(()) });
    let worker = builder.build().expect("build");
    let mut status = worker.status_handle();
    let (addr, http) = start_health(worker.status_handle()).await;

    let body = wait_for_status(addr, "/readyz", 503, Duration::from_secs(2)).await;
    assert!(body.contains(r#""state":"starting""#), "{body}");

    let token = CancellationToken::new();
    let worker = tokio::spawn(worker.run(token.clone()));
    status
        .wait_for_timeout(Duration::from_secs(5), |s| {
            *s == redeliver::WorkerState::Connecting
        })
        .await
        .expect("the worker tries to connect");
    // Several failed attempts later it is still not ready, and still alive.
    tokio::time::sleep(Duration::from_millis(800)).await;
    let (code, body) = http_get(addr, "/readyz").await;
    assert_eq!(code, 503, "{body}");
    assert!(body.contains(r#""state":"connecting""#), "{body}");
    assert!(body.contains(r#""queue":"unreachable""#), "{body}");
    let (code, body) = http_get(addr, "/livez").await;
    assert_eq!(code, 200, "liveness must not depend on the broker: {body}");

    token.cancel();
    worker
        .await
        .expect("join")
        .expect("a stop while connecting is clean");
    let body = wait_for_status(addr, "/readyz", 503, Duration::from_secs(2)).await;
    assert!(body.contains(r#""state":"stopped""#), "{body}");
    http.cancel();
}

#[tokio::test]
async fn readyz_follows_the_consumer_through_connection_loss_and_drain() {
    let prefix = unique_prefix("rdt-health-", 8, ".");
    let _cleanup = Cleanup(prefix.clone());
    let conn = connect().await;
    // Few classic levels: the delay infrastructure is the amqp crate's subject, not this test's.
    let delay = DelayConfig::new()
        .prefix(prefix.clone())
        .levels(4)
        .queue_type(QueueType::Classic);
    let topology = Topology::new("ready")
        .prefix(prefix.clone())
        .delay(delay.clone());
    let queue = topology.queue_name();
    let connection_name = format!("{prefix}worker");

    let (started_tx, mut started_rx) = mpsc::unbounded_channel::<()>();
    let release = std::sync::Arc::new(Notify::new());
    let release_in_handler = release.clone();
    let builder = Worker::builder(amqp_url())
        .topology(topology.clone())
        .policy(RetryPolicy::none())
        .connection_name(connection_name.clone())
        // A steady 2 s between reconnect attempts keeps the outage visible to the probe.
        .reconnect_backoff(Backoff::Constant(Duration::from_secs(2)), Jitter::None)
        .shutdown_grace(Duration::from_secs(20))
        .handler(move |_m: Raw, _c: Context| {
            let started = started_tx.clone();
            let release = release_in_handler.clone();
            async move {
                let _ = started.send(());
                release.notified().await;
                Ok::<(), HandlerError>(())
            }
        });
    let worker = builder.build().expect("build");
    let (addr, http) = start_health(worker.status_handle()).await;

    // Before the worker runs: not ready.
    let (code, body) = http_get(addr, "/readyz").await;
    assert_eq!(code, 503, "{body}");
    assert!(body.contains(r#""state":"starting""#), "{body}");
    assert_eq!(http_get(addr, "/livez").await.0, 200);

    let token = CancellationToken::new();
    let worker = tokio::spawn(worker.run(token.clone()));
    let body = wait_for_status(addr, "/readyz", 200, Duration::from_secs(30)).await;
    assert!(body.contains(r#""state":"consuming""#), "{body}");
    assert!(body.contains(&queue), "{body}");

    // Connection force-closed by the broker: not ready until the worker consumes again.
    let name = connection_name.clone();
    let killed = mgmt(move || {
        // The management API lists a new connection after its stats interval.
        for _ in 0..100 {
            let n = kill_connections(&name);
            if n > 0 {
                return n;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        0
    })
    .await;
    assert!(
        killed > 0,
        "the worker's connection never showed in the management API"
    );
    let body = wait_for_status(addr, "/readyz", 503, Duration::from_secs(5)).await;
    assert!(body.contains(r#""state":"reconnecting""#), "{body}");
    let (code, body) = http_get(addr, "/livez").await;
    assert_eq!(code, 200, "liveness must not depend on the broker: {body}");
    let body = wait_for_status(addr, "/readyz", 200, Duration::from_secs(20)).await;
    assert!(body.contains(r#""state":"consuming""#), "{body}");

    // Draining: a handler still runs after shutdown was requested.
    let publisher = Publisher::new(&conn, delay.clone())
        .await
        .expect("publisher");
    publisher
        .publish_bytes("", &queue, b"hold", Default::default())
        .await
        .expect("publish");
    tokio::time::timeout(Duration::from_secs(10), started_rx.recv())
        .await
        .expect("the handler starts")
        .expect("handler channel open");
    token.cancel();
    let body = wait_for_status(addr, "/readyz", 503, Duration::from_secs(5)).await;
    assert!(body.contains(r#""state":"draining""#), "{body}");
    release.notify_one();
    tokio::time::timeout(Duration::from_secs(20), worker)
        .await
        .expect("the worker stops")
        .expect("join")
        .expect("clean stop");
    let body = wait_for_status(addr, "/readyz", 503, Duration::from_secs(2)).await;
    assert!(body.contains(r#""state":"stopped""#), "{body}");
    assert_eq!(
        ready_count(&conn, &queue).await,
        0,
        "the held message was acked"
    );
    http.cancel();

    topology.delete(&conn).await.expect("delete topology");
    delay.delete(&conn).await.expect("delete delay levels");
    let _ = conn.close(200, "done".into()).await;
    let p = prefix.clone();
    let left = mgmt(move || leftovers(&p)).await;
    assert!(left.is_empty(), "objects left behind: {left:?}");
}
