//! Direct connections over the loopback device: the handler posts kept
//! requests on its own QP and gets each completion with its own id; the
//! reactor routes, refuses its own staging on them, fails one on a failed
//! completion and leaves the others running.

use std::cell::RefCell;
use std::rc::Rc;

use crate::error::Error;
use crate::session::CqChoice;
use crate::verbs::{
    AccessFlags, Context, Kept, MemoryRegion, ProtectionDomain, QueuePair, RecvRequest, WcOpcode,
    WorkCompletion, WorkRequest,
};

use super::super::{ConnId, Ctx, Handler, Idle, Reactor, ReactorConfig, SendError, SessionId};
use super::{MAX_PASSES, connected_qps};

/// What a direct handler saw: (id, opcode, bytes) of each completion, and
/// each error's text.
#[derive(Debug, Default)]
pub(super) struct Log {
    /// `on_established` calls.
    pub(super) established: usize,
    pub(super) completions: Vec<(u32, WcOpcode, u32)>,
    pub(super) errors: Vec<String>,
    /// A session to remove (`Ctx::remove_session`) on the next idle pass.
    remove_when_idle: Option<SessionId>,
    /// What the handler does in its idle callbacks, while it says `true`.
    pub(super) idle_plan: Option<IdlePlan>,
}

/// A test's own `on_idle`, run while it returns true.
pub(super) struct IdlePlan(pub(super) Box<dyn FnMut(&mut Ctx<'_>) -> bool>);

impl std::fmt::Debug for IdlePlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("IdlePlan")
    }
}

pub(super) struct Direct(pub(super) Rc<RefCell<Log>>);

impl Handler for Direct {
    fn on_established(&mut self, _: &mut Ctx<'_>, _: ConnId) {
        self.0.borrow_mut().established += 1;
    }
    fn on_message(&mut self, _: &mut Ctx<'_>, _: ConnId, _: &[u8], _: Option<u32>) {
        unreachable!("a direct connection delivers no messages of the reactor's protocol");
    }
    fn on_direct_completion(
        &mut self,
        _: &mut Ctx<'_>,
        _: ConnId,
        id: u32,
        completion: &WorkCompletion,
    ) {
        let entry = (id, completion.opcode(), completion.byte_len());
        self.0.borrow_mut().completions.push(entry);
    }
    fn on_idle(&mut self, ctx: &mut Ctx<'_>) -> Idle {
        if let Some(session) = self.0.borrow_mut().remove_when_idle.take() {
            ctx.remove_session(session);
        }
        // Not borrowed while it runs: it may look at the log.
        let plan = self.0.borrow_mut().idle_plan.take();
        if let Some(mut plan) = plan
            && (plan.0)(ctx)
        {
            self.0.borrow_mut().idle_plan = Some(plan);
        }
        Idle::Again
    }
    fn on_error(&mut self, _: &mut Ctx<'_>, _: ConnId, error: &Error) {
        self.0.borrow_mut().errors.push(error.to_string());
    }
}

pub(super) struct End {
    pub(super) session: SessionId,
    pub(super) conn: ConnId,
    pub(super) log: Rc<RefCell<Log>>,
    pub(super) region: MemoryRegion,
}

pub(super) fn reactor(pd: &ProtectionDomain) -> Reactor<Direct, ()> {
    let config = ReactorConfig {
        sq_depth: 16,
        recv_depth: 16,
        ..ReactorConfig::default()
    };
    Reactor::new(pd, config).expect("a reactor on the loopback device")
}

/// Two direct connections of one reactor, connected to each other, each
/// with a 4 KiB region the other may WRITE and READ.
pub(super) fn direct_pair(reactor: &mut Reactor<Direct, ()>, pd: &ProtectionDomain) -> (End, End) {
    let access = AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
    let [a, b] = connected_qps(reactor, pd, access);
    let mut add = |qp: QueuePair| {
        let log = Rc::new(RefCell::new(Log::default()));
        let session = reactor
            .add_direct(vec![qp], Direct(Rc::clone(&log)))
            .expect("add_direct");
        let conn = reactor.conns(session).next().expect("one connection");
        let region = pd
            .alloc_mr(4096, access | AccessFlags::LOCAL_WRITE)
            .expect("a region");
        End {
            session,
            conn,
            log,
            region,
        }
    };
    (add(a), add(b))
}

#[track_caller]
pub(super) fn run_until(
    reactor: &mut Reactor<Direct, ()>,
    what: &str,
    mut done: impl FnMut() -> bool,
) {
    for _ in 0..MAX_PASSES {
        if done() {
            return;
        }
        reactor.turn().expect("a reactor pass");
    }
    panic!("not within {MAX_PASSES} passes: {what}");
}

