//! A DLQ holding messages whose one header nests as deep as a frame of the broker's size allows
//! (`[[[...]]]`, `{k:{k:...}}`): every `dlq` command used to abort on it (lapin's I/O thread
//! overflowed its stack, issue 29). Now each command reads it with the header cut and marked,
//! and exits 0.

mod common;
#[path = "../../worker/tests/common/raw_publish.rs"]
mod raw_publish;

use common::*;
use redeliver_amqp::HEADERS_REMOVED;
use redeliver_testkit::{amqp_url, connect, message_ids, ready_count as count};
use serde_json::Value;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_commands_survive_the_deepest_headers() {
    let conn = connect().await;
    let p = prefix();
    let _cleanup = Cleanup::new(&p, &["hq"]);
    declare("hq", &p, &[]);
    let q = format!("{p}hq");
    let dlq = format!("{q}.dlq");

    let (url, target) = (amqp_url(), dlq.clone());
    tokio::task::spawn_blocking(move || {
        let probe = raw_publish::publish(&url, &target, b"V", b"{}", "shallow")?;
        for (kind, id) in [(b'A', "deep-arrays"), (b'F', "deep-tables")] {
            let depth = raw_publish::deepest(kind, probe.frame_max, id);
            let value = raw_publish::nested(kind, depth);
            raw_publish::publish(&url, &target, &value, b"{\"n\":1}", id)?;
        }
        Ok::<_, String>(())
    })
    .await
    .unwrap()
    .unwrap_or_else(|e| panic!("publishing: {e}"));
    assert_eq!(count(&conn, &dlq).await, 3);

    // list, in both output modes.
    let table = cli(&["dlq", "list", "hq", "--prefix", &p]).ok();
    assert!(table.stdout.contains("deep-arrays"), "{}", table.stdout);
    let json = cli(&["dlq", "list", "hq", "--prefix", &p, "--json"]).ok();
    let listed: Value = serde_json::from_str(&json.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}):\n{}", json.stdout));
    assert_eq!(
        message_ids(&listed),
        ["shallow", "deep-arrays", "deep-tables"]
    );
    assert_eq!(count(&conn, &dlq).await, 3, "listing removed nothing");

    // peek: the cut header and why, bounded output.
    for id in ["deep-arrays", "deep-tables"] {
        let peek = cli(&["dlq", "peek", "hq", id, "--prefix", &p]).ok();
        assert!(peek.stdout.contains(HEADERS_REMOVED), "{}", peek.stdout);
        assert!(
            peek.stdout.contains("removed by redeliver"),
            "{}",
            peek.stdout
        );
        assert!(peek.stdout.len() < 16 * 1024, "{} bytes", peek.stdout.len());
    }

    // replay one: the copy in the queue carries the cut header, no longer deep.
    let one = cli(&[
        "dlq",
        "replay",
        "hq",
        "--prefix",
        &p,
        "--message-id",
        "deep-arrays",
    ])
    .ok();
    assert!(one.stdout.contains("moved 1 message(s)"), "{}", one.stdout);
    assert_eq!(count(&conn, &q).await, 1);
    assert_eq!(count(&conn, &dlq).await, 2);

    // purge the rest.
    let done = cli(&["dlq", "purge", "hq", "--prefix", &p, "--yes"]).ok();
    assert!(
        done.stdout
            .contains(&format!("purged 2 message(s) from '{dlq}'")),
        "{}",
        done.stdout
    );
    assert_eq!(count(&conn, &dlq).await, 0);
}
