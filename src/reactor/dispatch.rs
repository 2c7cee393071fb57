//! Completion routing: each polled completion goes, by its `wr_id`, to
//! its connection and handler (a direct connection's to its handler
//! alone), or, if it is no usual one, to `failure`. Called from the pass
//! (`pass`), once per completion.

use crate::verbs::{BIND_WR_ID, WcOpcode};

use super::admin::return_forwarded;
use super::conn::{
    Arrival, Conn, OpKind, WrKind, decode_direct, decode_wr_id, is_direct, same_generation,
};
use super::idle::IdlePolicy;
use super::slab::Key;
#[cfg(debug_assertions)]
use super::slab::TOUCHED;
use super::srq_pool::SrqPool;
use super::{Ctx, Handler, PeerLink, Reactor};

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
    /// Whose an SRQ receive's completion is (it comes with exactly the
    /// tagged `wr_id` the slot was posted with): the QP number says which
    /// connection consumed the slot.
    #[inline]
    fn srq_owner(
        srq: &mut Option<SrqPool>,
        idle: &mut IdlePolicy,
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
                idle.work_left();
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
    pub(super) fn route<const LEAN: bool>(&mut self, at: usize) {
        let wr_id = self.completions.wc(at).wr_id();
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
        let wc = self.completions.wc(at);
        // The connection is looked up once, and listed for the flush only
        // once it is known to be the completion's (a stranger's completion
        // naming an index must not list it).
        let (key, kind, conn) = if kind == WrKind::SrqRecv {
            let owner = Self::srq_owner(&mut self.srq, &mut self.idle, wc.wr_id(), wc.qp_num());
            let (key, slot) = match owner {
                SrqOwner::Conn(key, slot) => (key, slot),
                SrqOwner::Reclaimed => return,
                SrqOwner::Foreign => {
                    let wc = *self.completions.wc(at);
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
                    self.idle.work_left();
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
            // A retired send is not listed for the flush: retiring only
            // frees queue room and send slots, and a connection whose work
            // waited for them is listed already (the flush that could not
            // post it listed it again), as is one whose handler stages
            // more from the completion callback. (A flush visit was about
            // 60 Ir per signaled send on the host.)
            // A receive into a slot of the connection's own ring that is
            // not posted (or not any more) is none the device can have
            // filled through it: a stranger's too, refused before a byte
            // of the slot is read or the slot goes back. (Checked last,
            // as it marks a posted slot consumed.)
            let ours = |key: Key, conn: &mut Conn| {
                // (Bar a window bind's completion: `BIND_WR_ID` decodes
                // to an index too, and its QP may be a direct one's.)
                debug_assert!(!conn.direct || conn.qpn != qpn || wc.wr_id() == BIND_WR_ID);
                (same_generation(key, generation)
                    && conn.qpn == qpn
                    && match kind {
                        WrKind::Recv { slot } => !conn.uses_srq() && conn.consume_recv(slot),
                        _ => true,
                    })
                .then_some(!matches!(kind, WrKind::Send { .. }))
            };
            match self.conns.get_by_index_if(index, ours) {
                Some((key, conn)) => (key, kind, conn),
                None => {
                    let wc = *self.completions.wc(at);
                    self.foreign(&wc);
                    return;
                }
            }
        };
        if !wc.is_success() || conn.is_closed() {
            let wc = *self.completions.wc(at);
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
                let mut left = count;
                while left > 0 {
                    let Some(conn) = ctx.conns.get_mut_quiet(key) else {
                        return;
                    };
                    // A run of one kind retires whole, for one handler
                    // call (`retire_count` vouched for `left` ops in
                    // flight).
                    let (seq, op, run) = conn.retire_run(left);
                    left -= run;
                    match op.kind {
                        OpKind::Send => handler.on_sends_complete(&mut ctx, id, seq, run),
                        OpKind::Write => handler.on_writes_complete(&mut ctx, id, seq, run),
                        OpKind::Read => handler.on_reads_complete(&mut ctx, id, seq, run),
                        OpKind::Forward => {
                            // A slot back in the SRQ pool's batch needs
                            // this pass's flush, which a retire alone does
                            // not ask for.
                            if let Some(origin) = op.origin(id) {
                                return_forwarded(
                                    ctx.conns,
                                    &mut self.srq,
                                    &mut self.idle,
                                    origin,
                                    op.slot,
                                    op.from_srq,
                                );
                            }
                            handler.on_sends_complete(&mut ctx, id, seq, 1);
                        }
                        OpKind::Credit => {}
                    }
                }
                // Not listed for the flush by the retire (see `ours`
                // above): then the flush has nothing to do for it.
                #[cfg(debug_assertions)]
                if let Some(conn) = ctx.conns.get(key) {
                    debug_assert!(
                        ctx.conns.is_listed(TOUCHED, key.index)
                            || conn.is_closed()
                            || (conn.is_quiet() && !conn.reposts_due()),
                        "a retire left connection {} work for a flush it does not ask for",
                        conn.qpn
                    );
                }
            }
        }
    }

    /// Routes completion `at` of a direct connection, named by slab
    /// `index` and `generation` (and its QP number, checked as for the
    /// reactor's own), to its handler with the handler's own id.
    #[inline(always)]
    fn dispatch_direct(&mut self, at: usize, index: u32, generation: u32) {
        let wc = self.completions.wc(at);
        let qpn = wc.qp_num();
        // A direct connection's completions leave the flush nothing to do:
        // it is not listed.
        let ours = |key: Key, conn: &mut Conn| {
            (same_generation(key, generation) && conn.qpn == qpn && conn.direct).then_some(false)
        };
        let Some((key, conn)) = self.conns.get_by_index_if(index, ours) else {
            let wc = *self.completions.wc(at);
            self.foreign(&wc);
            return;
        };
        if !wc.is_success() || conn.is_closed() {
            let wc = *self.completions.wc(at);
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
}
