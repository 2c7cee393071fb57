//! A removed connection's share of the CQs goes to a newcomer only once a
//! pass has polled what its QP left there.

use super::*;

#[test]
fn a_removed_connections_cq_room_comes_free_after_the_next_pass() {
    // SAFETY: the loopback device has no preconditions.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().expect("a PD");
    let config = ReactorConfig {
        slot_size: 64,
        recv_depth: RECV_DEPTH,
        send_slots: 16,
        sq_depth: 64,
        cq_count: 1,
        cq_size: 256,
        ..ReactorConfig::default()
    };
    let mut reactor: Reactor<Probe, ()> = Reactor::new(&pd, config).expect("a reactor");
    reactor.poll_once().expect("a pass");
    let mut sessions = Vec::new();
    'fill: loop {
        for qp in connected_qps(&mut reactor, &pd, AccessFlags::empty()) {
            match reactor.add(vec![qp], Probe::default()) {
                Ok(session) => sessions.push(session),
                Err(_) => break 'fill,
            }
        }
        assert!(sessions.len() < 64, "the CQ never filled");
    }
    assert!(sessions.len() >= 2, "{} connections fit", sessions.len());
    let gone = sessions.pop().expect("a session");
    assert!(reactor.remove(gone).is_some());
    let [newcomer, _] = connected_qps(&mut reactor, &pd, AccessFlags::empty());
    assert!(
        matches!(
            reactor.add(vec![newcomer], Probe::default()),
            Err(Error::InvalidArgument(_))
        ),
        "the room is held until a pass polled the CQ"
    );
    reactor.poll_once().expect("a pass");
    let [newcomer, _] = connected_qps(&mut reactor, &pd, AccessFlags::empty());
    reactor
        .add(vec![newcomer], Probe::default())
        .expect("room once a pass polled the CQ");
}
