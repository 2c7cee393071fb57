//! Every event mode in both thread modes passes the same verified ping-pong
//! and streaming tests. Gated as described in `tests/util/mod.rs`.

mod util;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use rdma_comm_core::reactor::*;
use util::reactor::*;
use util::*;

/// How the tests lay QPs out over reactors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ThreadMode {
    /// Every QP gets its own reactor on its own thread.
    PerQp,
    /// All QPs share one reactor and its CQs.
    SharedCq,
}

const RUN_DEADLINE: Duration = Duration::from_secs(120);
const PING_ITERS: u64 = 2_000;
const STREAM_MESSAGES: u64 = 20_000;

fn config(event_mode: EventMode) -> ReactorConfig {
    config_srq(event_mode, false)
}

/// With `srq`, every QP of the reactor takes its receives from one shared
/// receive queue, big enough for two connections' shares.
fn config_srq(event_mode: EventMode, srq: bool) -> ReactorConfig {
    ReactorConfig {
        event_mode,
        srq_depth: if srq { 160 } else { 0 },
        slot_size: 2048,
        recv_depth: 64,
        send_slots: 64,
        signal_interval: 8,
        ..Default::default()
    }
}

#[track_caller]
fn check(what: &str, outcome: &Outcome, expected_done: u64) {
    assert_eq!(outcome.errors.load(Ordering::Relaxed), 0, "{what}: errors");
    assert_eq!(
        outcome.bad.load(Ordering::Relaxed),
        0,
        "{what}: corrupted, lost or reordered messages"
    );
    assert_eq!(
        outcome.done.load(Ordering::Relaxed),
        expected_done,
        "{what}: messages completed"
    );
}

fn ping_pong(event_mode: EventMode, thread_mode: ThreadMode, size: usize, srq: bool) {
    let config = |mode| config_srq(mode, srq);
    let ctx = open_device();
    let pd = ctx.alloc_pd().unwrap();
    match thread_mode {
        ThreadMode::SharedCq => {
            let mut reactor: Reactor<BoxedHandler> = Reactor::new(&pd, config(event_mode)).unwrap();
            // Both ends of the ping-pong on the one reactor's shared CQ.
            let (ping_a, echo_a) =
                add_ping_pong(&pd, Sides::One(&mut reactor), PING_ITERS, size, true);
            let cancel = watchdog(vec![reactor.stopper()], RUN_DEADLINE);
            reactor.run().unwrap();
            cancel.disarm();
            check("pinger", &ping_a, PING_ITERS);
            check("echoer", &echo_a, PING_ITERS);
        }
        ThreadMode::PerQp => {
            let mut server: Reactor<BoxedHandler> = Reactor::new(&pd, config(event_mode)).unwrap();
            let mut client: Reactor<BoxedHandler> = Reactor::new(&pd, config(event_mode)).unwrap();
            let (ping, echo) = add_ping_pong(
                &pd,
                Sides::Two {
                    server: &mut server,
                    client: &mut client,
                },
                PING_ITERS,
                size,
                true,
            );
            let (server_stop, client_stop) = (server.stopper(), client.stopper());
            let cancel = watchdog(vec![server_stop.clone(), client_stop], RUN_DEADLINE);
            let server = spawn(server, 0);
            let client = spawn(client, 1);
            let client = client.join().expect("client reactor thread");
            server_stop.stop();
            let server = server.join().expect("server reactor thread");
            cancel.disarm();
            check("pinger", &ping, PING_ITERS);
            check("echoer", &echo, PING_ITERS);
            if event_mode != EventMode::BusyPoll {
                // Each side sleeps between round trips, and what it posts on
                // waking is signaled: a round trip posts a ping and its
                // answer, not also a credit update per side to signal out
                // the tail before each sleep (twice the requests): about
                // one request per side per round trip.
                for (side, reactor) in [("server", &server), ("client", &client)] {
                    let counters = reactor.counters();
                    println!(
                        "{event_mode:?} {side}: {} requests, {} completions, {} sleeps for {PING_ITERS} round trips",
                        counters.requests, counters.completions, counters.sleeps
                    );
                    assert!(
                        counters.requests <= PING_ITERS * 3 / 2,
                        "{side}: {} requests for {PING_ITERS} round trips ({} sleeps)",
                        counters.requests,
                        counters.sleeps
                    );
                }
            }
        }
    }
}

