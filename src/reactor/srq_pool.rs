//! The reactor's shared receive queue: its slots, which connection consumed
//! a receive (by QP number), and how many receives each may have.
//!
//! Only this pool posts on the SRQ (the handle that can post is not
//! `Clone`; QPs attach through an `SrqAttachment`). Each post's `wr_id`
//! carries a tag keyed with the pool's secret SipHash key, and the pool
//! keeps the exact `wr_id` of every posted slot: a completion that matches
//! it is a genuine consumption of that slot, whichever QP reports it, and
//! one that does not (a request some other QP posted with a made-up id) is
//! ignored. A slot given back while it is posted, queued to be posted or
//! stranded is refused, so it is never posted twice; and a slot consumed
//! by a QP the reactor does not serve (not yet added, or removed) goes back
//! to the SRQ instead of being lost.
//!
//! Shares are promised only out of slots the SRQ holds or will hold: a
//! removed connection's share is free again at once, but the slots it
//! still had out (held by a handler, or in a forward on another
//! connection) are counted as orphans until they come back, and a newcomer
//! is promised a share only if the promised shares, the orphans and the
//! slots waiting for a refused post fit the SRQ. Otherwise the newcomer's
//! peer, keeping to its credits, could find the SRQ short of receives.

use std::hash::{BuildHasher, RandomState};

use crate::error::{Error, Result};
use crate::verbs::{
    AccessFlags, MemoryRegion, ProtectionDomain, RecvBatch, SharedReceiveQueue, SrqAttachment,
};

use super::ReactorConfig;
use super::conn::{IMM_TRAILER_LEN, MAX_REPOST, Ring, SharedRing, recv_request};
use super::slab::Key;
use super::table::wr_id::{MAX_CONNS, SRQ_SLOT_BITS, srq_recv as srq_recv_wr_id, srq_slot};

pub(super) struct SrqPool {
    srq: SharedReceiveQueue,
    shared: SharedRing,
    // Registered for as long as the reactor lives; dropped after the QPs.
    region: MemoryRegion,
    /// Sum of the connections' shares.
    promised: u32,
    /// Slots removed connections consumed that have not come back yet
    /// (held by a handler, or in a forward on another connection): no
    /// share may count on them. They come back through
    /// [`give_back_orphan`](Self::give_back_orphan).
    orphaned: u32,
    /// (QP number, connection), sorted: which connection consumed an SRQ
    /// receive. An entry goes with its connection, so a receive of a
    /// connection that is gone never reaches another; a newcomer whose QP
    /// reuses a gone QP's number is added only after the CQs are polled
    /// empty (see `Reactor::add`).
    owners: Vec<(u32, Key)>,
    /// Slots on their way back to the SRQ, posted at the end of the pass.
    returning: RecvBatch<'static, MAX_REPOST>,
    /// Slots given back while `returning` was full and its post failed:
    /// they wait here for the next flush rather than being lost to the SRQ.
    /// Room for every slot, reserved at creation.
    stranded: Vec<u32>,
    slot_size: usize,
    /// The `wr_id` each slot was last posted (or queued to be posted)
    /// with; 0 while the slot is consumed, [`STRANDED`] while it waits in
    /// `stranded`.
    posted_ids: Vec<u64>,
    tag_key: RandomState,
    posts: u64,
    /// Slots posted (or queued to be posted with this pass): the receives
    /// the SRQ can take now.
    pub(super) available: u32,
    /// Receives consumed by QPs the reactor does not serve (not yet added,
    /// or removed), given back to the SRQ.
    pub(super) reclaimed: u64,
    /// The first refused post since the last log line, and how many
    /// followed it: a refusal repeats for every slot given back after the
    /// batch filled, so it is logged once per pass, not once per slot.
    refusals: Option<(Error, u32)>,
}

/// The mark in `SrqPool::posted_ids` of a stranded slot: no posted slot's
/// `wr_id` (whose kind bits are set) and not 0.
const STRANDED: u64 = 1;

// SAFETY: the ring pointer and the batch point into `region`, which the
// pool owns; moving the pool to another thread moves their owner too.
unsafe impl Send for SrqPool {}

impl SrqPool {
    /// Bytes registered for the shared receive ring.
    pub(super) fn registered_bytes(&self) -> usize {
        self.region.len()
    }

