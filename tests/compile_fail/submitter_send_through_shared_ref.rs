//! Pushing needs `&mut Submitter`: a `Submitter` shared between threads
//! (it is `Sync`) cannot be pushed into through `&Submitter`.

use rdma_comm_core::reactor::ConnId;
use rdma_comm_core::runtime::Submitter;

fn push(submitter: &Submitter, conn: ConnId) {
    let _ = submitter.send(conn, b"x", None);
}

fn main() {
    let _ = push;
}