fn stream(event_mode: EventMode, thread_mode: ThreadMode, slow: Option<Duration>, srq: bool) {
    let config = |mode| config_srq(mode, srq);
    let ctx = open_device();
    let pd = ctx.alloc_pd().unwrap();
    let max = 1500;
    match thread_mode {
        ThreadMode::SharedCq => {
            let mut reactor: Reactor<BoxedHandler> = Reactor::new(&pd, config(event_mode)).unwrap();
            let (sent, received) = add_stream(
                &pd,
                Sides::One(&mut reactor),
                STREAM_MESSAGES,
                max,
                slow,
                false,
            );
            let cancel = watchdog(vec![reactor.stopper()], RUN_DEADLINE);
            reactor.run().unwrap();
            cancel.disarm();
            check("sink", &received, STREAM_MESSAGES);
            assert_eq!(sent.errors.load(Ordering::Relaxed), 0);
        }
        ThreadMode::PerQp => {
            let mut server: Reactor<BoxedHandler> = Reactor::new(&pd, config(event_mode)).unwrap();
            let mut client: Reactor<BoxedHandler> = Reactor::new(&pd, config(event_mode)).unwrap();
            let (sent, received) = add_stream(
                &pd,
                Sides::Two {
                    server: &mut server,
                    client: &mut client,
                },
                STREAM_MESSAGES,
                max,
                slow,
                true,
            );
            let cancel = watchdog(vec![server.stopper(), client.stopper()], RUN_DEADLINE);
            let server = spawn(server, 0);
            let client = spawn(client, 1);
            let server = server.join().expect("sink reactor thread");
            let client = client.join().expect("stream reactor thread");
            // On a hang, show where each side's queues and credits stood.
            for (side, reactor) in [("sink", &server), ("streamer", &client)] {
                for conn in reactor.sessions().flat_map(|s| reactor.conns(s)) {
                    println!("{side} {conn:?}: {:?}", reactor.conn_stats(conn));
                }
            }
            println!(
                "received {} sent-complete {}",
                received.done.load(Ordering::Relaxed),
                sent.done.load(Ordering::Relaxed)
            );
            cancel.disarm();
            check("sink", &received, STREAM_MESSAGES);
            assert_eq!(sent.errors.load(Ordering::Relaxed), 0);
        }
    }
}

macro_rules! matrix {
    ($($name:ident: $event:ident, $thread:ident;)*) => {
        mod ping_pong {
            use super::*;
            $(verbs_test! { fn $name() { ping_pong(EventMode::$event, ThreadMode::$thread, 256, false); } })*
        }
        mod streaming {
            use super::*;
            $(verbs_test! { fn $name() { stream(EventMode::$event, ThreadMode::$thread, None, false); } })*
        }
        mod srq_ping_pong {
            use super::*;
            $(verbs_test! { fn $name() { ping_pong(EventMode::$event, ThreadMode::$thread, 256, true); } })*
        }
        mod srq_streaming {
            use super::*;
            $(verbs_test! { fn $name() { stream(EventMode::$event, ThreadMode::$thread, None, true); } })*
        }
    };
}

matrix! {
    busy_poll_shared_cq: BusyPoll, SharedCq;
    busy_poll_per_qp: BusyPoll, PerQp;
    blocking_shared_cq: Blocking, SharedCq;
    blocking_per_qp: Blocking, PerQp;
    epoll_shared_cq: Epoll, SharedCq;
    epoll_per_qp: Epoll, PerQp;
}

verbs_test! {
    fn small_and_inline_messages_ping_pong() {
        ping_pong(EventMode::BusyPoll, ThreadMode::SharedCq, 8, false);
    }
}

verbs_test! {
    fn a_slow_receiver_slows_the_sender_without_loss_or_reordering() {
        stream(EventMode::BusyPoll, ThreadMode::PerQp, Some(Duration::from_millis(3)), false);
        stream(EventMode::Blocking, ThreadMode::PerQp, Some(Duration::from_millis(3)), false);
        stream(EventMode::BusyPoll, ThreadMode::PerQp, Some(Duration::from_millis(3)), true);
    }
}

