//! Records addressed by generation-checked ids that are reused: a removed
//! record frees its entry, and the entry's next tenant gets a new
//! generation, so an id kept past removal never reaches the newcomer. Every
//! key also names the slab's owner (its reactor), so a key of another
//! reactor's slab never reaches a record here either.
//!
//! Generations never repeat: an entry whose generation would wrap (its
//! 2^32nd tenant is removed) is retired for good instead of being reused,
//! so a key kept for however long never matches a later tenant. Each
//! retirement leaks one entry (a few bytes, and one index of the slab's
//! index space) after at least 2^32 removals at that index.

use std::collections::TryReserveError;

/// Where a record lives and which tenant of that entry it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct Key {
    pub(crate) index: u32,
    pub(crate) generation: u32,
    /// The owner of the slab the key came from (a reactor's unique id).
    pub(crate) owner: u64,
}

struct Entry<T> {
    generation: u32,
    /// The index is in `lists[list]` (see [`Slab::tracking`]), by list.
    listed: [bool; LISTS],
    value: Option<T>,
}

/// A slab of at most `limit` records, live or waiting for reuse.
pub(crate) struct Slab<T> {
    entries: Vec<Entry<T>>,
    free: Vec<u32>,
    /// Entries freed but not yet reusable (see [`Slab::quarantining`]).
    quarantine: Vec<u32>,
    quarantining: bool,
    live: usize,
    /// Most entries live, free or quarantined at once (retired ones are not
    /// counted: see [`Slab::remove`]).
    limit: usize,
    /// Entries ever used, retired ones included, stay below this: the
    /// index space of the keys (see [`Slab::indexed_below`]).
    index_bound: u32,
    /// Entries retired for good, their generations spent.
    retired: usize,
    /// The count of the last [`Slab::reserving`] (at most `limit`), which
    /// a retirement keeps good.
    reserved: usize,
    owner: u64,
    /// Whether mutable access lists the entry as touched.
    tracking: bool,
    /// By list ([`TOUCHED`], [`PARKED`], [`ROOM`]): the entries listed and not yet
    /// walked, each once. Capacities follow the entries (reserved when an
    /// entry is added), so listing never allocates.
    lists: [Vec<u32>; LISTS],
    /// By list: positions the current walk has passed (unlisted), which
    /// `end_walk` drops. Kept here, not by the walker, so a walk cut short
    /// (a handler's panic caught around `poll_once`) is finished by the
    /// next `begin_walk` rather than leaving stale positions behind.
    walked: [usize; LISTS],
}

const LISTS: usize = 3;
/// Entries mutably accessed (see [`Slab::tracking`]).
pub(crate) const TOUCHED: usize = 0;
/// Entries their owner parked for later ([`Slab::park`]).
pub(crate) const PARKED: usize = 1;
/// Entries whose owner has news for later in the pass ([`Slab::list_room`]):
/// connections whose handlers wait to be told that room is back, and have it.
pub(crate) const ROOM: usize = 2;

impl<T> Slab<T> {
    /// An empty slab whose keys name `owner`, which must be unique among
    /// the slabs keys could be mixed up between.
    pub(crate) fn new(limit: usize, owner: u64) -> Self {
        Self {
            entries: Vec::new(),
            free: Vec::new(),
            quarantine: Vec::new(),
            quarantining: false,
            live: 0,
            limit,
            index_bound: u32::MAX,
            retired: 0,
            reserved: 0,
            owner,
            tracking: false,
            lists: [Vec::new(), Vec::new(), Vec::new()],
            walked: [0; LISTS],
        }
    }

    /// Keeps every index below `bound`, for keys whose index travels in
    /// fewer bits than a `u32` (a `wr_id`'s): an insert is refused once
    /// every index below it is used, retired entries included. By default
    /// the whole `u32` range.
    pub(crate) fn indexed_below(mut self, bound: u32) -> Self {
        self.index_bound = bound;
        self
    }

