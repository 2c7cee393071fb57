//! Which sends of a datagram endpoint the device may still be reading
//! ([`SendWindow`]): a pure type, tested without a device.
//!
//! Sends are numbered in the order they are staged (wrapping `u32`s).
//! Only every `signal_every`-th asks for a completion; one retires every
//! send before it. With `signal_every` at most half the depth, a full
//! window always holds a signaled send whose completion is coming, so a
//! sender refused for room is never refused for good.

/// The sends staged and not yet retired, out of `depth`.
#[derive(Debug)]
pub(crate) struct SendWindow {
    /// The number the next staged send takes.
    next: u32,
    /// The oldest send not retired.
    oldest: u32,
    depth: u32,
    signal_every: u32,
    /// Sends staged since the last signaled one.
    since_signal: u32,
}

impl SendWindow {
    /// A window of `depth` sends (at least 2).
    pub(crate) fn new(depth: u32) -> Self {
        debug_assert!(depth >= 2);
        Self {
            next: 0,
            oldest: 0,
            depth,
            signal_every: (depth / 2).max(1),
            since_signal: 0,
        }
    }

    /// Sends the device may still be reading, or staged and not posted.
    #[inline]
    pub(crate) fn in_flight(&self) -> u32 {
        self.next.wrapping_sub(self.oldest)
    }

    /// Takes the next number: `Some((seq, signaled))`, or `None` when the
    /// window is full.
    #[inline]
    pub(crate) fn take(&mut self) -> Option<(u32, bool)> {
        if self.in_flight() >= self.depth {
            return None;
        }
        let seq = self.next;
        self.next = seq.wrapping_add(1);
        self.since_signal += 1;
        let signaled = self.since_signal >= self.signal_every;
        if signaled {
            self.since_signal = 0;
        }
        Some((seq, signaled))
    }

    /// Signaled send `seq` completed: it and every send before it retire.
    /// False (nothing changes) if `seq` is not in flight.
    #[inline]
    pub(crate) fn retire(&mut self, seq: u32) -> bool {
        let ahead = seq.wrapping_sub(self.oldest);
        if ahead >= self.in_flight() {
            return false;
        }
        self.oldest = seq.wrapping_add(1);
        true
    }

    /// Where send `seq` is in a ring of `slots` (a power of two, at least
    /// the depth).
    #[inline]
    pub(crate) fn slot(seq: u32, slots: u32) -> u32 {
        seq & (slots - 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_window_refuses_until_a_signaled_send_retires() {
        let mut window = SendWindow::new(4);
        let taken: Vec<_> = std::iter::from_fn(|| window.take()).collect();
        assert_eq!(taken, [(0, false), (1, true), (2, false), (3, true)]);
        assert_eq!(window.in_flight(), 4);
        assert!(!window.retire(4), "never staged");
        assert!(window.retire(1));
        assert_eq!(window.in_flight(), 2);
        assert!(!window.retire(0), "retired already");
        assert_eq!(window.take(), Some((4, false)));
    }

    #[test]
    fn numbers_wrap_without_losing_the_window() {
        let mut window = SendWindow::new(8);
        window.next = u32::MAX - 1;
        window.oldest = u32::MAX - 1;
        for _ in 0..8 {
            assert!(window.take().is_some());
        }
        assert_eq!(window.take(), None);
        assert!(window.retire(2), "past the wrap");
        assert_eq!(window.in_flight(), 3);
        assert_eq!(SendWindow::slot(u32::MAX, 8), 7);
        assert_eq!(SendWindow::slot(0, 8), 0);
    }

    proptest::proptest! {
        /// However the sends are staged and retired, a full window holds a
        /// signaled send (so its completion will make room), and the
        /// window never holds more than its depth.
        #[test]
        fn a_full_window_always_holds_a_signaled_send(
            depth in 2u32..64,
            steps in proptest::collection::vec(0u8..4, 1..400),
        ) {
            let mut window = SendWindow::new(depth);
            let mut signaled: std::collections::VecDeque<u32> = Default::default();
            for step in steps {
                if step == 0 {
                    if let Some(seq) = signaled.pop_front() {
                        proptest::prop_assert!(window.retire(seq));
                    }
                } else if let Some((seq, signal)) = window.take() {
                    if signal {
                        signaled.push_back(seq);
                    }
                } else {
                    proptest::prop_assert_eq!(window.in_flight(), depth);
                    proptest::prop_assert!(!signaled.is_empty(), "full, and no completion coming");
                }
                proptest::prop_assert!(window.in_flight() <= depth);
            }
        }
    }
}
