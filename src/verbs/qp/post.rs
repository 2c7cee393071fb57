//! Posting on a queue pair: send-queue requests one at a time, in batches
//! and kept to post again, the reactor's preallocated lists, window binds,
//! and receives; each ends in one call of the provider's post function.

use std::os::raw::c_int;
use std::ptr;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::sys;

use super::super::BIND_WR_ID;
use super::super::kept::{KeptBatch, KeptRecv, KeptRequest};
use super::super::list::{self, SendList};
use super::super::mw::{WindowSlot, ZERO_BASED_BIND};
use super::super::wr::{self, RecvBatch, RecvRequest, SendBatch, WorkRequest};
use super::QueuePair;

impl QueuePair {
    /// Posts one send-queue request.
    #[inline]
    pub fn post_send(&mut self, request: WorkRequest<'_>) -> Result<()> {
        let mut request = request;
        self.post_send_kept(&mut request)
    }

    /// Posts `request` and leaves it with the caller, to post again: a
    /// request built once outside the loop is posted with no building or
    /// copying per post (perftest's way; [`post_send`](Self::post_send)
    /// builds and copies one each time). Change its id or flags in place
    /// ([`WorkRequest::set_wr_id`], [`WorkRequest::set_flags`]) between
    /// posts. A request it keeps borrows its memory's [`Registration`]
    /// (sliced with [`Registration::slice`], it leaves the
    /// [`MemoryRegion`](crate::verbs::MemoryRegion) free to be written through
    /// `&mut`).
    ///
    /// [`Registration`]: crate::verbs::Registration
    /// [`Registration::slice`]: crate::verbs::Registration::slice
    #[inline]
    pub fn post_send_kept(&mut self, request: &mut WorkRequest<'_>) -> Result<()> {
        self.check_inline(request)?;
        let head = wr::Linkable::link_to(request, ptr::null_mut());
        // SAFETY: one request, NULL-terminated, pointing at its own SGE,
        // borrowed for the call.
        unsafe { self.post_send_raw(head, 1) }
    }

    /// Posts a [`KeptRequest`], which keeps the registration its bytes are
    /// in: as [`post_send_kept`](Self::post_send_kept), for a request kept
    /// in a struct beside its memory.
    #[inline]
    pub fn post_kept(&mut self, request: &mut KeptRequest) -> Result<()> {
        self.post_send_kept(request.request_mut())
    }

    /// Posts a [`KeptBatch`] as one list (one doorbell), as
    /// [`post_send_batch_kept`](Self::post_send_batch_kept).
    #[inline]
    pub fn post_kept_batch<const N: usize>(&mut self, batch: &mut KeptBatch<N>) -> Result<()> {
        self.post_send_batch_kept(batch.batch_mut())
    }

    /// Posts a [`KeptRecv`], as [`post_recv_kept`](Self::post_recv_kept).
    #[inline]
    pub fn post_kept_recv(&mut self, request: &mut KeptRecv) -> Result<()> {
        self.post_recv_kept(request.request_mut())
    }

    /// Posts every request of `batch` as one linked list (one doorbell) and
    /// keeps them, to post the same list again (perftest's post list, `-l`):
    /// nothing is built or copied per post. Change a request in place between
    /// posts through [`Batch::get_mut`](crate::verbs::Batch::get_mut). On
    /// [`Error::Post`] the batch is left as it was and the error says how
    /// many of its first requests the provider took: those are posted, so
    /// posting the batch again would post them twice (unlike
    /// [`post_send_batch`](Self::post_send_batch), which drops them).
    #[inline]
    pub fn post_send_batch_kept<const N: usize>(
        &mut self,
        batch: &mut SendBatch<'_, N>,
    ) -> Result<()> {
        if batch.is_empty() {
            return Ok(());
        }
        for request in &batch.requests {
            self.check_inline(request)?;
        }
        let len = batch.len();
        let head = wr::link(batch);
        // SAFETY: `link` made a NULL-terminated list of `len` requests inside
        // `batch`, which stays untouched until the call returns.
        unsafe { self.post_send_raw(head, len) }
    }

    /// Posts every request of `batch` as one linked list (one doorbell), then
    /// clears the batch. On error [`Error::Post`] says how many went out;
    /// those leave the batch and the rest stay, to retry.
    #[inline]
    pub fn post_send_batch<const N: usize>(&mut self, batch: &mut SendBatch<'_, N>) -> Result<()> {
        let len = batch.len();
        match self.post_send_batch_kept(batch) {
            Ok(()) => {
                batch.clear();
                Ok(())
            }
            Err(err) => {
                // The requests that went in leave the batch: posting them
                // again would send (or write into) their buffers twice.
                if let Error::Post { posted, .. } = err {
                    batch.requests.drain(..posted.min(len));
                }
                Err(err)
            }
        }
    }

    /// Posts every request staged in `list` with one doorbell and empties it
    /// (also on error: the caller fails the connection then).
    #[inline]
    pub(crate) fn post_list<const N: usize>(&mut self, list: &mut SendList<N>) -> Result<()> {
        list.post_with(|head, len| {
            // SAFETY: `post_with` hands a NULL-terminated list of `len`
            // requests in the list's own boxed arrays, alive for the call.
            unsafe { self.post_send_raw(head, len) }
        })
    }

