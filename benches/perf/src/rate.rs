//! Bandwidth roles: the sender that streams and times a run, and the sink that
//! absorbs it.

use rdma_comm_core::error::Error;
use rdma_comm_core::reactor::{ConnId, Ctx, Handler, SendError};

use crate::run_end::RunEnd;
use crate::{BandwidthStats, Clock, DONE_MARKER, PerfBuffers, PerfOp, PerfSpec};

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
    pub(crate) failed: Option<String>,
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
    /// The sender's done marker arrived.
    told_done: bool,
    pub(crate) failed: Option<String>,
}

impl RateSink {
    /// Messages received so far.
    pub fn received(&self) -> u64 {
        self.received
    }

    /// True once the sender said its run is over.
    pub fn is_done(&self) -> bool {
        self.told_done
    }

    /// The error that ended the run early, if any.
    pub fn failure(&self) -> Option<&str> {
        self.failed.as_deref()
    }
}

impl Handler for RateSink {
    fn on_message(&mut self, ctx: &mut Ctx<'_>, _conn: ConnId, _data: &[u8], imm: Option<u32>) {
        if imm == Some(DONE_MARKER) {
            self.told_done = true;
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
