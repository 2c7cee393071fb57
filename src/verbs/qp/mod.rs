//! Reliable-connected queue pairs: creation and the INIT→RTR→RTS
//! handshake here, posting in [`post`].

use std::any::Any;
use std::fmt;
use std::os::raw::c_int;
use std::ptr::{self, NonNull};
use std::sync::{Arc, Weak};

use crate::error::{Error, Result};
use crate::sys;

use super::cq::{CompletionQueue, CqId, CqInner, CqSource};
use super::device::{Gid, LinkLayer, Mtu};
use super::mw::WindowSlot;
use super::pd::{PdInner, ProtectionDomain};
use super::qp_config::QpConfig;
use super::srq::{SrqAttachment, SrqInner};
use super::{check_ptr, check_rc, loopback};

pub(super) mod post;

/// A provider's `post_send`, read once from its ops table.
pub(super) type PostSendFn = unsafe extern "C" fn(
    *mut sys::ibv_qp,
    *mut sys::ibv_send_wr,
    *mut *mut sys::ibv_send_wr,
) -> c_int;
/// A provider's `post_recv`, read once from its ops table.
pub(super) type PostRecvFn = unsafe extern "C" fn(
    *mut sys::ibv_qp,
    *mut sys::ibv_recv_wr,
    *mut *mut sys::ibv_recv_wr,
) -> c_int;

/// What a peer needs to connect to one of our QPs (exchanged out of band).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpEndpoint {
    /// QP number.
    pub qpn: u32,
    /// First packet sequence number (24 bits).
    pub psn: u32,
    /// The port's GID (needed on RoCE, optional on InfiniBand).
    pub gid: Gid,
    /// The port's LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// The MTU this side can carry; the connection uses the smaller of both.
    pub mtu: Mtu,
}

/// Queue pair state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(missing_docs)]
pub enum QpState {
    Reset,
    Init,
    ReadyToReceive,
    ReadyToSend,
    SendQueueDrain,
    SendQueueError,
    Error,
    Unknown(u32),
}

impl QpState {
    fn from_raw(raw: u32) -> Self {
        match raw {
            sys::IBV_QPS_RESET => Self::Reset,
            sys::IBV_QPS_INIT => Self::Init,
            sys::IBV_QPS_RTR => Self::ReadyToReceive,
            sys::IBV_QPS_RTS => Self::ReadyToSend,
            sys::IBV_QPS_SQD => Self::SendQueueDrain,
            sys::IBV_QPS_SQE => Self::SendQueueError,
            sys::IBV_QPS_ERR => Self::Error,
            other => Self::Unknown(other),
        }
    }
}

/// A reliable-connected queue pair.
///
/// Created in INIT (so receives can be posted before the peer connects);
/// [`connect`](Self::connect) takes it to RTS. Holds its PD and CQs, so they
/// outlive it whatever order handles are dropped in.
///
/// ```no_run
/// use rdma_comm_core::verbs::*;
/// let ctx = Context::open_default(None)?;
/// let pd = ctx.alloc_pd()?;
/// let cq = ctx.create_cq(512, None)?;
/// let mut qp = pd.create_qp(&cq, &cq, &QpConfig::default())?;
/// let mine = qp.endpoint();        // send this to the peer
/// # let theirs = mine;
/// qp.connect(&theirs)?;            // with what the peer sent back
/// # Ok::<(), rdma_comm_core::Error>(())
/// ```
pub struct QueuePair {
    qp: NonNull<sys::ibv_qp>,
    post_send_fn: PostSendFn,
    post_recv_fn: PostRecvFn,
    qpn: u32,
    port: u8,
    gid_index: u32,
    use_grh: bool,
    local: QpEndpoint,
    max_inline_data: u32,
    max_send_wr: u32,
    max_recv_wr: u32,
    config: QpConfig,
    /// Set by the first post: a reactor only takes QPs nothing else has
    /// posted on, so every completion it sees is one of its own requests.
    posted: bool,
    /// Window binds posted (not counted in `posted`: a reactor takes such a
    /// QP and recognises their completions by `BIND_WR_ID`).
    binds: u32,
    /// The windows bound on this QP that may still be allocated: they are
    /// deallocated before the QP is destroyed.
    windows: Vec<Weak<WindowSlot>>,
    // Dropped after the QP is destroyed in Drop: SRQ, CQs, the PD, then
    // what the QP was connected through.
    srq: Option<Arc<SrqInner>>,
    send_cq: Arc<CqInner>,
    recv_cq: Arc<CqInner>,
    pd: Arc<PdInner>,
    /// The rdma_cm id the QP was created on ([`cm::CmId::create_qp`](super::cm::CmId::create_qp)),
    /// kept so that the id is destroyed only after the QP.
    #[cfg_attr(not(feature = "rdma_cm"), allow(dead_code))]
    anchor: Anchor,
}

