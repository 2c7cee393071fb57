//! Finite SEND/RECV and WRITE_WITH_IMM ping-pong with payload verification,
//! both sides on the reactor.
//!
//! ```text
//! ping_pong --server [--listen 0.0.0.0:7471] [--max-peers N] [--reactors N] [--cores LIST] [--event-mode blocking] [--heap-report-ms MS]
//! ping_pong --connect HOST:7471 [--iters 1000] [--size 64] [--op send|write-imm|both] [--batch 1]
//! ```
//!
//! Every message carries a pattern derived from its sequence number; both
//! sides check every byte (and the immediate). `--batch N` keeps N pings in
//! flight, staged in one pass and so posted with one doorbell. The client
//! prints an RTT summary and exits 0 only if every byte matched.
//!
//! The server runs a runtime of `--reactors` pinned reactor threads (one by
//! default), each serving the peers placed on it over its own CQs: it
//! echoes SENDs straight out of their receive slots (no copy) and
//! WRITE_WITH_IMMs back from the peer's inbox, removes a peer when it
//! disconnects or fails, and keeps serving the others. In the Blocking and
//! Epoll modes an idle server makes no syscalls at all.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

mod common;

use clap::{Parser, ValueEnum};
use rdma_comm_core::Error;
use rdma_comm_core::reactor::*;
use rdma_comm_core::runtime::*;
use rdma_comm_core::session::*;
use rdma_comm_core::verbs::*;
use rdma_perf::Clock;

/// RDMA ping-pong with verified payloads.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// Serve peers.
    #[arg(long, conflicts_with = "connect")]
    server: bool,
    /// Address to listen on (server).
    #[arg(long, default_value = "0.0.0.0:7471")]
    listen: String,
    /// Stop after serving this many peers (server; default: forever).
    #[arg(long)]
    max_peers: Option<usize>,
    /// Time a client has to complete its handshake (server).
    #[arg(long, default_value_t = 10_000)]
    handshake_timeout_ms: u64,
    /// Largest message a peer may send, and each peer's inbox size (server).
    #[arg(long, default_value_t = 1 << 16)]
    max_size: usize,
    /// Print the heap in use (`heap: N B in use`) about this often
    /// (server; glibc 2.33 or later): the long-lived test reads it, since unlike the
    /// RSS it does not keep the allocator's high-water marks.
    #[arg(long, value_name = "MS", value_parser = clap::value_parser!(u64).range(1..=3_600_000))]
    heap_report_ms: Option<u64>,
    /// Server to connect to (client).
    #[arg(long, value_name = "HOST:PORT", required_unless_present = "server")]
    connect: Option<String>,
    /// Round trips (client).
    #[arg(long, default_value_t = 1000)]
    iters: u64,
    /// Payload bytes per message (client).
    #[arg(long, default_value_t = 64)]
    size: usize,
    /// Which operation carries the ping (client).
    #[arg(long, value_enum, default_value_t = Op::Both)]
    op: Op,
    #[command(flatten)]
    dev: common::DeviceArgs,
    #[command(flatten)]
    auth: common::AuthArgs,
    #[command(flatten)]
    transport: common::TransportArgs,
    #[command(flatten)]
    reactor: common::ReactorArgs,
    #[command(flatten)]
    runtime: common::RuntimeArgs,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Op {
    Send,
    WriteImm,
    Both,
}

/// How long the client waits for any answer before declaring the server gone.
const ROUND_TRIP_DEADLINE: Duration = Duration::from_secs(10);
/// How often control connections are checked for a vanished peer.
const PEER_CHECK_INTERVAL: Duration = Duration::from_millis(100);
/// Peers each of the server's reactors has CQs for at once (more are
/// refused with an error naming them, until some leave).
const MAX_PEERS_AT_ONCE: u32 = 64;
/// Most pings in flight: the WRITE_WITH_IMM immediate carries the inbox slot
/// in its top byte and the sequence number in the other 24 bits.
const MAX_WINDOW: usize = 64;

