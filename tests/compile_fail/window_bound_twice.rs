//! A type-2 window is bound once: binding consumes the `MemoryWindow`, so
//! the same window cannot also be bound for a second peer.

use rdma_comm_core::verbs::{AccessFlags, MemoryWindow, QueuePair, Registration, SendFlags};

fn bind_for_two_peers(
    a: &mut QueuePair,
    b: &mut QueuePair,
    window: MemoryWindow,
    memory: &Registration,
) {
    let _for_a = a.bind_window(window, memory, AccessFlags::REMOTE_WRITE, SendFlags::empty());
    let _for_b = b.bind_window(window, memory, AccessFlags::REMOTE_WRITE, SendFlags::empty());
}

fn main() {
    let _ = bind_for_two_peers;
}
