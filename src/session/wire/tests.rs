//! Unit tests of the wire formats: round trips, limits and refusals of
//! malformed or hostile frames.

use super::*;

fn sample() -> Message {
    Message::Offer(Handshake {
        qps: vec![QpInfo {
            name: "data".into(),
            qpn: 0x11,
            psn: 0xabcdef,
            gid: [7; 16],
            lid: 3,
            mtu: 1024,
        }],
        regions: vec![RegionInfo {
            id: 9,
            name: "inbox".into(),
            addr: 0,
            len: 4096,
            rkeys: vec![0x1234],
        }],
    })
}

fn all_kinds() -> Vec<Message> {
    vec![
        Message::Hello(Hello {
            nonce: [3; PROOF_LEN],
            identity: "client-7".into(),
            qps: vec!["data".into(), "ctl".into()],
        }),
        Message::Challenge {
            nonce: [4; PROOF_LEN],
            auth: true,
        },
        Message::Proof([5; PROOF_LEN]),
        Message::Admit,
        sample(),
        Message::Accept(Handshake::default()),
        Message::reject(2, "too many QPs"),
        Message::Ready { proof: None },
        Message::Ready {
            proof: Some([6; PROOF_LEN]),
        },
        Message::Disconnect { code: 0 },
    ]
}

#[test]
fn messages_round_trip() {
    for msg in all_kinds() {
        let bytes = msg.encode().unwrap();
        let (back, used) = Message::decode(&bytes).unwrap();
        assert_eq!((back, used), (msg.clone(), bytes.len()));
        let mut reader = FrameReader::new(MAX_PAYLOAD);
        let mut stream = bytes.as_slice();
        let frame = loop {
            if let Some(frame) = reader.read_from(&mut stream).unwrap() {
                break frame.to_vec();
            }
        };
        assert_eq!(frame, bytes);
    }
}

#[test]
fn fields_are_little_endian_at_fixed_offsets() {
    let bytes = sample().encode().unwrap();
    assert_eq!(&bytes[0..4], b"RCCM");
    assert_eq!(&bytes[4..6], &[3, 0]);
    assert_eq!(&bytes[6..8], &[KIND_OFFER as u8, 0]);
    assert_eq!(&bytes[12..14], &[1, 0], "one QP");
    assert_eq!(&bytes[14..18], &[0x11, 0, 0, 0], "qpn");
}

#[test]
fn the_encoder_refuses_what_the_decoder_would() {
    let long = "x".repeat(MAX_NAME_LEN + 1);
    let mut bad = vec![
        Message::Hello(Hello {
            nonce: [0; PROOF_LEN],
            identity: long.clone(),
            qps: vec![],
        }),
        Message::Reject {
            code: 1,
            reason: long.clone(),
        },
    ];
    let Message::Offer(good) = sample() else {
        unreachable!()
    };
    let mut no_key = good.clone();
    no_key.regions[0].rkeys.clear();
    let mut wide_qpn = good.clone();
    wide_qpn.qps[0].qpn = 1 << 24;
    let mut many = good.clone();
    many.qps = vec![good.qps[0].clone(); MAX_QPS + 1];
    bad.extend([no_key, wide_qpn, many].map(Message::Accept));
    for message in bad {
        assert!(message.encode().is_err(), "{message:?}");
    }
    assert_eq!(Message::reject(1, &long), Message::reject(1, &long[..255]));
}

#[test]
fn a_region_with_an_address_is_refused_both_ways() {
    let Message::Offer(mut offer) = sample() else {
        unreachable!()
    };
    offer.regions[0].addr = 0x7f00_0000_1000;
    let refused = Message::Offer(offer.clone()).encode().unwrap_err();
    assert!(matches!(refused, WireError::Malformed(_)), "{refused}");

    // The same frame with the address patched in, as a peer would send it.
    offer.regions[0].addr = 0;
    let mut bytes = Message::Offer(offer).encode().unwrap();
    let len = 4096u64.to_le_bytes();
    let at = bytes.windows(8).position(|w| w == len).unwrap() - 8;
    assert_eq!(
        &bytes[at..at + 8],
        &[0; 8],
        "the address precedes the length"
    );
    bytes[at..at + 8].copy_from_slice(&0x7f00_0000_1000u64.to_le_bytes());
    let err = Message::decode(&bytes).unwrap_err();
    assert!(
        matches!(err, WireError::Malformed(why) if why.contains("address is not 0")),
        "{err}"
    );
}

#[test]
fn the_largest_valid_offer_fits_a_frame() {
    let name = "n".repeat(MAX_NAME_LEN);
    let qp = QpInfo {
        name: name.clone(),
        qpn: 1,
        psn: 1,
        gid: [0; 16],
        lid: 0,
        mtu: 4096,
    };
    let region = RegionInfo {
        id: 1,
        name,
        addr: 0,
        len: 1,
        rkeys: vec![1; MAX_QPS],
    };
    let offer = Message::Offer(Handshake {
        qps: vec![qp; MAX_QPS],
        regions: vec![region; MAX_REGIONS],
    });
    let bytes = offer.encode().unwrap();
    assert_eq!(Message::decode(&bytes).unwrap().0, offer);
}

