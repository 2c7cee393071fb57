//! Round-trip times in constant memory, for the tools that report
//! percentiles of a run of any length (ping_pong's client, demo, mesh).
//! Included with `#[path = "../common/rtt.rs"] mod rtt;` (or the path from
//! where the tool lives).
//!
//! A histogram of fixed bounds (hdrhistogram) holds the counts: its size
//! is set when the recorder is made and no record allocates, so a run of
//! 10^9 round trips takes the memory one of ten does. Percentiles come to
//! within 0.1 % of the time; the smallest and largest are exact.

// Each tool uses some of these.
#![allow(dead_code)]

use hdrhistogram::Histogram;

/// The longest time told apart from longer ones: an hour. A longer round
/// trip counts as an hour in the percentiles (the maximum stays exact).
const HIGHEST_NS: u64 = 3_600 * 1_000_000_000;

/// Significant decimal digits kept of each time: 3, so within 0.1 %.
const SIGNIFICANT_DIGITS: u8 = 3;

/// Round-trip times in nanoseconds: their count, exact extremes and
/// percentiles.
#[derive(Debug, Clone)]
pub struct RttRecorder {
    histogram: Histogram<u64>,
    min_ns: u64,
    max_ns: u64,
}

impl Default for RttRecorder {
    fn default() -> Self {
        Self::new()
    }
}

impl RttRecorder {
    /// An empty recorder, with every count it will ever need.
    pub fn new() -> Self {
        let histogram = Histogram::new_with_bounds(1, HIGHEST_NS, SIGNIFICANT_DIGITS)
            .expect("constant bounds that hdrhistogram accepts");
        Self {
            histogram,
            min_ns: u64::MAX,
            max_ns: 0,
        }
    }

    /// Counts one round trip of `ns` nanoseconds. Allocates nothing.
    pub fn record(&mut self, ns: u64) {
        self.histogram.saturating_record(ns);
        self.min_ns = self.min_ns.min(ns);
        self.max_ns = self.max_ns.max(ns);
    }

    /// Adds every round trip `other` counted.
    pub fn merge(&mut self, other: &RttRecorder) {
        // Same bounds on both sides, so adding cannot fail.
        let _ = self.histogram.add(&other.histogram);
        self.min_ns = self.min_ns.min(other.min_ns);
        self.max_ns = self.max_ns.max(other.max_ns);
    }

    /// Round trips counted.
    pub fn count(&self) -> u64 {
        self.histogram.len()
    }

    /// The time `quantile` (0 to 1) of the round trips took at most: 0
    /// gives the shortest, 1 the longest, exactly; the rest are within
    /// 0.1 %, and never outside those two. 0 when nothing was counted.
    pub fn quantile_ns(&self, quantile: f64) -> u64 {
        if self.count() == 0 {
            return 0;
        }
        if quantile <= 0.0 {
            return self.min_ns;
        }
        if quantile >= 1.0 {
            return self.max_ns;
        }
        self.histogram
            .value_at_quantile(quantile)
            .clamp(self.min_ns, self.max_ns)
    }

    /// [`quantile_ns`](Self::quantile_ns) in microseconds.
    pub fn quantile_us(&self, quantile: f64) -> f64 {
        self.quantile_ns(quantile) as f64 / 1e3
    }

    /// Bytes of counts the recorder holds: fixed when it is made.
    pub fn footprint_bytes(&self) -> usize {
        self.histogram.distinct_values() * std::mem::size_of::<u64>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_come_within_a_thousandth_and_the_extremes_exactly() {
        let mut rtts = RttRecorder::new();
        for us in 1..=1000u64 {
            rtts.record(us * 1000 + 7);
        }
        assert_eq!(rtts.count(), 1000);
        assert_eq!(rtts.quantile_ns(0.0), 1007);
        assert_eq!(rtts.quantile_ns(1.0), 1_000_007);
        for (quantile, exact) in [(0.5, 500_007.0), (0.9, 900_007.0), (0.99, 990_007.0)] {
            let got = rtts.quantile_ns(quantile) as f64;
            assert!(
                (got - exact).abs() <= exact / 1000.0,
                "p{quantile}: {got} for {exact}"
            );
        }
        assert!((rtts.quantile_us(0.5) - 500.007).abs() < 0.6);
    }

    #[test]
    fn an_empty_recorder_reports_zeros() {
        let rtts = RttRecorder::new();
        assert_eq!(rtts.count(), 0);
        assert_eq!(rtts.quantile_ns(0.0), 0);
        assert_eq!(rtts.quantile_ns(0.5), 0);
        assert_eq!(rtts.quantile_ns(1.0), 0);
    }

    #[test]
    fn merged_recorders_count_both_runs() {
        let (mut a, mut b) = (RttRecorder::new(), RttRecorder::new());
        a.record(2_000);
        b.record(1_000);
        b.record(9_000);
        a.merge(&b);
        assert_eq!(a.count(), 3);
        assert_eq!(a.quantile_ns(0.0), 1_000);
        assert_eq!(a.quantile_ns(1.0), 9_000);
    }

    #[test]
    fn a_time_beyond_the_bounds_is_counted_and_the_maximum_stays_exact() {
        let mut rtts = RttRecorder::new();
        rtts.record(0);
        rtts.record(2 * HIGHEST_NS);
        assert_eq!(rtts.count(), 2);
        assert_eq!(rtts.quantile_ns(0.0), 0);
        assert_eq!(rtts.quantile_ns(1.0), 2 * HIGHEST_NS);
    }

    #[test]
    fn the_footprint_is_fixed_when_the_recorder_is_made() {
        let mut rtts = RttRecorder::new();
        let made = rtts.footprint_bytes();
        assert!(made < 1 << 20, "{made} B of counts");
        for ns in 0..1_000_000u64 {
            rtts.record(ns.wrapping_mul(7_919) % (10 * HIGHEST_NS));
        }
        assert_eq!(rtts.footprint_bytes(), made);
    }
}
