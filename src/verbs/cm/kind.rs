//! The kinds of connection-manager events (`enum rdma_cm_event_type`),
//! which errors name with or without the `rdma_cm` feature.

use std::fmt;

#[cfg(feature = "rdma_cm")]
use crate::sys;

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
    /// The connection is up; for a datagram id's `connect_ud`, the peer
    /// answered with its QP (`CmEvent::ud_destination`).
    Established,
    /// The connection is gone: the peer disconnected, or its process died
    /// and its kernel tore its side down. A host that dies, or a network
    /// partition, sends nothing: no event comes, and only traffic (a QP's
    /// retries running out) or a keepalive notices it.
    Disconnected,
    /// The device the id is bound to was removed; destroy the id.
    DeviceRemoval,
    /// A multicast join completed (datagram ids only): attach the QP with
    /// `CmEvent::attach_group`, which says where to send to the group.
    MulticastJoin,
    /// A multicast join failed, or a joined group was lost (datagram ids
    /// only).
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
    /// disconnected, device removal, a multicast error).
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
                | Self::MulticastError
        )
    }

    /// True for the events about a multicast group (`MulticastJoin`,
    /// `MulticastError`).
    pub fn is_multicast(self) -> bool {
        matches!(self, Self::MulticastJoin | Self::MulticastError)
    }
}

impl fmt::Display for CmEventKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl CmEventKind {
    #[cfg(feature = "rdma_cm")]
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
    #[cfg_attr(not(feature = "rdma_cm"), allow(dead_code))]
    pub(super) fn awaited_op(self) -> &'static str {
        match self {
            Self::AddrResolved => "rdma_resolve_addr",
            Self::RouteResolved => "rdma_resolve_route",
            Self::ConnectRequest => "rdma_listen (waiting for a connect request)",
            Self::ConnectResponse => "rdma_connect",
            Self::Established => "rdma_accept (rdma_connect for a datagram id)",
            Self::Disconnected => "rdma_disconnect",
            Self::MulticastJoin => "rdma_join_multicast",
            _ => "rdma_get_cm_event",
        }
    }
}
