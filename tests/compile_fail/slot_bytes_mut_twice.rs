//! `bytes_mut` borrows the slot handle mutably: two live mutable views of
//! the same slot cannot exist.

use rdma_comm_core::pool::{BufferPool, Slot};

fn alias(pool: &BufferPool, mut slot: Slot) {
    let first = pool.bytes_mut(&mut slot).unwrap();
    let second = pool.bytes_mut(&mut slot).unwrap();
    first[0] = second[0];
}

fn main() {
    let _ = alias;
}
