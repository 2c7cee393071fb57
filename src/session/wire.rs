//! The out-of-band handshake wire format (version 3).
//!
//! Every message is one frame: a 12-byte header, then the payload.
//!
//! ```text
//! header     magic u32 = 0x4D43_4352 ("RCCM")   version u16   kind u16   payload_len u32
//! payload    little-endian fixed-width fields; strings are u8 length + UTF-8
//!
//! Hello      nonce [32], identity str, u16 n, n × QP name str      client → server
//! Challenge  nonce [32], auth u8 (0 or 1)                          server → client
//! Proof      mac [32]                                              both ways
//! Admit      (empty)                                               server → client
//! Offer      handshake                                             client → server
//! Accept     handshake                                             server → client
//! Reject     code u16, reason str                                  both ways
//! Ready      (empty) or mac [32]                                   both ways
//! Disconnect code u16                                              both ways
//!
//! handshake  u16 n_qps, n_qps × qp, u16 n_regions, n_regions × region
//!   qp       qpn u32, psn u32, gid [16], lid u16, mtu u16 (bytes), name str
//!   region   id u32, addr u64 = 0, len u64, name str, n_qps × rkey u32 (one per QP)
//! ```
//!
//! A region's `addr` is always 0: exports are reached through zero-based
//! memory windows, so the peer addresses offsets `0..len` and never learns
//! where the memory is. A handshake with any other address is refused.
//!
//! The order of a handshake, and why, is in [`crate::session`]'s docs.
//!
//! The decoder never trusts a length: the header's payload length is capped
//! before anything is read, and every field read is checked against what is
//! left, so truncated or hostile input is an error, not a panic. Encoder and
//! decoder check the same rules ([`Message::check`]): whatever encodes
//! decodes to the same message, and whatever decodes encodes to the same
//! bytes.

use std::io::{self, Read};

/// Identifies our frames; anything else on the port is a stray client.
pub const MAGIC: u32 = 0x4D43_4352;
/// The protocol version this build speaks: of the handshake and of the
/// reactor's messages on the QPs it sets up (3: credits in every SEND's
/// immediate, a user immediate after the payload; 2 carried them in an
/// 8-byte header, and a peer of one cannot read the other).
pub const VERSION: u16 = 3;
/// Header size in bytes.
pub const FRAME_HEADER_LEN: usize = 12;
/// Largest payload accepted. The largest valid message (an offer with
/// [`MAX_QPS`] QPs and [`MAX_REGIONS`] regions, every name at its longest)
/// is about 52 KiB.
pub const MAX_PAYLOAD: u32 = 64 * 1024;
/// Most QPs one endpoint may ask for.
pub const MAX_QPS: usize = 64;
/// Most regions one side may export.
pub const MAX_REGIONS: usize = 64;
/// Longest name, identity or reason, in bytes.
pub const MAX_NAME_LEN: usize = 255;
/// Bytes of a nonce or a proof.
pub const PROOF_LEN: usize = super::auth::PROOF_LEN;

const KIND_HELLO: u16 = 1;
const KIND_CHALLENGE: u16 = 2;
const KIND_PROOF: u16 = 3;
const KIND_OFFER: u16 = 4;
const KIND_ACCEPT: u16 = 5;
const KIND_REJECT: u16 = 6;
const KIND_READY: u16 = 7;
const KIND_DISCONNECT: u16 = 8;
const KIND_ADMIT: u16 = 9;

pub use crate::error::WireError;

/// One queue pair as announced to the peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QpInfo {
    /// The QP's name (unique within an endpoint).
    pub name: String,
    /// QP number.
    pub qpn: u32,
    /// Initial PSN.
    pub psn: u32,
    /// Port GID.
    pub gid: [u8; 16],
    /// Port LID (0 on RoCE).
    pub lid: u16,
    /// Path MTU in bytes (256..4096).
    pub mtu: u16,
}

/// One exported memory region as announced to the peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionInfo {
    /// Caller-chosen id.
    pub id: u32,
    /// Caller-chosen name.
    pub name: String,
    /// The address the peer's offsets start from: always 0, since
    /// exports are reached through zero-based windows ([`Message::check`]
    /// refuses anything else, so no virtual address is ever sent or
    /// accepted).
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Remote key for each QP of the handshake, in QP order: a region is
    /// reachable only through the QP its key was bound to.
    pub rkeys: Vec<u32>,
}

/// The QPs and regions one side offers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Handshake {
    /// One entry per QP.
    pub qps: Vec<QpInfo>,
    /// Regions the peer may access.
    pub regions: Vec<RegionInfo>,
}

