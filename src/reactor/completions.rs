//! The reactor's completions: its CQs and their completion channels, the
//! buffers a pass and a spin poll them into, what spins left for the pass
//! (the spin loan's account), and the CQ entries promised to the
//! connections they serve. One place, so an
//! idle pass lends it whole to a spin ([`Ctx::spin`](super::Ctx::spin)).

use crate::error::{Error, Result};
use crate::session::CqSpread;
use crate::verbs::{
    CompletionChannel, CompletionQueue, Context, PollFailed, QueuePair, SharedCq, WorkCompletion,
};

use super::{EventMode, ReactorConfig, SessionId};

/// Completions polled per CQ per call.
pub(super) const POLL_BATCH: usize = 32;

/// Most CQ polls and completions of one pass's spins (each costs one):
/// the spin then ends, so the reactor's own work (the peer watch,
/// removals, a loop's timers) waits for about as long as this many empty
/// passes take. An empty poll costs tens of nanoseconds on a NIC, so a
/// spin lasts well under a millisecond there; ending and entering one
/// again costs about a pass. Only polls and completions count: a handler
/// that mostly waits on memory between polls (a WRITE ping-pong watching
/// for its answer's byte, polling the CQ only to reap a signaled WRITE)
/// holds a spin for that many of its own polls, however long its waits.
pub(crate) const SPIN_POLLS: u32 = 1 << 14;

/// The reactor's CQs and what is polled from them. See the module docs.
pub(super) struct Completions {
    // Drop order: the CQs, then the channels they report to.
    cqs: Vec<CompletionQueue>,
    /// Where the CQs report in the event modes: one for all (Blocking) or
    /// one each (Epoll); none when busy polling.
    channels: Vec<CompletionChannel>,
    /// Where a pass polls.
    wcs: [WorkCompletion; POLL_BATCH],
    /// Where spins poll: no pass polls over what one left.
    spin_wcs: [WorkCompletion; POLL_BATCH],
    spun: SpinState,
    /// CQ entries promised to connections (and the SRQ), by CQ.
    load: Vec<u32>,
    /// Of `load`, the entries of QPs removed when `retired_at` passes had
    /// polled every CQ: what those QPs left on the CQs is polled by the
    /// next pass, and until it is, a newcomer may not count on their room.
    retired: Vec<u32>,
    retired_at: u64,
    /// Handed out so far round-robin: the next QP spec takes CQ
    /// `next % cqs.len()`.
    next: usize,
    /// What spins spent (a CQ poll or a completion each) since
    /// [`take_spin_polls`](Self::take_spin_polls) last asked.
    spin_polls: u32,
    /// The CQs were armed and the events of the channels not consumed
    /// since: a caller's own loop that slept on the reactor's descriptor
    /// leaves them for the next pass it asks for.
    armed: bool,
}

/// What spins left for the reactor, read after the idle callbacks.
#[derive(Debug, Default)]
struct SpinState {
    /// Completions a spin polled and did not hand over:
    /// `spin_wcs[next..end]`, for the reactor to route in order.
    next: usize,
    end: usize,
    /// Completions spins polled: those not left (`next..end`) were
    /// handed over.
    polled: usize,
    /// CQ polls and completions polled of this pass's spins: together at
    /// most [`SPIN_POLLS`]. A spin takes what is left when it is lent and
    /// gives back what it did not use when it is dropped (so one that is
    /// forgotten keeps it).
    used: u32,
    /// A CQ poll of a spin failed: the pass reports it.
    failed: Option<Error>,
    /// The session whose `on_idle` runs: it may spin on its own
    /// connections only.
    session: Option<SessionId>,
}

/// What the spins of a pass left, once settled: the completions they did
/// not hand over wait at the front of the pass's buffer.
#[derive(Debug)]
pub(super) struct SpinsSettled {
    /// Completions waiting in the pass's buffer (`wc(0..left)`).
    pub(super) left: usize,
    /// Completions spins handed their handlers.
    pub(super) taken: usize,
    /// CQ polls and completions the spins spent.
    pub(super) used: u32,
    /// The error of a CQ poll a spin made.
    pub(super) failed: Option<Error>,
}

