//! The fault suite in native retry mode (`tests/native_*.rs`): which retry mode a broker gets
//! ([`RetryPlan`]), and when each handler call ran against the earliest time its retry allowed
//! ([`Run`], [`Timing`]).
//!
//! A native retry (RabbitMQ 4.3+ quorum queues) waits in the work queue itself, held by the
//! broker until its `x-opt-delivery-time`, and carries its earliest time as
//! `x-redeliver-not-before`; the worker must never run a handler before it. The workers'
//! `--runs` file says, per handler call, when it ran, the earliest time it carried and the
//! delay that led to it, so the harness checks every retry two ways:
//!
//! - against the `x-redeliver-not-before` it carried (native retries carry one; retries through
//!   the delay levels do not);
//! - against the delay that led to it: a retry after a delay `d` runs no earlier than `d` after
//!   the first run of the attempt before it (whichever run's failure sent it, that run started
//!   no earlier than the first). This holds in both modes, so the delay levels are checked too.
//!
//! A run more than [`EARLY_TOLERANCE_MS`] before either time is *early*; the suite requires
//! none.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::time::{Duration, Instant};

use redeliver_amqp::headers::DeadLetterInfo;
use redeliver_amqp::url::redact;
use redeliver_amqp::{BrokerVersion, ServerInfo};

use super::accounting::Accounting;
use super::scenario::Scenario;
use super::worker::{WorkerCmd, WorkerProc};
use super::{read_lines, report};

/// How much earlier than its time a run may start before it counts as early: the clocks are the
/// same machine's, but the worker stamps `not-before` before its disposition leaves and the
/// handler stamps its run after the delivery was decoded and scheduled.
pub const EARLY_TOLERANCE_MS: u64 = 50;

/// One handler call, as the worker's `--runs` file records it (before the handler acts).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Run {
    /// The message id.
    pub id: String,
    /// Its attempt (0 = first delivery).
    pub attempt: u32,
    /// When the handler ran (Unix ms).
    pub at_ms: u64,
    /// The `x-redeliver-not-before` it carried (Unix ms), if any.
    pub not_before_ms: Option<u64>,
    /// The `x-redeliver-delay-ms` it carried: the delay that led to this attempt.
    pub delay_ms: Option<u64>,
    /// What the handler did (`ok`, `fail`, ...).
    pub behaviour: String,
    /// The worker process that ran it.
    pub label: String,
}

impl Run {
    /// Parses `<id> <attempt> <unix ms> <not-before|-> <delay ms|-> <behaviour> <label>`.
    pub fn parse(line: &str) -> Option<Run> {
        let mut it = line.split(' ');
        let opt = |s: &str| -> Option<Option<u64>> {
            if s == "-" {
                Some(None)
            } else {
                s.parse().ok().map(Some)
            }
        };
        Some(Run {
            id: it.next()?.to_owned(),
            attempt: it.next()?.parse().ok()?,
            at_ms: it.next()?.parse().ok()?,
            not_before_ms: opt(it.next()?)?,
            delay_ms: opt(it.next()?)?,
            behaviour: it.next()?.to_owned(),
            label: it.next()?.to_owned(),
        })
    }

    /// Whether this run failed and asked for a retry.
    pub fn failed(&self) -> bool {
        self.behaviour == "fail"
    }
}

/// The runs of a `--runs` file (lines that do not parse, a line cut by a SIGKILL, are skipped).
pub fn read_runs(path: &Path) -> Vec<Run> {
    read_lines(path)
        .iter()
        .filter_map(|l| Run::parse(l))
        .collect()
}

/// A run earlier than its time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Early {
    /// The message id.
    pub id: String,
    /// The attempt that ran early.
    pub attempt: u32,
    /// The process that ran it.
    pub label: String,
    /// When it ran.
    pub at_ms: u64,
    /// The time it should not have run before.
    pub due_ms: u64,
    /// What said so: `not-before` (the header it carried) or `delay` (the previous attempt's
    /// first run plus the delay it carried).
    pub by: &'static str,
}

impl Early {
    /// How much too early, in ms.
    pub fn early_by_ms(&self) -> u64 {
        self.due_ms.saturating_sub(self.at_ms)
    }
}

