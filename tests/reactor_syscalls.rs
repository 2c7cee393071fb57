//! The busy-poll path makes no syscalls of its own. The provider's doorbell
//! is the provider's business (Soft-RoCE rings it with a `write()` on the
//! uverbs fd), so `write` is left out of the count; everything else the
//! reactor thread enters the kernel for is counted with a perf event on the
//! `raw_syscalls:sys_enter` tracepoint for this thread.
//! Gated as in `tests/util/mod.rs`.

mod util;

use std::sync::atomic::Ordering;
use std::time::Duration;

use rdma_comm_core::reactor::*;
use util::reactor::*;
use util::syscalls::SyscallCounter;
use util::*;

/// About how often the reactor's pass timer reads the clock (its documented
/// interval): `run_for` may read it about this often, and no more.
const CLOCK_READ_INTERVAL: Duration = Duration::from_millis(2);

verbs_test! {
    fn the_busy_poll_path_makes_no_syscalls_of_its_own() {
        let counter = SyscallCounter::open()
            .unwrap_or_else(|err| panic!("cannot count syscalls in this guest: {err}"));
        // The counter itself proves it works: these three must be seen.
        let seen = counter
            .count(|| {
                for _ in 0..3 {
                    // SAFETY: getppid has no preconditions.
                    std::hint::black_box(unsafe { libc::getppid() });
                }
            })
            .unwrap();
        assert_eq!(seen, 3, "the counter counts");

        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        // The peer watch is a periodic syscall between passes: this proves
        // the rest makes none.
        let config = ReactorConfig {
            slot_size: 1024,
            peer_check_interval: None,
            ..ReactorConfig::default()
        };
        let mut reactor: Reactor<BoxedHandler> = Reactor::new(&pd, config).unwrap();
        let (ping, echo) = add_ping_pong(&pd, Sides::One(&mut reactor), 2_000, 32, true);
        reactor.run().unwrap();
        assert_eq!(ping.done.load(Ordering::Relaxed), 2_000, "warm-up completed");

        ping.limit.store(102_000, Ordering::Relaxed);
        let mut result = Ok(());
        let busy = counter.count(|| result = reactor.run()).unwrap();
        result.unwrap();
        assert_eq!(ping.done.load(Ordering::Relaxed), 102_000);
        println!("100000 round trips (SEND and WRITE_WITH_IMM) through run(): {busy} syscalls besides doorbells");
        assert_eq!(busy, 0, "the busy-poll path entered the kernel");

        let idle = counter
            .count(|| {
                for _ in 0..200_000 {
                    if let Err(err) = reactor.poll_once() {
                        panic!("idle pass: {err}");
                    }
                }
            })
            .unwrap();
        println!("200000 idle passes: {idle} syscalls besides doorbells");
        assert_eq!(idle, 0, "an idle pass entered the kernel");

        // run_for has to tell time; it reads the clock about every
        // CLOCK_READ_INTERVAL, not every so many passes (on a non-TSC
        // clocksource each reading is a syscall; on a TSC one, none is).
        // Idle passes are the cheapest, so the most frequent.
        let window = Duration::from_millis(400);
        let mut ended = Ok(Ended::Stopped);
        let timed = counter.count(|| ended = reactor.run_for(window)).unwrap();
        assert_eq!(ended.unwrap(), Ended::Reached, "run_for returned at its limit");
        let allowed = (window.as_micros() / CLOCK_READ_INTERVAL.as_micros()) as u64 * 2 + 16;
        println!(
            "run_for({window:?}) on an idle reactor: {timed} syscalls besides doorbells (at most {allowed})"
        );
        assert!(timed <= allowed, "run_for read the clock {timed} times in {window:?}");
        assert_eq!(
            ping.bad.load(Ordering::Relaxed) + echo.bad.load(Ordering::Relaxed),
            0,
            "every echo verified"
        );
    }
}

verbs_test! {
    /// A run on direct connections (a SEND ping-pong, both ends on one
    /// reactor, busy polling) makes no syscalls besides doorbells either.
    fn direct_connections_make_no_syscalls_of_their_own() {
        use rdma_perf::loopback::{PerfPair, perf_pair_on};
        use rdma_perf::{DirectClient, DirectServer, PerfHandler, PerfOp, PerfSpec};
        let counter = SyscallCounter::open()
            .unwrap_or_else(|err| panic!("cannot count syscalls in this guest: {err}"));
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        let spec = PerfSpec { op: PerfOp::Send, size: 8, iters: 50_000, warmup: 0, batch: 1, tx_depth: 0 };
        let PerfPair { mut reactor, client, exports: _exports } = perf_pair_on(
            &pd,
            1,
            8,
            |buffers| PerfHandler::DirectClient(DirectClient::latency(spec, buffers)),
            |buffers| PerfHandler::DirectServer(DirectServer::new(spec, buffers, false)),
            true,
        )
        .unwrap();
        let mut result = Ok(());
        let busy = counter.count(|| result = reactor.run()).unwrap();
        result.unwrap();
        let Some(PerfHandler::DirectClient(done)) = reactor.handler(client) else {
            panic!("the client is gone");
        };
        assert_eq!(done.failure(), None);
        assert!(done.is_done(), "the run ended early");
        println!("50000 SEND round trips on direct connections: {busy} syscalls besides doorbells");
        assert_eq!(busy, 0, "the direct path entered the kernel");
    }
}

verbs_test! {
    /// A datagram ping-pong between two endpoints of one reactor, busy
    /// polling, makes no syscalls besides doorbells either.
    fn datagram_endpoints_make_no_syscalls_of_their_own() {
        use util::datagram::*;
        let counter = SyscallCounter::open()
            .unwrap_or_else(|err| panic!("cannot count syscalls in this guest: {err}"));
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        let config = ReactorConfig { peer_check_interval: None, ..ReactorConfig::default() };
        let mut reactor: Reactor<DatagramPeer> = Reactor::new(&pd, config).unwrap();
        let outcome = add_datagram_ping_pong(&mut reactor, 2_000);
        reactor.run().unwrap();
        outcome.limit.store(52_000, Ordering::Relaxed);
        let mut result = Ok(());
        let busy = counter.count(|| result = reactor.run()).unwrap();
        result.unwrap();
        assert_eq!(outcome.done.load(Ordering::Relaxed), 52_000);
        assert_eq!(outcome.errors.load(Ordering::Relaxed), 0);
        println!("50000 datagram round trips: {busy} syscalls besides doorbells");
        assert_eq!(busy, 0, "the datagram path entered the kernel");
    }
}
