//! The tools refuse a bad argument before they open a device: exit status
//! 2 and one line on stderr that names the argument and what it accepts.
//!
//! Every tool is started with `-d` naming a device that does not exist
//! (where it takes one): had it opened a device, it would have failed
//! with status 1 and an error naming that device, which
//! [`a_tool_given_good_arguments_fails_on_the_missing_device`] shows it
//! does. So these tests need no device and run on the host in every
//! `cargo test`, which builds the examples before it runs any test (and
//! `util::example_binary` fails, never skips, when one is missing).

mod util;

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

use util::{example_binary, keyed};

/// A device name no machine has: opening it would fail naming it.
const NO_DEVICE: &str = "no-such-rdma-device";

/// Runs `example` with `args`, the test key in its environment and stdin
/// closed; its output.
fn run(example: &str, args: &[&str]) -> Output {
    run_command(keyed(example_binary(example)), args)
}

fn run_command(mut command: Command, args: &[&str]) -> Output {
    command
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|err| panic!("running {command:?}: {err}"))
}

/// Asserts `example args` was refused as the tool refuses arguments:
/// status 2, one line on stderr starting `example: flag` and containing
/// `accepts`, and no sign of a device having been opened.
#[track_caller]
fn assert_refused(example: &str, args: &[&str], flag: &str, accepts: &str) {
    let mut with_device = args.to_vec();
    with_device.extend(["-d", NO_DEVICE]);
    assert_refused_output(
        &run(example, &with_device),
        example,
        &with_device,
        flag,
        accepts,
    );
}

#[track_caller]
fn assert_refused_output(out: &Output, example: &str, args: &[&str], flag: &str, accepts: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    let what = format!(
        "{example} {}: {:?}, stderr: {stderr:?}",
        args.join(" "),
        out.status
    );
    assert_eq!(out.status.code(), Some(2), "{what}");
    assert_eq!(stderr.lines().count(), 1, "one line: {what}");
    assert!(
        stderr.starts_with(&format!("{example}: {flag}")),
        "names {flag}: {what}"
    );
    assert!(stderr.contains(accepts), "says {accepts:?}: {what}");
    assert!(
        !stderr.contains(NO_DEVICE) && !stderr.contains("RDMA device"),
        "a device was opened: {what}"
    );
    assert!(out.stdout.is_empty(), "printed before refusing: {what}");
}

/// A file of `len` key bytes, mode 600, named for this test process.
fn key_file(name: &str, len: usize) -> PathBuf {
    let path = std::env::temp_dir().join(format!("tool-args-{}-{name}", std::process::id()));
    std::fs::write(&path, vec![b'k'; len]).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    path
}

#[test]
fn a_tool_given_good_arguments_fails_on_the_missing_device() {
    let out = run("ping_pong", &["--connect", "127.0.0.1:9", "-d", NO_DEVICE]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains(NO_DEVICE), "{stderr}");
}

#[test]
fn ping_pong_refuses_an_address_that_does_not_resolve() {
    assert_refused(
        "ping_pong",
        &["--connect", "nohost"],
        "--connect nohost",
        "must be HOST:PORT",
    );
    assert_refused(
        "ping_pong",
        &["--connect", "nohost.invalid:7471"],
        "--connect nohost.invalid:7471",
        "must be HOST:PORT",
    );
    assert_refused(
        "ping_pong",
        &["--server", "--listen", "notaport"],
        "--listen notaport",
        "must be HOST:PORT",
    );
}

#[test]
fn ping_pong_refuses_sizes_and_windows_out_of_range() {
    let connect = ["--connect", "127.0.0.1:9"];
    for size in ["0", "16777217"] {
        assert_refused(
            "ping_pong",
            &[&connect[..], &["--size", size]].concat(),
            &format!("--size {size}"),
            "must be 1 to 16777216",
        );
    }
    assert_refused(
        "ping_pong",
        &["--server", "--max-size", "0"],
        "--max-size 0",
        "must be 1 to 16777216",
    );
    for batch in ["0", "65"] {
        assert_refused(
            "ping_pong",
            &[&connect[..], &["--batch", batch]].concat(),
            &format!("--batch {batch}"),
            "must be 1 to 64",
        );
    }
}

