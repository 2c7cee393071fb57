//! Memory regions and the local/remote descriptors that point into them.
//!
//! Registered memory is shared with the device: the NIC reads and writes it
//! asynchronously while a work request is in flight. So a [`MemoryRegion`]
//! never hands out `&[u8]`/`&mut [u8]` safely; CPU access goes through copying
//! [`read`](MemoryRegion::read)/[`write`](MemoryRegion::write) or the `unsafe`
//! slice views, whose contract is "no work request touches this range now".
//! The slot pool built on top tracks that state and offers safe slices.

use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::sys;

use super::check_ptr;
use super::check_rc;
use super::loopback;
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
        /// Memory windows may be bound to the region
        /// ([`QueuePair::bind_window`](super::QueuePair::bind_window)). A
        /// region with this flag and no `REMOTE_*` flag is out of every
        /// peer's reach except through a window, which grants its rights to
        /// the one QP it is bound to. Not itself a remote right: such a
        /// region cannot be exported with [`remote`](MemoryRegion::remote).
        const MW_BIND = sys::IBV_ACCESS_MW_BIND;
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

/// The registration behind a [`MemoryRegion`]: the verbs MR and the buffer
/// it covers. Deregistered, then freed, when the last holder drops it.
///
/// A `Registration` gives no CPU access to the bytes, only the keys and
/// bounds a work request needs. Whatever posts a request keeps one for as
/// long as the request may be in flight (the reactor stores it with each
/// staged WRITE and READ; a session with each export), so the memory a
/// posted request points at stays registered and mapped until its
/// completion, even if the user drops the [`MemoryRegion`] first.
#[derive(Clone)]
pub struct Registration {
    inner: Arc<RegistrationInner>,
}

struct RegistrationInner {
    mr: NonNull<sys::ibv_mr>,
    addr: NonNull<u8>,
    len: usize,
    access: AccessFlags,
    backing: Backing,
    huge_pages: bool,
    pd: Arc<PdInner>,
}

// SAFETY: the MR handle is thread-safe in libibverbs; a registration never
// touches the buffer's bytes, it only reads its own immutable fields.
unsafe impl Send for RegistrationInner {}
// SAFETY: as for Send: nothing behind `&self` is mutated.
unsafe impl Sync for RegistrationInner {}

/// Registered memory that the CPU reads and writes by copying.
///
/// Writing takes `&mut self`, so two threads can never copy into the same
/// bytes at once; reading takes `&self`. The device may read or write the
/// bytes while a request is in flight: those accesses come from outside the
/// program, so a copy that overlaps one sees torn data but no Rust reference
/// ever covers the bytes (see the module docs).
pub struct MemoryRegion {
    registration: Registration,
}

impl fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("addr", &self.reg().addr)
            .field("len", &self.reg().len)
            .field("lkey", &self.lkey())
            .field("access", &self.reg().access)
            .field("huge_pages", &self.reg().huge_pages)
            .finish()
    }
}

impl fmt::Debug for Registration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Registration")
            .field("addr", &self.inner.addr)
            .field("len", &self.inner.len)
            .field("holders", &Arc::strong_count(&self.inner))
            .finish()
    }
}

