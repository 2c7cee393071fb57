//! A preallocated list of send work requests for a runtime that posts a
//! batch per doorbell: WRs and their SGEs, as many as one doorbell can
//! carry (the owner's send-queue depth), allocated once and linked once
//! (each WR to its SGE and to the next WR). Staging writes the few fields
//! a request needs into the next entry in place; posting cuts the chain
//! after the last staged entry, posts, and mends it. Nothing is zeroed,
//! copied or linked per message (perftest's way of reusing its WR, for a
//! whole batch).
//!
//! The arrays are held as raw pointers from the moment they are
//! allocated, and every access, the links included, derives from those
//! pointers: no reference to the arrays is ever made that could outdate
//! the stored links.
//!
//! Entries carry raw addresses and keys, so the list is crate-private: the
//! reactor, which owns the memory its requests point at, is its one user.

use std::ptr::NonNull;

use crate::sys;

use super::mr::{LocalSlice, RemoteSlice};
use super::wr::SendFlags;

/// The operation of one send-queue request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SendOpcode {
    /// SEND, optionally with an immediate.
    Send,
    /// RDMA WRITE, optionally with an immediate (which consumes a receive).
    Write,
    /// RDMA READ.
    Read,
}

/// Registered local memory for one SGE: address, length, lkey.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Sge {
    pub(crate) addr: u64,
    pub(crate) len: u32,
    pub(crate) lkey: u32,
}

impl From<&LocalSlice<'_>> for Sge {
    fn from(local: &LocalSlice<'_>) -> Self {
        Self {
            addr: local.addr,
            len: local.len,
            lkey: local.lkey,
        }
    }
}

impl From<Sge> for sys::ibv_sge {
    #[inline]
    fn from(sge: Sge) -> Self {
        Self {
            addr: sge.addr,
            length: sge.len,
            lkey: sge.lkey,
        }
    }
}

/// What one request needs besides its `wr_id` and flags.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SendDescriptor {
    pub(crate) opcode: SendOpcode,
    pub(crate) local: Sge,
    /// Remote address and rkey (WRITE and READ).
    pub(crate) remote: Option<RemoteSlice>,
    pub(crate) imm: Option<u32>,
}

impl SendDescriptor {
    /// A SEND of `local` (empty: a zero-length notification).
    #[inline]
    pub(crate) fn send(local: Sge, imm: Option<u32>) -> Self {
        Self {
            opcode: SendOpcode::Send,
            local,
            remote: None,
            imm,
        }
    }

    /// A WRITE of `local` to `remote`.
    #[inline]
    pub(crate) fn write(local: Sge, remote: RemoteSlice, imm: Option<u32>) -> Self {
        Self {
            opcode: SendOpcode::Write,
            local,
            remote: Some(remote),
            imm,
        }
    }

    /// A zero-length WRITE to no memory, for draining a send queue: posted
    /// on a QP in the error state it is flushed behind every request before
    /// it (as the kernel's `ib_drain_sq` does), so its signaled completion
    /// proves them all done, including unsignaled ones that had completed
    /// without a word. (On a live QP it would move no data: a responder
    /// checks no R_Key for a zero-length WRITE.)
    #[inline]
    pub(crate) fn drain() -> Self {
        Self {
            opcode: SendOpcode::Write,
            local: Sge::default(),
            remote: Some(RemoteSlice {
                addr: 0,
                len: 0,
                rkey: 0,
            }),
            imm: None,
        }
    }

    /// A READ of `remote` into `local`.
    #[inline]
    pub(crate) fn read(local: Sge, remote: RemoteSlice) -> Self {
        Self {
            opcode: SendOpcode::Read,
            local,
            remote: Some(remote),
            imm: None,
        }
    }

    #[inline]
    fn raw_opcode(&self) -> sys::ibv_wr_opcode {
        match (self.opcode, self.imm.is_some()) {
            (SendOpcode::Send, false) => sys::IBV_WR_SEND,
            (SendOpcode::Send, true) => sys::IBV_WR_SEND_WITH_IMM,
            (SendOpcode::Write, false) => sys::IBV_WR_RDMA_WRITE,
            (SendOpcode::Write, true) => sys::IBV_WR_RDMA_WRITE_WITH_IMM,
            (SendOpcode::Read, _) => sys::IBV_WR_RDMA_READ,
        }
    }
}

