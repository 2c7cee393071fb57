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
//! // Server side:
//! let server = ServerSession::bind("0.0.0.0:7471", &pd, ServerConfig::default())?;
//! // Client side (elsewhere):
//! let config = ClientConfig::new(vec![QpSpec::new("data")]);
//! let mut endpoint = ClientSession::connect("server:7471", &pd, &config)?;
//! let data = endpoint.qp_by_name("data").unwrap();
//! println!("connected QP {} to {}", data.qp().qpn(), endpoint.peer());
//! # Ok::<(), rdma_comm_core::Error>(())
//! ```

mod client;
mod endpoint;
mod server;
pub mod wire;

use std::io::{self, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use client::{ClientConfig, ClientSession};
pub use endpoint::{CloseReport, Endpoint, NamedRegion, PeerStatus, SessionLink, SessionQp};
pub use server::{HandshakeFailure, ServerConfig, ServerSession};

use crate::error::{Error, Result};
use crate::verbs::{
    CqSource, Gid, MemoryRegion, Mtu, ProtectionDomain, QpConfig, QpEndpoint, QueuePair,
    Registration, SharedCq, SrqAttachment,
};
use wire::{Handshake, Message, QpInfo, RegionInfo, WireError};

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
/// The region must have been registered with remote access; its rkey is sent
/// only to the peer of the endpoint that exports it.
#[derive(Debug, Clone)]
pub struct Export {
    /// Caller-chosen id.
    pub id: u32,
    /// Caller-chosen name (at most 255 bytes).
    pub name: String,
    /// The region's registration: the endpoint (and then its link) keeps
    /// it registered while the peer may access it, even if the caller drops
    /// its [`MemoryRegion`] first.
    pub region: Registration,
    /// The region itself when it was exported shared ([`Export::shared`]),
    /// so that whoever serves the peer can read what it wrote.
    pub memory: Option<Arc<MemoryRegion>>,
}

impl Export {
    /// Offers `region` (a `&MemoryRegion` or its [`Registration`]) under `name`.
    pub fn new(id: u32, name: impl Into<String>, region: impl Into<Registration>) -> Self {
        Self {
            id,
            name: name.into(),
            region: region.into(),
            memory: None,
        }
    }

    /// Offers `memory` under `name` and keeps it readable through
    /// [`Export::memory`] (a server's per-peer inbox, say). Shared, it can
    /// no longer be written by the CPU: only the peer writes it.
    pub fn shared(id: u32, name: impl Into<String>, memory: Arc<MemoryRegion>) -> Self {
        Self {
            id,
            name: name.into(),
            region: memory.registration().clone(),
            memory: Some(memory),
        }
    }
}

/// Default time a handshake may take end to end.
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The TCP control connection during a handshake, with one overall deadline.
struct Control {
    stream: TcpStream,
    peer: SocketAddr,
    deadline: Instant,
}

impl Control {
    fn new(stream: TcpStream, peer: SocketAddr, timeout: Duration) -> Self {
        // Handshake messages are tiny; send them without Nagle delay.
        let _ = stream.set_nodelay(true);
        Self {
            stream,
            peer,
            deadline: Instant::now() + timeout,
        }
    }

    fn remaining(&self) -> Result<Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(self.wire_error(WireError::Io(io::Error::new(
                io::ErrorKind::TimedOut,
                "handshake timed out",
            ))));
        }
        Ok(left)
    }

    fn wire_error(&self, source: WireError) -> Error {
        Error::Handshake {
            peer: self.peer,
            source,
        }
    }

    fn send(&mut self, message: &Message) -> Result<()> {
        let left = self.remaining()?;
        let _ = self.stream.set_write_timeout(Some(left));
        message
            .write_to(&mut self.stream)
            .map_err(|e| self.wire_error(WireError::Io(e)))
    }

    fn recv(&mut self) -> Result<Message> {
        let left = self.remaining()?;
        let _ = self.stream.set_read_timeout(Some(left));
        Message::read_from(&mut self.stream).map_err(|err| {
            // A read timeout surfaces as WouldBlock on Linux; say what it means.
            let err = match err {
                WireError::Io(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    WireError::Io(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "handshake timed out waiting for the peer",
                    ))
                }
                other => other,
            };
            self.wire_error(err)
        })
    }

    /// Tells the peer why we give up, without waiting long if it does not read.
    fn reject(&mut self, code: u16, reason: &str) {
        let _ = self
            .stream
            .set_write_timeout(Some(Duration::from_millis(200)));
        let _ = self.stream.write_all(
            &Message::Reject {
                code,
                reason: reason.to_string(),
            }
            .encode(),
        );
    }

    fn protocol_error(&self, what: impl Into<String>) -> Error {
        Error::Protocol {
            peer: self.peer,
            what: what.into(),
        }
    }

    fn into_stream(self) -> TcpStream {
        // Leave the socket blocking without timeouts; the endpoint sets its own.
        let _ = self.stream.set_read_timeout(None);
        let _ = self.stream.set_write_timeout(None);
        self.stream
    }
}

