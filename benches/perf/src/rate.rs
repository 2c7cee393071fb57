//! Bandwidth roles: the sender that streams and times a run, and the sink that
//! absorbs it.

use rdma_comm_core::error::Error;
use rdma_comm_core::reactor::{ConnId, Ctx, Handler, Idle, SendError};

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
    /// Completions since a message was last staged. A completion stages
    /// more only once a batch's worth is back (or fewer than a batch are in
    /// flight), so that one lookup of the connection and one slice of the
    /// buffers serve a whole batch, as perftest posts a list at a time.
    since_staged: u64,
    marks: RateMarks,
    pub(crate) failed: Option<String>,
    end: RunEnd,
}

/// When a bandwidth run's messages completed: the run's clock and
/// (completions so far, clock reading) every so many completions,
/// preallocated, from which the average and peak rates come.
#[derive(Debug)]
pub(crate) struct RateMarks {
    clock: Clock,
    /// (completions so far, timestamp), every `stride` completions.
    marks: Vec<(u64, u64)>,
    stride: u64,
    /// The completion count that takes the next mark: one compare a
    /// message, where a remainder would be a DIV (slow under emulation),
    /// and a sender whose count jumps by its batch still marks once per
    /// `stride`.
    next_mark: u64,
    iters: u64,
}

impl RateMarks {
    /// Marks for a run of `iters` messages, read on `clock` (calibrated
    /// once: a clock's calibration spins for a while), one every `every`
    /// completions or more (fewer for a long run: at most `MAX_MARKS`).
    /// A sender whose completions come in bursts of its batch marks once a
    /// burst, as perftest stamps once a completion: marks within a burst
    /// are nanoseconds apart and tell the peak nothing, and a clock read
    /// per message costs the reactor's protocol rows about 50 Ir a message.
    pub(crate) fn new(iters: u64, every: u64, clock: Clock) -> Self {
        let stride = iters.div_ceil(MAX_MARKS).max(every).max(1);
        Self {
            clock,
            marks: Vec::with_capacity(iters.div_ceil(stride) as usize + 2),
            stride,
            next_mark: stride,
            iters,
        }
    }

    /// The first message goes out now.
    #[inline]
    pub(crate) fn start(&mut self) {
        if self.marks.is_empty() {
            self.marks.push((0, self.clock.now()));
        }
    }

    /// `completed` messages of the run are done (called as they grow).
    #[inline]
    pub(crate) fn completed(&mut self, completed: u64) {
        if completed >= self.next_mark || completed == self.iters {
            self.marks.push((completed, self.clock.now()));
            self.next_mark = completed.saturating_add(self.stride);
        }
    }

    /// Bandwidth figures for messages of `size` bytes, once done.
    pub(crate) fn stats(&self, size: usize) -> BandwidthStats {
        let elapsed_ns = |from: u64, to: u64| self.clock.nanos(from, to).max(1) as f64;
        let (first, last) = (self.marks.first().copied(), self.marks.last().copied());
        let avg_secs = match (first, last) {
            (Some((_, start)), Some((_, end))) => elapsed_ns(start, end) / 1e9,
            _ => f64::INFINITY,
        };
        let bytes = size as f64;
        let peak = peak_rate(&self.marks, bytes, |from, to| self.clock.nanos(from, to));
        let avg = self.iters as f64 * bytes / avg_secs;
        BandwidthStats {
            bytes: size,
            iters: self.iters,
            peak_bytes_per_sec: peak.max(avg),
            avg_bytes_per_sec: avg,
            msg_rate_mpps: self.iters as f64 / avg_secs / 1e6,
        }
    }
}

/// Timestamps kept per run, at most (preallocated).
const MAX_MARKS: u64 = 1 << 16;
/// The peak is the best rate over any stretch lasting at least this
/// fraction of the run's time. Selective signaling retires completions in
/// bursts whose marks are nanoseconds apart: a stretch measured in marks
/// rather than time (a run of a few large messages has only a few) could
/// fall inside one burst and report an absurd rate.
const PEAK_FRACTION: u64 = 4;

