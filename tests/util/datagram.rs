//! A datagram ping-pong between two endpoints of one reactor, for the
//! proofs that the datagram path allocates nothing and makes no syscalls
//! of its own: the handlers allocate nothing after construction.
#![allow(dead_code)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use rdma_comm_core::Error;
use rdma_comm_core::reactor::*;
use rdma_comm_core::verbs::*;

/// Idle passes a pinger waits for the echo of its ping before it sends
/// the ping again (a datagram may be dropped).
const RESEND_AFTER: u32 = 200_000;

/// What the pair did (atomics: no locks, no allocation).
#[derive(Default, Debug)]
pub struct DatagramOutcome {
    /// Round trips the pinger stops the reactor at.
    pub limit: AtomicU64,
    pub done: AtomicU64,
    /// Echoes whose bytes were not the ping's.
    pub bad: AtomicU64,
    pub resent: AtomicU64,
    pub errors: AtomicU64,
}

pub struct Pinger {
    dgram: Option<DatagramId>,
    to: Option<UdDestination>,
    outcome: Arc<DatagramOutcome>,
    waiting: bool,
    idle_passes: u32,
    payload: [u8; 32],
}

impl Pinger {
    fn ping(&mut self, ctx: &mut Ctx<'_>) {
        let (Some(dgram), Some(to)) = (self.dgram, self.to.as_ref()) else {
            return;
        };
        let seq = self.outcome.done.load(Ordering::Relaxed);
        self.payload[..8].copy_from_slice(&seq.to_le_bytes());
        if ctx.send_datagram(dgram, to, &self.payload).is_ok() {
            self.waiting = true;
            self.idle_passes = 0;
        }
    }
}

impl Handler for Pinger {
    fn on_message(&mut self, _: &mut Ctx<'_>, _: ConnId, _: &[u8], _: Option<u32>) {}

    fn on_datagram(
        &mut self,
        ctx: &mut Ctx<'_>,
        _: DatagramId,
        _: &DatagramSource<'_>,
        data: &[u8],
    ) {
        let seq = self.outcome.done.load(Ordering::Relaxed);
        if data.len() != self.payload.len() || data[..8] != seq.to_le_bytes() {
            // A late echo of a resent ping: not this round's.
            self.outcome.bad.fetch_add(1, Ordering::Relaxed);
            return;
        }
        self.waiting = false;
        let done = seq + 1;
        self.outcome.done.store(done, Ordering::Relaxed);
        if done >= self.outcome.limit.load(Ordering::Relaxed) {
            ctx.stop();
            return;
        }
        self.ping(ctx);
    }

    fn on_datagram_error(&mut self, _: &mut Ctx<'_>, _: DatagramId, _: &Error) {
        self.outcome.errors.fetch_add(1, Ordering::Relaxed);
    }

    fn on_idle(&mut self, ctx: &mut Ctx<'_>) -> Idle {
        if self.outcome.done.load(Ordering::Relaxed) >= self.outcome.limit.load(Ordering::Relaxed) {
            return Idle::Again;
        }
        if !self.waiting {
            self.ping(ctx);
        } else {
            self.idle_passes += 1;
            if self.idle_passes >= RESEND_AFTER {
                self.outcome.resent.fetch_add(1, Ordering::Relaxed);
                self.ping(ctx);
            }
        }
        Idle::Again
    }
}

pub struct Echo {
    to: Option<UdDestination>,
    outcome: Arc<DatagramOutcome>,
}

impl Handler for Echo {
    fn on_message(&mut self, _: &mut Ctx<'_>, _: ConnId, _: &[u8], _: Option<u32>) {}

    fn on_datagram(
        &mut self,
        ctx: &mut Ctx<'_>,
        dgram: DatagramId,
        _: &DatagramSource<'_>,
        data: &[u8],
    ) {
        if let Some(to) = self.to.as_ref()
            && ctx.send_datagram(dgram, to, data).is_err()
        {
            self.outcome.errors.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn on_datagram_error(&mut self, _: &mut Ctx<'_>, _: DatagramId, _: &Error) {
        self.outcome.errors.fetch_add(1, Ordering::Relaxed);
    }
}

/// One end of the pair.
pub enum DatagramPeer {
    Pinger(Pinger),
    Echo(Echo),
}

impl Handler for DatagramPeer {
    fn on_message(&mut self, _: &mut Ctx<'_>, _: ConnId, _: &[u8], _: Option<u32>) {}

    fn on_datagram(
        &mut self,
        ctx: &mut Ctx<'_>,
        dgram: DatagramId,
        source: &DatagramSource<'_>,
        data: &[u8],
    ) {
        match self {
            Self::Pinger(pinger) => pinger.on_datagram(ctx, dgram, source, data),
            Self::Echo(echo) => echo.on_datagram(ctx, dgram, source, data),
        }
    }

    fn on_datagram_error(&mut self, ctx: &mut Ctx<'_>, dgram: DatagramId, error: &Error) {
        match self {
            Self::Pinger(pinger) => pinger.on_datagram_error(ctx, dgram, error),
            Self::Echo(echo) => echo.on_datagram_error(ctx, dgram, error),
        }
    }

    fn on_idle(&mut self, ctx: &mut Ctx<'_>) -> Idle {
        match self {
            Self::Pinger(pinger) => pinger.on_idle(ctx),
            Self::Echo(_) => Idle::Done,
        }
    }
}

/// Adds a pinger and an echo endpoint to `reactor`; the pinger stops the
/// reactor after `limit` round trips of 32-byte datagrams.
pub fn add_datagram_ping_pong(
    reactor: &mut Reactor<DatagramPeer>,
    limit: u64,
) -> Arc<DatagramOutcome> {
    let outcome = Arc::new(DatagramOutcome::default());
    outcome.limit.store(limit, Ordering::Relaxed);
    let config = UdConfig::default();
    let pinger = Pinger {
        dgram: None,
        to: None,
        outcome: Arc::clone(&outcome),
        waiting: false,
        idle_passes: 0,
        payload: [0x5a; 32],
    };
    let echo = Echo {
        to: None,
        outcome: Arc::clone(&outcome),
    };
    let a = reactor
        .add_datagram(&config, |_, _| Ok(DatagramPeer::Pinger(pinger)))
        .expect("the pinger's endpoint");
    let b = reactor
        .add_datagram(&config, |_, _| Ok(DatagramPeer::Echo(echo)))
        .expect("the echo's endpoint");
    let (qp_a, qp_b) = (
        reactor.datagram_qp(a).unwrap(),
        reactor.datagram_qp(b).unwrap(),
    );
    let to_b = qp_a.destination(&qp_b.endpoint()).expect("to the echo");
    let to_a = qp_b.destination(&qp_a.endpoint()).expect("to the pinger");
    if let Some(DatagramPeer::Pinger(pinger)) = reactor.datagram_handler_mut(a) {
        pinger.dgram = Some(a);
        pinger.to = Some(to_b);
    }
    if let Some(DatagramPeer::Echo(echo)) = reactor.datagram_handler_mut(b) {
        echo.to = Some(to_a);
    }
    outcome
}
