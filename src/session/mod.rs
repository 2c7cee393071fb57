//! Connection set-up: out-of-band TCP handshake, server and client sessions,
//! and the endpoints they produce.
//!
//! A client opens a TCP connection and sends its qps (one RC QP each:
//! QPN, random PSN, GID, LID, MTU) and the regions it exports. The server
//! builds matching QPs, answers with its own, and both sides move their QPs to
//! RTS before exchanging `Ready`. The TCP connection stays open as the control
//! channel: it carries the disconnect message and reveals a dead peer.
//!
//! ```no_run
//! use std::time::Duration;
//! use rdma_comm_core::session::*;
//! use rdma_comm_core::verbs::*;
//!
//! let ctx = Context::open_default(None)?;
//! let pd = ctx.alloc_pd()?;
//! // Both sides hold the same key (a file of 32 random bytes, mode 600).
//! let key = AuthKey::from_file("/etc/myservice/rdma.key")?;
//! // Server side:
//! let server = ServerSession::bind("0.0.0.0:7471", &pd, ServerConfig::default().with_auth_key(key.clone()))?;
//! // Client side (elsewhere):
//! let config = ClientConfig::new(vec![QpSpec::new("data")]).with_auth_key(Some(key));
//! let mut endpoint = ClientSession::connect("server:7471", &pd, &config)?;
//! let data = endpoint.qp_by_name("data").unwrap();
//! println!("connected QP {} to {}", data.qp().qpn(), endpoint.peer());
//! # Ok::<(), rdma_comm_core::Error>(())
//! ```

mod auth;
mod client;
#[cfg(feature = "rdma_cm")]
mod cm;

/// The refusal of `Transport::RdmaCm` by a build without the `rdma_cm`
/// feature (client and server alike).
#[cfg(not(feature = "rdma_cm"))]
const RDMA_CM_OFF: &str = "Transport::RdmaCm needs the rdma_cm feature";
mod endpoint;
mod handshake;
pub(crate) mod net;
mod peer_places;
mod server;
pub mod wire;

use std::io::{self, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use auth::{AUTH_KEY_ENV, AuthKey, MIN_KEY_LEN};
pub use client::{ClientConfig, ClientSession};
#[cfg(feature = "rdma_cm")]
pub use cm::CONTROL_BUFFERS;
pub use endpoint::{CloseReport, Endpoint, NamedRegion, PeerStatus, SessionLink, SessionQp};
pub use handshake::{PeerHello, Refusal};
pub use server::{
    AuthorizeFn, ExportFn, FailureFn, HandshakeFailure, MAX_RECORDED_FAILURES, PlaceFn, QpHome,
    ServerConfig, ServerSession, ServerShutdown,
};

use crate::error::{Error, Result};
use crate::verbs::{
    AccessFlags, BoundWindow, CqSource, Gid, MemoryRegion, MemoryWindow, Mtu, ProtectionDomain,
    QpConfig, QpEndpoint, QueuePair, Registration, SendFlags, SharedCq, SrqAttachment,
};
use handshake::FrameIo;
use wire::{FrameReader, Handshake, QpInfo, RegionInfo, WireError};

/// How a session's peers find each other and talk before their QPs are
/// connected, and how a lost peer shows afterwards.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Transport {
    /// A TCP connection carries the handshake and stays open as the
    /// control connection, with keepalive: a peer whose host died is
    /// noticed within about 20 s even on an idle session.
    #[default]
    Tcp,
    /// The RDMA connection manager (librdmacm's `rdma_cm`) resolves the
    /// peer's IP address to a device, port and route, and connects a small
    /// control QP that carries the same handshake (one frame per SEND; see
    /// [`CONTROL_BUFFERS`] for what it holds) and later the goodbye. The
    /// session's QPs are connected by that handshake as over TCP. A peer
    /// whose process ends is reported through the connection manager's
    /// `Disconnected` event; a peer whose host dies sends nothing, so it is
    /// noticed only by traffic (a QP's retries running out, see
    /// [`QpConfig`]), not on an idle session. The address and port are the
    /// connection manager's (an RDMA-capable interface's IP address), not
    /// a TCP port: a server on `Transport::RdmaCm` opens no TCP socket.
    RdmaCm,
}

/// Which completion queue a session's QP reports to.
#[derive(Debug, Clone)]
pub enum CqChoice {
    /// A CQ of its own with this many entries, polled through the session QP.
    Private {
        /// CQ size.
        entries: u32,
    },
    /// A CQ the caller owns and polls (a reactor's, say).
    Shared(SharedCq),
    /// CQs the caller owns and polls, taken in turn by successive QPs: a
    /// server whose peers one reactor with several CQs serves, so that a
    /// thousand connections are not all charged to one CQ.
    Spread(CqSpread),
}

