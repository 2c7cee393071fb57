//! Work requests and fixed-capacity batches of them.
//!
//! A [`WorkRequest`] is an `ibv_send_wr` with its one scatter/gather entry
//! beside it. The `next` and `sg_list` pointers are filled in only at post time,
//! so requests and batches can be moved, changed in place and posted again
//! freely; a [`SendBatch`] is posted as one linked list in one
//! `ibv_post_send` (one doorbell).

use std::marker::PhantomData;

use arrayvec::ArrayVec;

use crate::error::{Error, Result};
use crate::sys;

use super::mr::{AccessFlags, LocalSlice, RemoteSlice};
use super::requests::sealed::{Keep, Request, Requests, Seal};

bitflags::bitflags! {
    /// Per-request send flags.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct SendFlags: u32 {
        /// Generate a completion for this request (selective signaling leaves
        /// it off on most requests).
        const SIGNALED = sys::IBV_SEND_SIGNALED;
        /// Copy the payload into the WQE; the buffer is free on return.
        const INLINE = sys::IBV_SEND_INLINE;
        /// Wake a peer waiting for solicited events only.
        const SOLICITED = sys::IBV_SEND_SOLICITED;
        /// Wait for earlier READs to finish before this request starts.
        const FENCE = sys::IBV_SEND_FENCE;
    }
}

/// One send-queue request: SEND, SEND_WITH_IMM, WRITE, WRITE_WITH_IMM or READ.
///
/// ```no_run
/// # use rdma_comm_core::verbs::*;
/// # fn demo(qp: &mut QueuePair, mr: &MemoryRegion, peer: RemoteRegion) -> rdma_comm_core::Result<()> {
/// let local = mr.slice(0, 64)?;
/// let target = peer.slice(128, 64)?; // bounds-checked against what the peer exported
/// qp.post_send(&mut WorkRequest::write_with_imm(1, local, target, 0xfeed)?.signaled())?;
/// # Ok(()) }
/// ```
#[derive(Clone, Copy)]
pub struct WorkRequest<'a> {
    pub(crate) wr: sys::ibv_send_wr,
    pub(crate) sge: sys::ibv_sge,
    /// Made by [`send_inline`](Self::send_inline): its SGE points at
    /// unregistered memory, so it must stay `INLINE` whatever flags are
    /// set later (without it the device would be asked to read memory no
    /// key covers).
    inline_only: bool,
    _buffers: PhantomData<&'a [u8]>,
}

impl std::fmt::Debug for WorkRequest<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkRequest")
            .field("wr_id", &self.wr.wr_id)
            .field("opcode", &self.wr.opcode)
            .field("flags", &SendFlags::from_bits_retain(self.wr.send_flags))
            .field("len", &self.sge.length)
            .finish()
    }
}

impl<'a> WorkRequest<'a> {
    fn new(wr_id: u64, opcode: sys::ibv_wr_opcode, sge: sys::ibv_sge) -> Self {
        let wr = sys::ibv_send_wr {
            wr_id,
            opcode,
            // A zero-length request carries no SGE (a valid, common notification).
            num_sge: i32::from(sge.length > 0),
            ..Default::default()
        };
        Self {
            wr,
            sge,
            inline_only: false,
            _buffers: PhantomData,
        }
    }

    fn with_remote(mut self, remote: RemoteSlice) -> Self {
        self.wr.wr.rdma.remote_addr = remote.addr;
        self.wr.wr.rdma.rkey = remote.rkey;
        self
    }

    fn with_imm_data(mut self, imm: u32) -> Self {
        self.wr.__bindgen_anon_1.imm_data = imm.to_be();
        self
    }

    /// SEND `local` to the peer's next posted RECV.
    pub fn send(wr_id: u64, local: LocalSlice<'a>) -> Self {
        Self::new(wr_id, sys::IBV_WR_SEND, sge(&local))
    }

