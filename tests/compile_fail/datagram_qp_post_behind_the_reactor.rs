//! The reactor lends its datagram endpoint's QP only shared: a handler
//! makes destinations with it, but cannot post behind the reactor's back
//! (its receive ring and send window would no longer say what the device
//! holds).

use rdma_comm_core::reactor::{DatagramId, Handler, Reactor};
use rdma_comm_core::verbs::UdSend;

fn post_behind<H: Handler>(reactor: &mut Reactor<H>, id: DatagramId, mut request: UdSend<'_>) {
    if let Some(qp) = reactor.datagram_qp(id) {
        let _ = qp.post_send(&mut request);
    }
}

fn main() {
    let _ = post_behind::<Box<dyn Handler>>;
}
