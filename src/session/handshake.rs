//! The handshake's two sides as straight-line state machines over a frame
//! transport ([`FrameIo`]), so the same code runs over TCP with a deadline
//! and, in tests and the fuzzer, over scripted frames.
//!
//! The order is what makes a stranger get nothing and hold nothing:
//!
//! 1. client → `Hello` (nonce, identity, QP names). Nothing secret.
//! 2. server → `Challenge` (nonce, whether a key is required). The server
//!    has created nothing.
//! 3. With a key: client → `Proof`, server checks it, server → `Proof`,
//!    client checks it. A wrong or missing key ends the handshake here on
//!    both sides, with a `Reject` that says why.
//! 4. The server's admission (its peer limit, its backlog, the user's
//!    authorize callback) sees the peer's address and hello, and the server
//!    → `Admit` (or `Reject` with the reason).
//! 5. Only now: client creates its QPs → `Offer` (its QPs and regions),
//!    server creates its QPs and exports, connects them and → `Accept`.
//!    With a key, each is followed by a `Proof` over the transcript up to
//!    it, checked before anything is built or connected from it: QP numbers
//!    or region keys altered or injected in transit are refused.
//! 6. Both → `Ready`; with a key each carries a proof over the whole
//!    transcript.

use std::collections::HashSet;
use std::net::SocketAddr;

use super::auth::{self, AuthKey, Transcript, label};
use super::reject_code;
use super::wire::{Handshake, Hello, Message, WireError};
use crate::error::{Error, Result};

/// Frames in and out of one handshake.
pub(crate) trait FrameIo {
    /// Who is on the other end (for errors).
    fn peer(&self) -> SocketAddr;
    /// Sends one complete frame.
    fn send_frame(&mut self, frame: &[u8]) -> std::result::Result<(), WireError>;
    /// Receives one complete frame (header included).
    fn recv_frame(&mut self) -> std::result::Result<Vec<u8>, WireError>;
    /// Sends a last frame (a rejection) without waiting long for it.
    fn send_last(&mut self, frame: &[u8]) {
        let _ = self.send_frame(frame);
    }
    /// The peer was admitted: the handshake's full deadline and frame size
    /// apply from now on.
    fn admitted(&mut self) {}
}

/// What a server's admission policy and authorize callback see of a peer
/// before anything is created for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerHello {
    /// The peer's address.
    pub peer: SocketAddr,
    /// Who the peer says it is.
    pub identity: String,
    /// The names of the QPs it asks for, in order.
    pub qps: Vec<String>,
    /// Whether it proved that it holds the server's key (false when the
    /// server has none).
    pub authenticated: bool,
}

/// Why admission refused a peer: sent to it as a `Reject`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// Reject code ([`reject_code`]).
    pub code: u16,
    /// What the peer is told.
    pub reason: String,
}

impl Refusal {
    /// A refusal with [`reject_code::UNAUTHORIZED`].
    pub fn unauthorized(reason: impl Into<String>) -> Self {
        Self {
            code: reject_code::UNAUTHORIZED,
            reason: reason.into(),
        }
    }
}

/// Creates and connects one side's QPs and exports.
pub(crate) trait Resources {
    /// Creates the QPs and exports and describes them. The server gets the
    /// client's offer; the client gets `None`.
    fn build(&mut self, peer_offer: Option<&Handshake>) -> Result<Handshake>;
    /// Connects the QPs to the peer's and makes the exports reachable.
    fn connect(&mut self, peer: &Handshake) -> Result<()>;
}

/// One handshake's frames and their running transcript.
struct Exchange<'a, F: FrameIo> {
    io: &'a mut F,
    peer: SocketAddr,
    transcript: Transcript,
}

impl<'a, F: FrameIo> Exchange<'a, F> {
    fn new(io: &'a mut F) -> Self {
        let peer = io.peer();
        Self {
            io,
            peer,
            transcript: Transcript::default(),
        }
    }

