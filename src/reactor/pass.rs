//! The pass engine: poll every CQ, route each completion to its connection
//! and handler (`dispatch`), then flush (`flush`: one doorbell per QP with
//! staged work, receive reposts off the latency path), and now and then
//! watch the peers (`peer_watch`); in the event modes, arm the CQs and
//! sleep.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::error::Result;

use super::completions::{POLL_BATCH, SpinsSettled};
use super::srq_pool::SrqPool;
use super::{EventMode, Handler, Idle, PeerLink, Reactor};

/// Longest sleep while SRQ receives wait to be posted again after a
/// refused post.
pub(super) const SRQ_RETRY: Duration = Duration::from_millis(1);
impl<H: Handler, L: PeerLink> Reactor<H, L> {
    /// One pass, then (in the event modes, if it found nothing) one wait.
    /// Returns the completions handled, those of the re-poll after arming
    /// included.
    pub fn turn(&mut self) -> Result<usize> {
        let mut done = self.one_pass()?;
        if done == 0 && self.config.event_mode != EventMode::BusyPoll {
            done = self.arm_and_poll()?;
            if done == 0 {
                self.wait()?;
            }
        }
        Ok(done)
    }

    /// Sleeps until a completion, a peer event (a watched control
    /// connection, see [`PeerLink::event_fd`]), a [`Waker`](super::Waker)
    /// or the idle timeout, then consumes the completion events and looks
    /// at the peers whose connection woke it. Only after
    /// [`prepare_wait`](Self::prepare_wait) said nothing is pending: for
    /// the runtime's loop, which checks other work between arming and
    /// sleeping. Returns at once in busy-poll mode.
    pub(crate) fn wait(&mut self) -> Result<()> {
        if self.config.event_mode == EventMode::BusyPoll {
            return Ok(());
        }
        let timeout = self.sleep_limit();
        if !timeout.is_zero() {
            self.counters.sleeps += 1;
        }
        self.take_wake(timeout)
    }

    /// Waits up to `timeout` (zero: only looks), then takes what woke the
    /// reactor: the completion events, a [`Waker`](super::Waker)'s wake,
    /// and the peers whose control connection fired, which it looks at.
    fn take_wake(&mut self, timeout: Duration) -> Result<()> {
        self.waiter.wait(timeout, &mut self.fired)?;
        self.completions.drain_events()?;
        if !self.fired.is_empty() {
            self.check_fired_peers();
        }
        if self.recheck_at.is_some_and(|at| Instant::now() >= at) {
            self.check_peers();
        }
        Ok(())
    }

    /// How long [`wait`](Self::wait) may sleep: the idle timeout, or less
    /// when a peer's partial control frame must be looked at again, or SRQ
    /// receives a refused post left behind must be tried again (nothing
    /// else wakes the reactor for them, and the peers' SENDs may be
    /// waiting for exactly those receives). Not at all while a removal
    /// waits: one asked for after a pass's last removals (by a handler
    /// told of a connection that pass's late flush failed) is the next
    /// pass's, and the receives it hands back must not wait for the idle
    /// timeout. Nor while datagrams wait for their doorbell, or handlers
    /// to be told that room is back.
    pub(crate) fn sleep_limit(&self) -> Duration {
        // Datagrams staged after the pass's flush (by a handler told its
        // endpoint failed, say) go out with the next pass, not after a sleep.
        if !self.deferred.removals.is_empty()
            || self.datagrams.has_work(false)
            || self.conns.has_room_news()
        {
            return Duration::ZERO;
        }
        let mut timeout = self.config.idle_timeout;
        if let Some(at) = self.recheck_at {
            timeout = timeout.min(at.saturating_duration_since(Instant::now()));
        }
        if self.srq.as_ref().is_some_and(SrqPool::has_unposted) {
            timeout = timeout.min(SRQ_RETRY);
        }
        timeout
    }

    /// Polls every CQ once (in batches), dispatches, then flushes: reposts
    /// receives and rings one doorbell per QP with staged work. Calls
    /// `on_idle` when nothing completed, watches the peers when their
    /// interval is up, and removes the sessions callbacks asked to remove.
    /// After [`prepare_wait`](Self::prepare_wait) it first takes what
    /// woke the caller: the completion events, a [`Waker`](super::Waker)'s
    /// wake, and the peers whose control connection fired (in the Epoll
    /// mode, whose set holds them), without waiting. Returns the
    /// completions handled.
    #[inline]
    pub fn poll_once(&mut self) -> Result<usize> {
        if self.completions.is_armed() {
            self.take_wake(Duration::ZERO)?;
        }
        self.one_pass()
    }

