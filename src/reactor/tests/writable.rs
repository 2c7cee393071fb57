//! `Handler::on_writable`: a handler refused for want of room is told once
//! room is back (credits a credit update returns, send-queue entries a
//! retire frees), once after any number of refusals, and a connection
//! that fails while waiting is not told.

use super::*;
use crate::reactor::SendError;
use crate::verbs::refuse_sends_after;

/// Passes enough for anything the loopback device lands to be handled.
const SETTLE: usize = 8;

/// Stages SENDs of `data` on `conn` until one is refused for want of
/// room; returns how many were taken.
fn send_until_refused(reactor: &mut Reactor<Probe, ()>, conn: ConnId, data: &[u8]) -> usize {
    let mut taken = 0;
    loop {
        match reactor.with_ctx(|ctx| ctx.send(conn, data, None)) {
            Ok(_) => taken += 1,
            Err(SendError::WouldBlock) => return taken,
            Err(err) => panic!("sending: {err}"),
        }
        assert!(taken <= 4 * RECV_DEPTH as usize, "never refused");
    }
}

/// Whether `conn`'s handler waits to be told that room is back.
fn waits(reactor: &Reactor<Probe, ()>, conn: ConnId) -> bool {
    reactor
        .conns
        .get(conn.key())
        .is_some_and(|conn| conn.waits_for_room())
}

fn settle(reactor: &mut Reactor<Probe, ()>) {
    turns(reactor, SETTLE);
}

/// Two 4 KiB regions registered with `access`, ours and the peer's, and
/// the peer's first 8 bytes as a remote slice: for one-sided requests.
fn regions(
    pd: &ProtectionDomain,
    access: AccessFlags,
) -> (MemoryRegion, MemoryRegion, crate::verbs::RemoteSlice) {
    let ours = pd.alloc_mr(4096, access).expect("a region");
    let theirs = pd.alloc_mr(4096, access).expect("a region");
    let remote = theirs.remote().unwrap().slice(0, 8).unwrap();
    (ours, theirs, remote)
}

/// A sender whose peer holds every message runs out of credits; it is
/// told nothing while the peer holds them, and exactly once, with room for
/// a SEND, when the peer's release brings the credits back, however often
/// it was refused meanwhile.
#[test]
fn a_sender_out_of_credits_is_told_once_when_the_peer_returns_them() {
    // SAFETY: every QP of the device is served from this thread.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().expect("a PD");
    let mut reactor = reactor(&pd);
    let (a, b) = add_pair(&mut reactor, &pd);
    b.seen.borrow_mut().hold = true;
    a.seen.borrow_mut().send_when_writable = Some(b"backlog".to_vec());
    let taken = send_until_refused(&mut reactor, a.conn, b"first");
    assert!(taken > 0, "credits at first");
    settle(&mut reactor);
    assert_eq!(send_until_refused(&mut reactor, a.conn, b"again"), 0);
    assert_eq!(send_until_refused(&mut reactor, a.conn, b"again"), 0);
    settle(&mut reactor);
    assert!(a.seen.borrow().writable.is_empty(), "no room yet");
    assert_eq!(b.seen.borrow().held.len(), taken, "all held");
    let held = std::mem::take(&mut b.seen.borrow_mut().held);
    b.seen.borrow_mut().hold = false;
    release_all(&mut reactor, held);
    run_until(&mut reactor, "a told of room", |_| {
        !a.seen.borrow().writable.is_empty()
    });
    settle(&mut reactor);
    assert_eq!(
        a.seen.borrow().writable,
        vec![(a.conn, true)],
        "told once, and the SEND it made then was taken"
    );
    let messages = &b.seen.borrow().messages;
    assert_eq!(messages.last().map(Vec::as_slice), Some(&b"backlog"[..]));
    assert!(!waits(&reactor, a.conn), "the wait is over");
}

/// A handler whose sends are never refused is never told.
#[test]
fn a_sender_never_refused_is_never_told() {
    // SAFETY: every QP of the device is served from this thread.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().expect("a PD");
    let mut reactor = reactor(&pd);
    let (a, b) = add_pair(&mut reactor, &pd);
    for _ in 0..4 * RECV_DEPTH {
        send(&mut reactor, a.conn, b"paced");
        settle(&mut reactor);
    }
    assert_eq!(b.seen.borrow().messages.len(), 4 * RECV_DEPTH as usize);
    assert!(a.seen.borrow().writable.is_empty());
}

/// WRITEs (no credit needed) that fill the send queue are refused; the
/// retire of the first signaled ones brings room back, and the handler is
/// told, once.
#[test]
fn a_full_send_queue_tells_once_its_requests_retire() {
    // SAFETY: every QP of the device is served from this thread.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().expect("a PD");
    let mut reactor = reactor(&pd);
    let (a, _b) = add_pair(&mut reactor, &pd);
    a.seen.borrow_mut().send_when_writable = Some(b"after".to_vec());
    let (ours, _theirs, remote) =
        regions(&pd, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE);
    let local = ours.slice(0, 8).unwrap();
    let mut staged = 0;
    loop {
        match reactor.with_ctx(|ctx| ctx.write(a.conn, &local, remote, None)) {
            Ok(_) => staged += 1,
            Err(SendError::WouldBlock) => break,
            Err(err) => panic!("writing: {err}"),
        }
        assert!(staged <= 1024, "never refused");
    }
    assert!(
        a.seen.borrow().writable.is_empty(),
        "not told before a pass"
    );
    run_within(&mut reactor, SETTLE, "told of room", |_| {
        !a.seen.borrow().writable.is_empty()
    });
    settle(&mut reactor);
    assert_eq!(a.seen.borrow().writable.len(), 1, "told once");
    assert!(a.seen.borrow().writable[0].1, "a SEND was taken then");
}

