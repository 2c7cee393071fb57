//! The accepting side: one listener, a handshake thread per connection,
//! every one of them bounded in number and in time.

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::io::{self, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

mod accept;
mod config;

use config::RESERVED_PENDING;
pub use config::{
    AuthorizeFn, ExportFn, FailureFn, HandshakeFailure, MAX_RECORDED_FAILURES, PlaceFn, QpHome,
    ServerConfig,
};

use accept::accept_loop;
#[cfg(feature = "rdma_cm")]
use accept::cm_accept_loop;

use super::net::{self, WakeReceiver, Waker};
use super::peer_places::{PeerPlace, PeerPlaces};

use super::endpoint::ControlLink;
use super::handshake::{self, FrameIo, PeerHello, Refusal, Resources};
use super::wire::{Handshake, MAX_QPS, Message};
use super::{
    Control, Endpoint, Export, ExportWindows, QpSpec, SessionQp, Transport, build_qps,
    check_exports, connect_qps, local_handshake, reject_code,
};
use crate::error::{Error, Result};
#[cfg(feature = "rdma_cm")]
use crate::verbs::cm::{CmEventKind, CmId, EventChannel};
use crate::verbs::{BoundWindow, ProtectionDomain};

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
    /// Peers connected now (for `max_peers`).
    places: Arc<PeerPlaces>,
    shutdown: AtomicBool,
    /// Set when the accept thread stops: handshakes still in progress end.
    cut: AtomicBool,
    /// Wakes the accept thread (shutdown).
    waker: Waker,
    /// [`ServerConfig::on_failure`].
    on_failure: Option<Arc<FailureFn>>,
}

/// Handshakes in progress: how many, from where, and their sockets (to cut
/// them when the server goes).
#[derive(Default)]
struct Pending {
    total: usize,
    per_address: HashMap<AddressKey, usize>,
    sockets: HashMap<u64, TcpStream>,
    next_id: u64,
}

/// What the per-address limit counts by: an IPv4 address, or the /64 of an
/// IPv6 one (a host usually holds a whole /64).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum AddressKey {
    V4(u32),
    V6(u64),
}

impl AddressKey {
    fn of(ip: IpAddr) -> Self {
        match ip {
            IpAddr::V4(v4) => AddressKey::V4(v4.to_bits()),
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => AddressKey::V4(v4.to_bits()),
                None => AddressKey::V6((v6.to_bits() >> 64) as u64),
            },
        }
    }
}

/// What the accept thread listens on.
enum Listener {
    Tcp(TcpListener),
    #[cfg(feature = "rdma_cm")]
    Cm(EventChannel, CmId),
}

/// Everything a handshake thread needs.
struct Worker {
    pd: ProtectionDomain,
    config: ServerConfig,
    accepted: SyncSender<Endpoint>,
    state: Arc<State>,
}

