//! The out-of-band handshake wire format.
//!
//! Every message is one frame: a 12-byte header, then the payload.
//!
//! ```text
//! header   magic u32 = 0x4D43_4352 ("RCCM")   version u16   kind u16   payload_len u32
//! payload  little-endian fixed-width fields; strings are u8 length + UTF-8
//!
//! Hello / Accept   u16 n_qps, n × qp, u16 n_regions, n × region
//!   qp             qpn u32, psn u32, gid [16], lid u16, mtu u16 (bytes), name str
//!   region         id u32, addr u64, len u64, rkey u32, name str
//! Reject           code u16, reason str
//! Ready            (empty)
//! Disconnect       code u16
//! ```
//!
//! The decoder never trusts a length: the header's payload length is capped at
//! [`MAX_PAYLOAD`] before anything is read, and every field read is checked
//! against what is left, so truncated or hostile input is an error, not a panic.

use std::io::{self, Read, Write};

/// Identifies our frames; anything else on the port is a stray client.
pub const MAGIC: u32 = 0x4D43_4352;
/// The protocol version this build speaks.
pub const VERSION: u16 = 1;
/// Header size in bytes.
pub const FRAME_HEADER_LEN: usize = 12;
/// Largest payload accepted (a handshake with hundreds of qps fits easily).
pub const MAX_PAYLOAD: u32 = 64 * 1024;
/// Most qps one endpoint may ask for.
pub const MAX_QPS: usize = 256;
/// Most regions one side may export.
pub const MAX_REGIONS: usize = 1024;

const KIND_HELLO: u16 = 1;
const KIND_ACCEPT: u16 = 2;
const KIND_REJECT: u16 = 3;
const KIND_READY: u16 = 4;
const KIND_DISCONNECT: u16 = 5;

pub use crate::error::WireError;

/// One queue pair as announced to the peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QpInfo {
    /// SessionQp name (unique within an endpoint).
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
    /// Remote address.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Remote key.
    pub rkey: u32,
}

/// Channels and regions one side offers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Handshake {
    /// One entry per QP.
    pub qps: Vec<QpInfo>,
    /// Regions the peer may access.
    pub regions: Vec<RegionInfo>,
}

/// A control message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    /// Client → server: my qps and regions.
    Hello(Handshake),
    /// Server → client: mine, matching your qps one to one.
    Accept(Handshake),
    /// Server → client: the handshake is refused.
    Reject {
        /// Reason code.
        code: u16,
        /// Human-readable reason.
        reason: String,
    },
    /// Either side: my QPs are ready to send.
    Ready,
    /// Either side: I am closing.
    Disconnect {
        /// Reason code (0 = normal close).
        code: u16,
    },
}