/// Kept SEND, RECV, WRITE and READ requests, posted twice each through
/// `Ctx::direct`: every completion reaches the handler of its connection
/// with the id the request was given, whatever the reactor wrote in the
/// top half, and the bytes land.
#[test]
fn kept_requests_complete_to_their_handler_with_their_ids() {
    // SAFETY: every QP of the device is served from this thread.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().expect("a PD");
    let mut reactor = reactor(&pd);
    let (mut a, b) = direct_pair(&mut reactor, &pd);
    reactor.turn().unwrap();
    assert_eq!(
        (a.log.borrow().established, b.log.borrow().established),
        (1, 1),
        "each handler told once, by add_direct"
    );
    let b_remote = b.region.remote().expect("exportable");

    let mut recv = Kept::new(
        RecvRequest::new(0xdead_0000_0000_0007, b.region.slice(0, 64).unwrap()).unwrap(),
        &[b.region.registration()],
    )
    .expect("kept receive");
    a.region.write(0, b"direct!!").unwrap();
    let a_memory = a.region.registration().clone();
    let mut send = Kept::new(
        WorkRequest::send(0x11, a.region.slice(0, 8).unwrap()).signaled(),
        &[&a_memory],
    )
    .expect("kept send");
    let mut write = Kept::new(
        WorkRequest::write(
            0x22,
            a.region.slice(0, 8).unwrap(),
            b_remote.slice(128, 8).unwrap(),
        )
        .unwrap()
        .signaled(),
        &[&a_memory],
    )
    .expect("kept write");
    let mut read = Kept::new(
        WorkRequest::read(
            0x33,
            a.region.slice(256, 8).unwrap(),
            b_remote.slice(128, 8).unwrap(),
        )
        .unwrap()
        .signaled(),
        &[&a_memory],
    )
    .expect("kept read");

    for round in 0..2 {
        reactor.with_ctx(|ctx| {
            ctx.direct(b.conn).unwrap().post_recv(&mut recv).unwrap();
            let mut qp = ctx.direct(a.conn).unwrap();
            qp.post_send(&mut send).unwrap();
            qp.post_send(&mut write).unwrap();
            qp.post_send(&mut read).unwrap();
        });
        let want = 3 * (round + 1);
        run_until(&mut reactor, "every completion", || {
            a.log.borrow().completions.len() == want
                && b.log.borrow().completions.len() == round + 1
        });
    }
    let a_log = a.log.borrow();
    assert_eq!(
        a_log.completions[..3],
        [
            (0x11, WcOpcode::SEND, 8),
            (0x22, WcOpcode::RDMA_WRITE, 8),
            (0x33, WcOpcode::RDMA_READ, 8)
        ]
    );
    assert_eq!(a_log.completions[3..], a_log.completions[..3]);
    assert_eq!(
        b.log.borrow().completions,
        [(7, WcOpcode::RECV, 8), (7, WcOpcode::RECV, 8)],
        "the reactor's tag stays out of the handler's id"
    );
    let mut landed = [0u8; 8];
    b.region.read(0, &mut landed).unwrap();
    assert_eq!(&landed, b"direct!!");
    b.region.read(128, &mut landed).unwrap();
    assert_eq!(&landed, b"direct!!");
    a.region.read(256, &mut landed).unwrap();
    assert_eq!(
        &landed, b"direct!!",
        "the READ brought the WRITE's bytes back"
    );
    assert!(a_log.errors.is_empty() && b.log.borrow().errors.is_empty());
}

/// The reactor's staging refuses a direct connection (its handler alone
/// posts there), and `Ctx::direct` refuses one of the reactor's protocol
/// (the reactor alone posts there).
#[test]
fn neither_side_posts_on_the_others_connection() {
    // SAFETY: every QP of the device is served from this thread.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().expect("a PD");
    let mut reactor = reactor(&pd);
    let (a, _b) = direct_pair(&mut reactor, &pd);
    reactor.with_ctx(|ctx| {
        // (A SEND is refused for its size first: a direct connection has
        // no send slots worth the name.)
        assert!(ctx.send(a.conn, b"", None).is_err());
        let local = a.region.slice(0, 8).unwrap();
        let remote = a.region.remote().unwrap().slice(0, 8).unwrap();
        assert!(matches!(
            ctx.write(a.conn, &local, remote, None),
            Err(SendError::Invalid(_))
        ));
        assert!(matches!(
            ctx.read(a.conn, &local, remote),
            Err(SendError::Invalid(_))
        ));
        assert!(matches!(
            ctx.write_now(a.conn, &local, remote, None),
            Err(SendError::Invalid(_))
        ));
        assert!(matches!(
            ctx.read_now(a.conn, &local, remote),
            Err(SendError::Invalid(_))
        ));
    });

    let mut plain: Reactor<super::Probe, ()> = super::reactor(&pd);
    let (ours, _) = super::add_pair(&mut plain, &pd);
    plain.with_ctx(|ctx| {
        assert!(matches!(ctx.direct(ours.conn), Err(SendError::Invalid(_))));
    });
}

