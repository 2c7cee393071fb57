//! The registration a connection's requests hold by count
//! ([`RegistrationCache`]): the common case of one buffer region used over
//! and over costs no atomic reference count per request.

use crate::reactor::conn::op::Keep;
use crate::verbs::Registration;

/// One registration, held for the requests in flight that use it by a
/// count instead of a handle each.
#[derive(Default)]
pub(super) struct RegistrationCache {
    registration: Option<Registration>,
    /// Requests in flight that hold `registration`.
    in_flight: u32,
}

impl RegistrationCache {
    /// True if the cached registration is the one `id` names.
    #[inline]
    pub(super) fn holds(&self, id: usize) -> bool {
        self.registration
            .as_ref()
            .is_some_and(|registration| registration.id() == id)
    }

    /// Holds the registration `id` names for one more request: through the
    /// cached one if it is that (no reference count touched), else a
    /// handle from `handle`, which becomes the cached one when no request
    /// in flight uses the old, or else is returned for the request to own.
    #[inline]
    pub(super) fn hold(
        &mut self,
        id: usize,
        handle: impl FnOnce() -> Option<Registration>,
    ) -> (Keep, Option<Registration>) {
        if self.holds(id) {
            self.in_flight += 1;
            return (Keep::Cached, None);
        }
        let Some(registration) = handle() else {
            return (Keep::Nothing, None);
        };
        if self.in_flight == 0 {
            self.registration = Some(registration);
            self.in_flight = 1;
            (Keep::Cached, None)
        } else {
            (Keep::Own, Some(registration))
        }
    }

    /// A request that held the cached registration ([`Keep::Cached`]) is
    /// done with it: it completed, or the device never got it.
    #[inline]
    pub(super) fn release(&mut self) {
        debug_assert!(self.in_flight > 0, "released more than held");
        self.in_flight -= 1;
    }

    /// Requests in flight that hold the cached registration.
    #[cfg(test)]
    pub(super) fn in_flight(&self) -> u32 {
        self.in_flight
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verbs::{AccessFlags, Context, MemoryRegion};

    #[test]
    fn one_registration_is_held_by_count_and_another_by_handle_while_it_is_in_flight() {
        // SAFETY: nothing is posted on the loopback device here.
        let ctx = unsafe { Context::loopback() };
        let pd = ctx.alloc_pd().expect("a PD");
        let (a, b): (MemoryRegion, MemoryRegion) = (
            pd.alloc_mr(64, AccessFlags::empty()).expect("an MR"),
            pd.alloc_mr(64, AccessFlags::empty()).expect("an MR"),
        );
        let (a_id, b_id) = (a.registration().id(), b.registration().id());
        let mut cache = RegistrationCache::default();
        let (keep, own) = cache.hold(a_id, || None);
        assert!(
            keep == Keep::Nothing && own.is_none(),
            "no handle, nothing held"
        );
        assert_eq!(
            cache.hold(a_id, || Some(a.registration().clone())).0,
            Keep::Cached
        );
        let mut asked = false;
        let again = cache.hold(a_id, || {
            asked = true;
            None
        });
        assert!(again.0 == Keep::Cached && again.1.is_none());
        assert!(!asked, "no handle asked for the cached one");
        assert_eq!(cache.in_flight(), 2);
        let (keep, own) = cache.hold(b_id, || Some(b.registration().clone()));
        assert_eq!(
            keep,
            Keep::Own,
            "a is in flight: b gets a handle of its own"
        );
        assert!(own.is_some() && cache.holds(a_id) && !cache.holds(b_id));
        cache.release();
        cache.release();
        assert_eq!(cache.in_flight(), 0);
        assert_eq!(
            cache.hold(b_id, || Some(b.registration().clone())).0,
            Keep::Cached
        );
        assert!(
            cache.holds(b_id) && !cache.holds(a_id),
            "b replaces a once a is done"
        );
    }
}
