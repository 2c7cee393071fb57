//! Sessions over the RDMA connection manager ([`Transport::RdmaCm`]).
//!
//! The connection manager resolves the peer's IP address to a device, port
//! and route and connects one small *control QP* per session; the
//! handshake's frames (the same hello, authentication, offer and accept as
//! over TCP) travel as SENDs on it, one frame per message, and the
//! session's own QPs are connected by that handshake exactly as over TCP.
//! Once established, the control QP carries only the goodbye, and the
//! session's event channel (its descriptor is what a reactor waits on)
//! reports a peer whose process went away as `Disconnected`.
//!
//! What a stranger holds before it is authorized: one control QP with a
//! 4-entry CQ and [`CONTROL_BUFFERS`] bytes of registered buffers, no
//! remote access, for at most the server's hello timeout, within the same
//! pending-handshake limits (in all and per address) as over TCP.
//!
//! [`Transport::RdmaCm`]: super::Transport::RdmaCm

use std::collections::VecDeque;
use std::io;
use std::net::{SocketAddr, ToSocketAddrs};
use std::os::fd::{AsFd, BorrowedFd};
use std::time::{Duration, Instant};

use super::endpoint::PeerStatus;
use super::handshake::FrameIo;
use super::wire::{self, FRAME_HEADER_LEN, FrameReader, Message, WireError};
use crate::error::{CmFailure, Error, Result};
use crate::verbs::cm::{CmEvent, CmEventKind, CmId, ConnectRequest, EventChannel};
use crate::verbs::{
    AccessFlags, CompletionQueue, MemoryRegion, ProtectionDomain, QpConfig, QueuePair, RecvRequest,
    WorkCompletion, WorkRequest,
};

/// One message slot: the largest handshake frame.
const SLOT: usize = FRAME_HEADER_LEN + wire::MAX_PAYLOAD as usize;

/// Receives kept posted on a control QP. The handshake alternates, so two
/// are enough; a third frame waits in the sender's RNR retries (the control
/// QP retries them forever, within the handshake's deadline) until one is
/// reposted.
const RECV_SLOTS: usize = 2;

/// Registered bytes per control QP: its receive slots and one send slot.
pub const CONTROL_BUFFERS: usize = (RECV_SLOTS + 1) * SLOT;

/// The work request id of the control QP's one SEND; receives use their
/// slot's index.
const WR_SEND: u64 = u64::MAX;

/// The private data of a session's connect request: it names this crate's
/// session protocol and its version, so a request without it (rping, say)
/// is refused before anything is made for it. A refusal's private data is
/// the same tag and a reject code (big-endian).
const TAG: [u8; 8] = {
    let magic = wire::MAGIC.to_be_bytes();
    let version = wire::VERSION.to_be_bytes();
    [
        magic[0], magic[1], magic[2], magic[3], b'C', b'M', version[0], version[1],
    ]
};

/// How long one step of the connection manager (address, route, the
/// peer's answer) may take, within the connect deadline.
const CM_STEP: Duration = Duration::from_secs(5);

/// How long a goodbye waits for the peer's acknowledgement.
const GOODBYE_WAIT: Duration = Duration::from_millis(50);

/// Between polls of a control QP while a handshake waits.
const POLL_PAUSE: Duration = Duration::from_micros(200);

/// True when a connect request carries this crate's session tag.
pub(super) fn is_session_request(request: &ConnectRequest) -> bool {
    request.private_data().starts_with(&TAG)
}

/// Refuses a connect request with `code` in its private data.
pub(super) fn refuse(request: ConnectRequest, code: u16) {
    let mut data = [0u8; TAG.len() + 2];
    data[..TAG.len()].copy_from_slice(&TAG);
    data[TAG.len()..].copy_from_slice(&code.to_be_bytes());
    let _ = request.reject(&data);
}

