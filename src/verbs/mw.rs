//! Type-2 memory windows: remote access to registered memory, granted to
//! the one QP (so the one peer) a window is bound to.
//!
//! A process's QPs and regions usually share one protection domain, and an
//! MR's own rkey works on every QP of that domain: a peer that learns the
//! descriptor of a region exported to another peer can use it too. A type-2
//! window is bound by a work request on one QP, and its rkey works only for
//! requests that arrive on that QP. So: register the memory with
//! [`AccessFlags::MW_BIND`] and no `REMOTE_*` flag (then its own rkey
//! reaches nothing), bind one window per peer on the QP that serves that
//! peer ([`QueuePair::bind_window`]), and hand each peer its own window's
//! descriptor ([`BoundWindow::remote`]).
//!
//! Windows are bound zero-based (`IBV_ACCESS_ZERO_BASED`): the peer
//! addresses its window from 0 to its length, and the device adds where the
//! memory starts. So a window's descriptor carries address 0, and no
//! virtual address of ours reaches a peer.
//!
//! Lifecycle: [`ProtectionDomain::alloc_mw`] gives an unbound
//! [`MemoryWindow`]; binding consumes it and gives a [`BoundWindow`], which
//! keeps the bound memory's [`Registration`] (so the memory stays
//! registered and mapped while a peer may reach it). The window is
//! deallocated when the `BoundWindow` or the QP it is bound on is dropped,
//! whichever comes first: from then on the peer's key reaches nothing. So
//! access is revoked when a peer goes, whether its window or its QP goes
//! first. (The QP deallocates its windows before it is destroyed: rxe's
//! `ibv_destroy_qp` blocks for about 50 s, with a kernel warning, while a
//! type-2 window is still bound to the QP.) A type-2 window is bound once
//! (the types say so); to grant access again, bind a new one.

use std::fmt;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, PoisonError};

use crate::error::{Error, Result};
use crate::sys;

use super::mr::{AccessFlags, Registration, RemoteRegion};
use super::pd::{PdInner, ProtectionDomain};
use super::qp::{QpState, QueuePair};
use super::wr::SendFlags;
use super::{check_ptr, check_rc, loopback};

/// The `wr_id` of every bind request: its completion (opcode
/// [`WcOpcode::BIND_MW`](super::WcOpcode::BIND_MW) when signaled and
/// successful, or any failure) carries it. No id the reactor gives its own
/// requests has this value, so it recognises the binds of a QP it serves.
pub const BIND_WR_ID: u64 = 0x4249_4e44_0000_0000; // "BIND"

/// The verb a bind refused when it is posted names in its
/// [`Error::Post`] (a provider without zero-based type-2 windows refuses
/// there): nothing falls back to a window at our virtual address.
pub(super) const ZERO_BASED_BIND: &str = "ibv_post_send(IBV_WR_BIND_MW, IBV_ACCESS_ZERO_BASED)";

/// The verbs window and the memory it may be bound to.
struct WindowHandle {
    mw: NonNull<sys::ibv_mw>,
    /// Kept while the window is bound: the peer may reach this memory until
    /// the window is deallocated (and rxe refuses to deregister an MR with
    /// windows bound to it).
    keep: Option<Registration>,
    // Dropped after the window is deallocated.
    pd: Arc<PdInner>,
}

// SAFETY: windows may be deallocated from any thread in libibverbs; the
// handle's fields are not mutated behind `&self`.
unsafe impl Send for WindowHandle {}
// SAFETY: as for Send: nothing behind `&self` is mutated.
unsafe impl Sync for WindowHandle {}

impl Drop for WindowHandle {
    fn drop(&mut self) {
        // SAFETY: the window came from ibv_alloc_mw and is deallocated once,
        // before the PD (held by a field).
        let rc = unsafe { sys::ibv_dealloc_mw(self.mw.as_ptr()) };
        if let Err(err) = check_rc(rc, "ibv_dealloc_mw", &self.pd.ctx.name, None) {
            // The window may still be bound: a peer may still reach the
            // memory, so it must stay registered and mapped for good.
            log::error!("{err}; leaking the memory the window is bound to");
            std::mem::forget(self.keep.take());
        }
    }
}

