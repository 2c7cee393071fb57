//! The connection manager (`verbs::cm`) in one process: both sides of a
//! connection over rxe0 at 10.77.0.1, each on a channel of its own.
//!
//! Gating: `verbs_test!` (tools/test runs these in the Soft-RoCE guest,
//! which has rdma_ucm loaded).

mod util;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::Duration;

use rdma_comm_core::Error;
use rdma_comm_core::verbs::cm::{
    self, CmEventKind, CmFailure, CmId, EventChannel, MAX_ACCEPT_PRIVATE_DATA,
    MAX_CONNECT_PRIVATE_DATA,
};
use rdma_comm_core::verbs::*;
use util::{open_device, pattern, wait_ok};

const T: Duration = Duration::from_secs(10);

fn addr() -> SocketAddr {
    static NEXT: AtomicU16 = AtomicU16::new(7400);
    SocketAddr::from(([10, 77, 0, 1], NEXT.fetch_add(1, Ordering::Relaxed)))
}

/// One side: its channel (the server's is its listener's, which a
/// request's id shares), id, QP, CQ and a 4 KiB buffer.
struct Side {
    channel: EventChannel,
    id: Option<CmId>,
    qp: QueuePair,
    cq: CompletionQueue,
    mr: MemoryRegion,
}

fn resources(ctx: &Context) -> (ProtectionDomain, CompletionQueue) {
    (ctx.alloc_pd().unwrap(), ctx.create_cq(64, None).unwrap())
}

/// A client id with its address and route resolved.
fn resolved(to: SocketAddr) -> (EventChannel, CmId) {
    let channel = EventChannel::new().unwrap();
    let mut id = channel.create_id().unwrap();
    id.resolve_addr(None, to, T).unwrap();
    channel.expect(&id, CmEventKind::AddrResolved, T).unwrap();
    id.resolve_route(T).unwrap();
    channel.expect(&id, CmEventKind::RouteResolved, T).unwrap();
    (channel, id)
}

fn listening(at: SocketAddr) -> (EventChannel, CmId) {
    let channel = EventChannel::new().unwrap();
    let mut id = channel.create_id().unwrap();
    id.bind(at).unwrap();
    id.listen(8).unwrap();
    (channel, id)
}

/// Connects a client to a fresh listener with the given private data;
/// returns the client, the server, the listening id and what each side
/// received.
fn connected(client_data: &[u8], server_data: &[u8]) -> (Side, Side, CmId, Vec<u8>, Vec<u8>) {
    let at = addr();
    let listener = listening(at);
    let (channel, mut id) = resolved(at);
    let ctx = id.context().unwrap();
    assert!(ctx.is_lent());
    let (pd, cq) = resources(&ctx);
    let mut qp = id.create_qp(&pd, &cq, &cq, &util::remote_config()).unwrap();
    let mr = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    qp.post_recv(&mut RecvRequest::new(1, mr.slice(0, 4096).unwrap()).unwrap())
        .unwrap();
    id.connect(&qp, client_data).unwrap();

    let mut event = listener
        .0
        .expect(&listener.1, CmEventKind::ConnectRequest, T)
        .unwrap();
    let request = event
        .take_request()
        .expect("a connect request carries its id");
    assert!(event.take_request().is_none(), "taken once");
    drop(event);
    let got_by_server = request.private_data().to_vec();
    assert_eq!(request.peer_addr().map(|a| a.ip()), Some(at.ip()));
    let server_ctx = request.id().context().unwrap();
    let (spd, scq) = resources(&server_ctx);
    let mut sqp = request
        .id()
        .create_qp(&spd, &scq, &scq, &QpConfig::default())
        .unwrap();
    let smr = spd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    sqp.post_recv(&mut RecvRequest::new(2, smr.slice(0, 4096).unwrap()).unwrap())
        .unwrap();
    let sid = request.accept(&mut sqp, server_data).unwrap();

    let response = channel
        .expect(&id, CmEventKind::ConnectResponse, T)
        .unwrap();
    let got_by_client = response.private_data().to_vec();
    drop(response);
    id.establish(&mut qp).unwrap();
    listener
        .0
        .expect(&sid, CmEventKind::Established, T)
        .unwrap();
    let (lchannel, listener) = listener;
    let server = Side {
        channel: lchannel,
        id: Some(sid),
        qp: sqp,
        cq: scq,
        mr: smr,
    };
    let client = Side {
        channel,
        id: Some(id),
        qp,
        cq,
        mr,
    };
    (client, server, listener, got_by_client, got_by_server)
}

