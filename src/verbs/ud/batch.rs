//! Datagrams staged for one `ibv_post_send` ([`UdSendList`]): the
//! reactor's datagram endpoints post each pass's sends as one list, one
//! doorbell, from preallocated requests.

use std::ptr;
use std::sync::Arc;

use crate::error::Result;
use crate::sys;

use super::super::list::{Sge, count_before};
use super::{AddressHandle, UdDestination, UdQueuePair};

/// Up to `N` datagrams, preallocated, each holding the address handle it
/// goes to until the list is posted (the handler's destination may be
/// dropped in between).
pub(crate) struct UdSendList<const N: usize> {
    // Boxed: a list is large, and its owner moves.
    wrs: Box<[sys::ibv_send_wr; N]>,
    sges: Box<[sys::ibv_sge; N]>,
    /// The handle of each staged datagram. An entry keeps its handle after
    /// the post, so a sender that keeps sending to one destination pays no
    /// reference count per datagram.
    handles: Box<[Option<Arc<AddressHandle>>; N]>,
    len: usize,
}

// SAFETY: the raw pointers inside are the links `post` writes into the
// list's own boxes right before posting (unused after) and the address
// handles of `handles`, which the list holds.
unsafe impl<const N: usize> Send for UdSendList<N> {}

impl<const N: usize> UdSendList<N> {
    pub(crate) fn new() -> Self {
        let mut wrs = Box::new([sys::ibv_send_wr::default(); N]);
        for wr in wrs.iter_mut() {
            wr.opcode = sys::IBV_WR_SEND;
        }
        Self {
            wrs,
            sges: Box::new([sys::ibv_sge::default(); N]),
            handles: Box::new(std::array::from_fn(|_| None)),
            len: 0,
        }
    }

    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    #[inline]
    pub(crate) fn is_full(&self) -> bool {
        self.len == N
    }

    /// Stages a SEND of `local` to `to`, inline if `inline`, asking for a
    /// completion if `signaled`; false (nothing staged) when full. The
    /// caller checked `to` with [`UdQueuePair::check_destination`] and keeps
    /// `local` within the port's MTU.
    #[inline]
    pub(crate) fn push(
        &mut self,
        wr_id: u64,
        local: Sge,
        to: &UdDestination,
        inline: bool,
        signaled: bool,
    ) -> bool {
        let i = self.len;
        // `>=`, not `==`: it also proves the indexing below in bounds.
        if i >= N {
            return false;
        }
        let held = &mut self.handles[i];
        if !held.as_ref().is_some_and(|h| Arc::ptr_eq(h, &to.handle)) {
            *held = Some(Arc::clone(&to.handle));
        }
        let sge = &mut self.sges[i];
        sge.addr = local.addr;
        sge.length = local.len;
        sge.lkey = local.lkey;
        let wr = &mut self.wrs[i];
        wr.wr_id = wr_id;
        wr.num_sge = i32::from(local.len > 0);
        wr.send_flags = (if inline { sys::IBV_SEND_INLINE } else { 0 })
            | (if signaled { sys::IBV_SEND_SIGNALED } else { 0 });
        wr.wr.ud = sys::ibv_send_wr__bindgen_ty_2__bindgen_ty_3 {
            ah: to.handle.ah.as_ptr(),
            remote_qpn: to.qpn,
            remote_qkey: to.qkey,
        };
        self.len = i + 1;
        true
    }
}

impl UdQueuePair {
    /// Whether this QP may send to `to`: a destination of the QP's PD.
    /// (The caller keeps each datagram within [`max_datagram`](Self::max_datagram).)
    #[inline]
    pub(crate) fn check_destination(&self, to: &UdDestination) -> Result<()> {
        if !Arc::ptr_eq(&to.handle.pd, &self.pd) {
            return Err(crate::Error::ForeignHandle(
                "a UdDestination of another protection domain than the QP's",
            ));
        }
        Ok(())
    }

    /// Posts every datagram of `list` with one `ibv_post_send` and empties
    /// it, also when the post fails. Each posted datagram's address handle
    /// is kept with its send-queue entry until the entry is reused.
    pub(crate) fn post_list<const N: usize>(&mut self, list: &mut UdSendList<N>) -> Result<()> {
        let len = list.len;
        if len == 0 {
            return Ok(());
        }
        list.len = 0;
        // Links from pointers taken now: every one derives from these two,
        // and nothing borrows the arrays again until the post returns.
        let wrs = list.wrs.as_mut_ptr();
        let sges = list.sges.as_mut_ptr();
        for i in 0..len {
            let next = if i + 1 < len {
                wrs.wrapping_add(i + 1)
            } else {
                ptr::null_mut()
            };
            // SAFETY: i < len <= N, so entry i of both arrays exists; we
            // hold `&mut list`, so nothing else accesses them.
            unsafe {
                (*wrs.add(i)).sg_list = sges.add(i);
                (*wrs.add(i)).next = next;
            }
        }
        let mut bad: *mut sys::ibv_send_wr = ptr::null_mut();
        // SAFETY: a NULL-terminated list of `len` requests of this QP's
        // kind, each with its SGE beside it and an address handle of the
        // QP's PD (`check_send`) that `list.handles` holds for the call.
        let rc = unsafe { (self.post_send_fn)(self.qp.as_ptr(), wrs, &mut bad) };
        let posted = if rc == 0 {
            len
        } else {
            count_before(wrs, bad, len)
        };
        for handle in &list.handles[..posted] {
            // The entry's previous send was done before the queue took this
            // one in its place: its handle may go.
            let entry = &mut self.in_flight[self.next_entry];
            if !entry
                .as_ref()
                .zip(handle.as_ref())
                .is_some_and(|(a, b)| Arc::ptr_eq(a, b))
            {
                entry.clone_from(handle);
            }
            self.next_entry += 1;
            if self.next_entry == self.in_flight.len() {
                self.next_entry = 0;
            }
        }
        self.post_error("ibv_post_send", rc, posted)
    }
}
