//! What a connection makes of one of its completions, once the table
//! vetted it as the connection's: credits counted and checked, the
//! receive slot queued for reposting when the handler gets no hold of it,
//! retired send-queue work counted. The result says what the handler is
//! told.

use crate::verbs::{WcOpcode, WorkCompletion};

use super::{Arrival, Conn};

/// What a completion brings the handler, once the connection has done
/// its part (credits, reposts, the overrun check).
pub(crate) enum Delivery {
    /// A WRITE_WITH_IMM landed.
    WriteImm { imm: u32, len: u32 },
    /// The peer's first credit: the connection is usable.
    Established,
    /// A message in receive slot `slot` (payload address and length),
    /// maybe with the peer's first credit.
    Message {
        established: bool,
        slot: u32,
        data: (*const u8, usize),
        imm: Option<u32>,
        from_srq: bool,
    },
    /// Signaled send-queue work done: this many ops retire.
    Retired { count: u32 },
    /// Nothing for the handler (a credit update of an established peer,
    /// a signaled send whose ops retired already).
    Nothing,
    /// A receive into `slot` beyond what the peer was granted: it ignores
    /// its credits, and is cut off.
    Overrun { slot: u32 },
    /// A SEND into `slot` that the protocol has no place for (`what`): the
    /// peer is cut off.
    Malformed { slot: u32, what: &'static str },
}

impl Conn {
    /// A successful receive into slot `slot` on an open connection.
    #[inline(always)]
    pub(crate) fn on_receive(&mut self, slot: u32, wc: &WorkCompletion) -> Delivery {
        if !self.count_receive() {
            return Delivery::Overrun { slot };
        }
        let len = wc.byte_len();
        if wc.opcode() == WcOpcode::RECV_RDMA_WITH_IMM {
            self.queue_repost(slot);
            return Delivery::WriteImm {
                imm: wc.imm().unwrap_or(0),
                len,
            };
        }
        match self.recv_message(slot, len, wc.imm()) {
            Ok(Arrival::Message { count, data, imm }) => {
                let established = self.peer_credit(count);
                if established {
                    self.answer_first_credit();
                }
                Delivery::Message {
                    established,
                    slot,
                    data,
                    imm,
                    from_srq: self.uses_srq(),
                }
            }
            Ok(Arrival::Credit(count)) => {
                self.queue_repost(slot);
                if !self.peer_credit(count) {
                    return Delivery::Nothing;
                }
                self.answer_first_credit();
                Delivery::Established
            }
            Err(what) => Delivery::Malformed { slot, what },
        }
    }

    /// A successful completion of send-queue request `seq` on an open
    /// connection.
    #[inline(always)]
    pub(crate) fn on_send(&self, seq: u32) -> Delivery {
        match self.retire_count(seq) {
            0 => Delivery::Nothing,
            count => Delivery::Retired { count },
        }
    }
}
