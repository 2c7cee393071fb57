//! Driving one of our QPs through INIT, RTR and RTS with the attributes the
//! connection manager negotiated, as librdmacm does for QPs it creates.

use std::net::SocketAddr;

use crate::error::{CmFailure, Error, Result};
use crate::sys;

use super::super::{Context, LinkLayer, QueuePair};
use super::last_errno;

/// The READ depths this side agreed to (the passive side chooses them
/// before the connection manager knows them).
#[derive(Debug, Clone, Copy)]
pub(super) struct ReadDepths {
    /// READs the peer may have outstanding at our QP (`max_dest_rd_atomic`).
    pub(super) responder: u8,
    /// READs our QP may have outstanding (`max_rd_atomic`).
    pub(super) initiator: u8,
}

/// Bits of the RTR mask the kernel sets for RoCE, which an InfiniBand
/// port refuses (librdmacm clears them the same way).
const ROCE_ONLY_RTR_BITS: u32 = 0x00e0_0000;

/// Takes `qp` INIT→INIT (the id's port and P_Key, our access rights),
/// →RTR and →RTS with the connection manager's attributes for `id`.
///
/// # Safety
/// `id` must be a live rdma_cm id whose channel's lock the caller holds.
pub(super) unsafe fn ready(
    id: *mut sys::rdma_cm_id,
    qp: &mut QueuePair,
    depths: Option<ReadDepths>,
    peer: Option<SocketAddr>,
) -> Result<()> {
    let ctx = Context {
        inner: std::sync::Arc::clone(&qp.pd_inner().ctx),
    };
    let infiniband = ctx.query_port(qp.port())?.link_layer == LinkLayer::InfiniBand;
    let steps = [
        (
            sys::IBV_QPS_INIT,
            "rdma_init_qp_attr(INIT)",
            "ibv_modify_qp(INIT->INIT, rdma_cm)",
        ),
        (
            sys::IBV_QPS_RTR,
            "rdma_init_qp_attr(RTR)",
            "ibv_modify_qp(INIT->RTR, rdma_cm)",
        ),
        (
            sys::IBV_QPS_RTS,
            "rdma_init_qp_attr(RTS)",
            "ibv_modify_qp(RTR->RTS, rdma_cm)",
        ),
    ];
    for (state, op, verb) in steps {
        let mut attr = sys::ibv_qp_attr {
            qp_state: state,
            ..Default::default()
        };
        let mut mask: libc::c_int = 0;
        // SAFETY: the caller vouches for the id; both out-pointers are valid.
        if unsafe { sys::rdma_init_qp_attr(id, &mut attr, &mut mask) } != 0 {
            return Err(Error::Cm {
                op,
                peer,
                cause: CmFailure::Errno(last_errno()),
            });
        }
        let mut mask = mask as u32;
        let config = qp.config();
        match state {
            sys::IBV_QPS_INIT => {
                // Least privilege: what the QP was configured to grant,
                // not the connection manager's REMOTE_READ | REMOTE_WRITE.
                attr.qp_access_flags = config.remote_access.bits();
                mask |= sys::IBV_QP_ACCESS_FLAGS;
            }
            sys::IBV_QPS_RTR => {
                if infiniband {
                    mask &= !ROCE_ONLY_RTR_BITS;
                }
                if let Some(depths) = depths {
                    attr.max_dest_rd_atomic = depths.responder;
                }
                // On the active side the depths come from the peer's reply:
                // it must not make us reserve more than we configured.
                attr.max_dest_rd_atomic = attr.max_dest_rd_atomic.min(config.max_rd_atomic);
                if mask & sys::IBV_QP_MIN_RNR_TIMER != 0 {
                    attr.min_rnr_timer = config.min_rnr_timer;
                }
            }
            _ => {
                if let Some(depths) = depths {
                    attr.max_rd_atomic = depths.initiator;
                }
                attr.max_rd_atomic = attr.max_rd_atomic.min(config.max_rd_atomic);
                // The retry counts come from the peer's request or reply:
                // a peer must not make us retry longer than we configured
                // (RNR 7 is for ever).
                attr.retry_cnt = attr.retry_cnt.min(config.retry_cnt);
                attr.rnr_retry = attr.rnr_retry.min(config.rnr_retry);
            }
        }
        qp.modify_with(&mut attr, mask, verb)?;
    }
    Ok(())
}
