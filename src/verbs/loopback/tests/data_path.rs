//! What the device moves: SENDs into receives (with immediates, after an
//! RNR wait), WRITE, READ and WRITE_WITH_IMM, unsignaled requests, and both
//! ends on two threads.

use super::*;
use crate::verbs::{SendBatch, SendFlags};

#[test]
fn a_send_lands_in_the_oldest_receive_with_its_immediate() {
    let (pd, mut cq, mut a, mut b) = pair(16, AccessFlags::empty());
    let mut mr = pd.alloc_mr(256, AccessFlags::LOCAL_WRITE).unwrap();
    mr.write(0, b"ping").unwrap();
    b.post_recv(&mut RecvRequest::new(10, mr.slice(64, 32).unwrap()).unwrap())
        .unwrap();
    b.post_recv(&mut RecvRequest::new(11, mr.slice(96, 32).unwrap()).unwrap())
        .unwrap();
    a.post_send(&mut WorkRequest::send_with_imm(1, mr.slice(0, 4).unwrap(), 0xfeed).signaled())
        .unwrap();
    a.post_send(&mut WorkRequest::send_inline(2, b"inline").signaled())
        .unwrap();
    let wcs = drain(&mut cq);
    assert_eq!(wcs.len(), 4, "{wcs:?}");
    let recv = wcs.iter().find(|wc| wc.wr_id() == 10).unwrap();
    assert!(recv.is_success());
    assert_eq!(recv.opcode(), WcOpcode::RECV);
    assert_eq!(
        (recv.byte_len(), recv.imm(), recv.qp_num()),
        (4, Some(0xfeed), b.qpn())
    );
    let second = wcs.iter().find(|wc| wc.wr_id() == 11).unwrap();
    assert_eq!((second.byte_len(), second.imm()), (6, None));
    let sent = wcs.iter().find(|wc| wc.wr_id() == 1).unwrap();
    assert_eq!((sent.opcode(), sent.qp_num()), (WcOpcode::SEND, a.qpn()));
    assert_eq!(bytes(&mr, 64, 4), b"ping");
    assert_eq!(bytes(&mr, 96, 6), b"inline");
}

#[test]
fn unsignaled_requests_complete_silently() {
    let (pd, mut cq, mut a, mut b) = pair(16, AccessFlags::empty());
    let mr = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    b.post_recv(&mut RecvRequest::new(7, mr.slice(0, 8).unwrap()).unwrap())
        .unwrap();
    a.post_send(&mut WorkRequest::send_inline(1, b"x")).unwrap();
    let wcs = drain(&mut cq);
    assert_eq!(wcs.len(), 1);
    assert_eq!(wcs[0].wr_id(), 7);
}

#[test]
fn a_send_without_a_receive_waits_for_one_and_keeps_its_place() {
    let access = AccessFlags::REMOTE_WRITE;
    let (pd, mut cq, mut a, mut b) = pair(16, access);
    let mut src = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    let dst = pd
        .alloc_mr(64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
        .unwrap();
    src.write(0, b"first").unwrap();
    {
        // Inline data is copied at post time: the buffer may go right away.
        let gone = *b"second";
        a.post_send(&mut WorkRequest::send_inline(2, &gone).signaled())
            .unwrap();
    }
    a.post_send(&mut WorkRequest::send(1, src.slice(0, 5).unwrap()).signaled())
        .unwrap();
    // A WRITE behind stalled SENDs waits too (the send queue is in order).
    let target = dst.remote().unwrap().slice(32, 5).unwrap();
    a.post_send(
        &mut WorkRequest::write(3, src.slice(0, 5).unwrap(), target)
            .unwrap()
            .signaled(),
    )
    .unwrap();
    assert!(
        drain(&mut cq).is_empty(),
        "nothing completes without a receive"
    );
    assert_eq!(bytes(&dst, 32, 5), [0; 5]);

    b.post_recv(&mut RecvRequest::new(20, dst.slice(0, 16).unwrap()).unwrap())
        .unwrap();
    let ids: Vec<u64> = drain(&mut cq).iter().map(WorkCompletion::wr_id).collect();
    assert_eq!(ids, [20, 2], "one receive runs one SEND");
    assert_eq!(bytes(&dst, 0, 6), b"second");

    b.post_recv(&mut RecvRequest::new(21, dst.slice(16, 16).unwrap()).unwrap())
        .unwrap();
    let ids: Vec<u64> = drain(&mut cq).iter().map(WorkCompletion::wr_id).collect();
    assert_eq!(ids, [21, 1, 3]);
    assert_eq!(bytes(&dst, 16, 5), b"first");
    assert_eq!(bytes(&dst, 32, 5), b"first");
}

#[test]
fn write_read_and_write_with_imm_move_the_bytes() {
    let access = AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
    let (pd, mut cq, mut a, mut b) = pair(16, access);
    let mut local = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    let mut exported = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE | access).unwrap();
    let remote = exported.remote().unwrap();
    local.write(0, b"written!").unwrap();
    exported.write(48, b"readable").unwrap();

    a.post_send(
        &mut WorkRequest::write(1, local.slice(0, 8).unwrap(), remote.slice(0, 8).unwrap())
            .unwrap()
            .signaled(),
    )
    .unwrap();
    a.post_send(
        &mut WorkRequest::read(2, local.slice(16, 8).unwrap(), remote.slice(48, 8).unwrap())
            .unwrap()
            .signaled(),
    )
    .unwrap();
    b.post_recv(&mut RecvRequest::new(30, local.slice(0, 0).unwrap()).unwrap())
        .unwrap();
    a.post_send(
        &mut WorkRequest::write_with_imm(
            3,
            local.slice(0, 4).unwrap(),
            remote.slice(20, 4).unwrap(),
            9,
        )
        .unwrap()
        .signaled(),
    )
    .unwrap();
    let wcs = drain(&mut cq);
    assert!(wcs.iter().all(WorkCompletion::is_success), "{wcs:?}");
    let opcodes: Vec<(u64, WcOpcode)> = wcs.iter().map(|wc| (wc.wr_id(), wc.opcode())).collect();
    assert_eq!(
        opcodes,
        [
            (1, WcOpcode::RDMA_WRITE),
            (2, WcOpcode::RDMA_READ),
            (30, WcOpcode::RECV_RDMA_WITH_IMM),
            (3, WcOpcode::RDMA_WRITE),
        ]
    );
    assert_eq!(
        (wcs[1].byte_len(), wcs[2].byte_len(), wcs[2].imm()),
        (8, 4, Some(9))
    );
    assert_eq!(bytes(&exported, 0, 8), b"written!");
    assert_eq!(bytes(&exported, 20, 4), b"writ");
    assert_eq!(bytes(&local, 16, 8), b"readable");
}

