//! Multicast membership of a UD QP: joining a group directly (the QP
//! attached to its GID, with this host's IP membership held by a socket)
//! or through the connection manager, leaving it, and what holds each
//! membership until the QP leaves the group or is dropped.

use std::any::Any;
use std::net::{Ipv4Addr, UdpSocket};
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::sys;

use super::super::check_rc;
use super::super::device::{Gid, LinkLayer};
use super::UdQueuePair;

impl UdQueuePair {
    /// Joins multicast group `group`, the IPv4-mapped GID of a multicast
    /// address (`Gid::from_ipv4(239.1.1.1)`): datagrams sent to it with
    /// this QP's Q_Key are received here too. RoCE v2 routes multicast over
    /// IP, so the QP is attached to the group and this host joins the IP
    /// group on the interface of the QP's GID (IGMP, as the kernel's
    /// connection manager does); without that membership the kernel, and
    /// an IGMP-snooping switch, would not deliver the group's packets. Not
    /// on InfiniBand, where a group is joined through the subnet manager
    /// ([`Error::Unsupported`]).
    ///
    /// Joining a group the QP has joined already does nothing; a group it
    /// joined through the connection manager (`cm::CmId::join_multicast`)
    /// is refused.
    pub fn join(&mut self, group: Gid) -> Result<()> {
        match self.membership(group) {
            Some(Membership::Ip { .. }) => return Ok(()),
            Some(Membership::Cm { .. }) => {
                return Err(Error::InvalidArgument(
                    "join: the QP joined this group through the connection manager",
                ));
            }
            None => {}
        }
        let Some(address) = group.ipv4_mapped().filter(Ipv4Addr::is_multicast) else {
            return Err(Error::InvalidArgument(
                "join: a group is the IPv4-mapped GID of a multicast address (224.0.0.0/4)",
            ));
        };
        let interface = match (self.link_layer, self.local.gid.ipv4_mapped()) {
            (LinkLayer::Ethernet, Some(interface)) => interface,
            _ => {
                return Err(Error::Unsupported {
                    verb: "ibv_attach_mcast (multicast needs a RoCE v2 port with an IPv4 GID)",
                    device: Arc::clone(&self.pd.ctx.name),
                });
            }
        };
        // Bound to the group's address, so that it opens no port to unicast.
        let membership = UdpSocket::bind((address, 0))
            .and_then(|socket| {
                socket
                    .join_multicast_v4(&address, &interface)
                    .map(|()| socket)
            })
            .map_err(|source| Error::Os {
                what: "joining the multicast group's IP group (IP_ADD_MEMBERSHIP)",
                source,
            })?;
        self.attach(&group, 0, "ibv_attach_mcast")?;
        self.groups.push((
            group,
            Membership::Ip {
                _socket: membership,
            },
        ));
        Ok(())
    }

    /// Leaves multicast group `group` joined with [`join`](Self::join):
    /// the QP is detached from it and this QP's IP membership of it ends.
    /// A group joined through the connection manager is left with
    /// `cm::CmId::leave_multicast`.
    pub fn leave(&mut self, group: Gid) -> Result<()> {
        let at = match self.groups.iter().position(|(joined, _)| *joined == group) {
            Some(at) if matches!(self.groups[at].1, Membership::Ip { .. }) => at,
            Some(_) => {
                return Err(Error::InvalidArgument(
                    "leave: the QP joined this group through the connection manager \
                     (CmId::leave_multicast leaves it)",
                ));
            }
            None => {
                return Err(Error::InvalidArgument(
                    "leave: the QP has not joined this group",
                ));
            }
        };
        self.detach(&group, 0)?;
        self.groups.swap_remove(at);
        Ok(())
    }

    fn membership(&self, group: Gid) -> Option<&Membership> {
        self.groups
            .iter()
            .find(|(joined, _)| *joined == group)
            .map(|(_, membership)| membership)
    }

    /// True if the QP joined the group `key` names, either way.
    #[cfg_attr(not(feature = "rdma_cm"), allow(dead_code))]
    pub(in crate::verbs) fn has_joined(&self, key: Gid) -> bool {
        self.membership(key).is_some()
    }

    /// Records a join through the connection manager of the group `key`
    /// names (the GID of its address), held by `group` until the QP leaves
    /// it; the QP is attached once the join is reported
    /// ([`attach_cm_group`](Self::attach_cm_group)). The caller checked
    /// that the QP had not joined it.
    #[cfg_attr(not(feature = "rdma_cm"), allow(dead_code))]
    pub(in crate::verbs) fn add_cm_group(&mut self, key: Gid, group: Arc<dyn Any + Send + Sync>) {
        self.groups.push((
            key,
            Membership::Cm {
                attached: None,
                group,
            },
        ));
    }

