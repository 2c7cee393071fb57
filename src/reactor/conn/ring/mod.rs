//! A connection's receive side ([`RecvRing`]): the ring its receives land
//! in (its own, or the reactor's SRQ), consumed slots waiting to be
//! reposted, where each slot of its own ring is (so none is posted twice),
//! and the views of a received message's bytes.

use crate::verbs::{
    AccessFlags, MemoryRegion, ProtectionDomain, QueuePair, RecvSlots, Registration,
};

use super::credit::{Arrival, Credits, send_imm};
use super::slots::{IMM_TRAILER_LEN, Ring, RingSlots, SharedRing, SlotSource};

/// Most receives reposted with one `ibv_post_recv`.
pub(crate) const MAX_REPOST: usize = 64;

/// A connection's receive side: where its receives land, which slots
/// wait to be posted again, and the decoding of what arrived.
pub(crate) struct RecvRing {
    /// The top 32 bits of every receive's `wr_id` (see `Conn::new`).
    tag: u64,
    ring: Ring,
    slot_size: usize,
    /// Receives the connection may have outstanding: its ring, or its
    /// credit quota in the SRQ.
    depth: u32,
    /// Slots in the ring receives land in (bounds for slot indices).
    slots: u32,
    /// Receives come from the reactor's SRQ.
    shared: bool,
    /// Where each slot of the own ring is (none with an SRQ).
    ring_slots: RingSlots,
    /// Slots consumed and waiting to be reposted: each slot is in here at
    /// most once, so one entry per slot of the ring (own or SRQ) always
    /// suffices.
    pending: Box<[u32]>,
    pending_len: usize,
    /// Each slot's receive of the own ring, built once (none with an SRQ,
    /// whose pool posts its slots).
    requests: Option<RecvSlots>,
    /// Reposts wait for this many, or for an idle pass (0 while SRQ slots
    /// given back wait to be credited: see `uncredited`).
    threshold: usize,
    /// The repost batch `threshold` holds otherwise.
    repost_batch: usize,
    /// SRQ slots handed back to the pool whose receives are not credited
    /// yet: a connection counts them only once the SRQ has posted them, so
    /// that no credit announces a receive the SRQ refused. While any wait,
    /// the connection is due, and each flush asks the pool again.
    uncredited: u32,
    /// SRQ slots this connection consumed, and those it queued to go back
    /// (both cumulative, wrapping): the difference is what it has out,
    /// held by its handler or in forwards, which its removal orphans.
    shared_taken: u32,
    shared_queued: u32,
    /// The ring's registration (own or the SRQ's): forwards out of it keep
    /// a clone until they complete.
    registration: Registration,
    /// The own ring's region (none with an SRQ). The connection declares
    /// its QP first, so the QP is destroyed before this is deregistered.
    region: Option<MemoryRegion>,
}

impl RecvRing {
    /// The receive side of a connection with `depth` receives, in slots of
    /// `slot_size` bytes: a ring of its own registered on `pd`, or its
    /// share of the reactor's SRQ (`shared`). Reposts go in batches of
    /// `repost_batch` (at most half the ring). `tag` tops every `wr_id`.
    pub(crate) fn new(
        pd: &ProtectionDomain,
        slot_size: usize,
        depth: u32,
        repost_batch: u32,
        tag: u64,
        shared: Option<SharedRing>,
    ) -> crate::Result<Self> {
        // `decode` takes the trailer off a slot.
        debug_assert!(slot_size >= IMM_TRAILER_LEN);
        // One SGE describes a slot.
        let sge_len = u32::try_from(slot_size).map_err(|_| {
            crate::Error::InvalidArgument("ReactorConfig::slot_size: at most 4 GiB - 1")
        })?;
        let is_shared = shared.is_some();
        let (region, ring, slots, registration, requests) = match shared {
            Some(shared) => (None, shared.ring, shared.slots, shared.registration, None),
            None => {
                let region = pd.alloc_mr(slot_size * depth as usize, AccessFlags::LOCAL_WRITE)?;
                let ring = Ring::of(&region);
                let registration = region.registration().clone();
                // The tag tops each slot's `wr_id` (`wr_id::recv`).
                let requests =
                    RecvSlots::new(region.addr(), region.lkey(), sge_len, depth, |slot| {
                        tag | u64::from(slot)
                    });
                (Some(region), ring, depth, registration, Some(requests))
            }
        };
        let repost_batch =
            (repost_batch as usize).clamp(1, MAX_REPOST.min(depth as usize / 2).max(1));
        Ok(Self {
            tag,
            ring,
            slot_size,
            depth,
            slots,
            shared: is_shared,
            ring_slots: RingSlots::new(if is_shared { 0 } else { slots }),
            // A peer that ignores its credits can consume more SRQ slots
            // than its quota; every one of them must find its way back.
            pending: vec![0; slots as usize].into_boxed_slice(),
            pending_len: 0,
            requests,
            threshold: repost_batch,
            repost_batch,
            uncredited: 0,
            shared_taken: 0,
            shared_queued: 0,
            registration,
            region,
        })
    }

