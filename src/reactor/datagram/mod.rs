//! Datagram endpoints: unreliable datagrams and multicast on the reactor's
//! CQs, beside its connections.
//!
//! An endpoint ([`Reactor::add_datagram`](super::Reactor::add_datagram))
//! is a UD QP the reactor creates on its shared CQs, with a ring of
//! receives posted ahead of traffic and reposted in batches, and send
//! slots its handler's datagrams are copied into
//! ([`Ctx::send_datagram`](super::Ctx::send_datagram)); a pass's datagrams
//! go out with one doorbell per endpoint, and only one send in every half
//! send queue asks for a completion. Its handler gets each datagram in
//! [`Handler::on_datagram`](super::Handler::on_datagram), with the source
//! it claims, before reading any of its bytes.
//!
//! Nothing here allocates after the endpoint is added.

mod endpoint;
mod handlers;
mod reactor;
mod receives;
mod sends;
mod window;

use std::fmt;

use crate::verbs::{GRH_BYTES, Gid, UdDestination, datagram_sender};

use super::SendError;
use super::table::wr_id::MAX_ENDPOINTS;
pub(crate) use endpoint::{Arrived, DatagramEndpoint, Flushed, PostCount};
pub(crate) use handlers::DatagramHandlers;

/// A datagram endpoint of one reactor
/// ([`Reactor::add_datagram`](super::Reactor::add_datagram)). Ids are
/// never reused: a removed endpoint's id, another reactor's, or one of a
/// reactor that is gone, names nothing.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct DatagramId {
    reactor: u64,
    /// Its place in the reactor's table (and in its requests' `wr_id`s),
    /// which a later endpoint may take once it is removed.
    index: u32,
    /// Which of the endpoints the reactor ever added it is: never reused.
    serial: u64,
}

impl fmt::Debug for DatagramId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DatagramId({}.{})", self.reactor, self.serial)
    }
}

/// Where a datagram says it came from: the sending QP's number and, when
/// the datagram carried a routing header, its GID. Both are the sender's
/// own word, anyone on the fabric can claim any: a filter, not an
/// authentication (see the security docs).
#[derive(Clone, Copy)]
pub struct DatagramSource<'a> {
    qpn: u32,
    grh: Option<&'a [u8; GRH_BYTES]>,
}

impl DatagramSource<'_> {
    /// The sending QP's number.
    #[inline]
    pub fn qpn(&self) -> u32 {
        self.qpn
    }

    /// The sender's GID, read from the routing header (on RoCE v2 over
    /// IPv4, its source address as an IPv4-mapped GID); `None` if the
    /// datagram had none.
    #[inline]
    pub fn gid(&self) -> Option<Gid> {
        self.grh.and_then(datagram_sender)
    }
}

impl fmt::Debug for DatagramSource<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DatagramSource")
            .field("qpn", &self.qpn)
            .field("gid", &self.gid())
            .finish()
    }
}

/// The datagram endpoints of one reactor, and which of them have work for
/// the end of the pass. A removed endpoint's place is taken again only
/// once a pass has polled what its QP left on the CQs; ids carry a serial,
/// so a removed endpoint's never names the one in its place.
pub(crate) struct DatagramTable {
    owner: u64,
    places: Vec<Place>,
    /// The serial of the next endpoint added.
    next_serial: u64,
    /// The serial of the endpoint in each place (or of the last one
    /// there): beside `places`, and indexed by a mask, so the id a
    /// completion names costs no bounds check.
    serials: [u64; MAX_ENDPOINTS],
    /// Endpoints with datagrams staged or a repost batch due, one bit each.
    work: u64,
    /// Endpoints with any receive waiting to be posted again, one bit each.
    pending: u64,
    /// Endpoints a callback asked to remove, one bit each (also in `work`,
    /// so the end of the pass sees them).
    removing: u64,
    /// What removed endpoints posted, so the reactor's counters never go
    /// back.
    retired: PostCount,
}

