//! An RDMA `cat`: moves a byte stream from one process's stdin to another's
//! stdout over an RC QP, optionally through relays.
//!
//! ```text
//! rdma_cat recv --listen 7480 > out
//! rdma_cat relay --listen 7481 --to HOST:7480
//! rdma_cat send HOST:7481 < in
//! ```
//!
//! Blocks are read from stdin straight into registered send slots and
//! written to stdout straight from the receive slots they landed in; a relay
//! forwards each receive slot as it is, holding it until the downstream SEND
//! completes. Credits bound what is in flight at every hop, so a slow
//! consumer slows the producer and nothing is buffered without bound. The
//! sender exits 0 only after the receiver acknowledged every byte as written.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, IsTerminal, Read, Write};
use std::net::ToSocketAddrs;
use std::os::fd::AsFd;
use std::process::ExitCode;
use std::rc::Rc;
use std::time::{Duration, Instant};

mod common;

use clap::{Args, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use rdma_comm_core::reactor::*;
use rdma_comm_core::session::*;
use rdma_comm_core::verbs::*;

/// Stream stdin to a peer's stdout over RDMA.
#[derive(Parser, Debug)]
#[command(version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Read stdin and send it to a receiver or relay.
    Send {
        /// The receiver or relay.
        #[arg(value_name = "HOST:PORT")]
        peer: String,
        #[command(flatten)]
        opts: Opts,
    },
    /// Accept one sender and write what it sends to stdout.
    Recv {
        /// Port (or ADDR:PORT) to listen on.
        #[arg(long)]
        listen: String,
        #[command(flatten)]
        opts: Opts,
    },
    /// Accept one sender and forward its stream to the next hop.
    Relay {
        /// Port (or ADDR:PORT) to listen on.
        #[arg(long)]
        listen: String,
        /// The next receiver or relay.
        #[arg(long, value_name = "HOST:PORT")]
        to: String,
        #[command(flatten)]
        opts: Opts,
    },
}

#[derive(Args, Debug, Clone)]
struct Opts {
    #[command(flatten)]
    dev: common::DeviceArgs,
    #[command(flatten)]
    auth: common::AuthArgs,
    #[command(flatten)]
    reactor: common::ReactorArgs,
    /// Payload bytes per block, 1 B to 16 MiB.
    #[arg(long, default_value_t = 64 * 1024, value_parser = common::range(1usize, MAX_BLOCK))]
    block_size: usize,
    /// Blocks in flight per hop (receive ring and send slots), 4 to 4096.
    #[arg(long, default_value_t = 32, value_parser = common::range(4u32, 4096))]
    depth: u32,
    /// Seconds to keep trying to reach the next hop, at least 1.
    #[arg(long, default_value_t = 10, value_parser = common::at_least(1u64))]
    connect_timeout: u64,
    /// No progress line.
    #[arg(short, long)]
    quiet: bool,
}

/// The immediate that marks the receiver's acknowledgement: its payload is
/// the number of bytes it wrote. A block with no payload ends the stream.
const ACK_TAG: u32 = u32::from_be_bytes(*b"CAT!");
/// How often the control connections are checked for a vanished peer.
const PEER_CHECK_INTERVAL: Duration = Duration::from_millis(100);
/// After a peer hangs up, completions it sent just before may still be queued.
const LAST_WORDS: Duration = Duration::from_millis(200);
/// The disconnect code a finished role leaves with: "your acknowledgement
/// reached me". The acknowledging side can then stop without its own SEND
/// completion, which may wait on a transport ACK lost on the way back (the
/// sender's QP is gone by then, so only a retry timeout would end it).
const STREAM_DONE: u16 = u16::from_be_bytes(*b"OK");

/// Largest block (`--block-size`): 16 MiB.
const MAX_BLOCK: usize = 16 << 20;

type Failure = String;

fn main() -> ExitCode {
    common::init_logging();
    let mut cli: Cli = common::parse("rdma_cat");
    if let Err(refusal) = check(&mut cli.command) {
        return refusal.exit("rdma_cat");
    }
    let result = match &cli.command {
        Command::Send { peer, opts } => send(peer, opts),
        Command::Recv { listen, opts } => recv(listen, opts),
        Command::Relay { listen, to, opts } => relay(listen, to, opts),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) => {
            eprintln!("rdma_cat: {failure}");
            ExitCode::FAILURE
        }
    }
}

