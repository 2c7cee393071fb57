//! Peers that ignore their credits on a reactor's shared receive queue:
//! such a peer is cut off with `Error::CreditOverrun`, the
//! SRQ receives it took come back, and the other peers keep streaming. And
//! the other side of the rule: peers that keep to their credits, however
//! close to the limit a slow, holding or forwarding receiver drives them,
//! are never cut off. And a peer whose SENDs break the protocol (no
//! immediate, an unknown kind) is cut off with `Error::MalformedMessage`
//! and its SRQ receive comes back. Gated as described in
//! `tests/util/mod.rs`.
//!
//! The rates and counts they print go straight to stderr
//! (`writeln!(std::io::stderr())`): the test harness captures `eprintln!`,
//! and these figures are meant to show when the tests pass.
#![allow(clippy::explicit_write)]

mod util;

use std::collections::VecDeque;
use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use rdma_comm_core::Error;
use rdma_comm_core::reactor::*;
use rdma_comm_core::session::*;
use rdma_comm_core::verbs::*;
use util::reactor::*;
use util::*;

/// Hang guard of every wait below (not a speed target: no assertion is
/// about time).
const RUN_DEADLINE: Duration = Duration::from_secs(240);
/// Each connection's share of the SRQ: the credits its peer gets.
const SHARE: u32 = 64;
/// Three shares: the honest streamer's sink, the hostile peer, and a third
/// peer added after the attack.
const SRQ_DEPTH: u32 = 3 * SHARE;
const SLOT: usize = 1024;
/// Messages of each honest stream, of up to `MAX` bytes.
const STREAM: u64 = 10_000;
const MAX: usize = 1000;
/// Receives the hostile peer posts (and claims in its SENDs' immediates)
/// for the reactor's credit updates, which it never needs to repost.
const HOSTILE_RECVS: u32 = 256;
/// The hostile peer's SENDs: this much payload, with the reactor's
/// immediate (a message, claiming `HOSTILE_RECVS` receives).
const HOSTILE_PAYLOAD: usize = 64;

fn srq_config() -> ReactorConfig {
    ReactorConfig {
        srq_depth: SRQ_DEPTH,
        recv_depth: SHARE,
        slot_size: SLOT,
        send_slots: 64,
        signal_interval: 8,
        ..Default::default()
    }
}

fn peer_config() -> ReactorConfig {
    ReactorConfig {
        srq_depth: 0,
        ..srq_config()
    }
}

/// What the reactor's side of the hostile connection saw.
#[derive(Default)]
struct Seen {
    /// Messages delivered to `on_message`.
    delivered: AtomicU64,
    /// Every `on_error`, as text.
    errors: Mutex<Vec<String>>,
    /// The fields of a `CreditOverrun`: (qpn, granted, consumed, share).
    overrun: Mutex<Option<(u32, u32, u32, u32)>>,
    /// The peer the `CreditOverrun` named (`Error::peer`).
    peer: Mutex<Option<std::net::SocketAddr>>,
}

/// The reactor's handler of the hostile peer's connection: an ordinary
/// consumer, or (`hold`) one that keeps every message, like a relay whose
/// downstream is stuck, so the peer's grant never grows past its share.
struct HostileSide {
    seen: Arc<Seen>,
    hold: bool,
    held: Vec<HeldRecv>,
}

impl Handler for HostileSide {
    fn on_message(&mut self, ctx: &mut Ctx<'_>, _: ConnId, data: &[u8], _: Option<u32>) {
        assert_eq!(data.len(), HOSTILE_PAYLOAD, "the hostile peer's payload");
        self.seen.delivered.fetch_add(1, Ordering::Relaxed);
        if self.hold {
            self.held.push(ctx.hold().expect("in on_message"));
        }
    }

    fn on_error(&mut self, ctx: &mut Ctx<'_>, _: ConnId, error: &Error) {
        self.seen.errors.lock().unwrap().push(error.to_string());
        if let Error::CreditOverrun {
            qpn,
            granted,
            consumed,
            share,
            ..
        } = *error
        {
            *self.seen.overrun.lock().unwrap() = Some((qpn, granted, consumed, share));
            *self.seen.peer.lock().unwrap() = error.peer();
        }
        // What it held goes back to the SRQ although the connection is dead.
        for held in self.held.drain(..) {
            ctx.release(held).expect("a held receive of this reactor");
        }
    }
}

