//! Datagrams through the connection manager (`verbs::cm` datagram ids,
//! `RDMA_PS_UDP`) in one process: both sides over rxe0 at 10.77.0.1, each
//! on a channel of its own; and a multicast group joined and left through
//! the connection manager (its traffic crosses two guests with mckey in
//! `tools/faults`' multicast-cm scenario).
//!
//! Gating: `verbs_test!` (tools/test runs these in the Soft-RoCE guest,
//! which has rdma_ucm loaded).

mod util;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::{Duration, Instant};

use rdma_comm_core::Error;
use rdma_comm_core::error::CmFailure;
use rdma_comm_core::verbs::cm::{CmEventKind, CmId, EventChannel};
use rdma_comm_core::verbs::*;

const T: Duration = Duration::from_secs(10);
const SLOT: usize = GRH_BYTES + 256;

fn addr() -> SocketAddr {
    static NEXT: AtomicU16 = AtomicU16::new(7600);
    SocketAddr::from(([10, 77, 0, 1], NEXT.fetch_add(1, Ordering::Relaxed)))
}

/// A datagram id with its address and route resolved.
fn resolved(channel: &EventChannel, to: SocketAddr) -> CmId {
    let mut id = channel.create_ud_id().unwrap();
    id.resolve_addr(None, to, T).unwrap();
    channel.expect(&id, CmEventKind::AddrResolved, T).unwrap();
    id.resolve_route(T).unwrap();
    channel.expect(&id, CmEventKind::RouteResolved, T).unwrap();
    id
}

/// One receive completion from `cq`, within `T`.
#[track_caller]
fn one_completion(cq: &mut CompletionQueue) -> WorkCompletion {
    let deadline = Instant::now() + T;
    let mut wcs = [WorkCompletion::default(); 1];
    while Instant::now() < deadline {
        if let Some(wc) = cq.poll(&mut wcs).unwrap().first() {
            wc.ok().unwrap();
            return *wc;
        }
    }
    panic!("no completion within {T:?}");
}

verbs_test! {
    /// udaddy's exchange: the client connects, learns the server's QP from
    /// Established, sends; the server answers at the completion's address.
    fn a_datagram_goes_each_way_after_connect_ud_and_accept_ud() {
        let at = addr();
        let server_channel = EventChannel::new().unwrap();
        let mut listener = server_channel.create_ud_id().unwrap();
        assert!(listener.is_datagram());
        listener.bind(at).unwrap();
        listener.listen(4).unwrap();

        let channel = EventChannel::new().unwrap();
        let mut id = resolved(&channel, at);
        let ctx = id.context().unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let mut cq = ctx.create_cq(16, None).unwrap();
        let mut qp = id.create_ud_qp(&pd, &cq, &cq, &UdConfig::default()).unwrap();
        let mr = pd.alloc_mr(2 * SLOT, AccessFlags::LOCAL_WRITE).unwrap();
        qp.post_recv(&mut RecvRequest::new(1, mr.slice(0, SLOT).unwrap()).unwrap())
            .unwrap();
        id.connect_ud(&qp, b"udaddy").unwrap();
        assert!(matches!(id.connect_ud(&qp, &[]), Err(Error::InvalidArgument(_))));

        let mut event = server_channel
            .expect(&listener, CmEventKind::ConnectRequest, T)
            .unwrap();
        let request = event.take_request().expect("a request carries its id");
        drop(event);
        assert!(request.id().is_datagram());
        assert!(request.private_data().starts_with(b"udaddy"));
        let sctx = request.id().context().unwrap();
        let spd = sctx.alloc_pd().unwrap();
        let mut scq = sctx.create_cq(16, None).unwrap();
        let mut sqp = request
            .id()
            .create_ud_qp(&spd, &scq, &scq, &UdConfig::default())
            .unwrap();
        let smr = spd.alloc_mr(2 * SLOT, AccessFlags::LOCAL_WRITE).unwrap();
        sqp.post_recv(&mut RecvRequest::new(2, smr.slice(0, SLOT).unwrap()).unwrap())
            .unwrap();
        let _sid = request.accept_ud(&sqp, &[]).unwrap();

        let established = channel.expect(&id, CmEventKind::Established, T).unwrap();
        let to_server = established.ud_destination(&qp).unwrap();
        drop(established);
        assert_eq!(to_server.qpn(), sqp.qpn());
        assert_eq!(to_server.qkey(), RDMA_UDP_QKEY);

        let mut request = UdSend::inline(3, b"ping", &to_server).unwrap().with_imm(qp.qpn()).signaled();
        qp.post_send(&mut request).unwrap();
        assert_eq!(one_completion(&mut cq).wr_id(), 3);

        let wc = one_completion(&mut scq);
        assert_eq!(wc.imm(), Some(qp.qpn()));
        assert_eq!(wc.src_qp(), qp.qpn());
        let payload = datagram_payload(&wc).unwrap();
        let mut got = vec![0; payload.len()];
        smr.read(payload.start, &mut got).unwrap();
        assert_eq!(got, b"ping");
        let mut grh = [0; GRH_BYTES];
        smr.read(0, &mut grh).unwrap();
        let to_client = sqp.reply_destination(&wc, &grh).unwrap();
        let mut answer = UdSend::inline(4, b"pong", &to_client).unwrap().signaled();
        sqp.post_send(&mut answer).unwrap();
        assert_eq!(one_completion(&mut scq).wr_id(), 4);

        let wc = one_completion(&mut cq);
        assert_eq!(wc.wr_id(), 1);
        let payload = datagram_payload(&wc).unwrap();
        let mut got = vec![0; payload.len()];
        mr.read(payload.start, &mut got).unwrap();
        assert_eq!(got, b"pong");
    }
}

