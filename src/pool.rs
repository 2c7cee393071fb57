//! Registered buffer pools: one registration split into fixed-size slots.
//!
//! A [`Slot`] is a move-only handle. Holding it is what entitles you to the
//! slot's bytes ([`BufferPool::bytes_mut`]); posting a work request on it
//! *consumes* the handle, and only the completion of that request gives it back
//! ([`BufferPool::complete`]). So a slot can never be reused or touched while
//! the NIC may still be reading or writing it: the type system enforces it, and
//! the pool's per-slot state double-checks every completion.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU16, Ordering};

use crate::error::{Error, Result};
use crate::verbs::{
    AccessFlags, LocalSlice, MemoryRegion, ProtectionDomain, QueuePair, RecvRequest, RemoteSlice,
    WorkCompletion, WorkRequest,
};

/// Slots start on cache-line boundaries so neighbours never share a line.
const SLOT_ALIGN: usize = 64;

static NEXT_POOL_ID: AtomicU16 = AtomicU16::new(1);

/// Exclusive right to one slot of a [`BufferPool`] while it is not in flight.
///
/// Not `Clone`: there is at most one handle per slot. Give it back with
/// [`BufferPool::release`] or consume it by posting; a dropped handle keeps its
/// slot out of circulation.
#[must_use = "a dropped slot is lost to the pool; release it or post it"]
pub struct Slot {
    index: u32,
    pool_id: u16,
}

impl fmt::Debug for Slot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Slot({}#{})", self.pool_id, self.index)
    }
}

impl Slot {
    /// The slot's index within its pool.
    pub fn index(&self) -> u32 {
        self.index
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotState {
    Free,
    Held,
    InFlight,
}

/// A post that did not go out; the slot comes back to the caller.
#[derive(Debug)]
pub struct PostError {
    /// The slot, still owned by the caller.
    pub slot: Slot,
    /// Why the post failed.
    pub error: Error,
}

impl fmt::Display for PostError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "posting {:?} failed: {}", self.slot, self.error)
    }
}

impl std::error::Error for PostError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

/// N fixed-size slots in one registered region.
///
/// ```no_run
/// use rdma_comm_core::pool::BufferPool;
/// use rdma_comm_core::verbs::*;
/// # fn demo(pd: &ProtectionDomain, qp: &QueuePair, cq: &mut CompletionQueue) -> rdma_comm_core::Result<()> {
/// let mut pool = BufferPool::new(pd, 4096, 64, AccessFlags::LOCAL_WRITE)?;
/// let mut slot = pool.acquire().expect("a free slot");
/// pool.bytes_mut(&mut slot)[..5].copy_from_slice(b"hello");
/// pool.post_send(qp, slot, 5, None).map_err(|e| e.error)?; // the handle is gone now
/// let mut wcs = [WorkCompletion::default(); 8];
/// for wc in cq.poll(&mut wcs)? {
///     if let Some(slot) = pool.complete(wc) {             // ...and back once it completed
///         pool.release(slot);
///     }
/// }
/// # Ok(()) }
/// ```
pub struct BufferPool {
    region: Arc<MemoryRegion>,
    slot_size: usize,
    states: Vec<SlotState>,
    free: Vec<u32>,
    pool_id: u16,
}

impl fmt::Debug for BufferPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BufferPool")
            .field("slot_size", &self.slot_size)
            .field("slots", &self.states.len())
            .field("free", &self.free.len())
            .field("huge_pages", &self.region.huge_pages())
            .finish()
    }
}

