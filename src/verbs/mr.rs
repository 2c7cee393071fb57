//! Memory regions and the local/remote descriptors that point into them.
//!
//! Registered memory is shared with the device: the NIC reads and writes it
//! asynchronously while a work request is in flight. So a [`MemoryRegion`]
//! never hands out `&[u8]`/`&mut [u8]` safely; CPU access goes through copying
//! [`read`](MemoryRegion::read)/[`write`](MemoryRegion::write) or the `unsafe`
//! slice views, whose contract is "no work request touches this range now".
//! The slot pool built on top tracks that state and offers safe slices.

use std::fmt;
use std::marker::PhantomData;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::sys;

use super::check_ptr;
use super::check_rc;
use super::pd::{PdInner, ProtectionDomain};

bitflags::bitflags! {
    /// Access rights of a memory region (and of a QP, for remote operations).
    ///
    /// Least privilege: ask only for what the peer needs. An rkey is a
    /// capability; a region without `REMOTE_*` flags cannot be exported.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct AccessFlags: u32 {
        /// The local NIC may write (needed for RECV and READ targets).
        const LOCAL_WRITE = sys::IBV_ACCESS_LOCAL_WRITE;
        /// Peers may RDMA WRITE into it (implies `LOCAL_WRITE`).
        const REMOTE_WRITE = sys::IBV_ACCESS_REMOTE_WRITE;
        /// Peers may RDMA READ from it.
        const REMOTE_READ = sys::IBV_ACCESS_REMOTE_READ;
        /// Peers may run atomics on it (implies `LOCAL_WRITE`).
        const REMOTE_ATOMIC = sys::IBV_ACCESS_REMOTE_ATOMIC;
    }
}

impl AccessFlags {
    /// Adds the flags the verbs spec requires alongside the requested ones.
    fn normalized(self) -> Self {
        if self.intersects(Self::REMOTE_WRITE | Self::REMOTE_ATOMIC) {
            self | Self::LOCAL_WRITE
        } else {
            self
        }
    }

    /// True if any remote access is granted.
    pub fn is_remote(self) -> bool {
        self.intersects(Self::REMOTE_WRITE | Self::REMOTE_READ | Self::REMOTE_ATOMIC)
    }
}

/// Where the registered bytes live and how to free them after deregistration.
enum Backing {
    /// Anonymous mmap, page-aligned (huge pages when `huge`).
    Mapped { ptr: NonNull<u8>, len: usize },
    /// A boxed slice we took ownership of; rebuilt and dropped after dereg.
    Boxed { ptr: NonNull<u8>, len: usize },
    /// Memory the caller owns (see `register_raw`).
    External,
}

/// Registered memory, deregistered before its buffer is freed.
pub struct MemoryRegion {
    mr: NonNull<sys::ibv_mr>,
    addr: NonNull<u8>,
    len: usize,
    access: AccessFlags,
    backing: Backing,
    huge_pages: bool,
    pd: Arc<PdInner>,
}

// SAFETY: the MR handle is thread-safe in libibverbs, and the buffer is only
// touched through raw-pointer copies whose soundness does not depend on the thread.
unsafe impl Send for MemoryRegion {}
// SAFETY: `&self` methods only copy through raw pointers (see module docs).
unsafe impl Sync for MemoryRegion {}

impl fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("addr", &self.addr)
            .field("len", &self.len)
            .field("lkey", &self.lkey())
            .field("access", &self.access)
            .field("huge_pages", &self.huge_pages)
            .finish()
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // SAFETY: the MR came from ibv_reg_mr and is deregistered once. After this
        // the device can no longer reach the buffer, so freeing it below is safe
        // even if a work request using it never completed.
        let rc = unsafe { sys::ibv_dereg_mr(self.mr.as_ptr()) };
        if let Err(err) = check_rc(rc, "ibv_dereg_mr", &self.pd.ctx.name, None) {
            // Freeing memory the device may still reach would be worse than a leak.
            log::error!("{err}; leaking the buffer");
            return;
        }
        free_backing(&self.backing);
    }
}

