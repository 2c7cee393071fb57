//! Unreliable datagrams: UD queue pairs, the destinations they send to (an
//! address handle with the remote QP number and Q_Key) and multicast groups.
//!
//! A UD QP needs no peer to connect to: it is ready to send and receive
//! once created. Each receive buffer starts with the [`GRH_BYTES`] of the
//! global routing header the device writes before the payload, so a
//! receive posted on a UD QP must be at least that long (shorter ones are
//! refused at post). Anyone on the fabric who knows a UD QP's number and
//! Q_Key, or a multicast group it joined, can send to it: a datagram's
//! source ([`WorkCompletion::src_qp`], and the GRH) is all a receiver knows
//! of who sent it, and it is whatever the sender wrote.

use std::any::Any;
use std::fmt;
use std::marker::PhantomData;
use std::os::raw::c_int;
use std::ptr::{self, NonNull};
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::sys;

use super::cq::{CqInner, CqSource, WorkCompletion};
use super::device::{Gid, LinkLayer};
use super::mr::LocalSlice;
use super::pd::{PdInner, ProtectionDomain};
use super::qp::{Anchor, PostRecvFn, PostSendFn, destroy_qp, post, post_fns};
use super::recv_slots::RecvSlots;
use super::requests::sealed::{Request, Seal};
use super::requests::{self, RecvRequests};
use super::wc::WcOpcode;
use super::{check_ptr, check_rc};

mod batch;
mod destination;
mod multicast;
pub(crate) use batch::UdSendList;
use destination::AddressHandle;
pub use destination::UdDestination;
use multicast::Membership;

/// Bytes of the global routing header at the start of every UD receive
/// buffer (on RoCE v2 over IPv4, the IPv4 header in its last 20).
pub const GRH_BYTES: usize = 40;

const _: () = assert!(std::mem::size_of::<sys::ibv_grh>() == GRH_BYTES);

/// The Q_Key rdma-core's UD tools (`udaddy`, `mckey`) and librdmacm use.
pub const RDMA_UDP_QKEY: u32 = 0x0123_4567;

/// The QP number a datagram to a multicast group is addressed to.
pub(super) const MULTICAST_QPN: u32 = 0x00ff_ffff;

/// Q_Keys with the top bit set are privileged (controlled by the kernel).
const CONTROLLED_QKEY: u32 = 0x8000_0000;

/// How to create a UD QP.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UdConfig {
    /// Send queue depth (default 256).
    pub max_send_wr: u32,
    /// Receive queue depth (default 256).
    pub max_recv_wr: u32,
    /// Largest payload to send inline (default 64).
    pub max_inline_data: u32,
    /// The Q_Key a datagram must carry to be taken (and the one this QP's
    /// datagrams to a group carry). Not one of the privileged ones (top bit
    /// set). Default: [`RDMA_UDP_QKEY`], rdma-core's.
    pub qkey: u32,
    /// The port (default: the first active one).
    pub port: Option<u8>,
    /// The GID to send from (default: as [`Context::select_gid`](super::Context::select_gid) picks).
    pub gid_index: Option<u32>,
}

impl Default for UdConfig {
    fn default() -> Self {
        Self {
            max_send_wr: 256,
            max_recv_wr: 256,
            max_inline_data: 64,
            qkey: RDMA_UDP_QKEY,
            port: None,
            gid_index: None,
        }
    }
}

impl UdConfig {
    fn validate(&self) -> Result<()> {
        if self.qkey & CONTROLLED_QKEY != 0 {
            return Err(Error::InvalidArgument(
                "UdConfig::qkey: a Q_Key with the top bit set is privileged",
            ));
        }
        if self.max_send_wr == 0 || self.max_recv_wr == 0 {
            return Err(Error::InvalidArgument(
                "UdConfig: max_send_wr and max_recv_wr must be at least 1",
            ));
        }
        Ok(())
    }
}

