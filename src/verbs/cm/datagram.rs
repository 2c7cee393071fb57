//! Datagrams through the connection manager (`RDMA_PS_UDP`, rdma-core's
//! `udaddy`): a UD QP for an id, the active side's connect (a service ID
//! resolution request), the passive side's accept, and the destination the
//! active side's `Established` event carries.

use std::any::Any;
use std::ptr;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::sys;

use super::super::{CqSource, ProtectionDomain, RDMA_UDP_QKEY, UdConfig, UdQueuePair};
use super::id::{NOT_BOUND, Progress};
use super::{CmId, MAX_UD_ACCEPT_PRIVATE_DATA, MAX_UD_CONNECT_PRIVATE_DATA};

impl CmId {
    /// Creates a UD queue pair for this datagram id
    /// ([`EventChannel::create_ud_id`](super::EventChannel::create_ud_id)):
    /// the crate's own [`UdQueuePair`], on `pd` and the given CQs, on the
    /// id's port, ready to send and receive (post its receives before
    /// connecting or accepting). The QP keeps the id alive (the id is
    /// destroyed after it).
    ///
    /// `pd` (and the CQs) must be on the id's device context
    /// ([`context`](Self::context)). `config.port` is replaced by the id's
    /// port; `config.qkey` must be [`RDMA_UDP_QKEY`], the Q_Key the
    /// connection manager tells peers (anything else is refused: the
    /// peer's datagrams would carry a Q_Key the QP drops).
    pub fn create_ud_qp(
        &self,
        pd: &ProtectionDomain,
        send_cq: &impl CqSource,
        recv_cq: &impl CqSource,
        config: &UdConfig,
    ) -> Result<UdQueuePair> {
        if !self.is_datagram() {
            return Err(Error::InvalidArgument(
                "CmId::create_ud_qp: the id is for reliable connections \
                 (a datagram id comes from EventChannel::create_ud_id)",
            ));
        }
        if config.qkey != RDMA_UDP_QKEY {
            return Err(Error::InvalidArgument(
                "CmId::create_ud_qp: rdma_cm's datagram peers send with the Q_Key \
                 RDMA_UDP_QKEY (UdConfig::qkey)",
            ));
        }
        let (verbs, port) = self.bound_device(NOT_BOUND)?;
        if pd.inner.ctx.ctx != verbs {
            return Err(Error::InvalidArgument(
                "CmId::create_ud_qp: the PD is not on the id's device context \
                 (allocate it from CmId::context() or cm::open_device())",
            ));
        }
        let mut config = config.clone();
        config.port = Some(port);
        let mut qp = pd.create_ud_qp(send_cq, recv_cq, &config)?;
        qp.anchor_to(Arc::clone(&self.inner) as Arc<dyn Any + Send + Sync>);
        Ok(qp)
    }

    /// Asks the listener at the resolved address for its QP (after
    /// `RouteResolved`) for `qp` (created on this id), with up to 180
    /// bytes of `private_data`. The answer arrives as `Established` (then
    /// [`CmEvent::ud_destination`](super::CmEvent::ud_destination) is where
    /// to send), or as `Unreachable` when nothing listens there or the
    /// listener refused. The peer learns `qp`'s number only from the
    /// datagrams it gets.
    pub fn connect_ud(&mut self, qp: &UdQueuePair, private_data: &[u8]) -> Result<()> {
        if private_data.len() > MAX_UD_CONNECT_PRIVATE_DATA {
            return Err(Error::InvalidArgument(
                "rdma_connect(UD): private data is limited to 180 bytes",
            ));
        }
        self.check_ud_qp(qp, "rdma_connect(UD): the QP was not created on this id")?;
        if self.progress != Progress::Idle {
            return Err(Error::InvalidArgument(
                "rdma_connect(UD): the id is already connecting or connected",
            ));
        }
        let mut param = ud_conn_param(qp.qpn(), private_data);
        // SAFETY: the id is live and bound (it has a QP); the parameters and
        // the private data they point at are read during the call.
        self.call("rdma_connect(UD)", None, |id| unsafe {
            sys::rdma_connect(id, &mut param)
        })?;
        self.progress = Progress::Connecting { qpn: qp.qpn() };
        Ok(())
    }

    /// Answers the datagram connect request this id came with (see
    /// [`ConnectRequest::accept_ud`](super::ConnectRequest::accept_ud)).
    pub(super) fn accept_ud(&mut self, qp: &UdQueuePair, private_data: &[u8]) -> Result<()> {
        if private_data.len() > MAX_UD_ACCEPT_PRIVATE_DATA {
            return Err(Error::InvalidArgument(
                "rdma_accept(UD): private data is limited to 136 bytes",
            ));
        }
        self.check_ud_qp(
            qp,
            "rdma_accept(UD): the QP was not created on the request's id",
        )?;
        if self.progress != Progress::Idle {
            return Err(Error::InvalidArgument(
                "rdma_accept(UD): the request was already answered",
            ));
        }
        let mut param = ud_conn_param(qp.qpn(), private_data);
        // SAFETY: the id is live; the parameters and private data are read
        // during the call.
        self.call("rdma_accept(UD)", None, |id| unsafe {
            sys::rdma_accept(id, &mut param)
        })?;
        self.progress = Progress::Connected;
        Ok(())
    }

    fn check_ud_qp(&self, qp: &UdQueuePair, op: &'static str) -> Result<()> {
        if qp.is_anchored_to(&self.inner) {
            Ok(())
        } else {
            Err(Error::InvalidArgument(op))
        }
    }
}

/// The parameters a datagram connect or accept sends: the QP number and
/// the private data (no READ depths or retries: there is no connection).
fn ud_conn_param(qpn: u32, private_data: &[u8]) -> sys::rdma_conn_param {
    sys::rdma_conn_param {
        private_data: if private_data.is_empty() {
            ptr::null()
        } else {
            private_data.as_ptr().cast()
        },
        // Both callers checked the length against a limit below 256.
        private_data_len: private_data.len() as u8,
        qp_num: qpn,
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_datagram_connect_names_the_qp_and_carries_only_the_private_data() {
        let data = [7u8; MAX_UD_CONNECT_PRIVATE_DATA];
        let param = ud_conn_param(0x12_3456, &data);
        assert_eq!(param.qp_num, 0x12_3456);
        assert_eq!(param.private_data, data.as_ptr().cast());
        assert_eq!(usize::from(param.private_data_len), data.len());
        assert_eq!(
            (
                param.responder_resources,
                param.initiator_depth,
                param.retry_count,
                param.rnr_retry_count,
                param.srq
            ),
            (0, 0, 0, 0, 0)
        );
        let empty = ud_conn_param(1, &[]);
        assert!(empty.private_data.is_null());
        assert_eq!(empty.private_data_len, 0);
    }
}
