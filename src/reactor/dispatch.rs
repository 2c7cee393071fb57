//! Completion routing: each polled completion is looked up in the
//! connection table by its `wr_id` and QP number; the connection turns it
//! into a delivery (credits, reposts, the overrun check), and the handler
//! is called with it. A completion the table refuses, a failed one, and
//! one of a closed connection go to `failure`. Called from the pass
//! (`pass`), once per completion.

use super::admin::return_forwarded;
use crate::verbs::WcOpcode;

use super::conn::{Arrival, OpKind};
use super::slab::{Key, ROOM};
use super::table::{Completed, Entry, Refusal, wr_id};
use super::{ConnId, Ctx, Handler, PeerLink, Reactor, SessionId};

impl<H: Handler, L: PeerLink> Reactor<H, L> {
    /// Routes completion `at` of `wcs`, read in place (a copy of the
    /// 48-byte completion per message costs about 15 Ir): only the rare
    /// paths that hand it to a method of the reactor copy it. In a lean
    /// pass (`LEAN`: no connection of the reactor's own protocol), only a
    /// direct connection's completion is looked up inline; any other goes
    /// to a call of its own.
    ///
    /// A delivered receive, and a callback's work on the connection it was
    /// called for, leave that connection to the flush through
    /// [`ConnTable::settle`](super::table::ConnTable::settle).
    #[inline(always)]
    pub(super) fn route<const LEAN: bool>(&mut self, at: usize) {
        let wc = self.completions.wc(at);
        let (wr_id, qpn) = (wc.wr_id(), wc.qp_num());
        match self.conns.lookup::<LEAN>(wr_id, qpn, &mut self.srq) {
            Ok(Entry {
                key,
                completed: Completed::Direct,
                conn,
            }) => {
                if !wc.is_success() || conn.state().is_closed() {
                    let wc = *self.completions.wc(at);
                    self.direct_unusual(key, &wc);
                    return;
                }
                let (session, id) = (conn.session(), conn.id());
                let Some(handler) = self.sessions.handler_mut(session) else {
                    return;
                };
                let mut ctx = reactor_ctx!(self);
                // The low half of the id is the handler's (see `direct`).
                handler.on_direct_completion(&mut ctx, id, wr_id as u32, wc);
            }
            Ok(Entry {
                key,
                completed,
                conn,
            }) => {
                if !wc.is_success() || conn.state().is_closed() {
                    let wc = *self.completions.wc(at);
                    self.dispatch_unusual(key, &wc, completed);
                    return;
                }
                let (session, id) = (conn.session(), conn.id());
                match completed {
                    // The connection counts and checks the peer's
                    // credits and queues the slot for reposting if the
                    // handler gets no hold of it. The cold paths are
                    // called in place: a refusal carried out in a result
                    // would join the delivery's path (about 40 Ir a send
                    // round trip).
                    Completed::Recv { slot } => {
                        // A receive beyond what the peer was granted: it
                        // ignores its credits.
                        if !conn.count_receive() {
                            self.overrun(key, slot);
                            return;
                        }
                        let len = wc.byte_len();
                        if wc.opcode() == WcOpcode::RECV_RDMA_WITH_IMM {
                            conn.queue_repost(slot);
                            self.counters.messages += 1;
                            let imm = wc.imm().unwrap_or(0);
                            self.deliver_write_imm(key, session, id, imm, len);
                            return;
                        }
                        match conn.rq().decode(slot, len, wc.imm()) {
                            Ok(Arrival::Message { count, data, imm }) => {
                                self.counters.messages += 1;
                                let established = conn.peer_credit(count);
                                if established {
                                    conn.answer_first_credit();
                                }
                                let message = Message {
                                    established,
                                    slot,
                                    data,
                                    imm,
                                    from_srq: conn.rq().uses_srq(),
                                };
                                self.deliver_message(key, session, id, message);
                            }
                            Ok(Arrival::Credit(count)) => {
                                conn.queue_repost(slot);
                                if !conn.peer_credit(count) {
                                    self.conns.settle(key.index);
                                    return;
                                }
                                conn.answer_first_credit();
                                self.deliver_established(key, session, id);
                            }
                            Err(what) => self.malformed(key, slot, what),
                        }
                    }
                    Completed::Send { seq } => {
                        let count = conn.sq().retire_count(seq);
                        if count != 0 {
                            // A handler waiting for room the retire may
                            // bring has it now, maybe: the flush looks.
                            if conn.retire_may_bring_room() {
                                self.conns.settle(key.index);
                            }
                            self.deliver_retired(key, session, id, count);
                        }
                    }
                    Completed::Direct => {}
                }
            }
            Err(refusal) => self.refused(at, refusal),
        }
    }