/// A failed completion fails its direct connection (the handler is told
/// once, and its QP takes no more posts) and leaves the other pair running.
#[test]
fn a_failed_completion_fails_only_its_direct_connection() {
    // SAFETY: every QP of the device is served from this thread.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().expect("a PD");
    let mut reactor = reactor(&pd);
    let (a, b) = direct_pair(&mut reactor, &pd);
    let (c, d) = direct_pair(&mut reactor, &pd);

    // A 4-byte receive for an 8-byte SEND: both ends fail.
    reactor.with_ctx(|ctx| {
        let mut short = RecvRequest::new(1, b.region.slice(0, 4).unwrap()).unwrap();
        ctx.direct(b.conn).unwrap().post_recv(&mut short).unwrap();
        let mut send = WorkRequest::send(2, a.region.slice(0, 8).unwrap()).signaled();
        ctx.direct(a.conn).unwrap().post_send(&mut send).unwrap();
    });
    run_until(&mut reactor, "both ends told", || {
        !a.log.borrow().errors.is_empty() && !b.log.borrow().errors.is_empty()
    });
    for _ in 0..100 {
        reactor.turn().unwrap();
    }
    assert_eq!(
        a.log.borrow().errors.len(),
        1,
        "told once: {:?}",
        a.log.borrow().errors
    );
    assert_eq!(
        b.log.borrow().errors.len(),
        1,
        "told once: {:?}",
        b.log.borrow().errors
    );
    reactor.with_ctx(|ctx| {
        assert!(matches!(ctx.direct(a.conn), Err(SendError::Closed)));
    });

    // The other pair still works.
    reactor.with_ctx(|ctx| {
        let mut recv = RecvRequest::new(5, d.region.slice(0, 8).unwrap()).unwrap();
        ctx.direct(d.conn).unwrap().post_recv(&mut recv).unwrap();
        let mut send = WorkRequest::send(6, c.region.slice(0, 8).unwrap()).signaled();
        ctx.direct(c.conn).unwrap().post_send(&mut send).unwrap();
    });
    run_until(&mut reactor, "the other pair's SEND", || {
        d.log.borrow().completions.len() == 1 && c.log.borrow().completions.len() == 1
    });
    assert!(c.log.borrow().errors.is_empty() && d.log.borrow().errors.is_empty());
}

/// A kept request must lie in the registration it keeps, and an inline
/// SEND (whose bytes are in none) cannot be kept.
#[test]
fn a_kept_request_points_only_into_what_it_keeps() {
    // SAFETY: every QP of the device is served from this thread.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().expect("a PD");
    let one = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    let other = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    let send = WorkRequest::send(1, one.slice(0, 8).unwrap());
    assert!(Kept::new(send, &[other.registration()]).is_err());
    assert!(Kept::new(send, &[one.registration()]).is_ok());
    let recv = RecvRequest::new(1, one.slice(64, 8).unwrap()).unwrap();
    assert!(Kept::new(recv, &[other.registration()]).is_err());
    let inline = WorkRequest::send_inline(1, b"abc");
    assert!(Kept::new(inline, &[one.registration()]).is_err());
    // An empty request points at nothing: any registration will do.
    let empty = WorkRequest::send(1, one.slice(0, 0).unwrap());
    assert!(Kept::new(empty, &[other.registration()]).is_ok());
}

/// An SRQ reactor refuses direct connections: they post their own receives.
#[test]
fn an_srq_reactor_refuses_direct_connections() {
    // SAFETY: every QP of the device is served from this thread.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().expect("a PD");
    let mut reactor: Reactor<Direct, ()> = Reactor::new(
        &pd,
        ReactorConfig {
            srq_depth: 64,
            ..ReactorConfig::default()
        },
    )
    .unwrap();
    let spec = reactor.qp_spec("srq");
    let CqChoice::Shared(cq) = spec.cq else {
        panic!("qp_spec did not share the reactor's CQ");
    };
    let srq = spec.srq.as_ref().expect("an SRQ attachment");
    let qp = pd.create_qp_with_srq(&cq, &cq, srq, &spec.qp).unwrap();
    let log = Rc::new(RefCell::new(Log::default()));
    assert!(reactor.add_direct(vec![qp], Direct(log)).is_err());
}

