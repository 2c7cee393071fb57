//! Per-connection state of the reactor: its QP, the receive ring, the
//! send-slot ring, send-queue accounting with selective signaling, credits,
//! and the staged requests that become one doorbell per pass.
//!
//! Everything here is sized at registration and never grows: the data path
//! only moves indices around preallocated arrays.

mod credit;
mod ring;
mod staging;

use crate::verbs::{
    AccessFlags, MemoryRegion, ProtectionDomain, QueuePair, RecvBatch, Registration,
    SendDescriptor, SendFlags, SendList,
};

use super::idle::SpellMark;
use super::table::wr_id::{self, direct_recv_tag, direct_send_tag};
use super::{ConnId, ConnStats, DirectQp, ReactorConfig, SendError, SessionId};

pub(crate) use credit::Arrival;
use ring::RingSlots;
pub(crate) use ring::{Ring, SharedRing, recv_request};
pub(crate) use staging::{ForwardOrigin, OpKind};
use staging::{Keep, SqOp};

/// Bytes of every slot kept back for the trailer of a SEND that carries a
/// user immediate: the immediate itself, after the payload. Every SEND of
/// the reactor is a SEND_WITH_IMM whose immediate carries the credit (see
/// `credit::send_imm`), so a payload that fits a packet goes in one.
pub(crate) const IMM_TRAILER_LEN: usize = 4;
/// Most requests staged for one QP in one pass (one doorbell).
pub(crate) const MAX_STAGED: usize = 64;
/// Most receives reposted with one `ibv_post_recv`.
pub(crate) const MAX_REPOST: usize = 64;
/// The mark in `Conn::unposted` of a refused doorbell (a count of requests
/// never reaches it: a send queue is far smaller).
const REFUSED: u32 = 1 << 31;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ConnState {
    /// Waiting for the peer's first credit update.
    Connecting,
    Established,
    /// A direct connection, open: its handler posts on the QP, and the
    /// reactor's staging refuses it.
    Direct,
    /// A completion failed or posting failed; the handler was told.
    Failed,
    /// The session was removed: nothing is owned any more.
    Removed,
}

