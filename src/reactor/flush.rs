//! The end of a pass: one doorbell per QP with staged work, receive
//! reposts (batched, off the latency path), and the idle-time work of
//! signaling out unsignaled tails. It visits only the connections a pass
//! touched, and those parked with work for an idle pass.

use crate::error::Result;

use super::conn::Conn;
use super::counters::Counters;
use super::idle::{Leftovers, Spell};
use super::slab::{PARKED, TOUCHED};
use super::srq_pool::SrqPool;
use super::{ConnId, Handler, PeerLink, Reactor};

impl<H: Handler, L: PeerLink> Reactor<H, L> {
    /// End of pass: one doorbell per QP with staged work, then the receive
    /// reposts that are due (all pending ones when `tidy`). Reposting after
    /// the doorbell keeps it off the latency path; the receives it adds are
    /// announced with the next SEND or credit update.
    /// Tells the idle policy what is left for later passes: work any pass
    /// must do (reposts that are due, work or a credit update that could not
    /// go out), and what an idle pass does.
    #[inline]
    pub(super) fn flush(&mut self, tidy: bool, signal_tails: bool) {
        // `fail` may leave work again while we walk.
        self.idle.flush_begins();
        // A connection still due here was left by a pass a failed poll cut
        // short (a pass flushes its due one itself): the walk takes it.
        self.conns.list_due();
        // Before the walk, which could otherwise post behind a request
        // whose doorbell the device refused.
        if !self.deferred.refused.is_empty() {
            self.fail_refused();
        }
        // The connections something may have changed since the last flush
        // (the slab lists every mutable access): a pass on a reactor of a
        // thousand connections flushes the few its completions and handlers
        // touched, not all of them.
        let idle_work = tidy || signal_tails;
        if idle_work {
            // A connection parked during the walk (a forward's slot given
            // back by a connection the walk failed) keeps its flag.
            self.idle.idle_flush_begins();
        }
        let mut left = Leftovers::default();
        self.flush_list(TOUCHED, tidy, signal_tails, &mut left);
        if idle_work {
            // The connections a flush left with receives below a batch or
            // an unsignaled tail: parked by `flush_index`, so idle-time
            // work visits them, not every connection.
            self.flush_list(PARKED, tidy, signal_tails, &mut left);
        }
        if let Some(pool) = &mut self.srq {
            // Held messages of removed connections, released.
            for slot in self.deferred.srq_returns.drain(..) {
                pool.give_back_orphan(slot);
            }
            if let Err(err) = pool.flush() {
                log::error!("reposting SRQ receives: {err}");
                // Slots a failed post left behind (in the batch or
                // stranded; an `Ok` leaves none): try again next pass.
                self.idle.work_left();
            }
        }
        self.idle.flush_ended(left);
    }

    /// Flushes connection `index` alone, as the pass's flush would: the
    /// one a pass's completions left due (see `ConnTable::settle`), so the
    /// flush has no walk to make for it. A doorbell rung alone that the
    /// device refused must fail its connection before anything else is
    /// posted, which the pass's flush does first: then it is listed for
    /// that flush instead.
    #[inline]
    pub(super) fn flush_one(&mut self, index: u32) {
        if !self.deferred.refused.is_empty() {
            self.conns.touch(index);
            return;
        }
        let mut left = Leftovers::default();
        self.flush_index(index, false, false, &mut left);
        self.idle.flush_ended(left);
        // Slots the SRQ refused wait in the pool for the pass's flush,
        // which tries them again.
        if self.srq.as_ref().is_some_and(SrqPool::has_unposted) {
            self.idle.work_left();
        }
    }

    /// Flushes every connection on slab list `list`, walked in place: what
    /// the walk lists again (work left for the next pass) goes to the end
    /// and stays listed.
    #[inline(always)]
    fn flush_list(&mut self, list: usize, tidy: bool, signal_tails: bool, left: &mut Leftovers) {
        let listed = self.conns.begin_walk(list);
        for at in 0..listed {
            let Some(index) = self.conns.unlist_at(list, at) else {
                break;
            };
            self.flush_index(index, tidy, signal_tails, left);
        }
        self.conns.end_walk(list);
    }

