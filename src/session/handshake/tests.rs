//! The state machines against scripted and hostile peers, and against each
//! other (no device: the resources are counted, not created).

use std::sync::mpsc;
use std::time::Duration;

use proptest::prelude::*;

use super::*;
use crate::session::wire::{PROOF_LEN, QpInfo, RegionInfo};

fn addr() -> SocketAddr {
    "192.0.2.7:4000".parse().unwrap()
}

/// Plays back frames; then times out like a silent peer.
struct Script {
    incoming: std::vec::IntoIter<Vec<u8>>,
    sent: Vec<Message>,
    /// Frames received when the handshake called `admitted` and `proven`.
    admitted_after: Option<usize>,
    proven_after: Option<usize>,
    received: usize,
}

impl Script {
    fn new(frames: Vec<Vec<u8>>) -> Self {
        Self {
            incoming: frames.into_iter(),
            sent: Vec::new(),
            admitted_after: None,
            proven_after: None,
            received: 0,
        }
    }
}

impl FrameIo for Script {
    fn peer(&self) -> SocketAddr {
        addr()
    }
    fn send_frame(&mut self, frame: &[u8]) -> std::result::Result<(), WireError> {
        let (message, used) = Message::decode(frame).expect("we send valid frames");
        assert_eq!(used, frame.len());
        self.sent.push(message);
        Ok(())
    }
    fn admitted(&mut self) {
        self.admitted_after.get_or_insert(self.received);
    }
    fn proven(&mut self) {
        self.proven_after.get_or_insert(self.received);
    }
    fn recv_frame(&mut self) -> std::result::Result<Vec<u8>, WireError> {
        self.received += 1;
        self.incoming.next().ok_or_else(|| {
            WireError::Io(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "script over",
            ))
        })
    }
}

/// One end of an in-memory connection.
struct Pipe {
    tx: mpsc::Sender<Vec<u8>>,
    rx: mpsc::Receiver<Vec<u8>>,
}

fn pipe() -> (Pipe, Pipe) {
    let (a_tx, a_rx) = mpsc::channel();
    let (b_tx, b_rx) = mpsc::channel();
    (Pipe { tx: a_tx, rx: b_rx }, Pipe { tx: b_tx, rx: a_rx })
}

impl FrameIo for Pipe {
    fn peer(&self) -> SocketAddr {
        addr()
    }
    fn send_frame(&mut self, frame: &[u8]) -> std::result::Result<(), WireError> {
        // Like a socket's buffer: a frame sent after the peer left is
        // not an error yet.
        let _ = self.tx.send(frame.to_vec());
        Ok(())
    }
    fn recv_frame(&mut self) -> std::result::Result<Vec<u8>, WireError> {
        self.rx
            .recv_timeout(Duration::from_secs(5))
            .map_err(|_| WireError::Truncated("header"))
    }
}

/// Counts what would have been created.
#[derive(Default)]
struct Counted {
    built: usize,
    connected: usize,
    qps: usize,
    /// The peer handshake `connect` was given.
    connected_to: Option<Handshake>,
}

impl Resources for Counted {
    fn build(&mut self, offer: Option<&Handshake>) -> Result<Handshake> {
        self.built += 1;
        let qps = offer.map_or(self.qps, |offer| offer.qps.len());
        Ok(Handshake {
            qps: (0..qps)
                .map(|i| QpInfo {
                    name: format!("qp{i}"),
                    qpn: 10 + i as u32,
                    psn: 1,
                    gid: [0; 16],
                    lid: 0,
                    mtu: 1024,
                })
                .collect(),
            regions: vec![RegionInfo {
                id: 1,
                name: "secret".into(),
                addr: 0,
                len: 64,
                rkeys: vec![0x77; qps],
            }],
        })
    }
    fn connect(&mut self, peer: &Handshake) -> Result<()> {
        self.connected += 1;
        self.connected_to = Some(peer.clone());
        Ok(())
    }
}

fn key(byte: u8) -> AuthKey {
    AuthKey::new(&[byte; 32]).unwrap()
}

fn names(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("qp{i}")).collect()
}

/// Runs both sides against each other.
fn pair(
    server_key: Option<AuthKey>,
    client_key: Option<AuthKey>,
    refuse: bool,
) -> (
    Result<Handshake>,
    Result<(Hello, Handshake)>,
    Counted,
    Counted,
) {
    let (mut client_end, mut server_end) = pipe();
    let server = std::thread::spawn(move || {
        let mut resources = Counted::default();
        let result = serve(
            &mut server_end,
            server_key.as_ref(),
            4,
            |_| {
                if refuse {
                    Err(Refusal::unauthorized("not on the list"))
                } else {
                    Ok(())
                }
            },
            &mut resources,
        );
        (result, resources)
    });
    let mut resources = Counted {
        qps: 2,
        ..Counted::default()
    };
    let client = connect(
        &mut client_end,
        client_key.as_ref(),
        "tester",
        names(2),
        &mut resources,
    );
    drop(client_end);
    let (served, server_resources) = server.join().unwrap();
    (client, served, resources, server_resources)
}

