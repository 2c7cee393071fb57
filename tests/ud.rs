//! Unreliable datagrams between two UD QPs on one device: by QP number,
//! a reply to the sender a completion names, the Q_Key, receives too short
//! for the GRH, and a multicast group joined and left (its traffic crosses
//! two guests in `tools/faults`' multicast scenario).
//! Gated as described in `tests/util/mod.rs`: runs in the Soft-RoCE guest.

mod util;

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use rdma_comm_core::Error;
use rdma_comm_core::verbs::*;
use util::*;

/// Bytes of each receive: the GRH, then room for the payload.
const RECV_LEN: usize = GRH_BYTES + 256;

/// A UD QP on a CQ of its own, with receives posted.
struct End {
    qp: UdQueuePair,
    cq: CompletionQueue,
    rx: MemoryRegion,
    tx: MemoryRegion,
}

impl End {
    fn new(pd: &ProtectionDomain, ctx: &Context) -> Self {
        let mut cq = ctx.create_cq(64, None).expect("a CQ");
        let qp = pd
            .create_ud_qp(&cq, &cq, &UdConfig::default())
            .expect("a UD QP");
        let rx = pd
            .alloc_mr(8 * RECV_LEN, AccessFlags::LOCAL_WRITE)
            .expect("rx");
        let tx = pd.alloc_mr(4096, AccessFlags::empty()).expect("tx");
        // No completion is pending on a fresh CQ.
        assert!(
            cq.poll(&mut [WorkCompletion::default(); 1])
                .expect("poll")
                .is_empty()
        );
        let mut end = Self { qp, cq, rx, tx };
        for slot in 0..8 {
            end.post_recv(slot);
        }
        end
    }

    fn post_recv(&mut self, slot: u64) {
        let at = slot as usize * RECV_LEN;
        let slice = self.rx.slice(at, RECV_LEN).expect("a slot");
        let mut request = RecvRequest::new(slot, slice).expect("a receive");
        self.qp.post_recv(&mut request).expect("posted");
    }

    /// Sends `data` (signaled) to `to` and waits for its completion.
    fn send(&mut self, to: &UdDestination, data: &[u8], imm: Option<u32>) {
        self.tx.write(0, data).expect("staged");
        let local = self.tx.slice(0, data.len()).expect("a slice");
        let mut request = UdSend::new(7, local, to).signaled();
        if let Some(imm) = imm {
            request = request.with_imm(imm);
        }
        self.qp.post_send(&mut request).expect("a datagram posted");
        let wc = wait_ok(&mut self.cq);
        assert_eq!(wc.wr_id(), 7, "the send's completion");
    }

    /// The next datagram received: its completion, GRH and payload.
    fn receive(&mut self) -> (WorkCompletion, Vec<u8>, Vec<u8>) {
        let wc = wait_ok(&mut self.cq);
        assert_eq!(wc.opcode(), WcOpcode::RECV, "{wc:?}");
        let at = wc.wr_id() as usize * RECV_LEN;
        let payload = datagram_payload(&wc).expect("a GRH and a payload");
        let grh = read_back(&self.rx, at, GRH_BYTES);
        let bytes = read_back(&self.rx, at + payload.start, payload.len());
        self.post_recv(wc.wr_id());
        (wc, grh, bytes)
    }

    /// Nothing arrives within `quiet`.
    fn receives_nothing(&mut self, quiet: Duration) {
        let start = Instant::now();
        let mut wcs = [WorkCompletion::default(); 4];
        while start.elapsed() < quiet {
            let got = self.cq.poll(&mut wcs).expect("poll");
            assert!(got.is_empty(), "a datagram arrived: {got:?}");
        }
    }
}

verbs_test! {
    fn a_datagram_reaches_a_qp_by_number_and_its_reply_the_sender() {
        let ctx = open_device();
        let pd = ctx.alloc_pd().expect("a PD");
        let (mut a, mut b) = (End::new(&pd, &ctx), End::new(&pd, &ctx));
        let to_b = a.qp.destination(&b.qp.endpoint()).expect("a destination");
        assert_eq!(to_b.qpn(), b.qp.qpn());

        a.send(&to_b, b"ping", None);
        let (wc, grh, payload) = b.receive();
        assert_eq!(payload, b"ping");
        assert_eq!(wc.byte_len() as usize, GRH_BYTES + 4, "the GRH counts in the byte count");
        assert_eq!(wc.src_qp(), a.qp.qpn(), "the sender's QP number");
        assert!(wc.has_grh());
        assert_eq!(wc.imm(), None);

        // The answer goes where the completion and the GRH say it came from.
        let to_a = b.qp.reply_destination(&wc, &grh).expect("a reply destination");
        assert_eq!(to_a.qpn(), a.qp.qpn());
        b.send(&to_a, b"pong", Some(0xfeed));
        let (wc, _, payload) = a.receive();
        assert_eq!(payload, b"pong");
        assert_eq!(wc.imm(), Some(0xfeed));
        assert_eq!(wc.src_qp(), b.qp.qpn());

        // Inline, too.
        let mut inline = UdSend::inline(8, b"inline", &to_b).expect("inline").signaled();
        a.qp.post_send(&mut inline).expect("posted inline");
        assert_eq!(wait_ok(&mut a.cq).wr_id(), 8);
        assert_eq!(b.receive().2, b"inline");
    }
}