impl ServerSession {
    /// Listens on `addr` (IPv4 or IPv6; port 0 picks a free port).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a configuration with neither an
    /// `auth_key` nor `insecure_open` (a server is keyed unless told to be
    /// open), with both, or with a pending-handshake limit or backlog of 0;
    /// [`Error::Os`] when the address cannot be bound.
    pub fn bind(
        addr: impl ToSocketAddrs,
        pd: &ProtectionDomain,
        config: ServerConfig,
    ) -> Result<Self> {
        config.check_access()?;
        if config.max_pending_handshakes == 0
            || config.max_pending_per_address == 0
            || config.accept_backlog == 0
        {
            return Err(Error::InvalidArgument(
                "pending-handshake limits and the accept backlog must be at least 1",
            ));
        }
        let os = |what| move |source| Error::Os { what, source };
        // The tables of handshakes in progress, sized for the most there
        // can be (up to a cap), and the record of failures, for the most it
        // keeps: a server that runs for months does not grow them at its
        // busiest moments. Twice the room: entries removed leave markers
        // that count against it until the table is rehashed.
        let room = 2 * config.max_pending_handshakes.min(RESERVED_PENDING);
        let pending = Pending {
            per_address: HashMap::with_capacity(room),
            // Only a TCP handshake keeps its socket there.
            sockets: match config.transport {
                Transport::Tcp => HashMap::with_capacity(room),
                Transport::RdmaCm => HashMap::new(),
            },
            ..Pending::default()
        };
        let (listener, local_addr) = match config.transport {
            Transport::Tcp => {
                let listener =
                    TcpListener::bind(addr).map_err(os("binding the session listener"))?;
                let local_addr = listener
                    .local_addr()
                    .map_err(os("reading the listener address"))?;
                listener
                    .set_nonblocking(true)
                    .map_err(os("making the listener non-blocking"))?;
                (Listener::Tcp(listener), local_addr)
            }
            #[cfg(not(feature = "rdma_cm"))]
            Transport::RdmaCm => return Err(Error::InvalidArgument(super::RDMA_CM_OFF)),
            #[cfg(feature = "rdma_cm")]
            Transport::RdmaCm => {
                let (channel, id, local_addr) = super::cm::listen(addr, config.accept_backlog)?;
                (Listener::Cm(channel, id), local_addr)
            }
        };
        if config.insecure_open {
            log::warn!(
                "session server on {local_addr}: open to anyone who reaches it (no auth_key: insecure_open)"
            );
        }
        let (waker, wake_receiver) = net::wake_pair().map_err(os("creating the accept wake-up"))?;
        let (tx, rx) = mpsc::sync_channel(config.accept_backlog);
        let state = Arc::new(State {
            failures: Mutex::new(VecDeque::with_capacity(MAX_RECORDED_FAILURES)),
            failed: AtomicU64::new(0),
            pending: Mutex::new(pending),
            reserved: AtomicUsize::new(0),
            places: PeerPlaces::new(config.max_peers),
            shutdown: AtomicBool::new(false),
            cut: AtomicBool::new(false),
            waker,
            on_failure: config.on_failure.clone(),
        });
        let worker = Arc::new(Worker {
            pd: pd.clone(),
            config,
            accepted: tx,
            state: Arc::clone(&state),
        });
        let acceptor = std::thread::Builder::new()
            .name(format!("rdma-accept-{}", local_addr.port()))
            .spawn(move || match listener {
                Listener::Tcp(listener) => accept_loop(listener, wake_receiver, worker),
                #[cfg(feature = "rdma_cm")]
                Listener::Cm(channel, id) => cm_accept_loop(channel, id, wake_receiver, worker),
            })
            .map_err(os("spawning the accept thread"))?;
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

    /// Blocks until the next peer is connected. `None` once no more will
    /// come (the server was shut down, or its listener failed).
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

    /// Peers connected now: admitted, and their endpoint (or the reactor
    /// session made of it) not yet dropped. At most `max_peers`.
    pub fn connected_peers(&self) -> usize {
        self.state.places.taken()
    }

    /// Handshakes that failed or were refused since the server started.
    pub fn failed_handshakes(&self) -> u64 {
        self.state.failed.load(Ordering::Acquire)
    }

    /// A handle that stops this server from another thread: it stops
    /// listening, cuts the handshakes in progress, and [`accept`](Self::accept)
    /// returns `None` once the endpoints already made are taken.
    pub fn shutdown_handle(&self) -> ServerShutdown {
        ServerShutdown {
            state: Arc::clone(&self.state),
        }
    }

    /// Handshakes that failed since the last call, at most
    /// [`MAX_RECORDED_FAILURES`] of the latest (each was also logged).
    pub fn take_failures(&self) -> Vec<HandshakeFailure> {
        lock(&self.state.failures).drain(..).collect()
    }
}

/// Stops a [`ServerSession`] from any thread ([`ServerSession::shutdown_handle`]).
#[derive(Clone)]
pub struct ServerShutdown {
    state: Arc<State>,
}

impl fmt::Debug for ServerShutdown {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerShutdown").finish_non_exhaustive()
    }
}

impl ServerShutdown {
    /// Handshakes in progress right now (see
    /// [`ServerSession::pending_handshakes`]).
    pub fn pending_handshakes(&self) -> usize {
        self.state.pending().total
    }

    /// Stops listening and cuts the handshakes in progress.
    pub fn shutdown(&self) {
        self.state.shutdown.store(true, Ordering::Release);
        self.state.waker.wake();
    }
}

