//! lat_bw's measurements written straight on the crate's safe verbs layer,
//! with no reactor: one QP, one CQ, one buffer, and a loop per test, the way
//! perftest is written.
//!
//! ```text
//! verbs_perf --server [--listen 0.0.0.0:7476] --op read --test lat -s 8
//! verbs_perf --connect HOST:7476 --op read --test lat -s 8 [-n 1000]
//! verbs_perf --connect HOST:7476 --op write --test bw -s 64 --batch 16 --signal 16
//! ```
//!
//! It answers one question: what does a message cost through this crate's
//! verbs layer alone ([`QueuePair::post_send_kept`] and
//! [`QueuePair::post_send_batch_kept`] of requests bounds-checked once and
//! posted again, as perftest posts its prebuilt requests;
//! [`CompletionQueue::poll`])? `tools/instr-count` counts it beside lat_bw (the
//! reactor) and perftest. The difference between it and lat_bw is what the
//! reactor's services cost: many connections on shared CQs, credits,
//! receive rings, vetted completions and handlers. A service with one
//! connection per core that needs none of them can be written this way.
//!
//! Set-up is the session layer's, as for lat_bw: an authenticated
//! handshake (`--auth-key-file`) connects the QP, and each side exports its
//! buffer to the other through a memory window of its own. With a key,
//! nothing about the QP or the buffer reaches a client that cannot prove
//! it; without one (as perftest, and lat_bw without a key), the first
//! client to connect gets both, and the server says so. The session
//! is then split ([`Endpoint::into_parts`]): the loop owns the QP and polls
//! its own CQ, and the link stays open to say goodbye and to notice a peer
//! that is gone.
//!
//! Both sides take the same `--op/--test/-s/-n/--warmup`, checked when they
//! meet (each exports its buffer under a name that says the test). A run
//! not over within `--deadline` seconds of the handshake fails, on either
//! side, and any wait fails after 20 s without progress. Latency: READ is
//! timed per READ; SEND is echoed by a SEND; WRITE is answered by a WRITE the
//! peer notices by polling the last byte of its buffer. SEND and WRITE report
//! half the round trip. Bandwidth streams WRITEs or SENDs with `--batch`
//! requests per doorbell, one in `--signal` signaled, at most `--tx-depth`
//! outstanding.

use std::io;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

mod common;

use clap::{Parser, ValueEnum};
use rdma_comm_core::session::{
    ClientConfig, ClientSession, CqChoice, Endpoint, Export, PeerStatus, QpSpec, ServerConfig,
    ServerSession, SessionLink,
};
use rdma_comm_core::verbs::{
    AccessFlags, CompletionQueue, Context, MemoryRegion, ProtectionDomain, QpConfig, QueuePair,
    RecvRequest, Registration, RemoteRegion, SendBatch, SendFlags, WcOpcode, WorkCompletion,
    WorkRequest,
};
use rdma_comm_core::{Error, Result};
use rdma_perf::{BandwidthStats, Clock, LATENCY_HEADER, LatencyStats, bandwidth_header};

/// Most iterations or messages of a run (a latency run keeps a sample of
/// 8 bytes per iteration).
const MAX_ITERS: u64 = 100_000_000;
/// Receives kept posted (SEND tests).
const RECV_DEPTH: u32 = 128;
/// Most requests per doorbell.
const MAX_BATCH: usize = 32;
/// Completions taken per poll.
const POLL_BATCH: usize = 16;
/// A wait that sees no progress for this long fails instead of hanging.
const STALL: Duration = Duration::from_secs(20);
/// Spins between looks at the clock while waiting (the clock is not read on
/// every spin: a wait that succeeds at once never reads it).
const SPINS_PER_CLOCK_CHECK: u32 = 1 << 16;
/// The goodbye's code when the two sides were asked for different tests.
const OTHER_TEST: u16 = 1;
/// Longest a server with nothing to do sleeps on the control connection
/// before it looks at the deadline again.
const GOODBYE_CHECK: Duration = Duration::from_secs(1);
/// What a peer may do with the buffer it is given.
const REMOTE_ACCESS: AccessFlags = AccessFlags::REMOTE_WRITE.union(AccessFlags::REMOTE_READ);

