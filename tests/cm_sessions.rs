//! Sessions over the RDMA connection manager (`Transport::RdmaCm`) on rxe0
//! at 10.77.0.1: the handshake on the control QP (exports, authentication),
//! the goodbye and a killed peer reported through the connection manager,
//! a request without the session tag refused before anything is made, a
//! client that starts before its server, and `ping_pong --cm` end to end.
//! Gated as described in `tests/util/mod.rs`: runs in the Soft-RoCE guest.

mod util;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU16, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use rdma_comm_core::Error;
use rdma_comm_core::session::wire::{Hello, MAGIC, Message, VERSION, WireError};
use rdma_comm_core::session::*;
use rdma_comm_core::verbs::cm::{CmEventKind, CmId, EventChannel};
use rdma_comm_core::verbs::*;
use util::process::Proc;
use util::*;

/// A fresh rdma_cm port on rxe0's address for each use.
fn addr() -> SocketAddr {
    static NEXT: AtomicU16 = AtomicU16::new(7600);
    SocketAddr::from(([10, 77, 0, 1], NEXT.fetch_add(1, Ordering::Relaxed)))
}

fn server_config() -> ServerConfig {
    ServerConfig {
        transport: Transport::RdmaCm,
        ..ServerConfig::insecure_open()
    }
}

fn client_config() -> ClientConfig {
    let mut config = ClientConfig::new(vec![QpSpec::new("data")]).with_transport(Transport::RdmaCm);
    config.connect_deadline = Duration::from_secs(20);
    config
}

fn key(byte: u8) -> AuthKey {
    AuthKey::new(&[byte; 32]).unwrap()
}

/// Polls `check_peer` until it reports something, within the deadline.
#[track_caller]
fn peer_status(endpoint: &mut Endpoint) -> PeerStatus {
    let start = Instant::now();
    loop {
        match endpoint.check_peer() {
            PeerStatus::Alive if start.elapsed() < DEADLINE => {
                thread::sleep(Duration::from_millis(10))
            }
            status => return status,
        }
    }
}

verbs_test! {
    fn a_session_over_rdma_cm_writes_into_exports_and_says_goodbye_with_a_code() {
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        let inbox = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND).unwrap();
        let export = inbox.registration().clone();
        let mut config = server_config();
        config.qp.remote_access = AccessFlags::REMOTE_WRITE;
        config.auth_key = Some(key(7));
        config.insecure_open = false;
        config.exports = Some(Arc::new(move |_, _: &ProtectionDomain| {
            Ok(vec![Export::new(1, "inbox", export.clone(), AccessFlags::REMOTE_WRITE)])
        }));
        let server = ServerSession::bind(addr(), &pd, config).unwrap();
        let at = server.local_addr();
        assert_eq!(at.ip(), addr().ip(), "bound where asked");

        let client_pd = pd.clone();
        let client = thread::spawn(move || {
            ClientSession::connect(at, &client_pd, &client_config().with_auth_key(Some(key(7))))
        });
        let mut served = server.accept_timeout(DEADLINE).expect("the server's endpoint");
        let mut client = client.join().unwrap().expect("the client connects over rdma_cm");
        assert_eq!(client.peer().ip(), at.ip(), "the client's peer is the server's address");
        assert_eq!(served.peer().ip(), at.ip(), "the server's peer is the client's address");

        // Both directions, then a WRITE into the exported inbox.
        exchange(&pd, &mut client, &mut served, b"hello over the connection manager");
        exchange(&pd, &mut served, &mut client, b"and back");
        let target = client.remote_region("inbox").expect("the server's export arrived");
        let mut tx = pd.alloc_mr(64, AccessFlags::empty()).unwrap();
        tx.write(0, b"written through the window").unwrap();
        let qp = client.qp_at(0).unwrap();
        qp.qp_mut()
            .post_send(&mut WorkRequest::write(3, tx.slice(0, 26).unwrap(), target.slice(0, 26).unwrap()).unwrap().signaled())
            .unwrap();
        wait_ok(qp.cq_mut().unwrap());
        assert_eq!(read_back(&inbox, 0, 26), b"written through the window");

        // Nothing reported while both live; then the client's goodbye.
        assert!(matches!(served.check_peer(), PeerStatus::Alive));
        assert!(client.send_disconnect(42), "the goodbye was acknowledged");
        drop(client);
        match peer_status(&mut served) {
            PeerStatus::Disconnected { code } => assert_eq!(code, 42),
            other => panic!("expected the goodbye with its code, got {other:?}"),
        }
    }
}

