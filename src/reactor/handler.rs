//! The callbacks a session implements.

use crate::error::Error;
use crate::session::PeerStatus;
use crate::verbs::WorkCompletion;

use super::{ConnId, Ctx, DatagramId, DatagramSource, SessionId};

/// Callbacks a session implements. Only `on_message` is required.
///
/// Callbacks run on the reactor thread and must not block; work they stage
/// through the [`Ctx`] goes out at the end of the pass.
///
/// # Sending: credits and `WouldBlock`
///
/// A SEND (and a WRITE with an immediate) consumes one of the receives the
/// peer has posted for this connection, and the reactor sends only what
/// the peer has announced room for (its credits), so the peer never sees
/// an RNR. Staging returns [`SendError::WouldBlock`](super::SendError::WouldBlock)
/// when no credit, send-queue entry or send slot is left. Nothing is lost
/// or queued then: keep the message and stage it again, in order, from
/// [`on_writable`](Self::on_writable), which the reactor calls once room
/// is back. Credits come back as the peer reposts the receives it
/// consumed, with its next message or a credit update the reactor sends
/// by itself, so a handler that retries from `on_writable` never stalls.
/// A handler that keeps received messages ([`Ctx::hold`]) holds its own
/// receives: the peer gets their credits back only once they are
/// released or forwarded. `examples/echo.rs` shows both rules.
#[allow(unused_variables)]
pub trait Handler {
    /// The peer's first credit update arrived: the connection can send.
    /// For a direct connection ([`Reactor::add_direct`](super::Reactor::add_direct)),
    /// called from `add_direct`: its QP is the handler's to post on.
    fn on_established(&mut self, ctx: &mut Ctx<'_>, conn: ConnId) {}
    /// A SEND arrived. `data` is valid only during the call.
    fn on_message(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, data: &[u8], imm: Option<u32>);
    /// Requests staged on `conn` were refused with
    /// [`SendError::WouldBlock`](super::SendError::WouldBlock) (while it
    /// was full, or still connecting), and completions since brought room
    /// back for every kind refused: a request of those kinds staged now is
    /// taken. Called once after any number of refusals, in the pass whose
    /// completions brought the room, after its completion and `on_idle`
    /// callbacks and its flush (a handler that answers in `on_message`
    /// while it has a backlog queues the answer behind it), before its
    /// peer-watch and removal callbacks; a refusal after the call waits
    /// anew. Not called for a connection that failed. Called on the
    /// handler of the session `conn` belongs to: a relay that stages on
    /// another session's connection shares one handler between the two
    /// (`Rc<RefCell<H>>`, below).
    fn on_writable(&mut self, ctx: &mut Ctx<'_>, conn: ConnId) {}
    /// A WRITE_WITH_IMM of `len` bytes landed in one of our exported regions.
    fn on_write_imm(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, imm: u32, len: u32) {}
    /// A SEND staged with sequence number `seq` completed locally, told by
    /// the default [`on_sends_complete`](Self::on_sends_complete) (as are
    /// the next two by theirs): a handler that overrides those is not
    /// called here. A wrapper that hands callbacks to an inner handler
    /// forwards the run methods too, or the inner handler's overrides are
    /// bypassed.
    fn on_send_complete(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, seq: u32) {}
    /// A WRITE staged with sequence number `seq` completed.
    fn on_write_complete(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, seq: u32) {}
    /// A READ staged with sequence number `seq` completed: the bytes are local.
    fn on_read_complete(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, seq: u32) {}
    /// `count` SENDs staged on `conn` completed, with the sequence numbers
    /// `first`, `first + 1`, … (wrapping), oldest first. A signaled
    /// completion retires every request staged before it, and each run of
    /// one kind comes in one call (a forward alone); `count` is at least 1.
    ///
    /// The default calls [`on_send_complete`](Self::on_send_complete) for
    /// each, in order. Override it to take a batch's completions in one
    /// call: then `on_send_complete` is not called for them.
    #[inline]
    fn on_sends_complete(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, first: u32, count: u32) {
        each_seq(ctx, conn, first, count, |ctx, conn, seq| {
            self.on_send_complete(ctx, conn, seq)
        });
    }
    /// `count` WRITEs completed, as [`on_sends_complete`](Self::on_sends_complete)
    /// for SENDs; the default calls [`on_write_complete`](Self::on_write_complete)
    /// for each.
    #[inline]
    fn on_writes_complete(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, first: u32, count: u32) {
        each_seq(ctx, conn, first, count, |ctx, conn, seq| {
            self.on_write_complete(ctx, conn, seq)
        });
    }
    /// `count` READs completed, as [`on_sends_complete`](Self::on_sends_complete)
    /// for SENDs; the default calls [`on_read_complete`](Self::on_read_complete)
    /// for each.
    #[inline]
    fn on_reads_complete(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, first: u32, count: u32) {
        each_seq(ctx, conn, first, count, |ctx, conn, seq| {
            self.on_read_complete(ctx, conn, seq)
        });
    }
    /// The connection failed (a completion error, a failed post, a peer
    /// that consumed more receives than it was granted:
    /// [`Error::CreditOverrun`], or one whose SEND the protocol has no place
    /// for: [`Error::MalformedMessage`]). It stays closed; other
    /// connections are unaffected.
    fn on_error(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, error: &Error) {}
    /// The peer watch ([`ReactorConfig::peer_check_interval`](super::ReactorConfig::peer_check_interval)) found the
    /// session's peer gone: it disconnected (`PeerStatus::Disconnected`) or
    /// was lost. Called once. The connections keep running, since the
    /// peer's last messages may still be queued: a server removes the
    /// session with [`Ctx::remove_session`] when it is done with it.
    fn on_peer_gone(&mut self, ctx: &mut Ctx<'_>, session: SessionId, status: &PeerStatus) {}
    /// A completion of a direct connection ([`Reactor::add_direct`]): a
    /// request its handler posted through [`Ctx::direct`] is done, `id`
    /// being the low 32 bits of the request's `wr_id`. Failed completions
    /// do not come here: they fail the connection ([`on_error`](Self::on_error)).
    ///
    /// [`Reactor::add_direct`]: super::Reactor::add_direct
    fn on_direct_completion(
        &mut self,
        ctx: &mut Ctx<'_>,
        conn: ConnId,
        id: u32,
        completion: &WorkCompletion,
    ) {
    }
    /// A datagram arrived on endpoint `dgram`
    /// ([`Reactor::add_datagram`](super::Reactor::add_datagram)) from
    /// where `source` says (its claim, not a proof: filter on it before
    /// reading `data`). `data` is the payload, as long as the device
    /// reported, valid only during the call. Datagrams lost on the way
    /// are not told: a sequence number in the payload shows the gaps.
    fn on_datagram(
        &mut self,
        ctx: &mut Ctx<'_>,
        dgram: DatagramId,
        source: &DatagramSource<'_>,
        data: &[u8],
    ) {
    }
    /// A completion of endpoint `dgram` failed, or the device refused a
    /// post: the endpoint receives and sends no more.
    fn on_datagram_error(&mut self, ctx: &mut Ctx<'_>, dgram: DatagramId, error: &Error) {}
    /// A pass found no completions (busy poll) or a wait timed out, and
    /// this handler's last `on_idle` returned [`Idle::Again`] (or it has
    /// not been called yet): what it returns now says whether it is
    /// called on such passes again. Not a timer: under steady traffic no
    /// pass is empty. The default returns [`Idle::Done`], so a handler
    /// that does not implement it costs an empty pass nothing. A reactor of direct connections only lends its CQs here:
    /// the handler of a direct connection may spin on them
    /// ([`Ctx::spin`]).
    fn on_idle(&mut self, ctx: &mut Ctx<'_>) -> Idle {
        Idle::Done
    }
}

/// What a handler's [`on_idle`](Handler::on_idle) asks of the passes that
/// find nothing after it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Idle {
    /// Call `on_idle` again on the next pass that finds nothing: for work
    /// that no completion brings (pacing by the clock, draining a channel
    /// fed by another thread, spinning on a direct connection).
    Again,
    /// Do not call this session's (or datagram endpoint's) `on_idle`
    /// again, ever: a handler that may have work no completion brings
    /// later (from a [`Waker`](super::Waker), or the runtime's
    /// `RuntimeHandle::wake_all`) returns `Again`.
    Done,
}

/// Calls `each` with the sequence numbers `first`, `first + 1`, …
/// (`count` of them, wrapping), in order: the defaults of
/// [`Handler::on_sends_complete`] and its kin. One at a time (the latency
/// path) goes straight through; the loop, which keeps its state across
/// calls, is out of line.
#[inline(always)]
fn each_seq(
    ctx: &mut Ctx<'_>,
    conn: ConnId,
    first: u32,
    count: u32,
    mut each: impl FnMut(&mut Ctx<'_>, ConnId, u32),
) {
    if count == 1 {
        each(ctx, conn, first);
    } else {
        each_seq_of_run(ctx, conn, first, count, each);
    }
}

/// [`each_seq`] for a run of several.
#[inline(never)]
fn each_seq_of_run(
    ctx: &mut Ctx<'_>,
    conn: ConnId,
    first: u32,
    count: u32,
    mut each: impl FnMut(&mut Ctx<'_>, ConnId, u32),
) {
    for n in 0..count {
        each(ctx, conn, first.wrapping_add(n));
    }
}

impl<H: Handler + ?Sized> Handler for Box<H> {
    fn on_established(&mut self, ctx: &mut Ctx<'_>, conn: ConnId) {
        (**self).on_established(ctx, conn)
    }
    fn on_message(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, data: &[u8], imm: Option<u32>) {
        (**self).on_message(ctx, conn, data, imm)
    }
    fn on_writable(&mut self, ctx: &mut Ctx<'_>, conn: ConnId) {
        (**self).on_writable(ctx, conn)
    }
    fn on_write_imm(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, imm: u32, len: u32) {
        (**self).on_write_imm(ctx, conn, imm, len)
    }
    fn on_send_complete(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, seq: u32) {
        (**self).on_send_complete(ctx, conn, seq)
    }
    fn on_write_complete(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, seq: u32) {
        (**self).on_write_complete(ctx, conn, seq)
    }
    fn on_read_complete(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, seq: u32) {
        (**self).on_read_complete(ctx, conn, seq)
    }
    fn on_sends_complete(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, first: u32, count: u32) {
        (**self).on_sends_complete(ctx, conn, first, count)
    }
    fn on_writes_complete(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, first: u32, count: u32) {
        (**self).on_writes_complete(ctx, conn, first, count)
    }
    fn on_reads_complete(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, first: u32, count: u32) {
        (**self).on_reads_complete(ctx, conn, first, count)
    }
    fn on_error(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, error: &Error) {
        (**self).on_error(ctx, conn, error)
    }
    fn on_direct_completion(
        &mut self,
        ctx: &mut Ctx<'_>,
        conn: ConnId,
        id: u32,
        completion: &WorkCompletion,
    ) {
        (**self).on_direct_completion(ctx, conn, id, completion)
    }
    fn on_idle(&mut self, ctx: &mut Ctx<'_>) -> Idle {
        (**self).on_idle(ctx)
    }
    fn on_datagram(
        &mut self,
        ctx: &mut Ctx<'_>,
        dgram: DatagramId,
        source: &DatagramSource<'_>,
        data: &[u8],
    ) {
        (**self).on_datagram(ctx, dgram, source, data)
    }
    fn on_datagram_error(&mut self, ctx: &mut Ctx<'_>, dgram: DatagramId, error: &Error) {
        (**self).on_datagram_error(ctx, dgram, error)
    }
    fn on_peer_gone(&mut self, ctx: &mut Ctx<'_>, session: SessionId, status: &PeerStatus) {
        (**self).on_peer_gone(ctx, session, status)
    }
}

/// One handler shared by several sessions of a reactor (a relay's upstream
/// and downstream, a mesh's peers), which the owner can also inspect between
/// passes. Callbacks never nest, so the borrow never conflicts.
impl<H: Handler> Handler for std::rc::Rc<std::cell::RefCell<H>> {
    fn on_established(&mut self, ctx: &mut Ctx<'_>, conn: ConnId) {
        self.borrow_mut().on_established(ctx, conn)
    }
    fn on_message(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, data: &[u8], imm: Option<u32>) {
        self.borrow_mut().on_message(ctx, conn, data, imm)
    }
    fn on_writable(&mut self, ctx: &mut Ctx<'_>, conn: ConnId) {
        self.borrow_mut().on_writable(ctx, conn)
    }
    fn on_write_imm(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, imm: u32, len: u32) {
        self.borrow_mut().on_write_imm(ctx, conn, imm, len)
    }
    fn on_send_complete(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, seq: u32) {
        self.borrow_mut().on_send_complete(ctx, conn, seq)
    }
    fn on_write_complete(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, seq: u32) {
        self.borrow_mut().on_write_complete(ctx, conn, seq)
    }
    fn on_read_complete(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, seq: u32) {
        self.borrow_mut().on_read_complete(ctx, conn, seq)
    }
    fn on_sends_complete(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, first: u32, count: u32) {
        self.borrow_mut().on_sends_complete(ctx, conn, first, count)
    }
    fn on_writes_complete(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, first: u32, count: u32) {
        self.borrow_mut()
            .on_writes_complete(ctx, conn, first, count)
    }
    fn on_reads_complete(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, first: u32, count: u32) {
        self.borrow_mut().on_reads_complete(ctx, conn, first, count)
    }
    fn on_error(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, error: &Error) {
        self.borrow_mut().on_error(ctx, conn, error)
    }
    fn on_direct_completion(
        &mut self,
        ctx: &mut Ctx<'_>,
        conn: ConnId,
        id: u32,
        completion: &WorkCompletion,
    ) {
        self.borrow_mut()
            .on_direct_completion(ctx, conn, id, completion)
    }
    fn on_idle(&mut self, ctx: &mut Ctx<'_>) -> Idle {
        self.borrow_mut().on_idle(ctx)
    }
    fn on_datagram(
        &mut self,
        ctx: &mut Ctx<'_>,
        dgram: DatagramId,
        source: &DatagramSource<'_>,
        data: &[u8],
    ) {
        self.borrow_mut().on_datagram(ctx, dgram, source, data)
    }
    fn on_datagram_error(&mut self, ctx: &mut Ctx<'_>, dgram: DatagramId, error: &Error) {
        self.borrow_mut().on_datagram_error(ctx, dgram, error)
    }
    fn on_peer_gone(&mut self, ctx: &mut Ctx<'_>, session: SessionId, status: &PeerStatus) {
        self.borrow_mut().on_peer_gone(ctx, session, status)
    }
}
