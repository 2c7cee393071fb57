//! Completion queues: a bounded ring of `ibv_wc` per CQ, allocated at
//! creation, and the ops-table entries that poll it (`poll_cq`) or refuse
//! to arm it (`req_notify_cq`).

use std::collections::VecDeque;
use std::os::raw::c_int;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};

use crate::sys;

use super::qp::LbQp;
use super::registry::next_handle;
use super::{MAX_CQE, lock};

/// A CQ's completions: a ring allocated at creation.
pub(super) struct CqRing {
    state: Mutex<RingState>,
    /// QPs moved to the error state whose outstanding sends this CQ has
    /// yet to see flushed: a device flushes its send queue after
    /// `ibv_modify_qp` returns, so a program that reuses their memory
    /// before it polls their flushed completions is caught (see
    /// `LbQp::enter_error`). Flushed at the start of the next poll.
    deferred: Mutex<Vec<Weak<LbQp>>>,
    has_deferred: AtomicBool,
}

struct RingState {
    wcs: VecDeque<sys::ibv_wc>,
    capacity: usize,
    /// A completion was dropped: the CQ is dead once drained.
    overflowed: bool,
}

impl CqRing {
    /// Queues `wc`; false (and the completion dropped) when the ring is full.
    pub(super) fn push(&self, wc: sys::ibv_wc) -> bool {
        let mut ring = lock(&self.state);
        if ring.overflowed || ring.wcs.len() >= ring.capacity {
            ring.overflowed = true;
            return false;
        }
        // Never reallocates: the deque was allocated with `capacity`.
        ring.wcs.push_back(wc);
        true
    }

    /// Flushes `qp`'s outstanding sends at this CQ's next poll.
    pub(super) fn defer_flush(&self, qp: Weak<LbQp>) {
        lock(&self.deferred).push(qp);
        self.has_deferred.store(true, Ordering::Release);
    }

    /// Runs the flushes `defer_flush` queued (no lock of this CQ held:
    /// each pushes its completions here).
    #[cold]
    fn run_deferred(&self) {
        // Cleared first: a flush deferred while these run sets it again.
        self.has_deferred.store(false, Ordering::Release);
        let due = std::mem::take(&mut *lock(&self.deferred));
        for qp in due.iter().filter_map(Weak::upgrade) {
            qp.flush_stalled();
        }
    }

    /// Moves up to `max` completions to `out`.
    ///
    /// # Safety
    /// `out` is valid for writing `max` entries.
    unsafe fn poll(&self, max: usize, out: *mut sys::ibv_wc) -> c_int {
        if self.has_deferred.load(Ordering::Acquire) {
            self.run_deferred();
        }
        let mut ring = lock(&self.state);
        let n = max.min(ring.wcs.len()).min(c_int::MAX as usize);
        for i in 0..n {
            let Some(wc) = ring.wcs.pop_front() else {
                break;
            };
            // SAFETY: i < n <= max, and `out` has room for `max` (the caller).
            unsafe { out.add(i).write(wc) };
        }
        if n == 0 && ring.overflowed {
            return -libc::EOVERFLOW;
        }
        n as c_int
    }
}

/// A loopback CQ: the verbs struct the crate holds, then the ring.
#[repr(C)]
struct CqObj {
    /// First, so an `*mut ibv_cq` of ours is an `*mut CqObj`.
    cq: sys::ibv_cq,
    ring: Arc<CqRing>,
}

/// Creates a CQ of exactly `cqe` entries on a loopback context. Destroy it
/// with [`destroy_cq`].
pub(crate) fn create_cq(
    ctx: NonNull<sys::ibv_context>,
    cqe: u32,
) -> Result<NonNull<sys::ibv_cq>, c_int> {
    if cqe == 0 || cqe > MAX_CQE {
        return Err(libc::EINVAL);
    }
    let capacity = cqe as usize;
    let obj = Box::new(CqObj {
        cq: sys::ibv_cq {
            context: ctx.as_ptr(),
            handle: next_handle(),
            cqe: cqe as c_int,
            ..Default::default()
        },
        ring: Arc::new(CqRing {
            state: Mutex::new(RingState {
                wcs: VecDeque::with_capacity(capacity),
                capacity,
                overflowed: false,
            }),
            deferred: Mutex::new(Vec::new()),
            has_deferred: AtomicBool::new(false),
        }),
    });
    Ok(NonNull::from(Box::leak(obj)).cast())
}

/// Destroys a CQ from [`create_cq`]. Completions QPs still push (none can:
/// they hold the CQ) would go to the detached ring.
///
/// # Safety
/// `cq` came from [`create_cq`], is destroyed once, and no QP uses it.
pub(crate) unsafe fn destroy_cq(cq: NonNull<sys::ibv_cq>) {
    // SAFETY: a Box<CqObj> from create_cq, released once.
    drop(unsafe { Box::from_raw(cq.as_ptr().cast::<CqObj>()) });
}

/// The ring of a loopback CQ.
///
/// # Safety
/// `cq` is a live CQ from [`create_cq`], alive for `'a`.
pub(super) unsafe fn ring_of<'a>(cq: *mut sys::ibv_cq) -> &'a Arc<CqRing> {
    // SAFETY: our CQs are CqObjs with the ibv_cq first (repr(C)); only
    // the `ring` field is borrowed, which nobody writes after creation.
    unsafe { &(*cq.cast::<CqObj>()).ring }
}

#[cfg(test)]
thread_local! {
    /// Test-only fault: how many of this thread's next CQ polls fail.
    static FAILING_POLLS: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Makes this thread's next `count` polls of any loopback CQ fail with
/// `EIO`, as a provider's poll that fails does, leaving what they would
/// have found queued (tests of a failed poll). Per thread, so tests that
/// run alongside are not hit.
#[cfg(test)]
pub(crate) fn fail_next_polls(count: u32) {
    FAILING_POLLS.set(count);
}

pub(super) unsafe extern "C" fn poll_cq(
    cq: *mut sys::ibv_cq,
    num: c_int,
    wc: *mut sys::ibv_wc,
) -> c_int {
    #[cfg(test)]
    if let Some(left) = FAILING_POLLS.get().checked_sub(1) {
        FAILING_POLLS.set(left);
        return -libc::EIO;
    }
    // SAFETY: libibverbs' contract: `cq` is a live CQ of this context (one
    // of ours) and `wc` has room for `num` entries.
    unsafe { ring_of(cq).poll(num.max(0) as usize, wc) }
}

pub(super) unsafe extern "C" fn req_notify_cq(_cq: *mut sys::ibv_cq, _solicited: c_int) -> c_int {
    // Busy polling only: no completion channels on this device.
    libc::EOPNOTSUPP
}
