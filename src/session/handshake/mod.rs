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
use std::io;
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
    /// The peer was admitted: frames up to the full size are read from now
    /// on.
    fn admitted(&mut self) {}
    /// The peer proved itself (its key, or on an open server its offer):
    /// the handshake's full deadline applies from now on, where until now
    /// the hello deadline did.
    fn proven(&mut self) {}
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

    /// Receives one message. A whole frame whose content breaks a rule (a
    /// region with an address, say) is refused with the rule, so the peer
    /// hears why.
    fn recv(&mut self) -> Result<Message> {
        let frame = self.io.recv_frame().map_err(|err| self.wire_error(err))?;
        self.transcript.add(&frame);
        match Message::decode(&frame) {
            Ok((message, _)) => Ok(message),
            Err(err) => {
                if let WireError::Malformed(rule) = err {
                    self.refuse(reject_code::BAD_REQUEST, rule);
                }
                Err(self.wire_error(err))
            }
        }
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
    if key.is_some() {
        x.io.proven();
    }
    x.send(&Message::Admit)?;

    let offer = match x.recv()? {
        Message::Offer(offer) => offer,
        other => return Err(x.unexpected("Offer", &other)),
    };
    x.recv_proof(key, label::CLIENT_OFFER, "client's offer")?;
    // An open server has no proof of the peer: a stranger that stops
    // after the hello holds its slot only until the hello deadline.
    x.io.proven();
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
        Message::Admit => {
            x.io.admitted();
            x.io.proven();
        }
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
    // Once our Ready is on its way the server may have it: a cut from
    // then on may have left it a session.
    x.send_ready(key, label::CLIENT_READY)
        .map_err(cut_after_our_ready)?;
    x.recv_ready(key, label::SERVER_READY)
        .map_err(cut_after_our_ready)?;
    Ok(accept)
}

/// Whether `io` says the peer cut the connection (closed or reset it)
/// rather than kept silent.
pub(crate) fn is_cut(io: &io::Error) -> bool {
    matches!(
        io.kind(),
        io::ErrorKind::UnexpectedEof
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe
    )
}

/// A connection cut after our `Ready` is no longer a cut handshake that a
/// client may simply try again: the server may have sent its own `Ready`
/// and kept the session. Reported as [`io::ErrorKind::Other`], with what
/// happened.
fn cut_after_our_ready(err: Error) -> Error {
    match err {
        Error::Handshake {
            peer,
            source: WireError::Io(io),
        } if is_cut(&io) => Error::Handshake {
            peer,
            source: WireError::Io(io::Error::other(format!("after our Ready: {io}"))),
        },
        other => other,
    }
}

#[cfg(test)]
mod tests;
