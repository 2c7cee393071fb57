//! The shared receive queue's paths: where every one of its slots is after
//! traffic, a refused repost, a removed or failed connection holding and
//! forwarding slots, a QP the reactor does not serve, and a removal.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use super::*;
use crate::reactor::SendError;
use crate::reactor::pass::SRQ_RETRY;

/// Where each slot of the reactor's SRQ is that the pool or a connection
/// knows of (held messages and forwards in flight are none of these), and
/// how many the device consumed whose completions are not yet polled.
#[derive(Debug)]
struct SrqSlots {
    /// Posted on the device.
    posted: BTreeSet<u32>,
    /// In the pool's batch, to be posted with this pass.
    queued: BTreeSet<u32>,
    /// In the pool after a failed post, for a later pass.
    stranded: BTreeSet<u32>,
    /// Queued for reposting by a connection, or released by a handler
    /// after its connection went.
    returning: BTreeSet<u32>,
    /// Consumed on the device, their completions not yet polled (the pool
    /// still counts them available).
    unpolled: usize,
}

impl SrqSlots {
    fn count(&self) -> usize {
        self.posted.len() + self.queued.len() + self.stranded.len() + self.returning.len()
    }

    fn has(&self, slot: u32) -> bool {
        [&self.posted, &self.queued, &self.stranded, &self.returning]
            .iter()
            .any(|set| set.contains(&slot))
    }
}

/// Where the SRQ's slots are, asserting that each is in one place once
/// (the device holds it once, under the `wr_id` the pool posted it with)
/// and that the pool's `available` counts at least those posted or queued
/// (the rest are consumed, their completions not yet polled).
#[track_caller]
fn srq_account(reactor: &Reactor<Probe, ()>) -> SrqSlots {
    let pool = reactor.srq.as_ref().expect("an SRQ reactor");
    let (queued, stranded) = pool.unposted();
    let mut places: Vec<(u32, &str)> = Vec::new();
    places.extend(pool.on_device().into_iter().map(|slot| (slot, "posted")));
    places.extend(queued.into_iter().map(|slot| (slot, "queued")));
    places.extend(stranded.into_iter().map(|slot| (slot, "stranded")));
    for (_, conn) in reactor
        .conns
        .iter()
        .filter(|(_, conn)| conn.rq().uses_srq())
    {
        places.extend(
            conn.rq()
                .pending_slots()
                .iter()
                .map(|&slot| (slot, "returning")),
        );
    }
    let released = &reactor.deferred.srq_returns;
    places.extend(released.iter().map(|&slot| (slot, "returning")));
    let mut seen: BTreeMap<u32, &str> = BTreeMap::new();
    for (slot, place) in places {
        assert!(slot < SRQ_DEPTH, "slot {slot} outside the SRQ");
        if let Some(before) = seen.insert(slot, place) {
            panic!("SRQ slot {slot} is {before} and {place}");
        }
    }
    let of = |wanted: &str| -> BTreeSet<u32> {
        seen.iter()
            .filter(|&(_, &place)| place == wanted)
            .map(|(&slot, _)| slot)
            .collect()
    };
    let (posted, queued) = (of("posted"), of("queued"));
    let unpolled = (pool.available as usize)
        .checked_sub(posted.len() + queued.len())
        .unwrap_or_else(|| {
            panic!(
                "available ({}) short of the slots posted or queued: {posted:?} {queued:?}",
                pool.available
            )
        });
    SrqSlots {
        posted,
        queued,
        stranded: of("stranded"),
        returning: of("returning"),
        unpolled,
    }
}

/// Runs passes until every slot of the SRQ is posted again, each once.
#[track_caller]
pub(super) fn run_until_srq_whole(reactor: &mut Reactor<Probe, ()>, what: &str) {
    run_until(reactor, what, |reactor| {
        srq_account(reactor).posted.len() == SRQ_DEPTH as usize
    });
    assert_eq!(reactor.srq_posted(), Some(SRQ_DEPTH));
}

/// The messages `end` received, as the `u32`s they carry.
fn numbers(end: &End) -> Vec<u32> {
    let seen = end.seen.borrow();
    seen.messages
        .iter()
        .map(|m| u32::from_le_bytes(m[..4].try_into().expect("4 bytes")))
        .collect()
}

