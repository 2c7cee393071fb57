//! The connection a pass's completions leave work (due, see
//! `ConnTable::settle`): flushed right after the completions, without the
//! flush's walk, and as the walk would: never behind a refused doorbell,
//! and with what a completion callback stages on it.

use std::cell::RefCell;

use crate::verbs::{AccessFlags, Context, refuse_sends_after};

use super::now::sq_used;
use super::{ConnId, Ctx, add_pair, reactor, run_until, run_within, send};

/// Something a handler does from a callback, given the connection.
type Action = Box<dyn FnOnce(&mut Ctx<'_>, ConnId)>;

thread_local! {
    /// What the next `on_message` does (once), in this test's thread.
    static WHEN_RECEIVED: RefCell<Option<Action>> = RefCell::new(None);
    /// What the next `on_send_complete` does (once), in this test's thread.
    static WHEN_SENT: RefCell<Option<Action>> = RefCell::new(None);
}

/// Runs what a test left for the next `on_message` (`Probe` calls it).
pub(super) fn when_received(ctx: &mut Ctx<'_>, conn: ConnId) {
    if let Some(action) = WHEN_RECEIVED.with(|cell| cell.borrow_mut().take()) {
        action(ctx, conn);
    }
}

/// Runs what a test left for the next `on_send_complete` (`Probe` calls
/// it).
pub(super) fn when_sent(ctx: &mut Ctx<'_>, conn: ConnId) {
    if let Some(action) = WHEN_SENT.with(|cell| cell.borrow_mut().take()) {
        action(ctx, conn);
    }
}

/// Fewer passes than the idle spell after which a pass reposts and
/// flushes what waits: what arrives within them went out with the pass
/// that staged it.
const FEW_PASSES: usize = 5;

/// A request an `on_message` callback stages on its own connection behind
/// a doorbell the device refused (rung alone from the same callback) is
/// not posted by the due connection's flush: the connection fails first,
/// once, and both requests are unwound.
#[test]
fn the_due_connection_is_never_flushed_behind_a_refused_doorbell() {
    // SAFETY: every QP of the device is served from this thread.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().expect("a PD");
    let mut reactor = reactor(&pd);
    let (a, b) = add_pair(&mut reactor, &pd);
    let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
    let ours = pd.alloc_mr(4096, access).expect("a region");
    let theirs = pd.alloc_mr(4096, access).expect("a region");
    let remote = theirs.remote().unwrap().slice(0, 8).unwrap();
    let local = ours.slice(0, 8).unwrap().registration().clone();
    run_until(&mut reactor, "a quiet", |r| sq_used(r, a.conn) == 0);
    WHEN_RECEIVED.with(|cell| {
        *cell.borrow_mut() = Some(Box::new(move |ctx: &mut Ctx<'_>, conn: ConnId| {
            let local = local.slice(0, 8).unwrap();
            ctx.write_now(conn, &local, remote, None)
                .expect("refused, still staged");
            ctx.read(conn, &local, remote).expect("staged behind it");
        }));
    });
    let a_qpn = reactor.conns.get(a.conn.key()).expect("live").qpn();
    refuse_sends_after(a_qpn, 0);
    send(&mut reactor, b.conn, b"to a");
    run_within(&mut reactor, FEW_PASSES, "a told of the refusal", |_| {
        !a.seen.borrow().errors.is_empty()
    });
    for _ in 0..FEW_PASSES {
        reactor.turn().expect("a pass");
    }
    assert_eq!(a.seen.borrow().messages.len(), 1, "the message came");
    assert_eq!(a.seen.borrow().errors.len(), 1, "told once");
    assert_eq!(sq_used(&reactor, a.conn), 0, "both requests unwound");
}

/// A SEND an `on_send_complete` callback stages on its connection goes out
/// with the pass of that completion (the retire settles its connection),
/// not with an idle pass's flush.
#[test]
fn what_a_send_completion_stages_on_its_connection_goes_out_in_its_pass() {
    // SAFETY: every QP of the device is served from this thread.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().expect("a PD");
    let mut reactor = reactor(&pd);
    let (a, b) = add_pair(&mut reactor, &pd);
    run_until(&mut reactor, "a quiet", |r| sq_used(r, a.conn) == 0);
    WHEN_SENT.with(|cell| {
        *cell.borrow_mut() = Some(Box::new(|ctx: &mut Ctx<'_>, conn: ConnId| {
            ctx.send(conn, b"second", None).expect("room for it");
        }));
    });
    reactor.with_ctx(|ctx| {
        ctx.send(a.conn, b"first", None).expect("room for it");
        // Its completion, and so the callback, comes at once.
        ctx.signal_staged(a.conn);
    });
    run_within(&mut reactor, FEW_PASSES, "both messages at b", |_| {
        b.seen.borrow().messages.len() == 2
    });
    assert_eq!(
        b.seen.borrow().messages,
        [b"first".to_vec(), b"second".to_vec()]
    );
}
