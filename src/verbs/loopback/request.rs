//! Work requests as this device queues them: send and receive requests
//! read out of the poster's lists into fixed-size values (a stalled inline
//! send copies its payload), so they can wait after the post call returns,
//! and the send completions built from them.

use std::os::raw::c_int;

use crate::sys;

use super::MAX_SGE;
use super::dma::{Span, Spans, resolve};
use super::qp::LbQp;
use super::registry::{KeyMap, MrEntry};

/// One scatter/gather entry as posted.
#[derive(Clone, Copy, Default, Debug)]
struct Seg {
    addr: u64,
    len: u32,
    lkey: u32,
}

/// A request's scatter/gather list, inline (no allocation).
#[derive(Clone, Copy, Default, Debug)]
pub(super) struct SgList {
    segs: [Seg; MAX_SGE],
    count: usize,
}

impl SgList {
    /// Copies a posted list.
    ///
    /// # Safety
    /// `list` points at `count` valid entries when `count` > 0.
    pub(super) unsafe fn from_raw(
        list: *const sys::ibv_sge,
        count: c_int,
        max: usize,
    ) -> Option<Self> {
        let count = usize::try_from(count).ok()?;
        if count > max.min(MAX_SGE) || (count > 0 && list.is_null()) {
            return None;
        }
        let mut sgl = Self {
            count,
            ..Self::default()
        };
        for (i, seg) in sgl.segs.iter_mut().take(count).enumerate() {
            // SAFETY: i < count entries, valid per the caller.
            let sge = unsafe { *list.add(i) };
            *seg = Seg {
                addr: sge.addr,
                len: sge.length,
                lkey: sge.lkey,
            };
        }
        Some(sgl)
    }

    fn segs(&self) -> &[Seg] {
        &self.segs[..self.count]
    }

    fn total(&self) -> u64 {
        self.segs().iter().map(|s| u64::from(s.len)).sum()
    }

    /// True if any byte of this list is also in `other`.
    pub(super) fn overlaps(&self, other: &SgList) -> bool {
        self.segs().iter().any(|a| {
            other.segs().iter().any(|b| {
                let (a_end, b_end) = (
                    a.addr.saturating_add(u64::from(a.len)),
                    b.addr.saturating_add(u64::from(b.len)),
                );
                a.len > 0 && b.len > 0 && a.addr < b_end && b.addr < a_end
            })
        })
    }

    /// Resolves every entry against the MR table (in `pd`, with `need`).
    pub(super) fn resolve(&self, mrs: &KeyMap<MrEntry>, pd: u32, need: u32) -> Option<Spans> {
        let mut spans = Spans::new();
        for seg in self.segs().iter().filter(|s| s.len > 0) {
            spans.push(resolve(
                mrs,
                seg.lkey,
                seg.addr,
                u64::from(seg.len),
                pd,
                need,
            )?);
        }
        Some(spans)
    }
}

/// Where a send request's payload comes from.
enum Payload {
    /// Registered memory named by the SGEs' lkeys.
    Registered,
    /// Inline data at the SGEs' addresses, valid during the post call.
    InlineBorrowed,
    /// Inline data copied out when the request stalled.
    InlineOwned(Box<[u8]>),
}

/// A send-queue request as executed (and, stalled, as queued).
pub(super) struct SendOp {
    wr_id: u64,
    pub(super) opcode: sys::ibv_wr_opcode,
    pub(super) signaled: bool,
    /// Network byte order, as posted.
    pub(super) imm: u32,
    pub(super) sgl: SgList,
    payload: Payload,
    pub(super) remote_addr: u64,
    pub(super) rkey: u32,
}