/// What a sender needs to reach a UD QP (exchanged out of band).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UdEndpoint {
    /// QP number.
    pub qpn: u32,
    /// The Q_Key its datagrams must carry.
    pub qkey: u32,
    /// The port's GID.
    pub gid: Gid,
    /// The port's LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
}

/// An unreliable-datagram queue pair, ready to send and receive.
///
/// Holds its PD and CQs, so they outlive it. Dropping it leaves the
/// multicast groups it joined, then destroys it.
///
/// ```no_run
/// use rdma_comm_core::verbs::*;
/// let ctx = Context::open_default(None)?;
/// let pd = ctx.alloc_pd()?;
/// let cq = ctx.create_cq(512, None)?;
/// let mut qp = pd.create_ud_qp(&cq, &cq, &UdConfig::default())?;
/// let buf = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE)?;
/// // Room for the GRH and a payload of up to 1024 bytes.
/// qp.post_recv(&mut RecvRequest::new(1, buf.slice(0, GRH_BYTES + 1024)?)?)?;
/// let peer = qp.endpoint(); // what another QP would be given
/// let to_peer = qp.destination(&peer)?;
/// qp.post_send(&mut UdSend::new(2, buf.slice(2048, 8)?, &to_peer).signaled())?;
/// # Ok::<(), rdma_comm_core::Error>(())
/// ```
pub struct UdQueuePair {
    qp: NonNull<sys::ibv_qp>,
    post_send_fn: PostSendFn,
    post_recv_fn: PostRecvFn,
    port: u8,
    gid_index: u32,
    local: UdEndpoint,
    max_inline_data: u32,
    /// The port's MTU: the largest datagram.
    mtu: u32,
    /// The address handle of each send-queue entry's last send, kept until
    /// that entry is reused (by then the send is done): a provider may look
    /// the address up only when it transmits. One per entry the device
    /// granted, filled as sends are posted.
    in_flight: Vec<Option<Arc<AddressHandle>>>,
    /// Sends posted, modulo the entries: the next one's place in `in_flight`.
    next_entry: usize,
    link_layer: LinkLayer,
    /// The multicast groups joined, each under the GID of its address and
    /// with what holds this host's membership of it; left before the QP
    /// is destroyed.
    groups: Vec<(Gid, Membership)>,
    /// The rdma_cm id the QP was created on ([`cm::CmId::create_ud_qp`](super::cm::CmId::create_ud_qp)),
    /// kept so that the id is destroyed only after the QP.
    #[cfg_attr(not(feature = "rdma_cm"), allow(dead_code))]
    anchor: Anchor,
    // Held so that the CQs and the PD outlive the QP: dropped after it is
    // destroyed in Drop.
    _send_cq: Arc<CqInner>,
    _recv_cq: Arc<CqInner>,
    pd: Arc<PdInner>,
}

// SAFETY: libibverbs QPs may be used from any thread, and posting is
// internally synchronised by the provider; the handle is freed only in Drop.
unsafe impl Send for UdQueuePair {}
// SAFETY: see Send.
unsafe impl Sync for UdQueuePair {}

impl fmt::Debug for UdQueuePair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UdQueuePair")
            .field("device", &self.pd.ctx.name)
            .field("qpn", &self.local.qpn)
            .field("port", &self.port)
            .field("groups", &self.groups.len())
            .finish()
    }
}

impl Drop for UdQueuePair {
    fn drop(&mut self) {
        for (group, membership) in std::mem::take(&mut self.groups) {
            if let Some((gid, lid)) = membership.attachment(group)
                && let Err(err) = self.detach(&gid, lid)
            {
                log::warn!("{err}");
            }
            drop(membership);
        }
        // SAFETY: the QP came from ibv_create_qp on `pd` and is destroyed
        // once, before the CQs and PD it uses (held by the fields).
        let rc = unsafe { destroy_qp(&self.pd, self.qp) };
        if let Err(err) = check_rc(
            rc,
            "ibv_destroy_qp",
            &self.pd.ctx.name,
            Some(self.local.qpn),
        ) {
            log::error!("{err}");
        }
    }
}