pub(crate) struct Conn {
    pub(crate) id: ConnId,
    /// The top 32 bits of every send-queue request's and every receive's
    /// `wr_id`, made once (`id` never changes): a request's `wr_id` is then
    /// its sequence number or slot (or a direct handler's own 32 bits)
    /// OR-ed in. `wr_id::send(id.key(), 0)` and `wr_id::recv(id.key(), 0)`;
    /// a direct connection's carry the direct bit too (`direct_send_tag`).
    send_tag: u64,
    recv_tag: u64,
    pub(crate) session: SessionId,
    /// The QP's position among its session's QPs.
    pub(crate) qp_index: usize,
    pub(crate) qpn: u32,
    /// Window binds posted on the QP before the reactor took it: their
    /// completions (failures, or signaled ones) carry `BIND_WR_ID`.
    pub(crate) binds: u32,
    pub(crate) state: ConnState,
    /// A direct connection: its handler posts on the QP itself and gets
    /// every completion as it comes ([`Ctx::direct`](super::Ctx::direct));
    /// the reactor stages, signals, credits and reposts nothing on it.
    /// (The same as `protocol_qpn == NO_QPN`, kept as a flag: the hot
    /// checks read it cheaper, `tools/instr-count --host`.)
    pub(crate) direct: bool,
    /// The QP number the completions of the reactor's protocol come
    /// from: the QP's, or [`NO_QPN`] on a direct connection, so that one
    /// compare vets both the QP and the kind.
    protocol_qpn: u64,
    // Declared before the rings' registrations: the QP is destroyed first.
    // Only this connection posts on it (the reactor took it whole).
    qp: QueuePair,
    // Receive ring and send slots, `slot_size` bytes per slot. The rings are
    // addressed through their cached base, lkey and pointer; `regions` owns
    // the registrations.
    recv_ring: Ring,
    send_ring: Ring,
    /// Own receive ring (none with an SRQ) and send slots.
    regions: (Option<MemoryRegion>, MemoryRegion),
    /// Set when receives come from the reactor's SRQ.
    shared_recv: bool,
    /// The receive ring's registration (own or the SRQ's): forwards out of
    /// it keep a clone until they complete.
    recv_registration: Registration,
    pub(crate) slot_size: usize,
    /// Receives this connection may have outstanding: its ring, or its
    /// credit quota in the SRQ.
    pub(crate) recv_depth: u32,
    /// Slots in the ring receives land in (bounds for slot indices).
    recv_slots: u32,
    /// Where each slot of the own ring is (none with an SRQ).
    ring_slots: RingSlots,
    send_slots: u32,
    // Send-slot ring: slots are used and released in SQ order.
    send_head: u32,
    send_in_use: u32,
    // Send-queue accounting: ops[seq % depth] for seq in [sq_done, sq_next).
    ops: Box<[SqOp]>,
    /// Beside `ops`: the registration handle of an op that holds one of
    /// its own (`Keep::Own`), None elsewhere. Dropped after the QP (declared
    /// after it), so a handle never outlives its use by the device.
    owned: Box<[Option<Registration>]>,
    sq_depth: u32,
    sq_next: u32,
    sq_done: u32,
    /// The newest ops a failed post left unposted, no longer in `batch`
    /// (which holds the others the device has not seen), with [`REFUSED`]
    /// set once a doorbell was refused: nonzero means the connection waits
    /// to fail.
    unposted: u32,
    since_signal: u32,
    /// The quiet spell of this connection's last doorbell on sparse
    /// traffic: while the reactor's spell reads it as sparse, what the
    /// connection posts is signaled (see `Conn::is_sparse`).
    posted_after_spell: SpellMark,
    signal_interval: u32,
    max_inline: u32,
    // Credits (all cumulative, wrapping): receives the peer has posted, RECV-
    // consuming requests we have posted, receives we have posted and told.
    peer_posted: u32,
    consumed: u32,
    posted: u32,
    /// The highest receive count we have put on the wire (or are about to,
    /// with this pass's doorbell): everything the peer was ever granted.
    advertised: u32,
    /// Receives the peer consumed on this QP (SENDs, WRITE_WITH_IMMs and
    /// credit updates that completed here): never more than `advertised`
    /// for a peer that keeps to its credits.
    received: u32,
    credit_threshold: u32,
    // Staging.
    pub(crate) batch: SendList<MAX_STAGED>,
    has_staged_send: bool,
    // Receive slots consumed and waiting to be reposted: each slot is in here
    // at most once, so one entry per slot of the receive ring (own or SRQ)
    // always suffices.
    pending_reposts: Box<[u32]>,
    pending_len: usize,
    reposts: RecvBatch<'static, MAX_REPOST>,
    repost_threshold: usize,
    /// The registration requests keep by count instead of by handle (see
    /// `staging::Keep`), and how many in flight use it.
    kept: Option<Registration>,
    kept_in_flight: u32,
}

// SAFETY: the raw pointers in the rings point into this Conn's own regions,
// or into the reactor's SRQ region, which lives as long as the reactor that
// owns this Conn; moving the Conn to another thread moves none of that memory.
unsafe impl Send for Conn {}

/// No QP number: beyond every `u32` a device can report.
const NO_QPN: u64 = 1 << 32;

impl Conn {
    /// The QP number a completion of the reactor's protocol must come
    /// from to be this connection's: none on a direct connection.
    #[inline(always)]
    pub(crate) fn protocol_qpn(&self) -> u64 {
        self.protocol_qpn
    }

    /// The `wr_id` of send-queue request `seq` (`wr_id::send`).
    #[inline(always)]
    pub(crate) fn send_wr_id(&self, seq: u32) -> u64 {
        debug_assert!(!self.direct, "the reactor posts nothing on a direct QP");
        debug_assert_eq!(self.send_tag, wr_id::send(self.id.key(), 0));
        self.send_tag | u64::from(seq)
    }