/// What a client says first: who it claims to be and what it will ask for.
/// Nothing in it is secret, and the server creates nothing for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// The client's fresh random nonce.
    pub nonce: [u8; PROOF_LEN],
    /// Who the client says it is (proven only by the key, when one is
    /// configured).
    pub identity: String,
    /// The names of the QPs it will offer, in order.
    pub qps: Vec<String>,
}

/// A control message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    /// Client → server: who I am and what I will ask for.
    Hello(Hello),
    /// Server → client: my nonce, and whether I require a proof.
    Challenge {
        /// The server's fresh random nonce.
        nonce: [u8; PROOF_LEN],
        /// Whether both sides must prove they hold the shared key.
        auth: bool,
    },
    /// Either side: HMAC-SHA256 of the transcript so far under my label.
    Proof([u8; PROOF_LEN]),
    /// Server → client: you are admitted; make your QPs and offer them.
    Admit,
    /// Client → server (after admission): my QPs and regions.
    Offer(Handshake),
    /// Server → client: mine, matching your QPs one to one.
    Accept(Handshake),
    /// Either side: the handshake is refused.
    Reject {
        /// Reason code ([`reject_code`](super::reject_code)).
        code: u16,
        /// Human-readable reason: at most [`MAX_NAME_LEN`] bytes, without
        /// control or bidirectional formatting characters (a peer's reason
        /// prints as one plain line; [`Message::reject`] escapes them).
        reason: String,
    },
    /// Either side: my QPs are ready; with authentication, a proof over the
    /// whole handshake (QP numbers and region keys included).
    Ready {
        /// The proof, when the handshake is authenticated.
        proof: Option<[u8; PROOF_LEN]>,
    },
    /// Either side: I am closing.
    Disconnect {
        /// Reason code (0 = normal close).
        code: u16,
    },
}

impl Message {
    /// A rejection whose reason has its control and bidirectional
    /// formatting characters escaped and is cut (at a character boundary)
    /// to what the wire carries.
    pub fn reject(code: u16, reason: &str) -> Self {
        let reason = printable(reason);
        let mut end = reason.len().min(MAX_NAME_LEN);
        while !reason.is_char_boundary(end) {
            end -= 1;
        }
        Message::Reject {
            code,
            reason: reason[..end].to_string(),
        }
    }

    /// Checks every rule the decoder enforces: limits on counts and
    /// lengths, 24-bit QP numbers and PSNs, valid MTUs, regions at address
    /// 0, one key per QP.
    pub fn check(&self) -> Result<(), WireError> {
        match self {
            Message::Hello(hello) => {
                check_name(&hello.identity)?;
                if hello.qps.len() > MAX_QPS {
                    return Err(WireError::Malformed("too many QPs"));
                }
                hello.qps.iter().try_for_each(|name| check_name(name))
            }
            Message::Offer(h) | Message::Accept(h) => check_handshake(h),
            Message::Reject { reason, .. } => check_name(reason),
            Message::Challenge { .. }
            | Message::Admit
            | Message::Proof(_)
            | Message::Ready { .. }
            | Message::Disconnect { .. } => Ok(()),
        }
    }

