//! `dlq list|peek|replay|purge` and the same operations on the unroutable parking queue
//! (`dlq list --group-by` and `dlq stats` are in [`crate::triage`]).
//!
//! Both kinds of queue are read with [`crate::browse::Reader`], so a listing never reorders or
//! drops anything, and a replay acknowledges a message only after its copy is confirmed.

use std::borrow::Cow;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::SystemTime;

use anyhow::Context as _;
use lapin::options::QueuePurgeOptions;
use lapin::Connection;
use redeliver_amqp::DelayConfig;
use redeliver_amqp::{PublishError, Publisher};
use serde::Serialize;

use crate::browse::{self, Reader, IDLE, MAX_PREFETCH};
use crate::message::{self, Summary};
use crate::output;
use crate::select::Filter;
use crate::text::escape;

/// Which queue a command reads, and what its messages are.
#[derive(Clone, Debug)]
pub(crate) enum Source {
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
    pub(crate) fn queue(&self) -> &str {
        match self {
            Source::Dlq { dlq, .. } => dlq,
            Source::Unroutable { queue, .. } => queue,
        }
    }

    pub(crate) fn summarize(&self, position: usize, d: &lapin::message::Delivery) -> Summary {
        match self {
            Source::Dlq { home, .. } => message::summarize(position, d.into(), Some(home), None),
            Source::Unroutable { levels, .. } => {
                message::summarize(position, d.into(), None, Some(*levels))
            }
        }
    }

    /// False for messages excluded by `--queue` on the parking queue.
    pub(crate) fn wanted(&self, s: &Summary) -> bool {
        match self {
            Source::Unroutable { only: Some(q), .. } => s.destination.as_deref() == Some(q),
            _ => true,
        }
    }

    /// `--queue Q` of the parking queue, as reports quote it.
    fn selection(&self) -> Option<String> {
        match self {
            Source::Unroutable { only: Some(q), .. } => Some(format!("--queue {q}")),
            _ => None,
        }
    }

    fn is_parked(&self) -> bool {
        matches!(self, Source::Unroutable { .. })
    }
}

/// `list`: prints a table (or JSON array) of up to `limit` messages from the head.
pub(crate) async fn list(
    conn: &Connection,
    src: &Source,
    limit: u32,
    json: bool,
) -> anyhow::Result<()> {
    let queue = src.queue();
    // Summaries as the messages come: the bodies are not kept, only bounded previews.
    let mut rows: Vec<Summary> = Vec::new();
    let mut position = 0usize;
    let scanned = browse::scan(conn, queue, limit, "reading", |d| {
        position += 1;
        let s = src.summarize(position, &d);
        if src.wanted(&s) {
            rows.push(s);
        }
    })
    .await?;
    let note = scanned.shortfall_note(queue);
    if json {
        if let Some(note) = note {
            eprintln!("{note}");
        }
        return output::print_json(&rows, "the listing");
    }
    if scanned.counts.messages == 0 {
        println!("'{queue}' is empty");
        return Ok(());
    }
    println!(
        "'{queue}': {} message(s) ready, showing {} from the head (read at {}, nothing removed)",
        scanned.counts.messages,
        rows.len(),
        message::now_rfc3339()
    );
    print!("{}", output::summary_table(&rows, src.is_parked()));
    if let Some(note) = note {
        eprintln!("{note}");
    }
    Ok(())
}

