//! How long a command an application thread submits waits until its
//! doorbell: the runtime's submission tracing (`trace_submissions`), read
//! from the reactor's statistics. Prints figures; asserts nothing.
//!
//! ```text
//! submit_latency [--commands 100000] [--size 64] [--event-mode busy|blocking]
//! ```
//!
//! A runtime of one reactor sends 64-byte commands from this thread to a
//! sink on a reactor of its own (another thread), in two patterns:
//! - **one at a time**: submit, wait until the reactor has taken it, pause
//!   20 µs: the unloaded path (in Blocking mode, a wake-up included);
//! - **flood**: submit as fast as the ring takes them: queueing behind a
//!   full ring and the connection's credits.
//!
//! Each figure is the age of a command (TSC at `send`) when the pass that
//! staged it returned from its doorbells: median, 99th percentile and
//! maximum, to within 6 %.

use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

mod common;

use clap::Parser;
use rdma_comm_core::reactor::*;
use rdma_comm_core::runtime::*;
use rdma_comm_core::session::*;
use rdma_comm_core::verbs::*;

/// Submit-to-doorbell latency of the runtime's submission rings.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Commands per pattern (at least 1).
    #[arg(long, default_value_t = 100_000, value_parser = common::at_least(1u64))]
    commands: u64,
    /// Payload bytes per command, 1 B to 1 MiB (a submission slot's most).
    #[arg(long, default_value_t = 64, value_parser = common::range(1usize, MAX_SUBMIT_SLOT))]
    size: usize,
    /// How the runtime's reactor waits.
    #[arg(long, value_enum, default_value_t = common::EventArg::Busy)]
    event_mode: common::EventArg,
    #[command(flatten)]
    dev: common::DeviceArgs,
}

fn main() -> ExitCode {
    common::init_logging();
    match run(&common::parse::<Args>("submit_latency")) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("submit_latency: {err}");
            ExitCode::FAILURE
        }
    }
}

/// Tells the main thread its connection, then does nothing: the commands
/// go out from the ring.
struct Sender(mpsc::Sender<ConnId>);

impl Handler for Sender {
    fn on_established(&mut self, _ctx: &mut Ctx<'_>, conn: ConnId) {
        let _ = self.0.send(conn);
    }

    fn on_message(&mut self, _: &mut Ctx<'_>, _: ConnId, _: &[u8], _: Option<u32>) {}
}

/// Counts what arrives.
struct Sink(Arc<AtomicU64>);

impl Handler for Sink {
    fn on_message(&mut self, _: &mut Ctx<'_>, _: ConnId, _: &[u8], _: Option<u32>) {
        self.0.fetch_add(1, Ordering::Release);
    }
}

fn run(args: &Args) -> rdma_comm_core::Result<()> {
    let ctx = Context::open_default(args.dev.device.as_deref())?;
    let pd = ctx.alloc_pd()?;
    println!(
        "submit_latency on {}: one reactor ({:?}); {} commands of {} B per pattern",
        ctx.name(),
        args.event_mode,
        args.commands,
        args.size
    );
    // A fresh runtime and peer per pattern, so each histogram is its own.
    for (name, one_at_a_time) in [("one at a time", true), ("flood", false)] {
        pattern(args, &pd, name, one_at_a_time)?;
    }
    Ok(())
}

fn pattern(
    args: &Args,
    pd: &ProtectionDomain,
    name: &str,
    one_at_a_time: bool,
) -> rdma_comm_core::Result<()> {
    let (tx, established) = mpsc::channel();
    let tx = std::sync::Mutex::new(tx);
    let config = RuntimeConfig {
        reactors: 1,
        reactor: ReactorConfig {
            event_mode: args.event_mode.into(),
            ..ReactorConfig::for_traffic(args.size.max(64), 64, 1)
        },
        submit_slot_size: args.size,
        trace_submissions: true,
        ..RuntimeConfig::default()
    };
    let factory = move |_: &NewSession<'_>| {
        let tx = tx.lock().unwrap_or_else(|p| p.into_inner()).clone();
        Ok(Sender(tx))
    };
    let mut runtime = Runtime::start(pd, config, factory)?;
    // Server and peer share one process, and a key made for this run.
    let key = AuthKey::random()?;
    let mut server = runtime.server_config(AccessFlags::empty());
    server.auth_key = Some(key.clone());
    args.dev.apply(&mut server.qp);
    let addr = runtime.serve("127.0.0.1:0", server)?;

