//! Registered buffer pools: one registration split into fixed-size slots.
//!
//! A [`Slot`] is a move-only handle. Holding it is what entitles you to the
//! slot's bytes ([`BufferPool::bytes_mut`]); posting a work request on it
//! *consumes* the handle, and only the completion of that request gives it back
//! ([`BufferPool::complete`]). So a slot can never be reused or touched while
//! the NIC may still be reading or writing it.
//!
//! What makes that hold:
//! - the slot handle is the only way to the bytes: the pool exposes neither
//!   its region nor a descriptor that would let a request be posted on a
//!   slot without consuming its handle;
//! - a pool is never registered with remote access (nor for memory windows,
//!   which would grant it), so no peer can write into a slot a Rust
//!   reference covers;
//! - every pool has a 64-bit id that is never reused (creation fails once
//!   the id space is spent, rather than wrap), and a handle or a completion
//!   from another pool is refused with [`Error::ForeignHandle`];
//! - a completion gives a slot back only if the slot is in flight and the
//!   completion's `wr_id` is the one its post carried. That id holds a tag
//!   keyed with a secret random key of the pool's (SipHash over pool id,
//!   slot and post number), never handed out before the completion: code
//!   that posts a request of its own with a made-up `wr_id` on the same QP
//!   would have to guess 44 bits to pass off its completion as the slot's.

use std::fmt;
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Error, Result};
use crate::verbs::{
    AccessFlags, LocalSlice, MemoryRegion, ProtectionDomain, QueuePair, RecvRequest, RemoteSlice,
    WorkCompletion, WorkRequest,
};

/// Slots start on cache-line boundaries so neighbours never share a line.
const SLOT_ALIGN: usize = 64;

/// Bits of a post's `wr_id` that carry the slot index; the pool id takes the
/// rest. So a pool has at most 2^20 slots, and at most 2^44 pools are ever
/// made in one process (at one registration per microsecond, half a year of
/// nothing else): past that, [`BufferPool::new`] fails instead of reusing an
/// id.
const SLOT_BITS: u32 = 20;
/// Most slots in one pool.
pub const MAX_SLOTS: u32 = 1 << SLOT_BITS;
const MAX_POOL_ID: u64 = (1 << (64 - SLOT_BITS)) - 1;

static NEXT_POOL_ID: AtomicU64 = AtomicU64::new(1);

/// A fresh pool id, never handed out before.
fn next_pool_id() -> Result<u64> {
    NEXT_POOL_ID
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |id| {
            (id <= MAX_POOL_ID).then_some(id + 1)
        })
        .map_err(|_| Error::InvalidArgument("this process has used up its buffer pool ids"))
}

