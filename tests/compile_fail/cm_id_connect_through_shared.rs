//! Connecting changes an id's state: it takes the id exclusively, so two
//! threads sharing `&CmId` cannot race their calls.
use rdma_comm_core::verbs::QueuePair;
use rdma_comm_core::verbs::cm::CmId;

fn connect(id: &CmId, qp: &QueuePair) {
    let _ = id.connect(qp, b"");
}

fn main() {}