impl Completions {
    /// Creates `config.cq_count` CQs (at least one) of `config.cq_size`,
    /// and in the event modes the completion channels they report to.
    /// Every CQ keeps room for the whole SRQ's completions.
    pub(super) fn open(ctx: &Context, config: &ReactorConfig) -> Result<Self> {
        let cq_count = config.cq_count.max(1) as usize;
        let channels: Vec<CompletionChannel> = match config.event_mode {
            EventMode::BusyPoll => Vec::new(),
            EventMode::Blocking => vec![ctx.create_comp_channel()?],
            EventMode::Epoll => (0..cq_count)
                .map(|_| ctx.create_comp_channel())
                .collect::<Result<_>>()?,
        };
        let cqs = (0..cq_count)
            .map(|i| ctx.create_cq(config.cq_size, channels.get(i).or(channels.first())))
            .collect::<Result<Vec<_>>>()?;
        if cqs.iter().any(|cq| cq.capacity() < config.srq_depth) {
            return Err(Error::InvalidArgument(
                "every CQ must hold the whole SRQ's completions: raise cq_size to srq_depth or more",
            ));
        }
        Ok(Self {
            load: vec![config.srq_depth; cqs.len()],
            retired: vec![0; cqs.len()],
            retired_at: 0,
            cqs,
            channels,
            wcs: [WorkCompletion::default(); POLL_BATCH],
            spin_wcs: [WorkCompletion::default(); POLL_BATCH],
            spun: SpinState::default(),
            next: 0,
            spin_polls: 0,
            armed: false,
        })
    }

    /// The completion channels, for the waiter to watch.
    pub(super) fn channels(&self) -> &[CompletionChannel] {
        &self.channels
    }

    /// Consumes the completion events that woke a wait (acked in batches).
    pub(super) fn drain_events(&mut self) -> Result<()> {
        self.armed = false;
        for channel in &self.channels {
            while channel.try_get_event()?.is_some() {}
        }
        Ok(())
    }

    /// Whether the CQs were armed and their events not consumed since.
    #[inline(always)]
    pub(super) fn is_armed(&self) -> bool {
        self.armed
    }

    /// How many CQs there are.
    #[inline(always)]
    pub(super) fn cq_count(&self) -> usize {
        self.cqs.len()
    }

    /// Polls CQ `cq` into the pass's buffer; returns how many it found
    /// (`wc(0..n)`), [`POLL_BATCH`] at most.
    #[inline(always)]
    pub(super) fn poll(&mut self, cq: usize) -> Result<usize> {
        Ok(self.cqs[cq].poll(&mut self.wcs)?.len())
    }

    /// Completion `at` of the pass's buffer.
    #[inline(always)]
    pub(super) fn wc(&self, at: usize) -> &WorkCompletion {
        &self.wcs[at]
    }

    /// Arms every CQ: its channel gets an event for the next completion.
    pub(super) fn arm(&mut self) -> Result<()> {
        self.armed = true;
        for cq in &mut self.cqs {
            cq.req_notify(false)?;
        }
        Ok(())
    }

    /// The CQ the next QP spec takes, round-robin.
    pub(super) fn next_shared(&mut self) -> SharedCq {
        let cq = self.cqs[self.next % self.cqs.len()].shared();
        self.next += 1;
        cq
    }

    /// The CQ the next QP takes, round-robin with the specs', and its index.
    pub(super) fn next_cq(&mut self) -> (usize, SharedCq) {
        let index = self.next % self.cqs.len();
        (index, self.next_shared())
    }

    /// Every CQ, for a server to hand its peers in turn; `None` with one CQ.
    pub(super) fn spread(&self) -> Option<CqSpread> {
        (self.cqs.len() > 1)
            .then(|| CqSpread::new(self.cqs.iter().map(CompletionQueue::shared).collect()))
            .flatten()
    }

    /// The indexes of `qp`'s send and receive CQs, if both are ours (by
    /// identity: CQ ids repeat across device contexts).
    pub(super) fn cqs_of(&self, qp: &QueuePair) -> Option<(usize, usize)> {
        let send = self.cqs.iter().position(|cq| qp.sends_to(cq))?;
        let recv = self.cqs.iter().position(|cq| qp.receives_to(cq))?;
        Some((send, recv))
    }

    /// Whether the CQs have room for `charges` (entries by CQ index) on
    /// top of what they promised already.
    pub(super) fn can_absorb(&self, charges: &[(usize, u32)]) -> bool {
        charges
            .iter()
            .all(|&(cq, entries)| self.load[cq].saturating_add(entries) <= self.cqs[cq].capacity())
    }

