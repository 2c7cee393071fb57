//! Latency and bandwidth through the reactor, printed the way perftest prints.
//!
//! ```text
//! lat_bw --server --op write --test lat [--size 8 | --all]
//! lat_bw --connect HOST:7474 --op write --test lat [--size 8 | --all] [--iters 1000]
//! lat_bw --connect HOST:7474 --op send --test bw --size 64 --batch 16 --signal 16 [--report-gbits]
//! ```
//!
//! Both sides take the same `--op/--test/--size/--all/--iters` flags, as with
//! perftest. The client prints the table (and `--json FILE` writes it).
//!
//! `--direct` (on both sides) runs on a direct connection
//! (`Reactor::add_direct`): the handler posts requests built once on its QP,
//! perftest's way, and the reactor only polls and routes. `--spin` (with
//! `--direct`, on both sides) runs a latency test's loop on the CQs the
//! reactor lends from `on_idle` (`Ctx::spin`).
//!
//! `--reactors N` (on both sides) runs N streams at once on a runtime of N
//! reactors, each pinned to a core of its own (`--cores LIST`, or the NIC's
//! NUMA node first): the client connects stream i as `stream-i` and adopts it
//! on its reactor i, the server places it on its reactor i; the client
//! prints each stream's row and, for bandwidth, their sum.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

#[path = "../common/mod.rs"]
mod common;
mod datagram;
#[path = "../common/plot.rs"]
mod plot;
mod report;
mod streams;

use clap::{Parser, ValueEnum};
use rdma_comm_core::reactor::*;
use rdma_comm_core::runtime::*;
use rdma_comm_core::session::*;
use rdma_comm_core::verbs::*;
use rdma_perf::*;