verbs_test! {
    fn a_wrong_key_is_refused_and_a_request_without_the_tag_gets_nothing() {
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        let mut config = server_config();
        config.auth_key = Some(key(1));
        config.insecure_open = false;
        let server = ServerSession::bind(addr(), &pd, config).unwrap();
        let at = server.local_addr();

        let wrong = ClientSession::connect(at, &pd, &client_config().with_auth_key(Some(key(2))));
        assert!(matches!(wrong, Err(Error::Unauthenticated { .. })), "{wrong:?}");
        let missing = ClientSession::connect(at, &pd, &client_config());
        assert!(matches!(missing, Err(Error::Unauthenticated { .. })), "{missing:?}");

        // A plain rdma_cm peer (rping's request, say) carries no tag: it is
        // rejected at once with the tag and BAD_REQUEST, and holds nothing.
        let RawClient { channel, mut id, qp, .. } = raw_client(at);
        id.connect(&qp, b"not a session").unwrap();
        let answer = channel.get_event(Some(DEADLINE)).unwrap().expect("an answer");
        assert_eq!(answer.kind(), CmEventKind::Rejected);
        let data = answer.private_data();
        assert_eq!(&data[8..10], &reject_code::BAD_REQUEST.to_be_bytes(), "{data:?}");
        // Recorded before the refusal went out.
        let failures = server.take_failures();
        assert!(
            failures.iter().any(|f| f.error.to_string().contains("without the session tag")),
            "{failures:?}"
        );

        // The right key still gets in afterwards.
        let client_pd = pd.clone();
        let good = thread::spawn(move || {
            ClientSession::connect(at, &client_pd, &client_config().with_auth_key(Some(key(1))))
        });
        let mut served = server.accept_timeout(DEADLINE).expect("the good client's endpoint");
        let mut client = good.join().unwrap().expect("the right key connects");
        exchange(&pd, &mut client, &mut served, b"authenticated");
    }
}

verbs_test! {
    fn a_client_that_starts_first_waits_for_its_server() {
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        let at = addr();
        let client_pd = pd.clone();
        let started = Instant::now();
        let client = thread::spawn(move || ClientSession::connect(at, &client_pd, &client_config()));
        thread::sleep(Duration::from_millis(700));
        let server = ServerSession::bind(at, &pd, server_config()).unwrap();
        let mut served = server.accept_timeout(DEADLINE).expect("the late server's endpoint");
        let mut client = client.join().unwrap().expect("the client retried until the server listened");
        assert!(started.elapsed() >= Duration::from_millis(700));
        exchange(&pd, &mut client, &mut served, b"late but fine");
    }
}

/// The deadline of a [`slow_admitting_server`]'s handshakes, and how long
/// its slow admissions take.
const SLOW_DEADLINE: Duration = Duration::from_secs(2);
const SLOW_ADMISSION: Duration = Duration::from_millis(2500);

/// A server over `transport` whose admission callback sleeps through its
/// handshake deadline on the calls `slow` picks (then admits, or with
/// `refuse`, refuses): without `refuse` it cuts those handshakes without a
/// word, as one whose deadline ran out while its client was slow. Returns
/// the server and the number of calls so far.
fn slow_admitting_server(
    pd: &ProtectionDomain,
    transport: Transport,
    slow: fn(usize) -> bool,
    refuse: bool,
) -> (ServerSession, Arc<AtomicUsize>) {
    let calls = Arc::new(AtomicUsize::new(0));
    let seen = Arc::clone(&calls);
    let config = ServerConfig {
        transport,
        handshake_timeout: SLOW_DEADLINE,
        authorize: Some(Arc::new(move |_: &PeerHello| {
            if slow(seen.fetch_add(1, Ordering::SeqCst)) {
                thread::sleep(SLOW_ADMISSION);
                if refuse {
                    return Err(Refusal::unauthorized("too late and not welcome"));
                }
            }
            Ok(())
        })),
        ..ServerConfig::insecure_open()
    };
    let at = match transport {
        Transport::Tcp => "127.0.0.1:0".parse().unwrap(),
        Transport::RdmaCm => addr(),
    };
    (ServerSession::bind(at, pd, config).unwrap(), calls)
}