impl ProtectionDomain {
    /// Creates a UD queue pair on `send_cq`/`recv_cq` and takes it to RTS.
    /// Not on the loopback device ([`Error::Unsupported`]).
    pub fn create_ud_qp(
        &self,
        send_cq: &impl CqSource,
        recv_cq: &impl CqSource,
        config: &UdConfig,
    ) -> Result<UdQueuePair> {
        config.validate()?;
        let name = &self.inner.ctx.name;
        if self.inner.ctx.is_loopback() {
            return Err(Error::Unsupported {
                verb: "ibv_create_qp(IBV_QPT_UD)",
                device: Arc::clone(name),
            });
        }
        let (send_cq, recv_cq) = (send_cq.as_shared(), recv_cq.as_shared());
        let own = self.inner.ctx.ctx;
        if send_cq.inner.ctx.ctx != own || recv_cq.inner.ctx.ctx != own {
            return Err(Error::InvalidArgument(
                "create_ud_qp: the CQs must be on the PD's device context",
            ));
        }
        let ctx = self.context();
        let port = match config.port {
            Some(port) => port,
            None => ctx.first_active_port()?,
        };
        let port_attr = ctx.query_port(port)?;
        let gid = ctx.select_gid(port, config.gid_index)?;
        let mut init_attr = sys::ibv_qp_init_attr {
            send_cq: send_cq.inner.cq.as_ptr(),
            recv_cq: recv_cq.inner.cq.as_ptr(),
            cap: sys::ibv_qp_cap {
                max_send_wr: config.max_send_wr,
                max_recv_wr: config.max_recv_wr,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: config.max_inline_data,
            },
            qp_type: sys::IBV_QPT_UD,
            sq_sig_all: 0,
            ..Default::default()
        };
        // SAFETY: PD and CQs are live (held from here on); init_attr is fully
        // initialised and the provider writes back the granted caps.
        let raw = unsafe { sys::ibv_create_qp(self.inner.pd.as_ptr(), &mut init_attr) };
        let qp = check_ptr(raw, "ibv_create_qp(IBV_QPT_UD)", name)?;
        // SAFETY: the QP is live.
        let (qpn, post_send_fn, post_recv_fn) = match unsafe { post_fns(qp, name) } {
            Ok(fns) => fns,
            Err(err) => {
                // SAFETY: the QP is live and not yet owned by a UdQueuePair.
                unsafe { destroy_qp(&self.inner, qp) };
                return Err(err);
            }
        };
        let qp = UdQueuePair {
            qp,
            post_send_fn,
            post_recv_fn,
            port,
            gid_index: gid.index,
            local: UdEndpoint {
                qpn,
                qkey: config.qkey,
                gid: gid.gid,
                lid: port_attr.lid,
            },
            max_inline_data: init_attr.cap.max_inline_data,
            mtu: port_attr.active_mtu.bytes(),
            in_flight: vec![None; init_attr.cap.max_send_wr.max(1) as usize],
            next_entry: 0,
            link_layer: port_attr.link_layer,
            groups: Vec::new(),
            anchor: Anchor::default(),
            _send_cq: send_cq.inner,
            _recv_cq: recv_cq.inner,
            pd: Arc::clone(&self.inner),
        };
        qp.make_ready()?;
        Ok(qp)
    }
}

impl UdQueuePair {
    /// The QP number.
    pub fn qpn(&self) -> u32 {
        self.local.qpn
    }

    /// What a sender needs to reach this QP.
    pub fn endpoint(&self) -> UdEndpoint {
        self.local
    }

    /// The largest payload [`UdSend::inline`] may carry on this QP.
    pub fn max_inline_data(&self) -> u32 {
        self.max_inline_data
    }

