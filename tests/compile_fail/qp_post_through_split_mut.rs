//! `SessionQp::split_mut` lends the CQ mutably but the QP only shared: a
//! post-then-poll loop cannot post through it.

use rdma_comm_core::session::SessionQp;
use rdma_comm_core::verbs::{MemoryRegion, RecvRequest};

fn post_through_split(channel: &mut SessionQp, mr: &MemoryRegion) {
    let (qp, _cq) = channel.split_mut();
    qp.post_recv(&mut RecvRequest::new(1, mr.slice(0, 64).unwrap()).unwrap())
        .unwrap();
}

fn main() {
    let _ = post_through_split;
}
