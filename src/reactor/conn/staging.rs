//! Send staging: admission (credits, send-queue entries, send slots), the
//! send-queue ring of operations with selective signaling, and the staged
//! requests that go out with one doorbell.

use crate::error::Error;
use crate::verbs::{
    AccessFlags, LocalSlice, Registration, RemoteSlice, SendDescriptor, SendFlags, SendOpcode, Sge,
};

use super::credit::send_imm;
use super::ring::SlotSource;
use super::{Conn, ConnId, ConnState, IMM_TRAILER_LEN, REFUSED, SendError};
use crate::reactor::slab::Key;

/// An operation on the send queue, remembered until a signaled completion
/// at or after it proves it done. Plain data of 16 bytes: staging and
/// retiring one copies two words and runs no drop glue (the registration a
/// request holds by handle, the rare case, waits in `Conn::owned` beside it).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct SqOp {
    pub(crate) kind: OpKind,
    /// For a forward: the slot is one of the reactor's SRQ.
    pub(crate) from_srq: bool,
    /// For a WRITE, READ or forward: how the registration of the local
    /// memory it points at is held until the request is known complete, so
    /// the memory stays registered and mapped while the device may use it.
    pub(crate) keep: Keep,
    /// For a forward, the receive slot of its origin to repost.
    pub(crate) slot: u32,
    /// For a forward: the slab index and generation of the connection
    /// whose receive slot this SEND carried. It is of the same reactor
    /// (`Ctx::forward` refuses another's), so its owner is this
    /// connection's: storing the whole id would double the op.
    origin_index: u32,
    origin_generation: u32,
}

/// Where a forwarded message came from: its connection and receive slot,
/// which go back there once the forward completes.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ForwardOrigin {
    pub(crate) conn: ConnId,
    pub(crate) slot: u32,
    /// The slot is one of the reactor's SRQ.
    pub(crate) from_srq: bool,
}

/// How a request holds the registration of its local memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum Keep {
    /// It points at the connection's own send ring (or nothing).
    #[default]
    Nothing,
    /// The connection's kept registration (`Conn::kept`), counted in
    /// `kept_in_flight`: the common case of one buffer region used over and
    /// over costs no atomic reference count per request.
    Cached,
    /// A handle of its own, in `Conn::owned` at the op's position.
    Own,
}

// Two words: the size the send-queue ring was shrunk to.
const _: () = assert!(std::mem::size_of::<SqOp>() == 16);

impl SqOp {
    pub(super) fn of(kind: OpKind) -> Self {
        Self {
            kind,
            ..Self::default()
        }
    }

    /// A forward of `origin`'s receive slot.
    fn forward(origin: ForwardOrigin, keep: Keep) -> Self {
        let key = origin.conn.key();
        Self {
            kind: OpKind::Forward,
            from_srq: origin.from_srq,
            keep,
            slot: origin.slot,
            origin_index: key.index,
            origin_generation: key.generation,
        }
    }

