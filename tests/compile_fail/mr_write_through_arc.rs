//! A region shared through an `Arc` (as an exported inbox usually is) can
//! be read by every holder but written by none.

use std::sync::Arc;

use rdma_comm_core::verbs::MemoryRegion;

fn write_shared(mr: Arc<MemoryRegion>) {
    mr.write(0, b"torn").unwrap();
}

fn main() {
    let _ = write_shared;
}
