//! How a client's run ends: the done marker, staged until it fits, then
//! signaled, and the reactor stopped once it completed.

use rdma_comm_core::reactor::{ConnId, Ctx, SendError};

use crate::DONE_MARKER;

/// The end of a client's run: the done marker is staged (retried while the
/// peer has no credit for it), signaled, and the reactor stops once it has
/// completed, so the client never leaves before the server was told.
#[derive(Debug, Default)]
pub(crate) struct RunEnd {
    state: EndState,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum EndState {
    #[default]
    Running,
    Staging,
    Sent(u32),
    Done,
}

impl RunEnd {
    /// True once the run's measured part is over.
    pub(crate) fn begun(&self) -> bool {
        self.state != EndState::Running
    }

    pub(crate) fn begin(&mut self, ctx: &mut Ctx<'_>, conn: Option<ConnId>) {
        self.state = EndState::Staging;
        self.retry(ctx, conn);
    }

    pub(crate) fn retry(&mut self, ctx: &mut Ctx<'_>, conn: Option<ConnId>) {
        if self.state != EndState::Staging {
            return;
        }
        let Some(conn) = conn else {
            self.finish(ctx);
            return;
        };
        match ctx.send(conn, &[0], Some(DONE_MARKER)) {
            Ok(seq) => {
                ctx.signal_staged(conn);
                self.state = EndState::Sent(seq);
            }
            Err(SendError::WouldBlock) => {}
            Err(_) => self.finish(ctx),
        }
    }

    pub(crate) fn completed(&mut self, ctx: &mut Ctx<'_>, seq: u32) {
        if self.state == EndState::Sent(seq) {
            self.finish(ctx);
        }
    }

    /// Sends `first`, `first + 1`, … (`count` of them, wrapping) completed.
    pub(crate) fn completed_within(&mut self, ctx: &mut Ctx<'_>, first: u32, count: u32) {
        if let EndState::Sent(seq) = self.state
            && seq.wrapping_sub(first) < count
        {
            self.finish(ctx);
        }
    }

    fn finish(&mut self, ctx: &mut Ctx<'_>) {
        self.state = EndState::Done;
        ctx.stop();
    }
}