// SAFETY: libibverbs QPs may be used from any thread, and posting is internally
// synchronised by the provider; the handle is freed only in Drop.
unsafe impl Send for QueuePair {}
// SAFETY: see Send.
unsafe impl Sync for QueuePair {}

impl fmt::Debug for QueuePair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QueuePair")
            .field("device", &self.pd.ctx.name)
            .field("qpn", &self.qpn)
            .field("port", &self.port)
            .field("gid_index", &self.gid_index)
            .finish()
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        // Windows bound to the QP go first (rxe's destroy blocks for long
        // while one is bound); their peers' keys reach nothing from here on.
        for window in self.windows.drain(..) {
            if let Some(window) = window.upgrade() {
                window.revoke();
            }
        }
        // SAFETY: the QP came from ibv_create_qp (or loopback::create_qp, on
        // a loopback context) and is destroyed once, before the CQs and PD
        // it uses (held by the fields below).
        let rc = unsafe { destroy_qp(&self.pd, self.qp) };
        if let Err(err) = check_rc(rc, "ibv_destroy_qp", &self.pd.ctx.name, Some(self.qpn)) {
            log::error!("{err}");
        }
    }
}

/// What a QP keeps alive until after it is destroyed (the connection
/// manager's id it was created on), and can be asked about.
#[derive(Default)]
pub(super) struct Anchor(Option<Arc<dyn Any + Send + Sync>>);

impl Anchor {
    /// Keeps `anchor`.
    #[cfg_attr(not(feature = "rdma_cm"), allow(dead_code))]
    pub(super) fn set(&mut self, anchor: Arc<dyn Any + Send + Sync>) {
        self.0 = Some(anchor);
    }

    /// True if it keeps exactly this object.
    #[cfg_attr(not(feature = "rdma_cm"), allow(dead_code))]
    pub(super) fn is<T: Any + Send + Sync>(&self, anchor: &Arc<T>) -> bool {
        self.0
            .as_ref()
            .is_some_and(|own| std::ptr::addr_eq(Arc::as_ptr(own), Arc::as_ptr(anchor)))
    }
}

impl ProtectionDomain {
    /// Creates an RC queue pair on `send_cq`/`recv_cq` (which may be the same
    /// CQ, or CQs shared with other QPs) and moves it to INIT.
    pub fn create_qp(
        &self,
        send_cq: &impl CqSource,
        recv_cq: &impl CqSource,
        config: &QpConfig,
    ) -> Result<QueuePair> {
        self.create_qp_inner(send_cq, recv_cq, None, config)
    }

    /// Like [`create_qp`](Self::create_qp), but the QP takes its receives
    /// from `srq` (posting receives on the QP itself is then refused).
    pub fn create_qp_with_srq(
        &self,
        send_cq: &impl CqSource,
        recv_cq: &impl CqSource,
        srq: &SrqAttachment,
        config: &QpConfig,
    ) -> Result<QueuePair> {
        self.create_qp_inner(send_cq, recv_cq, Some(srq), config)
    }

