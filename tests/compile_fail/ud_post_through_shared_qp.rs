//! A UD QP is `Sync` because everything `&UdQueuePair` can do is safe
//! from any thread; posting needs `&mut UdQueuePair`, so a QP shared
//! between threads cannot be posted on.

use std::sync::Arc;

use rdma_comm_core::verbs::{UdQueuePair, UdSend};

fn post_shared(qp: Arc<UdQueuePair>, mut request: UdSend<'_>) {
    let _ = qp.post_send(&mut request);
}

fn main() {
    let _ = post_shared;
}