    /// SEND with a 32-bit immediate value delivered in the peer's completion.
    pub fn send_with_imm(wr_id: u64, local: LocalSlice<'a>, imm: u32) -> Self {
        Self::new(wr_id, sys::IBV_WR_SEND_WITH_IMM, sge(&local)).with_imm_data(imm)
    }

    /// SEND a small payload from any memory, copied inline into the WQE.
    /// It must fit the QP's `max_inline_data` (checked at post time).
    pub fn send_inline(wr_id: u64, data: &'a [u8]) -> Self {
        let sge = sys::ibv_sge {
            addr: data.as_ptr() as u64,
            length: data.len() as u32,
            lkey: 0,
        };
        let mut wr = Self::new(wr_id, sys::IBV_WR_SEND, sge);
        wr.inline_only = true;
        wr.set_flags(SendFlags::empty());
        wr
    }

    /// RDMA WRITE `local` to `remote`; both must have the same length.
    pub fn write(wr_id: u64, local: LocalSlice<'a>, remote: RemoteSlice) -> Result<Self> {
        same_len(&local, &remote)?;
        Ok(Self::new(wr_id, sys::IBV_WR_RDMA_WRITE, sge(&local)).with_remote(remote))
    }

    /// RDMA WRITE that also consumes one of the peer's RECVs, delivering `imm`.
    pub fn write_with_imm(
        wr_id: u64,
        local: LocalSlice<'a>,
        remote: RemoteSlice,
        imm: u32,
    ) -> Result<Self> {
        same_len(&local, &remote)?;
        Ok(
            Self::new(wr_id, sys::IBV_WR_RDMA_WRITE_WITH_IMM, sge(&local))
                .with_remote(remote)
                .with_imm_data(imm),
        )
    }

    /// RDMA READ `remote` into `local` (which needs `LOCAL_WRITE`).
    pub fn read(wr_id: u64, local: LocalSlice<'a>, remote: RemoteSlice) -> Result<Self> {
        same_len(&local, &remote)?;
        if !local.access.contains(AccessFlags::LOCAL_WRITE) {
            return Err(Error::InvalidArgument(
                "a READ target must be registered with LOCAL_WRITE",
            ));
        }
        Ok(Self::new(wr_id, sys::IBV_WR_RDMA_READ, sge(&local)).with_remote(remote))
    }

    /// Requests a completion for this request.
    pub fn signaled(self) -> Self {
        self.with_flags(SendFlags::SIGNALED)
    }

    /// Adds send flags (`INLINE` is ignored on a READ, which has no payload
    /// to carry).
    pub fn with_flags(mut self, flags: SendFlags) -> Self {
        self.set_flags(self.flags() | flags);
        self
    }

    /// Sets the flags to `flags`, in place: for a request posted again
    /// ([`QueuePair::post_send`] leaves it with the caller), say to signal
    /// one post in many. A [`send_inline`](Self::send_inline) request stays
    /// `INLINE` (its bytes are in no registered memory) and a READ never
    /// is; the inline length is checked against the QP at each post.
    ///
    /// [`QueuePair::post_send`]: super::QueuePair::post_send
    pub fn set_flags(&mut self, flags: SendFlags) {
        let mut bits = flags.bits();
        if self.inline_only {
            bits |= sys::IBV_SEND_INLINE;
        }
        if self.wr.opcode == sys::IBV_WR_RDMA_READ {
            bits &= !sys::IBV_SEND_INLINE;
        }
        self.wr.send_flags = bits;
    }

    /// Sets the caller's id, in place (see [`set_flags`](Self::set_flags)).
    pub fn set_wr_id(&mut self, wr_id: u64) {
        self.wr.wr_id = wr_id;
    }

    /// The caller's id for this request.
    pub fn wr_id(&self) -> u64 {
        self.wr.wr_id
    }

    /// Payload length in bytes.
    pub fn len(&self) -> u32 {
        self.sge.length
    }

    /// True for a zero-length request.
    pub fn is_empty(&self) -> bool {
        self.sge.length == 0
    }