/// When every retry ran, against its time.
#[derive(Clone, Debug, Default)]
pub struct Timing {
    /// Handler calls recorded.
    pub runs: usize,
    /// Of them, retries (attempt > 0).
    pub retries: usize,
    /// Retries that carried an `x-redeliver-not-before` (native retries).
    pub with_not_before: usize,
    /// Retries checked against the previous attempt's first run plus their delay.
    pub with_delay: usize,
    /// Runs earlier than their time by more than [`EARLY_TOLERANCE_MS`].
    pub early: Vec<Early>,
    /// How late retries carrying a not-before ran after it, in ms: median and maximum.
    pub late_ms: (u64, u64),
}

impl Timing {
    /// Checks every run of `runs`: pure bookkeeping, so it is tested alone.
    pub fn compute(runs: &[Run]) -> Timing {
        // The first run of each (id, attempt).
        let mut first: HashMap<(&str, u32), u64> = HashMap::new();
        for r in runs {
            first
                .entry((r.id.as_str(), r.attempt))
                .and_modify(|t| *t = (*t).min(r.at_ms))
                .or_insert(r.at_ms);
        }
        let mut t = Timing {
            runs: runs.len(),
            ..Timing::default()
        };
        let mut late = Vec::new();
        for r in runs.iter().filter(|r| r.attempt > 0) {
            t.retries += 1;
            let mut check = |due: u64, by: &'static str| {
                if r.at_ms + EARLY_TOLERANCE_MS < due {
                    t.early.push(Early {
                        id: r.id.clone(),
                        attempt: r.attempt,
                        label: r.label.clone(),
                        at_ms: r.at_ms,
                        due_ms: due,
                        by,
                    });
                }
            };
            if let Some(nb) = r.not_before_ms {
                check(nb, "not-before");
                late.push(r.at_ms.saturating_sub(nb));
            }
            if let (Some(d), Some(prev)) = (r.delay_ms, first.get(&(r.id.as_str(), r.attempt - 1)))
            {
                check(prev + d, "delay");
            }
            t.with_not_before += usize::from(r.not_before_ms.is_some());
            t.with_delay += usize::from(
                r.delay_ms.is_some() && first.contains_key(&(r.id.as_str(), r.attempt - 1)),
            );
        }
        late.sort_unstable();
        t.late_ms = (
            late.get(late.len() / 2).copied().unwrap_or(0),
            late.last().copied().unwrap_or(0),
        );
        t
    }

    /// One line with every count.
    pub fn summary(&self) -> String {
        format!(
            "runs={} retries={} (carrying not-before {}, checked against their delay {}) \
             early={} (tolerance {EARLY_TOLERANCE_MS} ms); late after not-before: median {} ms, \
             max {} ms",
            self.runs,
            self.retries,
            self.with_not_before,
            self.with_delay,
            self.early.len(),
            self.late_ms.0,
            self.late_ms.1
        )
    }

    /// The suite's invariant: no handler ran before its time. Prints the summary either way.
    pub fn assert_none_early(&self, what: &str) {
        report(format!("{what}: timing {}", self.summary()));
        let named: Vec<String> = self
            .early
            .iter()
            .take(20)
            .map(|e| {
                format!(
                    "{} attempt {} by {} at {} ({} ms before its {} {})",
                    e.id,
                    e.attempt,
                    e.label,
                    e.at_ms,
                    e.early_by_ms(),
                    e.by,
                    e.due_ms
                )
            })
            .collect();
        assert!(
            self.early.is_empty(),
            "{what}: {} handler run(s) before their time: {}",
            self.early.len(),
            named.join("; ")
        );
    }
}

