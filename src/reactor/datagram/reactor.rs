//! The reactor's side of its datagram endpoints: adding one, multicast
//! membership, routing their completions to the handler, and their flush
//! at the end of a pass.

use crate::error::{Error, Result};
use crate::verbs::{Gid, UdConfig, UdQueuePair};

use super::super::table::wr_id::WrKind;
use super::super::{Handler, PeerLink, Reactor};
use super::{Arrived, DatagramEndpoint, DatagramId, DatagramSource};

impl<H: Handler, L: PeerLink> Reactor<H, L> {
    /// Adds a datagram endpoint: a UD QP on the reactor's CQs made as
    /// `config` asks (`max_recv_wr` receives posted at once and kept
    /// posted, `max_send_wr` sends in flight at most, at least 2), ready at
    /// once, and the handler `make` builds for it from its id and QP (where
    /// a sender makes its destinations:
    /// [`UdQueuePair::group_destination`], [`UdQueuePair::destination`]).
    /// Its datagrams go to [`Handler::on_datagram`]; the handler sends with
    /// [`Ctx::send_datagram`](crate::reactor::Ctx::send_datagram) and runs
    /// [`Handler::on_idle`] with the others (while it returns
    /// [`Idle::Again`](crate::reactor::Idle::Again)). Each receive and send slot is
    /// the port's MTU (plus the 40-byte GRH for a receive), registered
    /// once. A reactor holds at most 64 endpoints at once; a
    /// [removed](Self::remove_datagram) one's place is free again once the
    /// next pass has polled the CQs, and ids are never reused. An error of
    /// `make` is returned, and the endpoint is not added.
    ///
    /// Anyone on the fabric who learns the endpoint's QP number and Q_Key,
    /// or a group it joined, can send to it: see the security docs.
    ///
    /// ```no_run
    /// # use rdma_comm_core::prelude::*;
    /// struct Publisher { feed: DatagramId, to: UdDestination, next: u64 }
    /// impl Handler for Publisher {
    ///     fn on_message(&mut self, _: &mut Ctx<'_>, _: ConnId, _: &[u8], _: Option<u32>) {}
    ///     fn on_idle(&mut self, ctx: &mut Ctx<'_>) -> Idle {
    ///         // WouldBlock: the send queue is full; the next pass tries again.
    ///         if ctx.send_datagram(self.feed, &self.to, &self.next.to_le_bytes()).is_ok() {
    ///             self.next += 1;
    ///         }
    ///         Idle::Again
    ///     }
    /// }
    /// # fn demo(reactor: &mut Reactor<Publisher>) -> rdma_comm_core::Result<()> {
    /// let group = Gid::from_ipv4([239, 1, 1, 1].into());
    /// reactor.add_datagram(&UdConfig::default(), |feed, qp| {
    ///     Ok(Publisher { feed, to: qp.group_destination(group)?, next: 0 })
    /// })?;
    /// # Ok(()) }
    /// ```
    pub fn add_datagram(
        &mut self,
        config: &UdConfig,
        make: impl FnOnce(DatagramId, &UdQueuePair) -> Result<H>,
    ) -> Result<DatagramId> {
        let id = self.datagrams.next_id(self.counters.passes)?;
        self.completions.release_retired(self.counters.passes);
        let (cq_index, cq) = self.completions.next_cq();
        let charge = (
            cq_index,
            config.max_send_wr.saturating_add(config.max_recv_wr),
        );
        if !self.completions.can_absorb(&[charge]) {
            return Err(Error::InvalidArgument(
                "Reactor::add_datagram: the reactor's CQ has no room for the endpoint's queues (ReactorConfig::cq_size)",
            ));
        }
        let endpoint = DatagramEndpoint::new(&self.pd, &cq, id_index(id) as u32, config)?;
        let handler = make(id, endpoint.qp())?;
        self.completions.charge(&[charge]);
        self.datagram_handlers.insert(id_index(id), handler);
        // Its completions and doorbells are the full pass's.
        self.full_pass_parts += 1;
        self.datagrams.push(id, endpoint, charge);
        log::info!(
            "datagram endpoint {id:?}: UD QP {} with Q_Key {:#x} is open to anyone on the fabric who knows them",
            self.datagrams.get(id).map_or(0, |e| e.qp().qpn()),
            config.qkey,
        );
        Ok(id)
    }

    /// The UD QP of endpoint `id`: what peers need to reach it
    /// ([`UdQueuePair::endpoint`]) and the destinations its handler sends
    /// to ([`UdQueuePair::destination`], [`UdQueuePair::group_destination`]).
    /// `None` for an id of another reactor.
    pub fn datagram_qp(&self, id: DatagramId) -> Option<&UdQueuePair> {
        self.datagrams.get(id).map(DatagramEndpoint::qp)
    }

    /// Joins endpoint `id` to multicast group `group` (see
    /// [`UdQueuePair::join`]): datagrams sent to the group reach its
    /// handler from now on.
    /// ([`Ctx::join`](super::super::Ctx::join) does the same from a
    /// callback.)
    pub fn join(&mut self, id: DatagramId, group: Gid) -> Result<()> {
        self.datagrams.join(id, group)
    }

    /// Takes endpoint `id` out of multicast group `group`.
    pub fn leave(&mut self, id: DatagramId, group: Gid) -> Result<()> {
        self.datagrams.leave(id, group)
    }

