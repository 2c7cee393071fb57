//! The RDMA connection manager (librdmacm's `rdma_cm`): connecting RC QPs
//! by IP address and port, interoperable with any rdma_cm peer (rping,
//! perftest's `-R`, NVMe-oF, ...), instead of the session layer's TCP
//! handshake.
//!
//! An [`EventChannel`] carries the events of its [`CmId`]s. The active side
//! resolves the address and route, creates its QP on the id and connects;
//! the passive side binds, listens and takes a [`ConnectRequest`] from each
//! `ConnectRequest` event, creates a QP on its id and accepts:
//!
//! ```no_run
//! use std::time::Duration;
//! use rdma_comm_core::verbs::QpConfig;
//! use rdma_comm_core::verbs::cm::{CmEventKind, EventChannel};
//!
//! let t = Duration::from_secs(2);
//! let channel = EventChannel::new()?;
//! let mut id = channel.create_id()?;
//! id.resolve_addr(None, "10.77.0.1:7174".parse().unwrap(), t)?;
//! channel.expect(&id, CmEventKind::AddrResolved, t)?;
//! id.resolve_route(t)?;
//! channel.expect(&id, CmEventKind::RouteResolved, t)?;
//! let ctx = id.context()?;              // librdmacm's context of the id's device
//! let pd = ctx.alloc_pd()?;
//! let cq = ctx.create_cq(64, None)?;
//! let mut qp = id.create_qp(&pd, &cq, &cq, &QpConfig::default())?; // our QueuePair, in INIT
//! // post receives here
//! id.connect(&qp, b"hello")?;
//! channel.expect(&id, CmEventKind::ConnectResponse, t)?;
//! id.establish(&mut qp)?;               // RTR, RTS, and the peer is told
//! # Ok::<(), rdma_comm_core::Error>(())
//! ```
//!
//! # Datagrams
//!
//! An id from [`EventChannel::create_ud_id`] is in the UDP port space
//! (`RDMA_PS_UDP`, as rdma-core's `udaddy` uses): no connection, only the
//! exchange of QP numbers. The active side resolves as above, creates a
//! [`UdQueuePair`](super::UdQueuePair) on the id
//! ([`CmId::create_ud_qp`]), posts its receives and calls
//! [`CmId::connect_ud`]; the `Established` event that answers carries the
//! peer's QP ([`CmEvent::ud_destination`]). The passive side answers each
//! request with [`ConnectRequest::accept_ud`] and a UD QP of the request's
//! id, then answers each datagram at the address its completion gives
//! ([`UdQueuePair::reply_destination`](super::UdQueuePair::reply_destination)).
//!
//! # Multicast
//!
//! A datagram id's QP joins a multicast group by its IP address as
//! rdma-core's `mckey` does: bind the id to a device (resolve the group's
//! address from a local one), create the QP on it, post its receives and
//! call [`CmId::join_multicast`]; the `MulticastJoin` event's
//! [`CmEvent::attach_group`] attaches the QP and says where to send to the
//! group (`MulticastError` is the join's failure).
//! [`CmId::leave_multicast`], or dropping the QP, leaves it.
//!
//! # Ownership
//!
//! - The QP is the crate's own [`QueuePair`](super::QueuePair), created in
//!   our PD on our CQs and driven to RTS with the attributes the connection
//!   manager negotiated (librdmacm's "QP not associated with the id" mode,
//!   rping's `-q`), so a reactor can take it like any other.
//! - The QP holds its id: the id is destroyed (`rdma_destroy_id`) only after
//!   the QP, whatever order the handles are dropped in.
//! - The PD and CQs must be on the id's device context, which librdmacm
//!   opened ([`CmId::context`], [`open_device`]). That `Context` holds a
//!   reference on librdmacm's device list, which keeps the context open, so
//!   it outlives the QP, its PD and CQs, and the id.
//! - Ids and events hold their channel, which is destroyed after them; an
//!   event holds the id it is about, so an id is never destroyed while one
//!   of its events is unacknowledged (the destroy would wait for it).
//!
//! # Threads
//!
//! Every librdmacm call on a channel and its ids holds the channel's lock,
//! so an id's fields are never read while the library writes them for an
//! event; the final destroy and the acknowledgement do not (they run in
//! `Drop` and never wait for a thread holding the lock). Calls that can
//! take a while under the lock (a route resolution on InfiniBand may ask
//! ibacm; `accept` and `establish` modify the QP three times) hold up the
//! other ids of the same channel meanwhile: give connections that must not
//! wait on each other channels of their own ([`CmId::migrate`]).

#[cfg(feature = "rdma_cm")]
mod addr;
#[cfg(feature = "rdma_cm")]
mod channel;
#[cfg(feature = "rdma_cm")]
mod connect;
#[cfg(feature = "rdma_cm")]
mod datagram;
#[cfg(feature = "rdma_cm")]
mod device;
#[cfg(feature = "rdma_cm")]
mod event;
#[cfg(feature = "rdma_cm")]
mod id;
mod kind;
#[cfg(feature = "rdma_cm")]
mod multicast;
#[cfg(feature = "rdma_cm")]
mod request;
#[cfg(feature = "rdma_cm")]
mod transition;

pub use crate::error::CmFailure;
#[cfg(feature = "rdma_cm")]
pub use channel::EventChannel;
#[cfg(feature = "rdma_cm")]
pub use device::open_device;
#[cfg(feature = "rdma_cm")]
pub use event::CmEvent;
#[cfg(feature = "rdma_cm")]
pub use id::{CmId, CmToken};
pub use kind::CmEventKind;
#[cfg(feature = "rdma_cm")]
pub use request::ConnectRequest;

/// Private data a connect request can carry (InfiniBand and RoCE, `RDMA_PS_TCP`).
pub const MAX_CONNECT_PRIVATE_DATA: usize = 56;
/// Private data an accept can carry.
pub const MAX_ACCEPT_PRIVATE_DATA: usize = 196;
/// Private data a reject can carry.
pub const MAX_REJECT_PRIVATE_DATA: usize = 148;
/// Private data a datagram connect request can carry
/// (`CmId::connect_ud`; InfiniBand and RoCE, `RDMA_PS_UDP`).
pub const MAX_UD_CONNECT_PRIVATE_DATA: usize = 180;
/// Private data a datagram accept can carry (`ConnectRequest::accept_ud`).
pub const MAX_UD_ACCEPT_PRIVATE_DATA: usize = 136;
#[cfg(feature = "rdma_cm")]
/// The largest private data buffer an event has (`RDMA_MAX_PRIVATE_DATA`).
const MAX_PRIVATE_DATA: usize = 256;

#[cfg(feature = "rdma_cm")]
/// Connection parameters as an event reports them, from this side's point
/// of view.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct ConnParams {
    /// RDMA READs the peer may have outstanding at us.
    pub responder_resources: u8,
    /// RDMA READs we may have outstanding at the peer.
    pub initiator_depth: u8,
    /// Transport retries the peer asks for (connect requests only).
    pub retry_count: u8,
    /// RNR retries the peer asks for (7: for ever).
    pub rnr_retry_count: u8,
    /// True if the peer's QP takes its receives from a shared receive queue.
    pub srq: bool,
    /// The peer's QP number.
    pub qp_num: u32,
}

#[cfg(feature = "rdma_cm")]
/// errno after a librdmacm call that returned -1 (or NULL).
fn last_errno() -> i32 {
    match std::io::Error::last_os_error().raw_os_error() {
        Some(0) | None => libc::EIO,
        Some(errno) => errno,
    }
}