#[test]
fn matching_keys_connect_and_each_side_builds_once() {
    for k in [None, Some(key(1))] {
        let (client, server, c, s) = pair(k.clone(), k, false);
        let accept = client.unwrap();
        assert_eq!(accept.regions[0].name, "secret");
        let (hello, offer) = server.unwrap();
        assert_eq!((hello.identity.as_str(), offer.qps.len()), ("tester", 2));
        assert_eq!((c.built, c.connected, s.built, s.connected), (1, 1, 1, 1));
    }
}

#[test]
fn a_wrong_or_missing_key_fails_both_sides_before_anything_is_built() {
    for (server_key, client_key) in [
        (Some(key(1)), Some(key(2))),
        (Some(key(1)), None),
        (None, Some(key(2))),
    ] {
        let (client, server, c, s) = pair(server_key.clone(), client_key.clone(), false);
        let case = format!("server {server_key:?}, client {client_key:?}");
        for err in [client.unwrap_err(), server.unwrap_err()] {
            assert!(
                matches!(err, Error::Unauthenticated { peer, .. } if peer == addr()),
                "{case}: {err}"
            );
        }
        assert_eq!((c.built, s.built), (0, 0), "{case}");
    }
}

#[test]
fn a_refused_peer_is_told_why_and_nothing_is_built() {
    let (client, server, c, s) = pair(Some(key(1)), Some(key(1)), true);
    let err = client.unwrap_err();
    assert!(err.to_string().contains("not on the list"), "{err}");
    assert!(matches!(server, Err(Error::Unauthorized { .. })));
    assert_eq!((c.built, s.built), (0, 0));
}

/// Changes one field of a message (or the message itself); `how`
/// picks which.
fn tamper(message: Message, how: u8) -> Message {
    let flip = |mut p: [u8; PROOF_LEN]| {
        p[usize::from(how)] ^= 0x40;
        p
    };
    let alter = |mut h: Handshake| {
        if how == 0 {
            h.qps[0].qpn ^= 1;
        } else {
            h.regions[0].rkeys[0] ^= 1;
        }
        h
    };
    match message {
        Message::Hello(mut h) => {
            h.identity.push('!');
            Message::Hello(h)
        }
        Message::Challenge { nonce, auth } if how == 0 => Message::Challenge { nonce, auth: !auth },
        Message::Challenge { nonce, auth } => Message::Challenge {
            nonce: flip(nonce),
            auth,
        },
        Message::Proof(p) => Message::Proof(flip(p)),
        Message::Admit => Message::reject(reject_code::BUSY, "injected"),
        Message::Offer(h) => Message::Offer(alter(h)),
        Message::Accept(h) => Message::Accept(alter(h)),
        Message::Ready { .. } if how == 0 => Message::Ready { proof: None },
        Message::Ready { proof } => Message::Ready {
            proof: proof.map(flip),
        },
        other => other,
    }
}

/// Client and server with a man in the middle that alters frame `at`
/// (counted over both directions).
fn tampered_pair(at: usize, how: u8) -> (bool, bool, Counted, Counted) {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let (mut client_end, middle_client) = pipe();
    let (middle_server, mut server_end) = pipe();
    let count = Arc::new(AtomicUsize::new(0));
    let forward = |from: Pipe, to: Pipe, count: Arc<AtomicUsize>| {
        std::thread::spawn(move || {
            while let Ok(frame) = from.rx.recv_timeout(Duration::from_secs(5)) {
                let index = count.fetch_add(1, Ordering::SeqCst);
                let frame = if index == at {
                    let (message, _) = Message::decode(&frame).unwrap();
                    tamper(message, how).encode().unwrap()
                } else {
                    frame
                };
                if to.tx.send(frame).is_err() {
                    break;
                }
            }
        })
    };
    // Frames from the client reach the server's end and back.
    let (c2s_from, s2c_to) = (middle_client, middle_server);
    let a = forward(
        Pipe {
            tx: s2c_to.tx.clone(),
            rx: c2s_from.rx,
        },
        Pipe {
            tx: s2c_to.tx,
            rx: mpsc::channel().1,
        },
        Arc::clone(&count),
    );
    let b = forward(
        Pipe {
            tx: c2s_from.tx.clone(),
            rx: s2c_to.rx,
        },
        Pipe {
            tx: c2s_from.tx,
            rx: mpsc::channel().1,
        },
        count,
    );
    let server = std::thread::spawn(move || {
        let mut resources = Counted::default();
        let ok = serve(
            &mut server_end,
            Some(&key(3)),
            4,
            |_| Ok(()),
            &mut resources,
        )
        .is_ok();
        (ok, resources)
    });
    let mut resources = Counted {
        qps: 2,
        ..Counted::default()
    };
    let client_ok = connect(
        &mut client_end,
        Some(&key(3)),
        "c",
        names(2),
        &mut resources,
    )
    .is_ok();
    drop(client_end);
    let (server_ok, server_resources) = server.join().unwrap();
    let _ = (a.join(), b.join());
    (client_ok, server_ok, resources, server_resources)
}

