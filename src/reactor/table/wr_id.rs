//! What the reactor writes into a work request's `wr_id`, and reads back
//! from its completion: which connection (index and generation), whether
//! it is a receive or a send-queue request, and the receive slot or
//! send-queue sequence number.
//!
//! Layout, from the top bit: connection index (20 bits), whether the
//! connection is direct (1 bit), connection generation (low 9 bits), kind
//! (2 bits), slot or sequence (32 bits; a direct connection's handler's
//! own id).
//! A completion is also checked against the QP number of the connection it
//! names, so a request no connection of this reactor posted is never taken
//! for one of its own.
//!
//! Receives of the reactor's SRQ belong to no connection until one consumes
//! them; theirs is: a tag (42 bits, keyed with a secret of the SRQ pool's),
//! kind 3, and the slot in the low 20 bits. The pool keeps the exact `wr_id`
//! of each posted slot, so a completion that matches it is a genuine
//! consumption whichever QP reports it.

use super::super::slab::Key;

/// Bits of the connection index: a reactor serves at most 2^20 - 1
/// connections at once (the all-ones index means "the SRQ").
const INDEX_BITS: u32 = 20;
const GENERATION_BITS: u32 = 9;
const KIND_BITS: u32 = 2;
/// Set in every request of a direct connection (never in an SRQ
/// receive's, whose tag bits it would be: those are told by their kind).
const DIRECT_BIT: u64 = 1 << (32 + KIND_BITS + GENERATION_BITS);

/// Most connections a reactor holds at once.
pub(crate) const MAX_CONNS: usize = (1 << INDEX_BITS) - 1;
/// Bits of an SRQ receive's `wr_id` that carry its slot: an SRQ has at
/// most 2^20 slots.
pub(crate) const SRQ_SLOT_BITS: u32 = 20;

const KIND_RECV: u64 = 1;
const KIND_SEND: u64 = 2;
const KIND_SRQ_RECV: u64 = 3;

/// What a completion's `wr_id` says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum WrKind {
    Recv {
        slot: u32,
    },
    Send {
        seq: u32,
    },
    /// A receive of the reactor's SRQ: the pool checks the whole `wr_id`.
    SrqRecv,
    Unknown,
}

#[inline]
fn encode(index: u32, generation: u32, kind: u64, value: u32) -> u64 {
    let generation = u64::from(generation) & ((1 << GENERATION_BITS) - 1);
    (u64::from(index) << (64 - INDEX_BITS))
        | (generation << (32 + KIND_BITS))
        | (kind << 32)
        | u64::from(value)
}

/// A receive into slot `slot` of connection `conn`'s own ring.
#[inline]
pub(crate) fn recv(conn: Key, slot: u32) -> u64 {
    encode(conn.index, conn.generation, KIND_RECV, slot)
}

/// A receive into slot `slot` (below 2^20) of the reactor's SRQ, carrying
/// `tag` (its low 42 bits).
#[inline]
pub(crate) fn srq_recv(slot: u32, tag: u64) -> u64 {
    let tag = tag & ((1 << 42) - 1);
    // Tag bits above the kind, and between the slot and the kind.
    let high = (tag >> 12) << 34;
    let low = (tag & 0xfff) << SRQ_SLOT_BITS;
    high | (KIND_SRQ_RECV << 32) | low | u64::from(slot & ((1 << SRQ_SLOT_BITS) - 1))
}

/// The slot an SRQ receive's `wr_id` names.
#[inline]
pub(crate) fn srq_slot(wr_id: u64) -> u32 {
    (wr_id as u32) & ((1 << SRQ_SLOT_BITS) - 1)
}

/// Send-queue request `seq` of connection `conn`.
#[inline]
pub(crate) fn send(conn: Key, seq: u32) -> u64 {
    encode(conn.index, conn.generation, KIND_SEND, seq)
}

/// The top 32 bits of every send-queue request of direct connection
/// `conn`: the low 32 are its handler's.
#[inline]
pub(crate) fn direct_send_tag(conn: Key) -> u64 {
    encode(conn.index, conn.generation, KIND_SEND, 0) | DIRECT_BIT
}

/// The top 32 bits of every receive of direct connection `conn`.
#[inline]
pub(crate) fn direct_recv_tag(conn: Key) -> u64 {
    encode(conn.index, conn.generation, KIND_RECV, 0) | DIRECT_BIT
}

/// True if `wr_id`, of kind `kind` (as decoded), is a direct connection's:
/// a send-queue request or a receive with the direct bit (an SRQ
/// receive's tag may set that bit, and so does `BIND_WR_ID`, whose kind
/// is neither).
#[inline]
pub(crate) fn is_direct(wr_id: u64, kind: WrKind) -> bool {
    wr_id & DIRECT_BIT != 0 && matches!(kind, WrKind::Send { .. } | WrKind::Recv { .. })
}

