//! A connection's preallocated send work requests: `MAX_STAGED` WRs and their
//! SGEs, linked to each other once when the connection is created. Staging
//! writes the few fields a request needs into the next entry in place; the
//! doorbell cuts the list after the last staged entry, posts it, and mends
//! it. Nothing is zeroed, copied or relinked per message (perftest's way of
//! reusing its WR, for a whole batch).

use crate::sys;
use crate::verbs::QueuePair;

/// What one request needs besides its `wr_id` and flags.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Request {
    pub(crate) opcode: sys::ibv_wr_opcode,
    pub(crate) addr: u64,
    pub(crate) len: u32,
    pub(crate) lkey: u32,
    /// Remote address and rkey (WRITE and READ).
    pub(crate) remote: (u64, u32),
    pub(crate) imm: Option<u32>,
}

impl Request {
    /// A request on local memory only (SEND, SEND_WITH_IMM).
    #[inline]
    pub(crate) fn local(opcode: sys::ibv_wr_opcode, addr: u64, len: u32, lkey: u32) -> Self {
        Self {
            opcode,
            addr,
            len,
            lkey,
            remote: (0, 0),
            imm: None,
        }
    }
}

pub(crate) struct StagedSends<const N: usize> {
    // Boxed so the entries never move: the links between them stay valid
    // when the connection that owns them moves.
    wrs: Box<[sys::ibv_send_wr; N]>,
    sges: Box<[sys::ibv_sge; N]>,
    len: usize,
}

impl<const N: usize> StagedSends<N> {
    pub(crate) fn new() -> Self {
        let mut wrs: Box<[sys::ibv_send_wr; N]> = Box::new([sys::ibv_send_wr::default(); N]);
        let mut sges: Box<[sys::ibv_sge; N]> = Box::new([sys::ibv_sge::default(); N]);
        let wr_base = wrs.as_mut_ptr();
        for (i, wr) in wrs.iter_mut().enumerate() {
            wr.sg_list = &mut sges[i];
            // SAFETY: i + 1 <= N, one past the end at most, which is never
            // dereferenced: the last entry's link is cut before every post.
            wr.next = unsafe { wr_base.add(i + 1) };
        }
        Self { wrs, sges, len: 0 }
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
        self.len == N
    }

    #[inline]
    pub(crate) fn clear(&mut self) {
        self.len = 0;
    }

    /// Fills the next entry; the caller checked `is_full`.
    #[inline]
    pub(crate) fn push(&mut self, wr_id: u64, send_flags: u32, request: &Request) {
        let i = self.len;
        if i == N {
            return;
        }
        let sge = &mut self.sges[i];
        sge.addr = request.addr;
        sge.length = request.len;
        sge.lkey = request.lkey;
        let wr = &mut self.wrs[i];
        wr.wr_id = wr_id;
        wr.opcode = request.opcode;
        wr.send_flags = send_flags;
        // A zero-length request carries no SGE (a credit update).
        wr.num_sge = i32::from(request.len > 0);
        wr.wr.rdma.remote_addr = request.remote.0;
        wr.wr.rdma.rkey = request.remote.1;
        wr.__bindgen_anon_1.imm_data = request.imm.unwrap_or(0).to_be();
        self.len = i + 1;
    }

    /// Adds `flags` to the last staged request.
    #[inline]
    pub(crate) fn flag_last(&mut self, flags: u32) -> bool {
        match self.len.checked_sub(1) {
            Some(last) => {
                self.wrs[last].send_flags |= flags;
                true
            }
            None => false,
        }
    }

    /// Posts every staged request with one `ibv_post_send` and empties the
    /// list (also when posting fails: the connection is failed then).
    #[inline]
    pub(crate) fn post(&mut self, qp: &QueuePair) -> crate::Result<()> {
        let len = self.len;
        if len == 0 {
            return Ok(());
        }
        self.len = 0;
        let last = &mut self.wrs[len - 1] as *mut sys::ibv_send_wr;
        // SAFETY: `last` is entry len - 1 of our boxed array. Cutting its link
        // ends the list the provider walks at the staged entries, whose SGEs
        // point into registered memory the connection owns.
        unsafe {
            let mended = (*last).next;
            (*last).next = std::ptr::null_mut();
            let result = qp.post_send_list(self.wrs.as_mut_ptr(), len);
            (*last).next = mended;
            result
        }
    }
}
