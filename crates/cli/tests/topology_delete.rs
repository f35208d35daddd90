//! `topology delete --include-delay` against the real broker: delay queues that hold messages
//! (other services' pending retries, parked messages) are not deleted without --force, and
//! nothing else is either.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "common/cleanup.rs"]
mod cleanup;
mod common;
#[path = "common/messages.rs"]
mod messages;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use cleanup::{cli, Cleanup};
use common::*;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::BasicProperties;
use messages::*;
use redeliver_testkit::{connect, ready_count as count};
use serde_json::Value;

/// Few levels with a long tick, so a message put in a level queue stays there for the test.
const LV: &str = "4";
const GRANULARITY: &str = "10m";

fn level(p: &str, k: u8) -> String {
    format!("{p}redeliver.delay.{k}")
}

fn parking(p: &str) -> String {
    format!("{p}redeliver.delay.unroutable")
}

fn run(p: &str, cmd: &[&str]) -> redeliver_testkit::process::Output {
    let mut args: Vec<&str> = cmd.to_vec();
    args.extend(["--prefix", p, "--levels", LV, "--granularity", GRANULARITY]);
    cli(&args)
}

/// `topology show --json`'s objects: (name, exists).
fn objects(p: &str, queue: &str) -> Vec<(String, bool)> {
    let out = run(p, &["topology", "show", queue, "--json"]).ok();
    let v: Value = serde_json::from_str(&out.stdout).expect("json");
    v["objects"]
        .as_array()
        .expect("objects")
        .iter()
        .map(|o| {
            (
                o["name"].as_str().unwrap_or_default().to_owned(),
                o["exists"] == true,
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_empty_delay_queues_are_kept_unless_forced() {
    let conn = connect().await;
    let p = prefix();
    let _cleanup = Cleanup::new(&p, &["keep"]);
    run(&p, &["topology", "declare", "keep"]).ok();
    // Retries of other services waiting in levels 2 and 0, one parked message, and one
    // message in Q itself (which --yes alone may delete).
    for id in ["r1", "r2"] {
        publish(&conn, &level(&p, 2), id, b"{}", user_headers()).await;
    }
    publish(&conn, &level(&p, 0), "r3", b"{}", user_headers()).await;
    publish(&conn, &parking(&p), "parked", b"{}", user_headers()).await;
    publish(&conn, &format!("{p}keep"), "own", b"{}", user_headers()).await;
    let before = objects(&p, "keep");
    assert!(before.iter().all(|(_, e)| *e), "{before:?}");

    // Refused: exit code 2 like the other "confirm with a flag" refusals, the queues and
    // their counts named, nothing deleted.
    let out = run(
        &p,
        &["topology", "delete", "keep", "--include-delay", "--yes"],
    );
    assert_eq!(out.code, 2, "{out:?}");
    assert!(out.stdout.is_empty(), "{out:?}");
    for needle in [
        format!("'{}' (2 message(s))", level(&p, 2)),
        format!("'{}' (1 message(s))", level(&p, 0)),
        format!("'{}' (1 message(s))", parking(&p)),
        "nothing was deleted".to_owned(),
        "--force".to_owned(),
    ] {
        assert!(out.stderr.contains(&needle), "{needle}: {}", out.stderr);
    }
    assert!(!out.stderr.contains(&level(&p, 1)), "{}", out.stderr);
    assert_eq!(objects(&p, "keep"), before);
    assert_eq!(count(&conn, &level(&p, 2)).await, 2);
    assert_eq!(count(&conn, &level(&p, 0)).await, 1);
    assert_eq!(count(&conn, &parking(&p)).await, 1);
    assert_eq!(count(&conn, &format!("{p}keep")).await, 1);

    // The same refusal as one JSON document on stdout.
    let out = run(
        &p,
        &[
            "topology",
            "delete",
            "keep",
            "--include-delay",
            "--yes",
            "--json",
        ],
    );
    assert_eq!(out.code, 2, "{out:?}");
    let v: Value = serde_json::from_str(&out.stdout).expect("one JSON document");
    assert_eq!(v["deleted"], false);
    assert_eq!(v["refused"], true);
    assert_eq!(v["queue"], format!("{p}keep"));
    assert_eq!(
        v["non_empty"],
        serde_json::json!([
            {"queue": level(&p, 2), "messages": 2},
            {"queue": level(&p, 0), "messages": 1},
            {"queue": parking(&p), "messages": 1},
        ])
    );
    assert_eq!(v["already_deleted"], serde_json::json!([]));
    assert!(v["error"].as_str().is_some_and(|e| e.contains("--force")));
    assert_eq!(objects(&p, "keep"), before);

    // --force only makes sense with --include-delay.
    let out = run(&p, &["topology", "delete", "keep", "--yes", "--force"]);
    assert_eq!(out.code, 2, "{out:?}");
    assert_eq!(objects(&p, "keep"), before);

    // --force deletes them, saying what was discarded.
    let out = run(
        &p,
        &[
            "topology",
            "delete",
            "keep",
            "--include-delay",
            "--yes",
            "--force",
            "--json",
        ],
    )
    .ok();
    let v: Value = serde_json::from_str(&out.stdout).expect("json");
    assert_eq!(v["deleted"], true);
    assert_eq!(v["delay_deleted"], true);
    assert_eq!(
        v["discarded"],
        serde_json::json!([
            {"queue": level(&p, 2), "messages": 2},
            {"queue": level(&p, 0), "messages": 1},
            {"queue": parking(&p), "messages": 1},
        ])
    );
    let after = objects(&p, "keep");
    assert!(after.iter().all(|(_, e)| !*e), "{after:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_delay_infrastructure_is_deleted_as_before() {
    let _conn = connect().await;
    let p = prefix();
    let _cleanup = Cleanup::new(&p, &["empty"]);
    run(&p, &["topology", "declare", "empty"]).ok();
    assert!(objects(&p, "empty").iter().all(|(_, e)| *e));
    let out = run(
        &p,
        &["topology", "delete", "empty", "--include-delay", "--yes"],
    )
    .ok();
    assert!(
        out.stdout.contains("deleted the delay infrastructure"),
        "{out:?}"
    );
    assert!(!out.stdout.contains("--force"), "{out:?}");
    let after = objects(&p, "empty");
    assert!(after.iter().all(|(_, e)| !*e), "{after:?}");
    // The settings exchange went too: other settings can be declared on the prefix now.
    cli(&[
        "topology", "declare", "empty", "--prefix", &p, "--levels", "3",
    ])
    .ok();
    cli(&[
        "topology",
        "delete",
        "empty",
        "--prefix",
        &p,
        "--levels",
        "3",
        "--include-delay",
        "--yes",
    ])
    .ok();
}

/// Retries published the whole time the command runs: without --force, every confirmed one is
/// still in a delay queue afterwards, whether the command refused at its first count or found
/// them while deleting (a level queue is deleted only once its exchange can no longer route to
/// it, and found empty then).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_arriving_while_deleting_are_not_destroyed() {
    let conn = connect().await;
    for round in 0..8u64 {
        let p = prefix();
        let _cleanup = Cleanup::new(&p, &["busy"]);
        run(&p, &["topology", "declare", "busy"]).ok();
        let stop = Arc::new(AtomicBool::new(false));
        let publisher = {
            // A connection of its own: the publisher's 404 must not touch the one counting.
            let ch = connect().await.create_channel().await.expect("channel");
            ch.confirm_select(ConfirmSelectOptions::default())
                .await
                .expect("confirms");
            let (stop, top) = (stop.clone(), level(&p, 3));
            tokio::spawn(async move {
                // Starts a little later each round, to meet the command at different steps.
                tokio::time::sleep(Duration::from_millis(12 * round)).await;
                let mut confirmed = 0u32;
                while !stop.load(Ordering::Relaxed) {
                    // A delay of 8 ticks: waits in level 3.
                    let sent = ch
                        .basic_publish(
                            top.as_str().into(),
                            "1.0.0.0.busy".into(),
                            BasicPublishOptions::default(),
                            b"{}",
                            BasicProperties::default().with_delivery_mode(2),
                        )
                        .await;
                    let Ok(confirm) = sent else { break };
                    match confirm.await {
                        Ok(c) if c.is_ack() => confirmed += 1,
                        // The exchange was deleted: the publisher is told, nothing is confirmed.
                        _ => break,
                    }
                }
                confirmed
            })
        };
        let out = run(
            &p,
            &["topology", "delete", "busy", "--include-delay", "--yes"],
        );
        stop.store(true, Ordering::Relaxed);
        let confirmed = publisher.await.expect("publisher");
        eprintln!(
            "round {round}: exit {}, {confirmed} confirmed: {}",
            out.code,
            out.stderr.trim()
        );
        let mut kept = 0;
        for q in [
            level(&p, 3),
            level(&p, 2),
            level(&p, 1),
            level(&p, 0),
            parking(&p),
        ] {
            if redeliver_testkit::queue_exists(&conn, &q).await {
                kept += count(&conn, &q).await;
            }
        }
        assert!(out.code == 0 || out.code == 2, "round {round}: {out:?}");
        assert_eq!(
            kept, confirmed,
            "round {round}: {confirmed} retries confirmed, {kept} left in delay queues: {out:?}"
        );
        if out.code == 2 {
            assert!(out.stderr.contains("--force"), "{out:?}");
        }
    }
}
