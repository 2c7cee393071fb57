//! Both ends of a connection on one reactor over the in-process loopback
//! device ([`Context::loopback`]): what `benches/loopback.rs`, the
//! `loopback_path` program (`tools/instr-count --host`) and the host tests
//! of the reactor set up, so the reactor's own path runs with no NIC.

use rdma_comm_core::Result;
use rdma_comm_core::reactor::{NoLink, Reactor, ReactorConfig, SessionId};
use rdma_comm_core::verbs::{AccessFlags, Context, ProtectionDomain, Registration};

use crate::{PerfBuffers, PerfHandler};

/// A reactor on a new loopback device holding a client and a server
/// session of one connection, built by [`perf_pair`].
#[derive(Debug)]
pub struct PerfPair {
    /// The reactor; [`Reactor::run`] it.
    pub reactor: Reactor<PerfHandler, NoLink>,
    /// The client's session.
    pub client: SessionId,
    /// Both exported buffers, registered until this is dropped even if a
    /// role drops its buffer (the sink does; a real server keeps its
    /// exports in its session).
    pub exports: [Registration; 2],
}

/// Opens a loopback device and a reactor on it (`signal_interval`,
/// 256-byte slots), gives each side a `2 × size` buffer exported to the
/// other, and adds the roles `client` and `server` build from them.
pub fn perf_pair(
    signal_interval: u32,
    size: usize,
    client: impl FnOnce(PerfBuffers) -> PerfHandler,
    server: impl FnOnce(PerfBuffers) -> PerfHandler,
) -> Result<PerfPair> {
    pair_on_loopback(signal_interval, size, client, server, false)
}

/// As [`perf_pair`], with both sessions added as direct connections
/// ([`Reactor::add_direct`]) for the direct roles.
pub fn direct_perf_pair(
    size: usize,
    client: impl FnOnce(PerfBuffers) -> PerfHandler,
    server: impl FnOnce(PerfBuffers) -> PerfHandler,
) -> Result<PerfPair> {
    pair_on_loopback(1, size, client, server, true)
}

fn pair_on_loopback(
    signal_interval: u32,
    size: usize,
    client: impl FnOnce(PerfBuffers) -> PerfHandler,
    server: impl FnOnce(PerfBuffers) -> PerfHandler,
    direct: bool,
) -> Result<PerfPair> {
    // SAFETY: the reactor built here serves both QPs of this device on the
    // one thread that runs it, and nothing else touches their bytes.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd()?;
    perf_pair_on(&pd, signal_interval, size, client, server, direct)
}

/// As [`perf_pair`] (or [`direct_perf_pair`] if `direct`) on `pd`'s
/// device, any device: both ends on one reactor, connected to each other.
pub fn perf_pair_on(
    pd: &ProtectionDomain,
    signal_interval: u32,
    size: usize,
    client: impl FnOnce(PerfBuffers) -> PerfHandler,
    server: impl FnOnce(PerfBuffers) -> PerfHandler,
    direct: bool,
) -> Result<PerfPair> {
    // Both ends are QPs of this process (no link to watch): no peer watch,
    // whose clock-paced checks would make a count depend on the run's speed.
    let config = ReactorConfig {
        signal_interval,
        slot_size: 256,
        peer_check_interval: None,
        ..ReactorConfig::default()
    };
    let mut reactor: Reactor<PerfHandler, NoLink> = Reactor::new(pd, config)?;
    let access = AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
    let (client_qp, server_qp) = reactor.connected_pair(pd, access)?;
    let buffer = || pd.alloc_mr(2 * size, AccessFlags::LOCAL_WRITE | access);
    let (client_buf, server_buf) = (buffer()?, buffer()?);
    let (to_server, to_client) = (server_buf.remote()?, client_buf.remote()?);
    let exports = [
        client_buf.registration().clone(),
        server_buf.registration().clone(),
    ];
    let server = server(PerfBuffers {
        buffer: server_buf,
        peer: to_client,
    });
    let client = client(PerfBuffers {
        buffer: client_buf,
        peer: to_server,
    });
    let client = if direct {
        reactor.add_direct(vec![server_qp], server)?;
        reactor.add_direct(vec![client_qp], client)?
    } else {
        reactor.add(vec![server_qp], server)?;
        reactor.add(vec![client_qp], client)?
    };
    Ok(PerfPair {
        reactor,
        client,
        exports,
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{direct_perf_pair, perf_pair};
    use crate::{
        DirectClient, DirectServer, LatencyClient, PerfHandler, PerfOp, PerfSpec, RateSender,
        RateSink, Reflector,
    };

    /// A spec of no iterations at all, warmup included.
    fn no_iterations(op: PerfOp, batch: usize) -> PerfSpec {
        PerfSpec {
            op,
            size: 8,
            iters: 0,
            warmup: 0,
            batch,
            tx_depth: 0,
        }
    }

    /// Every client asked for 0 iterations runs one and stops its reactor
    /// (a latency client counted to `warmup + iters` and never met 0).
    #[test]
    fn every_client_asked_for_no_iterations_ends() {
        type Build = fn(PerfSpec) -> super::Result<super::PerfPair>;
        let cases: [(&str, PerfOp, Build); 7] = [
            ("protocol send latency", PerfOp::Send, |spec| {
                perf_pair(
                    1,
                    8,
                    |b| PerfHandler::Latency(LatencyClient::new(spec, b)),
                    |b| PerfHandler::Reflect(Reflector::new(spec, b)),
                )
            }),
            ("protocol read latency", PerfOp::Read, |spec| {
                perf_pair(
                    1,
                    8,
                    |b| PerfHandler::Latency(LatencyClient::new(spec, b)),
                    |b| PerfHandler::Reflect(Reflector::new(spec, b)),
                )
            }),
            ("protocol send rate", PerfOp::Send, |spec| {
                perf_pair(
                    16,
                    8,
                    |b| PerfHandler::Rate(RateSender::new(spec, b)),
                    |_| PerfHandler::Sink(RateSink::default()),
                )
            }),
            ("direct send latency", PerfOp::Send, |spec| {
                direct_perf_pair(
                    8,
                    |b| PerfHandler::DirectClient(DirectClient::latency(spec, b)),
                    |b| PerfHandler::DirectServer(DirectServer::new(spec, b, false)),
                )
            }),
            ("direct read latency", PerfOp::Read, |spec| {
                direct_perf_pair(
                    8,
                    |b| PerfHandler::DirectClient(DirectClient::latency(spec, b)),
                    |b| PerfHandler::DirectServer(DirectServer::new(spec, b, false)),
                )
            }),
            ("spinning read latency", PerfOp::Read, |spec| {
                direct_perf_pair(
                    8,
                    |b| PerfHandler::DirectClient(DirectClient::latency(spec, b).spinning()),
                    |b| PerfHandler::DirectServer(DirectServer::new(spec, b, false)),
                )
            }),
            ("direct write rate", PerfOp::Write, |spec| {
                direct_perf_pair(
                    8,
                    |b| PerfHandler::DirectClient(DirectClient::bandwidth(spec, b)),
                    |b| PerfHandler::DirectServer(DirectServer::new(spec, b, true)),
                )
            }),
        ];
        for (name, op, build) in cases {
            let batch = if name.ends_with("rate") { 16 } else { 1 };
            let mut pair = build(no_iterations(op, batch)).expect("a loopback pair");
            let ended = pair
                .reactor
                .run_for(Duration::from_secs(10))
                .expect("passes");
            assert_eq!(
                ended,
                rdma_comm_core::reactor::Ended::Stopped,
                "{name}: a client of 0 iterations never ended"
            );
        }
    }
}
