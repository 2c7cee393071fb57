//! Credits: how many receives the peer has posted for us, and telling the
//! peer how many we have posted (in the immediate of every SEND, or of a
//! zero-length one when there is nothing to send); and the grant a peer
//! must keep to: its first receive beyond it cuts it off (see
//! [`Conn::count_receive`] and, for how many SRQ receives such a peer can
//! take before, and for how long, `ReactorConfig::srq_depth`).

use crate::error::Error;
use crate::verbs::{SendDescriptor, Sge};

use super::super::idle::Spell;
use super::staging::{OpKind, SqOp};
use super::{Conn, ConnState};

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

/// A SEND that arrived, decoded (`Conn::recv_message`).
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

impl Conn {
    /// Credits available for RECV-consuming requests (may be negative before
    /// the peer's first update).
    #[inline]
    pub(super) fn credits(&self) -> i32 {
        self.peer_posted.wrapping_sub(self.consumed) as i32
    }

    /// Applies a receive count the peer sent (30 bits of its cumulative
    /// count, from a SEND's immediate). Returns true if this is the first
    /// one (the connection is now usable).
    ///
    /// The full count is rebuilt from the one we know
    /// ([`send_imm::advance`]).
    #[inline]
    pub(crate) fn peer_credit(&mut self, count: u32) -> bool {
        self.peer_posted = send_imm::advance(self.peer_posted, count);
        if self.state == ConnState::Connecting && self.peer_posted != 0 {
            self.state = ConnState::Established;
            return true;
        }
        false
    }

    /// Counts a receive the peer consumed on this QP (a SEND, a
    /// WRITE_WITH_IMM or a credit update). Returns false if it goes beyond
    /// what the peer was granted: a peer that ignores its credits.
    ///
    /// The grant is `advertised`, the highest receive count we put on the
    /// wire, in a SEND's immediate (a message or a credit update): every count is cumulative,
    /// so updates that cross each other or arrive late only leave the peer
    /// with less, and a peer that keeps to its credits (it posts a
    /// RECV-consuming request only while the count it last heard exceeds
    /// what it has consumed) never gets past it. Receives the handler holds
    /// or forwards are not reposted, so they do not raise the count until
    /// they come back. One add and one compare per receive.
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

    /// The error that cuts off a peer that consumed more receives than it
    /// was granted (see [`count_receive`](Self::count_receive)): `consumed`
    /// is one past `granted`, the receive that overran. What it took
    /// beyond, on an SRQ, is bounded by `ReactorConfig::srq_depth`.
    #[cold]
    pub(crate) fn overrun_error(&self) -> Error {
        Error::CreditOverrun {
            qpn: self.qpn,
            // The reactor names the peer when it hands the error over.
            peer: None,
            granted: self.advertised,
            consumed: self.received,
            share: self.recv_depth,
        }
    }

    /// What an open connection has left after a flush: work any pass
    /// must do ([`is_unsettled`](Self::is_unsettled)), receives waiting
    /// for a fuller batch, an unsignaled tail.
    #[inline]
    pub(crate) fn leftovers(&self) -> (bool, bool, bool) {
        (
            self.is_unsettled(),
            self.has_pending_reposts(),
            self.has_unsignaled_tail(),
        )
    }

    /// Nothing staged and no credit update due (reposts may be pending).
    #[inline]
    pub(crate) fn is_quiet(&self) -> bool {
        self.batch.is_empty() && self.posted.wrapping_sub(self.advertised) < self.credit_threshold
    }

    /// Something the next flush has to do even on an idle pass: reposts that
    /// are due, staged work or a due credit update (for a closed connection:
    /// SRQ slots to give back). Fewer receives than a batch wait for a
    /// fuller batch or a longer idle spell.
    #[inline]
    pub(crate) fn is_unsettled(&self) -> bool {
        if self.is_closed() {
            self.owes_shared_slots()
        } else {
            self.open_leftovers().0
        }
    }

