//! The 1 KB JSON message every scenario publishes, and what the consumers decode from it.

use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::config::BODY_BYTES;

/// What the publishers serialize. `pad` brings the body to about [`BODY_BYTES`].
#[derive(Serialize, Debug)]
pub struct PayloadOut<'a> {
    /// Unique within a run, so a consumer can pair a retried copy with its first delivery.
    pub seq: u64,
    /// Publish time, Unix nanoseconds (the consumer is another process: wall clock, same host).
    pub ts_ns: u64,
    /// If set, the consumer fails the first delivery and asks for a retry after this many ms.
    pub retry_ms: Option<u32>,
    pub pad: &'a str,
}

/// What both consumers decode (the same struct, so they do the same JSON work). The pad is
/// scanned by serde but not kept, as a handler that ignores a field would do.
#[derive(Deserialize, Debug, Clone)]
pub struct PayloadIn {
    pub seq: u64,
    pub ts_ns: u64,
    pub retry_ms: Option<u32>,
}

/// Padding that makes a typical body [`BODY_BYTES`] long.
pub fn padding() -> String {
    padding_for(BODY_BYTES)
}

/// Padding that makes a typical body `bytes` long.
pub fn padding_for(bytes: usize) -> String {
    let probe = PayloadOut {
        seq: 1_000_000,
        ts_ns: now_ns(),
        retry_ms: None,
        pad: "",
    };
    let base = serde_json::to_vec(&probe).map(|v| v.len()).unwrap_or(80);
    "x".repeat(bytes.saturating_sub(base))
}

pub fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_is_about_one_kilobyte() {
        let pad = padding();
        let body = serde_json::to_vec(&PayloadOut {
            seq: 42_000,
            ts_ns: now_ns(),
            retry_ms: Some(10),
            pad: &pad,
        })
        .unwrap();
        assert!((1000..=1050).contains(&body.len()), "{}", body.len());
        let back: PayloadIn = serde_json::from_slice(&body).unwrap();
        assert_eq!(back.seq, 42_000);
        assert_eq!(back.retry_ms, Some(10));
    }
}
