//! The CLI over amqps:// against the testkit's TLS broker (a RabbitMQ node it starts with
//! throwaway certificates, unless `AMQPS_URL` names one).

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;
#[path = "common/messages.rs"]
mod messages;

use std::time::Duration;

use common::*;
use messages::*;
use redeliver_testkit::connect_to;
use redeliver_testkit::TlsCleanup;
use redeliver_testkit::{message_ids, reject_all, tls_broker, tls_file, wait_count};
use serde_json::{json, Value};

/// `dlq list` over amqps:// with the test CA; with an unrelated CA the command fails, says why,
/// and prints no password. The URL and the CA also come from files / the environment
/// (`--url-file`, `REDELIVER_TLS_CA_FILE`), as a Kubernetes pod gives them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_list_over_amqps() {
    let broker = tls_broker();
    let conn = connect_to(&broker.amqp_url).await;
    let p = prefix();
    let _cleanup = TlsCleanup(p.clone());
    let levels = LEVELS.to_string();
    let declare = [
        "topology",
        "declare",
        "tlsjobs",
        "--prefix",
        &p,
        "--levels",
        &levels,
        "--classic",
    ];
    cli_env(&declare, &[("AMQP_URL", &broker.amqp_url)]).ok();
    let q = format!("{p}tlsjobs");
    let ids = ["tls-0", "tls-1"];
    for (i, id) in ids.iter().enumerate() {
        let body = json!({ "order": i }).to_string();
        publish(&conn, &q, id, body.as_bytes(), user_headers()).await;
    }
    reject_all(&conn, &q, ids.len()).await;
    wait_count(&conn, &format!("{q}.dlq"), 2, Duration::from_secs(10)).await;

    let amqps = broker.url.clone();
    let ca = tls_file("ca.pem");
    let ca = ca.to_str().expect("a UTF-8 path");
    let args = ["dlq", "list", "tlsjobs", "--prefix", &p, "--json"];
    let mut with_ca = args.to_vec();
    with_ca.extend(["--url", &amqps, "--tls-ca-file", ca]);
    let listed: Value = serde_json::from_str(&cli_env(&with_ca, &[]).ok().stdout).unwrap();
    assert_eq!(message_ids(&listed), ids);

    let dir = std::env::temp_dir().join(format!("rd-cli-{p}"));
    std::fs::create_dir_all(&dir).unwrap();
    let url_file = dir.join("amqp-url");
    std::fs::write(&url_file, format!("{amqps}\n")).unwrap();
    let mut from_files = args.to_vec();
    from_files.extend(["--url-file", url_file.to_str().unwrap()]);
    let out = cli_env(&from_files, &[("REDELIVER_TLS_CA_FILE", ca)]).ok();
    assert_eq!(
        message_ids(&serde_json::from_str(&out.stdout).unwrap()),
        ids
    );

    let other = tls_file("other-ca.pem");
    let mut wrong = args.to_vec();
    wrong.extend(["--url", &amqps, "--tls-ca-file", other.to_str().unwrap()]);
    let out = cli_env(&wrong, &[]);
    assert_eq!(out.code, 1, "{out:?}");
    assert!(out.stderr.contains("TLS handshake"), "{}", out.stderr);
    assert!(out.stderr.contains("UnknownIssuer"), "{}", out.stderr);
    assert!(
        !out.stderr.contains(":guest@"),
        "no password: {}",
        out.stderr
    );
    let _ = std::fs::remove_dir_all(&dir);
}
