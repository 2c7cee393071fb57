//! What the runtime promises, measured in the guest:
//! - commands an application thread submits through a ring reach the peer
//!   intact, and while 1,000,000 of them flow (the ring running full) the
//!   whole process allocates nothing, the submitting thread makes no
//!   syscall at all (no lock, no wake-up: the reactor busy-polls) and the
//!   reactor thread none besides its doorbells; and they share the
//!   reactor's doorbells;
//! - commands submitted to a sleeping reactor wake it;
//! - an idle runtime in Blocking mode makes no syscalls at all, with or
//!   without peers, and still wakes for a new session, a peer that leaves
//!   and a stop; a reactor sleeping without a timer still loses a peer
//!   whose control frame stops halfway, at that frame's deadline.
//!
//! Allocations are counted process-wide while a window is open, with a
//! counting `#[global_allocator]`; syscalls with perf events on the
//! `raw_syscalls:sys_enter` tracepoint, per thread. Gated as in
//! `tests/util/mod.rs`.

mod util;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use rdma_comm_core::Error;
use rdma_comm_core::reactor::*;
use rdma_comm_core::runtime::*;
use rdma_comm_core::session::*;
use rdma_comm_core::verbs::AccessFlags;
use util::runtime::*;
use util::syscalls::SyscallCounter;
use util::*;

struct CountingAllocator;

static MEASURING: AtomicBool = AtomicBool::new(false);
static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);
/// The thread and size of the first allocations counted, to name the
/// culprit of a failure (recorded without allocating).
static CULPRITS: [AtomicU64; 4] = [const { AtomicU64::new(0) }; 4];

fn note(size: usize) {
    // The test harness's main thread (tid = pid) is not the system under
    // test: it allocates to print "has been running for over 60 seconds".
    // SAFETY: getpid and gettid have no preconditions.
    if MEASURING.load(Ordering::Relaxed) && unsafe { libc::gettid() != libc::getpid() } {
        let n = ALLOCATIONS.fetch_add(1, Ordering::Relaxed) as usize;
        if let Some(slot) = CULPRITS.get(n) {
            // SAFETY: gettid has no preconditions.
            let tid = unsafe { libc::gettid() } as u64;
            slot.store(tid << 32 | size as u64, Ordering::Relaxed);
        }
    }
}

/// "thread name (tid): N bytes" for each allocation recorded.
fn culprits() -> Vec<String> {
    let n = (ALLOCATIONS.load(Ordering::Relaxed) as usize).min(CULPRITS.len());
    CULPRITS[..n]
        .iter()
        .map(|slot| {
            let value = slot.load(Ordering::Relaxed);
            let (tid, size) = (value >> 32, value & 0xffff_ffff);
            let comm =
                std::fs::read_to_string(format!("/proc/self/task/{tid}/comm")).unwrap_or_default();
            format!("{} ({tid}): {size} bytes", comm.trim())
        })
        .collect()
}

// SAFETY: every call is forwarded to the system allocator unchanged.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: forwarded with the caller's layout.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: forwarded with the caller's layout.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
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

const WARM_UP: u64 = 2_000;
const MEASURED: u64 = 1_000_000;

/// Length of command `seq`: most inline, every third in the entry's slot.
fn command_len(seq: u64) -> usize {
    if seq.is_multiple_of(3) { 200 } else { 16 }
}

/// Checks every message against the command it came from; allocates nothing.
struct Sink {
    next: u64,
    bad: Arc<AtomicU64>,
    got: Arc<AtomicU64>,
}

impl Handler for Sink {
    fn on_message(&mut self, _ctx: &mut Ctx<'_>, _conn: ConnId, data: &[u8], imm: Option<u32>) {
        let seq = self.next;
        if imm != Some(seq as u32) || data.len() != command_len(seq) || !matches(data, seq) {
            self.bad.fetch_add(1, Ordering::Relaxed);
        }
        self.next += 1;
        self.got.store(self.next, Ordering::Release);
    }

    fn on_error(&mut self, _ctx: &mut Ctx<'_>, _conn: ConnId, _error: &Error) {
        self.bad.fetch_add(1 << 32, Ordering::Relaxed);
    }
}

