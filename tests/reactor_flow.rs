//! Credit flow control under a deliberately slow receiver: the sender is held
//! back, nothing is lost or reordered, and the device never sends or receives
//! an RNR NAK. Alone in its binary so no other test's traffic moves the
//! device-wide counters. Gated as in `tests/util/mod.rs`.

mod util;

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use rdma_comm_core::Error;
use rdma_comm_core::reactor::*;
use util::reactor::*;
use util::*;

/// Forwards every upstream message downstream without copying it: the
/// receive slot is held until the downstream SEND completes. Messages the
/// downstream cannot take yet wait, in order, still holding their slots, so
/// the upstream runs out of credits instead of the relay buffering.
struct Relay {
    down: ConnId,
    waiting: VecDeque<HeldRecv>,
    most_waiting: usize,
    outcome: Arc<Outcome>,
}

impl Relay {
    fn drain(&mut self, ctx: &mut Ctx<'_>) {
        while let Some(held) = self.waiting.pop_front() {
            let imm = Some(self.outcome.done.fetch_add(1, Ordering::Relaxed) as u32);
            if let Err((error, held)) = ctx.forward(self.down, held, imm) {
                self.outcome.done.fetch_sub(1, Ordering::Relaxed);
                self.waiting.push_front(held);
                if !matches!(error, SendError::WouldBlock) {
                    eprintln!("relay: {error}");
                    self.outcome.errors.fetch_add(1, Ordering::Relaxed);
                    ctx.stop();
                }
                return;
            }
        }
    }
}

impl Handler for Relay {
    fn on_message(&mut self, ctx: &mut Ctx<'_>, _conn: ConnId, _data: &[u8], _imm: Option<u32>) {
        let held = ctx.hold().expect("a message can be held in on_message");
        self.waiting.push_back(held);
        self.most_waiting = self.most_waiting.max(self.waiting.len());
        self.outcome
            .limit
            .fetch_max(self.most_waiting as u64, Ordering::Relaxed);
        self.drain(ctx);
    }

    fn on_error(&mut self, ctx: &mut Ctx<'_>, _conn: ConnId, error: &Error) {
        eprintln!("relay upstream: {error}");
        self.outcome.errors.fetch_add(1, Ordering::Relaxed);
        ctx.stop();
    }

    fn on_idle(&mut self, ctx: &mut Ctx<'_>) -> Idle {
        self.drain(ctx);
        Idle::Again
    }
}

/// The relay's downstream session: only failures to report.
struct Downstream(Arc<Outcome>);

impl Handler for Downstream {
    fn on_message(&mut self, _ctx: &mut Ctx<'_>, _conn: ConnId, _data: &[u8], _imm: Option<u32>) {
        self.0.bad.fetch_add(1, Ordering::Relaxed);
    }

    fn on_error(&mut self, ctx: &mut Ctx<'_>, _conn: ConnId, error: &Error) {
        eprintln!("relay downstream: {error}");
        self.0.errors.fetch_add(1, Ordering::Relaxed);
        ctx.stop();
    }
}

verbs_test! {
    fn a_slow_receiver_causes_no_rnr_and_loses_nothing() {
        slow_receiver(0);
    }
}

verbs_test! {
    fn a_slow_receiver_behind_an_srq_causes_no_rnr_and_loses_nothing() {
        slow_receiver(24);
    }
}

/// Streams into a sleeping sink; `srq_depth` 0 gives each QP its own ring.
fn slow_receiver(srq_depth: u32) {
    let ctx = open_device();
    let device = ctx.name().to_string();
    let pd = ctx.alloc_pd().unwrap();
    // A small receive ring makes the credit limit bite early and often.
    let config = ReactorConfig {
        recv_depth: 16,
        srq_depth,
        repost_batch: 4,
        slot_size: 512,
        ..ReactorConfig::default()
    };
    let mut sink_reactor: Reactor<BoxedHandler> = Reactor::new(&pd, config.clone()).unwrap();
    let mut stream_reactor: Reactor<BoxedHandler> = Reactor::new(&pd, config).unwrap();
    let before = quiet_rnr_counters(&device);
    let total = 30_000;
    let (sent, received) = add_stream(
        &pd,
        Sides::Two {
            server: &mut sink_reactor,
            client: &mut stream_reactor,
        },
        total,
        500,
        Some(Duration::from_millis(5)),
        true,
    );
    let cancel = watchdog(
        vec![sink_reactor.stopper(), stream_reactor.stopper()],
        Duration::from_secs(300),
    );
    let sink = spawn(sink_reactor, 0);
    let streamer = spawn(stream_reactor, 1);
    // Both stay alive until both are done: a sink torn down early would fail
    // the streamer's last, signaled request.
    let _sink = sink.join().unwrap();
    let _streamer = streamer.join().unwrap();
    cancel.disarm();

    assert_eq!(
        received.bad.load(Ordering::Relaxed),
        0,
        "lost, reordered or corrupted messages"
    );
    assert_eq!(received.done.load(Ordering::Relaxed), total);
    assert_eq!(
        sent.errors.load(Ordering::Relaxed) + received.errors.load(Ordering::Relaxed),
        0
    );
    let after = quiet_rnr_counters(&device);
    println!("RNR NAKs received/sent: before {before:?}, after {after:?}");
    assert_eq!(after, before, "flow control let an RNR happen");
}