/// Reject codes sent to a peer.
pub mod reject_code {
    /// The request was invalid (QP count, names, ...).
    pub const BAD_REQUEST: u16 = 1;
    /// Creating local resources failed.
    pub const RESOURCES: u16 = 2;
}

fn build_qps(pd: &ProtectionDomain, specs: &[QpSpec]) -> Result<Vec<SessionQp>> {
    let ctx = pd.context();
    specs
        .iter()
        .map(|spec| {
            let (qp, cq) = match &spec.cq {
                CqChoice::Private { entries } => {
                    let cq = ctx.create_cq(*entries, None)?;
                    (create_qp(pd, &cq, spec)?, Some(cq))
                }
                CqChoice::Shared(shared) => (create_qp(pd, shared, spec)?, None),
            };
            Ok(SessionQp::new(spec.name.clone(), qp, cq))
        })
        .collect()
}

fn create_qp(pd: &ProtectionDomain, cq: &impl CqSource, spec: &QpSpec) -> Result<QueuePair> {
    match &spec.srq {
        Some(srq) => pd.create_qp_with_srq(cq, cq, srq, &spec.qp),
        None => pd.create_qp(cq, cq, &spec.qp),
    }
}

fn local_handshake(qps: &[SessionQp], exports: &[Export]) -> Result<Handshake> {
    let qps = qps
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
        .map(|e| {
            let remote = e.region.remote()?;
            Ok(RegionInfo {
                id: e.id,
                name: e.name.clone(),
                addr: remote.addr(),
                len: remote.len(),
                rkey: remote.rkey(),
            })
        })
        .collect::<Result<_>>()?;
    Ok(Handshake { qps, regions })
}

/// Connects our qps, in order, to the peer's.
fn connect_qps(control: &Control, qps: &mut [SessionQp], remote: &[QpInfo]) -> Result<()> {
    if qps.len() != remote.len() {
        return Err(control.protocol_error(format!(
            "peer answered with {} QPs for our {}",
            remote.len(),
            qps.len()
        )));
    }
    for (session_qp, info) in qps.iter_mut().zip(remote) {
        let mtu = Mtu::from_bytes(u32::from(info.mtu))
            .ok_or_else(|| control.protocol_error(format!("invalid MTU {}", info.mtu)))?;
        let peer = QpEndpoint {
            qpn: info.qpn,
            psn: info.psn,
            gid: Gid(info.gid),
            lid: info.lid,
            mtu,
        };
        session_qp.qp_mut().connect(&peer)?;
    }
    Ok(())
}

fn check_qp_names(specs: &[QpSpec]) -> Result<()> {
    for (i, spec) in specs.iter().enumerate() {
        if spec.name.len() > 255 {
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