#[test]
fn both_ends_on_two_threads_deliver_everything() {
    // One QP pair, each end served by its own thread: the poster writes the
    // peer's receive queue and CQ while the peer posts and polls, and
    // sends that find no receive are run by the receiver's next post.
    const MESSAGES: u64 = 20_000;
    const WINDOW: u64 = 128;
    const DEADLINE: std::time::Duration = std::time::Duration::from_secs(60);
    let started = std::time::Instant::now();
    // SAFETY: the receiver reads a slot only after polling the completion
    // that ends the SEND into it, and reposts it only after reading; the
    // sender's data is inline (copied from its stack inside the post).
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().unwrap();
    let mut cqa = ctx.create_cq(1024, None).unwrap();
    let mut cqb = ctx.create_cq(1024, None).unwrap();
    let mut a = pd.create_qp(&cqa, &cqa, &QpConfig::default()).unwrap();
    let mut b = pd.create_qp(&cqb, &cqb, &QpConfig::default()).unwrap();
    link(&mut a, &mut b);
    let ring = pd.alloc_mr(64 * 8, AccessFlags::LOCAL_WRITE).unwrap();
    let receiver = std::thread::spawn(move || {
        let post = |b: &mut QueuePair, slot: u64| {
            let slice = ring.slice(slot as usize * 8, 8).unwrap();
            b.post_recv(&mut RecvRequest::new(slot, slice).unwrap())
                .unwrap();
        };
        for slot in 0..64 {
            post(&mut b, slot);
        }
        let mut wcs = [WorkCompletion::default(); 16];
        let mut next = 0u64;
        while next < MESSAGES {
            // A lost wakeup would hang here: fail instead.
            assert!(
                started.elapsed() < DEADLINE,
                "received {next} of {MESSAGES}"
            );
            let slots: Vec<u64> = cqb
                .poll(&mut wcs)
                .unwrap()
                .iter()
                .inspect(|wc| assert!(wc.is_success(), "{wc:?}"))
                .map(WorkCompletion::wr_id)
                .collect();
            for slot in slots {
                let mut value = [0u8; 8];
                ring.read(slot as usize * 8, &mut value).unwrap();
                assert_eq!(u64::from_le_bytes(value), next, "in order");
                next += 1;
                post(&mut b, slot);
            }
        }
        b
    });
    let mut wcs = [WorkCompletion::default(); 16];
    let mut completed = 0;
    for seq in 0..MESSAGES {
        while seq - completed >= WINDOW {
            assert!(
                started.elapsed() < DEADLINE,
                "sent {seq}, {completed} completed"
            );
            let done = cqa.poll(&mut wcs).unwrap();
            assert!(done.iter().all(WorkCompletion::is_success));
            completed += done.len() as u64;
        }
        let value = seq.to_le_bytes();
        a.post_send(&mut WorkRequest::send_inline(seq, &value).signaled())
            .unwrap();
    }
    let _b = receiver.join().unwrap();
}