/// The reject code in a refusal's private data, if it is one of ours.
fn refusal_code(private_data: &[u8]) -> Option<u16> {
    let code = private_data.strip_prefix(&TAG)?.get(..2)?;
    Some(u16::from_be_bytes([code[0], code[1]]))
}

/// A control QP and what it needs, made on a connection manager id's
/// device: the handshake's frame transport, then the established link.
pub(super) struct ControlQp {
    // Field order is drop order: the QP (which holds its id) before its
    // CQ and buffers, and those before their PD.
    qp: QueuePair,
    cq: CompletionQueue,
    recv: MemoryRegion,
    send: MemoryRegion,
    _pd: ProtectionDomain,
    id: Option<CmId>,
    channel: EventChannel,
    peer: SocketAddr,
    /// Frames received, not read yet: (slot, bytes).
    arrived: VecDeque<(usize, usize)>,
    /// The handshake's current deadline (the hello's, then the whole one).
    deadline: Instant,
    final_deadline: Instant,
    max_payload: u32,
    /// A server going away cuts its handshakes short.
    cut: Option<Box<dyn Fn() -> bool + Send>>,
}

impl ControlQp {
    /// The control QP for `id` (bound to a device), its receives posted.
    fn new(id: &CmId, channel: EventChannel, peer: SocketAddr) -> Result<Self> {
        let ctx = id.context()?;
        let pd = ctx.alloc_pd()?;
        let cq = ctx.create_cq(4, None)?;
        let config = QpConfig {
            max_send_wr: 1,
            max_recv_wr: RECV_SLOTS as u32,
            remote_access: AccessFlags::empty(),
            // A frame the peer has no receive for yet waits for one.
            rnr_retry: 7,
            ..QpConfig::default()
        };
        let recv = pd.alloc_mr(RECV_SLOTS * SLOT, AccessFlags::LOCAL_WRITE)?;
        let send = pd.alloc_mr(SLOT, AccessFlags::empty())?;
        let qp = id.create_qp(&pd, &cq, &cq, &config)?;
        let now = Instant::now();
        let mut control = Self {
            qp,
            cq,
            recv,
            send,
            _pd: pd,
            id: None,
            channel,
            peer,
            arrived: VecDeque::new(),
            deadline: now,
            final_deadline: now,
            max_payload: super::PRE_ADMISSION_MAX_PAYLOAD,
            cut: None,
        };
        for slot in 0..RECV_SLOTS {
            control.post_recv(slot)?;
        }
        Ok(control)
    }

    fn post_recv(&mut self, slot: usize) -> Result<()> {
        let slice = self.recv.slice(slot * SLOT, SLOT)?;
        self.qp.post_recv(RecvRequest::new(slot as u64, slice)?)
    }

    /// Sets the handshake's deadlines from now.
    fn set_deadlines(&mut self, timeout: Duration, hello_timeout: Duration) {
        let now = Instant::now();
        let after = |d: Duration| {
            now.checked_add(d)
                .unwrap_or(now + Duration::from_secs(365 * 86_400))
        };
        self.final_deadline = after(timeout);
        self.deadline = after(hello_timeout).min(self.final_deadline);
    }

    fn wire_error(&self, err: Error) -> WireError {
        WireError::Io(io::Error::other(err.to_string()))
    }

    /// Polls the CQ once: receives go to `arrived`; returns whether the
    /// SEND completed. A failed completion is an error.
    fn poll(&mut self) -> Result<bool> {
        let mut wcs = [WorkCompletion::default(); 4];
        let mut sent = false;
        let done = self.cq.poll(&mut wcs)?;
        for wc in done {
            wc.ok().map_err(|err| err.with_peer(Some(self.peer)))?;
            if wc.wr_id() == WR_SEND {
                sent = true;
            } else {
                self.arrived
                    .push_back((wc.wr_id() as usize, wc.byte_len() as usize));
            }
        }
        Ok(sent)
    }