/// A cut before our `Ready`, as the client reports it over rdma_cm: the
/// peer's disconnect, as a reset connection.
fn is_cut(err: &Error) -> bool {
    matches!(err, Error::Handshake { source: WireError::Io(io), .. }
        if io.kind() == std::io::ErrorKind::ConnectionReset && io.to_string().contains("RDMA_CM_EVENT_DISCONNECTED"))
}

verbs_test! {
    /// Over the connection manager as over TCP, a handshake the server cut
    /// without a word before our `Ready` is tried again within the connect
    /// deadline; a server that keeps cutting leaves the client with an
    /// error at the deadline, and one that cut and stopped listening with
    /// the cut, at once.
    fn a_handshake_the_server_cut_is_tried_again_over_rdma_cm() {
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        let (server, calls) = slow_admitting_server(&pd, Transport::RdmaCm, |call| call == 0, false);
        let mut client = ClientSession::connect(server.local_addr(), &pd, &client_config()).expect("connected on a later try");
        let mut served = server.accept_timeout(DEADLINE).expect("the server's side");
        // (A loaded guest may take a later handshake past the deadline too.)
        assert!(calls.load(Ordering::SeqCst) >= 2, "the cut handshake was tried again");
        exchange(&pd, &mut client, &mut served, b"after a cut");
        // The cut handshake is counted once its thread has cleaned up,
        // which may come after the disconnect the client acted on.
        let waited = Instant::now();
        while server.failed_handshakes() == 0 && waited.elapsed() < DEADLINE {
            thread::sleep(Duration::from_millis(10));
        }
        let failures = server.take_failures();
        assert!(!failures.is_empty() && failures.iter().all(|f| f.error.to_string().contains("timed out")), "{failures:?}");
        assert!(server.try_accept().is_none(), "one session for one connect");
        drop((client, served, server));

        let (server, calls) = slow_admitting_server(&pd, Transport::RdmaCm, |_| true, false);
        let mut config = client_config();
        config.connect_deadline = Duration::from_secs(6);
        let started = Instant::now();
        // The last try ends at the connect deadline however far it got (cut,
        // timed out waiting, still resolving or connecting): what counts
        // is that the cuts were tried again, and for how long.
        let err = ClientSession::connect(server.local_addr(), &pd, &config).unwrap_err();
        let took = started.elapsed();
        assert!(calls.load(Ordering::SeqCst) >= 2, "tried again: {err}");
        // Two cut tries take at least two server deadlines; the last ends
        // at the connect deadline (plus a frame's 200 ms).
        assert!(took >= 2 * SLOW_DEADLINE && took < Duration::from_secs(12), "gave up near the deadline: {took:?}: {err}");
        drop(server);

        // The server goes away while it admits the first try: the client's
        // one reconnect finds nobody listening and reports the cut.
        let (server, calls) = slow_admitting_server(&pd, Transport::RdmaCm, |_| true, false);
        let at = server.local_addr();
        config.connect_deadline = Duration::from_secs(30);
        let client_pd = pd.clone();
        let started = Instant::now();
        let client = thread::spawn(move || ClientSession::connect(at, &client_pd, &config));
        while calls.load(Ordering::SeqCst) == 0 && started.elapsed() < DEADLINE {
            thread::sleep(Duration::from_millis(10));
        }
        drop(server);
        let err = client.join().unwrap().unwrap_err();
        assert!(is_cut(&err), "the cut, not the refused reconnect: {err}");
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        assert!(started.elapsed() < Duration::from_secs(15), "not the whole deadline: {:?}", started.elapsed());
    }
}

