//! Sessions in one process: handshakes, bad input, retries, close, shared CQs,
//! and the buffer pool. Gated as described in `tests/util/mod.rs`, except
//! the test of pool slots, which needs no NIC and runs on the in-process
//! loopback device ([`Context::loopback`]) in every `cargo test`.

mod util;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use rdma_comm_core::Error;
use rdma_comm_core::pool::BufferPool;
use rdma_comm_core::session::wire::{FRAME_HEADER_LEN, MAGIC, VERSION, WireError};
use rdma_comm_core::session::*;
use rdma_comm_core::verbs::*;
use util::*;

fn server(pd: &ProtectionDomain, config: ServerConfig) -> ServerSession {
    ServerSession::bind("127.0.0.1:0", pd, config).expect("bind")
}

fn client_config(names: &[&str]) -> ClientConfig {
    let mut config = ClientConfig::new(names.iter().map(|n| QpSpec::new(*n)).collect());
    config.connect_deadline = Duration::from_secs(10);
    config
}

fn header(version: u16, kind: u16, len: u32) -> Vec<u8> {
    let mut h = Vec::with_capacity(FRAME_HEADER_LEN);
    h.extend_from_slice(&MAGIC.to_le_bytes());
    h.extend_from_slice(&version.to_le_bytes());
    h.extend_from_slice(&kind.to_le_bytes());
    h.extend_from_slice(&len.to_le_bytes());
    h
}

/// Connects and sends `bytes`, then holds the socket until the server hangs up.
fn stray(addr: SocketAddr, bytes: Vec<u8>) -> thread::JoinHandle<()> {
    thread::spawn(move || {
        let mut stream = TcpStream::connect(addr).unwrap();
        let _ = stream.write_all(&bytes);
        let _ = stream.shutdown(std::net::Shutdown::Write);
        let mut sink = Vec::new();
        let _ = stream.set_read_timeout(Some(DEADLINE));
        let _ = stream.read_to_end(&mut sink);
    })
}

verbs_test! {
    fn stray_and_broken_clients_are_rejected_while_real_clients_connect() {
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        let srv = server(&pd, ServerConfig { handshake_timeout: Duration::from_secs(3), ..ServerConfig::insecure_open() });
        let addr = srv.local_addr();

        // A silent client connects first and says nothing.
        let silent = TcpStream::connect(addr).unwrap();
        let strays = vec![
            stray(addr, b"GET / HTTP/1.1\r\nHost: rdma\r\n\r\n".to_vec()),
            stray(addr, [header(VERSION, 1, 100), vec![0; 10]].concat()),
            stray(addr, header(VERSION, 1, u32::MAX)),
            stray(addr, header(9, 1, 0)),
        ];

        // Real clients complete while the silent one still holds its connection.
        let client_pd = pd.clone();
        let real = thread::spawn(move || {
            (0..3)
                .map(|_| ClientSession::connect(addr, &client_pd, &client_config(&["data"])).expect("real client connects"))
                .collect::<Vec<_>>()
        });
        let mut clients = real.join().unwrap();
        for client in &mut clients {
            let mut served = srv.accept_timeout(DEADLINE).expect("server side of a real client");
            exchange(&pd, client, &mut served, b"real traffic");
        }
        for handle in strays {
            handle.join().unwrap();
        }

        // Every bad connection produced one named, typed failure; the silent one
        // after the handshake timeout.
        let start = std::time::Instant::now();
        let mut failures = Vec::new();
        while failures.len() < 5 && start.elapsed() < DEADLINE {
            failures.extend(srv.take_failures());
            thread::sleep(Duration::from_millis(50));
        }
        assert_eq!(failures.len(), 5, "{failures:?}");
        let wire = |f: &HandshakeFailure| match &f.error {
            Error::Handshake { source, peer } => {
                assert_eq!(peer.ip(), addr.ip(), "failure names the peer");
                source.to_string()
            }
            other => panic!("expected a handshake error, got {other}"),
        };
        let texts: Vec<String> = failures.iter().map(wire).collect();
        for expected in ["bad magic", "truncated", "exceeds the maximum", "unsupported protocol version 9", "timed out"] {
            assert!(texts.iter().any(|t| t.contains(expected)), "no failure mentions {expected:?}: {texts:?}");
        }
        drop(silent);
    }
}