    /// For a forward staged on connection `on`: the connection its
    /// receive slot came from.
    #[inline]
    pub(crate) fn origin(&self, on: ConnId) -> Option<ConnId> {
        (self.kind == OpKind::Forward).then(|| {
            ConnId(Key {
                index: self.origin_index,
                generation: self.origin_generation,
                owner: on.key().owner,
            })
        })
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum OpKind {
    #[default]
    Credit,
    Send,
    Write,
    Read,
    /// A SEND straight out of a held receive slot of another connection.
    Forward,
}

impl Conn {
    /// Send-queue entries in use (posted or staged, not known complete).
    #[inline]
    pub(super) fn sq_used(&self) -> u32 {
        self.sq_next.wrapping_sub(self.sq_done)
    }

    /// Whether posting a request now would be refused, and why.
    #[inline]
    fn admit(&self, consumes_recv: bool, needs_slot: bool) -> Result<(), SendError> {
        // One compare on the busy path, where the state is what it
        // almost always is.
        if self.state != ConnState::Established {
            return Err(self.refusal());
        }
        // One SQ entry and one credit stay reserved for credit updates, so a
        // busy sender can always tell its peer that it may send again.
        if self.sq_used() + 1 >= self.sq_depth || self.batch.is_full() {
            return Err(SendError::WouldBlock);
        }
        if consumes_recv && self.credits() < 2 {
            return Err(SendError::WouldBlock);
        }
        if needs_slot && self.send_in_use >= self.send_slots {
            return Err(SendError::WouldBlock);
        }
        Ok(())
    }

    /// Why a connection that is not established refuses a request.
    #[cold]
    fn refusal(&self) -> SendError {
        debug_assert_ne!(self.state, ConnState::Established);
        match self.state {
            ConnState::Connecting | ConnState::Established => SendError::WouldBlock,
            ConnState::Failed | ConnState::Removed => SendError::Closed,
            ConnState::Direct => direct_refused(),
        }
    }

    /// Records `op` in the SQ ring (with the registration handle an op of
    /// `Keep::Own` holds, `owned`), decides its signaling (always if
    /// `force_signal`), and stages it.
    #[inline(always)]
    pub(super) fn stage_signaled(
        &mut self,
        request: SendDescriptor,
        op: SqOp,
        owned: Option<Registration>,
        force_signal: bool,
    ) -> u32 {
        let seq = self.sq_next;
        self.sq_next = seq.wrapping_add(1);
        let at = (seq & (self.sq_depth - 1)) as usize;
        // An own handle goes with `Keep::Own` and nothing else, and the
        // op that had this position before took its handle when it retired.
        debug_assert_eq!(op.keep == Keep::Own, owned.is_some());
        debug_assert!(self.owned[at].is_none());
        self.ops[at] = op;
        if let Some(owned) = owned {
            // Empty: the op that was here retired and took its handle.
            // (Moved in here: `is_some()` and a move of the whole option
            // left a check for a handle to drop on every request's path.)
            self.owned[at] = Some(owned);
        }
        // Selective signaling: every Nth request, and early whenever the SQ or
        // the slot ring gets low, so resources held by unsignaled requests are
        // always freed by a later signaled one.
        let sq_left = self.sq_depth - self.sq_used();
        let slots_left = self.send_slots - self.send_in_use;
        self.since_signal += 1;
        let signal = force_signal
            || self.since_signal >= self.signal_interval
            || sq_left <= self.signal_interval
            || slots_left < self.signal_interval;
        let mut flags = SendFlags::empty();
        if signal {
            flags |= SendFlags::SIGNALED;
            self.since_signal = 0;
        }
        if request.local.len <= self.max_inline && request.opcode != SendOpcode::Read {
            flags |= SendFlags::INLINE;
        }
        // admit() checked the room.
        let pushed = self.batch.push(self.send_wr_id(seq), flags, &request);
        debug_assert!(pushed, "staged past a full list");
        seq
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
            return Err(SendError::TooLarge {
                len: capacity,
                max: self.max_payload(),
            });
        }
        self.admit(true, true)?;
        let slot = (self.send_head + self.send_in_use) & (self.send_slots - 1);
        let start = slot as usize * self.slot_size;
        // SAFETY: the send ring is registered while the connection lives;
        // the slot is free (no posted request references it: slots are
        // released only when a completion proves their SEND done) and lies
        // inside the ring (`capacity` and a trailer fit a slot); we hold
        // &mut self, and nothing else reaches the send ring (it has no
        // remote access).
        let bytes = unsafe {
            std::slice::from_raw_parts_mut(
                self.send_ring.ptr.add(start),
                capacity + IMM_TRAILER_LEN,
            )
        };
        let Some(len) = fill(&mut bytes[..capacity]) else {
            return Err(SendError::Cancelled);
        };
        let len = len.min(capacity);
        let wire_len = match imm {
            Some(imm) => {
                bytes[len..len + IMM_TRAILER_LEN].copy_from_slice(&imm.to_le_bytes());
                len + IMM_TRAILER_LEN
            }
            None => len,
        };
        self.send_in_use += 1;
        let sge = Sge {
            addr: self.send_ring.addr + start as u64,
            len: wire_len as u32,
            lkey: self.send_ring.lkey,
        };
        Ok(self.stage_credited_send(sge, imm.is_some(), SqOp::of(OpKind::Send), None))
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
        // Without a handle of its own the forward rides on the kept
        // registration, which must then be the source ring's.
        debug_assert!(registration.is_some() || self.keeps(source.registration_id));
        let wire_len = len + imm.map_or(0, |_| IMM_TRAILER_LEN);
        if len > self.max_payload() || wire_len > source.size {
            return Err(SendError::TooLarge {
                len,
                max: self
                    .max_payload()
                    .min(source.size.saturating_sub(IMM_TRAILER_LEN)),
            });
        }
        self.admit(true, false)?;
        if let Some(imm) = imm {
            // SAFETY: `source` is a receive slot the caller holds (its
            // receive completed and it is not reposted or sent on until this
            // forward completes), so no request reads or writes it now, and
            // `len + IMM_TRAILER_LEN` bytes lie inside it (checked above).
            unsafe {
                source
                    .ptr
                    .add(len)
                    .cast::<u32>()
                    .write_unaligned(imm.to_le());
            }
        }
        let sge = Sge {
            addr: source.addr,
            len: wire_len as u32,
            lkey: source.lkey,
        };
        let (keep, owned) = self.keep(source.registration_id, || registration);
        let op = SqOp::forward(origin, keep);
        Ok(self.stage_credited_send(sge, imm.is_some(), op, owned))
    }

    /// Stages a SEND (address, length, lkey in `sge`, a user immediate's
    /// trailer included if `with_imm`) that consumes one peer receive, with
    /// our receive count in its immediate. The count cannot grow before the
    /// doorbell: receives are reposted only after the doorbell of the pass
    /// that staged this.
    #[inline]
    fn stage_credited_send(
        &mut self,
        sge: Sge,
        with_imm: bool,
        op: SqOp,
        owned: Option<Registration>,
    ) -> u32 {
        let kind = match with_imm {
            true => send_imm::MESSAGE_WITH_IMM,
            false => send_imm::MESSAGE,
        };
        let request = SendDescriptor::send(sge, Some(send_imm::encode(kind, self.posted)));
        self.consumed = self.consumed.wrapping_add(1);
        self.has_staged_send = true;
        self.stage_signaled(request, op, owned, false)
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
            return Err(SendError::Invalid(Error::InvalidArgument(
                "local and remote lengths of an RDMA operation differ",
            )));
        }
        self.admit(imm.is_some(), false)?;
        if imm.is_some() {
            self.consumed = self.consumed.wrapping_add(1);
        }
        let request = SendDescriptor::write(Sge::from(local), remote, imm);
        let (keep, owned) = self.keep(local.registration().id(), || {
            Some(local.registration().clone())
        });
        let op = SqOp {
            keep,
            ..SqOp::of(OpKind::Write)
        };
        Ok(self.stage_signaled(request, op, owned, force_signal))
    }

