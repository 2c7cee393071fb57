//! Shared receive queues: one queue of posted receives that every QP
//! created on it consumes in order, whichever QP a SEND arrives on, and the
//! `post_srq_recv` entry of the ops table.
//!
//! As on a NIC, a QP that goes to the error state flushes none of the
//! SRQ's receives (they stay posted for the other QPs), and a QP's
//! receive completion names that QP (`qp_num`), not the SRQ.

use std::collections::VecDeque;
use std::os::raw::c_int;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use crate::sys;

use super::qp::{LbQp, receive_over_stalled_send, take_recv_list};
use super::registry::{QPS, next_handle};
use super::request::PostedRecv;
use super::{MAX_SGE, MAX_SRQ_WR, lock};

/// A loopback SRQ's shared state, held by the QPs created on it.
pub(super) struct LbSrq {
    /// Its `ibv_srq` handle, which the test-only refusal knob is keyed by.
    #[cfg(test)]
    handle: u32,
    /// The PD its receives' local keys are checked against.
    pub(super) pd: u32,
    max_wr: usize,
    max_sge: usize,
    queue: Mutex<SrqQueue>,
}

/// An SRQ's posted receives. Locked inside a QP's receive-queue lock (by a
/// delivery) or alone (by a post); nothing is locked under it but the MR
/// table's read lock and the CQ rings.
pub(super) struct SrqQueue {
    pub(super) posted: VecDeque<PostedRecv>,
    /// The QPs (by number) on this SRQ whose peer's send queue stalled on
    /// it for want of a receive: the next post runs those send queues.
    waiting: Vec<u32>,
}

impl SrqQueue {
    /// Notes that the peer of QP `qpn` stalled on this SRQ.
    pub(super) fn wait(&mut self, qpn: u32) {
        if !self.waiting.contains(&qpn) {
            self.waiting.push(qpn);
        }
    }
}

/// A loopback SRQ: the verbs struct the crate holds, then the shared state.
#[repr(C)]
struct SrqObj {
    /// First, so an `*mut ibv_srq` of ours is an `*mut SrqObj`.
    srq: sys::ibv_srq,
    lb: Arc<LbSrq>,
}

/// The state of a loopback SRQ.
///
/// # Safety
/// `srq` is a live SRQ from [`create_srq`], alive for `'a`.
pub(super) unsafe fn srq_of<'a>(srq: *mut sys::ibv_srq) -> &'a Arc<LbSrq> {
    // SAFETY: our SRQs are SrqObjs with the ibv_srq first (repr(C)); only
    // the `lb` field is borrowed, which nobody writes after creation.
    unsafe { &(*srq.cast::<SrqObj>()).lb }
}

/// Creates an SRQ in `pd` of `init.attr.max_wr` receives of up to
/// `init.attr.max_sge` entries, and writes the granted sizes back. Destroy
/// it with [`destroy_srq`].
///
/// # Safety
/// `pd` is a live PD from [`alloc_pd`](super::alloc_pd).
pub(crate) unsafe fn create_srq(
    pd: NonNull<sys::ibv_pd>,
    init: &mut sys::ibv_srq_init_attr,
) -> Result<NonNull<sys::ibv_srq>, c_int> {
    let attr = &mut init.attr;
    if attr.max_wr > MAX_SRQ_WR || attr.max_sge as usize > MAX_SGE {
        return Err(libc::EINVAL);
    }
    attr.max_wr = attr.max_wr.max(1);
    attr.max_sge = attr.max_sge.max(1);
    // SAFETY: the caller vouches for the PD.
    let (context, pd_handle) = unsafe { ((*pd.as_ptr()).context, (*pd.as_ptr()).handle) };
    let handle = next_handle();
    let lb = Arc::new(LbSrq {
        #[cfg(test)]
        handle,
        pd: pd_handle,
        max_wr: attr.max_wr as usize,
        max_sge: attr.max_sge as usize,
        queue: Mutex::new(SrqQueue {
            posted: VecDeque::with_capacity(attr.max_wr as usize),
            waiting: Vec::new(),
        }),
    });
    let obj = Box::new(SrqObj {
        srq: sys::ibv_srq {
            context,
            srq_context: init.srq_context,
            pd: pd.as_ptr(),
            handle,
            ..Default::default()
        },
        lb,
    });
    Ok(NonNull::from(Box::leak(obj)).cast())
}

