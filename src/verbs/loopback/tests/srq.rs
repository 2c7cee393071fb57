//! Shared receive queues: QPs on one SRQ take its receives in order and
//! report them under their own QP number, a full SRQ refuses more (all of
//! a list or, with the test-only knob, its tail), a SEND that finds the
//! SRQ empty waits for its next post, and a QP's error flushes none of
//! the SRQ's receives.

use super::*;
use crate::verbs::{SharedReceiveQueue, refuse_srq_recvs_after};

/// Two connected pairs on `cq` whose receiving ends (`b`, `d`) take their
/// receives from `srq`.
fn two_pairs_on(
    pd: &ProtectionDomain,
    cq: &CompletionQueue,
    srq: &SharedReceiveQueue,
) -> [QueuePair; 4] {
    let config = QpConfig::default();
    let qp = |shared: bool| match shared {
        true => pd
            .create_qp_with_srq(cq, cq, &srq.attachment(), &config)
            .unwrap(),
        false => pd.create_qp(cq, cq, &config).unwrap(),
    };
    let (mut a, mut b, mut c, mut d) = (qp(false), qp(true), qp(false), qp(true));
    link(&mut a, &mut b);
    link(&mut c, &mut d);
    [a, b, c, d]
}

/// A CQ, an SRQ of `depth` receives, a region of `len` bytes for them, and
/// two connected pairs on the CQ whose receiving ends (`b`, `d`) take their
/// receives from the SRQ (the objects hold their context and PD).
struct OnSrq {
    cq: CompletionQueue,
    srq: SharedReceiveQueue,
    mr: MemoryRegion,
    qps: [QueuePair; 4],
}

fn on_srq(depth: u32, len: usize) -> OnSrq {
    let ctx = single_threaded_context();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(32, None).unwrap();
    let srq = pd.create_srq(depth).unwrap();
    let mr = pd.alloc_mr(len, AccessFlags::LOCAL_WRITE).unwrap();
    let qps = two_pairs_on(&pd, &cq, &srq);
    OnSrq { cq, srq, mr, qps }
}

/// Posts on `srq` a receive of 8 bytes at `8 * id` in `mr` for each of `ids`.
fn post_srq(srq: &mut SharedReceiveQueue, mr: &MemoryRegion, ids: std::ops::Range<u64>) {
    let mut batch: RecvBatch<'_, 16> = RecvBatch::new();
    for id in ids {
        let slice = mr.slice(8 * id as usize, 8).unwrap();
        batch.push(RecvRequest::new(id, slice).unwrap()).unwrap();
    }
    srq.post_recv(&mut batch).unwrap();
}

/// The receive completions among `wcs`, as (wr_id, QP number, status).
fn receives(wcs: &[WorkCompletion]) -> Vec<(u64, u32, WcStatus)> {
    wcs.iter()
        .filter(|wc| wc.opcode() == WcOpcode::RECV || !wc.is_success())
        .map(|wc| (wc.wr_id(), wc.qp_num(), wc.status()))
        .collect()
}

#[test]
fn qps_on_one_srq_take_its_receives_in_order_under_their_own_number() {
    let OnSrq {
        mut cq,
        mut srq,
        mr,
        qps: [mut a, b, mut c, d],
    } = on_srq(8, 64);
    post_srq(&mut srq, &mr, 0..3);

    a.post_send(&mut WorkRequest::send_inline(100, b"from a"))
        .unwrap();
    c.post_send(&mut WorkRequest::send_inline(101, b"from c"))
        .unwrap();
    a.post_send(&mut WorkRequest::send_inline(102, b"a again"))
        .unwrap();
    let ok = WcStatus::SUCCESS;
    assert_eq!(
        receives(&drain(&mut cq)),
        [(0, b.qpn(), ok), (1, d.qpn(), ok), (2, b.qpn(), ok)],
        "the SRQ's oldest receive first, named by the QP that took it"
    );
    assert_eq!(bytes(&mr, 0, 6), b"from a");
    assert_eq!(bytes(&mr, 8, 6), b"from c");
    assert_eq!(bytes(&mr, 16, 7), b"a again");
}

#[test]
fn a_full_srq_refuses_more_and_a_qp_on_it_takes_no_receives_of_its_own() {
    let ctx = single_threaded_context();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(32, None).unwrap();
    let mut srq = pd.create_srq(4).unwrap();
    assert_eq!(srq.max_wr(), 4);
    let mr = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    post_srq(&mut srq, &mr, 0..3);
    let mut batch: RecvBatch<'_, 4> = RecvBatch::new();
    for id in 3..5 {
        let slice = mr.slice(8 * id as usize, 8).unwrap();
        batch.push(RecvRequest::new(id, slice).unwrap()).unwrap();
    }
    let outcome = srq.post_recv(&mut batch);
    assert_eq!(batch.len(), 2, "a post leaves the batch as it was");
    batch.drop_posted(&outcome);
    let err = outcome.unwrap_err();
    assert!(
        matches!(err, Error::Post { errno, posted: 1, .. } if errno == libc::ENOMEM),
        "the fourth fits, the fifth does not: {err}"
    );
    assert_eq!(batch.len(), 1, "what was refused stays in the batch");

    let config = QpConfig::default();
    let mut qp = pd
        .create_qp_with_srq(&cq, &cq, &srq.attachment(), &config)
        .unwrap();
    let err = qp
        .post_recv(&mut RecvRequest::new(9, mr.slice(0, 8).unwrap()).unwrap())
        .unwrap_err();
    assert!(
        matches!(err, Error::Post { errno, posted: 0, .. } if errno == libc::EINVAL),
        "{err}"
    );
}

