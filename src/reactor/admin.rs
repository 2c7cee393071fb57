//! Taking sessions in and out of a reactor: checks that a source's QPs are
//! fit to be served (the reactor's CQs, room in them, the reactor's SRQ,
//! nothing posted yet but window binds), building their connections, and tearing them down
//! so that a long-lived reactor holds only the peers it serves.

use crate::error::{Error, Result};
use crate::verbs::QueuePair;

use super::conn::{Conn, MIN_SQ_DEPTH, sq_room};
use super::idle::IdlePolicy;
use super::srq_pool::SrqPool;
use super::table::ConnTable;
use super::table::wr_id::MAX_CONNS;
use super::{ConnId, Handler, PeerLink, QpSource, Reactor, SessionId};

impl<H: Handler, L: PeerLink> Reactor<H, L> {
    /// Takes over a connected QP source (an [`Endpoint`](crate::session::Endpoint)
    /// built from [`qp_spec`](Self::qp_spec)s, say): posts its
    /// receive rings now and sends the initial credit updates with the next
    /// pass. `handler` gets every callback for its connections.
    ///
    /// A QP may come with memory windows bound on it
    /// ([`QueuePair::bind_window`], signaled or not): they take their
    /// send-queue entries from the reactor's depth for that connection
    /// (create the QP with `max_send_wr` = `sq_depth` + binds to keep the
    /// full depth) and a CQ entry each, and a bind that fails fails its
    /// connection ([`Handler::on_error`] with `IBV_WC_MW_BIND_ERR`).
    ///
    /// Refused with a typed error, leaving the reactor as it was: a QP on
    /// other CQs or another SRQ, a QP anything but binds was posted on
    /// already, a QP whose binds leave fewer than 4 send-queue entries, more
    /// connections than the CQs can absorb at the configured depths (see
    /// [`ReactorConfig::absorbing`](super::ReactorConfig::absorbing)) or
    /// than the SRQ can give their shares. On a reactor with an SRQ, an add
    /// whose QPs fit its CQs and SRQ first runs one pass (which may call
    /// handlers), so that no completion a destroyed QP left behind passes
    /// for one of the newcomer's: the refusals after that (the reactor's
    /// limits, the SRQ's shares) leave the reactor as that pass left it.
    pub fn add<S: QpSource<Link = L>>(&mut self, source: S, handler: H) -> Result<SessionId> {
        self.add_as(source, handler, false)
    }

    /// Takes over a connected QP source as direct connections (see
    /// [`Ctx::direct`](super::Ctx::direct)): the handler posts on each QP
    /// itself, its receives included, and gets every completion in
    /// [`Handler::on_direct_completion`]; the reactor polls, routes and
    /// fails them, and posts nothing of its own. The connections are
    /// established at once, with nothing posted; the handler hears of each
    /// ([`Handler::on_established`]) before this returns, and posts its
    /// first receives there. A SEND that comes before them waits
    /// in the peer's RNR retries (the peer must be direct too, since
    /// nothing of the reactor's protocol is spoken). Each takes its QP's whole send and receive depth from
    /// the CQs' room. Refused on a reactor with an SRQ, and as
    /// [`add`](Self::add) refuses.
    pub fn add_direct<S: QpSource<Link = L>>(
        &mut self,
        source: S,
        handler: H,
    ) -> Result<SessionId> {
        self.add_as(source, handler, true)
    }

    fn add_as<S: QpSource<Link = L>>(
        &mut self,
        source: S,
        handler: H,
        direct: bool,
    ) -> Result<SessionId> {
        let (qps, link) = source.into_parts();
        self.completions.release_retired(self.counters.passes);
        let cq_charges = self.check_qps(&qps, direct)?;
        if self.srq.is_some() {
            // The SRQ's receives are told apart by QP number, and the kernel
            // gives a destroyed QP's number to the next QP at once: a QP on
            // our CQs destroyed before (a removed connection's, or one never
            // added) may have left completions that would pass for this
            // newcomer's, another peer's messages. Poll them out first (they
            // go back to the SRQ as a stranger's). Before its first flush
            // grants credits, the newcomer's own peer sends nothing but its
            // initial credit update, which this may drop as it may any time
            // before the add (the peer's first credit is answered with
            // another update).
            self.one_pass()?;
        }
        let Some(session) = self.sessions.vacant_id() else {
            return Err(Error::InvalidArgument(
                "the reactor serves its maximum of sessions",
            ));
        };
        if self.conns.len() + qps.len() > MAX_CONNS {
            return Err(Error::InvalidArgument(
                "the reactor serves its maximum of connections (2^20 - 1)",
            ));
        }
        let share = self.config.recv_depth.max(2);
        // (A direct connection is refused on a reactor with an SRQ.)
        if let Some(pool) = &mut self.srq {
            let shares = share
                .checked_mul(qps.len() as u32)
                .ok_or(Error::InvalidArgument(
                    "recv_depth times the session's QPs is beyond any SRQ",
                ))?;
            pool.promise(shares)?;
        }
        let count = qps.len() as u32;
        let mut conns = Vec::with_capacity(qps.len());
        let mut failure = None;
        for (index, qp) in qps.into_iter().enumerate() {
            match self.build_conn(session, index, qp, direct) {
                Ok(conn) => conns.push(conn),
                Err(err) => {
                    failure = Some(err);
                    break;
                }
            }
        }
        if let Some(err) = failure {
            let built = conns.len() as u32;
            for conn in conns {
                self.drop_conn(conn);
            }
            if let Some(pool) = &mut self.srq {
                // The shares of the connections that were never built.
                pool.unpromise(share * (count - built));
            }
            // Those built and dropped may have left completions on the
            // CQs (their receives, flushed): their room is held as a
            // removed connection's is, until a pass has polled them.
            self.completions.charge(&cq_charges);
            self.completions
                .discharge(&cq_charges, self.counters.passes);
            return Err(err);
        }
        self.completions.charge(&cq_charges);
        let watched = link.event_fd();
        let key = self.sessions.insert(handler, link, conns, cq_charges);
        debug_assert_eq!(key, Some(session));
        if let Some(fd) = watched
            && let Err(err) = self.waiter.watch(fd, u64::from(session.0.index))
        {
            // The periodic watch (if configured) still sees this peer.
            log::warn!("cannot wait on a peer's control connection: {err}");
        }
        // The initial credit updates wait for the next flush.
        self.idle.sessions_changed();
        if direct {
            self.hand_over(session);
        }
        Ok(session)
    }