impl MemoryWindow {
    /// The rkey the peer will use once this window is bound: known before
    /// the bind (the consumer picks the key byte), so it can be announced
    /// while the QP is still being connected.
    pub fn rkey_when_bound(&self) -> u32 {
        // SAFETY: a pure function of its argument (a static inline of the
        // header, through the shim).
        unsafe { sys::ibv_inc_rkey(self.handle.rkey()) }
    }
}

impl WindowHandle {
    fn rkey(&self) -> u32 {
        // SAFETY: the window is allocated for as long as `self` lives.
        unsafe { self.mw.as_ref().rkey }
    }
}

/// A bound window, shared by its [`BoundWindow`] and (weakly) the QP it is
/// bound on: the first of them to go deallocates it.
pub(super) struct WindowSlot {
    handle: Mutex<Option<WindowHandle>>,
}

impl WindowSlot {
    /// Deallocates the window now, unless that happened already.
    pub(super) fn revoke(&self) {
        let handle = self
            .handle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        drop(handle);
    }

    fn is_revoked(&self) -> bool {
        self.handle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_none()
    }
}

/// A type-2 memory window, not bound yet: remote access to registered
/// memory that, once bound on a QP, only requests arriving on that QP can
/// use.
///
/// A PD's QPs share its regions, and an MR's own rkey works on every QP of
/// the PD: a peer that learns the descriptor of memory exported to another
/// peer can use it too. Register the memory with [`AccessFlags::MW_BIND`]
/// and no `REMOTE_*` flag instead, bind one window per peer on the QP that
/// serves that peer ([`QueuePair::bind_window`]), and give each peer its
/// own window's descriptor ([`BoundWindow::remote`]). Binding consumes the
/// window (a type-2 window is bound once); dropping an unbound window
/// deallocates it.
pub struct MemoryWindow {
    handle: WindowHandle,
}

impl fmt::Debug for MemoryWindow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryWindow")
            .field("device", &self.handle.pd.ctx.name)
            .field("rkey", &self.handle.rkey())
            .finish()
    }
}

impl ProtectionDomain {
    /// Allocates a type-2 memory window in this PD.
    ///
    /// # Errors
    /// [`Error::Unsupported`] when the device has no type-2 windows (see
    /// [`DeviceAttr::mem_window_type2`](super::DeviceAttr::mem_window_type2)),
    /// [`Error::Verbs`] when it has no more.
    pub fn alloc_mw(&self) -> Result<MemoryWindow> {
        if self.inner.ctx.is_loopback() {
            return Err(loopback::unsupported("ibv_alloc_mw", &self.inner.ctx.name));
        }
        // SAFETY: the PD is live (we hold it from here on); the window is
        // deallocated in WindowHandle::drop.
        let raw = unsafe { sys::ibv_alloc_mw(self.inner.pd.as_ptr(), sys::IBV_MW_TYPE_2) };
        let mw = check_ptr(raw, "ibv_alloc_mw", &self.inner.ctx.name)?;
        Ok(MemoryWindow {
            handle: WindowHandle {
                mw,
                keep: None,
                pd: Arc::clone(&self.inner),
            },
        })
    }
}

/// A memory window bound to a registration on one QP: what one peer may
/// reach, and how ([`remote`](Self::remote) is the descriptor to send it).
///
/// Keeps the registration (the memory stays registered and mapped) until
/// it is dropped; dropping it deallocates the window, after which the
/// peer's key reaches nothing.
#[must_use = "dropping a bound window revokes the access it grants"]
pub struct BoundWindow {
    slot: Arc<WindowSlot>,
    registration: Registration,
    remote: RemoteRegion,
    qpn: u32,
    access: AccessFlags,
}

