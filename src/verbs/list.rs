//! A preallocated list of send work requests for a runtime that posts a
//! batch per doorbell: WRs and their SGEs, as many as one doorbell can
//! carry (the owner's send-queue depth), allocated once. Staging writes the few fields
//! a request needs into the next entry in place, through typed setters;
//! posting links the staged entries (two pointer stores each, from pointers
//! taken at that moment, so no stored pointer outlives a later borrow of
//! the arrays) and posts them. Nothing is zeroed or copied per message
//! (perftest's way of reusing its WR, for a whole batch).
//!
//! Entries carry raw addresses and keys, so the list is crate-private: the
//! reactor, which owns the memory its requests point at, is its one user.

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

/// Send requests up to a capacity fixed at creation, preallocated.
pub(crate) struct SendList {
    // Boxed: a list is large, and its owner moves. Both have the
    // capacity's length.
    wrs: Box<[sys::ibv_send_wr]>,
    sges: Box<[sys::ibv_sge]>,
    len: usize,
}

// SAFETY: the only raw pointers inside are the links `post_with` writes
// into the list's own boxes right before posting; they are not used after.
unsafe impl Send for SendList {}

impl SendList {
    /// A list of room for `capacity` requests (at least one).
    pub(crate) fn with_capacity(capacity: usize) -> Self {
        let capacity = capacity.max(1);
        Self {
            wrs: vec![sys::ibv_send_wr::default(); capacity].into_boxed_slice(),
            sges: vec![sys::ibv_sge::default(); capacity].into_boxed_slice(),
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
        self.len >= self.wrs.len()
    }

    #[inline]
    pub(crate) fn clear(&mut self) {
        self.len = 0;
    }

    /// Fills the next entry; false (and nothing staged) when full.
    #[inline]
    pub(crate) fn push(&mut self, wr_id: u64, flags: SendFlags, request: &SendDescriptor) -> bool {
        let i = self.len;
        // Both arrays have the same length; `get_mut` proves each index in
        // bounds with the one compare that refuses a full list.
        let (Some(wr), Some(sge)) = (self.wrs.get_mut(i), self.sges.get_mut(i)) else {
            return false;
        };
        *sge = request.local.into();
        wr.wr_id = wr_id;
        wr.opcode = request.raw_opcode();
        wr.send_flags = flags.bits();
        // A zero-length request carries no SGE (a credit update).
        wr.num_sge = i32::from(request.local.len > 0);
        let (remote_addr, rkey) = request.remote.map_or((0, 0), |r| (r.addr, r.rkey));
        wr.wr.rdma.remote_addr = remote_addr;
        wr.wr.rdma.rkey = rkey;
        wr.__bindgen_anon_1.imm_data = request.imm.unwrap_or(0).to_be();
        self.len = i + 1;
        true
    }

    /// The flags, `wr_id` and bytes of staged request `index` (unit tests
    /// of the reactor's staging).
    #[cfg(test)]
    pub(crate) fn staged_at(&self, index: usize) -> Option<(SendFlags, u64, u32)> {
        (index < self.len).then(|| {
            let wr = &self.wrs[index];
            let bytes = if wr.num_sge > 0 {
                self.sges[index].length
            } else {
                0
            };
            (
                SendFlags::from_bits_truncate(wr.send_flags),
                wr.wr_id,
                bytes,
            )
        })
    }

    /// Adds `flags` to the last staged request; false when none is staged.
    #[inline]
    pub(crate) fn flag_last(&mut self, flags: SendFlags) -> bool {
        match self.len.checked_sub(1) {
            Some(last) => {
                self.wrs[last].send_flags |= flags.bits();
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
        let len = self.len;
        if len == 0 {
            return Ok(());
        }
        self.len = 0;
        // Links from pointers taken now: every one derives from these two,
        // and nothing borrows the arrays again until `post` returns.
        let wrs = self.wrs.as_mut_ptr();
        let sges = self.sges.as_mut_ptr();
        for i in 0..len {
            let next = if i + 1 < len {
                wrs.wrapping_add(i + 1)
            } else {
                std::ptr::null_mut()
            };
            // SAFETY: i < len <= capacity, so entry i of both arrays exists; we
            // hold `&mut self`, so nothing else accesses them.
            unsafe {
                (*wrs.add(i)).sg_list = sges.add(i);
                (*wrs.add(i)).next = next;
            }
        }
        post(wrs, len)
    }
}

/// How many list nodes precede `bad` (all of them if `bad` is not in the list).
pub(super) fn count_before<W: NextPtr>(head: *mut W, bad: *mut W, len: usize) -> usize {
    let mut cur = head;
    let mut n = 0;
    while !cur.is_null() && cur != bad && n < len {
        // SAFETY: `cur` walks the list the caller built and just posted; it
        // is still alive in the caller, and at most `len` nodes are visited.
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
            assert_eq!(count_before(head, std::ptr::null_mut(), 10), len);
            Ok(())
        })
        .unwrap();
    }
}
