//! Sizes of each scenario (full and `--short`) and shared constants.

use std::time::Duration;

use clap::ValueEnum;

pub const DEFAULT_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// The database of scenarios 7 to 9 (inbox, outbox): the PostgreSQL tests' default (trust
/// authentication, database `test`, as `scripts/postgres.sh up` sets it up).
pub const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/test";

/// Prefetch of every consumer, raw and redeliver (issue 7: prefetch 200).
pub const PREFETCH: u16 = 200;

/// Handler concurrency of the redeliver worker. Equal to the prefetch so the worker can have
/// every unacked delivery in flight, like the raw consumer that spawns one task per retry.
pub const CONCURRENCY: usize = 200;

/// Handler concurrency of both consumers of scenario 7 (inbox), and the size of each one's sqlx
/// pool (one connection per handler in flight, as the inbox's docs ask). Not [`CONCURRENCY`]:
/// two pools of 200 do not fit PostgreSQL's default `max_connections` of 100, and on a small
/// host 50 transactions in flight already keep the database busy (its commits are grouped).
/// The prefetch stays [`PREFETCH`].
pub const DB_CONCURRENCY: usize = 50;

/// Producer rate of scenario 8's latency phase (transactions storing one outbox message each).
pub const OUTBOX_RATE: u64 = 500;

/// Publisher confirms kept in flight by the backlog publishers (DESIGN: 20-200 is the sweet spot).
pub const CONFIRM_WINDOW: usize = 200;

/// Retry delay of scenario 2 (and of the settle phase of scenario 4).
pub const RETRY_DELAY: Duration = Duration::from_millis(10);

/// Delay given to parked messages in scenario 4: long enough to stay parked for the whole run.
pub const PARK_DELAY: Duration = Duration::from_secs(3600);

/// Target size of one message body in bytes.
pub const BODY_BYTES: usize = 1024;

/// Body size of scenario 6 (RSS with the whole prefetch in flight).
pub const INFLIGHT_BODY_BYTES: usize = 64 * 1024;

/// Worker processes of scenario 5 (scale-out on one queue).
pub const SCALE_PROCESSES: &[usize] = &[1, 2, 4];

/// Per-round ratios spread wider than this (max / min) are too noisy to conclude from.
pub const SPREAD_LIMIT: f64 = 1.25;

/// Fewer round pairs than this never conclude (`--short` runs 2).
pub const MIN_ROUNDS_TO_CONCLUDE: usize = 3;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Scenario {
    Happy,
    Retry,
    Delay,
    Park,
    /// 1, 2 and 4 redeliver worker processes on one quorum queue.
    Scale,
    /// RSS with `prefetch` deliveries of 64 KiB bodies held in flight.
    Inflight,
    /// A PostgreSQL INSERT per message through the inbox, against a hand-written transaction.
    Inbox,
    /// The outbox relay: commit-to-delivery latency and rows/s.
    Outbox,
    /// The outbox relay with 1 % of the rows refused by the broker, against none: good rows/s.
    OutboxRefused,
    /// Jittered retry delays published exact against rounded to few delay-level hops.
    Hops,
    /// Retries held by a RabbitMQ 4.3+ quorum queue (AMQP 1.0) against the delay levels, and
    /// the happy path of both transports.
    Native,
}

impl Scenario {
    pub fn all() -> &'static [Scenario] {
        &[
            Scenario::Happy,
            Scenario::Retry,
            Scenario::Delay,
            Scenario::Park,
            Scenario::Scale,
            Scenario::Inflight,
            Scenario::Inbox,
            Scenario::Outbox,
            Scenario::OutboxRefused,
            Scenario::Hops,
            Scenario::Native,
        ]
    }

    /// Whether the scenario needs PostgreSQL.
    pub fn needs_postgres(self) -> bool {
        matches!(
            self,
            Scenario::Inbox | Scenario::Outbox | Scenario::OutboxRefused
        )
    }
}

