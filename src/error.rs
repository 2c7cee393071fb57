//! Typed errors: every failure names the verb, the device and, where there is
//! one, the queue pair, so a log line is enough to find the cause.
//!
//! Building an error never allocates: device names are shared `Arc<str>`s and
//! errno values stay raw until displayed, so errors can be returned from the
//! data path.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::verbs::cm::CmEventKind;
use crate::verbs::{WcOpcode, WcStatus};

/// Result alias used across the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What went wrong, with enough context to act on it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A verbs call returned an error code.
    #[error("{verb} failed on {device}{}: {}", qpn_suffix(*.qpn), io::Error::from_raw_os_error(*.errno))]
    Verbs {
        /// The verb that failed, e.g. `ibv_modify_qp(RTR)`.
        verb: &'static str,
        /// The errno it reported.
        errno: i32,
        /// The device it ran on.
        device: Arc<str>,
        /// The queue pair involved, if any.
        qpn: Option<u32>,
    },
    /// Posting work requests failed; the first `posted` of the list went out.
    #[error("{verb} failed on {device} (QP {qpn}) after {posted} work request(s) were posted: {}", io::Error::from_raw_os_error(*.errno))]
    Post {
        /// `ibv_post_send` or `ibv_post_recv`; a window bind's is
        /// `ibv_post_send(IBV_WR_BIND_MW, IBV_ACCESS_ZERO_BASED)`.
        verb: &'static str,
        /// The errno it reported (`ENOMEM`: the queue is full).
        errno: i32,
        /// The device.
        device: Arc<str>,
        /// The queue pair.
        qpn: u32,
        /// How many requests of the list were accepted before the failing one.
        posted: usize,
    },
    /// Polling a completion queue failed: the CQ overran or the device
    /// failed, and it cannot be polled on. `ibv_poll_cq` returns a negative
    /// value then, not an errno (mlx4 and mlx5 return -2 whatever the
    /// cause, others `-errno`), so the provider's value is kept as it is.
    #[error(
        "ibv_poll_cq failed on {device}: the provider returned {code} (a CQ overrun or a device error)"
    )]
    CqPoll {
        /// The device.
        device: Arc<str>,
        /// What the provider's poll returned (negative).
        code: i32,
    },
    /// The device or provider does not implement a verb.
    #[error("{verb} is not supported by {device}")]
    Unsupported {
        /// The verb that is missing.
        verb: &'static str,
        /// The device that lacks it.
        device: Arc<str>,
    },
    /// A work request completed with an error status.
    ///
    /// `IBV_WC_RETRY_EXC_ERR` means the peer stopped acknowledging: it
    /// died, or the link was down for longer than the QP's retry window
    /// (see [`QpConfig::timeout`](crate::verbs::QpConfig::timeout)).
    ///
    /// The message leaves the opcode out: libibverbs defines it only for
    /// successful completions.
    #[error(
        "work request {wr_id:#x} on QP {qpn}{} failed: {status} (vendor error {vendor_err:#x})",
        peer_suffix(*.peer)
    )]
    Completion {
        /// Completion status, e.g. `IBV_WC_REM_ACCESS_ERR`.
        status: WcStatus,
        /// The operation as the completion reported it: undefined, since
        /// libibverbs sets it only for successful completions (some
        /// providers do fill it in). The work request id says what failed.
        opcode: WcOpcode,
        /// The QP the completion belongs to.
        qpn: u32,
        /// The work request id the poster chose.
        wr_id: u64,
        /// Provider-specific detail.
        vendor_err: u32,
        /// The peer the QP is connected to, when known: the reactor fills
        /// it in from the session's link ([`PeerLink::peer`](crate::reactor::PeerLink::peer));
        /// a bare [`WorkCompletion::ok`](crate::verbs::WorkCompletion::ok) knows none.
        peer: Option<SocketAddr>,
    },
    /// No RDMA device matched (or none exists at all).
    #[error("no RDMA device {0}")]
    NoDevice(String),
    /// The port is not usable.
    #[error("{device} port {port}: {reason}")]
    Port {
        /// The device.
        device: Arc<str>,
        /// The port number (1-based).
        port: u8,
        /// Why it cannot be used.
        reason: String,
    },
    /// A local or remote range lies outside its registered region.
    #[error("{what}: range {offset}+{len} is outside the region of {size} bytes")]
    OutOfBounds {
        /// Which descriptor was out of bounds.
        what: &'static str,
        /// Requested offset into the region.
        offset: u64,
        /// Requested length.
        len: u64,
        /// Size of the region.
        size: u64,
    },
    /// A request was malformed before it reached the device.
    #[error("invalid request: {0}")]
    InvalidArgument(&'static str),
    /// A [`QpConfig`](crate::verbs::QpConfig) setting is outside the range
    /// its field has on the wire (see
    /// [`QpConfig::validate`](crate::verbs::QpConfig::validate)); no QP was
    /// created or changed.
    #[error("invalid QP configuration: {field} = {value} is out of range (at most {max})")]
    QpConfigOutOfRange {
        /// The `QpConfig` field, e.g. `retry_cnt`.
        field: &'static str,
        /// The value it was given.
        value: u8,
        /// The largest value it takes.
        max: u8,
    },
    /// A handle (a pool slot, say) was given to an object it does not
    /// belong to, or that no longer holds what it named.
    #[error("foreign handle: {0}")]
    ForeignHandle(&'static str),
    /// An inline payload exceeds the QP's `max_inline_data`.
    #[error("inline payload of {len} bytes exceeds the QP's max_inline_data of {max}")]
    InlineTooLarge {
        /// Payload length.
        len: usize,
        /// The QP's limit.
        max: u32,
    },
    /// The out-of-band handshake with a peer failed (bad or truncated message,
    /// wrong version, timeout, reset).
    #[error("handshake with {peer} failed: {source}")]
    Handshake {
        /// The peer's address.
        peer: SocketAddr,
        /// What was wrong.
        #[source]
        source: WireError,
    },
    /// An established peer went away without a disconnect message, or sent
    /// something that is not part of the protocol.
    #[error("peer {peer} is gone: {source}")]
    PeerGone {
        /// The peer's address.
        peer: SocketAddr,
        /// What the control connection showed.
        #[source]
        source: WireError,
    },
    /// The peer understood us and said no.
    #[error("{peer} rejected the connection (code {code}): {reason}")]
    Rejected {
        /// The peer's address.
        peer: SocketAddr,
        /// Reason code.
        code: u16,
        /// The peer's reason.
        reason: String,
    },
    /// Mutual authentication with the peer failed: a wrong or missing key
    /// on either side. Nothing was created or revealed.
    #[error("authentication with {peer} failed: {what}")]
    Unauthenticated {
        /// The peer's address.
        peer: SocketAddr,
        /// Which side lacked or failed the proof.
        what: String,
    },
    /// The server's admission policy (its authorize callback, its peer
    /// limit or its accept backlog) refused the peer. Nothing was created.
    #[error("{peer} was not admitted: {reason}")]
    Unauthorized {
        /// The peer's address.
        peer: SocketAddr,
        /// Why.
        reason: String,
    },
    /// The peer sent a well-formed message that makes no sense at this point.
    #[error("protocol error with {peer}: {what}")]
    Protocol {
        /// The peer's address.
        peer: SocketAddr,
        /// What was unexpected.
        what: String,
    },
    /// Connecting kept failing until the deadline.
    #[error("could not connect to {addr} within {elapsed:?} ({attempts} attempts): {last}")]
    ConnectTimeout {
        /// The address we tried.
        addr: String,
        /// How many connection attempts were made.
        attempts: u32,
        /// Time spent.
        elapsed: Duration,
        /// The last attempt's error.
        last: io::Error,
    },
    /// The peer of a reactor connection ignored its credits: it consumed
    /// more receives than the reactor had granted it. On a shared receive
    /// queue such a peer would take receives promised to other
    /// connections, so the reactor cuts it off: the QP goes to the error
    /// state, the receive is not delivered, and the handler's `on_error`
    /// gets this. Both counts are cumulative over the connection's life
    /// (and wrap at 2^32); a peer that keeps to its credits never has
    /// `consumed > granted`. How many shared receives such a peer can take
    /// beyond its grant before it is cut off, and for how long, is told at
    /// [`ReactorConfig::srq_depth`](crate::reactor::ReactorConfig::srq_depth).
    #[error(
        "the peer{} of QP {qpn} ignored its credits: it consumed {consumed} receives but was granted {granted} (a share of {share}); connection cut off",
        peer.map(|p| format!(" {p}")).unwrap_or_default()
    )]
    CreditOverrun {
        /// The local QP the receives arrived on.
        qpn: u32,
        /// The peer's address, when known: the reactor fills it in from the
        /// session's link, as for [`Error::Completion`].
        peer: Option<SocketAddr>,
        /// Receives granted to the peer: the highest receive count the
        /// reactor had announced to it.
        granted: u32,
        /// Receives the peer had consumed, the one that overran included.
        consumed: u32,
        /// The connection's share of receives (`ReactorConfig::recv_depth`).
        share: u32,
    },
    /// The peer of a reactor connection sent a SEND that the reactor's
    /// protocol has no place for (no immediate, an unknown kind, a length
    /// that does not fit its kind): it does not speak the protocol, so the
    /// reactor cuts it off as for [`Error::CreditOverrun`]. The message is
    /// not delivered.
    #[error(
        "the peer{} of QP {qpn} sent a malformed message ({what}); connection cut off",
        peer.map(|p| format!(" {p}")).unwrap_or_default()
    )]
    MalformedMessage {
        /// The local QP the message arrived on.
        qpn: u32,
        /// The peer's address, when known.
        peer: Option<SocketAddr>,
        /// What was wrong with it.
        what: &'static str,
    },
    /// A connection-manager (rdma_cm) call failed, or the event that came
    /// back was not the one the operation waits for (a reject, an
    /// unreachable peer, a disconnect, a timeout).
    #[error("{op}{}: {cause}", with_peer_suffix(*.peer))]
    Cm {
        /// The operation, e.g. `rdma_resolve_addr` or `rdma_connect`.
        op: &'static str,
        /// The peer's address, when the id has one.
        peer: Option<SocketAddr>,
        /// What happened.
        #[source]
        cause: CmFailure,
    },
    /// An operating-system call outside libibverbs failed, or memory asked
    /// for up front was refused (`ENOMEM`).
    #[error("{what}: {source}")]
    Os {
        /// What we were doing.
        what: &'static str,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// An authentication key file could not be used: unreadable, open to
    /// group or others, too large, or holding too short a key.
    #[error("authentication key file {}: {what}{}", path.display(), source.as_ref().map(|e| format!(": {e}")).unwrap_or_default())]
    KeyFile {
        /// The file.
        path: std::path::PathBuf,
        /// What is wrong with it.
        what: &'static str,
        /// The error of reading it, when that is what failed.
        source: Option<io::Error>,
    },
    /// A runtime could not be started or used as asked: too few cores, a
    /// core listed twice, a reactor that failed to start or has stopped.
    #[error("runtime: {0}")]
    Runtime(String),
}