/// Checks what clap cannot before anything is opened: the addresses
/// resolve and the key is read.
fn check(command: &mut Command) -> Result<(), common::Refusal> {
    let opts = match command {
        Command::Send { peer, opts } => {
            common::address("peer", peer)?;
            opts
        }
        Command::Recv { listen, opts } => {
            check_listen(listen)?;
            opts
        }
        Command::Relay { listen, to, opts } => {
            check_listen(listen)?;
            common::address("--to", to)?;
            opts
        }
    };
    opts.auth.load()
}

/// `--listen`: a port, or an address and port that resolve.
fn check_listen(listen: &str) -> Result<(), common::Refusal> {
    match listen_addr(listen)
        .to_socket_addrs()
        .map(|mut addrs| addrs.next())
    {
        Ok(Some(_)) => Ok(()),
        Ok(None) => Err(common::Refusal::new(
            "--listen",
            listen,
            "must be PORT or ADDR:PORT (the address has none)",
        )),
        Err(err) => Err(common::Refusal::new(
            "--listen",
            listen,
            format!("must be PORT or ADDR:PORT ({err})"),
        )),
    }
}

/// Bytes moved, whether the far end acknowledged them all, and why not.
#[derive(Debug, Default)]
struct Status {
    bytes: u64,
    acked: bool,
    failure: Option<Failure>,
    /// A peer the reactor's watch found gone before the stream was
    /// acknowledged: when, which session, and how it left.
    left: Option<(Instant, SessionId, String)>,
}

impl Status {
    /// Records a peer that left (the reactor's peer watch); the run fails
    /// with it unless the stream completes within its last words.
    /// `acknowledged_to_it` says our acknowledgement to this peer is staged:
    /// its [`STREAM_DONE`] then means the acknowledgement arrived.
    fn peer_gone(&mut self, session: SessionId, status: &PeerStatus, acknowledged_to_it: bool) {
        let bytes = self.bytes;
        let what = match status {
            PeerStatus::Alive => return,
            PeerStatus::Disconnected { code: STREAM_DONE } if acknowledged_to_it => {
                self.acked = true;
                return;
            }
            PeerStatus::Disconnected { code } => format!(
                "closed the connection (code {code}) after {bytes} bytes, before the stream was acknowledged"
            ),
            PeerStatus::Lost(err) => format!("was lost after {bytes} bytes: {err}"),
        };
        self.left.get_or_insert((Instant::now(), session, what));
    }

    /// Records a failed connection (the first failure is the one reported).
    fn broke(&mut self, error: &rdma_comm_core::Error) {
        let bytes = self.bytes;
        self.failure
            .get_or_insert_with(|| format!("the stream broke after {bytes} bytes: {error}"));
    }
}

/// Reads stdin into send slots until EOF, then ends the stream and waits
/// for the receiver's count.
struct Sender {
    input: File,
    conn: Option<ConnId>,
    block: usize,
    batch: usize,
    end_staged: bool,
    status: Status,
}

impl Sender {
    fn pump(&mut self, ctx: &mut Ctx<'_>) {
        let Some(conn) = self.conn else { return };
        while !self.end_staged && self.status.failure.is_none() && ctx.staged(conn) < self.batch {
            let mut read = Ok(0);
            let input = &mut self.input;
            let staged = ctx.send_from(conn, self.block, None, |slot| {
                loop {
                    match input.read(slot) {
                        Ok(n) => {
                            read = Ok(n);
                            return Some(n);
                        }
                        Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
                        Err(err) => {
                            read = Err(err);
                            return None;
                        }
                    }
                }
            });
            match (staged, read) {
                (Ok(_), Ok(0)) => self.end_staged = true,
                (Ok(_), Ok(n)) => self.status.bytes += n as u64,
                (Err(SendError::WouldBlock), _) => break,
                (_, Err(err)) => self.status.failure = Some(format!("reading stdin: {err}")),
                (Err(err), _) => self.status.failure = Some(format!("sending: {err}")),
            }
        }
    }
}