/// What an honest run exchanges.
fn honest() -> (Handshake, Handshake) {
    let offer = Counted {
        qps: 2,
        ..Counted::default()
    }
    .build(None)
    .unwrap();
    let accept = Counted::default().build(Some(&offer)).unwrap();
    (offer, accept)
}

#[test]
fn with_a_key_no_frame_can_be_altered_in_transit_unnoticed() {
    let (offer, accept) = honest();
    let (client_ok, server_ok, ..) = tampered_pair(usize::MAX, 0);
    assert!(client_ok && server_ok, "the untouched run connects");
    // Hello, Challenge, Proof, Proof, Admit, Offer, Proof, Accept, Proof, Ready, Ready.
    for at in 0..11 {
        for how in 0..2 {
            let (client_ok, server_ok, client, server) = tampered_pair(at, how);
            assert!(
                !(client_ok && server_ok),
                "frame {at} altered ({how}) went unnoticed"
            );
            assert!(
                server
                    .connected_to
                    .as_ref()
                    .is_none_or(|seen| *seen == offer),
                "frame {at} ({how}): the server connected to an altered offer"
            );
            assert!(
                client
                    .connected_to
                    .as_ref()
                    .is_none_or(|seen| *seen == accept),
                "frame {at} ({how}): the client connected to an altered accept"
            );
        }
    }
}

#[test]
fn an_offer_that_differs_from_the_hello_is_refused_before_anything_is_built() {
    let offer = |names: &[&str]| {
        let mut h = Counted {
            qps: names.len(),
            ..Counted::default()
        }
        .build(None)
        .unwrap();
        for (qp, name) in h.qps.iter_mut().zip(names) {
            qp.name = (*name).to_string();
        }
        for region in &mut h.regions {
            region.rkeys.truncate(names.len());
        }
        Message::Offer(h)
    };
    for (said, offered) in [
        (&["qp0"][..], &["qp0", "qp1"][..]),
        (&["qp0"], &["other"]),
        (&["qp0", "qp1"], &["qp1", "qp0"]),
    ] {
        let hello = Message::Hello(Hello {
            nonce: [1; PROOF_LEN],
            identity: "x".into(),
            qps: said.iter().map(|s| s.to_string()).collect(),
        });
        let mut io = Script::new(vec![frame(&hello), frame(&offer(offered))]);
        let mut resources = Counted::default();
        let err = serve(&mut io, None, 4, |_| Ok(()), &mut resources).unwrap_err();
        assert!(matches!(err, Error::Protocol { .. }), "{err}");
        assert_eq!(resources.built, 0, "{said:?} then {offered:?}");
        assert!(
            matches!(
                io.sent.last(),
                Some(Message::Reject {
                    code: reject_code::BAD_REQUEST,
                    ..
                })
            ),
            "{:?}",
            io.sent
        );
    }
}

fn frame(message: &Message) -> Vec<u8> {
    message.encode().unwrap()
}

