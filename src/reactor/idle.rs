//! The reactor's idle policy: what the passes' history says about the work
//! a flush left behind, when an idle pass does that work (receives below a
//! repost batch, unsignaled tails), and when traffic counts as sparse, so a
//! flush signals what it posts instead of leaving a tail that the
//! idle-time flush would signal out with a credit update (a SEND the peer
//! must receive, on a receive of its own).
//!
//! The pass reports events (a pass found completions or none, a flush
//! began or ended, the CQs were armed for a sleep, work was left for the
//! next flush) and asks for decisions (whether a pass has chores, whether
//! to repost or signal tails now, how sparse traffic is): the rules live
//! here, as code, and nothing here touches a device.

/// Empty busy-poll passes after which unsignaled tails are signaled out.
pub(super) const TAIL_SIGNAL_IDLE_PASSES: u32 = 1024;
/// Empty busy-poll passes after which receives consumed since the last
/// batch are reposted anyway. Not on the first empty pass: in a ping-pong
/// the next message usually lands then, and a pass that is busy posting
/// receives finds it later.
pub(super) const REPOST_IDLE_PASSES: u32 = 8;

/// When the reactor's passes do their idle-time work, and whether traffic
/// is sparse. See the module docs.
#[derive(Debug)]
pub(super) struct IdlePolicy {
    /// Empty passes since the last completion. Arming the CQs to sleep
    /// counts as [`TAIL_SIGNAL_IDLE_PASSES`] of them (so an empty pass
    /// after a wake without a completion does the idle-time work at once;
    /// the arming's own flush left little).
    idle_passes: u32,
    /// The reactor is in a quiet spell, or the last pass with completions
    /// ended one: traffic is sparse, so each flush signals its
    /// connections' last request (a local completion).
    after_quiet: bool,
    /// Quiet spells so far (wrapping): counted when an idle pass reaches
    /// the tail-signaling point and when the CQs are armed for a sleep.
    /// Beside `after_quiet`, traffic on a connection also counts as sparse
    /// after a spell until it posts while `after_quiet` is false (see
    /// [`Spell::is_sparse`]): the pass that ends a spell may bring only a
    /// request's own send completion (on a NIC), or another connection's
    /// message, and the message a handler answers, with the answer, come
    /// passes later. (The per-connection test alone covers `after_quiet`'s
    /// reach too, except once the count has wrapped round to a
    /// connection's mark: the flush asks both, so nothing is signaled
    /// less than under `after_quiet` alone.)
    quiet_spells: u32,
    /// The last flush left work behind that any pass must do (or work was
    /// staged, or sessions changed, since).
    unsettled: bool,
    /// The last flush left receives to repost once the reactor goes idle.
    reposts_left: bool,
    /// The last flush left an unsignaled tail to signal out when idle.
    tails_left: bool,
}

impl Default for IdlePolicy {
    /// A new reactor: not idle, not quiet, and with a flush owed (the
    /// initial credit updates of the first sessions).
    fn default() -> Self {
        Self {
            idle_passes: 0,
            after_quiet: false,
            quiet_spells: 0,
            unsettled: true,
            reposts_left: false,
            tails_left: false,
        }
    }
}

impl IdlePolicy {
    /// A pass found completions: the reactor is not idle. Traffic stays
    /// sparse through this pass's flush if it ends a quiet spell.
    #[inline(always)]
    pub(super) fn found_completions(&mut self) {
        self.after_quiet = self.idle_passes >= TAIL_SIGNAL_IDLE_PASSES;
        self.idle_passes = 0;
    }

    /// A pass found nothing. The pass that reaches the tail-signaling
    /// point begins a quiet spell; only a pass with completions ends it,
    /// and counts idle passes from 0 again, so a spell is counted once.
    #[inline(always)]
    pub(super) fn found_none(&mut self) {
        self.idle_passes = self.idle_passes.saturating_add(1);
        if self.idle_passes == TAIL_SIGNAL_IDLE_PASSES {
            self.quiet_begins();
        }
    }

