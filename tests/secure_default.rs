//! A server is closed unless told otherwise, and strangers speaking the wire
//! format from raw sockets hold nothing for long: no open server without
//! the explicit opt-in (and a warning when given), a silent admitted
//! stranger freed at the hello deadline, and a peer limit that counts the
//! peers connected now.
//!
//! Runs on the in-process loopback device in every `cargo test`: sessions
//! over TCP on 127.0.0.0/8, QPs on [`Context::loopback`].

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::{Mutex, Once};
use std::thread;
use std::time::{Duration, Instant};

use rdma_comm_core::Error;
use rdma_comm_core::session::wire::{FrameReader, Hello, MAX_PAYLOAD, Message, PROOF_LEN};
use rdma_comm_core::session::*;
use rdma_comm_core::verbs::*;

/// Whatever the library logs at warn level or above, for the tests that
/// read it.
static WARNINGS: Mutex<Vec<String>> = Mutex::new(Vec::new());

struct Capture;

impl log::Log for Capture {
    fn enabled(&self, metadata: &log::Metadata) -> bool {
        metadata.level() <= log::Level::Warn
    }
    fn log(&self, record: &log::Record) {
        if self.enabled(record.metadata()) {
            let line = record.args().to_string();
            WARNINGS
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .push(line);
        }
    }
    fn flush(&self) {}
}

fn capture_warnings() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        log::set_logger(&Capture).unwrap();
        log::set_max_level(log::LevelFilter::Warn);
    });
}

fn loopback_pd() -> ProtectionDomain {
    // SAFETY: each test's QPs are only connected, never posted to, so no
    // two threads touch a request's bytes.
    let ctx = unsafe { Context::loopback() };
    ctx.alloc_pd().expect("a PD on the loopback device")
}

fn open_server(pd: &ProtectionDomain, config: ServerConfig) -> ServerSession {
    ServerSession::bind("127.0.0.1:0", pd, config).expect("binding an open server")
}

fn client_config(deadline: Duration) -> ClientConfig {
    let mut config = ClientConfig::new(vec![QpSpec::new("data")]);
    config.connect_deadline = deadline;
    config.handshake_timeout = deadline;
    config
}

/// A TCP connection from `source` (any 127/8 address is loopback on Linux).
fn connect_from(source: [u8; 4], to: SocketAddr) -> TcpStream {
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    socket.bind(&SocketAddr::from((source, 0)).into()).unwrap();
    socket.connect(&to.into()).unwrap();
    socket.into()
}

/// Reads one frame, failing the test after 5 s.
fn read_frame(stream: &mut TcpStream) -> Message {
    let mut reader = FrameReader::new(MAX_PAYLOAD);
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    loop {
        if let Some(frame) = reader.read_from(stream).expect("a frame from the server") {
            return Message::decode(frame).unwrap().0;
        }
    }
}

/// A stranger from `source` that says hello, is admitted by an open
/// server, and then says nothing more: returns its socket, still open.
fn admitted_stranger(source: [u8; 4], server: SocketAddr) -> TcpStream {
    let mut stream = connect_from(source, server);
    let hello = Message::Hello(Hello {
        nonce: [7; PROOF_LEN],
        identity: "stranger".into(),
        qps: vec!["data".into()],
    });
    stream.write_all(&hello.encode().unwrap()).unwrap();
    match read_frame(&mut stream) {
        Message::Challenge { auth: false, .. } => {}
        other => panic!("expected an open server's challenge, got {other:?}"),
    }
    match read_frame(&mut stream) {
        Message::Admit => {}
        other => panic!("expected Admit, got {other:?}"),
    }
    stream
}