fn main() -> ExitCode {
    let args = Args::parse();
    let result = if args.server {
        serve(&args)
    } else {
        ping(&args)
    };
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(err) => {
            eprintln!("ping_pong: {err}");
            ExitCode::FAILURE
        }
    }
}

/// The payload of message `seq`: differs per message and per byte.
fn pattern(seq: u64, len: usize) -> impl Iterator<Item = u8> {
    (0..len).map(move |i| (seq.wrapping_mul(0x9e37_79b9).wrapping_add(i as u64 * 31) >> 3) as u8)
}

fn matches_pattern(bytes: &[u8], seq: u64) -> bool {
    bytes.iter().copied().eq(pattern(seq, bytes.len()))
}

fn write_imm(slot: usize, seq: u64) -> u32 {
    ((slot as u32) << 24) | (seq as u32 & 0x00ff_ffff)
}

/// `depth` receives per peer; `send_slots` for SENDs that are not echoes
/// (the server echoes from receive slots and its inbox, so it needs few).
/// for `peers` peers; the reactor watches each peer's control connection.
fn reactor_config(
    args: &Args,
    payload: usize,
    depth: u32,
    send_slots: u32,
    peers: u32,
) -> ReactorConfig {
    let default_mode = common::EventArg::Busy;
    let base = ReactorConfig::for_traffic(payload, depth, peers);
    ReactorConfig {
        event_mode: args.reactor.event_mode_or(default_mode).into(),
        send_slots,
        signal_interval: args.reactor.signal_interval,
        repost_batch: args.reactor.repost_batch_or(base.repost_batch),
        ..base
    }
    .watching_peers(PEER_CHECK_INTERVAL)
}

/// The client: keeps `window` pings in flight and checks every echo.
struct Pinger {
    iters: u64,
    size: usize,
    op: Op,
    window: usize,
    conn: Option<ConnId>,
    source: MemoryRegion,
    inbox: Arc<MemoryRegion>,
    server_inbox: RemoteRegion,
    clock: Clock,
    scratch: Vec<u8>,
    /// Staging time of each in-flight ping, by window slot.
    sent_at: Vec<u64>,
    next: u64,
    answered: u64,
    rtts_ns: Vec<u64>,
    mismatches: u64,
    failure: Option<String>,
    /// The failure is a transport error of the connection (it names the
    /// QP and the server), not a protocol one.
    typed_failure: bool,
}

impl Pinger {
    fn uses_send(&self, seq: u64) -> bool {
        match self.op {
            Op::Send => true,
            Op::WriteImm => false,
            Op::Both => seq.is_multiple_of(2),
        }
    }

    fn pump(&mut self, ctx: &mut Ctx<'_>) {
        let Some(conn) = self.conn else { return };
        while self.next < self.iters && self.next - self.answered < self.window as u64 {
            let seq = self.next;
            let slot = (seq % self.window as u64) as usize;
            let size = self.size;
            let staged = if self.uses_send(seq) {
                ctx.send_with(conn, size, None, |buf| {
                    for (dst, src) in buf.iter_mut().zip(pattern(seq, size)) {
                        *dst = src;
                    }
                })
            } else {
                let offset = slot * size;
                for (dst, src) in self.scratch.iter_mut().zip(pattern(seq, size)) {
                    *dst = src;
                }
                // This slot's previous ping was answered, so nothing reads it.
                let local = self
                    .source
                    .write(offset, &self.scratch)
                    .and_then(|()| self.source.slice(offset, size));
                let remote = self.server_inbox.slice(offset as u64, size as u64);
                match (local, remote) {
                    (Ok(local), Ok(remote)) => {
                        ctx.write(conn, &local, remote, Some(write_imm(slot, seq)))
                    }
                    (Err(err), _) | (_, Err(err)) => Err(SendError::Invalid(err)),
                }
            };
            match staged {
                Ok(_) => {
                    self.sent_at[slot] = self.clock.now();
                    self.next += 1;
                }
                Err(SendError::WouldBlock) => return,
                Err(err) => {
                    self.failure = Some(format!("ping {seq}: {err}"));
                    return;
                }
            }
        }
    }

