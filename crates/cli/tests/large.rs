//! Operator commands on a DLQ of large messages keep their memory bounded: the peak resident
//! size of `dlq list`, `dlq stats` and `dlq peek` over 64 messages of almost 16 MiB (1 GiB in
//! all, RabbitMQ 4's largest message size) stays far below the size of the queue.
//!
//! Ignored by default (it moves 1 GiB through the broker several times); run it with
//! `cargo test -p redeliver-cli --test large -- --ignored`. It needs GNU time (`/usr/bin/time`)
//! for the peak resident size of the CLI process.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "common/cleanup.rs"]
mod cleanup;
mod common;
#[path = "common/declare.rs"]
mod declare;

use std::process::Command;

use cleanup::Cleanup;
use common::*;
use declare::declare;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::BasicProperties;
use redeliver_testkit::{amqp_url, connect, ready_count as count};

/// Just under RabbitMQ 4's default max_message_size (16 MiB), so every broker takes it.
const BODY: usize = 16 * 1024 * 1024 - 4096;
const MESSAGES: usize = 64;
/// The CLI's own footprint is a few MiB; what it holds of the messages must stay a handful
/// of bodies at most, never the queue (1 GiB).
const MAX_RSS_KIB: u64 = 256 * 1024;

/// Runs the CLI under GNU time; returns (exit code, stdout, peak RSS in KiB).
fn measured(args: &[&str]) -> (i32, String, u64) {
    let out = Command::new("/usr/bin/time")
        .args(["-f", "maxrss=%M"])
        .arg(env!("CARGO_BIN_EXE_redeliver"))
        .args(args)
        .env("AMQP_URL", amqp_url())
        .output()
        .expect("run the CLI under /usr/bin/time");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let rss = stderr
        .lines()
        .rev()
        .find_map(|l| l.strip_prefix("maxrss="))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no maxrss in:\n{stderr}"));
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        rss,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "moves 1 GiB through the broker; run with --ignored"]
async fn large_dlq_is_read_in_bounded_memory() {
    let conn = connect().await;
    let p = prefix();
    let _cleanup = Cleanup::new(&p, &["large"]);
    declare("large", &p, &[]);
    let dlq = format!("{p}large.dlq");

    let ch = conn.create_channel().await.expect("channel");
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirm mode");
    // JSON, so a preview that parsed whole bodies would show in the peak.
    let mut body = b"{\"pad\": \"".to_vec();
    body.resize(BODY - 2, b'x');
    body.extend(b"\"}");
    for i in 0..MESSAGES {
        ch.basic_publish(
            "".into(),
            dlq.as_str().into(),
            BasicPublishOptions::default(),
            &body,
            BasicProperties::default().with_message_id(format!("big-{i}").as_str().into()),
        )
        .await
        .expect("publish")
        .await
        .expect("confirm");
    }
    drop(body);
    assert_eq!(count(&conn, &dlq).await, MESSAGES as u32);

    let last = format!("big-{}", MESSAGES - 1);
    let limit = MESSAGES.to_string();
    for args in [
        vec![
            "dlq", "list", "large", "--prefix", &p, "--limit", &limit, "--json",
        ],
        vec!["dlq", "stats", "large", "--prefix", &p, "--json"],
        vec!["dlq", "peek", "large", &last, "--prefix", &p, "--json"],
    ] {
        let (code, stdout, rss) = measured(&args);
        assert_eq!(code, 0, "{args:?}");
        eprintln!("{args:?}: peak RSS {} MiB", rss / 1024);
        assert!(
            rss < MAX_RSS_KIB,
            "{args:?}: peak RSS {} MiB for a DLQ of {} MiB",
            rss / 1024,
            MESSAGES * BODY / (1024 * 1024)
        );
        assert!(stdout.len() < 64 * 1024 * 1024 || args[1] == "peek");
    }
    assert_eq!(count(&conn, &dlq).await, MESSAGES as u32, "nothing removed");
}
