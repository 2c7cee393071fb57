//! When a completion is not the usual: one nothing of ours posted, a failed
//! one, one for a connection already failed, or a peer that broke the
//! protocol (a credit overrun, a malformed SEND). A connection that fails
//! here stops its QP and tells its handler; the others keep running.

use crate::error::Error;
use crate::verbs::{BIND_WR_ID, WorkCompletion};

use super::conn::Conn;
use super::slab::Key;
use super::table::Completed;
use super::{ConnId, Handler, PeerLink, Reactor};

impl<H: Handler, L: PeerLink> Reactor<H, L> {
    /// A failed completion of a direct connection fails it (the first
    /// one: those its failure flushes after it are ignored, as are any
    /// of a connection already closed). Its handler's requests hold
    /// nothing of the reactor's, so nothing is given back.
    #[cold]
    #[inline(never)]
    pub(super) fn direct_unusual(&mut self, key: Key, wc: &WorkCompletion) {
        if self.conns.get(key).is_some_and(|c| !c.state().is_closed()) {
            let error = wc
                .ok()
                .err()
                .unwrap_or(Error::InvalidArgument("failed completion"));
            self.fail(ConnId(key), error);
        }
    }

    /// A completion no connection of ours posted (or a receive naming a
    /// slot of a connection's own ring that is not posted): a window bind
    /// of a QP we serve (posted before we took it), which fails its
    /// connection if the bind failed; anything else is ignored and counted.
    #[cold]
    #[inline(never)]
    pub(super) fn foreign(&mut self, wc: &WorkCompletion) {
        if wc.wr_id() == BIND_WR_ID
            && let Some(key) = self.bound_on(wc.qp_num())
        {
            if !wc.is_success() && self.conns.get(key).is_some_and(|c| !c.state().is_closed()) {
                let error = wc
                    .ok()
                    .err()
                    .unwrap_or(Error::InvalidArgument("failed window bind"));
                self.fail(ConnId(key), error);
            }
            return;
        }
        self.counters.foreign_completions += 1;
        log::debug!("ignoring a completion no connection of this reactor posted: {wc:?}");
    }

    /// The connection whose QP is `qpn` and had windows bound on it before
    /// it came (a QP number is unique among live QPs; requiring binds keeps
    /// a stale completion of a destroyed QP whose number was reused from
    /// failing a connection that never bound a window).
    #[cold]
    fn bound_on(&self, qpn: u32) -> Option<Key> {
        self.conns
            .iter()
            .find(|(_, conn)| conn.qpn() == qpn && conn.binds() > 0)
            .map(|(key, _)| key)
    }

    /// A failed completion, or one for a closed connection: give back the
    /// receive slot it held and, if it failed, fail the connection.
    #[cold]
    #[inline(never)]
    pub(super) fn dispatch_unusual(&mut self, key: Key, wc: &WorkCompletion, completed: Completed) {
        let Some(conn) = self.conns.get_mut(key) else {
            return;
        };
        if let Completed::Recv { slot } = completed {
            // A receive slot of the SRQ is everyone's: it goes back even when
            // its connection is closed or the receive failed (for a QP's own
            // ring of a dead connection this does nothing).
            conn.queue_repost(slot);
            self.idle.work_left();
        }
        if !conn.state().is_closed() {
            let error = wc
                .ok()
                .err()
                .unwrap_or(Error::InvalidArgument("failed completion"));
            self.fail(ConnId(key), error);
        }
        if let Completed::Send { seq } = completed {
            self.retire_failed(key, seq);
        }
    }

    /// A completion of `seq` on failed connection `key`: the requests it
    /// proves done give their forwards' receive slots back (the device no
    /// longer reads them) and their registrations go.
    #[cold]
    fn retire_failed(&mut self, key: Key, seq: u32) {
        let mut released = Vec::new();
        if let Some(conn) = self.conns.get_mut(key) {
            conn.retire_failed(seq, |origin, slot, from_srq| {
                released.push((origin, slot, from_srq));
            });
        }
        if !released.is_empty() {
            self.idle.work_left();
            self.release_forwarded(released);
        }
    }