impl Handler for Sender {
    fn on_peer_gone(&mut self, _ctx: &mut Ctx<'_>, session: SessionId, status: &PeerStatus) {
        self.status.peer_gone(session, status, false);
    }

    fn on_established(&mut self, ctx: &mut Ctx<'_>, conn: ConnId) {
        self.conn = Some(conn);
        self.pump(ctx);
    }

    fn on_message(&mut self, _ctx: &mut Ctx<'_>, _conn: ConnId, data: &[u8], imm: Option<u32>) {
        match ack_count(data, imm) {
            Some(count) if count == self.status.bytes && self.end_staged => {
                self.status.acked = true
            }
            Some(count) => {
                self.status.failure = Some(format!(
                    "the receiver acknowledged {count} bytes, but {} were sent",
                    self.status.bytes
                ))
            }
            None => self.status.failure = Some("unexpected message from the receiver".into()),
        }
    }

    fn on_send_complete(&mut self, ctx: &mut Ctx<'_>, _conn: ConnId, _seq: u32) {
        self.pump(ctx);
    }

    fn on_error(&mut self, _ctx: &mut Ctx<'_>, _conn: ConnId, error: &rdma_comm_core::Error) {
        self.status.broke(error);
    }

    fn on_idle(&mut self, ctx: &mut Ctx<'_>) -> Idle {
        self.pump(ctx);
        Idle::Again
    }
}

/// Stages the acknowledgement of `count` bytes, signaled so its completion
/// shows promptly; `Ok(None)` when there is no credit yet (retry later).
fn stage_ack(ctx: &mut Ctx<'_>, conn: ConnId, count: u64) -> Result<Option<u32>, SendError> {
    match ctx.send(conn, &count.to_le_bytes(), Some(ACK_TAG)) {
        Ok(seq) => {
            ctx.signal_staged(conn);
            Ok(Some(seq))
        }
        Err(SendError::WouldBlock) => Ok(None),
        Err(err) => Err(err),
    }
}

fn ack_count(data: &[u8], imm: Option<u32>) -> Option<u64> {
    let bytes: [u8; 8] = data.try_into().ok()?;
    (imm == Some(ACK_TAG)).then(|| u64::from_le_bytes(bytes))
}

/// Writes every block to stdout from its receive slot; at the end of the
/// stream, flushes and acknowledges the byte count.
struct Receiver {
    output: File,
    ended: Option<ConnId>,
    ack: Option<u32>,
    status: Status,
}

impl Receiver {
    fn try_ack(&mut self, ctx: &mut Ctx<'_>) {
        let Some(conn) = self.ended else { return };
        if self.ack.is_some() || self.status.failure.is_some() {
            return;
        }
        match stage_ack(ctx, conn, self.status.bytes) {
            Ok(seq) => self.ack = seq,
            Err(err) => self.status.failure = Some(format!("acknowledging: {err}")),
        }
    }
}

impl Handler for Receiver {
    fn on_peer_gone(&mut self, _ctx: &mut Ctx<'_>, session: SessionId, status: &PeerStatus) {
        // One peer only: it is the one we acknowledge.
        self.status.peer_gone(session, status, self.ack.is_some());
    }

    fn on_message(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, data: &[u8], _imm: Option<u32>) {
        if self.status.failure.is_some() {
            return;
        }
        if self.ended.is_some() {
            self.status.failure = Some("the sender sent data after the end of the stream".into());
        } else if data.is_empty() {
            if let Err(err) = self.output.flush() {
                self.status.failure = Some(format!("writing stdout: {err}"));
                return;
            }
            self.ended = Some(conn);
            self.try_ack(ctx);
        } else if let Err(err) = self.output.write_all(data) {
            self.status.failure = Some(format!("writing stdout: {err}"));
        } else {
            self.status.bytes += data.len() as u64;
        }
    }

    fn on_send_complete(&mut self, _ctx: &mut Ctx<'_>, _conn: ConnId, seq: u32) {
        if self.ack == Some(seq) {
            self.status.acked = true;
        }
    }

