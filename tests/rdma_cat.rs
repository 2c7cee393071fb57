//! `examples/rdma_cat` end to end, as separate processes: a 256 MiB random
//! stream through send → relay → recv keeps its SHA-256; empty and 1-byte
//! inputs pass; a receiver killed mid-stream makes the sender fail.
//! Gated as described in `tests/util/mod.rs`: runs in the Soft-RoCE guest.

mod util;

use std::io::{Read, Write};
use std::process::{Child, ChildStdin, ChildStdout, ExitStatus, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use util::*;

/// Three processes and two hashes share two emulated cores.
const DEADLINE: Duration = Duration::from_secs(600);

fn rdma_cat(args: &[&str]) -> Child {
    keyed(example_binary("rdma_cat"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn rdma_cat")
}

/// Deterministic, incompressible bytes (xorshift64*), fast enough that the
/// generator is not what the test waits for.
struct Noise(u64);

impl Noise {
    fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            let word = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes();
            chunk.copy_from_slice(&word[..chunk.len()]);
        }
    }
}

/// Writes `len` noise bytes (or until the reader goes away) in odd-sized
/// pieces; returns their SHA-256 and how many were written.
fn feed(mut stdin: ChildStdin, len: u64, seed: u64) -> thread::JoinHandle<(Vec<u8>, u64)> {
    thread::spawn(move || {
        let mut noise = Noise(seed | 1);
        let mut hash = Sha256::new();
        let mut buf = vec![0u8; 100_003];
        let mut written = 0u64;
        while written < len {
            let n = buf.len().min((len - written) as usize);
            noise.fill(&mut buf[..n]);
            if stdin.write_all(&buf[..n]).is_err() {
                break;
            }
            hash.update(&buf[..n]);
            written += n as u64;
        }
        (hash.finalize().to_vec(), written)
    })
}

/// Reads a child's stdout to the end: its SHA-256 and length.
fn drain(mut stdout: ChildStdout) -> thread::JoinHandle<(Vec<u8>, u64)> {
    thread::spawn(move || {
        let mut hash = Sha256::new();
        let mut buf = vec![0u8; 1 << 16];
        let mut total = 0u64;
        loop {
            match stdout.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    hash.update(&buf[..n]);
                    total += n as u64;
                }
            }
        }
        (hash.finalize().to_vec(), total)
    })
}

/// Waits for `child` (killing it at the deadline) and returns its status and stderr.
#[track_caller]
fn finish(name: &str, child: &mut Child, started: Instant) -> (ExitStatus, String) {
    let mut stderr = child.stderr.take().expect("stderr piped");
    let reader = thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    loop {
        if let Some(status) = child.try_wait().expect("wait") {
            let text = reader.join().unwrap();
            eprintln!("{name}: {status}; stderr: {text}");
            return (status, text);
        }
        if started.elapsed() > DEADLINE {
            let _ = child.kill();
            panic!("{name} still running after {DEADLINE:?}");
        }
        thread::sleep(Duration::from_millis(20));
    }
}

/// send → [relay →] recv of `len` bytes; asserts every process exits 0 and
/// the output is the input.
fn stream(len: u64, through_relay: bool) {
    let started = Instant::now();
    let recv_port = free_port().to_string();
    let mut receiver = rdma_cat(&["recv", "--listen", &recv_port, "--quiet"]);
    let output = drain(receiver.stdout.take().unwrap());
    let recv_addr = format!("127.0.0.1:{recv_port}");
    let (mut relay, entry) = if through_relay {
        let relay_port = free_port().to_string();
        let relay = rdma_cat(&[
            "relay",
            "--listen",
            &relay_port,
            "--to",
            &recv_addr,
            "--quiet",
        ]);
        (Some(relay), format!("127.0.0.1:{relay_port}"))
    } else {
        (None, recv_addr)
    };
    let mut sender = rdma_cat(&["send", &entry, "--quiet"]);
    let input = feed(sender.stdin.take().unwrap(), len, len ^ 0x5eed);

    let (sender_status, _) = finish("sender", &mut sender, started);
    let (input_hash, written) = input.join().unwrap();
    if let Some(relay) = relay.as_mut() {
        let (status, _) = finish("relay", relay, started);
        assert!(status.success(), "relay failed");
    }
    let (receiver_status, _) = finish("receiver", &mut receiver, started);
    let (output_hash, read) = output.join().unwrap();
    assert!(sender_status.success(), "sender failed");
    assert!(receiver_status.success(), "receiver failed");
    assert_eq!(written, len);
    assert_eq!(read, len, "the receiver wrote a different number of bytes");
    assert_eq!(output_hash, input_hash, "the bytes differ");
    eprintln!("{len} bytes in {:?}", started.elapsed());
}

verbs_test! {
    fn a_256_mib_stream_through_a_relay_keeps_its_sha256() {
        stream(256 << 20, true);
    }
}

verbs_test! {
    fn an_empty_input_arrives_empty() {
        stream(0, false);
    }
}

verbs_test! {
    fn a_one_byte_input_arrives_whole() {
        stream(1, false);
    }
}

verbs_test! {
    fn a_stream_that_is_not_a_multiple_of_the_block_passes_a_relay() {
        stream(3 * 65536 + 12345, true);
    }
}

verbs_test! {
    fn killing_the_receiver_mid_stream_fails_the_sender() {
        let started = Instant::now();
        let port = free_port().to_string();
        let mut receiver = rdma_cat(&["recv", "--listen", &port, "--quiet"]);
        let mut output = receiver.stdout.take().unwrap();
        let mut sender = rdma_cat(&["send", &format!("127.0.0.1:{port}"), "--quiet"]);
        // Endless input: only the failure can end this sender.
        let _input = feed(sender.stdin.take().unwrap(), u64::MAX, 7);
        let mut seen = 0usize;
        let mut buf = vec![0u8; 1 << 16];
        while seen < 4 << 20 {
            match output.read(&mut buf) {
                Ok(0) | Err(_) => panic!("the receiver stopped early"),
                Ok(n) => seen += n,
            }
        }
        receiver.kill().expect("kill -9 the receiver");
        let _ = receiver.wait();
        let (status, stderr) = finish("sender", &mut sender, started);
        assert!(!status.success(), "the sender exited 0 after losing its receiver");
        assert!(
            stderr.contains("rdma_cat: ") && !stderr.contains("panicked"),
            "no clear message: {stderr:?}"
        );
    }
}