    /// The port the QP sends and receives on.
    pub fn port(&self) -> u8 {
        self.port
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

    fn modify(&self, attr: &mut sys::ibv_qp_attr, mask: u32, verb: &'static str) -> Result<()> {
        // SAFETY: the QP is live and `attr` is initialised for every bit in `mask`.
        let rc = unsafe { sys::ibv_modify_qp(self.qp.as_ptr(), attr, mask as c_int) };
        check_rc(rc, verb, &self.pd.ctx.name, Some(self.local.qpn))
    }

    /// RESET→INIT→RTR→RTS: a UD QP has no peer, so it is ready at once.
    fn make_ready(&self) -> Result<()> {
        let mut attr = sys::ibv_qp_attr {
            qp_state: sys::IBV_QPS_INIT,
            pkey_index: 0,
            port_num: self.port,
            qkey: self.local.qkey,
            ..Default::default()
        };
        let mask = sys::IBV_QP_STATE | sys::IBV_QP_PKEY_INDEX | sys::IBV_QP_PORT | sys::IBV_QP_QKEY;
        self.modify(&mut attr, mask, "ibv_modify_qp(RESET->INIT)")?;
        let mut attr = sys::ibv_qp_attr {
            qp_state: sys::IBV_QPS_RTR,
            ..Default::default()
        };
        self.modify(&mut attr, sys::IBV_QP_STATE, "ibv_modify_qp(INIT->RTR)")?;
        let mut attr = sys::ibv_qp_attr {
            qp_state: sys::IBV_QPS_RTS,
            sq_psn: 0,
            ..Default::default()
        };
        self.modify(
            &mut attr,
            sys::IBV_QP_STATE | sys::IBV_QP_SQ_PSN,
            "ibv_modify_qp(RTR->RTS)",
        )
    }

    /// The largest datagram this QP sends: its port's MTU.
    pub fn max_datagram(&self) -> u32 {
        self.mtu
    }

    /// Posts one datagram. Refused: a destination made on another PD, a
    /// datagram larger than the port's MTU ([`max_datagram`](Self::max_datagram)),
    /// an inline one larger than [`max_inline_data`](Self::max_inline_data).
    pub fn post_send(&mut self, request: &mut UdSend<'_>) -> Result<()> {
        self.check_destination(request.to)?;
        if request.sge.length > self.mtu {
            return Err(Error::InvalidArgument(
                "a datagram larger than the port's MTU (UdQueuePair::max_datagram)",
            ));
        }
        if request.wr.send_flags & sys::IBV_SEND_INLINE != 0
            && request.sge.length > self.max_inline_data
        {
            return Err(Error::InlineTooLarge {
                len: request.sge.length as usize,
                max: self.max_inline_data,
            });
        }
        request.wr.sg_list = &raw mut request.sge;
        request.wr.next = ptr::null_mut();
        let mut bad: *mut sys::ibv_send_wr = ptr::null_mut();
        // SAFETY: one request whose SGE is beside it, and whose address
        // handle (of this QP's PD, checked above) the request borrows, both
        // alive for the call; the handle is kept below until the send is done.
        let rc = unsafe { (self.post_send_fn)(self.qp.as_ptr(), &mut request.wr, &mut bad) };
        // One request: a refusal posted none of it.
        self.post_error("ibv_post_send", rc, 0)?;
        // This entry's previous send was done before the queue took this one
        // in its place: its handle may go.
        self.in_flight[self.next_entry] = Some(Arc::clone(&request.to.handle));
        self.next_entry = (self.next_entry + 1) % self.in_flight.len();
        Ok(())
    }

    /// Posts receives, each at least [`GRH_BYTES`] long (the GRH comes
    /// first, then the payload); a shorter one refuses the whole post.
    pub fn post_recv<R: RecvRequests>(&mut self, requests: &mut R) -> Result<()> {
        let requests = requests.requests_mut(Seal::new());
        if requests.is_empty() {
            return Ok(());
        }
        if requests
            .iter()
            .any(|request| (request.local_sge().1 as usize) < GRH_BYTES)
        {
            return Err(no_room_for_the_grh());
        }
        let len = requests.len();
        let head = requests::link(requests);
        // SAFETY: `link` made a NULL-terminated list of `len` requests, each
        // pointing at its own SGE, inside `requests`, borrowed for the call.
        unsafe { self.post_recv_raw(head, len) }
    }

    /// Posts the receives of `slots` (indices into `recvs`) with one
    /// `ibv_post_recv`, linking their prebuilt requests. A slot out of
    /// `recvs` refuses the whole post.
    ///
    /// # Safety
    ///
    /// The memory `recvs` describes is registered on this QP's PD and stays
    /// so until every receive posted into it completed or the QP is
    /// destroyed; no slot in `slots` is posted already (on any QP), and
    /// none is accessed by the CPU while posted; `slots` names each slot
    /// once.
    pub(crate) unsafe fn post_slots(&mut self, recvs: &mut RecvSlots, slots: &[u32]) -> Result<()> {
        if (recvs.slot_size() as usize) < GRH_BYTES {
            return Err(no_room_for_the_grh());
        }
        recvs.post_with(slots, |head, len| {
            // SAFETY: a NULL-terminated list of `len` distinct requests of
            // `recvs`, each with its SGE, over memory the caller keeps
            // registered and unread while posted (this function's
            // contract).
            unsafe { self.post_recv_raw(head, len) }
        })
    }

    /// Whether this QP may send to `to`: a destination of the QP's PD.
    /// (The caller keeps each datagram within [`max_datagram`](Self::max_datagram).)
    #[inline]
    pub(crate) fn check_destination(&self, to: &UdDestination) -> Result<()> {
        if !Arc::ptr_eq(&to.handle.pd, &self.pd) {
            return Err(Error::ForeignHandle(
                "a UdDestination of another protection domain than the QP's",
            ));
        }
        Ok(())
    }

    /// Posts every datagram of `list` with one `ibv_post_send` and empties
    /// it, also when the post fails. Each posted datagram's address handle
    /// is kept with its send-queue entry until the entry is reused.
    pub(crate) fn post_list<const N: usize>(&mut self, list: &mut UdSendList<N>) -> Result<()> {
        let post_send = self.post_send_fn;
        let qp = self.qp.as_ptr();
        let posted = list.post_with(|head, len, handles| {
            let mut bad: *mut sys::ibv_send_wr = ptr::null_mut();
            // SAFETY: a NULL-terminated list of `len` requests of this QP's
            // kind, each with at most one SGE (valid memory, as
            // `UdSendList::push` requires) and an address handle of the
            // QP's PD (`check_destination`, also a requirement of `push`)
            // that `handles` holds for the call.
            let rc = unsafe { post_send(qp, head, &mut bad) };
            let posted = if rc == 0 {
                len
            } else {
                // SAFETY: the list just posted, still cut at `len`.
                unsafe { super::list::count_before(head, bad, len) }
            };
            // Each posted datagram's handle stays with its send-queue entry.
            for handle in &handles[..posted] {
                // The entry's previous send was done before the queue took
                // this one in its place: its handle may go.
                let entry = &mut self.in_flight[self.next_entry];
                if !entry
                    .as_ref()
                    .zip(handle.as_ref())
                    .is_some_and(|(a, b)| Arc::ptr_eq(a, b))
                {
                    entry.clone_from(handle);
                }
                self.next_entry += 1;
                if self.next_entry == self.in_flight.len() {
                    self.next_entry = 0;
                }
            }
            (rc, posted)
        });
        let Some((rc, posted)) = posted else {
            return Ok(());
        };
        self.post_error("ibv_post_send", rc, posted)
    }

    /// Posts the NULL-terminated list of `len` receives that starts at
    /// `head` with one `ibv_post_recv`; a refusal says how many it took.
    ///
    /// # Safety
    ///
    /// `head` starts a NULL-terminated list of `len` valid requests, each
    /// with its SGE, over memory registered on this QP's PD that stays so,
    /// and unread by the CPU, while posted.
    unsafe fn post_recv_raw(&mut self, head: *mut sys::ibv_recv_wr, len: usize) -> Result<()> {
        let mut bad: *mut sys::ibv_recv_wr = ptr::null_mut();
        // SAFETY: this function's contract.
        let rc = unsafe { (self.post_recv_fn)(self.qp.as_ptr(), head, &mut bad) };
        if rc == 0 {
            return Ok(());
        }
        // SAFETY: the list just posted, valid by this function's contract.
        let posted = unsafe { super::list::count_before(head, bad, len) };
        self.post_error("ibv_post_recv", rc, posted)
    }

    fn post_error(&self, verb: &'static str, rc: c_int, posted: usize) -> Result<()> {
        if rc == 0 {
            return Ok(());
        }
        Err(post::post_error(
            verb,
            rc,
            &self.pd.ctx.name,
            self.local.qpn,
            posted,
        ))
    }
}

/// One datagram to send: SEND or SEND_WITH_IMM of one slice (or inline
/// bytes) to a [`UdDestination`].
#[derive(Clone, Copy)]
pub struct UdSend<'a> {
    wr: sys::ibv_send_wr,
    sge: sys::ibv_sge,
    to: &'a UdDestination,
    _payload: PhantomData<&'a [u8]>,
}

