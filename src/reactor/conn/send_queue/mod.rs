//! A connection's send side ([`SendQueue`]): the ring of send slots SEND
//! payloads are copied into, the send-queue ring of operations with
//! selective signaling, the registrations requests hold until they are
//! known complete, and the staged requests that go out with one doorbell.

mod registration_cache;
mod send_slots;
mod signal;
mod sizes;
#[cfg(test)]
mod tests;

use crate::error::Error;
use crate::verbs::{
    LocalSlice, ProtectionDomain, QueuePair, Registration, RemoteSlice, SendDescriptor, SendFlags,
    SendList, SendOpcode, Sge,
};

use super::credit::{Credits, send_imm};
use super::op::{ForwardOrigin, Keep, OpKind, SqOp};
use super::slots::{IMM_TRAILER_LEN, SlotSource};
use crate::reactor::ConnId;
use crate::reactor::idle::Spell;
use crate::reactor::{ReactorConfig, SendError};
use registration_cache::RegistrationCache;
use send_slots::SendSlots;
use signal::Signaling;
use sizes::Sizes;
pub(crate) use sizes::{MIN_SQ_DEPTH, sq_room};

/// The mark in `SendQueue::unposted` of a refused doorbell (a count of
/// requests never reaches it: a send queue is far smaller).
const REFUSED: u32 = 1 << 31;

/// Most requests staged for one QP in one pass (one doorbell). A queue
/// shallower than this stages at most its depth, and its list has only
/// that room (each entry is about 150 bytes a connection keeps).
const MAX_STAGED: usize = 64;

/// A connection's send side: sized at registration, it only moves indices
/// around preallocated arrays afterwards.
pub(crate) struct SendQueue {
    /// The top 32 bits of every request's `wr_id` (see `Conn::new`).
    tag: u64,
    /// Where SEND payloads are copied.
    send_slots: SendSlots,
    /// `ops[seq % ops.len()]` for every `seq` in `[done, next)`: posted or
    /// staged, not known complete (at most `depth` of them).
    ops: Box<[SqOp]>,
    /// Beside `ops`: the registration handle of an op that holds one of
    /// its own (`Keep::Own`), None elsewhere. The connection destroys its
    /// QP before dropping this, so a handle never outlives its use by the
    /// device.
    owned: Box<[Option<Registration>]>,
    /// Send-queue entries in use at most.
    depth: u32,
    next: u32,
    done: u32,
    /// The newest ops a failed post left unposted, no longer in `batch`
    /// (which holds the others the device has not seen), with [`REFUSED`]
    /// set once a doorbell was refused: nonzero means the connection waits
    /// to fail.
    unposted: u32,
    signaling: Signaling,
    max_inline: u32,
    /// The requests staged this pass: one doorbell.
    batch: SendList,
    /// The registration requests hold by count instead of by handle (see
    /// [`Keep`]).
    cache: RegistrationCache,
}

impl SendQueue {
    /// The send side of a connection on `qp`: a send queue of the
    /// configured depth (at most the QP's room), signaled every `signal_interval` requests, and send slots of
    /// `slot_size` bytes registered on `pd`. `tag` tops every `wr_id`.
    pub(crate) fn new(
        pd: &ProtectionDomain,
        qp: &QueuePair,
        config: &ReactorConfig,
        slot_size: usize,
        tag: u64,
    ) -> crate::Result<Self> {
        let Sizes {
            depth,
            ring,
            signal_interval,
            slots,
        } = Sizes::of(config, qp);
        Ok(Self {
            tag,
            send_slots: SendSlots::new(pd, slot_size, slots)?,
            ops: vec![SqOp::default(); ring as usize].into_boxed_slice(),
            owned: std::iter::repeat_with(|| None)
                .take(ring as usize)
                .collect(),
            depth,
            next: 0,
            done: 0,
            unposted: 0,
            signaling: Signaling::new(signal_interval),
            max_inline: qp.max_inline_data(),
            batch: SendList::with_capacity((depth as usize).min(MAX_STAGED)),
            cache: RegistrationCache::default(),
        })
    }

    /// Replaces the `wr_id` tag (a direct connection's, whose requests its
    /// handler posts).
    pub(super) fn retag(&mut self, tag: u64) {
        self.tag = tag;
    }

