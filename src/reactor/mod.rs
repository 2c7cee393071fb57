//! The run-to-completion reactor: one thread, shared CQs, preposted receive
//! rings, credit flow control, selective signaling and one doorbell per QP per
//! pass. After sessions are added, a pass allocates nothing.
//!
//! # How a message flows
//! 1. A handler stages work through [`Ctx`] (`send`, `write`, `read`). A SEND's
//!    payload is written straight into a registered send slot.
//!    Staging puts the reactor's receive count into the SEND's immediate
//!    (piggybacked credits; every SEND is a SEND_WITH_IMM, and a user's
//!    immediate travels in 4 bytes after the payload), so a payload that
//!    fits a packet goes in one.
//! 2. At the end of the pass the reactor posts all staged requests of a QP
//!    as one linked list: one doorbell. Then it reposts the consumed
//!    receives, a batch per `ibv_post_recv`, off the latency path; the next
//!    SEND or credit update announces them.
//! 3. The next pass polls the CQs in batches and routes each completion by
//!    its `wr_id` (connection, kind, slot or sequence number), checked
//!    against the QP number it came from, to the owning session's
//!    [`Handler`]. Receives go to `on_message`/`on_write_imm` and
//!    signaled sends retire every earlier unsignaled one.
//!
//! # Flow control
//! A sender never posts more RECV-consuming requests (SEND, WRITE_WITH_IMM)
//! than the peer has receives posted. Each side counts the receives it has
//! posted and tells the peer in the immediate of its SENDs, or, when it has
//! nothing to send, with a zero-length one. One credit and one send-queue entry are
//! kept back for those updates, so two peers can never starve each other. A
//! slow receiver therefore slows the sender ([`SendError::WouldBlock`]): no
//! RNR, no loss. A peer that does not keep to its credits, and consumes a
//! receive beyond the highest count it was told, is cut off with
//! [`Error::CreditOverrun`](crate::Error::CreditOverrun) (which matters most
//! with a shared receive queue, whose receives it would take from the
//! others; see [`ReactorConfig::srq_depth`] for the limit of that). A peer
//! whose SEND the protocol has no place for is cut off with
//! [`Error::MalformedMessage`](crate::Error::MalformedMessage).
//!
//! ```no_run
//! use rdma_comm_core::reactor::*;
//! use rdma_comm_core::session::*;
//! use rdma_comm_core::verbs::*;
//!
//! struct Echo;
//! impl Handler for Echo {
//!     fn on_message(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, data: &[u8], imm: Option<u32>) {
//!         let _ = ctx.send(conn, data, imm); // echo; WouldBlock only under overload
//!     }
//! }
//!
//! let ctx = Context::open_default(None)?;
//! let pd = ctx.alloc_pd()?;
//! let mut reactor = Reactor::new(&pd, ReactorConfig::default())?;
//! let config = ClientConfig::new(vec![reactor.qp_spec("rpc")]);
//! let endpoint = ClientSession::connect("server:7471", &pd, &config)?;
//! reactor.add(endpoint, Echo)?;
//! reactor.run()?; // until a Stopper stops it
//! # Ok::<(), rdma_comm_core::Error>(())
//! ```

//!
//! # Files
//! [`config`](ReactorConfig) and ids, the [`Handler`] trait, [`Ctx`] and
//! held messages, the [`QpSource`] a session comes from, the SRQ pool,
//! the QP specs a session's QPs are built from, the sessions, session
//! admin (`add`, `remove`), the connection table (`table/`: the
//! connections and the `wr_id` layout, with the lookup that vets each
//! completion), the completions (CQs, poll buffers, the spin loan), the
//! pass engine (poll, dispatch, flush), the idle policy (when idle passes
//! repost and signal tails, and when traffic is sparse), the [`Stopper`],
//! and per connection (`conn/`) the owned parts of a connection: its
//! credits, receive ring and send queue (with its send slots, signaling
//! and sizes).

/// A [`Ctx`] over the reactor's parts, borrowed field by field so that a
/// handler (in `sessions` or `datagram_handlers`) can be borrowed beside it.
macro_rules! reactor_ctx {
    ($reactor:ident) => {
        $crate::reactor::Ctx::new(
            &mut $reactor.conns,
            &$reactor.stop,
            &mut $reactor.deferred,
            &mut $reactor.datagrams,
        )
    };
}

