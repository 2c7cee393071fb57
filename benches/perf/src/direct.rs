//! The roles on direct connections ([`Reactor::add_direct`]): perftest's
//! loop inside a reactor. Each side builds its requests once
//! (kept with their memory: [`Kept`]) when its connection is
//! handed over, posts them on the QP itself through [`Ctx::direct`] (one
//! doorbell per post, or per batch), and counts its completions, as
//! perftest does: the reactor polls and routes, and stages, credits and
//! reposts nothing. Both sides must run direct.
//!
//! A completion's id (the low half of its `wr_id`) says what it was: a
//! receive, the done marker, or send-queue requests, in which case the id
//! is how many requests it retires (selective signaling: one in
//! [`SIGNAL_EVERY`] at latency, the last of each batch at bandwidth).
//!
//! [`Reactor::add_direct`]: rdma_comm_core::reactor::Reactor::add_direct

use rdma_comm_core::error::Error;
use rdma_comm_core::reactor::{ConnId, Ctx, DirectQp, Handler, Idle, SendError, Spin, Spun};
use rdma_comm_core::verbs::{
    Kept, RecvRequest, SendBatch, SendFlags, WcOpcode, WorkCompletion, WorkRequest,
};

use crate::latency::{latency_stats, poll_byte, sample_capacity};
use crate::rate::RateMarks;
use crate::{BandwidthStats, Clock, DONE_MARKER, LatencyStats, PerfBuffers, PerfOp, PerfSpec};

/// Latency requests signaled: one in this many (the others retire with it).
pub const SIGNAL_EVERY: u32 = 16;
/// Most receives a side keeps posted (fewer if the QP holds fewer).
const RECEIVES: u32 = 512;
/// Most requests per doorbell at bandwidth.
pub const MAX_BATCH: usize = 64;
/// The id of every receive.
const RECV_ID: u32 = u32::MAX;
/// The id of the done marker.
const DONE_ID: u32 = u32::MAX - 1;

/// The requests one side posts, built once.
#[derive(Debug)]
struct Requests {
    /// The test's request (latency, and the reflector's answer).
    op: Kept<WorkRequest<'static>>,
    /// The test's request `batch` times, the last signaled (bandwidth).
    batch: Kept<SendBatch<'static, MAX_BATCH>>,
    /// A receive into the first half of the buffer.
    landing: Kept<RecvRequest<'static>>,
    /// The zero-byte SEND that ends a run, with [`DONE_MARKER`].
    done: Kept<WorkRequest<'static>>,
    /// `INLINE` when the payload fits the QP's inline data.
    inline: SendFlags,
    /// Every post of `op` is signaled (a READ, whose completion is its
    /// answer).
    always_signaled: bool,
}

