//! The connecting side: TCP (or the connection manager) with retry and
//! backoff, then the handshake.

use std::io;
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use super::endpoint::ControlLink;
use super::handshake::{self, FrameIo, Resources};
use super::wire::{Handshake, WireError};
use super::{
    AuthKey, Control, DEFAULT_HANDSHAKE_TIMEOUT, Endpoint, Export, ExportWindows, QpSpec,
    SessionQp, Transport, build_qps, check_exports, check_qp_names, connect_qps, local_handshake,
    reject_code,
};
use crate::error::{Error, Result};
use crate::verbs::{BoundWindow, ProtectionDomain};

/// What a client asks for and how hard it tries.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// Channels to open (at least one).
    pub qps: Vec<QpSpec>,
    /// Regions to export to the server.
    pub exports: Vec<Export>,
    /// Give up connecting (all retries included) after this long; a frame
    /// of ours in flight, or a refusal of ours, then gets up to 200 ms more.
    pub connect_deadline: Duration,
    /// First pause between attempts; doubles up to `max_backoff`.
    pub initial_backoff: Duration,
    /// Longest pause between attempts.
    pub max_backoff: Duration,
    /// Time the handshake may take once connected (TCP or the connection
    /// manager), ending at `connect_deadline` at the latest.
    pub handshake_timeout: Duration,
    /// The shared key to prove and to require of the server. With a key,
    /// the client reveals nothing (its QPs, its region keys) until the
    /// server has proven it holds the same key.
    pub auth_key: Option<AuthKey>,
    /// Who this client says it is (the server's authorize callback sees it;
    /// at most 255 bytes).
    pub identity: String,
    /// TCP, or the RDMA connection manager (the server must use the same).
    pub transport: Transport,
}

impl ClientConfig {
    /// Opens `qps`, exporting nothing, with default timeouts.
    pub fn new(qps: Vec<QpSpec>) -> Self {
        Self {
            qps,
            exports: Vec::new(),
            connect_deadline: Duration::from_secs(30),
            initial_backoff: Duration::from_millis(20),
            max_backoff: Duration::from_secs(1),
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
            auth_key: None,
            identity: String::new(),
            transport: Transport::Tcp,
        }
    }

    /// Connects over `transport`.
    pub fn with_transport(mut self, transport: Transport) -> Self {
        self.transport = transport;
        self
    }

    /// Proves `key` to the server and requires the server to prove it.
    pub fn with_auth_key(mut self, key: Option<AuthKey>) -> Self {
        self.auth_key = key;
        self
    }

    /// Says who this client is.
    pub fn with_identity(mut self, identity: impl Into<String>) -> Self {
        self.identity = identity.into();
        self
    }

    /// Adds regions to export.
    pub fn with_exports(mut self, exports: Vec<Export>) -> Self {
        self.exports = exports;
        self
    }
}

/// Connects to a [`ServerSession`](super::ServerSession).
#[derive(Debug)]
pub struct ClientSession;

