//! The reactor's datagram endpoints on one device: a ping-pong between two
//! endpoints with the source each datagram claims, a sender that outruns
//! its send queue (refused for room, never stalled), a multicast group,
//! the refusals (size, another PD's destination, another reactor's
//! endpoint), removal, and the echoes of a burst sharing a doorbell. Gated
//! as described in `tests/util/mod.rs`: runs in the Soft-RoCE guest.

mod util;

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use rdma_comm_core::Error;
use rdma_comm_core::reactor::*;
use rdma_comm_core::verbs::*;
use util::*;

/// What one endpoint's handler does and has seen.
#[derive(Default)]
struct Peer {
    /// Where it sends: set once both endpoints exist.
    to: Option<UdDestination>,
    /// The QP number its datagrams must claim to come from.
    expect_qpn: Option<u32>,
    /// Reply to each datagram with the same bytes.
    echo: bool,
    /// Send this many in all from `on_idle`, as fast as the queue takes them.
    burst: u64,
    /// Ping-pong round trips to make (the pinger sends the first from `on_idle`).
    rounds: u64,
    sent: u64,
    received: u64,
    refused_for_room: u64,
    wrong_source: u64,
    altered: u64,
    /// The next ping's number, and whether one is out.
    next: u64,
    waiting: bool,
    errors: u64,
    /// Remove its own endpoint from the callback of this many-th datagram.
    remove_at: Option<u64>,
}