impl Message {
    /// Serialises into a complete frame.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![0; FRAME_HEADER_LEN];
        let kind = match self {
            Message::Hello(h) => {
                encode_handshake(h, &mut out);
                KIND_HELLO
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
            Message::Ready => KIND_READY,
            Message::Disconnect { code } => {
                out.extend_from_slice(&code.to_le_bytes());
                KIND_DISCONNECT
            }
        };
        let len = (out.len() - FRAME_HEADER_LEN) as u32;
        out[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        out[4..6].copy_from_slice(&VERSION.to_le_bytes());
        out[6..8].copy_from_slice(&kind.to_le_bytes());
        out[8..12].copy_from_slice(&len.to_le_bytes());
        out
    }

    /// Decodes one frame from the front of `bytes`; returns it and the bytes used.
    pub fn decode(bytes: &[u8]) -> Result<(Message, usize), WireError> {
        let header: &[u8; FRAME_HEADER_LEN] = bytes
            .get(..FRAME_HEADER_LEN)
            .and_then(|h| h.try_into().ok())
            .ok_or(WireError::Truncated("header"))?;
        let (kind, len) = decode_header(header)?;
        let payload = bytes
            .get(FRAME_HEADER_LEN..FRAME_HEADER_LEN + len as usize)
            .ok_or(WireError::Truncated("payload"))?;
        Ok((
            decode_payload(kind, payload)?,
            FRAME_HEADER_LEN + len as usize,
        ))
    }

    /// Reads one frame from a stream (honouring its read timeout).
    pub fn read_from(stream: &mut impl Read) -> Result<Message, WireError> {
        let mut header = [0; FRAME_HEADER_LEN];
        read_exact(stream, &mut header, "header")?;
        let (kind, len) = decode_header(&header)?;
        // The length is capped, so this allocation is bounded.
        let mut payload = vec![0; len as usize];
        read_exact(stream, &mut payload, "payload")?;
        decode_payload(kind, &payload)
    }

    /// Writes one frame to a stream.
    pub fn write_to(&self, stream: &mut impl Write) -> io::Result<()> {
        stream.write_all(&self.encode())?;
        stream.flush()
    }
}

fn read_exact(stream: &mut impl Read, buf: &mut [u8], what: &'static str) -> Result<(), WireError> {
    stream.read_exact(buf).map_err(|err| match err.kind() {
        io::ErrorKind::UnexpectedEof => WireError::Truncated(what),
        _ => WireError::Io(err),
    })
}

/// Checks a header and returns (kind, payload length).
pub fn decode_header(header: &[u8; FRAME_HEADER_LEN]) -> Result<(u16, u32), WireError> {
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
    if len > MAX_PAYLOAD {
        return Err(WireError::Oversized {
            len,
            max: MAX_PAYLOAD,
        });
    }
    Ok((kind, len))
}

fn decode_payload(kind: u16, payload: &[u8]) -> Result<Message, WireError> {
    let mut r = Reader(payload);
    let message = match kind {
        KIND_HELLO => Message::Hello(decode_handshake(&mut r)?),
        KIND_ACCEPT => Message::Accept(decode_handshake(&mut r)?),
        KIND_REJECT => Message::Reject {
            code: r.u16()?,
            reason: r.str()?,
        },
        KIND_READY => Message::Ready,
        KIND_DISCONNECT => Message::Disconnect { code: r.u16()? },
        other => return Err(WireError::UnknownKind(other)),
    };
    if !r.0.is_empty() {
        return Err(WireError::Malformed("trailing bytes after the message"));
    }
    Ok(message)
}

fn encode_handshake(h: &Handshake, out: &mut Vec<u8>) {
    out.extend_from_slice(&(h.qps.len() as u16).to_le_bytes());
    for c in &h.qps {
        out.extend_from_slice(&c.qpn.to_le_bytes());
        out.extend_from_slice(&c.psn.to_le_bytes());
        out.extend_from_slice(&c.gid);
        out.extend_from_slice(&c.lid.to_le_bytes());
        out.extend_from_slice(&c.mtu.to_le_bytes());
        put_str(out, &c.name);
    }
    out.extend_from_slice(&(h.regions.len() as u16).to_le_bytes());
    for region in &h.regions {
        out.extend_from_slice(&region.id.to_le_bytes());
        out.extend_from_slice(&region.addr.to_le_bytes());
        out.extend_from_slice(&region.len.to_le_bytes());
        out.extend_from_slice(&region.rkey.to_le_bytes());
        put_str(out, &region.name);
    }
}

fn decode_handshake(r: &mut Reader<'_>) -> Result<Handshake, WireError> {
    let n_qps = r.u16()? as usize;
    if n_qps > MAX_QPS {
        return Err(WireError::Malformed("too many QPs"));
    }
    let mut qps = Vec::with_capacity(n_qps);
    for _ in 0..n_qps {
        let channel = QpInfo {
            qpn: r.u32()?,
            psn: r.u32()?,
            gid: r.array()?,
            lid: r.u16()?,
            mtu: r.u16()?,
            name: r.str()?,
        };
        if channel.qpn > 0x00ff_ffff || channel.psn > 0x00ff_ffff {
            return Err(WireError::Malformed("QPN and PSN are 24-bit values"));
        }
        if ![256, 512, 1024, 2048, 4096].contains(&channel.mtu) {
            return Err(WireError::Malformed(
                "MTU must be 256, 512, 1024, 2048 or 4096",
            ));
        }
        qps.push(channel);
    }
    let n_regions = r.u16()? as usize;
    if n_regions > MAX_REGIONS {
        return Err(WireError::Malformed("too many regions"));
    }
    let mut regions = Vec::with_capacity(n_regions);
    for _ in 0..n_regions {
        let region = RegionInfo {
            id: r.u32()?,
            addr: r.u64()?,
            len: r.u64()?,
            rkey: r.u32()?,
            name: r.str()?,
        };
        if region.addr.checked_add(region.len).is_none() {
            return Err(WireError::Malformed(
                "region wraps around the address space",
            ));
        }
        regions.push(region);
    }
    Ok(Handshake { qps, regions })
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    // Names are capped at 255 bytes, cut at a character boundary.
    let mut end = s.len().min(255);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    out.push(end as u8);
    out.extend_from_slice(&s.as_bytes()[..end]);
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
        Ok(self.take(N)?.try_into().expect("take returned N bytes"))
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
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Message {
        Message::Hello(Handshake {
            qps: vec![QpInfo {
                name: "data".into(),
                qpn: 0x11,
                psn: 0xabcdef,
                gid: [7; 16],
                lid: 3,
                mtu: 1024,
            }],
            regions: vec![RegionInfo {
                id: 9,
                name: "inbox".into(),
                addr: 0x7f00_0000_1000,
                len: 4096,
                rkey: 0x1234,
            }],
        })
    }

    #[test]
    fn messages_round_trip() {
        for msg in [
            sample(),
            Message::Accept(Handshake::default()),
            Message::Reject {
                code: 2,
                reason: "too many QPs".into(),
            },
            Message::Ready,
            Message::Disconnect { code: 0 },
        ] {
            let bytes = msg.encode();
            let (back, used) = Message::decode(&bytes).unwrap();
            assert_eq!((back, used), (msg.clone(), bytes.len()));
            assert_eq!(Message::read_from(&mut bytes.as_slice()).unwrap(), msg);
        }
    }

    #[test]
    fn fields_are_little_endian_at_fixed_offsets() {
        let bytes = sample().encode();
        assert_eq!(&bytes[0..4], b"RCCM");
        assert_eq!(&bytes[4..6], &[1, 0]);
        assert_eq!(&bytes[6..8], &[1, 0]);
        assert_eq!(&bytes[12..14], &[1, 0], "one QP");
        assert_eq!(&bytes[14..18], &[0x11, 0, 0, 0], "qpn");
    }

    #[test]
    fn decoder_rejects_bad_input_with_clear_errors() {
        let good = sample().encode();
        let mut bad_magic = good.clone();
        bad_magic[0] = b'X';
        assert!(matches!(
            Message::decode(&bad_magic),
            Err(WireError::BadMagic(_))
        ));

        let mut bad_version = good.clone();
        bad_version[4] = 2;
        assert!(matches!(
            Message::decode(&bad_version),
            Err(WireError::UnsupportedVersion {
                found: 2,
                supported: 1
            })
        ));

        for cut in [0, 5, FRAME_HEADER_LEN, good.len() - 1] {
            assert!(
                matches!(Message::decode(&good[..cut]), Err(WireError::Truncated(_))),
                "cut at {cut}"
            );
        }

        let mut huge = good.clone();
        huge[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            Message::decode(&huge),
            Err(WireError::Oversized { len: u32::MAX, .. })
        ));
        assert!(matches!(
            Message::read_from(&mut huge.as_slice()),
            Err(WireError::Oversized { .. })
        ));

        let mut unknown = Message::Ready.encode();
        unknown[6] = 99;
        assert!(matches!(
            Message::decode(&unknown),
            Err(WireError::UnknownKind(99))
        ));

        let mut trailing = Message::Ready.encode();
        trailing[8] = 1;
        trailing.push(0);
        assert!(matches!(
            Message::decode(&trailing),
            Err(WireError::Malformed(_))
        ));
    }

    #[test]
    fn garbage_from_a_stray_client_is_bad_magic() {
        let err = Message::read_from(&mut &b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"[..]).unwrap_err();
        assert!(matches!(err, WireError::BadMagic(_)), "{err}");
        assert!(err.to_string().contains("not an rdma-comm-core peer"));
    }
}
