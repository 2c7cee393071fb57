//! rping over this crate's connection manager (`verbs::cm`) and verbs
//! layers, wire-compatible with rdma-core's `rping`: either side of ours
//! talks to the other side of theirs.
//!
//! ```text
//! rping -s [-vVd] [-S size] [-a addr] [-p port]
//! rping -c [-vVd] [-S size] [-C count] [-I addr] -a addr [-p port]
//! ```
//!
//! The loop, per ping: the client fills its source buffer with
//! `rdma-ping-N: ` and a rotating run of letters, and SENDs its address,
//! rkey and size (`struct rping_rdma_info`: big-endian u64, u32, u32); the
//! server READs it and SENDs a go-ahead; the client SENDs its sink buffer's
//! descriptor; the server WRITEs the data there and SENDs a go-ahead. With
//! `-V` the client checks the sink against the source, and our server
//! checks what it read against the pattern the client must have sent.
//!
//! Unlike the original, the QP is always ours, driven by the connection
//! manager's attributes (its `-q`, accepted here as a no-op); `-P` (a
//! persistent, threaded server) is not offered. Failures are typed errors
//! naming the operation and the peer; a disconnect in the middle of a ping,
//! or at any point for the client, is a failure (exit status 1).

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use clap::{ArgGroup, Parser};

mod common;
use rdma_comm_core::error::CmFailure;
use rdma_comm_core::verbs::cm::{CmEvent, CmEventKind, CmId, EventChannel};
use rdma_comm_core::verbs::{
    AccessFlags, CompletionChannel, CompletionQueue, Context, MemoryRegion, ProtectionDomain,
    QpConfig, QueuePair, RecvRequest, RemoteRegion, WcOpcode, WorkCompletion, WorkRequest,
};
use rdma_comm_core::{Error, Result};

/// rping's limits on -S: room for the message prefix, and its 64 KiB buffer.
const MIN_SIZE: u32 = 23;
const MAX_SIZE: u32 = 65535;
/// `struct rping_rdma_info`: buf (be64), rkey (be32), size (be32).
const INFO_LEN: usize = 16;
/// rping's send queue depth; it keeps one receive posted.
const SQ_DEPTH: u32 = 16;
/// rping's address and route resolution timeout.
const RESOLVE_TIMEOUT: Duration = Duration::from_millis(2000);
/// How long a client waits for the server's answer to its connect request.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

const WR_SEND: u64 = 1;
const WR_RECV: u64 = 2;
const WR_RDMA: u64 = 3;

/// An RDMA ping-pong, compatible with rdma-core's rping.
#[derive(Parser, Debug)]
#[command(disable_version_flag = true, group(ArgGroup::new("side").required(true).args(["server", "client"])))]
struct Args {
    /// Server side (bind to -a, or every address).
    #[arg(short = 's')]
    server: bool,
    /// Client side (connect to -a).
    #[arg(short = 'c')]
    client: bool,
    /// Address to connect to (client) or bind to (server).
    #[arg(short = 'a', value_name = "ADDR")]
    addr: Option<String>,
    /// Source address for the client to bind to.
    #[arg(short = 'I', value_name = "ADDR")]
    source: Option<String>,
    /// Port.
    #[arg(short = 'p', default_value_t = 7174)]
    port: u16,
    /// Pings (client; 0: for ever).
    #[arg(short = 'C', default_value_t = 0)]
    count: u32,
    /// Ping data size (23 to 65535, as rping allows).
    #[arg(short = 'S', default_value_t = 64, value_parser = common::range(MIN_SIZE, MAX_SIZE))]
    size: u32,
    /// Print the ping data.
    #[arg(short = 'v')]
    verbose: bool,
    /// Validate the ping data.
    #[arg(short = 'V')]
    validate: bool,
    /// Debug output (connection steps, on stderr).
    #[arg(short = 'd')]
    debug: bool,
    /// Self-created QP (always so here; accepted for compatibility).
    #[arg(short = 'q')]
    _self_qp: bool,
    /// Serve anyone who reaches the port (server): rping's protocol has no
    /// authentication, so `-s` runs only when told so.
    #[arg(long)]
    insecure: bool,
}