impl ProtectionDomain {
    /// Allocates `len` zeroed, page-aligned bytes and registers them.
    ///
    /// Uses huge pages when the system has them free, silently falling back to
    /// normal pages otherwise ([`MemoryRegion::huge_pages`] tells which).
    pub fn alloc_mr(&self, len: usize, access: AccessFlags) -> Result<MemoryRegion> {
        if len == 0 {
            return Err(Error::InvalidArgument("a memory region must not be empty"));
        }
        let (ptr, map_len, huge) = map_anonymous(len)?;
        let backing = Backing::Mapped { ptr, len: map_len };
        self.register_inner(ptr, len, access, backing, huge)
    }

    /// Registers a boxed buffer, taking ownership of it.
    pub fn register_boxed(&self, buf: Box<[u8]>, access: AccessFlags) -> Result<MemoryRegion> {
        if buf.is_empty() {
            return Err(Error::InvalidArgument("a memory region must not be empty"));
        }
        let len = buf.len();
        let ptr = NonNull::new(Box::into_raw(buf).cast::<u8>()).expect("Box pointers are non-null");
        self.register_inner(ptr, len, access, Backing::Boxed { ptr, len }, false)
    }

    /// Registers memory the caller owns (for example a shared or device mapping).
    ///
    /// # Safety
    /// `ptr..ptr+len` must stay valid and mapped until the returned region is
    /// dropped, and the caller must not create Rust references to it while a
    /// work request may access it.
    pub unsafe fn register_raw(
        &self,
        ptr: NonNull<u8>,
        len: usize,
        access: AccessFlags,
    ) -> Result<MemoryRegion> {
        self.register_inner(ptr, len, access, Backing::External, false)
    }

    fn register_inner(
        &self,
        addr: NonNull<u8>,
        len: usize,
        access: AccessFlags,
        backing: Backing,
        huge_pages: bool,
    ) -> Result<MemoryRegion> {
        let access = access.normalized();
        // SAFETY: addr..addr+len is valid for the region's life (owned backing, or
        // the caller's promise in register_raw).
        let raw = unsafe {
            sys::ibv_reg_mr(
                self.inner.pd.as_ptr(),
                addr.as_ptr().cast(),
                len,
                access.bits() as i32,
            )
        };
        let mr = match check_ptr(raw, "ibv_reg_mr", &self.inner.ctx.name) {
            Ok(mr) => mr,
            Err(err) => {
                free_backing(&backing);
                return Err(err);
            }
        };
        Ok(MemoryRegion {
            mr,
            addr,
            len,
            access,
            backing,
            huge_pages,
            pd: Arc::clone(&self.inner),
        })
    }
}

/// Frees what we own of a buffer; called only once nothing is registered on it.
fn free_backing(backing: &Backing) {
    match *backing {
        // SAFETY: the mapping came from mmap with this length.
        Backing::Mapped { ptr, len } => unsafe {
            libc::munmap(ptr.as_ptr().cast(), len);
        },
        // SAFETY: ptr/len came from Box::into_raw of a Box<[u8]>.
        Backing::Boxed { ptr, len } => {
            drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(ptr.as_ptr(), len)) })
        }
        Backing::External => {}
    }
}

const HUGE_PAGE: usize = 2 << 20;

/// Maps zeroed anonymous memory, with 2 MiB huge pages when `len` is large
/// enough and the kernel has them, else normal pages.
fn map_anonymous(len: usize) -> Result<(NonNull<u8>, usize, bool)> {
    let prot = libc::PROT_READ | libc::PROT_WRITE;
    let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
    if len >= HUGE_PAGE {
        let huge_len = len.div_ceil(HUGE_PAGE) * HUGE_PAGE;
        // SAFETY: anonymous mapping request; no existing memory is affected.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                huge_len,
                prot,
                flags | libc::MAP_HUGETLB,
                -1,
                0,
            )
        };
        if ptr != libc::MAP_FAILED {
            return Ok((
                NonNull::new(ptr.cast()).expect("mmap never returns NULL on success"),
                huge_len,
                true,
            ));
        }
    }
    // SAFETY: anonymous mapping request; no existing memory is affected.
    let ptr = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, flags, -1, 0) };
    if ptr == libc::MAP_FAILED {
        return Err(Error::Os {
            what: "mmap for a memory region",
            source: std::io::Error::last_os_error(),
        });
    }
    Ok((
        NonNull::new(ptr.cast()).expect("mmap never returns NULL on success"),
        len,
        false,
    ))
}