    pub(super) fn new(pd: &ProtectionDomain, config: &ReactorConfig) -> Result<Self> {
        let slot_size = config.slot_size.max(IMM_TRAILER_LEN);
        let slots = config.srq_depth;
        if slots > 1 << SRQ_SLOT_BITS {
            return Err(Error::InvalidArgument("an SRQ holds at most 2^20 receives"));
        }
        let srq = pd.create_srq(slots)?;
        let region = pd.alloc_mr(slot_size * slots as usize, AccessFlags::LOCAL_WRITE)?;
        // A QP built from the reactor's `qp_spec` holds the SRQ, and may
        // outlive the reactor: the SRQ keeps its ring's memory.
        srq.keep_registered(region.registration().clone());
        let ring = Ring::of(&region);
        // Owners of the connections the reactor reserves its records for:
        // adding one within them grows nothing here either.
        let mut owners = Vec::new();
        owners
            .try_reserve_exact((config.reserve_connections as usize).min(MAX_CONNS))
            .map_err(super::reservation_refused)?;
        let mut pool = Self {
            srq,
            shared: SharedRing {
                ring,
                slots,
                registration: region.registration().clone(),
            },
            region,
            promised: 0,
            orphaned: 0,
            owners,
            returning: RecvBatch::new(),
            stranded: Vec::with_capacity(slots as usize),
            slot_size,
            posted_ids: vec![0; slots as usize],
            tag_key: RandomState::new(),
            posts: 0,
            available: 0,
            reclaimed: 0,
            refusals: None,
        };
        for slot in 0..slots {
            pool.give_back(slot)?;
        }
        pool.flush()?;
        Ok(pool)
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

    /// Reserves `shares` receives for new connections, or refuses: the
    /// shares promised already, the slots removed connections still have
    /// out, the slots a refused post left unposted, and these must fit the
    /// SRQ. (Unposted slots of live connections are counted in their
    /// shares too: while the SRQ refuses posts, a newcomer that would fit
    /// may be refused, never one that would not.)
    pub(super) fn promise(&mut self, shares: u32) -> Result<()> {
        let unposted = (self.returning.len() + self.stranded.len()) as u32;
        let bound = self
            .promised
            .saturating_add(self.orphaned)
            .saturating_add(unposted);
        if bound.saturating_add(shares) > self.shared.slots {
            return Err(Error::InvalidArgument(
                "the reactor's SRQ cannot give these connections their recv_depth shares (raise srq_depth, or wait for removed connections' held and forwarded messages to come back)",
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

    /// Forgets the connection of QP `qpn` as it goes, and gives back its
    /// share; the `out` slots it consumed and has not given back (held by
    /// its handler, or in forwards on other connections) are orphans until
    /// they come back.
    pub(super) fn remove_owner(&mut self, qpn: u32, share: u32, out: u32) {
        self.owners.retain(|&(q, _)| q != qpn);
        self.promised = self.promised.saturating_sub(share);
        self.orphaned = self.orphaned.saturating_add(out);
    }

    /// Gives back a slot of a removed connection (released by a handler,
    /// or its forward done): one orphan fewer.
    #[inline]
    pub(super) fn give_back_orphan(&mut self, slot: u32) {
        self.orphaned = self.orphaned.saturating_sub(1);
        self.give_back_noting(slot);
    }

    /// Slots removed connections still have out.
    #[cfg(test)]
    pub(super) fn orphaned(&self) -> u32 {
        self.orphaned
    }

    /// The connection whose QP consumed an SRQ receive.
    #[inline]
    pub(super) fn owner(&self, qpn: u32) -> Option<Key> {
        let at = self.owners.binary_search_by_key(&qpn, |&(q, _)| q).ok()?;
        Some(self.owners[at].1)
    }

    /// The slot a completion's `wr_id` consumed, if it is exactly the
    /// `wr_id` that slot is posted with now; the slot is then no longer
    /// posted. `None` for anything else (a made-up id, a repeat).
    #[inline]
    pub(super) fn claim(&mut self, wr_id: u64) -> Option<u32> {
        let slot = srq_slot(wr_id);
        let posted = self.posted_ids.get_mut(slot as usize)?;
        if *posted != wr_id || wr_id <= STRANDED {
            return None;
        }
        *posted = 0;
        self.available = self.available.saturating_sub(1);
        Some(slot)
    }

    /// A slot consumed by a QP the reactor does not serve: straight back
    /// (a refused post is noted for the pass's flush to log, as a storm of
    /// such completions against a refusing SRQ must not log per slot).
    #[cold]
    pub(super) fn reclaim(&mut self, slot: u32) {
        self.reclaimed += 1;
        self.give_back_noting(slot);
    }

    /// Queues SRQ slot `slot` (claimed or held, not posted) to be posted
    /// again with a fresh tag; posts when a batch fills. If a full batch
    /// cannot be posted, the slot waits in `stranded` for the next flush
    /// (and the error is returned): a slot is never dropped. A slot that is
    /// not consumed (posted, queued or stranded already) is refused: it
    /// would be posted twice, two receives landing in one buffer, one of
    /// them maybe under a handler's view of the bytes.
    #[inline]
    pub(super) fn give_back(&mut self, slot: u32) -> Result<()> {
        match self.posted_ids.get(slot as usize) {
            Some(0) => {}
            Some(_) => {
                refuse_give_back(slot);
                return Ok(());
            }
            None => return Ok(()),
        }
        if self.returning.is_full()
            && let Err(err) = self.post_returning()
        {
            // Only after a failed post: the batch keeps what did not go in.
            self.strand(slot);
            return Err(err);
        }
        self.queue(slot);
        if self.returning.is_full() {
            self.post_returning()?;
        }
        Ok(())
    }

    /// As [`give_back`](Self::give_back), where slots may come back by the
    /// thousand (a connection returning its share, completions of QPs gone):
    /// a refused post is noted, and logged once with a count by the pass's
    /// [`flush`](Self::flush) (the slot is kept either way).
    #[inline]
    pub(super) fn give_back_noting(&mut self, slot: u32) {
        if let Err(err) = self.give_back(slot) {
            match &mut self.refusals {
                Some((_, more)) => *more += 1,
                None => self.refusals = Some((err, 0)),
            }
        }
    }

    /// Puts `slot` (consumed, or stranded) in the batch with a fresh tag
    /// (the batch has room).
    #[inline]
    fn queue(&mut self, slot: u32) {
        // `give_back` refused a slot posted already; a stranded one comes
        // here once, from `unstrand`.
        let posted = self.posted_ids[slot as usize];
        if posted > STRANDED {
            refuse_give_back(slot);
            return;
        }
        self.posts = self.posts.wrapping_add(1);
        // Never 0, which marks a slot that is not posted.
        let tag = self.tag_key.hash_one((slot, self.posts)) | 1;
        let wr_id = srq_recv_wr_id(slot, tag);
        // SAFETY: the SRQ keeps the ring's registration until it is
        // destroyed (`keep_registered`, in `new`), after every QP that
        // receives from it; a slot given back is read by no one.
        let request = unsafe { recv_request(self.shared.ring, self.slot_size, wr_id, slot) };
        let _ = self.returning.push(request);
        self.available += 1;
        self.posted_ids[slot as usize] = wr_id;
    }

    /// Posts the batch of slots given back with one `ibv_post_srq_recv`
    /// and drops what went in; on a partial post the rest stay, to post
    /// again.
    #[inline]
    fn post_returning(&mut self) -> Result<()> {
        let posted = self.srq.post_recv(&mut self.returning);
        self.returning.drop_posted(&posted);
        posted
    }

    #[cold]
    fn strand(&mut self, slot: u32) {
        // Each slot is stranded once before it is posted again (a
        // stranded one given back is refused), so the room reserved for
        // every slot suffices.
        if self.stranded.len() < self.stranded.capacity() {
            self.stranded.push(slot);
            self.posted_ids[slot as usize] = STRANDED;
        }
    }

    /// True while slots given back wait to be posted (a failed post left
    /// them in the batch or stranded): the next pass must come soon.
    #[inline]
    pub(super) fn has_unposted(&self) -> bool {
        !self.returning.is_empty() || !self.stranded.is_empty()
    }

    /// Posts the slots given back in this pass (and any a failed post
    /// stranded before).
    #[inline]
    pub(super) fn flush(&mut self) -> Result<()> {
        if let Some((err, more)) = self.refusals.take() {
            log::error!(
                "reposting SRQ receives: {err} (and {more} more refusals since the last flush)"
            );
        }
        self.post_returning()?;
        if !self.stranded.is_empty() {
            self.unstrand()?;
        }
        Ok(())
    }

    #[cold]
    fn unstrand(&mut self) -> Result<()> {
        while let Some(slot) = self.stranded.pop() {
            if self.returning.is_full() {
                self.stranded.push(slot);
                self.post_returning()?;
                continue;
            }
            self.queue(slot);
        }
        self.post_returning()
    }
}

/// An SRQ slot given back while posted, queued or stranded: refused, so it
/// is not posted twice. No path of the reactor does it; one that did is a
/// bug, logged here.
#[cold]
#[inline(never)]
fn refuse_give_back(slot: u32) {
    log::error!("SRQ slot {slot} given back while posted or waiting to be: not posted twice");
}

#[cfg(test)]
impl SrqPool {
    /// The SRQ, for tests that make the device refuse its posts.
    pub(crate) fn srq(&self) -> &SharedReceiveQueue {
        &self.srq
    }

    /// The slots posted on the SRQ now, as the device holds them, oldest
    /// first; each must be posted with the `wr_id` the pool gave it.
    #[track_caller]
    pub(crate) fn on_device(&self) -> Vec<u32> {
        crate::verbs::srq_posted_wr_ids(&self.srq)
            .into_iter()
            .map(|wr_id| {
                let slot = srq_slot(wr_id);
                assert_eq!(
                    self.posted_ids.get(slot as usize),
                    Some(&wr_id),
                    "the device holds slot {slot} under an id the pool did not post it with"
                );
                slot
            })
            .collect()
    }

    /// The slots queued in the pool's batch (to be posted with this pass)
    /// and those stranded by a failed post (to be posted by a later one).
    pub(crate) fn unposted(&self) -> (Vec<u32>, Vec<u32>) {
        let queued = self
            .returning
            .requests
            .iter()
            .map(|request| srq_slot(request.wr_id()))
            .collect();
        (queued, self.stranded.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verbs::{Context, QpConfig, WorkCompletion, WorkRequest, refuse_srq_recvs_after};

    /// Every slot of `pool` given back with `give`, each exactly once
    /// (whatever the order), once the pool's batch and stranded slots are
    /// posted.
    #[track_caller]
    fn assert_posted_once(pool: &mut SrqPool, slots: u32) {
        pool.flush().expect("the pool's posts");
        let mut on_device = pool.on_device();
        on_device.sort_unstable();
        assert_eq!(on_device, (0..slots).collect::<Vec<_>>(), "each once");
        assert_eq!(pool.available, slots);
    }

    #[test]
    fn a_slot_given_back_while_posted_queued_or_stranded_is_refused() {
        // SAFETY: every QP of the device is served from this thread.
        let ctx = unsafe { Context::loopback() };
        let pd = ctx.alloc_pd().expect("a PD");
        // Two batches' worth, so a full batch whose post is refused
        // strands what comes after it.
        let slots = 2 * MAX_REPOST as u32;
        let config = ReactorConfig {
            srq_depth: slots,
            slot_size: 64,
            ..ReactorConfig::default()
        };
        let mut pool = SrqPool::new(&pd, &config).expect("an SRQ pool");
        assert_posted_once(&mut pool, slots);

        // Posted: refused.
        pool.give_back(3).expect("refused quietly");
        assert_eq!(pool.unposted(), (vec![], vec![]), "not queued again");
        assert_posted_once(&mut pool, slots);

        // Every slot consumed by a QP on the SRQ, and claimed.
        let mut cq = ctx.create_cq(2 * slots, None).expect("a CQ");
        let mut qp = pd
            .create_qp_with_srq(&cq, &cq, &pool.attachment(), &QpConfig::default())
            .expect("a QP on the SRQ");
        let peer_cq = ctx.create_cq(16, None).expect("a CQ");
        let mut peer = pd
            .create_qp(&peer_cq, &peer_cq, &QpConfig::default())
            .expect("its peer");
        let (to_qp, to_peer) = (qp.endpoint(), peer.endpoint());
        qp.connect(&to_peer).expect("connect");
        peer.connect(&to_qp).expect("connect");
        for _ in 0..slots {
            peer.post_send(&mut WorkRequest::send_inline(0, b"x"))
                .expect("a SEND");
        }
        let mut wcs = [WorkCompletion::default(); 32];
        let mut claimed = 0;
        while claimed < slots {
            let polled = cq.poll(&mut wcs).expect("a poll");
            assert!(!polled.is_empty(), "{claimed} of {slots} consumed");
            for wc in polled {
                assert!(pool.claim(wc.wr_id()).is_some(), "a slot of ours");
                assert!(pool.claim(wc.wr_id()).is_none(), "claimed once");
                claimed += 1;
            }
        }
        assert_eq!(pool.available, 0);

        // Queued: given back twice, queued once.
        pool.give_back(0).expect("queued");
        pool.give_back(0).expect("refused quietly");
        assert_eq!(pool.unposted(), (vec![0], vec![]));

        // Stranded: the batch fills (slots 0 to 63) and its post is
        // refused, then again when slot 64 comes: it is stranded. Given
        // back again, it is refused, as is slot 0, still in the batch.
        refuse_srq_recvs_after(pool.srq(), 0);
        refuse_srq_recvs_after(pool.srq(), 0);
        for slot in 1..MAX_REPOST as u32 {
            pool.give_back_noting(slot);
        }
        assert!(pool.give_back(64).is_err(), "the second refusal");
        pool.give_back(64).expect("refused quietly");
        pool.give_back(0).expect("refused quietly");
        let (queued, stranded) = pool.unposted();
        assert_eq!(queued, (0..MAX_REPOST as u32).collect::<Vec<_>>());
        assert_eq!(stranded, vec![64], "stranded once");

        // The rest, and everything twice more: each posted once.
        for slot in (0..slots).chain(0..slots) {
            pool.give_back_noting(slot);
        }
        assert_posted_once(&mut pool, slots);
        drop(qp);
    }
}
