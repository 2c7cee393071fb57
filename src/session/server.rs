//! The accepting side: one listener, a handshake thread per connection.

use std::fmt;
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use super::wire::{MAX_QPS, Message};
use super::{
    Control, CqChoice, DEFAULT_HANDSHAKE_TIMEOUT, Endpoint, Export, QpSpec, build_qps, connect_qps,
    local_handshake, reject_code,
};
use crate::error::{Error, Result};
use crate::verbs::{ProtectionDomain, QpConfig, SrqAttachment};

/// Builds the regions exported to one peer (called once per handshake).
pub type ExportFn = dyn Fn(SocketAddr, &ProtectionDomain) -> Result<Vec<Export>> + Send + Sync;

/// How the server builds each peer's endpoint.
#[derive(Clone)]
pub struct ServerConfig {
    /// QP settings for every QP a client asks for.
    pub qp: QpConfig,
    /// CQ for every QP: private per QP, or one the caller polls.
    pub cq: CqChoice,
    /// Shared receive queue for every QP (`None`: each QP its own).
    pub srq: Option<SrqAttachment>,
    /// Most qps one client may ask for.
    pub max_qps: usize,
    /// Stop accepting after this many successful handshakes (`None`: never).
    pub max_peers: Option<usize>,
    /// Time one handshake may take; a silent client is dropped after it.
    pub handshake_timeout: Duration,
    /// Handshakes in progress at once; connections beyond it are refused.
    pub max_pending_handshakes: usize,
    /// Regions to export to each peer (none by default).
    pub exports: Option<Arc<ExportFn>>,
}

impl fmt::Debug for ServerConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerConfig")
            .field("qp", &self.qp)
            .field("cq", &self.cq)
            .field("srq", &self.srq.is_some())
            .field("max_qps", &self.max_qps)
            .field("max_peers", &self.max_peers)
            .field("handshake_timeout", &self.handshake_timeout)
            .field("exports", &self.exports.is_some())
            .finish()
    }
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            qp: QpConfig::default(),
            cq: CqChoice::default(),
            srq: None,
            max_qps: 16,
            max_peers: None,
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
            max_pending_handshakes: 64,
            exports: None,
        }
    }
}

/// A handshake that did not produce an endpoint. The server logs it and
/// keeps serving.
#[derive(Debug)]
pub struct HandshakeFailure {
    /// Who connected.
    pub peer: SocketAddr,
    /// What went wrong.
    pub error: Error,
}

/// Listens for clients and turns each successful handshake into an [`Endpoint`].
///
/// Every connection gets its own handshake thread with a deadline, so a slow,
/// silent or malicious client never holds up anyone else's accept.
pub struct ServerSession {
    local_addr: SocketAddr,
    accepted: Receiver<Endpoint>,
    failures: Arc<Mutex<Vec<HandshakeFailure>>>,
    // Not the whole `Shared`: its Sender must die with the acceptor and the
    // handshake threads, so that accept() sees the end.
    pending: Arc<AtomicUsize>,
    shutdown: Arc<AtomicBool>,
    acceptor: Option<JoinHandle<()>>,
}

impl fmt::Debug for ServerSession {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerSession")
            .field("local_addr", &self.local_addr)
            .finish()
    }
}

/// Everything a handshake thread needs.
struct Shared {
    pd: ProtectionDomain,
    config: ServerConfig,
    accepted: Sender<Endpoint>,
    failures: Arc<Mutex<Vec<HandshakeFailure>>>,
    pending: Arc<AtomicUsize>,
    established: AtomicUsize,
    local_addr: SocketAddr,
}

impl ServerSession {
    /// Listens on `addr` (IPv4 or IPv6; port 0 picks a free port).
    pub fn bind(
        addr: impl ToSocketAddrs,
        pd: &ProtectionDomain,
        config: ServerConfig,
    ) -> Result<Self> {
        let listener = TcpListener::bind(addr).map_err(|source| Error::Os {
            what: "binding the session listener",
            source,
        })?;
        let local_addr = listener.local_addr().map_err(|source| Error::Os {
            what: "reading the listener address",
            source,
        })?;
        let (tx, rx) = mpsc::channel();
        let failures = Arc::new(Mutex::new(Vec::new()));
        let shutdown = Arc::new(AtomicBool::new(false));
        let pending = Arc::new(AtomicUsize::new(0));
        let shared = Arc::new(Shared {
            pd: pd.clone(),
            config,
            accepted: tx,
            failures: Arc::clone(&failures),
            pending: Arc::clone(&pending),
            established: AtomicUsize::new(0),
            local_addr,
        });
        let stop = Arc::clone(&shutdown);
        let acceptor = std::thread::Builder::new()
            .name(format!("rdma-accept-{}", local_addr.port()))
            .spawn(move || accept_loop(listener, shared, stop))
            .map_err(|source| Error::Os {
                what: "spawning the accept thread",
                source,
            })?;
        Ok(Self {
            local_addr,
            accepted: rx,
            failures,
            pending,
            shutdown,
            acceptor: Some(acceptor),
        })
    }

    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Blocks until the next peer is connected. `None` once no more will come
    /// (`max_peers` reached, or the listener failed).
    pub fn accept(&self) -> Option<Endpoint> {
        self.accepted.recv().ok()
    }

    /// Like [`accept`](Self::accept), giving up after `timeout`.
    pub fn accept_timeout(&self, timeout: Duration) -> Option<Endpoint> {
        self.accepted.recv_timeout(timeout).ok()
    }

