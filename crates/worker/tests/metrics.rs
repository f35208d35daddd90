//! The metrics the worker emits, observed through a minimal in-memory recorder (own test binary:
//! the recorder is process-global).

// Test code: a failed expectation panics, in test helpers as in tests (the workspace lints
// forbid it in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use common::*;
use metrics::{
    Counter, CounterFn, Gauge, GaugeFn, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder,
    SharedString, Unit,
};
use redeliver_testkit::mgmt::{await_listed_connection, force_close_connection};
use redeliver_testkit::{amqp_url, eventually};
use redeliver_worker::metrics_names as m;
use redeliver_worker::{
    CancellationToken, Context, HandlerError, Jitter, Json, QueueType, RetryPolicy, Worker,
    WorkerState,
};

#[derive(Default)]
struct Cell {
    count: AtomicU64,
    gauge: Mutex<f64>,
    samples: Mutex<Vec<f64>>,
}

impl CounterFn for Cell {
    fn increment(&self, v: u64) {
        self.count.fetch_add(v, Ordering::SeqCst);
    }
    fn absolute(&self, v: u64) {
        self.count.fetch_max(v, Ordering::SeqCst);
    }
}

impl GaugeFn for Cell {
    fn increment(&self, v: f64) {
        *self.gauge.lock().unwrap() += v;
    }
    fn decrement(&self, v: f64) {
        *self.gauge.lock().unwrap() -= v;
    }
    fn set(&self, v: f64) {
        *self.gauge.lock().unwrap() = v;
    }
}

impl HistogramFn for Cell {
    fn record(&self, v: f64) {
        self.samples.lock().unwrap().push(v);
    }
}

#[derive(Default)]
struct TestRecorder {
    cells: Mutex<HashMap<String, Arc<Cell>>>,
}

/// "name{a=1,b=2}" with labels sorted.
fn render(key: &Key) -> String {
    let mut labels: Vec<String> = key
        .labels()
        .map(|l| format!("{}={}", l.key(), l.value()))
        .collect();
    labels.sort();
    format!("{}{{{}}}", key.name(), labels.join(","))
}

impl TestRecorder {
    fn cell(&self, key: &Key) -> Arc<Cell> {
        self.cells
            .lock()
            .unwrap()
            .entry(render(key))
            .or_default()
            .clone()
    }
    fn get(&self, name: &str) -> Option<Arc<Cell>> {
        self.cells.lock().unwrap().get(name).cloned()
    }
}

impl Recorder for TestRecorder {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        Counter::from_arc(self.cell(key))
    }
    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::from_arc(self.cell(key))
    }
    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::from_arc(self.cell(key))
    }
}

struct Shared(Arc<TestRecorder>);
impl Recorder for Shared {
    fn describe_counter(&self, k: KeyName, u: Option<Unit>, d: SharedString) {
        self.0.describe_counter(k, u, d)
    }
    fn describe_gauge(&self, k: KeyName, u: Option<Unit>, d: SharedString) {
        self.0.describe_gauge(k, u, d)
    }
    fn describe_histogram(&self, k: KeyName, u: Option<Unit>, d: SharedString) {
        self.0.describe_histogram(k, u, d)
    }
    fn register_counter(&self, key: &Key, md: &Metadata<'_>) -> Counter {
        self.0.register_counter(key, md)
    }
    fn register_gauge(&self, key: &Key, md: &Metadata<'_>) -> Gauge {
        self.0.register_gauge(key, md)
    }
    fn register_histogram(&self, key: &Key, md: &Metadata<'_>) -> Histogram {
        self.0.register_histogram(key, md)
    }
}

fn recorder() -> Arc<TestRecorder> {
    static R: OnceLock<Arc<TestRecorder>> = OnceLock::new();
    R.get_or_init(|| {
        let r = Arc::new(TestRecorder::default());
        metrics::set_global_recorder(Shared(r.clone())).expect("no other recorder");
        r
    })
    .clone()
}

#[derive(serde::Deserialize)]
struct Job {
    kind: String,
}