/// Latency and bandwidth over the verbs layer alone, perftest's way.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// Wait for the client.
    #[arg(long, conflicts_with = "connect")]
    server: bool,
    /// Address to listen on (server).
    #[arg(long, default_value = "0.0.0.0:7476")]
    listen: String,
    /// Server to connect to (client).
    #[arg(long, value_name = "HOST:PORT", required_unless_present = "server")]
    connect: Option<String>,
    /// Operation.
    #[arg(long, value_enum, default_value_t = Op::Write)]
    op: Op,
    /// Latency or bandwidth.
    #[arg(long = "test", value_enum, default_value_t = Test::Lat)]
    test: Test,
    /// Message size in bytes.
    #[arg(short = 's', long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..))]
    size: u32,
    /// Measured iterations (latency) or messages (bandwidth).
    #[arg(short = 'n', long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..=MAX_ITERS))]
    iters: u64,
    /// Unmeasured iterations first (latency).
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u64).range(0..=MAX_ITERS))]
    warmup: u64,
    /// Seconds the whole run may take, from the handshake on (either side
    /// gives up then: a peer that keeps up a trickle holds it no longer).
    #[arg(long, default_value_t = 3600, value_parser = clap::value_parser!(u64).range(1..=86_400 * 30))]
    deadline: u64,
    /// Bandwidth: requests per doorbell (at most 32).
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=MAX_BATCH as i64))]
    batch: u32,
    /// One request in this many is signaled.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..=1024))]
    signal: u64,
    /// Bandwidth: most requests outstanding (perftest's -t).
    #[arg(short = 't', long, default_value_t = 128, value_parser = clap::value_parser!(u64).range(1..=4096))]
    tx_depth: u64,
    #[command(flatten)]
    dev: common::DeviceArgs,
    #[command(flatten)]
    auth: common::AuthArgs,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    Send,
    Write,
    Read,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Test {
    Lat,
    Bw,
}

