//! Bad input: every malformed message ends in the DLQ (or, for a bad delay routing key, parked
//! in the delay infrastructure's unroutable queue), after a bounded number of handler calls,
//! and the worker keeps serving good messages afterwards. Nothing is lost.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use redeliver_testkit::reliability;
use redeliver_testkit::Got;

use std::collections::{HashMap, HashSet};
use std::panic::AssertUnwindSafe;

use futures::FutureExt;
use std::time::{Duration, Instant};

use redeliver::amqp::headers::{ATTEMPT, X_DEATH};
use redeliver::lapin::types::{AMQPValue, FieldArray, FieldTable, LongString};
use redeliver::lapin::BasicProperties;
use redeliver::QueueType;
use reliability::{report, Scenario, Shape};

const MAX_RETRIES: u32 = 3;
const TRIES: usize = MAX_RETRIES as usize + 1;
/// The largest bodies: 50 MiB, or just under the broker's `max_message_size` when that is
/// smaller (16 MiB by default from RabbitMQ 4.0, which refuses a larger publish by closing the
/// channel), leaving room for the JSON around the padding.
fn big_body_len(version: redeliver::amqp::BrokerVersion) -> usize {
    (50 * 1024 * 1024).min(version.default_max_message_size() - 4096)
}

/// Where a message must end up, and after how many handler calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Expect {
    /// Recorded as a success after exactly this many calls.
    Ok(usize),
    /// In the DLQ after exactly this many handler calls (0: rejected before the handler).
    Dlq(usize),
    /// In the delay infrastructure's unroutable queue.
    Parked,
}

struct Case {
    id: String,
    what: String,
    expect: Expect,
}

fn text(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s.as_bytes()))
}

fn json(id: &str, mode: &str) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({ "id": id, "mode": mode })).expect("serialize")
}

fn props(id: &str, content_type: Option<&str>, headers: Option<FieldTable>) -> BasicProperties {
    let mut p = BasicProperties::default()
        .with_message_id(id.into())
        .with_delivery_mode(2);
    if let Some(ct) = content_type {
        p = p.with_content_type(ct.into());
    }
    if let Some(h) = headers {
        p = p.with_headers(h);
    }
    p
}

fn table(entries: Vec<(&str, AMQPValue)>) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in entries {
        t.insert(k.into(), v);
    }
    t
}

/// A well-formed `x-death` claiming `count` earlier rejections from `queue`.
fn forged_x_death(queue: &str, count: i64) -> AMQPValue {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::FieldTable(table(vec![
        ("count", AMQPValue::LongLongInt(count)),
        ("reason", text("rejected")),
        ("queue", text(queue)),
        ("exchange", text("")),
        (
            "routing-keys",
            AMQPValue::FieldArray(FieldArray::from(vec![text(queue)])),
        ),
        ("time", AMQPValue::Timestamp(now)),
    ]))]))
}

/// Malformed `x-death` values RabbitMQ 3.10.8 dead-letters without trouble (measured one by one
/// on a dedicated node): they replace or sit beside the entry the broker writes.
fn tolerated_x_death(queue: &str) -> Vec<(&'static str, AMQPValue)> {
    let entry = |q: &str, reason: &str, count: AMQPValue| {
        AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::FieldTable(table(vec![
            ("count", count),
            ("reason", text(reason)),
            ("queue", text(q)),
        ]))]))
    };
    vec![
        ("x-death-string", text("forged")),
        (
            "x-death-table",
            AMQPValue::FieldTable(table(vec![("count", AMQPValue::LongLongInt(1))])),
        ),
        (
            "x-death-empty-array",
            AMQPValue::FieldArray(FieldArray::from(vec![])),
        ),
        (
            "x-death-negative-count",
            entry(queue, "rejected", AMQPValue::LongLongInt(-5)),
        ),
        (
            "x-death-other-queue-text-count",
            entry("elsewhere", "expired", text("many")),
        ),
    ]
}