/// A place of the table: the endpoint in it, if any.
struct Place {
    seat: Option<Seat>,
    /// Passes that had polled every CQ when its last endpoint was removed:
    /// its requests' ids may be on the CQs until a later pass has polled
    /// them, so no other endpoint takes the place before then.
    freed_at: u64,
    /// The QP number of its last endpoint, once removed: what tells that
    /// endpoint's late completions from a stranger's.
    departed_qpn: Option<u32>,
}

impl Place {
    /// What a completion of QP `qpn` naming this empty place, polled after
    /// `passes` passes, is: its removed endpoint's while no pass since the
    /// removal has polled every CQ, else a stranger's.
    #[cold]
    fn departed(&self, qpn: u32, passes: u64) -> Arrived {
        if self.departed_qpn == Some(qpn) && passes <= self.freed_at {
            Arrived::Stale
        } else {
            Arrived::Foreign
        }
    }
}

/// An endpoint and the CQ entries the reactor promised it, as a session's
/// are kept: (CQ index, entries).
struct Seat {
    endpoint: DatagramEndpoint,
    charge: (usize, u32),
}

const _: () = assert!(MAX_ENDPOINTS <= u64::BITS as usize);

impl DatagramTable {
    /// No endpoints; ids name reactor `owner`.
    pub(crate) fn new(owner: u64) -> Self {
        Self {
            owner,
            places: Vec::new(),
            next_serial: 0,
            serials: [u64::MAX; MAX_ENDPOINTS],
            work: 0,
            pending: 0,
            removing: 0,
            retired: PostCount::default(),
        }
    }

    /// The id the next endpoint gets, `passes` passes having polled every
    /// CQ: a place no endpoint ever had, or one whose endpoint was removed
    /// before the last of them began. An error when all 64 are taken.
    pub(crate) fn next_id(&self, passes: u64) -> crate::Result<DatagramId> {
        let free = self
            .places
            .iter()
            .position(|place| place.seat.is_none() && place.freed_at < passes);
        let index = match free {
            Some(index) => index,
            None if self.places.len() < MAX_ENDPOINTS => self.places.len(),
            None => {
                return Err(crate::Error::InvalidArgument(
                    "Reactor::add_datagram: a reactor holds at most 64 datagram endpoints (a removed one's place is free once the next pass has polled the CQs)",
                ));
            }
        };
        Ok(DatagramId {
            reactor: self.owner,
            index: index as u32,
            serial: self.next_serial,
        })
    }

    /// Holds `endpoint`, made for `id` (the last [`next_id`](Self::next_id)),
    /// with the CQ entries promised to it.
    pub(crate) fn push(
        &mut self,
        id: DatagramId,
        endpoint: DatagramEndpoint,
        charge: (usize, u32),
    ) {
        debug_assert_eq!(id.serial, self.next_serial);
        self.next_serial += 1;
        self.serials[id.index as usize % MAX_ENDPOINTS] = id.serial;
        let place = Place {
            seat: Some(Seat { endpoint, charge }),
            freed_at: 0,
            departed_qpn: None,
        };
        match self.places.get_mut(id.index as usize) {
            Some(free) => *free = place,
            None => self.places.push(place),
        }
    }

    /// The place of endpoint `id`, if it is this reactor's and not
    /// removed.
    #[inline]
    fn place_of(&self, id: DatagramId) -> Option<&Place> {
        let place = self.places.get(id.index as usize)?;
        (self.names(id) && place.seat.is_some()).then_some(place)
    }

    /// Whether `id` is this reactor's and carries the serial of its
    /// place's endpoint (or of the last one there): no bounds check.
    #[inline]
    fn names(&self, id: DatagramId) -> bool {
        id.reactor == self.owner && self.id(id.index).serial == id.serial
    }

    /// Takes endpoint `id` out, with the CQ entries promised to it, when
    /// `passes` passes have polled every CQ. `None` if it is another
    /// reactor's or gone.
    pub(crate) fn remove(
        &mut self,
        id: DatagramId,
        passes: u64,
    ) -> Option<(DatagramEndpoint, (usize, u32))> {
        self.place_of(id)?;
        let place = &mut self.places[id.index as usize];
        place.freed_at = passes;
        let Seat { endpoint, charge } = place.seat.take()?;
        place.departed_qpn = Some(endpoint.qp().qpn());
        self.work &= !(1 << id.index);
        self.pending &= !(1 << id.index);
        self.removing &= !(1 << id.index);
        let posted = endpoint.posted();
        self.retired.requests += posted.requests;
        self.retired.doorbells += posted.doorbells;
        Some((endpoint, charge))
    }

