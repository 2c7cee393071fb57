//! Tail signaling under sparse traffic: what goes out after a quiet
//! spell is signaled as it is posted, so no credit update has to follow
//! it to signal out a tail.

use super::*;
use crate::reactor::idle::TAIL_SIGNAL_IDLE_PASSES;

/// Round trips in each test.
const ROUND_TRIPS: usize = 20;

/// Empty passes between requests: past the point where an idle reactor
/// signals out unsignaled tails.
const QUIET_PASSES: u32 = 2 * TAIL_SIGNAL_IDLE_PASSES;

/// Sparse request/response, the requester sending from outside a pass
/// (as a timer would) and the responder answering from `on_message`:
/// each round trip posts its request and its answer and nothing else.
/// Before, each side's last request stayed unsignaled until the idle
/// reactor signaled it out with a credit update, which doubled what went
/// on the wire and made the peer take a receive for nothing.
///
/// The count is exact on the loopback device, which completes a request
/// in the pass that posts it: the answer goes out in the pass that ends
/// the quiet spell. On a NIC a send completion may land in a pass of its
/// own, ahead of the answer: the next test.
#[test]
fn sparse_round_trips_post_no_credit_updates_to_signal_their_tails() {
    // SAFETY: every QP of the device is served from this thread.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().expect("a PD");
    let (mut reactor, client, server) = echoing_pair(&pd);
    quiet(&mut reactor);
    let before = reactor.counters();
    for round in 0..ROUND_TRIPS {
        send(&mut reactor, client.conn, &[round as u8; 8]);
        run_until(&mut reactor, "the answer", |_| {
            client.seen.borrow().messages.len() == round + 1
        });
        quiet(&mut reactor);
    }
    let after = reactor.counters();
    let requests = after.requests - before.requests;
    assert_eq!(
        requests,
        2 * ROUND_TRIPS as u64,
        "a request and an answer per round trip, no tail signals"
    );
    let completions = after.completions - before.completions;
    // Each message's receive, and the signaled send completion of each:
    // every send completes, so no slot or SQ entry is held by a tail.
    assert_eq!(completions, 4 * ROUND_TRIPS as u64);
    holds_no_tail(&reactor, &[&client, &server]);
}

/// A quiet spell ended by a completion that posts nothing (on a NIC, a
/// request's own send completion, ahead of its answer) leaves traffic
/// sparse until something is posted: the follow-up a handler posts on the
/// answer, passes later, is signaled too, so no credit update has to
/// signal it out once the reactor is quiet again.
#[test]
fn a_follow_up_posted_after_the_spell_ended_leaves_no_tail() {
    // SAFETY: every QP of the device is served from this thread.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().expect("a PD");
    let mut client = reactor(&pd);
    let mut server = reactor(&pd);
    let (asker, answerer) = add_pair_across(&mut client, &mut server, &pd);
    // The asker follows every answer up with a copy of it; the answerer
    // answers from outside its passes (as a timer would) and echoes nothing.
    asker.seen.borrow_mut().echo = true;
    quiet_both(&mut client, &mut server);
    let before = client.counters();
    for round in 0..ROUND_TRIPS {
        send(&mut client, asker.conn, &[round as u8; 8]);
        // The request goes out, then its send completion ends the
        // client's quiet spell in a pass of its own.
        client.turn().expect("a reactor pass");
        client.turn().expect("a reactor pass");
        run_until(&mut server, "the request", |_| {
            answerer.seen.borrow().messages.len() == 2 * round + 1
        });
        send_now(&mut server, answerer.conn, &[round as u8; 8]);
        // The answer lands, and the follow-up is posted, passes after the
        // spell ended.
        run_until(&mut client, "the answer", |_| {
            asker.seen.borrow().messages.len() == round + 1
        });
        run_until(&mut server, "the follow-up", |_| {
            answerer.seen.borrow().messages.len() == 2 * round + 2
        });
        quiet_both(&mut client, &mut server);
    }
    let after = client.counters();
    assert_eq!(
        after.requests - before.requests,
        2 * ROUND_TRIPS as u64,
        "a request and a follow-up per round trip, no tail signals"
    );
    // The answer's receive, and the signaled send completion of the
    // request and of the follow-up: nothing is left as a tail.
    assert_eq!(
        after.completions - before.completions,
        3 * ROUND_TRIPS as u64
    );
    holds_no_tail(&client, &[&asker]);
    holds_no_tail(&server, &[&answerer]);
}

