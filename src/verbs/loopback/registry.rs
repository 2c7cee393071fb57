//! The process-wide registries: every loopback MR by key and every live QP
//! by number, and the counters that hand out keys, QP numbers and handles.
//! They are global, not per context, because the QPs of any loopback
//! context in the process connect to one another and reach each other's
//! memory.

use std::collections::HashMap;
#[cfg(test)]
use std::collections::VecDeque;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{LazyLock, Mutex, PoisonError, RwLock, RwLockReadGuard, Weak};

#[cfg(test)]
use super::lock;
use super::qp::LbQp;

/// A hasher for keys that are already unique small integers.
#[derive(Default)]
pub(super) struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u32(&mut self, n: u32) {
        // Spread into the high bits, which the table's control bytes use.
        self.0 = u64::from(n).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

pub(super) type KeyMap<V> = HashMap<u32, V, BuildHasherDefault<IdHasher>>;

/// A registered range, by key (lkey and rkey are the same number).
#[derive(Clone, Copy, Debug)]
pub(super) struct MrEntry {
    pub(super) addr: u64,
    pub(super) len: u64,
    pub(super) access: u32,
    pub(super) pd: u32,
}

/// Every loopback MR in the process. Copies hold the read lock for their
/// whole duration; deregistration takes the write lock.
pub(super) static MRS: LazyLock<RwLock<KeyMap<MrEntry>>> = LazyLock::new(Default::default);
/// Every live loopback QP in the process, by QP number.
pub(super) static QPS: LazyLock<Mutex<KeyMap<Weak<LbQp>>>> = LazyLock::new(Default::default);
pub(super) static NEXT_KEY: AtomicU32 = AtomicU32::new(0x100);
pub(super) static NEXT_QPN: AtomicU32 = AtomicU32::new(0x11);
static NEXT_HANDLE: AtomicU32 = AtomicU32::new(1);

pub(super) fn read_mrs() -> RwLockReadGuard<'static, KeyMap<MrEntry>> {
    MRS.read().unwrap_or_else(PoisonError::into_inner)
}

pub(super) fn next_handle() -> u32 {
    NEXT_HANDLE.fetch_add(1, Ordering::Relaxed)
}

#[cfg(test)]
thread_local! {
    /// The QP number the next QP this thread creates takes if it is free
    /// ([`reuse_qpn_next`]).
    static REUSED_QPN: std::cell::Cell<Option<u32>> = const { std::cell::Cell::new(None) };
}

/// Makes the next QP this thread creates take number `qpn` if no live QP
/// has it, as a kernel that reuses a destroyed QP's number at once does
/// (tests of completions left behind by a destroyed QP).
#[cfg(test)]
pub(crate) fn reuse_qpn_next(qpn: u32) {
    REUSED_QPN.with(|next| next.set(Some(qpn)));
}

/// The number [`reuse_qpn_next`] asked this thread's next QP to take.
pub(super) fn take_reused_qpn() -> Option<u32> {
    #[cfg(test)]
    return REUSED_QPN.with(std::cell::Cell::take);
    #[cfg(not(test))]
    None
}

/// True while a QP numbered `qpn` is registered (tests of teardown).
#[cfg(test)]
pub(super) fn is_qp_registered(qpn: u32) -> bool {
    lock(&QPS).contains_key(&qpn)
}

/// True while a memory region keyed `key` is registered (tests of teardown).
#[cfg(test)]
pub(super) fn is_mr_registered(key: u32) -> bool {
    read_mrs().contains_key(&key)
}

/// Test-only faults: by QP number (send lists) and by SRQ handle (receive
/// lists of an SRQ), how many requests each of the next posts accepts
/// before it refuses the rest of its list with `ENOMEM`, as a provider
/// whose queue filled up mid-list does, and whether it says where (sets
/// `bad_wr`). Queued: calls in a row limit posts in a row.
#[cfg(test)]
static SEND_POST_LIMITS: LazyLock<PostLimits> = LazyLock::new(Default::default);
#[cfg(test)]
static SRQ_POST_LIMITS: LazyLock<PostLimits> = LazyLock::new(Default::default);

/// Per key, the queued limits: how many requests a post accepts, and
/// whether its refusal says where.
#[cfg(test)]
type PostLimits = Mutex<KeyMap<VecDeque<(usize, bool)>>>;

#[cfg(test)]
fn queue_limit(limits: &PostLimits, key: u32, limit: (usize, bool)) {
    lock(limits).entry(key).or_default().push_back(limit);
}

#[cfg(test)]
fn take_limit(limits: &PostLimits, key: u32) -> PostLimit {
    let mut limits = lock(limits);
    let Some(queued) = limits.get_mut(&key) else {
        return PostLimit::default();
    };
    let limit = queued.pop_front();
    if queued.is_empty() {
        limits.remove(&key);
    }
    PostLimit {
        limit: limit.map(|(accepted, _)| accepted),
        says_where: limit.is_none_or(|(_, says_where)| says_where),
        accepted: 0,
    }
}

/// Makes the next post of a send list on QP `qpn` (not limited already)
/// accept only its first `accepted` requests (tests of a partial post).
#[cfg(test)]
pub(crate) fn refuse_sends_after(qpn: u32, accepted: usize) {
    queue_limit(&SEND_POST_LIMITS, qpn, (accepted, true));
}

/// As [`refuse_sends_after`], by a provider that does not say which
/// request it refused (leaves `bad_wr` as it was): the caller cannot tell
/// what went in.
#[cfg(test)]
pub(crate) fn refuse_sends_after_silently(qpn: u32, accepted: usize) {
    queue_limit(&SEND_POST_LIMITS, qpn, (accepted, false));
}

/// The limit `refuse_sends_after` set for this post on `qpn`, if any.
#[cfg(test)]
pub(super) fn take_send_limit(qpn: u32) -> PostLimit {
    take_limit(&SEND_POST_LIMITS, qpn)
}

/// Makes the next post of a receive list on the SRQ whose handle is
/// `handle` (not limited already) accept only its first `accepted`
/// receives (tests of a partial post).
#[cfg(test)]
pub(crate) fn refuse_srq_recvs_after(handle: u32, accepted: usize) {
    queue_limit(&SRQ_POST_LIMITS, handle, (accepted, true));
}

/// The limit `refuse_srq_recvs_after` set for this post on SRQ `handle`,
/// if any.
#[cfg(test)]
pub(super) fn take_srq_recv_limit(handle: u32) -> PostLimit {
    take_limit(&SRQ_POST_LIMITS, handle)
}

/// One post's test-only limit (none: it takes its whole list).
#[cfg(test)]
#[derive(Default)]
pub(super) struct PostLimit {
    limit: Option<usize>,
    /// Whether a refusal sets `bad_wr` (rdma-core's providers do; read
    /// only for send lists, and moot without a `limit`).
    says_where: bool,
    accepted: usize,
}

#[cfg(test)]
impl PostLimit {
    /// Whether the post refuses its next request; if not, it is counted
    /// as taken.
    pub(super) fn refuses_next(&mut self) -> bool {
        if self.limit.is_some_and(|limit| self.accepted >= limit) {
            return true;
        }
        self.accepted += 1;
        false
    }

    /// Whether a refusal sets `bad_wr`.
    pub(super) fn says_where(&self) -> bool {
        self.says_where
    }
}
