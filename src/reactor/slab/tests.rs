//! The slab's reuse, quarantine, reservation, retirement and walk lists.

use super::*;

/// Walks `list` whole: its entries, unlisted.
fn walk(slab: &mut Slab<i32>, list: usize) -> Vec<u32> {
    let len = slab.begin_walk(list);
    let walked = (0..len).filter_map(|at| slab.unlist_at(list, at)).collect();
    slab.end_walk(list);
    walked
}

#[test]
fn removed_entries_are_reused_and_stale_keys_miss() {
    let mut slab = Slab::new(2, 1);
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

/// The capacities a reservation sets: entries, free list, quarantine,
/// and each walk list.
fn room(slab: &Slab<i32>) -> (usize, usize, usize, [usize; LISTS]) {
    (
        slab.entries.capacity(),
        slab.free.capacity(),
        slab.quarantine.capacity(),
        slab.lists.each_ref().map(Vec::capacity),
    )
}

#[test]
fn a_reserving_slab_grows_nothing_up_to_its_reservation() {
    let mut slab = Slab::new(16, 1)
        .quarantining()
        .tracking()
        .reserving(8)
        .unwrap();
    let (before, records) = (room(&slab), slab.entries.as_ptr());
    assert!(
        before.0 >= 8 && before.3.iter().all(|&c| c >= 16),
        "{before:?}"
    );
    // Churn at eight live, listed, quarantined and released as a pass
    // would, twice over.
    for _ in 0..2 {
        let keys: Vec<Key> = (0..8).map(|i| slab.insert(i).unwrap()).collect();
        keys.iter().for_each(|key| slab.park(key.index));
        walk(&mut slab, TOUCHED);
        walk(&mut slab, PARKED);
        for &key in &keys {
            slab.remove(key);
        }
        slab.release_quarantine(slab.quarantined());
    }
    assert_eq!(room(&slab), before, "nothing grew");
    assert_eq!(slab.entries.as_ptr(), records, "no record moved");
    // Past the reservation it still takes more, growing.
    let keys: Vec<Key> = (0..9).map(|i| slab.insert(i).unwrap()).collect();
    assert_eq!(keys.len(), 9);
    assert!(slab.entries.capacity() > before.0);
}

#[test]
fn a_reservation_too_large_is_an_error_not_an_abort() {
    // About 2^52 bytes: within what a Vec may ask for, beyond any
    // address space, so the allocator itself refuses it (which
    // `reserve_exact` would have turned into an abort).
    let slab = Slab::<[u8; 4096]>::new(usize::MAX, 1);
    assert!(slab.reserving(1 << 40).is_err());
}

#[test]
fn a_reservation_does_not_depend_on_the_order_of_the_builder() {
    let first = Slab::new(64, 1).reserving(8).unwrap();
    let first = first.quarantining().tracking();
    let last = Slab::new(64, 1).quarantining().tracking().reserving(8);
    assert_eq!(room(&first), room(&last.unwrap()));
}

#[test]
fn quarantined_entries_wait_for_release() {
    let mut slab = Slab::new(4, 1).quarantining();
    let first = slab.insert(1).unwrap();
    slab.remove(first);
    let second = slab.insert(2).unwrap();
    assert_ne!(second.index, first.index, "not reused while quarantined");
    assert_eq!(slab.quarantined(), 1);
    slab.release_quarantine(1);
    let third = slab.insert(3).unwrap();
    assert_eq!(third.index, first.index, "reused after release");
}

#[test]
fn keys_of_another_slab_miss() {
    let (mut ours, mut theirs) = (Slab::new(2, 1), Slab::new(2, 2));
    let mine = ours.insert("ours").unwrap();
    let other = theirs.insert("theirs").unwrap();
    assert_eq!(
        (mine.index, mine.generation),
        (other.index, other.generation)
    );
    assert_eq!(ours.get(other), None);
    assert_eq!(ours.remove(other), None);
    assert_eq!(theirs.get_mut(mine), None);
    assert_eq!(ours.get(mine), Some(&"ours"));
}

#[test]
fn mutable_access_lists_each_entry_once_and_quiet_access_does_not() {
    let mut slab = Slab::new(8, 1).tracking();
    let keys: Vec<Key> = (0..4).map(|v| slab.insert(v).unwrap()).collect();
    let capacity = slab.lists[TOUCHED].capacity();
    assert!(capacity >= 4, "room for every entry was reserved at insert");
    let list = walk(&mut slab, TOUCHED);
    assert_eq!(list, vec![0, 1, 2, 3], "newcomers are listed");
    let _ = slab.get(keys[0]);
    assert!(!slab.has_touched(), "reading is not touching");
    *slab.get_mut(keys[2]).unwrap() += 10;
    *slab.get_mut(keys[2]).unwrap() += 10;
    slab.get_by_index_mut(1);
    slab.get_by_index_quiet(3);
    let list = walk(&mut slab, TOUCHED);
    assert_eq!(
        list,
        vec![2, 1],
        "each once, in the order first touched; quiet access unlisted"
    );
    assert!(!slab.has_touched());
    slab.get_mut(keys[2]);
    let list = walk(&mut slab, TOUCHED);
    assert_eq!(list, vec![2], "listed again after being taken");
    for _ in 0..10 {
        for index in 0..4 {
            slab.touch(index);
        }
        let list = walk(&mut slab, TOUCHED);
        assert_eq!(list.len(), 4);
    }
    assert_eq!(
        slab.lists[TOUCHED].capacity(),
        capacity,
        "the lists never grew"
    );
    assert_eq!(
        slab.get_mut(Key {
            index: 0,
            generation: 9,
            owner: 1
        }),
        None
    );
    assert!(!slab.has_touched(), "a stale key lists nothing");
}

#[test]
fn what_a_walk_lists_again_waits_for_the_next_walk() {
    let mut slab = Slab::new(8, 1).tracking();
    for v in 0..3 {
        slab.insert(v).unwrap();
    }
    let len = slab.begin_walk(TOUCHED);
    assert_eq!(len, 3);
    let mut walked = Vec::new();
    for at in 0..len {
        let index = slab.unlist_at(TOUCHED, at).unwrap();
        walked.push(index);
        // The walked entry comes back, and one further on is touched
        // before the walk gets there (already listed: no second entry).
        slab.touch(index);
        slab.touch(2);
    }
    assert_eq!(slab.lists[TOUCHED].len(), 6, "3 walked, 3 listed again");
    assert_eq!(slab.unlist_at(TOUCHED, 6), None, "past the end");
    slab.end_walk(TOUCHED);
    assert_eq!(walked, vec![0, 1, 2]);
    assert_eq!(
        walk(&mut slab, TOUCHED),
        vec![0, 1, 2],
        "each once, for later"
    );
    assert!(!slab.has_touched());
}

#[test]
fn a_walk_cut_short_is_finished_by_the_next() {
    let mut slab = Slab::new(8, 1).tracking();
    for v in 0..4 {
        slab.insert(v).unwrap();
    }
    let capacity = slab.lists[TOUCHED].capacity();
    // Again and again: two positions walked, then the walk stops
    // without `end_walk` (a panic in the middle), and everything is
    // touched again.
    for _ in 0..10 {
        let len = slab.begin_walk(TOUCHED);
        assert_eq!(len, 4, "each entry once, the cut walk's positions gone");
        slab.unlist_at(TOUCHED, 0);
        slab.unlist_at(TOUCHED, 1);
        for index in 0..4 {
            slab.touch(index);
        }
    }
    assert_eq!(walk(&mut slab, TOUCHED).len(), 4);
    assert_eq!(slab.lists[TOUCHED].capacity(), capacity, "never grew");
}

#[test]
fn parked_entries_come_back_once_each() {
    let mut slab = Slab::new(8, 1).tracking();
    for v in 0..3 {
        slab.insert(v).unwrap();
    }
    walk(&mut slab, TOUCHED);
    slab.park(2);
    slab.park(0);
    slab.park(2);
    assert!(!slab.has_touched(), "parking is not touching");
    let parked = walk(&mut slab, PARKED);
    assert_eq!(parked, vec![2, 0]);
    assert!(walk(&mut slab, PARKED).is_empty(), "taken means unlisted");
}

#[test]
fn untracked_slabs_list_nothing() {
    let mut slab = Slab::new(2, 1);
    let key = slab.insert(1).unwrap();
    slab.get_mut(key);
    assert!(!slab.has_touched());
}

/// Brings the entry the next insert reuses to generation `generation`
/// (inserting and removing once first, if no freed entry waits) and
/// churns it through its last tenants: returns each tenant's key,
/// the last one's generation `u32::MAX`, all removed.
fn churn_to_the_end(slab: &mut Slab<i32>, generation: u32) -> Vec<Key> {
    if !slab.age_vacant(generation) {
        let key = slab.insert(-1).unwrap();
        slab.remove(key);
        slab.release_quarantine(slab.quarantined());
        assert!(slab.age_vacant(generation));
    }
    let mut keys = Vec::new();
    loop {
        let key = slab.insert(keys.len() as i32).unwrap();
        keys.push(key);
        assert_eq!(slab.remove(key), Some(keys.len() as i32 - 1));
        slab.release_quarantine(slab.quarantined());
        if key.generation == u32::MAX {
            return keys;
        }
    }
}

#[test]
fn an_entry_whose_generations_are_spent_is_retired_and_its_keys_stay_stale() {
    let mut slab = Slab::new(2, 1);
    let keys = churn_to_the_end(&mut slab, u32::MAX - 2);
    assert_eq!(keys.len(), 3, "generations MAX - 2, MAX - 1 and MAX");
    assert!(keys.iter().all(|key| key.index == 0));
    let a = slab.insert(10).unwrap();
    let b = slab.insert(11).unwrap();
    // Every key of index 0, of any generation (0 included, which a
    // wrapping generation would come back to), misses the newcomers.
    for generation in [0, 1, u32::MAX - 2, u32::MAX - 1, u32::MAX] {
        let stale = Key {
            index: 0,
            generation,
            owner: 1,
        };
        assert_eq!(slab.get(stale), None);
        assert_eq!(slab.get_mut(stale), None);
        assert_eq!(slab.remove(stale), None);
    }
    assert!(slab.get_by_index_mut(0).is_none());
    assert_eq!(slab.get(a), Some(&10));
    // Newcomers took fresh entries; the retired index is never reused.
    assert_eq!((a.index, b.index), (1, 2));
    assert_eq!(a.generation, 0, "a fresh entry starts over");
    assert_eq!(slab.retired(), 1);
    assert_eq!(slab.free.len(), 0, "a retired entry is not free");
    // Capacity: the retired entry does not count against the limit:
    // two live records, as before it; a third is refused.
    assert_eq!(slab.len(), 2);
    assert!(slab.insert(12).is_none(), "full at the limit");
    assert_eq!(slab.vacant_key(), None);
    assert_eq!(slab.capacity_used(), 3, "live, live, retired");
    let live: Vec<i32> = slab.iter().map(|(_, v)| *v).collect();
    assert_eq!(live, vec![10, 11]);
    // Churn on the fresh entries goes on as before.
    slab.remove(a);
    let c = slab.insert(13).unwrap();
    assert_eq!((c.index, c.generation), (1, 1));
    assert_eq!(slab.get(a), None);
}

#[test]
fn a_retired_entry_is_never_quarantined_nor_released() {
    let mut slab = Slab::new(4, 1).quarantining();
    let key = slab.insert(1).unwrap();
    slab.remove(key);
    slab.release_quarantine(1);
    assert!(slab.age_vacant(u32::MAX));
    let last = slab.insert(2).unwrap();
    assert_eq!((last.index, last.generation), (key.index, u32::MAX));
    assert_eq!(slab.remove(last), Some(2));
    assert_eq!(slab.quarantined(), 0, "retired, not quarantined");
    slab.release_quarantine(usize::MAX);
    let next = slab.insert(3).unwrap();
    assert_ne!(next.index, last.index);
    assert_eq!(slab.get(last), None);
}

#[test]
fn a_retired_entry_keeps_the_reservation_good() {
    let mut slab = Slab::new(16, 1)
        .quarantining()
        .tracking()
        .reserving(4)
        .unwrap();
    churn_to_the_end(&mut slab, u32::MAX - 1);
    walk(&mut slab, TOUCHED);
    assert_eq!(slab.retired(), 1);
    let (before, records) = (room(&slab), slab.entries.as_ptr());
    // Four live, as reserved, listed, churned and quarantined as a
    // pass would: the fifth entry they need (the retired one holds its
    // place) grows nothing, and no record moves.
    for _ in 0..2 {
        let keys: Vec<Key> = (0..4).map(|i| slab.insert(i).unwrap()).collect();
        assert!(keys.iter().all(|key| key.index != 0));
        keys.iter().for_each(|key| slab.park(key.index));
        slab.touch(0);
        walk(&mut slab, TOUCHED);
        walk(&mut slab, PARKED);
        for &key in &keys {
            slab.remove(key);
        }
        slab.release_quarantine(slab.quarantined());
    }
    assert_eq!(slab.capacity_used(), 5);
    assert_eq!(room(&slab), before, "nothing grew");
    assert_eq!(slab.entries.as_ptr(), records, "no record moved");
}

#[test]
fn retired_entries_use_up_the_index_space() {
    // Indices below 2: after one retirement, one entry is left to use.
    let mut slab = Slab::new(2, 1).indexed_below(2);
    churn_to_the_end(&mut slab, u32::MAX);
    let a = slab.insert(1).unwrap();
    assert_eq!(a.index, 1);
    assert_eq!(slab.len(), 1);
    assert!(
        slab.insert(2).is_none(),
        "below the limit, but no index is left"
    );
    // Churn goes on in the entry left.
    slab.remove(a);
    let b = slab.insert(3).unwrap();
    assert_eq!((b.index, b.generation), (1, 1));
}

#[test]
fn a_long_churn_stays_in_place() {
    let mut slab = Slab::new(4, 1);
    for round in 0..100_000u32 {
        let key = slab.insert(round).unwrap();
        assert_eq!(slab.remove(key), Some(round));
    }
    assert_eq!(slab.capacity_used(), 1);
}

#[test]
fn only_a_quarantined_entry_names_its_departed_generation() {
    let mut slab = Slab::new(4, 1).quarantining();
    let a = slab.insert(1).unwrap();
    assert_eq!(slab.quarantined_generation(a.index), None, "live");
    assert_eq!(slab.quarantined_generation(a.index + 1), None, "never used");
    assert_eq!(slab.remove(a), Some(1));
    assert_eq!(
        slab.quarantined_generation(a.index),
        Some(a.generation),
        "removed"
    );
    slab.release_quarantine(1);
    assert_eq!(slab.quarantined_generation(a.index), None, "free again");
}
