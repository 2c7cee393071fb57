//! Ids kept past their entry's last generation: a connection's or
//! session's entry whose generations are spent is retired, so a
//! `ConnId`, `SessionId` or `HeldRecv` of its first tenant never reaches
//! a newcomer (with wrapping generations, the 2^32nd newcomer after it
//! would have been that tenant's namesake).

use super::*;
use crate::reactor::SendError;

#[test]
fn ids_of_an_entrys_first_tenant_never_reach_a_newcomer_after_its_last() {
    // SAFETY: every QP of the device is served from this thread.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().expect("a PD");
    let mut reactor = reactor(&pd);
    let (first, first_peer) = add_pair(&mut reactor, &pd);
    first.seen.borrow_mut().hold = true;
    send(&mut reactor, first_peer.conn, b"kept");
    run_until(&mut reactor, "the message held", |_| {
        first.seen.borrow().held.len() == 1
    });
    let held = first.seen.borrow_mut().held.pop().expect("one held");
    let (conn, session) = (first.conn.key(), first.session.0);
    assert_eq!((conn.generation, session.generation), (0, 0));
    drop(reactor.remove(first.session).expect("the first session"));
    reactor
        .turn()
        .expect("the pass that releases the quarantine");

    // The entries' last tenants (as after 2^32 - 1 more), then removed.
    assert!(reactor.conns.age_vacant(u32::MAX));
    assert!(reactor.sessions.age_vacant(u32::MAX));
    let (last, last_peer) = add_pair(&mut reactor, &pd);
    assert_eq!(
        (last.conn.key().index, last.conn.key().generation),
        (conn.index, u32::MAX)
    );
    assert_eq!(last.session.0.index, session.index);
    drop(reactor.remove(last.session).expect("the last tenant"));
    drop(reactor.remove(last_peer.session).expect("its peer"));
    reactor
        .turn()
        .expect("the pass that releases the quarantine");

    // Newcomers, more than the freed entries: none takes the spent ones.
    let (one, two) = add_pair(&mut reactor, &pd);
    let (three, four) = add_pair(&mut reactor, &pd);
    let newcomers = [&one, &two, &three, &four];
    assert!(reactor.conns(first.session).next().is_none());
    assert!(reactor.handler(first.session).is_none());
    assert!(reactor.remove(first.session).is_none());
    let queued = |reactor: &Reactor<Probe, ()>| -> Vec<Vec<u32>> {
        newcomers
            .iter()
            .map(|end| {
                let conn = reactor.conns.get(end.conn.key()).expect("a newcomer");
                conn.rq().pending_slots().to_vec()
            })
            .collect()
    };
    let before = queued(&reactor);
    reactor.with_ctx(|ctx| {
        let sent = ctx.send(first.conn, b"stale", None);
        assert!(
            matches!(sent, Err(SendError::Closed)),
            "a stale ConnId reached a newcomer: {sent:?}"
        );
        assert_eq!(ctx.held_bytes(&held), None, "the slot is no newcomer's");
        let held = match ctx.forward(one.conn, held, None) {
            Err((SendError::Foreign, held)) => held,
            other => panic!("a stale held message forwarded: {other:?}"),
        };
        ctx.release(held)
            .expect("a gone connection's slot: nothing to do");
    });
    assert_eq!(queued(&reactor), before, "no newcomer's slot queued");
    for end in newcomers {
        assert_ne!(end.conn.key().index, conn.index, "a spent entry reused");
        assert_ne!(end.session.0.index, session.index, "a spent entry reused");
    }
    send(&mut reactor, two.conn, b"fresh");
    run_until(&mut reactor, "the newcomers talk", |_| {
        one.seen.borrow().messages == [b"fresh".to_vec()]
    });
    let ends = newcomers.iter().all(|end| {
        let seen = end.seen.borrow();
        seen.errors.is_empty() && seen.messages.len() <= 1
    });
    assert!(ends, "no newcomer got anything of the first tenant's");
}

/// A held message names its reactor through its connection's id: another
/// reactor's `Ctx` gives it back as foreign (release, forward, its bytes)
/// even where that reactor has a connection at the same index and
/// generation, and its own reactor takes it.
#[test]
fn a_held_message_is_foreign_to_another_reactor_with_the_same_index() {
    // SAFETY: every QP of the device is served from this thread.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().expect("a PD");
    let mut reactor = reactor(&pd);
    let mut other = super::reactor(&pd);
    let (here, peer) = add_pair(&mut reactor, &pd);
    let (namesake, _) = add_pair(&mut other, &pd);
    assert_eq!(
        (here.conn.key().index, here.conn.key().generation),
        (namesake.conn.key().index, namesake.conn.key().generation),
        "the same index and generation on both reactors"
    );
    here.seen.borrow_mut().hold = true;
    send(&mut reactor, peer.conn, b"kept");
    run_until(&mut reactor, "the message held", |_| {
        here.seen.borrow().held.len() == 1
    });
    let held = here.seen.borrow_mut().held.pop().expect("one held");
    let held = other.with_ctx(|ctx| {
        assert_eq!(ctx.held_bytes(&held), None, "not readable there");
        let held = match ctx.forward(namesake.conn, held, None) {
            Err((SendError::Foreign, held)) => held,
            other => panic!("forwarded from another reactor: {other:?}"),
        };
        match ctx.release(held) {
            Err((SendError::Foreign, held)) => held,
            other => panic!("released on another reactor: {other:?}"),
        }
    });
    reactor.with_ctx(|ctx| {
        assert_eq!(ctx.held_bytes(&held), Some(&b"kept"[..]));
        ctx.release(held).expect("released at home");
    });
}