verbs_test! {
    /// A refusal the server makes after its handshake deadline (a slow
    /// `authorize` that then says no) still reaches the client, over TCP
    /// and over the connection manager: the client reports it and does not
    /// take the disconnect after it for a cut to try again.
    fn a_refusal_made_after_the_deadline_is_read_not_retried() {
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        for transport in [Transport::Tcp, Transport::RdmaCm] {
            let (server, calls) = slow_admitting_server(&pd, transport, |_| true, true);
            let err = ClientSession::connect(server.local_addr(), &pd, &client_config().with_transport(transport)).unwrap_err();
            assert!(
                matches!(&err, Error::Rejected { code, reason, .. } if *code == reject_code::UNAUTHORIZED && reason.contains("not welcome")),
                "{transport:?}: {err}"
            );
            assert_eq!(calls.load(Ordering::SeqCst), 1, "{transport:?}: not tried again");
        }
    }
}

verbs_test! {
    fn ping_pong_over_cm_verifies_round_trips_and_names_a_killed_peer() {
        let at = addr().to_string();
        let mut server = Proc::spawn(
            "ping_pong",
            &["--server", "--cm", "--listen", &at, "--reactors", "1"],
        );
        server.expect_line("listening on ");
        let ok = |iters: &str| {
            Proc::spawn("ping_pong", &["--connect", &at, "--cm", "--iters", iters, "--size", "64", "--op", "both"])
        };
        let mut client = ok("300");
        client.expect_line("300 round trips, 0 mismatches");
        server.expect_line("done: 300 messages verified and echoed");

        // A client killed mid-run: its process's exit tears its rdma_cm id
        // down, and the server hears of it as a disconnect.
        let mut victim = ok("100000000");
        // The victim's own line: the first client's matched already. Killed
        // before its handshake ends, it would be a failed handshake, not a
        // peer lost mid-run.
        server.expect_lines(" connected", 2);
        thread::sleep(Duration::from_millis(500));
        let killed = Instant::now();
        victim.child.kill().unwrap();
        let line = server.expect_line("error");
        println!("killed client reported after {:?}: {line}", killed.elapsed());
        // "peer 10.77.0.1:PORT error: ...": the client's own rdma_cm port,
        // not the server's.
        let named: SocketAddr = line
            .split_whitespace()
            .nth(1)
            .and_then(|peer| peer.parse().ok())
            .unwrap_or_else(|| panic!("the error names the peer: {line}"));
        assert_eq!(named.ip(), addr().ip());
        assert_ne!(named.port(), at.parse::<SocketAddr>().unwrap().port(), "{line}");

        // And the server goes on serving.
        let mut after = ok("200");
        after.expect_line("200 round trips, 0 mismatches");
    }
}

/// A plain rdma_cm client, resolved to `at`, with a QP on its id.
struct RawClient {
    channel: EventChannel,
    id: CmId,
    qp: QueuePair,
    cq: CompletionQueue,
    pd: ProtectionDomain,
}

fn raw_client(at: SocketAddr) -> RawClient {
    let channel = EventChannel::new().unwrap();
    let mut id = channel.create_id().unwrap();
    id.resolve_addr(None, at, DEADLINE).unwrap();
    drop(
        channel
            .expect(&id, CmEventKind::AddrResolved, DEADLINE)
            .unwrap(),
    );
    id.resolve_route(DEADLINE).unwrap();
    drop(
        channel
            .expect(&id, CmEventKind::RouteResolved, DEADLINE)
            .unwrap(),
    );
    let ctx = id.context().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(16, None).unwrap();
    let qp = id.create_qp(&pd, &cq, &cq, &QpConfig::default()).unwrap();
    RawClient {
        channel,
        id,
        qp,
        cq,
        pd,
    }
}

/// The 8-byte tag a session's connect request carries.
fn tag() -> [u8; 8] {
    let (magic, version) = (MAGIC.to_be_bytes(), VERSION.to_be_bytes());
    [
        magic[0], magic[1], magic[2], magic[3], b'C', b'M', version[0], version[1],
    ]
}