/// Every end's errors, with its name, for an assertion that there are none.
pub(super) fn errors_of(ends: &[(&str, &End)]) -> Vec<String> {
    ends.iter()
        .filter(|(_, end)| !end.seen.borrow().errors.is_empty())
        .map(|(name, end)| format!("{name}: {:?}", end.seen.borrow().errors))
        .collect()
}

/// Traffic both ways over two pairs of connections on the SRQ, three
/// shares' worth on each: every message arrives in order, and once the
/// reactor is idle every slot is posted on the SRQ again, once.
#[test]
fn srq_messages_arrive_and_every_slot_comes_back_once() {
    // SAFETY: every QP of the device is served from this thread.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().expect("a PD");
    let mut reactor = srq_reactor(&pd);
    let start = srq_account(&reactor);
    assert_eq!(
        start.posted.len(),
        SRQ_DEPTH as usize,
        "all posted at first"
    );
    let (a, b) = add_pair(&mut reactor, &pd);
    let (c, d) = add_pair(&mut reactor, &pd);
    let rounds = 3 * SRQ_SHARE;
    let ends = [(&a, &b), (&b, &a), (&c, &d), (&d, &c)];
    // A round at a time, where every slot is looked at after every pass.
    for i in 0..rounds {
        for (from, _) in ends {
            send(&mut reactor, from.conn, &i.to_le_bytes());
        }
        run_until(&mut reactor, "the round delivered", |reactor| {
            srq_account(reactor);
            ends.iter()
                .all(|(_, to)| to.seen.borrow().messages.len() == i as usize + 1)
        });
    }
    let expected: Vec<u32> = (0..rounds).collect();
    for (_, to) in ends {
        assert_eq!(numbers(to), expected);
    }
    run_until_srq_whole(&mut reactor, "every SRQ slot posted again");
    let named = [("a", &a), ("b", &b), ("c", &c), ("d", &d)];
    assert!(errors_of(&named).is_empty(), "{:?}", errors_of(&named));
}

