//! The conservation harness shared by the reliability suite (`tests/reliability_*.rs`).
//!
//! A [`Scenario`] owns one uniquely prefixed topology (work queue, DLX, DLQ and its own delay
//! levels) on one broker. The test publishes messages with unique ids ([`Scenario::publish`]),
//! runs `reliability_worker` processes against it ([`Scenario::worker`]), injects its fault, and
//! then [`Scenario::account`]s for every id, one [`IdAccount`] each: acked after a success (gone
//! from every queue of the scenario, with the successes its handlers recorded before the ack,
//! and which worker process recorded each), in the DLQ (with each copy's headers), still in the
//! work queue or the delay levels, parked in the unroutable queue, or *lost* (found nowhere and
//! never recorded as a success; the suite requires none). Every id settled or handled more than
//! once is named with its count ([`Accounting::duplicates`]), so a failure says which ids were
//! lost or duplicated, not only how many. Beside the per-id account, the workers' own success
//! counter (observed after each ack frame is written) says how many success acks left the
//! processes: acks written beyond the ids acked are acks the broker never acted on (a
//! *duplicate* in the totals, as opposed to a handler that ran again without a second ack,
//! *re-handled*). Both are allowed by at-least-once, and each fault test bounds them.
//!
//! Broker URLs hold passwords: the harness hands them to worker processes through the
//! environment (`AMQP_URL`), never on a command line, and prints them redacted.
//!
//! A broker that cannot be reached fails the test with instructions, never skips it.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use futures::{FutureExt, StreamExt};
use lapin::options::{BasicGetOptions, BasicPublishOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Connection, ConnectionProperties};
use redeliver_amqp::url::redact;
use redeliver_amqp::{DelayConfig, Publisher, QueueType, Topology};

use crate::mgmt;
use crate::process::LoggedChild;

/// The workspace's root directory (the examples and `scripts/` live there).
fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The default broker (AMQP_URL overrides).
pub fn amqp_url() -> String {
    crate::amqp_url()
}

/// The default broker's management API (RABBITMQ_MGMT_URL overrides).
pub fn mgmt_url() -> String {
    mgmt::url()
}

/// Connects to `url` or fails the test with instructions.
pub async fn connect(url: &str) -> Connection {
    let props = ConnectionProperties::default()
        .with_connection_name("redeliver-reliability-harness".into());
    match Connection::connect(url, props).await {
        Ok(c) => c,
        Err(e) => panic!(
            "cannot connect to RabbitMQ at {}: {e}\n{}",
            redact(url),
            crate::START_BROKER
        ),
    }
}

/// Prints a line the suite's report is built from (`cargo test -- --nocapture` shows it).
pub fn report(line: impl AsRef<str>) {
    println!("[reliability] {}", line.as_ref());
}

// ---------------------------------------------------------------------------------------------
// The worker binary

/// Path of the `reliability_worker` example, built once per test process.
///
/// `cargo test --workspace` builds every example next to the test binaries
/// (`<target>/<profile>/examples/`, whatever CARGO_TARGET_DIR says), so it is found there from
/// this executable's own path (`<target>/<profile>/deps/<test>-<hash>`). When a narrower command
/// (`cargo test --test reliability_kill`) did not build it, it is built here with the same cargo.
pub fn worker_binary() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| crate::examples::example_binary(&workspace_root(), "reliability_worker"))
}

// ---------------------------------------------------------------------------------------------
// Scenario

/// How a scenario's topology is shaped.
#[derive(Clone)]
pub struct Shape {
    /// AMQP URL of the broker (the test's publisher and the accounting use it).
    pub url: String,
    /// Type of the work queue.
    pub queue_type: QueueType,
    /// Delay levels of the scenario's own delay infrastructure.
    pub delay_levels: u8,
    /// Type of the delay level queues.
    pub delay_queue_type: QueueType,
    /// Type of the DLQ.
    pub dlq_queue_type: QueueType,
    /// Quorum `x-delivery-limit` of the work queue.
    pub delivery_limit: u32,
}

/// Shows the URL without its password.
impl std::fmt::Debug for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shape")
            .field("url", &redact(&self.url))
            .field("queue_type", &self.queue_type)
            .field("delay_levels", &self.delay_levels)
            .field("delay_queue_type", &self.delay_queue_type)
            .field("dlq_queue_type", &self.dlq_queue_type)
            .field("delivery_limit", &self.delivery_limit)
            .finish()
    }
}

impl Default for Shape {
    fn default() -> Self {
        Self {
            url: amqp_url(),
            queue_type: QueueType::Quorum,
            // 10 levels of 10 ms reach 10.23 s, more than any retry delay used here; fewer
            // queues than the default 24 keeps setup fast.
            delay_levels: 10,
            delay_queue_type: QueueType::Quorum,
            dlq_queue_type: QueueType::Classic,
            delivery_limit: 20,
        }
    }
}

/// One test's topology, files and worker processes.
pub struct Scenario {
    /// Test name, as given to [`Scenario::new`].
    pub name: String,
    /// Prefix of every object of the scenario (delay levels included).
    pub prefix: String,
    /// Queue name without the prefix.
    pub short_queue: String,
    /// How the topology is shaped.
    pub shape: Shape,
    /// The topology the workers consume.
    pub topology: Topology,
    /// Directory of the worker logs, events and records.
    pub dir: PathBuf,
    /// Ids the handlers recorded as succeeded, one per line.
    pub record: PathBuf,
    /// Handler calls, `id attempt behaviour` per line.
    pub calls: PathBuf,
    /// Successes settled by each ack frame the workers wrote, one number per line.
    pub acked: PathBuf,
    /// The broker's product and version, as it announced them (`RabbitMQ 4.0.5`).
    pub broker: String,
    /// The harness's own connection and publisher; replaced by [`Scenario::reconnect`] after a
    /// broker restart.
    link: std::sync::Mutex<(Arc<Connection>, Publisher)>,
}

fn kind(t: QueueType) -> &'static str {
    match t {
        QueueType::Quorum => "quorum",
        QueueType::Classic => "classic",
    }
}

impl Scenario {
    /// Declares a fresh, uniquely prefixed topology for test `name`.
    pub async fn new(name: &str, shape: Shape) -> Arc<Scenario> {
        let id = uuid::Uuid::new_v4().simple().to_string();
        let prefix = format!("rel-{name}-{}.", &id[..8]);
        let short_queue = "work".to_owned();
        let delay = DelayConfig::new()
            .prefix(prefix.clone())
            .levels(shape.delay_levels)
            .queue_type(shape.delay_queue_type);
        let topology = Topology::new(short_queue.clone())
            .prefix(prefix.clone())
            .queue_type(shape.queue_type)
            .dlq_queue_type(shape.dlq_queue_type)
            .delivery_limit(Some(shape.delivery_limit))
            .delay(delay.clone());
        let dir = std::env::temp_dir()
            .join("redeliver-reliability")
            .join(prefix.trim_end_matches('.'));
        std::fs::create_dir_all(&dir).expect("create the scenario directory");
        let conn = connect(&shape.url).await;
        // Declared here, before any worker runs, so messages can be published first; the worker
        // declares the same objects again (idempotent) from the same settings.
        topology
            .declare(&conn)
            .await
            .unwrap_or_else(|e| panic!("declare the topology of {prefix}: {e}"));
        let publisher = Publisher::new(&conn, delay)
            .await
            .expect("open a confirm-mode publisher");
        let broker = match redeliver_amqp::ServerInfo::probe(&shape.url).await {
            Ok(info) => format!("RabbitMQ {}", info.version_text()),
            Err(e) => panic!("probe the broker at {}: {e}", redact(&shape.url)),
        };
        report(format!(
            "{name}: {broker}, prefix {prefix}, files in {}",
            dir.display()
        ));
        Arc::new(Scenario {
            name: name.to_owned(),
            record: dir.join("succeeded.txt"),
            calls: dir.join("calls.txt"),
            acked: dir.join("acked.txt"),
            broker,
            dir,
            prefix,
            short_queue,
            shape,
            topology,
            link: std::sync::Mutex::new((Arc::new(conn), publisher)),
        })
    }