impl Drop for RegistrationInner {
    fn drop(&mut self) {
        let rc = if self.pd.ctx.is_loopback() {
            // SAFETY: the MR came from loopback::reg_mr and is deregistered
            // once; when this returns no loopback copy reaches the buffer.
            unsafe { loopback::dereg_mr(self.mr) };
            0
        } else {
            // SAFETY: the MR came from ibv_reg_mr and is deregistered once. After this
            // the device can no longer reach the buffer, so freeing it below is safe
            // even if a work request using it never completed.
            unsafe { sys::ibv_dereg_mr(self.mr.as_ptr()) }
        };
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
    /// `ptr..ptr+len` must stay valid and mapped until the region *and every
    /// [`Registration`] of it* are dropped (requests in flight, exports and
    /// the reactor keep registrations past the region), and the caller must
    /// not create Rust references to it while a work request or a peer may
    /// access it.
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
        let registered = if self.inner.ctx.is_loopback() {
            // SAFETY: the PD is a loopback one and live; addr..addr+len is
            // valid until the deregistration in RegistrationInner::drop,
            // which runs before the backing is freed (owned backing, or the
            // caller's promise in register_raw).
            unsafe { loopback::reg_mr(self.inner.pd, addr.as_ptr(), len, access.bits()) }.map_err(
                |errno| crate::error::verbs_error("ibv_reg_mr", errno, &self.inner.ctx.name, None),
            )
        } else {
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
            check_ptr(raw, "ibv_reg_mr", &self.inner.ctx.name)
        };
        let mr = match registered {
            Ok(mr) => mr,
            Err(err) => {
                free_backing(&backing);
                return Err(err);
            }
        };
        Ok(MemoryRegion {
            registration: Registration {
                inner: Arc::new(RegistrationInner {
                    mr,
                    addr,
                    len,
                    access,
                    backing,
                    huge_pages,
                    pd: Arc::clone(&self.inner),
                }),
            },
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

impl From<&MemoryRegion> for Registration {
    fn from(region: &MemoryRegion) -> Self {
        region.registration.clone()
    }
}

impl From<&Arc<MemoryRegion>> for Registration {
    fn from(region: &Arc<MemoryRegion>) -> Self {
        region.registration.clone()
    }
}

impl Registration {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.inner.len
    }

    /// Always false: empty regions cannot be registered.
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }

    /// Start address (as the device sees it).
    pub fn addr(&self) -> u64 {
        self.inner.addr.as_ptr() as u64
    }

    /// Local key, used in scatter/gather entries.
    pub fn lkey(&self) -> u32 {
        // SAFETY: the MR is registered for as long as `self` lives.
        unsafe { self.inner.mr.as_ref().lkey }
    }

    /// The access rights the memory was registered with.
    pub fn access(&self) -> AccessFlags {
        self.inner.access
    }

    /// True when the buffer is backed by huge pages.
    pub fn huge_pages(&self) -> bool {
        self.inner.huge_pages
    }

    /// The MR's own remote key. It reaches the memory only if the region
    /// was registered with `REMOTE_*` rights (export such a region with
    /// [`remote`](Self::remote)); a region registered for windows alone
    /// ([`AccessFlags::MW_BIND`]) is reachable only through a window's key.
    pub fn mr_rkey(&self) -> u32 {
        // SAFETY: the MR is registered for as long as `self` lives.
        unsafe { self.inner.mr.as_ref().rkey }
    }

    /// The verbs MR, for a bind request (registered while `self` lives).
    pub(crate) fn mr_ptr(&self) -> *mut sys::ibv_mr {
        self.inner.mr.as_ptr()
    }

    /// True if the memory was registered in `pd`.
    pub(crate) fn in_pd(&self, pd: &Arc<PdInner>) -> bool {
        Arc::ptr_eq(&self.inner.pd, pd)
    }

    /// True if the memory was registered in `pd`.
    pub fn belongs_to(&self, pd: &super::ProtectionDomain) -> bool {
        self.in_pd(&pd.inner)
    }

    /// True if both handles are the same registration.
    pub fn same_as(&self, other: &Registration) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// An identity, equal for handles of the same registration (while one
    /// of them lives): to compare without holding a handle.
    pub(crate) fn id(&self) -> usize {
        Arc::as_ptr(&self.inner) as usize
    }

    /// The descriptor a peer needs to WRITE or READ this memory with the
    /// MR's own rkey. It carries the memory's virtual address, and the key
    /// works from every QP of the PD: sessions never send it, and export
    /// through zero-based windows instead (see `session::Export`).
    ///
    /// Fails unless it was registered with a `REMOTE_*` flag: only regions
    /// the user exports get an rkey worth sending.
    pub fn remote(&self) -> Result<RemoteRegion> {
        if !self.inner.access.is_remote() {
            return Err(Error::InvalidArgument(
                "region was registered without remote access; it cannot be exported",
            ));
        }
        Ok(RemoteRegion {
            addr: self.addr(),
            len: self.inner.len as u64,
            rkey: self.mr_rkey(),
        })
    }

    /// A bounds-checked local descriptor for `len` bytes at `offset`.
    #[inline]
    pub fn slice(&self, offset: usize, len: usize) -> Result<LocalSlice<'_>> {
        check_range(
            "local slice",
            offset as u64,
            len as u64,
            self.inner.len as u64,
        )?;
        let len = u32::try_from(len)
            .map_err(|_| Error::InvalidArgument("a single SGE carries at most 4 GiB"))?;
        Ok(LocalSlice {
            addr: self.addr() + offset as u64,
            len,
            lkey: self.lkey(),
            access: self.inner.access,
            registration: self,
        })
    }

    /// Where byte `offset` lives in this process. Only for modules that
    /// track themselves which bytes the device may be using (the buffer
    /// pool, the reactor's rings).
    pub(crate) fn ptr_at(&self, offset: usize) -> *mut u8 {
        debug_assert!(offset <= self.inner.len);
        self.inner.addr.as_ptr().wrapping_add(offset)
    }
}

impl MemoryRegion {
    fn reg(&self) -> &RegistrationInner {
        &self.registration.inner
    }

