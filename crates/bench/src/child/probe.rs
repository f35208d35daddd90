//! What both consumers call for every delivery: counts, latency histogram, delay errors.
//! One mutex, taken once per message on both sides, so it costs them the same.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Result};
use serde::{Deserialize, Serialize};
use tokio::sync::{oneshot, watch};

use crate::payload::{now_ns, PayloadIn};
use crate::stats::{self, Histogram};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Ok,
    Fail,
    /// Like `Ok`, but every handler holds its delivery until `target` of them are held at once
    /// (scenario 6: RSS with the whole prefetch in flight), then all complete.
    Hold,
}

impl Kind {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "ok" => Ok(Kind::Ok),
            "fail" => Ok(Kind::Fail),
            "hold" => Ok(Kind::Hold),
            other => bail!("unknown RUN kind '{other}'"),
        }
    }
}

/// Result of one RUN, sent to the parent as JSON.
#[derive(Serialize, Deserialize, Debug, Clone, Default)]
pub struct RunReport {
    pub ok: u64,
    pub fail: u64,
    /// Unix ns: RUN received, the first delivery handled (ok or failed), and the event that
    /// reached the target. Drain rates run from `first_ns`: neither side's connection or
    /// consumer setup is timed.
    pub go_ns: u64,
    #[serde(default)]
    pub first_ns: u64,
    pub last_ns: u64,
    /// Publish -> handler, over the successful deliveries of this RUN, microseconds.
    pub lat_p50_us: u64,
    pub lat_p99_us: u64,
    pub lat_max_us: u64,
    /// Scenario 3: (intended delay ms, observed minus intended, microseconds).
    pub delay_errors: Vec<(u32, i64)>,
    /// Scenario 11, native retries: handler start minus the `x-redeliver-not-before` time the
    /// worker put on the retry (Unix ms), microseconds.
    #[serde(default)]
    pub not_before_errors: Vec<i64>,
    /// Scenario 11: retries handled whose message had already completed its retry in this
    /// process (no first failure left to pair with): handled twice. Not counted in `ok`.
    #[serde(default)]
    pub duplicates: u64,
    /// CPU time the consumer process used from the first delivery handled to the report,
    /// microseconds: the same window as the drain rate.
    pub cpu_us: u64,
    /// CPU time from the RUN to the first delivery handled, microseconds: the redeliver side
    /// starts its worker there (connection, topology, consumer), the raw side its consumer.
    #[serde(default)]
    pub setup_cpu_us: u64,
    pub baseline_rss_kb: u64,
    pub rss_kb: u64,
    pub hwm_kb: u64,
    /// `RUN hold`: RSS when all `target` deliveries were held at once.
    #[serde(default)]
    pub held_rss_kb: u64,
}

/// A snapshot of the current RUN (`STAT`), for runs no single process completes (scale-out).
#[derive(Serialize, Deserialize, Debug, Clone, Copy, Default)]
pub struct Stat {
    pub ok: u64,
    pub fail: u64,
    /// Unix ns of the first and the latest delivery handled in this RUN (0: none yet).
    pub first_ns: u64,
    pub last_ns: u64,
    /// CPU time of the process since the first delivery handled in this RUN (since the RUN
    /// until one is), microseconds.
    pub cpu_us: u64,
}

struct Inner {
    kind: Kind,
    target: u64,
    ok: u64,
    fail: u64,
    go_ns: u64,
    first_ns: u64,
    last_event_ns: u64,
    /// CPU time at the RUN, then at its first delivery.
    run_cpu0_us: u64,
    cpu0_us: u64,
    held: u64,
    held_rss_kb: u64,
    hist: Histogram,
    first_fail: HashMap<u64, Instant>,
    /// `dedup`: every message handled successfully in this process, by `seq`.
    seen: HashSet<u64>,
    delay_errors: Vec<(u32, i64)>,
    not_before_errors: Vec<i64>,
    duplicates: u64,
    done: Option<oneshot::Sender<u64>>,
}

