//! Requests that keep the registration their bytes are in, so a handler
//! can build them once and keep them for as long as it likes: perftest's
//! prebuilt requests, as values with no lifetime. A [`WorkRequest`] borrows
//! its memory for as long as it exists, which a request kept in the same
//! struct as its [`MemoryRegion`](super::MemoryRegion) cannot do.

use arrayvec::ArrayVec;

use crate::error::{Error, Result};

use super::mr::Registration;
use super::wr::{RecvRequest, SendBatch, SendFlags, WorkRequest};

/// A send-queue request together with (a handle on) the registration its
/// bytes are in, to post again and again
/// ([`QueuePair::post_kept`](super::QueuePair::post_kept)). Only its id
/// and flags change after it is built; the request itself is never handed
/// out, so it cannot outlive the registration it points into.
#[derive(Debug)]
pub struct KeptRequest {
    request: WorkRequest<'static>,
    _memory: Registration,
}

/// Checks that `sge` lies in `memory`: its key, and its bytes in range.
fn within(memory: &Registration, addr: u64, len: u32, lkey: u32) -> Result<()> {
    let start = memory.addr();
    let end = start + memory.len() as u64;
    let fits = addr >= start && addr.checked_add(u64::from(len)).is_some_and(|e| e <= end);
    if len > 0 && (lkey != memory.lkey() || !fits) {
        return Err(Error::InvalidArgument(
            "a kept request's bytes must lie in the registration it keeps",
        ));
    }
    Ok(())
}

impl KeptRequest {
    /// Keeps `request`, whose bytes must lie in `memory` (checked: the
    /// key and the range). A [`WorkRequest::send_inline`] request is
    /// refused, since its bytes are in no registration.
    pub fn new(request: WorkRequest<'_>, memory: &Registration) -> Result<Self> {
        let (addr, len, lkey) = request.local_sge();
        within(memory, addr, len, lkey)?;
        let request = request.detached().ok_or(Error::InvalidArgument(
            "an inline request's bytes are in no registration to keep",
        ))?;
        Ok(Self {
            request,
            _memory: memory.clone(),
        })
    }

    /// Sets the id its next completion carries.
    #[inline]
    pub fn set_wr_id(&mut self, wr_id: u64) {
        self.request.set_wr_id(wr_id);
    }

    /// The id its next completion carries.
    #[inline]
    pub fn wr_id(&self) -> u64 {
        self.request.wr_id()
    }

    /// Sets its flags, as [`WorkRequest::set_flags`].
    #[inline]
    pub fn set_flags(&mut self, flags: SendFlags) {
        self.request.set_flags(flags);
    }

    /// Its flags.
    #[inline]
    pub fn flags(&self) -> SendFlags {
        self.request.flags()
    }

    #[inline]
    pub(crate) fn request_mut(&mut self) -> &mut WorkRequest<'static> {
        &mut self.request
    }
}

// SAFETY: the request's raw pointers (`next`, `sg_list`) are written at
// each post, from the request's own place, and never read otherwise; the
// bytes it points at are the registration's, which is `Send + Sync` and
// held here, so moving it to another thread moves nothing it relies on.
unsafe impl Send for KeptRequest {}

/// A receive request together with the registration it lands in (see
/// [`KeptRequest`]).
#[derive(Debug)]
pub struct KeptRecv {
    request: RecvRequest<'static>,
    _memory: Registration,
}

impl KeptRecv {
    /// Keeps `request`, whose bytes must lie in `memory` (checked).
    pub fn new(request: RecvRequest<'_>, memory: &Registration) -> Result<Self> {
        let (addr, len, lkey) = request.local_sge();
        within(memory, addr, len, lkey)?;
        Ok(Self {
            request: request.detached(),
            _memory: memory.clone(),
        })
    }

    /// Sets the id its next completion carries.
    #[inline]
    pub fn set_wr_id(&mut self, wr_id: u64) {
        self.request.set_wr_id(wr_id);
    }

    /// The id its next completion carries.
    #[inline]
    pub fn wr_id(&self) -> u64 {
        self.request.wr_id()
    }

    #[inline]
    pub(crate) fn request_mut(&mut self) -> &mut RecvRequest<'static> {
        &mut self.request
    }
}

// SAFETY: as for `KeptRequest`.
unsafe impl Send for KeptRecv {}

/// Up to `N` kept send-queue requests posted as one list, one doorbell
/// ([`QueuePair::post_kept_batch`](super::QueuePair::post_kept_batch)):
/// perftest's post list (`-l`), kept with the registrations it points into.
#[derive(Debug, Default)]
pub struct KeptBatch<const N: usize> {
    batch: SendBatch<'static, N>,
    /// One handle per distinct registration (most batches have one).
    memory: ArrayVec<Registration, N>,
}

// SAFETY: as for `KeptRequest`: the list's pointers are written at each
// post, and every request's memory is a registration held here.
unsafe impl<const N: usize> Send for KeptBatch<N> {}

impl<const N: usize> KeptBatch<N> {
    /// An empty batch.
    pub fn new() -> Self {
        Self {
            batch: SendBatch::new(),
            memory: ArrayVec::new(),
        }
    }

    /// Adds a request (see [`KeptRequest::new`] for what it may point at).
    /// Fails when the batch is full.
    pub fn push(&mut self, request: WorkRequest<'_>, memory: &Registration) -> Result<()> {
        let kept = KeptRequest::new(request, memory)?;
        if self.batch.is_full() {
            return Err(Error::InvalidArgument("the kept batch is full"));
        }
        if !self.memory.iter().any(|m| m.same_as(memory)) {
            self.memory.push(memory.clone());
        }
        // Cannot fail: checked above.
        let _ = self.batch.push(kept.request);
        Ok(())
    }

    /// Requests in the batch.
    pub fn len(&self) -> usize {
        self.batch.len()
    }

    /// True with no requests.
    pub fn is_empty(&self) -> bool {
        self.batch.is_empty()
    }

    /// Sets the id of request `index` (nothing past the end).
    #[inline]
    pub fn set_wr_id(&mut self, index: usize, wr_id: u64) {
        if let Some(request) = self.batch.get_mut(index) {
            request.set_wr_id(wr_id);
        }
    }

    /// The id of request `index`.
    #[inline]
    pub fn wr_id(&self, index: usize) -> Option<u64> {
        self.batch.requests.get(index).map(WorkRequest::wr_id)
    }

    /// Sets the flags of request `index` (nothing past the end).
    #[inline]
    pub fn set_flags(&mut self, index: usize, flags: SendFlags) {
        if let Some(request) = self.batch.get_mut(index) {
            request.set_flags(flags);
        }
    }

    #[inline]
    pub(crate) fn batch_mut(&mut self) -> &mut SendBatch<'static, N> {
        &mut self.batch
    }
}
