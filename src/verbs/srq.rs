//! Shared receive queues: one pool of posted receives that many QPs draw on,
//! so memory for receives grows with traffic, not with the number of peers.

use std::fmt;
use std::os::raw::c_int;
use std::ptr::NonNull;
use std::sync::{Arc, OnceLock};

use crate::error::{Error, Result};
use crate::sys;

use super::mr::Registration;
use super::pd::{PdInner, ProtectionDomain};
use super::requests::{self, RecvRequests, sealed::Seal};
use super::{check_ptr, check_rc, loopback};

type PostSrqRecvFn = unsafe extern "C" fn(
    *mut sys::ibv_srq,
    *mut sys::ibv_recv_wr,
    *mut *mut sys::ibv_recv_wr,
) -> c_int;

pub(crate) struct SrqInner {
    pub(crate) srq: NonNull<sys::ibv_srq>,
    post_recv_fn: PostSrqRecvFn,
    max_wr: u32,
    /// Memory the owner's receives point into, kept registered and mapped
    /// until the SRQ is destroyed, however long an attached QP keeps it
    /// (dropped after the SRQ, like the PD).
    kept: OnceLock<Registration>,
    // Dropped after the SRQ is destroyed: the PD outlives it.
    pub(crate) pd: Arc<PdInner>,
}

// SAFETY: libibverbs SRQs may be used from any thread (posting is serialised
// by the provider); the handle is freed only in Drop, after every QP using it
// (each holds an Arc) is gone.
unsafe impl Send for SrqInner {}
// SAFETY: see Send.
unsafe impl Sync for SrqInner {}

impl Drop for SrqInner {
    fn drop(&mut self) {
        // SAFETY: created by ibv_create_srq (or loopback::create_srq, on a
        // loopback context) and destroyed once, after the QPs attached to it
        // (they hold this Arc) and before the PD (held below).
        let rc = unsafe { destroy_srq(&self.pd, self.srq) };
        if let Err(err) = check_rc(rc, "ibv_destroy_srq", &self.pd.ctx.name, None) {
            log::error!("{err}");
        }
    }
}

/// Destroys an SRQ with the verb of its context's provider.
///
/// # Safety
/// `srq` is a live SRQ created in `pd` and is destroyed once; nothing uses
/// it afterwards.
unsafe fn destroy_srq(pd: &PdInner, srq: NonNull<sys::ibv_srq>) -> c_int {
    if pd.ctx.is_loopback() {
        // SAFETY: from loopback::create_srq (the PD's context is a loopback
        // one), destroyed once (the caller).
        unsafe { loopback::destroy_srq(srq) };
        0
    } else {
        // SAFETY: from ibv_create_srq, destroyed once (the caller).
        unsafe { sys::ibv_destroy_srq(srq.as_ptr()) }
    }
}

/// A shared receive queue: the one handle that may post receives on it.
///
/// Not `Clone`: whoever owns it decides what the SRQ's receives point at,
/// so a completion that names one of them really is one of its own. QPs
/// attach through an [`SrqAttachment`], which keeps the SRQ alive but
/// cannot post.
///
/// ```no_run
/// use rdma_comm_core::verbs::*;
/// let ctx = Context::open_default(None)?;
/// let pd = ctx.alloc_pd()?;
/// let cq = ctx.create_cq(1024, None)?;
/// let srq = pd.create_srq(512)?;
/// let qp = pd.create_qp_with_srq(&cq, &cq, &srq.attachment(), &QpConfig::default())?;
/// # let _ = qp;
/// # Ok::<(), rdma_comm_core::Error>(())
/// ```
pub struct SharedReceiveQueue {
    pub(crate) inner: Arc<SrqInner>,
}

/// A handle that attaches QPs to a [`SharedReceiveQueue`] and keeps it alive,
/// without the right to post receives on it.
#[derive(Clone)]
pub struct SrqAttachment {
    pub(crate) inner: Arc<SrqInner>,
}

impl fmt::Debug for SrqAttachment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SrqAttachment")
            .field("device", &self.inner.pd.ctx.name)
            .field("max_wr", &self.inner.max_wr)
            .finish()
    }
}

impl SrqAttachment {
    /// Receives the SRQ can hold.
    pub fn max_wr(&self) -> u32 {
        self.inner.max_wr
    }

    /// True if both handles are the same SRQ.
    pub fn same_as(&self, other: &SrqAttachment) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

impl fmt::Debug for SharedReceiveQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedReceiveQueue")
            .field("device", &self.inner.pd.ctx.name)
            .field("max_wr", &self.inner.max_wr)
            .finish()
    }
}

