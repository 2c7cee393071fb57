//! What the SRQ's receives back: a connection's credits count an SRQ slot
//! only once the SRQ holds it again, and a newcomer's share is promised
//! only out of slots that can come back (not those a removed connection
//! still has out, held or forwarded).

use super::srq::errors_of;
use super::*;
use crate::reactor::SendError;
use crate::reactor::pass::SRQ_RETRY;
use crate::verbs::refuse_srq_recvs_after;

/// Messages `origin` holds in the tests below.
const HELD: u32 = 20;

/// `HELD` messages from `source`, held by `origin`'s handler.
fn hold(reactor: &mut Reactor<Probe, ()>, origin: &End, source: &End) -> Vec<HeldRecv> {
    origin.seen.borrow_mut().hold = true;
    for i in 0..HELD {
        send(reactor, source.conn, &i.to_le_bytes());
    }
    run_until(reactor, "the messages held", |_| {
        origin.seen.borrow().held.len() == HELD as usize
    });
    origin.seen.borrow_mut().hold = false;
    std::mem::take(&mut origin.seen.borrow_mut().held)
}

fn orphaned(reactor: &Reactor<Probe, ()>) -> u32 {
    reactor.srq.as_ref().expect("an SRQ reactor").orphaned()
}

/// Four connections take 192 of the SRQ's 256 receives. One of them is
/// removed while its handler holds 18 of its messages and 2 more are being
/// forwarded on another connection: its share is free, but those 20 slots
/// are not, so a pair of newcomers (96 more, 260 with them) is refused
/// until they come back, and accepted after.
#[test]
fn slots_a_removed_connection_has_out_are_promised_to_no_newcomer() {
    // SAFETY: every QP of the device is served from this thread.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().expect("a PD");
    let mut reactor = srq_reactor(&pd);
    let (origin, source) = add_pair(&mut reactor, &pd);
    let (relay, sink) = add_pair(&mut reactor, &pd);
    let mut held = hold(&mut reactor, &origin, &source);
    let forwarded: Vec<HeldRecv> = held.drain(..2).collect();
    reactor.with_ctx(|ctx| forward_all(ctx, relay.conn, forwarded));
    assert_eq!(orphaned(&reactor), 0, "nothing orphaned while served");

    reactor.remove(origin.session).expect("origin's session");
    assert_eq!(orphaned(&reactor), HELD, "18 held and 2 forwarded");
    refuse_a_newcomer(&mut reactor, &pd);

    // The forwards complete, and the held messages are released: every
    // slot is back, none is an orphan, and the newcomers fit.
    release_all(&mut reactor, held);
    run_until(&mut reactor, "the orphans back", |reactor| {
        orphaned(reactor) == 0
    });
    assert_eq!(sink.seen.borrow().messages.len(), 2, "both forwarded");
    let (late, late_peer) = welcome_a_newcomer(&mut reactor, &pd);
    let ends = [
        ("source", &source),
        ("relay", &relay),
        ("sink", &sink),
        ("late", &late),
        ("late's peer", &late_peer),
    ];
    assert!(errors_of(&ends).is_empty(), "{:?}", errors_of(&ends));
}

/// A pair of newcomers (two shares) the SRQ cannot back: refused.
fn refuse_a_newcomer(reactor: &mut Reactor<Probe, ()>, pd: &ProtectionDomain) {
    let [a, b] = connected_qps(reactor, pd, AccessFlags::empty());
    let seen = Rc::new(RefCell::new(Seen::default()));
    match reactor.add(vec![a, b], Probe(seen)) {
        Err(Error::InvalidArgument(what)) => assert!(what.contains("shares"), "{what}"),
        other => panic!("newcomers promised slots the SRQ does not hold: {other:?}"),
    }
}

/// A pair of newcomers, added, and a message between them.
fn welcome_a_newcomer(reactor: &mut Reactor<Probe, ()>, pd: &ProtectionDomain) -> (End, End) {
    let (late, late_peer) = add_pair(reactor, pd);
    send(reactor, late_peer.conn, b"welcome");
    run_until(reactor, "the newcomer's message", |_| {
        late.seen.borrow().messages.len() == 1
    });
    (late, late_peer)
}

/// Receives the connection `end` has granted its peer and not yet seen
/// consumed.
fn outstanding(reactor: &Reactor<Probe, ()>, end: &End) -> u32 {
    let conn = reactor.conns.get(end.conn.key()).expect("the connection");
    conn.credits().outstanding()
}

