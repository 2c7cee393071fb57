//! The reactor's shared receive queue: its slots, which connection consumed
//! a receive (by QP number), and how many receives each may have.
//!
//! Only this pool posts on the SRQ (the handle that can post is not
//! `Clone`; QPs attach through an `SrqAttachment`), and a completion names
//! an SRQ slot only if it comes from a QP the pool knows, so a slot is
//! never reposted while it is still posted.

use crate::error::{Error, Result};
use crate::verbs::{
    AccessFlags, MemoryRegion, ProtectionDomain, RecvBatch, SharedReceiveQueue, SrqAttachment,
};

use super::ReactorConfig;
use super::conn::{CREDIT_HEADER_LEN, MAX_REPOST, Ring, SharedRing, recv_request, srq_recv_wr_id};
use super::slab::Key;

pub(super) struct SrqPool {
    srq: SharedReceiveQueue,
    shared: SharedRing,
    // Registered for as long as the reactor lives; dropped after the QPs.
    _region: MemoryRegion,
    /// Sum of the connections' shares.
    promised: u32,
    /// (QP number, connection), sorted: which connection consumed an SRQ
    /// receive. An entry goes with its connection, so a QP number reused
    /// later never routes a receive to a connection that is gone.
    owners: Vec<(u32, Key)>,
    /// Slots on their way back to the SRQ, posted at the end of the pass.
    returning: RecvBatch<'static, MAX_REPOST>,
    slot_size: usize,
    /// Receives consumed by QPs the reactor no longer knows: slots that
    /// cannot be told apart from forged ones, so they stay out.
    pub(super) lost: u64,
}

// SAFETY: the ring pointer and the batch point into `_region`, which the
// pool owns; moving the pool to another thread moves their owner too.
unsafe impl Send for SrqPool {}

impl SrqPool {
    pub(super) fn new(pd: &ProtectionDomain, config: &ReactorConfig) -> Result<Self> {
        let slot_size = config.slot_size.max(CREDIT_HEADER_LEN);
        let mut srq = pd.create_srq(config.srq_depth)?;
        let slots = config.srq_depth;
        let region = pd.alloc_mr(slot_size * slots as usize, AccessFlags::LOCAL_WRITE)?;
        let ring = Ring::of(&region);
        let mut batch = RecvBatch::<MAX_REPOST>::new();
        for slot in 0..slots {
            let _ = batch.push(recv_request(ring, slot_size, srq_recv_wr_id(slot), slot));
            if batch.is_full() {
                srq.post_recv_batch(&mut batch)?;
            }
        }
        srq.post_recv_batch(&mut batch)?;
        Ok(Self {
            srq,
            shared: SharedRing {
                ring,
                slots,
                registration: region.registration().clone(),
            },
            _region: region,
            promised: 0,
            owners: Vec::new(),
            returning: RecvBatch::new(),
            slot_size,
            lost: 0,
        })
    }

    /// What a connection needs to know of the SRQ.
    pub(super) fn shared(&self) -> SharedRing {
        self.shared.clone()
    }

    /// A handle to attach QPs with.
    pub(super) fn attachment(&self) -> SrqAttachment {
        self.srq.attachment()
    }

    /// True if `attachment` attaches QPs to this pool's SRQ.
    pub(super) fn is_ours(&self, attachment: &SrqAttachment) -> bool {
        self.srq.is_attached_by(attachment)
    }

    /// Reserves `shares` receives for new connections, or refuses.
    pub(super) fn promise(&mut self, shares: u32) -> Result<()> {
        if self.promised.saturating_add(shares) > self.shared.slots {
            return Err(Error::InvalidArgument(
                "the reactor's SRQ cannot give these connections their recv_depth shares (raise srq_depth)",
            ));
        }
        self.promised += shares;
        Ok(())
    }

    /// Gives back shares promised to connections that were never built.
    pub(super) fn unpromise(&mut self, shares: u32) {
        self.promised = self.promised.saturating_sub(shares);
    }

    /// Registers the owner of QP `qpn`.
    pub(super) fn add_owner(&mut self, qpn: u32, conn: Key) {
        self.owners.push((qpn, conn));
        self.owners.sort_unstable();
    }

    /// Forgets a connection that is going, and gives back its share.
    pub(super) fn remove_owner(&mut self, qpn: u32, share: u32) {
        self.owners.retain(|&(q, _)| q != qpn);
        self.promised = self.promised.saturating_sub(share);
    }

    /// The connection whose QP consumed an SRQ receive.
    #[inline]
    pub(super) fn owner(&self, qpn: u32) -> Option<Key> {
        let at = self.owners.binary_search_by_key(&qpn, |&(q, _)| q).ok()?;
        Some(self.owners[at].1)
    }

    /// Queues SRQ slot `slot` to be posted again; posts when a batch fills.
    #[inline]
    pub(super) fn give_back(&mut self, slot: u32) -> Result<()> {
        if slot >= self.shared.slots {
            return Ok(());
        }
        let request = recv_request(self.shared.ring, self.slot_size, srq_recv_wr_id(slot), slot);
        let _ = self.returning.push(request);
        if self.returning.is_full() {
            self.srq.post_recv_batch(&mut self.returning)?;
        }
        Ok(())
    }

    /// Posts the slots given back in this pass.
    #[inline]
    pub(super) fn flush(&mut self) -> Result<()> {
        self.srq.post_recv_batch(&mut self.returning)
    }
}
