//! A worker process for the reliability suite (`tests/reliability_*.rs`): the tests spawn it as a
//! child, inject faults around it (SIGKILL, closed connections, broker restarts, a stopped
//! cluster node) and then account for every message they published.
//!
//! What it does with a message, decided per message and attempt so that a rerun or a restarted
//! process makes the same choice:
//!
//! - the body must be JSON `{"id": "...", "mode": "..."}` (`mode` optional); anything else is
//!   dead-lettered by the worker without calling the handler;
//! - `mode` forces a behaviour: `ok`, `fail` (transient error every time), `flaky` (a transient
//!   error on the first attempt, success on every retry), `permanent`, `panic`, `hang`, `abort`
//!   (the process dies on the spot, as a worker crashing on a poison message); without it the
//!   seeded rates `--fail-rate`, `--panic-rate`, `--hang-rate` decide;
//! - on success the line `<message id> <--label>` is appended to the `--record` file *before*
//!   the handler returns, so the ack can only follow a recorded success, and the harness can say
//!   per id which processes handled it. A kill between the two makes the handler run twice for
//!   one message (recorded twice), never gives a success nobody recorded;
//! - with `--acked`, every ack frame the worker writes to the broker's socket for successful
//!   deliveries appends the number of successes it settled (one line per frame, after lapin
//!   reports the frame written). This is the worker's own `redeliver_messages_succeeded_total`
//!   counter, observed through a `metrics` recorder installed here: it counts after the ack, not
//!   before, so the harness can tell a message *acked* twice (the broker redelivered it although
//!   its ack was sent) from a handler that ran twice because the kill fell before the ack;
//! - with `--runs`, every handler call appends `<id> <attempt> <unix ms> <not-before> <delay ms>
//!   <behaviour> <label>` *before* it acts: when it ran, and the earliest time its retry state
//!   allowed (`x-redeliver-not-before`, which a native retry carries; `-` when absent) and the
//!   delay that led to it (`x-redeliver-delay-ms`, `-` on a first attempt), so the harness can
//!   tell whether any retry ran before its time.
//!
//! `--retry-mode levels|native|auto` (or `REDELIVER_RETRY_MODE`) says where retries wait
//! ([`WorkerBuilder::retry_mode`](redeliver::WorkerBuilder::retry_mode)); the `--events` file's
//! lines carry the mode the session chose (`levels` or `native`) as a fourth field.
//!
//! ```text
//! AMQP_URL=amqp://guest:guest@127.0.0.1:5672/%2f cargo run --example reliability_worker -- \
//!     --queue work --prefix t1. --record /tmp/ok.txt --fail-rate 0.2 --seed 7
//! ```
//!
//! With `--inbox-schema` the handler's effect is a row written through the PostgreSQL inbox
//! (`redeliver::postgres`), with fault points before and after its commit: see
//! `examples/reliability_worker/inbox.rs`. `DATABASE_URL` names the database (default
//! `postgres://postgres@127.0.0.1:5432/test`).
//!
//! The broker URLs hold the password, so the harness passes them in `AMQP_URL`, not on the
//! command line (where `ps` shows them). Several URLs (comma-separated, or `--url` repeated) are
//! the worker's own failover list
//! ([`WorkerBuilder::failover_urls`](redeliver::WorkerBuilder::failover_urls)): it connects
//! through the first and, when a connection attempt fails or the connection is lost, goes on
//! with the next one.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context as _};
use clap::{Parser, ValueEnum};
use redeliver::amqp::headers::RetryState;
use redeliver::worker::metrics_names::MESSAGES_SUCCEEDED;
use redeliver::{
    BudgetConfig, CancellationToken, Context, DelayConfig, HandlerError, Jitter, Json, QueueType,
    RetryBudget, RetryMode, RetryPolicy, Topology, Worker, WorkerState, WorkerStatus,
};
use tracing::{info, warn};

#[path = "reliability_worker/inbox.rs"]
mod inbox;

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Kind {
    Quorum,
    Classic,
}

impl From<Kind> for QueueType {
    fn from(k: Kind) -> Self {
        match k {
            Kind::Quorum => QueueType::Quorum,
            Kind::Classic => QueueType::Classic,
        }
    }
}

