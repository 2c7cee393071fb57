//! Unit tests of the loopback device through the verbs wrappers (which call
//! its functions exactly as they call a provider's): post and poll, RNR
//! queueing, access checks, flushes, CQ overflow and teardown in any order.

use crate::Error;
use crate::verbs::{
    AccessFlags, CompletionQueue, Context, MemoryRegion, ProtectionDomain, QpConfig, QpState,
    QueuePair, RecvBatch, RecvRequest, WcOpcode, WcStatus, WorkCompletion, WorkRequest,
};

/// Two connected QPs on one CQ, granting `access` to each other.
fn pair(
    cq_size: u32,
    access: AccessFlags,
) -> (ProtectionDomain, CompletionQueue, QueuePair, QueuePair) {
    let ctx = single_threaded_context();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(cq_size, None).unwrap();
    let config = QpConfig {
        remote_access: access,
        ..QpConfig::default()
    };
    let mut a = pd.create_qp(&cq, &cq, &config).unwrap();
    let mut b = pd.create_qp(&cq, &cq, &config).unwrap();
    let (ea, eb) = (a.endpoint(), b.endpoint());
    a.connect(&eb).unwrap();
    b.connect(&ea).unwrap();
    (pd, cq, a, b)
}

fn drain(cq: &mut CompletionQueue) -> Vec<WorkCompletion> {
    let mut all = Vec::new();
    let mut wcs = [WorkCompletion::default(); 8];
    loop {
        let got = cq.poll(&mut wcs).unwrap();
        if got.is_empty() {
            return all;
        }
        all.extend_from_slice(got);
    }
}

/// Every completion queued, as (wr_id, status).
fn statuses(cq: &mut CompletionQueue) -> Vec<(u64, WcStatus)> {
    drain(cq)
        .iter()
        .map(|wc| (wc.wr_id(), wc.status()))
        .collect()
}

fn bytes(mr: &MemoryRegion, offset: usize, len: usize) -> Vec<u8> {
    let mut out = vec![0; len];
    mr.read(offset, &mut out).unwrap();
    out
}

#[test]
fn the_device_reports_one_active_port_with_a_loopback_gid() {
    let ctx = single_threaded_context();
    assert!(ctx.is_loopback());
    assert_eq!(ctx.name(), "loopback");
    assert_eq!(ctx.first_active_port().unwrap(), 1);
    let gid = ctx.select_gid(1, None).unwrap();
    assert_eq!(gid.index, 0);
    assert_eq!(gid.gid.to_string(), "::ffff:127.0.0.1");
    assert!(ctx.query_port(2).is_err());
    assert!(!ctx.same_context(&single_threaded_context()));
}

#[test]
fn a_send_lands_in_the_oldest_receive_with_its_immediate() {
    let (pd, mut cq, mut a, mut b) = pair(16, AccessFlags::empty());
    let mut mr = pd.alloc_mr(256, AccessFlags::LOCAL_WRITE).unwrap();
    mr.write(0, b"ping").unwrap();
    b.post_recv(RecvRequest::new(10, mr.slice(64, 32).unwrap()).unwrap())
        .unwrap();
    b.post_recv(RecvRequest::new(11, mr.slice(96, 32).unwrap()).unwrap())
        .unwrap();
    a.post_send(WorkRequest::send_with_imm(1, mr.slice(0, 4).unwrap(), 0xfeed).signaled())
        .unwrap();
    a.post_send(WorkRequest::send_inline(2, b"inline").signaled())
        .unwrap();
    let wcs = drain(&mut cq);
    assert_eq!(wcs.len(), 4, "{wcs:?}");
    let recv = wcs.iter().find(|wc| wc.wr_id() == 10).unwrap();
    assert!(recv.is_success());
    assert_eq!(recv.opcode(), WcOpcode::RECV);
    assert_eq!(
        (recv.byte_len(), recv.imm(), recv.qp_num()),
        (4, Some(0xfeed), b.qpn())
    );
    let second = wcs.iter().find(|wc| wc.wr_id() == 11).unwrap();
    assert_eq!((second.byte_len(), second.imm()), (6, None));
    let sent = wcs.iter().find(|wc| wc.wr_id() == 1).unwrap();
    assert_eq!((sent.opcode(), sent.qp_num()), (WcOpcode::SEND, a.qpn()));
    assert_eq!(bytes(&mr, 64, 4), b"ping");
    assert_eq!(bytes(&mr, 96, 6), b"inline");
}

