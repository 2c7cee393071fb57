//! The send queue on its own, over the loopback device: signaling,
//! retiring, the send slots and the registrations requests keep. Nothing
//! is posted: staging and retiring touch only the queue's own arrays.

use super::*;
use crate::reactor::conn::ring::RecvRing;
use crate::verbs::{AccessFlags, CompletionQueue, Context, MemoryRegion, QpConfig};

const TAG: u64 = 0x1234_5678 << 32;

struct Fixture {
    // The QP first, as in a connection: destroyed before the queue's
    // registrations.
    _qp: QueuePair,
    sq: SendQueue,
    _cq: CompletionQueue,
    pd: ProtectionDomain,
    _ctx: Context,
}

/// A queue of 16 entries, signaled every 4 requests, with 8 slots of 64
/// bytes.
fn fixture() -> Fixture {
    // SAFETY: nothing is posted on the loopback device here.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().expect("a PD");
    let cq = ctx.create_cq(64, None).expect("a CQ");
    let qp = pd.create_qp(&cq, &cq, &QpConfig::default()).expect("a QP");
    let config = ReactorConfig {
        sq_depth: 16,
        signal_interval: 4,
        send_slots: 8,
        ..ReactorConfig::default()
    };
    let sq = SendQueue::new(&pd, &qp, &config, 64, TAG).expect("a send queue");
    Fixture {
        _qp: qp,
        sq,
        _cq: cq,
        pd,
        _ctx: ctx,
    }
}

fn credit_update() -> SendDescriptor {
    SendDescriptor::send(Sge::default(), Some(0))
}

fn granted(count: u32) -> Credits {
    let mut credits = Credits::new(16);
    credits.apply_peer_count(count);
    credits
}

/// `stage_send` with its contract checked first.
fn send(
    sq: &mut SendQueue,
    capacity: usize,
    imm: Option<u32>,
    fill: impl FnOnce(&mut [u8]) -> Option<usize>,
    credits: &mut Credits,
) -> Result<u32, SendError> {
    assert!(sq.has_room() && sq.has_free_slot() && capacity + IMM_TRAILER_LEN <= 64);
    // SAFETY: checked just above.
    unsafe { sq.stage_send(capacity, imm, fill, credits) }
}

fn signaled(sq: &SendQueue) -> Vec<bool> {
    (0..sq.staged())
        .map(|at| {
            sq.batch
                .staged_at(at)
                .expect("staged")
                .0
                .contains(SendFlags::SIGNALED)
        })
        .collect()
}

#[test]
fn every_nth_request_is_signaled_and_more_when_room_runs_low() {
    let mut f = fixture();
    assert_eq!(f.sq.depth, 16);
    for seq in 0..15 {
        assert_eq!(
            f.sq.stage(credit_update(), SqOp::of(OpKind::Credit), None, false),
            seq
        );
    }
    let expected: Vec<bool> = (0..15).map(|at| at == 3 || at == 7 || at >= 11).collect();
    assert_eq!(
        signaled(&f.sq),
        expected,
        "every 4th, then each once 4 entries are left"
    );
    assert_eq!(
        f.sq.batch.staged_at(5).expect("staged").1,
        TAG | 5,
        "the wr_id is tag | seq"
    );
    assert!(!f.sq.signaling().has_unsignaled_tail());
    assert!(
        !f.sq.has_room(),
        "one entry beyond the last is kept for a credit update"
    );
}

#[test]
fn a_lone_signal_on_the_last_request_resets_the_count() {
    let mut f = fixture();
    f.sq.stage(credit_update(), SqOp::of(OpKind::Credit), None, false);
    assert!(f.sq.signaling().has_unsignaled_tail());
    f.sq.signal_last_staged();
    assert!(!f.sq.signaling().has_unsignaled_tail());
    assert_eq!(signaled(&f.sq), [true]);
}

#[test]
fn a_signaled_completion_retires_it_and_everything_before() {
    let mut f = fixture();
    for _ in 0..5 {
        f.sq.stage(credit_update(), SqOp::of(OpKind::Credit), None, false);
    }
    assert_eq!(f.sq.retire_count(2), 3);
    assert_eq!(f.sq.retire_count(4), 5);
    assert_eq!(f.sq.retire_count(5), 0, "not in flight");
    assert_eq!(f.sq.retire_count(u32::MAX), 0, "long done");
    for seq in 0..3 {
        assert_eq!(f.sq.pop_oldest().0, seq);
    }
    assert_eq!(f.sq.used(), 2);
    assert_eq!(f.sq.retire_count(2), 0, "retired already");
}

#[test]
fn a_run_of_one_kind_is_reported_at_once_and_frees_its_slots() {
    let mut f = fixture();
    let mut credits = granted(10);
    for byte in 1..=3u8 {
        let fill = |buf: &mut [u8]| {
            buf[0] = byte;
            Some(1)
        };
        send(&mut f.sq, 8, Some(7), fill, &mut credits).expect("a slot");
    }
    assert_eq!(credits.available(), 7, "each SEND spent a credit");
    f.sq.stage_credit_update(&mut credits, false);
    assert_eq!(f.sq.slots_used(), 3);
    let (_, first, run) = f.sq.retire_run(4);
    assert_eq!(
        (first.kind(), run),
        (OpKind::Send, 3),
        "the credit update is not in the run"
    );
    assert_eq!(f.sq.slots_used(), 0);
    assert_eq!(f.sq.retire_run(4).1.kind(), OpKind::Credit);
    assert_eq!(f.sq.used(), 0);
}

