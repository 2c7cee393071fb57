//! Failures become typed errors, never panics, and the process carries on.
//! Gated as described in `tests/util/mod.rs`: runs in the Soft-RoCE guest.

mod util;

use rdma_comm_core::Error;
use rdma_comm_core::verbs::*;
use util::*;

/// Posts `wr` on a fresh pair and returns its (failed) completion as an error.
fn remote_failure(
    make: impl FnOnce(&MemoryRegion, RemoteRegion) -> (u64, u32, u32, bool),
) -> Error {
    let mut p = Pair::with_remote_access();
    let local = p.pd.alloc_mr(8192, AccessFlags::LOCAL_WRITE).unwrap();
    let exported =
        p.pd.alloc_mr(4096, AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ)
            .unwrap();
    let (addr, len, rkey, is_read) = make(&exported, exported.remote().unwrap());
    // A descriptor as a lying (or buggy) peer would send it: its claimed
    // bounds pass our local check, so the device has to refuse the access.
    let target = RemoteRegion::new(addr, u64::from(len), rkey)
        .slice(0, u64::from(len))
        .unwrap();
    let src = local.slice(0, len as usize).unwrap();
    let wr = if is_read {
        WorkRequest::read(5, src, target)
    } else {
        WorkRequest::write(5, src, target)
    };
    p.a.post_send(&mut wr.unwrap().signaled())
        .expect("posting succeeds; the device rejects it later");
    let wc = wait_for(&mut p.cq_a, 1)[0];
    let err = wc.ok().expect_err("the access must fail");
    // The QP is now in the error state; anything posted after it is flushed.
    assert_eq!(p.a.state().unwrap(), QpState::Error);
    err
}

verbs_test! {
    fn bad_rkey_is_a_typed_remote_access_error() {
        let err = remote_failure(|mr, peer| (mr.addr(), 64, peer.rkey() ^ 0x00ff_ff00, false));
        assert_eq!(err.completion_status(), Some(WcStatus::REM_ACCESS_ERR), "{err}");
        let text = err.to_string();
        assert!(text.contains("IBV_WC_REM_ACCESS_ERR") && text.contains("QP "), "{text}");
    }
}

verbs_test! {
    fn out_of_range_remote_address_is_a_typed_remote_access_error() {
        // Past the end of the exported region, for both WRITE and READ.
        let err = remote_failure(|mr, peer| (mr.addr() + 4000, 200, peer.rkey(), false));
        assert_eq!(err.completion_status(), Some(WcStatus::REM_ACCESS_ERR), "{err}");
        let err = remote_failure(|mr, peer| (mr.addr() + 4096, 1, peer.rkey(), true));
        assert_eq!(err.completion_status(), Some(WcStatus::REM_ACCESS_ERR), "{err}");
    }
}

verbs_test! {
    fn bounds_checks_refuse_bad_descriptors_before_posting() {
        let p = Pair::with_remote_access();
        let mut mr = p.pd.alloc_mr(4096, AccessFlags::REMOTE_WRITE).unwrap();
        let peer = mr.remote().unwrap();
        assert!(matches!(peer.slice(4000, 200), Err(Error::OutOfBounds { .. })));
        assert!(matches!(mr.slice(4096, 1), Err(Error::OutOfBounds { .. })));
        assert!(matches!(mr.write(usize::MAX, b"x"), Err(Error::OutOfBounds { .. })));
        // Local-only memory has no rkey worth exporting.
        let private = p.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
        assert!(matches!(private.remote(), Err(Error::InvalidArgument(_))));
        // Lengths of the two sides of an RDMA op must agree.
        let wr = WorkRequest::write(1, mr.slice(0, 10).unwrap(), peer.slice(0, 11).unwrap());
        assert!(matches!(wr, Err(Error::InvalidArgument(_))));
        // RECV and READ targets must be locally writable.
        let read_only = p.pd.alloc_mr(64, AccessFlags::REMOTE_READ).unwrap();
        assert!(RecvRequest::new(1, read_only.slice(0, 64).unwrap()).is_err());
    }
}

verbs_test! {
    fn after_a_failed_qp_the_process_goes_on() {
        let err = remote_failure(|mr, peer| (mr.addr(), 8, peer.rkey().wrapping_add(1), false));
        assert!(err.completion_status().is_some());
        // A fresh pair on the same device works as usual.
        let mut p = Pair::with_remote_access();
        let mut local = p.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
        let exported = p.pd.alloc_mr(64, AccessFlags::REMOTE_WRITE).unwrap();
        local.write(0, b"still alive").unwrap();
        let wr = WorkRequest::write(1, local.slice(0, 11).unwrap(), exported.remote().unwrap().slice(0, 11).unwrap()).unwrap();
        p.a.post_send(&mut wr.signaled()).unwrap();
        wait_ok(&mut p.cq_a);
        assert_eq!(read_back(&exported, 0, 11), b"still alive");
    }
}

