//! Connection ids are opaque: they come from the reactor, never from an
//! integer (which could name another tenant of a reused slot).

use rdma_comm_core::reactor::ConnId;

fn make() -> ConnId {
    ConnId(0)
}

fn main() {
    let _ = make;
}