/// Worker process for the reliability suite.
#[derive(Debug, Parser)]
struct Args {
    /// AMQP URLs, tried in turn (repeat the flag or separate with commas).
    #[arg(
        long = "url",
        env = "AMQP_URL",
        value_delimiter = ',',
        hide_env_values = true,
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
    )]
    urls: Vec<String>,
    /// Queue name, without the prefix.
    #[arg(long)]
    queue: String,
    /// Prefix of every object (queue, DLX, DLQ and delay levels).
    #[arg(long, default_value = "")]
    prefix: String,
    /// Type of the work queue.
    #[arg(long, value_enum, default_value = "quorum")]
    queue_type: Kind,
    /// Number of delay levels (granularity 10 ms: 10 levels reach 10.23 s).
    #[arg(long, default_value_t = 10)]
    delay_levels: u8,
    /// Type of the delay level queues.
    #[arg(long, value_enum, default_value = "quorum")]
    delay_queue_type: Kind,
    /// Type of the dead-letter queue.
    #[arg(long, value_enum, default_value = "classic")]
    dlq_queue_type: Kind,
    /// `x-delivery-limit` of a quorum work queue.
    #[arg(long, default_value_t = 20)]
    delivery_limit: u32,
    /// File every success is appended to: `<message id> <label>` per line.
    #[arg(long)]
    record: PathBuf,
    /// Names this process in its success records (no spaces).
    #[arg(long, default_value = "worker")]
    label: String,
    /// Also fsync the record file after each line (survives a machine crash, not only a
    /// process kill; the tests only kill processes, so it is off by default).
    #[arg(long)]
    fsync: bool,
    /// File each ack frame settling successful deliveries appends its number of successes to,
    /// once the frame is written (the worker's `redeliver_messages_succeeded_total` counter).
    #[arg(long)]
    acked: Option<PathBuf>,
    /// File every handler call is appended to: `id attempt outcome`.
    #[arg(long)]
    calls: Option<PathBuf>,
    /// Probability that an attempt fails with a transient error.
    #[arg(long, default_value_t = 0.0)]
    fail_rate: f64,
    /// Probability that an attempt panics.
    #[arg(long, default_value_t = 0.0)]
    panic_rate: f64,
    /// Probability that an attempt hangs (for `--hang-ms`).
    #[arg(long, default_value_t = 0.0)]
    hang_rate: f64,
    /// How long a hanging attempt sleeps.
    #[arg(long, default_value_t = 60_000)]
    hang_ms: u64,
    /// Seed of the fault choices.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Simulated work per message.
    #[arg(long, default_value_t = 0)]
    work_ms: u64,
    /// Per-message handler timeout.
    #[arg(long)]
    handler_timeout_ms: Option<u64>,
    /// Maximum retries before dead-lettering.
    #[arg(long, default_value_t = 3)]
    max_retries: u32,
    /// First retry delay (exponential, factor 2, full jitter).
    #[arg(long, default_value_t = 50)]
    retry_base_ms: u64,
    /// Largest retry delay.
    #[arg(long, default_value_t = 1_000)]
    retry_cap_ms: u64,
    /// No jitter: each retry waits exactly its exponential delay.
    #[arg(long)]
    no_jitter: bool,
    /// Where retries wait: `levels`, `native` (the quorum queue holds them, RabbitMQ 4.3+) or
    /// `auto` (native where it works); the worker's default (`levels`) when not given.
    #[arg(long, env = "REDELIVER_RETRY_MODE")]
    retry_mode: Option<RetryMode>,
    /// File every handler call appends `<id> <attempt> <unix ms> <not-before> <delay ms>
    /// <behaviour> <label>` to, before it acts.
    #[arg(long)]
    runs: Option<PathBuf>,
    /// Enables a retry budget allowing this fraction of first attempts as retries.
    #[arg(long)]
    budget_percent: Option<f64>,
    /// Retry budget reserve, retries per second allowed whatever the traffic.
    #[arg(long, default_value_t = 0)]
    budget_reserve_per_sec: u32,
    /// Retry budget window.
    #[arg(long, default_value_t = 10)]
    budget_ttl_secs: u64,
    /// A content type other than this one is a permanent error.
    #[arg(long)]
    require_content_type: Option<String>,
    /// Per-consumer prefetch.
    #[arg(long, default_value_t = 50)]
    prefetch: u16,
    /// Handlers running at once.
    #[arg(long, default_value_t = 10)]
    concurrency: usize,
    /// Shutdown grace period.
    #[arg(long, default_value_t = 5_000)]
    shutdown_grace_ms: u64,
    /// File the worker's state changes are appended to: `<unix ms> <state> <url index>` (the
    /// URL it connected through last, `-` before the first connection), so a test can measure
    /// outages and recoveries from the worker's own point of view.
    #[arg(long)]
    events: Option<PathBuf>,
    /// Connection name shown by the management API (default: the worker's,
    /// `redeliver-worker:<queue>`).
    #[arg(long)]
    connection_name: Option<String>,
    /// Inbox mode: each handled message writes one row to `<schema>.effects` through the
    /// PostgreSQL inbox of this schema (the test creates the schema and the table).
    #[arg(long)]
    inbox_schema: Option<String>,
    /// The PostgreSQL database of the inbox mode.
    #[arg(
        long,
        env = "DATABASE_URL",
        hide_env_values = true,
        default_value = "postgres://postgres@127.0.0.1:5432/test"
    )]
    database_url: String,
    /// Inbox consumer name (default: the queue's full name).
    #[arg(long)]
    inbox_consumer: Option<String>,
    /// Inbox mode: also store an outbox message to this queue (default exchange) per handled
    /// message, with the message's id.
    #[arg(long)]
    outbox_queue: Option<String>,
    /// Inbox mode: file each delivery appends `<id> <label> <start ms> <end ms> <outcome>` to.
    #[arg(long)]
    deliveries: Option<PathBuf>,
    /// Inbox mode: abort inside the transaction, after the effect's INSERT, on the first
    /// delivery of this message id (repeatable).
    #[arg(long)]
    abort_before_commit: Vec<String>,
    /// Inbox mode: abort after the inbox committed, before the ack, on the first delivery of
    /// this message id (repeatable).
    #[arg(long)]
    abort_after_commit: Vec<String>,
    /// Inbox mode: seeded probability of an abort before the commit (first deliveries only).
    #[arg(long, default_value_t = 0.0)]
    abort_before_commit_rate: f64,
    /// Inbox mode: seeded probability of an abort after the commit (first deliveries only).
    #[arg(long, default_value_t = 0.0)]
    abort_after_commit_rate: f64,
}