impl ClientSession {
    /// Connects to `addr`, retrying refused or unreachable attempts with
    /// exponential backoff until the deadline, then runs the handshake.
    /// A handshake is tried again, within the same deadline, when the
    /// server answers busy, or cuts it without a word before our `Ready`
    /// (over TCP it closes or resets the connection, over rdma_cm it
    /// disconnects): its hello or handshake deadline ran out while this
    /// process, or the server, was slow. The attempt after a cut connects
    /// once: a server that no longer listens (its peer limit reached, or
    /// shut down) ends the retries with the cut. A refusal that says why
    /// (a wrong key, an unauthorized peer, a bad request), a server that
    /// keeps silent until our handshake timeout, and a cut once our `Ready`
    /// is on its way (the server may have kept the session) are not
    /// retried. Each handshake's timeout is counted from its connect and
    /// ends at the connect deadline at the latest (a frame of ours in
    /// flight, or a refusal of ours, gets up to 200 ms more). When the
    /// deadline runs out in an attempt made after a busy answer, before
    /// the server admitted us, the busy refusal is returned
    /// ([`Error::Rejected`] with
    /// [`reject_code::BUSY`](super::reject_code::BUSY)): that is why
    /// nothing got through. An attempt that times out on its own handshake
    /// timeout, with deadline to spare, or once admitted (the server may
    /// have made the session's resources by then), reports the timeout; so
    /// does one after an attempt the server admitted since the busy
    /// answer. A busy answer after admission is not tried again.
    ///
    /// Either every QP is connected and ready, or an error is returned and
    /// every resource created on the way is destroyed: never half-connected.
    pub fn connect(
        addr: impl ToSocketAddrs,
        pd: &ProtectionDomain,
        config: &ClientConfig,
    ) -> Result<Endpoint> {
        if config.qps.is_empty() {
            return Err(Error::InvalidArgument("a client needs at least one QP"));
        }
        check_qp_names(&config.qps)?;
        check_exports(pd, &config.exports)?;
        if config.identity.len() > super::wire::MAX_NAME_LEN {
            return Err(Error::InvalidArgument(
                "a client identity is at most 255 bytes",
            ));
        }
        let start = Instant::now();
        let mut backoff = first_backoff(config.initial_backoff, config.max_backoff);
        let mut cut: Option<Error> = None;
        let mut busy: Option<Error> = None;
        loop {
            let after_cut = cut.is_some();
            let mut admitted = false;
            match (
                Self::attempt(&addr, pd, config, start, after_cut, &mut admitted),
                cut.take(),
            ) {
                // The server cut us and stopped listening: the cut says why.
                (Err(err), Some(cut)) if nobody_listens(&err) => return Err(cut),
                // (Busy is an answer to a hello: once admitted, the server
                // may have made the session, and busy is not tried again.)
                (Err(err), _)
                    if worth_another_try(&err)
                        && !(admitted && matches!(err, Error::Rejected { .. }))
                        && start.elapsed().saturating_add(backoff) < config.connect_deadline =>
                {
                    // The server's text, escaped, as the server escapes ours.
                    log::debug!("{:?}; trying again in {backoff:?}", err.to_string());
                    if matches!(err, Error::Rejected { .. }) {
                        busy = Some(err);
                    } else {
                        // Admitted since the busy answer: it no longer says
                        // why a later attempt fails.
                        if admitted {
                            busy = None;
                        }
                        cut = Some(err);
                    }
                    std::thread::sleep(backoff);
                    backoff = next_backoff(backoff, config.max_backoff);
                }
                // An attempt after a busy answer that the connect deadline
                // ended before the server admitted us: the server being
                // busy is why nothing got through, not the little time the
                // last attempt had. (Once admitted, the server may have
                // made the session's resources: its timeout is reported.)
                (Err(err), _)
                    if busy.is_some()
                        && !admitted
                        && timed_out(&err)
                        && start.elapsed() >= config.connect_deadline =>
                {
                    log::debug!("{err}, after the server was busy");
                    return Err(busy.take().unwrap_or(err));
                }
                (other, _) => return other,
            }
        }
    }

    /// One connection and handshake, within what is left of the connect
    /// deadline; after a cut, the connection is tried once. `admitted` is
    /// set once the server has admitted us.
    fn attempt(
        addr: &impl ToSocketAddrs,
        pd: &ProtectionDomain,
        config: &ClientConfig,
        start: Instant,
        after_cut: bool,
        admitted: &mut bool,
    ) -> Result<Endpoint> {
        let deadline = super::deadline_after(start, config.connect_deadline);
        let remaining = || {
            deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1))
        };
        match config.transport {
            Transport::Tcp => {
                let (stream, peer) = connect_with_retry(addr, config, remaining(), !after_cut)?;
                // Counted from now: a connect that waited for a late server
                // leaves the handshake only what is left of the deadline.
                let handshake_timeout = config.handshake_timeout.min(remaining());
                let control = Control::new(stream, peer, handshake_timeout, handshake_timeout);
                Self::handshake(pd, config, control, admitted, |control| {
                    Ok(ControlLink::tcp(control.into_stream()?))
                })
            }
            #[cfg(not(feature = "rdma_cm"))]
            Transport::RdmaCm => Err(Error::InvalidArgument(super::RDMA_CM_OFF)),
            #[cfg(feature = "rdma_cm")]
            Transport::RdmaCm => {
                let backoff = (config.initial_backoff, config.max_backoff);
                let control = super::cm::connect(
                    addr,
                    config.handshake_timeout,
                    deadline,
                    backoff,
                    !after_cut,
                )?;
                Self::handshake(pd, config, control, admitted, |control| {
                    Ok(ControlLink::Cm(Box::new(control.into_link())))
                })
            }
        }
    }

    /// Runs the handshake over `control`, then makes the endpoint with the
    /// link `link` makes of it. Sets `admitted` once the server admits us.
    fn handshake<C: FrameIo>(
        pd: &ProtectionDomain,
        config: &ClientConfig,
        mut control: C,
        admitted: &mut bool,
        link: impl FnOnce(C) -> Result<ControlLink>,
    ) -> Result<Endpoint> {
        let peer = control.peer();
        let mut side = ClientSide {
            pd,
            config,
            admitted,
            peer,
            qps: Vec::new(),
            windows: None,
            bound: Vec::new(),
        };
        let names = config.qps.iter().map(|spec| spec.name.clone()).collect();
        let accept = handshake::connect(
            &mut control,
            config.auth_key.as_ref(),
            &config.identity,
            names,
            &mut side,
        )?;
        Ok(Endpoint::new(
            peer,
            side.qps,
            config.exports.clone(),
            side.bound,
            accept.regions,
            link(control)?,
        ))
    }
}

