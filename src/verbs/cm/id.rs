//! Connection-manager ids: the rdma_cm's sockets. Each is bound to a
//! device by address resolution, a bind or a connect request, and creates
//! the crate's own [`QueuePair`]s on that device.

use std::fmt;
use std::net::SocketAddr;
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use crate::error::{CmFailure, Error, Result};
use crate::sys;

use super::super::Context;
use super::EventChannel;
use super::addr::{self, RawAddr};
use super::channel::{ChannelInner, Registry};
use super::last_errno;

pub(super) const NOT_BOUND: &str = "the rdma_cm id is not bound to a device yet \
     (a bind to a local address, an address resolution or a connect request binds it)";

/// Names a [`CmId`] in the events of its channel
/// ([`CmEvent::token`](super::CmEvent::token)). Unique in the process and
/// never reused; it cannot be made from an integer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CmToken(u64);

impl CmToken {
    fn next() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        Self(NEXT.fetch_add(1, Ordering::Relaxed))
    }

    /// The number, for logs.
    pub fn get(self) -> u64 {
        self.0
    }
}

/// The id itself, shared by its handle, the events about it and the QPs
/// created on it: destroyed after the last of them.
pub(crate) struct CmIdInner {
    raw: NonNull<sys::rdma_cm_id>,
    token: CmToken,
    /// True for an id in the UDP port space (`RDMA_PS_UDP`): datagrams,
    /// a [`UdQueuePair`](super::super::UdQueuePair), and events carrying
    /// the UD view of their parameters.
    datagram: bool,
    /// The channel the id's events arrive on (changed only by
    /// [`CmId::migrate`], holding both channels' locks). Dropped after the
    /// id is destroyed: the channel goes last.
    channel: Mutex<Arc<ChannelInner>>,
}

// SAFETY: librdmacm ids may be used from any thread; every call on one but
// the final destroy holds its channel's lock.
unsafe impl Send for CmIdInner {}
// SAFETY: see Send.
unsafe impl Sync for CmIdInner {}

impl Drop for CmIdInner {
    fn drop(&mut self) {
        // SAFETY: the QPs created on this id hold an Arc to it, so they are
        // destroyed; each event about it holds one too, so every event
        // reported for it is acknowledged (rdma_destroy_id waits for that).
        // Nothing else calls into the id any more. The channel's lock is
        // not taken: a thread holding it never waits for this drop.
        let rc = unsafe { sys::rdma_destroy_id(self.raw.as_ptr()) };
        if rc != 0 {
            log::error!(
                "rdma_destroy_id: {}",
                std::io::Error::from_raw_os_error(last_errno())
            );
        }
    }
}

impl CmIdInner {
    /// The id's address, its key in the channel's registry.
    pub(crate) fn addr(&self) -> usize {
        self.raw.as_ptr() as usize
    }

    pub(crate) fn token(&self) -> CmToken {
        self.token
    }

    /// True for an id in the UDP port space.
    pub(crate) fn is_datagram(&self) -> bool {
        self.datagram
    }

    /// The raw id, for calls made holding its channel's lock.
    pub(super) fn raw(&self) -> *mut sys::rdma_cm_id {
        self.raw.as_ptr()
    }

    /// The channel the id is on now.
    pub(super) fn channel(&self) -> Arc<ChannelInner> {
        Arc::clone(&self.channel.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

/// An rdma_cm id: resolve and connect (active side), or bind, listen and
/// take connect requests (passive side). Reliable connections with a
/// [`QueuePair`](super::super::QueuePair) ([`EventChannel::create_id`](super::EventChannel::create_id)),
/// or datagrams with a [`UdQueuePair`](super::super::UdQueuePair)
/// ([`EventChannel::create_ud_id`](super::EventChannel::create_ud_id)).
///
/// Operations are asynchronous: each reports its outcome as an event on
/// the [`EventChannel`](super::EventChannel) the id was created from. The
/// id is destroyed when dropped, but not before the QPs created on it
/// ([`create_qp`](Self::create_qp)) and the events about it, which keep it
/// alive.
pub struct CmId {
    pub(super) inner: Arc<CmIdInner>,
    /// How far this handle has taken its connection: calls out of order
    /// are refused before they touch a QP.
    pub(super) progress: Progress,
}

/// Where an id's connection stands (see [`CmId::connect`],
/// [`CmId::establish`] and [`ConnectRequest::accept`](super::ConnectRequest::accept)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Progress {
    /// Not connecting.
    Idle,
    /// A connect request went out for the QP with this number.
    Connecting { qpn: u32 },
    /// Established or accepted.
    Connected,
}

impl fmt::Debug for CmId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CmId")
            .field("token", &self.inner.token)
            .field("datagram", &self.inner.datagram)
            .field("local", &self.local_addr())
            .field("peer", &self.peer_addr())
            .finish()
    }
}