    pub(super) fn create_qp_inner(
        &self,
        send_cq: &impl CqSource,
        recv_cq: &impl CqSource,
        srq: Option<&SrqAttachment>,
        config: &QpConfig,
    ) -> Result<QueuePair> {
        config.validate()?;
        let (send_cq, recv_cq) = (send_cq.as_shared(), recv_cq.as_shared());
        // The kernel looks the CQs and the SRQ up by their handles in the
        // PD's context: one of another context fails, or worse, names an
        // unrelated CQ there and the QP's completions go to it.
        let own = self.inner.ctx.ctx;
        if send_cq.inner.ctx.ctx != own
            || recv_cq.inner.ctx.ctx != own
            || srq.is_some_and(|srq| srq.inner.pd.ctx.ctx != own)
        {
            return Err(Error::InvalidArgument(
                "create_qp: the CQs and the SRQ must be on the PD's device context",
            ));
        }
        let ctx = self.context();
        let name = &self.inner.ctx.name;
        let port = match config.port {
            Some(p) => p,
            None => ctx.first_active_port()?,
        };
        let port_attr = ctx.query_port(port)?;
        let gid = match (config.gid_index, port_attr.link_layer) {
            (None, LinkLayer::InfiniBand) => ctx
                .gid_table(port)?
                .into_iter()
                .next()
                .map_or((0, Gid::default()), |e| (e.index, e.gid)),
            (index, _) => ctx.select_gid(port, index).map(|e| (e.index, e.gid))?,
        };

        let mut init_attr = sys::ibv_qp_init_attr {
            send_cq: send_cq.inner.cq.as_ptr(),
            recv_cq: recv_cq.inner.cq.as_ptr(),
            cap: sys::ibv_qp_cap {
                max_send_wr: config.max_send_wr,
                max_recv_wr: config.max_recv_wr,
                max_send_sge: config.max_send_sge,
                max_recv_sge: config.max_recv_sge,
                max_inline_data: config.max_inline_data,
            },
            srq: srq.map_or(ptr::null_mut(), |srq| srq.inner.srq.as_ptr()),
            qp_type: sys::IBV_QPT_RC,
            sq_sig_all: 0,
            ..Default::default()
        };
        // Clamp the READ depths to the device (the verbs fail EINVAL beyond);
        // asked before the QP exists, so a failure leaves nothing to destroy.
        let limits = ctx.query_device()?;
        let qp = if self.inner.ctx.is_loopback() {
            // SAFETY: a loopback PD and, on its context (checked above),
            // loopback CQs and SRQ (if any), all live; init_attr is fully
            // initialised.
            unsafe { loopback::create_qp(self.inner.pd, &mut init_attr) }
                .map_err(|errno| crate::error::verbs_error("ibv_create_qp", errno, name, None))?
        } else {
            // SAFETY: PD and CQs are live (we hold Arcs from here on); init_attr is
            // fully initialised and the provider writes back the granted caps.
            let raw = unsafe { sys::ibv_create_qp(self.inner.pd.as_ptr(), &mut init_attr) };
            check_ptr(raw, "ibv_create_qp", name)?
        };
        // SAFETY: the QP is live.
        let (qpn, post_send_fn, post_recv_fn) = match unsafe { post_fns(qp, name) } {
            Ok(fns) => fns,
            Err(err) => {
                // SAFETY: the QP is live and not yet owned by a QueuePair.
                unsafe { destroy_qp(&self.inner, qp) };
                return Err(err);
            }
        };
        let psn = config.psn.unwrap_or_else(random_psn) & 0x00ff_ffff;
        let local = QpEndpoint {
            qpn,
            psn,
            gid: gid.1,
            lid: port_attr.lid,
            mtu: port_attr.active_mtu,
        };
        let mut config = config.clone();
        config.max_rd_atomic = config
            .max_rd_atomic
            .min(limits.max_qp_rd_atom.max(1))
            .min(limits.max_qp_init_rd_atom.max(1));
        let mut qp = QueuePair {
            qp,
            post_send_fn,
            post_recv_fn,
            qpn,
            port,
            gid_index: gid.0,
            // InfiniBand routes by LID; a GRH is needed only across subnets,
            // which the caller signals by choosing a GID index.
            use_grh: port_attr.link_layer != LinkLayer::InfiniBand || config.gid_index.is_some(),
            local,
            max_inline_data: init_attr.cap.max_inline_data,
            max_send_wr: init_attr.cap.max_send_wr,
            max_recv_wr: init_attr.cap.max_recv_wr,
            config,
            posted: false,
            binds: 0,
            windows: Vec::new(),
            srq: srq.map(|srq| Arc::clone(&srq.inner)),
            send_cq: send_cq.inner,
            recv_cq: recv_cq.inner,
            pd: Arc::clone(&self.inner),
            anchor: Anchor::default(),
        };
        qp.enter_init()?;
        Ok(qp)
    }
}