/// `peek`: prints the first message with `message_id` in full.
pub(crate) async fn peek(
    conn: &Connection,
    src: &Source,
    message_id: &str,
    json: bool,
) -> anyhow::Result<()> {
    let queue = src.queue();
    // Only the message asked for is kept; every other one is dropped as it is read.
    let mut found: Option<(usize, lapin::message::Delivery)> = None;
    let mut position = 0usize;
    let scanned = browse::scan(conn, queue, MAX_PREFETCH, "reading", |d| {
        position += 1;
        let wanted = d
            .properties
            .message_id()
            .as_ref()
            .is_some_and(|m| m.as_str() == message_id);
        if found.is_none() && wanted {
            found = Some((position, d));
        }
    })
    .await?;
    let Some((position, d)) = found else {
        anyhow::bail!(
            "no message with message_id '{message_id}' among the {} message(s) read from \
             '{queue}' ({} ready); list them with `redeliver {} list`",
            scanned.read,
            scanned.counts.messages,
            match src {
                Source::Dlq { .. } => "dlq",
                Source::Unroutable { .. } => "unroutable",
            }
        );
    };
    if json {
        output::print_json(
            &output::message_json(position, queue, (&d).into()),
            "the message",
        )?;
    } else {
        print!("{}", output::message_text(position, queue, (&d).into()));
    }
    Ok(())
}

/// What `replay` should move.
#[derive(Clone, Debug, Default)]
pub(crate) struct Selection {
    /// At most this many selected messages move.
    pub limit: Option<u64>,
    pub filter: Filter,
    pub dry_run: bool,
    /// Unroutable only: publish everything here instead of the routing key's destination.
    pub to: Option<String>,
}

/// One message a replay moved (or, in a dry run, would move).
#[derive(Debug, Serialize)]
struct Moved {
    position: usize,
    message_id: Option<String>,
    destination: String,
}

/// One selected message a replay could not move; it stays where it was.
#[derive(Debug, Serialize)]
struct Skipped {
    position: usize,
    message_id: Option<String>,
    error: String,
}

impl Skipped {
    fn new(summary: &Summary, error: String) -> Self {
        Self {
            position: summary.position,
            message_id: summary.message_id.clone(),
            error,
        }
    }

    /// "#3 message_id m-1: queue 'x' does not exist ...", the stderr line of text mode.
    fn text(&self) -> String {
        format!(
            "{}: {}",
            label(self.position, self.message_id.as_deref()),
            escape(&self.error)
        )
    }
}

/// "#3 message_id m-1", for text output: the id is escaped (it is the publisher's).
fn label(position: usize, id: Option<&str>) -> String {
    format!(
        "#{position} message_id {}",
        id.map_or(Cow::Borrowed("(none)"), escape)
    )
}

/// What a replay did. The field names are the keys of `replay --json`.
#[derive(Debug, Default, Serialize)]
struct Report {
    queue: String,
    /// Where the messages go: Q, --to, or null for the parking queue's own destinations.
    destination: Option<String>,
    dry_run: bool,
    moved: u64,
    /// Messages looked at (selected or not).
    examined: u64,
    /// Messages that were ready when the replay started and that it never looked at: the
    /// broker stopped handing them out (a filtered replay can look past at most 65535
    /// unselected messages, which stay unacknowledged) or another consumer took them.
    not_examined: u64,
    /// Whether criteria chose the messages (then an unexamined one may be a selected one that
    /// did not move, and the replay fails).
    #[serde(skip)]
    filtering: bool,
    messages: Vec<Moved>,
    skipped: Vec<Skipped>,
    missing_message_ids: Vec<String>,
    interrupted: bool,
    /// Requested message_ids met during the scan, selected by the other criteria or not.
    #[serde(skip)]
    seen_ids: Vec<String>,
}

/// Everything one replay pass needs besides the reader and the report.
struct Run<'a> {
    src: &'a Source,
    sel: &'a Selection,
    /// Messages to look at: those ready when the replay started (at most --limit unfiltered).
    scan: u64,
    limit: u64,
    publisher: Option<&'a Publisher>,
    stop: &'a AtomicBool,
    bar: &'a indicatif::ProgressBar,
    /// The command's start, the reference of --older-than.
    now: SystemTime,
}