/// Send work requests with their SGEs, preallocated and linked once: each
/// WR to its SGE and to the next WR (the last to none). A post hands out
/// the first `len` as one NULL-terminated list ([`post_with`](Self::post_with)).
/// Shared by the reactor's lists of connection requests ([`SendList`]) and
/// of datagrams (`UdSendList`).
pub(crate) struct SendChain {
    /// `capacity` WRs, from a leaked boxed slice; freed in `drop`.
    wrs: NonNull<sys::ibv_send_wr>,
    /// `capacity` SGEs, from a leaked boxed slice; freed in `drop`.
    sges: NonNull<sys::ibv_sge>,
    capacity: usize,
}

// SAFETY: the chain owns both arrays (nothing else points into them but
// their own links), so moving it to another thread moves sole ownership.
unsafe impl Send for SendChain {}

impl SendChain {
    /// `capacity` requests (at least one), each set up by `init` (its
    /// constant fields; the links are the chain's).
    pub(crate) fn new(capacity: usize, init: impl Fn(&mut sys::ibv_send_wr)) -> Self {
        let capacity = capacity.max(1);
        let mut wrs = vec![sys::ibv_send_wr::default(); capacity].into_boxed_slice();
        wrs.iter_mut().for_each(init);
        let sges = vec![sys::ibv_sge::default(); capacity].into_boxed_slice();
        let wrs = NonNull::from(Box::leak(wrs)).cast::<sys::ibv_send_wr>();
        let sges = NonNull::from(Box::leak(sges)).cast::<sys::ibv_sge>();
        for i in 0..capacity {
            let next = if i + 1 < capacity {
                wrs.as_ptr().wrapping_add(i + 1)
            } else {
                std::ptr::null_mut()
            };
            // SAFETY: i < capacity, the length of both fresh arrays, which
            // only this chain points into.
            unsafe {
                let wr = wrs.as_ptr().add(i);
                (*wr).sg_list = sges.as_ptr().add(i);
                (*wr).next = next;
            }
        }
        Self {
            wrs,
            sges,
            capacity,
        }
    }

    /// How many requests the chain holds.
    #[inline]
    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    /// Request `i`, to fill in through [`ChainEntry`]'s setters (which
    /// leave the links alone); `None` beyond the capacity.
    #[inline(always)]
    pub(crate) fn entry(&mut self, i: usize) -> Option<ChainEntry<'_>> {
        if i >= self.capacity {
            return None;
        }
        // SAFETY: i < capacity, so entry i of both arrays exists; the
        // borrows are derived from the arrays' own pointers (as the links
        // are), and `&mut self` keeps anything else from reaching them
        // while they live.
        unsafe {
            Some(ChainEntry {
                wr: &mut *self.wrs.as_ptr().add(i),
                sge: &mut *self.sges.as_ptr().add(i),
            })
        }
    }

    /// Request `i`, to read (`None` beyond the capacity).
    #[cfg(test)]
    pub(crate) fn get(&self, i: usize) -> Option<(&sys::ibv_send_wr, &sys::ibv_sge)> {
        if i >= self.capacity {
            return None;
        }
        // SAFETY: as in `entry`, shared.
        unsafe { Some((&*self.wrs.as_ptr().add(i), &*self.sges.as_ptr().add(i))) }
    }

    /// Hands the first `len` requests to `post` as one NULL-terminated
    /// list: the chain is cut after the last one for the call and mended
    /// after it (also if `post` unwinds). Returns what `post` returns, or
    /// `nothing` (`post` not called) for a `len` of 0 or beyond the
    /// capacity.
    ///
    /// The list `post` gets holds `len` requests, each with its one SGE (or
    /// none: `num_sge` is 0 or 1, [`ChainEntry::set_local`]), as their
    /// setters left them; whether their memory and handles are valid is the
    /// fillers' to vouch for.
    #[inline]
    pub(crate) fn post_with<T>(
        &mut self,
        len: usize,
        nothing: T,
        post: impl FnOnce(*mut sys::ibv_send_wr) -> T,
    ) -> T {
        if len == 0 || len > self.capacity {
            return nothing;
        }
        let head = self.wrs.as_ptr();
        if len == self.capacity {
            // The last entry's link is null already.
            return post(head);
        }
        // SAFETY: 1 <= len < capacity, so entries len - 1 and len exist;
        // `&mut self` is exclusive. The cut makes entry len - 1 the list's
        // last, the links before it being as created (only this function
        // writes a link, and the guard restores it).
        let _mend = unsafe {
            let last = head.add(len - 1);
            (*last).next = std::ptr::null_mut();
            Mend {
                last,
                next: head.add(len),
            }
        };
        post(head)
    }
}