impl MemoryRegion {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: empty regions cannot be registered.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Start address (as the device sees it).
    pub fn addr(&self) -> u64 {
        self.addr.as_ptr() as u64
    }

    /// Raw pointer to the first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.addr.as_ptr()
    }

    /// Local key, used in scatter/gather entries.
    pub fn lkey(&self) -> u32 {
        // SAFETY: the MR is registered for as long as `self` lives.
        unsafe { self.mr.as_ref().lkey }
    }

    /// The access rights this region was registered with.
    pub fn access(&self) -> AccessFlags {
        self.access
    }

    /// True when the buffer is backed by huge pages.
    pub fn huge_pages(&self) -> bool {
        self.huge_pages
    }

    /// A bounds-checked local descriptor for `len` bytes at `offset`.
    pub fn slice(&self, offset: usize, len: usize) -> Result<LocalSlice<'_>> {
        check_range("local slice", offset as u64, len as u64, self.len as u64)?;
        let len = u32::try_from(len)
            .map_err(|_| Error::InvalidArgument("a single SGE carries at most 4 GiB"))?;
        Ok(LocalSlice {
            addr: self.addr() + offset as u64,
            len,
            lkey: self.lkey(),
            access: self.access,
            _region: PhantomData,
        })
    }

    /// A local descriptor for the whole region.
    pub fn whole(&self) -> Result<LocalSlice<'_>> {
        self.slice(0, self.len)
    }

    /// The descriptor a peer needs to WRITE or READ this region.
    ///
    /// Fails unless the region was registered with a `REMOTE_*` flag: only
    /// regions the user exports get an rkey worth sending.
    pub fn remote(&self) -> Result<RemoteRegion> {
        if !self.access.is_remote() {
            return Err(Error::InvalidArgument(
                "region was registered without remote access; it cannot be exported",
            ));
        }
        // SAFETY: the MR is registered for as long as `self` lives.
        let rkey = unsafe { self.mr.as_ref().rkey };
        Ok(RemoteRegion {
            addr: self.addr(),
            len: self.len as u64,
            rkey,
        })
    }

    /// Copies `src` into the region at `offset`.
    ///
    /// Bytes a work request is writing at the same time may end up torn; keep
    /// ranges in flight and ranges being written apart.
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        check_range(
            "write into region",
            offset as u64,
            src.len() as u64,
            self.len as u64,
        )?;
        // SAFETY: in bounds (checked above); `src` is ordinary memory that cannot
        // overlap registered memory we own exclusively through raw pointers.
        unsafe { std::ptr::copy(src.as_ptr(), self.as_ptr().add(offset), src.len()) };
        Ok(())
    }

    /// Copies bytes at `offset` out of the region into `dst`.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        check_range(
            "read from region",
            offset as u64,
            dst.len() as u64,
            self.len as u64,
        )?;
        // SAFETY: in bounds (checked above); see `write`.
        unsafe { std::ptr::copy(self.as_ptr().add(offset), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// Reads one byte with a volatile load: for polling a byte that a peer's
    /// RDMA WRITE will change (the compiler may not cache it).
    #[inline]
    pub fn load_byte(&self, offset: usize) -> Option<u8> {
        // SAFETY: in bounds (checked by `get`-style comparison); a volatile u8
        // read of registered memory races only with the NIC, never with Rust code.
        (offset < self.len).then(|| unsafe { std::ptr::read_volatile(self.as_ptr().add(offset)) })
    }

    /// Views the whole region as a slice.
    ///
    /// # Safety
    /// No work request may write any of these bytes while the slice lives.
    pub unsafe fn as_slice(&self) -> &[u8] {
        // SAFETY: valid for len bytes; the caller rules out concurrent DMA writes.
        unsafe { std::slice::from_raw_parts(self.as_ptr(), self.len) }
    }

    /// Views the whole region as a mutable slice.
    ///
    /// # Safety
    /// No work request may read or write any of these bytes while the slice lives.
    pub unsafe fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: valid for len bytes; `&mut self` excludes other CPU access and
        // the caller rules out DMA.
        unsafe { std::slice::from_raw_parts_mut(self.as_ptr(), self.len) }
    }
}