    /// Replaces the `wr_id` tag (a direct connection's, whose receives its
    /// handler posts).
    pub(super) fn retag(&mut self, tag: u64) {
        self.tag = tag;
        if let Some(requests) = &mut self.requests {
            requests.retag(|slot| tag | u64::from(slot));
        }
    }

    /// The tag that tops every receive's `wr_id`.
    pub(crate) fn tag(&self) -> u64 {
        self.tag
    }

    /// Receives the connection may have outstanding.
    pub(crate) fn depth(&self) -> u32 {
        self.depth
    }

    /// Bytes registered for this ring alone (none with an SRQ).
    pub(crate) fn registered_bytes(&self) -> usize {
        self.region.as_ref().map_or(0, MemoryRegion::len)
    }

    /// Posts the whole own ring on `qp`; called once at registration. With
    /// an SRQ the reactor posted the receives, and the quota is granted.
    /// Either way `credits` counts them.
    pub(super) fn post_initial(
        &mut self,
        qp: &mut QueuePair,
        credits: &mut Credits,
    ) -> crate::Result<()> {
        if self.shared {
            credits.add_posted(self.depth);
            return Ok(());
        }
        for slot in 0..self.depth {
            self.queue(slot, false, qp.qpn());
        }
        self.flush(qp, credits)
    }

    /// Queues receive slot `slot` for reposting at the end of the pass. A
    /// slot of the own ring is queued only if it is consumed and not
    /// queued already ([`RingSlots`]): one posted or queued is refused, so
    /// it is never posted twice, and none is queued once the connection is
    /// `closed` (its own ring is dead). (An SRQ slot is the SRQ pool's to
    /// check, and goes back even from a closed connection.)
    #[inline]
    pub(super) fn queue(&mut self, slot: u32, closed: bool, qpn: u32) {
        if self.shared {
            if self.pending_len == self.pending.len() || slot >= self.slots {
                return;
            }
            // There is room: it is queued below.
            self.shared_queued = self.shared_queued.wrapping_add(1);
        } else if closed {
            return;
        } else if !self.ring_slots.queue(slot) {
            // Posted or queued already (or outside the ring): each slot is
            // queued once, so the list (one entry a slot) has room.
            refuse_repost(qpn, slot);
            return;
        }
        if let Some(entry) = self.pending.get_mut(self.pending_len) {
            *entry = slot;
            self.pending_len += 1;
        }
    }

    /// An SRQ receive was routed to this connection.
    #[inline]
    pub(crate) fn note_shared_receive(&mut self) {
        self.shared_taken = self.shared_taken.wrapping_add(1);
    }

    /// SRQ slots this connection consumed and has not queued to go back.
    pub(crate) fn shared_out(&self) -> u32 {
        self.shared_taken.wrapping_sub(self.shared_queued)
    }

    /// A receive completion names slot `slot` of the own ring: true if that
    /// slot is posted (now consumed), false for a completion the ring
    /// cannot have produced.
    #[inline(always)]
    pub(crate) fn consume(&mut self, slot: u32) -> bool {
        self.ring_slots.consume(slot)
    }

