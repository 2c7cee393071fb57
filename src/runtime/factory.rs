//! Building each session's handler on the reactor thread that will own it,
//! so a handler need not be `Send` (it may hold `Rc`s, or state shared by
//! the sessions of one reactor only).

use std::net::SocketAddr;

use crate::error::{Error, Result};
use crate::reactor::{ConnId, Ctx, DatagramId, DatagramSource, Handler, Idle, SessionId};
use crate::session::{Endpoint, PeerHello, PeerStatus};
use crate::verbs::{UdQueuePair, WorkCompletion};

use super::port::Seat;

/// A session about to be served, as its handler's factory sees it.
#[derive(Debug)]
pub struct NewSession<'a> {
    /// The reactor that will serve it.
    pub reactor: usize,
    /// The connected endpoint: the peer's address, its regions, ours.
    pub endpoint: &'a Endpoint,
    /// What the peer said in its hello (sessions a listener accepted).
    pub hello: Option<&'a PeerHello>,
}

/// A datagram endpoint a reactor opens as it starts
/// ([`RuntimeConfig::datagrams`](super::RuntimeConfig::datagrams)), as its
/// handler's factory sees it.
#[derive(Debug)]
pub struct NewDatagram<'a> {
    /// The reactor that serves it.
    pub reactor: usize,
    /// Its id on that reactor: what its handler, and the sessions' handlers
    /// of the same reactor, send datagrams with
    /// ([`Ctx::send_datagram`](crate::reactor::Ctx::send_datagram)).
    pub id: DatagramId,
    /// Its UD QP: what peers need to reach it
    /// ([`UdQueuePair::endpoint`]) and the destinations it sends to.
    pub qp: &'a UdQueuePair,
}

/// Builds handlers; runs on the reactor threads (so it is shared: `Sync`),
/// each handler on the thread of the reactor that serves its session. A
/// handler that calls [`Ctx::stop`] stops its reactor; the handlers of the
/// sessions a stopping reactor still serves come back through
/// [`stopped`](Self::stopped).
///
/// Any `Fn(&NewSession) -> Result<H>` is a factory:
///
/// ```no_run
/// # use rdma_comm_core::reactor::*;
/// # use rdma_comm_core::runtime::*;
/// struct Echo;
/// impl Handler for Echo {
///     fn on_message(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, data: &[u8], imm: Option<u32>) {
///         let _ = ctx.send(conn, data, imm);
///     }
/// }
/// let factory = |_: &NewSession<'_>| Ok::<_, rdma_comm_core::Error>(Echo);
/// # let _ = factory;
/// ```
pub trait HandlerFactory: Send + Sync + 'static {
    /// The handler of one session.
    type Handler: Handler + 'static;

    /// The handler for `session`. An error refuses the session: its
    /// endpoint is dropped (telling the peer goodbye) and
    /// [`refused`](Self::refused) is told why.
    fn build(&self, session: &NewSession<'_>) -> Result<Self::Handler>;

    /// The handler of a datagram endpoint its reactor opens as it starts
    /// ([`RuntimeConfig::datagrams`](super::RuntimeConfig::datagrams)),
    /// built on that reactor's thread before it serves anything. An error
    /// stops the runtime from starting ([`Runtime::start`](super::Runtime::start)
    /// returns it). Refuses by default: a runtime with datagram endpoints
    /// needs a factory that builds their handlers.
    fn build_datagram(&self, datagram: &NewDatagram<'_>) -> Result<Self::Handler> {
        let _ = datagram;
        Err(Error::InvalidArgument(
            "RuntimeConfig::datagrams: the handler factory builds no datagram handlers (implement HandlerFactory::build_datagram)",
        ))
    }

    /// A session that reached `reactor` was not served: `build` or the
    /// reactor refused it (its QPs not on the reactor's CQs, no room left).
    /// Logs by default.
    fn refused(&self, reactor: usize, peer: SocketAddr, error: &Error) {
        log::warn!("reactor {reactor} did not take the session of {peer}: {error}");
    }

    /// Reactor `reactor` stopped while it still served a session: its
    /// handler comes back here, on the reactor's thread, for results it
    /// holds (after the session's QPs are destroyed and its peer told
    /// goodbye). A session removed before (`Ctx::remove_session`) drops its
    /// handler then. Drops it by default.
    fn stopped(&self, reactor: usize, handler: Self::Handler) {
        let _ = (reactor, handler);
    }

    /// Reactor `reactor` stopped (or failed to start) with datagram
    /// endpoint `id` open: its handler comes back here, on the reactor's
    /// thread, after the sessions' and after the endpoints' QPs are gone.
    /// Hands it to [`stopped`](Self::stopped) by default.
    fn datagram_stopped(&self, reactor: usize, id: DatagramId, handler: Self::Handler) {
        let _ = id;
        self.stopped(reactor, handler);
    }
}

