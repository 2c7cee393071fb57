//! What a handler's callbacks may do ([`Ctx`]), and received messages held
//! past their callback ([`HeldRecv`]).

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::verbs::{Gid, LocalSlice, RemoteSlice, UdDestination};

use super::completions::Completions;
use super::conn::{Conn, ConnState, ForwardOrigin};
use super::datagram::{DatagramId, DatagramTable};
use super::table::ConnTable;
use super::{ConnId, SendError, SessionId};

/// What a callback may do: stage work on any connection of the reactor.
pub struct Ctx<'a> {
    pub(super) conns: &'a mut ConnTable,
    pub(super) stop: &'a AtomicBool,
    /// In `on_message`: the message's receive slot, until the handler holds it.
    pub(super) current: Option<HeldRecv>,
    /// Set when a call may have staged work or queued a repost, so an idle
    /// pass knows whether it has anything to flush.
    pub(super) touched: bool,
    /// The slot of the connection a completion callback was called for
    /// (`u32::MAX` outside one), which the reactor settles itself once the
    /// callback returns: what the callback stages on it does not list it
    /// for the pass's flush.
    pub(super) own: u32,
    /// Whether the callback staged work on [`own`](Self::own).
    pub(super) own_staged: bool,
    /// What callbacks leave for the end of the pass.
    pub(super) deferred: &'a mut Deferred,
    /// In `on_idle`: the reactor's CQs, lent for a spin ([`Ctx::spin`]).
    pub(super) loan: Option<&'a mut Completions>,
    /// The datagram endpoints ([`Ctx::send_datagram`]).
    pub(super) datagrams: &'a mut DatagramTable,
}

/// Work callbacks leave for the reactor to do after them.
#[derive(Debug, Default)]
pub(crate) struct Deferred {
    /// Sessions to remove after the pass.
    pub(crate) removals: Vec<SessionId>,
    /// SRQ slots of held messages whose connection is gone, to give back to
    /// the SRQ (capacity reserved for every SRQ slot: pushing never
    /// allocates).
    pub(crate) srq_returns: Vec<u32>,
    /// Connections whose doorbell rung alone (`Ctx::read_now`,
    /// `Ctx::write_now`) the device refused, and why: the next flush fails
    /// them (pushing allocates, on this error path only).
    pub(crate) refused: Vec<(ConnId, crate::Error)>,
    /// Doorbells rung alone so far (counted into `Counters::doorbells` and
    /// `Counters::requests` when the counters are read).
    pub(crate) lone_doorbells: u64,
}

/// A reactor's process-wide unique id (never reused).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ReactorId(pub(crate) u64);

impl ReactorId {
    pub(crate) fn next() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        Self(NEXT.fetch_add(1, Ordering::Relaxed))
    }
}

impl<'a> Ctx<'a> {
    #[inline(always)]
    pub(super) fn new(
        conns: &'a mut ConnTable,
        stop: &'a AtomicBool,
        deferred: &'a mut Deferred,
        datagrams: &'a mut DatagramTable,
    ) -> Self {
        Self {
            conns,
            stop,
            current: None,
            touched: false,
            own: u32::MAX,
            own_staged: false,
            deferred,
            loan: None,
            datagrams,
        }
    }
}

/// A received message whose receive slot the handler kept past `on_message`
/// with [`Ctx::hold`]. The slot is not reposted (so the peer gets one credit
/// fewer) until the message is [released](Ctx::release) or
/// [forwarded](Ctx::forward): holding messages is how a relay pushes
/// back on its upstream. Dropping it leaks the slot: for the connection's life
/// on its own ring, for the reactor's on the SRQ.
///
/// A held message belongs to the reactor and connection it arrived on: it
/// is neither `Clone` nor constructible outside the reactor, and a [`Ctx`]
/// of another reactor, or of a connection that took the removed one's
/// place, refuses it ([`SendError::Foreign`]).
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a held receive slot is only reposted by release or forward"]
pub struct HeldRecv {
    /// The connection it arrived on, whose id also names its reactor.
    conn: ConnId,
    slot: u32,
    /// The slot is one of the reactor's SRQ (it goes back there even if
    /// its connection is gone by the time the message is released).
    from_srq: bool,
    /// Payload bytes (at the start of the slot).
    len: u32,
}

