//! An in-process software RDMA device, "loopback": RC queue pairs of any
//! loopback context in the process connect to one another, and the data
//! path (post send, post receive, poll) runs through the same cached
//! function pointers as a hardware provider's, so the crate's data path is
//! the one a real device runs. For tests and benchmarks on machines
//! without an RDMA NIC ([`Context::loopback`](super::Context::loopback)).
//!
//! # Model
//! - A send-queue request executes synchronously inside `ibv_post_send`:
//!   SEND takes the peer's oldest posted receive, WRITE and READ copy
//!   between registered memory, and completions land on both sides' CQs
//!   before the call returns. A SEND (or WRITE_WITH_IMM) that finds no
//!   receive posted stalls the send queue, as RNR retries with
//!   `rnr_retry` 7 (forever) would: it and everything posted after it wait
//!   on the sender, and the peer's next `ibv_post_recv` runs them (on the
//!   peer's thread). `rnr_retry` below 7 is treated as 7.
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
//!   once. Unlike some hardware providers, destroying a QP leaves its
//!   completions in the CQs (as Soft-RoCE does).
//! - A CQ is a bounded ring of `ibv_wc` allocated at creation. A completion
//!   that does not fit is dropped, the QP it belonged to goes to the error
//!   state, and once the entries queued before it are polled every poll of
//!   that CQ fails with `EOVERFLOW` (the CQ is dead, as after a hardware CQ
//!   overrun).
//! - Not supported (the verbs return `Error::Unsupported`): completion
//!   channels and `req_notify` (busy polling only), shared receive queues,
//!   memory windows, atomics, and QP types other than RC.
//!
//! # Locking
//! Each QP has a send-queue mutex (its stalled requests) and a receive-queue
//! mutex (its posted receives; its state changes to ERR under it). A
//! poster holds its own send-queue lock and takes the peer's receive-queue
//! lock for a SEND; the MR table's read lock and the CQ ring locks are
//! taken last and held briefly. Send-queue locks are never taken while a
//! receive-queue lock is held, and no thread holds two send-queue locks, so
//! the order is acyclic. The locks are uncontended when one thread serves
//! both ends: their cost (a few atomic operations per request) is part of
//! what a benchmark over this device measures, where a NIC would charge a
//! doorbell and DMA instead.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::os::raw::c_int;
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{
    Arc, LazyLock, Mutex, MutexGuard, OnceLock, PoisonError, RwLock, RwLockReadGuard, Weak,
};

use crate::sys;

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
/// Largest CQ.
const MAX_CQE: u32 = 1 << 22;
/// READ depths reported (nothing limits them here).
const MAX_RD_ATOM: u8 = 16;

// ---------------------------------------------------------------------------
// Device, port and GID attributes.

/// Allocates a loopback device context whose ops table holds this module's
/// data-path functions. Free it with [`close_context`].
pub(crate) fn open_context() -> NonNull<sys::ibv_context> {
    let mut ctx = Box::<sys::ibv_context>::default();
    ctx.ops.post_send = Some(post_send);
    ctx.ops.post_recv = Some(post_recv);
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

// ---------------------------------------------------------------------------
// Registries.

/// A hasher for keys that are already unique small integers.
#[derive(Default)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u32(&mut self, n: u32) {
        // Spread into the high bits, which the table's control bytes use.
        self.0 = u64::from(n).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

type KeyMap<V> = HashMap<u32, V, BuildHasherDefault<IdHasher>>;

/// A registered range, by key (lkey and rkey are the same number).
#[derive(Clone, Copy, Debug)]
struct MrEntry {
    addr: u64,
    len: u64,
    access: u32,
    pd: u32,
}

/// Every loopback MR in the process. Copies hold the read lock for their
/// whole duration; deregistration takes the write lock.
static MRS: LazyLock<RwLock<KeyMap<MrEntry>>> = LazyLock::new(Default::default);
/// Every live loopback QP in the process, by QP number.
static QPS: LazyLock<Mutex<KeyMap<Weak<LbQp>>>> = LazyLock::new(Default::default);
static NEXT_KEY: AtomicU32 = AtomicU32::new(0x100);
static NEXT_QPN: AtomicU32 = AtomicU32::new(0x11);
static NEXT_HANDLE: AtomicU32 = AtomicU32::new(1);

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // Nothing here panics while holding a lock; if something did, the data
    // is still consistent enough to keep serving (and never unsound).
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

fn read_mrs() -> RwLockReadGuard<'static, KeyMap<MrEntry>> {
    MRS.read().unwrap_or_else(PoisonError::into_inner)
}

fn next_handle() -> u32 {
    NEXT_HANDLE.fetch_add(1, Ordering::Relaxed)
}

// ---------------------------------------------------------------------------
// Protection domains and memory regions.

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

/// A contiguous range of registered (or inline) memory, resolved for a copy.
#[derive(Clone, Copy)]
struct Span {
    ptr: *mut u8,
    len: usize,
}

/// Up to `MAX_SGE` spans.
#[derive(Clone, Copy)]
struct Spans {
    spans: [Span; MAX_SGE],
    count: usize,
}