    fn on_error(&mut self, _ctx: &mut Ctx<'_>, _conn: ConnId, error: &rdma_comm_core::Error) {
        self.status.broke(error);
    }

    fn on_idle(&mut self, ctx: &mut Ctx<'_>) -> Idle {
        self.try_ack(ctx);
        Idle::Again
    }
}

/// Forwards upstream blocks downstream without copying them; blocks the
/// downstream has no credit for wait in order, still holding their receive
/// slots, which is what pushes back on the upstream sender.
struct Relay {
    /// The downstream connection, known once its session was added.
    down: Option<ConnId>,
    up: Option<ConnId>,
    waiting: VecDeque<HeldRecv>,
    end_forwarded: bool,
    down_acked: Option<u64>,
    up_ack: Option<u32>,
    status: Status,
}

impl Relay {
    fn drain(&mut self, ctx: &mut Ctx<'_>) {
        let Some(down) = self.down else {
            return;
        };
        while let Some(held) = self.waiting.pop_front() {
            let len = held.len();
            match ctx.forward(down, held, None) {
                Ok(_) => {
                    self.status.bytes += len as u64;
                    self.end_forwarded = len == 0;
                }
                Err((SendError::WouldBlock, held)) => {
                    self.waiting.push_front(held);
                    return;
                }
                Err((err, held)) => {
                    // Our own reactor's message: releasing it cannot fail.
                    let _ = ctx.release(held);
                    self.status.failure = Some(format!("forwarding: {err}"));
                    return;
                }
            }
        }
    }

    fn try_ack_upstream(&mut self, ctx: &mut Ctx<'_>) {
        let (Some(up), Some(count), None) = (self.up, self.down_acked, self.up_ack) else {
            return;
        };
        match stage_ack(ctx, up, count) {
            Ok(seq) => self.up_ack = seq,
            Err(err) => self.status.failure = Some(format!("acknowledging upstream: {err}")),
        }
    }
}

impl Handler for Relay {
    fn on_peer_gone(&mut self, ctx: &mut Ctx<'_>, session: SessionId, status: &PeerStatus) {
        let upstream = self.up.and_then(|up| ctx.session_of(up)) == Some(session);
        self.status
            .peer_gone(session, status, upstream && self.up_ack.is_some());
    }

    fn on_message(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, data: &[u8], imm: Option<u32>) {
        if Some(conn) == self.down {
            match ack_count(data, imm) {
                Some(count) if count == self.status.bytes && self.end_forwarded => {
                    self.down_acked = Some(count);
                    self.try_ack_upstream(ctx);
                }
                Some(count) => {
                    self.status.failure = Some(format!(
                        "downstream acknowledged {count} bytes, but {} were forwarded",
                        self.status.bytes
                    ))
                }
                None => self.status.failure = Some("unexpected message from downstream".into()),
            }
            return;
        }
        self.up = Some(conn);
        let Some(held) = ctx.hold() else { return };
        self.waiting.push_back(held);
        self.drain(ctx);
    }

    fn on_send_complete(&mut self, _ctx: &mut Ctx<'_>, conn: ConnId, seq: u32) {
        if Some(conn) == self.up && self.up_ack == Some(seq) {
            self.status.acked = true;
        }
    }

    fn on_error(&mut self, _ctx: &mut Ctx<'_>, conn: ConnId, error: &rdma_comm_core::Error) {
        let side = if Some(conn) == self.down {
            "downstream"
        } else {
            "upstream"
        };
        self.status
            .failure
            .get_or_insert_with(|| format!("{side}, after {} bytes: {error}", self.status.bytes));
    }

    fn on_idle(&mut self, ctx: &mut Ctx<'_>) -> Idle {
        self.drain(ctx);
        self.try_ack_upstream(ctx);
        Idle::Again
    }
}

