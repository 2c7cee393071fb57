//! Credits ([`Credits`]): how many receives the peer has posted for us,
//! and telling the peer how many we have posted (in the immediate of every
//! SEND, or of a zero-length one when there is nothing to send); and the
//! grant a peer must keep to: its first receive beyond it cuts it off (see
//! [`Credits::count_receive`] and, for how many SRQ receives such a peer
//! can take before, and for how long, `ReactorConfig::srq_depth`).

use crate::error::Error;

/// The immediate of every SEND the reactor posts (all are SEND_WITH_IMM):
/// the top two bits say what the SEND is, the low 30 carry the sender's
/// cumulative receive count modulo 2^30 (its credits for us).
///
/// ```text
/// kind 0  message            payload = every byte received
/// kind 1  credit update      no payload
/// kind 2  message with imm   payload, then the user's immediate (u32 LE)
/// kind 3  (never sent: a peer that sends it is cut off)
/// ```
///
/// The credit rides in the immediate rather than in a header so that a
/// payload that fits a packet goes in one (a 4 KiB block at a 4 KiB MTU),
/// and the user's immediate goes in a trailer so that a received message,
/// which starts its slot, can be forwarded with one by writing 4 bytes
/// after it.
pub(crate) mod send_imm {
    /// Bits of the receive count.
    pub(crate) const COUNT_BITS: u32 = 30;
    /// The receive count's bits.
    pub(crate) const COUNT_MASK: u32 = (1 << COUNT_BITS) - 1;
    /// A message whose payload is everything received.
    pub(crate) const MESSAGE: u32 = 0;
    /// A credit update (no payload).
    pub(crate) const CREDIT: u32 = 1;
    /// A message followed by the user's immediate.
    pub(crate) const MESSAGE_WITH_IMM: u32 = 2;

    /// The immediate of a SEND of `kind` from a sender that has posted
    /// `posted` receives.
    #[inline]
    pub(crate) fn encode(kind: u32, posted: u32) -> u32 {
        (kind << COUNT_BITS) | (posted & COUNT_MASK)
    }

    /// The full receive count that `count` (its low 30 bits) reports, given
    /// `known`, the highest heard so far: a step forward of less than 2^29
    /// (a peer's receives are far fewer) raises it; anything else is an
    /// update that crossed a later one, and leaves it.
    #[inline]
    pub(crate) fn advance(known: u32, count: u32) -> u32 {
        let step = count.wrapping_sub(known) & COUNT_MASK;
        if step < 1 << (COUNT_BITS - 1) {
            known.wrapping_add(step)
        } else {
            known
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn the_kind_and_count_share_the_immediate() {
            assert_eq!(encode(MESSAGE, 5), 5);
            assert_eq!(encode(CREDIT, 5), 0x4000_0005);
            assert_eq!(encode(MESSAGE_WITH_IMM, u32::MAX), 0xBFFF_FFFF);
            for kind in [MESSAGE, CREDIT, MESSAGE_WITH_IMM] {
                let imm = encode(kind, 0x1234_5678);
                assert_eq!(imm >> COUNT_BITS, kind);
                assert_eq!(imm & COUNT_MASK, 0x1234_5678 & COUNT_MASK);
            }
        }

        #[test]
        fn counts_rebuild_across_every_wrap() {
            // Around the 30-bit wrap of the wire and the 32-bit wrap of
            // the full count, a count a step ahead raises the known one by
            // exactly that step.
            for known in [0, 100, COUNT_MASK - 3, (1 << 31) + 7, u32::MAX - 2] {
                for step in [1, 2, 64, 4096, (1 << 29) - 1] {
                    let full = known.wrapping_add(step);
                    assert_eq!(advance(known, full & COUNT_MASK), full, "{known} + {step}");
                }
                // The same count again, or one that crossed a later update.
                assert_eq!(advance(known, known & COUNT_MASK), known);
                for behind in [1, 64, 1 << 29] {
                    let stale = known.wrapping_sub(behind) & COUNT_MASK;
                    assert_eq!(advance(known, stale), known, "{known} - {behind}");
                }
            }
        }
    }
}

/// A SEND that arrived, decoded (`RecvRing::decode`).
#[derive(Debug)]
pub(crate) enum Arrival {
    /// A credit update: the peer's receive count (30 bits).
    Credit(u32),
    /// A message: the peer's receive count (30 bits), the payload (address,
    /// length) in the receive slot, and the user's immediate.
    Message {
        count: u32,
        data: (*const u8, usize),
        imm: Option<u32>,
    },
}

/// A connection's credits, both ways. All counts are cumulative and wrap.
/// Pure bookkeeping: the connection stages the requests these numbers
/// ask for.
#[derive(Debug)]
pub(crate) struct Credits {
    /// Receives the peer has posted for us (its last count, rebuilt to 32
    /// bits).
    peer_posted: u32,
    /// Our requests that consume one of the peer's receives.
    consumed: u32,
    /// Receives we have posted.
    posted: u32,
    /// The highest receive count we have put on the wire (or are about to,
    /// with this pass's doorbell): everything the peer was ever granted.
    advertised: u32,
    /// Receives the peer consumed on this QP (SENDs, WRITE_WITH_IMMs and
    /// credit updates that completed here): never more than `advertised`
    /// for a peer that keeps to its credits.
    received: u32,
    /// Unannounced receives that call for a credit update of their own.
    threshold: u32,
    /// A staged SEND carries our count: the doorbell announces it.
    announce_staged: bool,
}

impl Credits {
    /// Credits of a connection with `recv_depth` receives (its ring, or
    /// its share of the SRQ): an update goes out once a quarter of them,
    /// and at least two, went unannounced. Never for one alone: a peer's
    /// credit update consumes one of our receives, and an update of ours
    /// for that one would consume one of the peer's, which would answer
    /// it, for good. (With fewer than three receives it is one: then the
    /// reserved one is all a sender has.)
    pub(crate) fn new(recv_depth: u32) -> Self {
        Self {
            peer_posted: 0,
            consumed: 0,
            posted: 0,
            advertised: 0,
            received: 0,
            threshold: (recv_depth / 4)
                .max(2)
                .min(recv_depth.saturating_sub(1))
                .max(1),
            announce_staged: false,
        }
    }