/// The connection index and generation bits of a direct connection's
/// `wr_id` (as [`is_direct`] tells it), or `None` for any other: one mask
/// and compare, where [`decode`] goes through the kind.
#[inline(always)]
pub(crate) fn decode_direct(wr_id: u64) -> Option<(u32, u32)> {
    let kind = (wr_id >> 32) & ((1 << KIND_BITS) - 1);
    // KIND_RECV or KIND_SEND, the kinds a direct connection posts.
    if wr_id & DIRECT_BIT == 0 || kind.wrapping_sub(KIND_RECV) > KIND_SEND - KIND_RECV {
        return None;
    }
    let index = (wr_id >> (64 - INDEX_BITS)) as u32;
    let generation = ((wr_id >> (32 + KIND_BITS)) & ((1 << GENERATION_BITS) - 1)) as u32;
    Some((index, generation))
}

/// The connection index, the generation bits and the kind of a `wr_id`.
#[inline]
pub(crate) fn decode(wr_id: u64) -> (u32, u32, WrKind) {
    let index = (wr_id >> (64 - INDEX_BITS)) as u32;
    let generation = ((wr_id >> (32 + KIND_BITS)) & ((1 << GENERATION_BITS) - 1)) as u32;
    let value = wr_id as u32;
    let kind = match (wr_id >> 32) & ((1 << KIND_BITS) - 1) {
        KIND_RECV => WrKind::Recv { slot: value },
        KIND_SEND => WrKind::Send { seq: value },
        KIND_SRQ_RECV => WrKind::SrqRecv,
        _ => WrKind::Unknown,
    };
    (index, generation, kind)
}

/// Bits between the kind and the index that name a datagram endpoint in
/// its requests' ids: endpoints are numbered below 2^6, so the direct
/// bit above them is never set.
const ENDPOINT_SHIFT: u32 = 32 + KIND_BITS;
/// Most datagram endpoints a reactor holds.
pub(crate) const MAX_ENDPOINTS: usize = 1 << 6;
/// The index no connection has: datagram endpoints' requests carry it.
const DATAGRAM_INDEX: u64 = MAX_CONNS as u64;

/// A receive into slot `slot` of datagram endpoint `endpoint`.
#[inline]
pub(crate) fn datagram_recv(endpoint: u32, slot: u32) -> u64 {
    datagram(endpoint, KIND_RECV, slot)
}

/// Send `seq` of datagram endpoint `endpoint`.
#[inline]
pub(crate) fn datagram_send(endpoint: u32, seq: u32) -> u64 {
    datagram(endpoint, KIND_SEND, seq)
}

#[inline]
fn datagram(endpoint: u32, kind: u64, value: u32) -> u64 {
    debug_assert!((endpoint as usize) < MAX_ENDPOINTS);
    (DATAGRAM_INDEX << (64 - INDEX_BITS))
        | (u64::from(endpoint) % MAX_ENDPOINTS as u64) << ENDPOINT_SHIFT
        | (kind << 32)
        | u64::from(value)
}

/// The endpoint and kind of a datagram endpoint's `wr_id`, or `None` for
/// any other (connections' ids, SRQ receives', window binds', strangers').
#[inline]
pub(crate) fn decode_datagram(wr_id: u64) -> Option<(u32, WrKind)> {
    let mask_between = ((1u64 << (64 - INDEX_BITS - ENDPOINT_SHIFT)) - 1) << ENDPOINT_SHIFT;
    let endpoint_bits = (MAX_ENDPOINTS as u64 - 1) << ENDPOINT_SHIFT;
    if wr_id >> (64 - INDEX_BITS) != DATAGRAM_INDEX || wr_id & mask_between & !endpoint_bits != 0 {
        return None;
    }
    let endpoint = ((wr_id >> ENDPOINT_SHIFT) & (MAX_ENDPOINTS as u64 - 1)) as u32;
    let value = wr_id as u32;
    match (wr_id >> 32) & ((1 << KIND_BITS) - 1) {
        KIND_RECV => Some((endpoint, WrKind::Recv { slot: value })),
        KIND_SEND => Some((endpoint, WrKind::Send { seq: value })),
        _ => None,
    }
}

