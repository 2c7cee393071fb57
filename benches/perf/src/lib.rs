//! # rdma-perf
//!
//! Latency and bandwidth measurement through the reactor, with perftest's
//! method and output format. Used by `examples/lat_bw` (and through it
//! `tools/compare-perftest`) and the criterion benchmarks; `examples/ping_pong`
//! and `tools/mesh` take its [`Clock`]. It is a crate of its own so that a
//! service embedding `rdma-comm-core` compiles none of it.
//!
//! Latency is a ping-pong: SEND and WRITE_WITH_IMM are answered the same way,
//! and WRITE is answered by a WRITE that the peer notices by polling the last
//! byte of its buffer, as `ib_write_lat` does. SEND and WRITE report half the
//! round trip; READ reports the full time of one READ. Times come from the TSC
//! (quanta). Bandwidth streams `iters` messages with at most `batch` requests
//! per doorbell. Both sides end when the client sends a final marker message.
#![deny(missing_docs, missing_debug_implementations)]
#![deny(unsafe_op_in_unsafe_fn)]

use std::fmt;
use std::sync::Arc;

use rdma_comm_core::error::Error;
use rdma_comm_core::reactor::{ConnId, Ctx, Handler, SendError};
use rdma_comm_core::verbs::{MemoryRegion, RemoteRegion};

/// Immediate value of the message that ends a run.
pub const DONE_MARKER: u32 = u32::MAX;

/// The end of a client's run: the done marker is staged (retried while the
/// peer has no credit for it), signaled, and the reactor stops once it has
/// completed, so the client never leaves before the server was told.
#[derive(Debug, Default)]
struct RunEnd {
    state: EndState,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum EndState {
    #[default]
    Running,
    Staging,
    Sent(u32),
    Done,
}

impl RunEnd {
    /// True once the run's measured part is over.
    fn begun(&self) -> bool {
        self.state != EndState::Running
    }

    fn begin(&mut self, ctx: &mut Ctx<'_>, conn: Option<ConnId>) {
        self.state = EndState::Staging;
        self.retry(ctx, conn);
    }

    fn retry(&mut self, ctx: &mut Ctx<'_>, conn: Option<ConnId>) {
        if self.state != EndState::Staging {
            return;
        }
        let Some(conn) = conn else {
            self.finish(ctx);
            return;
        };
        match ctx.send(conn, &[0], Some(DONE_MARKER)) {
            Ok(seq) => {
                ctx.signal_staged(conn);
                self.state = EndState::Sent(seq);
            }
            Err(SendError::WouldBlock) => {}
            Err(_) => self.finish(ctx),
        }
    }

    fn completed(&mut self, ctx: &mut Ctx<'_>, seq: u32) {
        if self.state == EndState::Sent(seq) {
            self.finish(ctx);
        }
    }

    fn finish(&mut self, ctx: &mut Ctx<'_>) {
        self.state = EndState::Done;
        ctx.stop();
    }
}

/// The operation measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PerfOp {
    /// SEND/RECV.
    Send,
    /// RDMA WRITE (latency: answered by a WRITE the peer detects by polling).
    Write,
    /// RDMA WRITE_WITH_IMM (answered the same way).
    WriteImm,
    /// RDMA READ.
    Read,
}

impl fmt::Display for PerfOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PerfOp::Send => "send",
            PerfOp::Write => "write",
            PerfOp::WriteImm => "write_imm",
            PerfOp::Read => "read",
        })
    }
}

/// What to measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PerfSpec {
    /// The operation.
    pub op: PerfOp,
    /// Message size in bytes.
    pub size: usize,
    /// Measured iterations.
    pub iters: u64,
    /// Unmeasured iterations first.
    pub warmup: u64,
    /// Bandwidth: most requests per doorbell.
    pub batch: usize,
}

/// Buffers one side needs. `buffer` holds `2 × size` bytes and is exported:
/// the first half is where the peer's WRITEs land (and what READs fetch), the
/// second half is the source of our own WRITEs, so polling the landing half
/// never sees our own marker.
#[derive(Debug, Clone)]
pub struct PerfBuffers {
    /// This side's buffer.
    pub buffer: Arc<MemoryRegion>,
    /// The peer's exported buffer.
    pub peer: RemoteRegion,
}

