//! Credit flow control under a deliberately slow receiver: the sender is held
//! back, nothing is lost or reordered, and the device never sends or receives
//! an RNR NAK. Alone in its binary so no other test's traffic moves the
//! device-wide counters. Gated as in `tests/util/mod.rs`.

mod util;

use std::sync::atomic::Ordering;
use std::time::Duration;

use rdma_comm_core::reactor::*;
use util::reactor::*;
use util::*;

fn rnr_counters(device: &str) -> (u64, u64) {
    let read = |name: &str| {
        let path = format!("/sys/class/infiniband/{device}/ports/1/hw_counters/{name}");
        std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("{path}: {e}"))
            .trim()
            .parse::<u64>()
            .unwrap()
    };
    (read("rcvd_rnr_err"), read("send_rnr_err"))
}

verbs_test! {
    fn a_slow_receiver_causes_no_rnr_and_loses_nothing() {
        let ctx = open_device();
        let device = ctx.name().to_string();
        let pd = ctx.alloc_pd().unwrap();
        // A small receive ring makes the credit limit bite early and often.
        let config = ReactorConfig { recv_depth: 16, repost_batch: 4, slot_size: 512, ..ReactorConfig::default() };
        let mut sink_reactor: Reactor<BoxedHandler> = Reactor::new(&pd, config.clone()).unwrap();
        let mut stream_reactor: Reactor<BoxedHandler> = Reactor::new(&pd, config).unwrap();
        let before = rnr_counters(&device);
        let total = 30_000;
        let (sent, received) = add_stream(
            &pd,
            Sides::Two { server: &mut sink_reactor, client: &mut stream_reactor },
            total,
            500,
            Some(Duration::from_millis(5)),
            true,
        );
        let cancel = watchdog(vec![sink_reactor.stopper(), stream_reactor.stopper()], Duration::from_secs(300));
        let sink = spawn(sink_reactor, 0);
        let streamer = spawn(stream_reactor, 1);
        sink.join().unwrap();
        streamer.join().unwrap();
        cancel.store(true, Ordering::Release);

        assert_eq!(received.bad.load(Ordering::Relaxed), 0, "lost, reordered or corrupted messages");
        assert_eq!(received.done.load(Ordering::Relaxed), total);
        assert_eq!(sent.errors.load(Ordering::Relaxed) + received.errors.load(Ordering::Relaxed), 0);
        let after = rnr_counters(&device);
        println!("RNR NAKs received/sent: before {before:?}, after {after:?}");
        assert_eq!(after, before, "flow control let an RNR happen");
    }
}
