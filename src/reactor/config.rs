//! Reactor configuration, the ids it hands out, and the errors of staging.

use std::fmt;
use std::time::Duration;

use crate::error::Error;

use super::slab::Key;

/// How the reactor waits when there is nothing to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EventMode {
    /// Spin on the CQs: lowest latency, one core at 100 %.
    #[default]
    BusyPoll,
    /// Arm the CQs and block on their shared completion channel.
    Blocking,
    /// Arm the CQs and wait in epoll over one channel per CQ; the epoll fd is
    /// available to embed in another event loop.
    Epoll,
}

/// Reactor sizing and behaviour. `Default` suits small-message RPC.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReactorConfig {
    /// How to wait when idle.
    pub event_mode: EventMode,
    /// CQs the reactor owns; QPs are spread over them.
    pub cq_count: u32,
    /// Entries per CQ.
    pub cq_size: u32,
    /// Bytes per send and receive slot (the largest SEND payload is
    /// [`SLOT_RESERVE`](super::SLOT_RESERVE) bytes less).
    pub slot_size: usize,
    /// Receives kept posted per QP; with an SRQ, each connection's share of
    /// it (the credits its peer gets). At least 3 (fewer count as 3): one
    /// stays reserved for credit updates.
    pub recv_depth: u32,
    /// Receives in one shared receive queue for all of the reactor's QPs
    /// (0: every QP keeps its own ring of `recv_depth`). Memory then grows
    /// with the traffic in flight instead of with the number of peers.
    /// Connections are refused once their `recv_depth` shares would exceed
    /// it, so credit flow control still rules out RNR.
    ///
    /// A peer that ignores its credits is cut off
    /// ([`Error::CreditOverrun`]) by the pass that polls its first receive
    /// beyond its grant (the highest receive count announced to it): the
    /// pass under way when that receive lands, or the next one, since
    /// every pass polls every CQ empty. That pass moves the peer's QP to
    /// the error state at once, before any other completion is handled,
    /// so it takes no receive after; delivers nothing of it past the grant
    /// (its later completions in the same poll are given back, not
    /// delivered); and gives back with its flush every SRQ receive the
    /// peer took (any a NIC reports only after that pass go back with the
    /// pass that polls them).
    ///
    /// Until then the peer takes whatever SRQ receives are posted, but at
    /// most `srq_depth` beyond its grant, all told: what it takes from the
    /// landing of its first receive beyond the grant to the cut-off is
    /// distinct slots, since a slot goes back to the SRQ only once the
    /// reactor has polled its completion, and those completions queue on
    /// the peer's QP behind that first one. In practice it is the SRQ
    /// receives posted when that first one lands, and any a flush reposts
    /// before the next pass polls it. Other peers may meet RNR NAKs for
    /// that moment: their NIC retries them (keep their `rnr_retry` at 7,
    /// the default), and headroom above the sum of the shares (at least a
    /// peer's send-queue depth) absorbs the burst.
    pub srq_depth: u32,
    /// Consumed receives are reposted in batches of this many (fewer after
    /// a few empty busy-poll passes, or before the reactor sleeps).
    pub repost_batch: u32,
    /// Send-queue entries per QP (at most what the QP allows). Providers
    /// round a send queue up to a power of two, Soft-RoCE after adding
    /// one: a depth of 2^k - 1 is the one that costs no memory for nothing.
    pub sq_depth: u32,
    /// Send slots per QP.
    pub send_slots: u32,
    /// Signal every Nth send-queue request.
    pub signal_interval: u32,
    /// Inline payload size to ask the QP for.
    pub max_inline: u32,
    /// Longest sleep in the Blocking and Epoll modes before `on_idle` runs.
    /// [`Duration::MAX`] (see [`sleeping_until_woken`](Self::sleeping_until_woken))
    /// sleeps until a completion, a peer event or a [`Waker`](super::Waker)
    /// ends it, so an idle reactor makes no syscalls at all.
    pub idle_timeout: Duration,
    /// How often the reactor asks each session's peer link whether the peer
    /// is still there ([`Handler::on_peer_gone`](super::Handler::on_peer_gone)):
    /// every second by default, so a server learns that a client left even
    /// when it was not sending to it. The check is non-blocking and runs
    /// between passes, never per message; it costs one syscall per session
    /// with a control connection per interval, and a busy-polling reactor
    /// reads the clock every so many passes to know when it is due (a
    /// syscall too where the clocksource has no user-space reading, as in
    /// an emulated guest). A reactor that sleeps with no timeout
    /// ([`sleeping_until_woken`](Self::sleeping_until_woken)) checks a
    /// link when its [`event_fd`](super::PeerLink::event_fd) fires or
    /// something else wakes it. `None` never asks: a departed peer is then
    /// noticed only by a failed completion, and a busy-polling reactor
    /// makes no syscalls of its own at all.
    pub peer_check_interval: Option<Duration>,
    /// Connections the reactor makes room for when it is built: its
    /// connection and session records for this many (about 4 KiB of
    /// address space each, whose pages are touched only when used) and
    /// their bookkeeping (slab lists, SRQ owners, the list of removals a
    /// pass asks for) are allocated then, or
    /// [`Reactor::new`](super::Reactor::new) fails with `ENOMEM`. While no
    /// more records are in use at once (live ones, and those removed since
    /// the last pass), adding a connection grows none of these tables and
    /// moves no record: the reactor's records do not step a long-running
    /// server's heap up the first time it holds more peers at once than
    /// before, and no add copies every record. (A session server sizes its
    /// tables of handshakes in progress by its own limits.) The
    /// connection's own QP, rings, registrations and session entry are
    /// still made as it is added. Past it, more are accepted up to the
    /// reactor's limit, and the tables grow then.
    /// [`absorbing`](Self::absorbing) (so also
    /// [`for_traffic`](Self::for_traffic)) raises it to the connections it
    /// sizes the CQs for.
    pub reserve_connections: u32,
}

