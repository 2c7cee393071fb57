//! The run-to-completion reactor: one thread, shared CQs, preposted receive
//! rings, credit flow control, selective signaling and one doorbell per QP per
//! pass. After sessions are added, a pass allocates nothing.
//!
//! # How a message flows
//! 1. A handler stages work through [`Ctx`] (`send`, `write`, `read`). A SEND's
//!    payload is written straight into a registered send slot.
//!    Staging stamps the reactor's receive count into the SEND's 8-byte
//!    header (piggybacked credits).
//! 2. At the end of the pass the reactor posts all staged requests of a QP
//!    as one linked list: one doorbell. Then it reposts the consumed
//!    receives, a batch per `ibv_post_recv`, off the latency path; the next
//!    SEND or credit update announces them.
//! 3. The next pass polls the CQs in batches and routes each completion by
//!    its `wr_id` (connection, kind, slot or sequence number) to the owning
//!    session's [`Handler`]. Receives go to `on_message`/`on_write_imm` and
//!    signaled sends retire every earlier unsignaled one.
//!
//! # Flow control
//! A sender never posts more RECV-consuming requests (SEND, WRITE_WITH_IMM)
//! than the peer has receives posted. Each side counts the receives it has
//! posted and tells the peer in SEND headers, or, when it has nothing to send,
//! with a zero-length SEND_WITH_IMM. One credit and one send-queue entry are
//! kept back for those updates, so two peers can never starve each other. A
//! slow receiver therefore slows the sender ([`SendError::WouldBlock`]): no
//! RNR, no loss.
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
//! let config = ClientConfig::new(vec![reactor.channel_spec("rpc")]);
//! let endpoint = ClientSession::connect("server:7471", &pd, &config)?;
//! reactor.add(endpoint, Echo)?;
//! reactor.run()?; // until a Stopper stops it
//! # Ok::<(), rdma_comm_core::Error>(())
//! ```

mod conn;
mod pass_timer;
pub mod placement;
mod staged;
mod wait;

use std::fmt;
use std::os::fd::RawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crate::error::{Error, Result};
use crate::session::{ChannelSpec, CqChoice, Endpoint, ServerConfig};
use crate::verbs::{
    AccessFlags, CompletionChannel, CompletionQueue, CqId, LocalSlice, MemoryRegion,
    ProtectionDomain, QpConfig, RecvBatch, RemoteSlice, WcOpcode, WorkCompletion,
};

use conn::{
    Conn, ConnState, HEADER_LEN, MAX_REPOST, OpKind, Ring, SRQ_CONN, SharedRing, WrKind,
    decode_wr_id, recv_request,
};
pub use pass_timer::{CLOCK_READ_INTERVAL, PassTimer};
pub use placement::{CorePreference, Placement, pin_current_thread};
use wait::Waiter;
pub use wait::Waker;

/// How the reactor waits when there is nothing to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EventMode {
    /// Spin on the CQs: lowest latency, one core at 100 %.
    #[default]
    BusyPoll,
    /// Arm the CQs and block on their shared completion channel.
    Blocking,
    /// Arm the CQs and wait in epoll over one channel per CQ; the epoll fd is
    /// available to embed in another event loop.
    Epoll,
}

/// One reactor per QP, or many QPs on one reactor's shared CQs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ThreadMode {
    /// Every QP gets its own reactor on its own pinned thread.
    PerQp,
    /// All QPs share one reactor and its CQs.
    #[default]
    SharedCq,
}

/// Reactor sizing and behaviour. `Default` suits small-message RPC.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReactorConfig {
    /// How to wait when idle.
    pub event_mode: EventMode,
    /// CQs the reactor owns; channels are spread over them.
    pub cq_count: u32,
    /// Entries per CQ.
    pub cq_size: u32,
    /// Bytes per send and receive slot (the largest SEND is 8 bytes less).
    pub slot_size: usize,
    /// Receives kept posted per QP; with an SRQ, each connection's share of
    /// it (the credits its peer gets).
    pub recv_depth: u32,
    /// Receives in one shared receive queue for all of the reactor's QPs
    /// (0: every QP keeps its own ring of `recv_depth`). Memory then grows
    /// with the traffic in flight instead of with the number of peers.
    /// Connections are refused once their `recv_depth` shares would exceed
    /// it, so credit flow control still rules out RNR.
    pub srq_depth: u32,
    /// Consumed receives are reposted in batches of this many (fewer after
    /// a few empty busy-poll passes, or before the reactor sleeps).
    pub repost_batch: u32,
    /// Send-queue depth per QP (rounded down to a power of two).
    pub sq_depth: u32,
    /// Send slots per QP.
    pub send_slots: u32,
    /// Signal every Nth send-queue request.
    pub signal_interval: u32,
    /// Inline payload size to ask the QP for.
    pub max_inline: u32,
    /// Longest sleep in the Blocking and Epoll modes before `on_idle` runs.
    pub idle_timeout: Duration,
}

impl Default for ReactorConfig {
    fn default() -> Self {
        Self {
            event_mode: EventMode::BusyPoll,
            cq_count: 1,
            cq_size: 4096,
            slot_size: 4096,
            recv_depth: 128,
            srq_depth: 0,
            repost_batch: 16,
            sq_depth: 256,
            send_slots: 64,
            signal_interval: 16,
            max_inline: 64,
            idle_timeout: Duration::from_millis(10),
        }
    }
}

/// A connection (one channel of one session) within a reactor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnId(pub u32);

/// A session (one endpoint and its handler) within a reactor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SessionId(pub usize);

