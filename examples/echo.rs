//! An echo server and a verifying client: the smallest complete service on
//! the reactor, and a template for one.
//!
//! ```text
//! echo --loopback [--count 10000] [--size 64]
//! echo --server [--listen 0.0.0.0:7471] [-d DEVICE] (--auth-key-file KEY | --insecure)
//! echo --connect HOST:7471 [--count 10000] [--size 64] [-d DEVICE] (--auth-key-file KEY | --insecure)
//! ```
//!
//! The server sends every message back straight from its receive slot. The
//! client sends `--count` messages one at a time, checks every byte and
//! immediate of every echo, and exits non-zero unless all came back intact.
//! `--loopback` runs both on one reactor over the in-process loopback
//! device: no NIC, no network, no key.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::rc::Rc;
use std::time::Instant;

mod common;

use clap::Parser;
use rdma_comm_core::prelude::*;

/// An echo server and a client that verifies every echo.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Serve echoes.
    #[arg(long, conflicts_with_all = ["connect", "loopback", "count", "size"])]
    server: bool,
    /// Address to listen on (server).
    #[arg(long, default_value = "0.0.0.0:7471")]
    listen: String,
    /// Server to connect to (client).
    #[arg(long, value_name = "HOST:PORT", conflicts_with_all = ["loopback", "listen"])]
    connect: Option<String>,
    /// Both ends in this process over the loopback device (no NIC, no
    /// network, no key).
    #[arg(long, conflicts_with_all = ["listen", "device", "auth_key_file", "insecure"])]
    loopback: bool,
    /// Messages the client sends, 1 to 10^12.
    #[arg(long, default_value_t = 10_000, value_parser = common::range(1u64, 1_000_000_000_000))]
    count: u64,
    /// Bytes per message, 8 to 4092 (a receive slot of 4 KiB, less the
    /// reactor's 4).
    #[arg(long, default_value_t = 64, value_parser = common::range(8usize, 4092))]
    size: usize,
    /// RDMA device (default: the first with an active port).
    #[arg(short = 'd', long)]
    device: Option<String>,
    #[command(flatten)]
    auth: common::AuthArgs,
}

fn main() -> ExitCode {
    common::init_logging();
    let mut args: Args = common::parse("echo");
    if !(args.server || args.loopback || args.connect.is_some()) {
        return common::Refusal::of(
            "--server",
            "say --server, --connect HOST:PORT or --loopback",
        )
        .exit("echo");
    }
    // Every argument is checked before a device is opened.
    let checked = if args.loopback {
        Ok(None)
    } else {
        let (flag, text) = match &args.connect {
            Some(server) => ("--connect", server.as_str()),
            None => ("--listen", args.listen.as_str()),
        };
        args.auth
            .load()
            .and_then(|()| common::address(flag, text))
            .map(|addrs| Some(addrs[0]))
    };
    let addr = match checked {
        Ok(addr) => addr,
        Err(refusal) => return refusal.exit("echo"),
    };
    let outcome = match addr {
        None => loopback(&args),
        Some(addr) if args.server => server(&args, addr),
        Some(addr) => client(&args, addr),
    };
    match outcome {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(err) => {
            eprintln!("echo: {err}");
            ExitCode::FAILURE
        }
    }
}

/// The server's side of a session: sends each message back from its own
/// receive slot (no copy). A message it cannot send yet (the client has no
/// receive posted for it: `WouldBlock`) waits, in order, and goes out from
/// `on_writable` or the next message. The reactor reposts a slot once its echo
/// is sent, and the client is granted only as many messages as there are
/// slots, so at most `recv_depth` ever wait: the queue is sized for that
/// up front and never grows.
struct Echo {
    waiting: VecDeque<(ConnId, HeldRecv, Option<u32>)>,
}

impl Echo {
    fn new(config: &ReactorConfig) -> Self {
        Echo {
            waiting: VecDeque::with_capacity(config.recv_depth as usize),
        }
    }

    fn drain(&mut self, ctx: &mut Ctx<'_>) {
        while let Some((conn, held, imm)) = self.waiting.pop_front() {
            match ctx.forward(conn, held, imm) {
                Ok(_) => {}
                Err((SendError::WouldBlock, held)) => {
                    self.waiting.push_front((conn, held, imm));
                    return;
                }
                // The connection is gone or failed (on_error says why):
                // its message goes back to its ring.
                Err((_, held)) => {
                    let _ = ctx.release(held);
                }
            }
        }
    }
}

