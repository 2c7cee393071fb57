//! A structure-aware fuzzer for the handshake wire format (proptest,
//! bounded so it runs on the host in CI). Random bytes almost never pass
//! the magic, so most cases are frames with a valid header and hostile
//! content: counts and lengths at and past the limits, 24-bit fields with
//! high bits set, invalid MTUs, regions with an address other than 0, keys
//! that do not match the QP count, names of 255 bytes and more, lengths in
//! the header that disagree with the payload, other versions and unknown
//! kinds.
//!
//! What must hold: nothing panics; the encoder refuses exactly what the
//! decoder refuses; what encodes decodes to the same message, and what
//! decodes encodes to the same bytes; a frame dripped in pieces through the
//! incremental reader arrives as the same frame or the same error.
//! The handshake state machines are fuzzed in `src/session/handshake.rs`.

use proptest::prelude::*;
use rdma_comm_core::session::wire::{
    FRAME_HEADER_LEN, FrameReader, Handshake, Hello, MAGIC, MAX_NAME_LEN, MAX_PAYLOAD, MAX_QPS,
    MAX_REGIONS, Message, PROOF_LEN, QpInfo, RegionInfo, VERSION, WireError,
};

/// Names around the 255-byte limit, with multi-byte characters.
fn name() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-z0-9_-]{0,12}",
        "\\PC{0,20}",
        (250usize..=260).prop_map(|n| "n".repeat(n)),
        (120usize..=130).prop_map(|n| "é".repeat(n)),
    ]
}

fn mtu() -> impl Strategy<Value = u16> {
    prop_oneof![
        4 => prop::sample::select(vec![256u16, 512, 1024, 2048, 4096]),
        1 => any::<u16>(),
    ]
}

fn field24() -> impl Strategy<Value = u32> {
    prop_oneof![4 => 0u32..=0x00ff_ffff, 1 => any::<u32>()]
}

