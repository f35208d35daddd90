//! The CLI's `redeliver dlq replay` killed with SIGKILL mid-run, twice, on a DLQ holding N
//! messages, then run again to completion: nothing is lost, everything is back in the work
//! queue, and each kill costs at most one duplicate.
//!
//! A replay publishes one copy at a time to Q, waits for the broker's confirm, and only then
//! acks the DLQ copy. A kill can therefore leave at most the one message in flight in both
//! queues (copy published or confirmed, DLQ copy not yet acked); every other unacked DLQ message
//! goes back to the DLQ when the connection drops, and the next run moves it.

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use redeliver_testkit::process::{LoggedChild, Output};
use redeliver_testkit::reliability;

use std::collections::{HashMap, HashSet};
use std::process::Command;
use std::time::{Duration, Instant};

use reliability::{report, Scenario, Shape};

const N: usize = 2000;
/// Fractions of N moved at which a run is killed.
const KILL_AT: [f64; 2] = [0.25, 0.6];

fn replay_cmd(s: &Scenario) -> Command {
    let mut cmd = Command::new(Scenario::cli_binary());
    // The URL holds the password: in the environment, never on the command line.
    cmd.args(["dlq", "replay", &s.short_queue, "--prefix", &s.prefix])
        .env("AMQP_URL", &s.shape.url)
        .env_remove("AMQP_URL_FILE");
    cmd
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_replay_killed_mid_run_loses_nothing() {
    let s = Scenario::new("replay", Shape::default()).await;
    s.run(|s| async move {
        let started = Instant::now();
        let queue = s.queue();
        let dlq = s.dlq();
        let ids: Vec<String> = (0..N).map(|i| format!("{}m{i:06}", s.prefix)).collect();
        s.publish_ids_to(&dlq, &ids, |_| None).await;
        assert_eq!(
            s.queue_state(&dlq).await.0 as usize,
            N,
            "the DLQ holds the N"
        );
        // Built before the first run, so the timing below is the replay's alone.
        let _ = Scenario::cli_binary();

        let mut kills = 0;
        for (round, at) in KILL_AT.into_iter().enumerate() {
            let want = (N as f64 * at) as u32;
            let mut run = LoggedChild::spawn(
                replay_cmd(&s),
                &format!("replay-{round}"),
                s.dir.join(format!("replay-{round}.log")),
            );
            let deadline = Instant::now() + Duration::from_secs(120);
            let moved = loop {
                let (ready, _) = s.queue_state(&queue).await;
                if ready >= want {
                    break ready;
                }
                assert!(
                    run.is_running(),
                    "replay {round} exited before {want} of {N} were in the work queue \
                     ({ready} there):\n{}",
                    run.log_tail(20)
                );
                assert!(
                    Instant::now() < deadline,
                    "replay {round}: only {ready} moved"
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
            };
            assert!(
                run.is_running(),
                "replay {round} finished before it could be killed:\n{}",
                run.log_tail(20)
            );
            run.kill();
            kills += 1;
            // The broker requeues the dead connection's unacked DLQ messages: wait until every
            // message is ready again in one of the two queues.
            let deadline = Instant::now() + Duration::from_secs(60);
            let (q, d) = loop {
                let q = s.queue_state(&queue).await.0 as usize;
                let d = s.queue_state(&dlq).await.0 as usize;
                if q + d >= N {
                    break (q, d);
                }
                assert!(
                    Instant::now() < deadline,
                    "after the kill only {q} in the work queue and {d} in the DLQ"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            };
            report(format!(
                "replay {round}: SIGKILL with at least {moved} of {N} in the work queue; then \
                 {q} in the work queue, {d} in the DLQ ({} in both)",
                (q + d).saturating_sub(N)
            ));
        }

        // The last run goes to completion.
        let mut cmd = replay_cmd(&s);
        let out = tokio::task::spawn_blocking(move || Output::of(&mut cmd))
            .await
            .expect("replay task")
            .ok();
        report(format!("final replay: {}", out.stdout.trim()));

        let left = s.drain(&dlq).await;
        let back = s.drain(&queue).await;
        let mut copies: HashMap<&str, usize> = HashMap::new();
        for g in &back {
            *copies.entry(g.message_id()).or_default() += 1;
        }
        let lost: Vec<&String> = ids
            .iter()
            .filter(|id| !copies.contains_key(id.as_str()))
            .collect();
        let published: HashSet<&str> = ids.iter().map(String::as_str).collect();
        let foreign = back
            .iter()
            .filter(|g| !published.contains(g.message_id()))
            .count();
        let duplicates = back.len() - copies.len();
        // Named, so a failure says which messages the kills duplicated.
        let mut duplicated: Vec<(&str, usize)> = copies
            .iter()
            .filter(|(_, n)| **n > 1)
            .map(|(id, n)| (*id, n - 1))
            .collect();
        duplicated.sort();
        report(format!(
            "RESULT fault=\"dlq replay SIGKILLed, {kills} kills\" broker=\"{}\" N={N} lost={} \
             duplicates={duplicates} left-in-dlq={} bound={kills} duplicated-ids={duplicated:?}; \
             total {:?}",
            s.broker,
            lost.len(),
            left.len(),
            started.elapsed()
        ));
        assert!(
            left.is_empty(),
            "{} message(s) still in the DLQ after a complete replay",
            left.len()
        );
        assert!(
            lost.is_empty(),
            "{} message(s) lost, e.g. {:?}",
            lost.len(),
            &lost[..lost.len().min(10)]
        );
        assert_eq!(foreign, 0, "messages of another scenario in the work queue");
        assert!(
            duplicates <= kills,
            "{duplicates} duplicates after {kills} kills: more than the message in flight at each: \
             {duplicated:?}"
        );
    })
    .await;
}
