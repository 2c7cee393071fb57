//! Per-connection state of the reactor: its QP, the receive ring, the
//! send-slot ring, send-queue accounting with selective signaling, credits,
//! and the staged requests that become one doorbell per pass.
//!
//! Everything here is sized at registration and never grows: the data path
//! only moves indices around preallocated arrays.

mod wr_id;

use crate::error::Error;
use crate::verbs::{
    AccessFlags, LocalSlice, MemoryRegion, ProtectionDomain, QueuePair, RecvBatch, RecvRequest,
    Registration, RemoteSlice, SendDescriptor, SendFlags, SendList, SendOpcode, Sge,
};

use super::{ConnId, ReactorConfig, SendError, SessionId};

pub(crate) use wr_id::{MAX_CONNS, SRQ_CONN, WrKind};
pub(crate) use wr_id::{decode as decode_wr_id, same_generation, srq_recv as srq_recv_wr_id};

/// Bytes in front of every SEND payload: the sender's cumulative count of
/// receives it has posted (piggybacked credits), then 4 reserved bytes.
pub(crate) const CREDIT_HEADER_LEN: usize = 8;
/// Most requests staged for one QP in one pass (one doorbell).
pub(crate) const MAX_STAGED: usize = 64;
/// Most receives reposted with one `ibv_post_recv`.
pub(crate) const MAX_REPOST: usize = 64;

/// An operation on the send queue, remembered until a signaled completion
/// at or after it proves it done.
#[derive(Clone, Debug, Default)]
pub(crate) struct SqOp {
    pub(crate) kind: OpKind,
    /// For a forward, the receive slot of connection `origin` to repost.
    pub(crate) slot: u32,
    /// For a forward: the connection whose receive slot this SEND carried.
    pub(crate) origin: Option<ConnId>,
    /// For a forward: the slot is one of the reactor's SRQ.
    pub(crate) from_srq: bool,
    /// For a WRITE or READ: the registration of its local memory, held
    /// until the request is known complete so the memory stays registered
    /// and mapped while the device may use it.
    pub(crate) keep: Option<Registration>,
}

impl SqOp {
    fn of(kind: OpKind) -> Self {
        Self {
            kind,
            ..Self::default()
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum OpKind {
    #[default]
    Credit,
    Send,
    Write,
    Read,
    /// A SEND straight out of a held receive slot of another connection.
    Forward,
}

/// A reactor's shared receive queue as a connection sees it: the ring its
/// receives land in and the ring's size. The reactor reposts its slots.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SharedRing {
    pub(crate) ring: Ring,
    pub(crate) slots: u32,
}

/// Builds the receive request with id `wr_id` for slot `slot` of `ring`.
#[inline]
pub(crate) fn recv_request(
    ring: Ring,
    slot_size: usize,
    wr_id: u64,
    slot: u32,
) -> RecvRequest<'static> {
    RecvRequest::from_raw(
        wr_id,
        ring.slot_addr(slot, slot_size),
        slot_size as u32,
        ring.lkey,
    )
}

/// A held receive slot as the source of a forward: where its bytes are
/// (to stamp the credit header) and how the NIC addresses them.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SlotSource {
    ptr: *mut u8,
    addr: u64,
    lkey: u32,
}

/// Where a registered ring of slots lives.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Ring {
    ptr: *mut u8,
    addr: u64,
    lkey: u32,
}

impl Ring {
    pub(crate) fn of(region: &MemoryRegion) -> Self {
        Self {
            ptr: region.registration().ptr_at(0),
            addr: region.addr(),
            lkey: region.lkey(),
        }
    }

