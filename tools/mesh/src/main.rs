//! Full-mesh traffic between cluster ranks (the successor of
//! mesh_comm_service). Started by the site's launcher, never by ssh, through
//! the `tools/mesh/run` script, which runs the binary `target/release/mesh`:
//!
//! ```text
//! mpirun -np 4 tools/mesh/run --op write --duration 5
//! srun -N 4 --ntasks-per-node=1 tools/mesh/run --op send --bytes 1G --reactors 2
//! tools/mesh/run --rank 1 --size 2 --hosts node1,node2     # by hand
//! ```
//!
//! Every rank connects to every other one (rank r listens on
//! `--base-port + r`, accepts the higher ranks and connects to the lower
//! ones). Its sessions run on a runtime of `--reactors` N pinned reactor
//! threads (one by default): reactor p % N serves the session with rank p,
//! with a handler of its own ([`peer`]). Each pair first measures latency
//! with 8-byte SEND ping-pongs in both directions, then both directions
//! stream WRITE_WITH_IMM (into a ring the peer exports) or SEND traffic for
//! `--duration` or `--bytes`, every message filled with a pattern unique to
//! sender, receiver and sequence number and checked on arrival
//! ([`pattern`]). Each stream ends with its message count, which the
//! receiver checks. What crosses peers goes through a small shared
//! [`board`]: when every stream of a rank is over, its row of figures goes
//! to rank 0, which gathers every rank's row and prints the latency and
//! bandwidth matrices ([`report`]). A rank that fails or loses a peer tells
//! the others why before it leaves, and they name the cause.
//!
//! Modules: [`args`] (the command line), [`cluster`] (rank, size and hosts
//! from the launcher), [`setup`] (cores, runtime, listener, connections),
//! [`peer`] (one session's handler), [`board`] (what crosses peers),
//! [`wire`] (message kinds and the figures sent to rank 0), [`pattern`]
//! (the payload), [`report`] (rank 0's matrices).
//!
//! A crate of its own (`rdma-mesh`, binary `mesh`), so that a service
//! embedding `rdma-comm-core` compiles neither it nor [`cluster`].
#![deny(missing_docs, missing_debug_implementations)]
#![deny(unsafe_op_in_unsafe_fn)]

use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

// The device and reactor flags every example shares, from the same file.
#[path = "../../../examples/common/mod.rs"]
mod common;
// The examples' round-trip recorder (constant memory), from the same file.
#[path = "../../../examples/common/rtt.rs"]
mod rtt;

mod args;
mod board;
mod cluster;
mod pattern;
mod peer;
mod report;
mod setup;
mod wire;

use args::Args;
use board::Board;
use cluster::World;
use rdma_comm_core::verbs::Context;
use report::Report;

fn main() -> ExitCode {
    common::init_logging();
    let launched = Instant::now();
    let mut args: Args = common::parse("mesh");
    if let Err(refusal) = args.auth.load() {
        return refusal.exit("mesh");
    }
    let world = match setup::world(&args) {
        Ok(world) => world,
        Err(failure) => {
            eprintln!("mesh: {failure}");
            return ExitCode::FAILURE;
        }
    };
    if let Err(refusal) = setup::check(&args, &world) {
        return refusal.exit("mesh");
    }
    match run(&args, world, launched) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(failure) => {
            eprintln!("mesh: {failure}");
            ExitCode::FAILURE
        }
    }
}

/// One line on stderr in one write, so that the lines of ranks sharing a
/// terminal or a launcher's pipe do not interleave.
fn say(line: &str) {
    let _ = std::io::stderr().write_all(format!("{line}\n").as_bytes());
}

/// Runs this rank, checked and placed in `world`, whose process started
/// at `launched`: true when every message arrived intact (on rank 0: on
/// every rank).
fn run(args: &Args, world: World, launched: Instant) -> Result<bool, String> {
    let reactors = usize::from(args.reactors);
    let device =
        Context::open_default(args.dev.device.as_deref()).map_err(|err| err.to_string())?;
    let cores = setup::cores(args, &world, device.name())?;
    let pd = device.alloc_pd().map_err(|err| err.to_string())?;
    let board = Arc::new(Board::new(world.rank, world.size));
    let runtime = setup::start(args, &world, &pd, cores.choice, &board)?;
    let plan = runtime.plan().clone();
    if reactors > 1 {
        let note = cores.note.map(|note| format!(" (any core: {note})"));
        say(&format!(
            "mesh: rank {}: {}{}; {}",
            world.rank,
            plan,
            note.unwrap_or_default(),
            setup::describe_placement(&world, reactors)
        ));
    } else if let (Some(note), 0) = (&cores.note, world.rank) {
        match plan.cores.first().copied().flatten() {
            Some(core) => say(&format!(
                "mesh: rank 0 runs on core {core} ({note}, so any core will do; each rank takes the core of its node-local rank)"
            )),
            None => say(&format!("mesh: rank 0 is not pinned ({note})")),
        }
    }
    setup::connect_lower(args, &world, &pd, &runtime, &board);
    let handle = runtime.handle();
    let healthy = || match handle.stats().iter().find(|reactor| !reactor.running) {
        Some(stopped) => Err(format!("reactor {} stopped", stopped.reactor)),
        None => Ok(()),
    };
    // One line per rank: where a launch is slow to come up, it says which
    // ranks are past their handshakes.
    let connected = || {
        say(&format!(
            "mesh: rank {}: connected to its {} peers {:.2} s after its start",
            world.rank,
            world.size - 1,
            launched.elapsed().as_secs_f64()
        ))
    };
    let connect_timeout = Duration::from_secs(args.connect_timeout);
    let outcome = board.supervise(connect_timeout, healthy, connected);
    runtime.stop();
    let stats = runtime.join();
    board.stop_waking();
    match &stats {
        Ok(stats) if reactors > 1 => {
            for reactor in stats {
                say(&format!("mesh: rank {}: {reactor}", world.rank));
            }
        }
        Ok(_) => {}
        Err(err) => say(&format!("mesh: rank {}: {err}", world.rank)),
    }
    outcome?;
    stats.map_err(|err| err.to_string())?;
    let bad: u64 = board.row().iter().map(|cell| cell.bad).sum();
    if bad > 0 {
        say(&format!(
            "mesh: rank {}: {bad} messages arrived corrupted, misplaced or out of order",
            world.rank
        ));
    }
    if world.rank == 0 {
        let report = Report::new(args, &world, board.matrix());
        report.print();
        if let Some(path) = &args.json {
            std::fs::write(path, report.json()).map_err(|err| format!("writing {path}: {err}"))?;
        }
        return Ok(report.bad == 0);
    }
    Ok(bad == 0)
}
