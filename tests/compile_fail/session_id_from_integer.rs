//! Session ids are opaque: they come from `Reactor::add`, never from an
//! integer.

use rdma_comm_core::reactor::SessionId;

fn make() -> SessionId {
    SessionId(0)
}

fn main() {
    let _ = make;
}
