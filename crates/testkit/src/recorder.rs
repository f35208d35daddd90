//! The metrics the code under test records, kept in memory for the test to read: a
//! process-wide [`metrics`] recorder, installed by the first call of [`recorder`].
//!
//! A metric is found by its name and its labels, written `"k=v,k=v"` in any order (`""` for
//! none). Metrics are process-global, so a test that reads them runs in a binary of its own or
//! labels what it reads with names of its own (a unique queue).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use metrics::{
    Counter, CounterFn, Gauge, GaugeFn, Histogram, HistogramFn, Key, KeyName, Metadata,
    SharedString, Unit,
};

/// What was recorded, by metric: counters, gauges and histograms alike.
#[derive(Default)]
pub struct Recorded {
    cells: Mutex<HashMap<String, Arc<Cell>>>,
}

/// The process-wide recorder, installed on the first call: call it before the code under test
/// registers its metrics (a metric registered before is recorded nowhere).
///
/// # Panics
///
/// When another recorder was installed in this process.
pub fn recorder() -> &'static Recorded {
    static RECORDED: OnceLock<&'static Recorded> = OnceLock::new();
    RECORDED.get_or_init(|| {
        let recorded: &'static Recorded = Box::leak(Box::default());
        metrics::set_global_recorder(Global(recorded))
            .expect("another metrics recorder is installed in this test binary");
        recorded
    })
}

impl Recorded {
    /// Counter `name` with `labels`, 0 when never registered.
    pub fn counter(&self, name: &str, labels: &str) -> u64 {
        self.find(name, labels)
            .map_or(0, |c| c.count.load(Ordering::SeqCst))
    }

    /// Gauge `name` with `labels`, `None` when never registered.
    pub fn gauge(&self, name: &str, labels: &str) -> Option<f64> {
        self.find(name, labels).map(|c| *lock(&c.gauge))
    }

    /// The values histogram `name` with `labels` recorded, in order; empty when never
    /// registered.
    pub fn samples(&self, name: &str, labels: &str) -> Vec<f64> {
        self.find(name, labels)
            .map(|c| lock(&c.samples).clone())
            .unwrap_or_default()
    }

    fn find(&self, name: &str, labels: &str) -> Option<Arc<Cell>> {
        let labels = labels
            .split(',')
            .filter(|l| !l.is_empty())
            .map(str::to_owned);
        lock(&self.cells).get(&render(name, labels)).cloned()
    }

    fn cell(&self, key: &Key) -> Arc<Cell> {
        let labels = key.labels().map(|l| format!("{}={}", l.key(), l.value()));
        Arc::clone(
            lock(&self.cells)
                .entry(render(key.name(), labels))
                .or_default(),
        )
    }
}

/// `name{a=1,b=2}`, the labels sorted: how a metric is filed whatever the order of its labels.
fn render(name: &str, labels: impl Iterator<Item = String>) -> String {
    let mut labels: Vec<String> = labels.collect();
    labels.sort();
    format!("{name}{{{}}}", labels.join(","))
}

/// A lock that a panicking test thread did not take down with it: the values stay readable.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// One metric's values; a metric is only ever one of the three kinds.
#[derive(Default)]
struct Cell {
    count: AtomicU64,
    gauge: Mutex<f64>,
    samples: Mutex<Vec<f64>>,
}

impl CounterFn for Cell {
    fn increment(&self, value: u64) {
        self.count.fetch_add(value, Ordering::SeqCst);
    }
    fn absolute(&self, value: u64) {
        // A counter never goes down: an older absolute value arriving late is ignored.
        self.count.fetch_max(value, Ordering::SeqCst);
    }
}

impl GaugeFn for Cell {
    fn increment(&self, value: f64) {
        *lock(&self.gauge) += value;
    }
    fn decrement(&self, value: f64) {
        *lock(&self.gauge) -= value;
    }
    fn set(&self, value: f64) {
        *lock(&self.gauge) = value;
    }
}

impl HistogramFn for Cell {
    fn record(&self, value: f64) {
        lock(&self.samples).push(value);
    }
}

/// The installed recorder: [`metrics::set_global_recorder`] takes it by value, the tests read
/// the same [`Recorded`] through [`recorder`].
struct Global(&'static Recorded);

impl metrics::Recorder for Global {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        Counter::from_arc(self.0.cell(key))
    }
    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::from_arc(self.0.cell(key))
    }
    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::from_arc(self.0.cell(key))
    }
}