impl RateSender {
    /// A sender for `spec`.
    pub fn new(spec: PerfSpec, buffers: PerfBuffers) -> Self {
        let spec = spec.runnable();
        Self {
            spec,
            buffers,
            conn: None,
            posted: 0,
            completed: 0,
            since_staged: 0,
            marks: RateMarks::new(spec.iters, spec.batch as u64, Clock::new()),
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
        self.marks.stats(self.spec.size)
    }

    fn pump(&mut self, ctx: &mut Ctx<'_>) {
        let Some(conn) = self.conn else { return };
        let size = self.spec.size;
        let tx_depth = match self.spec.tx_depth {
            0 => u64::MAX,
            depth => depth,
        };
        let has_room = |sender: &Self, staged: usize| {
            sender.posted < sender.spec.iters
                && staged < sender.spec.batch
                && sender.posted - sender.completed < tx_depth
        };
        // Counted here rather than asked of `ctx` per request: one lookup
        // of the connection per request, the staging call's own.
        let mut staged = ctx.staged(conn);
        if !has_room(self, staged) {
            return;
        }
        // Every request moves the same bytes: slice them once per batch.
        let rdma = match self.spec.op {
            PerfOp::Send => Ok(None),
            PerfOp::Write | PerfOp::WriteImm | PerfOp::Read => match (
                self.buffers.buffer.slice(size, size),
                self.buffers.peer.slice(0, size as u64),
            ) {
                (Ok(local), Ok(remote)) => Ok(Some((local, remote))),
                (Err(e), _) | (_, Err(e)) => Err(SendError::Invalid(e)),
            },
        };
        let mut failed = None;
        match rdma {
            Err(err) => failed = Some(err),
            Ok(rdma) => {
                while has_room(self, staged) {
                    let result = match (&rdma, self.spec.op) {
                        // The payload's content does not matter for a rate test.
                        (None, _) => ctx.send_with(conn, size, None, |_| {}),
                        (Some((local, remote)), PerfOp::Read) => ctx.read(conn, local, *remote),
                        (Some((local, remote)), PerfOp::WriteImm) => {
                            ctx.write(conn, local, *remote, Some(0))
                        }
                        (Some((local, remote)), _) => ctx.write(conn, local, *remote, None),
                    };
                    match result {
                        Ok(_) => {
                            if self.posted == 0 {
                                self.marks.start();
                            }
                            self.posted += 1;
                            self.since_staged = 0;
                            staged += 1;
                        }
                        Err(SendError::WouldBlock) => break,
                        Err(err) => {
                            failed = Some(err);
                            break;
                        }
                    }
                }
            }
        }
        if let Some(err) = failed {
            self.failed = Some(err.to_string());
            ctx.stop();
        }
    }

    /// `count` measured messages completed (a signaled completion retires
    /// a batch's worth in one call).
    fn completed_run(&mut self, ctx: &mut Ctx<'_>, count: u64) {
        self.completed += count;
        self.since_staged += count;
        self.marks.completed(self.completed);
        let batch = self.spec.batch as u64;
        // (`>=`: a run never takes it past `iters`, but a miscount must
        // not run on forever.)
        if self.completed >= self.spec.iters {
            self.end.begin(ctx, self.conn);
        } else if self.since_staged >= batch || self.posted - self.completed < batch {
            // (Fewer than a batch in flight: the last staging fell short,
            // for want of credit or room. Stage at every completion then.)
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

    // Runs of completions at once, as perftest counts what one poll
    // returns: one call per signaled completion, not one per message.
    fn on_sends_complete(&mut self, ctx: &mut Ctx<'_>, _conn: ConnId, first: u32, count: u32) {
        if self.end.begun() {
            self.end.completed_within(ctx, first, count);
        } else if self.spec.op == PerfOp::Send {
            self.completed_run(ctx, u64::from(count));
        }
    }

    fn on_writes_complete(&mut self, ctx: &mut Ctx<'_>, _conn: ConnId, _first: u32, count: u32) {
        if !self.end.begun() {
            self.completed_run(ctx, u64::from(count));
        }
    }

    fn on_reads_complete(&mut self, ctx: &mut Ctx<'_>, _conn: ConnId, _first: u32, count: u32) {
        if !self.end.begun() {
            self.completed_run(ctx, u64::from(count));
        }
    }

    fn on_error(&mut self, ctx: &mut Ctx<'_>, _conn: ConnId, error: &Error) {
        self.failed = Some(error.to_string());
        ctx.stop();
    }

    fn on_writable(&mut self, ctx: &mut Ctx<'_>, _conn: ConnId) {
        self.resume(ctx);
    }

    fn on_idle(&mut self, ctx: &mut Ctx<'_>) -> Idle {
        self.resume(ctx);
        Idle::Again
    }
}

impl RateSender {
    /// Stages what a refusal or a short batch left: the run's, or its end's.
    fn resume(&mut self, ctx: &mut Ctx<'_>) {
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

/// The best rate (bytes per second) over any stretch of `marks` (messages
/// done, clock reading) lasting at least a [`PEAK_FRACTION`] of the run,
/// with `nanos` converting two readings to the nanoseconds between them.
fn peak_rate(marks: &[(u64, u64)], bytes: f64, nanos: impl Fn(u64, u64) -> u64) -> f64 {
    let (Some(&(_, start)), Some(&(_, end))) = (marks.first(), marks.last()) else {
        return 0.0;
    };
    let min_stretch_ns = (nanos(start, end) / PEAK_FRACTION).max(1);
    // The best stretch so far as (messages, nanoseconds), compared by cross
    // multiplication: a division per mark would cost more than the rest of
    // the loop (a mark per message in a run of the reactor's protocol).
    let (mut best_done, mut best_ns) = (0u64, 1u64);
    // For each start, the first mark at least `min_stretch_ns` later (two
    // pointers: both only move forward).
    let mut stop = 0;
    'starts: for (begin, &(done_at_begin, t_begin)) in marks.iter().enumerate() {
        stop = stop.max(begin + 1);
        let (done_at_stop, stretch_ns) = loop {
            let Some(&(done_at_stop, t_stop)) = marks.get(stop) else {
                // No later start has a long enough stretch either.
                break 'starts;
            };
            let stretch_ns = nanos(t_begin, t_stop);
            if stretch_ns >= min_stretch_ns {
                break (done_at_stop, stretch_ns);
            }
            stop += 1;
        };
        let done = done_at_stop.saturating_sub(done_at_begin);
        if u128::from(done) * u128::from(best_ns) > u128::from(best_done) * u128::from(stretch_ns) {
            (best_done, best_ns) = (done, stretch_ns);
        }
    }
    best_done as f64 * bytes / (best_ns as f64 / 1e9)
}

#[cfg(test)]
mod tests {
    use super::{MAX_MARKS, RateMarks, peak_rate};
    use crate::Clock;

    /// The completion counts `marks` stamped, after completions 1 to
    /// `iters` one by one.
    fn marked(iters: u64, every: u64, clock: Clock) -> Vec<u64> {
        let mut marks = RateMarks::new(iters, every, clock);
        let capacity = marks.marks.capacity();
        marks.start();
        for done in 1..=iters {
            marks.completed(done);
        }
        assert_eq!(marks.marks.capacity(), capacity, "the marks grew");
        marks.marks.iter().map(|&(done, _)| done).collect()
    }

    #[test]
    fn a_sender_of_batches_marks_once_a_batch_and_at_the_end() {
        let clock = Clock::new();
        assert_eq!(
            marked(100, 16, clock.clone()),
            [0, 16, 32, 48, 64, 80, 96, 100]
        );
        assert_eq!(marked(3, 1, clock.clone()), [0, 1, 2, 3]);
        // A long run keeps at most MAX_MARKS, whatever the batch.
        let long = marked(4 * MAX_MARKS, 1, clock);
        assert_eq!(long.len() as u64, MAX_MARKS + 1);
        assert_eq!((long[1], long[long.len() - 1]), (4, 4 * MAX_MARKS));
    }

    #[test]
    fn a_count_that_jumps_still_marks_once_a_stride_within_capacity() {
        // A direct client's count grows by whole retired batches, which
        // need not land on a multiple of the stride.
        let mut marks = RateMarks::new(100, 16, Clock::new());
        let capacity = marks.marks.capacity();
        marks.start();
        for done in (5..=100).step_by(5) {
            marks.completed(done);
        }
        let counts: Vec<u64> = marks.marks.iter().map(|&(done, _)| done).collect();
        assert_eq!(counts, [0, 20, 40, 60, 80, 100]);
        assert_eq!(marks.marks.capacity(), capacity, "the marks grew");
    }

    fn ns(from: u64, to: u64) -> u64 {
        to.saturating_sub(from)
    }

    #[test]
    fn a_burst_of_marks_a_nanosecond_apart_does_not_make_the_peak() {
        // 16 messages of 1 MB: bursts of 4 retired 1 ns apart, bursts 1 ms apart.
        let mut marks = vec![(0, 0)];
        for burst in 1..=4u64 {
            for i in 1..=4u64 {
                marks.push(((burst - 1) * 4 + i, burst * 1_000_000 + i));
            }
        }
        let peak = peak_rate(&marks, 1e6, ns);
        // 4 MB per ms is 4e9 B/s; one burst read alone would be about 1e15.
        // A stretch from a burst's first mark to the next burst's second
        // counts five messages in a millisecond: the granularity left.
        assert!(peak <= 5.01e9, "peak {peak}");
        assert!(peak >= 3.9e9, "peak {peak}");
    }

    #[test]
    fn a_faster_stretch_shows_as_the_peak() {
        // One message per ms for 8 ms, then one per 0.5 ms for 8 messages.
        let mut marks: Vec<(u64, u64)> = (0..=8).map(|i| (i, i * 1_000_000)).collect();
        marks.extend((1..=8).map(|i| (8 + i, 8_000_000 + i * 500_000)));
        let peak = peak_rate(&marks, 1.0, ns);
        assert!((peak - 2000.0).abs() < 1.0, "peak {peak}");
    }

    #[test]
    fn the_peak_is_the_best_rate_over_any_long_enough_stretch() {
        // Irregular marks (a fixed pseudo-random walk), against the plain
        // definition: every start, its first mark a quarter of the run
        // later, the best rate of those.
        let mut state = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let (mut done, mut at) = (0u64, 0u64);
        let mut marks = vec![(0, 0)];
        for _ in 0..500 {
            done += 1 + next() % 16;
            at += 1 + next() % 100_000;
            marks.push((done, at));
        }
        let min = ((at - marks[0].1) / 4).max(1);
        let mut expected = 0.0_f64;
        for (begin, &(d0, t0)) in marks.iter().enumerate() {
            if let Some(&(d1, t1)) = marks[begin + 1..].iter().find(|m| m.1 - t0 >= min) {
                expected = expected.max((d1 - d0) as f64 * 64.0 / ((t1 - t0) as f64 / 1e9));
            }
        }
        let peak = peak_rate(&marks, 64.0, ns);
        assert!(
            (peak - expected).abs() <= expected * 1e-12,
            "{peak} vs {expected}"
        );
    }

    #[test]
    fn no_marks_no_peak() {
        assert_eq!(peak_rate(&[], 1.0, ns), 0.0);
        assert_eq!(peak_rate(&[(1, 5)], 1.0, ns), 0.0);
    }
}
