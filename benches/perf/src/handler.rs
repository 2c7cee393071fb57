//! One handler type for all the roles, dispatched statically.

use std::fmt;

use rdma_comm_core::error::Error;
use rdma_comm_core::reactor::{ConnId, Ctx, DatagramId, DatagramSource, Handler, Idle, SessionId};
use rdma_comm_core::session::PeerStatus;

use rdma_comm_core::verbs::WorkCompletion;

use crate::{
    DirectClient, DirectServer, LatencyClient, RateSender, RateSink, Reflector, UdClient,
    UdExchange, UdServer,
};

/// Any of the measurement roles, so one reactor type serves them all.
#[allow(missing_docs, clippy::large_enum_variant)]
pub enum PerfHandler {
    Latency(LatencyClient),
    Reflect(Reflector),
    Rate(RateSender),
    Sink(RateSink),
    DirectClient(DirectClient),
    DirectServer(DirectServer),
    UdExchange(UdExchange),
    UdClient(UdClient),
    UdServer(UdServer),
}

impl fmt::Debug for PerfHandler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PerfHandler::Latency(_) => "PerfHandler::Latency",
            PerfHandler::Reflect(_) => "PerfHandler::Reflect",
            PerfHandler::Rate(_) => "PerfHandler::Rate",
            PerfHandler::Sink(_) => "PerfHandler::Sink",
            PerfHandler::DirectClient(_) => "PerfHandler::DirectClient",
            PerfHandler::DirectServer(_) => "PerfHandler::DirectServer",
            PerfHandler::UdExchange(_) => "PerfHandler::UdExchange",
            PerfHandler::UdClient(_) => "PerfHandler::UdClient",
            PerfHandler::UdServer(_) => "PerfHandler::UdServer",
        })
    }
}

/// Calls the same method on whichever role is inside, statically: a dyn call
/// per callback would add an indirect branch to every reactor pass.
macro_rules! each_role {
    ($self:ident, $h:ident => $call:expr) => {
        match $self {
            PerfHandler::Latency($h) => $call,
            PerfHandler::Reflect($h) => $call,
            PerfHandler::Rate($h) => $call,
            PerfHandler::Sink($h) => $call,
            PerfHandler::DirectClient($h) => $call,
            PerfHandler::DirectServer($h) => $call,
            PerfHandler::UdExchange($h) => $call,
            PerfHandler::UdClient($h) => $call,
            PerfHandler::UdServer($h) => $call,
        }
    };
}

impl PerfHandler {
    /// The error that ended the run early, if any.
    pub fn failure(&self) -> Option<&str> {
        each_role!(self, h => h.failure())
    }
}

impl Handler for PerfHandler {
    fn on_established(&mut self, ctx: &mut Ctx<'_>, conn: ConnId) {
        each_role!(self, h => h.on_established(ctx, conn))
    }
    fn on_message(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, data: &[u8], imm: Option<u32>) {
        each_role!(self, h => h.on_message(ctx, conn, data, imm))
    }
    fn on_writable(&mut self, ctx: &mut Ctx<'_>, conn: ConnId) {
        each_role!(self, h => h.on_writable(ctx, conn))
    }
    fn on_write_imm(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, imm: u32, len: u32) {
        each_role!(self, h => h.on_write_imm(ctx, conn, imm, len))
    }
    fn on_send_complete(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, seq: u32) {
        each_role!(self, h => h.on_send_complete(ctx, conn, seq))
    }
    fn on_write_complete(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, seq: u32) {
        each_role!(self, h => h.on_write_complete(ctx, conn, seq))
    }
    fn on_read_complete(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, seq: u32) {
        each_role!(self, h => h.on_read_complete(ctx, conn, seq))
    }
    fn on_sends_complete(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, first: u32, count: u32) {
        each_role!(self, h => h.on_sends_complete(ctx, conn, first, count))
    }
    fn on_writes_complete(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, first: u32, count: u32) {
        each_role!(self, h => h.on_writes_complete(ctx, conn, first, count))
    }
    fn on_reads_complete(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, first: u32, count: u32) {
        each_role!(self, h => h.on_reads_complete(ctx, conn, first, count))
    }
    fn on_error(&mut self, ctx: &mut Ctx<'_>, conn: ConnId, error: &Error) {
        each_role!(self, h => h.on_error(ctx, conn, error))
    }
    fn on_direct_completion(
        &mut self,
        ctx: &mut Ctx<'_>,
        conn: ConnId,
        id: u32,
        completion: &WorkCompletion,
    ) {
        each_role!(self, h => h.on_direct_completion(ctx, conn, id, completion))
    }
    fn on_idle(&mut self, ctx: &mut Ctx<'_>) -> Idle {
        each_role!(self, h => h.on_idle(ctx))
    }
    fn on_datagram(
        &mut self,
        ctx: &mut Ctx<'_>,
        dgram: DatagramId,
        source: &DatagramSource<'_>,
        data: &[u8],
    ) {
        each_role!(self, h => h.on_datagram(ctx, dgram, source, data))
    }
    fn on_datagram_error(&mut self, ctx: &mut Ctx<'_>, dgram: DatagramId, error: &Error) {
        each_role!(self, h => h.on_datagram_error(ctx, dgram, error))
    }
    /// A peer that leaves before the run ended fails it (the reactor's peer
    /// watch only runs while the run does). One that leaves after is
    /// expected: the peer check of the very pass that ended the run may
    /// already see it go.
    fn on_peer_gone(&mut self, ctx: &mut Ctx<'_>, _session: SessionId, status: &PeerStatus) {
        if each_role!(self, h => h.is_done()) {
            return;
        }
        let why = match status {
            PeerStatus::Alive => return,
            PeerStatus::Disconnected { code } => {
                format!("the peer hung up (code {code}) before the run ended")
            }
            PeerStatus::Lost(err) => format!("lost the peer: {err}"),
        };
        each_role!(self, h => {
            h.failed.get_or_insert(why);
        });
        ctx.stop();
    }
}