    /// The CQs were armed for a sleep: a reactor about to sleep is quiet,
    /// a spell of its own, so what each connection posts after it is
    /// signaled, not left as a tail for the next arming to signal out with
    /// a credit update. The next empty pass does the idle-time work at once.
    pub(super) fn armed_for_sleep(&mut self) {
        self.idle_passes = self.idle_passes.max(TAIL_SIGNAL_IDLE_PASSES);
        self.quiet_begins();
    }

    fn quiet_begins(&mut self) {
        self.after_quiet = true;
        self.quiet_spells = self.quiet_spells.wrapping_add(1);
    }

    /// Something left work that the next flush must do on any pass, idle
    /// or not: a callback staged work, a connection failed and gave
    /// receive slots back, a slot went back to the SRQ's batch, a post
    /// was refused.
    #[inline(always)]
    pub(super) fn work_left(&mut self) {
        self.unsettled = true;
    }

    /// A session was added (its initial credit updates wait for the next
    /// flush) or removed (what it held goes back with the next flush).
    pub(super) fn sessions_changed(&mut self) {
        self.work_left();
    }

    /// A connection was parked with receives below a repost batch (a
    /// forward gave its slot back): the idle-time flush reposts them.
    #[inline(always)]
    pub(super) fn reposts_parked(&mut self) {
        self.reposts_left = true;
    }

    /// A flush begins: it does the work any pass must do, so none is owed
    /// until something (the flush itself included) leaves some again.
    #[inline(always)]
    pub(super) fn flush_begins(&mut self) {
        self.unsettled = false;
    }

    /// An idle-time flush (reposting or signaling tails) begins its walk:
    /// it visits every parked connection and says anew what is left.
    /// Cleared before the walk, not overwritten after it: a connection
    /// parked during the walk keeps its flag.
    #[inline(always)]
    pub(super) fn idle_flush_begins(&mut self) {
        self.reposts_left = false;
        self.tails_left = false;
    }

    /// A flush ended, leaving `left` behind. Connections parked before
    /// keep what they had pending: only an idle-time flush, which visits
    /// them all, clears that ([`idle_flush_begins`](Self::idle_flush_begins)).
    #[inline(always)]
    pub(super) fn flush_ended(&mut self, left: Leftovers) {
        self.unsettled |= left.unsettled;
        self.reposts_left |= left.reposts;
        self.tails_left |= left.tails;
    }

    /// Whether a flush owes work any pass must do.
    #[inline(always)]
    pub(super) fn is_unsettled(&self) -> bool {
        self.unsettled
    }

    /// Whether the pass's flush reposts every pending receive now, below a
    /// batch too: receives are waiting and the reactor has been idle for
    /// [`REPOST_IDLE_PASSES`].
    #[inline(always)]
    pub(super) fn repost_now(&self) -> bool {
        self.reposts_left && self.idle_passes >= REPOST_IDLE_PASSES
    }

    /// Whether the reactor has been idle long enough for receives waiting
    /// for a fuller batch to go back now ([`REPOST_IDLE_PASSES`]), whoever
    /// holds them: the datagram endpoints ask this.
    #[inline(always)]
    pub(super) fn idle_for_reposts(&self) -> bool {
        self.idle_passes >= REPOST_IDLE_PASSES
    }

    /// Whether the pass's flush signals out unsignaled tails now (which
    /// would otherwise never report completion): a tail is waiting and the
    /// reactor has been idle for [`TAIL_SIGNAL_IDLE_PASSES`]. Asked again
    /// every idle pass from then on: the signal may have to wait for a
    /// credit.
    #[inline(always)]
    pub(super) fn signal_tails_now(&self) -> bool {
        self.tails_left && self.idle_passes >= TAIL_SIGNAL_IDLE_PASSES
    }

    /// Whether a pass owes a flush for what the idle policy knows of:
    /// work any pass must do, or idle-time work that is due.
    #[inline(always)]
    pub(super) fn owes_flush(&self) -> bool {
        self.unsettled || self.repost_now() || self.signal_tails_now()
    }

