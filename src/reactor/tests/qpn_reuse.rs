//! A newcomer on an SRQ reactor whose QP the kernel gives a destroyed QP's
//! number (as it may, at once): the receives that QP left queued in the
//! CQ, another peer's messages, never reach the newcomer.

use super::srq::{errors_of, run_until_srq_whole};
use super::*;

/// A newcomer whose QP takes number `qpn` (as the kernel may give a
/// destroyed QP's number to the next QP at once), and its partner, both
/// added and established, after a few more passes.
fn newcomer_numbered(
    reactor: &mut Reactor<Probe, ()>,
    pd: &ProtectionDomain,
    qpn: u32,
) -> (End, End) {
    reuse_qpn_next(qpn);
    let [newcomer_qp, partner_qp] = connected_qps(reactor, pd, AccessFlags::empty());
    assert_eq!(newcomer_qp.qpn(), qpn, "the newcomer's QP took the number");
    let newcomer = add_end(reactor, newcomer_qp);
    let partner = add_end(reactor, partner_qp);
    run_until(reactor, "the newcomers established", |_| {
        newcomer.seen.borrow().established && partner.seen.borrow().established
    });
    for _ in 0..16 {
        reactor.turn().expect("a pass");
    }
    (newcomer, partner)
}

/// A removed connection's last receive is still queued in the CQ when the
/// kernel gives its QP number to a newcomer's QP (as it may, at once): the
/// newcomer must not take that message, another peer's, for its own.
#[test]
fn a_newcomer_reusing_a_removed_qps_number_never_gets_its_queued_receive() {
    // SAFETY: every QP of the device is served from this thread.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().expect("a PD");
    let mut reactor = srq_reactor(&pd);
    let access = AccessFlags::empty();
    let [leaving_qp, sender_qp] = connected_qps(&mut reactor, &pd, access);
    let leaving_qpn = leaving_qp.qpn();
    let leaving = add_end(&mut reactor, leaving_qp);
    let sender = add_end(&mut reactor, sender_qp);
    run_until(&mut reactor, "both ends established", |_| {
        leaving.seen.borrow().established && sender.seen.borrow().established
    });

    // The message goes out with the pass's flush, after its poll: its
    // receive's completion waits in the CQ for the next pass.
    send(&mut reactor, sender.conn, b"for the leaving end only");
    reactor.turn().expect("the pass that posts it");
    assert!(leaving.seen.borrow().messages.is_empty(), "not polled yet");
    let reclaimed_before = ignored(&reactor).1;
    drop(
        reactor
            .remove(leaving.session)
            .expect("the leaving session"),
    );

    let (newcomer, partner) = newcomer_numbered(&mut reactor, &pd, leaving_qpn);
    assert!(
        newcomer.seen.borrow().messages.is_empty(),
        "the newcomer got the removed connection's message: {:?}",
        newcomer.seen.borrow().messages
    );
    assert!(
        ignored(&reactor).1 > reclaimed_before,
        "the removed connection's receive went back to the SRQ"
    );
    send(&mut reactor, partner.conn, b"for the newcomer");
    run_until(&mut reactor, "the newcomer's own message", |_| {
        !newcomer.seen.borrow().messages.is_empty()
    });
    assert_eq!(
        newcomer.seen.borrow().messages,
        [b"for the newcomer".to_vec()]
    );
    run_until_srq_whole(&mut reactor, "every SRQ slot posted again");
}

/// A QP built on the reactor's CQs and SRQ but never added (its session
/// refused, say) leaves a receive's completion behind when it is
/// destroyed: a newcomer given its number must not take it for its own.
#[test]
fn a_newcomer_reusing_a_never_added_qps_number_never_gets_its_queued_receive() {
    // SAFETY: every QP of the device is served from this thread.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().expect("a PD");
    let mut reactor = srq_reactor(&pd);
    let mut never_added = loopback_qp(&mut reactor, &pd, "never added", AccessFlags::empty());
    let stranger_cq = ctx.create_cq(16, None).expect("the stranger's CQ");
    let mut stranger = pd
        .create_qp(&stranger_cq, &stranger_cq, &QpConfig::default())
        .expect("the stranger's QP");
    let (to_never, to_stranger) = (never_added.endpoint(), stranger.endpoint());
    never_added.connect(&to_stranger).expect("connect");
    stranger.connect(&to_never).expect("connect");
    let buf = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).expect("a buffer");
    // A message (kind 0, claiming 16 receives): it takes an SRQ receive.
    let mut request =
        WorkRequest::send_with_imm(0, buf.slice(0, 24).expect("a slice"), 16).signaled();
    stranger.post_send(&mut request).expect("a SEND posted");
    let never_added_qpn = never_added.qpn();
    drop(never_added);
    let reclaimed_before = ignored(&reactor).1;

    let (newcomer, partner) = newcomer_numbered(&mut reactor, &pd, never_added_qpn);
    assert!(
        newcomer.seen.borrow().messages.is_empty(),
        "the newcomer got the stranger's message: {:?}",
        newcomer.seen.borrow().messages
    );
    let errors = errors_of(&[("newcomer", &newcomer), ("partner", &partner)]);
    assert!(errors.is_empty(), "{errors:?}");
    assert!(
        ignored(&reactor).1 > reclaimed_before,
        "the stranger's receive went back to the SRQ"
    );
    run_until_srq_whole(&mut reactor, "every SRQ slot posted again");
}
