//! What the device refuses or fails, and how: keys, rights and ranges, a
//! SEND too long, the error state and its flushes, receives over memory a
//! stalled send uses, a full CQ, full queues, and requests from a QP that
//! is not the peer.

use super::*;

#[test]
fn a_bad_rkey_fails_the_request_and_the_qp() {
    let (pd, mut cq, mut a, mut b) = pair(16, AccessFlags::REMOTE_WRITE);
    let local = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    let exported = pd
        .alloc_mr(64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
        .unwrap();
    let good = exported.remote().unwrap();
    let forged = crate::verbs::RemoteRegion::new(good.addr(), good.len(), good.rkey() ^ 0x5a5a);
    b.post_recv(&mut RecvRequest::new(40, local.slice(0, 8).unwrap()).unwrap())
        .unwrap();
    a.post_recv(&mut RecvRequest::new(41, local.slice(8, 8).unwrap()).unwrap())
        .unwrap();
    // Unsignaled, and followed by another request in the same list: the
    // failure is reported anyway, the rest is flushed.
    a.post_send(
        &mut WorkRequest::write(1, local.slice(0, 8).unwrap(), forged.slice(0, 8).unwrap())
            .unwrap(),
    )
    .unwrap();
    a.post_send(&mut WorkRequest::send_inline(2, b"late").signaled())
        .unwrap();
    let wcs = drain(&mut cq);
    let summary: Vec<(u64, WcStatus)> = wcs.iter().map(|wc| (wc.wr_id(), wc.status())).collect();
    assert_eq!(
        summary,
        [
            (1, WcStatus::REM_ACCESS_ERR),
            (41, WcStatus::WR_FLUSH_ERR),
            (2, WcStatus::WR_FLUSH_ERR),
        ]
    );
    assert!(matches!(wcs[0].ok(), Err(Error::Completion { .. })));
    assert_eq!(a.state().unwrap(), QpState::Error);
    // The responder keeps its receive and its state.
    assert_eq!(b.state().unwrap(), QpState::ReadyToSend);
    // A READ of a region exported for WRITE only is refused too.
    let (pd, mut cq, mut c, _d) = pair(16, AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ);
    let local = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    let write_only = pd
        .alloc_mr(64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
        .unwrap()
        .remote()
        .unwrap();
    c.post_send(
        &mut WorkRequest::read(
            5,
            local.slice(0, 8).unwrap(),
            write_only.slice(0, 8).unwrap(),
        )
        .unwrap(),
    )
    .unwrap();
    assert_eq!(drain(&mut cq)[0].status(), WcStatus::REM_ACCESS_ERR);
}

#[test]
fn a_qp_without_remote_access_refuses_writes() {
    let (pd, mut cq, mut a, _b) = pair(16, AccessFlags::empty());
    let local = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    let exported = pd
        .alloc_mr(64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
        .unwrap()
        .remote()
        .unwrap();
    a.post_send(
        &mut WorkRequest::write(1, local.slice(0, 8).unwrap(), exported.slice(0, 8).unwrap())
            .unwrap(),
    )
    .unwrap();
    assert_eq!(drain(&mut cq)[0].status(), WcStatus::REM_ACCESS_ERR);
}

#[test]
fn a_deregistered_region_is_out_of_reach() {
    let (pd, mut cq, mut a, _b) = pair(16, AccessFlags::REMOTE_WRITE);
    let local = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    let exported = pd
        .alloc_mr(64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
        .unwrap();
    let remote = exported.remote().unwrap();
    drop(exported);
    a.post_send(
        &mut WorkRequest::write(1, local.slice(0, 8).unwrap(), remote.slice(0, 8).unwrap())
            .unwrap(),
    )
    .unwrap();
    assert_eq!(drain(&mut cq)[0].status(), WcStatus::REM_ACCESS_ERR);
}

#[test]
fn a_send_longer_than_the_receive_fails_both_sides() {
    let (pd, mut cq, mut a, mut b) = pair(16, AccessFlags::empty());
    let mr = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    b.post_recv(&mut RecvRequest::new(50, mr.slice(0, 2).unwrap()).unwrap())
        .unwrap();
    b.post_recv(&mut RecvRequest::new(51, mr.slice(2, 2).unwrap()).unwrap())
        .unwrap();
    a.post_send(&mut WorkRequest::send_inline(1, b"too long"))
        .unwrap();
    let summary = statuses(&mut cq);
    assert_eq!(
        summary,
        [
            (50, WcStatus::LOC_LEN_ERR),
            (51, WcStatus::WR_FLUSH_ERR),
            (1, WcStatus::REM_INV_REQ_ERR),
        ]
    );
    assert_eq!(a.state().unwrap(), QpState::Error);
    assert_eq!(b.state().unwrap(), QpState::Error);
}

#[test]
fn the_error_state_flushes_receives_and_stalled_sends_in_order() {
    let (pd, mut cq, mut a, mut b) = pair(16, AccessFlags::empty());
    let mr = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    post_recvs(&mut a, &mr, 60..63);
    // Two sends stall at b (no receive there).
    a.post_send(&mut WorkRequest::send_inline(1, b"a")).unwrap();
    a.post_send(&mut WorkRequest::send_inline(2, b"b")).unwrap();
    assert!(drain(&mut cq).is_empty());
    a.set_error().unwrap();
    let ids: Vec<u64> = drain(&mut cq)
        .iter()
        .inspect(|wc| assert_eq!(wc.status(), WcStatus::WR_FLUSH_ERR))
        .map(WorkCompletion::wr_id)
        .collect();
    assert_eq!(ids, [60, 61, 62, 1, 2]);
    // Posting on a QP in error flushes at once.
    a.post_recv(&mut RecvRequest::new(63, mr.slice(0, 8).unwrap()).unwrap())
        .unwrap();
    a.post_send(&mut WorkRequest::send_inline(3, b"c")).unwrap();
    let ids: Vec<u64> = drain(&mut cq).iter().map(WorkCompletion::wr_id).collect();
    assert_eq!(ids, [63, 3]);
    // b never got anything; its sends to a peer in error fail.
    b.post_send(&mut WorkRequest::send_inline(4, b"d")).unwrap();
    let wcs = drain(&mut cq);
    assert_eq!(
        (wcs[0].wr_id(), wcs[0].status()),
        (4, WcStatus::RETRY_EXC_ERR)
    );
}

#[test]
fn a_receive_over_memory_a_stalled_send_still_reads_is_refused_until_its_flush_is_polled() {
    let (pd, mut cq, mut a, _b) = pair(16, AccessFlags::empty());
    let mr = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    // Stalls at b (no receive there), reading bytes 8..24 of `mr`.
    a.post_send(&mut WorkRequest::send(1, mr.slice(8, 16).unwrap()))
        .unwrap();
    let refused = a.post_recv(&mut RecvRequest::new(60, mr.slice(16, 8).unwrap()).unwrap());
    assert!(
        matches!(&refused, Err(Error::Post { errno, posted: 0, .. }) if *errno == libc::EBUSY),
        "{refused:?}"
    );
    // A list with one such receive is refused whole: nothing of it posted.
    let mut batch: RecvBatch<'_, 2> = RecvBatch::new();
    batch
        .push(RecvRequest::new(58, mr.slice(0, 8).unwrap()).unwrap())
        .unwrap();
    batch
        .push(RecvRequest::new(59, mr.slice(20, 8).unwrap()).unwrap())
        .unwrap();
    let refused = a.post_recv(&mut batch);
    assert!(
        matches!(&refused, Err(Error::Post { errno, posted: 0, .. }) if *errno == libc::EBUSY),
        "{refused:?}"
    );
    assert_eq!(batch.len(), 2);
    // Next to it is fine.
    a.post_recv(&mut RecvRequest::new(61, mr.slice(24, 8).unwrap()).unwrap())
        .unwrap();
    // The error state flushes the send only when the CQ is next polled: the
    // device may read its memory until then.
    a.set_error().unwrap();
    assert!(
        a.post_recv(&mut RecvRequest::new(62, mr.slice(8, 8).unwrap()).unwrap())
            .is_err()
    );
    let summary = statuses(&mut cq);
    assert_eq!(
        summary,
        [(61, WcStatus::WR_FLUSH_ERR), (1, WcStatus::WR_FLUSH_ERR)]
    );
    a.post_recv(&mut RecvRequest::new(63, mr.slice(8, 8).unwrap()).unwrap())
        .unwrap();
    assert_eq!(drain(&mut cq)[0].wr_id(), 63);
}

#[test]
fn a_peer_going_to_error_fails_sends_stalled_on_it() {
    let (_pd, mut cq, mut a, b) = pair(16, AccessFlags::empty());
    a.post_send(&mut WorkRequest::send_inline(1, b"a").signaled())
        .unwrap();
    a.post_send(&mut WorkRequest::send_inline(2, b"b").signaled())
        .unwrap();
    drop(b);
    let summary = statuses(&mut cq);
    assert_eq!(
        summary,
        [(1, WcStatus::RETRY_EXC_ERR), (2, WcStatus::WR_FLUSH_ERR)]
    );
    assert_eq!(a.state().unwrap(), QpState::Error);
}

#[test]
fn a_full_cq_fails_the_qp_and_then_reports_the_overflow() {
    let (pd, mut cq, mut a, mut b) = pair(2, AccessFlags::empty());
    let mr = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    post_recvs(&mut b, &mr, 70..72);
    // Receive + send completion fill the CQ; the next receive completion
    // does not fit.
    a.post_send(&mut WorkRequest::send_inline(1, b"a").signaled())
        .unwrap();
    a.post_send(&mut WorkRequest::send_inline(2, b"b").signaled())
        .unwrap();
    assert_eq!(b.state().unwrap(), QpState::Error);
    let mut wcs = [WorkCompletion::default(); 8];
    let ids: Vec<u64> = cq
        .poll(&mut wcs)
        .unwrap()
        .iter()
        .map(|wc| wc.wr_id())
        .collect();
    assert_eq!(ids, [70, 1]);
    let err = cq.poll(&mut wcs).unwrap_err();
    assert!(
        matches!(err, Error::CqPoll { code, .. } if code == -libc::EOVERFLOW),
        "{err}"
    );
}

#[test]
fn queues_refuse_more_than_their_depth() {
    let ctx = single_threaded_context();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(64, None).unwrap();
    let config = QpConfig {
        max_recv_wr: 2,
        ..QpConfig::default()
    };
    let mut qp = pd.create_qp(&cq, &cq, &config).unwrap();
    let mr = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    post_recvs(&mut qp, &mr, 0..2);
    let err = qp
        .post_recv(&mut RecvRequest::new(2, mr.slice(0, 8).unwrap()).unwrap())
        .unwrap_err();
    assert!(
        matches!(err, Error::Post { errno, posted: 0, .. } if errno == libc::ENOMEM),
        "{err}"
    );
    // Not connected: sends are refused.
    let err = qp
        .post_send(&mut WorkRequest::send_inline(9, b"x"))
        .unwrap_err();
    assert!(
        matches!(err, Error::Post { errno, .. } if errno == libc::EINVAL),
        "{err}"
    );
}

#[test]
fn a_qp_takes_requests_only_from_the_qp_it_is_connected_to() {
    // A -> B, but B <-> C: B drops A's requests as a NIC would (A's retries
    // run out), so A reaches neither B's receives nor B's memory, and the
    // wakeup B's receives give goes to C, the one that may be waiting.
    let access = AccessFlags::REMOTE_WRITE;
    let (pd, mut cq, mut b, mut c) = pair(64, access);
    let ctx = pd.context();
    let mut a = pd
        .create_qp(
            &cq,
            &cq,
            &QpConfig {
                remote_access: access,
                ..QpConfig::default()
            },
        )
        .unwrap();
    a.connect(&b.endpoint()).unwrap();
    let mut ring = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE | access).unwrap();
    ring.write(0, &[0; 64]).unwrap();
    b.post_recv(&mut RecvRequest::new(100, ring.slice(0, 8).unwrap()).unwrap())
        .unwrap();
    a.post_send(&mut WorkRequest::send_inline(1, b"intruder").signaled())
        .unwrap();
    let wcs = drain(&mut cq);
    assert_eq!(wcs.len(), 1, "{wcs:?}");
    assert_eq!(
        (wcs[0].wr_id(), wcs[0].status()),
        (1, WcStatus::RETRY_EXC_ERR)
    );
    assert_eq!(bytes(&ring, 0, 8), [0; 8], "B's receive untouched");
    // A QP of another context that connects to B on its own cannot WRITE
    // B's exported memory either, with the right key.
    let other = single_threaded_context();
    let (opd, mut ocq) = (other.alloc_pd().unwrap(), other.create_cq(8, None).unwrap());
    let mut x = opd.create_qp(&ocq, &ocq, &QpConfig::default()).unwrap();
    x.connect(&b.endpoint()).unwrap();
    let mut payload = opd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap();
    payload.write(0, b"OWNED!!!").unwrap();
    let target = ring.remote().unwrap();
    let write = WorkRequest::write(2, payload.slice(0, 8).unwrap(), target.slice(8, 8).unwrap());
    x.post_send(&mut write.unwrap().signaled()).unwrap();
    let wcs = drain(&mut ocq);
    assert_eq!(wcs[0].status(), WcStatus::RETRY_EXC_ERR, "{wcs:?}");
    assert_eq!(bytes(&ring, 8, 8), [0; 8], "B's memory untouched");
    // B and C still work: C's SEND lands in B's receive.
    c.post_send(&mut WorkRequest::send_inline(3, b"friend").signaled())
        .unwrap();
    let wcs = drain(&mut cq);
    assert!(wcs.iter().all(WorkCompletion::is_success), "{wcs:?}");
    assert_eq!(bytes(&ring, 0, 6), b"friend");
    drop((a, ctx));
}

#[test]
fn forged_remote_ranges_are_refused() {
    // RemoteRegion::new is safe and public: only the device's range check
    // stands between a forged range with a valid key and memory outside
    // the region. Each case is tried as a WRITE and as a READ, each on a
    // fresh pair (a refused request puts its QP in error).
    let access = AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
    let ctx = single_threaded_context();
    let pd = ctx.alloc_pd().unwrap();
    let mut cq = ctx.create_cq(64, None).unwrap();
    let local = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    let exported = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE | access).unwrap();
    let good = exported.remote().unwrap();
    let cases = [
        (good.addr() + 60, "runs past the end"),
        (good.addr() - 1, "starts before the region"),
        (u64::MAX - 3, "addr + len overflows"),
    ];
    for (addr, what) in cases {
        let forged = crate::verbs::RemoteRegion::new(addr, 8, good.rkey());
        for read in [false, true] {
            let (mut a, _b) = connected(&pd, &cq, access);
            let request = match read {
                false => {
                    WorkRequest::write(1, local.slice(0, 8).unwrap(), forged.slice(0, 8).unwrap())
                }
                true => {
                    WorkRequest::read(1, local.slice(8, 8).unwrap(), forged.slice(0, 8).unwrap())
                }
            };
            a.post_send(&mut request.unwrap().signaled()).unwrap();
            let wcs = drain(&mut cq);
            assert_eq!(
                wcs[0].status(),
                WcStatus::REM_ACCESS_ERR,
                "{what} (read: {read})"
            );
        }
    }
    // The same key and an in-range address work: the refusals were the
    // range's, not the key's.
    let (mut a, _b) = connected(&pd, &cq, access);
    let request = WorkRequest::write(1, local.slice(0, 8).unwrap(), good.slice(56, 8).unwrap());
    a.post_send(&mut request.unwrap().signaled()).unwrap();
    assert!(drain(&mut cq)[0].is_success());
}
