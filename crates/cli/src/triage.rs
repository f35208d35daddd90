//! Triage of a dead-letter queue: `dlq list --group-by reason|error` and `dlq stats`.
//!
//! Both read the queue like a listing (nothing removed, order kept) and aggregate message by
//! message, so only the counts are held in memory, not the messages.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use lapin::Connection;
use serde::Serialize;
use serde_json::{json, Value};

use crate::browse::{self, Scanned};
use crate::cli::GroupBy;
use crate::dlq::Source;
use crate::message::{self, Summary};
use crate::output;
use crate::text::escape;

/// Counts per distinct key (None = messages without one).
#[derive(Debug, Default)]
pub(crate) struct Tally(BTreeMap<Option<String>, u64>);

impl Tally {
    pub(crate) fn add(&mut self, key: Option<String>) {
        *self.0.entry(key).or_default() += 1;
    }

    /// Most frequent first; ties by key so the output is stable; "none" after every named key
    /// of the same count (it is the least informative row).
    pub(crate) fn sorted(&self) -> Vec<(Option<String>, u64)> {
        let mut v: Vec<(Option<String>, u64)> =
            self.0.iter().map(|(k, n)| (k.clone(), *n)).collect();
        v.sort_by(|(ka, na), (kb, nb)| {
            nb.cmp(na)
                .then_with(|| ka.is_none().cmp(&kb.is_none()))
                .then_with(|| ka.cmp(kb))
        });
        v
    }
}

impl GroupBy {
    /// The JSON key and table header of the grouped field.
    fn names(self) -> (&'static str, &'static str) {
        match self {
            GroupBy::Reason => ("reason", "REASON"),
            GroupBy::Error => ("error", "ERROR"),
        }
    }

    fn key(self, s: &Summary) -> Option<String> {
        match self {
            GroupBy::Reason => s.reason.clone(),
            GroupBy::Error => s.final_error.clone(),
        }
    }
}

/// `[{"reason": R, "count": N}, ...]` (or `"error"`), in `groups` order.
fn groups_json(key: &str, groups: &[(Option<String>, u64)]) -> Value {
    Value::Array(
        groups
            .iter()
            .map(|(k, n)| json!({ key: k, "count": n }))
            .collect(),
    )
}

/// Reads up to `limit` messages of `src`, summarizing each, and hands the summaries to `each`.
async fn scan_summaries(
    conn: &Connection,
    src: &Source,
    limit: u32,
    mut each: impl FnMut(Summary),
) -> anyhow::Result<Scanned> {
    let mut position = 0usize;
    browse::scan(conn, src.queue(), limit, "reading", |d| {
        position += 1;
        let s = src.summarize(position, &d);
        if src.wanted(&s) {
            each(s);
        }
    })
    .await
}

/// `dlq list --group-by`: counts per distinct reason or final error, most frequent first.
pub(crate) async fn group_by(
    conn: &Connection,
    src: &Source,
    limit: u32,
    by: GroupBy,
    json: bool,
) -> anyhow::Result<()> {
    let mut tally = Tally::default();
    let scanned = scan_summaries(conn, src, limit, |s| tally.add(by.key(&s))).await?;
    let groups = tally.sorted();
    let (key, header) = by.names();
    if let Some(note) = scanned.shortfall_note(src.queue()) {
        eprintln!("{note}");
    }
    if json {
        return output::print_json(&groups_json(key, &groups), "the counts");
    }
    let queue = src.queue();
    if scanned.counts.messages == 0 {
        println!("'{queue}' is empty");
        return Ok(());
    }
    println!(
        "'{queue}': {} message(s) ready, {} read from the head, by {key} (read at {}, nothing \
         removed)",
        scanned.counts.messages,
        scanned.read,
        message::now_rfc3339()
    );
    print!("{}", output::group_table(header, &groups));
    Ok(())
}

/// The figures of `dlq stats`; the field names are its `--json` keys.
#[derive(Debug, Serialize)]
pub(crate) struct Stats {
    pub queue: String,
    /// Ready messages when the command started.
    pub ready: u32,
    /// Messages read (at most --limit).
    pub read: u32,
    pub by_reason: Vec<ReasonCount>,
    pub oldest_dead_lettered_at: Option<String>,
    pub newest_dead_lettered_at: Option<String>,
    /// Messages read whose dead-lettering time is unknown (not in oldest/newest).
    pub undated: u64,
    /// Total size of the bodies read.
    pub body_bytes: u64,
    pub read_at: String,
}

#[derive(Debug, Serialize)]
pub(crate) struct ReasonCount {
    pub reason: Option<String>,
    pub count: u64,
}

/// Accumulates [`Stats`] one summary at a time.
#[derive(Debug, Default)]
struct StatsAcc {
    reasons: Tally,
    /// (time, the header text as the message carries it).
    oldest: Option<(SystemTime, String)>,
    newest: Option<(SystemTime, String)>,
    undated: u64,
    body_bytes: u64,
}

impl StatsAcc {
    fn add(&mut self, s: &Summary) {
        self.reasons.add(s.reason.clone());
        self.body_bytes += s.body_bytes as u64;
        let (Some(at), Some(text)) = (s.dead_lettered_time(), s.dead_lettered_at.as_ref()) else {
            self.undated += 1;
            return;
        };
        if self.oldest.as_ref().is_none_or(|(t, _)| at < *t) {
            self.oldest = Some((at, text.clone()));
        }
        if self.newest.as_ref().is_none_or(|(t, _)| at > *t) {
            self.newest = Some((at, text.clone()));
        }
    }

