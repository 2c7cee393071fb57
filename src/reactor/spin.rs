//! Spinning on a direct connection: the reactor lends its CQs to one
//! handler, from `on_idle`, for a loop of the handler's own that posts and
//! polls with nothing of the reactor's in between ([`Ctx::spin`]). That is
//! perftest's loop inside the reactor's ownership: the completions the
//! handler gets are vetted as the dispatch vets them (its connection's
//! tags, its QP number, a success), and the first completion that is
//! anything else ends the spin and stays where the reactor routes it as it
//! routes every completion, so a stranger's, another connection's or a
//! failed one never reaches the spinning handler.
//!
//! A spin is bounded: the spins of one pass make at most `SPIN_POLLS`
//! polls and completions, and a spin ends when the reactor is asked to
//! stop (seen at its next poll that finds nothing) or at that first
//! completion it may not hand over; the reactor then finishes its pass
//! (the completions left, the peer watch with what the spin spent counted
//! as passes, removals) and the next idle pass may lend the CQs again. A handler that panics inside a spin (or in an idle callback
//! after one) loses what the spin polled and did not hand over, as a panic
//! in any callback loses the rest of its pass's batch: nothing is told
//! twice, late, or for a connection removed since. Only a reactor with no
//! connection of its own protocol lends its CQs (their tails and reposts
//! count idle passes, which a spin would take), and only to the session
//! whose connection spins.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::verbs::{PollFailed, WorkCompletion};

use super::completions::Completions;
use super::direct::{DirectQp, direct_conn};
use super::{ConnId, Ctx, SendError};

/// Bits of a `wr_id` that the reactor writes on a direct connection's
/// requests (its tags); the low half is the handler's.
const TAG_MASK: u64 = !(u32::MAX as u64);

/// What [`Spin::poll`] found.
#[derive(Debug)]
pub enum Spun<'s> {
    /// A successful completion of the spinning connection, with the
    /// handler's id (the low 32 bits of its request's `wr_id`).
    Completion(u32, &'s WorkCompletion),
    /// Nothing completed yet: poll again, or return.
    Empty,
    /// The spin is over: return from `on_idle` (a completion waits for the
    /// reactor, the pass's budget is spent, the reactor is asked to stop,
    /// or a CQ poll failed, which the pass then reports). Every later poll
    /// says so too.
    Ended,
}

/// The reactor's CQs, lent to a direct connection's handler within one
/// `on_idle` call ([`Ctx::spin`]): it posts through [`qp`](Self::qp) and
/// polls through [`poll`](Self::poll), perftest's loop, until the spin
/// ends. Dropping it (at the end of the loop, or unwinding from a panic)
/// leaves the reactor what it polled and did not hand over.
pub struct Spin<'s> {
    qp: DirectQp<'s>,
    completions: &'s mut Completions,
    stop: &'s AtomicBool,
    /// `spin_wcs[next..end]`: polled and not handed over yet (kept here,
    /// and told to `completions` as it changes, so the reactor knows them
    /// even if the spin is forgotten).
    next: usize,
    end: usize,
    /// The connection's CQs, by index (the same for a QP with one CQ).
    send_cq: usize,
    recv_cq: usize,
    qpn: u32,
    /// Polls and completions left before the spin ends (0 once it
    /// ended), and what it gave up unused when it ended early.
    budget: u32,
    unused: u32,
    ended: bool,
}

impl fmt::Debug for Spin<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Spin")
            .field("qpn", &self.qpn)
            .field("budget", &self.budget)
            .field("ended", &self.ended)
            .finish()
    }
}

impl Drop for Spin<'_> {
    fn drop(&mut self) {
        self.completions.spin_returned(self.budget + self.unused);
    }
}