verbs_test! {
    fn a_zero_copy_relay_pushes_a_slow_receiver_back_to_its_source() {
        let ctx = open_device();
        let device = ctx.name().to_string();
        let pd = ctx.alloc_pd().unwrap();
        let config = ReactorConfig { recv_depth: 16, repost_batch: 4, slot_size: 512, ..ReactorConfig::default() };
        let mut sink_reactor: Reactor<BoxedHandler> = Reactor::new(&pd, config.clone()).unwrap();
        let mut relay_reactor: Reactor<BoxedHandler> = Reactor::new(&pd, config.clone()).unwrap();
        let mut stream_reactor: Reactor<BoxedHandler> = Reactor::new(&pd, config).unwrap();
        let before = quiet_rnr_counters(&device);
        let total = 20_000;
        let max = 500;

        // relay -> slow sink
        let (sink_inbox, _) = regions(&pd, 64);
        let (relay_inbox, _) = regions(&pd, 64);
        let (sink_ep, down_ep) = connect(
            &pd,
            &mut Sides::Two { server: &mut sink_reactor, client: &mut relay_reactor },
            &sink_inbox,
            &relay_inbox,
        );
        let received = Arc::new(Outcome::default());
        let mut sink = Sink::new(total, max, Arc::clone(&received));
        sink.slow = Some(Duration::from_millis(5));
        sink_reactor.add(sink_ep, Box::new(sink)).unwrap();
        let relayed = Arc::new(Outcome::default());
        let down_session = relay_reactor.add(down_ep, Box::new(Downstream(Arc::clone(&relayed)))).unwrap();
        let down = relay_reactor.conns(down_session).next().unwrap();

        // source -> relay
        let (source_inbox, _) = regions(&pd, 64);
        let (up_ep, source_ep) = connect(
            &pd,
            &mut Sides::Two { server: &mut relay_reactor, client: &mut stream_reactor },
            &relay_inbox,
            &source_inbox,
        );
        let relay = Relay { down, waiting: VecDeque::with_capacity(64), most_waiting: 0, outcome: Arc::clone(&relayed) };
        relay_reactor.add(up_ep, Box::new(relay)).unwrap();
        let sent = Arc::new(Outcome::default());
        let mut streamer = Streamer::new(total, max, Arc::clone(&sent));
        streamer.stop_when_done = true;
        stream_reactor.add(source_ep, Box::new(streamer)).unwrap();

        let relay_stopper = relay_reactor.stopper();
        let cancel = watchdog(
            vec![sink_reactor.stopper(), relay_reactor.stopper(), stream_reactor.stopper()],
            Duration::from_secs(300),
        );
        let sink = spawn(sink_reactor, 0);
        let relay = spawn(relay_reactor, 1);
        let streamer = spawn(stream_reactor, 1);
        let _sink = sink.join().unwrap();
        // The relay serves the streamer's last completions, so it stops last.
        let _streamer = streamer.join().unwrap();
        relay_stopper.stop();
        let _relay = relay.join().unwrap();
        cancel.disarm();

        // The Sink checks every message's sequence (the relay's immediate),
        // length and bytes, so a lost, reordered or overwritten slot shows.
        assert_eq!(received.bad.load(Ordering::Relaxed), 0, "lost, reordered or corrupted messages");
        assert_eq!(received.done.load(Ordering::Relaxed), total);
        let errors = sent.errors.load(Ordering::Relaxed)
            + relayed.errors.load(Ordering::Relaxed)
            + received.errors.load(Ordering::Relaxed);
        assert_eq!(errors, 0);
        let most_waiting = relayed.limit.load(Ordering::Relaxed);
        println!("relay held at most {most_waiting} messages waiting for downstream credit");
        assert!(most_waiting <= 16, "the relay held more than its receive ring");
        let after = quiet_rnr_counters(&device);
        println!("RNR NAKs received/sent: before {before:?}, after {after:?}");
        assert_eq!(after, before, "flow control let an RNR happen");
    }
}