/// Times a submission found the ring full.
static RING_FULL: AtomicU64 = AtomicU64::new(0);

/// Submits command `seq`, spinning (no syscall) while the ring is full.
fn submit(submitter: &mut Submitter, conn: ConnId, seq: u64) {
    let mut full = false;
    loop {
        match submitter.send_with(conn, command_len(seq), Some(seq as u32), |buf| {
            fill(buf, seq)
        }) {
            Ok(()) => break,
            Err(SubmitError::WouldBlock) => {
                full = true;
                std::hint::spin_loop()
            }
            Err(err) => panic!("command {seq}: {err}"),
        }
    }
    if full {
        RING_FULL.fetch_add(1, Ordering::Relaxed);
    }
}

/// A test peer's reactor: Blocking, waking every 50 ms to see its flags.
fn peer_config(payload: usize, depth: u32) -> ReactorConfig {
    ReactorConfig {
        event_mode: EventMode::Blocking,
        idle_timeout: Duration::from_millis(50),
        ..ReactorConfig::for_traffic(payload, depth, 1)
    }
}

/// The peer of the submission tests: a sink checking every command's
/// message on a reactor of its own, in a thread, until `release`.
fn sink_peer(
    addr: std::net::SocketAddr,
    bad: Arc<AtomicU64>,
    got: Arc<AtomicU64>,
    release: Arc<AtomicBool>,
) -> std::thread::JoinHandle<()> {
    stalling_sink_peer(addr, bad, got, release, Arc::new(AtomicBool::new(false)))
}

/// [`sink_peer`] that stops turning its reactor (so it returns no credit)
/// while `stall` is set.
fn stalling_sink_peer(
    addr: std::net::SocketAddr,
    bad: Arc<AtomicU64>,
    got: Arc<AtomicU64>,
    release: Arc<AtomicBool>,
    stall: Arc<AtomicBool>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        let config = peer_config(512, 64);
        let mut reactor: Reactor<Sink> = Reactor::new(&pd, config).unwrap();
        let spec = reactor.qp_spec("rpc");
        let endpoint = ClientSession::connect(addr, &pd, &ClientConfig::new(vec![spec])).unwrap();
        reactor.add(endpoint, Sink { next: 0, bad, got }).unwrap();
        let started = Instant::now();
        while !release.load(Ordering::Acquire) && started.elapsed() < 20 * DEADLINE {
            if stall.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
            reactor.turn().unwrap();
        }
    })
}

/// The first connection the echo factory reports established.
fn established(events: &mpsc::Receiver<Event>) -> ConnId {
    loop {
        match events.recv_timeout(DEADLINE) {
            Ok(Event::Established { conn, .. }) => break conn,
            Ok(Event::Built { .. }) => {}
            Err(err) => panic!("no session: {err}"),
        }
    }
}

