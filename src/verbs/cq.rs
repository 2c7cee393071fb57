//! Completion queues, completion channels and the work-completion view.

use std::fmt;
use std::os::fd::{AsRawFd, RawFd};
use std::os::raw::{c_int, c_void};
use std::ptr::{self, NonNull};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use super::wc::{WcOpcode, WcStatus};
use crate::error::{Error, Result, os_result};
use crate::sys;

use super::device::{Context, ContextInner};
use super::{check_ptr, check_rc, loopback};

/// Completion events are acknowledged in batches of this many: each ack takes
/// the CQ's mutex in libibverbs, so acking every event would cost a lock per wakeup.
const ACK_BATCH: u32 = 64;

type PollCqFn = unsafe extern "C" fn(*mut sys::ibv_cq, c_int, *mut sys::ibv_wc) -> c_int;
type ReqNotifyFn = unsafe extern "C" fn(*mut sys::ibv_cq, c_int) -> c_int;

pub(crate) struct CqInner {
    pub(crate) cq: NonNull<sys::ibv_cq>,
    /// Where the CQ's `cq_context` points. A separate allocation, so that
    /// a channel owner on another thread reading it through that raw
    /// pointer never aliases the `&mut CqInner` of `Drop`.
    events: Arc<EventCount>,
    // Field order is drop order: the CQ is destroyed (in Drop) before the
    // channel and the context it uses are released.
    _channel: Option<Arc<ChannelInner>>,
    pub(crate) ctx: Arc<ContextInner>,
}

/// Completion events taken from the channel and not yet acknowledged.
struct EventCount {
    unacked: AtomicU32,
    /// Set by `Drop` before it acks what was counted: an event another
    /// thread took from the channel just then is acked by that thread at
    /// once, or `ibv_destroy_cq` (which waits for every delivered event's
    /// ack) would wait for a batch that never fills.
    dropping: AtomicBool,
}

// SAFETY: CQ handles are thread-safe in libibverbs for create/destroy/ack;
// polling goes through `&mut CompletionQueue`, so one thread polls at a time.
unsafe impl Send for CqInner {}
// SAFETY: shared access only reads the handle or updates the atomic counter.
unsafe impl Sync for CqInner {}

impl Drop for CqInner {
    fn drop(&mut self) {
        if self.ctx.is_loopback() {
            // SAFETY: created by loopback::create_cq and destroyed once;
            // every QP using this CQ holds an Arc to it, so none is alive.
            // (Loopback CQs have no channel, so no event is unacked.)
            unsafe { loopback::destroy_cq(self.cq) };
            return;
        }
        self.events.dropping.store(true, Ordering::SeqCst);
        let unacked = self.events.unacked.swap(0, Ordering::SeqCst);
        // SAFETY: every QP using this CQ holds an Arc to it, so none is alive.
        // ibv_destroy_cq waits until all delivered events are acked, so ack
        // first; events counted later are acked by their taker (`dropping`).
        let rc = unsafe {
            if unacked > 0 {
                sys::ibv_ack_cq_events(self.cq.as_ptr(), unacked);
            }
            sys::ibv_destroy_cq(self.cq.as_ptr())
        };
        if let Err(err) = check_rc(rc, "ibv_destroy_cq", &self.ctx.name, None) {
            log::error!("{err}");
        }
    }
}

/// Identifies a CQ in events from a shared [`CompletionChannel`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CqId(pub u32);

/// A completion queue, polled into caller-owned arrays.
///
/// The handle is the only way to poll, and polling takes `&mut self`: one
/// thread owns a CQ, which is why it is created single-threaded where the
/// provider supports that (no provider lock on poll). QPs keep the underlying
/// CQ alive on their own, so dropping this handle early is safe.
///
/// ```no_run
/// use rdma_comm_core::verbs::{Context, WorkCompletion};
/// let ctx = Context::open_default(None)?;
/// let mut cq = ctx.create_cq(256, None)?;
/// let mut wcs = [WorkCompletion::default(); 32];
/// for wc in cq.poll(&mut wcs)? {
///     wc.ok()?; // a failed completion becomes a typed error
///     println!("wr {} done, {} bytes", wc.wr_id(), wc.byte_len());
/// }
/// # Ok::<(), rdma_comm_core::Error>(())
/// ```
pub struct CompletionQueue {
    pub(crate) inner: Arc<CqInner>,
    poll_fn: PollCqFn,
    req_notify_fn: ReqNotifyFn,
    capacity: u32,
}

