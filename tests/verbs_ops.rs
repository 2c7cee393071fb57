//! Data movement between two connected RC QPs with each of the five verbs ops.
//! Gated as described in `tests/util/mod.rs`: runs in the Soft-RoCE guest.

mod util;

use rdma_comm_core::verbs::*;
use util::*;

verbs_test! {
    fn device_port_and_gid_are_reported() {
        let ctx = open_device();
        let port = ctx.first_active_port().expect("an active port");
        let attr = ctx.query_port(port).expect("query_port");
        assert_eq!(attr.state, PortState::Active);
        assert!(attr.active_mtu.bytes() >= 256);
        let gid = ctx.select_gid(port, None).expect("select_gid");
        if attr.link_layer == LinkLayer::Ethernet {
            assert_eq!(gid.gid_type, GidType::RoceV2, "RoCE prefers v2: {gid:?}");
            assert!(gid.gid.ipv4_mapped().is_some(), "RoCE prefers the IPv4-mapped GID: {gid:?}");
        }
        let same = ctx.select_gid(port, Some(gid.index)).expect("override by index");
        assert_eq!(same, gid);
        assert!(ctx.select_gid(port, Some(100_000)).is_err());
        assert!(Context::open("no-such-device").is_err());
        let limits = ctx.query_device().expect("query_device");
        assert!(limits.max_qp_wr >= 256 && limits.max_cqe >= 1024, "{limits:?}");
    }
}

verbs_test! {
    fn send_and_send_with_imm_deliver_bytes_and_immediates() {
        let mut p = Pair::new(&QpConfig::default());
        let mut tx = p.pd.alloc_mr(4096, AccessFlags::empty()).unwrap();
        let rx = p.pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
        let msg = pattern(1, 1000);
        tx.write(0, &msg).unwrap();

        p.b.post_recv(&mut RecvRequest::new(10, rx.slice(0, 2048).unwrap()).unwrap()).unwrap();
        p.b.post_recv(&mut RecvRequest::new(11, rx.slice(2048, 2048).unwrap()).unwrap()).unwrap();
        p.a.post_send(&mut WorkRequest::send(1, tx.slice(0, 1000).unwrap()).signaled()).unwrap();
        p.a.post_send(&mut WorkRequest::send_with_imm(2, tx.slice(0, 500).unwrap(), 0xdead_beef).signaled()).unwrap();

        let sent = wait_for(&mut p.cq_a, 2);
        for wc in &sent {
            wc.ok().unwrap();
            assert_eq!(wc.opcode(), WcOpcode::SEND);
        }
        let recvd = wait_for(&mut p.cq_b, 2);
        assert_eq!((recvd[0].wr_id(), recvd[0].byte_len(), recvd[0].imm()), (10, 1000, None));
        assert_eq!((recvd[1].wr_id(), recvd[1].byte_len(), recvd[1].imm()), (11, 500, Some(0xdead_beef)));
        assert!(recvd.iter().all(|wc| wc.opcode() == WcOpcode::RECV && wc.qp_num() == p.b.qpn()));
        assert_eq!(read_back(&rx, 0, 1000), msg);
        assert_eq!(read_back(&rx, 2048, 500), msg[..500]);
    }
}

