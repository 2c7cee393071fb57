//! A stranger on the network gets nothing and holds nothing:
//! slow-drip handshakes, authentication with a shared key, admission, the
//! peer limit and the accept backlog, a server dropped mid-handshake, and a
//! control connection that drips on an established endpoint.
//! Gated as described in `tests/util/mod.rs`: runs in the Soft-RoCE guest.

mod util;

use std::collections::{HashMap, VecDeque};
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use rdma_comm_core::Error;
use rdma_comm_core::session::wire::{
    FrameReader, Handshake, Hello, MAX_PAYLOAD, Message, PROOF_LEN, QpInfo, WireError,
};
use rdma_comm_core::session::*;
use rdma_comm_core::verbs::WcStatus;
use rdma_comm_core::verbs::*;
use socket2::{Domain, Socket, Type};
use util::ping_pong::start_server;
use util::*;

fn client_config(key: Option<&AuthKey>) -> ClientConfig {
    let mut config = ClientConfig::new(vec![QpSpec::new("data")]).with_auth_key(key.cloned());
    config.connect_deadline = Duration::from_secs(5);
    config.handshake_timeout = Duration::from_secs(5);
    config
}

fn key(byte: u8) -> AuthKey {
    AuthKey::new(&[byte; 32]).unwrap()
}

/// A TCP connection from `source` (any 127/8 address is loopback on Linux).
fn connect_from(source: [u8; 4], to: SocketAddr) -> TcpStream {
    let socket = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
    let from = SocketAddr::from((source, 0));
    socket.bind(&from.into()).unwrap();
    socket.connect(&to.into()).unwrap();
    socket.into()
}

/// How long the server held one dripper, and when it hung up.
struct Held {
    /// The dripper's end of the connection: the peer in the server's
    /// failure record for it.
    local: SocketAddr,
    held: Duration,
    cut_at: Instant,
}

/// Drips a valid-looking Hello, one byte every `every`, until the server
/// hangs up.
fn drip(mut stream: TcpStream, every: Duration) -> Held {
    let start = Instant::now();
    let local = stream.local_addr().unwrap();
    let frame = Message::Hello(Hello {
        nonce: [1; PROOF_LEN],
        identity: "drip".into(),
        qps: vec!["x".into()],
    })
    .encode()
    .unwrap();
    stream.set_read_timeout(Some(every)).unwrap();
    let mut sink = [0u8; 512];
    for byte in frame.iter().cycle() {
        if stream.write_all(std::slice::from_ref(byte)).is_err() {
            break;
        }
        match stream.read(&mut sink) {
            // Hung up (a refusal may come first; the close follows).
            Ok(0) => break,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(_) => break,
        }
        if start.elapsed() > Duration::from_secs(60) {
            break;
        }
    }
    let cut_at = Instant::now();
    Held {
        local,
        held: cut_at - start,
        cut_at,
    }
}

/// What the server did with one dripper.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Outcome {
    CutAtDeadline,
    RefusedAsOneAddress,
    RefusedAsBusy,
}