mod admin;
mod completions;
mod config;
mod conn;
mod counters;
mod ctx;
mod datagram;
mod direct;
mod dispatch;
mod failure;
mod flush;
mod handler;
mod idle;
mod idle_list;
mod pass;
mod pass_timer;
mod peer_watch;
pub mod placement;
mod sessions;
mod slab;
mod source;
mod specs;
mod spin;
mod srq_pool;
mod stopper;
mod table;
#[cfg(test)]
mod tests;
mod wait;

use std::fmt;
use std::os::fd::RawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crate::error::Result;
use crate::session::SessionLink;
use crate::verbs::ProtectionDomain;

use completions::Completions;
use conn::{Conn, IMM_TRAILER_LEN};
use ctx::{Deferred, ReactorId};
use datagram::{DatagramHandlers, DatagramTable};
use idle::IdlePolicy;
use sessions::Sessions;
use srq_pool::SrqPool;
use table::ConnTable;
use table::wr_id::MAX_CONNS;
use wait::Waiter;

#[cfg(test)]
use completions::SPIN_POLLS;
#[cfg(test)]
pub(crate) use config::slab_key_for_tests;
pub use config::{ConnId, EventMode, ReactorConfig, SendError, SessionId};
pub use counters::{ConnStats, Counters, MemoryUse};
pub use ctx::{Ctx, HeldRecv};
pub use datagram::{DatagramId, DatagramSource};
pub use direct::DirectQp;
pub use handler::{Handler, Idle};
pub use pass_timer::PassTimer;
pub use placement::{CorePreference, Placement, pin_current_thread, usable_cores};
pub use source::{NoLink, PeerLink, QpSource};
pub use spin::{Spin, Spun};
pub use stopper::{Ended, Stopper};
pub use wait::Waker;

/// Bytes of every slot the reactor keeps back: a SEND carries at most
/// `slot_size - SLOT_RESERVE` payload bytes. The reserve holds a user
/// immediate, which travels after the payload (the SEND's own immediate
/// carries the credits), so a received message can always be forwarded
/// with one, in place.
pub const SLOT_RESERVE: usize = IMM_TRAILER_LEN;

/// Most sessions one reactor serves at once.
const MAX_SESSIONS: usize = MAX_CONNS;

/// A run-to-completion reactor. See the module docs.
///
/// `L` is what stays with a session besides its QPs (see [`QpSource`]):
/// the session layer's [`SessionLink`] unless sessions come from elsewhere.
pub struct Reactor<H: Handler, L: PeerLink = SessionLink> {
    config: ReactorConfig,
    // Drop order: connections (each destroys its QP, then deregisters its
    // rings), then the sessions' links (which hold the regions exported to
    // peers), then the SRQ and its ring, then the CQs and their channels.
    conns: ConnTable,
    sessions: Sessions<H, L>,
    srq: Option<SrqPool>,
    /// The CQs, the buffers polled into, what spins left, CQ charges.
    completions: Completions,
    waiter: Waiter,
    pd: ProtectionDomain,
    /// What the full pass serves: connections of the reactor's own
    /// protocol (not direct ones) and datagram endpoints. While there are
    /// none, a pass takes the lean path.
    full_pass_parts: usize,
    /// When idle passes repost and signal tails, and whether traffic is
    /// sparse.
    idle: IdlePolicy,
    /// Busy passes between clock readings in `run_for`, as learned so far.
    clock_stride: u32,
    stop: Arc<AtomicBool>,
    /// What callbacks left for after the pass (removals, SRQ slots).
    deferred: Deferred,
    peer_timer: Option<PassTimer>,
    /// The datagram endpoints, and their handlers (by endpoint index).
    datagrams: DatagramTable,
    datagram_handlers: DatagramHandlers<H>,
    /// Running totals ([`Reactor::counters`]).
    counters: Counters,
    /// Sessions whose link fd woke the last wait (reused: no allocation).
    fired: Vec<u64>,
    /// When a link holding part of a frame must be looked at again
    /// ([`PeerLink::recheck_within`]); bounds the wait.
    recheck_at: Option<std::time::Instant>,
}

impl<H: Handler, L: PeerLink> fmt::Debug for Reactor<H, L> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reactor")
            .field("config", &self.config)
            .field("sessions", &self.sessions.len())
            .field("conns", &self.conns.len())
            .finish()
    }
}

