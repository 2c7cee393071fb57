//! Finite SEND/RECV and WRITE_WITH_IMM ping-pong with payload verification.
//!
//! ```text
//! ping_pong --server [--listen 0.0.0.0:7471] [--max-peers N]
//! ping_pong --connect HOST:7471 [--iters 1000] [--size 64] [--op send|write-imm|both]
//! ```
//!
//! Every message carries a pattern derived from its sequence number; both sides
//! check every byte (and the immediate). The client prints an RTT summary and
//! exits 0 only if every byte matched. The server serves any number of peers,
//! each on its own thread, and keeps going when one of them fails.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

mod common;

use clap::{Parser, ValueEnum};
use rdma_comm_core::Error;
use rdma_comm_core::pool::BufferPool;
use rdma_comm_core::session::*;
use rdma_comm_core::verbs::*;

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
    /// Largest message a peer may send (server).
    #[arg(long, default_value_t = 1 << 16)]
    max_size: usize,
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
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Op {
    Send,
    WriteImm,
    Both,
}

/// How long one round trip may take before the peer is declared unresponsive.
const ROUND_TRIP_DEADLINE: Duration = Duration::from_secs(10);
/// Receive buffers kept posted per peer.
const RECV_DEPTH: u32 = 16;
/// wr_id of the server's WRITE_WITH_IMM echo (pool wr_ids have a pool tag).
const ECHO_WRITE_ID: u64 = 1;

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

fn qp_config(args: &Args) -> QpConfig {
    let mut qp = QpConfig::default();
    args.dev.apply(&mut qp);
    qp.remote_access = AccessFlags::REMOTE_WRITE;
    qp.max_recv_wr = RECV_DEPTH * 2;
    qp
}

fn ping(args: &Args) -> rdma_comm_core::Result<bool> {
    let addr = args
        .connect
        .as_deref()
        .expect("clap requires --connect without --server");
    let ctx = Context::open_default(args.dev.device.as_deref())?;
    let pd = ctx.alloc_pd()?;
    let size = args.size.max(1);
    let inbox = Arc::new(pd.alloc_mr(size, AccessFlags::REMOTE_WRITE)?);
    let mut tx = BufferPool::new(&pd, size, 2, AccessFlags::empty())?;
    let mut rx = BufferPool::new(&pd, size, RECV_DEPTH, AccessFlags::LOCAL_WRITE)?;

    let mut spec = ChannelSpec::new("ping");
    spec.qp = qp_config(args);
    let config = ClientConfig::new(vec![spec]).with_exports(vec![Export::new(
        1,
        "inbox",
        Arc::clone(&inbox),
    )]);
    let mut endpoint = ClientSession::connect(addr, &pd, &config)?;
    let peer = endpoint.peer();
    let server_inbox = endpoint
        .remote_region("inbox")
        .ok_or_else(|| Error::Protocol {
            peer,
            what: "server exported no \"inbox\" region".into(),
        })?;
    println!(
        "connected to {peer}: {} x {size} B, op {:?}",
        args.iters, args.op
    );

    let channel = endpoint.channel(0).expect("one channel was negotiated");
    let (qp, cq) = channel.split_mut();
    let cq = cq.expect("the channel has a private CQ");
    while let Some(slot) = rx.acquire() {
        rx.post_recv(qp, slot).map_err(|e| e.error)?;
    }

    let mut rtts = Vec::with_capacity(args.iters as usize);
    let mut mismatches = 0u64;
    let mut wcs = [WorkCompletion::default(); 16];
    for seq in 0..args.iters {
        let use_send = match args.op {
            Op::Send => true,
            Op::WriteImm => false,
            Op::Both => seq % 2 == 0,
        };
        let mut slot = tx.acquire().expect("the send slot came back last round");
        for (dst, src) in tx.bytes_mut(&mut slot)[..size]
            .iter_mut()
            .zip(pattern(seq, size))
        {
            *dst = src;
        }
        let start = Instant::now();
        let posted = if use_send {
            tx.post_send(qp, slot, size, None)
        } else {
            tx.post_write(
                qp,
                slot,
                server_inbox.slice(0, size as u64)?,
                Some(seq as u32),
            )
        };
        posted.map_err(|e| e.error)?;

        let (mut sent, mut answered) = (false, false);
        while !(sent && answered) {
            if start.elapsed() > ROUND_TRIP_DEADLINE {
                return Err(Error::Protocol {
                    peer,
                    what: format!("no answer to message {seq} within {ROUND_TRIP_DEADLINE:?}"),
                });
            }
            for wc in cq.poll(&mut wcs)? {
                wc.ok()?;
                if let Some(slot) = tx.complete(wc) {
                    tx.release(slot);
                    sent = true;
                } else if let Some(slot) = rx.complete(wc) {
                    let len = wc.byte_len() as usize;
                    let ok = match wc.imm() {
                        // WRITE_WITH_IMM echo: the bytes are in our inbox.
                        Some(imm) => {
                            imm == seq as u32 && len == size && inbox_matches(&inbox, seq, size)?
                        }
                        None => len == size && matches_pattern(&rx.bytes(&slot)[..len], seq),
                    };
                    if !ok {
                        mismatches += 1;
                        eprintln!(
                            "message {seq}: echo did not match (imm {:?}, {len} bytes)",
                            wc.imm()
                        );
                    }
                    rx.post_recv(qp, slot).map_err(|e| e.error)?;
                    answered = true;
                }
            }
        }
        rtts.push(start.elapsed());
    }

    let report = endpoint.close()?;
    print_summary(&rtts, mismatches, report.drained.len());
    Ok(mismatches == 0 && rtts.len() as u64 == args.iters)
}

