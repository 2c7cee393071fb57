//! The reactor over the in-process software device ([`Context::loopback`]):
//! these tests need no RDMA device and run in every plain `cargo test`.
//!
//! Sessions are pairs of loopback QPs created on the reactor's CQs and
//! handed to it directly (a `Vec<QueuePair>` source), both ends in one
//! reactor. Waits are bounded by pass counts, never by sleeping.

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use rdma_comm_core::Error;
use rdma_comm_core::reactor::*;
use rdma_comm_core::verbs::*;

/// Passes a test waits for something before failing.
const MAX_PASSES: usize = 200_000;

/// Everything a session's handler saw.
#[derive(Debug, Default)]
struct Seen {
    established: Vec<ConnId>,
    messages: Vec<(Vec<u8>, Option<u32>)>,
    write_imms: Vec<(u32, u32)>,
    sends_done: Vec<u32>,
    writes_done: Vec<u32>,
    reads_done: Vec<u32>,
    errors: Vec<Option<WcStatus>>,
    /// Every error's text (its variant and fields).
    error_texts: Vec<String>,
}

/// A handler that records into a `Seen` the test keeps a handle to, and
/// passes every message it gets on as its `relay` says.
#[derive(Debug, Clone, Default)]
struct Recorder {
    seen: Rc<RefCell<Seen>>,
    relay: Rc<Cell<Relay>>,
    held: Rc<RefCell<Vec<HeldRecv>>>,
}

/// What a `Recorder` does with a message besides recording it.
#[derive(Debug, Clone, Copy, Default)]
enum Relay {
    #[default]
    Nothing,
    /// Forwards it at once to this connection, with this immediate.
    Forward(ConnId, Option<u32>),
    /// Holds it (into `Recorder::held`).
    Hold,
}

impl Handler for Recorder {
    fn on_established(&mut self, _: &mut Ctx<'_>, conn: ConnId) {
        self.seen.borrow_mut().established.push(conn);
    }
    fn on_message(&mut self, ctx: &mut Ctx<'_>, _: ConnId, data: &[u8], imm: Option<u32>) {
        self.seen.borrow_mut().messages.push((data.to_vec(), imm));
        match self.relay.get() {
            Relay::Nothing => {}
            Relay::Forward(to, imm) => {
                let held = ctx.hold().expect("in on_message");
                assert_eq!(held.len(), data.len());
                if let Err((err, held)) = ctx.forward(to, held, imm) {
                    panic!("forwarding {} bytes: {err}", held.len());
                }
            }
            Relay::Hold => {
                let held = ctx.hold().expect("in on_message");
                assert_eq!(ctx.held_bytes(&held), Some(data));
                self.held.borrow_mut().push(held);
            }
        }
    }
    fn on_write_imm(&mut self, _: &mut Ctx<'_>, _: ConnId, imm: u32, len: u32) {
        self.seen.borrow_mut().write_imms.push((imm, len));
    }
    fn on_send_complete(&mut self, _: &mut Ctx<'_>, _: ConnId, seq: u32) {
        self.seen.borrow_mut().sends_done.push(seq);
    }
    fn on_write_complete(&mut self, _: &mut Ctx<'_>, _: ConnId, seq: u32) {
        self.seen.borrow_mut().writes_done.push(seq);
    }
    fn on_read_complete(&mut self, _: &mut Ctx<'_>, _: ConnId, seq: u32) {
        self.seen.borrow_mut().reads_done.push(seq);
    }
    fn on_error(&mut self, _: &mut Ctx<'_>, _: ConnId, error: &Error) {
        let mut seen = self.seen.borrow_mut();
        seen.errors.push(error.completion_status());
        seen.error_texts.push(format!("{error:?}"));
    }
}

const ACCESS: AccessFlags = AccessFlags::REMOTE_WRITE.union(AccessFlags::REMOTE_READ);

/// One session of a pair: its id, its connection, what its handler saw,
/// what it does with messages and what it holds.
struct End {
    session: SessionId,
    conn: ConnId,
    seen: Rc<RefCell<Seen>>,
    relay: Rc<Cell<Relay>>,
    held: Rc<RefCell<Vec<HeldRecv>>>,
}

fn new_reactor(pd: &ProtectionDomain) -> Reactor<Recorder, ()> {
    reactor_reposting_by(pd, ReactorConfig::default().repost_batch)
}

/// A reactor of small rings that reposts receives `repost_batch` at a time.
fn reactor_reposting_by(pd: &ProtectionDomain, repost_batch: u32) -> Reactor<Recorder, ()> {
    let config = ReactorConfig {
        repost_batch,
        ..small_rings()
    };
    Reactor::new(pd, config).expect("a reactor on the loopback device")
}

/// The tests' reactor configuration: small rings, the rest the default.
fn small_rings() -> ReactorConfig {
    ReactorConfig {
        slot_size: 256,
        recv_depth: 16,
        send_slots: 16,
        sq_depth: 64,
        ..ReactorConfig::default()
    }
}