/// What a refused reservation of `ReactorConfig::reserve_connections`
/// records becomes: the reactor is not built (an allocation failure would
/// otherwise abort the process).
fn reservation_refused(_: std::collections::TryReserveError) -> crate::Error {
    crate::Error::Os {
        what: "reserving the reactor's records (ReactorConfig::reserve_connections)",
        source: std::io::Error::from_raw_os_error(libc::ENOMEM),
    }
}

impl<H: Handler, L: PeerLink> Reactor<H, L> {
    /// Creates the reactor's CQs (and completion channels in the event modes).
    pub fn new(pd: &ProtectionDomain, config: ReactorConfig) -> Result<Self> {
        let ctx = pd.context();
        // Every CQ keeps room for the whole SRQ (see `add`).
        let completions = Completions::open(&ctx, &config)?;
        let waiter = Waiter::new(config.event_mode, completions.channels())?;
        let srq_slots = config.srq_depth as usize;
        let srq = match config.srq_depth {
            0 => None,
            _ => Some(SrqPool::new(pd, &config)?),
        };
        let peer_timer = config
            .peer_check_interval
            .map(|every| match config.event_mode {
                EventMode::BusyPoll => PassTimer::new(every),
                _ => PassTimer::reading_every_pass(every),
            });
        // Every id of the reactor's connections, sessions and endpoints
        // names it.
        let id = ReactorId::next();
        let reserve = config.reserve_connections as usize;
        let conns = ConnTable::new(id.0, reserve).map_err(reservation_refused)?;
        // A session has a connection at least.
        let sessions = Sessions::new(MAX_SESSIONS, id.0, reserve).map_err(reservation_refused)?;
        // Removals asked for within one pass: at most every session.
        let mut removals = Vec::new();
        removals
            .try_reserve_exact(reserve.min(MAX_SESSIONS))
            .map_err(reservation_refused)?;
        Ok(Self {
            config,
            conns,
            sessions,
            srq,
            completions,
            waiter,
            pd: pd.clone(),
            full_pass_parts: 0,
            idle: IdlePolicy::default(),
            clock_stride: 1,
            stop: Arc::new(AtomicBool::new(false)),
            deferred: Deferred {
                removals,
                srq_returns: Vec::with_capacity(srq_slots),
                refused: Vec::new(),
                lone_doorbells: 0,
            },
            peer_timer,
            datagrams: DatagramTable::new(id.0),
            datagram_handlers: DatagramHandlers::default(),
            counters: Counters::default(),
            fired: Vec::with_capacity(wait::MAX_EVENTS),
            recheck_at: None,
        })
    }

    /// The configuration in force.
    pub fn config(&self) -> &ReactorConfig {
        &self.config
    }

    /// A handle that stops [`run`](Self::run) from any thread.
    pub fn stopper(&self) -> Stopper {
        Stopper::new(Arc::clone(&self.stop), self.waiter.waker.clone())
    }

    /// The handler of a session (`None` if it was removed).
    pub fn handler(&self, session: SessionId) -> Option<&H> {
        self.sessions.get(session).map(|s| s.handler())
    }

    /// The handler of a session, mutably.
    pub fn handler_mut(&mut self, session: SessionId) -> Option<&mut H> {
        self.sessions.handler_mut(session)
    }

    /// The link of a session: its peer's address and regions, the control
    /// connection (the QPs stay the reactor's own).
    pub fn link(&self, session: SessionId) -> Option<&L> {
        self.sessions.get(session).map(|s| s.link())
    }

    /// The link of a session, mutably (to send a disconnect reason, say).
    pub fn link_mut(&mut self, session: SessionId) -> Option<&mut L> {
        self.sessions.get_mut(session).map(|s| s.link_mut())
    }