impl HeldRecv {
    /// The connection the message arrived on.
    pub fn conn(&self) -> ConnId {
        self.conn
    }

    /// Payload length in bytes.
    pub fn len(&self) -> usize {
        self.len as usize
    }

    /// True for a message with no payload.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The receive slot it holds (tests of who gets a slot back when).
    #[cfg(test)]
    pub(crate) fn slot(&self) -> u32 {
        self.slot
    }
}

impl fmt::Debug for Ctx<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ctx")
            .field("conns", &self.conns.len())
            .field("reactor", &self.conns.owner())
            .finish()
    }
}

impl Ctx<'_> {
    #[inline]
    fn conn(&mut self, conn: ConnId) -> Result<&mut Conn, SendError> {
        self.touched = true;
        self.target(conn).ok_or(SendError::Closed)
    }

    /// Connection `conn`, to stage work on: listed for the pass's flush,
    /// unless it is the one the callback was called for, which the reactor
    /// flushes after the callback (noted in `own_staged`).
    #[inline(always)]
    fn target(&mut self, conn: ConnId) -> Option<&mut Conn> {
        // The slot alone decides: the lookup checks the rest of the id.
        if conn.key().index == self.own {
            self.own_staged = true;
            return self.conns.get_mut_quiet(conn.key());
        }
        self.conns.get_mut(conn.key())
    }

    /// A received message of `len` payload bytes whose slot the handler may
    /// hold, for `on_message`.
    pub(super) fn offer(&mut self, conn: ConnId, slot: u32, len: u32, from_srq: bool) {
        self.current = Some(HeldRecv {
            conn,
            slot,
            from_srq,
            len,
        });
    }

    /// The connection a held message came from, if it is this reactor's
    /// and that connection is still the one it arrived on.
    fn held_origin(&self, held: &HeldRecv) -> Option<&Conn> {
        // The lookup checks the key's owner (the reactor) too.
        self.conns.get(held.conn.key())
    }

    /// Asks the reactor to remove `session` after this pass: its QPs are
    /// destroyed, its connections, handler and peer link dropped (which
    /// tells a session-layer peer goodbye). For a server whose peer left.
    pub fn remove_session(&mut self, session: SessionId) {
        if !self.deferred.removals.contains(&session) {
            self.deferred.removals.push(session);
        }
    }

    /// Asks the reactor to remove datagram endpoint `dgram` after this
    /// pass, as [`Reactor::remove_datagram`](super::Reactor::remove_datagram)
    /// does; its handler is then dropped. Until then it still receives,
    /// and what it staged this pass is dropped with it. An id of another
    /// reactor, or of an endpoint removed already, is ignored.
    pub fn remove_datagram(&mut self, dgram: DatagramId) {
        self.datagrams.mark_for_removal(dgram);
    }

    /// Stages a datagram of `data` (copied into a registered send slot of
    /// endpoint `dgram`) to `to`, a destination made by a UD QP of the same
    /// protection domain (the endpoint's own, from
    /// [`Reactor::datagram_qp`](super::Reactor::datagram_qp) or
    /// [`Reactor::add_datagram`](super::Reactor::add_datagram)'s `make`);
    /// it goes out with the endpoint's other datagrams of this pass, one
    /// doorbell, when the pass ends. Refused with [`SendError::WouldBlock`]
    /// while the send queue is full (the next completions make room),
    /// [`SendError::TooLarge`] above the port's MTU, [`SendError::Closed`]
    /// for a failed endpoint or one of another reactor, and
    /// [`SendError::Invalid`] for a destination of another protection
    /// domain. Nothing tells the sender whether a datagram arrived.
    #[inline]
    pub fn send_datagram(
        &mut self,
        dgram: DatagramId,
        to: &UdDestination,
        data: &[u8],
    ) -> Result<(), SendError> {
        self.datagrams.stage(dgram, to, data)
    }

    /// Joins datagram endpoint `dgram` to multicast group `group` (see
    /// [`Reactor::join`](super::Reactor::join)), from a callback: how a
    /// runtime's handlers, which have no `Reactor`, change what they
    /// subscribe to. A control-path call (the host's IP membership and the
    /// device's attach are syscalls), not one for every message.
    pub fn join(&mut self, dgram: DatagramId, group: Gid) -> crate::Result<()> {
        self.datagrams.join(dgram, group)
    }

    /// Takes datagram endpoint `dgram` out of multicast group `group`, from
    /// a callback.
    pub fn leave(&mut self, dgram: DatagramId, group: Gid) -> crate::Result<()> {
        self.datagrams.leave(dgram, group)
    }

    /// Stages a SEND of `data` (copied into a registered send slot).
    /// Returns the sequence number its completion will report
    /// ([`Handler::on_sends_complete`](super::Handler::on_sends_complete),
    /// by default `on_send_complete`).
    #[inline]
    pub fn send(&mut self, conn: ConnId, data: &[u8], imm: Option<u32>) -> Result<u32, SendError> {
        self.send_with(conn, data.len(), imm, |buf| buf.copy_from_slice(data))
    }

    /// Stages a SEND of `len` bytes that `fill` writes directly into the
    /// registered send slot (no intermediate copy).
    #[inline]
    pub fn send_with(
        &mut self,
        conn: ConnId,
        len: usize,
        imm: Option<u32>,
        fill: impl FnOnce(&mut [u8]),
    ) -> Result<u32, SendError> {
        self.conn(conn)?.stage_send(len, imm, |buf| {
            fill(buf);
            Some(len)
        })
    }

    /// Stages a SEND whose payload `fill` produces in place, in a registered
    /// send slot of `capacity` bytes: it returns how many bytes it wrote, or
    /// `None` to stage nothing ([`SendError::Cancelled`]). Made for reading
    /// a file or socket straight into the slot when the length is not known
    /// in advance.
    ///
    /// ```no_run
    /// # use rdma_comm_core::reactor::*;
    /// # use std::io::Read;
    /// # fn demo(ctx: &mut Ctx<'_>, conn: ConnId, input: &mut impl Read) {
    /// let capacity = ctx.max_payload(conn);
    /// let staged = ctx.send_from(conn, capacity, None, |slot| input.read(slot).ok());
    /// # }
    /// ```
    #[inline]
    pub fn send_from(
        &mut self,
        conn: ConnId,
        capacity: usize,
        imm: Option<u32>,
        fill: impl FnOnce(&mut [u8]) -> Option<usize>,
    ) -> Result<u32, SendError> {
        self.conn(conn)?.stage_send(capacity, imm, fill)
    }

    /// In `on_message`: keeps the message's receive slot after the callback
    /// returns. `None` outside `on_message` or if already held.
    pub fn hold(&mut self) -> Option<HeldRecv> {
        self.current.take()
    }

    /// The payload of a held message; `None` for a message of another
    /// reactor or of a connection that is gone.
    pub fn held_bytes(&self, held: &HeldRecv) -> Option<&[u8]> {
        let conn = self.held_origin(held)?;
        Some(conn.rq().bytes(held.slot, held.len as usize))
    }

    /// Gives a held receive slot back: it is reposted with this pass (an
    /// SRQ slot goes back to the SRQ even if its connection is gone; a slot
    /// of a gone connection's own ring needs nothing). A message of another
    /// reactor comes back with [`SendError::Foreign`], to be released there.
    pub fn release(&mut self, held: HeldRecv) -> Result<(), (SendError, HeldRecv)> {
        self.touched = true;
        if held.conn.key().owner != self.conns.owner() {
            return Err((SendError::Foreign, held));
        }
        match self.conns.get_mut(held.conn.key()) {
            Some(conn) => conn.queue_repost(held.slot),
            None if held.from_srq => self.deferred.srq_returns.push(held.slot),
            None => {}
        }
        Ok(())
    }

    /// Sends a held message on to `to` without copying it: the SEND reads
    /// the receive slot itself, which is reposted once the SEND completes
    /// (`on_sends_complete` on `to` reports it, alone). On error the message comes
    /// back still held, so it can be retried later in order.
    #[inline]
    pub fn forward(
        &mut self,
        to: ConnId,
        held: HeldRecv,
        imm: Option<u32>,
    ) -> Result<u32, (SendError, HeldRecv)> {
        self.touched = true;
        let Some(origin) = self.held_origin(&held) else {
            return Err((SendError::Foreign, held));
        };
        let Some(source) = origin.rq().source(held.slot) else {
            return Err((SendError::Foreign, held));
        };
        let origin_of = ForwardOrigin {
            conn: held.conn,
            slot: held.slot,
            from_srq: origin.rq().uses_srq(),
        };
        let len = held.len as usize;
        let Some(target) = self.target(to) else {
            return Err((SendError::Closed, held));
        };
        // The usual case: the target keeps the origin's ring registration
        // already, so the forward needs no handle of its own (no reference
        // count, and no second lookup of either connection).
        if target.sq().keeps(source.registration_id) {
            return target
                .stage_forward(source, len, imm, origin_of, None)
                .map_err(|error| (error, held));
        }
        // Found above, and nothing ran since that could remove it.
        let Some(registration) = self
            .held_origin(&held)
            .map(|origin| origin.rq().registration().clone())
        else {
            return Err((SendError::Foreign, held));
        };
        let Some(target) = self.target(to) else {
            return Err((SendError::Closed, held));
        };
        target
            .stage_forward(source, len, imm, origin_of, Some(registration))
            .map_err(|error| (error, held))
    }

    /// Stages an RDMA WRITE from `local` to `remote`; with `imm` it consumes
    /// one of the peer's receives and needs a credit. The reactor keeps
    /// `local`'s [`Registration`](crate::verbs::Registration) until the
    /// WRITE is known complete, so dropping the region early is harmless.
    #[inline]
    pub fn write(
        &mut self,
        conn: ConnId,
        local: &LocalSlice<'_>,
        remote: RemoteSlice,
        imm: Option<u32>,
    ) -> Result<u32, SendError> {
        self.conn(conn)?.stage_write(local, remote, imm, false)
    }

    /// Stages an RDMA READ of `remote` into `local` (registered with
    /// `LOCAL_WRITE`). The reactor keeps its registration until the READ
    /// completes.
    #[inline]
    pub fn read(
        &mut self,
        conn: ConnId,
        local: &LocalSlice<'_>,
        remote: RemoteSlice,
    ) -> Result<u32, SendError> {
        self.conn(conn)?.stage_read(local, remote)
    }

    /// As [`read`](Self::read), with the doorbell rung now instead of at
    /// the end of the pass: for a lone latency-critical request, which is
    /// then on the wire while the pass goes on, and which costs the pass's
    /// end nothing. If requests are already staged on `conn` in this pass,
    /// it is staged behind them and goes with them at the end of the pass
    /// (posted alone, it would overtake them).
    ///
    /// A doorbell the device refuses is reported as a refused flush is:
    /// the call still returns the request's sequence number, the request
    /// never completes, later requests on `conn` are only staged, and the
    /// connection fails with the device's error (`on_error`) at the next
    /// flush, the one ending this pass (or the next pass, from
    /// [`Reactor::with_ctx`](super::Reactor::with_ctx)), or before that
    /// flush goes on when rung from `on_error` during it.
    ///
    /// Ringing once per request gives up batching: a sender with many
    /// requests in one pass stages them ([`read`](Self::read)) and lets the
    /// pass ring once.
    #[inline]
    pub fn read_now(
        &mut self,
        conn: ConnId,
        local: &LocalSlice<'_>,
        remote: RemoteSlice,
    ) -> Result<u32, SendError> {
        let Some(record) = self.alone(conn)? else {
            return self.read(conn, local, remote);
        };
        let seq = match record.stage_read(local, remote) {
            Ok(seq) => seq,
            Err(refused) => return Err(self.refused_alone(conn, refused)),
        };
        let posted = record.post_staged();
        self.rang_alone(conn, posted);
        Ok(seq)
    }

    /// As [`write`](Self::write), with the doorbell rung now (see
    /// [`read_now`](Self::read_now)) and the WRITE signaled (also when it
    /// is staged behind others), so its completion retires it without a
    /// later request and no unsignaled tail is left for the reactor's idle
    /// passes to signal out.
    #[inline]
    pub fn write_now(
        &mut self,
        conn: ConnId,
        local: &LocalSlice<'_>,
        remote: RemoteSlice,
        imm: Option<u32>,
    ) -> Result<u32, SendError> {
        let Some(record) = self.alone(conn)? else {
            return self.conn(conn)?.stage_write(local, remote, imm, true);
        };
        let seq = match record.stage_write(local, remote, imm, true) {
            Ok(seq) => seq,
            Err(refused) => return Err(self.refused_alone(conn, refused)),
        };
        let posted = record.post_staged();
        self.rang_alone(conn, posted);
        Ok(seq)
    }

    /// `conn`, if a request staged on it now may be rung alone: looked up
    /// without listing it for the flush, which then has nothing to do for
    /// it. `None` if requests staged before must go first.
    #[inline(always)]
    fn alone(&mut self, conn: ConnId) -> Result<Option<&mut Conn>, SendError> {
        let record = self
            .conns
            .get_mut_quiet(conn.key())
            .ok_or(SendError::Closed)?;
        Ok(record.sq().can_ring_alone().then_some(record))
    }

    /// A request to ring alone on `conn` was refused: the connection is
    /// listed for the flush all the same, as staging through
    /// [`conn`](Self::conn) lists it (a connection refused for want of room
    /// is then looked at by the flushes that follow the completions that
    /// may bring it).
    #[cold]
    #[inline(never)]
    fn refused_alone(&mut self, conn: ConnId, refused: SendError) -> SendError {
        self.touched = true;
        self.conns.touch(conn.key().index);
        refused
    }

    /// Counts a doorbell rung alone on `conn`; a refused one is left for
    /// the next flush, which fails the connection (listed for it, so even
    /// an idle pass flushes).
    #[inline(always)]
    fn rang_alone(&mut self, conn: ConnId, posted: crate::Result<()>) {
        self.deferred.lone_doorbells += 1;
        if let Err(error) = posted {
            self.refused(conn, error);
        }
    }

    #[cold]
    #[inline(never)]
    fn refused(&mut self, conn: ConnId, error: crate::Error) {
        self.touched = true;
        self.conns.touch(conn.key().index);
        self.deferred.refused.push((conn, error));
    }

    /// Signals the request last staged on `conn`, so its completion (and
    /// that of everything before it) is reported as soon as it happens
    /// instead of with the next signaled request: for a final message whose
    /// completion the handler waits for.
    pub fn signal_staged(&mut self, conn: ConnId) {
        self.touched = true;
        if let Some(conn) = self.conns.get_mut(conn.key()) {
            conn.sq_mut().signal_last_staged();
        }
    }

    /// Requests staged on `conn` in this pass so far (they leave in one
    /// doorbell at its end): lets a sender cap its batch size.
    pub fn staged(&self, conn: ConnId) -> usize {
        self.conns.get(conn.key()).map_or(0, |c| c.sq().staged())
    }

    /// Largest payload one SEND on `conn` can carry.
    pub fn max_payload(&self, conn: ConnId) -> usize {
        self.conns.get(conn.key()).map_or(0, Conn::max_payload)
    }

    /// True once the connection can send (a direct connection: from
    /// `add_direct` until it fails).
    pub fn is_established(&self, conn: ConnId) -> bool {
        self.conns
            .get(conn.key())
            .is_some_and(|c| matches!(c.state(), ConnState::Established | ConnState::Direct))
    }

    /// The position of `conn`'s QP among its session's QPs.
    pub fn qp_index(&self, conn: ConnId) -> Option<usize> {
        self.conns.get(conn.key()).map(|c| c.qp_index())
    }

    /// The session `conn` belongs to.
    pub fn session_of(&self, conn: ConnId) -> Option<SessionId> {
        self.conns.get(conn.key()).map(|c| c.session())
    }

    /// Asks the reactor's `run` loop to return after this pass.
    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::Release);
    }
}