verbs_test! {
    fn slow_drip_handshakes_do_not_deny_service_to_real_clients() {
        // A stranger is cut at the hello deadline, long before the
        // handshake's.
        const TIMEOUT: Duration = Duration::from_secs(1);
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        let config = ServerConfig {
            hello_timeout: TIMEOUT,
            handshake_timeout: Duration::from_secs(30),
            ..ServerConfig::insecure_open()
        };
        let per_address = config.max_pending_handshakes.min(config.max_pending_per_address);
        let srv = ServerSession::bind("127.0.0.1:0", &pd, config).unwrap();
        let addr = srv.local_addr();

        // 80 drippers from one host and 80 from ten others, one byte every
        // 500 ms: a server that bounded each read by the timeout would be held
        // for many timeouts. Each gets one absolute deadline (the hello timeout here), one
        // host at most its share of the pending table, and all of them
        // together more than the table holds: real clients are told "busy"
        // and retry until the strangers' slots run out.
        const DRIPPERS: usize = 160;
        // The host that sends half of them.
        const ONE_HOST: [u8; 4] = [127, 0, 0, 2];
        let drippers: Vec<_> = (0..DRIPPERS)
            .map(|i| {
                let source = if i < 80 { ONE_HOST } else { [127, 0, 0, 3 + (i % 10) as u8] };
                let stream = connect_from(source, addr);
                thread::spawn(move || drip(stream, Duration::from_millis(500)))
            })
            .collect();
        thread::sleep(Duration::from_millis(500));
        let pending = srv.pending_handshakes();
        assert!(pending <= 64, "{pending} handshakes pending");

        // Real clients from 127.0.0.1, one after another, all served: the
        // first while the strangers hold the table (it is told "busy" until
        // their slots run out, well within its connect deadline). Four are
        // asked for within 12 s: a slow guest may take a second or more for
        // one client.
        let start = Instant::now();
        let mut served = 0;
        while served < 4 && start.elapsed() < 12 * TIMEOUT {
            let endpoint = ClientSession::connect(addr, &pd, &client_config(None))
                .unwrap_or_else(|err| panic!("a real client during the drip attack: {err}"));
            let server_side = srv.accept_timeout(DEADLINE).expect("the server side of a real client");
            assert_eq!(server_side.peer().ip(), endpoint.peer().ip());
            served += 1;
            thread::sleep(Duration::from_millis(300));
        }
        assert!(served >= 4, "only {served} real clients in {:?}", 12 * TIMEOUT);

        // No dripper was held much past the deadline (a timeout per partial
        // read would hold one for tens of seconds here).
        // Held time counts from the dripper's connect, so it includes the
        // time the server took to reach it in the backlog: under TCG that
        // alone can reach a second (more in a slow boot), hence the slack,
        // still far below the 30 s handshake timeout.
        let held: Vec<Held> = drippers.into_iter().map(|d| d.join().unwrap()).collect();
        let longest = held.iter().map(|h| h.held).max().unwrap();
        assert!(longest < 2 * TIMEOUT + Duration::from_secs(3), "a dripper was held {longest:?}");

        // Every dripper was either refused at the door or admitted and cut
        // at the hello deadline; the server's record says which (its
        // 256-entry list holds all 160).
        assert_eq!(srv.pending_handshakes(), 0);
        let failures = srv.take_failures();
        // A connection the server reset gives its port back at once (the
        // socket is still open here, but no longer bound), so a later
        // dripper may have the same address. Such drippers connected one
        // after the other, in the order of `held`, and the server recorded
        // them in that order too.
        let mut records: HashMap<SocketAddr, VecDeque<String>> = HashMap::new();
        for failure in &failures {
            records.entry(failure.peer).or_default().push_back(failure.error.to_string());
        }
        let mut outcome = |h: &Held| {
            let record = records.get_mut(&h.local).and_then(VecDeque::pop_front);
            match record {
                Some(r) if r.contains("timed out") => Outcome::CutAtDeadline,
                Some(r) if r.contains("from one address") => Outcome::RefusedAsOneAddress,
                Some(r) if r.contains("too many handshakes in progress") => Outcome::RefusedAsBusy,
                _ => panic!("dripper {}: recorded as {record:?}", h.local),
            }
        };
        let outcomes: Vec<(&Held, Outcome)> = held.iter().map(|h| (h, outcome(h))).collect();
        // Real clients (from 127.0.0.1) may have been told "busy" too.
        records.retain(|peer, left| peer.ip() != IpAddr::from([127, 0, 0, 1]) && !left.is_empty());
        assert!(records.is_empty(), "recorded, but no dripper had that address: {records:?}");
        let from_one: Vec<&(&Held, Outcome)> =
            outcomes.iter().filter(|(h, _)| h.local.ip() == IpAddr::from(ONE_HOST)).collect();
        assert!(from_one.iter().any(|(_, o)| *o == Outcome::RefusedAsOneAddress), "none refused as one address");

        // One address holds at most its share at a time. A held dripper is
        // cut at the hello deadline counted from its accept, and a freed
        // slot is only refilled after that cut, so among any
        // `per_address + 1` cuts of one address two are a deadline apart:
        // none of those windows is shorter than half a deadline (the half
        // absorbs the drippers' own scheduling). Drippers the server reached
        // only after a first share expired may be held too: the limit is on
        // how many at once, not in total.
        let mut cuts: Vec<Instant> = from_one
            .iter()
            .filter(|(_, o)| *o == Outcome::CutAtDeadline)
            .map(|(h, _)| h.cut_at)
            .collect();
        cuts.sort();
        assert!(!cuts.is_empty(), "no dripper from {ONE_HOST:?} was held at all");
        for (i, window) in cuts.windows(per_address + 1).enumerate() {
            let span = window[per_address] - window[0];
            assert!(
                span >= TIMEOUT / 2,
                "{} drippers from one address cut within {span:?} (cuts {i}..): more than {per_address} held at once",
                per_address + 1
            );
        }
    }
}

