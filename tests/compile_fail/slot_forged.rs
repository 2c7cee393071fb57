//! Slot handles come from the pool only: one cannot be made up for an
//! index that may be in flight.

use rdma_comm_core::pool::Slot;

fn forge() -> Slot {
    Slot {
        index: 0,
        pool_id: 1,
    }
}

fn main() {
    let _ = forge;
}
