//! Connection-manager events: a typed view of `struct rdma_cm_event`,
//! acknowledged (`rdma_ack_cm_event`) when dropped.

use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use arrayvec::ArrayVec;

use crate::sys;

use super::id::{CmId, CmIdInner, CmToken};
use super::{ConnParams, ConnectRequest};

/// What a connection-manager event reports (`enum rdma_cm_event_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CmEventKind {
    /// `rdma_resolve_addr` succeeded: the id is bound to a device.
    AddrResolved,
    /// `rdma_resolve_addr` failed (status: a negative errno).
    AddrError,
    /// `rdma_resolve_route` succeeded.
    RouteResolved,
    /// `rdma_resolve_route` failed.
    RouteError,
    /// A peer asks to connect to a listening id; the event carries the new
    /// id (`CmEvent::take_request`).
    ConnectRequest,
    /// The peer accepted our connect request: call `CmId::establish`.
    ConnectResponse,
    /// Establishing the connection failed.
    ConnectError,
    /// The peer did not answer (or its answer was unusable).
    Unreachable,
    /// The peer rejected the request (status: the transport's reason).
    Rejected,
    /// The connection is up.
    Established,
    /// The connection is gone: the peer disconnected, or its process died
    /// and its kernel tore its side down. A host that dies, or a network
    /// partition, sends nothing: no event comes, and only traffic (a QP's
    /// retries running out) or a keepalive notices it.
    Disconnected,
    /// The device the id is bound to was removed; destroy the id.
    DeviceRemoval,
    /// A multicast join completed (datagram ids only).
    MulticastJoin,
    /// A multicast join failed (datagram ids only).
    MulticastError,
    /// The address's network device changed its hardware address.
    AddrChange,
    /// The QP of a closed connection left its timewait state.
    TimewaitExit,
    /// An event this crate does not know.
    Unknown,
}

impl CmEventKind {
    /// rdma_cm's name for it, e.g. `RDMA_CM_EVENT_REJECTED`.
    pub fn name(self) -> &'static str {
        match self {
            Self::AddrResolved => "RDMA_CM_EVENT_ADDR_RESOLVED",
            Self::AddrError => "RDMA_CM_EVENT_ADDR_ERROR",
            Self::RouteResolved => "RDMA_CM_EVENT_ROUTE_RESOLVED",
            Self::RouteError => "RDMA_CM_EVENT_ROUTE_ERROR",
            Self::ConnectRequest => "RDMA_CM_EVENT_CONNECT_REQUEST",
            Self::ConnectResponse => "RDMA_CM_EVENT_CONNECT_RESPONSE",
            Self::ConnectError => "RDMA_CM_EVENT_CONNECT_ERROR",
            Self::Unreachable => "RDMA_CM_EVENT_UNREACHABLE",
            Self::Rejected => "RDMA_CM_EVENT_REJECTED",
            Self::Established => "RDMA_CM_EVENT_ESTABLISHED",
            Self::Disconnected => "RDMA_CM_EVENT_DISCONNECTED",
            Self::DeviceRemoval => "RDMA_CM_EVENT_DEVICE_REMOVAL",
            Self::MulticastJoin => "RDMA_CM_EVENT_MULTICAST_JOIN",
            Self::MulticastError => "RDMA_CM_EVENT_MULTICAST_ERROR",
            Self::AddrChange => "RDMA_CM_EVENT_ADDR_CHANGE",
            Self::TimewaitExit => "RDMA_CM_EVENT_TIMEWAIT_EXIT",
            Self::Unknown => "RDMA_CM_EVENT_(unknown)",
        }
    }

    /// True for the events that end an operation or a connection in
    /// failure (address, route and connect errors, unreachable, rejected,
    /// disconnected, device removal).
    pub fn is_failure(self) -> bool {
        matches!(
            self,
            Self::AddrError
                | Self::RouteError
                | Self::ConnectError
                | Self::Unreachable
                | Self::Rejected
                | Self::Disconnected
                | Self::DeviceRemoval
        )
    }
}