/// Messages held on two connections of the SRQ, released at once: the
/// next pass gives back more slots than one post of the pool takes, and
/// the device refuses its posts for a while (as a provider whose SRQ
/// filled up would). Slots given back while the pool's batch is full and
/// its post refused wait in the pool (stranded) for a later pass, which
/// posts them; none is lost or posted twice, no connection is failed for
/// the shared queue's refusal, and the SRQ serves traffic after.
#[test]
fn srq_slots_a_refused_repost_strands_go_back_with_a_later_pass() {
    // SAFETY: every QP of the device is served from this thread.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().expect("a PD");
    let mut reactor = srq_reactor(&pd);
    let (first, first_source) = add_pair(&mut reactor, &pd);
    let (second, second_source) = add_pair(&mut reactor, &pd);
    const HELD: u32 = 40;
    first.seen.borrow_mut().hold = true;
    second.seen.borrow_mut().hold = true;
    for i in 0..HELD {
        send(&mut reactor, first_source.conn, &i.to_le_bytes());
        send(&mut reactor, second_source.conn, &i.to_le_bytes());
    }
    run_until(&mut reactor, "both hold their messages", |_| {
        [&first, &second]
            .iter()
            .all(|end| end.seen.borrow().held.len() == HELD as usize)
    });
    let mut held = std::mem::take(&mut first.seen.borrow_mut().held);
    held.append(&mut second.seen.borrow_mut().held);
    first.seen.borrow_mut().hold = false;
    second.seen.borrow_mut().hold = false;
    let account = srq_account(&reactor);
    for held in &held {
        assert!(
            !account.has(held.slot()),
            "held slot {} elsewhere",
            held.slot()
        );
    }
    assert_eq!(
        account.count() + held.len(),
        SRQ_DEPTH as usize,
        "before: every slot posted, queued, returning or held once"
    );

    // Released together: the next pass gives back 80 slots, more than the
    // pool's batch (64), while the device refuses its next posts.
    const REFUSED: usize = 24;
    let pool = reactor.srq.as_ref().expect("an SRQ reactor");
    for _ in 0..REFUSED {
        refuse_srq_recvs_after(pool.srq(), 0);
    }
    release_all(&mut reactor, held);
    reactor.turn().expect("the pass that gives the slots back");
    let account = srq_account(&reactor);
    assert!(
        !account.stranded.is_empty(),
        "a full batch the device refused strands what comes after: {account:?}"
    );
    assert_eq!(
        account.count(),
        SRQ_DEPTH as usize,
        "after the refusals: every slot posted, queued, stranded or returning once"
    );
    // Nothing but a pass posts them: a reactor that sleeps (in an event
    // mode) wakes for the next one within SRQ_RETRY, however long its idle
    // timeout.
    reactor.config.idle_timeout = Duration::MAX;
    assert_eq!(reactor.sleep_limit(), SRQ_RETRY);

    // Each pass after a failed post tries again (and meets one refusal
    // while they last): once they are used up, the next pass posts.
    run_within(
        &mut reactor,
        REFUSED + 2,
        "the stranded slots posted by the passes right after",
        |reactor| srq_account(reactor).posted.len() == SRQ_DEPTH as usize,
    );
    assert_eq!(reactor.srq_posted(), Some(SRQ_DEPTH));
    assert_eq!(
        reactor.sleep_limit(),
        Duration::MAX,
        "all posted: no early wake"
    );
    let ends = [
        ("first", &first),
        ("first's source", &first_source),
        ("second", &second),
        ("second's source", &second_source),
    ];
    assert!(errors_of(&ends).is_empty(), "{:?}", errors_of(&ends));

    // The SRQ is whole: the first connection takes three shares' worth.
    for i in HELD..HELD + 3 * SRQ_SHARE {
        send(&mut reactor, first_source.conn, &i.to_le_bytes());
    }
    run_until(&mut reactor, "three shares' worth more", |_| {
        first.seen.borrow().messages.len() == (HELD + 3 * SRQ_SHARE) as usize
    });
    let expected: Vec<u32> = (0..HELD + 3 * SRQ_SHARE).collect();
    assert_eq!(numbers(&first), expected);
    run_until_srq_whole(&mut reactor, "every SRQ slot posted again");
    assert!(errors_of(&ends).is_empty(), "{:?}", errors_of(&ends));

    // A lone slot whose post is refused on an otherwise idle reactor: the
    // pass right after the refusal tries again, without waiting for
    // anything else to happen.
    first.seen.borrow_mut().hold = true;
    send(&mut reactor, first_source.conn, &u32::MAX.to_le_bytes());
    run_until(&mut reactor, "one message held", |_| {
        first.seen.borrow().held.len() == 1
    });
    first.seen.borrow_mut().hold = false;
    let held = first.seen.borrow_mut().held.pop().expect("one held");
    // Idle long enough for every unsignaled tail to be signaled out.
    for _ in 0..4 * crate::reactor::idle::TAIL_SIGNAL_IDLE_PASSES {
        reactor.turn().expect("an idle pass");
    }
    let pool = reactor.srq.as_ref().expect("an SRQ reactor");
    // The connection's flush posts its slots at once, and the end of the
    // pass tries again: both are refused.
    refuse_srq_recvs_after(pool.srq(), 0);
    refuse_srq_recvs_after(pool.srq(), 0);
    let slot = held.slot();
    reactor.with_ctx(|ctx| {
        if let Err((err, _)) = ctx.release(held) {
            panic!("releasing: {err}");
        }
    });
    // Given back after a few idle passes (a lone slot waits for a fuller
    // batch), and refused: it stays in the pool's batch.
    run_within(
        &mut reactor,
        4 * crate::reactor::idle::REPOST_IDLE_PASSES as usize,
        "the slot's post refused",
        |reactor| srq_account(reactor).queued.contains(&slot),
    );
    reactor.turn().expect("the pass after the refusal");
    let account = srq_account(&reactor);
    assert_eq!(
        account.posted.len(),
        SRQ_DEPTH as usize,
        "the next pass posts it: {account:?}"
    );
    assert!(errors_of(&ends).is_empty(), "{:?}", errors_of(&ends));
}

