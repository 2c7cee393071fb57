//! A pool hands out its bytes per slot only: there is no way to its region,
//! which would reach slots that are in flight.

use rdma_comm_core::pool::BufferPool;

fn reach_region(pool: &BufferPool) {
    let _ = pool.region();
}

fn main() {
    let _ = reach_region;
}
