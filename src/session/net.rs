//! Socket plumbing the standard library lacks.
//!
//! Waiting for a listener or a wake-up, whichever comes first: the accept
//! thread sleeps in `poll(2)` on both, so stopping it needs no connection
//! to itself (which a firewall or an unreachable listen address can refuse).
//! And TCP keepalive on control connections, so a peer that vanished
//! without a FIN or RST (power loss, a cut link) is noticed.

use std::io::{self, Read};
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
    /// limit say) this does nothing: sent with `MSG_NOSIGNAL`, as a plain
    /// write would raise SIGPIPE in a process that does not ignore it
    /// (only newer standard libraries write Unix sockets that way).
    pub(super) fn wake(&self) {
        let byte = 1u8;
        // SAFETY: the descriptor is open while `self.0` lives, and the
        // buffer is one readable byte on our stack.
        let _ = unsafe {
            libc::send(
                self.0.as_raw_fd(),
                (&raw const byte).cast(),
                1,
                libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
            )
        };
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
    use super::*;

    /// Blocks SIGPIPE for this thread, runs `f`, and returns whether `f`
    /// raised one: a blocked SIGPIPE stays pending (Linux keeps blocked
    /// signals even while ignored), where it is seen and taken back. Only
    /// this thread's mask changes, never the process's disposition.
    fn raises_sigpipe(f: impl FnOnce()) -> bool {
        // SAFETY: sigset_t values set up by sigemptyset/sigaddset; the
        // masks are this thread's; sigtimedwait with a zero timeout only
        // takes back a SIGPIPE already pending.
        unsafe {
            let mut pipe: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut pipe);
            libc::sigaddset(&mut pipe, libc::SIGPIPE);
            let mut old: libc::sigset_t = std::mem::zeroed();
            assert_eq!(libc::pthread_sigmask(libc::SIG_BLOCK, &pipe, &mut old), 0);
            f();
            let mut pending: libc::sigset_t = std::mem::zeroed();
            assert_eq!(libc::sigpending(&mut pending), 0);
            let raised = libc::sigismember(&pending, libc::SIGPIPE) == 1;
            if raised {
                let now = libc::timespec {
                    tv_sec: 0,
                    tv_nsec: 0,
                };
                libc::sigtimedwait(&pipe, std::ptr::null_mut(), &now);
            }
            assert_eq!(
                libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut()),
                0
            );
            raised
        }
    }

    #[test]
    fn waking_a_receiver_that_is_gone_raises_no_sigpipe() {
        let (waker, receiver) = wake_pair().unwrap();
        waker.wake();
        drop(receiver);
        assert!(
            !raises_sigpipe(|| waker.wake()),
            "a wake-up after the receiver left raised SIGPIPE"
        );
        // The control: write(2) to the same broken socket raises one.
        let byte = 1u8;
        assert!(
            raises_sigpipe(|| {
                // SAFETY: the descriptor is open while `waker` lives; the
                // buffer is one readable byte.
                unsafe { libc::write(waker.0.as_raw_fd(), (&raw const byte).cast(), 1) };
            }),
            "the check sees a SIGPIPE"
        );
    }
}