#[test]
fn the_refusal_knob_takes_the_head_of_one_srq_post_per_call() {
    let OnSrq {
        mut cq,
        mut srq,
        mr,
        qps: [mut a, _b, _c, _d],
    } = on_srq(16, 128);
    let mut batch: RecvBatch<'_, 8> = RecvBatch::new();
    for id in 0..5 {
        let slice = mr.slice(8 * id as usize, 8).unwrap();
        batch.push(RecvRequest::new(id, slice).unwrap()).unwrap();
    }
    // Two limits in a row: one for each of the next two posts.
    refuse_srq_recvs_after(&srq, 2);
    refuse_srq_recvs_after(&srq, 0);
    let mut post = |batch: &mut RecvBatch<'_, 8>| {
        let outcome = srq.post_recv(batch);
        batch.drop_posted(&outcome);
        outcome
    };
    let err = post(&mut batch).unwrap_err();
    assert!(
        matches!(err, Error::Post { errno, posted: 2, .. } if errno == libc::ENOMEM),
        "{err}"
    );
    assert_eq!(batch.len(), 3);
    let err = post(&mut batch).unwrap_err();
    assert!(
        matches!(err, Error::Post { errno, posted: 0, .. } if errno == libc::ENOMEM),
        "{err}"
    );
    assert_eq!(batch.len(), 3);
    // Each for one post: the next takes the rest.
    post(&mut batch).unwrap();
    assert!(batch.is_empty());
    for id in 0..5 {
        a.post_send(&mut WorkRequest::send_inline(100 + id, b"x"))
            .unwrap();
    }
    let ids: Vec<u64> = receives(&drain(&mut cq)).iter().map(|r| r.0).collect();
    assert_eq!(ids, [0, 1, 2, 3, 4], "each receive posted once");
}

#[test]
fn a_send_that_finds_the_srq_empty_waits_for_its_next_post() {
    let OnSrq {
        mut cq,
        mut srq,
        mr,
        qps: [mut a, b, mut c, d],
    } = on_srq(8, 64);
    a.post_send(&mut WorkRequest::send_inline(100, b"a").signaled())
        .unwrap();
    c.post_send(&mut WorkRequest::send_inline(101, b"c").signaled())
        .unwrap();
    assert!(drain(&mut cq).is_empty(), "both wait for a receive");

    post_srq(&mut srq, &mr, 0..1);
    let wcs = drain(&mut cq);
    assert_eq!(wcs.len(), 2, "one receive runs one SEND: {wcs:?}");
    let first = receives(&wcs)[0];
    post_srq(&mut srq, &mr, 1..2);
    let wcs = drain(&mut cq);
    assert_eq!(wcs.len(), 2, "the next runs the other: {wcs:?}");
    let second = receives(&wcs)[0];
    let mut qps = [first.1, second.1];
    qps.sort_unstable();
    let mut expected = [b.qpn(), d.qpn()];
    expected.sort_unstable();
    assert_eq!(qps, expected, "each QP took one");
}

#[test]
fn a_qp_on_an_srq_going_to_error_flushes_none_of_its_receives() {
    let OnSrq {
        mut cq,
        mut srq,
        mr,
        qps: [mut a, b, mut c, d],
    } = on_srq(8, 64);
    post_srq(&mut srq, &mr, 0..3);
    b.set_error().unwrap();
    assert!(
        receives(&drain(&mut cq)).is_empty(),
        "nothing of the SRQ flushed"
    );
    assert_eq!(b.state().unwrap(), QpState::Error);
    let err = a.post_send(&mut WorkRequest::send_inline(100, b"a").signaled());
    assert!(err.is_ok(), "{err:?}");
    let wcs = drain(&mut cq);
    assert!(
        wcs.iter()
            .all(|wc| !wc.is_success() && wc.qp_num() == a.qpn()),
        "a SEND to the failed QP takes no receive: {wcs:?}"
    );
    for id in 0..3 {
        c.post_send(&mut WorkRequest::send_inline(200 + id, b"c"))
            .unwrap();
    }
    let ok = WcStatus::SUCCESS;
    assert_eq!(
        receives(&drain(&mut cq)),
        [(0, d.qpn(), ok), (1, d.qpn(), ok), (2, d.qpn(), ok)],
        "the other QP takes all three"
    );
    // Destroying a QP on it flushes none either.
    post_srq(&mut srq, &mr, 3..4);
    drop(b);
    assert!(receives(&drain(&mut cq)).is_empty());
    c.post_send(&mut WorkRequest::send_inline(300, b"c"))
        .unwrap();
    assert_eq!(receives(&drain(&mut cq)), [(3, d.qpn(), ok)]);
}

/// The registration an SRQ keeps stays registered after its region is
/// dropped, as long as a QP attached to the SRQ (so the SRQ) lives: the
/// receives posted there never outlive their memory.
#[test]
fn an_srq_keeps_its_registration_until_destroyed() {
    let ctx = single_threaded_context();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(16, None).unwrap();
    let srq = pd.create_srq(4).unwrap();
    let region = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    let key = region.lkey();
    assert!(srq.keep_registered(region.registration().clone()));
    assert!(!srq.keep_registered(region.registration().clone()), "once");
    let qp = pd
        .create_qp_with_srq(&cq, &cq, &srq.attachment(), &QpConfig::default())
        .unwrap();
    drop((region, srq));
    assert!(
        super::super::is_mr_registered(key),
        "kept while the QP holds the SRQ"
    );
    drop(qp);
    assert!(
        !super::super::is_mr_registered(key),
        "released with the SRQ"
    );
}
