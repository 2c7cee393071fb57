//! A connection's own receive ring when the provider takes only part of a
//! posted list.

use std::collections::BTreeSet;
use std::time::Duration;

use super::*;
use crate::reactor::conn::Conn;
use crate::reactor::idle::{REPOST_IDLE_PASSES, TAIL_SIGNAL_IDLE_PASSES};
use crate::reactor::slab::{Key, PARKED, TOUCHED};

/// How many receives of `conn`'s own ring are posted, and the slots
/// queued for reposting, each of which must be queued once.
#[track_caller]
fn ring_account(reactor: &Reactor<Probe, ()>, conn: ConnId) -> (u32, BTreeSet<u32>) {
    let conn = reactor.conns.get(conn.key()).expect("a live connection");
    let mut queued = BTreeSet::new();
    for &slot in conn.rq().pending_slots() {
        assert!(queued.insert(slot), "slot {slot} queued twice");
    }
    (conn.credits().outstanding(), queued)
}

/// Whether every receive of `conn`'s own ring is posted, none queued.
fn ring_whole(reactor: &Reactor<Probe, ()>, conn: ConnId) -> bool {
    let (posted, queued) = ring_account(reactor, conn);
    posted == RECV_DEPTH && queued.is_empty()
}

/// Idle passes enough for every unsignaled tail to be signaled out and
/// the idle-time flushes to leave nothing parked but what waits.
fn idle_until_tails_signaled(reactor: &mut Reactor<Probe, ()>) {
    for _ in 0..3 * TAIL_SIGNAL_IDLE_PASSES {
        reactor.turn().expect("an idle pass");
    }
}

/// A batch the provider takes only in part: the requests it never got
/// give back what they hold in the same pass (a forward's receive slot
/// goes back to the connection it came from, a SEND's slot is freed), and
/// those it got keep theirs until the flushed completion behind them is
/// polled, since the device may still read that memory. Every slot comes
/// back exactly once, and the other sessions keep running.
#[test]
fn a_partial_post_frees_at_once_only_what_the_device_never_got() {
    // SAFETY: every QP of the device is served from this thread.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().expect("a PD");
    let mut reactor = reactor(&pd);
    let (origin, source) = add_pair(&mut reactor, &pd);
    let (relay, sink) = add_pair(&mut reactor, &pd);

    // Four messages held on `origin`, to forward on `relay`.
    origin.seen.borrow_mut().hold = true;
    for i in 1..=4u8 {
        send(&mut reactor, source.conn, &[i; 8]);
    }
    run_until(&mut reactor, "four messages held", |_| {
        origin.seen.borrow().held.len() == 4
    });
    origin.seen.borrow_mut().hold = false;
    let held = std::mem::take(&mut origin.seen.borrow_mut().held);
    let slots: Vec<u32> = held.iter().map(HeldRecv::slot).collect();
    let (outstanding, queued) = ring_account(&reactor, origin.conn);
    assert_eq!(
        outstanding as usize + queued.len() + held.len(),
        RECV_DEPTH as usize,
        "before: every slot is posted, queued or held once"
    );

    // Its credit update, unsignaled, is still on the send queue.
    let sq_in_flight = reactor.conn_stats(relay.conn).expect("relay").sq_used;
    // One doorbell's worth on `relay`: forward, forward, SEND, forward,
    // forward. The provider takes the first two.
    reactor.with_ctx(|ctx| {
        for (i, held) in held.into_iter().enumerate() {
            if i == 2 {
                ctx.send(relay.conn, b"plain", None).expect("a SEND staged");
            }
            if let Err((err, _)) = ctx.forward(relay.conn, held, None) {
                panic!("forwarding: {err}");
            }
        }
    });
    let relay_qpn = reactor.conns.get(relay.conn.key()).expect("relay").qpn();
    refuse_sends_after(relay_qpn, 2);
    reactor.turn().expect("the pass that posts");

    {
        let seen = relay.seen.borrow();
        assert_eq!(seen.errors.len(), 1, "the relay is told once");
        let (errno, text) = &seen.errors[0];
        assert_eq!(*errno, Some(libc::ENOMEM), "{text}");
        assert!(
            text.contains(&format!("{relay_qpn:#x}")) || text.contains(&relay_qpn.to_string()),
            "names the QP: {text}"
        );
    }
    // The two forwards the device never got gave their slots back; the
    // two it got still hold theirs (posted: only their flush tells).
    let stats = reactor.conn_stats(relay.conn).expect("relay");
    let (sq_used, sends_in_use) = (stats.sq_used, stats.send_slots_used);
    assert_eq!(
        sq_used,
        sq_in_flight + 2,
        "the posted forwards wait for their flush"
    );
    assert_eq!(sends_in_use, 0, "the unposted SEND's slot is free");
    let (outstanding, queued) = ring_account(&reactor, origin.conn);
    for slot in &slots[..2] {
        assert!(!queued.contains(slot), "slot {slot} back while posted");
    }
    assert_eq!(
        outstanding as usize + queued.len(),
        RECV_DEPTH as usize - 2,
        "after the failed post: all but the two posted forwards' slots"
    );

    // The flushed completion behind the posted ones gives theirs back.
    run_until(&mut reactor, "the relay's flush polled", |reactor| {
        reactor.conn_stats(relay.conn).expect("relay").sq_used == 0
    });
    let (outstanding, queued) = ring_account(&reactor, origin.conn);
    assert_eq!(
        outstanding as usize + queued.len(),
        RECV_DEPTH as usize,
        "every slot back exactly once"
    );
    assert_eq!(
        relay.seen.borrow().errors.len(),
        1,
        "the flush is no second error"
    );
    // What the device got arrived.
    run_until(&mut reactor, "the posted forwards delivered", |_| {
        sink.seen.borrow().messages.len() == 2
    });
    assert_eq!(sink.seen.borrow().messages, [vec![1; 8], vec![2; 8]]);

    // The origin's ring is whole: it takes more messages than it has slots.
    let before = origin.seen.borrow().messages.len();
    for i in 0..3 * RECV_DEPTH {
        send(&mut reactor, source.conn, &i.to_le_bytes());
    }
    run_until(&mut reactor, "the origin takes three rings' worth", |_| {
        origin.seen.borrow().messages.len() == before + 3 * RECV_DEPTH as usize
    });
    let seen = origin.seen.borrow();
    for (i, message) in seen.messages[before..].iter().enumerate() {
        assert_eq!(message, &(i as u32).to_le_bytes(), "message {i}");
    }
    assert!(seen.errors.is_empty() && source.seen.borrow().errors.is_empty());
}

