//! Which handlers' `on_idle` an empty pass calls: those whose last
//! `on_idle` returned `Idle::Again`, and newcomers once; a handler that
//! returns `Idle::Done` (as the default does) is never called again, and a
//! removed session leaves the list.

use super::*;

#[test]
fn only_handlers_that_ask_again_are_called_on_empty_passes() {
    // SAFETY: every QP of the device is served from this thread.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().expect("a PD");
    let mut reactor = reactor(&pd);
    let (again, done) = add_pair(&mut reactor, &pd);
    let before = (
        again.seen.borrow().idle_calls,
        done.seen.borrow().idle_calls,
    );
    // Done at its next call.
    done.seen.borrow_mut().idle_done_after = Some(before.1 + 1);
    let empty = reactor.counters().empty_passes;
    turns(&mut reactor, 50);
    let passes = (reactor.counters().empty_passes - empty) as u32;
    assert!(passes > 0, "some passes were empty");
    assert_eq!(
        again.seen.borrow().idle_calls - before.0,
        passes,
        "called on every empty pass"
    );
    assert_eq!(
        done.seen.borrow().idle_calls - before.1,
        1,
        "called until it said Done"
    );
    assert_eq!(reactor.sessions.idle_len(), 1);
    // A removed session leaves the list; a newcomer joins it.
    drop(reactor.remove(again.session).expect("its session"));
    assert_eq!(reactor.sessions.idle_len(), 0);
    let [a, b] = connected_qps(&mut reactor, &pd, AccessFlags::empty());
    let (newcomer, other) = (add_end(&mut reactor, a), add_end(&mut reactor, b));
    assert_eq!(reactor.sessions.idle_len(), 2);
    newcomer.seen.borrow_mut().idle_done_after = Some(3);
    other.seen.borrow_mut().idle_done_after = Some(1);
    turns(&mut reactor, 50);
    assert_eq!(
        newcomer.seen.borrow().idle_calls,
        3,
        "called until it said Done"
    );
    assert_eq!(reactor.sessions.idle_len(), 0, "an empty pass calls nobody");
}