/// Adds two sessions of one connection each, connected to each other, and
/// runs passes until both are established.
fn add_pair(reactor: &mut Reactor<Recorder, ()>, pd: &ProtectionDomain) -> (End, End) {
    let (a, b) = reactor
        .connected_pair(pd, ACCESS)
        .expect("two connected QPs");
    let mut add = |qp: QueuePair| {
        let recorder = Recorder::default();
        let (seen, relay, held) = (
            Rc::clone(&recorder.seen),
            Rc::clone(&recorder.relay),
            Rc::clone(&recorder.held),
        );
        let session = reactor.add(vec![qp], recorder).expect("add");
        let conn = reactor.conns(session).next().expect("one connection");
        End {
            session,
            conn,
            seen,
            relay,
            held,
        }
    };
    let (a, b) = (add(a), add(b));
    run_until(reactor, "both ends established", || {
        !a.seen.borrow().established.is_empty() && !b.seen.borrow().established.is_empty()
    });
    (a, b)
}

#[track_caller]
fn run_until<H: Handler>(reactor: &mut Reactor<H, ()>, what: &str, mut done: impl FnMut() -> bool) {
    for _ in 0..MAX_PASSES {
        if done() {
            return;
        }
        reactor.turn().expect("a reactor pass");
    }
    panic!("not within {MAX_PASSES} passes: {what}");
}

/// Stages a SEND of `data` on `conn`, running passes while the window is
/// spent: credits come back with the receiver's updates.
#[track_caller]
fn send_when_credited(
    reactor: &mut Reactor<Recorder, ()>,
    conn: ConnId,
    data: &[u8],
    imm: Option<u32>,
) {
    let mut passes = 0;
    while let Err(err) = reactor.with_ctx(|ctx| ctx.send(conn, data, imm)) {
        assert!(matches!(err, SendError::WouldBlock), "{err}");
        assert!(passes < MAX_PASSES, "no credit within {MAX_PASSES} passes");
        passes += 1;
        reactor.turn().unwrap();
    }
}

fn bytes(mr: &MemoryRegion, offset: usize, len: usize) -> Vec<u8> {
    let mut out = vec![0; len];
    mr.read(offset, &mut out).expect("read from region");
    out
}

#[test]
fn send_write_write_imm_and_read_deliver_the_right_bytes() {
    // SAFETY: one thread serves every QP of this device and reads every byte.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().unwrap();
    let mut reactor = new_reactor(&pd);
    let (client, server) = add_pair(&mut reactor, &pd);
    let mut local = pd.alloc_mr(256, AccessFlags::LOCAL_WRITE).unwrap();
    let mut exported = pd.alloc_mr(256, AccessFlags::LOCAL_WRITE | ACCESS).unwrap();
    let remote = exported.remote().unwrap();
    local.write(0, b"written by WRITE").unwrap();
    local.write(32, b"with an immediate").unwrap();
    exported.write(128, b"fetched by READ").unwrap();

    reactor.with_ctx(|ctx| {
        ctx.send(client.conn, b"hello, server", Some(7)).unwrap();
        ctx.send(server.conn, b"hello, client", None).unwrap();
    });
    run_until(&mut reactor, "both SENDs", || {
        !client.seen.borrow().messages.is_empty() && !server.seen.borrow().messages.is_empty()
    });
    assert_eq!(
        server.seen.borrow().messages,
        [(b"hello, server".to_vec(), Some(7))]
    );
    assert_eq!(
        client.seen.borrow().messages,
        [(b"hello, client".to_vec(), None)]
    );

    reactor.with_ctx(|ctx| {
        let write = local.slice(0, 16).unwrap();
        ctx.write(client.conn, &write, remote.slice(0, 16).unwrap(), None)
            .unwrap();
        let write_imm = local.slice(32, 17).unwrap();
        ctx.write(
            client.conn,
            &write_imm,
            remote.slice(64, 17).unwrap(),
            Some(0xbeef),
        )
        .unwrap();
        let read = local.slice(128, 15).unwrap();
        ctx.read(client.conn, &read, remote.slice(128, 15).unwrap())
            .unwrap();
    });
    run_until(
        &mut reactor,
        "the WRITEs, the WRITE_WITH_IMM and the READ",
        || {
            let seen = client.seen.borrow();
            seen.writes_done.len() == 2
                && seen.reads_done.len() == 1
                && server.seen.borrow().write_imms.len() == 1
        },
    );
    assert_eq!(server.seen.borrow().write_imms, [(0xbeef, 17)]);
    assert_eq!(bytes(&exported, 0, 16), b"written by WRITE");
    assert_eq!(bytes(&exported, 64, 17), b"with an immediate");
    assert_eq!(bytes(&local, 128, 15), b"fetched by READ");
    for end in [&client, &server] {
        assert!(
            end.seen.borrow().errors.is_empty(),
            "{:?}",
            end.seen.borrow()
        );
    }
}

#[test]
fn many_messages_each_way_arrive_in_order() {
    // SAFETY: one thread serves every QP of this device and reads every byte.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().unwrap();
    let mut reactor = new_reactor(&pd);
    let (a, b) = add_pair(&mut reactor, &pd);
    // Far more than the receive depth: credits pace the senders.
    const COUNT: u32 = 2_000;
    let ends = [&a, &b];
    let mut next = [0u32; 2];
    let arrived = || {
        ends.iter()
            .all(|end| end.seen.borrow().messages.len() == COUNT as usize)
    };
    let mut passes = 0;
    while !arrived() {
        assert!(
            passes < MAX_PASSES,
            "not every message within {MAX_PASSES} passes"
        );
        passes += 1;
        reactor.with_ctx(|ctx| {
            for (end, next) in ends.iter().zip(&mut next) {
                while *next < COUNT {
                    match ctx.send(end.conn, &next.to_le_bytes(), Some(*next)) {
                        Ok(_) => *next += 1,
                        Err(SendError::WouldBlock) => break,
                        Err(err) => panic!("staging a SEND: {err}"),
                    }
                }
            }
        });
        reactor.turn().unwrap();
    }
    for end in ends {
        let seen = end.seen.borrow();
        for (i, (data, imm)) in seen.messages.iter().enumerate() {
            let i = i as u32;
            assert_eq!((data.as_slice(), *imm), (&i.to_le_bytes()[..], Some(i)));
        }
        assert!(seen.errors.is_empty());
    }
}

