//! The handlers of a reactor's datagram endpoints, by the endpoints'
//! places, and which of them want `on_idle`: apart from the endpoint
//! table, which a callback's `Ctx` borrows while a handler runs.

use crate::reactor::idle_list::IdleList;

/// Each endpoint place's handler, if an endpoint holds the place, and the
/// places whose handlers' `on_idle` runs on the next pass that finds
/// nothing.
pub(crate) struct DatagramHandlers<H> {
    places: Vec<Option<H>>,
    idle: IdleList<usize>,
}

impl<H> Default for DatagramHandlers<H> {
    fn default() -> Self {
        Self {
            places: Vec::new(),
            idle: IdleList::new(),
        }
    }
}

impl<H> DatagramHandlers<H> {
    /// The handler of the endpoint that takes place `place` (its `on_idle`
    /// runs on the next empty pass).
    pub(crate) fn insert(&mut self, place: usize, handler: H) {
        if self.places.len() <= place {
            self.places.resize_with(place + 1, || None);
        }
        self.places[place] = Some(handler);
        self.idle.leave(place);
        self.idle.join(place);
    }

    /// Takes the handler of place `place` out, its endpoint gone.
    pub(crate) fn take(&mut self, place: usize) -> Option<H> {
        self.idle.leave(place);
        self.places.get_mut(place)?.take()
    }

    pub(crate) fn get(&self, place: usize) -> Option<&H> {
        self.places.get(place)?.as_ref()
    }

    #[inline]
    pub(crate) fn get_mut(&mut self, place: usize) -> Option<&mut H> {
        self.places.get_mut(place)?.as_mut()
    }

    /// Every handler, by place.
    pub(crate) fn into_places(self) -> Vec<Option<H>> {
        self.places
    }

    /// The handler at place `at` of the idle list (see
    /// [`Sessions::idle_at`](crate::reactor::sessions::Sessions::idle_at)).
    pub(crate) fn idle_at(&mut self, at: usize) -> Option<&mut H> {
        let place = self.idle.get(at)?;
        // A listed place holds a handler: `take` takes it off the list. Were
        // it ever not so, the place is dropped (this walk ends there, the
        // next goes past it).
        match self.places.get_mut(place).and_then(Option::as_mut) {
            Some(handler) => Some(handler),
            None => {
                debug_assert!(false, "a listed place holds a handler");
                self.idle.drop_at(at);
                None
            }
        }
    }

    /// The handler at place `at` of the idle list asked not to be called
    /// again.
    pub(crate) fn idle_done(&mut self, at: usize) {
        self.idle.drop_at(at);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_place_taken_again_is_listed_once_and_a_taken_one_not_at_all() {
        let mut handlers = DatagramHandlers::default();
        handlers.insert(2, "a");
        handlers.insert(0, "b");
        assert_eq!(handlers.take(2), Some("a"));
        handlers.insert(2, "c");
        handlers.insert(2, "d");
        let mut seen = Vec::new();
        let mut at = 0;
        while let Some(handler) = handlers.idle_at(at) {
            seen.push(*handler);
            at += 1;
        }
        seen.sort_unstable();
        assert_eq!(seen, vec!["b", "d"]);
        handlers.idle_done(0);
        assert!(handlers.idle_at(1).is_none());
        assert_eq!(handlers.take(9), None);
        assert_eq!(handlers.get(0), Some(&"b"));
    }
}