    /// The tag that tops every request's `wr_id`.
    pub(crate) fn tag(&self) -> u64 {
        self.tag
    }

    /// The `wr_id` of request `seq`.
    #[inline(always)]
    fn wr_id(&self, seq: u32) -> u64 {
        self.tag | u64::from(seq)
    }

    /// Bytes registered for the send slots.
    pub(crate) fn registered_bytes(&self) -> usize {
        self.send_slots.registered_bytes()
    }

    /// Where op `seq` is in `ops` (and `owned`): a mask of the ring's own
    /// length, which the optimiser sees is in bounds (no check on an
    /// index).
    #[inline(always)]
    fn position(&self, seq: u32) -> usize {
        seq as usize & (self.ops.len() - 1)
    }

    /// Send-queue entries in use (posted or staged, not known complete).
    #[inline]
    pub(crate) fn used(&self) -> u32 {
        self.next.wrapping_sub(self.done)
    }

    /// Send slots in use.
    pub(crate) fn slots_used(&self) -> u32 {
        self.send_slots.used()
    }

    /// Room for a request of a handler: a send-queue entry beyond the one
    /// kept for a credit update, and a place in this pass's doorbell.
    #[inline]
    pub(crate) fn has_room(&self) -> bool {
        // The list holds `depth` requests, or `MAX_STAGED` when that is
        // fewer; what is staged is in use too, so below the depth it is
        // below the list's room as well.
        self.used() + 1 < self.depth && self.batch.len() < MAX_STAGED
    }

    /// A free send slot.
    #[inline]
    pub(crate) fn has_free_slot(&self) -> bool {
        self.send_slots.left() > 0
    }

    /// Requests staged for the next doorbell.
    #[inline]
    pub(crate) fn staged(&self) -> usize {
        self.batch.len()
    }

    /// Records `op` in the send-queue ring (with the registration handle
    /// an op of `Keep::Own` holds, `owned`), decides its signaling (always
    /// if `force_signal`), and stages it. The caller checked the room.
    #[inline(always)]
    pub(super) fn stage(
        &mut self,
        request: SendDescriptor,
        op: SqOp,
        owned: Option<Registration>,
        force_signal: bool,
    ) -> u32 {
        let seq = self.next;
        self.next = seq.wrapping_add(1);
        let at = self.position(seq);
        // An own handle goes with `Keep::Own` and nothing else, and the
        // op that had this position before took its handle when it retired.
        debug_assert_eq!(op.keep() == Keep::Own, owned.is_some());
        debug_assert!(self.owned[at].is_none());
        self.ops[at] = op;
        if let Some(owned) = owned {
            // Empty: the op that was here retired and took its handle.
            // (Moved in here: `is_some()` and a move of the whole option
            // left a check for a handle to drop on every request's path.)
            self.owned[at] = Some(owned);
        }
        let mut flags = SendFlags::empty();
        let sq_left = self.depth - self.used();
        if self
            .signaling
            .decide(force_signal, sq_left, self.send_slots.left())
        {
            flags |= SendFlags::SIGNALED;
        }
        if request.local.len <= self.max_inline && request.opcode != SendOpcode::Read {
            flags |= SendFlags::INLINE;
        }
        let pushed = self.batch.push(self.wr_id(seq), flags, &request);
        debug_assert!(pushed, "staged past a full list");
        seq
    }

    /// Stages a SEND whose payload `fill` writes into the next free send
    /// slot, `capacity` bytes at most, returning how many it wrote (`None`:
    /// stage nothing). A user immediate goes in the slot right after the
    /// payload; the request spends a credit of `credits`, whose receive
    /// count it carries.
    ///
    /// # Safety
    ///
    /// There is room ([`has_room`](Self::has_room)) and a free slot
    /// ([`has_free_slot`](Self::has_free_slot)), and `capacity` and a
    /// trailer fit a slot.
    #[inline]
    pub(super) unsafe fn stage_send(
        &mut self,
        capacity: usize,
        imm: Option<u32>,
        fill: impl FnOnce(&mut [u8]) -> Option<usize>,
        credits: &mut Credits,
    ) -> Result<u32, SendError> {
        // SAFETY: the caller's contract is `fill`'s.
        let Some(sge) = (unsafe { self.send_slots.fill(capacity, imm, fill) }) else {
            return Err(SendError::Cancelled);
        };
        let count = credits.spend_on_send(message_kind(imm));
        let request = SendDescriptor::send(sge, Some(count));
        Ok(self.stage(request, SqOp::of(OpKind::Send), None, false))
    }