/// The QP number of freshly created QP `qp` and its provider's post
/// functions, read once from its context's ops table (which never changes)
/// instead of on every post; a provider without them is unsupported.
///
/// # Safety
/// `qp` is a live QP.
pub(super) unsafe fn post_fns(
    qp: NonNull<sys::ibv_qp>,
    device: &Arc<str>,
) -> Result<(u32, PostSendFn, PostRecvFn)> {
    // SAFETY: the QP is live (the caller), and so is its context.
    let (qpn, post_send_fn, post_recv_fn) = unsafe {
        let ops = &(*(*qp.as_ptr()).context).ops;
        ((*qp.as_ptr()).qp_num, ops.post_send, ops.post_recv)
    };
    match (post_send_fn, post_recv_fn) {
        (Some(send), Some(recv)) => Ok((qpn, send, recv)),
        _ => Err(Error::Unsupported {
            verb: "ibv_post_send",
            device: Arc::clone(device),
        }),
    }
}

/// Destroys a QP with the verb of its context's provider.
///
/// # Safety
/// `qp` is a live QP created in `pd` and is destroyed once; nothing uses it
/// afterwards.
pub(super) unsafe fn destroy_qp(pd: &PdInner, qp: NonNull<sys::ibv_qp>) -> c_int {
    if pd.ctx.is_loopback() {
        // SAFETY: from loopback::create_qp (the PD's context is a loopback
        // one), destroyed once (the caller).
        unsafe { loopback::destroy_qp(qp) };
        0
    } else {
        // SAFETY: from ibv_create_qp, destroyed once (the caller).
        unsafe { sys::ibv_destroy_qp(qp.as_ptr()) }
    }
}

/// A random 24-bit PSN, so a restarted peer never matches stale packets.
fn random_psn() -> u32 {
    let mut buf = [0u8; 4];
    // SAFETY: getrandom writes at most buf.len() bytes into buf.
    let n = unsafe { libc::getrandom(buf.as_mut_ptr().cast(), buf.len(), 0) };
    if n != buf.len() as isize {
        // Without entropy, mix the clock and pid: still differs across restarts.
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        return nanos ^ std::process::id().rotate_left(12);
    }
    u32::from_ne_bytes(buf) & 0x00ff_ffff
}

impl QueuePair {
    /// The QP number.
    pub fn qpn(&self) -> u32 {
        self.qpn
    }

    /// The shared receive queue this QP takes its receives from, if any.
    pub fn shared_receive_queue(&self) -> Option<SrqAttachment> {
        self.srq.as_ref().map(|inner| SrqAttachment {
            inner: Arc::clone(inner),
        })
    }

    /// True once anything was posted on this QP (through any handle),
    /// window binds aside (see [`bound_windows`](Self::bound_windows)).
    pub fn has_posted(&self) -> bool {
        self.posted
    }

    /// How many window binds were posted on this QP
    /// ([`bind_window`](Self::bind_window)). Each takes a send-queue entry
    /// until a later signaled request completes, and a CQ entry if it is
    /// signaled or fails; a reactor that takes the QP leaves it that much
    /// less of the send queue (so create a QP that will bind `n` windows
    /// with `max_send_wr` = the reactor's `sq_depth` + `n`).
    pub fn bound_windows(&self) -> u32 {
        self.binds
    }

    /// The PD the QP was created in.
    pub(super) fn pd_inner(&self) -> &Arc<PdInner> {
        &self.pd
    }

    /// The CQ that send completions go to.
    pub fn send_cq_id(&self) -> CqId {
        // SAFETY: the CQ is alive while this QP holds it.
        CqId(unsafe { (*self.send_cq.cq.as_ptr()).handle })
    }