impl Handler for Echo {
    fn on_message(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, _data: &[u8], imm: Option<u32>) {
        if let Some(held) = ctx.hold() {
            self.waiting.push_back((conn, held, imm));
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

/// The client: one message in flight, each checked when it comes back.
struct Client {
    conn: Option<ConnId>,
    message: Vec<u8>,
    sent: u64,
    echoed: u64,
    count: u64,
    intact: bool,
}

impl Client {
    fn new(count: u64, size: usize) -> Self {
        Client {
            conn: None,
            message: vec![0; size],
            sent: 0,
            echoed: 0,
            count,
            intact: true,
        }
    }

    /// Every message came back, or one came back altered: the run is over.
    fn finished(&self) -> bool {
        self.echoed == self.count || !self.intact
    }

    /// Sends the next message unless one is in flight. `WouldBlock` (the
    /// server's receives not yet announced) is retried from `on_writable`.
    fn send_next(&mut self, ctx: &mut Ctx<'_>) {
        let Some(conn) = self.conn else { return };
        if self.sent > self.echoed || self.sent == self.count || !self.intact {
            return;
        }
        fill(&mut self.message, self.sent);
        match ctx.send(conn, &self.message, Some(self.sent as u32)) {
            Ok(_) => self.sent += 1,
            Err(SendError::WouldBlock) => {}
            Err(err) => {
                eprintln!("echo: send: {err}");
                self.intact = false;
                ctx.stop();
            }
        }
    }
}

impl Handler for Client {
    fn on_established(&mut self, ctx: &mut Ctx<'_>, conn: ConnId) {
        self.conn = Some(conn);
        self.send_next(ctx);
    }

    fn on_message(&mut self, ctx: &mut Ctx<'_>, _conn: ConnId, data: &[u8], imm: Option<u32>) {
        fill(&mut self.message, self.echoed);
        if data != self.message.as_slice() || imm != Some(self.echoed as u32) {
            eprintln!("echo: message {} came back altered", self.echoed);
            self.intact = false;
        }
        self.echoed += 1;
        self.send_next(ctx);
    }

    fn on_writable(&mut self, ctx: &mut Ctx<'_>, _conn: ConnId) {
        self.send_next(ctx);
    }

    fn on_error(&mut self, ctx: &mut Ctx<'_>, _conn: ConnId, error: &Error) {
        eprintln!("echo: the connection failed: {error}");
        self.intact = false;
        ctx.stop();
    }

    fn on_peer_gone(&mut self, ctx: &mut Ctx<'_>, _session: SessionId, status: &PeerStatus) {
        eprintln!("echo: the server left: {status:?}");
        self.intact = false;
        ctx.stop();
    }
}

/// Message `seq`'s bytes: its number, then a pattern of it.
fn fill(message: &mut [u8], seq: u64) {
    message[..8].copy_from_slice(&seq.to_le_bytes());
    for (i, byte) in message[8..].iter_mut().enumerate() {
        *byte = (seq as u8).wrapping_mul(31).wrapping_add(i as u8);
    }
}

fn report(client: &Client, started: Instant) -> bool {
    let ok = client.intact && client.echoed == client.count;
    println!(
        "{} of {} messages of {} B echoed{}, in {:.1?}",
        client.echoed,
        client.count,
        client.message.len(),
        if ok { ", every byte intact" } else { "" },
        started.elapsed()
    );
    ok
}

/// Server: one reactor per core (a runtime), each session placed on one.
fn server(args: &Args, addr: SocketAddr) -> Result<bool> {
    let pd = Context::open_default(args.device.as_deref())?.alloc_pd()?;
    // The reactors' peer watch (every second) finds departed clients,
    // whose sessions on_peer_gone removes.
    let config = RuntimeConfig::default();
    let reactor_config = config.reactor.clone();
    let mut runtime = Runtime::start(&pd, config, move |_: &NewSession<'_>| {
        Ok(Echo::new(&reactor_config))
    })?;
    let mut server = runtime.server_config(AccessFlags::empty());
    args.auth.secure(&mut server)?;
    let local = runtime.serve(addr, server)?;
    println!("echo: serving on {local}");
    runtime.join()?;
    Ok(true)
}

/// Client: one reactor on this thread, one session.
fn client(args: &Args, addr: SocketAddr) -> Result<bool> {
    let pd = Context::open_default(args.device.as_deref())?.alloc_pd()?;
    let mut reactor = Reactor::new(&pd, ReactorConfig::default())?;
    let config = ClientConfig::new(vec![reactor.qp_spec("echo")]).with_auth_key(args.auth.key()?);
    let started = Instant::now();
    let session = reactor.add(
        ClientSession::connect(addr, &pd, &config)?,
        Client::new(args.count, args.size),
    )?;
    // Until every message came back, or stopped by a failure (`ctx.stop()`),
    // which the report shows.
    let _ = reactor.run_until(|reactor| reactor.handler(session).is_some_and(Client::finished))?;
    Ok(reactor
        .handler(session)
        .is_some_and(|client| report(client, started)))
}

/// Both ends on one reactor over the loopback device.
fn loopback(args: &Args) -> Result<bool> {
    // SAFETY: `Context::loopback` requires that no other thread touches
    // registered bytes a post may copy: this thread serves every QP of the
    // device, and nothing else in the process uses it.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd()?;
    let config = ReactorConfig::default();
    let mut reactor: Reactor<Box<dyn Handler>, NoLink> = Reactor::new(&pd, config.clone())?;
    let (client_qp, server_qp) = reactor.connected_pair(&pd, AccessFlags::empty())?;
    reactor.add(vec![server_qp], Box::new(Echo::new(&config)))?;
    // Shared with the reactor, to read the outcome once it has run.
    let client = Rc::new(RefCell::new(Client::new(args.count, args.size)));
    let started = Instant::now();
    reactor.add(vec![client_qp], Box::new(Rc::clone(&client)))?;
    let _ = reactor.run_until(|_| client.borrow().finished())?;
    Ok(report(&client.borrow(), started))
}
