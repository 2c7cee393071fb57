//! Counting a thread's syscalls with a perf event on the
//! `raw_syscalls:sys_enter` tracepoint (in the guest, which lets us mount
//! tracefs and open tracepoint events).
#![allow(dead_code)]

use std::fs;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

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
pub struct SyscallCounter {
    fd: OwnedFd,
    /// What an empty window counts: the `DISABLE` ioctl that closes it.
    overhead: u64,
}

impl SyscallCounter {
    /// Counts the calling thread's syscalls other than `write`.
    pub fn open() -> Result<Self, String> {
        Self::open_for(0, Some(c"id != 1"))
    }

    /// Counts thread `tid`'s syscalls (0: the calling thread) that pass
    /// `filter` (None: all of them).
    pub fn open_for(tid: i32, filter: Option<&std::ffi::CStr>) -> Result<Self, String> {
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
        // call; pid `tid` (0: this thread) and cpu -1 count that thread on
        // any CPU.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_perf_event_open,
                &attr,
                tid,
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
        if let Some(filter) = filter
            // SAFETY: a valid descriptor and a NUL-terminated filter string.
            && unsafe { libc::ioctl(fd.as_raw_fd(), PERF_EVENT_IOC_SET_FILTER, filter.as_ptr()) } != 0
        {
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
    pub fn count(&self, work: impl FnOnce()) -> Result<u64, String> {
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

    pub fn read(&self) -> Result<u64, String> {
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
            // EBUSY: another test of this binary, running alongside, mounted
            // it first; its mount serves us too.
            let mounted = io::Error::last_os_error();
            match read() {
                Some(text) => text,
                None if rc != 0 => return Err(mounted),
                None => return Err(io::Error::other("tracefs has no raw_syscalls events")),
            }
        }
    };
    text.trim().parse().map_err(io::Error::other)
}

impl SyscallCounter {
    /// Starts counting (for a window that another thread's work fills).
    pub fn enable(&self) -> Result<(), String> {
        self.ioctl(PERF_EVENT_IOC_ENABLE)
    }

    /// Stops counting.
    pub fn disable(&self) -> Result<(), String> {
        self.ioctl(PERF_EVENT_IOC_DISABLE)
    }
}