/// What a stranger without the key may send, in any order.
fn stranger_message() -> impl Strategy<Value = Message> {
    let names = prop::collection::vec("[a-c]{1,2}", 0..6);
    prop_oneof![
        (any::<[u8; PROOF_LEN]>(), names).prop_map(|(nonce, qps)| Message::Hello(Hello {
            nonce,
            identity: "x".into(),
            qps,
        })),
        any::<[u8; PROOF_LEN]>().prop_map(Message::Proof),
        (0usize..3).prop_map(|n| Message::Offer(Handshake {
            qps: (0..n)
                .map(|i| QpInfo {
                    name: ["a", "b", "c"][i].into(),
                    qpn: 5,
                    psn: 5,
                    gid: [0; 16],
                    lid: 0,
                    mtu: 1024,
                })
                .collect(),
            regions: vec![],
        })),
        prop::option::of(any::<[u8; PROOF_LEN]>()).prop_map(|proof| Message::Ready { proof }),
        (any::<[u8; PROOF_LEN]>(), any::<bool>())
            .prop_map(|(nonce, auth)| Message::Challenge { nonce, auth }),
        Just(Message::Accept(Handshake::default())),
        Just(Message::Admit),
        any::<u16>().prop_map(|code| Message::Disconnect { code }),
        (any::<u16>(), "[a-z ]{0,20}").prop_map(|(code, reason)| Message::Reject { code, reason }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2_000, ..ProptestConfig::default() })]

    /// A stranger without the key, sending any sequence of well-formed
    /// messages (or garbage), makes the server create nothing, admit
    /// nothing and reveal nothing; every run ends with an error.
    #[test]
    fn a_keyed_server_gives_a_stranger_nothing(
        script in prop::collection::vec(stranger_message(), 0..8),
        garbage in prop::option::of(prop::collection::vec(any::<u8>(), 0..40)),
    ) {
        let mut frames: Vec<Vec<u8>> = script.iter().map(frame).collect();
        frames.extend(garbage);
        let mut io = Script::new(frames);
        let mut resources = Counted::default();
        let mut admitted = false;
        let result = serve(&mut io, Some(&key(9)), 4, |_| { admitted = true; Ok(()) }, &mut resources);
        prop_assert!(result.is_err());
        prop_assert!(!admitted);
        prop_assert_eq!((resources.built, resources.connected), (0, 0));
        prop_assert!(io.sent.len() <= 2, "sent {:?}", io.sent);
        prop_assert!(io.sent.iter().all(|m| matches!(m, Message::Challenge { .. } | Message::Reject { .. })), "revealed {:?}", io.sent);
    }

    /// Without a key, the server still creates nothing before its
    /// admission agreed, and nothing at all for a peer it refused.
    #[test]
    fn an_open_server_creates_nothing_for_a_refused_or_confused_peer(
        script in prop::collection::vec(stranger_message(), 0..8),
        refuse in any::<bool>(),
    ) {
        let mut io = Script::new(script.iter().map(frame).collect());
        let mut resources = Counted::default();
        let mut admitted = false;
        let result = serve(&mut io, None, 4, |_| {
            admitted = true;
            if refuse { Err(Refusal::unauthorized("no")) } else { Ok(()) }
        }, &mut resources);
        if refuse || !admitted {
            prop_assert_eq!(resources.built, 0);
        }
        prop_assert!(resources.built <= 1);
        if result.is_ok() {
            prop_assert!(admitted && !refuse);
        }
        let accepts = io.sent.iter().filter(|m| matches!(m, Message::Accept(_))).count();
        prop_assert_eq!(accepts, resources.built.min(resources.connected));
    }

    /// A client with a key, facing a server that does not know it,
    /// creates nothing and reveals nothing (no Offer).
    #[test]
    fn a_keyed_client_reveals_nothing_to_an_impostor(
        script in prop::collection::vec(stranger_message(), 0..8),
    ) {
        let mut io = Script::new(script.iter().map(frame).collect());
        let mut resources = Counted { qps: 1, ..Counted::default() };
        let result = connect(&mut io, Some(&key(9)), "c", names(1), &mut resources);
        prop_assert!(result.is_err());
        prop_assert_eq!(resources.built, 0);
        prop_assert!(!io.sent.iter().any(|m| matches!(m, Message::Offer(_))), "revealed {:?}", io.sent);
    }
}

/// The frames an honest client sends an open server: hello, then its offer.
fn open_client_frames(stop_after_hello: bool) -> Vec<Vec<u8>> {
    let hello = Message::Hello(Hello {
        nonce: [1; PROOF_LEN],
        identity: "c".into(),
        qps: names(1),
    });
    let mut offer = Counted {
        qps: 1,
        ..Counted::default()
    }
    .build(None)
    .unwrap();
    offer.qps[0].name = "qp0".into();
    let mut frames = vec![frame(&hello)];
    if !stop_after_hello {
        frames.push(frame(&Message::Offer(offer)));
        frames.push(frame(&Message::Ready { proof: None }));
    }
    frames
}