    /// Fails on a connection manager event that ends the connection.
    fn check_events(&mut self) -> Result<()> {
        while let Some(event) = self.channel.try_get_event()? {
            if event.kind().is_failure() {
                return Err(event_error(
                    "the session's control connection",
                    &event,
                    self.peer,
                ));
            }
        }
        Ok(())
    }

    /// One round of waiting: the CQ, the events, the deadline, the cut.
    fn pump(&mut self, deadline: Instant) -> std::result::Result<bool, WireError> {
        let sent = self.poll().map_err(|err| self.wire_error(err))?;
        self.check_events().map_err(|err| self.wire_error(err))?;
        if sent || !self.arrived.is_empty() {
            return Ok(sent);
        }
        if self.cut.as_ref().is_some_and(|cut| cut()) {
            return Err(WireError::Io(io::Error::other(
                "the server is shutting down",
            )));
        }
        if Instant::now() >= deadline {
            return Err(WireError::Io(io::Error::new(
                io::ErrorKind::TimedOut,
                "handshake timed out",
            )));
        }
        std::thread::sleep(POLL_PAUSE);
        Ok(false)
    }

    /// Sends one frame and waits until the peer has it (or `deadline`).
    fn send_until(
        &mut self,
        frame: &[u8],
        deadline: Instant,
    ) -> std::result::Result<(), WireError> {
        if frame.len() > SLOT {
            return Err(WireError::Oversized {
                len: frame.len() as u32,
                max: SLOT as u32,
            });
        }
        let posted = self.send.write(0, frame).and_then(|()| {
            let slice = self.send.slice(0, frame.len())?;
            self.qp
                .post_send(WorkRequest::send(WR_SEND, slice).signaled())
        });
        posted.map_err(|err| self.wire_error(err))?;
        // The send buffer is written again only after this completion.
        while !self.pump(deadline)? {}
        Ok(())
    }

    /// Takes the next received message, reposting its slot.
    fn take_arrived(&mut self) -> std::result::Result<Option<Vec<u8>>, WireError> {
        let Some((slot, len)) = self.arrived.pop_front() else {
            return Ok(None);
        };
        let mut bytes = vec![0u8; len.min(SLOT)];
        let read = self.recv.read(slot * SLOT, &mut bytes);
        read.and_then(|()| self.post_recv(slot))
            .map_err(|err| self.wire_error(err))?;
        Ok(Some(bytes))
    }

    /// Decodes one message as exactly one frame of at most `max_payload`.
    fn one_frame(bytes: &[u8], max_payload: u32) -> std::result::Result<Vec<u8>, WireError> {
        let mut reader = FrameReader::new(max_payload);
        let mut source = bytes;
        loop {
            if let Some(frame) = reader.read_from(&mut source)? {
                if !source.is_empty() {
                    return Err(WireError::Malformed("bytes after the frame in a message"));
                }
                return Ok(frame.to_vec());
            }
        }
    }
}

impl FrameIo for ControlQp {
    fn peer(&self) -> SocketAddr {
        self.peer
    }

    fn send_frame(&mut self, frame: &[u8]) -> std::result::Result<(), WireError> {
        self.send_until(frame, self.deadline)
    }

    fn send_last(&mut self, frame: &[u8]) {
        let deadline = self.deadline.min(Instant::now() + super::LAST_FRAME_WAIT);
        let _ = self.send_until(frame, deadline);
    }

    fn admitted(&mut self) {
        self.deadline = self.final_deadline;
        self.max_payload = wire::MAX_PAYLOAD;
    }

    fn recv_frame(&mut self) -> std::result::Result<Vec<u8>, WireError> {
        loop {
            if let Some(bytes) = self.take_arrived()? {
                return Self::one_frame(&bytes, self.max_payload);
            }
            self.pump(self.deadline)?;
        }
    }
}

/// The error an ending event is for `what`.
fn event_error(what: &'static str, event: &CmEvent, peer: SocketAddr) -> Error {
    Error::Cm {
        op: what,
        peer: Some(peer),
        cause: CmFailure::Event {
            got: event.kind(),
            status: event.status(),
            expected: None,
        },
    }
}

