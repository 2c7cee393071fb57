//! A connection's wait for room: requests refused with `WouldBlock` for
//! want of a send-queue entry, a credit or a send slot, remembered so the
//! handler is told once room for every kind refused is back
//! (`Handler::on_writable`), and whether the connection is on its table's
//! list of those waiting.

/// What a request needs to be taken besides a send-queue entry: a credit
/// (it consumes a peer receive), a send slot (it copies its payload).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Needs {
    pub(crate) credit: bool,
    pub(crate) slot: bool,
}

impl Needs {
    /// What both need.
    fn and(self, other: Self) -> Self {
        Self {
            credit: self.credit || other.credit,
            slot: self.slot || other.slot,
        }
    }
}

/// Whether a connection's handler waits to be told room is back, for what,
/// and whether its table lists it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct RoomWait {
    /// What the requests refused since the wait began need together.
    needs: Option<Needs>,
    /// The table lists the connection as waiting.
    listed: bool,
}

impl RoomWait {
    /// A request needing `needs` was refused for want of room.
    pub(super) fn refused(&mut self, needs: Needs) {
        self.needs = Some(self.needs.map_or(needs, |before| before.and(needs)));
    }

    /// What room the wait is for, if the handler waits.
    pub(super) fn needs(&self) -> Option<Needs> {
        self.needs
    }

    /// True once per wait: the handler waits and the table does not list
    /// the connection yet (the caller lists it).
    #[inline(always)]
    pub(super) fn list(&mut self) -> bool {
        let newly = self.needs.is_some() && !self.listed;
        self.listed |= newly;
        newly
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEND: Needs = Needs {
        credit: true,
        slot: true,
    };
    const READ: Needs = Needs {
        credit: false,
        slot: false,
    };

    #[test]
    fn a_wait_is_listed_once_and_needs_what_every_refusal_needed() {
        let mut wait = RoomWait::default();
        assert!(!wait.list(), "nothing refused: nothing to list");
        assert_eq!(wait.needs(), None);
        wait.refused(READ);
        assert_eq!(wait.needs(), Some(READ));
        assert!(wait.list(), "listed once");
        assert!(!wait.list());
        wait.refused(Needs {
            credit: true,
            slot: false,
        });
        wait.refused(READ);
        assert_eq!(
            wait.needs(),
            Some(Needs {
                credit: true,
                slot: false
            }),
            "a later refusal adds its needs, and nothing takes them away"
        );
        wait.refused(SEND);
        assert_eq!(wait.needs(), Some(SEND));
        assert!(!wait.list(), "still listed");
    }
}
