//! The runtime on four cores: `tools/test` runs
//! this binary in a guest of its own booted with 4 vCPUs (it fails, rather
//! than skips, on fewer):
//! - 8 clients over 4 reactors: each reactor thread pinned to a distinct
//!   CPU (read back with `sched_getaffinity` and the CPU it last ran on),
//!   sessions placed as the policy says, every message verified;
//! - a client process killed mid-run: its session fails on one reactor
//!   while the sessions on the others keep running to the end;
//! - a runtime stopped with sessions open: every thread joined, every QP
//!   destroyed (the kernel's `rdma resource` table), no descriptor leaked.
//!
//! Gated as in `tests/util/mod.rs`. tools/test: --smp 4

mod util;

use std::collections::{HashMap, HashSet};
use std::sync::mpsc;
use std::time::Duration;

use rdma_comm_core::runtime::*;
use rdma_comm_core::verbs::AccessFlags;
use util::process::Proc;
use util::runtime::*;
use util::*;

/// The vCPUs these tests need.
const CPUS: usize = 4;

/// Fails (never skips) in a guest that is too small.
fn four_cpus() {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    assert!(
        cpus >= CPUS,
        "these tests need {CPUS} CPUs and see {cpus}: tools/test boots their guest with --smp {CPUS}"
    );
}

fn four_reactors(policy: PlacementPolicy, sessions: u32) -> RuntimeConfig {
    RuntimeConfig {
        reactors: CPUS,
        reactor: blocking(sessions),
        policy,
        ..RuntimeConfig::default()
    }
}

