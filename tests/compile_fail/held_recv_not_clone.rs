//! A held receive is one receive slot: it cannot be cloned (and so released
//! or forwarded twice).

use rdma_comm_core::reactor::HeldRecv;

fn duplicate(held: HeldRecv) -> (HeldRecv, HeldRecv) {
    (held.clone(), held)
}

fn main() {
    let _ = duplicate;
}