impl Spans {
    const EMPTY: Span = Span {
        ptr: ptr::null_mut(),
        len: 0,
    };

    fn new() -> Self {
        Self {
            spans: [Self::EMPTY; MAX_SGE],
            count: 0,
        }
    }

    fn one(span: Span) -> Self {
        let mut spans = Self::new();
        spans.push(span);
        spans
    }

    fn push(&mut self, span: Span) {
        if span.len > 0 && self.count < MAX_SGE {
            self.spans[self.count] = span;
            self.count += 1;
        }
    }

    fn as_slice(&self) -> &[Span] {
        &self.spans[..self.count]
    }

    fn total(&self) -> u64 {
        self.as_slice().iter().map(|s| s.len as u64).sum()
    }
}

/// Looks `key` up and checks that `addr..addr+len` lies inside it, in `pd`,
/// with every right of `need`.
fn resolve(
    mrs: &KeyMap<MrEntry>,
    key: u32,
    addr: u64,
    len: u64,
    pd: u32,
    need: u32,
) -> Option<Span> {
    let entry = mrs.get(&key)?;
    let end = addr.checked_add(len)?;
    let inside = addr >= entry.addr && end <= entry.addr + entry.len;
    (inside && entry.pd == pd && entry.access & need == need).then_some(Span {
        ptr: addr as *mut u8,
        len: len as usize,
    })
}

/// Copies the bytes of `src` into `dst` in order; `dst` holds at least as
/// many bytes as `src`.
///
/// # Safety
/// Every span is valid for the copy: registered memory under the MR
/// table's read lock, or inline data the poster keeps alive for the call.
/// Source and destination may overlap (the copy is a `memmove` per piece).
unsafe fn copy_spans(src: &Spans, dst: &Spans) {
    let mut targets = dst.as_slice().iter();
    let mut target = Spans::EMPTY;
    let mut filled = 0;
    for source in src.as_slice() {
        let mut taken = 0;
        while taken < source.len {
            if filled == target.len {
                match targets.next() {
                    Some(next) => (target, filled) = (*next, 0),
                    None => return,
                }
                continue;
            }
            let n = (source.len - taken).min(target.len - filled);
            // SAFETY: both ranges are in bounds of their spans, which the
            // caller vouches for; `copy` allows overlap.
            unsafe { ptr::copy(source.ptr.add(taken), target.ptr.add(filled), n) };
            taken += n;
            filled += n;
        }
    }
}

// ---------------------------------------------------------------------------
// Completion queues.

/// A CQ's completions: a ring allocated at creation.
struct CqRing {
    state: Mutex<RingState>,
}

struct RingState {
    wcs: VecDeque<sys::ibv_wc>,
    capacity: usize,
    /// A completion was dropped: the CQ is dead once drained.
    overflowed: bool,
}

impl CqRing {
    /// Queues `wc`; false (and the completion dropped) when the ring is full.
    fn push(&self, wc: sys::ibv_wc) -> bool {
        let mut ring = lock(&self.state);
        if ring.overflowed || ring.wcs.len() >= ring.capacity {
            ring.overflowed = true;
            return false;
        }
        // Never reallocates: the deque was allocated with `capacity`.
        ring.wcs.push_back(wc);
        true
    }

