//! A datagram endpoint's receive ring ([`Receives`]): registered slots of
//! a GRH and the largest datagram each, all posted ahead of traffic, and
//! the consumed ones waiting to be posted again in batches.

use crate::verbs::{
    AccessFlags, GRH_BYTES, MemoryRegion, ProtectionDomain, RecvSlots, UdQueuePair,
};

use super::super::conn::{MAX_REPOST, Ring, RingSlots};
use super::super::table::wr_id;

/// A datagram as it lies in its slot: the GRH's bytes, then the payload.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Landed {
    pub(crate) grh: *const [u8; GRH_BYTES],
    pub(crate) payload: *const u8,
    pub(crate) len: usize,
}

/// The receive side of a datagram endpoint.
pub(crate) struct Receives {
    ring: Ring,
    slot_size: usize,
    /// Where each slot is: posted, consumed or queued (a completion naming
    /// a slot that is not posted is refused).
    slots: RingSlots,
    /// Consumed slots waiting to be posted again (each at most once).
    pending: Box<[u32]>,
    pending_len: usize,
    /// Each slot's receive, built once.
    requests: RecvSlots,
    /// Reposts wait for this many, or for an idle pass.
    threshold: usize,
    /// The ring. The endpoint declares its QP first, so the QP is
    /// destroyed before this is deregistered.
    region: MemoryRegion,
}

impl Receives {
    /// `count` receives of up to `max_datagram` bytes each (after the GRH)
    /// for endpoint `endpoint`, registered on `pd`; none posted yet.
    pub(crate) fn new(
        pd: &ProtectionDomain,
        endpoint: u32,
        count: u32,
        max_datagram: u32,
    ) -> crate::Result<Self> {
        // The GRH lands before the payload; one SGE describes a slot.
        let slot_size = GRH_BYTES + max_datagram as usize;
        let sge_len = u32::try_from(slot_size)
            .map_err(|_| crate::Error::InvalidArgument("a datagram slot of 4 GiB or more"))?;
        let region = pd.alloc_mr(slot_size * count as usize, AccessFlags::LOCAL_WRITE)?;
        let requests = RecvSlots::new(region.addr(), region.lkey(), sge_len, count, |slot| {
            wr_id::datagram_recv(endpoint, slot)
        });
        let mut slots = RingSlots::new(count);
        for slot in 0..count {
            // Fresh slots are no one's: queued for the first post.
            slots.queue(slot);
        }
        Ok(Self {
            ring: Ring::of(&region),
            slot_size,
            slots,
            pending: (0..count).collect(),
            pending_len: count as usize,
            requests,
            threshold: (count as usize / 4).clamp(1, MAX_REPOST),
            region,
        })
    }

    /// Bytes registered for the ring.
    pub(crate) fn registered_bytes(&self) -> usize {
        self.region.len()
    }

    /// A receive of `slot` completed with `byte_len` bytes: where the
    /// datagram lies, if the slot was posted (it is consumed now, and
    /// must be [`queue`](Self::queue)d once read) and the count covers a
    /// GRH. `Err(true)` for a consumed slot too short to hold a GRH (queue
    /// it), `Err(false)` for a slot that was not posted (a completion the
    /// device cannot have made through this ring: leave it).
    #[inline]
    pub(crate) fn consume(&mut self, slot: u32, byte_len: u32) -> Result<Landed, bool> {
        if !self.slots.consume(slot) {
            return Err(false);
        }
        let len = byte_len as usize;
        if len < GRH_BYTES || len > self.slot_size {
            return Err(true);
        }
        let start = self.ring.slot_ptr(slot, self.slot_size);
        Ok(Landed {
            grh: start.cast_const().cast(),
            payload: start.wrapping_add(GRH_BYTES).cast_const(),
            len: len - GRH_BYTES,
        })
    }

    /// Consumed `slot` goes back to the device with a later flush.
    #[inline]
    pub(crate) fn queue(&mut self, slot: u32) {
        if self.slots.queue(slot)
            && let Some(entry) = self.pending.get_mut(self.pending_len)
        {
            *entry = slot;
            self.pending_len += 1;
        }
    }

    /// Whether enough receives wait to be posted again for a batch.
    #[inline]
    pub(crate) fn is_due(&self) -> bool {
        self.pending_len >= self.threshold
    }

    /// Whether any receive waits to be posted again.
    #[inline]
    pub(crate) fn has_pending(&self) -> bool {
        self.pending_len != 0
    }

    /// Posts every queued slot on `qp`, [`MAX_REPOST`] per `ibv_post_recv`.
    ///
    /// # Safety
    ///
    /// `qp` is the QP these receives are for: created on the PD the ring
    /// is registered on, and destroyed before the ring is dropped.
    pub(crate) unsafe fn flush(&mut self, qp: &mut UdQueuePair) -> crate::Result<()> {
        for batch in self.pending[..self.pending_len].chunks(MAX_REPOST) {
            self.slots.post_queued(batch)?;
            // SAFETY: the requests describe this ring's region, held here,
            // registered on `qp`'s PD and outliving it (this function's
            // contract); each slot of `batch` was queued (checked above,
            // once each), so the device holds none of them and the CPU reads
            // none of them until its receive completes.
            unsafe { qp.post_slots(&mut self.requests, batch)? };
        }
        self.pending_len = 0;
        Ok(())
    }
}

#[cfg(all(test, feature = "loopback"))]
mod tests {
    use super::*;
    use crate::verbs::Context;

    #[test]
    fn a_slot_is_read_only_once_posted_and_queued_only_once_consumed() {
        // SAFETY: nothing is posted on this device.
        let ctx = unsafe { Context::loopback() };
        let pd = ctx.alloc_pd().expect("a PD");
        let mut receives = Receives::new(&pd, 3, 4, 64).expect("a ring");
        assert!(
            receives.has_pending() && receives.is_due(),
            "all wait for the first post"
        );
        // As a flush would, without a QP.
        receives
            .slots
            .post_queued(&[0, 1, 2, 3])
            .expect("all queued");
        receives.pending_len = 0;
        let landed = receives
            .consume(2, (GRH_BYTES + 10) as u32)
            .expect("posted");
        assert_eq!(landed.len, 10);
        assert_eq!(
            landed.payload as usize - landed.grh as usize,
            GRH_BYTES,
            "the payload follows the GRH"
        );
        assert_eq!(
            receives.consume(2, 50).err(),
            Some(false),
            "consumed already"
        );
        assert_eq!(
            receives.consume(9, 50).err(),
            Some(false),
            "outside the ring"
        );
        assert_eq!(
            receives.consume(1, 39).err(),
            Some(true),
            "shorter than a GRH"
        );
        let too_long = (GRH_BYTES + 65) as u32;
        assert_eq!(
            receives.consume(3, too_long).err(),
            Some(true),
            "longer than a slot"
        );
        receives.queue(2);
        receives.queue(2);
        assert_eq!(receives.pending_len, 1, "queued once");
        assert!(receives.is_due(), "a quarter of four");
    }
}
