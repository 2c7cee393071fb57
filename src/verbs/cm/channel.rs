//! The event channel: the descriptor every rdma_cm event of its ids
//! arrives on, read without blocking and acknowledged by dropping the event.

use std::collections::HashMap;
use std::fmt;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::ptr::{self, NonNull};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::{Duration, Instant};

use crate::error::{CmFailure, Error, Result, os_result};
use crate::sys;

use super::CmEventKind;
use super::event::CmEvent;
use super::id::{CmId, CmIdInner};
use super::last_errno;
use super::multicast::Group;

/// The channel itself, shared by its handle, every id on it and every
/// event taken from it; destroyed after all of them.
pub(crate) struct ChannelInner {
    raw: NonNull<sys::rdma_event_channel>,
    /// Held around every librdmacm call on the channel and its ids, except
    /// `rdma_destroy_id` and `rdma_ack_cm_event` (which run in `Drop`s and
    /// must not wait for it): the library writes an id's fields while it
    /// processes that id's events, so this keeps our reads of them, and
    /// our calls, from racing with it. A multicast group's drop takes it
    /// to leave the group, so no QP or event is dropped while it is held.
    ids: Mutex<Registry>,
}

/// The ids of a channel by address, so that an event finds its id.
///
/// Entries are weak: an id being dropped is no longer found (its events are
/// acknowledged at once), and a stale entry is replaced when librdmacm
/// reuses the address for a new id, which it can only do after the old id
/// was destroyed, when no event of the old one can come any more.
#[derive(Default)]
pub(crate) struct Registry {
    by_addr: HashMap<usize, Weak<CmIdInner>>,
    /// The multicast groups joined on the channel's ids, by the number
    /// each join gave librdmacm as its context (which its events carry),
    /// never reused. A group is removed when it is left; its events that
    /// arrive after are acknowledged at once.
    groups: HashMap<u64, Weak<Group>>,
}

impl Registry {
    pub(crate) fn insert(&mut self, id: &Arc<CmIdInner>) {
        if self.by_addr.len() >= 64 && self.by_addr.len().is_power_of_two() {
            self.by_addr.retain(|_, weak| weak.strong_count() > 0);
        }
        self.by_addr.insert(id.addr(), Arc::downgrade(id));
    }

    /// Forgets `id` (moved to another channel).
    pub(crate) fn remove(&mut self, id: &Arc<CmIdInner>) {
        if let Some(weak) = self.by_addr.get(&id.addr())
            && Weak::ptr_eq(weak, &Arc::downgrade(id))
        {
            self.by_addr.remove(&id.addr());
        }
    }

    fn find(&self, raw: *mut sys::rdma_cm_id) -> Option<Arc<CmIdInner>> {
        self.by_addr.get(&(raw as usize)).and_then(Weak::upgrade)
    }

    pub(crate) fn insert_group(&mut self, context: u64, group: &Arc<Group>) {
        self.groups.insert(context, Arc::downgrade(group));
    }

    pub(crate) fn remove_group(&mut self, context: u64) {
        self.groups.remove(&context);
    }

    /// Whether a join of `addr` on the id `id` is still held.
    pub(crate) fn holds_group(&self, id: &Arc<CmIdInner>, addr: std::net::SocketAddr) -> bool {
        self.groups
            .values()
            .filter_map(Weak::upgrade)
            .any(|group| group.is_of(id, addr))
    }

    fn find_group(&self, context: u64) -> Option<Arc<Group>> {
        self.groups.get(&context).and_then(Weak::upgrade)
    }
}

// SAFETY: librdmacm channels may be used from any thread; every call on it
// but the final destroy is serialised by `ids`.
unsafe impl Send for ChannelInner {}
// SAFETY: see Send.
unsafe impl Sync for ChannelInner {}

impl Drop for ChannelInner {
    fn drop(&mut self) {
        // SAFETY: every id and event holds an Arc to us, so all ids are
        // destroyed and all events acknowledged, as the call requires.
        unsafe { sys::rdma_destroy_event_channel(self.raw.as_ptr()) };
    }
}

impl ChannelInner {
    /// Takes the lock that serialises librdmacm calls on this channel.
    pub(crate) fn lock(&self) -> MutexGuard<'_, Registry> {
        self.ids.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn raw(&self) -> *mut sys::rdma_event_channel {
        self.raw.as_ptr()
    }

    fn fd(&self) -> RawFd {
        // SAFETY: the channel is live while `self` is; `fd` never changes.
        unsafe { (*self.raw.as_ptr()).fd }
    }
}