impl Requests {
    /// The requests for `spec` on `qp`: a SEND or WRITE of our second half
    /// (inline when it fits) into the peer's first half, or a READ of the
    /// peer's first half into ours; `answer` makes the reflector's (a
    /// WRITE back from the first half, where the client's marker landed).
    fn new(
        spec: &PerfSpec,
        buffers: &PerfBuffers,
        qp: &DirectQp<'_>,
        answer: bool,
    ) -> Result<Self, Error> {
        let size = spec.size;
        let memory = buffers.buffer.registration();
        let remote = buffers.peer.slice(0, size as u64)?;
        let (first, second) = (memory.slice(0, size)?, memory.slice(size, size)?);
        let source = if answer { first } else { second };
        let inline = if size <= qp.max_inline_data() as usize && spec.op != PerfOp::Read {
            SendFlags::INLINE
        } else {
            SendFlags::empty()
        };
        let op = match spec.op {
            PerfOp::Send => WorkRequest::send(u64::from(SIGNAL_EVERY), source),
            PerfOp::Write => WorkRequest::write(u64::from(SIGNAL_EVERY), source, remote)?,
            PerfOp::Read => WorkRequest::read(1, first, remote)?.signaled(),
            PerfOp::WriteImm => {
                return Err(Error::InvalidArgument(
                    "direct connections measure send, write and read",
                ));
            }
        }
        .with_flags(inline);
        let mut batch = SendBatch::<MAX_BATCH>::new();
        let batch_len = spec.batch.clamp(1, MAX_BATCH);
        for k in 0..batch_len {
            let mut request = op;
            let last = k + 1 == batch_len;
            request.set_wr_id(if last { batch_len as u64 } else { 0 });
            request.set_flags(if last {
                SendFlags::SIGNALED | inline
            } else {
                inline
            });
            // Cannot fail: at most MAX_BATCH requests.
            let _ = batch.push(request);
        }
        let done = WorkRequest::send_with_imm(u64::from(DONE_ID), memory.slice(0, 0)?, DONE_MARKER)
            .signaled();
        Ok(Self {
            op: Kept::new(op, &[memory])?,
            batch: Kept::new(batch, &[memory])?,
            landing: Kept::new(RecvRequest::new(u64::from(RECV_ID), first)?, &[memory])?,
            done: Kept::new(done, &[memory])?,
            inline,
            always_signaled: spec.op == PerfOp::Read,
        })
    }

    /// Posts as many receives as the QP holds, up to [`RECEIVES`].
    fn post_receives(&mut self, qp: &mut DirectQp<'_>) -> Result<(), Error> {
        for _ in 0..RECEIVES.min(qp.max_recv_wr()) {
            qp.post_recv(&mut self.landing)?;
        }
        Ok(())
    }

    /// Posts the test's request, signaled if it is the `SIGNAL_EVERY`th
    /// since the last signaled one (`unsignaled` counts them).
    #[inline]
    fn post_op(&mut self, qp: &mut DirectQp<'_>, unsignaled: &mut u32) -> Result<(), Error> {
        if !self.always_signaled {
            *unsignaled += 1;
            let flags = if *unsignaled == SIGNAL_EVERY {
                *unsignaled = 0;
                self.inline | SendFlags::SIGNALED
            } else {
                self.inline
            };
            self.op.set_flags(flags);
        }
        qp.post_send(&mut self.op)
    }
}

/// Builds a side's requests on `conn` once it is handed over, posting
/// receives first if `receives`; also returns the QP's send-queue depth.
fn start(
    ctx: &mut Ctx<'_>,
    conn: ConnId,
    spec: &PerfSpec,
    buffers: &PerfBuffers,
    answer: bool,
    receives: bool,
) -> Result<(Requests, u32), String> {
    let mut qp = ctx.direct(conn).map_err(|e| e.to_string())?;
    let mut requests = Requests::new(spec, buffers, &qp, answer).map_err(|e| e.to_string())?;
    if receives {
        requests.post_receives(&mut qp).map_err(|e| e.to_string())?;
    }
    Ok((requests, qp.max_send_wr()))
}

/// Where a side posts: its connection's QP through the callback's
/// [`Ctx`], or through the [`Spin`] it runs in (whose connection it is).
/// The roles' steps are generic over it, so each caller's code is
/// compiled for it alone.
trait Poster {
    /// The QP of `conn` to post on (an error once it is gone).
    fn qp(&mut self, conn: ConnId) -> Result<DirectQp<'_>, String>;
    /// Asks the reactor to stop.
    fn stop(&mut self);
}

impl Poster for Ctx<'_> {
    #[inline(always)]
    fn qp(&mut self, conn: ConnId) -> Result<DirectQp<'_>, String> {
        self.direct(conn).map_err(|e| e.to_string())
    }
    fn stop(&mut self) {
        Ctx::stop(self);
    }
}

impl Poster for Spin<'_> {
    #[inline(always)]
    fn qp(&mut self, _: ConnId) -> Result<DirectQp<'_>, String> {
        Ok(Spin::qp(self))
    }
    fn stop(&mut self) {
        Spin::stop(self);
    }
}

