//! A slot handle can be posted once: a second post of the same slot while
//! the first is in flight does not compile.

use rdma_comm_core::pool::{BufferPool, Slot};
use rdma_comm_core::verbs::QueuePair;

fn post_twice(pool: &mut BufferPool, qp: &mut QueuePair, slot: Slot) {
    pool.post_recv(qp, slot).unwrap();
    pool.post_recv(qp, slot).unwrap();
}

fn main() {
    let _ = post_twice;
}
