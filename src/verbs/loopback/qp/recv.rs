//! The receive side of a loopback QP: posting receives (refused over
//! memory a stalled send still uses), the walk over a posted list that an
//! SRQ shares, and the flushed completion of a receive.

use super::*;

impl LbQp {
    /// `ibv_post_recv`.
    ///
    /// # Safety
    /// `head` starts a NULL-terminated list of valid receive requests with
    /// valid SGE lists; `bad` is writable.
    unsafe fn post_recvs(
        &self,
        head: *mut sys::ibv_recv_wr,
        bad: *mut *mut sys::ibv_recv_wr,
    ) -> c_int {
        if self.srq.is_some() {
            // A QP on an SRQ takes no receives of its own (EINVAL, as rxe).
            // SAFETY: `bad` is writable (the caller).
            unsafe { *bad = head };
            return libc::EINVAL;
        }
        // SAFETY: as the caller vouches for the list.
        if unsafe { receive_over_stalled_send(head) } {
            // Nothing of the list is posted: the first request is bad.
            // SAFETY: `bad` is writable (the caller).
            unsafe { *bad = head };
            return libc::EBUSY;
        }
        let mut kick = false;
        let rc = 'post: {
            let mut rq = lock(&self.rq);
            if self.state() == sys::IBV_QPS_RESET {
                // SAFETY: `bad` is writable (the caller).
                unsafe { *bad = head };
                break 'post libc::EINVAL;
            }
            // SAFETY: as the caller vouches for the list and `bad`.
            unsafe {
                take_recv_list(head, bad, self.max_recv_sge, |wr_id, sgl| {
                    if self.state() == sys::IBV_QPS_ERR {
                        self.recv_cq.push(flush_recv_wc(wr_id, self.qpn));
                    } else if rq.posted.len() >= self.max_recv_wr {
                        return Err(libc::ENOMEM);
                    } else {
                        rq.posted.push_back(PostedRecv { wr_id, sgl });
                        kick |= std::mem::take(&mut rq.peer_waiting);
                    }
                    Ok(())
                })
            }
        };
        if kick && let Some(peer) = self.peer() {
            peer.progress();
        }
        rc
    }
}

/// Walks the receive list at `head`, handing each request's `wr_id` and
/// checked SGE list (at most `max_sge` entries) to `take`. Stops at the
/// first request whose SGE list is invalid (`EINVAL`) or that `take`
/// refuses (its errno), pointing `bad` at it; 0 when all were taken.
///
/// # Safety
/// `head` starts a NULL-terminated list of valid receive requests with
/// valid SGE lists; `bad` is writable.
pub(in crate::verbs::loopback) unsafe fn take_recv_list(
    head: *mut sys::ibv_recv_wr,
    bad: *mut *mut sys::ibv_recv_wr,
    max_sge: usize,
    mut take: impl FnMut(u64, SgList) -> Result<(), c_int>,
) -> c_int {
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: a valid request of the caller's list.
        let wr = unsafe { &*cur };
        // SAFETY: the caller vouches for its SGE list.
        let refused = match unsafe { SgList::from_raw(wr.sg_list, wr.num_sge, max_sge) } {
            Some(sgl) => take(wr.wr_id, sgl).err(),
            None => Some(libc::EINVAL),
        };
        if let Some(errno) = refused {
            // SAFETY: `bad` is writable (the caller).
            unsafe { *bad = cur };
            return errno;
        }
        cur = wr.next;
    }
    0
}

/// True if a receive of the list at `head` has memory a stalled send of
/// any QP still uses (the arriving message would overwrite what that send
/// has yet to read, or a READ has yet to write). A NIC would not notice;
/// this device refuses the list, as it refuses an unregistered buffer.
/// Checked only while some send is stalled.
///
/// # Safety
/// `head` starts a NULL-terminated list of valid receive requests with
/// valid SGE lists.
#[inline]
pub(in crate::verbs::loopback) unsafe fn receive_over_stalled_send(
    head: *mut sys::ibv_recv_wr,
) -> bool {
    // SAFETY: as the caller vouches.
    STALLED.load(Ordering::Relaxed) > 0 && unsafe { check_stalled_uses(head) }
}

/// [`receive_over_stalled_send`] while some send is stalled.
///
/// # Safety
/// As for [`receive_over_stalled_send`].
#[cold]
unsafe fn check_stalled_uses(head: *mut sys::ibv_recv_wr) -> bool {
    // Taken out of the registry first: a send-queue lock is never taken
    // with the registry's held.
    let qps: Vec<Arc<LbQp>> = lock(&QPS).values().filter_map(Weak::upgrade).collect();
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: a valid request of the caller's list.
        let wr = unsafe { &*cur };
        // SAFETY: the caller vouches for its SGE list. (An invalid one is
        // refused by the post itself.)
        let sgl = unsafe { SgList::from_raw(wr.sg_list, wr.num_sge, MAX_SGE) };
        if sgl.is_some_and(|sgl| qps.iter().any(|qp| qp.stalled_use(&sgl))) {
            return true;
        }
        cur = wr.next;
    }
    false
}

pub(super) fn flush_recv_wc(wr_id: u64, qpn: u32) -> sys::ibv_wc {
    sys::ibv_wc {
        wr_id,
        status: sys::IBV_WC_WR_FLUSH_ERR,
        opcode: sys::IBV_WC_RECV,
        qp_num: qpn,
        ..Default::default()
    }
}

pub(in crate::verbs::loopback) unsafe extern "C" fn post_recv(
    qp: *mut sys::ibv_qp,
    wr: *mut sys::ibv_recv_wr,
    bad: *mut *mut sys::ibv_recv_wr,
) -> c_int {
    // SAFETY: as for post_send.
    unsafe { qp_of(qp).post_recvs(wr, bad) }
}
