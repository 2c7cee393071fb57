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
    ns_per_tick: f64,
}

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
        Self {
            reference,
            ns_per_tick,
        }
    }

    /// Raw ticks: cheap enough to read around every operation.
    #[inline]
    pub fn now(&self) -> u64 {
        ticks(&self.reference)
    }

    /// Nanoseconds between two readings of [`now`](Self::now).
    pub fn nanos(&self, start: u64, end: u64) -> u64 {
        (end.saturating_sub(start) as f64 * self.ns_per_tick) as u64
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