/// `replay`. Reads at most the messages that were ready when it started (so messages that a
/// failing handler dead-letters again during the replay are not replayed in a loop), publishes
/// each selected one to its destination through the default exchange and waits for the
/// broker's confirm, then acknowledges the source copy. Unselected messages are never
/// acknowledged and go back in order when the channel closes.
pub(crate) async fn replay(
    conn: &Connection,
    src: &Source,
    sel: &Selection,
    delay: DelayConfig,
    json: bool,
) -> anyhow::Result<()> {
    let now = SystemTime::now();
    let queue = src.queue().to_owned();
    let counts = browse::require_queue(conn, &queue).await?;
    if let Source::Dlq { home, .. } = src {
        // Fail before touching anything if Q is gone: the mandatory publish would be returned.
        browse::require_queue(conn, home).await?;
    }
    if let Some(to) = &sel.to {
        browse::require_queue(conn, to).await?;
    }
    let mut report = Report {
        queue: queue.clone(),
        destination: match (src, &sel.to) {
            (_, Some(to)) => Some(to.clone()),
            (Source::Dlq { home, .. }, None) => Some(home.clone()),
            (Source::Unroutable { .. }, None) => None,
        },
        dry_run: sel.dry_run,
        filtering: !sel.filter.is_empty() || src.selection().is_some(),
        ..Report::default()
    };
    let filtering = report.filtering;
    let limit = sel.limit.unwrap_or(u64::MAX);
    let scan = if filtering {
        u64::from(counts.messages)
    } else {
        u64::from(counts.messages).min(limit)
    };
    if scan == 0 {
        if !json {
            println!("'{queue}' is empty: nothing to replay");
        }
        return finish_replay(report, &sel.filter, json);
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
    let stop = stop_on_ctrl_c();
    let bar = output::progress(scan, "replaying");
    let run = Run {
        src,
        sel,
        scan,
        limit,
        publisher: publisher.as_ref(),
        stop: &stop,
        bar: &bar,
        now,
    };
    let mut reader = Reader::open(conn, &queue, prefetch).await?;
    let outcome = replay_loop(&mut reader, &run, &mut report).await;
    bar.finish_and_clear();
    let closed = reader.close().await;
    if !json {
        print_replay_text(&report);
    }
    // The report is printed even when the replay failed half-way: it says what already moved.
    if let Err(e) = outcome {
        if json {
            report.missing_message_ids = sel.filter.missing_ids(&report.seen_ids);
            output::print_json(&report, "the replay report")?;
        }
        return Err(e);
    }
    closed?;
    finish_replay(report, &sel.filter, json)
}

/// Ctrl-C stops between two messages instead of killing the process mid-move (which would
/// also be safe, at worst a duplicate, but leaves no report).
fn stop_on_ctrl_c() -> Arc<AtomicBool> {
    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            flag.store(true, Ordering::SeqCst);
        }
    });
    stop
}

fn print_replay_text(report: &Report) {
    if report.dry_run {
        for m in &report.messages {
            println!(
                "would move {} to '{}'",
                label(m.position, m.message_id.as_deref()),
                escape(&m.destination)
            );
        }
    }
    let verb = if report.dry_run {
        "would move"
    } else {
        "moved"
    };
    let dest = report.destination.as_ref().map_or_else(
        || "their destination queues".to_owned(),
        |d| format!("'{}'", escape(d)),
    );
    println!(
        "{verb} {} message(s) from '{}' to {dest}{}",
        report.moved,
        report.queue,
        if report.dry_run {
            " (dry run: nothing changed)"
        } else {
            ""
        }
    );
    if report.interrupted {
        println!(
            "interrupted: the remaining messages are still in '{}'",
            report.queue
        );
    }
    if report.not_examined > 0 {
        println!(
            "{} message(s) of '{}' were not examined: run the replay again",
            report.not_examined, report.queue
        );
    }
    for s in &report.skipped {
        eprintln!("skipped: {}", s.text());
    }
}