    /// Every mutable access lists its entry until a walk of the
    /// [`TOUCHED`] list passes it ([`unlist_at`](Self::unlist_at)): the
    /// reactor then flushes only
    /// the connections something may have changed, instead of walking all
    /// of them on every busy pass. Listing is by construction: a record can
    /// only change through `&mut`, and every `&mut` path of the slab lists,
    /// except [`get_by_index_quiet`](Self::get_by_index_quiet), whose
    /// caller lists what it leaves unfinished,
    /// [`get_by_index_if`](Self::get_by_index_if), whose caller lists what
    /// the change left work or flushes it itself, and
    /// [`get_mut_quiet`](Self::get_mut_quiet), for changes that leave the
    /// flush nothing to do (a direct connection's, a retired send's: the
    /// dispatch checks this in debug builds) or whose caller lists or
    /// flushes the record itself (a forward's slot given back to its
    /// origin, a callback's work on the connection it was called for).
    pub(crate) fn tracking(mut self) -> Self {
        self.tracking = true;
        self
    }

    /// Whether entry `index` is on list `list` (always, when the slab does
    /// not track): for the checks of debug builds and for tests.
    #[cfg(any(test, debug_assertions))]
    pub(crate) fn is_listed(&self, list: usize, index: u32) -> bool {
        !self.tracking
            || self
                .entries
                .get(index as usize)
                .is_some_and(|entry| entry.listed[list])
    }

    /// Lists entry `index` as touched (once).
    #[inline]
    pub(crate) fn touch(&mut self, index: u32) {
        if self.tracking {
            self.mark(TOUCHED, index);
        }
    }

    /// Lists entry `index` in the parked list (once): work its owner left
    /// for later, found again by a walk of the [`PARKED`] list instead of
    /// a walk over every entry. The mark stays with the index: a
    /// newcomer in a parked entry is visited once for nothing.
    #[inline]
    pub(crate) fn park(&mut self, index: u32) {
        if self.tracking {
            self.mark(PARKED, index);
        }
    }

    /// Lists entry `index` in the [`ROOM`] list (once).
    #[cold]
    pub(crate) fn list_room(&mut self, index: u32) {
        if self.tracking {
            self.mark(ROOM, index);
        }
    }

    /// True if some entry is on `list` and not yet walked.
    #[inline(always)]
    pub(crate) fn has_listed(&self, list: usize) -> bool {
        !self.lists[list].is_empty()
    }

    #[inline]
    fn mark(&mut self, list: usize, index: u32) {
        if let Some(entry) = self.entries.get_mut(index as usize) {
            list_entry(&mut self.lists[list], &mut entry.listed[list], index);
        }
    }

    /// True if some entry was touched and not yet walked.
    #[inline]
    pub(crate) fn has_touched(&self) -> bool {
        !self.lists[TOUCHED].is_empty()
    }

    /// Starts a walk over `list`: returns how many entries it holds, each
    /// once, in the order first listed. Call [`unlist_at`](Self::unlist_at)
    /// for each position below that, then [`end_walk`](Self::end_walk): the
    /// walk moves nothing and allocates nothing. (Finishes first a walk
    /// that was cut short.)
    #[inline]
    pub(crate) fn begin_walk(&mut self, list: usize) -> usize {
        if self.walked[list] != 0 {
            self.end_walk(list);
        }
        self.lists[list].len()
    }

    /// The entry at position `at` of `list`, unlisted: it can be listed
    /// again while the walk goes on, at the end, past the walk. `None`
    /// past the end.
    #[inline]
    pub(crate) fn unlist_at(&mut self, list: usize, at: usize) -> Option<u32> {
        let index = *self.lists[list].get(at)?;
        self.walked[list] = at + 1;
        if let Some(entry) = self.entries.get_mut(index as usize) {
            entry.listed[list] = false;
        }
        Some(index)
    }