fn is_timeout(error: &Error) -> bool {
    matches!(error, Error::Handshake { source: WireError::Io(e), .. } if e.kind() == std::io::ErrorKind::TimedOut)
}

verbs_test! {
    fn client_retries_until_the_server_appears_and_ipv6_works() {
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        // Find a free port, then start the server on it only after the client began.
        let port = TcpListener::bind("[::1]:0").unwrap().local_addr().unwrap().port();
        let client_pd = pd.clone();
        let client = thread::spawn(move || ClientSession::connect(("::1", port), &client_pd, &client_config(&["a"])));
        thread::sleep(Duration::from_millis(300));
        let srv = ServerSession::bind(("::1", port), &pd, ServerConfig::insecure_open()).unwrap();
        let mut served = srv.accept_timeout(DEADLINE).expect("accepted after retries");
        let mut endpoint = client.join().unwrap().expect("client connected after retries");
        assert!(endpoint.peer().is_ipv6());
        exchange(&pd, &mut served, &mut endpoint, b"over IPv6 control");
    }
}

/// Listens in front of `server`: cuts the first `cut` connections at once
/// (as a server whose hello deadline ran out does), then relays every later
/// one to `server` both ways, or with `then_stop`, stops listening.
fn cutting_relay(server: SocketAddr, cut: usize, then_stop: bool) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    thread::spawn(move || {
        for (n, client) in listener.incoming().enumerate() {
            let Ok(client) = client else { return };
            if n < cut {
                drop(client);
                if n + 1 == cut && then_stop {
                    return;
                }
                continue;
            }
            let Ok(upstream) = TcpStream::connect(server) else {
                return;
            };
            for (mut from, mut to) in [
                (client.try_clone().unwrap(), upstream.try_clone().unwrap()),
                (upstream, client),
            ] {
                thread::spawn(move || {
                    let _ = std::io::copy(&mut from, &mut to);
                    let _ = to.shutdown(std::net::Shutdown::Write);
                });
            }
        }
    });
    addr
}

verbs_test! {
    /// A server that cuts a handshake without a word (its hello deadline ran
    /// out while the client was slow) is tried again within the connect
    /// deadline; one that keeps cutting leaves the client with the cut once
    /// the deadline has passed, and one that cuts and stops listening (its
    /// peer limit reached) at once.
    fn a_handshake_the_server_cut_is_tried_again() {
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        let srv = server(&pd, ServerConfig::insecure_open());
        let relay = cutting_relay(srv.local_addr(), 2, false);
        let mut endpoint = ClientSession::connect(relay, &pd, &client_config(&["a"])).expect("connected on the third try");
        let mut served = srv.accept_timeout(DEADLINE).expect("the server's side");
        exchange(&pd, &mut endpoint, &mut served, b"after two cuts");
        assert!(srv.take_failures().is_empty(), "the server itself refused nothing");
        assert!(srv.try_accept().is_none(), "one session for one connect");
        assert_eq!(srv.pending_handshakes(), 0);

        let is_cut = |err: &Error| {
            matches!(err, Error::Handshake { source: WireError::Io(io), .. }
                if matches!(io.kind(), std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset))
        };
        let always = cutting_relay(srv.local_addr(), usize::MAX, false);
        let mut config = client_config(&["a"]);
        config.connect_deadline = Duration::from_millis(600);
        let started = std::time::Instant::now();
        let err = ClientSession::connect(always, &pd, &config).unwrap_err();
        assert!(is_cut(&err), "{err}");
        assert!(started.elapsed() < Duration::from_secs(5), "gave up within the deadline: {:?}", started.elapsed());

        let gone = cutting_relay(srv.local_addr(), 1, true);
        config.connect_deadline = Duration::from_secs(30);
        let started = std::time::Instant::now();
        let err = ClientSession::connect(gone, &pd, &config).unwrap_err();
        assert!(is_cut(&err), "the cut, not the refused reconnect: {err}");
        assert!(started.elapsed() < Duration::from_secs(5), "not the whole deadline: {:?}", started.elapsed());
    }
}