impl SendOp {
    /// Reads a posted request; `Err(errno)` for one this device refuses.
    ///
    /// # Safety
    /// `wr` is a valid request whose SGE list is valid, as `ibv_post_send`
    /// requires.
    pub(super) unsafe fn from_raw(wr: &sys::ibv_send_wr, qp: &LbQp) -> Result<Self, c_int> {
        let opcode = wr.opcode;
        let rdma = matches!(
            opcode,
            sys::IBV_WR_RDMA_WRITE | sys::IBV_WR_RDMA_WRITE_WITH_IMM | sys::IBV_WR_RDMA_READ
        );
        if !rdma && !matches!(opcode, sys::IBV_WR_SEND | sys::IBV_WR_SEND_WITH_IMM) {
            return Err(libc::EINVAL);
        }
        // SAFETY: the caller vouches for the list.
        let sgl = unsafe { SgList::from_raw(wr.sg_list, wr.num_sge, qp.max_send_sge) }
            .ok_or(libc::EINVAL)?;
        let inline = wr.send_flags & sys::IBV_SEND_INLINE != 0;
        if inline && (opcode == sys::IBV_WR_RDMA_READ || sgl.total() > u64::from(qp.max_inline)) {
            return Err(libc::EINVAL);
        }
        let (remote_addr, rkey) = if rdma {
            // SAFETY: `rdma` is the union member of these opcodes.
            unsafe { (wr.wr.rdma.remote_addr, wr.wr.rdma.rkey) }
        } else {
            (0, 0)
        };
        Ok(Self {
            wr_id: wr.wr_id,
            opcode,
            signaled: qp.sig_all || wr.send_flags & sys::IBV_SEND_SIGNALED != 0,
            // SAFETY: a plain u32 in every member of the union.
            imm: unsafe { wr.__bindgen_anon_1.imm_data },
            sgl,
            payload: if inline {
                Payload::InlineBorrowed
            } else {
                Payload::Registered
            },
            remote_addr,
            rkey,
        })
    }

    /// Makes the request independent of the post call (for queuing).
    ///
    /// # Safety
    /// Called during the post call that posted it (inline data still valid).
    pub(super) unsafe fn detach(mut self) -> Self {
        if let Payload::InlineBorrowed = self.payload {
            let mut data = Vec::with_capacity(self.sgl.total() as usize);
            for seg in self.sgl.segs() {
                // SAFETY: inline data is readable for the call (the poster's
                // contract for IBV_SEND_INLINE).
                data.extend_from_slice(unsafe {
                    std::slice::from_raw_parts(seg.addr as *const u8, seg.len as usize)
                });
            }
            self.payload = Payload::InlineOwned(data.into_boxed_slice());
        }
        self
    }

    /// True if the device still reads (a SEND's or WRITE's payload) or
    /// writes (a READ's target) memory of `list` for this request: its
    /// payload is registered memory, not inline data it copied.
    pub(super) fn uses(&self, list: &SgList) -> bool {
        matches!(self.payload, Payload::Registered) && self.sgl.overlaps(list)
    }

    /// The bytes this request sends or writes, resolved in `pd`.
    pub(super) fn source(&self, mrs: &KeyMap<MrEntry>, pd: u32) -> Option<Spans> {
        match &self.payload {
            Payload::Registered => self.sgl.resolve(mrs, pd, 0),
            Payload::InlineBorrowed => {
                let mut spans = Spans::new();
                for seg in self.sgl.segs() {
                    spans.push(Span {
                        ptr: seg.addr as *mut u8,
                        len: seg.len as usize,
                    });
                }
                Some(spans)
            }
            Payload::InlineOwned(data) => Some(Spans::one(Span {
                ptr: data.as_ptr().cast_mut(),
                len: data.len(),
            })),
        }
    }

    fn wc_opcode(&self) -> sys::ibv_wc_opcode {
        match self.opcode {
            sys::IBV_WR_RDMA_WRITE | sys::IBV_WR_RDMA_WRITE_WITH_IMM => sys::IBV_WC_RDMA_WRITE,
            sys::IBV_WR_RDMA_READ => sys::IBV_WC_RDMA_READ,
            _ => sys::IBV_WC_SEND,
        }
    }

    pub(super) fn wc(&self, qpn: u32, status: sys::ibv_wc_status, byte_len: u32) -> sys::ibv_wc {
        sys::ibv_wc {
            wr_id: self.wr_id,
            status,
            opcode: self.wc_opcode(),
            byte_len,
            qp_num: qpn,
            ..Default::default()
        }
    }
}

/// A posted receive.
#[derive(Clone, Copy, Debug)]
pub(super) struct PostedRecv {
    pub(super) wr_id: u64,
    pub(super) sgl: SgList,
}