verbs_test! {
    fn the_shared_key_is_proven_both_ways_and_a_wrong_or_missing_one_is_refused() {
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        let srv = ServerSession::bind(
            "127.0.0.1:0",
            &pd,
            ServerConfig::default().with_auth_key(key(1)),
        )
        .unwrap();
        let addr = srv.local_addr();

        let mut good = ClientSession::connect(addr, &pd, &client_config(Some(&key(1)))).expect("right key");
        let mut served = srv.accept_timeout(DEADLINE).expect("server side");
        assert!(matches!(good.check_peer(), PeerStatus::Alive));
        assert!(matches!(served.check_peer(), PeerStatus::Alive));

        for (client_key, what) in [(Some(key(2)), "wrong key"), (None, "no key")] {
            let err = ClientSession::connect(addr, &pd, &client_config(client_key.as_ref())).unwrap_err();
            assert!(
                matches!(&err, Error::Unauthenticated { peer, .. } if *peer == addr),
                "client with {what}: {err}"
            );
            let failure = wait_failure(&srv);
            assert!(matches!(failure.error, Error::Unauthenticated { .. }), "server on a client with {what}: {}", failure.error);
            assert_eq!(failure.peer.ip(), addr.ip(), "the failure names the peer");
        }
        assert!(srv.accept_timeout(Duration::from_millis(200)).is_none(), "nothing was admitted");

        // A client with a key refuses a server without one, revealing nothing.
        let open = ServerSession::bind("127.0.0.1:0", &pd, ServerConfig::insecure_open()).unwrap();
        let err = ClientSession::connect(open.local_addr(), &pd, &client_config(Some(&key(1)))).unwrap_err();
        assert!(matches!(&err, Error::Unauthenticated { peer, .. } if *peer == open.local_addr()), "{err}");
        assert!(err.to_string().contains("does not authenticate"), "{err}");
        assert!(matches!(wait_failure(&open).error, Error::Unauthenticated { .. }));
    }
}

fn wait_failure(srv: &ServerSession) -> HandshakeFailure {
    let start = Instant::now();
    loop {
        if let Some(failure) = srv.take_failures().into_iter().next() {
            return failure;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "no handshake failure was recorded"
        );
        thread::sleep(Duration::from_millis(20));
    }
}

verbs_test! {
    fn the_authorize_callback_sees_the_authenticated_hello_before_anything_is_made() {
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = Arc::clone(&seen);
        let authorize: Arc<AuthorizeFn> = Arc::new(move |hello: &PeerHello| {
            log.lock().unwrap().push(hello.clone());
            if hello.identity == "mallory" {
                Err(Refusal::unauthorized("mallory is not welcome"))
            } else {
                Ok(())
            }
        });
        let srv = ServerSession::bind(
            "127.0.0.1:0",
            &pd,
            ServerConfig { authorize: Some(authorize), ..ServerConfig::default().with_auth_key(key(1)) },
        )
        .unwrap();
        let addr = srv.local_addr();
        let err = ClientSession::connect(addr, &pd, &client_config(Some(&key(1))).with_identity("mallory")).unwrap_err();
        assert!(
            matches!(&err, Error::Rejected { code, reason, .. } if *code == reject_code::UNAUTHORIZED && reason.contains("not welcome")),
            "{err}"
        );
        assert!(matches!(wait_failure(&srv).error, Error::Unauthorized { .. }));
        let _alice = ClientSession::connect(addr, &pd, &client_config(Some(&key(1))).with_identity("alice")).expect("alice");
        let _served = srv.accept_timeout(DEADLINE).expect("alice's server side");
        let seen = seen.lock().unwrap();
        assert_eq!(seen.len(), 2);
        assert!(seen.iter().all(|h| h.authenticated && h.qps == ["data"] && h.peer.ip() == addr.ip()), "{seen:?}");
    }
}

verbs_test! {
    fn concurrent_handshakes_never_exceed_max_peers_or_the_backlog() {
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        // Nobody calls accept(): two fit the backlog, the rest are told the
        // server is busy.
        let srv = ServerSession::bind(
            "127.0.0.1:0",
            &pd,
            ServerConfig { accept_backlog: 2, ..ServerConfig::insecure_open() },
        )
        .unwrap();
        let addr = srv.local_addr();
        let results = connect_at_once(addr, &pd, 6);
        let ok = results.iter().filter(|r| r.is_ok()).count();
        assert_eq!(ok, 2, "{results:?}");
        assert!(results.iter().filter_map(|r| r.as_ref().err()).all(|e| e.contains("busy")), "{results:?}");
        let taken: Vec<Endpoint> = (0..2).map(|_| srv.accept_timeout(DEADLINE).unwrap()).collect();
        assert!(srv.try_accept().is_none());
        // Taking them makes room again.
        let later = connect_at_once(addr, &pd, 1);
        assert!(later[0].is_ok(), "{later:?}");
        drop(taken);

        let limited = ServerSession::bind(
            "127.0.0.1:0",
            &pd,
            ServerConfig { max_peers: Some(2), ..ServerConfig::insecure_open() },
        )
        .unwrap();
        let results = connect_at_once(limited.local_addr(), &pd, 6);
        assert_eq!(results.iter().filter(|r| r.is_ok()).count(), 2, "{results:?}");
        assert!(limited.accept_timeout(DEADLINE).is_some() && limited.accept_timeout(DEADLINE).is_some());
        assert!(limited.accept_timeout(Duration::from_secs(1)).is_none(), "a third peer was admitted");
    }
}