    /// Ends a walk of `list`: drops the positions it passed and keeps what
    /// was listed since.
    #[inline]
    pub(crate) fn end_walk(&mut self, list: usize) {
        let walked = std::mem::take(&mut self.walked[list]);
        let listed = &mut self.lists[list];
        if walked >= listed.len() {
            listed.clear();
        } else {
            listed.drain(..walked);
        }
    }

    /// Freed entries wait in quarantine until
    /// [`release_quarantine`](Self::release_quarantine) says nothing can
    /// name them any more: for records whose ids also travel outside (in
    /// `wr_id`s of completions still queued), so a newcomer in the entry
    /// never sees them.
    pub(crate) fn quarantining(mut self) -> Self {
        self.quarantining = true;
        self
    }

    /// Room for `count` entries (at most the limit; live ones and those
    /// removed but still quarantined count alike) and their bookkeeping, so
    /// that adding up to that many grows no vector: no record moves and
    /// nothing is allocated. The quarantine and the lists are sized whether
    /// or not the slab uses them (a few bytes an entry), so the order of
    /// the builder calls does not matter. An allocation refused is an error,
    /// not an abort. An entry retired later (see [`remove`](Self::remove))
    /// does not eat into the reservation: the removal that retires it
    /// reserves room for one more entry.
    pub(crate) fn reserving(mut self, count: usize) -> Result<Self, TryReserveError> {
        let count = count.min(self.limit);
        self.reserved = count;
        self.entries.try_reserve_exact(count)?;
        self.free.try_reserve_exact(count)?;
        self.quarantine.try_reserve_exact(count)?;
        // As `insert` reserves: every entry twice in every list.
        for list in self.lists.iter_mut() {
            list.try_reserve_exact(count.saturating_mul(2))?;
        }
        Ok(self)
    }

    /// Entries in quarantine now.
    #[inline]
    pub(crate) fn quarantined(&self) -> usize {
        self.quarantine.len()
    }

    /// Makes the first `count` quarantined entries reusable.
    pub(crate) fn release_quarantine(&mut self, count: usize) {
        let count = count.min(self.quarantine.len());
        self.free.extend(self.quarantine.drain(..count));
    }

    fn key(&self, index: u32, generation: u32) -> Key {
        Key {
            index,
            generation,
            owner: self.owner,
        }
    }

    /// The entry `key` names, if it is this slab's and of that generation.
    #[inline]
    fn entry(&self, key: Key) -> Option<&Entry<T>> {
        let entry = self.entries.get(key.index as usize)?;
        (key.owner == self.owner && entry.generation == key.generation).then_some(entry)
    }

    #[inline]
    fn entry_mut(&mut self, key: Key) -> Option<&mut Entry<T>> {
        let owner = self.owner;
        let entry = self.entries.get_mut(key.index as usize)?;
        (key.owner == owner && entry.generation == key.generation).then_some(entry)
    }

    /// Live records.
    pub(crate) fn len(&self) -> usize {
        self.live
    }

    /// The key the next `insert` will use, or `None` when full: `limit`
    /// entries are live, free or quarantined, or every index below the
    /// bound is used.
    pub(crate) fn vacant_key(&self) -> Option<Key> {
        if let Some(&index) = self.free.last() {
            let generation = self.entries[index as usize].generation;
            return Some(self.key(index, generation));
        }
        let used = self.entries.len();
        (used - self.retired < self.limit && used < self.index_bound as usize)
            .then(|| self.key(used as u32, 0))
    }