/// A held message released while the SRQ refuses its next posts: its slot
/// is not credited to the connection (no credit may announce a receive
/// the SRQ does not hold) until a later pass posts it; then it is, and
/// traffic goes on.
#[test]
fn an_srq_slot_is_credited_only_once_the_srq_holds_it_again() {
    // SAFETY: every QP of the device is served from this thread.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().expect("a PD");
    let mut reactor = srq_reactor(&pd);
    let (origin, source) = add_pair(&mut reactor, &pd);
    let held = hold(&mut reactor, &origin, &source);
    // Idle long enough for every repost and tail to be done with.
    for _ in 0..4 * crate::reactor::idle::TAIL_SIGNAL_IDLE_PASSES {
        reactor.turn().expect("an idle pass");
    }
    let before = outstanding(&reactor, &origin);
    assert_eq!(before, SRQ_SHARE - HELD, "the held slots are not granted");

    // The connection's flush and the pass's end each meet a refusal.
    let pool = reactor.srq.as_ref().expect("an SRQ reactor");
    refuse_srq_recvs_after(pool.srq(), 0);
    refuse_srq_recvs_after(pool.srq(), 0);
    release_all(&mut reactor, held);
    reactor.turn().expect("the pass that gives the slots back");
    let (queued, stranded) = reactor.srq.as_ref().expect("an SRQ").unposted();
    assert_eq!(queued.len() + stranded.len(), HELD as usize, "all refused");
    assert_eq!(
        outstanding(&reactor, &origin),
        before,
        "refused slots are not credited"
    );
    assert_eq!(
        reactor.sleep_limit(),
        SRQ_RETRY.min(reactor.config.idle_timeout)
    );

    reactor.turn().expect("the pass after the refusals");
    assert_eq!(reactor.srq_posted(), Some(SRQ_DEPTH), "all posted now");
    run_until(&mut reactor, "the slots credited", |reactor| {
        outstanding(reactor, &origin) == SRQ_SHARE
    });
    for i in 0..2 * SRQ_SHARE {
        send(&mut reactor, source.conn, &i.to_le_bytes());
    }
    run_until(&mut reactor, "two shares' worth more", |_| {
        origin.seen.borrow().messages.len() == (HELD + 2 * SRQ_SHARE) as usize
    });
    let ends = [("origin", &origin), ("source", &source)];
    assert!(errors_of(&ends).is_empty(), "{:?}", errors_of(&ends));
}

/// Sends from `source` until its credits run out, `origin`'s handler
/// holding every message: the held messages.
fn exhaust(reactor: &mut Reactor<Probe, ()>, origin: &End, source: &End) -> Vec<HeldRecv> {
    origin.seen.borrow_mut().hold = true;
    let mut sent = 0;
    // A send is refused for room in the send queue or send slots too,
    // which completions free: each round sends until refused, then idles
    // long enough for every completion, repost, update and tail, until
    // only the credits refuse.
    for _round in 0..8 {
        loop {
            match reactor.with_ctx(|ctx| ctx.send(source.conn, b"m", None)) {
                Ok(_) => sent += 1,
                Err(SendError::WouldBlock) => break,
                Err(err) => panic!("sending: {err}"),
            }
        }
        for _ in 0..4 * crate::reactor::idle::TAIL_SIGNAL_IDLE_PASSES {
            reactor.turn().expect("an idle pass");
        }
        let blocked = matches!(
            reactor.with_ctx(|ctx| ctx.send(source.conn, b"x", None)),
            Err(SendError::WouldBlock)
        );
        if !blocked {
            sent += 1;
            continue;
        }
        assert_eq!(origin.seen.borrow().held.len(), sent, "every message held");
        origin.seen.borrow_mut().hold = false;
        return std::mem::take(&mut origin.seen.borrow_mut().held);
    }
    panic!("the peer never ran out of credits ({sent} sent)");
}

/// Whether `origin` has put on the wire (posted) credits for its peer to
/// send again, and owes it no update.
fn announced(reactor: &Reactor<Probe, ()>, origin: &End) -> bool {
    let origin = reactor.conns.get(origin.conn.key()).expect("origin");
    let credits = origin.credits();
    origin.is_quiet() && credits.granted().wrapping_sub(credits.received()) >= 2
}

/// The pass a reactor makes after arming its CQs to sleep (the loopback
/// device arms none): it finds nothing, and `origin`'s credits are on
/// their way.
fn pass_after_arming_announces(reactor: &mut Reactor<Probe, ()>, origin: &End) {
    assert_eq!(
        reactor.pass_after_arming().expect("a pass"),
        0,
        "nothing completed"
    );
    assert!(
        announced(reactor, origin),
        "the credits are on their way before the sleep"
    );
}

/// A peer out of credits, and the messages that took them released by
/// the handler's `on_idle` in the pass a reactor makes after arming its
/// CQs to sleep: their receives are reposted after that pass's doorbells,
/// and announced before the reactor sleeps (nothing else would wake it).
/// On the connection's own ring and on the SRQ.
#[test]
fn credits_the_last_pass_before_a_sleep_reposts_are_announced() {
    // SAFETY: every QP of the device is served from this thread.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().expect("a PD");
    for mut reactor in [super::reactor(&pd), srq_reactor(&pd)] {
        let (origin, source) = add_pair(&mut reactor, &pd);
        let held = exhaust(&mut reactor, &origin, &source);
        origin.seen.borrow_mut().release_on_idle = held;
        // What a reactor does before it sleeps (the loopback device arms
        // no CQ).
        reactor.settle_for_sleep();
        pass_after_arming_announces(&mut reactor, &origin);
        assert!(origin.seen.borrow().release_on_idle.is_empty(), "released");
        run_until(&mut reactor, "the peer may send again", |reactor| {
            let source = reactor.conns.get(source.conn.key()).expect("source");
            source.credits().available() >= 2
        });
    }
}