    /// The flags set so far.
    pub fn flags(&self) -> SendFlags {
        SendFlags::from_bits_retain(self.wr.send_flags)
    }
}

impl<'a> Request for WorkRequest<'a> {
    type Wr = sys::ibv_send_wr;
    type Detached = WorkRequest<'static>;

    #[inline(always)]
    fn link_to(&mut self, next: *mut sys::ibv_send_wr) -> *mut sys::ibv_send_wr {
        self.wr.sg_list = &raw mut self.sge;
        self.wr.next = next;
        &raw mut self.wr
    }

    #[inline(always)]
    fn wr_id(&self) -> u64 {
        self.wr.wr_id
    }

    #[inline(always)]
    fn set_wr_id(&mut self, wr_id: u64) {
        self.wr.wr_id = wr_id;
    }

    #[inline(always)]
    fn inline_len(&self) -> Option<u32> {
        (self.wr.send_flags & sys::IBV_SEND_INLINE != 0).then_some(self.sge.length)
    }

    fn local_sge(&self) -> (u64, u32, u32) {
        (self.sge.addr, self.sge.length, self.sge.lkey)
    }

    /// `None` for an inline send, whose bytes are in no registration.
    fn detached(self) -> Option<WorkRequest<'static>> {
        if self.inline_only {
            return None;
        }
        Some(WorkRequest {
            wr: self.wr,
            sge: self.sge,
            inline_only: false,
            _buffers: PhantomData,
        })
    }
}

impl<'a> Requests for WorkRequest<'a> {
    type Wr = sys::ibv_send_wr;
    type Request = Self;

    #[inline(always)]
    fn requests_mut(&mut self, _: Seal) -> &mut [Self] {
        std::slice::from_mut(self)
    }
}

impl<'a> Keep for WorkRequest<'a> {
    type Kept = WorkRequest<'static>;

    fn kept(self) -> Option<WorkRequest<'static>> {
        self.detached()
    }
}

/// The scatter/gather entry of `local`.
pub(super) fn sge(local: &LocalSlice<'_>) -> sys::ibv_sge {
    super::list::Sge::from(local).into()
}

fn same_len(local: &LocalSlice<'_>, remote: &RemoteSlice) -> Result<()> {
    if local.len == remote.len {
        Ok(())
    } else {
        Err(Error::InvalidArgument(
            "local and remote lengths of an RDMA operation differ",
        ))
    }
}

/// Up to `N` requests posted together as one linked list: one
/// `ibv_post_send` (one doorbell) for a [`SendBatch`], one `ibv_post_recv` for
/// a [`RecvBatch`].
///
/// Preallocate one per QP and reuse it: pushing and posting never allocate.
/// Posting leaves the batch as it was, to post the same list again
/// (perftest's post list, `-l`) or to empty with
/// [`drop_posted`](Self::drop_posted).
#[derive(Debug)]
pub struct Batch<R, const N: usize> {
    pub(crate) requests: ArrayVec<R, N>,
}

/// Send-queue requests, posted with one doorbell.
pub type SendBatch<'a, const N: usize> = Batch<WorkRequest<'a>, N>;

/// Receive requests, posted with one `ibv_post_recv`.
pub type RecvBatch<'a, const N: usize> = Batch<RecvRequest<'a>, N>;

impl<R, const N: usize> Default for Batch<R, N> {
    fn default() -> Self {
        Self {
            requests: ArrayVec::new(),
        }
    }
}

impl<R, const N: usize> Batch<R, N> {
    /// An empty batch.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a request; hands it back when the batch is full.
    // Handing the request back by value is the point: boxing it would allocate.
    #[allow(clippy::result_large_err)]
    pub fn push(&mut self, request: R) -> Result<(), R> {
        self.requests.try_push(request).map_err(|e| e.element())
    }

    /// Number of staged requests.
    pub fn len(&self) -> usize {
        self.requests.len()
    }

    /// True when nothing is staged.
    pub fn is_empty(&self) -> bool {
        self.requests.is_empty()
    }