/// Prints the JSON report (in JSON mode) and turns what went wrong into the exit code: skipped
/// messages, then requested message ids that were not found (a typo must not look like
/// success).
fn finish_replay(mut report: Report, filter: &Filter, json: bool) -> anyhow::Result<()> {
    report.missing_message_ids = filter.missing_ids(&report.seen_ids);
    if json {
        output::print_json(&report, "the replay report")?;
    }
    if !report.skipped.is_empty() {
        anyhow::bail!(
            "{} message(s) could not be replayed and are still in '{}'",
            report.skipped.len(),
            report.queue
        );
    }
    if report.filtering && report.not_examined > 0 {
        anyhow::bail!(
            "{} of the messages in '{}' were not examined, so selected ones may remain: the \
             broker stopped handing them out after {} (a filtered replay can look past at most \
             {MAX_PREFETCH} unselected messages, and another consumer may have taken some); \
             run the replay again",
            report.not_examined,
            report.queue,
            report.examined
        );
    }
    missing_ids_error(&report.missing_message_ids)
}

fn missing_ids_error(missing: &[String]) -> anyhow::Result<()> {
    if missing.is_empty() {
        return Ok(());
    }
    anyhow::bail!(
        "no message with message_id {} was found",
        missing
            .iter()
            .map(|m| format!("'{m}'"))
            .collect::<Vec<_>>()
            .join(", ")
    )
}

/// Where a selected message goes and whether its retry state is reset; `Err` is why it cannot
/// go anywhere.
fn destination_of(
    run: &Run<'_>,
    summary: &Summary,
    routing_key: &str,
) -> Result<(String, bool), String> {
    match (run.src, &run.sel.to) {
        (Source::Dlq { home, .. }, None) => Ok((home.clone(), true)),
        (Source::Dlq { .. }, Some(to)) => Ok((to.clone(), true)),
        (Source::Unroutable { .. }, Some(to)) => Ok((to.clone(), false)),
        (Source::Unroutable { .. }, None) => summary
            .destination
            .clone()
            .map(|q| (q, false))
            .ok_or_else(|| {
                format!("routing key '{routing_key}' names no destination queue; use --to")
            }),
    }
}

async fn replay_loop(
    reader: &mut Reader,
    run: &Run<'_>,
    report: &mut Report,
) -> anyhow::Result<()> {
    for position in 1..=run.scan {
        if run.stop.load(Ordering::SeqCst) {
            report.interrupted = true;
            break;
        }
        if report.moved >= run.limit {
            break;
        }
        let Some(d) = reader.next(IDLE).await? else {
            report.not_examined = run.scan - report.examined;
            break;
        };
        report.examined += 1;
        run.bar.inc(1);
        let summary = run.src.summarize(position as usize, &d);
        if run.sel.filter.names_id(summary.message_id.as_deref()) {
            report.seen_ids.extend(summary.message_id.iter().cloned());
        }
        if !run.src.wanted(&summary) || !run.sel.filter.matches(&summary, run.now) {
            continue;
        }
        let (dest, reset) = match destination_of(run, &summary, d.routing_key.as_str()) {
            Ok(x) => x,
            Err(why) => {
                report.skipped.push(Skipped::new(&summary, why));
                continue;
            }
        };
        if let Some(publisher) = run.publisher {
            if !copy_one(publisher, run.src, &d, &summary, &dest, reset, report).await? {
                continue;
            }
            // The copy is safe in `dest`; only now may the source copy go.
            remove_source(reader, &d, &summary, &dest).await?;
        }
        report.moved += 1;
        report.messages.push(Moved {
            position: summary.position,
            message_id: summary.message_id.clone(),
            destination: dest,
        });
    }
    Ok(())
}