    /// What a flush needs to tell sparse traffic from busy traffic, per
    /// connection.
    #[inline(always)]
    pub(super) fn spell(&self) -> Spell {
        Spell {
            count: self.quiet_spells,
            after_quiet: self.after_quiet,
        }
    }

    /// Empty passes since the last completion (for tests that stop a pass
    /// short of the idle-time work).
    #[cfg(test)]
    pub(super) fn idle_passes(&self) -> u32 {
        self.idle_passes
    }
}

/// What the connections a flush walked still have pending, gathered
/// connection by connection and handed to [`IdlePolicy::flush_ended`].
#[derive(Debug, Default)]
pub(super) struct Leftovers {
    /// Work any pass must do.
    unsettled: bool,
    /// Receives waiting for a fuller repost batch.
    reposts: bool,
    /// Unsignaled requests at the tail of a burst.
    tails: bool,
}

impl Leftovers {
    /// Notes what one connection has left: work any pass must do, receives
    /// below a batch, an unsignaled tail.
    #[inline(always)]
    pub(super) fn note(&mut self, unsettled: bool, reposts: bool, tail: bool) {
        self.unsettled |= unsettled;
        self.reposts |= reposts;
        self.tails |= tail;
    }
}

/// The reactor's quiet spells as a flush sees them: whether a
/// connection's traffic is sparse, and the mark a doorbell on sparse
/// traffic leaves on it.
#[derive(Clone, Copy, Debug)]
pub(super) struct Spell {
    /// The count of quiet spells.
    count: u32,
    /// Within a spell, or from the pass ending it to the next pass with
    /// completions.
    after_quiet: bool,
}

impl Spell {
    /// Whether traffic on a connection marked `mark` counts as sparse, so
    /// the flush signals the last request it posts: the reactor is in or
    /// just out of a quiet spell, or the connection is new or has rung no
    /// doorbell on busy traffic since the reactor last counted a spell.
    #[inline(always)]
    pub(super) fn is_sparse(self, mark: SpellMark) -> bool {
        self.after_quiet | (mark.0 != self.count)
    }

    /// What a doorbell rung on sparse traffic marks its connection with:
    /// the count before the current one while `after_quiet` holds, so a
    /// request sent then (by a timer, say) leaves the answer to it, and
    /// what a handler posts on that, sparse; the current count after that,
    /// so the connection's traffic is busy until the next spell. (A
    /// connection with busy traffic is marked with the current count
    /// already.)
    #[inline(always)]
    pub(super) fn mark(self) -> SpellMark {
        SpellMark(self.count.wrapping_sub(u32::from(self.after_quiet)))
    }
}

/// A connection's mark of the quiet spell its last doorbell on sparse
/// traffic was rung in (see [`Spell::mark`]); only a [`Spell`] reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct SpellMark(u32);

impl SpellMark {
    /// A new connection's: unlike any count the reactor starts from, so
    /// its first post is signaled.
    pub(super) const NEW: Self = Self(u32::MAX);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn empty_passes(policy: &mut IdlePolicy, passes: u32) {
        for _ in 0..passes {
            policy.found_none();
        }
    }

    /// A policy whose flush owes nothing, as after a flush that left nothing.
    fn settled() -> IdlePolicy {
        let mut policy = IdlePolicy::default();
        policy.flush_begins();
        policy.flush_ended(Leftovers::default());
        policy
    }

    fn left(unsettled: bool, reposts: bool, tails: bool) -> Leftovers {
        let mut left = Leftovers::default();
        left.note(unsettled, reposts, tails);
        left
    }

    #[test]
    fn a_new_reactor_owes_a_flush_and_is_not_quiet() {
        let policy = IdlePolicy::default();
        assert!(policy.is_unsettled());
        assert!(policy.owes_flush());
        assert!(!policy.repost_now() && !policy.signal_tails_now());
        let spell = policy.spell();
        assert!(!spell.is_sparse(spell.mark()), "busy traffic after a mark");
        assert!(
            spell.is_sparse(SpellMark::NEW),
            "a new connection's is sparse"
        );
    }