    /// Moves up to `max` completions to `out`.
    ///
    /// # Safety
    /// `out` is valid for writing `max` entries.
    unsafe fn poll(&self, max: usize, out: *mut sys::ibv_wc) -> c_int {
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
unsafe fn ring_of<'a>(cq: *mut sys::ibv_cq) -> &'a Arc<CqRing> {
    // SAFETY: our CQs are CqObjs with the ibv_cq first (repr(C)); only
    // the `ring` field is borrowed, which nobody writes after creation.
    unsafe { &(*cq.cast::<CqObj>()).ring }
}

unsafe extern "C" fn poll_cq(cq: *mut sys::ibv_cq, num: c_int, wc: *mut sys::ibv_wc) -> c_int {
    // SAFETY: libibverbs' contract: `cq` is a live CQ of this context (one
    // of ours) and `wc` has room for `num` entries.
    unsafe { ring_of(cq).poll(num.max(0) as usize, wc) }
}

unsafe extern "C" fn req_notify_cq(_cq: *mut sys::ibv_cq, _solicited: c_int) -> c_int {
    // Busy polling only: no completion channels on this device.
    libc::EOPNOTSUPP
}

// ---------------------------------------------------------------------------
// Queue pairs.

/// One scatter/gather entry as posted.
#[derive(Clone, Copy, Default, Debug)]
struct Seg {
    addr: u64,
    len: u32,
    lkey: u32,
}

/// A request's scatter/gather list, inline (no allocation).
#[derive(Clone, Copy, Default, Debug)]
struct SgList {
    segs: [Seg; MAX_SGE],
    count: usize,
}

impl SgList {
    /// Copies a posted list.
    ///
    /// # Safety
    /// `list` points at `count` valid entries when `count` > 0.
    unsafe fn from_raw(list: *const sys::ibv_sge, count: c_int, max: usize) -> Option<Self> {
        let count = usize::try_from(count).ok()?;
        if count > max.min(MAX_SGE) || (count > 0 && list.is_null()) {
            return None;
        }
        let mut sgl = Self {
            count,
            ..Self::default()
        };
        for (i, seg) in sgl.segs.iter_mut().take(count).enumerate() {
            // SAFETY: i < count entries, valid per the caller.
            let sge = unsafe { *list.add(i) };
            *seg = Seg {
                addr: sge.addr,
                len: sge.length,
                lkey: sge.lkey,
            };
        }
        Some(sgl)
    }

    fn segs(&self) -> &[Seg] {
        &self.segs[..self.count]
    }

    fn total(&self) -> u64 {
        self.segs().iter().map(|s| u64::from(s.len)).sum()
    }

    /// Resolves every entry against the MR table (in `pd`, with `need`).
    fn resolve(&self, mrs: &KeyMap<MrEntry>, pd: u32, need: u32) -> Option<Spans> {
        let mut spans = Spans::new();
        for seg in self.segs().iter().filter(|s| s.len > 0) {
            spans.push(resolve(
                mrs,
                seg.lkey,
                seg.addr,
                u64::from(seg.len),
                pd,
                need,
            )?);
        }
        Some(spans)
    }
}

/// Where a send request's payload comes from.
enum Payload {
    /// Registered memory named by the SGEs' lkeys.
    Registered,
    /// Inline data at the SGEs' addresses, valid during the post call.
    InlineBorrowed,
    /// Inline data copied out when the request stalled.
    InlineOwned(Box<[u8]>),
}

/// A send-queue request as executed (and, stalled, as queued).
struct SendOp {
    wr_id: u64,
    opcode: sys::ibv_wr_opcode,
    signaled: bool,
    /// Network byte order, as posted.
    imm: u32,
    sgl: SgList,
    payload: Payload,
    remote_addr: u64,
    rkey: u32,
}

impl SendOp {
    /// Reads a posted request; `Err(errno)` for one this device refuses.
    ///
    /// # Safety
    /// `wr` is a valid request whose SGE list is valid, as `ibv_post_send`
    /// requires.
    unsafe fn from_raw(wr: &sys::ibv_send_wr, qp: &LbQp) -> Result<Self, c_int> {
        let opcode = wr.opcode;
        let rdma = matches!(
            opcode,
            sys::IBV_WR_RDMA_WRITE | sys::IBV_WR_RDMA_WRITE_WITH_IMM | sys::IBV_WR_RDMA_READ
        );
        if !rdma && !matches!(opcode, sys::IBV_WR_SEND | sys::IBV_WR_SEND_WITH_IMM) {
            return Err(libc::EINVAL);
        }
        // SAFETY: the caller vouches for the list.
        let sgl = unsafe { SgList::from_raw(wr.sg_list, wr.num_sge, qp.max_send_sge) }
            .ok_or(libc::EINVAL)?;
        let inline = wr.send_flags & sys::IBV_SEND_INLINE != 0;
        if inline && (opcode == sys::IBV_WR_RDMA_READ || sgl.total() > u64::from(qp.max_inline)) {
            return Err(libc::EINVAL);
        }
        let (remote_addr, rkey) = if rdma {
            // SAFETY: `rdma` is the union member of these opcodes.
            unsafe { (wr.wr.rdma.remote_addr, wr.wr.rdma.rkey) }
        } else {
            (0, 0)
        };
        Ok(Self {
            wr_id: wr.wr_id,
            opcode,
            signaled: qp.sig_all || wr.send_flags & sys::IBV_SEND_SIGNALED != 0,
            // SAFETY: a plain u32 in every member of the union.
            imm: unsafe { wr.__bindgen_anon_1.imm_data },
            sgl,
            payload: if inline {
                Payload::InlineBorrowed
            } else {
                Payload::Registered
            },
            remote_addr,
            rkey,
        })
    }

    /// Makes the request independent of the post call (for queuing).
    ///
    /// # Safety
    /// Called during the post call that posted it (inline data still valid).
    unsafe fn detach(mut self) -> Self {
        if let Payload::InlineBorrowed = self.payload {
            let mut data = Vec::with_capacity(self.sgl.total() as usize);
            for seg in self.sgl.segs() {
                // SAFETY: inline data is readable for the call (the poster's
                // contract for IBV_SEND_INLINE).
                data.extend_from_slice(unsafe {
                    std::slice::from_raw_parts(seg.addr as *const u8, seg.len as usize)
                });
            }
            self.payload = Payload::InlineOwned(data.into_boxed_slice());
        }
        self
    }

    /// The bytes this request sends or writes, resolved in `pd`.
    fn source(&self, mrs: &KeyMap<MrEntry>, pd: u32) -> Option<Spans> {
        match &self.payload {
            Payload::Registered => self.sgl.resolve(mrs, pd, 0),
            Payload::InlineBorrowed => {
                let mut spans = Spans::new();
                for seg in self.sgl.segs() {
                    spans.push(Span {
                        ptr: seg.addr as *mut u8,
                        len: seg.len as usize,
                    });
                }
                Some(spans)
            }
            Payload::InlineOwned(data) => Some(Spans::one(Span {
                ptr: data.as_ptr().cast_mut(),
                len: data.len(),
            })),
        }
    }

    fn wc_opcode(&self) -> sys::ibv_wc_opcode {
        match self.opcode {
            sys::IBV_WR_RDMA_WRITE | sys::IBV_WR_RDMA_WRITE_WITH_IMM => sys::IBV_WC_RDMA_WRITE,
            sys::IBV_WR_RDMA_READ => sys::IBV_WC_RDMA_READ,
            _ => sys::IBV_WC_SEND,
        }
    }

    fn wc(&self, qpn: u32, status: sys::ibv_wc_status, byte_len: u32) -> sys::ibv_wc {
        sys::ibv_wc {
            wr_id: self.wr_id,
            status,
            opcode: self.wc_opcode(),
            byte_len,
            qp_num: qpn,
            ..Default::default()
        }
    }
}

/// A posted receive.
#[derive(Clone, Copy, Debug)]
struct PostedRecv {
    wr_id: u64,
    sgl: SgList,
}

/// What executing one send request came to.
enum Outcome {
    /// Done; `peer_failed`: the peer went to the error state meanwhile
    /// (its CQ overflowed), so its stalled requests need flushing.
    Done { len: u32, peer_failed: bool },
    /// No receive posted at the peer: the send queue waits.
    Stall,
    /// Failed with `status`; the requester goes to error.
    Fail {
        status: sys::ibv_wc_status,
        peer_failed: bool,
    },
}

impl Outcome {
    fn fail(status: sys::ibv_wc_status) -> Self {
        Self::Fail {
            status,
            peer_failed: false,
        }
    }
}

struct SendQueue {
    /// Requests waiting behind a SEND the peer had no receive for.
    stalled: VecDeque<SendOp>,
}

struct RecvQueue {
    posted: VecDeque<PostedRecv>,
    /// The peer's send queue stalled on this receive queue: the next post
    /// runs it.
    peer_waiting: bool,
}

/// A loopback QP's state, shared with peers that look it up.
struct LbQp {
    qpn: u32,
    pd: u32,
    send_cq: Arc<CqRing>,
    recv_cq: Arc<CqRing>,
    sig_all: bool,
    max_send_wr: usize,
    max_recv_wr: usize,
    max_send_sge: usize,
    max_recv_sge: usize,
    max_inline: u32,
    /// `IBV_QPS_*`; changes to ERR only under the receive-queue lock.
    state: AtomicU32,
    /// `IBV_ACCESS_REMOTE_*` rights peers have on this QP.
    remote_access: AtomicU32,
    peer: OnceLock<Weak<LbQp>>,
    sq: Mutex<SendQueue>,
    rq: Mutex<RecvQueue>,
}

/// A loopback QP: the verbs struct the crate holds, then the shared state.
#[repr(C)]
struct QpObj {
    /// First, so an `*mut ibv_qp` of ours is an `*mut QpObj`.
    qp: sys::ibv_qp,
    lb: Arc<LbQp>,
}

/// The state of a loopback QP.
///
/// # Safety
/// `qp` is a live QP from [`create_qp`], alive for `'a`.
unsafe fn qp_of<'a>(qp: *mut sys::ibv_qp) -> &'a Arc<LbQp> {
    // SAFETY: our QPs are QpObjs with the ibv_qp first (repr(C)); only the
    // `lb` field is borrowed, which nobody writes after creation.
    unsafe { &(*qp.cast::<QpObj>()).lb }
}

/// Creates an RC QP in `pd` on the CQs of `init` and writes the granted
/// capabilities back. Destroy it with [`destroy_qp`].
///
/// # Safety
/// `pd` is a live PD from [`alloc_pd`]; `init.send_cq` and `init.recv_cq`
/// are live CQs from [`create_cq`].
pub(crate) unsafe fn create_qp(
    pd: NonNull<sys::ibv_pd>,
    init: &mut sys::ibv_qp_init_attr,
) -> Result<NonNull<sys::ibv_qp>, c_int> {
    if init.qp_type != sys::IBV_QPT_RC || !init.srq.is_null() {
        return Err(libc::EOPNOTSUPP);
    }
    let cap = &mut init.cap;
    if cap.max_send_wr > MAX_QP_WR
        || cap.max_recv_wr > MAX_QP_WR
        || cap.max_send_sge as usize > MAX_SGE
        || cap.max_recv_sge as usize > MAX_SGE
        || cap.max_inline_data > MAX_INLINE
        || init.send_cq.is_null()
        || init.recv_cq.is_null()
    {
        return Err(libc::EINVAL);
    }
    cap.max_send_wr = cap.max_send_wr.max(1);
    cap.max_recv_wr = cap.max_recv_wr.max(1);
    // SAFETY: the caller vouches for the PD and both CQs.
    let (context, pd_handle, send_cq, recv_cq) = unsafe {
        (
            (*pd.as_ptr()).context,
            (*pd.as_ptr()).handle,
            Arc::clone(ring_of(init.send_cq)),
            Arc::clone(ring_of(init.recv_cq)),
        )
    };
    let mut qps = lock(&QPS);
    let qpn = loop {
        let qpn = NEXT_QPN.fetch_add(1, Ordering::Relaxed) & 0x00ff_ffff;
        // 0 and 1 are the special QPs of InfiniBand.
        if qpn > 1 && qps.get(&qpn).is_none_or(|qp| qp.strong_count() == 0) {
            break qpn;
        }
    };
    let lb = Arc::new(LbQp {
        qpn,
        pd: pd_handle,
        send_cq,
        recv_cq,
        sig_all: init.sq_sig_all != 0,
        max_send_wr: cap.max_send_wr as usize,
        max_recv_wr: cap.max_recv_wr as usize,
        max_send_sge: cap.max_send_sge as usize,
        max_recv_sge: cap.max_recv_sge as usize,
        max_inline: cap.max_inline_data,
        state: AtomicU32::new(sys::IBV_QPS_RESET),
        remote_access: AtomicU32::new(0),
        peer: OnceLock::new(),
        sq: Mutex::new(SendQueue {
            stalled: VecDeque::new(),
        }),
        rq: Mutex::new(RecvQueue {
            posted: VecDeque::with_capacity(cap.max_recv_wr as usize),
            peer_waiting: false,
        }),
    });
    qps.insert(qpn, Arc::downgrade(&lb));
    drop(qps);
    let obj = Box::new(QpObj {
        qp: sys::ibv_qp {
            context,
            pd: pd.as_ptr(),
            send_cq: init.send_cq,
            recv_cq: init.recv_cq,
            handle: next_handle(),
            qp_num: qpn,
            state: sys::IBV_QPS_RESET,
            qp_type: sys::IBV_QPT_RC,
            ..Default::default()
        },
        lb,
    });
    Ok(NonNull::from(Box::leak(obj)).cast())
}

/// Destroys a QP from [`create_qp`]: it goes to the error state first
/// (flushing what it holds), then leaves the registry.
///
/// # Safety
/// `qp` came from [`create_qp`] and is destroyed once; no call on it runs.
pub(crate) unsafe fn destroy_qp(qp: NonNull<sys::ibv_qp>) {
    // SAFETY: a Box<QpObj> from create_qp, released once.
    let obj = unsafe { Box::from_raw(qp.as_ptr().cast::<QpObj>()) };
    obj.lb.enter_error();
    let mut qps = lock(&QPS);
    if qps
        .get(&obj.lb.qpn)
        .is_some_and(|w| ptr::eq(w.as_ptr(), Arc::as_ptr(&obj.lb)))
    {
        qps.remove(&obj.lb.qpn);
    }
}

/// `ibv_modify_qp` for a loopback QP: RESET→INIT, INIT→RTR (finding the
/// peer by `dest_qp_num`), RTR→RTS and any→ERR. Returns an errno.
///
/// # Safety
/// `qp` is a live QP from [`create_qp`].
pub(crate) unsafe fn modify_qp(
    qp: NonNull<sys::ibv_qp>,
    attr: &sys::ibv_qp_attr,
    mask: u32,
) -> c_int {
    // SAFETY: the caller vouches for the QP.
    let lb = unsafe { qp_of(qp.as_ptr()) };
    if mask & sys::IBV_QP_STATE == 0 {
        return 0;
    }
    let current = lb.state();
    let allowed = match attr.qp_state {
        sys::IBV_QPS_INIT => matches!(current, sys::IBV_QPS_RESET | sys::IBV_QPS_INIT),
        sys::IBV_QPS_RTR => current == sys::IBV_QPS_INIT,
        sys::IBV_QPS_RTS => matches!(current, sys::IBV_QPS_RTR | sys::IBV_QPS_RTS),
        sys::IBV_QPS_ERR => true,
        _ => false,
    };
    if !allowed {
        return libc::EINVAL;
    }
    if mask & sys::IBV_QP_ACCESS_FLAGS != 0 {
        lb.remote_access
            .store(attr.qp_access_flags, Ordering::Release);
    }
    match attr.qp_state {
        sys::IBV_QPS_ERR => {
            lb.enter_error();
            0
        }
        sys::IBV_QPS_RTR => {
            if mask & sys::IBV_QP_DEST_QPN == 0 {
                return libc::EINVAL;
            }
            let peer = lock(&QPS).get(&attr.dest_qp_num).cloned();
            let Some(peer) = peer.filter(|qp| qp.strong_count() > 0) else {
                // No loopback QP has that number (a NIC would accept it and
                // time out later; here the mistake shows at once).
                return libc::ENOENT;
            };
            if lb.peer.set(peer).is_err() {
                return libc::EINVAL;
            }
            lb.set_state(sys::IBV_QPS_RTR)
        }
        state => lb.set_state(state),
    }
}

/// The state of a loopback QP (`IBV_QPS_*`).
///
/// # Safety
/// `qp` is a live QP from [`create_qp`].
pub(crate) unsafe fn query_qp_state(qp: NonNull<sys::ibv_qp>) -> sys::ibv_qp_state {
    // SAFETY: the caller vouches for the QP.
    unsafe { qp_of(qp.as_ptr()) }.state()
}

impl LbQp {
    fn state(&self) -> u32 {
        self.state.load(Ordering::Acquire)
    }

    /// A state change other than to ERR, under both locks (so it orders
    /// with posts and deliveries). Returns 0 (or EINVAL if the QP failed
    /// meanwhile).
    fn set_state(&self, state: u32) -> c_int {
        let _sq = lock(&self.sq);
        let _rq = lock(&self.rq);
        if self.state() == sys::IBV_QPS_ERR {
            return libc::EINVAL;
        }
        self.state.store(state, Ordering::Release);
        0
    }

    /// True if the QP takes incoming requests.
    fn accepts(&self) -> bool {
        matches!(self.state(), sys::IBV_QPS_RTR | sys::IBV_QPS_RTS)
    }

    fn peer(&self) -> Option<Arc<LbQp>> {
        self.peer.get().and_then(Weak::upgrade)
    }

    /// True if this QP's peer is `other` (set once, by `modify_qp` to RTR).
    fn is_connected_to(&self, other: &LbQp) -> bool {
        self.peer
            .get()
            .is_some_and(|peer| std::ptr::eq(peer.as_ptr(), other))
    }

    /// Moves to ERR with the receive queue locked, flushing its receives.
    /// True if the QP was not in ERR before.
    fn fail_locked(&self, rq: &mut RecvQueue) -> bool {
        if self.state() == sys::IBV_QPS_ERR {
            return false;
        }
        self.state.store(sys::IBV_QPS_ERR, Ordering::Release);
        rq.peer_waiting = false;
        for recv in rq.posted.drain(..) {
            self.recv_cq.push(flush_recv_wc(recv.wr_id, self.qpn));
        }
        true
    }

    /// Moves to ERR with the send queue locked: receives, then stalled
    /// sends, are flushed. True if the QP was not in ERR before.
    fn fail_sq(&self, sq: &mut SendQueue) -> bool {
        let newly = self.fail_locked(&mut lock(&self.rq));
        for op in sq.stalled.drain(..) {
            self.send_cq
                .push(op.wc(self.qpn, sys::IBV_WC_WR_FLUSH_ERR, 0));
        }
        newly
    }

    /// `ibv_modify_qp(ERR)` and destroy: flushes everything, then lets the
    /// peer find out (its stalled sends to us fail).
    fn enter_error(&self) {
        let newly = self.fail_sq(&mut lock(&self.sq));
        if newly && let Some(peer) = self.peer() {
            peer.progress();
        }
    }

    /// Runs stalled sends until one stalls again (or flushes them, in ERR).
    fn progress(&self) {
        let peer = self.peer();
        let mut kick = false;
        {
            let mut sq = lock(&self.sq);
            if self.state() == sys::IBV_QPS_ERR {
                kick = self.fail_sq(&mut sq);
            }
            while let Some(op) = sq.stalled.front() {
                match self.execute(op, peer.as_deref()) {
                    Outcome::Stall => break,
                    outcome => {
                        let Some(op) = sq.stalled.pop_front() else {
                            break;
                        };
                        kick |= self.complete(&mut sq, &op, outcome);
                    }
                }
            }
        }
        if kick && let Some(peer) = peer {
            peer.progress();
        }
    }

    /// Posts the completion of a request that ran (not stalled); true if
    /// the peer must be kicked afterwards.
    fn complete(&self, sq: &mut SendQueue, op: &SendOp, outcome: Outcome) -> bool {
        match outcome {
            Outcome::Stall => false,
            Outcome::Done { len, peer_failed } => {
                let overflow =
                    op.signaled && !self.send_cq.push(op.wc(self.qpn, sys::IBV_WC_SUCCESS, len));
                let failed = overflow && self.fail_sq(sq);
                failed || peer_failed
            }
            Outcome::Fail {
                status,
                peer_failed,
            } => {
                self.send_cq.push(op.wc(self.qpn, status, 0));
                self.fail_sq(sq) || peer_failed
            }
        }
    }

    /// Runs one request against `peer`.
    fn execute(&self, op: &SendOp, peer: Option<&LbQp>) -> Outcome {
        let Some(peer) = peer else {
            return Outcome::fail(sys::IBV_WC_RETRY_EXC_ERR);
        };
        // A responder takes requests only from the QP it is connected to (a
        // NIC drops the packets of any other, whose requester then runs out
        // of retries): without this, any QP that learned a QP number could
        // reach that QP's receives and memory, and the stalled-send wakeup,
        // which goes to the receiver's own peer only, would be lost.
        if !peer.is_connected_to(self) {
            return Outcome::fail(sys::IBV_WC_RETRY_EXC_ERR);
        }
        match op.opcode {
            sys::IBV_WR_RDMA_WRITE => self.write(op, peer),
            sys::IBV_WR_RDMA_READ => self.read(op, peer),
            _ => self.deliver(op, peer),
        }
    }

    /// RDMA WRITE: our gather list into the peer's memory.
    fn write(&self, op: &SendOp, peer: &LbQp) -> Outcome {
        if !peer.accepts() {
            return Outcome::fail(sys::IBV_WC_RETRY_EXC_ERR);
        }
        let mrs = read_mrs();
        let Some(src) = op.source(&mrs, self.pd) else {
            return Outcome::fail(sys::IBV_WC_LOC_PROT_ERR);
        };
        let Some(dst) = peer.remote_target(&mrs, op, src.total(), sys::IBV_ACCESS_REMOTE_WRITE)
        else {
            return Outcome::fail(sys::IBV_WC_REM_ACCESS_ERR);
        };
        // SAFETY: both sides resolved against the MR table, whose read lock
        // we hold (inline data is the poster's, valid for the call).
        unsafe { copy_spans(&src, &dst) };
        Outcome::Done {
            len: src.total() as u32,
            peer_failed: false,
        }
    }

    /// RDMA READ: the peer's memory into our scatter list.
    fn read(&self, op: &SendOp, peer: &LbQp) -> Outcome {
        if !peer.accepts() {
            return Outcome::fail(sys::IBV_WC_RETRY_EXC_ERR);
        }
        let mrs = read_mrs();
        let Some(dst) = op.sgl.resolve(&mrs, self.pd, sys::IBV_ACCESS_LOCAL_WRITE) else {
            return Outcome::fail(sys::IBV_WC_LOC_PROT_ERR);
        };
        let Some(src) = peer.remote_target(&mrs, op, dst.total(), sys::IBV_ACCESS_REMOTE_READ)
        else {
            return Outcome::fail(sys::IBV_WC_REM_ACCESS_ERR);
        };
        // SAFETY: as in `write`.
        unsafe { copy_spans(&src, &dst) };
        Outcome::Done {
            len: dst.total() as u32,
            peer_failed: false,
        }
    }

    /// The range of our memory a peer's WRITE or READ of `len` bytes names,
    /// if the QP and the MR grant `right`.
    fn remote_target(
        &self,
        mrs: &KeyMap<MrEntry>,
        op: &SendOp,
        len: u64,
        right: u32,
    ) -> Option<Spans> {
        if len == 0 {
            // Zero-length RDMA checks no key (the IB rule).
            return Some(Spans::new());
        }
        if self.remote_access.load(Ordering::Acquire) & right == 0 {
            return None;
        }
        resolve(mrs, op.rkey, op.remote_addr, len, self.pd, right).map(Spans::one)
    }

    /// SEND, SEND_WITH_IMM and WRITE_WITH_IMM: consumes the peer's oldest
    /// receive (or stalls without one).
    fn deliver(&self, op: &SendOp, peer: &LbQp) -> Outcome {
        let mut rq = lock(&peer.rq);
        if !peer.accepts() {
            return Outcome::fail(sys::IBV_WC_RETRY_EXC_ERR);
        }
        let Some(recv) = rq.posted.front().copied() else {
            rq.peer_waiting = true;
            return Outcome::Stall;
        };
        let mrs = read_mrs();
        let Some(src) = op.source(&mrs, self.pd) else {
            return Outcome::fail(sys::IBV_WC_LOC_PROT_ERR);
        };
        let len = src.total();
        let mut wc = sys::ibv_wc {
            wr_id: recv.wr_id,
            status: sys::IBV_WC_SUCCESS,
            opcode: sys::IBV_WC_RECV,
            byte_len: len as u32,
            qp_num: peer.qpn,
            src_qp: self.qpn,
            ..Default::default()
        };
        if op.opcode != sys::IBV_WR_SEND {
            wc.wc_flags = sys::IBV_WC_WITH_IMM;
            wc.__bindgen_anon_1.imm_data = op.imm;
        }
        if op.opcode == sys::IBV_WR_RDMA_WRITE_WITH_IMM {
            let Some(dst) = peer.remote_target(&mrs, op, len, sys::IBV_ACCESS_REMOTE_WRITE) else {
                return Outcome::fail(sys::IBV_WC_REM_ACCESS_ERR);
            };
            // SAFETY: as in `write`.
            unsafe { copy_spans(&src, &dst) };
            wc.opcode = sys::IBV_WC_RECV_RDMA_WITH_IMM;
        } else {
            let dst = recv.sgl.resolve(&mrs, peer.pd, sys::IBV_ACCESS_LOCAL_WRITE);
            let failure = match dst {
                None => Some((sys::IBV_WC_LOC_PROT_ERR, sys::IBV_WC_REM_OP_ERR)),
                Some(dst) if dst.total() < len => {
                    Some((sys::IBV_WC_LOC_LEN_ERR, sys::IBV_WC_REM_INV_REQ_ERR))
                }
                Some(dst) => {
                    // SAFETY: as in `write`.
                    unsafe { copy_spans(&src, &dst) };
                    None
                }
            };
            if let Some((theirs, ours)) = failure {
                drop(mrs);
                rq.posted.pop_front();
                wc.status = theirs;
                peer.recv_cq.push(wc);
                let peer_failed = peer.fail_locked(&mut rq);
                return Outcome::Fail {
                    status: ours,
                    peer_failed,
                };
            }
        }
        drop(mrs);
        rq.posted.pop_front();
        let peer_failed = !peer.recv_cq.push(wc) && peer.fail_locked(&mut rq);
        Outcome::Done {
            len: len as u32,
            peer_failed,
        }
    }

    /// `ibv_post_send`.
    ///
    /// # Safety
    /// `head` starts a NULL-terminated list of valid requests whose SGE
    /// lists (and inline data) are valid for the call; `bad` is writable.
    unsafe fn post_sends(
        &self,
        head: *mut sys::ibv_send_wr,
        bad: *mut *mut sys::ibv_send_wr,
    ) -> c_int {
        let peer = self.peer();
        let mut kick = false;
        let rc = 'post: {
            let mut sq = lock(&self.sq);
            if !matches!(self.state(), sys::IBV_QPS_RTS | sys::IBV_QPS_ERR) {
                // SAFETY: `bad` is writable (the caller).
                unsafe { *bad = head };
                break 'post libc::EINVAL;
            }
            let mut cur = head;
            while !cur.is_null() {
                // SAFETY: a valid request of the caller's list.
                let wr = unsafe { &*cur };
                // SAFETY: as the caller vouches for the list.
                let op = match unsafe { SendOp::from_raw(wr, self) } {
                    Ok(op) => op,
                    Err(errno) => {
                        // SAFETY: `bad` is writable.
                        unsafe { *bad = cur };
                        break 'post errno;
                    }
                };
                if self.state() == sys::IBV_QPS_ERR {
                    self.send_cq
                        .push(op.wc(self.qpn, sys::IBV_WC_WR_FLUSH_ERR, 0));
                } else if !sq.stalled.is_empty() {
                    if sq.stalled.len() >= self.max_send_wr {
                        // SAFETY: `bad` is writable.
                        unsafe { *bad = cur };
                        break 'post libc::ENOMEM;
                    }
                    // SAFETY: still inside the post call.
                    sq.stalled.push_back(unsafe { op.detach() });
                } else {
                    match self.execute(&op, peer.as_deref()) {
                        // SAFETY: still inside the post call.
                        Outcome::Stall => sq.stalled.push_back(unsafe { op.detach() }),
                        outcome => kick |= self.complete(&mut sq, &op, outcome),
                    }
                }
                cur = wr.next;
            }
            0
        };
        if kick && let Some(peer) = peer {
            peer.progress();
        }
        rc
    }

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
        let mut kick = false;
        let rc = 'post: {
            let mut rq = lock(&self.rq);
            if self.state() == sys::IBV_QPS_RESET {
                // SAFETY: `bad` is writable (the caller).
                unsafe { *bad = head };
                break 'post libc::EINVAL;
            }
            let mut cur = head;
            while !cur.is_null() {
                // SAFETY: a valid request of the caller's list.
                let wr = unsafe { &*cur };
                // SAFETY: the caller vouches for its SGE list.
                let sgl = unsafe { SgList::from_raw(wr.sg_list, wr.num_sge, self.max_recv_sge) };
                let Some(sgl) = sgl else {
                    // SAFETY: `bad` is writable.
                    unsafe { *bad = cur };
                    break 'post libc::EINVAL;
                };
                if self.state() == sys::IBV_QPS_ERR {
                    self.recv_cq.push(flush_recv_wc(wr.wr_id, self.qpn));
                } else if rq.posted.len() >= self.max_recv_wr {
                    // SAFETY: `bad` is writable.
                    unsafe { *bad = cur };
                    break 'post libc::ENOMEM;
                } else {
                    rq.posted.push_back(PostedRecv {
                        wr_id: wr.wr_id,
                        sgl,
                    });
                    kick |= std::mem::take(&mut rq.peer_waiting);
                }
                cur = wr.next;
            }
            0
        };
        if kick && let Some(peer) = self.peer() {
            peer.progress();
        }
        rc
    }
}