    /// The registered address of slot `slot`.
    #[inline]
    fn slot_addr(&self, slot: u32, slot_size: usize) -> u64 {
        self.addr + u64::from(slot) * slot_size as u64
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ConnState {
    /// Waiting for the peer's first credit update.
    Connecting,
    Established,
    /// A completion failed or posting failed; the handler was told.
    Failed,
    /// The session was removed: nothing is owned any more.
    Removed,
}

pub(crate) struct Conn {
    pub(crate) id: ConnId,
    pub(crate) session: SessionId,
    /// The QP's position among its session's QPs.
    pub(crate) qp_index: usize,
    pub(crate) qpn: u32,
    pub(crate) state: ConnState,
    // Declared before the rings' registrations: the QP is destroyed first.
    // Only this connection posts on it (the reactor took it whole).
    qp: QueuePair,
    // Receive ring and send slots, `slot_size` bytes per slot. The rings are
    // addressed through their cached base, lkey and pointer; `regions` owns
    // the registrations.
    recv_ring: Ring,
    send_ring: Ring,
    /// Own receive ring (none with an SRQ) and send slots.
    _regions: (Option<MemoryRegion>, MemoryRegion),
    /// Set when receives come from the reactor's SRQ.
    shared_recv: bool,
    pub(crate) slot_size: usize,
    /// Receives this connection may have outstanding: its ring, or its
    /// credit quota in the SRQ.
    pub(crate) recv_depth: u32,
    /// Slots in the ring receives land in (bounds for slot indices).
    recv_slots: u32,
    send_slots: u32,
    // Send-slot ring: slots are used and released in SQ order.
    send_head: u32,
    send_in_use: u32,
    // Send-queue accounting: ops[seq % depth] for seq in [sq_done, sq_next).
    ops: Box<[SqOp]>,
    sq_depth: u32,
    sq_next: u32,
    sq_done: u32,
    since_signal: u32,
    signal_interval: u32,
    max_inline: u32,
    // Credits (all cumulative, wrapping): receives the peer has posted, RECV-
    // consuming requests we have posted, receives we have posted and told.
    peer_posted: u32,
    consumed: u32,
    posted: u32,
    advertised: u32,
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
    /// Registrations of requests that were in flight when the connection
    /// failed: kept until the QP is destroyed with the connection.
    retired: Vec<Registration>,
}

// SAFETY: the raw pointers in the rings point into this Conn's own regions,
// or into the reactor's SRQ region, which lives as long as the reactor that
// owns this Conn; moving the Conn to another thread moves none of that memory.
unsafe impl Send for Conn {}

impl Conn {
    pub(crate) fn new(
        id: ConnId,
        session: SessionId,
        qp_index: usize,
        pd: &ProtectionDomain,
        qp: QueuePair,
        config: &ReactorConfig,
        shared: Option<SharedRing>,
    ) -> crate::Result<Self> {
        let slot_size = config.slot_size.max(CREDIT_HEADER_LEN);
        let recv_depth = match shared {
            Some(_) => config.recv_depth.max(2),
            None => config.recv_depth.min(qp.max_recv_wr()).max(2),
        };
        // A power of two, so the ring index stays continuous when seq wraps.
        let sq_depth = prev_power_of_two(config.sq_depth.min(qp.max_send_wr()).max(4));
        let signal_interval = config.signal_interval.clamp(1, sq_depth / 2);
        // Powers of two, so ring positions are masks, not divisions (a DIV
        // on every message shows up in latency, under emulation most of all).
        let send_slots = config
            .send_slots
            .max(2 * signal_interval)
            .next_power_of_two();
        let (recv_region, recv_ring, recv_slots) = match shared {
            Some(shared) => (None, shared.ring, shared.slots),
            None => {
                let region =
                    pd.alloc_mr(slot_size * recv_depth as usize, AccessFlags::LOCAL_WRITE)?;
                let ring = Ring::of(&region);
                (Some(region), ring, recv_depth)
            }
        };
        let send_region = pd.alloc_mr(slot_size * send_slots as usize, AccessFlags::empty())?;
        let max_inline = qp.max_inline_data();
        Ok(Self {
            id,
            session,
            qp_index,
            qpn: qp.qpn(),
            state: ConnState::Connecting,
            qp,
            recv_ring,
            send_ring: Ring::of(&send_region),
            _regions: (recv_region, send_region),
            shared_recv: shared.is_some(),
            slot_size,
            recv_depth,
            recv_slots,
            send_slots,
            send_head: 0,
            send_in_use: 0,
            ops: vec![SqOp::default(); sq_depth as usize].into_boxed_slice(),
            sq_depth,
            sq_next: 0,
            sq_done: 0,
            since_signal: 0,
            signal_interval,
            max_inline,
            peer_posted: 0,
            consumed: 0,
            posted: 0,
            advertised: 0,
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
            retired: Vec::new(),
        })
    }

    /// Largest payload of one SEND.
    pub(crate) fn max_payload(&self) -> usize {
        self.slot_size - CREDIT_HEADER_LEN
    }

    /// Credits available for RECV-consuming requests (may be negative before
    /// the peer's first update).
    #[inline]
    fn credits(&self) -> i32 {
        self.peer_posted.wrapping_sub(self.consumed) as i32
    }

    /// Send-queue entries in use (posted or staged, not known complete).
    #[inline]
    fn sq_used(&self) -> u32 {
        self.sq_next.wrapping_sub(self.sq_done)
    }

    /// Posts the whole receive ring; called once at registration. With an
    /// SRQ the reactor posted the receives; the quota becomes our credit.
    pub(crate) fn post_initial_receives(&mut self) -> crate::Result<()> {
        if self.shared_recv {
            self.posted = self.recv_depth;
            return Ok(());
        }
        for slot in 0..self.recv_depth {
            self.queue_repost(slot);
        }
        self.flush_reposts()
    }

    /// Queues receive slot `slot` for reposting at the end of the pass.
    #[inline]
    pub(crate) fn queue_repost(&mut self, slot: u32) {
        // A closed connection's own ring is dead, but SRQ slots belong to
        // every connection and must go back.
        let dead = self.is_closed() && !self.shared_recv;
        if dead || self.pending_len == self.pending_reposts.len() || slot >= self.recv_slots {
            return;
        }
        self.pending_reposts[self.pending_len] = slot;
        self.pending_len += 1;
    }

    /// True if consumed receives wait to be reposted.
    #[inline]
    pub(crate) fn has_pending_reposts(&self) -> bool {
        self.pending_len != 0
    }

    /// True when enough receives are consumed to repost them now.
    #[inline]
    pub(crate) fn reposts_due(&self) -> bool {
        self.pending_len >= self.repost_threshold
    }

    /// True when receives come from the reactor's SRQ.
    #[inline]
    pub(crate) fn uses_srq(&self) -> bool {
        self.shared_recv
    }

    /// Reposts every queued slot of the connection's own ring,
    /// `MAX_REPOST` per `ibv_post_recv`, and counts them as credits for the
    /// peer. (SRQ slots go back through [`take_shared_reposts`].)
    #[inline]
    pub(crate) fn flush_reposts(&mut self) -> crate::Result<()> {
        if self.shared_recv {
            return Ok(());
        }
        let key = self.id.key();
        let mut start = 0;
        while start < self.pending_len {
            let end = (start + MAX_REPOST).min(self.pending_len);
            for &slot in &self.pending_reposts[start..end] {
                let request =
                    recv_request(self.recv_ring, self.slot_size, wr_id::recv(key, slot), slot);
                // At most MAX_REPOST pushes into a batch emptied by each post.
                let _ = self.reposts.push(request);
            }
            self.qp.post_recv_batch(&mut self.reposts)?;
            self.posted = self.posted.wrapping_add((end - start) as u32);
            start = end;
        }
        self.pending_len = 0;
        Ok(())
    }

    /// Hands every queued SRQ slot to `repost` (the reactor's SRQ) and counts
    /// them as credits for the peer.
    #[inline]
    pub(crate) fn take_shared_reposts(&mut self, mut repost: impl FnMut(u32)) {
        if !self.shared_recv {
            return;
        }
        for &slot in &self.pending_reposts[..self.pending_len] {
            repost(slot);
        }
        self.posted = self.posted.wrapping_add(self.pending_len as u32);
        self.pending_len = 0;
    }

    /// The credit header and the payload (address, length) of a SEND of
    /// `len` bytes in receive slot `slot`; `None` for a message too short to
    /// carry a header (a credit update) or a slot outside the ring.
    #[inline]
    pub(crate) fn recv_message(&self, slot: u32, len: u32) -> Option<(u32, (*const u8, usize))> {
        let len = len as usize;
        if len < CREDIT_HEADER_LEN || len > self.slot_size || slot >= self.recv_slots {
            return None;
        }
        // SAFETY: the ring is registered while the connection lives and the
        // slot's `len` bytes lie inside it; its receive completed and it is
        // not reposted before the caller is done, so no DMA writes it.
        unsafe {
            let start = self.recv_slot_ptr(slot);
            let credit = u32::from_le(start.cast::<u32>().read_unaligned());
            Some((
                credit,
                (start.add(CREDIT_HEADER_LEN), len - CREDIT_HEADER_LEN),
            ))
        }
    }

    /// The bytes of receive slot `slot`.
    #[inline]
    pub(crate) fn recv_bytes(&self, slot: u32, len: usize) -> &[u8] {
        if slot >= self.recv_slots {
            return &[];
        }
        let len = len.min(self.slot_size);
        // SAFETY: the ring is registered while the connection lives and the
        // range is inside it; the caller holds the slot (its receive
        // completed and it is not reposted until released), so no DMA writes it.
        unsafe { std::slice::from_raw_parts(self.recv_slot_ptr(slot), len) }
    }

    /// Where receive slot `slot` starts in memory.
    ///
    /// # Safety
    /// `slot` must be below `recv_slots`.
    #[inline]
    unsafe fn recv_slot_ptr(&self, slot: u32) -> *const u8 {
        // SAFETY: the caller keeps `slot` inside the ring, so the offset
        // stays within the registered allocation.
        unsafe { self.recv_ring.ptr.add(slot as usize * self.slot_size) }
    }

    /// Where receive slot `slot` is, to send it on as a forward; `None` for
    /// a slot outside the ring.
    #[inline]
    pub(crate) fn recv_slot_source(&self, slot: u32) -> Option<SlotSource> {
        if slot >= self.recv_slots {
            return None;
        }
        Some(SlotSource {
            // SAFETY: `slot` is inside the ring, which is still registered.
            ptr: unsafe { self.recv_slot_ptr(slot) }.cast_mut(),
            addr: self.recv_ring.slot_addr(slot, self.slot_size),
            lkey: self.recv_ring.lkey,
        })
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

    /// Whether posting a request now would be refused, and why.
    #[inline]
    fn admit(&self, consumes_recv: bool, needs_slot: bool) -> Result<(), SendError> {
        match self.state {
            ConnState::Established => {}
            ConnState::Connecting => return Err(SendError::WouldBlock),
            ConnState::Failed | ConnState::Removed => return Err(SendError::Closed),
        }
        // One SQ entry and one credit stay reserved for credit updates, so a
        // busy sender can always tell its peer that it may send again.
        if self.sq_used() + 1 >= self.sq_depth || self.batch.is_full() {
            return Err(SendError::WouldBlock);
        }
        if consumes_recv && self.credits() < 2 {
            return Err(SendError::WouldBlock);
        }
        if needs_slot && self.send_in_use >= self.send_slots {
            return Err(SendError::WouldBlock);
        }
        Ok(())
    }

    /// Records `op` in the SQ ring, decides its signaling, and stages it.
    #[inline]
    fn stage(&mut self, request: SendDescriptor, op: SqOp) -> u32 {
        self.stage_signaled(request, op, false)
    }

    #[inline]
    fn stage_signaled(&mut self, request: SendDescriptor, op: SqOp, force_signal: bool) -> u32 {
        let seq = self.sq_next;
        self.sq_next = seq.wrapping_add(1);
        self.ops[(seq & (self.sq_depth - 1)) as usize] = op;
        // Selective signaling: every Nth request, and early whenever the SQ or
        // the slot ring gets low, so resources held by unsignaled requests are
        // always freed by a later signaled one.
        let sq_left = self.sq_depth - self.sq_used();
        let slots_left = self.send_slots - self.send_in_use;
        self.since_signal += 1;
        let signal = force_signal
            || self.since_signal >= self.signal_interval
            || sq_left <= self.signal_interval
            || slots_left < self.signal_interval;
        let mut flags = SendFlags::empty();
        if signal {
            flags |= SendFlags::SIGNALED;
            self.since_signal = 0;
        }
        if request.local.len <= self.max_inline && request.opcode != SendOpcode::Read {
            flags |= SendFlags::INLINE;
        }
        // admit() checked the room.
        self.batch
            .push(wr_id::send(self.id.key(), seq), flags, &request);
        seq
    }

    /// Stages a SEND whose payload `fill` writes into a free send slot of
    /// `capacity` bytes, returning how many it wrote (`None`: stage nothing).
    #[inline]
    pub(crate) fn stage_send(
        &mut self,
        capacity: usize,
        imm: Option<u32>,
        fill: impl FnOnce(&mut [u8]) -> Option<usize>,
    ) -> Result<u32, SendError> {
        if capacity > self.max_payload() {
            return Err(SendError::TooLarge {
                len: capacity,
                max: self.max_payload(),
            });
        }
        self.admit(true, true)?;
        let slot = (self.send_head + self.send_in_use) & (self.send_slots - 1);
        let start = slot as usize * self.slot_size;
        // SAFETY: the send ring is registered while the connection lives;
        // the slot is free (no posted request references it: slots are
        // released only when a completion proves their SEND done) and lies
        // inside the ring; we hold &mut self, and nothing else reaches the
        // send ring (it has no remote access).
        let bytes = unsafe {
            std::slice::from_raw_parts_mut(
                self.send_ring.ptr.add(start),
                CREDIT_HEADER_LEN + capacity,
            )
        };
        let Some(len) = fill(&mut bytes[CREDIT_HEADER_LEN..]) else {
            return Err(SendError::Cancelled);
        };
        let len = len.min(capacity);
        let header = bytes.as_mut_ptr();
        self.send_in_use += 1;
        let addr = self.send_ring.addr + start as u64;
        let sge = Sge {
            addr,
            len: (CREDIT_HEADER_LEN + len) as u32,
            lkey: self.send_ring.lkey,
        };
        Ok(self.stage_credited_send(header, sge, imm, SqOp::of(OpKind::Send)))
    }

    /// Stages a SEND of `len` bytes (header included) straight from receive
    /// slot `slot` of connection `origin`, which is reposted when it completes.
    #[inline]
    pub(crate) fn stage_forward(
        &mut self,
        source: SlotSource,
        len: usize,
        imm: Option<u32>,
        origin: ConnId,
        slot: u32,
        from_srq: bool,
    ) -> Result<u32, SendError> {
        if len - CREDIT_HEADER_LEN > self.max_payload() {
            return Err(SendError::TooLarge {
                len: len - CREDIT_HEADER_LEN,
                max: self.max_payload(),
            });
        }
        self.admit(true, false)?;
        let op = SqOp {
            kind: OpKind::Forward,
            slot,
            origin: Some(origin),
            from_srq,
            keep: None,
        };
        let sge = Sge {
            addr: source.addr,
            len: len as u32,
            lkey: source.lkey,
        };
        Ok(self.stage_credited_send(source.ptr, sge, imm, op))
    }

    /// Stages a SEND (address, length, lkey in `sge`) that consumes one peer
    /// receive, and stamps our receive count into its `header`. The count
    /// cannot grow before the doorbell: receives are reposted only after the
    /// doorbell of the pass that staged this.
    #[inline]
    fn stage_credited_send(
        &mut self,
        header: *mut u8,
        sge: Sge,
        imm: Option<u32>,
        op: SqOp,
    ) -> u32 {
        // SAFETY: `header` starts a send slot or a held receive slot that this
        // request is about to carry: at least CREDIT_HEADER_LEN bytes we own,
        // which no posted request reads yet.
        unsafe { header.cast::<u32>().write_unaligned(self.posted.to_le()) };
        let request = SendDescriptor::send(sge, imm);
        self.consumed = self.consumed.wrapping_add(1);
        self.has_staged_send = true;
        self.stage(request, op)
    }

    /// Stages a WRITE (or WRITE_WITH_IMM, which consumes a peer receive).
    #[inline]
    pub(crate) fn stage_write(
        &mut self,
        local: &LocalSlice<'_>,
        remote: RemoteSlice,
        imm: Option<u32>,
    ) -> Result<u32, SendError> {
        if local.len() != remote.len() {
            return Err(SendError::Invalid(Error::InvalidArgument(
                "local and remote lengths of an RDMA operation differ",
            )));
        }
        self.admit(imm.is_some(), false)?;
        if imm.is_some() {
            self.consumed = self.consumed.wrapping_add(1);
        }
        let request = SendDescriptor::write(Sge::from(local), remote, imm);
        let op = SqOp {
            keep: Some(local.registration().clone()),
            ..SqOp::of(OpKind::Write)
        };
        Ok(self.stage(request, op))
    }

    /// Stages a READ of `remote` into `local`.
    #[inline]
    pub(crate) fn stage_read(
        &mut self,
        local: &LocalSlice<'_>,
        remote: RemoteSlice,
    ) -> Result<u32, SendError> {
        if local.len() != remote.len() {
            return Err(SendError::Invalid(Error::InvalidArgument(
                "local and remote lengths of an RDMA operation differ",
            )));
        }
        if !local.access.contains(AccessFlags::LOCAL_WRITE) {
            return Err(SendError::Invalid(Error::InvalidArgument(
                "a READ target must be registered with LOCAL_WRITE",
            )));
        }
        self.admit(false, false)?;
        let request = SendDescriptor::read(Sge::from(local), remote);
        let op = SqOp {
            keep: Some(local.registration().clone()),
            ..SqOp::of(OpKind::Read)
        };
        // Always signaled: a READ's completion is the only sign its data has
        // landed, and callers wait for it.
        Ok(self.stage_signaled(request, op, true))
    }

    /// Signals the last staged request, so it and everything before it
    /// report completion without waiting for the signaling interval.
    pub(crate) fn signal_last_staged(&mut self) {
        if self.batch.flag_last(SendFlags::SIGNALED) {
            self.since_signal = 0;
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
            force_signal || last_credit,
        );
    }

    /// How many ops a signaled completion of `seq` retires: it and every
    /// earlier one (RC completes the send queue in order). Zero if `seq` is
    /// not in flight.
    #[inline]
    pub(crate) fn retire_count(&self, seq: u32) -> u32 {
        let count = seq.wrapping_sub(self.sq_done).wrapping_add(1);
        if count <= self.sq_used() { count } else { 0 }
    }

    /// Retires the oldest op, releasing its send slot (and the
    /// registration it kept).
    #[inline]
    pub(crate) fn pop_oldest(&mut self) -> (u32, SqOp) {
        let seq = self.sq_done;
        let op = std::mem::take(&mut self.ops[(seq & (self.sq_depth - 1)) as usize]);
        self.sq_done = seq.wrapping_add(1);
        if op.kind == OpKind::Send {
            self.send_head = (self.send_head + 1) & (self.send_slots - 1);
            self.send_in_use -= 1;
        }
        (seq, op)
    }

    /// Marks everything staged and in flight as dead (after a failure).
    /// Calls `release` for every forward among them, whose receive slot
    /// belongs to another connection that must get it back.
    ///
    /// Requests already posted may still be in flight on the QP until it
    /// is destroyed, so their registrations stay with the connection
    /// (moved to `retired`) rather than being dropped here.
    pub(crate) fn fail(&mut self, mut release: impl FnMut(ConnId, u32, bool)) {
        self.state = ConnState::Failed;
        while self.sq_used() > 0 {
            let (_, op) = self.pop_oldest();
            if let (OpKind::Forward, Some(origin)) = (op.kind, op.origin) {
                release(origin, op.slot, op.from_srq);
            }
            if let Some(keep) = op.keep {
                // Bounded by the SQ depth: this runs once per connection.
                self.retired.push(keep);
            }
        }
        self.batch.clear();
        if !self.shared_recv {
            self.pending_len = 0;
        }
    }

    /// True if this connection holds SRQ slots that must be reposted even
    /// though it is closed.
    #[inline]
    pub(crate) fn owes_shared_slots(&self) -> bool {
        self.shared_recv && self.pending_len != 0
    }

    /// True once failed or removed: nothing more is posted.
    #[inline]
    pub(crate) fn is_closed(&self) -> bool {
        matches!(self.state, ConnState::Failed | ConnState::Removed)
    }

    /// Stops the QP (outstanding work is flushed) and fails the
    /// connection; the caller then drops it, which destroys the QP before
    /// its rings are deregistered.
    pub(crate) fn shut_down(&mut self, release: impl FnMut(ConnId, u32, bool)) {
        // Errors add nothing here: the QP is destroyed next either way.
        let _ = self.qp.set_error();
        if self.state != ConnState::Failed {
            self.fail(release);
        }
        self.state = ConnState::Removed;
    }

    /// Moves the QP to the error state, so the peer sees the failure too.
    pub(crate) fn stop_qp(&self) {
        // Errors add nothing: the connection is failed already.
        let _ = self.qp.set_error();
    }

    /// Rings the doorbell for everything staged.
    #[inline]
    pub(crate) fn post_staged(&mut self) -> crate::Result<()> {
        self.qp.post_list(&mut self.batch)
    }

    /// Queue depths in use (for tests and diagnostics).
    pub(crate) fn stats(&self) -> (u32, u32, i32) {
        (self.sq_used(), self.send_in_use, self.credits())
    }
}

fn prev_power_of_two(n: u32) -> u32 {
    1 << (31 - n.leading_zeros())
}