    #[test]
    fn a_flush_settles_what_it_did_and_keeps_what_it_left() {
        let mut policy = IdlePolicy::default();
        policy.flush_begins();
        assert!(!policy.is_unsettled());
        policy.flush_ended(left(true, false, false));
        assert!(policy.is_unsettled() && policy.owes_flush());
        policy.flush_begins();
        policy.flush_ended(left(false, false, false));
        assert!(!policy.owes_flush());
    }

    #[test]
    fn work_left_and_sessions_changed_owe_a_flush() {
        let mut policy = settled();
        policy.work_left();
        assert!(policy.owes_flush());
        let mut policy = settled();
        policy.sessions_changed();
        assert!(policy.owes_flush());
    }

    #[test]
    fn reposts_wait_for_the_repost_idle_passes() {
        let mut policy = settled();
        policy.flush_begins();
        policy.flush_ended(left(false, true, false));
        empty_passes(&mut policy, REPOST_IDLE_PASSES - 1);
        assert!(!policy.repost_now() && !policy.owes_flush());
        policy.found_none();
        assert!(policy.repost_now() && policy.owes_flush());
        assert!(!policy.signal_tails_now(), "no tail was left");
        // A completion starts the count again.
        policy.found_completions();
        assert!(!policy.repost_now());
    }

    #[test]
    fn datagram_reposts_wait_for_the_same_idle_passes_whatever_the_connections_left() {
        let mut policy = settled();
        empty_passes(&mut policy, REPOST_IDLE_PASSES - 1);
        assert!(!policy.idle_for_reposts());
        policy.found_none();
        assert!(
            policy.idle_for_reposts() && !policy.repost_now(),
            "no connection left any"
        );
        policy.found_completions();
        assert!(!policy.idle_for_reposts());
    }

    #[test]
    fn a_parked_repost_waits_like_a_flushs() {
        let mut policy = settled();
        policy.reposts_parked();
        assert!(!policy.owes_flush());
        empty_passes(&mut policy, REPOST_IDLE_PASSES);
        assert!(policy.repost_now());
    }

    #[test]
    fn tails_wait_for_the_tail_signal_idle_passes() {
        let mut policy = settled();
        policy.flush_begins();
        policy.flush_ended(left(false, false, true));
        empty_passes(&mut policy, TAIL_SIGNAL_IDLE_PASSES - 1);
        assert!(!policy.signal_tails_now() && !policy.owes_flush());
        policy.found_none();
        assert!(policy.signal_tails_now() && policy.owes_flush());
        // Asked again on every idle pass until a flush signals them out.
        policy.found_none();
        assert!(policy.signal_tails_now());
        policy.flush_begins();
        policy.idle_flush_begins();
        policy.flush_ended(Leftovers::default());
        assert!(!policy.signal_tails_now() && !policy.owes_flush());
    }

    #[test]
    fn only_an_idle_flush_clears_what_parked_connections_have() {
        let mut policy = settled();
        policy.flush_begins();
        policy.flush_ended(left(false, true, true));
        // A flush of touched connections only: the parked ones keep theirs.
        policy.flush_begins();
        policy.flush_ended(Leftovers::default());
        empty_passes(&mut policy, TAIL_SIGNAL_IDLE_PASSES);
        assert!(policy.repost_now() && policy.signal_tails_now());
        // An idle flush that finds a tail still there keeps it.
        policy.flush_begins();
        policy.idle_flush_begins();
        policy.flush_ended(left(false, false, true));
        assert!(!policy.repost_now() && policy.signal_tails_now());
    }

