//! `dlq list|peek|replay|purge` and the same operations on the unroutable parking queue.
//!
//! Both kinds of queue are read with [`crate::browse::Reader`], so a listing never reorders or
//! drops anything, and a replay acknowledges a message only after its copy is confirmed.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::Context as _;
use lapin::options::{BasicAckOptions, QueuePurgeOptions};
use lapin::Connection;
use redeliver_amqp::delay::DelayConfig;
use redeliver_amqp::publisher::{PublishError, Publisher};

use crate::browse::{self, Reader, IDLE, MAX_PREFETCH};
use crate::message::{self, Summary};
use crate::output;

/// Which queue a command reads, and what its messages are.
#[derive(Clone, Debug)]
pub enum Source {
    /// `Q.dlq`: messages go back to `home` (Q), with their retry state reset.
    Dlq { dlq: String, home: String },
    /// `{prefix}redeliver.delay.unroutable`: messages go to the queue named in their routing
    /// key (after `levels` bit words), retry state kept. `only` filters by that destination.
    Unroutable {
        queue: String,
        levels: u8,
        only: Option<String>,
    },
}

impl Source {
    fn queue(&self) -> &str {
        match self {
            Source::Dlq { dlq, .. } => dlq,
            Source::Unroutable { queue, .. } => queue,
        }
    }

    fn summarize(&self, position: usize, d: &lapin::message::Delivery) -> Summary {
        match self {
            Source::Dlq { home, .. } => message::summarize(position, d, Some(home), None),
            Source::Unroutable { levels, .. } => {
                message::summarize(position, d, None, Some(*levels))
            }
        }
    }

    /// False for messages excluded by `--queue` on the parking queue.
    fn wanted(&self, s: &Summary) -> bool {
        match self {
            Source::Unroutable { only: Some(q), .. } => s.destination.as_deref() == Some(q),
            _ => true,
        }
    }
}

/// `list`: prints a table (or JSON array) of up to `limit` messages from the head.
pub async fn list(conn: &Connection, src: &Source, limit: u32, json: bool) -> anyhow::Result<()> {
    let queue = src.queue();
    let (counts, deliveries) = browse::snapshot(conn, queue, limit).await?;
    let rows: Vec<Summary> = deliveries
        .iter()
        .enumerate()
        .map(|(i, d)| src.summarize(i + 1, d))
        .filter(|s| src.wanted(s))
        .collect();
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&rows).context("cannot encode the listing as JSON")?
        );
        return Ok(());
    }
    if counts.messages == 0 {
        println!("'{queue}' is empty");
        return Ok(());
    }
    println!(
        "'{queue}': {} message(s) ready, showing {} from the head (read at {}, nothing removed)",
        counts.messages,
        rows.len(),
        message::now_rfc3339()
    );
    print!(
        "{}",
        output::summary_table(&rows, matches!(src, Source::Unroutable { .. }))
    );
    if (deliveries.len() as u64) < u64::from(counts.messages.min(limit)) {
        eprintln!(
            "note: the broker handed out {} of the {} expected messages within {}s (another \
             consumer on '{queue}'?)",
            deliveries.len(),
            counts.messages.min(limit),
            IDLE.as_secs()
        );
    }
    Ok(())
}

/// `peek`: prints the first message with `message_id` in full.
pub async fn peek(
    conn: &Connection,
    src: &Source,
    message_id: &str,
    json: bool,
) -> anyhow::Result<()> {
    let queue = src.queue();
    let (counts, deliveries) = browse::snapshot(conn, queue, MAX_PREFETCH).await?;
    let found = deliveries.iter().enumerate().find(|(_, d)| {
        d.properties
            .message_id()
            .as_ref()
            .is_some_and(|m| m.as_str() == message_id)
    });
    let Some((i, d)) = found else {
        anyhow::bail!(
            "no message with message_id '{message_id}' among the {} message(s) read from \
             '{queue}' ({} ready); list them with `redeliver {} list`",
            deliveries.len(),
            counts.messages,
            match src {
                Source::Dlq { .. } => "dlq",
                Source::Unroutable { .. } => "unroutable",
            }
        );
    };
    if json {
        let v = output::message_json(i + 1, queue, d);
        println!(
            "{}",
            serde_json::to_string_pretty(&v).context("cannot encode the message as JSON")?
        );
    } else {
        print!("{}", output::message_text(i + 1, queue, d));
    }
    Ok(())
}

/// What `replay` should move.
#[derive(Clone, Debug, Default)]
pub struct Selection {
    pub limit: Option<u64>,
    pub message_ids: Vec<String>,
    pub dry_run: bool,
    /// Unroutable only: publish everything here instead of the routing key's destination.
    pub to: Option<String>,
}