fn inbox_matches(inbox: &MemoryRegion, seq: u64, size: usize) -> rdma_comm_core::Result<bool> {
    let mut bytes = vec![0u8; size];
    inbox.read(0, &mut bytes)?;
    Ok(matches_pattern(&bytes, seq))
}

fn print_summary(rtts: &[Duration], mismatches: u64, drained: usize) {
    let mut us: Vec<f64> = rtts.iter().map(|d| d.as_secs_f64() * 1e6).collect();
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
    if drained > 0 {
        println!("{drained} completions drained at close");
    }
}

fn serve(args: &Args) -> rdma_comm_core::Result<bool> {
    let ctx = Context::open_default(args.dev.device.as_deref())?;
    let pd = ctx.alloc_pd()?;
    let max_size = args.max_size.max(1);
    let mut config = ServerConfig {
        qp: qp_config(args),
        max_peers: args.max_peers,
        handshake_timeout: Duration::from_millis(args.handshake_timeout_ms),
        ..Default::default()
    };
    config.exports = Some(Arc::new(move |_peer: SocketAddr, pd: &ProtectionDomain| {
        // Each peer writes into its own inbox: no peer can touch another's data.
        Ok(vec![Export::new(
            1,
            "inbox",
            Arc::new(pd.alloc_mr(max_size, AccessFlags::REMOTE_WRITE)?),
        )])
    }));
    let server = ServerSession::bind(args.listen.as_str(), &pd, config)?;
    println!("listening on {}", server.local_addr());

    let mut workers = Vec::new();
    let mut served = 0;
    loop {
        for failure in server.take_failures() {
            println!("rejected {}: {}", failure.peer, failure.error);
        }
        if args.max_peers.is_some_and(|max| served >= max) {
            break;
        }
        let Some(endpoint) = server.accept_timeout(Duration::from_millis(100)) else {
            continue;
        };
        served += 1;
        let peer = endpoint.peer();
        println!("peer {peer} connected");
        let pd = pd.clone();
        workers.push(std::thread::spawn(move || {
            match echo(endpoint, &pd, max_size) {
                Ok(count) => println!("peer {peer} done: {count} messages verified and echoed"),
                Err(err) => println!("peer {peer} error: {err}"),
            }
        }));
    }
    for worker in workers {
        let _ = worker.join();
    }
    // Report handshakes still in progress too (each ends by its timeout).
    while server.pending_handshakes() > 0 {
        std::thread::sleep(Duration::from_millis(50));
    }
    for failure in server.take_failures() {
        println!("rejected {}: {}", failure.peer, failure.error);
    }
    Ok(true)
}