fn main() -> ExitCode {
    common::init_logging();
    let args: Args = common::parse("rping");
    let addrs = match check(&args) {
        Ok(addrs) => addrs,
        Err(refusal) => return refusal.exit("rping"),
    };
    let result = if args.server {
        log::warn!(
            "rping server on {}: open to anyone who reaches it (rping has no authentication: --insecure)",
            addrs.target
        );
        server(&args, addrs.target)
    } else {
        client(&args, addrs)
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("rping: {err}");
            ExitCode::FAILURE
        }
    }
}

/// The addresses the flags name, resolved before anything is opened.
struct Addrs {
    /// The client's server, or the address the server binds (`-a`, `-p`).
    target: SocketAddr,
    /// The client's source address (`-I`).
    source: Option<SocketAddr>,
}

/// Resolves `-a` (a client needs one) and `-I`; a server needs `--insecure`.
fn check(args: &Args) -> std::result::Result<Addrs, common::Refusal> {
    if args.server && !args.insecure {
        return Err(common::Refusal::of(
            "-s",
            "rping's protocol has no authentication, so its server serves anyone: add --insecure to run it",
        ));
    }
    let host = match (&args.addr, args.server) {
        (Some(host), _) => host.as_str(),
        (None, true) => "0.0.0.0",
        (None, false) => {
            return Err(common::Refusal::of(
                "-a",
                "the client needs the server's address",
            ));
        }
    };
    Ok(Addrs {
        target: common::host("-a", host, args.port)?,
        source: args
            .source
            .as_deref()
            .map(|source| common::host("-I", source, 0))
            .transpose()?,
    })
}

/// The client's ping data, exactly as rping writes it: `rdma-ping-N: `,
/// then letters from 'A' + N mod 58 up to 'z' and round again, NUL last.
fn fill_ping(buf: &mut [u8], ping: u64) {
    if buf.is_empty() {
        return;
    }
    let prefix = format!("rdma-ping-{ping}: ");
    let copied = prefix.len().min(buf.len() - 1);
    buf[..copied].copy_from_slice(&prefix.as_bytes()[..copied]);
    buf[copied] = 0;
    let mut c = b'A' + (ping % 58) as u8;
    for byte in buf.iter_mut().skip(prefix.len()) {
        *byte = c;
        c = if c >= b'z' { b'A' } else { c + 1 };
    }
    let last = buf.len() - 1;
    buf[last] = 0;
}

/// The bytes up to the first NUL, as rping's `%s` prints them.
fn as_c_str(buf: &[u8]) -> std::borrow::Cow<'_, str> {
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end])
}

/// What a connection waits for next.
enum Wake {
    Completion(WorkCompletion),
    Cm(CmEvent),
}

/// The PD, CQ and buffers of one connection, made on the id's device.
struct Resources {
    pd: ProtectionDomain,
    comp: CompletionChannel,
    cq: CompletionQueue,
    config: QpConfig,
    recv: MemoryRegion,
    send: MemoryRegion,
    /// The client's sink, the server's landing buffer.
    rdma: MemoryRegion,
    /// The client's source buffer.
    start: Option<MemoryRegion>,
}

impl Resources {
    fn new(ctx: &Context, size: u32, client: bool) -> Result<Self> {
        let pd = ctx.alloc_pd()?;
        let comp = ctx.create_comp_channel()?;
        comp.set_nonblocking(true)?;
        let cq = ctx.create_cq(SQ_DEPTH * 2, Some(&comp))?;
        let mut config = QpConfig::default();
        config.max_send_wr = SQ_DEPTH;
        config.max_recv_wr = 2;
        // Least privilege: the server reads the client's source and writes
        // its sink; nobody touches the server's memory.
        let (rdma_access, start_access) = if client {
            config.remote_access = AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE;
            (AccessFlags::REMOTE_WRITE, Some(AccessFlags::REMOTE_READ))
        } else {
            (AccessFlags::LOCAL_WRITE, None)
        };
        let size = size as usize;
        Ok(Self {
            rdma: pd.alloc_mr(size, rdma_access)?,
            start: start_access
                .map(|access| pd.alloc_mr(size, access))
                .transpose()?,
            recv: pd.alloc_mr(INFO_LEN, AccessFlags::LOCAL_WRITE)?,
            send: pd.alloc_mr(INFO_LEN, AccessFlags::empty())?,
            pd,
            comp,
            cq,
            config,
        })
    }

