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

mod config;
mod cores;
mod factory;
mod handle;
mod policy;
mod port;
mod stats;
mod submit;
mod trace;
mod worker;

use std::fmt;
use std::net::{SocketAddr, ToSocketAddrs};
use std::ops::Deref;
use std::sync::Arc;
use std::thread::JoinHandle;

use crate::error::{Error, Result};
use crate::reactor::{EventMode, ReactorConfig};
use crate::session::{QpHome, Refusal, ServerConfig, ServerSession, ServerShutdown};
use crate::verbs::ProtectionDomain;

pub use config::{DatagramPlan, MAX_SUBMIT_RING, MAX_SUBMIT_SLOT, RuntimeConfig};
pub use cores::{CoreChoice, CorePlan, parse_core_list};
pub use factory::{HandlerFactory, NewDatagram, NewSession};
pub use handle::RuntimeHandle;
pub use policy::{ChooseFn, PlacementPolicy, ReactorLoad};
pub use stats::ReactorStats;
pub use submit::{INLINE_PAYLOAD, SubmitError, Submitter};
pub use trace::SubmitLatency;

use policy::Chooser;
use port::{Arrival, Incoming, Port, Seat};

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

impl fmt::Debug for Runtime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Runtime")
            .field("plan", &self.plan)
            .field("policy", &self.shared.chooser.policy)
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
        let what = arrival.what();
        if !port.is_open() {
            return Err(Error::Runtime(format!(
                "reactor {reactor} has stopped: the {what} was dropped"
            )));
        }
        if port.arrivals.push(arrival).is_err() {
            return Err(Error::Runtime(format!(
                "reactor {reactor}'s arrival queue is full: the {what} was dropped"
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