/// Restores a cut link of a [`SendChain`] when dropped: after the post,
/// and if the post unwinds.
struct Mend {
    last: *mut sys::ibv_send_wr,
    next: *mut sys::ibv_send_wr,
}

impl Drop for Mend {
    #[inline(always)]
    fn drop(&mut self) {
        // SAFETY: `last` is an entry of the chain that cut it
        // (`SendChain::post_with`), which is still borrowed exclusively
        // while this guard lives; `next` is the entry after it.
        unsafe { (*self.last).next = self.next };
    }
}

/// One request of a [`SendChain`], to fill in. The setters never touch its
/// links (`next`, `sg_list`), and `num_sge` is 0 or 1: the chain stays a
/// list of requests each with its own SGE.
pub(crate) struct ChainEntry<'a> {
    wr: &'a mut sys::ibv_send_wr,
    sge: &'a mut sys::ibv_sge,
}

impl ChainEntry<'_> {
    /// The request's id.
    #[inline(always)]
    pub(crate) fn set_id(&mut self, wr_id: u64) {
        self.wr.wr_id = wr_id;
    }

    /// The operation.
    #[inline(always)]
    pub(crate) fn set_opcode(&mut self, opcode: sys::ibv_wr_opcode) {
        self.wr.opcode = opcode;
    }

    /// The send flags (`IBV_SEND_*`).
    #[inline(always)]
    pub(crate) fn set_flags(&mut self, flags: u32) {
        self.wr.send_flags = flags;
    }

    /// Adds send flags.
    #[inline(always)]
    pub(crate) fn add_flags(&mut self, flags: u32) {
        self.wr.send_flags |= flags;
    }

    /// The local memory: one SGE, or none for zero bytes.
    #[inline(always)]
    pub(crate) fn set_local(&mut self, local: Sge) {
        *self.sge = local.into();
        self.wr.num_sge = i32::from(local.len > 0);
    }

    /// The remote memory of a WRITE or READ (zeros for a SEND).
    #[inline(always)]
    pub(crate) fn set_remote(&mut self, remote_addr: u64, rkey: u32) {
        self.wr.wr.rdma.remote_addr = remote_addr;
        self.wr.wr.rdma.rkey = rkey;
    }

    /// The immediate, in host order.
    #[inline(always)]
    pub(crate) fn set_imm(&mut self, imm: u32) {
        self.wr.__bindgen_anon_1.imm_data = imm.to_be();
    }

    /// A UD SEND's address (its address handle, QP number and Q_Key).
    #[inline(always)]
    pub(crate) fn set_ud(&mut self, ud: sys::ibv_send_wr__bindgen_ty_2__bindgen_ty_3) {
        self.wr.wr.ud = ud;
    }
}

impl Drop for SendChain {
    fn drop(&mut self) {
        // SAFETY: both pointers came from leaked boxed slices of `capacity`
        // entries, and are freed only here.
        unsafe {
            drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(
                self.wrs.as_ptr(),
                self.capacity,
            )));
            drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(
                self.sges.as_ptr(),
                self.capacity,
            )));
        }
    }
}

/// Send requests up to a capacity fixed at creation, preallocated and
/// linked ([`SendChain`]).
pub(crate) struct SendList {
    chain: SendChain,
    len: usize,
}

impl SendList {
    /// A list of room for `capacity` requests (at least one).
    pub(crate) fn with_capacity(capacity: usize) -> Self {
        Self {
            chain: SendChain::new(capacity, |_| {}),
            len: 0,
        }
    }

    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    #[inline]
    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    #[inline]
    pub(crate) fn is_full(&self) -> bool {
        self.len >= self.chain.capacity()
    }

    #[inline]
    pub(crate) fn clear(&mut self) {
        self.len = 0;
    }