impl fmt::Debug for BoundWindow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BoundWindow")
            .field("remote", &self.remote)
            .field("qpn", &self.qpn)
            .field("access", &self.access)
            .field("revoked", &self.is_revoked())
            .finish()
    }
}

impl BoundWindow {
    /// The descriptor to give the peer: address 0 (the window is
    /// zero-based: the peer addresses offsets into it), the memory's
    /// length, and the window's rkey (valid only on the QP it was bound
    /// on).
    pub fn remote(&self) -> RemoteRegion {
        self.remote
    }

    /// The window's rkey.
    pub fn rkey(&self) -> u32 {
        self.remote.rkey()
    }

    /// The QP number the window was bound on: only requests arriving on
    /// that QP can use it.
    pub fn qpn(&self) -> u32 {
        self.qpn
    }

    /// The rights the window grants.
    pub fn access(&self) -> AccessFlags {
        self.access
    }

    /// The memory the window is bound to (kept registered while the window
    /// lives).
    pub fn registration(&self) -> &Registration {
        &self.registration
    }

    /// True once the window was deallocated because its QP was dropped:
    /// the peer's key reaches nothing any more.
    pub fn is_revoked(&self) -> bool {
        self.slot.is_revoked()
    }
}

/// The rights a window can grant.
const WINDOW_RIGHTS: AccessFlags = AccessFlags::REMOTE_WRITE
    .union(AccessFlags::REMOTE_READ)
    .union(AccessFlags::REMOTE_ATOMIC);

