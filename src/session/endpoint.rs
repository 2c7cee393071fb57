//! A connected peer: its qps, the regions it exported, and the control
//! connection that carries the disconnect and reveals a dead peer.

use std::fmt;
use std::io::{self, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::os::fd::{AsFd, BorrowedFd};
use std::time::{Duration, Instant};

use super::Export;
use super::peer_places::PeerPlace;
use super::wire::{FrameReader, Message, RegionInfo, WireError};
use crate::error::{Error, Result};
use crate::verbs::{BoundWindow, CompletionQueue, QueuePair, RemoteRegion, WorkCompletion};

/// How long a graceful close waits for flushed completions on private CQs.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(2);

/// Largest control payload an established peer may send (a `Disconnect`
/// has 2 bytes): anything longer is a protocol error, not a buffer to grow.
const CONTROL_MAX_PAYLOAD: u32 = 64;

/// A control frame that started arriving must be whole within this long;
/// a peer that sends part of one and stops is lost.
const CONTROL_FRAME_DEADLINE: Duration = Duration::from_secs(5);

/// One RC queue pair of an endpoint.
pub struct SessionQp {
    name: String,
    // Field order: the QP is destroyed before its private CQ.
    qp: QueuePair,
    cq: Option<CompletionQueue>,
}

impl fmt::Debug for SessionQp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SessionQp")
            .field("name", &self.name)
            .field("qpn", &self.qp.qpn())
            .field("private_cq", &self.cq.is_some())
            .finish()
    }
}

impl SessionQp {
    pub(super) fn new(name: String, qp: QueuePair, cq: Option<CompletionQueue>) -> Self {
        Self { name, qp, cq }
    }

    /// The QP's name within its session.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The queue pair, for posting.
    pub fn qp(&self) -> &QueuePair {
        &self.qp
    }

    /// The queue pair, mutably.
    pub fn qp_mut(&mut self) -> &mut QueuePair {
        &mut self.qp
    }

    /// The private CQ to poll, or `None` when the QP uses a shared CQ.
    pub fn cq_mut(&mut self) -> Option<&mut CompletionQueue> {
        self.cq.as_mut()
    }

    /// The QP and its private CQ together (for post-then-poll loops).
    pub fn split_mut(&mut self) -> (&QueuePair, Option<&mut CompletionQueue>) {
        (&self.qp, self.cq.as_mut())
    }
}

/// A region the peer exported to us.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamedRegion {
    /// The peer's id for it.
    pub id: u32,
    /// The peer's name for it.
    pub name: String,
    /// The bounds-checked descriptor for WRITE and READ through the
    /// session's first QP. Its address is 0 (the peer's windows are
    /// zero-based): offsets from 0 to its length reach the memory.
    pub region: RemoteRegion,
    /// The region's key for each QP of the session, in QP order: the peer
    /// may grant access through each QP separately.
    pub rkeys: Vec<u32>,
}

impl NamedRegion {
    /// The descriptor to use on the session's QP number `index`.
    pub fn on_qp(&self, index: usize) -> Option<RemoteRegion> {
        let rkey = *self.rkeys.get(index)?;
        Some(RemoteRegion::new(
            self.region.addr(),
            self.region.len(),
            rkey,
        ))
    }
}

impl From<RegionInfo> for NamedRegion {
    fn from(info: RegionInfo) -> Self {
        let first = info.rkeys.first().copied().unwrap_or(0);
        Self {
            id: info.id,
            name: info.name,
            region: RemoteRegion::new(info.addr, info.len, first),
            rkeys: info.rkeys,
        }
    }
}

/// What [`Endpoint::check_peer`] found on the control connection.
#[derive(Debug)]
pub enum PeerStatus {
    /// Nothing to report.
    Alive,
    /// The peer closed gracefully with this code.
    Disconnected {
        /// The peer's reason code (0 = normal).
        code: u16,
    },
    /// The connection is gone without a goodbye (crash, kill, reset, garbage).
    Lost(Error),
}

/// What a graceful close drained.
#[derive(Debug, Default)]
pub struct CloseReport {
    /// Completions polled from private CQs after the QPs entered the error
    /// state: flushed work that never ran, plus anything that finished late.
    pub drained: Vec<WorkCompletion>,
    /// True if the disconnect message reached the socket.
    pub peer_notified: bool,
}

