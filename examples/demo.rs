//! The main job's demonstration (`tools/run` with no arguments): a server
//! runtime of pinned reactors and several clients exchanging verified
//! messages; it prints where each reactor runs, the round-trip percentiles,
//! the message rate, what each reactor did, and the device line.
//!
//! ```text
//! demo [--reactors 2] [--clients 4] [--seconds 5] [--size 256] [--window 8] [--event-mode blocking]
//! ```
//!
//! The server echoes every SEND straight out of its receive slot; each
//! client keeps `--window` SENDs in flight for `--seconds` and checks every
//! byte of every echo. It exits non-zero if any message was lost or altered.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::mpsc;
use std::time::{Duration, Instant};

mod common;
#[path = "common/rtt.rs"]
mod rtt;

use clap::Parser;
use rdma_comm_core::Error;
use rdma_comm_core::reactor::*;
use rdma_comm_core::runtime::*;
use rdma_comm_core::session::*;
use rdma_comm_core::verbs::*;
use rdma_perf::Clock;
use rtt::RttRecorder;

/// A runtime of pinned reactors serving verified traffic from several clients.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Client sessions, 1 to 1024.
    #[arg(long, default_value_t = 4, value_parser = common::range(1usize, MAX_CLIENTS))]
    clients: usize,
    /// How long the clients send, 1 s to a day.
    #[arg(long, default_value_t = 5, value_parser = common::range(1u64, 86_400))]
    seconds: u64,
    /// Payload bytes per message, 1 B to 1 MiB.
    #[arg(long, default_value_t = 256, value_parser = common::range(1usize, MAX_SIZE))]
    size: usize,
    /// Messages each client keeps in flight, 1 to 64.
    #[arg(long, default_value_t = 8, value_parser = common::range(1usize, MAX_WINDOW))]
    window: usize,
    #[command(flatten)]
    dev: common::DeviceArgs,
    /// How the reactors wait (blocking leaves cores to the clients).
    #[arg(long, value_enum, default_value_t = common::EventArg::Blocking)]
    event_mode: common::EventArg,
    /// Server reactors, one core each (default: 2, or 1 on a one-core
    /// machine).
    #[arg(long, value_parser = common::range(1u16, u16::MAX))]
    reactors: Option<u16>,
    /// Pin the server's reactor i to the i-th core of this list.
    #[arg(long, value_name = "LIST")]
    cores: Option<String>,
}

/// Most client sessions (`--clients`).
const MAX_CLIENTS: usize = 1024;
/// Largest message (`--size`): 1 MiB.
const MAX_SIZE: usize = 1 << 20;
/// Most messages in flight per client (`--window`).
const MAX_WINDOW: usize = 64;

fn main() -> ExitCode {
    common::init_logging();
    let args: Args = common::parse("demo");
    if let Err(refusal) = check(&args) {
        return refusal.exit("demo");
    }
    match run(&args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(err) => {
            eprintln!("demo: {err}");
            ExitCode::FAILURE
        }
    }
}

/// The server's reactors: as asked, else 2 (1 on a one-core machine).
fn server_reactors(args: &Args) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    args.reactors.map_or(cores.min(2), usize::from)
}

/// Checks what clap cannot before anything is opened: the core list
/// names a usable core for each server reactor, or there are cores
/// enough for them.
fn check(args: &Args) -> Result<(), common::Refusal> {
    let reactors = server_reactors(args);
    match &args.cores {
        Some(list) => common::core_list("--cores", list, reactors).map(drop),
        None => common::check_reactor_count("--reactors", reactors),
    }
}

/// The payload of message `seq` of client `client`.
fn fill(buf: &mut [u8], client: usize, seq: u64) {
    let seed = seq.wrapping_mul(0x9e37_79b9) ^ (client as u64) << 40;
    for (i, b) in buf.iter_mut().enumerate() {
        *b = (seed.wrapping_add(i as u64 * 131) >> 5) as u8;
    }
}

fn intact(bytes: &[u8], client: usize, seq: u64) -> bool {
    let seed = seq.wrapping_mul(0x9e37_79b9) ^ (client as u64) << 40;
    bytes
        .iter()
        .enumerate()
        .all(|(i, &b)| b == (seed.wrapping_add(i as u64 * 131) >> 5) as u8)
}

/// The server's side of a session: echoes each SEND from its receive slot.
struct Echo {
    conn: Option<ConnId>,
    waiting: std::collections::VecDeque<HeldRecv>,
}

impl Echo {
    fn drain(&mut self, ctx: &mut Ctx<'_>) {
        let Some(conn) = self.conn else { return };
        while let Some(held) = self.waiting.pop_front() {
            if let Err((_, held)) = ctx.forward(conn, held, None) {
                self.waiting.push_front(held);
                return;
            }
        }
    }
}

