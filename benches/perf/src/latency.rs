//! Latency roles: the client that times ping-pongs (or READs) and the
//! reflector that answers them.

use rdma_comm_core::error::Error;
use rdma_comm_core::reactor::{ConnId, Ctx, Handler, Idle, SendError};
use rdma_comm_core::verbs::{MemoryRegion, RemoteSlice};

use crate::run_end::RunEnd;
use crate::{Clock, DONE_MARKER, LatencyStats, PerfBuffers, PerfOp, PerfSpec};

/// Measures round trips (or READs) and keeps one sample per iteration.
#[derive(Debug)]
pub struct LatencyClient {
    spec: PerfSpec,
    buffers: PerfBuffers,
    /// The peer's bytes every iteration targets, sliced once (`None` if
    /// they do not fit its buffer: `issue` then reports why).
    remote: Option<RemoteSlice>,
    conn: Option<ConnId>,
    seq: u64,
    started_at: u64,
    in_flight: bool,
    clock: Clock,
    /// Round-trip (or READ) times in clock ticks.
    samples: Vec<u64>,
    pub(crate) failed: Option<String>,
    end: RunEnd,
}

/// A sample's ticks as the latency it reports: a whole READ, or half a
/// SEND or WRITE round trip.
fn latency_ns(clock: &Clock, whole: bool, ticks: u64) -> u64 {
    let ns = clock.nanos(0, ticks);
    if whole { ns } else { ns / 2 }
}

/// Where the samples a client reports begin: after the warmup's (a
/// client keeps them all, so its loop asks nothing per iteration).
pub(crate) fn first_measured(spec: &PerfSpec, samples: &[u64]) -> usize {
    usize::try_from(spec.warmup).map_or(samples.len(), |warmup| warmup.min(samples.len()))
}

/// Room for every iteration's sample, the warmup's too.
pub(crate) fn sample_capacity(spec: &PerfSpec) -> usize {
    usize::try_from(spec.warmup.saturating_add(spec.iters)).unwrap_or(usize::MAX)
}

/// The latency columns of a client's samples (ticks of `clock`): whole
/// READs, half SEND and WRITE round trips.
pub(crate) fn latency_stats(
    spec: &PerfSpec,
    clock: &Clock,
    samples: &mut [u64],
) -> Option<LatencyStats> {
    let whole = spec.op == PerfOp::Read;
    let ns_per_tick = clock.ns_per_tick() / if whole { 1.0 } else { 2.0 };
    let first = first_measured(spec, samples);
    LatencyStats::from_ticks(spec.size, &mut samples[first..], ns_per_tick)
}

impl LatencyClient {
    /// A client for `spec` with preallocated sample storage.
    pub fn new(spec: PerfSpec, buffers: PerfBuffers) -> Self {
        let spec = spec.runnable();
        Self {
            spec,
            remote: buffers.peer.slice(0, spec.size as u64).ok(),
            buffers,
            conn: None,
            seq: 0,
            started_at: 0,
            in_flight: false,
            clock: Clock::new(),
            samples: Vec::with_capacity(sample_capacity(&spec)),
            failed: None,
            end: RunEnd::default(),
        }
    }

    /// Per-iteration latencies in nanoseconds (half round trips for SEND and
    /// WRITE, full READs) after the warmup, once finished.
    pub fn latencies_ns(&self) -> Vec<u64> {
        let whole = self.spec.op == PerfOp::Read;
        self.samples[first_measured(&self.spec, &self.samples)..]
            .iter()
            .map(|&ticks| latency_ns(&self.clock, whole, ticks))
            .collect()
    }

    /// The run's latency columns (its samples after the warmup), once
    /// finished; `None` without any.
    pub fn into_latency_stats(mut self) -> Option<LatencyStats> {
        latency_stats(&self.spec, &self.clock, &mut self.samples)
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
        self.started_at = now;
        match self.stage(ctx, conn) {
            Ok(_) => self.in_flight = true,
            Err(SendError::WouldBlock) => self.in_flight = false,
            Err(err) => {
                self.failed = Some(err.to_string());
                ctx.stop();
            }
        }
    }

