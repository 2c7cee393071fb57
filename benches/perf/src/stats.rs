//! perftest's latency and bandwidth columns: computed from samples, printed in
//! its layout.

/// perftest's latency columns for one message size.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LatencyStats {
    /// Message size.
    pub bytes: usize,
    /// Samples.
    pub iters: usize,
    /// Fastest, µs.
    pub min_us: f64,
    /// Slowest, µs.
    pub max_us: f64,
    /// Median, µs (perftest's t_typical).
    pub typical_us: f64,
    /// Mean, µs.
    pub avg_us: f64,
    /// Standard deviation, µs.
    pub stdev_us: f64,
    /// 99th percentile, µs.
    pub p99_us: f64,
    /// 99.9th percentile, µs.
    pub p999_us: f64,
}

/// The column header perftest prints for latency tests.
pub const LATENCY_HEADER: &str = " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] ";

impl LatencyStats {
    /// Computes the columns from per-iteration latencies in nanoseconds.
    pub fn from_ns(bytes: usize, samples_ns: &[u64]) -> Option<Self> {
        Self::from_ticks(bytes, &mut samples_ns.to_vec(), 1.0)
    }

    /// Computes the columns from per-iteration clock readings, `ticks`
    /// (sorted in place), of `ns_per_tick` nanoseconds each. Only the
    /// columns are converted: a tick count orders as its latency does, so
    /// the samples are never converted one by one before the sort.
    // Never inlined: tools/instr-count finds the report's sort by this name.
    #[inline(never)]
    pub fn from_ticks(bytes: usize, ticks: &mut [u64], ns_per_tick: f64) -> Option<Self> {
        if ticks.is_empty() {
            return None;
        }
        ticks.sort_unstable();
        let us = |ticks: u64| ticks as f64 * ns_per_tick / 1000.0;
        let n = ticks.len();
        let avg = ticks.iter().map(|&t| us(t)).sum::<f64>() / n as f64;
        let var = ticks.iter().map(|&t| (us(t) - avg).powi(2)).sum::<f64>() / n as f64;
        let pct = |p: f64| us(ticks[(((n as f64) * p).ceil() as usize).clamp(1, n) - 1]);
        Some(Self {
            bytes,
            iters: n,
            min_us: us(ticks[0]),
            max_us: us(ticks[n - 1]),
            typical_us: us(ticks[n / 2]),
            avg_us: avg,
            stdev_us: var.sqrt(),
            p99_us: pct(0.99),
            p999_us: pct(0.999),
        })
    }

    /// One row in perftest's layout.
    pub fn row(&self) -> String {
        format!(
            " {:<7} {:<10}    {:<7.2}        {:<7.2}      {:<7.2}          {:<7.2}        {:<7.2}          {:<7.2}                {:<7.2}",
            self.bytes,
            self.iters,
            self.min_us,
            self.max_us,
            self.typical_us,
            self.avg_us,
            self.stdev_us,
            self.p99_us,
            self.p999_us
        )
    }
}

/// perftest's bandwidth columns for one message size.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BandwidthStats {
    /// Message size.
    pub bytes: usize,
    /// Messages.
    pub iters: u64,
    /// Best window, bytes per second.
    pub peak_bytes_per_sec: f64,
    /// Whole run, bytes per second.
    pub avg_bytes_per_sec: f64,
    /// Messages per second, in millions.
    pub msg_rate_mpps: f64,
}

/// The column header for bandwidth tests, in MiB/s or Gb/s.
pub fn bandwidth_header(gbits: bool) -> String {
    let unit = if gbits { "Gb/sec" } else { "MiB/sec" };
    format!(" #bytes     #iterations    BW peak[{unit}]    BW average[{unit}]   MsgRate[Mpps]")
}

impl BandwidthStats {
    /// One row in perftest's layout (MiB/s, or Gb/s with `gbits`).
    pub fn row(&self, gbits: bool) -> String {
        let scale = |bps: f64| {
            if gbits {
                bps * 8.0 / 1e9
            } else {
                bps / (1024.0 * 1024.0)
            }
        };
        format!(
            " {:<10} {:<10}       {:<7.2}            {:<7.2}               {:<7.6}",
            self.bytes,
            self.iters,
            scale(self.peak_bytes_per_sec),
            scale(self.avg_bytes_per_sec),
            self.msg_rate_mpps
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_columns_follow_perftest() {
        let samples: Vec<u64> = (1..=1000).map(|i| i * 1000).collect();
        let stats = LatencyStats::from_ns(8, &samples).unwrap();
        assert_eq!((stats.min_us, stats.max_us), (1.0, 1000.0));
        assert_eq!(stats.typical_us, 501.0);
        assert_eq!((stats.p99_us, stats.p999_us), (990.0, 999.0));
        assert!((stats.avg_us - 500.5).abs() < 1e-9);
        assert!(stats.row().starts_with(" 8       1000"));
        assert!(LatencyStats::from_ns(8, &[]).is_none());
    }

    #[test]
    fn ticks_convert_only_the_columns() {
        // Shuffled, at 0.5 ns a tick: the same columns as the nanoseconds.
        let mut ticks: Vec<u64> = (1..=1000).rev().map(|i| i * 2000).collect();
        ticks.swap(3, 700);
        let stats = LatencyStats::from_ticks(8, &mut ticks, 0.5).unwrap();
        let samples: Vec<u64> = (1..=1000).map(|i| i * 1000).collect();
        let want = LatencyStats::from_ns(8, &samples).unwrap();
        let columns = |s: &LatencyStats| {
            [
                s.min_us,
                s.max_us,
                s.typical_us,
                s.avg_us,
                s.stdev_us,
                s.p99_us,
                s.p999_us,
            ]
        };
        for (got, want) in columns(&stats).into_iter().zip(columns(&want)) {
            assert!((got - want).abs() < 1e-9, "{got} against {want}");
        }
        assert_eq!((stats.bytes, stats.iters), (8, 1000));
        assert!(LatencyStats::from_ticks(8, &mut [], 0.5).is_none());
    }

    #[test]
    fn bandwidth_rows_scale_units() {
        let stats = BandwidthStats {
            bytes: 65536,
            iters: 10,
            peak_bytes_per_sec: 1024.0 * 1024.0 * 2.0,
            avg_bytes_per_sec: 1024.0 * 1024.0,
            msg_rate_mpps: 0.5,
        };
        assert!(stats.row(false).contains("2.00") && stats.row(false).contains("1.00"));
        assert!(bandwidth_header(true).contains("Gb/sec"));
    }
}
