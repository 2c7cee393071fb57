//! Records addressed by generation-checked ids that are reused: a removed
//! record frees its entry, and the entry's next tenant gets a new
//! generation, so an id kept past removal never reaches the newcomer.

/// Where a record lives and which tenant of that entry it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct Key {
    pub(crate) index: u32,
    pub(crate) generation: u32,
}

struct Entry<T> {
    generation: u32,
    value: Option<T>,
}

/// A slab of at most `limit` live records.
pub(crate) struct Slab<T> {
    entries: Vec<Entry<T>>,
    free: Vec<u32>,
    live: usize,
    limit: usize,
}

impl<T> Slab<T> {
    pub(crate) fn new(limit: usize) -> Self {
        Self {
            entries: Vec::new(),
            free: Vec::new(),
            live: 0,
            limit,
        }
    }

    /// Live records.
    pub(crate) fn len(&self) -> usize {
        self.live
    }

    /// The key the next `insert` will use, or `None` when full.
    pub(crate) fn vacant_key(&self) -> Option<Key> {
        if let Some(&index) = self.free.last() {
            let generation = self.entries[index as usize].generation;
            return Some(Key { index, generation });
        }
        (self.entries.len() < self.limit).then_some(Key {
            index: self.entries.len() as u32,
            generation: 0,
        })
    }

    /// Stores `value` under [`vacant_key`](Self::vacant_key); `None` when full.
    pub(crate) fn insert(&mut self, value: T) -> Option<Key> {
        let key = self.vacant_key()?;
        match self.free.pop() {
            Some(_) => self.entries[key.index as usize].value = Some(value),
            None => self.entries.push(Entry {
                generation: 0,
                value: Some(value),
            }),
        }
        self.live += 1;
        Some(key)
    }

    /// Takes the record out; its entry is reused with the next generation.
    pub(crate) fn remove(&mut self, key: Key) -> Option<T> {
        let entry = self.entries.get_mut(key.index as usize)?;
        if entry.generation != key.generation {
            return None;
        }
        let value = entry.value.take()?;
        entry.generation = entry.generation.wrapping_add(1);
        self.free.push(key.index);
        self.live -= 1;
        Some(value)
    }

    #[inline]
    pub(crate) fn get(&self, key: Key) -> Option<&T> {
        let entry = self.entries.get(key.index as usize)?;
        if entry.generation == key.generation {
            entry.value.as_ref()
        } else {
            None
        }
    }

    #[inline]
    pub(crate) fn get_mut(&mut self, key: Key) -> Option<&mut T> {
        let entry = self.entries.get_mut(key.index as usize)?;
        if entry.generation == key.generation {
            entry.value.as_mut()
        } else {
            None
        }
    }

    /// The record at `index`, whatever its generation, with its key.
    #[inline]
    pub(crate) fn get_by_index_mut(&mut self, index: u32) -> Option<(Key, &mut T)> {
        let entry = self.entries.get_mut(index as usize)?;
        let generation = entry.generation;
        entry
            .value
            .as_mut()
            .map(|value| (Key { index, generation }, value))
    }

    /// Entries ever used (live or free): bounds for index loops.
    #[inline]
    pub(crate) fn capacity_used(&self) -> u32 {
        self.entries.len() as u32
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (Key, &T)> {
        self.entries
            .iter()
            .enumerate()
            .filter_map(|(index, entry)| {
                let key = Key {
                    index: index as u32,
                    generation: entry.generation,
                };
                entry.value.as_ref().map(|value| (key, value))
            })
    }

    pub(crate) fn iter_mut(&mut self) -> impl Iterator<Item = (Key, &mut T)> {
        self.entries
            .iter_mut()
            .enumerate()
            .filter_map(|(index, entry)| {
                let key = Key {
                    index: index as u32,
                    generation: entry.generation,
                };
                entry.value.as_mut().map(|value| (key, value))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn removed_entries_are_reused_and_stale_keys_miss() {
        let mut slab = Slab::new(2);
        let a = slab.insert("a").unwrap();
        let b = slab.insert("b").unwrap();
        assert!(slab.insert("c").is_none(), "full at the limit");
        assert_eq!(slab.remove(a), Some("a"));
        assert_eq!(slab.remove(a), None, "removed twice");
        let c = slab.insert("c").unwrap();
        assert_eq!(c.index, a.index, "the entry is reused");
        assert_ne!(c.generation, a.generation);
        assert_eq!(slab.get(a), None, "a stale key misses the newcomer");
        assert_eq!(slab.get(c), Some(&"c"));
        assert_eq!(slab.get(b), Some(&"b"));
        assert_eq!(slab.len(), 2);
        assert_eq!(slab.capacity_used(), 2, "no growth from reuse");
    }

    #[test]
    fn a_long_churn_stays_in_place() {
        let mut slab = Slab::new(4);
        for round in 0..100_000u32 {
            let key = slab.insert(round).unwrap();
            assert_eq!(slab.remove(key), Some(round));
        }
        assert_eq!(slab.capacity_used(), 1);
    }
}
