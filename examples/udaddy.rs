//! udaddy over this crate's connection manager (`verbs::cm`, `RDMA_PS_UDP`)
//! and UD queue pairs, compatible with rdma-core's `udaddy`: either side of
//! ours talks to the other side of theirs.
//!
//! ```text
//! udaddy --insecure [-b ADDR] [--port PORT] [-C COUNT] [-S SIZE] [--timeout SECS]   (server)
//! udaddy -s ADDR [-b ADDR] [--port PORT] [-C COUNT] [-S SIZE] [--timeout SECS]      (client)
//! ```
//!
//! The client resolves the server, asks for its QP through the connection
//! manager, and on `Established` sends `-C` datagrams of `-S` bytes, each
//! a SEND with immediate data carrying its own QP number (udaddy's server
//! answers the QP that number names); then it counts the answers. The
//! server accepts one client, answers each datagram at the address its
//! completion gives (the same bytes, with its own QP number as immediate
//! data), and stops after `-C` of them. Each side prints one line and exits
//! 0 when `-C` datagrams went each way, 1 otherwise (a timeout, an error).
//! As with udaddy, both sides must use the same `-C` and `-S`.

use std::net::{SocketAddr, ToSocketAddrs};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;

mod common;

use rdma_comm_core::verbs::cm::{CmEventKind, EventChannel};
use rdma_comm_core::verbs::{
    AccessFlags, CompletionQueue, GRH_BYTES, MemoryRegion, RecvRequest, UdConfig, UdDestination,
    UdQueuePair, UdSend, WcOpcode, WorkCompletion, datagram_payload,
};
use rdma_comm_core::{Error, Result};

/// udaddy's largest datagram here: a 4096-byte MTU.
const MAX_SIZE: usize = 4096;
/// udaddy's address and route resolution timeout.
const RESOLVE_TIMEOUT: Duration = Duration::from_millis(2000);
/// Receives kept posted.
const RECEIVES: usize = 64;

/// UD datagrams through the connection manager, compatible with rdma-core's udaddy.
#[derive(Parser, Debug)]
#[command(disable_version_flag = true)]
struct Args {
    /// Client: the server's address (without it, this is the server).
    #[arg(short = 's', value_name = "ADDR")]
    server: Option<String>,
    /// Address to bind to (server; default every address) or send from (client).
    #[arg(short = 'b', value_name = "ADDR")]
    bind: Option<String>,
    /// Port.
    #[arg(long, default_value_t = 7174, value_parser = common::range(1u16, u16::MAX))]
    port: u16,
    /// Datagrams each way, 1 to 100000 (udaddy's default: 10).
    #[arg(short = 'C', default_value_t = 10, value_parser = common::range(1u32, 100_000))]
    count: u32,
    /// Bytes per datagram, 1 to 4096 and at most the port's MTU (udaddy's
    /// default: 100).
    #[arg(short = 'S', default_value_t = 100, value_parser = common::range(1usize, MAX_SIZE))]
    size: usize,
    /// Seconds to wait for the peer, the connection and the datagrams, 1 to 3600.
    #[arg(long, default_value_t = 30, value_parser = common::range(1u64, 3600))]
    timeout: u64,
    /// Serve anyone who reaches the port (server): udaddy's protocol has no
    /// authentication, so the server runs only when told so.
    #[arg(long)]
    insecure: bool,
}

fn main() -> ExitCode {
    common::init_logging();
    let args: Args = common::parse("udaddy");
    let (target, source) = match check(&args) {
        Ok(addrs) => addrs,
        Err(refusal) => return refusal.exit("udaddy"),
    };
    let timeout = Duration::from_secs(args.timeout);
    let result = if args.server.is_some() {
        client(&args, target, source, timeout)
    } else {
        log::warn!(
            "udaddy server on {target}: answers anyone who reaches it (udaddy has no authentication: --insecure)"
        );
        server(&args, target, timeout)
    };
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(err) => {
            eprintln!("udaddy: {err}");
            ExitCode::FAILURE
        }
    }
}