verbs_test! {
    fn client_reports_a_server_that_never_answers() {
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        // Nobody listening at all.
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let mut config = client_config(&["a"]);
        config.connect_deadline = Duration::from_millis(500);
        let err = ClientSession::connect(("127.0.0.1", port), &pd, &config).unwrap_err();
        assert!(matches!(err, Error::ConnectTimeout { attempts, .. } if attempts > 1), "{err}");
        assert!(err.to_string().contains(&port.to_string()), "{err}");

        // Something accepts TCP but never speaks the protocol.
        let mute = TcpListener::bind("127.0.0.1:0").unwrap();
        let mute_addr = mute.local_addr().unwrap();
        config.handshake_timeout = Duration::from_millis(500);
        let err = ClientSession::connect(mute_addr, &pd, &config).unwrap_err();
        assert!(is_timeout(&err), "{err}");
        assert!(err.to_string().contains(&mute_addr.to_string()), "{err}");
        drop(mute);
    }
}

verbs_test! {
    fn server_rejects_a_request_it_cannot_serve() {
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        let srv = server(&pd, ServerConfig { max_qps: 2, ..ServerConfig::insecure_open() });
        let err = ClientSession::connect(srv.local_addr(), &pd, &client_config(&["a", "b", "c"])).unwrap_err();
        assert!(matches!(&err, Error::Rejected { code: 1, reason, .. } if reason.contains("3 QPs")), "{err}");
        // Duplicate names are refused before anything is sent.
        let err = ClientSession::connect(srv.local_addr(), &pd, &client_config(&["a", "a"])).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        // The server still serves.
        let _client = ClientSession::connect(srv.local_addr(), &pd, &client_config(&["a", "b"])).unwrap();
        let served = srv.accept_timeout(DEADLINE).unwrap();
        assert_eq!(served.qps().len(), 2);
        assert_eq!(served.qps()[1].name(), "b");
    }
}

verbs_test! {
    fn graceful_close_drains_outstanding_work_and_tells_the_peer() {
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        let srv = server(&pd, ServerConfig::insecure_open());
        let mut client = ClientSession::connect(srv.local_addr(), &pd, &client_config(&["a"])).unwrap();
        let mut served = srv.accept_timeout(DEADLINE).unwrap();
        assert!(matches!(served.check_peer(), PeerStatus::Alive));

        let rx = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
        for i in 0..5 {
            client.qp_at(0).unwrap().qp_mut().post_recv(&mut RecvRequest::new(i, rx.slice(0, 64).unwrap()).unwrap()).unwrap();
        }
        let report = client.close().unwrap();
        assert!(report.peer_notified);
        assert_eq!(report.drained.len(), 5, "{:?}", report.drained);
        assert!(report.drained.iter().all(|wc| wc.status() == WcStatus::WR_FLUSH_ERR));

        let status = (0..100)
            .map(|_| {
                thread::sleep(Duration::from_millis(20));
                served.check_peer()
            })
            .find(|s| !matches!(s, PeerStatus::Alive));
        assert!(matches!(status, Some(PeerStatus::Disconnected { code: 0 })), "{status:?}");
    }
}

verbs_test! {
    fn a_reason_code_sent_before_an_abort_reaches_the_peer_once() {
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        let srv = server(&pd, ServerConfig::insecure_open());
        let mut client = ClientSession::connect(srv.local_addr(), &pd, &client_config(&["a"])).unwrap();
        let mut served = srv.accept_timeout(DEADLINE).unwrap();
        assert!(client.send_disconnect(0x8002));
        assert!(client.send_disconnect(0x8003), "a repeat call reports the first message");
        drop(client);

        let statuses: Vec<PeerStatus> = (0..100)
            .map(|_| {
                thread::sleep(Duration::from_millis(20));
                served.check_peer()
            })
            .filter(|s| !matches!(s, PeerStatus::Alive))
            .take(2)
            .collect();
        assert!(matches!(statuses[0], PeerStatus::Disconnected { code: 0x8002 }), "{statuses:?}");
        // The drop sent no second disconnect: after the first, only the end of the stream.
        assert!(matches!(statuses.get(1), Some(PeerStatus::Lost(_))), "{statuses:?}");
    }
}