verbs_test! {
    fn the_epoll_fd_embeds_in_an_external_event_loop() {
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        // The echo side runs on its own thread; the pinging side is driven by
        // the caller's loop, which sleeps on the reactor's fd between replies.
        let mut server: Reactor<BoxedHandler> = Reactor::new(&pd, config(EventMode::BusyPoll)).unwrap();
        let mut reactor: Reactor<BoxedHandler> = Reactor::new(&pd, config(EventMode::Epoll)).unwrap();
        let (ping, echo) = add_ping_pong(&pd, Sides::Two { server: &mut server, client: &mut reactor }, PING_ITERS, 64, true);
        let server_stop = server.stopper();
        let server = spawn(server, 0);
        let reactor_fd = reactor.event_fd().expect("epoll mode exposes a descriptor");

        // The caller's own epoll set, with the reactor's fd as one member.
        // SAFETY: plain epoll syscalls on descriptors owned here or by the reactor.
        let outer = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        assert!(outer >= 0);
        let mut event = libc::epoll_event { events: libc::EPOLLIN as u32, u64: 42 };
        // SAFETY: as above.
        assert_eq!(unsafe { libc::epoll_ctl(outer, libc::EPOLL_CTL_ADD, reactor_fd, &mut event) }, 0);

        let start = std::time::Instant::now();
        let mut sleeps = 0u64;
        while !ping.finished.load(Ordering::Acquire) && start.elapsed() < RUN_DEADLINE {
            reactor.poll_once().unwrap();
            if let Some(limit) = reactor.prepare_wait().unwrap() {
                let mut ready = [libc::epoll_event { events: 0, u64: 0 }];
                // No longer than the reactor allows (it may owe a pass).
                let timeout = limit.min(std::time::Duration::from_millis(100));
                // SAFETY: `ready` has room for one event.
                let n = unsafe { libc::epoll_wait(outer, ready.as_mut_ptr(), 1, timeout.as_nanos().div_ceil(1_000_000) as i32) };
                if n == 1 {
                    assert_eq!({ ready[0].u64 }, 42);
                    sleeps += 1;
                }
            }
        }
        // SAFETY: closing the descriptor created above.
        unsafe { libc::close(outer) };
        server_stop.stop();
        server.join().expect("echo reactor thread");
        check("pinger", &ping, PING_ITERS);
        check("echoer", &echo, PING_ITERS);
        assert!(sleeps > 0, "the outer loop slept on the reactor's fd and was woken by it");
        // A completion's event left unconsumed would keep the descriptor
        // readable and wake every later sleep at once: poll_once consumes
        // what woke the loop (a ping brings two completions at most).
        assert!(sleeps <= 3 * PING_ITERS, "{sleeps} wakes for {PING_ITERS} pings");
    }
}

verbs_test! {
    fn removing_a_session_mid_traffic_leaves_the_others_running() {
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        let mut reactor: Reactor<BoxedHandler> = Reactor::new(&pd, config(EventMode::BusyPoll)).unwrap();
        // Sessions 0 (echoer) and 1 (pinger), then 2 (sink) and 3 (streamer).
        let (ping, _echo) = add_ping_pong(&pd, Sides::One(&mut reactor), u64::MAX, 64, true);
        let (sent, received) = add_stream(&pd, Sides::One(&mut reactor), STREAM_MESSAGES, 1000, None, false);
        let ids: Vec<SessionId> = reactor.sessions().collect();
        let echoer = ids[0];
        let started = std::time::Instant::now();
        while ping.done.load(Ordering::Relaxed) < 200 {
            reactor.turn().unwrap();
            assert!(started.elapsed() < RUN_DEADLINE, "the ping-pong did not get going");
        }
        let (link, _handler) = reactor.remove(echoer).expect("the echoer session");
        drop(link);
        assert!(reactor.handler(echoer).is_none());
        assert_eq!(reactor.conns(echoer).count(), 0);
        assert!(reactor.remove(echoer).is_none(), "removed twice");
        // Completions still queued for the removed QP are ignored and the
        // stream is not disturbed; the pinger's peer shows as disconnected on
        // the control connection (its last ping may have been acknowledged
        // already, so the QP alone need not report anything).
        let pinger = ids[1];
        let mut pinger_told = false;
        while !received.finished.load(Ordering::Acquire) || !pinger_told {
            reactor.turn().unwrap();
            if !pinger_told {
                let status = reactor.link_mut(pinger).expect("pinger session").check_peer();
                pinger_told = matches!(status, rdma_comm_core::session::PeerStatus::Disconnected { .. });
            }
            assert!(
                started.elapsed() < RUN_DEADLINE,
                "stuck after the removal: stream {}/{STREAM_MESSAGES}, pinger told {pinger_told}",
                received.done.load(Ordering::Relaxed)
            );
        }
        // The sink may finish while the sender's last completions are still
        // unreported (an unsignaled tail is signaled out once idle): every
        // one of the STREAM_MESSAGES sends must complete, no more, no fewer.
        while sent.done.load(Ordering::Relaxed) < STREAM_MESSAGES {
            reactor.turn().unwrap();
            assert!(
                started.elapsed() < RUN_DEADLINE,
                "the stream sender saw {} of {STREAM_MESSAGES} sends complete",
                sent.done.load(Ordering::Relaxed)
            );
        }
        check("stream sender", &sent, STREAM_MESSAGES);
        check("stream receiver", &received, STREAM_MESSAGES);
        assert_eq!(ping.bad.load(Ordering::Relaxed), 0);
        assert_eq!(reactor.sessions().count(), 3);
        assert!(reactor.remove(pinger).is_some());
        assert_eq!(reactor.sessions().collect::<Vec<_>>(), [ids[2], ids[3]]);
    }
}

