//! A `SharedReceiveQueue` has one owner: it cannot be cloned into a second
//! handle that could post receives too.

use rdma_comm_core::verbs::SharedReceiveQueue;

fn duplicate(srq: SharedReceiveQueue) -> (SharedReceiveQueue, SharedReceiveQueue) {
    (srq.clone(), srq)
}

fn main() {
    let _ = duplicate;
}
