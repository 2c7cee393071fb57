//! A bound window is one grant with one owner: it cannot be cloned, so
//! dropping it (or its QP) revokes the access, with no copy left to
//! deallocate the window a second time.

use rdma_comm_core::verbs::BoundWindow;

fn keep_a_copy(window: &BoundWindow) -> BoundWindow {
    window.clone()
}

fn main() {
    let _ = keep_a_copy;
}