verbs_test! {
    fn submitted_commands_arrive_intact_without_allocations_locks_or_syscalls() {
        let _serial = serial();
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        let (tx, events) = mpsc::channel();
        let config = RuntimeConfig {
            reactors: 1,
            cores: CoreChoice::List(vec![0]),
            // Without the peer watch's periodic syscall: the data path
            // makes none of its own.
            reactor: ReactorConfig {
                peer_check_interval: None,
                ..ReactorConfig::for_traffic(512, 64, 1)
            },
            ..RuntimeConfig::default()
        };
        let mut runtime = Runtime::start(&pd, config, echo_factory(tx)).unwrap();
        let addr = runtime.serve("127.0.0.1:0", insecure(runtime.server_config(AccessFlags::empty()))).unwrap();

        // The peer: a sink on a reactor of its own, in a thread.
        let (bad, got) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        // The sink's thread ends (and frees its reactor) only after the window.
        let release = Arc::new(AtomicBool::new(false));
        let total = WARM_UP + MEASURED;
        let sink = sink_peer(addr, Arc::clone(&bad), Arc::clone(&got), Arc::clone(&release));
        let conn = established(&events);
        let mut submitter = runtime.submitter(0).unwrap();
        assert_eq!(submitter.max_payload(), 1024);
        assert_eq!(
            submitter.send(conn, &[0; 2000], None),
            Err(SubmitError::TooLarge { len: 2000, max: 1024 })
        );
        for seq in 0..WARM_UP {
            submit(&mut submitter, conn, seq);
        }
        wait_until("the warm-up", || got.load(Ordering::Acquire) >= WARM_UP);
        // The reactor publishes its statistics now and then: wait until they
        // count the whole warm-up, or the measured count includes part of it.
        wait_until("the warm-up's statistics", || runtime.stats()[0].commands >= WARM_UP);
        let before = runtime.stats()[0].clone();

        let mine = SyscallCounter::open_for(0, None).expect("counting this thread's syscalls");
        let tid = before.thread_id as i32;
        let reactor = SyscallCounter::open_for(tid, Some(c"id != 1")).expect("counting the reactor's");
        reactor.enable().unwrap();
        let reactor_before = reactor.read().unwrap();
        let started = Instant::now();
        let mut timed_out = false;
        let syscalls = mine
            .count(|| {
                MEASURING.store(true, Ordering::SeqCst);
                for seq in WARM_UP..total {
                    submit(&mut submitter, conn, seq);
                }
                // The clock is a syscall on the guest's HPET: read it rarely.
                let mut spins = 0u32;
                while got.load(Ordering::Acquire) < total {
                    spins = spins.wrapping_add(1);
                    if spins.is_multiple_of(1 << 24) && started.elapsed() > 10 * DEADLINE {
                        timed_out = true;
                        break;
                    }
                    std::hint::spin_loop();
                }
                MEASURING.store(false, Ordering::SeqCst);
            })
            .unwrap();
        reactor.disable().unwrap();
        let reactor_syscalls = reactor.read().unwrap() - reactor_before;
        let elapsed = started.elapsed();
        release.store(true, Ordering::Release);
        sink.join().unwrap();
        assert!(!timed_out, "{} of {total} messages arrived", got.load(Ordering::Acquire));
        let full = RING_FULL.load(Ordering::Relaxed);
        println!("the ring of {} commands was found full {full} times", submitter.capacity());
        assert!(full > 0, "the ring never ran full: nothing shows full rings lose nothing");
        assert_eq!(bad.load(Ordering::Relaxed), 0, "every message intact and in order");
        assert_eq!(submitter.rejected(), 0);

        wait_until("the statistics", || runtime.stats()[0].commands >= total);
        let after = runtime.stats()[0].clone();
        let commands = after.commands - before.commands;
        let doorbells = after.counters.doorbells - before.counters.doorbells;
        let allocations = ALLOCATIONS.load(Ordering::Relaxed);
        println!(
            "{MEASURED} submitted SENDs in {elapsed:?}: {allocations} allocations in the process, {syscalls} syscalls on the submitting thread, {reactor_syscalls} on the reactor thread besides doorbells, {doorbells} doorbells ({:.1} commands each)",
            commands as f64 / doorbells.max(1) as f64
        );
        assert_eq!(commands, MEASURED);
        assert_eq!(allocations, 0, "the submission path allocated: {:?}", culprits());
        assert_eq!(syscalls, 0, "the submitting thread entered the kernel (a lock or a wake-up)");
        assert_eq!(reactor_syscalls, 0, "the reactor thread entered the kernel besides its doorbells");
        assert!(doorbells < commands, "commands share doorbells: {doorbells} for {commands}");
        drop(submitter);
        runtime.stop();
        runtime.join().unwrap();
    }
}

/// The runtime's own threads: reactors, listener routers, accept threads.
fn runtime_threads() -> Vec<(i32, String)> {
    let mut threads = Vec::new();
    for task in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let tid: i32 = task.file_name().to_string_lossy().parse().unwrap();
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        let comm = comm.trim().to_string();
        if ["rdma-reactor", "rdma-route", "rdma-accept"]
            .iter()
            .any(|p| comm.starts_with(p))
        {
            threads.push((tid, comm));
        }
    }
    threads.sort();
    threads
}

