//! Flags every example shares (each example includes this with `mod common;`).

use clap::Args;
use rdma_comm_core::verbs::QpConfig;

/// Which device, port and GID to use; everything is detected by default.
#[derive(Args, Debug, Clone)]
pub struct DeviceArgs {
    /// RDMA device (default: the first with an active port).
    #[arg(short = 'd', long)]
    pub device: Option<String>,
    /// Port number (default: the first active one).
    #[arg(short = 'i', long)]
    pub ib_port: Option<u8>,
    /// GID index (default: the RoCE v2 IPv4-mapped GID).
    #[arg(short = 'x', long)]
    pub gid_index: Option<u32>,
}

impl DeviceArgs {
    /// Applies the port and GID choice to a QP configuration.
    #[allow(dead_code)]
    pub fn apply(&self, qp: &mut QpConfig) {
        qp.port = self.ib_port;
        qp.gid_index = self.gid_index;
    }
}