    /// Asks for endpoint `id` (if it is this reactor's and not removed) to
    /// be removed at the end of the pass.
    pub(crate) fn mark_for_removal(&mut self, id: DatagramId) {
        if self.get(id).is_some() {
            self.removing |= 1 << id.index;
            self.work |= 1 << id.index;
        }
    }

    /// Whether a callback asked for an endpoint to be removed.
    #[inline]
    pub(crate) fn has_removals(&self) -> bool {
        self.removing != 0
    }

    /// The endpoints asked to be removed, one bit each, taken.
    pub(crate) fn take_removals(&mut self) -> u64 {
        std::mem::take(&mut self.removing)
    }

    /// The endpoint in place `index`, if any.
    #[inline]
    fn at(&mut self, index: u32) -> Option<&mut DatagramEndpoint> {
        self.places
            .get_mut(index as usize)?
            .seat
            .as_mut()
            .map(|seat| &mut seat.endpoint)
    }

    /// The id of the endpoint in place `index` (or of the last one there).
    #[inline]
    pub(crate) fn id(&self, index: u32) -> DatagramId {
        DatagramId {
            reactor: self.owner,
            index,
            serial: self.serials[index as usize % MAX_ENDPOINTS],
        }
    }

    /// Endpoint `id`, if it is this reactor's and not removed.
    #[inline]
    pub(crate) fn get(&self, id: DatagramId) -> Option<&DatagramEndpoint> {
        self.place_of(id)?.seat.as_ref().map(|seat| &seat.endpoint)
    }

    /// Endpoint `id`, mutably, if it is this reactor's and not removed:
    /// one bounds check and the compares, on the path of every datagram
    /// sent.
    #[inline]
    pub(crate) fn get_mut(&mut self, id: DatagramId) -> Option<&mut DatagramEndpoint> {
        if !self.names(id) {
            return None;
        }
        self.at(id.index)
    }

    /// Joins endpoint `id` to multicast group `group`, saying so.
    pub(crate) fn join(&mut self, id: DatagramId, group: Gid) -> crate::Result<()> {
        let endpoint = self.get_mut(id).ok_or(crate::Error::InvalidArgument(
            "join: a datagram endpoint of another reactor, or one removed",
        ))?;
        endpoint.join(group)?;
        log::info!("datagram endpoint {id:?} joined {group}: anyone on the fabric may send to it");
        Ok(())
    }

    /// Takes endpoint `id` out of multicast group `group`.
    pub(crate) fn leave(&mut self, id: DatagramId, group: Gid) -> crate::Result<()> {
        self.get_mut(id)
            .ok_or(crate::Error::InvalidArgument(
                "leave: a datagram endpoint of another reactor, or one removed",
            ))?
            .leave(group)?;
        log::info!("datagram endpoint {id:?} left {group}");
        Ok(())
    }

