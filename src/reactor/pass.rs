//! The pass engine: poll every CQ, route each completion to its connection
//! and handler, then flush (`flush`: one doorbell per QP with staged work,
//! receive reposts off the latency path), and now and then watch the
//! peers. Completions that are not the usual go to `failure`.

use std::time::{Duration, Instant};

use crate::error::Result;
use crate::session::PeerStatus;
use crate::verbs::WcOpcode;

use super::admin::return_forwarded;
use super::conn::{
    Arrival, Conn, OpKind, WrKind, decode_direct, decode_wr_id, is_direct, same_generation,
};
use super::slab::Key;
use super::srq_pool::SrqPool;
use super::{Ctx, EventMode, Handler, POLL_BATCH, PeerLink, Reactor, Session, SessionId, Waiter};

/// Longest sleep while SRQ receives wait to be posted again after a
/// refused post.
pub(super) const SRQ_RETRY: Duration = Duration::from_millis(1);
/// Empty busy-poll passes after which unsignaled tails are signaled out.
pub(super) const TAIL_SIGNAL_IDLE_PASSES: u32 = 1024;
/// Empty busy-poll passes after which receives consumed since the last
/// batch are reposted anyway. Not on the first empty pass: in a ping-pong
/// the next message usually lands then, and a pass that is busy posting
/// receives finds it later.
pub(super) const REPOST_IDLE_PASSES: u32 = 8;

/// What a completion brings the handler, once the connection has done
/// its part (credits, reposts, the overrun check).
enum Delivery {
    /// A WRITE_WITH_IMM landed.
    WriteImm { imm: u32, len: u32 },
    /// The peer's first credit: the connection is usable.
    Established,
    /// A message in receive slot `slot` (payload address and length),
    /// maybe with the peer's first credit.
    Message {
        established: bool,
        slot: u32,
        data: (*const u8, usize),
        imm: Option<u32>,
        from_srq: bool,
    },
    /// Signaled send-queue work done: this many ops retire.
    Retired { count: u32 },
}

/// Whose an SRQ receive's completion is.
enum SrqOwner {
    /// This connection's, in this slot.
    Conn(Key, u32),
    /// A QP the reactor does not serve consumed the slot, which went
    /// straight back to the SRQ.
    Reclaimed,
    /// Nothing this reactor posted.
    Foreign,
}