#[test]
fn forwards_carry_any_payload_with_or_without_an_immediate() {
    // SAFETY: one thread serves every QP of this device and reads every byte.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().unwrap();
    let mut reactor = new_reactor(&pd);
    // source -> relay_in, whose handler forwards to relay_out -> sink.
    let (source, relay_in) = add_pair(&mut reactor, &pd);
    let (relay_out, sink) = add_pair(&mut reactor, &pd);
    let max = reactor.with_ctx(|ctx| ctx.max_payload(source.conn));
    assert_eq!(max, 256 - SLOT_RESERVE);
    // Every combination of immediates in and out, at the sizes where a
    // trailer could run out of its slot; more messages than receives, so
    // the relay's slots come back from its forwards and are reused.
    let (mut expected, mut relayed) = (Vec::new(), Vec::new());
    let mut sent = 0;
    for imm_in in [None, Some(0xdead_beef_u32)] {
        for imm_out in [None, Some(u32::MAX), Some(0)] {
            relay_in.relay.set(Relay::Forward(relay_out.conn, imm_out));
            for len in [0, 1, 3, 4, max - 1, max] {
                for round in 0..4u8 {
                    let data: Vec<u8> = (0..len).map(|i| (i as u8) ^ round ^ 0x5a).collect();
                    send_when_credited(&mut reactor, source.conn, &data, imm_in);
                    sent += 1;
                    relayed.push((data.clone(), imm_in));
                    expected.push((data, imm_out));
                    run_until(&mut reactor, "the forwarded message", || {
                        sink.seen.borrow().messages.len() == sent
                    });
                }
            }
        }
    }
    assert_eq!(sink.seen.borrow().messages, expected);
    assert_eq!(relay_in.seen.borrow().messages, relayed);
    // A message one byte too long is refused before anything is staged.
    assert!(matches!(
        reactor.with_ctx(|ctx| ctx.send(source.conn, &vec![0; max + 1], None)),
        Err(SendError::TooLarge { len, max: m }) if len == max + 1 && m == max
    ));
    for end in [&source, &relay_in, &relay_out, &sink] {
        assert!(end.seen.borrow().errors.is_empty());
    }
}

#[test]
fn a_peer_whose_sends_break_the_protocol_is_cut_off() {
    // SAFETY: one thread serves every QP of this device and reads every byte.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().unwrap();
    let mut reactor = new_reactor(&pd);
    let max = 256 - SLOT_RESERVE;
    let payload = pd.alloc_mr(256, AccessFlags::LOCAL_WRITE).unwrap();
    let inbox = pd.alloc_mr(16 * 256, AccessFlags::LOCAL_WRITE).unwrap();
    // (immediate, length) of SENDs the reactor never sends.
    let kind = |kind: u32| kind << 30 | 16;
    let cases: [(Option<u32>, usize, &str); 5] = [
        (None, 8, "without the reactor's immediate"),
        (Some(kind(3)), 8, "unknown kind"),
        (Some(kind(1)), 8, "credit update with a payload"),
        (Some(kind(2)), 3, "too short for its immediate"),
        (Some(kind(0)), max + 1, "longer than the largest payload"),
    ];
    let mut raw_peers = Vec::new();
    // An honest pair on the same reactor, checked after every cut-off.
    let (a, b) = add_pair(&mut reactor, &pd);
    for (round, (imm, len, what)) in cases.into_iter().enumerate() {
        let (qp, mut raw) = reactor.connected_pair(&pd, ACCESS).unwrap();
        // The raw peer takes the reactor's credit update like any peer.
        for i in 0..16 {
            let slot = inbox.slice(i * 256, 256).unwrap();
            raw.post_recv(&mut RecvRequest::new(1 << 40 | i as u64, slot).unwrap())
                .unwrap();
        }
        let recorder = Recorder::default();
        let seen = Rc::clone(&recorder.seen);
        let session = reactor.add(vec![qp], recorder).unwrap();
        let conn = reactor.conns(session).next().unwrap();
        let local = payload.slice(0, len).unwrap();
        let mut wr = match imm {
            Some(imm) => WorkRequest::send_with_imm(7, local, imm),
            None => WorkRequest::send(7, local),
        };
        raw.post_send(&mut wr).unwrap();
        run_until(&mut reactor, what, || !seen.borrow().errors.is_empty());
        let text = seen.borrow().error_texts.join("; ");
        assert!(
            text.starts_with("MalformedMessage") && text.contains(what),
            "{what}: {text}"
        );
        assert!(seen.borrow().messages.is_empty(), "{what}: delivered");
        assert!(matches!(
            reactor.with_ctx(|ctx| ctx.send(conn, b"x", None)),
            Err(SendError::Closed)
        ));
        raw_peers.push(raw);
        let tag = Some(round as u32);
        reactor.with_ctx(|ctx| ctx.send(a.conn, b"still here", tag).unwrap());
        run_until(&mut reactor, "the honest message", || {
            b.seen.borrow().messages.len() == round + 1
        });
        assert_eq!(
            b.seen.borrow().messages[round],
            (b"still here".to_vec(), tag)
        );
    }
    assert!(a.seen.borrow().errors.is_empty() && b.seen.borrow().errors.is_empty());
}