#[test]
fn ping_pong_names_a_key_file_it_cannot_read_or_that_is_too_short() {
    let connect = ["--connect", "127.0.0.1:9"];
    let missing = std::env::temp_dir().join("tool-args-no-such-key");
    let missing = missing.to_str().unwrap();
    assert_refused(
        "ping_pong",
        &[&connect[..], &["--auth-key-file", missing]].concat(),
        &format!("--auth-key-file {missing}"),
        "at least 32 bytes",
    );
    let short = key_file("short", 20);
    let short_path = short.to_str().unwrap();
    assert_refused(
        "ping_pong",
        &[&connect[..], &["--auth-key-file", short_path]].concat(),
        &format!("--auth-key-file {short_path}"),
        "at least 32 bytes",
    );
    let long_enough = key_file("long-enough", 32);
    let out = run(
        "ping_pong",
        &[
            &connect[..],
            &[
                "--auth-key-file",
                long_enough.to_str().unwrap(),
                "-d",
                NO_DEVICE,
            ],
        ]
        .concat(),
    );
    assert_eq!(
        out.status.code(),
        Some(1),
        "a 32-byte key is taken: {out:?}"
    );
    for path in [short, long_enough] {
        let _ = std::fs::remove_file(path);
    }
}

#[test]
fn a_short_or_missing_key_in_the_environment_is_named() {
    let mut short = Command::new(example_binary("ping_pong"));
    short.env(
        rdma_comm_core::session::AUTH_KEY_ENV,
        "twenty bytes of key.",
    );
    let args = ["--connect", "127.0.0.1:9", "-d", NO_DEVICE];
    assert_refused_output(
        &run_command(short, &args),
        "ping_pong",
        &args,
        "RDMA_COMM_AUTH_KEY",
        "at least 32 bytes",
    );
    let mut none = Command::new(example_binary("rdma_cat"));
    none.env_remove(rdma_comm_core::session::AUTH_KEY_ENV);
    let args = ["recv", "--listen", "7480", "-d", NO_DEVICE];
    assert_refused_output(
        &run_command(none, &args),
        "rdma_cat",
        &args,
        "--auth-key-file",
        "--insecure",
    );
}

#[test]
fn lat_bw_refuses_sizes_and_latency_runs_it_cannot_hold() {
    let connect = ["--connect", "127.0.0.1:9"];
    for size in ["0", "8388609"] {
        assert_refused(
            "lat_bw",
            &[&connect[..], &["-s", size]].concat(),
            &format!("--size {size}"),
            "must be 1 to 8388608",
        );
    }
    assert_refused(
        "lat_bw",
        &[&connect[..], &["-n", "0"]].concat(),
        "--iters 0",
        "must be at least 1",
    );
    assert_refused(
        "lat_bw",
        &[&connect[..], &["-n", "1000000000"]].concat(),
        "--iters 1000000000",
        "must be at most 33554432",
    );
    assert_refused(
        "lat_bw",
        &[&connect[..], &["--direct", "--op", "write-imm"]].concat(),
        "--direct",
        "one stream",
    );
    for other in [
        &["--op", "write"][..],
        &["--op", "send", "--direct"],
        &["--op", "send", "--reactors", "2"],
        &["--op", "send", "-a"],
    ] {
        assert_refused(
            "lat_bw",
            &[&connect[..], &["--transport", "ud"], other].concat(),
            "--transport",
            "ud measures SEND on one stream",
        );
    }
}

#[test]
fn rdma_cat_refuses_a_listen_address_and_depths_out_of_range() {
    assert_refused(
        "rdma_cat",
        &["recv", "--listen", "notaport"],
        "--listen notaport",
        "must be PORT or ADDR:PORT",
    );
    for depth in ["3", "4097"] {
        assert_refused(
            "rdma_cat",
            &["recv", "--listen", "7480", "--depth", depth],
            &format!("--depth {depth}"),
            "must be 4 to 4096",
        );
    }
    assert_refused(
        "rdma_cat",
        &["send", "127.0.0.1:7480", "--block-size", "0"],
        "--block-size 0",
        "must be 1 to 16777216",
    );
}