impl Default for ReactorConfig {
    fn default() -> Self {
        Self {
            event_mode: EventMode::BusyPoll,
            cq_count: 1,
            cq_size: 4096,
            slot_size: 4096,
            recv_depth: 128,
            srq_depth: 0,
            repost_batch: 16,
            sq_depth: 255,
            send_slots: 64,
            signal_interval: 16,
            max_inline: 64,
            idle_timeout: Duration::from_millis(10),
            peer_check_interval: Some(PEER_CHECK_INTERVAL),
            reserve_connections: 0,
        }
    }
}

/// Inline room a provider gives a send-queue entry's one scatter-gather
/// entry anyway: what [`ReactorConfig::for_traffic`] asks for when its
/// SENDs do not fit the default room.
const LEAST_INLINE: u32 = 16;

/// The inline room for SENDs of up to `payload` bytes (see
/// [`ReactorConfig::for_traffic`]).
fn inline_room(payload: usize) -> u32 {
    let default = ReactorConfig::default().max_inline as usize;
    let wire = payload.saturating_add(super::SLOT_RESERVE);
    if wire <= default {
        (wire.next_multiple_of(LEAST_INLINE as usize) as u32).max(LEAST_INLINE)
    } else {
        LEAST_INLINE
    }
}

/// How often a reactor watches its peers unless told otherwise.
const PEER_CHECK_INTERVAL: Duration = Duration::from_secs(1);

/// Largest CQ the reactor asks for: rxe and many NICs cap one CQ at about
/// 32k entries, so more connections are spread over more CQs.
const MAX_CQ_ENTRIES: u32 = 32_000;

impl ReactorConfig {
    /// The one sizing rule the tools share: SENDs of up to `payload` bytes,
    /// `depth` receives and send slots per connection (a window of up to
    /// `depth - 1` messages in flight each way: one receive stays reserved
    /// for credit updates), about twice that in send-queue
    /// entries (one fewer than a power of two, at least 31), and
    /// CQs that absorb `connections` such connections (spread over several
    /// CQs when one would be too large), whose records are reserved up
    /// front. Reposts go out in quarter windows. The inline room is what
    /// such a SEND takes (with the trailer a user immediate needs), if it
    /// fits the default, and otherwise the least a provider gives: a
    /// provider sizes every send-queue entry for the inline room asked for
    /// (Soft-RoCE: 208 bytes plus the room, rounded up to a power of two),
    /// so room no SEND uses costs every connection memory. (A WRITE goes
    /// inline only within that room too.)
    ///
    /// ```
    /// # use rdma_comm_core::reactor::*;
    /// let config = ReactorConfig::for_traffic(4096, 64, 16);
    /// assert!(config.cq_count * config.cq_size >= 16 * config.entries_per_conn());
    /// ```
    pub fn for_traffic(payload: usize, depth: u32, connections: u32) -> Self {
        let depth = depth.clamp(4, 4096);
        let config = Self {
            slot_size: (payload + super::SLOT_RESERVE).next_multiple_of(64),
            recv_depth: depth,
            repost_batch: (depth / 4).max(1),
            send_slots: depth,
            sq_depth: (2 * depth).max(32).next_power_of_two() - 1,
            max_inline: inline_room(payload),
            ..Self::default()
        };
        config.absorbing(connections)
    }

    /// Sizes the CQs so that `connections` connections at the configured
    /// depths fit: each CQ must absorb every request its QPs can have
    /// outstanding ([`Reactor::add`](super::Reactor::add) refuses one more).
    /// Also reserves the records of that many connections up front
    /// ([`reserve_connections`](Self::reserve_connections)).
    pub fn absorbing(mut self, connections: u32) -> Self {
        let needed = connections.max(1).saturating_mul(self.entries_per_conn());
        let per_cq_room = MAX_CQ_ENTRIES.saturating_sub(self.srq_depth).max(1);
        self.cq_count = self.cq_count.max(needed.div_ceil(per_cq_room));
        let per_cq = needed.div_ceil(self.cq_count) + self.srq_depth;
        self.cq_size = self.cq_size.max(per_cq).max(256);
        self.reserve_connections = self.reserve_connections.max(connections);
        self
    }