impl fmt::Debug for UdSend<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UdSend")
            .field("wr_id", &self.wr.wr_id)
            .field("len", &self.sge.length)
            .finish()
    }
}

impl<'a> UdSend<'a> {
    fn build(wr_id: u64, sge: sys::ibv_sge, to: &'a UdDestination) -> Self {
        let mut wr = sys::ibv_send_wr {
            wr_id,
            opcode: sys::IBV_WR_SEND,
            num_sge: i32::from(sge.length > 0),
            ..Default::default()
        };
        wr.wr.ud = to.address();
        Self {
            wr,
            sge,
            to,
            _payload: PhantomData,
        }
    }

    /// SEND `local` to `to`.
    pub fn new(wr_id: u64, local: LocalSlice<'a>, to: &'a UdDestination) -> Self {
        Self::build(wr_id, super::wr::sge(&local), to)
    }

    /// SEND `data`, copied into the request at post (no registration
    /// needed; at most [`UdQueuePair::max_inline_data`] bytes).
    pub fn inline(wr_id: u64, data: &'a [u8], to: &'a UdDestination) -> Result<Self> {
        let length = u32::try_from(data.len())
            .map_err(|_| Error::InvalidArgument("UdSend::inline: payload too large"))?;
        let sge = sys::ibv_sge {
            addr: data.as_ptr() as u64,
            length,
            lkey: 0,
        };
        let mut request = Self::build(wr_id, sge, to);
        request.wr.send_flags |= sys::IBV_SEND_INLINE;
        Ok(request)
    }

