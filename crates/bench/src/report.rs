//! The Markdown report: one table per scenario family, then the targets.

use std::fmt::Write;

use crate::child::{QueueKind, Side};

pub struct ThroughputRow {
    pub scenario: String,
    pub queue: QueueKind,
    pub side: Side,
    pub messages: u64,
    pub consume_per_s: f64,
    pub publish_per_s: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub peak_rss_mib: f64,
    pub rss_delta_mib: f64,
    /// Consumer process CPU (user + system) per message during the drain, microseconds.
    pub cpu_us_per_msg: f64,
    /// consume msg/s of every round (the row shows the best).
    pub runs: Vec<f64>,
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

pub struct Target {
    pub name: String,
    pub goal: String,
    pub measured: String,
    pub met: bool,
}

#[derive(Default)]
pub struct Report {
    pub throughput: Vec<ThroughputRow>,
    pub delay: Vec<DelayRow>,
    pub park: Vec<ParkRow>,
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

impl Report {
    /// msg/s of one row, if measured.
    pub fn consume_rate(&self, scenario: &str, queue: QueueKind, side: Side) -> Option<f64> {
        self.throughput
            .iter()
            .find(|r| r.scenario == scenario && r.queue == queue && r.side == side)
            .map(|r| r.consume_per_s)
    }

    pub fn render(&self, header: &str) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "{header}");
        if !self.throughput.is_empty() {
            let _ = writeln!(s, "\n### Throughput and latency (scenarios 1 and 2)\n");
            let _ = writeln!(
                s,
                "| scenario | queue | side | messages | consume msg/s | publish msg/s | consumer CPU us/msg | p50 latency ms | p99 latency ms | peak RSS MiB | RSS delta MiB | redeliver / raw msg/s | all rounds msg/s |"
            );
            let _ = writeln!(
                s,
                "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"
            );
            for r in &self.throughput {
                // Against each raw consumer of the same scenario and queue type.
                let ratio = match r.side {
                    Side::Raw | Side::RawBatch => String::new(),
                    Side::Redeliver => [Side::Raw, Side::RawBatch]
                        .into_iter()
                        .filter_map(|s| {
                            self.consume_rate(&r.scenario, r.queue, s)
                                .filter(|raw| *raw > 0.0)
                                .map(|raw| {
                                    format!("**{:.2}x** vs {}", r.consume_per_s / raw, s.short())
                                })
                        })
                        .collect::<Vec<_>>()
                        .join(", "),
                };
                let _ = writeln!(
                    s,
                    "| {} | {} | {} | {} | {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {} | {} |",
                    r.scenario,
                    r.queue.name(),
                    r.side.name(),
                    r.messages,
                    rate(r.consume_per_s),
                    rate(r.publish_per_s),
                    r.cpu_us_per_msg,
                    r.p50_ms,
                    r.p99_ms,
                    r.peak_rss_mib,
                    r.rss_delta_mib,
                    ratio,
                    r.runs
                        .iter()
                        .map(|v| format!("{v:.0}"))
                        .collect::<Vec<_>>()
                        .join(" / ")
                );
            }
        }
        if !self.delay.is_empty() {
            let _ = writeln!(
                s,
                "\n### Delay accuracy (scenario 3): observed minus intended delay\n"
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
                "\n### Memory under waiting retries (scenario 4): consumer process RSS\n"
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
            let _ = writeln!(s, "\n### Targets (ratios from this run)\n");
            let _ = writeln!(s, "| target | goal | measured | met |");
            let _ = writeln!(s, "|---|---|---|---|");
            for t in &self.targets {
                let _ = writeln!(
                    s,
                    "| {} | {} | {} | {} |",
                    t.name,
                    t.goal,
                    t.measured,
                    if t.met { "yes" } else { "**no**" }
                );
            }
        }
        if !self.errors.is_empty() {
            let _ = writeln!(s, "\n### Errors\n");
            for e in &self.errors {
                let _ = writeln!(s, "- {e}");
            }
        }
        s
    }
}