    /// Serialises into a complete frame, or says which rule the message
    /// breaks (the decoder would refuse it).
    pub fn encode(&self) -> Result<Vec<u8>, WireError> {
        self.check()?;
        let mut out = vec![0; FRAME_HEADER_LEN];
        let kind = match self {
            Message::Hello(hello) => {
                out.extend_from_slice(&hello.nonce);
                put_str(&mut out, &hello.identity);
                out.extend_from_slice(&(hello.qps.len() as u16).to_le_bytes());
                for name in &hello.qps {
                    put_str(&mut out, name);
                }
                KIND_HELLO
            }
            Message::Challenge { nonce, auth } => {
                out.extend_from_slice(nonce);
                out.push(u8::from(*auth));
                KIND_CHALLENGE
            }
            Message::Proof(mac) => {
                out.extend_from_slice(mac);
                KIND_PROOF
            }
            Message::Admit => KIND_ADMIT,
            Message::Offer(h) => {
                encode_handshake(h, &mut out);
                KIND_OFFER
            }
            Message::Accept(h) => {
                encode_handshake(h, &mut out);
                KIND_ACCEPT
            }
            Message::Reject { code, reason } => {
                out.extend_from_slice(&code.to_le_bytes());
                put_str(&mut out, reason);
                KIND_REJECT
            }
            Message::Ready { proof } => {
                if let Some(mac) = proof {
                    out.extend_from_slice(mac);
                }
                KIND_READY
            }
            Message::Disconnect { code } => {
                out.extend_from_slice(&code.to_le_bytes());
                KIND_DISCONNECT
            }
        };
        let len = out.len() - FRAME_HEADER_LEN;
        if len > MAX_PAYLOAD as usize {
            return Err(WireError::Oversized {
                len: len as u32,
                max: MAX_PAYLOAD,
            });
        }
        out[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        out[4..6].copy_from_slice(&VERSION.to_le_bytes());
        out[6..8].copy_from_slice(&kind.to_le_bytes());
        out[8..12].copy_from_slice(&(len as u32).to_le_bytes());
        Ok(out)
    }

    /// Decodes one frame from the front of `bytes`; returns it and the bytes used.
    pub fn decode(bytes: &[u8]) -> Result<(Message, usize), WireError> {
        let header: &[u8; FRAME_HEADER_LEN] = bytes
            .get(..FRAME_HEADER_LEN)
            .and_then(|h| h.try_into().ok())
            .ok_or(WireError::Truncated("header"))?;
        let (kind, len) = decode_header(header, MAX_PAYLOAD)?;
        let payload = bytes
            .get(FRAME_HEADER_LEN..FRAME_HEADER_LEN + len as usize)
            .ok_or(WireError::Truncated("payload"))?;
        Ok((
            decode_payload(kind, payload)?,
            FRAME_HEADER_LEN + len as usize,
        ))
    }
}

/// Names (identities, QPs, regions) and reject reasons are at most 255
/// bytes and carry no character that [`is_unprintable`] refuses: a peer's
/// text ends up in logs and on terminals.
fn check_name(name: &str) -> Result<(), WireError> {
    if name.len() > MAX_NAME_LEN {
        return Err(WireError::Malformed("a name is longer than 255 bytes"));
    }
    if name.chars().any(is_unprintable) {
        return Err(WireError::Malformed(
            "a name holds a control or bidirectional formatting character",
        ));
    }
    Ok(())
}

/// Characters a peer's text may not carry into a log or a terminal as they
/// are: controls (newlines, escape sequences), the line and paragraph
/// separators some viewers break lines at, and the invisible formatting
/// characters (bidirectional overrides that reorder what a terminal shows,
/// zero-width and tag characters that make look-alike names).
fn is_unprintable(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{00ad}'
                | '\u{061c}'
                | '\u{180e}'
                | '\u{200b}'..='\u{200f}'
                | '\u{2028}'..='\u{202e}'
                | '\u{2060}'..='\u{206f}'
                | '\u{feff}'
                | '\u{fff9}'..='\u{fffb}'
                | '\u{e0000}'..='\u{e007f}'
        )
}

/// `text` with every character [`is_unprintable`] refuses written as its
/// escape (`\n`, `\u{1b}`).
fn printable(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if is_unprintable(c) {
            out.extend(c.escape_debug());
        } else {
            out.push(c);
        }
    }
    out
}

fn check_handshake(h: &Handshake) -> Result<(), WireError> {
    if h.qps.len() > MAX_QPS {
        return Err(WireError::Malformed("too many QPs"));
    }
    if h.regions.len() > MAX_REGIONS {
        return Err(WireError::Malformed("too many regions"));
    }
    for qp in &h.qps {
        check_name(&qp.name)?;
        if qp.qpn > 0x00ff_ffff || qp.psn > 0x00ff_ffff {
            return Err(WireError::Malformed("QPN and PSN are 24-bit values"));
        }
        if ![256, 512, 1024, 2048, 4096].contains(&qp.mtu) {
            return Err(WireError::Malformed(
                "MTU must be 256, 512, 1024, 2048 or 4096",
            ));
        }
    }
    for region in &h.regions {
        check_name(&region.name)?;
        if region.addr != 0 {
            return Err(WireError::Malformed(
                "a region's address is not 0 (exports are zero-based windows: peers address offsets)",
            ));
        }
        if region.rkeys.len() != h.qps.len() {
            return Err(WireError::Malformed("a region needs one key per QP"));
        }
    }
    Ok(())
}