/// Publishes the copy of `d` to `dest` and waits for the broker's confirm. `Ok(false)`: the copy
/// could not go to `dest` for a reason that concerns this message only (recorded as skipped);
/// `Err`: the replay must stop.
async fn copy_one(
    publisher: &Publisher,
    src: &Source,
    d: &lapin::message::Delivery,
    summary: &Summary,
    dest: &str,
    reset: bool,
    report: &mut Report,
) -> anyhow::Result<bool> {
    let queue = src.queue();
    let label = label(summary.position, summary.message_id.as_deref());
    let props = message::replay_properties(&d.properties, reset);
    // A copy, not a new message: no message_id is invented for one that had none.
    match publisher.publish_copy("", dest, &d.data, props).await {
        Ok(()) => {}
        Err(PublishError::Returned { .. }) if src.is_parked() => {
            report.skipped.push(Skipped::new(
                summary,
                format!(
                    "queue '{dest}' does not exist (the broker returned the copy); declare it \
                     or use --to"
                ),
            ));
            return Ok(false);
        }
        Err(e) => {
            return Err(anyhow::Error::new(e).context(format!(
                "could not republish {label} to '{dest}'; it is still in '{queue}' and {} \
                 message(s) were moved before it",
                report.moved
            )));
        }
    }
    Ok(true)
}

/// Acknowledges the source copy of a message whose copy `dest` confirmed.
async fn remove_source(
    reader: &mut Reader,
    d: &lapin::message::Delivery,
    summary: &Summary,
    dest: &str,
) -> anyhow::Result<()> {
    let queue = reader.queue().to_owned();
    let label = label(summary.position, summary.message_id.as_deref());
    match reader.ack(d).await {
        Ok(true) => Ok(()),
        Ok(false) => anyhow::bail!(
            "{label} was published to '{dest}' but the channel on '{queue}' closed before its \
             copy there could be acknowledged: it stays in '{queue}' too (a duplicate, same \
             message_id)"
        ),
        Err(e) => Err(anyhow::Error::new(e).context(format!(
            "{label} was published to '{dest}' but acknowledging it in '{queue}' failed: it \
             stays there too (a duplicate, same message_id)"
        ))),
    }
}

/// What a purge did. The field names are the keys of `purge --json`.
#[derive(Debug, Default, Serialize)]
pub(crate) struct PurgeReport {
    queue: String,
    purged: u64,
    kept: u64,
    /// Messages a selective purge did not look at (it can look past at most 65535 kept ones).
    not_examined: u64,
    /// The criteria as options (`--reason permanent --older-than 7d`); null for a full purge.
    selection: Option<String>,
    missing_message_ids: Vec<String>,
}

impl PurgeReport {
    fn print_text(&self) {
        let matching = self
            .selection
            .as_ref()
            .map_or_else(String::new, |s| format!(" matching {s}"));
        let mut line = format!(
            "purged {} message(s){matching} from '{}'",
            self.purged, self.queue
        );
        if self.selection.is_some() {
            line.push_str(&format!(", kept {} in their order", self.kept));
        }
        if self.not_examined > 0 {
            line.push_str(&format!(" ({} not examined: run again)", self.not_examined));
        }
        println!("{line}");
    }

    /// Prints the report, then fails if some messages were not examined (they may include
    /// selected ones that are still there) or a requested message_id was not found.
    fn finish(self, json: bool) -> anyhow::Result<()> {
        if json {
            output::print_json(&self, "the purge report")?;
        } else {
            self.print_text();
        }
        if self.not_examined > 0 {
            anyhow::bail!(
                "{} message(s) of '{}' were not examined, so selected ones may remain: a \
                 selective purge can look past at most {MAX_PREFETCH} kept messages (or another \
                 consumer took some); run the purge again",
                self.not_examined,
                self.queue
            );
        }
        missing_ids_error(&self.missing_message_ids)
    }
}