    fn finish(self, queue: &str, scanned: &Scanned) -> Stats {
        Stats {
            queue: queue.to_owned(),
            ready: scanned.counts.messages,
            read: scanned.read,
            by_reason: self
                .reasons
                .sorted()
                .into_iter()
                .map(|(reason, count)| ReasonCount { reason, count })
                .collect(),
            oldest_dead_lettered_at: self.oldest.map(|(_, s)| s),
            newest_dead_lettered_at: self.newest.map(|(_, s)| s),
            undated: self.undated,
            body_bytes: self.body_bytes,
            read_at: message::now_rfc3339(),
        }
    }
}

/// `dlq stats`.
pub(crate) async fn stats(
    conn: &Connection,
    src: &Source,
    limit: u32,
    json: bool,
) -> anyhow::Result<()> {
    let mut acc = StatsAcc::default();
    let scanned = scan_summaries(conn, src, limit, |s| acc.add(&s)).await?;
    let stats = acc.finish(src.queue(), &scanned);
    if let Some(note) = scanned.shortfall_note(src.queue()) {
        eprintln!("{note}");
    }
    if json {
        return output::print_json(&stats, "the statistics");
    }
    print!("{}", stats_text(&stats, SystemTime::now()));
    Ok(())
}

/// "2024-05-01T12:00:00Z (3h 2m ago)"; the age is left out when the time cannot be read.
/// `at` is a header's text, so it is printed escaped.
fn with_age(at: &str, now: SystemTime) -> String {
    let shown = escape(at);
    match message::parse_rfc3339(at).and_then(|t| now.duration_since(t).ok()) {
        Some(age) if age >= Duration::from_secs(60) => {
            format!("{shown} ({} ago)", rough_age(age))
        }
        Some(_) => format!("{shown} (less than a minute ago)"),
        None => shown.into_owned(),
    }
}

/// The two largest of days, hours, minutes ("945d 6h", "3h 2m", "12m"): enough to triage, and
/// no calendar months whose length would need a calendar.
fn rough_age(age: Duration) -> String {
    let minutes = age.as_secs() / 60;
    let (d, h, m) = (minutes / 1440, minutes / 60 % 24, minutes % 60);
    match (d, h) {
        (0, 0) => format!("{m}m"),
        (0, _) => format!("{h}h {m}m"),
        _ => format!("{d}d {h}h"),
    }
}

fn stats_text(s: &Stats, now: SystemTime) -> String {
    if s.ready == 0 {
        return format!("'{}' is empty\n", s.queue);
    }
    let mut out = format!("'{}' (read at {}, nothing removed)\n", s.queue, s.read_at);
    out.push_str(&format!("  ready:       {}\n", s.ready));
    out.push_str(&format!(
        "  read:        {}{}\n",
        s.read,
        if s.read < s.ready {
            " (the figures below cover the head of the queue only)"
        } else {
            ""
        }
    ));
    let time = |t: &Option<String>| {
        t.as_deref()
            .map_or_else(|| "-".to_owned(), |t| with_age(t, now))
    };
    out.push_str(&format!(
        "  oldest:      {}\n",
        time(&s.oldest_dead_lettered_at)
    ));
    out.push_str(&format!(
        "  newest:      {}\n",
        time(&s.newest_dead_lettered_at)
    ));
    if s.undated > 0 {
        out.push_str(&format!(
            "  undated:     {} (no dead-lettering time)\n",
            s.undated
        ));
    }
    out.push_str(&format!("  body bytes:  {}\n", s.body_bytes));
    out.push_str("by reason:\n");
    let groups: Vec<(Option<String>, u64)> = s
        .by_reason
        .iter()
        .map(|r| (r.reason.clone(), r.count))
        .collect();
    for line in output::group_table("REASON", &groups).lines() {
        out.push_str(&format!("  {line}\n"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tally_sorts_by_count_then_key_with_none_last() {
        let mut t = Tally::default();
        for k in [None, Some("b"), Some("a"), Some("b"), Some("c"), None] {
            t.add(k.map(str::to_owned));
        }
        assert_eq!(
            t.sorted(),
            vec![
                (Some("b".to_owned()), 2),
                (None, 2),
                (Some("a".to_owned()), 1),
                (Some("c".to_owned()), 1),
            ]
        );
    }

    #[test]
    fn groups_json_uses_the_field_name() {
        let v = groups_json("error", &[(Some("boom".into()), 2), (None, 1)]);
        assert_eq!(
            v,
            json!([{"error": "boom", "count": 2}, {"error": null, "count": 1}])
        );
    }

    #[test]
    fn ages_are_whole_minutes() {
        let now = humantime::parse_rfc3339("2024-05-01T12:00:00Z").unwrap();
        assert_eq!(
            with_age("2024-05-01T09:29:30Z", now),
            "2024-05-01T09:29:30Z (2h 30m ago)"
        );
        assert_eq!(
            with_age("2024-05-01T11:59:30Z", now),
            "2024-05-01T11:59:30Z (less than a minute ago)"
        );
        assert_eq!(with_age("garbage", now), "garbage");
        assert_eq!(
            with_age("2024-05-01T09:29:30Z\r\u{1b}[2J", now),
            "2024-05-01T09:29:30Z\\r\\u{1b}[2J",
            "a header's text, escaped"
        );
        assert_eq!(
            with_age("+584554051223-11-09T07:00:15Z", now),
            "+584554051223-11-09T07:00:15Z"
        );
        assert_eq!(
            with_age("2022-01-01T00:00:00Z", now),
            "2022-01-01T00:00:00Z (851d 12h ago)"
        );
        assert_eq!(rough_age(Duration::from_secs(59 * 60 + 59)), "59m");
    }
}
