//! There is at most one handle per slot: `Slot` is not `Clone`.

use rdma_comm_core::pool::Slot;

fn duplicate(slot: Slot) -> (Slot, Slot) {
    (slot.clone(), slot)
}

fn main() {
    let _ = duplicate;
}