    #[test]
    fn a_quiet_spell_begins_once_at_the_tail_signal_point() {
        let mut policy = settled();
        let before = policy.spell();
        empty_passes(&mut policy, TAIL_SIGNAL_IDLE_PASSES - 1);
        assert!(!policy.spell().after_quiet);
        policy.found_none();
        let spell = policy.spell();
        assert!(spell.after_quiet);
        assert_eq!(spell.count, before.count.wrapping_add(1));
        // More empty passes are the same spell.
        empty_passes(&mut policy, 3 * TAIL_SIGNAL_IDLE_PASSES);
        assert_eq!(policy.spell().count, spell.count);
        assert_eq!(policy.idle_passes(), 4 * TAIL_SIGNAL_IDLE_PASSES);
    }

    #[test]
    fn the_pass_ending_a_spell_keeps_traffic_sparse_and_the_next_does_not() {
        let mut policy = settled();
        empty_passes(&mut policy, TAIL_SIGNAL_IDLE_PASSES);
        policy.found_completions();
        assert!(policy.spell().after_quiet, "the pass ending the spell");
        policy.found_completions();
        assert!(!policy.spell().after_quiet, "busy again");
        // A pass with completions before the tail point leaves it busy.
        empty_passes(&mut policy, TAIL_SIGNAL_IDLE_PASSES - 1);
        policy.found_completions();
        assert!(!policy.spell().after_quiet);
    }

    #[test]
    fn arming_for_a_sleep_is_a_spell_and_makes_idle_work_due() {
        let mut policy = settled();
        policy.flush_begins();
        policy.flush_ended(left(false, true, true));
        let before = policy.spell().count;
        policy.armed_for_sleep();
        let spell = policy.spell();
        assert!(spell.after_quiet);
        assert_eq!(spell.count, before.wrapping_add(1));
        assert!(policy.repost_now() && policy.signal_tails_now());
        // Each arming counts one.
        policy.armed_for_sleep();
        assert_eq!(policy.spell().count, before.wrapping_add(2));
        // Idle passes after an arming do not count the spell again.
        empty_passes(&mut policy, TAIL_SIGNAL_IDLE_PASSES);
        assert_eq!(policy.spell().count, before.wrapping_add(2));
    }

    #[test]
    fn a_doorbell_on_sparse_traffic_marks_its_connection_until_busy_traffic() {
        let mut policy = settled();
        // Busy traffic: a connection marked with this count is busy.
        let busy = policy.spell();
        assert_eq!(busy.mark().0, busy.count);
        // A spell: every connection's traffic is sparse, and a doorbell
        // then marks the count before the spell's.
        empty_passes(&mut policy, TAIL_SIGNAL_IDLE_PASSES);
        let quiet = policy.spell();
        let mark = quiet.mark();
        assert!(quiet.is_sparse(mark));
        assert_eq!(mark, SpellMark(quiet.count.wrapping_sub(1)));
        // After the pass that ends the spell, that mark still reads sparse
        // (the answer to a request sent in the spell is signaled) ...
        policy.found_completions();
        policy.found_completions();
        let after = policy.spell();
        assert!(after.is_sparse(mark));
        // ... until the connection posts on busy traffic, marked with the
        // current count.
        let busy_mark = after.mark();
        assert!(!after.is_sparse(busy_mark));
        // The next spell makes it sparse again.
        policy.armed_for_sleep();
        policy.found_completions();
        policy.found_completions();
        assert!(policy.spell().is_sparse(busy_mark));
    }

    #[test]
    fn spell_counts_wrap() {
        let mut policy = settled();
        policy.quiet_spells = u32::MAX;
        policy.armed_for_sleep();
        let spell = policy.spell();
        assert_eq!(spell.count, 0);
        assert_eq!(spell.mark(), SpellMark(u32::MAX));
        assert!(spell.is_sparse(SpellMark::NEW), "after_quiet holds");
    }

    #[test]
    fn idle_passes_saturate() {
        let mut policy = settled();
        policy.idle_passes = u32::MAX - 1;
        policy.found_none();
        policy.found_none();
        assert_eq!(policy.idle_passes(), u32::MAX);
    }
}
