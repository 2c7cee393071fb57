use super::*;
use crate::verbs::Context;

const SLOT: usize = 64;

fn pd() -> (ProtectionDomain, Context) {
    // SAFETY: nothing is posted on the loopback device here.
    let ctx = unsafe { Context::loopback() };
    (ctx.alloc_pd().expect("a PD"), ctx)
}

/// An own ring of 8 slots of 64 bytes, reposted 4 at a time.
fn own(pd: &ProtectionDomain) -> RecvRing {
    RecvRing::new(pd, SLOT, 8, 4, 0, None).expect("a ring")
}

fn message(ring: &RecvRing, slot: u32, len: u32, imm: Option<u32>) -> (usize, Option<u32>) {
    match ring.decode(slot, len, imm) {
        Ok(Arrival::Message { data, imm, .. }) => (data.1, imm),
        other => panic!("not a message: {other:?}"),
    }
}

#[test]
fn the_reactor_kinds_decode_and_every_other_send_is_refused() {
    let (pd, _ctx) = pd();
    let ring = own(&pd);
    let source = ring.source(2).expect("in the ring");
    // SAFETY: nothing is posted, and the trailer fits the slot.
    unsafe { source.write_trailer(10, 0xDEAD_BEEF) };
    assert_eq!(
        message(&ring, 1, 10, Some(send_imm::encode(send_imm::MESSAGE, 5))),
        (10, None)
    );
    let with_imm = send_imm::encode(send_imm::MESSAGE_WITH_IMM, 5);
    assert_eq!(
        message(&ring, 2, 14, Some(with_imm)),
        (10, Some(0xDEAD_BEEF))
    );
    assert!(matches!(
        ring.decode(0, 0, Some(send_imm::encode(send_imm::CREDIT, 9))),
        Ok(Arrival::Credit(9))
    ));
    let largest = (SLOT - IMM_TRAILER_LEN) as u32;
    assert_eq!(message(&ring, 0, largest, Some(0)).0, largest as usize);
    for (slot, len, imm) in [
        (0, 4, None),
        (8, 4, Some(0)),
        (0, 3, Some(with_imm)),
        (0, 4, Some(send_imm::encode(send_imm::CREDIT, 1))),
        (0, 4, Some(send_imm::encode(3, 1))),
        (0, largest + 1, Some(0)),
    ] {
        assert!(ring.decode(slot, len, imm).is_err(), "{slot} {len} {imm:?}");
    }
    assert!(
        ring.source(8).is_none() && ring.bytes(8, 4).is_empty(),
        "outside the ring"
    );
}

#[test]
fn an_own_slot_goes_back_once_and_never_from_a_closed_ring() {
    let (pd, _ctx) = pd();
    let mut ring = own(&pd);
    // A new ring's slots are consumed: none is posted yet.
    for slot in 0..3 {
        ring.queue(slot, false, 1);
    }
    assert!(ring.has_pending() && !ring.is_due(), "3 of a batch of 4");
    ring.queue(1, false, 1);
    assert_eq!(ring.pending_slots(), [0, 1, 2], "queued twice");
    ring.queue(3, true, 1);
    assert_eq!(ring.pending_slots(), [0, 1, 2], "a closed ring is dead");
    ring.queue(3, false, 1);
    assert!(ring.is_due());
    assert!(!ring.consume(0), "queued, not posted");
    ring.drop_own_pending();
    assert!(!ring.has_pending() && !ring.owes_shared_slots());
}

#[test]
fn shared_slots_go_back_even_from_a_closed_connection() {
    let (pd, _ctx) = pd();
    let srq = own(&pd);
    let shared = SharedRing {
        ring: srq.ring,
        slots: 8,
        registration: srq.registration().clone(),
    };
    let mut ring = RecvRing::new(&pd, SLOT, 4, 4, 0, Some(shared)).expect("a share");
    assert!(ring.uses_srq() && ring.registered_bytes() == 0);
    ring.queue(7, true, 1);
    ring.queue(8, false, 1);
    assert_eq!(
        ring.pending_slots(),
        [7],
        "closed or not; never outside the ring"
    );
    ring.drop_own_pending();
    assert!(ring.owes_shared_slots());
    let mut credits = Credits::new(4);
    let mut back = Vec::new();
    ring.take_shared(|slot| back.push(slot));
    assert_eq!(back, [7]);
    assert!(!ring.has_pending());
    assert_eq!(credits.outstanding(), 0, "not credited before the post");
    assert!(ring.is_due(), "due until credited");
    ring.credit_shared(false, &mut credits);
    assert_eq!(credits.outstanding(), 0, "the SRQ refused the post");
    assert!(ring.is_due(), "still due: the next flush asks again");
    ring.queue(6, false, 1);
    ring.take_shared(|slot| back.push(slot));
    ring.credit_shared(true, &mut credits);
    assert_eq!(back, [7, 6]);
    assert_eq!(credits.outstanding(), 2, "both credited once posted");
    assert!(!ring.is_due(), "the batch threshold again");
}
