//! Completions a removed connection left on the CQ (requests that
//! completed before its QP went, and the receives its removal flushed):
//! the reactor's own, so counted as stale, never as a stranger's.

use super::*;

#[test]
fn a_removed_connections_late_completions_are_stale_not_foreign() {
    // SAFETY: every QP of the device is served from this thread.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().expect("a PD");
    let (mut sender, mut receiver) = (reactor(&pd), reactor(&pd));
    let (from, to) = add_pair_across(&mut sender, &mut receiver, &pd);
    const MESSAGES: u64 = 3;
    for _ in 0..MESSAGES {
        send(&mut sender, from.conn, b"late");
    }
    // The sender's pass posts them; the device lands them at once, so
    // their receive completions wait on the receiver's CQ, unpolled.
    sender.turn().expect("the pass that posts them");
    let before = receiver.counters();
    assert_eq!(to.seen.borrow().messages.len(), 0, "none polled yet");
    // Each receive still posted brings one completion: a message that
    // landed, or a flush when the removal moves the QP to the error state.
    let ring = receiver
        .conns
        .get(to.conn.key())
        .expect("the connection")
        .rq();
    let posted = (0..RECV_DEPTH).filter(|&slot| ring.is_posted(slot)).count() as u64;
    assert!(posted >= MESSAGES, "{posted} posted");
    drop(receiver.remove(to.session).expect("the receiving session"));
    for _ in 0..4 {
        receiver.turn().expect("a pass");
    }
    let after = receiver.counters();
    assert_eq!(
        after.stale_completions - before.stale_completions,
        posted,
        "each receive it had posted counted stale"
    );
    assert_eq!(
        after.foreign_completions, before.foreign_completions,
        "none taken for a stranger's"
    );
    assert!(to.seen.borrow().messages.is_empty(), "none delivered");
}