#[test]
fn a_short_fill_puts_the_immediate_right_after_what_it_wrote() {
    // SAFETY: one thread serves every QP of this device and reads every byte.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().unwrap();
    let mut reactor = new_reactor(&pd);
    let (a, b) = add_pair(&mut reactor, &pd);
    let capacity = reactor.with_ctx(|ctx| ctx.max_payload(a.conn));
    let mut expected = Vec::new();
    for (i, wrote) in [0, 1, capacity / 2, capacity - 1, capacity]
        .into_iter()
        .enumerate()
    {
        let imm = 0x0101_0101 * (i as u32 + 1);
        reactor.with_ctx(|ctx| {
            // The slot is filled with 0xee past what the fill says it
            // wrote: none of that may arrive.
            ctx.send_from(a.conn, capacity, Some(imm), |slot| {
                slot.fill(0xee);
                slot[..wrote].fill(i as u8);
                Some(wrote)
            })
            .unwrap()
        });
        expected.push((vec![i as u8; wrote], Some(imm)));
        run_until(&mut reactor, "the message", || {
            b.seen.borrow().messages.len() == i + 1
        });
    }
    assert_eq!(b.seen.borrow().messages, expected);
}

#[test]
fn held_messages_forwarded_together_in_a_later_pass_arrive_in_order() {
    // SAFETY: one thread serves every QP of this device and reads every byte.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().unwrap();
    let mut reactor = new_reactor(&pd);
    let (source, relay_in) = add_pair(&mut reactor, &pd);
    let (relay_out, sink) = add_pair(&mut reactor, &pd);
    relay_in.relay.set(Relay::Hold);
    let max = reactor.with_ctx(|ctx| ctx.max_payload(source.conn));
    // Three rounds, so the slots the forwards give back are used again.
    const HELD: usize = 8;
    let mut expected = Vec::new();
    for round in 0..3u8 {
        let mut messages = Vec::new();
        for i in 0..HELD {
            let len = [0, 1, max - 1, max][i % 4];
            let data = vec![round * 16 + i as u8; len];
            let imm = (i % 2 == 0).then_some(u32::from(round) << 8 | i as u32);
            send_when_credited(&mut reactor, source.conn, &data, imm);
            messages.push(data);
        }
        run_until(&mut reactor, "every message held", || {
            relay_in.held.borrow().len() == HELD
        });
        // Some passes later, all at once: several forwards in flight, each
        // with a new immediate or none, some where a trailer came in.
        for _ in 0..10 {
            reactor.turn().unwrap();
        }
        let held: Vec<HeldRecv> = relay_in.held.borrow_mut().drain(..).collect();
        reactor.with_ctx(|ctx| {
            for (i, held) in held.into_iter().enumerate() {
                let imm = (i % 3 != 0).then_some(!(i as u32));
                if let Err((err, _)) = ctx.forward(relay_out.conn, held, imm) {
                    panic!("forward {i}: {err}");
                }
            }
        });
        for (i, data) in messages.into_iter().enumerate() {
            expected.push((data, (i % 3 != 0).then_some(!(i as u32))));
        }
        run_until(&mut reactor, "the forwarded messages", || {
            sink.seen.borrow().messages.len() == expected.len()
        });
    }
    assert_eq!(sink.seen.borrow().messages, expected);
    for end in [&source, &relay_in, &relay_out, &sink] {
        assert!(end.seen.borrow().errors.is_empty());
    }
}

/// How many messages from `source` the `relay` end can hold at once: one
/// per receive slot it has posted (less what the sender keeps back), so a
/// slot that never came back makes it one less. Lets them all go after.
fn holding_capacity(reactor: &mut Reactor<Recorder, ()>, source: &End, relay: &End) -> usize {
    // Settled first: every receive reposted, and announced exactly (a
    // credit update goes out only every few reposts; a SEND carries the
    // count whatever it is).
    for _ in 0..2_000 {
        reactor.turn().unwrap();
    }
    send_when_credited(reactor, relay.conn, b"my count", None);
    for _ in 0..2_000 {
        reactor.turn().unwrap();
    }
    let before = relay.relay.replace(Relay::Hold);
    // The window does not reopen while the relay holds: no reposts.
    let mut refused = 0;
    while refused < 1_000 {
        match reactor.with_ctx(|ctx| ctx.send(source.conn, b"hold me", None)) {
            Ok(_) => refused = 0,
            Err(SendError::WouldBlock) => refused += 1,
            Err(err) => panic!("{err}"),
        }
        reactor.turn().unwrap();
    }
    let held: Vec<HeldRecv> = relay.held.borrow_mut().drain(..).collect();
    let count = held.len();
    reactor.with_ctx(|ctx| {
        for held in held {
            if let Err((err, _)) = ctx.release(held) {
                panic!("release: {err}");
            }
        }
    });
    relay.relay.set(before);
    for _ in 0..2_000 {
        reactor.turn().unwrap();
    }
    count
}

