//! A connection of the reactor ([`Conn`]): its QP and the owned parts
//! around it, each in a module of its own: the credits ([`Credits`]), the
//! receive side ([`RecvRing`]) and the send side ([`SendQueue`]). `Conn`
//! holds the rules that span them: admission of a request, the credit
//! updates and the connection's state.
//!
//! Everything here is sized at registration and never grows: the data path
//! only moves indices around preallocated arrays.

mod credit;
mod op;
mod ring;
mod room;
mod send_queue;
mod slots;
mod state;
#[cfg(test)]
mod test_access;

use crate::error::Error;
use crate::verbs::{
    AccessFlags, LocalSlice, ProtectionDomain, QueuePair, Registration, RemoteSlice,
};

use super::table::wr_id::{self, direct_recv_tag, direct_send_tag};
use super::{ConnId, ConnStats, DirectQp, ReactorConfig, SendError, SessionId};

pub(crate) use credit::Arrival;
use credit::Credits;
pub(crate) use op::{ForwardOrigin, OpKind};
pub(crate) use ring::MAX_REPOST;
use ring::RecvRing;
use room::{Needs, RoomWait};
use send_queue::SendQueue;
pub(crate) use send_queue::{MIN_SQ_DEPTH, sq_room};
pub(crate) use slots::{IMM_TRAILER_LEN, Ring, RingSlots, SharedRing, SlotSource, recv_request};
pub(crate) use state::ConnState;

/// One connection of the reactor: its QP, credits, receive side and send
/// side, and the rules that span them.
pub(crate) struct Conn {
    id: ConnId,
    session: SessionId,
    /// The QP's position among its session's QPs.
    qp_index: usize,
    qpn: u32,
    /// Window binds posted on the QP before the reactor took it: their
    /// completions (failures, or signaled ones) carry `BIND_WR_ID`.
    binds: u32,
    state: ConnState,
    /// Its handler posts on the QP ([`Ctx::direct`](super::Ctx::direct));
    /// the reactor stages, signals, credits and reposts nothing on it. (As
    /// `protocol_qpn == NO_QPN`, but a flag is cheaper to test.)
    direct: bool,
    /// The QP number the completions of the reactor's protocol come
    /// from: the QP's, or [`NO_QPN`] on a direct connection, so that one
    /// compare vets both the QP and the kind.
    protocol_qpn: u64,
    /// Bytes of a slot, in both rings.
    slot_size: usize,
    /// Whether requests were refused for want of room, and the handler
    /// waits to be told it is back (`Handler::on_writable`).
    room: RoomWait,
    // Declared before the parts, so it is destroyed before the rings'
    // registrations and those requests hold. Only this connection posts on
    // it (the reactor took it whole).
    qp: QueuePair,
    credits: Credits,
    rq: RecvRing,
    sq: SendQueue,
}

// SAFETY: the raw pointers in the rings point into this Conn's own regions,
// or into the reactor's SRQ region, which lives as long as the reactor that
// owns this Conn; moving the Conn to another thread moves none of that memory.
unsafe impl Send for Conn {}

/// The fewest receives a connection keeps posted (or is granted from the
/// SRQ): one stays reserved for the peer's credit updates, and an update
/// is owed only for two or more receives gone unannounced, so the updates
/// that announce receives consumed by updates die out between idle peers.
pub(crate) const MIN_RECV_DEPTH: u32 = 3;

/// No QP number: beyond every `u32` a device can report.
const NO_QPN: u64 = 1 << 32;

impl Conn {
    pub(crate) fn new(
        id: ConnId,
        session: SessionId,
        qp_index: usize,
        pd: &ProtectionDomain,
        qp: QueuePair,
        config: &ReactorConfig,
        shared: Option<SharedRing>,
    ) -> crate::Result<Self> {
        let slot_size = config.slot_size.max(IMM_TRAILER_LEN);
        let recv_depth = match shared {
            Some(_) => config.recv_depth.max(MIN_RECV_DEPTH),
            None => config.recv_depth.min(qp.max_recv_wr()).max(MIN_RECV_DEPTH),
        };
        let rq = RecvRing::new(
            pd,
            slot_size,
            recv_depth,
            config.repost_batch,
            wr_id::recv(id.key(), 0),
            shared,
        )?;
        let sq = SendQueue::new(pd, &qp, config, slot_size, wr_id::send(id.key(), 0))?;
        Ok(Self {
            id,
            session,
            qp_index,
            qpn: qp.qpn(),
            binds: qp.bound_windows(),
            state: ConnState::Connecting,
            direct: false,
            protocol_qpn: u64::from(qp.qpn()),
            slot_size,
            room: RoomWait::default(),
            qp,
            credits: Credits::new(recv_depth),
            rq,
            sq,
        })
    }