    /// Attaches the QP to the group held by `group` (recorded with
    /// [`add_cm_group`](Self::add_cm_group)), at the GID and LID its join
    /// event reported. `InvalidArgument` when this QP holds no such group
    /// (another QP's, or one it left).
    #[cfg_attr(not(feature = "rdma_cm"), allow(dead_code))]
    pub(in crate::verbs) fn attach_cm_group<T: Any + Send + Sync>(
        &mut self,
        group: &Arc<T>,
        mgid: Gid,
        mlid: u16,
    ) -> Result<()> {
        let Some(at) = self.groups.iter().position(|(_, membership)| {
            matches!(membership, Membership::Cm { group: own, .. }
                if std::ptr::addr_eq(Arc::as_ptr(own), Arc::as_ptr(group)))
        }) else {
            return Err(Error::InvalidArgument(
                "the join event is of a group this QP did not join, or left",
            ));
        };
        let current = match &self.groups[at].1 {
            Membership::Cm { attached, .. } => *attached,
            Membership::Ip { .. } => None,
        };
        match current {
            Some(now) if now == (mgid, mlid) => return Ok(()),
            Some((old, old_lid)) => self.detach(&old, old_lid)?,
            None => {}
        }
        if let Membership::Cm { attached, .. } = &mut self.groups[at].1 {
            *attached = None;
        }
        self.attach(&mgid, mlid, "ibv_attach_mcast(rdma_cm)")?;
        if let Membership::Cm { attached, .. } = &mut self.groups[at].1 {
            *attached = Some((mgid, mlid));
        }
        Ok(())
    }

    /// Detaches the QP from the group `key` names, joined through the
    /// connection manager, and hands back what holds the group (whose
    /// release leaves it). A failed detach keeps the membership.
    #[cfg_attr(not(feature = "rdma_cm"), allow(dead_code))]
    pub(in crate::verbs) fn remove_cm_group(
        &mut self,
        key: Gid,
    ) -> Result<Arc<dyn Any + Send + Sync>> {
        let at = match self.groups.iter().position(|(joined, _)| *joined == key) {
            Some(at) if matches!(self.groups[at].1, Membership::Cm { .. }) => at,
            Some(_) => {
                return Err(Error::InvalidArgument(
                    "leave_multicast: the QP joined this group with UdQueuePair::join \
                     (UdQueuePair::leave leaves it)",
                ));
            }
            None => {
                return Err(Error::InvalidArgument(
                    "leave_multicast: the QP has not joined this group",
                ));
            }
        };
        if let Some((gid, lid)) = self.groups[at].1.attachment(key) {
            self.detach(&gid, lid)?;
        }
        match self.groups.swap_remove(at).1 {
            Membership::Cm { group, .. } => Ok(group),
            // Not so: `at` was found as a connection manager's above.
            Membership::Ip { .. } => Err(Error::InvalidArgument(
                "leave_multicast: the QP joined this group with UdQueuePair::join",
            )),
        }
    }

    /// Attaches the QP to `group` (`lid`: 0 on RoCE), naming the call
    /// `verb` in an error.
    fn attach(&self, group: &Gid, lid: u16, verb: &'static str) -> Result<()> {
        let gid = sys::ibv_gid { raw: group.0 };
        // SAFETY: the QP is live and `gid` is an aligned, initialised GID.
        let rc = unsafe { sys::ibv_attach_mcast(self.qp.as_ptr(), &gid, lid) };
        check_rc(rc, verb, &self.pd.ctx.name, Some(self.local.qpn))
    }

    pub(super) fn detach(&self, group: &Gid, lid: u16) -> Result<()> {
        let gid = sys::ibv_gid { raw: group.0 };
        // SAFETY: the QP is live and `gid` is an aligned, initialised GID.
        let rc = unsafe { sys::ibv_detach_mcast(self.qp.as_ptr(), &gid, lid) };
        check_rc(
            rc,
            "ibv_detach_mcast",
            &self.pd.ctx.name,
            Some(self.local.qpn),
        )
    }
}

/// What holds a QP's membership of a multicast group.
pub(super) enum Membership {
    /// Joined with [`UdQueuePair::join`]: attached to the group's GID, and
    /// the socket that holds this host's IP membership of it.
    Ip { _socket: UdpSocket },
    /// Joined through the connection manager: attached to the GID and LID
    /// its join event reported, once it came; `group` holds the
    /// connection manager's membership, which ends when the last holder
    /// (this, or an unacknowledged event of the group) lets go.
    #[cfg_attr(not(feature = "rdma_cm"), allow(dead_code))]
    Cm {
        attached: Option<(Gid, u16)>,
        group: Arc<dyn Any + Send + Sync>,
    },
}

impl Membership {
    /// The GID and LID the QP is attached to for the group `key` names.
    pub(super) fn attachment(&self, key: Gid) -> Option<(Gid, u16)> {
        match self {
            Self::Ip { .. } => Some((key, 0)),
            Self::Cm { attached, .. } => *attached,
        }
    }
}