/// Runs `run` on the spin `ctx` lends for `conn`; returns a refusal the
/// run must fail with, if any. (A failed connection the reactor reports
/// itself, to `on_error`; completions that wait for the reactor leave the
/// spin to the next idle pass.)
fn spin_on(ctx: &mut Ctx<'_>, conn: ConnId, run: impl FnOnce(&mut Spin<'_>)) -> Option<String> {
    match ctx.spin(conn) {
        Ok(mut spin) => {
            run(&mut spin);
            None
        }
        Err(SendError::Closed | SendError::WouldBlock) => None,
        Err(err) => Some(err.to_string()),
    }
}

/// What a side's run is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// Waiting for its connection.
    Waiting,
    Running,
    /// The done marker is out.
    Ending,
    Over,
}

/// The client on a direct connection: latency (ping-pongs or READs, one
/// sample each) or bandwidth (`iters` messages, `batch` per doorbell, at
/// most `tx_depth` outstanding).
#[derive(Debug)]
pub struct DirectClient {
    spec: PerfSpec,
    buffers: PerfBuffers,
    bandwidth: bool,
    conn: Option<ConnId>,
    requests: Option<Requests>,
    stage: Stage,
    /// Latency: iterations begun, the start of the one in flight, and
    /// whether it is.
    seq: u64,
    started_at: u64,
    in_flight: bool,
    unsignaled: u32,
    clock: Clock,
    samples: Vec<u64>,
    /// Bandwidth: requests posted, retired, and the marks of the run.
    posted: u64,
    retired: u64,
    marks: RateMarks,
    /// Send-queue entries the run may use.
    depth: u64,
    /// Latency: the run's loop spins on the reactor's CQs from `on_idle`
    /// (`Ctx::spin`); a request answered between spins waits for the next
    /// one, due from this time.
    spin: bool,
    due: Option<u64>,
    /// Spinning WRITE ping-pong: a signaled WRITE whose completion no
    /// poll has taken yet.
    unreaped: bool,
    pub(crate) failed: Option<String>,
}

impl DirectClient {
    /// A latency client for `spec`.
    pub fn latency(spec: PerfSpec, buffers: PerfBuffers) -> Self {
        Self::new(spec, buffers, false)
    }

    /// A bandwidth client for `spec`.
    pub fn bandwidth(spec: PerfSpec, buffers: PerfBuffers) -> Self {
        Self::new(spec, buffers, true)
    }

    fn new(spec: PerfSpec, buffers: PerfBuffers, bandwidth: bool) -> Self {
        let spec = spec.runnable();
        let samples = if bandwidth { 0 } else { sample_capacity(&spec) };
        let clock = Clock::new();
        Self {
            spec,
            buffers,
            bandwidth,
            conn: None,
            requests: None,
            stage: Stage::Waiting,
            seq: 0,
            started_at: 0,
            in_flight: false,
            unsignaled: 0,
            clock: clock.clone(),
            samples: Vec::with_capacity(samples),
            posted: 0,
            retired: 0,
            marks: RateMarks::new(if bandwidth { spec.iters } else { 0 }, 1, clock),
            depth: 0,
            spin: false,
            due: None,
            unreaped: false,
            failed: None,
        }
    }

    /// The same, with a latency run's loop spinning on the reactor's CQs
    /// (`Ctx::spin`): perftest's loop inside the reactor's ownership.
    pub fn spinning(mut self) -> Self {
        self.spin = !self.bandwidth;
        self
    }

    /// True for a bandwidth client.
    pub fn is_bandwidth(&self) -> bool {
        self.bandwidth
    }

    /// The error that ended the run early, if any.
    pub fn failure(&self) -> Option<&str> {
        self.failed.as_deref()
    }

    /// True once every iteration (or message) was done.
    pub fn is_done(&self) -> bool {
        matches!(self.stage, Stage::Ending | Stage::Over)
    }