/// A connection-manager event channel: a file descriptor on which the
/// events of every [`CmId`] created from it arrive.
///
/// The descriptor is non-blocking: [`try_get_event`](Self::try_get_event)
/// never waits, [`get_event`](Self::get_event) waits in `poll(2)` with a
/// timeout, and [`fd`](Self::fd) can go into epoll, mio or tokio. Each event
/// is acknowledged when it is dropped.
///
/// ```no_run
/// use std::time::Duration;
/// use rdma_comm_core::verbs::cm::{CmEventKind, EventChannel};
///
/// let channel = EventChannel::new()?;
/// let mut id = channel.create_id()?;
/// let server = "10.77.0.1:7174".parse().unwrap();
/// id.resolve_addr(None, server, Duration::from_secs(2))?;
/// channel.expect(&id, CmEventKind::AddrResolved, Duration::from_secs(2))?;
/// id.resolve_route(Duration::from_secs(2))?;
/// channel.expect(&id, CmEventKind::RouteResolved, Duration::from_secs(2))?;
/// # Ok::<(), rdma_comm_core::Error>(())
/// ```
pub struct EventChannel {
    pub(super) inner: Arc<ChannelInner>,
}

impl fmt::Debug for EventChannel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EventChannel")
            .field("fd", &self.fd())
            .finish()
    }
}

/// The channel's descriptor, for epoll, mio or a reactor's wait.
impl AsFd for EventChannel {
    fn as_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the descriptor is the channel's own; `self` holds the
        // channel, which closes it only when destroyed, and the borrow
        // cannot outlive `self`.
        unsafe { BorrowedFd::borrow_raw(self.inner.fd()) }
    }
}

impl EventChannel {
    /// Opens a channel (`rdma_create_event_channel`) and makes it
    /// non-blocking.
    pub fn new() -> Result<Self> {
        // SAFETY: no arguments; the channel is destroyed in ChannelInner::drop.
        let raw = unsafe { sys::rdma_create_event_channel() };
        let raw = NonNull::new(raw).ok_or_else(|| Error::Cm {
            op: "rdma_create_event_channel (is the rdma_ucm module loaded?)",
            peer: None,
            cause: CmFailure::Errno(last_errno()),
        })?;
        let inner = Arc::new(ChannelInner {
            raw,
            ids: Mutex::new(Registry::default()),
        });
        let fd = inner.fd();
        // SAFETY: fcntl on the channel's own descriptor; no memory is passed.
        let flags = os_result(
            unsafe { libc::fcntl(fd, libc::F_GETFL) }.into(),
            "fcntl(F_GETFL) on an rdma_cm event channel",
        )?;
        // SAFETY: as above.
        let rc = unsafe { libc::fcntl(fd, libc::F_SETFL, flags as libc::c_int | libc::O_NONBLOCK) };
        os_result(rc.into(), "fcntl(F_SETFL) on an rdma_cm event channel")?;
        Ok(Self { inner })
    }

    /// Creates an id for reliable connections (`RDMA_PS_TCP`) whose events
    /// arrive on this channel.
    pub fn create_id(&self) -> Result<CmId> {
        CmId::create(&self.inner, false)
    }

    /// Creates an id for unreliable datagrams (`RDMA_PS_UDP`, rdma-core's
    /// `udaddy`) whose events arrive on this channel: its QP is a
    /// [`UdQueuePair`](super::super::UdQueuePair) ([`CmId::create_ud_qp`]),
    /// the active side's [`connect_ud`](CmId::connect_ud) is answered by an
    /// `Established` event carrying the peer's QP
    /// ([`CmEvent::ud_destination`](super::CmEvent::ud_destination)), and
    /// the passive side answers a request with
    /// [`ConnectRequest::accept_ud`](super::ConnectRequest::accept_ud).
    pub fn create_ud_id(&self) -> Result<CmId> {
        CmId::create(&self.inner, true)
    }

    /// The channel's file descriptor (readable when an event is pending).
    pub fn fd(&self) -> RawFd {
        self.inner.fd()
    }

