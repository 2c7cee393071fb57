//! The TSC clock the benchmarks, the tools and the runtime's optional
//! submission tracing read (`rdma_perf` re-exports it).

/// Cycle-accurate timestamps, taken the way perftest takes them.
///
/// On x86_64 this reads the TSC directly (perftest's `get_cycles`), calibrated
/// once against quanta's monotonic reference. quanta alone would fall back to
/// `clock_gettime` when the CPU does not advertise an invariant TSC, as in a
/// TCG guest, where that is an emulated HPET read costing microseconds inside
/// every measured round trip.
///
/// ```
/// let clock = rdma_comm_core::clock::Clock::new();
/// let start = clock.now();
/// let elapsed_ns = clock.nanos(start, clock.now());
/// # let _ = elapsed_ns;
/// ```
#[derive(Debug, Clone)]
pub struct Clock {
    reference: quanta::Clock,
    /// Nanoseconds per tick in 32.32 fixed point: a conversion is one
    /// multiply and a shift, where a float one converts twice (the
    /// submission trace converts every request).
    ns_per_tick_fixed: u64,
}

/// Fractional bits of [`Clock`]'s nanoseconds per tick.
const FIXED_POINT_BITS: u32 = 32;

impl Default for Clock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock {
    /// Calibrates the clock (spins for about 20 ms).
    pub fn new() -> Self {
        let reference = quanta::Clock::new();
        let (t0, c0) = (reference.now(), ticks(&reference));
        while reference.now().duration_since(t0) < std::time::Duration::from_millis(20) {
            std::hint::spin_loop();
        }
        let (t1, c1) = (reference.now(), ticks(&reference));
        let ns = t1.duration_since(t0).as_nanos() as f64;
        let ns_per_tick = if c1 > c0 { ns / (c1 - c0) as f64 } else { 1.0 };
        Self::with_rate(reference, ns_per_tick)
    }

    fn with_rate(reference: quanta::Clock, ns_per_tick: f64) -> Self {
        // `as` saturates: a rate beyond 2^32 ns per tick is no clock's.
        let ns_per_tick_fixed = (ns_per_tick * (1u64 << FIXED_POINT_BITS) as f64).round() as u64;
        Self {
            reference,
            ns_per_tick_fixed,
        }
    }

    /// Raw ticks: cheap enough to read around every operation.
    #[inline]
    pub fn now(&self) -> u64 {
        ticks(&self.reference)
    }

    /// Nanoseconds per tick of [`now`](Self::now), as [`nanos`](Self::nanos)
    /// converts them (for converting many readings at once: a sum, or only
    /// the figures a report prints).
    pub fn ns_per_tick(&self) -> f64 {
        self.ns_per_tick_fixed as f64 / (1u64 << FIXED_POINT_BITS) as f64
    }

    /// Nanoseconds between two readings of [`now`](Self::now) (0 if `end`
    /// is the earlier).
    #[inline]
    pub fn nanos(&self, start: u64, end: u64) -> u64 {
        let fixed = u128::from(end.saturating_sub(start)) * u128::from(self.ns_per_tick_fixed);
        u64::try_from(fixed >> FIXED_POINT_BITS).unwrap_or(u64::MAX)
    }
}

#[cfg(target_arch = "x86_64")]
#[inline]
fn ticks(_reference: &quanta::Clock) -> u64 {
    // SAFETY: RDTSC has no preconditions and touches no memory.
    unsafe { core::arch::x86_64::_rdtsc() }
}

#[cfg(not(target_arch = "x86_64"))]
#[inline]
fn ticks(reference: &quanta::Clock) -> u64 {
    reference.raw()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixed_point_nanos_match_the_float_rate() {
        // A 2.4 GHz TSC, a 1 GHz counter and a slow 10 MHz one.
        for ns_per_tick in [1.0 / 2.4, 1.0, 100.0] {
            let clock = Clock::with_rate(quanta::Clock::new(), ns_per_tick);
            for ticks in [0u64, 1, 3, 1_000, 123_456_789, 1 << 40] {
                let exact = ticks as f64 * ns_per_tick;
                let got = clock.nanos(0, ticks) as f64;
                assert!(
                    (got - exact).abs() <= 1.0 + exact * 1e-9,
                    "{ticks} ticks at {ns_per_tick} ns: {got}, not {exact}"
                );
            }
        }
    }

    #[test]
    fn an_earlier_end_is_zero_and_a_huge_span_saturates() {
        let clock = Clock::with_rate(quanta::Clock::new(), 100.0);
        assert_eq!(clock.nanos(10, 5), 0);
        assert_eq!(clock.nanos(0, u64::MAX), u64::MAX);
    }
}