    #[inline]
    fn check_inline(&self, request: &WorkRequest<'_>) -> Result<()> {
        if request.wr.send_flags & sys::IBV_SEND_INLINE != 0
            && request.sge.length > self.max_inline_data
        {
            return Err(Error::InlineTooLarge {
                len: request.sge.length as usize,
                max: self.max_inline_data,
            });
        }
        Ok(())
    }

    /// Posts a NULL-terminated list of `len` requests.
    ///
    /// # Safety
    /// `head` must start a NULL-terminated list of at least `len` valid
    /// `ibv_send_wr`s whose SGE arrays are valid too, all alive for the call.
    #[inline]
    unsafe fn post_send_raw(&mut self, head: *mut sys::ibv_send_wr, len: usize) -> Result<()> {
        self.posted = true;
        // SAFETY: as the caller vouches.
        unsafe { self.post_send_unrecorded(head, len, "ibv_post_send") }
    }

    /// Posts one window bind, counted in [`bound_windows`](Self::bound_windows)
    /// instead of [`has_posted`](Self::has_posted).
    ///
    /// # Safety
    /// `wr` must be a valid, NULL-terminated `IBV_WR_BIND_MW` request with
    /// the `wr_id` [`BIND_WR_ID`](BIND_WR_ID), whose window and MR
    /// are live for the call.
    pub(in crate::verbs) unsafe fn post_bind(
        &mut self,
        wr: &mut sys::ibv_send_wr,
        window: &Arc<WindowSlot>,
    ) -> Result<()> {
        debug_assert_eq!(wr.opcode, sys::IBV_WR_BIND_MW);
        debug_assert_eq!(wr.wr_id, BIND_WR_ID);
        wr.next = ptr::null_mut();
        // SAFETY: as the caller vouches; one request.
        unsafe { self.post_send_unrecorded(wr, 1, ZERO_BASED_BIND) }?;
        self.binds += 1;
        // Windows dropped since then need no tracking.
        self.windows.retain(|w| w.strong_count() > 0);
        self.windows.push(Arc::downgrade(window));
        Ok(())
    }

    /// Posts a list of send requests without noting it; a refusal names
    /// `verb`.
    ///
    /// # Safety
    /// As for `post_send_raw`.
    #[inline]
    unsafe fn post_send_unrecorded(
        &mut self,
        head: *mut sys::ibv_send_wr,
        len: usize,
        verb: &'static str,
    ) -> Result<()> {
        let mut bad: *mut sys::ibv_send_wr = ptr::null_mut();
        // SAFETY: the caller vouches for the list; the provider copies the
        // requests (or the inline payload) before returning.
        let rc = unsafe { (self.post_send_fn)(self.qp.as_ptr(), head, &mut bad) };
        if rc == 0 {
            Ok(())
        } else {
            Err(self.post_error(verb, rc, list::count_before(head, bad, len)))
        }
    }

    /// Posts one receive.
    #[inline]
    pub fn post_recv(&mut self, request: RecvRequest<'_>) -> Result<()> {
        let mut request = request;
        self.post_recv_kept(&mut request)
    }

    /// Posts `request` and leaves it with the caller, to post again (see
    /// [`post_send_kept`](Self::post_send_kept)).
    #[inline]
    pub fn post_recv_kept(&mut self, request: &mut RecvRequest<'_>) -> Result<()> {
        let head = wr::Linkable::link_to(request, ptr::null_mut());
        // SAFETY: one request, NULL-terminated, pointing at its own SGE,
        // borrowed for the call.
        unsafe { self.post_recv_raw(head, 1) }
    }

    /// Posts every request of `batch` with one `ibv_post_recv`, then clears it.
    #[inline]
    pub fn post_recv_batch<const N: usize>(&mut self, batch: &mut RecvBatch<'_, N>) -> Result<()> {
        self.posted = true;
        let (qp, post) = (self.qp.as_ptr(), self.post_recv_fn);
        list::post_recv_batch(batch, |head, bad| {
            // SAFETY: the QP is live; `head` is a NULL-terminated list of
            // requests inside `batch`, untouched until the call returns.
            unsafe { post(qp, head, bad) }
        })
        .map_err(|(rc, posted)| self.post_error("ibv_post_recv", rc, posted))
    }

    /// # Safety
    /// As for `post_send_raw`, for receive requests.
    #[inline]
    unsafe fn post_recv_raw(&mut self, head: *mut sys::ibv_recv_wr, len: usize) -> Result<()> {
        self.posted = true;
        let mut bad: *mut sys::ibv_recv_wr = ptr::null_mut();
        // SAFETY: as in post_send_raw.
        let rc = unsafe { (self.post_recv_fn)(self.qp.as_ptr(), head, &mut bad) };
        if rc == 0 {
            Ok(())
        } else {
            Err(self.post_error("ibv_post_recv", rc, list::count_before(head, bad, len)))
        }
    }

    #[cold]
    fn post_error(&self, verb: &'static str, rc: c_int, posted: usize) -> Error {
        Error::Post {
            verb,
            errno: rc.abs(),
            device: Arc::clone(&self.pd.ctx.name),
            qpn: self.qpn,
            posted,
        }
    }
}
