//! The reactor's data path allocates nothing: after warm-up, 1,000,000
//! ping-pong round trips (SEND/RECV and WRITE_WITH_IMM, alternating) make zero
//! heap allocations on the reactor thread; so do 100,000 through an SRQ. Gated as in `tests/util/mod.rs`.

mod util;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::Ordering;

use rdma_comm_core::reactor::*;
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

    // The counter itself proves it works: this allocation must be seen.
    COUNTING.with(|c| c.set(true));
    drop(std::hint::black_box(Box::new(1u8)));
    COUNTING.with(|c| c.set(false));
    assert_eq!(
        ALLOCATIONS.with(|n| n.replace(0)),
        1,
        "the counting allocator counts"
    );

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
