//! `examples/lat_bw` (and `examples/verbs_perf`, the same tests on the verbs
//! layer alone) end to end, server and client as separate processes: every
//! operation in latency and bandwidth mode finishes on both sides and prints
//! a perftest-format data row with sane figures.
//! Gated as described in `tests/util/mod.rs`: runs in the Soft-RoCE guest.

mod util;

use std::process::{Child, Output, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use util::process::Proc;
use util::*;

/// Debug builds of both sides share two emulated cores.
const DEADLINE: Duration = Duration::from_secs(120);

fn spawn(example: &str, args: &[&str]) -> Child {
    keyed(example_binary(example))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|err| panic!("spawn {example}: {err}"))
}

fn lat_bw(args: &[&str]) -> Child {
    spawn("lat_bw", args)
}

/// Waits for a client and its server until the deadline. If either is still
/// running then, kills both and fails with what each printed and how each
/// ended: a hung server is most often explained by its client's error.
fn finish_pair(mut client: Child, mut server: Child, started: Instant) -> (Output, Output) {
    loop {
        let client_done = client.try_wait().expect("wait for the client").is_some();
        let server_done = server.try_wait().expect("wait for the server").is_some();
        if client_done && server_done {
            break;
        }
        if started.elapsed() > DEADLINE {
            let (hung, pid) = match client_done {
                true => ("the server", server.id()),
                false => ("the client", client.id()),
            };
            let stuck = process::where_stuck(pid);
            let _ = client.kill();
            let _ = server.kill();
            let client = client.wait_with_output().expect("collect the client");
            let server = server.wait_with_output().expect("collect the server");
            panic!(
                "{hung} hung after {:?}, here:\n{stuck}\nclient ({}): stderr: {}\nstdout: {}\nserver ({}): stderr: {}",
                started.elapsed(),
                client.status,
                String::from_utf8_lossy(&client.stderr),
                String::from_utf8_lossy(&client.stdout),
                server.status,
                String::from_utf8_lossy(&server.stderr),
            );
        }
        thread::sleep(Duration::from_millis(50));
    }
    (
        client.wait_with_output().expect("collect the client"),
        server.wait_with_output().expect("collect the server"),
    )
}

/// The numbers of the data row after perftest's `#bytes` header.
fn data_row(stdout: &str) -> Vec<f64> {
    let mut lines = stdout.lines().skip_while(|line| !line.contains("#bytes"));
    let header = lines.next().expect("a perftest header line");
    let row = lines
        .next()
        .unwrap_or_else(|| panic!("no data row after {header:?}"));
    row.split_whitespace()
        .map(|field| {
            field
                .parse()
                .unwrap_or_else(|_| panic!("{field:?} in {row:?}"))
        })
        .collect()
}

/// Runs one server/client pair of `example`; returns the client's data row.
fn run(example: &str, op: &str, test: &str, size: usize, iters: usize) -> Vec<f64> {
    let listen = format!("127.0.0.1:{}", free_port());
    run_example(example, &listen, &[], op, test, size, iters).0
}

/// Runs one server/client pair of `example` on `listen` with `extra` flags
/// on both; returns the client's data row and its whole output.
fn run_example(
    example: &str,
    listen: &str,
    extra: &[&str],
    op: &str,
    test: &str,
    size: usize,
    iters: usize,
) -> (Vec<f64>, String) {
    let started = Instant::now();
    let (size, iters) = (size.to_string(), iters.to_string());
    let mut common = vec!["--op", op, "--test", test, "-s", &size, "-n", &iters];
    common.extend(extra);
    let mut server_args = vec!["--server", "--listen", listen];
    server_args.extend(&common);
    let server = spawn(example, &server_args);
    let mut client_args = vec!["--connect", listen];
    client_args.extend(&common);
    let client = spawn(example, &client_args);
    let (client, server) = finish_pair(client, server, started);
    let stdout = String::from_utf8_lossy(&client.stdout);
    assert!(
        client.status.success(),
        "{op} {test}: client failed: {}\n{stdout}",
        String::from_utf8_lossy(&client.stderr)
    );
    assert!(
        server.status.success(),
        "{op} {test}: server failed: {}",
        String::from_utf8_lossy(&server.stderr)
    );
    let row = data_row(&stdout);
    assert_eq!(row[0] as usize, size.parse::<usize>().unwrap(), "{stdout}");
    assert_eq!(row[1] as usize, iters.parse::<usize>().unwrap(), "{stdout}");
    (row, stdout.into_owned())
}