/// Why a request was not staged.
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    /// No credit, send-queue entry or send slot right now: retry after a
    /// completion or on the next `on_idle`.
    #[error("would block: the peer has no receive posted or the send queue is full")]
    WouldBlock,
    /// The payload exceeds the slot size.
    #[error("payload of {len} bytes exceeds the maximum of {max}")]
    TooLarge {
        /// Requested length.
        len: usize,
        /// The connection's maximum payload.
        max: usize,
    },
    /// The connection failed or does not exist.
    #[error("the connection is closed")]
    Closed,
    /// The fill closure of [`Ctx::send_from`] staged nothing.
    #[error("the fill closure produced no message")]
    Cancelled,
    /// The request itself is invalid.
    #[error(transparent)]
    Invalid(Error),
}

/// Callbacks a session implements. Only `on_message` is required.
///
/// Callbacks run on the reactor thread and must not block; work they stage
/// through the [`Ctx`] goes out at the end of the pass.
#[allow(unused_variables)]
pub trait Handler {
    /// The peer's first credit update arrived: the connection can send.
    fn on_established(&mut self, ctx: &mut Ctx<'_>, conn: ConnId) {}
    /// A SEND arrived. `data` is valid only during the call.
    fn on_message(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, data: &[u8], imm: Option<u32>);
    /// A WRITE_WITH_IMM of `len` bytes landed in one of our exported regions.
    fn on_write_imm(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, imm: u32, len: u32) {}
    /// A SEND staged with sequence number `seq` completed locally.
    fn on_send_complete(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, seq: u32) {}
    /// A WRITE staged with sequence number `seq` completed.
    fn on_write_complete(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, seq: u32) {}
    /// A READ staged with sequence number `seq` completed: the bytes are local.
    fn on_read_complete(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, seq: u32) {}
    /// The connection failed (a completion error or a failed post). It stays
    /// closed; other connections are unaffected.
    fn on_error(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, error: &Error) {}
    /// A pass found no completions (busy poll) or a wait timed out.
    fn on_idle(&mut self, ctx: &mut Ctx<'_>) {}
}

impl<H: Handler + ?Sized> Handler for Box<H> {
    fn on_established(&mut self, ctx: &mut Ctx<'_>, conn: ConnId) {
        (**self).on_established(ctx, conn)
    }
    fn on_message(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, data: &[u8], imm: Option<u32>) {
        (**self).on_message(ctx, conn, data, imm)
    }
    fn on_write_imm(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, imm: u32, len: u32) {
        (**self).on_write_imm(ctx, conn, imm, len)
    }
    fn on_send_complete(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, seq: u32) {
        (**self).on_send_complete(ctx, conn, seq)
    }
    fn on_write_complete(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, seq: u32) {
        (**self).on_write_complete(ctx, conn, seq)
    }
    fn on_read_complete(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, seq: u32) {
        (**self).on_read_complete(ctx, conn, seq)
    }
    fn on_error(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, error: &Error) {
        (**self).on_error(ctx, conn, error)
    }
    fn on_idle(&mut self, ctx: &mut Ctx<'_>) {
        (**self).on_idle(ctx)
    }
}

/// One handler shared by several sessions of a reactor (a relay's upstream
/// and downstream, a mesh's peers), which the owner can also inspect between
/// passes. Callbacks never nest, so the borrow never conflicts.
impl<H: Handler> Handler for std::rc::Rc<std::cell::RefCell<H>> {
    fn on_established(&mut self, ctx: &mut Ctx<'_>, conn: ConnId) {
        self.borrow_mut().on_established(ctx, conn)
    }
    fn on_message(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, data: &[u8], imm: Option<u32>) {
        self.borrow_mut().on_message(ctx, conn, data, imm)
    }
    fn on_write_imm(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, imm: u32, len: u32) {
        self.borrow_mut().on_write_imm(ctx, conn, imm, len)
    }
    fn on_send_complete(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, seq: u32) {
        self.borrow_mut().on_send_complete(ctx, conn, seq)
    }
    fn on_write_complete(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, seq: u32) {
        self.borrow_mut().on_write_complete(ctx, conn, seq)
    }
    fn on_read_complete(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, seq: u32) {
        self.borrow_mut().on_read_complete(ctx, conn, seq)
    }
    fn on_error(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, error: &Error) {
        self.borrow_mut().on_error(ctx, conn, error)
    }
    fn on_idle(&mut self, ctx: &mut Ctx<'_>) {
        self.borrow_mut().on_idle(ctx)
    }
}

/// What a callback may do: stage work on any connection of the reactor.
pub struct Ctx<'a> {
    conns: &'a mut [Conn],
    stop: &'a AtomicBool,
    /// In `on_message`: the message's receive slot, until the handler holds it.
    current: Option<HeldRecv>,
    /// Set when a call may have staged work or queued a repost, so an idle
    /// pass knows whether it has anything to flush.
    touched: bool,
}

/// A received message whose receive slot the handler kept past `on_message`
/// with [`Ctx::hold`]. The slot is not reposted (so the peer gets one credit
/// fewer) until the message is [released](Ctx::release) or
/// [forwarded](Ctx::forward): holding messages is how a relay pushes
/// back on its upstream. Dropping it leaks the slot for the connection's life.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a held receive slot is only reposted by release or forward"]
pub struct HeldRecv {
    conn: ConnId,
    slot: u32,
    /// Bytes received, header included.
    len: u32,
}

impl HeldRecv {
    /// The connection the message arrived on.
    pub fn conn(&self) -> ConnId {
        self.conn
    }

    /// Payload length in bytes.
    pub fn len(&self) -> usize {
        self.len as usize - HEADER_LEN
    }

    /// True for a message with no payload.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl fmt::Debug for Ctx<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ctx")
            .field("conns", &self.conns.len())
            .finish()
    }
}

