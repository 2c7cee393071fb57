//! One pinned reactor per core: a [`Runtime`] starts N reactor threads, each
//! pinned to a core of its own (the NIC's NUMA node first), each owning its
//! CQs, its SRQ and its handlers; nothing mutable is shared between them.
//!
//! - **Sessions** come from a listener ([`Runtime::serve`]), which places
//!   each admitted peer on a reactor by a [`PlacementPolicy`] *before* its
//!   QPs are built (they must be on that reactor's CQs), or from the
//!   application ([`RuntimeHandle::adopt`], with QPs built from
//!   [`RuntimeHandle::qp_spec`]). Either way the endpoint reaches its
//!   reactor through a lock-free bounded queue the reactor drains when
//!   idle, and a [`HandlerFactory`] builds its handler on that reactor's
//!   thread.
//! - **Submissions** from application threads go through a [`Submitter`]:
//!   a bounded single-producer ring of fixed-size commands per thread and
//!   reactor. A full ring is an immediate `WouldBlock`; the reactor stages
//!   the commands in the same pass as its handlers' work, so they share
//!   its doorbells.
//! - **Idle** (Blocking and Epoll modes): a reactor sleeps until a
//!   completion, a peer's control connection, its queue (an eventfd, rung
//!   only when it sleeps) or a stop wakes it. An idle runtime makes no
//!   syscalls at all.
//! - **Control**: [`RuntimeHandle::stop`] or [`stop_reactor`](RuntimeHandle::stop_reactor),
//!   [`Runtime::join`], and per-reactor [`ReactorStats`].
//!
//! ```no_run
//! use rdma_comm_core::reactor::*;
//! use rdma_comm_core::runtime::*;
//! use rdma_comm_core::session::AuthKey;
//! use rdma_comm_core::verbs::*;
//!
//! struct Echo;
//! impl Handler for Echo {
//!     fn on_message(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, data: &[u8], imm: Option<u32>) {
//!         let _ = ctx.send(conn, data, imm);
//!     }
//! }
//!
//! let ctx = Context::open_default(None)?;
//! let pd = ctx.alloc_pd()?;
//! let config = RuntimeConfig { reactors: 2, ..RuntimeConfig::default() };
//! let mut runtime = Runtime::start(&pd, config, |_: &NewSession<'_>| Ok(Echo))?;
//! println!("{}", runtime.plan());
//! let mut server = runtime.server_config(AccessFlags::empty());
//! server.auth_key = Some(AuthKey::from_file("/etc/myservice/rdma.key")?);
//! runtime.serve("0.0.0.0:7471", server)?;
//! runtime.join()?; // until a RuntimeHandle stops it
//! # Ok::<(), rdma_comm_core::Error>(())
//! ```

mod cores;
mod factory;
mod policy;
mod port;
mod submit;
mod trace;
mod worker;

use std::fmt;
use std::net::{SocketAddr, ToSocketAddrs};
use std::ops::Deref;
use std::sync::Arc;
use std::thread::JoinHandle;

use crate::error::{Error, Result};
use crate::reactor::{Counters, EventMode, ReactorConfig};
use crate::session::{
    Endpoint, QpHome, QpSpec, Refusal, ServerConfig, ServerSession, ServerShutdown,
};
use crate::verbs::{AccessFlags, Gid, ProtectionDomain, UdConfig};

pub use cores::{CoreChoice, CorePlan, parse_core_list};
pub use factory::{HandlerFactory, NewDatagram, NewSession};
pub use policy::{ChooseFn, PlacementPolicy, ReactorLoad};
pub use submit::{INLINE_PAYLOAD, SubmitError, Submitter};
pub use trace::SubmitLatency;

use policy::Chooser;
use port::{Arrival, Incoming, Port, Seat};

/// Largest payload slot of a submission ring entry.
pub const MAX_SUBMIT_SLOT: usize = 1 << 20;
/// Most commands in one submission ring.
pub const MAX_SUBMIT_RING: usize = 1 << 16;