    /// Fills the next entry; false (and nothing staged) when full.
    #[inline]
    pub(crate) fn push(&mut self, wr_id: u64, flags: SendFlags, request: &SendDescriptor) -> bool {
        let i = self.len;
        let Some(mut entry) = self.chain.entry(i) else {
            return false;
        };
        let (remote_addr, rkey) = request.remote.map_or((0, 0), |r| (r.addr, r.rkey));
        entry.set_local(request.local);
        entry.set_id(wr_id);
        entry.set_opcode(request.raw_opcode());
        entry.set_flags(flags.bits());
        entry.set_remote(remote_addr, rkey);
        entry.set_imm(request.imm.unwrap_or(0));
        self.len = i + 1;
        true
    }

    /// The flags, `wr_id` and bytes of staged request `index` (unit tests
    /// of the reactor's staging).
    #[cfg(test)]
    pub(crate) fn staged_at(&self, index: usize) -> Option<(SendFlags, u64, u32)> {
        if index >= self.len {
            return None;
        }
        let (wr, sge) = self.chain.get(index)?;
        let bytes = if wr.num_sge > 0 { sge.length } else { 0 };
        Some((
            SendFlags::from_bits_truncate(wr.send_flags),
            wr.wr_id,
            bytes,
        ))
    }

    /// Adds `flags` to the last staged request; false when none is staged.
    #[inline]
    pub(crate) fn flag_last(&mut self, flags: SendFlags) -> bool {
        let Some(last) = self.len.checked_sub(1) else {
            return false;
        };
        match self.chain.entry(last) {
            Some(mut entry) => {
                entry.add_flags(flags.bits());
                true
            }
            None => false,
        }
    }

    /// Hands the staged requests to `post` as one NULL-terminated list
    /// (head, length) and empties the list, also when posting fails.
    #[inline]
    pub(crate) fn post_with(
        &mut self,
        post: impl FnOnce(*mut sys::ibv_send_wr, usize) -> crate::Result<()>,
    ) -> crate::Result<()> {
        let len = std::mem::take(&mut self.len);
        self.chain.post_with(len, Ok(()), |head| post(head, len))
    }
}

/// How many list nodes precede `bad` (all `len` if `bad` is not among the
/// first `len`).
///
/// # Safety
///
/// The first `len` nodes from `head`, following their `next` links (up to
/// a null one), are valid requests.
pub(super) unsafe fn count_before<W: NextPtr>(head: *mut W, bad: *mut W, len: usize) -> usize {
    let mut cur = head;
    let mut n = 0;
    while !cur.is_null() && cur != bad && n < len {
        // SAFETY: `cur` is one of the first `len` nodes (n < len), valid
        // by the caller's word.
        cur = unsafe { (*cur).next_ptr() };
        n += 1;
    }
    n
}

/// A verbs request with a `next` link.
pub(super) trait NextPtr {
    fn next_ptr(&self) -> *mut Self;
}

impl NextPtr for sys::ibv_send_wr {
    fn next_ptr(&self) -> *mut Self {
        self.next
    }
}

impl NextPtr for sys::ibv_recv_wr {
    fn next_ptr(&self) -> *mut Self {
        self.next
    }
}

/// The `wr_id` and first SGE address of each request of a list (tests of
/// the lists' linking).
#[cfg(test)]
pub(super) trait Listed: NextPtr {
    /// # Safety
    /// `sg_list` points at a valid SGE.
    unsafe fn id_and_addr(&self) -> (u64, u64);
}

#[cfg(test)]
impl Listed for sys::ibv_send_wr {
    unsafe fn id_and_addr(&self) -> (u64, u64) {
        // SAFETY: the caller's.
        (self.wr_id, unsafe { (*self.sg_list).addr })
    }
}

#[cfg(test)]
impl Listed for sys::ibv_recv_wr {
    unsafe fn id_and_addr(&self) -> (u64, u64) {
        // SAFETY: the caller's.
        (self.wr_id, unsafe { (*self.sg_list).addr })
    }
}

