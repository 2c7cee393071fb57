//! The accepting side: one listener, a handshake thread per connection,
//! every one of them bounded in number and in time.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::io::Write;
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use super::handshake::{self, PeerHello, Refusal, Resources};
use super::wire::{Handshake, MAX_QPS, Message};
use super::{
    AuthKey, Control, CqChoice, DEFAULT_HANDSHAKE_TIMEOUT, Endpoint, Export, QpSpec, SessionQp,
    build_qps, check_exports, connect_qps, local_handshake, reject_code,
};
use crate::error::{Error, Result};
use crate::verbs::{ProtectionDomain, QpConfig, SrqAttachment};

/// Builds the regions exported to one peer (called once per handshake,
/// after the peer was authenticated and admitted).
pub type ExportFn = dyn Fn(SocketAddr, &ProtectionDomain) -> Result<Vec<Export>> + Send + Sync;

/// Decides whether a peer is admitted, from its address and hello, before
/// anything is created for it. Runs on the peer's handshake thread, after
/// authentication when a key is configured.
pub type AuthorizeFn = dyn Fn(&PeerHello) -> std::result::Result<(), Refusal> + Send + Sync;

/// Most handshake failures kept for [`ServerSession::take_failures`]; older
/// ones are dropped (and counted by [`ServerSession::failed_handshakes`]).
pub const MAX_RECORDED_FAILURES: usize = 256;

/// How the server builds each peer's endpoint, and what it lets a stranger
/// hold.
#[derive(Clone)]
pub struct ServerConfig {
    /// QP settings for every QP a client asks for.
    pub qp: QpConfig,
    /// CQ for every QP: private per QP, or one the caller polls.
    pub cq: CqChoice,
    /// Shared receive queue for every QP (`None`: each QP its own).
    pub srq: Option<SrqAttachment>,
    /// Most QPs one client may ask for (at most [`MAX_QPS`]).
    pub max_qps: usize,
    /// Admit at most this many peers, then stop listening (`None`: no limit).
    pub max_peers: Option<usize>,
    /// Time one handshake may take from accept to ready, whatever the peer
    /// sends and however slowly: its thread and socket are gone by then.
    pub handshake_timeout: Duration,
    /// Handshakes in progress at once; connections beyond it are refused at
    /// once.
    pub max_pending_handshakes: usize,
    /// Handshakes in progress at once from one IP address, so that one
    /// host cannot take every pending slot.
    pub max_pending_per_address: usize,
    /// Established endpoints waiting for [`ServerSession::accept`]; a peer
    /// that would exceed it is refused before anything is created for it.
    pub accept_backlog: usize,
    /// The shared key clients must prove (and that this server proves to
    /// them). `None`: no authentication.
    pub auth_key: Option<AuthKey>,
    /// Admission callback (none: everyone who authenticates is admitted).
    pub authorize: Option<Arc<AuthorizeFn>>,
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
            .field("max_pending_handshakes", &self.max_pending_handshakes)
            .field("max_pending_per_address", &self.max_pending_per_address)
            .field("accept_backlog", &self.accept_backlog)
            .field("auth_key", &self.auth_key)
            .field("authorize", &self.authorize.is_some())
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
            max_pending_per_address: 8,
            accept_backlog: 64,
            auth_key: None,
            authorize: None,
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
/// Every connection gets its own handshake thread with one absolute
/// deadline, so a slow, silent or malicious client never holds up anyone
/// else's accept; how many run at once is bounded overall and per address.
/// Dropping the server stops listening, cuts every handshake in progress
/// and joins all its threads.
pub struct ServerSession {
    local_addr: SocketAddr,
    accepted: Receiver<Endpoint>,
    state: Arc<State>,
    acceptor: Option<JoinHandle<()>>,
}

impl fmt::Debug for ServerSession {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerSession")
            .field("local_addr", &self.local_addr)
            .finish()
    }
}

/// What the server and its threads share (not the sender of accepted
/// endpoints: it must die with the threads, so that accept() sees the end).
struct State {
    failures: Mutex<VecDeque<HandshakeFailure>>,
    failed: AtomicU64,
    pending: Mutex<Pending>,
    /// Peers admitted whose endpoint accept() has not taken yet.
    reserved: AtomicUsize,
    /// Peers admitted in all (for `max_peers`), less those that failed after.
    admitted: AtomicUsize,
    shutdown: AtomicBool,
}