    /// True if consumed receives wait to be reposted.
    #[inline]
    pub(crate) fn has_pending(&self) -> bool {
        self.pending_len != 0
    }

    /// True when enough receives are consumed to repost them now.
    #[inline]
    pub(crate) fn is_due(&self) -> bool {
        self.pending_len >= self.threshold
    }

    /// True when receives come from the reactor's SRQ.
    #[inline]
    pub(crate) fn uses_srq(&self) -> bool {
        self.shared
    }

    /// True if SRQ slots wait to go back, which a closed connection owes
    /// too.
    #[inline]
    pub(crate) fn owes_shared_slots(&self) -> bool {
        self.shared && self.pending_len != 0
    }

    /// Forgets the own ring's queued slots (a failed connection's ring is
    /// dead); SRQ slots stay queued, to go back.
    pub(super) fn drop_own_pending(&mut self) {
        if !self.shared {
            self.pending_len = 0;
        }
    }

    /// Reposts every queued slot of the own ring on `qp`, `MAX_REPOST` per
    /// `ibv_post_recv`, and counts them in `credits`. (SRQ slots go back
    /// through [`take_shared`](Self::take_shared).)
    #[inline]
    pub(super) fn flush(&mut self, qp: &mut QueuePair, credits: &mut Credits) -> crate::Result<()> {
        // None with an SRQ.
        let Some(requests) = &mut self.requests else {
            return Ok(());
        };
        for batch in self.pending[..self.pending_len].chunks(MAX_REPOST) {
            self.ring_slots.post_queued(batch)?;
            // SAFETY: the own ring's region, which `requests` describes, is
            // held here, and the connection destroys its QP before dropping
            // this (field order); each slot of `batch` was queued (checked
            // above, once each), so the device holds none of them and the
            // CPU reads none of them until its receive completes.
            unsafe { qp.post_slots(requests, batch) }?;
            credits.add_posted(batch.len() as u32);
        }
        self.pending_len = 0;
        Ok(())
    }

    /// Hands every queued SRQ slot to `repost` (the reactor's SRQ); they
    /// are credited by [`credit_shared`](Self::credit_shared) once the SRQ
    /// has posted them.
    #[inline]
    pub(crate) fn take_shared(&mut self, mut repost: impl FnMut(u32)) {
        if !self.shared {
            return;
        }
        for &slot in &self.pending[..self.pending_len] {
            repost(slot);
        }
        self.uncredited += self.pending_len as u32;
        self.pending_len = 0;
        // Due until credited: the next flush asks the pool again.
        self.threshold = 0;
    }

    /// After the reactor's SRQ posted everything given back to it
    /// (`posted`), counts the slots handed back in `credits`; otherwise
    /// they stay uncredited, and the connection due.
    #[inline]
    pub(super) fn credit_shared(&mut self, posted: bool, credits: &mut Credits) {
        if posted {
            credits.add_posted(std::mem::take(&mut self.uncredited));
            self.threshold = self.repost_batch;
        }
    }