/// Peer H: a raw QP driven through the verbs API, no reactor. It posts
/// 64-byte SENDs whose immediate looks like the reactor's (a message and a
/// receive count), as fast as its send queue takes them, whatever credits
/// it was given.
struct Flood {
    endpoint: Endpoint,
    message: MemoryRegion,
    _inbox: MemoryRegion,
    depth: u32,
    in_flight: u32,
    posted: u64,
    acked: u64,
    /// Credit updates the reactor sent it.
    updates: u64,
    /// The first failed completion or post: the peer saw its connection die.
    failure: Option<String>,
    wcs: [WorkCompletion; 32],
}

const RECV_ID: u64 = 1 << 63;

impl Flood {
    fn new(pd: &ProtectionDomain, mut endpoint: Endpoint) -> Self {
        let mut message = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
        message.write(0, &pattern(7, HOSTILE_PAYLOAD)).unwrap();
        let inbox = pd
            .alloc_mr(HOSTILE_RECVS as usize * 64, AccessFlags::LOCAL_WRITE)
            .unwrap();
        let qp = endpoint.qps_mut()[0].qp_mut();
        for i in 0..HOSTILE_RECVS as usize {
            let local = inbox.slice(i * 64, 64).unwrap();
            qp.post_recv(&mut RecvRequest::new(RECV_ID | i as u64, local).unwrap())
                .unwrap();
        }
        let depth = qp.max_send_wr();
        Self {
            endpoint,
            message,
            _inbox: inbox,
            depth,
            in_flight: 0,
            posted: 0,
            acked: 0,
            updates: 0,
            failure: None,
            wcs: [WorkCompletion::default(); 32],
        }
    }

    /// Reaps completions, then fills the send queue.
    fn pump(&mut self) {
        let channel = &mut self.endpoint.qps_mut()[0];
        let cq = channel.cq_mut().expect("the hostile peer's private CQ");
        loop {
            let done = cq.poll(&mut self.wcs).unwrap();
            let n = done.len();
            for wc in done {
                let receive = wc.wr_id() & RECV_ID != 0;
                match (receive, wc.is_success()) {
                    (true, true) => self.updates += 1,
                    (false, true) => self.acked += 1,
                    (_, false) => {
                        if self.failure.is_none() {
                            self.failure = Some(wc.ok().unwrap_err().to_string());
                        }
                    }
                }
                if !receive {
                    self.in_flight -= 1;
                }
            }
            if n < self.wcs.len() {
                break;
            }
        }
        if self.failure.is_some() {
            return;
        }
        let qp = channel.qp_mut();
        while self.in_flight < self.depth {
            // The immediate's kind 0 (a message) and our cumulative receive
            // count (what the reactor reads as our credit for it).
            let mut wr = WorkRequest::send_with_imm(
                self.posted,
                self.message.slice(0, 64).unwrap(),
                HOSTILE_RECVS,
            )
            .signaled();
            match qp.post_send(&mut wr) {
                Ok(()) => {
                    self.in_flight += 1;
                    self.posted += 1;
                }
                Err(err) if err.is_queue_full() => break,
                Err(err) => {
                    self.failure = Some(err.to_string());
                    break;
                }
            }
        }
    }
}

/// One honest stream: a reactor-driven `Streamer` on the peer reactor into
/// a verifying `Sink` on the SRQ reactor.
struct Stream {
    sent: Arc<Outcome>,
    received: Arc<Outcome>,
    sink: SessionId,
    streamer: SessionId,
    started: Instant,
    finished: Option<Instant>,
}

