//! Creating and destroying verbs objects leaks nothing, in any drop order.
//! Gated as described in `tests/util/mod.rs`: runs in the Soft-RoCE guest.

mod util;

use rdma_comm_core::verbs::*;
use util::*;

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .map(|dir| dir.count())
        .unwrap_or(0)
}

fn rss_kib() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    pages * 4
}

/// One full set of objects, used once and dropped.
fn churn(ctx: &Context, round: u64) {
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(64, None).unwrap();
    let mr = pd
        .alloc_mr(
            64 * 1024,
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
        )
        .unwrap();
    let mut qp = pd.create_qp(&cq, &cq, &remote_config()).unwrap();
    qp.post_recv(&mut RecvRequest::new(round, mr.slice(0, 4096).unwrap()).unwrap())
        .unwrap();
    // Vary the drop order: parents first on odd rounds.
    if round % 2 == 1 {
        drop((pd, cq));
        drop(mr);
        drop(qp);
    } else {
        drop((qp, mr, cq, pd));
    }
}

verbs_test! {
    fn a_thousand_qp_cq_mr_sets_leak_no_fds_or_memory() {
        let ctx = open_device();
        for round in 0..50 {
            churn(&ctx, round);
        }
        let (fds, rss) = (open_fds(), rss_kib());
        for round in 0..1000 {
            churn(&ctx, round);
        }
        let (fds_after, rss_after) = (open_fds(), rss_kib());
        assert_eq!(fds_after, fds, "open fds grew from {fds} to {fds_after}");
        assert!(rss_after <= rss + 8 * 1024, "RSS grew from {rss} KiB to {rss_after} KiB over 1000 sets");
    }
}

verbs_test! {
    fn handles_can_be_dropped_in_any_order_while_the_qp_is_connected() {
        let Pair { a, b, cq_a, cq_b, pd, ctx } = Pair::with_remote_access();
        let mr = pd.alloc_mr(4096, AccessFlags::REMOTE_WRITE).unwrap();
        // Context, PD and CQ handles go first; the QPs and MR keep what they need.
        drop(ctx);
        drop(pd);
        drop(cq_a);
        drop(cq_b);
        assert_eq!(a.state().unwrap(), QpState::ReadyToSend);
        let local = a.endpoint();
        assert_ne!(local.qpn, b.qpn());
        drop(a);
        drop(mr);
        drop(b);
    }
}

verbs_test! {
    fn caller_owned_buffers_register_and_carry_data() {
        let mut p = Pair::new(&QpConfig::default());
        let tx = p.pd.register_boxed(pattern(9, 300).into_boxed_slice(), AccessFlags::empty()).unwrap();
        let rx = p.pd.register_boxed(vec![0u8; 300].into_boxed_slice(), AccessFlags::LOCAL_WRITE).unwrap();
        assert!(!tx.huge_pages());
        p.b.post_recv(&mut RecvRequest::new(1, rx.whole().unwrap()).unwrap()).unwrap();
        p.a.post_send(&mut WorkRequest::send(2, tx.whole().unwrap()).signaled()).unwrap();
        wait_ok(&mut p.cq_a);
        assert_eq!(wait_ok(&mut p.cq_b).byte_len(), 300);
        assert_eq!(read_back(&rx, 0, 300), pattern(9, 300));
    }
}