fn latency(example: &str, op: &str) {
    // #bytes #iterations t_min t_max t_typical t_avg t_stdev p99 p99.9
    let row = run(example, op, "lat", 8, 300);
    assert_eq!(row.len(), 9, "{row:?}");
    let (min, max, typical) = (row[2], row[3], row[4]);
    assert!(min > 0.0 && min <= typical && typical <= max, "{row:?}");
}

fn bandwidth(example: &str, op: &str) {
    // #bytes #iterations BW_peak BW_average MsgRate
    let row = run(example, op, "bw", 64, 3000);
    assert_eq!(row.len(), 5, "{row:?}");
    let (peak, average, rate) = (row[2], row[3], row[4]);
    assert!(peak > 0.0 && average > 0.0 && rate > 0.0, "{row:?}");
}

verbs_test! {
    /// From 1 MiB a bandwidth client sleeps between completions (it has
    /// nothing else to do, and does not spin on a core a software device's
    /// work needs): every kind of request still moves every message.
    fn a_bandwidth_client_of_large_messages_sleeps_and_moves_them_all() {
        for op in ["read", "write", "send"] {
            let listen = format!("127.0.0.1:{}", free_port());
            let (row, stdout) = run_example("lat_bw", &listen, &[], op, "bw", 1 << 20, 24);
            assert!(stdout.contains("Event mode: Blocking"), "{op}: {stdout}");
            let (average, rate) = (row[3], row[4]);
            assert!(average > 0.0 && rate > 0.0, "{op}: {row:?}");
        }
        // Below that size, or when asked, it polls.
        for (extra, size) in [(&[][..], 512 << 10), (&["--event-mode", "busy"][..], 1 << 20)] {
            let listen = format!("127.0.0.1:{}", free_port());
            let (_, stdout) = run_example("lat_bw", &listen, extra, "read", "bw", size, 8);
            assert!(stdout.contains("Event mode: Busy"), "{size} B {extra:?}: {stdout}");
        }
    }
}

verbs_test! {
    fn send_latency_and_bandwidth() {
        latency("lat_bw", "send");
        bandwidth("lat_bw", "send");
    }
}

verbs_test! {
    fn write_latency_and_bandwidth() {
        latency("lat_bw", "write");
        bandwidth("lat_bw", "write");
    }
}

verbs_test! {
    fn write_with_imm_latency_and_bandwidth() {
        latency("lat_bw", "write-imm");
        bandwidth("lat_bw", "write-imm");
    }
}

verbs_test! {
    fn read_latency_and_bandwidth() {
        latency("lat_bw", "read");
        bandwidth("lat_bw", "read");
    }
}

verbs_test! {
    fn two_reactors_run_two_streams_and_report_their_sum() {
        let started = Instant::now();
        let listen = format!("127.0.0.1:{}", free_port());
        let common = ["--op", "write", "--test", "bw", "-s", "64", "-n", "2000", "--reactors", "2"];
        let mut server_args = vec!["--server", "--listen", &listen];
        server_args.extend(common);
        let server = lat_bw(&server_args);
        let mut client_args = vec!["--connect", &listen];
        client_args.extend(common);
        let (client, server) = finish_pair(lat_bw(&client_args), server, started);
        let (stdout, stderr) = (String::from_utf8_lossy(&client.stdout), String::from_utf8_lossy(&client.stderr));
        assert!(client.status.success() && server.status.success(), "{stdout}\n{stderr}");
        assert!(stderr.contains("lat_bw: 2 streams, 2 reactors on cores "), "{stderr}");
        let numbers = |prefix: &str| -> Vec<f64> {
            let line = stdout
                .lines()
                .find(|line| line.starts_with(prefix))
                .unwrap_or_else(|| panic!("no {prefix:?} row in {stdout}"));
            line[prefix.len()..].split_whitespace().map(|f| f.parse().unwrap()).collect()
        };
        let (a, b, all) = (numbers("stream 0: "), numbers("stream 1: "), numbers("all 2 streams: "));
        assert_eq!((a.len(), b.len(), all.len()), (5, 5, 5), "{stdout}");
        assert_eq!(all[1], a[1] + b[1], "iterations add up: {stdout}");
        assert!((all[3] - (a[3] + b[3])).abs() < 0.01 * all[3] + 0.01, "average bandwidth adds up: {stdout}");
    }
}

