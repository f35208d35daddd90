//! Fixed-size latency histogram (no growth with the message count, so it does not disturb the
//! RSS it sits next to), exact percentiles for small samples, and /proc memory readings.

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

/// Two significant digits: a bucket is at most 1/128 of its values wide (0.8 %, the hand-written
/// one before it had 1/64), values under 256 are exact; 58 KiB over the whole u64 range. Three
/// digits would take 440 KiB for precision the latencies' run-to-run noise does not have.
const SIGFIG: u8 = 2;

/// Microsecond latencies in an [`hdrhistogram::Histogram`], with the exact maximum beside it:
/// the crate only gives back the top of the maximum's bucket.
pub struct Histogram {
    hist: hdrhistogram::Histogram<u64>,
    max: u64,
}

impl Default for Histogram {
    fn default() -> Self {
        // The whole u64 range, allocated once: recording never resizes, saturates or fails.
        let hist = hdrhistogram::Histogram::new_with_bounds(1, u64::MAX, SIGFIG)
            .expect("constant bounds and precision are valid");
        Histogram { hist, max: 0 }
    }
}

impl Histogram {
    pub fn record(&mut self, v: u64) {
        // Infallible, and with bounds covering every u64 it never has to clamp.
        self.hist.saturating_record(v);
        self.max = self.max.max(v);
    }

    pub fn max(&self) -> u64 {
        self.max
    }

    /// Nearest-rank percentile, `q` in 0..=1: the top of the bucket holding that rank, never
    /// above the maximum; 0 when empty.
    pub fn percentile(&self, q: f64) -> u64 {
        if self.hist.is_empty() {
            return 0;
        }
        self.hist.value_at_quantile(q).min(self.max)
    }
}

/// Nearest-rank percentile of an already sorted slice.
pub fn percentile_sorted<T: Copy + Default>(sorted: &[T], q: f64) -> T {
    if sorted.is_empty() {
        return T::default();
    }
    let n = sorted.len();
    let rank = ((q * n as f64).ceil() as usize).clamp(1, n);
    sorted[rank - 1]
}

/// Resident set size now and its high-water mark, in KiB.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize)]
pub struct Mem {
    pub rss_kb: u64,
    pub hwm_kb: u64,
}

/// Reads VmRSS and VmHWM of a process (`None`: this one).
pub fn mem(pid: Option<u32>) -> Result<Mem> {
    let path = match pid {
        Some(p) => format!("/proc/{p}/status"),
        None => "/proc/self/status".to_string(),
    };
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    let field = |name: &str| -> u64 {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    Ok(Mem {
        rss_kb: field("VmRSS:"),
        hwm_kb: field("VmHWM:"),
    })
}

/// CPU time (user + system, all threads) this process has used, in microseconds. Clock ticks
/// are 10 ms (CLK_TCK = 100 on Linux), fine over runs of seconds.
pub fn cpu_us() -> u64 {
    read_cpu_us("/proc/self/stat").unwrap_or(0)
}

/// CPU time (user + system, all threads) of another process on this host, in microseconds:
/// `None` if its `/proc/<pid>/stat` cannot be read.
pub fn cpu_us_of(pid: u32) -> Option<u64> {
    read_cpu_us(&format!("/proc/{pid}/stat"))
}

fn read_cpu_us(path: &str) -> Option<u64> {
    let stat = std::fs::read_to_string(path).ok()?;
    // The command name (field 2) may contain spaces; the fields after its ')' are fixed.
    let rest = stat.rfind(')').map(|i| &stat[i + 1..])?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the whole line: 12th and 13th after ')'.
    let tick = |i: usize| fields.get(i).and_then(|f| f.parse::<u64>().ok());
    Some((tick(11)? + tick(12)?) * 10_000)
}

/// Median of a sample (the mean of the two middle values for an even count); 0 when empty.
pub fn median(values: &[f64]) -> f64 {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Smallest and largest finite value; (0, 0) when empty.
pub fn min_max(values: &[f64]) -> (f64, f64) {
    let v = values.iter().copied().filter(|x| x.is_finite());
    let (lo, hi) = v.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), x| {
        (lo.min(x), hi.max(x))
    });
    if lo.is_finite() {
        (lo, hi)
    } else {
        (0.0, 0.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_tight() {
        for v in [0u64, 1, 127, 128, 129, 1000, 12_345, 1 << 20, u64::MAX / 2] {
            let mut h = Histogram::default();
            // A larger value above it, so the cap at the maximum does not hide the bucket.
            h.record(v);
            h.record(u64::MAX);
            let p50 = h.percentile(0.5);
            assert!(p50 >= v, "{v}");
            assert!(p50 - v <= v / 60 + 1, "{v} -> {p50}");
        }
        // The crate's top bucket ends one short of u64::MAX; the maximum stays exact.
        let mut h = Histogram::default();
        h.record(u64::MAX);
        assert_eq!(h.max(), u64::MAX);
        assert!(h.percentile(0.5) >= u64::MAX - u64::MAX / 60);
    }

    #[test]
    fn percentiles() {
        let mut h = Histogram::default();
        assert_eq!((h.percentile(0.5), h.max()), (0, 0));
        for v in 1..=1000 {
            h.record(v);
        }
        let p50 = h.percentile(0.5);
        assert!((495..=510).contains(&p50), "{p50}");
        assert_eq!(h.percentile(1.0), 1000);
        assert_eq!(h.max(), 1000);
        assert_eq!(percentile_sorted(&[1, 2, 3, 4], 0.5), 2);
        assert_eq!(percentile_sorted(&[1, 2, 3, 4], 0.99), 4);
    }

    #[test]
    fn reads_own_memory() {
        let m = mem(None).unwrap();
        assert!(m.rss_kb > 0 && m.hwm_kb >= m.rss_kb);
        let t0 = cpu_us();
        let mut x = 0u64;
        for i in 0..50_000_000u64 {
            x = x.wrapping_mul(31).wrapping_add(i);
        }
        std::hint::black_box(x);
        assert!(cpu_us() >= t0);
        assert!(cpu_us_of(std::process::id()).is_some());
        assert_eq!(cpu_us_of(u32::MAX), None);
    }

    #[test]
    fn medians() {
        assert_eq!(median(&[]), 0.0);
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(min_max(&[2.0, 0.5, 1.0]), (0.5, 2.0));
        assert_eq!(min_max(&[]), (0.0, 0.0));
    }
}