    /// The latency columns (whole READs, half SEND and WRITE round trips,
    /// after the warmup), once done; `None` without any.
    pub fn into_latency_stats(mut self) -> Option<LatencyStats> {
        latency_stats(&self.spec, &self.clock, &mut self.samples)
    }

    /// Bandwidth figures, once done.
    pub fn stats(&self) -> BandwidthStats {
        self.marks.stats(self.spec.size)
    }

    #[cold]
    fn fail(&mut self, ctx: &mut impl Poster, why: String) {
        self.failed.get_or_insert(why);
        self.stage = Stage::Over;
        ctx.stop();
    }

    /// Posts iteration `self.seq`, timed from `now`.
    #[inline(always)]
    fn issue(&mut self, ctx: &mut impl Poster, now: u64) {
        self.started_at = now;
        if self.spec.op == PerfOp::Write
            && let Err(err) = self.write_marker()
        {
            return self.fail(ctx, err.to_string());
        }
        let (Some(conn), Some(requests)) = (self.conn, self.requests.as_mut()) else {
            return;
        };
        let posted = match ctx.qp(conn) {
            Ok(mut qp) => requests.post_op(&mut qp, &mut self.unsignaled),
            Err(why) => return self.fail(ctx, why),
        };
        match posted {
            Ok(()) => self.in_flight = true,
            Err(err) => self.fail_with(ctx, err),
        }
    }

    /// A WRITE ping-pong's marker for iteration `self.seq`, in the last
    /// byte of the half the WRITE sends.
    #[inline]
    fn write_marker(&mut self) -> Result<(), Error> {
        let marker = marker(self.seq);
        self.buffers.buffer.write(2 * self.spec.size - 1, &[marker])
    }

    #[cold]
    #[inline(never)]
    fn fail_with(&mut self, ctx: &mut impl Poster, err: Error) {
        self.fail(ctx, err.to_string());
    }

    /// The answer of the iteration in flight came.
    #[inline]
    fn answered(&mut self, ctx: &mut impl Poster) {
        // One reading ends this round trip and starts the next, as
        // perftest times from post to post.
        let now = self.clock.now();
        self.in_flight = false;
        self.samples.push(now.saturating_sub(self.started_at));
        self.seq += 1;
        if self.seq == self.spec.warmup + self.spec.iters {
            self.end(ctx);
        } else if self.spin {
            // Spinning, every request goes out from the spin: the next
            // idle pass lends one.
            self.due = Some(now);
        } else {
            self.issue(ctx, now);
        }
    }

    /// A latency run's completion `id` (of `opcode`): a receive (a SEND's
    /// answer, whose receive goes back first), a READ, the done marker,
    /// or signaled SENDs and WRITEs retiring the unsignaled ones before.
    #[inline]
    fn latency_completion(&mut self, ctx: &mut impl Poster, id: u32, opcode: WcOpcode) {
        match id {
            RECV_ID => {
                if let (Some(conn), Some(requests)) = (self.conn, self.requests.as_mut())
                    && let Ok(mut qp) = ctx.qp(conn)
                    && let Err(err) = qp.post_recv(&mut requests.landing)
                {
                    return self.fail(ctx, err.to_string());
                }
                if self.in_flight {
                    self.answered(ctx);
                }
            }
            DONE_ID => {
                self.stage = Stage::Over;
                ctx.stop();
            }
            _ if opcode == WcOpcode::RDMA_READ && self.in_flight => self.answered(ctx),
            _ => {}
        }
    }

    /// A WRITE ping-pong's answer shows in memory, not in the CQ.
    #[inline]
    fn write_answered(&self) -> bool {
        self.in_flight
            && self.spec.op == PerfOp::Write
            && poll_byte(&self.buffers.buffer, self.spec.size - 1, |b| {
                b == marker(self.seq)
            })
    }