/// A connected peer: one or more qps plus the [`SessionLink`] (the
/// control connection, the regions each side exported).
pub struct Endpoint {
    // Field order is drop order: qps (QPs, then private CQs) go before
    // the link, whose exported regions the peer may have been writing into.
    qps: Vec<SessionQp>,
    link: SessionLink,
    /// What the server's `place` callback attached (see [`QpHome`](super::QpHome)).
    pub(super) home_token: Option<Box<dyn std::any::Any + Send>>,
}

/// Everything of a session but its QPs: the peer's address, the control
/// connection that carries the disconnect and reveals a dead peer, the
/// regions we exported to the peer (kept registered while the link lives)
/// and the regions it exported to us. A reactor keeps it beside the QPs it
/// took; dropping it tells the peer goodbye.
pub struct SessionLink {
    peer: SocketAddr,
    exports: Vec<Export>,
    /// The peer's windows onto our exports: dropping them (with the link)
    /// ends its access, even if its QPs lived on.
    windows: Vec<BoundWindow>,
    remote_regions: Vec<NamedRegion>,
    /// Where the goodbye travels and a lost peer shows.
    control: ControlLink,
    closed: bool,
    /// Set once the disconnect message went out: whether it reached the
    /// socket (see [`SessionLink::send_disconnect`]).
    disconnect_sent: Option<bool>,
    /// The peer's place in its server's peer limit, given back with the
    /// link (none on the client's side).
    place: Option<PeerPlace>,
}

impl fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Endpoint")
            .field("peer", &self.link.peer)
            .field("qps", &self.qps)
            .field("remote_regions", &self.link.remote_regions)
            .finish()
    }
}

impl fmt::Debug for SessionLink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SessionLink")
            .field("peer", &self.peer)
            .field("exports", &self.exports.len())
            .field("remote_regions", &self.remote_regions)
            .finish()
    }
}

impl Endpoint {
    pub(super) fn new(
        peer: SocketAddr,
        qps: Vec<SessionQp>,
        exports: Vec<Export>,
        windows: Vec<BoundWindow>,
        remote_regions: Vec<RegionInfo>,
        control: ControlLink,
    ) -> Self {
        let remote_regions = remote_regions.into_iter().map(NamedRegion::from).collect();
        Self {
            qps,
            link: SessionLink {
                peer,
                exports,
                windows,
                remote_regions,
                control,
                closed: false,
                disconnect_sent: None,
                place: None,
            },
            home_token: None,
        }
    }

    /// Splits the endpoint into its QPs, in negotiated order, and the link
    /// (for a reactor that takes the QPs over). Private CQs are released.
    pub fn into_parts(self) -> (Vec<QueuePair>, SessionLink) {
        let Endpoint { qps, link, .. } = self;
        (qps.into_iter().map(|c| c.qp).collect(), link)
    }

    /// Gives the endpoint its peer's place in the server's peer limit.
    pub(super) fn hold_place(&mut self, place: PeerPlace) {
        self.link.place = Some(place);
    }

    /// Takes what the server's [`place`](super::ServerConfig::place)
    /// callback attached to this peer ([`QpHome::token`](super::QpHome::token)):
    /// the router that hands endpoints to reactors reads its choice here.
    pub fn take_home_token(&mut self) -> Option<Box<dyn std::any::Any + Send>> {
        self.home_token.take()
    }

    /// The link: control connection and regions.
    pub fn link(&self) -> &SessionLink {
        &self.link
    }

    /// The link, mutably.
    pub fn link_mut(&mut self) -> &mut SessionLink {
        &mut self.link
    }

    /// The peer's control address.
    pub fn peer(&self) -> SocketAddr {
        self.link.peer
    }

    /// All qps, in the order they were negotiated.
    pub fn qps(&self) -> &[SessionQp] {
        &self.qps
    }

    /// All qps, mutably.
    pub fn qps_mut(&mut self) -> &mut [SessionQp] {
        &mut self.qps
    }

    /// SessionQp by index.
    pub fn qp_at(&mut self, index: usize) -> Option<&mut SessionQp> {
        self.qps.get_mut(index)
    }

