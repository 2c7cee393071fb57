//! The lookup over the loopback device: what it takes, and every refusal
//! with its reason (a stale generation, another QP, a kind the connection
//! never posts, a slot not posted, ids nothing of the table posted).

use super::wr_id::{direct_recv_tag, direct_send_tag, recv, send, srq_recv};
use super::*;
use crate::reactor::slab::TOUCHED;
use crate::reactor::{ReactorConfig, SessionId};
use crate::verbs::{BIND_WR_ID, CompletionQueue, Context, ProtectionDomain, QpConfig, QueuePair};

/// A table with a connection of the reactor's protocol (its receives
/// posted) and a direct one, on two connected QPs.
struct Fixture {
    table: ConnTable,
    srq: Option<SrqPool>,
    conn: Key,
    conn_qpn: u32,
    direct: Key,
    direct_qpn: u32,
    // Dropped after the table: the connections' QPs report to it.
    _cq: CompletionQueue,
    _pd: ProtectionDomain,
}

fn qps(pd: &ProtectionDomain, cq: &CompletionQueue) -> (QueuePair, QueuePair) {
    let config = QpConfig::default();
    let mut a = pd.create_qp(cq, cq, &config).expect("a QP");
    let mut b = pd.create_qp(cq, cq, &config).expect("a QP");
    let (to_a, to_b) = (a.endpoint(), b.endpoint());
    a.connect(&to_b).expect("connected");
    b.connect(&to_a).expect("connected");
    (a, b)
}

fn fixture() -> Fixture {
    // SAFETY: every QP of the device is served from this thread.
    let ctx = unsafe { Context::loopback() };
    let pd = ctx.alloc_pd().expect("a PD");
    let cq = ctx.create_cq(256, None).expect("a CQ");
    let config = ReactorConfig::default();
    let session = SessionId(Key {
        index: 0,
        generation: 0,
        owner: 1,
    });
    let mut table = ConnTable::new(1, 4).expect("room");
    let (a, b) = qps(&pd, &cq);
    let id = table.vacant_id().expect("room");
    let mut conn = Conn::new(id, session, 0, &pd, a, &config, None).expect("a connection");
    conn.post_initial_receives().expect("receives posted");
    let conn_qpn = conn.qpn();
    table.insert(conn);
    let direct_id = table.vacant_id().expect("room");
    let direct = Conn::new_direct(direct_id, session, 1, &pd, b, &config).expect("direct");
    let direct_qpn = direct.qpn();
    table.insert(direct);
    // Nothing listed before the lookups.
    let listed = table.begin_walk(TOUCHED);
    for at in 0..listed {
        table.unlist_at(TOUCHED, at);
    }
    table.end_walk(TOUCHED);
    Fixture {
        table,
        srq: None,
        conn: id.key(),
        conn_qpn,
        direct: direct_id.key(),
        direct_qpn,
        _cq: cq,
        _pd: pd,
    }
}

impl Fixture {
    /// The full lookup: the key and what it completed, or the refusal.
    fn look(&mut self, wr_id: u64, qpn: u32) -> Result<(Key, Completed), Refusal> {
        self.table
            .lookup::<false>(wr_id, qpn, &mut self.srq)
            .map(|entry| (entry.key, entry.completed))
    }

    /// The lookup of a lean pass.
    fn look_direct(&mut self, wr_id: u64, qpn: u32) -> Result<(Key, Completed), Refusal> {
        self.table
            .lookup::<true>(wr_id, qpn, &mut self.srq)
            .map(|entry| (entry.key, entry.completed))
    }
}

