//! The handlers whose `on_idle` the passes that find nothing call: those
//! that asked to be called again ([`Idle::Again`](super::Idle::Again)),
//! each listed once, so an empty pass costs what they do and nothing per
//! session or endpoint that has no use for it.

use std::collections::TryReserveError;

/// Keys (sessions, or endpoints' places) whose handlers' `on_idle` runs on
/// the next pass that finds nothing, in no particular order.
#[derive(Debug)]
pub(super) struct IdleList<K> {
    keys: Vec<K>,
}

impl<K: Copy + PartialEq> IdleList<K> {
    /// An empty list (listing allocates, when an endpoint is added).
    pub(super) fn new() -> Self {
        Self { keys: Vec::new() }
    }

    /// An empty list with room for `reserve` keys reserved (listing more
    /// allocates, when a session or endpoint is added).
    pub(super) fn with_capacity(reserve: usize) -> Result<Self, TryReserveError> {
        let mut keys = Vec::new();
        keys.try_reserve(reserve)?;
        Ok(Self { keys })
    }

    /// Lists `key` (a newcomer: its handler's `on_idle` runs at least
    /// once), last: at place [`len`](Self::len) before the call.
    pub(super) fn join(&mut self, key: K) {
        self.keys.push(key);
    }

    /// Takes `key` off the list, wherever it is (when its endpoint goes):
    /// a search, for short lists.
    pub(super) fn leave(&mut self, key: K) {
        if let Some(at) = self.keys.iter().position(|&listed| listed == key) {
            self.keys.swap_remove(at);
        }
    }

    /// The key at `at`: a walk asks from 0 up, and after
    /// [`drop_at`](Self::drop_at) asks the same place again.
    #[inline]
    pub(super) fn get(&self, at: usize) -> Option<K> {
        self.keys.get(at).copied()
    }

    /// Takes the key at `at` off the list (its handler asked not to be
    /// called again, or it is gone). The last key takes its place, and is
    /// returned, for an owner that keeps each key's place.
    pub(super) fn drop_at(&mut self, at: usize) -> Option<K> {
        self.keys.swap_remove(at);
        self.keys.get(at).copied()
    }

    /// Keys listed.
    pub(super) fn len(&self) -> usize {
        self.keys.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A walk that drops some keys still visits every key once.
    #[test]
    fn a_walk_that_drops_keys_visits_each_once() {
        let mut list = IdleList::with_capacity(4).unwrap();
        for key in 0..5u32 {
            list.join(key);
        }
        let mut visited = Vec::new();
        let mut at = 0;
        while let Some(key) = list.get(at) {
            visited.push(key);
            if key % 2 == 0 {
                list.drop_at(at);
            } else {
                at += 1;
            }
        }
        visited.sort_unstable();
        assert_eq!(visited, vec![0, 1, 2, 3, 4]);
        assert_eq!(list.len(), 2);
        list.leave(3);
        list.leave(7);
        assert_eq!(list.get(0), Some(1));
        assert_eq!(list.len(), 1);
    }
}
