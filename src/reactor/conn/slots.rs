//! Rings of slots: where a registered ring lives ([`Ring`]), the receive
//! request for one of its slots, a held receive slot as the source of a
//! forward ([`SlotSource`]), and where each slot of a connection's own
//! receive ring is ([`RingSlots`]).

use crate::verbs::{MemoryRegion, RecvRequest, Registration};

/// Bytes of every slot kept back for the trailer of a SEND that carries a
/// user immediate: the immediate itself, after the payload. Every SEND of
/// the reactor is a SEND_WITH_IMM whose immediate carries the credit (see
/// `credit::send_imm`), so a payload that fits a packet goes in one.
pub(crate) const IMM_TRAILER_LEN: usize = 4;

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
    pub(crate) fn queue(&mut self, slot: u32) -> bool {
        self.step(slot, SlotState::Consumed, SlotState::Queued)
    }

    /// Queued `slot` goes to the device: true if it was queued (it is
    /// posted now), false (nothing changes) if it is not. Only `queue`
    /// puts a slot in the list a flush posts from, and once: checked here
    /// all the same, as a slot posted twice would lose a receive.
    #[inline(always)]
    fn post(&mut self, slot: u32) -> bool {
        self.step(slot, SlotState::Queued, SlotState::Posted)
    }

    /// Marks every slot of `batch` posted, as a repost about to go to the
    /// device. A slot that was not queued (none is: `queue` lists each
    /// slot once) would be posted twice: refused, and its ring (the
    /// caller's connection or endpoint) fails instead. Posted from here
    /// on: if the device refuses part of the batch, the ring is dead.
    #[inline]
    pub(crate) fn post_queued(&mut self, batch: &[u32]) -> crate::Result<()> {
        let mut all_queued = true;
        for &slot in batch {
            all_queued &= self.post(slot);
        }
        if all_queued {
            Ok(())
        } else {
            Err(not_queued())
        }
    }

    /// Whether `slot` is posted (tests).
    #[cfg(test)]
    pub(crate) fn is_posted(&self, slot: u32) -> bool {
        self.states.get(slot as usize) == Some(&SlotState::Posted)
    }
}

/// The refusal of a repost naming a slot that is not queued.
#[cold]
fn not_queued() -> crate::Error {
    crate::Error::InvalidArgument("a receive slot reposted without being queued")
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

    /// Where slot `slot` of `slot_size` bytes starts in memory (the
    /// caller dereferences it only inside the ring's registration).
    #[inline]
    pub(crate) fn slot_ptr(&self, slot: u32, slot_size: usize) -> *mut u8 {
        self.ptr.wrapping_add(slot as usize * slot_size)
    }

    /// The registered address of slot `slot`.
    #[inline]
    pub(crate) fn slot_addr(&self, slot: u32, slot_size: usize) -> u64 {
        self.addr + u64::from(slot) * slot_size as u64
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
        slots.post_queued(&[0]).expect("queued");
        assert!(slots.is_posted(0));
        assert!(slots.post_queued(&[0]).is_err(), "posted twice");
        assert!(!slots.queue(0), "queued while posted");
        assert!(slots.consume(0));
        assert!(!slots.consume(0), "consumed twice");
        assert!(slots.queue(0), "consumed: it may go back");
        assert!(!slots.queue(4) && !slots.consume(4), "outside the ring");
        assert!(!RingSlots::new(0).queue(0), "no ring of its own");
    }
}