#[test]
fn a_connections_own_completions_are_its() {
    let mut f = fixture();
    let (conn, qpn) = (f.conn, f.conn_qpn);
    assert_eq!(
        f.look(send(conn, 9), qpn),
        Ok((conn, Completed::Send { seq: 9 }))
    );
    assert_eq!(
        f.look(recv(conn, 3), qpn),
        Ok((conn, Completed::Recv { slot: 3 }))
    );
    let (direct, direct_qpn) = (f.direct, f.direct_qpn);
    for tag in [direct_send_tag(direct), direct_recv_tag(direct)] {
        let want = Ok((direct, Completed::Direct));
        assert_eq!(f.look(tag | 0xfeed, direct_qpn), want);
        assert_eq!(f.look_direct(tag | 0xfeed, direct_qpn), want);
    }
    // The dispatch settles what a completion left (see the next test).
    for key in [conn, direct] {
        assert!(!f.table.is_settled(key.index), "a lookup lists nothing");
    }
}

#[test]
fn the_first_connection_settled_is_due_and_the_others_are_listed() {
    let mut f = fixture();
    let (first, second) = (f.conn.index, f.direct.index);
    assert_eq!(f.table.take_due(), None);
    f.table.settle(first);
    f.table.settle(first);
    assert!(f.table.is_settled(first));
    assert!(
        !f.table.is_listed(TOUCHED, first),
        "the due connection needs no walk"
    );
    f.table.settle(second);
    assert!(f.table.is_listed(TOUCHED, second), "a second one is walked");
    assert_eq!(f.table.take_due(), Some(first));
    assert_eq!(f.table.take_due(), None, "taken once");
    assert!(!f.table.is_settled(first));
    // The next pass starts afresh: the first connection it settles is due.
    f.table.settle(second);
    assert_eq!(f.table.take_due(), Some(second));
    // A pass that will not flush it lists it for the walk instead.
    f.table.settle(first);
    f.table.list_due();
    assert_eq!(f.table.take_due(), None);
    assert!(f.table.is_listed(TOUCHED, first), "walked instead");
}

#[test]
fn an_earlier_tenants_ids_are_stale() {
    let mut f = fixture();
    let (conn, qpn) = (f.conn, f.conn_qpn);
    let earlier = Key {
        generation: conn.generation.wrapping_sub(1),
        ..conn
    };
    assert_eq!(f.look(send(earlier, 1), qpn), Err(Refusal::StaleGeneration));
    assert_eq!(f.look(recv(earlier, 1), qpn), Err(Refusal::StaleGeneration));
    // A stranger's, never a late completion of the reactor's own: an
    // entry takes a newcomer only once its quarantine is over.
    assert!(!f.table.names_departed(send(earlier, 1)));
    let direct = Key {
        generation: f.direct.generation + 1,
        ..f.direct
    };
    let qpn = f.direct_qpn;
    assert_eq!(
        f.look_direct(direct_send_tag(direct), qpn),
        Err(Refusal::StaleGeneration)
    );
    // The slot a stale receive named is still posted for the real one.
    assert_eq!(
        f.look(recv(f.conn, 1), f.conn_qpn),
        Ok((f.conn, Completed::Recv { slot: 1 }))
    );
}

#[test]
fn another_qps_completion_naming_a_connection_is_refused() {
    let mut f = fixture();
    let (conn, other) = (f.conn, f.direct_qpn);
    assert_eq!(f.look(send(conn, 1), other), Err(Refusal::WrongQp));
    assert_eq!(f.look(recv(conn, 1), other), Err(Refusal::WrongQp));
    let direct = direct_send_tag(f.direct);
    assert_eq!(f.look(direct, f.conn_qpn), Err(Refusal::WrongQp));
    assert_eq!(f.look_direct(direct, f.conn_qpn), Err(Refusal::WrongQp));
    assert!(
        !f.table.is_listed(TOUCHED, conn.index),
        "a refusal lists nothing"
    );
}