/// How many reactors, where, and how sessions and commands reach them.
#[derive(Debug, Clone)]
pub struct RuntimeConfig {
    /// Reactor threads, one per core.
    pub reactors: usize,
    /// Which cores they are pinned to.
    pub cores: CoreChoice,
    /// Every reactor's configuration (event mode, queue depths, CQs sized
    /// for the sessions one reactor serves: see [`ReactorConfig::absorbing`]).
    /// In the Blocking and Epoll modes the runtime sleeps until woken
    /// ([`ReactorConfig::sleeping_until_woken`]) unless `idle_timeout` is
    /// set shorter than the default's.
    pub reactor: ReactorConfig,
    /// How sessions are spread over the reactors.
    pub policy: PlacementPolicy,
    /// Sessions and rings waiting in each reactor's arrival queue at most.
    pub arrival_queue: usize,
    /// Commands in each submission ring (rounded up to a power of two).
    pub submit_ring: usize,
    /// Payload bytes each submission ring entry can carry beyond the
    /// [`INLINE_PAYLOAD`] that fit in the command (0: inline only; at most
    /// [`MAX_SUBMIT_SLOT`]).
    pub submit_slot_size: usize,
    /// Name prefix of the reactor threads (`NAME-0`, `NAME-1`, ...).
    pub thread_name: String,
    /// Measure how long submitted commands wait until the pass that posts
    /// them has returned from its doorbells (the end of that pass:
    /// [`ReactorStats::submit_latency`]): one TSC read per command on the
    /// submitting thread, one per pass that staged commands on the reactor,
    /// and a walk over the histogram when the statistics are published
    /// after new samples. At most 64 commands a pass are sampled. Off by
    /// default.
    pub trace_submissions: bool,
    /// Datagram endpoints (UD QPs on a reactor's CQs, see
    /// [`Reactor::add_datagram`](crate::reactor::Reactor::add_datagram))
    /// each reactor opens as it starts, before it serves anything; their
    /// handlers come from [`HandlerFactory::build_datagram`]. Each is open
    /// to anyone on the fabric (it logs so). None by default.
    pub datagrams: Vec<DatagramPlan>,
}

/// A datagram endpoint a runtime reactor opens as it starts
/// ([`RuntimeConfig::datagrams`]).
#[derive(Debug, Clone, Default)]
pub struct DatagramPlan {
    /// The reactor that serves it: below [`RuntimeConfig::reactors`].
    pub reactor: usize,
    /// Its UD QP's depths, inline room, Q_Key, port and GID.
    pub config: UdConfig,
    /// Multicast groups (IPv4-mapped GIDs of multicast addresses) it joins
    /// before the reactor serves anything.
    pub groups: Vec<Gid>,
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        Self {
            reactors: 1,
            cores: CoreChoice::NearDevice,
            reactor: ReactorConfig::default(),
            policy: PlacementPolicy::RoundRobin,
            arrival_queue: 256,
            submit_ring: 1024,
            submit_slot_size: 1024,
            thread_name: "rdma-reactor".into(),
            trace_submissions: false,
            datagrams: Vec::new(),
        }
    }
}

/// What one reactor has done, as last published (before each sleep, every
/// 1024 passes, and when it stopped).
#[derive(Debug, Clone, PartialEq)]
pub struct ReactorStats {
    /// The reactor's index.
    pub reactor: usize,
    /// The core it is pinned to.
    pub core: Option<usize>,
    /// Its thread's OS id (for `perf`, `top -H`, `/proc`).
    pub thread_id: u64,
    /// Still running.
    pub running: bool,
    /// Sessions it serves.
    pub sessions: usize,
    /// Commands from submission rings it staged.
    pub commands: u64,
    /// Passes, completions, messages, requests, doorbells, sleeps.
    pub counters: Counters,
    /// How long submitted commands waited until their doorbell, with
    /// [`RuntimeConfig::trace_submissions`].
    pub submit_latency: Option<SubmitLatency>,
}

impl ReactorStats {
    /// The share of passes that found nothing to do (see
    /// [`Counters::idle_fraction`]).
    pub fn idle_fraction(&self) -> f64 {
        self.counters.idle_fraction()
    }
}

