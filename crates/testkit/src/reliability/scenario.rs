//! A scenario of the reliability suite: one uniquely prefixed topology, the harness's own
//! connection and publisher, and what it observes of the broker and of the workers' files.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use futures::{FutureExt, StreamExt};
use lapin::options::BasicPublishOptions;
use lapin::{BasicProperties, Connection};
use redeliver_amqp::url::redact;
use redeliver_amqp::{DelayConfig, Publisher, QueueType, Topology};

use super::accounting::{Accounting, Observed};
use super::worker::WorkerCmd;
use super::{read_lines, report};
use crate::examples::workspace_root;
use crate::Got;

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
            url: crate::amqp_url(),
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
    /// Handler calls with their times, for workers given `--runs` (the native fault tests:
    /// [`super::native`]).
    pub runs: PathBuf,
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
        let conn = crate::connect_to(&shape.url).await;
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
            runs: dir.join("runs.txt"),
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
        let conn = match Connection::connect(&self.shape.url, Default::default()).await {
            Ok(c) => c,
            Err(e) => {
                eprintln!("cleanup of {}: cannot connect: {e}", self.prefix);
                return;
            }
        };
        if let Err(e) = self.topology.delete(&conn).await {
            eprintln!("cleanup of {}: {e}", self.prefix);
        }
        if let Err(e) = self.topology.configured_delay().delete(&conn).await {
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
        self.topology.configured_delay()
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
        self.reconnect_to(&self.shape.url, timeout).await;
    }

    /// [`Self::reconnect`] through `url`, another node of the same cluster (when the node of
    /// the scenario's URL is down); the topology's cleanup still connects through the
    /// scenario's URL.
    pub async fn reconnect_to(&self, url: &str, timeout: Duration) {
        let start = Instant::now();
        loop {
            match Connection::connect(url, Default::default()).await {
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
                    redact(url)
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

    /// Handler calls with their times, from the runs file (workers given `--runs`).
    pub fn runs(&self) -> Vec<super::native::Run> {
        super::native::read_runs(&self.runs)
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
        crate::drain_queue(&self.connection(), queue).await
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shape_shows_no_password() {
        let shape = Shape {
            url: "amqp://app:s3cret@127.0.0.1:5672/%2f".into(),
            queue_type: QueueType::Quorum,
            delay_levels: 1,
            delay_queue_type: QueueType::Quorum,
            dlq_queue_type: QueueType::Classic,
            delivery_limit: 1,
        };
        let shown = format!("{shape:?}");
        assert!(!shown.contains("s3cret"), "{shown}");
        assert!(shown.contains("amqp://app:***@127.0.0.1:5672"), "{shown}");
    }
}
