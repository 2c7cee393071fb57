//! The reactor's per-message path over the in-process loopback device, as
//! a plain program for instruction counting (`tools/instr-count --host`
//! runs it under callgrind with collection on inside `Reactor::run` only):
//! one reactor holds both ends of one connection, so the count covers both
//! sides of every message, with no device, no kernel and no timing in it.
//!
//! ```text
//! loopback_path CASE MESSAGES
//! CASE: send-lat | read-lat | send-b1 | send-b16 | write-b1 | write-b16
//! ```
//!
//! Latency cases: 8 B, one message (a SEND ping or a READ) at a time.
//! Streaming cases: 64 B, 1 or 16 requests per doorbell, one signaled in
//! 16. Prints the messages and the time per message (not deterministic;
//! the instruction count is).

use std::process::ExitCode;
use std::time::Instant;

use rdma_comm_core::reactor::{Reactor, ReactorConfig};
use rdma_comm_core::session::CqChoice;
use rdma_comm_core::verbs::{AccessFlags, Context};
use rdma_perf::{
    LatencyClient, PerfBuffers, PerfHandler, PerfOp, PerfSpec, RateSender, RateSink, Reflector,
};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let (Some(case), Some(messages)) =
        (args.get(1), args.get(2).and_then(|n| n.parse::<u64>().ok()))
    else {
        eprintln!(
            "usage: loopback_path send-lat|read-lat|send-b1|send-b16|write-b1|write-b16 MESSAGES"
        );
        return ExitCode::from(2);
    };
    let (op, latency, batch) = match case.as_str() {
        "send-lat" => (PerfOp::Send, true, 1),
        "read-lat" => (PerfOp::Read, true, 1),
        "send-b1" => (PerfOp::Send, false, 1),
        "send-b16" => (PerfOp::Send, false, 16),
        "write-b1" => (PerfOp::Write, false, 1),
        "write-b16" => (PerfOp::Write, false, 16),
        other => {
            eprintln!("loopback_path: no case {other:?}");
            return ExitCode::from(2);
        }
    };
    match run(op, latency, batch, messages.max(1)) {
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
fn run(op: PerfOp, latency: bool, batch: usize, messages: u64) -> Result<f64, String> {
    let size = if latency { 8 } else { 64 };
    // SAFETY: this thread serves both QPs of the device and is the only one
    // that touches the registered bytes.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().map_err(|e| e.to_string())?;
    let config = ReactorConfig {
        signal_interval: if latency { 1 } else { 16 },
        slot_size: 256,
        ..ReactorConfig::default()
    };
    let mut reactor: Reactor<PerfHandler, ()> =
        Reactor::new(&pd, config).map_err(|e| e.to_string())?;
    let access = AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
    let mut qps = Vec::new();
    for name in ["client", "server"] {
        let spec = reactor.qp_spec_with_access(name, access);
        let CqChoice::Shared(cq) = spec.cq else {
            return Err("qp_spec did not share the reactor's CQ".into());
        };
        qps.push(
            pd.create_qp(&cq, &cq, &spec.qp)
                .map_err(|e| e.to_string())?,
        );
    }
    let (mut server_qp, mut client_qp) = (qps.pop().ok_or("no QP")?, qps.pop().ok_or("no QP")?);
    let (client_end, server_end) = (client_qp.endpoint(), server_qp.endpoint());
    client_qp.connect(&server_end).map_err(|e| e.to_string())?;
    server_qp.connect(&client_end).map_err(|e| e.to_string())?;
    let buffer = || pd.alloc_mr(2 * size, AccessFlags::LOCAL_WRITE | access);
    let (client_buf, server_buf) = (
        buffer().map_err(|e| e.to_string())?,
        buffer().map_err(|e| e.to_string())?,
    );
    let to_server = server_buf.remote().map_err(|e| e.to_string())?;
    let to_client = client_buf.remote().map_err(|e| e.to_string())?;
    // The sink drops its buffer: keep both registered for the run.
    let _keep = [
        client_buf.registration().clone(),
        server_buf.registration().clone(),
    ];
    let spec = PerfSpec {
        op,
        size,
        iters: messages,
        warmup: 0,
        batch,
        tx_depth: 0,
    };
    let server_buffers = PerfBuffers {
        buffer: server_buf,
        peer: to_client,
    };
    let client_buffers = PerfBuffers {
        buffer: client_buf,
        peer: to_server,
    };
    let (server, client) = if latency {
        (
            PerfHandler::Reflect(Reflector::new(spec, server_buffers)),
            PerfHandler::Latency(LatencyClient::new(spec, client_buffers)),
        )
    } else {
        (
            PerfHandler::Sink(RateSink::default()),
            PerfHandler::Rate(RateSender::new(spec, client_buffers)),
        )
    };
    reactor
        .add(vec![server_qp], server)
        .map_err(|e| e.to_string())?;
    let session = reactor
        .add(vec![client_qp], client)
        .map_err(|e| e.to_string())?;
    let started = Instant::now();
    reactor.run().map_err(|e| e.to_string())?;
    let elapsed = started.elapsed();
    let failure = match reactor.handler(session) {
        Some(PerfHandler::Latency(client)) => client.failure().map(str::to_owned),
        Some(PerfHandler::Rate(sender)) => sender.failure().map(str::to_owned),
        _ => Some("the client session is gone".into()),
    };
    if let Some(failure) = failure {
        return Err(failure);
    }
    Ok(elapsed.as_nanos() as f64 / messages as f64)
}