    /// Runs `body`, then deletes the topology whether or not it panicked (and keeps the files
    /// for diagnosis only when it did), then re-raises the panic.
    pub async fn run<F, Fut>(self: Arc<Self>, body: F)
    where
        F: FnOnce(Arc<Scenario>) -> Fut,
        Fut: Future<Output = ()>,
    {
        let outcome = AssertUnwindSafe(body(Arc::clone(&self)))
            .catch_unwind()
            .await;
        self.cleanup(outcome.is_ok()).await;
        if let Err(panic) = outcome {
            std::panic::resume_unwind(panic);
        }
    }

    async fn cleanup(&self, passed: bool) {
        // A fresh connection: the scenario's may have been closed by the fault under test.
        let conn = match Connection::connect(&self.shape.url, ConnectionProperties::default()).await
        {
            Ok(c) => c,
            Err(e) => {
                eprintln!("cleanup of {}: cannot connect: {e}", self.prefix);
                return;
            }
        };
        if let Err(e) = self.topology.delete(&conn).await {
            eprintln!("cleanup of {}: {e}", self.prefix);
        }
        if let Err(e) = self.topology.delay_config().delete(&conn).await {
            eprintln!("cleanup of {} delay levels: {e}", self.prefix);
        }
        let _ = conn.close(200, "cleanup".into()).await;
        // RELIABILITY_KEEP=1 keeps the worker logs and records of passing tests too.
        if passed && std::env::var_os("RELIABILITY_KEEP").is_none() {
            let _ = std::fs::remove_dir_all(&self.dir);
        } else {
            eprintln!(
                "{}: worker logs and records kept in {}",
                self.name,
                self.dir.display()
            );
        }
    }

    /// Full name of the work queue.
    pub fn queue(&self) -> String {
        self.topology.queue_name()
    }

    /// Full name of the DLQ.
    pub fn dlq(&self) -> String {
        self.topology.dlq_name()
    }

    /// The scenario's delay infrastructure.
    pub fn delay(&self) -> &DelayConfig {
        self.topology.delay_config()
    }

    /// The harness's current connection.
    pub fn connection(&self) -> Arc<Connection> {
        Arc::clone(&self.lock_link().0)
    }

    fn publisher(&self) -> Publisher {
        self.lock_link().1.clone()
    }