/// A stranger that knows the tag: its request is accepted, then it posts
/// no receive, so our answer waits in RNR retries, and sends `frames`.
fn stalling_stranger(
    at: SocketAddr,
    frames: &[Vec<u8>],
) -> (EventChannel, CmId, QueuePair, MemoryRegion) {
    let RawClient {
        channel,
        mut id,
        mut qp,
        mut cq,
        pd,
    } = raw_client(at);
    id.connect(&qp, &tag()).unwrap();
    drop(
        channel
            .expect(&id, CmEventKind::ConnectResponse, DEADLINE)
            .unwrap(),
    );
    id.establish(&mut qp).unwrap();
    let mut mr = pd.alloc_mr(1 << 16, AccessFlags::empty()).unwrap();
    for (i, frame) in frames.iter().enumerate() {
        mr.write(0, frame).unwrap();
        qp.post_send(
            &mut WorkRequest::send(i as u64, mr.slice(0, frame.len()).unwrap()).signaled(),
        )
        .unwrap();
        wait_ok(&mut cq);
    }
    (channel, id, qp, mr)
}

/// Held by the tests whose strangers stall answers in RNR retry: the drop
/// test watches the device-wide RNR counter for its own stranger's NAK.
static STALLING: Mutex<()> = Mutex::new(());

verbs_test! {
    /// Dropping the server cuts a handshake whose answer waits in RNR retry
    /// (the stranger posts no receive) within the 200 ms a frame in flight
    /// gets, not at the handshake's deadline.
    fn dropping_the_server_cuts_a_stalled_answer_at_once() {
        let _alone = STALLING.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        let mut config = server_config();
        config.hello_timeout = Duration::from_secs(20);
        config.handshake_timeout = Duration::from_secs(20);
        let server = ServerSession::bind(addr(), &pd, config).unwrap();
        let hello = Message::Hello(Hello { nonce: [0; 32], identity: "stranger".into(), qps: vec!["data".into()] })
            .encode()
            .unwrap();
        let (rnr_naks, _) = rnr_counters(ctx.name());
        let stranger = stalling_stranger(server.local_addr(), &[hello]);
        // The server's challenge is posted once the stranger's hello is in,
        // and waits in RNR retry: the device counts the stranger's NAK.
        let waited = Instant::now();
        while rnr_counters(ctx.name()).0 == rnr_naks && waited.elapsed() < DEADLINE {
            thread::sleep(Duration::from_millis(10));
        }
        assert!(rnr_counters(ctx.name()).0 > rnr_naks, "the server's answer never met the stranger's missing receive");
        assert_eq!(server.pending_handshakes(), 1);
        let started = Instant::now();
        drop(server);
        let took = started.elapsed();
        // Far below the 20 s deadline it once waited for (19.5 s), with
        // room for a slow guest's rdma_cm and QP teardown.
        assert!(took < Duration::from_secs(8), "dropping the server took {took:?}");
        drop(stranger);
    }
}