    fn answer(&mut self, ctx: &mut Ctx<'_>, ok: bool, what: impl FnOnce() -> String) {
        let seq = self.answered;
        let slot = (seq % self.window as u64) as usize;
        self.rtts_ns
            .push(self.clock.nanos(self.sent_at[slot], self.clock.now()));
        if !ok {
            self.mismatches += 1;
            eprintln!("message {seq}: echo did not match ({})", what());
        }
        self.answered += 1;
        self.pump(ctx);
    }

    fn done(&self) -> bool {
        self.answered == self.iters || self.failure.is_some()
    }
}

impl Handler for Pinger {
    fn on_established(&mut self, ctx: &mut Ctx<'_>, conn: ConnId) {
        self.conn = Some(conn);
        self.pump(ctx);
    }

    fn on_message(&mut self, ctx: &mut Ctx<'_>, _conn: ConnId, data: &[u8], imm: Option<u32>) {
        let seq = self.answered;
        let ok = self.uses_send(seq)
            && imm.is_none()
            && data.len() == self.size
            && matches_pattern(data, seq);
        self.answer(ctx, ok, || format!("SEND echo, {} bytes", data.len()));
    }

    fn on_write_imm(&mut self, ctx: &mut Ctx<'_>, _conn: ConnId, imm: u32, len: u32) {
        let seq = self.answered;
        let slot = (seq % self.window as u64) as usize;
        let expected_kind = !self.uses_send(seq);
        let scratch = &mut self.scratch[..(len as usize).min(self.size)];
        let ok = expected_kind
            && imm == write_imm(slot, seq)
            && len as usize == self.size
            && self.inbox.read(slot * self.size, scratch).is_ok()
            && matches_pattern(scratch, seq);
        self.answer(ctx, ok, || {
            format!("WRITE_WITH_IMM echo, imm {imm:#x}, {len} bytes")
        });
    }

    fn on_peer_gone(&mut self, _ctx: &mut Ctx<'_>, _session: SessionId, status: &PeerStatus) {
        self.failure.get_or_insert_with(|| match status {
            PeerStatus::Disconnected { code } => format!("the server hung up (code {code})"),
            PeerStatus::Lost(err) => err.to_string(),
            PeerStatus::Alive => "the server's link reported nothing".into(),
        });
    }

    fn on_error(&mut self, _ctx: &mut Ctx<'_>, _conn: ConnId, error: &Error) {
        // A typed error names the QP and the server already. Only the
        // first failure counts: a later error does not retype an earlier
        // protocol failure (nor the other way round).
        if self.failure.is_none() {
            self.typed_failure = true;
            self.failure = Some(error.to_string());
        }
    }

    fn on_idle(&mut self, ctx: &mut Ctx<'_>) {
        self.pump(ctx);
    }
}

