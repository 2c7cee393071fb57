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
//! What a stranger holds before it is authorized: a handshake thread, an
//! event channel, a kernel id, and on the id's device a PD, a 4-entry CQ,
//! one control QP without remote access and [`CONTROL_BUFFERS`] bytes of
//! registered buffers (a frame longer than a slot arrives in several
//! SENDs), for at most the server's hello timeout (and the time its
//! `authorize` callback takes, then 200 ms more for a frame in flight or a
//! refusal to go out), within the same pending-handshake limits as over
//! TCP. The per-address limit counts the
//! address the request carries, which a host on the same network can forge.
//!
//! [`Transport::RdmaCm`]: super::Transport::RdmaCm

mod link;

use std::collections::VecDeque;
use std::io;
use std::net::{SocketAddr, ToSocketAddrs};
use std::time::{Duration, Instant};

use super::handshake::FrameIo;
use super::reject_code;
use super::wire::{self, FrameReader, WireError};
use crate::error::{CmFailure, Error, Result};
use crate::verbs::cm::CmEventKind;
use crate::verbs::cm::{CmEvent, CmId, ConnectRequest, EventChannel};

use crate::verbs::{
    AccessFlags, CompletionQueue, MemoryRegion, ProtectionDomain, QpConfig, QueuePair, RecvRequest,
    WorkCompletion, WorkRequest,
};
pub(super) use link::CmLink;

/// One message slot. A frame longer than this travels in several SENDs,
/// which the receiver reads as one byte stream (bounded as over TCP), so a
/// stranger's handshake pins little memory.
const SLOT: usize = 4096;

/// Receives kept posted on a control QP. The handshake alternates, and
/// each piece of a long frame is acknowledged before the next is sent;
/// a piece that finds no receive waits in the sender's RNR retries (within
/// the sender's deadline) until one is reposted.
const RECV_SLOTS: usize = 2;

/// Registered bytes per control QP, for the session's whole life: its
/// receive slots and one send slot.
pub const CONTROL_BUFFERS: usize = (RECV_SLOTS + 1) * SLOT;

/// The work request id of the control QP's one SEND; receives use their
/// slot's index.
const WR_SEND: u64 = u64::MAX;

/// The private data of a session's connect request: it names this crate's
/// session protocol (magic, "CM") and its version, so a request without
/// it (rping, say) is refused before anything is made for it. A refusal's
/// private data is the same tag and a reject code (big-endian).
const TAG: [u8; 8] = {
    let magic = wire::MAGIC.to_be_bytes();
    let version = wire::VERSION.to_be_bytes();
    [
        magic[0], magic[1], magic[2], magic[3], b'C', b'M', version[0], version[1],
    ]
};

/// The InfiniBand CM's reject reason when nobody listens on the port
/// (`IB_CM_REJ_INVALID_SERVICE_ID`): the one refusal a client retries.
const REJECT_NO_LISTENER: i32 = 8;

/// How long one step of the connection manager (address, route, the
/// peer's answer) may take, within the connect deadline.
const CM_STEP: Duration = Duration::from_secs(5);

/// How long a goodbye is given to reach the peer before the connection is
/// torn down anyway, by a background thread: no reactor waits for it.
const GOODBYE_WAIT: Duration = Duration::from_secs(1);

/// Between polls of a control QP while a handshake or a goodbye waits.
const POLL_PAUSE: Duration = Duration::from_micros(200);

/// True when a connect request carries this crate's session tag (any
/// version: a version the server does not speak is answered in the
/// handshake, as over TCP).
pub(super) fn is_session_request(request: &ConnectRequest) -> bool {
    request.private_data().starts_with(&TAG[..6])
}

/// Refuses a connect request with `code` in its private data.
pub(super) fn refuse(request: ConnectRequest, code: u16) {
    let mut data = [0u8; TAG.len() + 2];
    data[..TAG.len()].copy_from_slice(&TAG);
    data[TAG.len()..].copy_from_slice(&code.to_be_bytes());
    let _ = request.reject(&data);
}

