//! What the soundness redesign promises at run time: handles, completions
//! and held receives of one pool, reactor or connection are refused by
//! another, a reactor takes only QPs nothing was posted on and ignores
//! completions it did not post, and in-flight requests keep their memory.
//! (What the types rule out at compile time: `tests/compile_fail.rs`.)
//!
//! Runs on the in-process loopback device ([`Context::loopback`]) in every
//! `cargo test`: pools over a loopback [`Pair`], reactors whose sessions
//! are loopback QPs connected to each other directly (a session's exports
//! need memory windows, which loopback lacks), and foreign QPs that come
//! from sessions over TCP on 127.0.0.1. The few tests that need a NIC are
//! declared with `verbs_test!` and run only in the Soft-RoCE guest (see
//! `tests/util/mod.rs`); each says why.

mod util;

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use rdma_comm_core::Error;
use rdma_comm_core::pool::BufferPool;
use rdma_comm_core::reactor::*;
use rdma_comm_core::session::*;
use rdma_comm_core::verbs::*;
use util::reactor::*;
use util::*;

/// How long a reactor test may turn its reactors before it fails.
const RUN_DEADLINE: Duration = Duration::from_secs(60);

/// A PD of a new loopback device.
fn loopback_pd() -> ProtectionDomain {
    // SAFETY: each test posts every request and touches every byte of its
    // device's memory on its own thread: its reactors turn there, its raw
    // posts are made there, and the session threads that make a foreign
    // QP only create and connect QPs.
    let ctx = unsafe { Context::loopback() };
    ctx.alloc_pd().expect("a PD on the loopback device")
}

/// Two QPs of a new loopback device, connected to each other.
fn loopback_pair() -> Pair {
    // SAFETY: as in `loopback_pd`: the test's thread posts to both QPs,
    // polls both CQs and touches every byte.
    Pair::on(unsafe { Context::loopback() }, &QpConfig::default())
}

fn reactor_config(srq: bool) -> ReactorConfig {
    ReactorConfig {
        srq_depth: if srq { 160 } else { 0 },
        slot_size: 1024,
        recv_depth: 64,
        send_slots: 64,
        signal_interval: 8,
        ..Default::default()
    }
}

/// A reactor with `reactor_config(srq)` whose sessions are QPs handed to
/// it directly.
fn new_reactor(pd: &ProtectionDomain, srq: bool) -> Reactor<BoxedHandler, ()> {
    Reactor::new(pd, reactor_config(srq)).expect("a reactor")
}

/// Turns every reactor in `reactors` until `done` (which may look at
/// them) says so, failing the test at [`RUN_DEADLINE`].
#[track_caller]
fn turn_until<L: PeerLink>(
    reactors: &mut [&mut Reactor<BoxedHandler, L>],
    what: &str,
    mut done: impl FnMut(&[&mut Reactor<BoxedHandler, L>]) -> bool,
) {
    let start = Instant::now();
    while !done(reactors) {
        for reactor in reactors.iter_mut() {
            reactor.turn().expect("reactor pass");
        }
        assert!(
            start.elapsed() < RUN_DEADLINE,
            "timed out after {RUN_DEADLINE:?} waiting for {what}"
        );
    }
}

/// Receives a message a callback sent, turning `reactors` meanwhile.
#[track_caller]
fn turn_until_received<T, L: PeerLink>(
    reactors: &mut [&mut Reactor<BoxedHandler, L>],
    what: &str,
    rx: &mpsc::Receiver<T>,
) -> T {
    let mut got = None;
    turn_until(reactors, what, |_| {
        got = got.take().or_else(|| rx.try_recv().ok());
        got.is_some()
    });
    got.expect("received")
}

/// A handler that expects neither a message nor an error.
struct Quiet;

impl Handler for Quiet {
    fn on_message(&mut self, _: &mut Ctx<'_>, conn: ConnId, data: &[u8], _: Option<u32>) {
        panic!("{conn:?} got an unexpected message of {} bytes", data.len());
    }

    fn on_error(&mut self, _: &mut Ctx<'_>, conn: ConnId, error: &Error) {
        panic!("{conn:?} failed: {error}");
    }
}

fn quiet() -> Box<Quiet> {
    Box::new(Quiet)
}

/// Runs `check` once, when its session's first connection is established.
struct OnEstablished<F>(Option<F>);