/// Syscalls (all of them) the given threads make while `idle` runs. A
/// thread that exited before it could be counted (a handshake thread that
/// just finished, say) counts as one syscall, its exit: not idle.
fn syscalls_of(threads: &[(i32, String)], idle: impl FnOnce()) -> Vec<(String, u64)> {
    let counters: Vec<Option<SyscallCounter>> = threads
        .iter()
        .map(|(tid, comm)| match SyscallCounter::open_for(*tid, None) {
            Ok(counter) => Some(counter),
            Err(_)
                if !std::path::Path::new(&format!("/proc/self/task/{tid}")).exists()
                    && !std::path::Path::new(&format!("/proc/{tid}")).exists() =>
            {
                None
            }
            Err(e) => panic!("counting {comm}: {e}"),
        })
        .collect();
    let before: Vec<u64> = counters
        .iter()
        .map(|c| {
            c.as_ref().map_or(0, |c| {
                c.enable().unwrap();
                c.read().unwrap()
            })
        })
        .collect();
    idle();
    threads
        .iter()
        .zip(counters.iter().zip(before))
        .map(|((_, comm), (counter, before))| match counter {
            Some(counter) => {
                counter.disable().unwrap();
                (comm.clone(), counter.read().unwrap() - before)
            }
            None => (format!("{comm} (exited)"), 1),
        })
        .collect()
}

const IDLE: Duration = Duration::from_secs(2);

/// Stops a reactor when dropped.
struct StopOnDrop(Stopper);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.stop();
    }
}

/// Waits until the threads `measure` counts have finished what start-up or a
/// handshake left them doing: until one short window passes without a
/// syscall (at most 10 s, then the measurement that follows fails). Under TCG
/// a loaded guest can take longer than any fixed pause. A thread that wakes
/// on a timer shorter than [`IDLE`] is still caught by that measurement.
fn settle(measure: impl Fn(Duration) -> Vec<(String, u64)>) {
    let start = Instant::now();
    let mut last = Vec::new();
    while start.elapsed() < Duration::from_secs(10) {
        last = measure(Duration::from_millis(300));
        if last.iter().all(|(_, n)| *n == 0) {
            println!("settled after {:?}", start.elapsed());
            return;
        }
    }
    println!("not settled after 10 s: {last:?}");
}

verbs_test! {
    fn an_idle_runtime_makes_no_syscalls_yet_wakes_for_sessions_peers_and_stop() {
        idle_runtime(EventMode::Blocking);
    }
}

verbs_test! {
    fn an_idle_epoll_runtime_makes_no_syscalls_either() {
        idle_runtime(EventMode::Epoll);
    }
}