/// Retries waiting at `t_ms` (Unix ms): ids whose attempt `k > 0` later ran with an earliest
/// time (its not-before, or the previous attempt's first run plus its delay) after `t_ms`,
/// while attempt `k - 1` had first run before `t_ms`. Computed afterwards from the runs, so it
/// says, whatever the mode, how many retries a fault found waiting (in the queue itself when
/// native, in the delay levels otherwise).
pub fn waiting_at(runs: &[Run], t_ms: u64) -> usize {
    let mut first: HashMap<(&str, u32), u64> = HashMap::new();
    for r in runs {
        first
            .entry((r.id.as_str(), r.attempt))
            .and_modify(|t| *t = (*t).min(r.at_ms))
            .or_insert(r.at_ms);
    }
    let mut waiting: HashMap<(&str, u32), ()> = HashMap::new();
    for r in runs.iter().filter(|r| r.attempt > 0) {
        let Some(&prev) = first.get(&(r.id.as_str(), r.attempt - 1)) else {
            continue;
        };
        let due = r
            .not_before_ms
            .or_else(|| r.delay_ms.map(|d| prev + d))
            .unwrap_or(0);
        if prev < t_ms && due > t_ms {
            waiting.insert((r.id.as_str(), r.attempt), ());
        }
    }
    waiting.len()
}

/// Ids whose last run failed with retries left (at most `max_retries` retries): their retry
/// waits (in the queue when native, in the delay levels otherwise) or is being handed over.
pub fn pending_retries(runs: &[Run], max_retries: u32) -> usize {
    let mut last: HashMap<&str, &Run> = HashMap::new();
    for r in runs {
        let e = last.entry(r.id.as_str()).or_insert(r);
        if (r.attempt, r.at_ms) > (e.attempt, e.at_ms) {
            *e = r;
        }
    }
    last.values()
        .filter(|r| r.failed() && r.attempt < max_retries)
        .count()
}

/// Which retry mode the workers of a fault test run with on this broker: `native` where the
/// broker holds native retries (RabbitMQ 4.3+), else `auto`, which must pick the delay levels.
#[derive(Clone, Copy, Debug)]
pub struct RetryPlan {
    /// The broker's version.
    pub version: BrokerVersion,
    /// Whether the workers retry natively.
    pub native: bool,
}

impl RetryPlan {
    /// Reads the version of the broker at `url`.
    pub async fn probe(url: &str) -> RetryPlan {
        let info = ServerInfo::probe(url)
            .await
            .unwrap_or_else(|e| panic!("probe the broker at {}: {e}", redact(url)));
        let version = info
            .version()
            .unwrap_or_else(|| panic!("the broker at {} sent no version", redact(url)));
        let plan = RetryPlan {
            version,
            native: version.holds_native_retries(),
        };
        report(format!(
            "RabbitMQ {version}: workers run with --retry-mode {}, expecting {}",
            plan.mode_arg(),
            plan.expected()
        ));
        plan
    }