impl Spin<'_> {
    /// Posting on the spinning connection's QP (as [`Ctx::direct`] gives).
    #[inline]
    pub fn qp(&mut self) -> DirectQp<'_> {
        DirectQp {
            qp: &mut *self.qp.qp,
            send_tag: self.qp.send_tag,
            recv_tag: self.qp.recv_tag,
        }
    }

    /// Asks the reactor to stop, as [`Ctx::stop`] does; the spin ends at
    /// its next poll that finds nothing (or when its budget is spent).
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Release);
    }

    /// The next completion of the connection: one the spin polled before
    /// and has not handed over yet, or one polled now from the
    /// connection's CQs (its send CQ first). A completion the spin may not
    /// hand over (another QP's, a removed connection's, a failed one) ends
    /// the spin, and the reactor routes it and every one after it as it
    /// routes all completions once `on_idle` returns.
    #[inline(always)]
    pub fn poll(&mut self) -> Spun<'_> {
        if self.next == self.end && !self.refill() {
            return if self.ended { Spun::Ended } else { Spun::Empty };
        }
        let at = self.next;
        let wc = self.completions.spin_wc(at);
        let top = wc.wr_id() & TAG_MASK;
        if (top == self.qp.send_tag || top == self.qp.recv_tag)
            && wc.qp_num() == self.qpn
            && wc.is_success()
        {
            self.next = at + 1;
            // The reactor's view moves with the handler's: a spin that is
            // forgotten (`mem::forget`) still leaves it the rest.
            self.completions.spin_handed(self.next);
            // Borrowed again for the caller.
            let wc = self.completions.spin_wc(at);
            return Spun::Completion(wc.wr_id() as u32, wc);
        }
        // Not the spin's to hand over: the spin ends, and this completion
        // and the rest of the batch are the reactor's (its view says so
        // already).
        self.ended = true;
        self.unused += self.budget;
        self.budget = 0;
        Spun::Ended
    }

    /// Polls the connection's CQs into the empty buffer; true if it found
    /// any completion, which the reactor is told of at once. Each poll and
    /// each completion it brings costs one of the budget, so a spin is as
    /// long as about that many empty passes, busy or not. Ends the spin
    /// when it may not poll again. (Inlined into the handler's loop with
    /// `poll`, so the loop keeps its state in registers; the spin row of
    /// `tools/instr-count --host` guards it.)
    #[inline(always)]
    fn refill(&mut self) -> bool {
        if self.budget == 0 {
            self.end_spin();
            return false;
        }
        self.budget -= 1;
        let mut n = self.poll_cq(self.send_cq);
        if n == 0 && self.recv_cq != self.send_cq && !self.ended {
            self.budget = self.budget.saturating_sub(1);
            n = self.poll_cq(self.recv_cq);
        }
        if n == 0 {
            // Asked to stop: seen at the next poll that finds nothing (or
            // when the budget is spent), not read on every busy one.
            if self.stop.load(Ordering::Relaxed) {
                self.end_spin();
            }
            return false;
        }
        self.budget = self.budget.saturating_sub(n as u32);
        self.next = 0;
        self.end = n;
        self.completions.spin_polled(n);
        true
    }

    /// Polls CQ `index` into the buffer. A CQ that cannot be polled ends
    /// the spin, and the pass reports the error (a provider may have
    /// dropped what that poll found: the next poll would not say).
    #[inline]
    fn poll_cq(&mut self, index: usize) -> usize {
        match self.completions.spin_poll(index) {
            Ok(n) => n,
            Err(failed) => {
                self.poll_failed(index, failed);
                0
            }
        }
    }

    #[cold]
    #[inline(never)]
    fn poll_failed(&mut self, index: usize, failed: PollFailed) {
        self.end_spin();
        self.completions.spin_poll_failed(index, failed);
    }

    /// No more polls: every later one says [`Spun::Ended`].
    #[inline]
    fn end_spin(&mut self) {
        self.ended = true;
        self.unused += self.budget;
        self.budget = 0;
    }
}

impl Ctx<'_> {
    /// Lends the reactor's CQs to `conn`'s handler for a loop of its own,
    /// from its `on_idle` (where the pass found nothing): it posts on its
    /// direct connection's QP and polls for its completions with nothing
    /// of the reactor's in between, as perftest's loop does. For a
    /// connection that owns its reactor, one pinned session per core. Lent
    /// only by a reactor that serves no connection of its own protocol
    /// (whose unsignaled tails and reposts wait for idle passes), and only
    /// to the session whose connection `conn` is.
    ///
    /// The completions the spin hands over are the connection's own and
    /// successful; the first that is anything else ends the spin and is
    /// the reactor's to route (a failure still reaches `on_error`, once).
    /// A handler that panics inside the spin loses what it polled and did
    /// not hand over, as a panic loses the rest of a pass's batch; one
    /// that forgets its `Spin` (`mem::forget`) loses none (the reactor
    /// routes what it did not hand over, as after a drop) and keeps the
    /// pass's budget spent.
    /// It ends too when the pass's spins spent 16384 polls (a poll or
    /// a completion each) and when the reactor is asked to stop (seen at
    /// the next poll that finds nothing), so the reactor's own work waits
    /// for about that many empty passes' time. (A runtime's stop is seen
    /// between passes: it waits for the spin.) Completions it polled and
    /// did not hand over before it was dropped reach the handler through
    /// [`Handler::on_direct_completion`](super::Handler::on_direct_completion),
    /// in order, once `on_idle` returns.
    ///
    /// # Errors
    /// [`SendError::Invalid`] outside `on_idle`, in a reactor that serves
    /// connections of its own protocol, for one of those connections or
    /// for another session's; [`SendError::Closed`] for a connection that
    /// failed or is gone; [`SendError::WouldBlock`] while an earlier
    /// spin's completions wait for the reactor or once this pass's spins
    /// spent those 16384: until the next idle pass (asking again in a
    /// loop within this `on_idle` never succeeds).
    pub fn spin(&mut self, conn: ConnId) -> Result<Spin<'_>, SendError> {
        let Some(loan) = self.loan.as_mut() else {
            return Err(SendError::Invalid(crate::Error::InvalidArgument(
                "the reactor lends its CQs only in on_idle, when it serves no connection of its own protocol",
            )));
        };
        // One pass's spins share one budget, so the reactor's own work
        // waits for at most that many polls.
        let budget = loan.spin_budget();
        if budget == 0 {
            return Err(SendError::WouldBlock);
        }
        let record = direct_conn(self.conns, conn)?;
        if loan.lent_to() != Some(record.session()) {
            return Err(SendError::Invalid(crate::Error::InvalidArgument(
                "a spin is lent only to the session whose connection it is",
            )));
        }
        let qp = record.direct_qp().ok_or(SendError::Closed)?;
        // `add_direct` took only QPs on these CQs.
        let Some((send_cq, recv_cq)) = loan.cqs_of(qp.qp) else {
            return Err(SendError::Closed);
        };
        // Taken whole now, and what is left given back on drop.
        loan.take_budget(budget);
        Ok(Spin {
            qpn: qp.qpn(),
            qp,
            completions: loan,
            stop: self.stop,
            next: 0,
            end: 0,
            send_cq,
            recv_cq,
            budget,
            unused: 0,
            ended: false,
        })
    }
}