    // The peer: a sink on a Blocking reactor of its own.
    let arrived = Arc::new(AtomicU64::new(0));
    let quit = Arc::new(AtomicBool::new(false));
    let sink = {
        let (arrived, quit, pd) = (Arc::clone(&arrived), Arc::clone(&quit), pd.clone());
        let dev = args.dev.clone();
        let size = args.size;
        std::thread::spawn(move || -> rdma_comm_core::Result<()> {
            let config = ReactorConfig {
                event_mode: EventMode::Blocking,
                idle_timeout: Duration::from_millis(20),
                ..ReactorConfig::for_traffic(size.max(64), 64, 1)
            };
            let mut reactor: Reactor<Sink> = Reactor::new(&pd, config)?;
            let mut spec = reactor.qp_spec("sink");
            dev.apply(&mut spec.qp);
            let client = ClientConfig::new(vec![spec]).with_auth_key(Some(key));
            let endpoint = ClientSession::connect(addr, &pd, &client)?;
            reactor.add(endpoint, Sink(arrived))?;
            while !quit.load(Ordering::Acquire) {
                reactor.turn()?;
            }
            Ok(())
        })
    };
    let outcome = established
        .recv_timeout(Duration::from_secs(30))
        .map_err(|_| rdma_comm_core::Error::Runtime("the sink never connected".into()))
        .and_then(|conn| submit_all(args, &runtime, conn, &arrived, one_at_a_time));
    quit.store(true, Ordering::Release);
    runtime.stop();
    let stats = runtime.join()?;
    let sink = sink
        .join()
        .unwrap_or_else(|_| Err(rdma_comm_core::Error::Runtime("the sink panicked".into())));
    let sent = outcome?;
    sink?;
    let latency = stats[0].submit_latency.unwrap_or_default();
    println!(
        "{name:<14} submit to doorbell: p50 {:>8.2} us  p99 {:>8.2} us  max {:>9.2} us  ({} commands traced, {} of {sent} arrived)",
        latency.p50_ns as f64 / 1e3,
        latency.p99_ns as f64 / 1e3,
        latency.max_ns as f64 / 1e3,
        latency.samples,
        arrived.load(Ordering::Acquire),
    );
    println!("  {}", stats[0]);
    Ok(())
}

/// Submits `args.commands` commands in the pattern; returns how many.
fn submit_all(
    args: &Args,
    runtime: &Runtime,
    conn: ConnId,
    arrived: &AtomicU64,
    one_at_a_time: bool,
) -> rdma_comm_core::Result<u64> {
    let mut submitter = runtime.submitter(0)?;
    let payload = vec![0x5a; args.size];
    let deadline = Instant::now() + Duration::from_secs(600);
    for _ in 0..args.commands {
        while let Err(err) = submitter.send(conn, &payload, None) {
            if err != SubmitError::WouldBlock || Instant::now() > deadline {
                return Err(rdma_comm_core::Error::Runtime(format!("submitting: {err}")));
            }
            std::hint::spin_loop();
        }
        if one_at_a_time {
            while submitter.queued() > 0 {
                if Instant::now() > deadline {
                    return Err(rdma_comm_core::Error::Runtime(
                        "the reactor stopped taking commands".into(),
                    ));
                }
                std::hint::spin_loop();
            }
            let pause = Instant::now();
            while pause.elapsed() < Duration::from_micros(20) {
                std::hint::spin_loop();
            }
        }
    }
    while arrived.load(Ordering::Acquire) < args.commands && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(args.commands)
}
