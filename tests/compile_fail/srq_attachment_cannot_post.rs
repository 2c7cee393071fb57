//! An `SrqAttachment` attaches QPs to a shared receive queue; it has no way
//! to post receives on it.

use rdma_comm_core::verbs::{RecvBatch, SrqAttachment};

fn post_through_attachment(attachment: &mut SrqAttachment, batch: &mut RecvBatch<'_, 4>) {
    attachment.post_recv(batch).unwrap();
}

fn main() {
    let _ = post_through_attachment;
}