/// What a tagged refusal says: its reject code; `None` when the private
/// data is not a refusal of this crate's.
fn refusal_code(private_data: &[u8]) -> Option<u16> {
    let rest = private_data.strip_prefix(&TAG[..6])?;
    Some(u16::from_be_bytes([*rest.get(2)?, *rest.get(3)?]))
}

/// What a reject code means, for the error the client returns.
fn refusal_reason(code: u16) -> &'static str {
    match code {
        reject_code::BUSY => "refused before the handshake: the server is busy",
        reject_code::BAD_REQUEST => "refused before the handshake: not a session request",
        _ => "refused before the handshake",
    }
}

/// Says when a server is going away (its handshakes then end).
pub(super) type CutFn = Box<dyn Fn() -> bool + Send + Sync>;

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
    /// Messages received, not read yet: (slot, bytes).
    arrived: VecDeque<(usize, usize)>,
    /// The handshake's byte stream: the message being read, how far, and
    /// the reader of the frame it belongs to.
    chunk: Vec<u8>,
    chunk_read: usize,
    reader: FrameReader,
    /// Our one SEND is posted and not completed: the send buffer is the
    /// NIC's until it completes.
    sending: bool,
    /// The event that ended the connection, once one came (kept, whoever
    /// read it off the channel).
    ended: Option<(CmEventKind, i32)>,
    /// The handshake's current deadline (the hello's, then the whole one).
    deadline: Instant,
    /// A frame was acknowledged only after the deadline or the cut (see
    /// `send_until`), which one: the handshake reads and sends nothing
    /// more, and fails with this.
    expired: Option<Expired>,
    final_deadline: Instant,
    cut: Option<CutFn>,
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
            // A piece the peer has no receive for yet waits for one; every
            // wait is bounded by a deadline of ours.
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
            chunk: Vec::new(),
            chunk_read: 0,
            reader: FrameReader::new(super::PRE_ADMISSION_MAX_PAYLOAD),
            sending: false,
            ended: None,
            deadline: now,
            expired: None,
            final_deadline: now,
            cut: None,
        };
        for slot in 0..RECV_SLOTS {
            control.post_recv(slot)?;
        }
        Ok(control)
    }

    fn post_recv(&mut self, slot: usize) -> Result<()> {
        let slice = self.recv.slice(slot * SLOT, SLOT)?;
        self.qp
            .post_recv(&mut RecvRequest::new(slot as u64, slice)?)
    }

    /// Sets the handshake's deadlines from now.
    fn set_deadlines(&mut self, timeout: Duration, hello_timeout: Duration) {
        let now = Instant::now();
        let after = |d: Duration| super::deadline_after(now, d);
        self.final_deadline = after(timeout);
        self.deadline = after(hello_timeout).min(self.final_deadline);
    }

    /// A library error where the handshake's transport wants an I/O one.
    fn wire_error(&self, err: Error) -> WireError {
        WireError::Io(io::Error::other(err.to_string()))
    }

    /// The end of the connection as the handshake sees it. The peer's
    /// disconnect is a cut ([`io::ErrorKind::ConnectionReset`], as a TCP
    /// reset is): before our `Ready` a client may try the handshake again
    /// (see `handshake::is_cut`). Any other end is final.
    fn ended_wire_error(&self, err: Error) -> WireError {
        let kind = match self.ended {
            Some((CmEventKind::Disconnected, _)) => io::ErrorKind::ConnectionReset,
            _ => io::ErrorKind::Other,
        };
        WireError::Io(io::Error::new(kind, err.to_string()))
    }

    /// Polls the CQ once: receives go to `arrived`; returns whether our
    /// SEND completed. A failed completion is an error.
    fn poll(&mut self) -> Result<bool> {
        let mut wcs = [WorkCompletion::default(); 4];
        let mut sent = false;
        let done = self.cq.poll(&mut wcs)?;
        for wc in done {
            if wc.wr_id() == WR_SEND {
                self.sending = false;
            }
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

    /// Reads the connection manager's events; notes the one that ended the
    /// connection, and fails with it from then on.
    fn check_events(&mut self) -> Result<()> {
        while self.ended.is_none() {
            let Some(event) = self.channel.try_get_event()? else {
                break;
            };
            if event.kind().is_failure() {
                self.ended = Some((event.kind(), event.status()));
            }
        }
        match self.ended {
            Some((got, status)) => Err(ended_error(got, status, self.peer)),
            None => Ok(()),
        }
    }

    /// One round of waiting: the CQ and the events, then the cut and the
    /// deadline, then a pause if nothing came. Returns whether our SEND
    /// completed.
    fn pump(&mut self, deadline: Instant) -> std::result::Result<bool, WireError> {
        let before = self.arrived.len();
        let sent = self.poll().map_err(|err| self.wire_error(err))?;
        if sent {
            return Ok(true);
        }
        if let Err(err) = self.check_events() {
            // What the peer sent before it left (a rejection, say) was
            // acknowledged before its disconnect, so it is in our CQ by
            // now: it is read first, and the end (kept) comes after.
            let late = self.poll().map_err(|err| self.wire_error(err))?;
            if late || self.arrived.len() > before {
                return Ok(late);
            }
            return Err(self.ended_wire_error(err));
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
        if self.arrived.len() == before {
            std::thread::sleep(POLL_PAUSE);
        }
        Ok(false)
    }

    /// Posts `bytes` (at most a slot) as one SEND. The buffer is the NIC's
    /// until it completes, so nothing is posted while one is in flight.
    fn post(&mut self, bytes: &[u8]) -> Result<()> {
        if self.sending {
            return Err(Error::InvalidArgument(
                "the control QP's previous SEND has not completed",
            ));
        }
        self.send.write(0, bytes)?;
        let slice = self.send.slice(0, bytes.len())?;
        self.qp
            .post_send(&mut WorkRequest::send(WR_SEND, slice).signaled())?;
        self.sending = true;
        Ok(())
    }

    /// Sends one frame, a slot at a time, each acknowledged before the
    /// next, within `deadline`. Nothing is posted once the deadline has
    /// passed or the server is going away, and a piece in flight when
    /// either comes is seen through: its acknowledgement gets up to
    /// `LAST_FRAME_WAIT` more, once. So a server that gives up has not
    /// just handed its peer the `Ready` that ends the handshake (short of
    /// a lost acknowledgement). A handshake whose piece was acknowledged
    /// that late is over ([`expired`](Self::expired)): nothing is read or
    /// sent after it, so it ends at most `LAST_FRAME_WAIT` past its
    /// deadline.
    ///
    /// `see_through`: whether a piece in flight at the deadline gets that
    /// extra time (not for the last frame, whose deadline is its own).
    fn send_until(
        &mut self,
        frame: &[u8],
        deadline: Instant,
        see_through: bool,
    ) -> std::result::Result<(), WireError> {
        for piece in frame.chunks(SLOT) {
            if self.cut.as_ref().is_some_and(|cut| cut()) {
                return Err(WireError::Io(io::Error::other(
                    "the server is shutting down",
                )));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(WireError::Io(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "handshake timed out writing to the peer",
                )));
            }
            self.post(piece).map_err(|err| self.wire_error(err))?;
            // The cut is watched here, not in `pump`: it shortens the wait
            // instead of ending it.
            let cut = self.cut.take();
            let mut until = deadline;
            let mut extended = None;
            let acknowledged = loop {
                if see_through && extended.is_none() && cut.as_ref().is_some_and(|cut| cut()) {
                    extended = Some(Expired::Cut);
                    until = until.min(Instant::now() + super::LAST_FRAME_WAIT);
                }
                match self.pump(until) {
                    Ok(true) => break Ok(()),
                    Ok(false) => {}
                    Err(WireError::Io(io))
                        if see_through
                            && extended.is_none()
                            && io.kind() == io::ErrorKind::TimedOut =>
                    {
                        extended = Some(Expired::Deadline);
                        until = Instant::now() + super::LAST_FRAME_WAIT;
                    }
                    Err(err) => break Err(err),
                }
            };
            self.cut = cut;
            acknowledged?;
            if extended.is_some() {
                // (A next piece of this frame is refused before it is
                // posted: the deadline has passed, or the cut has fired.)
                self.expired = extended;
            }
        }
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
}

/// What a frame in flight was seen through past (see
/// [`ControlQp::send_until`]).
#[derive(Debug, Clone, Copy)]
enum Expired {
    /// The handshake's deadline.
    Deadline,
    /// The server's cut: it is going away.
    Cut,
}

impl Expired {
    /// The error the handshake ends with once a frame was seen through.
    fn error(expired: Option<Self>) -> WireError {
        WireError::Io(match expired {
            Some(Self::Cut) => io::Error::other("the server is shutting down"),
            _ => io::Error::new(
                io::ErrorKind::TimedOut,
                "handshake timed out (its last frame was acknowledged after the deadline)",
            ),
        })
    }
}

impl FrameIo for ControlQp {
    fn peer(&self) -> SocketAddr {
        self.peer
    }

    fn send_frame(&mut self, frame: &[u8]) -> std::result::Result<(), WireError> {
        if self.expired.is_some() {
            return Err(Expired::error(self.expired));
        }
        self.send_until(frame, self.deadline, true)
    }

    /// The last frame (a refusal) is posted, and gets `LAST_FRAME_WAIT` to
    /// be acknowledged, even past the handshake's deadline or once the
    /// server is going away (over TCP a shutdown closes the socket first):
    /// the disconnect that follows must not overtake it.
    fn send_last(&mut self, frame: &[u8]) {
        // A frame seen through past the deadline had those 200 ms already.
        if self.expired.is_some() {
            return;
        }
        let deadline = Instant::now() + super::LAST_FRAME_WAIT;
        let cut = self.cut.take();
        let _ = self.send_until(frame, deadline, false);
        self.cut = cut;
    }

    fn admitted(&mut self) {
        self.reader.set_max_payload(wire::MAX_PAYLOAD);
    }

    fn proven(&mut self) {
        self.deadline = self.final_deadline;
    }

    fn recv_frame(&mut self) -> std::result::Result<Vec<u8>, WireError> {
        if self.expired.is_some() {
            return Err(Expired::error(self.expired));
        }
        loop {
            // The messages are one byte stream: a frame may span several.
            while self.chunk_read < self.chunk.len() {
                let mut source = &self.chunk[self.chunk_read..];
                let before = source.len();
                let frame = self.reader.read_from(&mut source)?;
                self.chunk_read += before - source.len();
                if let Some(frame) = frame {
                    return Ok(frame.to_vec());
                }
            }
            if let Some(bytes) = self.take_arrived()? {
                self.chunk = bytes;
                self.chunk_read = 0;
                continue;
            }
            self.pump(self.deadline)?;
        }
    }
}

/// The error for an event that came instead of the one awaited.
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

/// The error for the event that ended a session's control connection.
fn ended_error(got: CmEventKind, status: i32, peer: SocketAddr) -> Error {
    Error::Cm {
        op: "the session's control connection",
        peer: Some(peer),
        cause: CmFailure::Event {
            got,
            status,
            expected: None,
        },
    }
}

/// The client's side: resolves `addr` and connects a control QP to the
/// session server there, within `deadline`; the handshake then has
/// `handshake_timeout`, but no time past `deadline`. With `retry`, a
/// server that is not listening yet (or not reachable yet) is tried again
/// with backoff; without, that is an error [`not_there`] tells. A
/// server's refusal comes back as [`Error::Rejected`] with its code.
pub(super) fn connect(
    addr: &impl ToSocketAddrs,
    handshake_timeout: Duration,
    deadline: Instant,
    backoff: (Duration, Duration),
    retry: bool,
) -> Result<ControlQp> {
    let target = first_address(addr, "resolving the session server's address")?;
    let (initial, max_wait) = backoff;
    let mut wait = super::client::first_backoff(initial, max_wait);
    loop {
        match connect_once(target, deadline) {
            Err(err)
                if retry
                    && not_there(&err)
                    && Instant::now()
                        .checked_add(wait)
                        .is_some_and(|then| then < deadline) =>
            {
                std::thread::sleep(wait);
                wait = super::client::next_backoff(wait, max_wait);
            }
            Ok(mut control) => {
                // Counted from now, and ending at the deadline at the latest.
                let timeout = handshake_timeout.min(
                    deadline
                        .saturating_duration_since(Instant::now())
                        .max(Duration::from_millis(1)),
                );
                control.set_deadlines(timeout, timeout);
                return Ok(control);
            }
            Err(err) => return Err(err),
        }
    }
}

/// Nobody listens there (yet), or the peer did not answer: worth another
/// try within the deadline, except on the attempt after a cut, where it
/// means the server went away. Any other refusal is final.
pub(super) fn not_there(err: &Error) -> bool {
    matches!(
        err,
        Error::Cm {
            cause: CmFailure::Event {
                got: CmEventKind::Unreachable,
                ..
            } | CmFailure::Event {
                got: CmEventKind::Rejected,
                status: REJECT_NO_LISTENER,
                ..
            },
            ..
        }
    )
}

/// An rdma_cm step whose time ran out: an event that did not come within
/// our wait, or one that reports the kernel's own timeout (an address or
/// route not resolved, a connect left unanswered).
pub(super) fn timed_out(err: &Error) -> bool {
    match err {
        Error::Cm {
            cause: CmFailure::Timeout(_),
            ..
        } => true,
        Error::Cm {
            cause: CmFailure::Event { status, .. },
            ..
        } => *status == -libc::ETIMEDOUT,
        _ => false,
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
    let wait = step();
    let answer = loop {
        match control.channel.get_event(Some(wait))? {
            Some(event) if event.is_for(&id) => break event,
            Some(_) => {}
            None => {
                return Err(Error::Cm {
                    op: "waiting for the session server's answer",
                    peer: Some(peer),
                    cause: CmFailure::Timeout(wait.as_millis().min(u128::from(u32::MAX)) as u32),
                });
            }
        }
    };
    match answer.kind() {
        CmEventKind::ConnectResponse => {}
        CmEventKind::Rejected => {
            if let Some(code) = refusal_code(answer.private_data()) {
                return Err(Error::Rejected {
                    peer,
                    code,
                    reason: refusal_reason(code).into(),
                });
            }
            return Err(event_error("rdma_connect", &answer, peer));
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
    cut: CutFn,
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

/// The first address `addr` resolves to; an error says `what` was being
/// resolved (rdma_cm binds and connects one address, not a list).
fn first_address(addr: &impl ToSocketAddrs, what: &'static str) -> Result<SocketAddr> {
    let os = |source| Error::Os { what, source };
    addr.to_socket_addrs()
        .map_err(os)?
        .next()
        .ok_or_else(|| os(io::Error::other("no address")))
}

/// A listening id on a channel of its own, bound to `addr` (port 0 picks
/// one); returns it with the address it is bound to.
pub(super) fn listen(
    addr: impl ToSocketAddrs,
    backlog: usize,
) -> Result<(EventChannel, CmId, SocketAddr)> {
    let addr = first_address(&addr, "resolving the session listener's address")?;
    let channel = EventChannel::new()?;
    let mut id = channel.create_id()?;
    id.bind(addr)?;
    id.listen(backlog.clamp(1, usize::from(u16::MAX)) as u16)?;
    let local = id.local_addr().unwrap_or(addr);
    Ok((channel, id, local))
}
