//! What a server is configured with: the hooks that export regions,
//! authorize and place each peer, report a failed handshake, and the
//! limits and timeouts of `ServerConfig`.

use std::any::Any;
use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use super::super::handshake::{PeerHello, Refusal};
use super::super::{
    AuthKey, CqChoice, DEFAULT_HANDSHAKE_TIMEOUT, DEFAULT_HELLO_TIMEOUT, Export, Transport,
};
use crate::error::{Error, Result};
use crate::verbs::{ProtectionDomain, QpConfig, SrqAttachment};

/// Builds the regions exported to one peer (called once per handshake,
/// after the peer was authenticated and admitted).
pub type ExportFn = dyn Fn(SocketAddr, &ProtectionDomain) -> Result<Vec<Export>> + Send + Sync;

/// Decides whether a peer is admitted, from its address and hello, before
/// anything is created for it. Runs on the peer's handshake thread, after
/// authentication when a key is configured.
pub type AuthorizeFn = dyn Fn(&PeerHello) -> std::result::Result<(), Refusal> + Send + Sync;

/// Chooses where one admitted peer's QPs go, from its hello: a runtime
/// with several reactors puts each peer on the CQs of the reactor that will
/// serve it. Runs on the peer's handshake thread right after admission
/// (after `authorize`), before anything is created; a `Refusal` reaches the
/// peer as a rejection.
pub type PlaceFn = dyn Fn(&PeerHello) -> std::result::Result<QpHome, Refusal> + Send + Sync;

/// Where one peer's QPs go (see [`ServerConfig::place`]).
pub struct QpHome {
    /// The CQ every QP of the peer reports to.
    pub cq: CqChoice,
    /// The shared receive queue they take receives from (`None`: their own).
    pub srq: Option<SrqAttachment>,
    /// Travels with the peer's endpoint ([`Endpoint::take_home_token`](super::super::Endpoint::take_home_token)) for
    /// whoever routes it; dropped with the handshake if it fails.
    pub token: Option<Box<dyn Any + Send>>,
}

impl fmt::Debug for QpHome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QpHome")
            .field("cq", &self.cq)
            .field("srq", &self.srq.is_some())
            .field("token", &self.token.is_some())
            .finish()
    }
}

/// Called with every failed or refused handshake as it happens (on the
/// thread that saw it), for a server that reports them without polling
/// [`ServerSession::take_failures`](super::ServerSession::take_failures).
pub type FailureFn = dyn Fn(&HandshakeFailure) + Send + Sync;

/// Most handshakes in progress whose table entries a server reserves when
/// it binds (a higher [`ServerConfig::max_pending_handshakes`] is allowed;
/// its tables grow past this then). Each pending handshake holds a thread
/// and two descriptors, so more than this at once is rare.
pub(super) const RESERVED_PENDING: usize = 1024;

/// Most handshake failures kept for [`ServerSession::take_failures`](super::ServerSession::take_failures); older
/// ones are dropped (and counted by [`ServerSession::failed_handshakes`](super::ServerSession::failed_handshakes)).
pub const MAX_RECORDED_FAILURES: usize = 256;

