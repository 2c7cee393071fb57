//! Spins (`Ctx::spin`) over the loopback device: a direct connection's
//! handler polls the reactor's CQs itself from `on_idle`, gets its own
//! successful completions with its ids, and nothing else: the first
//! completion that is another connection's, a stranger's or a failure
//! ends the spin and reaches its owner through the reactor, in order.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::{Duration, Instant};

use crate::verbs::{
    AccessFlags, Context, Kept, ProtectionDomain, RecvRequest, WcOpcode, WorkRequest,
};

use super::super::table::wr_id::direct_send_tag;
use super::super::{Ctx, Reactor, SPIN_POLLS, SendError, Spun};
use super::direct::{Direct, End, IdlePlan, direct_pair, protocol_pair, reactor, run_until};
use super::{connected_qps, ignored};

/// What a spin handed over: (id, opcode) of each completion, its empty
/// polls, and whether it ended.
#[derive(Debug, Default)]
struct Seen_ {
    taken: Vec<(u32, WcOpcode)>,
    empty_polls: u32,
    ended: bool,
}

type Seen = Rc<RefCell<Seen_>>;

/// Polls `spin` until it ends or hands over `want` completions, writing
/// down what it saw.
fn drain(spin: &mut super::super::Spin<'_>, seen: &Seen, want: usize) {
    while seen.borrow().taken.len() < want {
        match spin.poll() {
            Spun::Completion(id, wc) => seen.borrow_mut().taken.push((id, wc.opcode())),
            Spun::Empty => seen.borrow_mut().empty_polls += 1,
            Spun::Ended => {
                seen.borrow_mut().ended = true;
                return;
            }
        }
    }
}

/// A's signaled READ of B's first 8 bytes into A's bytes 256.., with `id`.
fn read_request(a: &End, b: &End, id: u64) -> Kept<WorkRequest<'static>> {
    let remote = b.region.remote().unwrap().slice(0, 8).unwrap();
    let read = WorkRequest::read(id, a.region.slice(256, 8).unwrap(), remote)
        .unwrap()
        .signaled();
    Kept::new(read, &[a.region.registration()]).unwrap()
}

/// A reactor of direct connections only, on the loopback device, with a
/// direct pair on it (and the PD, for more).
fn lean_pair() -> (ProtectionDomain, Reactor<Direct, ()>, End, End) {
    // SAFETY: every QP of the device is served from this thread.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().expect("a PD");
    let mut reactor = reactor(&pd);
    let (a, b) = direct_pair(&mut reactor, &pd);
    (pd, reactor, a, b)
}

/// One idle pass in which `end` spins, posts `request` and polls until
/// the spin hands over `want` completions or ends (and stays ended).
fn post_in_a_spin(
    reactor: &mut Reactor<Direct, ()>,
    end: &End,
    mut request: Kept<WorkRequest<'static>>,
    want: usize,
) -> Seen {
    let (conn, seen) = (end.conn, Seen::default());
    let seen_in = Rc::clone(&seen);
    plan(end, move |ctx| {
        let mut spin = ctx.spin(conn).expect("a spin");
        spin.qp().post_send(&mut request).expect("a post");
        drain(&mut spin, &seen_in, want);
        if seen_in.borrow().ended {
            assert!(matches!(spin.poll(), Spun::Ended), "ended for good");
        }
        false
    });
    idle_pass(reactor);
    seen
}

/// A receive posted on B (id 9) and A's signaled 8-byte SEND to it (id
/// 0x11), for A to post.
fn send_to(reactor: &mut Reactor<Direct, ()>, a: &End, b: &End) -> Kept<WorkRequest<'static>> {
    reactor.with_ctx(|ctx| {
        let mut recv = RecvRequest::new(9, b.region.slice(0, 8).unwrap()).unwrap();
        ctx.direct(b.conn).unwrap().post_recv(&mut recv).unwrap();
    });
    let send = WorkRequest::send(0x11, a.region.slice(0, 8).unwrap()).signaled();
    Kept::new(send, &[a.region.registration()]).unwrap()
}

