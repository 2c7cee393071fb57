//! Helpers shared by the verbs integration tests.
//!
//! # How these tests are gated
//! Every test that needs an RDMA device is declared with [`verbs_test!`], which
//! marks it `#[ignore]` with the reason. A plain `cargo test` on a host without
//! a NIC therefore lists them as *ignored* (never as passed). `tools/test`, the
//! README's test command, runs them with `--include-ignored` inside the
//! Soft-RoCE guest (`tools/rxe-vm`), where a missing device is a failure.
#![allow(dead_code)]

pub mod datagram;
pub mod ping_pong;
pub mod process;
pub mod reactor;
pub mod runtime;
pub mod syscalls;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use rdma_comm_core::verbs::*;

/// Declares a test that needs an RDMA device (see the module docs).
#[macro_export]
macro_rules! verbs_test {
    ($(#[$meta:meta])* fn $name:ident() $body:block) => {
        #[test]
        #[ignore = "needs an RDMA device: tools/test runs it in the Soft-RoCE guest"]
        $(#[$meta])*
        fn $name() $body
    };
}

/// `config` open to anyone without a key: the tests whose subject is not
/// authentication serve so (each `bind` logs that it is open).
pub fn insecure(
    mut config: rdma_comm_core::session::ServerConfig,
) -> rdma_comm_core::session::ServerConfig {
    config.insecure_open = true;
    config
}

/// How long a test waits for completions before failing.
pub const DEADLINE: Duration = Duration::from_secs(20);

/// Opens `$RDMA_TEST_DEVICE` or the first device with an active port.
#[track_caller]
pub fn open_device() -> Context {
    let wanted = std::env::var("RDMA_TEST_DEVICE").ok();
    Context::open_default(wanted.as_deref()).unwrap_or_else(|err| {
        panic!("verbs tests need an RDMA device ({err}); run them through tools/test, which boots the Soft-RoCE guest")
    })
}

/// Soft-RoCE's RNR counters of `device`'s port 1: (RNR NAKs received by
/// our requesters, RNR NAKs sent by our responders). Device-wide, so a test
/// that compares them runs alone in its binary or only waits for a rise.
pub fn rnr_counters(device: &str) -> (u64, u64) {
    let read = |name: &str| {
        let path = format!("/sys/class/infiniband/{device}/ports/1/hw_counters/{name}");
        std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("{path}: {e}"))
            .trim()
            .parse::<u64>()
            .unwrap()
    };
    (read("rcvd_rnr_err"), read("send_rnr_err"))
}

/// [`rnr_counters`] once they hold still (two reads 200 ms apart agree;
/// for at most 10 s): QPs of a process that ran before (a test binary that
/// provokes RNRs on purpose, a killed peer) may still be retrying, and a
/// test that compares the counters counts only RNRs of its own time.
pub fn quiet_rnr_counters(device: &str) -> (u64, u64) {
    let mut last = rnr_counters(device);
    for _ in 0..50 {
        std::thread::sleep(std::time::Duration::from_millis(200));
        let now = rnr_counters(device);
        if now == last {
            break;
        }
        last = now;
    }
    last
}

/// Two RC QPs on one device, connected to each other, each with its own CQ.
pub struct Pair {
    pub a: QueuePair,
    pub b: QueuePair,
    pub cq_a: CompletionQueue,
    pub cq_b: CompletionQueue,
    pub pd: ProtectionDomain,
    pub ctx: Context,
}

impl Pair {
    /// Connects two QPs built with `config`.
    #[track_caller]
    pub fn new(config: &QpConfig) -> Self {
        Self::on(open_device(), config)
    }

    /// Connects two QPs of `ctx` (a device or [`Context::loopback`]) built
    /// with `config`.
    #[track_caller]
    pub fn on(ctx: Context, config: &QpConfig) -> Self {
        let pd = ctx.alloc_pd().expect("alloc_pd");
        let cq_a = ctx.create_cq(1024, None).expect("create_cq a");
        let cq_b = ctx.create_cq(1024, None).expect("create_cq b");
        let mut a = pd.create_qp(&cq_a, &cq_a, config).expect("create_qp a");
        let mut b = pd.create_qp(&cq_b, &cq_b, config).expect("create_qp b");
        let (ea, eb) = (a.endpoint(), b.endpoint());
        a.connect(&eb).expect("connect a->b");
        b.connect(&ea).expect("connect b->a");
        Pair {
            a,
            b,
            cq_a,
            cq_b,
            pd,
            ctx,
        }
    }

    /// A pair whose QPs accept remote WRITE and READ.
    #[track_caller]
    pub fn with_remote_access() -> Self {
        Self::new(&remote_config())
    }
}

/// A QP config that lets the peer WRITE and READ.
pub fn remote_config() -> QpConfig {
    let mut config = QpConfig::default();
    config.remote_access = AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
    config
}

/// Polls `cq` until `count` completions arrived, failing the test at the deadline.
#[track_caller]
pub fn wait_for(cq: &mut CompletionQueue, count: usize) -> Vec<WorkCompletion> {
    let start = Instant::now();
    let mut got = Vec::with_capacity(count);
    let mut buf = [WorkCompletion::default(); 32];
    while got.len() < count {
        let room = (count - got.len()).min(buf.len());
        got.extend_from_slice(cq.poll(&mut buf[..room]).expect("poll_cq"));
        assert!(
            start.elapsed() < DEADLINE,
            "timed out after {DEADLINE:?} with {} of {count} completions: {got:?}",
            got.len()
        );
    }
    got
}

/// Like [`wait_for`] with `count == 1`, asserting success.
#[track_caller]
pub fn wait_ok(cq: &mut CompletionQueue) -> WorkCompletion {
    let wc = wait_for(cq, 1)[0];
    wc.ok()
        .unwrap_or_else(|err| panic!("completion failed: {err}"));
    wc
}

/// Deterministic test bytes: distinct per seed and position.
pub fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(31).wrapping_add(seed as u32 * 7) as u8 ^ (i >> 8) as u8)
        .collect()
}

