//! Stopping a running reactor from another thread: a flag the reactor
//! reads between passes, and a wake for a reactor asleep in a wait; why a
//! bounded run ended.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use super::wait::Waker;

/// Stops a running reactor from any thread.
#[derive(Debug, Clone)]
pub struct Stopper {
    flag: Arc<AtomicBool>,
    waker: Waker,
}

impl Stopper {
    /// A stopper that sets `flag` (the reactor's stop request) and wakes
    /// the reactor through `waker`.
    pub(super) fn new(flag: Arc<AtomicBool>, waker: Waker) -> Self {
        Self { flag, waker }
    }

    /// Makes `run` return after its current pass.
    pub fn stop(&self) {
        self.flag.store(true, Ordering::Release);
        self.waker.wake();
    }
}

/// Why [`Reactor::run_until`](super::Reactor::run_until) or
/// [`Reactor::run_for`](super::Reactor::run_for) returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use = "a run may have been stopped before it reached its end"]
pub enum Ended {
    /// It reached what it was to run until: its condition held, or its
    /// time limit passed.
    Reached,
    /// A [`Stopper`] or [`Ctx::stop`](super::Ctx::stop) asked it to
    /// return first.
    Stopped,
}

#[cfg(test)]
mod tests {
    use super::super::EventMode;
    use super::super::wait::Waiter;
    use super::*;

    #[test]
    fn stop_sets_the_flag_and_wakes_the_wait() {
        let mut waiter = Waiter::new(EventMode::Blocking, &[]).expect("an eventfd");
        let flag = Arc::new(AtomicBool::new(false));
        let stopper = Stopper::new(Arc::clone(&flag), waiter.waker.clone());
        stopper.clone().stop();
        assert!(flag.load(Ordering::Acquire));
        // The wake makes a wait with no timeout return at once.
        let mut fired = Vec::new();
        waiter
            .wait(std::time::Duration::MAX, &mut fired)
            .expect("the wait returns");
        assert!(fired.is_empty());
    }
}
