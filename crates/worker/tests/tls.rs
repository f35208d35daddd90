//! amqps:// against a real TLS listener (the testkit's TLS broker: a RabbitMQ node it starts
//! with throwaway certificates, unless `AMQPS_URL` names one): the worker over TLS, certificates
//! that must be refused, and mutual TLS with SASL EXTERNAL.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;
#[path = "common/consuming.rs"]
mod consuming;

use std::time::Duration;

use common::*;
use consuming::run_consuming;
use redeliver_amqp::lapin::ConnectionProperties;
use redeliver_amqp::ConnectError;
use redeliver_amqp::{QueueType, TlsConfig};
use redeliver_core::{HandlerError, RetryPolicy};
use redeliver_testkit::mgmt::Client;
use redeliver_testkit::TlsCleanup;
use redeliver_testkit::{amqps_url, tls_broker, tls_file};
use redeliver_testkit::{drain_queue, eventually, ready_count, record, Calls, Got};
use redeliver_worker::{Context, Json, Worker, WorkerState};
use tokio_util::sync::CancellationToken;

#[derive(serde::Deserialize)]
struct Job {
    mode: String,
}

fn trusted() -> TlsConfig {
    TlsConfig::new().ca_file(tls_file("ca.pem"))
}

/// The amqps URL without its user and password, for SASL EXTERNAL.
fn anonymous(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) => format!("{}{}", &url[..s + 3], &url[at + 1..]),
        _ => url.to_owned(),
    }
}

/// `localhost` replaced by `127.0.0.1`: the same broker, a name its certificate does not list.
fn by_ip(url: &str) -> String {
    url.replacen("localhost", "127.0.0.1", 1)
}