/// Reads `len` bytes at `offset` out of `mr`.
pub fn read_back(mr: &MemoryRegion, offset: usize, len: usize) -> Vec<u8> {
    let mut out = vec![0; len];
    mr.read(offset, &mut out).expect("read region");
    out
}

/// The path of example `name`, built next to the test binaries (integration
/// tests live in target/<profile>/deps, examples one level up).
#[track_caller]
pub fn example_binary(name: &str) -> PathBuf {
    let path = profile_dir().join("examples").join(name);
    assert!(
        path.exists(),
        "{} is missing: build the examples first (tools/test does)",
        path.display()
    );
    path
}

/// The key every tool a test starts is given, through
/// [`AUTH_KEY_ENV`](rdma_comm_core::session::AUTH_KEY_ENV): the tools
/// refuse to run without one (or `--insecure`).
pub const TEST_KEY: &str = "a key for the tools the tests start, 32+ bytes";

/// [`TEST_KEY`] as a key, for an in-process client of a tool the test started.
pub fn test_key() -> rdma_comm_core::session::AuthKey {
    rdma_comm_core::session::AuthKey::new(TEST_KEY.as_bytes()).expect("TEST_KEY is long enough")
}

/// A command for `program` with [`TEST_KEY`] in its environment.
pub fn keyed(program: impl AsRef<std::ffi::OsStr>) -> std::process::Command {
    let mut command = std::process::Command::new(program);
    command.env(rdma_comm_core::session::AUTH_KEY_ENV, TEST_KEY);
    command
}

/// Runs `program` with `args` and no key in its environment, and checks it
/// refuses to start, naming both ways out (a key file, or `--insecure`).
#[track_caller]
pub fn assert_refused_without_a_key(program: PathBuf, args: &[&str]) {
    let out = std::process::Command::new(program)
        .args(args)
        .env_remove(rdma_comm_core::session::AUTH_KEY_ENV)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        text.contains("--auth-key-file") && text.contains("--insecure"),
        "{text}"
    );
}

/// The path of binary `name` of a workspace member (`mesh` from tools/mesh),
/// which cargo puts in target/<profile> itself.
#[track_caller]
pub fn workspace_binary(name: &str) -> PathBuf {
    let path = profile_dir().join(name);
    assert!(
        path.exists(),
        "{} is missing: build the workspace's binaries first (tools/test does)",
        path.display()
    );
    path
}

/// target/<profile>: the parent of the deps directory this test runs from.
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().to_path_buf()
}

/// A TCP port that was free a moment ago (see [`free_ports`]).
pub fn free_port() -> u16 {
    free_ports(1)
}

