//! The example worker (`examples/image_processing.rs`) during a broker outage at start-up, as a
//! rollout meets it: the health server is up at once, `/livez` says 200 and `/readyz` 503, the
//! process keeps trying instead of exiting (no CrashLoopBackOff); once the broker answers, it
//! becomes ready and consumes.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use redeliver_testkit::http::{get, wait_for_status};
use redeliver_testkit::process::LoggedChild;
use redeliver_testkit::{amqp_url, connect, queue_depth, unique_prefix, Cleanup};

/// A port nothing listens on: bound, then released.
fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

/// The broker's `host:port` from the test's `AMQP_URL`.
fn broker_addr() -> String {
    let url = amqp_url();
    let rest = url.split("://").nth(1).unwrap_or("");
    let authority = rest.split('/').next().unwrap_or("");
    let host_port = authority.rsplit('@').next().unwrap_or(authority);
    if host_port.contains(':') {
        host_port.to_owned()
    } else {
        format!("{host_port}:5672")
    }
}

/// Forwards every connection to `port` to the broker, from now on: the broker "appears".
async fn start_forwarding(port: u16) -> tokio::task::JoinHandle<()> {
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .expect("the outage port is free again");
    let target = broker_addr();
    tokio::spawn(async move {
        while let Ok((mut inbound, _)) = listener.accept().await {
            let target = target.clone();
            tokio::spawn(async move {
                if let Ok(mut outbound) = tokio::net::TcpStream::connect(&target).await {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                }
            });
        }
    })
}

/// Waits until something listens on `addr`.
async fn await_listening(addr: SocketAddr, within: Duration) -> bool {
    let start = Instant::now();
    while start.elapsed() < within {
        if std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_waits_for_the_broker_instead_of_exiting() {
    let bin = redeliver_testkit::examples::example_binary(
        Path::new(env!("CARGO_MANIFEST_DIR")),
        "image_processing",
    );
    let prefix = unique_prefix("startup-", 10, "-");
    let _cleanup = Cleanup(prefix.clone());
    let outage_port = free_port();
    let health: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().expect("addr");
    let log = std::env::temp_dir().join(format!("{prefix}worker.log"));
    let mut cmd = Command::new(&bin);
    cmd.env(
        "AMQP_URL",
        format!("amqp://guest:guest@127.0.0.1:{outage_port}/%2f"),
    )
    .env("REDELIVER_HEALTH_ADDR", health.to_string())
    .env("REDELIVER_PREFIX", &prefix)
    .env("RUST_LOG", "info");
    let mut worker = LoggedChild::spawn(cmd, "image_processing", log);

    assert!(
        await_listening(health, Duration::from_secs(20)).await,
        "the health server never listened: {}",
        worker.log_tail(20)
    );
    // Several seconds of failed connection attempts: alive, not ready, still running.
    let outage_end = Instant::now() + Duration::from_secs(3);
    while Instant::now() < outage_end {
        assert_eq!(
            get(health, "/livez").await.0,
            200,
            "{}",
            worker.log_tail(20)
        );
        let (code, body) = get(health, "/readyz").await;
        assert_eq!(code, 503, "ready without a broker: {body}");
        assert!(
            worker.is_running(),
            "the worker exited while the broker was unreachable: {}",
            worker.log_tail(20)
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }

    // The broker appears: ready (reconnect backoff is at most 30 s), then it consumes.
    let forwarding = start_forwarding(outage_port).await;
    wait_for_status(health, "/readyz", 200, Duration::from_secs(45)).await;
    let conn = connect().await;
    let queue = format!("{prefix}images");
    let ch = conn.create_channel().await.expect("channel");
    ch.confirm_select(Default::default())
        .await
        .expect("confirms");
    let job =
        br#"{"id": 1, "url": "https://example.invalid/a.png", "width": 64, "fail_rate": 0.0}"#;
    ch.basic_publish(
        "".into(),
        queue.as_str().into(),
        Default::default(),
        job,
        Default::default(),
    )
    .await
    .expect("publish")
    .await
    .expect("confirm");
    let mut consumed = false;
    for _ in 0..100 {
        let depth = queue_depth(&conn, &queue).await.expect("queue");
        if depth.ready == 0 && depth.consumers > 0 {
            consumed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        consumed,
        "the job was not consumed: {}",
        worker.log_tail(30)
    );
    assert!(
        worker.is_running(),
        "the worker stopped: {}",
        worker.log_tail(30)
    );

    let status = worker.terminate(Duration::from_secs(30)).await;
    assert!(status.contains("exit status: 0"), "{status}");
    forwarding.abort();
}
