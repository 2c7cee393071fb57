//! 64 B SENDs spread over many connections of one reactor on the loopback
//! device: how the reactor's work per message grows with the connections
//! it serves, counted where nothing depends on timing (`spread_path
//! MESSAGES CONNS`, which `tools/instr-count --host` runs at 1 and at 1024
//! connections).
//!
//! Each connection is a session of its own on both ends, as `conn_scale`
//! connects them: a sender streams its share of the messages, at most
//! [`BATCH`] per doorbell, and all senders together keep at most
//! [`IN_FLIGHT`] SENDs in flight, so the offered load is the same at every
//! count and only how many connections carry it changes. A sink counts
//! what arrives; the last sender to see all of its SENDs complete stops
//! the reactor.

use std::cell::Cell;
use std::rc::Rc;

use rdma_comm_core::Result;
use rdma_comm_core::reactor::{
    ConnId, Ctx, Handler, Idle, NoLink, Reactor, ReactorConfig, SendError,
};
use rdma_comm_core::verbs::{AccessFlags, ProtectionDomain};

/// Bytes per SEND.
pub const SPREAD_SIZE: usize = 64;
/// Most SENDs per doorbell per connection.
pub const BATCH: usize = 16;
/// Most SENDs in flight over all connections together.
pub const IN_FLIGHT: u64 = 64;

/// What the senders of one run share: one reactor thread, so plain cells.
#[derive(Debug)]
struct Shared {
    /// The senders of the run: the reactor stops when all have finished.
    senders: usize,
    in_flight: Cell<u64>,
    finished: Cell<usize>,
    failure: Cell<Option<&'static str>>,
}

/// A handler of a spread run: a sender's end of a connection, or a sink's.
#[derive(Debug)]
pub enum Spread {
    /// Streams its share of the messages on its one connection.
    Sender(SpreadSender),
    /// Counts what arrives on its one connection.
    Sink,
}

/// Streams its share of a spread run's SENDs on its one connection.
#[derive(Debug)]
pub struct SpreadSender {
    shared: Rc<Shared>,
    conn: Option<ConnId>,
    quota: u64,
    sent: u64,
    completed: u64,
}

impl SpreadSender {
    fn pump(&mut self, ctx: &mut Ctx<'_>) {
        let Some(conn) = self.conn else { return };
        let shared = &self.shared;
        let before = self.sent;
        while self.sent < self.quota
            && ctx.staged(conn) < BATCH
            && shared.in_flight.get() < IN_FLIGHT
        {
            match ctx.send_with(conn, SPREAD_SIZE, None, |_| {}) {
                Ok(_) => {
                    self.sent += 1;
                    shared.in_flight.set(shared.in_flight.get() + 1);
                }
                Err(SendError::WouldBlock) => break,
                Err(_) => {
                    shared.failure.set(Some("a SEND was refused"));
                    ctx.stop();
                    return;
                }
            }
        }
        // A connection's burst may be shorter than the signaling interval
        // when the cap is spread over many: its end is signaled, or its
        // requests would report only once the reactor signals out idle
        // tails.
        if self.sent > before {
            ctx.signal_staged(conn);
        }
    }
}