verbs_test! {
    fn channels_on_a_shared_cq_are_addressable_by_index_and_name() {
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        let mut shared = ctx.create_cq(256, None).unwrap();
        let srv = server(&pd, ServerConfig::insecure_open());
        let specs = ["control", "bulk"]
            .iter()
            .map(|name| QpSpec { cq: CqChoice::Shared(shared.shared()), ..QpSpec::new(*name) })
            .collect();
        let mut config = client_config(&[]);
        config.qps = specs;
        let mut client = ClientSession::connect(srv.local_addr(), &pd, &config).unwrap();
        let mut served = srv.accept_timeout(DEADLINE).unwrap();
        assert!(client.qp_by_name("bulk").unwrap().cq_mut().is_none(), "shared CQ is polled by its owner");
        let qpns: Vec<u32> = client.qps().iter().map(|c| c.qp().qpn()).collect();

        let mut tx = pd.alloc_mr(64, AccessFlags::empty()).unwrap();
        let rx = pd.alloc_mr(128, AccessFlags::LOCAL_WRITE).unwrap();
        for (i, channel) in served.qps_mut().iter_mut().enumerate() {
            channel.qp_mut().post_recv(&mut RecvRequest::new(i as u64, rx.slice(i * 64, 64).unwrap()).unwrap()).unwrap();
        }
        for (i, name) in ["control", "bulk"].iter().enumerate() {
            tx.write(i, &[i as u8 + 1]).unwrap();
            let qp = client.qp_by_name(name).unwrap().qp_mut();
            qp.post_send(&mut WorkRequest::send(i as u64, tx.slice(i, 1).unwrap()).signaled()).unwrap();
        }
        let done = wait_for(&mut shared, 2);
        let mut seen: Vec<u32> = done.iter().map(|wc| wc.ok().unwrap().qp_num()).collect();
        seen.sort();
        let mut expected = qpns.clone();
        expected.sort();
        assert_eq!(seen, expected, "both channels completed on the shared CQ");
        for i in 0..2 {
            let wc = wait_ok(served.qp_at(i).unwrap().cq_mut().unwrap());
            assert_eq!(read_back(&rx, wc.wr_id() as usize * 64, 1), [wc.wr_id() as u8 + 1]);
        }
    }
}

verbs_test! {
    fn exported_regions_reach_the_peer_with_least_privilege() {
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        let server_inbox = Arc::new(pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND).unwrap());
        let inbox_for_server = Arc::clone(&server_inbox);
        let mut config = ServerConfig::insecure_open();
        config.qp.remote_access = AccessFlags::REMOTE_WRITE;
        config.exports = Some(Arc::new(move |_peer, _pd: &ProtectionDomain| Ok(vec![Export::new(7, "inbox", &inbox_for_server, AccessFlags::REMOTE_WRITE)])));
        let srv = server(&pd, config);
        let mut client = ClientSession::connect(srv.local_addr(), &pd, &client_config(&["a"])).unwrap();
        let served = srv.accept_timeout(DEADLINE).unwrap();

        let regions = client.remote_regions().to_vec();
        assert_eq!(regions.len(), 1);
        assert_eq!((regions[0].id, regions[0].name.as_str(), regions[0].region.len()), (7, "inbox", 4096));
        let target = client.remote_region("inbox").unwrap();
        assert!(matches!(target.slice(4090, 7), Err(Error::OutOfBounds { .. })), "bounds-checked before posting");

        let mut pool = BufferPool::new(&pd, 256, 4, AccessFlags::empty()).unwrap();
        let mut slot = pool.acquire().unwrap();
        pool.bytes_mut(&mut slot).unwrap()[..5].copy_from_slice(b"hello");
        let channel = client.qp_at(0).unwrap();
        pool.post_write(channel.qp_mut(), slot, target.slice(100, 5).unwrap(), None).unwrap();
        let wc = wait_ok(channel.cq_mut().unwrap());
        let slot = pool.complete(&wc).unwrap();
        pool.release(slot).unwrap();
        assert_eq!(read_back(&server_inbox, 100, 5), b"hello");

        // Only memory that windows can grant, and only remote rights, can be
        // exported: not memory without MW_BIND, not memory with rights of
        // its own (its rkey would reach it from any QP), not local rights.
        let plain = Arc::new(pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap());
        let open = Arc::new(pd.alloc_mr(64, AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND | AccessFlags::REMOTE_WRITE).unwrap());
        let fine = Arc::new(pd.alloc_mr(64, AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND).unwrap());
        for export in [
            Export::new(1, "plain", &plain, AccessFlags::REMOTE_WRITE),
            Export::new(1, "open", &open, AccessFlags::REMOTE_WRITE),
            Export::new(1, "local", &fine, AccessFlags::LOCAL_WRITE),
            Export::new(1, "nothing", &fine, AccessFlags::empty()),
        ] {
            let config = client_config(&["a"]).with_exports(vec![export.clone()]);
            assert!(
                matches!(ClientSession::connect(srv.local_addr(), &pd, &config), Err(Error::InvalidArgument(_))),
                "{export:?}"
            );
        }
        drop(served);
    }
}

