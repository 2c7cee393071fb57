//! Sleeping until completions arrive, for the Blocking and Epoll event modes.
//!
//! Blocking waits on the one completion channel all CQs share, plus a wake
//! eventfd, with `poll(2)`. Epoll keeps one channel per CQ in an epoll set
//! (plus the eventfd); that epoll fd is what users embed in their own loops.
//! Either way a wait only starts after the CQs were armed and polled once
//! more, so a completion that raced the arming is never slept through.
//!
//! Peers' control connections can be watched too ([`Waiter::watch`]): a wait
//! that one of them ends reports its token, so the reactor looks at that
//! peer only, and an idle reactor needs no timer to notice a peer leaving.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::time::Duration;

use crate::error::{Result, os_result};
use crate::session::net::poll_timeout_ms;
use crate::verbs::CompletionChannel;

use super::EventMode;

/// Most events one epoll wait returns (and watched fds reported per wait).
pub(crate) const MAX_EVENTS: usize = 16;

/// Marks the epoll data of a watched fd (channels and the waker carry
/// their fd, which is below 2^31).
const WATCHED: u64 = 1 << 63;

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
    /// Blocking mode: the channel, the waker, then the watched fds.
    poll_fds: Vec<libc::pollfd>,
    /// Tokens of the watched fds, in `poll_fds` order after the fixed ones.
    tokens: Vec<u64>,
    /// Fixed entries at the front of `poll_fds`.
    fixed: usize,
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
            tokens: Vec::new(),
            fixed: 0,
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
                waiter.fixed = waiter.poll_fds.len();
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

    /// Adds `fd` to what a wait watches (event modes only; busy polling
    /// never waits); a wait it ends reports `token` (below 2^63).
    pub(crate) fn watch(&mut self, fd: RawFd, token: u64) -> Result<()> {
        match (self.mode, &self.epoll) {
            (EventMode::Blocking, _) => {
                self.poll_fds.push(libc::pollfd {
                    fd,
                    events: libc::POLLIN,
                    revents: 0,
                });
                self.tokens.push(token);
            }
            (EventMode::Epoll, Some(epoll)) => {
                let mut event = libc::epoll_event {
                    events: libc::EPOLLIN as u32,
                    u64: WATCHED | token,
                };
                // SAFETY: valid epoll fd, a descriptor the caller keeps open
                // while it is watched, a valid event pointer.
                let rc = unsafe {
                    libc::epoll_ctl(epoll.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut event)
                };
                os_result(rc.into(), "epoll_ctl(ADD) of a peer's control connection")?;
            }
            _ => {}
        }
        Ok(())
    }

    /// Stops watching `fd` (before it is closed).
    pub(crate) fn unwatch(&mut self, fd: RawFd) {
        match (self.mode, &self.epoll) {
            (EventMode::Blocking, _) => {
                if let Some(at) = self.poll_fds[self.fixed..].iter().position(|p| p.fd == fd) {
                    self.poll_fds.swap_remove(self.fixed + at);
                    self.tokens.swap_remove(at);
                }
            }
            (EventMode::Epoll, Some(epoll)) => {
                let mut event = libc::epoll_event { events: 0, u64: 0 };
                // SAFETY: valid epoll fd and event pointer; a descriptor
                // that is not in the set only makes the call fail.
                unsafe { libc::epoll_ctl(epoll.as_raw_fd(), libc::EPOLL_CTL_DEL, fd, &mut event) };
            }
            _ => {}
        }
    }

    /// Sleeps until a channel, the waker or a watched fd fires, or
    /// `timeout` passes ([`Duration::MAX`]: no timeout). The tokens of the
    /// watched fds that fired go to `fired` (at most [`MAX_EVENTS`]).
    pub(crate) fn wait(&mut self, timeout: Duration, fired: &mut Vec<u64>) -> Result<()> {
        fired.clear();
        let ms = poll_timeout_ms(timeout);
        let rc = match (self.mode, &self.epoll) {
            (EventMode::Epoll, Some(epoll)) => {
                let mut events = [libc::epoll_event { events: 0, u64: 0 }; MAX_EVENTS];
                // SAFETY: valid epoll fd and a buffer of MAX_EVENTS events.
                let rc = unsafe {
                    libc::epoll_wait(
                        epoll.as_raw_fd(),
                        events.as_mut_ptr(),
                        events.len() as i32,
                        ms,
                    )
                };
                for event in events.iter().take(rc.max(0) as usize) {
                    let data = event.u64;
                    if data & WATCHED != 0 {
                        fired.push(data & !WATCHED);
                    }
                }
                rc
            }
            (EventMode::Blocking, _) => {
                // SAFETY: poll_fds is a valid array of pollfd.
                let rc = unsafe {
                    libc::poll(
                        self.poll_fds.as_mut_ptr(),
                        self.poll_fds.len() as libc::nfds_t,
                        ms,
                    )
                };
                if rc > 0 {
                    let watched = self.poll_fds[self.fixed..].iter().zip(&self.tokens);
                    for (entry, &token) in watched {
                        if entry.revents != 0 && fired.len() < MAX_EVENTS {
                            fired.push(token);
                        }
                    }
                }
                rc
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