fn ping(args: &Args) -> rdma_comm_core::Result<bool> {
    let addr = args.connect.as_deref().unwrap_or_default();
    let ctx = Context::open_default(args.dev.device.as_deref())?;
    let pd = ctx.alloc_pd()?;
    let size = args.size.max(1);
    let window = args.reactor.batch_or(1).min(MAX_WINDOW);
    let inbox = Arc::new(pd.alloc_mr(
        window * size,
        AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND,
    )?);
    let source = pd.alloc_mr(window * size, AccessFlags::empty())?;
    let depth = (2 * window as u32).max(16);
    let mut reactor: Reactor<Pinger> =
        Reactor::new(&pd, reactor_config(args, size, depth, depth, 1))?;
    let mut spec = reactor.qp_spec_with_access("ping", AccessFlags::REMOTE_WRITE);
    args.dev.apply(&mut spec.qp);
    let config = ClientConfig::new(vec![spec])
        .with_exports(vec![Export::new(
            1,
            "inbox",
            inbox.as_ref(),
            AccessFlags::REMOTE_WRITE,
        )])
        .with_auth_key(args.auth.key()?)
        .with_transport(args.transport.transport());
    let endpoint = ClientSession::connect(addr, &pd, &config)?;
    let peer = endpoint.peer();
    let server_inbox = endpoint
        .remote_region("inbox")
        .ok_or_else(|| Error::Protocol {
            peer,
            what: "server exported no \"inbox\" region".into(),
        })?;
    if (window * size) as u64 > server_inbox.len() {
        return Err(Error::Protocol {
            peer,
            what: format!(
                "{window} pings of {size} B need {} B, the server takes {} B per peer (its --max-size)",
                window * size,
                server_inbox.len()
            ),
        });
    }
    println!(
        "connected to {peer}: {} x {size} B, op {:?}, {window} in flight",
        args.iters, args.op
    );
    let pinger = Pinger {
        iters: args.iters,
        size,
        op: args.op,
        window,
        conn: None,
        source,
        inbox,
        server_inbox,
        clock: Clock::new(),
        scratch: vec![0; size],
        sent_at: vec![0; window],
        next: 0,
        answered: 0,
        rtts_ns: Vec::with_capacity(args.iters as usize),
        mismatches: 0,
        failure: None,
        typed_failure: false,
    };
    let session = reactor.add(endpoint, pinger)?;

    let mut last_progress = (0, Instant::now());
    // Reading the clock every pass would cost more than the pass (a syscall
    // on a VM's HPET): the timer reads it now and then. The reactor watches
    // the server itself (Pinger::on_peer_gone).
    let mut progress_check = reactor.pass_timer(PEER_CHECK_INTERVAL);
    loop {
        let completions = reactor.turn()?;
        let Some(pinger) = reactor.handler(session) else {
            break;
        };
        if pinger.done() {
            break;
        }
        if !progress_check.expired_after(completions) {
            continue;
        }
        if pinger.answered != last_progress.0 {
            last_progress = (pinger.answered, Instant::now());
        } else if last_progress.1.elapsed() > ROUND_TRIP_DEADLINE {
            return Err(Error::Protocol {
                peer,
                what: format!(
                    "no answer to message {} within {ROUND_TRIP_DEADLINE:?}",
                    pinger.answered
                ),
            });
        }
    }
    let (mut link, pinger) = reactor
        .remove(session)
        .ok_or(Error::InvalidArgument("the session vanished"))?;
    // The reactor destroyed the QPs; say goodbye on the control connection.
    link.close();
    if let Some(failure) = &pinger.failure {
        if pinger.typed_failure {
            eprintln!("ping_pong: {failure}");
            return Ok(false);
        }
        return Err(Error::Protocol {
            peer,
            what: failure.clone(),
        });
    }
    print_summary(&pinger.rtts_ns, pinger.mismatches);
    Ok(pinger.mismatches == 0 && pinger.rtts_ns.len() as u64 == args.iters)
}

fn print_summary(rtts_ns: &[u64], mismatches: u64) {
    let mut us: Vec<f64> = rtts_ns.iter().map(|&ns| ns as f64 / 1e3).collect();
    us.sort_by(f64::total_cmp);
    let at = |q: f64| {
        us.get(((us.len() as f64 - 1.0) * q).round() as usize)
            .copied()
            .unwrap_or(0.0)
    };
    println!(
        "{} round trips, {mismatches} mismatches; RTT usec: min {:.2} median {:.2} p99 {:.2} max {:.2}",
        us.len(),
        at(0.0),
        at(0.5),
        at(0.99),
        at(1.0)
    );
}

/// An echo the server could not post yet (no credit or send-queue room);
/// echoes leave in arrival order.
enum Echo {
    /// A SEND, still in its receive slot.
    Send(HeldRecv),
    /// A WRITE_WITH_IMM: write the inbox range back with the same immediate.
    Write { offset: usize, len: usize, imm: u32 },
}