/// Cycle-accurate timestamps, taken the way perftest takes them.
///
/// On x86_64 this reads the TSC directly (perftest's `get_cycles`), calibrated
/// once against quanta's monotonic reference. quanta alone would fall back to
/// `clock_gettime` when the CPU does not advertise an invariant TSC, as in a
/// TCG guest, where that is an emulated HPET read costing microseconds inside
/// every measured round trip.
///
/// ```
/// let clock = rdma_perf::Clock::new();
/// let start = clock.now();
/// let elapsed_ns = clock.nanos(start, clock.now());
/// # let _ = elapsed_ns;
/// ```
#[derive(Debug)]
pub struct Clock {
    reference: quanta::Clock,
    ns_per_tick: f64,
}

impl Default for Clock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock {
    /// Calibrates the clock (spins for about 20 ms).
    pub fn new() -> Self {
        let reference = quanta::Clock::new();
        let (t0, c0) = (reference.now(), ticks(&reference));
        while reference.now().duration_since(t0) < std::time::Duration::from_millis(20) {
            std::hint::spin_loop();
        }
        let (t1, c1) = (reference.now(), ticks(&reference));
        let ns = t1.duration_since(t0).as_nanos() as f64;
        let ns_per_tick = if c1 > c0 { ns / (c1 - c0) as f64 } else { 1.0 };
        Self {
            reference,
            ns_per_tick,
        }
    }

    /// Raw ticks: cheap enough to read around every operation.
    #[inline]
    pub fn now(&self) -> u64 {
        ticks(&self.reference)
    }

    /// Nanoseconds between two readings of [`now`](Self::now).
    pub fn nanos(&self, start: u64, end: u64) -> u64 {
        (end.saturating_sub(start) as f64 * self.ns_per_tick) as u64
    }
}

#[cfg(target_arch = "x86_64")]
#[inline]
fn ticks(_reference: &quanta::Clock) -> u64 {
    // SAFETY: RDTSC has no preconditions and touches no memory.
    unsafe { core::arch::x86_64::_rdtsc() }
}

#[cfg(not(target_arch = "x86_64"))]
#[inline]
fn ticks(reference: &quanta::Clock) -> u64 {
    reference.raw()
}

/// Measures round trips (or READs) and keeps one sample per iteration.
#[derive(Debug)]
pub struct LatencyClient {
    spec: PerfSpec,
    buffers: PerfBuffers,
    conn: Option<ConnId>,
    seq: u64,
    started_at: u64,
    in_flight: bool,
    clock: Clock,
    /// Round-trip (or READ) times in clock ticks.
    samples: Vec<u64>,
    failed: Option<String>,
    end: RunEnd,
}

impl LatencyClient {
    /// A client for `spec` with preallocated sample storage.
    pub fn new(spec: PerfSpec, buffers: PerfBuffers) -> Self {
        Self {
            spec,
            buffers,
            conn: None,
            seq: 0,
            started_at: 0,
            in_flight: false,
            clock: Clock::new(),
            samples: Vec::with_capacity(spec.iters as usize),
            failed: None,
            end: RunEnd::default(),
        }
    }

    /// Per-iteration latencies in nanoseconds (half round trips for SEND and
    /// WRITE, full READs), once finished.
    pub fn latencies_ns(&self) -> Vec<u64> {
        let halve = self.spec.op != PerfOp::Read;
        self.samples
            .iter()
            .map(|&ticks| self.clock.nanos(0, ticks))
            .map(|ns| if halve { ns / 2 } else { ns })
            .collect()
    }

    /// The error that ended the run early, if any.
    pub fn failure(&self) -> Option<&str> {
        self.failed.as_deref()
    }

    /// True when every iteration was measured.
    pub fn is_done(&self) -> bool {
        self.end.begun()
    }

    /// The byte that marks iteration `seq` (never 0, so a fresh buffer differs).
    fn marker(seq: u64) -> u8 {
        (seq % 255) as u8 + 1
    }