    /// The worker's `--retry-mode`.
    pub fn mode_arg(&self) -> &'static str {
        if self.native {
            "native"
        } else {
            "auto"
        }
    }

    /// The mode every session must choose.
    pub fn expected(&self) -> &'static str {
        if self.native {
            "native"
        } else {
            "levels"
        }
    }

    /// `s.worker()` with this plan's retry mode and the scenario's runs file.
    pub fn worker(&self, s: &Scenario) -> WorkerCmd {
        s.worker()
            .arg("retry-mode", self.mode_arg())
            .arg("runs", s.runs.display())
    }

    /// Every session `w` opened chose [`Self::expected`] (its events file), and there was one.
    pub fn assert_chosen(&self, w: &WorkerProc) {
        let modes = w.retry_modes();
        assert!(
            !modes.is_empty() && modes.iter().all(|m| m == self.expected()),
            "{}: RabbitMQ {} with --retry-mode {}: sessions chose {modes:?}, expected {}",
            w.label(),
            self.version,
            self.mode_arg(),
            self.expected()
        );
    }

    /// Before RabbitMQ 4.3, an explicit `native` stops the worker at start, saying why (the
    /// worker's `WorkerError::RetryMode`); on 4.3+ nothing to check.
    pub async fn assert_explicit_native_refused(&self, cmd: &WorkerCmd) {
        if self.native {
            return;
        }
        let mut w = cmd
            .clone()
            .arg("retry-mode", "native")
            .spawn("explicit-native");
        let start = Instant::now();
        while w.is_running() {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "RabbitMQ {}: a worker with --retry-mode native still runs after 30 s:\n{}",
                self.version,
                w.log_tail(20)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let status = w.terminate(Duration::from_secs(1)).await;
        let log = std::fs::read_to_string(w.log()).unwrap_or_default();
        assert!(
            !status.contains("exit status: 0") && log.contains("4.3") && w.retry_modes().is_empty(),
            "RabbitMQ {}: an explicit native retry mode must stop the worker before it \
             consumes, saying it needs 4.3 ({status}):\n{}",
            self.version,
            w.log_tail(20)
        );
        report(format!(
            "RabbitMQ {}: --retry-mode native refused at start ({status})",
            self.version
        ));
    }

    /// Whether a native fault scenario has anything to run on this broker. On 4.3+ it does:
    /// true. Before 4.3 there is no native retry to fault: an explicit `native` must stop the
    /// worker at start ([`Self::assert_explicit_native_refused`]) and `auto` must choose the
    /// delay levels (a worker started, consuming, then stopped); then false, and the caller
    /// returns. The same faults through the delay levels are the `reliability_*` suites' (kill,
    /// connections, restart), which run on every version.
    pub async fn native_or_refused(&self, s: &Scenario) -> bool {
        if self.native {
            return true;
        }
        self.assert_explicit_native_refused(&s.worker()).await;
        let mut w = self.worker(s).spawn("auto");
        s.wait_consumers(1, Duration::from_secs(30)).await;
        w.terminate(Duration::from_secs(10)).await;
        self.assert_chosen(&w);
        report(format!(
            "RabbitMQ {}: --retry-mode auto chose the delay levels; the faults through them \
             are the reliability_* suites'",
            self.version
        ));
        false
    }

    /// After [`Scenario::account`]: no handler ran before its time, and natively every retry
    /// carried its earliest time (a retry without one went through the delay levels instead).
    /// Prints one `NATIVE-RESULT` line with the counts per broker (lost, duplicates, early
    /// runs, the dead letters' reasons) first.
    pub fn assert_on_time(&self, s: &Scenario, acc: &Accounting, what: &str) {
        let timing = Timing::compute(&s.runs());
        let reasons = self.dead_letter_reasons(acc);
        report(format!(
            "NATIVE-RESULT fault=\"{what}\" broker=\"{}\" mode={} N={} lost={} \
             duplicates={} re-handled={} early={} retries={} (with not-before {}) \
             dead-lettered={} reasons={reasons:?} success-acks-counted={} acked={}",
            acc.broker,
            self.expected(),
            acc.published,
            acc.lost.len(),
            acc.settled_twice,
            acc.rehandled,
            timing.early.len(),
            timing.retries,
            timing.with_not_before,
            acc.dead_lettered,
            acc.acked_successes,
            acc.succeeded
        ));
        timing.assert_none_early(what);
        assert!(timing.retries > 0, "{what}: no retry ran at all");
        if self.native {
            assert_eq!(
                timing.with_not_before, timing.retries,
                "{what}: native retries without x-redeliver-not-before (through the levels?)"
            );
        }
    }

    /// The dead letters' reasons. Native dead letters must carry the worker's reason
    /// (`x-opt-redeliver-dead-letter-reason`, read as a header over AMQP 0-9-1) unless the
    /// broker moved them itself (its delivery limit); through the levels, the broker's x-death
    /// says why.
    pub fn dead_letter_reasons(&self, acc: &Accounting) -> BTreeMap<String, usize> {
        let mut reasons = BTreeMap::new();
        for g in &acc.dlq {
            let ours = DeadLetterInfo::read(g.headers()).map(|i| i.reason);
            let reason = match (&ours, g.death_reason()) {
                (Some(r), _) => r.clone(),
                (None, Some(broker)) => format!("x-death {broker}"),
                (None, None) => "none".to_owned(),
            };
            if self.native {
                assert!(
                    ours.is_some() || reason == "x-death delivery_limit",
                    "{}: a native dead letter without the worker's reason: {reason}, headers {:?}",
                    g.message_id(),
                    g.headers()
                );
            }
            *reasons.entry(reason).or_default() += 1;
        }
        reasons
    }
}