    /// One pass of the kind the connections need.
    #[inline]
    pub(super) fn one_pass(&mut self) -> Result<usize> {
        if self.full_pass_parts != 0 {
            self.full_pass()
        } else {
            self.lean_pass()
        }
    }

    /// [`run`](Self::run) in busy-poll mode, where a turn is a pass: the
    /// passes run in a loop inside one call per kind of pass, so a pass
    /// pays no call's entry and exit, and what it keeps in registers or
    /// on the stack across completions is set up once. Returns when
    /// stopped.
    pub(super) fn busy_run(&mut self) -> Result<()> {
        while !self.stop.load(Ordering::Acquire) {
            if self.full_pass_parts != 0 {
                self.passes::<false>()?;
            } else {
                self.passes::<true>()?;
            }
        }
        Ok(())
    }

    /// Passes of one kind until stopped or until the other kind is
    /// needed: lean ones while the reactor serves only direct
    /// connections, full ones while it serves connections of its own
    /// protocol.
    #[inline(never)]
    fn passes<const LEAN: bool>(&mut self) -> Result<()> {
        loop {
            self.pass::<LEAN>()?;
            if (self.full_pass_parts == 0) != LEAN || self.stop.load(Ordering::Acquire) {
                return Ok(());
            }
        }
    }

    /// A pass of a reactor that serves connections of its own protocol:
    /// their dispatch and the flush inlined.
    #[inline(never)]
    fn full_pass(&mut self) -> Result<usize> {
        self.pass::<false>()
    }

    /// A pass of a reactor that serves only direct connections.
    #[inline(never)]
    fn lean_pass(&mut self) -> Result<usize> {
        self.pass::<true>()
    }

    /// One pass. `LEAN` (no connection of the reactor's own protocol, so
    /// a completion is a direct connection's, or a stranger's): the pass
    /// stays short, and the dispatch of any other completion and the
    /// chores after the pass, when there are any, are calls of their own;
    /// inlined, their code would weigh on every pass's registers
    /// (`tools/instr-count --host`, the direct rows, guards it). Both
    /// variants do the same; only their cost differs.
    #[inline(always)]
    fn pass<const LEAN: bool>(&mut self) -> Result<usize> {
        // Connections removed before this pass: their QPs are destroyed, so
        // once every CQ has been polled empty below, no completion naming
        // them is left and their slab entries can take newcomers.
        let settled = self.conns.quarantined();
        let mut done = 0;
        for cq in 0..self.completions.cq_count() {
            loop {
                let n = self.completions.poll(cq)?;
                if !LEAN && n != 0 && done == 0 {
                    // Before the routing: the flush of the connection it
                    // leaves due asks whether traffic is sparse.
                    self.idle.found_completions();
                }
                for at in 0..n {
                    self.route::<LEAN>(at);
                }
                done += n;
                if n < POLL_BATCH {
                    break;
                }
            }
        }
        // Counted once every CQ is polled: what a QP removed before this
        // pass left on them is gone, and its CQ room can be handed out
        // (a pass a failed poll or a panic cut short does not count).
        self.counters.passes += 1;
        // The connection the completions left work (most passes' only
        // one), flushed without the walk of the touched list. (A lean pass
        // has no connection of the reactor's protocol to leave any.)
        if !LEAN && let Some(index) = self.conns.take_due() {
            self.flush_one(index);
        }
        if !LEAN && settled > 0 {
            self.conns.release_quarantine(settled);
        }
        self.counters.completions += done as u64;
        let touched = if done == 0 {
            let touched = self.empty_pass::<LEAN>();
            // A handler spun on the CQs the pass lent it (`Ctx::spin`;
            // only a lean pass lends them).
            if LEAN && self.completions.has_spun() {
                done = self.settle_spin::<LEAN>()?;
                self.counters.completions += done as u64;
                if done != 0 {
                    // Not an empty pass after all.
                    self.counters.empty_passes -= 1;
                    self.idle.found_completions();
                }
            }
            touched
        } else {
            if LEAN {
                self.idle.found_completions();
            }
            false
        };
        if !LEAN {
            // The peer timer is read after the flush (`chores`): read here,
            // it makes the protocol's pass dearer (`tools/instr-count --host`).
            self.chores(0, touched, None, done);
            return Ok(done);
        }
        let peers_due = match &mut self.peer_timer {
            Some(timer) => timer.expired_after(done),
            None => false,
        };
        if settled > 0 || touched || peers_due || self.has_chores() {
            self.chores_apart(settled, touched, peers_due);
        }
        Ok(done)
    }