    /// Tells the handler of new direct session `session` that each of its
    /// connections is its own to post on (`on_established`, in QP order).
    fn hand_over(&mut self, session: SessionId) {
        let Some(record) = self.sessions.get_mut(session) else {
            return;
        };
        let (handler, conns) = record.handler_and_conns();
        let mut ctx = reactor_ctx!(self);
        for &conn in conns {
            handler.on_established(&mut ctx, conn);
        }
        if ctx.touched {
            self.idle.work_left();
        }
    }

    /// Checks `qps` against the reactor's CQs and SRQ; returns the CQ
    /// entries they would take, by CQ index.
    fn check_qps(&self, qps: &[QueuePair], direct: bool) -> Result<Vec<(usize, u32)>> {
        let mut charges: Vec<(usize, u32)> = Vec::new();
        if direct
            && (self.srq.is_some() || qps.iter().any(|qp| qp.shared_receive_queue().is_some()))
        {
            return Err(Error::InvalidArgument(
                "a direct connection posts its own receives: add it to a reactor without an SRQ",
            ));
        }
        for qp in qps {
            let Some((send, recv)) = self.completions.cqs_of(qp) else {
                return Err(Error::InvalidArgument(
                    "QP was not created on this reactor's CQs (build it from Reactor::qp_spec)",
                ));
            };
            let srq_matches = match (&self.srq, qp.shared_receive_queue()) {
                (Some(pool), Some(srq)) => pool.is_ours(&srq),
                (None, None) => true,
                _ => false,
            };
            if !srq_matches {
                return Err(Error::InvalidArgument(
                    "QP's receive queue does not match this reactor's (build it from Reactor::qp_spec)",
                ));
            }
            if !qp.belongs_to(&self.pd) {
                return Err(Error::InvalidArgument(
                    "QP was created in another protection domain than the reactor's (its rings would be out of the QP's reach)",
                ));
            }
            if qp.has_posted() {
                return Err(Error::InvalidArgument(
                    "something was posted on this QP already: the reactor takes only QPs whose every completion will be its own",
                ));
            }
            // Window binds posted before hold send-queue entries until the
            // reactor's first signaled completion, and a CQ entry each if
            // they are signaled or fail.
            if qp.bound_windows() > 0 && sq_room(&self.config, qp) < MIN_SQ_DEPTH {
                return Err(Error::InvalidArgument(
                    "the QP's window binds leave the reactor too little of its send queue (create it with max_send_wr = sq_depth + binds)",
                ));
            }
            let mut sq = sq_room(&self.config, qp).max(MIN_SQ_DEPTH) + qp.bound_windows();
            // With an SRQ, receive completions are bounded by the SRQ, whose
            // whole depth every CQ keeps room for (a peer that ignores its
            // credits can consume all of it), not by the connection's share.
            let mut rq = match self.srq {
                Some(_) => 0,
                None => self.config.recv_depth.max(2),
            };
            if direct {
                // Its handler may fill the QP's queues: every request of
                // them may complete.
                sq = qp.max_send_wr();
                rq = qp.max_recv_wr();
            }
            for (cq, entries) in [(send, sq), (recv, rq)] {
                match charges.iter_mut().find(|(c, _)| *c == cq) {
                    Some((_, total)) => *total += entries,
                    None => charges.push((cq, entries)),
                }
            }
        }
        if !self.completions.can_absorb(&charges) {
            return Err(Error::InvalidArgument(
                "the reactor's CQs cannot absorb more connections at these queue depths (see ReactorConfig::absorbing)",
            ));
        }
        Ok(charges)
    }