/// The server's bind address or the client's target, and the client's
/// source: resolved before anything is opened. A server needs
/// `--insecure`, and a client gets no `--insecure` (it would mean nothing).
fn check(args: &Args) -> std::result::Result<(SocketAddr, Option<SocketAddr>), common::Refusal> {
    match &args.server {
        None if !args.insecure => Err(common::Refusal::of(
            "--insecure",
            "udaddy's protocol has no authentication, so its server answers anyone: add --insecure to run it (or -s ADDR for the client)",
        )),
        None => {
            let bind = args.bind.as_deref().unwrap_or("0.0.0.0");
            Ok((socket_addr("-b", bind, args.port)?, None))
        }
        Some(_) if args.insecure => Err(common::Refusal::of(
            "--insecure",
            "only the server takes it (the client is -s ADDR)",
        )),
        Some(server) => Ok((
            socket_addr("-s", server, args.port)?,
            args.bind
                .as_deref()
                .map(|source| socket_addr("-b", source, 0))
                .transpose()?,
        )),
    }
}

/// `flag`'s ADDR (a name or an address) with `port`.
fn socket_addr(
    flag: &str,
    host: &str,
    port: u16,
) -> std::result::Result<SocketAddr, common::Refusal> {
    let refuse = |why: String| {
        common::Refusal::new(
            flag,
            host,
            format!("must be a host name or address ({why})"),
        )
    };
    (host, port)
        .to_socket_addrs()
        .map_err(|err| refuse(err.to_string()))?
        .next()
        .ok_or_else(|| refuse("it has no address".into()))
}

/// A UD QP's CQs and buffers: `RECEIVES` receive slots of GRH + size, and
/// one send buffer.
struct Buffers {
    send_cq: CompletionQueue,
    recv_cq: CompletionQueue,
    rx: MemoryRegion,
    tx: MemoryRegion,
    slot: usize,
}

impl Buffers {
    fn post(&self, qp: &mut UdQueuePair, slot: usize) -> Result<()> {
        qp.post_recv(&mut RecvRequest::new(
            slot as u64,
            self.rx.slice(slot * self.slot, self.slot)?,
        )?)
    }

    /// Sends `len` bytes of the send buffer to `to`, with this QP's number
    /// as immediate data (as udaddy does), and waits for the completion.
    fn send(&mut self, qp: &mut UdQueuePair, len: usize, to: &UdDestination) -> Result<()> {
        let qpn = qp.qpn();
        let mut request = UdSend::new(0, self.tx.slice(0, len)?, to)
            .with_imm(qpn)
            .signaled();
        qp.post_send(&mut request)?;
        let mut wcs = [WorkCompletion::default(); 1];
        loop {
            if let Some(wc) = self.send_cq.poll(&mut wcs)?.first() {
                wc.ok()?;
                return Ok(());
            }
            std::hint::spin_loop();
        }
    }
}

/// The CQs and buffers for a QP on the id's device, and the QP itself.
fn resources(
    id: &rdma_comm_core::verbs::cm::CmId,
    size: usize,
) -> Result<(
    Buffers,
    UdQueuePair,
    rdma_comm_core::verbs::ProtectionDomain,
)> {
    let ctx = id.context()?;
    let pd = ctx.alloc_pd()?;
    let send_cq = ctx.create_cq(16, None)?;
    let recv_cq = ctx.create_cq(RECEIVES as u32, None)?;
    let config = UdConfig {
        max_send_wr: 16,
        max_recv_wr: RECEIVES as u32,
        ..UdConfig::default()
    };
    let mut qp = id.create_ud_qp(&pd, &send_cq, &recv_cq, &config)?;
    if size > qp.max_datagram() as usize {
        return Err(Error::InvalidArgument(
            "-S: larger than the port's MTU (UdQueuePair::max_datagram)",
        ));
    }
    let slot = GRH_BYTES + size;
    let buffers = Buffers {
        rx: pd.alloc_mr(RECEIVES * slot, AccessFlags::LOCAL_WRITE)?,
        tx: pd.alloc_mr(size, AccessFlags::empty())?,
        send_cq,
        recv_cq,
        slot,
    };
    for slot in 0..RECEIVES {
        buffers.post(&mut qp, slot)?;
    }
    Ok((buffers, qp, pd))
}