/// An idle runtime in `mode` makes no syscalls, with or without a peer, and
/// wakes for a peer that leaves, a new session and a stop.
fn idle_runtime(mode: EventMode) {
    let _serial = serial();
    let ctx = open_device();
    let pd = ctx.alloc_pd().unwrap();

    // Before: a plain Blocking reactor with the default idle timeout and
    // a peer watch, as the tools ran one, wakes on its timers. It is
    // stopped only once its counter is closed: a thread that exits while
    // its perf event is being disabled or closed is a kernel path this
    // test has no business racing (under TCG it can leave both vCPUs
    // stuck in the guest kernel).
    let (stopper_tx, stopper_rx) = mpsc::channel();
    let plain = {
        let pd = pd.clone();
        std::thread::Builder::new()
            .name("rdma-reactor-plain".into())
            .spawn(move || {
                let config = ReactorConfig {
                    event_mode: EventMode::Blocking,
                    peer_check_interval: Some(Duration::from_millis(100)),
                    ..ReactorConfig::default()
                };
                let mut reactor: Reactor<Echo> = Reactor::new(&pd, config).unwrap();
                stopper_tx.send(reactor.stopper()).unwrap();
                reactor.run().unwrap();
            })
            .unwrap()
    };
    let Ok(stopper) = stopper_rx.recv() else {
        // It failed before it had a reactor: its panic says why.
        std::panic::resume_unwind(plain.join().unwrap_err());
    };
    // Stopped however this part ends: a plain reactor left running after a
    // failed measurement would be counted as the runtime's by the next test.
    let stopper = StopOnDrop(stopper);
    std::thread::sleep(Duration::from_millis(200));
    let plain_thread: Vec<_> = runtime_threads().into_iter().take(1).collect();
    let old = syscalls_of(&plain_thread, || std::thread::sleep(Duration::from_secs(1)));
    drop(stopper);
    plain.join().unwrap();
    println!(
        "before: a plain Blocking reactor with the default idle timeout, idle for 1 s: {old:?} syscalls"
    );

    let (tx, events) = mpsc::channel();
    let config = RuntimeConfig {
        reactors: 2,
        reactor: ReactorConfig {
            event_mode: mode,
            ..blocking(4)
        },
        ..RuntimeConfig::default()
    };
    let mut runtime = Runtime::start(&pd, config, echo_factory(tx)).unwrap();
    let addr = runtime
        .serve(
            "127.0.0.1:0",
            insecure(runtime.server_config(AccessFlags::empty())),
        )
        .unwrap();
    // Threads name themselves once they run.
    wait_until("the runtime's threads", || runtime_threads().len() == 4);
    let threads = runtime_threads();
    settle(|window| syscalls_of(&threads, || std::thread::sleep(window)));
    let idle = syscalls_of(&threads, || std::thread::sleep(IDLE));
    println!("idle {mode:?} runtime, no peers, {IDLE:?}: {idle:?}");
    assert!(
        idle.iter().all(|(_, n)| *n == 0),
        "an idle runtime made syscalls: {idle:?}"
    );

    // A peer that pings, then stays connected and quiet: long enough for
    // the settling and the measurement below (up to 12 s) in a slow guest,
    // whose goodbye would otherwise wake the reactor inside the window.
    let client = ping_client(addr, "quiet", 20, Duration::from_secs(20));
    wait_until("the pings", || {
        runtime
            .stats()
            .iter()
            .map(|s| s.counters.messages)
            .sum::<u64>()
            >= 20
    });
    settle(|window| syscalls_of(&threads, || std::thread::sleep(window)));
    let with_peer = syscalls_of(&threads, || std::thread::sleep(IDLE));
    println!("idle {mode:?} runtime, one quiet peer, {IDLE:?}: {with_peer:?}");
    assert!(
        with_peer.iter().all(|(_, n)| *n == 0),
        "an idle runtime with a peer made syscalls: {with_peer:?}"
    );

    // The peer leaves: its control connection wakes its reactor.
    assert_eq!(client.join().unwrap(), Ok(20));
    wait_until("the session to be removed", || {
        runtime.stats().iter().all(|s| s.sessions == 0)
    });
    // A new session wakes a sleeping reactor through its queue.
    assert_eq!(
        ping_client(addr, "late", 10, Duration::ZERO)
            .join()
            .unwrap(),
        Ok(10)
    );
    while events.try_recv().is_ok() {}
    // And a stop wakes them all.
    runtime.stop();
    let started = Instant::now();
    runtime.join().unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "join took {:?}",
        started.elapsed()
    );
}