/// Latency and bandwidth benchmark with perftest-compatible output.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Wait for the client.
    #[arg(long, conflicts_with = "connect")]
    server: bool,
    /// Address to listen on (server).
    #[arg(long, default_value = "0.0.0.0:7474")]
    listen: String,
    /// Server to connect to (client).
    #[arg(long, value_name = "HOST:PORT", required_unless_present = "server")]
    connect: Option<String>,
    /// Operation.
    #[arg(long, value_enum, default_value_t = OpArg::Write)]
    op: OpArg,
    /// Latency or bandwidth.
    #[arg(long = "test", value_enum, default_value_t = TestArg::Lat)]
    test: TestArg,
    /// Message size in bytes, 1 B to 8 MiB.
    #[arg(short = 's', long, default_value_t = 2, value_parser = common::range(1usize, MAX_SIZE))]
    size: usize,
    /// Every power of two from 1 B to 8 MiB (perftest's -a, which starts at 2 B, plus 1 B).
    #[arg(short = 'a', long)]
    all: bool,
    /// Measured iterations per size, at least 1. A latency client keeps
    /// every sample (8 B each) for perftest's columns: with --warmup, over
    /// all streams, at most 33554432 (256 MiB).
    #[arg(short = 'n', long, default_value_t = 1000, value_parser = common::at_least(1u64))]
    iters: u64,
    /// Bandwidth: most requests outstanding at once (perftest's -t, whose
    /// default for bandwidth tests is 128); 0: as many as the send queue
    /// and the peer's credits allow.
    #[arg(short = 't', long, default_value_t = 128)]
    tx_depth: u64,
    /// Unmeasured iterations first (latency).
    #[arg(long, default_value_t = 100)]
    warmup: u64,
    /// Report bandwidth in Gb/s.
    #[arg(long)]
    report_gbits: bool,
    /// Also write the results as JSON to this file (client).
    #[arg(long, value_name = "FILE")]
    json: Option<String>,
    /// Also draw latency or bandwidth against message size into this SVG.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<String>,
    #[command(flatten)]
    dev: common::DeviceArgs,
    #[command(flatten)]
    auth: common::AuthArgs,
    #[command(flatten)]
    transport: common::TransportArgs,
    /// The transport service (both sides): reliable connections, or
    /// unreliable datagrams on a datagram endpoint of the reactor (SEND
    /// only, one stream, up to the port's MTU; as ib_send_lat and
    /// ib_send_bw with -c UD).
    #[arg(long = "transport", value_enum, default_value_t = ServiceArg::Rc)]
    service: ServiceArg,
    #[command(flatten)]
    reactor: common::ReactorArgs,
    /// Direct connections (both sides): the handler posts requests built
    /// once on its QP itself and counts its completions, as perftest does;
    /// the reactor only polls and routes (no staging, credits or reposts).
    /// send, write and read; one stream.
    #[arg(long)]
    direct: bool,
    /// With --direct, latency (both sides): the handler's loop spins on the
    /// reactor's CQs (`Ctx::spin`), posting and polling with nothing of the
    /// reactor's in between, perftest's loop inside the reactor.
    #[arg(long, requires = "direct")]
    spin: bool,
    /// Pin the reactor to this CPU (default: a core near the NIC; the server
    /// takes the first, the client the second).
    #[arg(long, conflicts_with_all = ["no_pin", "cores"])]
    core: Option<usize>,
    /// Leave the reactor thread unpinned.
    #[arg(long)]
    no_pin: bool,
    #[command(flatten)]
    runtime: common::RuntimeArgs,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum OpArg {
    Send,
    Write,
    WriteImm,
    Read,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum ServiceArg {
    Rc,
    Ud,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum TestArg {
    Lat,
    Bw,
}

const MAX_SIZE: usize = 8 << 20;

/// Most latency samples a client holds at once, warmups included, over
/// all its streams: 8 B each, 256 MiB in all. perftest's columns (the
/// typical value, the standard deviation) come from every sample, so a
/// longer run is refused rather than summarised.
const MAX_LATENCY_SAMPLES: u64 = 32 << 20;

/// Messages from this size up are far apart even at line rate (an 8 MiB
/// message is about 0.7 ms at 100 Gb/s) with many queued behind each, so a
/// bandwidth client that sleeps between completions loses nothing.
const SLEEPY_BW_SIZE: usize = 1 << 20;

/// How the reactor waits at `size`: as asked, else busy polling, except a
/// bandwidth client of messages of at least [`SLEEPY_BW_SIZE`], which
/// sleeps on its completion channel. It has nothing to do between
/// completions, and a spinning thread pinned to a core stands in the way
/// of a software device's deferred work on that core: with Soft-RoCE a
/// large READ's responses are built in softirq work that the busy client
/// then shares its core with (8 MiB READs at 0.95 of perftest's, whose
/// unpinned client the scheduler moves off that core; 0.99 sleeping).
fn event_mode(args: &Args, size: usize) -> common::EventArg {
    let default = if args.test == TestArg::Bw && !args.server && size >= SLEEPY_BW_SIZE {
        common::EventArg::Blocking
    } else {
        common::EventArg::Busy
    };
    args.reactor.event_mode_or(default)
}

/// The event mode over every size of the run, for the banner and report.
fn event_mode_label(args: &Args) -> String {
    let sizes = sizes(args);
    let first = event_mode(args, sizes[0]);
    match sizes.iter().find(|&&size| event_mode(args, size) != first) {
        Some(&from) => format!("{first:?} ({:?} from {from} B)", event_mode(args, from)),
        None => format!("{first:?}"),
    }
}

fn main() -> ExitCode {
    common::init_logging();
    let mut args: Args = common::parse("lat_bw");
    if let Err(refusal) = check(&mut args) {
        return refusal.exit("lat_bw");
    }
    let args = args_of(args);
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("lat_bw: {err}");
            ExitCode::FAILURE
        }
    }
}

/// Checks what clap cannot before anything is opened: the address
/// resolves, the key is read, the cores are usable, the flags go together
/// and a latency client can hold its samples.
fn check(args: &mut Args) -> Result<(), common::Refusal> {
    use common::Refusal;
    let streams = u64::from(args.runtime.reactors);
    if args.spin && args.test == TestArg::Bw {
        return Err(Refusal::of(
            "--spin",
            "runs latency tests: a bandwidth run keeps its queue full from its completions",
        ));
    }
    if args.direct && (streams > 1 || args.op == OpArg::WriteImm) {
        return Err(Refusal::of(
            "--direct",
            "measures send, write and read on one stream",
        ));
    }
    if args.service == ServiceArg::Ud
        && (args.op != OpArg::Send || args.direct || streams > 1 || args.all)
    {
        return Err(Refusal::of(
            "--transport",
            "ud measures SEND on one stream, one size at a time (not --direct, --reactors or --all)",
        ));
    }
    if args.server {
        common::address("--listen", &args.listen)?;
    } else {
        common::address("--connect", args.connect.as_deref().unwrap_or_default())?;
        let per_stream = args.iters.saturating_add(args.warmup);
        if args.test == TestArg::Lat && per_stream.saturating_mul(streams) > MAX_LATENCY_SAMPLES {
            return Err(Refusal::new(
                "--iters",
                args.iters,
                format!(
                    "a latency client keeps every sample: --iters plus --warmup ({}), times \
                     the streams ({streams}), must be at most {MAX_LATENCY_SAMPLES}",
                    args.warmup
                ),
            ));
        }
    }
    if let Some(core) = args.core {
        common::core_list("--core", &core.to_string(), 1)?;
    }
    args.runtime.check(args.no_pin)?;
    args.auth.load()
}

