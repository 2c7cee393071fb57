//! examples/rping against rdma-core's own `rping` (from rdmacm-utils), both
//! ways, and against itself, over rxe0 at 10.77.0.1 in the Soft-RoCE guest.
//!
//! Gating: every test is a `verbs_test!` (ignored on a host without a
//! device; tools/test runs them in the guest). A test that cannot find
//! `rping` fails and says how to install it: it never skips.
//!
//! Sizes: 64 B, 4 KiB and 65535 B, the largest rping accepts (its -S range
//! is 23 to 65535; 65536 is refused). The rping server gets the same -S as
//! the client: it READs the client's whole buffer into its own.

mod util;

use std::path::PathBuf;
use std::process::{Command, ExitStatus};
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::Duration;

use util::example_binary;
use util::process::Proc;

/// rxe0's address in the guest (tools/rxe-vm).
const ADDR: &str = "10.77.0.1";
const SIZES: [u32; 3] = [64, 4096, 65535];
const COUNT: usize = 100;
/// Long enough for 100 pings of 64 KiB on two emulated cores, with room.
const DEADLINE: Duration = Duration::from_secs(120);

/// A port of its own for each connection in this binary.
fn port() -> u16 {
    static NEXT: AtomicU16 = AtomicU16::new(7300);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// rdma-core's rping, or a failure that says how to get it.
#[track_caller]
fn rping_path() -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/bin".into(), "/usr/sbin".into()])
        .map(|dir| dir.join("rping"))
        .find(|candidate| candidate.is_file())
        .unwrap_or_else(|| {
            panic!(
                "rdma-core's `rping` is not installed (Debian package rdmacm-utils): \
                 tools/ensure-deps installs it; these tests check examples/rping against it \
                 and never skip"
            )
        })
}

fn ours() -> PathBuf {
    example_binary("rping")
}

/// `program` with `args`, its stdout lines waited for and its stderr kept.
#[track_caller]
fn spawn(program: PathBuf, args: &[String]) -> Proc {
    let mut command = Command::new(program);
    command.args(args);
    let mut proc = Proc::spawn_reading_both(command);
    proc.deadline = DEADLINE;
    proc
}

/// Waits until an rdma_cm id listens on `port` (`rdma res show cm_id`):
/// neither rping server says when it is ready.
#[track_caller]
fn wait_listening(server: &mut Proc, port: u16) {
    let wanted = format!("{ADDR}:{port}");
    server.wait_until(&format!("listening on {wanted}"), || {
        let out = Command::new("rdma")
            .args(["-j", "res", "show", "cm_id"])
            .output()
            .expect("run `rdma -j res show cm_id` (iproute2)");
        let ids: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        ids.as_array()
            .into_iter()
            .flatten()
            .any(|id| id["state"] == "LISTEN" && id["src-addr"].as_str() == Some(wanted.as_str()))
    });
}

/// The flags both sides get: validated and printed pings of `size` bytes
/// at ADDR:`port`.
fn side_args(side: &str, port: u16, size: u32) -> Vec<String> {
    let (port, size) = (port.to_string(), size.to_string());
    let mut all = vec![side.to_string()];
    all.extend(["-V", "-v", "-a", ADDR, "-p", &port, "-S", &size].map(String::from));
    all
}

/// A server's flags; ours also needs `--insecure`, since rping's protocol
/// has no authentication.
fn server_args(program: &PathBuf, port: u16, size: u32) -> Vec<String> {
    let mut args = side_args("-s", port, size);
    if *program == ours() {
        args.push("--insecure".to_string());
    }
    args
}

/// A client's flags; `count` 0 pings for ever.
fn client_args(port: u16, size: u32, count: usize) -> Vec<String> {
    let mut args = side_args("-c", port, size);
    args.extend(["-C".to_string(), count.to_string()]);
    args
}

/// The ping data of ping `n` as printed (`%s`: up to its NUL), which is
/// exactly what rping's client generates.
fn ping_data(n: usize, size: u32) -> String {
    let mut text = format!("rdma-ping-{n}: ");
    let mut c = b'A' + (n % 58) as u8;
    while text.len() < size as usize - 1 {
        text.push(c as char);
        c = if c >= b'z' { b'A' } else { c + 1 };
    }
    text.truncate(size as usize - 1);
    text
}

/// `count` lines `{prefix}{ping_data(i)}` in order.
#[track_caller]
fn assert_pings(who: &str, lines: &[String], prefix: &str, size: u32) {
    let pings: Vec<&String> = lines.iter().filter(|l| l.starts_with(prefix)).collect();
    assert_eq!(
        pings.len(),
        COUNT,
        "{who}: {} ping lines, expected {COUNT}",
        pings.len()
    );
    for (i, line) in pings.iter().enumerate() {
        let expected = format!("{prefix}{}", ping_data(i, size));
        assert!(
            **line == expected,
            "{who}: ping {i} of {size} B differs: {:.80}...",
            line
        );
    }
}