    /// Carries `imm` (SEND_WITH_IMM).
    pub fn with_imm(mut self, imm: u32) -> Self {
        self.wr.opcode = sys::IBV_WR_SEND_WITH_IMM;
        self.wr.__bindgen_anon_1.imm_data = imm.to_be();
        self
    }

    /// Asks for a completion.
    pub fn signaled(mut self) -> Self {
        self.wr.send_flags |= sys::IBV_SEND_SIGNALED;
        self
    }
}

/// Where the payload of the datagram `wc` reports lies in its receive
/// buffer: after the GRH, up to the byte count the device reported (never
/// the payload's own idea of its length). `None` for a completion shorter
/// than a GRH, and for anything but a successful receive.
pub fn datagram_payload(wc: &WorkCompletion) -> Option<std::ops::Range<usize>> {
    // A failed completion's byte count means nothing.
    if !wc.is_success() || wc.opcode() != WcOpcode::RECV {
        return None;
    }
    let end = wc.byte_len() as usize;
    (end >= GRH_BYTES).then_some(GRH_BYTES..end)
}

/// The GID the datagram whose receive buffer began with `grh` came from:
/// the GRH's source GID, or on RoCE v2 over IPv4 the IPv4 header's source
/// address as an IPv4-mapped GID. `None` when neither header is there (a
/// completion without a GRH, [`WorkCompletion::has_grh`]). Like every
/// header of a datagram it is the sender's own word: a filter, not an
/// authentication.
pub fn datagram_sender(grh: &[u8; GRH_BYTES]) -> Option<Gid> {
    // Where the IPv4 header sits in the GRH's place (its last 20 bytes).
    const IPV4: usize = GRH_BYTES - 20;
    if grh[0] >> 4 == 6 {
        let mut raw = [0; 16];
        raw.copy_from_slice(&grh[8..24]);
        return Some(Gid(raw));
    }
    (grh[IPV4] >> 4 == 4).then(|| {
        let source = &grh[IPV4 + 12..IPV4 + 16];
        Gid::from_ipv4(std::net::Ipv4Addr::new(
            source[0], source[1], source[2], source[3],
        ))
    })
}

