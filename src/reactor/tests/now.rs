//! Requests rung alone (`Ctx::read_now`, `Ctx::write_now`): the doorbell
//! rings inside the callback, the flush has nothing left to do for them,
//! they never overtake requests staged before them, and a doorbell the
//! device refuses fails only its connection, at the end of the pass.

use std::cell::RefCell;

use crate::verbs::{
    AccessFlags, Context, MemoryRegion, ProtectionDomain, RemoteSlice, refuse_sends_after,
    refuse_sends_after_silently,
};

use super::{ConnId, Ctx, Reactor, add_pair, reactor, run_until, run_within, send};

/// Something a handler does from a callback.
type Action = Box<dyn FnOnce(&mut Ctx<'_>)>;

thread_local! {
    /// What the next handler told of an error does (once), in this test's
    /// thread.
    static WHEN_TOLD: RefCell<Option<Action>> = RefCell::new(None);
}

/// Runs what a test left for the next `on_error` (`Probe` calls it).
pub(super) fn when_told(ctx: &mut Ctx<'_>) {
    if let Some(action) = WHEN_TOLD.with(|cell| cell.borrow_mut().take()) {
        action(ctx);
    }
}

/// Fewer passes than the idle spell after which the reactor signals out an
/// unsignaled tail itself: a request retired within them was signaled.
const FEW_PASSES: usize = 100;

fn region(pd: &ProtectionDomain) -> MemoryRegion {
    let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
    pd.alloc_mr(4096, access).expect("a region")
}

/// Send-queue entries `conn` has in use (posted or staged, not retired).
pub(super) fn sq_used(reactor: &Reactor<super::Probe, ()>, conn: ConnId) -> u32 {
    reactor.conn_stats(conn).expect("a live connection").sq_used
}

/// A WRITE and a READ rung now are on the wire when the call returns (the
/// loopback device executes a request inside its post), counted as one
/// doorbell each, leave the flush nothing, and are signaled: each retires
/// within a few passes, with whatever went unsignaled before it.
#[test]
fn a_request_rung_now_is_on_the_wire_when_the_call_returns() {
    // SAFETY: every QP of the device is served from this thread.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().expect("a PD");
    let mut reactor = reactor(&pd);
    let (a, _b) = add_pair(&mut reactor, &pd);
    let mut ours = region(&pd);
    let theirs = region(&pd);
    ours.write(0, b"rung now").unwrap();
    let remote = theirs.remote().unwrap();

    let before = reactor.counters();
    let local = ours.slice(0, 8).unwrap();
    reactor
        .with_ctx(|ctx| ctx.write_now(a.conn, &local, remote.slice(0, 8).unwrap(), None))
        .expect("the WRITE rung");
    let mut landed = [0; 8];
    theirs.read(0, &mut landed).unwrap();
    assert_eq!(&landed, b"rung now", "landed before any pass");
    let after = reactor.counters();
    assert_eq!(after.doorbells, before.doorbells + 1);
    assert_eq!(after.requests, before.requests + 1);
    assert!(!reactor.conns.has_touched(), "nothing listed for the flush");
    run_within(&mut reactor, FEW_PASSES, "the WRITE retired", |r| {
        sq_used(r, a.conn) == 0
    });

    let into = ours.slice(64, 8).unwrap();
    reactor
        .with_ctx(|ctx| ctx.read_now(a.conn, &into, remote.slice(0, 8).unwrap()))
        .expect("the READ rung");
    ours.read(64, &mut landed).unwrap();
    assert_eq!(&landed, b"rung now", "read back before any pass");
    assert_eq!(reactor.counters().doorbells, before.doorbells + 2);
    run_within(&mut reactor, FEW_PASSES, "the READ retired", |r| {
        sq_used(r, a.conn) == 0
    });
}

/// With a request already staged on the connection in this pass, one
/// asked to ring now is staged behind it instead (posted alone it would
/// overtake it): both go with the pass's one doorbell, in order.
#[test]
fn a_request_rung_now_waits_behind_what_is_staged() {
    // SAFETY: every QP of the device is served from this thread.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().expect("a PD");
    let mut reactor = reactor(&pd);
    let (a, _b) = add_pair(&mut reactor, &pd);
    let mut ours = region(&pd);
    let theirs = region(&pd);
    ours.write(0, b"first!!!second!!").unwrap();
    let remote = theirs.remote().unwrap();
    let (first, second) = (ours.slice(0, 8).unwrap(), ours.slice(8, 8).unwrap());

    let before = reactor.counters();
    let (staged_seq, now_seq) = reactor.with_ctx(|ctx| {
        let staged = ctx.write(a.conn, &first, remote.slice(0, 8).unwrap(), None);
        let now = ctx.write_now(a.conn, &second, remote.slice(8, 8).unwrap(), None);
        assert_eq!(ctx.staged(a.conn), 2, "staged behind the first");
        (staged.expect("staged"), now.expect("staged too"))
    });
    assert_eq!(now_seq, staged_seq.wrapping_add(1));
    let mut landed = [0; 16];
    theirs.read(0, &mut landed).unwrap();
    assert_eq!(landed, [0; 16], "nothing posted before the pass's end");
    assert_eq!(reactor.counters().doorbells, before.doorbells);

    reactor.turn().expect("the pass that posts");
    theirs.read(0, &mut landed).unwrap();
    assert_eq!(&landed, b"first!!!second!!");
    let after = reactor.counters();
    assert_eq!(after.doorbells, before.doorbells + 1, "one doorbell");
    assert_eq!(after.requests, before.requests + 2, "for both");
    // Signaled there too: both retire within a few passes.
    run_within(&mut reactor, FEW_PASSES, "both WRITEs retired", |r| {
        sq_used(r, a.conn) == 0
    });
}

/// A doorbell rung alone from `on_error` while a flush walks the
/// connections (it failed another one), and refused: its connection fails
/// before the walk reaches it, so nothing is posted behind the refused
/// request, and the requests it was refused with are unwound once.
#[test]
fn a_doorbell_refused_during_a_flush_fails_its_connection_before_the_walk_reaches_it() {
    // SAFETY: every QP of the device is served from this thread.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().expect("a PD");
    let mut reactor = reactor(&pd);
    // `c` first: the walk takes the connections in the order listed.
    let (c, _d) = add_pair(&mut reactor, &pd);
    let (a, _b) = add_pair(&mut reactor, &pd);
    let ours = region(&pd);
    let theirs = region(&pd);
    let remote: RemoteSlice = theirs.remote().unwrap().slice(0, 8).unwrap();
    run_until(&mut reactor, "both connections quiet", |r| {
        sq_used(r, a.conn) == 0 && sq_used(r, c.conn) == 0 && !r.conns.has_touched()
    });
    let into = ours.slice(0, 8).unwrap().registration().clone();
    let a_conn = a.conn;
    WHEN_TOLD.with(|cell| {
        *cell.borrow_mut() = Some(Box::new(move |ctx: &mut Ctx<'_>| {
            let local = into.slice(0, 8).unwrap();
            ctx.read_now(a_conn, &local, remote)
                .expect("refused, still staged");
            ctx.read_now(a_conn, &local, remote)
                .expect("staged behind it");
        }));
    });
    let qpn = |conn: ConnId| reactor.conns.get(conn.key()).expect("live").qpn();
    let (c_qpn, a_qpn) = (qpn(c.conn), qpn(a.conn));
    reactor.with_ctx(|ctx| {
        ctx.send(c.conn, b"refused", None).expect("a SEND on c");
        // Lists `a` for the same walk, after `c`, with nothing staged.
        ctx.signal_staged(a.conn);
    });
    refuse_sends_after(c_qpn, 0);
    refuse_sends_after(a_qpn, 0);
    reactor.turn().expect("the pass whose flush fails c");

    assert_eq!(c.seen.borrow().errors.len(), 1, "c failed");
    assert_eq!(
        a.seen.borrow().errors.len(),
        1,
        "a failed in the same flush"
    );
    assert_eq!(sq_used(&reactor, a.conn), 0, "both READs unwound");
    for _ in 0..FEW_PASSES {
        reactor.turn().expect("a pass");
    }
    assert_eq!(a.seen.borrow().errors.len(), 1, "told once");
    assert_eq!(sq_used(&reactor, a.conn), 0, "nothing retired twice");
}