    /// Promises `charges` (entries by CQ index, checked with
    /// [`can_absorb`](Self::can_absorb)).
    pub(super) fn charge(&mut self, charges: &[(usize, u32)]) {
        for &(cq, entries) in charges {
            self.load[cq] += entries;
        }
    }

    /// Takes back what [`charge`](Self::charge) promised to a QP removed
    /// when `passes` passes had polled every CQ: the room comes free once
    /// a later pass has ([`release_retired`](Self::release_retired)).
    pub(super) fn discharge(&mut self, charges: &[(usize, u32)], passes: u64) {
        self.release_retired(passes);
        for &(cq, entries) in charges {
            let entries = entries.min(self.load[cq] - self.retired[cq]);
            self.retired[cq] += entries;
        }
        self.retired_at = passes;
    }

    /// Frees the room of the QPs removed before the last of `passes`
    /// passes (those that polled every CQ so far) began: whatever they
    /// left on the CQs is gone.
    pub(super) fn release_retired(&mut self, passes: u64) {
        if passes > self.retired_at {
            for (load, retired) in self.load.iter_mut().zip(&mut self.retired) {
                *load -= std::mem::take(retired);
            }
        }
    }

    /// Whether spins spent anything this pass (the pass then settles them).
    #[inline(always)]
    pub(super) fn has_spun(&self) -> bool {
        self.spun.used != 0
    }

    /// Before the idle callbacks lend the CQs: what spins polled in a pass
    /// an idle callback panicked out of (a caller may catch that and go
    /// on) is dropped, as a panic drops the rest of a pass's batch: told
    /// late, it would come after what passes polled since, and might name
    /// a connection removed since.
    #[inline(always)]
    pub(super) fn begin_loans(&mut self) {
        if self.spun.used != 0 {
            self.spun = SpinState::default();
        }
    }

    /// The CQs are lent to `session`'s `on_idle` next.
    #[inline(always)]
    pub(super) fn lend_to(&mut self, session: SessionId) {
        self.spun.session = Some(session);
    }

    /// The session whose `on_idle` the CQs are lent to.
    pub(super) fn lent_to(&self) -> Option<SessionId> {
        self.spun.session
    }

    /// What a new spin may spend: what this pass's spins left of
    /// [`SPIN_POLLS`], or nothing while an earlier spin's completions
    /// wait for the reactor.
    pub(super) fn spin_budget(&self) -> u32 {
        if self.spun.next < self.spun.end {
            return 0;
        }
        SPIN_POLLS.saturating_sub(self.spun.used)
    }

    /// A spin takes `budget` (of [`spin_budget`](Self::spin_budget)) whole;
    /// it gives back what it did not use when it is dropped
    /// ([`spin_returned`](Self::spin_returned)).
    pub(super) fn take_budget(&mut self, budget: u32) {
        self.spun.used += budget;
    }

    /// Polls CQ `cq` into the spins' buffer (`spin_wc(0..n)`).
    #[inline(always)]
    pub(super) fn spin_poll(&mut self, cq: usize) -> std::result::Result<usize, PollFailed> {
        self.cqs[cq].poll_count(&mut self.spin_wcs[..])
    }

    /// A spin's poll of CQ `cq` failed: the pass reports the first such
    /// error.
    #[cold]
    pub(super) fn spin_poll_failed(&mut self, cq: usize, failed: PollFailed) {
        let error = self.cqs[cq].poll_error(failed);
        self.spun.failed.get_or_insert(error);
    }

    /// Completion `at` of the spins' buffer.
    #[inline(always)]
    pub(super) fn spin_wc(&self, at: usize) -> &WorkCompletion {
        &self.spin_wcs[at]
    }

    /// A spin polled `spin_wc(0..n)`: all of them are the reactor's to
    /// route until the spin hands them over.
    #[inline(always)]
    pub(super) fn spin_polled(&mut self, n: usize) {
        self.spun.next = 0;
        self.spun.end = n;
        self.spun.polled += n;
    }

    /// A spin handed `spin_wc(..next)` over: the rest of its batch is
    /// still the reactor's.
    #[inline(always)]
    pub(super) fn spin_handed(&mut self, next: usize) {
        self.spun.next = next;
    }

    /// A spin was dropped: it gives back `unused` of its budget (what it
    /// left the reactor, `spin_handed` and `spin_polled` told already).
    #[inline(always)]
    pub(super) fn spin_returned(&mut self, unused: u32) {
        self.spun.used -= unused;
    }