verbs_test! {
    fn write_write_with_imm_and_read_move_bytes() {
        let mut p = Pair::with_remote_access();
        let mut local = p.pd.alloc_mr(1 << 16, AccessFlags::LOCAL_WRITE).unwrap();
        let mut exported = p.pd.alloc_mr(1 << 16, AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ).unwrap();
        let peer = exported.remote().unwrap();

        // WRITE: no receive is consumed, no completion on the target side.
        let data = pattern(2, 3000);
        local.write(0, &data).unwrap();
        let wr = WorkRequest::write(1, local.slice(0, 3000).unwrap(), peer.slice(100, 3000).unwrap()).unwrap();
        p.a.post_send(&mut wr.signaled()).unwrap();
        assert_eq!(wait_ok(&mut p.cq_a).opcode(), WcOpcode::RDMA_WRITE);
        assert_eq!(read_back(&exported, 100, 3000), data);

        // WRITE_WITH_IMM: data lands, and the target's RECV reports the immediate.
        let data = pattern(3, 777);
        local.write(4096, &data).unwrap();
        let notify = p.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
        p.b.post_recv(&mut RecvRequest::new(77, notify.slice(0, 0).unwrap()).unwrap()).unwrap();
        let wr = WorkRequest::write_with_imm(2, local.slice(4096, 777).unwrap(), peer.slice(8192, 777).unwrap(), 0x1234_5678)
            .unwrap();
        p.a.post_send(&mut wr.signaled()).unwrap();
        wait_ok(&mut p.cq_a);
        let wc = wait_ok(&mut p.cq_b);
        assert_eq!((wc.wr_id(), wc.opcode(), wc.imm(), wc.byte_len()), (77, WcOpcode::RECV_RDMA_WITH_IMM, Some(0x1234_5678), 777));
        assert_eq!(read_back(&exported, 8192, 777), data);

        // READ: pull bytes the peer holds.
        let data = pattern(4, 5000);
        exported.write(20_000, &data).unwrap();
        let wr = WorkRequest::read(3, local.slice(30_000, 5000).unwrap(), peer.slice(20_000, 5000).unwrap()).unwrap();
        p.a.post_send(&mut wr.signaled()).unwrap();
        let wc = wait_ok(&mut p.cq_a);
        assert_eq!((wc.wr_id(), wc.opcode(), wc.byte_len()), (3, WcOpcode::RDMA_READ, 5000));
        assert_eq!(read_back(&local, 30_000, 5000), data);
    }
}

verbs_test! {
    fn write_and_read_at_offsets_from_1_byte_to_8_mib() {
        const MAX: usize = 8 << 20;
        const SLACK: usize = 8192;
        let mut p = Pair::with_remote_access();
        let mut local = p.pd.alloc_mr(MAX + SLACK, AccessFlags::LOCAL_WRITE).unwrap();
        let mut exported = p.pd.alloc_mr(MAX + SLACK, AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ).unwrap();
        let peer = exported.remote().unwrap();

        let mut sizes: Vec<usize> = (0..=23).map(|shift| 1usize << shift).collect();
        sizes.extend([3, 1023, 1025, 4097, 65_537, 1_000_001]);
        for (round, &len) in sizes.iter().enumerate() {
            let seed = round as u8;
            let local_off = [0, 1, 7, 4093][round % 4];
            let remote_off = [5, 0, 4096, 333][round % 4];
            let guard_at = remote_off + len;

            // WRITE local[local_off..] -> remote[remote_off..]; the byte after must be untouched.
            exported.write(guard_at, &[0xA5]).unwrap();
            local.write(local_off, &pattern(seed, len)).unwrap();
            let wr = WorkRequest::write(1, local.slice(local_off, len).unwrap(), peer.slice(remote_off as u64, len as u64).unwrap()).unwrap();
            p.a.post_send(&mut wr.signaled()).unwrap();
            wait_ok(&mut p.cq_a);
            assert!(read_back(&exported, remote_off, len) == pattern(seed, len), "WRITE of {len} B at {remote_off} corrupted data");
            assert_eq!(read_back(&exported, guard_at, 1), [0xA5], "WRITE of {len} B overran");

            // READ it back into a different local offset and compare.
            let back_off = (local_off + 3) % 16;
            local.write(back_off + len, &[0x5A]).unwrap();
            let wr = WorkRequest::read(2, local.slice(back_off, len).unwrap(), peer.slice(remote_off as u64, len as u64).unwrap()).unwrap();
            p.a.post_send(&mut wr.signaled()).unwrap();
            assert_eq!(wait_ok(&mut p.cq_a).byte_len() as usize, len);
            assert!(read_back(&local, back_off, len) == pattern(seed, len), "READ of {len} B returned wrong data");
            assert_eq!(read_back(&local, back_off + len, 1), [0x5A], "READ of {len} B overran");
        }
    }
}