impl fmt::Debug for CompletionQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompletionQueue")
            .field("id", &self.id())
            .field("capacity", &self.capacity)
            .finish()
    }
}

impl Context {
    /// Creates a CQ with room for at least `min_entries` completions,
    /// optionally reporting to `channel`.
    pub fn create_cq(
        &self,
        min_entries: u32,
        channel: Option<&CompletionChannel>,
    ) -> Result<CompletionQueue> {
        let name = &self.inner.name;
        let channel_ptr = channel.map_or(ptr::null_mut(), |c| c.inner.channel.as_ptr());
        let cqe = c_int::try_from(min_entries)
            .map_err(|_| Error::InvalidArgument("CQ size exceeds i32"))?;
        let cq = if self.inner.is_loopback() {
            if channel.is_some() {
                return Err(loopback::unsupported(
                    "ibv_create_cq with a completion channel",
                    name,
                ));
            }
            loopback::create_cq(self.inner.ctx, min_entries)
                .map_err(|errno| crate::error::verbs_error("ibv_create_cq", errno, name, None))?
        } else {
            self.create_provider_cq(min_entries, cqe, channel_ptr)?
        };

        // SAFETY: `cq` is live; its context's ops table is set by the provider
        // at open time and never changes, so reading it once here is enough.
        let (poll_fn, req_notify_fn, capacity) = unsafe {
            let ops = &(*(*cq.as_ptr()).context).ops;
            (
                ops.poll_cq,
                ops.req_notify_cq,
                (*cq.as_ptr()).cqe.max(0) as u32,
            )
        };
        let inner = Arc::new(CqInner {
            cq,
            events: Arc::new(EventCount {
                unacked: AtomicU32::new(0),
                dropping: AtomicBool::new(false),
            }),
            _channel: channel.map(|c| Arc::clone(&c.inner)),
            ctx: Arc::clone(&self.inner),
        });
        let (Some(poll_fn), Some(req_notify_fn)) = (poll_fn, req_notify_fn) else {
            return Err(Error::Unsupported {
                verb: "ibv_poll_cq",
                device: Arc::clone(name),
            });
        };
        // SAFETY: cq_context is the user's field; it points at the Arc'd
        // event count, which the inner keeps until after ibv_destroy_cq, and
        // that waits until every event delivered for this CQ was acked.
        unsafe { (*cq.as_ptr()).cq_context = Arc::as_ptr(&inner.events) as *mut c_void };
        Ok(CompletionQueue {
            inner,
            poll_fn,
            req_notify_fn,
            capacity,
        })
    }
}

impl Context {
    /// `ibv_create_cq_ex` (single-threaded), or `ibv_create_cq` where the
    /// provider has no extended CQs.
    fn create_provider_cq(
        &self,
        min_entries: u32,
        cqe: c_int,
        channel_ptr: *mut sys::ibv_comp_channel,
    ) -> Result<NonNull<sys::ibv_cq>> {
        let name = &self.inner.name;
        let ctx = self.inner.ctx.as_ptr();
        let mut attr = sys::ibv_cq_init_attr_ex {
            cqe: min_entries,
            channel: channel_ptr,
            wc_flags: u64::from(sys::IBV_WC_STANDARD_FLAGS),
            comp_mask: sys::IBV_CQ_INIT_ATTR_MASK_FLAGS,
            flags: sys::IBV_CREATE_CQ_ATTR_SINGLE_THREADED,
            ..Default::default()
        };
        // SAFETY: the context is open and `attr` is fully initialised.
        let cq_ex = unsafe { sys::ibv_create_cq_ex(ctx, &mut attr) };
        Ok(if cq_ex.is_null() {
            // Providers without extended CQs (or without the single-threaded
            // hint) still support the classic verb.
            // SAFETY: the context is open; channel is NULL or a live channel.
            let raw = unsafe { sys::ibv_create_cq(ctx, cqe, ptr::null_mut(), channel_ptr, 0) };
            check_ptr(raw, "ibv_create_cq", name)?
        } else {
            // SAFETY: cq_ex is a live extended CQ; the conversion is a field access.
            check_ptr(
                unsafe { sys::ibv_cq_ex_to_cq(cq_ex) },
                "ibv_cq_ex_to_cq",
                name,
            )?
        })
    }
}

