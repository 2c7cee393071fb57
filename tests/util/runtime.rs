//! Runtime test helpers: an echo handler that is not `Send` (it counts in an
//! `Rc`), a verifying ping client on a reactor of its own in a thread, and
//! the guest-wide lock that keeps runtime tests from sharing 2 vCPUs.
#![allow(dead_code)]

use std::cell::Cell;
use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::mpsc::Sender;
use std::sync::{Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rdma_comm_core::Error;
use rdma_comm_core::reactor::*;
use rdma_comm_core::runtime::*;
use rdma_comm_core::session::*;

use super::DEADLINE;

/// One runtime test at a time: each pins reactors to both vCPUs.
pub fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The payload of message `seq`.
pub fn payload(seq: u64, len: usize) -> Vec<u8> {
    let mut bytes = vec![0; len];
    fill(&mut bytes, seq);
    bytes
}

pub fn fill(bytes: &mut [u8], seq: u64) {
    for (i, b) in bytes.iter_mut().enumerate() {
        *b = (seq.wrapping_mul(0x9e37_79b9).wrapping_add(i as u64 * 131) >> 5) as u8;
    }
}

pub fn matches(bytes: &[u8], seq: u64) -> bool {
    bytes
        .iter()
        .enumerate()
        .all(|(i, &b)| b == (seq.wrapping_mul(0x9e37_79b9).wrapping_add(i as u64 * 131) >> 5) as u8)
}

/// What a server handler reports to the test.
#[derive(Debug)]
pub enum Event {
    /// A session was built on `reactor` for the peer with this identity.
    Built { reactor: usize, identity: String },
    /// A connection of a session on `reactor` can send.
    Established { reactor: usize, conn: ConnId },
}

/// Echoes every SEND; counts in an `Rc` (so it is not `Send`: the factory
/// must build it on its reactor's thread); removes its session when the
/// peer leaves.
pub struct Echo {
    pub reactor: usize,
    pub echoed: Rc<Cell<u64>>,
    pub events: Sender<Event>,
}

impl Handler for Echo {
    fn on_established(&mut self, _ctx: &mut Ctx<'_>, conn: ConnId) {
        let _ = self.events.send(Event::Established {
            reactor: self.reactor,
            conn,
        });
    }

    fn on_message(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, data: &[u8], imm: Option<u32>) {
        if ctx.send(conn, data, imm).is_ok() {
            self.echoed.set(self.echoed.get() + 1);
        }
    }

    fn on_peer_gone(&mut self, ctx: &mut Ctx<'_>, session: SessionId, _status: &PeerStatus) {
        ctx.remove_session(session);
    }
}

/// A factory of [`Echo`]s that reports each session it builds.
pub fn echo_factory(events: Sender<Event>) -> impl HandlerFactory<Handler = Echo> {
    move |session: &NewSession<'_>| {
        let identity = session
            .hello
            .map(|hello| hello.identity.clone())
            .unwrap_or_default();
        let _ = events.send(Event::Built {
            reactor: session.reactor,
            identity,
        });
        Ok(Echo {
            reactor: session.reactor,
            echoed: Rc::new(Cell::new(0)),
            events: events.clone(),
        })
    }
}

/// A reactor configuration for runtimes and clients that sleep when idle.
pub fn blocking(sessions: u32) -> ReactorConfig {
    ReactorConfig {
        event_mode: EventMode::Blocking,
        ..ReactorConfig::for_traffic(512, 16, sessions)
    }
}

/// Sends `iters` SENDs of `size` bytes one at a time, checking each echo.
struct Pinger {
    iters: u64,
    size: usize,
    seq: u64,
    bad: u64,
    failure: Option<String>,
}

impl Pinger {
    fn ping(&mut self, ctx: &mut Ctx<'_>, conn: ConnId) {
        let (seq, size) = (self.seq, self.size);
        if let Err(err) = ctx.send_with(conn, size, Some(seq as u32), |buf| fill(buf, seq)) {
            self.failure.get_or_insert(format!("ping {seq}: {err}"));
        }
    }
}

impl Handler for Pinger {
    fn on_established(&mut self, ctx: &mut Ctx<'_>, conn: ConnId) {
        self.ping(ctx, conn);
    }

    fn on_message(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, data: &[u8], imm: Option<u32>) {
        if imm != Some(self.seq as u32) || data.len() != self.size || !matches(data, self.seq) {
            self.bad += 1;
        }
        self.seq += 1;
        if self.seq < self.iters {
            self.ping(ctx, conn);
        }
    }

    fn on_error(&mut self, _ctx: &mut Ctx<'_>, _conn: ConnId, error: &Error) {
        self.failure.get_or_insert(error.to_string());
    }

    fn on_peer_gone(&mut self, _ctx: &mut Ctx<'_>, _session: SessionId, status: &PeerStatus) {
        self.failure
            .get_or_insert(format!("server gone: {status:?}"));
    }
}

/// Round trips a ping client verified, or why it failed.
pub type ClientResult = Result<u64, String>;

/// Connects to `addr` as `identity` and pings `iters` times; then keeps the
/// session open (idle) for `linger`, and hangs up.
pub fn ping_client(
    addr: SocketAddr,
    identity: &str,
    iters: u64,
    linger: Duration,
) -> JoinHandle<ClientResult> {
    let identity = identity.to_string();
    std::thread::spawn(move || {
        let ctx = super::open_device();
        let pd = ctx.alloc_pd().map_err(|e| e.to_string())?;
        // Clients wake every 50 ms to see the deadline (their syscalls are
        // not the runtime's).
        let config = ReactorConfig {
            idle_timeout: Duration::from_millis(50),
            ..blocking(1)
        };
        let mut reactor: Reactor<Pinger> = Reactor::new(&pd, config).map_err(|e| e.to_string())?;
        let spec = reactor.qp_spec("rpc");
        let config = ClientConfig::new(vec![spec]).with_identity(identity.clone());
        let endpoint =
            ClientSession::connect(addr, &pd, &config).map_err(|e| format!("{identity}: {e}"))?;
        let pinger = Pinger {
            iters,
            size: 100,
            seq: 0,
            bad: 0,
            failure: None,
        };
        let session = reactor.add(endpoint, pinger).map_err(|e| e.to_string())?;
        let started = Instant::now();
        loop {
            let pinger = reactor.handler(session).expect("the session");
            if let Some(failure) = &pinger.failure {
                return Err(format!("{identity}: {failure}"));
            }
            if pinger.seq >= iters {
                break;
            }
            if started.elapsed() > DEADLINE {
                return Err(format!("{identity}: {} of {iters} round trips", pinger.seq));
            }
            reactor.turn().map_err(|e| e.to_string())?;
        }
        std::thread::sleep(linger);
        let (mut link, pinger) = reactor.remove(session).expect("the session");
        link.close();
        match pinger.bad {
            0 => Ok(pinger.seq),
            bad => Err(format!("{identity}: {bad} echoes did not match")),
        }
    })
}

/// Waits until `ready` holds, failing the test at the deadline.
#[track_caller]
pub fn wait_until(what: &str, mut ready: impl FnMut() -> bool) {
    let started = Instant::now();
    while !ready() {
        assert!(started.elapsed() < DEADLINE, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}