    /// SessionQp by name.
    pub fn qp_by_name(&mut self, name: &str) -> Option<&mut SessionQp> {
        self.qps.iter_mut().find(|c| c.name == name)
    }

    /// Regions the peer exported.
    pub fn remote_regions(&self) -> &[NamedRegion] {
        self.link.remote_regions()
    }

    /// The peer's region called `name`, for use on the first QP (see
    /// [`remote_region_on`](Self::remote_region_on) for the others).
    pub fn remote_region(&self, name: &str) -> Option<RemoteRegion> {
        self.link.remote_region(name)
    }

    /// The peer's region called `name`, for use on QP number `qp`: each QP
    /// has a key of its own, and another QP's key gives a remote access
    /// error.
    pub fn remote_region_on(&self, name: &str, qp: usize) -> Option<RemoteRegion> {
        self.link.remote_region_on(name, qp)
    }

    /// Our regions this peer may access.
    pub fn exports(&self) -> &[Export] {
        &self.link.exports
    }

    /// See [`SessionLink::check_peer`].
    pub fn check_peer(&mut self) -> PeerStatus {
        self.link.check_peer()
    }

    /// See [`SessionLink::send_disconnect`].
    pub fn send_disconnect(&mut self, code: u16) -> bool {
        self.link.send_disconnect(code)
    }

    /// Closes gracefully: sends the disconnect message, moves every QP to the
    /// error state, drains private CQs (reporting what was flushed), then
    /// destroys everything. Shared CQs are drained by their owner.
    pub fn close(mut self) -> Result<CloseReport> {
        let mut report = CloseReport {
            peer_notified: self.link.send_disconnect(0),
            ..Default::default()
        };
        let mut first_error = None;
        for session_qp in &self.qps {
            if let Err(err) = session_qp.qp.set_error() {
                first_error.get_or_insert(err);
            }
        }
        let deadline = Instant::now() + DRAIN_TIMEOUT;
        let mut wcs = [WorkCompletion::default(); 32];
        for session_qp in &mut self.qps {
            let Some(cq) = session_qp.cq.as_mut() else {
                continue;
            };
            // Flushes arrive promptly after ERR; stop at the first empty poll
            // after a short quiet period, or at the deadline.
            let mut quiet_since = Instant::now();
            while Instant::now() < deadline && quiet_since.elapsed() < Duration::from_millis(50) {
                match cq.poll(&mut wcs) {
                    Ok([]) => std::thread::yield_now(),
                    Ok(done) => {
                        report.drained.extend_from_slice(done);
                        quiet_since = Instant::now();
                    }
                    Err(err) => {
                        first_error.get_or_insert(err);
                        break;
                    }
                }
            }
        }
        self.link.close();
        match first_error {
            Some(err) => Err(err),
            None => Ok(report),
        }
    }
}

/// Longest [`SessionLink::wait_for_peer`] sleeps at a time over the
/// connection manager, whose goodbye it cannot sleep on: how late it may
/// see one.
#[cfg(feature = "rdma_cm")]
pub(crate) const CM_GOODBYE_SLICE: Duration = Duration::from_millis(50);

impl SessionLink {
    /// The peer's control address.
    pub fn peer(&self) -> SocketAddr {
        self.peer
    }

    /// Regions the peer exported.
    pub fn remote_regions(&self) -> &[NamedRegion] {
        &self.remote_regions
    }

    /// The peer's region called `name`, for use on the first QP.
    pub fn remote_region(&self, name: &str) -> Option<RemoteRegion> {
        self.remote_region_on(name, 0)
    }

    /// The peer's region called `name`, for use on QP number `qp`.
    pub fn remote_region_on(&self, name: &str, qp: usize) -> Option<RemoteRegion> {
        self.remote_regions
            .iter()
            .find(|r| r.name == name)
            .and_then(|r| r.on_qp(qp))
    }

    /// Our regions this peer may access.
    pub fn exports(&self) -> &[Export] {
        &self.exports
    }

    /// The windows the peer reaches our exports through, one per export and
    /// QP (export-major order); they are revoked when the link goes.
    pub fn windows(&self) -> &[BoundWindow] {
        &self.windows
    }