#[test]
fn unsignaled_requests_complete_silently() {
    let (pd, mut cq, mut a, mut b) = pair(16, AccessFlags::empty());
    let mr = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    b.post_recv(RecvRequest::new(7, mr.slice(0, 8).unwrap()).unwrap())
        .unwrap();
    a.post_send(WorkRequest::send_inline(1, b"x")).unwrap();
    let wcs = drain(&mut cq);
    assert_eq!(wcs.len(), 1);
    assert_eq!(wcs[0].wr_id(), 7);
}

#[test]
fn a_send_without_a_receive_waits_for_one_and_keeps_its_place() {
    let access = AccessFlags::REMOTE_WRITE;
    let (pd, mut cq, mut a, mut b) = pair(16, access);
    let mut src = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    let dst = pd
        .alloc_mr(64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
        .unwrap();
    src.write(0, b"first").unwrap();
    {
        // Inline data is copied at post time: the buffer may go right away.
        let gone = *b"second";
        a.post_send(WorkRequest::send_inline(2, &gone).signaled())
            .unwrap();
    }
    a.post_send(WorkRequest::send(1, src.slice(0, 5).unwrap()).signaled())
        .unwrap();
    // A WRITE behind stalled SENDs waits too (the send queue is in order).
    let target = dst.remote().unwrap().slice(32, 5).unwrap();
    a.post_send(
        WorkRequest::write(3, src.slice(0, 5).unwrap(), target)
            .unwrap()
            .signaled(),
    )
    .unwrap();
    assert!(
        drain(&mut cq).is_empty(),
        "nothing completes without a receive"
    );
    assert_eq!(bytes(&dst, 32, 5), [0; 5]);

    b.post_recv(RecvRequest::new(20, dst.slice(0, 16).unwrap()).unwrap())
        .unwrap();
    let ids: Vec<u64> = drain(&mut cq).iter().map(WorkCompletion::wr_id).collect();
    assert_eq!(ids, [20, 2], "one receive runs one SEND");
    assert_eq!(bytes(&dst, 0, 6), b"second");

    b.post_recv(RecvRequest::new(21, dst.slice(16, 16).unwrap()).unwrap())
        .unwrap();
    let ids: Vec<u64> = drain(&mut cq).iter().map(WorkCompletion::wr_id).collect();
    assert_eq!(ids, [21, 1, 3]);
    assert_eq!(bytes(&dst, 16, 5), b"first");
    assert_eq!(bytes(&dst, 32, 5), b"first");
}

#[test]
fn write_read_and_write_with_imm_move_the_bytes() {
    let access = AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
    let (pd, mut cq, mut a, mut b) = pair(16, access);
    let mut local = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    let mut exported = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE | access).unwrap();
    let remote = exported.remote().unwrap();
    local.write(0, b"written!").unwrap();
    exported.write(48, b"readable").unwrap();

    a.post_send(
        WorkRequest::write(1, local.slice(0, 8).unwrap(), remote.slice(0, 8).unwrap())
            .unwrap()
            .signaled(),
    )
    .unwrap();
    a.post_send(
        WorkRequest::read(2, local.slice(16, 8).unwrap(), remote.slice(48, 8).unwrap())
            .unwrap()
            .signaled(),
    )
    .unwrap();
    b.post_recv(RecvRequest::new(30, local.slice(0, 0).unwrap()).unwrap())
        .unwrap();
    a.post_send(
        WorkRequest::write_with_imm(
            3,
            local.slice(0, 4).unwrap(),
            remote.slice(20, 4).unwrap(),
            9,
        )
        .unwrap()
        .signaled(),
    )
    .unwrap();
    let wcs = drain(&mut cq);
    assert!(wcs.iter().all(WorkCompletion::is_success), "{wcs:?}");
    let opcodes: Vec<(u64, WcOpcode)> = wcs.iter().map(|wc| (wc.wr_id(), wc.opcode())).collect();
    assert_eq!(
        opcodes,
        [
            (1, WcOpcode::RDMA_WRITE),
            (2, WcOpcode::RDMA_READ),
            (30, WcOpcode::RECV_RDMA_WITH_IMM),
            (3, WcOpcode::RDMA_WRITE),
        ]
    );
    assert_eq!(
        (wcs[1].byte_len(), wcs[2].byte_len(), wcs[2].imm()),
        (8, 4, Some(9))
    );
    assert_eq!(bytes(&exported, 0, 8), b"written!");
    assert_eq!(bytes(&exported, 20, 4), b"writ");
    assert_eq!(bytes(&local, 16, 8), b"readable");
}