verbs_test! {
    /// A datagram id takes only a UD QP with rdma_cm's Q_Key, a reliable id
    /// only an RC QP, and only a datagram id's Established carries a peer.
    fn datagram_and_reliable_ids_refuse_each_others_calls() {
        let at = addr();
        let channel = EventChannel::new().unwrap();
        let ud = resolved(&channel, at);
        let ctx = ud.context().unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(16, None).unwrap();
        assert!(matches!(
            ud.create_qp(&pd, &cq, &cq, &QpConfig::default()),
            Err(Error::InvalidArgument(_))
        ));
        let other_qkey = UdConfig { qkey: 0x1111, ..UdConfig::default() };
        assert!(matches!(
            ud.create_ud_qp(&pd, &cq, &cq, &other_qkey),
            Err(Error::InvalidArgument(_))
        ));
        let qp = ud.create_ud_qp(&pd, &cq, &cq, &UdConfig::default()).unwrap();
        assert_eq!(qp.port(), ud.port().unwrap());

        let mut rc = channel.create_id().unwrap();
        assert!(!rc.is_datagram());
        rc.resolve_addr(None, addr(), T).unwrap();
        let event = channel.expect(&rc, CmEventKind::AddrResolved, T).unwrap();
        assert!(matches!(event.ud_destination(&qp), Err(Error::InvalidArgument(_))));
        drop(event);
        assert!(matches!(
            rc.create_ud_qp(&pd, &cq, &cq, &UdConfig::default()),
            Err(Error::InvalidArgument(_))
        ));
        // A QP of another id is not this one's to connect.
        let mut other = resolved(&channel, at);
        assert!(matches!(other.connect_ud(&qp, &[]), Err(Error::InvalidArgument(_))));
        assert!(matches!(
            other.connect_ud(&qp, &[0; 181]),
            Err(Error::InvalidArgument(_))
        ));
    }
}

verbs_test! {
    /// With nothing listening, or a listener that says no, the answer to a
    /// datagram connect is Unreachable; a datagram request's reject carries
    /// at most 136 bytes; a datagram id has no connection to end.
    fn a_datagram_connect_nobody_takes_is_unreachable() {
        let channel = EventChannel::new().unwrap();
        let mut id = resolved(&channel, addr());
        let ctx = id.context().unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(16, None).unwrap();
        let qp = id.create_ud_qp(&pd, &cq, &cq, &UdConfig::default()).unwrap();
        id.connect_ud(&qp, &[]).unwrap();
        let unreachable = |result: Result<_, Error>| {
            matches!(
                result,
                Err(Error::Cm {
                    cause: CmFailure::Event { got: CmEventKind::Unreachable, .. },
                    ..
                })
            )
        };
        assert!(unreachable(channel.expect(&id, CmEventKind::Established, T)), "no listener");
        assert!(matches!(id.disconnect(), Err(Error::InvalidArgument(_))));

        let at = addr();
        let server_channel = EventChannel::new().unwrap();
        let mut listener = server_channel.create_ud_id().unwrap();
        listener.bind(at).unwrap();
        listener.listen(4).unwrap();
        let mut id = resolved(&channel, at);
        let ctx = id.context().unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(16, None).unwrap();
        let qp = id.create_ud_qp(&pd, &cq, &cq, &UdConfig::default()).unwrap();
        id.connect_ud(&qp, &[]).unwrap();
        let mut event = server_channel
            .expect(&listener, CmEventKind::ConnectRequest, T)
            .unwrap();
        let request = event.take_request().expect("a request carries its id");
        drop(event);
        // Refused before anything goes out; the request, dropped, says no.
        assert!(matches!(request.reject(&[0; 137]), Err(Error::InvalidArgument(_))));
        assert!(unreachable(channel.expect(&id, CmEventKind::Established, T)), "refused");
    }
}

