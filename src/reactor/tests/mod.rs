//! The reactor's failure paths over the loopback device, where a test can
//! make a provider refuse part of a posted list (which a NIC does when its
//! queue fills mid-list) and look at what each connection holds, and, on a
//! shared receive queue, where every one of its slots is.

use std::cell::RefCell;
use std::rc::Rc;

use crate::error::Error;
use crate::session::CqChoice;
use crate::verbs::{
    AccessFlags, CompletionQueue, Context, MemoryRegion, ProtectionDomain, QpConfig, QueuePair,
    RecvRequest, WorkCompletion, WorkRequest, refuse_sends_after, refuse_srq_recvs_after,
    reuse_qpn_next,
};

use super::{ConnId, Ctx, Handler, HeldRecv, Idle, Reactor, ReactorConfig, SessionId};

/// Passes a test waits for something before failing.
const MAX_PASSES: usize = 100_000;
/// Receive slots per connection.
const RECV_DEPTH: u32 = 16;
/// Each connection's share of the SRQ, in the SRQ tests: room to hold more
/// messages on two connections than one SRQ post takes (`MAX_REPOST`).
const SRQ_SHARE: u32 = 48;
/// Receives of the SRQ, in the SRQ tests: four connections' shares and
/// headroom.
const SRQ_DEPTH: u32 = 4 * SRQ_SHARE + 64;

/// What one session's handler saw.
#[derive(Debug, Default)]
struct Seen {
    established: bool,
    messages: Vec<Vec<u8>>,
    /// Messages kept while `hold` is set.
    held: Vec<HeldRecv>,
    hold: bool,
    /// Every error's errno (if it has one) and text.
    errors: Vec<(Option<i32>, String)>,
    /// The session the handler asks to remove when told of an error (its
    /// own, as a server retiring a failed peer does).
    remove_on_error: Option<SessionId>,
    /// Every message is answered with a copy, from `on_message`.
    echo: bool,
    /// Held messages forwarded on a connection when the handler is told of
    /// an error (once).
    forward_on_error: Option<(ConnId, Vec<HeldRecv>)>,
    /// Held messages released by the next `on_idle`.
    release_on_idle: Vec<HeldRecv>,
    /// Each `on_writable`'s connection, and whether the SEND of
    /// `send_when_writable` it made then (if any) was taken.
    writable: Vec<(ConnId, bool)>,
    /// What `on_writable` sends, if anything: once, or with
    /// `send_until_refused` until a SEND is refused.
    send_when_writable: Option<Vec<u8>>,
    send_until_refused: bool,
    /// `on_idle` calls.
    idle_calls: u32,
    /// What `on_idle` returns once it has been called this often
    /// (before: `Idle::Again`).
    idle_done_after: Option<u32>,
}

#[derive(Debug, Default)]
struct Probe(Rc<RefCell<Seen>>);

impl Handler for Probe {
    fn on_established(&mut self, _: &mut Ctx<'_>, _: ConnId) {
        self.0.borrow_mut().established = true;
    }
    fn on_message(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, data: &[u8], _: Option<u32>) {
        let mut seen = self.0.borrow_mut();
        seen.messages.push(data.to_vec());
        if seen.echo {
            ctx.send(conn, data, None).expect("room for the answer");
        }
        if seen.hold {
            let held = ctx.hold().expect("in on_message");
            seen.held.push(held);
        }
        drop(seen);
        due::when_received(ctx, conn);
    }
    fn on_send_complete(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, _: u32) {
        due::when_sent(ctx, conn);
    }
    fn on_error(&mut self, ctx: &mut Ctx<'_>, _: ConnId, error: &Error) {
        let mut seen = self.0.borrow_mut();
        seen.errors.push((error.errno(), error.to_string()));
        if let Some(session) = seen.remove_on_error {
            ctx.remove_session(session);
        }
        if let Some((to, held)) = seen.forward_on_error.take() {
            forward_all(ctx, to, held);
        }
        drop(seen);
        now::when_told(ctx);
    }
    fn on_writable(&mut self, ctx: &mut Ctx<'_>, conn: ConnId) {
        let mut seen = self.0.borrow_mut();
        let taken = match &seen.send_when_writable {
            Some(data) => {
                let taken = ctx.send(conn, data, None).is_ok();
                while seen.send_until_refused && ctx.send(conn, data, None).is_ok() {}
                taken
            }
            None => false,
        };
        seen.writable.push((conn, taken));
    }
    fn on_idle(&mut self, ctx: &mut Ctx<'_>) -> Idle {
        for held in std::mem::take(&mut self.0.borrow_mut().release_on_idle) {
            if let Err((err, _)) = ctx.release(held) {
                panic!("releasing: {err}");
            }
        }
        let mut seen = self.0.borrow_mut();
        seen.idle_calls += 1;
        match seen.idle_done_after {
            Some(calls) if seen.idle_calls >= calls => Idle::Done,
            _ => Idle::Again,
        }
    }
}

