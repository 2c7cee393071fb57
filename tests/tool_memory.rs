//! The tools' latency statistics take constant memory, whatever the count:
//! the recorder ping_pong's client, demo and mesh keep their round trips
//! in allocates nothing per record (on the host, under a counting
//! allocator), and a ping_pong client asked for 10^9 round trips runs
//! with a flat resident set (in the Soft-RoCE guest).

mod util;

#[path = "../examples/common/rtt.rs"]
mod rtt;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::time::{Duration, Instant};

use rtt::RttRecorder;
use util::ping_pong::start_server;
use util::process::Proc;

/// The system allocator, counting the bytes each thread asks for.
struct Counting;

thread_local! {
    static ASKED: Cell<u64> = const { Cell::new(0) };
}

fn count(bytes: usize) {
    // Not during the thread's teardown, when the counter is gone.
    let _ = ASKED.try_with(|asked| asked.set(asked.get() + bytes as u64));
}

// SAFETY: every call goes to the system allocator with the caller's own
// arguments; counting touches only a thread-local cell.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        // SAFETY: the caller's layout, as `GlobalAlloc::alloc` requires.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        // SAFETY: as in `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count(new_size);
        // SAFETY: the caller's block, layout and size, as `realloc` requires.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's block and layout, as `dealloc` requires.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Bytes this thread asked the allocator for while `work` ran.
fn asked_during(work: impl FnOnce()) -> u64 {
    let before = ASKED.with(Cell::get);
    work();
    ASKED.with(Cell::get) - before
}

#[test]
fn recording_round_trips_allocates_nothing_after_the_recorder_is_made() {
    // The counter sees an allocation (so a zero below means none).
    let asked = asked_during(|| drop(std::hint::black_box(Vec::<u64>::with_capacity(1000))));
    assert!(asked >= 8000, "a vector of 1000 u64 counted as {asked} B");
    let mut rtts = RttRecorder::new();
    let footprint = rtts.footprint_bytes();
    let asked = asked_during(|| {
        for ns in 1..=10 {
            rtts.record(ns * 1_000);
        }
    });
    assert_eq!(asked, 0, "10 records asked for {asked} B");
    assert_eq!(rtts.footprint_bytes(), footprint);
    // Spread over the whole range the recorder tells apart, and beyond.
    let asked = asked_during(|| {
        for i in 0..10_000_000u64 {
            rtts.record(i.wrapping_mul(2_654_435_761) % (1 << 43));
        }
    });
    assert_eq!(asked, 0, "10^7 records asked for {asked} B");
    assert_eq!(rtts.footprint_bytes(), footprint);
    assert_eq!(rtts.count(), 10_000_010);
    // Reading the percentiles allocates nothing either.
    let asked = asked_during(|| {
        assert!(rtts.quantile_ns(0.5) <= rtts.quantile_ns(0.99));
    });
    assert_eq!(asked, 0, "percentiles asked for {asked} B");
}

/// The resident set of process `pid`, in KiB.
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no VmRSS in /proc/{pid}/status"))
}

/// Packets `device`'s port 1 received (Soft-RoCE's counter, device-wide).
fn received_packets(device: &str) -> u64 {
    let path = format!("/sys/class/infiniband/{device}/ports/1/hw_counters/rcvd_pkts");
    std::fs::read_to_string(&path)
        .unwrap_or_else(|err| panic!("{path}: {err}"))
        .trim()
        .parse()
        .unwrap()
}

/// Round trips a run asked for 10^9 of gets through between the two
/// readings of its resident set. Every round trip stores 8 bytes or more
/// if its time is kept (the client did so before), 800 KB for these.
const ROUND_TRIPS_BETWEEN: u64 = 100_000;

/// The most the resident set may grow between the two readings.
const FLAT_KIB: u64 = 256;

/// Waits until `device` received `packets` more than `from`, failing the
/// test at `deadline` or if `client` exits.
#[track_caller]
fn wait_for_packets(client: &mut Proc, device: &str, from: u64, packets: u64, deadline: Instant) {
    client.deadline = deadline.saturating_duration_since(Instant::now());
    client.wait_until(&format!("{packets} more packets received"), || {
        received_packets(device) - from >= packets
    });
}

verbs_test! {
    /// A ping_pong client asked for 10^9 round trips (8 GB of RTTs, were
    /// they kept in a vector) runs, and its resident
    /// set stays flat over 10^5 of them. A round trip is at most 4
    /// packets received on the device (a ping and its echo, and an ACK
    /// each), so the device's count of packets received bounds how many
    /// have passed. Killed once that is shown.
    fn a_ping_pong_client_of_a_billion_round_trips_keeps_a_flat_resident_set() {
        let device = util::open_device().name().to_string();
        let (_server, addr) = start_server(&[]);
        let mut client = Proc::spawn(
            "ping_pong",
            &["--connect", &addr.to_string(), "--iters", "1000000000", "--size", "8", "--batch", "16"],
        );
        client.expect_line("connected to");
        let deadline = Instant::now() + Duration::from_secs(600);
        // Past the start: the first thousands of round trips touch what
        // the reactor and the allocator set up.
        let start = received_packets(&device);
        wait_for_packets(&mut client, &device, start, 4 * 20_000, deadline);
        let (before, from) = (rss_kib(client.pid()), received_packets(&device));
        wait_for_packets(&mut client, &device, from, 4 * ROUND_TRIPS_BETWEEN, deadline);
        let after = rss_kib(client.pid());
        client.kill();
        assert!(
            after <= before + FLAT_KIB,
            "the resident set grew from {before} KiB to {after} KiB over {ROUND_TRIPS_BETWEEN} round trips or more"
        );
    }
}
