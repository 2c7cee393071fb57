//! A connection's receive side: the ring its receives land in (its own,
//! or the reactor's SRQ), consumed slots waiting to be reposted, where each
//! slot of its own ring is (so none is posted twice), and the views of a
//! received message's bytes.

use crate::verbs::{MemoryRegion, RecvRequest, Registration};

use super::credit::{Arrival, send_imm};
use super::{Conn, IMM_TRAILER_LEN, MAX_REPOST};

/// A reactor's shared receive queue as a connection sees it: the ring its
/// receives land in and the ring's size. The reactor reposts its slots.
#[derive(Clone, Debug)]
pub(crate) struct SharedRing {
    pub(crate) ring: Ring,
    pub(crate) slots: u32,
    /// The SRQ ring's registration, which forwards out of it keep.
    pub(crate) registration: Registration,
}

/// Builds the receive request with id `wr_id` for slot `slot` of `ring`.
///
/// # Safety
///
/// `ring` is the ring of slots of `slot_size` bytes whose region the
/// caller keeps registered until the receive completes or its QP (or SRQ)
/// is destroyed, and `slot` is one of its slots, read by no one while
/// posted.
#[inline]
pub(crate) unsafe fn recv_request(
    ring: Ring,
    slot_size: usize,
    wr_id: u64,
    slot: u32,
) -> RecvRequest<'static> {
    // SAFETY: the slot lies in the ring's registration, which the caller
    // keeps as long as the receive may be posted.
    unsafe {
        RecvRequest::from_raw(
            wr_id,
            ring.slot_addr(slot, slot_size),
            slot_size as u32,
            ring.lkey,
        )
    }
}

/// A held receive slot as the source of a forward: where its bytes are
/// and how many (to write a user immediate's trailer after the payload),
/// how the NIC addresses them, and which
/// registration holds the ring (the forward keeps it until it completes, so
/// the ring stays mapped even if its connection is removed meanwhile).
#[derive(Clone, Copy, Debug)]
pub(crate) struct SlotSource {
    pub(super) ptr: *mut u8,
    /// Bytes of the slot.
    pub(super) size: usize,
    pub(super) addr: u64,
    pub(super) lkey: u32,
    pub(crate) registration_id: usize,
}

/// Where each slot of a connection's own receive ring is: posted (the
/// device may write it), consumed (its receive completed: the reactor or a
/// handler reads it, or holds it, or a forward sends from it) or queued to
/// be posted again. A slot is queued only if it is consumed, and posted
/// only if queued; a completion is taken as a slot's only if that slot is
/// posted. So a slot is never posted twice, whichever path gives it back
/// twice, and a receive completion that names a slot not posted (one the
/// device cannot have filled through this ring) is refused before its
/// bytes are looked at. One byte a slot, allocated with the connection.
/// (The SRQ's slots are guarded likewise by the SRQ pool.)
pub(crate) struct RingSlots {
    states: Box<[SlotState]>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SlotState {
    Consumed,
    Queued,
    Posted,
}

impl RingSlots {
    /// A ring of `slots` slots, none posted yet (`slots` 0: no ring of its
    /// own).
    pub(crate) fn new(slots: u32) -> Self {
        Self {
            states: vec![SlotState::Consumed; slots as usize].into_boxed_slice(),
        }
    }

    /// Moves `slot` from `from` to `to`; false (nothing changes) if it is
    /// not in `from` or not in the ring.
    #[inline(always)]
    fn step(&mut self, slot: u32, from: SlotState, to: SlotState) -> bool {
        match self.states.get_mut(slot as usize) {
            Some(state) if *state == from => {
                *state = to;
                true
            }
            _ => false,
        }
    }

    /// A receive of `slot` completed: true if it was posted (it is now
    /// consumed).
    #[inline(always)]
    pub(crate) fn consume(&mut self, slot: u32) -> bool {
        self.step(slot, SlotState::Posted, SlotState::Consumed)
    }

    /// True if consumed `slot` is now queued for reposting; false if it is
    /// posted or queued already.
    #[inline(always)]
    fn queue(&mut self, slot: u32) -> bool {
        self.step(slot, SlotState::Consumed, SlotState::Queued)
    }

    /// Queued `slot` goes to the device. (Only `queue` puts a slot in the
    /// list the flush posts from, so it is queued: no check but in debug
    /// builds.)
    #[inline(always)]
    fn post(&mut self, slot: u32) {
        if let Some(state) = self.states.get_mut(slot as usize) {
            debug_assert_eq!(
                *state,
                SlotState::Queued,
                "receive slot {slot} posted unqueued"
            );
            *state = SlotState::Posted;
        }
    }

    /// Whether `slot` is posted (tests).
    #[cfg(test)]
    pub(crate) fn is_posted(&self, slot: u32) -> bool {
        self.states.get(slot as usize) == Some(&SlotState::Posted)
    }
}

/// Where a registered ring of slots lives.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Ring {
    pub(super) ptr: *mut u8,
    pub(super) addr: u64,
    pub(super) lkey: u32,
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
    pub(super) fn slot_addr(&self, slot: u32, slot_size: usize) -> u64 {
        self.addr + u64::from(slot) * slot_size as u64
    }
}

impl Conn {
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

