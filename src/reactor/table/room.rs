//! The connections refused for want of room (a credit, a send-queue entry
//! or a send slot) whose handlers wait to be told it is back: a list the
//! end of each pass walks while it is not empty, so a pass pays for them
//! only while some wait, and never once per completion.

use std::collections::TryReserveError;

use crate::reactor::slab::Key;

/// What a look at a waiting connection found.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Wait<T> {
    /// It is gone or closed: off the list, untold.
    Gone,
    /// Still no room: it stays listed.
    Waiting,
    /// Room is back: off the list, and the handler is told (`T` says whom).
    Ready(T),
}

/// The waiting connections' keys, each listed once (the connection's own
/// flag says whether it is).
#[derive(Debug)]
pub(super) struct RoomWaits {
    keys: Vec<Key>,
    /// Where the walk begun by [`begin_walk`](Self::begin_walk) looks next.
    cursor: usize,
}

impl RoomWaits {
    /// An empty list with room for `reserve` connections reserved (one
    /// more waiting than that allocates, on that refusal's path).
    pub(super) fn with_capacity(reserve: usize) -> Result<Self, TryReserveError> {
        let mut keys = Vec::new();
        keys.try_reserve(reserve)?;
        Ok(Self { keys, cursor: 0 })
    }

    pub(super) fn push(&mut self, key: Key) {
        self.keys.push(key);
    }

    #[inline(always)]
    pub(super) fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Starts a walk from the first waiting connection; returns how many
    /// wait, the walk's budget of looks.
    pub(super) fn begin_walk(&mut self) -> usize {
        self.cursor = 0;
        self.keys.len()
    }

    /// Looks at the waiting connections from where the walk is, one look
    /// per unit of `budget`, until `look` finds one ready, which it
    /// returns, off the list. Connections listed during the walk may be
    /// looked at in it; the budget bounds the walk whatever the looks do.
    pub(super) fn next_ready<T>(
        &mut self,
        budget: &mut usize,
        mut look: impl FnMut(Key) -> Wait<T>,
    ) -> Option<T> {
        while *budget > 0 && self.cursor < self.keys.len() {
            *budget -= 1;
            match look(self.keys[self.cursor]) {
                Wait::Waiting => self.cursor += 1,
                Wait::Gone => {
                    self.keys.swap_remove(self.cursor);
                }
                Wait::Ready(told) => {
                    self.keys.swap_remove(self.cursor);
                    return Some(told);
                }
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(index: u32) -> Key {
        Key {
            index,
            generation: 0,
            owner: 1,
        }
    }

    /// A walk tells the ready ones, drops the gone ones untold, keeps the
    /// waiting ones for the next walk, and looks at no key twice.
    #[test]
    fn a_walk_tells_the_ready_drops_the_gone_and_keeps_the_rest() {
        let mut waits = RoomWaits::with_capacity(4).unwrap();
        for index in 0..4 {
            waits.push(key(index));
        }
        let mut looked = Vec::new();
        let mut budget = waits.begin_walk();
        let mut told = Vec::new();
        while let Some(index) = waits.next_ready(&mut budget, |k| {
            looked.push(k.index);
            match k.index {
                0 => Wait::Ready(0),
                1 => Wait::Gone,
                _ => Wait::Waiting,
            }
        }) {
            told.push(index);
        }
        assert_eq!(told, vec![0]);
        looked.sort_unstable();
        assert_eq!(looked, vec![0, 1, 2, 3], "each looked at once");
        assert_eq!(budget, 0);
        let mut left: Vec<u32> = waits.keys.iter().map(|k| k.index).collect();
        left.sort_unstable();
        assert_eq!(left, vec![2, 3], "the waiting stay listed");
        assert!(!waits.is_empty());
    }

    /// A look that lists a connection again (a handler refused once more)
    /// cannot keep the walk going: the budget ends it.
    #[test]
    fn the_budget_ends_a_walk_whose_looks_list_more() {
        let mut waits = RoomWaits::with_capacity(1).unwrap();
        waits.push(key(0));
        let mut budget = waits.begin_walk();
        let mut looks = 0;
        let mut told = 0;
        while waits
            .next_ready(&mut budget, |_| {
                looks += 1;
                Wait::Ready(())
            })
            .is_some()
        {
            told += 1;
            waits.push(key(0));
        }
        assert_eq!((looks, told), (1, 1));
        assert_eq!(waits.keys.len(), 1, "listed again, for the next walk");
    }
}