impl<F: FnOnce(&mut Ctx<'_>, ConnId) + Send> Handler for OnEstablished<F> {
    fn on_established(&mut self, ctx: &mut Ctx<'_>, conn: ConnId) {
        if let Some(check) = self.0.take() {
            check(ctx, conn);
        }
    }

    fn on_message(&mut self, _: &mut Ctx<'_>, _: ConnId, _: &[u8], _: Option<u32>) {}

    fn on_error(&mut self, _: &mut Ctx<'_>, conn: ConnId, error: &Error) {
        panic!("{conn:?} failed: {error}");
    }
}

fn on_established(check: impl FnOnce(&mut Ctx<'_>, ConnId) + Send + 'static) -> BoxedHandler {
    Box::new(OnEstablished(Some(check)))
}

/// Connects two QPs on `reactor`'s CQ (and its SRQ, if it has one) and
/// adds them as sessions with `server` and `client` as handlers.
fn add_pair(
    pd: &ProtectionDomain,
    reactor: &mut Reactor<BoxedHandler, ()>,
    server: BoxedHandler,
    client: BoxedHandler,
) -> (SessionId, SessionId) {
    let (server_qp, client_qp) = reactor
        .connected_pair(pd, AccessFlags::empty())
        .expect("two connected QPs");
    let server = reactor
        .add(vec![server_qp], server)
        .expect("add server side");
    let client = reactor
        .add(vec![client_qp], client)
        .expect("add client side");
    (server, client)
}

fn conns_of<L: PeerLink>(reactor: &Reactor<BoxedHandler, L>) -> Vec<ConnId> {
    reactor
        .sessions()
        .flat_map(|session| reactor.conns(session).collect::<Vec<_>>())
        .collect()
}

// ---------------------------------------------------------------- pools

#[test]
fn a_pool_refuses_remote_access() {
    let pd = loopback_pd();
    for access in [
        AccessFlags::REMOTE_WRITE,
        AccessFlags::REMOTE_READ,
        AccessFlags::REMOTE_ATOMIC,
        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
    ] {
        let refused = BufferPool::new(&pd, 256, 4, access);
        assert!(
            matches!(refused, Err(Error::InvalidArgument(_))),
            "{access:?}: {refused:?}"
        );
    }
    BufferPool::new(&pd, 256, 4, AccessFlags::LOCAL_WRITE).expect("local access is fine");
}

#[test]
fn a_pool_refuses_slots_of_another_pool() {
    let mut p = loopback_pair();
    // `a` has more slots than `b`: its last slot's index is out of `b`'s range.
    let mut a = BufferPool::new(&p.pd, 64, 8, AccessFlags::LOCAL_WRITE).unwrap();
    let mut b = BufferPool::new(&p.pd, 64, 4, AccessFlags::LOCAL_WRITE).unwrap();
    let mut slots: Vec<_> = std::iter::from_fn(|| a.acquire()).collect();
    let held_by_b = b.acquire().unwrap();
    for slot in &mut slots {
        assert!(
            matches!(b.bytes(slot), Err(Error::ForeignHandle(_))),
            "bytes of {slot:?}"
        );
        let refused = b.bytes_mut(slot).map(|_| ());
        assert!(
            matches!(refused, Err(Error::ForeignHandle(_))),
            "bytes_mut of {slot:?}"
        );
    }
    // Posting a foreign slot hands it back untouched.
    let slot = slots.pop().unwrap();
    let refused = b
        .post_send(&mut p.a, slot, 8, None)
        .expect_err("a foreign slot");
    assert!(
        matches!(refused.error, Error::ForeignHandle(_)),
        "{}",
        refused.error
    );
    assert!(!p.a.has_posted(), "nothing reached the QP");
    let slot = refused.slot;
    let refused = b.post_recv(&mut p.b, slot).expect_err("a foreign slot");
    assert!(
        matches!(refused.error, Error::ForeignHandle(_)),
        "{}",
        refused.error
    );
    assert!(!p.b.has_posted(), "nothing reached the QP");
    // Releasing into the wrong pool is refused (the handle is gone with it).
    assert!(matches!(
        b.release(refused.slot),
        Err(Error::ForeignHandle(_))
    ));
    assert_eq!(
        (b.available(), b.in_flight()),
        (3, 0),
        "b's free list is untouched"
    );
    // The rest still work in their own pool.
    for mut slot in slots {
        a.bytes_mut(&mut slot).unwrap().fill(1);
        a.release(slot).unwrap();
    }
    assert_eq!(a.available(), 7);
    b.release(held_by_b).unwrap();
    assert_eq!(b.available(), 4);
}

#[test]
fn a_pool_ignores_completions_of_another_pool() {
    let mut p = loopback_pair();
    let mut a = BufferPool::new(&p.pd, 64, 4, AccessFlags::LOCAL_WRITE).unwrap();
    let mut b = BufferPool::new(&p.pd, 64, 4, AccessFlags::LOCAL_WRITE).unwrap();
    let mut recvs = BufferPool::new(&p.pd, 64, 4, AccessFlags::LOCAL_WRITE).unwrap();
    while let Some(slot) = recvs.acquire() {
        recvs.post_recv(&mut p.b, slot).unwrap();
    }
    // Both pools send from their slot 0, so the completions name the same index.
    let (slot_a, slot_b) = (a.acquire().unwrap(), b.acquire().unwrap());
    assert_eq!(slot_a.index(), slot_b.index());
    a.post_send(&mut p.a, slot_a, 8, None).unwrap();
    b.post_send(&mut p.a, slot_b, 8, None).unwrap();
    let done = wait_for(&mut p.cq_a, 2);
    for wc in &done {
        wc.ok().unwrap();
        let (mine, other) = if a.owns(wc) {
            (&mut a, &mut b)
        } else {
            (&mut b, &mut a)
        };
        assert!(!other.owns(wc), "{wc:?} is claimed by both pools");
        let in_flight = other.in_flight();
        assert!(
            other.complete(wc).is_none(),
            "the other pool's completion gave a slot back"
        );
        assert_eq!(
            other.in_flight(),
            in_flight,
            "the other pool's slots stay as they were"
        );
        let slot = mine.complete(wc).expect("its own pool takes it back");
        mine.release(slot).unwrap();
    }
    assert_eq!((a.in_flight(), b.in_flight()), (0, 0));
    assert!(
        a.complete(&WorkCompletion::default()).is_none(),
        "an all-zero completion"
    );
}

#[test]
fn a_forged_completion_does_not_free_an_in_flight_slot() {
    let mut p = loopback_pair();
    let mut recvs = BufferPool::new(&p.pd, 64, 1, AccessFlags::LOCAL_WRITE).unwrap();
    // Bytes 0..64 are the source of the SENDs, then one 64-byte buffer
    // per forged receive.
    let mut own = p.pd.alloc_mr(64 * 8, AccessFlags::LOCAL_WRITE).unwrap();
    // Receives of our own on the pool's QP, posted first so they complete
    // first, while the pool's slot 0 is in flight behind them. Their ids
    // carry slot index 0 with every tag a guess might try.
    let forged: [u64; 6] = [
        0,
        1 << 20,
        42 << 20,
        0x0123_4567_89a0_0000,
        0x5555_5555_5550_0000,
        0xffff_ffff_fff0_0000,
    ];
    for (i, &wr_id) in forged.iter().enumerate() {
        let local = own.slice((i + 1) * 64, 64).unwrap();
        p.b.post_recv(&mut RecvRequest::new(wr_id, local).unwrap())
            .unwrap();
    }
    let slot = recvs.acquire().unwrap();
    assert_eq!(slot.index(), 0);
    recvs.post_recv(&mut p.b, slot).unwrap();
    assert!(recvs.acquire().is_none());

    own.write(0, &pattern(1, 64)).unwrap();
    for _ in 0..=forged.len() {
        p.a.post_send(&mut WorkRequest::send(0, own.slice(0, 64).unwrap()).signaled())
            .unwrap();
    }
    for wc in wait_for(&mut p.cq_a, forged.len() + 1) {
        wc.ok().unwrap();
    }
    let received = wait_for(&mut p.cq_b, forged.len() + 1);
    for wc in &received[..forged.len()] {
        wc.ok().unwrap();
        assert!(!recvs.owns(wc), "forged {:#x} claimed", wc.wr_id());
        assert!(
            recvs.complete(wc).is_none(),
            "forged {:#x} freed the slot",
            wc.wr_id()
        );
        assert_eq!(recvs.in_flight(), 1, "the slot stays in flight");
    }
    let real = received[forged.len()];
    let slot = recvs
        .complete(&real)
        .expect("the real completion gives the slot back");
    assert_eq!(recvs.bytes(&slot).unwrap(), pattern(1, 64));
    assert!(recvs.complete(&real).is_none(), "and only once");
    recvs.release(slot).unwrap();
}

// ---------------------------------------------------------------- reactor

#[test]
fn add_refuses_a_qp_something_was_posted_on() {
    let pd = loopback_pd();
    let mut reactor = new_reactor(&pd, false);
    let (server_qp, mut client_qp) = reactor
        .connected_pair(&pd, AccessFlags::empty())
        .expect("two connected QPs");
    let own = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    assert!(!client_qp.has_posted());
    client_qp
        .post_recv(&mut RecvRequest::new(7, own.whole().unwrap()).unwrap())
        .unwrap();
    assert!(client_qp.has_posted());

    let refused = reactor
        .add(vec![client_qp], quiet())
        .expect_err("a QP with a posted receive");
    assert!(matches!(refused, Error::InvalidArgument(_)), "{refused}");
    assert!(refused.to_string().contains("posted"), "{refused}");
    assert_eq!(reactor.sessions().count(), 0, "the reactor is as it was");
    reactor
        .add(vec![server_qp], quiet())
        .expect("a QP nothing was posted on");
    assert_eq!(ignored(&reactor), (0, 0));
}

// Guest only: CQ ids are a kernel's per-context handles; loopback's are process-wide (no twin).
verbs_test! {
    fn add_refuses_a_qp_on_another_contexts_cq_with_the_same_id() {
        // CQ ids are the kernel's handles, numbered per device context: a CQ
        // of a second context of the same device gets the id of the reactor's.
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        let mut reactor: Reactor<BoxedHandler, ()> =
            Reactor::new(&pd, reactor_config(false)).unwrap();
        let CqChoice::Shared(ours) = reactor.qp_spec("probe").cq else {
            panic!("a reactor's channel spec names its shared CQ");
        };
        let probe = pd.create_qp(&ours, &ours, &QpConfig::default()).unwrap();
        let other = open_device();
        let other_pd = other.alloc_pd().unwrap();
        let mut other_cqs = Vec::new();
        let twin = loop {
            assert!(other_cqs.len() < 16, "no CQ of a second context has the reactor's CQ's id");
            other_cqs.push(other.create_cq(4096, None).unwrap());
            let cq = other_cqs.last().unwrap();
            let qp = other_pd.create_qp(cq, cq, &QpConfig::default()).unwrap();
            if (qp.send_cq_id(), qp.recv_cq_id()) == (probe.send_cq_id(), probe.recv_cq_id()) {
                break qp;
            }
        };
        let refused = reactor.add(vec![twin], quiet()).expect_err("a QP on another context's CQ");
        assert!(matches!(refused, Error::InvalidArgument(_)), "{refused}");
        assert_eq!(reactor.sessions().count(), 0);
        reactor.add(vec![probe], quiet()).expect("a QP on the reactor's own CQ");
    }
}

/// The (index, generation) of a connection, read from its `Debug` form
/// `ConnId(index#generation)`: the reactor's `wr_id` carries both.
fn conn_key(conn: ConnId) -> (u64, u64) {
    let text = format!("{conn:?}");
    let inner = text
        .strip_prefix("ConnId(")
        .and_then(|rest| rest.strip_suffix(')'))
        .expect("ConnId(index#generation)");
    let (index, generation) = inner.split_once('#').expect("index#generation");
    (index.parse().unwrap(), generation.parse().unwrap())
}

/// A `wr_id` laid out as the reactor's own (src/reactor/conn/wr_id.rs):
/// connection index << 44 | generation << 34 | kind << 32 | slot or sequence.
fn reactor_wr_id(conn: ConnId, kind: u64, value: u32) -> u64 {
    let (index, generation) = conn_key(conn);
    index << 44 | (generation & 0x3ff) << 34 | kind << 32 | u64::from(value)
}
const KIND_RECV: u64 = 1;
const KIND_SEND: u64 = 2;

/// A QP on `reactor`'s CQ (and SRQ, if it has one) that the reactor never
/// takes, connected to a peer with a private CQ: (that QP's endpoint, the
/// peer's endpoint).
fn foreign_qp(
    pd: &ProtectionDomain,
    reactor: &mut Reactor<BoxedHandler, ()>,
) -> (Endpoint, Endpoint) {
    foreign_qp_with(pd, reactor, true)
}

/// Like [`foreign_qp`], optionally without the reactor's SRQ (so the QP
/// posts receives of its own).
fn foreign_qp_with(
    pd: &ProtectionDomain,
    reactor: &mut Reactor<BoxedHandler, ()>,
    on_srq: bool,
) -> (Endpoint, Endpoint) {
    let config = ServerConfig {
        max_peers: Some(1),
        ..ServerConfig::insecure_open()
    };
    let listener = ServerSession::bind("127.0.0.1:0", pd, config).expect("bind");
    let mut spec = reactor.qp_spec("foreign");
    if !on_srq {
        spec.srq = None;
    }
    let foreign = ClientSession::connect(listener.local_addr(), pd, &ClientConfig::new(vec![spec]))
        .expect("connect");
    let peer = listener.accept_timeout(DEADLINE).expect("accept");
    (foreign, peer)
}

fn foreign_completions_are_ignored(srq: bool) {
    const RECVS: usize = 8;
    const SENDS: usize = 4;
    let pd = loopback_pd();
    let mut reactor = new_reactor(&pd, srq);
    let (ping, echo) = add_ping_pong_on_qps(&pd, &mut reactor, u64::MAX, 64, true);
    let conns = conns_of(&reactor);
    let (mut foreign, mut peer) = foreign_qp(&pd, &mut reactor);
    turn_until(&mut [&mut reactor], "the ping-pong to get going", |_| {
        ping.done.load(Ordering::Relaxed) >= 50
    });

    let mut payload = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    payload.write(0, &pattern(9, 64)).unwrap();
    let foreign_inbox = pd.alloc_mr(1024 * RECVS, AccessFlags::LOCAL_WRITE).unwrap();
    let peer_inbox = pd.alloc_mr(64 * SENDS, AccessFlags::LOCAL_WRITE).unwrap();
    let foreign_qp = foreign.qps_mut()[0].qp_mut();
    let peer_channel = &mut peer.qps_mut()[0];
    // Receives on the foreign QP whose ids name the reactor's connections
    // and receive slots. (With an SRQ the foreign QP cannot post: the
    // peer's SENDs consume the reactor's SRQ receives instead.)
    if !srq {
        for i in 0..RECVS {
            let wr_id = reactor_wr_id(conns[i % conns.len()], KIND_RECV, (i / conns.len()) as u32);
            let local = foreign_inbox.slice(i * 1024, 1024).unwrap();
            foreign_qp
                .post_recv(&mut RecvRequest::new(wr_id, local).unwrap())
                .unwrap();
        }
    }
    // SENDs from the foreign QP whose ids name the connections' send queues.
    for i in 0..SENDS {
        let local = peer_inbox.slice(i * 64, 64).unwrap();
        peer_channel
            .qp_mut()
            .post_recv(&mut RecvRequest::new(i as u64, local).unwrap())
            .unwrap();
    }
    for i in 0..SENDS {
        let wr_id = reactor_wr_id(conns[i % conns.len()], KIND_SEND, (i / conns.len()) as u32);
        foreign_qp
            .post_send(&mut WorkRequest::send(wr_id, payload.slice(0, 16).unwrap()).signaled())
            .unwrap();
    }
    // The peer's SENDs land in the foreign QP's receives, whose completions
    // go to the reactor's CQ. They are plain SENDs, which the reactor would
    // cut off as malformed were they taken for its own.
    for i in 0..RECVS {
        let mut wr = WorkRequest::send(100 + i as u64, payload.whole().unwrap()).signaled();
        peer_channel.qp_mut().post_send(&mut wr).unwrap();
    }

    // Every foreign completion is counted as such. With an SRQ, the
    // receives the foreign QP consumed are the reactor's own SRQ receives
    // (their tagged ids match): those are given back to the SRQ and counted
    // as reclaimed, not as foreign.
    let expected = if srq {
        (SENDS as u64, RECVS as u64)
    } else {
        ((SENDS + RECVS) as u64, 0)
    };
    let mut peer_done = Vec::new();
    let mut wcs = [WorkCompletion::default(); 16];
    // A completion taken for the sessions' own shows as a bad message or an
    // error: stop waiting then.
    let troubled = || {
        [&ping, &echo].iter().any(|outcome| {
            outcome.errors.load(Ordering::Relaxed) + outcome.bad.load(Ordering::Relaxed) > 0
        })
    };
    let check_sessions = || {
        for (what, outcome) in [("pinger", &ping), ("echoer", &echo)] {
            assert_eq!(outcome.errors.load(Ordering::Relaxed), 0, "{what}: errors");
            assert_eq!(
                outcome.bad.load(Ordering::Relaxed),
                0,
                "{what}: bad messages"
            );
        }
    };
    turn_until(&mut [&mut reactor], "the foreign completions", |reactors| {
        let cq = peer_channel.cq_mut().expect("the peer's private CQ");
        peer_done.extend_from_slice(cq.poll(&mut wcs).unwrap());
        let (foreign, reclaimed) = ignored(reactors[0]);
        troubled()
            || (peer_done.len() >= SENDS + RECVS
                && foreign >= expected.0
                && reclaimed >= expected.1)
    });
    check_sessions();
    for wc in &peer_done {
        wc.ok()
            .unwrap_or_else(|err| panic!("the peer's side: {err}"));
    }
    // The real sessions go on, every message verified.
    let after = ping.done.load(Ordering::Relaxed);
    turn_until(&mut [&mut reactor], "the ping-pong to go on", |_| {
        troubled() || ping.done.load(Ordering::Relaxed) >= after + 200
    });
    check_sessions();
    assert_eq!(
        ignored(&reactor),
        expected,
        "(foreign, reclaimed SRQ receives)"
    );
    if !srq {
        assert_eq!(
            read_back(&foreign_inbox, 0, 64),
            pattern(9, 64),
            "the foreign receives got the peer's bytes"
        );
    }
}

#[test]
fn completions_the_reactor_did_not_post_are_ignored_and_counted() {
    foreign_completions_are_ignored(false);
}

#[test]
fn receives_shaped_like_srq_receives_are_ignored_unless_their_tag_matches() {
    const RECVS: usize = 8;
    let pd = loopback_pd();
    let mut reactor = new_reactor(&pd, true);
    let (ping, echo) = add_ping_pong_on_qps(&pd, &mut reactor, u64::MAX, 64, true);
    // On the reactor's CQ but not its SRQ: it posts receives of its own,
    // with ids of the SRQ's shape (kind 3, slots 0..8, made-up tags).
    let (mut foreign, mut peer) = foreign_qp_with(&pd, &mut reactor, false);
    turn_until(&mut [&mut reactor], "the ping-pong to get going", |_| {
        ping.done.load(Ordering::Relaxed) >= 50
    });
    let inbox = pd.alloc_mr(1024 * RECVS, AccessFlags::LOCAL_WRITE).unwrap();
    let payload = pd.alloc_mr(64, AccessFlags::empty()).unwrap();
    let foreign_qp = foreign.qps_mut()[0].qp_mut();
    for i in 0..RECVS {
        let tag = 0x2545_f491_4f6c_dd1d_u64.wrapping_mul(i as u64 + 1);
        let wr_id = (tag << 34) | (3 << 32) | i as u64;
        let local = inbox.slice(i * 1024, 1024).unwrap();
        foreign_qp
            .post_recv(&mut RecvRequest::new(wr_id, local).unwrap())
            .unwrap();
    }
    for i in 0..RECVS {
        let mut wr = WorkRequest::send(i as u64, payload.whole().unwrap()).signaled();
        peer.qps_mut()[0].qp_mut().post_send(&mut wr).unwrap();
    }
    turn_until(&mut [&mut reactor], "the forged completions", |reactors| {
        ignored(reactors[0]).0 >= RECVS as u64
    });
    let start = ping.done.load(Ordering::Relaxed);
    turn_until(&mut [&mut reactor], "the ping-pong to go on", |_| {
        ping.done.load(Ordering::Relaxed) >= start + 50
    });
    assert_eq!(ignored(&reactor), (RECVS as u64, 0), "(foreign, reclaimed)");
    for outcome in [&ping, &echo] {
        assert_eq!(outcome.errors.load(Ordering::Relaxed), 0);
        assert_eq!(outcome.bad.load(Ordering::Relaxed), 0);
    }
}

#[test]
fn srq_receives_consumed_by_a_foreign_qp_are_counted_and_never_dispatched() {
    foreign_completions_are_ignored(true);
}

/// What the holder and the thief of `a_held_receive_is_refused_by_another_reactor` saw.
#[derive(Default)]
struct Stash {
    /// Messages held on reactor A, for reactor B to try.
    held: Vec<HeldRecv>,
    /// A held message B handed back for A to release.
    returned: Option<HeldRecv>,
    /// B's view: held_bytes, forward, release, whether `to` was established.
    on_b: Option<(bool, String, String, bool)>,
    /// A's view of the message B gave back: its bytes verified, release.
    on_a: Option<(bool, String)>,
}

/// On reactor A: holds the first two messages of a stream and hands them
/// out; releases what comes back.
struct Holder {
    stash: Arc<Mutex<Stash>>,
    max: usize,
    seq: u64,
    holds: usize,
}

impl Holder {
    fn new(stash: &Arc<Mutex<Stash>>, max: usize) -> Self {
        Self {
            stash: Arc::clone(stash),
            max,
            seq: 0,
            holds: 2,
        }
    }
}

impl Handler for Holder {
    fn on_message(&mut self, ctx: &mut Ctx<'_>, _: ConnId, data: &[u8], imm: Option<u32>) {
        assert!(
            imm == Some(self.seq as u32) && matches(data, self.seq),
            "message {}",
            self.seq
        );
        self.seq += 1;
        if self.holds > 0 {
            self.holds -= 1;
            let held = ctx.hold().expect("in on_message");
            self.stash.lock().unwrap().held.push(held);
        }
    }

    fn on_idle(&mut self, ctx: &mut Ctx<'_>) -> Idle {
        let mut stash = self.stash.lock().unwrap();
        if let Some(held) = stash.returned.take() {
            let intact = ctx
                .held_bytes(&held)
                .is_some_and(|bytes| bytes.len() == stream_len(0, self.max) && matches(bytes, 0));
            stash.on_a = Some((intact, format!("{:?}", ctx.release(held))));
        }
        Idle::Again
    }
}

/// On reactor B: tries the held messages of reactor A.
struct Thief {
    stash: Arc<Mutex<Stash>>,
    to: Option<ConnId>,
}

impl Handler for Thief {
    fn on_established(&mut self, _: &mut Ctx<'_>, conn: ConnId) {
        self.to = Some(conn);
    }

    fn on_message(&mut self, _: &mut Ctx<'_>, _: ConnId, _: &[u8], _: Option<u32>) {}

    fn on_idle(&mut self, ctx: &mut Ctx<'_>) -> Idle {
        let mut stash = self.stash.lock().unwrap();
        let Some(to) = self.to else {
            return Idle::Again;
        };
        if stash.held.len() < 2 || stash.on_b.is_some() {
            return Idle::Again;
        }
        let second = stash.held.pop().unwrap();
        let first = stash.held.pop().unwrap();
        let bytes = ctx.held_bytes(&first).is_none();
        let forward = match ctx.forward(to, first, None) {
            Err((error, held)) => {
                stash.returned = Some(held);
                format!("{error:?}")
            }
            Ok(seq) => format!("forwarded as {seq}"),
        };
        let release = format!("{:?}", ctx.release(second));
        stash.on_b = Some((bytes, forward, release, ctx.is_established(to)));
        Idle::Again
    }
}

#[test]
fn a_held_receive_is_refused_by_another_reactor() {
    const MAX: usize = 256;
    let pd = loopback_pd();
    let mut a = new_reactor(&pd, false);
    let mut b = new_reactor(&pd, false);
    let stash = Arc::new(Mutex::new(Stash::default()));
    let holder = Holder::new(&stash, MAX);
    let streamer = Streamer::new(4, MAX, Arc::default());
    add_pair(&pd, &mut a, Box::new(holder), Box::new(streamer));
    // B's first connection has the same slot and generation as A's.
    let thief = Thief {
        stash: Arc::clone(&stash),
        to: None,
    };
    add_pair(&pd, &mut b, Box::new(thief), quiet());
    // Same slot and generation (what Debug shows), yet different ids.
    let shown = |r: &Reactor<BoxedHandler, ()>| format!("{:?}", conns_of(r));
    assert_eq!(shown(&a), shown(&b), "the two reactors' ids look alike");
    assert_ne!(conns_of(&a), conns_of(&b), "ids name their reactor");

    turn_until(&mut [&mut a, &mut b], "B to try A's held messages", |_| {
        stash.lock().unwrap().on_b.is_some()
    });
    let on_b = stash.lock().unwrap().on_b.clone();
    let (bytes_refused, forward, release, to_established) = on_b.unwrap();
    assert!(to_established, "B's own connection was fine");
    assert!(bytes_refused, "B's held_bytes gave A's receive slot");
    assert_eq!(forward, "Foreign", "B's forward");
    assert!(
        release.starts_with("Err((Foreign, HeldRecv"),
        "B's release hands it back: {release}"
    );

    turn_until(
        &mut [&mut a, &mut b],
        "A to release the message B gave back",
        |_| stash.lock().unwrap().on_a.is_some(),
    );
    let (intact, release) = stash.lock().unwrap().on_a.clone().unwrap();
    assert!(intact, "A still reads the message B tried");
    assert_eq!(release, "Ok(())", "A releases it");
    assert_eq!((ignored(&a), ignored(&b)), ((0, 0), (0, 0)));
}

fn held_receive_after_removal(srq: bool) {
    const MAX: usize = 256;
    let pd = loopback_pd();
    let mut reactor = new_reactor(&pd, srq);
    let stash = Arc::new(Mutex::new(Stash::default()));
    let holder = Holder::new(&stash, MAX);
    let (first, second) = add_pair(
        &pd,
        &mut reactor,
        Box::new(holder),
        Box::new(Streamer::new(4, MAX, Arc::default())),
    );
    turn_until(&mut [&mut reactor], "a held message", |_| {
        !stash.lock().unwrap().held.is_empty()
    });
    let held = stash.lock().unwrap().held.remove(0);
    let stale = held.conn();

    // The sessions go, and new ones take their slots (with a new generation).
    assert!(reactor.remove(first).is_some() && reactor.remove(second).is_some());
    // A pass that polls the CQs empty releases the removed connections'
    // entries from quarantine (stale completions may name them until then).
    reactor.poll_once().unwrap();
    let (tx, rx) = mpsc::channel();
    let probe = on_established(move |ctx, conn| {
        let bytes = ctx.held_bytes(&held).is_none();
        let (forward, held) = match ctx.forward(conn, held, None) {
            Err((error, held)) => (format!("{error:?}"), held),
            Ok(seq) => panic!("a stale held message was forwarded as {seq}"),
        };
        let release = format!("{:?}", ctx.release(held));
        tx.send((bytes, forward, release)).unwrap();
    });
    add_pair(&pd, &mut reactor, probe, quiet());
    let reused = conns_of(&reactor);
    assert!(
        reused
            .iter()
            .any(|conn| conn.slot() == stale.slot() && *conn != stale),
        "{stale:?} has a successor among {reused:?}"
    );

    let (bytes_refused, forward, release) =
        turn_until_received(&mut [&mut reactor], "the probe", &rx);
    assert!(bytes_refused, "held_bytes of a removed connection's slot");
    assert_eq!(forward, "Foreign");
    // Its own reactor takes it back: an SRQ slot returns to the SRQ, a slot
    // of the removed connection's own ring needs nothing.
    assert_eq!(release, "Ok(())");
}

#[test]
fn a_held_receive_is_refused_after_its_session_is_removed_and_its_slot_reused() {
    held_receive_after_removal(false);
}

#[test]
fn a_held_srq_receive_is_refused_after_its_session_is_removed_and_its_slot_reused() {
    held_receive_after_removal(true);
}

/// Stages WRITEs from regions it drops right after staging.
struct DroppingWriter {
    pd: ProtectionDomain,
    peer_inbox: RemoteRegion,
    /// (offset in the peer's inbox, length) of each WRITE.
    writes: Vec<(usize, usize)>,
    completed: usize,
    done: mpsc::Sender<Result<usize, String>>,
}

impl Handler for DroppingWriter {
    fn on_established(&mut self, ctx: &mut Ctx<'_>, conn: ConnId) {
        for (i, &(offset, len)) in self.writes.iter().enumerate() {
            let mut source = self.pd.alloc_mr(len, AccessFlags::LOCAL_WRITE).unwrap();
            source.write(0, &pattern(i as u8, len)).unwrap();
            let local = source.slice(0, len).unwrap();
            let remote = self.peer_inbox.slice(offset as u64, len as u64).unwrap();
            ctx.write(conn, &local, remote, None).expect("staged");
            // Deregistered and unmapped now, unless the reactor kept it.
            drop(source);
        }
        ctx.signal_staged(conn);
    }

    fn on_message(&mut self, _: &mut Ctx<'_>, _: ConnId, _: &[u8], _: Option<u32>) {}

    fn on_write_complete(&mut self, _: &mut Ctx<'_>, _: ConnId, _: u32) {
        self.completed += 1;
        if self.completed == self.writes.len() {
            let _ = self.done.send(Ok(self.completed));
        }
    }

    fn on_error(&mut self, _: &mut Ctx<'_>, _: ConnId, error: &Error) {
        let _ = self.done.send(Err(error.to_string()));
    }
}

// Guest only: a NIC reads the source after the post returns; loopback copies inside it.
verbs_test! {
    fn a_write_completes_after_its_region_is_dropped() {
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        let mut reactor: Reactor<BoxedHandler> = Reactor::new(&pd, reactor_config(false)).unwrap();
        let inbox = Arc::new(pd.alloc_mr(16 * 1024, AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND).unwrap());
        let (server_ep, client_ep) = connect(&pd, &mut Sides::One(&mut reactor), &inbox, &inbox);
        // Inline-sized WRITEs (the provider copies the payload when the
        // doorbell rings, after the drop) and larger ones (the NIC reads it).
        let writes: Vec<(usize, usize)> =
            (0..16).map(|i| (i * 1024, if i % 2 == 0 { 32 } else { 1000 })).collect();
        let (tx, rx) = mpsc::channel();
        let writer = DroppingWriter {
            pd: pd.clone(),
            peer_inbox: client_ep.remote_region("inbox").expect("the server's inbox"),
            writes: writes.clone(),
            completed: 0,
            done: tx,
        };
        reactor.add(server_ep, quiet()).unwrap();
        reactor.add(client_ep, Box::new(writer)).unwrap();
        let outcome = turn_until_received(&mut [&mut reactor], "the WRITEs", &rx);
        assert_eq!(outcome, Ok(writes.len()), "every WRITE completed without an error");
        for (i, &(offset, len)) in writes.iter().enumerate() {
            assert_eq!(read_back(&inbox, offset, len), pattern(i as u8, len), "WRITE {i}");
        }
    }
}

#[test]
fn session_ids_are_reused_and_stale_conn_ids_are_closed() {
    let pd = loopback_pd();
    let mut reactor = new_reactor(&pd, false);
    let old_sessions = add_pair(&pd, &mut reactor, quiet(), quiet());
    let old_conns = conns_of(&reactor);
    for session in [old_sessions.0, old_sessions.1] {
        assert!(reactor.remove(session).is_some());
        assert!(reactor.remove(session).is_none(), "removed twice");
        assert!(reactor.handler(session).is_none() && reactor.link(session).is_none());
        assert_eq!(reactor.conns(session).count(), 0);
    }
    for &conn in &old_conns {
        assert!(reactor.conn_stats(conn).is_none(), "{conn:?}");
    }
    // The removed connections' entries wait in quarantine until a pass
    // has polled every CQ empty.
    reactor.poll_once().unwrap();

    let (tx, rx) = mpsc::channel();
    let stale = (old_conns.clone(), old_sessions.0);
    let probe = on_established(move |ctx, conn| {
        let mut seen = Vec::new();
        for &old in &stale.0 {
            seen.push((
                format!("{:?}", ctx.send(old, b"to a removed connection", None)),
                ctx.session_of(old),
                ctx.is_established(old),
                ctx.max_payload(old),
            ));
        }
        // Asks for a removal the reactor must ignore: that session is gone.
        ctx.remove_session(stale.1);
        let len = stream_len(0, 64);
        let sent = ctx
            .send_with(conn, len, Some(0), |buf| fill(buf, 0))
            .is_ok();
        tx.send((seen, sent)).unwrap();
    });
    let sink_outcome = Arc::new(Outcome::default());
    let sink = Box::new(Sink::new(1, 64, Arc::clone(&sink_outcome)));
    let new_sessions = add_pair(&pd, &mut reactor, probe, sink);
    for (old, new) in [
        (old_sessions.0, new_sessions.0),
        (old_sessions.1, new_sessions.1),
    ] {
        assert_ne!(old, new, "a new session gets a new id");
    }
    let slots = |(a, b): (SessionId, SessionId)| {
        let mut slots = [a.slot(), b.slot()];
        slots.sort_unstable();
        slots
    };
    let (old_slots, new_slots) = (slots(old_sessions), slots(new_sessions));
    assert_eq!(old_slots, new_slots, "session slots are reused");
    let new_conns = conns_of(&reactor);
    for old in &old_conns {
        let successor = new_conns
            .iter()
            .any(|new| new.slot() == old.slot() && new != old);
        assert!(successor, "{old:?} has a successor among {new_conns:?}");
    }

    let (seen, sent) = turn_until_received(&mut [&mut reactor], "the probe", &rx);
    for (old, (send, session, established, max_payload)) in old_conns.iter().zip(seen) {
        assert_eq!(send, "Err(Closed)", "send on stale {old:?}");
        assert_eq!(
            (session, established, max_payload),
            (None, false, 0),
            "{old:?}"
        );
    }
    assert!(sent, "the new connection sends");
    turn_until(&mut [&mut reactor], "the new session's message", |_| {
        sink_outcome.finished.load(Ordering::Acquire)
    });
    assert_eq!(sink_outcome.bad.load(Ordering::Relaxed), 0);
    assert_eq!(
        reactor.sessions().count(),
        2,
        "the stale removal request was ignored"
    );
}

#[test]
fn ids_of_one_reactor_are_refused_by_another() {
    let pd = loopback_pd();
    let mut a = new_reactor(&pd, false);
    let mut b = new_reactor(&pd, false);
    let (a_session, _) = add_pair(&pd, &mut a, quiet(), quiet());
    let (b_session, _) = add_pair(&pd, &mut b, quiet(), quiet());
    let a_conn = a.conns(a_session).next().unwrap();
    let b_conn = b.conns(b_session).next().unwrap();
    assert_eq!(
        a_conn.slot(),
        b_conn.slot(),
        "both reactors use the same slots"
    );
    // B knows nothing of A's ids, however alike they look.
    assert!(b.conn_stats(a_conn).is_none());
    assert!(b.handler(a_session).is_none() && b.link(a_session).is_none());
    assert_eq!(b.conns(a_session).count(), 0);
    assert!(b.remove(a_session).is_none(), "B removed nothing");
    assert!(b.conn_stats(b_conn).is_some() && a.conn_stats(a_conn).is_some());
    // Nor does a callback of B reach B's connection through A's id.
    let (tx, rx) = mpsc::channel();
    let probe = on_established(move |ctx, _| {
        let sent = ctx.send(a_conn, b"to the wrong peer", None);
        tx.send(format!("{sent:?}")).unwrap();
    });
    add_pair(&pd, &mut b, probe, quiet());
    let sent = turn_until_received(&mut [&mut b], "the probe", &rx);
    assert_eq!(sent, "Err(Closed)");
}