/// A reactor whose receive slots go back as soon as they are free (every
/// one reposted at the end of its pass), so a slot that comes back too
/// early is seen at once.
fn eager_reactor(pd: &ProtectionDomain) -> Reactor<Recorder, ()> {
    reactor_reposting_by(pd, 1)
}

/// A reactor connection whose peer is a raw QP of the test's: the raw end
/// posts `receives` receives, then claims `claimed` in its credit update.
struct RawTarget {
    conn: ConnId,
    seen: Rc<RefCell<Seen>>,
    raw: QueuePair,
    scratch: MemoryRegion,
    _inbox: MemoryRegion,
}

impl RawTarget {
    fn new(
        reactor: &mut Reactor<Recorder, ()>,
        pd: &ProtectionDomain,
        receives: usize,
        claimed: u32,
    ) -> Self {
        let (qp, mut raw) = reactor.connected_pair(pd, ACCESS).unwrap();
        let inbox = pd
            .alloc_mr(receives * 256, AccessFlags::LOCAL_WRITE)
            .unwrap();
        for i in 0..receives {
            let slot = inbox.slice(i * 256, 256).unwrap();
            raw.post_recv(&mut RecvRequest::new(i as u64, slot).unwrap())
                .unwrap();
        }
        let recorder = Recorder::default();
        let seen = Rc::clone(&recorder.seen);
        let session = reactor.add(vec![qp], recorder).unwrap();
        let conn = reactor.conns(session).next().unwrap();
        let scratch = pd.alloc_mr(256, AccessFlags::LOCAL_WRITE).unwrap();
        // A credit update: kind 1, and the receive count.
        let mut update =
            WorkRequest::send_with_imm(100, scratch.slice(0, 0).unwrap(), 1 << 30 | claimed);
        raw.post_send(&mut update).unwrap();
        run_until(reactor, "the target established", || {
            !seen.borrow().established.is_empty()
        });
        Self {
            conn,
            seen,
            raw,
            scratch,
            _inbox: inbox,
        }
    }

    /// Breaks the protocol (a SEND without the reactor's immediate), so the
    /// reactor cuts the target off.
    fn misbehave(&mut self, reactor: &mut Reactor<Recorder, ()>) {
        let mut wr = WorkRequest::send(101, self.scratch.slice(0, 8).unwrap());
        self.raw.post_send(&mut wr).unwrap();
        run_until(reactor, "the target cut off", || {
            !self.seen.borrow().errors.is_empty()
        });
        let text = self.seen.borrow().error_texts.join("; ");
        assert!(text.starts_with("MalformedMessage"), "{text}");
    }
}

/// A relay forwards `messages` messages (each longer than the inline
/// limit, so the SEND reads the relay's receive slot in place) to a target
/// whose raw peer posted `receives` receives and claims 8; then the peer
/// breaks the protocol and is cut off. Every slot of the relay must come
/// back, and none too early: a repost while a forward could still read its
/// slot is refused by the device (EBUSY), which would fail the relay.
fn relay_to_a_target_that_is_cut_off(receives: usize, messages: u8) {
    // SAFETY: one thread serves every QP of this device and reads every byte.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().unwrap();
    let mut reactor = eager_reactor(&pd);
    let (source, relay_in) = add_pair(&mut reactor, &pd);
    let capacity = holding_capacity(&mut reactor, &source, &relay_in);
    assert!(capacity >= 8, "{capacity}");
    let mut target = RawTarget::new(&mut reactor, &pd, receives, 8);
    relay_in.relay.set(Relay::Forward(target.conn, None));
    let seen = relay_in.seen.borrow().messages.len();
    for i in 0..messages {
        send_when_credited(&mut reactor, source.conn, &[i; 200], None);
    }
    run_until(&mut reactor, "the messages at the relay", || {
        relay_in.seen.borrow().messages.len() == seen + usize::from(messages)
    });
    relay_in.relay.set(Relay::Nothing);
    for _ in 0..10 {
        reactor.turn().unwrap();
    }
    target.misbehave(&mut reactor);
    assert_eq!(holding_capacity(&mut reactor, &source, &relay_in), capacity);
    for end in [&source, &relay_in] {
        let seen = end.seen.borrow();
        assert!(seen.errors.is_empty(), "{:?}", seen.error_texts);
    }
}

#[test]
fn a_forward_stalled_on_a_peer_that_is_cut_off_keeps_its_slot_until_the_flush_is_polled() {
    // The one receive takes the target's first credit update; the forward
    // stalls (an RNR wait) until the cut-off flushes it, and its slot goes
    // back only once that flush is polled.
    relay_to_a_target_that_is_cut_off(1, 1);
}

#[test]
fn forwards_that_completed_unsignaled_give_their_slots_back_when_the_target_is_cut_off() {
    // Receives for everything: the target's two credit updates and five
    // forwards, which complete at once, unsignaled (one in 16 is). Nothing
    // will report them: the cut-off drains the target's send queue, and
    // the drain's completion retires them.
    relay_to_a_target_that_is_cut_off(8, 5);
}