#[test]
fn a_kind_the_connection_never_posts_is_refused() {
    let mut f = fixture();
    // A direct id naming a connection of the protocol, on its QP.
    let (conn, qpn) = (f.conn, f.conn_qpn);
    assert_eq!(f.look(direct_send_tag(conn), qpn), Err(Refusal::WrongKind));
    assert_eq!(
        f.look_direct(direct_recv_tag(conn), qpn),
        Err(Refusal::WrongKind)
    );
    // The other way round, which only a device's bad data brings (every
    // request a direct connection's handler posts carries the direct bit):
    // refused too, in debug builds as in release ones.
    let (direct, direct_qpn) = (f.direct, f.direct_qpn);
    assert_eq!(f.look(send(direct, 1), direct_qpn), Err(Refusal::WrongKind));
    assert_eq!(f.look(recv(direct, 1), direct_qpn), Err(Refusal::WrongKind));
    // A lean pass's lookup leaves every other id to the full one.
    assert_eq!(f.look_direct(send(conn, 1), qpn), Err(Refusal::NotDirect));
}

#[test]
fn a_receive_into_a_slot_not_posted_is_refused() {
    let mut f = fixture();
    let (conn, qpn) = (f.conn, f.conn_qpn);
    assert!(f.look(recv(conn, 2), qpn).is_ok());
    let listed = f.table.begin_walk(TOUCHED);
    for at in 0..listed {
        f.table.unlist_at(TOUCHED, at);
    }
    f.table.end_walk(TOUCHED);
    assert_eq!(f.look(recv(conn, 2), qpn), Err(Refusal::NotPosted), "twice");
    assert_eq!(
        f.look(recv(conn, u32::MAX), qpn),
        Err(Refusal::NotPosted),
        "beyond the ring"
    );
    assert!(!f.table.is_listed(TOUCHED, conn.index));
}

#[test]
fn ids_nothing_of_the_table_posted_are_foreign() {
    let mut f = fixture();
    let qpn = f.conn_qpn;
    let vacant = Key { index: 7, ..f.conn };
    assert_eq!(f.look(send(vacant, 1), qpn), Err(Refusal::Foreign));
    assert_eq!(
        f.look_direct(direct_send_tag(vacant), qpn),
        Err(Refusal::Foreign)
    );
    assert_eq!(f.look(0, qpn), Err(Refusal::Foreign), "no kind");
    assert_eq!(f.look(BIND_WR_ID, qpn), Err(Refusal::Foreign));
    assert_eq!(
        f.look(srq_recv(0, 1), qpn),
        Err(Refusal::Foreign),
        "an SRQ receive without an SRQ"
    );
}

#[test]
fn a_removed_connections_ids_are_departed_until_its_quarantine_ends() {
    let mut f = fixture();
    let (conn, qpn) = (f.conn, f.conn_qpn);
    // An index no connection ever had.
    let never = Key { index: 3, ..conn };
    assert_eq!(f.look(send(never, 1), qpn), Err(Refusal::Foreign));
    assert!(!f.table.names_departed(send(never, 1)));
    // The connection removed: its requests and receives are departed,
    // with its generation only.
    drop(f.table.remove(ConnId(conn)).expect("removed"));
    for wr_id in [send(conn, 1), recv(conn, 1)] {
        assert_eq!(f.look(wr_id, qpn), Err(Refusal::Foreign));
        assert!(f.table.names_departed(wr_id), "{wr_id:#x}");
    }
    let other = Key {
        generation: conn.generation + 5,
        ..conn
    };
    assert!(
        !f.table.names_departed(send(other, 1)),
        "another generation"
    );
    // Ids at the removed index of no connection's kind: an SRQ receive's
    // shape, the kind no request has.
    let tops = send(conn, 0) & !(0b11 << 32);
    for wr_id in [
        tops | (0b11 << 32) | 1,
        tops | 1,
        BIND_WR_ID,
        srq_recv(1, 1),
    ] {
        assert!(!f.table.names_departed(wr_id), "{wr_id:#x}");
    }
    // Once a pass has polled every CQ empty, nothing of it is left.
    f.table.release_quarantine(1);
    assert!(!f.table.names_departed(send(conn, 1)));
}
