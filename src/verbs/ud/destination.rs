//! Where a UD QP sends ([`UdDestination`]): an address handle, made from
//! a peer's [`UdEndpoint`], a multicast group or a received datagram's
//! sender, with the remote QP number and Q_Key.

use std::fmt;
use std::ptr::{self, NonNull};
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::sys;

use super::super::cq::WorkCompletion;
use super::super::device::Gid;
use super::super::pd::PdInner;
use super::super::{check_ptr, check_rc};
use super::{GRH_BYTES, MULTICAST_QPN, UdEndpoint, UdQueuePair};

impl UdQueuePair {
    /// Where to send datagrams for the UD QP `to` describes, from this
    /// QP's port and GID.
    pub fn destination(&self, to: &UdEndpoint) -> Result<UdDestination> {
        self.destination_to(to.gid, to.lid, to.qpn, to.qkey)
    }

    /// Where to send datagrams for the members of multicast group `group`
    /// (those that joined it, with [`join`](Self::join)), with this QP's
    /// Q_Key. The sender need not join the group itself.
    pub fn group_destination(&self, group: Gid) -> Result<UdDestination> {
        self.destination_to(group, 0, MULTICAST_QPN, self.local.qkey)
    }

    fn destination_to(&self, gid: Gid, lid: u16, qpn: u32, qkey: u32) -> Result<UdDestination> {
        let mut attr = sys::ibv_ah_attr {
            dlid: lid,
            port_num: self.port,
            is_global: 1,
            ..Default::default()
        };
        attr.grh.dgid.raw = gid.0;
        attr.grh.sgid_index = self.gid_index as u8;
        attr.grh.hop_limit = 64;
        self.create_destination(attr, "ibv_create_ah", qpn, qkey)
    }

    /// Where to send datagrams for QP `qpn` (with Q_Key `qkey`) at the
    /// address `attr` describes, as the connection manager reports a
    /// datagram peer or a group (`rdma_ud_param`): refused unless the
    /// attributes are for this QP's port and `qpn` is a QP number (24 bits).
    #[cfg_attr(not(feature = "rdma_cm"), allow(dead_code))]
    pub(in crate::verbs) fn destination_from_ah_attr(
        &self,
        attr: &sys::ibv_ah_attr,
        qpn: u32,
        qkey: u32,
    ) -> Result<UdDestination> {
        if attr.port_num != self.port {
            return Err(Error::InvalidArgument(
                "the peer's address handle attributes are for another port than the QP's",
            ));
        }
        if qpn > MULTICAST_QPN {
            return Err(Error::InvalidArgument(
                "the peer's QP number is wider than 24 bits",
            ));
        }
        self.create_destination(*attr, "ibv_create_ah(rdma_cm)", qpn, qkey)
    }

    /// Creates an address handle from `attr` in this QP's PD (`verb` names
    /// the call in an error) and makes it a destination.
    fn create_destination(
        &self,
        mut attr: sys::ibv_ah_attr,
        verb: &'static str,
        qpn: u32,
        qkey: u32,
    ) -> Result<UdDestination> {
        // SAFETY: the PD is live (held by the destination from here on) and
        // `attr` is an initialised copy the verb only reads.
        let raw = unsafe { sys::ibv_create_ah(self.pd.pd.as_ptr(), &mut attr) };
        self.adopt_ah(raw, verb, qpn, qkey)
    }

    /// Makes `raw`, what `verb` returned for an address handle in this
    /// QP's PD (null on failure, with errno set), a destination.
    fn adopt_ah(
        &self,
        raw: *mut sys::ibv_ah,
        verb: &'static str,
        qpn: u32,
        qkey: u32,
    ) -> Result<UdDestination> {
        let ah = check_ptr(raw, verb, &self.pd.ctx.name)?;
        Ok(UdDestination {
            handle: Arc::new(AddressHandle {
                ah,
                pd: Arc::clone(&self.pd),
            }),
            qpn,
            qkey,
        })
    }

