//! `Reactor::add` takes the endpoint (and so its QPs) whole: nothing can be
//! posted on them behind the reactor's back afterwards.

use rdma_comm_core::reactor::{ConnId, Ctx, Handler, Reactor};
use rdma_comm_core::session::Endpoint;
use rdma_comm_core::verbs::{MemoryRegion, RecvRequest};

struct Quiet;

impl Handler for Quiet {
    fn on_message(&mut self, _: &mut Ctx<'_>, _: ConnId, _: &[u8], _: Option<u32>) {}
}

fn post_after_add(reactor: &mut Reactor<Quiet>, mut endpoint: Endpoint, mr: &MemoryRegion) {
    reactor.add(endpoint, Quiet).unwrap();
    let mut wr = RecvRequest::new(1, mr.slice(0, 64).unwrap()).unwrap();
    endpoint.qps_mut()[0].qp_mut().post_recv(&mut wr).unwrap();
}

fn main() {
    let _ = post_after_add;
}