    /// A peer consumed a receive beyond its grant (see
    /// [`Error::CreditOverrun`]): the receive is not delivered, its slot
    /// goes back (to the SRQ, where it belongs to everyone), and the
    /// connection fails like any other: its QP goes to the error state
    /// here, before the next completion is routed, so the peer can take no
    /// more SRQ receives, and the handler is told. Receives the peer
    /// consumed meanwhile still complete on its QP; they reach the closed
    /// connection, undelivered, and their slots go back too
    /// (`dispatch_unusual`), with this pass's flush for those this pass
    /// polls, or, once the session is removed, the SRQ pool reclaims them.
    /// (How many that can be: `ReactorConfig::srq_depth`.)
    #[cold]
    #[inline(never)]
    pub(super) fn overrun(&mut self, key: Key, slot: u32) {
        self.cut_off(key, slot, |conn, peer| conn.overrun_error().with_peer(peer));
    }

    /// Cuts off the peer of `key`, whose SEND into `slot` is none the
    /// reactor sends (`what`): it does not speak the protocol, and nothing
    /// it sends can be trusted.
    #[cold]
    #[inline(never)]
    pub(super) fn malformed(&mut self, key: Key, slot: u32, what: &'static str) {
        self.cut_off(key, slot, |conn, peer| Error::MalformedMessage {
            qpn: conn.qpn(),
            peer,
            what,
        });
    }

    /// Fails connection `key` with the error `error` makes of it and its
    /// peer's address, giving back the receive slot `slot` its peer's last
    /// SEND took (undelivered).
    fn cut_off(
        &mut self,
        key: Key,
        slot: u32,
        error: impl FnOnce(&Conn, Option<std::net::SocketAddr>) -> Error,
    ) {
        let Some(conn) = self.conns.get_mut(key) else {
            return;
        };
        // Named here already (fail would too) so the log line says who.
        let peer = self
            .sessions
            .get(conn.session())
            .and_then(|record| record.link().peer());
        let error = error(conn, peer);
        log::warn!("cutting off a peer: {error}");
        conn.queue_repost(slot);
        self.fail(ConnId(key), error);
    }

    /// Fails the connections whose doorbell rung alone from a callback
    /// (`Ctx::read_now`, `Ctx::write_now`) the device refused, unless
    /// something failed them already. Their handlers may ring more while
    /// told; a refused one of another connection is failed in turn.
    #[cold]
    #[inline(never)]
    pub(super) fn fail_refused(&mut self) {
        while let Some((id, error)) = self.deferred.refused.pop() {
            if self
                .conns
                .get(id.key())
                .is_some_and(|conn| !conn.state().is_closed())
            {
                self.fail(id, error);
            }
        }
    }

    #[cold]
    pub(super) fn fail(&mut self, id: ConnId, error: Error) {
        // The failed connection's forwards give other connections' receive
        // slots back: the next pass must repost them.
        self.idle.work_left();
        // Forwards the failed connection had only staged carried other
        // connections' receive slots: give those back (a cold path, so the
        // list may allocate). Posted ones give theirs back as their flushed
        // completions come (`retire_failed`), or when the QP is destroyed.
        let mut released = Vec::new();
        let Some(conn) = self.conns.get_mut(id.key()) else {
            return;
        };
        conn.fail(|origin, slot, from_srq| released.push((origin, slot, from_srq)));
        // Stops the QP, so the peer sees the failure too.
        conn.stop_qp();
        let session = conn.session();
        self.release_forwarded(released);
        let mut ctx = reactor_ctx!(self);
        if let Some(record) = self.sessions.get_mut(session) {
            // A failed completion or a credit overrun names its peer.
            let error = error.with_peer(record.link().peer());
            record.handler_mut().on_error(&mut ctx, id, &error);
        }
    }
}