/// A non-polling reference to a CQ, for creating QPs on it from other threads
/// (a session acceptor, say) while one owner keeps polling.
#[derive(Clone)]
pub struct SharedCq {
    pub(crate) inner: Arc<CqInner>,
}

impl fmt::Debug for SharedCq {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // SAFETY: the CQ is live while any reference to it is.
        f.debug_struct("SharedCq")
            .field("id", &CqId(unsafe { (*self.inner.cq.as_ptr()).handle }))
            .finish()
    }
}

/// Anything a QP can be attached to: the polling handle or a shared reference.
pub trait CqSource: sealed::Sealed {
    /// A shared reference to the CQ.
    fn as_shared(&self) -> SharedCq;
}

impl CqSource for CompletionQueue {
    fn as_shared(&self) -> SharedCq {
        self.shared()
    }
}

impl CqSource for SharedCq {
    fn as_shared(&self) -> SharedCq {
        self.clone()
    }
}

mod sealed {
    /// Only this crate's CQ types can be attached to QPs.
    pub trait Sealed {}
    impl Sealed for super::CompletionQueue {}
    impl Sealed for super::SharedCq {}
}

impl CompletionQueue {
    /// A reference other threads can create QPs on; polling stays with `self`.
    pub fn shared(&self) -> SharedCq {
        SharedCq {
            inner: Arc::clone(&self.inner),
        }
    }

    /// The id events from a shared channel carry for this CQ.
    pub fn id(&self) -> CqId {
        // SAFETY: the CQ is live while `self` is.
        CqId(unsafe { (*self.inner.cq.as_ptr()).handle })
    }

    /// How many completions the CQ can hold (at least what was asked for).
    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// Polls up to `out.len()` completions into `out` and returns the filled
    /// prefix. Never allocates and never blocks; an empty slice means nothing
    /// was ready.
    ///
    /// # Errors
    /// [`Error::CqPoll`] when the provider's poll fails (the CQ overran or
    /// the device failed): the CQ cannot be polled on.
    #[inline]
    pub fn poll<'a>(&mut self, out: &'a mut [WorkCompletion]) -> Result<&'a [WorkCompletion]> {
        let max = out.len().min(c_int::MAX as usize) as c_int;
        // SAFETY: `out` is valid for `max` entries and WorkCompletion is a
        // transparent ibv_wc; the function pointer came from this CQ's context.
        let n = unsafe { (self.poll_fn)(self.inner.cq.as_ptr(), max, out.as_mut_ptr().cast()) };
        // This shape (a `Result<()>` and `?`, the count clamped) keeps the
        // reactor's pass, which inlines it, short: returning the error from
        // here costs the protocol's round trip more (`tools/instr-count --host`).
        if n < 0 {
            poll_failed(n, &self.inner.ctx.name)?;
        }
        Ok(&out[..n.max(0) as usize])
    }

    /// As [`poll`](Self::poll), for a hot loop: how many completions it
    /// wrote to the front of `out`, or, if the poll failed, what
    /// [`poll_error`](Self::poll_error) turns into the error. Both fit in
    /// registers, where `poll`'s `Result` goes through memory. (The
    /// reactor's pass keeps `poll`: there the count measured no better.)
    #[inline]
    pub fn poll_count(
        &mut self,
        out: &mut [WorkCompletion],
    ) -> std::result::Result<usize, PollFailed> {
        let max = out.len().min(c_int::MAX as usize) as c_int;
        // SAFETY: `out` is valid for `max` entries and WorkCompletion is a
        // transparent ibv_wc; the function pointer came from this CQ's context.
        let n = unsafe { (self.poll_fn)(self.inner.cq.as_ptr(), max, out.as_mut_ptr().cast()) };
        if n < 0 {
            return Err(PollFailed(n));
        }
        debug_assert!(n <= max, "the provider wrote past the buffer");
        Ok(n as usize)
    }

    /// The error of a failed [`poll_count`](Self::poll_count):
    /// [`Error::CqPoll`], naming the device, with what the provider
    /// returned.
    #[cold]
    #[inline(never)]
    pub fn poll_error(&self, failed: PollFailed) -> Error {
        cq_poll_error(failed.0, &self.inner.ctx.name)
    }

    /// Arms the CQ: the channel gets an event for the next completion (or the
    /// next solicited one). Poll once more after arming, or a completion that
    /// arrived just before may never wake you.
    pub fn req_notify(&mut self, solicited_only: bool) -> Result<()> {
        // SAFETY: the CQ is live; the function pointer came from its context.
        let rc =
            unsafe { (self.req_notify_fn)(self.inner.cq.as_ptr(), c_int::from(solicited_only)) };
        check_rc(rc, "ibv_req_notify_cq", &self.inner.ctx.name, None)
    }
}

