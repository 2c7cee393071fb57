//! A submission ring has one producer: `Submitter` is not `Clone`, so no
//! second thread can push into the same ring.

use rdma_comm_core::runtime::Submitter;

fn duplicate(submitter: Submitter) -> (Submitter, Submitter) {
    (submitter.clone(), submitter)
}

fn main() {
    let _ = duplicate;
}
