//! Protection domains and memory regions: the verbs objects a loopback
//! context hands out for them, and registration into the MR table that
//! every copy is checked against.

use std::os::raw::c_int;
use std::ptr::NonNull;
use std::sync::PoisonError;
use std::sync::atomic::Ordering;

use crate::sys;

use super::registry::{MRS, MrEntry, NEXT_KEY, next_handle};

/// Allocates a PD on a loopback context. Free it with [`dealloc_pd`].
pub(crate) fn alloc_pd(ctx: NonNull<sys::ibv_context>) -> NonNull<sys::ibv_pd> {
    let pd = Box::new(sys::ibv_pd {
        context: ctx.as_ptr(),
        handle: next_handle(),
    });
    NonNull::from(Box::leak(pd))
}

/// Frees a PD from [`alloc_pd`].
///
/// # Safety
/// `pd` came from [`alloc_pd`], is freed once, and no MR or QP of it is alive.
pub(crate) unsafe fn dealloc_pd(pd: NonNull<sys::ibv_pd>) {
    // SAFETY: a Box from alloc_pd, released once (the caller's promise).
    drop(unsafe { Box::from_raw(pd.as_ptr()) });
}

/// Registers `addr..addr+len` with `access` (`IBV_ACCESS_*` bits) in `pd`.
///
/// # Safety
/// `pd` is a live PD from [`alloc_pd`], and `addr..addr+len` stays valid
/// for reads and writes until [`dereg_mr`] of the returned MR returns.
pub(crate) unsafe fn reg_mr(
    pd: NonNull<sys::ibv_pd>,
    addr: *mut u8,
    len: usize,
    access: u32,
) -> Result<NonNull<sys::ibv_mr>, c_int> {
    if len == 0 || (addr as u64).checked_add(len as u64).is_none() {
        return Err(libc::EINVAL);
    }
    // SAFETY: the caller vouches that the PD is live.
    let (context, pd_handle) = unsafe { ((*pd.as_ptr()).context, (*pd.as_ptr()).handle) };
    let mut mrs = MRS.write().unwrap_or_else(PoisonError::into_inner);
    let key = loop {
        let key = NEXT_KEY.fetch_add(1, Ordering::Relaxed);
        if key != 0 && !mrs.contains_key(&key) {
            break key;
        }
    };
    mrs.insert(
        key,
        MrEntry {
            addr: addr as u64,
            len: len as u64,
            access,
            pd: pd_handle,
        },
    );
    drop(mrs);
    let mr = Box::new(sys::ibv_mr {
        context,
        pd: pd.as_ptr(),
        addr: addr.cast(),
        length: len,
        handle: key,
        lkey: key,
        rkey: key,
    });
    Ok(NonNull::from(Box::leak(mr)))
}

/// Deregisters an MR from [`reg_mr`]: once this returns, no copy reaches
/// its memory.
///
/// # Safety
/// `mr` came from [`reg_mr`] and is deregistered once.
pub(crate) unsafe fn dereg_mr(mr: NonNull<sys::ibv_mr>) {
    // SAFETY: a Box from reg_mr, released once (the caller's promise).
    let mr = unsafe { Box::from_raw(mr.as_ptr()) };
    // The write lock waits for every copy in progress (they hold the read
    // lock) and keeps later ones from finding the key.
    MRS.write()
        .unwrap_or_else(PoisonError::into_inner)
        .remove(&mr.lkey);
}