/// CQs that successive QPs take in turn (see [`CqChoice::Spread`]); clones
/// share the turn.
#[derive(Debug, Clone)]
pub struct CqSpread {
    cqs: Arc<[SharedCq]>,
    next: Arc<std::sync::atomic::AtomicUsize>,
}

impl CqSpread {
    /// A spread over `cqs`; `None` if there are none.
    pub fn new(cqs: Vec<SharedCq>) -> Option<Self> {
        (!cqs.is_empty()).then(|| Self {
            cqs: cqs.into(),
            next: Arc::default(),
        })
    }

    /// The CQs, in the order they are taken.
    pub fn cqs(&self) -> &[SharedCq] {
        &self.cqs
    }

    /// The CQ the next QP takes.
    fn take_turn(&self) -> &SharedCq {
        let turn = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        &self.cqs[turn % self.cqs.len()]
    }
}

impl Default for CqChoice {
    fn default() -> Self {
        CqChoice::Private { entries: 1024 }
    }
}

/// One QP of a session to open: a name, a CQ choice and the QP settings.
#[derive(Debug, Clone)]
pub struct QpSpec {
    /// Unique name within the endpoint (at most 255 bytes).
    pub name: String,
    /// Where completions go.
    pub cq: CqChoice,
    /// QP settings (queue depths, remote access, port, GID index).
    pub qp: QpConfig,
    /// Take receives from this shared receive queue instead of the QP's own
    /// receive queue.
    pub srq: Option<SrqAttachment>,
}

impl QpSpec {
    /// A QP with a private CQ and default settings.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            cq: CqChoice::default(),
            qp: QpConfig::default(),
            srq: None,
        }
    }
}

/// A local region offered to the peer for WRITE and/or READ.
///
/// Each peer gets its own type-2 memory window per QP, bound on the QP that
/// serves it: its key reaches the memory only through that QP, so a peer
/// that learns another peer's descriptor reaches nothing with it, and the
/// access ends when the session does. So the memory is registered with
/// `LOCAL_WRITE | MW_BIND` and no `REMOTE_*` flag (its own rkey then
/// reaches nothing), and `access` says what the peer may do. The windows
/// are zero-based: the peer is told address 0 and addresses offsets into
/// the region, never where it is in this process.
///
/// ```no_run
/// # use std::sync::Arc;
/// # use rdma_comm_core::session::Export;
/// # use rdma_comm_core::verbs::*;
/// # let pd = Context::open_default(None)?.alloc_pd()?;
/// let inbox = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND)?;
/// let export = Export::new(1, "inbox", &inbox, AccessFlags::REMOTE_WRITE);
/// # Ok::<(), rdma_comm_core::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct Export {
    /// Caller-chosen id.
    pub id: u32,
    /// Caller-chosen name (at most 255 bytes).
    pub name: String,
    /// The region's registration: the endpoint's windows keep it
    /// registered while the peer may access it, even if the caller drops
    /// its [`MemoryRegion`] first.
    pub region: Registration,
    /// What the peer may do: `REMOTE_WRITE` and/or `REMOTE_READ`
    /// (`REMOTE_ATOMIC` too, where the device has atomics).
    pub access: AccessFlags,
    /// The region itself when it was exported shared ([`Export::shared`]),
    /// so that whoever serves the peer can read what it wrote.
    pub memory: Option<Arc<MemoryRegion>>,
}

impl Export {
    /// Offers `region` (a `&MemoryRegion` or its [`Registration`]) under
    /// `name`, for `access`.
    pub fn new(
        id: u32,
        name: impl Into<String>,
        region: impl Into<Registration>,
        access: AccessFlags,
    ) -> Self {
        Self {
            id,
            name: name.into(),
            region: region.into(),
            access,
            memory: None,
        }
    }

    /// Offers `memory` under `name` for `access`, and keeps it readable
    /// through [`Export::memory`] (a server's per-peer inbox, say). Shared,
    /// it can no longer be written by the CPU: only the peer writes it.
    pub fn shared(
        id: u32,
        name: impl Into<String>,
        memory: Arc<MemoryRegion>,
        access: AccessFlags,
    ) -> Self {
        Self {
            id,
            name: name.into(),
            region: memory.registration().clone(),
            access,
            memory: Some(memory),
        }
    }
}