impl BufferPool {
    /// Registers `slot_count` slots of at least `slot_size` bytes (rounded up
    /// to 64) in one region, on huge pages when available.
    pub fn new(
        pd: &ProtectionDomain,
        slot_size: usize,
        slot_count: u32,
        access: AccessFlags,
    ) -> Result<Self> {
        if slot_size == 0 || slot_count == 0 {
            return Err(Error::InvalidArgument(
                "a pool needs at least one slot of at least one byte",
            ));
        }
        let slot_size = slot_size.div_ceil(SLOT_ALIGN) * SLOT_ALIGN;
        let total = slot_size
            .checked_mul(slot_count as usize)
            .ok_or(Error::InvalidArgument("pool size overflows"))?;
        let region = Arc::new(pd.alloc_mr(total, access)?);
        Ok(Self {
            region,
            slot_size,
            states: vec![SlotState::Free; slot_count as usize],
            free: (0..slot_count).rev().collect(),
            pool_id: NEXT_POOL_ID.fetch_add(1, Ordering::Relaxed),
        })
    }

    /// Bytes per slot.
    pub fn slot_size(&self) -> usize {
        self.slot_size
    }

    /// Number of slots.
    pub fn capacity(&self) -> u32 {
        self.states.len() as u32
    }

    /// Free slots right now.
    pub fn available(&self) -> usize {
        self.free.len()
    }

    /// Slots currently posted and not yet completed.
    pub fn in_flight(&self) -> usize {
        self.states
            .iter()
            .filter(|s| **s == SlotState::InFlight)
            .count()
    }

    /// The registered region behind the pool (to export it, say).
    pub fn region(&self) -> &Arc<MemoryRegion> {
        &self.region
    }

    /// Byte offset of slot `index` in the region.
    pub fn offset_of(&self, index: u32) -> usize {
        index as usize * self.slot_size
    }

    /// Takes a free slot.
    #[inline]
    pub fn acquire(&mut self) -> Option<Slot> {
        let index = self.free.pop()?;
        self.states[index as usize] = SlotState::Held;
        Some(Slot {
            index,
            pool_id: self.pool_id,
        })
    }

    /// Returns a slot to the free list.
    #[inline]
    pub fn release(&mut self, slot: Slot) {
        self.check(&slot);
        self.states[slot.index as usize] = SlotState::Free;
        // Capacity was reserved for every slot, so this never reallocates.
        self.free.push(slot.index);
    }

    /// The slot's bytes.
    #[inline]
    pub fn bytes<'a>(&'a self, slot: &'a Slot) -> &'a [u8] {
        self.check(slot);
        // SAFETY: the handle proves the slot is not in flight (posting consumes
        // it), so no DMA touches these bytes; the range is inside the region.
        unsafe { std::slice::from_raw_parts(self.slot_ptr(slot.index), self.slot_size) }
    }

    /// The slot's bytes, writable.
    #[inline]
    pub fn bytes_mut<'a>(&'a self, slot: &'a mut Slot) -> &'a mut [u8] {
        self.check(slot);
        // SAFETY: as in `bytes`; in addition `&mut Slot` is the only handle to
        // this slot, so no other reference to these bytes can exist.
        unsafe { std::slice::from_raw_parts_mut(self.slot_ptr(slot.index), self.slot_size) }
    }

    fn slot_ptr(&self, index: u32) -> *mut u8 {
        // SAFETY: index < slot count, so the offset is inside the region.
        unsafe { self.region.as_ptr().add(self.offset_of(index)) }
    }

    #[inline]
    fn check(&self, slot: &Slot) {
        // A handle from another pool would alias this pool's slots: a bug in
        // the caller, never a runtime condition, hence a panic.
        assert_eq!(
            slot.pool_id, self.pool_id,
            "{slot:?} belongs to another pool"
        );
    }

