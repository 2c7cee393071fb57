//! A program run as a child process, its stdout (or stderr) read line by
//! line (and, if asked, its stderr kept beside it), for tests that drive
//! servers and clients as separate processes.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use super::example_binary;

/// How long [`Proc`] waits for a line or an exit unless told otherwise.
/// Generous: several processes share two emulated cores in the guest.
pub const PROCESS_DEADLINE: Duration = Duration::from_secs(240);

/// A child process whose stdout (or stderr) lines arrive on a channel.
/// Killed on drop.
pub struct Proc {
    pub child: Child,
    lines: Receiver<String>,
    /// The thread that reads them: finished once the pipe is closed.
    reader: JoinHandle<()>,
    /// Every line read so far, in order.
    pub seen: Vec<String>,
    /// The stderr lines of a process whose stdout is the one read
    /// ([`spawn_reading_both`](Self::spawn_reading_both)), and their reader.
    stderr: Option<Collected>,
    /// How long each wait may take before the test fails.
    pub deadline: Duration,
    /// The program and its arguments, for failure reports.
    what: String,
    /// Lines failure reports leave out ([`hide_in_report`](Self::hide_in_report)).
    hidden: Vec<String>,
}

/// Lines a thread of their own collects from a pipe.
struct Collected {
    lines: Arc<Mutex<Vec<String>>>,
    reader: JoinHandle<()>,
}

impl Proc {
    /// Starts `examples/<example>` with `args`; stderr goes to the test's.
    #[track_caller]
    pub fn spawn(example: &str, args: &[&str]) -> Self {
        Self::spawn_with_env(example, args, &[])
    }