/// A relay removed with forwards in flight hands their slots back to the
/// origin; the pass's late flush reposts them and owes the origin's peer a
/// credit update, whose post the device refuses. The origin fails, and its
/// handler asks for its session's removal after that pass's removals ran:
/// the reactor does not sleep on it (`sleep_limit` is zero) and the next
/// pass removes it. The other sessions keep running.
#[test]
fn a_removal_asked_for_by_a_connection_the_late_flush_fails_does_not_wait_for_a_sleep() {
    // SAFETY: every QP of the device is served from this thread.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().expect("a PD");
    let mut reactor = reactor(&pd);
    let (origin, source) = add_pair(&mut reactor, &pd);
    let (relay, _sink) = add_pair(&mut reactor, &pd);
    origin.seen.borrow_mut().remove_on_error = Some(origin.session);

    // Half a ring held on `origin` (the peer has credit for them):
    // reposting them is more than a credit update's worth (a quarter).
    origin.seen.borrow_mut().hold = true;
    let held_count = RECV_DEPTH as usize / 2;
    for i in 0..held_count {
        send(&mut reactor, source.conn, &[i as u8; 8]);
    }
    run_until(&mut reactor, "the messages held", |_| {
        origin.seen.borrow().held.len() == held_count
    });
    origin.seen.borrow_mut().hold = false;
    let held = std::mem::take(&mut origin.seen.borrow_mut().held);

    // Forwarded on `relay`, whose session goes in the same pass: its QP is
    // destroyed with the forwards posted and their completions unpolled.
    reactor.with_ctx(|ctx| {
        forward_all(ctx, relay.conn, held);
        ctx.remove_session(relay.session);
    });
    let origin_qpn = reactor.conns.get(origin.conn.key()).expect("origin").qpn();
    refuse_sends_after(origin_qpn, 0);
    reactor.poll_once().expect("the pass of the removal");
    assert!(
        reactor.sessions.get(relay.session).is_none(),
        "relay removed"
    );
    {
        let seen = origin.seen.borrow();
        assert_eq!(
            seen.errors.len(),
            1,
            "the origin's credit update refused: {:?}",
            seen.errors
        );
        assert_eq!(seen.errors[0].0, Some(libc::ENOMEM), "{:?}", seen.errors);
    }
    assert!(
        reactor.sessions.get(origin.session).is_some(),
        "asked for after the pass's removals: the next pass's"
    );
    assert_eq!(reactor.sleep_limit(), Duration::ZERO, "a removal waits");

    reactor.turn().expect("the next pass");
    assert!(
        reactor.sessions.get(origin.session).is_none(),
        "origin removed"
    );
    assert!(reactor.sleep_limit() > Duration::ZERO, "nothing waits");

    // The reactor keeps serving: a new pair talks.
    let (one, other) = add_pair(&mut reactor, &pd);
    send(&mut reactor, one.conn, b"still running");
    run_until(&mut reactor, "a new pair talks", |_| {
        other.seen.borrow().messages == [b"still running".to_vec()]
    });
}