/// `n` clients connecting at once; each result as `Ok` or the error text.
fn connect_at_once(
    addr: SocketAddr,
    pd: &ProtectionDomain,
    n: usize,
) -> Vec<Result<Endpoint, String>> {
    let clients: Vec<_> = (0..n)
        .map(|_| {
            let pd = pd.clone();
            thread::spawn(move || {
                let mut config = client_config(None);
                // Refused clients retry busy until this ends; 4 s leaves a
                // slow guest time to answer their first attempt.
                config.connect_deadline = Duration::from_secs(4);
                ClientSession::connect(addr, &pd, &config).map_err(|e| e.to_string())
            })
        })
        .collect();
    clients.into_iter().map(|c| c.join().unwrap()).collect()
}

verbs_test! {
    fn a_deadline_that_ends_a_retry_after_busy_reports_busy_and_a_silent_server_its_timeout() {
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        // Deadline 4 s, handshake timeout 60 s: the retry after busy is
        // ended by the deadline before any admission, so busy is why.
        let mut config = client_config(None);
        config.connect_deadline = Duration::from_secs(4);
        config.handshake_timeout = Duration::from_secs(60);
        let server = BusyFirst::start(Then::Silent);
        let err = ClientSession::connect(server.addr, &pd, &config).unwrap_err();
        assert!(
            matches!(err, Error::Rejected { code: reject_code::BUSY, .. }),
            "{err}"
        );
        assert!(server.stop() >= 2, "the client tried again after busy");
        // The same, but the retry is admitted before the server falls
        // silent: it may have made the session by then, so the timeout is
        // what the client reports.
        let server = BusyFirst::start(Then::Admit);
        let err = ClientSession::connect(server.addr, &pd, &config).unwrap_err();
        assert!(err.to_string().contains("timed out"), "{err}");
        assert!(server.stop() >= 2, "the client tried again after busy");
        // Busy after admission is not an answer to try again: the server
        // may have kept what it made. The client stops at the second.
        let server = BusyFirst::start(Then::AdmitThenBusy);
        let err = ClientSession::connect(server.addr, &pd, &config).unwrap_err();
        assert!(
            matches!(err, Error::Rejected { code: reject_code::BUSY, .. }),
            "{err}"
        );
        assert_eq!(server.stop(), 2, "busy after admission was tried again");
        // Deadline 30 s, handshake timeout 2 s: the retry times out on its
        // own with most of the deadline left, and says so.
        config.connect_deadline = Duration::from_secs(30);
        config.handshake_timeout = Duration::from_secs(2);
        let server = BusyFirst::start(Then::Silent);
        let started = Instant::now();
        let err = ClientSession::connect(server.addr, &pd, &config).unwrap_err();
        assert!(err.to_string().contains("timed out"), "{err}");
        assert!(started.elapsed() < Duration::from_secs(20), "{:?}", started.elapsed());
        assert!(server.stop() >= 2, "the timeout came after a busy answer");
    }
}

/// What [`BusyFirst`] does with the connections after the first.
#[derive(Clone, Copy, PartialEq)]
enum Then {
    /// Accepts them and says nothing.
    Silent,
    /// Answers the hello with a challenge and admission, then says nothing.
    Admit,
    /// Admits, and answers the client's offer with busy.
    AdmitThenBusy,
}

/// A fake server that answers the first connection's hello with busy and
/// the connections after it as `then` says.
struct BusyFirst {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<thread::JoinHandle<usize>>,
}