    /// As [`leftovers`](Self::leftovers), for a connection the caller knows
    /// is open (the flush, right after its doorbell).
    #[inline]
    pub(crate) fn open_leftovers(&self) -> (bool, bool, bool) {
        (
            self.reposts_due() || !self.is_quiet(),
            self.has_pending_reposts(),
            self.has_unsignaled_tail(),
        )
    }

    /// Before the doorbell: notes that the staged SENDs announce our receive
    /// count (stamped when they were staged), or stages an explicit credit
    /// update if none does and enough receives went unannounced.
    #[inline]
    pub(crate) fn prepare_flush(&mut self) {
        if self.has_staged_send {
            self.advertised = self.posted;
            self.has_staged_send = false;
        } else if self.posted.wrapping_sub(self.advertised) >= self.credit_threshold
            && self.can_stage_update()
        {
            self.stage_credit_update(false);
        }
    }

    /// Whether traffic on this connection counts as sparse, so a flush
    /// signals the last request it posts (see [`Spell::is_sparse`]).
    #[inline]
    pub(in crate::reactor) fn is_sparse(&self, spell: Spell) -> bool {
        spell.is_sparse(self.posted_after_spell)
    }

    /// Notes a doorbell rung on sparse traffic in `spell` (see
    /// [`Spell::mark`]).
    #[inline]
    pub(in crate::reactor) fn note_sparse_post(&mut self, spell: Spell) {
        self.posted_after_spell = spell.mark();
    }

    /// True if requests went out unsignaled since the last signaled one: their
    /// completions are only reported once a later signaled request completes.
    pub(crate) fn has_unsignaled_tail(&self) -> bool {
        self.since_signal > 0 && self.state == ConnState::Established
    }

    /// Makes the unsignaled tail complete: a signaled credit update (the one
    /// request that needs no payload and only the reserved credit). Skipped
    /// without a credit; the peer's next update brings one.
    pub(crate) fn stage_tail_signal(&mut self) {
        if self.can_stage_update() {
            self.stage_credit_update(true);
        }
    }

    /// Sends the first credit update; allowed before any credit is known
    /// because our receive ring is posted and the peer retries on RNR.
    pub(crate) fn stage_initial_update(&mut self) {
        self.stage_credit_update(false);
    }

    /// Answers the first credit the peer sent with one more update of ours.
    /// The peer may have missed our initial one: through a shared receive
    /// queue, an update that arrives before the peer's reactor took its QP
    /// is a stranger's completion there and is dropped, and a peer that
    /// then never sends would stay connecting for good. The peer has its
    /// QP by now (it sent this), so this one reaches it. Skipped without a
    /// credit (then our next SEND announces the count anyway).
    pub(crate) fn answer_first_credit(&mut self) {
        if self.can_stage_update() {
            self.stage_credit_update(false);
        }
    }

    /// Room for a credit update: the reserved credit, an SQ entry, a batch slot.
    fn can_stage_update(&self) -> bool {
        self.credits() >= 1 && self.sq_used() < self.sq_depth && !self.batch.is_full()
    }

    /// Stages a zero-length SEND_WITH_IMM whose immediate is our receive count.
    fn stage_credit_update(&mut self, force_signal: bool) {
        // An update that spends the last credit must be signaled: without a
        // credit no later request can signal out the tail, and the peer may
        // owe us no update (it announces only every `credit_threshold`), so
        // unsignaled sends before it would never report completion.
        let last_credit = self.credits() <= 1;
        let imm = send_imm::encode(send_imm::CREDIT, self.posted);
        let request = SendDescriptor::send(Sge::default(), Some(imm));
        self.consumed = self.consumed.wrapping_add(1);
        self.advertised = self.posted;
        self.stage_signaled(
            request,
            SqOp::of(OpKind::Credit),
            None,
            force_signal || last_credit,
        );
    }
}