/// What a window may grant.
const WINDOW_RIGHTS: AccessFlags = AccessFlags::REMOTE_WRITE
    .union(AccessFlags::REMOTE_READ)
    .union(AccessFlags::REMOTE_ATOMIC);

/// Default time a handshake may take end to end.
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Default time a server gives a connection to prove itself (see
/// [`ServerConfig::hello_timeout`]).
pub const DEFAULT_HELLO_TIMEOUT: Duration = Duration::from_secs(2);

/// Largest frame payload before admission: a hello with the most QPs and
/// the longest names (about 16.3 KiB); proofs and rejections are smaller.
const PRE_ADMISSION_MAX_PAYLOAD: u32 = 17 * 1024;

/// Keepalive on established control connections: a peer that vanished
/// without a FIN or RST is noticed within idle + probes × interval (20 s).
const KEEPALIVE_IDLE: Duration = Duration::from_secs(5);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);
const KEEPALIVE_PROBES: u32 = 3;

/// `from` + `d`, or a year from `from` when `d` is too large for the clock
/// (a timeout of `Duration::MAX` means "no timeout").
fn deadline_after(from: Instant, d: Duration) -> Instant {
    from.checked_add(d)
        .unwrap_or(from + Duration::from_secs(365 * 86_400))
}

/// Longest a last frame (a refusal) is waited on. It gets this even past
/// the handshake's deadline: a refusal dropped for want of time would
/// reach the peer as a cut without a word, which a client tries again
/// instead of reading why (a slow `authorize` that then refuses, say). Over
/// rdma_cm a frame already posted when the deadline passes (or the server
/// starts going away) gets as long to be acknowledged instead, and the
/// handshake then ends without a refusal. So a handshake may end this much
/// past its deadline.
const LAST_FRAME_WAIT: Duration = Duration::from_millis(200);

/// The TCP control connection during a handshake. One absolute deadline
/// bounds the whole handshake: every read and write waits at most until
/// then, however the peer drips its bytes. Until the peer has proven
/// itself a shorter one applies, and until admission frames are capped at
/// what a hello needs.
struct Control {
    stream: TcpStream,
    peer: SocketAddr,
    deadline: Instant,
    final_deadline: Instant,
    reader: FrameReader,
}

impl Control {
    fn new(
        stream: TcpStream,
        peer: SocketAddr,
        timeout: Duration,
        hello_timeout: Duration,
    ) -> Self {
        // Handshake messages are tiny; send them without Nagle delay.
        let _ = stream.set_nodelay(true);
        let now = Instant::now();
        let after = |d: Duration| deadline_after(now, d);
        let final_deadline = after(timeout);
        Self {
            stream,
            peer,
            deadline: after(hello_timeout).min(final_deadline),
            final_deadline,
            reader: FrameReader::new(PRE_ADMISSION_MAX_PAYLOAD),
        }
    }

    /// Time left, or the timeout error once there is none.
    fn remaining(&self) -> std::result::Result<Duration, WireError> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(WireError::Io(io::Error::new(
                io::ErrorKind::TimedOut,
                "handshake timed out",
            )));
        }
        Ok(left)
    }

    fn write_until(
        &mut self,
        frame: &[u8],
        deadline: Instant,
    ) -> std::result::Result<(), WireError> {
        let mut sent = 0;
        while sent < frame.len() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(WireError::Io(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "handshake timed out writing to the peer",
                )));
            }
            self.stream.set_write_timeout(Some(left))?;
            match self.stream.write(&frame[sent..]) {
                Ok(0) => return Err(WireError::Io(io::ErrorKind::WriteZero.into())),
                Ok(n) => sent += n,
                Err(err) if is_timeout(&err) || err.kind() == io::ErrorKind::Interrupted => {}
                Err(err) => return Err(WireError::Io(err)),
            }
        }
        Ok(())
    }

    /// The stream for the endpoint: non-blocking, so nothing on a reactor
    /// thread ever waits on the peer, with keepalive, so a peer that
    /// vanished silently is noticed.
    fn into_stream(self) -> Result<TcpStream> {
        let os = |what| move |source| Error::Os { what, source };
        self.stream
            .set_nonblocking(true)
            .map_err(os("making the control connection non-blocking"))?;
        net::keepalive(
            &self.stream,
            KEEPALIVE_IDLE,
            KEEPALIVE_INTERVAL,
            KEEPALIVE_PROBES,
        )
        .map_err(os("enabling keepalive on the control connection"))?;
        Ok(self.stream)
    }
}

