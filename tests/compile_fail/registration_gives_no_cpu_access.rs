//! A `Registration` (what the reactor and exports keep) holds the memory
//! registered but gives no CPU access to its bytes.

use rdma_comm_core::verbs::Registration;

fn write_through_registration(registration: &mut Registration) {
    registration.write(0, b"torn").unwrap();
}

fn main() {
    let _ = write_through_registration;
}
