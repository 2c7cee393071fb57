//! The rings of receive and send slots: where a registered ring lives
//! ([`Ring`]), the receive request for one of its slots, a held slot as
//! the source of a forward ([`SlotSource`]), where each slot of a
//! connection's own receive ring is ([`RingSlots`]), and the ring SEND
//! payloads are copied into ([`SendSlots`]).

use crate::verbs::{AccessFlags, MemoryRegion, ProtectionDomain, RecvRequest, Registration, Sge};

use super::IMM_TRAILER_LEN;

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

impl SlotSource {
    /// Bytes of the slot.
    #[inline]
    pub(crate) fn size(&self) -> usize {
        self.size
    }

    /// Writes user immediate `imm` right after a `len`-byte payload.
    ///
    /// # Safety
    ///
    /// The caller holds the slot (its receive completed, and it is neither
    /// reposted nor read by a request until the caller is done), and
    /// `len + IMM_TRAILER_LEN <= size`.
    #[inline]
    pub(super) unsafe fn write_trailer(&self, len: usize, imm: u32) {
        debug_assert!(len + IMM_TRAILER_LEN <= self.size);
        // SAFETY: the caller keeps the trailer inside the held slot.
        unsafe { self.ptr.add(len).cast::<u32>().write_unaligned(imm.to_le()) }
    }
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
    pub(super) fn queue(&mut self, slot: u32) -> bool {
        self.step(slot, SlotState::Consumed, SlotState::Queued)
    }

    /// Queued `slot` goes to the device. (Only `queue` puts a slot in the
    /// list the flush posts from, so it is queued: no check but in debug
    /// builds.)
    #[inline(always)]
    pub(super) fn post(&mut self, slot: u32) {
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

/// A connection's send slots: SEND payloads are copied into them, and
/// they are used and released in send-queue order, `in_use` of them from
/// `head`. A slot is released only when a completion proves its SEND done.
pub(crate) struct SendSlots {
    ring: Ring,
    slot_size: usize,
    /// A power of two, so positions are masks, not divisions (a DIV on
    /// every message shows up in latency, under emulation most of all).
    count: u32,
    head: u32,
    in_use: u32,
    region: MemoryRegion,
}

impl SendSlots {
    /// `count` (a power of two) slots of `slot_size` bytes, registered on
    /// `pd` for local access only: nothing but this ring reaches them.
    pub(crate) fn new(pd: &ProtectionDomain, slot_size: usize, count: u32) -> crate::Result<Self> {
        debug_assert!(count.is_power_of_two() && slot_size >= IMM_TRAILER_LEN);
        let region = pd.alloc_mr(slot_size * count as usize, AccessFlags::empty())?;
        Ok(Self {
            ring: Ring::of(&region),
            slot_size,
            count,
            head: 0,
            in_use: 0,
            region,
        })
    }

    /// Bytes registered for the slots.
    pub(crate) fn registered_bytes(&self) -> usize {
        self.region.len()
    }

    /// Slots in use.
    #[inline]
    pub(crate) fn used(&self) -> u32 {
        self.in_use
    }

    /// Slots free.
    #[inline]
    pub(crate) fn left(&self) -> u32 {
        self.count - self.in_use
    }

    /// Takes the next free slot if `fill` writes a payload of at most
    /// `capacity` bytes into it (`None` from `fill`: the slot stays free),
    /// with user immediate `imm` right after the payload. Returns the
    /// slot's bytes on the wire. The caller checked that a slot is free and
    /// that `capacity` and a trailer fit one.
    #[inline]
    pub(crate) fn fill(
        &mut self,
        capacity: usize,
        imm: Option<u32>,
        fill: impl FnOnce(&mut [u8]) -> Option<usize>,
    ) -> Option<Sge> {
        debug_assert!(capacity + IMM_TRAILER_LEN <= self.slot_size && self.in_use < self.count);
        let slot = (self.head + self.in_use) & (self.count - 1);
        let start = slot as usize * self.slot_size;
        // SAFETY: the region is registered while this lives; the slot is
        // free (no posted request references it) and lies inside the ring
        // (`capacity` and a trailer fit a slot); we hold &mut self, and
        // nothing else reaches the ring (it has no remote access).
        let bytes = unsafe {
            std::slice::from_raw_parts_mut(self.ring.ptr.add(start), capacity + IMM_TRAILER_LEN)
        };
        let len = fill(&mut bytes[..capacity])?.min(capacity);
        let wire_len = match imm {
            Some(imm) => {
                bytes[len..len + IMM_TRAILER_LEN].copy_from_slice(&imm.to_le_bytes());
                len + IMM_TRAILER_LEN
            }
            None => len,
        };
        self.in_use += 1;
        Some(Sge {
            addr: self.ring.addr + start as u64,
            len: wire_len as u32,
            lkey: self.ring.lkey,
        })
    }

    /// Releases the oldest slot in use: its SEND completed.
    #[inline(always)]
    pub(crate) fn release_oldest(&mut self) {
        debug_assert!(self.in_use > 0);
        self.head = (self.head + 1) & (self.count - 1);
        self.in_use -= 1;
    }

    /// The first `len` bytes of slot `slot` (unit tests).
    #[cfg(test)]
    pub(crate) fn written(&self, slot: u32, len: usize) -> &[u8] {
        assert!(slot < self.count && len <= self.slot_size);
        // SAFETY: inside the registered ring; nothing is posted in tests.
        unsafe {
            std::slice::from_raw_parts(self.ring.ptr.add(slot as usize * self.slot_size), len)
        }
    }

    /// Releases the newest slot in use: its SEND was never posted.
    pub(crate) fn release_newest(&mut self) {
        debug_assert!(self.in_use > 0);
        self.in_use -= 1;
    }
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