    /// Stages iteration `self.seq`, timed from `now` (a clock reading).
    fn issue(&mut self, ctx: &mut Ctx<'_>, now: u64) {
        let Some(conn) = self.conn else { return };
        let size = self.spec.size;
        let seq = self.seq;
        let marker = Self::marker(seq);
        self.started_at = now;
        let buffer = &self.buffers.buffer;
        let result = match self.spec.op {
            PerfOp::Send => ctx.send_with(conn, size, None, |buf| {
                if let Some(last) = buf.last_mut() {
                    *last = marker;
                }
            }),
            PerfOp::Write | PerfOp::WriteImm => {
                let imm = (self.spec.op == PerfOp::WriteImm).then_some(seq as u32);
                let wrote = buffer.write(2 * size - 1, &[marker]);
                match (
                    wrote,
                    buffer.slice(size, size),
                    self.buffers.peer.slice(0, size as u64),
                ) {
                    (Ok(()), Ok(local), Ok(remote)) => ctx.write(conn, &local, remote, imm),
                    (Err(e), ..) | (_, Err(e), _) | (.., Err(e)) => Err(SendError::Invalid(e)),
                }
            }
            PerfOp::Read => match (
                buffer.slice(0, size),
                self.buffers.peer.slice(0, size as u64),
            ) {
                (Ok(local), Ok(remote)) => ctx.read(conn, &local, remote),
                (Err(e), _) | (_, Err(e)) => Err(SendError::Invalid(e)),
            },
        };
        match result {
            Ok(_) => self.in_flight = true,
            Err(SendError::WouldBlock) => self.in_flight = false,
            Err(err) => {
                self.failed = Some(err.to_string());
                ctx.stop();
            }
        }
    }

    fn answered(&mut self, ctx: &mut Ctx<'_>) {
        // Raw ticks now, nanoseconds after the run (as perftest converts its
        // cycle counts at the end): no float work inside the measured loop.
        // One reading ends this round trip and starts the next, as perftest
        // times from post to post.
        let now = self.clock.now();
        let elapsed = now.saturating_sub(self.started_at);
        self.in_flight = false;
        if self.seq >= self.spec.warmup {
            self.samples.push(elapsed);
        }
        self.seq += 1;
        if self.seq == self.spec.warmup + self.spec.iters {
            self.end.begin(ctx, self.conn);
        } else {
            self.issue(ctx, now);
        }
    }
}

impl Handler for LatencyClient {
    fn on_established(&mut self, ctx: &mut Ctx<'_>, conn: ConnId) {
        self.conn = Some(conn);
        self.issue(ctx, self.clock.now());
    }

    fn on_message(&mut self, ctx: &mut Ctx<'_>, _conn: ConnId, _data: &[u8], _imm: Option<u32>) {
        if self.spec.op == PerfOp::Send && self.in_flight {
            self.answered(ctx);
        }
    }

    fn on_write_imm(&mut self, ctx: &mut Ctx<'_>, _conn: ConnId, _imm: u32, _len: u32) {
        if self.spec.op == PerfOp::WriteImm && self.in_flight {
            self.answered(ctx);
        }
    }

    fn on_read_complete(&mut self, ctx: &mut Ctx<'_>, _conn: ConnId, _seq: u32) {
        if self.spec.op == PerfOp::Read && self.in_flight {
            self.answered(ctx);
        }
    }

    fn on_error(&mut self, ctx: &mut Ctx<'_>, _conn: ConnId, error: &Error) {
        self.failed = Some(error.to_string());
        ctx.stop();
    }

    fn on_send_complete(&mut self, ctx: &mut Ctx<'_>, _conn: ConnId, seq: u32) {
        self.end.completed(ctx, seq);
    }

    fn on_idle(&mut self, ctx: &mut Ctx<'_>) {
        // The common case first: a ping is out and its answer comes as a
        // completion; nothing to do until then.
        if self.in_flight && self.spec.op != PerfOp::Write {
            return;
        }
        if self.end.begun() {
            self.end.retry(ctx, self.conn);
            return;
        }
        if self.conn.is_none() {
            return;
        }
        if !self.in_flight {
            self.issue(ctx, self.clock.now());
        } else if self.spec.op == PerfOp::Write {
            let marker = Self::marker(self.seq);
            if poll_byte(&self.buffers.buffer, self.spec.size - 1, |b| b == marker) {
                // The reflector's WRITE carried our marker back into our landing half.
                self.answered(ctx);
            }
        }
    }
}

/// Spins on one byte of `region` for a short while, the way perftest's WRITE
/// latency test does: a WRITE's answer shows up in memory, not in the CQ, so
/// checking it only once per reactor pass would add a pass to every round trip.
#[inline]
fn poll_byte(region: &MemoryRegion, offset: usize, done: impl Fn(u8) -> bool) -> bool {
    for _ in 0..256 {
        if region.load_byte(offset).is_some_and(&done) {
            return true;
        }
        std::hint::spin_loop();
    }
    false
}

