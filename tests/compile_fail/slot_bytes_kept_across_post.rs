//! A view of a slot's bytes cannot outlive the slot's handle being posted:
//! the NIC would otherwise write under a live `&[u8]`.

use rdma_comm_core::pool::{BufferPool, Slot};
use rdma_comm_core::verbs::QueuePair;

fn keep_view(pool: &mut BufferPool, qp: &mut QueuePair, slot: Slot) -> u8 {
    let view = pool.bytes(&slot).unwrap();
    pool.post_recv(qp, slot).unwrap();
    view[0]
}

fn main() {
    let _ = keep_view;
}