fn sizes(args: &Args) -> Vec<usize> {
    if args.all {
        (0..=23).map(|shift| 1usize << shift).collect()
    } else {
        vec![args.size]
    }
}

fn spec(args: &Args, size: usize) -> PerfSpec {
    let op = match args.op {
        OpArg::Send => PerfOp::Send,
        OpArg::Write => PerfOp::Write,
        OpArg::WriteImm => PerfOp::WriteImm,
        OpArg::Read => PerfOp::Read,
    };
    PerfSpec {
        op,
        size,
        iters: args.iters,
        warmup: args.warmup,
        batch: args.reactor.batch_or(16),
        tx_depth: args.tx_depth,
    }
}

/// Slots only matter for SEND; keep the receive ring under ~64 MiB.
fn reactor_config(args: &Args, size: usize) -> ReactorConfig {
    let slot_size = if args.op == OpArg::Send {
        size + 64
    } else {
        64
    };
    let depth = ((64 << 20) / slot_size).clamp(8, 256) as u32;
    // A server that only serves one-sided READs or WRITEs has nothing to poll
    // for but the done marker: let it sleep, as perftest's does, so it leaves
    // the CPU to the NIC (with Soft-RoCE the NIC *is* the CPU).
    let passive = args.server
        && ((args.test == TestArg::Lat && args.op == OpArg::Read)
            || (args.test == TestArg::Bw && args.op != OpArg::Send));
    let base = ReactorConfig::default();
    let config = ReactorConfig {
        event_mode: if passive {
            EventMode::Blocking
        } else {
            event_mode(args, size).into()
        },
        slot_size,
        recv_depth: depth,
        send_slots: depth.min(128).max(2 * args.reactor.signal_interval),
        sq_depth: 512,
        signal_interval: args.reactor.signal_interval,
        repost_batch: args.reactor.repost_batch_or(base.repost_batch),
        ..base
    };
    // A direct connection takes its QP's whole queues from the CQ's room,
    // and a provider may round the QP's depths up.
    let config = ReactorConfig {
        peer_check_interval: Some(Duration::from_millis(200)),
        ..config.absorbing(if args.direct { 2 } else { 1 })
    };
    // Nor does it wake on a timer: its peer's completions and control
    // connection wake it. (Woken every 10 ms, it put its wake-ups into the
    // client's READ latencies: the guest's vCPUs also run Soft-RoCE.)
    if passive {
        config.sleeping_until_woken()
    } else {
        config
    }
}

/// One size's result on one stream.
enum Row {
    Latency(LatencyStats),
    Bandwidth(BandwidthStats),
    /// The server side, which measures nothing.
    Served,
}