    /// True when no more requests fit.
    pub fn is_full(&self) -> bool {
        self.requests.is_full()
    }

    /// Drops all staged requests.
    pub fn clear(&mut self) {
        self.requests.clear();
    }

    /// Request `index`, to change in place before the batch is posted
    /// (again).
    pub fn get_mut(&mut self, index: usize) -> Option<&mut R> {
        self.requests.get_mut(index)
    }

    /// Drops the requests a post of this batch took, as its `outcome`
    /// says: all of them on `Ok`, the first `posted` on [`Error::Post`],
    /// none on any other error. What stays was not posted, so posting the
    /// batch again posts no buffer twice.
    #[inline]
    pub fn drop_posted(&mut self, outcome: &Result<()>) {
        match outcome {
            Ok(()) => self.requests.clear(),
            Err(Error::Post { posted, .. }) => {
                self.requests.drain(..(*posted).min(self.requests.len()));
            }
            Err(_) => {}
        }
    }
}

impl<R: Request, const N: usize> Requests for Batch<R, N> {
    type Wr = R::Wr;
    type Request = R;

    #[inline(always)]
    fn requests_mut(&mut self, _: Seal) -> &mut [R] {
        self.requests.as_mut_slice()
    }
}

impl<R: Request, const N: usize> Keep for Batch<R, N> {
    type Kept = Batch<R::Detached, N>;

    fn kept(self) -> Option<Self::Kept> {
        let mut kept = ArrayVec::new();
        for request in self.requests {
            kept.push(request.detached()?);
        }
        Some(Batch { requests: kept })
    }
}

/// One receive request: where the next incoming SEND (or WRITE_WITH_IMM's
/// notification) lands.
#[derive(Clone, Copy)]
pub struct RecvRequest<'a> {
    pub(crate) wr: sys::ibv_recv_wr,
    pub(crate) sge: sys::ibv_sge,
    _buffer: PhantomData<&'a [u8]>,
}

impl std::fmt::Debug for RecvRequest<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecvRequest")
            .field("wr_id", &self.wr.wr_id)
            .field("len", &self.sge.length)
            .finish()
    }
}

impl RecvRequest<'static> {
    /// A receive of `len` bytes at `addr`, under `lkey`, that borrows
    /// nothing: the reactor's receive rings.
    ///
    /// # Safety
    ///
    /// `addr..addr + len` must lie in the registration `lkey` names, and
    /// that registration must outlive every post of the request and its
    /// completion (the device writes there until the receive completes or
    /// its QP is destroyed), with no reference into those bytes held while
    /// it may.
    pub(crate) unsafe fn from_raw(wr_id: u64, addr: u64, len: u32, lkey: u32) -> Self {
        let sge = sys::ibv_sge {
            addr,
            length: len,
            lkey,
        };
        let wr = sys::ibv_recv_wr {
            wr_id,
            num_sge: i32::from(len > 0),
            ..Default::default()
        };
        Self {
            wr,
            sge,
            _buffer: PhantomData,
        }
    }
}

impl<'a> RecvRequest<'a> {
    /// A receive into `local`, which must be registered with `LOCAL_WRITE`.
    /// An empty slice receives only immediates and zero-byte messages.
    pub fn new(wr_id: u64, local: LocalSlice<'a>) -> Result<Self> {
        if !local.access.contains(AccessFlags::LOCAL_WRITE) {
            return Err(Error::InvalidArgument(
                "a RECV buffer must be registered with LOCAL_WRITE",
            ));
        }
        let sge = sge(&local);
        let wr = sys::ibv_recv_wr {
            wr_id,
            num_sge: i32::from(sge.length > 0),
            ..Default::default()
        };
        Ok(Self {
            wr,
            sge,
            _buffer: PhantomData,
        })
    }

    /// The caller's id for this request.
    pub fn wr_id(&self) -> u64 {
        self.wr.wr_id
    }