/// A pair of connections of the reactor's own protocol, with `Direct`
/// handlers (which count `on_established`), run until both are
/// established; returns their sessions.
pub(super) fn protocol_pair(
    reactor: &mut Reactor<Direct, ()>,
    pd: &ProtectionDomain,
) -> [(SessionId, Rc<RefCell<Log>>); 2] {
    let ends = connected_qps(reactor, pd, AccessFlags::empty()).map(|qp| {
        let log = Rc::new(RefCell::new(Log::default()));
        let session = reactor.add(vec![qp], Direct(Rc::clone(&log))).expect("add");
        (session, log)
    });
    run_until(reactor, "the protocol pair established", || {
        ends.iter().all(|(_, log)| log.borrow().established == 1)
    });
    ends
}

/// One SEND from `a` to `b` over their direct connections, run until both
/// completions are in.
fn direct_send(reactor: &mut Reactor<Direct, ()>, a: &End, b: &End) {
    let (sent, received) = (
        a.log.borrow().completions.len(),
        b.log.borrow().completions.len(),
    );
    reactor.with_ctx(|ctx| {
        let mut recv = RecvRequest::new(9, b.region.slice(0, 8).unwrap()).unwrap();
        ctx.direct(b.conn).unwrap().post_recv(&mut recv).unwrap();
        let mut send = WorkRequest::send(8, a.region.slice(0, 8).unwrap()).signaled();
        ctx.direct(a.conn).unwrap().post_send(&mut send).unwrap();
    });
    run_until(reactor, "the direct SEND's completions", || {
        a.log.borrow().completions.len() == sent + 1
            && b.log.borrow().completions.len() == received + 1
    });
}

/// A reactor that also serves connections of its own protocol takes the
/// full pass, one that serves only direct connections the lean one (see
/// `Reactor::poll_once`): a direct pair works under both, beside a
/// protocol pair, after its removal and beside a new one, and the count
/// that picks the pass follows the connections.
#[test]
fn direct_connections_work_beside_the_reactors_own_and_after_them() {
    // SAFETY: every QP of the device is served from this thread.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().expect("a PD");
    let mut reactor = reactor(&pd);
    let (a, b) = direct_pair(&mut reactor, &pd);
    direct_send(&mut reactor, &a, &b);
    assert_eq!(reactor.full_pass_parts, 0, "direct connections only: lean");

    let first = protocol_pair(&mut reactor, &pd);
    assert_eq!(reactor.full_pass_parts, 2);
    direct_send(&mut reactor, &a, &b);

    for (session, _) in &first {
        assert!(reactor.remove(*session).is_some());
    }
    assert_eq!(
        reactor.full_pass_parts, 0,
        "the last protocol connection gone"
    );
    direct_send(&mut reactor, &a, &b);

    let second = protocol_pair(&mut reactor, &pd);
    assert_eq!(reactor.full_pass_parts, 2);
    direct_send(&mut reactor, &a, &b);
    for (_, log) in &second {
        assert!(log.borrow().errors.is_empty());
    }
    assert!(a.log.borrow().errors.is_empty() && b.log.borrow().errors.is_empty());
    assert_eq!(b.log.borrow().completions, [(9, WcOpcode::RECV, 8); 4]);
}

/// A reactor of direct connections only (the lean pass) still does the
/// work after a pass when there is some: a removal a callback asked for
/// happens, and the removed connection's slab entry, quarantined for a
/// pass, takes a newcomer with a new generation.
#[test]
fn a_lean_pass_removes_what_callbacks_remove_and_reuses_their_entries() {
    // SAFETY: every QP of the device is served from this thread.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().expect("a PD");
    let mut reactor = reactor(&pd);
    let (a, b) = direct_pair(&mut reactor, &pd);
    let (c, d) = direct_pair(&mut reactor, &pd);
    assert_eq!(reactor.full_pass_parts, 0, "direct connections only: lean");

    direct_send(&mut reactor, &a, &b);
    // Passes with nothing to do, then a's idle callback asks for b's
    // session to go: the removal is the pass's only chore.
    for _ in 0..10 {
        reactor.turn().expect("a reactor pass");
    }
    a.log.borrow_mut().remove_when_idle = Some(b.session);
    let mut passes = 0;
    while reactor.sessions().any(|session| session == b.session) {
        assert!(passes < MAX_PASSES, "b's session still there");
        reactor.turn().expect("a reactor pass");
        passes += 1;
    }
    // The next pass releases the quarantine (every CQ polled empty since
    // the removal), its only chore.
    reactor.turn().expect("a reactor pass");

    let (e, f) = direct_pair(&mut reactor, &pd);
    let (gone, taken) = (b.conn.key(), e.conn.key());
    assert_eq!(taken.index, gone.index, "the removed entry is reused");
    assert_ne!(taken.generation, gone.generation);
    direct_send(&mut reactor, &e, &f);
    direct_send(&mut reactor, &c, &d);
    for end in [&a, &c, &d, &e, &f] {
        assert!(
            end.log.borrow().errors.is_empty(),
            "{:?}",
            end.log.borrow().errors
        );
    }
}
