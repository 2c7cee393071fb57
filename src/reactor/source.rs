//! What a reactor takes a session from: connected QPs, plus a link to the
//! peer that the reactor keeps beside them and watches.
//!
//! The session layer's [`Endpoint`] is one source; an rdma_cm connection or
//! a service's own control plane can be others. The reactor takes the QPs
//! whole, so nothing else can post on them while it serves them, and it
//! refuses a QP that already had anything posted: every completion on the
//! reactor's queues is then one of its own requests, or the completion of
//! a memory window bind posted before (`wr_id`
//! [`BIND_WR_ID`](crate::verbs::BIND_WR_ID), which no request of the
//! reactor's carries), which it never takes for one of its own.

use std::net::SocketAddr;
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::time::Duration;

use crate::session::{Endpoint, PeerStatus, SessionLink};
use crate::verbs::QueuePair;

/// Connected QPs and the link to their peer.
pub trait QpSource {
    /// What stays with the session while the reactor serves it.
    type Link: PeerLink;

    /// Hands over the QPs (connected, nothing posted but window binds)
    /// and the link.
    fn into_parts(self) -> (Vec<QueuePair>, Self::Link);
}

/// A session's way to its peer, watched by the reactor.
pub trait PeerLink {
    /// Whether the peer is still there. Must not block: it runs on the
    /// reactor thread, between passes.
    fn check_peer(&mut self) -> PeerStatus {
        PeerStatus::Alive
    }

    /// A descriptor that becomes readable when the peer has something to
    /// say (a control connection): a reactor in the Blocking or Epoll mode
    /// waits on it and checks this peer when it fires, so it needs no timer
    /// to notice a peer leaving. `None`: only the periodic watch
    /// ([`ReactorConfig::peer_check_interval`](super::ReactorConfig::peer_check_interval))
    /// sees this peer go. The descriptor must stay open while the reactor
    /// serves the session.
    fn event_fd(&self) -> Option<RawFd> {
        None
    }

    /// Check this peer again within this time even if nothing wakes the
    /// reactor: the link holds part of a frame and must see whether the
    /// rest comes before its deadline. A sleeping reactor bounds its sleep
    /// by it. `None` (the default): an event or the periodic watch is
    /// enough.
    fn recheck_within(&self) -> Option<Duration> {
        None
    }

    /// The peer's address, if the link knows it: the reactor puts it into
    /// the failed completions it hands the session's handler
    /// ([`Error::Completion`](crate::Error::Completion)'s `peer`), so a
    /// transport error names whom it lost.
    fn peer(&self) -> Option<SocketAddr> {
        None
    }
}

impl QpSource for Endpoint {
    type Link = SessionLink;

    fn into_parts(self) -> (Vec<QueuePair>, SessionLink) {
        Endpoint::into_parts(self)
    }
}

impl PeerLink for SessionLink {
    fn check_peer(&mut self) -> PeerStatus {
        SessionLink::check_peer(self)
    }

    fn event_fd(&self) -> Option<RawFd> {
        Some(self.as_fd().as_raw_fd())
    }

    fn recheck_within(&self) -> Option<Duration> {
        SessionLink::recheck_within(self)
    }

    fn peer(&self) -> Option<SocketAddr> {
        Some(SessionLink::peer(self))
    }
}

/// The link of QPs connected by other means ([`Vec<QueuePair>`] as a
/// [`QpSource`]): nothing to watch, so the peer is always taken to be there.
/// A reactor serving only such sessions is a `Reactor<H, NoLink>`.
pub type NoLink = ();

/// QPs connected by other means, with nothing to watch.
impl QpSource for Vec<QueuePair> {
    type Link = NoLink;

    fn into_parts(self) -> (Vec<QueuePair>, NoLink) {
        (self, ())
    }
}

impl PeerLink for NoLink {}

/// Any link, for a reactor serving sessions of several kinds.
impl PeerLink for Box<dyn PeerLink> {
    fn check_peer(&mut self) -> PeerStatus {
        (**self).check_peer()
    }

    fn event_fd(&self) -> Option<RawFd> {
        (**self).event_fd()
    }

    fn recheck_within(&self) -> Option<Duration> {
        (**self).recheck_within()
    }

    fn peer(&self) -> Option<SocketAddr> {
        (**self).peer()
    }
}