#[test]
fn an_open_server_keeps_the_hello_deadline_until_the_offer_arrives() {
    // Admitted, then silent: the full deadline never applies.
    let mut io = Script::new(open_client_frames(true));
    let mut resources = Counted::default();
    let result = serve(&mut io, None, 4, |_| Ok(()), &mut resources);
    assert!(result.is_err());
    assert_eq!(io.admitted_after, Some(1), "admitted after the hello");
    assert_eq!(io.proven_after, None, "a silent stranger is never proven");
    assert_eq!(resources.built, 0);

    // An offer proves an open server's peer (there is nothing else to
    // prove): the full deadline applies from the second frame on.
    let mut io = Script::new(open_client_frames(false));
    let mut resources = Counted::default();
    serve(&mut io, None, 4, |_| Ok(()), &mut resources).unwrap();
    assert_eq!(io.admitted_after, Some(1));
    assert_eq!(io.proven_after, Some(2), "proven once the offer is in");
}

#[test]
fn a_keyed_server_gives_the_full_deadline_only_after_the_key_is_proven() {
    let (server_io, client_io) = pipe();
    let client = std::thread::spawn(move || {
        let mut io = client_io;
        let mut resources = Counted {
            qps: 1,
            ..Counted::default()
        };
        connect(&mut io, Some(&key(1)), "c", names(1), &mut resources)
    });
    struct Watch {
        io: Pipe,
        received: usize,
        proven_after: Option<usize>,
    }
    impl FrameIo for Watch {
        fn peer(&self) -> SocketAddr {
            addr()
        }
        fn send_frame(&mut self, frame: &[u8]) -> std::result::Result<(), WireError> {
            self.io.send_frame(frame)
        }
        fn recv_frame(&mut self) -> std::result::Result<Vec<u8>, WireError> {
            self.received += 1;
            self.io.recv_frame()
        }
        fn proven(&mut self) {
            self.proven_after.get_or_insert(self.received);
        }
    }
    let mut io = Watch {
        io: server_io,
        received: 0,
        proven_after: None,
    };
    let mut resources = Counted::default();
    serve(&mut io, Some(&key(1)), 4, |_| Ok(()), &mut resources).unwrap();
    client.join().unwrap().unwrap();
    assert_eq!(
        io.proven_after,
        Some(2),
        "proven by the hello and the proof"
    );
}

/// `message`'s frame with its first region's address set to `addr`, as a
/// peer that sends its virtual addresses would (the encoder refuses it).
fn with_region_address(message: &Message, addr: u64) -> Vec<u8> {
    let (Message::Offer(h) | Message::Accept(h)) = message else {
        unreachable!()
    };
    let mut bytes = frame(message);
    let len = h.regions[0].len.to_le_bytes();
    let at = bytes.windows(8).position(|w| w == len).unwrap() - 8;
    assert_eq!(
        &bytes[at..at + 8],
        &[0; 8],
        "the address precedes the length"
    );
    bytes[at..at + 8].copy_from_slice(&addr.to_le_bytes());
    bytes
}

#[track_caller]
fn assert_refused_for_an_address(result: Result<impl std::fmt::Debug>, sent: &[Message]) {
    let err = result.unwrap_err();
    assert!(
        matches!(
            err,
            Error::Handshake {
                source: WireError::Malformed(_),
                ..
            }
        ),
        "{err}"
    );
    assert!(
        matches!(
            sent.last(),
            Some(Message::Reject { code: reject_code::BAD_REQUEST, reason }) if reason.contains("address is not 0")
        ),
        "the peer is told why: {sent:?}"
    );
}

#[test]
fn a_peer_that_sends_a_region_address_is_refused_and_told_why() {
    let mut counted = Counted {
        qps: 1,
        ..Counted::default()
    };
    let theirs = counted.build(None).unwrap();

    // A client's offer with an address: the server builds nothing.
    let hello = Message::Hello(Hello {
        nonce: [1; PROOF_LEN],
        identity: "x".into(),
        qps: vec!["qp0".into()],
    });
    let offer = with_region_address(&Message::Offer(theirs.clone()), 0x7f12_3456_7000);
    let mut io = Script::new(vec![frame(&hello), offer]);
    let mut resources = Counted::default();
    let result = serve(&mut io, None, 4, |_| Ok(()), &mut resources);
    assert_refused_for_an_address(result, &io.sent);
    assert_eq!(resources.built, 0);

    // A server's accept with an address: the client connects nothing.
    let challenge = Message::Challenge {
        nonce: [2; PROOF_LEN],
        auth: false,
    };
    let accept = with_region_address(&Message::Accept(theirs), 0x7f12_3456_7000);
    let mut io = Script::new(vec![frame(&challenge), frame(&Message::Admit), accept]);
    let mut resources = Counted {
        qps: 1,
        ..Counted::default()
    };
    let result = connect(&mut io, None, "c", names(1), &mut resources);
    assert_refused_for_an_address(result, &io.sent);
    assert_eq!((resources.built, resources.connected), (1, 0));
}
