//! A `QueuePair` is `Sync`, but sharing it (through an `Arc`) does not let
//! the holders post on it: posting needs `&mut QueuePair`.

use std::sync::Arc;

use rdma_comm_core::verbs::{MemoryRegion, QueuePair, RecvRequest};

fn post_shared(qp: Arc<QueuePair>, mr: &MemoryRegion) {
    qp.post_recv(&mut RecvRequest::new(1, mr.slice(0, 64).unwrap()).unwrap())
        .unwrap();
}

fn main() {
    let _ = post_shared;
}