/// Messages forwarded from a connection's own ring give their slots back
/// as the forwards complete: fewer than a repost batch wait, the
/// connection parked, for the idle-time flush, which reposts them. Once
/// the reactor is idle the ring is whole again, each slot posted once.
#[test]
fn forwarded_slots_come_back_to_a_live_origins_ring_when_the_reactor_idles() {
    // SAFETY: every QP of the device is served from this thread.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().expect("a PD");
    let mut reactor = super::reactor(&pd);
    let mut other = super::reactor(&pd);
    let (origin, source) = add_pair(&mut reactor, &pd);
    // The sink on a reactor of its own: its receives leave this one's
    // idle-time flush nothing to do.
    let (relay, sink) = add_pair_across(&mut reactor, &mut other, &pd);
    let whole = |reactor: &Reactor<Probe, ()>| ring_whole(reactor, origin.conn);
    run_until(&mut reactor, "the origin's ring whole", whole);

    origin.seen.borrow_mut().hold = true;
    send(&mut reactor, source.conn, &[1; 8]);
    send(&mut reactor, source.conn, &[2; 8]);
    run_until(&mut reactor, "two messages held", |_| {
        origin.seen.borrow().held.len() == 2
    });
    origin.seen.borrow_mut().hold = false;
    // Idle long enough for every tail to be signaled out: then nothing
    // leaves the origin listed or parked but its slots coming back.
    idle_until_tails_signaled(&mut reactor);
    let index = origin.conn.key().index;
    assert!(
        !reactor.conns.is_listed(TOUCHED, index) && !reactor.conns.is_listed(PARKED, index),
        "the origin has nothing left for a flush"
    );
    let held = std::mem::take(&mut origin.seen.borrow_mut().held);
    reactor.with_ctx(|ctx| {
        forward_all(ctx, relay.conn, held);
        ctx.signal_staged(relay.conn);
    });
    // Both reactors turn until the forwards arrived and the origin's ring
    // is whole again.
    let done = (0..MAX_PASSES).any(|_| {
        reactor.turn().expect("a reactor pass");
        other.turn().expect("a pass of the other reactor");
        sink.seen.borrow().messages.len() == 2 && whole(&reactor)
    });
    assert!(done, "the forwarded slots were never posted again");
    assert_eq!(sink.seen.borrow().messages, [vec![1; 8], vec![2; 8]]);
    let sq_used = reactor.conn_stats(relay.conn).expect("relay").sq_used;
    assert_eq!(sq_used, 0, "the forwards retired");
}