    /// The `wr_id` of a receive into slot `slot` of the connection's own
    /// ring (`wr_id::recv`).
    #[inline(always)]
    pub(crate) fn recv_wr_id(&self, slot: u32) -> u64 {
        debug_assert!(!self.direct, "the reactor posts nothing on a direct QP");
        debug_assert_eq!(self.recv_tag, wr_id::recv(self.id.key(), 0));
        self.recv_tag | u64::from(slot)
    }

    pub(crate) fn new(
        id: ConnId,
        session: SessionId,
        qp_index: usize,
        pd: &ProtectionDomain,
        qp: QueuePair,
        config: &ReactorConfig,
        shared: Option<SharedRing>,
    ) -> crate::Result<Self> {
        let slot_size = config.slot_size.max(IMM_TRAILER_LEN);
        let recv_depth = match shared {
            Some(_) => config.recv_depth.max(2),
            None => config.recv_depth.min(qp.max_recv_wr()).max(2),
        };
        // A power of two, so the ring index stays continuous when seq wraps.
        let sq_depth = prev_power_of_two(sq_room(config, &qp).max(MIN_SQ_DEPTH));
        let signal_interval = config.signal_interval.clamp(1, sq_depth / 2);
        // Powers of two, so ring positions are masks, not divisions (a DIV
        // on every message shows up in latency, under emulation most of all).
        let send_slots = config
            .send_slots
            .max(2 * signal_interval)
            .next_power_of_two();
        let shared_recv = shared.is_some();
        let (recv_region, recv_ring, recv_slots, recv_registration) = match shared {
            Some(shared) => (None, shared.ring, shared.slots, shared.registration),
            None => {
                let region =
                    pd.alloc_mr(slot_size * recv_depth as usize, AccessFlags::LOCAL_WRITE)?;
                let ring = Ring::of(&region);
                let registration = region.registration().clone();
                (Some(region), ring, recv_depth, registration)
            }
        };
        let send_region = pd.alloc_mr(slot_size * send_slots as usize, AccessFlags::empty())?;
        let max_inline = qp.max_inline_data();
        Ok(Self {
            id,
            send_tag: wr_id::send(id.key(), 0),
            recv_tag: wr_id::recv(id.key(), 0),
            session,
            qp_index,
            qpn: qp.qpn(),
            binds: qp.bound_windows(),
            state: ConnState::Connecting,
            direct: false,
            protocol_qpn: u64::from(qp.qpn()),
            qp,
            recv_ring,
            send_ring: Ring::of(&send_region),
            regions: (recv_region, send_region),
            shared_recv,
            recv_registration,
            slot_size,
            recv_depth,
            recv_slots,
            ring_slots: RingSlots::new(if shared_recv { 0 } else { recv_slots }),
            send_slots,
            send_head: 0,
            send_in_use: 0,
            ops: vec![SqOp::default(); sq_depth as usize].into_boxed_slice(),
            owned: std::iter::repeat_with(|| None)
                .take(sq_depth as usize)
                .collect(),
            sq_depth,
            sq_next: 0,
            sq_done: 0,
            unposted: 0,
            since_signal: 0,
            // Its first post is signaled.
            posted_after_spell: SpellMark::NEW,
            signal_interval,
            max_inline,
            peer_posted: 0,
            consumed: 0,
            posted: 0,
            advertised: 0,
            received: 0,
            credit_threshold: (recv_depth / 4).max(1),
            batch: SendList::new(),
            has_staged_send: false,
            // A peer that ignores its credits can consume more SRQ slots than
            // its quota; every one of them must find its way back.
            pending_reposts: vec![0; recv_slots as usize].into_boxed_slice(),
            pending_len: 0,
            reposts: RecvBatch::new(),
            repost_threshold: (config.repost_batch as usize)
                .clamp(1, MAX_REPOST.min(recv_depth as usize / 2).max(1)),
            kept: None,
            kept_in_flight: 0,
        })
    }