    /// rping keeps one receive posted, for the next `rping_rdma_info`.
    fn post_recv(&self, qp: &mut QueuePair) -> Result<()> {
        qp.post_recv(&mut RecvRequest::new(
            WR_RECV,
            self.recv.slice(0, INFO_LEN)?,
        )?)
    }
}

/// One connected rping peer.
struct Conn {
    debug: bool,
    peer: SocketAddr,
    channel: EventChannel,
    id: CmId,
    qp: QueuePair,
    res: Resources,
    pending: VecDeque<WorkCompletion>,
}

impl Conn {
    fn new(
        debug: bool,
        peer: SocketAddr,
        channel: EventChannel,
        id: CmId,
        qp: QueuePair,
        res: Resources,
    ) -> Self {
        let conn = Conn {
            debug,
            peer,
            channel,
            id,
            qp,
            res,
            pending: VecDeque::new(),
        };
        conn.debug(|| format!("connected with {peer}"));
        conn
    }

    fn debug(&self, what: impl FnOnce() -> String) {
        if self.debug {
            eprintln!("rping debug: {}", what());
        }
    }

    /// SENDs `struct rping_rdma_info` for a buffer, or zeros (a go-ahead).
    fn send_info(&mut self, info: Option<(u64, u32, u32)>) -> Result<()> {
        let mut msg = [0u8; INFO_LEN];
        if let Some((addr, rkey, size)) = info {
            msg[..8].copy_from_slice(&addr.to_be_bytes());
            msg[8..12].copy_from_slice(&rkey.to_be_bytes());
            msg[12..].copy_from_slice(&size.to_be_bytes());
        }
        self.res.send.write(0, &msg)?;
        let send = WorkRequest::send(WR_SEND, self.res.send.slice(0, INFO_LEN)?);
        self.qp.post_send(&mut send.signaled())
    }

    /// Receives one `struct rping_rdma_info` and reposts the receive.
    fn recv_info(&mut self, step: &'static str) -> Result<RemoteRegion> {
        let len = self.wait_for(WcOpcode::RECV, step)?;
        let mut msg = [0u8; INFO_LEN];
        self.res.recv.read(0, &mut msg)?;
        self.res.post_recv(&mut self.qp)?;
        if len as usize != INFO_LEN {
            return Err(self.protocol(format!("received bogus data, size {len}")));
        }
        let addr = u64::from_be_bytes(msg[..8].try_into().expect("8 bytes"));
        let rkey = u32::from_be_bytes(msg[8..12].try_into().expect("4 bytes"));
        let size = u32::from_be_bytes(msg[12..].try_into().expect("4 bytes"));
        self.debug(|| format!("received rkey {rkey:#x} addr {addr:#x} len {size} from peer"));
        Ok(RemoteRegion::new(addr, u64::from(size), rkey))
    }

    fn protocol(&self, what: String) -> Error {
        Error::Protocol {
            peer: self.peer,
            what,
        }
    }

    /// Waits for a successful completion of `opcode` and returns its byte
    /// count. A failed completion is its typed error; a failure event (a
    /// disconnect, ...) is [`Error::Cm`] naming `step`.
    fn wait_for(&mut self, opcode: WcOpcode, step: &'static str) -> Result<u32> {
        loop {
            match self.wait()? {
                Wake::Completion(wc) => {
                    // Named as every other failure here is: by the peer.
                    wc.ok().map_err(|err| err.with_peer(Some(self.peer)))?;
                    if wc.opcode() == opcode {
                        return Ok(wc.byte_len());
                    }
                    self.debug(|| format!("{} completion", wc.opcode()));
                }
                Wake::Cm(mut event) => {
                    self.debug(|| format!("cm event {} (status {})", event.kind(), event.status()));
                    if let Some(request) = event.take_request() {
                        // One connection at a time, as rping without -P.
                        let _ = request.reject(&[]);
                    } else if event.kind().is_failure() {
                        return Err(Error::Cm {
                            op: step,
                            peer: Some(self.peer),
                            cause: CmFailure::Event {
                                got: event.kind(),
                                status: event.status(),
                                expected: None,
                            },
                        });
                    }
                }
            }
        }
    }

