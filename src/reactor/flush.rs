//! The end of a pass: one doorbell per QP with staged work, receive
//! reposts (batched, off the latency path), and the idle-time work of
//! signaling out unsignaled tails. It visits only the connections a pass
//! touched, and those parked with work for an idle pass.

use crate::error::Result;

use super::conn::Conn;
use super::counters::Counters;
use super::slab::{PARKED, TOUCHED};
use super::srq_pool::SrqPool;
use super::{ConnId, Handler, PeerLink, Reactor};

/// What the connections a flush walked still have pending.
#[derive(Default)]
struct Left {
    /// Work any pass must do (see [`Reactor::flush`]).
    unsettled: bool,
    /// Receives waiting for a fuller repost batch.
    reposts: bool,
    /// Unsignaled requests at the tail of a burst.
    tails: bool,
}

impl<H: Handler, L: PeerLink> Reactor<H, L> {
    /// End of pass: one doorbell per QP with staged work, then the receive
    /// reposts that are due (all pending ones when `tidy`). Reposting after
    /// the doorbell keeps it off the latency path; the receives it adds are
    /// announced with the next SEND or credit update.
    /// Notes what is left for later passes: in `unsettled`, work any pass
    /// must do (reposts that are due, work or a credit update that could not
    /// go out); in `reposts_left` and `tails_left`, what an idle pass does.
    #[inline]
    pub(super) fn flush(&mut self, tidy: bool, signal_tails: bool) {
        // `fail` may set it again while we walk.
        self.unsettled = false;
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
            // This flush visits every parked connection and says anew what
            // is left. Cleared before the walk, not overwritten after it:
            // a connection parked during the walk (a forward's slot given
            // back by a connection the walk failed) keeps its flag.
            self.reposts_left = false;
            self.tails_left = false;
        }
        let mut left = Left::default();
        self.flush_list(TOUCHED, tidy, signal_tails, &mut left);
        if idle_work {
            // The connections a flush left with receives below a batch or
            // an unsignaled tail: parked by `flush_index`, so idle-time
            // work visits them, not every connection.
            self.flush_list(PARKED, tidy, signal_tails, &mut left);
        }
        if let Some(pool) = &mut self.srq {
            for slot in self.deferred.srq_returns.drain(..) {
                pool.give_back_noting(slot);
            }
            if let Err(err) = pool.flush() {
                log::error!("reposting SRQ receives: {err}");
                // Slots a failed post left behind (in the batch or
                // stranded; an `Ok` leaves none): try again next pass.
                self.unsettled = true;
            }
        }
        self.unsettled |= left.unsettled;
        // Connections parked earlier keep what they had pending: only the
        // idle-time flush, which visits them all, clears these (above).
        self.reposts_left |= left.reposts;
        self.tails_left |= left.tails;
    }

    /// Flushes every connection on slab list `list`, walked in place: what
    /// the walk lists again (work left for the next pass) goes to the end
    /// and stays listed.
    #[inline(always)]
    fn flush_list(&mut self, list: usize, tidy: bool, signal_tails: bool, left: &mut Left) {
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
    fn flush_index(&mut self, index: u32, tidy: bool, signal_tails: bool, left: &mut Left) {
        let (spell, after_quiet) = (self.quiet_spells, self.after_quiet);
        let Some((key, conn)) = self.conns.get_by_index_quiet(index) else {
            return;
        };
        self.counters.flush_visits += 1;
        if conn.is_closed() {
            self.flush_closed(index, left);
            return;
        }
        let repost = conn.reposts_due() || (tidy && conn.has_pending_reposts());
        let tail = signal_tails && conn.has_unsignaled_tail();
        // The walk visits only connections a pass touched or parked, so
        // most have work: it is inline (a call's entry and exit were 5 %
        // of the reactor's instructions per READ).
        if (repost || tail || !conn.is_quiet())
            && let Err(error) = Self::flush_conn(
                conn,
                &mut self.srq,
                &mut self.counters,
                repost,
                tail,
                spell,
                after_quiet,
            )
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
        left: &mut Left,
        unsettled: bool,
        reposts: bool,
        tail: bool,
    ) {
        left.unsettled |= unsettled;
        left.reposts |= reposts;
        left.tails |= tail;
        if unsettled {
            self.conns.touch(index);
        }
        if reposts || tail {
            self.conns.park(index);
        }
    }

    /// What a doorbell rung on a connection with sparse traffic marks it
    /// with, given the reactor's count of quiet spells and `after_quiet`:
    /// the count before the current one while `after_quiet` holds (within
    /// the spell, or from the pass ending it to the next pass with
    /// completions), so a request sent then (by a timer, say) leaves the
    /// answer to it, and what a handler posts on that, sparse; the current
    /// count after that, so the connection's traffic is busy until the
    /// next spell. (A connection with busy traffic is marked with the
    /// current count already.)
    #[inline]
    fn spell_mark(spell: u32, after_quiet: bool) -> u32 {
        spell.wrapping_sub(u32::from(after_quiet))
    }

    /// Signals the last request staged on `conn`, if it is not; with
    /// nothing staged and `tail` (an unsignaled tail to signal out), stages
    /// a signaled credit update. Off the busy path.
    #[cold]
    fn leave_no_tail(conn: &mut Conn, tail: bool) {
        if !conn.has_unsignaled_tail() {
            return;
        }
        if !conn.batch.is_empty() {
            conn.signal_last_staged();
        } else if tail {
            conn.stage_tail_signal();
        }
    }

    /// A closed connection only owes the SRQ its consumed slots.
    #[cold]
    fn flush_closed(&mut self, index: u32, left: &mut Left) {
        let Some((_, conn)) = self.conns.get_by_index_quiet(index) else {
            return;
        };
        if let Some(pool) = &mut self.srq {
            conn.take_shared_reposts(|slot| pool.give_back_noting(slot));
        }
        let (unsettled, reposts, tail) = conn.leftovers();
        self.note_left(index, left, unsettled, reposts, tail);
    }

    /// Rings the doorbell of open connection `conn` and reposts its
    /// receives (`repost`). With `tail` (its unsignaled tail is to be
    /// signaled out), or when its traffic is sparse (`after_quiet`: the
    /// reactor is in a quiet spell or its last pass with completions ended
    /// one; or the connection has not posted on busy traffic since the
    /// reactor counted quiet spell `spell`), the last request it posts is
    /// signaled; with `tail` and nothing to post, a signaled credit update
    /// goes out. A doorbell on sparse traffic marks the connection (see
    /// [`spell_mark`](Self::spell_mark)).
    #[inline]
    fn flush_conn(
        conn: &mut Conn,
        srq: &mut Option<SrqPool>,
        counters: &mut Counters,
        repost: bool,
        tail: bool,
        spell: u32,
        after_quiet: bool,
    ) -> Result<()> {
        conn.prepare_flush();
        let sparse = after_quiet | conn.is_sparse(spell);
        if tail | sparse {
            Self::leave_no_tail(conn, tail);
        }
        let staged = conn.batch.len() as u64;
        if staged > 0 {
            counters.doorbells += 1;
            counters.requests += staged;
            if sparse {
                conn.note_sparse_post(Self::spell_mark(spell, after_quiet));
            }
        }
        conn.post_staged()?;
        if !repost {
            return Ok(());
        }
        match srq {
            Some(pool) if conn.uses_srq() => {
                // Every slot is offered even after a failed post: the pool
                // keeps each one (in its batch, or stranded), and the end
                // of the pass posts them or leaves them for the next
                // (`flush`), where skipping it would lose it to the SRQ. A
                // post the shared queue refused is none of this
                // connection's doing, so it does not fail the connection
                // (the pass's end logs it).
                conn.take_shared_reposts(|slot| pool.give_back_noting(slot));
                Ok(())
            }
            _ => conn.flush_reposts(),
        }
    }
}
