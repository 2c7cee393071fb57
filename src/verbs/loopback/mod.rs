//! An in-process software RDMA device, "loopback": RC queue pairs of any
//! loopback context in the process connect to one another, and the data
//! path (post send, post receive, poll) runs through the same cached
//! function pointers as a hardware provider's, so the crate's data path is
//! the one a real device runs. For tests and benchmarks on machines
//! without an RDMA NIC ([`Context::loopback`](super::Context::loopback)).
//!
//! # Model
//! - A send-queue request executes synchronously inside `ibv_post_send`:
//!   SEND takes the peer's oldest posted receive (of its shared receive
//!   queue, for a QP created on one), WRITE and READ copy between
//!   registered memory, and completions land on both sides' CQs before the
//!   call returns. A SEND (or WRITE_WITH_IMM) that finds no receive posted
//!   stalls the send queue, as RNR retries with `rnr_retry` 7 (forever)
//!   would: it and everything posted after it wait on the sender, and the
//!   peer's next `ibv_post_recv` (or `ibv_post_srq_recv` on its SRQ) runs
//!   them (on the peer's thread). `rnr_retry` below 7 is treated as 7.
//! - Copies reach only memory registered here ([`reg_mr`]): a process-wide
//!   table of keys checked for range, protection domain and access rights,
//!   read-locked for the whole copy; deregistration write-locks it, so no
//!   copy is running into memory once its registration is gone.
//! - A violation completes with `IBV_WC_LOC_PROT_ERR` (a local key),
//!   `IBV_WC_REM_ACCESS_ERR` (a remote key or missing QP access right) or,
//!   for a peer that is gone or in the error state, `IBV_WC_RETRY_EXC_ERR`,
//!   and moves the requester to the error state. A SEND larger than the
//!   receive completes `IBV_WC_LOC_LEN_ERR` at the receiver and
//!   `IBV_WC_REM_INV_REQ_ERR` at the sender, and both go to error.
//! - The error state (`ibv_modify_qp` to ERR, or destroying the QP, or a
//!   failed request) flushes the posted receives and the stalled sends with
//!   `IBV_WC_WR_FLUSH_ERR`, in order; requests posted later are flushed at
//!   once (or after the stalled ones, in order). A QP on an SRQ flushes
//!   none of the SRQ's receives: they stay posted for its other QPs, as on
//!   a NIC. After `ibv_modify_qp` the
//!   stalled sends are flushed when their send CQ is next polled, not
//!   during the call, as a device does its flushing after the call
//!   returns: until their flushed completions are polled they still use
//!   their memory. Unlike some hardware providers, destroying a QP flushes
//!   at once and leaves its completions in the CQs (as Soft-RoCE does).
//! - A receive list with a receive over memory that a stalled send of any
//!   QP still uses (reads, or for a READ writes) is refused whole with
//!   `EBUSY`: on a NIC the arriving message would overwrite bytes a request
//!   in flight has yet to read, silently. The check runs only while some
//!   send is stalled (which a sender that keeps to its credits never is).
//! - A CQ is a bounded ring of `ibv_wc` allocated at creation. A completion
//!   that does not fit is dropped, the QP it belonged to goes to the error
//!   state, and once the entries queued before it are polled every poll of
//!   that CQ returns `-EOVERFLOW` (`Error::CqPoll`: the CQ is dead, as
//!   after a hardware CQ overrun).
//! - Not supported (the verbs return `Error::Unsupported`): completion
//!   channels and `req_notify` (busy polling only), memory windows,
//!   atomics, and QP types other than RC. An SRQ has no limit event.
//!
//! # Locking
//! Each QP has a send-queue mutex (its stalled requests) and a receive-queue
//! mutex (its posted receives; its state changes to ERR under it); an SRQ
//! has one mutex for its receives. A poster holds its own send-queue lock
//! and takes the peer's receive-queue lock for a SEND, and inside it the
//! peer's SRQ lock if it has an SRQ; the MR table's read lock and the CQ
//! ring locks are taken last and held briefly. A post on an SRQ holds its
//! lock alone, and runs the send queues stalled on it after releasing it.
//! Send-queue locks are never taken while a receive-queue or SRQ lock is
//! held, and no thread holds two send-queue locks, so the order is
//! acyclic. A CQ's list of deferred flushes is locked under a send-queue
//! lock (by `ibv_modify_qp`) and alone (by the poll that runs them, before
//! it takes any send-queue lock); the QP registry is never held while a
//! send-queue lock is taken. The locks are uncontended when one thread
//! serves both ends: their cost (a few atomic operations per request) is
//! part of what a benchmark over this device measures, where a NIC would
//! charge a doorbell and DMA instead.

mod cq;
mod dma;
mod pd_mr;
mod qp;
mod registry;
mod request;
mod srq;

use std::os::raw::c_int;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crate::error::Error;
use crate::sys;