/// Six messages held on `origin` (on the SRQ); two of them forwarded on
/// `relay` with the next pass, whose completions (unsignaled) are not yet
/// polled when this returns: the held four and the forwarded two.
fn hold_six_forward_two(
    reactor: &mut Reactor<Probe, ()>,
    origin: &End,
    source: &End,
    relay: &End,
) -> (Vec<HeldRecv>, Vec<u32>) {
    origin.seen.borrow_mut().hold = true;
    for i in 1..=6u8 {
        send(reactor, source.conn, &[i; 8]);
    }
    run_until(reactor, "six messages held", |_| {
        origin.seen.borrow().held.len() == 6
    });
    origin.seen.borrow_mut().hold = false;
    let mut held = std::mem::take(&mut origin.seen.borrow_mut().held);
    let forwarded: Vec<HeldRecv> = held.drain(..2).collect();
    let forwarded_slots = forwarded.iter().map(HeldRecv::slot).collect();
    reactor.with_ctx(|ctx| {
        forward_all(ctx, relay.conn, forwarded);
    });
    reactor.turn().expect("the pass that posts the forwards");
    let sq_used = reactor.conn_stats(relay.conn).expect("relay").sq_used;
    assert!(sq_used >= 2, "the forwards are in flight ({sq_used})");
    (held, forwarded_slots)
}

/// A connection on the SRQ removed while it holds four messages and two
/// of them are being forwarded, and while two receives it consumed wait
/// in the CQ: the held slots go back when released, the forwarded ones
/// when the relay's completion is polled, and the two unpolled ones are
/// reclaimed (their QP is gone); each exactly once.
#[test]
fn a_removed_srq_connection_gives_back_its_held_and_forwarded_slots_once() {
    // SAFETY: every QP of the device is served from this thread.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().expect("a PD");
    let mut reactor = srq_reactor(&pd);
    let (origin, source) = add_pair(&mut reactor, &pd);
    let (relay, sink) = add_pair(&mut reactor, &pd);
    let (held, forwarded) = hold_six_forward_two(&mut reactor, &origin, &source, &relay);

    // Two more messages, posted with a pass whose completions stay queued.
    send(&mut reactor, source.conn, &[7; 8]);
    send(&mut reactor, source.conn, &[8; 8]);
    reactor.turn().expect("the pass that posts them");
    let messages = origin.seen.borrow().messages.len();
    assert_eq!(messages, 6, "the two are not polled yet");
    let (foreign_before, reclaimed_before) = ignored(&reactor);
    reactor.remove(origin.session).expect("origin's session");

    let account = srq_account(&reactor);
    for slot in held.iter().map(HeldRecv::slot).chain(forwarded.clone()) {
        assert!(
            !account.has(slot),
            "slot {slot} back while held or in flight"
        );
    }
    release_all(&mut reactor, held);
    run_until_srq_whole(&mut reactor, "every slot back");
    let (foreign, reclaimed) = ignored(&reactor);
    assert_eq!(reclaimed - reclaimed_before, 2, "the two unpolled receives");
    assert_eq!(foreign, foreign_before, "none taken for a stranger's");
    assert_eq!(sink.seen.borrow().messages, [vec![1; 8], vec![2; 8]]);
    let ends = [("relay", &relay), ("sink", &sink)];
    assert!(errors_of(&ends).is_empty(), "{:?}", errors_of(&ends));
}

/// A connection on the SRQ that fails (its peer is gone, so its next SEND
/// does) while it holds four messages and two of them are being
/// forwarded: it stays until removed, and the slots come back to the SRQ
/// through it, exactly once: the held ones when released, the forwarded
/// ones when the relay's completion is polled.
#[test]
fn a_failed_srq_connection_gives_back_its_held_and_forwarded_slots_once() {
    // SAFETY: every QP of the device is served from this thread.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().expect("a PD");
    let mut reactor = srq_reactor(&pd);
    let (origin, source) = add_pair(&mut reactor, &pd);
    let (relay, sink) = add_pair(&mut reactor, &pd);
    let (held, forwarded) = hold_six_forward_two(&mut reactor, &origin, &source, &relay);

    reactor.remove(source.session).expect("source's session");
    send(&mut reactor, origin.conn, b"anyone?");
    run_until(&mut reactor, "the origin failed", |_| {
        !origin.seen.borrow().errors.is_empty()
    });
    assert_eq!(origin.seen.borrow().errors.len(), 1, "told once");
    assert!(
        reactor.conns.get(origin.conn.key()).is_some(),
        "not removed"
    );
    let account = srq_account(&reactor);
    for slot in held.iter().map(HeldRecv::slot).chain(forwarded.clone()) {
        assert!(
            !account.has(slot),
            "slot {slot} back while held or in flight"
        );
    }

    release_all(&mut reactor, held);
    run_until_srq_whole(&mut reactor, "every slot back");
    assert_eq!(sink.seen.borrow().messages, [vec![1; 8], vec![2; 8]]);
    assert_eq!(origin.seen.borrow().errors.len(), 1, "still told once");
    let ends = [("relay", &relay), ("sink", &sink)];
    assert!(errors_of(&ends).is_empty(), "{:?}", errors_of(&ends));
}

