//! The measured loops: the requests a run builds once, the QP and CQ they
//! go through, selective signaling, and the bound on every wait.

use std::io;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use rdma_comm_core::verbs::{
    CompletionQueue, MemoryRegion, QueuePair, RecvRequest, Registration, RemoteRegion, SendBatch,
    SendFlags, WcOpcode, WorkCompletion, WorkRequest,
};
use rdma_comm_core::{Error, Result};
use rdma_perf::Clock;

use super::{Args, MAX_BATCH, Op};

/// Spins between looks at the clock while waiting (the clock is not read on
/// every spin: a wait that succeeds at once never reads it).
const SPINS_PER_CLOCK_CHECK: u32 = 1 << 16;
/// A wait that sees no progress for this long fails instead of hanging.
const STALL: Duration = Duration::from_secs(20);
/// Completions taken per poll.
const POLL_BATCH: usize = 16;
/// Fails a wait that has seen no progress for [`STALL`], or any wait past
/// the run's deadline; looks at the clock only every
/// [`SPINS_PER_CLOCK_CHECK`] calls, counted over all the run's waits (so
/// a peer that keeps each wait short still meets the deadline).
struct Patience {
    spins: u32,
    since: Option<Instant>,
    deadline: Instant,
}

impl Patience {
    fn new(deadline: Instant) -> Self {
        Self {
            spins: 0,
            since: None,
            deadline,
        }
    }

    /// A wait starts, or the one under way got something: the stall clock
    /// starts again (the deadline stays).
    #[inline]
    fn progressed(&mut self) {
        self.since = None;
    }

    #[inline(always)]
    fn spin(&mut self, what: &'static str) -> Result<()> {
        self.spins += 1;
        if self.spins < SPINS_PER_CLOCK_CHECK {
            return Ok(());
        }
        self.look_at_the_clock(what)
    }

    #[cold]
    #[inline(never)]
    fn look_at_the_clock(&mut self, what: &'static str) -> Result<()> {
        self.spins = 0;
        let now = Instant::now();
        let since = *self.since.get_or_insert(now);
        let late = now >= self.deadline;
        if late || now.duration_since(since) >= STALL {
            let why = if late {
                "the run passed --deadline".to_string()
            } else {
                format!("nothing for {STALL:?}")
            };
            let stalled = io::Error::new(io::ErrorKind::TimedOut, why);
            return Err(Error::Os {
                what,
                source: stalled,
            });
        }
        Ok(())
    }
}

/// The requests a run posts, each built once (bounds-checked against the
/// buffer and the peer's export then) and posted again and again with only
/// its id and flags changed, the way perftest reuses its requests.
pub(crate) struct Requests<'r> {
    /// A receive into our first half (SEND tests).
    landing: RecvRequest<'r>,
    /// The test's request: a SEND or WRITE of our second half into the
    /// peer's first half (inline when it fits), or a READ of the peer's
    /// first half into ours.
    op: WorkRequest<'r>,
    /// `INLINE` when the payload fits the QP's inline data.
    inline: SendFlags,
}

impl<'r> Requests<'r> {
    pub(crate) fn new(
        args: &Args,
        qp: &QueuePair,
        registration: &'r Registration,
        peer: RemoteRegion,
    ) -> Result<Self> {
        let size = args.size as usize;
        let remote = peer.slice(0, u64::from(args.size))?;
        let (first, second) = (
            registration.slice(0, size)?,
            registration.slice(size, size)?,
        );
        let inline = if args.size <= qp.max_inline_data() && args.op != Op::Read {
            SendFlags::INLINE
        } else {
            SendFlags::empty()
        };
        let op = match args.op {
            Op::Send => WorkRequest::send(0, second),
            Op::Write => WorkRequest::write(0, second, remote)?,
            Op::Read => WorkRequest::read(1, first, remote)?.signaled(),
        };
        Ok(Self {
            landing: RecvRequest::new(0, first)?,
            op: op.with_flags(inline),
            inline,
        })
    }
}

/// Gives a kept request the id and flags of its next post.
#[inline]
fn stamp(request: &mut WorkRequest<'_>, wr_id: u64, flags: SendFlags) {
    request.set_wr_id(wr_id);
    request.set_flags(flags);
}

/// One connected QP with its CQ and buffer. The buffer holds `2 × size`
/// bytes: the first half is where the peer's WRITEs and SENDs land and what
/// its READs fetch, the second half is what ours send, so polling the first
/// half never sees our own marker.
pub(crate) struct Link<'r> {
    qp: QueuePair,
    cq: CompletionQueue,
    buffer: MemoryRegion,
    requests: Requests<'r>,
    wcs: [WorkCompletion; POLL_BATCH],
    size: u32,
    signals: Signals,
    /// Send-queue slots in use: requests posted and not known complete.
    sq_used: u64,
    sq_depth: u64,
    /// Every wait's bound: no progress for STALL, or past the deadline.
    patience: Patience,
    /// Named in a failed completion's error.
    peer: SocketAddr,
}

