//! Message rate and memory as the connections on one reactor grow.
//!
//! ```text
//! conn_scale [--conns 1,16,256,1024] [--messages 200000] [--size 64] [--srq both|on|off] [--plot FILE.svg]
//! ```
//!
//! For each count N, one process connects N sessions (one QP each) over
//! 127.0.0.1 from a sending reactor to a receiving reactor, each on a
//! thread pinned to a core of its own, and streams `--messages` 64-byte
//! SENDs spread evenly over the N connections, at most `--batch` per
//! doorbell per connection and `--in-flight` over all of them (the same
//! offered load at every N; without that cap, 1024 windows of 16 flood
//! Soft-RoCE into dropping packets and retrying). It prints, per N, with
//! and without a shared receive queue on the receiver:
//!
//! - the message rate, and its ratio to the rate of the smallest N;
//! - the receiver's registered receive memory, in all and per connection
//!   (with an SRQ it is the SRQ's ring, fixed by its depth);
//! - the process's resident memory growth per connection (both ends: the
//!   sender's and the receiver's QPs, rings and provider queues), and how
//!   much of it is the provider's queues (the rings the device maps into
//!   the process: their size follows the queue depths and the inline room,
//!   see `ReactorConfig::for_traffic`).
//!
//! Every connection gets the same credit window (`--window`), with or
//! without the SRQ, so only the number of connections changes.

use std::cell::Cell;
use std::process::ExitCode;
use std::rc::Rc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

mod common;
#[path = "common/plot.rs"]
mod plot;

use clap::{Parser, ValueEnum};
use rdma_comm_core::reactor::*;
use rdma_comm_core::session::*;
use rdma_comm_core::verbs::*;
use rdma_comm_core::{Error, Result};

/// Message rate and receive memory against the number of connections.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Connection counts to measure, in order, each 1 to 65536.
    #[arg(long, value_delimiter = ',', default_value = "1,16,256,1024", value_parser = common::range(1u32, MAX_CONNS))]
    conns: Vec<u32>,
    /// Messages per measurement, spread over the connections (at least 1).
    #[arg(long, default_value_t = 200_000, value_parser = common::at_least(1u64))]
    messages: u64,
    /// SEND payload in bytes, 0 to 1 MiB.
    #[arg(short = 's', long, default_value_t = 64, value_parser = common::range(0usize, MAX_SIZE))]
    size: usize,
    /// Credits per connection: receives of its own, or its share of the
    /// SRQ; 1 to 4096.
    #[arg(long, default_value_t = 16, value_parser = common::range(1u32, 4096))]
    window: u32,
    /// Most requests per doorbell per connection, 1 to 4096.
    #[arg(long, default_value_t = 16, value_parser = common::range(1usize, common::MAX_BATCH))]
    batch: usize,
    /// Most SENDs in flight over all connections together (0: only the
    /// per-connection windows limit them). The same offered load at every
    /// count: what changes is only how many connections carry it.
    #[arg(long, default_value_t = 64)]
    in_flight: u64,
    /// Both reactors sleep on their completion channels instead of
    /// spinning (with Soft-RoCE, the kernel's share of the CPU then grows).
    #[arg(long)]
    blocking: bool,
    /// Whether the receiver uses a shared receive queue.
    #[arg(long, value_enum, default_value_t = SrqArg::Both)]
    srq: SrqArg,
    /// Also draw the rate against the number of connections into this SVG.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<String>,
    #[command(flatten)]
    dev: common::DeviceArgs,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum SrqArg {
    Both,
    On,
    Off,
}

/// What one count measured.
struct Point {
    conns: u32,
    mpps: f64,
    receive_bytes: usize,
    rss_growth: Option<Resident>,
}

/// Most connections of one count (`--conns`).
const MAX_CONNS: u32 = 1 << 16;
/// Largest SEND (`--size`): 1 MiB.
const MAX_SIZE: usize = 1 << 20;