    /// Where to answer the datagram `wc` reports, whose receive buffer
    /// began with `grh` (its first [`GRH_BYTES`]): the sender's QP, with
    /// this QP's Q_Key.
    pub fn reply_destination(&self, wc: &WorkCompletion, grh: &[u8]) -> Result<UdDestination> {
        let grh: &[u8; GRH_BYTES] = grh
            .get(..GRH_BYTES)
            .and_then(|bytes| bytes.try_into().ok())
            .ok_or(Error::InvalidArgument(
                "reply_destination: the GRH is the first 40 bytes of the receive buffer",
            ))?;
        let mut wc = *wc.raw();
        let mut header = std::mem::MaybeUninit::<sys::ibv_grh>::uninit();
        // SAFETY: `ibv_grh` is 40 bytes of plain integers (checked below), so
        // any 40 bytes copied into it make a valid, properly aligned value.
        let mut header = unsafe {
            ptr::copy_nonoverlapping(grh.as_ptr(), header.as_mut_ptr().cast::<u8>(), GRH_BYTES);
            header.assume_init()
        };
        // SAFETY: the PD is live; `wc` and `header` are aligned copies of
        // ours that the verb only reads (its signature is not const).
        let raw = unsafe {
            sys::ibv_create_ah_from_wc(self.pd.pd.as_ptr(), &mut wc, &mut header, self.port)
        };
        self.adopt_ah(raw, "ibv_create_ah_from_wc", wc.src_qp, self.local.qkey)
    }
}

/// Where a UD QP sends: an address handle, with the remote QP number and
/// Q_Key. A [`UdSend`](super::UdSend) borrows it; a QP it was posted on keeps its address
/// handle until the send is surely done (a provider such as rxe looks the
/// address up only when it transmits), so it may be dropped right after a
/// post.
pub struct UdDestination {
    pub(super) handle: Arc<AddressHandle>,
    pub(super) qpn: u32,
    pub(super) qkey: u32,
}

impl fmt::Debug for UdDestination {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UdDestination")
            .field("qpn", &self.qpn)
            .field("qkey", &self.qkey)
            .finish()
    }
}

impl UdDestination {
    /// The request's UD fields: the address handle, QP number and Q_Key.
    pub(super) fn address(&self) -> sys::ibv_send_wr__bindgen_ty_2__bindgen_ty_3 {
        sys::ibv_send_wr__bindgen_ty_2__bindgen_ty_3 {
            ah: self.handle.ah.as_ptr(),
            remote_qpn: self.qpn,
            remote_qkey: self.qkey,
        }
    }

    /// The remote QP number (0xffffff for a multicast group).
    pub fn qpn(&self) -> u32 {
        self.qpn
    }

    /// The Q_Key the datagrams carry.
    pub fn qkey(&self) -> u32 {
        self.qkey
    }
}

/// An address handle, destroyed when the last destination or posted send
/// that holds it lets go. Holds its PD.
pub(super) struct AddressHandle {
    pub(super) ah: NonNull<sys::ibv_ah>,
    pub(super) pd: Arc<PdInner>,
}

// SAFETY: an address handle is an immutable device object, usable from any
// thread; it is destroyed only in Drop, once no one holds it.
unsafe impl Send for AddressHandle {}
// SAFETY: see Send.
unsafe impl Sync for AddressHandle {}

impl Drop for AddressHandle {
    fn drop(&mut self) {
        // SAFETY: created by ibv_create_ah(_from_wc) on the PD held here,
        // destroyed once, when no destination and no send still in a
        // QP's send queue holds it.
        let rc = unsafe { sys::ibv_destroy_ah(self.ah.as_ptr()) };
        if let Err(err) = check_rc(rc, "ibv_destroy_ah", &self.pd.ctx.name, None) {
            log::error!("{err}");
        }
    }
}