    /// Sets the caller's id, in place (for a request kept and posted again).
    pub fn set_wr_id(&mut self, wr_id: u64) {
        self.wr.wr_id = wr_id;
    }
}

impl<'a> Request for RecvRequest<'a> {
    type Wr = sys::ibv_recv_wr;
    type Detached = RecvRequest<'static>;

    #[inline(always)]
    fn link_to(&mut self, next: *mut sys::ibv_recv_wr) -> *mut sys::ibv_recv_wr {
        self.wr.sg_list = &raw mut self.sge;
        self.wr.next = next;
        &raw mut self.wr
    }

    #[inline(always)]
    fn wr_id(&self) -> u64 {
        self.wr.wr_id
    }

    #[inline(always)]
    fn set_wr_id(&mut self, wr_id: u64) {
        self.wr.wr_id = wr_id;
    }

    #[inline(always)]
    fn inline_len(&self) -> Option<u32> {
        None
    }

    fn local_sge(&self) -> (u64, u32, u32) {
        (self.sge.addr, self.sge.length, self.sge.lkey)
    }

    fn detached(self) -> Option<RecvRequest<'static>> {
        Some(RecvRequest {
            wr: self.wr,
            sge: self.sge,
            _buffer: PhantomData,
        })
    }
}

impl<'a> Requests for RecvRequest<'a> {
    type Wr = sys::ibv_recv_wr;
    type Request = Self;

    #[inline(always)]
    fn requests_mut(&mut self, _: Seal) -> &mut [Self] {
        std::slice::from_mut(self)
    }
}

impl<'a> Keep for RecvRequest<'a> {
    type Kept = RecvRequest<'static>;

    fn kept(self) -> Option<RecvRequest<'static>> {
        self.detached()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_links_requests_in_order() {
        let data = [1u8, 2, 3];
        let mut batch = SendBatch::<4>::new();
        for id in 0..4 {
            batch.push(WorkRequest::send_inline(id, &data)).unwrap();
        }
        assert!(
            batch.push(WorkRequest::send_inline(9, &data)).is_err(),
            "a full batch refuses more"
        );
        let mut cur = super::super::requests::link(batch.requests_mut(Seal::new()));
        let mut ids = Vec::new();
        while !cur.is_null() {
            // SAFETY: the list points into `batch`, alive and unmodified here.
            let wr = unsafe { &*cur };
            ids.push(wr.wr_id);
            // SAFETY: as above.
            assert_eq!(unsafe { (*wr.sg_list).length }, 3);
            cur = wr.next;
        }
        assert_eq!(ids, [0, 1, 2, 3]);
    }

    /// A request over unregistered bytes stays inline whatever flags are
    /// set on it; a READ never is.
    #[test]
    fn flags_keep_an_inline_send_inline_and_a_read_not() {
        let data = [7u8; 4];
        let mut inline = WorkRequest::send_inline(1, &data);
        inline.set_flags(SendFlags::SIGNALED);
        assert_eq!(inline.flags(), SendFlags::SIGNALED | SendFlags::INLINE);
        inline.set_flags(SendFlags::empty());
        assert_eq!(inline.flags(), SendFlags::INLINE);

        let target = sys::ibv_sge {
            addr: 0x1000,
            length: 4,
            lkey: 9,
        };
        let read = WorkRequest::new(2, sys::IBV_WR_RDMA_READ, target)
            .with_flags(SendFlags::INLINE | SendFlags::SIGNALED);
        assert_eq!(read.flags(), SendFlags::SIGNALED);
    }

    #[test]
    fn immediates_travel_in_network_order() {
        let wr = WorkRequest::send_inline(1, &[]).with_imm_data(0x0102_0304);
        // SAFETY: imm_data is the member we just wrote.
        assert_eq!(
            unsafe { wr.wr.__bindgen_anon_1.imm_data },
            0x0102_0304u32.to_be()
        );
        assert_eq!(wr.wr.num_sge, 0, "an empty payload carries no SGE");
    }
}