    /// Credits available for RECV-consuming requests (negative before the
    /// peer's first update, once a first credit update went out).
    #[inline]
    pub(crate) fn available(&self) -> i32 {
        self.peer_posted.wrapping_sub(self.consumed) as i32
    }

    /// Whether a request may consume a peer receive: one credit stays
    /// reserved for credit updates, so a busy sender can always tell its
    /// peer that it may send again.
    #[inline(always)]
    pub(crate) fn can_spend_on_request(&self) -> bool {
        self.available() >= 2
    }

    /// Applies a receive count the peer sent (30 bits of its cumulative
    /// count, from a SEND's immediate), rebuilt to the full count from the
    /// one we know ([`send_imm::advance`]). Returns whether the peer has
    /// granted anything yet.
    #[inline]
    pub(crate) fn apply_peer_count(&mut self, count: u32) -> bool {
        self.peer_posted = send_imm::advance(self.peer_posted, count);
        self.peer_posted != 0
    }

    /// Counts a receive the peer consumed on this QP (a SEND, a
    /// WRITE_WITH_IMM or a credit update). Returns false if it goes beyond
    /// what the peer was granted: a peer that ignores its credits.
    ///
    /// The grant is `advertised`, the highest receive count we put on the
    /// wire, in a SEND's immediate (a message or a credit update): every
    /// count is cumulative, so updates that cross each other or arrive late
    /// only leave the peer with less, and a peer that keeps to its credits
    /// (it posts a RECV-consuming request only while the count it last
    /// heard exceeds what it has consumed) never gets past it. Receives the
    /// handler holds or forwards are not reposted, so they do not raise the
    /// count until they come back. One add and one compare per receive.
    ///
    /// Called in completion order, so the first receive beyond the grant
    /// is found by the pass that polls it, and the caller fails the
    /// connection there: the peer's later receives are neither counted nor
    /// delivered. With an SRQ, a peer takes at most `srq_depth` receives
    /// beyond its grant before that (see `ReactorConfig::srq_depth`).
    #[inline]
    pub(crate) fn count_receive(&mut self) -> bool {
        self.received = self.received.wrapping_add(1);
        self.advertised.wrapping_sub(self.received) as i32 >= 0
    }

    /// Everything the peer was granted so far (the highest count announced).
    #[cfg(test)]
    pub(crate) fn granted(&self) -> u32 {
        self.advertised
    }

    /// The error that cuts off a peer that consumed more receives than it
    /// was granted (see [`count_receive`](Self::count_receive)) on QP
    /// `qpn` with a share of `share` receives: `consumed` is one past
    /// `granted`, the receive that overran. What it took beyond, on an
    /// SRQ, is bounded by `ReactorConfig::srq_depth`.
    #[cold]
    pub(crate) fn overrun_error(&self, qpn: u32, share: u32) -> Error {
        Error::CreditOverrun {
            qpn,
            // The reactor names the peer when it hands the error over.
            peer: None,
            granted: self.advertised,
            consumed: self.received,
            share,
        }
    }

    /// Receives the peer consumed so far.
    #[cfg(test)]
    pub(crate) fn received(&self) -> u32 {
        self.received
    }

    /// Receives posted and not yet consumed.
    #[cfg(test)]
    pub(crate) fn outstanding(&self) -> u32 {
        self.posted.wrapping_sub(self.received)
    }

    /// Counts `count` more receives posted (or, with an SRQ, granted from
    /// the connection's share).
    #[inline]
    pub(crate) fn add_posted(&mut self, count: u32) {
        self.posted = self.posted.wrapping_add(count);
    }