    /// Sessions currently served (added and not removed).
    pub fn sessions(&self) -> impl Iterator<Item = SessionId> + '_ {
        self.sessions.ids()
    }

    /// The connections of a session, in QP order.
    pub fn conns(&self, session: SessionId) -> impl Iterator<Item = ConnId> + '_ {
        self.sessions.conns(session)
    }

    /// Where `conn`'s send queue, send slots and credits stand (`None` once
    /// it is removed).
    pub fn conn_stats(&self, conn: ConnId) -> Option<ConnStats> {
        self.conns.get(conn.key()).map(Conn::stats)
    }

    /// What the reactor has done so far: passes, completions, messages,
    /// requests, doorbells, sleeps, and what it ignored.
    pub fn counters(&self) -> Counters {
        let mut counters = self.counters;
        counters.reclaimed_receives = self.srq.as_ref().map_or(0, |pool| pool.reclaimed);
        // Rung from callbacks, which cannot reach these (one request each).
        counters.doorbells += self.deferred.lone_doorbells;
        counters.requests += self.deferred.lone_doorbells;
        // The datagram endpoints count their own posts.
        let datagrams = self.datagrams.posted();
        counters.doorbells += datagrams.doorbells;
        counters.requests += datagrams.requests;
        counters
    }

    /// A handle that wakes the reactor from a sleep (or makes its next wait
    /// return at once) from any thread: for a loop of its own that also
    /// waits for work from other threads.
    pub fn waker(&self) -> Waker {
        self.waiter.waker.clone()
    }

    /// Lets `stage` stage work through a [`Ctx`] between passes, as a
    /// callback would: it goes out with the next pass's doorbells (one per
    /// QP, shared with whatever the handlers stage in that pass), or at
    /// once with [`Ctx::read_now`] and [`Ctx::write_now`]. For work
    /// that comes from outside the handlers, such as commands other threads
    /// queued.
    pub fn with_ctx<R>(&mut self, stage: impl FnOnce(&mut Ctx<'_>) -> R) -> R {
        let mut ctx = reactor_ctx!(self);
        let result = stage(&mut ctx);
        if ctx.touched {
            self.idle.work_left();
        }
        result
    }

    /// Receives of the shared receive queue posted now (or going out with
    /// the current pass), out of [`ReactorConfig::srq_depth`]; `None`
    /// without an SRQ. The rest are consumed and not yet reposted: held by
    /// handlers, being forwarded, or waiting for a fuller repost batch.
    /// Once the reactor has been idle for a few passes with nothing held,
    /// every slot is posted again, including those a peer that was cut off
    /// for ignoring its credits ([`Error::CreditOverrun`](crate::Error::CreditOverrun))
    /// had taken.
    pub fn srq_posted(&self) -> Option<u32> {
        self.srq.as_ref().map(|pool| pool.available)
    }

    /// Memory registered for the connections' rings and the datagram
    /// endpoints' slots now (walks them: not for the data path).
    pub fn memory(&self) -> MemoryUse {
        let mut usage = MemoryUse {
            receive_bytes: self.srq.as_ref().map_or(0, SrqPool::registered_bytes),
            ..MemoryUse::default()
        };
        for (_, conn) in self.conns.iter() {
            let (receive, send) = conn.registered_bytes();
            usage.receive_bytes += receive;
            usage.send_bytes += send;
            usage.connections += 1;
        }
        for (_, endpoint) in self.datagrams.iter() {
            let (receive, send) = endpoint.registered_bytes();
            usage.receive_bytes += receive;
            usage.send_bytes += send;
        }
        usage
    }

    /// Runs passes until a [`Stopper`] or [`Ctx::stop`] asks it to return.
    pub fn run(&mut self) -> Result<()> {
        // A plain load per pass: a locked read-modify-write on every empty
        // busy-poll pass would cost more than the poll itself.
        if self.config.event_mode == EventMode::BusyPoll {
            self.busy_run()?;
        } else {
            while !self.stop.load(Ordering::Acquire) {
                self.turn()?;
            }
        }
        self.stop.store(false, Ordering::Release);
        Ok(())
    }

    /// Runs passes until `done` holds ([`Ended::Reached`]) or a [`Stopper`]
    /// or [`Ctx::stop`] asks it to return ([`Ended::Stopped`]). `done` is
    /// asked before the first pass and after each one, so it should be a
    /// cheap look at state, such as a handler's ([`handler`](Self::handler)).
    /// A stop asked for while `done` already holds is left for the next run.
    ///
    /// ```no_run
    /// # use rdma_comm_core::prelude::*;
    /// struct Count(u64);
    /// impl Handler for Count {
    ///     fn on_message(&mut self, _: &mut Ctx<'_>, _: ConnId, _: &[u8], _: Option<u32>) {
    ///         self.0 += 1;
    ///     }
    /// }
    /// # fn demo(reactor: &mut Reactor<Count>, session: SessionId) -> Result<()> {
    /// // Until the session's handler has seen 1,000 messages.
    /// let ended = reactor.run_until(|reactor| reactor.handler(session).is_some_and(|count| count.0 >= 1_000))?;
    /// assert_eq!(ended, Ended::Reached, "nothing here stops it");
    /// # Ok(())
    /// # }
    /// ```
    pub fn run_until(&mut self, mut done: impl FnMut(&Self) -> bool) -> Result<Ended> {
        while !done(self) {
            if self.stop.load(Ordering::Acquire) {
                self.stop.store(false, Ordering::Release);
                return Ok(Ended::Stopped);
            }
            self.turn()?;
        }
        Ok(Ended::Reached)
    }

    /// Runs passes until about `limit` has passed ([`Ended::Reached`]) or a
    /// [`Stopper`] or [`Ctx::stop`] asks it to return ([`Ended::Stopped`]):
    /// for a caller that also has something to do now and then.
    pub fn run_for(&mut self, limit: Duration) -> Result<Ended> {
        // A busy pass is cheaper than reading the clock (a syscall where the
        // clocksource is not the TSC): the timer reads it every so many
        // passes. A pass that may sleep is long enough to read it every time.
        let mut timer = self.pass_timer(limit);
        // Polls of spins before this call were counted by whoever ran them.
        self.take_spin_polls();
        let mut expired = false;
        while !expired && !self.stop.load(Ordering::Acquire) {
            let done = self.turn()?;
            let spun = self.take_spin_polls();
            if spun != 0 {
                timer.count_passes(spun);
            }
            expired = timer.expired_after(done);
        }
        self.clock_stride = timer.stride();
        if expired {
            return Ok(Ended::Reached);
        }
        self.stop.store(false, Ordering::Release);
        Ok(Ended::Stopped)
    }

    /// A timer for a loop that calls [`turn`](Self::turn) and now and then
    /// has something else to do: it reads the clock every pass in the event
    /// modes, whose passes may sleep, and every so many passes when busy
    /// polling (see [`PassTimer`]).
    ///
    /// ```no_run
    /// # use rdma_comm_core::reactor::*;
    /// # use std::time::Duration;
    /// # fn demo<H: Handler>(reactor: &mut Reactor<H>) -> rdma_comm_core::Result<()> {
    /// let mut every_second = reactor.pass_timer(Duration::from_secs(1));
    /// loop {
    ///     let completions = reactor.turn()?;
    ///     // A pass whose handler spun (`Ctx::spin`) stood for many.
    ///     every_second.count_passes(reactor.take_spin_polls());
    ///     if every_second.expired_after(completions) {
    ///         eprintln!("still running");
    ///     }
    /// }
    /// # }
    /// ```
    pub fn pass_timer(&self, period: Duration) -> PassTimer {
        if self.config.event_mode == EventMode::BusyPoll {
            PassTimer::resume(period, self.clock_stride)
        } else {
            PassTimer::reading_every_pass(period)
        }
    }

    /// The descriptor to wait on in another event loop (Epoll: the epoll set;
    /// Blocking: the completion channel); `None` when busy polling. Such a
    /// loop calls [`poll_once`](Self::poll_once) until it finds nothing,
    /// then [`prepare_wait`](Self::prepare_wait), and sleeps on this
    /// descriptor no longer than the limit that returns.
    ///
    /// ```no_run
    /// # use rdma_comm_core::reactor::*;
    /// # fn sleep_on(fd: std::os::fd::RawFd, limit: std::time::Duration) {}
    /// # fn demo<H: Handler>(reactor: &mut Reactor<H>) -> rdma_comm_core::Result<()> {
    /// let fd = reactor.event_fd().expect("an event mode");
    /// loop {
    ///     if reactor.poll_once()? == 0
    ///         && let Some(limit) = reactor.prepare_wait()?
    ///     {
    ///         sleep_on(fd, limit); // with the loop's other descriptors
    ///     }
    /// }
    /// # }
    /// ```
    pub fn event_fd(&self) -> Option<RawFd> {
        self.waiter.fd()
    }

    /// What handlers' spins spent ([`Ctx::spin`]) since the last call, a
    /// CQ poll or a completion each: a loop that paces other work by
    /// counting passes (a [`PassTimer`] of [`pass_timer`](Self::pass_timer))
    /// counts them too, each about the cost of an empty pass, or a pass
    /// that spun (up to 16384 of them) would count as one.
    pub fn take_spin_polls(&mut self) -> u32 {
        self.completions.take_spin_polls()
    }

    /// Whether a [`Stopper`] or [`Ctx::stop`] asked the reactor to stop
    /// since `run` last returned: for the runtime's loop.
    pub(crate) fn stop_requested(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }
}
