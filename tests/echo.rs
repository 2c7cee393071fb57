//! `examples/echo.rs`, the template service: its loopback mode on the host
//! (no NIC), and its server and client as two processes over the device.

mod util;

use std::process::Command;

use util::example_binary;
use util::process::Proc;

#[test]
fn the_loopback_echo_brings_back_every_message_intact() {
    let out = Command::new(example_binary("echo"))
        .args(["--loopback", "--count", "10000", "--size", "4092"])
        .output()
        .expect("echo runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("10000 of 10000 messages of 4092 B echoed, every byte intact"),
        "{stdout}"
    );
}

verbs_test! {
    fn a_keyed_echo_server_serves_a_keyed_client_and_refuses_one_without_the_key() {
        let mut server = Proc::spawn("echo", &["--server", "--listen", "127.0.0.1:0"]);
        let line = server.expect_line("echo: serving on ");
        let addr = line.trim_start_matches("echo: serving on ").to_string();

        let client = Proc::spawn("echo", &["--connect", &addr, "--count", "2000"]);
        let (ok, lines) = client.finish();
        assert!(ok, "the client failed: {lines:?}");
        assert!(
            lines.iter().any(|line| line.starts_with("2000 of 2000 messages of 64 B echoed, every byte intact")),
            "{lines:?}"
        );

        // Another key: refused by the server, reported by the client.
        let out = Command::new(example_binary("echo"))
            .args(["--connect", &addr, "--count", "10"])
            .env(rdma_comm_core::session::AUTH_KEY_ENV, "another key, also 32 bytes long or more")
            .output()
            .expect("echo runs");
        assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stderr));
        drop(server);
    }
}