/// One success, one retry-then-success, one permanent failure, one undecodable body: each
/// counter, the duration histogram and the gauges show exactly that, labelled by queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counters_match_what_happened() {
    init_tracing();
    let rec = recorder();
    let (_names, conn, topo, queue) =
        fixture("metrics", QueueType::Classic, 6, QueueType::Classic).await;
    let token = CancellationToken::new();
    let conn_name = format!("metrics-{queue}");
    let builder = Worker::builder(amqp_url())
        .topology(topo.clone())
        .connection_name(conn_name.clone())
        .policy(
            RetryPolicy::constant(Duration::from_millis(20))
                .jitter(Jitter::None)
                .max_retries(3),
        )
        .handler(|job: Json<Job>, ctx: Context| async move {
            match (job.kind.as_str(), ctx.attempt()) {
                ("flaky", 0) => Err(HandlerError::transient("once")),
                ("bad", _) => Err(HandlerError::permanent("never")),
                _ => Ok(()),
            }
        });
    let mut status = builder.status_handle();
    let run = tokio::spawn(builder.run(token.clone()));
    status
        .wait_for_timeout(Duration::from_secs(20), |s| *s == WorkerState::Consuming)
        .await
        .expect("consuming");
    let q = format!("queue={queue}");
    for (state, value) in [("consuming", 1.0), ("connecting", 0.0), ("draining", 0.0)] {
        let gauge = rec
            .get(&format!("{}{{{q},state={state}}}", m::CONNECTION_STATE))
            .expect("state gauge");
        assert_eq!(*gauge.gauge.lock().unwrap(), value, "{state}");
    }

    publish_all(
        &conn,
        &queue,
        vec![
            (br#"{"kind":"ok"}"#.to_vec(), props("1")),
            (br#"{"kind":"flaky"}"#.to_vec(), props("2")),
            (br#"{"kind":"bad"}"#.to_vec(), props("3")),
            (b"<xml/>".to_vec(), props("4")),
        ],
    )
    .await;
    let count = |name: String| rec.get(&name).map_or(0, |c| c.count.load(Ordering::SeqCst));
    let succeeded = format!("{}{{{q}}}", m::MESSAGES_SUCCEEDED);
    assert!(eventually(Duration::from_secs(10), || count(succeeded.clone()) == 2).await);
    assert!(
        eventually(Duration::from_secs(5), || count(format!(
            "{}{{{q},reason=undecodable}}",
            m::MESSAGES_DEAD_LETTERED
        )) == 1)
        .await
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        count(format!("{}{{{q}}}", m::MESSAGES_RECEIVED)),
        5,
        "4 messages + 1 retry copy"
    );
    assert_eq!(
        count(format!("{}{{attempt=1,{q}}}", m::MESSAGES_RETRIED)),
        1
    );
    assert_eq!(
        count(format!(
            "{}{{{q},reason=permanent}}",
            m::MESSAGES_DEAD_LETTERED
        )),
        1
    );
    assert_eq!(count(format!("{}{{{q}}}", m::SETTLE_FAILURES)), 0);
    let durations = rec.get(&format!("{}{{{q}}}", m::HANDLER_DURATION)).unwrap();
    assert_eq!(
        durations.samples.lock().unwrap().len(),
        4,
        "one per handler call (not for the undecodable body)"
    );
    let in_flight = rec
        .get(&format!("{}{{{q}}}", m::HANDLERS_IN_FLIGHT))
        .unwrap();
    assert_eq!(*in_flight.gauge.lock().unwrap(), 0.0);

    // A lost connection counts as a reconnect once the worker consumes again.
    let reconnects = format!("{}{{{q}}}", m::RECONNECTS);
    assert_eq!(count(reconnects.clone()), 0);
    await_listed_connection(&conn_name).await;
    force_close_connection(&conn_name).await;
    assert!(
        eventually(Duration::from_secs(20), || count(reconnects.clone()) == 1).await,
        "one reconnect counted"
    );
    status
        .wait_for_timeout(Duration::from_secs(20), |s| *s == WorkerState::Consuming)
        .await
        .expect("consuming again");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(count(reconnects), 1);

    token.cancel();
    run.await.unwrap().unwrap();
    for (state, value) in [("stopped", 1.0), ("consuming", 0.0)] {
        let gauge = rec
            .get(&format!("{}{{{q},state={state}}}", m::CONNECTION_STATE))
            .expect("state gauge");
        assert_eq!(*gauge.gauge.lock().unwrap(), value, "{state}");
    }
}