/// The server's side of one peer.
struct Echoer {
    peer: SocketAddr,
    conn: Option<ConnId>,
    inbox: Arc<MemoryRegion>,
    client_inbox: RemoteRegion,
    scratch: Vec<u8>,
    seq: u64,
    waiting: VecDeque<Echo>,
    /// Corrupted data: reported even if the peer then hangs up politely.
    corrupt: Option<String>,
    transport: Option<String>,
    /// The outcome was reported and the session's removal asked for.
    retired: bool,
    /// Last field, so it drops last: the outcome's line is printed once the
    /// reactor removed the session (its QP, control socket and, with the
    /// fields above, its inbox are gone by then).
    report: Report,
}

/// A peer's outcome, printed when dropped.
struct Report {
    line: Option<String>,
    /// Told once the line is printed.
    finished: mpsc::Sender<()>,
}

impl Drop for Report {
    fn drop(&mut self) {
        if let Some(line) = self.line.take() {
            println!("{line}");
            let _ = self.finished.send(());
        }
    }
}

impl Echoer {
    fn drain(&mut self, ctx: &mut Ctx<'_>, conn: ConnId) {
        self.conn = Some(conn);
        while let Some(echo) = self.waiting.pop_front() {
            let result = match echo {
                Echo::Send(held) => match ctx.forward(conn, held, None) {
                    Ok(_) => Ok(()),
                    Err((error, held)) => {
                        self.waiting.push_front(Echo::Send(held));
                        Err(error)
                    }
                },
                Echo::Write { offset, len, imm } => {
                    let staged = match (
                        self.inbox.slice(offset, len),
                        self.client_inbox.slice(offset as u64, len as u64),
                    ) {
                        (Ok(local), Ok(remote)) => ctx.write(conn, &local, remote, Some(imm)),
                        (Err(err), _) | (_, Err(err)) => Err(SendError::Invalid(err)),
                    };
                    staged.map(|_| ()).inspect_err(|_| {
                        self.waiting.push_front(Echo::Write { offset, len, imm });
                    })
                }
            };
            match result {
                Ok(()) => {}
                Err(SendError::WouldBlock) => return,
                Err(err) => {
                    self.transport.get_or_insert_with(|| format!("echo: {err}"));
                    return;
                }
            }
        }
    }

    /// Reports how the peer's session ended and has the reactor remove it
    /// after this pass; the other peers go on.
    fn retire(&mut self, ctx: &mut Ctx<'_>, session: SessionId, outcome: Result<u64, String>) {
        if self.retired {
            return;
        }
        self.retired = true;
        let peer = self.peer;
        self.report.line = Some(match outcome {
            Ok(count) => format!("peer {peer} done: {count} messages verified and echoed"),
            Err(err) => format!("peer {peer} error: {err}"),
        });
        // Printed when the reactor drops this handler with the session.
        ctx.remove_session(session);
    }
}

impl Handler for Echoer {
    fn on_message(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, data: &[u8], imm: Option<u32>) {
        if imm.is_some() || !matches_pattern(data, self.seq) {
            self.corrupt.get_or_insert_with(|| {
                format!(
                    "message {} ({} B SEND) arrived corrupted",
                    self.seq,
                    data.len()
                )
            });
            return;
        }
        self.seq += 1;
        // Zero-copy echo straight from the receive slot.
        if let Some(held) = ctx.hold() {
            self.waiting.push_back(Echo::Send(held));
        }
        self.drain(ctx, conn);
    }

    fn on_write_imm(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, imm: u32, len: u32) {
        let (slot, len) = ((imm >> 24) as usize, len as usize);
        let offset = slot * len;
        let room = self.scratch.len();
        let scratch = &mut self.scratch[..len.min(room)];
        let intact = imm & 0x00ff_ffff == self.seq as u32 & 0x00ff_ffff
            && scratch.len() == len
            && self.inbox.read(offset, scratch).is_ok()
            && matches_pattern(scratch, self.seq);
        if !intact {
            self.corrupt.get_or_insert_with(|| {
                format!(
                    "message {} ({len} B WRITE_WITH_IMM, imm {imm:#x}) arrived corrupted",
                    self.seq
                )
            });
            return;
        }
        self.seq += 1;
        self.waiting.push_back(Echo::Write { offset, len, imm });
        self.drain(ctx, conn);
    }