    /// The CQ that receive completions go to.
    pub fn recv_cq_id(&self) -> CqId {
        // SAFETY: as above.
        CqId(unsafe { (*self.recv_cq.cq.as_ptr()).handle })
    }

    /// True if send completions go to `cq` itself. (A [`CqId`] is the
    /// kernel's handle, numbered per device context: a CQ of another
    /// context of the same device can have the same one.)
    pub(crate) fn sends_to(&self, cq: &CompletionQueue) -> bool {
        Arc::ptr_eq(&self.send_cq, &cq.inner)
    }

    /// True if receive completions go to `cq` itself (see [`sends_to`](Self::sends_to)).
    pub(crate) fn receives_to(&self, cq: &CompletionQueue) -> bool {
        Arc::ptr_eq(&self.recv_cq, &cq.inner)
    }

    /// True if the QP was created in `pd` (memory registered elsewhere is
    /// out of its reach).
    pub(crate) fn belongs_to(&self, pd: &ProtectionDomain) -> bool {
        Arc::ptr_eq(&self.pd, &pd.inner)
    }

    /// The port in use.
    pub fn port(&self) -> u8 {
        self.port
    }

    /// The GID index in use.
    pub fn gid_index(&self) -> u32 {
        self.gid_index
    }

    /// What the peer needs to connect to this QP.
    pub fn endpoint(&self) -> QpEndpoint {
        self.local
    }

    /// The inline payload limit the provider granted.
    pub fn max_inline_data(&self) -> u32 {
        self.max_inline_data
    }

    /// The send-queue depth the provider granted.
    pub fn max_send_wr(&self) -> u32 {
        self.max_send_wr
    }

    /// The receive-queue depth the provider granted.
    pub fn max_recv_wr(&self) -> u32 {
        self.max_recv_wr
    }

    /// Keeps `anchor` alive until after the QP is destroyed.
    #[cfg_attr(not(feature = "rdma_cm"), allow(dead_code))]
    pub(super) fn anchor_to(&mut self, anchor: Arc<dyn Any + Send + Sync>) {
        self.anchor.set(anchor);
    }

    /// True if the QP was anchored to exactly this object.
    #[cfg_attr(not(feature = "rdma_cm"), allow(dead_code))]
    pub(super) fn is_anchored_to<T: Any + Send + Sync>(&self, anchor: &Arc<T>) -> bool {
        self.anchor.is(anchor)
    }

    /// How this QP was configured (READ depths clamped to the device).
    #[cfg_attr(not(feature = "rdma_cm"), allow(dead_code))]
    pub(super) fn config(&self) -> &QpConfig {
        &self.config
    }

    /// Applies a state transition whose attributes another party computed
    /// (the connection manager's `rdma_init_qp_attr`), noting the send PSN
    /// it chose in [`endpoint`](Self::endpoint).
    #[cfg_attr(not(feature = "rdma_cm"), allow(dead_code))]
    pub(super) fn modify_with(
        &mut self,
        attr: &mut sys::ibv_qp_attr,
        mask: u32,
        verb: &'static str,
    ) -> Result<()> {
        self.modify(attr, mask, verb)?;
        if mask & sys::IBV_QP_SQ_PSN != 0 {
            self.local.psn = attr.sq_psn & 0x00ff_ffff;
        }
        Ok(())
    }

    fn modify(&self, attr: &mut sys::ibv_qp_attr, mask: u32, verb: &'static str) -> Result<()> {
        let rc = if self.pd.ctx.is_loopback() {
            // SAFETY: a live QP of a loopback context (from loopback::create_qp).
            unsafe { loopback::modify_qp(self.qp, attr, mask) }
        } else {
            // SAFETY: the QP is live and `attr` is initialised for every bit in `mask`.
            unsafe { sys::ibv_modify_qp(self.qp.as_ptr(), attr, mask as c_int) }
        };
        check_rc(rc, verb, &self.pd.ctx.name, Some(self.qpn))
    }