/// Checks a header against `max_payload` and returns (kind, payload length).
pub(crate) fn decode_header(
    header: &[u8; FRAME_HEADER_LEN],
    max_payload: u32,
) -> Result<(u16, u32), WireError> {
    let magic = u32::from_le_bytes([header[0], header[1], header[2], header[3]]);
    if magic != MAGIC {
        return Err(WireError::BadMagic(magic));
    }
    let version = u16::from_le_bytes([header[4], header[5]]);
    if version != VERSION {
        return Err(WireError::UnsupportedVersion {
            found: version,
            supported: VERSION,
        });
    }
    let kind = u16::from_le_bytes([header[6], header[7]]);
    let len = u32::from_le_bytes([header[8], header[9], header[10], header[11]]);
    if len > max_payload {
        return Err(WireError::Oversized {
            len,
            max: max_payload,
        });
    }
    Ok((kind, len))
}

fn decode_payload(kind: u16, payload: &[u8]) -> Result<Message, WireError> {
    let mut r = Reader(payload);
    let message = match kind {
        KIND_HELLO => {
            let nonce = r.array()?;
            let identity = r.name()?;
            let n = r.u16()? as usize;
            if n > MAX_QPS {
                return Err(WireError::Malformed("too many QPs"));
            }
            let qps = (0..n).map(|_| r.name()).collect::<Result<_, _>>()?;
            Message::Hello(Hello {
                nonce,
                identity,
                qps,
            })
        }
        KIND_CHALLENGE => Message::Challenge {
            nonce: r.array()?,
            auth: match r.take(1)?[0] {
                0 => false,
                1 => true,
                _ => return Err(WireError::Malformed("the auth flag is 0 or 1")),
            },
        },
        KIND_PROOF => Message::Proof(r.array()?),
        KIND_ADMIT => Message::Admit,
        KIND_OFFER => Message::Offer(decode_handshake(&mut r)?),
        KIND_ACCEPT => Message::Accept(decode_handshake(&mut r)?),
        KIND_REJECT => Message::Reject {
            code: r.u16()?,
            reason: r.name()?,
        },
        KIND_READY => Message::Ready {
            proof: match r.0.len() {
                0 => None,
                PROOF_LEN => Some(r.array()?),
                _ => return Err(WireError::Malformed("a Ready carries no proof or 32 bytes")),
            },
        },
        KIND_DISCONNECT => Message::Disconnect { code: r.u16()? },
        other => return Err(WireError::UnknownKind(other)),
    };
    if !r.0.is_empty() {
        return Err(WireError::Malformed("trailing bytes after the message"));
    }
    message.check()?;
    Ok(message)
}

fn encode_handshake(h: &Handshake, out: &mut Vec<u8>) {
    out.extend_from_slice(&(h.qps.len() as u16).to_le_bytes());
    for qp in &h.qps {
        out.extend_from_slice(&qp.qpn.to_le_bytes());
        out.extend_from_slice(&qp.psn.to_le_bytes());
        out.extend_from_slice(&qp.gid);
        out.extend_from_slice(&qp.lid.to_le_bytes());
        out.extend_from_slice(&qp.mtu.to_le_bytes());
        put_str(out, &qp.name);
    }
    out.extend_from_slice(&(h.regions.len() as u16).to_le_bytes());
    for region in &h.regions {
        out.extend_from_slice(&region.id.to_le_bytes());
        out.extend_from_slice(&region.addr.to_le_bytes());
        out.extend_from_slice(&region.len.to_le_bytes());
        put_str(out, &region.name);
        for rkey in &region.rkeys {
            out.extend_from_slice(&rkey.to_le_bytes());
        }
    }
}

fn decode_handshake(r: &mut Reader<'_>) -> Result<Handshake, WireError> {
    let n_qps = r.u16()? as usize;
    if n_qps > MAX_QPS {
        return Err(WireError::Malformed("too many QPs"));
    }
    let mut qps = Vec::with_capacity(n_qps);
    for _ in 0..n_qps {
        qps.push(QpInfo {
            qpn: r.u32()?,
            psn: r.u32()?,
            gid: r.array()?,
            lid: r.u16()?,
            mtu: r.u16()?,
            name: r.name()?,
        });
    }
    let n_regions = r.u16()? as usize;
    if n_regions > MAX_REGIONS {
        return Err(WireError::Malformed("too many regions"));
    }
    let mut regions = Vec::with_capacity(n_regions);
    for _ in 0..n_regions {
        regions.push(RegionInfo {
            id: r.u32()?,
            addr: r.u64()?,
            len: r.u64()?,
            name: r.name()?,
            rkeys: (0..n_qps).map(|_| r.u32()).collect::<Result<_, _>>()?,
        });
    }
    Ok(Handshake { qps, regions })
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    // `check` has made sure it fits.
    out.push(s.len() as u8);
    out.extend_from_slice(s.as_bytes());
}