fn reactor_config(opts: &Opts) -> ReactorConfig {
    // 4 to 4096, as the flag takes.
    let depth = opts.depth;
    ReactorConfig {
        event_mode: opts
            .reactor
            .event_mode_or(common::EventArg::Blocking)
            .into(),
        slot_size: opts.block_size + SLOT_RESERVE,
        recv_depth: depth,
        repost_batch: opts.reactor.repost_batch_or((depth / 4).max(1)),
        send_slots: depth,
        sq_depth: (2 * depth).max(64),
        signal_interval: opts.reactor.signal_interval,
        peer_check_interval: Some(PEER_CHECK_INTERVAL),
        ..ReactorConfig::default()
    }
    .absorbing(2)
}

fn listen_addr(listen: &str) -> String {
    match listen.parse::<u16>() {
        Ok(port) => format!("0.0.0.0:{port}"),
        Err(_) => listen.to_string(),
    }
}

fn accept_one<H: Handler>(
    listen: &str,
    pd: &ProtectionDomain,
    reactor: &mut Reactor<H>,
    opts: &Opts,
) -> Result<Endpoint, Failure> {
    let mut config = reactor.server_config(AccessFlags::empty());
    opts.dev.apply(&mut config.qp);
    config.max_peers = Some(1);
    opts.auth
        .secure(&mut config)
        .map_err(|err| err.to_string())?;
    common::report_refusals("rdma_cat", &mut config);
    let server = ServerSession::bind(listen_addr(listen).as_str(), pd, config)
        .map_err(|err| format!("listening on {listen}: {err}"))?;
    Ok(server.accept().ok_or("the listener stopped")?)
}

fn connect<H: Handler>(
    peer: &str,
    pd: &ProtectionDomain,
    reactor: &mut Reactor<H>,
    opts: &Opts,
) -> Result<Endpoint, Failure> {
    let mut spec = reactor.qp_spec("stream");
    opts.dev.apply(&mut spec.qp);
    let mut config = ClientConfig::new(vec![spec]);
    config.connect_deadline = Duration::from_secs(opts.connect_timeout);
    config.auth_key = opts.auth.key().map_err(|err| err.to_string())?;
    ClientSession::connect(peer, pd, &config).map_err(|err| format!("connecting to {peer}: {err}"))
}

fn open_device(opts: &Opts) -> Result<ProtectionDomain, Failure> {
    let ctx = Context::open_default(opts.dev.device.as_deref()).map_err(|err| err.to_string())?;
    ctx.alloc_pd().map_err(|err| err.to_string())
}

fn new_reactor<T: Handler>(
    pd: &ProtectionDomain,
    opts: &Opts,
) -> Result<Reactor<Rc<RefCell<T>>>, Failure> {
    Reactor::new(pd, reactor_config(opts)).map_err(|err| err.to_string())
}

fn progress_bar(opts: &Opts, total: Option<u64>) -> ProgressBar {
    if opts.quiet || !io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let template = match total {
        Some(_) => "{bytes}/{total_bytes} {wide_bar} {binary_bytes_per_sec} eta {eta}",
        None => "{bytes} {binary_bytes_per_sec} {elapsed}",
    };
    let bar = ProgressBar::with_draw_target(total, ProgressDrawTarget::stderr());
    if let Ok(style) = ProgressStyle::with_template(template) {
        bar.set_style(style);
    }
    bar
}

/// Turns the reactor until the role finishes or fails, watching every
/// session's control connection so a vanished peer ends the run promptly.
fn drive<T: Handler>(
    reactor: &mut Reactor<Rc<RefCell<T>>>,
    role: &Rc<RefCell<T>>,
    status_of: fn(&T) -> &Status,
    bar: &ProgressBar,
) -> Result<(), Failure> {
    // The reactor watches every session's peer (each role's on_peer_gone).
    let mut progress = reactor.pass_timer(PEER_CHECK_INTERVAL);
    loop {
        let completions = reactor.turn().map_err(|err| err.to_string())?;
        let acked = {
            let role = role.borrow();
            let status = status_of(&role);
            if let Some(failure) = &status.failure {
                return Err(failure.clone());
            }
            if status.acked {
                bar.set_position(status.bytes);
                bar.finish();
            }
            status.acked
        };
        if acked {
            // Both ends of every hop now know the stream arrived; say so to
            // the peers before leaving, so none waits for a SEND completion
            // whose transport ACK may have been lost.
            let sessions: Vec<SessionId> = reactor.sessions().collect();
            for session in sessions {
                if let Some(link) = reactor.link_mut(session) {
                    link.send_disconnect(STREAM_DONE);
                }
            }
            return Ok(());
        }
        if let Some((since, session, what)) = &status_of(&role.borrow()).left {
            if since.elapsed() > LAST_WORDS {
                let peer = reactor.link(*session).map(SessionLink::peer);
                return Err(match peer {
                    Some(peer) => format!("{peer} {what}"),
                    None => format!("the peer {what}"),
                });
            }
            continue;
        }
        if !progress.expired_after(completions) {
            continue;
        }
        bar.set_position(status_of(&role.borrow()).bytes);
    }
}

