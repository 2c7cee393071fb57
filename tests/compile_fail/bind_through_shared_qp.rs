//! Binding a window posts on the QP's send queue, so it needs
//! `&mut QueuePair` like every post: whoever shares a QP (a reactor's
//! handler, say) cannot bind on it.

use std::sync::Arc;

use rdma_comm_core::verbs::{AccessFlags, MemoryWindow, QueuePair, Registration, SendFlags};

fn bind_shared(qp: Arc<QueuePair>, window: MemoryWindow, memory: &Registration) {
    let _ = qp.bind_window(window, memory, AccessFlags::REMOTE_READ, SendFlags::empty());
}

fn main() {
    let _ = bind_shared;
}
