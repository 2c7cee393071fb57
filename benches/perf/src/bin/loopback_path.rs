//! The reactor's per-message path over the in-process loopback device, as
//! a plain program for instruction counting (`tools/instr-count --host`
//! runs it under callgrind with collection on inside `Reactor::run` only):
//! one reactor holds both ends of one connection, so the count covers both
//! sides of every message, with no device, no kernel and no timing in it.
//!
//! ```text
//! loopback_path CASE MESSAGES
//! CASE: send-lat | read-lat | write-lat | send-b1 | send-b16 | write-b1
//!       | write-b16 | direct-CASE (the same on direct connections)
//!       | spin-read-lat (direct, the client's READs from a spin)
//! ```
//!
//! Latency cases: 8 B, one message (a SEND ping, a READ or a WRITE) at a
//! time. (`write-lat` is left out of `tools/instr-count --host`: both ends
//! spin on their landing byte in one thread, so its count says more about
//! where in a pass the loopback device lands the WRITE than about the
//! path.)
//! `spin-read-lat`: the client's loop spins on the CQs the reactor lends
//! (`Ctx::spin`). Only READ: in one reactor a SEND's or WRITE's answer
//! comes from the other end's handler, which a spin does not run.
//! Streaming cases: 64 B, 1 or 16 requests per doorbell, one signaled in
//! 16. Prints the messages and the time per message (not deterministic;
//! the instruction count is).

use std::process::ExitCode;
use std::time::Instant;

use rdma_perf::loopback::{PerfPair, direct_perf_pair, perf_pair};
use rdma_perf::{
    DirectClient, DirectServer, LatencyClient, PerfHandler, PerfOp, PerfSpec, RateSender, RateSink,
    Reflector,
};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let (Some(case), Some(messages)) =
        (args.get(1), args.get(2).and_then(|n| n.parse::<u64>().ok()))
    else {
        eprintln!(
            "usage: loopback_path [direct-]send-lat|read-lat|write-lat|send-b1|send-b16|write-b1|write-b16|spin-read-lat MESSAGES"
        );
        return ExitCode::from(2);
    };
    // `direct-` cases: the same on direct connections (`Reactor::add_direct`).
    let (direct, spin, base) = match (case.strip_prefix("direct-"), case.as_str()) {
        (Some(base), _) => (true, false, base),
        (None, "spin-read-lat") => (true, true, "read-lat"),
        (None, base) => (false, false, base),
    };
    let (op, latency, batch) = match base {
        "send-lat" => (PerfOp::Send, true, 1),
        "read-lat" => (PerfOp::Read, true, 1),
        "send-b1" => (PerfOp::Send, false, 1),
        "send-b16" => (PerfOp::Send, false, 16),
        "write-b1" => (PerfOp::Write, false, 1),
        "write-b16" => (PerfOp::Write, false, 16),
        "write-lat" => (PerfOp::Write, true, 1),
        other => {
            eprintln!("loopback_path: no case {other:?}");
            return ExitCode::from(2);
        }
    };
    match run(op, latency, batch, messages.max(1), direct, spin) {
        Ok(ns) => {
            println!("{case} {messages} messages {ns:.1} ns/message");
            ExitCode::SUCCESS
        }
        Err(err) => {
            eprintln!("loopback_path: {err}");
            ExitCode::FAILURE
        }
    }
}

/// Runs one case; returns wall nanoseconds per message.
fn run(
    op: PerfOp,
    latency: bool,
    batch: usize,
    messages: u64,
    direct: bool,
    spin: bool,
) -> Result<f64, String> {
    let size = if latency { 8 } else { 64 };
    let spec = PerfSpec {
        op,
        size,
        iters: messages,
        warmup: 0,
        batch,
        tx_depth: 0,
    };
    let signal_interval = if latency { 1 } else { 16 };
    let pair = if direct {
        direct_perf_pair(
            size,
            |buffers| match latency {
                true if spin => {
                    PerfHandler::DirectClient(DirectClient::latency(spec, buffers).spinning())
                }
                true => PerfHandler::DirectClient(DirectClient::latency(spec, buffers)),
                false => PerfHandler::DirectClient(DirectClient::bandwidth(spec, buffers)),
            },
            |buffers| PerfHandler::DirectServer(DirectServer::new(spec, buffers, !latency)),
        )
    } else if latency {
        perf_pair(
            signal_interval,
            size,
            |buffers| PerfHandler::Latency(LatencyClient::new(spec, buffers)),
            |buffers| PerfHandler::Reflect(Reflector::new(spec, buffers)),
        )
    } else {
        perf_pair(
            signal_interval,
            size,
            |buffers| PerfHandler::Rate(RateSender::new(spec, buffers)),
            |_| PerfHandler::Sink(RateSink::default()),
        )
    };
    let PerfPair {
        mut reactor,
        client,
        exports: _exports,
    } = pair.map_err(|e| e.to_string())?;
    let started = Instant::now();
    reactor.run().map_err(|e| e.to_string())?;
    let elapsed = started.elapsed();
    let failure = match reactor.handler(client) {
        Some(PerfHandler::Latency(client)) => client.failure().map(str::to_owned),
        Some(PerfHandler::Rate(sender)) => sender.failure().map(str::to_owned),
        Some(PerfHandler::DirectClient(client)) => client.failure().map(str::to_owned),
        _ => Some("the client session is gone".into()),
    };
    if let Some(failure) = failure {
        return Err(failure);
    }
    Ok(elapsed.as_nanos() as f64 / messages as f64)
}