/// Destroys an SRQ from [`create_srq`]. Its receives go with it unflushed,
/// as on a NIC; QPs still on it (none: the crate destroys them first)
/// would keep its queue.
///
/// # Safety
/// `srq` came from [`create_srq`] and is destroyed once; no call on it runs.
pub(crate) unsafe fn destroy_srq(srq: NonNull<sys::ibv_srq>) {
    // SAFETY: a Box<SrqObj> from create_srq, released once.
    drop(unsafe { Box::from_raw(srq.as_ptr().cast::<SrqObj>()) });
}

/// The `wr_id`s of the receives posted on a loopback SRQ now, oldest
/// first (tests of who posts what).
///
/// # Safety
/// `srq` is a live SRQ from [`create_srq`].
#[cfg(test)]
pub(crate) unsafe fn posted_wr_ids(srq: NonNull<sys::ibv_srq>) -> Vec<u64> {
    // SAFETY: the caller vouches for the SRQ.
    let srq = unsafe { srq_of(srq.as_ptr()) };
    srq.queue().posted.iter().map(|recv| recv.wr_id).collect()
}

impl LbSrq {
    pub(super) fn queue(&self) -> MutexGuard<'_, SrqQueue> {
        lock(&self.queue)
    }

    /// `ibv_post_srq_recv`: refused whole (`EBUSY`) over memory a stalled
    /// send still uses, as a QP's receives are; `ENOMEM` once `max_wr`
    /// receives are posted. Then the send queues stalled on this SRQ run.
    ///
    /// # Safety
    /// `head` starts a NULL-terminated list of valid receive requests with
    /// valid SGE lists; `bad` is writable.
    unsafe fn post_recvs(
        &self,
        head: *mut sys::ibv_recv_wr,
        bad: *mut *mut sys::ibv_recv_wr,
    ) -> c_int {
        // SAFETY: as the caller vouches for the list.
        if unsafe { receive_over_stalled_send(head) } {
            // SAFETY: `bad` is writable (the caller).
            unsafe { *bad = head };
            return libc::EBUSY;
        }
        let mut waiting = Vec::new();
        let rc = {
            let mut queue = self.queue();
            #[cfg(test)]
            let mut limit = super::registry::take_srq_recv_limit(self.handle);
            // SAFETY: as the caller vouches for the list and `bad`.
            unsafe {
                take_recv_list(head, bad, self.max_sge, |wr_id, sgl| {
                    #[cfg(test)]
                    if limit.refuses_next() {
                        return Err(libc::ENOMEM);
                    }
                    if queue.posted.len() >= self.max_wr {
                        return Err(libc::ENOMEM);
                    }
                    queue.posted.push_back(PostedRecv { wr_id, sgl });
                    if !queue.waiting.is_empty() {
                        waiting = std::mem::take(&mut queue.waiting);
                    }
                    Ok(())
                })
            }
        };
        if !waiting.is_empty() {
            wake(&waiting);
        }
        rc
    }
}

/// Runs the send queues that stalled on an SRQ's QPs `qpns` (no lock held:
/// each takes its own send-queue lock; one that finds no receive again
/// waits again).
fn wake(qpns: &[u32]) {
    // Out of the registry first: a send-queue lock is never taken with the
    // registry's held.
    let qps: Vec<Arc<LbQp>> = {
        let registry = lock(&QPS);
        qpns.iter()
            .filter_map(|qpn| registry.get(qpn).and_then(Weak::upgrade))
            .collect()
    };
    for qp in qps {
        qp.receive_posted();
    }
}

/// The ops table's `post_srq_recv`.
///
/// # Safety
/// `srq` is a live SRQ from [`create_srq`], `wr` starts a NULL-terminated
/// list of valid receive requests with valid SGE lists, and `bad` is
/// writable (libibverbs' contract for the verb).
pub(super) unsafe extern "C" fn post_srq_recv(
    srq: *mut sys::ibv_srq,
    wr: *mut sys::ibv_recv_wr,
    bad: *mut *mut sys::ibv_recv_wr,
) -> c_int {
    // SAFETY: libibverbs' contract: `srq` is a live SRQ of this context (one
    // of ours), `wr` a valid list, `bad` writable.
    unsafe { srq_of(srq).post_recvs(wr, bad) }
}