    /// Stages a SEND of the `len`-byte payload that starts held receive
    /// slot `source` of `origin`, which is reposted when it completes. A
    /// user immediate goes in the slot right after the payload. The request
    /// spends a credit of `credits`.
    ///
    /// # Safety
    ///
    /// There is room ([`has_room`](Self::has_room)); the caller holds
    /// `source` (its receive completed, and it is neither reposted nor sent
    /// on until this forward completes); and the payload, and the trailer
    /// if there is an immediate, fit it.
    #[inline]
    pub(super) unsafe fn stage_forward(
        &mut self,
        source: SlotSource,
        len: usize,
        imm: Option<u32>,
        origin: ForwardOrigin,
        registration: Option<Registration>,
        credits: &mut Credits,
    ) -> u32 {
        // Without a handle of its own the forward rides on the kept
        // registration, which must then be the source ring's.
        debug_assert!(registration.is_some() || self.keeps(source.registration_id));
        debug_assert!(len + imm.map_or(0, |_| IMM_TRAILER_LEN) <= source.size);
        let wire_len = match imm {
            Some(imm) => {
                // SAFETY: the caller holds `source`, and the trailer fits
                // it (this function's contract).
                unsafe { source.write_trailer(len, imm) };
                len + IMM_TRAILER_LEN
            }
            None => len,
        };
        let sge = Sge {
            addr: source.addr,
            len: wire_len as u32,
            lkey: source.lkey,
        };
        let (keep, owned) = self.cache.hold(source.registration_id, || registration);
        let count = credits.spend_on_send(message_kind(imm));
        let request = SendDescriptor::send(sge, Some(count));
        self.stage(request, SqOp::forward(origin, keep), owned, false)
    }

    /// Stages a WRITE (a WRITE_WITH_IMM if `imm`, which consumes a peer
    /// receive: the caller spent its credit), signaled if `force_signal`
    /// or when selective signaling says so. The caller checked the room.
    #[inline]
    pub(super) fn stage_write(
        &mut self,
        local: &LocalSlice<'_>,
        remote: RemoteSlice,
        imm: Option<u32>,
        force_signal: bool,
    ) -> u32 {
        let request = SendDescriptor::write(Sge::from(local), remote, imm);
        let (keep, owned) = self.cache.hold(local.registration().id(), || {
            Some(local.registration().clone())
        });
        let op = SqOp::holding(OpKind::Write, keep);
        self.stage(request, op, owned, force_signal)
    }

    /// Stages a READ of `remote` into `local`, always signaled: a READ's
    /// completion is the only sign its data has landed, and callers wait
    /// for it. The caller checked the room.
    #[inline(always)]
    pub(super) fn stage_read(&mut self, local: &LocalSlice<'_>, remote: RemoteSlice) -> u32 {
        let request = SendDescriptor::read(Sge::from(local), remote);
        let (keep, owned) = self.cache.hold(local.registration().id(), || {
            Some(local.registration().clone())
        });
        let op = SqOp::holding(OpKind::Read, keep);
        self.stage(request, op, owned, true)
    }

    /// Stages a credit update (see [`push_credit_update`](Self::push_credit_update))
    /// if there is room for it: the credit kept for it, and the send-queue
    /// entry kept for it. Skipped without room (the peer's next update
    /// brings a credit, and our next SEND announces the count anyway).
    pub(super) fn stage_credit_update(&mut self, credits: &mut Credits, force_signal: bool) {
        if credits.available() >= 1 && self.used() < self.depth && !self.batch.is_full() {
            self.push_credit_update(credits, force_signal);
        }
    }

    /// Stages the connection's first credit update, before any credit is
    /// known: our receive ring is posted, and the peer retries on RNR.
    pub(super) fn stage_first_credit_update(&mut self, credits: &mut Credits) {
        self.push_credit_update(credits, false);
    }