    /// Stages the request of iteration `self.seq` on `conn`.
    #[inline]
    fn stage(&mut self, ctx: &mut Ctx<'_>, conn: ConnId) -> Result<u32, SendError> {
        let size = self.spec.size;
        let marker = Self::marker(self.seq);
        if self.spec.op == PerfOp::Send {
            return ctx.send_with(conn, size, None, |buf| {
                if let Some(last) = buf.last_mut() {
                    *last = marker;
                }
            });
        }
        let Some(remote) = self.remote else {
            return Err(SendError::Invalid(self.remote_misfit()));
        };
        let buffer = &mut self.buffers.buffer;
        if self.spec.op == PerfOp::Read {
            let local = buffer.slice(0, size).map_err(SendError::Invalid)?;
            return ctx.read_now(conn, &local, remote);
        }
        let imm = (self.spec.op == PerfOp::WriteImm).then_some(self.seq as u32);
        buffer
            .write(2 * size - 1, &[marker])
            .map_err(SendError::Invalid)?;
        let local = buffer.slice(size, size).map_err(SendError::Invalid)?;
        // Staged, not rung now: `write_now` signals every WRITE, and on
        // this ping-pong (one signaled in 16 otherwise) the completion it
        // adds costs more than the flush it saves (in the guest, about 170
        // Ir more per round trip). A READ is signaled anyway.
        ctx.write(conn, &local, remote, imm)
    }

    /// Why the peer's buffer has no room for a message of the spec's size.
    #[cold]
    fn remote_misfit(&self) -> Error {
        match self.buffers.peer.slice(0, self.spec.size as u64) {
            Err(err) => err,
            Ok(_) => Error::InvalidArgument("the peer's buffer was not sliced"),
        }
    }

    fn answered(&mut self, ctx: &mut Ctx<'_>) {
        // Raw ticks now; the report converts only the columns it prints,
        // after the run: no float work inside the measured loop.
        // One reading ends this round trip and starts the next, as perftest
        // times from post to post.
        let now = self.clock.now();
        let elapsed = now.saturating_sub(self.started_at);
        self.in_flight = false;
        self.samples.push(elapsed);
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

    fn on_idle(&mut self, ctx: &mut Ctx<'_>) -> Idle {
        self.when_idle(ctx);
        Idle::Again
    }
}

impl LatencyClient {
    /// What a pass that finds nothing does for this role.
    fn when_idle(&mut self, ctx: &mut Ctx<'_>) {
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
///
/// A tight loop of loads, as perftest's, with no `spin_loop` hint: a PAUSE
/// delays noticing the byte by its own latency (about 140 cycles on recent
/// x86 cores), and under QEMU's TCG each one leaves the translated code for
/// the CPU loop.
#[inline]
pub(crate) fn poll_byte(region: &MemoryRegion, offset: usize, done: impl Fn(u8) -> bool) -> bool {
    (0..256).any(|_| region.load_byte(offset).is_some_and(&done))
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
    /// The client's done marker arrived.
    told_done: bool,
    pub(crate) failed: Option<String>,
}

impl Reflector {
    /// A reflector for `spec`.
    pub fn new(spec: PerfSpec, buffers: PerfBuffers) -> Self {
        Self {
            spec,
            buffers,
            conn: None,
            last_marker: 0,
            told_done: false,
            failed: None,
        }
    }

    /// The error that ended the run early, if any.
    pub fn failure(&self) -> Option<&str> {
        self.failed.as_deref()
    }

    /// True once the client said its run is over.
    pub fn is_done(&self) -> bool {
        self.told_done
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
            self.told_done = true;
            ctx.stop();
        } else if self.spec.op == PerfOp::Send {
            // Echo the receive slot itself (as ib_send_lat answers from a
            // buffer it does not fill): no copy, no send slot.
            let echoed = match ctx.hold() {
                Some(held) => ctx.forward(conn, held, None).map_err(|(err, held)| {
                    // The message is this reactor's own: releasing it cannot fail.
                    let _ = ctx.release(held);
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

    fn on_idle(&mut self, ctx: &mut Ctx<'_>) -> Idle {
        self.when_idle(ctx);
        Idle::Again
    }
}

impl Reflector {
    /// What a pass that finds nothing does for this role.
    fn when_idle(&mut self, ctx: &mut Ctx<'_>) {
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
