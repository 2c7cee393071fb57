//! Posting on a shared receive queue needs its one owner's `&mut`.

use rdma_comm_core::verbs::{RecvBatch, SharedReceiveQueue};

fn post_shared(srq: &SharedReceiveQueue, batch: &mut RecvBatch<'_, 4>) {
    srq.post_recv(batch).unwrap();
}

fn main() {
    let _ = post_shared;
}