impl Side {
    fn id(&mut self) -> &mut CmId {
        self.id.as_mut().expect("the id is still here")
    }

    #[track_caller]
    fn expect(&mut self, kind: CmEventKind) {
        let id = self.id.as_ref().expect("the id is still here");
        self.channel.expect(id, kind, T).unwrap();
    }
}

/// SENDs `data` from `from` to `to` and checks what arrived.
fn send(from: &mut Side, to: &mut Side, wr_id: u64, data: &[u8]) {
    from.mr.write(2048, data).unwrap();
    from.qp
        .post_send(
            &mut WorkRequest::send(wr_id, from.mr.slice(2048, data.len()).unwrap()).signaled(),
        )
        .unwrap();
    wait_ok(&mut from.cq);
    let wc = wait_ok(&mut to.cq);
    assert_eq!(wc.byte_len() as usize, data.len());
    assert_eq!(util::read_back(&to.mr, 0, data.len()), data);
    to.qp
        .post_recv(&mut RecvRequest::new(wr_id, to.mr.slice(0, 2048).unwrap()).unwrap())
        .unwrap();
}

verbs_test! {
    /// Private data both ways at the spec's limits, RTS on both sides, a
    /// SEND each way through our own QPs, and a disconnect both see.
    fn connect_accept_send_disconnect() {
        let request_data = pattern(1, MAX_CONNECT_PRIVATE_DATA);
        let accept_data = pattern(2, MAX_ACCEPT_PRIVATE_DATA);
        let (mut client, mut server, _listener, got_by_client, got_by_server) =
            connected(&request_data, &accept_data);
        assert_eq!(&got_by_server[..request_data.len()], request_data);
        assert_eq!(&got_by_client[..accept_data.len()], accept_data);
        assert_eq!(client.qp.state().unwrap(), QpState::ReadyToSend);
        assert_eq!(server.qp.state().unwrap(), QpState::ReadyToSend);
        send(&mut client, &mut server, 10, b"ping over rdma_cm");
        send(&mut server, &mut client, 11, b"pong");

        // Calls out of order are refused before they touch the working QP.
        let again = client.id.as_mut().unwrap().establish(&mut client.qp);
        assert!(matches!(again, Err(Error::InvalidArgument(_))), "{again:?}");
        let again = client.id.as_mut().unwrap().connect(&client.qp, b"");
        assert!(matches!(again, Err(Error::InvalidArgument(_))), "{again:?}");
        assert_eq!(client.qp.state().unwrap(), QpState::ReadyToSend);
        send(&mut client, &mut server, 12, b"still connected");

        // The DREQ reaches the server; its own disconnect answers it (DREP),
        // which is the client's Disconnected.
        client.id().disconnect().unwrap();
        server.expect(CmEventKind::Disconnected);
        server.id().disconnect().unwrap();
        client.expect(CmEventKind::Disconnected);
    }
}