#[derive(Debug, serde::Deserialize)]
struct Job {
    id: String,
    #[serde(default)]
    mode: Option<String>,
}

/// What one attempt does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Behaviour {
    Ok,
    Fail,
    Permanent,
    Panic,
    Hang,
    Abort,
}

/// Settings and shared files of the handler.
struct App {
    record: Mutex<File>,
    label: String,
    calls: Option<Mutex<File>>,
    runs: Option<Mutex<File>>,
    fsync: bool,
    seed: u64,
    fail_rate: f64,
    panic_rate: f64,
    hang_rate: f64,
    hang: Duration,
    work: Duration,
    require_content_type: Option<String>,
}

/// splitmix64 over a byte string: a stable hash, so the same (seed, id, attempt) always draws
/// the same number in every process.
fn draw(seed: u64, id: &str, attempt: u32, salt: u64) -> f64 {
    let mut x = seed ^ salt.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let mut mix = |v: u64| {
        x = x.wrapping_add(v).wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        x = z ^ (z >> 31);
    };
    for b in id.bytes() {
        mix(u64::from(b));
    }
    mix(u64::from(attempt));
    // 53 random bits as a fraction in [0, 1).
    (x >> 11) as f64 / (1u64 << 53) as f64
}

impl App {
    fn behaviour(&self, job: &Job, attempt: u32) -> Behaviour {
        match job.mode.as_deref() {
            Some("ok") => return Behaviour::Ok,
            Some("fail") => return Behaviour::Fail,
            Some("flaky") if attempt == 0 => return Behaviour::Fail,
            Some("flaky") => return Behaviour::Ok,
            Some("permanent") => return Behaviour::Permanent,
            Some("panic") => return Behaviour::Panic,
            Some("hang") => return Behaviour::Hang,
            Some("abort") => return Behaviour::Abort,
            _ => {}
        }
        // Independent draws so that changing one rate does not move the others' choices.
        if draw(self.seed, &job.id, attempt, 1) < self.panic_rate {
            Behaviour::Panic
        } else if draw(self.seed, &job.id, attempt, 2) < self.hang_rate {
            Behaviour::Hang
        } else if draw(self.seed, &job.id, attempt, 3) < self.fail_rate {
            Behaviour::Fail
        } else {
            Behaviour::Ok
        }
    }

