//! The ring SEND payloads are copied into ([`SendSlots`]).

use crate::verbs::{AccessFlags, MemoryRegion, ProtectionDomain, Sge};

use super::super::slots::{IMM_TRAILER_LEN, Ring};

/// A connection's send slots: SEND payloads are copied into them, and
/// they are used and released in send-queue order, `in_use` of them from
/// `head`. A slot is released only when a completion proves its SEND done.
pub(super) struct SendSlots {
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
    pub(super) fn new(pd: &ProtectionDomain, slot_size: usize, count: u32) -> crate::Result<Self> {
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
    pub(super) fn registered_bytes(&self) -> usize {
        self.region.len()
    }

    /// Slots in use.
    #[inline]
    pub(super) fn used(&self) -> u32 {
        self.in_use
    }

    /// Slots free.
    #[inline]
    pub(super) fn left(&self) -> u32 {
        self.count - self.in_use
    }

    /// Takes the next free slot if `fill` writes a payload of at most
    /// `capacity` bytes into it (`None` from `fill`: the slot stays free),
    /// with user immediate `imm` right after the payload. Returns the
    /// slot's bytes on the wire.
    ///
    /// # Safety
    ///
    /// A slot is free (`left() > 0`), and `capacity` and a trailer fit one:
    /// the slice `fill` gets is made from them.
    #[inline]
    pub(super) unsafe fn fill(
        &mut self,
        capacity: usize,
        imm: Option<u32>,
        fill: impl FnOnce(&mut [u8]) -> Option<usize>,
    ) -> Option<Sge> {
        debug_assert!(self.in_use < self.count && capacity + IMM_TRAILER_LEN <= self.slot_size);
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
    pub(super) fn release_oldest(&mut self) {
        debug_assert!(self.in_use > 0);
        self.head = (self.head + 1) & (self.count - 1);
        self.in_use -= 1;
    }

    /// The first `len` bytes of slot `slot` (unit tests).
    #[cfg(test)]
    pub(super) fn written(&self, slot: u32, len: usize) -> &[u8] {
        assert!(slot < self.count && len <= self.slot_size);
        // SAFETY: inside the registered ring; nothing is posted in tests.
        unsafe {
            std::slice::from_raw_parts(self.ring.ptr.add(slot as usize * self.slot_size), len)
        }
    }

    /// Releases the newest slot in use: its SEND was never posted.
    pub(super) fn release_newest(&mut self) {
        debug_assert!(self.in_use > 0);
        self.in_use -= 1;
    }
}
