//! Sizes of each scenario (full and `--short`) and shared constants.

use std::time::Duration;

use clap::ValueEnum;

pub const DEFAULT_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// Prefetch of every consumer, raw and redeliver (issue 7: prefetch 200).
pub const PREFETCH: u16 = 200;

/// Handler concurrency of the redeliver worker. Equal to the prefetch so the worker can have
/// every unacked delivery in flight, like the raw consumer that spawns one task per retry.
pub const CONCURRENCY: usize = 200;

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
        ]
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
}

impl Sizes {
    /// `scripts/bench-instructions.sh` counts on `happy + paced` of both sizes (110,000 and
    /// 6,000 messages per happy-path consumer): change it with them.
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
        }
    }

    pub fn short() -> Self {
        Sizes {
            rounds: 2,
            happy: 5_000,
            retry: 1_000,
            paced: 1_000,
            paced_rate: 1_000,
            delay_probes: 200,
            delay_max: Duration::from_secs(1),
            parked: 2_000,
            scale: 5_000,
            inflight_warmup: 1_000,
        }
    }
}