impl Ctx<'_> {
    fn conn(&mut self, conn: ConnId) -> Result<&mut Conn, SendError> {
        self.touched = true;
        self.conns.get_mut(conn.0 as usize).ok_or(SendError::Closed)
    }

    /// Stages a SEND of `data` (copied into a registered send slot).
    /// Returns the sequence number `on_send_complete` will report.
    #[inline]
    pub fn send(&mut self, conn: ConnId, data: &[u8], imm: Option<u32>) -> Result<u32, SendError> {
        self.send_with(conn, data.len(), imm, |buf| buf.copy_from_slice(data))
    }

    /// Stages a SEND of `len` bytes that `fill` writes directly into the
    /// registered send slot (no intermediate copy).
    #[inline]
    pub fn send_with(
        &mut self,
        conn: ConnId,
        len: usize,
        imm: Option<u32>,
        fill: impl FnOnce(&mut [u8]),
    ) -> Result<u32, SendError> {
        self.conn(conn)?.stage_send(len, imm, |buf| {
            fill(buf);
            Some(len)
        })
    }

    /// Stages a SEND whose payload `fill` produces in place, in a registered
    /// send slot of `capacity` bytes: it returns how many bytes it wrote, or
    /// `None` to stage nothing ([`SendError::Cancelled`]). Made for reading
    /// a file or socket straight into the slot when the length is not known
    /// in advance.
    ///
    /// ```no_run
    /// # use rdma_comm_core::reactor::*;
    /// # use std::io::Read;
    /// # fn demo(ctx: &mut Ctx<'_>, conn: ConnId, input: &mut impl Read) {
    /// let capacity = ctx.max_payload(conn);
    /// let staged = ctx.send_from(conn, capacity, None, |slot| input.read(slot).ok());
    /// # }
    /// ```
    #[inline]
    pub fn send_from(
        &mut self,
        conn: ConnId,
        capacity: usize,
        imm: Option<u32>,
        fill: impl FnOnce(&mut [u8]) -> Option<usize>,
    ) -> Result<u32, SendError> {
        self.conn(conn)?.stage_send(capacity, imm, fill)
    }

    /// In `on_message`: keeps the message's receive slot after the callback
    /// returns. `None` outside `on_message` or if already held.
    pub fn hold(&mut self) -> Option<HeldRecv> {
        self.current.take()
    }

    /// The payload of a held message.
    pub fn held_bytes(&self, held: &HeldRecv) -> &[u8] {
        match self.conns.get(held.conn.0 as usize) {
            Some(conn) => &conn.recv_bytes(held.slot, held.len as usize)[HEADER_LEN..],
            None => &[],
        }
    }

    /// Gives a held receive slot back: it is reposted with this pass.
    pub fn release(&mut self, held: HeldRecv) {
        self.touched = true;
        if let Some(conn) = self.conns.get_mut(held.conn.0 as usize) {
            conn.queue_repost(held.slot);
        }
    }

    /// Sends a held message on to `to` without copying it: the SEND reads
    /// the receive slot itself, which is reposted once the SEND completes
    /// (`on_send_complete` on `to` reports it). On error the message comes
    /// back still held, so it can be retried later in order.
    #[inline]
    pub fn forward(
        &mut self,
        to: ConnId,
        held: HeldRecv,
        imm: Option<u32>,
    ) -> Result<u32, (SendError, HeldRecv)> {
        self.touched = true;
        let Some(origin) = self.conns.get(held.conn.0 as usize) else {
            return Err((SendError::Closed, held));
        };
        let Some(source) = origin.recv_slot_source(held.slot) else {
            return Err((SendError::Closed, held));
        };
        let Some(target) = self.conns.get_mut(to.0 as usize) else {
            return Err((SendError::Closed, held));
        };
        target
            .stage_forward(source, held.len as usize, imm, held.conn, held.slot)
            .map_err(|error| (error, held))
    }

    /// Stages an RDMA WRITE from `local` to `remote`; with `imm` it consumes
    /// one of the peer's receives and needs a credit. `local`'s region must
    /// stay registered until `on_write_complete`.
    #[inline]
    pub fn write(
        &mut self,
        conn: ConnId,
        local: &LocalSlice<'_>,
        remote: RemoteSlice,
        imm: Option<u32>,
    ) -> Result<u32, SendError> {
        self.conn(conn)?.stage_write(local, remote, imm)
    }

    /// Stages an RDMA READ of `remote` into `local` (registered with
    /// `LOCAL_WRITE`, and kept registered until `on_read_complete`).
    #[inline]
    pub fn read(
        &mut self,
        conn: ConnId,
        local: &LocalSlice<'_>,
        remote: RemoteSlice,
    ) -> Result<u32, SendError> {
        self.conn(conn)?.stage_read(local, remote)
    }

    /// Signals the request last staged on `conn`, so its completion (and
    /// that of everything before it) is reported as soon as it happens
    /// instead of with the next signaled request: for a final message whose
    /// completion the handler waits for.
    pub fn signal_staged(&mut self, conn: ConnId) {
        self.touched = true;
        if let Some(conn) = self.conns.get_mut(conn.0 as usize) {
            conn.signal_last_staged();
        }
    }

    /// Requests staged on `conn` in this pass so far (they leave in one
    /// doorbell at its end): lets a sender cap its batch size.
    pub fn staged(&self, conn: ConnId) -> usize {
        self.conns.get(conn.0 as usize).map_or(0, |c| c.batch.len())
    }

    /// Largest payload one SEND on `conn` can carry.
    pub fn max_payload(&self, conn: ConnId) -> usize {
        self.conns.get(conn.0 as usize).map_or(0, Conn::max_payload)
    }

    /// True once the connection can send.
    pub fn is_established(&self, conn: ConnId) -> bool {
        self.conns
            .get(conn.0 as usize)
            .is_some_and(|c| c.state == ConnState::Established)
    }

    /// The channel index of `conn` within its session's endpoint.
    pub fn channel_index(&self, conn: ConnId) -> usize {
        self.conns.get(conn.0 as usize).map_or(0, |c| c.channel)
    }

    /// Asks the reactor's `run` loop to return after this pass.
    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::Release);
    }
}

