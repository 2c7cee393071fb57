//! Receives of a ring of equal slots, each request built once
//! ([`RecvSlots`]): a repost only links the requests of the slots that go
//! back, in the order given, and posts them with one `ibv_post_recv`
//! ([`QueuePair::post_slots`](super::QueuePair::post_slots) for a
//! connection's own ring, `UdQueuePair::post_slots` for a datagram
//! endpoint's).

use crate::error::{Error, Result};
use crate::sys;

/// One receive request per slot of a ring, with its SGE, built once.
pub(crate) struct RecvSlots {
    // Boxed: the owner moves, the requests do not.
    wrs: Box<[sys::ibv_recv_wr]>,
    sges: Box<[sys::ibv_sge]>,
    slot_size: u32,
}

// SAFETY: the raw pointers inside are the links `post_with` writes into
// the boxes right before posting (unused after).
unsafe impl Send for RecvSlots {}

impl RecvSlots {
    /// `count` receives of `slot_size` bytes each, slot `i` at `addr + i *
    /// slot_size` under `lkey`, carrying `wr_id(i)`. Describing memory
    /// posts nothing; the posting verbs say what posting asks of it.
    pub(crate) fn new(
        addr: u64,
        lkey: u32,
        slot_size: u32,
        count: u32,
        wr_id: impl Fn(u32) -> u64,
    ) -> Self {
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
                num_sge: i32::from(slot_size > 0),
                ..Default::default()
            })
            .collect();
        Self {
            wrs,
            sges,
            slot_size,
        }
    }

    /// Gives every slot's request the id `wr_id(slot)`.
    pub(crate) fn retag(&mut self, wr_id: impl Fn(u32) -> u64) {
        for (slot, wr) in (0..).zip(self.wrs.iter_mut()) {
            wr.wr_id = wr_id(slot);
        }
    }

    /// Slots described.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.wrs.len()
    }

    /// Bytes of each slot.
    pub(crate) fn slot_size(&self) -> u32 {
        self.slot_size
    }

    /// Links the requests of `slots` (in that order) into one
    /// NULL-terminated list and hands it to `post` with its length; no
    /// slot posts nothing. A slot out of the ring refuses the whole post.
    /// A slot named twice would shorten the list (its link is overwritten):
    /// the posting verbs' callers name each once.
    pub(crate) fn post_with(
        &mut self,
        slots: &[u32],
        post: impl FnOnce(*mut sys::ibv_recv_wr, usize) -> Result<()>,
    ) -> Result<()> {
        let Some(&first) = slots.first() else {
            return Ok(());
        };
        // Without allocating: the data path allocates nothing, in debug
        // builds too (a repost names at most a few dozen slots).
        debug_assert!(
            slots
                .iter()
                .enumerate()
                .all(|(i, slot)| !slots[i + 1..].contains(slot)),
            "a receive slot named twice"
        );
        let count = self.wrs.len();
        if first as usize >= count {
            return Err(out_of_ring());
        }
        // Links from pointers taken now: every one derives from these two,
        // and nothing borrows the arrays again until the post returns. Each
        // slot links to the next once that one is known to be in the ring;
        // a slot beyond it refuses the post with nothing posted (links left
        // behind are rewritten by the next post before it uses them).
        let wrs = self.wrs.as_mut_ptr();
        let sges = self.sges.as_mut_ptr();
        let mut at = first as usize;
        for &next in &slots[1..] {
            let next = next as usize;
            if next >= count {
                return Err(out_of_ring());
            }
            // SAFETY: `at` and `next` are below the arrays' length (checked
            // as each was reached), and we hold `&mut self`.
            unsafe {
                (*wrs.add(at)).sg_list = sges.add(at);
                (*wrs.add(at)).next = wrs.add(next);
            }
            at = next;
        }
        // SAFETY: as above, for the last slot.
        unsafe {
            (*wrs.add(at)).sg_list = sges.add(at);
            (*wrs.add(at)).next = std::ptr::null_mut();
        }
        post(wrs.wrapping_add(first as usize), slots.len())
    }
}

/// The refusal of a post naming a slot beyond the ring.
#[cold]
fn out_of_ring() -> Error {
    Error::InvalidArgument("a receive slot outside the ring")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_slot_has_its_request_and_a_post_links_the_slots_in_order() {
        let mut slots = RecvSlots::new(0x1000, 7, 100, 3, |slot| 0xab00 + u64::from(slot));
        assert_eq!(slots.len(), 3);
        assert_eq!(slots.sges[2].addr, 0x1000 + 200);
        assert_eq!((slots.sges[2].length, slots.sges[2].lkey), (100, 7));
        assert_eq!(slots.wrs[1].wr_id, 0xab01);
        let mut seen = Vec::new();
        slots
            .post_with(&[2, 0], |head, len| {
                assert_eq!(len, 2);
                // SAFETY: the list just linked, alive during the call.
                seen = unsafe { super::super::list::ids_and_addrs(head) };
                Ok(())
            })
            .expect("posted");
        assert_eq!(seen, [(0xab02, 0x1000 + 200), (0xab00, 0x1000)]);
        slots.retag(|slot| 0xcd00 + u64::from(slot));
        assert_eq!(slots.wrs[2].wr_id, 0xcd02);
        for outside in [&[3][..], &[1, 3], &[0, 2, 7]] {
            assert!(matches!(
                slots.post_with(outside, |_, _| panic!("nothing is posted")),
                Err(Error::InvalidArgument(_))
            ));
        }
        // The links a refused post left are rewritten by the next.
        let mut ids = Vec::new();
        slots
            .post_with(&[1], |head, len| {
                assert_eq!(len, 1);
                // SAFETY: the list just linked, alive during the call.
                let wr = unsafe { &*head };
                ids.push(wr.wr_id);
                assert!(wr.next.is_null(), "one request");
                Ok(())
            })
            .expect("posted");
        assert_eq!(ids, [0xcd01]);
    }
}