verbs_test! {
    fn an_srq_refuses_connections_beyond_its_shares_and_takes_back_removed_ones() {
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        // 160 SRQ receives, 64 per connection: two connections fit, a third does not.
        let mut reactor: Reactor<BoxedHandler> = Reactor::new(&pd, config_srq(EventMode::BusyPoll, true)).unwrap();
        let (_ping, _echo) = add_ping_pong(&pd, Sides::One(&mut reactor), 10, 64, false);
        let mut other: Reactor<BoxedHandler> = Reactor::new(&pd, config(EventMode::BusyPoll)).unwrap();
        let (inbox, _) = regions(&pd, 64);
        let (ours, _theirs) = connect(&pd, &mut Sides::Two { server: &mut reactor, client: &mut other }, &inbox, &inbox);
        let refused = reactor.add(ours, Box::new(Sink::new(1, 1, Default::default())));
        let message = refused.expect_err("a third share does not fit").to_string();
        assert!(message.contains("srq_depth"), "{message}");
        // Removing a session gives its share back.
        let first = reactor.sessions().next().expect("the ping-pong's first session");
        assert!(reactor.remove(first).is_some());
        let (ours, _theirs2) = connect(&pd, &mut Sides::Two { server: &mut reactor, client: &mut other }, &inbox, &inbox);
        reactor.add(ours, Box::new(Sink::new(1, 1, Default::default()))).expect("the freed share");
    }
}

/// Notes `on_established` and sends nothing.
struct Silent(Arc<AtomicBool>);

impl Handler for Silent {
    fn on_established(&mut self, _: &mut Ctx<'_>, _: ConnId) {
        self.0.store(true, Ordering::Release);
    }