impl QueuePair {
    /// Binds `window` to all of `region` on this QP, granting `access`
    /// (`REMOTE_WRITE`, `REMOTE_READ` and/or `REMOTE_ATOMIC`) to requests
    /// that arrive on this QP and to no other. Returns the bound window,
    /// whose [`remote`](BoundWindow::remote) descriptor goes to the peer.
    /// The window lasts until the `BoundWindow` or this QP is dropped.
    ///
    /// The QP must be in RTS, and the QP also needs the rights in its own
    /// [`remote_access`](super::QpConfig::remote_access). `region` must be
    /// registered in the QP's and the window's PD with
    /// [`AccessFlags::MW_BIND`] (and `LOCAL_WRITE` for a window granting
    /// `REMOTE_WRITE` or `REMOTE_ATOMIC`). The window covers the whole
    /// registration: Soft-RoCE checks accesses through a window against the
    /// bounds of the MR, not of the window, so a window on part of a region
    /// would grant all of it there. Register each exported range on its own.
    ///
    /// The window is zero-based: the peer's remote address is an offset
    /// into it (0 up to the region's length), and the descriptor carries
    /// address 0, never where the memory is in this process.
    ///
    /// # Signaled or not
    /// `flags` may hold [`SendFlags::SIGNALED`] and [`SendFlags::FENCE`].
    /// The request's `wr_id` is [`BIND_WR_ID`]. A failed bind always
    /// completes (`IBV_WC_MW_BIND_ERR`) and moves the QP to the error
    /// state. An unsignaled bind occupies a send-queue entry until a later
    /// signaled request of this QP completes, and a bind executes in order
    /// with the QP's other send-queue requests: the peer's first access is
    /// safe once the bind's completion, or any later send completion of
    /// this QP, was seen. A peer that uses the key before the bind executed
    /// gets a remote access error.
    ///
    /// Binds do not count as posts for [`has_posted`](Self::has_posted)
    /// but for [`bound_windows`](Self::bound_windows): a
    /// [`Reactor`](crate::reactor::Reactor) takes a QP with binds posted,
    /// gives them their send-queue entries and fails the connection if one
    /// of them fails.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for anything above that is not so (the
    /// window is dropped then); [`Error::Post`] (its verb
    /// `ibv_post_send(IBV_WR_BIND_MW, IBV_ACCESS_ZERO_BASED)`) when the
    /// send queue is full or the provider refuses the request, a device
    /// without zero-based windows among them. A device that takes the
    /// request and then refuses the bind fails it like any bind: its
    /// completion carries an error and the QP goes to the error state.
    pub fn bind_window(
        &mut self,
        window: MemoryWindow,
        region: &Registration,
        access: AccessFlags,
        flags: SendFlags,
    ) -> Result<BoundWindow> {
        if access.is_empty() || !WINDOW_RIGHTS.contains(access) {
            return Err(Error::InvalidArgument(
                "a window grants REMOTE_WRITE, REMOTE_READ and/or REMOTE_ATOMIC, and nothing else",
            ));
        }
        if !(SendFlags::SIGNALED | SendFlags::FENCE).contains(flags) {
            return Err(Error::InvalidArgument(
                "a bind request takes only the SIGNALED and FENCE flags",
            ));
        }
        if !region.access().contains(AccessFlags::MW_BIND) {
            return Err(Error::InvalidArgument(
                "windows bind only to memory registered with AccessFlags::MW_BIND",
            ));
        }
        if access.intersects(AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC)
            && !region.access().contains(AccessFlags::LOCAL_WRITE)
        {
            return Err(Error::InvalidArgument(
                "a window granting REMOTE_WRITE or REMOTE_ATOMIC needs memory registered with LOCAL_WRITE",
            ));
        }
        let pd = self.pd_inner();
        if !Arc::ptr_eq(&window.handle.pd, pd) || !region.in_pd(pd) {
            return Err(Error::InvalidArgument(
                "the window, the memory and the QP must belong to the same protection domain",
            ));
        }
        if self.state()? != QpState::ReadyToSend {
            return Err(Error::InvalidArgument(
                "windows are bound on a QP in RTS (connect it first)",
            ));
        }
        let rkey = window.rkey_when_bound();
        let mut handle = window.handle;
        let mut wr = sys::ibv_send_wr {
            wr_id: BIND_WR_ID,
            opcode: sys::IBV_WR_BIND_MW,
            send_flags: flags.bits(),
            num_sge: 0,
            ..Default::default()
        };
        wr.__bindgen_anon_2.bind_mw = sys::ibv_send_wr__bindgen_ty_4__bindgen_ty_1 {
            mw: handle.mw.as_ptr(),
            rkey,
            bind_info: sys::ibv_mw_bind_info {
                mr: region.mr_ptr(),
                addr: region.addr(),
                length: region.len() as u64,
                mw_access_flags: access.bits() | sys::IBV_ACCESS_ZERO_BASED,
            },
        };
        // Kept before posting: from the post on, the device may bind.
        handle.keep = Some(region.clone());
        let slot = Arc::new(WindowSlot {
            handle: Mutex::new(Some(handle)),
        });
        // SAFETY: one request, NULL-terminated, alive for the call; the
        // window and the MR it names are live (the provider takes their
        // handles). The memory stays registered for as long as the window
        // is allocated. If the window is revoked (deallocated) before a
        // queued bind runs, the bind names a window and an MR handle that
        // may be gone: the device re-checks both keys when it executes the
        // bind and fails it (the QP goes to error); nothing is bound to
        // unregistered memory.
        unsafe { self.post_bind(&mut wr, &slot)? };
        Ok(BoundWindow {
            slot,
            registration: region.clone(),
            remote: RemoteRegion::new(0, region.len() as u64, rkey),
            qpn: self.qpn(),
            access,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_grant_only_remote_rights() {
        assert!(WINDOW_RIGHTS.is_remote());
        assert!(!WINDOW_RIGHTS.contains(AccessFlags::MW_BIND));
        assert!(!WINDOW_RIGHTS.contains(AccessFlags::LOCAL_WRITE));
        assert!(!AccessFlags::MW_BIND.is_remote());
    }

    #[test]
    fn the_rkey_tag_wraps_within_its_byte() {
        // SAFETY: a pure function of its argument.
        let (next, wrapped) = unsafe {
            (
                sys::ibv_inc_rkey(0x1234_5601),
                sys::ibv_inc_rkey(0x1234_56ff),
            )
        };
        assert_eq!((next, wrapped), (0x1234_5602, 0x1234_5600));
    }
}