struct End {
    session: SessionId,
    conn: ConnId,
    seen: Rc<RefCell<Seen>>,
}

/// What a reactor ignored: (foreign completions, reclaimed SRQ receives).
fn ignored<H: Handler, L: super::PeerLink>(reactor: &Reactor<H, L>) -> (u64, u64) {
    let counters = reactor.counters();
    (counters.foreign_completions, counters.reclaimed_receives)
}

fn reactor(pd: &ProtectionDomain) -> Reactor<Probe, ()> {
    let config = ReactorConfig {
        slot_size: 64,
        recv_depth: RECV_DEPTH,
        send_slots: 16,
        sq_depth: 64,
        ..ReactorConfig::default()
    };
    Reactor::new(pd, config).expect("a reactor on the loopback device")
}

/// A reactor whose connections take their receives from one SRQ of
/// `SRQ_DEPTH`, `SRQ_SHARE` each.
fn srq_reactor(pd: &ProtectionDomain) -> Reactor<Probe, ()> {
    let config = ReactorConfig {
        slot_size: 64,
        recv_depth: SRQ_SHARE,
        srq_depth: SRQ_DEPTH,
        send_slots: 16,
        sq_depth: 64,
        ..ReactorConfig::default()
    };
    Reactor::new(pd, config).expect("an SRQ reactor on the loopback device")
}

/// A loopback QP on the reactor's CQ (and its SRQ, if it has one), with
/// `access`.
fn loopback_qp<H: Handler>(
    reactor: &mut Reactor<H, ()>,
    pd: &ProtectionDomain,
    name: &str,
    access: AccessFlags,
) -> QueuePair {
    let spec = reactor.qp_spec_with_access(name, access);
    let CqChoice::Shared(cq) = spec.cq else {
        panic!("qp_spec did not share the reactor's CQ");
    };
    match &spec.srq {
        Some(srq) => pd.create_qp_with_srq(&cq, &cq, srq, &spec.qp),
        None => pd.create_qp(&cq, &cq, &spec.qp),
    }
    .expect("a loopback QP")
}

/// Two loopback QPs on the reactor's CQ (and its SRQ, if it has one), with
/// `access`, connected to each other.
fn connected_qps<H: Handler>(
    reactor: &mut Reactor<H, ()>,
    pd: &ProtectionDomain,
    access: AccessFlags,
) -> [QueuePair; 2] {
    let mut a = loopback_qp(reactor, pd, "a", access);
    let mut b = loopback_qp(reactor, pd, "b", access);
    let (to_a, to_b) = (a.endpoint(), b.endpoint());
    a.connect(&to_b).expect("connect");
    b.connect(&to_a).expect("connect");
    [a, b]
}