    /// Stages a READ of `remote` into `local`.
    #[inline(always)]
    pub(crate) fn stage_read(
        &mut self,
        local: &LocalSlice<'_>,
        remote: RemoteSlice,
    ) -> Result<u32, SendError> {
        if local.len() != remote.len() {
            return Err(SendError::Invalid(Error::InvalidArgument(
                "local and remote lengths of an RDMA operation differ",
            )));
        }
        if !local.access.contains(AccessFlags::LOCAL_WRITE) {
            return Err(SendError::Invalid(Error::InvalidArgument(
                "a READ target must be registered with LOCAL_WRITE",
            )));
        }
        self.admit(false, false)?;
        let request = SendDescriptor::read(Sge::from(local), remote);
        let (keep, owned) = self.keep(local.registration().id(), || {
            Some(local.registration().clone())
        });
        let op = SqOp {
            keep,
            ..SqOp::of(OpKind::Read)
        };
        // Always signaled: a READ's completion is the only sign its data has
        // landed, and callers wait for it.
        Ok(self.stage_signaled(request, op, owned, true))
    }

    /// Signals the last staged request, so it and everything before it
    /// report completion without waiting for the signaling interval.
    pub(crate) fn signal_last_staged(&mut self) {
        if self.batch.flag_last(SendFlags::SIGNALED) {
            self.since_signal = 0;
        }
    }