impl BusyFirst {
    fn start(then: Then) -> Self {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        listener.set_nonblocking(true).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = Arc::clone(&stop);
        let thread = thread::spawn(move || {
            let busy = || Message::Reject {
                code: reject_code::BUSY,
                reason: "busy".into(),
            };
            let admit = || {
                vec![
                    Message::Challenge {
                        nonce: [7; PROOF_LEN],
                        auth: false,
                    },
                    Message::Admit,
                ]
            };
            let mut held = Vec::new();
            while !stopped.load(Ordering::Relaxed) {
                let Ok((mut stream, _)) = listener.accept() else {
                    thread::sleep(Duration::from_millis(5));
                    continue;
                };
                // What to send after each frame the client sends.
                let script = match (held.is_empty(), then) {
                    (true, _) => vec![vec![busy()]],
                    (false, Then::Silent) => Vec::new(),
                    (false, Then::Admit) => vec![admit()],
                    (false, Then::AdmitThenBusy) => vec![admit(), vec![busy()]],
                };
                stream
                    .set_read_timeout(Some(Duration::from_millis(100)))
                    .unwrap();
                let mut reader = FrameReader::new(MAX_PAYLOAD);
                'script: for answer in &script {
                    // The client's next frame, however slowly it comes.
                    while !stopped.load(Ordering::Relaxed) {
                        match reader.read_from(&mut stream) {
                            Ok(Some(_)) => {
                                for message in answer {
                                    let _ = stream.write_all(&message.encode().unwrap());
                                }
                                continue 'script;
                            }
                            Ok(None) => {}
                            Err(WireError::Io(e))
                                if matches!(
                                    e.kind(),
                                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                                ) => {}
                            // The client went away: nothing more to answer.
                            Err(_) => break 'script,
                        }
                    }
                }
                held.push(stream);
            }
            held.len()
        });
        Self {
            addr,
            stop,
            thread: Some(thread),
        }
    }

    /// Stops the server; returns how many connections it took.
    fn stop(mut self) -> usize {
        self.halt()
            .expect("a running server")
            .expect("the fake server's thread")
    }

    /// Stops the thread, if it still runs, and joins it.
    fn halt(&mut self) -> Option<thread::Result<usize>> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.take().map(thread::JoinHandle::join)
    }
}

impl Drop for BusyFirst {
    /// A test that failed before `stop` leaves no thread behind.
    fn drop(&mut self) {
        let _ = self.halt();
    }
}

verbs_test! {
    fn dropping_the_server_cuts_pending_handshakes_and_joins_their_threads() {
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        let srv = ServerSession::bind(
            "127.0.0.1:0",
            &pd,
            ServerConfig {
                handshake_timeout: Duration::from_secs(60),
                hello_timeout: Duration::from_secs(60),
                ..ServerConfig::insecure_open()
            },
        )
        .unwrap();
        let silent: Vec<TcpStream> = (0..6).map(|_| TcpStream::connect(srv.local_addr()).unwrap()).collect();
        let start = Instant::now();
        while srv.pending_handshakes() < 6 {
            assert!(start.elapsed() < DEADLINE, "handshakes did not start");
            thread::sleep(Duration::from_millis(10));
        }
        // Drop joins the accept thread, which joins every handshake thread:
        // it returns at once because the pending sockets are cut, not after
        // the 60 s deadline (10 s: room for a slow guest, far from 60).
        let dropped = Instant::now();
        drop(srv);
        assert!(dropped.elapsed() < Duration::from_secs(10), "drop waited {:?}", dropped.elapsed());
        for mut stream in silent {
            stream.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
            let mut byte = [0u8; 64];
            assert!(matches!(stream.read(&mut byte), Ok(0) | Err(_)), "the socket is closed");
        }
    }
}

/// A client that runs the handshake by hand, so that the test controls
/// every byte of its control connection afterwards.
struct RawClient {
    stream: TcpStream,
    _qp: QueuePair,
    _cq: CompletionQueue,
}

impl RawClient {
    fn connect(addr: SocketAddr, pd: &ProtectionDomain) -> Self {
        let cq = pd.context().create_cq(16, None).unwrap();
        let mut qp = pd.create_qp(&cq, &cq, &remote_config()).unwrap();
        let mut stream = TcpStream::connect(addr).unwrap();
        stream.set_read_timeout(Some(DEADLINE)).unwrap();
        let mut reader = FrameReader::new(MAX_PAYLOAD);
        let send =
            |stream: &mut TcpStream, m: Message| stream.write_all(&m.encode().unwrap()).unwrap();
        let mut recv = |stream: &mut TcpStream| loop {
            if let Some(frame) = reader.read_from(stream).unwrap() {
                break Message::decode(frame).unwrap().0;
            }
        };
        send(
            &mut stream,
            Message::Hello(Hello {
                nonce: [2; PROOF_LEN],
                identity: "raw".into(),
                qps: vec!["raw".into()],
            }),
        );
        assert!(matches!(
            recv(&mut stream),
            Message::Challenge { auth: false, .. }
        ));
        assert_eq!(recv(&mut stream), Message::Admit);
        let ep = qp.endpoint();
        let info = QpInfo {
            name: "raw".into(),
            qpn: ep.qpn,
            psn: ep.psn,
            gid: ep.gid.0,
            lid: ep.lid,
            mtu: ep.mtu.bytes() as u16,
        };
        send(
            &mut stream,
            Message::Offer(Handshake {
                qps: vec![info],
                regions: vec![],
            }),
        );
        let Message::Accept(accept) = recv(&mut stream) else {
            panic!("no accept")
        };
        let theirs = &accept.qps[0];
        qp.connect(&QpEndpoint {
            qpn: theirs.qpn,
            psn: theirs.psn,
            gid: Gid(theirs.gid),
            lid: theirs.lid,
            mtu: Mtu::from_bytes(u32::from(theirs.mtu)).unwrap(),
        })
        .unwrap();
        send(&mut stream, Message::Ready { proof: None });
        assert_eq!(recv(&mut stream), Message::Ready { proof: None });
        RawClient {
            stream,
            _qp: qp,
            _cq: cq,
        }
    }
}

