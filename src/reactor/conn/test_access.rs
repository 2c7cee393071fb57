//! What tests of the reactor read or do on a connection that the reactor
//! itself never needs.

use super::{Conn, Credits};

impl Conn {
    /// The credit counts.
    pub(crate) fn credits(&self) -> &Credits {
        &self.credits
    }

    /// Posts a receive into slot `slot` of the own ring whatever its state
    /// (see [`RecvRing::post_bypassing_the_guard`]).
    pub(crate) fn post_recv_bypassing_the_guard(&mut self, slot: u32) -> crate::Result<()> {
        self.rq.post_bypassing_the_guard(&mut self.qp, slot)
    }
}