impl CmId {
    /// A new id on `channel`: in the UDP port space (`RDMA_PS_UDP`) if
    /// `datagram`, else in the TCP one (`RDMA_PS_TCP`).
    pub(super) fn create(channel: &Arc<ChannelInner>, datagram: bool) -> Result<Self> {
        let space = if datagram {
            sys::RDMA_PS_UDP
        } else {
            sys::RDMA_PS_TCP
        };
        let mut registry = channel.lock();
        let mut raw: *mut sys::rdma_cm_id = ptr::null_mut();
        // SAFETY: the channel is live (we hold an Arc and its lock); `raw`
        // is a valid out-pointer; the id is destroyed in CmIdInner::drop.
        let rc = unsafe { sys::rdma_create_id(channel.raw(), &mut raw, ptr::null_mut(), space) };
        let raw = match NonNull::new(raw) {
            Some(raw) if rc == 0 => raw,
            _ => {
                return Err(Error::Cm {
                    op: "rdma_create_id",
                    peer: None,
                    cause: CmFailure::Errno(last_errno()),
                });
            }
        };
        Ok(Self::register(channel, &mut registry, raw, datagram))
    }

    /// Takes ownership of the id librdmacm made for a connect request to a
    /// listener in the UDP port space if `datagram`, else in the TCP one.
    ///
    /// # Safety
    /// `raw` must be the new id of a connect request just taken from
    /// `channel` (with its lock, `registry`, held since), owned by nobody
    /// else.
    pub(super) unsafe fn adopt(
        channel: &Arc<ChannelInner>,
        registry: &mut Registry,
        raw: *mut sys::rdma_cm_id,
        datagram: bool,
    ) -> Self {
        let raw = NonNull::new(raw).expect("a connect request carries its new id");
        Self::register(channel, registry, raw, datagram)
    }

    fn register(
        channel: &Arc<ChannelInner>,
        registry: &mut Registry,
        raw: NonNull<sys::rdma_cm_id>,
        datagram: bool,
    ) -> Self {
        let inner = Arc::new(CmIdInner {
            raw,
            token: CmToken::next(),
            datagram,
            channel: Mutex::new(Arc::clone(channel)),
        });
        registry.insert(&inner);
        Self {
            inner,
            progress: Progress::Idle,
        }
    }

    /// What names this id in its channel's events.
    pub fn token(&self) -> CmToken {
        self.inner.token
    }

    /// True for an id in the UDP port space ([`EventChannel::create_ud_id`](super::EventChannel::create_ud_id)),
    /// and for a connect request's id to a listener there.
    pub fn is_datagram(&self) -> bool {
        self.inner.datagram
    }

    /// Runs `call` on the raw id under the channel's lock and turns a
    /// non-zero result into [`Error::Cm`] with errno.
    pub(super) fn call(
        &self,
        op: &'static str,
        peer: Option<SocketAddr>,
        call: impl FnOnce(*mut sys::rdma_cm_id) -> libc::c_int,
    ) -> Result<()> {
        let channel = self.inner.channel();
        let _lock = channel.lock();
        if call(self.inner.raw.as_ptr()) == 0 {
            return Ok(());
        }
        Err(Error::Cm {
            op,
            peer: peer.or_else(|| self.peer_addr_locked()),
            cause: CmFailure::Errno(last_errno()),
        })
    }