    fn on_error(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, error: &Error) {
        // The peer stopped acknowledging for the whole retry window (it
        // died, or its link is down): no goodbye explains that, since one
        // comes over the control connection long before the window ends.
        // Report it now rather than when the control connection times out.
        if let (Some(WcStatus::RETRY_EXC_ERR), Some(session)) =
            (error.completion_status(), ctx.session_of(conn))
        {
            // Corrupted data seen before is reported too, as on_peer_gone
            // would have.
            let outcome = match &self.corrupt {
                Some(corrupt) => format!("{corrupt}; then {error}"),
                None => error.to_string(),
            };
            self.retire(ctx, session, Err(outcome));
            return;
        }
        // Kept until the peer watch tells whether the peer left politely
        // (which explains a transport error that followed) or was lost.
        self.transport.get_or_insert_with(|| error.to_string());
    }

    fn on_peer_gone(&mut self, ctx: &mut Ctx<'_>, session: SessionId, status: &PeerStatus) {
        let outcome = match (status, self.corrupt.as_deref()) {
            (_, Some(corrupt)) => Err(corrupt.to_string()),
            // A polite goodbye explains a transport error that followed it.
            (PeerStatus::Disconnected { .. }, None) => Ok(self.seq),
            (PeerStatus::Lost(err), None) => Err(match &self.transport {
                Some(transport) => format!("{err} (after {transport})"),
                None => err.to_string(),
            }),
            (PeerStatus::Alive, None) => return,
        };
        self.retire(ctx, session, outcome);
    }

    fn on_idle(&mut self, ctx: &mut Ctx<'_>) {
        if let (Some(conn), false) = (self.conn, self.waiting.is_empty()) {
            self.drain(ctx, conn);
        }
    }
}

/// Builds each peer's [`Echoer`] on the reactor that serves it.
struct Echoers {
    max_size: usize,
    finished: mpsc::Sender<()>,
}

impl HandlerFactory for Echoers {
    type Handler = Echoer;

    fn build(&self, session: &NewSession<'_>) -> rdma_comm_core::Result<Echoer> {
        let endpoint = session.endpoint;
        let peer = endpoint.peer();
        let protocol = |what: &str| Error::Protocol {
            peer,
            what: what.into(),
        };
        let client_inbox = endpoint
            .remote_region("inbox")
            .ok_or_else(|| protocol("it exported no inbox"))?;
        let inbox = endpoint.exports()[0]
            .memory
            .clone()
            .ok_or_else(|| protocol("its inbox is not readable"))?;
        println!("peer {peer} connected");
        Ok(Echoer {
            peer,
            retired: false,
            conn: None,
            inbox,
            client_inbox,
            scratch: vec![0; self.max_size],
            seq: 0,
            waiting: VecDeque::with_capacity(MAX_WINDOW),
            corrupt: None,
            transport: None,
            report: Report {
                line: None,
                finished: self.finished.clone(),
            },
        })
    }

    fn refused(&self, _reactor: usize, peer: SocketAddr, error: &Error) {
        println!("peer {peer} error: {error}");
        let _ = self.finished.send(());
    }
}

/// Bytes the C allocator counts in use over all its arenas, its own
/// mmapped blocks included: the Rust heap and the verbs provider's
/// allocations alike. Chunks a thread freed into its cache (glibc's
/// tcache) count as in use until they are reused. What the RSS also holds,
/// free pages the allocator keeps below a high-water mark, is not in it.
/// `None` without glibc's `mallinfo2` (glibc before 2.33): it is looked up
/// when asked for, so the program still links and runs there.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn heap_in_use() -> Option<usize> {
    type Mallinfo2 = unsafe extern "C" fn() -> libc::mallinfo2;
    // SAFETY: a C string naming a symbol; RTLD_DEFAULT searches the
    // libraries already loaded, and a missing symbol is a null pointer.
    let symbol = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"mallinfo2".as_ptr()) };
    if symbol.is_null() {
        return None;
    }
    // SAFETY: glibc's `mallinfo2` has this signature (malloc.h): no
    // arguments, a struct of `size_t`s returned by value.
    let mallinfo2: Mallinfo2 = unsafe { std::mem::transmute(symbol) };
    // SAFETY: it reads the allocator's counters under each arena's lock;
    // its MT-Unsafe notes (initialisation, `mallopt`) do not apply once
    // the program has allocated, and nothing here calls `mallopt`.
    let info = unsafe { mallinfo2() };
    Some(info.uordblks + info.hblkhd)
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn heap_in_use() -> Option<usize> {
    None
}

