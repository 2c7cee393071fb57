//! Protection domains: the security boundary that MRs and QPs belong to.

use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::error::Result;
use crate::sys;

use super::check_ptr;
use super::check_rc;
use super::device::{Context, ContextInner};
use super::loopback;

pub(crate) struct PdInner {
    pub(crate) pd: NonNull<sys::ibv_pd>,
    pub(crate) ctx: Arc<ContextInner>,
}

// SAFETY: PDs are thread-safe in libibverbs; freed only in Drop once no MR or QP
// (each holding an Arc to this) is left.
unsafe impl Send for PdInner {}
// SAFETY: see Send.
unsafe impl Sync for PdInner {}

impl Drop for PdInner {
    fn drop(&mut self) {
        if self.ctx.is_loopback() {
            // SAFETY: allocated by loopback::alloc_pd, freed once; all MRs
            // and QPs of this PD hold an Arc to it, so none is alive.
            unsafe { loopback::dealloc_pd(self.pd) };
            return;
        }
        // SAFETY: all MRs and QPs of this PD hold an Arc to it, so none is alive.
        let rc = unsafe { sys::ibv_dealloc_pd(self.pd.as_ptr()) };
        if let Err(err) = check_rc(rc, "ibv_dealloc_pd", &self.ctx.name, None) {
            log::error!("{err}");
        }
    }
}

/// A protection domain. Memory regions and queue pairs are created from it.
///
/// Cheap to clone; deallocated after the last clone, MR and QP are gone.
///
/// ```no_run
/// use rdma_comm_core::verbs::{AccessFlags, Context};
/// let ctx = Context::open_default(None)?;
/// let pd = ctx.alloc_pd()?;
/// let mr = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE)?;
/// # Ok::<(), rdma_comm_core::Error>(())
/// ```
#[derive(Clone)]
pub struct ProtectionDomain {
    pub(crate) inner: Arc<PdInner>,
}

impl fmt::Debug for ProtectionDomain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProtectionDomain")
            .field("device", &self.inner.ctx.name)
            .finish()
    }
}

impl Context {
    /// Allocates a protection domain.
    pub fn alloc_pd(&self) -> Result<ProtectionDomain> {
        let pd = if self.inner.is_loopback() {
            loopback::alloc_pd(self.inner.ctx)
        } else {
            // SAFETY: the context is open; the PD is freed in PdInner::drop.
            check_ptr(
                unsafe { sys::ibv_alloc_pd(self.inner.ctx.as_ptr()) },
                "ibv_alloc_pd",
                &self.inner.name,
            )?
        };
        Ok(ProtectionDomain {
            inner: Arc::new(PdInner {
                pd,
                ctx: Arc::clone(&self.inner),
            }),
        })
    }
}

impl ProtectionDomain {
    /// The device this PD belongs to.
    pub fn context(&self) -> Context {
        Context {
            inner: Arc::clone(&self.inner.ctx),
        }
    }
}