    fn wire_error(&self, source: WireError) -> Error {
        Error::Handshake {
            peer: self.peer,
            source,
        }
    }

    fn send(&mut self, message: &Message) -> Result<()> {
        let frame = message.encode().map_err(|err| self.wire_error(err))?;
        self.transcript.add(&frame);
        self.io
            .send_frame(&frame)
            .map_err(|err| self.wire_error(err))
    }

    fn recv(&mut self) -> Result<Message> {
        let frame = self.io.recv_frame().map_err(|err| self.wire_error(err))?;
        self.transcript.add(&frame);
        let (message, _) = Message::decode(&frame).map_err(|err| self.wire_error(err))?;
        Ok(message)
    }

    /// Tells the peer why we stop (best effort).
    fn refuse(&mut self, code: u16, reason: &str) {
        if let Ok(frame) = Message::reject(code, reason).encode() {
            self.io.send_last(&frame);
        }
    }

    /// Refuses with `code` and returns the protocol error to report.
    fn refuse_protocol(&mut self, code: u16, what: String) -> Error {
        self.refuse(code, &what);
        Error::Protocol {
            peer: self.peer,
            what,
        }
    }

    fn unauthenticated(&mut self, told: &str, what: impl Into<String>) -> Error {
        self.refuse(reject_code::UNAUTHENTICATED, told);
        Error::Unauthenticated {
            peer: self.peer,
            what: what.into(),
        }
    }

    fn rejected(&self, code: u16, reason: String) -> Error {
        if code == reject_code::UNAUTHENTICATED {
            Error::Unauthenticated {
                peer: self.peer,
                what: format!("the peer refused: {reason}"),
            }
        } else {
            Error::Rejected {
                peer: self.peer,
                code,
                reason,
            }
        }
    }

    fn unexpected(&mut self, expected: &str, got: &Message) -> Error {
        if let Message::Reject { code, reason } = got {
            return self.rejected(*code, reason.clone());
        }
        self.refuse_protocol(
            reject_code::BAD_REQUEST,
            format!("expected {expected}, got {}", kind_name(got)),
        )
    }

    /// Receives the peer's `Ready` and checks its proof.
    fn recv_ready(&mut self, key: Option<&AuthKey>, label: &[u8]) -> Result<()> {
        let digest = self.transcript.digest();
        match (self.recv()?, key) {
            (Message::Ready { proof: None }, None) => Ok(()),
            (Message::Ready { proof: Some(proof) }, Some(key))
                if key.verify(label, &digest, &proof) =>
            {
                Ok(())
            }
            (Message::Ready { .. }, _) => Err(self.unauthenticated(
                "the final proof does not match",
                "the peer's final proof does not match the handshake (altered in transit?)",
            )),
            (other, _) => Err(self.unexpected("Ready", &other)),
        }
    }

    /// With a key: sends a proof over the transcript so far.
    fn send_proof(&mut self, key: Option<&AuthKey>, label: &[u8]) -> Result<()> {
        match key {
            Some(key) => {
                let digest = self.transcript.digest();
                self.send(&Message::Proof(key.prove(label, &digest)))
            }
            None => Ok(()),
        }
    }

    /// With a key: receives the peer's proof over the transcript so far.
    fn recv_proof(&mut self, key: Option<&AuthKey>, label: &[u8], of: &str) -> Result<()> {
        let Some(key) = key else { return Ok(()) };
        let digest = self.transcript.digest();
        match self.recv()? {
            Message::Proof(proof) if key.verify(label, &digest, &proof) => Ok(()),
            Message::Proof(_) => Err(self.unauthenticated(
                "a proof does not match",
                format!("the proof of the {of} does not match (altered in transit?)"),
            )),
            other => Err(self.unexpected("Proof", &other)),
        }
    }

    fn send_ready(&mut self, key: Option<&AuthKey>, label: &[u8]) -> Result<()> {
        let digest = self.transcript.digest();
        let proof = key.map(|key| key.prove(label, &digest));
        self.send(&Message::Ready { proof })
    }
}