#[test]
fn a_bad_rkey_fails_its_session_while_another_keeps_running() {
    // SAFETY: one thread serves every QP of this device and reads every byte.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().unwrap();
    let mut reactor = new_reactor(&pd);
    let (bad, bad_peer) = add_pair(&mut reactor, &pd);
    let (good, good_peer) = add_pair(&mut reactor, &pd);
    let local = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    let exported = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE | ACCESS).unwrap();
    let real = exported.remote().unwrap();
    let forged = RemoteRegion::new(real.addr(), real.len(), real.rkey().wrapping_add(0x1000));

    reactor.with_ctx(|ctx| {
        let slice = local.slice(0, 8).unwrap();
        ctx.write(bad.conn, &slice, forged.slice(0, 8).unwrap(), None)
            .unwrap();
    });
    run_until(&mut reactor, "the failed WRITE's error", || {
        !bad.seen.borrow().errors.is_empty()
    });
    assert_eq!(bad.seen.borrow().errors, [Some(WcStatus::REM_ACCESS_ERR)]);
    assert!(matches!(
        reactor.with_ctx(|ctx| ctx.send(bad.conn, b"x", None)),
        Err(SendError::Closed)
    ));

    // The other session is untouched.
    for round in 0..50u32 {
        reactor.with_ctx(|ctx| ctx.send(good.conn, &round.to_le_bytes(), None).unwrap());
        run_until(&mut reactor, "the good session's message", || {
            good_peer.seen.borrow().messages.len() == round as usize + 1
        });
    }
    assert!(good.seen.borrow().errors.is_empty());
    assert!(good_peer.seen.borrow().errors.is_empty());
    assert!(bad_peer.seen.borrow().messages.is_empty());
}

#[test]
fn removing_a_session_flushes_and_reclaims_it() {
    // SAFETY: one thread serves every QP of this device and reads every byte.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().unwrap();
    let mut reactor = new_reactor(&pd);
    let (gone, orphan) = add_pair(&mut reactor, &pd);
    let (stays, stays_peer) = add_pair(&mut reactor, &pd);
    let before = reactor.memory();
    assert_eq!(before.connections, 4);

    // Receives are posted on `gone`'s QP: removal moves it to the error
    // state (flushing them into the shared CQ) and destroys it.
    let (_link, handler) = reactor.remove(gone.session).expect("a known session");
    drop(handler);
    let after = reactor.memory();
    assert_eq!(after.connections, 3);
    assert!(after.receive_bytes < before.receive_bytes);
    assert!(after.send_bytes < before.send_bytes);
    assert!(reactor.handler(gone.session).is_none());
    for _ in 0..100 {
        reactor.turn().unwrap();
    }
    // The flushed completions went nowhere: nobody saw an error yet.
    assert!(gone.seen.borrow().errors.is_empty());
    assert!(orphan.seen.borrow().errors.is_empty());

    // The orphaned peer finds out when it next talks to the removed QP.
    reactor.with_ctx(|ctx| ctx.send(orphan.conn, b"anyone?", None).unwrap());
    run_until(&mut reactor, "the orphan's error", || {
        !orphan.seen.borrow().errors.is_empty()
    });
    assert_eq!(
        orphan.seen.borrow().errors[0],
        Some(WcStatus::RETRY_EXC_ERR)
    );
    reactor.remove(orphan.session).expect("a known session");
    assert_eq!(reactor.memory().connections, 2);

    // The slots are reused by a new pair, and the survivors keep talking.
    let (fresh, fresh_peer) = add_pair(&mut reactor, &pd);
    reactor.with_ctx(|ctx| {
        ctx.send(fresh.conn, b"new", None).unwrap();
        ctx.send(stays.conn, b"old", None).unwrap();
    });
    run_until(&mut reactor, "both messages", || {
        fresh_peer.seen.borrow().messages.len() == 1 && stays_peer.seen.borrow().messages.len() == 1
    });
    assert_eq!(reactor.sessions().count(), 4);
    assert!(stays.seen.borrow().errors.is_empty());
}

#[test]
fn loopback_objects_dropped_in_any_order_do_not_crash() {
    for order in 0..4 {
        // SAFETY: one thread serves every QP of this device and reads every byte.
        let ctx = unsafe { Context::loopback() };
        let pd = ctx.alloc_pd().unwrap();
        let mut reactor = new_reactor(&pd);
        let (a, b) = add_pair(&mut reactor, &pd);
        let local = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
        let exported = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE | ACCESS).unwrap();
        let remote = exported.remote().unwrap();
        // Work in flight (staged, not yet flushed) when things go away.
        reactor.with_ctx(|ctx| {
            let slice = local.slice(0, 8).unwrap();
            ctx.write(a.conn, &slice, remote.slice(0, 8).unwrap(), None)
                .unwrap();
            ctx.send(b.conn, b"pending", None).unwrap();
        });
        match order {
            0 => drop((reactor, local, exported, pd, ctx)),
            1 => drop((ctx, pd, exported, local, reactor)),
            2 => {
                // The target region goes first: the WRITE fails cleanly.
                drop(exported);
                run_until(&mut reactor, "the WRITE's failure", || {
                    !a.seen.borrow().errors.is_empty()
                });
                assert_eq!(a.seen.borrow().errors, [Some(WcStatus::REM_ACCESS_ERR)]);
                drop((pd, reactor, local, ctx));
            }
            _ => {
                reactor.remove(b.session);
                drop((local, ctx, reactor, exported, pd));
            }
        }
    }
}