    /// Looks at the control connection without blocking: a disconnect
    /// message, EOF, a reset or garbage all mean the peer is gone. A frame
    /// that arrives in pieces is kept until it is whole, so a peer that
    /// sends one byte at a time stalls nothing (a frame not whole within
    /// 5 s loses the peer); one `recv` when nothing came, and it allocates
    /// nothing. Over the connection manager: the peer's goodbye, or its
    /// `Disconnected` event (see [`Transport::RdmaCm`](super::Transport::RdmaCm)).
    pub fn check_peer(&mut self) -> PeerStatus {
        let status = match &mut self.control {
            ControlLink::Tcp(tcp) => tcp.check(self.peer),
            #[cfg(feature = "rdma_cm")]
            ControlLink::Cm(cm) => cm.check(),
        };
        if !matches!(status, PeerStatus::Alive) {
            // A peer seen gone is no longer connected: its place under the
            // server's `max_peers` is free for a newcomer, whenever the
            // session itself is let go.
            self.place = None;
        }
        status
    }

    /// As [`check_peer`](Self::check_peer), after sleeping until the
    /// control connection has something (the peer's goodbye, its leaving)
    /// or `timeout` passes, for a side with nothing else to do while its
    /// peer works: it does not wake every few milliseconds to look (on a
    /// shared core, such wake-ups land in the peer's measurements). It may
    /// return [`PeerStatus::Alive`] before `timeout`, so call it in a loop:
    /// a signal ends the sleep; while part of a frame is held it sleeps no
    /// longer than that frame's deadline; and over the connection manager,
    /// where the goodbye arrives on a CQ it cannot sleep on (only the
    /// peer's leaving reaches the event channel), it sleeps at most
    /// 50 ms at a time.
    pub fn wait_for_peer(&mut self, timeout: Duration) -> PeerStatus {
        let status = self.check_peer();
        if !matches!(status, PeerStatus::Alive) {
            return status;
        }
        let timeout = match &self.control {
            ControlLink::Tcp(_) => timeout,
            #[cfg(feature = "rdma_cm")]
            ControlLink::Cm(_) => timeout.min(CM_GOODBYE_SLICE),
        };
        let timeout = self
            .recheck_within()
            .map_or(timeout, |left| left.min(timeout));
        if let Err(source) = super::net::wait_readable(self, timeout) {
            return PeerStatus::Lost(Error::Os {
                what: "waiting on a peer's control connection",
                source,
            });
        }
        self.check_peer()
    }

    /// While part of a control frame is held: the time left until its
    /// deadline (just past it), after which [`check_peer`](Self::check_peer)
    /// must run again to lose the peer even if no more bytes come.
    pub fn recheck_within(&self) -> Option<Duration> {
        match &self.control {
            ControlLink::Tcp(tcp) => tcp.partial_since.map(|since| {
                CONTROL_FRAME_DEADLINE.saturating_sub(since.elapsed()) + Duration::from_millis(1)
            }),
            #[cfg(feature = "rdma_cm")]
            ControlLink::Cm(_) => None,
        }
    }

    /// Tells the peer that this side is leaving, with a reason code it reads
    /// from [`check_peer`](Self::check_peer) as
    /// [`PeerStatus::Disconnected`]. Sending it before an abort lets the
    /// peer report why instead of seeing a bare hang-up. The QPs keep
    /// running until the endpoint is closed or dropped, which send no second
    /// message; only the first call sends. Returns whether the message
    /// reached the socket (on a repeat call: whether the first one did).
    ///
    /// ```no_run
    /// # fn leave(endpoint: &mut rdma_comm_core::session::Endpoint) {
    /// const GIVING_UP: u16 = 7;
    /// endpoint.send_disconnect(GIVING_UP);
    /// # }
    /// ```
    pub fn send_disconnect(&mut self, code: u16) -> bool {
        if let Some(delivered) = self.disconnect_sent {
            return delivered;
        }
        let delivered = match &mut self.control {
            // The socket is non-blocking and the frame tiny: it goes into the
            // send buffer at once, or the peer stopped reading long ago.
            ControlLink::Tcp(tcp) => Message::Disconnect { code }
                .encode()
                .is_ok_and(|frame| matches!(tcp.stream.write(&frame), Ok(n) if n == frame.len())),
            #[cfg(feature = "rdma_cm")]
            ControlLink::Cm(cm) => cm.send_disconnect(code),
        };
        self.disconnect_sent = Some(delivered);
        delivered
    }