fn check_range(what: &'static str, offset: u64, len: u64, size: u64) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(Error::OutOfBounds {
            what,
            offset,
            len,
            size,
        }),
    }
}

/// A bounds-checked range of a local [`MemoryRegion`], for one scatter/gather entry.
#[derive(Debug, Clone, Copy)]
pub struct LocalSlice<'a> {
    pub(crate) addr: u64,
    pub(crate) len: u32,
    pub(crate) lkey: u32,
    pub(crate) access: AccessFlags,
    _region: PhantomData<&'a MemoryRegion>,
}

impl LocalSlice<'_> {
    /// Length in bytes.
    pub fn len(&self) -> u32 {
        self.len
    }

    /// True for a zero-length slice.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Start address.
    pub fn addr(&self) -> u64 {
        self.addr
    }
}

/// A peer's exported region: `{addr, len, rkey}` as received out of band.
///
/// Every WRITE or READ against it goes through [`RemoteRegion::slice`], so an
/// out-of-range access is refused locally instead of faulting the QP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RemoteRegion {
    addr: u64,
    len: u64,
    rkey: u32,
}

impl RemoteRegion {
    /// Builds a descriptor from fields received from a peer.
    pub fn new(addr: u64, len: u64, rkey: u32) -> Self {
        Self { addr, len, rkey }
    }

    /// Remote start address.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True for an empty region.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Remote key.
    pub fn rkey(&self) -> u32 {
        self.rkey
    }

    /// A bounds-checked target of `len` bytes at `offset`.
    pub fn slice(&self, offset: u64, len: u64) -> Result<RemoteSlice> {
        check_range("remote slice", offset, len, self.len)?;
        let len = u32::try_from(len)
            .map_err(|_| Error::InvalidArgument("one RDMA operation carries at most 4 GiB"))?;
        Ok(RemoteSlice {
            addr: self.addr + offset,
            len,
            rkey: self.rkey,
        })
    }
}

/// A bounds-checked range of a [`RemoteRegion`], the target of one WRITE or READ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteSlice {
    pub(crate) addr: u64,
    pub(crate) len: u32,
    pub(crate) rkey: u32,
}

impl RemoteSlice {
    /// Remote address.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Length in bytes.
    pub fn len(&self) -> u32 {
        self.len
    }

    /// True for a zero-length target.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Remote key.
    pub fn rkey(&self) -> u32 {
        self.rkey
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remote_slices_are_bounds_checked() {
        let region = RemoteRegion::new(0x1000, 4096, 7);
        let s = region.slice(4000, 96).unwrap();
        assert_eq!((s.addr(), s.len(), s.rkey()), (0x1000 + 4000, 96, 7));
        assert!(matches!(
            region.slice(4000, 97),
            Err(Error::OutOfBounds { .. })
        ));
        assert!(matches!(
            region.slice(u64::MAX, 2),
            Err(Error::OutOfBounds { .. })
        ));
        assert!(region.slice(4096, 0).is_ok());
    }

    #[test]
    fn remote_write_implies_local_write() {
        assert!(
            AccessFlags::REMOTE_WRITE
                .normalized()
                .contains(AccessFlags::LOCAL_WRITE)
        );
        assert_eq!(
            AccessFlags::REMOTE_READ.normalized(),
            AccessFlags::REMOTE_READ
        );
        assert!(!AccessFlags::LOCAL_WRITE.is_remote());
    }
}
