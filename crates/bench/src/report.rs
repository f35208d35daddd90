//! The Markdown report: one table per scenario family, the per-round ratios, then the targets.
//! Headings start at level 4 under the run's level-3 heading, so the whole output pastes as one
//! section of BENCHMARKS.md's Results.

use std::fmt::Write;

use crate::child::{QueueKind, Side};
use crate::config::{MIN_ROUNDS_TO_CONCLUDE, SPREAD_LIMIT};
use crate::stats::{median, min_max};

/// One side's result in one round of a throughput scenario.
pub struct ThroughputRow {
    pub scenario: String,
    pub queue: QueueKind,
    pub side: Side,
    /// 0-based round (set by `rounds_of`).
    pub round: u32,
    pub messages: u64,
    pub consume_per_s: f64,
    pub publish_per_s: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub peak_rss_mib: f64,
    pub rss_delta_mib: f64,
    /// Consumer process CPU (user + system) per message during the drain, microseconds.
    pub cpu_us_per_msg: f64,
    /// Consumer process CPU from the RUN to its first delivery, milliseconds: not in the
    /// per-message figure (the worker's start-up, the raw side's consume).
    pub setup_cpu_ms: f64,
    /// The broker node's CPU per message during the drain, microseconds (None: not readable).
    pub broker_cpu_us_per_msg: Option<f64>,
    /// The database's processes' CPU per message during the drain, microseconds (scenario 7;
    /// None elsewhere or when the database is not on this host).
    pub db_cpu_us_per_msg: Option<f64>,
}

pub struct DelayRow {
    pub label: String,
    pub side: Side,
    pub probes: u64,
    pub max_delay_ms: u64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    pub min_ms: f64,
    /// p99 of (error - 2 % of the delay): the target says this must be <= 50 ms.
    pub p99_excess_ms: f64,
    pub within_target_pct: f64,
}

pub struct ParkRow {
    pub side: Side,
    pub parked: u64,
    pub rss_none_mib: f64,
    pub rss_parked_mib: f64,
    pub peak_rss_mib: f64,
}

impl ParkRow {
    pub fn growth_pct(&self) -> f64 {
        if self.rss_none_mib <= 0.0 {
            return 0.0;
        }
        (self.rss_parked_mib - self.rss_none_mib) / self.rss_none_mib * 100.0
    }
}

/// One round of the scale-out scenario with `processes` worker processes on one queue.
pub struct ScaleRow {
    pub processes: usize,
    pub prefetch: u16,
    pub messages: u64,
    /// All processes together: messages / (last delivery handled - first one), any process.
    pub total_per_s: f64,
    /// CPU of all the worker processes together, per message.
    pub cpu_us_per_msg: f64,
    pub broker_cpu_us_per_msg: Option<f64>,
    /// Messages handled by the least and the most busy process.
    pub min_share: u64,
    pub max_share: u64,
}

/// Scenario 6: a consumer holding `held` deliveries of `body_kib` KiB at once.
pub struct InflightRow {
    pub side: Side,
    pub held: u64,
    pub body_kib: f64,
    /// Consuming, nothing in flight (after a warm-up with 1 KB messages).
    pub rss_idle_mib: f64,
    /// When the last of the `held` deliveries arrived.
    pub rss_held_mib: f64,
    /// Settled again after they were all acked.
    pub rss_after_mib: f64,
    pub peak_rss_mib: f64,
}

impl InflightRow {
    pub fn growth_mib(&self) -> f64 {
        self.rss_held_mib - self.rss_idle_mib
    }
    pub fn per_delivery_kib(&self) -> f64 {
        self.growth_mib() * 1024.0 / self.held.max(1) as f64
    }
}

/// One round of scenario 8 (outbox): the latency phase and the relay's drain of a backlog.
pub struct OutboxRow {
    pub round: u32,
    /// Messages stored (one per transaction) at `rate` per second in the latency phase.
    pub latency_messages: u64,
    pub rate: u64,
    /// Just after the producer's COMMIT returned -> delivered to the consumer.
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    /// Rows committed before the relay started, and the time it took to empty the table.
    pub backlog: u64,
    pub drain_secs: f64,
    pub rows_per_s: f64,
    /// The bench process (the relay and the probe of the table), per row.
    pub relay_cpu_us_per_row: f64,
    pub db_cpu_us_per_row: Option<f64>,
    pub broker_cpu_us_per_row: Option<f64>,
}

/// The two backlogs of scenario 9.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RefusedVariant {
    /// Every row routable.
    Clean,
    /// 1 % of the rows refused by the broker (returned: no queue has their routing key).
    Refused,
}

impl RefusedVariant {
    pub fn name(self) -> &'static str {
        match self {
            RefusedVariant::Clean => "clean",
            RefusedVariant::Refused => "refused",
        }
    }
}