    /// The latency run's loop on the CQs `spin` lends, until the run is
    /// over or the spin ends: perftest's loop, its state in locals for the
    /// spin's length (each iteration posts, waits for its answer and
    /// stamps it; a WRITE ping-pong polls the CQ only to reap the one
    /// WRITE in SIGNAL_EVERY it signals, or when the answer is slow, where
    /// perftest signals and reaps every WRITE).
    fn spin_run(&mut self, spin: &mut Spin<'_>) {
        let total = self.spec.warmup + self.spec.iters;
        let (op, size) = (self.spec.op, self.spec.size);
        let Some(requests) = self.requests.as_mut() else {
            return;
        };
        let (clock, samples, buffer) = (&self.clock, &mut self.samples, &mut self.buffers.buffer);
        let mut seq = self.seq;
        let mut started_at = self.started_at;
        let mut in_flight = self.in_flight;
        let mut unsignaled = self.unsignaled;
        let mut unreaped = self.unreaped;
        // A request the reactor's dispatch answered waits for this spin,
        // timed from that answer.
        let mut now = match self.due.take() {
            Some(due) => due,
            None => clock.now(),
        };
        let mut failed = None;
        'run: while seq < total {
            if !in_flight {
                started_at = now;
                let posted = if op == PerfOp::Write {
                    // `post_op` signals the SIGNAL_EVERYth request: this
                    // one's completion is to be reaped.
                    unreaped |= unsignaled == SIGNAL_EVERY - 1;
                    buffer.write(2 * size - 1, &[marker(seq)])
                } else {
                    Ok(())
                }
                .and_then(|()| requests.post_op(&mut spin.qp(), &mut unsignaled));
                if let Err(err) = posted {
                    failed = Some(err);
                    break;
                }
                in_flight = true;
            }
            if op == PerfOp::Write {
                let want = marker(seq);
                while !poll_byte(buffer, size - 1, |b| b == want) {
                    // Slow: the CQ, for a failure or the spin's end.
                    match spin.poll() {
                        Spun::Completion(SIGNAL_EVERY, _) => unreaped = false,
                        Spun::Ended => {
                            // An answer in by now is stamped now, not
                            // after the reactor's pass.
                            if poll_byte(buffer, size - 1, |b| b == want) {
                                now = stamp(clock, samples, started_at);
                                in_flight = false;
                                seq += 1;
                            }
                            break 'run;
                        }
                        Spun::Completion(..) | Spun::Empty => {}
                    }
                }
                // A signaled WRITE the byte wait's polls did not take:
                // one poll an iteration until one is taken, never a wait
                // (a completion taken once is not polled again).
                if unreaped {
                    match spin.poll() {
                        Spun::Completion(SIGNAL_EVERY, _) => unreaped = false,
                        Spun::Ended => {
                            // The answer is in: its sample stands.
                            now = stamp(clock, samples, started_at);
                            in_flight = false;
                            seq += 1;
                            break 'run;
                        }
                        Spun::Completion(..) | Spun::Empty => {}
                    }
                }
            } else {
                loop {
                    match spin.poll() {
                        Spun::Completion(RECV_ID, _) => {
                            if let Err(err) = spin.qp().post_recv(&mut requests.landing) {
                                failed = Some(err);
                                break 'run;
                            }
                            if op == PerfOp::Send {
                                break;
                            }
                        }
                        Spun::Completion(_, wc) if wc.opcode() == WcOpcode::RDMA_READ => break,
                        // Signaled SENDs retiring the unsignaled before.
                        Spun::Completion(..) | Spun::Empty => {}
                        Spun::Ended => break 'run,
                    }
                }
            }
            now = stamp(clock, samples, started_at);
            in_flight = false;
            seq += 1;
        }
        self.seq = seq;
        self.started_at = started_at;
        self.in_flight = in_flight;
        self.unsignaled = unsignaled;
        self.unreaped = unreaped;
        if let Some(err) = failed {
            return self.fail_with(spin, err);
        }
        if in_flight {
            return;
        }
        if seq == total {
            self.end(spin);
        } else {
            self.due = Some(now);
        }
    }

    /// A spinning run's idle pass: a spin, while the run is on.
    fn spin_idle(&mut self, ctx: &mut Ctx<'_>) {
        let Some(conn) = self.conn else { return };
        if self.stage != Stage::Running {
            return;
        }
        if let Some(refused) = spin_on(ctx, conn, |spin| self.spin_run(spin)) {
            self.fail(ctx, refused);
        }
    }

    /// Posts batches while the run has messages left and the send queue
    /// room for a whole batch.
    fn pump(&mut self, ctx: &mut Ctx<'_>, conn: ConnId) {
        let Some(requests) = self.requests.as_mut() else {
            return;
        };
        let mut qp = match ctx.direct(conn) {
            Ok(qp) => qp,
            Err(err) => return self.fail(ctx, err.to_string()),
        };
        let batch_len = requests.batch.len() as u64;
        let mut failed = None;
        while self.posted < self.spec.iters && self.posted - self.retired + batch_len <= self.depth
        {
            let left = self.spec.iters - self.posted;
            if left < batch_len {
                // The run's tail, less than a batch: one request at a
                // time, the last signaled to retire them all.
                requests.op.set_wr_id(left);
                for k in 0..left {
                    let signal = if k + 1 == left {
                        SendFlags::SIGNALED
                    } else {
                        SendFlags::empty()
                    };
                    requests.op.set_flags(requests.inline | signal);
                    if let Err(err) = qp.post_send(&mut requests.op) {
                        failed = Some(err);
                        break;
                    }
                }
                self.posted += left;
                break;
            }
            if let Err(err) = qp.post_send(&mut requests.batch) {
                failed = Some(err);
                break;
            }
            if self.posted == 0 {
                self.marks.start();
            }
            self.posted += batch_len;
        }
        if let Some(err) = failed {
            self.fail(ctx, err.to_string());
        }
    }

    /// A bandwidth run's signaled request retired `count` requests.
    fn retired(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, count: u32) {
        self.retired += u64::from(count);
        self.marks.completed(self.retired);
        if self.retired == self.spec.iters {
            self.end(ctx);
        } else {
            self.pump(ctx, conn);
        }
    }

    /// Posts the done marker.
    fn end(&mut self, ctx: &mut impl Poster) {
        self.stage = Stage::Ending;
        let (Some(conn), Some(requests)) = (self.conn, self.requests.as_mut()) else {
            return;
        };
        let posted = match ctx.qp(conn) {
            Ok(mut qp) => qp.post_send(&mut requests.done).map_err(|e| e.to_string()),
            Err(why) => Err(why),
        };
        if let Err(why) = posted {
            self.fail(ctx, why);
        }
    }
}