/// The TLS broker's record of the connection named `name` (listed a few seconds after it
/// opens: the API shows what the broker last emitted).
async fn listed_connection(name: &str) -> serde_json::Value {
    let api = Client::new(&tls_broker().mgmt_url);
    for _ in 0..100 {
        let wanted = name.to_owned();
        let api = api.clone();
        let found = redeliver_testkit::mgmt::blocking(move || {
            api.get_json("/api/connections")
                .expect("connections")
                .as_array()
                .into_iter()
                .flatten()
                .find(|c| c["client_properties"]["connection_name"] == wanted.as_str())
                .cloned()
        })
        .await;
        if let Some(c) = found {
            return c;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!("no connection named {name} in the management API within 20 s");
}

/// Consumes, retries through the delay levels and dead-letters over TLS, and the broker sees the
/// worker's connection as TLS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_consumes_retries_and_dead_letters_over_tls() {
    init_tracing();
    let broker = tls_broker();
    let names = Names::new("tls");
    let _cleanup = TlsCleanup(names.prefix.clone());
    let conn = redeliver_testkit::connect_to(&broker.amqp_url).await;
    let topo = names.topology("q", QueueType::Quorum, names.delay(6, QueueType::Classic));
    let queue = topo.queue_name();
    let calls: Calls = Default::default();
    let c = calls.clone();
    let name = format!("{}worker", names.prefix);
    let token = CancellationToken::new();
    let builder = Worker::builder(amqps_url())
        .tls(trusted())
        .topology(topo.clone())
        .connection_name(name.clone())
        .policy(RetryPolicy::constant(Duration::from_millis(50)).max_retries(3))
        .handler(move |job: Json<Job>, ctx: Context| {
            let c = c.clone();
            async move {
                let n = record(&c, ctx.message_id().unwrap_or(""), ctx.attempt());
                match job.mode.as_str() {
                    "flaky" if n == 1 => Err(HandlerError::transient("first try fails")),
                    "bad" => Err(HandlerError::permanent("never works")),
                    _ => Ok(()),
                }
            }
        });
    let (_status, run) = run_consuming(builder, &token).await;
    publish_all(
        &conn,
        &queue,
        vec![
            (br#"{"mode":"ok"}"#.to_vec(), props("ok")),
            (br#"{"mode":"flaky"}"#.to_vec(), props("flaky")),
            (br#"{"mode":"bad"}"#.to_vec(), props("bad")),
        ],
    )
    .await;
    let mut dead = Vec::new();
    assert!(
        eventually(Duration::from_secs(15), || {
            let calls = calls.lock().unwrap();
            calls.get("flaky").map(Vec::len) == Some(2) && calls.contains_key("ok")
        })
        .await,
        "not every message handled: {:?}",
        calls.lock().unwrap().keys().collect::<Vec<_>>()
    );
    for _ in 0..100 {
        dead.extend(drain_queue(&conn, &topo.dlq_name()).await);
        if !dead.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let seen = listed_connection(&name).await;
    token.cancel();
    run.await.unwrap().unwrap();
    assert_eq!(
        dead.iter().map(Got::message_id).collect::<Vec<_>>(),
        ["bad"]
    );
    let flaky: Vec<u32> = calls.lock().unwrap()["flaky"]
        .iter()
        .map(|(a, _)| *a)
        .collect();
    assert_eq!(flaky, [0, 1], "retried once through the delay levels");
    assert_eq!(
        seen["ssl"], true,
        "the broker sees a TLS connection: {seen}"
    );
    println!("worker over TLS: {}", seen["ssl_protocol"]);
    assert_eq!(ready_count(&conn, &queue).await, 0);
}

/// A certificate from an unknown CA, or one that does not name the host, is refused with an error
/// that says so; the worker keeps trying instead of crashing, and reports itself not ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_ca_and_wrong_host_name_are_refused_clearly() {
    let props = ConnectionProperties::default;
    let url = amqps_url();
    let cases = [
        (
            "an unrelated CA",
            url.clone(),
            TlsConfig::new().ca_file(tls_file("other-ca.pem")),
            "UnknownIssuer",
        ),
        (
            "the system CAs only",
            url.clone(),
            TlsConfig::new(),
            "UnknownIssuer",
        ),
        (
            "a name the certificate lacks",
            by_ip(&url),
            trusted(),
            "not valid for name",
        ),
    ];
    for (what, url, tls_config, expected) in &cases {
        match redeliver_amqp::connect(url, props(), tls_config).await {
            Err(e @ ConnectError::TlsHandshake { .. }) => {
                let text = e.to_string();
                assert!(text.contains(expected), "{what}: {text}");
                assert!(!text.contains("guest:guest"), "{what}: {text}");
                println!("{what}: {text}");
            }
            other => panic!("{what}: expected a TLS handshake error, got {other:?}"),
        }
    }
    // The worker: not ready, still running, retrying.
    let names = Names::new("tlsbad");
    let topo = names.topology("q", QueueType::Classic, names.delay(4, QueueType::Classic));
    let token = CancellationToken::new();
    let builder = Worker::builder(url.clone())
        .tls(TlsConfig::new().ca_file(tls_file("other-ca.pem")))
        .topology(topo)
        .handler(|_job: Json<Job>, _ctx: Context| async { Ok::<(), HandlerError>(()) });
    let worker = builder.build().expect("build");
    let status = worker.status_handle();
    let run = tokio::spawn(worker.run(token.clone()));
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        !run.is_finished(),
        "the worker gave up (or crashed) on a bad certificate"
    );
    assert!(!status.is_ready());
    assert!(
        matches!(
            status.state(),
            WorkerState::Connecting | WorkerState::Reconnecting
        ),
        "{:?}",
        status.state()
    );
    token.cancel();
    tokio::time::timeout(Duration::from_secs(10), run)
        .await
        .expect("stops when cancelled")
        .unwrap()
        .expect("a clean stop");
}

/// Mutual TLS: with the client certificate and SASL EXTERNAL the broker logs the client in by the
/// certificate (CN = guest), the URL carrying no password; a certificate from another CA is
/// refused by the broker; EXTERNAL without a certificate is refused before connecting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_with_and_without_a_client_certificate() {
    let url = amqps_url();
    let mtls = trusted()
        .client_cert(tls_file("client.pem"), tls_file("client.key"))
        .sasl_external(true);
    let name = format!("rdw-mtls-{}", redeliver_testkit::unique_id(8));
    let props = ConnectionProperties::default().with_connection_name(name.as_str().into());
    let conn = redeliver_amqp::connect(&anonymous(&url), props, &mtls)
        .await
        .expect("SASL EXTERNAL with the client certificate");
    let ch = conn.create_channel().await.expect("a channel");
    ch.close(200, "ok".into()).await.unwrap();
    let seen = listed_connection(&name).await;
    conn.close(200, "ok".into()).await.unwrap();
    assert_eq!(seen["user"], "guest", "{seen}");
    assert_eq!(seen["auth_mechanism"], "EXTERNAL", "{seen}");
    println!(
        "mTLS: user {}, {}, peer {}",
        seen["user"], seen["auth_mechanism"], seen["peer_cert_subject"]
    );

    // The certificate as a second factor, with the password login.
    let with_password = trusted().client_cert(tls_file("client.pem"), tls_file("client.key"));
    let conn = redeliver_amqp::connect(&url, ConnectionProperties::default(), &with_password)
        .await
        .expect("client certificate plus password");
    conn.close(200, "ok".into()).await.unwrap();

    // A client certificate the broker's CA did not sign.
    let foreign = trusted()
        .client_cert(tls_file("other-client.pem"), tls_file("other-client.key"))
        .sasl_external(true);
    let refused =
        redeliver_amqp::connect(&anonymous(&url), ConnectionProperties::default(), &foreign).await;
    let e = refused.expect_err("the broker refuses a certificate from another CA");
    // The alert, or the reset that often replaces it, both named as a refused certificate.
    assert!(
        e.to_string().contains("refused the client certificate"),
        "{e}"
    );
    println!("foreign client certificate: {e}");

    // EXTERNAL without a certificate: our own check, before any connection.
    let e = redeliver_amqp::connect(
        &anonymous(&url),
        ConnectionProperties::default(),
        &trusted().sasl_external(true),
    )
    .await
    .expect_err("EXTERNAL needs a certificate");
    assert!(e.to_string().contains("client certificate"), "{e}");
}