/// Answers a latency client: SEND by SEND, WRITE_WITH_IMM by WRITE_WITH_IMM,
/// WRITE by WRITE (after noticing the new marker by polling). Stops on the
/// client's done marker.
#[derive(Debug)]
pub struct Reflector {
    spec: PerfSpec,
    buffers: PerfBuffers,
    conn: Option<ConnId>,
    last_marker: u8,
    failed: Option<String>,
}

impl Reflector {
    /// A reflector for `spec`.
    pub fn new(spec: PerfSpec, buffers: PerfBuffers) -> Self {
        Self {
            spec,
            buffers,
            conn: None,
            last_marker: 0,
            failed: None,
        }
    }

    /// The error that ended the run early, if any.
    pub fn failure(&self) -> Option<&str> {
        self.failed.as_deref()
    }

    fn write_back(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, imm: Option<u32>) {
        let size = self.spec.size;
        let buffer = &self.buffers.buffer;
        let result = match (
            buffer.slice(0, size),
            self.buffers.peer.slice(0, size as u64),
        ) {
            (Ok(local), Ok(remote)) => ctx.write(conn, &local, remote, imm),
            (Err(e), _) | (_, Err(e)) => Err(SendError::Invalid(e)),
        };
        if let Err(err) = result {
            self.failed = Some(err.to_string());
            ctx.stop();
        }
    }
}

impl Handler for Reflector {
    fn on_established(&mut self, _ctx: &mut Ctx<'_>, conn: ConnId) {
        self.conn = Some(conn);
    }

    fn on_message(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, data: &[u8], imm: Option<u32>) {
        if imm == Some(DONE_MARKER) {
            ctx.stop();
        } else if self.spec.op == PerfOp::Send {
            // Echo the receive slot itself (as ib_send_lat answers from a
            // buffer it does not fill): no copy, no send slot.
            let echoed = match ctx.hold() {
                Some(held) => ctx.forward(conn, held, None).map_err(|(err, held)| {
                    ctx.release(held);
                    err
                }),
                None => ctx.send(conn, data, None),
            };
            if let Err(err) = echoed {
                self.failed = Some(err.to_string());
                ctx.stop();
            }
        }
    }

    fn on_write_imm(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, imm: u32, _len: u32) {
        self.write_back(ctx, conn, Some(imm));
    }

    fn on_error(&mut self, ctx: &mut Ctx<'_>, _conn: ConnId, error: &Error) {
        self.failed = Some(error.to_string());
        ctx.stop();
    }

    fn on_idle(&mut self, ctx: &mut Ctx<'_>) {
        // WRITE ping-pong: the client's WRITE changed the last byte of our
        // landing half; write that half straight back.
        if self.spec.op != PerfOp::Write {
            return;
        }
        let Some(conn) = self.conn else { return };
        let last = self.last_marker;
        if poll_byte(&self.buffers.buffer, self.spec.size - 1, |b| {
            b != 0 && b != last
        }) {
            self.last_marker = self
                .buffers
                .buffer
                .load_byte(self.spec.size - 1)
                .unwrap_or(last);
            self.write_back(ctx, conn, None);
        }
    }
}

/// Streams `iters` messages as fast as the reactor allows, at most `batch`
/// requests per doorbell, and times the whole run.
#[derive(Debug)]
pub struct RateSender {
    spec: PerfSpec,
    buffers: PerfBuffers,
    conn: Option<ConnId>,
    posted: u64,
    completed: u64,
    clock: Clock,
    started_at: u64,
    /// (completions so far, timestamp), every `mark_stride` completions.
    marks: Vec<(u64, u64)>,
    mark_stride: u64,
    failed: Option<String>,
    end: RunEnd,
}

/// Timestamps kept per run, at most (preallocated).
const MAX_MARKS: u64 = 1 << 16;
/// The peak is the best rate over any stretch of this fraction of the run.
/// Selective signaling retires completions in bursts that share a
/// timestamp; a stretch of a quarter of the run spans enough bursts that
/// their granularity cannot inflate the figure.
const PEAK_FRACTION: usize = 4;

impl RateSender {
    /// A sender for `spec`.
    pub fn new(spec: PerfSpec, buffers: PerfBuffers) -> Self {
        Self {
            spec,
            buffers,
            conn: None,
            posted: 0,
            completed: 0,
            clock: Clock::new(),
            started_at: 0,
            marks: Vec::with_capacity(spec.iters.min(MAX_MARKS) as usize + 2),
            mark_stride: spec.iters.div_ceil(MAX_MARKS).max(1),
            failed: None,
            end: RunEnd::default(),
        }
    }