/// The error of [`CompletionQueue::poll`] when its poll returned `code`.
fn poll_failed(code: c_int, device: &Arc<str>) -> Result<()> {
    Err(cq_poll_error(code, device))
}

/// [`Error::CqPoll`] for a poll of `device`'s CQ that returned `code`.
fn cq_poll_error(code: c_int, device: &Arc<str>) -> Error {
    Error::CqPoll {
        device: Arc::clone(device),
        code,
    }
}

pub(crate) struct ChannelInner {
    channel: NonNull<sys::ibv_comp_channel>,
    ctx: Arc<ContextInner>,
}

// SAFETY: completion channels are thread-safe; destroyed only once no CQ (each
// holding an Arc) uses it.
unsafe impl Send for ChannelInner {}
// SAFETY: see Send.
unsafe impl Sync for ChannelInner {}

impl Drop for ChannelInner {
    fn drop(&mut self) {
        // SAFETY: no CQ refers to the channel any more (they hold Arcs to it).
        let rc = unsafe { sys::ibv_destroy_comp_channel(self.channel.as_ptr()) };
        if let Err(err) = check_rc(rc, "ibv_destroy_comp_channel", &self.ctx.name, None) {
            log::error!("{err}");
        }
    }
}

/// A completion event channel: a file descriptor that becomes readable when an
/// armed CQ gets a completion. Use it to block, or hand [`fd`](Self::fd) to epoll.
///
/// ```no_run
/// use rdma_comm_core::verbs::Context;
/// let ctx = Context::open_default(None)?;
/// let channel = ctx.create_comp_channel()?;
/// let mut cq = ctx.create_cq(256, Some(&channel))?;
/// cq.req_notify(false)?;
/// let ready = channel.get_event()?; // blocks
/// assert_eq!(ready, cq.id());
/// # Ok::<(), rdma_comm_core::Error>(())
/// ```
pub struct CompletionChannel {
    inner: Arc<ChannelInner>,
}

impl fmt::Debug for CompletionChannel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompletionChannel")
            .field("fd", &self.fd())
            .finish()
    }
}

impl Context {
    /// Creates a completion channel.
    ///
    /// # Errors
    /// [`Error::Unsupported`] on a [`Context::loopback`] context, which is
    /// polled only.
    pub fn create_comp_channel(&self) -> Result<CompletionChannel> {
        if self.inner.is_loopback() {
            return Err(loopback::unsupported(
                "ibv_create_comp_channel",
                &self.inner.name,
            ));
        }
        // SAFETY: the context is open; the channel is destroyed in ChannelInner::drop.
        let raw = unsafe { sys::ibv_create_comp_channel(self.inner.ctx.as_ptr()) };
        let channel = check_ptr(raw, "ibv_create_comp_channel", &self.inner.name)?;
        Ok(CompletionChannel {
            inner: Arc::new(ChannelInner {
                channel,
                ctx: Arc::clone(&self.inner),
            }),
        })
    }
}