fn is_timeout(err: &io::Error) -> bool {
    // A socket timeout surfaces as WouldBlock on Linux.
    matches!(
        err.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

impl FrameIo for Control {
    fn peer(&self) -> SocketAddr {
        self.peer
    }

    fn send_frame(&mut self, frame: &[u8]) -> std::result::Result<(), WireError> {
        self.write_until(frame, self.deadline)
    }

    fn admitted(&mut self) {
        self.reader.set_max_payload(wire::MAX_PAYLOAD);
    }

    fn proven(&mut self) {
        self.deadline = self.final_deadline;
    }

    fn send_last(&mut self, frame: &[u8]) {
        // Its own short wait, even past the deadline: see `LAST_FRAME_WAIT`.
        let _ = self.write_until(frame, Instant::now() + LAST_FRAME_WAIT);
    }

    fn recv_frame(&mut self) -> std::result::Result<Vec<u8>, WireError> {
        loop {
            let left = self.remaining()?;
            self.stream.set_read_timeout(Some(left))?;
            match self.reader.read_from(&mut self.stream) {
                Ok(Some(frame)) => return Ok(frame.to_vec()),
                Ok(None) => {}
                Err(WireError::Io(err)) if is_timeout(&err) => {
                    self.remaining()?;
                }
                Err(err) => return Err(err),
            }
        }
    }
}

/// Reject codes sent to a peer.
pub mod reject_code {
    /// The request was invalid (QP count, names, message order, ...).
    pub const BAD_REQUEST: u16 = 1;
    /// Creating local resources failed.
    pub const RESOURCES: u16 = 2;
    /// A key is missing or wrong on one side.
    pub const UNAUTHENTICATED: u16 = 3;
    /// The server's admission refused the peer (authorize callback, peer
    /// limit).
    pub const UNAUTHORIZED: u16 = 4;
    /// The server is busy (too many handshakes in progress, from the
    /// peer's address or in all, or a full accept backlog): try again later.
    /// A client retries it within its connect deadline.
    pub const BUSY: u16 = 5;
}

/// Creates the QPs of `specs`, each with room in its send queue for the
/// `binds` window binds it will carry.
fn build_qps(pd: &ProtectionDomain, specs: &[QpSpec], binds: usize) -> Result<Vec<SessionQp>> {
    let ctx = pd.context();
    specs
        .iter()
        .map(|spec| {
            let mut spec = spec.clone();
            spec.qp.max_send_wr = spec.qp.max_send_wr.saturating_add(binds as u32);
            let (qp, cq) = match &spec.cq {
                CqChoice::Private { entries } => {
                    let cq = ctx.create_cq(*entries, None)?;
                    (create_qp(pd, &cq, &spec)?, Some(cq))
                }
                CqChoice::Shared(shared) => (create_qp(pd, shared, &spec)?, None),
                CqChoice::Spread(spread) => (create_qp(pd, spread.take_turn(), &spec)?, None),
            };
            Ok(SessionQp::new(spec.name.clone(), qp, cq))
        })
        .collect()
}

/// One window per export and QP (`[export][qp]`), bound once the QPs are
/// connected; their keys are known now, for the handshake.
struct ExportWindows(Vec<Vec<MemoryWindow>>);

impl ExportWindows {
    fn allocate(pd: &ProtectionDomain, exports: &[Export], qps: usize) -> Result<Self> {
        exports
            .iter()
            .map(|_| (0..qps).map(|_| pd.alloc_mw()).collect())
            .collect::<Result<_>>()
            .map(Self)
    }

    /// Binds every window on its QP (unsignaled: the QP's CQ may be a
    /// reactor's). The peer hears of the keys only after this, when the
    /// next handshake message goes out; its first access follows a TCP
    /// round trip, by which time the bind (queued first on the QP) has run.
    fn bind(self, qps: &mut [SessionQp], exports: &[Export]) -> Result<Vec<BoundWindow>> {
        let mut bound = Vec::new();
        for (export, windows) in exports.iter().zip(self.0) {
            for (session_qp, window) in qps.iter_mut().zip(windows) {
                let announced = window.rkey_when_bound();
                let window = session_qp.qp_mut().bind_window(
                    window,
                    &export.region,
                    export.access,
                    SendFlags::empty(),
                )?;
                debug_assert_eq!(window.rkey(), announced);
                bound.push(window);
            }
        }
        Ok(bound)
    }
}

fn create_qp(pd: &ProtectionDomain, cq: &impl CqSource, spec: &QpSpec) -> Result<QueuePair> {
    match &spec.srq {
        Some(srq) => pd.create_qp_with_srq(cq, cq, srq, &spec.qp),
        None => pd.create_qp(cq, cq, &spec.qp),
    }
}

fn local_handshake(
    qps: &[SessionQp],
    exports: &[Export],
    windows: &ExportWindows,
) -> Result<Handshake> {
    let qp_infos = qps
        .iter()
        .map(|c| {
            let ep = c.qp().endpoint();
            QpInfo {
                name: c.name().to_string(),
                qpn: ep.qpn,
                psn: ep.psn,
                gid: ep.gid.0,
                lid: ep.lid,
                mtu: ep.mtu.bytes() as u16,
            }
        })
        .collect();
    let regions = exports
        .iter()
        .zip(&windows.0)
        .map(|(e, windows)| RegionInfo {
            id: e.id,
            name: e.name.clone(),
            // The windows are bound zero-based: the peer addresses offsets.
            addr: 0,
            len: e.region.len() as u64,
            rkeys: windows.iter().map(MemoryWindow::rkey_when_bound).collect(),
        })
        .collect();
    Ok(Handshake {
        qps: qp_infos,
        regions,
    })
}

/// Connects our qps, in order, to the peer's.
fn connect_qps(peer: SocketAddr, qps: &mut [SessionQp], remote: &[QpInfo]) -> Result<()> {
    let protocol = |what: String| Error::Protocol { peer, what };
    if qps.len() != remote.len() {
        return Err(protocol(format!(
            "peer answered with {} QPs for our {}",
            remote.len(),
            qps.len()
        )));
    }
    for (session_qp, info) in qps.iter_mut().zip(remote) {
        let mtu = Mtu::from_bytes(u32::from(info.mtu))
            .ok_or_else(|| protocol(format!("invalid MTU {}", info.mtu)))?;
        let endpoint = QpEndpoint {
            qpn: info.qpn,
            psn: info.psn,
            gid: Gid(info.gid),
            lid: info.lid,
            mtu,
        };
        session_qp.qp_mut().connect(&endpoint)?;
    }
    Ok(())
}

fn check_qp_names(specs: &[QpSpec]) -> Result<()> {
    if specs.len() > wire::MAX_QPS {
        return Err(Error::InvalidArgument("an endpoint has at most 64 QPs"));
    }
    for (i, spec) in specs.iter().enumerate() {
        if spec.name.len() > wire::MAX_NAME_LEN {
            return Err(Error::InvalidArgument("QP names are at most 255 bytes"));
        }
        if specs[..i].iter().any(|other| other.name == spec.name) {
            return Err(Error::InvalidArgument(
                "QP names must be unique within an endpoint",
            ));
        }
    }
    Ok(())
}

/// Checks exports: what the wire carries (their number, name lengths), and
/// that each can be granted through windows only.
fn check_exports(pd: &ProtectionDomain, exports: &[Export]) -> Result<()> {
    if exports.len() > wire::MAX_REGIONS {
        return Err(Error::InvalidArgument("a side exports at most 64 regions"));
    }
    for export in exports {
        if export.name.len() > wire::MAX_NAME_LEN {
            return Err(Error::InvalidArgument("export names are at most 255 bytes"));
        }
        let registered = export.region.access();
        if registered.intersects(WINDOW_RIGHTS) {
            return Err(Error::InvalidArgument(
                "exported memory is registered without REMOTE_* rights (LOCAL_WRITE | MW_BIND): \
                 each peer gets them through a window of its own",
            ));
        }
        if !registered.contains(AccessFlags::MW_BIND) {
            return Err(Error::InvalidArgument(
                "exported memory is registered with MW_BIND",
            ));
        }
        if export.access.is_empty() || !WINDOW_RIGHTS.contains(export.access) {
            return Err(Error::InvalidArgument(
                "an export grants REMOTE_WRITE, REMOTE_READ and/or REMOTE_ATOMIC",
            ));
        }
        if export
            .access
            .intersects(AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC)
            && !registered.contains(AccessFlags::LOCAL_WRITE)
        {
            return Err(Error::InvalidArgument(
                "memory exported for REMOTE_WRITE or REMOTE_ATOMIC is registered with LOCAL_WRITE",
            ));
        }
        if !export.region.belongs_to(pd) {
            return Err(Error::InvalidArgument(
                "exported memory is registered in the session's protection domain",
            ));
        }
    }
    Ok(())
}