/// Each request's `wr_id` and SGE address, from `head` to the null link.
///
/// # Safety
/// `head` starts a NULL-terminated list of valid requests, each with a
/// valid SGE.
#[cfg(test)]
pub(super) unsafe fn ids_and_addrs<W: Listed>(head: *mut W) -> Vec<(u64, u64)> {
    let mut seen = Vec::new();
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: the caller's.
        unsafe {
            seen.push((*cur).id_and_addr());
            cur = (*cur).next_ptr();
        }
    }
    seen
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_post_sees_exactly_the_staged_entries_and_the_list_is_mended() {
        let mut list = SendList::with_capacity(4);
        let sge = Sge {
            addr: 0x1000,
            len: 8,
            lkey: 7,
        };
        for id in 0..3 {
            assert!(list.push(id, SendFlags::empty(), &SendDescriptor::send(sge, None)));
        }
        assert!(list.flag_last(SendFlags::SIGNALED));
        let seen = std::cell::RefCell::new(Vec::new());
        list.post_with(|head, len| {
            assert_eq!(len, 3);
            let mut cur = head;
            while !cur.is_null() {
                // SAFETY: the list's own entries, alive during the call.
                let wr = unsafe { &*cur };
                seen.borrow_mut().push((wr.wr_id, wr.send_flags));
                cur = wr.next;
            }
            Ok(())
        })
        .unwrap();
        let signaled = SendFlags::SIGNALED.bits();
        assert_eq!(*seen.borrow(), [(0, 0), (1, 0), (2, signaled)]);
        assert!(list.is_empty());
        // Mended: a longer batch next time walks through the old cut.
        for id in 0..4 {
            assert!(list.push(id, SendFlags::empty(), &SendDescriptor::send(sge, Some(5))));
        }
        assert!(!list.push(9, SendFlags::empty(), &SendDescriptor::send(sge, None)));
        list.post_with(|head, len| {
            // SAFETY: the list just handed over, alive during the call.
            assert_eq!(unsafe { count_before(head, std::ptr::null_mut(), 10) }, len);
            Ok(())
        })
        .unwrap();
    }

    #[test]
    fn a_refused_post_mends_the_list_and_each_entry_keeps_its_sge() {
        let mut list = SendList::with_capacity(3);
        let sge = |addr| Sge {
            addr,
            len: 8,
            lkey: 1,
        };
        assert!(list.push(
            1,
            SendFlags::empty(),
            &SendDescriptor::send(sge(0x10), None)
        ));
        let refused = list.post_with(|head, len| {
            // SAFETY: the list just handed over, alive during the call.
            assert_eq!(unsafe { count_before(head, std::ptr::null_mut(), 10) }, len);
            Err(crate::Error::InvalidArgument("refused"))
        });
        assert!(refused.is_err());
        assert!(list.is_empty(), "emptied also when refused");
        for id in 0..3 {
            let request = SendDescriptor::send(sge(0x100 * (id + 1)), None);
            assert!(list.push(id, SendFlags::empty(), &request));
        }
        let mut seen = Vec::new();
        list.post_with(|head, len| {
            assert_eq!(len, 3);
            // SAFETY: the list's own entries and SGEs, alive during the call.
            seen = unsafe { ids_and_addrs(head) };
            Ok(())
        })
        .unwrap();
        assert_eq!(seen, [(0, 0x100), (1, 0x200), (2, 0x300)]);
    }

    #[test]
    fn a_chain_posts_only_counts_it_holds_and_mends_after_a_panic() {
        let mut chain = SendChain::new(3, |_| {});
        assert_eq!(
            chain.post_with(0, None, |_| Some(0)),
            None,
            "nothing to post"
        );
        assert_eq!(
            chain.post_with(4, None, |_| Some(4)),
            None,
            "beyond the capacity"
        );
        let length = |head: *mut sys::ibv_send_wr| {
            // SAFETY: the chain's own list, alive during the call.
            Some(unsafe { count_before(head, std::ptr::null_mut(), 10) })
        };
        assert_eq!(chain.post_with(3, None, length), Some(3), "all of it");
        let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            chain.post_with(1, (), |_| panic!("a post that unwinds"));
        }));
        assert!(unwound.is_err());
        assert_eq!(chain.post_with(1, None, length), Some(1));
        assert_eq!(
            chain.post_with(3, None, length),
            Some(3),
            "mended after the panic"
        );
        assert_eq!(chain.post_with(2, None, length), Some(2));
    }
}