/// A selective purge (`dlq purge` with criteria, `unroutable purge --queue Q`): removes only the
/// messages that `src` wants and `filter` matches; every other one goes back to the queue in
/// its place when the reader closes.
pub(crate) async fn purge_matching(
    conn: &Connection,
    src: &Source,
    filter: &Filter,
    json: bool,
) -> anyhow::Result<()> {
    let now = SystemTime::now();
    let queue = src.queue().to_owned();
    let counts = browse::require_queue(conn, &queue).await?;
    let selection = [src.selection(), Some(filter.describe())]
        .into_iter()
        .flatten()
        .filter(|s| !s.is_empty())
        .collect::<Vec<_>>()
        .join(" ");
    let mut report = PurgeReport {
        queue: queue.clone(),
        selection: Some(selection),
        ..PurgeReport::default()
    };
    let total = u64::from(counts.messages);
    let mut seen_ids = Vec::new();
    if total > 0 {
        let window = counts.messages.min(MAX_PREFETCH);
        let bar = output::progress(total, "scanning");
        let mut reader = Reader::open(conn, &queue, window).await?;
        let scanned = async {
            // Unselected messages stay unacknowledged (they go back on close), so at most
            // `window` of them can be looked past.
            while report.purged + report.kept < total && report.kept < u64::from(window) {
                let Some(d) = reader.next(IDLE).await? else {
                    break;
                };
                let position = (report.purged + report.kept + 1) as usize;
                let s = src.summarize(position, &d);
                if filter.names_id(s.message_id.as_deref()) {
                    seen_ids.extend(s.message_id.iter().cloned());
                }
                if src.wanted(&s) && filter.matches(&s, now) {
                    let removed = reader.ack(&d).await.with_context(|| {
                        format!("cannot remove message #{position} from '{queue}'")
                    })?;
                    if !removed {
                        anyhow::bail!(
                            "the channel on '{queue}' closed before message #{position} could be \
                             removed: it and every later selected message stay in '{queue}' \
                             ({} purged so far); run the purge again",
                            report.purged
                        );
                    }
                    report.purged += 1;
                } else {
                    report.kept += 1;
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
    } else if !json {
        println!("'{queue}' is empty: nothing to purge");
        return missing_ids_error(&filter.missing_ids(&seen_ids));
    }
    report.not_examined = total.saturating_sub(report.purged + report.kept);
    report.missing_message_ids = filter.missing_ids(&seen_ids);
    report.finish(json)
}

/// `purge`: deletes every message of `queue`, printing how many.
pub(crate) async fn purge(conn: &Connection, queue: &str, json: bool) -> anyhow::Result<()> {
    browse::require_queue(conn, queue).await?;
    let ch = conn
        .create_channel()
        .await
        .context("cannot open a channel")?;
    let n = ch
        .queue_purge(queue.into(), QueuePurgeOptions::default())
        .await
        .with_context(|| format!("cannot purge '{queue}'"))?;
    // Best effort: the channel is done either way and the connection closes soon.
    let _ = ch.close(200, "ok".into()).await;
    PurgeReport {
        queue: queue.to_owned(),
        purged: u64::from(n),
        ..PurgeReport::default()
    }
    .finish(json)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_filtered_replay_that_could_not_look_at_everything_fails() {
        let report = || Report {
            queue: "q.dlq".into(),
            examined: 65_535,
            not_examined: 10,
            filtering: true,
            ..Report::default()
        };
        let err = finish_replay(report(), &Filter::default(), false).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("10 of the messages in 'q.dlq' were not examined"),
            "{err}"
        );
        // Unfiltered, nothing was left behind that should have moved: the count is reported
        // and the messages are still there for the next run.
        let unfiltered = Report {
            filtering: false,
            ..report()
        };
        assert!(finish_replay(unfiltered, &Filter::default(), false).is_ok());
    }

    #[test]
    fn a_selective_purge_that_could_not_look_at_everything_fails() {
        let report = PurgeReport {
            queue: "q.dlq".into(),
            purged: 1,
            kept: 65_535,
            not_examined: 4,
            selection: Some("--reason permanent".into()),
            missing_message_ids: Vec::new(),
        };
        let err = report.finish(true).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("4 message(s) of 'q.dlq' were not examined"),
            "{err}"
        );
    }

    #[test]
    fn labels_escape_the_message_id() {
        assert_eq!(
            label(3, Some("m\u{1b}[31m\r")),
            "#3 message_id m\\u{1b}[31m\\r"
        );
        assert_eq!(label(1, None), "#1 message_id (none)");
    }
}
