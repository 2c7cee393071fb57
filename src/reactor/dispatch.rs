//! Completion routing: each polled completion is looked up in the
//! connection table by its `wr_id` and QP number; the connection turns it
//! into a delivery (credits, reposts, the overrun check), and the handler
//! is called with it. A completion the table refuses, a failed one, and
//! one of a closed connection go to `failure`. Called from the pass
//! (`pass`), once per completion.

use super::admin::return_forwarded;
use crate::verbs::WcOpcode;

use super::conn::{Arrival, OpKind};
use super::slab::Key;
use super::table::{Completed, Entry, Refusal, wr_id};
use super::{ConnId, Handler, PeerLink, Reactor, SessionId};

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
                let delivery = match completed {
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
                            Delivery::WriteImm {
                                imm: wc.imm().unwrap_or(0),
                                len,
                            }
                        } else {
                            match conn.rq().decode(slot, len, wc.imm()) {
                                Ok(Arrival::Message { count, data, imm }) => {
                                    self.counters.messages += 1;
                                    let established = conn.peer_credit(count);
                                    if established {
                                        conn.answer_first_credit();
                                    }
                                    Delivery::Message {
                                        established,
                                        slot,
                                        data,
                                        imm,
                                        from_srq: conn.rq().uses_srq(),
                                    }
                                }
                                Ok(Arrival::Credit(count)) => {
                                    conn.queue_repost(slot);
                                    if !conn.peer_credit(count) {
                                        self.conns.settle(key.index);
                                        return;
                                    }
                                    conn.answer_first_credit();
                                    Delivery::Established
                                }
                                Err(what) => {
                                    self.malformed(key, slot, what);
                                    return;
                                }
                            }
                        }
                    }
                    Completed::Send { seq } => match conn.sq().retire_count(seq) {
                        0 => return,
                        count => Delivery::Retired { count },
                    },
                    Completed::Direct => return,
                };
                let (session, id) = (conn.session(), conn.id());
                self.deliver(key, session, id, delivery);
            }
            Err(refusal) => self.refused(at, refusal),
        }
    }

    /// Completion `at`, refused by the table: in a lean pass, one that is
    /// no direct connection's is routed in full (and a connection it
    /// leaves due is listed instead, for the lean pass's chores: only a
    /// full pass flushes the due one); an SRQ slot reclaimed leaves a
    /// repost for the flush; anything else is no connection's.
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
            _ => {
                let wc = *self.completions.wc(at);
                self.foreign(&wc);
            }
        }
    }

    /// Calls the handler of `session` with what completion brought
    /// connection `key` (`id`), and does what the call leaves: the
    /// message's slot queued for reposting unless held, forwards' slots
    /// given back as their sends retire, and the connection settled for
    /// the flush if the delivery or the callback left it work.
    #[inline(always)]
    fn deliver(&mut self, key: Key, session: SessionId, id: ConnId, delivery: Delivery) {
        let Some(handler) = self.sessions.handler_mut(session) else {
            // A receive leaves its connection work (its slot's repost, a
            // credit update that may be due); a retire leaves none.
            if !matches!(delivery, Delivery::Retired { .. }) {
                self.conns.settle(key.index);
            }
            return;
        };
        let mut ctx = reactor_ctx!(self);
        ctx.own = key.index;
        // Whether the delivery leaves the connection work for the flush: a
        // receive does (see above); a retire only through what the
        // callbacks staged on it.
        let left_work = match delivery {
            Delivery::WriteImm { imm, len } => {
                handler.on_write_imm(&mut ctx, id, imm, len);
                true
            }
            Delivery::Established => {
                handler.on_established(&mut ctx, id);
                true
            }
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
                    && let Some(conn) = ctx.conns.get_mut_quiet(key)
                {
                    conn.queue_repost(slot);
                }
                true
            }
            Delivery::Retired { count } => {
                let mut left = count;
                while left > 0 {
                    let Some(conn) = ctx.conns.get_mut_quiet(key) else {
                        break;
                    };
                    // A run of one kind retires whole, for one handler
                    // call (`retire_count` vouched for `left` ops in
                    // flight).
                    let (seq, op, run) = conn.retire_run(left);
                    left -= run;
                    match op.kind() {
                        OpKind::Send => handler.on_sends_complete(&mut ctx, id, seq, run),
                        OpKind::Write => handler.on_writes_complete(&mut ctx, id, seq, run),
                        OpKind::Read => handler.on_reads_complete(&mut ctx, id, seq, run),
                        OpKind::Forward => {
                            // A slot back in the SRQ pool's batch needs
                            // this pass's flush, which a retire alone does
                            // not ask for.
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
                ctx.own_staged
            }
        };
        if left_work {
            ctx.conns.settle(key.index);
        }
        // Whatever the delivery and its callbacks left the connection, the
        // flush sees: it is due or listed, or has nothing for a flush.
        #[cfg(debug_assertions)]
        if let Some(conn) = ctx.conns.get(key) {
            debug_assert!(
                ctx.conns.is_settled(key.index)
                    || conn.state().is_closed()
                    || (conn.is_quiet() && !conn.rq().is_due()),
                "a delivery left connection {} work the flush does not see",
                conn.qpn()
            );
        }
    }
}
