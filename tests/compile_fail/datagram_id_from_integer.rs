//! Datagram endpoint ids are opaque: they come from the reactor that made
//! the endpoint, never from integers (which could name another reactor's).

use rdma_comm_core::reactor::DatagramId;

fn make() -> DatagramId {
    DatagramId { reactor: 1, index: 0, serial: 0 }
}

fn main() {
    let _ = make;
}
