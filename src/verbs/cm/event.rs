//! Connection-manager events: a typed view of `struct rdma_cm_event`,
//! acknowledged (`rdma_ack_cm_event`) when dropped.

use std::fmt;
use std::net::IpAddr;
use std::ptr::NonNull;
use std::sync::Arc;

use arrayvec::ArrayVec;

use crate::error::{CmFailure, Error, Result};
use crate::sys;

use super::super::{RDMA_UDP_QKEY, UdDestination, UdQueuePair};

/// The QP numbers a datagram peer can answer with: none of the special
/// QPs 0 and 1, and not the multicast QPN 0xffffff.
const FIRST_PEER_QPN: u32 = 2;
const LAST_PEER_QPN: u32 = 0x00ff_fffe;
use super::id::{CmId, CmIdInner, CmToken};
use super::multicast::{self, Group};
use super::{CmEventKind, ConnParams, ConnectRequest};

/// One connection-manager event, acknowledged when dropped.
///
/// It keeps the id it is about alive (an id's destruction waits for its
/// events' acknowledgements, so it could not finish while this is held),
/// and a multicast event its group (so the group is not left, which would
/// wait for this acknowledgement, until this is dropped).
pub struct CmEvent {
    raw: NonNull<sys::rdma_cm_event>,
    kind: CmEventKind,
    /// A connect request's new id, until taken.
    request: Option<CmId>,
    /// The id the event counts against: the listener for a connect request.
    owner: Arc<CmIdInner>,
    /// The group a multicast event is about; dropped after the
    /// acknowledgement, so that leaving it does not wait for this event.
    group: Option<Arc<Group>>,
}

// SAFETY: the event is ours until acknowledged, from any thread; it is
// only read, and acknowledged once, in Drop.
unsafe impl Send for CmEvent {}
// SAFETY: shared access only reads it.
unsafe impl Sync for CmEvent {}

impl fmt::Debug for CmEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CmEvent")
            .field("kind", &self.kind)
            .field("status", &self.status())
            .field("token", &self.token())
            .field("private_data_len", &self.private_data().len())
            .finish()
    }
}

impl Drop for CmEvent {
    fn drop(&mut self) {
        // SAFETY: the event came from rdma_get_cm_event and is acknowledged
        // exactly once; `owner` (dropped after this) keeps its id alive.
        unsafe { sys::rdma_ack_cm_event(self.raw.as_ptr()) };
    }
}

impl CmEvent {
    /// # Safety
    /// `raw` must be an unacknowledged event of the channel `owner` is on,
    /// counting against `owner`; `request` the new id of a connect request;
    /// `group` the group of a multicast event.
    pub(super) unsafe fn new(
        raw: NonNull<sys::rdma_cm_event>,
        kind: CmEventKind,
        owner: Arc<CmIdInner>,
        request: Option<CmId>,
        group: Option<Arc<Group>>,
    ) -> Self {
        Self {
            raw,
            kind,
            request,
            owner,
            group,
        }
    }

    fn event(&self) -> &sys::rdma_cm_event {
        // SAFETY: valid until acknowledged in Drop.
        unsafe { self.raw.as_ref() }
    }

    /// What happened.
    pub fn kind(&self) -> CmEventKind {
        self.kind
    }

    /// The event's status: 0, a negative errno, or for `Rejected` the
    /// transport's reject reason.
    pub fn status(&self) -> i32 {
        self.event().status
    }

    /// The id the event is about. For a connect request that is the
    /// listening id; the new one is [`take_request`](Self::take_request)'s.
    pub fn token(&self) -> CmToken {
        self.owner.token()
    }

    /// True if the event is about `id` (see [`token`](Self::token)).
    pub fn is_for(&self, id: &CmId) -> bool {
        self.token() == id.token()
    }

    /// The private data that came with it (a connect request, response,
    /// reject or establishment), padded by the transport beyond what the
    /// peer sent; empty when there is none.
    pub fn private_data(&self) -> &[u8] {
        if self.kind.is_multicast() {
            // librdmacm puts the join's context there.
            return &[];
        }
        // Both views of the union begin with the private data and its
        // length (`rdma_conn_param` and `rdma_ud_param` alike).
        let (data, len) = if self.owner.is_datagram() {
            let ud = self.ud_raw();
            (ud.private_data, ud.private_data_len)
        } else {
            let conn = self.conn_raw();
            (conn.private_data, conn.private_data_len)
        };
        if data.is_null() || len == 0 {
            return &[];
        }
        // SAFETY: librdmacm points it into the event's own buffer of
        // `len` bytes, valid until acknowledged.
        unsafe { std::slice::from_raw_parts(data.cast::<u8>(), usize::from(len)) }
    }

    /// The connection parameters that came with it, from this side's
    /// point of view (a request's `responder_resources` is what the peer
    /// wants us to serve). All zeros for an event of a datagram id, which
    /// has no connection.
    pub fn conn_params(&self) -> ConnParams {
        if self.owner.is_datagram() {
            return ConnParams::default();
        }
        let conn = self.conn_raw();
        ConnParams {
            responder_resources: conn.responder_resources,
            initiator_depth: conn.initiator_depth,
            retry_count: conn.retry_count,
            rnr_retry_count: conn.rnr_retry_count,
            srq: conn.srq != 0,
            qp_num: conn.qp_num,
        }
    }