/// True if `generation` (as decoded) is that of `conn`.
#[inline]
pub(crate) fn same_generation(conn: Key, generation: u32) -> bool {
    conn.generation & ((1 << GENERATION_BITS) - 1) == generation
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip() {
        let conn = Key {
            index: MAX_CONNS as u32 - 1,
            generation: 1027,
            owner: 1,
        };
        let (index, generation, kind) = decode(recv(conn, u32::MAX));
        assert_eq!((index, kind), (conn.index, WrKind::Recv { slot: u32::MAX }));
        assert!(same_generation(conn, generation));
        let (index, generation, kind) = decode(send(conn, 7));
        assert_eq!((index, kind), (conn.index, WrKind::Send { seq: 7 }));
        assert!(same_generation(conn, generation));
        let next = Key {
            generation: conn.generation + 1,
            ..conn
        };
        assert!(!same_generation(next, generation));
        let srq = srq_recv(5, u64::MAX);
        assert_eq!((decode(srq).2, srq_slot(srq)), (WrKind::SrqRecv, 5));
        assert_ne!(srq_recv(5, 1), srq_recv(5, 2), "the tag is in the id");
        assert_eq!(srq_slot(srq_recv((1 << 20) - 1, 0)), (1 << 20) - 1);
        assert_eq!(decode(0).2, WrKind::Unknown);
    }

    #[test]
    fn direct_ids_carry_their_connection_and_the_handlers_id_apart() {
        let conn = Key {
            index: 77,
            generation: 513,
            owner: 1,
        };
        for (tag, want) in [
            (direct_send_tag(conn), WrKind::Send { seq: 0xfeed }),
            (direct_recv_tag(conn), WrKind::Recv { slot: 0xfeed }),
        ] {
            let wr_id = tag | 0xfeed;
            let (index, generation, kind) = decode(wr_id);
            assert_eq!((index, kind), (77, want));
            assert!(same_generation(conn, generation));
            assert!(is_direct(wr_id, kind));
            assert!(!is_direct(send(conn, 0xfeed), decode(send(conn, 0xfeed)).2));
        }
        // An SRQ receive's tag may set the bit: its kind tells it apart.
        let srq = srq_recv(3, u64::MAX);
        assert!(!is_direct(srq, decode(srq).2));
    }

    proptest::proptest! {
        /// An id taken for a datagram endpoint's is exactly the one that
        /// endpoint's request would carry: no other id is.
        #[test]
        fn a_datagram_id_is_decoded_only_from_its_own_encoding(wr_id: u64) {
            if let Some((endpoint, kind)) = decode_datagram(wr_id) {
                let again = match kind {
                    WrKind::Recv { slot } => datagram_recv(endpoint, slot),
                    WrKind::Send { seq } => datagram_send(endpoint, seq),
                    _ => unreachable!("decode_datagram gives a receive or a send"),
                };
                proptest::prop_assert_eq!(again, wr_id);
            }
        }

        /// A connection's tags made once (`SendQueue`'s and `RecvRing`'s
        /// tags: the id with value 0) with a value OR-ed in
        /// are the ids encoded whole.
        #[test]
        fn tag_with_a_value_is_the_whole_id(
            index in 0..MAX_CONNS as u32,
            generation: u32,
            value: u32,
        ) {
            let conn = Key { index, generation, owner: 1 };
            proptest::prop_assert_eq!(send(conn, 0) | u64::from(value), send(conn, value));
            proptest::prop_assert_eq!(recv(conn, 0) | u64::from(value), recv(conn, value));
        }

        /// The direct path's shortcut says what the full decode says, for
        /// any id a completion may carry (a stranger's included).
        #[test]
        fn decode_direct_agrees_with_decode(wr_id: u64) {
            let (index, generation, kind) = decode(wr_id);
            let want = is_direct(wr_id, kind).then_some((index, generation));
            proptest::prop_assert_eq!(decode_direct(wr_id), want);
        }

        /// Every id a direct connection's handler can post is decoded as
        /// its connection's.
        #[test]
        fn decode_direct_finds_every_direct_id(
            index in 0..MAX_CONNS as u32,
            generation: u32,
            own: u32,
            receive: bool,
        ) {
            let conn = Key { index, generation, owner: 1 };
            let tag = if receive { direct_recv_tag(conn) } else { direct_send_tag(conn) };
            let (found, bits) = decode_direct(tag | u64::from(own)).expect("a direct id");
            proptest::prop_assert_eq!(found, index);
            proptest::prop_assert!(same_generation(conn, bits));
        }
    }

    #[test]
    fn datagram_ids_are_no_connections_and_no_connections_ids_are_datagrams() {
        for endpoint in [0, 1, MAX_ENDPOINTS as u32 - 1] {
            for (wr_id, want) in [
                (datagram_recv(endpoint, 7), WrKind::Recv { slot: 7 }),
                (
                    datagram_send(endpoint, u32::MAX),
                    WrKind::Send { seq: u32::MAX },
                ),
            ] {
                assert_eq!(decode_datagram(wr_id), Some((endpoint, want)));
                assert_eq!(
                    decode(wr_id).0,
                    MAX_CONNS as u32,
                    "an index no connection has"
                );
                let (_, _, kind) = decode(wr_id);
                assert!(!is_direct(wr_id, kind));
                assert_eq!(decode_direct(wr_id), None);
            }
        }
        let conn = Key {
            index: MAX_CONNS as u32 - 1,
            generation: u32::MAX,
            owner: 1,
        };
        for wr_id in [
            recv(conn, 1),
            send(conn, 1),
            direct_send_tag(conn) | 5,
            srq_recv(1, 0),
            crate::verbs::BIND_WR_ID,
        ] {
            assert_eq!(decode_datagram(wr_id), None, "{wr_id:#x}");
        }
        // An SRQ receive whose tag sets every bit is still the SRQ's.
        assert_eq!(decode_datagram(srq_recv(1, u64::MAX)), None);
    }

    #[test]
    fn window_binds_are_never_taken_for_our_requests() {
        let bind = crate::verbs::BIND_WR_ID;
        assert_eq!(decode(bind).2, WrKind::Unknown);
        assert!(
            !is_direct(bind, decode(bind).2),
            "nor for a direct connection's"
        );
        assert_eq!(decode_direct(bind), None);
    }
}