verbs_test! {
    fn a_qp_without_remote_access_refuses_writes() {
        // Least privilege on the QP too: the default config grants no remote access.
        let mut p = Pair::new(&QpConfig::default());
        let local = p.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
        let exported = p.pd.alloc_mr(64, AccessFlags::REMOTE_WRITE).unwrap();
        let wr = WorkRequest::write(1, local.slice(0, 8).unwrap(), exported.remote().unwrap().slice(0, 8).unwrap()).unwrap();
        p.a.post_send(&mut wr.signaled()).unwrap();
        let wc = wait_for(&mut p.cq_a, 1)[0];
        let err = wc.ok().unwrap_err();
        assert!(
            matches!(err.completion_status(), Some(s) if s == WcStatus::REM_ACCESS_ERR || s == WcStatus::REM_INV_REQ_ERR),
            "{err}"
        );
    }
}

verbs_test! {
    fn a_full_send_queue_reports_queue_full() {
        let mut config = QpConfig::default();
        config.max_send_wr = 8;
        let mut p = Pair::new(&config);
        let depth = p.a.max_send_wr() as usize;
        // Nobody polls and no RECV is posted, so nothing frees SQ slots: the
        // SENDs sit in RNR retry (rnr_retry 7 = forever).
        let mut posted = 0;
        let err = loop {
            match p.a.post_send(&mut WorkRequest::send_inline(posted as u64, b"x").signaled()) {
                Ok(()) => posted += 1,
                Err(err) => break err,
            }
            // Providers round queues up (rxe to a power of two), so allow slack.
            assert!(posted <= 4 * depth + 64, "posted {posted} into a queue of {depth} without ENOMEM");
        };
        assert!(err.is_queue_full(), "{err}");
        assert!(posted >= depth.min(8), "posted {posted} of {depth}");
    }
}

verbs_test! {
    fn a_cq_or_srq_of_another_context_is_refused() {
        // Two opens of the same device are two contexts: a CQ handle of one
        // means nothing (or another CQ) in the other.
        let (ours, other) = (open_device(), open_device());
        let pd = ours.alloc_pd().unwrap();
        let own_cq = ours.create_cq(16, None).unwrap();
        let foreign_cq = other.create_cq(16, None).unwrap();
        let config = QpConfig::default();
        for (send, recv) in [(&foreign_cq, &own_cq), (&own_cq, &foreign_cq)] {
            let err = pd.create_qp(send, recv, &config).unwrap_err();
            assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        }
        let foreign_srq = other.alloc_pd().unwrap().create_srq(16).unwrap();
        let err = pd
            .create_qp_with_srq(&own_cq, &own_cq, &foreign_srq.attachment(), &config)
            .unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        // The same context is fine.
        pd.create_qp(&own_cq, &own_cq, &config).unwrap();
    }
}

verbs_test! {
    fn a_drain_posted_after_the_error_state_completes_behind_everything_before_it() {
        // What the reactor relies on to retire the requests of a failed
        // connection, unsignaled ones included: a signaled zero-length
        // WRITE to no memory, posted on a QP in the error state, is flushed
        // in order behind every request before it.
        let mut p = Pair::with_remote_access();
        let local = p.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
        let exported = p.pd.alloc_mr(64, AccessFlags::REMOTE_WRITE).unwrap();
        // An unsignaled WRITE that completes silently, then a signaled one
        // to know it did.
        for (id, signaled) in [(1, false), (2, true)] {
            let wr = WorkRequest::write(id, local.slice(0, 8).unwrap(), exported.remote().unwrap().slice(0, 8).unwrap()).unwrap();
            p.a.post_send(&mut if signaled { wr.signaled() } else { wr }).unwrap();
        }
        assert_eq!(wait_ok(&mut p.cq_a).wr_id(), 2);
        // Two SENDs the peer has no receive for: RNR waits, one unsignaled.
        p.a.post_send(&mut WorkRequest::send_inline(3, b"x")).unwrap();
        p.a.post_send(&mut WorkRequest::send_inline(4, b"y").signaled()).unwrap();
        p.a.set_error().unwrap();
        let nowhere = RemoteRegion::new(0, 0, 0).slice(0, 0).unwrap();
        let drain = WorkRequest::write(5, local.slice(0, 0).unwrap(), nowhere).unwrap();
        p.a.post_send(&mut drain.signaled()).expect("a QP in the error state takes requests to flush");
        let wcs = wait_for(&mut p.cq_a, 3);
        let ids: Vec<u64> = wcs.iter().map(|wc| wc.wr_id()).collect();
        assert_eq!(ids, [3, 4, 5], "{wcs:?}");
        // The one in its RNR wait may report that instead of a flush.
        assert!(wcs.iter().all(|wc| wc.status() != WcStatus::SUCCESS), "{wcs:?}");
        assert_eq!(wcs[2].status(), WcStatus::WR_FLUSH_ERR);
    }
}