/// A QP on the reactor's SRQ that the reactor does not serve (never
/// added) consumes a slot: its completion reaches the reactor's CQ
/// naming a QP it does not know, and the slot goes straight back to the
/// SRQ (counted as reclaimed), once; the served connections keep going.
#[test]
fn an_srq_slot_consumed_by_a_qp_the_reactor_does_not_serve_comes_back() {
    // SAFETY: every QP of the device is served from this thread.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().expect("a PD");
    let mut reactor = srq_reactor(&pd);
    let (a, b) = add_pair(&mut reactor, &pd);
    run_until_srq_whole(&mut reactor, "settled");

    let spec = reactor.qp_spec("stranger");
    let CqChoice::Shared(cq) = spec.cq else {
        panic!("qp_spec did not share the reactor's CQ");
    };
    let srq = spec.srq.expect("an SRQ reactor's spec names its SRQ");
    let mut stranger = pd
        .create_qp_with_srq(&cq, &cq, &srq, &spec.qp)
        .expect("a QP on the reactor's SRQ");
    let other_cq = ctx.create_cq(16, None).expect("a CQ of its own");
    let mut peer = pd
        .create_qp(&other_cq, &other_cq, &QpConfig::default())
        .expect("the stranger's peer");
    let (to_stranger, to_peer) = (stranger.endpoint(), peer.endpoint());
    stranger.connect(&to_peer).expect("connect");
    peer.connect(&to_stranger).expect("connect");

    let oldest = srq_account(&reactor).posted.len();
    assert_eq!(oldest, SRQ_DEPTH as usize);
    let first = reactor.srq.as_ref().expect("an SRQ").on_device()[0];
    peer.post_send(&mut WorkRequest::send_inline(1, b"not the reactor's"))
        .expect("a SEND into the SRQ");
    let account = srq_account(&reactor);
    assert!(!account.has(first), "slot {first} consumed");
    assert_eq!(account.count(), SRQ_DEPTH as usize - 1);
    assert_eq!(account.unpolled, 1, "its completion not yet polled");

    run_until(&mut reactor, "the slot reclaimed", |reactor| {
        ignored(reactor).1 == 1
    });
    assert_eq!(ignored(&reactor), (0, 1), "reclaimed, not foreign");
    run_until_srq_whole(&mut reactor, "the slot posted again");
    assert_eq!(
        reactor.srq.as_ref().expect("an SRQ").on_device().last(),
        Some(&first),
        "the slot went back to the SRQ's tail"
    );

    for i in 0..2 * SRQ_SHARE {
        send(&mut reactor, a.conn, &i.to_le_bytes());
    }
    run_until(&mut reactor, "the served pair keeps going", |_| {
        b.seen.borrow().messages.len() == 2 * SRQ_SHARE as usize
    });
    assert_eq!(numbers(&b), (0..2 * SRQ_SHARE).collect::<Vec<_>>());
    assert_eq!(ignored(&reactor), (0, 1));
    drop(stranger);
}