#[derive(Clone, Debug)]
pub struct Sizes {
    /// Rounds of scenarios 1, 2 and 5 per side, interleaved (A B C, then C B A, ...); the
    /// report gives medians over the rounds and the median of the per-round ratios.
    pub rounds: u32,
    /// Scenario 1: backlog drained for msg/s.
    pub happy: u64,
    /// Scenario 2: backlog that fails once each, drained for msg/s.
    pub retry: u64,
    /// Latency phases (scenarios 1 and 2): messages published at `paced_rate` while consuming.
    pub paced: u64,
    pub paced_rate: u64,
    /// Scenario 3: number of probes and the maximum random delay.
    pub delay_probes: u64,
    pub delay_max: Duration,
    /// Scenario 4: messages parked in the delay levels.
    pub parked: u64,
    /// Scenario 5: backlog drained by 1, 2 and 4 worker processes together.
    pub scale: u64,
    /// Scenario 6: 1 KB messages drained before the idle RSS is read (allocator warm-up).
    pub inflight_warmup: u64,
    /// Scenario 7: backlog drained for msg/s, one INSERT (and for the inbox its own row) each.
    pub inbox: u64,
    /// Scenario 7's latency phase: messages published at `inbox_paced_rate` while consuming
    /// (below what either side drains, so the latency is not queueing).
    pub inbox_paced: u64,
    pub inbox_paced_rate: u64,
    /// Scenario 8: messages stored at [`OUTBOX_RATE`] for the commit-to-delivery latency.
    pub outbox_latency: u64,
    /// Scenarios 8 and 9: rows committed before the relay starts, for its rows/s.
    pub outbox_backlog: u64,
    /// Scenario 10: messages that fail 7 times each with a jittered policy.
    pub hops: u64,
    /// Scenario 10's policy (exponential from 100 ms, cap 6 s) is divided by this: `--short`
    /// waits a tenth as long, with smaller tick counts than the realistic ones.
    pub hops_time_divisor: u32,
    /// The memory scenarios (6 and park): how long a child settles before its RSS is sampled,
    /// and how many samples (the largest counts), `rss_sample` apart.
    pub rss_settle: Duration,
    pub rss_samples: u32,
    pub rss_sample: Duration,
    /// Scenario 11: messages that fail once each (delays 0-1 s), per side and round.
    pub native_retry: u64,
    /// Scenario 11: messages that fail once each, published at `native_paced_rate` while the
    /// consumer runs (below what every side drains): the delay error without a backlog.
    pub native_paced: u64,
    pub native_paced_rate: u64,
    /// Scenario 11: backlog drained by the worker in each retry mode (happy path).
    pub native_happy: u64,
}

impl Sizes {
    /// `scripts/bench-instructions.sh` counts on `happy + paced` of both sizes (110,000 and
    /// 5,300 messages per happy-path consumer): change it with them.
    pub fn full() -> Self {
        Sizes {
            rounds: 5,
            happy: 100_000,
            retry: 20_000,
            paced: 10_000,
            paced_rate: 2_000,
            delay_probes: 2_000,
            delay_max: Duration::from_secs(5),
            parked: 50_000,
            scale: 100_000,
            inflight_warmup: 10_000,
            inbox: 20_000,
            inbox_paced: 2_000,
            inbox_paced_rate: 500,
            // 6 s at 500/s.
            outbox_latency: 3_000,
            outbox_backlog: 20_000,
            hops: 2_000,
            hops_time_divisor: 1,
            rss_settle: Duration::from_secs(2),
            rss_samples: 8,
            rss_sample: Duration::from_millis(250),
            native_retry: 20_000,
            native_paced: 4_000,
            native_paced_rate: 800,
            native_happy: 100_000,
        }
    }

    pub fn short() -> Self {
        Sizes {
            rounds: 2,
            happy: 5_000,
            retry: 1_000,
            paced: 300,
            paced_rate: 1_000,
            delay_probes: 100,
            delay_max: Duration::from_secs(1),
            parked: 2_000,
            scale: 5_000,
            inflight_warmup: 1_000,
            inbox: 1_000,
            inbox_paced: 200,
            inbox_paced_rate: 500,
            outbox_latency: 500,
            outbox_backlog: 1_000,
            hops: 200,
            hops_time_divisor: 10,
            rss_settle: Duration::from_millis(500),
            rss_samples: 4,
            rss_sample: Duration::from_millis(100),
            // Scenario 11 runs three consumers per round (each in a child process): kept small so
            // the bench test stays a smoke test of a few seconds per broker.
            native_retry: 200,
            native_paced: 100,
            native_paced_rate: 200,
            native_happy: 1_000,
        }
    }
}