/// Echoes every message back the way it came until the peer disconnects.
fn echo(
    mut endpoint: Endpoint,
    pd: &ProtectionDomain,
    max_size: usize,
) -> rdma_comm_core::Result<u64> {
    let peer = endpoint.peer();
    let corrupt = |what: String| Error::Protocol { peer, what };
    let client_inbox = endpoint
        .remote_region("inbox")
        .ok_or_else(|| corrupt("client exported no inbox".into()))?;
    let inbox = Arc::clone(&endpoint.exports()[0].region);
    let mut rx = BufferPool::new(pd, max_size, RECV_DEPTH, AccessFlags::LOCAL_WRITE)?;
    let qp = endpoint
        .channel(0)
        .expect("one channel was negotiated")
        .qp();
    while let Some(slot) = rx.acquire() {
        rx.post_recv(qp, slot).map_err(|e| e.error)?;
    }

    let mut seq = 0u64;
    let mut idle_polls = 0u32;
    let mut wcs = [WorkCompletion::default(); 16];
    loop {
        let (qp, cq) = endpoint
            .channel(0)
            .expect("one channel was negotiated")
            .split_mut();
        let done = cq.expect("the channel has a private CQ").poll(&mut wcs)?;
        if done.is_empty() {
            idle_polls = idle_polls.wrapping_add(1);
            // The control connection is checked now and then, not per poll.
            if idle_polls.is_multiple_of(4096) {
                match endpoint.check_peer() {
                    PeerStatus::Alive => {}
                    PeerStatus::Disconnected { .. } => return Ok(seq),
                    PeerStatus::Lost(err) => return Err(err),
                }
            }
            continue;
        }
        idle_polls = 0;
        for wc in done {
            wc.ok()?;
            if wc.wr_id() == ECHO_WRITE_ID {
                continue;
            }
            let Some(slot) = rx.complete(wc) else {
                continue;
            };
            let len = wc.byte_len() as usize;
            match wc.opcode() {
                // Our echo SEND finished: the slot goes back to receiving.
                WcOpcode::SEND => rx.post_recv(qp, slot).map_err(|e| e.error)?,
                WcOpcode::RECV => {
                    if !matches_pattern(&rx.bytes(&slot)[..len], seq) {
                        return Err(corrupt(format!(
                            "message {seq} ({len} B SEND) arrived corrupted"
                        )));
                    }
                    seq += 1;
                    // Zero-copy echo straight from the receive slot.
                    rx.post_send(qp, slot, len, None).map_err(|e| e.error)?;
                }
                WcOpcode::RECV_RDMA_WITH_IMM => {
                    let imm = wc.imm().unwrap_or(u32::MAX);
                    if imm != seq as u32 || !inbox_matches(&inbox, seq, len)? {
                        return Err(corrupt(format!(
                            "message {seq} ({len} B WRITE_WITH_IMM, imm {imm}) arrived corrupted"
                        )));
                    }
                    seq += 1;
                    rx.post_recv(qp, slot).map_err(|e| e.error)?;
                    let back = WorkRequest::write_with_imm(
                        ECHO_WRITE_ID,
                        inbox.slice(0, len)?,
                        client_inbox.slice(0, len as u64)?,
                        imm,
                    )?;
                    qp.post_send(back.signaled())?;
                }
                _ => rx.release(slot),
            }
        }
    }
}
