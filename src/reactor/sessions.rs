//! The sessions a reactor serves: for each, its handler, its link to the
//! peer, its connections and the CQ entries they reserved, addressed by
//! generation-checked [`SessionId`]s that are never reused for a newcomer.

use std::collections::TryReserveError;

use super::ConnId;
use super::config::SessionId;
use super::idle_list::IdleList;
use super::slab::Slab;

/// One session: its handler, its link to the peer and its connections.
pub(crate) struct Session<H, L> {
    handler: H,
    link: L,
    conns: Vec<ConnId>,
    /// CQ entries its connections reserved, by CQ index.
    cq_charges: Vec<(usize, u32)>,
    /// The peer watch found the peer gone (and told the handler).
    gone: bool,
    /// Its place on the sessions' idle list, while listed.
    idle_place: Option<usize>,
}

/// What a removed session hands back.
pub(crate) struct Removed<H, L> {
    pub(crate) handler: H,
    pub(crate) link: L,
    pub(crate) conns: Vec<ConnId>,
    pub(crate) cq_charges: Vec<(usize, u32)>,
    /// The peer watch found the peer gone (and stopped watching its link).
    pub(crate) gone: bool,
}

impl<H, L> Session<H, L> {
    pub(crate) fn handler(&self) -> &H {
        &self.handler
    }

    #[inline]
    pub(crate) fn handler_mut(&mut self) -> &mut H {
        &mut self.handler
    }

    pub(crate) fn link(&self) -> &L {
        &self.link
    }

    pub(crate) fn link_mut(&mut self) -> &mut L {
        &mut self.link
    }

    /// The handler with the session's connections, in QP order.
    pub(crate) fn handler_and_conns(&mut self) -> (&mut H, &[ConnId]) {
        (&mut self.handler, &self.conns)
    }

    /// Whether the peer watch found the peer gone.
    pub(crate) fn is_gone(&self) -> bool {
        self.gone
    }

    /// The peer watch found the peer gone (said once: it stays so).
    pub(crate) fn mark_gone(&mut self) {
        self.gone = true;
    }
}

/// The sessions of one reactor.
pub(crate) struct Sessions<H, L> {
    slab: Slab<Session<H, L>>,
    /// The sessions whose handlers' `on_idle` runs on the next pass that
    /// finds nothing, by slab index (a removal takes its index off).
    idle: IdleList<u32>,
}

impl<H, L> Sessions<H, L> {
    /// At most `limit` sessions, with room for `reserve` reserved, whose
    /// ids name `owner` (a reactor's unique id).
    pub(crate) fn new(limit: usize, owner: u64, reserve: usize) -> Result<Self, TryReserveError> {
        let slab = Slab::new(limit, owner).reserving(reserve)?;
        Ok(Self {
            slab,
            idle: IdleList::with_capacity(reserve)?,
        })
    }

    /// The id the next [`insert`](Self::insert) gives, or `None` when full.
    pub(crate) fn vacant_id(&self) -> Option<SessionId> {
        self.slab.vacant_key().map(SessionId)
    }

    /// Stores a session under [`vacant_id`](Self::vacant_id)'s id.
    pub(crate) fn insert(
        &mut self,
        handler: H,
        link: L,
        conns: Vec<ConnId>,
        cq_charges: Vec<(usize, u32)>,
    ) -> Option<SessionId> {
        let session = Session {
            handler,
            link,
            conns,
            cq_charges,
            gone: false,
            idle_place: Some(self.idle.len()),
        };
        let id = self.slab.insert(session).map(SessionId)?;
        self.idle.join(id.0.index);
        Some(id)
    }

    /// Takes session `id` out; its id is never given again.
    pub(crate) fn remove(&mut self, id: SessionId) -> Option<Removed<H, L>> {
        let session = self.slab.remove(id.0)?;
        if let Some(place) = session.idle_place {
            self.drop_idle(place);
        }
        Some(Removed {
            handler: session.handler,
            link: session.link,
            conns: session.conns,
            cq_charges: session.cq_charges,
            gone: session.gone,
        })
    }

    /// Sessions served now.
    pub(crate) fn len(&self) -> usize {
        self.slab.len()
    }

    #[inline]
    pub(crate) fn get(&self, id: SessionId) -> Option<&Session<H, L>> {
        self.slab.get(id.0)
    }

    #[inline]
    pub(crate) fn get_mut(&mut self, id: SessionId) -> Option<&mut Session<H, L>> {
        self.slab.get_mut(id.0)
    }

    /// The handler of session `id`.
    #[inline]
    pub(crate) fn handler_mut(&mut self, id: SessionId) -> Option<&mut H> {
        self.slab.get_mut(id.0).map(|session| &mut session.handler)
    }

    /// The session at slab index `index` (a wait's token), whatever its
    /// generation.
    pub(crate) fn get_by_index_mut(
        &mut self,
        index: u32,
    ) -> Option<(SessionId, &mut Session<H, L>)> {
        self.slab
            .get_by_index_mut(index)
            .map(|(key, session)| (SessionId(key), session))
    }

