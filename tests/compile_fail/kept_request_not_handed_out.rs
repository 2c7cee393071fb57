//! A `Kept` never hands out the requests it keeps: a copy of one would
//! outlive the registrations the `Kept` holds. What a post reads from them
//! takes a seal that only the crate can make, and a path only the crate
//! can name.

use rdma_comm_core::verbs::{Kept, SendRequests, WorkRequest};

fn through_the_bound<R: SendRequests>(requests: &mut R) {
    let _ = requests.requests_mut(Default::default());
}

fn through_the_path(kept: &mut Kept<WorkRequest<'static>>) -> WorkRequest<'static> {
    use rdma_comm_core::verbs::requests::sealed::{Requests, Seal};
    kept.requests_mut(Seal::new())[0]
}

fn main() {
    let _ = (through_the_bound::<Kept<WorkRequest<'static>>>, through_the_path);
}