impl Drop for ServerSession {
    fn drop(&mut self) {
        self.state.shutdown.store(true, Ordering::Release);
        self.state.waker.wake();
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

    /// Records a failed handshake; logged at warn level only for a peer
    /// that was admitted (a stranger's garbage must not flood the log).
    fn record_failure(&self, peer: SocketAddr, error: Error, admitted: bool) {
        let level = if admitted {
            log::Level::Warn
        } else {
            log::Level::Debug
        };
        // Debug formatting escapes what a peer chose (its reject reason).
        log::log!(
            level,
            "session handshake from {peer} failed: {:?}",
            error.to_string()
        );
        self.keep_failure(HandshakeFailure { peer, error });
    }

    fn keep_failure(&self, failure: HandshakeFailure) {
        self.failed.fetch_add(1, Ordering::AcqRel);
        if let Some(tell) = &self.on_failure {
            tell(&failure);
        }
        let mut failures = lock(&self.failures);
        if failures.len() == MAX_RECORDED_FAILURES {
            failures.pop_front();
        }
        failures.push_back(failure);
    }

    /// Records a connection refused at the door (logged at debug level: a
    /// flood of them must not flood the log).
    fn record_refusal(&self, peer: SocketAddr, reason: String) {
        log::debug!("session connection from {peer} refused: {reason}");
        self.keep_failure(HandshakeFailure {
            peer,
            error: Error::Unauthorized { peer, reason },
        });
    }

    /// Takes a pending slot for `peer`, or says why not.
    fn register(
        self: &Arc<Self>,
        config: &ServerConfig,
        peer: SocketAddr,
        stream: Option<&TcpStream>,
    ) -> std::result::Result<PendingSlot, String> {
        let mut pending = self.pending();
        if pending.total >= config.max_pending_handshakes {
            return Err("too many handshakes in progress".into());
        }
        let key = AddressKey::of(peer.ip());
        if pending.per_address.get(&key).copied().unwrap_or(0) >= config.max_pending_per_address {
            return Err("too many handshakes in progress from one address".into());
        }
        // A clone of the socket, so that a server going away can cut the
        // handshake short (a connection manager handshake watches `cut`).
        let clone = stream
            .map(TcpStream::try_clone)
            .transpose()
            .map_err(|err| err.to_string())?;
        pending.total += 1;
        *pending.per_address.entry(key).or_default() += 1;
        let id = pending.next_id;
        pending.next_id += 1;
        if let Some(clone) = clone {
            pending.sockets.insert(id, clone);
        }
        Ok(PendingSlot {
            state: Arc::clone(self),
            id,
            key,
        })
    }

    /// Cuts every handshake in progress: their reads and writes fail now.
    fn cut_pending(&self) {
        self.cut.store(true, Ordering::Release);
        for socket in self.pending().sockets.values() {
            let _ = socket.shutdown(Shutdown::Both);
        }
    }
}

/// A pending-handshake slot, given back when dropped: on every path out of
/// a handshake thread, a panic included.
struct PendingSlot {
    state: Arc<State>,
    id: u64,
    key: AddressKey,
}

impl Drop for PendingSlot {
    fn drop(&mut self) {
        let mut pending = self.state.pending();
        pending.total -= 1;
        pending.sockets.remove(&self.id);
        if let Some(count) = pending.per_address.get_mut(&self.key) {
            *count -= 1;
            if *count == 0 {
                pending.per_address.remove(&self.key);
            }
        }
    }
}

/// An admitted peer's place (see [`ServerConfig::max_peers`]), which its
/// endpoint takes over, and its backlog reservation, given back when
/// dropped unless its endpoint reached the accept queue.
struct Admission<'a> {
    state: &'a State,
    place: Option<PeerPlace>,
    kept: bool,
}

