//! Posting a slot consumes its handle: its bytes cannot be reached again
//! until the completion hands a slot back.

use rdma_comm_core::pool::{BufferPool, Slot};
use rdma_comm_core::verbs::QueuePair;

fn reuse_in_flight(pool: &mut BufferPool, qp: &mut QueuePair, mut slot: Slot) {
    pool.post_send(qp, slot, 8, None).unwrap();
    pool.bytes_mut(&mut slot).unwrap()[0] = 1;
}

fn main() {
    let _ = reuse_in_flight;
}