/// Stops a running reactor from any thread.
#[derive(Debug, Clone)]
pub struct Stopper {
    flag: Arc<AtomicBool>,
    waker: Waker,
}

impl Stopper {
    /// Makes `run` return after its current pass.
    pub fn stop(&self) {
        self.flag.store(true, Ordering::Release);
        self.waker.wake();
    }
}

/// Bytes of every slot the reactor keeps for its credit header: a SEND
/// carries at most `slot_size - SEND_HEADER_LEN` payload bytes.
pub const SEND_HEADER_LEN: usize = HEADER_LEN;

/// Completions polled per CQ per call.
const POLL_BATCH: usize = 32;
/// Connections per reactor: `wr_id` carries the connection index in 24 bits,
/// the all-ones value meaning "SRQ".
const MAX_CONNS: usize = SRQ_CONN as usize;
/// Empty busy-poll passes after which unsignaled tails are signaled out.
const TAIL_SIGNAL_IDLE_PASSES: u32 = 1024;
/// Empty busy-poll passes after which receives consumed since the last
/// batch are reposted anyway. Not on the first empty pass: in a ping-pong
/// the next message usually lands then, and a pass that is busy posting
/// receives finds it later.
const REPOST_IDLE_PASSES: u32 = 8;

/// The reactor's shared receive queue, its slots and who may use how many.
struct SrqPool {
    shared: SharedRing,
    // Registered for as long as the reactor lives; dropped after the QPs.
    _region: MemoryRegion,
    /// Sum of the connections' shares.
    promised: u32,
    /// (QP number, connection index), sorted: which connection consumed an
    /// SRQ receive.
    owners: Vec<(u32, u32)>,
    /// Slots consumed by a QP the reactor does not know, to repost.
    orphans: RecvBatch<'static, MAX_REPOST>,
    slot_size: usize,
}

// SAFETY: the ring pointer and the orphan batch point into `_region`, which
// the pool owns; moving the pool to another thread moves their owner too.
unsafe impl Send for SrqPool {}

impl SrqPool {
    fn new(pd: &ProtectionDomain, config: &ReactorConfig) -> Result<Self> {
        let slot_size = config.slot_size.max(HEADER_LEN);
        let srq = pd.create_srq(config.srq_depth)?;
        let slots = config.srq_depth;
        let region = pd.alloc_mr(slot_size * slots as usize, AccessFlags::LOCAL_WRITE)?;
        let ring = Ring::of(&region);
        let mut batch = RecvBatch::<MAX_REPOST>::new();
        for slot in 0..slots {
            let _ = batch.push(recv_request(ring, slot_size, SRQ_CONN, slot));
            if batch.is_full() {
                srq.post_recv_batch(&mut batch)?;
            }
        }
        srq.post_recv_batch(&mut batch)?;
        Ok(Self {
            shared: SharedRing { ring, srq, slots },
            _region: region,
            promised: 0,
            owners: Vec::new(),
            orphans: RecvBatch::new(),
            slot_size,
        })
    }

    #[inline]
    fn owner(&self, qpn: u32) -> Option<u32> {
        let at = self.owners.binary_search_by_key(&qpn, |&(q, _)| q).ok()?;
        Some(self.owners[at].1)
    }

    #[cold]
    fn repost_orphan(&mut self, slot: u32) -> Result<()> {
        if slot < self.shared.slots {
            let request = recv_request(self.shared.ring, self.slot_size, SRQ_CONN, slot);
            let _ = self.orphans.push(request);
        }
        if self.orphans.is_full() {
            self.shared.srq.post_recv_batch(&mut self.orphans)?;
        }
        Ok(())
    }
}

/// A run-to-completion reactor. See the module docs.
pub struct Reactor<H: Handler> {
    config: ReactorConfig,
    // Drop order: QPs (in the endpoints) first, then the regions in the
    // connections, then the CQs and their channels.
    // By session; `None` once removed (session ids are never reused).
    endpoints: Vec<Option<Endpoint>>,
    conns: Vec<Conn>,
    handlers: Vec<Option<H>>,
    cqs: Vec<CompletionQueue>,
    channels: Vec<CompletionChannel>,
    waiter: Waiter,
    srq: Option<SrqPool>,
    pd: ProtectionDomain,
    wcs: [WorkCompletion; POLL_BATCH],
    next_cq: usize,
    idle_passes: u32,
    /// The last flush left work behind that any pass must do (or sessions
    /// changed since).
    unsettled: bool,
    /// The last flush left receives to repost once the reactor goes idle.
    reposts_left: bool,
    /// The last flush left an unsignaled tail to signal out when idle.
    tails_left: bool,
    /// Busy passes between clock readings in `run_for`, as learned so far.
    clock_stride: u32,
    stop: Arc<AtomicBool>,
}

impl<H: Handler> fmt::Debug for Reactor<H> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reactor")
            .field("config", &self.config)
            .field("sessions", &self.endpoints.len())
            .field("conns", &self.conns.len())
            .finish()
    }
}