/// Exclusive right to one slot of a [`BufferPool`] while it is not in flight.
///
/// Not `Clone`: there is at most one handle per slot. Give it back with
/// [`BufferPool::release`] or consume it by posting; a dropped handle keeps its
/// slot out of circulation.
#[must_use = "a dropped slot is lost to the pool; release it or post it"]
pub struct Slot {
    index: u32,
    pool_id: u64,
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
/// # fn demo(pd: &ProtectionDomain, qp: &mut QueuePair, cq: &mut CompletionQueue) -> rdma_comm_core::Result<()> {
/// let mut pool = BufferPool::new(pd, 4096, 64, AccessFlags::LOCAL_WRITE)?;
/// let mut slot = pool.acquire().expect("a free slot");
/// pool.bytes_mut(&mut slot)?[..5].copy_from_slice(b"hello");
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
    // Private: a handle to the region would reach slot bytes without a slot.
    region: MemoryRegion,
    slot_size: usize,
    states: Vec<SlotState>,
    /// The `wr_id` of each in-flight slot's post.
    posted_ids: Vec<u64>,
    free: Vec<u32>,
    pool_id: u64,
    /// Key of the tags in `wr_id`s, and how many posts went out.
    tag_key: RandomState,
    posts: u64,
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
    /// Registers `slot_count` slots (at most [`MAX_SLOTS`]) of at least
    /// `slot_size` bytes (rounded up to 64) in one region, on huge pages when
    /// available.
    ///
    /// `access` may hold `LOCAL_WRITE` (for RECV and READ targets) but no
    /// `REMOTE_*` flag and no `MW_BIND` (a window would grant remote access
    /// all the same): slot bytes are handed out as Rust slices, which a
    /// peer must never be able to write under. Export a plain
    /// [`MemoryRegion`] instead.
    pub fn new(
        pd: &ProtectionDomain,
        slot_size: usize,
        slot_count: u32,
        access: AccessFlags,
    ) -> Result<Self> {
        if slot_size == 0 || slot_count == 0 || slot_count > MAX_SLOTS {
            return Err(Error::InvalidArgument(
                "a pool needs 1 to MAX_SLOTS slots of at least one byte",
            ));
        }
        if access.is_remote() || access.contains(AccessFlags::MW_BIND) {
            return Err(Error::InvalidArgument(
                "a buffer pool cannot be registered with remote access or for memory windows: a peer could write a slot a Rust reference covers",
            ));
        }
        let pool_id = next_pool_id()?;
        let slot_size = slot_size.div_ceil(SLOT_ALIGN) * SLOT_ALIGN;
        let total = slot_size
            .checked_mul(slot_count as usize)
            .ok_or(Error::InvalidArgument("pool size overflows"))?;
        let region = pd.alloc_mr(total, access)?;
        Ok(Self {
            region,
            slot_size,
            states: vec![SlotState::Free; slot_count as usize],
            posted_ids: vec![0; slot_count as usize],
            free: (0..slot_count).rev().collect(),
            pool_id,
            tag_key: RandomState::new(),
            posts: 0,
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

    /// True when the slots are backed by huge pages.
    pub fn huge_pages(&self) -> bool {
        self.region.huge_pages()
    }

    /// Byte offset of slot `index` in the pool's region.
    fn offset_of(&self, index: u32) -> usize {
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

    /// Returns a slot to the free list. A handle of another pool is
    /// refused (and dropped: it can never be used here).
    #[inline]
    pub fn release(&mut self, slot: Slot) -> Result<()> {
        self.check(&slot)?;
        self.states[slot.index as usize] = SlotState::Free;
        // Capacity was reserved for every slot, so this never reallocates.
        self.free.push(slot.index);
        Ok(())
    }

    /// The slot's bytes.
    #[inline]
    pub fn bytes<'a>(&'a self, slot: &'a Slot) -> Result<&'a [u8]> {
        self.check(slot)?;
        // SAFETY: `check` proved the handle is one of ours, and so in range
        // and held (posting consumes it): no request the pool posted touches
        // these bytes, and no peer can (no remote access). The only other
        // way to the bytes is `bytes_mut`, which needs `&mut Slot`.
        unsafe {
            Ok(std::slice::from_raw_parts(
                self.slot_ptr(slot.index),
                self.slot_size,
            ))
        }
    }

    /// The slot's bytes, writable.
    #[inline]
    pub fn bytes_mut<'a>(&'a self, slot: &'a mut Slot) -> Result<&'a mut [u8]> {
        self.check(slot)?;
        // SAFETY: as in `bytes`; in addition `&mut Slot` is the only handle to
        // this slot, so no other reference to these bytes can exist.
        unsafe {
            Ok(std::slice::from_raw_parts_mut(
                self.slot_ptr(slot.index),
                self.slot_size,
            ))
        }
    }

    fn slot_ptr(&self, index: u32) -> *mut u8 {
        self.region.registration().ptr_at(self.offset_of(index))
    }

    /// A handle of this pool (ids are never reused, so that also means its
    /// index is in range) that is held, not free or in flight.
    #[inline]
    fn check(&self, slot: &Slot) -> Result<()> {
        let ours = slot.pool_id == self.pool_id
            && self.states.get(slot.index as usize) == Some(&SlotState::Held);
        if ours {
            Ok(())
        } else {
            Err(Error::ForeignHandle(
                "the slot belongs to another buffer pool",
            ))
        }
    }

    /// A local descriptor for the first `len` bytes of a slot, for the post
    /// that consumes its handle.
    fn local(&self, slot: &Slot, len: usize) -> Result<LocalSlice<'_>> {
        self.check(slot)?;
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

    /// A fresh `wr_id` for a post on slot `index`: the index, and a tag
    /// only this pool can compute.
    fn next_wr_id(&mut self, index: u32) -> u64 {
        self.posts = self.posts.wrapping_add(1);
        let tag = self.tag_key.hash_one((self.pool_id, index, self.posts));
        (tag << SLOT_BITS) | u64::from(index)
    }

    /// The slot an in-flight post with this `wr_id` went out on, if any.
    fn in_flight_slot(&self, wr_id: u64) -> Option<u32> {
        let index = (wr_id & (u64::from(MAX_SLOTS) - 1)) as u32;
        let posted = *self.posted_ids.get(index as usize)? == wr_id;
        (posted && self.states[index as usize] == SlotState::InFlight).then_some(index)
    }

    /// True if `wc` reports a post of this pool that is still in flight.
    pub fn owns(&self, wc: &WorkCompletion) -> bool {
        self.in_flight_slot(wc.wr_id()).is_some()
    }

    /// Runs `post` with the slot's wr_id and descriptor; on success the slot
    /// is in flight and the handle is gone, on failure it is handed back.
    fn post_with(
        &mut self,
        slot: Slot,
        len: usize,
        post: impl FnOnce(u64, LocalSlice<'_>) -> Result<()>,
    ) -> Result<(), PostError> {
        if let Err(error) = self.check(&slot) {
            return Err(PostError { slot, error });
        }
        let wr_id = self.next_wr_id(slot.index);
        match self.local(&slot, len).and_then(|local| post(wr_id, local)) {
            Ok(()) => {
                self.states[slot.index as usize] = SlotState::InFlight;
                self.posted_ids[slot.index as usize] = wr_id;
                Ok(())
            }
            Err(error) => Err(PostError { slot, error }),
        }
    }

    /// SENDs the first `len` bytes of `slot` (signaled), with an optional immediate.
    pub fn post_send(
        &mut self,
        qp: &mut QueuePair,
        slot: Slot,
        len: usize,
        imm: Option<u32>,
    ) -> Result<(), PostError> {
        self.post_with(slot, len, |wr_id, local| {
            let wr = match imm {
                Some(imm) => WorkRequest::send_with_imm(wr_id, local, imm),
                None => WorkRequest::send(wr_id, local),
            };
            qp.post_send(&mut wr.signaled())
        })
    }

    /// WRITEs the first `remote.len()` bytes of `slot` to `remote` (signaled),
    /// with an optional immediate that consumes one of the peer's RECVs.
    pub fn post_write(
        &mut self,
        qp: &mut QueuePair,
        slot: Slot,
        remote: RemoteSlice,
        imm: Option<u32>,
    ) -> Result<(), PostError> {
        self.post_with(slot, remote.len() as usize, |wr_id, local| {
            let wr = match imm {
                Some(imm) => WorkRequest::write_with_imm(wr_id, local, remote, imm)?,
                None => WorkRequest::write(wr_id, local, remote)?,
            };
            qp.post_send(&mut wr.signaled())
        })
    }

    /// READs `remote` into the start of `slot` (signaled).
    pub fn post_read(
        &mut self,
        qp: &mut QueuePair,
        slot: Slot,
        remote: RemoteSlice,
    ) -> Result<(), PostError> {
        self.post_with(slot, remote.len() as usize, |wr_id, local| {
            qp.post_send(&mut WorkRequest::read(wr_id, local, remote)?.signaled())
        })
    }

    /// Posts the whole slot as a receive buffer.
    pub fn post_recv(&mut self, qp: &mut QueuePair, slot: Slot) -> Result<(), PostError> {
        let len = self.slot_size;
        self.post_with(slot, len, |wr_id, local| {
            qp.post_recv(&mut RecvRequest::new(wr_id, local)?)
        })
    }

    /// Takes back the slot a completion reports on, successful or not (a
    /// flushed RECV returns its buffer too). `None` if the completion is not
    /// for a post of this pool that is still in flight.
    #[inline]
    pub fn complete(&mut self, wc: &WorkCompletion) -> Option<Slot> {
        let Some(index) = self.in_flight_slot(wc.wr_id()) else {
            log::warn!(
                "completion {:#x} is not for a post of pool {} in flight",
                wc.wr_id(),
                self.pool_id
            );
            return None;
        };
        self.states[index as usize] = SlotState::Held;
        Some(Slot {
            index,
            pool_id: self.pool_id,
        })
    }
}
