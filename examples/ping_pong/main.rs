//! Finite SEND/RECV and WRITE_WITH_IMM ping-pong with payload verification,
//! both sides on the reactor.
//!
//! ```text
//! ping_pong --server [--listen 0.0.0.0:7471] [--peers N] [--reactors N] [--cores LIST] [--event-mode blocking] [--heap-report-ms MS]
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

use std::process::ExitCode;
use std::time::Duration;

mod client;
#[path = "../common/mod.rs"]
mod common;
#[path = "../common/rtt.rs"]
mod rtt;
mod server;

use clap::{Parser, ValueEnum};
use rdma_comm_core::reactor::*;

/// RDMA ping-pong with verified payloads.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Serve peers.
    #[arg(long, conflicts_with = "connect")]
    server: bool,
    /// Address to listen on (server).
    #[arg(long, default_value = "0.0.0.0:7471")]
    listen: String,
    /// Serve this many peers, then exit once they have left (server;
    /// default: serve for ever). It is also the server's `max_peers`: at
    /// most this many are connected at once.
    #[arg(long, value_parser = common::at_least(1usize))]
    peers: Option<usize>,
    /// Time a client has to complete its handshake (server), 1 ms to an hour.
    #[arg(long, default_value_t = 10_000, value_parser = common::range(1u64, 3_600_000))]
    handshake_timeout_ms: u64,
    /// Largest message a peer may send, and each peer's inbox size
    /// (server), 1 B to 16 MiB.
    #[arg(long, default_value_t = 1 << 16, value_parser = common::range(1usize, MAX_MESSAGE))]
    max_size: usize,
    /// Print the heap in use (`heap: N B in use`) about this often
    /// (server; glibc 2.33 or later): the long-lived test reads it, since unlike the
    /// RSS it does not keep the allocator's high-water marks.
    #[arg(long, value_name = "MS", value_parser = common::range(1u64, 3_600_000))]
    heap_report_ms: Option<u64>,
    /// Server to connect to (client).
    #[arg(long, value_name = "HOST:PORT", required_unless_present = "server")]
    connect: Option<String>,
    /// Round trips (client): any count, the statistics take constant memory.
    #[arg(long, default_value_t = 1000)]
    iters: u64,
    /// Payload bytes per message (client), 1 B to 16 MiB.
    #[arg(long, default_value_t = 64, value_parser = common::range(1usize, MAX_MESSAGE))]
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
/// Largest message (`--size`, `--max-size`): 16 MiB.
const MAX_MESSAGE: usize = 16 << 20;

fn main() -> ExitCode {
    common::init_logging();
    // --batch is the window here: at most MAX_WINDOW pings in flight.
    let mut args: Args = common::parse_adjusted("ping_pong", |command| {
        command.mut_arg("batch", |batch| {
            batch
                .value_parser(common::range(1usize, MAX_WINDOW))
                .help("Pings in flight (client), 1 to 64, staged in one pass [default: 1]")
        })
    });
    if let Err(refusal) = check(&mut args) {
        return refusal.exit("ping_pong");
    }
    let result = if args.server {
        server::serve(&args)
    } else {
        client::ping(&args)
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

/// Checks what clap cannot before anything is opened: the addresses
/// resolve, the key is read, the core list fits.
fn check(args: &mut Args) -> Result<(), common::Refusal> {
    if args.server {
        common::address("--listen", &args.listen)?;
        args.runtime.check(false)?;
    } else {
        common::address("--connect", args.connect.as_deref().unwrap_or_default())?;
    }
    args.auth.load()
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
        peer_check_interval: Some(PEER_CHECK_INTERVAL),
        ..base
    }
}