/// `check_peer` and how long it took.
fn timed_check(endpoint: &mut Endpoint) -> (PeerStatus, Duration) {
    let start = Instant::now();
    let status = endpoint.check_peer();
    (status, start.elapsed())
}

verbs_test! {
    fn check_peer_never_blocks_on_a_control_frame_that_arrives_in_pieces() {
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        let srv = ServerSession::bind("127.0.0.1:0", &pd, ServerConfig::insecure_open()).unwrap();
        let mut raw = RawClient::connect(srv.local_addr(), &pd);
        let mut served = srv.accept_timeout(DEADLINE).expect("server side");
        let goodbye = Message::Disconnect { code: 42 }.encode().unwrap();
        // One byte at a time; check_peer must not wait for the rest.
        // (A bound well under that, and well over a TCG guest's
        // scheduling hiccups, also in a slow boot.)
        const NOT_BLOCKED: Duration = Duration::from_secs(1);
        for byte in &goodbye[..goodbye.len() - 1] {
            raw.stream.write_all(std::slice::from_ref(byte)).unwrap();
            thread::sleep(Duration::from_millis(20));
            let (status, took) = timed_check(&mut served);
            assert!(matches!(status, PeerStatus::Alive), "{status:?}");
            assert!(took < NOT_BLOCKED, "check_peer blocked for {took:?}");
        }
        raw.stream.write_all(&goodbye[goodbye.len() - 1..]).unwrap();
        thread::sleep(Duration::from_millis(20));
        assert!(matches!(served.check_peer(), PeerStatus::Disconnected { code: 42 }));

        // An oversized frame on an established link is refused by its
        // header, without buffering it.
        let mut raw = RawClient::connect(srv.local_addr(), &pd);
        let mut served = srv.accept_timeout(DEADLINE).expect("server side");
        let mut big = Message::Disconnect { code: 1 }.encode().unwrap();
        big[8..12].copy_from_slice(&(1u32 << 20).to_le_bytes());
        raw.stream.write_all(&big[..12]).unwrap();
        thread::sleep(Duration::from_millis(20));
        let (status, took) = timed_check(&mut served);
        assert!(matches!(&status, PeerStatus::Lost(Error::PeerGone { .. })), "{status:?}");
        assert!(took < NOT_BLOCKED, "{took:?}");

        // Before admission a frame may be no larger than a hello can be: a
        // stranger announcing 20 KiB is refused on the header alone.
        let mut stranger = TcpStream::connect(srv.local_addr()).unwrap();
        let mut header = Message::Disconnect { code: 0 }.encode().unwrap();
        header[6..8].copy_from_slice(&1u16.to_le_bytes());
        header[8..12].copy_from_slice(&(20u32 << 10).to_le_bytes());
        stranger.write_all(&header[..12]).unwrap();
        let failure = wait_failure(&srv);
        assert!(failure.error.to_string().contains("exceeds the maximum of 17408"), "{}", failure.error);
    }
}

fn write_key(name: &str, byte: u8) -> std::path::PathBuf {
    let dir = std::env::current_dir()
        .unwrap()
        .join("target")
        .join("strangers");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, [byte; 32]).unwrap();
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    path
}

