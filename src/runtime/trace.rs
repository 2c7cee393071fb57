//! Optional submission tracing: how long a command waits between its
//! `Submitter::send` and the doorbell of the reactor pass that posts it.
//!
//! With [`RuntimeConfig::trace_submissions`](super::RuntimeConfig::trace_submissions)
//! each ring stamps its commands with the TSC when they are queued; the
//! reactor keeps the stamps of the commands it staged in a pass (up to
//! [`PER_PASS`]) and, once the pass has rung its doorbells, adds their ages
//! to a log-linear histogram. Nothing is allocated after start; the cost is
//! one TSC read per command on the application thread and one per pass
//! that staged commands on the reactor.

use arrayvec::ArrayVec;

use crate::clock::Clock;

/// Commands per pass whose ages are recorded (the rest of a larger batch
/// left in the same doorbell and would read about the same).
pub(crate) const PER_PASS: usize = 64;

/// Sub-buckets per power of two: ages are kept to within 1/16 (6 %).
const SUB_BUCKETS: u64 = 16;
/// Buckets for every u64 number of nanoseconds.
const BUCKETS: usize = ((64 - 4 + 1) * SUB_BUCKETS) as usize;

/// Percentiles of the submit-to-doorbell ages a reactor recorded.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SubmitLatency {
    /// Commands recorded.
    pub samples: u64,
    /// Median, in nanoseconds (to within 6 %).
    pub p50_ns: u64,
    /// 99th percentile, in nanoseconds (to within 6 %).
    pub p99_ns: u64,
    /// Largest, in nanoseconds (to within 6 %).
    pub max_ns: u64,
}

/// A log-linear histogram of nanoseconds.
pub(crate) struct Histogram {
    counts: Box<[u64]>,
    total: u64,
}

impl Histogram {
    pub(crate) fn new() -> Self {
        Self {
            counts: vec![0; BUCKETS].into_boxed_slice(),
            total: 0,
        }
    }

    fn index(ns: u64) -> usize {
        if ns < SUB_BUCKETS {
            return ns as usize;
        }
        let exponent = u64::from(63 - ns.leading_zeros());
        ((exponent - 3) * SUB_BUCKETS + ((ns >> (exponent - 4)) & (SUB_BUCKETS - 1))) as usize
    }

    /// The smallest value of bucket `index`.
    fn floor(index: usize) -> u64 {
        let index = index as u64;
        if index < SUB_BUCKETS {
            return index;
        }
        let exponent = index / SUB_BUCKETS + 3;
        (SUB_BUCKETS + index % SUB_BUCKETS) << (exponent - 4)
    }

    pub(crate) fn record(&mut self, ns: u64) {
        self.counts[Self::index(ns)] += 1;
        self.total += 1;
    }

    fn percentile(&self, q: f64) -> u64 {
        let rank = ((self.total as f64 * q).ceil() as u64).clamp(1, self.total.max(1));
        let mut seen = 0;
        for (index, &count) in self.counts.iter().enumerate() {
            seen += count;
            if seen >= rank {
                return Self::floor(index);
            }
        }
        0
    }

    pub(crate) fn summary(&self) -> SubmitLatency {
        if self.total == 0 {
            return SubmitLatency::default();
        }
        SubmitLatency {
            samples: self.total,
            p50_ns: self.percentile(0.50),
            p99_ns: self.percentile(0.99),
            max_ns: self.percentile(1.0),
        }
    }
}

/// A reactor's side of the tracing.
pub(crate) struct Tracer {
    clock: Clock,
    /// Stamps of the commands staged in this pass.
    pub(crate) staged: ArrayVec<u64, PER_PASS>,
    pub(crate) ages: Histogram,
    /// Samples in the last summary published.
    published: u64,
}

impl Tracer {
    pub(crate) fn new(clock: Clock) -> Self {
        Self {
            clock,
            staged: ArrayVec::new(),
            ages: Histogram::new(),
            published: 0,
        }
    }

    /// The summary, if samples came in since the last one (its walk over
    /// the buckets is not repeated on every sleep of an idle reactor).
    pub(crate) fn new_summary(&mut self) -> Option<SubmitLatency> {
        (self.ages.total != self.published).then(|| {
            self.published = self.ages.total;
            self.ages.summary()
        })
    }

    /// The pass that staged commands has returned from its doorbells: the
    /// staged commands' ages go into the histogram.
    #[inline]
    pub(crate) fn doorbells_rung(&mut self) {
        if self.staged.is_empty() {
            return;
        }
        let now = self.clock.now();
        for stamp in self.staged.drain(..) {
            self.ages.record(self.clock.nanos(stamp, now));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_keep_values_to_within_a_sixteenth() {
        for ns in (0..100_000u64).chain([1 << 20, 123_456_789, u64::MAX / 3, u64::MAX]) {
            let floor = Histogram::floor(Histogram::index(ns));
            assert!(floor <= ns && ns - floor <= ns / 16, "{ns} -> {floor}");
        }
    }

    #[test]
    fn percentiles_of_a_known_distribution() {
        let mut histogram = Histogram::new();
        assert_eq!(histogram.summary(), SubmitLatency::default());
        for ns in 1..=1000 {
            histogram.record(ns * 100);
        }
        let summary = histogram.summary();
        assert_eq!(summary.samples, 1000);
        assert!((47_000..=50_000).contains(&summary.p50_ns), "{summary:?}");
        assert!((93_000..=99_000).contains(&summary.p99_ns), "{summary:?}");
        assert!((94_000..=100_000).contains(&summary.max_ns), "{summary:?}");
    }
}