fn main() -> ExitCode {
    common::init_logging();
    let args: Args = common::parse("conn_scale");
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("conn_scale: {err}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Result<()> {
    // The process's cores, looked at before anything is pinned.
    usable_cores();
    // Each count is 1 or more, and there is one at least (clap's checks).
    let largest = args.conns.iter().copied().max().unwrap_or(1);
    // Each session holds a TCP control connection at both ends.
    raise_fd_limit(u64::from(largest) * 2 + 64)?;
    let modes: &[bool] = match args.srq {
        SrqArg::Both => &[false, true],
        SrqArg::On => &[true],
        SrqArg::Off => &[false],
    };
    println!(
        "{} B SENDs, {} messages per point, window {} per connection, batch {}, at most {} in flight",
        args.size, args.messages, args.window, args.batch, args.in_flight
    );
    println!(
        "{:<6} {:>7} {:>10} {:>8} {:>16} {:>14} {:>16} {:>18}",
        "srq",
        "conns",
        "Mpps",
        "x first",
        "recv mem [KiB]",
        "per conn [B]",
        "RSS/conn [KiB]",
        "queues/conn [KiB]"
    );
    let mut series = Vec::new();
    for &srq in modes {
        let mut points: Vec<Point> = Vec::new();
        for &conns in &args.conns {
            let point = measure(args, conns, srq, largest)?;
            let first = points.first().map_or(point.mpps, |p| p.mpps);
            let per_conn = |bytes: u64| format!("{:.1}", bytes as f64 / 1024.0 / f64::from(conns));
            println!(
                "{:<6} {:>7} {:>10.4} {:>8.2} {:>16.1} {:>14} {:>16} {:>18}",
                if srq { "on" } else { "off" },
                conns,
                point.mpps,
                point.mpps / first,
                point.receive_bytes as f64 / 1024.0,
                point.receive_bytes / conns as usize,
                point
                    .rss_growth
                    .map_or("-".into(), |grown| per_conn(grown.total)),
                point
                    .rss_growth
                    .map_or("-".into(), |grown| per_conn(grown.queues)),
            );
            points.push(point);
        }
        series.push(plot::Series {
            label: if srq { "with SRQ" } else { "own receive rings" }.into(),
            color: if srq {
                plotters::style::RED
            } else {
                plotters::style::BLUE
            },
            points: points
                .iter()
                .map(|p| (f64::from(p.conns), p.mpps))
                .collect(),
        });
    }
    if let Some(path) = &args.plot {
        let chart = plot::Chart {
            path,
            caption: format!(
                "{} B SEND rate against connections on one reactor",
                args.size
            ),
            x_desc: "connections",
            y_desc: "Mpps",
            x_label: &|n| format!("{n}"),
        };
        plot::draw(&chart, &series).map_err(|what| Error::Os {
            what: "drawing the plot",
            source: std::io::Error::other(what),
        })?;
    }
    Ok(())
}

/// The sending reactor's configuration (the receiver's starts from it).
fn sender_config(args: &Args, conns: u32) -> ReactorConfig {
    let mut config = ReactorConfig::for_traffic(args.size, args.window, conns);
    if args.blocking {
        config.event_mode = EventMode::Blocking;
    }
    config
}

/// The receiving reactor's configuration: the same window per connection
/// with or without an SRQ; the SRQ is sized for the largest count, once.
fn config(args: &Args, srq: bool, largest: u32, conns: u32) -> ReactorConfig {
    let mut config = sender_config(args, conns);
    config.repost_batch = (args.window / 2).max(1);
    if srq {
        config.srq_depth = args.window * largest;
        config = config.absorbing(conns);
    }
    config
}

/// One count: sets up the receiver on a thread of its own, connects
/// `conns` sessions, streams, and tears both down.
fn measure(args: &Args, conns: u32, srq: bool, largest: u32) -> Result<Point> {
    let rss_before = resident_bytes();
    let (ready_tx, ready_rx) = mpsc::channel::<Result<(std::net::SocketAddr, Stopper)>>();
    let (memory_tx, memory_rx) = mpsc::channel::<MemoryUse>();
    let receiver_config = config(args, srq, largest, conns);
    let expected = quota(args, conns) * u64::from(conns);
    let dev = args.dev.clone();
    // Receiver and senders share one process, and a key made for this run.
    let key = AuthKey::random()?;
    let receiver_key = key.clone();
    let receiver = std::thread::spawn(move || -> Result<u64> {
        pin(0);
        let ctx = Context::open_default(dev.device.as_deref())?;
        let pd = ctx.alloc_pd()?;
        let mut reactor: Reactor<Sink> = Reactor::new(&pd, receiver_config)?;
        let received = Rc::new(Cell::new(0));
        let mut server = reactor.server_config(AccessFlags::empty());
        server.auth_key = Some(receiver_key);
        dev.apply(&mut server.qp);
        server.max_peers = Some(conns as usize);
        let listener = match ServerSession::bind("127.0.0.1:0", &pd, server) {
            Ok(listener) => listener,
            Err(err) => {
                let _ = ready_tx.send(Err(err));
                return Ok(0);
            }
        };
        let _ = ready_tx.send(Ok((listener.local_addr(), reactor.stopper())));
        for _ in 0..conns {
            // Bounded: a sender that failed to connect must not leave
            // this thread waiting for ever.
            let endpoint = listener
                .accept_timeout(Duration::from_secs(60))
                .ok_or(Error::InvalidArgument("no connection came within 60 s"))?;
            reactor.add(
                endpoint,
                Sink {
                    received: received.clone(),
                    expected,
                },
            )?;
        }
        let _ = memory_tx.send(reactor.memory());
        let before = reactor.counters();
        reactor.run()?;
        report("receiver", &before, &reactor.counters());
        Ok(received.get())
    });
    let (addr, stopper) = match ready_rx.recv() {
        Ok(ready) => ready?,
        // It failed before it listened: its own error says why.
        Err(_) => {
            return Err(match receiver.join() {
                Ok(Err(err)) => err,
                _ => Error::InvalidArgument("the receiver thread died"),
            });
        }
    };
    let sent = send_all(args, conns, addr, &key, &memory_rx);
    if sent.is_err() {
        stopper.stop();
    }
    let received = receiver
        .join()
        .map_err(|_| Error::InvalidArgument("the receiver thread panicked"))?;
    let (mpps, receive_bytes, rss_after, total) = match sent {
        Ok(sent) => sent,
        Err(err) => {
            // The receiver's own failure often says why (a limit it hit).
            if let Err(receiver_err) = &received {
                eprintln!("conn_scale: the receiver failed: {receiver_err}");
            }
            return Err(err);
        }
    };
    // The receiver stops once it counted every message: it cannot have
    // stopped on fewer, but it may have been stopped because we failed.
    if received? != total {
        return Err(Error::InvalidArgument(
            "the receiver counted other than the messages sent",
        ));
    }
    Ok(Point {
        conns,
        mpps,
        receive_bytes,
        rss_growth: rss_before
            .zip(rss_after)
            .map(|(before, after)| after.since(before)),
    })
}

/// The sending side: connects, waits for every connection, then streams
/// and times. Returns (Mpps, receiver's receive bytes, RSS with everything
/// connected, messages sent).
fn send_all(
    args: &Args,
    conns: u32,
    addr: std::net::SocketAddr,
    key: &AuthKey,
    memory: &mpsc::Receiver<MemoryUse>,
) -> Result<(f64, usize, Option<Resident>, u64)> {
    pin(1);
    let ctx = Context::open_default(args.dev.device.as_deref())?;
    let pd = ctx.alloc_pd()?;
    let mut reactor: Reactor<Sender> = Reactor::new(&pd, sender_config(args, conns))?;
    let quota = quota(args, conns);
    let shared = Rc::new(Shared::default());
    let connecting = Instant::now();
    for _ in 0..conns {
        let mut spec = reactor.qp_spec("scale");
        args.dev.apply(&mut spec.qp);
        let mut client = ClientConfig::new(vec![spec]).with_auth_key(Some(key.clone()));
        client.connect_deadline = Duration::from_secs(60);
        let endpoint = ClientSession::connect(addr, &pd, &client)?;
        reactor.add(endpoint, Sender::new(&shared, quota, args))?;
    }
    // Every connection established before the clock starts.
    let deadline = Instant::now() + Duration::from_secs(60);
    while shared.established.get() < conns as usize {
        reactor.poll_once()?;
        if Instant::now() > deadline {
            return Err(Error::InvalidArgument(
                "connections still not established after 60 s",
            ));
        }
    }
    let receiver_memory = memory
        .recv_timeout(Duration::from_secs(60))
        .map_err(|_| Error::InvalidArgument("the receiver did not report its memory"))?;
    let rss = resident_bytes();
    eprintln!(
        "conn_scale: {conns} connections up in {:.2} s",
        connecting.elapsed().as_secs_f64()
    );
    shared.finished_goal.set(conns as usize);
    shared.in_flight_cap.set(if args.in_flight == 0 {
        u64::MAX
    } else {
        args.in_flight
    });
    let before = reactor.counters();
    let start = Instant::now();
    shared.started.set(true);
    reactor.run()?;
    let elapsed = start.elapsed().as_secs_f64();
    report("sender", &before, &reactor.counters());
    if let Some(failure) = shared.failure.take() {
        return Err(Error::InvalidArgument(failure));
    }
    let total = quota * u64::from(conns);
    Ok((
        total as f64 / elapsed / 1e6,
        receiver_memory.receive_bytes,
        rss,
        total,
    ))
}

/// What one side's reactor did during the run, on stderr: how busy it
/// was, and how many connections its flushes looked at.
fn report(side: &str, before: &Counters, after: &Counters) {
    let passes = after.passes - before.passes;
    eprintln!(
        "conn_scale: {side}: {passes} passes ({:.0} % empty), {} completions, {} requests in {} doorbells, {} flush visits",
        100.0 * (after.empty_passes - before.empty_passes) as f64 / passes.max(1) as f64,
        after.completions - before.completions,
        after.requests - before.requests,
        after.doorbells - before.doorbells,
        after.flush_visits - before.flush_visits,
    );
}

/// Messages per connection.
fn quota(args: &Args, conns: u32) -> u64 {
    args.messages.div_ceil(u64::from(conns))
}

/// What the sending sessions share: one reactor thread, so plain cells.
#[derive(Default)]
struct Shared {
    started: Cell<bool>,
    established: Cell<usize>,
    finished: Cell<usize>,
    finished_goal: Cell<usize>,
    in_flight: Cell<u64>,
    in_flight_cap: Cell<u64>,
    failure: Cell<Option<&'static str>>,
}

/// Streams its quota of SENDs on its one connection.
struct Sender {
    shared: Rc<Shared>,
    conn: Option<ConnId>,
    quota: u64,
    sent: u64,
    completed: u64,
    size: usize,
    batch: usize,
}

impl Sender {
    fn new(shared: &Rc<Shared>, quota: u64, args: &Args) -> Self {
        Self {
            shared: shared.clone(),
            conn: None,
            quota,
            sent: 0,
            completed: 0,
            size: args.size,
            batch: args.batch,
        }
    }

    fn pump(&mut self, ctx: &mut Ctx<'_>) {
        let Some(conn) = self.conn else { return };
        if !self.shared.started.get() {
            return;
        }
        let staged_before = self.sent;
        while self.sent < self.quota
            && ctx.staged(conn) < self.batch
            && self.shared.in_flight.get() < self.shared.in_flight_cap.get()
        {
            match ctx.send_with(conn, self.size, None, |_| {}) {
                Ok(_) => {
                    self.sent += 1;
                    self.shared.in_flight.set(self.shared.in_flight.get() + 1);
                }
                Err(SendError::WouldBlock) => break,
                Err(_) => {
                    self.shared.failure.set(Some("a SEND was refused"));
                    ctx.stop();
                    return;
                }
            }
        }
        // The end of a burst is signaled: with the in-flight cap spread
        // over many connections, a connection may send fewer than the
        // signaling interval at a time, and unsignaled requests would only
        // report once the reactor signals out idle tails.
        if self.sent > staged_before {
            ctx.signal_staged(conn);
        }
    }
}

impl Handler for Sender {
    /// Credit updates are all a sender receives; the reactor takes them.
    fn on_message(&mut self, _ctx: &mut Ctx<'_>, _conn: ConnId, _data: &[u8], _imm: Option<u32>) {}

    fn on_established(&mut self, ctx: &mut Ctx<'_>, conn: ConnId) {
        self.conn = Some(conn);
        self.shared
            .established
            .set(self.shared.established.get() + 1);
        self.pump(ctx);
    }

    fn on_send_complete(&mut self, ctx: &mut Ctx<'_>, _conn: ConnId, _seq: u32) {
        self.completed += 1;
        self.shared.in_flight.set(self.shared.in_flight.get() - 1);
        if self.completed == self.quota {
            let finished = self.shared.finished.get() + 1;
            self.shared.finished.set(finished);
            if finished == self.shared.finished_goal.get() {
                ctx.stop();
            }
        } else {
            self.pump(ctx);
        }
    }

    fn on_error(&mut self, ctx: &mut Ctx<'_>, _conn: ConnId, _error: &Error) {
        self.shared.failure.set(Some("a connection failed"));
        ctx.stop();
    }

    fn on_writable(&mut self, ctx: &mut Ctx<'_>, _conn: ConnId) {
        self.pump(ctx);
    }

    /// The start, and room the shared in-flight cap gives back, come
    /// with no callback of this session's own: it looks while it has
    /// messages to send.
    fn on_idle(&mut self, ctx: &mut Ctx<'_>) -> Idle {
        self.pump(ctx);
        if self.sent < self.quota {
            Idle::Again
        } else {
            Idle::Done
        }
    }
}

/// The receiving side: counts the SENDs (the reactor reposts and returns
/// credits), and stops its reactor once all of them arrived.
struct Sink {
    received: Rc<Cell<u64>>,
    expected: u64,
}

impl Handler for Sink {
    fn on_message(&mut self, ctx: &mut Ctx<'_>, _conn: ConnId, _data: &[u8], _imm: Option<u32>) {
        let received = self.received.get() + 1;
        self.received.set(received);
        if received == self.expected {
            ctx.stop();
        }
    }
}

/// Pins the calling thread to the `core`th of the process's cores (the
/// receiver and the sender each get one of their own). `usable_cores`, not
/// the thread's own list: the second count's receiver is spawned by the
/// pinned sender and inherits its one core.
fn pin(core: usize) {
    if let Some(&id) = usable_cores().get(core) {
        core_affinity::set_for_current(core_affinity::CoreId { id });
    }
}

/// The process's resident memory (Linux), in all and in the provider's
/// queues (the QPs', CQs' and SRQs' rings the device maps into the process).
#[derive(Clone, Copy, Debug, Default)]
struct Resident {
    total: u64,
    queues: u64,
}

impl Resident {
    /// What grew from `before` to `self`.
    fn since(self, before: Resident) -> Resident {
        Resident {
            total: self.total.saturating_sub(before.total),
            queues: self.queues.saturating_sub(before.queues),
        }
    }
}

/// The process's resident memory, read from `/proc/self/smaps`, if it can
/// be read.
fn resident_bytes() -> Option<Resident> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
    let mut resident = Resident::default();
    let mut in_queue = false;
    for line in smaps.lines() {
        let mut fields = line.split_whitespace();
        let first = fields.next().unwrap_or("");
        if first.ends_with(':') {
            if first == "Rss:" {
                let kib: u64 = fields.next()?.parse().ok()?;
                resident.total += kib * 1024;
                if in_queue {
                    resident.queues += kib * 1024;
                }
            }
        } else {
            // A mapping's header: range, permissions, offset, device,
            // inode, then the path if it has one.
            in_queue = fields
                .nth(4)
                .is_some_and(|path| path.starts_with("/dev/infiniband/"));
        }
    }
    Some(resident)
}

/// Lifts the soft limit on open files to `wanted` (up to the hard limit).
fn raise_fd_limit(wanted: u64) -> Result<()> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct we pass and nothing else.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return Err(Error::Os {
            what: "reading the open-file limit",
            source: std::io::Error::last_os_error(),
        });
    }
    if limit.rlim_cur >= wanted {
        return Ok(());
    }
    limit.rlim_cur = wanted.min(limit.rlim_max);
    // SAFETY: setrlimit reads the struct we pass.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) } != 0 || limit.rlim_cur < wanted {
        return Err(Error::Os {
            what: "raising the open-file limit (each connection needs two descriptors)",
            source: std::io::Error::from_raw_os_error(libc::EMFILE),
        });
    }
    Ok(())
}