/// A connection that fails while it waits for room (its flush refused
/// by the device, which hands its requests, and so its room, back) is not
/// told, and its handler hears of the failure once.
#[test]
fn a_connection_that_fails_while_waiting_is_not_told() {
    // SAFETY: every QP of the device is served from this thread.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().expect("a PD");
    let mut reactor = reactor(&pd);
    let (a, _b) = add_pair(&mut reactor, &pd);
    let (ours, _theirs, remote) =
        regions(&pd, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE);
    let local = ours.slice(0, 8).unwrap();
    let a_qpn = reactor.conns.get(a.conn.key()).expect("live").qpn();
    refuse_sends_after(a_qpn, 0);
    let mut staged = 0;
    while reactor
        .with_ctx(|ctx| ctx.write(a.conn, &local, remote, None))
        .is_ok()
    {
        staged += 1;
        assert!(staged <= 1024, "never refused");
    }
    assert!(waits(&reactor, a.conn));
    settle(&mut reactor);
    assert_eq!(a.seen.borrow().errors.len(), 1, "told of the failure once");
    assert!(a.seen.borrow().writable.is_empty(), "not told of room");
}

/// A handler that stages until refused again from `on_writable` waits
/// anew, and is told again when the next room comes.
#[test]
fn a_refusal_inside_on_writable_waits_anew() {
    // SAFETY: every QP of the device is served from this thread.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().expect("a PD");
    let mut reactor = reactor(&pd);
    let (a, b) = add_pair(&mut reactor, &pd);
    b.seen.borrow_mut().hold = true;
    {
        let mut seen = a.seen.borrow_mut();
        seen.send_when_writable = Some(b"more".to_vec());
        seen.send_until_refused = true;
    }
    send_until_refused(&mut reactor, a.conn, b"first");
    for round in 1..=2 {
        settle(&mut reactor);
        let held = std::mem::take(&mut b.seen.borrow_mut().held);
        release_all(&mut reactor, held);
        run_until(&mut reactor, "told of room", |_| {
            a.seen.borrow().writable.len() == round
        });
        settle(&mut reactor);
        assert_eq!(a.seen.borrow().writable.len(), round, "told once a round");
        assert!(waits(&reactor, a.conn), "refused inside on_writable: waits");
    }
}

/// Room is what the refused requests need: READs refused for want of
/// send-queue entries, while the peer holds every credit, are told once
/// the READs retire, without waiting for credits; a SEND refused after
/// that waits for credits too, and is told when they come back.
#[test]
fn room_is_what_the_refused_requests_need() {
    // SAFETY: every QP of the device is served from this thread.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().expect("a PD");
    let mut reactor = reactor(&pd);
    let (a, b) = add_pair(&mut reactor, &pd);
    b.seen.borrow_mut().hold = true;
    // Spend the credits without a refusal (one stays reserved for updates).
    let credits = reactor.conns.get(a.conn.key()).unwrap().stats().credits;
    for _ in 1..credits {
        reactor
            .with_ctx(|ctx| ctx.send(a.conn, b"spent", None))
            .expect("a credit left");
    }
    settle(&mut reactor);
    let (ours, _theirs, remote) = regions(&pd, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ);
    let local = ours.slice(0, 8).unwrap();
    let mut staged = 0;
    while reactor
        .with_ctx(|ctx| ctx.read(a.conn, &local, remote))
        .is_ok()
    {
        staged += 1;
        assert!(staged <= 1024, "never refused");
    }
    run_within(&mut reactor, SETTLE, "told of room for READs", |_| {
        !a.seen.borrow().writable.is_empty()
    });
    assert_eq!(
        reactor.conns.get(a.conn.key()).unwrap().stats().credits,
        1,
        "told with the credits still spent"
    );
    assert!(matches!(
        reactor.with_ctx(|ctx| ctx.send(a.conn, b"refused", None)),
        Err(SendError::WouldBlock)
    ));
    settle(&mut reactor);
    assert_eq!(
        a.seen.borrow().writable.len(),
        1,
        "the SEND waits for credits"
    );
    let held = std::mem::take(&mut b.seen.borrow_mut().held);
    b.seen.borrow_mut().hold = false;
    release_all(&mut reactor, held);
    run_until(&mut reactor, "told of credits", |_| {
        a.seen.borrow().writable.len() == 2
    });
}

/// READs rung alone (`read_now`) until the send queue is full: the refused
/// one is remembered as a staged one is, and told once they retire.
#[test]
fn a_request_rung_alone_that_is_refused_is_told_too() {
    // SAFETY: every QP of the device is served from this thread.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().expect("a PD");
    let mut reactor = reactor(&pd);
    let (a, _b) = add_pair(&mut reactor, &pd);
    let (ours, _theirs, remote) = regions(&pd, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ);
    let local = ours.slice(0, 8).unwrap();
    let mut rung = 0;
    loop {
        match reactor.with_ctx(|ctx| ctx.read_now(a.conn, &local, remote)) {
            Ok(_) => rung += 1,
            Err(SendError::WouldBlock) => break,
            Err(err) => panic!("reading: {err}"),
        }
        assert!(rung <= 1024, "never refused");
    }
    assert!(rung > 0);
    // Within a few passes: not left for the idle-time walk of parked
    // connections.
    run_within(&mut reactor, SETTLE, "told of room", |_| {
        !a.seen.borrow().writable.is_empty()
    });
    settle(&mut reactor);
    assert_eq!(a.seen.borrow().writable.len(), 1, "told once");
}