/// One drain of scenario 9 (outbox relay, 1 % of rows refused or none).
pub struct OutboxRefusedRow {
    pub round: u32,
    pub variant: RefusedVariant,
    /// Rows committed before the relay started: `good` + `refused`.
    pub rows: u64,
    pub good: u64,
    pub refused: u64,
    /// The relay connected -> the consumer received the last good row.
    pub drain_secs: f64,
    pub good_per_s: f64,
    /// The bench process (relay and consumer), per good row.
    pub relay_cpu_us_per_row: f64,
    pub db_cpu_us_per_row: Option<f64>,
    pub broker_cpu_us_per_row: Option<f64>,
    /// Refusals recorded on the rows left once the relay stopped (their `attempts`).
    pub refusals: u64,
    /// Refused rows left waiting for a retry, and parked, once the relay stopped.
    pub retrying: u64,
    pub parked: u64,
    /// Good rows the consumer received more than once.
    pub duplicates: u64,
}

/// Median and min-max of per-round values (ratios of a round pair).
#[derive(Clone, Debug)]
pub struct RoundStats {
    pub values: Vec<f64>,
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

impl RoundStats {
    pub fn of(values: Vec<f64>) -> Self {
        let (min, max) = min_max(&values);
        RoundStats {
            median: median(&values),
            min,
            max,
            values,
        }
    }

    /// max / min of the values (1.0 for a single one).
    pub fn spread(&self) -> f64 {
        if self.min > 0.0 {
            self.max / self.min
        } else {
            f64::INFINITY
        }
    }

    /// `Ok` if these rounds allow a conclusion (about `target`, if given), else why not.
    pub fn conclusive(&self, target: Option<f64>) -> Result<(), String> {
        if self.values.len() < MIN_ROUNDS_TO_CONCLUDE {
            return Err(format!(
                "no: {} round pair(s), {MIN_ROUNDS_TO_CONCLUDE} needed",
                self.values.len()
            ));
        }
        if self.spread() > SPREAD_LIMIT {
            return Err(format!(
                "no: spread {:.2} (max/min) > {SPREAD_LIMIT}",
                self.spread()
            ));
        }
        if let Some(t) = target {
            if self.min < t && t <= self.max {
                return Err(format!(
                    "no: min-max {:.2}-{:.2} crosses {t}",
                    self.min, self.max
                ));
            }
        }
        Ok(())
    }

    fn cell(&self) -> String {
        format!("{:.2}-{:.2}", self.min, self.max)
    }
}

/// redeliver against one raw side, per round pair of one scenario and queue type.
pub struct Comparison {
    pub vs: Side,
    pub msg_ratio: RoundStats,
    pub cpu_ratio: RoundStats,
}

pub struct Target {
    pub name: String,
    pub goal: String,
    pub measured: String,
    pub met: bool,
    /// For per-round ratios: "yes" or "no: why"; `None` for single measurements.
    pub conclusive: Option<String>,
}

impl Target {
    /// A target on a median of per-round ratios: met on the median; conclusive as
    /// [`RoundStats::conclusive`] says.
    pub fn from_ratio(
        name: String,
        goal: &str,
        r: &RoundStats,
        target: f64,
        higher_is_better: bool,
    ) -> Self {
        let met = if higher_is_better {
            r.median >= target
        } else {
            r.median <= target
        };
        Target {
            name,
            goal: goal.into(),
            measured: format!(
                "median {:.2}x, min-max {} over {} round pairs",
                r.median,
                r.cell(),
                r.values.len()
            ),
            met,
            conclusive: Some(match r.conclusive(Some(target)) {
                Ok(()) => "yes".into(),
                Err(why) => why,
            }),
        }
    }
}

#[derive(Default)]
pub struct Report {
    pub throughput: Vec<ThroughputRow>,
    pub delay: Vec<DelayRow>,
    pub park: Vec<ParkRow>,
    pub scale: Vec<ScaleRow>,
    pub inflight: Vec<InflightRow>,
    pub outbox: Vec<OutboxRow>,
    pub outbox_refused: Vec<OutboxRefusedRow>,
    pub hops: Vec<crate::scenarios::HopsRow>,
    pub native: Vec<crate::scenarios::NativeRow>,
    /// Why scenario 11 ran only its levels sides (a broker before 4.3).
    pub native_note: Option<String>,
    pub targets: Vec<Target>,
    pub errors: Vec<String>,
}

pub fn mib(kb: u64) -> f64 {
    kb as f64 / 1024.0
}

fn rate(v: f64) -> String {
    if v >= 100.0 {
        format!("{:.0}", v)
    } else {
        format!("{v:.1}")
    }
}

fn opt1(v: Option<f64>) -> String {
    v.map(|v| format!("{v:.1}")).unwrap_or_else(|| "n/a".into())
}

/// Median of `f` over rows, `None` if any row lacks it.
fn median_opt<'a>(
    rows: impl Iterator<Item = &'a ThroughputRow>,
    f: impl Fn(&ThroughputRow) -> Option<f64>,
) -> Option<f64> {
    let v: Option<Vec<f64>> = rows.map(f).collect();
    v.filter(|v| !v.is_empty()).map(|v| median(&v))
}