verbs_test! {
    fn the_tools_take_an_auth_key_file_and_name_the_peer_on_a_mismatch() {
        let server_key = write_key("server.key", 5);
        let other_key = write_key("other.key", 6);
        let key_arg = server_key.to_str().unwrap();
        let (mut server, addr) = start_server(&["--auth-key-file", key_arg]);

        let run = |extra: &[&str]| {
            let out = std::process::Command::new(example_binary("ping_pong"))
                .args(["--connect", &addr.to_string(), "--iters", "50"])
                .args(extra)
                .env_remove(AUTH_KEY_ENV)
                .output()
                .unwrap();
            let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
            (out.status.success(), text)
        };
        let (ok, out) = run(&["--auth-key-file", key_arg]);
        assert!(ok && out.contains("50 round trips, 0 mismatches"), "{out}");
        server.expect_line("done: 50 messages verified and echoed");

        let (ok, out) = run(&["--auth-key-file", other_key.to_str().unwrap()]);
        assert!(!ok, "a wrong key connected: {out}");
        assert!(out.contains("authentication with") && out.contains(&addr.to_string()), "{out}");

        let (ok, out) = run(&["--insecure"]);
        assert!(!ok, "a client without a key connected: {out}");
        assert!(out.contains("requires authentication"), "{out}");
        server.expect_lines("authentication", 2);

        // Neither a key nor --insecure: refused before anything is opened,
        // with the ways out named.
        assert_refused_without_a_key(
            example_binary("ping_pong"),
            &["--connect", &addr.to_string(), "--iters", "50"],
        );
    }
}

/// WRITEs `bytes` at `offset` of `target` from `endpoint`'s first QP (private
/// CQ); the completion.
fn write_through(
    pd: &ProtectionDomain,
    endpoint: &mut Endpoint,
    target: RemoteRegion,
    offset: u64,
    bytes: &[u8],
) -> WorkCompletion {
    let mut pool = rdma_comm_core::pool::BufferPool::new(pd, 256, 1, AccessFlags::empty()).unwrap();
    let mut slot = pool.acquire().unwrap();
    pool.bytes_mut(&mut slot).unwrap()[..bytes.len()].copy_from_slice(bytes);
    let qp = endpoint.qp_at(0).unwrap();
    pool.post_write(
        qp.qp_mut(),
        slot,
        target.slice(offset, bytes.len() as u64).unwrap(),
        None,
    )
    .unwrap();
    let wc = wait_for(qp.cq_mut().unwrap(), 1)[0];
    let _ = pool.complete(&wc);
    wc
}

verbs_test! {
    fn a_peer_reaches_only_the_memory_exported_to_it() {
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        let mut config = ServerConfig::insecure_open();
        config.qp.remote_access = AccessFlags::REMOTE_WRITE;
        // Each peer gets an inbox of its own, in the one PD all peers share.
        let inboxes = Arc::new(Mutex::new(Vec::new()));
        let made = Arc::clone(&inboxes);
        config.exports = Some(Arc::new(move |peer, pd: &ProtectionDomain| {
            let inbox = Arc::new(pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND)?);
            made.lock().unwrap().push((peer, Arc::clone(&inbox)));
            Ok(vec![Export::shared(1, "inbox", inbox, AccessFlags::REMOTE_WRITE)])
        }));
        let srv = ServerSession::bind("127.0.0.1:0", &pd, config).unwrap();
        let mut a = ClientSession::connect(srv.local_addr(), &pd, &client_config(None)).unwrap();
        let _a_served = srv.accept_timeout(DEADLINE).unwrap();
        let mut b = ClientSession::connect(srv.local_addr(), &pd, &client_config(None)).unwrap();
        let _b_served = srv.accept_timeout(DEADLINE).unwrap();
        // A connected first, so its inbox was made first.
        let (a_inbox, b_inbox) = {
            let made = inboxes.lock().unwrap();
            (Arc::clone(&made[0].1), Arc::clone(&made[1].1))
        };
        let a_target = a.remote_region("inbox").unwrap();
        let b_target = b.remote_region("inbox").unwrap();
        assert_ne!(a_target.rkey(), b_target.rkey(), "each peer has a key of its own");

        // Each peer writes its own inbox.
        assert!(write_through(&pd, &mut a, a_target, 0, b"from a").ok().is_ok());
        assert!(write_through(&pd, &mut b, b_target, 0, b"from b").ok().is_ok());
        assert_eq!(read_back(&a_inbox, 0, 6), b"from a");
        assert_eq!(read_back(&b_inbox, 0, 6), b"from b");

        // B, holding A's exact descriptor, gets a remote access error, and
        // A's inbox is untouched.
        let stolen = write_through(&pd, &mut b, a_target, 0, b"evil b");
        assert_eq!(stolen.status(), WcStatus::REM_ACCESS_ERR, "{stolen:?}");
        assert_eq!(read_back(&a_inbox, 0, 6), b"from a");

        // A goes on unaffected.
        for round in 0..20u8 {
            let wc = write_through(&pd, &mut a, a_target, 64, &[round; 8]);
            assert!(wc.ok().is_ok(), "A's write {round}: {wc:?}");
        }
        assert_eq!(read_back(&a_inbox, 64, 8), [19u8; 8]);
    }
}