/// The CPUs thread `tid` (of this process) may run on.
fn affinity(tid: u64) -> Vec<usize> {
    // SAFETY: an all-zero cpu_set_t is a valid, empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid cpu_set_t of the size passed.
    let rc = unsafe {
        libc::sched_getaffinity(tid as libc::pid_t, size_of::<libc::cpu_set_t>(), &mut set)
    };
    assert_eq!(
        rc,
        0,
        "sched_getaffinity({tid}): {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: CPU_ISSET reads a valid set within CPU_SETSIZE.
    (0..libc::CPU_SETSIZE as usize)
        .filter(|&cpu| unsafe { libc::CPU_ISSET(cpu, &set) })
        .collect()
}

/// The CPU thread `tid` of process `pid` last ran on (`/proc/.../stat`
/// field 39).
fn last_cpu(pid: &str, tid: u64) -> usize {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/stat")).unwrap();
    let (_, rest) = stat.rsplit_once(") ").unwrap();
    // `rest` starts at field 3 (state).
    rest.split_whitespace()
        .nth(39 - 3)
        .unwrap()
        .parse()
        .unwrap()
}

verbs_test! {
    fn eight_clients_over_four_reactors_each_pinned_to_its_own_cpu() {
        four_cpus();
        let _serial = serial();
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        let (tx, events) = mpsc::channel();
        let mut runtime = Runtime::start(&pd, four_reactors(PlacementPolicy::RoundRobin, 8), echo_factory(tx)).unwrap();
        println!("{}", runtime.plan());
        let addr = runtime.serve("127.0.0.1:0", insecure(runtime.server_config(AccessFlags::empty()))).unwrap();
        let clients: Vec<_> = (0..8)
            .map(|i| ping_client(addr, &format!("client-{i}"), 500, Duration::from_millis(500)))
            .collect();

        // Placement: round robin, two sessions per reactor.
        let mut by_reactor: HashMap<usize, usize> = HashMap::new();
        let mut seen = 0;
        while seen < 8 {
            match events.recv_timeout(DEADLINE) {
                Ok(Event::Built { reactor, .. }) => {
                    *by_reactor.entry(reactor).or_default() += 1;
                    seen += 1;
                }
                Ok(_) => {}
                Err(err) => panic!("{seen} of 8 sessions were built: {err}"),
            }
        }
        assert_eq!(by_reactor, (0..CPUS).map(|r| (r, 2)).collect(), "two sessions per reactor");

        // Pinning, read back from the kernel while the sessions run.
        let stats = runtime.stats();
        let mut cpus = HashSet::new();
        for reactor in &stats {
            let core = reactor.core.expect("every reactor is pinned");
            assert_eq!(affinity(reactor.thread_id), vec![core], "{reactor}");
            assert!(cpus.insert(core), "core {core} has two reactors");
        }
        for client in clients {
            assert_eq!(client.join().unwrap(), Ok(500), "every echo verified");
        }
        for reactor in runtime.stats() {
            let core = reactor.core.unwrap();
            assert_eq!(last_cpu("self", reactor.thread_id), core, "{reactor}");
            assert!(reactor.counters.messages >= 2 * 500, "{reactor}");
            println!("{reactor} (affinity {:?})", affinity(reactor.thread_id));
        }
        runtime.stop();
        runtime.join().unwrap();
    }
}

verbs_test! {
    fn a_client_killed_mid_run_fails_its_session_while_the_other_reactors_run_on() {
        four_cpus();
        let _serial = serial();
        let (mut server, addr) = util::ping_pong::start_server(&[
            "--event-mode", "blocking", "--reactors", "4",
        ]);
        server.expect_line("runtime: 4 reactors");
        // The server's reactor threads, pinned to distinct CPUs.
        let pid = server.pid().to_string();
        let reactors: Vec<u64> = std::fs::read_dir(format!("/proc/{pid}/task"))
            .unwrap()
            .flatten()
            .filter(|task| {
                std::fs::read_to_string(task.path().join("comm")).is_ok_and(|c| c.starts_with("rdma-reactor"))
            })
            .map(|task| task.file_name().to_string_lossy().parse().unwrap())
            .collect();
        assert_eq!(reactors.len(), CPUS, "the server's reactor threads");

        // Seven clients that run to the end, and one killed halfway; the
        // fewest-sessions policy puts two on each reactor.
        let iters = 3000;
        let mut clients: Vec<Proc> = (0..7).map(|_| util::ping_pong::client(addr, iters, 256, "send")).collect();
        let mut victim = util::ping_pong::client(addr, 1_000_000, 256, "send");
        server.expect_lines("connected", 8);
        std::thread::sleep(Duration::from_millis(1500));
        victim.child.kill().unwrap();
        victim.child.wait().unwrap();
        let failed = server.expect_line("error");
        println!("server: {failed}");
        for client in clients.drain(..) {
            let (ok, lines) = client.finish();
            assert!(ok, "a client on another reactor failed: {lines:#?}");
            assert!(lines.iter().any(|l| l.contains(&format!("{iters} round trips, 0 mismatches"))), "{lines:#?}");
        }
        server.expect_lines("done:", 7);
        // The server still serves a new peer.
        let (ok, lines) = util::ping_pong::client(addr, 100, 64, "send").finish();
        assert!(ok, "{lines:#?}");
        for tid in reactors {
            let affinity = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/status")).unwrap();
            let allowed = affinity.lines().find(|l| l.starts_with("Cpus_allowed_list")).unwrap().to_string();
            assert!(!allowed.contains([',', '-']), "reactor thread {tid} is pinned to one CPU: {allowed}");
        }
    }
}

/// RC QPs in the kernel's resource table. All of them, not only those with
/// our pid: the kernel names a QP's process by the thread that created it,
/// and drops the name once that thread has ended (a listener's handshake
/// thread, a client thread). The tests of this binary run one at a time.
fn rc_qps() -> usize {
    let out = std::process::Command::new("rdma")
        .args(["-j", "resource", "show", "qp"])
        .output()
        .expect("rdma resource show qp (iproute2)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .matches("\"type\":\"RC\"")
        .count()
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// This process's threads by id, with their names.
fn threads() -> HashMap<String, String> {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .flatten()
        .map(|task| {
            let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
            (
                task.file_name().to_string_lossy().into_owned(),
                comm.trim().to_string(),
            )
        })
        .collect()
}

/// Threads that were not there `before` (a thread of an earlier test may
/// have ended since: only new ones count).
fn new_threads(before: &HashMap<String, String>) -> Vec<String> {
    threads()
        .into_iter()
        .filter(|(tid, _)| !before.contains_key(tid))
        .map(|(tid, comm)| format!("{comm} ({tid})"))
        .collect()
}

verbs_test! {
    fn a_runtime_stopped_with_sessions_open_joins_every_thread_and_frees_every_qp_and_fd() {
        four_cpus();
        let _serial = serial();
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        let (fds, tasks, qps) = (open_fds(), threads(), rc_qps());
        let (tx, events) = mpsc::channel();
        let mut runtime = Runtime::start(&pd, four_reactors(PlacementPolicy::FewestSessions, 8), echo_factory(tx)).unwrap();
        let addr = runtime.serve("127.0.0.1:0", insecure(runtime.server_config(AccessFlags::empty()))).unwrap();
        // Eight clients that stay connected while the runtime stops.
        let clients: Vec<_> = (0..8)
            .map(|i| ping_client(addr, &format!("open-{i}"), 20, Duration::from_secs(3)))
            .collect();
        let mut built = 0;
        while built < 8 {
            if let Event::Built { .. } = events.recv_timeout(DEADLINE).unwrap() {
                built += 1;
            }
        }
        wait_until("every session to be served", || {
            runtime.stats().iter().map(|s| s.sessions).sum::<usize>() == 8
        });
        let during = (open_fds(), threads(), rc_qps());
        println!(
            "before: {fds} fds, {} threads, {qps} QPs; serving 8 sessions: {} fds, {} threads, {} QPs (clients included)",
            tasks.len(), during.0, during.1.len(), during.2
        );
        assert!(during.2 >= qps + 16, "8 sessions' QPs on both sides: {during:?}");
        runtime.stop();
        let stats = runtime.join().unwrap();
        assert!(stats.iter().all(|s| !s.running), "{stats:?}");
        // The clients see the server go and end; their own QPs go with them.
        for client in clients {
            let _ = client.join().unwrap();
        }
        drop(events);
        let started = std::time::Instant::now();
        while !new_threads(&tasks).is_empty() && started.elapsed() < DEADLINE {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(new_threads(&tasks), Vec::<String>::new(), "threads left running");
        assert_eq!(rc_qps(), qps, "every QP destroyed");
        assert_eq!(open_fds(), fds, "no descriptor leaked");
    }
}
