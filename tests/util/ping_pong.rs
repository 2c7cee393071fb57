//! Starting `examples/ping_pong` servers and clients as processes.
#![allow(dead_code)]

use std::net::SocketAddr;

use super::process::Proc;

/// Starts `ping_pong --server` on a free loopback port with `extra` flags
/// (`--peers`, `--max-size`, ...); returns it and the address it printed.
#[track_caller]
pub fn start_server(extra: &[&str]) -> (Proc, SocketAddr) {
    start_server_with_env(extra, &[])
}

/// [`start_server`] with `env` added to the server's environment.
#[track_caller]
pub fn start_server_with_env(extra: &[&str], env: &[(&str, &str)]) -> (Proc, SocketAddr) {
    let args = [&["--server", "--listen", "127.0.0.1:0"], extra].concat();
    let mut server = Proc::spawn_with_env("ping_pong", &args, env);
    let line = server.expect_line("listening on ");
    let addr = line
        .trim_start_matches("listening on ")
        .parse()
        .expect("server prints its address");
    (server, addr)
}

/// Starts `ping_pong --connect` for `iters` round trips of `size` bytes by
/// `op` (`send`, `write-imm` or `both`).
#[track_caller]
pub fn client(addr: SocketAddr, iters: u64, size: usize, op: &str) -> Proc {
    Proc::spawn(
        "ping_pong",
        &[
            "--connect",
            &addr.to_string(),
            "--iters",
            &iters.to_string(),
            "--size",
            &size.to_string(),
            "--op",
            op,
        ],
    )
}