/// Posts `request` (signaled) on `endpoint`'s QP `index` (private CQ); the
/// completion.
fn post_through(endpoint: &mut Endpoint, index: usize, request: WorkRequest<'_>) -> WorkCompletion {
    let qp = endpoint.qp_at(index).unwrap();
    qp.qp_mut().post_send(&mut request.signaled()).unwrap();
    wait_for(qp.cq_mut().unwrap(), 1)[0]
}

verbs_test! {
    fn a_peer_addresses_offsets_into_its_window_and_never_learns_our_addresses() {
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        let rw = AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
        let mut config = insecure(ServerConfig::default());
        config.qp.remote_access = rw;
        let inbox = Arc::new(pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND).unwrap());
        let exported = Arc::clone(&inbox);
        config.exports = Some(Arc::new(move |_, _: &ProtectionDomain| {
            Ok(vec![Export::new(1, "inbox", &*exported, rw)])
        }));
        let srv = ServerSession::bind("127.0.0.1:0", &pd, config).unwrap();
        // A refused access ends its QP: one QP for the accesses inside the
        // window, one each for a WRITE and a READ past its end.
        let specs = vec![QpSpec::new("inside"), QpSpec::new("write-past"), QpSpec::new("read-past")];
        let mut client = ClientSession::connect(srv.local_addr(), &pd, &ClientConfig::new(specs)).unwrap();
        let _served = srv.accept_timeout(DEADLINE).unwrap();

        // What the peer received: a base of 0 on every QP, not the
        // inbox's virtual address.
        let named = client.remote_regions()[0].clone();
        assert_ne!(inbox.addr(), 0);
        assert_eq!(
            (named.region.addr(), named.region.len()),
            (0, 4096),
            "the peer was told our address {:#x}",
            inbox.addr()
        );
        for qp in 0..3 {
            assert_eq!(named.on_qp(qp).unwrap().addr(), 0, "QP {qp}");
        }
        let target = named.region;

        // WRITE and READ at offsets inside the window, up to its last byte.
        let mut src = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
        let dst = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
        src.write(0, &pattern(11, 64)).unwrap();
        src.write(64, &pattern(12, 8)).unwrap();
        let write = WorkRequest::write(1, src.slice(0, 64).unwrap(), target.slice(100, 64).unwrap()).unwrap();
        assert!(post_through(&mut client, 0, write).ok().is_ok(), "WRITE at offset 100");
        let write = WorkRequest::write(2, src.slice(64, 8).unwrap(), target.slice(4088, 8).unwrap()).unwrap();
        assert!(post_through(&mut client, 0, write).ok().is_ok(), "WRITE of the last 8 bytes");
        assert_eq!(read_back(&inbox, 100, 64), pattern(11, 64));
        assert_eq!(read_back(&inbox, 4088, 8), pattern(12, 8));
        let read = WorkRequest::read(3, dst.slice(0, 64).unwrap(), target.slice(100, 64).unwrap()).unwrap();
        assert!(post_through(&mut client, 0, read).ok().is_ok(), "READ at offset 100");
        let read = WorkRequest::read(4, dst.slice(64, 8).unwrap(), target.slice(4088, 8).unwrap()).unwrap();
        assert!(post_through(&mut client, 0, read).ok().is_ok(), "READ of the last 8 bytes");
        assert_eq!(read_back(&dst, 0, 64), pattern(11, 64));
        assert_eq!(read_back(&dst, 64, 8), pattern(12, 8));

        // Past the window's end, with the local bounds check out of the way
        // (a descriptor claiming twice the length): the device refuses.
        let forged = |qp: usize| RemoteRegion::new(0, 8192, named.rkeys[qp]);
        src.write(128, &[0xee; 8]).unwrap();
        let write = WorkRequest::write(5, src.slice(128, 8).unwrap(), forged(1).slice(4092, 8).unwrap()).unwrap();
        let wc = post_through(&mut client, 1, write);
        assert_eq!(wc.status(), WcStatus::REM_ACCESS_ERR, "WRITE across the window's end: {wc:?}");
        assert_eq!(read_back(&inbox, 4088, 8), pattern(12, 8), "nothing was written");
        let read = WorkRequest::read(6, dst.slice(128, 8).unwrap(), forged(2).slice(4096, 8).unwrap()).unwrap();
        let wc = post_through(&mut client, 2, read);
        assert_eq!(wc.status(), WcStatus::REM_ACCESS_ERR, "READ past the window's end: {wc:?}");
        assert_eq!(read_back(&dst, 128, 8), vec![0; 8], "nothing was read");
    }
}
