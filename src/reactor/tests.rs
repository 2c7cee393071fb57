//! The reactor's failure paths over the loopback device, where a test can
//! make a provider refuse part of a posted list (which a NIC does when its
//! queue fills mid-list) and look at what each connection holds.

use std::cell::RefCell;
use std::collections::BTreeSet;
use std::rc::Rc;

use crate::error::Error;
use crate::session::CqChoice;
use crate::verbs::{AccessFlags, Context, ProtectionDomain, QueuePair, refuse_sends_after};

use super::{ConnId, Ctx, Handler, HeldRecv, Reactor, ReactorConfig, SessionId};

/// Passes a test waits for something before failing.
const MAX_PASSES: usize = 100_000;
/// Receive slots per connection.
const RECV_DEPTH: u32 = 16;

/// What one session's handler saw.
#[derive(Debug, Default)]
struct Seen {
    established: bool,
    messages: Vec<Vec<u8>>,
    /// Messages kept while `hold` is set.
    held: Vec<HeldRecv>,
    hold: bool,
    /// Every error's errno (if it has one) and text.
    errors: Vec<(Option<i32>, String)>,
}

#[derive(Debug, Default)]
struct Probe(Rc<RefCell<Seen>>);

impl Handler for Probe {
    fn on_established(&mut self, _: &mut Ctx<'_>, _: ConnId) {
        self.0.borrow_mut().established = true;
    }
    fn on_message(&mut self, ctx: &mut Ctx<'_>, _: ConnId, data: &[u8], _: Option<u32>) {
        let mut seen = self.0.borrow_mut();
        seen.messages.push(data.to_vec());
        if seen.hold {
            let held = ctx.hold().expect("in on_message");
            seen.held.push(held);
        }
    }
    fn on_error(&mut self, _: &mut Ctx<'_>, _: ConnId, error: &Error) {
        let errors = &mut self.0.borrow_mut().errors;
        errors.push((error.errno(), error.to_string()));
    }
}

struct End {
    conn: ConnId,
    seen: Rc<RefCell<Seen>>,
}

fn reactor(pd: &ProtectionDomain) -> Reactor<Probe, ()> {
    let config = ReactorConfig {
        slot_size: 64,
        recv_depth: RECV_DEPTH,
        send_slots: 16,
        sq_depth: 64,
        ..ReactorConfig::default()
    };
    Reactor::new(pd, config).expect("a reactor on the loopback device")
}

/// Two sessions of one connection each, connected to each other and
/// established.
fn add_pair(reactor: &mut Reactor<Probe, ()>, pd: &ProtectionDomain) -> (End, End) {
    let access = AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
    let mut qp = |name: &str| {
        let spec = reactor.qp_spec_with_access(name, access);
        let CqChoice::Shared(cq) = spec.cq else {
            panic!("qp_spec did not share the reactor's CQ");
        };
        pd.create_qp(&cq, &cq, &spec.qp).expect("a loopback QP")
    };
    let (mut a, mut b) = (qp("a"), qp("b"));
    let (to_a, to_b) = (a.endpoint(), b.endpoint());
    a.connect(&to_b).expect("connect");
    b.connect(&to_a).expect("connect");
    let mut add = |qp: QueuePair| {
        let seen = Rc::new(RefCell::new(Seen::default()));
        let session: SessionId = reactor.add(vec![qp], Probe(Rc::clone(&seen))).expect("add");
        let conn = reactor.conns(session).next().expect("one connection");
        End { conn, seen }
    };
    let (a, b) = (add(a), add(b));
    run_until(reactor, "both ends established", |_| {
        a.seen.borrow().established && b.seen.borrow().established
    });
    (a, b)
}

#[track_caller]
fn run_until(
    reactor: &mut Reactor<Probe, ()>,
    what: &str,
    mut done: impl FnMut(&Reactor<Probe, ()>) -> bool,
) {
    for _ in 0..MAX_PASSES {
        if done(reactor) {
            return;
        }
        reactor.turn().expect("a reactor pass");
    }
    panic!("not within {MAX_PASSES} passes: {what}");
}

/// Sends `data` on `conn`, running passes while its credits are spent.
#[track_caller]
fn send(reactor: &mut Reactor<Probe, ()>, conn: ConnId, data: &[u8]) {
    for _ in 0..MAX_PASSES {
        match reactor.with_ctx(|ctx| ctx.send(conn, data, None)) {
            Ok(_) => return,
            Err(super::SendError::WouldBlock) => {
                reactor.turn().expect("a reactor pass");
            }
            Err(err) => panic!("sending: {err}"),
        }
    }
    panic!("no credit within {MAX_PASSES} passes");
}

/// How many receives of `conn`'s own ring are posted, and the slots
/// queued for reposting, each of which must be queued once.
#[track_caller]
fn ring_account(reactor: &Reactor<Probe, ()>, conn: ConnId) -> (u32, BTreeSet<u32>) {
    let conn = reactor.conns.get(conn.key()).expect("a live connection");
    let mut queued = BTreeSet::new();
    for &slot in conn.pending_slots() {
        assert!(queued.insert(slot), "slot {slot} queued twice");
    }
    (conn.receives_outstanding(), queued)
}