impl<H: Handler> Reactor<H> {
    /// Creates the reactor's CQs (and completion channels in the event modes).
    pub fn new(pd: &ProtectionDomain, config: ReactorConfig) -> Result<Self> {
        let ctx = pd.context();
        let cq_count = config.cq_count.max(1) as usize;
        let channels: Vec<CompletionChannel> = match config.event_mode {
            EventMode::BusyPoll => Vec::new(),
            EventMode::Blocking => vec![ctx.create_comp_channel()?],
            EventMode::Epoll => (0..cq_count)
                .map(|_| ctx.create_comp_channel())
                .collect::<Result<_>>()?,
        };
        let cqs = (0..cq_count)
            .map(|i| ctx.create_cq(config.cq_size, channels.get(i).or(channels.first())))
            .collect::<Result<Vec<_>>>()?;
        let waiter = Waiter::new(config.event_mode, &channels)?;
        let srq = match config.srq_depth {
            0 => None,
            _ => Some(SrqPool::new(pd, &config)?),
        };
        Ok(Self {
            config,
            endpoints: Vec::new(),
            conns: Vec::new(),
            handlers: Vec::new(),
            cqs,
            channels,
            waiter,
            srq,
            pd: pd.clone(),
            wcs: [WorkCompletion::default(); POLL_BATCH],
            next_cq: 0,
            idle_passes: 0,
            unsettled: true,
            reposts_left: false,
            tails_left: false,
            clock_stride: 1,
            stop: Arc::new(AtomicBool::new(false)),
        })
    }

    /// The configuration in force.
    pub fn config(&self) -> &ReactorConfig {
        &self.config
    }

    /// A channel spec whose QP reports to this reactor's CQs (spread over them
    /// round-robin) with queue depths matching the reactor's settings.
    pub fn channel_spec(&mut self, name: impl Into<String>) -> ChannelSpec {
        let cq = self.cqs[self.next_cq % self.cqs.len()].shared();
        self.next_cq += 1;
        let qp = QpConfig {
            max_send_wr: self.config.sq_depth,
            max_recv_wr: self.config.recv_depth,
            max_inline_data: self.config.max_inline,
            ..QpConfig::default()
        };
        ChannelSpec {
            name: name.into(),
            cq: CqChoice::Shared(cq),
            qp,
            srq: self.srq.as_ref().map(|pool| pool.shared.srq.clone()),
        }
    }

    /// Like [`channel_spec`](Self::channel_spec), also letting the peer WRITE
    /// and/or READ the regions this side exports.
    pub fn channel_spec_with_access(
        &mut self,
        name: impl Into<String>,
        remote_access: AccessFlags,
    ) -> ChannelSpec {
        let mut spec = self.channel_spec(name);
        spec.qp.remote_access = remote_access;
        spec
    }

    /// A server configuration whose QPs report to this reactor, with
    /// `remote_access` granted to peers.
    pub fn server_config(&mut self, remote_access: AccessFlags) -> ServerConfig {
        let spec = self.channel_spec_with_access("", remote_access);
        ServerConfig {
            qp: spec.qp,
            cq: spec.cq,
            srq: spec.srq,
            ..ServerConfig::default()
        }
    }

    /// Takes over a connected endpoint (built from [`channel_spec`](Self::channel_spec)s):
    /// posts its receive rings now and sends the initial credit updates with
    /// the next pass.
    /// `handler` gets every callback for its channels.
    pub fn add(&mut self, endpoint: Endpoint, handler: H) -> Result<SessionId> {
        let ours: Vec<CqId> = self.cqs.iter().map(CompletionQueue::id).collect();
        for channel in endpoint.channels() {
            let qp = channel.qp();
            if !ours.contains(&qp.send_cq_id()) || !ours.contains(&qp.recv_cq_id()) {
                return Err(Error::InvalidArgument(
                    "channel was not created on this reactor's CQs (build it from Reactor::channel_spec)",
                ));
            }
            let srq_matches = match (&self.srq, qp.shared_receive_queue()) {
                (Some(pool), Some(srq)) => pool.shared.srq.same_as(&srq),
                (None, None) => true,
                _ => false,
            };
            if !srq_matches {
                return Err(Error::InvalidArgument(
                    "channel's receive queue does not match this reactor's (build it from Reactor::channel_spec)",
                ));
            }
        }
        let share = self.config.recv_depth.max(2);
        let shares = share * endpoint.channels().len() as u32;
        if let Some(pool) = &self.srq
            && pool.promised + shares > pool.shared.slots
        {
            return Err(Error::InvalidArgument(
                "the reactor's SRQ cannot give these connections their recv_depth shares (raise srq_depth)",
            ));
        }
        let session = self.endpoints.len();
        let first = self.conns.len();
        if first + endpoint.channels().len() > MAX_CONNS {
            return Err(Error::InvalidArgument(
                "a reactor serves at most 2^24 connections (the wr_id field)",
            ));
        }
        let mut conns = Vec::with_capacity(endpoint.channels().len());
        for (index, channel) in endpoint.channels().iter().enumerate() {
            let id = ConnId((first + index) as u32);
            let shared = self.srq.as_ref().map(|pool| &pool.shared);
            let mut conn = Conn::new(
                id,
                session,
                index,
                &self.pd,
                channel.qp(),
                &self.config,
                shared,
            )?;
            conn.post_initial_receives(channel.qp())?;
            // Goes out with the first pass, so a test (or an application)
            // that adds both ends before running either sees no RNR at all.
            conn.stage_initial_update();
            conns.push(conn);
        }
        if let Some(pool) = &mut self.srq {
            pool.promised += shares;
            for (conn, channel) in conns.iter().zip(endpoint.channels()) {
                pool.owners.push((channel.qp().qpn(), conn.id.0));
            }
            pool.owners.sort_unstable();
        }
        self.conns.extend(conns);
        self.endpoints.push(Some(endpoint));
        self.handlers.push(Some(handler));
        // The initial credit updates wait for the next flush.
        self.unsettled = true;
        Ok(SessionId(session))
    }

    /// A handle that stops [`run`](Self::run) from any thread.
    pub fn stopper(&self) -> Stopper {
        Stopper {
            flag: Arc::clone(&self.stop),
            waker: self.waiter.waker.clone(),
        }
    }

