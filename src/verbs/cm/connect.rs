//! Connecting one of our QPs through its id: creating it on the id's
//! device, the connect request and its response, accepting and rejecting.

use std::any::Any;
use std::ptr;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::sys;

use super::super::{CqSource, ProtectionDomain, QpConfig, QueuePair, SrqAttachment};
use super::id::{NOT_BOUND, Progress};
use super::transition::{self, ReadDepths};
use super::{
    CmId, ConnParams, MAX_ACCEPT_PRIVATE_DATA, MAX_CONNECT_PRIVATE_DATA, MAX_REJECT_PRIVATE_DATA,
    MAX_UD_ACCEPT_PRIVATE_DATA,
};

impl CmId {
    /// Creates an RC queue pair for this id's connection: the crate's own
    /// [`QueuePair`], on `pd` and the given CQs, in INIT on the id's port, so
    /// receives can be posted before connecting. The QP keeps the id alive
    /// (the id is destroyed after it).
    ///
    /// `pd` (and the CQs) must be on the id's device context
    /// ([`context`](Self::context)). The connection manager chooses the
    /// path, MTU, PSNs, timeout and retry counts when it connects the QP;
    /// `config`'s queue sizes, remote access rights and `max_rd_atomic` (an
    /// upper bound on the negotiated READ depths) apply, as do
    /// `retry_cnt`/`rnr_retry` (what this side asks the peer to use) and
    /// `min_rnr_timer`.
    pub fn create_qp(
        &self,
        pd: &ProtectionDomain,
        send_cq: &impl CqSource,
        recv_cq: &impl CqSource,
        config: &QpConfig,
    ) -> Result<QueuePair> {
        self.create_qp_inner(pd, send_cq, recv_cq, None, config)
    }

    /// Like [`create_qp`](Self::create_qp), with the receives taken from `srq`.
    pub fn create_qp_with_srq(
        &self,
        pd: &ProtectionDomain,
        send_cq: &impl CqSource,
        recv_cq: &impl CqSource,
        srq: &SrqAttachment,
        config: &QpConfig,
    ) -> Result<QueuePair> {
        self.create_qp_inner(pd, send_cq, recv_cq, Some(srq), config)
    }

    fn create_qp_inner(
        &self,
        pd: &ProtectionDomain,
        send_cq: &impl CqSource,
        recv_cq: &impl CqSource,
        srq: Option<&SrqAttachment>,
        config: &QpConfig,
    ) -> Result<QueuePair> {
        if self.is_datagram() {
            return Err(Error::InvalidArgument(
                "CmId::create_qp: the id is for datagrams (EventChannel::create_ud_id): \
                 its QP comes from CmId::create_ud_qp",
            ));
        }
        let (verbs, port) = self.bound_device(NOT_BOUND)?;
        if pd.inner.ctx.ctx != verbs {
            return Err(Error::InvalidArgument(
                "CmId::create_qp: the PD is not on the id's device context \
                 (allocate it from CmId::context() or cm::open_device())",
            ));
        }
        let mut config = config.clone();
        config.port = Some(port);
        let mut qp = pd.create_qp_inner(send_cq, recv_cq, srq, &config)?;
        qp.anchor_to(Arc::clone(&self.inner) as Arc<dyn Any + Send + Sync>);
        Ok(qp)
    }

    fn check_qp(&self, qp: &QueuePair, op: &'static str) -> Result<()> {
        if qp.is_anchored_to(&self.inner) {
            Ok(())
        } else {
            Err(Error::InvalidArgument(op))
        }
    }

    /// Sends a connect request for `qp` (created on this id, after the
    /// route is resolved) carrying up to 56 bytes of `private_data`. The
    /// peer's answer arrives as `ConnectResponse` (then call
    /// [`establish`](Self::establish)), `Rejected` or `Unreachable`.
    pub fn connect(&mut self, qp: &QueuePair, private_data: &[u8]) -> Result<()> {
        if private_data.len() > MAX_CONNECT_PRIVATE_DATA {
            return Err(Error::InvalidArgument(
                "rdma_connect: private data is limited to 56 bytes",
            ));
        }
        self.check_qp(qp, "rdma_connect: the QP was not created on this id")?;
        if self.progress != Progress::Idle {
            return Err(Error::InvalidArgument(
                "rdma_connect: the id is already connecting or connected",
            ));
        }
        let depth = qp.config().max_rd_atomic;
        let mut param = conn_param(qp, depth, depth, private_data);
        // SAFETY: the id is live and bound (it has a QP); the parameters and
        // the private data they point at are read during the call.
        self.call("rdma_connect", None, |id| unsafe {
            sys::rdma_connect(id, &mut param)
        })?;
        self.progress = Progress::Connecting { qpn: qp.qpn() };
        Ok(())
    }