    /// Completion `at`, refused by the table: in a lean pass, one that is
    /// no direct connection's is routed in full (and a connection it
    /// leaves due is listed instead, for the lean pass's chores: only a
    /// full pass flushes the due one); an SRQ slot reclaimed leaves a
    /// repost for the flush; one a removed connection left is counted
    /// stale; anything else is no connection's.
    #[cold]
    #[inline(never)]
    fn refused(&mut self, at: usize, refusal: Refusal) {
        if let Some((endpoint, kind)) = wr_id::decode_datagram(self.completions.wc(at).wr_id()) {
            self.route_datagram(at, endpoint, kind);
            return;
        }
        match refusal {
            Refusal::NotDirect => {
                self.route::<false>(at);
                self.conns.list_due();
            }
            Refusal::Reclaimed => self.idle.work_left(),
            Refusal::Foreign if self.conns.names_departed(self.completions.wc(at).wr_id()) => {
                self.counters.stale_completions += 1;
                log::trace!(
                    "ignoring a completion of a removed connection: {:?}",
                    self.completions.wc(at)
                );
            }
            _ => {
                let wc = *self.completions.wc(at);
                self.foreign(&wc);
            }
        }
    }

    /// Calls the handler of `session` with a WRITE_WITH_IMM that landed on
    /// connection `key` (`id`); the connection is settled for the flush
    /// (its slot's repost).
    #[inline(always)]
    fn deliver_write_imm(&mut self, key: Key, session: SessionId, id: ConnId, imm: u32, len: u32) {
        self.call_and_settle(key, session, |handler, ctx| {
            handler.on_write_imm(ctx, id, imm, len);
        });
    }

    /// Tells the handler of `session` that connection `key` (`id`) is
    /// established by the peer's first credit; settled for the flush.
    #[cold]
    fn deliver_established(&mut self, key: Key, session: SessionId, id: ConnId) {
        self.call_and_settle(key, session, |handler, ctx| {
            handler.on_established(ctx, id);
        });
    }

