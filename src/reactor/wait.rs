//! Sleeping until completions arrive, for the Blocking and Epoll event modes.
//!
//! Blocking waits on the one completion channel all CQs share, plus a wake
//! eventfd, with `poll(2)`. Epoll keeps one channel per CQ in an epoll set
//! (plus the eventfd); that epoll fd is what users embed in their own loops.
//! Either way a wait only starts after the CQs were armed and polled once
//! more, so a completion that raced the arming is never slept through.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::time::Duration;

use crate::error::{Result, os_result};
use crate::verbs::CompletionChannel;

use super::EventMode;

/// Wakes a sleeping reactor from another thread.
#[derive(Debug, Clone)]
pub struct Waker {
    fd: Arc<OwnedFd>,
}

impl Waker {
    fn new() -> Result<Self> {
        // SAFETY: plain syscall; the returned descriptor is owned below.
        let rc = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        let fd = os_result(rc.into(), "eventfd for the reactor waker")? as RawFd;
        // SAFETY: `fd` is a fresh descriptor nobody else owns.
        Ok(Self {
            fd: Arc::new(unsafe { OwnedFd::from_raw_fd(fd) }),
        })
    }

    /// Makes the reactor's current or next wait return at once.
    pub fn wake(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a valid u64 to our eventfd; a full
        // counter (EAGAIN) already means a wake is pending.
        unsafe { libc::write(self.fd.as_raw_fd(), (&raw const one).cast(), 8) };
    }

    fn drain(&self) {
        let mut count: u64 = 0;
        // SAFETY: reads 8 bytes into a valid u64 from our non-blocking eventfd.
        unsafe { libc::read(self.fd.as_raw_fd(), (&raw mut count).cast(), 8) };
    }
}

pub(crate) struct Waiter {
    mode: EventMode,
    epoll: Option<OwnedFd>,
    poll_fds: Vec<libc::pollfd>,
    pub(crate) waker: Waker,
}

impl Waiter {
    pub(crate) fn new(mode: EventMode, channels: &[CompletionChannel]) -> Result<Self> {
        let waker = Waker::new()?;
        for channel in channels {
            channel.set_nonblocking(true)?;
        }
        let mut waiter = Self {
            mode,
            epoll: None,
            poll_fds: Vec::new(),
            waker,
        };
        match mode {
            EventMode::BusyPoll => {}
            EventMode::Blocking => {
                let fds = channels
                    .iter()
                    .map(|c| c.fd())
                    .chain([waiter.waker.fd.as_raw_fd()]);
                waiter.poll_fds = fds
                    .map(|fd| libc::pollfd {
                        fd,
                        events: libc::POLLIN,
                        revents: 0,
                    })
                    .collect();
            }
            EventMode::Epoll => {
                // SAFETY: plain syscall; the descriptor is owned below.
                let rc = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
                let epfd = os_result(rc.into(), "epoll_create1 for the reactor")? as RawFd;
                // SAFETY: a fresh descriptor nobody else owns.
                let epoll = unsafe { OwnedFd::from_raw_fd(epfd) };
                for fd in channels
                    .iter()
                    .map(|c| c.fd())
                    .chain([waiter.waker.fd.as_raw_fd()])
                {
                    let mut event = libc::epoll_event {
                        events: libc::EPOLLIN as u32,
                        u64: fd as u64,
                    };
                    // SAFETY: valid epoll fd, valid descriptor, valid event pointer.
                    let rc = unsafe { libc::epoll_ctl(epfd, libc::EPOLL_CTL_ADD, fd, &mut event) };
                    os_result(rc.into(), "epoll_ctl(ADD) of a completion channel")?;
                }
                waiter.epoll = Some(epoll);
            }
        }
        Ok(waiter)
    }

    /// The descriptor that becomes readable when the reactor has work: the
    /// epoll set in Epoll mode, the shared channel in Blocking mode.
    pub(crate) fn fd(&self) -> Option<RawFd> {
        match self.mode {
            EventMode::BusyPoll => None,
            EventMode::Blocking => self.poll_fds.first().map(|p| p.fd),
            EventMode::Epoll => self.epoll.as_ref().map(|e| e.as_raw_fd()),
        }
    }

    /// Sleeps until a channel or the waker fires, or `timeout` passes.
    pub(crate) fn wait(&mut self, timeout: Duration) -> Result<()> {
        let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
        let rc = match (self.mode, &self.epoll) {
            (EventMode::Epoll, Some(epoll)) => {
                let mut events = [libc::epoll_event { events: 0, u64: 0 }; 16];
                // SAFETY: valid epoll fd and a buffer of 16 events.
                unsafe {
                    libc::epoll_wait(
                        epoll.as_raw_fd(),
                        events.as_mut_ptr(),
                        events.len() as i32,
                        ms,
                    )
                }
            }
            (EventMode::Blocking, _) => {
                // SAFETY: poll_fds is a valid array of pollfd.
                unsafe {
                    libc::poll(
                        self.poll_fds.as_mut_ptr(),
                        self.poll_fds.len() as libc::nfds_t,
                        ms,
                    )
                }
            }
            _ => 0,
        };
        match os_result(rc.into(), "waiting for completion events") {
            Err(err) if err.errno() != Some(libc::EINTR) => return Err(err),
            _ => {}
        }
        self.waker.drain();
        Ok(())
    }
}
