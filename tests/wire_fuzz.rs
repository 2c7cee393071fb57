//! Fuzzes the handshake decoder with proptest (bounded, so it runs in CI on the
//! host): arbitrary bytes, mutated valid frames and truncations never panic,
//! and every valid message round-trips.

use proptest::prelude::*;
use rdma_comm_core::session::wire::{
    FRAME_HEADER_LEN, Handshake, MAX_PAYLOAD, Message, QpInfo, RegionInfo, WireError,
};

fn qp_info() -> impl Strategy<Value = QpInfo> {
    (
        "[a-z0-9_-]{0,40}",
        0u32..=0x00ff_ffff,
        0u32..=0x00ff_ffff,
        any::<[u8; 16]>(),
        any::<u16>(),
        prop::sample::select(vec![256u16, 512, 1024, 2048, 4096]),
    )
        .prop_map(|(name, qpn, psn, gid, lid, mtu)| QpInfo {
            name,
            qpn,
            psn,
            gid,
            lid,
            mtu,
        })
}

fn region() -> impl Strategy<Value = RegionInfo> {
    (
        "\\PC{0,20}",
        any::<u32>(),
        0u64..(1 << 62),
        0u64..(1 << 40),
        any::<u32>(),
    )
        .prop_map(|(name, id, addr, len, rkey)| RegionInfo {
            id,
            name,
            addr,
            len,
            rkey,
        })
}

fn handshake() -> impl Strategy<Value = Handshake> {
    (
        prop::collection::vec(qp_info(), 0..8),
        prop::collection::vec(region(), 0..8),
    )
        .prop_map(|(qps, regions)| Handshake { qps, regions })
}

fn message() -> impl Strategy<Value = Message> {
    prop_oneof![
        handshake().prop_map(Message::Hello),
        handshake().prop_map(Message::Accept),
        (any::<u16>(), "\\PC{0,60}").prop_map(|(code, reason)| Message::Reject { code, reason }),
        Just(Message::Ready),
        any::<u16>().prop_map(|code| Message::Disconnect { code }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 5_000, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = Message::decode(&bytes);
        let _ = Message::read_from(&mut bytes.as_slice());
    }

    #[test]
    fn valid_messages_round_trip(msg in message()) {
        let bytes = msg.encode();
        prop_assert!(bytes.len() <= FRAME_HEADER_LEN + MAX_PAYLOAD as usize);
        let (back, used) = Message::decode(&bytes).unwrap();
        prop_assert_eq!(used, bytes.len());
        prop_assert_eq!(back, msg);
    }

    #[test]
    fn mutated_frames_fail_cleanly(msg in message(), flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6)) {
        let mut bytes = msg.encode();
        for (at, value) in flips {
            let i = at.index(bytes.len());
            bytes[i] = value;
        }
        // Either a valid message or a typed error; never a panic or a huge allocation.
        if let Err(err) = Message::read_from(&mut bytes.as_slice()) {
            prop_assert!(!err.to_string().is_empty());
        }
    }

    #[test]
    fn every_truncation_is_reported_as_truncated(msg in message(), cut in any::<prop::sample::Index>()) {
        let bytes = msg.encode();
        let cut = cut.index(bytes.len());
        let err = Message::decode(&bytes[..cut]).unwrap_err();
        prop_assert!(matches!(err, WireError::Truncated(_)), "cut {} of {}: {}", cut, bytes.len(), err);
    }
}