fn send(peer: &str, opts: &Opts) -> Result<(), Failure> {
    let pd = open_device(opts)?;
    let input = File::from(
        io::stdin()
            .as_fd()
            .try_clone_to_owned()
            .map_err(|err| format!("stdin: {err}"))?,
    );
    let total = input
        .metadata()
        .ok()
        .filter(|meta| meta.is_file())
        .map(|meta| meta.len());
    let mut reactor = new_reactor::<Sender>(&pd, opts)?;
    let endpoint = connect(peer, &pd, &mut reactor, opts)?;
    let sender = Sender {
        input,
        conn: None,
        block: opts.block_size,
        batch: opts.reactor.batch_or(16),
        end_staged: false,
        status: Status::default(),
    };
    run_one(
        reactor,
        endpoint,
        sender,
        |s| &s.status,
        &progress_bar(opts, total),
    )
}

/// Runs a single-peer role to its end.
fn run_one<T: Handler>(
    mut reactor: Reactor<Rc<RefCell<T>>>,
    endpoint: Endpoint,
    role: T,
    status_of: fn(&T) -> &Status,
    bar: &ProgressBar,
) -> Result<(), Failure> {
    let role = Rc::new(RefCell::new(role));
    reactor
        .add(endpoint, Rc::clone(&role))
        .map_err(|err| err.to_string())?;
    drive(&mut reactor, &role, status_of, bar)
}

fn recv(listen: &str, opts: &Opts) -> Result<(), Failure> {
    let pd = open_device(opts)?;
    let output = File::from(
        io::stdout()
            .as_fd()
            .try_clone_to_owned()
            .map_err(|err| format!("stdout: {err}"))?,
    );
    let mut reactor = new_reactor::<Receiver>(&pd, opts)?;
    let endpoint = accept_one(listen, &pd, &mut reactor, opts)?;
    let receiver = Receiver {
        output,
        ended: None,
        ack: None,
        status: Status::default(),
    };
    run_one(
        reactor,
        endpoint,
        receiver,
        |s| &s.status,
        &progress_bar(opts, None),
    )
}

fn relay(listen: &str, to: &str, opts: &Opts) -> Result<(), Failure> {
    let pd = open_device(opts)?;
    let mut reactor = new_reactor::<Relay>(&pd, opts)?;
    // Downstream first: a relay that cannot reach its next hop should not
    // accept a sender it would only fail. Its receive ring is posted (by
    // `add`) before we wait for the sender, so the next hop's first credit
    // update finds a receive however long that takes.
    let downstream = connect(to, &pd, &mut reactor, opts)?;
    let role = Rc::new(RefCell::new(Relay {
        down: None,
        up: None,
        waiting: VecDeque::with_capacity(opts.depth as usize),
        end_forwarded: false,
        down_acked: None,
        up_ack: None,
        status: Status::default(),
    }));
    let down_session = reactor
        .add(downstream, Rc::clone(&role))
        .map_err(|err| err.to_string())?;
    role.borrow_mut().down = Some(
        reactor
            .conns(down_session)
            .next()
            .ok_or("the downstream endpoint has no channel")?,
    );
    let upstream = accept_one(listen, &pd, &mut reactor, opts)?;
    reactor
        .add(upstream, Rc::clone(&role))
        .map_err(|err| err.to_string())?;
    drive(
        &mut reactor,
        &role,
        |s| &s.status,
        &progress_bar(opts, None),
    )
}