    /// [`spawn`](Self::spawn) with `env` added to the environment.
    #[track_caller]
    pub fn spawn_with_env(example: &str, args: &[&str], env: &[(&str, &str)]) -> Self {
        let mut child = super::keyed(example_binary(example))
            .args(args)
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|err| panic!("spawn {example}: {err}"));
        let stdout = child.stdout.take().unwrap();
        Self::reading(child, stdout, format!("{example} {}", args.join(" ")))
    }

    /// Starts `command` for a program that reports on stderr: its stderr
    /// lines are the ones read; stdout is discarded.
    #[track_caller]
    pub fn spawn_reading_stderr(mut command: Command) -> Self {
        let mut child = command
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|err| panic!("spawn {command:?}: {err}"));
        let stderr = child.stderr.take().unwrap();
        Self::reading(child, stderr, format!("{command:?}"))
    }

    /// Starts `command` (stdin closed) reading both pipes: its stdout lines
    /// are the ones waited for, its stderr lines are kept for
    /// [`finish_with_stderr`](Self::finish_with_stderr) and failure reports.
    #[track_caller]
    pub fn spawn_reading_both(mut command: Command) -> Self {
        let mut child = command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|err| panic!("spawn {command:?}: {err}"));
        let stdout = child.stdout.take().unwrap();
        let stderr = child.stderr.take().unwrap();
        let mut proc = Self::reading(child, stdout, format!("{command:?}"));
        let lines = Arc::new(Mutex::new(Vec::new()));
        let into = Arc::clone(&lines);
        let reader = thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                into.lock().unwrap().push(line);
            }
        });
        proc.stderr = Some(Collected { lines, reader });
        proc
    }

    /// `child`, with the lines of `pipe` sent to the channel by a thread
    /// of their own (a pipe nobody reads would stall the child once full).
    fn reading(child: Child, pipe: impl Read + Send + 'static, what: String) -> Self {
        let (tx, lines) = mpsc::channel();
        let reader = thread::spawn(move || {
            for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Proc {
            child,
            lines,
            reader,
            seen: Vec::new(),
            stderr: None,
            deadline: PROCESS_DEADLINE,
            what,
            hidden: Vec::new(),
        }
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits for a line containing `needle` and returns it.
    #[track_caller]
    pub fn expect_line(&mut self, needle: &str) -> String {
        let start = Instant::now();
        loop {
            if let Some(line) = self.seen.iter().find(|l| l.contains(needle)) {
                return line.clone();
            }
            self.next_line(start, || format!("no line containing {needle:?}"));
        }
    }

    /// Waits until `count` lines contain `needle` (reading each line once,
    /// so it stays cheap when a server has printed thousands).
    #[track_caller]
    pub fn expect_lines(&mut self, needle: &str, count: usize) {
        let start = Instant::now();
        let mut found = self.count(needle);
        while found < count {
            self.next_line(start, || {
                format!("{found} of {count} lines containing {needle:?}")
            });
            found += usize::from(self.seen.last().is_some_and(|l| l.contains(needle)));
        }
    }

    /// Leaves lines containing `needle` out of failure reports: for a
    /// process that prints a reading every so often, whose lines would
    /// crowd out what it last said.
    pub fn hide_in_report(&mut self, needle: &str) {
        self.hidden.push(needle.to_string());
    }

    /// The newest line read so far that contains `needle`.
    pub fn last_line(&self, needle: &str) -> Option<&str> {
        self.seen
            .iter()
            .rev()
            .find(|l| l.contains(needle))
            .map(String::as_str)
    }

    /// How many lines read so far contain `needle`.
    pub fn count(&self, needle: &str) -> usize {
        self.seen.iter().filter(|l| l.contains(needle)).count()
    }

    /// Polls `ready` until it holds, failing the test if the process exits
    /// first or at the deadline. For a readiness the process does not print
    /// (a listener that only the kernel's tables show, say).
    #[track_caller]
    pub fn wait_until(&mut self, what: &str, mut ready: impl FnMut() -> bool) {
        let start = Instant::now();
        while !ready() {
            self.seen.extend(self.lines.try_iter());
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("exited ({status}) before {what}; {}", self.report());
            }
            assert!(
                start.elapsed() < self.deadline,
                "not {what} within {:?}; {}",
                self.deadline,
                self.report()
            );
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// Reads one more line into `seen`, failing the test at the deadline,
    /// or once the process has closed its end and exited.
    #[track_caller]
    fn next_line(&mut self, start: Instant, waiting_for: impl FnOnce() -> String) {
        let left = self.deadline.saturating_sub(start.elapsed());
        match self.lines.recv_timeout(left) {
            Ok(line) => self.seen.push(line),
            Err(RecvTimeoutError::Timeout) => panic!(
                "{} within {:?}; {}",
                waiting_for(),
                self.deadline,
                self.report()
            ),
            Err(RecvTimeoutError::Disconnected) => {
                // It closed its output: it is exiting, or has.
                let status = (0..250)
                    .find_map(|_| {
                        let status = self.child.try_wait().ok().flatten();
                        if status.is_none() {
                            thread::sleep(Duration::from_millis(20));
                        }
                        status
                    })
                    .map_or("not yet".to_string(), |status| status.to_string());
                panic!(
                    "{}: it closed its output (exit status: {status}); {}",
                    waiting_for(),
                    self.report()
                )
            }
        }
    }

    /// What the process is, the last lines read, and the stderr lines when
    /// they are kept.
    fn report(&self) -> String {
        let shown: Vec<&String> = self
            .seen
            .iter()
            .filter(|line| {
                !self
                    .hidden
                    .iter()
                    .any(|needle| line.contains(needle.as_str()))
            })
            .collect();
        let tail = &shown[shown.len().saturating_sub(40)..];
        let mut report = format!("{}: the last lines: {tail:#?}", self.what);
        if let Some(stderr) = &self.stderr {
            report += &format!(", stderr: {:#?}", stderr.lines.lock().unwrap());
        }
        report
    }

    /// Waits for exit; returns success and every line read. A process
    /// that does not exit in time is killed, and the failure says where
    /// its threads were.
    #[track_caller]
    pub fn finish(mut self) -> (bool, Vec<String>) {
        let status = self.wait_for_exit();
        (status.success(), std::mem::take(&mut self.seen))
    }

    /// [`finish`](Self::finish) for a process spawned with
    /// [`spawn_reading_both`](Self::spawn_reading_both): its exit status,
    /// every stdout line and every stderr line.
    #[track_caller]
    pub fn finish_with_stderr(mut self) -> (ExitStatus, Vec<String>, Vec<String>) {
        let status = self.wait_for_exit();
        let stderr = match &self.stderr {
            Some(stderr) => std::mem::take(&mut *stderr.lines.lock().unwrap()),
            None => Vec::new(),
        };
        (status, std::mem::take(&mut self.seen), stderr)
    }

    /// Kills the process (a peer lost mid-run, say); the value stays to be
    /// finished or dropped.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
    }

    /// Waits for the exit and reads the rest of the lines into `seen`.
    #[track_caller]
    fn wait_for_exit(&mut self) -> ExitStatus {
        let start = Instant::now();
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            if start.elapsed() > self.deadline {
                let stuck = where_stuck(self.pid());
                let _ = self.child.kill();
                self.seen.extend(self.lines.try_iter());
                panic!(
                    "process did not exit within {:?}, here:\n{stuck}{}",
                    self.deadline,
                    self.report()
                );
            }
            thread::sleep(Duration::from_millis(20));
        };
        // The rest of its output, once its pipes are closed, bounded: a
        // process it started may hold them open after it exits, and a wait
        // without a deadline would hang the whole test run instead of
        // failing this test.
        let start = Instant::now();
        while !self.pipes_closed() && start.elapsed() < self.deadline {
            thread::sleep(Duration::from_millis(20));
        }
        self.seen.extend(self.lines.try_iter());
        assert!(
            self.pipes_closed(),
            "its output stayed open for {:?} after it exited ({status}), \
             held by a process it started; {}",
            self.deadline,
            self.report()
        );
        status
    }

    /// Whether the readers of its pipes have seen them closed.
    fn pipes_closed(&self) -> bool {
        self.reader.is_finished()
            && self
                .stderr
                .as_ref()
                .is_none_or(|stderr| stderr.reader.is_finished())
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Where each thread of process `pid` is right now, read from /proc (the
/// guest runs tests as root, so kernel stacks are readable): its name, state,
/// wait channel, system call (number and arguments, or "running") and kernel
/// stack. For a test that found a process hung, so
/// a rare hang in CI says where it was, not only that it happened.
pub fn where_stuck(pid: u32) -> String {
    let read = |path: String| std::fs::read_to_string(path).unwrap_or_default();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return format!("process {pid}: gone\n");
    };
    let mut report = String::new();
    for task in tasks.flatten() {
        let dir = task.path().display().to_string();
        let state = read(format!("{dir}/status"))
            .lines()
            .find(|line| line.starts_with("State:"))
            .unwrap_or_default()
            .to_string();
        report += &format!(
            "thread {} ({}) {state}, waiting in {:?}, syscall {}\n{}",
            task.file_name().to_string_lossy(),
            read(format!("{dir}/comm")).trim(),
            read(format!("{dir}/wchan")),
            read(format!("{dir}/syscall")).trim(),
            read(format!("{dir}/stack")),
        );
    }
    report
}