    fn lock_link(&self) -> std::sync::MutexGuard<'_, (Arc<Connection>, Publisher)> {
        // The pair is replaced whole, so a panic elsewhere cannot leave it half-updated.
        self.link.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Opens a new connection and publisher (after the broker dropped the old ones), retrying
    /// for up to `timeout`.
    pub async fn reconnect(&self, timeout: Duration) {
        let start = Instant::now();
        loop {
            let props = ConnectionProperties::default()
                .with_connection_name("redeliver-reliability-harness".into());
            match Connection::connect(&self.shape.url, props).await {
                Ok(conn) => match Publisher::new(&conn, self.delay().clone()).await {
                    Ok(p) => {
                        *self.lock_link() = (Arc::new(conn), p);
                        return;
                    }
                    Err(e) => assert!(start.elapsed() < timeout, "reopen the publisher: {e}"),
                },
                Err(e) => assert!(
                    start.elapsed() < timeout,
                    "reconnect to {} within {timeout:?}: {e}",
                    redact(&self.shape.url)
                ),
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Connection name the worker processes of this scenario use, as the management API shows
    /// it: only these connections are ever force-closed.
    pub fn worker_connection_name(&self) -> String {
        format!("redeliver-worker:{}", self.queue())
    }

    /// Connection name of the worker processes' publishing connections (retry copies, dead
    /// letters), as the management API shows it: the worker names it after its consuming one.
    pub fn worker_publishing_connection_name(&self) -> String {
        format!("{} (publishing)", self.worker_connection_name())
    }

    /// A worker process command line for this scenario; add fault flags, then `spawn`.
    pub fn worker(&self) -> WorkerCmd {
        WorkerCmd {
            urls: self.shape.url.clone(),
            args: vec![
                "--queue".into(),
                self.short_queue.clone(),
                "--prefix".into(),
                self.prefix.clone(),
                "--queue-type".into(),
                kind(self.shape.queue_type).into(),
                "--delay-levels".into(),
                self.shape.delay_levels.to_string(),
                "--delay-queue-type".into(),
                kind(self.shape.delay_queue_type).into(),
                "--dlq-queue-type".into(),
                kind(self.shape.dlq_queue_type).into(),
                "--delivery-limit".into(),
                self.shape.delivery_limit.to_string(),
                "--record".into(),
                self.record.display().to_string(),
                "--calls".into(),
                self.calls.display().to_string(),
                "--acked".into(),
                self.acked.display().to_string(),
            ],
            dir: self.dir.clone(),
        }
    }

    // -- publishing

    /// Publishes `n` JSON messages `{"id": ...}` with `message_id = id` to the work queue, each
    /// confirmed by the broker (up to 100 confirms in flight). Returns the ids.
    pub async fn publish(&self, n: usize) -> Vec<String> {
        let ids: Vec<String> = (0..n).map(|i| format!("{}m{i:06}", self.prefix)).collect();
        self.publish_ids(&ids, |_| None).await;
        ids
    }

    /// Publishes one message per id, with `mode(i)` as the body's `mode` when given.
    pub async fn publish_ids(&self, ids: &[String], mode: impl Fn(usize) -> Option<&'static str>) {
        self.publish_ids_to(&self.queue(), ids, mode).await;
    }

    /// [`Self::publish_ids`] to any queue of the broker (the DLQ, to test a replay).
    pub async fn publish_ids_to(
        &self,
        queue: &str,
        ids: &[String],
        mode: impl Fn(usize) -> Option<&'static str>,
    ) {
        let queue = queue.to_owned();
        let jobs: Vec<(String, Vec<u8>)> = ids
            .iter()
            .enumerate()
            .map(|(i, id)| {
                let mut body = serde_json::json!({ "id": id });
                if let Some(m) = mode(i) {
                    body["mode"] = m.into();
                }
                (id.clone(), serde_json::to_vec(&body).expect("serialize"))
            })
            .collect();
        let results: Vec<_> = futures::stream::iter(jobs.into_iter().map(|(id, body)| {
            let publisher = self.publisher();
            let queue = queue.clone();
            async move {
                let props = BasicProperties::default()
                    .with_message_id(id.as_str().into())
                    .with_content_type("application/json".into())
                    .with_delivery_mode(2);
                publisher
                    .publish_bytes("", &queue, &body, props)
                    .await
                    .map_err(|e| format!("publish {id}: {e}"))
            }
        }))
        .buffer_unordered(100)
        .collect()
        .await;
        for r in results {
            r.unwrap_or_else(|e| panic!("{e}"));
        }
    }

    /// Publishes raw bytes with the given properties to `exchange`/`routing_key` on a confirm
    /// channel, mandatory off (the delay exchanges' alternate exchange is what must catch a bad
    /// key), and waits for the confirm.
    pub async fn publish_raw(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        props: BasicProperties,
    ) {
        self.try_publish_raw(exchange, routing_key, body, props)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    }

    /// [`Self::publish_raw`] returning a nack or a channel error instead of panicking.
    pub async fn try_publish_raw(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        props: BasicProperties,
    ) -> Result<(), String> {
        let publisher = self.publisher();
        let confirm = publisher
            .channel()
            .basic_publish(
                exchange.into(),
                routing_key.into(),
                BasicPublishOptions::default(),
                body,
                props,
            )
            .await
            .map_err(|e| format!("publish to {exchange}/{routing_key}: {e}"))?
            .await
            .map_err(|e| format!("confirm of {exchange}/{routing_key}: {e}"))?;
        if confirm.is_ack() {
            Ok(())
        } else {
            Err(format!(
                "broker did not confirm the publish to {exchange}/{routing_key}: {confirm:?}"
            ))
        }
    }

    // -- observing

    /// Ready messages and consumers of `queue` right now (passive declare: no statistics lag).
    pub async fn queue_state(&self, queue: &str) -> (u32, u32) {
        let d = crate::queue_depth(&self.connection(), queue)
            .await
            .unwrap_or_else(|e| panic!("passive declare of {queue}: {e}"));
        (d.ready, d.consumers)
    }

    /// Ready counts of every queue of the scenario.
    pub async fn counts(&self) -> Counts {
        let (queue, consumers) = self.queue_state(&self.queue()).await;
        let (dlq, _) = self.queue_state(&self.dlq()).await;
        let mut delay = 0;
        for k in 0..self.shape.delay_levels {
            delay += self.queue_state(&self.delay().level_name(k)).await.0;
        }
        let (unroutable, _) = self.queue_state(&self.delay().unroutable_name()).await;
        Counts {
            queue,
            consumers,
            dlq,
            delay,
            unroutable,
        }
    }

    /// Success lines of the record file, per id.
    pub fn succeeded(&self) -> HashMap<String, usize> {
        self.success_records()
            .into_iter()
            .fold(HashMap::new(), |mut m, (id, _)| {
                *m.entry(id).or_default() += 1;
                m
            })
    }

    /// Success lines of the record file: `(id, label of the worker process)`, in the order
    /// they were written (a line without a label, from an older worker, has an empty one).
    pub fn success_records(&self) -> Vec<(String, String)> {
        read_lines(&self.record)
            .into_iter()
            // The label has no spaces (the worker refuses one); an id may.
            .map(|l| match l.rsplit_once(' ') {
                Some((id, label)) => (id.to_owned(), label.to_owned()),
                None => (l, String::new()),
            })
            .collect()
    }

    /// Success acks written by the workers so far (the sum of the acked file).
    pub fn acked_successes(&self) -> u64 {
        read_lines(&self.acked)
            .iter()
            .map(|l| {
                l.parse::<u64>()
                    .unwrap_or_else(|e| panic!("{}: bad line {l:?}: {e}", self.acked.display()))
            })
            .sum()
    }

    /// Handler calls (id, attempt, behaviour) from the calls file.
    pub fn calls(&self) -> Vec<(String, u32, String)> {
        read_lines(&self.calls)
            .into_iter()
            .filter_map(|l| {
                let mut it = l.split(' ');
                let id = it.next()?.to_owned();
                let attempt = it.next()?.parse().ok()?;
                let what = it.next()?.to_owned();
                Some((id, attempt, what))
            })
            .collect()
    }

    /// Waits until `n` consumers are on the work queue; returns how long that took.
    pub async fn wait_consumers(&self, n: u32, timeout: Duration) -> Duration {
        let start = Instant::now();
        loop {
            let (_, consumers) = self.queue_state(&self.queue()).await;
            if consumers >= n {
                return start.elapsed();
            }
            assert!(
                start.elapsed() < timeout,
                "{}: {n} consumer(s) expected on {} within {timeout:?}, {consumers} there",
                self.name,
                self.queue()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Number of published ids already recorded as succeeded (at least once).
    pub fn progress(&self, ids: &HashSet<String>) -> usize {
        self.succeeded()
            .keys()
            .filter(|id| ids.contains(*id))
            .count()
    }

    /// Waits until at least `fraction` of `ids` were recorded as succeeded.
    pub async fn wait_progress(&self, ids: &HashSet<String>, fraction: f64, timeout: Duration) {
        let want = (ids.len() as f64 * fraction).ceil() as usize;
        let start = Instant::now();
        loop {
            let done = self.progress(ids);
            if done >= want {
                return;
            }
            assert!(
                start.elapsed() < timeout,
                "{}: only {done} of {} succeeded after {timeout:?} (wanted {want})",
                self.name,
                ids.len()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until every id is either recorded as succeeded or counted in the DLQ and nothing
    /// waits in the work queue or the delay levels (checked twice, 500 ms apart, so a message
    /// between two hops is not missed). Returns the time it took; panics after `timeout` with
    /// the current counts.
    pub async fn wait_settled(&self, ids: &HashSet<String>, timeout: Duration) -> Duration {
        self.try_wait_settled(ids, timeout)
            .await
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`Self::wait_settled`] without the panic: the error says what is still missing.
    pub async fn try_wait_settled(
        &self,
        ids: &HashSet<String>,
        timeout: Duration,
    ) -> Result<Duration, String> {
        let start = Instant::now();
        let mut stable = 0;
        loop {
            let c = self.counts().await;
            let ok = self.progress(ids);
            if ok + c.dlq as usize >= ids.len() && c.queue == 0 && c.delay == 0 {
                stable += 1;
                if stable == 2 {
                    return Ok(start.elapsed());
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
            stable = 0;
            if start.elapsed() > timeout {
                return Err(format!(
                    "{}: not settled after {timeout:?}: {ok} of {} succeeded, {c:?}",
                    self.name,
                    ids.len()
                ));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    // -- accounting

    /// Removes and returns every message of `queue` (call when no worker consumes it).
    pub async fn drain(&self, queue: &str) -> Vec<Got> {
        let ch = self
            .connection()
            .create_channel()
            .await
            .expect("open a channel");
        let mut out = Vec::new();
        while let Some(m) = ch
            .basic_get(queue.into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap_or_else(|e| panic!("basic.get on {queue}: {e}"))
        {
            let d = m.delivery;
            out.push(Got {
                id: d
                    .properties
                    .message_id()
                    .as_ref()
                    .map(|s| s.as_str().to_owned())
                    .unwrap_or_default(),
                headers: d.properties.headers().clone().unwrap_or_default(),
                body_len: d.data.len(),
            });
        }
        let _ = ch.close(200, "drained".into()).await;
        out
    }

    /// Accounts for every id in `ids`. Call after the workers stopped: it drains the DLQ, the
    /// work queue, the delay levels and the unroutable queue.
    ///
    /// The broker says which ids were acked: a message leaves the scenario's queues only when a
    /// worker acks it, and a worker acks the original of a retry or a dead letter only once its
    /// copy (same `message_id`) is confirmed in a delay level or the DLQ. So an id found in none
    /// of them was acked after a success, provided its handler recorded one (before the ack);
    /// without such a record it is lost.
    pub async fn account(&self, ids: &[String]) -> Accounting {
        let records = self.success_records();
        let acked_successes = self.acked_successes();
        let dlq = self.drain(&self.dlq()).await;
        let mut waiting = self.drain(&self.queue()).await;
        for k in 0..self.shape.delay_levels {
            waiting.extend(self.drain(&self.delay().level_name(k)).await);
        }
        let unroutable = self.drain(&self.delay().unroutable_name()).await;
        Accounting::compute(
            &self.name,
            &self.broker,
            ids,
            Observed {
                records,
                acked_successes,
                dlq,
                waiting,
                unroutable,
            },
        )
    }

    /// Path of the CLI (`redeliver`, crate `redeliver-cli`), built first when missing or stale.
    pub fn cli_binary() -> &'static Path {
        static BIN: OnceLock<PathBuf> = OnceLock::new();
        BIN.get_or_init(|| {
            crate::examples::package_binary(&workspace_root(), "redeliver-cli", "redeliver")
        })
    }
}

fn read_lines(path: &Path) -> Vec<String> {
    match std::fs::read_to_string(path) {
        Ok(s) => s
            .lines()
            .filter(|l| !l.is_empty())
            .map(str::to_owned)
            .collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => panic!("read {}: {e}", path.display()),
    }
}

/// Ready messages per queue of a scenario, and the work queue's consumers.
#[derive(Clone, Copy, Debug, Default)]
pub struct Counts {
    /// Ready in the work queue.
    pub queue: u32,
    /// Consumers on the work queue.
    pub consumers: u32,
    /// Ready in the DLQ.
    pub dlq: u32,
    /// Ready across the delay levels.
    pub delay: u32,
    /// Ready in the unroutable (parking) queue.
    pub unroutable: u32,
}

/// A drained message.
#[derive(Clone, Debug)]
pub struct Got {
    /// Its `message_id` (empty when it has none).
    pub id: String,
    /// Its headers.
    pub headers: FieldTable,
    /// Its body size.
    pub body_len: usize,
}

impl Got {
    /// Header `name`, if present.
    pub fn header(&self, name: &str) -> Option<&AMQPValue> {
        self.headers.inner().get(name)
    }

    /// Header `name` as text, when it is a string.
    pub fn header_str(&self, name: &str) -> Option<String> {
        crate::value_str(self.header(name)?)
    }

    /// Header `name` as an integer, when it is one.
    pub fn header_int(&self, name: &str) -> Option<i64> {
        crate::value_int(self.header(name)?)
    }

    /// `reason` of the newest x-death entry.
    pub fn death_reason(&self) -> Option<String> {
        redeliver_amqp::headers::x_death(Some(&self.headers))
            .first()
            .map(|d| d.reason.clone())
    }
}

/// Where one published id ended, as [`IdAccount::ending`] reads its account.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Ending {
    /// Gone from every queue of the scenario, with a success its handler recorded before the
    /// ack: acked after success.
    Acked,
    /// In the DLQ (and nowhere else waiting).
    DeadLettered,
    /// Still in the work queue or a delay level.
    InFlight,
    /// In the delay infrastructure's unroutable (parking) queue.
    Parked,
    /// Found nowhere, and no handler recorded a success for it.
    Lost,
}

/// Everything known about one published id after the run.
#[derive(Clone, Debug, Default)]
pub struct IdAccount {
    /// Labels of the worker processes whose handler recorded a success for it, one per
    /// success (before each ack; a label twice is one process handling it twice).
    pub handled_by: Vec<String>,
    /// Its copies in the DLQ, with their headers (x-death, attempt, last error).
    pub dlq: Vec<Got>,
    /// Its copies still in the work queue or the delay levels.
    pub waiting: usize,
    /// Its copies in the unroutable (parking) queue.
    pub parked: usize,
}

impl IdAccount {
    /// Successes its handlers recorded.
    pub fn successes(&self) -> usize {
        self.handled_by.len()
    }

    /// Copies of it the broker still holds (DLQ, work queue, delay levels, parking queue).
    pub fn copies(&self) -> usize {
        self.dlq.len() + self.waiting + self.parked
    }

    /// Where it ended. A copy still waiting wins over the rest (it is not settled yet), then a
    /// parked one, then the DLQ; an id the broker no longer holds was acked, after a success
    /// if its handler recorded one, else it is lost.
    pub fn ending(&self) -> Ending {
        if self.waiting > 0 {
            Ending::InFlight
        } else if self.parked > 0 {
            Ending::Parked
        } else if !self.dlq.is_empty() {
            Ending::DeadLettered
        } else if self.successes() > 0 {
            Ending::Acked
        } else {
            Ending::Lost
        }
    }

    /// Times it was handled or settled beyond once: handler successes plus copies held by the
    /// broker, minus one. Acked twice (the broker redelivered it although its ack was written),
    /// handled again without a second ack, acked and dead-lettered, dead-lettered twice: each
    /// extra time counts one.
    pub fn extra(&self) -> usize {
        (self.successes() + self.copies()).saturating_sub(1)
    }
}

/// The drained queues and the workers' records one [`Accounting`] is computed from.
#[derive(Debug, Default)]
pub struct Observed {
    /// Success records, `(id, worker label)`, in the order they were written.
    pub records: Vec<(String, String)>,
    /// Success acks the workers counted after writing them.
    pub acked_successes: u64,
    /// What the DLQ held.
    pub dlq: Vec<Got>,
    /// What the work queue and the delay levels held.
    pub waiting: Vec<Got>,
    /// What the unroutable (parking) queue held.
    pub unroutable: Vec<Got>,
}

/// Where every published id ended up: per id ([`Self::ids`]), and the totals the reports and
/// RELIABILITY.md's tables use.
#[derive(Debug)]
pub struct Accounting {
    /// The scenario's name.
    pub scenario: String,
    /// The broker it ran on (`RabbitMQ 4.0.5`).
    pub broker: String,
    /// Every published id's account.
    pub ids: BTreeMap<String, IdAccount>,
    /// Ids published.
    pub published: usize,
    /// Ids acked after a success: gone from every queue, with a success recorded by the handler.
    pub succeeded: usize,
    /// Successes settled by the ack frames the workers wrote (counted after each frame was
    /// written to the socket, from the worker's `redeliver_messages_succeeded_total`).
    pub acked_successes: u64,
    /// Ids gone from the broker beyond the success acks counted: a SIGKILL between writing an
    /// ack and counting it (must be 0 without kills; more would be an ack without a success).
    pub acks_unseen: usize,
    /// Success lines the handlers recorded for published ids (before the ack).
    pub handler_successes: usize,
    /// Handler successes beyond one per id: the handler ran again for a message already
    /// handled (a fault between its success and the broker receiving the ack). The ids are in
    /// [`Self::duplicates`].
    pub rehandled: usize,
    /// Distinct published ids found in the DLQ.
    pub dead_lettered: usize,
    /// Messages of published ids found in the DLQ (more than `dead_lettered` when one id was
    /// dead-lettered twice).
    pub dlq_messages: usize,
    /// Ids found in the DLQ more than once, with their number of copies.
    pub dlq_repeated: Vec<(String, usize)>,
    /// Messages still in the work queue or the delay levels.
    pub remaining: usize,
    /// Ids with a copy still in the work queue or the delay levels.
    pub in_flight: Vec<String>,
    /// Messages found in the unroutable (parking) queue.
    pub unroutable: usize,
    /// Published ids found nowhere, or gone from the broker without a handler success.
    pub lost: Vec<String>,
    /// Every id handled or settled more than once, with how many times beyond once
    /// ([`IdAccount::extra`]).
    pub duplicates: BTreeMap<String, usize>,
    /// Settlements beyond one per id, counted as the broker sees them: success acks written
    /// plus copies still in the broker (DLQ, work queue, delay levels, parking queue), minus the
    /// ids they settle. A message acked twice, acked and dead-lettered, or dead-lettered twice
    /// counts one; a handler that ran again without a second ack does not (that is
    /// [`Self::rehandled`]). Each of them is one of the ids named in [`Self::duplicates`].
    pub settled_twice: usize,
    /// Messages found (or successes recorded) that this scenario did not publish.
    pub foreign: usize,
    /// What the DLQ held.
    pub dlq: Vec<Got>,
    /// What the unroutable queue held.
    pub unroutable_messages: Vec<Got>,
}

/// At most this many ids are printed in one message; the count says how many there were.
const NAMED: usize = 20;

/// `{id: n, ...}` of at most [`NAMED`] entries, and `... (k in all)` past that.
fn named_counts(m: &BTreeMap<String, usize>) -> String {
    let mut out: Vec<String> = m
        .iter()
        .take(NAMED)
        .map(|(id, n)| format!("{id}: {n}"))
        .collect();
    if m.len() > NAMED {
        out.push(format!("... ({} ids in all)", m.len()));
    }
    format!("{{{}}}", out.join(", "))
}

/// `[id, ...]` of at most [`NAMED`] ids, and `... (k in all)` past that.
fn named(ids: &[String]) -> String {
    let mut out: Vec<&str> = ids.iter().take(NAMED).map(String::as_str).collect();
    let all = format!("... ({} ids in all)", ids.len());
    if ids.len() > NAMED {
        out.push(&all);
    }
    format!("[{}]", out.join(", "))
}

impl Accounting {
    /// Accounts for `ids` from what was observed: pure bookkeeping, so it is tested alone.
    pub fn compute(scenario: &str, broker: &str, ids: &[String], seen: Observed) -> Accounting {
        let mut accounts: BTreeMap<String, IdAccount> = ids
            .iter()
            .map(|id| (id.clone(), IdAccount::default()))
            .collect();
        let mut foreign = 0;
        for (id, label) in seen.records {
            match accounts.get_mut(&id) {
                Some(a) => a.handled_by.push(label),
                None => foreign += 1,
            }
        }
        for g in &seen.dlq {
            match accounts.get_mut(&g.id) {
                Some(a) => a.dlq.push(g.clone()),
                None => foreign += 1,
            }
        }
        for g in &seen.waiting {
            match accounts.get_mut(&g.id) {
                Some(a) => a.waiting += 1,
                None => foreign += 1,
            }
        }
        for g in &seen.unroutable {
            match accounts.get_mut(&g.id) {
                Some(a) => a.parked += 1,
                None => foreign += 1,
            }
        }
        let with = |e: Ending| -> Vec<String> {
            accounts
                .iter()
                .filter(|(_, a)| a.ending() == e)
                .map(|(id, _)| id.clone())
                .collect()
        };
        let lost = with(Ending::Lost);
        let succeeded = with(Ending::Acked).len();
        let in_flight = with(Ending::InFlight);
        let duplicates: BTreeMap<String, usize> = accounts
            .iter()
            .filter(|(_, a)| a.extra() > 0)
            .map(|(id, a)| (id.clone(), a.extra()))
            .collect();
        let handler_successes: usize = accounts.values().map(IdAccount::successes).sum();
        let handled_ids = accounts.values().filter(|a| a.successes() > 0).count();
        let in_broker: Vec<&IdAccount> = accounts.values().filter(|a| a.copies() > 0).collect();
        let broker_copies: usize = in_broker.iter().map(|a| a.copies()).sum();
        // One settlement per id is expected: a success ack, or its one copy in the broker.
        let settlements = seen.acked_successes as usize + broker_copies;
        let settled_ids = succeeded + in_broker.len();
        let dlq_repeated: Vec<(String, usize)> = accounts
            .iter()
            .filter(|(_, a)| a.dlq.len() > 1)
            .map(|(id, a)| (id.clone(), a.dlq.len()))
            .collect();
        Accounting {
            scenario: scenario.to_owned(),
            broker: broker.to_owned(),
            published: ids.len(),
            succeeded,
            acked_successes: seen.acked_successes,
            acks_unseen: succeeded.saturating_sub(seen.acked_successes as usize),
            handler_successes,
            rehandled: handler_successes - handled_ids,
            dead_lettered: accounts.values().filter(|a| !a.dlq.is_empty()).count(),
            dlq_messages: accounts.values().map(|a| a.dlq.len()).sum(),
            dlq_repeated,
            remaining: accounts.values().map(|a| a.waiting).sum(),
            in_flight,
            unroutable: seen.unroutable.len(),
            lost,
            duplicates,
            settled_twice: settlements.saturating_sub(settled_ids),
            foreign,
            dlq: seen.dlq,
            unroutable_messages: seen.unroutable,
            ids: accounts,
        }
    }

    /// Handled or settled beyond once, all ids together (the sum of [`Self::duplicates`]).
    pub fn duplicate_total(&self) -> usize {
        self.duplicates.values().sum()
    }

    /// Each duplicated id with what happened to it: its successes and the processes that
    /// recorded them, its copies in the DLQ (with their x-death reasons) and elsewhere.
    pub fn describe_duplicates(&self) -> String {
        let mut out: Vec<String> = self
            .duplicates
            .keys()
            .take(NAMED)
            .filter_map(|id| {
                let a = self.ids.get(id)?;
                let reasons: Vec<String> = a
                    .dlq
                    .iter()
                    .map(|g| g.death_reason().unwrap_or_else(|| "none".into()))
                    .collect();
                Some(format!(
                    "{id}: handled by {:?}, DLQ copies {reasons:?}, waiting {}, parked {}",
                    a.handled_by, a.waiting, a.parked
                ))
            })
            .collect();
        if self.duplicates.len() > NAMED {
            out.push(format!("... ({} ids in all)", self.duplicates.len()));
        }
        out.join("; ")
    }

    /// One line with every count.
    pub fn summary(&self) -> String {
        format!(
            "N={} succeeded={} (success acks {}, unseen {}; handler successes {}, re-handled {}) \
             dead-lettered={} (DLQ messages {}, ids twice or more {}) remaining={} unroutable={} \
             lost={} duplicates={} (settled twice {}) foreign={}; duplicated ids {}",
            self.published,
            self.succeeded,
            self.acked_successes,
            self.acks_unseen,
            self.handler_successes,
            self.rehandled,
            self.dead_lettered,
            self.dlq_messages,
            self.dlq_repeated.len(),
            self.remaining,
            self.unroutable,
            self.lost.len(),
            self.duplicate_total(),
            self.settled_twice,
            self.foreign,
            named_counts(&self.duplicates)
        )
    }

    /// The suite's invariant: nothing lost. Prints the summary either way.
    pub fn assert_nothing_lost(&self, what: &str) {
        report(format!("{what}: {}", self.summary()));
        assert!(
            self.lost.is_empty(),
            "{what}: {} message(s) lost: {}",
            self.lost.len(),
            named(&self.lost)
        );
        assert_eq!(
            self.foreign, 0,
            "{what}: messages of another scenario found"
        );
    }

    /// Nothing lost, nothing left in the work queue or delay levels, nothing parked.
    pub fn assert_settled(&self, what: &str) {
        self.assert_settled_parked(what, 0);
    }

    /// [`Self::assert_settled`] where exactly `parked` messages must be in the parking queue.
    pub fn assert_settled_parked(&self, what: &str, parked: usize) {
        self.assert_nothing_lost(what);
        assert!(
            self.in_flight.is_empty(),
            "{what}: {} message(s) still waiting in the work queue or the delay levels: {}",
            self.remaining,
            named(&self.in_flight)
        );
        assert_eq!(
            self.unroutable,
            parked,
            "{what}: messages in the parking queue (delay infrastructure's unroutable queue): \
             {:?}",
            self.unroutable_messages
                .iter()
                .map(|g| g.id.as_str())
                .take(NAMED)
                .collect::<Vec<_>>()
        );
    }

    /// Bounds what at-least-once allows a fault to cost: the ids handled or settled more than
    /// once, `bound` times at most in all, each named in the message; the settlements and the
    /// handler runs beyond one per id at most `bound` each; and, without a process killed
    /// (`killed` false), every id gone from the broker matched by a success ack the workers
    /// counted. Prints the measured counts as one `RESULT` line (RELIABILITY.md's tables are
    /// filled from them), with the duplicated ids.
    pub fn assert_duplicates_at_most(&self, what: &str, bound: usize, killed: bool) {
        report(format!(
            "RESULT fault=\"{what}\" broker=\"{}\" N={} lost={} duplicates={} re-handled={} \
             dlq-ids={} dlq-messages={} acks-unseen={} bound={bound} duplicated-ids={}",
            self.broker,
            self.published,
            self.lost.len(),
            self.settled_twice,
            self.rehandled,
            self.dead_lettered,
            self.dlq_messages,
            self.acks_unseen,
            named_counts(&self.duplicates)
        ));
        assert!(
            self.duplicate_total() <= bound,
            "{what}: ids handled or settled more than once, {} times beyond once in all, more \
             than the bound {bound}: {}",
            self.duplicate_total(),
            self.describe_duplicates()
        );
        assert!(
            self.settled_twice <= bound,
            "{what}: {} settlements beyond one per id, more than the bound {bound}; duplicated \
             ids: {}",
            self.settled_twice,
            self.describe_duplicates()
        );
        assert!(
            self.rehandled <= bound,
            "{what}: {} messages handled again, more than the bound {bound}; duplicated ids: {}",
            self.rehandled,
            self.describe_duplicates()
        );
        if killed {
            assert!(
                self.acks_unseen <= bound,
                "{what}: {} ids left the broker without a counted success ack",
                self.acks_unseen
            );
        } else {
            assert_eq!(
                self.acks_unseen, 0,
                "{what}: ids left the broker without a success ack (acks counted {}, ids \
                 acked {})",
                self.acked_successes, self.succeeded
            );
        }
    }

    /// Ids found in the DLQ more than once must be none: every dead letter is one message.
    pub fn assert_dead_lettered_once(&self, what: &str) {
        let repeated: BTreeMap<String, usize> = self.dlq_repeated.iter().cloned().collect();
        assert!(
            repeated.is_empty(),
            "{what}: ids dead-lettered more than once: {}",
            named_counts(&repeated)
        );
    }

    /// DLQ entries per x-death reason.
    pub fn dlq_reasons(&self) -> BTreeMap<String, usize> {
        let mut m = BTreeMap::new();
        for g in &self.dlq {
            *m.entry(g.death_reason().unwrap_or_else(|| "none".into()))
                .or_default() += 1;
        }
        m
    }
}

// ---------------------------------------------------------------------------------------------
// Worker processes

/// Command line of a `reliability_worker` process. The broker URLs, which hold the password,
/// are not part of it: they reach the process through its environment (`AMQP_URL`), so `ps`,
/// `/proc/<pid>/cmdline` and any message quoting the command never show them.
#[derive(Clone)]
pub struct WorkerCmd {
    /// Comma-separated broker URLs, passwords included: only ever put in the child's
    /// environment.
    urls: String,
    args: Vec<String>,
    dir: PathBuf,
}

impl std::fmt::Debug for WorkerCmd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerCmd")
            .field("urls", &redact(&self.urls))
            .field("args", &self.args)
            .field("dir", &self.dir)
            .finish()
    }
}

impl WorkerCmd {
    /// Adds `--flag value`.
    pub fn arg(mut self, flag: &str, value: impl ToString) -> Self {
        self.args.push(format!("--{flag}"));
        self.args.push(value.to_string());
        self
    }

    /// Adds a flag without value.
    pub fn flag(mut self, flag: &str) -> Self {
        self.args.push(format!("--{flag}"));
        self
    }

    /// Replaces the broker URLs (several, comma-separated, are tried in turn).
    pub fn urls(mut self, urls: &str) -> Self {
        urls.clone_into(&mut self.urls);
        self
    }

    /// The process `spawn` starts as `label`: the arguments (no URL among them) and, in the
    /// environment, `AMQP_URL` with the broker URLs.
    pub fn command(&self, label: &str) -> Command {
        self.command_of(worker_binary(), label)
    }

    /// [`Self::command`] running `program`.
    fn command_of(&self, program: &Path, label: &str) -> Command {
        let mut cmd = Command::new(program);
        cmd.args(&self.args)
            .arg("--events")
            .arg(self.dir.join(format!("{label}.events")))
            // Its success records name the process, so a duplicate says who handled it.
            .arg("--label")
            .arg(label)
            .env(
                "RUST_LOG",
                std::env::var("RELIABILITY_WORKER_LOG").unwrap_or_else(|_| "info".into()),
            )
            // The one source of the URLs, replacing whatever the test process was given.
            .env("AMQP_URL", &self.urls);
        cmd
    }

    /// Starts the process; its output goes to `<scenario dir>/<label>.log`, its state changes
    /// to `<label>.events`.
    pub fn spawn(&self, label: &str) -> WorkerProc {
        let log = self.dir.join(format!("{label}.log"));
        WorkerProc {
            process: LoggedChild::spawn(self.command(label), label, log),
            events: self.dir.join(format!("{label}.events")),
        }
    }
}

/// A running worker process; killed (SIGKILL) if still running when dropped.
pub struct WorkerProc {
    process: LoggedChild,
    /// Its state changes, one `unix-ms state url-index` line each.
    pub events: PathBuf,
}

/// One outage of a worker, in unix ms, as its events file tells it.
#[derive(Clone, Copy, Debug)]
pub struct Outage {
    /// When it stopped consuming.
    pub lost_at: u128,
    /// When it consumed again.
    pub back_at: u128,
    /// Index (in its `--url` list) of the URL it consumes through again.
    pub url: usize,
}

impl Outage {
    /// From losing the connection to consuming again.
    pub fn duration(&self) -> Duration {
        Duration::from_millis(u64::try_from(self.back_at - self.lost_at).unwrap_or(u64::MAX))
    }
}

/// Milliseconds since the Unix epoch (the clock of the workers' events files).
pub fn unix_ms() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0)
}

impl std::ops::Deref for WorkerProc {
    type Target = LoggedChild;

    fn deref(&self) -> &LoggedChild {
        &self.process
    }
}

impl std::ops::DerefMut for WorkerProc {
    fn deref_mut(&mut self) -> &mut LoggedChild {
        &mut self.process
    }
}

impl WorkerProc {
    /// State changes written by the worker: (unix ms, state, index of the URL in use).
    pub fn state_changes(&self) -> Vec<(u128, String, usize)> {
        read_lines(&self.events)
            .into_iter()
            .filter_map(|l| {
                let mut it = l.split(' ');
                Some((
                    it.next()?.parse().ok()?,
                    it.next()?.to_owned(),
                    // `-`: not connected yet.
                    it.next()?.parse().unwrap_or(usize::MAX),
                ))
            })
            .collect()
    }

    /// The worker's own outage after `since` (unix ms): from the first moment it stopped
    /// consuming to the next moment it consumed again. `None` while it has not recovered (or
    /// never lost its connection).
    pub fn outage_after(&self, since: u128) -> Option<Outage> {
        let changes = self.state_changes();
        let lost = changes
            .iter()
            .find(|(t, s, _)| *t >= since && s != "consuming")?;
        let back = changes
            .iter()
            .find(|(t, s, _)| *t >= lost.0 && s == "consuming")?;
        Some(Outage {
            lost_at: lost.0,
            back_at: back.0,
            url: back.2,
        })
    }

    /// Every outage of the worker so far: from leaving `consuming` to the next `consuming`
    /// (the first connection does not count; the final shutdown is not an outage).
    pub fn outages(&self) -> Vec<Duration> {
        let mut out = Vec::new();
        let mut lost_at = None;
        let mut consumed = false;
        for (t, state, _) in self.state_changes() {
            match state.as_str() {
                "consuming" => {
                    if let Some(l) = lost_at.take() {
                        out.push(Duration::from_millis(
                            u64::try_from(t - l).unwrap_or(u64::MAX),
                        ));
                    }
                    consumed = true;
                }
                "draining" | "stopped" if lost_at.is_none() => {}
                _ if consumed && lost_at.is_none() => lost_at = Some(t),
                _ => {}
            }
        }
        out
    }

    /// Waits up to `timeout` for [`Self::outage_after`].
    pub async fn wait_recovered(&self, since: u128, timeout: Duration) -> Outage {
        let start = Instant::now();
        loop {
            if let Some(r) = self.outage_after(since) {
                return r;
            }
            assert!(
                start.elapsed() < timeout,
                "{}: no recovery within {timeout:?}; state changes: {:?}\n{}",
                self.label(),
                self.state_changes(),
                self.log_tail(20)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Management API (default broker unless told otherwise)

/// Management names of the connections whose client-provided name is exactly `name`, on the
/// broker whose management API is at `mgmt`.
pub async fn connections_named(mgmt: &str, name: &str) -> Vec<String> {
    let (client, name) = (mgmt::Client::new(mgmt), name.to_owned());
    mgmt::blocking(move || client.connections_named(&name))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

/// Force-closes the given connections (as an operator or a broker-side failure would); returns
/// how many were closed. A connection already gone is not an error.
pub async fn close_connections(mgmt: &str, names: Vec<String>) -> usize {
    let client = mgmt::Client::new(mgmt);
    mgmt::blocking(move || {
        names
            .iter()
            .map(|n| client.close_connection(n).unwrap_or_else(|e| panic!("{e}")))
            .filter(|closed| *closed)
            .count()
    })
    .await
}

// ---------------------------------------------------------------------------------------------
// Extra broker nodes (scripts/cluster.sh)

/// Extra RabbitMQ nodes started by `scripts/cluster.sh` (a dedicated single node, or the
/// 3-node cluster), so disruptive faults never touch the default broker other suites use.
pub struct Nodes {
    /// Node (or cluster) name given to `scripts/cluster.sh`.
    pub name: String,
    /// Number of nodes.
    pub count: u32,
    /// AMQP port of node 1; node i listens on `base_port + i - 1`.
    pub base_port: u16,
    /// Whether the nodes run the management plugin.
    pub management: bool,
    /// True when this value started them (and so stops them when dropped).
    owned: bool,
}

impl Nodes {
    fn script_path() -> PathBuf {
        workspace_root().join("scripts/cluster.sh")
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new("bash");
        cmd.arg(Self::script_path())
            .args(args)
            .env("RD_CLUSTER_NAME", &self.name)
            .env("RD_CLUSTER_NODES", self.count.to_string())
            .env("RD_CLUSTER_BASE_PORT", self.base_port.to_string())
            .env(
                "RD_CLUSTER_MANAGEMENT",
                if self.management { "1" } else { "0" },
            );
        cmd
    }

    fn run(&self, args: &[&str]) -> Result<String, String> {
        let out = self
            .command(args)
            .output()
            .map_err(|e| format!("run scripts/cluster.sh: {e}"))?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(format!(
                "scripts/cluster.sh {} failed ({}):\n{}\n{}",
                args.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ))
        }
    }

    /// Starts the nodes unless they already run (then they are left running afterwards).
    pub async fn start(name: &str, count: u32, base_port: u16, management: bool) -> Nodes {
        let mut nodes = Nodes {
            name: name.to_owned(),
            count,
            base_port,
            management,
            owned: false,
        };
        let already = nodes.run(&["status"]).is_ok_and(|s| !s.contains(" down"));
        if !already {
            let n = Nodes {
                owned: false,
                name: nodes.name.clone(),
                ..nodes
            };
            let started = tokio::task::spawn_blocking(move || n.run(&["start"]))
                .await
                .expect("cluster.sh task");
            if let Err(e) = started {
                panic!(
                    "{e}\nThe disruptive tests start their own RabbitMQ node(s) with \
                     scripts/cluster.sh; it needs the rabbitmq-server package (run it as root \
                     or as the user owning ~/.erlang.cookie)."
                );
            }
            nodes.owned = true;
        }
        nodes
    }

    /// AMQP URL of node `i` (1-based).
    pub fn amqp_url(&self, i: u32) -> String {
        format!(
            "amqp://guest:guest@127.0.0.1:{}/%2f",
            u32::from(self.base_port) + i - 1
        )
    }

    /// Management API base URL of node `i` (1-based).
    pub fn mgmt_url(&self, i: u32) -> String {
        format!(
            "http://127.0.0.1:{}",
            u32::from(self.base_port) + 10000 + i - 1
        )
    }

    /// Erlang node name of node `i` (1-based).
    pub fn node_name(&self, i: u32) -> String {
        format!("{}-{i}@localhost", self.name)
    }

    /// `scripts/cluster.sh` with `args`, off the async runtime; panics on failure.
    pub async fn script(&self, args: &[&str]) -> String {
        let n = Nodes {
            owned: false,
            name: self.name.clone(),
            ..*self
        };
        let args: Vec<String> = args.iter().map(|s| (*s).to_owned()).collect();
        tokio::task::spawn_blocking(move || {
            let refs: Vec<&str> = args.iter().map(String::as_str).collect();
            n.run(&refs)
        })
        .await
        .expect("cluster.sh task")
        .unwrap_or_else(|e| panic!("{e}"))
    }

    /// `rabbitmqctl -n <node i> eval <expr>`; the printed result.
    pub async fn eval(&self, i: u32, expr: &str) -> String {
        let i = i.to_string();
        self.script(&["ctl", &i, "eval", expr])
            .await
            .trim()
            .to_owned()
    }

    /// `rabbitmqctl -n <node i> args...` (through the script, which knows the nodes' user and,
    /// for another RabbitMQ version, its chroot); panics on failure.
    pub async fn rabbitmqctl(&self, i: u32, args: &[&str]) {
        let i = i.to_string();
        let mut full = vec!["ctl", i.as_str()];
        full.extend_from_slice(args);
        self.script(&full).await;
    }
}

impl Drop for Nodes {
    fn drop(&mut self) {
        if self.owned {
            if let Err(e) = self.run(&["clean"]) {
                eprintln!("{e}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn got(id: &str) -> Got {
        Got {
            id: id.to_owned(),
            headers: FieldTable::default(),
            body_len: 0,
        }
    }

    fn record(id: &str, label: &str) -> (String, String) {
        (id.to_owned(), label.to_owned())
    }

    fn panic_message(f: impl FnOnce()) -> String {
        let err = std::panic::catch_unwind(AssertUnwindSafe(f)).expect_err("should panic");
        err.downcast_ref::<String>()
            .cloned()
            .or_else(|| err.downcast_ref::<&str>().map(|s| (*s).to_owned()))
            .unwrap_or_default()
    }

    #[test]
    fn every_id_has_an_ending_and_duplicates_are_named() {
        let ids: Vec<String> = [
            "ok",
            "twice",
            "dlq2",
            "ok-and-dlq",
            "gone",
            "waiting",
            "parked",
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        let seen = Observed {
            records: vec![
                record("ok", "a-1"),
                record("twice", "a-1"),
                record("twice", "a-2"),
                record("ok-and-dlq", "b-1"),
                record("someone-else", "b-1"),
            ],
            // ok, twice (acked twice: the first ack was written, then lost), ok-and-dlq.
            acked_successes: 4,
            dlq: vec![got("dlq2"), got("dlq2"), got("ok-and-dlq")],
            waiting: vec![got("waiting")],
            unroutable: vec![got("parked")],
        };
        let acc = Accounting::compute("t", "RabbitMQ 0", &ids, seen);
        let ending = |id: &str| acc.ids[id].ending();
        assert_eq!(ending("ok"), Ending::Acked);
        assert_eq!(ending("twice"), Ending::Acked);
        assert_eq!(ending("dlq2"), Ending::DeadLettered);
        assert_eq!(ending("ok-and-dlq"), Ending::DeadLettered);
        assert_eq!(ending("gone"), Ending::Lost);
        assert_eq!(ending("waiting"), Ending::InFlight);
        assert_eq!(ending("parked"), Ending::Parked);
        assert_eq!(acc.ids["twice"].handled_by, ["a-1", "a-2"]);
        assert_eq!(acc.lost, ["gone"]);
        assert_eq!(acc.in_flight, ["waiting"]);
        assert_eq!(acc.succeeded, 2);
        assert_eq!(acc.foreign, 1);
        let dup: Vec<(&str, usize)> = acc
            .duplicates
            .iter()
            .map(|(id, n)| (id.as_str(), *n))
            .collect();
        assert_eq!(dup, [("dlq2", 1), ("ok-and-dlq", 1), ("twice", 1)]);
        assert_eq!(acc.rehandled, 1);
        // Acked twice, dead-lettered twice, acked and dead-lettered: one each.
        assert_eq!(acc.settled_twice, 3);
        assert_eq!(acc.dlq_repeated, [("dlq2".to_owned(), 2)]);

        // Each failure names the ids, not only how many.
        let msg = panic_message(|| acc.assert_nothing_lost("t"));
        assert!(msg.contains("[gone]"), "{msg}");
        let msg = panic_message(|| acc.assert_duplicates_at_most("t", 2, true));
        for id in ["twice", "dlq2", "ok-and-dlq", "a-2"] {
            assert!(msg.contains(id), "{id} not named in: {msg}");
        }
        let msg = panic_message(|| acc.assert_dead_lettered_once("t"));
        assert!(msg.contains("dlq2: 2"), "{msg}");
    }

    #[test]
    fn a_clean_run_has_no_duplicates() {
        let ids = vec!["a".to_owned(), "b".to_owned()];
        let seen = Observed {
            records: vec![record("a", "w")],
            acked_successes: 1,
            dlq: vec![got("b")],
            ..Observed::default()
        };
        let acc = Accounting::compute("t", "RabbitMQ 0", &ids, seen);
        acc.assert_settled("t");
        acc.assert_duplicates_at_most("t", 0, false);
        acc.assert_dead_lettered_once("t");
        assert!(acc.duplicates.is_empty());
    }

    #[test]
    fn the_worker_command_line_holds_no_password() {
        let urls = "amqp://app:s3cret@127.0.0.1:5672/%2f,amqp://app:s3cret@127.0.0.1:5673/%2f";
        let cmd = WorkerCmd {
            urls: "amqp://guest:guest@127.0.0.1:5672/%2f".into(),
            args: vec!["--queue".into(), "work".into()],
            dir: std::env::temp_dir(),
        }
        .urls(urls)
        .arg("fail-rate", 0.3);
        let run = cmd.command_of(Path::new("reliability_worker"), "a-1");
        let args: Vec<String> = run
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        assert!(
            !args
                .iter()
                .any(|a| a.contains("s3cret") || a.contains("://")),
            "{args:?}"
        );
        let env: Vec<_> = run.get_envs().collect();
        assert!(env.contains(&(
            std::ffi::OsStr::new("AMQP_URL"),
            Some(std::ffi::OsStr::new(urls))
        )));
        let shape = Shape {
            url: urls.to_owned(),
            ..Shape::default()
        };
        assert!(!format!("{shape:?}").contains("s3cret"));
        let shown = format!("{cmd:?}");
        assert!(!shown.contains("s3cret"), "{shown}");
        assert!(shown.contains("amqp://app:***@127.0.0.1:5673"), "{shown}");
    }
}