#[test]
fn decoder_rejects_bad_input_with_clear_errors() {
    let good = sample().encode().unwrap();
    let mut bad_magic = good.clone();
    bad_magic[0] = b'X';
    assert!(matches!(
        Message::decode(&bad_magic),
        Err(WireError::BadMagic(_))
    ));

    let mut bad_version = good.clone();
    // Version 2 peers put an 8-byte header in front of every SEND:
    // they are refused at the handshake, not misread on the QP.
    bad_version[4] = 2;
    assert!(matches!(
        Message::decode(&bad_version),
        Err(WireError::UnsupportedVersion {
            found: 2,
            supported: 3
        })
    ));

    for cut in [0, 5, FRAME_HEADER_LEN, good.len() - 1] {
        assert!(
            matches!(Message::decode(&good[..cut]), Err(WireError::Truncated(_))),
            "cut at {cut}"
        );
    }

    let mut huge = good.clone();
    huge[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(matches!(
        Message::decode(&huge),
        Err(WireError::Oversized { len: u32::MAX, .. })
    ));
    let mut reader = FrameReader::new(MAX_PAYLOAD);
    let mut stream = huge.as_slice();
    assert!(matches!(
        reader.read_from(&mut stream),
        Err(WireError::Oversized { .. })
    ));

    let mut unknown = Message::Disconnect { code: 0 }.encode().unwrap();
    unknown[6] = 99;
    assert!(matches!(
        Message::decode(&unknown),
        Err(WireError::UnknownKind(99))
    ));

    let mut trailing = Message::Disconnect { code: 0 }.encode().unwrap();
    trailing[8] = 3;
    trailing.push(0);
    assert!(matches!(
        Message::decode(&trailing),
        Err(WireError::Malformed(_))
    ));
}

#[test]
fn garbage_from_a_stray_client_is_bad_magic() {
    let mut reader = FrameReader::new(MAX_PAYLOAD);
    let err = reader
        .read_from(&mut &b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"[..])
        .unwrap_err();
    assert!(matches!(err, WireError::BadMagic(_)), "{err}");
    assert!(err.to_string().contains("not an rdma-comm-core peer"));
}

#[test]
fn a_frame_dripped_byte_by_byte_arrives_whole_and_eof_is_typed() {
    let bytes = Message::Disconnect { code: 7 }.encode().unwrap();
    let mut reader = FrameReader::new(16);
    let mut got = None;
    for (i, byte) in bytes.iter().enumerate() {
        let frame = reader.read_from(&mut std::slice::from_ref(byte)).unwrap();
        assert_eq!(frame.is_some(), i == bytes.len() - 1);
        got = frame.map(<[u8]>::to_vec);
    }
    assert_eq!(got.unwrap(), bytes);
    let err = reader.read_from(&mut &[][..]).unwrap_err();
    assert!(matches!(err, WireError::Io(ref e) if e.kind() == io::ErrorKind::UnexpectedEof));
    let mut reader = FrameReader::new(16);
    assert!(reader.read_from(&mut &bytes[..3]).unwrap().is_none());
    assert!(matches!(
        reader.read_from(&mut &[][..]),
        Err(WireError::Truncated("header"))
    ));
}

/// A frame of `kind` whose payload is `payload`, built by hand (the
/// encoder refuses what these tests send).
fn raw_frame(kind: u16, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&MAGIC.to_le_bytes());
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&kind.to_le_bytes());
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(payload);
    out
}

#[test]
fn a_reject_reason_with_control_characters_is_escaped_when_sent_and_refused_when_received() {
    let hostile = "no\nINFO forged line \u{1b}[2J \u{202e}desrever";
    let mut payload = 4u16.to_le_bytes().to_vec();
    payload.push(hostile.len() as u8);
    payload.extend_from_slice(hostile.as_bytes());
    assert!(matches!(
        Message::decode(&raw_frame(KIND_REJECT, &payload)),
        Err(WireError::Malformed(_))
    ));
    // Our own reasons (an authorize callback's, say) go out escaped.
    let Message::Reject { reason, .. } = Message::reject(4, hostile) else {
        unreachable!()
    };
    assert_eq!(reason, "no\\nINFO forged line \\u{1b}[2J \\u{202e}desrever");
    // Plain text, quotes and non-ASCII letters included, is kept as sent.
    let plain = Message::reject(5, "busy: \"später\" \\ retry");
    let (decoded, _) = Message::decode(&plain.encode().unwrap()).unwrap();
    assert_eq!(decoded, plain);
}

#[test]
fn names_with_control_or_bidi_characters_are_refused_both_ways() {
    for bad in [
        "a\nb",
        "tab\there",
        "\u{1b}[31m",
        "x\u{202e}y",
        "\u{2066}",
        "line\u{2028}break",
        "zero\u{200b}width",
        "\u{feff}bom",
        "tag\u{e0041}",
    ] {
        let hello = Message::Hello(Hello {
            nonce: [1; PROOF_LEN],
            identity: bad.into(),
            qps: vec!["data".into()],
        });
        assert!(
            matches!(hello.encode(), Err(WireError::Malformed(_))),
            "{bad:?} encoded"
        );
        let mut payload = vec![1; PROOF_LEN];
        payload.push(bad.len() as u8);
        payload.extend_from_slice(bad.as_bytes());
        payload.extend_from_slice(&1u16.to_le_bytes());
        payload.push(4);
        payload.extend_from_slice(b"data");
        assert!(
            matches!(
                Message::decode(&raw_frame(KIND_HELLO, &payload)),
                Err(WireError::Malformed(_))
            ),
            "{bad:?} decoded"
        );
    }
}