    /// Decodes a SEND of `len` bytes with immediate `imm` that landed in
    /// slot `slot` (see [`send_imm`]). `Err` names what is wrong with a SEND the reactor never
    /// sends: a peer that sends one is cut off.
    #[inline]
    pub(crate) fn decode(
        &self,
        slot: u32,
        len: u32,
        imm: Option<u32>,
    ) -> Result<Arrival, &'static str> {
        let Some(imm) = imm else {
            return Err("a SEND without the reactor's immediate");
        };
        if slot >= self.slots {
            return Err("a receive outside the ring");
        }
        let count = imm & send_imm::COUNT_MASK;
        let len = len as usize;
        let (payload, trailer) = match imm >> send_imm::COUNT_BITS {
            send_imm::MESSAGE => (len, false),
            send_imm::MESSAGE_WITH_IMM if len >= IMM_TRAILER_LEN => (len - IMM_TRAILER_LEN, true),
            send_imm::CREDIT if len == 0 => return Ok(Arrival::Credit(count)),
            send_imm::MESSAGE_WITH_IMM => return Err("a SEND too short for its immediate"),
            send_imm::CREDIT => return Err("a credit update with a payload"),
            _ => return Err("a SEND of an unknown kind"),
        };
        // Past this a forward could not append an immediate in the slot.
        if payload > self.slot_size - IMM_TRAILER_LEN {
            return Err("a message longer than the largest payload");
        }
        // SAFETY: the ring is registered while the connection lives, and
        // the slot's `len` bytes (`len <= slot_size`: the payload fits the
        // largest, and a trailer the rest of the slot) lie inside it; its
        // receive completed and it is not reposted before the caller is
        // done, so no DMA writes it.
        unsafe {
            let start = self.slot_ptr(slot);
            let imm =
                trailer.then(|| u32::from_le(start.add(payload).cast::<u32>().read_unaligned()));
            Ok(Arrival::Message {
                count,
                data: (start, payload),
                imm,
            })
        }
    }

    /// The bytes of slot `slot`.
    #[inline]
    pub(crate) fn bytes(&self, slot: u32, len: usize) -> &[u8] {
        if slot >= self.slots {
            return &[];
        }
        let len = len.min(self.slot_size);
        // SAFETY: the ring is registered while the connection lives and the
        // range is inside it; the caller holds the slot (its receive
        // completed and it is not reposted until released), so no DMA
        // writes it.
        unsafe { std::slice::from_raw_parts(self.slot_ptr(slot), len) }
    }

    /// Where slot `slot` starts in memory.
    ///
    /// # Safety
    /// `slot` must be below `slots`.
    #[inline]
    unsafe fn slot_ptr(&self, slot: u32) -> *const u8 {
        // SAFETY: the caller keeps `slot` inside the ring, so the offset
        // stays within the registered allocation.
        unsafe { self.ring.ptr.add(slot as usize * self.slot_size) }
    }

    /// Where slot `slot` is, to send it on as a forward; `None` for a slot
    /// outside the ring.
    #[inline]
    pub(crate) fn source(&self, slot: u32) -> Option<SlotSource> {
        if slot >= self.slots {
            return None;
        }
        Some(SlotSource {
            // SAFETY: `slot` is inside the ring, which is still registered.
            ptr: unsafe { self.slot_ptr(slot) }.cast_mut(),
            size: self.slot_size,
            addr: self.ring.slot_addr(slot, self.slot_size),
            lkey: self.ring.lkey,
            registration_id: self.registration.id(),
        })
    }

    /// The ring's registration, for a forward that must hold it.
    #[inline]
    pub(crate) fn registration(&self) -> &Registration {
        &self.registration
    }
}

#[cfg(test)]
impl RecvRing {
    /// Slots consumed and queued for reposting.
    pub(crate) fn pending_slots(&self) -> &[u32] {
        &self.pending[..self.pending_len]
    }

    /// Whether slot `slot` of the own ring is posted.
    pub(crate) fn is_posted(&self, slot: u32) -> bool {
        self.ring_slots.is_posted(slot)
    }

    /// Posts a receive into slot `slot` of the own ring on `qp` behind the
    /// ones posted, whatever its state, as a double post would (tests of
    /// the refusal of the completion that follows).
    pub(super) fn post_bypassing_the_guard(
        &mut self,
        qp: &mut QueuePair,
        slot: u32,
    ) -> crate::Result<()> {
        let requests = self
            .requests
            .as_mut()
            .ok_or(crate::Error::InvalidArgument("no own ring"))?;
        // SAFETY: the own ring's region is held here, and the connection
        // destroys its QP before dropping this. This breaks `post_slots`'s
        // "not posted already" on purpose: sound only because the loopback
        // device, the one these tests run on, copies the request, and
        // nothing reads the slot meanwhile.
        unsafe { qp.post_slots(requests, &[slot]) }
    }
}

/// A slot of a connection's own ring given back while posted or queued
/// already: refused, so it is not posted twice. No path of the reactor
/// does it; one that did is a bug, logged here.
#[cold]
#[inline(never)]
fn refuse_repost(qpn: u32, slot: u32) {
    log::error!(
        "receive slot {slot} of QP {qpn:#x} given back while posted or queued: not posted twice"
    );
}

#[cfg(test)]
mod tests;