/// The answer of an iteration started at `started_at` is in: its sample,
/// and the reading (which starts the next iteration).
#[inline(always)]
fn stamp(clock: &Clock, samples: &mut Vec<u64>, started_at: u64) -> u64 {
    let now = clock.now();
    samples.push(now.saturating_sub(started_at));
    now
}

/// Iteration `seq`'s marker: never 0, so a fresh buffer differs.
fn marker(seq: u64) -> u8 {
    (seq % 255) as u8 + 1
}

impl Handler for DirectClient {
    fn on_established(&mut self, ctx: &mut Ctx<'_>, conn: ConnId) {
        self.conn = Some(conn);
        let receives = self.spec.op == PerfOp::Send && !self.bandwidth;
        match start(ctx, conn, &self.spec, &self.buffers, false, receives) {
            Ok((requests, sq_depth)) => {
                self.requests = Some(requests);
                self.depth = match self.spec.tx_depth {
                    0 => u64::from(sq_depth),
                    depth => depth.min(u64::from(sq_depth)),
                };
            }
            Err(why) => return self.fail(ctx, why),
        }
        self.stage = Stage::Running;
        if self.bandwidth {
            self.pump(ctx, conn);
        } else {
            self.issue(ctx, self.clock.now());
        }
    }

    fn on_message(&mut self, _: &mut Ctx<'_>, _: ConnId, _: &[u8], _: Option<u32>) {}

    #[inline]
    fn on_direct_completion(
        &mut self,
        ctx: &mut Ctx<'_>,
        conn: ConnId,
        id: u32,
        wc: &WorkCompletion,
    ) {
        match id {
            RECV_ID | DONE_ID => self.latency_completion(ctx, id, wc.opcode()),
            retired if self.bandwidth => self.retired(ctx, conn, retired),
            _ if wc.opcode() == WcOpcode::RDMA_READ && self.in_flight => self.answered(ctx),
            // Signaled SENDs and WRITEs retire the unsignaled ones before them.
            _ => self.unreaped = false,
        }
    }

    fn on_error(&mut self, ctx: &mut Ctx<'_>, _: ConnId, error: &Error) {
        self.fail(ctx, error.to_string());
    }

    #[inline]
    fn on_idle(&mut self, ctx: &mut Ctx<'_>) -> Idle {
        self.when_idle(ctx);
        Idle::Again
    }
}

impl DirectClient {
    /// What a pass that finds nothing does for this role.
    #[inline]
    fn when_idle(&mut self, ctx: &mut Ctx<'_>) {
        if self.spin {
            return self.spin_idle(ctx);
        }
        if !self.bandwidth && self.write_answered() {
            self.answered(ctx);
        }
    }
}

/// The server on a direct connection: answers a latency client (SEND by
/// SEND, WRITE by WRITE once it sees the new marker), absorbs a bandwidth
/// client's SENDs, and stops on the done marker.
#[derive(Debug)]
pub struct DirectServer {
    spec: PerfSpec,
    buffers: PerfBuffers,
    bandwidth: bool,
    conn: Option<ConnId>,
    requests: Option<Requests>,
    last_marker: u8,
    unsignaled: u32,
    told_done: bool,
    /// Latency: answers from a loop spinning on the reactor's CQs.
    spin: bool,
    pub(crate) failed: Option<String>,
}

impl DirectServer {
    /// The server of a latency (`bandwidth` false) or bandwidth run.
    pub fn new(spec: PerfSpec, buffers: PerfBuffers, bandwidth: bool) -> Self {
        Self {
            spec,
            buffers,
            bandwidth,
            conn: None,
            requests: None,
            last_marker: 0,
            unsignaled: 0,
            told_done: false,
            spin: false,
            failed: None,
        }
    }