impl Handler for Echo {
    fn on_message(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, _data: &[u8], _imm: Option<u32>) {
        self.conn = Some(conn);
        if let Some(held) = ctx.hold() {
            self.waiting.push_back(held);
        }
        self.drain(ctx);
    }

    fn on_writable(&mut self, ctx: &mut Ctx<'_>, _conn: ConnId) {
        self.drain(ctx);
    }

    fn on_peer_gone(&mut self, ctx: &mut Ctx<'_>, session: SessionId, _status: &PeerStatus) {
        ctx.remove_session(session);
    }
}

/// What a client reports when it is done.
struct Report {
    client: usize,
    rtts: RttRecorder,
    mismatches: u64,
    failure: Option<String>,
}

/// A client session: keeps `window` SENDs in flight until `until`, checks
/// every echo, records each round trip.
struct Pinger {
    client: usize,
    size: usize,
    window: u64,
    until: Instant,
    clock: Clock,
    sent_at: Vec<u64>,
    next: u64,
    answered: u64,
    rtts: RttRecorder,
    mismatches: u64,
    conn: Option<ConnId>,
    stopping: bool,
    report: Option<mpsc::Sender<Report>>,
    failure: Option<String>,
}

impl Pinger {
    fn pump(&mut self, ctx: &mut Ctx<'_>) {
        let Some(conn) = self.conn else { return };
        while !self.stopping && self.next - self.answered < self.window {
            let (client, seq, size) = (self.client, self.next, self.size);
            match ctx.send_with(conn, size, Some(seq as u32), |buf| fill(buf, client, seq)) {
                Ok(_) => {
                    self.sent_at[(seq % self.window) as usize] = self.clock.now();
                    self.next += 1;
                }
                Err(SendError::WouldBlock) => return,
                Err(err) => {
                    self.finish(Some(err.to_string()));
                    return;
                }
            }
        }
    }

    fn finish(&mut self, failure: Option<String>) {
        if let Some(report) = self.report.take() {
            let _ = report.send(Report {
                client: self.client,
                rtts: std::mem::take(&mut self.rtts),
                mismatches: self.mismatches,
                failure: failure.or(self.failure.take()),
            });
        }
    }
}

impl Handler for Pinger {
    fn on_established(&mut self, ctx: &mut Ctx<'_>, conn: ConnId) {
        self.conn = Some(conn);
        self.pump(ctx);
    }

    fn on_message(&mut self, ctx: &mut Ctx<'_>, _conn: ConnId, data: &[u8], imm: Option<u32>) {
        let seq = self.answered;
        let sent = self.sent_at[(seq % self.window) as usize];
        self.rtts.record(self.clock.nanos(sent, self.clock.now()));
        if imm.is_some() || data.len() != self.size || !intact(data, self.client, seq) {
            self.mismatches += 1;
        }
        self.answered += 1;
        // The clock is read every 64 answers (a syscall on some VMs).
        if self.answered.is_multiple_of(64) && Instant::now() >= self.until {
            self.stopping = true;
        }
        if self.stopping && self.answered == self.next {
            self.finish(None);
            return;
        }
        self.pump(ctx);
    }

    /// A ping refused for want of credits goes out once they are back.
    fn on_writable(&mut self, ctx: &mut Ctx<'_>, _conn: ConnId) {
        self.pump(ctx);
    }

    fn on_error(&mut self, _ctx: &mut Ctx<'_>, _conn: ConnId, error: &Error) {
        self.finish(Some(error.to_string()));
    }

    fn on_peer_gone(&mut self, _ctx: &mut Ctx<'_>, _session: SessionId, status: &PeerStatus) {
        self.finish(Some(format!("the server went away: {status:?}")));
    }
}