/// Management names of the AMQP 1.0 connections whose container id is `container_id` (the
/// worker's native consumer names its container after its connection name; AMQP 1.0 clients
/// send no `connection_name` property).
pub fn amqp1_connections(client: &crate::mgmt::Client, container_id: &str) -> Vec<String> {
    let list = client
        .get_json("/api/connections?columns=name,container_id")
        .unwrap_or_else(|e| panic!("{e}"));
    list.as_array()
        .into_iter()
        .flatten()
        .filter(|c| c["container_id"].as_str() == Some(container_id))
        .filter_map(|c| c["name"].as_str().map(str::to_owned))
        .collect()
}

/// `messages_delayed` of `queue` as the management API shows it (native retries held by a
/// RabbitMQ 4.3+ quorum queue; statistics up to 5 s old), `None` where the broker has no such
/// statistic.
pub fn delayed(client: &crate::mgmt::Client, queue: &str) -> Option<u64> {
    let q = client
        .get_json(&format!("/api/queues/%2f/{}", crate::mgmt::pct(queue)))
        .ok()?;
    q["messages_delayed"].as_u64()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(id: &str, attempt: u32, at: u64, nb: Option<u64>, d: Option<u64>, what: &str) -> Run {
        Run {
            id: id.into(),
            attempt,
            at_ms: at,
            not_before_ms: nb,
            delay_ms: d,
            behaviour: what.into(),
            label: "w".into(),
        }
    }

    #[test]
    fn a_line_parses_and_a_cut_one_does_not() {
        assert_eq!(
            Run::parse("m1 1 1000 1200 200 ok a-1"),
            Some(run("m1", 1, 1000, Some(1200), Some(200), "ok")).map(|r| Run {
                label: "a-1".into(),
                ..r
            })
        );
        assert_eq!(
            Run::parse("m1 0 1000 - - fail w"),
            Some(run("m1", 0, 1000, None, None, "fail"))
        );
        assert_eq!(Run::parse("m1 0 1000 - -"), None);
    }

    #[test]
    fn early_runs_are_named_by_either_check() {
        let runs = vec![
            run("a", 0, 1_000, None, None, "fail"),
            // On time (within the tolerance) by both checks.
            run("a", 1, 1_470, Some(1_500), Some(500), "ok"),
            run("b", 0, 1_000, None, None, "fail"),
            // 100 ms before its not-before.
            run("b", 1, 1_400, Some(1_500), Some(500), "ok"),
            run("c", 0, 1_000, None, None, "fail"),
            run("c", 0, 2_000, None, None, "fail"),
            // Levels: no not-before; 1 000 + 800 is its time, not 2 000 + 800.
            run("c", 1, 1_900, None, Some(800), "ok"),
            run("d", 0, 1_000, None, None, "fail"),
            // Levels, 300 ms early.
            run("d", 1, 1_500, None, Some(800), "ok"),
        ];
        let t = Timing::compute(&runs);
        assert_eq!(t.runs, 9);
        assert_eq!(t.retries, 4);
        assert_eq!(t.with_not_before, 2);
        assert_eq!(t.with_delay, 4);
        let early: Vec<(&str, &str, u64)> = t
            .early
            .iter()
            .map(|e| (e.id.as_str(), e.by, e.early_by_ms()))
            .collect();
        assert_eq!(
            early,
            [
                ("b", "not-before", 100),
                ("b", "delay", 100),
                ("d", "delay", 300)
            ]
        );
        let err = std::panic::catch_unwind(|| t.assert_none_early("t")).unwrap_err();
        let msg = err.downcast_ref::<String>().cloned().unwrap_or_default();
        assert!(
            msg.contains("b attempt 1") && msg.contains("d attempt 1"),
            "{msg}"
        );
    }

    #[test]
    fn waiting_and_pending_retries() {
        let runs = vec![
            run("a", 0, 1_000, None, None, "fail"),
            run("a", 1, 3_000, Some(3_000), Some(2_000), "ok"),
            run("b", 0, 1_000, None, None, "fail"),
            run("b", 1, 1_200, None, Some(200), "fail"),
            run("c", 0, 1_000, None, None, "ok"),
        ];
        assert_eq!(waiting_at(&runs, 1_100), 2);
        assert_eq!(waiting_at(&runs, 2_000), 1);
        assert_eq!(waiting_at(&runs, 3_500), 0);
        assert_eq!(pending_retries(&runs, 3), 1);
        assert_eq!(pending_retries(&runs, 1), 0);
    }
}