    /// The error that ended the run early, if any.
    pub fn failure(&self) -> Option<&str> {
        self.failed.as_deref()
    }

    /// True when every message completed.
    pub fn is_done(&self) -> bool {
        self.end.begun()
    }

    /// Bandwidth figures, once done.
    pub fn stats(&self) -> BandwidthStats {
        let elapsed_ns = |from: u64, to: u64| self.clock.nanos(from, to).max(1) as f64;
        let (first, last) = (self.marks.first().copied(), self.marks.last().copied());
        let avg_secs = match (first, last) {
            (Some((_, start)), Some((_, end))) => elapsed_ns(start, end) / 1e9,
            _ => f64::INFINITY,
        };
        let bytes = self.spec.size as f64;
        let span = (self.marks.len() / PEAK_FRACTION).max(1);
        let peak = self
            .marks
            .windows(span + 1)
            .map(|w| {
                let (from, to) = (w[0], w[span]);
                (to.0 - from.0) as f64 * bytes / (elapsed_ns(from.1, to.1) / 1e9)
            })
            .fold(0.0, f64::max);
        let avg = self.spec.iters as f64 * bytes / avg_secs;
        BandwidthStats {
            bytes: self.spec.size,
            iters: self.spec.iters,
            peak_bytes_per_sec: peak.max(avg),
            avg_bytes_per_sec: avg,
            msg_rate_mpps: self.spec.iters as f64 / avg_secs / 1e6,
        }
    }

    fn pump(&mut self, ctx: &mut Ctx<'_>) {
        let Some(conn) = self.conn else { return };
        let size = self.spec.size;
        while self.posted < self.spec.iters && ctx.staged(conn) < self.spec.batch {
            let result = match self.spec.op {
                // The payload's content does not matter for a rate test.
                PerfOp::Send => ctx.send_with(conn, size, None, |_| {}),
                PerfOp::Write | PerfOp::WriteImm | PerfOp::Read => {
                    match (
                        self.buffers.buffer.slice(size, size),
                        self.buffers.peer.slice(0, size as u64),
                    ) {
                        (Ok(local), Ok(remote)) => match self.spec.op {
                            PerfOp::Read => ctx.read(conn, &local, remote),
                            PerfOp::WriteImm => ctx.write(conn, &local, remote, Some(0)),
                            _ => ctx.write(conn, &local, remote, None),
                        },
                        (Err(e), _) | (_, Err(e)) => Err(SendError::Invalid(e)),
                    }
                }
            };
            match result {
                Ok(_) => {
                    if self.posted == 0 {
                        self.started_at = self.clock.now();
                        self.marks.push((0, self.started_at));
                    }
                    self.posted += 1;
                }
                Err(SendError::WouldBlock) => break,
                Err(err) => {
                    self.failed = Some(err.to_string());
                    ctx.stop();
                    break;
                }
            }
        }
    }

    fn completed_one(&mut self, ctx: &mut Ctx<'_>) {
        self.completed += 1;
        if self.completed.is_multiple_of(self.mark_stride) || self.completed == self.spec.iters {
            self.marks.push((self.completed, self.clock.now()));
        }
        if self.completed == self.spec.iters {
            self.end.begin(ctx, self.conn);
        } else {
            self.pump(ctx);
        }
    }
}

impl Handler for RateSender {
    fn on_established(&mut self, ctx: &mut Ctx<'_>, conn: ConnId) {
        self.conn = Some(conn);
        self.pump(ctx);
    }

