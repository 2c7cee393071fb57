//! `Reactor::run_until`: it returns once its condition holds, and when
//! stopped before that.

use super::*;
use crate::reactor::Ended;

#[test]
fn run_until_returns_once_its_condition_holds() {
    // SAFETY: every QP of the device is served from this thread.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().expect("a PD");
    let mut reactor = reactor(&pd);
    let (a, b) = add_pair(&mut reactor, &pd);
    reactor.with_ctx(|ctx| {
        for message in [b"one".as_slice(), b"two", b"three"] {
            ctx.send(a.conn, message, None).expect("room");
        }
    });
    let mut asked = 0;
    let done = reactor
        .run_until(|_| {
            asked += 1;
            b.seen.borrow().messages.len() == 3
        })
        .expect("passes");
    assert_eq!(done, Ended::Reached, "the condition held");
    assert!(asked > 1, "asked before the first pass and after passes");
    assert_eq!(
        b.seen.borrow().messages,
        [b"one".to_vec(), b"two".to_vec(), b"three".to_vec()]
    );
}

#[test]
fn run_until_returns_when_stopped_and_runs_again_after() {
    // SAFETY: every QP of the device is served from this thread.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().expect("a PD");
    let mut reactor = reactor(&pd);
    let (_a, _b) = add_pair(&mut reactor, &pd);
    reactor.stopper().stop();
    assert_eq!(
        reactor.run_until(|_| false).expect("passes"),
        Ended::Stopped,
        "stopped, not done"
    );
    // The stop was taken: the next run goes on until its condition.
    let mut passes = 0;
    let ended = reactor
        .run_until(|_| {
            passes += 1;
            passes == 10
        })
        .expect("passes");
    assert_eq!(ended, Ended::Reached);
}