    /// A direct connection (see `direct`): established at once, with rings
    /// of a few 4-byte slots that nothing ever posts (the rest of the
    /// connection's machinery is idle, and stays correct, around them).
    pub(crate) fn new_direct(
        id: ConnId,
        session: SessionId,
        qp_index: usize,
        pd: &ProtectionDomain,
        qp: QueuePair,
        config: &ReactorConfig,
    ) -> crate::Result<Self> {
        let token = ReactorConfig {
            slot_size: IMM_TRAILER_LEN,
            recv_depth: MIN_RECV_DEPTH,
            send_slots: 2,
            signal_interval: 1,
            sq_depth: MIN_SQ_DEPTH,
            ..config.clone()
        };
        let mut conn = Self::new(id, session, qp_index, pd, qp, &token, None)?;
        conn.direct = true;
        conn.protocol_qpn = NO_QPN;
        conn.state = ConnState::Direct;
        // The reactor posts nothing of its own on a direct QP, so the tags
        // are the direct ones its handler's requests carry.
        conn.sq.retag(direct_send_tag(id.key()));
        conn.rq.retag(direct_recv_tag(id.key()));
        Ok(conn)
    }

    /// The connection's id.
    #[inline(always)]
    pub(crate) fn id(&self) -> ConnId {
        self.id
    }

    /// The session the connection belongs to.
    #[inline(always)]
    pub(crate) fn session(&self) -> SessionId {
        self.session
    }

    /// The QP's position among its session's QPs.
    pub(crate) fn qp_index(&self) -> usize {
        self.qp_index
    }

    /// The QP's number.
    #[inline(always)]
    pub(crate) fn qpn(&self) -> u32 {
        self.qpn
    }

    /// Window binds posted on the QP before the reactor took it.
    pub(crate) fn binds(&self) -> u32 {
        self.binds
    }

    /// Where the connection is.
    #[inline(always)]
    pub(crate) fn state(&self) -> ConnState {
        self.state
    }

    /// True for a direct connection (see `direct`).
    #[inline(always)]
    pub(crate) fn is_direct(&self) -> bool {
        self.direct
    }

    /// The QP number a completion of the reactor's protocol must come
    /// from to be this connection's: none on a direct connection.
    #[inline(always)]
    pub(crate) fn protocol_qpn(&self) -> u64 {
        self.protocol_qpn
    }

    /// The receive side, to read what arrived.
    #[inline(always)]
    pub(crate) fn rq(&self) -> &RecvRing {
        &self.rq
    }

    /// The send side, to look at what is in flight.
    #[inline(always)]
    pub(crate) fn sq(&self) -> &SendQueue {
        &self.sq
    }

    /// The receive side, for what concerns it alone (the rules that span
    /// the parts are `Conn`'s).
    #[inline(always)]
    pub(crate) fn rq_mut(&mut self) -> &mut RecvRing {
        &mut self.rq
    }

    /// The send side, for what concerns it alone (the rules that span the
    /// parts are `Conn`'s).
    #[inline(always)]
    pub(crate) fn sq_mut(&mut self) -> &mut SendQueue {
        &mut self.sq
    }

