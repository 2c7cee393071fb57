//! The peer watch: every session's link is asked now and then (and when
//! its control connection wakes a sleeping reactor) whether its peer is
//! still there, and a handler whose peer left is told once.

use std::time::{Duration, Instant};

use crate::session::PeerStatus;

use super::sessions::Session;
use super::{Handler, PeerLink, Reactor, SessionId, Waiter};

impl<H: Handler, L: PeerLink> Reactor<H, L> {
    /// Asks every session's link whether its peer is still there; a session
    /// whose peer is gone is told once. Its connections keep running: the
    /// peer's last completions may still be queued (a polite peer hangs up
    /// right after its last message), so the handler decides when to let go.
    /// Returns whether a handler was told (and so may have changed
    /// connections).
    #[cold]
    pub(super) fn check_peers(&mut self) -> bool {
        let mut gone: Vec<(SessionId, PeerStatus)> = Vec::new();
        // Every link is looked at: those still holding part of a frame set
        // the next recheck again.
        self.recheck_at = None;
        for (id, session) in self.sessions.iter_mut() {
            if let Some(status) = Self::check_one(&mut self.waiter, &mut self.recheck_at, session) {
                gone.push((id, status));
            }
        }
        self.tell_gone(gone)
    }

    /// Looks at the peers whose control connection woke the last wait.
    #[cold]
    pub(super) fn check_fired_peers(&mut self) {
        let mut gone: Vec<(SessionId, PeerStatus)> = Vec::new();
        for &token in &self.fired {
            let Some((id, session)) = self.sessions.get_by_index_mut(token as u32) else {
                continue;
            };
            if let Some(status) = Self::check_one(&mut self.waiter, &mut self.recheck_at, session) {
                gone.push((id, status));
            }
        }
        self.tell_gone(gone);
    }

    /// Checks one session's control connection, unless its peer is known
    /// gone already; a peer found gone is marked so, its connection (which
    /// stays readable at EOF) no longer wakes the wait, and its status is
    /// returned. A live link holding part of a frame moves `recheck_at`
    /// up to when it must be looked at again.
    fn check_one(
        waiter: &mut Waiter,
        recheck_at: &mut Option<Instant>,
        session: &mut Session<H, L>,
    ) -> Option<PeerStatus> {
        if session.is_gone() {
            return None;
        }
        let status = session.link_mut().check_peer();
        if matches!(status, PeerStatus::Alive) {
            // At least a millisecond (a zero would spin), and a time too far
            // to represent is no deadline at all.
            if let Some(within) = session.link().recheck_within()
                && let Some(at) = Instant::now().checked_add(within.max(Duration::from_millis(1)))
            {
                *recheck_at = Some(recheck_at.map_or(at, |earlier| earlier.min(at)));
            }
            return None;
        }
        session.mark_gone();
        if let Some(fd) = session.link().event_fd() {
            waiter.unwatch(fd);
        }
        Some(status)
    }

    /// Tells each handler whose peer is gone, after one more poll of the
    /// CQs: what the peer sent before its goodbye (acknowledged, so in our
    /// CQ before the goodbye left) reaches the handler first, whatever the
    /// order in which this pass saw the two.
    /// Returns whether any was told.
    fn tell_gone(&mut self, gone: Vec<(SessionId, PeerStatus)>) -> bool {
        if gone.is_empty() {
            return false;
        }
        if let Err(err) = self.one_pass() {
            log::warn!("polling before telling of peers gone: {err}");
        }
        for (session, status) in gone {
            let mut ctx = reactor_ctx!(self);
            if let Some(handler) = self.sessions.handler_mut(session) {
                handler.on_peer_gone(&mut ctx, session, &status);
            }
            self.idle.work_left();
        }
        true
    }
}