/// One client run of 100 validated pings against a server, both checked.
/// Our client runs with -d, which reports how its disconnect ended: the
/// server must answer it (both rping and ours do).
fn ping_pong(server_bin: PathBuf, client_bin: PathBuf, size: u32) {
    let port = port();
    let mut server = spawn(server_bin.clone(), &server_args(&server_bin, port, size));
    wait_listening(&mut server, port);
    let ours = client_bin == self::ours();
    let mut args = client_args(port, size, COUNT);
    if ours {
        args.push("-d".into());
    }
    let client = spawn(client_bin, &args);
    let (status, out, err) = client.finish_with_stderr();
    assert!(
        status.success(),
        "client failed at {size} B ({status}): {err:#?}"
    );
    assert_pings("client", &out, "ping data: ", size);
    if ours {
        assert!(
            err.iter()
                .any(|l| l.contains("disconnect: Ok(Disconnected)")),
            "the server did not answer our disconnect: {:#?}",
            &err[err.len().saturating_sub(5)..]
        );
    }
    let (status, out, err) = server.finish_with_stderr();
    assert!(
        status.success(),
        "server failed at {size} B ({status}): {err:#?}"
    );
    assert_pings("server", &out, "server ping data: ", size);
}

verbs_test! {
    fn our_client_against_rping_server() {
        for size in SIZES {
            ping_pong(rping_path(), ours(), size);
        }
    }
}

verbs_test! {
    fn rping_client_against_our_server() {
        for size in SIZES {
            ping_pong(ours(), rping_path(), size);
        }
    }
}

verbs_test! {
    fn our_client_against_our_server() {
        for size in SIZES {
            ping_pong(ours(), ours(), size);
        }
    }
}

/// Runs `server_bin` and `client_bin` with endless 4 KiB pings, kills one
/// of them after 20 pings, and returns how the other (ours) ended: its
/// exit status, stdout lines and stderr. Our side must not hang.
fn kill_mid_run(
    server_bin: PathBuf,
    client_bin: PathBuf,
    kill_server: bool,
) -> (ExitStatus, Vec<String>, String) {
    let port = port();
    let mut server = spawn(server_bin.clone(), &server_args(&server_bin, port, 4096));
    wait_listening(&mut server, port);
    let client = spawn(client_bin, &client_args(port, 4096, 0));
    let (mut killed, survivor) = if kill_server {
        (server, client)
    } else {
        (client, server)
    };
    let mut survivor = survivor;
    survivor.expect_lines("ping data: ", 20);
    killed.kill();
    let (status, out, err) = survivor.finish_with_stderr();
    let err = err.join("\n");
    assert!(out.len() >= 20, "only {} pings before the kill", out.len());
    assert!(
        status.success() || err.contains("RDMA_CM_EVENT_DISCONNECTED") || err.contains("IBV_WC_"),
        "our side failed without naming the disconnect or a failed completion: {err}"
    );
    assert!(
        status.success() || err.contains(&format!("{ADDR}:")),
        "our side's error does not name the peer: {err}"
    );
    (status, out, err)
}

verbs_test! {
    /// The rping server is killed mid-run: our client says so with a typed
    /// error naming the peer and exits non-zero, without hanging.
    fn rping_server_killed_mid_run() {
        let (status, _, _) = kill_mid_run(rping_path(), ours(), true);
        assert!(!status.success(), "our client exited 0 after its server was killed");
    }
}

verbs_test! {
    /// The rping client is killed mid-run: our server sees the disconnect
    /// (between pings, rping's own "server DISCONNECT EVENT..." and exit 0;
    /// in the middle of one, a typed error and exit 1) and does not hang.
    fn rping_client_killed_mid_run() {
        let (status, _, err) = kill_mid_run(ours(), rping_path(), false);
        if status.success() {
            assert!(err.contains("server DISCONNECT EVENT"), "exit 0 without the disconnect: {err}");
        }
    }
}

verbs_test! {
    /// No listener at the port: a typed reject naming the peer, at once.
    fn our_client_without_server_is_rejected() {
        let port = port();
        let client = spawn(ours(), &client_args(port, 64, 1));
        let (status, _, err) = client.finish_with_stderr();
        assert!(!status.success());
        let err = err.join("\n");
        assert!(
            err.contains("RDMA_CM_EVENT_REJECTED") && err.contains(&format!("{ADDR}:{port}")),
            "{err}"
        );
    }
}