    /// Appends one line with a single write(2) on an O_APPEND file: atomic with respect to the
    /// other worker processes appending to the same file, and in the kernel's hands (so it
    /// survives SIGKILL) once `write_all` returns.
    fn append(file: &Mutex<File>, line: &str, fsync: bool) -> std::io::Result<()> {
        let mut f = file
            .lock()
            // A panic while appending cannot leave the file in a state we would mind.
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        f.write_all(line.as_bytes())?;
        if fsync {
            f.sync_data()?;
        }
        Ok(())
    }

    fn log_call(&self, id: &str, attempt: u32, what: &str) {
        if let Some(calls) = &self.calls {
            if let Err(e) = Self::append(calls, &format!("{id} {attempt} {what}\n"), false) {
                warn!(error = %e, "cannot append to the calls file");
            }
        }
    }

    /// Appends this call's line to the `--runs` file: when it ran, the earliest time and the
    /// delay its retry state carries.
    fn log_run(&self, id: &str, ctx: &Context, behaviour: Behaviour) {
        let Some(runs) = &self.runs else { return };
        let state = RetryState::read(ctx.headers());
        let or_dash = |v: Option<u64>| v.map_or_else(|| "-".to_owned(), |v| v.to_string());
        let what = format!("{behaviour:?}").to_lowercase();
        let line = format!(
            "{id} {} {} {} {} {what} {}\n",
            ctx.attempt(),
            unix_ms(),
            or_dash(state.not_before_ms),
            or_dash(state.delay.and_then(|d| u64::try_from(d.as_millis()).ok())),
            self.label
        );
        if let Err(e) = Self::append(runs, &line, false) {
            warn!(error = %e, "cannot append to the runs file");
        }
    }

    async fn handle(&self, job: Job, ctx: Context) -> Result<(), HandlerError> {
        // The message_id property is the accounting key (kept on every retry copy); the body's
        // id is the fallback for publishers that did not set it.
        let id = ctx.message_id().unwrap_or(&job.id).to_owned();
        let attempt = ctx.attempt();
        if let Some(want) = &self.require_content_type {
            let got = ctx
                .properties()
                .content_type()
                .as_ref()
                .map(|s| s.as_str().to_owned())
                .unwrap_or_default();
            if &got != want {
                self.log_call(&id, attempt, "wrong-content-type");
                return Err(HandlerError::permanent(format!(
                    "content type '{got}' is not '{want}'"
                )));
            }
        }
        let behaviour = self.behaviour(&job, attempt);
        self.log_run(&id, &ctx, behaviour);
        self.log_call(&id, attempt, &format!("{behaviour:?}").to_lowercase());
        self.act(behaviour, &id, attempt).await?;
        // Recorded before returning Ok, i.e. before the ack: if recording fails the message must
        // not be acked, so it becomes a transient error and is retried.
        Self::append(&self.record, &format!("{id} {}\n", self.label), self.fsync)
            .map_err(|e| HandlerError::transient(format!("cannot record success: {e}")))?;
        Ok(())
    }
}

impl App {
    /// The simulated work and the chosen behaviour of one attempt.
    async fn act(&self, behaviour: Behaviour, id: &str, attempt: u32) -> Result<(), HandlerError> {
        if !self.work.is_zero() {
            tokio::time::sleep(self.work).await;
        }
        match behaviour {
            Behaviour::Ok => {}
            Behaviour::Fail => {
                return Err(HandlerError::transient(format!(
                    "injected failure (attempt {attempt})"
                )))
            }
            Behaviour::Permanent => {
                return Err(HandlerError::permanent("injected permanent error"))
            }
            // The injected fault itself: a handler that panics.
            #[allow(clippy::panic)]
            Behaviour::Panic => panic!("injected panic for {id} (attempt {attempt})"),
            // No unwinding, no shutdown: the connection drops with the delivery unacked.
            Behaviour::Abort => std::process::abort(),
            Behaviour::Hang => {
                // Past the handler timeout the worker drops this future; without one this is
                // just a slow success.
                tokio::time::sleep(self.hang).await;
            }
        }
        Ok(())
    }
}

