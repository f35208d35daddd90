//! `topology declare|verify|show|delete` and `delay probe` against the real broker.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "common/cleanup.rs"]
mod cleanup;
mod common;
#[path = "common/declare.rs"]
mod declare;
#[path = "common/messages.rs"]
mod messages;

use cleanup::{cli, Cleanup};
use common::*;
use declare::declare;
use messages::*;
use redeliver_testkit::{connect, ready_count as count};
use serde_json::Value;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn declare_verify_show_and_mismatch() {
    let conn = connect().await;
    let p = prefix();
    let _cleanup = Cleanup::new(&p, &["shop"]);
    let levels = LEVELS.to_string();
    let lv = ["--prefix", p.as_str(), "--levels", levels.as_str()];
    let with = |cmd: &[&str]| -> Vec<String> {
        cmd.iter()
            .chain(lv.iter())
            .map(|s| (*s).to_owned())
            .collect()
    };
    let run = |cmd: &[&str]| {
        let args = with(cmd);
        cli(&args.iter().map(String::as_str).collect::<Vec<_>>())
    };

    // Before declare: verify fails and says how to fix it; show marks objects missing.
    let out = run(&["topology", "verify", "shop"]);
    assert_eq!(out.code, 1, "{out:?}");
    assert!(out.stderr.contains("does not exist"), "{}", out.stderr);
    assert!(
        out.stderr
            .contains(&format!("redeliver topology declare shop --prefix {p}")),
        "{}",
        out.stderr
    );
    let out = run(&["topology", "show", "shop"]).ok();
    assert!(out.stdout.contains("MISSING"), "{}", out.stdout);

    run(&["topology", "declare", "shop"]).ok();
    run(&["topology", "declare", "shop"]).ok(); // idempotent
    let out = run(&["topology", "verify", "shop"]).ok();
    assert!(out.stdout.starts_with("ok:"), "{}", out.stdout);

    publish(&conn, &format!("{p}shop"), "a", b"{}", user_headers()).await;
    let out = run(&["topology", "show", "shop", "--json"]).ok();
    let v: Value = serde_json::from_str(&out.stdout).unwrap();
    let objects = v["objects"].as_array().unwrap();
    // Q, Q.dlx, Q.dlq, L x (exchange + queue), deliver, unroutable exchange + queue.
    assert_eq!(objects.len(), 3 + 2 * usize::from(LEVELS) + 3);
    assert!(objects.iter().all(|o| o["exists"] == true), "{objects:?}");
    let q = &objects[0];
    assert_eq!(q["name"], format!("{p}shop"));
    assert_eq!(q["messages"], 1);
    assert_eq!(
        q["arguments"]["x-dead-letter-exchange"],
        format!("{p}shop.dlx")
    );
    let level0 = objects
        .iter()
        .find(|o| o["kind"] == "queue" && o["name"] == format!("{p}redeliver.delay.0"))
        .unwrap();
    assert_eq!(level0["arguments"]["x-message-ttl"], 10);
    let table = run(&["topology", "show", "shop"]).ok();
    assert!(table
        .stdout
        .contains(&format!("{p}redeliver.delay.unroutable")));
    assert!(!table.stdout.contains("MISSING"), "{}", table.stdout);

    // A classic declaration over the quorum queue: 406, object and argument named.
    let out = run(&["topology", "declare", "shop", "--classic"]);
    assert_eq!(out.code, 1, "{out:?}");
    assert!(
        out.stderr.contains(&format!("queue '{p}shop'")),
        "{}",
        out.stderr
    );
    assert!(out.stderr.contains("argument 'x-"), "{}", out.stderr);
    assert!(out.stderr.contains("hint:"), "{}", out.stderr);

    // The DLQ was declared classic (the default); --quorum-dlq asks for another type.
    let out = run(&["topology", "declare", "shop", "--quorum-dlq"]);
    assert_eq!(out.code, 1, "{out:?}");
    assert!(
        out.stderr.contains(&format!("queue '{p}shop.dlq'")),
        "{}",
        out.stderr
    );

    // delete refuses without --yes.
    let out = run(&["topology", "delete", "shop"]);
    assert_eq!(out.code, 2, "{out:?}");
    assert!(out.stderr.contains("--yes"));
    assert_eq!(count(&conn, &format!("{p}shop")).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delay_probe_reports_observed_delays() {
    let _conn = connect().await;
    let p = prefix();
    let _cleanup = Cleanup::new(&p, &["probed"]);
    let levels = LEVELS.to_string();
    // Without the infrastructure: a clear error.
    let out = cli(&[
        "delay", "probe", "--prefix", &p, "--levels", &levels, "--delays", "10ms",
    ]);
    assert_eq!(out.code, 1, "{out:?}");
    assert!(
        out.stderr.contains("redeliver topology declare"),
        "{}",
        out.stderr
    );

    declare("probed", &p, &[]);
    let out = cli(&[
        "delay",
        "probe",
        "--prefix",
        &p,
        "--levels",
        &levels,
        "--delays",
        "0ms,50ms,300ms",
    ])
    .ok();
    let rows: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(rows.len(), 4, "{}", out.stdout);
    assert!(rows[0].starts_with("INTENDED"), "{}", out.stdout);
    for r in &rows[1..] {
        assert!(r.trim_end().ends_with("ok"), "{}", out.stdout);
    }
    assert!(rows[3].starts_with("300ms"), "{}", out.stdout);
    // The observed delay is at least the routed one.
    let observed: f64 = rows[3]
        .split_whitespace()
        .nth(2)
        .unwrap()
        .trim_end_matches("ms")
        .parse()
        .unwrap();
    assert!(observed >= 300.0, "{}", out.stdout);
    // Too long for 10 levels of 10 ms: reported, not sent, exit 1.
    let out = cli(&[
        "delay", "probe", "--prefix", &p, "--levels", &levels, "--delays", "1h",
    ]);
    assert_eq!(out.code, 1, "{out:?}");
    assert!(out.stdout.contains("not sent"), "{}", out.stdout);
}