verbs_test! {
    fn every_op_runs_over_rdma_cm() {
        // rxe0's address: the connection manager resolves it to the device.
        for (port, op) in [(7700, "send"), (7701, "write"), (7702, "write-imm"), (7703, "read")] {
            let listen = format!("10.77.0.1:{port}");
            let (row, _) = run_example("lat_bw", &listen, &["--cm"], op, "lat", 8, 200);
            assert_eq!(row.len(), 9, "{op}: {row:?}");
            let (row, _) = run_example("lat_bw", &listen, &["--cm"], op, "bw", 64, 2000);
            assert!(row[3] > 0.0, "{op}: {row:?}");
            println!("{op} over rdma_cm: bandwidth row {row:?}");
        }
    }
}

verbs_test! {
    /// `--repost-batch 1` on both sides (every consumed receive reposted by
    /// the pass that consumed it): SEND latency and bandwidth still move
    /// every message. A batch outside 1..=64 is refused before anything is
    /// opened, naming the flag.
    fn lat_bw_reposts_receives_one_at_a_time_when_asked() {
        let extra = ["--repost-batch", "1"];
        let listen = format!("127.0.0.1:{}", free_port());
        let (row, _) = run_example("lat_bw", &listen, &extra, "send", "lat", 8, 300);
        assert!(row[2] > 0.0 && row[2] <= row[4], "{row:?}");
        let listen = format!("127.0.0.1:{}", free_port());
        let (row, _) = run_example("lat_bw", &listen, &extra, "send", "bw", 64, 3000);
        assert!(row[3] > 0.0 && row[4] > 0.0, "{row:?}");
        for bad in ["0", "65"] {
            let out = lat_bw(&["--connect", "127.0.0.1:9", "--repost-batch", bad])
                .wait_with_output()
                .expect("collect lat_bw");
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "--repost-batch {bad}: {stderr}");
            assert!(stderr.contains("--repost-batch"), "{stderr}");
        }
    }
}

/// SEND, WRITE and READ latency of `lat_bw` with `flags` on both sides, 8 B
/// and 300 iterations each: a full row whose min, typical and max are in
/// order.
fn every_latency_row_is_sane(flags: &[&str]) {
    for op in ["send", "write", "read"] {
        let listen = format!("127.0.0.1:{}", free_port());
        let (row, _) = run_example("lat_bw", &listen, flags, op, "lat", 8, 300);
        assert_eq!(row.len(), 9, "{flags:?} {op}: {row:?}");
        let (min, max, typical) = (row[2], row[3], row[4]);
        assert!(
            min > 0.0 && min <= typical && typical <= max,
            "{flags:?} {op}: {row:?}"
        );
    }
}

verbs_test! {
    /// On direct connections (`--direct`, both sides): every latency test
    /// finishes with a sane row, rates move every message (a batch of 16,
    /// and a run that is not a whole number of batches), larger messages
    /// than the inline limit go too, and what direct connections do not
    /// measure is refused with a reason.
    fn lat_bw_direct_runs_every_test() {
        let direct = ["--direct"];
        every_latency_row_is_sane(&direct);
        for (op, size, iters) in [("send", 64, 3000), ("write", 64, 3000), ("write", 4096, 1001), ("send", 4096, 333)] {
            let listen = format!("127.0.0.1:{}", free_port());
            let (row, _) = run_example("lat_bw", &listen, &direct, op, "bw", size, iters);
            assert!(row[2] > 0.0 && row[3] > 0.0 && row[4] > 0.0, "{op} {size}: {row:?}");
        }
        let listen = format!("127.0.0.1:{}", free_port());
        let (row, _) = run_example("lat_bw", &listen, &direct, "send", "lat", 4096, 100);
        assert!(row[2] > 0.0, "{row:?}");
        let out = lat_bw(&["--connect", "127.0.0.1:9", "--direct", "--op", "write-imm"])
            .wait_with_output()
            .expect("collect lat_bw");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && stderr.contains("--direct"), "{stderr}");
    }
}