    /// Stages a zero-length SEND_WITH_IMM whose immediate is our receive
    /// count. Signaled if `force_signal`, or if it spends the last credit:
    /// without a credit no later request can signal out the tail, and the
    /// peer may owe us no update (it announces only every quarter ring), so
    /// unsignaled sends before it would never report completion.
    fn push_credit_update(&mut self, credits: &mut Credits, force_signal: bool) {
        let signal = force_signal || credits.available() <= 1;
        let request = SendDescriptor::send(Sge::default(), Some(credits.spend_on_update()));
        self.stage(request, SqOp::of(OpKind::Credit), None, signal);
    }

    /// Signals the last staged request, so it and everything before it
    /// report completion without waiting for the signaling interval.
    pub(crate) fn signal_last_staged(&mut self) {
        if self.batch.flag_last(SendFlags::SIGNALED) {
            self.signaling.signaled();
        }
    }

    /// The selective signaling of this queue.
    #[inline]
    pub(crate) fn signaling(&self) -> &Signaling {
        &self.signaling
    }

    /// How many ops a signaled completion of `seq` retires: it and every
    /// earlier one (RC completes the send queue in order). Zero if `seq` is
    /// not in flight.
    #[inline]
    pub(crate) fn retire_count(&self, seq: u32) -> u32 {
        let count = seq.wrapping_sub(self.done).wrapping_add(1);
        if count <= self.used() { count } else { 0 }
    }

    /// Retires the oldest op, releasing its send slot (and the
    /// registration it kept: the request is complete, so the device no
    /// longer uses the memory).
    #[inline(always)]
    pub(super) fn pop_oldest(&mut self) -> (u32, SqOp) {
        // Entries outside [done, next) are stale: never retire one.
        debug_assert!(self.used() > 0);
        let seq = self.done;
        let at = self.position(seq);
        let op = self.ops[at];
        self.done = seq.wrapping_add(1);
        match (op.kind(), op.keep()) {
            (OpKind::Send, _) => self.send_slots.release_oldest(),
            (_, Keep::Cached) => self.cache.release(),
            (_, Keep::Own) => drop(self.owned[at].take()),
            (_, Keep::Nothing) => {}
        }
        (seq, op)
    }

    /// Retires the oldest op and, if it is a SEND, WRITE or READ a
    /// handler staged (not a forward or a credit update), the ops of its
    /// kind right after it, `most` in all at the most (`most` ≥ 1, and
    /// that many in flight): the run one handler call reports. Returns the
    /// first's sequence number, the first, and how many retired.
    #[inline(always)]
    pub(crate) fn retire_run(&mut self, most: u32) -> (u32, SqOp, u32) {
        let (seq, op) = self.pop_oldest();
        let mut run = 1;
        if matches!(op.kind(), OpKind::Send | OpKind::Write | OpKind::Read) {
            while run < most && self.ops[self.position(self.done)].kind() == op.kind() {
                self.pop_oldest();
                run += 1;
            }
        }
        (seq, op, run)
    }

    /// True if the registration requests hold by count is the one `id`
    /// names.
    #[inline]
    pub(crate) fn keeps(&self, id: usize) -> bool {
        self.cache.holds(id)
    }

    /// Rings the doorbell of `qp` for everything staged. After a failed
    /// post, notes how many of them the device never got, which
    /// [`unwind`](Self::unwind) gives back (none if the provider did not
    /// say: all are then held as posted).
    #[inline]
    pub(super) fn post(&mut self, qp: &mut QueuePair) -> crate::Result<()> {
        // Never behind a refused request: the connection fails first
        // (`Reactor::fail_refused`), and `unwind` gives back the newest.
        debug_assert!(self.unposted == 0 || self.batch.is_empty());
        let staged = self.batch.len() as u32;
        let result = qp.post_list(&mut self.batch);
        if let Err(error) = &result {
            // The connection fails before anything else is posted on it (at
            // the next flush's start, or in the walk that rang this), and
            // `unwind` gives the count back. The mark is set even if the
            // provider did not say which request it refused (then all are
            // held as posted and the count is 0): nothing may be rung alone
            // behind the refusal meanwhile. (Added, not stored: the
            // assertion above says nothing is left from before, and a sum
            // keeps every unposted request unwound even if that ever broke.)
            self.unposted = (self.unposted
                + match error {
                    Error::Post { posted, .. } => staged - (*posted as u32).min(staged),
                    // Nothing says what went in: hold on to it all.
                    _ => 0,
                })
                | REFUSED;
        }
        result
    }

