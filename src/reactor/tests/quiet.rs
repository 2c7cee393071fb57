//! A pair goes quiet once its traffic ends, at every ring depth: the
//! credit updates that announce receives reposted after credit updates
//! stop, instead of answering each other for good.

use super::*;

#[test]
fn a_pair_goes_quiet_after_traffic_at_every_depth() {
    for depth in [2, 3, 4, 5, 6, 7, 8, 16] {
        // SAFETY: every QP of the device is served from this thread.
        let ctx = unsafe { Context::loopback() };
        let pd = ctx.alloc_pd().expect("a PD");
        let config = ReactorConfig {
            slot_size: 64,
            recv_depth: depth,
            repost_batch: (depth / 4).max(1),
            send_slots: 16,
            sq_depth: 64,
            ..ReactorConfig::default()
        };
        let mut reactor: Reactor<Probe, ()> = Reactor::new(&pd, config).expect("a reactor");
        let (a, b) = add_pair(&mut reactor, &pd);
        for _ in 0..20 {
            send(&mut reactor, a.conn, b"ping");
        }
        run_until(&mut reactor, "all arrived", |_| {
            b.seen.borrow().messages.len() == 20
        });
        // Long enough for the idle-time reposts and tail signals.
        turns(&mut reactor, 5000);
        let before = reactor.counters();
        turns(&mut reactor, 1000);
        let after = reactor.counters();
        assert_eq!(
            (
                after.requests - before.requests,
                after.completions - before.completions
            ),
            (0, 0),
            "depth {depth}: still posting once quiet"
        );
    }
}