    /// A direct connection (see `direct`): established at once, with rings
    /// of two 4-byte slots that nothing ever posts (the rest of the
    /// connection's machinery is idle, and stays correct, around them).
    pub(crate) fn new_direct(
        id: ConnId,
        session: SessionId,
        qp_index: usize,
        pd: &ProtectionDomain,
        qp: QueuePair,
        config: &ReactorConfig,
    ) -> crate::Result<Self> {
        let token = ReactorConfig {
            slot_size: IMM_TRAILER_LEN,
            recv_depth: 2,
            send_slots: 2,
            signal_interval: 1,
            sq_depth: MIN_SQ_DEPTH,
            ..config.clone()
        };
        let mut conn = Self::new(id, session, qp_index, pd, qp, &token, None)?;
        conn.direct = true;
        conn.protocol_qpn = NO_QPN;
        conn.state = ConnState::Direct;
        // The reactor posts nothing of its own on a direct QP
        // (`send_wr_id` and `recv_wr_id` are never asked), so its tags are
        // the direct ones its handler's requests carry.
        conn.send_tag = direct_send_tag(id.key());
        conn.recv_tag = direct_recv_tag(id.key());
        Ok(conn)
    }

    /// Posting on a direct connection's QP: the QP with the tags its
    /// requests' `wr_id`s carry.
    #[inline]
    pub(crate) fn direct_qp(&mut self) -> Option<DirectQp<'_>> {
        debug_assert!(
            self.state != ConnState::Direct
                || (self.send_tag == direct_send_tag(self.id.key())
                    && self.recv_tag == direct_recv_tag(self.id.key()))
        );
        (self.state == ConnState::Direct).then_some(DirectQp {
            qp: &mut self.qp,
            send_tag: self.send_tag,
            recv_tag: self.recv_tag,
        })
    }

    /// Bytes registered for this connection alone: its own receive ring
    /// (none with an SRQ) and its send slots.
    pub(crate) fn registered_bytes(&self) -> (usize, usize) {
        let (recv, send) = &self.regions;
        (recv.as_ref().map_or(0, MemoryRegion::len), send.len())
    }

    /// Largest payload of one SEND: a slot less the room a user
    /// immediate's trailer takes (the same with or without one, so a
    /// received message can always be forwarded with an immediate).
    pub(crate) fn max_payload(&self) -> usize {
        self.slot_size - IMM_TRAILER_LEN
    }

    /// Marks the connection failed. Requests only staged are dropped, and
    /// `release` is called for every forward among them, whose receive
    /// slot belongs to another connection that must get it back.
    ///
    /// Requests already posted stay in the SQ ring with what they point at
    /// (a forward's receive slot, a registration): the device may read or
    /// write that memory until it reports them done. Their completions, now
    /// flushed in error, retire them (`retire_failed`); whatever is left
    /// goes when the QP is destroyed (`shut_down`).
    pub(crate) fn fail(&mut self, mut release: impl FnMut(ConnId, u32, bool)) {
        self.state = ConnState::Failed;
        let unposted = self.batch.len() as u32 + (std::mem::take(&mut self.unposted) & !REFUSED);
        let posted_end = self.sq_next.wrapping_sub(unposted);
        while self.sq_next != posted_end {
            let seq = self.sq_next.wrapping_sub(1);
            let at = (seq & (self.sq_depth - 1)) as usize;
            let op = self.ops[at];
            self.sq_next = seq;
            // Never posted: the device never saw the memory, so what the op
            // holds goes now.
            match (op.kind, op.keep) {
                (OpKind::Send, _) => self.send_in_use -= 1,
                (_, Keep::Cached) => self.kept_in_flight -= 1,
                (_, Keep::Own) => drop(self.owned[at].take()),
                (_, Keep::Nothing) => {}
            }
            if let Some(origin) = op.origin(self.id) {
                release(origin, op.slot, op.from_srq);
            }
        }
        self.batch.clear();
        if !self.shared_recv {
            self.pending_len = 0;
        }
    }

    /// Retires the posted requests of a failed connection that a completion
    /// of `seq` proves done (RC completes in order, and flushes complete
    /// even unsignaled requests), calling `release` for each forward's
    /// receive slot. Returns how many it retired.
    pub(crate) fn retire_failed(
        &mut self,
        seq: u32,
        mut release: impl FnMut(ConnId, u32, bool),
    ) -> u32 {
        let count = self.retire_count(seq);
        for _ in 0..count {
            let (_, op) = self.pop_oldest();
            if let Some(origin) = op.origin(self.id) {
                release(origin, op.slot, op.from_srq);
            }
        }
        count
    }

    /// True once failed or removed: nothing more is posted.
    #[inline]
    pub(crate) fn is_closed(&self) -> bool {
        matches!(self.state, ConnState::Failed | ConnState::Removed)
    }

    /// Stops the QP (outstanding work is flushed) and fails the
    /// connection, calling `release` for the receive slot of every forward
    /// still in the SQ ring. The caller then drops the connection, which
    /// destroys its QP before its rings and the registrations its requests
    /// hold, and only then gives the released slots back: until the QP is
    /// destroyed, the device may still read them.
    pub(crate) fn shut_down(&mut self, mut release: impl FnMut(ConnId, u32, bool)) {
        // Errors add nothing here: the QP is destroyed next either way.
        let _ = self.qp.set_error();
        if self.state != ConnState::Failed {
            self.fail(&mut release);
        }
        // Posted requests whose completions never came: their registrations
        // stay in `owned` and `kept` until the QP is gone (declared after it).
        while self.sq_done != self.sq_next {
            let op = self.ops[(self.sq_done & (self.sq_depth - 1)) as usize];
            self.sq_done = self.sq_done.wrapping_add(1);
            if let Some(origin) = op.origin(self.id) {
                release(origin, op.slot, op.from_srq);
            }
        }
        self.state = ConnState::Removed;
    }

    /// Moves the QP of a failed connection to the error state, so the peer
    /// sees the failure too, and drains its send queue: a signaled request
    /// behind those in flight, whose flushed completion names the newest
    /// of them and so retires them all (`retire_failed`). Without it, a
    /// request that completed unsignaled before the failure would report
    /// nothing, and what it holds (a forward's receive slot of another
    /// connection or of the SRQ) would wait for the session's removal.
    /// If either step fails, that is where it waits (`shut_down`).
    pub(crate) fn stop_qp(&mut self) {
        if self.qp.set_error().is_err() || self.sq_used() == 0 {
            return;
        }
        let newest = self.sq_next.wrapping_sub(1);
        // `fail` emptied it: nothing staged is dropped here.
        debug_assert!(self.batch.is_empty());
        let drain = SendDescriptor::drain();
        if self
            .batch
            .push(self.send_wr_id(newest), SendFlags::SIGNALED, &drain)
        {
            // Errors add nothing: the connection is failed already.
            let _ = self.qp.post_list(&mut self.batch);
        }
        self.batch.clear();
    }

    /// Queue depths in use (for tests and diagnostics).
    pub(crate) fn stats(&self) -> ConnStats {
        ConnStats {
            sq_used: self.sq_used(),
            send_slots_used: self.send_in_use,
            credits: self.credits(),
        }
    }
}

#[cfg(test)]
impl Conn {
    /// Receive slots consumed and queued for reposting.
    pub(crate) fn pending_slots(&self) -> &[u32] {
        &self.pending_reposts[..self.pending_len]
    }

    /// Receives posted on the QP and not yet consumed.
    pub(crate) fn receives_outstanding(&self) -> u32 {
        self.posted.wrapping_sub(self.received)
    }

    /// Receives the peer was granted so far (the highest count announced).
    pub(crate) fn granted(&self) -> u32 {
        self.advertised
    }
}

/// The fewest send-queue entries a connection works with.
pub(crate) const MIN_SQ_DEPTH: u32 = 4;

/// The send-queue entries of `qp` the reactor may use before rounding: its
/// configured depth, at most the QP's, less the entries the QP's window
/// binds hold (until a signaled completion retires them, which the reactor
/// does not track: it leaves them their entries for good).
pub(crate) fn sq_room(config: &ReactorConfig, qp: &QueuePair) -> u32 {
    config
        .sq_depth
        .min(qp.max_send_wr().saturating_sub(qp.bound_windows()))
}

fn prev_power_of_two(n: u32) -> u32 {
    1 << (31 - n.leading_zeros())
}