#[cfg(test)]
pub(crate) use cq::fail_next_polls;
pub(crate) use cq::{create_cq, destroy_cq};
use cq::{poll_cq, req_notify_cq};
pub(crate) use pd_mr::{alloc_pd, dealloc_pd, dereg_mr, reg_mr};
pub(crate) use qp::{create_qp, destroy_qp, modify_qp, query_qp_state};
use qp::{post_recv, post_send};
#[cfg(test)]
use registry::{is_mr_registered, is_qp_registered};
#[cfg(test)]
pub(crate) use registry::{
    refuse_sends_after, refuse_sends_after_silently, refuse_srq_recvs_after, reuse_qpn_next,
};
use srq::post_srq_recv;
#[cfg(test)]
pub(crate) use srq::posted_wr_ids as srq_posted_wr_ids;
pub(crate) use srq::{create_srq, destroy_srq};

/// The device name every loopback context reports.
pub(crate) const DEVICE_NAME: &str = "loopback";
/// The one port.
const PORT: u8 = 1;
/// Scatter/gather entries per request, send and receive.
const MAX_SGE: usize = 4;
/// Largest inline payload.
const MAX_INLINE: u32 = 1024;
/// Deepest send or receive queue.
const MAX_QP_WR: u32 = 1 << 15;
/// Deepest shared receive queue.
const MAX_SRQ_WR: u32 = 1 << 15;
/// Largest CQ.
const MAX_CQE: u32 = 1 << 22;
/// READ depths reported (nothing limits them here).
const MAX_RD_ATOM: u8 = 16;

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // Nothing here panics while holding a lock; if something did, the data
    // is still consistent enough to keep serving (and never unsound).
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

// ---------------------------------------------------------------------------
// Device, port and GID attributes.

/// Allocates a loopback device context whose ops table holds this module's
/// data-path functions. Free it with [`close_context`].
pub(crate) fn open_context() -> NonNull<sys::ibv_context> {
    let mut ctx = Box::<sys::ibv_context>::default();
    ctx.ops.post_send = Some(post_send);
    ctx.ops.post_recv = Some(post_recv);
    ctx.ops.post_srq_recv = Some(post_srq_recv);
    ctx.ops.poll_cq = Some(poll_cq);
    ctx.ops.req_notify_cq = Some(req_notify_cq);
    ctx.cmd_fd = -1;
    ctx.async_fd = -1;
    ctx.num_comp_vectors = 1;
    NonNull::from(Box::leak(ctx))
}

/// Frees a context from [`open_context`].
///
/// # Safety
/// `ctx` came from [`open_context`], is freed once, and no object created
/// on it (PD, CQ, QP, MR) is alive.
pub(crate) unsafe fn close_context(ctx: NonNull<sys::ibv_context>) {
    // SAFETY: allocated as a Box in open_context; the caller vouches that
    // this is the only release and nothing points at it any more.
    drop(unsafe { Box::from_raw(ctx.as_ptr()) });
}

/// What `ibv_query_device` reports.
pub(crate) fn device_attr() -> sys::ibv_device_attr {
    sys::ibv_device_attr {
        phys_port_cnt: PORT,
        max_qp_wr: MAX_QP_WR as c_int,
        max_sge: MAX_SGE as c_int,
        max_cqe: MAX_CQE as c_int,
        max_mr_size: u64::MAX,
        max_qp_rd_atom: c_int::from(MAX_RD_ATOM),
        max_qp_init_rd_atom: c_int::from(MAX_RD_ATOM),
        max_mw: 0,
        max_srq: c_int::MAX,
        max_srq_wr: MAX_SRQ_WR as c_int,
        max_srq_sge: MAX_SGE as c_int,
        device_cap_flags: 0,
        ..Default::default()
    }
}

/// What `ibv_query_port` reports: port 1 ACTIVE, Ethernet, MTU 4096, one GID.
pub(crate) fn port_attr(port: u8) -> Result<sys::ibv_port_attr, c_int> {
    if port != PORT {
        return Err(libc::EINVAL);
    }
    Ok(sys::ibv_port_attr {
        state: sys::IBV_PORT_ACTIVE,
        max_mtu: sys::IBV_MTU_4096,
        active_mtu: sys::IBV_MTU_4096,
        gid_tbl_len: 1,
        max_msg_sz: 1 << 31,
        link_layer: sys::IBV_LINK_LAYER_ETHERNET as u8,
        lid: 0,
        ..Default::default()
    })
}

/// The GID table of `port`: index 0 is `::ffff:127.0.0.1`, RoCE v2.
pub(crate) fn gid_table(port: u8) -> Vec<sys::ibv_gid_entry> {
    if port != PORT {
        return Vec::new();
    }
    let mut raw = [0u8; 16];
    raw[10] = 0xff;
    raw[11] = 0xff;
    raw[12..].copy_from_slice(&[127, 0, 0, 1]);
    let mut entry = sys::ibv_gid_entry {
        gid_index: 0,
        port_num: u32::from(PORT),
        gid_type: sys::IBV_GID_TYPE_ROCE_V2,
        ..Default::default()
    };
    entry.gid.raw = raw;
    vec![entry]
}

/// The error of a verb this device refuses (see "Not supported" in the
/// module docs): one place that names the verb and the device for every
/// refusal.
pub(crate) fn unsupported(verb: &'static str, device: &Arc<str>) -> Error {
    Error::Unsupported {
        verb,
        device: Arc::clone(device),
    }
}

#[cfg(test)]
mod tests;