#[test]
fn a_cancelled_send_takes_no_slot_and_no_credit() {
    let mut f = fixture();
    let mut credits = granted(10);
    let refused = send(&mut f.sq, 8, None, |_| None, &mut credits);
    assert!(matches!(refused, Err(SendError::Cancelled)));
    assert_eq!(
        (f.sq.slots_used(), f.sq.used(), credits.available()),
        (0, 0, 10)
    );
}

#[test]
fn the_payload_and_the_immediate_trailer_go_on_the_wire() {
    let mut f = fixture();
    let mut credits = granted(10);
    let fill = |buf: &mut [u8]| {
        buf[..3].copy_from_slice(b"abc");
        Some(3)
    };
    send(&mut f.sq, 8, Some(0xAABB_CCDD), fill, &mut credits).expect("a slot");
    let (_, _, wire_len) = f.sq.batch.staged_at(0).expect("staged");
    assert_eq!(wire_len, 7, "3 bytes of payload and the 4 of the immediate");
    assert_eq!(f.sq.send_slots.used(), 1);
    // The slot's bytes: the payload, then the immediate (little-endian).
    let wire = f.sq.send_slots.written(0, 7);
    assert_eq!(wire, b"abc\xDD\xCC\xBB\xAA");
}

#[test]
fn a_credit_update_that_spends_the_last_credit_is_signaled() {
    let mut f = fixture();
    let mut credits = granted(2);
    for _ in 0..3 {
        f.sq.stage_credit_update(&mut credits, false);
    }
    assert_eq!(
        signaled(&f.sq),
        [false, true],
        "the second spent the last; no third"
    );
    assert_eq!(credits.available(), 0);
    f.sq.stage_first_credit_update(&mut credits);
    assert_eq!(
        f.sq.staged(),
        3,
        "the first update goes even without a credit"
    );
}

#[test]
fn unwinding_gives_back_everything_the_device_never_saw() {
    let mut f = fixture();
    let mut credits = granted(10);
    for _ in 0..2 {
        send(&mut f.sq, 8, None, |_| Some(0), &mut credits).expect("a slot");
    }
    let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
    let region = f.pd.alloc_mr(64, access).expect("an MR");
    let remote = region
        .remote()
        .expect("remote")
        .slice(0, 8)
        .expect("in bounds");
    f.sq.stage_write(&region.slice(0, 8).expect("in bounds"), remote, None, false);
    let origin_ring = RecvRing::new(&f.pd, 64, 4, 1, 0, None).expect("a ring");
    let origin = ForwardOrigin {
        conn: crate::reactor::config::slab_key_for_tests(2),
        slot: 3,
        from_srq: false,
    };
    let source = origin_ring.source(3).expect("in the ring");
    let registration = Some(origin_ring.registration().clone());
    assert!(f.sq.has_room() && 8 + IMM_TRAILER_LEN <= source.size());
    // SAFETY: checked just above; the ring's slot 3 is nobody's (nothing is
    // posted).
    unsafe {
        f.sq.stage_forward(source, 8, Some(1), origin, registration, &mut credits)
    };
    let mut released = Vec::new();
    let on = crate::reactor::config::slab_key_for_tests(1);
    f.sq.unwind(on, |conn, slot, from_srq| {
        released.push((conn, slot, from_srq))
    });
    assert_eq!((f.sq.used(), f.sq.slots_used(), f.sq.staged()), (0, 0, 0));
    assert_eq!(f.sq.cache.in_flight(), 0);
    assert!(
        f.sq.owned.iter().all(Option::is_none),
        "what they held is dropped"
    );
    assert_eq!(
        released,
        [(origin.conn, 3, false)],
        "the forward's slot goes back"
    );
    assert!(f.sq.can_ring_alone());
}

#[test]
fn one_registration_is_kept_by_count_and_others_by_handle() {
    let mut f = fixture();
    let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
    let (a, b): (MemoryRegion, MemoryRegion) = (
        f.pd.alloc_mr(64, access).expect("an MR"),
        f.pd.alloc_mr(64, access).expect("an MR"),
    );
    let write = |sq: &mut SendQueue, region: &MemoryRegion| {
        let remote = region
            .remote()
            .expect("remote")
            .slice(0, 8)
            .expect("in bounds");
        sq.stage_write(&region.slice(0, 8).expect("in bounds"), remote, None, false)
    };
    write(&mut f.sq, &a);
    write(&mut f.sq, &a);
    assert!(f.sq.keeps(a.registration().id()));
    assert_eq!(f.sq.cache.in_flight(), 2, "no handle cloned for the second");
    let at = write(&mut f.sq, &b) as usize;
    assert!(
        f.sq.owned[at].is_some(),
        "b is held by a handle while a is in flight"
    );
    for _ in 0..3 {
        f.sq.pop_oldest();
    }
    assert!(
        f.sq.owned.iter().all(Option::is_none),
        "retiring drops the handle"
    );
    assert_eq!(f.sq.cache.in_flight(), 0);
    write(&mut f.sq, &b);
    assert!(
        f.sq.keeps(b.registration().id()),
        "b is kept once nothing uses a"
    );
}