impl fmt::Display for ReactorStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.counters;
        let core = self
            .core
            .map_or("unpinned".to_string(), |core| format!("core {core}"));
        write!(
            f,
            "reactor {} ({core}): {} sessions, {} passes ({:.0} % idle), {} completions, {} messages, {} requests in {} doorbells, {} sleeps, {} submitted commands",
            self.reactor,
            self.sessions,
            c.passes,
            100.0 * self.idle_fraction(),
            c.completions,
            c.messages,
            c.requests,
            c.doorbells,
            c.sleeps,
            self.commands
        )?;
        if let Some(latency) = &self.submit_latency {
            write!(
                f,
                "; submit to doorbell: p50 {:.1} us, p99 {:.1} us, max {:.1} us over {} commands",
                latency.p50_ns as f64 / 1e3,
                latency.p99_ns as f64 / 1e3,
                latency.max_ns as f64 / 1e3,
                latency.samples
            )?;
        }
        Ok(())
    }
}

/// What every handle shares.
struct Shared {
    ports: Vec<Arc<Port>>,
    /// The factory's [`HandlerFactory::refused`], for sessions that never
    /// reached their reactor.
    refused: Box<RefusedFn>,
    chooser: Chooser,
    pd: ProtectionDomain,
    submit_ring: usize,
    submit_slot_size: usize,
    /// The clock submissions are stamped with, when traced.
    trace_clock: Option<crate::clock::Clock>,
    listeners: std::sync::Mutex<Vec<ServerShutdown>>,
    /// Whether the reactors notice a peer that left without its handler's
    /// help (they watch peers, or sleep on the control connections).
    sees_peers_leave: bool,
}

type RefusedFn = dyn Fn(usize, SocketAddr, &Error) + Send + Sync;

/// A listener's choice for one peer, carried with its endpoint.
struct Placed {
    reactor: usize,
    seat: Seat,
    hello: crate::session::PeerHello,
}

/// A running set of pinned reactors. See the module docs.
///
/// It dereferences to its [`RuntimeHandle`]; dropping it stops and joins
/// every thread.
pub struct Runtime {
    handle: RuntimeHandle,
    plan: CorePlan,
    reactors: Vec<Option<JoinHandle<Result<()>>>>,
    routers: Vec<JoinHandle<()>>,
}

/// Controls a runtime from any thread: stop it or one reactor, read the
/// statistics, hand sessions to reactors, open submission rings. Cheap to
/// clone.
#[derive(Clone)]
pub struct RuntimeHandle {
    shared: Arc<Shared>,
}

impl fmt::Debug for Runtime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Runtime")
            .field("plan", &self.plan)
            .field("policy", &self.shared.chooser.policy)
            .finish()
    }
}

impl fmt::Debug for RuntimeHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RuntimeHandle")
            .field("reactors", &self.shared.ports.len())
            .finish()
    }
}

impl Deref for Runtime {
    type Target = RuntimeHandle;

    fn deref(&self) -> &RuntimeHandle {
        &self.handle
    }
}

