//! `on_message`'s bytes live in a receive slot that is reposted after the
//! callback: a handler cannot keep a reference to them.

use rdma_comm_core::reactor::{ConnId, Ctx, Handler};

struct Keeper<'a> {
    kept: Vec<&'a [u8]>,
}

impl<'a> Handler for Keeper<'a> {
    fn on_message(&mut self, _: &mut Ctx<'_>, _: ConnId, data: &[u8], _: Option<u32>) {
        self.kept.push(data);
    }
}

fn main() {
    let _ = Keeper { kept: Vec::new() };
}