    /// The next completion or connection-manager event, sleeping in poll(2)
    /// on both descriptors; completions already there come first.
    fn wait(&mut self) -> Result<Wake> {
        let mut wcs = [WorkCompletion::default(); 8];
        let mut armed = false;
        loop {
            if let Some(wc) = self.pending.pop_front() {
                return Ok(Wake::Completion(wc));
            }
            let polled = self.res.cq.poll(&mut wcs)?;
            if !polled.is_empty() {
                self.pending.extend(polled.iter().copied());
                continue;
            }
            if let Some(event) = self.channel.try_get_event()? {
                return Ok(Wake::Cm(event));
            }
            if !armed {
                // Arm, then look once more before sleeping: a completion
                // that came in between raises no event.
                while self.res.comp.try_get_event()?.is_some() {}
                self.res.cq.req_notify(false)?;
                armed = true;
                continue;
            }
            let mut fds = [self.res.comp.fd(), self.channel.fd()].map(|fd| libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            });
            // SAFETY: two valid pollfds for the call's duration.
            if unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) } < 0 {
                let source = std::io::Error::last_os_error();
                if source.kind() != std::io::ErrorKind::Interrupted {
                    return Err(Error::Os {
                        what: "poll on the CQ and rdma_cm channels",
                        source,
                    });
                }
            }
            armed = false;
        }
    }

    /// One ping, client side; returns the echo for -v.
    fn client_ping(
        &mut self,
        ping: u64,
        data: &mut [u8],
        echo: &mut [u8],
        validate: bool,
    ) -> Result<()> {
        fill_ping(data, ping);
        let size = data.len() as u32;
        let start = self
            .res
            .start
            .as_mut()
            .expect("the client has a source buffer");
        start.write(0, data)?;
        let source = (start.addr(), start.remote()?.rkey(), size);
        self.send_info(Some(source))?;
        self.recv_info("waiting for the server to read the source")?;
        let sink = (self.res.rdma.addr(), self.res.rdma.remote()?.rkey(), size);
        self.send_info(Some(sink))?;
        self.recv_info("waiting for the server to write the sink")?;
        self.res.rdma.read(0, echo)?;
        if validate && echo != data {
            return Err(self.protocol(format!("data mismatch in ping {ping}")));
        }
        Ok(())
    }

    /// One ping, server side, from the client's source descriptor; returns
    /// how many bytes were read into `data`.
    fn server_ping(
        &mut self,
        ping: u64,
        source: RemoteRegion,
        data: &mut [u8],
        validate: bool,
    ) -> Result<usize> {
        let len = source.len() as usize;
        if len == 0 {
            return Err(self.protocol("the client advertised an empty buffer".into()));
        }
        if len > data.len() {
            return Err(self.protocol(format!(
                "the client's buffer of {len} bytes is larger than ours of {} (-S)",
                data.len()
            )));
        }
        let local = self.res.rdma.slice(0, len)?;
        self.qp.post_send(
            &mut WorkRequest::read(WR_RDMA, local, source.slice(0, len as u64)?)?.signaled(),
        )?;
        self.wait_for(WcOpcode::RDMA_READ, "reading the client's source")?;
        let data = &mut data[..len];
        self.res.rdma.read(0, data)?;
        if validate {
            let mut expected = vec![0u8; len];
            fill_ping(&mut expected, ping);
            if *data != *expected {
                return Err(
                    self.protocol(format!("ping {ping}: the source is not rping's ping data"))
                );
            }
        }
        self.send_info(None)?;
        let sink = self.recv_info("waiting for the client's sink")?;
        // What rping writes back: the string and its NUL.
        let echo = (as_c_str(data).len() + 1).min(len).min(sink.len() as usize);
        let local = self.res.rdma.slice(0, echo)?;
        self.qp.post_send(
            &mut WorkRequest::write(WR_RDMA, local, sink.slice(0, echo as u64)?)?.signaled(),
        )?;
        self.wait_for(WcOpcode::RDMA_WRITE, "writing the client's sink")?;
        self.send_info(None)?;
        Ok(len)
    }

    /// Flushes the QP and disconnects: after the peer's disconnect this
    /// answers it (as rping does), otherwise it asks, and waits briefly for
    /// the `Disconnected` that confirms it.
    fn close(mut self, peer_left: bool) {
        if let Err(err) = self.qp.set_error() {
            self.debug(|| err.to_string());
        }
        if let Err(err) = self.id.disconnect() {
            self.debug(|| err.to_string());
        }
        if !peer_left {
            let done =
                self.channel
                    .expect(&self.id, CmEventKind::Disconnected, Duration::from_secs(2));
            self.debug(|| format!("disconnect: {:?}", done.map(|event| event.kind())));
        }
    }
}