impl Runtime {
    /// Starts `config.reactors` reactor threads on the cores
    /// [`CorePlan::choose`] picks for `pd`'s device, each with its own
    /// reactor over `pd`; `factory` builds every session's handler on the
    /// thread that serves it. Returns once every reactor is up.
    ///
    /// Each reactor opens the datagram endpoints
    /// [`RuntimeConfig::datagrams`] plans for it, builds their handlers
    /// ([`HandlerFactory::build_datagram`]) and joins their groups before
    /// this returns.
    ///
    /// # Errors
    /// [`Error::Runtime`] when the cores do not suffice, a datagram plan
    /// names a reactor beyond `reactors`, or a reactor cannot be pinned,
    /// created or spawned; the error of a datagram endpoint that cannot be
    /// opened, built or joined (on InfiniBand a join is
    /// [`Error::Unsupported`]: the groups of RoCE v2 only). The reactors
    /// started are stopped again.
    pub fn start<F: HandlerFactory>(
        pd: &ProtectionDomain,
        config: RuntimeConfig,
        factory: F,
    ) -> Result<Self> {
        // Each ring allocates `submit_ring × submit_slot_size` bytes up
        // front: bounded, so that the product can neither overflow nor
        // exhaust memory, and a slot length always fits a command's u32.
        if config.submit_slot_size > MAX_SUBMIT_SLOT
            || config.submit_ring > MAX_SUBMIT_RING
            || config
                .submit_ring
                .max(2)
                .next_power_of_two()
                .checked_mul(config.submit_slot_size)
                .is_none()
        {
            return Err(Error::Runtime(format!(
                "submission rings hold at most {MAX_SUBMIT_RING} commands with slots of at most \
                 {MAX_SUBMIT_SLOT} bytes (asked for {} of {})",
                config.submit_ring, config.submit_slot_size
            )));
        }
        if let Some(misplaced) = config
            .datagrams
            .iter()
            .find(|datagram| datagram.reactor >= config.reactors)
        {
            return Err(Error::Runtime(format!(
                "RuntimeConfig::datagrams: reactor {} of {} reactors",
                misplaced.reactor, config.reactors
            )));
        }
        let device = pd.context().name().to_string();
        let plan = CorePlan::choose(&device, config.reactors, &config.cores)?;
        let mut reactor_config = config.reactor.clone();
        let may_sleep = reactor_config.event_mode != EventMode::BusyPoll;
        if may_sleep && reactor_config.idle_timeout == ReactorConfig::default().idle_timeout {
            reactor_config = reactor_config.sleeping_until_woken();
        }
        let ports: Vec<Arc<Port>> = plan
            .cores
            .iter()
            .enumerate()
            .map(|(i, &core)| Arc::new(Port::new(i, core, config.arrival_queue, may_sleep)))
            .collect();
        let factory = Arc::new(factory);
        let refused = {
            let factory = Arc::clone(&factory);
            Box::new(move |reactor: usize, peer: SocketAddr, error: &Error| {
                factory.refused(reactor, peer, error)
            })
        };
        let shared = Arc::new(Shared {
            ports,
            refused,
            chooser: Chooser::new(config.policy.clone()),
            pd: pd.clone(),
            submit_ring: config.submit_ring,
            submit_slot_size: config.submit_slot_size,
            trace_clock: config.trace_submissions.then(crate::clock::Clock::new),
            listeners: std::sync::Mutex::new(Vec::new()),
            sees_peers_leave: config.reactor.peer_check_interval.is_some()
                || config.reactor.event_mode != crate::reactor::EventMode::BusyPoll,
        });
        let mut runtime = Runtime {
            handle: RuntimeHandle {
                shared: Arc::clone(&shared),
            },
            plan,
            reactors: Vec::new(),
            routers: Vec::new(),
        };
        for port in &shared.ports {
            let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel(1);
            let start = worker::Start {
                port: Arc::clone(port),
                pd: pd.clone(),
                config: reactor_config.clone(),
                factory: Arc::clone(&factory),
                datagrams: config
                    .datagrams
                    .iter()
                    .filter(|datagram| datagram.reactor == port.index)
                    .cloned()
                    .collect(),
                trace: shared.trace_clock.clone(),
                ready: ready_tx,
            };
            let spawned = std::thread::Builder::new()
                .name(format!("{}-{}", config.thread_name, port.index))
                .spawn(move || worker::run(start))
                .map_err(|source| Error::Os {
                    what: "spawning a reactor thread",
                    source,
                })?;
            runtime.reactors.push(Some(spawned));
            match ready_rx.recv() {
                Ok(Ok(())) => {}
                Ok(Err(err)) => return Err(err),
                Err(_) => {
                    return Err(Error::Runtime(format!(
                        "reactor {} died while starting",
                        port.index
                    )));
                }
            }
        }
        Ok(runtime)
    }

    /// Where the reactors run, in words with [`CorePlan::describe`].
    pub fn plan(&self) -> &CorePlan {
        &self.plan
    }

    /// A handle for other threads.
    pub fn handle(&self) -> RuntimeHandle {
        self.handle.clone()
    }

