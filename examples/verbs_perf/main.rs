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
//! verbs layer alone ([`QueuePair::post_send`] of requests and batches
//! bounds-checked once and posted again, as perftest posts its prebuilt
//! requests;
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

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[path = "../common/mod.rs"]
mod common;
mod loops;

use clap::{Parser, ValueEnum};
use rdma_comm_core::session::{
    ClientConfig, ClientSession, CqChoice, Endpoint, Export, PeerStatus, QpSpec, ServerConfig,
    ServerSession, SessionLink,
};
use rdma_comm_core::verbs::{
    AccessFlags, CompletionQueue, Context, MemoryRegion, ProtectionDomain, QpConfig, QueuePair,
    RemoteRegion,
};
use rdma_comm_core::{Error, Result};
use rdma_perf::{BandwidthStats, Clock, LATENCY_HEADER, LatencyStats, bandwidth_header};

use loops::{Link, Requests};

/// Most iterations or messages of a run (a latency run keeps a sample of
/// 8 bytes per iteration).
const MAX_ITERS: u64 = 100_000_000;
/// Largest message (`-s`): 1 GiB, the buffer being twice that.
const MAX_SIZE: u32 = 1 << 30;
/// Receives kept posted (SEND tests).
const RECV_DEPTH: u32 = 128;
/// Most requests per doorbell.
const MAX_BATCH: usize = 32;
/// The goodbye's code when the two sides were asked for different tests.
const OTHER_TEST: u16 = 1;
/// Longest a server with nothing to do sleeps on the control connection
/// before it looks at the deadline again.
const GOODBYE_CHECK: Duration = Duration::from_secs(1);
/// What a peer may do with the buffer it is given.
const REMOTE_ACCESS: AccessFlags = AccessFlags::REMOTE_WRITE.union(AccessFlags::REMOTE_READ);

/// Latency and bandwidth over the verbs layer alone, perftest's way.
#[derive(Parser, Debug)]
#[command(version)]
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
    /// Message size in bytes, 1 B to 1 GiB.
    #[arg(short = 's', long, default_value_t = 8, value_parser = common::range(1u32, MAX_SIZE))]
    size: u32,
    /// Measured iterations (latency) or messages (bandwidth), 1 to 10^8.
    #[arg(short = 'n', long, default_value_t = 1000, value_parser = common::range(1u64, MAX_ITERS))]
    iters: u64,
    /// Unmeasured iterations first (latency), 0 to 10^8.
    #[arg(long, default_value_t = 100, value_parser = common::range(0u64, MAX_ITERS))]
    warmup: u64,
    /// Seconds the whole run may take, from the handshake on (either side
    /// gives up then: a peer that keeps up a trickle holds it no longer);
    /// 1 s to 30 days.
    #[arg(long, default_value_t = 3600, value_parser = common::range(1u64, 86_400 * 30))]
    deadline: u64,
    /// Bandwidth: requests per doorbell, 1 to 32.
    #[arg(long, default_value_t = 16, value_parser = common::range(1u32, MAX_BATCH as u32))]
    batch: u32,
    /// One request in this many is signaled, 1 to 1024.
    #[arg(long, default_value_t = 16, value_parser = common::range(1u64, 1024))]
    signal: u64,
    /// Bandwidth: most requests outstanding (perftest's -t), 1 to 4096.
    #[arg(short = 't', long, default_value_t = 128, value_parser = common::range(1u64, 4096))]
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
    common::init_logging();
    let mut args: Args = common::parse("verbs_perf");
    if let Err(refusal) = check(&mut args) {
        return refusal.exit("verbs_perf");
    }
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("verbs_perf: {err}");
            ExitCode::FAILURE
        }
    }
}

/// Checks what clap cannot before anything is opened: the flags go
/// together, the address resolves and the key is read.
fn check(args: &mut Args) -> std::result::Result<(), common::Refusal> {
    if args.test == Test::Bw && args.op == Op::Read {
        return Err(common::Refusal::of("--op read", "has a latency test only"));
    }
    // A completion comes every --signal requests. Up to --signal - 1
    // unsignaled ones can be outstanding with no completion to come, and
    // the next batch must still fit beside them, or the loop waits forever;
    // when --signal divides --batch every batch ends signaled and needs
    // only to fit itself.
    let batch = u64::from(args.batch);
    let needed = if batch.is_multiple_of(args.signal) {
        batch
    } else {
        batch + args.signal - 1
    };
    if args.test == Test::Bw && needed > args.tx_depth {
        return Err(common::Refusal::new(
            "--tx-depth",
            args.tx_depth,
            format!(
                "must be at least {needed} with --batch {} and --signal {} (--batch, plus \
                 --signal - 1 unless --signal divides --batch)",
                args.batch, args.signal
            ),
        ));
    }
    if args.server {
        common::address("--listen", &args.listen)?;
    } else {
        common::address("--connect", args.connect.as_deref().unwrap_or_default())?;
    }
    args.auth.load()
}

/// The send queue's depth: room for `-t` requests in flight, a signal
/// interval and a batch.
fn sq_depth(args: &Args) -> u32 {
    args.tx_depth.max(args.signal).max(u64::from(args.batch)) as u32
}

fn run(args: &Args) -> Result<()> {
    let ctx = Context::open_default(args.dev.device.as_deref())?;
    let pd = ctx.alloc_pd()?;
    let sq_depth = sq_depth(args);
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
    let mut run = Link::new(args, qp, cq, buffer, requests, deadline, link.peer());
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
            // Half round trips for SEND and WRITE; only the columns are
            // converted from ticks.
            let halve = if args.op == Op::Read { 1.0 } else { 2.0 };
            let measured = &mut samples[args.warmup as usize..];
            println!("{LATENCY_HEADER}");
            if let Some(stats) =
                LatencyStats::from_ticks(size, measured, clock.ns_per_tick() / halve)
            {
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
        let export = buffer.registration().clone();
        let mut config = ServerConfig {
            qp,
            cq: CqChoice::Shared(cq.shared()),
            max_peers: Some(1),
            max_qps: 1,
            insecure_open: auth_key.is_none(),
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
        common::report_refusals("verbs_perf", &mut config);
        let server = ServerSession::bind(&args.listen, pd, config)?;
        return server
            .accept()
            .ok_or(Error::InvalidArgument("the listener stopped"));
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