/// A doorbell rung now that the device refuses: the call still returns
/// the request's sequence number (it is staged, as a request whose pass's
/// doorbell fails is), a later request on the connection is staged, not
/// rung, and at the end of the pass the connection fails, its handler is
/// told once, and both requests are unwound. Another pair keeps running.
#[test]
fn a_refused_doorbell_rung_now_fails_only_its_connection() {
    refused_rung_now(refuse_sends_after, 0);
}

/// A provider that refuses a doorbell without saying which request it
/// refused (`bad_wr` left alone) still stops a later request from being
/// rung alone behind it: the READ is staged, the connection fails once at
/// the end of the pass, and the WRITE, which nothing says the device did
/// not get, is held as posted.
#[test]
fn a_doorbell_refused_without_saying_where_still_stops_requests_rung_alone() {
    refused_rung_now(refuse_sends_after_silently, 1);
}

/// A WRITE rung now whose doorbell `refuse` makes the device refuse, and
/// a READ after it; `held`: how many of the two the failed connection
/// holds as posted.
fn refused_rung_now(refuse: fn(u32, usize), held: u32) {
    // SAFETY: every QP of the device is served from this thread.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().expect("a PD");
    let mut reactor = reactor(&pd);
    let (a, _b) = add_pair(&mut reactor, &pd);
    let (c, d) = add_pair(&mut reactor, &pd);
    let mut ours = region(&pd);
    let theirs = region(&pd);
    ours.write(0, b"refused!").unwrap();
    let remote = theirs.remote().unwrap();
    let local = ours.slice(0, 8).unwrap();
    let into = ours.slice(64, 8).unwrap();
    // (An idle spell signals out the handshake's unsignaled credit
    // updates.)
    run_until(&mut reactor, "the handshake's updates retired", |r| {
        sq_used(r, a.conn) == 0
    });

    let qpn = reactor.conns.get(a.conn.key()).expect("a").qpn();
    refuse(qpn, 0);
    let doorbells = reactor.counters().doorbells;
    reactor.with_ctx(|ctx| {
        ctx.write_now(a.conn, &local, remote.slice(0, 8).unwrap(), None)
            .expect("staged, though its doorbell was refused");
        ctx.read_now(a.conn, &into, remote.slice(0, 8).unwrap())
            .expect("staged behind it");
        assert_eq!(ctx.staged(a.conn), 1, "the READ waits: it is not rung");
    });
    assert_eq!(
        reactor.counters().doorbells,
        doorbells + 1,
        "one doorbell: the refused one"
    );
    assert!(a.seen.borrow().errors.is_empty(), "told at the pass's end");
    assert_eq!(sq_used(&reactor, a.conn), 2);

    reactor.turn().expect("a pass");
    {
        let seen = a.seen.borrow();
        assert_eq!(seen.errors.len(), 1, "told once");
        assert_eq!(seen.errors[0].0, Some(libc::ENOMEM), "{}", seen.errors[0].1);
    }
    assert_eq!(sq_used(&reactor, a.conn), held, "the rest unwound");
    let mut landed = [0; 8];
    theirs.read(0, &mut landed).unwrap();
    assert_eq!(landed, [0; 8], "the device never got the WRITE");

    send(&mut reactor, c.conn, b"still up");
    run_within(&mut reactor, FEW_PASSES, "the other pair's message", |_| {
        d.seen.borrow().messages.len() == 1
    });
    assert_eq!(a.seen.borrow().errors.len(), 1, "no second error");
}