verbs_test! {
    /// mckey's join: the MulticastJoin event attaches the QP and gives the
    /// group's destination; the QP joins a group one way only; a leave
    /// while the group's event is held ends the membership when that event
    /// goes; the QP's drop leaves what it still holds.
    fn a_qp_joins_a_group_through_the_connection_manager_and_leaves_it() {
        let channel = EventChannel::new().unwrap();
        let mut id = channel.create_ud_id().unwrap();
        let group = IpAddr::from([239, 1, 2, 3]);
        let gid = Gid::from_ipv4(Ipv4Addr::new(239, 1, 2, 3));
        id.resolve_addr(Some(SocketAddr::from(([10, 77, 0, 1], 0))), SocketAddr::new(group, 0), T)
            .unwrap();
        channel.expect(&id, CmEventKind::AddrResolved, T).unwrap();
        let ctx = id.context().unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(16, None).unwrap();
        let mut qp = id.create_ud_qp(&pd, &cq, &cq, &UdConfig::default()).unwrap();
        assert!(matches!(
            id.join_multicast(&mut qp, IpAddr::from([10, 77, 0, 9])),
            Err(Error::InvalidArgument(_))
        ), "not a group");

        id.join_multicast(&mut qp, group).unwrap();
        assert!(matches!(id.join_multicast(&mut qp, group), Err(Error::InvalidArgument(_))), "joined already");
        let joined = channel.expect(&id, CmEventKind::MulticastJoin, T).unwrap();
        assert_eq!(joined.group(), Some(group));
        assert!(joined.private_data().is_empty());
        assert!(matches!(joined.ud_destination(&qp), Err(Error::InvalidArgument(_))));
        let to_group = joined.attach_group(&mut qp).unwrap();
        assert_eq!((to_group.qpn(), to_group.qkey()), (0x00ff_ffff, RDMA_UDP_QKEY));
        drop(joined);
        // Each way of joining has its own leave, and a group is joined one way.
        assert!(matches!(qp.leave(gid), Err(Error::InvalidArgument(_))));
        assert!(matches!(qp.join(gid), Err(Error::InvalidArgument(_))));
        id.leave_multicast(&mut qp, group).unwrap();
        assert!(matches!(id.leave_multicast(&mut qp, group), Err(Error::InvalidArgument(_))), "left already");

        // Left while its event is held: the event's drop leaves it (a leave
        // then would wait for the acknowledgement, here for ever).
        id.join_multicast(&mut qp, group).unwrap();
        let joined = channel.expect(&id, CmEventKind::MulticastJoin, T).unwrap();
        id.leave_multicast(&mut qp, group).unwrap();
        assert!(matches!(joined.attach_group(&mut qp), Err(Error::InvalidArgument(_))), "left");
        // The id holds the group until the event goes: joining it again now
        // would let the pending leave end the new membership.
        assert!(
            matches!(id.join_multicast(&mut qp, group), Err(Error::InvalidArgument(_))),
            "the leave is pending"
        );
        drop(joined);

        // Joined with the verbs, left with the verbs.
        qp.join(gid).unwrap();
        assert!(matches!(id.leave_multicast(&mut qp, group), Err(Error::InvalidArgument(_))));
        qp.leave(gid).unwrap();

        // A QP of another id, and a reliable id, are refused.
        let mut other = channel.create_ud_id().unwrap();
        other.resolve_addr(Some(SocketAddr::from(([10, 77, 0, 1], 0))), SocketAddr::new(group, 0), T)
            .unwrap();
        channel.expect(&other, CmEventKind::AddrResolved, T).unwrap();
        assert!(matches!(other.join_multicast(&mut qp, group), Err(Error::InvalidArgument(_))));
        let rc = channel.create_id().unwrap();
        assert!(matches!(rc.join_multicast(&mut qp, group), Err(Error::InvalidArgument(_))));

        // Joined again and left by the QP's drop; then the id goes too.
        id.join_multicast(&mut qp, group).unwrap();
        channel
            .expect(&id, CmEventKind::MulticastJoin, T)
            .unwrap()
            .attach_group(&mut qp)
            .unwrap();
        drop(qp);
        drop(id);
    }
}