impl Stream {
    fn start(
        pd: &ProtectionDomain,
        srq: &mut Reactor<BoxedHandler>,
        peer: &mut Reactor<BoxedHandler>,
    ) -> Self {
        let sinks: Vec<_> = srq.sessions().collect();
        let streamers: Vec<_> = peer.sessions().collect();
        let (sent, received) = add_stream(
            pd,
            Sides::Two {
                server: srq,
                client: peer,
            },
            STREAM,
            MAX,
            None,
            false,
        );
        let new = |now: Vec<SessionId>, before: &[SessionId]| {
            now.into_iter()
                .find(|s| !before.contains(s))
                .expect("the stream's session")
        };
        Self {
            sink: new(srq.sessions().collect(), &sinks),
            streamer: new(peer.sessions().collect(), &streamers),
            sent,
            received,
            started: Instant::now(),
            finished: None,
        }
    }

    /// Every message received and every send completed.
    fn done(&mut self) -> bool {
        let done = self.received.finished.load(Ordering::Acquire)
            && self.sent.done.load(Ordering::Relaxed) == STREAM;
        if done && self.finished.is_none() {
            self.finished = Some(Instant::now());
        }
        done
    }

    /// Messages per second from the start to the last one received.
    fn rate(&self) -> f64 {
        let end = self.finished.unwrap_or_else(Instant::now);
        self.received.done.load(Ordering::Relaxed) as f64
            / end.duration_since(self.started).as_secs_f64()
    }

    #[track_caller]
    fn check(&self, what: &str) {
        for (side, outcome) in [("sender", &self.sent), ("sink", &self.received)] {
            assert_eq!(
                outcome.errors.load(Ordering::Relaxed),
                0,
                "{what} {side}: errors"
            );
            assert_eq!(
                outcome.bad.load(Ordering::Relaxed),
                0,
                "{what} {side}: lost, reordered or corrupted messages"
            );
            assert_eq!(
                outcome.done.load(Ordering::Relaxed),
                STREAM,
                "{what} {side}: messages"
            );
        }
    }
}

/// A connection of the SRQ reactor, through a real handshake, whose other
/// end is a raw QP (a `Flood`, which floods only when pumped), handled on
/// the reactor by a `HostileSide`.
struct RawPeer {
    session: SessionId,
    /// The reactor's QP of the connection, and the peer's address.
    qpn: u32,
    peer: std::net::SocketAddr,
    seen: Arc<Seen>,
    raw: Flood,
}

impl RawPeer {
    fn connect(
        pd: &ProtectionDomain,
        srq: &mut Reactor<BoxedHandler>,
        name: &str,
        hold: bool,
    ) -> Self {
        let listener = ServerSession::bind(
            "127.0.0.1:0",
            pd,
            ServerConfig {
                max_peers: Some(1),
                ..ServerConfig::insecure_open()
            },
        )
        .expect("bind");
        let spec = srq.qp_spec(name);
        let ours =
            ClientSession::connect(listener.local_addr(), pd, &ClientConfig::new(vec![spec]))
                .expect("connect");
        let theirs = listener.accept_timeout(DEADLINE).expect("accept");
        let (qpn, peer) = (ours.qps()[0].qp().qpn(), ours.peer());
        let seen = Arc::new(Seen::default());
        let side = HostileSide {
            seen: Arc::clone(&seen),
            hold,
            held: Vec::new(),
        };
        let session = srq
            .add(ours, Box::new(side))
            .expect("add the raw peer's connection");
        Self {
            session,
            qpn,
            peer,
            seen,
            raw: Flood::new(pd, theirs),
        }
    }
}

/// Turns both reactors (and pumps the flood, if any) until `done`, failing
/// the test at [`RUN_DEADLINE`] with `what` and the state of things.
#[track_caller]
fn run_until(
    srq: &mut Reactor<BoxedHandler>,
    peer: &mut Reactor<BoxedHandler>,
    mut flood: Option<&mut Flood>,
    what: &str,
    mut done: impl FnMut(&Reactor<BoxedHandler>, Option<&Flood>) -> bool,
) {
    let start = Instant::now();
    while !done(srq, flood.as_deref()) {
        srq.turn().expect("SRQ reactor pass");
        peer.turn().expect("peer reactor pass");
        if let Some(flood) = flood.as_deref_mut() {
            flood.pump();
        }
        assert!(
            start.elapsed() < RUN_DEADLINE,
            "timed out after {RUN_DEADLINE:?} waiting for {what} (SRQ receives posted: {:?} of {SRQ_DEPTH}; H: {:?})",
            srq.srq_posted(),
            flood
                .as_deref()
                .map(|f| (f.posted, f.acked, f.in_flight, f.updates, &f.failure)),
        );
    }
}