/// A peer that connects, exports an inbox as ping_pong clients do, and says
/// nothing; its reactor runs in a thread until `quit`.
fn quiet_peer(addr: std::net::SocketAddr, quit: Arc<AtomicBool>) -> std::thread::JoinHandle<()> {
    struct Quiet;
    impl Handler for Quiet {
        fn on_message(&mut self, _: &mut Ctx<'_>, _: ConnId, _: &[u8], _: Option<u32>) {}
    }
    std::thread::spawn(move || {
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        let config = peer_config(64, 16);
        let mut reactor: Reactor<Quiet> = Reactor::new(&pd, config).unwrap();
        // Exported through a window: no REMOTE_* rights of its own.
        let inbox = pd
            .alloc_mr(4096, AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND)
            .unwrap();
        let spec = reactor.qp_spec_with_access("ping", AccessFlags::REMOTE_WRITE);
        let config = ClientConfig::new(vec![spec])
            .with_exports(vec![Export::new(
                1,
                "inbox",
                &inbox,
                AccessFlags::REMOTE_WRITE,
            )])
            .with_auth_key(Some(util::test_key()));
        let endpoint = ClientSession::connect(addr, &pd, &config).unwrap();
        let session = reactor.add(endpoint, Quiet).unwrap();
        while !quit.load(Ordering::Acquire) {
            reactor.turn().unwrap();
        }
        let (mut link, _) = reactor.remove(session).unwrap();
        link.close();
    })
}

/// Syscalls every thread of process `pid` makes while `idle` runs.
fn process_syscalls(pid: u32, idle: impl FnOnce()) -> Vec<(String, u64)> {
    let threads: Vec<(i32, String)> = std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .flatten()
        .map(|task| {
            let tid = task.file_name().to_string_lossy().parse().unwrap();
            let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
            (tid, comm.trim().to_string())
        })
        .collect();
    syscalls_of(&threads, idle)
}

verbs_test! {
    fn an_idle_ping_pong_server_in_blocking_mode_makes_no_syscalls() {
        let _serial = serial();
        let (mut server, addr) = util::ping_pong::start_server(&[
            "--event-mode", "blocking", "--reactors", "2", "--peers", "2",
        ]);
        let placement = server.expect_line("runtime: ");
        println!("{placement}");
        settle(|window| process_syscalls(server.pid(), || std::thread::sleep(window)));
        let alone = process_syscalls(server.pid(), || std::thread::sleep(IDLE));
        println!("idle ping_pong server, no peers, {IDLE:?}: {alone:?}");
        assert!(alone.len() >= 4, "main, 2 reactors, router, accept: {alone:?}");
        assert!(alone.iter().all(|(_, n)| *n == 0), "an idle server made syscalls: {alone:?}");

        let quit = Arc::new(AtomicBool::new(false));
        let peer = quiet_peer(addr, Arc::clone(&quit));
        server.expect_line(" connected");
        settle(|window| process_syscalls(server.pid(), || std::thread::sleep(window)));
        let with_peer = process_syscalls(server.pid(), || std::thread::sleep(IDLE));
        println!("idle ping_pong server, one quiet peer, {IDLE:?}: {with_peer:?}");
        assert!(with_peer.iter().all(|(_, n)| *n == 0), "an idle server with a peer made syscalls: {with_peer:?}");

        // The peer's goodbye wakes its reactor; a new client wakes another.
        quit.store(true, Ordering::Release);
        peer.join().unwrap();
        server.expect_line("done: 0 messages verified and echoed");
        let mut client = util::ping_pong::client(addr, 100, 64, "both");
        client.expect_line("100 round trips, 0 mismatches");
        server.expect_line("done: 100 messages verified and echoed");
        let (ok, lines) = server.finish();
        assert!(ok, "{lines:#?}");
        assert!(lines.iter().any(|l| l.starts_with("reactor 1 (core ")), "per-reactor statistics: {lines:#?}");
    }
}

/// The scheduler state of one of this process's threads ('R', 'S', ...).
fn thread_state(tid: u64) -> char {
    let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).unwrap_or_default();
    stat.rsplit_once(") ")
        .and_then(|(_, rest)| rest.chars().next())
        .unwrap_or('?')
}

verbs_test! {
    fn commands_submitted_to_a_sleeping_reactor_wake_it() {
        let _serial = serial();
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        let (tx, events) = mpsc::channel();
        // Blocking: the runtime's reactor sleeps with no timeout.
        let config = RuntimeConfig { reactors: 1, reactor: blocking(1), ..RuntimeConfig::default() };
        let mut runtime = Runtime::start(&pd, config, echo_factory(tx)).unwrap();
        let addr = runtime.serve("127.0.0.1:0", insecure(runtime.server_config(AccessFlags::empty()))).unwrap();
        let (bad, got) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let release = Arc::new(AtomicBool::new(false));
        let stall = Arc::new(AtomicBool::new(false));
        let sink = stalling_sink_peer(addr, Arc::clone(&bad), Arc::clone(&got), Arc::clone(&release), Arc::clone(&stall));
        let conn = established(&events);
        let mut submitter = runtime.submitter(0).unwrap();
        let tid = runtime.stats()[0].thread_id;
        let asleep = || {
            wait_until("the reactor to sleep", || {
                thread_state(tid) == 'S' && {
                    std::thread::sleep(Duration::from_millis(100));
                    thread_state(tid) == 'S'
                }
            })
        };
        let mut seq = 0;
        // One command at a time, each to a reactor asleep in its wait, then
        // bursts of twice the ring (it runs full while the reactor wakes).
        for burst in [1u64, 1, 1, 1, 1, 1, 1, 1, 2 * 1024, 2 * 1024] {
            // Asleep, and still asleep a moment later: in its wait.
            asleep();
            for _ in 0..burst {
                submit(&mut submitter, conn, seq);
                seq += 1;
            }
            wait_until("the commands to arrive", || got.load(Ordering::Acquire) == seq);
        }
        // The peer stops returning credit: the ring's first command cannot
        // be staged and more wait behind it. The reactor still sleeps (a
        // credit update will wake it), and everything arrives once the peer
        // turns again.
        stall.store(true, Ordering::Release);
        for _ in 0..300 {
            submit(&mut submitter, conn, seq);
            seq += 1;
        }
        // One more after the reactor found the first one stuck: news it
        // must not take for work it can do.
        std::thread::sleep(Duration::from_millis(300));
        submit(&mut submitter, conn, seq);
        seq += 1;
        asleep();
        assert!(submitter.queued() > 0, "commands wait behind the stalled connection");
        stall.store(false, Ordering::Release);
        wait_until("the held-back commands to arrive", || got.load(Ordering::Acquire) == seq);
        release.store(true, Ordering::Release);
        sink.join().unwrap();
        assert_eq!(bad.load(Ordering::Relaxed), 0, "every message intact, in order, once");
        assert_eq!(runtime.stats()[0].commands, seq);
        drop(submitter);
        runtime.stop();
        runtime.join().unwrap();
    }
}