    /// The next event, or `None` at once when none is pending.
    ///
    /// Events of ids that were dropped meanwhile are acknowledged and
    /// skipped (a connect request to a dropped listener is refused).
    pub fn try_get_event(&self) -> Result<Option<CmEvent>> {
        let mut guard = self.inner.lock();
        let taken = loop {
            let mut raw: *mut sys::rdma_cm_event = ptr::null_mut();
            // SAFETY: the channel is live and the fd non-blocking; `raw` is
            // a valid out-pointer; the event is ours until acknowledged.
            let rc = unsafe { sys::rdma_get_cm_event(self.inner.raw(), &mut raw) };
            if rc != 0 {
                break match last_errno() {
                    libc::EAGAIN | libc::EINTR => Ok(None),
                    errno => Err(Error::Cm {
                        op: "rdma_get_cm_event",
                        peer: None,
                        cause: CmFailure::Errno(errno),
                    }),
                };
            }
            let Some(raw) = NonNull::new(raw) else {
                continue;
            };
            // SAFETY: the event is valid until acknowledged below or by the
            // CmEvent that takes it.
            let (kind, id, listen_id) = unsafe {
                let ev = raw.as_ref();
                (CmEventKind::from_raw(ev.event), ev.id, ev.listen_id)
            };
            // A connect request counts against its listener; everything
            // else against the id it is about.
            let owner_raw = if kind == CmEventKind::ConnectRequest {
                listen_id
            } else {
                id
            };
            let owner = guard.find(owner_raw);
            let Some(owner) = owner else {
                if kind == CmEventKind::ConnectRequest {
                    // Nobody listens any more: the new id goes, which
                    // rejects the peer.
                    // SAFETY: the new id is ours; it has no QP and no event.
                    unsafe { sys::rdma_destroy_id(id) };
                }
                // SAFETY: the event is valid and acknowledged once.
                unsafe { sys::rdma_ack_cm_event(raw.as_ptr()) };
                continue;
            };
            // A multicast event holds its group, which is left only once
            // no event of it is unacknowledged (librdmacm's leave waits
            // for that).
            let group = if kind.is_multicast() {
                // SAFETY: librdmacm gives a multicast event the UD view of
                // the parameters and sets their private data to the join's
                // context, which is one of our numbers (never dereferenced).
                let context = unsafe { raw.as_ref().param.ud.private_data }.addr() as u64;
                let Some(group) = guard.find_group(context) else {
                    // The group was left meanwhile.
                    // SAFETY: the event is valid and acknowledged once.
                    unsafe { sys::rdma_ack_cm_event(raw.as_ptr()) };
                    continue;
                };
                Some(group)
            } else {
                None
            };
            break Ok(Some((raw, kind, owner, id, group)));
        };
        let Some((raw, kind, owner, id, group)) = taken? else {
            return Ok(None);
        };
        let request = if kind == CmEventKind::ConnectRequest {
            // SAFETY: librdmacm made this id for the request; from here on
            // it is ours (and destroyed by the CmId).
            Some(unsafe { CmId::adopt(&self.inner, &mut guard, id, owner.is_datagram()) })
        } else {
            None
        };
        drop(guard);
        // SAFETY: `raw` is an unacknowledged event; CmEvent acknowledges it.
        Ok(Some(unsafe {
            CmEvent::new(raw, kind, owner, request, group)
        }))
    }

    /// Waits up to `timeout` (for ever with `None`) for the next event;
    /// `Ok(None)` when none came in time.
    pub fn get_event(&self, timeout: Option<Duration>) -> Result<Option<CmEvent>> {
        // A timeout past the clock's range waits for ever.
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
        loop {
            if let Some(event) = self.try_get_event()? {
                return Ok(Some(event));
            }
            let wait_ms = match deadline {
                None => -1,
                Some(deadline) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Ok(None);
                    }
                    // Round up, so a sub-millisecond rest does not spin.
                    left.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32
                }
            };
            let mut pfd = libc::pollfd {
                fd: self.fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd for the call's duration.
            let rc = unsafe { libc::poll(&mut pfd, 1, wait_ms) };
            if rc < 0 && last_errno() != libc::EINTR {
                return Err(Error::Cm {
                    op: "poll on an rdma_cm event channel",
                    peer: None,
                    cause: CmFailure::Errno(last_errno()),
                });
            }
        }
    }

    /// Waits for the event `want` on `id`, for a blocking program that
    /// gives each connection a channel of its own.
    ///
    /// Any other event (a reject, an unreachable peer, an address or route
    /// error, a disconnect, or an event of another id) is returned as
    /// [`Error::Cm`] with [`CmFailure::Event`] naming it; no event within
    /// `timeout` as [`CmFailure::Timeout`]. The operation named in the error
    /// is the one `want` completes.
    pub fn expect(&self, id: &CmId, want: CmEventKind, timeout: Duration) -> Result<CmEvent> {
        let op = want.awaited_op();
        let Some(event) = self.get_event(Some(timeout))? else {
            return Err(Error::Cm {
                op,
                peer: id.peer_addr(),
                cause: CmFailure::Timeout(timeout.as_millis().min(u128::from(u32::MAX)) as u32),
            });
        };
        if event.kind() == want && event.is_for(id) {
            return Ok(event);
        }
        Err(Error::Cm {
            op,
            peer: id.peer_addr(),
            cause: CmFailure::Event {
                got: event.kind(),
                status: event.status(),
                expected: Some(want),
            },
        })
    }
}

impl AsRawFd for EventChannel {
    fn as_raw_fd(&self) -> RawFd {
        self.fd()
    }
}