/// Handshakes in progress: how many, from where, and their sockets (to cut
/// them when the server goes).
#[derive(Default)]
struct Pending {
    total: usize,
    per_address: HashMap<IpAddr, usize>,
    sockets: HashMap<u64, TcpStream>,
    next_id: u64,
}

/// Everything a handshake thread needs.
struct Worker {
    pd: ProtectionDomain,
    config: ServerConfig,
    accepted: SyncSender<Endpoint>,
    state: Arc<State>,
    local_addr: SocketAddr,
}

impl ServerSession {
    /// Listens on `addr` (IPv4 or IPv6; port 0 picks a free port).
    pub fn bind(
        addr: impl ToSocketAddrs,
        pd: &ProtectionDomain,
        config: ServerConfig,
    ) -> Result<Self> {
        if config.max_pending_handshakes == 0
            || config.max_pending_per_address == 0
            || config.accept_backlog == 0
        {
            return Err(Error::InvalidArgument(
                "pending-handshake limits and the accept backlog must be at least 1",
            ));
        }
        let listener = TcpListener::bind(addr).map_err(|source| Error::Os {
            what: "binding the session listener",
            source,
        })?;
        let local_addr = listener.local_addr().map_err(|source| Error::Os {
            what: "reading the listener address",
            source,
        })?;
        let (tx, rx) = mpsc::sync_channel(config.accept_backlog);
        let state = Arc::new(State {
            failures: Mutex::new(VecDeque::new()),
            failed: AtomicU64::new(0),
            pending: Mutex::new(Pending::default()),
            reserved: AtomicUsize::new(0),
            admitted: AtomicUsize::new(0),
            shutdown: AtomicBool::new(false),
        });
        let worker = Arc::new(Worker {
            pd: pd.clone(),
            config,
            accepted: tx,
            state: Arc::clone(&state),
            local_addr,
        });
        let acceptor = std::thread::Builder::new()
            .name(format!("rdma-accept-{}", local_addr.port()))
            .spawn(move || accept_loop(listener, worker))
            .map_err(|source| Error::Os {
                what: "spawning the accept thread",
                source,
            })?;
        Ok(Self {
            local_addr,
            accepted: rx,
            state,
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
        self.taken(self.accepted.recv().ok())
    }

    /// Like [`accept`](Self::accept), giving up after `timeout`.
    pub fn accept_timeout(&self, timeout: Duration) -> Option<Endpoint> {
        self.taken(self.accepted.recv_timeout(timeout).ok())
    }

    /// Like [`accept`](Self::accept), without waiting.
    pub fn try_accept(&self) -> Option<Endpoint> {
        self.taken(self.accepted.try_recv().ok())
    }

    fn taken(&self, endpoint: Option<Endpoint>) -> Option<Endpoint> {
        if endpoint.is_some() {
            self.state.reserved.fetch_sub(1, Ordering::AcqRel);
        }
        endpoint
    }

    /// Handshakes in progress right now (each ends within the handshake timeout).
    pub fn pending_handshakes(&self) -> usize {
        self.state.pending().total
    }

    /// Handshakes that failed or were refused since the server started.
    pub fn failed_handshakes(&self) -> u64 {
        self.state.failed.load(Ordering::Acquire)
    }

    /// Handshakes that failed since the last call, at most
    /// [`MAX_RECORDED_FAILURES`] of the latest (each was also logged).
    pub fn take_failures(&self) -> Vec<HandshakeFailure> {
        lock(&self.state.failures).drain(..).collect()
    }
}

impl Drop for ServerSession {
    fn drop(&mut self) {
        self.state.shutdown.store(true, Ordering::Release);
        // Wake the blocking accept() so the thread sees the flag.
        let _ = TcpStream::connect_timeout(&wake_addr(self.local_addr), Duration::from_millis(200));
        if let Some(acceptor) = self.acceptor.take() {
            let _ = acceptor.join();
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl State {
    fn pending(&self) -> MutexGuard<'_, Pending> {
        lock(&self.pending)
    }

    fn record_failure(&self, peer: SocketAddr, error: Error) {
        log::warn!("session handshake from {peer} failed: {error}");
        self.failed.fetch_add(1, Ordering::AcqRel);
        let mut failures = lock(&self.failures);
        if failures.len() == MAX_RECORDED_FAILURES {
            failures.pop_front();
        }
        failures.push_back(HandshakeFailure { peer, error });
    }

    /// Takes a pending slot for `peer`, or says why not.
    fn register(
        &self,
        config: &ServerConfig,
        peer: SocketAddr,
        stream: &TcpStream,
    ) -> std::result::Result<u64, String> {
        let mut pending = self.pending();
        if pending.total >= config.max_pending_handshakes {
            return Err(format!(
                "{} handshakes in progress, the most this server allows",
                pending.total
            ));
        }
        let from_address = pending.per_address.get(&peer.ip()).copied().unwrap_or(0);
        if from_address >= config.max_pending_per_address {
            return Err(format!(
                "{from_address} handshakes in progress from {}, the most this server allows \
                 from one address",
                peer.ip()
            ));
        }
        // A clone of the socket, so that a server going away can cut the
        // handshake short.
        let clone = stream.try_clone().map_err(|err| err.to_string())?;
        pending.total += 1;
        *pending.per_address.entry(peer.ip()).or_default() += 1;
        let id = pending.next_id;
        pending.next_id += 1;
        pending.sockets.insert(id, clone);
        Ok(id)
    }

    fn unregister(&self, id: u64, peer: SocketAddr) {
        let mut pending = self.pending();
        pending.total -= 1;
        pending.sockets.remove(&id);
        if let Some(count) = pending.per_address.get_mut(&peer.ip()) {
            *count -= 1;
            if *count == 0 {
                pending.per_address.remove(&peer.ip());
            }
        }
    }

    /// Cuts every handshake in progress: their reads and writes fail now.
    fn cut_pending(&self) {
        for socket in self.pending().sockets.values() {
            let _ = socket.shutdown(Shutdown::Both);
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

/// Tells a refused connection why, without waiting for it to read.
fn refuse_at_once(mut stream: TcpStream, reason: &str) {
    if stream.set_nonblocking(true).is_ok()
        && let Ok(frame) = Message::reject(reject_code::UNAUTHORIZED, reason).encode()
    {
        let _ = stream.write(&frame);
    }
}

fn accept_loop(listener: TcpListener, worker: Arc<Worker>) {
    let state = Arc::clone(&worker.state);
    let mut threads: Vec<JoinHandle<()>> = Vec::new();
    loop {
        let (stream, peer) = match listener.accept() {
            Ok(conn) => conn,
            Err(err) => {
                if state.shutdown.load(Ordering::Acquire) {
                    break;
                }
                // EMFILE, ECONNABORTED and friends are per-connection; keep going.
                log::warn!("session accept on {}: {err}", worker.local_addr);
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        threads.retain(|thread| !thread.is_finished());
        if state.shutdown.load(Ordering::Acquire) {
            break;
        }
        if let Some(max) = worker.config.max_peers
            && state.admitted.load(Ordering::Acquire) >= max
            && state.pending().total == 0
        {
            break;
        }
        let id = match state.register(&worker.config, peer, &stream) {
            Ok(id) => id,
            Err(reason) => {
                refuse_at_once(stream, &reason);
                state.record_failure(peer, Error::Unauthorized { peer, reason });
                continue;
            }
        };
        let thread_worker = Arc::clone(&worker);
        let spawned = std::thread::Builder::new()
            .name(format!("rdma-handshake-{peer}"))
            .spawn(move || run_handshake(&thread_worker, stream, peer, id));
        match spawned {
            Ok(thread) => threads.push(thread),
            Err(source) => {
                state.unregister(id, peer);
                state.record_failure(
                    peer,
                    Error::Os {
                        what: "spawning a handshake thread",
                        source,
                    },
                );
            }
        }
    }
    state.cut_pending();
    for thread in threads {
        let _ = thread.join();
    }
}

fn run_handshake(worker: &Worker, stream: TcpStream, peer: SocketAddr, id: u64) {
    let state = &worker.state;
    let mut admitted = false;
    let result = serve_handshake(worker, stream, peer, &mut admitted);
    state.unregister(id, peer);
    let endpoint = match result {
        Ok(endpoint) => endpoint,
        Err(error) => {
            if admitted {
                state.admitted.fetch_sub(1, Ordering::AcqRel);
                state.reserved.fetch_sub(1, Ordering::AcqRel);
            }
            state.record_failure(peer, error);
            return;
        }
    };
    match worker.accepted.try_send(endpoint) {
        Ok(()) => {}
        // Admission reserved room, so the queue is full only if the server
        // is gone; the endpoint goes with its QPs.
        Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
            state.reserved.fetch_sub(1, Ordering::AcqRel);
            return;
        }
    }
    if worker
        .config
        .max_peers
        .is_some_and(|max| state.admitted.load(Ordering::Acquire) >= max)
    {
        // Unblock accept() so the acceptor sees the limit and stops.
        let _ =
            TcpStream::connect_timeout(&wake_addr(worker.local_addr), Duration::from_millis(200));
    }
}

/// Admits a peer: a peer-limit slot, a backlog slot, then the user's say.
fn admit(worker: &Worker, hello: &PeerHello) -> std::result::Result<(), Refusal> {
    let state = &worker.state;
    let config = &worker.config;
    if state.shutdown.load(Ordering::Acquire) {
        return Err(Refusal::unauthorized("the server is shutting down"));
    }
    let max_peers = config.max_peers.unwrap_or(usize::MAX);
    if state
        .admitted
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
            (n < max_peers).then_some(n + 1)
        })
        .is_err()
    {
        return Err(Refusal::unauthorized("the server takes no more peers"));
    }
    let release_peer = || state.admitted.fetch_sub(1, Ordering::AcqRel);
    if state
        .reserved
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
            (n < config.accept_backlog).then_some(n + 1)
        })
        .is_err()
    {
        release_peer();
        return Err(Refusal::unauthorized(
            "the server is busy: its accept backlog is full",
        ));
    }
    if let Some(authorize) = &config.authorize
        && let Err(refusal) = authorize(hello)
    {
        release_peer();
        state.reserved.fetch_sub(1, Ordering::AcqRel);
        return Err(refusal);
    }
    Ok(())
}

/// The server's resources for one admitted peer.
struct ServerSide<'a> {
    worker: &'a Worker,
    peer: SocketAddr,
    qps: Vec<SessionQp>,
    exports: Vec<Export>,
}

impl Resources for ServerSide<'_> {
    fn build(&mut self, offer: Option<&Handshake>) -> Result<Handshake> {
        let config = &self.worker.config;
        let specs: Vec<QpSpec> = offer
            .map_or(&[][..], |offer| &offer.qps)
            .iter()
            .map(|qp| QpSpec {
                name: qp.name.clone(),
                cq: config.cq.clone(),
                qp: config.qp.clone(),
                srq: config.srq.clone(),
            })
            .collect();
        self.qps = build_qps(&self.worker.pd, &specs)?;
        if let Some(make) = &config.exports {
            self.exports = make(self.peer, &self.worker.pd)?;
            check_exports(&self.exports)?;
        }
        local_handshake(&self.qps, &self.exports)
    }

    fn connect(&mut self, peer: &Handshake) -> Result<()> {
        connect_qps(self.peer, &mut self.qps, &peer.qps)
    }
}

fn serve_handshake(
    worker: &Worker,
    stream: TcpStream,
    peer: SocketAddr,
    admitted: &mut bool,
) -> Result<Endpoint> {
    let config = &worker.config;
    let mut control = Control::new(stream, peer, config.handshake_timeout);
    let mut side = ServerSide {
        worker,
        peer,
        qps: Vec::new(),
        exports: Vec::new(),
    };
    let (_, offer) = handshake::serve(
        &mut control,
        config.auth_key.as_ref(),
        config.max_qps.min(MAX_QPS),
        |hello| {
            admit(worker, hello)?;
            *admitted = true;
            Ok(())
        },
        &mut side,
    )?;
    Ok(Endpoint::new(
        peer,
        side.qps,
        side.exports,
        offer.regions,
        control.into_stream()?,
    ))
}
