//! A black-holed connection: a proxy between worker and broker stops forwarding without
//! closing either socket, as a dead NAT entry or a partitioned node does. The missing
//! heartbeats give it away within two heartbeat intervals; the worker reconnects (here to its
//! failover URL, straight to the broker) and nothing is lost.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;
#[path = "common/fixture.rs"]
mod fixture;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use fixture::fixture;
#[path = "common/consuming.rs"]
mod consuming;

use redeliver_amqp::QueueType;
use redeliver_core::{Backoff, HandlerError, Jitter};
use redeliver_testkit::{amqp_url, eventually};
use redeliver_worker::{Context, Raw, Worker, WorkerState};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

const N: usize = 100;
const HEARTBEAT_SECS: u64 = 1;

/// The broker's `host:port` from the test's `AMQP_URL`.
fn broker_addr(url: &str) -> String {
    let rest = url.split("://").nth(1).unwrap_or("");
    let authority = rest.split('/').next().unwrap_or("");
    let host_port = authority.rsplit('@').next().unwrap_or(authority);
    if host_port.contains(':') {
        host_port.to_owned()
    } else {
        format!("{host_port}:5672")
    }
}

/// Copies `from` to `to` until either side closes; while `hole` is set it reads nothing and
/// writes nothing, but keeps both sockets open.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    hole: Arc<AtomicBool>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        if hole.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        }
        let n = match tokio::time::timeout(Duration::from_millis(50), from.read(&mut buf)).await {
            Err(_) => continue,
            Ok(Ok(0)) | Ok(Err(_)) => return,
            Ok(Ok(n)) => n,
        };
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// A proxy to `target` on a free local port, and its black-hole switch.
async fn proxy(target: String) -> (u16, Arc<AtomicBool>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let hole = Arc::new(AtomicBool::new(false));
    let switch = Arc::clone(&hole);
    tokio::spawn(async move {
        while let Ok((inbound, _)) = listener.accept().await {
            let Ok(outbound) = TcpStream::connect(&target).await else {
                continue;
            };
            let (ir, iw) = inbound.into_split();
            let (or, ow) = outbound.into_split();
            tokio::spawn(pump(ir, ow, Arc::clone(&hole)));
            tokio::spawn(pump(or, iw, Arc::clone(&hole)));
        }
    });
    (port, switch)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_black_holed_connection_is_detected_by_heartbeats() {
    init_tracing();
    let (_names, conn, topo, queue) =
        fixture("heartbeat", QueueType::Quorum, 2, QueueType::Classic).await;
    let direct = amqp_url();
    let (port, hole) = proxy(broker_addr(&direct)).await;
    let sep = if direct.contains('?') { '&' } else { '?' };
    let via_proxy = {
        let path = direct
            .rsplit('/')
            .next()
            .unwrap_or("%2f")
            .split('?')
            .next()
            .unwrap_or("%2f");
        format!("amqp://guest:guest@127.0.0.1:{port}/{path}?heartbeat={HEARTBEAT_SECS}")
    };
    let failover = format!("{direct}{sep}heartbeat={HEARTBEAT_SECS}");
    let handled: Arc<Mutex<HashMap<String, u32>>> = Arc::default();
    let seen = Arc::clone(&handled);
    let token = CancellationToken::new();
    let builder = Worker::builder(via_proxy)
        .failover_urls([failover])
        .topology(topo.clone())
        .reconnect_backoff(Backoff::Constant(Duration::from_millis(100)), Jitter::None)
        .handler(move |m: Raw, _c: Context| {
            let seen = Arc::clone(&seen);
            async move {
                tokio::time::sleep(Duration::from_millis(5)).await;
                *seen
                    .lock()
                    .unwrap()
                    .entry(String::from_utf8_lossy(&m).into_owned())
                    .or_default() += 1;
                Ok::<(), HandlerError>(())
            }
        });
    let (mut status, run) = consuming::run_consuming(builder, &token).await;
    assert_eq!(status.broker(), Some(0), "consuming through the proxy");
    let batch = |from: usize| {
        (from..from + N / 2)
            .map(|i| (format!("m{i}").into_bytes(), props(&format!("m{i}"))))
            .collect::<Vec<_>>()
    };
    publish_all(&conn, &queue, batch(0)).await;
    let count = |h: &Arc<Mutex<HashMap<String, u32>>>| h.lock().unwrap().len();
    assert!(eventually(Duration::from_secs(20), || count(&handled) == N / 2).await);

    hole.store(true, Ordering::SeqCst);
    let cut = Instant::now();
    status
        .wait_for_timeout(Duration::from_secs(10 * HEARTBEAT_SECS), |s| {
            *s != WorkerState::Consuming
        })
        .await
        .expect("the black hole was never noticed");
    let detected = cut.elapsed();
    // lapin gives up after two heartbeat intervals without a frame; a second of slack for
    // its timer and the session's teardown.
    assert!(
        detected <= Duration::from_secs(2 * HEARTBEAT_SECS + 1),
        "noticed after {detected:?}"
    );
    status
        .wait_for_timeout(Duration::from_secs(20), |s| *s == WorkerState::Consuming)
        .await
        .expect("consuming again");
    assert_eq!(
        status.broker(),
        Some(1),
        "reconnected through the failover URL"
    );
    eprintln!("black hole noticed after {detected:?}");

    publish_all(&conn, &queue, batch(N / 2)).await;
    assert!(
        eventually(Duration::from_secs(30), || count(&handled) == N).await,
        "lost: {} of {N} handled",
        count(&handled)
    );
    let duplicates: u32 = handled.lock().unwrap().values().map(|n| n - 1).sum();
    eprintln!("0 lost, {duplicates} duplicates");
    token.cancel();
    run.await.expect("join").expect("clean stop");
}