#[test]
fn demo_refuses_a_core_listed_twice_and_windows_out_of_range() {
    assert_refused("demo", &["--cores", "0,0"], "--cores 0,0", "listed twice");
    for window in ["0", "65"] {
        assert_refused(
            "demo",
            &["--window", window],
            &format!("--window {window}"),
            "must be 1 to 64",
        );
    }
    assert_refused(
        "demo",
        &["--seconds", "0"],
        "--seconds 0",
        "must be 1 to 86400",
    );
}

#[test]
fn rpings_server_runs_only_when_told_it_serves_anyone() {
    // rping's protocol has no authentication: `-s` alone is refused.
    // (rping's -d is its debug flag: it takes no device, and opens the
    // one its address routes to only after this check.)
    let args = ["-s", "-a", "127.0.0.1"];
    assert_refused_output(&run("rping", &args), "rping", &args, "-s", "--insecure");
}

#[test]
fn udaddy_refuses_bad_values_and_a_server_not_told_it_answers_anyone() {
    // udaddy takes no device: it opens the one its address routes to,
    // only after these checks.
    for (args, flag, accepts) in [
        (&["-b", "127.0.0.1"][..], "--insecure", "add --insecure"),
        (
            &["-s", "127.0.0.1", "--insecure"],
            "--insecure",
            "only the server takes it",
        ),
        (
            &["-s", "no-such-host.invalid"],
            "-s no-such-host.invalid",
            "must be a host name or address",
        ),
        (
            &["--insecure", "-b", "no-such-host.invalid"],
            "-b no-such-host.invalid",
            "must be a host name or address",
        ),
        (&["-s", "127.0.0.1", "-C", "0"], "-C 0", "must be 1 to 4096"),
        (
            &["-s", "127.0.0.1", "-C", "4097"],
            "-C 4097",
            "must be 1 to 4096",
        ),
        (&["-s", "127.0.0.1", "-S", "0"], "-S 0", "must be 1 to 4096"),
        (
            &["-s", "127.0.0.1", "-S", "4097"],
            "-S 4097",
            "must be 1 to 4096",
        ),
        (
            &["--insecure", "--port", "0"],
            "--port 0",
            "must be 1 to 65535",
        ),
        (
            &["-s", "127.0.0.1", "--timeout", "0"],
            "--timeout 0",
            "must be 1 to 3600",
        ),
    ] {
        assert_refused_output(&run("udaddy", args), "udaddy", args, flag, accepts);
    }
}

/// An argument the chosen mode would ignore is refused, naming both.
#[test]
fn echo_refuses_arguments_its_mode_would_ignore() {
    for (args, mode, ignored) in [
        (
            &["--loopback", "--listen", "x"][..],
            "--loopback",
            "--listen",
        ),
        (&["--loopback", "-d", NO_DEVICE], "--loopback", "--device"),
        (
            &["--loopback", "--auth-key-file", "/nonexistent"],
            "--loopback",
            "--auth-key-file",
        ),
        (&["--loopback", "--insecure"], "--loopback", "--insecure"),
        (
            &["--server", "--count", "5", "--insecure"],
            "--server",
            "--count",
        ),
        (
            &["--server", "--size", "8", "--insecure"],
            "--server",
            "--size",
        ),
        (
            &["--connect", "127.0.0.1:9", "--listen", "127.0.0.1:1"],
            "--connect",
            "--listen",
        ),
    ] {
        let out = run("echo", args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "echo {args:?}: {stderr}");
        assert!(
            stderr.contains(mode) && stderr.contains(ignored),
            "echo {args:?} names {mode} and {ignored}: {stderr}"
        );
    }
}

#[test]
fn echo_refuses_a_missing_role_sizes_out_of_range_and_an_unresolved_server() {
    assert_refused(
        "echo",
        &[],
        "--server",
        "say --server, --connect HOST:PORT or --loopback",
    );
    for size in ["7", "4093"] {
        assert_refused(
            "echo",
            &["--connect", "127.0.0.1:9", "--size", size],
            &format!("--size {size}"),
            "must be 8 to 4092",
        );
    }
    assert_refused(
        "echo",
        &["--connect", "nohost.invalid:7471"],
        "--connect nohost.invalid:7471",
        "must be HOST:PORT",
    );
    assert_refused(
        "echo",
        &["--connect", "127.0.0.1:9", "--count", "0"],
        "--count 0",
        "must be 1 to 1000000000000",
    );
}