/// A cursor that refuses to read past the end.
struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], WireError> {
        if self.0.len() < n {
            return Err(WireError::Truncated("field"));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], WireError> {
        let mut out = [0; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn u16(&mut self) -> Result<u16, WireError> {
        Ok(u16::from_le_bytes(self.array()?))
    }

    fn u32(&mut self) -> Result<u32, WireError> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64, WireError> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    fn str(&mut self) -> Result<String, WireError> {
        let len = self.take(1)?[0] as usize;
        let bytes = self.take(len)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| WireError::Malformed("name is not UTF-8"))
    }

    /// A name (see [`check_name`]).
    fn name(&mut self) -> Result<String, WireError> {
        let name = self.str()?;
        check_name(&name)?;
        Ok(name)
    }
}

/// Reads frames incrementally from a stream, one `read` call at a time, so
/// that the caller decides how long each read may wait (a handshake's
/// absolute deadline) or that none waits at all (a non-blocking control
/// connection polled from a reactor thread).
///
/// Its buffer grows to the frame being read, never past the header plus
/// the payload limit; up to 1 KiB of it is allocated up front, so a reader
/// of small frames (a control connection's) never allocates while reading.
/// After an error it stays failed: a stream out of step is not resumed.
#[derive(Debug)]
pub struct FrameReader {
    buf: Vec<u8>,
    have: usize,
    /// The frame's total length once its header is in.
    frame_len: Option<usize>,
    max_payload: u32,
    failed: bool,
}

impl FrameReader {
    /// A reader of frames with at most `max_payload` bytes of payload.
    pub fn new(max_payload: u32) -> Self {
        let upfront = FRAME_HEADER_LEN + (max_payload as usize).min(1024);
        Self {
            buf: vec![0; upfront],
            have: 0,
            frame_len: None,
            max_payload,
            failed: false,
        }
    }

    /// Changes the payload limit for the frames whose header is not in yet.
    pub fn set_max_payload(&mut self, max_payload: u32) {
        self.max_payload = max_payload;
    }

    /// Bytes of a frame received so far (0 between frames).
    pub fn pending(&self) -> usize {
        self.have
    }

    /// Makes one `read` call for the current frame. Returns the whole frame
    /// once it is in (the next call starts the next frame), `None` while it
    /// is incomplete. A bad header fails as soon as its 12 bytes are in; the
    /// end of the stream fails as [`WireError::Truncated`] inside a frame
    /// and as an `UnexpectedEof` I/O error between frames; a read that would
    /// block or timed out comes back as the I/O error it is (and the reader
    /// goes on from there next time). Any other error is final.
    pub fn read_from(&mut self, stream: &mut impl Read) -> Result<Option<&[u8]>, WireError> {
        if self.failed {
            return Err(WireError::Malformed("the stream already failed"));
        }
        match self.read_some(stream) {
            Err(WireError::Io(err))
                if matches!(
                    err.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                Err(WireError::Io(err))
            }
            Err(err) => {
                self.failed = true;
                Err(err)
            }
            Ok(true) => Ok(Some(&self.buf[..self.have])),
            Ok(false) => Ok(None),
        }
    }

    /// One read; whether the frame is complete.
    fn read_some(&mut self, stream: &mut impl Read) -> Result<bool, WireError> {
        if self.frame_len == Some(self.have) {
            // The previous call returned a frame; start the next.
            self.have = 0;
            self.frame_len = None;
        }
        let want = self.frame_len.unwrap_or(FRAME_HEADER_LEN);
        let n = match stream.read(&mut self.buf[self.have..want]) {
            Ok(0) => {
                return Err(match (self.have, self.frame_len) {
                    (0, _) => WireError::Io(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the connection closed",
                    )),
                    (_, None) => WireError::Truncated("header"),
                    (_, Some(_)) => WireError::Truncated("payload"),
                });
            }
            Ok(n) => n,
            Err(err) if err.kind() == io::ErrorKind::Interrupted => 0,
            Err(err) => return Err(WireError::Io(err)),
        };
        self.have += n;
        if self.frame_len.is_none() && self.have == FRAME_HEADER_LEN {
            let mut header = [0; FRAME_HEADER_LEN];
            header.copy_from_slice(&self.buf[..FRAME_HEADER_LEN]);
            let (_, len) = decode_header(&header, self.max_payload)?;
            let frame_len = FRAME_HEADER_LEN + len as usize;
            if self.buf.len() < frame_len {
                self.buf.resize(frame_len, 0);
            }
            self.frame_len = Some(frame_len);
        }
        Ok(self.frame_len == Some(self.have))
    }
}

#[cfg(test)]
mod tests;