    /// Stores `value` under [`vacant_key`](Self::vacant_key); `None` when full.
    pub(crate) fn insert(&mut self, value: T) -> Option<Key> {
        let key = self.vacant_key()?;
        match self.free.pop() {
            Some(_) => self.entries[key.index as usize].value = Some(value),
            None => {
                if self.tracking {
                    // Room to list every entry twice in every list, so
                    // the data path never grows them: during a walk, the
                    // positions walked stay until its end, and each entry
                    // may be listed once more behind them.
                    let wanted = 2 * (self.entries.len() + 1);
                    for list in self.lists.iter_mut() {
                        list.reserve(wanted.saturating_sub(list.len()));
                    }
                }
                self.entries.push(Entry {
                    generation: 0,
                    listed: [false; LISTS],
                    value: Some(value),
                });
            }
        }
        self.live += 1;
        // A newcomer counts as changed: whatever it was built with (a
        // connection's first credit update) goes out with the next flush.
        self.touch(key.index);
        Some(key)
    }

    /// Takes the record out; its entry is reused with the next generation,
    /// or, if its generation is the last (`u32::MAX`), retired: never
    /// reused, so no generation of it comes back. A retired entry keeps its
    /// index (no later entry takes it) but does not count against `limit`:
    /// the slab still holds `limit` records, in fresh entries, until the
    /// index space (see [`indexed_below`](Self::indexed_below)) runs out.
    pub(crate) fn remove(&mut self, key: Key) -> Option<T> {
        let entry = self.entry_mut(key)?;
        let value = entry.value.take()?;
        let next = entry.generation.checked_add(1);
        if let Some(next) = next {
            entry.generation = next;
        }
        self.live -= 1;
        match next {
            Some(_) if self.quarantining => self.quarantine.push(key.index),
            Some(_) => self.free.push(key.index),
            None => self.retire(),
        }
        Some(value)
    }

    /// For tests: the entry the next insert reuses (the last freed one)
    /// takes generation `generation`, so a test reaches the end of its
    /// generations without 2^32 removals. False if no freed entry waits.
    #[cfg(test)]
    pub(crate) fn age_vacant(&mut self, generation: u32) -> bool {
        let Some(&index) = self.free.last() else {
            return false;
        };
        self.entries[index as usize].generation = generation;
        true
    }

    /// Entries retired for good (tests and diagnostics).
    #[cfg(test)]
    pub(crate) fn retired(&self) -> usize {
        self.retired
    }

    /// Notes an entry retired (its generations spent: it is on no list of
    /// reusable entries, empty for good), and keeps the reservation good:
    /// room for one more entry, as the retired one holds its place. (A
    /// refused allocation only means a later insert beyond the reservation
    /// may grow the tables, as any insert beyond it does.)
    #[cold]
    fn retire(&mut self) {
        self.retired += 1;
        let wanted = self.reserved.saturating_add(self.retired);
        let _ = self
            .entries
            .try_reserve_exact(wanted.saturating_sub(self.entries.len()));
        for list in self.lists.iter_mut() {
            let _ = list.try_reserve_exact(wanted.saturating_mul(2).saturating_sub(list.len()));
        }
    }

    /// The owner every key of this slab names.
    #[inline]
    pub(crate) fn owner(&self) -> u64 {
        self.owner
    }

    #[inline]
    pub(crate) fn get(&self, key: Key) -> Option<&T> {
        self.entry(key)?.value.as_ref()
    }

    /// As [`get_mut`](Self::get_mut), without listing the record as
    /// touched: for a record the flush has nothing to do with.
    #[inline]
    pub(crate) fn get_mut_quiet(&mut self, key: Key) -> Option<&mut T> {
        let entry = self.entries.get_mut(key.index as usize)?;
        if key.owner != self.owner || entry.generation != key.generation {
            return None;
        }
        entry.value.as_mut()
    }

    #[inline]
    pub(crate) fn get_mut(&mut self, key: Key) -> Option<&mut T> {
        // One lookup: the entry and the list are separate fields.
        let owner = self.owner;
        let entry = self.entries.get_mut(key.index as usize)?;
        if key.owner != owner || entry.generation != key.generation {
            return None;
        }
        if self.tracking {
            list_entry(
                &mut self.lists[TOUCHED],
                &mut entry.listed[TOUCHED],
                key.index,
            );
        }
        entry.value.as_mut()
    }

