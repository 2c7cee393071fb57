//! A server's peer limit ([`ServerConfig::max_peers`](super::ServerConfig)):
//! places for the peers connected now. A place is taken at admission,
//! travels with the peer's endpoint, and is given back when the endpoint
//! (or the session link a reactor keeps of it) is dropped, or when the
//! handshake fails: a peer that left frees its place, so strangers that
//! come and go never use up the limit.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The places of one server.
#[derive(Debug)]
pub(crate) struct PeerPlaces {
    taken: AtomicUsize,
    max: usize,
}

impl PeerPlaces {
    /// Room for `max` peers at once (`None`: no limit).
    pub(crate) fn new(max: Option<usize>) -> Arc<Self> {
        Arc::new(Self {
            taken: AtomicUsize::new(0),
            max: max.unwrap_or(usize::MAX),
        })
    }

    /// A place for one more peer, or `None` when every place is taken.
    pub(crate) fn take(self: &Arc<Self>) -> Option<PeerPlace> {
        self.taken
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max).then_some(n + 1)
            })
            .ok()
            .map(|_| PeerPlace(Arc::clone(self)))
    }

    /// True when every place is taken now.
    pub(crate) fn full(&self) -> bool {
        self.taken.load(Ordering::Acquire) >= self.max
    }

    /// Places taken now.
    pub(crate) fn taken(&self) -> usize {
        self.taken.load(Ordering::Acquire)
    }
}

/// One peer's place, given back when dropped.
pub(crate) struct PeerPlace(Arc<PeerPlaces>);

impl fmt::Debug for PeerPlace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("PeerPlace")
    }
}

impl Drop for PeerPlace {
    fn drop(&mut self) {
        self.0.taken.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn places_are_taken_up_to_the_limit_and_given_back_on_drop() {
        let places = PeerPlaces::new(Some(2));
        let a = places.take().unwrap();
        let b = places.take().unwrap();
        assert!(places.full());
        assert!(places.take().is_none(), "no third place");
        drop(a);
        assert_eq!(places.taken(), 1);
        let c = places
            .take()
            .expect("a departed peer's place is free again");
        drop((b, c));
        assert_eq!(places.taken(), 0);
        assert!(!places.full());
    }

    #[test]
    fn no_limit_never_fills() {
        let places = PeerPlaces::new(None);
        let held: Vec<_> = (0..1000).map(|_| places.take().unwrap()).collect();
        assert!(!places.full());
        assert_eq!(places.taken(), held.len());
    }
}