    /// Every endpoint not removed, with its id.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (DatagramId, &DatagramEndpoint)> {
        self.places.iter().enumerate().filter_map(|(index, place)| {
            place
                .seat
                .as_ref()
                .map(|seat| (self.id(index as u32), &seat.endpoint))
        })
    }

    /// A completion naming endpoint `index` (a receive into slot `value`,
    /// or send `value`), polled by a pass after `passes` passes: what it
    /// brings, vetted by the endpoint. One of an endpoint removed since it
    /// posted it (its QP's, polled before a pass after the removal has
    /// polled every CQ) is stale; any other naming no endpoint is a
    /// stranger's.
    #[inline]
    pub(crate) fn complete(
        &mut self,
        index: u32,
        wc: &crate::verbs::WorkCompletion,
        receive: bool,
        value: u32,
        passes: u64,
    ) -> Arrived {
        let Some(place) = self.places.get_mut(index as usize) else {
            return Arrived::Foreign;
        };
        let Some(Seat { endpoint, .. }) = &mut place.seat else {
            return place.departed(wc.qp_num(), passes);
        };
        let arrived = endpoint.complete(wc, receive, value);
        // A slot given back here (a failed or short receive) waits for a
        // batch like any other.
        if matches!(arrived, Arrived::Nothing) && endpoint.has_pending_receives() {
            self.pending |= 1 << index;
            if endpoint.has_due_receives() {
                self.work |= 1 << index;
            }
        }
        arrived
    }

    /// Datagram slot `slot` of endpoint `index` was read: it goes back.
    #[inline]
    pub(crate) fn release(&mut self, index: u32, slot: u32) {
        if let Some(endpoint) = self.at(index) {
            let due = endpoint.release(slot);
            self.pending |= 1 << index;
            if due {
                self.work |= 1 << index;
            }
        }
    }

    /// Stages `data` to `to` on endpoint `id`, for the end of the pass.
    #[inline]
    pub(crate) fn stage(
        &mut self,
        id: DatagramId,
        to: &UdDestination,
        data: &[u8],
    ) -> Result<(), SendError> {
        let Some(endpoint) = self.get_mut(id) else {
            return Err(SendError::Closed);
        };
        let staged = endpoint.stage(to, data);
        // Also after a refusal: a full list posted and refused leaves an
        // error to report.
        self.work |= 1 << id.index;
        staged
    }

    /// Whether the end of the pass has work here: datagrams staged, a
    /// repost batch due, or, on an idle pass (`idle`), any receive to
    /// post again.
    #[inline(always)]
    pub(crate) fn has_work(&self, idle: bool) -> bool {
        // One test, branch-free in `idle`: every pass asks.
        (self.work | self.pending & u64::from(idle).wrapping_neg()) != 0
    }

    /// Rings each endpoint's doorbell for its staged datagrams and posts
    /// its receives (a full batch, or all of them if `idle`). Returns the
    /// endpoints a refused post failed (one bit each:
    /// [`take_report`](Self::take_report)).
    #[inline]
    pub(crate) fn flush(&mut self, idle: bool) -> u64 {
        let mut failed = 0;
        let mut todo = std::mem::take(&mut self.work);
        if idle {
            todo |= self.pending;
        }
        // The endpoints with work, by their bits.
        while todo != 0 {
            let index = todo.trailing_zeros();
            todo &= todo - 1;
            let Some(endpoint) = self.at(index) else {
                continue;
            };
            let Flushed { pending, report } = endpoint.flush(idle);
            if !pending {
                self.pending &= !(1 << index);
            }
            if report {
                failed |= 1 << index;
            }
        }
        failed
    }

    /// Datagrams every endpoint posted and the doorbells that posted them,
    /// so far (removed ones' too).
    pub(crate) fn posted(&self) -> PostCount {
        self.iter()
            .map(|(_, endpoint)| endpoint.posted())
            .fold(self.retired, |sum, posted| PostCount {
                requests: sum.requests + posted.requests,
                doorbells: sum.doorbells + posted.doorbells,
            })
    }

    /// The error a refused post failed endpoint `index` with, once.
    pub(crate) fn take_report(&mut self, index: u32) -> Option<crate::Error> {
        self.at(index)?.take_report()
    }
}

impl<'a> DatagramSource<'a> {
    pub(crate) fn new(qpn: u32, grh: Option<&'a [u8; GRH_BYTES]>) -> Self {
        Self { qpn, grh }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_places_completion_is_stale_only_from_its_last_qp_while_it_drains() {
        let removed_after = 7;
        let place = Place {
            seat: None,
            freed_at: removed_after,
            departed_qpn: Some(0x11),
        };
        let stale = |qpn, passes| matches!(place.departed(qpn, passes), Arrived::Stale);
        assert!(stale(0x11, removed_after), "the pass after the removal");
        assert!(!stale(0x12, removed_after), "another QP's");
        assert!(
            !stale(0x11, removed_after + 1),
            "once a pass has drained the CQs"
        );
        let never = Place {
            seat: None,
            freed_at: 0,
            departed_qpn: None,
        };
        assert!(matches!(never.departed(0x11, 0), Arrived::Foreign));
    }
}