impl CompletionChannel {
    /// The channel's file descriptor (for epoll, mio, tokio's `AsyncFd`, ...).
    pub fn fd(&self) -> RawFd {
        // SAFETY: the channel is live while `self` is.
        unsafe { (*self.inner.channel.as_ptr()).fd }
    }

    /// Makes [`try_get_event`](Self::try_get_event) return immediately when no
    /// event is pending; needed when the fd sits in an edge-driven poller.
    pub fn set_nonblocking(&self, nonblocking: bool) -> Result<()> {
        let fd = self.fd();
        // SAFETY: fcntl on a descriptor we own; no memory is passed.
        let rc = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        let flags = os_result(rc.into(), "fcntl(F_GETFL) on a completion channel")? as c_int;
        let flags = if nonblocking {
            flags | libc::O_NONBLOCK
        } else {
            flags & !libc::O_NONBLOCK
        };
        // SAFETY: as above.
        let rc = unsafe { libc::fcntl(fd, libc::F_SETFL, flags) };
        os_result(rc.into(), "fcntl(F_SETFL) on a completion channel").map(drop)
    }

    /// Blocks until an armed CQ on this channel has an event and returns its id.
    /// The CQ is disarmed again: call `req_notify` before the next wait.
    pub fn get_event(&self) -> Result<CqId> {
        self.try_get_event()?.ok_or_else(|| Error::Os {
            what: "ibv_get_cq_event on a non-blocking channel (use try_get_event)",
            source: std::io::Error::from_raw_os_error(libc::EAGAIN),
        })
    }

    /// Like [`get_event`](Self::get_event), but `Ok(None)` when the channel is
    /// non-blocking and no event is pending.
    pub fn try_get_event(&self) -> Result<Option<CqId>> {
        let mut cq: *mut sys::ibv_cq = ptr::null_mut();
        let mut cq_context: *mut c_void = ptr::null_mut();
        // SAFETY: the channel is live and both out-pointers are valid.
        let rc =
            unsafe { sys::ibv_get_cq_event(self.inner.channel.as_ptr(), &mut cq, &mut cq_context) };
        if rc != 0 {
            let err = std::io::Error::last_os_error();
            return match err.raw_os_error() {
                Some(libc::EAGAIN) => Ok(None),
                Some(libc::EINTR) => Ok(None),
                _ => Err(Error::Os {
                    what: "ibv_get_cq_event",
                    source: err,
                }),
            };
        }
        // SAFETY: the CQ cannot be destroyed while this event is
        // unacknowledged (ibv_destroy_cq waits for the ack), so `cq` and the
        // event count its context points at (set at creation) are alive
        // until we ack below; neither is touched after that.
        let (id, events) = unsafe { (CqId((*cq).handle), &*(cq_context as *const EventCount)) };
        let pending = events.unacked.fetch_add(1, Ordering::SeqCst) + 1;
        if pending >= ACK_BATCH || events.dropping.load(Ordering::SeqCst) {
            let taken = events.unacked.swap(0, Ordering::SeqCst);
            // SAFETY: we ack at most as many events as were delivered.
            unsafe { sys::ibv_ack_cq_events(cq, taken) };
        }
        Ok(Some(id))
    }
}

impl AsRawFd for CompletionChannel {
    fn as_raw_fd(&self) -> RawFd {
        self.fd()
    }
}

/// A failed poll of [`CompletionQueue::poll_count`]: the provider's return
/// code, for [`CompletionQueue::poll_error`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PollFailed(c_int);

/// One work completion: a zero-copy view over `ibv_wc`.
#[repr(transparent)]
#[derive(Clone, Copy, Default)]
pub struct WorkCompletion(sys::ibv_wc);

impl WorkCompletion {
    /// The id the poster gave the work request.
    #[inline]
    pub fn wr_id(&self) -> u64 {
        self.0.wr_id
    }

    /// Completion status.
    #[inline]
    pub fn status(&self) -> WcStatus {
        WcStatus(self.0.status)
    }

    /// True when the work request succeeded.
    #[inline]
    pub fn is_success(&self) -> bool {
        self.0.status == sys::IBV_WC_SUCCESS
    }