    /// Listens on `addr` and places every admitted peer on a reactor by the
    /// runtime's policy: its QPs are built on that reactor's CQs (and SRQ)
    /// and its endpoint goes to that reactor's queue. `config` comes from
    /// [`RuntimeHandle::server_config`] (its `cq`, `srq` and `place` are
    /// the runtime's). Returns the address it listens on. The listener
    /// stops with the runtime.
    ///
    /// # Errors
    /// A configuration with neither a key nor `insecure_open` (as
    /// [`ServerSession::bind`](crate::session::ServerSession::bind) refuses
    /// it); binding the listener; spawning its thread; a `max_peers` the
    /// reactors could never free a place of (busy-polling reactors that do
    /// not watch peers never see one leave: see
    /// [`ReactorConfig::peer_check_interval`](crate::reactor::ReactorConfig::peer_check_interval)).
    pub fn serve(
        &mut self,
        addr: impl ToSocketAddrs,
        mut config: ServerConfig,
    ) -> Result<SocketAddr> {
        if config.max_peers.is_some() && !self.handle.shared.sees_peers_leave {
            return Err(Error::InvalidArgument(
                "max_peers needs reactors that see a peer leave: ReactorConfig::peer_check_interval, or a Blocking or Epoll event mode",
            ));
        }
        let shared = Arc::clone(&self.handle.shared);
        config.place = Some(Arc::new(move |hello: &crate::session::PeerHello| {
            let reactor = shared.choose(Some(hello)).map_err(|reason| {
                log::warn!("placing {}: {reason}", hello.peer);
                Refusal {
                    code: crate::session::reject_code::BUSY,
                    reason: "no reactor can take the peer".into(),
                }
            })?;
            let port = &shared.ports[reactor];
            // A reactor that has not drained its queue yet would drop the
            // endpoint at the end of the handshake: the peer is told to try
            // again instead, before anything is built.
            if port.arrivals.is_full() {
                return Err(Refusal {
                    code: crate::session::reject_code::BUSY,
                    reason: "the reactor's arrival queue is full".into(),
                });
            }
            let Some(setup) = port.setup.get() else {
                return Err(Refusal::unauthorized("the server is shutting down"));
            };
            Ok(QpHome {
                cq: crate::session::CqChoice::Shared(setup.next_cq()),
                srq: setup.srq(),
                token: Some(Box::new(Placed {
                    reactor,
                    seat: Seat::new(&port.seats),
                    hello: hello.clone(),
                })),
            })
        }));
        let server = ServerSession::bind(addr, &self.handle.shared.pd, config)?;
        let local = server.local_addr();
        self.handle
            .shared
            .listeners
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .push(server.shutdown_handle());
        let shared = Arc::clone(&self.handle.shared);
        let router = std::thread::Builder::new()
            .name(format!("rdma-route-{}", local.port()))
            .spawn(move || route(&server, &shared))
            .map_err(|source| Error::Os {
                what: "spawning a listener's router thread",
                source,
            })?;
        self.routers.push(router);
        Ok(local)
    }

    /// Waits until every reactor has stopped (see [`RuntimeHandle::stop`]),
    /// then stops the listeners, and returns each reactor's final
    /// statistics.
    ///
    /// # Errors
    /// The first reactor that failed (a verbs error in its loop), by index.
    pub fn join(mut self) -> Result<Vec<ReactorStats>> {
        self.join_all()
    }

    fn join_all(&mut self) -> Result<Vec<ReactorStats>> {
        let mut first_error = None;
        for thread in self.reactors.iter_mut().filter_map(Option::take) {
            let outcome = thread
                .join()
                .unwrap_or_else(|_| Err(Error::Runtime("a reactor thread panicked".into())));
            if let Err(err) = outcome {
                first_error.get_or_insert(err);
            }
        }
        self.handle.stop_listeners();
        for router in self.routers.drain(..) {
            let _ = router.join();
        }
        match first_error {
            Some(err) => Err(err),
            None => Ok(self.handle.stats()),
        }
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        self.handle.stop();
        if let Err(err) = self.join_all() {
            log::error!("runtime: {err}");
        }
    }
}