verbs_test! {
    /// Spinning on direct connections (`--direct --spin`, both sides, each
    /// its own process): every latency test finishes with a sane row, and
    /// a bandwidth test or a spin without `--direct` is refused.
    fn lat_bw_spin_runs_every_latency_test() {
        every_latency_row_is_sane(&["--direct", "--spin"]);
        for refused in [&["--direct", "--spin", "--test", "bw"][..], &["--spin"][..]] {
            let mut args = vec!["--connect", "127.0.0.1:9"];
            args.extend_from_slice(refused);
            let out = lat_bw(&args).wait_with_output().expect("collect lat_bw");
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success() && stderr.contains("--"), "{refused:?}: {stderr}");
        }
    }
}

verbs_test! {
    /// The same tests on the verbs layer alone: every one finishes on both
    /// sides with a sane row (READ has a latency test only).
    fn verbs_perf_runs_every_test() {
        for op in ["send", "write", "read"] {
            latency("verbs_perf", op);
        }
        for op in ["send", "write"] {
            bandwidth("verbs_perf", op);
        }
        // Messages larger than the inline limit, and a doorbell per message.
        let listen = format!("127.0.0.1:{}", free_port());
        let extra = ["--batch", "1", "--signal", "1"];
        let (row, _) = run_example("verbs_perf", &listen, &extra, "send", "bw", 4096, 500);
        assert!(row[3] > 0.0, "{row:?}");
    }
}

/// Write syscalls `pid` made so far (`/proc/PID/io`): with Soft-RoCE each
/// doorbell is one.
fn write_syscalls(pid: u32) -> u64 {
    let io = std::fs::read_to_string(format!("/proc/{pid}/io")).unwrap_or_default();
    io.lines()
        .find_map(|line| line.strip_prefix("syscw: "))
        .and_then(|count| count.trim().parse().ok())
        .unwrap_or(0)
}

verbs_test! {
    /// A verbs_perf client whose server dies mid-run fails with the failed
    /// completion's error, naming the peer, as the tools' other failures do.
    fn verbs_perf_names_the_peer_of_a_failed_completion() {
        let listen = format!("127.0.0.1:{}", free_port());
        // Ten million READs: minutes under TCG, where the kill comes after
        // seconds (and 80 MB of samples reserved).
        let mut server = Proc::spawn("verbs_perf", &["--server", "--listen", &listen, "--op", "read", "-s", "8", "-n", "10000000"]);
        let mut command = keyed(example_binary("verbs_perf"));
        // rxe retries for ever at the default retry count (7).
        command.args(["--connect", &listen, "--op", "read", "-s", "8", "-n", "10000000", "--retry-cnt", "2"]);
        let mut client = Proc::spawn_reading_both(command);
        // In the READ loop once its doorbells run in the thousands (the
        // handshake rings a few).
        let pid = client.pid();
        client.wait_until("the client's READ loop", || write_syscalls(pid) > 5_000);
        server.kill();
        let (status, _, stderr) = client.finish_with_stderr();
        assert!(!status.success(), "{stderr:?}");
        assert!(
            stderr.iter().any(|line| line.contains("failed: IBV_WC_") && line.contains(&listen)),
            "a failed completion that names {listen}: {stderr:?}"
        );
        drop(server);
    }
}

verbs_test! {
    /// Two sides asked for different tests refuse each other before any
    /// traffic, and say why.
    fn verbs_perf_sides_running_different_tests_refuse_each_other() {
        let started = Instant::now();
        let listen = format!("127.0.0.1:{}", free_port());
        let server = spawn("verbs_perf", &["--server", "--listen", &listen, "--op", "read", "-s", "8"]);
        let client = spawn("verbs_perf", &["--connect", &listen, "--op", "write", "-s", "8"]);
        let (client, server) = finish_pair(client, server, started);
        for (side, output) in [("client", client), ("server", server)] {
            let stderr = String::from_utf8_lossy(&output.stderr);
            assert!(!output.status.success(), "{side} accepted another test: {stderr}");
            assert!(stderr.contains("the peer runs another test"), "{side}: {stderr}");
        }
    }
}