/// Turns the reactors (and pumps the flood) until every SRQ receive is
/// posted again.
#[track_caller]
fn srq_back_to_full_strength(
    srq: &mut Reactor<BoxedHandler>,
    peer: &mut Reactor<BoxedHandler>,
    flood: Option<&mut Flood>,
    what: &str,
) {
    run_until(srq, peer, flood, what, |srq, _| {
        srq.srq_posted() == Some(SRQ_DEPTH)
    });
}

/// The attack: G streams alone, then with H flooding the SRQ, then a third
/// honest peer streams after H was cut off. With `hold`, the reactor's
/// handler of H keeps every message H gets delivered, so H's grant is
/// exactly its share, and a peer that overran it unchecked would keep
/// every SRQ receive it took: the others would stall for good.
fn credit_overrun(hold: bool) {
    let ctx = open_device();
    let pd = ctx.alloc_pd().unwrap();
    let mut srq: Reactor<BoxedHandler> = Reactor::new(&pd, srq_config()).unwrap();
    let mut peer: Reactor<BoxedHandler> = Reactor::new(&pd, peer_config()).unwrap();
    assert_eq!(srq.srq_posted(), Some(SRQ_DEPTH));

    // G alone.
    let mut alone = Stream::start(&pd, &mut srq, &mut peer);
    run_until(&mut srq, &mut peer, None, "G's stream alone", |_, _| {
        alone.done()
    });
    alone.check("G alone");
    // Both ends at once, with no pass in between: neither sees the other go.
    assert!(peer.remove(alone.streamer).is_some() && srq.remove(alone.sink).is_some());
    srq_back_to_full_strength(&mut srq, &mut peer, None, "the SRQ after G's first stream");

    // G again, and H. H's QP on the SRQ reactor is added like any peer's;
    // its other end is a raw QP.
    let mut with_h = Stream::start(&pd, &mut srq, &mut peer);
    let RawPeer {
        session: hostile,
        qpn: hostile_qpn,
        peer: hostile_peer,
        seen,
        raw: mut flood,
    } = RawPeer::connect(&pd, &mut srq, "hostile", hold);
    // H strikes in the middle of G's stream.
    run_until(
        &mut srq,
        &mut peer,
        None,
        "G's stream to get going",
        |_, _| with_h.received.done.load(Ordering::Relaxed) >= STREAM / 10,
    );
    let (mut progress, mut passes_without) = (0, 0u32);
    run_until(
        &mut srq,
        &mut peer,
        Some(&mut flood),
        "G's stream while H floods",
        |_, _| {
            if with_h.done() {
                return true;
            }
            let now = with_h.received.done.load(Ordering::Relaxed);
            if now == progress {
                passes_without += 1;
            } else {
                (progress, passes_without) = (now, 0);
            }
            // A held-back H that went unchecked keeps what it took: G
            // stalls for good. Stop waiting once it has made no progress
            // for many passes (the checks below then fail).
            hold && seen.delivered.load(Ordering::Relaxed) > u64::from(SHARE)
                && passes_without > 50_000
        },
    );
    let delivered = seen.delivered.load(Ordering::Relaxed);
    writeln!(
        std::io::stderr(),
        "G's message rate: alone {:.0}/s, while H floods {:.0}/s ({} of {STREAM} messages); H posted {} SENDs, {} acknowledged, {delivered} delivered to its handler; SRQ receives posted: {:?} of {SRQ_DEPTH}",
        alone.rate(),
        with_h.rate(),
        with_h.received.done.load(Ordering::Relaxed),
        flood.posted,
        flood.acked,
        srq.srq_posted(),
    )
    .unwrap();

    // H, and only H, was cut off, with the typed error.
    let errors = seen.errors.lock().unwrap().clone();
    assert!(
        !errors.is_empty(),
        "H was never cut off: its handler got {delivered} messages on a share of {SHARE}"
    );
    assert_eq!(errors.len(), 1, "H's handler was told once: {errors:?}");
    let overrun = *seen.overrun.lock().unwrap();
    let Some((qpn, granted, consumed, share)) = overrun else {
        panic!("H's error is not a CreditOverrun: {errors:?}");
    };
    assert_eq!((qpn, share), (hostile_qpn, SHARE), "{}", errors[0]);
    assert_eq!(
        *seen.peer.lock().unwrap(),
        Some(hostile_peer),
        "the overrun names H's address: {}",
        errors[0]
    );
    assert_eq!(
        consumed,
        granted.wrapping_add(1),
        "cut off at the first receive beyond the grant"
    );
    assert_eq!(
        u64::from(granted),
        delivered,
        "every granted receive and no other was delivered"
    );
    if hold {
        assert_eq!(
            granted, SHARE,
            "with every message held, the grant never grows past the share"
        );
    }
    assert!(
        srq.conns(hostile).next().is_some(),
        "H's session stays until its owner removes it"
    );
    with_h.check("G while H floods");

    // Whatever H took beyond its grant comes back, though H keeps
    // flooding: its QP on the reactor is in the error state, so its SENDs
    // take no more receives (and are no longer acknowledged).
    srq_back_to_full_strength(
        &mut srq,
        &mut peer,
        Some(&mut flood),
        "the SRQ receives H took",
    );
    let acked = flood.acked;

    // A third peer, added later, streams while H still tries (H's session,
    // failed, keeps its share until its owner removes it).
    let mut after = Stream::start(&pd, &mut srq, &mut peer);
    run_until(
        &mut srq,
        &mut peer,
        Some(&mut flood),
        "the third peer's stream",
        |_, _| after.done(),
    );
    after.check("the third peer");
    writeln!(
        std::io::stderr(),
        "a third peer after H was cut off: {:.0}/s; H meanwhile: {} SENDs posted, {} acknowledged, {} in flight, failure seen: {:?}",
        after.rate(),
        flood.posted,
        flood.acked,
        flood.in_flight,
        flood.failure,
    )
    .unwrap();
    assert_eq!(
        flood.acked, acked,
        "the reactor acknowledged H's SENDs after cutting it off"
    );
    srq_back_to_full_strength(
        &mut srq,
        &mut peer,
        Some(&mut flood),
        "the SRQ after the third peer",
    );
    assert_eq!(
        seen.errors.lock().unwrap().len(),
        1,
        "H's handler was told once"
    );
    assert!(srq.remove(hostile).is_some());
    srq_back_to_full_strength(
        &mut srq,
        &mut peer,
        Some(&mut flood),
        "the SRQ after H's removal",
    );
}

