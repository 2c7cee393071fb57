//! The reactor's work per message as its connections grow, over the
//! in-process loopback device, as a plain program for instruction counting
//! (`tools/instr-count --host` runs it under callgrind with collection on
//! inside `Reactor::run` only, at 1 and at 1024 connections). A program of
//! its own, not a case of `loopback_path`: a second handler type in one
//! binary moves the optimiser's choices for the first, and with them that
//! program's counts.
//!
//! ```text
//! spread_path MESSAGES CONNS
//! ```
//!
//! 64 B SENDs spread over CONNS connections (1 to 4096), each a session of
//! its own on both ends, at most 16 per doorbell per connection and 64 in
//! flight over all ([`rdma_perf::SpreadRun`]): the same load at every
//! count. Prints the messages, the time per message (not deterministic;
//! the instruction count is) and the reactor's passes.

use std::process::ExitCode;
use std::time::Instant;

use rdma_perf::SpreadRun;

/// Most connections a run takes.
const MAX_CONNS: u32 = 4096;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let Some(messages) = args
        .get(1)
        .and_then(|n| n.parse::<u64>().ok())
        .filter(|&n| n > 0)
    else {
        eprintln!(
            "spread_path: MESSAGES must be a whole number above 0 (usage: spread_path MESSAGES CONNS)"
        );
        return ExitCode::from(2);
    };
    let Some(conns) = args
        .get(2)
        .and_then(|n| n.parse::<u32>().ok())
        .filter(|n| (1..=MAX_CONNS).contains(n))
    else {
        eprintln!("spread_path: CONNS must be a whole number from 1 to {MAX_CONNS}");
        return ExitCode::from(2);
    };
    if args.len() > 3 {
        eprintln!("spread_path: takes MESSAGES and CONNS only");
        return ExitCode::from(2);
    }
    // SAFETY: the reactor built here serves every QP of this device on
    // this one thread, and nothing else touches their bytes.
    let ctx = unsafe { rdma_comm_core::verbs::Context::loopback() };
    let built = ctx
        .alloc_pd()
        .and_then(|pd| SpreadRun::new(&pd, conns, messages).map(|run| (pd, run)));
    let (_pd, mut run) = match built {
        Ok(built) => built,
        Err(err) => {
            eprintln!("spread_path: {err}");
            return ExitCode::FAILURE;
        }
    };
    let started = Instant::now();
    if let Err(err) = run.reactor.run() {
        eprintln!("spread_path: {err}");
        return ExitCode::FAILURE;
    }
    let elapsed = started.elapsed();
    if let Some(failure) = run.failure() {
        eprintln!("spread_path: {failure}");
        return ExitCode::FAILURE;
    }
    let counters = run.reactor.counters();
    println!(
        "{} messages over {conns} connections {:.1} ns/message, {} passes ({} empty), {} doorbells",
        counters.messages,
        elapsed.as_nanos() as f64 / counters.messages.max(1) as f64,
        counters.passes,
        counters.empty_passes,
        counters.doorbells,
    );
    ExitCode::SUCCESS
}