    /// The registration, to keep the memory registered past this handle
    /// (for as long as a request or an export needs it).
    pub fn registration(&self) -> &Registration {
        &self.registration
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.reg().len
    }

    /// Always false: empty regions cannot be registered.
    pub fn is_empty(&self) -> bool {
        self.reg().len == 0
    }

    /// Start address (as the device sees it).
    pub fn addr(&self) -> u64 {
        self.registration.addr()
    }

    /// Local key, used in scatter/gather entries.
    pub fn lkey(&self) -> u32 {
        self.registration.lkey()
    }

    /// The access rights this region was registered with.
    pub fn access(&self) -> AccessFlags {
        self.reg().access
    }

    /// True when the buffer is backed by huge pages.
    pub fn huge_pages(&self) -> bool {
        self.reg().huge_pages
    }

    /// A bounds-checked local descriptor for `len` bytes at `offset`.
    #[inline]
    pub fn slice(&self, offset: usize, len: usize) -> Result<LocalSlice<'_>> {
        self.registration.slice(offset, len)
    }

    /// A local descriptor for the whole region.
    pub fn whole(&self) -> Result<LocalSlice<'_>> {
        self.slice(0, self.len())
    }

    /// The descriptor a peer needs to WRITE or READ this region, with its
    /// virtual address (see [`Registration::remote`]).
    ///
    /// Fails unless the region was registered with a `REMOTE_*` flag: only
    /// regions the user exports get an rkey worth sending.
    pub fn remote(&self) -> Result<RemoteRegion> {
        self.registration.remote()
    }

    /// Copies `src` into the region at `offset`.
    ///
    /// `&mut self` keeps other threads' copies out. Bytes a work request is
    /// reading or writing at the same time may end up torn; keep ranges in
    /// flight and ranges being written apart.
    pub fn write(&mut self, offset: usize, src: &[u8]) -> Result<()> {
        check_range(
            "write into region",
            offset as u64,
            src.len() as u64,
            self.len() as u64,
        )?;
        // SAFETY: in bounds (checked above). `&mut self` means no other copy
        // through this region runs now, and no Rust reference to registered
        // bytes exists outside the `unsafe` views, whose callers promised
        // not to overlap. `src` is ordinary memory, disjoint from ours.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.registration.ptr_at(offset), src.len())
        };
        Ok(())
    }

    /// Copies bytes at `offset` out of the region into `dst`.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        check_range(
            "read from region",
            offset as u64,
            dst.len() as u64,
            self.len() as u64,
        )?;
        // SAFETY: in bounds (checked above); CPU writes need `&mut self`, so
        // none runs while we hold `&self`. `dst` is ordinary memory.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.registration.ptr_at(offset),
                dst.as_mut_ptr(),
                dst.len(),
            )
        };
        Ok(())
    }

    /// Reads one byte with a volatile load: for polling a byte that a peer's
    /// RDMA WRITE will change (the compiler may not cache it).
    #[inline]
    pub fn load_byte(&self, offset: usize) -> Option<u8> {
        // SAFETY: in bounds (checked by the comparison); a volatile u8 read
        // of registered memory races only with the NIC, never with Rust code
        // (CPU writes need `&mut self`).
        (offset < self.len())
            .then(|| unsafe { std::ptr::read_volatile(self.registration.ptr_at(offset)) })
    }

    /// Views the whole region as a slice.
    ///
    /// # Safety
    /// No work request may write any of these bytes while the slice lives
    /// (no posted RECV or READ into them, no remote WRITE a peer can issue).
    pub unsafe fn as_slice(&self) -> &[u8] {
        // SAFETY: valid for len bytes; the caller rules out DMA writes, and
        // CPU writes need `&mut self`.
        unsafe { std::slice::from_raw_parts(self.registration.ptr_at(0), self.len()) }
    }

    /// Views the whole region as a mutable slice.
    ///
    /// # Safety
    /// No work request may read or write any of these bytes while the slice
    /// lives (nothing posted on them, no peer holding their rkey or the
    /// rkey of a memory window bound to them).
    pub unsafe fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: valid for len bytes; `&mut self` excludes other CPU access and
        // the caller rules out DMA.
        unsafe { std::slice::from_raw_parts_mut(self.registration.ptr_at(0), self.len()) }
    }
}

#[inline]
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
    registration: &'a Registration,
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

    /// The registration the slice points into: a request that outlives
    /// this borrow keeps a clone of it until its completion.
    pub fn registration(&self) -> &Registration {
        self.registration
    }
}

/// A peer's exported region: `{addr, len, rkey}` as received out of band.
/// A remote operation at `offset` targets `addr + offset`. A session's
/// exports arrive with `addr` 0: they are zero-based memory windows, so
/// offsets are all the peer needs.
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
    #[inline]
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