/// A raw peer on the SRQ reactor sends one SEND the protocol has no place
/// for, in the middle of an honest stream: each time, that peer alone is
/// cut off with `MalformedMessage`, nothing is delivered, the receive it
/// took goes back to the SRQ and the stream finishes intact.
fn malformed_on_an_srq() {
    let ctx = open_device();
    let pd = ctx.alloc_pd().unwrap();
    let mut srq: Reactor<BoxedHandler> = Reactor::new(&pd, srq_config()).unwrap();
    let mut peer: Reactor<BoxedHandler> = Reactor::new(&pd, peer_config()).unwrap();
    // (immediate, what the error says): no immediate, kind 3.
    let cases: [(Option<u32>, &str); 2] = [
        (None, "without the reactor's immediate"),
        (Some(3 << 30 | HOSTILE_RECVS), "unknown kind"),
    ];
    for (imm, what) in cases {
        let mut stream = Stream::start(&pd, &mut srq, &mut peer);
        // Its receives for the reactor's credit updates; no flooding.
        let RawPeer {
            session: bad,
            seen,
            mut raw,
            ..
        } = RawPeer::connect(&pd, &mut srq, "malformed", false);
        run_until(
            &mut srq,
            &mut peer,
            None,
            "the stream to get going",
            |_, _| stream.received.done.load(Ordering::Relaxed) >= STREAM / 10,
        );
        let local = raw.message.slice(0, 64).unwrap();
        let mut wr = match imm {
            Some(imm) => WorkRequest::send_with_imm(1, local, imm),
            None => WorkRequest::send(1, local),
        };
        raw.endpoint.qps_mut()[0]
            .qp_mut()
            .post_send(&mut wr)
            .unwrap();
        run_until(&mut srq, &mut peer, None, what, |_, _| {
            !seen.errors.lock().unwrap().is_empty()
        });
        let errors = seen.errors.lock().unwrap().clone();
        assert_eq!(errors.len(), 1, "{what}: {errors:?}");
        assert!(
            errors[0].contains("malformed message") && errors[0].contains(what),
            "{what}: {}",
            errors[0]
        );
        assert_eq!(seen.delivered.load(Ordering::Relaxed), 0, "{what}");
        run_until(&mut srq, &mut peer, None, "the stream", |_, _| {
            stream.done()
        });
        stream.check(what);
        srq_back_to_full_strength(&mut srq, &mut peer, None, what);
        assert!(srq.remove(bad).is_some());
        assert!(peer.remove(stream.streamer).is_some() && srq.remove(stream.sink).is_some());
        srq_back_to_full_strength(&mut srq, &mut peer, None, what);
    }
}