/// A peer out of credits; its messages released, and the SRQ refuses the
/// post the connection's flush makes of them as the reactor prepares to
/// sleep (the pool's post at the pass's end succeeds): the credits are
/// counted and announced before the reactor sleeps.
#[test]
fn credits_a_refused_srq_post_delayed_are_announced_before_a_sleep() {
    // SAFETY: every QP of the device is served from this thread.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().expect("a PD");
    let mut reactor = srq_reactor(&pd);
    let (origin, source) = add_pair(&mut reactor, &pd);
    let held = exhaust(&mut reactor, &origin, &source);
    let pool = reactor.srq.as_ref().expect("an SRQ reactor");
    refuse_srq_recvs_after(pool.srq(), 0);
    release_all(&mut reactor, held);
    reactor.settle_for_sleep();
    pass_after_arming_announces(&mut reactor, &origin);
    assert_eq!(reactor.srq_posted(), Some(SRQ_DEPTH), "all posted");
    send(&mut reactor, source.conn, b"again");
    run_until(&mut reactor, "the peer's next message", |_| {
        origin
            .seen
            .borrow()
            .messages
            .last()
            .is_some_and(|m| m == b"again")
    });
}

/// Slots a removed connection's handler held come back while the SRQ
/// refuses their post: no orphans any more, but not on the SRQ either, so
/// a newcomer's share must not count on them until a pass posts them.
#[test]
fn slots_a_refused_post_left_unposted_are_promised_to_no_newcomer() {
    // SAFETY: every QP of the device is served from this thread.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().expect("a PD");
    let mut reactor = srq_reactor(&pd);
    let (origin, source) = add_pair(&mut reactor, &pd);
    let (relay, sink) = add_pair(&mut reactor, &pd);
    let held = hold(&mut reactor, &origin, &source);
    reactor.remove(origin.session).expect("origin's session");
    assert_eq!(orphaned(&reactor), HELD);
    // The pass that takes them back, and the one `add` makes first.
    let pool = reactor.srq.as_ref().expect("an SRQ reactor");
    refuse_srq_recvs_after(pool.srq(), 0);
    refuse_srq_recvs_after(pool.srq(), 0);
    release_all(&mut reactor, held);
    reactor.turn().expect("the pass that takes them back");
    assert_eq!(orphaned(&reactor), 0, "no orphans any more");
    refuse_a_newcomer(&mut reactor, &pd);
    // The next add's pass posts them: the newcomers fit.
    let (late, late_peer) = welcome_a_newcomer(&mut reactor, &pd);
    let ends = [
        ("relay", &relay),
        ("sink", &sink),
        ("late", &late),
        ("late's peer", &late_peer),
    ];
    assert!(errors_of(&ends).is_empty(), "{:?}", errors_of(&ends));
}

/// As [`credits_the_last_pass_before_a_sleep_reposts_are_announced`],
/// releasing one message fewer than a repost batch (parked, not due): the
/// receives are reposted and announced before the sleep all the same.
#[test]
fn a_release_below_a_repost_batch_before_a_sleep_is_announced() {
    // SAFETY: every QP of the device is served from this thread.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().expect("a PD");
    for mut reactor in [super::reactor(&pd), srq_reactor(&pd)] {
        let (origin, source) = add_pair(&mut reactor, &pd);
        let mut held = exhaust(&mut reactor, &origin, &source);
        let depth = reactor
            .conns
            .get(origin.conn.key())
            .expect("origin")
            .rq()
            .depth();
        let batch = reactor.config.repost_batch.min(depth / 2) as usize;
        let rest = held.split_off(batch - 1);
        origin.seen.borrow_mut().release_on_idle = held;
        reactor.settle_for_sleep();
        pass_after_arming_announces(&mut reactor, &origin);
        release_all(&mut reactor, rest);
    }
}

/// The SRQ refuses the post the pass after arming makes of receives its
/// idle callback released (the pool's post at its end succeeds): they are
/// credited and announced before the sleep all the same.
#[test]
fn a_refused_srq_post_in_the_pass_after_arming_is_announced() {
    // SAFETY: every QP of the device is served from this thread.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().expect("a PD");
    let mut reactor = srq_reactor(&pd);
    let (origin, source) = add_pair(&mut reactor, &pd);
    let held = exhaust(&mut reactor, &origin, &source);
    origin.seen.borrow_mut().release_on_idle = held;
    reactor.settle_for_sleep();
    let pool = reactor.srq.as_ref().expect("an SRQ reactor");
    refuse_srq_recvs_after(pool.srq(), 0);
    pass_after_arming_announces(&mut reactor, &origin);
    assert_eq!(reactor.srq_posted(), Some(SRQ_DEPTH), "all posted");
}
