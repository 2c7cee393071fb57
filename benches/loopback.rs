//! The reactor's per-message path (staging, doorbell bookkeeping,
//! completion dispatch) measured over the in-process software device
//! ([`Context::loopback`]), so it runs on any machine, with no RDMA NIC:
//! one reactor holds both ends of a connection, whose QPs are loopback QPs
//! created on the reactor's CQs ([`Reactor::qp_spec`]) and handed to it
//! directly (a `Vec<QueuePair>` [`QpSource`](rdma_comm_core::reactor::QpSource)).
//!
//! What the figures include besides the reactor: the loopback device's
//! own work per request (a few uncontended mutexes, a key lookup and a
//! `memcpy`, where a NIC would charge a doorbell and DMA). They say how
//! much the runtime costs per message on this CPU, not what a network
//! does. Prints figures (criterion's per-message time); asserts nothing
//! timed.
//!
//! ```sh
//! cargo bench --bench loopback -- --warm-up-time 1 --measurement-time 3
//! ```

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use rdma_comm_core::reactor::*;
use rdma_comm_core::verbs::*;
use rdma_perf::loopback::{direct_perf_pair, perf_pair};
use rdma_perf::*;

/// One reactor holding both ends of a loopback connection; returns it with
/// the client's session id and the registrations of both exported buffers
/// (see [`perf_pair`]).
fn pair(
    signal_interval: u32,
    size: usize,
    client: impl FnOnce(PerfBuffers) -> PerfHandler,
    server: impl FnOnce(PerfBuffers) -> PerfHandler,
) -> (Reactor<PerfHandler, ()>, SessionId, [Registration; 2]) {
    let pair = perf_pair(signal_interval, size, client, server)
        .expect("a reactor with both ends on the loopback device");
    (pair.reactor, pair.client, pair.exports)
}

/// One message at a time: `iters` (at least 1) round trips of `size`
/// bytes after `warmup` untimed ones.
fn round_trip_spec(op: PerfOp, size: usize, iters: u64, warmup: u64) -> PerfSpec {
    PerfSpec {
        op,
        size,
        iters: iters.max(1),
        warmup,
        batch: 1,
        tx_depth: 0,
    }
}

/// Round trips: 8 B SEND ping-pong, 8 B READ. Per iteration: one round trip.
fn round_trips(c: &mut Criterion) {
    const SIZE: usize = 8;
    let mut group = c.benchmark_group("loopback_round_trip_8B");
    group.sample_size(10);
    for op in [PerfOp::Send, PerfOp::Read] {
        group.bench_function(BenchmarkId::from_parameter(op), |b| {
            b.iter_custom(|iters| {
                let spec = round_trip_spec(op, SIZE, iters, 50);
                let (mut reactor, session, _exports) = pair(
                    1,
                    SIZE,
                    |buffers| PerfHandler::Latency(LatencyClient::new(spec, buffers)),
                    |buffers| PerfHandler::Reflect(Reflector::new(spec, buffers)),
                );
                reactor.run().expect("reactor run");
                let Some(PerfHandler::Latency(client)) = reactor.handler(session) else {
                    unreachable!("the client session holds the latency client")
                };
                if let Some(failure) = client.failure() {
                    panic!("{op} round trips failed: {failure}");
                }
                // SEND samples are half round trips; READ samples whole ones.
                let factor = if op == PerfOp::Read { 1 } else { 2 };
                Duration::from_nanos(client.latencies_ns().iter().map(|ns| factor * ns).sum())
            });
        });
    }
    group.finish();
}

/// Round trips on direct connections (`Reactor::add_direct`: the handler
/// posts requests built once, the reactor polls and routes, in its lean
/// pass): 8 B SEND ping-pong, WRITE ping-pong (the answer noticed in
/// memory) and READ, and READ from the client's spin (`Ctx::spin`: its
/// loop polls the CQs the reactor lends it). Per iteration: one round
/// trip, timed over the whole run.
fn direct_round_trips(c: &mut Criterion) {
    const SIZE: usize = 8;
    let mut group = c.benchmark_group("loopback_direct_round_trip_8B");
    group.sample_size(10);
    for (op, spin) in [
        (PerfOp::Send, false),
        (PerfOp::Write, false),
        (PerfOp::Read, false),
        (PerfOp::Read, true),
    ] {
        let id = if spin {
            format!("{op}-spin")
        } else {
            op.to_string()
        };
        group.bench_function(BenchmarkId::from_parameter(id), |b| {
            b.iter_custom(|iters| {
                let spec = round_trip_spec(op, SIZE, iters, 0);
                let mut pair = direct_perf_pair(
                    SIZE,
                    |buffers| {
                        let client = DirectClient::latency(spec, buffers);
                        PerfHandler::DirectClient(if spin { client.spinning() } else { client })
                    },
                    |buffers| PerfHandler::DirectServer(DirectServer::new(spec, buffers, false)),
                )
                .expect("a reactor with both direct ends on the loopback device");
                let started = Instant::now();
                pair.reactor.run().expect("reactor run");
                let elapsed = started.elapsed();
                let Some(PerfHandler::DirectClient(client)) = pair.reactor.handler(pair.client)
                else {
                    unreachable!("the client session holds the direct client")
                };
                if let Some(failure) = client.failure() {
                    panic!("direct {op} round trips failed: {failure}");
                }
                elapsed
            });
        });
    }
    group.finish();
}

/// Streaming: 64 B SEND and WRITE at 1 and 16 requests per doorbell. Per
/// iteration: one message.
fn streaming(c: &mut Criterion) {
    const SIZE: usize = 64;
    let mut group = c.benchmark_group("loopback_stream_64B");
    group.sample_size(10).throughput(Throughput::Elements(1));
    for op in [PerfOp::Send, PerfOp::Write] {
        for batch in [1, 16] {
            let id = BenchmarkId::new(op.to_string(), format!("batch{batch}"));
            group.bench_function(id, |b| {
                b.iter_custom(|iters| {
                    let spec = PerfSpec {
                        op,
                        size: SIZE,
                        iters: iters.max(1),
                        warmup: 0,
                        batch,
                        tx_depth: 0,
                    };
                    let (mut reactor, session, _exports) = pair(
                        16,
                        SIZE,
                        |buffers| PerfHandler::Rate(RateSender::new(spec, buffers)),
                        |_| PerfHandler::Sink(RateSink::default()),
                    );
                    reactor.run().expect("reactor run");
                    let Some(PerfHandler::Rate(sender)) = reactor.handler(session) else {
                        unreachable!("the client session holds the rate sender")
                    };
                    if let Some(failure) = sender.failure() {
                        panic!("{op} streaming failed: {failure}");
                    }
                    let stats = black_box(sender.stats());
                    Duration::from_secs_f64(stats.iters as f64 / (stats.msg_rate_mpps * 1e6))
                });
            });
        }
    }
    group.finish();
}

criterion_group!(benches, round_trips, direct_round_trips, streaming);
criterion_main!(benches);
