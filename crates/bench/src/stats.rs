//! Fixed-size latency histogram (no growth with the message count, so it does not disturb the
//! RSS it sits next to), exact percentiles for small samples, and /proc memory readings.

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

/// Sub-buckets per power of two: relative error under 1/64 (1.6 %).
const SUB: u64 = 64;
const LINEAR: u64 = 2 * SUB;
const BUCKETS: usize = (LINEAR + (64 - 7) * SUB) as usize;

/// Log-linear histogram of microsecond values, HdrHistogram style.
pub struct Histogram {
    counts: Vec<u64>,
    total: u64,
    max: u64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            counts: vec![0; BUCKETS],
            total: 0,
            max: 0,
        }
    }
}

fn index(v: u64) -> usize {
    if v < LINEAR {
        return v as usize;
    }
    let e = 63 - u64::from(v.leading_zeros()); // >= 7
    let shift = e - 6;
    (LINEAR + (e - 7) * SUB + ((v >> shift) - SUB)) as usize
}

/// Upper bound of the values that land in bucket `i`.
fn upper(i: usize) -> u64 {
    let i = i as u64;
    if i < LINEAR {
        return i;
    }
    let e = (i - LINEAR) / SUB + 7;
    let m = (i - LINEAR) % SUB + SUB;
    let shift = e - 6;
    ((m + 1) << shift) - 1
}

impl Histogram {
    pub fn record(&mut self, v: u64) {
        self.counts[index(v)] += 1;
        self.total += 1;
        self.max = self.max.max(v);
    }

    pub fn max(&self) -> u64 {
        self.max
    }

    /// Nearest-rank percentile, `q` in 0..=1; 0 when empty.
    pub fn percentile(&self, q: f64) -> u64 {
        if self.total == 0 {
            return 0;
        }
        let rank = ((q * self.total as f64).ceil() as u64).clamp(1, self.total);
        let mut seen = 0;
        for (i, c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return upper(i).min(self.max);
            }
        }
        self.max
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
    fn buckets_are_monotonic_and_tight() {
        for v in [0u64, 1, 127, 128, 129, 1000, 12_345, 1 << 20, u64::MAX / 2] {
            let i = index(v);
            assert!(upper(i) >= v, "{v}");
            assert!(upper(i) - v <= v / 60 + 1, "{v} -> {}", upper(i));
            if i > 0 {
                assert!(upper(i - 1) < v, "{v}");
            }
        }
        assert!(index(u64::MAX) < BUCKETS);
    }

    #[test]
    fn percentiles() {
        let mut h = Histogram::default();
        for v in 1..=1000 {
            h.record(v);
        }
        let p50 = h.percentile(0.5);
        assert!((495..=510).contains(&p50), "{p50}");
        assert_eq!(h.percentile(1.0), 1000);
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
