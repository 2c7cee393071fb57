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
//! verbs layer alone ([`QueuePair::post_send`], [`CompletionQueue::poll`],
//! bounds-checked slices)? `tools/instr-count` counts it beside lat_bw (the
//! reactor) and perftest. The difference between it and lat_bw is what the
//! reactor's services cost: many connections on shared CQs, credits,
//! receive rings, vetted completions and handlers. A service with one
//! connection per core that needs none of them can be written this way.
//!
//! Both sides take the same `--op/--test/-s` (checked when they meet); the QP
//! and buffer descriptions go over TCP, as perftest's do. Latency: READ is
//! timed per READ; SEND is echoed by a SEND; WRITE is answered by a WRITE the
//! peer notices by polling the last byte of its buffer. SEND and WRITE report
//! half the round trip. Bandwidth streams WRITEs or SENDs with `--batch`
//! requests per doorbell, one in `--signal` signaled, at most `--tx-depth`
//! outstanding.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::ExitCode;
use std::time::{Duration, Instant};

mod common;

use clap::{Parser, ValueEnum};
use rdma_comm_core::verbs::{
    AccessFlags, CompletionQueue, Context, Gid, MemoryRegion, Mtu, QpConfig, QpEndpoint, QueuePair,
    RecvRequest, RemoteRegion, SendBatch, SendFlags, WcOpcode, WorkCompletion, WorkRequest,
};
use rdma_comm_core::{Error, Result};
use rdma_perf::{BandwidthStats, Clock, LATENCY_HEADER, LatencyStats, bandwidth_header};

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
/// The description each side sends: a tag, the test, the QP, the buffer.
const HELLO_LEN: usize = 4 + 2 + 8 + 4 + 4 + 16 + 2 + 1 + 8 + 8 + 4;
const HELLO_TAG: &[u8; 4] = b"VPF1";

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
    #[arg(short = 'n', long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..))]
    iters: u64,
    /// Unmeasured iterations first (latency).
    #[arg(long, default_value_t = 100)]
    warmup: u64,
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
    // A completion comes every --signal requests and frees --batch slots'
    // worth only then: either beyond --tx-depth would wait forever.
    if args.test == Test::Bw
        && (u64::from(args.batch) > args.tx_depth || args.signal > args.tx_depth)
    {
        eprintln!("verbs_perf: --batch and --signal must not exceed --tx-depth");
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
    let mut link = Link::open(args)?;
    let (mut control, peer_addr) = meet(args)?;
    let peer = link.exchange(args, &mut control, peer_addr)?;
    link.peer = peer;
    // Both QPs are ready (and the receives posted) before anyone sends.
    sync(&mut control)?;
    let size = args.size as usize;
    if args.server {
        match (args.test, args.op) {
            (Test::Lat, Op::Send) => link.echo(args.warmup + args.iters)?,
            (Test::Lat, Op::Write) => link.reflect(args.warmup + args.iters)?,
            (Test::Bw, Op::Send) => link.sink(args.iters)?,
            // READ and WRITE bandwidth: the peer's work reaches our memory only.
            _ => {}
        }
        // The client's word that it is done: our QP must outlive its work.
        let mut done = [0u8; 1];
        control
            .read_exact(&mut done)
            .map_err(os("waiting for the client's end"))?;
        return Ok(());
    }
    let clock = Clock::new();
    match args.test {
        Test::Lat => {
            let total = args.warmup + args.iters;
            let mut samples = Vec::with_capacity(total as usize);
            match args.op {
                Op::Read => link.read_lat(&clock, total, &mut samples)?,
                Op::Send => link.send_lat(&clock, total, &mut samples)?,
                Op::Write => link.write_lat(&clock, total, &mut samples)?,
            }
            let halve = u64::from(args.op != Op::Read);
            let ns: Vec<u64> = samples[args.warmup as usize..]
                .iter()
                .map(|&ticks| clock.nanos(0, ticks) >> halve)
                .collect();
            println!("{LATENCY_HEADER}");
            if let Some(stats) = LatencyStats::from_ns(size, &ns) {
                println!("{}", stats.row());
            }
        }
        Test::Bw => {
            let start = clock.now();
            link.stream(args)?;
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
    control
        .write_all(&[1])
        .map_err(os("telling the server the run is over"))?;
    Ok(())
}

/// Names what an operating-system call was for.
fn os(what: &'static str) -> impl FnOnce(io::Error) -> Error {
    move |source| Error::Os { what, source }
}

/// The control connection: the server accepts one client, the client
/// retries while the server comes up.
fn meet(args: &Args) -> Result<(TcpStream, SocketAddr)> {
    if args.server {
        let listener = TcpListener::bind(&args.listen).map_err(os("listening"))?;
        let (stream, peer) = listener.accept().map_err(os("accepting the client"))?;
        stream
            .set_nodelay(true)
            .map_err(os("setting TCP_NODELAY"))?;
        return Ok((stream, peer));
    }
    let addr = args.connect.as_deref().unwrap_or_default();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match TcpStream::connect(addr) {
            Ok(stream) => {
                stream
                    .set_nodelay(true)
                    .map_err(os("setting TCP_NODELAY"))?;
                let peer = stream
                    .peer_addr()
                    .map_err(os("reading the server's address"))?;
                return Ok((stream, peer));
            }
            Err(err) if Instant::now() >= deadline => return Err(os("connecting")(err)),
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

/// One byte each way.
fn sync(control: &mut TcpStream) -> Result<()> {
    control
        .write_all(&[0])
        .map_err(os("syncing with the peer"))?;
    let mut byte = [0u8; 1];
    control
        .read_exact(&mut byte)
        .map_err(os("syncing with the peer"))?;
    Ok(())
}

/// Fails a wait that has seen no progress for [`STALL`]; looks at the clock
/// only every [`SPINS_PER_CLOCK_CHECK`] calls.
struct Patience {
    spins: u32,
    since: Option<Instant>,
}

impl Patience {
    fn new() -> Self {
        Self {
            spins: 0,
            since: None,
        }
    }

    #[inline]
    fn spin(&mut self, what: &'static str) -> Result<()> {
        self.spins += 1;
        if self.spins < SPINS_PER_CLOCK_CHECK {
            return Ok(());
        }
        self.spins = 0;
        let since = *self.since.get_or_insert_with(Instant::now);
        if since.elapsed() >= STALL {
            let stalled = io::Error::new(io::ErrorKind::TimedOut, format!("nothing for {STALL:?}"));
            return Err(os(what)(stalled));
        }
        Ok(())
    }
}

/// One connected QP with its CQ and buffer. The buffer holds `2 × size`
/// bytes: the first half is where the peer's WRITEs and SENDs land and what
/// its READs fetch, the second half is what ours send, so polling the first
/// half never sees our own marker.
struct Link {
    qp: QueuePair,
    cq: CompletionQueue,
    buffer: MemoryRegion,
    peer: RemoteRegion,
    wcs: [WorkCompletion; POLL_BATCH],
    size: u32,
    signals: Signals,
    /// Send-queue slots in use: requests posted and not known complete.
    sq_used: u64,
    sq_depth: u64,
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

impl Link {
    fn open(args: &Args) -> Result<Self> {
        let ctx = Context::open_default(args.dev.device.as_deref())?;
        let pd = ctx.alloc_pd()?;
        let sq_depth = args.tx_depth.max(args.signal).max(u64::from(args.batch)) as u32;
        let cq = ctx.create_cq(sq_depth + RECV_DEPTH, None)?;
        let access =
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
        let buffer = pd.alloc_mr(2 * args.size as usize, access)?;
        let mut config = QpConfig::default();
        args.dev.apply(&mut config);
        config.max_send_wr = sq_depth;
        config.max_recv_wr = RECV_DEPTH;
        config.remote_access = AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
        let qp = pd.create_qp(&cq, &cq, &config)?;
        Ok(Self {
            qp,
            cq,
            buffer,
            peer: RemoteRegion::new(0, 0, 0),
            wcs: [WorkCompletion::default(); POLL_BATCH],
            size: args.size,
            signals: Signals {
                every: args.signal,
                unsignaled: 0,
            },
            sq_used: 0,
            sq_depth: u64::from(sq_depth),
        })
    }

    /// Sends our description, reads the peer's, checks both run the same
    /// test, and connects the QP (posting the receives first).
    fn exchange(
        &mut self,
        args: &Args,
        control: &mut TcpStream,
        peer_addr: SocketAddr,
    ) -> Result<RemoteRegion> {
        let ours = self.hello(args)?;
        control
            .write_all(&ours)
            .map_err(os("sending our QP and buffer"))?;
        let mut theirs = [0u8; HELLO_LEN];
        control
            .read_exact(&mut theirs)
            .map_err(os("reading the peer's QP and buffer"))?;
        let mismatch = |what: &str| Error::Protocol {
            peer: peer_addr,
            what: what.to_string(),
        };
        if theirs[..4] != HELLO_TAG[..] {
            return Err(mismatch("not a verbs_perf peer"));
        }
        // The test: --op, --test and -s.
        if theirs[4..14] != ours[4..14] {
            return Err(mismatch(
                "the peer runs another test (--op, --test or -s differ)",
            ));
        }
        let mut rest = &theirs[14..];
        let mut take = |len: usize| {
            let (head, tail) = rest.split_at(len);
            rest = tail;
            head
        };
        let qpn = u32::from_be_bytes(take(4).try_into().unwrap_or_default());
        let psn = u32::from_be_bytes(take(4).try_into().unwrap_or_default());
        let gid = Gid(take(16).try_into().unwrap_or_default());
        let lid = u16::from_be_bytes(take(2).try_into().unwrap_or_default());
        let mtu = Mtu::from_raw(u32::from(take(1)[0]));
        let addr = u64::from_be_bytes(take(8).try_into().unwrap_or_default());
        let len = u64::from_be_bytes(take(8).try_into().unwrap_or_default());
        let rkey = u32::from_be_bytes(take(4).try_into().unwrap_or_default());
        let endpoint = QpEndpoint {
            qpn,
            psn,
            gid,
            lid,
            mtu,
        };
        let region = RemoteRegion::new(addr, len, rkey);
        if args.op == Op::Send {
            for _ in 0..RECV_DEPTH {
                self.post_receive()?;
            }
        }
        self.qp.connect(&endpoint)?;
        Ok(region)
    }

    fn hello(&self, args: &Args) -> Result<[u8; HELLO_LEN]> {
        let endpoint = self.qp.endpoint();
        let region = self.buffer.remote()?;
        let mut out = [0u8; HELLO_LEN];
        let mut at = 0;
        let mut put = |bytes: &[u8]| {
            out[at..at + bytes.len()].copy_from_slice(bytes);
            at += bytes.len();
        };
        put(HELLO_TAG);
        put(&[args.op as u8, args.test as u8]);
        put(&u64::from(args.size).to_be_bytes());
        put(&endpoint.qpn.to_be_bytes());
        put(&endpoint.psn.to_be_bytes());
        put(&endpoint.gid.0);
        put(&endpoint.lid.to_be_bytes());
        put(&[endpoint.mtu as u8]);
        put(&region.addr().to_be_bytes());
        put(&region.len().to_be_bytes());
        put(&region.rkey().to_be_bytes());
        Ok(out)
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
        let landing = self.buffer.slice(0, self.size as usize)?;
        self.qp.post_recv(RecvRequest::new(0, landing)?)
    }

    /// Polls until a send-queue slot is free.
    #[inline]
    fn wait_for_room(&mut self) -> Result<()> {
        let mut patience = Patience::new();
        while self.sq_used >= self.sq_depth {
            self.poll()?;
            patience.spin("waiting for send completions")?;
        }
        Ok(())
    }

    /// Posts one SEND or WRITE of our second half (inline when it fits).
    #[inline]
    fn post_own_half(&mut self, op: Op) -> Result<()> {
        self.wait_for_room()?;
        let (wr_id, mut flags) = self.signals.next(false);
        self.sq_used += 1;
        let size = self.size as usize;
        if self.size <= self.qp.max_inline_data() {
            flags |= SendFlags::INLINE;
        }
        let local = self.buffer.slice(size, size)?;
        let request = match op {
            Op::Send => WorkRequest::send(wr_id, local),
            _ => WorkRequest::write(wr_id, local, self.peer.slice(0, u64::from(self.size))?)?,
        };
        self.qp.post_send(request.with_flags(flags))
    }

    /// Polls until `want` receives have come.
    #[inline]
    fn wait_for_receives(&mut self, want: u64) -> Result<()> {
        let mut got = 0;
        let mut patience = Patience::new();
        while got < want {
            got += self.poll()?;
            patience.spin("waiting for a message")?;
        }
        Ok(())
    }

    /// Spins until the last byte of our landing half is `marker`.
    #[inline]
    fn wait_for_marker(&mut self, marker: u8) -> Result<()> {
        let at = self.size as usize - 1;
        let mut patience = Patience::new();
        while self.buffer.load_byte(at) != Some(marker) {
            patience.spin("waiting for the peer's WRITE")?;
        }
        Ok(())
    }

    /// Iteration `i`'s marker: never 0, so a fresh buffer differs.
    fn marker(i: u64) -> u8 {
        (i % 255) as u8 + 1
    }

    fn read_lat(&mut self, clock: &Clock, total: u64, samples: &mut Vec<u64>) -> Result<()> {
        let size = self.size as usize;
        let remote = self.peer.slice(0, u64::from(self.size))?;
        for _ in 0..total {
            let start = clock.now();
            self.sq_used += 1;
            let local = self.buffer.slice(0, size)?;
            self.qp
                .post_send(WorkRequest::read(1, local, remote)?.signaled())?;
            let mut patience = Patience::new();
            while self.sq_used > 0 {
                self.poll()?;
                patience.spin("waiting for a READ")?;
            }
            samples.push(clock.now().saturating_sub(start));
        }
        Ok(())
    }

    fn send_lat(&mut self, clock: &Clock, total: u64, samples: &mut Vec<u64>) -> Result<()> {
        for _ in 0..total {
            let start = clock.now();
            self.post_own_half(Op::Send)?;
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
            self.post_own_half(Op::Write)?;
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
            self.post_own_half(Op::Send)?;
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
            self.post_own_half(Op::Write)?;
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
    /// `tx_depth` outstanding, then waits for the last completion.
    fn stream(&mut self, args: &Args) -> Result<()> {
        let size = self.size as usize;
        let remote = self.peer.slice(0, u64::from(self.size))?;
        let depth = args.tx_depth.min(self.sq_depth);
        let inline = if self.size <= self.qp.max_inline_data() {
            SendFlags::INLINE
        } else {
            SendFlags::empty()
        };
        let mut posted = 0;
        let mut patience = Patience::new();
        while posted < args.iters || self.sq_used > 0 {
            let take = u64::from(args.batch).min(args.iters - posted);
            if take > 0 && self.sq_used + take <= depth {
                let mut batch: SendBatch<'_, MAX_BATCH> = SendBatch::new();
                for k in 0..take {
                    let (wr_id, flags) = self.signals.next(posted + k + 1 == args.iters);
                    let local = self.buffer.slice(size, size)?;
                    let request = match args.op {
                        Op::Send => WorkRequest::send(wr_id, local),
                        _ => WorkRequest::write(wr_id, local, remote)?,
                    };
                    // Never full: `take` is at most MAX_BATCH.
                    let _ = batch.push(request.with_flags(flags | inline));
                }
                self.qp.post_send_batch(&mut batch)?;
                posted += take;
                self.sq_used += take;
                patience = Patience::new();
                continue;
            }
            self.poll()?;
            patience.spin("waiting for send completions")?;
        }
        Ok(())
    }
}