/// The payload byte `i` of datagram `seq`.
fn pattern(seq: u32, i: usize) -> u8 {
    (seq as u8).wrapping_mul(31).wrapping_add(i as u8)
}

fn server(args: &Args, bind: SocketAddr, timeout: Duration) -> Result<bool> {
    let channel = EventChannel::new()?;
    let mut listener = channel.create_ud_id()?;
    listener.bind(bind)?;
    listener.listen(1)?;
    eprintln!("udaddy: listening on {bind}");
    let mut event = channel.expect(&listener, CmEventKind::ConnectRequest, timeout)?;
    let request = event
        .take_request()
        .ok_or(Error::InvalidArgument("a connect request without its id"))?;
    drop(event);
    let peer = request.peer_addr();
    let (mut buffers, mut qp, _pd) = resources(request.id(), args.size)?;
    let _id = request.accept_ud(&qp, &[])?;
    let deadline = Instant::now() + timeout;
    let (mut answered, mut grh) = (0u32, [0u8; GRH_BYTES]);
    let mut datagram = vec![0; args.size];
    let mut wcs = [WorkCompletion::default(); 16];
    while answered < args.count && Instant::now() < deadline {
        let polled = buffers.recv_cq.poll(&mut wcs)?.len();
        for &wc in &wcs[..polled] {
            wc.ok()?;
            let slot = wc.wr_id() as usize;
            let base = slot * buffers.slot;
            // Anything that is not a datagram of at most -S bytes is not
            // answered, but counts against nothing.
            if let Some(payload) = datagram_payload(&wc).filter(|p| p.len() <= args.size) {
                let len = payload.len();
                buffers.rx.read(base, &mut grh)?;
                buffers
                    .rx
                    .read(base + payload.start, &mut datagram[..len])?;
                let to = qp.reply_destination(&wc, &grh)?;
                buffers.tx.write(0, &datagram[..len])?;
                buffers.send(&mut qp, len, &to)?;
                answered += 1;
            }
            buffers.post(&mut qp, slot)?;
        }
    }
    let from = peer.map_or_else(|| "an unknown peer".to_string(), |p| p.to_string());
    println!(
        "answered {answered} of {} datagrams from {from}",
        args.count
    );
    Ok(answered == args.count)
}

fn client(
    args: &Args,
    server: SocketAddr,
    source: Option<SocketAddr>,
    timeout: Duration,
) -> Result<bool> {
    let channel = EventChannel::new()?;
    let mut id = channel.create_ud_id()?;
    id.resolve_addr(source, server, RESOLVE_TIMEOUT)?;
    channel.expect(&id, CmEventKind::AddrResolved, RESOLVE_TIMEOUT)?;
    id.resolve_route(RESOLVE_TIMEOUT)?;
    channel.expect(&id, CmEventKind::RouteResolved, RESOLVE_TIMEOUT)?;
    let (mut buffers, mut qp, _pd) = resources(&id, args.size)?;
    id.connect_ud(&qp, &[])?;
    let to = channel
        .expect(&id, CmEventKind::Established, timeout)?
        .ud_destination(&qp)?;
    eprintln!(
        "udaddy: {server} answered: QP {:#x}, Q_Key {:#x}",
        to.qpn(),
        to.qkey()
    );
    let mut datagram = vec![0; args.size];
    for seq in 0..args.count {
        for (i, byte) in datagram.iter_mut().enumerate() {
            *byte = pattern(seq, i);
        }
        buffers.tx.write(0, &datagram)?;
        buffers.send(&mut qp, args.size, &to)?;
    }
    let deadline = Instant::now() + timeout;
    let mut answers = 0u32;
    let mut wcs = [WorkCompletion::default(); 16];
    while answers < args.count && Instant::now() < deadline {
        let polled = buffers.recv_cq.poll(&mut wcs)?.len();
        for &wc in &wcs[..polled] {
            wc.ok()?;
            if wc.opcode() == WcOpcode::RECV && datagram_payload(&wc).is_some() {
                answers += 1;
            }
            buffers.post(&mut qp, wc.wr_id() as usize)?;
        }
    }
    println!(
        "sent {} datagrams of {} B to {server}, received {answers} answers",
        args.count, args.size
    );
    Ok(answers == args.count)
}