/// Selective signaling: one request in `every` is signaled, and carries in
/// its `wr_id` how many requests its completion retires.
struct Signals {
    every: u64,
    /// Requests posted since the last signaled one.
    unsignaled: u64,
}

impl Signals {
    /// The `wr_id` and flags of the next request (`last` signals it anyway).
    #[inline]
    fn next(&mut self, last: bool) -> (u64, SendFlags) {
        self.unsignaled += 1;
        if self.unsignaled == self.every || last {
            let retires = self.unsignaled;
            self.unsignaled = 0;
            (retires, SendFlags::SIGNALED)
        } else {
            (0, SendFlags::empty())
        }
    }
}

impl<'r> Link<'r> {
    pub(crate) fn new(
        args: &Args,
        qp: QueuePair,
        cq: CompletionQueue,
        buffer: MemoryRegion,
        requests: Requests<'r>,
        deadline: Instant,
        peer: SocketAddr,
    ) -> Self {
        Self {
            qp,
            cq,
            buffer,
            requests,
            wcs: [WorkCompletion::default(); POLL_BATCH],
            size: args.size,
            signals: Signals {
                every: args.signal,
                unsignaled: 0,
            },
            sq_used: 0,
            sq_depth: u64::from(super::sq_depth(args)),
            patience: Patience::new(deadline),
            peer,
        }
    }

    /// Polls the CQ once: send-queue completions free their slots, and the
    /// receives consumed are reposted. Returns the receives.
    #[inline]
    fn poll(&mut self) -> Result<u64> {
        let mut received = 0;
        for wc in self.cq.poll(&mut self.wcs)? {
            wc.ok().map_err(|err| err.with_peer(Some(self.peer)))?;
            let opcode = wc.opcode();
            if opcode == WcOpcode::RECV || opcode == WcOpcode::RECV_RDMA_WITH_IMM {
                received += 1;
            } else {
                self.sq_used -= wc.wr_id().min(self.sq_used);
            }
        }
        for _ in 0..received {
            self.post_receive()?;
        }
        Ok(received)
    }

    #[inline]
    pub(crate) fn post_receive(&mut self) -> Result<()> {
        self.qp.post_recv(&mut self.requests.landing)
    }

    /// Polls until a send-queue slot is free.
    #[inline]
    fn wait_for_room(&mut self) -> Result<()> {
        self.patience.progressed();
        while self.sq_used >= self.sq_depth {
            self.poll()?;
            self.patience.spin("waiting for send completions")?;
        }
        Ok(())
    }

    /// Posts the test's SEND or WRITE of our second half.
    #[inline]
    fn post_own_half(&mut self) -> Result<()> {
        self.wait_for_room()?;
        let (wr_id, flags) = self.signals.next(false);
        self.sq_used += 1;
        stamp(&mut self.requests.op, wr_id, flags | self.requests.inline);
        self.qp.post_send(&mut self.requests.op)
    }

    /// Polls until `want` receives have come.
    #[inline]
    fn wait_for_receives(&mut self, want: u64) -> Result<()> {
        let mut got = 0;
        self.patience.progressed();
        while got < want {
            let received = self.poll()?;
            got += received;
            if received > 0 {
                // Waiting on a stream of them: the stall is a gap in it.
                self.patience.progressed();
            }
            self.patience.spin("waiting for a message")?;
        }
        Ok(())
    }

    /// Spins until the last byte of our landing half is `marker`.
    #[inline]
    fn wait_for_marker(&mut self, marker: u8) -> Result<()> {
        let at = self.size as usize - 1;
        self.patience.progressed();
        while self.buffer.load_byte(at) != Some(marker) {
            self.patience.spin("waiting for the peer's WRITE")?;
        }
        Ok(())
    }

    /// Iteration `i`'s marker: never 0, so a fresh buffer differs.
    fn marker(i: u64) -> u8 {
        (i % 255) as u8 + 1
    }

    /// One READ at a time, each waited for by polling for its one
    /// completion (the send queue holds nothing else: no receives are
    /// posted in a READ test), as perftest's loop does.
    pub(crate) fn read_lat(
        &mut self,
        clock: &Clock,
        total: u64,
        samples: &mut Vec<u64>,
    ) -> Result<()> {
        for _ in 0..total {
            let start = clock.now();
            self.qp.post_send(&mut self.requests.op)?;
            self.patience.progressed();
            loop {
                if let Some(wc) = self.cq.poll(&mut self.wcs[..1])?.first() {
                    wc.ok().map_err(|err| err.with_peer(Some(self.peer)))?;
                    // The window binds set-up posted are unsignaled: nothing
                    // else completes here.
                    debug_assert_eq!(wc.wr_id(), 1, "a completion not the READ's");
                    break;
                }
                self.patience.spin("waiting for a READ")?;
            }
            samples.push(clock.now().saturating_sub(start));
        }
        Ok(())
    }