/// Waits until `done` holds, failing the test after `limit`.
#[track_caller]
fn wait_until(limit: Duration, what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < limit, "timed out after {limit:?}: {what}");
        thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_server_without_a_key_refuses_to_start_unless_told_to_serve_anyone() {
    capture_warnings();
    let pd = loopback_pd();
    match ServerSession::bind("127.0.0.1:0", &pd, ServerConfig::default()) {
        Err(Error::InvalidArgument(why)) => assert!(why.contains("insecure_open"), "{why}"),
        other => panic!("a keyless server started: {other:?}"),
    }
    let both = ServerConfig {
        insecure_open: true,
        ..ServerConfig::default().with_auth_key(AuthKey::new(&[1; 32]).unwrap())
    };
    assert!(matches!(
        ServerSession::bind("127.0.0.1:0", &pd, both),
        Err(Error::InvalidArgument(_))
    ));

    let keyed = ServerSession::bind(
        "127.0.0.1:0",
        &pd,
        ServerConfig::default().with_auth_key(AuthKey::new(&[1; 32]).unwrap()),
    )
    .expect("a keyed server starts");
    let open = open_server(&pd, ServerConfig::insecure_open());
    let warned = |addr: SocketAddr| {
        WARNINGS
            .lock()
            .unwrap()
            .iter()
            .filter(|line| line.contains(&addr.to_string()) && line.contains("open to anyone"))
            .count()
    };
    assert_eq!(
        warned(open.local_addr()),
        1,
        "one warning for the open server"
    );
    assert_eq!(warned(keyed.local_addr()), 0, "none for the keyed one");
}

#[test]
fn silent_admitted_strangers_hold_their_slots_only_until_the_hello_deadline() {
    let pd = loopback_pd();
    let config = ServerConfig::insecure_open();
    let hello_timeout = config.hello_timeout;
    let slots = config.max_pending_handshakes;
    let per_address = config.max_pending_per_address;
    assert!(config.handshake_timeout >= 4 * hello_timeout);
    let server = open_server(&pd, config);
    let addr = server.local_addr();

    // Every pending slot, from 8 addresses, taken by strangers that were
    // admitted and then went silent.
    let sources = slots / per_address;
    let strangers: Vec<TcpStream> = (0..sources)
        .flat_map(|source| (0..per_address).map(move |_| source))
        .map(|source| admitted_stranger([127, 0, 0, 10 + source as u8], addr))
        .collect();
    assert_eq!(server.pending_handshakes(), slots);

    // A real client keeps trying for the hello deadline and one retry's
    // worth more: it gets in once the strangers' slots are cut, long
    // before the handshake deadline they used to keep them for.
    let start = Instant::now();
    let deadline = hello_timeout + Duration::from_secs(2);
    let endpoint = ClientSession::connect(addr, &pd, &client_config(deadline))
        .expect("a real client gets in once the silent strangers are cut");
    let waited = start.elapsed();
    assert!(waited <= deadline, "took {waited:?}");
    let served = server
        .accept_timeout(Duration::from_secs(5))
        .expect("the server made the endpoint");
    assert_eq!(server.connected_peers(), 1);
    drop((endpoint, served, strangers));
}

#[test]
fn the_peer_limit_counts_the_peers_connected_now_and_strangers_never_close_the_listener() {
    let pd = loopback_pd();
    let server = open_server(
        &pd,
        ServerConfig {
            max_peers: Some(2),
            ..ServerConfig::insecure_open()
        },
    );
    let addr = server.local_addr();

    // Two strangers take both places at admission, then leave.
    let strangers: Vec<_> = (0..2)
        .map(|i| admitted_stranger([127, 0, 0, 20 + i], addr))
        .collect();
    assert_eq!(server.connected_peers(), 2);
    drop(strangers);
    wait_until(
        Duration::from_secs(5),
        "the strangers' handshakes end",
        || server.pending_handshakes() == 0,
    );
    assert_eq!(
        server.connected_peers(),
        0,
        "departed strangers hold no place"
    );

    // Two real peers fill the limit; a third is refused as busy while
    // they stay, and the listener stays open.
    let config = client_config(Duration::from_secs(5));
    let first = ClientSession::connect(addr, &pd, &config).expect("first peer");
    let second = ClientSession::connect(addr, &pd, &config).expect("second peer");
    let served: Vec<Endpoint> = (0..2)
        .map(|_| server.accept_timeout(Duration::from_secs(5)).unwrap())
        .collect();
    assert_eq!(server.connected_peers(), 2);
    match ClientSession::connect(addr, &pd, &client_config(Duration::from_millis(300))) {
        Err(Error::Rejected { code, .. }) => assert_eq!(code, reject_code::BUSY),
        Err(Error::ConnectTimeout { last, .. }) => {
            assert!(last.to_string().contains("busy"), "{last}")
        }
        other => panic!("a third peer was not refused as busy: {other:?}"),
    }

    // One leaves (its server-side endpoint is dropped): its place is free.
    drop(served);
    drop(first);
    let third = ClientSession::connect(addr, &pd, &config).expect("a third peer after one left");
    let _served = server.accept_timeout(Duration::from_secs(5)).unwrap();
    assert_eq!(server.connected_peers(), 1);
    drop((second, third));
}

