//! Telling time in a busy-poll loop without reading the clock every pass.
//!
//! `Instant::now` is a vDSO call on a machine whose clocksource is the TSC,
//! but a real `clock_gettime` syscall when it is not (an HPET, as in many
//! VMs). Once per pass, that syscall would cost more than the pass itself.
//! A [`PassTimer`] counts passes instead and reads the clock about every
//! `CLOCK_READ_INTERVAL`, learning from each reading how many passes that is.

use std::time::{Duration, Instant};

/// About how often a [`PassTimer`] reads the clock (or every period, if
/// shorter).
pub(crate) const CLOCK_READ_INTERVAL: Duration = Duration::from_millis(2);

/// Most passes between two clock readings, whatever the passes cost: bounds
/// how late a period can be noticed when passes suddenly become slow.
const MAX_STRIDE: u32 = 1 << 15;

/// How many empty passes a pass that handled completions counts for. Its
/// doorbell and handler cost tens of empty passes, so a stride learned while
/// idle stays short enough once traffic starts.
const BUSY_PASS_WEIGHT: u32 = 64;

/// Says when a period has passed, for a loop that calls it once per pass;
/// [`Reactor::pass_timer`](super::Reactor::pass_timer) makes one suited to
/// the reactor's event mode. It reads the clock about every 2 ms (or every
/// period, if shorter).
#[derive(Debug, Clone)]
pub struct PassTimer {
    period: Duration,
    period_start: Instant,
    last_read: Instant,
    passes: u32,
    stride: u32,
    /// False for passes that may block: then every pass reads the clock.
    adaptive: bool,
}

impl PassTimer {
    /// A timer for a busy loop, whose first period starts now.
    pub(crate) fn new(period: Duration) -> Self {
        let now = Instant::now();
        Self {
            period,
            period_start: now,
            last_read: now,
            passes: 0,
            stride: 1,
            adaptive: true,
        }
    }

    /// A timer for a loop whose passes may block (an event-mode reactor's):
    /// counting passes says nothing about time there, and a pass that may
    /// sleep is long enough to read the clock every time.
    pub(crate) fn reading_every_pass(period: Duration) -> Self {
        Self {
            adaptive: false,
            ..Self::new(period)
        }
    }

    /// A timer that starts from what an earlier one learned (its
    /// [`stride`](Self::stride)) instead of relearning it.
    pub(crate) fn resume(period: Duration, stride: u32) -> Self {
        Self {
            stride: stride.clamp(1, MAX_STRIDE),
            ..Self::new(period)
        }
    }

    /// Passes between clock readings, as learned so far.
    pub(crate) fn stride(&self) -> u32 {
        self.stride
    }

    /// Counts one pass. True once per elapsed period (noticed at the next
    /// clock reading, so up to about `CLOCK_READ_INTERVAL` late); the
    /// next period starts then.
    #[cfg(test)]
    fn expired(&mut self) -> bool {
        self.count(1)
    }

    /// Counts one reactor pass that handled `completions` (what
    /// [`Reactor::turn`](super::Reactor::turn) returned): one that did work
    /// weighs more than an empty one. True once per elapsed period (noticed at
    /// the next clock reading, so up to about 2 ms late); the next period
    /// starts then.
    #[inline]
    pub fn expired_after(&mut self, completions: usize) -> bool {
        self.count(if completions == 0 {
            1
        } else {
            BUSY_PASS_WEIGHT
        })
    }

    /// Counts `passes` passes made elsewhere (a spin's polls, see
    /// [`Reactor::take_spin_polls`](super::Reactor::take_spin_polls))
    /// without reading the clock: the next pass that reaches the stride
    /// reads it.
    pub fn count_passes(&mut self, passes: u32) {
        self.passes = self.passes.saturating_add(passes);
    }

    #[inline]
    fn count(&mut self, weight: u32) -> bool {
        self.passes = self.passes.saturating_add(weight);
        if self.passes < self.stride {
            return false;
        }
        self.read_clock()
    }

    #[cold]
    fn read_clock(&mut self) -> bool {
        let now = Instant::now();
        if self.adaptive {
            let since_last = now.duration_since(self.last_read).as_nanos().max(1);
            let target = CLOCK_READ_INTERVAL.min(self.period).as_nanos();
            // Passes per target interval at the rate just seen; at most
            // doubling, so one fast burst cannot stretch the stride far.
            let fitted = u128::from(self.passes) * target / since_last;
            let limit = u128::from(self.stride.saturating_mul(2)).min(u128::from(MAX_STRIDE));
            self.stride = fitted.clamp(1, limit.max(1)) as u32;
        }
        self.passes = 0;
        self.last_read = now;
        if now.duration_since(self.period_start) >= self.period {
            self.period_start = now;
            return true;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_period_expires_once_and_the_next_starts() {
        // Each expiry starts the next period, so two expiries are a period
        // apart however late a loaded machine lets the loop notice them
        // (the bound on how late is the stride test's).
        let period = Duration::from_millis(20);
        let mut timer = PassTimer::new(period);
        let started = Instant::now();
        let mut expiries = Vec::new();
        while expiries.len() < 3 && started.elapsed() < Duration::from_secs(10) {
            if timer.expired() {
                expiries.push(started.elapsed());
            }
        }
        assert_eq!(expiries.len(), 3, "{expiries:?}");
        assert!(expiries[0] >= period, "{expiries:?}");
        for pair in expiries.windows(2) {
            assert!(
                pair[1] - pair[0] >= period,
                "one expiry per period: {expiries:?}"
            );
        }
    }

    #[test]
    fn the_stride_grows_for_cheap_passes_and_shrinks_for_slow_ones() {
        let mut timer = PassTimer::new(Duration::from_secs(60));
        let started = Instant::now();
        while started.elapsed() < Duration::from_millis(20) {
            timer.expired();
        }
        let fast = timer.stride;
        assert!(
            fast > 64,
            "cheap passes read the clock rarely: stride {fast}"
        );
        assert!(fast <= MAX_STRIDE);
        // Passes that take 1 ms each: after the next reading the stride
        // falls back to about one (started lower than `fast` to keep the
        // test short: the first slow reading comes only `stride` passes on).
        timer.stride = 16;
        for _ in 0..40 {
            std::thread::sleep(Duration::from_millis(1));
            timer.expired();
        }
        assert!(
            timer.stride <= 2,
            "slow passes read the clock every pass: stride {}",
            timer.stride
        );
    }

    #[test]
    fn a_pass_that_did_work_weighs_more_than_an_empty_one() {
        let mut timer = PassTimer::new(Duration::from_secs(60));
        timer.stride = 2 * BUSY_PASS_WEIGHT;
        let before = timer.last_read;
        timer.expired_after(3);
        assert_eq!(timer.last_read, before, "one busy pass: no reading yet");
        timer.expired_after(1);
        assert!(timer.last_read > before, "two busy passes fill the stride");
        assert_eq!(timer.passes, 0);
    }

    #[test]
    fn a_timer_for_sleeping_passes_reads_the_clock_every_pass() {
        let mut timer = PassTimer::reading_every_pass(Duration::from_millis(5));
        for _ in 0..1000 {
            timer.expired();
        }
        assert_eq!(timer.stride, 1, "cheap passes do not stretch it");
        std::thread::sleep(Duration::from_millis(6));
        assert!(
            timer.expired(),
            "the first pass after the period notices it"
        );
        assert!(!timer.expired(), "the next period started at the expiry");
        assert_eq!(timer.stride, 1);
    }
}
