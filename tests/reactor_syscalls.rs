//! The busy-poll path makes no syscalls of its own. The provider's doorbell
//! is the provider's business (Soft-RoCE rings it with a `write()` on the
//! uverbs fd), so `write` is left out of the count; everything else the
//! reactor thread enters the kernel for is counted with a perf event on the
//! `raw_syscalls:sys_enter` tracepoint for this thread.
//! Gated as in `tests/util/mod.rs`.

mod util;

use std::fs;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::time::Duration;

use rdma_comm_core::reactor::*;
use util::reactor::*;
use util::*;

/// `struct perf_event_attr` as of PERF_ATTR_SIZE_VER0 (64 bytes), all a
/// tracepoint counter needs.
#[repr(C)]
#[derive(Default)]
struct PerfEventAttr {
    kind: u32,
    size: u32,
    config: u64,
    sample_period: u64,
    sample_type: u64,
    read_format: u64,
    flags: u64,
    wakeup_events: u32,
    bp_type: u32,
    config1: u64,
}

const PERF_TYPE_TRACEPOINT: u32 = 2;
const FLAG_DISABLED: u64 = 1;
const PERF_EVENT_IOC_ENABLE: libc::c_ulong = 0x2400;
const PERF_EVENT_IOC_DISABLE: libc::c_ulong = 0x2401;
const PERF_EVENT_IOC_SET_FILTER: libc::c_ulong = 0x4008_2406;

/// Counts this thread's syscalls other than `write` while a closure runs.
struct SyscallCounter {
    fd: OwnedFd,
    /// What an empty window counts: the `DISABLE` ioctl that closes it.
    overhead: u64,
}

impl SyscallCounter {
    fn open() -> Result<Self, String> {
        let id = tracepoint_id().map_err(|err| format!("raw_syscalls:sys_enter id: {err}"))?;
        let attr = PerfEventAttr {
            kind: PERF_TYPE_TRACEPOINT,
            size: size_of::<PerfEventAttr>() as u32,
            config: id,
            sample_period: 1,
            flags: FLAG_DISABLED,
            ..Default::default()
        };
        // SAFETY: `attr` is a valid VER0 perf_event_attr that outlives the
        // call; pid 0 and cpu -1 count this thread on any CPU.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_perf_event_open,
                &attr,
                0,
                -1,
                -1,
                0 as libc::c_ulong,
            )
        };
        if fd < 0 {
            return Err(format!("perf_event_open: {}", io::Error::last_os_error()));
        }
        // SAFETY: the kernel just returned this descriptor; we own it.
        let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        // x86-64: write is syscall 1; its count is the provider's doorbells.
        let filter = c"id != 1";
        // SAFETY: a valid descriptor and a NUL-terminated filter string.
        if unsafe { libc::ioctl(fd.as_raw_fd(), PERF_EVENT_IOC_SET_FILTER, filter.as_ptr()) } != 0 {
            return Err(format!(
                "setting the filter: {}",
                io::Error::last_os_error()
            ));
        }
        let mut counter = Self { fd, overhead: 0 };
        counter.overhead = counter.count(|| {})?;
        Ok(counter)
    }

    /// Syscalls (other than `write`) that `work` makes on this thread.
    fn count(&self, work: impl FnOnce()) -> Result<u64, String> {
        let before = self.read()?;
        self.ioctl(PERF_EVENT_IOC_ENABLE)?;
        work();
        self.ioctl(PERF_EVENT_IOC_DISABLE)?;
        Ok((self.read()? - before).saturating_sub(self.overhead))
    }

    fn ioctl(&self, request: libc::c_ulong) -> Result<(), String> {
        // SAFETY: a valid perf event descriptor; these requests take no argument.
        if unsafe { libc::ioctl(self.fd.as_raw_fd(), request, 0) } != 0 {
            return Err(format!("perf ioctl: {}", io::Error::last_os_error()));
        }
        Ok(())
    }

    fn read(&self) -> Result<u64, String> {
        let mut value = 0u64;
        // SAFETY: reads 8 bytes into `value`, which is 8 bytes long.
        let n = unsafe { libc::read(self.fd.as_raw_fd(), (&raw mut value).cast(), 8) };
        if n != 8 {
            return Err(format!(
                "reading the counter: {}",
                io::Error::last_os_error()
            ));
        }
        Ok(value)
    }
}

