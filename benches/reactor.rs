//! Round-trip latency and small-message rate through the reactor: one QP pair
//! on one reactor, one core (both ends share the reactor's CQ). Parameters:
//! signaling interval and doorbell batch size. Prints figures; asserts nothing.
//!
//! Needs an RDMA device: `tools/bench reactor` runs it in the Soft-RoCE guest.
//! `tools/compare-perftest` sets the same figures against perftest.

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use rdma_comm_core::reactor::*;
use rdma_comm_core::session::*;
use rdma_comm_core::verbs::*;
use rdma_perf::*;

const SIZE: usize = 64;

fn open() -> (Context, ProtectionDomain) {
    let ctx = Context::open_default(std::env::var("RDMA_TEST_DEVICE").ok().as_deref())
        .unwrap_or_else(|err| {
            panic!("this benchmark needs an RDMA device ({err}); run it with tools/bench")
        });
    let pd = ctx.alloc_pd().expect("alloc_pd");
    (ctx, pd)
}

/// One reactor holding both ends of a connection; returns it with the
/// client's and server's session ids.
fn pair(
    pd: &ProtectionDomain,
    signal_interval: u32,
    client: impl FnOnce(PerfBuffers) -> PerfHandler,
    server: impl FnOnce(PerfBuffers) -> PerfHandler,
) -> (Reactor<PerfHandler>, SessionId) {
    let config = ReactorConfig {
        signal_interval,
        slot_size: 256,
        ..ReactorConfig::default()
    };
    let mut reactor: Reactor<PerfHandler> = Reactor::new(pd, config).expect("reactor");
    let access = AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
    let exported = AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND;
    let server_buf = pd.alloc_mr(2 * SIZE, exported).unwrap();
    let client_buf = pd.alloc_mr(2 * SIZE, exported).unwrap();
    let key = AuthKey::random().unwrap();
    let mut server_config = reactor.server_config(access);
    server_config.auth_key = Some(key.clone());
    let export = server_buf.registration().clone();
    server_config.exports = Some(Arc::new(move |_, _: &ProtectionDomain| {
        Ok(vec![Export::new(1, "perf", export.clone(), access)])
    }));
    let listener = ServerSession::bind("127.0.0.1:0", pd, server_config).unwrap();
    let spec = reactor.qp_spec_with_access("perf", access);
    let client_config = ClientConfig::new(vec![spec])
        .with_auth_key(Some(key))
        .with_exports(vec![Export::new(1, "perf", &client_buf, access)]);
    let client_ep = ClientSession::connect(listener.local_addr(), pd, &client_config).unwrap();
    let server_ep = listener.accept().unwrap();
    let to_server = client_ep.remote_region("perf").unwrap();
    let to_client = server_ep.remote_region("perf").unwrap();
    reactor
        .add(
            server_ep,
            server(PerfBuffers {
                buffer: server_buf,
                peer: to_client,
            }),
        )
        .unwrap();
    let session = reactor
        .add(
            client_ep,
            client(PerfBuffers {
                buffer: client_buf,
                peer: to_server,
            }),
        )
        .unwrap();
    (reactor, session)
}

fn latency(c: &mut Criterion) {
    let (_ctx, pd) = open();
    let mut group = c.benchmark_group("round_trip_64B");
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(5));
    for op in [PerfOp::Send, PerfOp::Write] {
        for signal in [1, 16] {
            group.bench_function(
                BenchmarkId::new(op.to_string(), format!("signal{signal}")),
                |b| {
                    b.iter_custom(|iters| {
                        let spec = PerfSpec {
                            op,
                            size: SIZE,
                            iters,
                            warmup: 50,
                            batch: 1,
                            tx_depth: 0,
                        };
                        let (mut reactor, session) = pair(
                            &pd,
                            signal,
                            |buffers| PerfHandler::Latency(LatencyClient::new(spec, buffers)),
                            |buffers| PerfHandler::Reflect(Reflector::new(spec, buffers)),
                        );
                        reactor.run().unwrap();
                        let Some(PerfHandler::Latency(client)) = reactor.handler(session) else {
                            unreachable!()
                        };
                        // Samples are half round trips for SEND and WRITE; report whole ones.
                        Duration::from_nanos(
                            client.latencies_ns().iter().map(|half| 2 * half).sum(),
                        )
                    });
                },
            );
        }
    }
    group.finish();
}

fn message_rate(c: &mut Criterion) {
    let (_ctx, pd) = open();
    let mut group = c.benchmark_group("message_rate_64B");
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(5))
        .throughput(Throughput::Elements(1));
    for op in [PerfOp::Send, PerfOp::Write] {
        for signal in [1, 16] {
            for batch in [1, 16] {
                let id = BenchmarkId::new(op.to_string(), format!("signal{signal}_batch{batch}"));
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
                        let (mut reactor, session) = pair(
                            &pd,
                            signal,
                            |buffers| PerfHandler::Rate(RateSender::new(spec, buffers)),
                            |_| PerfHandler::Sink(RateSink::default()),
                        );
                        reactor.run().unwrap();
                        let Some(PerfHandler::Rate(sender)) = reactor.handler(session) else {
                            unreachable!()
                        };
                        let stats = black_box(sender.stats());
                        Duration::from_secs_f64(stats.iters as f64 / (stats.msg_rate_mpps * 1e6))
                    });
                });
            }
        }
    }
    group.finish();
}

criterion_group!(benches, latency, message_rate);
criterion_main!(benches);