verbs_test! {
    fn a_peer_whose_sends_break_the_protocol_on_an_srq_is_cut_off_and_its_receive_comes_back() {
        malformed_on_an_srq();
    }
}

verbs_test! {
    fn a_peer_that_ignores_its_credits_on_an_srq_is_cut_off_and_others_keep_streaming() {
        credit_overrun(false);
    }
}

verbs_test! {
    fn a_held_back_peer_that_ignores_its_credits_cannot_keep_the_srq_drained() {
        credit_overrun(true);
    }
}

// ------------------------------------------------------- honest peers

/// Keeps every message it gets (their receives stay consumed, so its peer
/// runs out of credits) and lets them all go now and then after a nap: a
/// slow receiver that holds its whole share.
struct Hoarder {
    expected: u64,
    total: u64,
    held: Vec<HeldRecv>,
    idle: u32,
    outcome: Arc<Outcome>,
}

impl Handler for Hoarder {
    fn on_message(&mut self, ctx: &mut Ctx<'_>, _: ConnId, data: &[u8], imm: Option<u32>) {
        let seq = self.expected;
        if imm != Some(seq as u32) || data.len() != stream_len(seq, MAX) || !matches(data, seq) {
            self.outcome.bad.fetch_add(1, Ordering::Relaxed);
        }
        self.expected += 1;
        self.outcome.done.store(self.expected, Ordering::Relaxed);
        self.held.push(ctx.hold().expect("in on_message"));
        self.outcome
            .limit
            .fetch_max(self.held.len() as u64, Ordering::Relaxed);
        if self.expected == self.total {
            self.outcome.finished.store(true, Ordering::Release);
        }
    }

    fn on_idle(&mut self, ctx: &mut Ctx<'_>) -> Idle {
        self.idle += 1;
        if self.held.is_empty() || !self.idle.is_multiple_of(64) {
            return Idle::Again;
        }
        thread::sleep(Duration::from_millis(1));
        // Oldest first; sometimes only half, so the peer's credits come back
        // in uneven steps.
        let keep = if self.idle.is_multiple_of(128) {
            self.held.len() / 2
        } else {
            0
        };
        let count = self.held.len() - keep;
        for held in self.held.drain(..count) {
            ctx.release(held).expect("a held receive of this reactor");
        }
        Idle::Again
    }

    fn on_error(&mut self, _: &mut Ctx<'_>, conn: ConnId, error: &Error) {
        eprintln!("hoarder {conn:?}: {error}");
        self.outcome.errors.fetch_add(1, Ordering::Relaxed);
    }
}

/// Forwards every upstream message downstream from its receive slot
/// (hold + forward, no copy); messages the downstream cannot take yet wait
/// in order, still holding their slots.
struct Relay {
    down: ConnId,
    waiting: VecDeque<HeldRecv>,
    forwarded: u64,
    outcome: Arc<Outcome>,
}