/// Milliseconds since the Unix epoch.
fn unix_ms() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0)
}

fn open_append(path: &PathBuf) -> anyhow::Result<File> {
    OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("cannot open {} for appending", path.display()))
}

fn rate(name: &str, v: f64) -> anyhow::Result<f64> {
    if !(0.0..=1.0).contains(&v) {
        bail!("--{name} must be between 0 and 1, got {v}");
    }
    Ok(v)
}

fn policy(args: &Args) -> RetryPolicy {
    let mut p = RetryPolicy::exponential(Duration::from_millis(args.retry_base_ms))
        .cap(Duration::from_millis(args.retry_cap_ms))
        .max_retries(args.max_retries)
        .seed(args.seed);
    if args.no_jitter {
        p = p.jitter(Jitter::None);
    }
    if let Some(pct) = args.budget_percent {
        p = p.budget(RetryBudget::new(BudgetConfig {
            ttl: Duration::from_secs(args.budget_ttl_secs),
            min_retries_per_sec: args.budget_reserve_per_sec,
            percent_can_retry: pct,
            ..BudgetConfig::default()
        }));
    }
    p
}

fn topology(args: &Args) -> Topology {
    let delay = DelayConfig::new()
        .prefix(args.prefix.clone())
        .levels(args.delay_levels)
        .queue_type(args.delay_queue_type.into());
    Topology::new(args.queue.clone())
        .prefix(args.prefix.clone())
        .queue_type(args.queue_type.into())
        .dlq_queue_type(args.dlq_queue_type.into())
        .delivery_limit(Some(args.delivery_limit))
        .delay(delay)
}

fn build(args: &Args, app: &Arc<App>, inbox: Option<inbox::Faulty>) -> anyhow::Result<Worker> {
    let app = Arc::clone(app);
    let (first, others) = args.urls.split_first().context("no --url given")?;
    let b = Worker::builder(first.clone())
        .failover_urls(others.to_vec())
        .topology(topology(args))
        .policy(policy(args))
        .prefetch(args.prefetch)
        .concurrency(args.concurrency)
        .shutdown_grace(Duration::from_millis(args.shutdown_grace_ms));
    let mut b = match inbox {
        Some(h) => b.handler(h),
        None => b.handler(move |job: Json<Job>, ctx: Context| {
            let app = Arc::clone(&app);
            async move { app.handle(job.into_inner(), ctx).await }
        }),
    };
    if let Some(ms) = args.handler_timeout_ms {
        b = b.handler_timeout(Duration::from_millis(ms));
    }
    if let Some(name) = &args.connection_name {
        b = b.connection_name(name.clone());
    }
    if let Some(mode) = args.retry_mode {
        b = b.retry_mode(mode);
    }
    b.build().context("invalid worker configuration")
}

/// Appends `<unix ms> <state> <url index> <retry mode>` to the `--events` file at every state
/// change (the mode the session chose, `levels` or `native`; `-` before the first session).
fn watch_events(file: File, mut status: WorkerStatus) {
    let file = Mutex::new(file);
    let write = move |state: WorkerState, broker: Option<usize>, mode: Option<RetryMode>| {
        let ms = unix_ms();
        let broker = broker.map_or_else(|| "-".to_owned(), |i| i.to_string());
        let mode = mode.map_or_else(|| "-".to_owned(), |m| m.to_string());
        if let Err(e) = App::append(&file, &format!("{ms} {state} {broker} {mode}\n"), false) {
            warn!(error = %e, "cannot append to the events file");
        }
    };
    tokio::spawn(async move {
        write(status.state(), status.broker(), status.retry_mode());
        while let Some(state) = status.changed().await {
            write(state, status.broker(), status.retry_mode());
        }
    });
}

/// The `metrics` recorder of this process: only the worker's success counter, whose increments
/// (made by the batched-ack task right after `basic.ack` was written to the socket, one per
/// frame) are appended to the `--acked` file, one `write(2)` each. Every other metric is a no-op.
struct AckedRecorder {
    counter: Arc<AckedCounter>,
}

struct AckedCounter {
    file: Mutex<File>,
}