/// A session of one connection, on `qp`, with a probe of its own.
fn add_end(reactor: &mut Reactor<Probe, ()>, qp: QueuePair) -> End {
    let seen = Rc::new(RefCell::new(Seen::default()));
    let session: SessionId = reactor.add(vec![qp], Probe(Rc::clone(&seen))).expect("add");
    let conn = reactor.conns(session).next().expect("one connection");
    End {
        session,
        conn,
        seen,
    }
}

/// A pair of sessions of one connection each, one on each of two reactors,
/// connected to each other and established.
fn add_pair_across(
    reactor: &mut Reactor<Probe, ()>,
    other: &mut Reactor<Probe, ()>,
    pd: &ProtectionDomain,
) -> (End, End) {
    let access = AccessFlags::empty();
    let mut here = loopback_qp(reactor, pd, "here", access);
    let mut there = loopback_qp(other, pd, "there", access);
    let (to_here, to_there) = (here.endpoint(), there.endpoint());
    here.connect(&to_there).expect("connect");
    there.connect(&to_here).expect("connect");
    let (here, there) = (add_end(reactor, here), add_end(other, there));
    for _ in 0..MAX_PASSES {
        if here.seen.borrow().established && there.seen.borrow().established {
            return (here, there);
        }
        reactor.turn().expect("a reactor pass");
        other.turn().expect("a pass of the other reactor");
    }
    panic!("the pair across two reactors never established");
}

/// Releases every held message, as a callback would.
fn release_all(reactor: &mut Reactor<Probe, ()>, held: Vec<HeldRecv>) {
    reactor.with_ctx(|ctx| {
        for message in held {
            if let Err((err, _)) = ctx.release(message) {
                panic!("releasing: {err}");
            }
        }
    });
}

/// Forwards every held message on `to`, from a callback's `ctx`.
fn forward_all(ctx: &mut Ctx<'_>, to: ConnId, held: Vec<HeldRecv>) {
    for message in held {
        if let Err((err, _)) = ctx.forward(to, message, None) {
            panic!("forwarding: {err}");
        }
    }
}

/// Two sessions of one connection each, connected to each other and
/// established.
fn add_pair(reactor: &mut Reactor<Probe, ()>, pd: &ProtectionDomain) -> (End, End) {
    let access = AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
    let [a, b] = connected_qps(reactor, pd, access);
    let (a, b) = (add_end(reactor, a), add_end(reactor, b));
    run_until(reactor, "both ends established", |_| {
        a.seen.borrow().established && b.seen.borrow().established
    });
    (a, b)
}

#[track_caller]
fn run_until(
    reactor: &mut Reactor<Probe, ()>,
    what: &str,
    done: impl FnMut(&Reactor<Probe, ()>) -> bool,
) {
    run_within(reactor, MAX_PASSES, what, done);
}

/// Runs passes until `done`, failing after `passes` of them.
#[track_caller]
fn run_within(
    reactor: &mut Reactor<Probe, ()>,
    passes: usize,
    what: &str,
    mut done: impl FnMut(&Reactor<Probe, ()>) -> bool,
) {
    for _ in 0..passes {
        if done(reactor) {
            return;
        }
        reactor.turn().expect("a reactor pass");
    }
    panic!("not within {passes} passes: {what}");
}

/// Runs `passes` passes, whatever they find.
fn turns(reactor: &mut Reactor<Probe, ()>, passes: usize) {
    for _ in 0..passes {
        reactor.turn().expect("a pass");
    }
}

/// Sends `data` on `conn`, running passes while its credits are spent.
#[track_caller]
fn send(reactor: &mut Reactor<Probe, ()>, conn: ConnId, data: &[u8]) {
    for _ in 0..MAX_PASSES {
        match reactor.with_ctx(|ctx| ctx.send(conn, data, None)) {
            Ok(_) => return,
            Err(super::SendError::WouldBlock) => {
                reactor.turn().expect("a reactor pass");
            }
            Err(err) => panic!("sending: {err}"),
        }
    }
    panic!("no credit within {MAX_PASSES} passes");
}