    fn on_message(&mut self, _ctx: &mut Ctx<'_>, _conn: ConnId, _data: &[u8], _imm: Option<u32>) {}

    fn on_send_complete(&mut self, ctx: &mut Ctx<'_>, _conn: ConnId, seq: u32) {
        if self.end.begun() {
            self.end.completed(ctx, seq);
        } else if self.spec.op == PerfOp::Send {
            self.completed_one(ctx);
        }
    }

    fn on_write_complete(&mut self, ctx: &mut Ctx<'_>, _conn: ConnId, _seq: u32) {
        if !self.end.begun() {
            self.completed_one(ctx);
        }
    }

    fn on_read_complete(&mut self, ctx: &mut Ctx<'_>, _conn: ConnId, _seq: u32) {
        if !self.end.begun() {
            self.completed_one(ctx);
        }
    }

    fn on_error(&mut self, ctx: &mut Ctx<'_>, _conn: ConnId, error: &Error) {
        self.failed = Some(error.to_string());
        ctx.stop();
    }

    fn on_idle(&mut self, ctx: &mut Ctx<'_>) {
        if self.end.begun() {
            self.end.retry(ctx, self.conn);
        } else {
            self.pump(ctx);
        }
    }
}

/// The server side of a bandwidth run: absorbs SENDs (and WRITE_WITH_IMM
/// notifications) and stops on the done marker.
#[derive(Debug, Default)]
pub struct RateSink {
    received: u64,
    failed: Option<String>,
}

impl RateSink {
    /// Messages received so far.
    pub fn received(&self) -> u64 {
        self.received
    }

    /// The error that ended the run early, if any.
    pub fn failure(&self) -> Option<&str> {
        self.failed.as_deref()
    }
}

impl Handler for RateSink {
    fn on_message(&mut self, ctx: &mut Ctx<'_>, _conn: ConnId, _data: &[u8], imm: Option<u32>) {
        if imm == Some(DONE_MARKER) {
            ctx.stop();
        } else {
            self.received += 1;
        }
    }

    fn on_write_imm(&mut self, _ctx: &mut Ctx<'_>, _conn: ConnId, _imm: u32, _len: u32) {
        self.received += 1;
    }

    fn on_error(&mut self, ctx: &mut Ctx<'_>, _conn: ConnId, error: &Error) {
        self.failed = Some(error.to_string());
        ctx.stop();
    }
}

/// Any of the measurement roles, so one reactor type serves them all.
#[allow(missing_docs, clippy::large_enum_variant)]
pub enum PerfHandler {
    Latency(LatencyClient),
    Reflect(Reflector),
    Rate(RateSender),
    Sink(RateSink),
}

impl fmt::Debug for PerfHandler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PerfHandler::Latency(_) => "PerfHandler::Latency",
            PerfHandler::Reflect(_) => "PerfHandler::Reflect",
            PerfHandler::Rate(_) => "PerfHandler::Rate",
            PerfHandler::Sink(_) => "PerfHandler::Sink",
        })
    }
}

/// Calls the same method on whichever role is inside, statically: a dyn call
/// per callback would add an indirect branch to every reactor pass.
macro_rules! each_role {
    ($self:ident, $h:ident => $call:expr) => {
        match $self {
            PerfHandler::Latency($h) => $call,
            PerfHandler::Reflect($h) => $call,
            PerfHandler::Rate($h) => $call,
            PerfHandler::Sink($h) => $call,
        }
    };
}

impl PerfHandler {
    /// The error that ended the run early, if any.
    pub fn failure(&self) -> Option<&str> {
        each_role!(self, h => h.failure())
    }
}

impl Handler for PerfHandler {
    fn on_established(&mut self, ctx: &mut Ctx<'_>, conn: ConnId) {
        each_role!(self, h => h.on_established(ctx, conn))
    }
    fn on_message(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, data: &[u8], imm: Option<u32>) {
        each_role!(self, h => h.on_message(ctx, conn, data, imm))
    }
    fn on_write_imm(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, imm: u32, len: u32) {
        each_role!(self, h => h.on_write_imm(ctx, conn, imm, len))
    }
    fn on_send_complete(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, seq: u32) {
        each_role!(self, h => h.on_send_complete(ctx, conn, seq))
    }
    fn on_write_complete(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, seq: u32) {
        each_role!(self, h => h.on_write_complete(ctx, conn, seq))
    }
    fn on_read_complete(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, seq: u32) {
        each_role!(self, h => h.on_read_complete(ctx, conn, seq))
    }
    fn on_error(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, error: &Error) {
        each_role!(self, h => h.on_error(ctx, conn, error))
    }
    fn on_idle(&mut self, ctx: &mut Ctx<'_>) {
        each_role!(self, h => h.on_idle(ctx))
    }
}

/// perftest's latency columns for one message size.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LatencyStats {
    /// Message size.
    pub bytes: usize,
    /// Samples.
    pub iters: usize,
    /// Fastest, µs.
    pub min_us: f64,
    /// Slowest, µs.
    pub max_us: f64,
    /// Median, µs (perftest's t_typical).
    pub typical_us: f64,
    /// Mean, µs.
    pub avg_us: f64,
    /// Standard deviation, µs.
    pub stdev_us: f64,
    /// 99th percentile, µs.
    pub p99_us: f64,
    /// 99.9th percentile, µs.
    pub p999_us: f64,
}

