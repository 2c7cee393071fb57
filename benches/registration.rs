//! Memory registration cost and buffer-pool memory use.
//!
//! Needs an RDMA device: `tools/bench registration` runs it in the Soft-RoCE
//! guest when the host has none. Prints criterion's timings for registering
//! regions of 4 KiB to 64 MiB (map, register, deregister, unmap) and, once, the
//! resident memory a buffer pool of each shape costs.

use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use rdma_comm_core::pool::BufferPool;
use rdma_comm_core::verbs::{AccessFlags, Context};

fn open() -> Context {
    Context::open_default(std::env::var("RDMA_TEST_DEVICE").ok().as_deref()).unwrap_or_else(|err| {
        panic!("this benchmark needs an RDMA device ({err}); run it with tools/bench")
    })
}

fn rss_kib() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    statm
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0)
        * 4
}

fn registration(c: &mut Criterion) {
    let ctx = open();
    let pd = ctx.alloc_pd().expect("alloc_pd");
    let mut group = c.benchmark_group("register_region");
    group
        .sample_size(20)
        .measurement_time(Duration::from_secs(3));
    for size in [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20] {
        group.throughput(Throughput::Bytes(size as u64));
        group.bench_with_input(BenchmarkId::from_parameter(size), &size, |b, &size| {
            b.iter(|| {
                black_box(
                    pd.alloc_mr(size, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
                        .unwrap(),
                )
            });
        });
    }
    group.finish();

    let mut group = c.benchmark_group("buffer_pool_new");
    group
        .sample_size(20)
        .measurement_time(Duration::from_secs(3));
    for (slot_size, slots) in [(4096, 256), (65536, 256), (1 << 20, 64)] {
        group.bench_function(format!("{slots}x{slot_size}"), |b| {
            b.iter(|| {
                black_box(BufferPool::new(&pd, slot_size, slots, AccessFlags::LOCAL_WRITE).unwrap())
            });
        });
    }
    group.finish();

    println!("\nbuffer pool memory (resident set growth while the pool is alive):");
    println!(
        "{:>10} {:>6} {:>12} {:>12} {:>10}",
        "slot_size", "slots", "bytes", "rss_KiB", "hugepages"
    );
    for (slot_size, slots) in [(4096usize, 256u32), (65536, 256), (1 << 20, 64)] {
        let before = rss_kib();
        let pool = BufferPool::new(&pd, slot_size, slots, AccessFlags::LOCAL_WRITE).unwrap();
        let after = rss_kib();
        println!(
            "{slot_size:>10} {slots:>6} {:>12} {:>12} {:>10}",
            pool.slot_size() * pool.capacity() as usize,
            after.saturating_sub(before),
            pool.huge_pages()
        );
    }
}

criterion_group!(benches, registration);
criterion_main!(benches);
