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
//! server accepts one client, answers each of its datagrams at the address
//! its completion gives (the same bytes, with its own QP number as
//! immediate data), and stops after `-C` of them. The QP a datagram's
//! immediate data names is not trusted: answers go to the completion's
//! source QP. Datagrams from any other address, longer than `-S` or failed
//! are neither answered nor counted. The client checks every answer (its
//! source QP, length and bytes) and retries its connect while the server
//! is not listening yet, until `--timeout`. Each side keeps a receive
//! posted for every datagram (`-C`), prints one line and exits 0 when `-C`
//! datagrams went each way, 1 otherwise (a timeout, an error). As with
//! udaddy, both sides must use the same `-C` and `-S`.

use std::net::{IpAddr, SocketAddr};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;

mod common;

use rdma_comm_core::error::CmFailure;
use rdma_comm_core::verbs::cm::{CmEventKind, EventChannel};
use rdma_comm_core::verbs::{
    AccessFlags, CompletionQueue, GRH_BYTES, Gid, MemoryRegion, RecvRequest, UdConfig,
    UdDestination, UdQueuePair, UdSend, WcOpcode, WorkCompletion, datagram_payload,
    datagram_sender,
};
use rdma_comm_core::{Error, Result};

/// udaddy's largest datagram here: a 4096-byte MTU.
const MAX_SIZE: usize = 4096;
/// udaddy's address and route resolution timeout.
const RESOLVE_TIMEOUT: Duration = Duration::from_millis(2000);
/// Most datagrams each way (`-C`): a receive stays posted for each.
const MAX_COUNT: u32 = 4096;
/// How long a send may take to complete: the device reports it within
/// microseconds, unless it is broken.
const SEND_TIMEOUT: Duration = Duration::from_secs(5);
/// Pause between empty polls: udaddy is not a latency test, and the
/// machine's cores are shared.
const IDLE_PAUSE: Duration = Duration::from_micros(100);
/// Pause between connect attempts while the server is not listening.
const RETRY_PAUSE: Duration = Duration::from_millis(200);

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
    /// Datagrams each way, 1 to 4096 (udaddy's default: 10).
    #[arg(short = 'C', default_value_t = 10, value_parser = common::range(1u32, MAX_COUNT))]
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
            Ok((common::host("-b", bind, args.port)?, None))
        }
        Some(_) if args.insecure => Err(common::Refusal::of(
            "--insecure",
            "only the server takes it (the client is -s ADDR)",
        )),
        Some(server) => Ok((
            common::host("-s", server, args.port)?,
            args.bind
                .as_deref()
                .map(|source| common::host("-b", source, 0))
                .transpose()?,
        )),
    }
}

/// A UD QP's CQs and buffers: a receive slot of GRH + size for each
/// datagram, and one send buffer.
struct Buffers {
    send_cq: CompletionQueue,
    recv_cq: CompletionQueue,
    rx: MemoryRegion,
    tx: MemoryRegion,
    slot: usize,
}

/// Polls `cq` until it reports a completion, or `deadline` passes (then
/// nothing), pausing between empty polls.
fn poll_until<'w>(
    cq: &mut CompletionQueue,
    wcs: &'w mut [WorkCompletion],
    deadline: Instant,
) -> Result<&'w [WorkCompletion]> {
    loop {
        let polled = cq.poll(wcs)?.len();
        if polled > 0 || Instant::now() >= deadline {
            return Ok(&wcs[..polled]);
        }
        std::thread::sleep(IDLE_PAUSE);
    }
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
        let deadline = Instant::now() + SEND_TIMEOUT;
        match poll_until(&mut self.send_cq, &mut wcs, deadline)?.first() {
            Some(wc) => wc.ok().map(drop),
            None => Err(Error::Os {
                what: "waiting for a datagram's send completion",
                source: std::io::ErrorKind::TimedOut.into(),
            }),
        }
    }
}

