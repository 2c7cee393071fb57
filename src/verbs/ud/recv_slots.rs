//! Receives of a ring of equal slots, each request built once
//! ([`UdRecvSlots`], posted with
//! [`UdQueuePair::post_slots`](super::UdQueuePair::post_slots)): a repost
//! only links the requests of the slots that go back, one `ibv_post_recv`.

use crate::error::{Error, Result};
use crate::sys;

use super::GRH_BYTES;

/// One receive request per slot of a ring, with its SGE, built once.
pub(crate) struct UdRecvSlots {
    // Boxed: the owner moves, the requests do not.
    pub(super) wrs: Box<[sys::ibv_recv_wr]>,
    pub(super) sges: Box<[sys::ibv_sge]>,
}

// SAFETY: the raw pointers inside are the links `post_slots` writes into
// the boxes right before posting (unused after).
unsafe impl Send for UdRecvSlots {}

impl UdRecvSlots {
    /// `count` receives of `slot_size` bytes each (at least the GRH), slot
    /// `i` at `addr + i * slot_size` under `lkey`, carrying `wr_id(i)`.
    /// Describing memory posts nothing; [`UdQueuePair::post_slots`](super::UdQueuePair::post_slots)
    /// says what posting asks of it.
    pub(crate) fn new(
        addr: u64,
        lkey: u32,
        slot_size: u32,
        count: u32,
        wr_id: impl Fn(u32) -> u64,
    ) -> Result<Self> {
        if (slot_size as usize) < GRH_BYTES {
            return Err(Error::InvalidArgument(
                "a UD receive must hold the 40-byte GRH before the payload",
            ));
        }
        let sges = (0..count)
            .map(|slot| sys::ibv_sge {
                addr: addr + u64::from(slot) * u64::from(slot_size),
                length: slot_size,
                lkey,
            })
            .collect();
        let wrs = (0..count)
            .map(|slot| sys::ibv_recv_wr {
                wr_id: wr_id(slot),
                num_sge: 1,
                ..Default::default()
            })
            .collect();
        Ok(Self { wrs, sges })
    }

    /// Slots described.
    pub(crate) fn len(&self) -> usize {
        self.wrs.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_slot_has_its_request_and_a_slot_too_short_for_the_grh_is_refused() {
        let slots = UdRecvSlots::new(0x1000, 7, 100, 3, |slot| 0xab00 + u64::from(slot))
            .expect("three slots");
        assert_eq!(slots.len(), 3);
        assert_eq!(slots.sges[2].addr, 0x1000 + 200);
        assert_eq!((slots.sges[2].length, slots.sges[2].lkey), (100, 7));
        assert_eq!(slots.wrs[1].wr_id, 0xab01);
        assert!(matches!(
            UdRecvSlots::new(0, 1, GRH_BYTES as u32 - 1, 1, |_| 0),
            Err(Error::InvalidArgument(_))
        ));
    }
}