impl Handler for Peer {
    fn on_message(&mut self, _: &mut Ctx<'_>, _: ConnId, _: &[u8], _: Option<u32>) {}

    fn on_datagram(
        &mut self,
        ctx: &mut Ctx<'_>,
        dgram: DatagramId,
        source: &DatagramSource<'_>,
        data: &[u8],
    ) {
        self.received += 1;
        if self.remove_at == Some(self.received) {
            ctx.remove_datagram(dgram);
        }
        if self.expect_qpn.is_some_and(|qpn| qpn != source.qpn()) || source.gid().is_none() {
            self.wrong_source += 1;
        }
        if self.echo {
            let to = self.to.as_ref().expect("a destination");
            ctx.send_datagram(dgram, to, data)
                .expect("an echo goes out");
            return;
        }
        if self.rounds > 0 && data != self.next.to_le_bytes() {
            self.altered += 1;
        }
        self.next += 1;
        self.waiting = false;
    }

    fn on_datagram_error(&mut self, _: &mut Ctx<'_>, _: DatagramId, error: &Error) {
        eprintln!("datagram endpoint failed: {error}");
        self.errors += 1;
    }

    fn on_idle(&mut self, ctx: &mut Ctx<'_>) -> Idle {
        let Some(to) = self.to.as_ref() else {
            return Idle::Again;
        };
        let Some(dgram) = DGRAM.with(|d| d.get()) else {
            return Idle::Again;
        };
        if self.rounds > 0 && !self.waiting && self.next < self.rounds {
            ctx.send_datagram(dgram, to, &self.next.to_le_bytes())
                .expect("a ping goes out");
            self.sent += 1;
            self.waiting = true;
        }
        while self.sent < self.burst {
            match ctx.send_datagram(dgram, to, &self.sent.to_le_bytes()) {
                Ok(()) => self.sent += 1,
                Err(SendError::WouldBlock) => {
                    self.refused_for_room += 1;
                    break;
                }
                Err(other) => panic!("a burst datagram: {other}"),
            }
        }
        Idle::Again
    }
}

thread_local! {
    /// The endpoint whose handler sends from `on_idle` (one per test thread).
    static DGRAM: std::cell::Cell<Option<DatagramId>> = const { std::cell::Cell::new(None) };
}

fn reactor(pd: &ProtectionDomain) -> Reactor<Peer> {
    Reactor::new(pd, ReactorConfig::default()).expect("a reactor")
}

fn run_until(
    reactor: &mut Reactor<Peer>,
    limit: Duration,
    mut done: impl FnMut(&Reactor<Peer>) -> bool,
) {
    let start = Instant::now();
    while !done(reactor) {
        assert!(start.elapsed() < limit, "stalled: {:?}", reactor.counters());
        reactor.turn().expect("a pass");
    }
}

/// Two endpoints of one reactor, each handler with a destination to the other.
fn pair(reactor: &mut Reactor<Peer>, a: Peer, b: Peer) -> (DatagramId, DatagramId) {
    let config = UdConfig::default();
    let a = reactor
        .add_datagram(&config, |_, _| Ok(a))
        .expect("endpoint a");
    let b = reactor
        .add_datagram(&config, |_, _| Ok(b))
        .expect("endpoint b");
    let (qp_a, qp_b) = (
        reactor.datagram_qp(a).expect("a"),
        reactor.datagram_qp(b).expect("b"),
    );
    let (to_b, to_a) = (
        qp_a.destination(&qp_b.endpoint()).expect("a to b"),
        qp_b.destination(&qp_a.endpoint()).expect("b to a"),
    );
    let (qpn_a, qpn_b) = (qp_a.qpn(), qp_b.qpn());
    let peer_a = reactor.datagram_handler_mut(a).expect("a's handler");
    peer_a.to = Some(to_b);
    peer_a.expect_qpn = Some(qpn_b);
    let peer_b = reactor.datagram_handler_mut(b).expect("b's handler");
    peer_b.to = Some(to_a);
    peer_b.expect_qpn = Some(qpn_a);
    (a, b)
}

verbs_test! {
    fn two_endpoints_ping_pong_and_each_datagram_names_its_source() {
        let ctx = open_device();
        let pd = ctx.alloc_pd().expect("a PD");
        let mut reactor = reactor(&pd);
        const ROUNDS: u64 = 2_000;
        let pinger = Peer { rounds: ROUNDS, ..Peer::default() };
        let echo = Peer { echo: true, ..Peer::default() };
        let (a, b) = pair(&mut reactor, pinger, echo);
        DGRAM.with(|d| d.set(Some(a)));
        run_until(&mut reactor, Duration::from_secs(60), |r| {
            r.datagram_handler(a).is_some_and(|p| p.next == ROUNDS)
        });
        let (pinger, echo) = (reactor.datagram_handler(a).unwrap(), reactor.datagram_handler(b).unwrap());
        assert_eq!((pinger.received, echo.received), (ROUNDS, ROUNDS));
        assert_eq!((pinger.altered, pinger.wrong_source, echo.wrong_source), (0, 0, 0));
        assert_eq!(pinger.errors + echo.errors, 0);
        let counters = reactor.counters();
        assert_eq!(counters.datagrams, 2 * ROUNDS);
        assert!(counters.requests >= 2 * ROUNDS, "{counters:?}");
    }
}

/// Endpoint `a` on reactor `ra` and `b` on `rb`, so that each reactor's
/// CQs hold only its own endpoint's completions; `b`'s handler gets a
/// destination to `a`. Returns `a`, `b` and a destination to `b`.
fn apart(
    ra: &mut Reactor<Peer>,
    rb: &mut Reactor<Peer>,
    a: Peer,
    b: Peer,
) -> (DatagramId, DatagramId, UdDestination) {
    let config = UdConfig::default();
    let a = ra.add_datagram(&config, |_, _| Ok(a)).expect("endpoint a");
    let b = rb.add_datagram(&config, |_, _| Ok(b)).expect("endpoint b");
    let (qp_a, qp_b) = (ra.datagram_qp(a).expect("a"), rb.datagram_qp(b).expect("b"));
    let to_b = qp_a.destination(&qp_b.endpoint()).expect("a to b");
    let to_a = qp_b.destination(&qp_a.endpoint()).expect("b to a");
    rb.datagram_handler_mut(b).expect("b's handler").to = Some(to_a);
    (a, b, to_b)
}

/// Datagrams of a burst that [`land_burst`] leaves on the receiver's CQ.
const LANDED: u64 = 8;

/// Sends `LANDED` datagrams from endpoint `a` of reactor `ra` to `to`,
/// posted by one pass of `ra` in one doorbell, then waits 2 s for the
/// device to land them on the receiver's CQ: they wait there, unpolled
/// (nothing shows them without polling, which the test's next pass must
/// do first).
fn land_burst(ra: &mut Reactor<Peer>, a: DatagramId, to: &UdDestination) {
    ra.with_ctx(|ctx| {
        for n in 0..LANDED {
            ctx.send_datagram(a, to, &n.to_le_bytes())
                .expect("a burst datagram");
        }
    });
    ra.turn().expect("a's pass");
    std::thread::sleep(Duration::from_secs(2));
}

verbs_test! {
    fn a_removed_endpoints_landed_datagrams_are_stale_not_foreign() {
        let ctx = open_device();
        let pd = ctx.alloc_pd().expect("a PD");
        let (mut ra, mut rb) = (reactor(&pd), reactor(&pd));
        let (a, b, to_b) = apart(&mut ra, &mut rb, Peer::default(), Peer::default());
        land_burst(&mut ra, a, &to_b);
        let before = rb.counters();
        let receiver = rb.remove_datagram(b).expect("b's handler");
        assert_eq!(receiver.received, 0, "none polled before the removal");
        // The next pass polls what the destroyed QP left on the CQ: each
        // counted, none delivered. Soft-RoCE leaves the whole burst there; a
        // provider that cleans a destroyed QP's completions from its CQ
        // (mlx5) leaves none.
        for _ in 0..4 {
            rb.poll_once().expect("a pass");
        }
        let after = rb.counters();
        let stale = after.stale_completions - before.stale_completions;
        if ctx.name().starts_with("rxe") {
            assert_eq!(stale, LANDED, "{after:?}");
        } else {
            assert!(stale <= LANDED, "{after:?}");
        }
        assert_eq!(after.foreign_completions, before.foreign_completions, "none a stranger's");
        assert_eq!(after.datagrams, before.datagrams, "none delivered");
    }
}

verbs_test! {
    fn the_echoes_of_a_burst_found_by_one_pass_share_one_doorbell() {
        let ctx = open_device();
        let pd = ctx.alloc_pd().expect("a PD");
        let (mut ra, mut rb) = (reactor(&pd), reactor(&pd));
        let echo = Peer { echo: true, ..Peer::default() };
        let (a, _, to_b) = apart(&mut ra, &mut rb, Peer::default(), echo);
        // A burst waits on b's CQ; one pass finds it, and each datagram's
        // callback echoes it: the echoes go in one doorbell.
        land_burst(&mut ra, a, &to_b);
        let before = rb.counters();
        rb.poll_once().expect("b's pass");
        let after = rb.counters();
        assert_eq!(after.datagrams - before.datagrams, LANDED, "the burst arrived before the pass");
        assert_eq!(after.requests - before.requests, LANDED, "every echo went out");
        assert_eq!(after.doorbells - before.doorbells, 1, "in one doorbell");
        run_until(&mut ra, Duration::from_secs(30), |r| {
            r.datagram_handler(a).is_some_and(|p| p.received == LANDED)
        });
        assert_eq!(ra.datagram_handler(a).unwrap().errors, 0);
    }
}

verbs_test! {
    fn a_sender_that_outruns_its_send_queue_is_refused_for_room_and_never_stalls() {
        let ctx = open_device();
        let pd = ctx.alloc_pd().expect("a PD");
        let mut reactor = reactor(&pd);
        const BURST: u64 = 50_000;
        let sender = Peer { burst: BURST, ..Peer::default() };
        let (a, b) = pair(&mut reactor, sender, Peer::default());
        DGRAM.with(|d| d.set(Some(a)));
        run_until(&mut reactor, Duration::from_secs(120), |r| {
            r.datagram_handler(a).is_some_and(|p| p.sent == BURST)
        });
        // What is in flight lands (or is dropped) within a few passes.
        for _ in 0..1_000 {
            reactor.turn().expect("a pass");
        }
        let (sender, receiver) = (reactor.datagram_handler(a).unwrap(), reactor.datagram_handler(b).unwrap());
        assert!(sender.refused_for_room > 0, "the send queue filled at least once");
        assert!(receiver.received > 0 && receiver.received <= BURST, "{}", receiver.received);
        assert_eq!(receiver.wrong_source, 0);
        assert_eq!(sender.errors + receiver.errors, 0);
        let counters = reactor.counters();
        assert!(counters.doorbells < BURST, "datagrams share doorbells: {counters:?}");
    }
}

verbs_test! {
    fn a_datagram_to_a_joined_group_reaches_the_member() {
        let ctx = open_device();
        let pd = ctx.alloc_pd().expect("a PD");
        let mut reactor = reactor(&pd);
        let config = UdConfig::default();
        let group = Gid::from_ipv4(Ipv4Addr::new(239, 1, 2, 3));
        let member = reactor.add_datagram(&config, |_, _| Ok(Peer::default())).expect("a member");
        reactor.join(member, group).expect("joined");
        // The publisher is made with its destination, from its own QP.
        let mut told = None;
        let publisher = reactor
            .add_datagram(&config, |id, qp| {
                told = Some(id);
                let to = Some(qp.group_destination(group)?);
                Ok(Peer { rounds: 1, to, ..Peer::default() })
            })
            .expect("a publisher");
        assert_eq!(told, Some(publisher), "the handler is made with its endpoint's id");
        DGRAM.with(|d| d.set(Some(publisher)));
        run_until(&mut reactor, Duration::from_secs(30), |r| {
            r.datagram_handler(member).is_some_and(|p| p.received == 1)
        });
        reactor.leave(member, group).expect("left");
        assert!(reactor.leave(member, group).is_err(), "not a member any more");
    }
}

verbs_test! {
    fn what_an_endpoint_cannot_send_is_refused() {
        let ctx = open_device();
        let pd = ctx.alloc_pd().expect("a PD");
        let mut reactor = reactor(&pd);
        let (a, _) = pair(&mut reactor, Peer::default(), Peer::default());
        let mtu = reactor.datagram_qp(a).unwrap().max_datagram() as usize;
        let to = reactor.datagram_handler_mut(a).unwrap().to.take().expect("a destination");
        let other_pd = ctx.alloc_pd().expect("another PD");
        let mut other = Reactor::<Peer>::new(&other_pd, ReactorConfig::default()).expect("another reactor");
        let foreign = other.add_datagram(&UdConfig::default(), |_, _| Ok(Peer::default())).expect("its endpoint");
        let foreign_to = other.datagram_qp(foreign).unwrap().destination(&reactor.datagram_qp(a).unwrap().endpoint()).expect("to a");
        reactor.with_ctx(|ctx| {
            let big = vec![0u8; mtu + 1];
            assert!(matches!(ctx.send_datagram(a, &to, &big), Err(SendError::TooLarge { .. })));
            assert!(matches!(ctx.send_datagram(a, &foreign_to, b"x"), Err(SendError::Invalid(_))));
            assert!(matches!(ctx.send_datagram(foreign, &to, b"x"), Err(SendError::Closed)));
            ctx.send_datagram(a, &to, &vec![7u8; mtu]).expect("a datagram of the MTU");
        });
        assert!(other.datagram_qp(a).is_none(), "another reactor's id names nothing");
        let before = reactor.memory();
        let refused = reactor.add_datagram(&UdConfig::default(), |_, _| Err(Error::InvalidArgument("no handler")));
        assert!(matches!(refused, Err(Error::InvalidArgument("no handler"))), "the handler's error");
        assert_eq!(reactor.memory(), before, "nothing of the refused endpoint is kept");
        let small = UdConfig { max_send_wr: 1, ..UdConfig::default() };
        assert!(matches!(reactor.add_datagram(&small, |_, _| Ok(Peer::default())), Err(Error::InvalidArgument(_))));
    }
}

verbs_test! {
    fn a_removed_endpoint_is_gone_and_its_id_names_nothing() {
        let ctx = open_device();
        let pd = ctx.alloc_pd().expect("a PD");
        let mut reactor = reactor(&pd);
        let empty = reactor.memory();
        const BURST: u64 = 5_000;
        let sender = Peer { burst: BURST, ..Peer::default() };
        let (a, b) = pair(&mut reactor, sender, Peer::default());
        DGRAM.with(|d| d.set(Some(a)));
        run_until(&mut reactor, Duration::from_secs(60), |r| {
            r.datagram_handler(b).is_some_and(|p| p.received > 0)
        });
        // The receiver goes while the sender's burst to it is in flight.
        let receiver = reactor.remove_datagram(b).expect("the handler comes back");
        assert!(receiver.received > 0);
        assert!(reactor.remove_datagram(b).is_none(), "removed once");
        assert!(reactor.datagram_qp(b).is_none() && reactor.datagram_handler(b).is_none());
        assert!(reactor.join(b, Gid::from_ipv4(Ipv4Addr::new(239, 1, 2, 4))).is_err());
        // The rest of the burst goes to a QP that is gone: dropped, as any
        // datagram nobody receives, and nothing fails or stalls.
        run_until(&mut reactor, Duration::from_secs(120), |r| {
            r.datagram_handler(a).is_some_and(|p| p.sent == BURST)
        });
        let to = reactor.datagram_handler_mut(a).unwrap().to.take().expect("a destination");
        reactor.with_ctx(|ctx| {
            assert!(matches!(ctx.send_datagram(b, &to, b"x"), Err(SendError::Closed)));
        });
        reactor.datagram_handler_mut(a).unwrap().to = Some(to);
        assert_eq!(reactor.datagram_handler(a).unwrap().errors, 0);
        // A callback's removal waits for the end of its pass; the sender
        // goes with sends in flight, whose completions left on the CQ are
        // counted stale, never a stranger's.
        reactor.datagram_handler_mut(a).unwrap().burst = 2 * BURST;
        reactor.turn().expect("a pass");
        reactor.with_ctx(|ctx| ctx.remove_datagram(a));
        assert!(reactor.datagram_qp(a).is_some(), "removed when the pass ends");
        reactor.turn().expect("a pass");
        assert!(reactor.datagram_qp(a).is_none());
        for _ in 0..100 {
            reactor.turn().expect("a pass");
        }
        assert_eq!(reactor.counters().foreign_completions, 0);
        assert_eq!(reactor.memory(), empty, "nothing of either endpoint is kept");
        // Ids are never reused; a new endpoint works beside the gone ones.
        let (c, d) = pair(&mut reactor, Peer { rounds: 10, ..Peer::default() }, Peer { echo: true, ..Peer::default() });
        assert!(![a, b].contains(&c) && ![a, b].contains(&d));
        DGRAM.with(|cell| cell.set(Some(c)));
        run_until(&mut reactor, Duration::from_secs(30), |r| {
            r.datagram_handler(c).is_some_and(|p| p.next == 10)
        });
    }
}

verbs_test! {
    fn a_handler_removes_its_own_endpoint_from_its_callback() {
        let ctx = open_device();
        let pd = ctx.alloc_pd().expect("a PD");
        let mut reactor = reactor(&pd);
        const BURST: u64 = 2_000;
        let sender = Peer { burst: BURST, ..Peer::default() };
        let receiver = Peer { remove_at: Some(10), ..Peer::default() };
        let (a, b) = pair(&mut reactor, sender, receiver);
        DGRAM.with(|d| d.set(Some(a)));
        let requests = reactor.counters().requests;
        run_until(&mut reactor, Duration::from_secs(60), |r| r.datagram_qp(b).is_none());
        assert!(reactor.datagram_handler(b).is_none(), "dropped with its endpoint");
        run_until(&mut reactor, Duration::from_secs(60), |r| {
            r.datagram_handler(a).is_some_and(|p| p.sent == BURST)
        });
        assert_eq!(reactor.datagram_handler(a).unwrap().errors, 0);
        let counters = reactor.counters();
        assert!(counters.requests >= requests + BURST, "{counters:?}");
        assert!(counters.datagrams >= 10, "{counters:?}");
        let before = counters.requests;
        assert!(reactor.remove_datagram(a).is_some());
        assert!(reactor.counters().requests >= before, "a removed endpoint's posts still count");
    }
}

verbs_test! {
    fn a_removed_endpoints_cq_room_comes_free_after_the_next_pass() {
        let ctx = open_device();
        let pd = ctx.alloc_pd().expect("a PD");
        let config = ReactorConfig { cq_count: 1, cq_size: 256, ..ReactorConfig::default() };
        let mut reactor = Reactor::<Peer>::new(&pd, config).expect("a reactor");
        let small = UdConfig { max_send_wr: 32, max_recv_wr: 32, ..UdConfig::default() };
        let add = |reactor: &mut Reactor<Peer>| reactor.add_datagram(&small, |_, _| Ok(Peer::default()));
        reactor.poll_once().expect("a pass");
        let mut added = Vec::new();
        while let Ok(id) = add(&mut reactor) {
            added.push(id);
            assert!(added.len() < 64, "the CQ never filled");
        }
        assert!(added.len() >= 2, "{} endpoints fit", added.len());
        let last = added.pop().unwrap();
        assert!(reactor.remove_datagram(last).is_some());
        // What its QP left on the CQ is polled by the next pass: until then
        // its room is not handed out again.
        assert!(matches!(add(&mut reactor), Err(Error::InvalidArgument(_))), "held until a pass");
        reactor.turn().expect("a pass");
        let again = add(&mut reactor).expect("room once a pass polled");
        assert!(again != last, "ids are never reused");
    }
}

verbs_test! {
    fn a_removed_endpoints_place_is_taken_again_after_a_pass_with_a_new_id() {
        let ctx = open_device();
        let pd = ctx.alloc_pd().expect("a PD");
        let config = ReactorConfig { cq_count: 1, cq_size: 4096, ..ReactorConfig::default() };
        let mut reactor = Reactor::<Peer>::new(&pd, config).expect("a reactor");
        let tiny = UdConfig { max_send_wr: 4, max_recv_wr: 4, ..UdConfig::default() };
        let add = |reactor: &mut Reactor<Peer>| reactor.add_datagram(&tiny, |_, _| Ok(Peer::default()));
        reactor.poll_once().expect("a pass");
        let mut ids: Vec<DatagramId> = (0..64).map(|_| add(&mut reactor).expect("one of 64")).collect();
        assert!(add(&mut reactor).is_err(), "64 at once");
        let gone = ids.swap_remove(10);
        assert!(reactor.remove_datagram(gone).is_some());
        assert!(add(&mut reactor).is_err(), "its place is free once the next pass began");
        reactor.poll_once().expect("a pass");
        let taken = add(&mut reactor).expect("its place again");
        assert!(taken != gone && !ids.contains(&taken), "a new id");
        assert!(reactor.datagram_qp(gone).is_none(), "the old id names nothing");
        assert!(reactor.remove_datagram(gone).is_none());
        assert!(reactor.datagram_qp(taken).is_some());
        // A reactor that serves for months adds and removes at will, the
        // other 63 places taken all along.
        let mut seen = ids.clone();
        seen.extend([gone, taken]);
        let mut last = taken;
        for _ in 0..200 {
            assert!(reactor.remove_datagram(last).is_some());
            assert!(add(&mut reactor).is_err(), "its place is held until a pass");
            reactor.poll_once().expect("a pass");
            last = add(&mut reactor).expect("its place");
            assert!(!seen.contains(&last), "{last:?} came back");
            seen.push(last);
        }
        assert_eq!(reactor.counters().foreign_completions, 0);
    }
}