    /// The handler of a session (`None` if it was removed).
    pub fn handler(&self, session: SessionId) -> Option<&H> {
        self.handlers.get(session.0)?.as_ref()
    }

    /// The handler of a session, mutably.
    pub fn handler_mut(&mut self, session: SessionId) -> Option<&mut H> {
        self.handlers.get_mut(session.0)?.as_mut()
    }

    /// The endpoint of a session.
    pub fn endpoint(&self, session: SessionId) -> Option<&Endpoint> {
        self.endpoints.get(session.0)?.as_ref()
    }

    /// The endpoint of a session, mutably (for [`Endpoint::check_peer`]).
    pub fn endpoint_mut(&mut self, session: SessionId) -> Option<&mut Endpoint> {
        self.endpoints.get_mut(session.0)?.as_mut()
    }

    /// Sessions currently served (added and not removed).
    pub fn sessions(&self) -> impl Iterator<Item = SessionId> + '_ {
        self.endpoints
            .iter()
            .enumerate()
            .filter(|(_, e)| e.is_some())
            .map(|(i, _)| SessionId(i))
    }

    /// Takes a session out of the reactor: its QPs are moved to the error
    /// state, its receive rings and send slots are deregistered, and the
    /// endpoint and handler are handed back (drop the endpoint, or `close`
    /// it, to tell the peer). Completions still queued for it are ignored.
    /// Messages of this session that another connection is still
    /// forwarding fail that forward. `None` if the session is unknown.
    ///
    /// A server removes a session when its peer disconnects, so a long-lived
    /// reactor holds only the peers it serves (plus a small record per
    /// connection it ever had).
    pub fn remove(&mut self, session: SessionId) -> Option<(Endpoint, H)> {
        let endpoint = self.endpoints.get_mut(session.0)?.take()?;
        let handler = self.handlers[session.0].take()?;
        for channel in endpoint.channels() {
            // The QP stops touching the rings before they are deregistered;
            // errors add nothing here (the endpoint is going away).
            let _ = channel.qp().set_error();
        }
        let mut released = Vec::new();
        let mut shares = 0;
        for conn in self.conns.iter_mut().filter(|c| c.session == session.0) {
            conn.remove(|origin, slot| released.push((origin, slot)));
            shares += conn.recv_depth;
        }
        if let Some(pool) = &mut self.srq {
            // Its QPs are in the error state and take no more receives.
            pool.promised = pool.promised.saturating_sub(shares);
        }
        self.release_forwarded(released);
        self.unsettled = true;
        Some((endpoint, handler))
    }

    /// Reposts receive slots whose forwards died with another connection.
    #[cold]
    fn release_forwarded(&mut self, released: Vec<(ConnId, u32)>) {
        for (origin, slot) in released {
            if let Some(origin) = self.conns.get_mut(origin.0 as usize) {
                origin.queue_repost(slot);
            }
        }
    }

    /// The connections of a session, in channel order.
    pub fn conns(&self, session: SessionId) -> impl Iterator<Item = ConnId> + '_ {
        self.conns
            .iter()
            .filter(move |c| c.session == session.0 && c.state != ConnState::Removed)
            .map(|c| c.id)
    }

    /// Send-queue entries in use, send slots in use and credits of `conn`.
    pub fn conn_stats(&self, conn: ConnId) -> Option<(u32, u32, i32)> {
        self.conns.get(conn.0 as usize).map(Conn::stats)
    }

    /// Runs passes until a [`Stopper`] or [`Ctx::stop`] asks it to return.
    pub fn run(&mut self) -> Result<()> {
        // A plain load per pass: a locked read-modify-write on every empty
        // busy-poll pass would cost more than the poll itself.
        while !self.stop.load(Ordering::Acquire) {
            self.turn()?;
        }
        self.stop.store(false, Ordering::Release);
        Ok(())
    }

    /// Runs passes until stopped (returns `true`) or until about `limit`
    /// has passed (returns `false`): for a caller that also has something
    /// to watch now and then, such as its peers' control connections.
    ///
    /// ```no_run
    /// # use rdma_comm_core::reactor::*;
    /// # use std::time::Duration;
    /// # fn demo<H: Handler>(reactor: &mut Reactor<H>, session: SessionId) -> rdma_comm_core::Result<()> {
    /// while !reactor.run_for(Duration::from_millis(100))? {
    ///     if let Some(endpoint) = reactor.endpoint_mut(session) {
    ///         if !matches!(endpoint.check_peer(), rdma_comm_core::session::PeerStatus::Alive) {
    ///             break;
    ///         }
    ///     }
    /// }
    /// # Ok(()) }
    /// ```
    pub fn run_for(&mut self, limit: Duration) -> Result<bool> {
        // A busy pass is cheaper than reading the clock (a syscall where the
        // clocksource is not the TSC): the timer reads it every so many
        // passes. A pass that may sleep is long enough to read it every time.
        let mut timer = self.pass_timer(limit);
        let mut expired = false;
        while !expired && !self.stop.load(Ordering::Acquire) {
            let done = self.turn()?;
            expired = timer.expired_after(done);
        }
        self.clock_stride = timer.stride();
        if expired {
            return Ok(false);
        }
        self.stop.store(false, Ordering::Release);
        Ok(true)
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

    /// One pass, then (in the event modes, if it found nothing) one wait.
    pub fn turn(&mut self) -> Result<usize> {
        let done = self.poll_once()?;
        if done == 0 && self.config.event_mode != EventMode::BusyPoll && self.prepare_wait()? {
            self.waiter.wait(self.config.idle_timeout)?;
            self.drain_channel_events()?;
        }
        Ok(done)
    }

    /// Polls every CQ once (in batches), dispatches, then flushes: reposts
    /// receives and rings one doorbell per QP with staged work. Calls
    /// `on_idle` when nothing completed. Returns the completions handled.
    pub fn poll_once(&mut self) -> Result<usize> {
        let mut done = 0;
        for cq_index in 0..self.cqs.len() {
            loop {
                let n = self.cqs[cq_index].poll(&mut self.wcs)?.len();
                for i in 0..n {
                    let wc = self.wcs[i];
                    self.dispatch(&wc);
                }
                done += n;
                if n < POLL_BATCH {
                    break;
                }
            }
        }
        let mut touched = done > 0;
        if done == 0 {
            let mut ctx = Ctx {
                conns: &mut self.conns,
                stop: &self.stop,
                current: None,
                touched: false,
            };
            for handler in self.handlers.iter_mut().flatten() {
                handler.on_idle(&mut ctx);
            }
            touched = ctx.touched;
            self.idle_passes = self.idle_passes.saturating_add(1);
        } else {
            self.idle_passes = 0;
        }
        // Unsignaled requests left at the tail of a burst would never report
        // completion; after a while with nothing to do, signal them out.
        // Retried every idle pass from then on: the signal may have to wait
        // for a credit.
        let signal_tails = self.tails_left && self.idle_passes >= TAIL_SIGNAL_IDLE_PASSES;
        let tidy = self.reposts_left && self.idle_passes >= REPOST_IDLE_PASSES;
        // An idle pass that staged nothing, after a flush that left nothing
        // behind, has nothing to flush: skipping the walk over the
        // connections keeps empty passes, and so the time to notice the next
        // completion, short. Receives waiting for a fuller batch do not count
        // until the reactor has been idle for a while.
        if touched || self.unsettled || tidy || signal_tails {
            self.flush(tidy, signal_tails);
        }
        Ok(done)
    }

    /// Arms every CQ and polls once more. Returns true if nothing is pending,
    /// so the caller may sleep on [`event_fd`](Self::event_fd) without
    /// missing a completion that raced the arming.
    pub fn prepare_wait(&mut self) -> Result<bool> {
        if self.config.event_mode == EventMode::BusyPoll {
            return Ok(false);
        }
        // Sleeping with an unsignaled tail would leave its completions
        // unreported: signal it out first. Its completion (or, without a
        // credit, the peer's next credit update) then wakes us.
        self.flush(true, true);
        for cq in &mut self.cqs {
            cq.req_notify(false)?;
        }
        Ok(self.poll_once()? == 0)
    }

    /// Consumes the completion events that woke us (acked in batches).
    pub fn drain_channel_events(&mut self) -> Result<()> {
        for channel in &self.channels {
            while channel.try_get_event()?.is_some() {}
        }
        Ok(())
    }

    /// The descriptor to wait on in another event loop (Epoll: the epoll set;
    /// Blocking: the completion channel). Call [`prepare_wait`](Self::prepare_wait)
    /// before sleeping on it and [`drain_channel_events`](Self::drain_channel_events)
    /// plus [`poll_once`](Self::poll_once) when it fires.
    pub fn event_fd(&self) -> Option<RawFd> {
        self.waiter.fd()
    }

    #[inline]
    fn dispatch(&mut self, wc: &WorkCompletion) {
        let (mut index, kind) = decode_wr_id(wc.wr_id());
        if index == SRQ_CONN {
            index = self.srq_owner(wc, kind);
        }
        let Some(conn) = self.conns.get_mut(index as usize) else {
            log::warn!("completion for unknown connection {index}: {wc:?}");
            return;
        };
        if !wc.is_success() || conn.is_closed() {
            self.dispatch_unusual(index, wc, kind);
            return;
        }
        let (session, id) = (conn.session, conn.id);
        let Some(handler) = self.handlers[session].as_mut() else {
            return;
        };
        let mut ctx = Ctx {
            conns: &mut self.conns,
            stop: &self.stop,
            current: None,
            touched: false,
        };
        match kind {
            WrKind::Recv { slot } => {
                let conn = &mut ctx.conns[index as usize];
                let len = wc.byte_len();
                if wc.opcode() == WcOpcode::RECV_RDMA_WITH_IMM {
                    conn.queue_repost(slot);
                    handler.on_write_imm(&mut ctx, id, wc.imm().unwrap_or(0), len);
                    return;
                }
                let Some((credit, data)) = conn.recv_message(slot, len) else {
                    // A credit update: the immediate is the peer's receive count.
                    conn.queue_repost(slot);
                    if conn.peer_credit(wc.imm().unwrap_or(0)) {
                        handler.on_established(&mut ctx, id);
                    }
                    return;
                };
                if conn.peer_credit(credit) {
                    handler.on_established(&mut ctx, id);
                }
                ctx.current = Some(HeldRecv {
                    conn: id,
                    slot,
                    len,
                });
                // SAFETY: the bytes live in the connection's receive region,
                // which outlives this call; the slot is reposted only after
                // the handler returns (or releases a hold on it), so the NIC
                // does not write it meanwhile, and nothing reachable through
                // `ctx` can.
                let data = unsafe { std::slice::from_raw_parts(data.0, data.1) };
                handler.on_message(&mut ctx, id, data, wc.imm());
                if ctx.current.is_some() {
                    ctx.conns[index as usize].queue_repost(slot);
                }
            }
            WrKind::Send { seq } => {
                let count = ctx.conns[index as usize].retire_count(seq);
                for _ in 0..count {
                    let (seq, op) = ctx.conns[index as usize].pop_oldest();
                    match op.kind {
                        OpKind::Send => handler.on_send_complete(&mut ctx, id, seq),
                        OpKind::Write => handler.on_write_complete(&mut ctx, id, seq),
                        OpKind::Read => handler.on_read_complete(&mut ctx, id, seq),
                        OpKind::Forward => {
                            if let Some(origin) = ctx.conns.get_mut(op.origin as usize) {
                                origin.queue_repost(op.slot);
                            }
                            handler.on_send_complete(&mut ctx, id, seq);
                        }
                        OpKind::Credit => {}
                    }
                }
            }
            WrKind::Unknown => log::warn!("completion with a foreign wr_id: {wc:?}"),
        }
    }

    /// A failed completion, or one for a closed connection: give back the
    /// receive slot it held and, if it failed, fail the connection.
    #[cold]
    #[inline(never)]
    fn dispatch_unusual(&mut self, index: u32, wc: &WorkCompletion, kind: WrKind) {
        let conn = &mut self.conns[index as usize];
        if let WrKind::Recv { slot } = kind {
            // A receive slot of the SRQ is everyone's: it goes back even when
            // its connection is gone or the receive failed (for a QP's own
            // ring of a dead connection this does nothing).
            conn.queue_repost(slot);
        }
        if conn.is_closed() {
            return;
        }
        let (id, session) = (conn.id, conn.session);
        let error = wc
            .ok()
            .err()
            .unwrap_or(Error::InvalidArgument("failed completion"));
        self.fail(id, session, error);
    }

    /// The connection whose QP consumed an SRQ receive (`MAX_CONNS`, which
    /// no connection has, after reposting the slot of an unknown QP).
    #[inline]
    fn srq_owner(&mut self, wc: &WorkCompletion, kind: WrKind) -> u32 {
        let Some(pool) = &mut self.srq else {
            return MAX_CONNS as u32;
        };
        if let Some(owner) = pool.owner(wc.qp_num()) {
            return owner;
        }
        if let WrKind::Recv { slot } = kind
            && let Err(err) = pool.repost_orphan(slot)
        {
            log::error!("reposting an SRQ receive: {err}");
        }
        MAX_CONNS as u32
    }

    #[cold]
    fn fail(&mut self, id: ConnId, session: usize, error: Error) {
        // The failed connection's forwards give other connections' receive
        // slots back: the next pass must repost them.
        self.unsettled = true;
        // Forwards in flight on the failed connection carried other
        // connections' receive slots: give those back (a cold path, so the
        // list may allocate).
        let mut released = Vec::new();
        let conn = &mut self.conns[id.0 as usize];
        conn.fail(|origin, slot| released.push((origin, slot)));
        let channel = conn.channel;
        self.release_forwarded(released);
        if let Some(ch) = self.endpoints[session]
            .as_ref()
            .and_then(|e| e.channels().get(channel))
        {
            // Stops the QP, so the peer sees the failure too; errors here add nothing.
            let _ = ch.qp().set_error();
        }
        let mut ctx = Ctx {
            conns: &mut self.conns,
            stop: &self.stop,
            current: None,
            touched: false,
        };
        if let Some(handler) = self.handlers[session].as_mut() {
            handler.on_error(&mut ctx, id, &error);
        }
    }

    /// End of pass: one doorbell per QP with staged work, then the receive
    /// reposts that are due (all pending ones when `tidy`). Reposting after
    /// the doorbell keeps it off the latency path; the receives it adds are
    /// announced with the next SEND or credit update.
    /// Notes what is left for later passes: in `unsettled`, work any pass
    /// must do (reposts that are due, work or a credit update that could not
    /// go out); in `reposts_left` and `tails_left`, what an idle pass does.
    #[inline]
    fn flush(&mut self, tidy: bool, signal_tails: bool) {
        // `fail` may set it again while we walk.
        self.unsettled = false;
        let (mut unsettled, mut reposts_left, mut tails_left) = (false, false, false);
        for index in 0..self.conns.len() {
            let conn = &self.conns[index];
            let repost = conn.reposts_due() || (tidy && conn.has_pending_reposts());
            let tail = signal_tails && conn.has_unsignaled_tail();
            // Most passes on a busy-poll reactor find nothing: this loop stays
            // a few loads per connection, the work is out of line.
            let due = if conn.is_closed() {
                conn.owes_shared_slots()
            } else {
                repost || tail || !conn.is_quiet()
            };
            if due {
                self.flush_conn(index, repost, tail);
            }
            let conn = &self.conns[index];
            unsettled |= conn.is_unsettled();
            reposts_left |= conn.has_pending_reposts();
            tails_left |= conn.has_unsignaled_tail();
        }
        if let Some(pool) = &mut self.srq
            && !pool.orphans.is_empty()
            && let Err(err) = pool.shared.srq.post_recv_batch(&mut pool.orphans)
        {
            log::error!("reposting SRQ receives of an unknown QP: {err}");
        }
        self.unsettled |= unsettled;
        self.reposts_left = reposts_left;
        self.tails_left = tails_left;
    }

    /// Rings the doorbell of connection `index` and reposts its receives
    /// (`repost`), signaling out an unsignaled tail first (`tail`).
    #[inline(never)]
    fn flush_conn(&mut self, index: usize, repost: bool, tail: bool) {
        let conn = &mut self.conns[index];
        if conn.is_closed() {
            if conn.owes_shared_slots()
                && let Err(err) = conn.flush_shared_reposts()
            {
                log::error!("reposting SRQ receives of a closed connection: {err}");
            }
            return;
        }
        let (session, channel, id) = (conn.session, conn.channel, conn.id);
        let Some(qp) = self.endpoints[session]
            .as_ref()
            .and_then(|e| e.channels().get(channel))
            .map(|c| c.qp())
        else {
            return;
        };
        conn.prepare_flush();
        if tail && conn.batch.is_empty() {
            conn.stage_tail_signal();
        }
        let mut result = conn.batch.post(qp);
        if result.is_ok() && repost {
            result = conn.flush_reposts(qp);
        }
        if let Err(error) = result {
            self.fail(id, session, error);
        }
    }
}