    /// Completes a connection after its `ConnectResponse`: takes `qp` to
    /// RTR and RTS with what the connection manager negotiated and tells
    /// the peer (`rdma_establish`), whose side then reports `Established`.
    /// On failure the QP is left in the error state.
    pub fn establish(&mut self, qp: &mut QueuePair) -> Result<()> {
        self.check_qp(qp, "rdma_establish: the QP was not created on this id")?;
        // Refused before the QP is touched: a working connection's QP is
        // not moved to the error state by a call out of order.
        if self.progress != (Progress::Connecting { qpn: qp.qpn() }) {
            return Err(Error::InvalidArgument(
                "rdma_establish: only once, after connect with this QP and its ConnectResponse",
            ));
        }
        let result = self.ready(qp, None).and_then(|()| {
            // SAFETY: the id is live; it has no librdmacm QP, as the call requires.
            self.call("rdma_establish", None, |id| unsafe {
                sys::rdma_establish(id)
            })
        });
        fail_qp_on_error(qp, result)?;
        self.progress = Progress::Connected;
        Ok(())
    }

    /// Accepts the connect request this id came with (see
    /// [`ConnectRequest::accept`](super::ConnectRequest::accept)).
    pub(super) fn accept(
        &mut self,
        qp: &mut QueuePair,
        requested: ConnParams,
        private_data: &[u8],
    ) -> Result<()> {
        if private_data.len() > MAX_ACCEPT_PRIVATE_DATA {
            return Err(Error::InvalidArgument(
                "rdma_accept: private data is limited to 196 bytes",
            ));
        }
        self.check_qp(
            qp,
            "rdma_accept: the QP was not created on the request's id",
        )?;
        if self.progress != Progress::Idle {
            return Err(Error::InvalidArgument(
                "rdma_accept: the id is already connected",
            ));
        }
        // The peer's READs need our responder resources, ours its; neither
        // beyond what our QP was configured for.
        let max = qp.config().max_rd_atomic;
        let depths = ReadDepths {
            responder: requested.responder_resources.min(max),
            initiator: requested.initiator_depth.min(max),
        };
        let result = self.ready(qp, Some(depths)).and_then(|()| {
            let mut param = conn_param(qp, depths.responder, depths.initiator, private_data);
            // SAFETY: the id is live; the parameters and private data are
            // read during the call.
            self.call("rdma_accept", None, |id| unsafe {
                sys::rdma_accept(id, &mut param)
            })
        });
        fail_qp_on_error(qp, result)?;
        self.progress = Progress::Connected;
        Ok(())
    }

    /// Rejects the connect request this id came with.
    pub(super) fn reject(&mut self, private_data: &[u8]) -> Result<()> {
        // A datagram request's answer carries less than a connection's.
        let (max, refusal) = match self.is_datagram() {
            true => (
                MAX_UD_ACCEPT_PRIVATE_DATA,
                "rdma_reject(UD): private data is limited to 136 bytes",
            ),
            false => (
                MAX_REJECT_PRIVATE_DATA,
                "rdma_reject: private data is limited to 148 bytes",
            ),
        };
        let len = u8::try_from(private_data.len())
            .ok()
            .filter(|&len| usize::from(len) <= max)
            .ok_or(Error::InvalidArgument(refusal))?;
        // SAFETY: the id is live; the private data is read during the call.
        self.call("rdma_reject", None, |id| unsafe {
            sys::rdma_reject(id, private_data.as_ptr().cast(), len)
        })
    }

    /// Takes `qp` INIT→INIT→RTR→RTS with the attributes the connection
    /// manager computed for this id.
    fn ready(&self, qp: &mut QueuePair, depths: Option<ReadDepths>) -> Result<()> {
        // SAFETY: the id is live and `locked` holds its channel's lock.
        self.locked(|id, peer| unsafe { transition::ready(id, qp, depths, peer) })
    }
}

/// The QP leaves a failed connection attempt in the error state, so that
/// nothing posted on it waits for a peer that will not come.
fn fail_qp_on_error(qp: &QueuePair, result: Result<()>) -> Result<()> {
    if result.is_err()
        && let Err(err) = qp.set_error()
    {
        log::warn!("after a failed rdma_cm connection: {err}");
    }
    result
}

/// The connection parameters this side sends for `qp`.
fn conn_param(
    qp: &QueuePair,
    responder: u8,
    initiator: u8,
    private_data: &[u8],
) -> sys::rdma_conn_param {
    let config = qp.config();
    sys::rdma_conn_param {
        private_data: if private_data.is_empty() {
            ptr::null()
        } else {
            private_data.as_ptr().cast()
        },
        // Both callers checked the length against a limit below 256.
        private_data_len: private_data.len() as u8,
        responder_resources: responder,
        initiator_depth: initiator,
        flow_control: 0,
        // 3-bit fields on the wire: QpConfig::validate refused anything
        // larger when the QP was created (its config cannot change since).
        retry_count: config.retry_cnt,
        rnr_retry_count: config.rnr_retry,
        srq: u8::from(qp.shared_receive_queue().is_some()),
        qp_num: qp.qpn(),
    }
}