fn serve(args: &Args) -> rdma_comm_core::Result<bool> {
    let ctx = Context::open_default(args.dev.device.as_deref())?;
    let pd = ctx.alloc_pd()?;
    let max_size = args.max_size.max(1);
    // A full client window plus the credits the reactor keeps in reserve.
    let depth = MAX_WINDOW as u32 + 8;
    let (finished, outcomes) = mpsc::channel();
    let config = RuntimeConfig {
        reactors: args.runtime.reactors.into(),
        cores: args.runtime.core_choice(false)?,
        reactor: reactor_config(args, max_size, depth, 1, MAX_PEERS_AT_ONCE),
        policy: PlacementPolicy::FewestSessions,
        ..RuntimeConfig::default()
    };
    let factory = Echoers {
        max_size,
        finished: finished.clone(),
    };
    let mut runtime = Runtime::start(&pd, config, factory)?;
    println!("runtime: {}", runtime.plan());
    let mut config = runtime.server_config(AccessFlags::REMOTE_WRITE);
    args.dev.apply(&mut config.qp);
    config.max_peers = args.max_peers;
    config.handshake_timeout = Duration::from_millis(args.handshake_timeout_ms);
    config.auth_key = args.auth.key()?;
    config.transport = args.transport.transport();
    config.exports = Some(Arc::new(move |_peer: SocketAddr, pd: &ProtectionDomain| {
        // Each peer writes into its own inbox, through a window bound to its
        // own QP: no peer can touch another's inbox, even knowing its key.
        Ok(vec![Export::shared(
            1,
            "inbox",
            Arc::new(pd.alloc_mr(max_size, AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND)?),
            AccessFlags::REMOTE_WRITE,
        )])
    }));
    // On stdout, one line each, as tests and scripts read them; escaped,
    // as `common::report_refusals` does, since the reason may quote what a
    // stranger sent.
    config.on_failure = Some(Arc::new(|failure: &HandshakeFailure| {
        println!("rejected {}: {:?}", failure.peer, failure.error.to_string());
    }));
    let addr = runtime.serve(args.listen.as_str(), config)?;
    println!("listening on {addr}");
    // Every peer ends with one outcome (done, error, or refused by its
    // reactor); the reactors report them. Waiting here costs nothing.
    drop(finished);
    let mut served = 0;
    let report_every = args.heap_report_ms.map(Duration::from_millis);
    let mut next_report = Instant::now();
    while args.max_peers.is_none_or(|max| served < max) {
        let Some(every) = report_every else {
            if outcomes.recv().is_err() {
                break;
            }
            served += 1;
            continue;
        };
        if Instant::now() >= next_report {
            match heap_in_use() {
                Some(bytes) => println!("heap: {bytes} B in use"),
                None => println!("heap: unknown (no glibc mallinfo2)"),
            }
            next_report = Instant::now() + every;
        }
        match outcomes.recv_timeout(next_report.saturating_duration_since(Instant::now())) {
            Ok(_) => served += 1,
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    // Let handshakes still in progress end on their own (each by its
    // timeout), so their failures are reported rather than cut short.
    while runtime.pending_handshakes() > 0 {
        std::thread::sleep(Duration::from_millis(50));
    }
    runtime.stop();
    for reactor in runtime.join()? {
        println!("{reactor}");
    }
    Ok(true)
}
