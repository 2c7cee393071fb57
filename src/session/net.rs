//! Socket plumbing the standard library lacks.
//!
//! Waiting for a listener or a wake-up, whichever comes first: the accept
//! thread sleeps in `poll(2)` on both, so stopping it needs no connection
//! to itself (which a firewall or an unreachable listen address can refuse).
//! And TCP keepalive on control connections, so a peer that vanished
//! without a FIN or RST (power loss, a cut link) is noticed.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

/// The sending half of a wake-up; cheap to share between threads.
#[derive(Debug)]
pub(super) struct Waker(UnixStream);

/// The receiving half, polled beside a listener.
#[derive(Debug)]
pub(super) struct WakeReceiver(UnixStream);

pub(super) fn wake_pair() -> io::Result<(Waker, WakeReceiver)> {
    let (tx, rx) = UnixStream::pair()?;
    tx.set_nonblocking(true)?;
    rx.set_nonblocking(true)?;
    Ok((Waker(tx), WakeReceiver(rx)))
}

impl Waker {
    /// Wakes the receiver (a full socket buffer means it is awake already).
    /// Once the receiver is gone (the accept thread ended, at its peer
    /// limit say) this does nothing: the standard library writes to a Unix
    /// socket with `MSG_NOSIGNAL`, so no SIGPIPE reaches a process that
    /// does not ignore it (tested below).
    pub(super) fn wake(&self) {
        let _ = (&self.0).write(&[1]);
    }
}

impl WakeReceiver {
    /// Blocks until `fd` is readable or a wake-up came; returns whether a
    /// wake-up came (and consumes them).
    pub(super) fn wait(&self, fd: &impl AsFd) -> io::Result<bool> {
        let mut fds = [
            libc::pollfd {
                fd: fd.as_fd().as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: self.0.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: `fds` is a valid array of two initialised pollfd entries
        // that outlives the call; both descriptors are open (borrowed above).
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, -1) };
        if rc < 0 {
            let err = io::Error::last_os_error();
            return if err.kind() == io::ErrorKind::Interrupted {
                Ok(false)
            } else {
                Err(err)
            };
        }
        let woken = fds[1].revents != 0;
        if woken {
            let mut sink = [0u8; 64];
            while matches!((&self.0).read(&mut sink), Ok(n) if n > 0) {}
        }
        Ok(woken)
    }
}

/// `timeout` as `poll(2)`'s and `epoll_wait(2)`'s milliseconds: rounded
/// up, so a deadline less than a millisecond away does not become a zero
/// timeout that returns at once until it passes; -1 (no timeout) from
/// [`i32::MAX`] ms on, which [`Duration::MAX`] is.
pub(crate) fn poll_timeout_ms(timeout: Duration) -> libc::c_int {
    match timeout.as_nanos().div_ceil(1_000_000) {
        ms if ms >= i32::MAX as u128 => -1,
        ms => ms as libc::c_int,
    }
}

/// Blocks until `fd` is readable (or hung up) or `timeout` passes, whichever
/// comes first ([`Duration::MAX`]: no timeout; a signal ends it early, as a
/// timeout would).
pub(super) fn wait_readable(fd: &impl AsFd, timeout: Duration) -> io::Result<()> {
    let mut entry = libc::pollfd {
        fd: fd.as_fd().as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = poll_timeout_ms(timeout);
    // SAFETY: one initialised pollfd that outlives the call; the descriptor
    // is open (borrowed above).
    let rc = unsafe { libc::poll(&mut entry, 1, ms) };
    if rc < 0 {
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
    Ok(())
}

/// Probes an idle control connection after `idle`, then every `interval`,
/// and gives up after `probes` unanswered probes; unacknowledged data also
/// fails the connection after `idle + probes * interval`.
pub(super) fn keepalive(
    stream: &TcpStream,
    idle: Duration,
    interval: Duration,
    probes: u32,
) -> io::Result<()> {
    let secs = |d: Duration| d.as_secs().clamp(1, i32::MAX as u64) as libc::c_int;
    let user_timeout = (idle + interval * probes).as_millis().min(u32::MAX as u128) as libc::c_uint;
    set(stream, libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1)?;
    set(stream, libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, secs(idle))?;
    set(
        stream,
        libc::IPPROTO_TCP,
        libc::TCP_KEEPINTVL,
        secs(interval),
    )?;
    set(
        stream,
        libc::IPPROTO_TCP,
        libc::TCP_KEEPCNT,
        probes.max(1) as libc::c_int,
    )?;
    set(
        stream,
        libc::IPPROTO_TCP,
        libc::TCP_USER_TIMEOUT,
        user_timeout as libc::c_int,
    )
}

fn set(
    stream: &TcpStream,
    level: libc::c_int,
    name: libc::c_int,
    value: libc::c_int,
) -> io::Result<()> {
    // SAFETY: the descriptor is open (borrowed from `stream`) and `value`
    // is a live c_int whose size is passed along.
    let rc = unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            level,
            name,
            (&value as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;

    thread_local! {
        /// SIGPIPEs delivered to this thread (a SIGPIPE goes to the thread
        /// that wrote).
        static SIGPIPES: Cell<u32> = const { Cell::new(0) };
    }

    extern "C" fn count_sigpipe(_: libc::c_int) {
        SIGPIPES.with(|count| count.set(count.get() + 1));
    }

    #[test]
    fn waking_a_receiver_that_is_gone_raises_no_sigpipe() {
        // Counted instead of ignored while this runs (a SIGPIPE of another
        // test's thread is counted on that thread, and then ignored as
        // before: its write fails with EPIPE either way).
        // SAFETY: valid sigaction values; the handler only touches a
        // thread-local counter.
        let previous = unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = count_sigpipe as extern "C" fn(libc::c_int) as usize;
            let mut previous: libc::sigaction = std::mem::zeroed();
            libc::sigaction(libc::SIGPIPE, &action, &mut previous);
            previous
        };
        let (waker, receiver) = wake_pair().unwrap();
        waker.wake();
        drop(receiver);
        waker.wake();
        let after_wake = SIGPIPES.with(Cell::get);
        // The control: write(2) to the same broken socket raises one.
        let byte = 1u8;
        // SAFETY: the descriptor is open while `waker` lives; the buffer is
        // one readable byte.
        let _ = unsafe { libc::write(waker.0.as_raw_fd(), (&raw const byte).cast(), 1) };
        let after_write = SIGPIPES.with(Cell::get);
        // SAFETY: restores the action saved above.
        unsafe { libc::sigaction(libc::SIGPIPE, &previous, std::ptr::null_mut()) };
        assert_eq!(
            after_wake, 0,
            "a wake-up after the receiver left raised SIGPIPE"
        );
        assert_eq!(after_write, 1, "the check sees a SIGPIPE");
    }
}