#[test]
fn a_bad_rkey_fails_the_request_and_the_qp() {
    let (pd, mut cq, mut a, mut b) = pair(16, AccessFlags::REMOTE_WRITE);
    let local = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    let exported = pd
        .alloc_mr(64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
        .unwrap();
    let good = exported.remote().unwrap();
    let forged = crate::verbs::RemoteRegion::new(good.addr(), good.len(), good.rkey() ^ 0x5a5a);
    b.post_recv(RecvRequest::new(40, local.slice(0, 8).unwrap()).unwrap())
        .unwrap();
    a.post_recv(RecvRequest::new(41, local.slice(8, 8).unwrap()).unwrap())
        .unwrap();
    // Unsignaled, and followed by another request in the same list: the
    // failure is reported anyway, the rest is flushed.
    a.post_send(
        WorkRequest::write(1, local.slice(0, 8).unwrap(), forged.slice(0, 8).unwrap()).unwrap(),
    )
    .unwrap();
    a.post_send(WorkRequest::send_inline(2, b"late").signaled())
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
        WorkRequest::read(
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
        WorkRequest::write(1, local.slice(0, 8).unwrap(), exported.slice(0, 8).unwrap()).unwrap(),
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
        WorkRequest::write(1, local.slice(0, 8).unwrap(), remote.slice(0, 8).unwrap()).unwrap(),
    )
    .unwrap();
    assert_eq!(drain(&mut cq)[0].status(), WcStatus::REM_ACCESS_ERR);
}

#[test]
fn a_send_longer_than_the_receive_fails_both_sides() {
    let (pd, mut cq, mut a, mut b) = pair(16, AccessFlags::empty());
    let mr = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    b.post_recv(RecvRequest::new(50, mr.slice(0, 2).unwrap()).unwrap())
        .unwrap();
    b.post_recv(RecvRequest::new(51, mr.slice(2, 2).unwrap()).unwrap())
        .unwrap();
    a.post_send(WorkRequest::send_inline(1, b"too long"))
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
    for id in 60..63 {
        a.post_recv(RecvRequest::new(id, mr.slice(0, 8).unwrap()).unwrap())
            .unwrap();
    }
    // Two sends stall at b (no receive there).
    a.post_send(WorkRequest::send_inline(1, b"a")).unwrap();
    a.post_send(WorkRequest::send_inline(2, b"b")).unwrap();
    assert!(drain(&mut cq).is_empty());
    a.set_error().unwrap();
    let ids: Vec<u64> = drain(&mut cq)
        .iter()
        .inspect(|wc| assert_eq!(wc.status(), WcStatus::WR_FLUSH_ERR))
        .map(WorkCompletion::wr_id)
        .collect();
    assert_eq!(ids, [60, 61, 62, 1, 2]);
    // Posting on a QP in error flushes at once.
    a.post_recv(RecvRequest::new(63, mr.slice(0, 8).unwrap()).unwrap())
        .unwrap();
    a.post_send(WorkRequest::send_inline(3, b"c")).unwrap();
    let ids: Vec<u64> = drain(&mut cq).iter().map(WorkCompletion::wr_id).collect();
    assert_eq!(ids, [63, 3]);
    // b never got anything; its sends to a peer in error fail.
    b.post_send(WorkRequest::send_inline(4, b"d")).unwrap();
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
    a.post_send(WorkRequest::send(1, mr.slice(8, 16).unwrap()))
        .unwrap();
    let refused = a.post_recv(RecvRequest::new(60, mr.slice(16, 8).unwrap()).unwrap());
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
    let refused = a.post_recv_batch(&mut batch);
    assert!(
        matches!(&refused, Err(Error::Post { errno, posted: 0, .. }) if *errno == libc::EBUSY),
        "{refused:?}"
    );
    assert_eq!(batch.len(), 2);
    // Next to it is fine.
    a.post_recv(RecvRequest::new(61, mr.slice(24, 8).unwrap()).unwrap())
        .unwrap();
    // The error state flushes the send only when the CQ is next polled: the
    // device may read its memory until then.
    a.set_error().unwrap();
    assert!(
        a.post_recv(RecvRequest::new(62, mr.slice(8, 8).unwrap()).unwrap())
            .is_err()
    );
    let summary = statuses(&mut cq);
    assert_eq!(
        summary,
        [(61, WcStatus::WR_FLUSH_ERR), (1, WcStatus::WR_FLUSH_ERR)]
    );
    a.post_recv(RecvRequest::new(63, mr.slice(8, 8).unwrap()).unwrap())
        .unwrap();
    assert_eq!(drain(&mut cq)[0].wr_id(), 63);
}

#[test]
fn a_peer_going_to_error_fails_sends_stalled_on_it() {
    let (_pd, mut cq, mut a, b) = pair(16, AccessFlags::empty());
    a.post_send(WorkRequest::send_inline(1, b"a").signaled())
        .unwrap();
    a.post_send(WorkRequest::send_inline(2, b"b").signaled())
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
    for id in 70..72 {
        b.post_recv(RecvRequest::new(id, mr.slice(0, 8).unwrap()).unwrap())
            .unwrap();
    }
    // Receive + send completion fill the CQ; the next receive completion
    // does not fit.
    a.post_send(WorkRequest::send_inline(1, b"a").signaled())
        .unwrap();
    a.post_send(WorkRequest::send_inline(2, b"b").signaled())
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
        matches!(err, Error::Verbs { errno, .. } if errno == libc::EOVERFLOW),
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
    for id in 0..2 {
        qp.post_recv(RecvRequest::new(id, mr.slice(0, 8).unwrap()).unwrap())
            .unwrap();
    }
    let err = qp
        .post_recv(RecvRequest::new(2, mr.slice(0, 8).unwrap()).unwrap())
        .unwrap_err();
    assert!(
        matches!(err, Error::Post { errno, posted: 0, .. } if errno == libc::ENOMEM),
        "{err}"
    );
    // Not connected: sends are refused.
    let err = qp.post_send(WorkRequest::send_inline(9, b"x")).unwrap_err();
    assert!(
        matches!(err, Error::Post { errno, .. } if errno == libc::EINVAL),
        "{err}"
    );
}

#[test]
fn connecting_needs_a_live_peer_and_happens_once() {
    let ctx = single_threaded_context();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(8, None).unwrap();
    let mut a = pd.create_qp(&cq, &cq, &QpConfig::default()).unwrap();
    let b = pd.create_qp(&cq, &cq, &QpConfig::default()).unwrap();
    let gone = b.endpoint();
    drop(b);
    assert!(a.connect(&gone).is_err());
    assert_eq!(a.state().unwrap(), QpState::Init);
    // QPNs are never reused while a QP lives; a new one gets a new number.
    let c = pd.create_qp(&cq, &cq, &QpConfig::default()).unwrap();
    assert_ne!(c.qpn(), gone.qpn);
    assert_ne!(c.qpn(), a.qpn());
    a.connect(&c.endpoint()).unwrap();
    assert_eq!(a.state().unwrap(), QpState::ReadyToSend);
}

#[test]
fn qps_of_different_loopback_contexts_connect() {
    let (ctx1, ctx2) = (single_threaded_context(), single_threaded_context());
    let (pd1, pd2) = (ctx1.alloc_pd().unwrap(), ctx2.alloc_pd().unwrap());
    let mut cq1 = ctx1.create_cq(8, None).unwrap();
    let mut cq2 = ctx2.create_cq(8, None).unwrap();
    let mut a = pd1.create_qp(&cq1, &cq1, &QpConfig::default()).unwrap();
    let mut b = pd2.create_qp(&cq2, &cq2, &QpConfig::default()).unwrap();
    let (ea, eb) = (a.endpoint(), b.endpoint());
    a.connect(&eb).unwrap();
    b.connect(&ea).unwrap();
    let mr2 = pd2.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    b.post_recv(RecvRequest::new(1, mr2.slice(0, 8).unwrap()).unwrap())
        .unwrap();
    a.post_send(WorkRequest::send_inline(2, b"hi").signaled())
        .unwrap();
    assert_eq!(drain(&mut cq1).len(), 1);
    assert_eq!(drain(&mut cq2)[0].byte_len(), 2);
    assert_eq!(bytes(&mr2, 0, 2), b"hi");
    // A region of the other PD is out of this QP's reach as a local buffer.
    let mr1 = pd1.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    b.post_recv(RecvRequest::new(3, mr1.slice(0, 8).unwrap()).unwrap())
        .unwrap();
    a.post_send(WorkRequest::send_inline(4, b"x")).unwrap();
    assert_eq!(drain(&mut cq2)[0].status(), WcStatus::LOC_PROT_ERR);
}

#[test]
fn unsupported_verbs_say_so() {
    let ctx = single_threaded_context();
    let pd = ctx.alloc_pd().unwrap();
    assert!(matches!(
        ctx.create_comp_channel(),
        Err(Error::Unsupported { .. })
    ));
    assert!(matches!(pd.create_srq(16), Err(Error::Unsupported { .. })));
    assert!(matches!(pd.alloc_mw(), Err(Error::Unsupported { .. })));
    let mut cq = ctx.create_cq(8, None).unwrap();
    assert!(matches!(
        cq.req_notify(false),
        Err(Error::Unsupported { .. })
    ));
    assert!(!ctx.query_device().unwrap().mem_window_type2);
}

#[test]
fn objects_dropped_in_any_order_are_released() {
    for order in 0..6 {
        let (pd, cq, a, b) = pair(8, AccessFlags::REMOTE_WRITE);
        let mr = pd
            .alloc_mr(64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
            .unwrap();
        let (qpns, key) = ([a.qpn(), b.qpn()], mr.lkey());
        assert!(qpns.iter().all(|&qpn| super::is_qp_registered(qpn)));
        assert!(super::is_mr_registered(key));
        let ctx = pd.context();
        match order {
            0 => drop((ctx, pd, cq, mr, a, b)),
            1 => drop((b, a, mr, cq, pd, ctx)),
            2 => drop((cq, a, ctx, mr, pd, b)),
            3 => drop((mr, pd, ctx, b, cq, a)),
            4 => drop((a, cq, b, pd, mr, ctx)),
            _ => drop((pd, b, ctx, a, mr, cq)),
        }
        // Nothing of them is left in the process-wide registries: a
        // long-lived process creating and dropping QPs does not grow.
        for qpn in qpns {
            assert!(
                !super::is_qp_registered(qpn),
                "order {order}: QP {qpn} left"
            );
        }
        assert!(
            !super::is_mr_registered(key),
            "order {order}: MR {key} left"
        );
    }
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
    b.post_recv(RecvRequest::new(100, ring.slice(0, 8).unwrap()).unwrap())
        .unwrap();
    a.post_send(WorkRequest::send_inline(1, b"intruder").signaled())
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
    x.post_send(write.unwrap().signaled()).unwrap();
    let wcs = drain(&mut ocq);
    assert_eq!(wcs[0].status(), WcStatus::RETRY_EXC_ERR, "{wcs:?}");
    assert_eq!(bytes(&ring, 8, 8), [0; 8], "B's memory untouched");
    // B and C still work: C's SEND lands in B's receive.
    c.post_send(WorkRequest::send_inline(3, b"friend").signaled())
        .unwrap();
    let wcs = drain(&mut cq);
    assert!(wcs.iter().all(WorkCompletion::is_success), "{wcs:?}");
    assert_eq!(bytes(&ring, 0, 6), b"friend");
    drop((a, ctx));
}

/// A context for a test whose one thread posts every request and reads
/// every byte.
fn single_threaded_context() -> Context {
    // SAFETY: each caller is a test whose one thread posts every request
    // and touches every registered byte.
    unsafe { Context::loopback() }
}

/// Two QPs of `pd` on `cq`, connected to each other.
fn connected(
    pd: &ProtectionDomain,
    cq: &CompletionQueue,
    access: AccessFlags,
) -> (QueuePair, QueuePair) {
    let config = QpConfig {
        remote_access: access,
        ..QpConfig::default()
    };
    let mut a = pd.create_qp(cq, cq, &config).unwrap();
    let mut b = pd.create_qp(cq, cq, &config).unwrap();
    let (ea, eb) = (a.endpoint(), b.endpoint());
    a.connect(&eb).unwrap();
    b.connect(&ea).unwrap();
    (a, b)
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
            a.post_send(request.unwrap().signaled()).unwrap();
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
    a.post_send(request.unwrap().signaled()).unwrap();
    assert!(drain(&mut cq)[0].is_success());
}

#[test]
fn both_ends_on_two_threads_deliver_everything() {
    // One QP pair, each end served by its own thread: the poster writes the
    // peer's receive queue and CQ while the peer posts and polls, and
    // sends that find no receive are run by the receiver's next post.
    const MESSAGES: u64 = 20_000;
    const WINDOW: u64 = 128;
    const DEADLINE: std::time::Duration = std::time::Duration::from_secs(60);
    let started = std::time::Instant::now();
    // SAFETY: the receiver reads a slot only after polling the completion
    // that ends the SEND into it, and reposts it only after reading; the
    // sender's data is inline (copied from its stack inside the post).
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().unwrap();
    let mut cqa = ctx.create_cq(1024, None).unwrap();
    let mut cqb = ctx.create_cq(1024, None).unwrap();
    let mut a = pd.create_qp(&cqa, &cqa, &QpConfig::default()).unwrap();
    let mut b = pd.create_qp(&cqb, &cqb, &QpConfig::default()).unwrap();
    let (ea, eb) = (a.endpoint(), b.endpoint());
    a.connect(&eb).unwrap();
    b.connect(&ea).unwrap();
    let ring = pd.alloc_mr(64 * 8, AccessFlags::LOCAL_WRITE).unwrap();
    let receiver = std::thread::spawn(move || {
        let post = |b: &mut QueuePair, slot: u64| {
            let slice = ring.slice(slot as usize * 8, 8).unwrap();
            b.post_recv(RecvRequest::new(slot, slice).unwrap()).unwrap();
        };
        for slot in 0..64 {
            post(&mut b, slot);
        }
        let mut wcs = [WorkCompletion::default(); 16];
        let mut next = 0u64;
        while next < MESSAGES {
            // A lost wakeup would hang here: fail instead.
            assert!(
                started.elapsed() < DEADLINE,
                "received {next} of {MESSAGES}"
            );
            let slots: Vec<u64> = cqb
                .poll(&mut wcs)
                .unwrap()
                .iter()
                .inspect(|wc| assert!(wc.is_success(), "{wc:?}"))
                .map(WorkCompletion::wr_id)
                .collect();
            for slot in slots {
                let mut value = [0u8; 8];
                ring.read(slot as usize * 8, &mut value).unwrap();
                assert_eq!(u64::from_le_bytes(value), next, "in order");
                next += 1;
                post(&mut b, slot);
            }
        }
        b
    });
    let mut wcs = [WorkCompletion::default(); 16];
    let mut completed = 0;
    for seq in 0..MESSAGES {
        while seq - completed >= WINDOW {
            assert!(
                started.elapsed() < DEADLINE,
                "sent {seq}, {completed} completed"
            );
            let done = cqa.poll(&mut wcs).unwrap();
            assert!(done.iter().all(WorkCompletion::is_success));
            completed += done.len() as u64;
        }
        let value = seq.to_le_bytes();
        a.post_send(WorkRequest::send_inline(seq, &value).signaled())
            .unwrap();
    }
    let _b = receiver.join().unwrap();
}