impl Relay {
    fn drain(&mut self, ctx: &mut Ctx<'_>) {
        while let Some(held) = self.waiting.pop_front() {
            match ctx.forward(self.down, held, Some(self.forwarded as u32)) {
                Ok(_) => self.forwarded += 1,
                Err((SendError::WouldBlock, held)) => {
                    self.waiting.push_front(held);
                    return;
                }
                Err((error, held)) => {
                    eprintln!("relay: {error}");
                    self.outcome.errors.fetch_add(1, Ordering::Relaxed);
                    self.waiting.push_front(held);
                    return;
                }
            }
        }
    }
}

impl Handler for Relay {
    fn on_message(&mut self, ctx: &mut Ctx<'_>, _: ConnId, _: &[u8], _: Option<u32>) {
        self.waiting.push_back(ctx.hold().expect("in on_message"));
        self.outcome
            .limit
            .fetch_max(self.waiting.len() as u64, Ordering::Relaxed);
        self.drain(ctx);
    }

    fn on_error(&mut self, _: &mut Ctx<'_>, conn: ConnId, error: &Error) {
        eprintln!("relay {conn:?}: {error}");
        self.outcome.errors.fetch_add(1, Ordering::Relaxed);
    }

    fn on_idle(&mut self, ctx: &mut Ctx<'_>) -> Idle {
        self.drain(ctx);
        Idle::Again
    }
}

/// A session that only reports failures.
struct Failures(Arc<Outcome>);

impl Handler for Failures {
    fn on_message(&mut self, _: &mut Ctx<'_>, _: ConnId, _: &[u8], _: Option<u32>) {
        self.0.bad.fetch_add(1, Ordering::Relaxed);
    }

    fn on_error(&mut self, _: &mut Ctx<'_>, conn: ConnId, error: &Error) {
        eprintln!("{conn:?}: {error}");
        self.0.errors.fetch_add(1, Ordering::Relaxed);
    }
}

/// Turns `reactor` on its own thread until `stop` is set (the handlers'
/// own `ctx.stop()` does not end `turn`).
fn spawn_turning(
    mut reactor: Reactor<BoxedHandler>,
    stop: Arc<AtomicBool>,
) -> thread::JoinHandle<Reactor<BoxedHandler>> {
    thread::spawn(move || {
        while !stop.load(Ordering::Acquire) {
            reactor.turn().expect("reactor pass");
        }
        reactor
    })
}