impl Handler for Spread {
    fn on_message(&mut self, _: &mut Ctx<'_>, _: ConnId, _: &[u8], _: Option<u32>) {}

    fn on_established(&mut self, ctx: &mut Ctx<'_>, conn: ConnId) {
        if let Spread::Sender(sender) = self {
            sender.conn = Some(conn);
            sender.pump(ctx);
        }
    }

    fn on_sends_complete(&mut self, ctx: &mut Ctx<'_>, _: ConnId, _: u32, count: u32) {
        let Spread::Sender(sender) = self else { return };
        let shared = &sender.shared;
        sender.completed += u64::from(count);
        shared
            .in_flight
            .set(shared.in_flight.get() - u64::from(count));
        if sender.completed < sender.quota {
            return sender.pump(ctx);
        }
        if sender.completed == sender.quota {
            let finished = shared.finished.get() + 1;
            shared.finished.set(finished);
            if finished == shared.senders {
                ctx.stop();
            }
        }
    }

    fn on_error(&mut self, ctx: &mut Ctx<'_>, _: ConnId, _: &rdma_comm_core::Error) {
        if let Spread::Sender(sender) = self {
            sender.shared.failure.set(Some("a connection failed"));
        }
        ctx.stop();
    }

    fn on_writable(&mut self, ctx: &mut Ctx<'_>, _: ConnId) {
        if let Spread::Sender(sender) = self {
            sender.pump(ctx);
        }
    }

    /// The shared in-flight cap gives room back with no callback of this
    /// sender's own: it looks again while it has messages to send.
    fn on_idle(&mut self, ctx: &mut Ctx<'_>) -> Idle {
        let Spread::Sender(sender) = self else {
            return Idle::Done;
        };
        sender.pump(ctx);
        if sender.sent < sender.quota {
            Idle::Again
        } else {
            Idle::Done
        }
    }
}

/// A reactor holding `conns` connections on `pd`'s device, both ends,
/// each a session of its own, ready to stream `messages` SENDs spread
/// evenly over them ([`Reactor::run`] it, then ask
/// [`SpreadRun::failure`]).
#[derive(Debug)]
pub struct SpreadRun {
    /// The reactor; [`Reactor::run`] it.
    pub reactor: Reactor<Spread, NoLink>,
    shared: Rc<Shared>,
}

impl SpreadRun {
    /// Connects `conns` (at least 1) pairs on `pd`'s device for `messages`
    /// (at least 1 per connection).
    pub fn new(pd: &ProtectionDomain, conns: u32, messages: u64) -> Result<Self> {
        let conns = conns.max(1);
        let config = ReactorConfig {
            signal_interval: 16,
            // Both ends' QPs are this process's: no link to watch, and no
            // clock-paced checks in a count.
            peer_check_interval: None,
            reserve_connections: 2 * conns,
            ..ReactorConfig::for_traffic(SPREAD_SIZE, 16, 2 * conns)
        };
        let mut reactor = Reactor::new(pd, config)?;
        let shared = Rc::new(Shared {
            senders: conns as usize,
            in_flight: Cell::new(0),
            finished: Cell::new(0),
            failure: Cell::new(None),
        });
        let quota = messages.div_ceil(u64::from(conns)).max(1);
        for _ in 0..conns {
            let (sender_qp, sink_qp) = reactor.connected_pair(pd, AccessFlags::empty())?;
            reactor.add(vec![sink_qp], Spread::Sink)?;
            let sender = SpreadSender {
                shared: Rc::clone(&shared),
                conn: None,
                quota,
                sent: 0,
                completed: 0,
            };
            reactor.add(vec![sender_qp], Spread::Sender(sender))?;
        }
        Ok(Self { reactor, shared })
    }

    /// Why the run ended early, if it did.
    pub fn failure(&self) -> Option<&'static str> {
        self.shared.failure.get()
    }

    /// Senders that saw all of their SENDs complete.
    pub fn finished(&self) -> usize {
        self.shared.finished.get()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use rdma_comm_core::reactor::Ended;
    use rdma_comm_core::verbs::Context;

    use super::*;

    /// A run over one connection and over a hundred ends with every
    /// sender's SENDs complete, and each one's share the same.
    #[test]
    fn a_spread_run_completes_on_every_connection() {
        for conns in [1, 100] {
            // SAFETY: the reactor built here serves every QP of this
            // device on this one thread.
            let ctx = unsafe { Context::loopback() };
            let pd = ctx.alloc_pd().expect("a PD");
            let mut run = SpreadRun::new(&pd, conns, 2_000).expect("connected");
            let ended = run
                .reactor
                .run_for(Duration::from_secs(60))
                .expect("passes");
            assert_eq!(ended, Ended::Stopped, "{conns} connections");
            assert_eq!(run.failure(), None);
            assert_eq!(run.finished(), conns as usize);
            let messages = run.reactor.counters().messages;
            let quota = 2_000u64.div_ceil(u64::from(conns));
            assert!(messages >= quota * u64::from(conns), "{messages}");
        }
    }
}