    /// How many ops a signaled completion of `seq` retires: it and every
    /// earlier one (RC completes the send queue in order). Zero if `seq` is
    /// not in flight.
    #[inline]
    pub(crate) fn retire_count(&self, seq: u32) -> u32 {
        let count = seq.wrapping_sub(self.sq_done).wrapping_add(1);
        if count <= self.sq_used() { count } else { 0 }
    }

    /// Retires the oldest op, releasing its send slot (and the
    /// registration it kept: the request is complete, so the device no
    /// longer uses the memory).
    #[inline(always)]
    pub(crate) fn pop_oldest(&mut self) -> (u32, SqOp) {
        // Entries outside [sq_done, sq_next) are stale: never retire one.
        debug_assert!(self.sq_used() > 0);
        let seq = self.sq_done;
        let at = (seq & (self.sq_depth - 1)) as usize;
        let op = self.ops[at];
        self.sq_done = seq.wrapping_add(1);
        match (op.kind, op.keep) {
            (OpKind::Send, _) => {
                self.send_head = (self.send_head + 1) & (self.send_slots - 1);
                self.send_in_use -= 1;
            }
            (_, Keep::Cached) => self.kept_in_flight -= 1,
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
        if matches!(op.kind, OpKind::Send | OpKind::Write | OpKind::Read) {
            while run < most
                && self.ops[(self.sq_done & (self.sq_depth - 1)) as usize].kind == op.kind
            {
                self.pop_oldest();
                run += 1;
            }
        }
        (seq, op, run)
    }

    /// True if the connection's kept registration is the one `id` names.
    #[inline]
    pub(crate) fn keeps(&self, id: usize) -> bool {
        self.kept.as_ref().is_some_and(|kept| kept.id() == id)
    }

    /// Holds the registration `id` names for one more request: through the
    /// kept one if it is that (no reference count touched), else a handle
    /// from `handle`, which becomes the kept one when nothing in flight
    /// uses the old, or else is returned for the op to own.
    #[inline]
    fn keep(
        &mut self,
        id: usize,
        handle: impl FnOnce() -> Option<Registration>,
    ) -> (Keep, Option<Registration>) {
        if self.keeps(id) {
            self.kept_in_flight += 1;
            return (Keep::Cached, None);
        }
        let Some(registration) = handle() else {
            return (Keep::Nothing, None);
        };
        if self.kept_in_flight == 0 {
            self.kept = Some(registration);
            self.kept_in_flight = 1;
            (Keep::Cached, None)
        } else {
            (Keep::Own, Some(registration))
        }
    }

    /// Rings the doorbell for everything staged. After a failed post, notes
    /// how many of them the device never got, which `fail` need not wait
    /// for (none if the provider did not say: all are then held as posted).
    #[inline]
    pub(crate) fn post_staged(&mut self) -> crate::Result<()> {
        // Never behind a refused request: the connection fails first
        // (`Reactor::fail_refused`), and `Conn::fail` unwinds the newest.
        debug_assert!(self.unposted == 0 || self.batch.is_empty());
        let staged = self.batch.len() as u32;
        let result = self.qp.post_list(&mut self.batch);
        if let Err(error) = &result {
            // The connection fails before anything else is posted on it (at
            // the next flush's start, or in the walk that rang this), and
            // `fail` unwinds the count. The mark is set even if the provider
            // did not say which request it refused (then all are held as
            // posted and the count is 0): nothing may be rung alone behind
            // the refusal meanwhile. (Added, not stored: the assertion above
            // says nothing is left from before, and a sum keeps every
            // unposted request unwound even if that ever broke.)
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
    /// that order), and no refused doorbell of this pass waits for the
    /// connection to fail.
    #[inline]
    pub(crate) fn can_ring_alone(&self) -> bool {
        self.batch.is_empty() && self.unposted == 0
    }
}

/// What staging on a direct connection gets: its handler posts there
/// itself ([`Ctx::direct`](crate::reactor::Ctx::direct)).
#[cold]
fn direct_refused() -> SendError {
    SendError::Invalid(crate::Error::InvalidArgument(
        "a direct connection is posted on through Ctx::direct",
    ))
}
