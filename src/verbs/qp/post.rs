//! Posting on a queue pair: send-queue requests and receives (one, or a
//! batch as one list, borrowing their memory or kept with it), the
//! reactor's preallocated lists and window binds; each ends in one call of
//! the provider's post function.

use std::os::raw::c_int;
use std::ptr;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::sys;

use super::super::BIND_WR_ID;
use super::super::list::{self, SendList};
use super::super::mw::{WindowSlot, ZERO_BASED_BIND};
use super::super::recv_slots::RecvSlots;
use super::super::requests::sealed::{Request, Seal};
use super::super::requests::{self, RecvRequests, SendRequests};
use super::QueuePair;

impl QueuePair {
    /// Posts `requests` (a [`WorkRequest`], a [`SendBatch`], or either
    /// [`Kept`]) as one linked list, one doorbell, and leaves them with the
    /// caller as they were: to post again with nothing built or copied per
    /// post (perftest's way), after changing an id or flags in place
    /// ([`WorkRequest::set_wr_id`], [`WorkRequest::set_flags`],
    /// [`Batch::get_mut`]). An inline request longer than the QP's
    /// [`max_inline_data`](Self::max_inline_data) is refused before
    /// anything is posted. On [`Error::Post`] the error says how many of
    /// the first requests the provider took: those are posted, so posting
    /// the same batch again would post them twice
    /// ([`Batch::drop_posted`] drops them).
    ///
    /// [`WorkRequest`]: crate::verbs::WorkRequest
    /// [`WorkRequest::set_wr_id`]: crate::verbs::WorkRequest::set_wr_id
    /// [`WorkRequest::set_flags`]: crate::verbs::WorkRequest::set_flags
    /// [`SendBatch`]: crate::verbs::SendBatch
    /// [`Batch::get_mut`]: crate::verbs::Batch::get_mut
    /// [`Batch::drop_posted`]: crate::verbs::Batch::drop_posted
    /// [`Kept`]: crate::verbs::Kept
    #[inline(always)]
    pub fn post_send<R: SendRequests>(&mut self, requests: &mut R) -> Result<()> {
        let requests = requests.requests_mut(Seal::new());
        if requests.is_empty() {
            return Ok(());
        }
        for request in requests.iter() {
            self.check_inline(request.inline_len())?;
        }
        let len = requests.len();
        let head = requests::link(requests);
        // SAFETY: `link` made a NULL-terminated list of `len` requests,
        // each pointing at its own SGE, inside `requests`, which stays
        // borrowed and untouched until the call returns.
        unsafe { self.post_send_raw(head, len) }
    }

    /// Posts `requests` (a [`RecvRequest`], a [`RecvBatch`], or either
    /// [`Kept`]) with one `ibv_post_recv` and leaves them with the caller,
    /// as [`post_send`](Self::post_send) does.
    ///
    /// [`RecvRequest`]: crate::verbs::RecvRequest
    /// [`RecvBatch`]: crate::verbs::RecvBatch
    /// [`Kept`]: crate::verbs::Kept
    #[inline]
    pub fn post_recv<R: RecvRequests>(&mut self, requests: &mut R) -> Result<()> {
        let requests = requests.requests_mut(Seal::new());
        if requests.is_empty() {
            return Ok(());
        }
        let len = requests.len();
        let head = requests::link(requests);
        // SAFETY: as in `post_send`.
        unsafe { self.post_recv_raw(head, len) }
    }

    /// Posts the receives of `slots` (indices into `recvs`, in that order)
    /// with one `ibv_post_recv`, linking their prebuilt requests. A slot
    /// out of `recvs` refuses the whole post.
    ///
    /// # Safety
    ///
    /// The memory `recvs` describes is registered on this QP's PD and stays
    /// so until every receive posted into it completed or the QP is
    /// destroyed; no slot in `slots` is posted already (on any QP), and
    /// none is accessed by the CPU while posted; `slots` names each slot
    /// once.
    #[inline]
    pub(crate) unsafe fn post_slots(&mut self, recvs: &mut RecvSlots, slots: &[u32]) -> Result<()> {
        recvs.post_with(slots, |head, len| {
            // SAFETY: a NULL-terminated list of `len` distinct requests of
            // `recvs`, each with its SGE, over memory the caller keeps
            // registered and unread while posted (this function's
            // contract).
            unsafe { self.post_recv_raw(head, len) }
        })
    }

    /// Posts every request staged in `list` with one doorbell and empties it
    /// (also on error: the caller fails the connection then).
    #[inline]
    pub(crate) fn post_list(&mut self, list: &mut SendList) -> Result<()> {
        list.post_with(|head, len| {
            // SAFETY: `post_with` hands a NULL-terminated list of `len`
            // requests in the list's own boxed arrays, alive for the call.
            unsafe { self.post_send_raw(head, len) }
        })
    }

    #[inline(always)]
    fn check_inline(&self, inline_len: Option<u32>) -> Result<()> {
        match inline_len {
            Some(len) if len > self.max_inline_data => Err(Error::InlineTooLarge {
                len: len as usize,
                max: self.max_inline_data,
            }),
            _ => Ok(()),
        }
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
            // SAFETY: the list just posted, valid as the caller vouches.
            let posted = unsafe { list::count_before(head, bad, len) };
            Err(self.post_error(verb, rc, posted))
        }
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
            // SAFETY: the list just posted, valid as the caller vouches.
            let posted = unsafe { list::count_before(head, bad, len) };
            Err(self.post_error("ibv_post_recv", rc, posted))
        }
    }

    #[cold]
    fn post_error(&self, verb: &'static str, rc: c_int, posted: usize) -> Error {
        post_error(verb, rc, &self.pd.ctx.name, self.qpn, posted)
    }
}

/// A refused post of `verb` (return code `rc`) on QP `qpn` of `device`,
/// after `posted` of its requests went out.
#[cold]
pub(in crate::verbs) fn post_error(
    verb: &'static str,
    rc: c_int,
    device: &Arc<str>,
    qpn: u32,
    posted: usize,
) -> Error {
    Error::Post {
        verb,
        errno: rc.abs(),
        device: Arc::clone(device),
        qpn,
        posted,
    }
}