    /// Removes endpoint `id`: its QP is destroyed (which leaves its
    /// multicast groups), its rings deregistered, the datagrams it staged
    /// dropped and its CQ room given back, and its handler handed back.
    /// Completions of it still on the CQ are ignored, and its id names
    /// nothing from now on (a later endpoint may take its place among the
    /// 64 once the next pass has polled the CQs, with an id of its own).
    /// `None` for an id of another reactor, or one removed already. From a
    /// callback:
    /// [`Ctx::remove_datagram`](crate::reactor::Ctx::remove_datagram).
    pub fn remove_datagram(&mut self, id: DatagramId) -> Option<H> {
        let (endpoint, charge) = self.datagrams.remove(id, self.counters.passes)?;
        drop(endpoint);
        // Its room comes free once the next pass has polled what the QP
        // left on the CQ.
        self.completions.discharge(&[charge], self.counters.passes);
        self.full_pass_parts -= 1;
        log::info!("datagram endpoint {id:?} removed");
        self.datagram_handlers.take(id_index(id))
    }

    /// Drops the reactor (its endpoints' QPs destroyed with it) and hands
    /// back the handlers of the endpoints it still has, with their ids, in
    /// the order of their places: for a runtime reactor's last act.
    pub(crate) fn into_datagram_handlers(mut self) -> Vec<(DatagramId, H)> {
        let handlers = std::mem::take(&mut self.datagram_handlers);
        let owned: Vec<(DatagramId, H)> = handlers
            .into_places()
            .into_iter()
            .enumerate()
            .filter_map(|(index, handler)| Some((self.datagrams.id(index as u32), handler?)))
            .collect();
        drop(self);
        owned
    }

    /// The handler of endpoint `id`.
    pub fn datagram_handler(&self, id: DatagramId) -> Option<&H> {
        self.datagrams.get(id)?;
        self.datagram_handlers.get(id_index(id))
    }

    /// The handler of endpoint `id`, mutably.
    pub fn datagram_handler_mut(&mut self, id: DatagramId) -> Option<&mut H> {
        self.datagrams.get(id)?;
        self.datagram_handlers.get_mut(id_index(id))
    }

    /// Completion `at`, whose `wr_id` names endpoint `index` as `kind`:
    /// a datagram goes to the handler and its slot back to the device; a
    /// failed completion fails the endpoint and tells the handler.
    #[inline(never)]
    pub(in super::super) fn route_datagram(&mut self, at: usize, index: u32, kind: WrKind) {
        let wc = self.completions.wc(at);
        let (receive, value) = match kind {
            WrKind::Recv { slot } => (true, slot),
            WrKind::Send { seq } => (false, seq),
            _ => return,
        };
        let id = self.datagrams.id(index);
        match self
            .datagrams
            .complete(index, wc, receive, value, self.counters.passes)
        {
            Arrived::Datagram { slot, landed } => {
                self.counters.datagrams += 1;
                // SAFETY: both lie in the endpoint's receive ring, registered
                // while the endpoint lives, which is past this call (a
                // callback's removal waits for the end of the pass, and
                // `remove_datagram` needs the reactor, which a callback
                // cannot reach); the slot is consumed and goes back to the
                // device only after the handler returns (`release`), and
                // nothing the handler can reach writes a receive ring.
                let (grh, data) = unsafe {
                    (
                        &*landed.grh,
                        std::slice::from_raw_parts(landed.payload, landed.len),
                    )
                };
                let source = DatagramSource::new(wc.src_qp(), wc.has_grh().then_some(grh));
                if let Some(handler) = self.datagram_handlers.get_mut(index as usize) {
                    let mut ctx = reactor_ctx!(self);
                    handler.on_datagram(&mut ctx, id, &source, data);
                    if ctx.touched {
                        self.idle.work_left();
                    }
                }
                self.datagrams.release(index, slot);
            }
            Arrived::Nothing => {}
            Arrived::Stale => self.counters.stale_completions += 1,
            Arrived::Failed(error) => self.datagram_failed(id, error),
            Arrived::Foreign => {
                let wc = *wc;
                self.foreign(&wc);
            }
        }
    }

    /// Tells endpoint `id`'s handler that it failed.
    #[cold]
    fn datagram_failed(&mut self, id: DatagramId, error: Error) {
        log::warn!("datagram endpoint {id:?} failed: {error}");
        if let Some(handler) = self.datagram_handlers.get_mut(id_index(id)) {
            let mut ctx = reactor_ctx!(self);
            handler.on_datagram_error(&mut ctx, id, &error);
        }
    }

    /// Removes the endpoints callbacks asked to remove; their handlers are
    /// dropped.
    #[cold]
    #[inline(never)]
    fn apply_datagram_removals(&mut self) {
        let mut removals = self.datagrams.take_removals();
        while removals != 0 {
            let index = removals.trailing_zeros();
            removals &= removals - 1;
            drop(self.remove_datagram(self.datagrams.id(index)));
        }
    }

    /// The end of a pass for the datagram endpoints: the removals callbacks
    /// asked for, one doorbell each for the others' staged datagrams, their
    /// reposts (all of them on an idle pass, `idle`), and the handlers of
    /// those a refused post failed told.
    // Cold for the pass's layout: most passes of most reactors have no
    // datagram to flush, and the branch to here costs them nothing more.
    #[cold]
    #[inline(never)]
    pub(in super::super) fn flush_datagrams(&mut self, idle: bool) {
        // Endpoints callbacks asked to remove go first, with what they
        // staged.
        if self.datagrams.has_removals() {
            self.apply_datagram_removals();
        }
        let failed = self.datagrams.flush(idle);
        if failed != 0 {
            for index in 0..u64::BITS {
                if failed & (1 << index) != 0
                    && let Some(error) = self.datagrams.take_report(index)
                {
                    let id = self.datagrams.id(index);
                    self.datagram_failed(id, error);
                }
            }
        }
    }
}

/// The index of endpoint `id` among the handlers (checked with the table).
fn id_index(id: DatagramId) -> usize {
    id.index as usize
}