/// Shortest pause between attempts: a zero setting would reconnect in a
/// tight loop.
const MIN_BACKOFF: Duration = Duration::from_millis(1);

/// The first pause between attempts: `initial`, at most `max` but never
/// under [`MIN_BACKOFF`].
pub(super) fn first_backoff(initial: Duration, max: Duration) -> Duration {
    initial.min(max).max(MIN_BACKOFF)
}

/// The pause after `backoff`: twice as long, at most `max` but never under
/// [`MIN_BACKOFF`]; saturating, so no setting overflows.
pub(super) fn next_backoff(backoff: Duration, max: Duration) -> Duration {
    backoff.saturating_mul(2).min(max).max(MIN_BACKOFF)
}

/// Whether a connect tried once found nobody listening: over TCP a refused
/// (or unanswered) connect, over rdma_cm a reject for want of a listener
/// or an unreachable peer.
fn nobody_listens(err: &Error) -> bool {
    #[cfg(feature = "rdma_cm")]
    if super::cm::not_there(err) {
        return true;
    }
    matches!(err, Error::ConnectTimeout { .. })
}

/// Whether an attempt failed because its time ran out: a connect left
/// unanswered (over TCP, or over rdma_cm as [`super::cm::timed_out`] says),
/// or a handshake frame that did not come.
fn timed_out(err: &Error) -> bool {
    match err {
        Error::ConnectTimeout { last, .. } => last.kind() == io::ErrorKind::TimedOut,
        #[cfg(feature = "rdma_cm")]
        Error::Cm { .. } => super::cm::timed_out(err),
        Error::Handshake {
            source: WireError::Io(io),
            ..
        } => io.kind() == io::ErrorKind::TimedOut,
        _ => false,
    }
}

/// Whether a failed handshake may go through if tried again: the server
/// asked us to come back (busy), or cut the handshake without saying why
/// before our `Ready` (after it, the handshake reports the cut as
/// [`io::ErrorKind::Other`]). Every resource of the failed attempt is gone
/// by then; the server drops what it made for it when it cuts.
fn worth_another_try(err: &Error) -> bool {
    match err {
        Error::Rejected { code, .. } => *code == reject_code::BUSY,
        Error::Handshake {
            source: WireError::Io(io),
            ..
        } => handshake::is_cut(io),
        _ => false,
    }
}

/// The client's resources, created once the server is trusted.
struct ClientSide<'a> {
    pd: &'a ProtectionDomain,
    config: &'a ClientConfig,
    /// Set when the handshake asks for our resources: the server has
    /// admitted us.
    admitted: &'a mut bool,
    peer: SocketAddr,
    qps: Vec<SessionQp>,
    windows: Option<ExportWindows>,
    bound: Vec<BoundWindow>,
}

impl Resources for ClientSide<'_> {
    fn build(&mut self, _: Option<&Handshake>) -> Result<Handshake> {
        *self.admitted = true;
        let exports = &self.config.exports;
        self.qps = build_qps(self.pd, &self.config.qps, exports.len())?;
        let windows = ExportWindows::allocate(self.pd, exports, self.qps.len())?;
        let ours = local_handshake(&self.qps, exports, &windows)?;
        self.windows = Some(windows);
        Ok(ours)
    }

    fn connect(&mut self, peer: &Handshake) -> Result<()> {
        connect_qps(self.peer, &mut self.qps, &peer.qps)?;
        if let Some(windows) = self.windows.take() {
            self.bound = windows.bind(&mut self.qps, &self.config.exports)?;
        }
        Ok(())
    }
}

