//! The device's "DMA": memory resolved against the MR table for one
//! request (checked for range, protection domain and access rights), and
//! the copy between resolved ranges. Every copy into or out of registered
//! memory runs here, so its safety argument (spans resolved under the MR
//! table's read lock) reads in one place.

use std::ptr;

use super::MAX_SGE;
use super::registry::{KeyMap, MrEntry};

/// A contiguous range of registered (or inline) memory, resolved for a copy.
#[derive(Clone, Copy)]
pub(super) struct Span {
    pub(super) ptr: *mut u8,
    pub(super) len: usize,
}

/// Up to `MAX_SGE` spans.
#[derive(Clone, Copy)]
pub(super) struct Spans {
    spans: [Span; MAX_SGE],
    count: usize,
}

impl Spans {
    const EMPTY: Span = Span {
        ptr: ptr::null_mut(),
        len: 0,
    };

    pub(super) fn new() -> Self {
        Self {
            spans: [Self::EMPTY; MAX_SGE],
            count: 0,
        }
    }

    pub(super) fn one(span: Span) -> Self {
        let mut spans = Self::new();
        spans.push(span);
        spans
    }

    pub(super) fn push(&mut self, span: Span) {
        if span.len > 0 && self.count < MAX_SGE {
            self.spans[self.count] = span;
            self.count += 1;
        }
    }

    fn as_slice(&self) -> &[Span] {
        &self.spans[..self.count]
    }

    pub(super) fn total(&self) -> u64 {
        self.as_slice().iter().map(|s| s.len as u64).sum()
    }
}

/// Looks `key` up and checks that `addr..addr+len` lies inside it, in `pd`,
/// with every right of `need`.
pub(super) fn resolve(
    mrs: &KeyMap<MrEntry>,
    key: u32,
    addr: u64,
    len: u64,
    pd: u32,
    need: u32,
) -> Option<Span> {
    let entry = mrs.get(&key)?;
    let end = addr.checked_add(len)?;
    let inside = addr >= entry.addr && end <= entry.addr + entry.len;
    (inside && entry.pd == pd && entry.access & need == need).then_some(Span {
        ptr: addr as *mut u8,
        len: len as usize,
    })
}

/// Copies the bytes of `src` into `dst` in order; `dst` holds at least as
/// many bytes as `src`.
///
/// # Safety
/// Every span is valid for the copy: registered memory under the MR
/// table's read lock, or inline data the poster keeps alive for the call.
/// Source and destination may overlap (the copy is a `memmove` per piece).
pub(super) unsafe fn copy_spans(src: &Spans, dst: &Spans) {
    let mut targets = dst.as_slice().iter();
    let mut target = Spans::EMPTY;
    let mut filled = 0;
    for source in src.as_slice() {
        let mut taken = 0;
        while taken < source.len {
            if filled == target.len {
                match targets.next() {
                    Some(next) => (target, filled) = (*next, 0),
                    None => return,
                }
                continue;
            }
            let n = (source.len - taken).min(target.len - filled);
            // SAFETY: both ranges are in bounds of their spans, which the
            // caller vouches for; `copy` allows overlap.
            unsafe { ptr::copy(source.ptr.add(taken), target.ptr.add(filled), n) };
            taken += n;
            filled += n;
        }
    }
}
