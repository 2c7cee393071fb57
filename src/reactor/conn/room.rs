//! A connection's wait for room: requests refused with `WouldBlock` for
//! want of a send-queue entry, a credit or a send slot (or because the
//! connection was not established yet), remembered so the handler is told
//! once room for every kind refused is back (`Handler::on_writable`).

/// What a request needs to be taken besides a send-queue entry: a credit
/// (it consumes a peer receive), a send slot (it copies its payload).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Needs {
    credit: bool,
    slot: bool,
}

impl Needs {
    pub(crate) fn new(credit: bool, slot: bool) -> Self {
        Self { credit, slot }
    }

    pub(crate) fn credit(self) -> bool {
        self.credit
    }

    pub(crate) fn slot(self) -> bool {
        self.slot
    }

    /// What both need.
    fn and(self, other: Self) -> Self {
        Self {
            credit: self.credit || other.credit,
            slot: self.slot || other.slot,
        }
    }
}

/// Whether a connection's handler waits to be told room is back, and for
/// what: what the requests refused since the wait began need together.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct RoomWait {
    needs: Option<Needs>,
}

impl RoomWait {
    /// A request needing `needs` was refused for want of room.
    pub(super) fn refused(&mut self, needs: Needs) {
        self.needs = Some(self.needs.map_or(needs, |before| before.and(needs)));
    }

    /// What room the wait is for, if the handler waits.
    #[inline(always)]
    pub(super) fn needs(&self) -> Option<Needs> {
        self.needs
    }

    /// The handler is told: the wait is over.
    pub(super) fn end(&mut self) {
        self.needs = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wait_needs_what_every_refusal_needed_until_it_ends() {
        let mut wait = RoomWait::default();
        assert_eq!(wait.needs(), None, "nothing refused: no wait");
        let read = Needs::new(false, false);
        wait.refused(read);
        assert_eq!(wait.needs(), Some(read));
        wait.refused(Needs::new(true, false));
        wait.refused(read);
        assert_eq!(
            wait.needs(),
            Some(Needs::new(true, false)),
            "a later refusal adds its needs, and nothing takes them away"
        );
        wait.refused(Needs::new(false, true));
        assert_eq!(wait.needs(), Some(Needs::new(true, true)));
        wait.end();
        assert_eq!(wait.needs(), None);
    }
}