fn run(args: &'static Args) -> rdma_comm_core::Result<()> {
    let ctx = Context::open_default(args.dev.device.as_deref())?;
    let pd = ctx.alloc_pd()?;
    let streams = usize::from(args.runtime.reactors);
    let rows: Vec<Vec<Row>> = if streams == 1 {
        pin_one(args, &ctx)?;
        if !args.server {
            report::print_banner(args, &ctx)?;
        }
        vec![measure(args, &pd, endpoint_addr(args))?]
    } else {
        let choice = args.runtime.core_choice(args.no_pin)?;
        if !args.server {
            report::print_banner(args, &ctx)?;
        }
        let mut per_size = Vec::new();
        for (i, size) in sizes(args).into_iter().enumerate() {
            per_size.push(streams::measure_on_runtime(
                args,
                &pd,
                streams,
                &choice,
                size,
                i == 0,
            )?);
        }
        // By stream, then size, as the single-stream path returns them.
        (0..streams)
            .map(|stream| {
                per_size
                    .iter_mut()
                    .map(|rows| std::mem::replace(&mut rows[stream], Row::Served))
                    .collect()
            })
            .collect()
    };
    if args.server {
        return Ok(());
    }
    let mut results = Vec::new();
    for (i, size) in sizes(args).into_iter().enumerate() {
        let mut total: Option<BandwidthStats> = None;
        for (stream, stream_rows) in rows.iter().enumerate() {
            let label = if streams > 1 {
                format!("stream {stream}: ")
            } else {
                String::new()
            };
            match stream_rows.get(i) {
                Some(Row::Latency(stats)) => {
                    println!("{label}{}", stats.row());
                    results.push(serde_json::json!({
                        "stream": stream, "bytes": size, "iterations": stats.iters, "t_min_us": stats.min_us, "t_max_us": stats.max_us,
                        "t_typical_us": stats.typical_us, "t_avg_us": stats.avg_us, "t_stdev_us": stats.stdev_us,
                        "p99_us": stats.p99_us, "p999_us": stats.p999_us,
                    }));
                }
                Some(Row::Bandwidth(stats)) => {
                    println!("{label}{}", stats.row(args.report_gbits));
                    results.push(serde_json::json!({
                        "stream": stream, "bytes": size, "iterations": stats.iters, "bw_peak_mib_s": stats.peak_bytes_per_sec / 1048576.0,
                        "bw_avg_mib_s": stats.avg_bytes_per_sec / 1048576.0, "msg_rate_mpps": stats.msg_rate_mpps,
                    }));
                    let sum = total.get_or_insert(BandwidthStats {
                        bytes: stats.bytes,
                        iters: 0,
                        peak_bytes_per_sec: 0.0,
                        avg_bytes_per_sec: 0.0,
                        msg_rate_mpps: 0.0,
                    });
                    sum.iters += stats.iters;
                    sum.peak_bytes_per_sec += stats.peak_bytes_per_sec;
                    sum.avg_bytes_per_sec += stats.avg_bytes_per_sec;
                    sum.msg_rate_mpps += stats.msg_rate_mpps;
                }
                _ => {}
            }
        }
        if let (Some(total), true) = (total, streams > 1) {
            println!("all {streams} streams: {}", total.row(args.report_gbits));
        }
    }
    println!("{}", "-".repeat(87));
    if let Some(path) = &args.plot {
        report::plot(path, args, ctx.name(), &results).map_err(|what| {
            rdma_comm_core::Error::Os {
                what: "drawing the plot",
                source: std::io::Error::other(what),
            }
        })?;
    }
    if let Some(path) = &args.json {
        let doc = serde_json::json!({
            "op": format!("{:?}", args.op), "test": format!("{:?}", args.test), "device": ctx.name(),
            "event_mode": event_mode_label(args), "signal_interval": args.reactor.signal_interval,
            "batch": args.reactor.batch_or(16), "streams": streams, "results": results,
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc).unwrap_or_default()).map_err(
            |source| rdma_comm_core::Error::Os {
                what: "writing the JSON report",
                source,
            },
        )?;
    }
    Ok(())
}

/// The arguments, for stream threads (parsed and checked once; they live
/// as long as the process).
fn args_of(args: Args) -> &'static Args {
    static ARGS: std::sync::OnceLock<Args> = std::sync::OnceLock::new();
    ARGS.get_or_init(|| args)
}

/// Pins the one reactor thread: `--no-pin`, `--core`, the first of
/// `--cores`, or a core near the NIC (the server takes the first, the
/// client the second). Says where, in words, when the NIC's node was no
/// guide.
fn pin_one(args: &Args, ctx: &Context) -> rdma_comm_core::Result<()> {
    let listed = match &args.runtime.cores {
        Some(list) => parse_core_list(list)?.first().copied(),
        None => None,
    };
    let placement = match (args.core.or(listed), args.no_pin) {
        (_, true) => pin_current_thread(ctx.name(), CorePreference::Unpinned, 0),
        (Some(core), _) => pin_current_thread(ctx.name(), CorePreference::Core(core), 0),
        (None, _) => pin_current_thread(
            ctx.name(),
            CorePreference::NearDevice,
            usize::from(!args.server),
        ),
    };
    if let Some(reason) = &placement.fallback {
        match placement.core {
            Some(core) => {
                eprintln!("lat_bw: the reactor runs on core {core} ({reason}, so any core will do)")
            }
            None => eprintln!("lat_bw: the reactor is not pinned ({reason}, and pinning failed)"),
        }
    }
    Ok(())
}

/// Where the client connects, or the single-stream server listens.
fn endpoint_addr(args: &Args) -> &str {
    match &args.connect {
        Some(addr) if !args.server => addr.as_str(),
        _ => args.listen.as_str(),
    }
}