/// `replay`. Reads at most the messages that were ready when it started (so messages that a
/// failing handler dead-letters again during the replay are not replayed in a loop), publishes
/// each selected one to its destination through the default exchange and waits for the
/// broker's confirm, then acknowledges the source copy. Unselected messages are never
/// acknowledged and go back in order when the channel closes.
pub async fn replay(
    conn: &Connection,
    src: &Source,
    sel: &Selection,
    delay: DelayConfig,
) -> anyhow::Result<()> {
    let queue = src.queue().to_owned();
    let counts = browse::require_queue(conn, &queue).await?;
    if let Source::Dlq { home, .. } = src {
        // Fail before touching anything if Q is gone: the mandatory publish would be returned.
        browse::require_queue(conn, home).await?;
    }
    if let Some(to) = &sel.to {
        browse::require_queue(conn, to).await?;
    }
    let filtering =
        !sel.message_ids.is_empty() || matches!(src, Source::Unroutable { only: Some(_), .. });
    let limit = sel.limit.unwrap_or(u64::MAX);
    let scan = if filtering {
        u64::from(counts.messages)
    } else {
        u64::from(counts.messages).min(limit)
    };
    if scan == 0 {
        println!("'{queue}' is empty: nothing to replay");
        return finish_ids(sel, &[]);
    }
    // Unselected messages stay unacknowledged while we look further, so a filtered replay needs
    // a window as large as the scan; an unfiltered one acknowledges as it goes.
    let prefetch = if filtering {
        scan.min(u64::from(MAX_PREFETCH)) as u32
    } else {
        scan.min(256) as u32
    };
    let publisher = if sel.dry_run {
        None
    } else {
        Some(
            Publisher::new(conn, delay)
                .await
                .context("cannot open a confirm-mode channel for publishing")?,
        )
    };

    // Ctrl-C stops between two messages instead of killing the process mid-move (which would
    // also be safe, at worst a duplicate, but leaves no report).
    let stop = Arc::new(AtomicBool::new(false));
    {
        let stop = stop.clone();
        tokio::spawn(async move {
            if tokio::signal::ctrl_c().await.is_ok() {
                stop.store(true, Ordering::SeqCst);
            }
        });
    }

    // With --message-id the bar counts the requested ids; otherwise the messages scanned.
    let bar = output::progress(
        if sel.message_ids.is_empty() {
            scan.min(limit)
        } else {
            sel.message_ids.len() as u64
        },
        "replaying",
    );
    let mut reader = Reader::open(conn, &queue, prefetch).await?;
    let mut report = Report::default();
    let outcome = replay_loop(
        &mut reader,
        src,
        sel,
        scan,
        limit,
        publisher.as_ref(),
        &stop,
        &bar,
        &mut report,
    )
    .await;
    bar.finish_and_clear();
    let closed = reader.close().await;

    let verb = if sel.dry_run { "would move" } else { "moved" };
    let dest = match (src, &sel.to) {
        (_, Some(to)) => format!("'{to}'"),
        (Source::Dlq { home, .. }, None) => format!("'{home}'"),
        (Source::Unroutable { .. }, None) => "their destination queues".to_owned(),
    };
    println!(
        "{verb} {} message(s) from '{queue}' to {dest}{}",
        report.moved,
        if sel.dry_run {
            " (dry run: nothing changed)"
        } else {
            ""
        }
    );
    if report.interrupted {
        println!("interrupted: the remaining messages are still in '{queue}'");
    }
    for s in &report.skipped {
        eprintln!("skipped: {s}");
    }
    outcome?;
    closed?;
    if !report.skipped.is_empty() {
        anyhow::bail!(
            "{} message(s) could not be replayed and are still in '{queue}'",
            report.skipped.len()
        );
    }
    finish_ids(sel, &report.seen_ids)
}

/// Requested message ids that were not found make the command fail (exit 1) after the others
/// were moved: a typo must not look like success.
fn finish_ids(sel: &Selection, seen: &[String]) -> anyhow::Result<()> {
    let missing: Vec<&str> = sel
        .message_ids
        .iter()
        .filter(|id| !seen.contains(id))
        .map(String::as_str)
        .collect();
    if missing.is_empty() {
        Ok(())
    } else {
        anyhow::bail!(
            "no message with message_id {} was found",
            missing
                .iter()
                .map(|m| format!("'{m}'"))
                .collect::<Vec<_>>()
                .join(", ")
        )
    }
}

#[derive(Default)]
struct Report {
    moved: u64,
    skipped: Vec<String>,
    seen_ids: Vec<String>,
    interrupted: bool,
}

