//! A connect request is answered once: accept consumes it, so it cannot be
//! rejected (or accepted again) afterwards.
use rdma_comm_core::verbs::QueuePair;
use rdma_comm_core::verbs::cm::ConnectRequest;

fn answer(request: ConnectRequest, qp: &mut QueuePair) {
    let _id = request.accept(qp, b"");
    let _ = request.reject(b"");
}

fn main() {}