/// True for the error a disconnect (or another failure event) makes.
fn peer_left(err: &Error) -> bool {
    matches!(err.cm_failure(), Some(CmFailure::Event { .. }))
}

/// True for the error the peer's disconnect makes.
fn is_disconnect(err: &Error) -> bool {
    matches!(
        err.cm_failure(),
        Some(CmFailure::Event {
            got: CmEventKind::Disconnected,
            ..
        })
    )
}

fn client(args: &Args, addrs: Addrs) -> Result<()> {
    let (dst, src) = (addrs.target, addrs.source);
    let channel = EventChannel::new()?;
    let mut id = channel.create_id()?;
    id.resolve_addr(src, dst, RESOLVE_TIMEOUT)?;
    channel.expect(&id, CmEventKind::AddrResolved, RESOLVE_TIMEOUT * 2)?;
    id.resolve_route(RESOLVE_TIMEOUT)?;
    channel.expect(&id, CmEventKind::RouteResolved, RESOLVE_TIMEOUT * 2)?;
    let res = Resources::new(&id.context()?, args.size, true)?;
    let mut qp = id.create_qp(&res.pd, &res.cq, &res.cq, &res.config)?;
    res.post_recv(&mut qp)?;
    id.connect(&qp, &[])?;
    drop(channel.expect(&id, CmEventKind::ConnectResponse, CONNECT_TIMEOUT)?);
    id.establish(&mut qp)?;
    let peer = id.peer_addr().unwrap_or(dst);
    let mut conn = Conn::new(args.debug, peer, channel, id, qp, res);

    let mut data = vec![0u8; args.size as usize];
    let mut echo = vec![0u8; args.size as usize];
    let mut ping: u64 = 0;
    while args.count == 0 || ping < u64::from(args.count) {
        if let Err(err) = conn.client_ping(ping, &mut data, &mut echo, args.validate) {
            eprintln!("rping: client failed after {ping} completed pings");
            conn.close(peer_left(&err));
            return Err(err);
        }
        if args.verbose {
            println!("ping data: {}", as_c_str(&echo));
        }
        ping += 1;
    }
    conn.close(false);
    Ok(())
}

fn server(args: &Args, bind: SocketAddr) -> Result<()> {
    let channel = EventChannel::new()?;
    let mut listener = channel.create_id()?;
    listener.bind(bind)?;
    listener.listen(3)?;
    if args.debug {
        eprintln!("rping debug: listening on {bind}");
    }
    let request = loop {
        if let Some(request) = channel
            .get_event(None)?
            .and_then(|mut event| event.take_request())
        {
            break request;
        }
    };
    let res = Resources::new(&request.id().context()?, args.size, false)?;
    let mut qp = request
        .id()
        .create_qp(&res.pd, &res.cq, &res.cq, &res.config)?;
    res.post_recv(&mut qp)?;
    let peer = request.peer_addr().unwrap_or(bind);
    let id = request.accept(&mut qp, &[])?;
    // Established arrives in its time; the first receive is what matters.
    let mut conn = Conn::new(args.debug, peer, channel, id, qp, res);

    let mut data = vec![0u8; args.size as usize];
    let mut ping: u64 = 0;
    loop {
        // Between pings a disconnect is the client's goodbye.
        let source = match conn.recv_info("waiting for the next source") {
            Ok(source) => source,
            Err(err) if is_disconnect(&err) => {
                eprintln!("server DISCONNECT EVENT...");
                conn.close(true);
                return Ok(());
            }
            Err(err) => {
                eprintln!("rping: server failed after {ping} completed pings");
                conn.close(peer_left(&err));
                return Err(err);
            }
        };
        match conn.server_ping(ping, source, &mut data, args.validate) {
            Ok(len) => {
                if args.verbose {
                    println!("server ping data: {}", as_c_str(&data[..len]));
                }
            }
            Err(err) => {
                eprintln!("rping: server failed in the middle of ping {ping}");
                conn.close(peer_left(&err));
                return Err(err);
            }
        }
        ping += 1;
    }
}