impl Drop for Admission<'_> {
    fn drop(&mut self) {
        if !self.kept {
            self.state.reserved.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// Runs one handshake on its thread; `slot` (released on every way out, a
/// panic included) is given back as soon as the handshake is over, before
/// the endpoint is queued.
fn run_handshake<'a>(
    worker: &'a Worker,
    slot: PendingSlot,
    peer: SocketAddr,
    serve: impl FnOnce(&mut Option<Admission<'a>>) -> Result<Endpoint>,
) {
    let state = &worker.state;
    let mut admission = None;
    let result = catch_unwind(AssertUnwindSafe(|| serve(&mut admission))).unwrap_or_else(|_| {
        Err(Error::Protocol {
            peer,
            what: "the handshake panicked (in an authorize or exports callback?)".into(),
        })
    });
    drop(slot);
    let mut endpoint = match result {
        Ok(endpoint) => endpoint,
        Err(error) => {
            state.record_failure(peer, error, admission.is_some());
            return;
        }
    };
    // The peer's place goes with its endpoint from now on.
    if let Some(place) = admission
        .as_mut()
        .and_then(|admission| admission.place.take())
    {
        endpoint.hold_place(place);
    }
    // Admission reserved room in the queue, so it is full only if the server
    // is gone (then the endpoint goes with its QPs and its place, and the
    // reservation with the admission guard).
    if worker.accepted.try_send(endpoint).is_ok()
        && let Some(admission) = admission.as_mut()
    {
        admission.kept = true;
    }
}

/// Admits a peer: a peer-limit slot, a backlog slot, then the user's say.
fn admit<'a>(worker: &'a Worker, hello: &PeerHello) -> std::result::Result<Admission<'a>, Refusal> {
    let state = &worker.state;
    let config = &worker.config;
    if state.shutdown.load(Ordering::Acquire) {
        return Err(Refusal::unauthorized("the server is shutting down"));
    }
    // Taken by peers connected now or by handshakes still in progress,
    // which may fail yet: "busy" (come back) rather than "no".
    let Some(place) = state.places.take() else {
        return Err(Refusal {
            code: reject_code::BUSY,
            reason: "the server is busy".into(),
        });
    };
    if state
        .reserved
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
            (n < config.accept_backlog).then_some(n + 1)
        })
        .is_err()
    {
        return Err(Refusal {
            code: reject_code::BUSY,
            reason: "the server is busy".into(),
        });
    }
    // From here on the guard gives both back on any failure.
    let admission = Admission {
        state,
        place: Some(place),
        kept: false,
    };
    if let Some(authorize) = &config.authorize {
        authorize(hello)?;
    }
    Ok(admission)
}

/// The server's resources for one admitted peer.
struct ServerSide<'a> {
    worker: &'a Worker,
    peer: SocketAddr,
    qps: Vec<SessionQp>,
    exports: Vec<Export>,
    /// Where `place` put the peer (set at admission).
    home: &'a RefCell<Option<QpHome>>,
    windows: Option<ExportWindows>,
    bound: Vec<BoundWindow>,
}

impl Resources for ServerSide<'_> {
    fn build(&mut self, offer: Option<&Handshake>) -> Result<Handshake> {
        let config = &self.worker.config;
        let home = self.home.borrow();
        let (cq, srq) = match home.as_ref() {
            Some(home) => (&home.cq, &home.srq),
            None => (&config.cq, &config.srq),
        };
        let specs: Vec<QpSpec> = offer
            .map_or(&[][..], |offer| &offer.qps)
            .iter()
            .map(|qp| QpSpec {
                name: qp.name.clone(),
                cq: cq.clone(),
                qp: config.qp.clone(),
                srq: srq.clone(),
            })
            .collect();
        drop(home);
        if let Some(make) = &config.exports {
            self.exports = make(self.peer, &self.worker.pd)?;
            check_exports(&self.worker.pd, &self.exports)?;
        }
        self.qps = build_qps(&self.worker.pd, &specs, self.exports.len())?;
        let windows = ExportWindows::allocate(&self.worker.pd, &self.exports, self.qps.len())?;
        let ours = local_handshake(&self.qps, &self.exports, &windows)?;
        self.windows = Some(windows);
        Ok(ours)
    }

    fn connect(&mut self, peer: &Handshake) -> Result<()> {
        connect_qps(self.peer, &mut self.qps, &peer.qps)?;
        if let Some(windows) = self.windows.take() {
            self.bound = windows.bind(&mut self.qps, &self.exports)?;
        }
        Ok(())
    }
}

/// Serves the handshake over `control`, then makes the endpoint with the
/// link `link` makes of it.
fn serve_handshake<'a, C: FrameIo>(
    worker: &'a Worker,
    mut control: C,
    peer: SocketAddr,
    admission: &mut Option<Admission<'a>>,
    link: impl FnOnce(C) -> Result<ControlLink>,
) -> Result<Endpoint> {
    let config = &worker.config;
    let home = RefCell::new(None);
    let mut side = ServerSide {
        worker,
        peer,
        qps: Vec::new(),
        exports: Vec::new(),
        home: &home,
        windows: None,
        bound: Vec::new(),
    };
    let (_, offer) = handshake::serve(
        &mut control,
        config.auth_key.as_ref(),
        config.max_qps.min(MAX_QPS),
        |hello| {
            *admission = Some(admit(worker, hello)?);
            if let Some(place) = &config.place {
                *home.borrow_mut() = Some(place(hello)?);
            }
            Ok(())
        },
        &mut side,
    )?;
    let mut endpoint = Endpoint::new(
        peer,
        side.qps,
        side.exports,
        side.bound,
        offer.regions,
        link(control)?,
    );
    endpoint.home_token = home.into_inner().and_then(|home| home.token);
    Ok(endpoint)
}
