//! The reactor's data path allocates nothing: after warm-up, 1,000,000
//! ping-pong round trips (SEND/RECV and WRITE_WITH_IMM, alternating) make zero
//! heap allocations on the reactor thread; so do 100,000 through an SRQ, and
//! a loop of the verbs layer's kept requests (SEND, a batch of WRITEs, READ)
//! with its polls, and runs on direct connections (rdma-perf's direct roles:
//! SEND, WRITE and READ latency, WRITE and SEND at batch 16). (Rust's allocator is what is counted: a `malloc` inside
//! libibverbs or the provider is not seen.) Gated as in `tests/util/mod.rs`.

mod util;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::Ordering;

use rdma_comm_core::reactor::*;
use rdma_comm_core::verbs::{
    AccessFlags, CompletionQueue, RecvRequest, SendBatch, WorkCompletion, WorkRequest,
};
use util::reactor::*;
use util::*;

/// Counts allocations made by threads that opted in, per thread: the tests
/// of this file run in parallel, and one's count must not leak into another's.
struct CountingAllocator;

thread_local! {
    static COUNTING: Cell<bool> = const { Cell::new(false) };
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

fn note_allocation() {
    // `try_with`: the allocator also runs while thread-locals are torn down.
    if COUNTING.try_with(Cell::get).unwrap_or(false) {
        let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
    }
}

// SAFETY: every call is forwarded to the system allocator unchanged.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note_allocation();
        // SAFETY: forwarded with the caller's layout.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note_allocation();
        // SAFETY: forwarded with the caller's layout.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note_allocation();
        // SAFETY: forwarded with the caller's pointer and layouts.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded with the caller's pointer and layout.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator;

/// The counter proves it works before a test trusts its zero: this
/// allocation must be seen.
fn assert_the_counter_counts() {
    COUNTING.with(|c| c.set(true));
    drop(std::hint::black_box(Box::new(1u8)));
    COUNTING.with(|c| c.set(false));
    assert_eq!(
        ALLOCATIONS.with(|n| n.replace(0)),
        1,
        "the counting allocator counts"
    );
}

const WARM_UP: u64 = 10_000;
const MEASURED: u64 = 1_000_000;

verbs_test! {
    fn a_million_round_trips_allocate_nothing() {
        round_trips_allocate_nothing(MEASURED, 0);
    }
}

verbs_test! {
    fn round_trips_through_an_srq_allocate_nothing() {
        round_trips_allocate_nothing(MEASURED / 10, 512);
    }
}

/// Measures `measured` round trips after warm-up; `srq_depth` 0: per-QP rings.
fn round_trips_allocate_nothing(measured: u64, srq_depth: u32) {
    let ctx = open_device();
    let pd = ctx.alloc_pd().unwrap();
    let config = ReactorConfig {
        slot_size: 1024,
        srq_depth,
        ..ReactorConfig::default()
    };
    let mut reactor: Reactor<BoxedHandler> = Reactor::new(&pd, config).unwrap();
    let (ping, echo) = add_ping_pong(&pd, Sides::One(&mut reactor), WARM_UP, 32, true);
    reactor.run().unwrap();
    assert_eq!(
        ping.done.load(Ordering::Relaxed),
        WARM_UP,
        "warm-up completed"
    );

    assert_the_counter_counts();

    ping.limit.store(WARM_UP + measured, Ordering::Relaxed);
    COUNTING.with(|c| c.set(true));
    let result = reactor.run();
    COUNTING.with(|c| c.set(false));
    result.unwrap();

    let allocations = ALLOCATIONS.with(Cell::get);
    println!(
        "{measured} round trips through the reactor (SRQ depth {srq_depth}): {allocations} heap allocations"
    );
    assert_eq!(ping.done.load(Ordering::Relaxed), WARM_UP + measured);
    assert_eq!(
        ping.bad.load(Ordering::Relaxed) + echo.bad.load(Ordering::Relaxed),
        0,
        "every echo verified"
    );
    assert_eq!(
        ping.errors.load(Ordering::Relaxed) + echo.errors.load(Ordering::Relaxed),
        0
    );
    assert_eq!(allocations, 0, "the data path allocated");
}

/// Rounds of the verbs-layer loop counted (after as many unmeasured).
const KEPT_ROUNDS: u64 = 10_000;
/// WRITEs per doorbell in the verbs-layer loop.
const KEPT_BATCH: usize = 16;

/// Polls `cq` until `count` completions came, each a success, without
/// allocating (the message of a failed assertion would, but then the test
/// fails anyway).
fn reap(cq: &mut CompletionQueue, wcs: &mut [WorkCompletion], count: usize) {
    let start = std::time::Instant::now();
    let mut got = 0;
    while got < count {
        for wc in cq.poll(wcs).expect("poll") {
            assert!(wc.is_success(), "a failed completion");
            got += 1;
        }
        assert!(start.elapsed() < DEADLINE, "completions late");
    }
}

verbs_test! {
    fn the_verbs_layers_kept_requests_allocate_nothing() {
        let Pair { mut a, mut b, mut cq_a, mut cq_b, pd, ctx: _ctx } = Pair::with_remote_access();
        let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
        let mut mr = pd.alloc_mr(8192, access).unwrap();
        let remote = mr.remote().unwrap();
        let registration = mr.registration().clone();
        // A SEND of bytes [0, 64) into a receive at [4096, 4160); 16 WRITEs
        // of [64k, 64k + 64) to [5120 + 64k, ...); a READ of [4096, 4160)
        // into [7168, 7232).
        let mut landing = RecvRequest::new(1, registration.slice(4096, 64).unwrap()).unwrap();
        let mut send = WorkRequest::send(2, registration.slice(0, 64).unwrap()).signaled();
        let mut writes: SendBatch<'_, KEPT_BATCH> = SendBatch::new();
        for k in 0..KEPT_BATCH {
            let local = registration.slice(64 * k, 64).unwrap();
            let target = remote.slice(5120 + 64 * k as u64, 64).unwrap();
            let write = WorkRequest::write(100 + k as u64, local, target).unwrap();
            let write = if k + 1 == KEPT_BATCH { write.signaled() } else { write };
            writes.push(write).unwrap();
        }
        let mut read = WorkRequest::read(3, registration.slice(7168, 64).unwrap(), remote.slice(4096, 64).unwrap())
            .unwrap()
            .signaled();
        let mut wcs = [WorkCompletion::default(); 32];
        let mut round = |mr: &mut rdma_comm_core::verbs::MemoryRegion, i: u64| {
            mr.write(0, &[i as u8; 64 * KEPT_BATCH]).unwrap();
            b.post_recv(&mut landing).unwrap();
            a.post_send(&mut send).unwrap();
            reap(&mut cq_a, &mut wcs, 1);
            reap(&mut cq_b, &mut wcs, 1);
            a.post_send(&mut writes).unwrap();
            reap(&mut cq_a, &mut wcs, 1);
            a.post_send(&mut read).unwrap();
            reap(&mut cq_a, &mut wcs, 1);
        };
        for i in 0..KEPT_ROUNDS {
            round(&mut mr, i);
        }
        assert_the_counter_counts();
        COUNTING.with(|c| c.set(true));
        for i in KEPT_ROUNDS..2 * KEPT_ROUNDS {
            round(&mut mr, i);
        }
        COUNTING.with(|c| c.set(false));
        let allocations = ALLOCATIONS.with(|n| n.replace(0));
        println!("{KEPT_ROUNDS} rounds of kept requests (a SEND, 16 WRITEs, a READ): {allocations} heap allocations");

        // The last round's bytes went where each request points.
        let last = (2 * KEPT_ROUNDS - 1) as u8;
        assert_eq!(read_back(&mr, 4096, 64), vec![last; 64], "the SEND landed");
        for k in 0..KEPT_BATCH {
            assert_eq!(read_back(&mr, 5120 + 64 * k, 64), vec![last; 64], "WRITE {k}");
        }
        assert_eq!(read_back(&mr, 7168, 64), vec![last; 64], "the READ fetched");
        assert_eq!(allocations, 0, "the kept posts and polls allocated");
    }
}

/// Heap allocations of one whole `run` of `reactor` (which must succeed).
fn allocations_of_run(reactor: &mut Reactor<rdma_perf::PerfHandler, ()>) -> u64 {
    assert_the_counter_counts();
    COUNTING.with(|c| c.set(true));
    let result = reactor.run();
    COUNTING.with(|c| c.set(false));
    result.unwrap();
    ALLOCATIONS.with(|n| n.replace(0))
}

/// Iterations of each run on direct connections.
const DIRECT_ITERS: u64 = 20_000;

verbs_test! {
    /// Whole latency runs of the reactor's own protocol, both ends on one
    /// reactor, allocate nothing: READs rung from the callbacks
    /// (`Ctx::read_now`), WRITEs and WRITE_WITH_IMMs staged.
    fn latency_runs_rung_now_allocate_nothing() {
        use rdma_perf::loopback::{PerfPair, perf_pair_on};
        use rdma_perf::{LatencyClient, PerfHandler, PerfOp, PerfSpec, Reflector};
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        for op in [PerfOp::Read, PerfOp::Write, PerfOp::WriteImm] {
            let spec = PerfSpec { op, size: 8, iters: DIRECT_ITERS, warmup: 0, batch: 1, tx_depth: 0 };
            let PerfPair { mut reactor, client, exports: _exports } = perf_pair_on(
                &pd,
                16,
                8,
                |buffers| PerfHandler::Latency(LatencyClient::new(spec, buffers)),
                |buffers| PerfHandler::Reflect(Reflector::new(spec, buffers)),
                false,
            )
            .unwrap();
            let allocations = allocations_of_run(&mut reactor);
            println!("{DIRECT_ITERS} {op:?} latency round trips: {allocations} heap allocations");
            let Some(PerfHandler::Latency(done)) = reactor.handler(client) else {
                panic!("{op:?}: the client is gone");
            };
            assert_eq!(done.failure(), None, "{op:?}");
            assert!(done.is_done(), "{op:?}: the run ended early");
            assert_eq!(allocations, 0, "{op:?}: the data path allocated");
        }
    }
}

verbs_test! {
    /// Whole runs on direct connections, both ends on one reactor, from
    /// the first pass to the done marker: the requests were built when
    /// `add_direct` handed the connections over, and the run allocates
    /// nothing (the samples and rate marks are preallocated). Also with
    /// the client spinning (`Ctx::spin`): READs from the spin alone, and
    /// SENDs whose answers the other end's handler makes, so each spin
    /// ends at the other end's completion and the reactor routes it.
    fn runs_on_direct_connections_allocate_nothing() {
        use rdma_perf::loopback::{PerfPair, perf_pair_on};
        use rdma_perf::{DirectClient, DirectServer, PerfHandler, PerfOp, PerfSpec};
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        for (op, latency, spin) in [
            (PerfOp::Send, true, false),
            (PerfOp::Write, true, false),
            (PerfOp::Read, true, false),
            (PerfOp::Write, false, false),
            (PerfOp::Send, false, false),
            (PerfOp::Read, true, true),
            (PerfOp::Send, true, true),
        ] {
            let size = if latency { 8 } else { 64 };
            let spec = PerfSpec { op, size, iters: DIRECT_ITERS, warmup: 0, batch: 16, tx_depth: 128 };
            let PerfPair { mut reactor, client, exports: _exports } = perf_pair_on(
                &pd,
                1,
                size,
                |buffers| match (latency, spin) {
                    (true, true) => PerfHandler::DirectClient(DirectClient::latency(spec, buffers).spinning()),
                    (true, false) => PerfHandler::DirectClient(DirectClient::latency(spec, buffers)),
                    (false, _) => PerfHandler::DirectClient(DirectClient::bandwidth(spec, buffers)),
                },
                |buffers| PerfHandler::DirectServer(DirectServer::new(spec, buffers, !latency)),
                true,
            )
            .unwrap();
            let allocations = allocations_of_run(&mut reactor);
            let what = format!(
                "{op:?} {}{}",
                if latency { "latency" } else { "batch 16" },
                if spin { ", spinning" } else { "" }
            );
            println!("{DIRECT_ITERS} iterations of {what} on direct connections: {allocations} heap allocations");
            let Some(PerfHandler::DirectClient(done)) = reactor.handler(client) else {
                panic!("{what}: the client is gone");
            };
            assert_eq!(done.failure(), None, "{what}");
            assert!(done.is_done(), "{what}: the run ended early");
            assert_eq!(allocations, 0, "{what}: the data path allocated");
        }
    }
}

verbs_test! {
    fn datagram_round_trips_allocate_nothing() {
        use util::datagram::*;
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        let mut reactor: Reactor<DatagramPeer> = Reactor::new(&pd, ReactorConfig::default()).unwrap();
        let outcome = add_datagram_ping_pong(&mut reactor, WARM_UP);
        reactor.run().unwrap();
        assert_eq!(outcome.done.load(Ordering::Relaxed), WARM_UP, "warm-up completed");

        assert_the_counter_counts();

        let measured = MEASURED / 10;
        outcome.limit.store(WARM_UP + measured, Ordering::Relaxed);
        COUNTING.with(|c| c.set(true));
        let result = reactor.run();
        COUNTING.with(|c| c.set(false));
        result.unwrap();

        let allocations = ALLOCATIONS.with(Cell::get);
        println!("{measured} datagram round trips through the reactor: {allocations} heap allocations");
        assert_eq!(outcome.done.load(Ordering::Relaxed), WARM_UP + measured);
        assert_eq!(outcome.errors.load(Ordering::Relaxed), 0);
        assert_eq!(allocations, 0, "the datagram path allocated");
    }
}