/// A session removed at its handler's request (the removal comes after
/// the pass's flush) hands the SRQ receives it consumed back: that same
/// pass posts them, so a reactor about to sleep owes the SRQ nothing.
#[test]
fn receives_a_removal_hands_back_go_out_in_the_same_pass() {
    // SAFETY: every QP of the device is served from this thread.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().expect("a PD");
    let mut reactor = srq_reactor(&pd);
    let (origin, source) = add_pair(&mut reactor, &pd);
    run_until_srq_whole(&mut reactor, "the SRQ posted");
    send(&mut reactor, source.conn, &[1; 8]);
    send(&mut reactor, source.conn, &[2; 8]);
    run_until(&mut reactor, "two messages", |_| {
        origin.seen.borrow().messages.len() == 2
    });
    let account = srq_account(&reactor);
    assert!(
        account.posted.len() < SRQ_DEPTH as usize,
        "the two wait for a fuller repost batch: {account:?}"
    );

    reactor.with_ctx(|ctx| ctx.remove_session(origin.session));
    reactor.poll_once().expect("the pass that removes it");
    assert!(reactor.sessions.get(origin.session).is_none(), "removed");
    let account = srq_account(&reactor);
    assert_eq!(
        account.posted.len(),
        SRQ_DEPTH as usize,
        "every slot posted by the pass of the removal: {account:?}"
    );
}

/// Forwards of an SRQ connection's messages complete after the connection
/// is gone: the pass that retires them gives their slots back to the SRQ
/// and posts them itself. A retire lists no connection for the flush, and
/// here nothing else asks for one: the sink is on another reactor, the
/// removals have settled, and the forwards are signaled, so their one
/// completion is all that pass polls.
#[test]
fn forwarded_slots_of_a_removed_origin_are_posted_by_the_pass_that_retires_them() {
    // SAFETY: every QP of the device is served from this thread.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().expect("a PD");
    let mut reactor = srq_reactor(&pd);
    let mut other = super::reactor(&pd);
    let (origin, source) = add_pair(&mut reactor, &pd);
    let (relay, sink) = add_pair_across(&mut reactor, &mut other, &pd);
    run_until_srq_whole(&mut reactor, "settled");

    origin.seen.borrow_mut().hold = true;
    send(&mut reactor, source.conn, &[1; 8]);
    send(&mut reactor, source.conn, &[2; 8]);
    run_until(&mut reactor, "two messages held", |_| {
        origin.seen.borrow().held.len() == 2
    });
    let held = std::mem::take(&mut origin.seen.borrow_mut().held);
    let forwarded: Vec<u32> = held.iter().map(HeldRecv::slot).collect();
    reactor.with_ctx(|ctx| {
        forward_all(ctx, relay.conn, held);
        ctx.signal_staged(relay.conn);
    });
    // Staged, not yet posted: the next pass's flush posts them, after the
    // removals below have asked for that flush.
    reactor.remove(origin.session).expect("origin's session");
    reactor.remove(source.session).expect("source's session");
    reactor.turn().expect("the pass that posts the forwards");
    let account = srq_account(&reactor);
    for slot in &forwarded {
        assert!(!account.has(*slot), "slot {slot} back while in flight");
    }
    let sq_used = reactor.conn_stats(relay.conn).expect("relay").sq_used;
    assert!(sq_used >= 2, "the forwards are in flight ({sq_used})");

    reactor.turn().expect("the pass that retires the forwards");
    let sq_used = reactor.conn_stats(relay.conn).expect("relay").sq_used;
    assert_eq!(sq_used, 0, "this pass retired the forwards");
    let account = srq_account(&reactor);
    for slot in &forwarded {
        assert!(
            account.posted.contains(slot),
            "forwarded slot {slot} not posted by the pass that retired it: {account:?}"
        );
    }
    run_until(&mut other, "the sink has both", |_| {
        sink.seen.borrow().messages.len() == 2
    });
    assert_eq!(sink.seen.borrow().messages, [vec![1; 8], vec![2; 8]]);
}