    /// The same, answering a latency run from a loop spinning on the
    /// reactor's CQs (`Ctx::spin`).
    pub fn spinning(mut self) -> Self {
        self.spin = !self.bandwidth;
        self
    }

    /// The error that ended the run early, if any.
    pub fn failure(&self) -> Option<&str> {
        self.failed.as_deref()
    }

    /// True once the client said its run is over.
    pub fn is_done(&self) -> bool {
        self.told_done
    }

    #[cold]
    fn fail(&mut self, ctx: &mut impl Poster, why: String) {
        self.failed.get_or_insert(why);
        ctx.stop();
    }

    /// Posts the answer (a SEND, or a WRITE of what landed).
    #[inline]
    fn answer(&mut self, ctx: &mut impl Poster) {
        let (Some(conn), Some(requests)) = (self.conn, self.requests.as_mut()) else {
            return;
        };
        let posted = match ctx.qp(conn) {
            Ok(mut qp) => requests
                .post_op(&mut qp, &mut self.unsignaled)
                .map_err(|e| e.to_string()),
            Err(why) => Err(why),
        };
        if let Err(why) = posted {
            self.fail(ctx, why);
        }
    }

    /// Completion `id`, with immediate `imm`: a receive (the client's SEND
    /// or its done marker) is reposted and a SEND answered.
    #[inline]
    fn served(&mut self, ctx: &mut impl Poster, id: u32, imm: Option<u32>) {
        if id != RECV_ID {
            return;
        }
        if imm == Some(DONE_MARKER) {
            self.told_done = true;
            return ctx.stop();
        }
        if let (Some(conn), Some(requests)) = (self.conn, self.requests.as_mut())
            && let Ok(mut qp) = ctx.qp(conn)
            && let Err(err) = qp.post_recv(&mut requests.landing)
        {
            return self.fail(ctx, err.to_string());
        }
        if self.spec.op == PerfOp::Send && !self.bandwidth {
            self.answer(ctx);
        }
    }