    /// A direct connection's QP, with the tags of its requests' `wr_id`s.
    #[inline]
    pub(crate) fn direct_qp(&mut self) -> Option<DirectQp<'_>> {
        (self.state == ConnState::Direct).then_some(DirectQp {
            qp: &mut self.qp,
            send_tag: self.sq.tag(),
            recv_tag: self.rq.tag(),
        })
    }

    /// Bytes registered for this connection alone (receive, send).
    pub(crate) fn registered_bytes(&self) -> (usize, usize) {
        (self.rq.registered_bytes(), self.sq.registered_bytes())
    }

    /// Largest payload of one SEND: a slot less a user immediate's trailer
    /// (with or without one, so any message can be forwarded with one).
    pub(crate) fn max_payload(&self) -> usize {
        self.slot_size - IMM_TRAILER_LEN
    }

    /// Whether posting a request now would be refused, and why. A refusal
    /// for want of room is remembered: the handler is told once room is
    /// back.
    #[inline]
    fn admit(&mut self, consumes_recv: bool, needs_slot: bool) -> Result<(), SendError> {
        // One compare on the busy path, where the state is what it
        // almost always is.
        if self.state != ConnState::Established {
            return Err(self.refuse_unestablished(Needs::new(consumes_recv, needs_slot)));
        }
        if !self.has_room_for(consumes_recv, needs_slot) {
            return Err(self.refuse_for_room(Needs::new(consumes_recv, needs_slot)));
        }
        Ok(())
    }

    /// Whether the send queue, the credits and the send slots have room for
    /// a request that consumes a peer receive or not, and copies its
    /// payload or not. One SQ entry and one credit stay reserved for credit
    /// updates.
    #[inline(always)]
    fn has_room_for(&self, consumes_recv: bool, needs_slot: bool) -> bool {
        self.sq.has_room()
            && (!consumes_recv || self.credits.can_spend_on_request())
            && (!needs_slot || self.sq.has_free_slot())
    }

    #[cold]
    #[inline(never)]
    fn refuse_for_room(&mut self, needs: Needs) -> SendError {
        self.room.refused(needs);
        SendError::WouldBlock
    }

    /// Refuses a request on a connection that is not established: one
    /// still connecting waits for room as a full one does (`on_writable`
    /// follows `on_established`, once the first credits are in).
    #[cold]
    #[inline(never)]
    fn refuse_unestablished(&mut self, needs: Needs) -> SendError {
        if self.state == ConnState::Connecting {
            self.room.refused(needs);
        }
        self.state.refusal()
    }

    /// Whether the handler waits to be told that room is back.
    #[inline(always)]
    pub(crate) fn waits_for_room(&self) -> bool {
        self.room.needs().is_some()
    }

    /// Whether a connection waiting for room has it back: every kind of
    /// request refused since it began waiting would be taken now.
    pub(crate) fn has_room_back(&self) -> bool {
        self.room
            .needs()
            .is_some_and(|needs| self.would_admit(needs.credit(), needs.slot()))
    }

    /// Whether a retire (which frees send-queue entries and slots, never
    /// credits) may end the connection's wait for room: it waits, and not
    /// for a credit it lacks.
    #[inline(always)]
    pub(crate) fn retire_may_bring_room(&self) -> bool {
        self.room
            .needs()
            .is_some_and(|needs| !needs.credit() || self.credits.can_spend_on_request())
    }

    /// [`admit`](Self::admit)'s verdict, without noting a refusal.
    fn would_admit(&self, consumes_recv: bool, needs_slot: bool) -> bool {
        self.state == ConnState::Established && self.has_room_for(consumes_recv, needs_slot)
    }

    /// The handler is told that room is back: the wait is over.
    pub(crate) fn end_room_wait(&mut self) {
        self.room.end();
    }

    /// Stages a SEND whose payload `fill` writes into a free send slot of
    /// `capacity` bytes, returning how many it wrote (`None`: stage nothing).
    #[inline]
    pub(crate) fn stage_send(
        &mut self,
        capacity: usize,
        imm: Option<u32>,
        fill: impl FnOnce(&mut [u8]) -> Option<usize>,
    ) -> Result<u32, SendError> {
        if capacity > self.max_payload() {
            return Err(SendError::too_large(capacity, self.max_payload()));
        }
        self.admit(true, true)?;
        // SAFETY: `admit` found room and a free slot, and `capacity` is at
        // most a slot less a trailer (checked above).
        unsafe { self.sq.stage_send(capacity, imm, fill, &mut self.credits) }
    }

    /// Stages a SEND of the `len`-byte payload that starts held receive
    /// slot `source` of connection `origin`, which is reposted when it
    /// completes. A user immediate goes in the slot right after the payload.
    #[inline]
    pub(crate) fn stage_forward(
        &mut self,
        source: SlotSource,
        len: usize,
        imm: Option<u32>,
        origin: ForwardOrigin,
        registration: Option<Registration>,
    ) -> Result<u32, SendError> {
        let wire_len = len + imm.map_or(0, |_| IMM_TRAILER_LEN);
        if len > self.max_payload() || wire_len > source.size() {
            let max = self
                .max_payload()
                .min(source.size().saturating_sub(IMM_TRAILER_LEN));
            return Err(SendError::too_large(len, max));
        }
        self.admit(true, false)?;
        let credits = &mut self.credits;
        // SAFETY: `admit` found room; the payload and trailer fit `source`
        // (checked above); the caller holds `source`, a slot whose receive
        // completed (`Ctx::forward` takes it from its `HeldRecv`).
        Ok(unsafe { (self.sq).stage_forward(source, len, imm, origin, registration, credits) })
    }

    /// Stages a WRITE (or WRITE_WITH_IMM, which consumes a peer receive),
    /// signaled if `force_signal` or when selective signaling says so.
    #[inline]
    pub(crate) fn stage_write(
        &mut self,
        local: &LocalSlice<'_>,
        remote: RemoteSlice,
        imm: Option<u32>,
        force_signal: bool,
    ) -> Result<u32, SendError> {
        if local.len() != remote.len() {
            return Err(SendError::lengths_differ());
        }
        self.admit(imm.is_some(), false)?;
        if imm.is_some() {
            self.credits.spend();
        }
        Ok(self.sq.stage_write(local, remote, imm, force_signal))
    }

    /// Stages a READ of `remote` into `local`.
    #[inline(always)]
    pub(crate) fn stage_read(
        &mut self,
        local: &LocalSlice<'_>,
        remote: RemoteSlice,
    ) -> Result<u32, SendError> {
        if local.len() != remote.len() {
            return Err(SendError::lengths_differ());
        }
        if !local.access.contains(AccessFlags::LOCAL_WRITE) {
            return Err(SendError::Invalid(Error::InvalidArgument(
                "a READ target must be registered with LOCAL_WRITE",
            )));
        }
        self.admit(false, false)?;
        Ok(self.sq.stage_read(local, remote))
    }

    /// Rings the doorbell for everything staged (see [`SendQueue::post`]).
    #[inline]
    pub(crate) fn post_staged(&mut self) -> crate::Result<()> {
        self.sq.post(&mut self.qp)
    }

    /// Applies a receive count the peer sent; true for the first, which
    /// establishes the connection.
    #[inline]
    pub(crate) fn peer_credit(&mut self, count: u32) -> bool {
        if self.credits.apply_peer_count(count) && self.state == ConnState::Connecting {
            self.state = ConnState::Established;
            return true;
        }
        false
    }

    /// Counts a receive the peer consumed: false for one beyond its grant
    /// (see [`Credits::count_receive`]), answered with
    /// [`overrun_error`](Self::overrun_error).
    #[inline]
    pub(crate) fn count_receive(&mut self) -> bool {
        self.credits.count_receive()
    }

    /// The error that cuts off a peer that overran its grant.
    #[cold]
    pub(crate) fn overrun_error(&self) -> Error {
        self.credits.overrun_error(self.qpn, self.rq.depth())
    }

    /// Posts the receives; called once at registration.
    pub(crate) fn post_initial_receives(&mut self) -> crate::Result<()> {
        self.rq.post_initial(&mut self.qp, &mut self.credits)
    }

    /// Queues receive slot `slot` for reposting (see [`RecvRing::queue`]).
    #[inline]
    pub(crate) fn queue_repost(&mut self, slot: u32) {
        let closed = self.state.is_closed();
        self.rq.queue(slot, closed, self.qpn);
    }

    /// Reposts the own ring's queued slots and counts them as credits.
    #[inline]
    pub(crate) fn flush_reposts(&mut self) -> crate::Result<()> {
        self.rq.flush(&mut self.qp, &mut self.credits)
    }

    /// Counts the SRQ slots handed back as credits if the SRQ has posted
    /// everything given back to it (`posted`); otherwise the connection
    /// stays due, to ask again with its next flush.
    #[inline]
    pub(crate) fn credit_shared(&mut self, posted: bool) {
        self.rq.credit_shared(posted, &mut self.credits);
    }

    /// What an open connection has left after a flush: work any pass
    /// must do ([`is_unsettled`](Self::is_unsettled)), receives waiting
    /// for a fuller batch, an unsignaled tail.
    #[inline]
    pub(crate) fn leftovers(&self) -> (bool, bool, bool) {
        (
            self.is_unsettled(),
            self.rq.has_pending(),
            self.has_unsignaled_tail(),
        )
    }

    /// Nothing staged and no credit update due (reposts may be pending).
    #[inline]
    pub(crate) fn is_quiet(&self) -> bool {
        self.sq.staged() == 0 && !self.credits.update_due()
    }

    /// Something the next flush has to do even on an idle pass: reposts that
    /// are due, staged work or a due credit update (for a closed connection:
    /// SRQ slots to give back). Fewer receives than a batch wait for a
    /// fuller batch or a longer idle spell.
    #[inline]
    pub(crate) fn is_unsettled(&self) -> bool {
        if self.state.is_closed() {
            self.rq.owes_shared_slots()
        } else {
            self.open_leftovers().0
        }
    }

    /// As [`leftovers`](Self::leftovers), for a connection the caller knows
    /// is open (the flush, right after its doorbell).
    #[inline]
    pub(crate) fn open_leftovers(&self) -> (bool, bool, bool) {
        (
            self.rq.is_due() || !self.is_quiet(),
            self.rq.has_pending(),
            self.has_unsignaled_tail(),
        )
    }

    /// Before the doorbell: the staged SENDs announce our receive count, or
    /// an explicit credit update is staged if none does and enough receives
    /// went unannounced.
    #[inline]
    pub(crate) fn prepare_flush(&mut self) {
        if self.credits.before_doorbell() {
            self.sq.stage_credit_update(&mut self.credits, false);
        }
    }

    /// True if requests went out unsignaled since the last signaled one on
    /// an established connection.
    pub(crate) fn has_unsignaled_tail(&self) -> bool {
        self.sq.signaling().has_unsignaled_tail() && self.state == ConnState::Established
    }

    /// Makes the unsignaled tail complete with a signaled credit update
    /// (the one request that needs no payload, only the reserved credit).
    pub(crate) fn stage_tail_signal(&mut self) {
        self.sq.stage_credit_update(&mut self.credits, true);
    }

    /// Stages the first credit update.
    pub(crate) fn stage_initial_update(&mut self) {
        self.sq.stage_first_credit_update(&mut self.credits);
    }

    /// Answers the first credit the peer sent with one more update of ours.
    /// The peer may have missed our initial one: through a shared receive
    /// queue, an update that arrives before the peer's reactor took its QP
    /// is a stranger's completion there and is dropped, and a peer that
    /// then never sends would stay connecting for good. The peer has its
    /// QP by now (it sent this), so this one reaches it. Skipped without a
    /// credit (then our next SEND announces the count anyway).
    pub(crate) fn answer_first_credit(&mut self) {
        self.sq.stage_credit_update(&mut self.credits, false);
    }

    /// Marks the connection failed. Requests only staged are dropped, and
    /// `release` is called for every forward among them, whose receive
    /// slot belongs to another connection that must get it back.
    ///
    /// Requests already posted stay in the SQ ring with what they point at
    /// (a forward's receive slot, a registration): the device may read or
    /// write that memory until it reports them done. Their completions, now
    /// flushed in error, retire them (`retire_failed`); whatever is left
    /// goes when the QP is destroyed (`shut_down`).
    pub(crate) fn fail(&mut self, release: impl FnMut(ConnId, u32, bool)) {
        self.state = ConnState::Failed;
        self.sq.unwind(self.id, release);
        self.rq.drop_own_pending();
    }

    /// Retires what a completion of `seq` on the failed connection proves
    /// done (see [`SendQueue::retire_failed`]).
    pub(crate) fn retire_failed(
        &mut self,
        seq: u32,
        release: impl FnMut(ConnId, u32, bool),
    ) -> u32 {
        self.sq.retire_failed(seq, self.id, release)
    }

    /// Stops the QP (outstanding work is flushed) and fails the
    /// connection, calling `release` for the receive slot of every forward
    /// still in the SQ ring. The caller then drops the connection, which
    /// destroys its QP before its rings and the registrations its requests
    /// hold, and only then gives the released slots back: until the QP is
    /// destroyed, the device may still read them.
    pub(crate) fn shut_down(&mut self, mut release: impl FnMut(ConnId, u32, bool)) {
        // Errors add nothing here: the QP is destroyed next either way.
        let _ = self.qp.set_error();
        if self.state != ConnState::Failed {
            self.fail(&mut release);
        }
        self.sq.abandon_posted(self.id, release);
        self.state = ConnState::Removed;
    }

    /// Moves the QP of a failed connection to the error state, so the peer
    /// sees the failure too, and drains its send queue (see
    /// [`SendQueue::post_drain`]). Without it, a request that completed
    /// unsignaled before the failure would report nothing, and what it
    /// holds (a forward's receive slot of another connection or of the SRQ)
    /// would wait for the session's removal. If either step fails, that is
    /// where it waits (`shut_down`).
    pub(crate) fn stop_qp(&mut self) {
        if self.qp.set_error().is_ok() {
            self.sq.post_drain(&mut self.qp);
        }
    }

    /// Queue depths in use (for tests and diagnostics).
    pub(crate) fn stats(&self) -> ConnStats {
        ConnStats {
            sq_used: self.sq.used(),
            send_slots_used: self.sq.slots_used(),
            credits: self.credits.available(),
        }
    }
}