/// A forward's slot given back during the walk of parked connections of
/// an idle-time flush (the relay's post fails there, and the forward it
/// was to carry, staged by another connection's error callback in the
/// same flush, gives its slot back): the origin is parked past the walk,
/// and the flush's end keeps what that said, so the next idle-time flush
/// reposts the slot. (A flush's end that overwrote the flag with what its
/// walk had seen would leave the slot waiting for the origin's next
/// message.)
#[test]
fn a_slot_given_back_during_the_parked_walk_is_reposted_by_the_next_idle_flush() {
    // SAFETY: every QP of the device is served from this thread.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().expect("a PD");
    let mut reactor = super::reactor(&pd);
    let (origin, source) = add_pair(&mut reactor, &pd);
    let (relay, relay_peer) = add_pair(&mut reactor, &pd);
    let (failing, _) = add_pair(&mut reactor, &pd);
    origin.seen.borrow_mut().hold = true;
    send(&mut reactor, source.conn, &[1; 8]);
    run_until(&mut reactor, "one message held", |_| {
        origin.seen.borrow().held.len() == 1
    });
    origin.seen.borrow_mut().hold = false;
    let held = std::mem::take(&mut origin.seen.borrow_mut().held);
    idle_until_tails_signaled(&mut reactor);
    // The relay gets a receive to repost below a batch: it is parked.
    reactor.with_ctx(|ctx| {
        ctx.send(relay_peer.conn, b"to the relay", None)
            .expect("room for it");
        ctx.signal_staged(relay_peer.conn);
    });
    run_until(&mut reactor, "the relay got it", |_| {
        relay.seen.borrow().messages.len() == 1
    });
    run_until(
        &mut reactor,
        "one pass short of the idle flush",
        |reactor| reactor.idle.idle_passes() >= REPOST_IDLE_PASSES - 1,
    );
    assert!(
        reactor.conns.is_listed(PARKED, relay.conn.key().index),
        "the relay is parked"
    );
    // In the idle flush: the failing connection's post is refused in the
    // walk of touched ones, its handler stages the forward on the relay,
    // and the relay's post is refused in the walk of parked ones.
    failing.seen.borrow_mut().forward_on_error = Some((relay.conn, held));
    reactor.with_ctx(|ctx| {
        ctx.send(failing.conn, b"refused", None)
            .expect("room for it")
    });
    let qpn = |conn: ConnId| reactor.conns.get(conn.key()).expect("live").qpn();
    refuse_sends_after(qpn(failing.conn), 0);
    refuse_sends_after(qpn(relay.conn), 0);
    reactor.turn().expect("the idle flush's pass");
    assert!(
        !relay.seen.borrow().errors.is_empty(),
        "the relay failed in the walk of parked connections"
    );
    let whole = |reactor: &Reactor<Probe, ()>| ring_whole(reactor, origin.conn);
    run_within(
        &mut reactor,
        2 * REPOST_IDLE_PASSES as usize,
        "the slot reposted by the next idle flush",
        whole,
    );
}

/// A receive slot given back twice (by some path that did, then by the
/// handler's release), and every slot given back while posted: each is
/// posted once, never twice, and the ring serves traffic after.
#[test]
fn a_slot_given_back_twice_or_while_posted_is_posted_once() {
    // SAFETY: every QP of the device is served from this thread.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().expect("a PD");
    let mut reactor = reactor(&pd);
    let (origin, source) = add_pair(&mut reactor, &pd);
    origin.seen.borrow_mut().hold = true;
    send(&mut reactor, source.conn, &[1; 8]);
    run_until(&mut reactor, "one message held", |_| {
        origin.seen.borrow().held.len() == 1
    });
    origin.seen.borrow_mut().hold = false;
    let held = origin.seen.borrow_mut().held.pop().expect("one held");
    let slot = held.slot();
    let key = origin.conn.key();
    fn conn(reactor: &mut Reactor<Probe, ()>, key: Key) -> &mut Conn {
        reactor.conns.get_mut(key).expect("origin")
    }
    assert!(!conn(&mut reactor, key).rq().is_posted(slot), "held");

    conn(&mut reactor, key).queue_repost(slot);
    reactor
        .with_ctx(|ctx| ctx.release(held).map_err(|(err, _)| err))
        .expect("released");
    let (_, queued) = ring_account(&reactor, origin.conn);
    assert!(queued.contains(&slot), "queued once (ring_account checks)");
    let whole = |reactor: &Reactor<Probe, ()>| ring_whole(reactor, origin.conn);
    run_until(&mut reactor, "the ring whole", whole);

    // Every slot is posted: none goes back again.
    for slot in 0..RECV_DEPTH {
        assert!(conn(&mut reactor, key).rq().is_posted(slot));
        conn(&mut reactor, key).queue_repost(slot);
    }
    let (posted, queued) = ring_account(&reactor, origin.conn);
    assert_eq!((posted, queued.len()), (RECV_DEPTH, 0), "nothing queued");
    idle_until_tails_signaled(&mut reactor);
    assert!(whole(&reactor), "{:?}", ring_account(&reactor, origin.conn));

    // Three rings' worth, in order.
    for i in 0..3 * RECV_DEPTH {
        send(&mut reactor, source.conn, &i.to_le_bytes());
    }
    run_until(&mut reactor, "three rings' worth", |_| {
        origin.seen.borrow().messages.len() == 1 + 3 * RECV_DEPTH as usize
    });
    let seen = origin.seen.borrow();
    for (i, message) in seen.messages[1..].iter().enumerate() {
        assert_eq!(message, &(i as u32).to_le_bytes(), "message {i}");
    }
    assert!(seen.errors.is_empty() && source.seen.borrow().errors.is_empty());
}