fn kind_name(message: &Message) -> &'static str {
    match message {
        Message::Hello(_) => "Hello",
        Message::Challenge { .. } => "Challenge",
        Message::Proof(_) => "Proof",
        Message::Admit => "Admit",
        Message::Offer(_) => "Offer",
        Message::Accept(_) => "Accept",
        Message::Reject { .. } => "Reject",
        Message::Ready { .. } => "Ready",
        Message::Disconnect { .. } => "Disconnect",
    }
}

/// Runs the server's side. `admit` sees the peer after authentication and
/// before anything is created; `resources` is used only after it agreed.
/// Returns the client's hello and offer.
pub(crate) fn serve(
    io: &mut impl FrameIo,
    key: Option<&AuthKey>,
    max_qps: usize,
    admit: impl FnOnce(&PeerHello) -> std::result::Result<(), Refusal>,
    resources: &mut impl Resources,
) -> Result<(Hello, Handshake)> {
    let mut x = Exchange::new(io);
    let hello = match x.recv()? {
        Message::Hello(hello) => hello,
        other => return Err(x.unexpected("Hello", &other)),
    };
    if hello.qps.is_empty() || hello.qps.len() > max_qps {
        let what = format!(
            "asked for {} QPs; this server allows 1 to {max_qps}",
            hello.qps.len()
        );
        return Err(x.refuse_protocol(reject_code::BAD_REQUEST, what));
    }
    if hello.qps.iter().collect::<HashSet<_>>().len() != hello.qps.len() {
        let what = "QP names must be unique within an endpoint".to_string();
        return Err(x.refuse_protocol(reject_code::BAD_REQUEST, what));
    }
    x.send(&Message::Challenge {
        nonce: auth::nonce()?,
        auth: key.is_some(),
    })?;

    if let Some(key) = key {
        let digest = x.transcript.digest();
        match x.recv()? {
            Message::Proof(proof) if key.verify(label::CLIENT, &digest, &proof) => {}
            Message::Proof(_) => {
                return Err(x.unauthenticated(
                    "authentication failed: wrong key",
                    "the client's proof does not match our key (wrong key?)",
                ));
            }
            Message::Reject { reason, .. } => {
                return Err(Error::Unauthenticated {
                    peer: x.peer,
                    what: format!("the client did not authenticate: {reason}"),
                });
            }
            other => {
                let what = format!(
                    "the client sent {} instead of a proof (no key configured?)",
                    kind_name(&other)
                );
                return Err(x.unauthenticated("this server requires authentication", what));
            }
        }
        let digest = x.transcript.digest();
        x.send(&Message::Proof(key.prove(label::SERVER, &digest)))?;
    }

    let peer_hello = PeerHello {
        peer: x.peer,
        identity: hello.identity.clone(),
        qps: hello.qps.clone(),
        authenticated: key.is_some(),
    };
    if let Err(refusal) = admit(&peer_hello) {
        x.refuse(refusal.code, &refusal.reason);
        return Err(Error::Unauthorized {
            peer: x.peer,
            reason: refusal.reason,
        });
    }
    x.io.admitted();
    x.send(&Message::Admit)?;

    let offer = match x.recv()? {
        Message::Offer(offer) => offer,
        other => return Err(x.unexpected("Offer", &other)),
    };
    x.recv_proof(key, label::CLIENT_OFFER, "client's offer")?;
    if !offer.qps.iter().map(|qp| &qp.name).eq(&hello.qps) {
        let what = "the offer's QPs differ from the hello's".to_string();
        return Err(x.refuse_protocol(reject_code::BAD_REQUEST, what));
    }
    let ours = match resources
        .build(Some(&offer))
        .and_then(|ours| resources.connect(&offer).map(|()| ours))
    {
        Ok(ours) => ours,
        Err(err) => {
            // The details stay in our log, not with the peer.
            x.refuse(
                reject_code::RESOURCES,
                "the server could not set up the QPs",
            );
            return Err(err);
        }
    };
    x.send(&Message::Accept(ours))?;
    x.send_proof(key, label::SERVER_ACCEPT)?;
    x.recv_ready(key, label::CLIENT_READY)?;
    x.send_ready(key, label::SERVER_READY)?;
    Ok((hello, offer))
}