impl ProtectionDomain {
    /// Creates a shared receive queue holding up to `max_wr` receives (one
    /// scatter/gather entry each).
    pub fn create_srq(&self, max_wr: u32) -> Result<SharedReceiveQueue> {
        let name = &self.inner.ctx.name;
        let mut init = sys::ibv_srq_init_attr {
            attr: sys::ibv_srq_attr {
                max_wr,
                max_sge: 1,
                srq_limit: 0,
            },
            ..Default::default()
        };
        let srq = if self.inner.ctx.is_loopback() {
            // SAFETY: a loopback PD, live (held through self); init is fully
            // initialised and the device writes back the granted sizes.
            unsafe { loopback::create_srq(self.inner.pd, &mut init) }
                .map_err(|errno| crate::error::verbs_error("ibv_create_srq", errno, name, None))?
        } else {
            // SAFETY: the PD is live (held through self); init is fully
            // initialised and the provider writes back the granted sizes.
            let raw = unsafe { sys::ibv_create_srq(self.inner.pd.as_ptr(), &mut init) };
            check_ptr(raw, "ibv_create_srq", name)?
        };
        // SAFETY: the SRQ is live; its context's ops table never changes.
        let post = unsafe { (*(*srq.as_ptr()).context).ops.post_srq_recv };
        let Some(post_recv_fn) = post else {
            // SAFETY: live and not yet owned by an SrqInner.
            unsafe { destroy_srq(&self.inner, srq) };
            return Err(Error::Unsupported {
                verb: "ibv_post_srq_recv",
                device: Arc::clone(name),
            });
        };
        Ok(SharedReceiveQueue {
            inner: Arc::new(SrqInner {
                srq,
                post_recv_fn,
                max_wr: init.attr.max_wr.max(max_wr),
                kept: OnceLock::new(),
                pd: Arc::clone(&self.inner),
            }),
        })
    }
}

impl SharedReceiveQueue {
    /// Keeps `registration` (the memory this SRQ's receives point into)
    /// until the SRQ is destroyed, after every QP attached to it: receives
    /// posted there never outlive their memory. Once per SRQ; false if it
    /// keeps one already.
    pub(crate) fn keep_registered(&self, registration: Registration) -> bool {
        self.inner.kept.set(registration).is_ok()
    }

    /// Receives the SRQ can hold.
    pub fn max_wr(&self) -> u32 {
        self.inner.max_wr
    }

    /// A handle to attach QPs with.
    pub fn attachment(&self) -> SrqAttachment {
        SrqAttachment {
            inner: Arc::clone(&self.inner),
        }
    }

    /// Posts `requests` (a [`RecvRequest`], a [`RecvBatch`], or either
    /// [`Kept`]) with one `ibv_post_srq_recv` and leaves them with the
    /// caller, as [`QueuePair::post_recv`] does: on [`Error::Post`] the
    /// error says how many of the first requests went in
    /// ([`Batch::drop_posted`] drops them).
    ///
    /// [`RecvRequest`]: super::RecvRequest
    /// [`RecvBatch`]: super::RecvBatch
    /// [`Kept`]: super::Kept
    /// [`QueuePair::post_recv`]: super::QueuePair::post_recv
    /// [`Batch::drop_posted`]: super::Batch::drop_posted
    #[inline]
    pub fn post_recv<R: RecvRequests>(&mut self, requests: &mut R) -> Result<()> {
        let requests = requests.requests_mut(Seal::new());
        if requests.is_empty() {
            return Ok(());
        }
        let len = requests.len();
        let head = requests::link(requests);
        let mut bad: *mut sys::ibv_recv_wr = std::ptr::null_mut();
        // SAFETY: the SRQ is live; `head` is a NULL-terminated list of
        // `len` requests inside `requests`, untouched until the call
        // returns, whose buffers are registered (a `RecvRequest` borrows
        // its memory, a `Kept` holds it, and the reactor's rings, built
        // by the unsafe `RecvRequest::from_raw`, are kept by their
        // owners).
        let rc = unsafe { (self.inner.post_recv_fn)(self.inner.srq.as_ptr(), head, &mut bad) };
        if rc == 0 {
            return Ok(());
        }
        // SAFETY: the list just posted, still inside `requests`.
        let posted = unsafe { super::list::count_before(head, bad, len) };
        Err(Error::Post {
            verb: "ibv_post_srq_recv",
            errno: rc.abs(),
            device: Arc::clone(&self.inner.pd.ctx.name),
            qpn: 0,
            posted,
        })
    }

    /// True if `attachment` attaches QPs to this SRQ.
    pub fn is_attached_by(&self, attachment: &SrqAttachment) -> bool {
        Arc::ptr_eq(&self.inner, &attachment.inner)
    }
}

/// Makes a `post_recv` on `srq` (of a loopback context) accept only
/// its first `accepted` receives and refuse the rest with `ENOMEM` (tests
/// of a partial post): the next one not limited already, so that calls in
/// a row limit posts in a row.
#[cfg(test)]
pub(crate) fn refuse_srq_recvs_after(srq: &SharedReceiveQueue, accepted: usize) {
    // SAFETY: the SRQ is live while `srq` holds it, and its handle is
    // written only at creation.
    let handle = unsafe { (*srq.inner.srq.as_ptr()).handle };
    loopback::refuse_srq_recvs_after(handle, accepted);
}

/// The `wr_id`s of the receives posted on `srq` (of a loopback context)
/// now, oldest first: what the device holds, for tests of who posts what.
/// Empty for an SRQ of another device.
#[cfg(test)]
pub(crate) fn srq_posted_wr_ids(srq: &SharedReceiveQueue) -> Vec<u64> {
    if !srq.inner.pd.ctx.is_loopback() {
        return Vec::new();
    }
    // SAFETY: a loopback SRQ (its context is a loopback one), live while
    // `srq` holds it.
    unsafe { loopback::srq_posted_wr_ids(srq.inner.srq) }
}