verbs_test! {
    fn a_destination_dropped_right_after_the_post_still_delivers() {
        let ctx = open_device();
        let pd = ctx.alloc_pd().expect("a PD");
        let (mut a, mut b) = (End::new(&pd, &ctx), End::new(&pd, &ctx));
        for round in 0u8..20 {
            let to_b = a.qp.destination(&b.qp.endpoint()).expect("a destination");
            a.tx.write(0, &[round; 8]).expect("staged");
            let local = a.tx.slice(0, 8).expect("a slice");
            a.qp.post_send(&mut UdSend::new(9, local, &to_b).signaled()).expect("posted");
            // The QP keeps the address handle until the send is done.
            drop(to_b);
            assert_eq!(wait_ok(&mut a.cq).wr_id(), 9, "send {round} completed");
            assert_eq!(b.receive().2, [round; 8], "datagram {round} arrived");
        }
    }
}

verbs_test! {
    fn a_destination_of_another_pd_and_a_datagram_over_the_mtu_are_refused() {
        let ctx = open_device();
        let pd = ctx.alloc_pd().expect("a PD");
        let (mut a, b) = (End::new(&pd, &ctx), End::new(&pd, &ctx));
        let other_pd = ctx.alloc_pd().expect("another PD");
        let cq = ctx.create_cq(16, None).expect("a CQ");
        let other = other_pd.create_ud_qp(&cq, &cq, &UdConfig::default()).expect("a UD QP");
        let foreign = other.destination(&b.qp.endpoint()).expect("a destination of the other PD");
        let local = a.tx.slice(0, 8).expect("a slice");
        match a.qp.post_send(&mut UdSend::new(1, local, &foreign)) {
            Err(Error::ForeignHandle(why)) => assert!(why.contains("protection domain"), "{why}"),
            other => panic!("a destination of another PD: {other:?}"),
        }
        let to_b = a.qp.destination(&b.qp.endpoint()).expect("a destination");
        let mtu = a.qp.max_datagram() as usize;
        let big = pd.alloc_mr(mtu + 1, AccessFlags::empty()).expect("a region");
        match a.qp.post_send(&mut UdSend::new(2, big.slice(0, mtu + 1).expect("a slice"), &to_b)) {
            Err(Error::InvalidArgument(why)) => assert!(why.contains("MTU"), "{why}"),
            other => panic!("a datagram over the MTU: {other:?}"),
        }
        a.qp
            .post_send(&mut UdSend::new(3, big.slice(0, mtu).expect("a slice"), &to_b).signaled())
            .expect("a datagram of exactly the MTU");
        assert_eq!(wait_ok(&mut a.cq).wr_id(), 3);
    }
}

verbs_test! {
    fn a_datagram_with_another_qkey_is_dropped() {
        let ctx = open_device();
        let pd = ctx.alloc_pd().expect("a PD");
        let (mut a, mut b) = (End::new(&pd, &ctx), End::new(&pd, &ctx));
        let wrong = UdEndpoint { qkey: RDMA_UDP_QKEY ^ 1, ..b.qp.endpoint() };
        let to_b_wrongly = a.qp.destination(&wrong).expect("a destination");
        a.send(&to_b_wrongly, b"stray", None);
        b.receives_nothing(Duration::from_millis(300));
        let to_b = a.qp.destination(&b.qp.endpoint()).expect("a destination");
        a.send(&to_b, b"right", None);
        assert_eq!(b.receive().2, b"right", "the right Q_Key gets through");
    }
}

verbs_test! {
    fn a_ud_receive_too_short_for_the_grh_is_refused() {
        let ctx = open_device();
        let pd = ctx.alloc_pd().expect("a PD");
        let cq = ctx.create_cq(16, None).expect("a CQ");
        let mut qp = pd.create_ud_qp(&cq, &cq, &UdConfig::default()).expect("a UD QP");
        let rx = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).expect("rx");
        let short = rx.slice(0, GRH_BYTES - 1).expect("a slice");
        match qp.post_recv(&mut RecvRequest::new(1, short).expect("a receive")) {
            Err(Error::InvalidArgument(why)) => assert!(why.contains("GRH"), "{why}"),
            other => panic!("a 39-byte UD receive: {other:?}"),
        }
        let exact = rx.slice(0, GRH_BYTES).expect("a slice");
        qp.post_recv(&mut RecvRequest::new(2, exact).expect("a receive")).expect("40 bytes will do");
        let privileged = UdConfig { qkey: 0x8000_0000, ..UdConfig::default() };
        assert!(matches!(pd.create_ud_qp(&cq, &cq, &privileged), Err(Error::InvalidArgument(_))));
    }
}

verbs_test! {
    fn a_qp_joins_and_leaves_a_multicast_group_and_refuses_what_is_not_one() {
        let ctx = open_device();
        let pd = ctx.alloc_pd().expect("a PD");
        let cq = ctx.create_cq(16, None).expect("a CQ");
        let mut qp = pd.create_ud_qp(&cq, &cq, &UdConfig::default()).expect("a UD QP");
        let group = Gid::from_ipv4(Ipv4Addr::new(239, 1, 1, 1));
        qp.join(group).expect("joined");
        qp.join(group).expect("joining again is a no-op");
        let unicast = Gid::from_ipv4(Ipv4Addr::new(10, 1, 1, 1));
        assert!(matches!(qp.join(unicast), Err(Error::InvalidArgument(_))), "not a group");
        let to_group = qp.group_destination(group).expect("the group's destination");
        assert_eq!(to_group.qpn(), 0x00ff_ffff, "datagrams to a group go to the multicast QPN");
        qp.leave(group).expect("left");
        assert!(matches!(qp.leave(group), Err(Error::InvalidArgument(_))), "not a member any more");
        // Joined again, then left by the drop.
        qp.join(group).expect("joined again");
        drop(qp);
    }
}