#[test]
fn pool_slots_stay_out_of_circulation_until_their_completion() {
    // SAFETY: this thread posts to both QPs, polls both CQs and touches
    // every byte.
    let mut p = Pair::on(unsafe { Context::loopback() }, &QpConfig::default());
    let mut pool = BufferPool::new(&p.pd, 1000, 8, AccessFlags::LOCAL_WRITE).unwrap();
    assert_eq!(pool.slot_size(), 1024, "slots are rounded to cache lines");
    let mut recvs = BufferPool::new(&p.pd, 1024, 8, AccessFlags::LOCAL_WRITE).unwrap();
    while let Some(slot) = recvs.acquire() {
        recvs.post_recv(&mut p.b, slot).unwrap();
    }
    for i in 0..8u8 {
        let mut slot = pool.acquire().unwrap();
        pool.bytes_mut(&mut slot).unwrap().fill(i);
        pool.post_send(&mut p.a, slot, 1000, Some(u32::from(i)))
            .unwrap();
    }
    assert_eq!((pool.available(), pool.in_flight()), (0, 8));
    assert!(pool.acquire().is_none(), "every slot is in flight");

    let done = wait_for(&mut p.cq_a, 8);
    for wc in &done {
        let slot = pool.complete(wc).expect("completion returns its slot");
        assert!(
            pool.complete(wc).is_none(),
            "a completion returns its slot once"
        );
        pool.release(slot).unwrap();
    }
    assert_eq!((pool.available(), pool.in_flight()), (8, 0));

    for wc in wait_for(&mut p.cq_b, 8) {
        let slot = recvs.complete(&wc).unwrap();
        let imm = wc.imm().unwrap() as u8;
        assert!(
            recvs.bytes(&slot).unwrap()[..1000]
                .iter()
                .all(|&b| b == imm)
        );
        recvs.release(slot).unwrap();
    }
}

verbs_test! {
    fn waiting_for_a_peer_sleeps_until_it_says_goodbye() {
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        let srv = server(&pd, ServerConfig::insecure_open());
        let mut client = ClientSession::connect(srv.local_addr(), &pd, &client_config(&["a"])).unwrap();
        let mut served = srv.accept_timeout(DEADLINE).unwrap();

        // A live, quiet peer: the wait takes its whole timeout.
        let start = std::time::Instant::now();
        let status = served.link_mut().wait_for_peer(Duration::from_millis(200));
        assert!(matches!(status, PeerStatus::Alive), "{status:?}");
        assert!(start.elapsed() >= Duration::from_millis(200), "{:?}", start.elapsed());

        // A goodbye sent meanwhile ends a long wait at once.
        let goodbye = thread::spawn(move || {
            thread::sleep(Duration::from_millis(100));
            assert!(client.send_disconnect(0x8004));
            client
        });
        let start = std::time::Instant::now();
        let status = served.link_mut().wait_for_peer(Duration::from_secs(20));
        let took = start.elapsed();
        assert!(matches!(status, PeerStatus::Disconnected { code: 0x8004 }), "{status:?}");
        // Far below the 20 s wait, with room for a slow guest.
        assert!(took < Duration::from_secs(8), "woken by the goodbye, not a timer: {took:?}");
        drop(goodbye.join().unwrap());
    }
}

verbs_test! {
    fn a_pending_handshake_limit_of_usize_max_still_binds() {
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        // The server reserves its tables of handshakes in progress for a
        // capped number of them, so "no limit" is not a reservation that
        // cannot be had.
        let config = ServerConfig { max_pending_handshakes: usize::MAX, ..ServerConfig::insecure_open() };
        let srv = server(&pd, config);
        let addr = srv.local_addr();
        let (client, accepted) = thread::scope(|scope| {
            let client = scope.spawn(|| ClientSession::connect(addr, &pd, &client_config(&["a"])));
            (client.join().unwrap(), srv.accept())
        });
        client.expect("a client of the unlimited server connects");
        assert!(accepted.is_some(), "the server accepts it");
    }
}