verbs_test! {
    /// A reject's reason and private data reach the client as a typed error.
    fn reject_is_typed_with_its_private_data() {
        let at = addr();
        let (lchannel, listener) = listening(at);
        let (channel, mut id) = resolved(at);
        let ctx = id.context().unwrap();
        let (pd, cq) = resources(&ctx);
        let qp = id.create_qp(&pd, &cq, &cq, &QpConfig::default()).unwrap();
        id.connect(&qp, b"may I?").unwrap();
        let mut event = lchannel.expect(&listener, CmEventKind::ConnectRequest, T).unwrap();
        let request = event.take_request().unwrap();
        assert_eq!(&request.private_data()[..6], b"may I?");
        request.reject(b"go away").unwrap();

        let event = channel.get_event(Some(T)).unwrap().expect("the reject arrives");
        assert_eq!(event.kind(), CmEventKind::Rejected);
        assert!(event.is_for(&id));
        assert_eq!(event.status(), 28, "consumer-defined reject");
        assert_eq!(&event.private_data()[..7], b"go away");

        // Through expect, the same is an Error::Cm naming the op and peer.
        let (channel, mut id) = resolved(at);
        let ctx = id.context().unwrap();
        let (pd, cq) = resources(&ctx);
        let qp = id.create_qp(&pd, &cq, &cq, &QpConfig::default()).unwrap();
        id.connect(&qp, &[]).unwrap();
        let mut event = lchannel.expect(&listener, CmEventKind::ConnectRequest, T).unwrap();
        drop(event.take_request()); // dropped unanswered: rejected too
        let err = channel.expect(&id, CmEventKind::ConnectResponse, T).unwrap_err();
        match &err {
            Error::Cm { op, peer, cause: CmFailure::Event { got, expected, .. } } => {
                assert_eq!(*op, "rdma_connect");
                assert_eq!(*peer, Some(at));
                assert_eq!(*got, CmEventKind::Rejected);
                assert_eq!(*expected, Some(CmEventKind::ConnectResponse));
            }
            other => panic!("not a typed reject: {other}"),
        }
        assert!(err.to_string().contains("RDMA_CM_EVENT_REJECTED"), "{err}");
    }
}

verbs_test! {
    /// Misuse the types cannot rule out is refused before anything is sent.
    fn misuse_is_refused_with_typed_errors() {
        let channel = EventChannel::new().unwrap();
        let mut unbound = channel.create_id().unwrap();
        assert!(matches!(unbound.context(), Err(Error::InvalidArgument(_))));
        assert!(matches!(unbound.resolve_route(T), Err(Error::InvalidArgument(_))));
        assert_eq!(unbound.port(), None);

        let at = addr();
        let (_lchannel, _listener) = listening(at);
        let (_channel, mut id) = resolved(at);
        // A PD of a context we opened ourselves is another context than the id's.
        let own = open_device();
        assert!(!own.is_lent());
        let (own_pd, own_cq) = resources(&own);
        let err = id.create_qp(&own_pd, &own_cq, &own_cq, &QpConfig::default()).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");

        let ctx = id.context().unwrap();
        let (pd, cq) = resources(&ctx);
        let qp = id.create_qp(&pd, &cq, &cq, &QpConfig::default()).unwrap();
        let too_long = vec![0u8; MAX_CONNECT_PRIVATE_DATA + 1];
        assert!(matches!(id.connect(&qp, &too_long), Err(Error::InvalidArgument(_))));
        // A QP that was not created on this id.
        let (_c2, other) = resolved(at);
        let stranger = other.create_qp(&pd, &cq, &cq, &QpConfig::default()).unwrap();
        assert!(matches!(id.connect(&stranger, &[]), Err(Error::InvalidArgument(_))));
    }
}

verbs_test! {
    /// librdmacm's context of the device serves every id on it: one PD for
    /// all connections of a server.
    fn open_device_is_the_ids_context() {
        let name = open_device().name().to_string();
        let shared = cm::open_device(&name).unwrap();
        assert!(shared.is_lent());
        let at = addr();
        let (_lchannel, _listener) = listening(at);
        let (_channel, id) = resolved(at);
        assert!(shared.same_context(&id.context().unwrap()));
        let (pd, cq) = resources(&shared);
        drop(shared); // the PD keeps the context open
        id.create_qp(&pd, &cq, &cq, &QpConfig::default()).unwrap();
        assert!(cm::open_device("no-such-device").is_err());
    }
}

verbs_test! {
    /// The QP holds its id: dropping the id's handle leaves the connection
    /// up (SENDs still flow, the peer sees no disconnect); dropping the QP
    /// then destroys the id, and the peer sees the disconnect.
    fn the_id_outlives_its_qp() {
        let (mut client, mut server, _listener, _, _) = connected(&[], &[]);
        drop(client.id.take());
        send(&mut client, &mut server, 20, b"still connected");
        send(&mut server, &mut client, 21, b"yes");
        assert!(
            server.channel.get_event(Some(Duration::from_millis(300))).unwrap().is_none(),
            "the server saw an event while the client's QP still holds its id"
        );
        drop(client);
        server.expect(CmEventKind::Disconnected);
    }
}