/// Tells the test how and when its peer was found gone.
struct Watcher(mpsc::Sender<(Instant, String)>);

impl Handler for Watcher {
    fn on_message(&mut self, _: &mut Ctx<'_>, _: ConnId, _: &[u8], _: Option<u32>) {}

    fn on_peer_gone(&mut self, _: &mut Ctx<'_>, _: SessionId, status: &PeerStatus) {
        let _ = self.0.send((Instant::now(), format!("{status:?}")));
    }
}

verbs_test! {
    fn a_reactor_sleeping_without_a_timer_loses_a_peer_whose_frame_stops_halfway() {
        let _serial = serial();
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        let config = ReactorConfig { event_mode: EventMode::Blocking, ..ReactorConfig::for_traffic(64, 16, 1) }
            .sleeping_until_woken();
        let mut server_side: Reactor<Watcher> = Reactor::new(&pd, config.clone()).unwrap();
        let server = ServerSession::bind("127.0.0.1:0", &pd, insecure(server_side.server_config(AccessFlags::empty()))).unwrap();
        let addr = server.local_addr();
        let client = std::thread::spawn(move || {
            let ctx = open_device();
            let pd = ctx.alloc_pd().unwrap();
            let mut reactor: Reactor<Watcher> = Reactor::new(&pd, config).unwrap();
            let spec = reactor.qp_spec("rpc");
            let endpoint = ClientSession::connect(addr, &pd, &ClientConfig::new(vec![spec])).unwrap();
            (ctx, pd, reactor, endpoint)
        });
        let peer = server.accept().unwrap();
        let (_ctx, _pd, mut reactor, endpoint) = client.join().unwrap();
        let (tx, gone) = mpsc::channel();
        reactor.add(endpoint, Watcher(tx)).unwrap();
        let stopper = reactor.stopper();
        let driver = std::thread::spawn(move || reactor.run().unwrap());
        // The server side writes the first byte of a frame on the control
        // connection and nothing more.
        std::thread::sleep(Duration::from_millis(300));
        use std::io::Write;
        use std::os::fd::AsFd;
        let (_qps, link) = peer.into_parts();
        let mut control = std::net::TcpStream::from(link.as_fd().try_clone_to_owned().unwrap());
        control.write_all(&[1]).unwrap();
        let sent = Instant::now();
        let (at, status) = gone.recv_timeout(DEADLINE).expect("the peer was never found gone");
        let after = at - sent;
        println!("a peer that stopped halfway through a frame was lost after {after:?}: {status}");
        assert!(status.contains("halfway"), "{status}");
        assert!(after >= Duration::from_secs(5) && after < Duration::from_secs(8), "{after:?}");
        stopper.stop();
        driver.join().unwrap();
        drop((control, link, server_side));
    }
}