    /// Whether the end of a pass has work besides a released quarantine,
    /// an idle callback's staging and the peer watch: what the last flush
    /// left, what callbacks deferred, a connection listed for the flush.
    #[inline(always)]
    fn has_chores(&self) -> bool {
        self.idle.owes_flush()
            || self.conns.has_touched()
            || !self.deferred.srq_returns.is_empty()
            || !self.deferred.removals.is_empty()
    }

    /// A pass found nothing: `on_idle` of the handlers that asked for it
    /// ([`Idle::Again`], and newcomers), the others costing nothing.
    /// Returns whether a callback may have staged work. A lean pass (no
    /// connection of the reactor's own protocol, whose tails and reposts
    /// count idle passes) lends each handler the CQs for a spin on its own
    /// connections.
    #[inline(always)]
    fn empty_pass<const LEAN: bool>(&mut self) -> bool {
        self.counters.empty_passes += 1;
        self.idle.found_none();
        let mut ctx = reactor_ctx!(self);
        if LEAN {
            self.completions.begin_loans();
            ctx.loan = Some(&mut self.completions);
        }
        let mut at = 0;
        while let Some((id, handler)) = self.sessions.idle_at(at) {
            if let Some(loan) = ctx.loan.as_deref_mut() {
                loan.lend_to(id);
            }
            match handler.on_idle(&mut ctx) {
                Idle::Again => at += 1,
                Idle::Done => self.sessions.idle_done(at),
            }
        }
        if !LEAN {
            let mut at = 0;
            while let Some(handler) = self.datagram_handlers.idle_at(at) {
                match handler.on_idle(&mut ctx) {
                    Idle::Again => at += 1,
                    Idle::Done => self.datagram_handlers.idle_done(at),
                }
            }
        }
        ctx.touched
    }

    /// After idle callbacks that spun: the completions a spin polled and
    /// did not hand over are routed as any pass's, in order (through
    /// `wcs`, which holds nothing then: the pass polled nothing); what the
    /// spins spent counts as passes for the peer watch (a poll or a
    /// completion each costs about an empty pass). Returns the completions the spins polled, or the
    /// error of a CQ poll a spin made (after routing what it left).
    #[cold]
    #[inline(never)]
    fn settle_spin<const LEAN: bool>(&mut self) -> Result<usize> {
        let SpinsSettled {
            left,
            taken,
            used,
            failed,
        } = self.completions.settle_spins();
        for at in 0..left {
            self.route::<LEAN>(at);
        }
        if let Some(timer) = &mut self.peer_timer {
            timer.count_passes(used);
        }
        match failed {
            Some(error) => Err(error),
            None => Ok(taken + left),
        }
    }

    /// [`chores`](Self::chores) as a call of its own.
    #[inline(never)]
    fn chores_apart(&mut self, settled: usize, touched: bool, peers_due: bool) {
        self.chores(settled, touched, Some(peers_due), 0);
    }