/// The column header perftest prints for latency tests.
pub const LATENCY_HEADER: &str = " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] ";

impl LatencyStats {
    /// Computes the columns from per-iteration latencies in nanoseconds.
    pub fn from_ns(bytes: usize, samples_ns: &[u64]) -> Option<Self> {
        if samples_ns.is_empty() {
            return None;
        }
        let mut us: Vec<f64> = samples_ns.iter().map(|&ns| ns as f64 / 1000.0).collect();
        us.sort_by(f64::total_cmp);
        let n = us.len();
        let avg = us.iter().sum::<f64>() / n as f64;
        let var = us.iter().map(|v| (v - avg).powi(2)).sum::<f64>() / n as f64;
        let pct = |p: f64| us[(((n as f64) * p).ceil() as usize).clamp(1, n) - 1];
        Some(Self {
            bytes,
            iters: n,
            min_us: us[0],
            max_us: us[n - 1],
            typical_us: us[n / 2],
            avg_us: avg,
            stdev_us: var.sqrt(),
            p99_us: pct(0.99),
            p999_us: pct(0.999),
        })
    }

    /// One row in perftest's layout.
    pub fn row(&self) -> String {
        format!(
            " {:<7} {:<10}    {:<7.2}        {:<7.2}      {:<7.2}          {:<7.2}        {:<7.2}          {:<7.2}                {:<7.2}",
            self.bytes,
            self.iters,
            self.min_us,
            self.max_us,
            self.typical_us,
            self.avg_us,
            self.stdev_us,
            self.p99_us,
            self.p999_us
        )
    }
}

/// perftest's bandwidth columns for one message size.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BandwidthStats {
    /// Message size.
    pub bytes: usize,
    /// Messages.
    pub iters: u64,
    /// Best window, bytes per second.
    pub peak_bytes_per_sec: f64,
    /// Whole run, bytes per second.
    pub avg_bytes_per_sec: f64,
    /// Messages per second, in millions.
    pub msg_rate_mpps: f64,
}

/// The column header for bandwidth tests, in MiB/s or Gb/s.
pub fn bandwidth_header(gbits: bool) -> String {
    let unit = if gbits { "Gb/sec" } else { "MiB/sec" };
    format!(" #bytes     #iterations    BW peak[{unit}]    BW average[{unit}]   MsgRate[Mpps]")
}

impl BandwidthStats {
    /// One row in perftest's layout (MiB/s, or Gb/s with `gbits`).
    pub fn row(&self, gbits: bool) -> String {
        let scale = |bps: f64| {
            if gbits {
                bps * 8.0 / 1e9
            } else {
                bps / (1024.0 * 1024.0)
            }
        };
        format!(
            " {:<10} {:<10}       {:<7.2}            {:<7.2}               {:<7.6}",
            self.bytes,
            self.iters,
            scale(self.peak_bytes_per_sec),
            scale(self.avg_bytes_per_sec),
            self.msg_rate_mpps
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_columns_follow_perftest() {
        let samples: Vec<u64> = (1..=1000).map(|i| i * 1000).collect();
        let stats = LatencyStats::from_ns(8, &samples).unwrap();
        assert_eq!((stats.min_us, stats.max_us), (1.0, 1000.0));
        assert_eq!(stats.typical_us, 501.0);
        assert_eq!((stats.p99_us, stats.p999_us), (990.0, 999.0));
        assert!((stats.avg_us - 500.5).abs() < 1e-9);
        assert!(stats.row().starts_with(" 8       1000"));
        assert!(LatencyStats::from_ns(8, &[]).is_none());
    }

    #[test]
    fn bandwidth_rows_scale_units() {
        let stats = BandwidthStats {
            bytes: 65536,
            iters: 10,
            peak_bytes_per_sec: 1024.0 * 1024.0 * 2.0,
            avg_bytes_per_sec: 1024.0 * 1024.0,
            msg_rate_mpps: 0.5,
        };
        assert!(stats.row(false).contains("2.00") && stats.row(false).contains("1.00"));
        assert!(bandwidth_header(true).contains("Gb/sec"));
    }
}