/// Malformed `x-death` values that crash RabbitMQ 3.10.8's dead-lettering
/// (`rabbit_dead_letter:update_x_death_header`, function_clause) when the broker dead-letters
/// the message: an array element that is not a table, or a non-numeric `count` in the entry for
/// the same queue and reason.
fn crashing_x_death(queue: &str) -> Vec<(&'static str, AMQPValue)> {
    vec![
        (
            "x-death-array-of-junk",
            AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::LongLongInt(7), text("x")])),
        ),
        (
            "x-death-text-count",
            AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::FieldTable(table(vec![
                ("count", text("many")),
                ("reason", text("rejected")),
                ("queue", text(queue)),
            ]))])),
        ),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_ends_in_the_dlq_and_the_worker_keeps_serving() {
    let version = redeliver_testkit::broker_version().await;
    let big = big_body_len(version);
    report(format!("RabbitMQ {version}: largest bodies {big} bytes"));
    let s = Scenario::new("input", Shape::default()).await;
    s.run(|s| async move {
        let started = Instant::now();
        let queue = s.queue();
        let mut w = s
            .worker()
            .arg("require-content-type", "application/json")
            .arg("max-retries", MAX_RETRIES)
            .arg("retry-base-ms", 20)
            .arg("retry-cap-ms", 100)
            .arg("concurrency", 4)
            .arg("prefetch", 8)
            .spawn("w");
        s.wait_consumers(1, Duration::from_secs(30)).await;

        let mut cases: Vec<Case> = Vec::new();
        let mut n = 0;
        let mut next_id = |what: &str| {
            n += 1;
            format!("{}bad{n:03}-{what}", s.prefix)
        };
        let json_ct = Some("application/json");

        // -- bodies the JSON decoder refuses: rejected before the handler runs
        let bodies: Vec<(&str, Vec<u8>)> = vec![
            ("invalid-json", br#"{"id": "x", "mode": "#.to_vec()),
            ("non-utf8", vec![0xff, 0xfe, 0xfd, 0x00, 0xc3, 0x28, 0x80]),
            ("empty-body", Vec::new()),
            ("json-not-an-object", b"[1, 2, 3]".to_vec()),
            ("big-not-json", vec![b'x'; big]),
        ];
        for (what, body) in bodies {
            let id = next_id(what);
            s.publish_raw("", &queue, &body, props(&id, json_ct, None))
                .await;
            cases.push(Case {
                id,
                what: what.into(),
                expect: Expect::Dlq(0),
            });
        }
        // A valid JSON body of that size is just a message: processed and acked.
        {
            let id = next_id("big-json");
            let pad = "p".repeat(big);
            let body =
                serde_json::to_vec(&serde_json::json!({ "id": id, "mode": "ok", "pad": pad }))
                    .expect("serialize");
            s.publish_raw("", &queue, &body, props(&id, json_ct, None))
                .await;
            cases.push(Case {
                id,
                what: "big-json".into(),
                expect: Expect::Ok(1),
            });
        }

        // -- wrong or missing content type: the handler refuses it as a permanent error
        for (what, ct) in [
            ("content-type-xml", Some("application/xml")),
            ("no-content-type", None),
        ] {
            let id = next_id(what);
            s.publish_raw("", &queue, &json(&id, "ok"), props(&id, ct, None))
                .await;
            cases.push(Case {
                id,
                what: what.into(),
                expect: Expect::Dlq(1),
            });
        }

        // -- garbage x-redeliver-attempt: anything but an integer in u32 range counts as 0, so a
        // failing message still gets exactly MAX_RETRIES retries; u32::MAX is a (huge) valid
        // count, so a failing message is dead-lettered at once. Never a crash, never a loop.
        let attempts: Vec<(&str, AMQPValue, usize)> = vec![
            ("attempt-negative", AMQPValue::LongLongInt(-1), TRIES),
            ("attempt-i64-min", AMQPValue::LongLongInt(i64::MIN), TRIES),
            ("attempt-i64-max", AMQPValue::LongLongInt(i64::MAX), TRIES),
            (
                "attempt-u32-max",
                AMQPValue::LongLongInt(i64::from(u32::MAX)),
                1,
            ),
            ("attempt-string", text("2"), TRIES),
            ("attempt-text", text("lots"), TRIES),
            (
                "attempt-array",
                AMQPValue::FieldArray(FieldArray::from(vec![
                    AMQPValue::LongLongInt(1),
                    AMQPValue::LongLongInt(2),
                ])),
                TRIES,
            ),
            ("attempt-double", AMQPValue::Double(2.5), TRIES),
            ("attempt-bool", AMQPValue::Boolean(true), TRIES),
            (
                "attempt-table",
                AMQPValue::FieldTable(FieldTable::default()),
                TRIES,
            ),
            ("attempt-void", AMQPValue::Void, TRIES),
        ];
        for (what, value, tries) in attempts {
            let id = next_id(&format!("{what}-fail"));
            let h = table(vec![(ATTEMPT, value.clone())]);
            s.publish_raw("", &queue, &json(&id, "fail"), props(&id, json_ct, Some(h)))
                .await;
            cases.push(Case {
                id,
                what: format!("{what} (failing)"),
                expect: Expect::Dlq(tries),
            });
            let id = next_id(&format!("{what}-ok"));
            let h = table(vec![(ATTEMPT, value)]);
            s.publish_raw("", &queue, &json(&id, "ok"), props(&id, json_ct, Some(h)))
                .await;
            cases.push(Case {
                id,
                what: format!("{what} (succeeding)"),
                expect: Expect::Ok(1),
            });
        }

        // -- forged x-death: the worker counts attempts in its own header, so a forged count
        // changes nothing. Malformed values the broker tolerates must still reach the DLQ
        // (`permanent` makes the worker reject the very delivery carrying the header, so the
        // broker's dead-lettering reads it). The malformed values that crash RabbitMQ 3.10's
        // dead-lettering are not sent to the shared broker: see `malformed_x_death_*` below.
        for (mode, expect) in [
            ("fail", Expect::Dlq(TRIES)),
            ("ok", Expect::Ok(1)),
            ("permanent", Expect::Dlq(1)),
        ] {
            let id = next_id(&format!("x-death-forged-{mode}"));
            let h = table(vec![(X_DEATH, forged_x_death(&queue, 1000))]);
            s.publish_raw("", &queue, &json(&id, mode), props(&id, json_ct, Some(h)))
                .await;
            cases.push(Case {
                id,
                what: format!("forged x-death count 1000 ({mode})"),
                expect,
            });
        }
        for (what, value) in tolerated_x_death(&queue) {
            for (mode, expect) in [("permanent", Expect::Dlq(1)), ("fail", Expect::Dlq(TRIES))] {
                let id = next_id(&format!("{what}-{mode}"));
                let h = table(vec![(X_DEATH, value.clone())]);
                s.publish_raw("", &queue, &json(&id, mode), props(&id, json_ct, Some(h)))
                    .await;
                cases.push(Case {
                    id,
                    what: format!("{what} ({mode})"),
                    expect,
                });
            }
        }

        // -- routing keys with topic wildcards (or otherwise malformed) published straight to
        // the delay exchanges: no binding matches them, so the alternate exchange must park
        // them in the unroutable queue rather than the broker dropping them.
        let levels = s.shape.delay_levels;
        let zeros = |k: usize| vec!["0"; k].join(".");
        let top = s.delay().level_name(levels - 1);
        let keys: Vec<(String, String, &str)> = vec![
            (top.clone(), "#".into(), "key-hash"),
            (top.clone(), "*".into(), "key-star"),
            (top.clone(), "*.*.#".into(), "key-stars-hash"),
            (top.clone(), format!("#.{queue}"), "key-hash-queue"),
            (s.delay().level_name(3), "1.#".into(), "key-short"),
            (
                s.delay().deliver_exchange(),
                format!("{}.#", zeros(levels as usize)),
                "key-deliver-hash",
            ),
            (
                s.delay().deliver_exchange(),
                format!("{}.*", zeros(levels as usize)),
                "key-deliver-star",
            ),
            (
                s.delay().deliver_exchange(),
                "#".into(),
                "key-deliver-bare-hash",
            ),
            // Right shape, no such queue: goes through level 0 (10 ms), then finds no binding
            // on the deliver exchange.
            (
                s.delay().level_name(0),
                format!("{}.1.{}no.such.queue", zeros(levels as usize - 1), s.prefix),
                "key-no-such-queue",
            ),
        ];
        for (exchange, key, what) in keys {
            let id = next_id(what);
            s.publish_raw(&exchange, &key, &json(&id, "ok"), props(&id, json_ct, None))
                .await;
            cases.push(Case {
                id,
                what: format!("{what} ({exchange} / {key})"),
                expect: Expect::Parked,
            });
        }

        // -- the worker still serves good messages after all of the above
        let good = s.publish(50).await;
        let mut ids: Vec<String> = cases.iter().map(|c| c.id.clone()).collect();
        ids.extend(good.iter().cloned());
        let expected_parked = cases.iter().filter(|c| c.expect == Expect::Parked).count();
        let waited: HashSet<String> = cases
            .iter()
            .filter(|c| c.expect != Expect::Parked)
            .map(|c| c.id.clone())
            .chain(good.iter().cloned())
            .collect();
        let settled = s.wait_settled(&waited, Duration::from_secs(90)).await;
        let deadline = Instant::now() + Duration::from_secs(20);
        while s.counts().await.unroutable < expected_parked as u32 {
            assert!(
                Instant::now() < deadline,
                "parked messages missing: {:?}",
                s.counts().await
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(w.is_running(), "the worker died:\n{}", w.log_tail(40));
        w.terminate(Duration::from_secs(10)).await;

        let acc = s.account(&ids).await;
        acc.assert_settled_parked("bad input", expected_parked);
        acc.assert_duplicates_at_most("bad input", 0, false);
        acc.assert_dead_lettered_once("bad input");
        let succeeded = s.succeeded();
        let mut calls: HashMap<String, usize> = HashMap::new();
        for (id, _, _) in s.calls() {
            *calls.entry(id).or_default() += 1;
        }
        let in_dlq: HashMap<&str, &Got> = acc.dlq.iter().map(|g| (g.message_id(), g)).collect();
        let parked: HashSet<&str> = acc
            .unroutable_messages
            .iter()
            .map(Got::message_id)
            .collect();
        let mut failures = Vec::new();
        for c in &cases {
            let n_calls = calls.get(&c.id).copied().unwrap_or(0);
            let ok = match c.expect {
                Expect::Ok(k) => succeeded.get(&c.id) == Some(&1) && n_calls == k,
                Expect::Dlq(k) => {
                    in_dlq
                        .get(c.id.as_str())
                        .is_some_and(|g| g.death_reason().as_deref() == Some("rejected"))
                        && n_calls == k
                }
                Expect::Parked => parked.contains(c.id.as_str()),
            };
            report(format!(
                "  {:<55} expected {:?}: {} ({n_calls} handler call(s))",
                c.what,
                c.expect,
                if ok { "ok" } else { "WRONG" }
            ));
            if !ok {
                failures.push(c.what.clone());
            }
        }
        let big_in_dlq = in_dlq
            .values()
            .find(|g| g.message_id().ends_with("big-not-json"))
            .map(|g| g.body.len());
        assert_eq!(
            big_in_dlq,
            Some(big),
            "the largest body must reach the DLQ whole"
        );
        assert!(
            good.iter().all(|id| succeeded.contains_key(id)),
            "good messages after bad input not all served"
        );
        assert!(
            failures.is_empty(),
            "cases not handled as expected: {failures:?}"
        );
        report(format!(
            "bad input: {} cases ({} in DLQ, {} parked, {} succeeded) + 50 good; settled in \
             {settled:?}, total {:?}",
            cases.len(),
            acc.dead_lettered,
            acc.unroutable,
            acc.succeeded - good.len(),
            started.elapsed()
        ));
    })
    .await;
}

/// Malformed `x-death` headers that RabbitMQ 3.10.8's own dead-lettering crashes on (RELIABILITY.md,
/// "Findings"). The worker republishes such a message without the bad entries before anything can
/// make the broker dead-letter it, so the promise holds: every message ends in the DLQ or
/// succeeded, and dead-lettering keeps working for what comes after. Runs on a dedicated node,
/// never on the shared broker: should the worker ever let one through, the crash on a quorum
/// queue takes down the node-wide supervisor of every quorum queue's dead-letter worker.
///
/// `cargo test --test reliability_input malformed_x_death -- --nocapture`
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_x_death_reaches_the_dlq_without_breaking_dead_lettering() {
    let nodes = redeliver_testkit::nodes::Nodes::start("rdpoison", 1, 5693, false).await;
    let mut failures = Vec::new();
    for queue_type in [QueueType::Quorum, QueueType::Classic] {
        let shape = Shape {
            url: nodes.amqp_url(1),
            queue_type,
            ..Shape::default()
        };
        let label = format!("poison-{}", queue_type.as_str());
        let s = Scenario::new(&label, shape).await;
        let outcome = std::sync::Arc::new(std::sync::Mutex::new(None));
        let out = std::sync::Arc::clone(&outcome);
        let nodes = &nodes;
        let run = s.run(|s| async move {
            let queue = s.queue();
            let mut w = s
                .worker()
                .arg("max-retries", MAX_RETRIES)
                .arg("retry-base-ms", 20)
                .arg("retry-cap-ms", 100)
                .spawn("w");
            s.wait_consumers(1, Duration::from_secs(30)).await;
            let mut ids = Vec::new();
            let mut refused = Vec::new();
            for (what, value) in crashing_x_death(&queue) {
                let id = format!("{}{what}", s.prefix);
                let h = table(vec![(X_DEATH, value)]);
                let body = json(&id, "permanent");
                let p = props(&id, Some("application/json"), Some(h));
                // A nack is not a loss (the publisher knows), but it is reported.
                match s.try_publish_raw("", &queue, &body, p).await {
                    Ok(()) => ids.push(id),
                    Err(e) => refused.push(format!("{what}: {e}")),
                }
                // One at a time, so each poison meets the broker on its own.
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            // After the poison: a message that needs the delay levels (fails twice, then the
            // DLQ) and plain ones, to see whether dead-lettering still works at all.
            let later: Vec<String> = (0..20).map(|i| format!("{}after-{i}", s.prefix)).collect();
            for (i, id) in later.iter().enumerate() {
                let body = json(id, if i == 0 { "fail" } else { "ok" });
                let p = props(id, Some("application/json"), None);
                match s.try_publish_raw("", &queue, &body, p).await {
                    Ok(()) => ids.push(id.clone()),
                    Err(e) => refused.push(format!("{id}: {e}")),
                }
            }
            let set: HashSet<String> = ids.iter().cloned().collect();
            let settled = s.try_wait_settled(&set, Duration::from_secs(20)).await;
            w.terminate(Duration::from_secs(10)).await;
            let sup = nodes.eval(1, "whereis(rabbit_fifo_dlx_sup).").await;
            let acc = s.account(&ids).await;
            let missing: Vec<String> = acc
                .lost
                .iter()
                .map(|id| id.trim_start_matches(&s.prefix).to_owned())
                .collect();
            report(format!(
                "{}: {}; settled: {settled:?}; rabbit_fifo_dlx_sup: {sup}; not found: {missing:?}; \
                 publishes refused: {refused:?}",
                s.name,
                acc.summary()
            ));
            // Repair the node for whatever runs next on it (the poison is deleted with the queue).
            let _ = nodes
                .eval(
                    1,
                    "supervisor:restart_child(rabbit_sup, rabbit_fifo_dlx_sup).",
                )
                .await;
            *out.lock().unwrap_or_else(|p| p.into_inner()) = Some((
                acc.lost.len(),
                settled.is_ok(),
                acc.settled_twice + acc.duplicate_total(),
            ));
        });
        // A broker-side crash can make even the accounting fail (a classic queue that "crashed
        // and failed to restart"): record it and go on with the next queue type.
        if let Err(panic) = AssertUnwindSafe(run).catch_unwind().await {
            let msg = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_default();
            report(format!("{label}: aborted: {msg}"));
            let _ = nodes
                .eval(
                    1,
                    "supervisor:restart_child(rabbit_sup, rabbit_fifo_dlx_sup).",
                )
                .await;
            failures.push(format!("{label}: {msg}"));
            continue;
        }
        let result = *outcome.lock().unwrap_or_else(|p| p.into_inner());
        // No fault here costs a redelivery: nothing may be settled or handled twice.
        if result != Some((0, true, 0)) {
            failures.push(format!(
                "{label}: (lost, settled, duplicates + re-handled) = {result:?}"
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "malformed x-death broke the promise: {failures:?}"
    );
}