    /// Binds the id to a local address (and so to a device, unless the
    /// address is a wildcard); a server's next step is [`listen`](Self::listen).
    pub fn bind(&mut self, addr: SocketAddr) -> Result<()> {
        let mut raw_addr = RawAddr::new(addr);
        // SAFETY: the id is live; the address is read during the call.
        self.call("rdma_bind_addr", Some(addr), |id| unsafe {
            sys::rdma_bind_addr(id, raw_addr.as_ptr())
        })
    }

    /// Listens for connect requests, which arrive on the channel as
    /// [`CmEventKind::ConnectRequest`](super::CmEventKind::ConnectRequest)
    /// events carrying a new id ([`CmEvent::take_request`](super::CmEvent::take_request)).
    ///
    /// `backlog` bounds only the requests not read yet: each one read is a
    /// kernel id the application holds until it answers, so a server that
    /// gathers requests before answering them must bound how many it holds
    /// (the session layer's pending-handshake limits do).
    pub fn listen(&mut self, backlog: u16) -> Result<()> {
        // SAFETY: the id is live.
        self.call("rdma_listen", None, |id| unsafe {
            sys::rdma_listen(id, libc::c_int::from(backlog))
        })
    }

    /// Starts resolving `dst` (and binding to `src`, or to the source the
    /// routing table picks); `AddrResolved` or `AddrError` follows within
    /// `timeout`.
    pub fn resolve_addr(
        &mut self,
        src: Option<SocketAddr>,
        dst: SocketAddr,
        timeout: Duration,
    ) -> Result<()> {
        let mut src = src.map(RawAddr::new);
        let mut dst_raw = RawAddr::new(dst);
        let src_ptr = src.as_mut().map_or(ptr::null_mut(), RawAddr::as_ptr);
        // SAFETY: the id is live; both addresses are read during the call.
        self.call("rdma_resolve_addr", Some(dst), |id| unsafe {
            sys::rdma_resolve_addr(id, src_ptr, dst_raw.as_ptr(), millis(timeout))
        })
    }

    /// Starts resolving the route to the resolved address; `RouteResolved`
    /// or `RouteError` follows within `timeout`.
    pub fn resolve_route(&mut self, timeout: Duration) -> Result<()> {
        self.bound_device(
            "rdma_resolve_route: the id has no address yet (resolve_addr and its AddrResolved come first)",
        )?;
        // SAFETY: the id is live and bound to a device (which the call
        // dereferences).
        self.call("rdma_resolve_route", None, |id| unsafe {
            sys::rdma_resolve_route(id, millis(timeout))
        })
    }

    /// The device context the id is bound to, lent by librdmacm: allocate
    /// the PD and CQs of the id's QP from it (or from a context of the same
    /// device from [`open_device`](super::open_device), which is the same
    /// one). It stays open while the returned `Context` or anything made
    /// from it lives, whatever happens to the id.
    pub fn context(&self) -> Result<Context> {
        let (verbs, _) = self.bound_device(NOT_BOUND)?;
        super::device::lent_context(verbs)
    }

    /// The local port the id is bound to, once it is bound to a device.
    pub fn port(&self) -> Option<u8> {
        self.bound_device(NOT_BOUND).ok().map(|(_, port)| port)
    }

    /// The id's device context and port, or `InvalidArgument(why)` when it
    /// has none yet.
    pub(super) fn bound_device(
        &self,
        why: &'static str,
    ) -> Result<(NonNull<sys::ibv_context>, u8)> {
        let channel = self.inner.channel();
        let _lock = channel.lock();
        // SAFETY: the id is live; librdmacm writes these fields only
        // during calls on this channel, which hold the lock we hold.
        let (verbs, port) = unsafe {
            let id = self.inner.raw.as_ref();
            (id.verbs, id.port_num)
        };
        NonNull::new(verbs)
            .map(|v| (v, port))
            .ok_or(Error::InvalidArgument(why))
    }

    /// The local address (after a bind, an address resolution, or for a
    /// request's id).
    pub fn local_addr(&self) -> Option<SocketAddr> {
        let channel = self.inner.channel();
        let _lock = channel.lock();
        // SAFETY: the id is live and its route fields are not written
        // while we hold the lock; the address is a sockaddr_storage union.
        unsafe { addr::read(sys::rdma_get_local_addr(self.inner.raw.as_ptr())) }
    }