/// Runs the client's side: says hello as `identity` with the QPs `names`,
/// proves and checks the key when one is configured (a client with a key
/// requires an authenticated server), then creates its resources. Returns
/// the server's accept.
pub(crate) fn connect(
    io: &mut impl FrameIo,
    key: Option<&AuthKey>,
    identity: &str,
    names: Vec<String>,
    resources: &mut impl Resources,
) -> Result<Handshake> {
    let mut x = Exchange::new(io);
    let expected = names.len();
    x.send(&Message::Hello(Hello {
        nonce: auth::nonce()?,
        identity: identity.to_string(),
        qps: names,
    }))?;
    let auth = match x.recv()? {
        Message::Challenge { auth, .. } => auth,
        other => return Err(x.unexpected("Challenge", &other)),
    };
    match (auth, key) {
        (false, None) => {}
        (true, None) => {
            return Err(x.unauthenticated(
                "the client has no key",
                "the server requires authentication and no key is configured here",
            ));
        }
        (false, Some(_)) => {
            return Err(x.unauthenticated(
                "the client requires an authenticated server",
                "the server does not authenticate and a key is configured here: \
                 nothing is revealed to an unauthenticated server",
            ));
        }
        (true, Some(key)) => {
            let digest = x.transcript.digest();
            x.send(&Message::Proof(key.prove(label::CLIENT, &digest)))?;
            let digest = x.transcript.digest();
            match x.recv()? {
                Message::Proof(proof) if key.verify(label::SERVER, &digest, &proof) => {}
                Message::Proof(_) => {
                    return Err(x.unauthenticated(
                        "authentication failed: wrong key",
                        "the server's proof does not match our key (wrong key?)",
                    ));
                }
                other => return Err(x.unexpected("Proof", &other)),
            }
        }
    }
    match x.recv()? {
        Message::Admit => x.io.admitted(),
        other => return Err(x.unexpected("Admit", &other)),
    }

    let ours = match resources.build(None) {
        Ok(ours) => ours,
        Err(err) => {
            x.refuse(reject_code::RESOURCES, &err.to_string());
            return Err(err);
        }
    };
    x.send(&Message::Offer(ours))?;
    x.send_proof(key, label::CLIENT_OFFER)?;
    let accept = match x.recv()? {
        Message::Accept(accept) => accept,
        other => return Err(x.unexpected("Accept", &other)),
    };
    x.recv_proof(key, label::SERVER_ACCEPT, "server's accept")?;
    if accept.qps.len() != expected {
        let what = format!(
            "the server answered with {} QPs for our {expected}",
            accept.qps.len()
        );
        return Err(x.refuse_protocol(reject_code::BAD_REQUEST, what));
    }
    if let Err(err) = resources.connect(&accept) {
        x.refuse(reject_code::RESOURCES, &err.to_string());
        return Err(err);
    }
    x.send_ready(key, label::CLIENT_READY)?;
    x.recv_ready(key, label::SERVER_READY)?;
    Ok(accept)
}

/// The state machines against scripted and hostile peers, and against each
/// other (no device: the resources are counted, not created).
#[cfg(test)]
mod tests {
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
    }

    impl Script {
        fn new(frames: Vec<Vec<u8>>) -> Self {
            Self {
                incoming: frames.into_iter(),
                sent: Vec::new(),
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
        fn recv_frame(&mut self) -> std::result::Result<Vec<u8>, WireError> {
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
                    addr: 0x1000,
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
            Message::Challenge { nonce, auth } if how == 0 => {
                Message::Challenge { nonce, auth: !auth }
            }
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
            (any::<u16>(), "[a-z ]{0,20}")
                .prop_map(|(code, reason)| Message::Reject { code, reason }),
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
}