verbs_test! {
    fn honest_peers_driven_to_their_credit_limit_are_never_cut_off() {
        // Small shares, so every sender hits its credit limit over and over.
        const SMALL: u32 = 16;
        const HOARDED: u64 = 20_000;
        const RELAYED: u64 = 20_000;
        const PINGS: u64 = 2_000;
        let config = ReactorConfig {
            recv_depth: SMALL,
            // The hoarder, the relay's two sides and the echoer.
            srq_depth: 4 * SMALL,
            repost_batch: 4,
            ..srq_config()
        };
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        let mut srq: Reactor<BoxedHandler> = Reactor::new(&pd, config.clone()).unwrap();
        let mut peer: Reactor<BoxedHandler> =
            Reactor::new(&pd, ReactorConfig { srq_depth: 0, ..config }).unwrap();
        let sides = |srq: &mut Reactor<BoxedHandler>, peer: &mut Reactor<BoxedHandler>| {
            let (inbox, _) = regions(&pd, 64);
            connect(&pd, &mut Sides::Two { server: srq, client: peer }, &inbox, &inbox)
        };

        // A streamer into a hoarder.
        let hoarded = Arc::new(Outcome::default());
        let hoard_sent = Arc::new(Outcome::default());
        let (ours, theirs) = sides(&mut srq, &mut peer);
        let hoarder = Hoarder {
            expected: 0,
            total: HOARDED,
            held: Vec::with_capacity(SMALL as usize),
            idle: 0,
            outcome: Arc::clone(&hoarded),
        };
        srq.add(ours, Box::new(hoarder)).unwrap();
        peer.add(theirs, Box::new(Streamer::new(HOARDED, MAX, Arc::clone(&hoard_sent)))).unwrap();

        // A streamer into a zero-copy relay on the SRQ reactor, whose
        // downstream is a slow sink back on the peer reactor.
        let relayed = Arc::new(Outcome::default());
        let relay_sent = Arc::new(Outcome::default());
        let relay_received = Arc::new(Outcome::default());
        let (down_ours, down_theirs) = sides(&mut srq, &mut peer);
        let down_session = srq.add(down_ours, Box::new(Failures(Arc::clone(&relayed)))).unwrap();
        let down = srq.conns(down_session).next().unwrap();
        let mut sink = Sink::new(RELAYED, MAX, Arc::clone(&relay_received));
        sink.slow = Some(Duration::from_millis(2));
        peer.add(down_theirs, Box::new(sink)).unwrap();
        let (up_ours, up_theirs) = sides(&mut srq, &mut peer);
        let relay = Relay {
            down,
            waiting: VecDeque::with_capacity(4 * SMALL as usize),
            forwarded: 0,
            outcome: Arc::clone(&relayed),
        };
        srq.add(up_ours, Box::new(relay)).unwrap();
        peer.add(up_theirs, Box::new(Streamer::new(RELAYED, MAX, Arc::clone(&relay_sent)))).unwrap();

        // A ping-pong of SENDs and WRITE_WITH_IMMs, echoed on the SRQ.
        let (ping, echo) = add_ping_pong(
            &pd,
            Sides::Two { server: &mut srq, client: &mut peer },
            PINGS,
            256,
            true,
        );

        let stop = Arc::new(AtomicBool::new(false));
        let srq_thread = spawn_turning(srq, Arc::clone(&stop));
        let peer_thread = spawn_turning(peer, Arc::clone(&stop));
        let outcomes = [
            ("hoarder", &hoarded),
            ("hoarding stream's sender", &hoard_sent),
            ("relay", &relayed),
            ("relay's sender", &relay_sent),
            ("relay's sink", &relay_received),
            ("pinger", &ping),
            ("echoer", &echo),
        ];
        let start = Instant::now();
        loop {
            let failed = outcomes.iter().any(|(_, o)| o.errors.load(Ordering::Relaxed) > 0);
            let done = hoarded.finished.load(Ordering::Acquire)
                && relay_received.finished.load(Ordering::Acquire)
                && ping.finished.load(Ordering::Acquire)
                && hoard_sent.done.load(Ordering::Relaxed) == HOARDED
                && relay_sent.done.load(Ordering::Relaxed) == RELAYED;
            if failed || done || start.elapsed() > RUN_DEADLINE {
                break;
            }
            thread::sleep(Duration::from_millis(10));
        }
        stop.store(true, Ordering::Release);
        let _srq = srq_thread.join().expect("SRQ reactor thread");
        let _peer = peer_thread.join().expect("peer reactor thread");
        let most_hoarded = hoarded.limit.load(Ordering::Relaxed);
        let most_waiting = relayed.limit.load(Ordering::Relaxed);
        writeln!(
            std::io::stderr(),
            "held at most: {most_hoarded} by the hoarder, {most_waiting} by the relay (share {SMALL})"
        )
        .unwrap();
        for (what, outcome) in outcomes {
            assert_eq!(outcome.errors.load(Ordering::Relaxed), 0, "{what}: errors (cut off?)");
            assert_eq!(outcome.bad.load(Ordering::Relaxed), 0, "{what}: bad messages");
        }
        assert_eq!(hoarded.done.load(Ordering::Relaxed), HOARDED, "hoarded messages");
        assert_eq!(relay_received.done.load(Ordering::Relaxed), RELAYED, "relayed messages");
        assert_eq!(ping.done.load(Ordering::Relaxed), PINGS, "round trips");
        assert_eq!(hoard_sent.done.load(Ordering::Relaxed), HOARDED, "hoarding stream's sends");
        assert_eq!(relay_sent.done.load(Ordering::Relaxed), RELAYED, "relayed stream's sends");
        // The hoarder held enough to drive its peer to the credit limit.
        assert!(most_hoarded >= u64::from(SMALL) / 2, "the hoarder held only {most_hoarded}");
    }
}