fn qp_info() -> impl Strategy<Value = QpInfo> {
    (
        name(),
        field24(),
        field24(),
        any::<[u8; 16]>(),
        any::<u16>(),
        mtu(),
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

/// A handshake whose counts are near the limits, and whose regions mostly
/// (not always) carry one key per QP.
fn handshake() -> impl Strategy<Value = Handshake> {
    let qp_count = prop_oneof![4 => 0usize..4, 1 => (MAX_QPS - 1)..=(MAX_QPS + 1)];
    let region_count = prop_oneof![4 => 0usize..4, 1 => (MAX_REGIONS - 1)..=(MAX_REGIONS + 1)];
    (qp_count, region_count).prop_flat_map(|(n_qps, n_regions)| {
        let region = (
            name(),
            any::<u32>(),
            prop_oneof![8 => Just(0u64), 1 => any::<u64>()],
            prop_oneof![4 => 0u64..(1 << 32), 1 => any::<u64>()],
            prop_oneof![
                8 => Just(n_qps),
                1 => 0usize..=(n_qps + 1),
            ],
            any::<u32>(),
        )
            .prop_map(|(name, id, addr, len, keys, rkey)| RegionInfo {
                id,
                name,
                addr,
                len,
                rkeys: (0..keys as u32).map(|i| rkey.wrapping_add(i)).collect(),
            });
        (
            prop::collection::vec(qp_info(), n_qps),
            prop::collection::vec(region, n_regions),
        )
            .prop_map(|(qps, regions)| Handshake { qps, regions })
    })
}

fn message() -> impl Strategy<Value = Message> {
    let qp_names = prop_oneof![
        4 => prop::collection::vec(name(), 0..4),
        1 => prop::collection::vec(name(), (MAX_QPS - 1)..=(MAX_QPS + 1)),
    ];
    prop_oneof![
        (any::<[u8; PROOF_LEN]>(), name(), qp_names).prop_map(|(nonce, identity, qps)| {
            Message::Hello(Hello {
                nonce,
                identity,
                qps,
            })
        }),
        (any::<[u8; PROOF_LEN]>(), any::<bool>())
            .prop_map(|(nonce, auth)| Message::Challenge { nonce, auth }),
        any::<[u8; PROOF_LEN]>().prop_map(Message::Proof),
        Just(Message::Admit),
        handshake().prop_map(Message::Offer),
        handshake().prop_map(Message::Accept),
        (any::<u16>(), name()).prop_map(|(code, reason)| Message::Reject { code, reason }),
        prop::option::of(any::<[u8; PROOF_LEN]>()).prop_map(|proof| Message::Ready { proof }),
        any::<u16>().prop_map(|code| Message::Disconnect { code }),
    ]
}

/// A frame with a valid magic, usually our version and a known kind, and a
/// payload length that may disagree with the payload.
fn hostile_frame() -> impl Strategy<Value = Vec<u8>> {
    (
        prop_oneof![8 => Just(VERSION), 1 => any::<u16>()],
        prop_oneof![8 => 1u16..=9, 1 => any::<u16>()],
        prop::collection::vec(any::<u8>(), 0..600),
        prop_oneof![
            4 => Just(None),
            1 => any::<u32>().prop_map(Some),
            1 => (0u32..=1024).prop_map(Some),
        ],
    )
        .prop_map(|(version, kind, payload, claimed)| {
            let len = claimed.unwrap_or(payload.len() as u32);
            let mut frame = Vec::with_capacity(FRAME_HEADER_LEN + payload.len());
            frame.extend_from_slice(&MAGIC.to_le_bytes());
            frame.extend_from_slice(&version.to_le_bytes());
            frame.extend_from_slice(&kind.to_le_bytes());
            frame.extend_from_slice(&len.to_le_bytes());
            frame.extend_from_slice(&payload);
            frame
        })
}

/// Feeds `bytes` to a frame reader in chunks of `chunk` bytes; the first
/// frame or error.
fn read_in_pieces(bytes: &[u8], chunk: usize) -> Result<Vec<u8>, WireError> {
    let mut reader = FrameReader::new(MAX_PAYLOAD);
    let mut rest = bytes;
    loop {
        let take = chunk.min(rest.len());
        let mut piece = &rest[..take];
        match reader.read_from(&mut piece)? {
            Some(frame) => return Ok(frame.to_vec()),
            None => rest = &rest[take - piece.len()..],
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3_000, ..ProptestConfig::default() })]

    #[test]
    fn encoder_and_decoder_agree_on_every_message(msg in message()) {
        match msg.encode() {
            Ok(bytes) => {
                prop_assert!(msg.check().is_ok());
                prop_assert!(bytes.len() <= FRAME_HEADER_LEN + MAX_PAYLOAD as usize);
                let (back, used) = Message::decode(&bytes).unwrap();
                prop_assert_eq!(used, bytes.len());
                prop_assert_eq!(&back, &msg);
                prop_assert_eq!(read_in_pieces(&bytes, 7).unwrap(), bytes);
            }
            Err(err) => {
                prop_assert!(msg.check().is_err(), "refused a valid message: {}", err);
            }
        }
    }

    #[test]
    fn hostile_frames_fail_typed_and_what_decodes_is_canonical(frame in hostile_frame(), chunk in 1usize..40) {
        match Message::decode(&frame) {
            Ok((msg, used)) => {
                prop_assert_eq!(msg.encode().unwrap(), frame[..used].to_vec());
            }
            Err(err) => prop_assert!(!err.to_string().is_empty()),
        }
        // The incremental reader agrees with the whole-buffer decoder on
        // where the frame ends, or fails on the header the same way.
        match (read_in_pieces(&frame, chunk), Message::decode(&frame)) {
            (Ok(got), Ok((_, used))) => prop_assert_eq!(got.len(), used),
            (Err(WireError::Oversized { .. }), Err(WireError::Oversized { .. }))
            | (Err(WireError::UnsupportedVersion { .. }), Err(WireError::UnsupportedVersion { .. }))
            | (Err(WireError::Truncated(_)), Err(WireError::Truncated(_)))
            | (Ok(_), Err(_)) => {}
            (got, want) => prop_assert!(false, "reader {:?} vs decoder {:?}", got, want),
        }
    }

    #[test]
    fn mutated_valid_frames_fail_cleanly(msg in message(), flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6)) {
        let Ok(mut bytes) = msg.encode() else { return Ok(()) };
        for (at, value) in flips {
            let i = at.index(bytes.len());
            bytes[i] = value;
        }
        if let Ok((back, used)) = Message::decode(&bytes) {
            prop_assert_eq!(back.encode().unwrap(), bytes[..used].to_vec());
        }
        let _ = read_in_pieces(&bytes, 3);
    }

    #[test]
    fn every_truncation_is_reported_as_truncated(msg in message(), cut in any::<prop::sample::Index>()) {
        let Ok(bytes) = msg.encode() else { return Ok(()) };
        let cut = cut.index(bytes.len());
        let err = Message::decode(&bytes[..cut]).unwrap_err();
        prop_assert!(matches!(err, WireError::Truncated(_)), "cut {} of {}: {}", cut, bytes.len(), err);
        let err = read_in_pieces(&bytes[..cut], 5).unwrap_err();
        prop_assert!(matches!(err, WireError::Truncated(_)) || cut == 0, "cut {}: {}", cut, err);
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = Message::decode(&bytes);
        let _ = read_in_pieces(&bytes, 16);
    }
}

#[test]
fn names_at_the_limit_pass_and_one_byte_more_does_not() {
    let at = Message::reject(1, &"r".repeat(MAX_NAME_LEN));
    assert!(at.encode().is_ok());
    let over = Message::Reject {
        code: 1,
        reason: "r".repeat(MAX_NAME_LEN + 1),
    };
    assert!(over.encode().is_err());
}