    /// The peer's address (after an address resolution, or for a
    /// request's id).
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        let channel = self.inner.channel();
        let _lock = channel.lock();
        self.peer_addr_locked()
    }

    /// Runs `f` with the raw id and the peer's address, holding the
    /// channel's lock (as librdmacm calls on the id must).
    pub(super) fn locked<R>(
        &self,
        f: impl FnOnce(*mut sys::rdma_cm_id, Option<SocketAddr>) -> R,
    ) -> R {
        let channel = self.inner.channel();
        let _lock = channel.lock();
        f(self.inner.raw.as_ptr(), self.peer_addr_locked())
    }

    fn peer_addr_locked(&self) -> Option<SocketAddr> {
        // SAFETY: as in local_addr; the caller holds the lock.
        unsafe { addr::read(sys::rdma_get_peer_addr(self.inner.raw.as_ptr())) }
    }

    /// Moves the id to channel `to` (`rdma_migrate_id`): its later events
    /// arrive there. A server moves each connection's id from the
    /// listener's channel to one of its own, so that the connection's
    /// events (`Established`, `Disconnected`) are waited on apart from new
    /// requests.
    ///
    /// Only while nothing else holds the id: before a QP is created on it
    /// and with no event about it held (librdmacm would wait for that
    /// event's acknowledgement, which could then never come);
    /// `InvalidArgument` otherwise.
    pub fn migrate(&mut self, to: &EventChannel) -> Result<()> {
        let from = self.inner.channel();
        if Arc::ptr_eq(&from, &to.inner) {
            return Ok(());
        }
        // Both locks, in address order (two threads migrating between the
        // same channels in opposite directions cannot deadlock): no event
        // of either channel is read, and no call made on either, meanwhile.
        let from_first = Arc::as_ptr(&from) < Arc::as_ptr(&to.inner);
        let (mut old, mut new);
        if from_first {
            old = from.lock();
            new = to.inner.lock();
        } else {
            new = to.inner.lock();
            old = from.lock();
        }
        // Events and QPs take their reference to the id under its
        // channel's lock (an event) or through `&self` (a QP), neither of
        // which can happen now: a count of one is this handle alone.
        if Arc::strong_count(&self.inner) != 1 {
            return Err(Error::InvalidArgument(
                "rdma_migrate_id: a QP or an unacknowledged event holds the id",
            ));
        }
        // SAFETY: the id and both channels are live and we hold both
        // channels' locks; no event of the id is unacknowledged (above), so
        // the call does not wait.
        let rc = unsafe { sys::rdma_migrate_id(self.inner.raw.as_ptr(), to.inner.raw()) };
        if rc != 0 {
            return Err(Error::Cm {
                op: "rdma_migrate_id",
                peer: self.peer_addr_locked(),
                cause: CmFailure::Errno(last_errno()),
            });
        }
        old.remove(&self.inner);
        new.insert(&self.inner);
        *self
            .inner
            .channel
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Arc::clone(&to.inner);
        Ok(())
    }

    /// Disconnects (`rdma_disconnect`): both sides then get
    /// `Disconnected`. The QP is not touched (librdmacm moves only QPs it
    /// created to the error state): its owner moves it with
    /// [`QueuePair::set_error`](super::super::QueuePair::set_error) to flush
    /// what is posted, or drops it.
    ///
    /// `InvalidArgument` on a datagram id, which has no connection.
    pub fn disconnect(&mut self) -> Result<()> {
        if self.is_datagram() {
            return Err(Error::InvalidArgument(
                "rdma_disconnect: a datagram id has no connection to end",
            ));
        }
        // SAFETY: the id is live; librdmacm checks that it has a device.
        self.call("rdma_disconnect", None, |id| unsafe {
            sys::rdma_disconnect(id)
        })
    }
}

/// A timeout in the milliseconds the resolve calls take.
fn millis(timeout: Duration) -> libc::c_int {
    timeout.as_millis().clamp(1, libc::c_int::MAX as u128) as libc::c_int
}