    pub(crate) fn send_lat(
        &mut self,
        clock: &Clock,
        total: u64,
        samples: &mut Vec<u64>,
    ) -> Result<()> {
        for _ in 0..total {
            let start = clock.now();
            self.post_own_half()?;
            self.wait_for_receives(1)?;
            samples.push(clock.now().saturating_sub(start));
        }
        Ok(())
    }

    pub(crate) fn write_lat(
        &mut self,
        clock: &Clock,
        total: u64,
        samples: &mut Vec<u64>,
    ) -> Result<()> {
        let last = 2 * self.size as usize - 1;
        for i in 0..total {
            let start = clock.now();
            let marker = Self::marker(i);
            self.buffer.write(last, &[marker])?;
            self.post_own_half()?;
            self.wait_for_marker(marker)?;
            samples.push(clock.now().saturating_sub(start));
            if self.signals.unsignaled == 0 {
                // The request just answered was signaled: reap it.
                self.poll()?;
            }
        }
        Ok(())
    }

    /// Server of SEND latency: answers each message with one.
    pub(crate) fn echo(&mut self, total: u64) -> Result<()> {
        for _ in 0..total {
            self.wait_for_receives(1)?;
            self.post_own_half()?;
        }
        Ok(())
    }

    /// Server of WRITE latency: answers each WRITE with one, carrying its
    /// marker back.
    pub(crate) fn reflect(&mut self, total: u64) -> Result<()> {
        let last = 2 * self.size as usize - 1;
        for i in 0..total {
            let marker = Self::marker(i);
            self.wait_for_marker(marker)?;
            self.buffer.write(last, &[marker])?;
            self.post_own_half()?;
            if self.signals.unsignaled == 0 {
                self.poll()?;
            }
        }
        Ok(())
    }

    /// Server of SEND bandwidth: takes `total` messages.
    pub(crate) fn sink(&mut self, total: u64) -> Result<()> {
        self.wait_for_receives(total)
    }

    /// Client of bandwidth: `iters` requests, `batch` per doorbell, at most
    /// `tx_depth` outstanding, then waits for the last completion. The
    /// batch is built once and posted again; when `--signal` divides
    /// `--batch` every batch signals the same requests, so nothing in it
    /// changes between posts (perftest's post list with `--cq-mod`).
    pub(crate) fn stream(&mut self, args: &Args) -> Result<()> {
        let depth = args.tx_depth.min(self.sq_depth);
        let batch_len = u64::from(args.batch);
        let fixed = batch_len.is_multiple_of(args.signal);
        let mut batch: SendBatch<'r, MAX_BATCH> = SendBatch::new();
        for _ in 0..batch_len {
            let (wr_id, flags) = self.signals.next(false);
            // Never full: `--batch` is at most MAX_BATCH.
            let _ = batch.push(self.request_with(wr_id, flags));
        }
        self.signals.unsignaled = 0;
        let mut posted = 0;
        self.patience.progressed();
        while posted < args.iters || self.sq_used > 0 {
            let take = batch_len.min(args.iters - posted);
            if take > 0 && self.sq_used + take <= depth {
                if take < batch_len {
                    // The tail of a run that is not a whole number of batches.
                    batch.clear();
                    for k in 0..take {
                        let (wr_id, flags) = self.signals.next(k + 1 == take);
                        let _ = batch.push(self.request_with(wr_id, flags));
                    }
                } else if !fixed {
                    for k in 0..take {
                        let (wr_id, flags) = self.signals.next(posted + k + 1 == args.iters);
                        let request = batch.get_mut(k as usize).expect("a full batch");
                        stamp(request, wr_id, flags | self.requests.inline);
                    }
                }
                self.qp.post_send(&mut batch)?;
                posted += take;
                self.sq_used += take;
                self.patience.progressed();
                continue;
            }
            self.poll()?;
            self.patience.spin("waiting for send completions")?;
        }
        Ok(())
    }

    /// The test's request with `wr_id` and `flags` (and `INLINE` when it fits).
    fn request_with(&self, wr_id: u64, flags: SendFlags) -> WorkRequest<'r> {
        let mut request = self.requests.op;
        stamp(&mut request, wr_id, flags | self.requests.inline);
        request
    }
}