impl<H: Handler, L: PeerLink> Reactor<H, L> {
    /// One pass, then (in the event modes, if it found nothing) one wait.
    /// Returns the completions handled, those of the re-poll after arming
    /// included.
    pub fn turn(&mut self) -> Result<usize> {
        let mut done = self.poll_once()?;
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
    /// at the peers whose connection woke it. Call it only after
    /// [`prepare_wait`](Self::prepare_wait) said nothing is pending: for a
    /// loop of its own that checks other work between arming and sleeping.
    /// Returns at once in busy-poll mode.
    pub fn wait(&mut self) -> Result<()> {
        if self.config.event_mode == EventMode::BusyPoll {
            return Ok(());
        }
        let timeout = self.sleep_limit();
        if !timeout.is_zero() {
            self.counters.sleeps += 1;
        }
        self.waiter.wait(timeout, &mut self.fired)?;
        self.drain_channel_events()?;
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
    /// timeout. A loop of its own that sleeps
    /// on [`event_fd`](Self::event_fd) after
    /// [`prepare_wait`](Self::prepare_wait) sleeps no longer than this
    /// either, then calls [`poll_once`](Self::poll_once).
    pub fn sleep_limit(&self) -> Duration {
        if !self.deferred.removals.is_empty() {
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
    /// Returns the completions handled.
    #[inline]
    pub fn poll_once(&mut self) -> Result<usize> {
        if self.protocol_conns != 0 {
            self.full_pass()
        } else {
            self.lean_pass()
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
    /// inlined, their code weighed on every pass's registers (on the host,
    /// a direct READ round trip's pass and dispatch went from 218 to 176
    /// Ir). Both variants do the same; only their cost differs.
    #[inline(always)]
    fn pass<const LEAN: bool>(&mut self) -> Result<usize> {
        // Connections removed before this pass: their QPs are destroyed, so
        // once every CQ has been polled empty below, no completion naming
        // them is left and their slab entries can take newcomers.
        let settled = self.conns.quarantined();
        self.counters.passes += 1;
        let mut done = 0;
        for cq_index in 0..self.cqs.len() {
            loop {
                let n = self.cqs[cq_index].poll(&mut self.wcs)?.len();
                for at in 0..n {
                    self.route::<LEAN>(at);
                }
                done += n;
                if n < POLL_BATCH {
                    break;
                }
            }
        }
        if !LEAN && settled > 0 {
            self.conns.release_quarantine(settled);
        }
        self.counters.completions += done as u64;
        let touched = if done == 0 {
            self.idle()
        } else {
            self.after_quiet = self.idle_passes >= TAIL_SIGNAL_IDLE_PASSES;
            self.idle_passes = 0;
            false
        };
        if !LEAN {
            // (The peer timer is read after the flush, as it always was: a
            // pass of the reactor's own protocol measured about 5 Ir more
            // with it read here.)
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
        self.unsettled
            || (self.reposts_left && self.idle_passes >= REPOST_IDLE_PASSES)
            || (self.tails_left && self.idle_passes >= TAIL_SIGNAL_IDLE_PASSES)
            || self.conns.has_touched()
            || !self.deferred.srq_returns.is_empty()
            || !self.deferred.removals.is_empty()
    }

    /// A pass found nothing: every handler's `on_idle`. Returns whether a
    /// callback may have staged work.
    #[inline]
    fn idle(&mut self) -> bool {
        self.counters.empty_passes += 1;
        self.idle_passes = self.idle_passes.saturating_add(1);
        if self.idle_passes >= TAIL_SIGNAL_IDLE_PASSES {
            self.after_quiet = true;
        }
        let mut ctx = Ctx::new(&mut self.conns, &self.stop, self.id, &mut self.deferred);
        for (_, session) in self.sessions.iter_mut() {
            session.handler.on_idle(&mut ctx);
        }
        ctx.touched
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
        // the reactor's protocol lists itself with its completion), in
        // `unsettled` or in the SRQ returns; a direct connection's
        // completions leave the flush nothing to do.
        let touched = touched || !self.deferred.srq_returns.is_empty();
        // Unsignaled requests left at the tail of a burst would never report
        // completion; after a while with nothing to do, signal them out.
        // Retried every idle pass from then on: the signal may have to wait
        // for a credit.
        let signal_tails = self.tails_left && self.idle_passes >= TAIL_SIGNAL_IDLE_PASSES;
        let tidy = self.reposts_left && self.idle_passes >= REPOST_IDLE_PASSES;
        // An idle pass that staged nothing, after a flush that left nothing
        // behind, has nothing to flush: skipping the walk over the
        // connections keeps empty passes, and so the time to notice the next
        // completion, short. Receives waiting for a fuller batch do not count
        // until the reactor has been idle for a while.
        if touched || self.unsettled || tidy || signal_tails || self.conns.has_touched() {
            self.flush(tidy, signal_tails);
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
        if late && (self.unsettled || self.conns.has_touched()) {
            self.flush(true, false);
        }
    }

    /// Arms every CQ and polls once more. Returns true if nothing is pending,
    /// so the caller may sleep on [`event_fd`](Self::event_fd) without
    /// missing a completion that raced the arming.
    pub fn prepare_wait(&mut self) -> Result<bool> {
        if self.config.event_mode == EventMode::BusyPoll {
            return Ok(false);
        }
        Ok(self.arm_and_poll()? == 0)
    }

    /// Arms every CQ, then polls once more; returns what that pass handled.
    fn arm_and_poll(&mut self) -> Result<usize> {
        // Sleeping with an unsignaled tail would leave its completions
        // unreported: signal it out first. Its completion (or, without a
        // credit, the peer's next credit update) then wakes us.
        self.flush(true, true);
        // A reactor about to sleep is quiet: what it posts on its next
        // completion is signaled (`after_quiet`), not left as a tail for
        // the next arming to signal out with a credit update.
        self.idle_passes = self.idle_passes.max(TAIL_SIGNAL_IDLE_PASSES);
        self.after_quiet = true;
        for cq in &mut self.cqs {
            cq.req_notify(false)?;
        }
        self.poll_once()
    }

    /// Consumes the completion events that woke us (acked in batches).
    pub fn drain_channel_events(&mut self) -> Result<()> {
        for channel in &self.channels {
            while channel.try_get_event()?.is_some() {}
        }
        Ok(())
    }

    /// Whose an SRQ receive's completion is (it comes with exactly the
    /// tagged `wr_id` the slot was posted with): the QP number says which
    /// connection consumed the slot.
    #[inline]
    fn srq_owner(
        srq: &mut Option<SrqPool>,
        unsettled: &mut bool,
        wr_id: u64,
        qp_num: u32,
    ) -> SrqOwner {
        let Some(pool) = srq.as_mut() else {
            return SrqOwner::Foreign;
        };
        let Some(slot) = pool.claim(wr_id) else {
            return SrqOwner::Foreign;
        };
        match pool.owner(qp_num) {
            Some(owner) => SrqOwner::Conn(owner, slot),
            None => {
                pool.reclaim(slot);
                *unsettled = true;
                SrqOwner::Reclaimed
            }
        }
    }

    /// Routes completion `at` of `wcs`, read in place (a copy of the
    /// 48-byte completion per message was about 15 Ir): only the rare
    /// paths that hand it to a method of the reactor copy it. Whose it
    /// is: the `wr_id` names the connection (index and generation), and
    /// the completion's QP number must be that connection's; or it is an
    /// SRQ receive.
    #[inline(always)]
    fn route<const LEAN: bool>(&mut self, at: usize) {
        let wr_id = self.wcs[at].wr_id();
        if LEAN {
            if let Some((index, generation)) = decode_direct(wr_id) {
                self.dispatch_direct(at, index, generation);
            } else {
                let (index, generation, kind) = decode_wr_id(wr_id);
                self.dispatch_apart(at, index, generation, kind);
            }
            return;
        }
        let (index, generation, kind) = decode_wr_id(wr_id);
        if is_direct(wr_id, kind) {
            self.dispatch_direct(at, index, generation);
        } else {
            self.dispatch(at, index, generation, kind);
        }
    }

    /// [`dispatch`](Self::dispatch) as a call of its own: in a lean pass,
    /// a completion no direct connection claims is a stranger's or a
    /// removed connection's (which `dispatch` ignores as it always does).
    #[cold]
    #[inline(never)]
    fn dispatch_apart(&mut self, at: usize, index: u32, generation: u32, kind: WrKind) {
        self.dispatch(at, index, generation, kind);
    }

    /// Routes completion `at`, of a connection of the reactor's own
    /// protocol (or an SRQ receive, or a stranger's).
    #[inline(always)]
    fn dispatch(&mut self, at: usize, index: u32, generation: u32, kind: WrKind) {
        let wc = &self.wcs[at];
        // The connection is looked up once, and listed for the flush only
        // once it is known to be the completion's (a stranger's completion
        // naming an index must not list it).
        let (key, kind, conn) = if kind == WrKind::SrqRecv {
            let owner =
                Self::srq_owner(&mut self.srq, &mut self.unsettled, wc.wr_id(), wc.qp_num());
            let (key, slot) = match owner {
                SrqOwner::Conn(key, slot) => (key, slot),
                SrqOwner::Reclaimed => return,
                SrqOwner::Foreign => {
                    let wc = self.wcs[at];
                    self.foreign(&wc);
                    return;
                }
            };
            let Some(conn) = self.conns.get_mut(key) else {
                // The owner table names no live connection (never: a
                // connection leaves it as it goes): the slot goes back as
                // for a QP the reactor does not serve.
                if let Some(pool) = self.srq.as_mut() {
                    pool.reclaim(slot);
                    self.unsettled = true;
                }
                return;
            };
            (key, WrKind::Recv { slot }, conn)
        } else {
            let qpn = wc.qp_num();
            // A receive of a connection on the SRQ always comes tagged.
            // (A direct connection's QP never completes without the direct
            // bit: only its handler posts there, through `DirectQp`, which
            // sets it; the reactor posts nothing on it.)
            let ours = |key: Key, conn: &Conn| {
                debug_assert!(!conn.direct || conn.qpn != qpn);
                (same_generation(key, generation)
                    && conn.qpn == qpn
                    && !(conn.uses_srq() && matches!(kind, WrKind::Recv { .. })))
                .then_some(true)
            };
            match self.conns.get_by_index_if(index, ours) {
                Some((key, conn)) => (key, kind, conn),
                None => {
                    let wc = self.wcs[at];
                    self.foreign(&wc);
                    return;
                }
            }
        };
        if !wc.is_success() || conn.is_closed() {
            let wc = self.wcs[at];
            self.dispatch_unusual(key, &wc, kind);
            return;
        }
        let delivery = match kind {
            WrKind::Recv { slot } => {
                // A receive beyond what the peer was granted: it ignores
                // its credits.
                if !conn.count_receive() {
                    self.overrun(key, slot);
                    return;
                }
                let len = wc.byte_len();
                if wc.opcode() == WcOpcode::RECV_RDMA_WITH_IMM {
                    conn.queue_repost(slot);
                    self.counters.messages += 1;
                    Delivery::WriteImm {
                        imm: wc.imm().unwrap_or(0),
                        len,
                    }
                } else {
                    match conn.recv_message(slot, len, wc.imm()) {
                        Ok(Arrival::Message { count, data, imm }) => {
                            self.counters.messages += 1;
                            Delivery::Message {
                                established: conn.peer_credit(count),
                                slot,
                                data,
                                imm,
                                from_srq: conn.uses_srq(),
                            }
                        }
                        Ok(Arrival::Credit(count)) => {
                            conn.queue_repost(slot);
                            if !conn.peer_credit(count) {
                                return;
                            }
                            Delivery::Established
                        }
                        Err(what) => {
                            self.malformed(key, slot, what);
                            return;
                        }
                    }
                }
            }
            WrKind::Send { seq } => match conn.retire_count(seq) {
                0 => return,
                count => Delivery::Retired { count },
            },
            WrKind::SrqRecv | WrKind::Unknown => return,
        };
        if let Delivery::Established
        | Delivery::Message {
            established: true, ..
        } = delivery
        {
            conn.answer_first_credit();
        }
        let (session, id) = (conn.session, conn.id);
        let Some(record) = self.sessions.get_mut(session.0) else {
            return;
        };
        let handler = &mut record.handler;
        let mut ctx = Ctx::new(&mut self.conns, &self.stop, self.id, &mut self.deferred);
        match delivery {
            Delivery::WriteImm { imm, len } => handler.on_write_imm(&mut ctx, id, imm, len),
            Delivery::Established => handler.on_established(&mut ctx, id),
            Delivery::Message {
                established,
                slot,
                data,
                imm,
                from_srq,
            } => {
                if established {
                    handler.on_established(&mut ctx, id);
                }
                ctx.offer(id, slot, data.1 as u32, from_srq);
                // SAFETY: the bytes live in the connection's receive ring,
                // registered while the connection lives, which is past this
                // call (removals wait for the end of the pass); the slot is
                // reposted only after the handler returns (or releases its
                // hold), so the NIC does not write it meanwhile, and nothing
                // reachable through `ctx` writes these bytes either (a
                // forward with an immediate writes only the 4 after them).
                let data = unsafe { std::slice::from_raw_parts(data.0, data.1) };
                handler.on_message(&mut ctx, id, data, imm);
                if ctx.current.is_some()
                    && let Some(conn) = ctx.conns.get_mut(key)
                {
                    conn.queue_repost(slot);
                }
            }
            Delivery::Retired { count } => {
                for _ in 0..count {
                    let Some(conn) = ctx.conns.get_mut(key) else {
                        return;
                    };
                    let (seq, op) = conn.pop_oldest();
                    match op.kind {
                        OpKind::Send => handler.on_send_complete(&mut ctx, id, seq),
                        OpKind::Write => handler.on_write_complete(&mut ctx, id, seq),
                        OpKind::Read => handler.on_read_complete(&mut ctx, id, seq),
                        OpKind::Forward => {
                            if let Some(origin) = op.origin(id) {
                                return_forwarded(
                                    ctx.conns,
                                    &mut self.srq,
                                    origin,
                                    op.slot,
                                    op.from_srq,
                                );
                            }
                            handler.on_send_complete(&mut ctx, id, seq);
                        }
                        OpKind::Credit => {}
                    }
                }
            }
        }
    }

    /// Routes completion `at` of a direct connection, named by slab
    /// `index` and `generation` (and its QP number, checked as for the
    /// reactor's own), to its handler with the handler's own id.
    #[inline(always)]
    fn dispatch_direct(&mut self, at: usize, index: u32, generation: u32) {
        let wc = &self.wcs[at];
        let qpn = wc.qp_num();
        // A direct connection's completions leave the flush nothing to do:
        // it is not listed.
        let ours = |key: Key, conn: &Conn| {
            (same_generation(key, generation) && conn.qpn == qpn && conn.direct).then_some(false)
        };
        let Some((key, conn)) = self.conns.get_by_index_if(index, ours) else {
            let wc = self.wcs[at];
            self.foreign(&wc);
            return;
        };
        if !wc.is_success() || conn.is_closed() {
            let wc = self.wcs[at];
            self.direct_unusual(key, &wc);
            return;
        }
        let (session, id) = (conn.session, conn.id);
        let Some(record) = self.sessions.get_mut(session.0) else {
            return;
        };
        let mut ctx = Ctx::new(&mut self.conns, &self.stop, self.id, &mut self.deferred);
        // The low half of the id is the handler's (see `direct`).
        let handlers_id = wc.wr_id() as u32;
        record
            .handler
            .on_direct_completion(&mut ctx, id, handlers_id, wc);
    }

    /// Asks every session's link whether its peer is still there; a session
    /// whose peer is gone is told once. Its connections keep running: the
    /// peer's last completions may still be queued (a polite peer hangs up
    /// right after its last message), so the handler decides when to let go.
    /// Returns whether a handler was told (and so may have changed
    /// connections).
    #[cold]
    fn check_peers(&mut self) -> bool {
        let mut gone: Vec<(SessionId, PeerStatus)> = Vec::new();
        // Every link is looked at: those still holding part of a frame set
        // the next recheck again.
        self.recheck_at = None;
        for (key, session) in self.sessions.iter_mut() {
            if let Some(status) = Self::check_one(&mut self.waiter, &mut self.recheck_at, session) {
                gone.push((SessionId(key), status));
            }
        }
        self.tell_gone(gone)
    }

    /// Looks at the peers whose control connection woke the last wait.
    #[cold]
    fn check_fired_peers(&mut self) {
        let mut gone: Vec<(SessionId, PeerStatus)> = Vec::new();
        for &token in &self.fired {
            let Some((key, session)) = self.sessions.get_by_index_mut(token as u32) else {
                continue;
            };
            if let Some(status) = Self::check_one(&mut self.waiter, &mut self.recheck_at, session) {
                gone.push((SessionId(key), status));
            }
        }
        self.tell_gone(gone);
    }

    /// Checks one session's control connection, unless its peer is known
    /// gone already; a peer found gone is marked so, its connection (which
    /// stays readable at EOF) no longer wakes the wait, and its status is
    /// returned. A live link holding part of a frame moves `recheck_at`
    /// up to when it must be looked at again.
    fn check_one(
        waiter: &mut Waiter,
        recheck_at: &mut Option<Instant>,
        session: &mut Session<H, L>,
    ) -> Option<PeerStatus> {
        if session.gone {
            return None;
        }
        let status = session.link.check_peer();
        if matches!(status, PeerStatus::Alive) {
            // At least a millisecond (a zero would spin), and a time too far
            // to represent is no deadline at all.
            if let Some(within) = session.link.recheck_within()
                && let Some(at) = Instant::now().checked_add(within.max(Duration::from_millis(1)))
            {
                *recheck_at = Some(recheck_at.map_or(at, |earlier| earlier.min(at)));
            }
            return None;
        }
        session.gone = true;
        if let Some(fd) = session.link.event_fd() {
            waiter.unwatch(fd);
        }
        Some(status)
    }

    /// Tells each handler whose peer is gone, after one more poll of the
    /// CQs: what the peer sent before its goodbye (acknowledged, so in our
    /// CQ before the goodbye left) reaches the handler first, whatever the
    /// order in which this pass saw the two.
    /// Returns whether any was told.
    fn tell_gone(&mut self, gone: Vec<(SessionId, PeerStatus)>) -> bool {
        if gone.is_empty() {
            return false;
        }
        if let Err(err) = self.poll_once() {
            log::warn!("polling before telling of peers gone: {err}");
        }
        for (session, status) in gone {
            let mut ctx = Ctx::new(&mut self.conns, &self.stop, self.id, &mut self.deferred);
            if let Some(record) = self.sessions.get_mut(session.0) {
                record.handler.on_peer_gone(&mut ctx, session, &status);
            }
            self.unsettled = true;
        }
        true
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