/// The refusal of a UD receive too short for the GRH before its payload.
#[cold]
fn no_room_for_the_grh() -> Error {
    Error::InvalidArgument("a UD receive must hold the 40-byte GRH before the payload")
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;

    #[test]
    fn the_sender_is_read_from_a_grh_or_from_an_ipv4_header_in_its_place() {
        let mut grh = [0; GRH_BYTES];
        assert_eq!(datagram_sender(&grh), None, "neither header");
        grh[20] = 0x45;
        grh[32..36].copy_from_slice(&[10, 78, 0, 2]);
        let v4 = Gid::from_ipv4(Ipv4Addr::new(10, 78, 0, 2));
        assert_eq!(datagram_sender(&grh), Some(v4), "RoCE v2 over IPv4");
        let mut grh = [0; GRH_BYTES];
        grh[0] = 0x60;
        grh[8..24].copy_from_slice(&[0xfe, 0x80, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8]);
        let sender = datagram_sender(&grh).expect("an IPv6 GRH");
        assert_eq!(sender.0[..2], [0xfe, 0x80]);
        assert_eq!(sender.0[8..], [1, 2, 3, 4, 5, 6, 7, 8]);
    }

    #[test]
    fn an_ipv4_mapped_gid_round_trips() {
        let group = Ipv4Addr::new(239, 1, 1, 1);
        let gid = Gid::from_ipv4(group);
        assert_eq!(gid.ipv4_mapped(), Some(group));
        assert_eq!(gid.to_string(), "::ffff:239.1.1.1");
    }

    #[test]
    fn only_a_successful_receive_has_a_payload() {
        // A default completion is a successful SEND: no datagram.
        assert_eq!(datagram_payload(&WorkCompletion::default()), None);
    }

    #[test]
    fn a_privileged_qkey_and_empty_queues_are_refused() {
        let privileged = UdConfig {
            qkey: 0x8000_0001,
            ..UdConfig::default()
        };
        assert!(matches!(
            privileged.validate(),
            Err(Error::InvalidArgument(_))
        ));
        let empty = UdConfig {
            max_recv_wr: 0,
            ..UdConfig::default()
        };
        assert!(matches!(empty.validate(), Err(Error::InvalidArgument(_))));
        assert!(UdConfig::default().validate().is_ok());
    }

    #[cfg(feature = "loopback")]
    #[test]
    fn the_loopback_device_refuses_a_ud_qp() {
        // SAFETY: nothing is posted on this device.
        let ctx = unsafe { super::super::Context::loopback() };
        let pd = ctx.alloc_pd().expect("a PD");
        let cq = ctx.create_cq(16, None).expect("a CQ");
        match pd.create_ud_qp(&cq, &cq, &UdConfig::default()) {
            Err(Error::Unsupported { verb, .. }) => assert!(verb.contains("UD"), "{verb}"),
            other => panic!("a UD QP on the loopback device: {other:?}"),
        }
    }
}