    /// Whether a request staged now may go out at once with a doorbell of
    /// its own (`Ctx::read_now`, `Ctx::write_now`): nothing staged waits
    /// ahead of it, which it would overtake on the send queue (a request's
    /// position there is its sequence number, and completions retire in
    /// that order), and no refused doorbell waits for the connection to
    /// fail.
    #[inline]
    pub(crate) fn can_ring_alone(&self) -> bool {
        self.batch.is_empty() && self.unposted == 0
    }

    /// Notes a doorbell rung on sparse traffic in `spell`.
    #[inline]
    pub(crate) fn note_sparse_post(&mut self, spell: Spell) {
        self.signaling.note_sparse_post(spell);
    }

    /// Takes back every request the device never got (the staged ones, and
    /// those a refused doorbell left), newest first: what each holds goes
    /// now, and `release` gets back the receive slot of every forward
    /// among them (`on` is the connection they were staged on).
    pub(super) fn unwind(&mut self, on: ConnId, mut release: impl FnMut(ConnId, u32, bool)) {
        let unposted = self.batch.len() as u32 + (std::mem::take(&mut self.unposted) & !REFUSED);
        let posted_end = self.next.wrapping_sub(unposted);
        while self.next != posted_end {
            let seq = self.next.wrapping_sub(1);
            let at = self.position(seq);
            let op = self.ops[at];
            self.next = seq;
            match (op.kind(), op.keep()) {
                (OpKind::Send, _) => self.send_slots.release_newest(),
                (_, Keep::Cached) => self.cache.release(),
                (_, Keep::Own) => drop(self.owned[at].take()),
                (_, Keep::Nothing) => {}
            }
            if let Some(origin) = op.forward_origin(on) {
                release(origin.conn, origin.slot, origin.from_srq);
            }
        }
        self.batch.clear();
    }

    /// Retires the posted requests of a failed connection (`on`) that a
    /// completion of `seq` proves done (RC completes in order, and flushes
    /// complete even unsignaled requests), giving `release` the receive
    /// slot of every forward among them. Returns how many it retired.
    pub(super) fn retire_failed(
        &mut self,
        seq: u32,
        on: ConnId,
        mut release: impl FnMut(ConnId, u32, bool),
    ) -> u32 {
        let count = self.retire_count(seq);
        for _ in 0..count {
            let (_, op) = self.pop_oldest();
            if let Some(origin) = op.forward_origin(on) {
                release(origin.conn, origin.slot, origin.from_srq);
            }
        }
        count
    }

    /// Forgets the posted requests whose completions will never come (the
    /// QP is about to be destroyed), giving `release` the receive slot of
    /// every forward among them. Their registrations stay held until this
    /// queue drops, after the QP.
    pub(super) fn abandon_posted(
        &mut self,
        on: ConnId,
        mut release: impl FnMut(ConnId, u32, bool),
    ) {
        while self.done != self.next {
            let op = self.ops[self.position(self.done)];
            self.done = self.done.wrapping_add(1);
            if let Some(origin) = op.forward_origin(on) {
                release(origin.conn, origin.slot, origin.from_srq);
            }
        }
    }

    /// Posts on `qp` (already in the error state) a signaled request
    /// behind those in flight, whose flushed completion names the newest of
    /// them and so retires them all. Nothing is staged (a failed
    /// connection unwound it).
    pub(super) fn post_drain(&mut self, qp: &mut QueuePair) {
        if self.used() == 0 {
            return;
        }
        debug_assert!(self.batch.is_empty());
        let newest = self.next.wrapping_sub(1);
        let drain = SendDescriptor::drain();
        if self
            .batch
            .push(self.wr_id(newest), SendFlags::SIGNALED, &drain)
        {
            // Errors add nothing: the connection is failed already.
            let _ = qp.post_list(&mut self.batch);
        }
        self.batch.clear();
    }
}

/// The kind a SEND's immediate gives it: with a user immediate's trailer
/// or without.
#[inline(always)]
fn message_kind(imm: Option<u32>) -> u32 {
    match imm {
        Some(_) => send_imm::MESSAGE_WITH_IMM,
        None => send_imm::MESSAGE,
    }
}