    /// Builds and stores the connection for QP `index` of `session`.
    fn build_conn(
        &mut self,
        session: SessionId,
        index: usize,
        qp: QueuePair,
        direct: bool,
    ) -> Result<ConnId> {
        let Some(id) = self.conns.vacant_id() else {
            return Err(Error::InvalidArgument(
                "the reactor serves its maximum of connections",
            ));
        };
        if direct {
            let conn = Conn::new_direct(id, session, index, &self.pd, qp, &self.config)?;
            self.conns.insert(conn);
            return Ok(id);
        }
        let shared = self.srq.as_ref().map(|pool| pool.shared());
        let mut conn = Conn::new(id, session, index, &self.pd, qp, &self.config, shared)?;
        conn.post_initial_receives()?;
        // Goes out with the first pass, so a test (or an application)
        // that adds both ends before running either sees no RNR at all.
        conn.stage_initial_update();
        if let Some(pool) = &mut self.srq {
            pool.add_owner(conn.qpn(), id.key());
        }
        self.conns.insert(conn);
        self.full_pass_parts += 1;
        Ok(id)
    }

    /// Takes a session out of the reactor: its QPs are moved to the error
    /// state and destroyed, its receive rings and send slots deregistered,
    /// and the link and handler handed back (drop the link to tell the
    /// peer). Completions still queued for it are ignored (counted in
    /// [`Counters::stale_completions`](super::Counters::stale_completions)).
    /// Messages of this session that another connection is forwarding
    /// still go out: the forward keeps the receive ring registered until it
    /// completes. `None` if the session is unknown.
    ///
    /// The session's records are freed and its ids reused (with a new
    /// generation), so a reactor that serves peers for months holds only
    /// the ones it serves now.
    pub fn remove(&mut self, session: SessionId) -> Option<(L, H)> {
        let record = self.sessions.remove(session)?;
        if !record.gone
            && let Some(fd) = record.link.event_fd()
        {
            self.waiter.unwatch(fd);
        }
        self.completions
            .discharge(&record.cq_charges, self.counters.passes);
        for conn in record.conns {
            self.drop_conn(conn);
        }
        self.idle.sessions_changed();
        Some((record.link, record.handler))
    }

    /// Stops and frees one connection, handing back what it borrowed:
    /// receive slots of other connections it was forwarding, its SRQ slots
    /// and share.
    fn drop_conn(&mut self, id: ConnId) {
        let Some(mut conn) = self.conns.remove(id) else {
            return;
        };
        if !conn.is_direct() {
            // (Counted at insertion; saturating, as a drift would only cost
            // speed: either pass handles any completion.)
            self.full_pass_parts = self.full_pass_parts.saturating_sub(1);
        }
        let mut released = Vec::new();
        conn.shut_down(|origin, slot, from_srq| released.push((origin, slot, from_srq)));
        if let Some(pool) = &mut self.srq {
            conn.rq_mut()
                .take_shared(|slot| pool.give_back_noting(slot));
            pool.remove_owner(conn.qpn(), conn.rq().depth(), conn.rq().shared_out());
        }
        // Dropping the connection destroys its QP before its rings.
        drop(conn);
        self.release_forwarded(released);
    }

    /// Reposts receive slots whose forwards died with another connection
    /// (straight to the SRQ when the origin is gone too).
    #[cold]
    pub(super) fn release_forwarded(&mut self, released: Vec<(ConnId, u32, bool)>) {
        for (origin, slot, from_srq) in released {
            return_forwarded(
                &mut self.conns,
                &mut self.srq,
                &mut self.idle,
                origin,
                slot,
                from_srq,
            );
        }
    }
}

/// Gives a forwarded receive slot back to its connection in `conns`, or, if
/// that connection is gone and the slot is the SRQ's, to the SRQ. (A slot
/// of a gone connection's own ring went with the ring.) A free function,
/// so a pass can call it while a handler's `Ctx` borrows the connections.
/// Always inlined: on a forward's completion it is the data path, and a
/// plain `#[inline]` leaves it out there (17 Ir more per SEND round trip).
///
/// The connection is listed for the flush only if the slot completes a
/// repost batch (or the connection is closed: the flush hands its SRQ
/// slots back); fewer wait for the idle-time flush, parked, and the idle
/// policy is told. That is what a flush's visit would have done with
/// them, without the visit. A slot that goes to the SRQ pool's batch
/// leaves the next flush work to do (posting it).
#[inline(always)]
pub(super) fn return_forwarded(
    conns: &mut ConnTable,
    srq: &mut Option<SrqPool>,
    idle: &mut IdlePolicy,
    origin: ConnId,
    slot: u32,
    from_srq: bool,
) {
    let key = origin.key();
    if let Some(origin) = conns.get_mut_quiet(key) {
        origin.queue_repost(slot);
        if origin.rq().is_due() || origin.state().is_closed() {
            conns.touch(key.index);
        } else if origin.rq().has_pending() {
            conns.park(key.index);
            idle.reposts_parked();
        }
    } else if from_srq && let Some(pool) = srq {
        pool.give_back_orphan(slot);
        idle.work_left();
    }
}
