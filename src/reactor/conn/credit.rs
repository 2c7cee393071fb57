//! Credits: how many receives the peer has posted for us, and telling the
//! peer how many we have posted (in SEND headers, or a zero-length
//! SEND_WITH_IMM when there is nothing to send).

use crate::error::Error;
use crate::verbs::{SendDescriptor, Sge};

use super::staging::{OpKind, SqOp};
use super::{Conn, ConnState};

impl Conn {
    /// Credits available for RECV-consuming requests (may be negative before
    /// the peer's first update).
    #[inline]
    pub(super) fn credits(&self) -> i32 {
        self.peer_posted.wrapping_sub(self.consumed) as i32
    }

    /// Applies a credit value the peer sent (in a header or an immediate).
    /// Returns true if this is the first one (the connection is now usable).
    #[inline]
    pub(crate) fn peer_credit(&mut self, total: u32) -> bool {
        if total.wrapping_sub(self.peer_posted) as i32 > 0 {
            self.peer_posted = total;
        }
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
    /// wire, in a SEND header or a credit update: every count is cumulative,
    /// so updates that cross each other or arrive late only leave the peer
    /// with less, and a peer that keeps to its credits (it posts a
    /// RECV-consuming request only while the count it last heard exceeds
    /// what it has consumed) never gets past it. Receives the handler holds
    /// or forwards are not reposted, so they do not raise the count until
    /// they come back. One add and one compare per receive.
    #[inline]
    pub(crate) fn count_receive(&mut self) -> bool {
        self.received = self.received.wrapping_add(1);
        self.advertised.wrapping_sub(self.received) as i32 >= 0
    }

    /// The error that cuts off a peer that consumed more receives than it
    /// was granted (see [`count_receive`](Self::count_receive)).
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
            self.reposts_due() || !self.is_quiet()
        }
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
        let request = SendDescriptor::send(Sge::default(), Some(self.posted));
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