    /// `Ok(self)` on success, else a typed [`Error::Completion`].
    #[inline]
    pub fn ok(&self) -> Result<&Self> {
        if self.is_success() {
            Ok(self)
        } else {
            Err(Error::Completion {
                status: self.status(),
                opcode: self.opcode(),
                qpn: self.qp_num(),
                wr_id: self.wr_id(),
                vendor_err: self.0.vendor_err,
                peer: None,
            })
        }
    }

    /// The operation. Only meaningful on success (failed completions may carry
    /// garbage here, per the verbs spec).
    #[inline]
    pub fn opcode(&self) -> WcOpcode {
        WcOpcode(self.0.opcode)
    }

    /// Bytes received (RECV and RECV_RDMA_WITH_IMM) or read.
    #[inline]
    pub fn byte_len(&self) -> u32 {
        self.0.byte_len
    }

    /// The immediate value (host byte order), if the sender attached one.
    #[inline]
    pub fn imm(&self) -> Option<u32> {
        // SAFETY: imm_data is the active union member when WITH_IMM is set.
        (self.0.wc_flags & sys::IBV_WC_WITH_IMM != 0)
            .then(|| u32::from_be(unsafe { self.0.__bindgen_anon_1.imm_data }))
    }

    /// The local QP number the completion belongs to.
    #[inline]
    pub fn qp_num(&self) -> u32 {
        self.0.qp_num
    }

    /// Provider-specific error detail.
    pub fn vendor_err(&self) -> u32 {
        self.0.vendor_err
    }

    /// The sending QP's number, for a receive on a UD QP.
    #[inline]
    pub fn src_qp(&self) -> u32 {
        self.0.src_qp
    }

    /// Whether the receive buffer starts with a valid GRH (UD receives:
    /// always on RoCE, on InfiniBand when the sender routed globally).
    #[inline]
    pub fn has_grh(&self) -> bool {
        self.0.wc_flags & sys::IBV_WC_GRH != 0
    }

    /// The verbs completion itself, for verbs that take one.
    pub(crate) fn raw(&self) -> &sys::ibv_wc {
        &self.0
    }
}