verbs_test! {
    fn batched_and_inline_sends_arrive_in_order() {
        let mut p = Pair::new(&QpConfig::default());
        let rx = p.pd.alloc_mr(16 * 64, AccessFlags::LOCAL_WRITE).unwrap();
        let mut recvs = RecvBatch::<16>::new();
        for i in 0..16 {
            recvs.push(RecvRequest::new(100 + i as u64, rx.slice(i * 64, 64).unwrap()).unwrap()).unwrap();
        }
        p.b.post_recv(&mut recvs).unwrap();
        assert_eq!(recvs.len(), 16, "a posted batch stays as it was, to post again");

        assert!(p.a.max_inline_data() >= 16, "provider grants some inline space");
        let payloads: Vec<[u8; 16]> = (0..16u8).map(|i| [i; 16]).collect();
        let mut batch = SendBatch::<16>::new();
        for (i, payload) in payloads.iter().enumerate() {
            // Selective signaling: only the last request of the batch is signaled.
            let mut wr = WorkRequest::send_inline(i as u64, payload);
            if i == 15 {
                wr = wr.signaled();
            }
            batch.push(wr).unwrap();
        }
        p.a.post_send(&mut batch).unwrap();
        let wc = wait_ok(&mut p.cq_a);
        assert_eq!(wc.wr_id(), 15, "only the signaled request completes");

        let got = wait_for(&mut p.cq_b, 16);
        for (i, wc) in got.iter().enumerate() {
            wc.ok().unwrap();
            assert_eq!((wc.wr_id(), wc.byte_len()), (100 + i as u64, 16));
            assert_eq!(read_back(&rx, i * 64, 16), [i as u8; 16]);
        }

        let too_big = vec![0u8; p.a.max_inline_data() as usize + 1];
        let err = p.a.post_send(&mut WorkRequest::send_inline(1, &too_big)).unwrap_err();
        assert!(matches!(err, rdma_comm_core::Error::InlineTooLarge { .. }), "{err}");
    }
}

verbs_test! {
    fn completion_channel_wakes_and_works_with_epoll() {
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        let channel = ctx.create_comp_channel().unwrap();
        let mut cq_a = ctx.create_cq(64, None).unwrap();
        let mut cq_b = ctx.create_cq(64, Some(&channel)).unwrap();
        let mut a = pd.create_qp(&cq_a, &cq_a, &QpConfig::default()).unwrap();
        let mut b = pd.create_qp(&cq_b, &cq_b, &QpConfig::default()).unwrap();
        let (ea, eb) = (a.endpoint(), b.endpoint());
        a.connect(&eb).unwrap();
        b.connect(&ea).unwrap();
        let rx = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();

        channel.set_nonblocking(true).unwrap();
        // SAFETY: plain epoll syscalls on descriptors we own.
        let epfd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        assert!(epfd >= 0);
        let mut ev = libc::epoll_event { events: libc::EPOLLIN as u32, u64: 7 };
        // SAFETY: as above.
        assert_eq!(unsafe { libc::epoll_ctl(epfd, libc::EPOLL_CTL_ADD, channel.fd(), &mut ev) }, 0);

        for round in 0..100u32 {
            cq_b.req_notify(false).unwrap();
            assert_eq!(channel.try_get_event().unwrap(), None, "no event before any completion");
            b.post_recv(&mut RecvRequest::new(u64::from(round), rx.slice(0, 64).unwrap()).unwrap()).unwrap();
            a.post_send(&mut WorkRequest::send_inline(0, &round.to_le_bytes()).signaled()).unwrap();
            wait_ok(&mut cq_a);

            let mut out = [libc::epoll_event { events: 0, u64: 0 }];
            // SAFETY: `out` has room for one event.
            let n = unsafe { libc::epoll_wait(epfd, out.as_mut_ptr(), 1, DEADLINE.as_millis() as i32) };
            assert_eq!(n, 1, "epoll reported the channel in round {round}");
            let id = out[0].u64;
            assert_eq!(id, 7);
            assert_eq!(channel.try_get_event().unwrap(), Some(cq_b.id()));
            let wc = wait_ok(&mut cq_b);
            assert_eq!((wc.wr_id(), read_back(&rx, 0, 4)), (u64::from(round), round.to_le_bytes().to_vec()));
        }
        // SAFETY: closing the epoll descriptor we created.
        unsafe { libc::close(epfd) };

        // Blocking mode on the same channel.
        channel.set_nonblocking(false).unwrap();
        cq_b.req_notify(false).unwrap();
        b.post_recv(&mut RecvRequest::new(999, rx.slice(0, 64).unwrap()).unwrap()).unwrap();
        a.post_send(&mut WorkRequest::send_inline(0, b"wake").signaled()).unwrap();
        assert_eq!(channel.get_event().unwrap(), cq_b.id());
        assert_eq!(wait_ok(&mut cq_b).wr_id(), 999);
        // More than one ack batch of events was delivered; dropping must not hang.
        drop((a, b, cq_a, cq_b, channel));
    }
}