/// Connects to `addr` within `deadline`, retrying with backoff when `retry`
/// (else once).
fn connect_with_retry(
    addr: &impl ToSocketAddrs,
    config: &ClientConfig,
    deadline: Duration,
    retry: bool,
) -> Result<(TcpStream, SocketAddr)> {
    let start = Instant::now();
    let describe = || {
        addr.to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
            .map_or_else(|| "the server".to_string(), |a| a.to_string())
    };
    let mut backoff = first_backoff(config.initial_backoff, config.max_backoff);
    let mut attempts = 0;
    loop {
        attempts += 1;
        let left = deadline.saturating_sub(start.elapsed());
        let last = match resolve_and_connect(addr, left.max(Duration::from_millis(1))) {
            Ok(conn) => return Ok(conn),
            Err(err) => err,
        };
        if !retry || start.elapsed().saturating_add(backoff) >= deadline {
            return Err(Error::ConnectTimeout {
                addr: describe(),
                attempts,
                elapsed: start.elapsed(),
                last,
            });
        }
        log::debug!(
            "connect attempt {attempts} to {} failed: {last}; retrying in {backoff:?}",
            describe()
        );
        std::thread::sleep(backoff);
        backoff = next_backoff(backoff, config.max_backoff);
    }
}

fn resolve_and_connect(
    addr: &impl ToSocketAddrs,
    timeout: Duration,
) -> io::Result<(TcpStream, SocketAddr)> {
    let mut last = io::Error::new(io::ErrorKind::NotFound, "the address resolved to nothing");
    // Name resolution is retried too: a peer's DNS entry may appear late.
    for candidate in addr.to_socket_addrs()? {
        match TcpStream::connect_timeout(&candidate, timeout) {
            Ok(stream) => return Ok((stream, candidate)),
            Err(err) => last = err,
        }
    }
    Err(last)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_backoff_never_spins_and_never_overflows() {
        assert_eq!(first_backoff(Duration::ZERO, Duration::ZERO), MIN_BACKOFF);
        assert_eq!(
            first_backoff(Duration::MAX, Duration::from_secs(1)),
            Duration::from_secs(1)
        );
        assert_eq!(next_backoff(Duration::ZERO, Duration::ZERO), MIN_BACKOFF);
        let (ms, s) = (Duration::from_millis, Duration::from_secs);
        assert_eq!(next_backoff(ms(20), s(1)), ms(40));
        assert_eq!(next_backoff(ms(800), s(1)), s(1));
        assert_eq!(next_backoff(Duration::MAX, Duration::MAX), Duration::MAX);
    }

    #[test]
    fn only_a_real_timeout_counts_as_one() {
        use crate::error::CmFailure;
        use crate::verbs::cm::CmEventKind;
        let peer = "127.0.0.1:7174".parse().unwrap();
        let connect = |kind: io::ErrorKind| Error::ConnectTimeout {
            addr: "the server".into(),
            attempts: 3,
            elapsed: Duration::from_secs(1),
            last: kind.into(),
        };
        let cm = |cause| Error::Cm {
            op: "rdma_connect",
            peer: Some(peer),
            cause,
        };
        let event = |got, status| CmFailure::Event {
            got,
            status,
            expected: None,
        };
        let handshake = |kind: io::ErrorKind| Error::Handshake {
            peer,
            source: WireError::Io(kind.into()),
        };
        assert!(timed_out(&connect(io::ErrorKind::TimedOut)));
        assert!(timed_out(&cm(CmFailure::Timeout(5000))));
        assert!(timed_out(&cm(event(
            CmEventKind::AddrError,
            -libc::ETIMEDOUT
        ))));
        assert!(timed_out(&cm(event(
            CmEventKind::Unreachable,
            -libc::ETIMEDOUT
        ))));
        assert!(timed_out(&handshake(io::ErrorKind::TimedOut)));
        // A refused connect, another event, a cut: not the clock.
        assert!(!timed_out(&connect(io::ErrorKind::ConnectionRefused)));
        assert!(!timed_out(&cm(event(CmEventKind::Rejected, 8))));
        assert!(!timed_out(&cm(CmFailure::Errno(libc::ECONNREFUSED))));
        assert!(!timed_out(&handshake(io::ErrorKind::UnexpectedEof)));
    }
}