/// Hands each endpoint the listener accepts to the reactor its handshake
/// placed it on.
fn route(server: &ServerSession, shared: &Shared) {
    while let Some(mut endpoint) = server.accept() {
        let placed = endpoint
            .take_home_token()
            .and_then(|token| token.downcast::<Placed>().ok());
        let Some(placed) = placed else {
            log::error!(
                "an endpoint from {} came without its reactor",
                endpoint.peer()
            );
            continue;
        };
        let Placed {
            reactor,
            seat,
            hello,
        } = *placed;
        let peer = endpoint.peer();
        let arrival = Arrival::Session(Box::new(Incoming {
            endpoint,
            seat,
            hello: Some(hello),
        }));
        if let Err(err) = shared.deliver(reactor, arrival) {
            (shared.refused)(reactor, peer, &err);
        }
    }
}

impl Shared {
    fn loads(&self) -> Vec<ReactorLoad> {
        self.ports
            .iter()
            .map(|port| ReactorLoad {
                reactor: port.index,
                sessions: port.seats.load(std::sync::atomic::Ordering::Acquire),
                open: port.is_open(),
            })
            .collect()
    }

    fn choose(
        &self,
        hello: Option<&crate::session::PeerHello>,
    ) -> std::result::Result<usize, String> {
        self.chooser.choose(hello, &self.loads())
    }

    fn port(&self, reactor: usize) -> Result<&Arc<Port>> {
        self.ports.get(reactor).ok_or_else(|| {
            Error::Runtime(format!(
                "there is no reactor {reactor} (the runtime has {})",
                self.ports.len()
            ))
        })
    }

    /// Queues `arrival` for reactor `reactor` and wakes it if it sleeps.
    /// If the reactor stops during the hand-over, a session goes to the
    /// factory's `refused` instead (and a ring is dropped), and this still
    /// returns `Ok`: the arrival was taken care of either way.
    fn deliver(&self, reactor: usize, arrival: Arrival) -> Result<()> {
        let port = self.port(reactor)?;
        if !port.is_open() {
            return Err(Error::Runtime(format!(
                "reactor {reactor} has stopped: the session or ring was dropped"
            )));
        }
        if port.arrivals.push(arrival).is_err() {
            return Err(Error::Runtime(format!(
                "reactor {reactor}'s arrival queue is full: the session or ring was dropped"
            )));
        }
        port.nudge();
        // The reactor may have stopped between the check above and the
        // push, after it drained its queue for the last time: then this
        // side drains it, so no endpoint waits there for the runtime's end.
        // (Pairs with the reactor's fence between `running = false` and
        // its drain: one of the two sides sees the other.)
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        if !port.running.load(std::sync::atomic::Ordering::Acquire) {
            port.refuse_queued(&self.refused);
        }
        Ok(())
    }
}

impl RuntimeHandle {
    /// Number of reactors.
    pub fn reactors(&self) -> usize {
        self.shared.ports.len()
    }

    /// The protection domain every reactor's QPs and regions belong to.
    pub fn pd(&self) -> &ProtectionDomain {
        &self.shared.pd
    }

    /// A server configuration with the reactors' QP settings and
    /// `remote_access` granted to peers; pass it to [`Runtime::serve`]
    /// after setting exports, limits and the key (it has none: a server
    /// without one refuses to start unless `insecure_open` says so).
    pub fn server_config(&self, remote_access: AccessFlags) -> ServerConfig {
        let mut qp = self.shared.ports[0]
            .setup
            .get()
            .map(|setup| setup.qp_config().clone())
            .unwrap_or_default();
        qp.remote_access = remote_access;
        ServerConfig {
            qp,
            ..ServerConfig::default()
        }
    }

    /// A QP spec on reactor `reactor`'s CQs (round-robin over them) and
    /// SRQ, with its queue depths, for a client the application connects
    /// and then hands over with [`adopt`](Self::adopt).
    ///
    /// # Errors
    /// [`Error::Runtime`] for an index out of range or a reactor not running.
    pub fn qp_spec(
        &self,
        reactor: usize,
        name: impl Into<String>,
        remote_access: AccessFlags,
    ) -> Result<QpSpec> {
        let port = self.shared.port(reactor)?;
        let setup = port
            .setup
            .get()
            .filter(|_| port.is_open())
            .ok_or_else(|| Error::Runtime(format!("reactor {reactor} is not running")))?;
        Ok(setup.qp_spec(name.into(), remote_access))
    }