impl metrics::CounterFn for AckedCounter {
    fn increment(&self, value: u64) {
        // A frame that settled only retry originals or dead-lettered ones counts 0: skipped.
        if value > 0 {
            if let Err(e) = App::append(&self.file, &format!("{value}\n"), false) {
                warn!(error = %e, "cannot append to the acked file");
            }
        }
    }

    fn absolute(&self, _value: u64) {}
}

impl metrics::Recorder for AckedRecorder {
    fn describe_counter(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_gauge(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_histogram(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }

    fn register_counter(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        if key.name() == MESSAGES_SUCCEEDED {
            metrics::Counter::from_arc(Arc::clone(&self.counter))
        } else {
            metrics::Counter::noop()
        }
    }

    fn register_gauge(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        metrics::Gauge::noop()
    }

    fn register_histogram(
        &self,
        _: &metrics::Key,
        _: &metrics::Metadata<'_>,
    ) -> metrics::Histogram {
        metrics::Histogram::noop()
    }
}

/// Cancels `token` on SIGTERM or SIGINT.
fn cancel_on_signal(token: CancellationToken) -> anyhow::Result<()> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("cannot listen for SIGTERM")?;
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => info!("SIGTERM: shutting down"),
            _ = tokio::signal::ctrl_c() => info!("SIGINT: shutting down"),
        }
        token.cancel();
    });
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_ansi(false)
        .init();
    let args = Args::parse();
    if args.label.contains(char::is_whitespace) {
        bail!("--label must not contain spaces: {:?}", args.label);
    }
    if let Some(path) = &args.acked {
        // Before the worker is built: it resolves its metric handles when a session starts.
        let recorder = AckedRecorder {
            counter: Arc::new(AckedCounter {
                file: Mutex::new(open_append(path)?),
            }),
        };
        if metrics::set_global_recorder(recorder).is_err() {
            bail!("a metrics recorder is already installed");
        }
    }
    let app = Arc::new(App {
        record: Mutex::new(open_append(&args.record)?),
        label: args.label.clone(),
        calls: args
            .calls
            .as_ref()
            .map(open_append)
            .transpose()?
            .map(Mutex::new),
        runs: args
            .runs
            .as_ref()
            .map(open_append)
            .transpose()?
            .map(Mutex::new),
        fsync: args.fsync,
        seed: args.seed,
        fail_rate: rate("fail-rate", args.fail_rate)?,
        panic_rate: rate("panic-rate", args.panic_rate)?,
        hang_rate: rate("hang-rate", args.hang_rate)?,
        hang: Duration::from_millis(args.hang_ms),
        work: Duration::from_millis(args.work_ms),
        require_content_type: args.require_content_type.clone(),
    });
    let inbox = match &args.inbox_schema {
        Some(schema) => Some(
            inbox::handler(
                Arc::clone(&app),
                inbox::Options {
                    database_url: args.database_url.clone(),
                    schema: schema.clone(),
                    consumer: args
                        .inbox_consumer
                        .clone()
                        .unwrap_or_else(|| format!("{}{}", args.prefix, args.queue)),
                    outbox_queue: args.outbox_queue.clone(),
                    deliveries: args.deliveries.as_ref().map(open_append).transpose()?,
                    faults: inbox::Faults {
                        before_commit: args.abort_before_commit.clone(),
                        after_commit: args.abort_after_commit.clone(),
                        before_commit_rate: rate(
                            "abort-before-commit-rate",
                            args.abort_before_commit_rate,
                        )?,
                        after_commit_rate: rate(
                            "abort-after-commit-rate",
                            args.abort_after_commit_rate,
                        )?,
                    },
                    pool_size: u32::try_from(args.concurrency)
                        .unwrap_or(u32::MAX)
                        .saturating_add(2),
                },
            )
            .await?,
        ),
        None => None,
    };
    let worker = build(&args, &app, inbox)?;
    if let Some(path) = &args.events {
        watch_events(open_append(path)?, worker.status_handle());
    }
    info!(queue = %args.queue, prefix = %args.prefix, urls = args.urls.len(), "reliability worker starting");
    let token = CancellationToken::new();
    cancel_on_signal(token.clone())?;
    worker
        .run(token)
        .await
        .context("worker stopped with an error")?;
    info!("reliability worker stopped");
    Ok(())
}