    /// The record at `index` with its key, if `accept` takes it (`Ok`),
    /// not listed: one lookup for a caller that must vet a record (a
    /// completion's claim to be its) and lists it, or has it flushed, once
    /// it knows what the change left. `vacant` is the error when no record
    /// is there.
    #[inline]
    pub(crate) fn get_by_index_if<E>(
        &mut self,
        index: u32,
        vacant: E,
        accept: impl FnOnce(Key, &mut T) -> Result<(), E>,
    ) -> Result<(Key, &mut T), E> {
        let Some(entry) = self.entries.get_mut(index as usize) else {
            return Err(vacant);
        };
        let key = Key {
            index,
            generation: entry.generation,
            owner: self.owner,
        };
        let Some(value) = entry.value.as_mut() else {
            return Err(vacant);
        };
        accept(key, value)?;
        Ok((key, value))
    }

    /// The record at `index`, whatever its generation, with its key.
    #[inline]
    pub(crate) fn get_by_index_mut(&mut self, index: u32) -> Option<(Key, &mut T)> {
        self.touch(index);
        self.get_by_index_quiet(index)
    }

    /// As [`get_by_index_mut`](Self::get_by_index_mut), without listing the
    /// entry as touched: for the flush that works the list off (it lists
    /// again, with [`touch`](Self::touch), what it leaves unfinished).
    #[inline]
    pub(crate) fn get_by_index_quiet(&mut self, index: u32) -> Option<(Key, &mut T)> {
        let owner = self.owner;
        let entry = self.entries.get_mut(index as usize)?;
        let key = Key {
            index,
            generation: entry.generation,
            owner,
        };
        entry.value.as_mut().map(|value| (key, value))
    }

    /// The generation of the record last removed from the entry at
    /// `index`, while the entry waits in quarantine (until
    /// [`release_quarantine`](Self::release_quarantine): what the record
    /// left behind may still be about); `None` for an entry that is live,
    /// free, retired or never used. A walk over the quarantine: for cold
    /// paths.
    pub(crate) fn quarantined_generation(&self, index: u32) -> Option<u32> {
        let entry = self.entries.get(index as usize)?;
        // Removal moved a quarantined entry to its next generation.
        (entry.value.is_none() && self.quarantine.contains(&index))
            .then(|| entry.generation.wrapping_sub(1))
    }

    /// Entries ever used (live, free or retired): bounds for index loops.
    #[inline]
    pub(crate) fn capacity_used(&self) -> u32 {
        self.entries.len() as u32
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (Key, &T)> {
        (0..self.capacity_used()).filter_map(|index| {
            let entry = &self.entries[index as usize];
            let key = self.key(index, entry.generation);
            entry.value.as_ref().map(|value| (key, value))
        })
    }

    pub(crate) fn iter_mut(&mut self) -> impl Iterator<Item = (Key, &mut T)> {
        // Untracked slabs (the sessions', walked on every idle pass) skip
        // the listing loop altogether.
        if self.tracking {
            for index in 0..self.capacity_used() {
                self.mark(TOUCHED, index);
            }
        }
        let owner = self.owner;
        self.entries
            .iter_mut()
            .enumerate()
            .filter_map(move |(index, entry)| {
                let key = Key {
                    index: index as u32,
                    generation: entry.generation,
                    owner,
                };
                entry.value.as_mut().map(|value| (key, value))
            })
    }
}

/// Lists entry `index` in `list` unless its mark says it is there already.
/// On the fields, not the slab, so a caller holding the entry lists it
/// without looking it up again.
#[inline(always)]
fn list_entry(list: &mut Vec<u32>, listed: &mut bool, index: u32) {
    if !*listed {
        *listed = true;
        // Never beyond capacity: each entry is listed at most once beyond
        // the positions a walk has passed, and `insert` reserved room for
        // every entry twice.
        debug_assert!(list.len() < list.capacity());
        list.push(index);
    }
}

#[cfg(test)]
mod tests;
