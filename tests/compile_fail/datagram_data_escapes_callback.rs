//! `on_datagram`'s bytes and the source it names live in a receive slot
//! that goes back to the device after the callback: a handler cannot keep
//! a reference to either.

use rdma_comm_core::reactor::{ConnId, Ctx, DatagramId, DatagramSource, Handler};

struct Keeper<'a> {
    kept: Vec<&'a [u8]>,
    sources: Vec<DatagramSource<'a>>,
}

impl<'a> Handler for Keeper<'a> {
    fn on_message(&mut self, _: &mut Ctx<'_>, _: ConnId, _: &[u8], _: Option<u32>) {}

    fn on_datagram(&mut self, _: &mut Ctx<'_>, _: DatagramId, source: &DatagramSource<'_>, data: &[u8]) {
        self.kept.push(data);
        self.sources.push(*source);
    }
}

fn main() {
    let _ = Keeper { kept: Vec::new(), sources: Vec::new() };
}
