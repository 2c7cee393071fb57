//! An endpoint's channels seen through `&Endpoint` give `&QueuePair`, and
//! posting needs `&mut QueuePair`.

use rdma_comm_core::session::Endpoint;
use rdma_comm_core::verbs::{MemoryRegion, WorkRequest};

fn post_shared(endpoint: &Endpoint, mr: &MemoryRegion) {
    let mut wr = WorkRequest::send(1, mr.slice(0, 8).unwrap());
    endpoint.qps()[0].qp().post_send(&mut wr).unwrap();
}

fn main() {
    let _ = post_shared;
}
