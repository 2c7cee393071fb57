//! Datagrams staged for one `ibv_post_send` ([`UdSendList`], posted with
//! [`UdQueuePair::post_list`](super::UdQueuePair::post_list)): the
//! reactor's datagram endpoints post each pass's sends as one list, one
//! doorbell, from preallocated requests.

use std::sync::Arc;

use crate::sys;

use super::super::list::{SendChain, Sge};
use super::{AddressHandle, UdDestination};

/// Up to `N` datagrams, preallocated and linked ([`SendChain`]: SENDs,
/// each with its SGE), each holding the address handle it goes to until
/// the list is posted (the handler's destination may be dropped in
/// between).
pub(crate) struct UdSendList<const N: usize> {
    chain: SendChain,
    /// The handle of each staged datagram. An entry keeps its handle after
    /// the post, so a sender that keeps sending to one destination pays no
    /// reference count per datagram.
    handles: Box<[Option<Arc<AddressHandle>>; N]>,
    len: usize,
}

impl<const N: usize> UdSendList<N> {
    pub(crate) fn new() -> Self {
        Self {
            chain: SendChain::new(N, |wr| wr.opcode = sys::IBV_WR_SEND),
            handles: Box::new(std::array::from_fn(|_| None)),
            len: 0,
        }
    }

    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    #[inline]
    pub(crate) fn is_full(&self) -> bool {
        self.len == N
    }

    /// Forgets the staged datagrams (their handles stay until reused).
    #[inline]
    pub(crate) fn clear(&mut self) {
        self.len = 0;
    }

    /// Stages a SEND of `local` to `to`, inline if `inline`, asking for a
    /// completion if `signaled`; false (nothing staged) when full.
    ///
    /// # Safety
    ///
    /// `local` is memory registered under its lkey, at most the port's MTU,
    /// that stays valid and unwritten until the send completes (with
    /// `inline`, the provider reads it by address at the post); `to` was
    /// checked with [`UdQueuePair::check_destination`] for the QP the list
    /// is posted on.
    ///
    /// [`UdQueuePair::check_destination`]: super::UdQueuePair::check_destination
    #[inline]
    pub(crate) unsafe fn push(
        &mut self,
        wr_id: u64,
        local: Sge,
        to: &UdDestination,
        inline: bool,
        signaled: bool,
    ) -> bool {
        let i = self.len;
        // Both are `N` long: one bound proves both.
        let (Some(held), Some(mut entry)) = (self.handles.get_mut(i), self.chain.entry(i)) else {
            return false;
        };
        if !held.as_ref().is_some_and(|h| Arc::ptr_eq(h, &to.handle)) {
            *held = Some(Arc::clone(&to.handle));
        }
        entry.set_local(local);
        entry.set_id(wr_id);
        entry.set_flags(
            (if inline { sys::IBV_SEND_INLINE } else { 0 })
                | (if signaled { sys::IBV_SEND_SIGNALED } else { 0 }),
        );
        entry.set_ud(to.address());
        self.len = i + 1;
        true
    }

    /// Hands the staged datagrams to `post` as one NULL-terminated list
    /// (head, length) with the address handles they go to, and empties the
    /// list (also when posting fails). `None` when nothing is staged.
    ///
    /// Every request `post` gets was filled by [`push`](Self::push), whose
    /// caller vouched for its memory and destination; its handle is in the
    /// slice, at its position, for the call and after it.
    #[inline]
    pub(super) fn post_with<T>(
        &mut self,
        post: impl FnOnce(*mut sys::ibv_send_wr, usize, &[Option<Arc<AddressHandle>>]) -> T,
    ) -> Option<T> {
        let len = std::mem::take(&mut self.len);
        let handles = &self.handles[..len.min(N)];
        self.chain
            .post_with(len, None, |head| Some(post(head, len, handles)))
    }
}