/// Requests and batches built once and posted again (`post_send` and
/// `post_recv` leave them with the caller): each post sends what the
/// buffer holds then, under the id and flags set in place, and such a
/// request borrows only the registration, so the region is written between
/// posts. A batch refused in part is left whole, with the count taken.
#[test]
fn kept_requests_post_again_with_what_the_buffer_holds_then() {
    let access = AccessFlags::REMOTE_WRITE;
    let (pd, mut cq, mut a, mut b) = pair(16, access);
    let mut mr = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    let exported = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE | access).unwrap();
    let remote = exported.remote().unwrap();
    let registration = mr.registration().clone();

    let mut landing = RecvRequest::new(40, registration.slice(32, 8).unwrap()).unwrap();
    let mut send = WorkRequest::send(0, registration.slice(0, 8).unwrap());
    for (i, text) in [b"first!!!", b"second!!"].iter().enumerate() {
        b.post_recv(&mut landing).unwrap();
        mr.write(0, &text[..]).unwrap();
        send.set_wr_id(i as u64 + 1);
        send.set_flags(SendFlags::SIGNALED);
        a.post_send(&mut send).unwrap();
        let wcs = drain(&mut cq);
        let ids: Vec<u64> = wcs.iter().map(WorkCompletion::wr_id).collect();
        assert_eq!(ids, [40, i as u64 + 1], "{wcs:?}");
        assert_eq!(bytes(&mr, 32, 8), &text[..]);
    }
    // Unsignaled now: it completes silently.
    send.set_flags(SendFlags::empty());
    b.post_recv(&mut landing).unwrap();
    a.post_send(&mut send).unwrap();
    let ids: Vec<u64> = drain(&mut cq).iter().map(WorkCompletion::wr_id).collect();
    assert_eq!(ids, [40]);

    // A batch of three WRITEs, posted twice: six writes, each of the bytes
    // written before its post.
    let mut batch: SendBatch<'_, 4> = SendBatch::new();
    for k in 0..3u64 {
        let local = registration.slice(8 * k as usize, 8).unwrap();
        let target = remote.slice(8 * k, 8).unwrap();
        let write = WorkRequest::write(100 + k, local, target).unwrap();
        batch.push(write.signaled()).unwrap();
    }
    for round in 0..2u8 {
        mr.write(0, &[round + 1; 24]).unwrap();
        a.post_send(&mut batch).unwrap();
        let ids: Vec<u64> = drain(&mut cq).iter().map(WorkCompletion::wr_id).collect();
        assert_eq!(ids, [100, 101, 102]);
        assert_eq!(bytes(&exported, 0, 24), vec![round + 1; 24]);
        assert_eq!(batch.len(), 3, "kept for the next post");
    }
    // Changed in place: the second request now carries id 7.
    batch.get_mut(1).unwrap().set_wr_id(7);
    a.post_send(&mut batch).unwrap();
    let ids: Vec<u64> = drain(&mut cq).iter().map(WorkCompletion::wr_id).collect();
    assert_eq!(ids, [100, 7, 102]);

    // The provider takes one of the three: the error says so and the batch
    // stays whole.
    crate::verbs::refuse_sends_after(a.qpn(), 1);
    match a.post_send(&mut batch) {
        Err(Error::Post { posted, .. }) => assert_eq!(posted, 1),
        other => panic!("a partial post: {other:?}"),
    }
    assert_eq!(batch.len(), 3);
    let ids: Vec<u64> = drain(&mut cq).iter().map(WorkCompletion::wr_id).collect();
    assert_eq!(ids, [100]);

    // Refused likewise, `drop_posted` drops what went in and keeps the
    // rest to retry; after a full post it empties the batch.
    crate::verbs::refuse_sends_after(a.qpn(), 1);
    let outcome = a.post_send(&mut batch);
    match &outcome {
        Err(Error::Post { posted, .. }) => assert_eq!(*posted, 1),
        other => panic!("a partial post: {other:?}"),
    }
    batch.drop_posted(&outcome);
    let left: Vec<u64> = (0..batch.len())
        .map(|i| batch.get_mut(i).unwrap().wr_id())
        .collect();
    assert_eq!(left, [7, 102], "the first went in");
    let outcome = a.post_send(&mut batch);
    assert!(outcome.is_ok());
    batch.drop_posted(&outcome);
    assert!(batch.is_empty());
    let ids: Vec<u64> = drain(&mut cq).iter().map(WorkCompletion::wr_id).collect();
    assert_eq!(ids, [100, 7, 102]);
}