/// The client's side: resolves `addr` and connects a control QP to the
/// session server there, within `deadline`. A server that is not
/// listening yet is retried with backoff; a refusal comes back as
/// [`Error::Rejected`] with the server's code.
pub(super) fn connect(
    addr: &impl ToSocketAddrs,
    handshake_timeout: Duration,
    deadline: Instant,
    backoff: (Duration, Duration),
) -> Result<ControlQp> {
    let os = |source| Error::Os {
        what: "resolving the session server's address",
        source,
    };
    let target = addr
        .to_socket_addrs()
        .map_err(os)?
        .next()
        .ok_or_else(|| os(io::Error::other("no address")))?;
    let (mut wait, max_wait) = backoff;
    loop {
        match connect_once(target, deadline) {
            // Nobody listens there (yet): come back within the deadline.
            Err(Error::Cm {
                cause:
                    CmFailure::Event {
                        got: CmEventKind::Rejected | CmEventKind::Unreachable,
                        ..
                    },
                ..
            }) if Instant::now() + wait < deadline => {
                std::thread::sleep(wait);
                wait = (wait * 2).min(max_wait);
            }
            Ok(mut control) => {
                control.set_deadlines(handshake_timeout, handshake_timeout);
                return Ok(control);
            }
            Err(err) => return Err(err),
        }
    }
}

fn connect_once(target: SocketAddr, deadline: Instant) -> Result<ControlQp> {
    let step = || {
        deadline
            .saturating_duration_since(Instant::now())
            .clamp(Duration::from_millis(1), CM_STEP)
    };
    let channel = EventChannel::new()?;
    let mut id = channel.create_id()?;
    id.resolve_addr(None, target, step())?;
    drop(channel.expect(&id, CmEventKind::AddrResolved, step())?);
    id.resolve_route(step())?;
    drop(channel.expect(&id, CmEventKind::RouteResolved, step())?);
    let peer = id.peer_addr().unwrap_or(target);
    let mut control = ControlQp::new(&id, channel, peer)?;
    id.connect(&control.qp, &TAG)?;
    let answer = loop {
        match control.channel.get_event(Some(step()))? {
            Some(event) if event.is_for(&id) => break event,
            Some(_) => {}
            None => {
                return Err(Error::Cm {
                    op: "waiting for the session server's answer",
                    peer: Some(peer),
                    cause: CmFailure::Timeout(step().as_millis() as u32),
                });
            }
        }
    };
    match answer.kind() {
        CmEventKind::ConnectResponse => {}
        CmEventKind::Rejected if refusal_code(answer.private_data()).is_some() => {
            let code = refusal_code(answer.private_data()).unwrap_or_default();
            return Err(Error::Rejected {
                peer,
                code,
                reason: "refused before the handshake (the server is busy)".into(),
            });
        }
        _ => return Err(event_error("rdma_connect", &answer, peer)),
    }
    drop(answer);
    id.establish(&mut control.qp)?;
    control.id = Some(id);
    Ok(control)
}

/// The server's side for one connect request: moves its id to a channel of
/// its own, makes the control QP and accepts. `cut` says when the server
/// is going away.
pub(super) fn accept(
    mut request: ConnectRequest,
    peer: SocketAddr,
    handshake_timeout: Duration,
    hello_timeout: Duration,
    cut: Box<dyn Fn() -> bool + Send>,
) -> Result<ControlQp> {
    let channel = EventChannel::new()?;
    request.migrate(&channel)?;
    let mut control = ControlQp::new(request.id(), channel, peer)?;
    control.set_deadlines(handshake_timeout, hello_timeout);
    control.cut = Some(cut);
    let id = request.accept(&mut control.qp, &[])?;
    control.id = Some(id);
    Ok(control)
}

impl ControlQp {
    /// The established session's link.
    pub(super) fn into_link(mut self) -> CmLink {
        self.cut = None;
        CmLink {
            control: self,
            lost: false,
        }
    }
}