    /// Enough receives went unannounced to owe the peer an update.
    #[inline]
    pub(crate) fn update_due(&self) -> bool {
        self.posted.wrapping_sub(self.advertised) >= self.threshold
    }

    /// The immediate of a SEND of `kind` (a message), which consumes a
    /// peer receive and announces our count with the doorbell that
    /// carries it.
    #[inline]
    pub(crate) fn spend_on_send(&mut self, kind: u32) -> u32 {
        self.consumed = self.consumed.wrapping_add(1);
        self.announce_staged = true;
        send_imm::encode(kind, self.posted)
    }

    /// A request that consumes a peer receive and announces nothing (a
    /// WRITE_WITH_IMM).
    #[inline]
    pub(crate) fn spend(&mut self) {
        self.consumed = self.consumed.wrapping_add(1);
    }

    /// The immediate of a credit update, which consumes a peer receive and
    /// announces our count at once.
    #[inline]
    pub(crate) fn spend_on_update(&mut self) -> u32 {
        self.consumed = self.consumed.wrapping_add(1);
        self.advertised = self.posted;
        send_imm::encode(send_imm::CREDIT, self.posted)
    }

    /// Before the doorbell: the count the staged SENDs carry (stamped when
    /// they were staged; no receive is posted in between) is announced.
    /// Returns whether none does and an update of its own is due.
    #[inline]
    pub(crate) fn before_doorbell(&mut self) -> bool {
        if self.announce_staged {
            self.advertised = self.posted;
            self.announce_staged = false;
            return false;
        }
        self.update_due()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Credits after the peer announced `peer` receives.
    fn granted_by_peer(peer: u32) -> Credits {
        let mut credits = Credits::new(16);
        credits.apply_peer_count(peer);
        credits
    }

    #[test]
    fn the_first_count_from_the_peer_opens_the_connection() {
        let mut credits = Credits::new(16);
        assert_eq!(credits.available(), 0);
        assert!(!credits.apply_peer_count(0), "a count of 0 grants nothing");
        assert!(credits.apply_peer_count(8));
        assert_eq!(credits.available(), 8);
    }

    #[test]
    fn every_spent_credit_is_counted_once() {
        let mut credits = granted_by_peer(4);
        let imm = credits.spend_on_send(send_imm::MESSAGE);
        assert_eq!(imm >> send_imm::COUNT_BITS, send_imm::MESSAGE);
        credits.spend();
        let update = credits.spend_on_update();
        assert_eq!(update >> send_imm::COUNT_BITS, send_imm::CREDIT);
        assert_eq!(credits.available(), 1);
        // A late, smaller count from the peer takes nothing back.
        credits.apply_peer_count(2);
        assert_eq!(credits.available(), 1);
        credits.apply_peer_count(10);
        assert_eq!(credits.available(), 7);
    }

    #[test]
    fn a_peer_is_cut_off_at_its_first_receive_beyond_the_grant() {
        let mut credits = Credits::new(16);
        credits.add_posted(3);
        assert!(!credits.count_receive(), "nothing announced yet");
        let mut credits = Credits::new(16);
        credits.add_posted(3);
        credits.spend_on_update();
        assert_eq!(credits.granted(), 3);
        assert!(credits.count_receive());
        assert!(credits.count_receive());
        assert!(credits.count_receive());
        assert!(!credits.count_receive(), "the fourth of a grant of 3");
        assert_eq!(credits.received(), 4);
    }

    #[test]
    fn the_grant_holds_across_the_wrap_of_the_counts() {
        let mut credits = Credits::new(16);
        credits.add_posted(u32::MAX - 1);
        credits.spend_on_update();
        // Far too many receives to count one by one: jump to the last two.
        credits.received = u32::MAX - 2;
        assert!(credits.count_receive(), "MAX - 1 of a grant of MAX - 1");
        assert!(!credits.count_receive(), "one beyond");
        credits.add_posted(4);
        credits.spend_on_update();
        assert_eq!(credits.granted(), 2, "wrapped");
        assert!(
            credits.count_receive(),
            "inside the new grant, across the wrap"
        );
    }

    #[test]
    fn a_staged_send_announces_the_count_and_spares_an_update() {
        let mut credits = granted_by_peer(8);
        credits.add_posted(4);
        assert!(credits.update_due(), "4 unannounced of a threshold of 4");
        credits.spend_on_send(send_imm::MESSAGE);
        assert!(!credits.before_doorbell(), "the SEND carries the count");
        assert_eq!(credits.granted(), 4);
        assert!(!credits.update_due());
        credits.add_posted(3);
        assert!(!credits.before_doorbell(), "3 below the threshold");
        credits.add_posted(1);
        assert!(
            credits.before_doorbell(),
            "no SEND staged: an update is due"
        );
        assert_eq!(credits.granted(), 4, "only the update announces");
        assert_eq!(credits.outstanding(), 8);
    }
}