/// Each tool's `--help` starts with what that tool does, not with the
/// crate's description.
#[test]
fn every_tools_help_says_what_the_tool_does() {
    for (tool, about) in [
        (
            "echo",
            "An echo server and a client that verifies every echo",
        ),
        ("ping_pong", "RDMA ping-pong with verified payloads"),
        ("lat_bw", "Latency and bandwidth benchmark"),
        ("rdma_cat", "Stream stdin to a peer's stdout over RDMA"),
        ("devinfo", "Show RDMA devices, ports and GIDs"),
        ("demo", "A runtime of pinned reactors"),
        ("conn_scale", "Message rate and receive memory"),
        ("submit_latency", "Submit-to-doorbell latency"),
        (
            "verbs_perf",
            "Latency and bandwidth over the verbs layer alone",
        ),
        ("feed", "Multicast feed"),
        ("udaddy", "UD datagrams through the connection manager"),
    ] {
        let out = run(tool, &["--help"]);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{tool} --help: {out:?}");
        let first = stdout.lines().next().unwrap_or_default();
        assert!(first.starts_with(about), "{tool} --help begins {first:?}");
    }
}

#[test]
fn feed_refuses_a_group_that_is_not_multicast_and_values_out_of_range() {
    for (args, flag, accepts) in [
        (
            &["publish", "--group", "10.1.1.1"][..],
            "--group 10.1.1.1",
            "must be an IPv4 multicast address",
        ),
        (
            &["subscribe", "--group", "nonsense"],
            "--group nonsense",
            "must be an IPv4 multicast address",
        ),
        (
            &["publish", "--group", "239.1.1.1", "--size", "23"],
            "--size 23",
            "must be 24 to 4096",
        ),
        (
            &["publish", "--group", "239.1.1.1", "--size", "4097"],
            "--size 4097",
            "must be 24 to 4096",
        ),
        (
            &["publish", "--group", "239.1.1.1", "--rate", "0"],
            "--rate 0",
            "must be 1 to 10000000",
        ),
        (
            &["publish", "--group", "239.1.1.1", "--count", "0"],
            "--count 0",
            "must be 1 to 1000000000",
        ),
        (
            &["subscribe", "--group", "239.1.1.1", "--timeout", "0"],
            "--timeout 0",
            "must be 1 to 86400",
        ),
        (
            &["subscribe", "--group", "239.1.1.1", "--receives", "0"],
            "--receives 0",
            "must be 1 to 8192",
        ),
        (
            &["subscribe", "--group", "239.1.1.1", "--receives", "8193"],
            "--receives 8193",
            "must be 1 to 8192",
        ),
        (
            &["subscribe", "--group", "239.1.1.1", "--cm", "nonsense"],
            "--cm nonsense",
            "must be an IPv4 address of this host",
        ),
        (
            &["publish", "--group", "239.1.1.1", "--cm", "239.1.1.2"],
            "--cm 239.1.1.2",
            "must be an IPv4 address of this host",
        ),
        (
            &["publish", "--group", "239.1.1.1", "--cm", "0.0.0.0"],
            "--cm 0.0.0.0",
            "must be an IPv4 address of this host",
        ),
        // With a good address, -d (which assert_refused adds) and -x are
        // refused: the device is the address's.
        (
            &["subscribe", "--group", "239.1.1.1", "--cm", "192.0.2.1"],
            "--cm",
            "give no -d or -x with it",
        ),
        (
            &[
                "publish",
                "--group",
                "239.1.1.1",
                "--cm",
                "192.0.2.1",
                "-x",
                "1",
            ],
            "--cm",
            "give no -d or -x with it",
        ),
    ] {
        assert_refused("feed", args, flag, accepts);
    }
    // Good arguments get as far as the device.
    let out = run(
        "feed",
        &["subscribe", "--group", "239.1.1.1", "-d", NO_DEVICE],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains(NO_DEVICE), "{stderr}");
    // With --cm, as far as the connection manager: no RDMA device, or none
    // with that address (192.0.2.1 is for documentation only).
    let out = run(
        "feed",
        &["subscribe", "--group", "239.1.1.1", "--cm", "192.0.2.1"],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("feed: rdma_"), "{stderr}");
}
