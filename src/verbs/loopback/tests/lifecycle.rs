//! The device's set-up and teardown: its port and GID, connecting, QPs of
//! different contexts, the verbs it lacks, and objects dropped in any order.

use super::*;

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
    link(&mut a, &mut b);
    let mr2 = pd2.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    b.post_recv(&mut RecvRequest::new(1, mr2.slice(0, 8).unwrap()).unwrap())
        .unwrap();
    a.post_send(&mut WorkRequest::send_inline(2, b"hi").signaled())
        .unwrap();
    assert_eq!(drain(&mut cq1).len(), 1);
    assert_eq!(drain(&mut cq2)[0].byte_len(), 2);
    assert_eq!(bytes(&mr2, 0, 2), b"hi");
    // A region of the other PD is out of this QP's reach as a local buffer.
    let mr1 = pd1.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    b.post_recv(&mut RecvRequest::new(3, mr1.slice(0, 8).unwrap()).unwrap())
        .unwrap();
    a.post_send(&mut WorkRequest::send_inline(4, b"x")).unwrap();
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
        assert!(qpns.iter().all(|&qpn| super::super::is_qp_registered(qpn)));
        assert!(super::super::is_mr_registered(key));
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
                !super::super::is_qp_registered(qpn),
                "order {order}: QP {qpn} left"
            );
        }
        assert!(
            !super::super::is_mr_registered(key),
            "order {order}: MR {key} left"
        );
    }
}