/// A rogue server whose reject reason holds control characters: the
/// client refuses the frame, and its error carries none of them.
#[test]
fn a_peers_control_characters_never_reach_our_errors() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let rogue = thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        let _hello = read_frame(&mut stream);
        let reason = b"no\nERROR forged \x1b[2J";
        let mut frame = Message::reject(4, "").encode().unwrap();
        frame.extend_from_slice(reason);
        let payload_len = (frame.len() - 12) as u32;
        frame[8..12].copy_from_slice(&payload_len.to_le_bytes());
        frame[14] = reason.len() as u8;
        stream.write_all(&frame).unwrap();
        let mut sink = Vec::new();
        let _ = stream.read_to_end(&mut sink);
    });
    let pd = loopback_pd();
    let err = ClientSession::connect(addr, &pd, &client_config(Duration::from_secs(5)))
        .expect_err("the rogue refuses");
    let shown = err.to_string();
    assert!(
        !shown.contains('\n') && !shown.contains('\u{1b}'),
        "{shown:?}"
    );
    assert!(shown.contains("control"), "{shown:?}");
    rogue.join().unwrap();
}

/// A handler that only serves messages: it never removes a session, so
/// only the peer watch can see its peer leave.
struct OnlyMessages;

impl rdma_comm_core::reactor::Handler for OnlyMessages {
    fn on_message(
        &mut self,
        _: &mut rdma_comm_core::reactor::Ctx<'_>,
        _: rdma_comm_core::reactor::ConnId,
        _: &[u8],
        _: Option<u32>,
    ) {
    }
}

#[test]
fn a_departed_peer_frees_its_place_once_the_reactor_sees_it_leave() {
    use rdma_comm_core::reactor::{Reactor, ReactorConfig};
    let pd = loopback_pd();
    // The default configuration watches peers (every second).
    let mut reactor: Reactor<OnlyMessages> =
        Reactor::new(&pd, ReactorConfig::default()).expect("a reactor");
    let mut config = reactor.server_config(AccessFlags::empty());
    config.insecure_open = true;
    config.max_peers = Some(1);
    let server = ServerSession::bind("127.0.0.1:0", &pd, config).expect("bind");
    let addr = server.local_addr();

    let client_config = ClientConfig::new(vec![reactor.qp_spec("data")]);
    let client = ClientSession::connect(addr, &pd, &client_config).expect("first peer");
    let served = server
        .accept_timeout(Duration::from_secs(5))
        .expect("the endpoint");
    reactor
        .add(served, OnlyMessages)
        .expect("served by the reactor");
    assert_eq!(server.connected_peers(), 1);

    // The peer leaves; the handler keeps the session, the watch frees the
    // place, and a newcomer gets in.
    drop(client);
    let start = Instant::now();
    while server.connected_peers() != 0 {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the departed peer still holds the only place"
        );
        let _ = reactor.run_for(Duration::from_millis(20)).expect("passes");
    }
    let newcomer = ClientSession::connect(addr, &pd, &client_config).expect("a newcomer");
    drop(newcomer);
}

#[test]
fn a_runtime_that_cannot_see_peers_leave_refuses_a_peer_limit() {
    use rdma_comm_core::reactor::ReactorConfig;
    use rdma_comm_core::runtime::{NewSession, Runtime, RuntimeConfig};
    let pd = loopback_pd();
    let config = RuntimeConfig {
        reactors: 1,
        reactor: ReactorConfig {
            peer_check_interval: None,
            ..ReactorConfig::default()
        },
        ..RuntimeConfig::default()
    };
    let mut runtime =
        Runtime::start(&pd, config, |_: &NewSession<'_>| Ok(OnlyMessages)).expect("a runtime");
    let mut config = runtime.server_config(AccessFlags::empty());
    config.insecure_open = true;
    config.max_peers = Some(2);
    match runtime.serve("127.0.0.1:0", config) {
        Err(Error::InvalidArgument(why)) => assert!(why.contains("peer_check_interval"), "{why}"),
        other => panic!("a peer limit nobody can free was accepted: {other:?}"),
    }
    runtime.handle().stop();
    runtime.join().expect("the runtime stops");
}
