//! Safe, RAII wrappers over libibverbs.
//!
//! Ownership mirrors the verbs object tree: a [`QueuePair`] holds its
//! [`ProtectionDomain`] and both [`CompletionQueue`]s, a [`MemoryRegion`] holds
//! its PD, and every object holds the device [`Context`]. Whatever order the
//! user drops handles in, a QP is destroyed before its CQs, an MR before its PD
//! and everything before the device is closed.
//!
//! The [`cm`] module connects QPs through the RDMA connection manager
//! (librdmacm).
//!
//! All `unsafe` FFI lives in this module tree; each block says why it is sound.

pub mod cm;
mod cq;
mod device;
mod kept;
mod list;
#[cfg(feature = "loopback")]
mod loopback;
#[cfg(not(feature = "loopback"))]
#[path = "loopback_off.rs"]
mod loopback;
mod mr;
mod mw;
mod pd;
mod qp;
mod qp_config;
mod recv_slots;
pub(crate) mod requests;
mod srq;
mod ud;
mod wc;
mod wr;

pub use cq::{
    CompletionChannel, CompletionQueue, CqId, CqSource, PollFailed, SharedCq, WorkCompletion,
};
pub use device::{
    Context, DeviceAttr, Gid, GidEntry, GidType, LinkLayer, Mtu, PortAttr, PortState, devices,
};
pub use kept::Kept;
pub(crate) use list::{SendDescriptor, SendList, SendOpcode, Sge};
#[cfg(test)]
pub(crate) use loopback::{
    fail_next_polls, refuse_sends_after, refuse_sends_after_silently, reuse_qpn_next,
};
pub use mr::{AccessFlags, LocalSlice, MemoryRegion, Registration, RemoteRegion, RemoteSlice};
pub use mw::{BIND_WR_ID, BoundWindow, MemoryWindow};
pub use pd::ProtectionDomain;
pub use qp::{QpEndpoint, QpState, QueuePair};
pub use qp_config::QpConfig;
pub(crate) use recv_slots::RecvSlots;
pub use requests::{RecvRequests, SendRequests};
pub use srq::{SharedReceiveQueue, SrqAttachment};
#[cfg(test)]
pub(crate) use srq::{refuse_srq_recvs_after, srq_posted_wr_ids};
pub(crate) use ud::UdSendList;
pub use ud::{
    GRH_BYTES, RDMA_UDP_QKEY, UdConfig, UdDestination, UdEndpoint, UdQueuePair, UdSend,
    datagram_payload, datagram_sender,
};
pub use wc::{WcOpcode, WcStatus};
pub use wr::{Batch, RecvBatch, RecvRequest, SendBatch, SendFlags, WorkRequest};

use std::os::raw::c_int;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::error::{Error, Result};

/// Turns a verb's integer result into a `Result`.
///
/// Verbs disagree on conventions: most return an errno value, a few return -1
/// and set `errno`, and some providers return `-errno`. All three end up here.
pub(crate) fn check_rc(
    rc: c_int,
    verb: &'static str,
    device: &Arc<str>,
    qpn: Option<u32>,
) -> Result<()> {
    if rc == 0 {
        return Ok(());
    }
    let errno = match rc {
        -1 => std::io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO),
        r if r < 0 => -r,
        r => r,
    };
    Err(errno_error(verb, errno, device, qpn))
}

/// Turns a verb's returned pointer into a `NonNull`, reading `errno` on NULL.
pub(crate) fn check_ptr<T>(
    ptr: *mut T,
    verb: &'static str,
    device: &Arc<str>,
) -> Result<NonNull<T>> {
    NonNull::new(ptr).ok_or_else(|| {
        // A NULL without errno happens with some providers; EINVAL is the closest.
        let errno = match std::io::Error::last_os_error().raw_os_error() {
            Some(0) | None => libc::EINVAL,
            Some(e) => e,
        };
        errno_error(verb, errno, device, None)
    })
}

fn errno_error(verb: &'static str, errno: i32, device: &Arc<str>, qpn: Option<u32>) -> Error {
    if errno == libc::EOPNOTSUPP {
        Error::Unsupported {
            verb,
            device: Arc::clone(device),
        }
    } else {
        crate::error::verbs_error(verb, errno, device, qpn)
    }
}