/// Runs every size on one stream (listening on or connecting to `addr`).
fn measure(args: &Args, pd: &ProtectionDomain, addr: &str) -> rdma_comm_core::Result<Vec<Row>> {
    let mut rows = Vec::new();
    if args.service == ServiceArg::Ud {
        return Ok(vec![datagram::measure_ud(args, pd, addr, args.size)?]);
    }
    for size in sizes(args) {
        let spec = spec(args, size);
        let mut reactor: Reactor<PerfHandler> = Reactor::new(pd, reactor_config(args, size))?;
        // Exported through a window per peer: no REMOTE_* rights of its own.
        let buffer = pd.alloc_mr(2 * size, AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND)?;
        let access = AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
        let endpoint = if args.server {
            let mut config = reactor.server_config(access);
            args.dev.apply(&mut config.qp);
            config.max_peers = Some(1);
            args.auth.secure(&mut config)?;
            config.transport = args.transport.transport();
            let export = buffer.registration().clone();
            config.exports = Some(Arc::new(move |_, _: &ProtectionDomain| {
                Ok(vec![Export::new(1, "perf", export.clone(), access)])
            }));
            common::report_refusals("lat_bw", &mut config);
            let server = ServerSession::bind(addr, pd, config)?;
            server
                .accept()
                .ok_or(rdma_comm_core::Error::InvalidArgument(
                    "the listener stopped",
                ))?
        } else {
            let mut spec = reactor.qp_spec_with_access("perf", access);
            args.dev.apply(&mut spec.qp);
            let mut config = ClientConfig::new(vec![spec])
                .with_exports(vec![Export::new(1, "perf", &buffer, access)]);
            config.connect_deadline = Duration::from_secs(60);
            config.auth_key = args.auth.key()?;
            config.transport = args.transport.transport();
            ClientSession::connect(addr, pd, &config)?
        };
        let peer =
            endpoint
                .remote_region("perf")
                .ok_or_else(|| rdma_comm_core::Error::Protocol {
                    peer: endpoint.peer(),
                    what: "peer exported no \"perf\" region".into(),
                })?;
        let buffers = PerfBuffers { buffer, peer };
        let handler = handler_for(args, spec, buffers);
        let peer_addr = endpoint.peer();
        let session = if args.direct {
            reactor.add_direct(endpoint, handler)?
        } else {
            reactor.add(endpoint, handler)?
        };
        // The reactor watches the peer's control connection, so a vanished
        // peer ends the run with an error (the handler's) instead of a hang.
        reactor.run()?;
        let (_link, handler) =
            reactor
                .remove(session)
                .ok_or(rdma_comm_core::Error::InvalidArgument(
                    "the session vanished from its reactor",
                ))?;
        rows.push(row_of(handler, peer_addr)?);
    }
    Ok(rows)
}

/// What a finished handler measured (or why it failed).
fn row_of(handler: PerfHandler, peer: std::net::SocketAddr) -> rdma_comm_core::Result<Row> {
    if let Some(failure) = handler.failure() {
        return Err(rdma_comm_core::Error::Protocol {
            peer,
            what: failure.to_string(),
        });
    }
    Ok(match handler {
        PerfHandler::Latency(client) => match client.into_latency_stats() {
            Some(stats) => Row::Latency(stats),
            None => Row::Served,
        },
        PerfHandler::Rate(sender) => Row::Bandwidth(sender.stats()),
        PerfHandler::DirectClient(client) if client.is_bandwidth() => {
            Row::Bandwidth(client.stats())
        }
        PerfHandler::DirectClient(client) => match client.into_latency_stats() {
            Some(stats) => Row::Latency(stats),
            None => Row::Served,
        },
        _ => Row::Served,
    })
}

/// The role a handler plays, from the flags.
fn handler_for(args: &Args, spec: PerfSpec, buffers: PerfBuffers) -> PerfHandler {
    let bandwidth = args.test == TestArg::Bw;
    if args.direct {
        return match args.server {
            true if args.spin => {
                PerfHandler::DirectServer(DirectServer::new(spec, buffers, bandwidth).spinning())
            }
            true => PerfHandler::DirectServer(DirectServer::new(spec, buffers, bandwidth)),
            false if bandwidth => PerfHandler::DirectClient(DirectClient::bandwidth(spec, buffers)),
            false if args.spin => {
                PerfHandler::DirectClient(DirectClient::latency(spec, buffers).spinning())
            }
            false => PerfHandler::DirectClient(DirectClient::latency(spec, buffers)),
        };
    }
    match (args.server, args.test) {
        (true, TestArg::Lat) => PerfHandler::Reflect(Reflector::new(spec, buffers)),
        (true, TestArg::Bw) => PerfHandler::Sink(RateSink::default()),
        (false, TestArg::Lat) => PerfHandler::Latency(LatencyClient::new(spec, buffers)),
        (false, TestArg::Bw) => PerfHandler::Rate(RateSender::new(spec, buffers)),
    }
}
