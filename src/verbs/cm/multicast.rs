//! Multicast through the connection manager (`rdma_join_multicast`,
//! rdma-core's `mckey`): a datagram id's QP joins a group by its IP
//! address, the `MulticastJoin` event says where the group is, and leaving
//! detaches the QP and ends the membership.

use std::any::Any;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::error::{CmFailure, Error, Result};
use crate::sys;

use super::super::ud::MULTICAST_QPN;
use super::super::{Gid, UdQueuePair};
use super::addr::RawAddr;
use super::channel::Registry;
use super::id::{CmId, CmIdInner, NOT_BOUND};
use super::last_errno;

/// One join of a group on an id: held by the QP that joined it and by
/// each unacknowledged event about it, and left (`rdma_leave_multicast`)
/// when the last of them lets go, or at once by
/// [`CmId::leave_multicast`] when nothing else holds it. It holds the id,
/// so the id is destroyed after the group is left.
pub(crate) struct Group {
    id: Arc<CmIdInner>,
    addr: SocketAddr,
    /// The join's context: the key of the group in its channel's registry.
    context: u64,
    /// Set once left, so that the drop does not leave again.
    left: AtomicBool,
}

impl Group {
    /// The group's address (port 0).
    pub(super) fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// True for a join of `addr` on the id `id`.
    pub(super) fn is_of(&self, id: &Arc<CmIdInner>, addr: SocketAddr) -> bool {
        Arc::ptr_eq(&self.id, id) && self.addr == addr
    }

    /// Leaves the group (`rdma_leave_multicast`) and forgets it, unless an
    /// unacknowledged event still holds it (librdmacm's leave would wait
    /// for its acknowledgement): then the drop of the last such event
    /// leaves it. `self` is the caller's handle, given up.
    fn leave(self: Arc<Self>) -> Result<()> {
        let channel = self.id.channel();
        let mut registry = channel.lock();
        // Events take their handle on a group under this lock: a count of
        // one is ours alone, and stays so.
        if Arc::strong_count(&self) > 1 {
            return Ok(());
        }
        let left = self.leave_locked(&mut registry);
        drop(registry);
        left.map_err(|errno| Error::Cm {
            op: "rdma_leave_multicast",
            peer: Some(self.addr),
            cause: CmFailure::Errno(errno),
        })
    }

    /// The leave itself; the caller holds the channel's lock (`registry`)
    /// and the last handle on the group. The errno of a failure.
    fn leave_locked(&self, registry: &mut Registry) -> std::result::Result<(), i32> {
        registry.remove_group(self.context);
        self.left.store(true, Ordering::Relaxed);
        let mut addr = RawAddr::new(self.addr);
        // SAFETY: the id is live (held) and we hold its channel's lock.
        // Every event of this group that was read is acknowledged: one not
        // acknowledged would hold the group, and one read after the last
        // handle went (the registry no longer finds the group) was
        // acknowledged at once under this lock. So the call, which waits
        // for those acknowledgements, does not wait.
        let rc = unsafe { sys::rdma_leave_multicast(self.id.raw(), addr.as_ptr()) };
        if rc == 0 { Ok(()) } else { Err(last_errno()) }
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        if self.left.load(Ordering::Relaxed) {
            return;
        }
        // Never dropped with the lock held: events are dropped, and QPs
        // let go of their groups, outside every call that holds it.
        let channel = self.id.channel();
        let mut registry = channel.lock();
        if let Err(errno) = self.leave_locked(&mut registry) {
            log::warn!(
                "rdma_leave_multicast with {}: {}",
                self.addr,
                std::io::Error::from_raw_os_error(errno)
            );
        }
    }
}

/// The number of the next join (the context librdmacm hands back in the
/// join's events); 0 is never used.
fn next_context() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// The GID a group's address stands for in a QP's list of groups (and the
/// one [`UdQueuePair::join`] would attach to): the IPv4-mapped GID of an
/// IPv4 address, an IPv6 address's own bytes.
fn group_key(group: IpAddr) -> Gid {
    match group {
        IpAddr::V4(v4) => Gid::from_ipv4(v4),
        IpAddr::V6(v6) => Gid(v6.octets()),
    }
}