pub struct Probe {
    track_delay: bool,
    /// Scenario 11: a message handled successfully a second time is counted as a duplicate,
    /// not in `ok` (a consumer session lost with deliveries unsettled gets them again).
    dedup: bool,
    inner: Mutex<Inner>,
    /// A `RUN hold` is waiting for its deliveries to pile up (checked by every delivery, on both
    /// sides alike: one relaxed load).
    holding: AtomicBool,
    release: watch::Sender<bool>,
}

impl Probe {
    pub fn new(track_delay: bool, dedup: bool) -> Self {
        Probe {
            track_delay,
            dedup,
            inner: Mutex::new(Inner {
                kind: Kind::Ok,
                target: u64::MAX,
                ok: 0,
                fail: 0,
                go_ns: 0,
                first_ns: 0,
                last_event_ns: 0,
                run_cpu0_us: 0,
                cpu0_us: 0,
                held: 0,
                held_rss_kb: 0,
                hist: Histogram::default(),
                first_fail: HashMap::new(),
                seen: HashSet::new(),
                delay_errors: Vec::new(),
                not_before_errors: Vec::new(),
                duplicates: 0,
                done: None,
            }),
            holding: AtomicBool::new(false),
            release: watch::channel(false).0,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding this lock is a bench bug; keep counting rather than cascade.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts a new RUN: the receiver fires with the Unix ns of the `target`-th event.
    pub fn reset(&self, kind: Kind, target: u64) -> oneshot::Receiver<u64> {
        let (tx, rx) = oneshot::channel();
        let mut g = self.lock();
        g.kind = kind;
        g.target = target;
        g.ok = 0;
        g.fail = 0;
        g.go_ns = now_ns();
        g.first_ns = 0;
        g.last_event_ns = 0;
        g.run_cpu0_us = stats::cpu_us();
        g.cpu0_us = g.run_cpu0_us;
        g.held = 0;
        g.held_rss_kb = 0;
        g.hist = Histogram::default();
        g.delay_errors.clear();
        g.not_before_errors.clear();
        g.duplicates = 0;
        g.done = Some(tx);
        let hold = kind == Kind::Hold;
        drop(g);
        self.release.send_replace(!hold);
        self.holding.store(hold, Ordering::Release);
        rx
    }

    /// Whether deliveries are being held (`RUN hold`): the raw consumer then gives each one a
    /// task of its own, as the worker does.
    pub fn holding(&self) -> bool {
        self.holding.load(Ordering::Relaxed)
    }

    /// In a `RUN hold`, waits until `target` deliveries are held at once; the last one to
    /// arrive samples the RSS (after a short settle) and releases them all. Returns at once
    /// otherwise.
    pub async fn hold(&self) {
        if !self.holding() {
            return;
        }
        let mut rx = self.release.subscribe();
        let last = {
            let mut g = self.lock();
            g.held += 1;
            g.held == g.target
        };
        if last {
            tokio::time::sleep(Duration::from_millis(300)).await;
            let rss = stats::mem(None).map(|m| m.rss_kb).unwrap_or(0);
            self.lock().held_rss_kb = rss;
            self.holding.store(false, Ordering::Release);
            self.release.send_replace(true);
        } else {
            let _ = rx.wait_for(|released| *released).await;
        }
    }

    fn event(g: &mut Inner, now: u64) {
        if g.first_ns == 0 {
            g.first_ns = now;
            // Once per RUN: the CPU window starts where the drain rate's does, so a side that
            // connects and declares its topology at the RUN is not charged for it per message.
            g.cpu0_us = stats::cpu_us();
        }
        g.last_event_ns = now;
    }

    /// The current RUN so far.
    pub fn stat(&self) -> Stat {
        let g = self.lock();
        Stat {
            ok: g.ok,
            fail: g.fail,
            first_ns: g.first_ns,
            last_ns: g.last_event_ns,
            cpu_us: stats::cpu_us().saturating_sub(g.cpu0_us),
        }
    }

    /// A delivery handled successfully.
    pub fn on_ok(&self, p: &PayloadIn) {
        let now = now_ns();
        let mut g = self.lock();
        if self.dedup && !g.seen.insert(p.seq) {
            g.duplicates += 1;
            return;
        }
        g.hist.record(now.saturating_sub(p.ts_ns) / 1000);
        if self.track_delay {
            if let (Some(ms), Some(t0)) = (p.retry_ms, g.first_fail.remove(&p.seq)) {
                let err_us = t0.elapsed().as_micros() as i64 - i64::from(ms) * 1000;
                g.delay_errors.push((ms, err_us));
            }
        }
        Self::event(&mut g, now);
        g.ok += 1;
        if matches!(g.kind, Kind::Ok | Kind::Hold) && g.ok == g.target {
            if let Some(tx) = g.done.take() {
                let _ = tx.send(now);
            }
        }
    }

    /// Scenario 11: a retry handled successfully, which says it was scheduled with `asked` (and,
    /// a native retry, not before `not_before_ms`, Unix ms). Records (now - first failure) -
    /// `asked` as [`Self::on_ok`] records it with the delay from the body.
    pub fn on_retry_ok(&self, p: &PayloadIn, asked: Duration, not_before_ms: Option<u64>) {
        let now = now_ns();
        let mut g = self.lock();
        g.hist.record(now.saturating_sub(p.ts_ns) / 1000);
        let Some(t0) = g.first_fail.remove(&p.seq) else {
            // Its retry ran before: a second delivery of a completed message.
            g.duplicates += 1;
            return;
        };
        let err_us = t0.elapsed().as_micros() as i64 - asked.as_micros() as i64;
        let ms = u32::try_from(asked.as_millis()).unwrap_or(u32::MAX);
        g.delay_errors.push((ms, err_us));
        if let Some(nb) = not_before_ms {
            let now_us = i64::try_from(now / 1000).unwrap_or(i64::MAX);
            let nb_us = i64::try_from(nb.saturating_mul(1000)).unwrap_or(i64::MAX);
            g.not_before_errors.push(now_us - nb_us);
        }
        Self::event(&mut g, now);
        g.ok += 1;
        if matches!(g.kind, Kind::Ok | Kind::Hold) && g.ok == g.target {
            if let Some(tx) = g.done.take() {
                let _ = tx.send(now);
            }
        }
    }

    /// A first delivery the handler fails into a retry.
    pub fn on_fail(&self, p: &PayloadIn) {
        let now = now_ns();
        let mut g = self.lock();
        if self.track_delay {
            g.first_fail.insert(p.seq, Instant::now());
        }
        Self::event(&mut g, now);
        g.fail += 1;
        if g.kind == Kind::Fail && g.fail == g.target {
            if let Some(tx) = g.done.take() {
                let _ = tx.send(now);
            }
        }
    }

    pub fn report(&self, last_ns: u64, baseline_rss_kb: u64) -> Result<RunReport> {
        let mem = stats::mem(None)?;
        let g = self.lock();
        if g.go_ns == 0 {
            return Err(anyhow!("report before any RUN"));
        }
        Ok(RunReport {
            ok: g.ok,
            fail: g.fail,
            go_ns: g.go_ns,
            first_ns: g.first_ns,
            last_ns,
            lat_p50_us: g.hist.percentile(0.50),
            lat_p99_us: g.hist.percentile(0.99),
            lat_max_us: g.hist.max(),
            delay_errors: g.delay_errors.clone(),
            not_before_errors: g.not_before_errors.clone(),
            duplicates: g.duplicates,
            cpu_us: stats::cpu_us().saturating_sub(g.cpu0_us),
            setup_cpu_us: g.cpu0_us.saturating_sub(g.run_cpu0_us),
            baseline_rss_kb,
            rss_kb: mem.rss_kb,
            hwm_kb: mem.hwm_kb,
            held_rss_kb: g.held_rss_kb,
        })
    }
}