    /// The connections of session `id`, in QP order (none once removed).
    pub(crate) fn conns(&self, id: SessionId) -> impl Iterator<Item = ConnId> + '_ {
        self.slab
            .get(id.0)
            .into_iter()
            .flat_map(|session| session.conns.iter().copied())
    }

    pub(crate) fn ids(&self) -> impl Iterator<Item = SessionId> + '_ {
        self.slab.iter().map(|(key, _)| SessionId(key))
    }

    pub(crate) fn iter_mut(&mut self) -> impl Iterator<Item = (SessionId, &mut Session<H, L>)> {
        self.slab
            .iter_mut()
            .map(|(key, session)| (SessionId(key), session))
    }

    /// The session at place `at` of the idle list, with its handler: a
    /// walk asks from 0 up, and after [`idle_done`](Self::idle_done) asks
    /// the same place again.
    #[inline]
    pub(crate) fn idle_at(&mut self, at: usize) -> Option<(SessionId, &mut H)> {
        let index = self.idle.get(at)?;
        // A listed index holds a live session: a removal takes its place
        // off the list before the entry can take a newcomer. Were it ever
        // not so, the place is dropped (this walk ends there, the next
        // goes past it).
        match self.slab.get_by_index_quiet(index) {
            Some((key, session)) => Some((SessionId(key), &mut session.handler)),
            None => {
                debug_assert!(false, "a listed session is live");
                self.idle.drop_at(at);
                None
            }
        }
    }

    /// The session at place `at` of the idle list asked not to be called
    /// again ([`Idle::Done`](super::Idle::Done)).
    pub(crate) fn idle_done(&mut self, at: usize) {
        if let Some(index) = self.idle.get(at)
            && let Some((_, session)) = self.slab.get_by_index_quiet(index)
        {
            session.idle_place = None;
        }
        self.drop_idle(at);
    }

    /// Takes place `place` off the idle list; the session moved into it
    /// learns its new place.
    fn drop_idle(&mut self, place: usize) {
        if place >= self.idle.len() {
            return;
        }
        if let Some(moved) = self.idle.drop_at(place)
            && let Some((_, session)) = self.slab.get_by_index_quiet(moved)
        {
            session.idle_place = Some(place);
        }
    }

    /// Sessions whose handlers' `on_idle` runs on the next empty pass.
    #[cfg(test)]
    pub(crate) fn idle_len(&self) -> usize {
        self.idle.len()
    }

    /// See [`Slab::age_vacant`].
    #[cfg(test)]
    pub(crate) fn age_vacant(&mut self, generation: u32) -> bool {
        self.slab.age_vacant(generation)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_removed_sessions_id_reaches_nothing_and_hands_everything_back() {
        let mut sessions: Sessions<&str, u8> = Sessions::new(2, 1, 2).unwrap();
        let id = sessions.vacant_id().unwrap();
        assert_eq!(sessions.insert("h", 7, Vec::new(), vec![(0, 3)]), Some(id));
        assert_eq!(sessions.ids().collect::<Vec<_>>(), vec![id]);
        let session = sessions.get_mut(id).unwrap();
        assert!(!session.is_gone());
        session.mark_gone();
        *session.link_mut() = 8;
        assert_eq!(sessions.handler_mut(id).map(|h| *h), Some("h"));
        let removed = sessions.remove(id).unwrap();
        assert_eq!(
            (
                removed.handler,
                removed.link,
                removed.gone,
                removed.cq_charges
            ),
            ("h", 8, true, vec![(0, 3)])
        );
        assert!(sessions.get(id).is_none());
        assert!(sessions.conns(id).next().is_none());
        let next = sessions.insert("n", 0, Vec::new(), Vec::new()).unwrap();
        assert_eq!(next.0.index, id.0.index, "the entry is reused");
        assert!(sessions.handler_mut(id).is_none(), "the old id misses it");
        assert_eq!(sessions.len(), 1);
    }

    /// The idle list: newcomers are on it, a session that is done and a
    /// removed one leave it, and the sessions moved into their places are
    /// still found and removed in one step.
    #[test]
    fn the_idle_list_keeps_every_listed_session_and_only_those() {
        let mut sessions: Sessions<u32, ()> = Sessions::new(8, 1, 8).unwrap();
        let ids: Vec<SessionId> = (0..5)
            .map(|n| sessions.insert(n, (), Vec::new(), Vec::new()).unwrap())
            .collect();
        let listed = |sessions: &mut Sessions<u32, ()>| {
            let mut handlers = Vec::new();
            let mut at = 0;
            while let Some((id, handler)) = sessions.idle_at(at) {
                assert_eq!(sessions_handler(id), *handler);
                handlers.push(*handler);
                at += 1;
            }
            handlers.sort_unstable();
            handlers
        };
        fn sessions_handler(id: SessionId) -> u32 {
            id.0.index
        }
        assert_eq!(listed(&mut sessions), vec![0, 1, 2, 3, 4]);
        // Session 0 is done: 4 moves into its place.
        sessions.idle_done(0);
        assert_eq!(listed(&mut sessions), vec![1, 2, 3, 4]);
        // Removing the moved one and another takes each off in one step.
        sessions.remove(ids[4]).unwrap();
        sessions.remove(ids[2]).unwrap();
        assert_eq!(listed(&mut sessions), vec![1, 3]);
        assert_eq!(sessions.idle_len(), 2);
        // Removing a session that is done leaves the list as it is.
        sessions.remove(ids[0]).unwrap();
        assert_eq!(listed(&mut sessions), vec![1, 3]);
        let newcomer = sessions.insert(9, (), Vec::new(), Vec::new()).unwrap();
        assert_eq!(sessions.handler_mut(newcomer), Some(&mut 9));
        assert_eq!(sessions.idle_len(), 3);
    }
}