/// The tracepoint's id, mounting tracefs first if no one has.
fn tracepoint_id() -> io::Result<u64> {
    const EVENT: &str = "events/raw_syscalls/sys_enter/id";
    let roots = ["/sys/kernel/tracing", "/sys/kernel/debug/tracing"];
    let read = || {
        roots
            .iter()
            .find_map(|root| fs::read_to_string(format!("{root}/{EVENT}")).ok())
    };
    let text = match read() {
        Some(text) => text,
        None => {
            // SAFETY: NUL-terminated strings and no mount data.
            let rc = unsafe {
                libc::mount(
                    c"tracefs".as_ptr(),
                    c"/sys/kernel/tracing".as_ptr(),
                    c"tracefs".as_ptr(),
                    0,
                    std::ptr::null(),
                )
            };
            if rc != 0 {
                return Err(io::Error::last_os_error());
            }
            read().ok_or_else(|| io::Error::other("tracefs has no raw_syscalls events"))?
        }
    };
    text.trim().parse().map_err(io::Error::other)
}

verbs_test! {
    fn the_busy_poll_path_makes_no_syscalls_of_its_own() {
        let counter = SyscallCounter::open()
            .unwrap_or_else(|err| panic!("cannot count syscalls in this guest: {err}"));
        // The counter itself proves it works: these three must be seen.
        let seen = counter
            .count(|| {
                for _ in 0..3 {
                    // SAFETY: getppid has no preconditions.
                    std::hint::black_box(unsafe { libc::getppid() });
                }
            })
            .unwrap();
        assert_eq!(seen, 3, "the counter counts");

        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        let config = ReactorConfig {
            slot_size: 1024,
            ..ReactorConfig::default()
        };
        let mut reactor: Reactor<BoxedHandler> = Reactor::new(&pd, config).unwrap();
        let (ping, echo) = add_ping_pong(&pd, Sides::One(&mut reactor), 2_000, 32, true);
        reactor.run().unwrap();
        assert_eq!(ping.done.load(Ordering::Relaxed), 2_000, "warm-up completed");

        ping.limit.store(102_000, Ordering::Relaxed);
        let mut result = Ok(());
        let busy = counter.count(|| result = reactor.run()).unwrap();
        result.unwrap();
        assert_eq!(ping.done.load(Ordering::Relaxed), 102_000);
        println!("100000 round trips (SEND and WRITE_WITH_IMM) through run(): {busy} syscalls besides doorbells");
        assert_eq!(busy, 0, "the busy-poll path entered the kernel");

        let idle = counter
            .count(|| {
                for _ in 0..200_000 {
                    if let Err(err) = reactor.poll_once() {
                        panic!("idle pass: {err}");
                    }
                }
            })
            .unwrap();
        println!("200000 idle passes: {idle} syscalls besides doorbells");
        assert_eq!(idle, 0, "an idle pass entered the kernel");

        // run_for has to tell time; it reads the clock about every
        // CLOCK_READ_INTERVAL, not every so many passes (on a non-TSC
        // clocksource each reading is a syscall; on a TSC one, none is).
        // Idle passes are the cheapest, so the most frequent.
        let window = Duration::from_millis(400);
        let mut stopped = Ok(true);
        let timed = counter.count(|| stopped = reactor.run_for(window)).unwrap();
        assert!(!stopped.unwrap(), "run_for returned at its limit");
        let allowed = (window.as_micros() / CLOCK_READ_INTERVAL.as_micros()) as u64 * 2 + 16;
        println!(
            "run_for({window:?}) on an idle reactor: {timed} syscalls besides doorbells (at most {allowed})"
        );
        assert!(timed <= allowed, "run_for read the clock {timed} times in {window:?}");
        assert_eq!(
            ping.bad.load(Ordering::Relaxed) + echo.bad.load(Ordering::Relaxed),
            0,
            "every echo verified"
        );
    }
}
