//! Only the reactor makes `HeldRecv`s: code outside it cannot name a
//! receive slot of its choosing.

use rdma_comm_core::reactor::{ConnId, HeldRecv};

fn forge(conn: ConnId) -> HeldRecv {
    HeldRecv {
        conn,
        slot: 0,
        len: 64,
    }
}

fn main() {
    let _ = forge;
}