/// An established session's control QP and event channel.
pub(super) struct CmLink {
    control: ControlQp,
    /// Set once the peer is known gone: no goodbye is waited for then.
    lost: bool,
}

impl CmLink {
    /// Looks for the peer's goodbye or the end of the connection, without
    /// blocking.
    pub(super) fn check(&mut self) -> PeerStatus {
        let status = self.look();
        if !matches!(status, PeerStatus::Alive) {
            self.lost = true;
        }
        status
    }

    fn look(&mut self) -> PeerStatus {
        let peer = self.control.peer;
        if let Err(err) = self.control.poll() {
            return PeerStatus::Lost(err);
        }
        if let Some(status) = self.goodbye() {
            return status;
        }
        loop {
            match self.control.channel.try_get_event() {
                Ok(Some(event)) if event.kind().is_failure() => {
                    // The goodbye was acknowledged before the disconnect
                    // went out: if one came, it is in the CQ by now.
                    if self.control.poll().is_ok()
                        && let Some(status) = self.goodbye()
                    {
                        return status;
                    }
                    return PeerStatus::Lost(event_error(
                        "the session's control connection",
                        &event,
                        peer,
                    ));
                }
                Ok(Some(_)) => {}
                Ok(None) => return PeerStatus::Alive,
                Err(err) => return PeerStatus::Lost(err),
            }
        }
    }

    /// The peer's goodbye, or anything else it had no business sending.
    fn goodbye(&mut self) -> Option<PeerStatus> {
        let peer = self.control.peer;
        let bytes = match self.control.take_arrived() {
            Ok(bytes) => bytes?,
            Err(source) => return Some(PeerStatus::Lost(Error::PeerGone { peer, source })),
        };
        Some(match Message::decode(&bytes) {
            Ok((Message::Disconnect { code }, used)) if used == bytes.len() => {
                PeerStatus::Disconnected { code }
            }
            Ok((other, _)) => PeerStatus::Lost(Error::Protocol {
                peer,
                what: format!("unexpected control message {other:?} on an established endpoint"),
            }),
            Err(source) => PeerStatus::Lost(Error::PeerGone { peer, source }),
        })
    }

    /// Sends the goodbye and waits briefly for the peer's acknowledgement
    /// (not at all once the peer is known gone); whether it got one.
    pub(super) fn send_disconnect(&mut self, code: u16) -> bool {
        if self.lost {
            return false;
        }
        let Ok(frame) = (Message::Disconnect { code }).encode() else {
            return false;
        };
        let deadline = Instant::now() + GOODBYE_WAIT;
        self.control.send_until(&frame, deadline).is_ok()
    }

    /// Disconnects: the peer's side reports `Disconnected`.
    pub(super) fn disconnect(&mut self) {
        if let Some(id) = self.control.id.as_mut() {
            let _ = id.disconnect();
        }
    }
}

/// The session's event channel: readable when the connection manager has
/// news (the peer's disconnect, above all).
impl AsFd for CmLink {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.control.channel.as_fd()
    }
}

/// A listening id on a channel of its own, bound to `addr` (port 0 picks
/// one); returns it with the address it is bound to.
pub(super) fn listen(
    addr: impl ToSocketAddrs,
    backlog: usize,
) -> Result<(EventChannel, CmId, SocketAddr)> {
    let os = |source| Error::Os {
        what: "resolving the session listener's address",
        source,
    };
    let addr = addr
        .to_socket_addrs()
        .map_err(os)?
        .next()
        .ok_or_else(|| os(io::Error::other("no address")))?;
    let channel = EventChannel::new()?;
    let mut id = channel.create_id()?;
    id.bind(addr)?;
    id.listen(backlog.clamp(1, usize::from(u16::MAX)) as u16)?;
    let local = id.local_addr().unwrap_or(addr);
    Ok((channel, id, local))
}