    /// Makes `call` on the handler of `session` for a completion of
    /// connection `key`, then settles the connection for the flush (a
    /// receive leaves it work: its slot's repost, maybe a credit update).
    #[inline(always)]
    fn call_and_settle(
        &mut self,
        key: Key,
        session: SessionId,
        call: impl FnOnce(&mut H, &mut Ctx<'_>),
    ) {
        if let Some(handler) = self.sessions.handler_mut(session) {
            let mut ctx = reactor_ctx!(self);
            ctx.own = key.index;
            call(handler, &mut ctx);
        }
        self.conns.settle(key.index);
    }

    /// Calls the handler of `session` with a message that arrived on
    /// connection `key` (`id`): its slot is queued for reposting unless
    /// the handler holds it, and the connection is settled for the flush.
    #[inline(always)]
    fn deliver_message(&mut self, key: Key, session: SessionId, id: ConnId, message: Message) {
        let Message {
            established,
            slot,
            data,
            imm,
            from_srq,
        } = message;
        let Some(handler) = self.sessions.handler_mut(session) else {
            if let Some(conn) = self.conns.get_mut_quiet(key) {
                conn.queue_repost(slot);
            }
            self.conns.settle(key.index);
            return;
        };
        let mut ctx = reactor_ctx!(self);
        ctx.own = key.index;
        if established {
            handler.on_established(&mut ctx, id);
        }
        ctx.offer(id, slot, data.1 as u32, from_srq);
        // SAFETY: the bytes live in the connection's receive ring,
        // registered while the connection lives, which is past this call
        // (removals wait for the end of the pass); the slot is reposted
        // only after the handler returns (or releases its hold), so the
        // NIC does not write it meanwhile, and nothing reachable through
        // `ctx` writes these bytes either (a forward with an immediate
        // writes only the 4 after them).
        let data = unsafe { std::slice::from_raw_parts(data.0, data.1) };
        handler.on_message(&mut ctx, id, data, imm);
        if ctx.current.is_some()
            && let Some(conn) = ctx.conns.get_mut_quiet(key)
        {
            conn.queue_repost(slot);
        }
        ctx.conns.settle(key.index);
        self.debug_check_settled(key);
    }

    /// Retires the `count` oldest send-queue ops of connection `key`
    /// (`id`), calling the handler of `session` once per run of one kind,
    /// and gives forwards' slots back. The connection is settled for the
    /// flush only if the callbacks staged work on it.
    #[inline(always)]
    fn deliver_retired(&mut self, key: Key, session: SessionId, id: ConnId, count: u32) {
        let Some(handler) = self.sessions.handler_mut(session) else {
            return;
        };
        let mut ctx = reactor_ctx!(self);
        ctx.own = key.index;
        let mut left = count;
        while left > 0 {
            let Some(conn) = ctx.conns.get_mut_quiet(key) else {
                break;
            };
            // A run of one kind retires whole, for one handler call
            // (`retire_count` vouched for `left` ops in flight).
            let (seq, op, run) = conn.sq_mut().retire_run(left);
            left -= run;
            match op.kind() {
                OpKind::Send => handler.on_sends_complete(&mut ctx, id, seq, run),
                OpKind::Write => handler.on_writes_complete(&mut ctx, id, seq, run),
                OpKind::Read => handler.on_reads_complete(&mut ctx, id, seq, run),
                OpKind::Forward => {
                    // A slot back in the SRQ pool's batch needs this pass's
                    // flush, which a retire alone does not ask for.
                    if let Some(origin) = op.forward_origin(id) {
                        return_forwarded(
                            ctx.conns,
                            &mut self.srq,
                            &mut self.idle,
                            origin.conn,
                            origin.slot,
                            origin.from_srq,
                        );
                    }
                    handler.on_sends_complete(&mut ctx, id, seq, 1);
                }
                OpKind::Credit => {}
            }
        }
        if ctx.own_staged {
            ctx.conns.settle(key.index);
        }
        self.debug_check_settled(key);
    }

    /// After the pass's flush: tells the handlers of connections refused
    /// for want of room that the flush found with room back
    /// ([`Handler::on_writable`]), unless something staged since took it
    /// again. Returns whether a callback may have staged work.
    #[cold]
    #[inline(never)]
    pub(super) fn tell_room(&mut self) -> bool {
        let listed = self.conns.begin_walk(ROOM);
        let mut touched = false;
        for at in 0..listed {
            let Some(index) = self.conns.unlist_at(ROOM, at) else {
                break;
            };
            let Some((_, conn)) = self.conns.get_by_index_quiet(index) else {
                continue;
            };
            if conn.state().is_closed() || !conn.has_room_back() {
                continue;
            }
            conn.end_room_wait();
            let (session, id) = (conn.session(), conn.id());
            let Some(handler) = self.sessions.handler_mut(session) else {
                continue;
            };
            let mut ctx = reactor_ctx!(self);
            handler.on_writable(&mut ctx, id);
            touched |= ctx.touched;
        }
        self.conns.end_walk(ROOM);
        touched
    }

    /// Whatever a delivery and its callbacks left connection `key`, the
    /// flush sees: it is due or listed, or has nothing for a flush.
    #[inline(always)]
    fn debug_check_settled(&self, key: Key) {
        #[cfg(debug_assertions)]
        if let Some(conn) = self.conns.get(key) {
            debug_assert!(
                self.conns.is_settled(key.index)
                    || conn.state().is_closed()
                    || (conn.is_quiet() && !conn.rq().is_due()),
                "a delivery left connection {} work the flush does not see",
                conn.qpn()
            );
        }
        #[cfg(not(debug_assertions))]
        let _ = key;
    }
}

/// A message a receive brought, once the connection has done its part
/// (credits, the overrun check): for the handler.
struct Message {
    /// The peer's first credit came with it: the connection is usable.
    established: bool,
    /// The receive slot it landed in.
    slot: u32,
    /// The payload's address and length.
    data: (*const u8, usize),
    imm: Option<u32>,
    from_srq: bool,
}