/// A batch the provider takes only in part: the requests it never got
/// give back what they hold in the same pass (a forward's receive slot
/// goes back to the connection it came from, a SEND's slot is freed), and
/// those it got keep theirs until the flushed completion behind them is
/// polled, since the device may still read that memory. Every slot comes
/// back exactly once, and the other sessions keep running.
#[test]
fn a_partial_post_frees_at_once_only_what_the_device_never_got() {
    // SAFETY: every QP of the device is served from this thread.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().expect("a PD");
    let mut reactor = reactor(&pd);
    let (origin, source) = add_pair(&mut reactor, &pd);
    let (relay, sink) = add_pair(&mut reactor, &pd);

    // Four messages held on `origin`, to forward on `relay`.
    origin.seen.borrow_mut().hold = true;
    for i in 1..=4u8 {
        send(&mut reactor, source.conn, &[i; 8]);
    }
    run_until(&mut reactor, "four messages held", |_| {
        origin.seen.borrow().held.len() == 4
    });
    origin.seen.borrow_mut().hold = false;
    let held = std::mem::take(&mut origin.seen.borrow_mut().held);
    let slots: Vec<u32> = held.iter().map(HeldRecv::slot).collect();
    let (outstanding, queued) = ring_account(&reactor, origin.conn);
    assert_eq!(
        outstanding as usize + queued.len() + held.len(),
        RECV_DEPTH as usize,
        "before: every slot is posted, queued or held once"
    );

    // Its credit update, unsignaled, is still on the send queue.
    let (sq_in_flight, _, _) = reactor.conn_stats(relay.conn).expect("relay");
    // One doorbell's worth on `relay`: forward, forward, SEND, forward,
    // forward. The provider takes the first two.
    reactor.with_ctx(|ctx| {
        for (i, held) in held.into_iter().enumerate() {
            if i == 2 {
                ctx.send(relay.conn, b"plain", None).expect("a SEND staged");
            }
            if let Err((err, _)) = ctx.forward(relay.conn, held, None) {
                panic!("forwarding: {err}");
            }
        }
    });
    let relay_qpn = reactor.conns.get(relay.conn.key()).expect("relay").qpn;
    refuse_sends_after(relay_qpn, 2);
    reactor.turn().expect("the pass that posts");

    {
        let seen = relay.seen.borrow();
        assert_eq!(seen.errors.len(), 1, "the relay is told once");
        let (errno, text) = &seen.errors[0];
        assert_eq!(*errno, Some(libc::ENOMEM), "{text}");
        assert!(
            text.contains(&format!("{relay_qpn:#x}")) || text.contains(&relay_qpn.to_string()),
            "names the QP: {text}"
        );
    }
    // The two forwards the device never got gave their slots back; the
    // two it got still hold theirs (posted: only their flush tells).
    let (sq_used, sends_in_use, _) = reactor.conn_stats(relay.conn).expect("relay");
    assert_eq!(
        sq_used,
        sq_in_flight + 2,
        "the posted forwards wait for their flush"
    );
    assert_eq!(sends_in_use, 0, "the unposted SEND's slot is free");
    let (outstanding, queued) = ring_account(&reactor, origin.conn);
    for slot in &slots[..2] {
        assert!(!queued.contains(slot), "slot {slot} back while posted");
    }
    assert_eq!(
        outstanding as usize + queued.len(),
        RECV_DEPTH as usize - 2,
        "after the failed post: all but the two posted forwards' slots"
    );

    // The flushed completion behind the posted ones gives theirs back.
    run_until(&mut reactor, "the relay's flush polled", |reactor| {
        reactor.conn_stats(relay.conn).expect("relay").0 == 0
    });
    let (outstanding, queued) = ring_account(&reactor, origin.conn);
    assert_eq!(
        outstanding as usize + queued.len(),
        RECV_DEPTH as usize,
        "every slot back exactly once"
    );
    assert_eq!(
        relay.seen.borrow().errors.len(),
        1,
        "the flush is no second error"
    );
    // What the device got arrived.
    run_until(&mut reactor, "the posted forwards delivered", |_| {
        sink.seen.borrow().messages.len() == 2
    });
    assert_eq!(sink.seen.borrow().messages, [vec![1; 8], vec![2; 8]]);

    // The origin's ring is whole: it takes more messages than it has slots.
    let before = origin.seen.borrow().messages.len();
    for i in 0..3 * RECV_DEPTH {
        send(&mut reactor, source.conn, &i.to_le_bytes());
    }
    run_until(&mut reactor, "the origin takes three rings' worth", |_| {
        origin.seen.borrow().messages.len() == before + 3 * RECV_DEPTH as usize
    });
    let seen = origin.seen.borrow();
    for (i, message) in seen.messages[before..].iter().enumerate() {
        assert_eq!(message, &(i as u32).to_le_bytes(), "message {i}");
    }
    assert!(seen.errors.is_empty() && source.seen.borrow().errors.is_empty());
}