    /// Sleeps (Blocking and Epoll modes) until something happens, never on a
    /// timer: completions, peers' control connections (see
    /// [`PeerLink::event_fd`](super::PeerLink::event_fd)) and
    /// [`Waker`](super::Waker)s end the sleep; `on_idle` runs only after them.
    pub fn sleeping_until_woken(mut self) -> Self {
        self.idle_timeout = Duration::MAX;
        self
    }

    /// CQ entries one connection can need at once: its send queue and its
    /// receives (with an SRQ, none of its own: every CQ keeps room for the
    /// whole SRQ instead).
    pub fn entries_per_conn(&self) -> u32 {
        let receives = if self.srq_depth > 0 {
            0
        } else {
            self.recv_depth.max(super::conn::MIN_RECV_DEPTH)
        };
        self.sq_depth.saturating_add(receives)
    }
}

/// A connection (one QP of one session) within a reactor.
///
/// Ids are reused once a connection is removed, each time with a new
/// generation: an id kept past its connection's removal never reaches the
/// connection that takes its place. An id also names its reactor, so
/// another reactor refuses it (as if the connection were closed).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnId(pub(crate) Key);

impl ConnId {
    pub(crate) fn key(self) -> Key {
        self.0
    }

    /// The connection's slot in the reactor: small, dense and reused, so it
    /// can index a handler's own per-connection arrays (look up the
    /// connection by the whole id, though: the slot is shared over time).
    pub fn slot(self) -> usize {
        self.0.index as usize
    }
}

impl fmt::Debug for ConnId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ConnId({}#{})", self.0.index, self.0.generation)
    }
}

/// A session (one connected QP source and its handler) within a reactor.
/// Reused with a new generation after removal, like [`ConnId`].
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SessionId(pub(crate) Key);

impl SessionId {
    /// The session's slot in the reactor (see [`ConnId::slot`]).
    pub fn slot(self) -> usize {
        self.0.index as usize
    }
}

impl fmt::Debug for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SessionId({}#{})", self.0.index, self.0.generation)
    }
}

/// Why a request was not staged.
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    /// No credit, send-queue entry or send slot right now: retry from
    /// [`Handler::on_writable`](super::Handler::on_writable), which the
    /// reactor calls once room is back (on a datagram endpoint, whose send
    /// queue is full: after a completion or from `on_idle`).
    #[error("would block: the peer has no receive posted or the send queue is full")]
    WouldBlock,
    /// The payload exceeds the slot size.
    #[error("payload of {len} bytes exceeds the maximum of {max}")]
    TooLarge {
        /// Requested length.
        len: usize,
        /// The connection's maximum payload.
        max: usize,
    },
    /// The connection failed or does not exist.
    #[error("the connection is closed")]
    Closed,
    /// A held message of another reactor, or of a connection that is gone.
    #[error("the held message belongs to another reactor or to a connection that is gone")]
    Foreign,
    /// The fill closure of [`Ctx::send_from`](super::Ctx::send_from) staged nothing.
    #[error("the fill closure produced no message")]
    Cancelled,
    /// The request itself is invalid.
    #[error(transparent)]
    Invalid(Error),
}

impl SendError {
    /// A payload of `len` bytes where `max` fit.
    #[cold]
    pub(crate) fn too_large(len: usize, max: usize) -> Self {
        Self::TooLarge { len, max }
    }

    /// An RDMA operation whose local and remote lengths differ.
    #[cold]
    pub(crate) fn lengths_differ() -> Self {
        Self::Invalid(Error::InvalidArgument(
            "local and remote lengths of an RDMA operation differ",
        ))
    }
}

/// A connection id made up for unit tests of other modules.
#[cfg(test)]
pub(crate) fn slab_key_for_tests(index: u32) -> ConnId {
    ConnId(Key {
        index,
        generation: 1,
        owner: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_inline_room_fits_the_traffics_sends_and_no_more() {
        // A SEND takes its payload and the trailer a user immediate needs.
        for (payload, room) in [(0, 16), (8, 16), (12, 16), (13, 32), (44, 48), (60, 64)] {
            assert_eq!(inline_room(payload), room, "payload {payload}");
            assert_eq!(ReactorConfig::for_traffic(payload, 16, 1).max_inline, room);
        }
        // Too large to go inline under the default room: the least room.
        for payload in [61, 64, 4096, usize::MAX] {
            assert_eq!(inline_room(payload), LEAST_INLINE, "payload {payload}");
        }
    }
}