/// A QP of the test's own, on a CQ of its own, connected to a reactor
/// connection: it speaks the reactor's protocol by hand (every SEND a
/// SEND_WITH_IMM whose immediate carries a kind and a receive count), and
/// keeps to its credits only if the test does.
struct RawPeer {
    qp: QueuePair,
    cq: CompletionQueue,
    /// Its SENDs' payload and its receives' buffer (the reactor sends it
    /// only credit updates, which carry none).
    buf: MemoryRegion,
    /// Its SENDs posted.
    posted: u64,
    /// Its SENDs that completed: each consumed a receive of the reactor's.
    delivered: u64,
    /// Its SENDs that failed (the reactor's end stopped taking them).
    failed: u64,
    /// Credit updates of the reactor's that it received.
    updates: u64,
}

/// The `wr_id` bit of a raw peer's receives.
const RAW_RECV: u64 = 1 << 63;

impl RawPeer {
    /// Receives it posts for the reactor's credit updates, and claims in
    /// its SENDs (it never needs to repost them).
    const RECVS: u32 = 200;
    /// Immediate kinds (`credit::send_imm`): a message, a credit update.
    const MESSAGE: u32 = 0;
    const CREDIT: u32 = 1;

    /// A raw peer connected to a new session of one connection on
    /// `reactor` (its QP on the reactor's CQ, and SRQ if it has one).
    fn connect(
        reactor: &mut Reactor<Probe, ()>,
        ctx: &Context,
        pd: &ProtectionDomain,
    ) -> (End, Self) {
        let mut ours = loopback_qp(reactor, pd, "reactor end", AccessFlags::empty());
        let cq = ctx.create_cq(8192, None).expect("the raw peer's CQ");
        let config = QpConfig {
            max_send_wr: 4096,
            ..QpConfig::default()
        };
        let mut qp = pd.create_qp(&cq, &cq, &config).expect("the raw peer's QP");
        let (to_ours, to_raw) = (ours.endpoint(), qp.endpoint());
        ours.connect(&to_raw).expect("connect");
        qp.connect(&to_ours).expect("connect");
        let buf = pd
            .alloc_mr(64, AccessFlags::LOCAL_WRITE)
            .expect("the raw peer's buffer");
        for i in 0..u64::from(Self::RECVS) {
            let mut request = RecvRequest::new(RAW_RECV | i, buf.slice(0, 64).expect("a slice"))
                .expect("a receive");
            qp.post_recv(&mut request).expect("a receive posted");
        }
        let end = add_end(reactor, ours);
        let peer = Self {
            qp,
            cq,
            buf,
            posted: 0,
            delivered: 0,
            failed: 0,
            updates: 0,
        };
        (end, peer)
    }

    /// Posts a signaled SEND of `len` bytes whose immediate says `kind`
    /// and claims all its receives (whatever its credits).
    fn send(&mut self, kind: u32, len: usize) {
        let imm = (kind << 30) | Self::RECVS;
        let local = self.buf.slice(0, len).expect("a slice");
        let mut request = WorkRequest::send_with_imm(0, local, imm).signaled();
        self.qp.post_send(&mut request).expect("a SEND posted");
        self.posted += 1;
    }

    /// Counts what completed since the last call.
    fn reap(&mut self) {
        let mut wcs = [WorkCompletion::default(); 32];
        loop {
            let polled = self.cq.poll(&mut wcs).expect("a poll");
            for wc in polled.iter() {
                match (wc.wr_id() & RAW_RECV != 0, wc.is_success()) {
                    (true, true) => self.updates += 1,
                    (true, false) => {}
                    (false, true) => self.delivered += 1,
                    (false, false) => self.failed += 1,
                }
            }
            if polled.len() < wcs.len() {
                return;
            }
        }
    }
}

mod cq_room;
mod direct;
mod due;
mod idle;
mod ids;
mod now;
mod qpn_reuse;
mod quiet;
mod ring;
mod run;
mod sparse;
mod spin;
mod srq;
mod srq_shares;
mod stale;
mod writable;
