//! Copying into a region needs `&mut MemoryRegion`: a shared reference
//! (which other threads may hold too) only reads.

use rdma_comm_core::verbs::MemoryRegion;

fn write_shared(mr: &MemoryRegion) {
    mr.write(0, b"torn").unwrap();
}

fn main() {
    let _ = write_shared;
}