fn main() -> ExitCode {
    let args = Args::parse();
    if args.test == Test::Bw && args.op == Op::Read {
        eprintln!("verbs_perf: --op read has a latency test only");
        return ExitCode::from(2);
    }
    // A completion comes every --signal requests. Up to --signal - 1
    // unsignaled ones can be outstanding with no completion to come, and
    // the next batch must still fit beside them, or the loop waits forever;
    // when --signal divides --batch every batch ends signaled and needs
    // only to fit itself.
    let batch = u64::from(args.batch);
    let fits = if batch.is_multiple_of(args.signal) {
        batch <= args.tx_depth
    } else {
        batch + args.signal - 1 <= args.tx_depth
    };
    if args.test == Test::Bw && !fits {
        eprintln!(
            "verbs_perf: --batch {} with --signal {} needs --tx-depth of at least {} \
             (--batch, plus --signal - 1 unless --signal divides --batch)",
            args.batch,
            args.signal,
            if batch.is_multiple_of(args.signal) {
                batch
            } else {
                batch + args.signal - 1
            }
        );
        return ExitCode::from(2);
    }
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("verbs_perf: {err}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Result<()> {
    let ctx = Context::open_default(args.dev.device.as_deref())?;
    let pd = ctx.alloc_pd()?;
    let sq_depth = args.tx_depth.max(args.signal).max(u64::from(args.batch)) as u32;
    let cq = ctx.create_cq(sq_depth + RECV_DEPTH, None)?;
    // Exported through a window per peer: no REMOTE_* rights of its own.
    let buffer = pd.alloc_mr(
        2 * args.size as usize,
        AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND,
    )?;
    let mut qp_config = QpConfig::default();
    args.dev.apply(&mut qp_config);
    qp_config.max_send_wr = sq_depth;
    qp_config.max_recv_wr = RECV_DEPTH;
    qp_config.remote_access = REMOTE_ACCESS;
    let endpoint = meet(args, &pd, &cq, &buffer, qp_config)?;
    let deadline = Instant::now() + Duration::from_secs(args.deadline);
    let (qp, peer, mut link) = take_apart(args, endpoint)?;
    // What the loop's requests point at, kept apart from the buffer so
    // requests built once can borrow it while the loop writes the buffer.
    let registration = buffer.registration().clone();
    let requests = Requests::new(args, &qp, &registration, peer)?;
    let mut run = Link::new(args, qp, cq, buffer, requests, sq_depth, deadline);
    if args.op == Op::Send {
        for _ in 0..RECV_DEPTH {
            run.post_receive()?;
        }
    }
    let size = args.size as usize;
    if args.server {
        match (args.test, args.op) {
            (Test::Lat, Op::Send) => run.echo(args.warmup + args.iters)?,
            (Test::Lat, Op::Write) => run.reflect(args.warmup + args.iters)?,
            (Test::Bw, Op::Send) => run.sink(args.iters)?,
            // READ and WRITE bandwidth: the peer's work reaches our memory only.
            _ => {}
        }
        // The QP must outlive the client's work: wait for its goodbye.
        return wait_for_goodbye(&mut link, deadline);
    }
    let clock = Clock::new();
    match args.test {
        Test::Lat => {
            let total = args.warmup + args.iters;
            let mut samples = Vec::with_capacity(total as usize);
            match args.op {
                Op::Read => run.read_lat(&clock, total, &mut samples)?,
                Op::Send => run.send_lat(&clock, total, &mut samples)?,
                Op::Write => run.write_lat(&clock, total, &mut samples)?,
            }
            let halve = u64::from(args.op != Op::Read);
            let ns = &mut samples[args.warmup as usize..];
            for sample in ns.iter_mut() {
                *sample = clock.nanos(0, *sample) >> halve;
            }
            println!("{LATENCY_HEADER}");
            if let Some(stats) = LatencyStats::from_ns(size, ns) {
                println!("{}", stats.row());
            }
        }
        Test::Bw => {
            let start = clock.now();
            run.stream(args)?;
            let secs = clock.nanos(start, clock.now()).max(1) as f64 / 1e9;
            let bytes = (args.iters * size as u64) as f64;
            let stats = BandwidthStats {
                bytes: size,
                iters: args.iters,
                // One window, the whole run.
                peak_bytes_per_sec: bytes / secs,
                avg_bytes_per_sec: bytes / secs,
                msg_rate_mpps: args.iters as f64 / secs / 1e6,
            };
            println!("{}", bandwidth_header(false));
            println!("{}", stats.row(false));
        }
    }
    link.close();
    Ok(())
}

/// The name each side exports its buffer under: it says the test, so two
/// sides asked for different tests find no buffer of the name they expect.
fn export_name(args: &Args) -> String {
    format!(
        "verbs_perf {:?} {:?} -s {} -n {} --warmup {}",
        args.op, args.test, args.size, args.iters, args.warmup
    )
}

/// The session handshake: the server accepts one client, the client
/// connects (retrying while the server comes up). The QP reports to `cq`,
/// which the loop polls itself.
fn meet(
    args: &Args,
    pd: &ProtectionDomain,
    cq: &CompletionQueue,
    buffer: &MemoryRegion,
    qp: QpConfig,
) -> Result<Endpoint> {
    let name = export_name(args);
    if args.server {
        let auth_key = args.auth.key()?;
        if auth_key.is_none() {
            eprintln!(
                "verbs_perf: no --auth-key-file (or RDMA_COMM_AUTH_KEY): the first client to \
                 connect gets the QP and the buffer"
            );
        }
        let export = buffer.registration().clone();
        let config = ServerConfig {
            qp,
            cq: CqChoice::Shared(cq.shared()),
            max_peers: Some(1),
            max_qps: 1,
            auth_key,
            exports: Some(Arc::new(move |_, _: &ProtectionDomain| {
                Ok(vec![Export::new(
                    1,
                    name.clone(),
                    export.clone(),
                    REMOTE_ACCESS,
                )])
            })),
            ..ServerConfig::default()
        };
        let server = ServerSession::bind(&args.listen, pd, config)?;
        let endpoint = server
            .accept()
            .ok_or(Error::InvalidArgument("the listener stopped"))?;
        for failure in server.take_failures() {
            eprintln!("verbs_perf: rejected {}: {}", failure.peer, failure.error);
        }
        return Ok(endpoint);
    }
    let addr = args.connect.as_deref().unwrap_or_default();
    let mut spec = QpSpec::new("perf");
    spec.cq = CqChoice::Shared(cq.shared());
    spec.qp = qp;
    let mut config = ClientConfig::new(vec![spec]).with_exports(vec![Export::new(
        1,
        name,
        buffer,
        REMOTE_ACCESS,
    )]);
    config.connect_deadline = Duration::from_secs(60);
    config.auth_key = args.auth.key()?;
    ClientSession::connect(addr, pd, &config)
}

/// The endpoint's one QP, the buffer the peer exported for this test, and
/// the link; a peer asked for another test is told so and refused.
fn take_apart(
    args: &Args,
    mut endpoint: Endpoint,
) -> Result<(QueuePair, RemoteRegion, SessionLink)> {
    let Some(peer) = endpoint.remote_region(&export_name(args)) else {
        endpoint.send_disconnect(OTHER_TEST);
        return Err(Error::Protocol {
            peer: endpoint.peer(),
            what: "the peer runs another test (--op, --test, -s, -n or --warmup differ)".into(),
        });
    };
    let peer_addr = endpoint.peer();
    let (mut qps, link) = endpoint.into_parts();
    match (qps.pop(), qps.is_empty()) {
        (Some(qp), true) => Ok((qp, peer, link)),
        _ => Err(Error::Protocol {
            peer: peer_addr,
            what: "the session has more or fewer than one QP".into(),
        }),
    }
}

/// Waits until the peer says goodbye (or is gone, or the run's deadline
/// passes), asleep on the control connection meanwhile: a server that woke
/// every millisecond to look put its wake-ups into the client's READ
/// latencies (the guest's vCPUs are shared with Soft-RoCE's work).
fn wait_for_goodbye(link: &mut SessionLink, deadline: Instant) -> Result<()> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match link.wait_for_peer(left.min(GOODBYE_CHECK)) {
            PeerStatus::Alive if Instant::now() >= deadline => {
                return Err(Error::Protocol {
                    peer: link.peer(),
                    what: "the client neither finished nor left within --deadline".into(),
                });
            }
            PeerStatus::Alive => {}
            PeerStatus::Disconnected { code: 0 } => return Ok(()),
            PeerStatus::Disconnected { code } => {
                return Err(Error::Protocol {
                    peer: link.peer(),
                    what: format!("the client gave up (code {code})"),
                });
            }
            PeerStatus::Lost(err) => return Err(err),
        }
    }
}

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
struct Requests<'r> {
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
    fn new(
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

/// One connected QP with its CQ and buffer. The buffer holds `2 × size`
/// bytes: the first half is where the peer's WRITEs and SENDs land and what
/// its READs fetch, the second half is what ours send, so polling the first
/// half never sees our own marker.
struct Link<'r> {
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
    fn new(
        args: &Args,
        qp: QueuePair,
        cq: CompletionQueue,
        buffer: MemoryRegion,
        requests: Requests<'r>,
        sq_depth: u32,
        deadline: Instant,
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
            sq_depth: u64::from(sq_depth),
            patience: Patience::new(deadline),
        }
    }

    /// Polls the CQ once: send-queue completions free their slots, and the
    /// receives consumed are reposted. Returns the receives.
    #[inline]
    fn poll(&mut self) -> Result<u64> {
        let mut received = 0;
        for wc in self.cq.poll(&mut self.wcs)? {
            wc.ok()?;
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
    fn post_receive(&mut self) -> Result<()> {
        self.qp.post_recv_kept(&mut self.requests.landing)
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
        let request = &mut self.requests.op;
        request.set_wr_id(wr_id);
        request.set_flags(flags | self.requests.inline);
        self.qp.post_send_kept(request)
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
    fn read_lat(&mut self, clock: &Clock, total: u64, samples: &mut Vec<u64>) -> Result<()> {
        for _ in 0..total {
            let start = clock.now();
            self.qp.post_send_kept(&mut self.requests.op)?;
            self.patience.progressed();
            loop {
                if let Some(wc) = self.cq.poll(&mut self.wcs[..1])?.first() {
                    wc.ok()?;
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

    fn send_lat(&mut self, clock: &Clock, total: u64, samples: &mut Vec<u64>) -> Result<()> {
        for _ in 0..total {
            let start = clock.now();
            self.post_own_half()?;
            self.wait_for_receives(1)?;
            samples.push(clock.now().saturating_sub(start));
        }
        Ok(())
    }

    fn write_lat(&mut self, clock: &Clock, total: u64, samples: &mut Vec<u64>) -> Result<()> {
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
    fn echo(&mut self, total: u64) -> Result<()> {
        for _ in 0..total {
            self.wait_for_receives(1)?;
            self.post_own_half()?;
        }
        Ok(())
    }

    /// Server of WRITE latency: answers each WRITE with one, carrying its
    /// marker back.
    fn reflect(&mut self, total: u64) -> Result<()> {
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
    fn sink(&mut self, total: u64) -> Result<()> {
        self.wait_for_receives(total)
    }

    /// Client of bandwidth: `iters` requests, `batch` per doorbell, at most
    /// `tx_depth` outstanding, then waits for the last completion. The
    /// batch is built once and posted again; when `--signal` divides
    /// `--batch` every batch signals the same requests, so nothing in it
    /// changes between posts (perftest's post list with `--cq-mod`).
    fn stream(&mut self, args: &Args) -> Result<()> {
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
                        request.set_wr_id(wr_id);
                        request.set_flags(flags | self.requests.inline);
                    }
                }
                self.qp.post_send_batch_kept(&mut batch)?;
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
        request.set_wr_id(wr_id);
        request.set_flags(flags | self.requests.inline);
        request
    }
}