    /// The end of a pass: quarantined entries released, the flush, the
    /// peer watch, removals. `peers_due`: whether the peer timer expired,
    /// or `None` to ask it here with the pass's `done`.
    #[inline(always)]
    fn chores(&mut self, settled: usize, touched: bool, peers_due: Option<bool>, done: usize) {
        if settled > 0 {
            self.conns.release_quarantine(settled);
        }
        // What the dispatch changed is on the touched list (a connection of
        // the reactor's protocol lists itself with a receive's completion,
        // and with what its handler stages), in the idle policy or in the SRQ
        // returns; a retired send and a direct connection's completions
        // leave the flush nothing to do.
        let touched = touched || !self.deferred.srq_returns.is_empty();
        // Unsignaled requests left at the tail of a burst would never report
        // completion: after a while with nothing to do, signal them out.
        let signal_tails = self.idle.signal_tails_now();
        let tidy = self.idle.repost_now();
        // An idle pass that staged nothing, after a flush that left nothing
        // behind, has nothing to flush: skipping the walk over the
        // connections keeps empty passes, and so the time to notice the next
        // completion, short. Receives waiting for a fuller batch do not count
        // until the reactor has been idle for a while.
        if touched || self.idle.is_unsettled() || tidy || signal_tails || self.conns.has_touched() {
            self.flush(tidy, signal_tails);
        }
        // Handlers told that room is back (the flush found it so) stage
        // their backlog, which goes out now.
        if self.conns.has_room_news() && self.tell_room() {
            self.flush(false, false);
        }
        // The datagram endpoints' doorbells, and once the reactor has been
        // idle a while their reposts below a batch.
        let datagram_tidy = self.idle.idle_for_reposts();
        if self.datagrams.has_work(datagram_tidy) {
            self.flush_datagrams(datagram_tidy);
        }
        // Here rather than in `turn`, so a loop of the user's own that calls
        // `poll_once` gets them too.
        let mut late = false;
        let peers_due = peers_due.unwrap_or_else(|| {
            self.peer_timer
                .as_mut()
                .is_some_and(|timer| timer.expired_after(done))
        });
        if peers_due {
            late = self.check_peers();
        }
        if !self.deferred.removals.is_empty() {
            self.apply_removals();
            late = true;
        }
        // Peer checks and removals come after this pass's flush, and may
        // hand a connection receives to repost (a relay removed with
        // forwards in flight gives its origin their slots back): they go
        // out now, not with a pass that a reactor about to sleep may not
        // make for a long time.
        if late && (self.idle.is_unsettled() || self.conns.has_touched()) {
            self.flush(true, false);
        }
        // Datagrams the late callbacks staged.
        if late && self.datagrams.has_work(false) {
            self.flush_datagrams(false);
        }
    }

    /// Arms every CQ and polls once more, for a caller's own event loop
    /// that sleeps on [`event_fd`](Self::event_fd): `Some(limit)` if
    /// nothing is pending, and the caller may sleep for at most `limit`
    /// before its next [`poll_once`](Self::poll_once) without missing a
    /// completion that raced the arming or work the reactor owes (see
    /// [`Reactor::event_fd`]); `None` if the reactor has work now, and
    /// always in busy-poll mode.
    pub fn prepare_wait(&mut self) -> Result<Option<Duration>> {
        if self.config.event_mode == EventMode::BusyPoll || self.arm_and_poll()? != 0 {
            return Ok(None);
        }
        Ok(Some(self.sleep_limit()))
    }

    /// Arms every CQ, then polls once more; returns what that pass handled.
    fn arm_and_poll(&mut self) -> Result<usize> {
        self.settle_for_sleep();
        self.completions.arm()?;
        self.pass_after_arming()
    }

    /// Before arming the CQs: nothing left that only a later pass would
    /// post. Sleeping with an unsignaled tail would leave its completions
    /// unreported: it is signaled out first. Its completion (or, without a
    /// credit, the peer's next credit update) then wakes us.
    pub(super) fn settle_for_sleep(&mut self) {
        self.flush(true, true);
        if self.datagrams.has_work(true) {
            self.flush_datagrams(true);
        }
        self.idle.armed_for_sleep();
    }

    /// The pass after arming, which finds what raced the arming; returns
    /// what it handled.
    pub(super) fn pass_after_arming(&mut self) -> Result<usize> {
        let done = self.one_pass()?;
        if done != 0 {
            return Ok(done);
        }
        // That pass's idle callbacks may have released receives (fewer
        // than a batch are only parked) and its flush credited SRQ slots
        // a refused post had left, after its doorbells: a peer waiting for
        // those credits would wait for as long as the reactor sleeps. The
        // first idle flush reposts them, the second announces what the
        // first counted. (Bounded: work that cannot go out, a credit
        // update without a credit say, waits for the completion that
        // makes room, which wakes the armed CQs as what these post does.)
        for _ in 0..2 {
            if !self.conns.has_touched() && !self.idle.owes_flush() {
                break;
            }
            self.flush(true, true);
        }
        Ok(done)
    }

    /// Removes the sessions callbacks asked to remove.
    #[cold]
    fn apply_removals(&mut self) {
        let removals = std::mem::take(&mut self.deferred.removals);
        for &session in &removals {
            self.remove(session);
        }
        // Keep the allocation for next time.
        self.deferred.removals = removals;
        self.deferred.removals.clear();
    }
}