    /// Queues receive slot `slot` for reposting at the end of the pass. A
    /// slot of the connection's own ring is queued only if it is consumed
    /// and not queued already ([`RingSlots`]): one posted or queued is
    /// refused, so it is never posted twice. (An SRQ slot is the SRQ
    /// pool's to check.)
    #[inline]
    pub(crate) fn queue_repost(&mut self, slot: u32) {
        if self.shared_recv {
            // SRQ slots belong to every connection and must go back, even
            // from a closed one.
            if self.pending_len == self.pending_reposts.len() || slot >= self.recv_slots {
                return;
            }
        } else if self.is_closed() {
            // A closed connection's own ring is dead.
            return;
        } else if !self.ring_slots.queue(slot) {
            // Posted or queued already (or outside the ring): each slot is
            // queued once, so the list (one entry a slot) has room.
            refuse_repost(self.qpn, slot);
            return;
        }
        if let Some(entry) = self.pending_reposts.get_mut(self.pending_len) {
            *entry = slot;
            self.pending_len += 1;
        }
    }

    /// A receive completion names slot `slot` of the connection's own
    /// ring: true if that slot is posted (now consumed), false for a
    /// completion the ring cannot have produced.
    #[inline(always)]
    pub(crate) fn consume_recv(&mut self, slot: u32) -> bool {
        self.ring_slots.consume(slot)
    }

    /// Whether slot `slot` of the connection's own ring is posted (tests).
    #[cfg(test)]
    pub(crate) fn recv_slot_posted(&self, slot: u32) -> bool {
        self.ring_slots.is_posted(slot)
    }

    /// Posts a receive into slot `slot` of the own ring behind the ones
    /// posted, whatever its state, as a double post would (tests of the
    /// refusal of the completion that follows).
    #[cfg(test)]
    pub(crate) fn post_recv_bypassing_the_guard(&mut self, slot: u32) -> crate::Result<()> {
        // SAFETY: the own ring's region is this connection's, dropped only
        // after its QP (field order).
        let request =
            unsafe { recv_request(self.recv_ring, self.slot_size, self.recv_wr_id(slot), slot) };
        let _ = self.reposts.push(request);
        self.post_reposts()
    }

    /// Posts the batch of reposts with one `ibv_post_recv` and drops what
    /// went in (all of it, but on a partial post, which fails the
    /// connection).
    #[inline]
    fn post_reposts(&mut self) -> crate::Result<()> {
        let posted = self.qp.post_recv(&mut self.reposts);
        self.reposts.drop_posted(&posted);
        posted
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
    /// peer. (SRQ slots go back through
    /// [`take_shared_reposts`](Self::take_shared_reposts).)
    #[inline]
    pub(crate) fn flush_reposts(&mut self) -> crate::Result<()> {
        if self.shared_recv {
            return Ok(());
        }
        let mut start = 0;
        while start < self.pending_len {
            let end = (start + MAX_REPOST).min(self.pending_len);
            for &slot in &self.pending_reposts[start..end] {
                // SAFETY: the own ring's region is this connection's,
                // dropped only after its QP (field order); a slot in
                // `pending_reposts` is consumed, so its bytes are no
                // one's.
                let request = unsafe {
                    recv_request(self.recv_ring, self.slot_size, self.recv_wr_id(slot), slot)
                };
                // At most MAX_REPOST pushes into a batch emptied by each post.
                let _ = self.reposts.push(request);
                // Posted from here on: if the device refuses part of the
                // batch, the connection fails and its ring is dead.
                self.ring_slots.post(slot);
            }
            self.post_reposts()?;
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

    /// Decodes a SEND of `len` bytes with immediate `imm` that landed in
    /// receive slot `slot` (see [`send_imm`]). `Err` names what is wrong
    /// with a SEND the reactor never sends: a peer that sends one is cut off.
    #[inline]
    pub(crate) fn recv_message(
        &self,
        slot: u32,
        len: u32,
        imm: Option<u32>,
    ) -> Result<Arrival, &'static str> {
        let Some(imm) = imm else {
            return Err("a SEND without the reactor's immediate");
        };
        if slot >= self.recv_slots {
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
        if payload > self.max_payload() {
            return Err("a message longer than the largest payload");
        }
        // SAFETY: the ring is registered while the connection lives, and
        // the slot's `len` bytes (`len <= slot_size`: the payload fits the
        // largest, and a trailer the rest of the slot) lie inside it; its
        // receive completed and it is not reposted before the caller is
        // done, so no DMA writes it.
        unsafe {
            let start = self.recv_slot_ptr(slot);
            let imm =
                trailer.then(|| u32::from_le(start.add(payload).cast::<u32>().read_unaligned()));
            Ok(Arrival::Message {
                count,
                data: (start, payload),
                imm,
            })
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
            size: self.slot_size,
            addr: self.recv_ring.slot_addr(slot, self.slot_size),
            lkey: self.recv_ring.lkey,
            registration_id: self.recv_registration.id(),
        })
    }

    /// The receive ring's registration, for a forward that must hold it.
    #[inline]
    pub(crate) fn recv_registration(&self) -> &Registration {
        &self.recv_registration
    }

    /// True if this connection holds SRQ slots that must be reposted even
    /// though it is closed.
    #[inline]
    pub(crate) fn owes_shared_slots(&self) -> bool {
        self.shared_recv && self.pending_len != 0
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
mod tests {
    use super::*;

    #[test]
    fn a_slot_is_queued_only_once_consumed_and_posted_only_once_queued() {
        let mut slots = RingSlots::new(4);
        assert!(!slots.consume(0), "nothing posted yet");
        assert!(slots.queue(0));
        assert!(!slots.queue(0), "queued twice");
        assert!(!slots.consume(0), "a queued slot is not posted");
        slots.post(0);
        assert!(slots.is_posted(0));
        assert!(!slots.queue(0), "queued while posted");
        assert!(slots.consume(0));
        assert!(!slots.consume(0), "consumed twice");
        assert!(slots.queue(0), "consumed: it may go back");
        assert!(!slots.queue(4) && !slots.consume(4), "outside the ring");
        assert!(!RingSlots::new(0).queue(0), "no ring of its own");
    }
}