impl CmId {
    /// Joins the multicast group at address `group` for `qp`, a QP created
    /// on this datagram id ([`create_ud_qp`](Self::create_ud_qp)), as
    /// rdma-core's `mckey` does (`rdma_join_multicast`). The id must be
    /// bound to a device first: `mckey` resolves the group's address from
    /// a local one (`resolve_addr(Some(local), group)`, then
    /// `AddrResolved`), or binds to a local address. Post the QP's
    /// receives before joining.
    ///
    /// The outcome arrives as `MulticastJoin`, whose
    /// [`attach_group`](super::CmEvent::attach_group) attaches `qp` and
    /// says where to send to the group, or `MulticastError`. On RoCE v2
    /// the kernel joins the group's IP group for this host (IGMP) as well.
    ///
    /// The QP holds the membership: [`leave_multicast`](Self::leave_multicast)
    /// ends it, and so does dropping the QP. `InvalidArgument` for a
    /// reliable id, an address that is not multicast, a QP of another id,
    /// and a group the QP joined already (either way).
    pub fn join_multicast(&self, qp: &mut UdQueuePair, group: IpAddr) -> Result<()> {
        if !self.is_datagram() {
            return Err(Error::InvalidArgument(
                "rdma_join_multicast: the id is for reliable connections \
                 (a datagram id comes from EventChannel::create_ud_id)",
            ));
        }
        if !group.is_multicast() {
            return Err(Error::InvalidArgument(
                "rdma_join_multicast: the group is a multicast address \
                 (224.0.0.0/4, ff00::/8)",
            ));
        }
        if !qp.is_anchored_to(&self.inner) {
            return Err(Error::InvalidArgument(
                "rdma_join_multicast: the QP was not created on this id",
            ));
        }
        self.bound_device(NOT_BOUND)?;
        let key = group_key(group);
        if qp.has_joined(key) {
            return Err(Error::InvalidArgument(
                "rdma_join_multicast: the QP joined this group already",
            ));
        }
        let addr = SocketAddr::new(group, 0);
        let context = next_context();
        let channel = self.inner.channel();
        let mut registry = channel.lock();
        // librdmacm keeps one membership per address on an id and leaves
        // the first it finds: a second join of the address (by another QP
        // of the id, or while a leave waits for an event to be dropped)
        // would make the pending leave end the new membership.
        if registry.holds_group(&self.inner, addr) {
            return Err(Error::InvalidArgument(
                "rdma_join_multicast: this id holds the group already (joined by \
                 another of its QPs, or left while one of its events is held)",
            ));
        }
        let mut raw_addr = RawAddr::new(addr);
        // SAFETY: the id is live and we hold its channel's lock; the
        // address is read during the call; the context is a number
        // librdmacm only hands back, never dereferences.
        let rc = unsafe {
            sys::rdma_join_multicast(
                self.inner.raw(),
                raw_addr.as_ptr(),
                std::ptr::without_provenance_mut::<libc::c_void>(context as usize),
            )
        };
        if rc != 0 {
            return Err(Error::Cm {
                op: "rdma_join_multicast",
                peer: Some(addr),
                cause: CmFailure::Errno(last_errno()),
            });
        }
        let joined = Arc::new(Group {
            id: Arc::clone(&self.inner),
            addr,
            context,
            left: AtomicBool::new(false),
        });
        // Before the lock goes: the join's events find it from here on.
        registry.insert_group(context, &joined);
        drop(registry);
        qp.add_cm_group(key, joined as Arc<dyn Any + Send + Sync>);
        Ok(())
    }

    /// Leaves the multicast group at address `group`, joined for `qp` with
    /// [`join_multicast`](Self::join_multicast): `qp` is detached from it
    /// and the membership ends (`rdma_leave_multicast`); an event of the
    /// group still held ends it when dropped. Leaving before the join's
    /// event came cancels the join.
    pub fn leave_multicast(&self, qp: &mut UdQueuePair, group: IpAddr) -> Result<()> {
        if !qp.is_anchored_to(&self.inner) {
            return Err(Error::InvalidArgument(
                "rdma_leave_multicast: the QP was not created on this id",
            ));
        }
        let held = qp.remove_cm_group(group_key(group))?;
        match held.downcast::<Group>() {
            Ok(joined) => joined.leave(),
            // Only groups are recorded as the connection manager's.
            Err(_) => Err(Error::InvalidArgument(
                "rdma_leave_multicast: not a group joined through the connection manager",
            )),
        }
    }
}

/// What a `MulticastJoin` event says of the group: the GID and LID to
/// attach a QP to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Joined {
    pub(super) mgid: Gid,
    pub(super) mlid: u16,
}

/// Checks a `MulticastJoin` event's parameters (`param.ud`) for a QP on
/// `port` with Q_Key `qkey` that joined `group`: the multicast QP number,
/// the QP's own Q_Key (a datagram with another one would be dropped), the
/// QP's port, and the GID the kernel maps `group` to (see
/// [`is_gid_of`]).
pub(super) fn joined(
    ud: &sys::rdma_ud_param,
    port: u8,
    qkey: u32,
    group: IpAddr,
) -> Result<Joined> {
    if ud.qp_num != MULTICAST_QPN {
        return Err(Error::InvalidArgument(
            "the join event's QP number is not the multicast one (0xffffff)",
        ));
    }
    if ud.qkey != qkey {
        return Err(Error::InvalidArgument(
            "the group's Q_Key is not the QP's (UdConfig::qkey)",
        ));
    }
    if ud.ah_attr.port_num != port {
        return Err(Error::InvalidArgument(
            "the join event's address is for another port than the QP's",
        ));
    }
    // SAFETY: both views of the GID union are 16 bytes of plain data.
    let mgid = Gid(unsafe { ud.ah_attr.grh.dgid.raw });
    if !is_gid_of(&mgid, group) {
        return Err(Error::InvalidArgument(
            "the join event's GID is not the one of the group joined",
        ));
    }
    Ok(Joined {
        mgid,
        mlid: ud.ah_attr.dlid,
    })
}

