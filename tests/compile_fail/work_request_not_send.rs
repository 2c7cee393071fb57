//! A work request holds raw pointers into the memory it borrows and into
//! itself (its scatter-gather entry, its list link): it stays on the thread
//! that built it. Only a `Kept` one, which holds the registration its bytes
//! are in, may move to another thread.

use rdma_comm_core::verbs::{AccessFlags, ProtectionDomain, WorkRequest};

fn needs_send<T: Send>(_: T) {}

fn move_to_another_thread(pd: &ProtectionDomain) {
    let mr = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    needs_send(WorkRequest::send(1, mr.slice(0, 8).unwrap()));
}

fn main() {
    let _ = move_to_another_thread;
}