    fn on_message(&mut self, _: &mut Ctx<'_>, _: ConnId, _: &[u8], _: Option<u32>) {}
}

verbs_test! {
    /// Through a shared receive queue, the peer's initial credit update can
    /// land before our reactor took the QP: it is then a stranger's
    /// completion there and dropped. Against a peer that never sends, our
    /// side would wait for a credit for good; the peer answers the first
    /// credit it hears with another, so both sides get established.
    fn a_credit_update_lost_before_the_srq_reactor_took_its_qp_is_sent_again() {
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        let mut srq_side: Reactor<BoxedHandler> =
            Reactor::new(&pd, config_srq(EventMode::BusyPoll, true)).unwrap();
        let mut plain_side: Reactor<BoxedHandler> =
            Reactor::new(&pd, config(EventMode::BusyPoll)).unwrap();
        let (server_inbox, _) = regions(&pd, 64);
        let (client_inbox, _) = regions(&pd, 64);
        let (server_ep, client_ep) = connect(
            &pd,
            &mut Sides::Two { server: &mut srq_side, client: &mut plain_side },
            &server_inbox,
            &client_inbox,
        );
        let (srq_up, plain_up) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
        // The plain side first: its initial update reaches the SRQ side's
        // shared queue, whose reactor polls it before it has the QP.
        plain_side.add(client_ep, Box::new(Silent(Arc::clone(&plain_up)))).unwrap();
        let start = std::time::Instant::now();
        while start.elapsed() < Duration::from_millis(500) {
            plain_side.turn().unwrap();
            srq_side.turn().unwrap();
        }
        assert!(!plain_up.load(Ordering::Acquire), "nobody sent the plain side a credit yet");
        srq_side.add(server_ep, Box::new(Silent(Arc::clone(&srq_up)))).unwrap();
        let start = std::time::Instant::now();
        while !(srq_up.load(Ordering::Acquire) && plain_up.load(Ordering::Acquire))
            && start.elapsed() < Duration::from_secs(10)
        {
            plain_side.turn().unwrap();
            srq_side.turn().unwrap();
        }
        assert!(plain_up.load(Ordering::Acquire), "the plain side heard the SRQ side's update");
        assert!(srq_up.load(Ordering::Acquire), "the SRQ side heard a credit after all");
        println!("both sides established after {:?}", start.elapsed());
    }
}

/// A handler for connections that only sit there.
struct Quiet;

impl Handler for Quiet {
    fn on_message(&mut self, _ctx: &mut Ctx<'_>, _conn: ConnId, _data: &[u8], _imm: Option<u32>) {}
}

verbs_test! {
    fn a_busy_connection_among_many_quiet_ones_costs_what_it_costs_alone() {
        // One ping-pong on a reactor that also holds 2 x QUIET_PAIRS quiet
        // connections (both ends of each on the same reactor, like the
        // ping-pong). Before the flush kept its lists, every pass that did
        // work walked all of them; now a pass looks at the connections its
        // completions and handlers touched (and, when idle, those parked
        // with work for later), so visits per pass must not grow with the
        // quiet ones.
        const QUIET_PAIRS: usize = 24;
        let ctx = open_device();
        let pd = ctx.alloc_pd().unwrap();
        let config = config(EventMode::BusyPoll).absorbing(2 * QUIET_PAIRS as u32 + 2);
        let mut reactor: Reactor<BoxedHandler> = Reactor::new(&pd, config).unwrap();
        for _ in 0..QUIET_PAIRS {
            let (server_inbox, _) = regions(&pd, 64);
            let (client_inbox, _) = regions(&pd, 64);
            let (server_ep, client_ep) =
                connect(&pd, &mut Sides::One(&mut reactor), &server_inbox, &client_inbox);
            reactor.add(server_ep, Box::new(Quiet)).unwrap();
            reactor.add(client_ep, Box::new(Quiet)).unwrap();
        }
        // Let the quiet ones settle (initial credit updates and their answers).
        let settle = std::time::Instant::now();
        while settle.elapsed() < Duration::from_millis(300) {
            reactor.poll_once().unwrap();
        }
        let (ping, echo) = add_ping_pong(&pd, Sides::One(&mut reactor), PING_ITERS, 64, true);
        let before = reactor.counters();
        let cancel = watchdog(vec![reactor.stopper()], RUN_DEADLINE);
        reactor.run().unwrap();
        cancel.disarm();
        check("pinger", &ping, PING_ITERS);
        check("echoer", &echo, PING_ITERS);
        let after = reactor.counters();
        let passes = after.passes - before.passes;
        let busy_passes = passes - (after.empty_passes - before.empty_passes);
        let visits = after.flush_visits - before.flush_visits;
        let connections = 2 * QUIET_PAIRS as u64 + 2;
        eprintln!(
            "{visits} flush visits over {passes} passes ({busy_passes} with completions), {connections} connections"
        );
        // The two ping-pong ends are all a pass has to look at (each maybe
        // twice: touched, then parked); walking everyone would be at least
        // `connections` per busy pass.
        assert!(
            visits <= 4 * busy_passes.max(1) + 4 * (passes - busy_passes),
            "{visits} visits for {busy_passes} busy of {passes} passes: the flush walks the quiet connections"
        );
        assert!(visits < busy_passes * connections / 4, "{visits} visits: no better than a walk");
    }
}