impl fmt::Debug for WorkCompletion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WorkCompletion")
            .field("wr_id", &self.wr_id())
            .field("status", &self.status())
            .field("opcode", &self.opcode())
            .field("byte_len", &self.byte_len())
            .field("imm", &self.imm())
            .field("qp_num", &self.qp_num())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{align_of, size_of};

    #[test]
    fn work_completion_is_a_transparent_ibv_wc() {
        assert_eq!(size_of::<WorkCompletion>(), size_of::<sys::ibv_wc>());
        assert_eq!(align_of::<WorkCompletion>(), align_of::<sys::ibv_wc>());
        // The layout every provider writes (rdma-core's struct ibv_wc).
        assert_eq!(size_of::<sys::ibv_wc>(), 48);
        assert_eq!(std::mem::offset_of!(sys::ibv_wc, wr_id), 0);
        assert_eq!(std::mem::offset_of!(sys::ibv_wc, status), 8);
        assert_eq!(std::mem::offset_of!(sys::ibv_wc, byte_len), 20);
        assert_eq!(std::mem::offset_of!(sys::ibv_wc, qp_num), 28);
        assert_eq!(std::mem::offset_of!(sys::ibv_wc, wc_flags), 36);
    }

    /// The completion codes the error module names by value are rdma-core's.
    #[test]
    fn completion_codes_match_the_bindings() {
        let statuses = [
            (WcStatus::SUCCESS, sys::IBV_WC_SUCCESS),
            (WcStatus::LOC_LEN_ERR, sys::IBV_WC_LOC_LEN_ERR),
            (WcStatus::LOC_QP_OP_ERR, sys::IBV_WC_LOC_QP_OP_ERR),
            (WcStatus::LOC_EEC_OP_ERR, sys::IBV_WC_LOC_EEC_OP_ERR),
            (WcStatus::LOC_PROT_ERR, sys::IBV_WC_LOC_PROT_ERR),
            (WcStatus::WR_FLUSH_ERR, sys::IBV_WC_WR_FLUSH_ERR),
            (WcStatus::MW_BIND_ERR, sys::IBV_WC_MW_BIND_ERR),
            (WcStatus::BAD_RESP_ERR, sys::IBV_WC_BAD_RESP_ERR),
            (WcStatus::LOC_ACCESS_ERR, sys::IBV_WC_LOC_ACCESS_ERR),
            (WcStatus::REM_INV_REQ_ERR, sys::IBV_WC_REM_INV_REQ_ERR),
            (WcStatus::REM_ACCESS_ERR, sys::IBV_WC_REM_ACCESS_ERR),
            (WcStatus::REM_OP_ERR, sys::IBV_WC_REM_OP_ERR),
            (WcStatus::RETRY_EXC_ERR, sys::IBV_WC_RETRY_EXC_ERR),
            (WcStatus::RNR_RETRY_EXC_ERR, sys::IBV_WC_RNR_RETRY_EXC_ERR),
            (WcStatus::LOC_RDD_VIOL_ERR, sys::IBV_WC_LOC_RDD_VIOL_ERR),
            (WcStatus::REM_INV_RD_REQ_ERR, sys::IBV_WC_REM_INV_RD_REQ_ERR),
            (WcStatus::REM_ABORT_ERR, sys::IBV_WC_REM_ABORT_ERR),
            (WcStatus::INV_EECN_ERR, sys::IBV_WC_INV_EECN_ERR),
            (WcStatus::INV_EEC_STATE_ERR, sys::IBV_WC_INV_EEC_STATE_ERR),
            (WcStatus::FATAL_ERR, sys::IBV_WC_FATAL_ERR),
            (WcStatus::RESP_TIMEOUT_ERR, sys::IBV_WC_RESP_TIMEOUT_ERR),
            (WcStatus::GENERAL_ERR, sys::IBV_WC_GENERAL_ERR),
        ];
        for (ours, theirs) in statuses {
            assert_eq!(ours.0, theirs, "{ours:?}");
        }
        let opcodes = [
            (WcOpcode::SEND, sys::IBV_WC_SEND),
            (WcOpcode::RDMA_WRITE, sys::IBV_WC_RDMA_WRITE),
            (WcOpcode::RDMA_READ, sys::IBV_WC_RDMA_READ),
            (WcOpcode::COMP_SWAP, sys::IBV_WC_COMP_SWAP),
            (WcOpcode::FETCH_ADD, sys::IBV_WC_FETCH_ADD),
            (WcOpcode::BIND_MW, sys::IBV_WC_BIND_MW),
            (WcOpcode::LOCAL_INV, sys::IBV_WC_LOCAL_INV),
            (WcOpcode::RECV, sys::IBV_WC_RECV),
            (WcOpcode::RECV_RDMA_WITH_IMM, sys::IBV_WC_RECV_RDMA_WITH_IMM),
        ];
        for (ours, theirs) in opcodes {
            assert_eq!(ours.0, theirs, "{ours:?}");
        }
    }

    #[test]
    fn statuses_have_verbs_names() {
        assert_eq!(WcStatus::REM_ACCESS_ERR.name(), "IBV_WC_REM_ACCESS_ERR");
        assert_eq!(WcStatus(sys::IBV_WC_SUCCESS).to_string(), "IBV_WC_SUCCESS");
        assert_eq!(
            WcOpcode::RECV_RDMA_WITH_IMM.name(),
            "IBV_WC_RECV_RDMA_WITH_IMM"
        );
        assert_eq!(WcStatus(999).name(), "IBV_WC_(unknown)");
    }

    #[test]
    fn failed_completion_becomes_typed_error() {
        let mut raw = sys::ibv_wc {
            wr_id: 42,
            status: sys::IBV_WC_REM_ACCESS_ERR,
            qp_num: 17,
            ..Default::default()
        };
        raw.opcode = sys::IBV_WC_RDMA_WRITE;
        let wc = WorkCompletion(raw);
        let err = wc.ok().unwrap_err();
        assert_eq!(err.completion_status(), Some(WcStatus::REM_ACCESS_ERR));
        let text = err.to_string();
        assert!(
            text.contains("IBV_WC_REM_ACCESS_ERR")
                && text.contains("QP 17")
                && text.contains("0x2a"),
            "{text}"
        );
    }
}