fn flush_recv_wc(wr_id: u64, qpn: u32) -> sys::ibv_wc {
    sys::ibv_wc {
        wr_id,
        status: sys::IBV_WC_WR_FLUSH_ERR,
        opcode: sys::IBV_WC_RECV,
        qp_num: qpn,
        ..Default::default()
    }
}

unsafe extern "C" fn post_send(
    qp: *mut sys::ibv_qp,
    wr: *mut sys::ibv_send_wr,
    bad: *mut *mut sys::ibv_send_wr,
) -> c_int {
    // SAFETY: libibverbs' contract: `qp` is a live QP of this context (one
    // of ours), `wr` a valid list, `bad` writable.
    unsafe { qp_of(qp).post_sends(wr, bad) }
}

unsafe extern "C" fn post_recv(
    qp: *mut sys::ibv_qp,
    wr: *mut sys::ibv_recv_wr,
    bad: *mut *mut sys::ibv_recv_wr,
) -> c_int {
    // SAFETY: as for post_send.
    unsafe { qp_of(qp).post_recvs(wr, bad) }
}

/// True while a QP numbered `qpn` is registered (tests of teardown).
#[cfg(test)]
fn is_qp_registered(qpn: u32) -> bool {
    lock(&QPS).contains_key(&qpn)
}

/// True while a memory region keyed `key` is registered (tests of teardown).
#[cfg(test)]
fn is_mr_registered(key: u32) -> bool {
    read_mrs().contains_key(&key)
}

#[cfg(test)]
mod tests;