#[test]
fn a_write_keeps_its_source_registered_after_the_region_is_dropped() {
    // Three WRITEs from three regions staged in one go: the first region
    // becomes the connection's kept registration, the other two are held by
    // handles of their own (the kept one is in flight). Their regions are
    // dropped before the doorbell; the device reads them at the doorbell
    // (the loopback device resolves the local key then, as a NIC's DMA
    // would), so a handle not held would show as a local protection error.
    // SAFETY: one thread serves every QP of this device and reads every byte.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().unwrap();
    let mut reactor = new_reactor(&pd);
    let (client, _server) = add_pair(&mut reactor, &pd);
    // Larger than the inline limit: a WRITE the device reads by key.
    const LEN: usize = 200;
    let exported = pd
        .alloc_mr(3 * LEN, AccessFlags::LOCAL_WRITE | ACCESS)
        .unwrap();
    let remote = exported.remote().unwrap();
    let sources: Vec<MemoryRegion> = [b"first...", b"second..", b"third..."]
        .into_iter()
        .map(|text| {
            let mut region = pd.alloc_mr(LEN, AccessFlags::LOCAL_WRITE).unwrap();
            region.write(0, &text.repeat(LEN / 8)).unwrap();
            region
        })
        .collect();
    reactor.with_ctx(|ctx| {
        for (i, region) in sources.iter().enumerate() {
            let local = region.slice(0, LEN).unwrap();
            let target = remote.slice((LEN * i) as u64, LEN as u64).unwrap();
            ctx.write(client.conn, &local, target, None).unwrap();
        }
    });
    drop(sources);
    run_until(&mut reactor, "three WRITEs", || {
        let seen = client.seen.borrow();
        seen.writes_done.len() == 3 || !seen.errors.is_empty()
    });
    assert!(
        client.seen.borrow().errors.is_empty(),
        "{:?}",
        client.seen.borrow()
    );
    let expected = [b"first...", b"second..", b"third..."].map(|text| text.repeat(LEN / 8));
    assert_eq!(bytes(&exported, 0, 3 * LEN), expected.concat());
}

#[test]
fn every_kind_of_request_staged_on_one_connection_leaves_in_one_batch() {
    // SAFETY: one thread serves every QP of this device and reads every byte.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().unwrap();
    let mut reactor = new_reactor(&pd);
    let (client, server) = add_pair(&mut reactor, &pd);
    let (gone, _gone_peer) = add_pair(&mut reactor, &pd);
    let mut local = pd.alloc_mr(256, AccessFlags::LOCAL_WRITE).unwrap();
    let mut exported = pd.alloc_mr(256, AccessFlags::LOCAL_WRITE | ACCESS).unwrap();
    let remote = exported.remote().unwrap();
    local.write(0, b"batched WRITE").unwrap();
    exported.write(128, b"batched READ").unwrap();

    reactor.with_ctx(|ctx| {
        let conn = client.conn;
        assert_eq!(ctx.staged(conn), 0);
        ctx.send(conn, b"batched SEND", Some(3)).unwrap();
        let write = local.slice(0, 13).unwrap();
        ctx.write(conn, &write, remote.slice(0, 13).unwrap(), None)
            .unwrap();
        let read = local.slice(128, 12).unwrap();
        ctx.read(conn, &read, remote.slice(128, 12).unwrap())
            .unwrap();
        ctx.send_from(conn, 8, None, |slot| {
            slot[..4].copy_from_slice(b"from");
            Some(4)
        })
        .unwrap();
        // One batch, one doorbell.
        assert_eq!(ctx.staged(conn), 4);
    });
    run_until(&mut reactor, "the batch", || {
        let seen = client.seen.borrow();
        seen.writes_done.len() == 1
            && seen.reads_done.len() == 1
            && server.seen.borrow().messages.len() == 2
    });
    assert_eq!(
        server.seen.borrow().messages,
        [
            (b"batched SEND".to_vec(), Some(3)),
            (b"from".to_vec(), None)
        ]
    );
    assert_eq!(bytes(&exported, 0, 13), b"batched WRITE");
    assert_eq!(bytes(&local, 128, 12), b"batched READ");

    // A connection that is gone takes nothing (its slot may hold another).
    reactor.remove(gone.session).expect("a known session");
    reactor.with_ctx(|ctx| {
        assert!(matches!(
            ctx.send(gone.conn, b"late", None),
            Err(SendError::Closed)
        ));
        assert_eq!(ctx.staged(gone.conn), 0);
    });
    assert!(client.seen.borrow().errors.is_empty());
}

/// What a `Runs` handler was told: each run of completions, by kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Run {
    Sends(u32, u32),
    Writes(u32, u32),
    Reads(u32, u32),
}

/// A handler that takes completions a run at a time and must never be
/// told of one alone.
#[derive(Debug, Default, Clone)]
struct Runs {
    runs: Rc<RefCell<Vec<Run>>>,
    established: Rc<Cell<usize>>,
}