    fn enter_init(&mut self) -> Result<()> {
        let mut attr = sys::ibv_qp_attr {
            qp_state: sys::IBV_QPS_INIT,
            pkey_index: 0,
            port_num: self.port,
            qp_access_flags: self.config.remote_access.bits(),
            ..Default::default()
        };
        let mask = sys::IBV_QP_STATE
            | sys::IBV_QP_PKEY_INDEX
            | sys::IBV_QP_PORT
            | sys::IBV_QP_ACCESS_FLAGS;
        self.modify(&mut attr, mask, "ibv_modify_qp(RESET->INIT)")
    }

    /// Connects to the peer described by `remote`: INIT→RTR→RTS.
    ///
    /// The path MTU is the smaller of ours (the port's active MTU) and theirs.
    pub fn connect(&mut self, remote: &QpEndpoint) -> Result<()> {
        // Checked at creation already; the attributes below take the values raw.
        self.config.validate()?;
        let mtu = remote.mtu.min(self.local.mtu);
        let mut attr = sys::ibv_qp_attr {
            qp_state: sys::IBV_QPS_RTR,
            path_mtu: mtu.to_raw(),
            dest_qp_num: remote.qpn,
            rq_psn: remote.psn & 0x00ff_ffff,
            max_dest_rd_atomic: self.config.max_rd_atomic,
            min_rnr_timer: self.config.min_rnr_timer,
            ..Default::default()
        };
        attr.ah_attr.dlid = remote.lid;
        attr.ah_attr.port_num = self.port;
        if self.use_grh {
            attr.ah_attr.is_global = 1;
            attr.ah_attr.grh.dgid.raw = remote.gid.0;
            attr.ah_attr.grh.sgid_index = self.gid_index as u8;
            attr.ah_attr.grh.hop_limit = 64;
        }
        let mask = sys::IBV_QP_STATE
            | sys::IBV_QP_AV
            | sys::IBV_QP_PATH_MTU
            | sys::IBV_QP_DEST_QPN
            | sys::IBV_QP_RQ_PSN
            | sys::IBV_QP_MAX_DEST_RD_ATOMIC
            | sys::IBV_QP_MIN_RNR_TIMER;
        self.modify(&mut attr, mask, "ibv_modify_qp(INIT->RTR)")?;

        let mut attr = sys::ibv_qp_attr {
            qp_state: sys::IBV_QPS_RTS,
            timeout: self.config.timeout,
            retry_cnt: self.config.retry_cnt,
            rnr_retry: self.config.rnr_retry,
            sq_psn: self.local.psn,
            max_rd_atomic: self.config.max_rd_atomic,
            ..Default::default()
        };
        let mask = sys::IBV_QP_STATE
            | sys::IBV_QP_TIMEOUT
            | sys::IBV_QP_RETRY_CNT
            | sys::IBV_QP_RNR_RETRY
            | sys::IBV_QP_SQ_PSN
            | sys::IBV_QP_MAX_QP_RD_ATOMIC;
        self.modify(&mut attr, mask, "ibv_modify_qp(RTR->RTS)")
    }

    /// Moves the QP to the error state: outstanding work completes with
    /// `IBV_WC_WR_FLUSH_ERR`, which is how a graceful close drains it.
    pub fn set_error(&self) -> Result<()> {
        let mut attr = sys::ibv_qp_attr {
            qp_state: sys::IBV_QPS_ERR,
            ..Default::default()
        };
        self.modify(&mut attr, sys::IBV_QP_STATE, "ibv_modify_qp(->ERR)")
    }

    /// The current state, as the device reports it.
    pub fn state(&self) -> Result<QpState> {
        if self.pd.ctx.is_loopback() {
            // SAFETY: a live QP of a loopback context (from loopback::create_qp).
            return Ok(QpState::from_raw(unsafe {
                loopback::query_qp_state(self.qp)
            }));
        }
        let mut attr = sys::ibv_qp_attr::default();
        let mut init = sys::ibv_qp_init_attr::default();
        // SAFETY: the QP is live and both out-pointers are valid.
        let rc = unsafe {
            sys::ibv_query_qp(
                self.qp.as_ptr(),
                &mut attr,
                sys::IBV_QP_STATE as c_int,
                &mut init,
            )
        };
        check_rc(rc, "ibv_query_qp", &self.pd.ctx.name, Some(self.qpn))?;
        Ok(QpState::from_raw(attr.qp_state))
    }
}