    /// WRITE ping-pong: whether the client's WRITE changed the last byte
    /// of our landing half (that half then goes straight back).
    #[inline]
    fn write_landed(&mut self) -> bool {
        let (last, at) = (self.last_marker, self.spec.size - 1);
        if !poll_byte(&self.buffers.buffer, at, |b| b != 0 && b != last) {
            return false;
        }
        self.last_marker = self.buffers.buffer.load_byte(at).unwrap_or(last);
        true
    }

    /// A spinning server's idle pass: a spin, until the client is done.
    fn spin_idle(&mut self, ctx: &mut Ctx<'_>) {
        let Some(conn) = self.conn else { return };
        if self.told_done {
            return;
        }
        if let Some(refused) = spin_on(ctx, conn, |spin| self.spin_serve(spin)) {
            self.fail(ctx, refused);
        }
    }

    /// Answers from the CQs `spin` lends, until the client is done or the
    /// spin ends.
    fn spin_serve(&mut self, spin: &mut Spin<'_>) {
        let writes = self.spec.op == PerfOp::Write;
        while !self.told_done && self.failed.is_none() {
            match spin.poll() {
                Spun::Completion(id, wc) => {
                    let imm = wc.imm();
                    self.served(spin, id, imm);
                }
                Spun::Empty if writes && self.write_landed() => self.answer(spin),
                Spun::Empty => {}
                Spun::Ended => break,
            }
        }
    }
}

impl Handler for DirectServer {
    fn on_established(&mut self, ctx: &mut Ctx<'_>, conn: ConnId) {
        self.conn = Some(conn);
        // Receives for the client's SENDs, or for its done marker.
        let answer = self.spec.op == PerfOp::Write;
        match start(ctx, conn, &self.spec, &self.buffers, answer, true) {
            Ok((requests, _)) => self.requests = Some(requests),
            Err(why) => self.fail(ctx, why),
        }
    }

    fn on_message(&mut self, _: &mut Ctx<'_>, _: ConnId, _: &[u8], _: Option<u32>) {}

    #[inline]
    fn on_direct_completion(&mut self, ctx: &mut Ctx<'_>, _: ConnId, id: u32, wc: &WorkCompletion) {
        self.served(ctx, id, wc.imm());
    }

    fn on_error(&mut self, ctx: &mut Ctx<'_>, _: ConnId, error: &Error) {
        self.fail(ctx, error.to_string());
    }

    #[inline]
    fn on_idle(&mut self, ctx: &mut Ctx<'_>) -> Idle {
        self.when_idle(ctx);
        Idle::Again
    }
}

impl DirectServer {
    /// What a pass that finds nothing does for this role.
    #[inline]
    fn when_idle(&mut self, ctx: &mut Ctx<'_>) {
        if self.spin {
            return self.spin_idle(ctx);
        }
        // WRITE ping-pong: the answer goes once the client's WRITE landed.
        if self.spec.op != PerfOp::Write || self.bandwidth {
            return;
        }
        if self.write_landed() {
            self.answer(ctx);
        }
    }
}