/// The CQs and buffers for a QP on the id's device, and the QP itself.
fn resources(
    id: &rdma_comm_core::verbs::cm::CmId,
    size: usize,
    count: u32,
) -> Result<(
    Buffers,
    UdQueuePair,
    rdma_comm_core::verbs::ProtectionDomain,
)> {
    let ctx = id.context()?;
    let pd = ctx.alloc_pd()?;
    let send_cq = ctx.create_cq(16, None)?;
    let recv_cq = ctx.create_cq(count, None)?;
    let config = UdConfig {
        max_send_wr: 16,
        max_recv_wr: count,
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
        rx: pd.alloc_mr(count as usize * slot, AccessFlags::LOCAL_WRITE)?,
        tx: pd.alloc_mr(size, AccessFlags::empty())?,
        send_cq,
        recv_cq,
        slot,
    };
    for slot in 0..count as usize {
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
    let (mut buffers, mut qp, _pd) = resources(request.id(), args.size, args.count)?;
    let _id = request.accept_ud(&qp, &[])?;
    // The GID the accepted client's datagrams come from (RoCE: its IP
    // address): anyone may send to this QP (the Q_Key is well known).
    let client_gid = peer.map(|peer| match peer.ip() {
        IpAddr::V4(ip) => Gid::from_ipv4(ip),
        IpAddr::V6(ip) => Gid(ip.octets()),
    });
    let deadline = Instant::now() + timeout;
    let (mut answered, mut grh) = (0u32, [0u8; GRH_BYTES]);
    let mut datagram = vec![0; args.size];
    let (mut ignored, mut wcs) = (0u32, [WorkCompletion::default(); 16]);
    while answered < args.count && Instant::now() < deadline {
        for &wc in poll_until(&mut buffers.recv_cq, &mut wcs, deadline)? {
            let slot = wc.wr_id() as usize;
            let base = slot * buffers.slot;
            // A failed receive (a datagram longer than a slot, say) and
            // anything that is not a datagram of at most -S bytes from the
            // accepted client is not answered, and counts for nothing.
            let mut payload = datagram_payload(&wc).filter(|p| p.len() <= args.size);
            if payload.is_some() {
                buffers.rx.read(base, &mut grh)?;
                if client_gid.is_none() || datagram_sender(&grh) != client_gid {
                    payload = None;
                }
            }
            match payload {
                None => ignored += 1,
                Some(payload) => {
                    let len = payload.len();
                    buffers
                        .rx
                        .read(base + payload.start, &mut datagram[..len])?;
                    let to = qp.reply_destination(&wc, &grh)?;
                    buffers.tx.write(0, &datagram[..len])?;
                    buffers.send(&mut qp, len, &to)?;
                    answered += 1;
                }
            }
            buffers.post(&mut qp, slot)?;
        }
    }
    let from = peer.map_or_else(|| "an unknown peer".to_string(), |p| p.to_string());
    println!(
        "answered {answered} of {} datagrams from {from} ({ignored} ignored)",
        args.count
    );
    Ok(answered == args.count)
}

/// The client's side of a connection: where the server's QP is, and what
/// talks to it (kept together: the QP holds its id and the channel).
struct Connected {
    to: UdDestination,
    buffers: Buffers,
    qp: UdQueuePair,
    _pd: rdma_comm_core::verbs::ProtectionDomain,
    _id: rdma_comm_core::verbs::cm::CmId,
    _channel: EventChannel,
}

/// Resolves the server and asks for its QP; again, after a pause, while
/// the answer is `Unreachable` (no server listening yet), until
/// `deadline`.
fn connect(
    args: &Args,
    server: SocketAddr,
    source: Option<SocketAddr>,
    deadline: Instant,
) -> Result<Connected> {
    loop {
        let channel = EventChannel::new()?;
        let mut id = channel.create_ud_id()?;
        id.resolve_addr(source, server, RESOLVE_TIMEOUT)?;
        channel.expect(&id, CmEventKind::AddrResolved, RESOLVE_TIMEOUT)?;
        id.resolve_route(RESOLVE_TIMEOUT)?;
        channel.expect(&id, CmEventKind::RouteResolved, RESOLVE_TIMEOUT)?;
        let (buffers, qp, pd) = resources(&id, args.size, args.count)?;
        id.connect_ud(&qp, &[])?;
        let left = deadline.saturating_duration_since(Instant::now());
        match channel.expect(&id, CmEventKind::Established, left) {
            Ok(event) => {
                let to = event.ud_destination(&qp)?;
                drop(event);
                return Ok(Connected {
                    to,
                    buffers,
                    qp,
                    _pd: pd,
                    _id: id,
                    _channel: channel,
                });
            }
            Err(Error::Cm {
                cause:
                    CmFailure::Event {
                        got: CmEventKind::Unreachable,
                        ..
                    },
                ..
            }) if Instant::now() + RETRY_PAUSE < deadline => std::thread::sleep(RETRY_PAUSE),
            Err(err) => return Err(err),
        }
    }
}

fn client(
    args: &Args,
    server: SocketAddr,
    source: Option<SocketAddr>,
    timeout: Duration,
) -> Result<bool> {
    let Connected {
        to,
        mut buffers,
        mut qp,
        ..
    } = connect(args, server, source, Instant::now() + timeout)?;
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
    // Only the source and length of an answer are checked: rdma-core's
    // udaddy server answers with what its receive buffer starts with (the
    // GRH), not with the datagram's bytes.
    let deadline = Instant::now() + timeout;
    let (mut answers, mut wrong) = (0u32, 0u32);
    let mut wcs = [WorkCompletion::default(); 16];
    while answers + wrong < args.count && Instant::now() < deadline {
        for &wc in poll_until(&mut buffers.recv_cq, &mut wcs, deadline)? {
            let answer = datagram_payload(&wc).filter(|p| {
                wc.opcode() == WcOpcode::RECV && wc.src_qp() == to.qpn() && p.len() == args.size
            });
            match answer {
                Some(_) => answers += 1,
                None => wrong += 1,
            }
            buffers.post(&mut qp, wc.wr_id() as usize)?;
        }
    }
    println!(
        "sent {} datagrams of {} B to {server}, received {answers} answers ({wrong} wrong)",
        args.count, args.size
    );
    Ok(answers == args.count)
}