/// A spell ended by another connection's message: a connection whose
/// last doorbell was on busy traffic (its echo in the round before) counts
/// as sparse again once the reactor has been quiet, so the echo it posts
/// on a message landing passes after the spell ended is signaled too.
#[test]
fn an_echo_after_another_connection_ended_the_spell_leaves_no_tail() {
    // SAFETY: every QP of the device is served from this thread.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().expect("a PD");
    let mut client = reactor(&pd);
    let mut server = reactor(&pd);
    let (echoing, echoed) = add_pair_across(&mut client, &mut server, &pd);
    let (woken, waking) = add_pair_across(&mut client, &mut server, &pd);
    echoing.seen.borrow_mut().echo = true;
    quiet_both(&mut client, &mut server);
    let before = client.counters();
    for round in 0..ROUND_TRIPS {
        // A message on the other connection ends the client's spell ...
        send_now(&mut server, waking.conn, &[round as u8; 8]);
        run_until(&mut client, "the waking message", |_| {
            woken.seen.borrow().messages.len() == round + 1
        });
        client.turn().expect("a reactor pass");
        // ... and the echoed one lands passes later.
        send_now(&mut server, echoed.conn, &[round as u8; 8]);
        run_until(&mut client, "the echoed message", |_| {
            echoing.seen.borrow().messages.len() == round + 1
        });
        run_until(&mut server, "the echo", |_| {
            echoed.seen.borrow().messages.len() == round + 1
        });
        quiet_both(&mut client, &mut server);
    }
    let requests = client.counters().requests - before.requests;
    // The echoes, and the credit updates the woken connection owes for its
    // receives (one per quarter of its receive ring): no tail signals.
    let credit_updates = ROUND_TRIPS as u64 / u64::from(RECV_DEPTH / 4);
    assert_eq!(requests, ROUND_TRIPS as u64 + credit_updates);
    holds_no_tail(&client, &[&echoing, &woken]);
}

/// Busy traffic keeps selective signaling: a burst of messages answered
/// back to back signals about one request in the signal interval, not
/// each.
#[test]
fn a_burst_is_still_signaled_selectively() {
    // SAFETY: every QP of the device is served from this thread.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().expect("a PD");
    let (mut reactor, client, _server) = echoing_pair(&pd);
    // Not quiet: the burst starts right after the handshake's passes.
    let before = reactor.counters();
    let burst = 64;
    for i in 0..burst {
        send(&mut reactor, client.conn, &[i as u8; 8]);
        reactor.turn().expect("a reactor pass");
    }
    run_until(&mut reactor, "every answer", |_| {
        client.seen.borrow().messages.len() == burst
    });
    let after = reactor.counters();
    let completions = after.completions - before.completions;
    // 2 * burst receives; a signaled send per signal interval (16) or so
    // on each side, and the credit updates among them: far fewer than a
    // completion per send.
    assert!(
        completions < 2 * burst as u64 + burst as u64 / 2,
        "{completions} completions for {burst} round trips: sends were signaled one by one"
    );
}

/// A reactor holding a connected pair: a client end, and a server end
/// that answers each message with a copy.
fn echoing_pair(pd: &ProtectionDomain) -> (Reactor<Probe, ()>, End, End) {
    let mut reactor = reactor(pd);
    let (client, server) = add_pair(&mut reactor, pd);
    server.seen.borrow_mut().echo = true;
    (reactor, client, server)
}

/// Runs empty passes until the reactor has been idle past the tail
/// signaling point, failing if anything still completes then.
#[track_caller]
fn quiet(reactor: &mut Reactor<Probe, ()>) {
    for _ in 0..QUIET_PASSES {
        reactor.turn().expect("a reactor pass");
    }
    let before = reactor.counters();
    reactor.turn().expect("a reactor pass");
    assert_eq!(
        reactor.counters().completions,
        before.completions,
        "still busy after {QUIET_PASSES} passes"
    );
}

/// Both reactors quiet (see [`quiet`]).
#[track_caller]
fn quiet_both(one: &mut Reactor<Probe, ()>, other: &mut Reactor<Probe, ()>) {
    quiet(one);
    quiet(other);
}

/// Sends `data` on `conn` from outside a pass (as a timer would), and
/// runs the pass that posts it.
#[track_caller]
fn send_now(reactor: &mut Reactor<Probe, ()>, conn: ConnId, data: &[u8]) {
    send(reactor, conn, data);
    reactor.turn().expect("a reactor pass");
}

/// Fails if a connection of `ends` still holds a send-queue entry: an
/// unsignaled tail that only a credit update would have signaled out.
#[track_caller]
fn holds_no_tail(reactor: &Reactor<Probe, ()>, ends: &[&End]) {
    for end in ends {
        let sq_in_flight = reactor
            .conn_stats(end.conn)
            .expect("a live connection")
            .sq_used;
        assert_eq!(
            sq_in_flight, 0,
            "a quiet connection holds no send-queue entry"
        );
    }
}