/// The first of `count` (1 to [`PORT_BLOCK`]) consecutive TCP ports that
/// were free a moment ago.
///
/// The ports lie outside the kernel's ephemeral range, in blocks of
/// [`PORT_BLOCK`], and each call of this process gets a block no earlier
/// call got, whatever the counts. A port from `bind(":0")`, or a
/// neighbour of one, is an ephemeral port: a connection that a test
/// running alongside makes can take it between this check and the
/// server's bind, and the server then fails with `EADDRINUSE`.
pub fn free_ports(count: u16) -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    // Blocks handed out by this process, counted from its own start.
    static HANDED_OUT: AtomicU32 = AtomicU32::new(0);
    assert!(
        (1..=PORT_BLOCK).contains(&count),
        "free_ports hands out 1 to {PORT_BLOCK} ports, not {count}"
    );
    let (floor, ceiling) = ports_outside_the_ephemeral_range();
    let blocks = (ceiling - floor) / u32::from(PORT_BLOCK);
    assert!(
        blocks > 0,
        "no block of {PORT_BLOCK} ports in {floor}..{ceiling}"
    );
    // Test binaries run one after another, but a pid-derived start keeps
    // two that overlap from walking the same blocks.
    let start = std::process::id().wrapping_mul(7_919) % blocks;
    for _ in 0..blocks {
        let taken = HANDED_OUT.fetch_add(1, Ordering::Relaxed);
        let base = floor + (start.wrapping_add(taken) % blocks) * u32::from(PORT_BLOCK);
        // Every port at once, on the wildcard address the tools bind.
        let all_free: Result<Vec<_>, _> = (base..base + u32::from(count))
            .map(|port| std::net::TcpListener::bind(("0.0.0.0", port as u16)))
            .collect();
        if all_free.is_ok() {
            return base as u16;
        }
    }
    panic!("no {count} consecutive free TCP ports in {floor}..{ceiling}");
}

/// The most ports one [`free_ports`] call hands out.
pub const PORT_BLOCK: u16 = 8;

/// The larger run of ports, `floor..ceiling`, that the kernel's ephemeral
/// range (`ip_local_port_range`, 32768–60999 unless tuned) leaves: below
/// it from 10000 (clear of the well-known and usual service ports), or
/// above it.
fn ports_outside_the_ephemeral_range() -> (u32, u32) {
    const FLOOR: u32 = 10_000;
    let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok();
    let mut bounds = range
        .iter()
        .flat_map(|range| range.split_whitespace())
        .map(|bound| bound.parse::<u32>().ok());
    let (low, high) = match (bounds.next().flatten(), bounds.next().flatten()) {
        (Some(low), Some(high)) if low <= high && high < 65_536 => (low, high),
        _ => (32_768, 60_999),
    };
    let below = (FLOOR, low.max(FLOOR));
    let above = (high + 1, 65_536);
    if below.1 - below.0 >= above.1 - above.0 {
        below
    } else {
        above
    }
}

/// One SEND from `from` to `to` on channel 0, verified.
#[track_caller]
pub fn exchange(
    pd: &ProtectionDomain,
    from: &mut rdma_comm_core::session::Endpoint,
    to: &mut rdma_comm_core::session::Endpoint,
    payload: &[u8],
) {
    let rx = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    let mut tx = pd.alloc_mr(4096, AccessFlags::empty()).unwrap();
    tx.write(0, payload).unwrap();
    let receiver = to.qp_at(0).unwrap();
    receiver
        .qp_mut()
        .post_recv(&mut RecvRequest::new(1, rx.slice(0, 4096).unwrap()).unwrap())
        .unwrap();
    let sender = from.qp_at(0).unwrap();
    sender
        .qp_mut()
        .post_send(&mut WorkRequest::send(2, tx.slice(0, payload.len()).unwrap()).signaled())
        .unwrap();
    wait_ok(sender.cq_mut().unwrap());
    let wc = wait_ok(to.qp_at(0).unwrap().cq_mut().unwrap());
    assert_eq!(wc.byte_len() as usize, payload.len());
    assert_eq!(read_back(&rx, 0, payload.len()), payload);
}

/// What a reactor ignored: (foreign completions, reclaimed SRQ receives).
pub fn ignored<H: rdma_comm_core::reactor::Handler, L: rdma_comm_core::reactor::PeerLink>(
    reactor: &rdma_comm_core::reactor::Reactor<H, L>,
) -> (u64, u64) {
    let counters = reactor.counters();
    (counters.foreign_completions, counters.reclaimed_receives)
}
