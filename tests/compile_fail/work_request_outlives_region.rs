//! A work request borrows the region its slice points into: the region
//! cannot be dropped (deregistered and freed) before the request is posted.

use rdma_comm_core::verbs::{MemoryRegion, QueuePair, WorkRequest};

fn post_freed(qp: &mut QueuePair, mr: MemoryRegion) {
    let mut wr = WorkRequest::send(1, mr.slice(0, 8).unwrap());
    drop(mr);
    qp.post_send(&mut wr).unwrap();
}

fn main() {
    let _ = post_freed;
}