    /// Handshakes in progress right now (each ends within the handshake timeout).
    pub fn pending_handshakes(&self) -> usize {
        self.pending.load(Ordering::Acquire)
    }

    /// Handshakes that failed since the last call (each was also logged).
    pub fn take_failures(&self) -> Vec<HandshakeFailure> {
        std::mem::take(
            &mut *self
                .failures
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner()),
        )
    }
}

impl Drop for ServerSession {
    fn drop(&mut self) {
        self.shutdown.store(true, Ordering::Release);
        // Wake the blocking accept() so the thread sees the flag.
        let _ = TcpStream::connect_timeout(&wake_addr(self.local_addr), Duration::from_millis(200));
        if let Some(acceptor) = self.acceptor.take() {
            let _ = acceptor.join();
        }
    }
}

/// The listener's address as a connectable one (0.0.0.0 / :: become loopback).
fn wake_addr(addr: SocketAddr) -> SocketAddr {
    let mut addr = addr;
    if addr.ip().is_unspecified() {
        addr.set_ip(match addr {
            SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
            SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
        });
    }
    addr
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>, shutdown: Arc<AtomicBool>) {
    loop {
        let (stream, peer) = match listener.accept() {
            Ok(conn) => conn,
            Err(err) => {
                if shutdown.load(Ordering::Acquire) {
                    return;
                }
                // EMFILE, ECONNABORTED and friends are per-connection; keep going.
                log::warn!("session accept on {:?}: {err}", listener.local_addr());
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        if shutdown.load(Ordering::Acquire) {
            return;
        }
        if let Some(max) = shared.config.max_peers
            && shared.established.load(Ordering::Acquire) >= max
        {
            return;
        }
        if shared.pending.fetch_add(1, Ordering::AcqRel) >= shared.config.max_pending_handshakes {
            shared.pending.fetch_sub(1, Ordering::AcqRel);
            record_failure(
                &shared,
                peer,
                Error::Protocol {
                    peer,
                    what: "too many handshakes in progress".into(),
                },
            );
            continue;
        }
        let worker = Arc::clone(&shared);
        let spawned = std::thread::Builder::new()
            .name(format!("rdma-handshake-{peer}"))
            .spawn(move || {
                let result = serve_handshake(&worker, stream, peer);
                worker.pending.fetch_sub(1, Ordering::AcqRel);
                match result {
                    Ok(endpoint) => {
                        let established = worker.established.fetch_add(1, Ordering::AcqRel) + 1;
                        // The receiver may be gone if the server was dropped.
                        let _ = worker.accepted.send(endpoint);
                        if worker.config.max_peers == Some(established) {
                            // Unblock accept() so the acceptor sees the limit and stops.
                            let _ = TcpStream::connect_timeout(
                                &wake_addr(worker.local_addr),
                                Duration::from_millis(200),
                            );
                        }
                    }
                    Err(error) => record_failure(&worker, peer, error),
                }
            });
        if let Err(err) = spawned {
            shared.pending.fetch_sub(1, Ordering::AcqRel);
            record_failure(
                &shared,
                peer,
                Error::Os {
                    what: "spawning a handshake thread",
                    source: err,
                },
            );
        }
    }
}

fn record_failure(shared: &Shared, peer: SocketAddr, error: Error) {
    log::warn!("session handshake from {peer} failed: {error}");
    shared
        .failures
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .push(HandshakeFailure { peer, error });
}

fn serve_handshake(shared: &Shared, stream: TcpStream, peer: SocketAddr) -> Result<Endpoint> {
    let config = &shared.config;
    let mut control = Control::new(stream, peer, config.handshake_timeout);
    let hello = match control.recv()? {
        Message::Hello(hello) => hello,
        other => return Err(control.protocol_error(format!("expected Hello, got {other:?}"))),
    };
    let max_qps = config.max_qps.min(MAX_QPS);
    if hello.qps.is_empty() || hello.qps.len() > max_qps {
        let reason = format!(
            "asked for {} QPs; this server allows 1 to {max_qps}",
            hello.qps.len()
        );
        control.reject(reject_code::BAD_REQUEST, &reason);
        return Err(control.protocol_error(reason));
    }

    let specs: Vec<QpSpec> = hello
        .qps
        .iter()
        .map(|c| QpSpec {
            name: c.name.clone(),
            cq: config.cq.clone(),
            qp: config.qp.clone(),
            srq: config.srq.clone(),
        })
        .collect();
    if let Err(err) = super::check_qp_names(&specs) {
        control.reject(reject_code::BAD_REQUEST, &err.to_string());
        return Err(control.protocol_error(err.to_string()));
    }
    let built = build_qps(&shared.pd, &specs).and_then(|qps| {
        let exports = match &config.exports {
            Some(make) => make(peer, &shared.pd)?,
            None => Vec::new(),
        };
        Ok((qps, exports))
    });
    let (mut qps, exports) = match built {
        Ok(built) => built,
        Err(err) => {
            control.reject(reject_code::RESOURCES, &err.to_string());
            return Err(err);
        }
    };
    let ours = local_handshake(&qps, &exports)?;
    connect_qps(&control, &mut qps, &hello.qps)?;
    control.send(&Message::Accept(ours))?;
    match control.recv()? {
        Message::Ready => {}
        other => return Err(control.protocol_error(format!("expected Ready, got {other:?}"))),
    }
    control.send(&Message::Ready)?;
    Ok(Endpoint::new(
        peer,
        qps,
        exports,
        hello.regions,
        control.into_stream(),
    ))
}