/// A peer that ignores its credits (a raw QP on one connection of the SRQ
/// reactor) while an honest one keeps to its own (another connection, at
/// its credit limit). The flooder first sends just what it was granted,
/// pass after pass, and is not cut off; then twice the SRQ at once: it
/// takes every SRQ receive posted at that moment and no more (the rest of
/// its SENDs wait, as for an RNR), never more than `srq_depth` beyond its
/// grant. The very next pass cuts it off (its connection is told of the
/// overrun), fails every SEND it had waiting (its peer's QP is in the
/// error state), and gives back every SRQ receive it took; it takes none
/// after. The honest peer's messages all arrive, in order, with no failed
/// completion.
#[test]
fn a_flooding_peer_takes_at_most_the_srq_beyond_its_grant_and_is_cut_off_within_a_pass() {
    // SAFETY: every QP of the device is served from this thread.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().expect("a PD");
    let mut reactor = srq_reactor(&pd);
    let (honest, sink) = add_pair(&mut reactor, &pd);
    let (victim, mut flooder) = RawPeer::connect(&mut reactor, &ctx, &pd);
    flooder.send(RawPeer::CREDIT, 0);
    run_until(&mut reactor, "the flooder's connection established", |_| {
        victim.seen.borrow().established
    });
    run_until_srq_whole(&mut reactor, "settled");
    let granted = |reactor: &Reactor<Probe, ()>| {
        let conn = reactor.conns.get(victim.conn.key()).expect("the victim");
        u64::from(conn.credits().granted())
    };
    const HONEST: u32 = 6 * SRQ_SHARE;
    /// Passes the flooder keeps to its grant before it floods.
    const POLITE_PASSES: usize = 20;
    const FLOOD: u32 = 2 * SRQ_DEPTH;
    let mut sent = 0u32;
    let mut cut_off = false;
    for pass in 0..MAX_PASSES {
        if cut_off && numbers(&sink).len() == HONEST as usize {
            break;
        }
        reactor.with_ctx(|ctx| {
            while sent < HONEST {
                match ctx.send(honest.conn, &sent.to_le_bytes(), None) {
                    Ok(_) => sent += 1,
                    Err(SendError::WouldBlock) => break,
                    Err(err) => panic!("the honest peer: {err}"),
                }
            }
        });
        flooder.reap();
        let took_before = flooder.delivered;
        if pass < POLITE_PASSES {
            for _ in took_before..granted(&reactor) {
                flooder.send(RawPeer::MESSAGE, 8);
            }
        } else if pass == POLITE_PASSES {
            let posted = srq_account(&reactor).posted.len() as u64;
            for _ in 0..FLOOD {
                flooder.send(RawPeer::MESSAGE, 8);
            }
            flooder.reap();
            assert_eq!(
                flooder.delivered - took_before,
                posted,
                "it takes every SRQ receive posted, and no more"
            );
        }
        flooder.reap();
        let took = flooder.delivered;
        let beyond = took.saturating_sub(granted(&reactor));
        assert!(
            beyond <= u64::from(SRQ_DEPTH),
            "{beyond} receives beyond the grant"
        );
        reactor.turn().expect("a pass");
        let told = victim.seen.borrow().errors.clone();
        flooder.reap();
        assert!(
            flooder.delivered == took || !cut_off && beyond == 0,
            "a receive after its first beyond the grant"
        );
        if cut_off || beyond == 0 {
            assert!(
                cut_off || told.is_empty(),
                "cut off within its grant: {told:?}"
            );
            continue;
        }
        // The pass right after its first receive beyond the grant.
        assert_eq!(told.len(), 1, "cut off by this pass, told once");
        assert!(told[0].1.contains("ignored its credits"), "{told:?}");
        cut_off = true;
        assert_eq!(
            flooder.failed,
            flooder.posted - took,
            "every SEND it had waiting failed"
        );
        assert_eq!(
            victim.seen.borrow().messages.len() as u64,
            granted(&reactor) - 1,
            "delivered: every message within the grant (its first SEND was a credit update), none beyond"
        );
        let account = srq_account(&reactor);
        assert_eq!(
            account.count() + account.unpolled,
            SRQ_DEPTH as usize,
            "every slot back (or consumed anew by the honest peer): {account:?}"
        );
        let conn = reactor.conns.get(victim.conn.key()).expect("the victim");
        assert!(!conn.rq().owes_shared_slots(), "the victim holds none");
    }
    assert!(cut_off, "never cut off");
    assert_eq!(numbers(&sink), (0..HONEST).collect::<Vec<_>>());
    let ends = [("honest", &honest), ("sink", &sink)];
    assert!(errors_of(&ends).is_empty(), "{:?}", errors_of(&ends));
    run_until_srq_whole(&mut reactor, "every SRQ slot posted again");
}