/// How the server builds each peer's endpoint, and what it lets a stranger
/// hold.
#[derive(Clone)]
pub struct ServerConfig {
    /// QP settings for every QP a client asks for.
    pub qp: QpConfig,
    /// CQ for every QP: private per QP, or one the caller polls.
    pub cq: CqChoice,
    /// Shared receive queue for every QP (`None`: each QP its own).
    pub srq: Option<SrqAttachment>,
    /// Most QPs one client may ask for (at most [`MAX_QPS`](super::super::wire::MAX_QPS)).
    pub max_qps: usize,
    /// Most peers connected at once (`None`: no limit). A peer holds its
    /// place from admission until its handshake fails, its endpoint (or
    /// the reactor session made of it) is dropped, or its endpoint's
    /// `check_peer` finds it gone, which a reactor's peer watch does
    /// (`ReactorConfig::peer_check_interval`, on by default; a Blocking or Epoll reactor also
    /// wakes on a peer's leaving). While every place is taken, newcomers
    /// are refused as busy and the listener keeps listening.
    pub max_peers: Option<usize>,
    /// Time one handshake may take from accept to ready, whatever the peer
    /// sends and however slowly. The deadline is absolute: time in this
    /// server's callbacks (`authorize`, `place`, `exports`) counts against
    /// it, and one that returns after it fails the handshake (the client
    /// sees a cut and tries again). Past it run only the callback it
    /// caught, `on_failure`, and up to 200 ms for a frame in flight or a
    /// refusal to go out.
    pub handshake_timeout: Duration,
    /// Time a connection has, within `handshake_timeout`, to prove itself:
    /// with a key, to say hello and prove the key; on an open server, to
    /// say hello and send its offer. On a keyed server a stranger holds a
    /// pending slot at most this long, plus up to 200 ms for a frame in
    /// flight or a refusal; on an open server one that sent an offer is
    /// given the rest of `handshake_timeout` to finish.
    pub hello_timeout: Duration,
    /// Handshakes in progress at once; connections beyond it are refused at
    /// once as busy (clients retry within their connect deadline). The
    /// server reserves its tables for this many when it binds (for at most
    /// 1024; past that they grow as needed).
    pub max_pending_handshakes: usize,
    /// Handshakes in progress at once from one IPv4 address or IPv6 /64, so
    /// that one host cannot take every pending slot.
    pub max_pending_per_address: usize,
    /// Established endpoints waiting for [`ServerSession::accept`](super::ServerSession::accept); a peer
    /// that would exceed it is refused before anything is created for it.
    pub accept_backlog: usize,
    /// The shared key clients must prove (and that this server proves to
    /// them). A server without one refuses to start unless
    /// `insecure_open` says so.
    pub auth_key: Option<AuthKey>,
    /// Serve without a key: anyone who reaches the port is admitted (to
    /// `authorize`, the limits and the exports). Exclusive with
    /// `auth_key`; a server bound so logs a warning. Meant for tests and
    /// closed networks ([`ServerConfig::insecure_open()`]).
    pub insecure_open: bool,
    /// Admission callback (none: everyone who authenticates is admitted).
    pub authorize: Option<Arc<AuthorizeFn>>,
    /// Regions to export to each peer (none by default).
    pub exports: Option<Arc<ExportFn>>,
    /// Chooses each admitted peer's CQ and SRQ (none: `cq` and `srq` for
    /// every peer).
    pub place: Option<Arc<PlaceFn>>,
    /// Told of every failed handshake as it happens (besides the log and
    /// [`ServerSession::take_failures`](super::ServerSession::take_failures)).
    pub on_failure: Option<Arc<FailureFn>>,
    /// TCP, or the RDMA connection manager (clients must use the same).
    /// Over the connection manager a connect request without this crate's
    /// session tag in its private data (an rping, say) is rejected at once,
    /// and one beyond the pending limits is rejected as busy.
    pub transport: Transport,
}

impl fmt::Debug for ServerConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerConfig")
            .field("qp", &self.qp)
            .field("cq", &self.cq)
            .field("srq", &self.srq.is_some())
            .field("max_qps", &self.max_qps)
            .field("max_peers", &self.max_peers)
            .field("handshake_timeout", &self.handshake_timeout)
            .field("hello_timeout", &self.hello_timeout)
            .field("max_pending_handshakes", &self.max_pending_handshakes)
            .field("max_pending_per_address", &self.max_pending_per_address)
            .field("accept_backlog", &self.accept_backlog)
            .field("auth_key", &self.auth_key)
            .field("insecure_open", &self.insecure_open)
            .field("authorize", &self.authorize.is_some())
            .field("exports", &self.exports.is_some())
            .field("place", &self.place.is_some())
            .field("on_failure", &self.on_failure.is_some())
            .finish()
    }
}

/// The defaults have no key and are not open: [`ServerSession::bind`](super::ServerSession::bind)
/// refuses them until [`ServerConfig::with_auth_key`] (or
/// [`ServerConfig::insecure_open`]) says which.
impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            qp: QpConfig::default(),
            cq: CqChoice::default(),
            srq: None,
            max_qps: 16,
            max_peers: None,
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
            hello_timeout: DEFAULT_HELLO_TIMEOUT,
            max_pending_handshakes: 64,
            max_pending_per_address: 8,
            accept_backlog: 64,
            auth_key: None,
            insecure_open: false,
            authorize: None,
            exports: None,
            place: None,
            on_failure: None,
            transport: Transport::Tcp,
        }
    }
}

impl ServerConfig {
    /// This configuration with clients required to prove `key`:
    /// `ServerConfig::default().with_auth_key(key)`, or
    /// `reactor.server_config(access).with_auth_key(key)`.
    pub fn with_auth_key(mut self, key: AuthKey) -> Self {
        self.auth_key = Some(key);
        self
    }

    /// The defaults, open to anyone who reaches the port: no key, every
    /// hello admitted (see the `insecure_open` field).
    pub fn insecure_open() -> Self {
        Self {
            insecure_open: true,
            ..Self::default()
        }
    }

    /// Refuses a server that would be open without having been told to.
    pub(super) fn check_access(&self) -> Result<()> {
        match (&self.auth_key, self.insecure_open) {
            (Some(_), false) | (None, true) => Ok(()),
            (None, false) => Err(Error::InvalidArgument(
                "a server needs an auth_key; ServerConfig::insecure_open() serves anyone without one",
            )),
            (Some(_), true) => Err(Error::InvalidArgument(
                "a server has either an auth_key or insecure_open, not both",
            )),
        }
    }
}

/// A handshake that did not produce an endpoint. The server logs it and
/// keeps serving.
#[derive(Debug)]
pub struct HandshakeFailure {
    /// Who connected.
    pub peer: SocketAddr,
    /// What went wrong.
    pub error: Error,
}