impl Report {
    fn rows<'a>(
        &'a self,
        scenario: &'a str,
        queue: QueueKind,
        side: Side,
    ) -> impl Iterator<Item = &'a ThroughputRow> + 'a {
        self.throughput
            .iter()
            .filter(move |r| r.scenario == scenario && r.queue == queue && r.side == side)
    }

    /// redeliver / `vs` of every round where both ran, for msg/s and CPU per message.
    pub fn comparison(&self, scenario: &str, queue: QueueKind, vs: Side) -> Option<Comparison> {
        let mut msg = Vec::new();
        let mut cpu = Vec::new();
        for rd in self.rows(scenario, queue, Side::Redeliver) {
            if let Some(raw) = self.rows(scenario, queue, vs).find(|r| r.round == rd.round) {
                if raw.consume_per_s > 0.0 {
                    msg.push(rd.consume_per_s / raw.consume_per_s);
                }
                if raw.cpu_us_per_msg > 0.0 {
                    cpu.push(rd.cpu_us_per_msg / raw.cpu_us_per_msg);
                }
            }
        }
        if msg.is_empty() {
            return None;
        }
        Some(Comparison {
            vs,
            msg_ratio: RoundStats::of(msg),
            cpu_ratio: RoundStats::of(cpu),
        })
    }

    /// Good rows/s with 1 % refused / without, of every round where both ran (scenario 9).
    pub fn refused_ratio(&self) -> Option<RoundStats> {
        let of = |round: u32, v: RefusedVariant| {
            self.outbox_refused
                .iter()
                .find(|r| r.round == round && r.variant == v)
        };
        let mut rounds: Vec<u32> = self.outbox_refused.iter().map(|r| r.round).collect();
        rounds.sort_unstable();
        rounds.dedup();
        let ratios: Vec<f64> = rounds
            .into_iter()
            .filter_map(|round| {
                let clean = of(round, RefusedVariant::Clean)?;
                let refused = of(round, RefusedVariant::Refused)?;
                (clean.good_per_s > 0.0).then(|| refused.good_per_s / clean.good_per_s)
            })
            .collect();
        (!ratios.is_empty()).then(|| RoundStats::of(ratios))
    }

    /// (scenario, queue, side) in the order first measured.
    fn groups(&self) -> Vec<(String, QueueKind, Side)> {
        let mut g: Vec<(String, QueueKind, Side)> = Vec::new();
        for r in &self.throughput {
            if !g
                .iter()
                .any(|(s, q, d)| *s == r.scenario && *q == r.queue && *d == r.side)
            {
                g.push((r.scenario.clone(), r.queue, r.side));
            }
        }
        // Sides in a fixed order within a scenario and queue type.
        let keys: Vec<(usize, usize)> = g
            .iter()
            .map(|(s, q, d)| {
                let first = g
                    .iter()
                    .position(|(s2, q2, _)| s2 == s && q2 == q)
                    .unwrap_or(0);
                (first, *d as usize)
            })
            .collect();
        let mut keyed: Vec<_> = keys.into_iter().zip(g).collect();
        keyed.sort_by_key(|(k, _)| *k);
        keyed.into_iter().map(|(_, g)| g).collect()
    }

    pub fn render(&self, header: &str) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "{header}");
        if !self.throughput.is_empty() {
            self.render_throughput(&mut s);
            self.render_ratios(&mut s);
            self.render_retry_split(&mut s);
            self.render_inbox_split(&mut s);
        }
        if !self.outbox.is_empty() {
            self.render_outbox(&mut s);
        }
        if !self.outbox_refused.is_empty() {
            self.render_outbox_refused(&mut s);
        }
        if !self.hops.is_empty() {
            crate::scenarios::render_hops(&self.hops, &mut s);
        }
        if !self.native.is_empty() {
            crate::scenarios::render_native(&self.native, self.native_note.as_deref(), &mut s);
        }
        if !self.scale.is_empty() {
            self.render_scale(&mut s);
        }
        if !self.inflight.is_empty() {
            self.render_inflight(&mut s);
        }
        if !self.delay.is_empty() {
            let _ = writeln!(
                s,
                "\n#### Delay accuracy (scenario 3): observed minus intended delay\n"
            );
            let _ = writeln!(
                s,
                "| probes sent | side | probes | delays | min ms | p50 ms | p99 ms | max ms | p99 of (error - 2 % of delay) ms | within 50 ms + 2 % |"
            );
            let _ = writeln!(s, "|---|---|---:|---|---:|---:|---:|---:|---:|---:|");
            for r in &self.delay {
                let _ = writeln!(
                    s,
                    "| {} | {} | {} | uniform 0-{} ms | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} % |",
                    r.label,
                    r.side.name(),
                    r.probes,
                    r.max_delay_ms,
                    r.min_ms,
                    r.p50_ms,
                    r.p99_ms,
                    r.max_ms,
                    r.p99_excess_ms,
                    r.within_target_pct
                );
            }
        }
        if !self.park.is_empty() {
            let _ = writeln!(
                s,
                "\n#### Memory under waiting retries (scenario 4): consumer process RSS\n"
            );
            let _ = writeln!(
                s,
                "| side | parked in delay levels | RSS, none parked MiB | RSS, all parked MiB | growth | peak RSS MiB |"
            );
            let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|");
            for r in &self.park {
                let _ = writeln!(
                    s,
                    "| {} | {} | {:.1} | {:.1} | {:+.1} % | {:.1} |",
                    r.side.name(),
                    r.parked,
                    r.rss_none_mib,
                    r.rss_parked_mib,
                    r.growth_pct(),
                    r.peak_rss_mib
                );
            }
        }
        if !self.targets.is_empty() {
            let _ = writeln!(s, "\n#### Targets (from this run)\n");
            let _ = writeln!(s, "| target | goal | measured | met | conclusive |");
            let _ = writeln!(s, "|---|---|---|---|---|");
            for t in &self.targets {
                let _ = writeln!(
                    s,
                    "| {} | {} | {} | {} | {} |",
                    t.name,
                    t.goal,
                    t.measured,
                    if t.met { "yes" } else { "**no**" },
                    t.conclusive.as_deref().unwrap_or("-")
                );
            }
        }
        if !self.errors.is_empty() {
            let _ = writeln!(s, "\n#### Errors\n");
            for e in &self.errors {
                let _ = writeln!(s, "- {e}");
            }
        }
        s
    }

    fn render_throughput(&self, s: &mut String) {
        let _ = writeln!(
            s,
            "\n#### Throughput and latency (scenarios 1, 2 and 7): each side's median over its rounds\n"
        );
        let _ = writeln!(
            s,
            "| scenario | queue | side | rounds | messages | consume msg/s | min-max msg/s | publish msg/s | consumer CPU us/msg | broker CPU us/msg | p50 latency ms | p99 latency ms | peak RSS MiB | RSS delta MiB | every round msg/s |"
        );
        let _ = writeln!(
            s,
            "|---|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"
        );
        for (scenario, queue, side) in self.groups() {
            let rows: Vec<&ThroughputRow> = self.rows(&scenario, queue, side).collect();
            let pick =
                |f: fn(&ThroughputRow) -> f64| -> Vec<f64> { rows.iter().map(|r| f(r)).collect() };
            let rates = pick(|r| r.consume_per_s);
            let (lo, hi) = min_max(&rates);
            let _ = writeln!(
                s,
                "| {scenario} | {} | {} | {} | {} | {} | {}-{} | {} | {:.1} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {} |",
                queue.name(),
                side.name(),
                rows.len(),
                rows.first().map(|r| r.messages).unwrap_or(0),
                rate(median(&rates)),
                rate(lo),
                rate(hi),
                rate(median(&pick(|r| r.publish_per_s))),
                median(&pick(|r| r.cpu_us_per_msg)),
                opt1(median_opt(rows.iter().copied(), |r| r.broker_cpu_us_per_msg)),
                median(&pick(|r| r.p50_ms)),
                median(&pick(|r| r.p99_ms)),
                min_max(&pick(|r| r.peak_rss_mib)).1,
                median(&pick(|r| r.rss_delta_mib)),
                rates
                    .iter()
                    .map(|v| format!("{v:.0}"))
                    .collect::<Vec<_>>()
                    .join(" / ")
            );
        }
    }

    fn render_ratios(&self, s: &mut String) {
        let _ = writeln!(
            s,
            "\n#### redeliver / raw, per round pair: median and min-max of the per-round ratios\n"
        );
        let _ = writeln!(
            s,
            "| scenario | queue | redeliver vs | round pairs | msg/s ratio, median | min-max | spread (max/min) | CPU/msg ratio, median | min-max | conclusive (msg/s) | every round's msg/s ratio |"
        );
        let _ = writeln!(s, "|---|---|---|---:|---:|---|---:|---:|---|---|---|");
        let mut seen: Vec<(String, QueueKind)> = Vec::new();
        for (scenario, queue, _) in self.groups() {
            if seen.iter().any(|(s2, q2)| *s2 == scenario && *q2 == queue) {
                continue;
            }
            seen.push((scenario.clone(), queue));
            for vs in [Side::Raw, Side::RawBatch] {
                let Some(c) = self.comparison(&scenario, queue, vs) else {
                    continue;
                };
                let _ = writeln!(
                    s,
                    "| {scenario} | {} | {} | {} | **{:.2}x** | {} | {:.2} | {:.2}x | {} | {} | {} |",
                    queue.name(),
                    c.vs.short(),
                    c.msg_ratio.values.len(),
                    c.msg_ratio.median,
                    c.msg_ratio.cell(),
                    c.msg_ratio.spread(),
                    c.cpu_ratio.median,
                    c.cpu_ratio.cell(),
                    match c.msg_ratio.conclusive(None) {
                        Ok(()) => "yes".to_string(),
                        Err(why) => why,
                    },
                    c.msg_ratio
                        .values
                        .iter()
                        .map(|v| format!("{v:.2}"))
                        .collect::<Vec<_>>()
                        .join(" / ")
                );
            }
        }
    }

    fn render_retry_split(&self, s: &mut String) {
        let groups: Vec<_> = self
            .groups()
            .into_iter()
            .filter(|(sc, _, _)| sc.starts_with("retry"))
            .collect();
        if groups.is_empty() {
            return;
        }
        let _ = writeln!(
            s,
            "\n#### Retry round trip (scenario 2): where the CPU goes, per completed round trip (medians)\n"
        );
        let _ = writeln!(
            s,
            "| scenario | side | consumer CPU us | broker CPU us | consumer + broker us | broker share |"
        );
        let _ = writeln!(s, "|---|---|---:|---:|---:|---:|");
        for (scenario, queue, side) in groups {
            let rows: Vec<&ThroughputRow> = self.rows(&scenario, queue, side).collect();
            let cpu = median(&rows.iter().map(|r| r.cpu_us_per_msg).collect::<Vec<_>>());
            let broker = median_opt(rows.iter().copied(), |r| r.broker_cpu_us_per_msg);
            let (total, share) = match broker {
                Some(b) if b + cpu > 0.0 => (
                    format!("{:.1}", b + cpu),
                    format!("{:.0} %", b / (b + cpu) * 100.0),
                ),
                _ => ("n/a".into(), "n/a".into()),
            };
            let _ = writeln!(
                s,
                "| {scenario} | {} | {cpu:.1} | {} | {total} | {share} |",
                side.name(),
                opt1(broker)
            );
        }
    }

    fn render_inbox_split(&self, s: &mut String) {
        let groups: Vec<_> = self
            .groups()
            .into_iter()
            .filter(|(sc, _, _)| sc == "inbox")
            .collect();
        if groups.is_empty() {
            return;
        }
        let _ = writeln!(
            s,
            "\n#### Exactly-once effects (scenario 7): where the CPU goes, per message (medians)\n"
        );
        let _ = writeln!(
            s,
            "| scenario | side | rounds | msg/s | consumer CPU us | PostgreSQL CPU us | broker CPU us | p50 latency ms | p99 latency ms |"
        );
        let _ = writeln!(s, "|---|---|---:|---:|---:|---:|---:|---:|---:|");
        for (scenario, queue, side) in groups {
            let rows: Vec<&ThroughputRow> = self.rows(&scenario, queue, side).collect();
            let pick =
                |f: fn(&ThroughputRow) -> f64| -> Vec<f64> { rows.iter().map(|r| f(r)).collect() };
            let _ = writeln!(
                s,
                "| {scenario} | {} | {} | {} | {:.1} | {} | {} | {:.1} | {:.1} |",
                side.name(),
                rows.len(),
                rate(median(&pick(|r| r.consume_per_s))),
                median(&pick(|r| r.cpu_us_per_msg)),
                opt1(median_opt(rows.iter().copied(), |r| r.db_cpu_us_per_msg)),
                opt1(median_opt(rows.iter().copied(), |r| r.broker_cpu_us_per_msg)),
                median(&pick(|r| r.p50_ms)),
                median(&pick(|r| r.p99_ms)),
            );
        }
    }

    fn render_outbox(&self, s: &mut String) {
        let _ = writeln!(
            s,
            "\n#### Outbox relay (scenario 8): commit to delivery, and rows/s over a backlog\n"
        );
        let _ = writeln!(
            s,
            "Latency: one message per transaction stored with `Outbox::store` at a fixed rate, one \
`Relay` (LISTEN/NOTIFY, default batch size) publishing, a plain auto-ack consumer on the \
destination queue; measured from just after the producer's `COMMIT` returned to the delivery \
reaching that consumer (**commit to delivery**: it bounds commit to confirmed publish from above). \
Throughput: the backlog committed with no relay running, then one relay started (it opens its own \
broker connection); rows/s = rows / (start of the relay -> table empty; a row is deleted only after \
the broker confirmed it). CPU per \
row over that drain: the bench process (the relay, in process), all PostgreSQL processes, the \
broker node.\n"
        );
        let _ = writeln!(
            s,
            "| round | messages at rate/s | p50 commit -> delivery ms | p99 ms | max ms | relay backlog rows | drain s | relay rows/s | relay process CPU us/row | PostgreSQL CPU us/row | broker CPU us/row |"
        );
        let _ = writeln!(s, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
        for r in &self.outbox {
            let _ = writeln!(
                s,
                "| {} | {} at {}/s | {:.1} | {:.1} | {:.1} | {} | {:.2} | {} | {:.1} | {} | {} |",
                r.round + 1,
                r.latency_messages,
                r.rate,
                r.p50_ms,
                r.p99_ms,
                r.max_ms,
                r.backlog,
                r.drain_secs,
                rate(r.rows_per_s),
                r.relay_cpu_us_per_row,
                opt1(r.db_cpu_us_per_row),
                opt1(r.broker_cpu_us_per_row),
            );
        }
        let col = |f: fn(&OutboxRow) -> f64| -> Vec<f64> { self.outbox.iter().map(f).collect() };
        let opt_col = |f: fn(&OutboxRow) -> Option<f64>| -> Option<f64> {
            let v: Option<Vec<f64>> = self.outbox.iter().map(f).collect();
            v.map(|v| median(&v))
        };
        let rows_s = col(|r| r.rows_per_s);
        let (lo, hi) = min_max(&rows_s);
        let (p99_lo, p99_hi) = min_max(&col(|r| r.p99_ms));
        let Some(first) = self.outbox.first() else {
            return;
        };
        let _ = writeln!(
            s,
            "| **median of {}** | {} at {}/s | **{:.1}** | **{:.1}** (min-max {:.1}-{:.1}) | {:.1} | {} | {:.2} | **{}** (min-max {}-{}) | {:.1} | {} | {} |",
            self.outbox.len(),
            first.latency_messages,
            first.rate,
            median(&col(|r| r.p50_ms)),
            median(&col(|r| r.p99_ms)),
            p99_lo,
            p99_hi,
            median(&col(|r| r.max_ms)),
            first.backlog,
            median(&col(|r| r.drain_secs)),
            rate(median(&rows_s)),
            rate(lo),
            rate(hi),
            median(&col(|r| r.relay_cpu_us_per_row)),
            opt1(opt_col(|r| r.db_cpu_us_per_row)),
            opt1(opt_col(|r| r.broker_cpu_us_per_row)),
        );
    }

    fn render_outbox_refused(&self, s: &mut String) {
        let _ = writeln!(
            s,
            "\n#### Outbox relay with refused rows (scenario 9): good rows/s, 1 % refused against none\n"
        );
        let _ = writeln!(
            s,
            "Each round drains two committed backlogs of the same size with one `Relay` (default batch \
size, its own broker connection), in turn (clean first, then refused first in the next round). \
**refused**: every 100th row goes to the default exchange with a routing key no queue has, so the \
broker returns it; the relay retries it (policy: 100 ms doubling, full jitter, 3 retries) and \
parks it after its 4th refusal. good rows/s = good rows / (relay connected -> the last good row \
reached a plain auto-ack consumer). After each drain: every good row reached the consumer and left \
the table, every refused row is still in it (retrying or parked). CPU per good row over the drain: \
the bench process (relay and consumer), all PostgreSQL processes, the broker node.\n"
        );
        let _ = writeln!(
            s,
            "| round | backlog | rows | refused | drain s | good rows/s | bench process CPU us/good row | PostgreSQL CPU us/good row | broker CPU us/good row | refusals recorded | left retrying | left parked | duplicates |"
        );
        let _ = writeln!(
            s,
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
        );
        for r in &self.outbox_refused {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {:.2} | {} | {:.1} | {} | {} | {} | {} | {} | {} |",
                r.round + 1,
                r.variant.name(),
                r.rows,
                r.refused,
                r.drain_secs,
                rate(r.good_per_s),
                r.relay_cpu_us_per_row,
                opt1(r.db_cpu_us_per_row),
                opt1(r.broker_cpu_us_per_row),
                r.refusals,
                r.retrying,
                r.parked,
                r.duplicates,
            );
        }
        for v in [RefusedVariant::Clean, RefusedVariant::Refused] {
            let rates: Vec<f64> = self
                .outbox_refused
                .iter()
                .filter(|r| r.variant == v)
                .map(|r| r.good_per_s)
                .collect();
            if rates.is_empty() {
                continue;
            }
            let (lo, hi) = min_max(&rates);
            let _ = writeln!(
                s,
                "| **median of {}** | {} | | | | **{}** (min-max {}-{}) | | | | | | | |",
                rates.len(),
                v.name(),
                rate(median(&rates)),
                rate(lo),
                rate(hi),
            );
        }
        let Some(r) = self.refused_ratio() else {
            return;
        };
        let _ = writeln!(
            s,
            "\n| good rows/s, refused / clean | round pairs | median | min-max | spread (max/min) | conclusive | every round's ratio |"
        );
        let _ = writeln!(s, "|---|---:|---:|---|---:|---|---|");
        let _ = writeln!(
            s,
            "| 1 % refused | {} | **{:.2}x** | {} | {:.2} | {} | {} |",
            r.values.len(),
            r.median,
            r.cell(),
            r.spread(),
            match r.conclusive(None) {
                Ok(()) => "yes".to_string(),
                Err(why) => why,
            },
            r.values
                .iter()
                .map(|v| format!("{v:.2}"))
                .collect::<Vec<_>>()
                .join(" / ")
        );
    }

    fn render_scale(&self, s: &mut String) {
        let _ = writeln!(
            s,
            "\n#### Scale-out (scenario 5): redeliver worker processes on one quorum queue (medians over the rounds)\n"
        );
        let _ = writeln!(
            s,
            "| worker processes | prefetch per process | unacked at most | rounds | messages | total msg/s | min-max msg/s | msg/s per process | vs 1 process | consumer CPU us/msg (all processes) | broker CPU us/msg | messages per process, min-max |"
        );
        let _ = writeln!(
            s,
            "|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---|"
        );
        let mut procs: Vec<usize> = self.scale.iter().map(|r| r.processes).collect();
        procs.dedup();
        procs.sort_unstable();
        procs.dedup();
        let total_of = |p: usize| {
            median(
                &self
                    .scale
                    .iter()
                    .filter(|r| r.processes == p)
                    .map(|r| r.total_per_s)
                    .collect::<Vec<_>>(),
            )
        };
        let one = total_of(1);
        for p in procs {
            let rows: Vec<&ScaleRow> = self.scale.iter().filter(|r| r.processes == p).collect();
            let rates: Vec<f64> = rows.iter().map(|r| r.total_per_s).collect();
            let (lo, hi) = min_max(&rates);
            let total = median(&rates);
            let broker: Option<Vec<f64>> = rows.iter().map(|r| r.broker_cpu_us_per_msg).collect();
            let prefetch = rows.first().map(|r| r.prefetch).unwrap_or(0);
            let _ = writeln!(
                s,
                "| {p} | {prefetch} | {} | {} | {} | {} | {}-{} | {} | {} | {:.1} | {} | {}-{} |",
                usize::from(prefetch) * p,
                rows.len(),
                rows.first().map(|r| r.messages).unwrap_or(0),
                rate(total),
                rate(lo),
                rate(hi),
                rate(total / p as f64),
                if one > 0.0 {
                    format!("{:.2}x", total / one)
                } else {
                    "-".into()
                },
                median(&rows.iter().map(|r| r.cpu_us_per_msg).collect::<Vec<_>>()),
                opt1(broker.map(|b| median(&b))),
                rows.iter().map(|r| r.min_share).min().unwrap_or(0),
                rows.iter().map(|r| r.max_share).max().unwrap_or(0),
            );
        }
    }

    fn render_inflight(&self, s: &mut String) {
        let _ = writeln!(
            s,
            "\n#### Memory with the prefetch in flight (scenario 6): consumer process RSS\n"
        );
        let _ = writeln!(
            s,
            "| side | deliveries held at once | body KiB | RSS consuming, none held MiB | RSS all held MiB | growth MiB | growth per delivery KiB | RSS after acking MiB | peak RSS MiB |"
        );
        let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|---:|---:|");
        for r in &self.inflight {
            let _ = writeln!(
                s,
                "| {} | {} | {:.0} | {:.1} | {:.1} | {:+.1} | {:.1} | {:.1} | {:.1} |",
                r.side.name(),
                r.held,
                r.body_kib,
                r.rss_idle_mib,
                r.rss_held_mib,
                r.growth_mib(),
                r.per_delivery_kib(),
                r.rss_after_mib,
                r.peak_rss_mib
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(side: Side, round: u32, rate: f64, cpu: f64) -> ThroughputRow {
        ThroughputRow {
            scenario: "happy".into(),
            queue: QueueKind::Quorum,
            side,
            round,
            messages: 10,
            consume_per_s: rate,
            publish_per_s: 1.0,
            p50_ms: 1.0,
            p99_ms: 2.0,
            peak_rss_mib: 1.0,
            rss_delta_mib: 1.0,
            cpu_us_per_msg: cpu,
            setup_cpu_ms: 0.0,
            broker_cpu_us_per_msg: None,
            db_cpu_us_per_msg: None,
        }
    }

    #[test]
    fn inbox_and_outbox_tables() {
        let mut r = Report::default();
        for round in 0..3 {
            let mut raw = row(Side::Raw, round, 1000.0, 100.0);
            raw.scenario = "inbox".into();
            raw.db_cpu_us_per_msg = Some(200.0);
            let mut rd = row(Side::Redeliver, round, 850.0, 110.0);
            rd.scenario = "inbox".into();
            r.throughput.push(raw);
            r.throughput.push(rd);
            r.outbox.push(OutboxRow {
                round,
                latency_messages: 3000,
                rate: 500,
                p50_ms: 4.0 + f64::from(round),
                p99_ms: 9.0,
                max_ms: 20.0,
                backlog: 20_000,
                drain_secs: 5.0,
                rows_per_s: 4000.0,
                relay_cpu_us_per_row: 30.0,
                db_cpu_us_per_row: None,
                broker_cpu_us_per_row: Some(50.0),
            });
        }
        let text = r.render("### test");
        assert!(
            text.contains("| inbox | quorum | raw | 3 | **0.85x** |"),
            "{text}"
        );
        // The redeliver side has no database figure: the median is n/a, not a guess.
        assert!(
            text.contains("| inbox | raw lapin | 3 | 1000 | 100.0 | 200.0 | n/a |"),
            "{text}"
        );
        assert!(
            text.contains("| inbox | redeliver | 3 | 850 | 110.0 | n/a |"),
            "{text}"
        );
        assert!(
            text.contains(
                "| **median of 3** | 3000 at 500/s | **5.0** | **9.0** (min-max 9.0-9.0) |"
            ),
            "{text}"
        );
    }

    #[test]
    fn refused_rows_pair_the_variants_of_each_round() {
        let mut r = Report::default();
        let row = |round, variant, good_per_s| OutboxRefusedRow {
            round,
            variant,
            rows: 1000,
            good: if variant == RefusedVariant::Refused {
                990
            } else {
                1000
            },
            refused: if variant == RefusedVariant::Refused {
                10
            } else {
                0
            },
            drain_secs: 1.0,
            good_per_s,
            relay_cpu_us_per_row: 30.0,
            db_cpu_us_per_row: None,
            broker_cpu_us_per_row: Some(50.0),
            refusals: 40,
            retrying: 0,
            parked: 10,
            duplicates: 0,
        };
        // Round 1 clean first, round 2 refused first, as the scenario runs them.
        r.outbox_refused.push(row(0, RefusedVariant::Clean, 1000.0));
        r.outbox_refused
            .push(row(0, RefusedVariant::Refused, 950.0));
        r.outbox_refused
            .push(row(1, RefusedVariant::Refused, 800.0));
        r.outbox_refused.push(row(1, RefusedVariant::Clean, 1000.0));
        r.outbox_refused.push(row(2, RefusedVariant::Clean, 1000.0));
        r.outbox_refused
            .push(row(2, RefusedVariant::Refused, 900.0));
        // A round whose refused drain failed pairs nothing.
        r.outbox_refused.push(row(3, RefusedVariant::Clean, 2000.0));
        let ratio = r.refused_ratio().unwrap();
        assert_eq!(ratio.values, vec![0.95, 0.8, 0.9]);
        assert_eq!(ratio.median, 0.9);
        let text = r.render("### test");
        assert!(
            text.contains("| 1 % refused | 3 | **0.90x** | 0.80-0.95 |"),
            "{text}"
        );
        assert!(
            text.contains("| **median of 3** | refused | | | | **900** (min-max 800-950) |"),
            "{text}"
        );
        assert!(
            text.contains(
                "| 2 | refused | 1000 | 10 | 1.00 | 800 | 30.0 | n/a | 50.0 | 40 | 0 | 10 | 0 |"
            ),
            "{text}"
        );
    }

    #[test]
    fn ratios_pair_rounds_and_take_the_median() {
        let mut r = Report::default();
        for (round, raw, rd) in [(0, 100.0, 90.0), (1, 50.0, 50.0), (2, 100.0, 120.0)] {
            r.throughput.push(row(Side::RawBatch, round, raw, 10.0));
            r.throughput.push(row(Side::Redeliver, round, rd, 11.0));
        }
        let c = r
            .comparison("happy", QueueKind::Quorum, Side::RawBatch)
            .unwrap();
        assert_eq!(c.msg_ratio.values, vec![0.9, 1.0, 1.2]);
        assert_eq!(c.msg_ratio.median, 1.0);
        assert!((c.cpu_ratio.median - 1.1).abs() < 1e-9);
        // 1.2 / 0.9 = 1.33 > 1.25: too wide.
        assert!(c.msg_ratio.conclusive(None).is_err());
        let narrow = RoundStats::of(vec![0.97, 1.0, 1.02]);
        assert!(narrow.conclusive(None).is_ok());
        assert!(narrow.conclusive(Some(0.95)).is_ok());
        // The interval crosses the target.
        assert!(narrow.conclusive(Some(0.99)).is_err());
        // Too few rounds.
        assert!(RoundStats::of(vec![1.0, 1.0]).conclusive(None).is_err());
        let text = r.render("### test");
        assert!(
            text.contains("| happy | quorum | rawb | 3 | **1.00x** |"),
            "{text}"
        );
    }
}