verbs_test! {
    fn a_stranger_that_stalls_our_answers_is_cut_off_at_the_hello_deadline() {
        let _alone = STALLING.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        let mut config = server_config();
        config.hello_timeout = Duration::from_secs(1);
        // Far from the hello deadline, so a bound with room for a slow
        // guest still tells the two apart.
        config.handshake_timeout = Duration::from_secs(60);
        config.max_pending_handshakes = 2;
        let server = ServerSession::bind(addr(), &pd, config).unwrap();
        let at = server.local_addr();

        // A hello that asks for a QP, then one more frame: the server's
        // challenge finds no receive and waits in RNR retry for ever.
        let hello = Message::Hello(Hello {
            nonce: [0; 32],
            identity: "stranger".into(),
            qps: vec!["data".into()],
        })
        .encode()
        .unwrap();
        let start = Instant::now();
        let strangers: Vec<_> = (0..2).map(|_| stalling_stranger(at, &[hello.clone(), hello.clone()])).collect();
        // Both pending slots are taken: a third is refused as busy at once.
        let RawClient { channel, mut id, qp, .. } = raw_client(at);
        id.connect(&qp, &tag()).unwrap();
        let answer = channel.get_event(Some(DEADLINE)).unwrap().expect("an answer");
        assert_eq!(answer.kind(), CmEventKind::Rejected);
        assert_eq!(&answer.private_data()[8..10], &reject_code::BUSY.to_be_bytes());
        drop(answer);

        // Both stalled handshakes end at the hello deadline, not later.
        let mut failures = Vec::new();
        while failures.len() < 2 && start.elapsed() < DEADLINE {
            failures.extend(server.take_failures().into_iter().filter(|f| f.error.to_string().contains("timed out")));
            thread::sleep(Duration::from_millis(20));
        }
        let ended = start.elapsed();
        println!("two stalling strangers cut off after {ended:?}: {failures:?}");
        assert_eq!(failures.len(), 2, "{failures:?}");
        assert!(ended < Duration::from_secs(10), "cut off at the 1 s hello deadline, not at the 60 s handshake deadline: {ended:?}");
        let released = Instant::now();
        while server.pending_handshakes() > 0 && released.elapsed() < DEADLINE {
            thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(server.pending_handshakes(), 0, "their pending slots are free again");

        // A real client is served now, and the server stops promptly.
        let client_pd = pd.clone();
        let good = thread::spawn(move || ClientSession::connect(at, &client_pd, &client_config()));
        let mut served = server.accept_timeout(DEADLINE).expect("a real client after the strangers");
        let mut client = good.join().unwrap().expect("the real client connects");
        exchange(&pd, &mut client, &mut served, b"served after the strangers");
        drop(strangers);
        let stopping = Instant::now();
        drop(server);
        assert!(stopping.elapsed() < Duration::from_secs(10), "shutdown took {:?}", stopping.elapsed());
    }
}

verbs_test! {
    fn an_id_moves_to_another_channel_only_while_nothing_holds_it() {
        let at = addr();
        let listener_channel = EventChannel::new().unwrap();
        let mut listener = listener_channel.create_id().unwrap();
        listener.bind(at).unwrap();
        listener.listen(4).unwrap();
        let (client_channel, mut client) = {
            let channel = EventChannel::new().unwrap();
            let mut id = channel.create_id().unwrap();
            id.resolve_addr(None, at, DEADLINE).unwrap();
            drop(channel.expect(&id, CmEventKind::AddrResolved, DEADLINE).unwrap());
            id.resolve_route(DEADLINE).unwrap();
            drop(channel.expect(&id, CmEventKind::RouteResolved, DEADLINE).unwrap());
            (channel, id)
        };
        let ctx = client.context().unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(4, None).unwrap();
        let mut qp = client.create_qp(&pd, &cq, &cq, &QpConfig::default()).unwrap();
        // A QP holds the client's id: it cannot move.
        let other = EventChannel::new().unwrap();
        let held = client.migrate(&other);
        assert!(matches!(held, Err(Error::InvalidArgument(_))), "{held:?}");
        client.connect(&qp, &[]).unwrap();

        let mut request = listener_channel
            .get_event(Some(DEADLINE))
            .unwrap()
            .and_then(|mut event| event.take_request())
            .expect("a connect request");
        let own = EventChannel::new().unwrap();
        request.migrate(&own).unwrap();
        let sctx = request.id().context().unwrap();
        let spd = sctx.alloc_pd().unwrap();
        let scq = sctx.create_cq(4, None).unwrap();
        let mut sqp = request.id().create_qp(&spd, &scq, &scq, &QpConfig::default()).unwrap();
        let sid = request.accept(&mut sqp, &[]).unwrap();
        drop(client_channel.expect(&client, CmEventKind::ConnectResponse, DEADLINE).unwrap());
        client.establish(&mut qp).unwrap();
        // The connection's events come on its own channel, not the listener's.
        drop(own.expect(&sid, CmEventKind::Established, DEADLINE).unwrap());
        client.disconnect().unwrap();
        drop(own.expect(&sid, CmEventKind::Disconnected, DEADLINE).unwrap());
        assert!(listener_channel.try_get_event().unwrap().is_none(), "nothing on the listener's channel");
    }
}