    /// A local descriptor for the first `len` bytes of a slot.
    pub fn local(&self, slot: &Slot, len: usize) -> Result<LocalSlice<'_>> {
        self.check(slot);
        if len > self.slot_size {
            return Err(Error::OutOfBounds {
                what: "slot",
                offset: 0,
                len: len as u64,
                size: self.slot_size as u64,
            });
        }
        self.region.slice(self.offset_of(slot.index), len)
    }

    /// The work-request id posts on `slot` carry: pool id and slot index.
    pub fn wr_id(&self, slot: &Slot) -> u64 {
        (u64::from(self.pool_id) << 48) | u64::from(slot.index)
    }

    /// True if a completion's `wr_id` came from a post on this pool.
    pub fn owns(&self, wr_id: u64) -> bool {
        (wr_id >> 48) as u16 == self.pool_id && ((wr_id & 0xffff_ffff) as usize) < self.states.len()
    }

    /// Runs `post` with the slot's wr_id and descriptor; on success the slot
    /// is in flight and the handle is gone, on failure it is handed back.
    fn post_with(
        &mut self,
        slot: Slot,
        len: usize,
        post: impl FnOnce(u64, LocalSlice<'_>) -> Result<()>,
    ) -> Result<(), PostError> {
        let wr_id = self.wr_id(&slot);
        match self.local(&slot, len).and_then(|local| post(wr_id, local)) {
            Ok(()) => {
                self.states[slot.index as usize] = SlotState::InFlight;
                Ok(())
            }
            Err(error) => Err(PostError { slot, error }),
        }
    }

    /// SENDs the first `len` bytes of `slot` (signaled), with an optional immediate.
    pub fn post_send(
        &mut self,
        qp: &QueuePair,
        slot: Slot,
        len: usize,
        imm: Option<u32>,
    ) -> Result<(), PostError> {
        self.post_with(slot, len, |wr_id, local| {
            let wr = match imm {
                Some(imm) => WorkRequest::send_with_imm(wr_id, local, imm),
                None => WorkRequest::send(wr_id, local),
            };
            qp.post_send(wr.signaled())
        })
    }

    /// WRITEs the first `remote.len()` bytes of `slot` to `remote` (signaled),
    /// with an optional immediate that consumes one of the peer's RECVs.
    pub fn post_write(
        &mut self,
        qp: &QueuePair,
        slot: Slot,
        remote: RemoteSlice,
        imm: Option<u32>,
    ) -> Result<(), PostError> {
        self.post_with(slot, remote.len() as usize, |wr_id, local| {
            let wr = match imm {
                Some(imm) => WorkRequest::write_with_imm(wr_id, local, remote, imm)?,
                None => WorkRequest::write(wr_id, local, remote)?,
            };
            qp.post_send(wr.signaled())
        })
    }

    /// READs `remote` into the start of `slot` (signaled).
    pub fn post_read(
        &mut self,
        qp: &QueuePair,
        slot: Slot,
        remote: RemoteSlice,
    ) -> Result<(), PostError> {
        self.post_with(slot, remote.len() as usize, |wr_id, local| {
            qp.post_send(WorkRequest::read(wr_id, local, remote)?.signaled())
        })
    }

    /// Posts the whole slot as a receive buffer.
    pub fn post_recv(&mut self, qp: &QueuePair, slot: Slot) -> Result<(), PostError> {
        let len = self.slot_size;
        self.post_with(slot, len, |wr_id, local| {
            qp.post_recv(RecvRequest::new(wr_id, local)?)
        })
    }

    /// Takes back the slot a completion reports on, successful or not (a
    /// flushed RECV returns its buffer too). `None` if the completion is not
    /// one of this pool's posts or was already completed.
    #[inline]
    pub fn complete(&mut self, wc: &WorkCompletion) -> Option<Slot> {
        let wr_id = wc.wr_id();
        if !self.owns(wr_id) {
            return None;
        }
        let index = (wr_id & 0xffff_ffff) as u32;
        let state = &mut self.states[index as usize];
        if *state != SlotState::InFlight {
            log::warn!(
                "completion for slot {index} of pool {} that is not in flight",
                self.pool_id
            );
            return None;
        }
        *state = SlotState::Held;
        Some(Slot {
            index,
            pool_id: self.pool_id,
        })
    }
}