impl Handler for Runs {
    fn on_established(&mut self, _: &mut Ctx<'_>, _: ConnId) {
        self.established.set(self.established.get() + 1);
    }
    fn on_message(&mut self, _: &mut Ctx<'_>, _: ConnId, _: &[u8], _: Option<u32>) {}
    fn on_send_complete(&mut self, _: &mut Ctx<'_>, _: ConnId, seq: u32) {
        panic!("SEND {seq} reported alone to a handler of runs");
    }
    fn on_write_complete(&mut self, _: &mut Ctx<'_>, _: ConnId, seq: u32) {
        panic!("WRITE {seq} reported alone to a handler of runs");
    }
    fn on_read_complete(&mut self, _: &mut Ctx<'_>, _: ConnId, seq: u32) {
        panic!("READ {seq} reported alone to a handler of runs");
    }
    fn on_sends_complete(&mut self, _: &mut Ctx<'_>, _: ConnId, first: u32, count: u32) {
        self.runs.borrow_mut().push(Run::Sends(first, count));
    }
    fn on_writes_complete(&mut self, _: &mut Ctx<'_>, _: ConnId, first: u32, count: u32) {
        self.runs.borrow_mut().push(Run::Writes(first, count));
    }
    fn on_reads_complete(&mut self, _: &mut Ctx<'_>, _: ConnId, first: u32, count: u32) {
        self.runs.borrow_mut().push(Run::Reads(first, count));
    }
}

/// Stages 10 WRITEs, 3 READs and 5 SENDs on `conn` in one pass, the last
/// SEND signaled, and returns the first one's sequence number. With the
/// default signaling interval (16) only the READs (always signaled) and
/// the last SEND have completions of their own: the first READ's retires
/// the WRITEs before it.
fn stage_mixed(ctx: &mut Ctx<'_>, conn: ConnId, local: &MemoryRegion, remote: RemoteRegion) -> u32 {
    let bytes = local.slice(0, 8).unwrap();
    let target = remote.slice(0, 8).unwrap();
    let first = ctx.write(conn, &bytes, target, None).unwrap();
    for n in 1..10 {
        assert_eq!(ctx.write(conn, &bytes, target, None).unwrap(), first + n);
    }
    for n in 10..13 {
        assert_eq!(ctx.read(conn, &bytes, target).unwrap(), first + n);
    }
    for n in 13..18 {
        assert_eq!(ctx.send(conn, b"run", None).unwrap(), first + n);
    }
    ctx.signal_staged(conn);
    first
}

/// Stages `stage_mixed` on a connection whose handler is a `Runs` as
/// `wrap` makes it, and returns the first sequence number and the runs
/// the handler was told.
fn runs_told<H: Handler>(
    pd: &ProtectionDomain,
    config: &ReactorConfig,
    local: &MemoryRegion,
    remote: RemoteRegion,
    wrap: impl Fn(Runs) -> H,
) -> (u32, Vec<Run>) {
    let mut reactor: Reactor<H, ()> = Reactor::new(pd, config.clone()).unwrap();
    let (a, b) = reactor.connected_pair(pd, ACCESS).unwrap();
    let (client, server) = (Runs::default(), Runs::default());
    let session = reactor.add(vec![a], wrap(client.clone())).unwrap();
    reactor.add(vec![b], wrap(server.clone())).unwrap();
    let conn = reactor.conns(session).next().unwrap();
    run_until(&mut reactor, "both ends established", || {
        client.established.get() + server.established.get() == 2
    });
    let first = reactor.with_ctx(|ctx| stage_mixed(ctx, conn, local, remote));
    // Five runs: the WRITEs, each READ, the SENDs.
    run_until(&mut reactor, "five runs told", || {
        client.runs.borrow().len() >= 5
    });
    let runs = client.runs.borrow().clone();
    (first, runs)
}

#[test]
fn completions_retired_together_come_a_run_of_one_kind_at_a_time() {
    // SAFETY: one thread serves every QP of this device and reads every byte.
    let device = unsafe { Context::loopback() };
    let pd = device.alloc_pd().unwrap();
    let config = small_rings();
    assert_eq!(config.signal_interval, 16, "the test counts on it");
    let local = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    let exported = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE | ACCESS).unwrap();
    let remote = exported.remote().unwrap();

    // A handler of runs: one call per run, and never one alone; through a
    // `Box` as well, which must hand the runs on.
    let expected = |first: u32| {
        [
            Run::Writes(first, 10),
            Run::Reads(first + 10, 1),
            Run::Reads(first + 11, 1),
            Run::Reads(first + 12, 1),
            Run::Sends(first + 13, 5),
        ]
    };
    let (first, runs) = runs_told(&pd, &config, &local, remote, |runs| runs);
    assert_eq!(runs, expected(first));
    let (first, runs) = runs_told(&pd, &config, &local, remote, Box::new);
    assert_eq!(runs, expected(first));

    // The default: each request told alone, in order.
    let mut reactor = new_reactor(&pd);
    let (client, _server) = add_pair(&mut reactor, &pd);
    let first = reactor.with_ctx(|ctx| stage_mixed(ctx, client.conn, &local, remote));
    run_until(&mut reactor, "every request told", || {
        client.seen.borrow().sends_done.len() == 5
    });
    let seen = client.seen.borrow();
    assert_eq!(seen.writes_done, (first..first + 10).collect::<Vec<_>>());
    assert_eq!(
        seen.reads_done,
        (first + 10..first + 13).collect::<Vec<_>>()
    );
    assert_eq!(
        seen.sends_done,
        (first + 13..first + 18).collect::<Vec<_>>()
    );
}