/// Why bytes from a peer were not a valid message.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// The first four bytes are not our magic: not one of our peers.
    #[error("bad magic {0:#010x} (not an rdma-comm-core peer)")]
    BadMagic(u32),
    /// The peer speaks a protocol version we do not.
    #[error("unsupported protocol version {found} (this side speaks {supported})")]
    UnsupportedVersion {
        /// Version in the frame.
        found: u16,
        /// Version we speak.
        supported: u16,
    },
    /// The input ended inside a header, payload or field.
    #[error("truncated message: {0}")]
    Truncated(&'static str),
    /// The declared payload length exceeds [`MAX_PAYLOAD`](crate::session::wire::MAX_PAYLOAD).
    #[error("payload length {len} exceeds the maximum of {max}")]
    Oversized {
        /// Declared length.
        len: u32,
        /// Our limit.
        max: u32,
    },
    /// An unknown message kind.
    #[error("unknown message kind {0}")]
    UnknownKind(u16),
    /// A field is out of range or the payload has trailing bytes.
    #[error("malformed message: {0}")]
    Malformed(&'static str),
    /// The transport failed or timed out.
    #[error("{0}")]
    Io(#[from] io::Error),
}

/// Why a connection-manager operation failed ([`Error::Cm`]). Small and
/// allocation-free, like every error here.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CmFailure {
    /// The call itself failed with this errno.
    #[error("{}", io::Error::from_raw_os_error(*.0))]
    Errno(i32),
    /// An event said no, or came instead of the one awaited.
    #[error("{got}{}{}", cm_status(*got, *status), expected_suffix(*expected))]
    Event {
        /// The event that came (`Rejected`, `Disconnected`, ...).
        got: CmEventKind,
        /// Its status: a negative errno, or for `Rejected` the transport's
        /// reject reason (InfiniBand CM: 28 is the peer's own reject, 8 no
        /// listener at that port).
        status: i32,
        /// The event the operation was waiting for, if any.
        expected: Option<CmEventKind>,
    },
    /// The awaited event did not come within this many milliseconds.
    #[error("no event within {0} ms")]
    Timeout(u32),
}

fn cm_status(got: CmEventKind, status: i32) -> String {
    let rejected = got == CmEventKind::Rejected;
    match status {
        0 => String::new(),
        s if s < 0 => format!(": {} (status {s})", io::Error::from_raw_os_error(-s)),
        8 if rejected => " (reason 8: no listener at that port)".into(),
        28 if rejected => " (reason 28: rejected by the peer)".into(),
        s if rejected => format!(" (reason {s})"),
        s => format!(" (status {s})"),
    }
}

fn expected_suffix(expected: Option<CmEventKind>) -> String {
    expected.map_or_else(String::new, |e| format!(" instead of {e}"))
}

fn with_peer_suffix(peer: Option<SocketAddr>) -> String {
    peer.map(|p| format!(" with {p}")).unwrap_or_default()
}

/// Turns the result of a libc call that returns -1 and sets `errno` on
/// failure into a `Result` naming what was being done.
pub(crate) fn os_result(rc: i64, what: &'static str) -> Result<i64> {
    if rc == -1 {
        Err(Error::Os {
            what,
            source: io::Error::last_os_error(),
        })
    } else {
        Ok(rc)
    }
}

fn qpn_suffix(qpn: Option<u32>) -> String {
    qpn.map(|n| format!(" (QP {n})")).unwrap_or_default()
}

fn peer_suffix(peer: Option<SocketAddr>) -> String {
    peer.map(|p| format!(" (peer {p})")).unwrap_or_default()
}

impl Error {
    /// The errno carried by a verbs or OS error, if any.
    pub fn errno(&self) -> Option<i32> {
        match self {
            Error::Verbs { errno, .. } | Error::Post { errno, .. } => Some(*errno),
            Error::Os { source, .. } => source.raw_os_error(),
            Error::KeyFile {
                source: Some(source),
                ..
            } => source.raw_os_error(),
            Error::Cm {
                cause: CmFailure::Errno(errno),
                ..
            } => Some(*errno),
            _ => None,
        }
    }

    /// True when a post failed because the send or receive queue is full
    /// (providers report `ENOMEM`); the caller should poll and retry.
    pub fn is_queue_full(&self) -> bool {
        matches!(self, Error::Verbs { errno, .. } | Error::Post { errno, .. } if *errno == libc::ENOMEM)
    }

    /// Why a connection-manager operation failed, when this is one.
    pub fn cm_failure(&self) -> Option<CmFailure> {
        match self {
            Error::Cm { cause, .. } => Some(*cause),
            _ => None,
        }
    }

    /// The completion status, when this error came from a failed completion.
    pub fn completion_status(&self) -> Option<WcStatus> {
        match self {
            Error::Completion { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// The peer this error names, if any: the address of a session's peer
    /// (handshake, control connection, rejection), the peer of the QP whose
    /// request failed or that ignored its credits, or the peer of a
    /// connection-manager id.
    pub fn peer(&self) -> Option<SocketAddr> {
        // Every variant is listed, with no catch-all: a new one must be
        // classified here, or the crate does not build.
        match self {
            Error::Completion { peer, .. }
            | Error::CreditOverrun { peer, .. }
            | Error::MalformedMessage { peer, .. }
            | Error::Cm { peer, .. } => *peer,
            Error::Handshake { peer, .. }
            | Error::PeerGone { peer, .. }
            | Error::Rejected { peer, .. }
            | Error::Unauthenticated { peer, .. }
            | Error::Unauthorized { peer, .. }
            | Error::Protocol { peer, .. } => Some(*peer),
            // ConnectTimeout's address is what the caller asked for (a
            // name, perhaps), not a peer that answered.
            Error::Verbs { .. }
            | Error::Post { .. }
            | Error::CqPoll { .. }
            | Error::Unsupported { .. }
            | Error::NoDevice(_)
            | Error::Port { .. }
            | Error::OutOfBounds { .. }
            | Error::InvalidArgument(_)
            | Error::KeyFile { .. }
            | Error::QpConfigOutOfRange { .. }
            | Error::ForeignHandle(_)
            | Error::InlineTooLarge { .. }
            | Error::ConnectTimeout { .. }
            | Error::Os { .. }
            | Error::Runtime(_) => None,
        }
    }

    /// Names `peer` as the peer of a failed completion, a credit overrun or
    /// a malformed message that did not say (other errors are returned as
    /// they are). For code on the verbs layer that knows whom its QP is
    /// connected to: [`WorkCompletion::ok`](crate::verbs::WorkCompletion::ok)
    /// knows no peer, so `wc.ok().map_err(|e| e.with_peer(Some(peer)))`
    /// makes its error name one.
    pub fn with_peer(mut self, peer: Option<SocketAddr>) -> Self {
        if let Error::Completion {
            peer: slot @ None, ..
        }
        | Error::CreditOverrun {
            peer: slot @ None, ..
        }
        | Error::MalformedMessage {
            peer: slot @ None, ..
        } = &mut self
        {
            *slot = peer;
        }
        self
    }
}

/// Shorthand used by the verbs modules to build a [`Error::Verbs`].
pub(crate) fn verbs_error(
    verb: &'static str,
    errno: i32,
    device: &Arc<str>,
    qpn: Option<u32>,
) -> Error {
    Error::Verbs {
        verb,
        errno,
        device: Arc::clone(device),
        qpn,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cm_errors_name_the_op_the_peer_and_the_event() {
        let peer = Some("10.77.0.1:7174".parse().unwrap());
        let rejected = Error::Cm {
            op: "rdma_connect",
            peer,
            cause: CmFailure::Event {
                got: CmEventKind::Rejected,
                status: 8,
                expected: Some(CmEventKind::ConnectResponse),
            },
        };
        assert_eq!(
            rejected.to_string(),
            "rdma_connect with 10.77.0.1:7174: RDMA_CM_EVENT_REJECTED (reason 8: no listener \
             at that port) instead of RDMA_CM_EVENT_CONNECT_RESPONSE"
        );
        let addr_error = CmFailure::Event {
            got: CmEventKind::AddrError,
            status: -libc::ETIMEDOUT,
            expected: None,
        };
        assert!(
            addr_error
                .to_string()
                .starts_with("RDMA_CM_EVENT_ADDR_ERROR: ")
        );
        let errno = Error::Cm {
            op: "rdma_bind_addr",
            peer: None,
            cause: CmFailure::Errno(libc::EADDRINUSE),
        };
        assert_eq!(errno.errno(), Some(libc::EADDRINUSE));
        assert_eq!(errno.cm_failure(), Some(CmFailure::Errno(libc::EADDRINUSE)));
        assert_eq!(
            CmFailure::Timeout(2000).to_string(),
            "no event within 2000 ms"
        );
        // Connection-manager errors do not make every Result larger.
        assert!(std::mem::size_of::<Error>() <= 64);
    }

    fn retry_exceeded(peer: Option<SocketAddr>) -> Error {
        Error::Completion {
            status: WcStatus::RETRY_EXC_ERR,
            opcode: WcOpcode::SEND,
            qpn: 17,
            wr_id: 0x2a,
            vendor_err: 0,
            peer,
        }
    }

    #[test]
    fn a_failed_completion_names_its_peer_once_known() {
        let bare = retry_exceeded(None);
        assert_eq!(
            bare.to_string(),
            "work request 0x2a on QP 17 failed: IBV_WC_RETRY_EXC_ERR (vendor error 0x0)"
        );
        assert_eq!(bare.peer(), None);
        let peer: SocketAddr = "10.78.0.1:7471".parse().unwrap();
        let named = bare.with_peer(Some(peer));
        assert_eq!(
            named.to_string(),
            "work request 0x2a on QP 17 (peer 10.78.0.1:7471) failed: IBV_WC_RETRY_EXC_ERR (vendor error 0x0)"
        );
        assert_eq!(named.peer(), Some(peer));
        assert_eq!(named.completion_status(), Some(WcStatus::RETRY_EXC_ERR));
        // A peer already named stays; other errors are left alone.
        let other: SocketAddr = "10.78.0.9:1".parse().unwrap();
        assert_eq!(named.with_peer(Some(other)).peer(), Some(peer));
        let gone = Error::InvalidArgument("x").with_peer(Some(other));
        assert_eq!(gone.peer(), None);
    }

    #[test]
    fn a_credit_overrun_names_its_peer_once_known() {
        let bare = Error::CreditOverrun {
            qpn: 9,
            peer: None,
            granted: 64,
            consumed: 65,
            share: 64,
        };
        assert_eq!(bare.peer(), None);
        assert!(bare.to_string().starts_with("the peer of QP 9 ignored"));
        let peer: SocketAddr = "10.78.0.2:7471".parse().unwrap();
        let named = bare.with_peer(Some(peer));
        assert_eq!(named.peer(), Some(peer));
        assert!(
            named
                .to_string()
                .starts_with("the peer 10.78.0.2:7471 of QP 9 ignored"),
            "{named}"
        );
    }

    #[test]
    fn a_cm_error_names_its_peer() {
        let peer: SocketAddr = "10.77.0.1:7174".parse().unwrap();
        let error = |peer| Error::Cm {
            op: "rdma_connect",
            peer,
            cause: CmFailure::Timeout(10),
        };
        assert_eq!(error(Some(peer)).peer(), Some(peer));
        assert_eq!(error(None).peer(), None);
    }
}