    /// Flushes the connection at slab `index` if it has work, and notes
    /// in `left` what it still has. One lookup on the common path: an open
    /// connection is flushed and looked at through the same borrow.
    #[inline]
    fn flush_index(&mut self, index: u32, tidy: bool, signal_tails: bool, left: &mut Leftovers) {
        let spell = self.idle.spell();
        let Some((key, conn)) = self.conns.get_by_index_quiet(index) else {
            return;
        };
        self.counters.flush_visits += 1;
        if conn.state().is_closed() {
            self.flush_closed(index, left);
            return;
        }
        let repost = conn.rq().is_due() || (tidy && conn.rq().has_pending());
        let tail = signal_tails && conn.has_unsignaled_tail();
        // The walk visits only connections a pass touched or parked, so
        // most have work: it is inline (a call's entry and exit would be
        // about 5 % of the reactor's instructions per READ).
        if (repost || tail || !conn.is_quiet())
            && let Err(error) =
                Self::flush_conn(conn, &mut self.srq, &mut self.counters, repost, tail, spell)
        {
            self.fail(ConnId(key), error);
            // The handler told may have rung a doorbell alone that the
            // device refused: its connection fails before the walk goes
            // on, which must never post behind the refused request (the
            // loop also takes what the handlers it tells push, so the
            // chain does not nest).
            if !self.deferred.refused.is_empty() {
                self.fail_refused();
            }
            if let Some((_, conn)) = self.conns.get_by_index_quiet(index) {
                let (unsettled, reposts, tail) = conn.leftovers();
                self.note_left(index, left, unsettled, reposts, tail);
            }
            return;
        }
        // Still open: a successful flush closes nothing.
        let (unsettled, reposts, tail) = conn.open_leftovers();
        // A handler refused for want of room is told once it is back: the
        // completions that bring it (credits, retired requests) list the
        // connection for this flush.
        if conn.waits_for_room() && conn.has_room_back() {
            self.conns.list_room(index);
        }
        self.note_left(index, left, unsettled, reposts, tail);
    }

    /// Notes what connection `index` still has: work that could not go out
    /// this time is flushed again by the next pass; receives below a batch
    /// and an unsignaled tail wait for the idle-time flush, which finds the
    /// connection parked.
    #[inline]
    fn note_left(
        &mut self,
        index: u32,
        left: &mut Leftovers,
        unsettled: bool,
        reposts: bool,
        tail: bool,
    ) {
        left.note(unsettled, reposts, tail);
        if unsettled {
            self.conns.touch(index);
        }
        if reposts || tail {
            self.conns.park(index);
        }
    }

    /// Signals the last request staged on `conn`, if it is not; with
    /// nothing staged and `tail` (an unsignaled tail to signal out), stages
    /// a signaled credit update. Off the busy path.
    #[cold]
    fn leave_no_tail(conn: &mut Conn, tail: bool) {
        if !conn.has_unsignaled_tail() {
            return;
        }
        if conn.sq().staged() != 0 {
            conn.sq_mut().signal_last_staged();
        } else if tail {
            conn.stage_tail_signal();
        }
    }

    /// A closed connection only owes the SRQ its consumed slots.
    #[cold]
    fn flush_closed(&mut self, index: u32, left: &mut Leftovers) {
        let Some((_, conn)) = self.conns.get_by_index_quiet(index) else {
            return;
        };
        if let Some(pool) = &mut self.srq {
            conn.rq_mut()
                .take_shared(|slot| pool.give_back_noting(slot));
        }
        let (unsettled, reposts, tail) = conn.leftovers();
        self.note_left(index, left, unsettled, reposts, tail);
    }

    /// Rings the doorbell of open connection `conn` and reposts its
    /// receives (`repost`). With `tail` (its unsignaled tail is to be
    /// signaled out), or when its traffic is sparse (see
    /// [`Spell::is_sparse`]), the last request it posts is signaled; with
    /// `tail` and nothing to post, a signaled credit update goes out. A
    /// doorbell on sparse traffic marks the connection (see
    /// [`Spell::mark`]).
    #[inline]
    fn flush_conn(
        conn: &mut Conn,
        srq: &mut Option<SrqPool>,
        counters: &mut Counters,
        repost: bool,
        tail: bool,
        spell: Spell,
    ) -> Result<()> {
        conn.prepare_flush();
        let sparse = conn.sq().signaling().is_sparse(spell);
        if tail | sparse {
            Self::leave_no_tail(conn, tail);
        }
        let staged = conn.sq().staged() as u64;
        if staged > 0 {
            counters.doorbells += 1;
            counters.requests += staged;
            if sparse {
                conn.sq_mut().note_sparse_post(spell);
            }
        }
        conn.post_staged()?;
        if !repost {
            return Ok(());
        }
        match srq {
            Some(pool) if conn.rq().uses_srq() => {
                Self::repost_shared(conn, pool);
                Ok(())
            }
            _ => conn.flush_reposts(),
        }
    }

    /// Gives the SRQ slots `conn` consumed back to `pool` and posts them.
    /// Every slot is offered even after a failed post: the pool keeps each
    /// one it could not post (in its batch, or stranded), and the end of
    /// the pass tries them again or leaves them for the next (`flush`). A
    /// post the shared queue refused is none of this connection's doing, so
    /// it does not fail the connection (the pass's end logs it). Posted
    /// now, and credited only once posted: a credit announced for a receive
    /// the SRQ does not hold would let the peer meet an RNR. After a
    /// refusal the connection stays due, and its next flush tries again.
    #[inline]
    fn repost_shared(conn: &mut Conn, pool: &mut SrqPool) {
        conn.rq_mut()
            .take_shared(|slot| pool.give_back_noting(slot));
        let posted = pool.flush();
        if let Err(err) = &posted {
            log::debug!("reposting SRQ receives (the next flush tries again): {err}");
        }
        conn.credit_shared(posted.is_ok());
    }
}