fn run(args: &Args) -> rdma_comm_core::Result<bool> {
    let ctx = Context::open_default(args.dev.device.as_deref())?;
    let pd = ctx.alloc_pd()?;
    // Each in its range, checked before the device was opened.
    let reactors = server_reactors(args);
    let (clients, size, window) = (args.clients, args.size, args.window);
    let per_reactor = clients.div_ceil(reactors) as u32;
    let depth = (2 * window as u32).max(16);
    let mode: EventMode = args.event_mode.into();
    let reactor_config = |sessions| ReactorConfig {
        event_mode: mode,
        peer_check_interval: Some(Duration::from_millis(100)),
        ..ReactorConfig::for_traffic(size, depth, sessions)
    };
    let core_choice = match &args.cores {
        Some(list) => CoreChoice::List(parse_core_list(list)?),
        None => CoreChoice::NearDevice,
    };

    // The server: pinned reactors, sessions placed by the fewest sessions.
    let server_config = RuntimeConfig {
        reactors,
        cores: core_choice,
        reactor: reactor_config(per_reactor),
        policy: PlacementPolicy::FewestSessions,
        thread_name: "demo-server".into(),
        ..RuntimeConfig::default()
    };
    let factory = |_: &NewSession<'_>| {
        Ok(Echo {
            conn: None,
            waiting: std::collections::VecDeque::with_capacity(64),
        })
    };
    let mut server = Runtime::start(&pd, server_config, factory)?;
    println!(
        "demo on {}: server runtime of {}",
        ctx.name(),
        server.plan()
    );
    // Server and clients share one process, and a key made for this run.
    let key = AuthKey::random()?;
    let mut config = server.server_config(AccessFlags::empty());
    config.auth_key = Some(key.clone());
    args.dev.apply(&mut config.qp);
    let addr: SocketAddr = server.serve("127.0.0.1:0", config)?;

    // The clients: one more runtime, unpinned, whose sessions the
    // application connects itself; each handler is built on its reactor.
    let (report_tx, reports) = mpsc::channel::<Report>();
    let until = Instant::now() + Duration::from_secs(args.seconds);
    let client_factory = {
        let report_tx = report_tx.clone();
        let next_client = std::sync::atomic::AtomicUsize::new(0);
        move |_: &NewSession<'_>| {
            let client = next_client.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Ok(Pinger {
                client,
                size,
                window: window as u64,
                until,
                clock: Clock::new(),
                sent_at: vec![0; window],
                next: 0,
                answered: 0,
                rtts: RttRecorder::new(),
                mismatches: 0,
                conn: None,
                stopping: false,
                report: Some(report_tx.clone()),
                failure: None,
            })
        }
    };
    drop(report_tx);
    let client_runtime = Runtime::start(
        &pd,
        RuntimeConfig {
            reactors: 1,
            cores: CoreChoice::Unpinned,
            reactor: reactor_config(clients as u32),
            thread_name: "demo-client".into(),
            ..RuntimeConfig::default()
        },
        client_factory,
    )?;
    println!(
        "{clients} clients: verified SENDs of {size} B, {window} in flight each, for {} s",
        args.seconds
    );
    let started = Instant::now();
    for client in 0..clients {
        let mut spec = client_runtime.qp_spec(0, "demo", AccessFlags::empty())?;
        args.dev.apply(&mut spec.qp);
        let config = ClientConfig::new(vec![spec])
            .with_identity(format!("client-{client}"))
            .with_auth_key(Some(key.clone()));
        let endpoint = ClientSession::connect(addr, &pd, &config)?;
        client_runtime.adopt(0, endpoint)?;
    }
    let placed: Vec<usize> = server.loads().iter().map(|l| l.sessions).collect();
    let mut all = RttRecorder::new();
    let (mut mismatches, mut ok) = (0, true);
    for _ in 0..clients {
        let Ok(report) = reports.recv_timeout(Duration::from_secs(args.seconds + 30)) else {
            eprintln!("demo: a client did not finish");
            ok = false;
            break;
        };
        if let Some(failure) = &report.failure {
            eprintln!("demo: client {}: {failure}", report.client);
            ok = false;
        }
        mismatches += report.mismatches;
        all.merge(&report.rtts);
    }
    let elapsed = started.elapsed();
    client_runtime.stop();
    client_runtime.join()?;
    // Let the server see the clients go, then stop it.
    std::thread::sleep(Duration::from_millis(200));
    server.stop();
    let stats = server.join()?;

    let rate = all.count() as f64 / elapsed.as_secs_f64();
    println!("placement: sessions per reactor {placed:?} (fewest sessions first)");
    println!(
        "{} round trips, {mismatches} mismatches; RTT usec: p50 {:.1}  p90 {:.1}  p99 {:.1}  p99.9 {:.1}  max {:.1}",
        all.count(),
        all.quantile_us(0.5),
        all.quantile_us(0.9),
        all.quantile_us(0.99),
        all.quantile_us(0.999),
        all.quantile_us(1.0)
    );
    println!(
        "message rate: {:.0} round trips/s ({:.0} messages/s both ways, {:.1} MiB/s of payload)",
        rate,
        2.0 * rate,
        2.0 * rate * size as f64 / (1 << 20) as f64
    );
    for reactor in &stats {
        println!("server {reactor}");
    }
    println!("{}", device_line(&ctx)?);
    Ok(ok && mismatches == 0 && all.count() > 0)
}

/// devinfo's device line: the port, its link and MTU, the GID we would pick.
fn device_line(ctx: &Context) -> rdma_comm_core::Result<String> {
    let limits = ctx.query_device()?;
    let mut line = format!("device {}", ctx.name());
    for port in 1..=limits.phys_port_cnt {
        let attr = ctx.query_port(port)?;
        line += &format!(
            ": port {port} {:?}, link {:?}, active_mtu {}",
            attr.state,
            attr.link_layer,
            attr.active_mtu.bytes()
        );
        if let Ok(entry) = ctx.select_gid(port, None) {
            line += &format!(", GID index {} ({})", entry.index, entry.gid);
        }
    }
    Ok(line)
}
