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

use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use util::example_binary;

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

/// A child whose stdout and stderr lines are collected; killed on drop.
struct Run {
    name: String,
    child: Child,
    out: Arc<Mutex<Vec<String>>>,
    err: Arc<Mutex<Vec<String>>>,
    readers: Vec<thread::JoinHandle<()>>,
}

impl Run {
    #[track_caller]
    fn spawn(name: &str, program: PathBuf, args: &[String]) -> Self {
        let mut child = Command::new(&program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|err| panic!("spawn {}: {err}", program.display()));
        let out = Arc::new(Mutex::new(Vec::new()));
        let err = Arc::new(Mutex::new(Vec::new()));
        let readers = vec![
            collect(child.stdout.take().unwrap(), Arc::clone(&out)),
            collect(child.stderr.take().unwrap(), Arc::clone(&err)),
        ];
        Run {
            name: format!("{name} ({} {})", program.display(), args.join(" ")),
            child,
            out,
            err,
            readers,
        }
    }

    fn count(&self, needle: &str) -> usize {
        self.out
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.contains(needle))
            .count()
    }

    /// Waits until `count` stdout lines contain `needle`.
    #[track_caller]
    fn wait_for_lines(&mut self, needle: &str, count: usize) {
        let what = format!("printing {count} lines with {needle:?}");
        self.wait_until(&what, |run| run.count(needle) >= count);
    }

    /// Polls `ready` until it holds, failing if the child exits first or
    /// at the deadline.
    #[track_caller]
    fn wait_until(&mut self, what: &str, mut ready: impl FnMut(&Run) -> bool) {
        let start = Instant::now();
        while !ready(self) {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "{} exited ({status}) before {what}: {}",
                    self.name,
                    self.dump()
                );
            }
            assert!(
                start.elapsed() < DEADLINE,
                "{}: not {what} within {DEADLINE:?}: {}",
                self.name,
                self.dump()
            );
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits for the exit; returns the status, stdout and stderr.
    #[track_caller]
    fn finish(mut self) -> (ExitStatus, Vec<String>, Vec<String>) {
        let start = Instant::now();
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            if start.elapsed() > DEADLINE {
                let _ = self.child.kill();
                panic!(
                    "{} did not exit within {DEADLINE:?} (a hang): {}",
                    self.name,
                    self.dump()
                );
            }
            thread::sleep(Duration::from_millis(20));
        };
        for reader in self.readers.drain(..) {
            reader.join().unwrap();
        }
        let out = std::mem::take(&mut *self.out.lock().unwrap());
        let err = std::mem::take(&mut *self.err.lock().unwrap());
        (status, out, err)
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
    }

    fn dump(&self) -> String {
        let out = self.out.lock().unwrap();
        let tail = &out[out.len().saturating_sub(5)..];
        format!(
            "stdout tail {tail:#?}, stderr {:#?}",
            self.err.lock().unwrap()
        )
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn collect(
    pipe: impl Read + Send + 'static,
    into: Arc<Mutex<Vec<String>>>,
) -> thread::JoinHandle<()> {
    thread::spawn(move || {
        for line in BufReader::new(pipe).lines().map_while(Result::ok) {
            into.lock().unwrap().push(line);
        }
    })
}

/// Waits until an rdma_cm id listens on `port` (`rdma res show cm_id`):
/// neither rping server says when it is ready.
#[track_caller]
fn wait_listening(server: &mut Run, port: u16) {
    let wanted = format!("{ADDR}:{port}");
    server.wait_until(&format!("listening on {wanted}"), |_| {
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

fn server_args(port: u16, size: u32) -> Vec<String> {
    side_args("-s", port, size)
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
    let mut server = Run::spawn("server", server_bin, &server_args(port, size));
    wait_listening(&mut server, port);
    let ours = client_bin == self::ours();
    let mut args = client_args(port, size, COUNT);
    if ours {
        args.push("-d".into());
    }
    let client = Run::spawn("client", client_bin, &args);
    let (status, out, err) = client.finish();
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
    let (status, out, err) = server.finish();
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
    let mut server = Run::spawn("server", server_bin, &server_args(port, 4096));
    wait_listening(&mut server, port);
    let client = Run::spawn("client", client_bin, &client_args(port, 4096, 0));
    let (mut killed, survivor) = if kill_server {
        (server, client)
    } else {
        (client, server)
    };
    let mut survivor = survivor;
    survivor.wait_for_lines("ping data: ", 20);
    killed.kill();
    let (status, out, err) = survivor.finish();
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
        let client = Run::spawn("our client", ours(), &client_args(port, 64, 1));
        let (status, _, err) = client.finish();
        assert!(!status.success());
        let err = err.join("\n");
        assert!(
            err.contains("RDMA_CM_EVENT_REJECTED") && err.contains(&format!("{ADDR}:{port}")),
            "{err}"
        );
    }
}