    /// What spins spent since the last call (see
    /// [`Reactor::take_spin_polls`](super::Reactor::take_spin_polls)).
    pub(super) fn take_spin_polls(&mut self) -> u32 {
        std::mem::take(&mut self.spin_polls)
    }

    /// After the idle callbacks: the completions spins polled and did not
    /// hand over move to the front of the pass's buffer (which holds
    /// nothing then: the pass polled nothing), for the pass to route in
    /// order; what they spent is tallied for
    /// [`take_spin_polls`](Self::take_spin_polls), and the spins' account
    /// starts anew.
    pub(super) fn settle_spins(&mut self) -> SpinsSettled {
        let SpinState {
            next,
            end,
            polled,
            used,
            failed,
            ..
        } = std::mem::take(&mut self.spun);
        let left = end - next;
        let taken = polled - left;
        self.wcs[..left].copy_from_slice(&self.spin_wcs[next..end]);
        self.spin_polls = self.spin_polls.saturating_add(used);
        SpinsSettled {
            left,
            taken,
            used,
            failed,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verbs::{AccessFlags, ProtectionDomain, QpConfig, RecvRequest, WorkRequest};

    fn config(cq_count: u32, cq_size: u32, srq_depth: u32) -> ReactorConfig {
        ReactorConfig {
            cq_count,
            cq_size,
            srq_depth,
            ..ReactorConfig::default()
        }
    }

    fn qp_on(pd: &ProtectionDomain, send: &SharedCq, recv: &SharedCq) -> QueuePair {
        pd.create_qp(send, recv, &QpConfig::default())
            .expect("a loopback QP")
    }

    #[test]
    fn specs_take_the_cqs_in_turn_and_find_their_indexes() {
        // SAFETY: every QP of the device is used from this thread.
        let ctx = unsafe { Context::loopback() };
        let pd = ctx.alloc_pd().expect("a PD");
        let mut completions = Completions::open(&ctx, &config(3, 64, 0)).expect("CQs");
        assert_eq!(completions.cq_count(), 3);
        let cqs: Vec<SharedCq> = (0..4).map(|_| completions.next_shared()).collect();
        for (turn, cq) in cqs.iter().enumerate() {
            let qp = qp_on(&pd, cq, cq);
            assert_eq!(completions.cqs_of(&qp), Some((turn % 3, turn % 3)));
        }
        let split = qp_on(&pd, &cqs[1], &cqs[2]);
        assert_eq!(completions.cqs_of(&split), Some((1, 2)));
        assert!(completions.spread().is_some());
        let one = Completions::open(&ctx, &config(1, 64, 0)).expect("a CQ");
        assert!(one.spread().is_none(), "one CQ needs no spread");
        // A CQ of another owner is none of ours.
        let stranger = ctx.create_cq(16, None).expect("a CQ");
        let qp = qp_on(&pd, &stranger.shared(), &cqs[0]);
        assert_eq!(completions.cqs_of(&qp), None);
    }

    #[test]
    fn charges_stay_within_each_cqs_capacity_and_the_srq_is_reserved() {
        // SAFETY: as above.
        let ctx = unsafe { Context::loopback() };
        let refused = Completions::open(&ctx, &config(1, 16, 1 << 20));
        assert!(matches!(refused, Err(Error::InvalidArgument(_))));
        let srq = 8;
        let mut completions = Completions::open(&ctx, &config(2, 64, srq)).expect("CQs");
        let room = completions.cqs[0].capacity() - srq;
        assert!(completions.can_absorb(&[(0, room), (1, room)]));
        assert!(!completions.can_absorb(&[(0, room + 1)]));
        completions.charge(&[(0, room)]);
        assert!(!completions.can_absorb(&[(0, 1)]));
        assert!(
            completions.can_absorb(&[(1, room)]),
            "CQs are charged apart"
        );
        // Removed during pass 7: the room is held until a later pass polled.
        completions.discharge(&[(0, room)], 7);
        assert!(!completions.can_absorb(&[(0, 1)]));
        completions.release_retired(7);
        assert!(
            !completions.can_absorb(&[(0, 1)]),
            "pass 7 may not have polled it"
        );
        completions.release_retired(8);
        assert!(completions.can_absorb(&[(0, room)]));
        // Taking back more than was promised saturates.
        completions.discharge(&[(1, u32::MAX)], 8);
        completions.release_retired(9);
        assert!(completions.can_absorb(&[(1, completions.cqs[1].capacity())]));
    }

    /// A connected pair of QPs on CQ 0 with a receive posted on `b`, and
    /// a signaled inline SEND from `a` to it: two completions on the
    /// loopback device, which completes them as they are posted.
    fn two_completions(ctx: &Context, completions: &mut Completions) -> [QueuePair; 2] {
        let pd = ctx.alloc_pd().expect("a PD");
        let cq = completions.next_shared();
        let (mut a, mut b) = (qp_on(&pd, &cq, &cq), qp_on(&pd, &cq, &cq));
        let (to_a, to_b) = (a.endpoint(), b.endpoint());
        a.connect(&to_b).expect("connect");
        b.connect(&to_a).expect("connect");
        let mr = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).expect("a region");
        let mut recv = RecvRequest::new(7, mr.slice(0, 8).expect("a slice")).expect("a receive");
        b.post_recv(&mut recv).expect("posted");
        a.post_send(&mut WorkRequest::send_inline(1, b"x").signaled())
            .expect("posted");
        [a, b]
    }

    #[test]
    fn a_pass_polls_into_its_buffer() {
        // SAFETY: as above.
        let ctx = unsafe { Context::loopback() };
        let mut completions = Completions::open(&ctx, &config(1, 64, 0)).expect("a CQ");
        assert_eq!(completions.poll(0).expect("a poll"), 0);
        let _qps = two_completions(&ctx, &mut completions);
        assert_eq!(completions.poll(0).expect("a poll"), 2);
        let mut ids = [completions.wc(0).wr_id(), completions.wc(1).wr_id()];
        ids.sort_unstable();
        assert_eq!(ids, [1, 7]);
        assert_eq!(completions.poll(0).expect("a poll"), 0);
    }

    #[test]
    fn a_spin_takes_the_budget_and_leaves_the_pass_what_it_did_not_hand_over() {
        // SAFETY: as above.
        let ctx = unsafe { Context::loopback() };
        let mut completions = Completions::open(&ctx, &config(1, 64, 0)).expect("a CQ");
        let _qps = two_completions(&ctx, &mut completions);
        let session = SessionId(crate::reactor::slab_key_for_tests(3).0);
        completions.begin_loans();
        completions.lend_to(session);
        assert_eq!(completions.lent_to(), Some(session));
        assert!(!completions.has_spun());
        let budget = completions.spin_budget();
        assert_eq!(budget, SPIN_POLLS);
        completions.take_budget(budget);
        assert_eq!(completions.spin_budget(), 0, "one pass's spins share it");
        assert_eq!(completions.spin_poll(0), Ok(2));
        let first = completions.spin_wc(0).wr_id();
        // The spin hands over the first, ends at the second, and gives
        // back all but the poll and the two completions.
        completions.spin_polled(2);
        completions.spin_handed(1);
        completions.spin_returned(budget - 3);
        assert!(completions.has_spun());
        assert_eq!(completions.spin_budget(), 0, "a completion waits");
        let settled = completions.settle_spins();
        assert_eq!((settled.left, settled.taken, settled.used), (1, 1, 3));
        assert!(settled.failed.is_none());
        let second = completions.wc(0).wr_id();
        let mut ids = [first, second];
        ids.sort_unstable();
        assert_eq!(ids, [1, 7]);
        // Settled: the next pass's spins start anew.
        assert!(!completions.has_spun());
        assert_eq!(completions.lent_to(), None);
        assert_eq!(completions.spin_budget(), SPIN_POLLS);
        assert_eq!(completions.take_spin_polls(), 3, "tallied");
        assert_eq!(completions.take_spin_polls(), 0);
    }

    #[test]
    fn lending_again_drops_what_an_unsettled_spin_left() {
        // SAFETY: as above.
        let ctx = unsafe { Context::loopback() };
        let mut completions = Completions::open(&ctx, &config(1, 64, 0)).expect("a CQ");
        completions.take_budget(SPIN_POLLS);
        completions.spin_polled(1);
        completions.spin_returned(SPIN_POLLS - 1);
        assert!(completions.has_spun());
        completions.begin_loans();
        assert!(!completions.has_spun());
        assert_eq!(completions.spin_budget(), SPIN_POLLS);
    }
}
