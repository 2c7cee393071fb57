//! What a queue posts: one request or a [`Batch`](super::Batch) of them,
//! borrowing its memory or [`Kept`](super::Kept) with it.
//! [`QueuePair::post_send`](super::QueuePair::post_send) takes any
//! [`SendRequests`]; [`QueuePair::post_recv`](super::QueuePair::post_recv)
//! and [`SharedReceiveQueue::post_recv`](super::SharedReceiveQueue::post_recv)
//! any [`RecvRequests`].
//!
//! Both traits are sealed: what a post reads from the requests (their raw
//! verbs requests, linked in place) is reachable only inside the crate,
//! through a [`Seal`](sealed::Seal) no other crate can make, so a
//! [`Kept`](super::Kept) never hands out the request it keeps.

use crate::sys;

/// What [`QueuePair::post_send`](super::QueuePair::post_send) posts: a
/// [`WorkRequest`](super::WorkRequest), a [`SendBatch`](super::SendBatch),
/// or either [`Kept`](super::Kept) with its memory.
pub trait SendRequests: sealed::Requests<Wr = sys::ibv_send_wr> {}

impl<T: sealed::Requests<Wr = sys::ibv_send_wr>> SendRequests for T {}

/// What [`QueuePair::post_recv`](super::QueuePair::post_recv) and
/// [`SharedReceiveQueue::post_recv`](super::SharedReceiveQueue::post_recv)
/// post: a [`RecvRequest`](super::RecvRequest), a
/// [`RecvBatch`](super::RecvBatch), or either [`Kept`](super::Kept) with
/// its memory.
pub trait RecvRequests: sealed::Requests<Wr = sys::ibv_recv_wr> {}

impl<T: sealed::Requests<Wr = sys::ibv_recv_wr>> RecvRequests for T {}

/// Points each of `requests` at its own SGE and at the next one; returns
/// the head (NULL when empty). Valid until `requests` is moved or changed.
#[inline]
pub(crate) fn link<R: sealed::Request>(requests: &mut [R]) -> *mut R::Wr {
    let mut next: *mut R::Wr = std::ptr::null_mut();
    for request in requests.iter_mut().rev() {
        next = request.link_to(next);
    }
    next
}

pub(crate) mod sealed {
    /// Proof of being inside the crate: its field is private, and only
    /// [`Seal::new`] (crate-private) makes one.
    #[derive(Debug)]
    pub struct Seal(());

    impl Seal {
        #[inline(always)]
        pub(crate) const fn new() -> Self {
            Self(())
        }
    }

    /// One verbs request with its one SGE beside it.
    pub trait Request {
        /// `ibv_send_wr` or `ibv_recv_wr`.
        type Wr;
        /// The same request with no borrow, for a [`Kept`](crate::verbs::Kept)
        /// that holds the registration its bytes are in instead.
        type Detached: Request<Wr = Self::Wr>;
        /// Sets the SGE pointer and `next`; returns a pointer to the WR.
        fn link_to(&mut self, next: *mut Self::Wr) -> *mut Self::Wr;
        fn wr_id(&self) -> u64;
        fn set_wr_id(&mut self, wr_id: u64);
        /// The bytes copied into the WQE, for a send flagged `INLINE`.
        fn inline_len(&self) -> Option<u32>;
        /// The local bytes it reads or writes: address, length and key.
        fn local_sge(&self) -> (u64, u32, u32);
        /// `None` for a request whose bytes are in no registration.
        fn detached(self) -> Option<Self::Detached>;
    }

    /// Requests posted as one list.
    pub trait Requests {
        type Wr;
        type Request: Request<Wr = Self::Wr>;
        /// The requests, to link and post (or to tag, inside the crate).
        fn requests_mut(&mut self, seal: Seal) -> &mut [Self::Request];
    }

    /// Requests that borrow their memory and can be kept with it instead.
    pub trait Keep: Requests {
        type Kept: Requests<Wr = Self::Wr>;
        /// `None` if a request's bytes are in no registration.
        fn kept(self) -> Option<Self::Kept>;
    }
}
