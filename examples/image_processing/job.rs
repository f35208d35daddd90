//! The job and its handler. The image server is simulated: a fetch fails with a connection
//! error about half the time, decided by a seeded hash of job id and attempt so that a run can
//! be reproduced. Replace `fetch` with your HTTP client.

use std::time::Duration;

use redeliver::{Context, HandlerError};
use serde::{Deserialize, Serialize};

/// One job, as `examples/publish.rs` sends it.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub(crate) struct ImageJob {
    /// Job number.
    pub id: u64,
    /// Image to fetch.
    pub url: String,
    /// Target width; 0 is a permanent error (no retry can fix it).
    pub width: u32,
    /// Chance that one fetch fails with a simulated connection error.
    #[serde(default)]
    pub fail_rate: f64,
    /// Seed of the simulated failures.
    #[serde(default)]
    pub seed: u64,
}

/// The handler: a bad request goes straight to the DLQ, a failed fetch is retried with the
/// policy's backoff.
pub(crate) async fn process(job: &ImageJob, ctx: &Context) -> Result<(), HandlerError> {
    if job.width == 0 {
        return Err(HandlerError::permanent(format!(
            "job {}: width must be positive",
            job.id
        )));
    }
    fetch(job, ctx.attempt())
        .await
        .map_err(HandlerError::transient)?;
    tracing::debug!(job = job.id, attempt = ctx.attempt(), width = job.width, url = %job.url, "image resized");
    Ok(())
}

/// Jobs at least this wide are large images: resizing one takes [`LARGE_IMAGE_TIME`], longer
/// than the standard queue's time limit, so the worker forwards them to the heavy queue.
pub(crate) const LARGE_WIDTH: u32 = 4000;
/// How long resizing a large image takes.
pub(crate) const LARGE_IMAGE_TIME: Duration = Duration::from_secs(15);

/// The simulated fetch and resize: 5 to 25 ms (a large image: 15 s more), then maybe a
/// connection reset.
async fn fetch(job: &ImageJob, attempt: u32) -> Result<(), std::io::Error> {
    tokio::time::sleep(Duration::from_millis(
        5 + (unit(job, attempt, 2) * 20.0) as u64,
    ))
    .await;
    if job.width >= LARGE_WIDTH {
        tokio::time::sleep(LARGE_IMAGE_TIME).await;
    }
    if fetch_fails(job, attempt) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::ConnectionReset,
            format!("simulated: connection reset while fetching {}", job.url),
        ));
    }
    Ok(())
}

/// Whether fetching the image fails on this attempt.
pub(crate) fn fetch_fails(job: &ImageJob, attempt: u32) -> bool {
    unit(job, attempt, 1) < job.fail_rate
}

/// Uniform in [0, 1) from the job, the attempt and a salt (SplitMix64 mixing, so failures look
/// random yet are reproducible).
fn unit(job: &ImageJob, attempt: u32, salt: u64) -> f64 {
    fn mix(mut z: u64) -> u64 {
        z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    let h = mix(job.seed ^ mix(job.id ^ mix(u64::from(attempt) ^ salt)));
    (h >> 11) as f64 / (1u64 << 53) as f64
}
