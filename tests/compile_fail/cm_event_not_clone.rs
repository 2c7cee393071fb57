//! A connection-manager event is acknowledged when dropped: a clone would
//! acknowledge it twice (librdmacm frees it on the first).
use rdma_comm_core::verbs::cm::CmEvent;

fn twice(event: &CmEvent) -> CmEvent {
    event.clone()
}

fn main() {}