    /// Where to send the peer's datagrams, from the `Established` event of
    /// a datagram id ([`CmId::connect_ud`]): the peer's QP number and
    /// Q_Key, with an address handle made in `qp`'s PD from the address
    /// the connection manager resolved (`param.ud.ah_attr`).
    ///
    /// `InvalidArgument` for any other event, for a `qp` not created on
    /// the event's id, and for what the peer answered when it is not a
    /// datagram peer's: a QP number outside 2 to 0xfffffe (no special QP,
    /// no multicast group) or a Q_Key other than [`RDMA_UDP_QKEY`], the
    /// one every datagram id uses. The address handle's attributes are our
    /// own kernel's, from the path it resolved.
    pub fn ud_destination(&self, qp: &UdQueuePair) -> Result<UdDestination> {
        if self.kind != CmEventKind::Established || !self.owner.is_datagram() {
            return Err(Error::InvalidArgument(
                "CmEvent::ud_destination: only the Established event of a datagram id \
                 (EventChannel::create_ud_id) carries a UD peer",
            ));
        }
        if !qp.is_anchored_to(&self.owner) {
            return Err(Error::InvalidArgument(
                "CmEvent::ud_destination: the QP was not created on the event's id",
            ));
        }
        let ud = self.ud_raw();
        if !(FIRST_PEER_QPN..=LAST_PEER_QPN).contains(&ud.qp_num) || ud.qkey != RDMA_UDP_QKEY {
            return Err(Error::InvalidArgument(
                "CmEvent::ud_destination: the peer answered with a QP number outside \
                 2 to 0xfffffe or a Q_Key other than RDMA_UDP_QKEY",
            ));
        }
        qp.destination_from_ah_attr(&ud.ah_attr, ud.qp_num, ud.qkey)
    }

    /// The multicast group a `MulticastJoin` or `MulticastError` event is
    /// about ([`CmId::join_multicast`]); `None` for any other event.
    pub fn group(&self) -> Option<IpAddr> {
        self.group.as_ref().map(|group| group.addr().ip())
    }

    /// Attaches `qp` to the group this `MulticastJoin` event reports joined
    /// ([`CmId::join_multicast`] for `qp`), so that it receives the group's
    /// datagrams, and returns where to send to the group: an address handle
    /// made in `qp`'s PD from the event's `param.ud.ah_attr`, QP number
    /// 0xffffff and the group's Q_Key.
    ///
    /// A `MulticastError` event is the join's failure: [`Error::Cm`] with
    /// [`CmFailure::Event`] naming it and its status.
    /// `InvalidArgument` for any other event, for a `qp` that did not join
    /// the group (or left it), and for parameters not fit for `qp` (another
    /// port, another Q_Key, not a multicast GID or QP number).
    pub fn attach_group(&self, qp: &mut UdQueuePair) -> Result<UdDestination> {
        let group = match (self.kind, &self.group) {
            (CmEventKind::MulticastJoin, Some(group)) => group,
            (CmEventKind::MulticastError, Some(group)) => {
                return Err(Error::Cm {
                    op: "rdma_join_multicast",
                    peer: Some(group.addr()),
                    cause: CmFailure::Event {
                        got: self.kind,
                        status: self.status(),
                        expected: Some(CmEventKind::MulticastJoin),
                    },
                });
            }
            _ => {
                return Err(Error::InvalidArgument(
                    "CmEvent::attach_group: only a MulticastJoin event \
                     (after CmId::join_multicast) reports a joined group",
                ));
            }
        };
        if !qp.is_anchored_to(&self.owner) {
            return Err(Error::InvalidArgument(
                "CmEvent::attach_group: the QP was not created on the event's id",
            ));
        }
        let ud = self.ud_raw();
        let joined = multicast::joined(ud, qp.port(), qp.endpoint().qkey, group.addr().ip())?;
        // The destination first: a QP is attached only if all went well.
        let destination = qp.destination_from_ah_attr(&ud.ah_attr, ud.qp_num, ud.qkey)?;
        qp.attach_cm_group(group, joined.mgid, joined.mlid)?;
        Ok(destination)
    }

    fn conn_raw(&self) -> &sys::rdma_conn_param {
        // SAFETY: both views of the union are plain data (integers, and a
        // pointer only read with its length), valid for any bytes; which
        // one librdmacm filled depends on the event and the port space, and
        // the callers read this one only for ids that are not datagram
        // ids, whose events all carry it.
        unsafe { &self.event().param.conn }
    }

    fn ud_raw(&self) -> &sys::rdma_ud_param {
        // SAFETY: as for `conn_raw`: plain data either way. The callers
        // read this view whole only for a datagram id's `Established` and
        // `MulticastJoin`, which librdmacm fills with it, and otherwise
        // only the private data and its length, where both views agree.
        unsafe { &self.event().param.ud }
    }

    /// The connect request this event carries (once; `None` for any other
    /// event). Accept or reject it; dropping it rejects the peer.
    pub fn take_request(&mut self) -> Option<ConnectRequest> {
        let id = self.request.take()?;
        let mut private_data = ArrayVec::new();
        let data = self.private_data();
        let _ =
            private_data.try_extend_from_slice(&data[..data.len().min(private_data.capacity())]);
        Some(ConnectRequest {
            id,
            private_data,
            requested: self.conn_params(),
        })
    }
}