impl fmt::Display for CmEventKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl CmEventKind {
    pub(super) fn from_raw(raw: sys::rdma_cm_event_type) -> Self {
        match raw {
            sys::RDMA_CM_EVENT_ADDR_RESOLVED => Self::AddrResolved,
            sys::RDMA_CM_EVENT_ADDR_ERROR => Self::AddrError,
            sys::RDMA_CM_EVENT_ROUTE_RESOLVED => Self::RouteResolved,
            sys::RDMA_CM_EVENT_ROUTE_ERROR => Self::RouteError,
            sys::RDMA_CM_EVENT_CONNECT_REQUEST => Self::ConnectRequest,
            sys::RDMA_CM_EVENT_CONNECT_RESPONSE => Self::ConnectResponse,
            sys::RDMA_CM_EVENT_CONNECT_ERROR => Self::ConnectError,
            sys::RDMA_CM_EVENT_UNREACHABLE => Self::Unreachable,
            sys::RDMA_CM_EVENT_REJECTED => Self::Rejected,
            sys::RDMA_CM_EVENT_ESTABLISHED => Self::Established,
            sys::RDMA_CM_EVENT_DISCONNECTED => Self::Disconnected,
            sys::RDMA_CM_EVENT_DEVICE_REMOVAL => Self::DeviceRemoval,
            sys::RDMA_CM_EVENT_MULTICAST_JOIN => Self::MulticastJoin,
            sys::RDMA_CM_EVENT_MULTICAST_ERROR => Self::MulticastError,
            sys::RDMA_CM_EVENT_ADDR_CHANGE => Self::AddrChange,
            sys::RDMA_CM_EVENT_TIMEWAIT_EXIT => Self::TimewaitExit,
            _ => Self::Unknown,
        }
    }

    /// The operation whose outcome this event is (for error messages).
    pub(super) fn awaited_op(self) -> &'static str {
        match self {
            Self::AddrResolved => "rdma_resolve_addr",
            Self::RouteResolved => "rdma_resolve_route",
            Self::ConnectRequest => "rdma_listen (waiting for a connect request)",
            Self::ConnectResponse => "rdma_connect",
            Self::Established => "rdma_accept",
            Self::Disconnected => "rdma_disconnect",
            _ => "rdma_get_cm_event",
        }
    }
}

/// One connection-manager event, acknowledged when dropped.
///
/// It keeps the id it is about alive (an id's destruction waits for its
/// events' acknowledgements, so it could not finish while this is held).
pub struct CmEvent {
    raw: NonNull<sys::rdma_cm_event>,
    kind: CmEventKind,
    /// A connect request's new id, until taken.
    request: Option<CmId>,
    /// The id the event counts against: the listener for a connect request.
    owner: Arc<CmIdInner>,
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
    /// counting against `owner`; `request` the new id of a connect request.
    pub(super) unsafe fn new(
        raw: NonNull<sys::rdma_cm_event>,
        kind: CmEventKind,
        owner: Arc<CmIdInner>,
        request: Option<CmId>,
    ) -> Self {
        Self {
            raw,
            kind,
            request,
            owner,
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
        let conn = self.conn_raw();
        if conn.private_data.is_null() || conn.private_data_len == 0 {
            return &[];
        }
        // SAFETY: librdmacm points it into the event's own buffer of
        // `private_data_len` bytes, valid until acknowledged.
        unsafe {
            std::slice::from_raw_parts(
                conn.private_data.cast::<u8>(),
                usize::from(conn.private_data_len),
            )
        }
    }

    /// The connection parameters that came with it, from this side's
    /// point of view (a request's `responder_resources` is what the peer
    /// wants us to serve).
    pub fn conn_params(&self) -> ConnParams {
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

    fn conn_raw(&self) -> &sys::rdma_conn_param {
        // SAFETY: every event of a connected (RDMA_PS_TCP) id carries the
        // connection view of the union, which is all our ids are.
        unsafe { &self.event().param.conn }
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
