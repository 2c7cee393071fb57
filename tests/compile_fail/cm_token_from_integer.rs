//! A CmToken names one id for the life of the process: it cannot be made
//! from an integer, so an event cannot be matched to an id it is not about.
use rdma_comm_core::verbs::cm::CmToken;

fn main() {
    let _forged = CmToken(1);
}