    /// The reactor the policy picks for a session without a hello (round
    /// robin, or the fewest sessions).
    ///
    /// # Errors
    /// [`Error::Runtime`] when no reactor runs.
    pub fn choose_reactor(&self) -> Result<usize> {
        self.shared.choose(None).map_err(Error::Runtime)
    }

    /// Hands a connected endpoint, whose QPs were built from
    /// [`qp_spec`](Self::qp_spec)`(reactor, ..)`, to that reactor: its
    /// factory builds the handler there and the reactor serves it.
    ///
    /// # Errors
    /// [`Error::Runtime`] when the reactor has stopped or its arrival queue
    /// is full (the endpoint is dropped, telling the peer goodbye). A
    /// reactor that stops while the endpoint is on its way hands it to the
    /// factory's [`refused`](HandlerFactory::refused) instead.
    pub fn adopt(&self, reactor: usize, endpoint: Endpoint) -> Result<()> {
        let port = self.shared.port(reactor)?;
        let arrival = Arrival::Session(Box::new(Incoming {
            endpoint,
            seat: Seat::new(&port.seats),
            hello: None,
        }));
        self.shared.deliver(reactor, arrival)
    }

    /// Opens a submission ring from the calling thread to reactor
    /// `reactor`: see [`Submitter`].
    ///
    /// # Errors
    /// [`Error::Runtime`] when the reactor has stopped or its arrival queue
    /// is full.
    pub fn submitter(&self, reactor: usize) -> Result<Submitter> {
        let (producer, consumer) = submit::ring(
            self.shared.submit_ring,
            self.shared.submit_slot_size,
            self.shared.trace_clock.clone(),
        );
        self.shared.deliver(reactor, Arrival::Ring(consumer))?;
        Ok(Submitter::new(
            producer,
            Arc::clone(self.shared.port(reactor)?),
        ))
    }

    /// Stops every reactor (each drops its sessions, telling their peers
    /// goodbye) and every listener. [`Runtime::join`] then returns.
    pub fn stop(&self) {
        for port in &self.shared.ports {
            port.ask_to_stop();
        }
        self.stop_listeners();
    }

    /// Wakes every reactor for a pass, so its handlers' `on_idle` runs: for
    /// state shared across reactors (a handler on one reactor that must act
    /// on what a handler on another one posted). Costs one eventfd write
    /// per reactor, sleeping or not (a busy one runs an extra pass). Meant
    /// for phase boundaries, not per message. A handle kept by a handler or
    /// the factory keeps the runtime's shared state (its PD, CQ handles,
    /// listeners) alive until that handle is dropped: drop it when done.
    pub fn wake_all(&self) {
        for port in &self.shared.ports {
            if let Some(setup) = port.setup.get() {
                setup.waker.wake();
            }
        }
    }

    /// Stops reactor `reactor` only; new sessions go to the others.
    ///
    /// # Errors
    /// [`Error::Runtime`] for an index out of range.
    pub fn stop_reactor(&self, reactor: usize) -> Result<()> {
        self.shared.port(reactor)?.ask_to_stop();
        Ok(())
    }

    fn stop_listeners(&self) {
        let listeners = self
            .shared
            .listeners
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        for listener in listeners.iter() {
            listener.shutdown();
        }
    }

    /// Handshakes in progress on the runtime's listeners (each ends within
    /// its handshake timeout): a server that stops after its last peer can
    /// let them end on their own first.
    pub fn pending_handshakes(&self) -> usize {
        let listeners = self
            .shared
            .listeners
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        listeners
            .iter()
            .map(ServerShutdown::pending_handshakes)
            .sum()
    }

    /// Each reactor's statistics, as last published.
    pub fn stats(&self) -> Vec<ReactorStats> {
        self.shared
            .ports
            .iter()
            .map(|port| port.snapshot())
            .collect()
    }

    /// How many sessions each reactor has been given and not yet dropped
    /// (handshakes in flight and queued sessions included).
    pub fn loads(&self) -> Vec<ReactorLoad> {
        self.shared.loads()
    }
}
