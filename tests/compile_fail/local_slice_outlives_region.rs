//! A `LocalSlice` borrows its region: it cannot outlive it.

use rdma_comm_core::verbs::{MemoryRegion, ProtectionDomain};

fn dangling(pd: &ProtectionDomain) -> u32 {
    let mr: MemoryRegion = pd
        .alloc_mr(64, rdma_comm_core::verbs::AccessFlags::LOCAL_WRITE)
        .unwrap();
    let slice = mr.slice(0, 8).unwrap();
    drop(mr);
    slice.len()
}

fn main() {
    let _ = dangling;
}
