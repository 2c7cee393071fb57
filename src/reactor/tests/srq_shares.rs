//! What the SRQ's receives back: a connection's credits count an SRQ slot
//! only once the SRQ holds it again, and a newcomer's share is promised
//! only out of slots that can come back (not those a removed connection
//! still has out, held or forwarded).

use super::srq::errors_of;
use super::*;
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
    let access = AccessFlags::empty();
    let [a, b] = connected_qps(&mut reactor, &pd, access);
    let seen = Rc::new(RefCell::new(Seen::default()));
    let refused = reactor.add(vec![a, b], Probe(seen));
    match refused {
        Err(Error::InvalidArgument(what)) => assert!(what.contains("shares"), "{what}"),
        other => panic!("a newcomer promised slots still out: {other:?}"),
    }

    // The forwards complete, and the held messages are released: every
    // slot is back, none is an orphan, and the newcomers fit.
    reactor.with_ctx(|ctx| {
        for message in held {
            if let Err((err, _)) = ctx.release(message) {
                panic!("releasing: {err}");
            }
        }
    });
    run_until(&mut reactor, "the orphans back", |reactor| {
        orphaned(reactor) == 0
    });
    assert_eq!(sink.seen.borrow().messages.len(), 2, "both forwarded");
    let (late, late_peer) = add_pair(&mut reactor, &pd);
    send(&mut reactor, late_peer.conn, b"welcome");
    run_until(&mut reactor, "the newcomer's message", |_| {
        late.seen.borrow().messages.len() == 1
    });
    let ends = [
        ("source", &source),
        ("relay", &relay),
        ("sink", &sink),
        ("late", &late),
        ("late's peer", &late_peer),
    ];
    assert!(errors_of(&ends).is_empty(), "{:?}", errors_of(&ends));
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
    reactor.with_ctx(|ctx| {
        for message in held {
            if let Err((err, _)) = ctx.release(message) {
                panic!("releasing: {err}");
            }
        }
    });
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