impl<F, H> HandlerFactory for F
where
    F: Fn(&NewSession<'_>) -> Result<H> + Send + Sync + 'static,
    H: Handler + 'static,
{
    type Handler = H;

    fn build(&self, session: &NewSession<'_>) -> Result<H> {
        self(session)
    }
}

/// A handler and the seat that counts its session on its reactor (none
/// for a datagram endpoint's, which is no session).
pub(crate) struct Seated<H> {
    pub(crate) handler: H,
    pub(crate) _seat: Option<Seat>,
}

impl<H: Handler> Handler for Seated<H> {
    #[inline]
    fn on_established(&mut self, ctx: &mut Ctx<'_>, conn: ConnId) {
        self.handler.on_established(ctx, conn)
    }
    #[inline]
    fn on_message(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, data: &[u8], imm: Option<u32>) {
        self.handler.on_message(ctx, conn, data, imm)
    }
    #[inline]
    fn on_write_imm(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, imm: u32, len: u32) {
        self.handler.on_write_imm(ctx, conn, imm, len)
    }
    fn on_writable(&mut self, ctx: &mut Ctx<'_>, conn: ConnId) {
        self.handler.on_writable(ctx, conn)
    }
    #[inline]
    fn on_send_complete(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, seq: u32) {
        self.handler.on_send_complete(ctx, conn, seq)
    }
    #[inline]
    fn on_write_complete(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, seq: u32) {
        self.handler.on_write_complete(ctx, conn, seq)
    }
    #[inline]
    fn on_read_complete(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, seq: u32) {
        self.handler.on_read_complete(ctx, conn, seq)
    }
    #[inline]
    fn on_sends_complete(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, first: u32, count: u32) {
        self.handler.on_sends_complete(ctx, conn, first, count)
    }
    #[inline]
    fn on_writes_complete(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, first: u32, count: u32) {
        self.handler.on_writes_complete(ctx, conn, first, count)
    }
    #[inline]
    fn on_reads_complete(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, first: u32, count: u32) {
        self.handler.on_reads_complete(ctx, conn, first, count)
    }
    fn on_error(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, error: &Error) {
        self.handler.on_error(ctx, conn, error)
    }
    fn on_peer_gone(&mut self, ctx: &mut Ctx<'_>, session: SessionId, status: &PeerStatus) {
        self.handler.on_peer_gone(ctx, session, status)
    }
    #[inline]
    fn on_direct_completion(
        &mut self,
        ctx: &mut Ctx<'_>,
        conn: ConnId,
        id: u32,
        completion: &WorkCompletion,
    ) {
        self.handler.on_direct_completion(ctx, conn, id, completion)
    }
    #[inline]
    fn on_datagram(
        &mut self,
        ctx: &mut Ctx<'_>,
        dgram: DatagramId,
        source: &DatagramSource<'_>,
        data: &[u8],
    ) {
        self.handler.on_datagram(ctx, dgram, source, data)
    }
    fn on_datagram_error(&mut self, ctx: &mut Ctx<'_>, dgram: DatagramId, error: &Error) {
        self.handler.on_datagram_error(ctx, dgram, error)
    }
    #[inline]
    fn on_idle(&mut self, ctx: &mut Ctx<'_>) -> Idle {
        self.handler.on_idle(ctx)
    }
}