/// Posts every one of `reads` in `spin` (each completes inside its post
/// on the loopback device), then takes the first completion back.
fn post_all_and_take_one(
    spin: &mut super::super::Spin<'_>,
    reads: &mut [Kept<WorkRequest<'static>>],
    seen: &Seen,
) {
    for read in reads {
        spin.qp().post_send(read).expect("a READ");
    }
    drain(spin, seen, 1);
}

/// (id, opcode) of each completion `end`'s handler was told of.
fn ids_and_opcodes(end: &End) -> Vec<(u32, WcOpcode)> {
    let log = end.log.borrow();
    log.completions.iter().map(|c| (c.0, c.1)).collect()
}

/// Sets `end`'s idle plan.
fn plan(end: &End, plan: impl FnMut(&mut Ctx<'_>) -> bool + 'static) {
    end.log.borrow_mut().idle_plan = Some(IdlePlan(Box::new(plan)));
}

/// What the idle callback of `log`'s handler is told when it asks for a
/// spin on `conn` (`None`: it was lent one).
fn spin_refusal(
    reactor: &mut Reactor<Direct, ()>,
    log: &Rc<RefCell<super::direct::Log>>,
    conn: crate::reactor::ConnId,
) -> Option<SendError> {
    let refused = Rc::new(RefCell::new(None));
    let refused_in = Rc::clone(&refused);
    log.borrow_mut().idle_plan = Some(IdlePlan(Box::new(move |ctx| {
        *refused_in.borrow_mut() = Some(ctx.spin(conn).err());
        false
    })));
    run_until(reactor, "an idle pass", || refused.borrow().is_some());
    refused.take().flatten()
}

/// One pass, which must be idle, so its `on_idle` runs the plans.
fn idle_pass(reactor: &mut Reactor<Direct, ()>) {
    reactor.poll_once().expect("a pass");
}

/// A READ loop inside one spin: every completion comes back through the
/// spin, with the handler's id, none through `on_direct_completion`, and
/// the bytes land.
#[test]
fn a_spin_hands_its_handler_its_own_completions() {
    let (_pd, mut reactor, a, mut b) = lean_pair();
    b.region.write(0, b"spinning").unwrap();
    let seen = Seen::default();
    let (conn, mut read, seen_in) = (a.conn, read_request(&a, &b, 0x33), Rc::clone(&seen));
    plan(&a, move |ctx| {
        let mut spin = ctx.spin(conn).expect("a spin from on_idle");
        for round in 1..=100 {
            spin.qp().post_send(&mut read).expect("a READ");
            drain(&mut spin, &seen_in, round);
        }
        false
    });
    let before = reactor.counters();
    idle_pass(&mut reactor);
    let seen = seen.borrow();
    assert!(!seen.ended, "the spin ran its course");
    assert_eq!(seen.taken, vec![(0x33, WcOpcode::RDMA_READ); 100]);
    assert!(a.log.borrow().completions.is_empty(), "none went round");
    assert_eq!(reactor.counters().completions - before.completions, 100);
    assert_eq!(
        reactor.counters().empty_passes,
        before.empty_passes,
        "a pass whose spin took completions is no empty pass"
    );
    let mut landed = [0u8; 8];
    a.region.read(256, &mut landed).unwrap();
    assert_eq!(&landed, b"spinning");
}

/// A's SEND to B on the shared CQ: B's receive is not A's, so the spin
/// ends there and B's handler gets it; A's own completion comes exactly
/// once, through the spin or after it, and a spin that ended stays ended.
#[test]
fn another_connections_completion_ends_the_spin_and_reaches_its_handler() {
    let (_pd, mut reactor, a, b) = lean_pair();
    let send = send_to(&mut reactor, &a, &b);
    let seen = post_in_a_spin(&mut reactor, &a, send, 2);
    let seen = seen.borrow();
    assert!(seen.ended, "B's receive ended A's spin");
    assert_eq!(b.log.borrow().completions, [(9, WcOpcode::RECV, 8)]);
    let a_after = ids_and_opcodes(&a);
    let all_of_a: Vec<_> = seen.taken.iter().copied().chain(a_after).collect();
    assert_eq!(all_of_a, [(0x11, WcOpcode::SEND)], "A's SEND, once");
}

/// A QP on the reactor's CQ that was never added (a stranger's) posts a
/// request whose `wr_id` carries A's very tag: its completion ends A's
/// spin (the QP number is not A's), reaches no handler and is counted as
/// foreign.
#[test]
fn a_strangers_completion_with_a_copied_tag_ends_the_spin() {
    let (pd, mut reactor, a, b) = lean_pair();
    let [mut stranger, _peer] = connected_qps(&mut reactor, &pd, AccessFlags::REMOTE_WRITE);
    let source = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    let target = pd
        .alloc_mr(64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
        .unwrap();
    let forged = direct_send_tag(a.conn.key()) | 0x44;
    let (foreign_before, _) = ignored(&reactor);
    let (conn, seen) = (a.conn, Seen::default());
    let seen_in = Rc::clone(&seen);
    plan(&a, move |ctx| {
        let mut spin = ctx.spin(conn).expect("a spin");
        // Posted while A spins, onto the CQ A polls.
        let remote = target.remote().unwrap().slice(0, 8).unwrap();
        let mut write = WorkRequest::write(forged, source.slice(0, 8).unwrap(), remote)
            .unwrap()
            .signaled();
        stranger
            .post_send(&mut write)
            .expect("the stranger's WRITE");
        drain(&mut spin, &seen_in, 1);
        false
    });
    idle_pass(&mut reactor);
    assert!(seen.borrow().ended && seen.borrow().taken.is_empty());
    assert!(a.log.borrow().completions.is_empty());
    assert!(b.log.borrow().completions.is_empty());
    assert_eq!(ignored(&reactor).0, foreign_before + 1);
}

/// A failed completion is not handed over: it ends the spin, and the
/// reactor fails the connection, telling its handler once; a failed
/// connection lends no spin.
#[test]
fn a_failed_completion_ends_the_spin_and_fails_the_connection_once() {
    let (pd, mut reactor, a, b) = lean_pair();
    // A READ of memory that allows no remote reads: A's own completion
    // fails.
    let closed = pd
        .alloc_mr(64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
        .unwrap();
    let remote = closed.remote().unwrap().slice(0, 8).unwrap();
    let read = WorkRequest::read(2, a.region.slice(0, 8).unwrap(), remote)
        .unwrap()
        .signaled();
    let read = Kept::new(read, &[a.region.registration()]).unwrap();
    let conn = a.conn;
    let seen = post_in_a_spin(&mut reactor, &a, read, 1);
    for _ in 0..100 {
        reactor.turn().unwrap();
    }
    assert!(seen.borrow().ended && seen.borrow().taken.is_empty());
    let errors = a.log.borrow().errors.clone();
    assert_eq!(errors.len(), 1, "told once: {errors:?}");
    assert!(a.log.borrow().completions.is_empty());
    assert!(
        b.log.borrow().errors.is_empty(),
        "the READ's target is not B's"
    );
    assert!(matches!(
        spin_refusal(&mut reactor, &a.log, conn),
        Some(SendError::Closed)
    ));
}

/// A CQ poll that fails inside a spin ends it, and the pass returns the
/// error with the device and the provider's code; what that poll left
/// queued (the loopback device drops nothing) reaches the handler at the
/// next pass, once, and the connection spins on.
#[test]
fn a_failed_cq_poll_ends_the_spin_and_the_pass_reports_it() {
    let (_pd, mut reactor, a, b) = lean_pair();
    let read = read_request(&a, &b, 4);
    let (conn, seen) = (a.conn, Seen::default());
    let seen_in = Rc::clone(&seen);
    let mut read_in = Some(read);
    plan(&a, move |ctx| {
        let Some(mut read) = read_in.take() else {
            return false;
        };
        let mut spin = ctx.spin(conn).expect("a spin");
        spin.qp().post_send(&mut read).expect("a READ");
        crate::verbs::fail_next_polls(1);
        drain(&mut spin, &seen_in, 1);
        assert!(matches!(spin.poll(), Spun::Ended), "ended for good");
        false
    });
    let error = reactor
        .poll_once()
        .expect_err("the pass reports the failed poll");
    crate::verbs::fail_next_polls(0);
    assert!(
        matches!(&error, crate::Error::CqPoll { device, code } if &**device == "loopback" && *code == -libc::EIO),
        "names the device and what the poll returned: {error:?}"
    );
    assert!(error.to_string().contains("ibv_poll_cq"), "{error}");
    assert!(seen.borrow().ended && seen.borrow().taken.is_empty());
    assert!(a.log.borrow().completions.is_empty(), "not told yet");
    for _ in 0..10 {
        reactor.turn().unwrap();
    }
    assert_eq!(
        a.log.borrow().completions,
        [(4, WcOpcode::RDMA_READ, 8)],
        "the READ the failed poll left, once, the usual way"
    );
    assert!(a.log.borrow().errors.is_empty() && b.log.borrow().errors.is_empty());
    let seen = post_in_a_spin(&mut reactor, &a, read_request(&a, &b, 5), 1);
    assert_eq!(seen.borrow().taken, [(5, WcOpcode::RDMA_READ)], "spins on");
}

/// A spin is lent only in `on_idle`, and only for a direct connection.
#[test]
fn a_spin_is_lent_only_in_on_idle_for_a_direct_connection() {
    let (pd, mut reactor, a, _b) = lean_pair();
    reactor.with_ctx(|ctx| {
        assert!(matches!(ctx.spin(a.conn), Err(SendError::Invalid(_))));
    });
    let [(session, protocol), _] = protocol_pair(&mut reactor, &pd);
    let conn = reactor.conns(session).next().expect("a connection");
    assert!(matches!(
        spin_refusal(&mut reactor, &protocol, conn),
        Some(SendError::Invalid(_))
    ));
}

/// A spin that finds nothing ends after its poll budget; one in a reactor
/// asked to stop ends at once.
#[test]
fn a_spin_ends_after_its_budget_and_when_the_reactor_stops() {
    let (_pd, mut reactor, a, _b) = lean_pair();
    for stopping in [false, true] {
        let (conn, seen) = (a.conn, Seen::default());
        let seen_in = Rc::clone(&seen);
        plan(&a, move |ctx| {
            let mut spin = ctx.spin(conn).expect("a spin");
            drain(&mut spin, &seen_in, 1);
            false
        });
        if stopping {
            reactor.stopper().stop();
        }
        idle_pass(&mut reactor);
        let seen = seen.borrow();
        assert!(seen.ended);
        let want = if stopping { 0 } else { SPIN_POLLS };
        assert_eq!(seen.empty_polls, want, "stopping: {stopping}");
    }
}

/// What a spin polled and did not hand over before it was dropped reaches
/// the handler after `on_idle`, in order; until then no other spin is lent.
#[test]
fn what_a_spin_left_reaches_the_handler_in_order() {
    let (_pd, mut reactor, a, b) = lean_pair();
    let mut reads = [1, 2, 3].map(|id| read_request(&a, &b, id));
    let (conn, seen) = (a.conn, Seen::default());
    let seen_in = Rc::clone(&seen);
    let again = Rc::new(RefCell::new(None));
    let again_in = Rc::clone(&again);
    plan(&a, move |ctx| {
        let mut spin = ctx.spin(conn).expect("a spin");
        post_all_and_take_one(&mut spin, &mut reads, &seen_in);
        drop(spin);
        *again_in.borrow_mut() = Some(ctx.spin(conn).err());
        false
    });
    idle_pass(&mut reactor);
    assert_eq!(seen.borrow().taken, [(1, WcOpcode::RDMA_READ)]);
    assert!(matches!(*again.borrow(), Some(Some(SendError::WouldBlock))));
    assert_eq!(
        a.log.borrow().completions,
        [(2, WcOpcode::RDMA_READ, 8), (3, WcOpcode::RDMA_READ, 8)],
        "the rest after on_idle, in order"
    );
}

/// A handler that panics inside a spin, caught around the pass by a
/// caller that goes on: what the spin polled and did not hand over is
/// dropped, as a panic drops the rest of a pass's batch, never told late
/// or twice, whether the reactor stays lean or turns full (a protocol
/// connection added after the panic); the connection goes on.
#[test]
fn a_panic_inside_a_spin_loses_and_repeats_nothing() {
    for then_full in [false, true] {
        let (pd, mut reactor, a, b) = lean_pair();
        let mut reads = [1, 2, 3].map(|id| read_request(&a, &b, id));
        let (conn, seen) = (a.conn, Seen::default());
        let seen_in = Rc::clone(&seen);
        plan(&a, move |ctx| {
            let mut spin = ctx.spin(conn).expect("a spin");
            post_all_and_take_one(&mut spin, &mut reads, &seen_in);
            panic!("a handler's bug, inside its spin");
        });
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| reactor.poll_once()));
        assert!(caught.is_err(), "the handler panicked");
        if then_full {
            let _protocol = protocol_pair(&mut reactor, &pd);
        }
        let mut more = [7, 8].map(|id| read_request(&a, &b, id));
        reactor.with_ctx(|ctx| {
            let mut qp = ctx.direct(a.conn).unwrap();
            for read in &mut more {
                qp.post_send(read).unwrap();
            }
        });
        for _ in 0..10 {
            reactor.turn().unwrap();
        }
        assert_eq!(seen.borrow().taken, [(1, WcOpcode::RDMA_READ)]);
        let ids: Vec<u32> = a.log.borrow().completions.iter().map(|c| c.0).collect();
        assert_eq!(
            ids,
            [7, 8],
            "the later READs once, the spin's never (full: {then_full})"
        );
    }
}

/// A spin is lent to a session for its own connections only, and not in
/// a reactor that also serves connections of its own protocol (whose
/// tails and reposts wait for idle passes a spin would take).
#[test]
fn a_spin_is_lent_only_for_the_sessions_own_connection_of_a_lean_reactor() {
    let (pd, mut reactor, a, b) = lean_pair();
    assert!(matches!(
        spin_refusal(&mut reactor, &b.log, a.conn),
        Some(SendError::Invalid(_))
    ));
    let _protocol = protocol_pair(&mut reactor, &pd);
    assert!(matches!(
        spin_refusal(&mut reactor, &a.log, a.conn),
        Some(SendError::Invalid(_))
    ));
}

/// One pass's spins share one budget of polls: a second spin after the
/// first spent it is refused until the next pass.
#[test]
fn the_spins_of_one_pass_share_one_budget() {
    let (_pd, mut reactor, a, _b) = lean_pair();
    let (conn, seen) = (a.conn, Seen::default());
    let seen_in = Rc::clone(&seen);
    let again = Rc::new(RefCell::new(None));
    let again_in = Rc::clone(&again);
    plan(&a, move |ctx| {
        let mut spin = ctx.spin(conn).expect("a spin");
        drain(&mut spin, &seen_in, 1);
        drop(spin);
        *again_in.borrow_mut() = Some(ctx.spin(conn).err());
        false
    });
    idle_pass(&mut reactor);
    assert_eq!(seen.borrow().empty_polls, SPIN_POLLS);
    assert!(matches!(*again.borrow(), Some(Some(SendError::WouldBlock))));
}

/// `run_for` counts a pass that spun as the passes its polls cost: a
/// reactor whose handler spins on an idle connection every pass still
/// returns about when asked (counted as one pass each, the 32768 passes
/// of a stride learned while idle took seconds of spins).
#[test]
fn run_for_counts_the_polls_of_spins() {
    let (_pd, mut reactor, a, _b) = lean_pair();
    // A stride learned while idle, without spins.
    assert_eq!(
        reactor.run_for(Duration::from_millis(20)).unwrap(),
        super::super::Ended::Reached
    );
    let conn = a.conn;
    plan(&a, move |ctx| {
        if let Ok(mut spin) = ctx.spin(conn) {
            while !matches!(spin.poll(), Spun::Ended) {}
        }
        true
    });
    let started = Instant::now();
    assert_eq!(
        reactor.run_for(Duration::from_millis(20)).unwrap(),
        super::super::Ended::Reached
    );
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(2),
        "run_for(20 ms) took {took:?}"
    );
}

/// A busy spin is as bounded as an idle one: each poll and each
/// completion it brings cost one of the pass's budget, so a READ loop
/// that always has its next READ in flight hands over fewer than
/// `SPIN_POLLS` completions before the spin ends.
#[test]
fn a_busy_spin_spends_its_budget_on_completions_too() {
    let (_pd, mut reactor, a, b) = lean_pair();
    let mut read = read_request(&a, &b, 0x33);
    let (conn, taken) = (a.conn, Rc::new(RefCell::new(0u32)));
    let taken_in = Rc::clone(&taken);
    plan(&a, move |ctx| {
        let mut spin = ctx.spin(conn).expect("a spin");
        spin.qp().post_send(&mut read).expect("a READ");
        loop {
            match spin.poll() {
                Spun::Completion(..) => {
                    *taken_in.borrow_mut() += 1;
                    spin.qp().post_send(&mut read).expect("a READ");
                }
                Spun::Empty => {}
                Spun::Ended => return false,
            }
        }
    });
    idle_pass(&mut reactor);
    let taken = *taken.borrow();
    // A READ completes inside its post here: one poll and one completion
    // each.
    assert_eq!(taken, SPIN_POLLS / 2, "{taken} READs in one spin");
}

/// A handler that forgets its spin (safe, if unkind) keeps the pass's
/// budget spent and still leaves the reactor a completion its spin could
/// not hand over: B's receive reaches B.
#[test]
fn a_forgotten_spin_spends_the_budget_and_loses_no_one_elses_completion() {
    let (_pd, mut reactor, a, b) = lean_pair();
    let mut send = send_to(&mut reactor, &a, &b);
    let (conn, seen) = (a.conn, Seen::default());
    let (seen_in, again) = (Rc::clone(&seen), Rc::new(RefCell::new(None)));
    let again_in = Rc::clone(&again);
    plan(&a, move |ctx| {
        let mut spin = ctx.spin(conn).expect("a spin");
        spin.qp().post_send(&mut send).expect("a SEND");
        drain(&mut spin, &seen_in, 2);
        std::mem::forget(spin);
        *again_in.borrow_mut() = Some(ctx.spin(conn).err());
        false
    });
    idle_pass(&mut reactor);
    assert!(matches!(*again.borrow(), Some(Some(SendError::WouldBlock))));
    assert!(seen.borrow().ended, "B's receive ended A's spin");
    assert_eq!(
        b.log.borrow().completions,
        [(9, WcOpcode::RECV, 8)],
        "B's receive reached B"
    );
}

/// A handler that forgets its spin right after its first completion,
/// while another connection's completion and one of its own wait later in
/// the same batch: both reach their handlers through the reactor (the
/// spin keeps the reactor's view of its batch current).
#[test]
fn a_spin_forgotten_midway_through_a_batch_loses_no_one_elses_completion() {
    let (_pd, mut reactor, a, b) = lean_pair();
    let mut send = send_to(&mut reactor, &a, &b);
    let mut read = read_request(&a, &b, 0x22);
    let (conn, seen) = (a.conn, Seen::default());
    let seen_in = Rc::clone(&seen);
    plan(&a, move |ctx| {
        let mut spin = ctx.spin(conn).expect("a spin");
        // Both complete inside their post: A's READ, then B's receive.
        spin.qp().post_send(&mut read).expect("a READ");
        spin.qp().post_send(&mut send).expect("a SEND");
        loop {
            match spin.poll() {
                Spun::Empty => continue,
                Spun::Completion(id, wc) => seen_in.borrow_mut().taken.push((id, wc.opcode())),
                Spun::Ended => seen_in.borrow_mut().ended = true,
            }
            break;
        }
        std::mem::forget(spin);
        false
    });
    let before = reactor.counters().completions;
    idle_pass(&mut reactor);
    assert_eq!(
        reactor.counters().completions - before,
        3,
        "counted: the one handed over and the two left"
    );
    assert_eq!(
        b.log.borrow().completions,
        [(9, WcOpcode::RECV, 8)],
        "B's receive reached B"
    );
    assert_eq!(
        seen.borrow().taken,
        [(0x22, WcOpcode::RDMA_READ)],
        "A's READ first"
    );
    let a_after = ids_and_opcodes(&a);
    assert_eq!(
        a_after,
        [(0x11, WcOpcode::SEND)],
        "A's SEND, which the spin did not hand over, through the reactor"
    );
}