#[allow(clippy::too_many_arguments)] // one call site; a struct would only rename the list
async fn replay_loop(
    reader: &mut Reader,
    src: &Source,
    sel: &Selection,
    scan: u64,
    limit: u64,
    publisher: Option<&Publisher>,
    stop: &AtomicBool,
    bar: &indicatif::ProgressBar,
    report: &mut Report,
) -> anyhow::Result<()> {
    let queue = src.queue();
    for position in 1..=scan {
        if stop.load(Ordering::SeqCst) {
            report.interrupted = true;
            break;
        }
        if report.moved >= limit {
            break;
        }
        let Some(d) = reader.next(IDLE).await? else {
            break;
        };
        let summary = src.summarize(position as usize, &d);
        let id = summary.message_id.clone();
        if !sel.message_ids.is_empty() {
            match &id {
                Some(m) if sel.message_ids.contains(m) => report.seen_ids.push(m.clone()),
                _ => continue,
            }
        }
        if !src.wanted(&summary) {
            continue;
        }
        let label = format!(
            "#{position} message_id {}",
            id.as_deref().unwrap_or("(none)")
        );
        let (dest, reset) = match (src, &sel.to) {
            (Source::Dlq { home, .. }, None) => (home.clone(), true),
            (Source::Dlq { .. }, Some(to)) => (to.clone(), true),
            (Source::Unroutable { .. }, Some(to)) => (to.clone(), false),
            (Source::Unroutable { .. }, None) => match summary.destination.clone() {
                Some(q) => (q, false),
                None => {
                    report.skipped.push(format!(
                        "{label}: routing key '{}' names no destination queue; use --to",
                        d.routing_key
                    ));
                    continue;
                }
            },
        };
        let Some(publisher) = publisher else {
            println!("would move {label} to '{dest}'");
            report.moved += 1;
            continue;
        };
        let props = message::replay_properties(&d.properties, reset);
        // A copy, not a new message: no message_id is invented for one that had none.
        match publisher.publish_copy("", &dest, &d.data, props).await {
            Ok(()) => {}
            Err(PublishError::Returned { .. }) if matches!(src, Source::Unroutable { .. }) => {
                report.skipped.push(format!(
                    "{label}: queue '{dest}' does not exist (the broker returned the copy); \
                     declare it or use --to"
                ));
                continue;
            }
            Err(e) => {
                return Err(anyhow::Error::new(e).context(format!(
                    "could not republish {label} to '{dest}'; it is still in '{queue}' and \
                     {} message(s) were moved before it",
                    report.moved
                )));
            }
        }
        // The copy is safe in `dest`; only now may the source copy go.
        match d.acker.ack(BasicAckOptions::default()).await {
            Ok(true) => {}
            Ok(false) => anyhow::bail!(
                "{label} was published to '{dest}' but the channel on '{queue}' closed before \
                 its copy there could be acknowledged: it stays in '{queue}' too (a duplicate, \
                 same message_id)"
            ),
            Err(e) => {
                return Err(anyhow::Error::new(e).context(format!(
                    "{label} was published to '{dest}' but acknowledging it in '{queue}' failed: \
                     it stays there too (a duplicate, same message_id)"
                )));
            }
        }
        report.moved += 1;
        bar.inc(1);
    }
    Ok(())
}

/// `purge` with a selection (`unroutable purge --queue Q`): removes only the messages `src`
/// wants; every other one goes back to the queue in its place when the reader closes.
pub async fn purge_matching(conn: &Connection, src: &Source) -> anyhow::Result<()> {
    let queue = src.queue().to_owned();
    let counts = browse::require_queue(conn, &queue).await?;
    if counts.messages == 0 {
        println!("'{queue}' is empty: nothing to purge");
        return Ok(());
    }
    let window = counts.messages.min(MAX_PREFETCH);
    let bar = output::progress(u64::from(counts.messages), "scanning");
    let mut reader = Reader::open(conn, &queue, window).await?;
    let (mut purged, mut kept) = (0u64, 0u64);
    let scanned = async {
        // Unselected messages stay unacknowledged (they go back on close), so at most `window`
        // of them can be looked past.
        while purged + kept < u64::from(counts.messages) && kept < u64::from(window) {
            let Some(d) = reader.next(IDLE).await? else {
                break;
            };
            let position = (purged + kept + 1) as usize;
            if src.wanted(&src.summarize(position, &d)) {
                d.acker
                    .ack(BasicAckOptions::default())
                    .await
                    .with_context(|| format!("cannot remove message #{position} from '{queue}'"))?;
                purged += 1;
            } else {
                kept += 1;
            }
            bar.inc(1);
        }
        anyhow::Ok(())
    }
    .await;
    bar.finish_and_clear();
    let closed = reader.close().await;
    scanned?;
    closed?;
    println!(
        "purged {purged} message(s) from '{queue}', kept {kept} in their order{}",
        if purged + kept < u64::from(counts.messages) {
            format!(
                " ({} not examined: run again)",
                u64::from(counts.messages) - purged - kept
            )
        } else {
            String::new()
        }
    );
    Ok(())
}

/// `purge`: deletes every message of `queue`, printing how many.
pub async fn purge(conn: &Connection, queue: &str) -> anyhow::Result<()> {
    browse::require_queue(conn, queue).await?;
    let ch = conn
        .create_channel()
        .await
        .context("cannot open a channel")?;
    let n = ch
        .queue_purge(queue.into(), QueuePurgeOptions::default())
        .await
        .with_context(|| format!("cannot purge '{queue}'"))?;
    let _ = ch.close(200, "ok".into()).await;
    println!("purged {n} message(s) from '{queue}'");
    Ok(())
}
