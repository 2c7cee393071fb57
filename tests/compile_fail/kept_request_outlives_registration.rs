//! A request kept to post again (`post_send` leaves it with the caller)
//! borrows the registration it points into: the registration cannot go
//! while the request may be posted once more.

use rdma_comm_core::verbs::{AccessFlags, ProtectionDomain, QueuePair, WorkRequest};

fn post_after_drop(pd: &ProtectionDomain, qp: &mut QueuePair) {
    let mr = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    let registration = mr.registration().clone();
    drop(mr);
    let mut kept = WorkRequest::send(1, registration.slice(0, 8).unwrap());
    qp.post_send(&mut kept).unwrap();
    drop(registration);
    qp.post_send(&mut kept).unwrap();
}

fn main() {
    let _ = post_after_drop;
}
