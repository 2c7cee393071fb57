//! `spread_path` checks its arguments before it opens the loopback device,
//! and a good run over a few connections ends with every message.

use std::process::Command;

fn spread_path(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_spread_path"))
        .args(args)
        .output()
        .expect("spread_path runs")
}

#[test]
fn bad_arguments_are_refused_with_exit_2_and_named() {
    let cases: [(&[&str], &str); 6] = [
        (&[], "MESSAGES"),
        (&["0", "4"], "MESSAGES"),
        (&["ten", "4"], "MESSAGES"),
        (&["10", "0"], "CONNS"),
        (&["10", "4097"], "CONNS"),
        (&["10", "4", "more"], "MESSAGES and CONNS only"),
    ];
    for (args, named) in cases {
        let out = spread_path(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(named), "{args:?} names {named}: {stderr}");
    }
}

#[test]
fn a_run_over_a_few_connections_carries_every_message() {
    let out = spread_path(&["1000", "8"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.starts_with("1000 messages over 8 connections"),
        "{stdout}"
    );
}
