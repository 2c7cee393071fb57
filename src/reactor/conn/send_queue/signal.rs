//! Selective signaling ([`Signaling`]): which requests ask for a
//! completion. Unsignaled requests are retired by a later signaled one
//! (RC completes the send queue in order), so whatever they hold (a send
//! slot, a send-queue entry, a registration) must always have a signaled
//! request behind it before it runs out.

use crate::reactor::idle::{Spell, SpellMark};

pub(crate) struct Signaling {
    /// Every this many requests one is signaled.
    interval: u32,
    /// Requests staged since the last signaled one.
    since: u32,
    /// The quiet spell of the last doorbell rung on sparse traffic: while
    /// the reactor's spell reads it as sparse, what is posted is signaled
    /// (see [`is_sparse`](Self::is_sparse)).
    posted_after_spell: SpellMark,
}

impl Signaling {
    /// Signals every `interval` requests (at least every one).
    pub(crate) fn new(interval: u32) -> Self {
        Self {
            interval: interval.max(1),
            since: 0,
            // The first post is signaled.
            posted_after_spell: SpellMark::NEW,
        }
    }

    /// Every this many requests one is signaled.
    #[cfg(test)]
    pub(crate) fn interval(&self) -> u32 {
        self.interval
    }

    /// Whether the request staged now is signaled: if `force`d, every
    /// `interval`th, and each one while fewer than an interval of
    /// send-queue entries (`sq_left`, this one's included) or of send slots
    /// (`slots_left`) are left, so what unsignaled requests hold is always
    /// freed by a later signaled one.
    #[inline(always)]
    pub(crate) fn decide(&mut self, force: bool, sq_left: u32, slots_left: u32) -> bool {
        self.since += 1;
        let signal = force
            || self.since >= self.interval
            || sq_left <= self.interval
            || slots_left < self.interval;
        if signal {
            self.since = 0;
        }
        signal
    }

    /// The last staged request was made signaled after the fact.
    #[inline]
    pub(crate) fn signaled(&mut self) {
        self.since = 0;
    }

    /// True if requests went out unsignaled since the last signaled one:
    /// they report completion only once a later signaled one completes.
    #[inline]
    pub(crate) fn has_unsignaled_tail(&self) -> bool {
        self.since > 0
    }

    /// Whether traffic counts as sparse in `spell`, so a flush signals the
    /// last request it posts (see [`Spell::is_sparse`]).
    #[inline]
    pub(crate) fn is_sparse(&self, spell: Spell) -> bool {
        spell.is_sparse(self.posted_after_spell)
    }

    /// Notes a doorbell rung on sparse traffic in `spell` (see
    /// [`Spell::mark`]).
    #[inline]
    pub(crate) fn note_sparse_post(&mut self, spell: Spell) {
        self.posted_after_spell = spell.mark();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_interval_th_request_is_signaled() {
        let mut signaling = Signaling::new(4);
        let plenty = 100;
        let signaled: Vec<bool> = (0..8)
            .map(|_| signaling.decide(false, plenty, plenty))
            .collect();
        assert_eq!(
            signaled,
            [false, false, false, true, false, false, false, true]
        );
        assert!(!signaling.has_unsignaled_tail());
        assert!(!signaling.decide(false, plenty, plenty));
        assert!(signaling.has_unsignaled_tail());
        signaling.signaled();
        assert!(!signaling.has_unsignaled_tail(), "the count starts again");
    }

    #[test]
    fn low_room_or_force_signals_at_once() {
        let mut signaling = Signaling::new(4);
        assert!(signaling.decide(true, 100, 100), "forced");
        assert!(
            signaling.decide(false, 4, 100),
            "an interval of entries left"
        );
        assert!(
            !signaling.decide(false, 5, 4),
            "room for an interval of both"
        );
        assert!(
            signaling.decide(false, 100, 3),
            "fewer slots than an interval"
        );
        assert_eq!(Signaling::new(0).interval(), 1, "at least every request");
    }
}