/// A receive completion for a slot that is not posted: a slot posted a
/// second time behind the ring (as a double post would leave it) is
/// filled after the handler took the first message from it. The second
/// completion is refused as a stranger's: not delivered, not counted as
/// a receive of the peer's (no overrun), the held message's slot not
/// given back; the connection keeps going.
#[test]
fn a_receive_completion_for_a_slot_not_posted_is_refused() {
    // SAFETY: every QP of the device is served from this thread.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().expect("a PD");
    let mut reactor = reactor(&pd);
    let (end, mut raw) = RawPeer::connect(&mut reactor, &ctx, &pd);
    end.seen.borrow_mut().hold = true;
    // The ring, slots 0 to 15 posted in order, takes the peer's credit
    // update in slot 0; behind slot 15, in the room that leaves (the QP
    // takes no more receives than the ring's), slot 5 is posted again.
    const TWICE: u32 = 5;
    raw.send(RawPeer::CREDIT, 0);
    reactor
        .conns
        .get_mut(end.conn.key())
        .expect("the connection")
        .post_recv_bypassing_the_guard(TWICE)
        .expect("the second post");
    // 15 messages (slots 1 to 15) and one more into slot 5's second
    // receive: 17 receives, one past the grant.
    for _ in 0..RECV_DEPTH {
        raw.send(RawPeer::MESSAGE, 8);
    }
    raw.reap();
    assert_eq!(raw.delivered, u64::from(RECV_DEPTH) + 1, "all landed");
    let before = ignored(&reactor).0;
    run_until(&mut reactor, "the messages held", |_| {
        end.seen.borrow().held.len() == RECV_DEPTH as usize - 1
    });
    for _ in 0..2 * REPOST_IDLE_PASSES {
        reactor.turn().expect("a pass");
    }
    let seen = end.seen.borrow();
    assert!(seen.established);
    assert!(seen.errors.is_empty(), "not cut off: {:?}", seen.errors);
    assert_eq!(seen.messages.len(), RECV_DEPTH as usize - 1, "none twice");
    let slots: BTreeSet<u32> = seen.held.iter().map(HeldRecv::slot).collect();
    assert_eq!(slots, (1..RECV_DEPTH).collect(), "each held once");
    assert_eq!(
        ignored(&reactor).0 - before,
        1,
        "the second completion of slot 5 refused"
    );
    let conn = reactor.conns.get(end.conn.key()).expect("the connection");
    assert!(!conn.rq().is_posted(TWICE), "still held");
    assert!(
        !conn.rq().pending_slots().contains(&TWICE),
        "not given back"
    );
    drop(seen);

    // Released, the held slots go back once each; the peer's messages
    // keep landing.
    let held = std::mem::take(&mut end.seen.borrow_mut().held);
    end.seen.borrow_mut().hold = false;
    reactor.with_ctx(|ctx| {
        for message in held {
            ctx.release(message)
                .map_err(|(err, _)| err)
                .expect("released");
        }
    });
    raw.reap();
    let updates = raw.updates;
    run_until(&mut reactor, "the ring whole, and announced", |reactor| {
        raw.reap();
        ring_whole(reactor, end.conn) && raw.updates > updates
    });
    raw.send(RawPeer::MESSAGE, 8);
    run_until(&mut reactor, "one more message", |_| {
        end.seen.borrow().messages.len() == RECV_DEPTH as usize
    });
    assert!(end.seen.borrow().errors.is_empty());
}