/// Whether `mgid` is the GID the kernel joins for `group`: on RoCE v2 the
/// address itself (IPv4-mapped), on RoCE v1 and InfiniBand an `ff..` GID
/// that ends with the address's low bits (all 4 bytes of an IPv4 one, the
/// last 10 of an IPv6 one).
fn is_gid_of(mgid: &Gid, group: IpAddr) -> bool {
    if *mgid == group_key(group) {
        return true;
    }
    mgid.0[0] == 0xff
        && match group {
            IpAddr::V4(v4) => mgid.0[12..] == v4.octets(),
            IpAddr::V6(v6) => mgid.0[6..] == v6.octets()[6..],
        }
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, Ipv6Addr};

    use super::*;
    use crate::verbs::RDMA_UDP_QKEY;

    /// A join event's parameters as the kernel reports a RoCE v2 group.
    fn roce_join(group: Ipv4Addr) -> sys::rdma_ud_param {
        let mut ud = sys::rdma_ud_param {
            qp_num: MULTICAST_QPN,
            qkey: RDMA_UDP_QKEY,
            ..Default::default()
        };
        ud.ah_attr.port_num = 1;
        ud.ah_attr.is_global = 1;
        ud.ah_attr.grh.dgid.raw = Gid::from_ipv4(group).0;
        ud
    }

    #[test]
    fn a_join_event_gives_the_group_gid_and_lid_to_attach_to() {
        let group = Ipv4Addr::new(239, 1, 1, 1);
        let mut ud = roce_join(group);
        assert_eq!(
            joined(&ud, 1, RDMA_UDP_QKEY, group.into()).unwrap(),
            Joined {
                mgid: Gid::from_ipv4(group),
                mlid: 0
            }
        );
        // InfiniBand (and RoCE v1): an ff.. GID ending with the address,
        // and the group's LID.
        let mut ib = [0u8; 16];
        ib[0] = 0xff;
        ib[1] = 0x12;
        ib[12..].copy_from_slice(&group.octets());
        ud.ah_attr.grh.dgid.raw = ib;
        ud.ah_attr.dlid = 0xc001;
        assert_eq!(
            joined(&ud, 1, RDMA_UDP_QKEY, group.into()).unwrap(),
            Joined {
                mgid: Gid(ib),
                mlid: 0xc001
            }
        );
        let v6: Ipv6Addr = "ff0e::1:2".parse().unwrap();
        ud.ah_attr.grh.dgid.raw = v6.octets();
        assert!(joined(&ud, 1, RDMA_UDP_QKEY, v6.into()).is_ok(), "IPv6");
    }

    #[test]
    fn a_join_event_unfit_for_the_qp_or_the_group_is_refused() {
        let group = Ipv4Addr::new(239, 1, 1, 1);
        let good = roce_join(group);
        let refused = |ud: sys::rdma_ud_param, port, qkey| {
            matches!(
                joined(&ud, port, qkey, group.into()),
                Err(Error::InvalidArgument(_))
            )
        };
        assert!(!refused(good, 1, RDMA_UDP_QKEY));
        assert!(refused(good, 2, RDMA_UDP_QKEY), "another port");
        assert!(refused(good, 1, RDMA_UDP_QKEY + 1), "another Q_Key");
        let mut unicast_qpn = good;
        unicast_qpn.qp_num = 0x12;
        assert!(refused(unicast_qpn, 1, RDMA_UDP_QKEY), "a QP's number");
        let mut unicast = good;
        unicast.ah_attr.grh.dgid.raw = Gid::from_ipv4(Ipv4Addr::new(10, 78, 0, 1)).0;
        assert!(refused(unicast, 1, RDMA_UDP_QKEY), "a unicast GID");
        let mut other = good;
        other.ah_attr.grh.dgid.raw = Gid::from_ipv4(Ipv4Addr::new(239, 1, 1, 2)).0;
        assert!(refused(other, 1, RDMA_UDP_QKEY), "another group");
        let mut other_ib = good;
        let mut gid = Gid::from_ipv4(Ipv4Addr::new(239, 1, 1, 2)).0;
        gid[0] = 0xff;
        other_ib.ah_attr.grh.dgid.raw = gid;
        assert!(
            refused(other_ib, 1, RDMA_UDP_QKEY),
            "another group's ff.. GID"
        );
        let mut zero = good;
        zero.ah_attr.grh.dgid.raw = [0; 16];
        assert!(refused(zero, 1, RDMA_UDP_QKEY), "no GID");
    }

    #[test]
    fn a_group_is_keyed_by_the_gid_of_its_address() {
        let v4 = Ipv4Addr::new(239, 1, 1, 1);
        assert_eq!(group_key(IpAddr::V4(v4)), Gid::from_ipv4(v4));
        let v6: Ipv6Addr = "ff0e::1".parse().unwrap();
        assert_eq!(group_key(IpAddr::V6(v6)), Gid(v6.octets()));
    }
}