    /// Says goodbye (if not yet said) and shuts the control connection.
    pub fn close(&mut self) {
        if self.closed {
            return;
        }
        self.send_disconnect(0);
        match &mut self.control {
            ControlLink::Tcp(tcp) => {
                let _ = tcp.stream.shutdown(Shutdown::Both);
            }
            #[cfg(feature = "rdma_cm")]
            ControlLink::Cm(cm) => cm.disconnect(),
        }
        self.closed = true;
    }
}

/// The control connection's socket (non-blocking), or over the connection
/// manager the session's event channel: readable when the peer sent
/// something or left, for an event loop that waits on it and then calls
/// [`SessionLink::check_peer`].
impl AsFd for SessionLink {
    fn as_fd(&self) -> BorrowedFd<'_> {
        match &self.control {
            ControlLink::Tcp(tcp) => tcp.stream.as_fd(),
            #[cfg(feature = "rdma_cm")]
            ControlLink::Cm(cm) => cm.as_fd(),
        }
    }
}

/// What carries an established session's goodbye and shows a lost peer.
pub(super) enum ControlLink {
    /// The handshake's TCP connection.
    Tcp(TcpLink),
    /// The connection manager's control QP and event channel.
    #[cfg(feature = "rdma_cm")]
    Cm(Box<super::cm::CmLink>),
}

impl ControlLink {
    /// The handshake's TCP connection (non-blocking, with keepalive).
    pub(super) fn tcp(stream: TcpStream) -> Self {
        ControlLink::Tcp(TcpLink {
            stream,
            reader: FrameReader::new(CONTROL_MAX_PAYLOAD),
            partial_since: None,
        })
    }
}

/// The TCP control connection of an established session.
pub(super) struct TcpLink {
    /// Non-blocking: nothing on this link ever waits on the peer.
    stream: TcpStream,
    /// A control frame arriving in pieces.
    reader: FrameReader,
    /// When the frame in `reader` started arriving.
    partial_since: Option<Instant>,
}

impl TcpLink {
    fn check(&mut self, peer: SocketAddr) -> PeerStatus {
        let lost = |err: io::Error| Error::PeerGone {
            peer,
            source: err.into(),
        };
        loop {
            match self.reader.read_from(&mut self.stream) {
                Ok(Some(frame)) => {
                    self.partial_since = None;
                    return match Message::decode(frame) {
                        Ok((Message::Disconnect { code }, _)) => PeerStatus::Disconnected { code },
                        Ok((other, _)) => PeerStatus::Lost(Error::Protocol {
                            peer,
                            what: format!(
                                "unexpected control message {other:?} on an established endpoint"
                            ),
                        }),
                        Err(source) => PeerStatus::Lost(Error::PeerGone { peer, source }),
                    };
                }
                Ok(None) => {}
                Err(WireError::Io(err)) if err.kind() == io::ErrorKind::WouldBlock => {
                    if self.reader.pending() == 0 {
                        return PeerStatus::Alive;
                    }
                    let since = *self.partial_since.get_or_insert_with(Instant::now);
                    if since.elapsed() < CONTROL_FRAME_DEADLINE {
                        return PeerStatus::Alive;
                    }
                    return PeerStatus::Lost(lost(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "a control frame stopped arriving halfway",
                    )));
                }
                Err(WireError::Io(err)) if err.kind() == io::ErrorKind::UnexpectedEof => {
                    return PeerStatus::Lost(lost(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "control connection closed without a disconnect message",
                    )));
                }
                Err(source) => return PeerStatus::Lost(Error::PeerGone { peer, source }),
            }
        }
    }
}

impl Drop for SessionLink {
    fn drop(&mut self) {
        // Dropped without close(): still tell the peer, so it sees a clean
        // disconnect instead of transport retries. The QPs, wherever they
        // are, were stopped or destroyed before this (field order).
        self.close();
    }
}
